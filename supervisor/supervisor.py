"""Sluice supervisor: runs one chain's hooks inside a sandbox, driven by the gateway.

Standard library only. The wire protocol (supervisor/PROTOCOL.md) is newline-delimited JSON: requests
arrive on the process's original stdin, every answer leaves on its original stderr. Before any hook
runs, the supervisor moves both protocol descriptors out of the way and points fds 0, 1 and 2 at
/dev/null and the (drained, discarded) stdout, so nothing a hook prints can break framing.

Each hook runs in a worker process of its own, forked before any hook code exists (so a worker holds
nothing of another hook), holding only a private pipe to the supervisor: never the protocol
descriptors. Globals, imported and monkeypatched modules, threads and memory of one hook are out of
reach of every other. After each hook call the supervisor kills the processes the hook left behind,
retires a worker that left threads running, and empties /tmp, so nothing of one hook is there when the
next one runs.

The supervisor walks the chain itself and applies the same checks the gateway re-applies on the
trusted side: declared action or pass, types, size and depth bounds.
"""

import json
import os
import select
import signal
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
    """The protocol descriptors: newline-delimited JSON in on `reader`, out on `writer`."""

    def __init__(self, reader, writer):
        self.reader = reader
        self.writer = writer

    @classmethod
    def from_stdio(cls):
        """Takes the process's stdin and stderr as the protocol before any hook code runs."""
        proto_in = os.dup(0)  # os.dup makes non-inheritable descriptors: child processes never get them
        proto_out = os.dup(2)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(1, 2)  # a hook's stderr joins its stdout, which the gateway drains and discards
        os.close(devnull)
        sys.stdin = open(os.devnull, "r")
        sys.stdout = os.fdopen(os.dup(1), "w", buffering=1, errors="replace")
        sys.stderr = sys.stdout
        return cls(os.fdopen(proto_in, "rb", buffering=1 << 16), os.fdopen(proto_out, "wb", buffering=1 << 16))

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
    """A hook as the supervisor knows it: its spec and the worker process that runs it."""

    def __init__(self, index, spec):
        self.index = index
        self.spec = spec
        self.name = str(spec.get("name", f"hook-{index}"))
        self.action = spec.get("action")
        self.worker = None
        self.execute = None
        self.load_sent = False
        self.error = None
        self.line = None
        if self.action not in ACTIONS or self.action == "pass":
            self.error = f"declared action {self.action!r} is not one of modify, block, skip, detect"

    def ack(self):
        out = {"name": self.name, "ok": self.error is None}
        if self.error is not None:
            out["error"] = self.error
            if self.line is not None:
                out["line"] = self.line
        return out


# ---------------------------------------------------------------------------------------- worker


