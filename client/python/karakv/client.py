"""The karakv Python SDK: the same protocol as the C++ SDK (client/client.cc).

Attach maps the session's staging region (a POSIX shared-memory object named in the reply), then
unlinks its name so no other process can open it. Tensors are copied into that region and travel
by offset (StagingRange); arrays that already live in it (Client.alloc) travel without a copy.
A session attached with staging_bytes=0 sends tensors inline in the RPC instead: slower, same
results. Layouts are those documented in proto/karakv/v1/karakv.proto.
"""
from __future__ import annotations

import mmap
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import grpc
import numpy as np

from . import errors
from .v1 import karakv_pb2 as pb
from .v1 import karakv_pb2_grpc as pb_grpc

_DTYPE_NAMES = {pb.DTYPE_FP32: "fp32", pb.DTYPE_FP16: "fp16", pb.DTYPE_BF16: "bf16"}
_DTYPE_PROTO = {v: k for k, v in _DTYPE_NAMES.items()}
_DTYPE_SIZE = {"fp32": 4, "fp16": 2, "bf16": 2}
_ALIGN = 64  # the C++ SDK's staging alignment
_MAX_MESSAGE = 1 << 30  # the daemon's receive/send limit


@dataclass(frozen=True)
class Geometry:
    """The model geometry the daemon serves. dtype is the pool's storage dtype: fp16, bf16 or fp32."""
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "fp16"
    block_size: int = 16

    @staticmethod
    def from_proto(g: pb.Geometry) -> "Geometry":
        return Geometry(g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim,
                        _DTYPE_NAMES.get(g.dtype, "fp16"), g.block_size)

    def to_proto(self) -> pb.Geometry:
        if self.dtype not in _DTYPE_PROTO:
            raise errors.InvalidArgument(f"dtype '{self.dtype}' unknown; expected fp16, bf16 or fp32",
                                         "Geometry")
        return pb.Geometry(num_layers=self.num_layers, num_q_heads=self.num_q_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           dtype=_DTYPE_PROTO[self.dtype], block_size=self.block_size)


@dataclass
class Compaction:
    """One sequence's compaction (or, for a dry run, what it would be). `kept` (dry run only) holds
    the resident positions after compaction, one list per (layer, KV head): index layer * Hk + head."""
    sequence_id: int
    policy: str
    tokens_before: int
    tokens_after: int
    skipped: str = ""
    kept: list = field(default_factory=list)


def health(target: str, timeout: float = 5.0) -> str:
    """grpc.health.v1 Check of the daemon at `target`: 'SERVING', 'NOT_SERVING', ... Raises the
    typed error when the daemon cannot be reached. (Hand-coded: HealthCheckRequest{} is empty and
    the reply is field 1, an enum, so no generated stub is needed.)"""
    names = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
    with grpc.insecure_channel(target) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=lambda _: b"",
                                    response_deserializer=lambda b: b)
        try:
            reply = check(None, timeout=timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "health") from None
    status = 0
    if len(reply) >= 2 and reply[0] == 0x08:  # field 1, varint; the values fit in one byte
        status = reply[1]
    return names.get(status, str(status))


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _to_numpy(x: Any) -> np.ndarray:
    """A C-contiguous numpy array with x's elements (bf16 torch tensors become their uint16 bits)."""
    if _is_torch(x):
        import torch  # only reached when the caller passed a torch tensor
        t = x.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()
    return np.asarray(x)


def _fp32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    return np.where(np.isnan(a), np.uint16(0x7FC0), rounded)


def _storage_array(x: Any, dtype: str, what: str) -> np.ndarray:
    """x in the pool's storage dtype: an array of that dtype, or uint16 raw bits for fp16/bf16, or
    any float array (converted with round to nearest even)."""
    a = _to_numpy(x)
    if dtype == "fp32":
        if a.dtype != np.float32:
            if a.dtype.kind != "f":
                raise errors.InvalidArgument(f"{what} has dtype {a.dtype}, expected float32 (storage fp32)", what)
            a = a.astype(np.float32)
    elif dtype == "fp16":
        if a.dtype == np.uint16:
            a = a.view(np.float16)
        elif a.dtype != np.float16:
            if a.dtype.kind != "f":
                raise errors.InvalidArgument(
                    f"{what} has dtype {a.dtype}, expected float16 (storage fp16), uint16 bits or float32", what)
            a = a.astype(np.float16)
    else:  # bf16
        if a.dtype != np.uint16:
            if a.dtype.kind != "f":
                raise errors.InvalidArgument(
                    f"{what} has dtype {a.dtype}, expected uint16 bfloat16 bits, torch.bfloat16 or float32", what)
            a = _fp32_to_bf16_bits(a.astype(np.float32))
    return np.ascontiguousarray(a)


