"""Python client for the Sluice gateway (`sluice.v1.Gateway`).

    from sluice_client import Client, Action

    with Client("127.0.0.1:50051") as sluice:
        r = sluice.run("support-bot", "input", "call me at 010-1234-5678")
        if r.stopped:
            print(r.message)
        else:
            print(r.payload)

`Client` is synchronous; `sluice_client.aio.AsyncClient` is the asyncio one. The generated stubs
are in `sluice_client.pb` (messages) and `sluice_client.pb_grpc` (service stubs)."""

from ._client import Client, Stream
from ._errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SluiceError,
    Unauthenticated,
    Unavailable,
)
from ._proto import gateway_pb2 as pb
from ._proto import gateway_pb2_grpc as pb_grpc
from ._results import Action, Blocked, Commit, Final, HookOutcome, RunResult, StreamEvent

__version__ = "0.2.0"

__all__ = [
    "Action",
    "Blocked",
    "Cancelled",
    "Client",
    "Commit",
    "DeadlineExceeded",
    "Final",
    "HookOutcome",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "RunResult",
    "SluiceError",
    "Stream",
    "StreamEvent",
    "Unauthenticated",
    "Unavailable",
    "pb",
    "pb_grpc",
]
