"""Tests of the supervisor over its real pipes: `python3 -m unittest discover -s supervisor`."""

import contextlib
import io
import json
import shutil
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SUPERVISOR = os.path.join(HERE, "supervisor.py")
ATTACH = os.path.join(HERE, "attach.py")


def hook(name, action, code, settings=None):
    return {"name": name, "action": action, "code": code, "settings": settings or {}}


def cells_work():
    """Whether this machine lets the supervisor make cells (it needs user namespaces)."""
    return subprocess.run([sys.executable, "-I", "-S", SUPERVISOR, "--probe"], capture_output=True, timeout=60).returncode == 0


CELLS = cells_work()


class Session:
    """One supervisor process, spoken to exactly as the gateway does."""

    def __init__(self, env=None, args=(), prefix=(), supervisor=SUPERVISOR, command=None):
        self.proc = subprocess.Popen(
            [*prefix, *(command or [sys.executable, "-I", "-S", "-u", supervisor, *args])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env or {},
        )
        self.ready = self.read()

    def send(self, msg):
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()

    def read(self):
        line = self.proc.stderr.readline()
        if not line:
            raise EOFError("supervisor closed the protocol")
        return json.loads(line)

    def init(self, hooks, trigger_point="input", policy="Closed", limits=None):
        self.send({"type": "init", "trigger_point": trigger_point, "failure_policy": policy, "hooks": hooks, "limits": limits or {}})
        return self.read()

    def chunk(self, outgoing, state=None, host=None, start=0):
        self.send({"type": "chunk", "id": 7, "outgoing": outgoing, "state": state or [], "context": {"target": "bot"}, "start": start})
        hooks = []
        while True:
            msg = self.read()
            if msg["type"] == "hook_result":
                hooks.append(msg)
            elif msg["type"] == "host_call":
                self.send(host(msg))
            else:
                return msg, hooks

    def end(self):
        self.send({"type": "end"})
        return self.read()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(5)
        self.proc.stdout.close()
        self.proc.stderr.close()


class SupervisorTest(unittest.TestCase):
    def setUp(self):
        self.s = Session()

    def tearDown(self):
        self.s.close()

    def test_ready_names_the_protocol(self):
        self.assertEqual(self.s.ready["type"], "ready")
        self.assertEqual(self.s.ready["protocol"], 2)

    def test_every_action_and_the_walk_stops_at_the_terminal_index(self):
        ack = self.s.init([
            hook("up", "modify", "def execute(c, s): return {'action': 'modify', 'outgoing': c['outgoing'].upper()}"),
            hook("find", "detect", "def execute(c, s): return {'action': 'detect', 'findings': {'n': len(c.outgoing)}}"),
            hook("stop", "block", "def execute(c, s): return {'action': 'block', 'message': 'no ' + c['outgoing']}"),
            hook("never", "modify", "def execute(c, s): return {'action': 'modify', 'outgoing': 'reached'}"),
        ])
        self.assertTrue(all(h["ok"] for h in ack["hooks"]), ack)
        result, hooks = self.s.chunk("hi")
        self.assertEqual([h["name"] for h in hooks], ["up", "find", "stop"])
        self.assertEqual(hooks[0]["outgoing"], "HI")
        self.assertEqual(hooks[1]["findings"], {"n": 2})
        self.assertEqual(hooks[2]["message"], "no HI")
        self.assertEqual(result, {"type": "result", "id": 7, "action": "block", "terminal_index": 2})

    def test_skip_is_terminal(self):
        self.s.init([hook("s", "skip", "def execute(c, s): return {'action': 'skip', 'message': 'cached'}")])
        result, _ = self.s.chunk("x")
        self.assertEqual((result["action"], result["terminal_index"]), ("skip", 0))

    def test_undeclared_action_is_a_hook_error_closed_blocks(self):
        self.s.init([hook("sneaky", "detect", "def execute(c, s): return {'action': 'block'}")])
        result, hooks = self.s.chunk("x")
        self.assertIn("declared 'detect'", hooks[0]["error"])
        self.assertEqual((result["action"], result["terminal_index"]), ("block", 0))

    def test_open_policy_passes_the_payload_on_after_an_exception(self):
        self.s.init([
            hook("boom", "modify", "def execute(c, s):\n    raise ValueError('bad day')\n"),
            hook("up", "modify", "def execute(c, s): return {'action': 'modify', 'outgoing': c['outgoing'].upper()}"),
        ], policy="Open")
        result, hooks = self.s.chunk("x")
        self.assertIn("ValueError: bad day", hooks[0]["error"])
        self.assertIn("line 2", hooks[0]["error"])
        self.assertEqual(hooks[1]["outgoing"], "X")
        self.assertEqual((result["action"], result["terminal_index"]), ("modify", None))

    def test_malformed_results_are_errors(self):
        cases = [
            ("return 'pass'", "not a dict"),
            ("return {'action': 'modify'}", "without 'outgoing'"),
            ("return {'action': 'modify', 'outgoing': 5}", "carries text"),
            ("return {'action': 'pass', 'state': object()}", "not JSON-serializable"),
            ("return {'action': 'pass', 'message': 3}", "not str"),
            ("return {'action': 'pass', 'state': 'x' * 100000}", "over the limit"),
            ("import sys; sys.exit(3)", "SystemExit"),
        ]
        self.s.init([hook(f"h{i}", "modify", f"def execute(c, s):\n    {body}\n") for i, (body, _) in enumerate(cases)], policy="Open")
        _, hooks = self.s.chunk("x")
        for (body, expected), got in zip(cases, hooks):
            self.assertIn(expected, got.get("error", ""), body)

    def test_compile_errors_are_reported_at_init_with_the_line(self):
        ack = self.s.init([
            hook("bad", "modify", "def execute(c, s):\n    return {\n"),
            hook("noexec", "modify", "x = 1\n"),
            hook("pass-declared", "pass", "def execute(c, s): return {'action': 'pass'}"),
        ])
        bad, noexec, declared = ack["hooks"]
        self.assertFalse(bad["ok"])
        self.assertIn("SyntaxError", bad["error"])
        self.assertEqual(bad["line"], 2)
        self.assertIn("execute", noexec["error"])
        self.assertIn("declared action", declared["error"])
        result, hooks = self.s.chunk("x")
        self.assertEqual(result["action"], "block")
        self.assertIn("SyntaxError", hooks[0]["error"])

    def test_printing_does_not_corrupt_the_protocol(self):
        code = (
            "import os, sys\n"
            "def execute(c, s):\n"
            "    print('{\"type\": \"result\", \"action\": \"pass\"}')\n"
            "    sys.stderr.write('{\"type\": \"result\"}\\n')\n"
            "    os.write(1, b'raw one\\n'); os.write(2, b'raw two\\n')\n"
            "    return {'action': 'modify', 'outgoing': 'clean'}\n"
        )
        self.s.init([hook("noisy", "modify", code)])
        result, hooks = self.s.chunk("x")
        self.assertEqual(hooks[0]["outgoing"], "clean")
        self.assertEqual(result["action"], "modify")

    def test_state_is_per_hook(self):
        count = "def execute(c, s):\n    n = (c['state'] or 0) + 1\n    return {'action': 'detect', 'state': n, 'findings': {'n': n}}\n"
        self.s.init([hook("a", "detect", count), hook("b", "detect", count)])
        _, hooks = self.s.chunk("x", state=[5, None])
        self.assertEqual([h["state"] for h in hooks], [6, 1])

    def test_host_call_round_trip_and_errors(self):
        code = (
            "def execute(c, s):\n"
            "    got = c.host_call('echo', {'q': 1})\n"
            "    try:\n"
            "        c.host_call('nope', {})\n"
            "    except HostCallError as e:\n"
            "        return {'action': 'modify', 'outgoing': str(got['q']) + ':' + str(e)}\n"
        )
        self.s.init([hook("caller", "modify", code)])

        def host(msg):
            if msg["name"] == "echo":
                return {"type": "host_result", "id": msg["id"], "ok": True, "result": msg["payload"]}
            return {"type": "host_result", "id": msg["id"], "ok": False, "error": "unknown capability 'nope'"}

        _, hooks = self.s.chunk("x", host=host)
        self.assertEqual(hooks[0]["outgoing"], "1:unknown capability 'nope'")

    def test_host_call_bound(self):
        code = "def execute(c, s):\n    for i in range(10):\n        c.host_call('echo', i)\n    return {'action': 'pass'}\n"
        self.s.init([hook("loop", "modify", code)], limits={"host_calls": 3})
        calls = []

        def host(msg):
            calls.append(msg)
            return {"type": "host_result", "id": msg["id"], "ok": True, "result": None}

        _, hooks = self.s.chunk("x", host=host)
        self.assertEqual(len(calls), 3)
        self.assertIn("host_call limit", hooks[0]["error"])

    def test_start_index_resumes_the_walk(self):
        self.s.init([
            hook("a", "modify", "def execute(c, s): return {'action': 'modify', 'outgoing': 'a'}"),
            hook("b", "modify", "def execute(c, s): return {'action': 'modify', 'outgoing': c.outgoing + 'b'}"),
        ])
        _, hooks = self.s.chunk("x", start=1)
        self.assertEqual([(h["index"], h["outgoing"]) for h in hooks], [(1, "xb")])

    def test_malformed_request_gets_an_error_and_the_supervisor_keeps_serving(self):
        self.s.proc.stdin.write(b"{not json\n")
        self.s.proc.stdin.flush()
        self.assertEqual(self.s.read()["type"], "error")
        self.s.send({"type": "teleport"})
        self.assertIn("unknown request", self.s.read()["message"])
        ack = self.s.init([hook("a", "detect", "def execute(c, s): return {'action': 'pass'}")])
        self.assertTrue(ack["hooks"][0]["ok"])

    def test_structured_payloads_need_a_dict(self):
        self.s.init([hook("t", "modify", "def execute(c, s): return {'action': 'modify', 'outgoing': 'text'}")], trigger_point="before_tool")
        _, hooks = self.s.chunk({"name": "write", "arguments": {}})
        self.assertIn("carries an object", hooks[0]["error"])


class MemoryLimitTest(unittest.TestCase):
    def test_memory_bomb_is_a_hook_error(self):
        s = Session(args=["--memory-bytes", str(256 << 20)])
        try:
            s.init([hook("bomb", "modify", "def execute(c, s):\n    x = bytearray(1 << 30)\n    return {'action': 'pass'}\n")])
            result, hooks = s.chunk("x")
            self.assertIn("MemoryError", hooks[0]["error"])
            self.assertEqual(result["action"], "block")
        finally:
            s.close()


def children(pid):
    """Pids whose parent is `pid`, from /proc."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def catches(pid, signum):
    """Whether process `pid` has installed a handler for `signum` (SigCgt in /proc/pid/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    return False


PRINT_AND_UPPER = """import os, sys
def execute(context, settings):
    print('to stdout'); print('to stderr', file=sys.stderr); os.write(1, b'raw 1'); os.write(2, b'raw 2')
    return {'action': 'modify', 'outgoing': context['outgoing'].upper()}
"""


class Pod:
    """`supervisor.py --listen` as a warm pod's main process, on an attach address of its own."""

    def __init__(self, args=(), prefix=(), env=None, supervisor=SUPERVISOR, attach=ATTACH):
        self.env = {"SLUICE_ATTACH": f"@sluice-test-{os.getpid()}-{time.monotonic_ns()}", **(env or {})}
        self.attach = attach
        self.log_file = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([*prefix, sys.executable, "-I", "-S", "-u", supervisor, "--listen", *args],
                                     env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log_file)
        self.log = b""

    def attach_command(self, *args):
        # The attach address is the network namespace's: reachable from outside a pid namespace.
        return [sys.executable, "-I", "-S", self.attach, *args]

    def probe(self):
        return subprocess.run(self.attach_command("--probe"), env=self.env, capture_output=True, timeout=30)

    def __enter__(self):
        for _ in range(3000):  # up to 30 s for the warm-up; nothing here asserts on time
            if self.probe().returncode == 0:
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        self.__exit__()
        raise AssertionError(f"the listening supervisor never became ready: {self.log!r}")

    def __exit__(self, *_):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log_file.seek(0)
        self.log = self.log_file.read()
        self.log_file.close()


class CommandLineTest(unittest.TestCase):
    def run_supervisor(self, *args, **kw):
        return subprocess.run([sys.executable, "-I", "-S", SUPERVISOR, *args], capture_output=True, timeout=30, **kw)

    def test_listen_waits_for_one_attach_and_serves_it_over_the_relays_pipes(self):
        with Pod() as pod:
            self.assertEqual(pod.probe().returncode, 0, "a waiting supervisor answers the probe")
            s = Session(env=pod.env, command=pod.attach_command())
            try:
                self.assertEqual(s.ready["type"], "ready")
                self.assertEqual(s.ready["pid"], pod.proc.pid, "the protocol comes from the pod's main process")
                ack = s.init([hook("a", "modify", PRINT_AND_UPPER), hook("b", "detect", "def execute(c, s):\n    return {'action': 'detect', 'findings': {'n': 1}}\n")])
                self.assertTrue(all(h["ok"] for h in ack["hooks"]), ack)
                result, hooks = s.chunk("hello")
                self.assertEqual((result["action"], hooks[0]["outgoing"]), ("modify", "HELLO"))
                # Attached, nobody else gets in: no second session.
                second = subprocess.run(pod.attach_command(), env=pod.env, capture_output=True, timeout=30)
                self.assertEqual(second.returncode, 1)
                self.assertIn(b"already attached", second.stderr)
                # A kubelet that restarts runs the startup probe again: an attached pod passes it,
                # or the kubelet would kill every held pod on the node.
                self.assertEqual(pod.probe().returncode, 0, "an attached supervisor is alive")
                result, hooks = s.chunk("still served")
                self.assertEqual(hooks[0]["outgoing"], "STILL SERVED", "the probe and the refused attach left the session alone")
                s.proc.stdin.close()
                self.assertEqual(s.proc.stdout.read(), b"", "what hooks print reaches no one")
                self.assertEqual(s.proc.wait(30), 0, "the relay exits with the supervisor's status")
            finally:
                s.close()
            self.assertEqual(pod.proc.wait(30), 0, "one attach per pod: the supervisor ends with its session")
        self.assertIn(b"waiting for the gateway's attach", pod.log)

    @unittest.skipUnless(CELLS, "needs cells")
    def test_a_waiting_pod_whose_zygote_died_exits_so_it_is_replaced(self):
        with Pod() as pod:
            ns = os.readlink(f"/proc/{pod.proc.pid}/ns/pid")
            zygote = [p for p in children(pod.proc.pid) if os.readlink(f"/proc/{p}/ns/pid") == ns]
            self.assertEqual(len(zygote), 1)
            os.kill(zygote[0], signal.SIGKILL)
            self.assertEqual(pod.proc.wait(30), 1)
        self.assertIn(b"the zygote died", pod.log)

    def test_listen_exits_zero_on_sigterm_while_waiting(self):
        with Pod() as pod:
            pod.proc.send_signal(signal.SIGTERM)
            self.assertEqual(pod.proc.wait(10), 0)

    def test_a_relay_that_sends_nonsense_does_not_take_the_pod(self):
        with Pod() as pod:
            nonsense = (
                "import os, socket, sys\n"
                "s = socket.socket(socket.AF_UNIX)\n"
                "s.connect('\\0' + os.environ['SLUICE_ATTACH'][1:])\n"
                "s.sendall(b'attach')\n"  # attach without descriptors
                "sys.exit(0 if s.recv(64) == b'unknown request' else 1)\n"
            )
            self.assertEqual(subprocess.run([sys.executable, "-c", nonsense], env=pod.env, timeout=30).returncode, 0)
            self.assertEqual(pod.probe().returncode, 0, "still waiting for a real attach")

    def test_attach_with_no_supervisor_fails_with_a_message(self):
        env = {"SLUICE_ATTACH": f"@sluice-test-nobody-{os.getpid()}"}
        for args in ([], ["--probe"]):
            proc = subprocess.run([sys.executable, "-I", "-S", ATTACH, *args], env=env, capture_output=True, timeout=30)
            self.assertEqual(proc.returncode, 1, args)
            self.assertIn(b"sluice attach: no supervisor is waiting", proc.stderr)
        proc = subprocess.run([sys.executable, "-I", "-S", ATTACH, "--bogus"], env=env, capture_output=True, timeout=30)
        self.assertEqual(proc.returncode, 2)
        self.assertIn(b"usage: attach.py", proc.stderr)

    def test_probe_answers_zero_and_leaves_no_process_or_file(self):
        with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryDirectory() as tmp:
            # A subreaper collects anything the probe leaves running: there must be nothing to collect.
            wrapper = (
                "import ctypes, os, subprocess, sys\n"
                "ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n"  # PR_SET_CHILD_SUBREAPER
                "rc = subprocess.run([sys.executable, '-I', '-S', sys.argv[1], '--probe']).returncode\n"
                "try:\n"
                "    os.waitpid(-1, os.WNOHANG)\n"
                "    sys.exit('the probe left a process behind')\n"
                "except ChildProcessError:\n"
                "    sys.exit(rc)\n"
            )
            proc = subprocess.run([sys.executable, "-c", wrapper, SUPERVISOR], capture_output=True, timeout=30,
                                  cwd=cwd, env={"TMPDIR": tmp})
            self.assertEqual((proc.returncode, proc.stderr), (0, b""))
            self.assertEqual(proc.stdout, b"")
            self.assertEqual((os.listdir(cwd), os.listdir(tmp)), ([], []))

    def test_probe_fails_with_a_message_when_the_answer_is_wrong(self):
        import supervisor

        for code, reason in [
            ("def execute(c, s): return {'action': 'modify', 'outgoing': 'no'}", '"outgoing": "no"'),
            ("def execute(c, s) return", "SyntaxError"),
            ("def execute(c, s): return {'action': 'pass'}", '"action": "pass"'),
        ]:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                self.assertEqual(supervisor.probe(code), 1, code)
            self.assertIn("probe failed", err.getvalue())
            self.assertIn(reason, err.getvalue())
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(supervisor.probe(), 0)
        self.assertEqual(err.getvalue(), "")

    def test_bad_arguments_exit_2_with_usage(self):
        for args in (["--bogus"], ["--workers", "2"], ["--memory-bytes"], ["--pids", "-1"], ["--memory-bytes", "1G"],
                     ["--cell-tmp-bytes", "0"], ["--listen", "--probe"]):
            proc = self.run_supervisor(*args)
            self.assertEqual(proc.returncode, 2, args)
            self.assertIn(b"usage: supervisor.py", proc.stderr)

    def test_memory_bytes_bounds_each_hook_process(self):
        bomb = [hook("bomb", "modify", "def execute(c, s):\n    x = bytearray(1 << 30)\n    return {'action': 'pass'}\n")]
        for args, bounded in ((["--memory-bytes", str(256 << 20)], True), (["--memory-bytes", str(4 << 30)], False)):
            s = Session(args=args)
            try:
                s.init(bomb)
                result, hooks = s.chunk("x")
                if bounded:
                    self.assertIn("MemoryError", hooks[0]["error"])
                    self.assertEqual(result["action"], "block")
                else:
                    self.assertNotIn("error", hooks[0])
                    self.assertEqual(result["action"], "pass")
            finally:
                s.close()

    def test_settings_come_only_from_flags(self):
        """The sandbox's settings are flags: nothing in the environment (a hook's /proc/1/environ
        shows the environment the zygote's ancestors were started with)."""
        s = Session(env={"SLUICE_MEMORY_BYTES": str(256 << 20)})
        try:
            s.init([hook("bomb", "modify", "def execute(c, s):\n    x = bytearray(1 << 30)\n    return {'action': 'pass'}\n")])
            _, hooks = s.chunk("x")
            self.assertNotIn("error", hooks[0], "an env var set a limit")
        finally:
            s.close()

    @unittest.skipUnless(os.geteuid() == 0 and shutil.which("setpriv"), "needs root to run the supervisor as nobody")
    def test_pids_flag_bounds_the_processes_hooks_may_start(self):
        forker = [hook("forker", "detect", FORK_MANY)]
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        for args, bounded in ((["--pids", "2"], True), ([], False)):
            s = Session(args=args, prefix=as_nobody)
            try:
                s.init(forker)
                result, hooks = s.chunk("x")
                if bounded:
                    self.assertIn("BlockingIOError", hooks[0].get("error", ""), args)
                else:
                    self.assertNotIn("error", hooks[0], args)
            finally:
                s.close()


FORK_MANY = """import os, time
def execute(context, settings):
    pids = []
    try:
        for _ in range(12):
            pid = os.fork()
            if pid == 0:
                time.sleep(0.5)
                os._exit(0)
            pids.append(pid)
    finally:
        for pid in pids:
            os.waitpid(pid, 0)
    return {"action": "pass"}
"""


def can_unshare():
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc", "true"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False



# Leaves everything a hook can leave: a /tmp and a /dev/shm file, a double-forked setsid daemon, an
# interval timer with a handler, SysV shared memory, an abstract unix socket, a lowered rlimit, an
# environment variable, a working directory, and a consumed `random` sequence.
LEAVE_BEHIND = r"""import ctypes, os, random, resource, signal, socket, time
def execute(context, settings):
    open('/tmp/left-by-a', 'w').write('x')
    if os.path.isdir('/dev/shm'):
        open('/dev/shm/left-by-a', 'w').write('x')
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(300)
        os._exit(0)
    os.wait()
    signal.signal(signal.SIGALRM, lambda *_: open('/tmp/alarm', 'w').write('fired'))
    signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
    libc = ctypes.CDLL(None, use_errno=True)
    shm = libc.shmget(0x51c0, 4096, 0o1666)
    global SOCK
    SOCK = socket.socket(socket.AF_UNIX)
    SOCK.bind('\0sluice-left-by-a')
    SOCK.listen(1)
    resource.setrlimit(resource.RLIMIT_NOFILE, (17, 17))
    os.environ['LEFT_BY_A'] = '1'
    os.chdir('/')
    return {'action': 'detect', 'findings': {'shm': shm, 'random': [random.random() for _ in range(3)]}}
"""
# Looks for every one of those, and at everything else it can see.
LOOK_AROUND = r"""import ctypes, os, random, resource, socket
def execute(context, settings):
    fds = sorted(int(f) for f in os.listdir('/proc/self/fd'))
    procs = {}
    for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
        try:
            procs[pid] = open('/proc/' + pid + '/cmdline', 'rb').read().replace(b'\0', b' ').decode()
        except OSError:
            pass
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect('\0sluice-left-by-a')
        sock = 'reached'
    except OSError:
        sock = None
    libc = ctypes.CDLL(None, use_errno=True)
    return {'action': 'detect', 'findings': {
        'procs': procs,
        'tmp': sorted(os.listdir('/tmp')),
        'shm_dir': sorted(os.listdir('/dev/shm')) if os.path.isdir('/dev/shm') else [],
        'sysv_shm': libc.shmget(0x51c0, 4096, 0o666),
        'socket': sock,
        'nofile': resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        'env': sorted(os.environ),
        'cwd': os.getcwd(),
        'random': [random.random() for _ in range(3)],
        'fds': fds,
        'caps': [l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')],
        'ppid': os.getppid(),
    }}
"""


@unittest.skipUnless(CELLS, "this machine cannot make cells (no user namespaces): see supervisor.py --probe")
class CellTest(unittest.TestCase):
    """What cells guarantee, with the real namespaces (on the host here; the end-to-end suites check
    the same inside gVisor)."""

    def setUp(self):
        self.s = Session()
        self.addCleanup(self.s.close)

    def seen(self, hooks):
        for h in hooks:
            self.assertNotIn("error", h, hooks)
        return hooks[-1]["findings"]

    def assert_nothing_of_a(self, seen, leftover):
        self.assertEqual(list(seen["procs"]), ["1"], f"other processes are visible: {seen['procs']}")
        self.assertEqual(seen["tmp"], [])
        self.assertEqual(seen["shm_dir"], [])
        self.assertEqual(seen["sysv_shm"], -1, "SysV shared memory of another hook is reachable")
        self.assertIsNone(seen["socket"], "an abstract socket of another hook is reachable")
        self.assertNotEqual(seen["nofile"], 17)
        self.assertNotIn("LEFT_BY_A", seen["env"])
        self.assertEqual(seen["cwd"], "/tmp")
        self.assertNotEqual(seen["random"], leftover["random"], "two cells share a random sequence")

    def test_a_hook_is_alone_without_privilege_or_descriptors(self):
        self.s.init([hook("look", "detect", LOOK_AROUND)])
        seen = self.seen(self.s.chunk("x")[1])
        self.assertEqual(list(seen["procs"]), ["1"])
        self.assertEqual(seen["ppid"], 0, "its parent is outside its pid namespace")
        self.assertTrue(all(c == "0000000000000000" for c in seen["caps"][:3]), seen["caps"])  # inheritable, permitted, effective
        self.assertEqual(seen["caps"][3], "0000000000000000", "bounding set")
        # 0-2 (stdout discarded), its pipe pair, and the descriptor listdir used.
        self.assertEqual(len(seen["fds"]), 6, seen["fds"])
        self.assertEqual(seen["env"], ["LANG", "PATH"])
        self.assertEqual(self.s.end(), {"type": "ended", "clean": True})

    def test_the_next_hook_sees_nothing_of_the_previous_one(self):
        self.s.init([hook("a", "detect", LEAVE_BEHIND), hook("b", "detect", LOOK_AROUND)])
        _, hooks = self.s.chunk("x")
        self.assert_nothing_of_a(self.seen(hooks), hooks[0]["findings"])
        self.assertEqual(self.s.end(), {"type": "ended", "clean": True})

    def test_the_next_trigger_point_sees_nothing_of_the_previous_one(self):
        self.s.init([hook("a", "detect", LEAVE_BEHIND)])
        _, hooks = self.s.chunk("x")
        left = self.seen(hooks)
        self.assertGreaterEqual(left["shm"], 0, "the hook could make a SysV segment in its own ipc namespace")
        self.assertEqual(self.s.end(), {"type": "ended", "clean": True})
        # The same hook name, the same code position: a fresh process all the same.
        self.s.init([hook("a", "detect", LOOK_AROUND)])
        self.assert_nothing_of_a(self.seen(self.s.chunk("x")[1]), left)
        self.assertEqual(self.s.end()["clean"], True)

    def test_timers_and_handlers_die_with_their_hook(self):
        arm = ("import signal, time\ndef execute(c, s):\n"
               "    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(SystemExit('alarm')))\n"
               "    signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)\n    time.sleep(0.001)\n"
               "    signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)\n    return {'action': 'pass'}\n")
        slow = "import time\ndef execute(c, s):\n    time.sleep(0.3)\n    return {'action': 'modify', 'outgoing': 'slow done'}\n"
        self.s.init([hook("arm", "detect", arm), hook("slow", "modify", slow)])
        result, hooks = self.s.chunk("x")
        self.assertEqual([h.get("error") for h in hooks], [None, None], hooks)
        self.assertEqual((result["action"], hooks[1]["outgoing"]), ("modify", "slow done"))

    def test_no_hook_can_signal_or_limit_the_supervisor(self):
        attack = ("import os, signal, resource\ndef execute(c, s):\n"
                  "    out = {}\n"
                  "    for name, f in (('kill1', lambda: os.kill(1, signal.SIGKILL)), ('int1', lambda: os.kill(1, signal.SIGINT)),\n"
                  "                    ('killall', lambda: os.kill(-1, signal.SIGKILL)),\n"
                  "                    ('prlimit', lambda: resource.prlimit(1, resource.RLIMIT_NOFILE, (3, 3)))):\n"
                  "        try:\n            f(); out[name] = 'done'\n        except BaseException as e:\n            out[name] = type(e).__name__\n"
                  "    return {'action': 'detect', 'findings': out}\n")
        self.s.init([hook("attack", "detect", attack),
                     hook("after", "modify", "def execute(c, s): return {'action': 'modify', 'outgoing': 'still here'}")])
        result, hooks = self.s.chunk("x")
        # Whatever each attempt did, it hit only the hook's own namespace: the next hook runs, and
        # the supervisor answers the next trigger point.
        self.assertEqual(hooks[-1].get("outgoing"), "still here", hooks)
        self.assertEqual(self.s.end()["type"], "ended")
        self.s.init([hook("again", "modify", "def execute(c, s): return {'action': 'modify', 'outgoing': 'ok'}")])
        self.assertEqual(self.s.chunk("x")[0]["action"], "modify")

    def test_a_hook_whose_process_dies_is_blamed_alone_and_restarted_for_the_next_chunk(self):
        dies = "import os\ndef execute(c, s):\n    if c['outgoing'] == 'die':\n        os._exit(3)\n    return {'action': 'modify', 'outgoing': c['outgoing'] + '!'}\n"
        up = "def execute(c, s): return {'action': 'modify', 'outgoing': c['outgoing'].upper()}"
        self.s.init([hook("dies", "modify", dies), hook("up", "modify", up)], policy="Open")
        _, hooks = self.s.chunk("die")
        self.assertIn("died", hooks[0]["error"])
        self.assertEqual(hooks[1]["outgoing"], "DIE")
        _, hooks = self.s.chunk("again")
        self.assertEqual([h.get("outgoing") for h in hooks], ["again!", "AGAIN!"])
        self.assertEqual(self.s.end()["clean"], True)

    def test_a_dead_zygote_makes_the_sandbox_dirty(self):
        self.s.init([hook("a", "detect", "def execute(c, s): return {'action': 'pass'}")])
        self.s.chunk("x")
        ns = os.readlink(f"/proc/{self.s.proc.pid}/ns/pid")
        zygote = [p for p in children(self.s.proc.pid) if os.readlink(f"/proc/{p}/ns/pid") == ns]
        self.assertEqual(len(zygote), 1, "the supervisor's one child in its own pid namespace: the zygote")
        os.kill(zygote[0], signal.SIGKILL)
        ended = self.s.end()
        self.assertEqual((ended["clean"], ended.get("reason")), (False, "the zygote died"))

    def test_requests_out_of_order_are_refused(self):
        self.s.send({"type": "chunk", "id": 1, "outgoing": "x", "state": [], "context": {}})
        self.assertIn("without an open cell", self.s.read()["message"])
        self.s.init([hook("a", "detect", "def execute(c, s): return {'action': 'pass'}")])
        self.s.send({"type": "init", "hooks": []})
        self.assertIn("end it first", self.s.read()["message"])
        self.assertEqual(self.s.end()["clean"], True)
        self.assertEqual(self.s.end()["clean"], True, "end without a cell: nothing to close")

    def test_a_machine_without_user_namespaces_is_refused_at_start(self):
        if not shutil.which("unshare") or os.geteuid() != 0:
            self.skipTest("needs root and unshare")
        no_userns = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                     'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"', "sh"]
        proc = subprocess.run([*no_userns, sys.executable, "-I", "-S", "-u", SUPERVISOR], input=b"",
                              capture_output=True, timeout=30)
        self.assertEqual(proc.returncode, 1)
        first = json.loads(proc.stderr.splitlines()[0])
        self.assertEqual(first["type"], "error")
        self.assertIn("cannot create cells", first["message"])
        self.assertIn("runsc 20240729", first["message"])


@unittest.skipUnless(hasattr(os, "geteuid") and os.geteuid() == 0 and can_unshare() and CELLS,
                     "needs root, unshare (pid and mount namespaces) and cells")
class ClusterModeTest(unittest.TestCase):
    """A warm pod in miniature: a pid namespace whose pid 1 is `supervisor.py --listen`, with its own
    /tmp, and the attach relay exec'd into it the way the gateway execs it into a pod."""

    def setUp(self):
        # The pod's own /tmp hides the host's, so supervisor and relay run from a copy outside /tmp
        # (the checkout itself may live under /tmp).
        self.image = tempfile.mkdtemp(prefix="sluice-pod-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
        self.supervisor = shutil.copy(SUPERVISOR, self.image)
        self.attach = shutil.copy(ATTACH, self.image)
        self.addCleanup(shutil.rmtree, self.image, ignore_errors=True)

    def pod(self):
        # unshare execs the supervisor as pid 1 of the new namespace, after mounting the pod's /tmp.
        wrapper = ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "--kill-child", "sh", "-c",
                   'mount -t tmpfs -o size=16m tmpfs /tmp && exec "$@"', "sh"]
        return Pod(prefix=wrapper, supervisor=self.supervisor, attach=self.attach)

    def test_cells_in_a_pod_and_the_relay_and_pid_1_survive_them(self):
        with self.pod() as pod:
            pid1 = next(k for c in children(pod.proc.pid) for k in [c, *children(c)] if b"--listen" in cmdline(k))
            nsenter = ["nsenter", "-t", str(pid1), "-p", "-m", "--"]
            s = Session(env=pod.env, command=[*nsenter, sys.executable, "-I", "-S", self.attach])
            try:
                self.assertEqual(s.ready["pid"], 1, "the pod's main process speaks the protocol")
                for _ in range(2):  # two trigger points through one attach
                    s.init([hook("a", "detect", LEAVE_BEHIND), hook("b", "detect", LOOK_AROUND)])
                    _, hooks = s.chunk("x")
                    for h in hooks:
                        self.assertNotIn("error", h, hooks)
                    seen = hooks[1]["findings"]
                    self.assertEqual((list(seen["procs"]), seen["tmp"]), (["1"], []))
                    self.assertEqual(s.end(), {"type": "ended", "clean": True}, "the relay is no leftover")
            finally:
                s.close()
            self.assertEqual(s.proc.wait(30), 0)
            # The session over, pid 1 exits and the namespace with it: nothing of the pod is left.
            self.assertEqual(pod.proc.wait(30), 0)


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


if __name__ == "__main__":
    unittest.main()
