"""Sluice supervisor: runs one chain's hooks inside a sandbox, driven by the gateway.

Standard library only. The wire protocol (supervisor/PROTOCOL.md) is newline-delimited JSON: requests
arrive on the process's original stdin, every answer leaves on its original stderr. Before anything
else, the supervisor moves both protocol descriptors out of the way and points fds 0, 1 and 2 at
/dev/null and the (drained, discarded) stdout, so nothing a hook prints can break framing.

The supervisor never runs hook code. Every trigger point runs in a fresh **cell**: each of its hooks
is a process of its own, forked from a clean zygote (imports done, no hook code, no payload ever
seen), in its own user, pid, mount, ipc, net and uts namespaces, with a private /tmp and /dev/shm, its
own /proc, no capabilities, no descriptor but its own pipe pair, and a reseeded `random`. Killing a
hook's process (pid 1 of its pid namespace) ends everything it started, and its mounts and IPC
objects go with the namespaces. So no hook reaches the supervisor, another hook, or anything of
another trigger point, and a sandbox can serve trigger point after trigger point.

Reading order: the protocol channel → the kernel calls (ctypes) → a hook's own process → the zygote
that makes them → the supervisor's side of a cell → the protocol loop → the command line.
"""

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

PROTOCOL_VERSION = 2
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
# A cell's processes get this long to die after SIGKILL before the sandbox is reported dirty.
TEARDOWN_SECONDS = 2.0
# What a hook's process may find in its environment (the sandbox's own settings are not in it).
CELL_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


class HostCallError(Exception):
    """Raised inside a hook when a host_call is denied or fails; the message says why."""


class HookError(Exception):
    """A hook broke the rules (wrong return, too large, undeclared action) or its process failed."""


class CellError(Exception):
    """A cell could not be made: the sandbox cannot isolate hooks, so it must not serve them."""


class Context(dict):
    """What a hook's execute receives: a dict that also allows attribute access and host_call."""

    __slots__ = ()

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def dumps(msg):
    return json.dumps(msg, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8", "surrogatepass") + b"\n"


class Channel:
    """The protocol descriptors: newline-delimited JSON in on `reader`, out on `writer`."""

    def __init__(self, reader, writer):
        self.reader = reader
        self.writer = writer

    @classmethod
    def from_stdio(cls):
        """Takes the process's stdin and stderr as the protocol before anything else runs."""
        proto_in = os.dup(0)
        proto_out = os.dup(2)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(1, 2)  # what a hook writes to stderr joins stdout, which the gateway drains and discards
        os.close(devnull)
        # Python's own files stay on fds 0 and 1: a file object on a descriptor of its own would be
        # closed by the cells' fd clean-up, and its finaliser could later close a reused number.
        sys.stdin = os.fdopen(0, "r", closefd=False)
        sys.stdout = sys.stderr = os.fdopen(1, "w", buffering=1, errors="replace", closefd=False)
        return cls(os.fdopen(proto_in, "rb", buffering=1 << 16), os.fdopen(proto_out, "wb", buffering=1 << 16))

    def send(self, msg, flush=True):
        self.writer.write(dumps(msg))
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
        size = len(dumps(value)) - 1
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


def json_type(value):
    return {dict: "dict", list: "list", str: "str", bool: "bool", int: "int", float: "float", type(None): "None"}.get(type(value), type(value).__name__)


# ------------------------------------------------------------------------------- kernel calls


class Kernel:
    """The Linux calls Python 3.11 lacks (unshare, mount, capset, prctl), through ctypes."""

    NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
    NAMESPACES = {"user": NEWUSER, "pid": NEWPID, "mount": NEWNS, "ipc": NEWIPC, "net": NEWNET, "uts": NEWUTS}
    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
    PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 24, 36, 38
    PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4

    def __init__(self):
        import ctypes

        self.ctypes = ctypes
        self.libc = ctypes.CDLL(None, use_errno=True)

    def check(self, what, result):
        if result != 0:
            errno = self.ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def unshare(self, flags):
        self.check("unshare", self.libc.unshare(flags))

    def mount(self, source, target, fstype, flags, data=None):
        enc = lambda s: None if s is None else s.encode()  # noqa: E731
        self.check(f"mount {target}", self.libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)))

    def prctl(self, option, arg=0):
        self.check(f"prctl {option}", self.libc.prctl(option, arg, 0, 0, 0))

    def drop_capabilities(self):
        """Empties the bounding, ambient, effective, permitted and inheritable sets: nothing the
        process or its children run can act with privilege, even inside its own user namespace."""
        ctypes = self.ctypes
        for cap in range(64):
            if self.libc.prctl(self.PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                break  # EINVAL past the last capability this kernel knows
        self.libc.prctl(self.PR_CAP_AMBIENT, self.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)

        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        class Data(ctypes.Structure):
            _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

        self.check("capset", self.libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()))
        self.prctl(self.PR_SET_NO_NEW_PRIVS, 1)


