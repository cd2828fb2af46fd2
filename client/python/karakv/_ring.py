"""The worker's end of the decode fast path, in Python: the shared-memory command ring of
proto/karakv/v1/ring.h (the layout the daemon and the C++ SDK share), reached through ctypes views
of the mapped staging region and futex system calls.

One command is in flight at a time (the client serialises its calls). A call submits a Step or
Attend command, rings the daemon's doorbell, then waits for the completion with the tag it gave:
a short spin, then FUTEX_WAIT on the completion doorbell in slices, asking the caller whether the
daemon is still alive once the wait has lasted a while. The wait is written as a generator of
wait steps (spin / sleep / liveness check) so that the blocking client runs them directly and
the asyncio client awaits them without blocking its event loop.

Memory order: the ring needs the command's bytes visible before the tail that publishes it, and
the tail before the doorbell. Python has no atomics; the stores below are plain aligned stores,
which x86-64 keeps in program order (TSO), and the one ordering TSO does not give (a store, then a
load of the daemon's `sleeping` flag) is avoided by always waking the daemon's futex. Other
architectures reorder stores, so the fast path is refused there (ring_supported()).
"""
from __future__ import annotations

import ctypes
import platform
import struct
import time
from typing import Any, Generator, NamedTuple, Optional, Sequence, Tuple, Union

MAGIC = 0x31524B4B  # "KKR1"
VERSION = 1
SLOTS = 64
COMMAND_BYTES = 4096
COMPLETION_BYTES = 512
HEADER_BYTES_BEFORE_IDS = 96
MAX_IDS = (COMMAND_BYTES - HEADER_BYTES_BEFORE_IDS) // 8
APPEND_ENTRY_BYTES = 80  # ring.h's AppendEntry: sequence_id, num_tokens, num_query_tokens, k, v, q, token_ids
MAX_APPENDS = (COMMAND_BYTES - HEADER_BYTES_BEFORE_IDS) // APPEND_ENTRY_BYTES
COMMANDS_OFFSET = 4096
COMPLETIONS_OFFSET = COMMANDS_OFFSET + SLOTS * COMMAND_BYTES
RING_BYTES = COMPLETIONS_OFFSET + SLOTS * COMPLETION_BYTES
OP_STEP, OP_ATTEND, OP_APPEND, OP_READKV = 1, 2, 3, 4
# Header.ops: a daemon that takes Append and ReadKV on the ring sets this bit (older ones leave 0).
OPS_APPEND_READKV = 1
STATE_OPEN = 0

# How long a wait goes before the daemon's liveness is checked, and then how often; and the
# longest single futex sleep (as the C++ SDK's RingClient).
LIVENESS_EVERY_S = 0.25
SLICE_NS = 10_000_000

_u32, _u64, _i32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32


def _pad(n: int):
    return ctypes.c_uint8 * n


class _Header(ctypes.Structure):
    # ring.h's Header: each index on its own 64-byte line.
    _fields_ = [("magic", _u32), ("version", _u32), ("slots", _u32), ("command_bytes", _u32),
                ("completion_bytes", _u32), ("ops", _u32), ("_p0", _pad(40)),
                ("sq_tail", _u64), ("_p1", _pad(56)),
                ("sq_head", _u64), ("_p2", _pad(56)),
                ("sq_doorbell", _u32), ("daemon_sleeping", _u32), ("_p3", _pad(56)),
                ("cq_tail", _u64), ("_p4", _pad(56)),
                ("cq_head", _u64), ("_p5", _pad(56)),
                ("cq_doorbell", _u32), ("worker_sleeping", _u32), ("_p6", _pad(56)),
                ("state", _u32), ("close_code", _u32), ("close_message", ctypes.c_char * 256)]


class _Range(ctypes.Structure):
    _fields_ = [("offset", _u64), ("length", _u64)]


class _Command(ctypes.Structure):
    _fields_ = [("tag", _u64), ("op", _u32), ("layer", _i32), ("scale", ctypes.c_float), ("count", _u32),
                ("sequence_id", _u64), ("k", _Range), ("v", _Range), ("q", _Range), ("out", _Range),
                ("ids", _u64 * MAX_IDS)]


class _Completion(ctypes.Structure):
    _fields_ = [("tag", _u64), ("code", _u32), ("compactions", _u32), ("decode_step", _u64),
                ("message_bytes", _u32), ("reserved", _u32),
                ("message", ctypes.c_char * (COMPLETION_BYTES - 32))]


