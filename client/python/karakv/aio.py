"""The asyncio client of karakvd, on grpc.aio: the same session, calls, errors, staging region,
fast path, TLS options and re-attach behaviour as karakv.Client, with every call a coroutine.

    import karakv.aio
    async with karakv.aio.Client.attach("unix:/run/karakv/karakv.sock") as c:
        seq = await c.create_sequence("kara")
        await c.append(seq, k, v)
        out = await c.step(0, [seq], k1, v1, q1)
        async for event in await c.watch_events(): ...

Calls that move tensors take an asyncio.Lock (they share the staging scratch area and the ring);
other calls run concurrently. The heartbeat is a task on the client's event loop. On the fast
path the ring's short spin yields to the event loop and its futex sleeps run in the loop's
default executor, so a waiting Step never blocks other tasks.
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Iterable, Optional

import grpc
import grpc.aio
import numpy as np

from . import _ring
from . import errors
from .client import (CHANNEL_OPTIONS, CreatedSequence, Event, Geometry, Inspection, Op, _ADOPTED, _Session,
                     _event)
from .v1 import karakv_pb2 as pb
from .v1 import karakv_pb2_grpc as pb_grpc

__all__ = ["Client", "EventStream"]


class EventStream:
    """A session's event stream (Client.watch_events): `async for event in stream`. Iteration ends
    when the stream does (after "session_ended", when the daemon drains, or after cancel());
    finish() then says how. `async with` cancels it on exit."""

    def __init__(self, call):
        self._call = call
        self._ended = False

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> Event:
        while not self._ended:
            try:
                message = await self._call.read()
            except (grpc.RpcError, asyncio.CancelledError):
                if not self._call.cancelled() and not self._call.done():
                    raise
                self._ended = True
                break
            if message is grpc.aio.EOF:
                self._ended = True
                break
            event = _event(message)
            if event is not None:  # a kind newer than this SDK is skipped
                return event
        raise StopAsyncIteration

    def cancel(self) -> None:
        self._call.cancel()

    async def finish(self) -> Optional[errors.KaraKVError]:
        """None when the stream ended OK (after "session_ended"), else the typed error that ended it
        (Unavailable when the daemon drains, Cancelled after cancel())."""
        code = await self._call.code()
        if code == grpc.StatusCode.OK:
            return None
        return errors.from_code(code.name, await self._call.details() or "", "WatchEvents")

    async def __aenter__(self) -> "EventStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class _Attaching:
    """What Client.attach returns: await it for the client, or `async with` it to close on exit."""

    def __init__(self, make):
        self._make = make
        self._client: Optional[Client] = None

    def __await__(self):
        return self._make().__await__()

    async def __aenter__(self) -> "Client":
        self._client = await self._make()
        return self._client

    async def __aexit__(self, *exc) -> None:
        if self._client is not None:
            await self._client.close()


class Client(_Session):
    """An asyncio session with karakvd: `c = await Client.attach(...)` or
    `async with Client.attach(...) as c`; `await c.close()` detaches. Options, methods and errors
    as karakv.Client's."""

    def __init__(self):  # use Client.attach
        self._init_state()
        self._lock = asyncio.Lock()
        self._heartbeat_task: Optional[asyncio.Task] = None

    @classmethod
    def attach(cls, target: Optional[str] = None, **options: Any) -> _Attaching:
        """As karakv.Client.attach (same keyword options), on a grpc.aio channel."""
        return _Attaching(lambda: cls._attach(target, **options))

    @classmethod
    async def _attach(cls, target: Optional[str] = None, *, worker_id: str = "worker", tenant: str = "default",
                      staging_bytes: int = 64 << 20, geometry: Optional[Geometry] = None, heartbeat: bool = True,
                      rpc_timeout: float = 60.0, auto_reattach: bool = True, reattach_timeout: float = 30.0,
                      cache_namespace: str = "", fast_path: bool = False, ring_spin: float = 50e-6,
                      ring_full_wait: float = 1e-3, tls: bool = False, tls_ca_file: str = "",
                      tls_cert_file: str = "", tls_key_file: str = "", model_fingerprint: str = "") -> "Client":
        self = cls()
        creds = self._configure(target, worker_id, tenant, staging_bytes, geometry, heartbeat, rpc_timeout,
                                auto_reattach, reattach_timeout, cache_namespace, fast_path, ring_spin,
                                ring_full_wait, tls, tls_ca_file, tls_cert_file, tls_key_file, model_fingerprint)
        if creds is not None:
            self._channel = grpc.aio.secure_channel(self.target, creds, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KaraKVStub(self._channel)
        try:
            reply = await self._call("Attach", self._attach_request)
        except BaseException:
            await self._channel.close()
            self._channel = self._stub = None
            raise
        try:
            self._adopt(reply)
        except BaseException:
            await self.close()
            raise
        if heartbeat and self.lease_seconds > 0:
            self._start_heartbeats()
        return self

    def _start_heartbeats(self) -> None:
        self._heartbeat_task = asyncio.get_running_loop().create_task(
            self._heartbeat_loop(self.lease_seconds / 3.0), name="karakv-heartbeat")

    async def _heartbeat_loop(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await self._stub.Heartbeat(pb.HeartbeatRequest(session_id=self.session_id), timeout=self._timeout)
            except grpc.RpcError:
                pass  # the next call reports the problem with its own status
            except AttributeError:
                return  # closed meanwhile

    async def _stop_heartbeats(self) -> None:
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def detach(self) -> int:
        """Frees everything the session owns in the daemon; returns how many sequences it released."""
        if not self._attached:
            raise errors.FailedPrecondition("not attached", "Detach")
        self._attached = False
        await self._stop_heartbeats()
        return (await self._call("Detach", pb.DetachRequest(session_id=self.session_id))).sequences_released

    async def close(self) -> None:
        """Detaches (best effort), unmaps the staging region and closes the channel."""
        if self._attached:
            try:
                await self.detach()
            except errors.KaraKVError:
                pass
        await self._stop_heartbeats()
        self._unmap()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def reattach(self, timeout: float = 30.0, initial_backoff: float = 0.1, max_backoff: float = 5.0) -> None:
        """As karakv.Client.reattach: a new session with the same options; old sequences stay lost."""
        self._lost |= self._live
        self._live = set()
        deadline = time.monotonic() + timeout
        delay = initial_backoff
        while True:
            try:
                fresh = await Client._attach(**{**self._attach_args, "heartbeat": False})
                break
            except errors.Unavailable:
                if time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, max_backoff)
        old_ring, old_staging, old_channel = self._ring, self._staging, self._channel
        await self._stop_heartbeats()
        for name in _ADOPTED:
            setattr(self, name, getattr(fresh, name))
        fresh._attached = False
        fresh._ring = fresh._staging = fresh._channel = fresh._stub = None
        if old_ring is not None:
            old_ring.release()
        if old_staging is not None:
            old_staging.close()
        if old_channel is not None:
            await old_channel.close()
        if self._attach_args["heartbeat"] and self.lease_seconds > 0:
            self._start_heartbeats()

    # ----------------------------------------------------------------------------- calls
    async def _run(self, op: Op, staging: bool = False):
        if staging:
            async with self._lock:
                return await self._drive(op)
        return await self._drive(op)

    async def _drive(self, op: Op):
        try:
            rpc = next(op)
            while True:
                rpc = op.send(await self._call(rpc.method, rpc.request, rpc.check_lost))
        except StopIteration as done:
            return done.value

    async def create_sequence(self, policy: str = "none", *, params: Optional[dict] = None,
                              prefill_policy: str = "", prefill_params: Optional[dict] = None,
                              storage: str = "", priority: int = 0) -> int:
        req = self._create_request(policy, params, prefill_policy, prefill_params, storage, priority)
        return (await self._run(self._op_create(req))).id

    async def create_from_prefix(self, prompt_token_ids: Any, policy: str = "none", *,
                                 params: Optional[dict] = None, prefill_policy: str = "",
                                 prefill_params: Optional[dict] = None, storage: str = "",
                                 priority: int = 0) -> CreatedSequence:
        req = self._create_request(policy, params, prefill_policy, prefill_params, storage, priority,
                                   prompt_token_ids)
        return await self._run(self._op_create(req))

    async def lookup(self, prompt_token_ids: Any) -> int:
        return await self._run(self._op_lookup(prompt_token_ids))

    async def fork(self, sequence_id: int) -> int:
        return await self._run(self._op_fork(sequence_id))

    async def release(self, sequence_id: int) -> int:
        return await self._run(self._op_release(sequence_id))

    async def append(self, sequence_id: int, k: Any, v: Any, q: Any = None, token_ids: Any = None) -> int:
        return await self._run(self._op_append(sequence_id, k, v, q, token_ids), staging=True)

    async def append_batch(self, entries: Iterable[Any]) -> list:
        return await self._run(self._op_append_batch(entries), staging=True)

    async def step(self, layer: int, sequence_ids: Iterable[int], k: Any, v: Any, q: Any, scale: float = 0.0,
                   out: Optional[np.ndarray] = None):
        return await self._run(self._op_step(layer, sequence_ids, k, v, q, scale, out), staging=True)

    async def attend(self, sequence_id: int, layer: int, q: Any, scale: float = 0.0,
                     out: Optional[np.ndarray] = None):
        return await self._run(self._op_attend(sequence_id, layer, q, scale, out), staging=True)

    async def read_kv(self, sequence_id: int, as_torch: bool = False):
        return await self._run(self._op_read_kv(sequence_id, as_torch), staging=True)

    async def compact(self, sequence_id: int = 0, dry_run: bool = False) -> list:
        return await self._run(self._op_compact(sequence_id, dry_run))

    async def inspect(self, sequence_id: int) -> Inspection:
        return await self._run(self._op_inspect(sequence_id))

    async def stats(self, check_invariants: bool = False) -> pb.StatsReply:
        return await self._run(self._op_simple("Stats", pb.StatsRequest(check_invariants=check_invariants),
                                               lambda r: r))

    async def list_sequences(self) -> list:
        return await self._run(self._op_simple("ListSequences", pb.ListSequencesRequest(session_id=self.session_id),
                                               lambda r: list(r.sequences)))

    async def heartbeat(self) -> int:
        return await self._run(self._op_simple("Heartbeat", pb.HeartbeatRequest(session_id=self.session_id),
                                               lambda r: r.lease_seconds))

    async def ping(self) -> None:
        await self._run(self._op_simple("Ping", pb.PingRequest(), lambda r: None))

    async def watch_events(self) -> EventStream:
        """This session's events from now on; returns once the daemon has subscribed the stream,
        raises the typed error when it refused (NotFound for an unknown session)."""
        if self._stub is None:
            raise errors.FailedPrecondition("the client is closed", "WatchEvents")
        call = self._stub.WatchEvents(pb.WatchEventsRequest(session_id=self.session_id))
        await call.initial_metadata()
        if call.done():
            code = await call.code()
            if code != grpc.StatusCode.OK:
                raise errors.from_code(code.name, await call.details() or "", "WatchEvents")
        return EventStream(call)

    # ----------------------------------------------------------------------------- transport
    async def _invoke(self, method: str, request):
        if self._ring is not None and self._ring.usable:
            cmd = _ring.command(method, request, getattr(self, "_ring_ids", None))
            if cmd is not None and self._ring.takes(cmd.op):
                reply = await self._ring_call(method, cmd)
                if reply is not None:
                    return reply
        try:
            return await getattr(self._stub, method)(request, timeout=self._timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, method) from None

    async def _ring_call(self, method: str, cmd: _ring.Command):
        ring = self._ring
        assert ring is not None  # _invoke checked it
        steps = ring.call(cmd, time.monotonic() + self._timeout, self._ring_full_wait)
        loop = asyncio.get_running_loop()
        try:
            step = next(steps)
            while True:
                answer = None
                if step == _ring.SPIN:
                    await asyncio.sleep(0)
                elif step == _ring.ALIVE:
                    answer = await self._liveness()
                elif isinstance(step, _ring.Wait):
                    await loop.run_in_executor(None, _ring.futex_wait, step.address, step.expected, step.timeout_ns)
                step = steps.send(answer)
        except StopIteration as done:
            completion = done.value
        except _ring.Lost:
            return None
        except _ring.Broken as e:
            raise errors.from_code(e.code, e.message, method) from None
        return self._ring_reply(method, completion)

    async def _liveness(self) -> Optional[str]:
        try:
            return self._gone_reason(await self._stub.Ping(pb.PingRequest(), timeout=1.0), None)
        except grpc.RpcError as e:
            return self._gone_reason(None, e)

    async def _call(self, method: str, request, check_lost: bool = True):
        if self._stub is None:
            raise errors.FailedPrecondition("the client is closed", method)
        if check_lost:
            self._check_lost(method, request)
        try:
            return await self._invoke(method, request)
        except errors.NotFound as e:
            err = e
        if not ("session" in err.message and await self._restarted()):
            raise err
        if not self._auto_reattach or method == "Detach":
            raise self._restarted_error(err, method) from None
        await self.reattach(timeout=self._reattach_timeout)
        if check_lost:
            self._check_lost(method, request)
        if "session_id" in request.DESCRIPTOR.fields_by_name:
            request.session_id = self.session_id
        return await self._invoke(method, request)

    async def _restarted(self) -> bool:
        if not self.instance_id:
            return False
        try:
            reply = await self._stub.Ping(pb.PingRequest(), timeout=self._timeout)
        except grpc.RpcError:
            return False
        return reply.instance_id != self.instance_id
