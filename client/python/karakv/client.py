"""The karakv Python SDK: the same protocol as the C++ SDK (client/client.cc).

Attach maps the session's staging region (a POSIX shared-memory object named in the reply), then
unlinks its name so no other process can open it. Tensors are copied into that region and travel
by offset (StagingRange); arrays that already live in it (Client.alloc) are views of the mapping
and travel without a copy. A session attached with staging_bytes=0 sends tensors inline in the RPC
instead: slower, same results. With fast_path, Step, Attend, Append and ReadKV go through the shared-memory
command ring after the staging region (karakv/_ring.py) instead of a gRPC round trip. Layouts are
those documented in proto/karakv/v1/karakv.proto.

Every call is written once, as a generator of the RPCs it needs (the `_op_*` methods of
_Session); Client runs them blocking and karakv.aio.Client awaits them on grpc.aio.
"""
from __future__ import annotations

import mmap
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Generator, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import grpc
import numpy as np

from . import _ring
from . import errors
from .v1 import karakv_pb2 as pb
from .v1 import karakv_pb2_grpc as pb_grpc

_DTYPE_NAMES = {pb.DTYPE_FP32: "fp32", pb.DTYPE_FP16: "fp16", pb.DTYPE_BF16: "bf16"}
_DTYPE_PROTO = {v: k for k, v in _DTYPE_NAMES.items()}
_DTYPE_SIZE = {"fp32": 4, "fp16": 2, "bf16": 2}
_ALIGN = 64  # the C++ SDK's staging alignment
_MAX_MESSAGE = 1 << 30  # the daemon's receive/send limit
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", _MAX_MESSAGE),
                   ("grpc.max_send_message_length", _MAX_MESSAGE)]

# Where a client connects when no target is given and $KARAKV_TARGET is unset or empty.
DEFAULT_TARGET = "unix:/tmp/karakv.sock"
TARGET_ENV = "KARAKV_TARGET"


def default_target(target: Optional[str] = None) -> str:
    """`target` when given, else $KARAKV_TARGET (the Helm chart sets it in worker containers), else
    unix:/tmp/karakv.sock."""
    return target or os.environ.get(TARGET_ENV) or DEFAULT_TARGET


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
    the resident positions after compaction, one list per (layer, KV head): index layer * Hk + head.
    `params`: the policy's parameters as the daemon resolved them (defaults filled in)."""
    sequence_id: int
    policy: str
    tokens_before: int
    tokens_after: int
    skipped: str = ""
    kept: list = field(default_factory=list)
    params: dict = field(default_factory=dict)


class CreatedSequence(NamedTuple):
    """A sequence created from the prefix cache: it already holds `cached_tokens` tokens (whole
    blocks); append the rest of the prompt from token cached_tokens on, with their ids."""
    id: int
    cached_tokens: int


@dataclass
class Inspection:
    """Operator view of one sequence (Inspect): `info` is its karakv.proto SequenceInfo, `positions`
    the resident positions of each (layer, KV head) row, index layer * Hk + head."""
    info: Any
    positions: list


@dataclass
class Event:
    """One event of a session's stream (WatchEvents; karakv.proto's Event). kind is "preempted",
    "compaction", "compaction_failed", "device_failed", "session_ended" or "dropped"; the fields of
    other kinds keep their defaults."""
    kind: str
    number: int = 0           # 1, 2, ... per stream; 0 for "dropped"
    time_unix: float = 0.0
    sequence_id: int = 0      # preempted, compaction, compaction_failed
    # preempted: why (request, wanted vs free blocks, priority rule); session_ended: why;
    # compaction_failed: the error's code and message (a kernel's names its op); device_failed: the
    # failing call's error (the daemon serves nothing more until it restarts; its sequences are lost)
    reason: str = ""
    priority: int = 0         # preempted
    blocks_freed: int = 0     # preempted
    tokens_lost: int = 0      # preempted
    policy: str = ""          # compaction, compaction_failed
    tokens_before: int = 0    # compaction
    tokens_after: int = 0     # compaction
    lease_expired: bool = False   # session_ended
    sequences_released: int = 0   # session_ended
    dropped: int = 0          # dropped: events lost because this reader fell behind


def _event(e: pb.Event) -> Optional[Event]:
    """The Event for a karakv.proto Event; None for a kind newer than this SDK (skipped)."""
    kind = e.WhichOneof("kind")
    out = Event(kind or "", e.number, e.time_unix)
    if kind == "preempted":
        p = e.preempted
        out.sequence_id, out.reason, out.priority = p.sequence_id, p.reason, p.priority
        out.blocks_freed, out.tokens_lost = p.blocks_freed, p.tokens_lost
    elif kind == "compaction":
        c = e.compaction
        out.sequence_id, out.policy, out.tokens_before, out.tokens_after = \
            c.sequence_id, c.policy, c.tokens_before, c.tokens_after
    elif kind == "compaction_failed":
        c = e.compaction_failed
        out.sequence_id, out.policy, out.reason = c.sequence_id, c.policy, c.reason
    elif kind == "device_failed":
        out.reason = e.device_failed.reason
    elif kind == "session_ended":
        s = e.session_ended
        out.reason, out.lease_expired, out.sequences_released = s.reason, s.lease_expired, s.sequences_released
    elif kind == "dropped":
        out.dropped = e.dropped.count
    else:
        return None
    return out


def _read_pem(option: str, path: str, method: str) -> Optional[bytes]:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise errors.InvalidArgument(f"{option}={path}: cannot read it ({e.strerror})", method) from None