# The offsets ring.h's static layout gives (checked here once, so a mistake cannot reach a daemon).
for _cls, _field, _want in ((_Header, "sq_tail", 64), (_Header, "sq_head", 128), (_Header, "sq_doorbell", 192),
                            (_Header, "daemon_sleeping", 196), (_Header, "cq_tail", 256), (_Header, "cq_head", 320),
                            (_Header, "cq_doorbell", 384), (_Header, "worker_sleeping", 388),
                            (_Header, "state", 448), (_Header, "close_message", 456), (_Command, "ids", 96),
                            (_Completion, "message", 32)):
    assert getattr(_cls, _field).offset == _want, (_cls.__name__, _field)
assert ctypes.sizeof(_Command) == COMMAND_BYTES and ctypes.sizeof(_Completion) == COMPLETION_BYTES


class Completion(NamedTuple):
    code: int  # a gRPC / absl status code number
    message: str
    decode_step: int
    compactions: int
    raw: bytes = b""  # OK: the message's first 4 x compactions bytes (an Append's per-entry lengths)


def append_lengths(done: Completion) -> list:
    """Each entry's sequence length from an OK Append completion (ring.h: append_length)."""
    return list(struct.unpack(f"<{done.compactions}I", done.raw[:4 * done.compactions]))


class Command(NamedTuple):
    op: int
    layer: int
    scale: float
    rows: int  # Step: sequences in `ids`; Attend: num_queries (the command's `count`)
    sequence_id: int
    k: Tuple[int, int]
    v: Tuple[int, int]
    q: Tuple[int, int]
    out: Tuple[int, int]
    ids: Tuple[int, ...]
    # Append: (sequence_id, num_tokens, num_query_tokens, k, v, q, token_ids) per entry, ranges as
    # (offset, length) pairs.
    entries: Tuple[Tuple[Any, ...], ...] = ()


class Lost(Exception):
    """The ring cannot answer this command (closed by karakvd, or the daemon is gone): it was not
    run, and the caller uses gRPC, which reports the cause as that path does."""


