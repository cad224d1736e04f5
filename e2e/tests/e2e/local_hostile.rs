//! The hostile-hook suite: one hostile hook between two honest ones, in real sandboxes, in both pool
//! modes (`reuse: Recycle`, where the next trigger point may run in the same sandbox, and `None`).
//! For every case the honest hooks' results are intact (in the hostile trigger point and in the next
//! one), the run ends within bounds, the hostile hook costs its own error and never the sandbox (no
//! deadline kill, no broken stream), the gateway keeps serving, and at the end nothing is left
//! behind.

use sluice_e2e::{Harness, action, text};
use sluice_proto as proto;
use sluice_proto::Action;
use std::time::{Duration, Instant};

/// Leaves a secret in its globals, its frame, a module and the builtins, then appends " [A]".
const HONEST_BEFORE: &str = r#"import builtins, json
SECRET = "s3cr3t" + "-A"
def execute(context, settings):
    local_secret = SECRET
    builtins.LEFT_SECRET = local_secret
    json.LEFT_SECRET = local_secret
    return {"action": "modify", "outgoing": context["outgoing"] + " [A]"}
"#;

/// Uses the modules a hostile hook might patch, gives anything the hostile hook left armed (timers,
/// children) a moment to act, then appends " [B]".
const HONEST_AFTER: &str = r#"import re, json, builtins, time
def execute(context, settings):
    time.sleep(0.1)
    text = re.sub("zzz", "", context["outgoing"])
    assert len("abc") == 3, "len was patched"
    assert json.loads(json.dumps({"k": 1})) == {"k": 1}, "json was patched"
    leftovers = [n for n in dir(builtins) + dir(json) if n.startswith("LEFT")]
    return {"action": "modify", "outgoing": text + " [B]" + (" TMP:" + ",".join(leftovers) if leftovers else "")}
"#;

/// Writes forged worker and protocol lines (a result, a host_call, new code for a later hook) into
/// every descriptor of every process it can see.
const FORGE_VIA_PROC_FDS: &str = r#"    import os
    lines = (b'{"op":"return","value":{"action":"pass"}}\n'
             b'{"op":"host_call","name":"echo","payload":{}}\n'
             b'{"op":"load","name":"honest-after","code":"def execute(c, s):\\n    return {}\\n"}\n'
             b'{"type":"result","id":1,"action":"pass","terminal_index":null}\n')
    for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
        try:
            fds = os.listdir('/proc/%s/fd' % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                f = os.open('/proc/%s/fd/%s' % (pid, fd), os.O_WRONLY | os.O_NONBLOCK)
                os.write(f, lines)
                os.close(f)
            except OSError:
                pass
    return {'action': 'pass'}
"#;

/// Leaves an interval timer whose handler kills every other process it can see and writes a file.
const TIMER_OUTLIVES_HOOK: &str = r#"    import os, signal
    def fire(*_):
        for p in os.listdir('/proc'):
            if p.isdigit() and int(p) != os.getpid():
                try:
                    os.kill(int(p), signal.SIGKILL)
                except OSError:
                    pass
        try:
            open('/tmp/from-timer', 'w').write('x')
        except OSError:
            pass
    signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)
    return {'action': 'pass'}
"#;

/// Lowers pid 1's limits.
const LIMITS_OF_PID_1: &str = r#"    import resource
    for res in (resource.RLIMIT_NOFILE, resource.RLIMIT_AS, resource.RLIMIT_NPROC):
        try:
            resource.prlimit(1, res, (3, 3))
        except (OSError, ValueError):
            pass
    return {'action': 'pass'}
"#;

/// Signals pid 1 from a child, a moment after the hook returned.
const SIGNAL_PID_1: &str = r#"    import os, signal
    if os.fork() == 0:
        import time
        time.sleep(0.03)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
            try:
                os.kill(1, sig)
            except OSError:
                pass
        os._exit(0)
    return {'action': 'pass'}
"#;

