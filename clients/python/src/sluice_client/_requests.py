"""Builds the gateway's requests from Python values, shared by the sync and asyncio clients: the
payload (text or JSON value), the caller context, and the agent-loop payload shapes."""

from typing import Any, Dict, Mapping, Optional, Sequence

from ._proto import gateway_pb2 as pb
from ._values import to_value

TEXT_POINTS = ("input", "output")


def context_map(context: Optional[Mapping[str, str]]) -> Dict[str, str]:
    """The caller context hooks see as `context["caller"]`: a map of strings to strings."""
    if context is None:
        return {}
    out = {}
    for k, v in context.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(
                f"context entries must be str -> str (got {type(k).__name__} -> {type(v).__name__} "
                f"for {k!r}); convert numbers and ids with str()"
            )
        out[k] = v
    return out


def run_request(
    namespace: str,
    target: str,
    trigger_point: str,
    payload: Any,
    context: Optional[Mapping[str, str]],
    session_id: str,
) -> "pb.RunRequest":
    req = pb.RunRequest(
        namespace=namespace,
        target=target,
        trigger_point=trigger_point,
        context=context_map(context),
        session_id=session_id,
    )
    if isinstance(payload, str):
        req.text = payload
    else:
        req.value.CopyFrom(to_value(payload))
    return req


def stream_open(
    namespace: str,
    target: str,
    trigger_point: str,
    context: Optional[Mapping[str, str]],
    session_id: str,
) -> "pb.StreamRequest":
    return pb.StreamRequest(
        open=pb.StreamOpen(
            namespace=namespace,
            target=target,
            trigger_point=trigger_point,
            context=context_map(context),
            session_id=session_id,
        )
    )


def check_chunks(chunks: Any) -> None:
    """A str is iterable (by character), but streaming one is a mistake worth naming."""
    if isinstance(chunks, (str, bytes)):
        raise TypeError("chunks must be an iterable of str, not a single string: pass [text]")


def chunk(text: Any) -> "pb.StreamRequest":
    if not isinstance(text, str):
        raise TypeError(f"stream chunks must be str, got {type(text).__name__}")
    return pb.StreamRequest(chunk=text)


FINISH = pb.StreamRequest(finish=pb.StreamFinish())


def before_model_payload(
    model: str,
    messages: Sequence[Any],
    tools: Sequence[Any],
    max_tokens: Optional[int],
    usage_so_far: Optional[Mapping[str, Any]],
    turn: int,
) -> Dict[str, Any]:
    return {
        "model": model,
        "messages": list(messages),
        "tools": list(tools),
        "max_tokens": max_tokens,
        "usage_so_far": dict(usage_so_far or {}),
        "turn": turn,
    }


def after_model_payload(message: Mapping[str, Any], usage: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    return {"message": dict(message), "usage": dict(usage or {})}


def before_tool_payload(name: str, arguments: Any) -> Dict[str, Any]:
    return {"name": name, "arguments": arguments}


def after_tool_payload(name: str, result: Any, error: Optional[str]) -> Dict[str, Any]:
    return {"name": name, "result": result, "error": error}