# ----------------------------------------------------------------------- a hook's own process


def hook_process_main(reader, writer, opts):
    """Runs in a hook's process, inside its cell: loads the hook's code when asked and answers calls
    over its private pipe pair. Anything here may be tampered with by the hook itself; the
    supervisor trusts nothing that comes back."""

    def send(msg):
        writer.write(dumps(msg))
        writer.flush()

    execute = None
    settings = "{}"
    filename = "<hook>"
    while True:
        line = reader.readline()
        if not line:
            os._exit(0)
        msg = json.loads(line)
        op = msg.get("op")
        if op == "load":
            filename = f"<hook {msg['name']}>"
            settings = json.dumps(msg.get("settings") or {})
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
                ret = execute(ctx, json.loads(settings))  # a fresh copy per call
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


# -------------------------------------------------------------------------------- the zygote


def zygote_main(control, opts):
    """The zygote: forked from the supervisor before any request was read, so it holds no hook code
    and has never seen a payload; it stays that way, because all it ever does is fork. For each
    `spawn` on its control socket it makes a pipe pair, forks the hook's process (see
    `enter_cell`) and hands the supervisor's ends back over the socket (SCM_RIGHTS)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the intermediate processes reap themselves
    while True:
        try:
            request = control.recv(64)
        except InterruptedError:
            continue
        if request != b"spawn":
            os._exit(0)  # the supervisor is gone (or mad): nothing is left to fork for
        to_hook_r, to_hook_w = os.pipe()
        from_hook_r, from_hook_w = os.pipe()
        try:
            pid = os.fork()
        except OSError as e:
            control.sendall(f"error fork: {e}".encode())
            pid = None
        if pid == 0:
            try:
                control.close()
                os.close(to_hook_w)
                os.close(from_hook_r)
                enter_cell(to_hook_r, from_hook_w, opts)
            finally:
                os._exit(1)
        if pid is not None:
            socket.send_fds(control, [b"ok"], [to_hook_w, from_hook_r])
        for fd in (to_hook_r, to_hook_w, from_hook_r, from_hook_w):
            os.close(fd)


def enter_cell(rfd, wfd, opts):
    """In the zygote's child: unshares every namespace, maps the sandbox user onto itself, forks
    the hook's process as pid 1 of the new pid namespace, reports that process's pid (as the
    supervisor sees it) on the hook's pipe, and exits. Errors go the same way, as `error`."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    writer = os.fdopen(wfd, "wb", buffering=0)
    kernel = Kernel()
    uid, gid = os.getuid(), os.getgid()  # inside the new user namespace they read as unmapped
    try:
        flags = 0
        for name in opts["namespaces"]:
            flags |= Kernel.NAMESPACES[name]
        kernel.unshare(flags)
        if "user" in opts["namespaces"]:
            try:
                with open("/proc/self/setgroups", "w") as f:
                    f.write("deny")
            except OSError:
                pass  # gVisor has no setgroups file; it maps gids without it
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"{uid} {uid} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"{gid} {gid} 1")
        pid = os.fork()
    except OSError as e:
        writer.write(dumps({"op": "error", "error": f"cannot create a cell: {e}"}))
        os._exit(1)
    if pid == 0:
        try:
            hook_process_setup(kernel, rfd, writer, opts)
        except BaseException as e:  # never a traceback on a descriptor the gateway reads
            writer.write(dumps({"op": "error", "error": f"the hook's process failed: {type(e).__name__}: {e}"}))
        os._exit(1)
    writer.write(dumps({"op": "pid", "pid": pid}))
    os._exit(0)


