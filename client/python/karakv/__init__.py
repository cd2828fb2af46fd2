"""karakv: the Python SDK of karakvd, the karakv KV-cache daemon.

    import karakv, numpy as np
    with karakv.Client.attach() as c:            # $KARAKV_TARGET, else unix:/tmp/karakv.sock
        seq = c.create_sequence("kara")
        c.append(seq, k, v)                      # [L][T][Hk][D] in the storage dtype
        out = c.step(0, [seq], k1, v1, q1)       # [B][Hq][D] float32

karakv.aio.Client (also karakv.AsyncClient) is the same client on asyncio (grpc.aio).
Errors are KaraKVError subclasses named after the gRPC status code (NotFound, InvalidArgument,
ResourceExhausted, ...), carrying the daemon's message; their text starts with the code's name.
"""
from .client import (DEFAULT_TARGET, TARGET_ENV, AppendEntry, Client, Compaction, CreatedSequence, Event,
                     EventStream, Geometry, Inspection, default_target, health)
from .errors import (Aborted, AlreadyExists, Cancelled, DaemonRestarted, DataLoss, DeadlineExceeded,
                     FailedPrecondition, Internal, InvalidArgument, KaraKVError, NotFound,
                     OutOfRange, PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable,
                     Unimplemented, Unknown)
from . import aio
from .aio import Client as AsyncClient

__version__ = "0.1.0"

__all__ = [
    "Client", "AsyncClient", "aio", "AppendEntry", "Compaction", "CreatedSequence", "Event", "EventStream", "Geometry",
    "Inspection", "health", "default_target", "DEFAULT_TARGET", "TARGET_ENV", "KaraKVError", "Aborted",
    "AlreadyExists", "Cancelled", "DaemonRestarted", "DataLoss", "DeadlineExceeded", "FailedPrecondition",
    "Internal", "InvalidArgument", "NotFound", "OutOfRange", "PermissionDenied", "ResourceExhausted",
    "Unauthenticated", "Unavailable", "Unimplemented", "Unknown",
]