def _fp32_array(x: Any, what: str) -> np.ndarray:
    a = _to_numpy(x)
    if a.dtype != np.float32:
        if a.dtype.kind != "f":
            raise errors.InvalidArgument(f"{what} has dtype {a.dtype}, expected float32", what)
        a = a.astype(np.float32)
    return np.ascontiguousarray(a)


def _check_shape(a: np.ndarray, want: Sequence[int | None], names: str, what: str) -> tuple:
    """Checks a's shape against `want` (None: any size >= 1); returns the shape."""
    if a.ndim != len(want) or any(w is not None and s != w for s, w in zip(a.shape, want)) or 0 in a.shape:
        shown = ", ".join("*" if w is None else str(w) for w in want)
        raise errors.InvalidArgument(f"{what} has shape {tuple(a.shape)}, expected {names} = ({shown})", what)
    return a.shape


class _Staging:
    """The mapped staging region. Arrays from Client.alloc are bump-allocated from the start (like
    the C++ SDK); each call copies its other tensors to a scratch area after them."""

    def __init__(self, name: str, size: int):
        fd = _shm_open(name)
        try:
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.size = size
        self.bytes = np.frombuffer(self.mm, dtype=np.uint8)
        self.base = self.bytes.ctypes.data
        self.used = 0  # high-water mark of Client.alloc
        self.scratch = 0

    def offset_of(self, a: np.ndarray) -> int | None:
        """a's offset in the region if a is a contiguous array inside it, else None."""
        if not a.flags.c_contiguous:
            return None
        addr = a.__array_interface__["data"][0]
        if self.base <= addr and addr + a.nbytes <= self.base + self.size:
            return addr - self.base
        return None

    def take(self, nbytes: int, what: str) -> int:
        start = (self.scratch + _ALIGN - 1) // _ALIGN * _ALIGN
        if start + nbytes > self.size:
            raise errors.ResourceExhausted(
                f"staging region full: wanted {nbytes} bytes at offset {start}, region holds {self.size} "
                "(attach with a larger staging_bytes, or reset_staging())", what)
        self.scratch = start + nbytes
        return start

    def close(self) -> None:
        self.bytes = None
        try:
            self.mm.close()
        except BufferError:
            pass  # the caller still holds arrays from alloc(); the mapping goes with them


def _shm_open(name: str) -> int:
    """shm_open(name, O_RDWR): CPython's own binding when present, else the Linux path of it."""
    try:
        import _posixshmem  # what multiprocessing.shared_memory uses, without its resource tracker
        return _posixshmem.shm_open(name, os.O_RDWR, mode=0)
    except ImportError:
        return os.open("/dev/shm/" + name.lstrip("/"), os.O_RDWR)


def _shm_unlink(name: str) -> None:
    try:
        import _posixshmem
        _posixshmem.shm_unlink(name)
    except ImportError:
        os.unlink("/dev/shm/" + name.lstrip("/"))