def channel_credentials(target: str, tls: bool = False, tls_ca_file: str = "", tls_cert_file: str = "",
                        tls_key_file: str = "", method: str = "Attach") -> Optional[grpc.ChannelCredentials]:
    """TLS credentials for a TCP target (karakvd --tls_cert), or None for a plaintext channel.
    tls_ca_file: PEM of the CA that signed the daemon's certificate (empty: the system's roots);
    tls_cert_file + tls_key_file: this client's certificate and key, for mutual TLS
    (karakvd --tls_client_ca). Any of them set, or tls=True, makes the channel TLS."""
    if not (tls or tls_ca_file or tls_cert_file or tls_key_file):
        return None
    if target.startswith("unix:") or target.startswith("unix-abstract:"):
        raise errors.InvalidArgument(
            f"TLS options given for {target}, a Unix socket: karakvd's Unix socket never speaks TLS (its file mode "
            "and --allowed_uids / --allowed_gids guard it); TLS needs a host:port target (karakvd --listen_tcp "
            "with --tls_cert / --tls_key)", method)
    if bool(tls_cert_file) != bool(tls_key_file):
        given = f"tls_cert_file={tls_cert_file}" if tls_cert_file else f"tls_key_file={tls_key_file}"
        raise errors.InvalidArgument(f"tls_cert_file and tls_key_file go together (mutual TLS): got only {given}; "
                                     "give both, or neither for server-only TLS", method)
    return grpc.ssl_channel_credentials(root_certificates=_read_pem("tls_ca_file", tls_ca_file, method),
                                        private_key=_read_pem("tls_key_file", tls_key_file, method),
                                        certificate_chain=_read_pem("tls_cert_file", tls_cert_file, method))


