"""Typed answers of the gateway: the action a chain took, the payload it let through, each hook's
outcome, and the events of a stream (commits, a block, the final result)."""

import enum
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

from ._proto import gateway_pb2 as pb
from ._values import from_value


class Action(str, enum.Enum):
    """What a chain (or one hook) did. Compares equal to its name in hook code: `Action.BLOCK == "block"`."""

    PASS = "pass"
    MODIFY = "modify"
    BLOCK = "block"
    SKIP = "skip"
    DETECT = "detect"

    @classmethod
    def _from_proto(cls, n: int) -> "Action":
        name = pb.Action.Name(n) if n in pb.Action.values() else None
        if name is None:
            # A newer gateway with an action this client does not know: say so instead of guessing.
            raise ValueError(f"the gateway answered an unknown action number {n}")
        return cls[name]


@dataclass(frozen=True)
class HookOutcome:
    """What one hook that ran did. `error` is set when the hook failed (an exception, a timeout, a
    wrong return); under `failurePolicy: Open` the run went on without it."""

    name: str
    action: Action
    message: str
    findings: Any
    error: Optional[str]
    latency_us: int
    # The end of what the hook printed; None unless the gateway carries hook output
    # (`--hook-output-bytes`), which is for debugging a chain.
    output: Optional[str] = None

    @classmethod
    def _from_proto(cls, h: "pb.HookOutcome") -> "HookOutcome":
        return cls(
            name=h.name,
            action=Action._from_proto(h.action),
            message=h.message,
            findings=from_value(h.findings) if h.HasField("findings") else None,
            error=h.error or None,
            latency_us=h.latency_us,
            output=h.output or None,
        )


@dataclass(frozen=True)
class RunResult:
    """The answer for one trigger point.

    `payload` is what goes on: the text (input/output) or the JSON value (agent-loop points),
    rewritten if a hook modified it. `message` is for the user when the chain blocked or skipped.
    `hooks` has one outcome per hook that ran, in chain order (platform baseline hooks first, as
    `baseline/<hook>`); `terminal_index` is the index in the chain of the hook that ended the walk."""

    action: Action
    payload: Any
    message: str
    hooks: Tuple[HookOutcome, ...]
    terminal_index: Optional[int]
    run_id: str

    @property
    def text(self) -> str:
        """The payload as text; TypeError if this trigger point carries a structured value."""
        if not isinstance(self.payload, str):
            raise TypeError(f"the payload is a {type(self.payload).__name__}, not text")
        return self.payload

    @property
    def stopped(self) -> bool:
        """True when a hook ended the walk (block or skip): do not go on as if nothing happened."""
        return self.action in (Action.BLOCK, Action.SKIP)

    @property
    def blocked(self) -> bool:
        return self.action is Action.BLOCK

    @property
    def errors(self) -> Tuple[HookOutcome, ...]:
        """The hooks that failed."""
        return tuple(h for h in self.hooks if h.error)

    @classmethod
    def _from_proto(cls, r: "pb.RunResponse") -> "RunResult":
        which = r.WhichOneof("payload")
        payload: Any
        if which == "text":
            payload = r.text
        elif which == "value":
            payload = from_value(r.value)
        else:
            payload = None
        return cls(
            action=Action._from_proto(r.action),
            payload=payload,
            message=r.message,
            hooks=tuple(HookOutcome._from_proto(h) for h in r.hooks),
            terminal_index=r.terminal_index if r.HasField("terminal_index") else None,
            run_id=r.run_id,
        )


@dataclass(frozen=True)
class Commit:
    """Text of the reply that is safe to show now, to append to what was committed before."""

    text: str


@dataclass(frozen=True)
class Blocked:
    """A hook blocked the reply on the stream path: stop showing and stop generating. The final
    result (action BLOCK) follows."""

    message: str
    hook: str


@dataclass(frozen=True)
class Final:
    """The authoritative result of the whole reply: persist `result.payload`, not the commits."""

    result: RunResult


StreamEvent = Union[Commit, Blocked, Final]


def event_from_proto(r: "pb.StreamResponse") -> StreamEvent:
    which = r.WhichOneof("msg")
    if which == "commit":
        return Commit(r.commit)
    if which == "blocked":
        return Blocked(message=r.blocked.message, hook=r.blocked.hook)
    if which == "final":
        return Final(RunResult._from_proto(r.final))
    raise ValueError("the gateway sent an empty stream message")