/// (name, body of the hostile hook's execute, indented by 4).
fn cases(port: u16) -> Vec<(&'static str, String)> {
    let report =
        "    return {'action': 'modify', 'outgoing': c['outgoing'] + ' FOUND:' + repr(found)}\n";
    let mut v: Vec<(&str, String)> = vec![
        ("fork-bomb", "    import os\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass\n".into()),
        ("memory-bomb", "    blob = bytearray(1 << 30)\n    return {'action': 'pass'}\n".into()),
        ("memory-creep", "    keep = []\n    while True:\n        keep.append(b'x' * (1 << 20))\n".into()),
        ("infinite-loop", "    while True:\n        pass\n".into()),
        ("catastrophic-regex", "    import re\n    re.match(r'(a+)+$', 'a' * 64 + 'b')\n    return {'action': 'pass'}\n".into()),
        ("sleep-past-deadline", "    import time\n    time.sleep(60)\n".into()),
        ("stdout-flood", "    import sys\n    while True:\n        sys.stdout.write('x' * 65536)\n".into()),
        ("stderr-flood", "    import os\n    while True:\n        os.write(2, b'{\"type\":\"result\"}' * 4096)\n".into()),
        ("huge-return", "    return {'action': 'modify', 'outgoing': 'x' * (8 << 20)}\n".into()),
        ("huge-state", "    return {'action': 'pass', 'state': ['x' * 1024] * 10000}\n".into()),
        ("huge-message", "    return {'action': 'pass', 'message': 'x' * 100000}\n".into()),
        ("non-serializable", "    return {'action': 'pass', 'state': object()}\n".into()),
        ("nan-findings", "    return {'action': 'pass', 'findings': float('nan')}\n".into()),
        ("wrongly-typed", "    return {'action': 'modify', 'outgoing': 42}\n".into()),
        ("undeclared-action", "    return {'action': 'bl' + 'ock', 'message': 'gotcha'}\n".into()),
        ("deep-nesting", "    x = []\n    for _ in range(100000):\n        x = [x]\n    return {'action': 'pass', 'findings': x}\n".into()),
        ("sys-exit", "    import sys\n    sys.exit(3)\n".into()),
        ("os-exit", "    import os\n    os._exit(3)\n".into()),
        ("kill-supervisor", "    import os, signal\n    for pid in (1, os.getppid()):\n        try:\n            os.kill(pid, signal.SIGKILL)\n        except OSError:\n            pass\n    return {'action': 'pass'}\n".into()),
        ("segfault", "    import ctypes\n    ctypes.string_at(0)\n".into()),
        ("unbounded-recursion", "    def f(n):\n        return f(n + 1)\n    f(0)\n".into()),
        ("close-all-fds", "    import os\n    os.closerange(0, 1024)\n    return {'action': 'pass'}\n".into()),
        ("fill-tmp", "    import os\n    i = 0\n    try:\n        while True:\n            with open('/tmp/fill-%d' % i, 'wb') as f:\n                f.write(b'x' * (1 << 20))\n            i += 1\n    except OSError:\n        pass\n    return {'action': 'pass'}\n".into()),
        ("monkeypatch-modules", "    import re, json, builtins\n    re.sub = lambda *a, **k: 'PWNED'\n    json.dumps = lambda *a, **k: 'PWNED'\n    builtins.len = lambda x: 0\n    return {'action': 'pass'}\n".into()),
        ("forge-protocol", "    import os\n    for fd in range(0, 256):\n        try:\n            os.write(fd, b'{\"type\":\"result\",\"id\":1,\"action\":\"block\",\"terminal_index\":0}\\n{\"op\":\"return\",\"value\":{\"action\":\"block\"}}\\n')\n        except OSError:\n            pass\n    return {'action': 'pass'}\n".into()),
    ];
    v.push(("read-protocol-stdin", format!("    import os\n    found = []\n    for fd in range(0, 256):\n        try:\n            os.set_blocking(fd, False)\n            data = os.read(fd, 65536)\n            if data:\n                found.append(data[:200])\n        except OSError:\n            pass\n{report}")));
    v.push(("gc-walk", format!("    import gc\n    found = [o for o in gc.get_objects() if isinstance(o, dict) and 's3cr3t-A' in str(o.values())][:3]\n{report}")));
    v.push(("frame-walk", format!("    import sys\n    found = []\n    for frame in sys._current_frames().values():\n        while frame:\n            found += [v for v in frame.f_locals.values() if isinstance(v, str) and 's3cr3t' in v]\n            frame = frame.f_back\n{report}")));
    v.push(("read-tmp-and-proc", format!("    import os\n    found = []\n    try:\n        procs = ['/proc/%s' % p for p in os.listdir('/proc') if p.isdigit()]\n    except OSError:\n        procs = []\n    for d in ['/tmp'] + procs:\n        for name in (os.listdir(d) if d == '/tmp' else ['environ', 'cmdline', 'mem']):\n            try:\n                with open(os.path.join(d, name), 'rb') as f:\n                    data = f.read(1 << 20)\n                if b's3cr3t' in data or b'SLUICE_TEST_SECRET' in data:\n                    found.append(os.path.join(d, name))\n            except OSError:\n                pass\n{report}")));
    v.push(("network", format!("    import socket\n    found = []\n    for host, port in [('127.0.0.1', {port}), ('8.8.8.8', 53), ('10.0.0.1', 80)]:\n        try:\n            socket.create_connection((host, port), timeout=0.3).close()\n            found.append(host)\n        except OSError:\n            pass\n    try:\n        found.append(socket.gethostbyname('example.com'))\n    except OSError:\n        pass\n{report}")));
    v.push(("kill-other-workers", "    import os, signal\n    for p in os.listdir('/proc'):\n        if p.isdigit() and int(p) not in (1, os.getpid()):\n            try:\n                os.kill(int(p), signal.SIGKILL)\n            except OSError:\n                pass\n    return {'action': 'pass'}\n".into()));
    v.push(("thread-acts-later", "    import os, threading, time, signal\n    def later():\n        time.sleep(0.05)\n        for p in os.listdir('/proc'):\n            if p.isdigit() and int(p) != os.getpid():\n                try:\n                    os.kill(int(p), signal.SIGKILL)\n                except OSError:\n                    pass\n        open('/tmp/from-thread', 'w').write('x')\n    threading.Thread(target=later, daemon=True).start()\n    return {'action': 'pass'}\n".into()));
    // Each of these broke the isolation of hooks that shared the supervisor's user and pid
    // namespace (before cells): writes into other processes' descriptors forged a later hook's
    // result, a host_call in its name and new code for it; a timer outlived its hook and killed the
    // next one; pid 1's limits and signals were in reach.
    v.push(("forge-via-proc-fds", FORGE_VIA_PROC_FDS.into()));
    v.push(("timer-outlives-hook", TIMER_OUTLIVES_HOOK.into()));
    v.push(("limits-of-pid-1", LIMITS_OF_PID_1.into()));
    v.push(("signal-pid-1", SIGNAL_PID_1.into()));
    // The attack that went through fork cells: a nested user namespace, gVisor's cgroupfs mounted
    // and written, values left for the next trigger point's cell. Every step must fail.
    v.push(("cgroupfs-write", "    import os\n    found = []\n    steps = [\n        ('unshare', lambda: os.unshare(0x10000000 | 0x00020000)),\n        ('list', lambda: os.listdir('/sys/fs/cgroup')),\n        ('write', lambda: open('/sys/fs/cgroup/memory/memory.limit_in_bytes', 'w').write('1')),\n        ('mount', lambda: os.system('mount -t cgroup none /tmp')),\n    ]\n    for step, f in steps:\n        try:\n            f()\n            found.append(step)\n        except (OSError, AttributeError):\n            pass\n".to_string() + report));
    v.push(("leftover-process", "    import os, time, signal\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(0.05)\n        for p in os.listdir('/proc'):\n            if p.isdigit():\n                try:\n                    os.kill(int(p), signal.SIGKILL)\n                except OSError:\n                    pass\n        os._exit(0)\n    return {'action': 'pass'}\n".into()));
    v
}

