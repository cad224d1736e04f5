"""The asyncio client (`grpc.aio`): the same calls as `sluice_client.Client`, awaited.

    async with AsyncClient("127.0.0.1:50051") as sluice:
        r = await sluice.run("support-bot", "input", "hello")
        async for event in sluice.stream("support-bot", model_chunks()):
            ..."""

import asyncio
import threading
import time
from typing import Any, AsyncIterable, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import _requests as rq
from ._channel import GATEWAY_SERVICE, Pem, endpoint
from ._client import Client, Metadata, Stream
from ._errors import Unavailable, from_rpc_error
from ._proto import gateway_pb2_grpc
from ._results import Blocked, Commit, Final, RunResult, StreamEvent

Chunks = Union[Iterable[str], AsyncIterable[str]]


def _pull(chunks: Chunks, loop: asyncio.AbstractEventLoop) -> Iterable[Any]:
    """The chunks as a plain iterable for the stream's gRPC thread: an async source is read on the
    event loop, one chunk at a time, while the application awaits the stream's events."""
    if not hasattr(chunks, "__aiter__"):
        return chunks  # type: ignore[return-value]
    source = chunks.__aiter__()  # type: ignore[union-attr]

    async def next_chunk() -> Any:
        return await source.__anext__()

    def pull() -> Iterator[Any]:
        while True:
            try:
                yield asyncio.run_coroutine_threadsafe(next_chunk(), loop).result()
            except StopAsyncIteration:
                return

    return pull()


class AsyncStream:
    """`async for event in stream`: `Commit`, `Blocked`, `Final`; `await stream.result()`.

    The call itself runs on the synchronous client, its events read on a thread of their own and
    handed to the event loop: with a request iterator, grpc.aio can report `INTERNAL: Internal error
    from Core` instead of the gateway's status when the gateway ends the stream while chunks are
    still being written (grpc/grpc#36066), which would turn a NOT_FOUND or PERMISSION_DENIED at open
    into a meaningless error. The sync API reports the gateway's status."""

    def __init__(self, stream: Stream, loop: asyncio.AbstractEventLoop):
        self._stream = stream
        self._loop = loop
        self._queue: "asyncio.Queue[Tuple[str, Any]]" = asyncio.Queue()
        self._commits: List[str] = []
        self._final: Optional[RunResult] = None
        self.blocked: Optional[Blocked] = None
        self._done = False
        threading.Thread(target=self._pump, name="sluice-stream", daemon=True).start()

    def _hand(self, kind: str, value: Any) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, value))
            return True
        except RuntimeError:  # the event loop is closed: nobody is reading any more
            self._stream.cancel()
            return False

    def _pump(self) -> None:
        try:
            for event in self._stream:
                if not self._hand("event", event):
                    return
        except BaseException as e:  # noqa: BLE001 (raised on the event loop by __anext__)
            self._hand("error", e)
            return
        self._hand("end", None)

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        kind, value = await self._queue.get()
        if kind == "end":
            self._done = True
            raise StopAsyncIteration
        if kind == "error":
            self._done = True
            raise value
        if isinstance(value, Commit):
            self._commits.append(value.text)
        elif isinstance(value, Blocked):
            self.blocked = value
        elif isinstance(value, Final):
            self._final = value.result
        return value

    @property
    def committed(self) -> str:
        return "".join(self._commits)

    async def result(self) -> RunResult:
        async for _ in self:
            pass
        assert self._final is not None  # the stream raises when it ends without one
        return self._final

    def cancel(self) -> None:
        self._stream.cancel()

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
        # Streams go through a synchronous channel (see AsyncStream).
        self._sync = Client(
            address, namespace=namespace, tls=tls, root_certificates=root_certificates,
            client_certificate=client_certificate, client_key=client_key, token=token,
            server_name=server_name, timeout=timeout, options=options,
        )

    async def close(self) -> None:
        await self._channel.close()
        self._sync.close()

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
        loop = asyncio.get_running_loop()
        stream = self._sync.stream(
            target, _pull(chunks, loop), trigger_point=trigger_point, namespace=namespace, context=context,
            session_id=session_id, timeout=timeout, metadata=metadata,
        )
        return AsyncStream(stream, loop)