class Client:
    """A session with karakvd. Make one with Client.attach(...); close() (or `with`) detaches.

    Calls are serialized by a lock (they share the staging scratch area); use one Client per
    thread for parallel calls.
    """

    def __init__(self):  # use Client.attach
        self._channel = None
        self._stub = None
        self._staging: _Staging | None = None
        self._attached = False
        self._lock = threading.RLock()  # re-entered when a call under it re-attaches
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._auto_reattach = False
        self._reattach_timeout = 30.0
        # Sequence ids this client got from the current daemon instance, and those lost with
        # earlier instances (never handed out again by this client: an old id never names new data).
        self._live: set[int] = set()
        self._lost: set[int] = set()

    # ----------------------------------------------------------------------------- session
    @classmethod
    def attach(cls, target: str = "unix:/tmp/karakv.sock", *, worker_id: str = "worker",
               tenant: str = "default", staging_bytes: int = 64 << 20,
               geometry: Geometry | None = None, heartbeat: bool = True,
               rpc_timeout: float = 60.0, auto_reattach: bool = True,
               reattach_timeout: float = 30.0) -> "Client":
        """Attaches to the daemon at `target` ("unix:/path" or "host:port"). With `geometry` set,
        the daemon refuses the session unless it serves exactly that geometry. With `heartbeat`, a
        background thread sends Heartbeat every lease/3 so the lease never runs out while attached.

        With `auto_reattach`, a call that finds karakvd restarted attaches again by itself (as
        reattach(), for up to `reattach_timeout` seconds): a call naming a sequence of the old
        instance raises DaemonRestarted (create it again and re-prefill), any other call is repeated
        on the new session. Without it, every call raises DaemonRestarted until reattach()."""
        self = cls()
        self._timeout = rpc_timeout
        self._auto_reattach = auto_reattach
        self._reattach_timeout = reattach_timeout
        self._attach_args = dict(target=target, worker_id=worker_id, tenant=tenant, staging_bytes=staging_bytes,
                                 geometry=geometry, heartbeat=heartbeat, rpc_timeout=rpc_timeout,
                                 auto_reattach=auto_reattach, reattach_timeout=reattach_timeout)
        options = [("grpc.max_receive_message_length", _MAX_MESSAGE),
                   ("grpc.max_send_message_length", _MAX_MESSAGE)]
        self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.KaraKVStub(self._channel)
        req = pb.AttachRequest(worker_id=worker_id, tenant=tenant, staging_bytes=staging_bytes)
        if geometry is not None:
            req.geometry.CopyFrom(geometry.to_proto())
        try:
            reply = self._call("Attach", req)
        except BaseException:
            self._channel.close()
            self._channel = self._stub = None
            raise
        self.session_id = reply.session_id
        self.instance_id = reply.instance_id  # random per karakvd start: a change means a restart
        self.geometry = Geometry.from_proto(reply.geometry)
        self.lease_seconds = reply.lease_seconds
        self.staging_name = reply.staging_name
        self._attached = True
        try:
            if reply.staging_name:
                try:
                    self._staging = _Staging(reply.staging_name, reply.staging_bytes)
                except OSError as e:
                    raise errors.FailedPrecondition(
                        f"cannot open staging region {reply.staging_name}: {e.strerror} (is the worker on "
                        "the same host, as the same user, sharing /dev/shm with karakvd?)", "Attach") from None
                # Both sides have it mapped now; removing the name means no other process can open it.
                _shm_unlink(reply.staging_name)
        except BaseException:
            self.close()
            raise
        if heartbeat and self.lease_seconds > 0:
            period = self.lease_seconds / 3.0
            self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, args=(period,),
                                                      name="karakv-heartbeat", daemon=True)
            self._heartbeat_thread.start()
        return self

    def _heartbeat_loop(self, period: float) -> None:
        while not self._stop_heartbeat.wait(period):
            try:
                self._stub.Heartbeat(pb.HeartbeatRequest(session_id=self.session_id), timeout=self._timeout)
            except grpc.RpcError:
                pass  # the next call of the worker reports the problem with its own status

    def _stop_heartbeats(self) -> None:
        self._stop_heartbeat.set()
        if self._heartbeat_thread is not None and self._heartbeat_thread is not threading.current_thread():
            self._heartbeat_thread.join()
        self._heartbeat_thread = None

    def detach(self) -> int:
        """Frees everything the session owns in the daemon; returns how many sequences it released.
        Later calls fail with NotFound."""
        if not self._attached:
            raise errors.FailedPrecondition("not attached", "Detach")
        self._attached = False
        self._stop_heartbeats()
        return self._call("Detach", pb.DetachRequest(session_id=self.session_id)).sequences_released

    def close(self) -> None:
        """Detaches (best effort), unmaps the staging region and closes the channel."""
        if self._attached:
            try:
                self.detach()
            except errors.KaraKVError:
                pass
        self._stop_heartbeats()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def reattach(self, timeout: float = 30.0, initial_backoff: float = 0.1, max_backoff: float = 5.0) -> None:
        """After DaemonRestarted (or any loss of the session): attaches again with the same options,
        retrying with exponential backoff (x2 per attempt, +-20% jitter) until `timeout` seconds
        have passed. The new session has a new staging region: arrays from the old alloc() stay
        readable and can still be passed to calls (they are then sent inline, not through staging);
        alloc() again for the fast path. Sequences are not restored; create them again and
        re-prefill: calls naming an old sequence raise DaemonRestarted."""
        # Lost with the old session whether or not attaching again succeeds.
        self._lost |= self._live
        self._live = set()
        deadline = time.monotonic() + timeout
        delay = initial_backoff
        while True:
            try:
                fresh = Client.attach(**{**self._attach_args, "heartbeat": False})
                break
            except errors.Unavailable:
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, max_backoff)
        old_staging, old_channel = self._staging, self._channel
        self._attached = False
        self._stop_heartbeats()
        with self._lock:
            for name in ("_channel", "_stub", "_staging", "_attached", "session_id", "instance_id", "geometry",
                         "lease_seconds", "staging_name"):
                setattr(self, name, getattr(fresh, name))
            # `fresh` only lent its session: its own close() must not detach or unmap anything.
            fresh._attached = False
            fresh._staging = fresh._channel = fresh._stub = None
        if old_staging is not None:
            old_staging.close()
        if old_channel is not None:
            old_channel.close()
        if self._attach_args["heartbeat"] and self.lease_seconds > 0:
            self._stop_heartbeat = threading.Event()
            self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, args=(self.lease_seconds / 3.0,),
                                                      name="karakv-heartbeat", daemon=True)
            self._heartbeat_thread.start()

    def heartbeat(self) -> int:
        """Renews the lease now; returns the lease in seconds."""
        return self._call("Heartbeat", pb.HeartbeatRequest(session_id=self.session_id)).lease_seconds

    def ping(self) -> None:
        self._call("Ping", pb.PingRequest())

    @property
    def staging_bytes(self) -> int:
        return self._staging.size if self._staging else 0

    # ----------------------------------------------------------------------------- staging
    def alloc(self, shape: Sequence[int] | int, dtype: Any = np.float32) -> np.ndarray:
        """A zeroed array inside the staging region (64-byte aligned). Passing it to a call sends it
        by offset without a copy; passing it as `out=` makes the daemon write the result into it.
        ResourceExhausted when the region is full or absent; reset_staging() frees every one."""
        dt = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        st = self._staging
        start = 0 if st is None else (st.used + _ALIGN - 1) // _ALIGN * _ALIGN
        if st is None or start + nbytes > st.size:
            raise errors.ResourceExhausted(
                f"staging region full: wanted {nbytes} bytes at offset {start}, region holds "
                f"{self.staging_bytes} (attach with a larger staging_bytes, or reset_staging())", "alloc")
        st.used = start + nbytes
        a = st.bytes[start:start + nbytes].view(dt).reshape(shape)
        a[...] = 0
        return a

    def reset_staging(self) -> None:
        """Makes the whole region available again (arrays from alloc() must no longer be used)."""
        if self._staging is not None:
            self._staging.used = 0

    def _begin(self) -> None:
        if self._staging is not None:
            self._staging.scratch = self._staging.used

    def _input(self, a: np.ndarray, ref: pb.TensorRef, what: str) -> None:
        st = self._staging
        if st is None:
            ref.data = a.tobytes()
            return
        offset = st.offset_of(a)
        if offset is None:
            offset = st.take(a.nbytes, what)
            st.bytes[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        ref.staging.offset = offset
        ref.staging.length = a.nbytes

    def _output(self, out: Any, nbytes: int, ref: pb.OutputRef, what: str):
        """Where the daemon writes an fp32 output: the caller's staging array `out`, or scratch
        staging (read back after the call), or inline (no staging region). Returns the offset."""
        st = self._staging
        if out is not None:
            if not isinstance(out, np.ndarray) or out.dtype != np.float32 or st is None \
                    or st.offset_of(out) is None or out.nbytes != nbytes:
                raise errors.InvalidArgument(
                    f"out must be a float32 array of {nbytes} bytes from Client.alloc", what)
            offset = st.offset_of(out)
        elif st is None:
            return None
        else:
            offset = st.take(nbytes, what)
        ref.staging.offset = offset
        ref.staging.length = nbytes
        return offset

    def _read_output(self, offset, inline: bytes, shape: tuple, out: Any) -> np.ndarray:
        if out is not None:
            return out
        if offset is None:
            return np.frombuffer(inline, dtype=np.float32).reshape(shape).copy()
        n = int(np.prod(shape)) * 4
        return self._staging.bytes[offset:offset + n].view(np.float32).reshape(shape).copy()

    # ----------------------------------------------------------------------------- sequences
    def create_sequence(self, policy: str = "none", *, params: dict | None = None,
                        prefill_policy: str = "", prefill_params: dict | None = None,
                        storage: str = "", priority: int = 0) -> int:
        """A new sequence compressed by `policy` (none, kara, snapkv, streaming, h2o, chunkkv; or
        with a storage format, "kara+kivi4"); params override the documented defaults by name."""
        req = pb.CreateSequenceRequest(session_id=self.session_id, policy=policy, priority=priority,
                                       prefill_policy=prefill_policy, storage=storage)
        for k, v in (params or {}).items():
            req.params[k] = float(v)
        for k, v in (prefill_params or {}).items():
            req.prefill_params[k] = float(v)
        while True:
            sequence_id = self._call("CreateSequence", req).sequence_id
            if self._take_id(sequence_id):
                return sequence_id
            req.session_id = self.session_id

    def _take_id(self, sequence_id: int) -> bool:
        """Records an id the daemon handed out. False when this client had a sequence with that id
        before a restart: the new one is released (the caller asks again)."""
        if sequence_id not in self._lost:
            self._live.add(sequence_id)
            return True
        self._call("ReleaseSequence", pb.ReleaseSequenceRequest(session_id=self.session_id,
                                                                sequence_id=sequence_id), check_lost=False)
        return False

    def fork(self, sequence_id: int) -> int:
        """A child sequence sharing the parent's blocks (copy on write)."""
        while True:
            child = self._call("ForkSequence", pb.ForkSequenceRequest(session_id=self.session_id,
                                                                      sequence_id=sequence_id)).sequence_id
            if self._take_id(child):
                return child

    def release(self, sequence_id: int) -> int:
        """Releases the sequence; returns how many blocks went back to the pool."""
        freed = self._call("ReleaseSequence", pb.ReleaseSequenceRequest(
            session_id=self.session_id, sequence_id=sequence_id)).blocks_freed
        self._live.discard(sequence_id)
        return freed

    # ----------------------------------------------------------------------------- tensors
    def append(self, sequence_id: int, k: Any, v: Any, q: Any = None) -> int:
        """Appends T tokens: k, v [L][T][Hk][D] in the storage dtype; optional q [L][Nq][Hq][D]
        float32, the queries of the last Nq tokens. Returns the sequence length after the append."""
        g = self.geometry
        ka = _storage_array(k, g.dtype, "Append.k")
        va = _storage_array(v, g.dtype, "Append.v")
        _, t, _, _ = _check_shape(ka, (g.num_layers, None, g.num_kv_heads, g.head_dim), "[L][T][Hk][D]", "Append.k")
        _check_shape(va, ka.shape, "[L][T][Hk][D] like k", "Append.v")
        req = pb.AppendRequest(session_id=self.session_id, sequence_id=sequence_id, num_tokens=t)
        with self._lock:
            self._begin()
            self._input(ka, req.k, "Append.k")
            self._input(va, req.v, "Append.v")
            if q is not None:
                qa = _fp32_array(q, "Append.q")
                _, nq, _, _ = _check_shape(qa, (g.num_layers, None, g.num_q_heads, g.head_dim),
                                           "[L][Nq][Hq][D]", "Append.q")
                self._input(qa, req.q, "Append.q")
                req.num_query_tokens = nq
            return self._call("Append", req).length

    def step(self, layer: int, sequence_ids: Iterable[int], k: Any, v: Any, q: Any,
             scale: float = 0.0, out: np.ndarray | None = None):
        """One decode step of one layer for a batch of B sequences: k, v [B][Hk][D] storage dtype,
        q [B][Hq][D] float32. Returns the attention output [B][Hq][D] float32 (a torch tensor when
        q is one; `out` when given). Layers of a step go 0..L-1. The daemon's decode-step counter
        after the call is in self.last_decode_step."""
        g = self.geometry
        ids = [int(s) for s in sequence_ids]
        b = len(ids)
        ka = _storage_array(k, g.dtype, "Step.k")
        va = _storage_array(v, g.dtype, "Step.v")
        qa = _fp32_array(q, "Step.q")
        _check_shape(ka, (b, g.num_kv_heads, g.head_dim), "[B][Hk][D]", "Step.k")
        _check_shape(va, (b, g.num_kv_heads, g.head_dim), "[B][Hk][D]", "Step.v")
        _check_shape(qa, (b, g.num_q_heads, g.head_dim), "[B][Hq][D]", "Step.q")
        req = pb.StepRequest(session_id=self.session_id, layer=layer, sequence_ids=ids, scale=scale)
        shape = (b, g.num_q_heads, g.head_dim)
        with self._lock:
            self._begin()
            self._input(ka, req.k, "Step.k")
            self._input(va, req.v, "Step.v")
            self._input(qa, req.q, "Step.q")
            offset = self._output(out, b * g.num_q_heads * g.head_dim * 4, req.out, "Step.out")
            reply = self._call("Step", req)
            self.last_decode_step = reply.decode_step
            result = self._read_output(offset, reply.out, shape, out)
        return self._like(q, result) if out is None else result

    def attend(self, sequence_id: int, layer: int, q: Any, scale: float = 0.0,
               out: np.ndarray | None = None):
        """Attention of N queries [N][Hq][D] float32 over the cached sequence without appending;
        query i sits at position length - N + i (causal). Returns [N][Hq][D] float32."""
        g = self.geometry
        qa = _fp32_array(q, "Attend.q")
        n, _, _ = _check_shape(qa, (None, g.num_q_heads, g.head_dim), "[N][Hq][D]", "Attend.q")
        req = pb.AttendRequest(session_id=self.session_id, sequence_id=sequence_id, layer=layer,
                               num_queries=n, scale=scale)
        with self._lock:
            self._begin()
            self._input(qa, req.q, "Attend.q")
            offset = self._output(out, n * g.num_q_heads * g.head_dim * 4, req.out, "Attend.out")
            reply = self._call("Attend", req)
            result = self._read_output(offset, reply.out, (n, g.num_q_heads, g.head_dim), out)
        return self._like(q, result) if out is None else result

    def read_kv(self, sequence_id: int, as_torch: bool = False):
        """The sequence's resident cache: (k, v, positions) with k, v [L][T][Hk][D] in the storage
        dtype (uint16 bits for bf16) and positions [L][Hk][T] int32, each token's position in the
        sequence's history. Through staging, the whole free scratch area is offered to the daemon."""
        g = self.geometry
        es = _DTYPE_SIZE[g.dtype]
        row = g.num_layers * g.num_kv_heads
        req = pb.ReadKVRequest(session_id=self.session_id, sequence_id=sequence_id)
        with self._lock:
            self._begin()
            st = self._staging
            if st is not None:
                per_token = 2 * row * g.head_dim * es + row * 4
                room = st.size - st.scratch - 3 * _ALIGN
                cap = max(room // per_token, 0)
                offsets = []
                for ref, nbytes, what in ((req.k, cap * row * g.head_dim * es, "ReadKV.k"),
                                          (req.v, cap * row * g.head_dim * es, "ReadKV.v"),
                                          (req.positions, cap * row * 4, "ReadKV.positions")):
                    offsets.append(st.take(nbytes, what))
                    ref.staging.offset = offsets[-1]
                    ref.staging.length = nbytes
            reply = self._call("ReadKV", req)
            t = reply.num_tokens
            kv_bytes = row * t * g.head_dim * es
            if st is not None:
                kb = st.bytes[offsets[0]:offsets[0] + kv_bytes].copy()
                vb = st.bytes[offsets[1]:offsets[1] + kv_bytes].copy()
                pbytes = st.bytes[offsets[2]:offsets[2] + row * t * 4].copy()
            else:
                kb = np.frombuffer(reply.k, dtype=np.uint8)[:kv_bytes].copy()
                vb = np.frombuffer(reply.v, dtype=np.uint8)[:kv_bytes].copy()
                pbytes = np.frombuffer(reply.positions, dtype=np.uint8)[:row * t * 4].copy()
        elem = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}[g.dtype]
        shape = (g.num_layers, t, g.num_kv_heads, g.head_dim)
        k = kb.view(elem).reshape(shape)
        v = vb.view(elem).reshape(shape)
        positions = pbytes.view(np.int32).reshape(g.num_layers, g.num_kv_heads, t)
        if as_torch:
            import torch
            conv = (lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)) \
                if g.dtype == "bf16" else torch.from_numpy
            return conv(k), conv(v), torch.from_numpy(positions)
        return k, v, positions

    @staticmethod
    def _like(q: Any, result: np.ndarray):
        if _is_torch(q):
            import torch
            return torch.from_numpy(result)
        return result

    # ----------------------------------------------------------------------------- control
    def compact(self, sequence_id: int = 0, dry_run: bool = False) -> list:
        """Runs the policy of `sequence_id` (0: every sequence of this session) now; dry_run changes
        nothing and returns the positions that would stay."""
        reply = self._call("Compact", pb.CompactRequest(session_id=self.session_id, sequence_id=sequence_id,
                                                       dry_run=dry_run))
        return [Compaction(c.sequence_id, c.policy, c.tokens_before, c.tokens_after, c.skipped,
                           [list(h.positions) for h in c.kept]) for c in reply.sequences]

    def stats(self, check_invariants: bool = False) -> pb.StatsReply:
        """The daemon's StatsReply (fields as in karakv.proto)."""
        return self._call("Stats", pb.StatsRequest(check_invariants=check_invariants))

    def list_sequences(self) -> list:
        """This session's sequences (karakv.proto SequenceInfo messages)."""
        return list(self._call("ListSequences", pb.ListSequencesRequest(session_id=self.session_id)).sequences)

    def _call(self, method: str, request, check_lost: bool = True):
        if self._stub is None:
            raise errors.FailedPrecondition("the client is closed", method)
        if check_lost:
            self._check_lost(method, request)
        rpc = getattr(self._stub, "ForkSequence" if method == "Fork" else method)
        try:
            return rpc(request, timeout=self._timeout)
        except grpc.RpcError as e:
            err = errors.from_rpc_error(e, method)
        # An unknown session may mean karakvd restarted (everything of this session is gone) rather
        # than an expired lease: the instance id tells them apart.
        if not (isinstance(err, errors.NotFound) and "session" in err.message and self._restarted()):
            raise err from None
        gone = (f"karakvd instance {self.instance_id} is gone, every sequence of session {self.session_id} "
                "with it")
        # Detach of a session the restart already ended has nothing left to do on a new one.
        if not self._auto_reattach or method == "Detach" or threading.current_thread() is self._heartbeat_thread:
            raise errors.DaemonRestarted(
                f"the daemon restarted; re-prefill ({gone}; Client.reattach() opens a new session) [{err.message}]",
                method) from None
        self.reattach(timeout=self._reattach_timeout)
        if check_lost:
            self._check_lost(method, request)
        # Names no sequence (CreateSequence, ListSequences, Compact of all ...): the same call on the
        # new session.
        if "session_id" in request.DESCRIPTOR.fields_by_name:
            request.session_id = self.session_id
        rpc = getattr(self._stub, "ForkSequence" if method == "Fork" else method)
        try:
            return rpc(request, timeout=self._timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, method) from None

    def _check_lost(self, method: str, request) -> None:
        """Raises DaemonRestarted when `request` names a sequence lost with an earlier instance."""
        if not self._lost:
            return
        fields = request.DESCRIPTOR.fields_by_name
        ids = list(request.sequence_ids) if "sequence_ids" in fields else []
        if "sequence_id" in fields:
            ids.append(request.sequence_id)
        for sid in ids:
            if sid in self._lost and sid not in self._live:
                raise errors.DaemonRestarted(
                    f"sequence {sid} was lost: the daemon restarted; re-prefill (karakvd at "
                    f"{self._attach_args['target']} restarted and holds none of this client's earlier sequences; "
                    f"this client re-attached as session {self.session_id}: create a new sequence and append the "
                    "prompt again)", method)

    def _restarted(self) -> bool:
        if not getattr(self, "instance_id", ""):
            return False
        try:
            reply = self._stub.Ping(pb.PingRequest(), timeout=self._timeout)
        except grpc.RpcError:
            return False
        return reply.instance_id != self.instance_id