/// `import a, b` lines rewritten as `a, b, = __import__('a'), __import__('b'),`, as an attacker
/// would write them: the static check refuses a chain that imports what the sandbox lacks
/// (`socket`, `threading`, `signal`, ...), and the case must reach the sandbox to show it holds.
fn dynamic_imports(body: &str) -> String {
    body.lines()
        .map(|line| {
            let code = line.trim_start();
            let indent = &line[..line.len() - code.len()];
            match code.strip_prefix("import ") {
                Some(names) if !names.contains(" as ") => {
                    let names: Vec<&str> = names.split(',').map(str::trim).collect();
                    let targets: String = names.iter().map(|n| format!("{n}, ")).collect();
                    let values: String = names
                        .iter()
                        .map(|n| format!("__import__('{n}'), "))
                        .collect();
                    format!("{indent}{}= {}\n", targets.trim_end(), values.trim_end())
                }
                _ => format!("{line}\n"),
            }
        })
        .collect()
}

fn chain(name: &str, body: &str, reuse: &str) -> String {
    let hostile = format!("def execute(c, s):\n{}", dynamic_imports(body));
    let mut y = format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  target: {name}\n  triggerPoint: input\n  failurePolicy: Open\n  timeoutMs: 3000\n  pool: {{warm: 1, max: 4, reuse: {reuse}}}\n  resources: {{cpu: '1', memory: 128Mi, pids: 32}}\n  hooks:\n"
    );
    for (hook, action, code) in [
        ("honest-before", "modify", HONEST_BEFORE),
        ("hostile", "modify", hostile.as_str()),
        ("honest-after", "modify", HONEST_AFTER),
    ] {
        y.push_str(&format!(
            "    - name: {hook}\n      action: {action}\n      code: |\n"
        ));
        for l in code.lines() {
            y.push_str(&format!("        {l}\n"));
        }
    }
    y
}

