"""Typed errors: every failed RPC raises the subclass of KaraKVError for its gRPC status code,
carrying the daemon's message (which says what was wrong and what was expected). The text of an
error names its status code as gRPC spells it: "NOT_FOUND: ReleaseSequence: unknown sequence 7"."""
from __future__ import annotations

import grpc


class KaraKVError(Exception):
    """Base of every error the SDK raises. `code` is the grpc.StatusCode, `method` the RPC (or the
    SDK call that refused the request before sending it), `message` the daemon's own text.
    str(error) is "CODE_NAME: method: message", as an absl::Status of the C++ SDK prints."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, method: str = "", code: grpc.StatusCode | None = None):
        self.message = message
        self.method = method
        if code is not None:
            self.code = code
        text = f"{method}: {message}" if method else message
        super().__init__(f"{self.code.name}: {text}")

    @property
    def code_name(self) -> str:
        """The status code's name, e.g. "NOT_FOUND"."""
        return self.code.name


class Cancelled(KaraKVError):
    code = grpc.StatusCode.CANCELLED


class Unknown(KaraKVError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(KaraKVError):
    """Malformed request: out-of-bounds staging range, wrong shape or dtype, bad parameter."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(KaraKVError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(KaraKVError):
    """Unknown sequence or session (also: a session whose lease expired)."""
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KaraKVError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(KaraKVError):
    """A sequence of another tenant."""
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(KaraKVError):
    """The KV pool (or the staging region) is full."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(KaraKVError):
    """The sequence is in the wrong state for this call (e.g. a Step layer out of order)."""
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(KaraKVError):
    code = grpc.StatusCode.ABORTED


class DaemonRestarted(Aborted):
    """karakvd restarted since this client attached (its instance id changed): the session and every
    sequence of it are gone. Nothing was computed on stale data. Call Client.reattach() for a new
    session and staging region (arrays from the old alloc() are invalid), then create the sequences
    again and re-prefill."""


class OutOfRange(KaraKVError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(KaraKVError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(KaraKVError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(KaraKVError):
    """The daemon is not reachable, or is draining for shutdown."""
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(KaraKVError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(KaraKVError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {cls.code: cls for cls in (
    Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
    PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange, Unimplemented,
    Internal, Unavailable, DataLoss, Unauthenticated)}


_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def from_code(code: int | str, message: str, method: str) -> KaraKVError:
    """The typed error for a status code given by number (absl / gRPC numbering, as the fast-path
    ring carries it) or by name."""
    status = grpc.StatusCode[code] if isinstance(code, str) else _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(status, KaraKVError)(message, method, status)


def from_rpc_error(err: grpc.RpcError, method: str) -> KaraKVError:
    """The typed error for a failed call (grpc.RpcError raised by a stub)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, KaraKVError)
    return cls(details or "", method, code)
