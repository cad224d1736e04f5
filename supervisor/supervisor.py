"""Sluice supervisor: runs one chain's hooks inside a sandbox, driven by the gateway.

Standard library only. The wire protocol (supervisor/PROTOCOL.md) is newline-delimited JSON: requests
arrive on the process's original stdin, every answer leaves on its original stderr. Before any hook
runs, the supervisor moves both protocol descriptors out of the way and points fds 0, 1 and 2 at
/dev/null and the (drained, discarded) stdout, so nothing a hook prints can break framing.

The supervisor walks the chain itself and applies the same checks the gateway re-applies on the
trusted side: declared action or pass, types, size and depth bounds.
"""

import json
import os
import sys
import time
import traceback

PROTOCOL_VERSION = 1
ACTIONS = ("pass", "modify", "block", "skip", "detect")
TERMINAL = ("block", "skip")
TEXT_TRIGGER_POINTS = ("input", "output")
DEFAULT_LIMITS = {
    "payload_bytes": 1 << 20,
    "state_bytes": 64 << 10,
    "findings_bytes": 64 << 10,
    "message_chars": 4096,
    "depth": 32,
    "host_calls": 16,
}
TRACEBACK_CHARS = 2000


class HostCallError(Exception):
    """Raised inside a hook when a host_call is denied or fails; the message says why."""


class HookError(Exception):
    """A hook broke the rules (wrong return, too large, undeclared action)."""


class Context(dict):
    """What a hook's execute receives: a dict that also allows attribute access and host_call."""

    __slots__ = ()

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


class Channel:
    """The protocol descriptors, taken before any hook code runs."""

    def __init__(self):
        proto_in = os.dup(0)  # os.dup makes non-inheritable descriptors: child processes never get them
        proto_out = os.dup(2)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(1, 2)  # a hook's stderr joins its stdout, which the gateway drains and discards
        os.close(devnull)
        sys.stdin = open(os.devnull, "r")
        sys.stdout = os.fdopen(os.dup(1), "w", buffering=1, errors="replace")
        sys.stderr = sys.stdout
        self.reader = os.fdopen(proto_in, "rb", buffering=1 << 16)
        self.writer = os.fdopen(proto_out, "wb", buffering=1 << 16)

    def send(self, msg, flush=True):
        data = json.dumps(msg, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        self.writer.write(data.encode("utf-8", "surrogatepass") + b"\n")
        if flush:
            self.flush()

    def flush(self):
        # Every syscall is expensive inside gVisor (tens of microseconds), so messages are written in
        # as few writes as keep the protocol's promises.
        self.writer.flush()

    def receive(self):
        line = self.reader.readline()
        if not line:
            return None
        return json.loads(line)


def depth_of(value, limit):
    """Nesting depth of a JSON-like value, stopping early once past `limit`."""
    stack = [(value, 1)]
    deepest = 0
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend((x, d + 1) for x in v)
    return deepest


def bounded_json(value, what, max_bytes, max_depth):
    """Checks that `value` is plain JSON within the bounds; returns it unchanged."""
    if depth_of(value, max_depth) > max_depth:
        raise HookError(f"{what} is nested deeper than {max_depth} levels")
    try:
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError) as e:
        raise HookError(f"{what} is not JSON-serializable: {e}") from None
    if size > max_bytes:
        raise HookError(f"{what} is {size} bytes, over the limit of {max_bytes}")
    return value