/// What is wrong with one answer of a hostile case's chain, if anything.
fn problems(name: &str, r: &proto::RunResponse, took: Duration) -> Vec<String> {
    let out = text(r).to_string();
    let honest = |hook: &str| {
        r.hooks
            .iter()
            .find(|o| o.name == hook)
            .map(|o| (o.error.clone(), o.action))
    };
    let mut problems = Vec::new();
    if honest("honest-before") != Some((String::new(), Action::Modify as i32)) {
        problems.push(format!("honest-before: {:?}", honest("honest-before")));
    }
    if honest("honest-after") != Some((String::new(), Action::Modify as i32)) {
        problems.push(format!("honest-after: {:?}", honest("honest-after")));
    }
    if !out.contains(" [A]") || !out.contains(" [B]") {
        problems.push(format!(
            "honest results missing from {:?}",
            &out[..out.len().min(300)]
        ));
    }
    if out.contains("s3cr3t")
        || out.contains("gateway-env")
        || out.contains("TMP:")
        || out.contains("FOUND:['127.0.0.1'")
    {
        problems.push(format!("leaked: {:?}", &out[..out.len().min(400)]));
    }
    if out.contains("FOUND:") && !out.contains("FOUND:[]") {
        problems.push(format!(
            "the hostile hook found something: {:?}",
            &out[..out.len().min(400)]
        ));
    }
    if name.ends_with("-flood") {
        let hostile = r
            .hooks
            .iter()
            .find(|o| o.name == "hostile")
            .map(|o| o.error.clone())
            .unwrap_or_default();
        // What a hook prints never leaves its instance: the flood runs until its deadline.
        if !hostile.contains("timed out") {
            problems.push(format!(
                "the flood did not end at its deadline: {hostile:?}"
            ));
        }
    }
    if action(r) != Action::Modify {
        problems.push(format!("top action {:?}", action(r)));
    }
    if took > Duration::from_secs(20) {
        problems.push(format!("took {took:?}"));
    }
    problems
}