class Broken(Exception):
    """The ring failed in a way that leaves it unusable; `code` names the status (a grpc.StatusCode name)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# Wait steps the generator yields: the driver spins once, sleeps on a futex, or checks liveness
# (sending back None when the daemon is alive, else why not).
SPIN = "spin"
ALIVE = "alive"


class Wait(NamedTuple):
    """Sleep on the futex word at `address` while it holds `expected`, for at most timeout_ns."""
    address: int
    expected: int
    timeout_ns: int


Step = Union[str, Wait]

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202}
_libc = None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def ring_supported() -> Optional[str]:
    """None when this machine can run the Python fast path, else why not."""
    machine = platform.machine().lower()
    if machine not in _SYS_FUTEX or platform.system() != "Linux":
        return (f"the Python SDK's fast path needs Linux on x86-64 (this is {platform.system()} on {machine}): its "
                "plain stores must reach the daemon in program order; attach without fast_path (same results over "
                "gRPC) or use the C++ SDK's fast path")
    return None


def _syscall():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


def futex_wait(address: int, expected: int, timeout_ns: int) -> None:
    """FUTEX_WAIT (shared: no FUTEX_PRIVATE_FLAG) on the 32-bit word at `address` while it holds
    `expected`, for at most timeout_ns. Returns on a wake, a changed word, the timeout or a signal."""
    ts = _Timespec(timeout_ns // 1_000_000_000, timeout_ns % 1_000_000_000)
    _syscall()(ctypes.c_long(_SYS_FUTEX[platform.machine().lower()]), ctypes.c_void_p(address),
               ctypes.c_int(_FUTEX_WAIT), ctypes.c_uint32(expected), ctypes.byref(ts), None, ctypes.c_int(0))


def futex_wake(address: int) -> None:
    _syscall()(ctypes.c_long(_SYS_FUTEX[platform.machine().lower()]), ctypes.c_void_p(address),
               ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(1), None, None, ctypes.c_int(0))


class Ring:
    """The rings at `offset` of the mapping `mm` (whose first byte is at address `base`)."""

    def __init__(self, mm, base: int, offset: int, length: int, spin_s: float):
        if length < RING_BYTES:
            raise ValueError(f"the ring area has {length} bytes, this SDK's layout needs {RING_BYTES}")
        h = _Header.from_buffer(mm, offset)
        got = (h.magic, h.version, h.slots, h.command_bytes, h.completion_bytes)
        want = (MAGIC, VERSION, SLOTS, COMMAND_BYTES, COMPLETION_BYTES)
        if got != want:
            raise ValueError(f"ring header (magic, version, slots, command bytes, completion bytes) is "
                             f"{tuple(map(hex, got))}, this SDK expects {tuple(map(hex, want))}")
        self._h: Any = h  # None once released
        self._mm: Any = mm
        self._commands = offset + COMMANDS_OFFSET
        self._completions = offset + COMPLETIONS_OFFSET
        self._sq_doorbell = base + offset + _Header.sq_doorbell.offset
        self._cq_doorbell = base + offset + _Header.cq_doorbell.offset
        # Our own indices: the shared copies are only published, never read back.
        self._sq_next = h.sq_tail
        self._cq_next = h.cq_head
        self._spin_s = spin_s
        self._tag = 1
        self.usable = True
        self.calls = 0
        self.sleeps = 0

    def takes(self, op: int) -> bool:
        """Whether the daemon runs `op` on this ring (Append and ReadKV only from daemons that say so)."""
        if op in (OP_STEP, OP_ATTEND):
            return True
        return self._h is not None and bool(self._h.ops & OPS_APPEND_READKV)

    def release(self) -> None:
        """Drops the views into the mapping (so it can be unmapped)."""
        self._h = None
        self._mm = None
        self.usable = False

    def _closed(self) -> Lost:
        self.usable = False
        msg = self._h.close_message.decode("utf-8", "replace") or "karakvd closed the fast-path ring"
        return Lost(msg)

    def _room(self) -> int:
        used = (self._sq_next - self._h.sq_head) & 0xFFFFFFFFFFFFFFFF
        return -1 if used > SLOTS else SLOTS - used

    def _depth(self) -> int:
        avail = (self._h.cq_tail - self._cq_next) & 0xFFFFFFFFFFFFFFFF
        return -1 if avail > SLOTS else avail

    def _ring_doorbell(self) -> None:
        h = self._h
        h.sq_doorbell = (h.sq_doorbell + 1) & 0xFFFFFFFF  # this side is its only writer
        futex_wake(self._sq_doorbell)  # always: see the module's note on memory order

    def call(self, cmd: Command, deadline: float,
             full_wait: float) -> Generator[Step, Optional[str], Optional[Completion]]:
        """Submits `cmd` and waits for its completion until `deadline` (time.monotonic()).
        Returns None when the command ring stayed full for `full_wait` (nothing was submitted).
        Raises Lost (not run; use gRPC) or Broken (the ring is unusable from now on)."""
        h = self._h
        if h is None or h.state != STATE_OPEN:
            raise self._closed() if h is not None else Lost("the fast-path ring was released")
        full_until = min(deadline, time.monotonic() + full_wait)
        while True:
            room = self._room()
            if room < 0:
                self.usable = False
                raise Broken("INTERNAL", "fast path: the command ring's head is impossible (shared memory corrupted)")
            if room > 0:
                break
            if time.monotonic() >= full_until:
                return None
            yield SPIN
        tag = self._tag
        self._tag += 1
        slot = _Command.from_buffer(self._mm, self._commands + (self._sq_next % SLOTS) * COMMAND_BYTES)
        slot.tag, slot.op, slot.layer, slot.scale = tag, cmd.op, cmd.layer, cmd.scale
        slot.count, slot.sequence_id = cmd.rows, cmd.sequence_id
        slot.k.offset, slot.k.length = cmd.k
        slot.v.offset, slot.v.length = cmd.v
        slot.q.offset, slot.q.length = cmd.q
        slot.out.offset, slot.out.length = cmd.out
        if cmd.ids:
            slot.ids[:len(cmd.ids)] = cmd.ids
        for i, (seq, tokens, nq, k, v, q, ids) in enumerate(cmd.entries):
            packed = struct.pack("<QII8Q", seq, tokens, nq, *k, *v, *q, *ids)
            ctypes.memmove(ctypes.addressof(slot.ids) + i * APPEND_ENTRY_BYTES, packed, APPEND_ENTRY_BYTES)
        del slot
        self._sq_next += 1
        h.sq_tail = self._sq_next
        self.calls += 1
        self._ring_doorbell()

        start = time.monotonic()
        next_liveness = start + LIVENESS_EVERY_S
        while True:
            depth = self._depth()
            if depth < 0:
                self.usable = False
                raise Broken("INTERNAL",
                             "fast path: the completion ring's tail is impossible (shared memory corrupted)")
            if depth > 0:
                slot = self._completions + (self._cq_next % SLOTS) * COMPLETION_BYTES
                done = _Completion.from_buffer_copy(self._mm, slot)
                self._cq_next += 1
                h.cq_head = self._cq_next
                if h.daemon_sleeping:  # it may be waiting for room in the completion ring
                    self._ring_doorbell()
                if done.tag != tag:
                    continue  # a stale completion of an abandoned command
                n = min(done.message_bytes, len(done.message))
                # An OK Append leaves each entry's length in the message (message_bytes stays 0).
                raw = b""
                if done.code == 0:  # (a c_char array's slice would stop at the first zero byte)
                    raw = ctypes.string_at(ctypes.addressof(done) + _Completion.message.offset,
                                           min(4 * done.compactions, COMPLETION_BYTES - 32))
                return Completion(done.code, bytes(done.message[:n]).decode("utf-8", "replace"),
                                  done.decode_step, done.compactions, raw)
            if h.state != STATE_OPEN:
                raise self._closed()
            now = time.monotonic()
            if now - start < self._spin_s:
                yield SPIN
                continue
            if now >= deadline:
                self.usable = False  # the command may still run; its completion would be mistaken for the next
                raise Broken("DEADLINE_EXCEEDED", "fast path: karakvd did not complete the command before the "
                                                  "deadline (rpc_timeout)")
            if now >= next_liveness:
                next_liveness = now + LIVENESS_EVERY_S
                why = yield ALIVE
                if why:
                    self.usable = False
                    raise Lost(why)
            bell = h.cq_doorbell
            h.worker_sleeping = 1
            if self._depth() == 0 and h.state == STATE_OPEN:
                left = int((deadline - now) * 1e9)
                yield Wait(self._cq_doorbell, bell, max(1, min(SLICE_NS, left)))
                self.sleeps += 1
            h.worker_sleeping = 0


def _range(ref) -> Tuple[int, int]:
    return (ref.staging.offset, ref.staging.length)


def _append_entry(e, staged_ids: Optional[Tuple[int, int]] = None) -> Optional[Tuple[Any, ...]]:
    """An AppendRequest as a ring AppendEntry, or None when it cannot go on the ring: a tensor not in
    staging, or token ids that are not also in staging (`staged_ids`: their offset and length)."""
    has_q = e.HasField("q") or e.num_query_tokens > 0
    if any(r.WhichOneof("location") != "staging" for r in (e.k, e.v)) \
            or (e.token_ids and staged_ids is None) \
            or (has_q and e.q.WhichOneof("location") != "staging"):
        return None
    return (e.sequence_id, e.num_tokens, e.num_query_tokens, _range(e.k), _range(e.v),
            _range(e.q) if has_q else (0, 0), staged_ids if e.token_ids else (0, 0))


def command(method: str, request, staged_ids: Optional[Sequence[Optional[Tuple[int, int]]]] = None
            ) -> Optional[Command]:
    """The ring command for a Step, Attend, Append or AppendBatch (up to MAX_APPENDS entries; token ids
    only where staged_ids[i] says where a copy of entry i's lies in staging) or ReadKV request whose
    every tensor is in staging, else None."""
    rng = _range

    if method == "Step":
        if any(r.WhichOneof("location") != "staging" for r in (request.k, request.v, request.q)) \
                or not request.out.HasField("staging") or len(request.sequence_ids) > MAX_IDS:
            return None
        return Command(OP_STEP, request.layer, request.scale, len(request.sequence_ids), 0, rng(request.k),
                       rng(request.v), rng(request.q), rng(request.out), tuple(request.sequence_ids))
    if method == "Attend":
        if request.q.WhichOneof("location") != "staging" or not request.out.HasField("staging"):
            return None
        return Command(OP_ATTEND, request.layer, request.scale, request.num_queries, request.sequence_id, (0, 0),
                       (0, 0), rng(request.q), rng(request.out), ())
    if method in ("Append", "AppendBatch"):
        requests = request.entries if method == "AppendBatch" else (request,)
        ids = list(staged_ids or ())
        ids += [None] * (len(requests) - len(ids))
        entries = tuple(e for e in map(_append_entry, requests, ids) if e is not None)
        if not entries or len(entries) != len(requests) or len(entries) > MAX_APPENDS:
            return None
        return Command(OP_APPEND, 0, 0.0, len(entries), 0, (0, 0), (0, 0), (0, 0), (0, 0), (), entries)
    if method == "ReadKV":
        if not (request.k.HasField("staging") and request.v.HasField("staging")
                and request.positions.HasField("staging")):
            return None
        return Command(OP_READKV, 0, 0.0, 0, request.sequence_id, rng(request.k), rng(request.v), (0, 0),
                       rng(request.positions), ())
    return None