def trimmed_traceback(exc, filename):
    """The hook's own frames of a traceback, short enough for an audit line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    lines = [f'  line {f.lineno}, in {f.name}: {(f.line or "").strip()}' for f in frames[-5:]]
    head = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    text = "\n".join([head] + lines)
    return text if len(text) <= TRACEBACK_CHARS else text[: TRACEBACK_CHARS - 3] + "..."


class Hook:
    def __init__(self, index, spec):
        self.index = index
        self.name = str(spec.get("name", f"hook-{index}"))
        self.action = spec.get("action")
        self.settings_json = json.dumps(spec.get("settings") or {})
        self.filename = f"<hook {self.name}>"
        self.execute = None
        self.error = None
        self.line = None
        if self.action not in ACTIONS or self.action == "pass":
            self.error = f"declared action {self.action!r} is not one of modify, block, skip, detect"
            return
        try:
            code = compile(spec.get("code", ""), self.filename, "exec")
        except SyntaxError as e:
            self.line = e.lineno
            self.error = f"SyntaxError: {e.msg} (line {e.lineno})"
            return
        namespace = {"__name__": f"hook_{self.name}", "HostCallError": HostCallError}
        try:
            exec(code, namespace)
        except BaseException as e:  # a hook's module code may raise anything, SystemExit included
            self.error = trimmed_traceback(e, self.filename)
            frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == self.filename]
            self.line = frames[-1].lineno if frames else None
            return
        execute = namespace.get("execute")
        if not callable(execute):
            self.error = "the code does not define a function execute(context, settings)"
            return
        self.execute = execute

    def ack(self):
        out = {"name": self.name, "ok": self.error is None}
        if self.error is not None:
            out["error"] = self.error
            if self.line is not None:
                out["line"] = self.line
        return out


class Supervisor:
    def __init__(self, channel):
        self.channel = channel
        self.hooks = []
        self.trigger_point = None
        self.failure_policy = "Closed"
        self.limits = dict(DEFAULT_LIMITS)
        self.next_host_call = 0

    def init(self, msg):
        self.trigger_point = msg.get("trigger_point")
        self.failure_policy = msg.get("failure_policy", "Closed")
        self.limits.update(msg.get("limits") or {})
        self.hooks = [Hook(i, spec) for i, spec in enumerate(msg.get("hooks") or [])]
        self.channel.send({"type": "ack", "hooks": [h.ack() for h in self.hooks]})

    def host_call(self, run_id, hook, budget, name, payload):
        if budget[0] <= 0:
            raise HostCallError(f"host_call limit reached: at most {self.limits['host_calls']} per run")
        budget[0] -= 1
        if not isinstance(name, str) or not name:
            raise HostCallError("host_call needs a capability name")
        try:
            payload = bounded_json(payload, "host_call payload", self.limits["payload_bytes"], self.limits["depth"])
        except HookError as e:
            raise HostCallError(str(e)) from None
        self.next_host_call += 1
        call_id = self.next_host_call
        self.channel.send({"type": "host_call", "id": call_id, "run": run_id, "hook": hook.index, "name": name, "payload": payload})
        while True:
            reply = self.channel.receive()
            if reply is None:
                raise SystemExit(0)  # the gateway hung up; nothing left to answer
            if reply.get("type") == "host_result" and reply.get("id") == call_id:
                break
        if reply.get("ok"):
            return reply.get("result")
        raise HostCallError(str(reply.get("error") or "host_call failed"))

    def check_result(self, hook, ret):
        """Validates what a hook returned; raises HookError with the reason."""
        if not isinstance(ret, dict):
            raise HookError(f"execute returned {type(ret).__name__}, not a dict with an 'action'")
        action = ret.get("action")
        if action not in ACTIONS:
            raise HookError(f"returned action {action!r} is not one of {', '.join(ACTIONS)}")
        if action not in ("pass", hook.action):
            raise HookError(f"returned action {action!r} but declared {hook.action!r} (a hook may return only its declared action or pass)")
        out = {"action": action}
        if action == "modify":
            if "outgoing" not in ret:
                raise HookError("returned modify without 'outgoing'")
            outgoing = ret["outgoing"]
            if self.trigger_point in TEXT_TRIGGER_POINTS:
                if not isinstance(outgoing, str):
                    raise HookError(f"returned outgoing of type {type(outgoing).__name__}; {self.trigger_point} carries text (str)")
            elif not isinstance(outgoing, dict):
                raise HookError(f"returned outgoing of type {type(outgoing).__name__}; {self.trigger_point} carries an object (dict)")
            out["outgoing"] = bounded_json(outgoing, "outgoing", self.limits["payload_bytes"], self.limits["depth"])
        message = ret.get("message")
        if message is not None:
            if not isinstance(message, str):
                raise HookError(f"returned message of type {type(message).__name__}, not str")
            if len(message) > self.limits["message_chars"]:
                raise HookError(f"message is {len(message)} characters, over the limit of {self.limits['message_chars']}")
            out["message"] = message
        if "findings" in ret and ret["findings"] is not None:
            out["findings"] = bounded_json(ret["findings"], "findings", self.limits["findings_bytes"], self.limits["depth"])
        if "state" in ret:
            out["state"] = bounded_json(ret["state"], "state", self.limits["state_bytes"], self.limits["depth"])
        return out

    def chunk(self, msg):
        run_id = msg.get("id")
        payload = msg.get("outgoing")
        states = msg.get("state") or []
        base = msg.get("context") or {}
        start = int(msg.get("start", 0))
        budget = [int(self.limits["host_calls"])]
        terminal = None
        top = "pass"
        began = time.perf_counter()
        for hook in self.hooks[start:]:
            # The previous hook's result goes out before this hook runs, so that if this one kills
            # the sandbox the gateway still knows how far the walk got.
            self.channel.flush()
            result = {"type": "hook_result", "id": run_id, "index": hook.index, "name": hook.name}
            try:
                if hook.error is not None:
                    raise HookError(hook.error)
                ctx = Context(base)
                ctx["outgoing"] = payload
                ctx["state"] = states[hook.index] if hook.index < len(states) else None
                ctx["hook"] = hook.name
                ctx["host_call"] = lambda name, body=None, _h=hook: self.host_call(run_id, _h, budget, name, body)
                ret = hook.execute(ctx, json.loads(hook.settings_json))
                result.update(self.check_result(hook, ret))
            except HookError as e:
                result["action"] = "pass"
                result["error"] = str(e)
            except BaseException as e:  # SystemExit, KeyboardInterrupt and RecursionError are hook errors too
                result["action"] = "pass"
                result["error"] = trimmed_traceback(e, hook.filename)
            ended = time.perf_counter()  # one clock read per hook: each is a syscall under gVisor
            result["latency_us"] = int((ended - began) * 1e6)
            began = ended
            self.channel.send(result, flush=False)
            if "error" in result:
                if self.failure_policy == "Open":
                    continue
                terminal, top = hook.index, "block"
                break
            action = result["action"]
            if action == "modify":
                payload = result["outgoing"]
            if action in TERMINAL:
                terminal, top = hook.index, action
                break
            if action == "modify" or (action == "detect" and top == "pass"):
                top = action
        self.channel.send({"type": "result", "id": run_id, "action": top, "terminal_index": terminal})

    def serve(self):
        self.channel.send({"type": "ready", "protocol": PROTOCOL_VERSION, "pid": os.getpid()})
        while True:
            try:
                msg = self.channel.receive()
            except ValueError as e:
                self.channel.send({"type": "error", "message": f"malformed request: {e}"})
                continue
            if msg is None:
                return
            kind = msg.get("type") if isinstance(msg, dict) else None
            if kind == "init":
                self.init(msg)
            elif kind == "chunk":
                self.chunk(msg)
            elif kind == "shutdown":
                return
            else:
                self.channel.send({"type": "error", "message": f"unknown request type {kind!r}"})


# Modules hooks commonly use, imported before `ready` so that no warm-path run pays for reading them
# through the sandbox's filesystem.
PRELOAD = ("re", "unicodedata", "string", "math", "datetime", "collections", "itertools", "functools",
           "hashlib", "base64", "copy", "random", "textwrap", "difflib", "fnmatch", "decimal")


def preload():
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


class NullChannel:
    """Stands in for the protocol during warm-up: encodes like the real one, sends nothing."""

    def send(self, msg, flush=True):
        json.dumps(msg, separators=(",", ":"), ensure_ascii=False, allow_nan=False)

    def flush(self):
        pass

    def receive(self):
        return None


WARM_UP_HOOK = """
import re
PATTERN = re.compile(r"\\d{3}-\\d{4}")
def execute(context, settings):
    text = PATTERN.sub(settings["mask"], context["outgoing"])
    return {"action": "modify", "outgoing": text, "state": {"n": 1}, "findings": {"k": [1, 2]}}
"""


def warm_up():
    """Runs one synthetic init and walk before `ready`, so the first real trigger point finds the
    interpreter's code paths and memory already warm (first touches are slow inside gVisor)."""
    sup = Supervisor(NullChannel())
    sup.init({"trigger_point": "input", "hooks": [{"name": "warm", "action": "modify", "code": WARM_UP_HOOK, "settings": {"mask": "#"}}]})
    payload = json.loads(json.dumps({"outgoing": "call 555-1234 " * 300, "state": [None], "context": {"caller": {}}}))
    sup.chunk({"id": 0, "outgoing": payload["outgoing"], "state": payload["state"], "context": payload["context"]})


def limit_memory():
    """Applies SLUICE_MEMORY_BYTES as an address-space limit so a memory bomb raises MemoryError in
    the hook; the sandbox's cgroup limit stays the hard stop behind it."""
    raw = os.environ.pop("SLUICE_MEMORY_BYTES", "")
    if raw.isdigit():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (int(raw), int(raw)))


def main():
    channel = Channel()
    preload()
    warm_up()
    limit_memory()
    sys.setrecursionlimit(2000)
    Supervisor(channel).serve()


if __name__ == "__main__":
    main()