async fn hostile_hooks_never_break_honest_ones_or_the_gateway(reuse: &str) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    // SAFETY: set before the gateway starts; the hooks must never see it.
    // (set_var is unsafe since edition 2024: nothing else touches the environment meanwhile.)
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("SLUICE_TEST_SECRET", "gateway-env")
    };
    let cases = cases(port);
    assert!(cases.len() >= 35, "the suite has {} cases", cases.len());
    let files: Vec<(String, String)> = cases
        .iter()
        .map(|(n, b)| (format!("{n}.yaml"), chain(n, b, reuse)))
        .collect();
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let h = Harness::start_with(&refs, |o| o.boot_concurrency = 2).await;

    let mut failures = Vec::new();
    let mut runs = 0;
    let broken = || {
        h.retirements()
            .into_iter()
            .find(|(reason, _)| reason == "broken")
            .map_or(0, |(_, n)| n)
    };
    for (name, _) in &cases {
        let broken_before = broken();
        // The hostile trigger point, then the next one: in Recycle mode it runs in the same
        // sandbox whenever the supervisor found it clean.
        for attempt in ["hostile", "next"] {
            let began = Instant::now();
            runs += 1;
            let r = match tokio::time::timeout(
                Duration::from_secs(30),
                h.run_text(name, "input", "msg"),
            )
            .await
            {
                Ok(Ok(r)) => r,
                Ok(Err(s)) => {
                    failures.push(format!("{name} ({attempt}): the gateway answered {s:?}"));
                    continue;
                }
                Err(_) => {
                    failures.push(format!("{name} ({attempt}): no answer within 30 s"));
                    continue;
                }
            };
            let found = problems(name, &r, began.elapsed());
            if !found.is_empty() {
                failures.push(format!("{name} ({attempt}): {}", found.join("; ")));
            }
        }
        // A sandbox is retired as broken when it is dropped after the run: the count has moved by
        // the time the next run claims one, so a case's kills show by the end of the next case
        // at the latest; the last case is checked after the final run below.
        if broken() > broken_before {
            failures.push(format!(
                "{name}: the hostile hook cost a sandbox (a deadline kill or a broken stream)"
            ));
        }
    }
    assert!(
        listener.accept().is_err(),
        "a hook connected to the host's loopback listener"
    );

    // The gateway still serves every chain, and each run has exactly one audit event.
    let r = h
        .run_text("undeclared-action", "input", "again")
        .await
        .unwrap();
    assert!(text(&r).ends_with(" [A] [B]"), "{r:?}");
    if broken() > 0 && failures.iter().all(|f| !f.contains("cost a sandbox")) {
        failures.push(format!("{} sandboxes were retired as broken", broken()));
    }
    assert!(
        failures.is_empty(),
        "{reuse}: hostile cases that broke something:\n{}",
        failures.join("\n")
    );
    let audit = h.audit();
    assert_eq!(audit.len(), runs + 1, "one audit event per run");
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_hooks_never_break_honest_ones_or_the_gateway_recycle() {
    hostile_hooks_never_break_honest_ones_or_the_gateway("Recycle").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_hooks_never_break_honest_ones_or_the_gateway_none() {
    hostile_hooks_never_break_honest_ones_or_the_gateway("None").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_point_cannot_see_the_previous_ones_files_or_processes() {
    let probe = "    import builtins, os, sys\n    found = [n for n in dir(builtins) if n.startswith('left_by')] + [m for m in sys.modules if m.startswith('left_by')]\n    builtins.left_by_earlier_run = 'x'\n    sys.modules['left_by_earlier_run'] = sys\n    try:\n        found += sorted(os.listdir('/tmp')) + [p for p in os.listdir('/proc') if p.isdigit()]\n    except OSError:\n        pass\n    try:\n        os.fork()\n        found.append('forked')\n    except (OSError, AttributeError):\n        pass\n    return {'action': 'modify', 'outgoing': c['outgoing'] + ' FOUND:' + repr(found)}\n";
    let yaml = chain("probe", probe, "None");
    let h = Harness::start(&[("probe.yaml", &yaml)]).await;
    let first = text(&h.run_text("probe", "input", "one").await.unwrap()).to_string();
    let second = text(&h.run_text("probe", "input", "two").await.unwrap()).to_string();
    for out in [&first, &second] {
        assert!(
            !out.contains("left-by-earlier-run"),
            "a file of an earlier trigger point is visible: {out}"
        );
        assert!(out.contains(" [A]") && out.contains(" [B]"), "{out}");
    }
    // Each cell finds nothing: no file, no process, nothing an earlier trigger point left.
    for out in [&first, &second] {
        assert!(out.contains("FOUND:[]"), "{out}");
    }
    h.stop_and_check_leaks().await;
}

/// Four hooks of 100 MiB each, every one within the chain's 128 MiB: each instance is reset as soon
/// as its hook answered, so the walk fits in the sandbox (memory + the runtime's allowance) and no
/// hook is OOM-killed for memory the hooks before it used.
async fn hooks_within_their_memory_limit_never_exceed_the_sandbox(reuse: &str) {
    let mut y = format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {{name: big, namespace: default}}\nspec:\n  target: big\n  triggerPoint: input\n  failurePolicy: Closed\n  timeoutMs: 20000\n  pool: {{warm: 1, max: 2, reuse: {reuse}}}\n  resources: {{cpu: '1', memory: 128Mi, pids: 32}}\n  hooks:\n"
    );
    for i in 0..4 {
        y.push_str(&format!("    - name: big-{i}\n      action: modify\n      code: |\n        def execute(context, settings):\n            blob = b'x' * (100 << 20)\n            return {{'action': 'modify', 'outgoing': context['outgoing'] + ' {i}:' + str(len(blob) >> 20)}}\n"));
    }
    let h = Harness::start(&[("big.yaml", &y)]).await;
    for _ in 0..2 {
        let r = h.run_text("big", "input", "m").await.unwrap();
        let errors: Vec<&str> = r
            .hooks
            .iter()
            .map(|o| o.error.as_str())
            .filter(|e| !e.is_empty())
            .collect();
        assert!(errors.is_empty(), "{reuse}: {errors:?}");
        assert_eq!(text(&r), "m 0:100 1:100 2:100 3:100", "{reuse}: {r:?}");
    }
    let broken: Vec<(String, u64)> = h
        .retirements()
        .into_iter()
        .filter(|(r, _)| r == "broken")
        .collect();
    assert!(broken.is_empty(), "{reuse}: {broken:?}");
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_within_their_memory_limit_never_exceed_the_sandbox_recycle() {
    hooks_within_their_memory_limit_never_exceed_the_sandbox("Recycle").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_within_their_memory_limit_never_exceed_the_sandbox_none() {
    hooks_within_their_memory_limit_never_exceed_the_sandbox("None").await;
}
