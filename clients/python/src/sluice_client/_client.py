"""The synchronous client: `Client.run` for one payload at one trigger point, the four agent-loop
helpers, and `Client.stream` for an agent reply streamed through the output chain."""

import threading
import time
from typing import Any, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import _requests as rq
from ._channel import GATEWAY_SERVICE, Pem, endpoint
from ._errors import SluiceError, Unavailable, from_rpc_error
from ._proto import gateway_pb2_grpc
from ._results import Blocked, Commit, Final, RunResult, StreamEvent, event_from_proto

Metadata = Sequence[Tuple[str, str]]


class _Feed:
    """Hands the application's chunks to gRPC (which reads them on its own thread): open first,
    then each chunk, then finish. Once the gateway has blocked or answered, it stops pulling chunks,
    so a generator over a model's stream is not read further. A chunk iterator that raises (or
    yields a non-str) ends the call; its exception is raised to the application instead of the
    resulting CANCELLED."""

    def __init__(self, first: Any, chunks: Iterable[Any]):
        self._first = first
        self._chunks = chunks
        self._stop = threading.Event()
        self.error: Optional[BaseException] = None

    def stop(self) -> None:
        self._stop.set()

    def __iter__(self) -> Iterator[Any]:
        yield self._first
        try:
            for text in self._chunks:
                if self._stop.is_set():
                    return
                yield rq.chunk(text)
                if self._stop.is_set():
                    return
        except Exception as e:  # noqa: BLE001 (handed to the application's thread)
            self.error = e
            return
        yield rq.FINISH


class Stream:
    """A reply going through the output chain. Iterate it for `Commit`, `Blocked` and `Final`
    events; `committed` is the text shown so far, `result()` waits for the final result.
    Use it as a context manager (or call `cancel()`) to end the call if you stop early."""

    def __init__(self, call: Any, feed: _Feed):
        self._call = call
        self._feed = feed
        self._commits: List[str] = []
        self._final: Optional[RunResult] = None
        self.blocked: Optional[Blocked] = None
        self._done = False

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> StreamEvent:
        if self._done:
            raise StopIteration
        try:
            resp = next(self._call)
        except StopIteration:
            self._done = True
            self._feed.stop()
            if self._final is None:
                raise SluiceError(grpc.StatusCode.INTERNAL, "the stream ended without a final result") from None
            raise
        except grpc.RpcError as e:
            self._done = True
            self._feed.stop()
            if self._final is not None:
                # The final result is what the gateway answered; a status racing behind it (the
                # call torn down while chunks were still being sent) changes nothing.
                raise StopIteration from None
            if self._feed.error is not None:
                raise self._feed.error from None
            raise from_rpc_error(e) from None
        event = event_from_proto(resp)
        if isinstance(event, Commit):
            self._commits.append(event.text)
        elif isinstance(event, Blocked):
            self._feed.stop()
            self.blocked = event
        elif isinstance(event, Final):
            self._feed.stop()
            self._final = event.result
        return event

    @property
    def committed(self) -> str:
        """All text committed so far (safe to show)."""
        return "".join(self._commits)

    def result(self) -> RunResult:
        """Reads the remaining events and returns the final result (the one to persist)."""
        for _ in self:
            pass
        assert self._final is not None  # __next__ raises when the stream ends without one
        return self._final

    def cancel(self) -> None:
        self._feed.stop()
        if not self._done:
            self._call.cancel()
            self._done = True

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()


class Client:
    """A connection to a Sluice gateway.

    `address` is `host:port` (`http://` / `https://` prefixes are accepted). TLS is on when any of
    `root_certificates`, `client_certificate`/`client_key` (mutual TLS) or `server_name` is given,
    or with `tls=True` (the system's CAs); certificates are PEM bytes or file paths. `token` is
    sent as `authorization: Bearer <token>` on every call. `namespace` is the default for calls;
    `timeout` (seconds) the default deadline of each call."""

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
            self._channel = grpc.insecure_channel(ep.target, options=list(ep.options))
        else:
            self._channel = grpc.secure_channel(ep.target, ep.credentials, options=list(ep.options))
        self.address = ep.target
        self.namespace = namespace
        self.timeout = timeout
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Waits until the gateway reports SERVING (its warm sandboxes are up); Unavailable if not
        within `timeout` seconds."""
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
                r = self._health.Check(
                    health_pb2.HealthCheckRequest(service=GATEWAY_SERVICE),
                    timeout=min(left, 5.0),
                    wait_for_ready=True,
                )
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            except grpc.RpcError as e:
                last = str(from_rpc_error(e))
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    def run(
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
        """Runs `payload` through the chain of (namespace, target, trigger_point). `payload` is text
        (str) for `input`/`output`, a JSON-like value for the agent-loop points."""
        req = rq.run_request(namespace or self.namespace, target, trigger_point, payload, context, session_id)
        try:
            resp = self._stub.Run(req, timeout=self._timeout(timeout), metadata=metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return RunResult._from_proto(resp)

    def before_model(
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
        """Before a model call. The result's payload holds the `messages`, `tools` and `max_tokens`
        to call the model with (hooks may compact, inject or drop); `stopped` means do not call."""
        payload = rq.before_model_payload(model, messages, tools, max_tokens, usage_so_far, turn)
        return self.run(target, "before_model", payload, **call)

    def after_model(
        self,
        target: str,
        *,
        message: Mapping[str, Any],
        usage: Optional[Mapping[str, Any]] = None,
        **call: Any,
    ) -> RunResult:
        """After a model call, with its reply `message` and `usage`."""
        return self.run(target, "after_model", rq.after_model_payload(message, usage), **call)

    def before_tool(self, target: str, *, name: str, arguments: Any, **call: Any) -> RunResult:
        """Before running a tool: the payload holds the (possibly rewritten) `name` and `arguments`."""
        return self.run(target, "before_tool", rq.before_tool_payload(name, arguments), **call)

    def after_tool(
        self, target: str, *, name: str, result: Any = None, error: Optional[str] = None, **call: Any
    ) -> RunResult:
        """After a tool ran: the payload holds the (possibly rewritten) `result` the model will see."""
        return self.run(target, "after_tool", rq.after_tool_payload(name, result, error), **call)

    def stream(
        self,
        target: str,
        chunks: Iterable[str],
        *,
        trigger_point: str = "output",
        namespace: Optional[str] = None,
        context: Optional[Mapping[str, str]] = None,
        session_id: str = "",
        timeout: Optional[float] = None,
        metadata: Optional[Metadata] = None,
    ) -> Stream:
        """Streams `chunks` (any iterable of str, e.g. a generator over the model's stream) through
        the chain. `timeout` bounds the whole stream (default: none, the gateway's idle limit)."""
        rq.check_chunks(chunks)
        first = rq.stream_open(namespace or self.namespace, target, trigger_point, context, session_id)
        feed = _Feed(first, chunks)
        call = self._stub.Stream(iter(feed), timeout=timeout, metadata=metadata)
        return Stream(call, feed)