def health(target: Optional[str] = None, timeout: float = 5.0, *, tls: bool = False, tls_ca_file: str = "",
           tls_cert_file: str = "", tls_key_file: str = "") -> str:
    """grpc.health.v1 Check of the daemon at `target` (default: $KARAKV_TARGET, else
    unix:/tmp/karakv.sock): 'SERVING', 'NOT_SERVING', ... Raises the typed error when the daemon
    cannot be reached. TLS options as Client.attach. (Hand-coded: HealthCheckRequest{} is empty and
    the reply is field 1, an enum, so no generated stub is needed.)"""
    target = default_target(target)
    names = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
    creds = channel_credentials(target, tls, tls_ca_file, tls_cert_file, tls_key_file, "health")
    channel = grpc.secure_channel(target, creds) if creds is not None else grpc.insecure_channel(target)
    with channel:
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
    """The mapped staging region (and, with the fast path, the rings after it: the mapping holds
    `map_size` bytes, the region its first `size`). Arrays from Client.alloc are bump-allocated
    from the start (like the C++ SDK); each call copies its other tensors to a scratch area after
    them."""

    def __init__(self, name: str, size: int, map_size: int):
        fd = _shm_open(name)
        try:
            self.mm = mmap.mmap(fd, map_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.size = size
        self.bytes: Any = np.frombuffer(self.mm, dtype=np.uint8, count=size)  # None once closed
        self.base = self.bytes.ctypes.data
        self.used = 0  # high-water mark of Client.alloc
        self.scratch = 0

    def offset_of(self, a: np.ndarray) -> Optional[int]:
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


class _Rpc(NamedTuple):
    """One RPC an operation needs: the driver sends the reply back into the operation."""
    method: str
    request: Any
    check_lost: bool = True


Op = Generator[_Rpc, Any, Any]


class _Session:
    """What the blocking and the asyncio client share: the session's state, the staging region and
    ring, and every operation as a generator of RPCs (no I/O of its own)."""

    def _init_state(self) -> None:
        self._channel: Any = None  # grpc.Channel or grpc.aio.Channel
        self._stub: Any = None
        self._attach_args: Dict[str, Any] = {}
        self._staging: Optional[_Staging] = None
        self._ring: Optional[_ring.Ring] = None
        self._attached = False
        self._auto_reattach = False
        self._reattach_timeout = 30.0
        self._timeout = 60.0
        self.session_id = ""
        self.instance_id = ""
        self.last_decode_step = 0
        # Sequence ids this client got from the current daemon instance, and those lost with
        # earlier instances (never handed out again by this client: an old id never names new data).
        self._live: set = set()
        self._lost: set = set()

    def _configure(self, target: Optional[str], worker_id: str, tenant: str, staging_bytes: int,
                   geometry: Optional[Geometry], heartbeat: bool, rpc_timeout: float, auto_reattach: bool,
                   reattach_timeout: float, cache_namespace: str, fast_path: bool, ring_spin: float,
                   ring_full_wait: float, tls: bool, tls_ca_file: str, tls_cert_file: str,
                   tls_key_file: str, model_fingerprint: str = "") -> Optional[grpc.ChannelCredentials]:
        """Records the attach options (reattach uses them again); returns the channel credentials."""
        target = default_target(target)
        self.target = target
        self._timeout = rpc_timeout
        self._auto_reattach = auto_reattach
        self._reattach_timeout = reattach_timeout
        self._ring_spin = ring_spin
        self._ring_full_wait = ring_full_wait
        self._attach_args = dict(target=target, worker_id=worker_id, tenant=tenant, staging_bytes=staging_bytes,
                                 geometry=geometry, heartbeat=heartbeat, rpc_timeout=rpc_timeout,
                                 auto_reattach=auto_reattach, reattach_timeout=reattach_timeout,
                                 cache_namespace=cache_namespace, fast_path=fast_path, ring_spin=ring_spin,
                                 ring_full_wait=ring_full_wait, tls=tls, tls_ca_file=tls_ca_file,
                                 tls_cert_file=tls_cert_file, tls_key_file=tls_key_file,
                                 model_fingerprint=model_fingerprint)
        if fast_path:
            if staging_bytes <= 0:
                raise errors.InvalidArgument("fast_path needs a staging region (staging_bytes > 0): the command "
                                             "ring lives after it and every tensor travels through it", "Attach")
            why = _ring.ring_supported()
            if why:
                raise errors.Unimplemented(why, "Attach")
        creds = channel_credentials(target, tls, tls_ca_file, tls_cert_file, tls_key_file)
        req = pb.AttachRequest(worker_id=worker_id, tenant=tenant, staging_bytes=staging_bytes,
                               cache_namespace=cache_namespace, fast_path=fast_path,
                               model_fingerprint=model_fingerprint)
        if geometry is not None:
            req.geometry.CopyFrom(geometry.to_proto())
        self._attach_request = req
        return creds

    def _adopt(self, reply: pb.AttachReply) -> None:
        """Takes the session of an AttachReply: maps its staging region and ring (raises, leaving
        the caller to close the client, when that fails)."""
        self.session_id = reply.session_id
        self.instance_id = reply.instance_id  # random per karakvd start: a change means a restart
        self.geometry = Geometry.from_proto(reply.geometry)
        self.lease_seconds = reply.lease_seconds
        self.staging_name = reply.staging_name
        self._attached = True
        if not reply.staging_name:
            return
        if reply.ring_bytes and reply.ring_offset != reply.staging_bytes:
            raise errors.Internal(f"ring_offset {reply.ring_offset} != staging_bytes {reply.staging_bytes} "
                                  "(SDK and karakvd disagree on the layout)", "Attach")
        try:
            self._staging = _Staging(reply.staging_name, reply.staging_bytes, reply.staging_bytes + reply.ring_bytes)
        except OSError as e:
            raise errors.FailedPrecondition(
                f"cannot open staging region {reply.staging_name}: {e.strerror} (is the worker on "
                "the same host, as the same user, sharing /dev/shm with karakvd?)", "Attach") from None
        # Both sides have it mapped now; removing the name means no other process can open it.
        _shm_unlink(reply.staging_name)
        if reply.ring_bytes:
            try:
                self._ring = _ring.Ring(self._staging.mm, self._staging.base, reply.ring_offset, reply.ring_bytes,
                                        self._ring_spin)
            except ValueError as e:
                raise errors.FailedPrecondition(
                    f"the fast-path ring's layout differs from this SDK's (karakv/v1/ring.h version): {e}; attach "
                    "without fast_path or use a matching SDK", "Attach") from None

    def _unmap(self) -> None:
        if self._ring is not None:
            self._ring.release()
            self._ring = None
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    @property
    def staging_bytes(self) -> int:
        return self._staging.size if self._staging else 0

    @property
    def fast_path(self) -> bool:
        """Whether Step, Attend, Append and ReadKV currently go through the shared-memory ring (attached with
        fast_path=True, and the ring was not closed)."""
        return self._ring is not None and self._ring.usable

    @property
    def ring_calls(self) -> int:
        """Commands this client sent through the ring so far (on this session)."""
        return self._ring.calls if self._ring is not None else 0

    # ----------------------------------------------------------------------------- staging
    def alloc(self, shape: Sequence[int] | int, dtype: Any = np.float32) -> np.ndarray:
        """A zeroed array inside the staging region (64-byte aligned): a numpy view of the shared
        mapping, not a copy. Passing it to a call sends its offset, so the daemon reads it in place;
        passing it as `out=` makes the daemon write the result into it. ResourceExhausted when the
        region is full or absent; reset_staging() frees every one."""
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
        # Where each Append entry of this operation put its token ids in staging (None: not staged).
        self._ring_ids: List[Optional[Tuple[int, int]]] = []

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
            found = st.offset_of(out) if st is not None and isinstance(out, np.ndarray) else None
            if found is None or out.dtype != np.float32 or out.nbytes != nbytes:
                raise errors.InvalidArgument(
                    f"out must be a float32 array of {nbytes} bytes from Client.alloc", what)
            offset = found
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
        assert self._staging is not None  # an offset means the output went to staging
        return self._staging.bytes[offset:offset + n].view(np.float32).reshape(shape).copy()

    @staticmethod
    def _like(q: Any, result: np.ndarray):
        if _is_torch(q):
            import torch
            return torch.from_numpy(result)
        return result

    def _check_lost(self, method: str, request) -> None:
        """Raises DaemonRestarted when `request` names a sequence lost with an earlier instance."""
        if not self._lost:
            return
        fields = request.DESCRIPTOR.fields_by_name
        ids = list(request.sequence_ids) if "sequence_ids" in fields else []
        if "sequence_id" in fields:
            ids.append(request.sequence_id)
        if "entries" in fields:  # AppendBatch
            ids.extend(e.sequence_id for e in request.entries)
        for sid in ids:
            if sid in self._lost and sid not in self._live:
                raise errors.DaemonRestarted(
                    f"sequence {sid} was lost: the daemon restarted; re-prefill (karakvd at "
                    f"{self._attach_args['target']} restarted and holds none of this client's earlier sequences; "
                    f"this client re-attached as session {self.session_id}: create a new sequence and append the "
                    "prompt again)", method)

    def _restarted_error(self, err: errors.KaraKVError, method: str) -> errors.DaemonRestarted:
        gone = (f"karakvd instance {self.instance_id} is gone, every sequence of session {self.session_id} "
                "with it")
        return errors.DaemonRestarted(
            f"the daemon restarted; re-prefill ({gone}; Client.reattach() opens a new session) [{err.message}]",
            method)

    def _ring_reply(self, method: str, done: Optional[_ring.Completion]):
        """The reply the gRPC path would have given for a ring completion (None: the ring was full)."""
        if done is None:
            return None
        if done.code != 0:
            raise errors.from_code(done.code, done.message, method)
        if method == "Step":
            return pb.StepReply(decode_step=done.decode_step, compactions=done.compactions)
        if method == "Append":
            return pb.AppendReply(length=done.decode_step)
        if method == "AppendBatch":
            return pb.AppendBatchReply(lengths=_ring.append_lengths(done))
        if method == "ReadKV":
            return pb.ReadKVReply(num_tokens=done.decode_step)
        return pb.AttendReply()

    def _gone_reason(self, reply: Optional[pb.PingReply], err: Optional[grpc.RpcError]) -> Optional[str]:
        """The liveness verdict during a long ring wait: a Ping answered UNAVAILABLE means the daemon
        is gone, one from another instance that it restarted; a slow answer is not a loss."""
        if err is not None:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                return f"karakvd is gone: a fast-path command got no completion and Ping failed ({err.details()})"
            return None
        if reply is not None and reply.instance_id and reply.instance_id != self.instance_id:
            return "karakvd restarted: a fast-path command got no completion and Ping answered from a new instance"
        return None

    # ----------------------------------------------------------------------------- operations
    def _op_create(self, req: pb.CreateSequenceRequest) -> Op:
        # An id this client held before a daemon restart is released and asked for again (the
        # daemon's ids only grow, so this ends): an old id must never name a new sequence.
        while True:
            req.session_id = self.session_id
            reply = yield _Rpc("CreateSequence", req)
            sid = reply.sequence_id
            if sid not in self._lost:
                self._live.add(sid)
                return CreatedSequence(sid, reply.cached_tokens)
            yield _Rpc("ReleaseSequence", pb.ReleaseSequenceRequest(session_id=self.session_id, sequence_id=sid),
                       False)

    @staticmethod
    def _create_request(policy: str, params: Optional[dict], prefill_policy: str, prefill_params: Optional[dict],
                        storage: str, priority: int, prefix_token_ids: Any = None) -> pb.CreateSequenceRequest:
        req = pb.CreateSequenceRequest(policy=policy, priority=priority, prefill_policy=prefill_policy,
                                       storage=storage)
        for k, v in (params or {}).items():
            req.params[k] = float(v)
        for k, v in (prefill_params or {}).items():
            req.prefill_params[k] = float(v)
        if prefix_token_ids is not None:
            req.prefix_token_ids.extend(_token_ids(prefix_token_ids, "CreateSequence.prefix_token_ids"))
        return req

    def _op_lookup(self, token_ids: Any) -> Op:
        ids = _token_ids(token_ids, "Lookup.token_ids")
        reply = yield _Rpc("Lookup", pb.LookupRequest(session_id=self.session_id, token_ids=ids))
        return reply.cached_tokens

    def _op_fork(self, sequence_id: int) -> Op:
        while True:
            reply = yield _Rpc("ForkSequence", pb.ForkSequenceRequest(session_id=self.session_id,
                                                                      sequence_id=sequence_id))
            child = reply.sequence_id
            if child not in self._lost:
                self._live.add(child)
                return child
            yield _Rpc("ReleaseSequence", pb.ReleaseSequenceRequest(session_id=self.session_id, sequence_id=child),
                       False)

    def _op_release(self, sequence_id: int) -> Op:
        reply = yield _Rpc("ReleaseSequence", pb.ReleaseSequenceRequest(session_id=self.session_id,
                                                                        sequence_id=sequence_id))
        self._live.discard(sequence_id)
        return reply.blocks_freed

    def _append_request(self, req: pb.AppendRequest, sequence_id: int, k: Any, v: Any, q: Any, token_ids: Any,
                        what: str) -> None:
        """Fills `req` (an AppendRequest, alone or an AppendBatch entry) after checking the tensors;
        errors name the argument as `what`.k, `what`.v, ... Call _begin() first."""
        g = self.geometry
        ka = _storage_array(k, g.dtype, f"{what}.k")
        va = _storage_array(v, g.dtype, f"{what}.v")
        _, t, _, _ = _check_shape(ka, (g.num_layers, None, g.num_kv_heads, g.head_dim), "[L][T][Hk][D]",
                                  f"{what}.k")
        _check_shape(va, ka.shape, "[L][T][Hk][D] like k", f"{what}.v")
        req.sequence_id = sequence_id
        req.num_tokens = t
        ids = None
        if token_ids is not None:
            ids = _token_ids(token_ids, f"{what}.token_ids")
            if len(ids) != t:
                raise errors.InvalidArgument(f"{what}.token_ids has {len(ids)} ids, expected T = {t} (one per "
                                             "appended token, as k and v hold)", f"{what}.token_ids")
            req.token_ids.extend(ids)
        self._input(ka, req.k, f"{what}.k")
        self._input(va, req.v, f"{what}.v")
        if q is not None:
            qa = _fp32_array(q, f"{what}.q")
            _, nq, _, _ = _check_shape(qa, (g.num_layers, None, g.num_q_heads, g.head_dim),
                                       "[L][Nq][Hq][D]", f"{what}.q")
            self._input(qa, req.q, f"{what}.q")
            req.num_query_tokens = nq
        self._ring_ids.append(self._stage_ids(ids))

    def _stage_ids(self, ids: Optional[list]) -> Optional[Tuple[int, int]]:
        """With the fast path, a copy of an Append's token ids in staging (after its tensors) so the
        Append can take the ring; None without ids, without a ring, or when the region is full
        (then the ids travel in the gRPC message as before)."""
        st = self._staging
        if not ids or st is None or self._ring is None:
            return None
        a = np.asarray(ids, dtype=np.int32)
        try:
            offset = st.take(a.nbytes, "token_ids")
        except errors.ResourceExhausted:
            return None
        st.bytes[offset:offset + a.nbytes] = a.view(np.uint8)
        return (offset, a.nbytes)

    def _op_append(self, sequence_id: int, k: Any, v: Any, q: Any, token_ids: Any) -> Op:
        req = pb.AppendRequest(session_id=self.session_id)
        self._begin()
        self._append_request(req, sequence_id, k, v, q, token_ids, "Append")
        return (yield _Rpc("Append", req)).length

    def _op_append_batch(self, entries: Iterable[Any]) -> Op:
        req = pb.AppendBatchRequest(session_id=self.session_id)
        self._begin()
        for i, entry in enumerate(entries):
            what = f"AppendBatch.entries[{i}]"
            e = _append_entry(entry, what)
            self._append_request(req.entries.add(), e.sequence_id, e.k, e.v, e.q, e.token_ids, what)
        return list((yield _Rpc("AppendBatch", req)).lengths)

    def _op_step(self, layer: int, sequence_ids: Iterable[int], k: Any, v: Any, q: Any, scale: float,
                 out: Optional[np.ndarray]) -> Op:
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
        self._begin()
        self._input(ka, req.k, "Step.k")
        self._input(va, req.v, "Step.v")
        self._input(qa, req.q, "Step.q")
        offset = self._output(out, b * g.num_q_heads * g.head_dim * 4, req.out, "Step.out")
        reply = yield _Rpc("Step", req)
        self.last_decode_step = reply.decode_step
        result = self._read_output(offset, reply.out, shape, out)
        return self._like(q, result) if out is None else result

    def _op_attend(self, sequence_id: int, layer: int, q: Any, scale: float, out: Optional[np.ndarray]) -> Op:
        g = self.geometry
        qa = _fp32_array(q, "Attend.q")
        n, _, _ = _check_shape(qa, (None, g.num_q_heads, g.head_dim), "[N][Hq][D]", "Attend.q")
        req = pb.AttendRequest(session_id=self.session_id, sequence_id=sequence_id, layer=layer,
                               num_queries=n, scale=scale)
        self._begin()
        self._input(qa, req.q, "Attend.q")
        offset = self._output(out, n * g.num_q_heads * g.head_dim * 4, req.out, "Attend.out")
        reply = yield _Rpc("Attend", req)
        result = self._read_output(offset, reply.out, (n, g.num_q_heads, g.head_dim), out)
        return self._like(q, result) if out is None else result

    def _op_read_kv(self, sequence_id: int, as_torch: bool) -> Op:
        g = self.geometry
        es = _DTYPE_SIZE[g.dtype]
        row = g.num_layers * g.num_kv_heads
        req = pb.ReadKVRequest(session_id=self.session_id, sequence_id=sequence_id)
        self._begin()
        st = self._staging
        offsets = []
        if st is not None:
            # The whole free scratch area is offered to the daemon.
            per_token = 2 * row * g.head_dim * es + row * 4
            room = st.size - st.scratch - 3 * _ALIGN
            cap = max(room // per_token, 0)
            for ref, nbytes, what in ((req.k, cap * row * g.head_dim * es, "ReadKV.k"),
                                      (req.v, cap * row * g.head_dim * es, "ReadKV.v"),
                                      (req.positions, cap * row * 4, "ReadKV.positions")):
                offsets.append(st.take(nbytes, what))
                ref.staging.offset = offsets[-1]
                ref.staging.length = nbytes
        reply = yield _Rpc("ReadKV", req)
        t = reply.num_tokens
        kv_bytes = row * t * g.head_dim * es
        st = self._staging if offsets else None
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

    def _op_compact(self, sequence_id: int, dry_run: bool) -> Op:
        reply = yield _Rpc("Compact", pb.CompactRequest(session_id=self.session_id, sequence_id=sequence_id,
                                                        dry_run=dry_run))
        return [Compaction(c.sequence_id, c.policy, c.tokens_before, c.tokens_after, c.skipped,
                           [list(h.positions) for h in c.kept], dict(c.params)) for c in reply.sequences]

    def _op_inspect(self, sequence_id: int) -> Op:
        reply = yield _Rpc("Inspect", pb.InspectRequest(sequence_id=sequence_id))
        hk = self.geometry.num_kv_heads
        rows: list = [[] for _ in range(self.geometry.num_layers * hk)]
        for h in reply.heads:
            if 0 <= h.layer * hk + h.head < len(rows):
                rows[h.layer * hk + h.head] = list(h.positions)
        return Inspection(reply.info, rows)

    def _op_simple(self, method: str, request, pick) -> Op:
        reply = yield _Rpc(method, request)
        return pick(reply)


class AppendEntry(NamedTuple):
    """One entry of Client.append_batch: the arguments of Client.append."""
    sequence_id: int
    k: Any
    v: Any
    q: Any = None
    token_ids: Any = None


def _append_entry(entry: Any, what: str) -> AppendEntry:
    """An append_batch entry as an AppendEntry (from itself, a tuple or a dict)."""
    if isinstance(entry, AppendEntry):
        return entry
    try:
        if isinstance(entry, dict):
            return AppendEntry(**entry)
        return AppendEntry(*entry)
    except TypeError as e:
        raise errors.InvalidArgument(f"{what} is {type(entry).__name__}, expected an AppendEntry(sequence_id, k, v, "
                                     f"q=None, token_ids=None) or a tuple or dict of its fields ({e})",
                                     what) from None


def _token_ids(ids: Any, what: str) -> list:
    """Token ids as a list of Python ints (from a list, a 1-D integer array or tensor)."""
    a = _to_numpy(ids) if not isinstance(ids, (list, tuple)) else np.asarray(ids, dtype=np.int64)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise errors.InvalidArgument(f"{what} has shape {tuple(a.shape)} and dtype {a.dtype}, expected a 1-D "
                                     "sequence of integer token ids", what)
    if a.size and (a.min() < -(1 << 31) or a.max() >= (1 << 31)):
        raise errors.InvalidArgument(f"{what} holds ids outside int32 (karakv.proto carries int32 token ids)", what)
    return a.astype(np.int64).tolist()


class EventStream:
    """A session's event stream (Client.watch_events). Iterate it for Events; iteration ends when the
    stream does: after a "session_ended" event (OK), when the daemon drains (UNAVAILABLE) or after
    cancel() (CANCELLED). finish() then says how. Use it as a context manager to cancel on exit."""

    def __init__(self, call):
        self._call = call
        self._ended = False

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> Event:
        while not self._ended:
            try:
                message = next(self._call)
            except StopIteration:
                self._ended = True
                break
            except grpc.RpcError:
                self._ended = True
                break
            event = _event(message)
            if event is not None:  # a kind newer than this SDK is skipped
                return event
        raise StopIteration

    def cancel(self) -> None:
        """Ends the stream from any thread; a blocked iteration then stops."""
        self._call.cancel()

    def finish(self) -> Optional[errors.KaraKVError]:
        """Waits for the stream to end; None when it ended OK (after "session_ended"), else the typed
        error that ended it (Unavailable when the daemon drains, Cancelled after cancel(),
        NotFound when the session was unknown)."""
        code = self._call.code()
        if code == grpc.StatusCode.OK:
            return None
        return errors.from_code(code.name, self._call.details() or "", "WatchEvents")

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class Client(_Session):
    """A session with karakvd. Make one with Client.attach(...); close() (or `with`) detaches.

    Calls that move tensors are serialized by a lock (they share the staging scratch area and the
    ring); use one Client per thread for parallel calls. karakv.aio.Client is the asyncio twin.
    """

    def __init__(self):  # use Client.attach
        self._init_state()
        self._lock = threading.RLock()  # re-entered when a call under it re-attaches
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread: Optional[threading.Thread] = None

    # ----------------------------------------------------------------------------- session
    @classmethod
    def attach(cls, target: Optional[str] = None, *, worker_id: str = "worker", tenant: str = "default",
               staging_bytes: int = 64 << 20, geometry: Optional[Geometry] = None, heartbeat: bool = True,
               rpc_timeout: float = 60.0, auto_reattach: bool = True, reattach_timeout: float = 30.0,
               cache_namespace: str = "", fast_path: bool = False, ring_spin: float = 50e-6,
               ring_full_wait: float = 1e-3, tls: bool = False, tls_ca_file: str = "", tls_cert_file: str = "",
               tls_key_file: str = "", model_fingerprint: str = "") -> "Client":
        """Attaches to the daemon at `target` ("unix:/path" or "host:port"; default $KARAKV_TARGET,
        else unix:/tmp/karakv.sock). With `geometry` set, the daemon refuses the session unless it
        serves exactly that geometry. With `heartbeat`, a background thread sends Heartbeat every
        lease/3 so the lease never runs out while attached.

        cache_namespace: the prefix cache namespace (empty: the tenant's own; a name shares cached
        prompts across tenants, if karakvd runs with --prefix_cache_shared_namespaces).
        model_fingerprint: the model this worker runs (name and revision, or a weights hash; at
        most 256 printable characters, no spaces). Cached prompts are shared only between sessions
        giving the same one, and with karakvd --prefix_tier across nodes too (empty: no tier).

        fast_path: Step, Attend, Append (token_ids copied into staging too) and ReadKV go through a command ring in
        shared memory after the staging region (one futex doorbell each way) instead of a gRPC round trip; results, status codes and
        messages are the same. Needs staging_bytes > 0 and Linux on x86-64. ring_spin: seconds to
        busy-wait for a completion before sleeping on the futex; ring_full_wait: seconds to wait for
        room in a full ring before using gRPC for that call.

        tls, tls_ca_file, tls_cert_file, tls_key_file: TLS to a TCP target (karakvd --tls_cert):
        PEM files of the CA that signed the daemon's certificate (empty: the system's roots) and,
        for mutual TLS (karakvd --tls_client_ca), this client's certificate and key. Any of them
        set, or tls=True, makes the channel TLS.

        With `auto_reattach`, a call that finds karakvd restarted attaches again by itself (as
        reattach(), for up to `reattach_timeout` seconds): a call naming a sequence of the old
        instance raises DaemonRestarted (create it again and re-prefill), any other call is repeated
        on the new session. Without it, every call raises DaemonRestarted until reattach()."""
        self = cls()
        creds = self._configure(target, worker_id, tenant, staging_bytes, geometry, heartbeat, rpc_timeout,
                                auto_reattach, reattach_timeout, cache_namespace, fast_path, ring_spin,
                                ring_full_wait, tls, tls_ca_file, tls_cert_file, tls_key_file, model_fingerprint)
        if creds is not None:
            self._channel = grpc.secure_channel(self.target, creds, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KaraKVStub(self._channel)
        try:
            reply = self._call("Attach", self._attach_request)
        except BaseException:
            self._channel.close()
            self._channel = self._stub = None
            raise
        try:
            self._adopt(reply)
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
            except AttributeError:
                return  # closed meanwhile

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
        self._unmap()
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
        old_ring, old_staging, old_channel = self._ring, self._staging, self._channel
        self._attached = False
        self._stop_heartbeats()
        with self._lock:
            for name in _ADOPTED:
                setattr(self, name, getattr(fresh, name))
            # `fresh` only lent its session: its own close() must not detach or unmap anything.
            fresh._attached = False
            fresh._ring = fresh._staging = fresh._channel = fresh._stub = None
        if old_ring is not None:
            old_ring.release()
        if old_staging is not None:
            old_staging.close()
        if old_channel is not None:
            old_channel.close()
        if self._attach_args["heartbeat"] and self.lease_seconds > 0:
            self._stop_heartbeat = threading.Event()
            self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, args=(self.lease_seconds / 3.0,),
                                                      name="karakv-heartbeat", daemon=True)
            self._heartbeat_thread.start()

    # ----------------------------------------------------------------------------- calls
    def _run(self, op: Op, staging: bool = False):
        """Runs an operation's RPCs one after another (under the lock when it uses staging)."""
        if staging:
            with self._lock:
                return self._drive(op)
        return self._drive(op)

    def _drive(self, op: Op):
        try:
            rpc = next(op)
            while True:
                rpc = op.send(self._call(rpc.method, rpc.request, rpc.check_lost))
        except StopIteration as done:
            return done.value

    def create_sequence(self, policy: str = "none", *, params: Optional[dict] = None,
                        prefill_policy: str = "", prefill_params: Optional[dict] = None,
                        storage: str = "", priority: int = 0) -> int:
        """A new sequence compressed by `policy` (none, kara, snapkv, streaming, h2o, chunkkv; or
        with a storage format, "kara+kivi4"); params override the documented defaults by name."""
        req = self._create_request(policy, params, prefill_policy, prefill_params, storage, priority)
        return self._run(self._op_create(req)).id

    def create_from_prefix(self, prompt_token_ids: Any, policy: str = "none", *, params: Optional[dict] = None,
                           prefill_policy: str = "", prefill_params: Optional[dict] = None, storage: str = "",
                           priority: int = 0) -> CreatedSequence:
        """A new sequence that starts from the longest cached prefix of `prompt_token_ids` (whole
        blocks of this session's cache namespace, shared by reference count): returns
        CreatedSequence(id, cached_tokens); append the rest, from token cached_tokens on, with their
        ids (append(..., token_ids=)). Other arguments as create_sequence."""
        req = self._create_request(policy, params, prefill_policy, prefill_params, storage, priority,
                                   prompt_token_ids)
        return self._run(self._op_create(req))

    def lookup(self, prompt_token_ids: Any) -> int:
        """How many leading tokens of a prompt the prefix cache holds for this session (whole
        blocks). Changes nothing."""
        return self._run(self._op_lookup(prompt_token_ids))

    def fork(self, sequence_id: int) -> int:
        """A child sequence sharing the parent's blocks (copy on write)."""
        return self._run(self._op_fork(sequence_id))

    def release(self, sequence_id: int) -> int:
        """Releases the sequence; returns how many blocks went back to the pool."""
        return self._run(self._op_release(sequence_id))

    def append(self, sequence_id: int, k: Any, v: Any, q: Any = None, token_ids: Any = None) -> int:
        """Appends T tokens: k, v [L][T][Hk][D] in the storage dtype; optional q [L][Nq][Hq][D]
        float32, the queries of the last Nq tokens; optional token_ids, the T tokens' ids (full
        prompt blocks whose every token came with an id are published to the prefix cache).
        Returns the sequence length after the append."""
        return self._run(self._op_append(sequence_id, k, v, q, token_ids), staging=True)

    def append_batch(self, entries: Iterable[Any]) -> list:
        """Several Appends in one call (a prefill batch): each entry an AppendEntry(sequence_id, k, v,
        q=None, token_ids=None), or a tuple or dict of those fields, exactly as append() takes them.
        Entries run in order; the first refused one stops the batch and leaves no trace, the ones
        before it stay applied (the error names the entry). Returns each entry's sequence length
        after it. Through the ring, as one command, when attached with fast_path and no entry has
        token_ids (up to 50 entries)."""
        return self._run(self._op_append_batch(entries), staging=True)

    def step(self, layer: int, sequence_ids: Iterable[int], k: Any, v: Any, q: Any,
             scale: float = 0.0, out: Optional[np.ndarray] = None):
        """One decode step of one layer for a batch of B sequences: k, v [B][Hk][D] storage dtype,
        q [B][Hq][D] float32. Returns the attention output [B][Hq][D] float32 (a torch tensor when
        q is one; `out` when given). Layers of a step go 0..L-1. The daemon's decode-step counter
        after the call is in self.last_decode_step. Through the ring when attached with fast_path."""
        return self._run(self._op_step(layer, sequence_ids, k, v, q, scale, out), staging=True)

    def attend(self, sequence_id: int, layer: int, q: Any, scale: float = 0.0,
               out: Optional[np.ndarray] = None):
        """Attention of N queries [N][Hq][D] float32 over the cached sequence without appending;
        query i sits at position length - N + i (causal). Returns [N][Hq][D] float32."""
        return self._run(self._op_attend(sequence_id, layer, q, scale, out), staging=True)

    def read_kv(self, sequence_id: int, as_torch: bool = False):
        """The sequence's resident cache: (k, v, positions) with k, v [L][T][Hk][D] in the storage
        dtype (uint16 bits for bf16) and positions [L][Hk][T] int32, each token's position in the
        sequence's history. Through staging, the whole free scratch area is offered to the daemon."""
        return self._run(self._op_read_kv(sequence_id, as_torch), staging=True)

    def compact(self, sequence_id: int = 0, dry_run: bool = False) -> list:
        """Runs the policy of `sequence_id` (0: every sequence of this session) now; dry_run changes
        nothing and returns the positions that would stay."""
        return self._run(self._op_compact(sequence_id, dry_run))

    def inspect(self, sequence_id: int) -> Inspection:
        """Operator view of any sequence (no session needed): its SequenceInfo and the resident
        positions of every (layer, KV head) row."""
        return self._run(self._op_inspect(sequence_id))

    def stats(self, check_invariants: bool = False) -> pb.StatsReply:
        """The daemon's StatsReply (fields as in karakv.proto)."""
        return self._run(self._op_simple("Stats", pb.StatsRequest(check_invariants=check_invariants), lambda r: r))

    def list_sequences(self) -> list:
        """This session's sequences (karakv.proto SequenceInfo messages)."""
        return self._run(self._op_simple("ListSequences", pb.ListSequencesRequest(session_id=self.session_id),
                                         lambda r: list(r.sequences)))

    def heartbeat(self) -> int:
        """Renews the lease now; returns the lease in seconds."""
        return self._run(self._op_simple("Heartbeat", pb.HeartbeatRequest(session_id=self.session_id),
                                         lambda r: r.lease_seconds))

    def ping(self) -> None:
        self._run(self._op_simple("Ping", pb.PingRequest(), lambda r: None))

    def watch_events(self) -> EventStream:
        """This session's events from now on: preempted sequences (karakvd --preempt_on_pressure),
        compactions, the session's end. Returns once the daemon has subscribed the stream; raises the
        typed error when it refused (NotFound for an unknown session)."""
        if self._stub is None:
            raise errors.FailedPrecondition("the client is closed", "WatchEvents")
        call = self._stub.WatchEvents(pb.WatchEventsRequest(session_id=self.session_id))
        call.initial_metadata()  # the daemon sends it once subscribed (or with a refusal)
        if call.done() and call.code() != grpc.StatusCode.OK:
            raise errors.from_code(call.code().name, call.details() or "", "WatchEvents")
        return EventStream(call)

    # ----------------------------------------------------------------------------- transport
    def _invoke(self, method: str, request):
        """One attempt: through the ring when it can carry the call, else gRPC."""
        if self._ring is not None and self._ring.usable:
            cmd = _ring.command(method, request, getattr(self, "_ring_ids", None))
            if cmd is not None and self._ring.takes(cmd.op):
                reply = self._ring_call(method, cmd)
                if reply is not None:
                    return reply
        try:
            return getattr(self._stub, method)(request, timeout=self._timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, method) from None

    def _ring_call(self, method: str, cmd: _ring.Command):
        """The reply through the ring; None when the call should use gRPC (ring full, or closed)."""
        ring = self._ring
        assert ring is not None  # _invoke checked it
        steps = ring.call(cmd, time.monotonic() + self._timeout, self._ring_full_wait)
        try:
            step = next(steps)
            while True:
                answer = None
                if step == _ring.SPIN:
                    os.sched_yield()
                elif step == _ring.ALIVE:
                    answer = self._liveness()
                elif isinstance(step, _ring.Wait):
                    _ring.futex_wait(step.address, step.expected, step.timeout_ns)
                step = steps.send(answer)
        except StopIteration as done:
            completion = done.value
        except _ring.Lost:
            return None  # not run: gRPC reports why (session gone, daemon restarted or unreachable)
        except _ring.Broken as e:
            raise errors.from_code(e.code, e.message, method) from None
        return self._ring_reply(method, completion)

    def _liveness(self) -> Optional[str]:
        try:
            return self._gone_reason(self._stub.Ping(pb.PingRequest(), timeout=1.0), None)
        except grpc.RpcError as e:
            return self._gone_reason(None, e)

    def _call(self, method: str, request, check_lost: bool = True):
        if self._stub is None:
            raise errors.FailedPrecondition("the client is closed", method)
        if check_lost:
            self._check_lost(method, request)
        try:
            return self._invoke(method, request)
        except errors.NotFound as e:
            err = e
        # An unknown session may mean karakvd restarted (everything of this session is gone) rather
        # than an expired lease: the instance id tells them apart.
        if not ("session" in err.message and self._restarted()):
            raise err
        # Detach of a session the restart already ended has nothing left to do on a new one.
        if not self._auto_reattach or method == "Detach" or threading.current_thread() is self._heartbeat_thread:
            raise self._restarted_error(err, method) from None
        self.reattach(timeout=self._reattach_timeout)
        if check_lost:
            self._check_lost(method, request)
        # Names no sequence (CreateSequence, ListSequences, Compact of all ...): the same call on the
        # new session.
        if "session_id" in request.DESCRIPTOR.fields_by_name:
            request.session_id = self.session_id
        return self._invoke(method, request)

    def _restarted(self) -> bool:
        if not self.instance_id:
            return False
        try:
            reply = self._stub.Ping(pb.PingRequest(), timeout=self._timeout)
        except grpc.RpcError:
            return False
        return reply.instance_id != self.instance_id


# What a client takes over from the fresh client of a re-attach.
_ADOPTED = ("_channel", "_stub", "_staging", "_ring", "_attached", "session_id", "instance_id", "geometry",
            "lease_seconds", "staging_name")
