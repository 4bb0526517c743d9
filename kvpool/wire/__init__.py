"""The wire: every struct that crosses a socket (the daemon's, a worker's direct channel, a worker's pipe where
it carries the same structs), the checks a request passes, and the error it raises. Imported by the workers too,
so it stays light and imports nothing else of kvpool."""

from kvpool.wire.checks import append_rows, check_position, check_session_fields
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import (
    PROTOCOL_VERSION,
    Append,
    AppendReply,
    Done,
    ErrorCode,
    ErrorReply,
    Hello,
    HelloReply,
    MissReason,
    ShardDescription,
    StatsReply,
)
from kvpool.wire.sampling import Sampling
from kvpool.wire.shape import ShardShape

__all__ = [
    "PROTOCOL_VERSION", "Append", "AppendReply", "Done", "ErrorCode", "ErrorReply", "Hello", "HelloReply", "MissReason",
    "RequestFailed", "Sampling", "ShardDescription", "ShardShape", "StatsReply", "append_rows", "check_position",
    "check_session_fields",
]
