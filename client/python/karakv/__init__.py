"""karakv: the Python SDK of karakvd, the karakv KV-cache daemon.

    import karakv, numpy as np
    with karakv.Client.attach("unix:/run/karakv/karakv.sock") as c:
        seq = c.create_sequence("kara")
        c.append(seq, k, v)                      # [L][T][Hk][D] in the storage dtype
        out = c.step(0, [seq], k1, v1, q1)       # [B][Hq][D] float32

Errors are KaraKVError subclasses named after the gRPC status code (NotFound, InvalidArgument,
ResourceExhausted, ...), carrying the daemon's message.
"""
from .client import Client, Compaction, Geometry, health
from .errors import (Aborted, AlreadyExists, Cancelled, DaemonRestarted, DataLoss, DeadlineExceeded,
                     FailedPrecondition, Internal, InvalidArgument, KaraKVError, NotFound,
                     OutOfRange, PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable,
                     Unimplemented, Unknown)

__version__ = "0.1.0"

__all__ = [
    "Client", "Compaction", "Geometry", "health", "KaraKVError", "Aborted", "AlreadyExists",
    "Cancelled", "DaemonRestarted", "DataLoss", "DeadlineExceeded", "FailedPrecondition", "Internal",
    "InvalidArgument", "NotFound", "OutOfRange", "PermissionDenied", "ResourceExhausted",
    "Unauthenticated", "Unavailable", "Unimplemented", "Unknown",
]