def worker_main(rfd, wfd, memory_bytes):
    """Runs in a forked worker: loads one hook and answers calls over its private pipe. Anything
    here may be tampered with by the hook itself; the supervisor trusts none of what comes back."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: other hooks cannot ptrace or read our memory
    except Exception:
        pass
    if memory_bytes:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    reader = os.fdopen(rfd, "rb", buffering=1 << 16)
    writer = os.fdopen(wfd, "wb", buffering=1 << 16)
    # A forked process pays for every page it touches first (copy-on-write faults are slow inside
    # gVisor): touch them now, before the sandbox is ready, not during a hook's first call.
    warm_up()
    import gc

    gc.collect()

    def send(msg):
        writer.write(json.dumps(msg, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8", "surrogatepass") + b"\n")
        writer.flush()

    execute = None
    filename = "<hook>"
    send({"op": "ready"})
    while True:
        line = reader.readline()
        if not line:
            os._exit(0)
        msg = json.loads(line)
        op = msg.get("op")
        if op == "load":
            filename = f"<hook {msg['name']}>"
            execute, error, lineno = load_hook(msg["name"], msg.get("code", ""), filename)
            send({"op": "loaded", "error": error, "line": lineno})
        elif op == "call":

            def host_call(name, payload=None):
                try:
                    send({"op": "host_call", "name": name, "payload": payload})
                except (TypeError, ValueError) as e:
                    raise HostCallError(f"host_call payload is not JSON-serializable: {e}") from None
                reply = json.loads(reader.readline() or b"{}")
                if reply.get("ok"):
                    return reply.get("result")
                raise HostCallError(str(reply.get("error") or "host_call failed"))

            ctx = Context(msg.get("context") or {})
            ctx["outgoing"] = msg.get("outgoing")
            ctx["state"] = msg.get("state")
            ctx["hook"] = msg.get("hook")
            ctx["host_call"] = host_call
            try:
                ret = execute(ctx, msg.get("settings") or {})
                try:
                    send({"op": "return", "value": ret})
                except (TypeError, ValueError, RecursionError) as e:
                    send({"op": "return", "error": f"execute returned something that is not JSON-serializable: {e}"})
            except BaseException as e:  # SystemExit, KeyboardInterrupt, MemoryError: hook errors too
                send({"op": "return", "error": trimmed_traceback(e, filename)})


def load_hook(name, code, filename):
    """Compiles and runs a hook's module code into a fresh namespace: (execute, error, line)."""
    try:
        compiled = compile(code, filename, "exec")
    except SyntaxError as e:
        return None, f"SyntaxError: {e.msg} (line {e.lineno})", e.lineno
    namespace = {"__name__": f"hook_{name}", "HostCallError": HostCallError}
    try:
        exec(compiled, namespace)
    except BaseException as e:  # a hook's module code may raise anything, SystemExit included
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == filename]
        return None, trimmed_traceback(e, filename), (frames[-1].lineno if frames else None)
    execute = namespace.get("execute")
    if not callable(execute):
        return None, "the code does not define a function execute(context, settings)", None
    return execute, None, None