def hook_process_setup(kernel, rfd, writer, opts):
    """The hook's process, pid 1 of its pid namespace: private mounts, no privileges, only its own
    descriptors, bounded memory, fresh randomness; then it serves its hook."""
    try:
        kernel.mount(None, "/", None, Kernel.MS_REC | Kernel.MS_PRIVATE)
        tmp_options = f"size={opts['tmp_bytes']},mode=1777"
        kernel.mount("tmpfs", "/tmp", "tmpfs", Kernel.MS_NOSUID | Kernel.MS_NODEV, tmp_options)
        if os.path.isdir("/dev/shm"):
            kernel.mount("tmpfs", "/dev/shm", "tmpfs", Kernel.MS_NOSUID | Kernel.MS_NODEV, tmp_options)
        kernel.mount("proc", "/proc", "proc", Kernel.MS_NOSUID | Kernel.MS_NODEV | Kernel.MS_NOEXEC)
        kernel.drop_capabilities()
        keep = {0, 1, 2, rfd, writer.fileno()}
        for fd in [int(f) for f in os.listdir("/proc/self/fd")]:
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass  # the descriptor listdir itself used
        if opts["memory_bytes"]:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (opts["memory_bytes"], opts["memory_bytes"]))
        import random

        random.seed()  # os.urandom: no two cells share a sequence
        os.environ.clear()
        os.environ.update(CELL_ENV)
        os.chdir("/tmp")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except OSError as e:
        writer.write(dumps({"op": "error", "error": f"cannot set up a cell: {e}"}))
        os._exit(1)
    sys.stdout = sys.stderr = os.fdopen(1, "w", buffering=1, errors="replace", closefd=False)
    writer.write(dumps({"op": "ready"}))
    hook_process_main(os.fdopen(rfd, "rb", buffering=1 << 16), os.fdopen(writer.fileno(), "wb", buffering=1 << 16, closefd=False), opts)


class Zygote:
    """The supervisor's handle on its zygote."""

    def __init__(self, opts):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                # Nothing of the supervisor's but fds 0-2 and the control socket: never the protocol.
                for fd in [int(f) for f in os.listdir("/proc/self/fd")]:
                    if fd > 2 and fd != theirs.fileno():
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                zygote_main(theirs, opts)
            finally:
                os._exit(1)
        theirs.close()
        self.pid = pid
        self.control = ours

    def spawn(self):
        """A new hook process: (pid, HookProcess) once it has said ready, or raises CellError."""
        try:
            self.control.send(b"spawn")
            reply, fds, _, _ = socket.recv_fds(self.control, 256, 2)
        except OSError as e:
            raise CellError(f"the zygote is gone: {e}") from None
        if reply != b"ok" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise CellError(reply.decode("utf-8", "replace") or "the zygote is gone")
        return HookProcess(fds[0], fds[1])

    def alive(self):
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return False
        return pid == 0

    def stop(self):
        self.control.close()
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (OSError, ChildProcessError):
            pass


# ------------------------------------------------------------------ the supervisor's side of a cell


class HookProcess:
    """The supervisor's handle on one hook's process: its pipes and, once known, its pid."""

    def __init__(self, write_fd, read_fd):
        self.writer = os.fdopen(write_fd, "wb", buffering=1 << 16)
        self.reader = os.fdopen(read_fd, "rb", buffering=1 << 16)
        self.pid = None
        self.namespace = None
        self.dead = False

    def handshake(self):
        """Reads what the cell's setup reports: the process's pid and its `ready` (in either order,
        from the intermediate process and the hook's process). Raises CellError on anything else."""
        ready = False
        while self.pid is None or not ready:
            msg = self.receive(4096)
            op = msg.get("op") if msg else None
            if op == "pid" and isinstance(msg.get("pid"), int) and self.pid is None:
                self.pid = msg["pid"]
            elif op == "ready" and not ready:
                ready = True
            elif op == "error":
                raise CellError(str(msg.get("error")))
            else:
                raise CellError("a hook's process died while its cell was set up")
        try:
            # Its pid namespace, read while only trusted code runs in it: how close() finds what
            # the hook leaves running there.
            self.namespace = os.readlink(f"/proc/{self.pid}/ns/pid")
        except OSError as e:
            raise CellError(f"cannot read a hook process's pid namespace: {e}") from None

    def send(self, msg):
        try:
            self.writer.write(dumps(msg))
            self.writer.flush()
            return True
        except (OSError, ValueError):
            self.dead = True
            return False

    def receive(self, limit):
        """The process's next message, or None when it died; `too_long`/`malformed` when it sent
        something the supervisor will not read."""
        try:
            line = self.reader.readline(limit + 1)
        except (OSError, ValueError):
            line = b""
        if not line:
            self.dead = True
            return None
        if not line.endswith(b"\n"):
            return {"op": "too_long"}
        try:
            msg = json.loads(line)
        except ValueError:
            return {"op": "malformed"}
        return msg if isinstance(msg, dict) else {"op": "malformed"}

    def kill(self):
        self.dead = True
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        for f in (self.writer, self.reader):
            try:
                f.close()
            except OSError:
                pass


