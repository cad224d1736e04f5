"""The asyncio client (`grpc.aio`): the same calls as `sluice_client.Client`, awaited.

    async with AsyncClient("127.0.0.1:50051") as sluice:
        r = await sluice.run("support-bot", "input", "hello")
        async for event in sluice.stream("support-bot", model_chunks()):
            ..."""

import asyncio
import time
from typing import Any, AsyncIterable, AsyncIterator, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import _requests as rq
from ._channel import GATEWAY_SERVICE, Pem, endpoint
from ._client import Metadata
from ._errors import SluiceError, Unavailable, from_rpc_error
from ._proto import gateway_pb2_grpc
from ._results import Blocked, Commit, Final, RunResult, StreamEvent, event_from_proto

Chunks = Union[Iterable[str], AsyncIterable[str]]


class _Feed:
    """Open, the chunks (sync or async iterable), finish; stops pulling chunks once the gateway
    blocked or answered, and keeps a chunk source's exception for the application."""

    def __init__(self, first: Any, chunks: Chunks):
        self._first = first
        self._chunks = chunks
        self.stopped = False
        self.error: Optional[BaseException] = None

    async def _texts(self) -> AsyncIterator[Any]:
        if hasattr(self._chunks, "__aiter__"):
            async for text in self._chunks:  # type: ignore[union-attr]
                yield text
        else:
            for text in self._chunks:  # type: ignore[union-attr]
                yield text

    async def __aiter__(self) -> AsyncIterator[Any]:
        yield self._first
        try:
            async for text in self._texts():
                if self.stopped:
                    return
                yield rq.chunk(text)
                if self.stopped:
                    return
        except Exception as e:  # noqa: BLE001 (raised to the application by AsyncStream)
            self.error = e
            return
        yield rq.FINISH


class AsyncStream:
    """`async for event in stream`: `Commit`, `Blocked`, `Final`; `await stream.result()`."""

    def __init__(self, call: Any, feed: _Feed):
        self._call = call
        self._feed = feed
        self._commits: List[str] = []
        self._final: Optional[RunResult] = None
        self.blocked: Optional[Blocked] = None
        self._done = False
        self._responses = call.__aiter__()

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            resp = await self._responses.__anext__()
        except StopAsyncIteration:
            self._done = True
            self._feed.stopped = True
            if self._final is None:
                raise SluiceError(grpc.StatusCode.INTERNAL, "the stream ended without a final result") from None
            raise
        except grpc.RpcError as e:
            self._done = True
            self._feed.stopped = True
            if self._feed.error is not None:
                raise self._feed.error from None
            raise from_rpc_error(e) from None
        event = event_from_proto(resp)
        if isinstance(event, Commit):
            self._commits.append(event.text)
        elif isinstance(event, Blocked):
            self._feed.stopped = True
            self.blocked = event
        elif isinstance(event, Final):
            self._feed.stopped = True
            self._final = event.result
        return event

    @property
    def committed(self) -> str:
        return "".join(self._commits)

    async def result(self) -> RunResult:
        async for _ in self:
            pass
        assert self._final is not None
        return self._final

    def cancel(self) -> None:
        self._feed.stopped = True
        if not self._done:
            self._call.cancel()
            self._done = True

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.cancel()


class AsyncClient:
    """A `grpc.aio` connection to a Sluice gateway; options as for `sluice_client.Client`."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        *,
        namespace: str = "default",
        tls: Optional[bool] = None,
        root_certificates: Optional[Pem] = None,
        client_certificate: Optional[Pem] = None,
        client_key: Optional[Pem] = None,
        token: Optional[str] = None,
        server_name: Optional[str] = None,
        timeout: Optional[float] = 30.0,
        options: Sequence[Tuple[str, object]] = (),
    ):
        ep = endpoint(
            address,
            tls=tls,
            root_certificates=root_certificates,
            client_certificate=client_certificate,
            client_key=client_key,
            token=token,
            server_name=server_name,
            options=options,
        )
        if ep.credentials is None:
            self._channel = grpc.aio.insecure_channel(ep.target, options=list(ep.options))
        else:
            self._channel = grpc.aio.secure_channel(ep.target, ep.credentials, options=list(ep.options))
        self.address = ep.target
        self.namespace = namespace
        self.timeout = timeout
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Waits until the gateway reports SERVING; Unavailable if not within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the gateway at {self.address} was not ready within {timeout:g}s ({last})",
                )
            try:
                r = await self._health.Check(
                    health_pb2.HealthCheckRequest(service=GATEWAY_SERVICE),
                    timeout=min(left, 5.0),
                    wait_for_ready=True,
                )
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            except grpc.RpcError as e:
                last = str(from_rpc_error(e))
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    async def run(
        self,
        target: str,
        trigger_point: str,
        payload: Any,
        *,
        namespace: Optional[str] = None,
        context: Optional[Mapping[str, str]] = None,
        session_id: str = "",
        timeout: Optional[float] = None,
        metadata: Optional[Metadata] = None,
    ) -> RunResult:
        req = rq.run_request(namespace or self.namespace, target, trigger_point, payload, context, session_id)
        try:
            resp = await self._stub.Run(
                req, timeout=self.timeout if timeout is None else timeout, metadata=metadata
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return RunResult._from_proto(resp)

    async def before_model(
        self,
        target: str,
        *,
        model: str,
        messages: Sequence[Any],
        tools: Sequence[Any] = (),
        max_tokens: Optional[int] = None,
        usage_so_far: Optional[Mapping[str, Any]] = None,
        turn: int,
        **call: Any,
    ) -> RunResult:
        payload = rq.before_model_payload(model, messages, tools, max_tokens, usage_so_far, turn)
        return await self.run(target, "before_model", payload, **call)

    async def after_model(
        self, target: str, *, message: Mapping[str, Any], usage: Optional[Mapping[str, Any]] = None, **call: Any
    ) -> RunResult:
        return await self.run(target, "after_model", rq.after_model_payload(message, usage), **call)

    async def before_tool(self, target: str, *, name: str, arguments: Any, **call: Any) -> RunResult:
        return await self.run(target, "before_tool", rq.before_tool_payload(name, arguments), **call)

    async def after_tool(
        self, target: str, *, name: str, result: Any = None, error: Optional[str] = None, **call: Any
    ) -> RunResult:
        return await self.run(target, "after_tool", rq.after_tool_payload(name, result, error), **call)

    def stream(
        self,
        target: str,
        chunks: Chunks,
        *,
        trigger_point: str = "output",
        namespace: Optional[str] = None,
        context: Optional[Mapping[str, str]] = None,
        session_id: str = "",
        timeout: Optional[float] = None,
        metadata: Optional[Metadata] = None,
    ) -> AsyncStream:
        rq.check_chunks(chunks)
        first = rq.stream_open(namespace or self.namespace, target, trigger_point, context, session_id)
        feed = _Feed(first, chunks)
        call = self._stub.Stream(feed.__aiter__(), timeout=timeout, metadata=metadata)
        return AsyncStream(call, feed)