class Worker:
    """The supervisor's handle on one worker process."""

    def __init__(self, memory_bytes):
        p2c_r, p2c_w = os.pipe()
        c2p_r, c2p_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(p2c_w)
                os.close(c2p_r)
                # Only the private pipe and fds 0-2 survive: never the protocol descriptors.
                for fd in [int(f) for f in os.listdir("/proc/self/fd")]:
                    if fd > 2 and fd not in (p2c_r, c2p_w):
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                sys.stdout = sys.stderr = os.fdopen(1, "w", buffering=1, errors="replace", closefd=False)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                worker_main(p2c_r, c2p_w, memory_bytes)
            finally:
                os._exit(1)
        os.close(p2c_r)
        os.close(c2p_w)
        self.pid = pid
        self.writer = os.fdopen(p2c_w, "wb", buffering=1 << 16)
        self.reader = os.fdopen(c2p_r, "rb", buffering=1 << 16)
        self.dead = False
        self.started = False

    def wait_started(self):
        """Waits for the worker's warm-up to finish."""
        if not self.started:
            self.started = True
            reply = self.receive(1024)
            if not reply or reply.get("op") != "ready":
                self.kill()

    def send(self, msg):
        try:
            self.writer.write(json.dumps(msg, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8", "surrogatepass") + b"\n")
            self.writer.flush()
            return True
        except (OSError, ValueError):
            self.dead = True
            return False

    def receive(self, limit):
        """The worker's next message, or None when it died or sent something malformed or too long."""
        try:
            line = self.reader.readline(limit + 1)
        except (OSError, ValueError):
            line = b""
        if not line or not line.endswith(b"\n"):
            self.kill()
            return None if not line else {"op": "too_long"}
        try:
            msg = json.loads(line)
        except ValueError:
            self.kill()
            return {"op": "malformed"}
        return msg if isinstance(msg, dict) else {"op": "malformed"}

    def threads(self):
        try:
            return len(os.listdir(f"/proc/{self.pid}/task"))
        except OSError:
            return 1

    def kill(self):
        if not self.dead:
            self.dead = True
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        for f in (self.writer, self.reader):
            try:
                f.close()
            except OSError:
                pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


# ------------------------------------------------------------------------------------ supervisor


class Supervisor:
    def __init__(self, channel, prefork=0, memory_bytes=0):
        self.channel = channel
        self.hooks = []
        self.trigger_point = None
        self.failure_policy = "Closed"
        self.limits = dict(DEFAULT_LIMITS)
        self.next_host_call = 0
        self.memory_bytes = memory_bytes
        self.sandboxed = in_sandbox()
        # Workers forked before any hook code exists: the claim path never pays for a fork.
        self.spare = [Worker(memory_bytes) for _ in range(prefork)]
        for w in self.spare:
            w.wait_started()
        self.last_ran = None
        self.inline = False
        self.tmp_mtime = None
        # Processes of the sandbox that are not the chain's and must survive clean_up: in a pod, the
        # exec'd relay (attach.py) whose pipes carry the protocol.
        self.keep_pids = set()

    def worker(self):
        w = self.spare.pop() if self.spare else Worker(self.memory_bytes)
        w.wait_started()
        return w

    def load(self, hook):
        """Gives the hook a worker and loads its code there (or, for a chain of one hook, here)."""
        if self.inline:
            hook.execute, error, line = load_hook(hook.name, hook.spec.get("code", ""), f"<hook {hook.name}>")
            return error, line
        self.start_load(hook)
        return self.finish_load(hook)

    def start_load(self, hook):
        hook.worker = self.worker()
        hook.load_sent = hook.worker.send({"op": "load", "name": hook.name, "code": hook.spec.get("code", "")})

    def finish_load(self, hook):
        if not hook.load_sent:
            return "the hook's process could not start", None
        reply = hook.worker.receive(self.limits["payload_bytes"])
        if not reply or reply.get("op") != "loaded":
            return "the hook's process died while loading its code", None
        return reply.get("error"), reply.get("line")

    def init(self, msg):
        self.trigger_point = msg.get("trigger_point")
        self.failure_policy = msg.get("failure_policy", "Closed")
        self.limits.update(msg.get("limits") or {})
        self.hooks = [Hook(i, spec) for i, spec in enumerate(msg.get("hooks") or [])]
        # A chain of one hook has no other hook to be isolated from (the sandbox itself is its
        # boundary), so it runs here without a worker's extra hop.
        self.inline = len(self.hooks) == 1
        if self.inline and self.memory_bytes:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (self.memory_bytes, self.memory_bytes))
        pending = [h for h in self.hooks if h.error is None]
        if self.inline:
            for hook in pending:
                hook.error, hook.line = self.load(hook)
        else:
            # All workers load at once: their compiles overlap instead of queueing.
            for hook in pending:
                self.start_load(hook)
            for hook in pending:
                hook.error, hook.line = self.finish_load(hook)
                # Module code that started a thread leaves it in this worker: retire the worker now;
                # the hook gets a fresh one (and runs its module code again) when it is called.
                if not hook.worker.dead and hook.worker.threads() > 1:
                    hook.worker.kill()
        self.clean_up()
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

    def call(self, run_id, hook, budget, payload, state, context):
        """Runs one hook in its worker; returns what it returned (a dict) or raises HookError."""
        if self.inline:
            return self.call_inline(run_id, hook, budget, payload, state, context)
        if hook.worker is None or hook.worker.dead:
            if hook.worker is not None:
                hook.worker.kill()  # closes its pipes; it is already dead
            error, _ = self.load(hook)  # its process died or was retired: a fresh one
            if error:
                raise HookError(error)
        w = hook.worker
        request = {"op": "call", "outgoing": payload, "state": state, "context": context, "hook": hook.name, "settings": hook.spec.get("settings") or {}}
        if not w.send(request):
            raise HookError("the hook's process died")
        limit = self.limits["payload_bytes"] * 2 + self.limits["state_bytes"] + self.limits["findings_bytes"] + 4096
        while True:
            msg = w.receive(limit)
            op = msg.get("op") if msg else None
            if op == "host_call":
                try:
                    answer = {"op": "host_result", "ok": True, "result": self.host_call(run_id, hook, budget, msg.get("name"), msg.get("payload"))}
                except HostCallError as e:
                    answer = {"op": "host_result", "ok": False, "error": str(e)}
                if not w.send(answer):
                    raise HookError("the hook's process died during a host_call")
            elif op == "return":
                if msg.get("error") is not None:
                    raise HookError(str(msg["error"]))
                return msg.get("value")
            elif op == "too_long":
                raise HookError(f"the hook returned more than {limit} bytes")
            elif msg is None:
                raise HookError("the hook's process died (killed, out of memory, or it exited)")
            else:
                w.kill()
                raise HookError("the hook's process sent a malformed message")

    def call_inline(self, run_id, hook, budget, payload, state, context):
        ctx = Context(context)
        ctx["outgoing"] = payload
        ctx["state"] = state
        ctx["hook"] = hook.name
        ctx["host_call"] = lambda name, body=None: self.host_call(run_id, hook, budget, name, body)
        try:
            ret = hook.execute(ctx, json.loads(json.dumps(hook.spec.get("settings") or {})))
        except BaseException as e:  # SystemExit, KeyboardInterrupt, MemoryError: hook errors too
            raise HookError(trimmed_traceback(e, f"<hook {hook.name}>")) from None
        try:
            # What crosses back is plain JSON, exactly as from a worker.
            return json.loads(json.dumps(ret, allow_nan=False))
        except (TypeError, ValueError, RecursionError) as e:
            raise HookError(f"execute returned something that is not JSON-serializable: {e}") from None

    def clean_up(self):
        """What a hook may leave behind is removed before the next one runs: processes other than the
        supervisor and its workers, workers with threads still running, and everything in /tmp.
        Only inside a sandbox (see in_sandbox: the supervisor is its pid 1, in local mode and in a pod):
        anywhere else killing "every other process" and emptying /tmp would hit the host."""
        if not self.sandboxed or self.inline:
            return
        ran, self.last_ran = self.last_ran, None
        if ran is not None and ran.worker is not None and not ran.worker.dead and ran.worker.threads() > 1:
            ran.worker.kill()  # threads it left could act while another hook runs
        workers = {h.worker.pid: h for h in self.hooks if h.worker is not None and not h.worker.dead}
        workers.update({w.pid: None for w in self.spare})
        # pid 1 is us (local mode, and a pod's `--listen`), its relay must outlive every hook.
        keep = {1, os.getpid()} | self.keep_pids | {pid for pid, h in workers.items() if h is None or not h.worker.dead}
        killed = False
        try:
            for entry in os.listdir("/proc"):
                if entry.isdigit() and int(entry) not in keep:
                    try:
                        os.kill(int(entry), signal.SIGKILL)
                        killed = True
                    except OSError:
                        pass
        except OSError:
            pass
        if killed:
            self.reap()
        else:
            self.reap(wait=False)  # a hook may have killed another hook's idle worker
        # /tmp changes its mtime whenever an entry is added or removed: a stat is cheaper than a scan.
        try:
            mtime = os.stat("/tmp").st_mtime_ns
        except OSError:
            mtime = None
        if mtime is None or mtime != self.tmp_mtime:
            try:
                with os.scandir("/tmp") as entries:
                    leftovers = [e.path for e in entries]
            except OSError:
                leftovers = []
            for path in leftovers:
                remove(path)
            try:
                self.tmp_mtime = os.stat("/tmp").st_mtime_ns
            except OSError:
                self.tmp_mtime = None

    def top_up(self, prefork):
        """Replaces spare workers that died while waiting (a pod waits for its claim indefinitely)."""
        self.reap(wait=False)
        while len(self.spare) < prefork:
            w = Worker(self.memory_bytes)
            w.wait_started()
            if w.dead:
                return False
            self.spare.append(w)
        return True

    def reap(self, wait=True):
        """Collects exited processes (orphans are re-parented to pid 1: the supervisor) and marks
        workers that died, so their hook gets a fresh one on its next call."""
        workers = {h.worker.pid for h in self.hooks if h.worker is not None} | {w.pid for w in self.spare}
        deadline = time.monotonic() + 0.2 if wait else None
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                if deadline is None or time.monotonic() >= deadline:
                    return
                time.sleep(0.001)
                continue
            if pid in workers:
                for h in self.hooks:
                    if h.worker is not None and h.worker.pid == pid:
                        h.worker.dead = True
                        h.worker.reaped = True
                for w in [w for w in self.spare if w.pid == pid]:
                    w.kill()  # closes its pipes; already reaped
                    self.spare.remove(w)

    def check_result(self, hook, ret):
        """Validates what a hook returned; raises HookError with the reason."""
        if not isinstance(ret, dict):
            raise HookError(f"execute returned {json_type(ret)}, not a dict with an 'action'")
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
                    raise HookError(f"returned outgoing of type {json_type(outgoing)}; {self.trigger_point} carries text (str)")
            elif not isinstance(outgoing, dict):
                raise HookError(f"returned outgoing of type {json_type(outgoing)}; {self.trigger_point} carries an object (dict)")
            out["outgoing"] = bounded_json(outgoing, "outgoing", self.limits["payload_bytes"], self.limits["depth"])
        message = ret.get("message")
        if message is not None:
            if not isinstance(message, str):
                raise HookError(f"returned message of type {json_type(message)}, not str")
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
            if self.last_ran is not None:
                self.clean_up()  # what the previous hook left is gone before this one runs
            result = {"type": "hook_result", "id": run_id, "index": hook.index, "name": hook.name}
            try:
                if hook.error is not None:
                    raise HookError(hook.error)
                state = states[hook.index] if hook.index < len(states) else None
                self.last_ran = hook
                ret = self.call(run_id, hook, budget, payload, state, base)
                result.update(self.check_result(hook, ret))
            except HookError as e:
                result["action"] = "pass"
                result["error"] = str(e)
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
        if self.last_ran is not None:
            self.clean_up()  # after the answer is out: off the critical path, before any next chunk

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


def in_sandbox():
    """Whether this process owns everything around it, so that clean_up may kill every other process
    and empty /tmp: inside a sandbox (SLUICE_SANDBOX=1) as its pid 1, which the supervisor is both in
    local mode and as a warm pod's main process (`--listen`). Anywhere else that would hit the host."""
    return os.environ.get("SLUICE_SANDBOX") == "1" and os.getpid() == 1


def json_type(value):
    return {dict: "dict", list: "list", str: "str", bool: "bool", int: "int", float: "float", type(None): "None"}.get(type(value), type(value).__name__)


def remove(path):
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            for entry in os.listdir(path):
                remove(os.path.join(path, entry))
            os.rmdir(path)
        else:
            os.unlink(path)
    except OSError:
        pass


# Modules hooks commonly use, imported before `ready` (and before the workers fork) so that no
# warm-path run pays for reading them through the sandbox's filesystem.
PRELOAD = ("re", "unicodedata", "string", "math", "datetime", "collections", "itertools", "functools",
           "hashlib", "base64", "copy", "random", "textwrap", "difflib", "fnmatch", "decimal", "ctypes", "resource")


def preload():
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


WARM_UP_HOOK = """
import re
PATTERN = re.compile(r"\\\\d{3}-\\\\d{4}")
def execute(context, settings):
    text = PATTERN.sub("#", context["outgoing"])
    return {"action": "modify", "outgoing": text, "state": {"n": 1}, "findings": {"k": [1, 2]}}
"""


def warm_up():
    """Exercises the interpreter's code paths (compile, regex, JSON) before the workers fork, so the
    first real trigger point finds them warm (first touches are slow inside gVisor)."""
    namespace = {}
    exec(compile(WARM_UP_HOOK, "<warm-up>", "exec"), namespace)
    payload = json.loads(json.dumps({"outgoing": "call 555-1234 " * 300, "state": [None]}))
    ret = namespace["execute"](Context(outgoing=payload["outgoing"], state=None), {})
    bounded_json(ret, "warm-up", 1 << 20, 32)


# ------------------------------------------------------------------------------ command line

USAGE = "usage: supervisor.py [--listen | --probe] [--workers N] [--memory-bytes BYTES] [--pids N]"


# Processes of the sandbox user that are not the chain's: in a pod, the attach relay and a readiness probe.
PIDS_ALLOWANCE = 4


class UsageError(Exception):
    pass


def parse_args(argv):
    """The command line: a mode (serve, the default; listen; probe) and the sandbox settings.
    Hand-rolled rather than argparse: every module read costs time inside gVisor."""
    opts = {"mode": "serve", "workers": None, "memory_bytes": None, "pids": None}
    args = list(argv)
    while args:
        arg, _, value = args.pop(0).partition("=")
        if arg in ("--listen", "--probe") and not value:
            if opts["mode"] != "serve":
                raise UsageError("--listen and --probe exclude each other")
            opts["mode"] = arg[2:]
        elif arg in ("--workers", "--memory-bytes", "--pids"):
            if not value:
                value = args.pop(0) if args else ""
            if not (value.isascii() and value.isdigit()):
                raise UsageError(f"{arg} needs a non-negative integer, not {value!r}")
            opts[arg[2:].replace("-", "_")] = int(value)
        else:
            raise UsageError(f"unknown argument {arg!r}")
    return opts


ATTACH_ADDRESS = "@sluice-supervisor"


def attach_address():
    """The abstract unix socket a warm pod's supervisor listens on (attach.py has the same rule)."""
    name = os.environ.pop("SLUICE_ATTACH", "") or ATTACH_ADDRESS
    return "\0" + name[1:] if name.startswith("@") else name


def listen(opts, log):
    """A warm pod's main process (pid 1). Everything that does not depend on the chain happens before
    the pod turns Ready: modules, warm-up, the hook workers. Then it waits for exactly one attach
    (attach.py, exec'd by the gateway once the pod is claimed), which hands over the exec's stdin,
    stdout and stderr; the protocol runs over them and, when the gateway closes stdin, the status goes
    back to the relay and the supervisor exits, ending the pod. Readiness probes (`attach.py
    --probe`) get "ready" while it waits with its workers alive. Returns the exit status."""
    import socket

    address = attach_address()
    supervisor = Supervisor(None, prefork=opts["workers"], memory_bytes=opts["memory_bytes"])
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(address)
    except OSError as e:
        log(f"cannot listen on {address!r}: {e}")
        return 1
    server.listen(16)
    log(f"ready: {opts['workers']} workers, waiting for the gateway's attach")
    while True:
        conn, _ = server.accept()
        fds = []
        try:
            conn.settimeout(5)
            request, fds, _, _ = socket.recv_fds(conn, 64, 3)
            verb, _, pid = request.partition(b" ")
            if request == b"probe":
                conn.sendall(b"ready" if supervisor.top_up(opts["workers"]) else b"a hook worker could not start")
            elif verb == b"attach" and pid.isdigit() and len(fds) == 3:
                break
            else:
                conn.sendall(b"unknown request")
        except OSError:
            pass  # a client that went away or sent nothing in time: wait for the next one
        for fd in fds:
            os.close(fd)
        conn.close()
    server.close()  # one attach per pod: a second exec finds no one listening
    # The relay names its own pid (gVisor's SO_PEERCRED does not): clean_up must spare it, as its
    # exit would end the exec. Before this attach no hook code exists here, so nothing else can ask.
    supervisor.keep_pids.add(int(pid))
    conn.settimeout(None)
    proto_in, hook_out, proto_out = fds
    os.close(hook_out)  # hooks print to /dev/null here: the exec's stdout stays empty
    supervisor.channel = Channel(os.fdopen(proto_in, "rb", buffering=1 << 16), os.fdopen(proto_out, "wb", buffering=1 << 16))
    supervisor.serve()
    try:
        conn.sendall(b"\0")
    except OSError:
        pass
    return 0


PROBE_HOOK = "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': context['outgoing'].upper()}\n"


def probe(code=PROBE_HOOK):
    """Readiness: one chain of one hook through the real protocol code (Channel, init, chunk) in this
    process, over a pair of pipes. Returns 0 when every answer is right, else 1 with the reason on
    stderr. Leaves nothing behind: a one-hook chain runs inline (no worker), and nothing is written."""
    requests = [
        {"type": "init", "trigger_point": "input", "failure_policy": "Closed",
         "hooks": [{"name": "probe", "action": "modify", "settings": {}, "code": code}]},
        {"type": "chunk", "id": 1, "start": 0, "outgoing": "ready?", "state": [None], "context": {}},
        {"type": "shutdown"},
    ]
    want = [
        {"type": "ready", "protocol": PROTOCOL_VERSION, "pid": os.getpid()},
        {"type": "ack", "hooks": [{"name": "probe", "ok": True}]},
        {"type": "hook_result", "id": 1, "index": 0, "name": "probe", "action": "modify", "outgoing": "READY?"},
        {"type": "result", "id": 1, "action": "modify", "terminal_index": None},
    ]
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    try:
        with os.fdopen(req_w, "wb") as w:  # a few hundred bytes: fits in the pipe before anyone reads
            w.write(b"".join(json.dumps(r).encode() + b"\n" for r in requests))
        with os.fdopen(req_r, "rb") as reader, os.fdopen(resp_w, "wb") as writer:
            Supervisor(Channel(reader, writer)).serve()
        with os.fdopen(resp_r, "rb") as r:
            got = [json.loads(line) for line in r]
    except Exception as e:
        print(f"sluice supervisor probe failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for answer in got:
        answer.pop("latency_us", None)
    if got != want:
        print(f"sluice supervisor probe failed: answers {json.dumps(got)}, expected {json.dumps(want)}", file=sys.stderr)
        return 1
    return 0


def main(argv=None):
    try:
        opts = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"{USAGE}\nsupervisor.py: {e}", file=sys.stderr)
        return 2
    if opts["mode"] == "probe":
        return probe()
    if opts["mode"] == "listen":
        # pid 1 gets no default signal handling: the pod's SIGTERM must end it.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        log = pod_log()
    else:
        channel = Channel.from_stdio()
    preload()
    warm_up()
    # Local mode passes these as env vars, a pod as flags (the flags win); hooks see neither.
    memory = os.environ.pop("SLUICE_MEMORY_BYTES", "")
    prefork = os.environ.pop("SLUICE_WORKERS", "")
    if opts["memory_bytes"] is None:
        opts["memory_bytes"] = int(memory) if memory.isdigit() else 0
    if opts["workers"] is None:
        opts["workers"] = int(prefork) if prefork.isdigit() else 0
    if opts["pids"]:
        import resource

        # In a pod the pids cgroup is the node's (podPidsLimit), not the chain's: the chain's limit
        # holds as RLIMIT_NPROC for the sandbox user, counted with the pod's own processes (the
        # attach relay, a probe) — hence the small allowance on top.
        limit = opts["pids"] + PIDS_ALLOWANCE
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    sys.setrecursionlimit(2000)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if opts["mode"] == "listen":
        return listen(opts, log)
    Supervisor(channel, prefork=opts["workers"], memory_bytes=opts["memory_bytes"]).serve()
    return 0


def pod_log():
    """Points fds 0, 1 and 2 at /dev/null before any worker forks (what hooks print in a pod goes
    nowhere: not into the node's container logs) and returns a logger onto the container's original
    stderr, for the supervisor's own lines (`kubectl logs`)."""
    original = os.dup(2)  # non-inheritable: workers never get it
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    sys.stdin = open(os.devnull, "r")
    sys.stdout = sys.stderr = os.fdopen(os.dup(1), "w", buffering=1, errors="replace")

    def log(line):
        try:
            os.write(original, f"sluice supervisor: {line}\n".encode("utf-8", "replace"))
        except OSError:
            pass

    return log


if __name__ == "__main__":
    sys.exit(main())