class Hook:
    """A hook of the open cell: its spec, its declared action, its process."""

    def __init__(self, index, spec):
        self.index = index
        self.spec = spec
        self.name = str(spec.get("name", f"hook-{index}"))
        self.action = spec.get("action")
        self.process = None
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


class Cell:
    """One trigger point's hooks, each in a process of its own, and what ending them found."""

    def __init__(self, zygote, hooks, limits):
        self.zygote = zygote
        self.hooks = hooks
        self.limits = limits
        self.retired = []  # processes of this cell already replaced: they are ended with it
        self.broken = None  # why the cell could not be made, when it could not

    def open(self):
        """Spawns every hook's process (the zygote forks them one after another; their namespace
        setup runs in parallel), then loads each hook's code. Raises CellError when the sandbox
        cannot make cells; a hook whose code does not load carries its error."""
        pending = [h for h in self.hooks if h.error is None]
        for hook in pending:
            hook.process = self.zygote.spawn()
        for hook in pending:
            hook.process.handshake()
        for hook in pending:
            self.start_load(hook)
        for hook in pending:
            hook.error, hook.line = self.finish_load(hook)

    def start_load(self, hook):
        spec = hook.spec
        hook.process.send({"op": "load", "name": hook.name, "code": spec.get("code", ""), "settings": spec.get("settings") or {}})

    def finish_load(self, hook):
        reply = hook.process.receive(self.limits["payload_bytes"])
        if not reply or reply.get("op") != "loaded":
            return "the hook's process died while loading its code", None
        return reply.get("error"), reply.get("line")

    def respawn(self, hook):
        """A hook whose process died earlier in this trigger point gets a fresh one, from the zygote
        like every other, with its code loaded again."""
        self.retired.append(hook.process)
        hook.process.kill()
        hook.process = self.zygote.spawn()
        hook.process.handshake()
        self.start_load(hook)
        error, _ = self.finish_load(hook)
        if error:
            raise HookError(error)

    def close(self):
        """Kills every process of the cell and waits until all are gone. Each hook's process is pid 1
        of its own pid namespace; whatever it started still running in that namespace (gVisor, unlike
        Linux, does not end a pid namespace with its init) is found by its namespace and killed too.
        Returns None when the cell ended as a cell should, else why the sandbox is dirty."""
        procs = [h.process for h in self.hooks if h.process is not None] + self.retired
        namespaces = {p.namespace for p in procs if p.namespace}
        for p in procs:
            p.kill()
        pids = {p.pid for p in procs if p.pid is not None}
        deadline = time.monotonic() + TEARDOWN_SECONDS
        # The hook processes first: on Linux a namespace's init exits only once all its other
        # processes have, so anything still in a namespace after its init is gone outlived it.
        while pids:
            pids -= reap()
            if pids and time.monotonic() >= deadline:
                return f"{len(pids)} hook process(es) did not die within {TEARDOWN_SECONDS:g} s"
            if pids:
                time.sleep(0.001)
        outlived = set()
        while True:
            members = namespace_members(namespaces)
            for pid in members:
                outlived.add(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            reap()
            if not members:
                break
            if time.monotonic() >= deadline:
                return f"{len(members)} process(es) of the cell did not die within {TEARDOWN_SECONDS:g} s"
            time.sleep(0.001)
        if outlived:
            return f"{len(outlived)} process(es) started by hooks outlived their hook (killed)"
        return None


def namespace_members(namespaces):
    """Pids of the processes (as this process sees them) that are in one of the given pid namespaces."""
    found = []
    if not namespaces:
        return found
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") in namespaces:
                    found.append(int(entry))
            except OSError:
                pass  # gone, or a zombie
    return found


def reap():
    """Collects every child that has exited (orphans are re-parented to us); returns their pids."""
    done = set()
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.add(pid)


# ----------------------------------------------------------------------------- the supervisor


class Supervisor:
    """The protocol loop: `init` opens a cell, `chunk` walks it, `end` closes it with a verdict."""

    def __init__(self, channel, zygote, sandboxed):
        self.channel = channel
        self.zygote = zygote
        self.sandboxed = sandboxed
        self.cell = None
        self.trigger_point = None
        self.failure_policy = "Closed"
        self.limits = dict(DEFAULT_LIMITS)
        self.next_host_call = 0
        # Processes of the sandbox that are neither ours nor a cell's and must be left alone: in a
        # pod, the exec'd relay (attach.py) whose pipes carry the protocol.
        self.keep_pids = set()

    @property
    def hooks(self):
        return self.cell.hooks if self.cell else []

    def init(self, msg):
        if self.cell is not None:
            self.channel.send({"type": "error", "message": "init while a cell is open: end it first"})
            return
        self.trigger_point = msg.get("trigger_point")
        self.failure_policy = msg.get("failure_policy", "Closed")
        self.limits = dict(DEFAULT_LIMITS)
        self.limits.update(msg.get("limits") or {})
        hooks = [Hook(i, spec) for i, spec in enumerate(msg.get("hooks") or [])]
        self.cell = Cell(self.zygote, hooks, self.limits)
        try:
            self.cell.open()
        except CellError as e:
            # The sandbox cannot isolate hooks: no hook of this cell may run, and the gateway is told
            # so in the ack (every hook fails) and again by `end`, whose verdict is dirty.
            self.cell.broken = str(e)
            for h in hooks:
                h.error = h.error or f"the sandbox could not start this hook: {e}"
        self.channel.send({"type": "ack", "hooks": [h.ack() for h in hooks]})

    def end(self):
        """Closes the cell and tells the gateway whether the sandbox may serve again."""
        reason = None
        if self.cell is not None:
            reason = self.cell.close() or self.cell.broken
            self.cell = None
        reason = reason or self.inspect()
        self.channel.send({"type": "ended", "clean": reason is None, **({"reason": reason} if reason else {})})

    def inspect(self):
        """What must hold between trigger points: the zygote alive and, inside a sandbox, no process
        left to us that is not ours."""
        if not self.zygote.alive():
            return "the zygote died"
        if not self.sandboxed:
            return None
        me = os.getpid()
        leftovers = []
        for pid, ppid in processes():
            # A hook's processes that left their pid namespace (a nested one) are re-parented to us:
            # anything re-parented to us that is not the zygote is one (the zygote's own short-lived
            # children are not re-parented to us).
            if ppid == me and pid != self.zygote.pid and pid not in self.keep_pids:
                leftovers.append(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if leftovers:
            reap()
            return f"processes left behind (killed): {sorted(leftovers)}"
        return None

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
        """Runs one hook in its process; returns what it returned (a dict) or raises HookError."""
        if hook.process.dead:
            try:
                self.cell.respawn(hook)
            except CellError as e:
                raise HookError(f"the hook's process could not be restarted: {e}") from None
        p = hook.process
        if not p.send({"op": "call", "outgoing": payload, "state": state, "context": context, "hook": hook.name}):
            raise HookError("the hook's process died")
        limit = self.limits["payload_bytes"] * 2 + self.limits["state_bytes"] + self.limits["findings_bytes"] + 4096
        while True:
            msg = p.receive(limit)
            op = msg.get("op") if msg else None
            if op == "host_call":
                try:
                    answer = {"op": "host_result", "ok": True, "result": self.host_call(run_id, hook, budget, msg.get("name"), msg.get("payload"))}
                except HostCallError as e:
                    answer = {"op": "host_result", "ok": False, "error": str(e)}
                if not p.send(answer):
                    raise HookError("the hook's process died during a host_call")
            elif op == "return":
                if msg.get("error") is not None:
                    raise HookError(str(msg["error"]))
                return msg.get("value")
            elif msg is None:
                raise HookError("the hook's process died (killed, out of memory, or it exited)")
            else:
                p.kill()  # it can no longer be read in step: a fresh one if it is called again
                raise HookError(f"the hook returned more than {limit} bytes" if op == "too_long" else "the hook's process sent a malformed message")

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
        if self.cell is None:
            self.channel.send({"type": "error", "message": "chunk without an open cell: send init first"})
            return
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
            # The previous hook's result goes out before this hook runs, so that if this one takes
            # the sandbox down the gateway still knows how far the walk got.
            self.channel.flush()
            result = {"type": "hook_result", "id": run_id, "index": hook.index, "name": hook.name}
            try:
                if hook.error is not None:
                    raise HookError(hook.error)
                state = states[hook.index] if hook.index < len(states) else None
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

    def serve(self):
        """Answers requests until the gateway closes stdin or says shutdown; an open cell is ended."""
        self.channel.send({"type": "ready", "protocol": PROTOCOL_VERSION, "pid": os.getpid()})
        while True:
            try:
                msg = self.channel.receive()
            except ValueError as e:
                self.channel.send({"type": "error", "message": f"malformed request: {e}"})
                continue
            kind = msg.get("type") if isinstance(msg, dict) else None
            if msg is None or kind == "shutdown":
                break
            if kind == "init":
                self.init(msg)
            elif kind == "chunk":
                self.chunk(msg)
            elif kind == "end":
                self.end()
            else:
                self.channel.send({"type": "error", "message": f"unknown request type {kind!r}"})
        if self.cell is not None:
            self.cell.close()
            self.cell = None


def processes():
    """(pid, parent pid) of every process this one can see."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    out.append((int(entry), int(f.read().rsplit(b")", 1)[1].split()[1])))
            except (OSError, ValueError, IndexError):
                pass
    return out


# Modules hooks commonly use, imported before the zygote forks so that no cell pays for reading
# them through the sandbox's filesystem.
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
    """Exercises the interpreter's code paths (compile, regex, JSON) before the zygote forks, so cells
    find them warm (first touches are slow inside gVisor)."""
    namespace = {}
    exec(compile(WARM_UP_HOOK, "<warm-up>", "exec"), namespace)
    payload = json.loads(json.dumps({"outgoing": "call 555-1234 " * 300, "state": [None]}))
    ret = namespace["execute"](Context(outgoing=payload["outgoing"], state=None), {})
    bounded_json(ret, "warm-up", 1 << 20, 32)
    import gc

    gc.collect()
    gc.freeze()  # what exists now is shared, untouched, by every forked cell


def start_zygote(opts, log):
    """Forks the zygote and proves it can make a cell (namespaces, mounts, dropped privileges): a
    sandbox that cannot isolate hooks says so at start instead of serving. Returns the zygote, or
    None after logging why."""
    kernel = Kernel()
    try:
        kernel.prctl(Kernel.PR_SET_CHILD_SUBREAPER, 1)  # hook processes are re-parented to us
    except OSError:
        pass  # pid 1 of a sandbox is the reaper anyway
    zygote = Zygote(opts)
    cell = Cell(zygote, [Hook(0, {"name": "self-check", "action": "detect", "code": SELF_CHECK_HOOK})], dict(DEFAULT_LIMITS))
    try:
        cell.open()
        hook = cell.hooks[0]
        if hook.error:
            raise CellError(hook.error)
        if not hook.process.send({"op": "call", "outgoing": "", "state": None, "context": {}, "hook": "self-check"}):
            raise CellError("the self-check process died")
        reply = hook.process.receive(4096)
        seen = (reply or {}).get("value") or {}
        if seen.get("findings") != SELF_CHECK_WANT:
            raise CellError(f"a cell is not isolated here: {json.dumps(seen.get('findings') or reply)}")
    except CellError as e:
        log(f"cannot create cells: {e} (cells need a gVisor release that allows unprivileged user, pid and mount namespaces inside the sandbox, such as runsc 20240729 or newer, and no seccomp filter refusing unshare or mount)")
        cell.close()
        zygote.stop()
        return None
    problem = cell.close()
    if problem:
        log(f"cannot create cells: {problem}")
        zygote.stop()
        return None
    return zygote


# What a hook must find in its cell: alone in its pid namespace, no capabilities, an empty /tmp.
SELF_CHECK_HOOK = """import os
def execute(context, settings):
    pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
    with open('/proc/self/status') as f:
        caps = [l.split()[1] for l in f if l.startswith('CapEff')]
    return {'action': 'detect', 'findings': {'pids': pids, 'caps': caps, 'tmp': os.listdir('/tmp')}}
"""
SELF_CHECK_WANT = {"pids": [1], "caps": ["0000000000000000"], "tmp": []}


# ------------------------------------------------------------------------------ command line

USAGE = "usage: supervisor.py [--listen | --probe] [--memory-bytes BYTES] [--pids N] [--cell-tmp-bytes BYTES]"

# Processes of the sandbox user that are not a hook's: the supervisor, its zygote, the attach relay
# and a readiness probe in a pod.
PIDS_ALLOWANCE = 4


class UsageError(Exception):
    pass


def parse_args(argv):
    """The command line: a mode (serve, the default; listen; probe) and the sandbox settings.
    Hand-rolled rather than argparse: every module read costs time inside gVisor."""
    opts = {"mode": "serve", "memory_bytes": 0, "pids": 0, "tmp_bytes": 8 << 20,
            "namespaces": ("user", "pid", "mount", "ipc", "net", "uts")}
    names = {"--memory-bytes": "memory_bytes", "--pids": "pids", "--cell-tmp-bytes": "tmp_bytes"}
    args = list(argv)
    while args:
        arg, _, value = args.pop(0).partition("=")
        if arg in ("--listen", "--probe") and not value:
            if opts["mode"] != "serve":
                raise UsageError("--listen and --probe exclude each other")
            opts["mode"] = arg[2:]
        elif arg in names:
            if not value:
                value = args.pop(0) if args else ""
            if not (value.isascii() and value.isdigit()):
                raise UsageError(f"{arg} needs a non-negative integer, not {value!r}")
            opts[names[arg]] = int(value)
        else:
            raise UsageError(f"unknown argument {arg!r}")
    if opts["tmp_bytes"] == 0:
        raise UsageError("--cell-tmp-bytes must be positive")
    return opts


ATTACH_ADDRESS = "@sluice-supervisor"
# How often a waiting pod's supervisor checks that its zygote is alive.
ZYGOTE_CHECK_SECONDS = 2.0


def attach_address():
    """The abstract unix socket a warm pod's supervisor listens on (attach.py has the same rule)."""
    name = os.environ.pop("SLUICE_ATTACH", "") or ATTACH_ADDRESS
    return "\0" + name[1:] if name.startswith("@") else name


def listen(zygote, log):
    """A warm pod's main process (pid 1). Everything that does not depend on the chain happens before
    the pod turns Ready: modules, warm-up, the zygote and its self-check. Then it waits for exactly
    one attach (attach.py, exec'd by the gateway once the pod is claimed), which hands over the exec's
    stdin, stdout and stderr; the protocol runs over them and, when the gateway closes stdin, the
    status goes back to the relay and the supervisor exits, ending the pod. Startup probes
    (`attach.py --probe`) get "ready" while it waits with its zygote alive, and "attached" once it
    serves its gateway: a kubelet that restarts runs the startup probe of every pod again, and a
    held pod must pass it (else the kubelet kills it). Returns the exit status."""
    address = attach_address()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(address)
    except OSError as e:
        log(f"cannot listen on {address!r}: {e}")
        return 1
    server.listen(16)
    server.settimeout(ZYGOTE_CHECK_SECONDS)
    log("ready: cells work here, waiting for the gateway's attach")
    while True:
        try:
            conn, _ = server.accept()
        except socket.timeout:
            # A pod that can no longer make cells must not wait to be claimed: its exit ends the
            # pod, which the operator replaces.
            if not zygote.alive():
                log("the zygote died: this pod can make no more cells")
                return 1
            continue
        fds = []
        try:
            conn.settimeout(5)
            request, fds, _, _ = socket.recv_fds(conn, 64, 3)
            verb, _, pid = request.partition(b" ")
            if request == b"probe":
                conn.sendall(b"ready" if zygote.alive() else b"the zygote died")
            elif verb == b"attach" and pid.isdigit() and len(fds) == 3:
                break
            else:
                conn.sendall(b"unknown request")
        except OSError:
            pass  # a client that went away or sent nothing in time: wait for the next one
        for fd in fds:
            os.close(fd)
        conn.close()
    # One attach per pod: from now on the socket only tells probes the pod is alive and refuses
    # every other attach.
    threading.Thread(target=answer_while_attached, args=(server,), daemon=True).start()
    conn.settimeout(None)
    proto_in, hook_out, proto_out = fds
    os.close(hook_out)  # hook processes print to /dev/null here: the exec's stdout stays empty
    channel = Channel(os.fdopen(proto_in, "rb", buffering=1 << 16), os.fdopen(proto_out, "wb", buffering=1 << 16))
    supervisor = Supervisor(channel, zygote, sandboxed=os.getpid() == 1)
    # The relay names its own pid (gVisor's SO_PEERCRED does not): it is not a leftover of a cell.
    supervisor.keep_pids.add(int(pid))
    supervisor.serve()
    try:
        conn.sendall(b"\0")
    except OSError:
        pass
    return 0


def answer_while_attached(server):
    """The attach socket of a supervisor that serves its gateway: probes get "attached", a second
    attach gets "already attached" (its descriptors closed unused). Runs until the process exits."""
    server.settimeout(None)
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        fds = []
        try:
            conn.settimeout(5)
            request, fds, _, _ = socket.recv_fds(conn, 64, 3)
            if request == b"probe":
                conn.sendall(b"attached")
            elif request.startswith(b"attach"):
                conn.sendall(b"already attached")
            else:
                conn.sendall(b"unknown request")
        except OSError:
            pass
        for fd in fds:
            os.close(fd)
        conn.close()


PROBE_HOOK = "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': context['outgoing'].upper()}\n"


def probe(code=PROBE_HOOK):
    """A self-test: one chain of one hook through the real protocol code (Channel, init, chunk, end)
    and a real cell, over a pair of pipes. Returns 0 when every answer is right, else 1 with the
    reason on stderr. Every process it starts is gone when it returns, and it writes no file."""
    requests = [
        {"type": "init", "trigger_point": "input", "failure_policy": "Closed",
         "hooks": [{"name": "probe", "action": "modify", "settings": {}, "code": code}]},
        {"type": "chunk", "id": 1, "start": 0, "outgoing": "ready?", "state": [None], "context": {}},
        {"type": "end"},
        {"type": "shutdown"},
    ]
    want = [
        {"type": "ready", "protocol": PROTOCOL_VERSION, "pid": os.getpid()},
        {"type": "ack", "hooks": [{"name": "probe", "ok": True}]},
        {"type": "hook_result", "id": 1, "index": 0, "name": "probe", "action": "modify", "outgoing": "READY?"},
        {"type": "result", "id": 1, "action": "modify", "terminal_index": None},
        {"type": "ended", "clean": True},
    ]
    problems = []
    opts = parse_args([])
    preload()
    zygote = start_zygote(opts, problems.append)
    if zygote is None:
        print(f"sluice supervisor probe failed: {problems[0]}", file=sys.stderr)
        return 1
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    try:
        with os.fdopen(req_w, "wb") as w:  # a few hundred bytes: fits in the pipe before anyone reads
            w.write(b"".join(json.dumps(r).encode() + b"\n" for r in requests))
        with os.fdopen(req_r, "rb") as reader, os.fdopen(resp_w, "wb") as writer:
            Supervisor(Channel(reader, writer), zygote, sandboxed=False).serve()
        with os.fdopen(resp_r, "rb") as r:
            got = [json.loads(line) for line in r]
    except Exception as e:
        print(f"sluice supervisor probe failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        zygote.stop()
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
        channel = None
    else:
        channel = Channel.from_stdio()
        log = None
    preload()
    if opts["pids"]:
        import resource

        # In a pod the pids cgroup is the node's (podPidsLimit), not the chain's: the chain's limit
        # holds as RLIMIT_NPROC for the sandbox user, counted with the pod's own processes.
        limit = opts["pids"] + PIDS_ALLOWANCE
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    sys.setrecursionlimit(2000)
    warm_up()
    problems = []
    zygote = start_zygote(opts, log or problems.append)
    if zygote is None:
        if channel is not None:
            channel.send({"type": "error", "message": problems[0]})
        return 1
    if opts["mode"] == "listen":
        return listen(zygote, log)
    Supervisor(channel, zygote, sandboxed=os.getpid() == 1).serve()
    zygote.stop()
    return 0


def pod_log():
    """Points fds 0, 1 and 2 at /dev/null before the zygote forks (what hooks print in a pod goes
    nowhere: not into the node's container logs) and returns a logger onto the container's original
    stderr, for the supervisor's own lines (`kubectl logs`)."""
    original = os.dup(2)  # the zygote closes it; hooks never get it
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    sys.stdin = os.fdopen(0, "r", closefd=False)
    sys.stdout = sys.stderr = os.fdopen(1, "w", buffering=1, errors="replace", closefd=False)

    def log(line):
        try:
            os.write(original, f"sluice supervisor: {line}\n".encode("utf-8", "replace"))
        except OSError:
            pass

    return log


if __name__ == "__main__":
    sys.exit(main())
