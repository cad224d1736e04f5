"""Exceptions for gateway errors: each gRPC status the gateway answers with becomes its own class,
so an application can tell "no chain here" from "bad request" from "try again later"."""

from typing import Dict, Optional, Type

import grpc


class SluiceError(Exception):
    """A call to the gateway failed. `code` is the gRPC status code, `details` its message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        self.code = code
        self.details = details
        super().__init__(f"{code.name}: {details}" if details else code.name)


class NotFound(SluiceError):
    """No HookChain serves this (namespace, target, trigger point)."""


class InvalidArgument(SluiceError):
    """The request was malformed (unknown trigger point, wrong payload kind, over a size limit)."""


class Unavailable(SluiceError):
    """The gateway could not be reached, or had no sandbox within its deadline: retry later."""


class Unauthenticated(SluiceError):
    """The gateway did not accept the caller's identity (missing or unknown token or certificate)."""


class PermissionDenied(SluiceError):
    """The caller is known but may not use this namespace."""


class DeadlineExceeded(SluiceError):
    """The call did not finish within its timeout (or the stream was idle too long)."""


class ResourceExhausted(SluiceError):
    """A stream's reply grew past the gateway's limit."""


class Cancelled(SluiceError):
    """The call was cancelled (by this client, or the stream ended without finish)."""


_BY_CODE: Dict[grpc.StatusCode, Type[SluiceError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def from_rpc_error(e: grpc.RpcError) -> SluiceError:
    """The exception for a failed call (sync or asyncio), keeping the gateway's message."""
    code: Optional[grpc.StatusCode] = e.code() if hasattr(e, "code") else None
    details: str = (e.details() if hasattr(e, "details") else None) or ""
    if code is None:
        code = grpc.StatusCode.UNKNOWN
    return _BY_CODE.get(code, SluiceError)(code, details)
