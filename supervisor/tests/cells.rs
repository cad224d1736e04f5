//! The supervisor as the gateway drives it, over its real protocol, with real WebAssembly instances:
//! what a hook can and cannot do, and that nothing of one hook or trigger point reaches another.
//! Natively here (no gVisor): the instance is the wall these tests prove; the e2e suites prove the
//! same inside runsc.

use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long a test waits for any one answer before it calls the supervisor hung: far beyond any
/// deadline the tests set, so it only ever catches a supervisor that does not answer at all.
const HUNG: Duration = Duration::from_secs(120);

struct Supervisor {
    child: Child,
    stdin: ChildStdin,
    /// Protocol lines as read by a thread of their own, so that a hung supervisor fails the test.
    answers: mpsc::Receiver<String>,
    next: u64,
    /// The longest protocol line it sent so far, in bytes.
    longest: usize,
}

fn runtime() -> PathBuf {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_sluice-supervisor"));
    let runtime = exe.with_file_name("sluice-cell.cwasm");
    assert!(
        runtime.is_file(),
        "no cell runtime at {}: run `make cell` first",
        runtime.display()
    );
    runtime
}

impl Supervisor {
    fn start(memory_bytes: u64) -> Self {
        Self::start_with(memory_bytes, &[])
    }

    fn start_with(memory_bytes: u64, flags: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice-supervisor"))
            .arg("--runtime")
            .arg(runtime())
            .args(["--memory-bytes", &memory_bytes.to_string()])
            .args(flags)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the supervisor starts");
        let stdin = child.stdin.take().unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap());
        let (tx, answers) = mpsc::channel();
        std::thread::spawn(move || {
            loop {
                let mut line = String::new();
                match lines.read_line(&mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        if tx.send(line).is_err() {
                            return;
                        }
                    }
                }
            }
        });
        let mut s = Self {
            child,
            stdin,
            answers,
            next: 0,
            longest: 0,
        };
        let ready = s.read();
        assert_eq!(ready["type"], "ready", "{ready}");
        assert_eq!(ready["protocol"], 3);
        s
    }

    fn send(&mut self, msg: Value) {
        writeln!(self.stdin, "{msg}").unwrap();
        self.stdin.flush().unwrap();
    }

    fn read(&mut self) -> Value {
        let line = self
            .answers
            .recv_timeout(HUNG)
            .unwrap_or_else(|e| panic!("no answer from the supervisor within {HUNG:?}: {e}"));
        self.longest = self.longest.max(line.len());
        serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("not a protocol line ({e}): {line:?}"))
    }

    /// Opens a cell with `hooks` (name, action, code); the ack.
    fn init(
        &mut self,
        trigger_point: &str,
        timeout_ms: u64,
        hooks: &[(&str, &str, &str)],
    ) -> Value {
        let hooks: Vec<Value> = hooks
            .iter()
            .map(|(name, action, code)| json!({"name": name, "action": action, "settings": {"k": "v"}, "code": code}))
            .collect();
        self.send(
            json!({"type": "init", "trigger_point": trigger_point, "failure_policy": "Open",
                         "timeout_ms": timeout_ms, "hooks": hooks}),
        );
        let ack = self.read();
        assert_eq!(ack["type"], "ack", "{ack}");
        ack
    }

    /// One walk, as a gateway that sends no moment sends it; the hook results (host calls
    /// answered by `answer`).
    fn chunk(&mut self, outgoing: Value, answer: impl Fn(&Value) -> Value) -> Vec<Value> {
        self.walk(json!({"outgoing": outgoing}), answer)
    }

    /// One walk of a run whose moment is `moment_ms`; the hook results.
    fn chunk_at(&mut self, outgoing: Value, moment_ms: u64) -> Vec<Value> {
        self.walk(
            json!({"outgoing": outgoing, "moment_ms": moment_ms}),
            no_host,
        )
    }

    /// Sends a `chunk` made of `fields` (and an id, `start` 0, no state, a context) and reads its
    /// hook results (host calls answered by `answer`) up to its `result`.
    fn walk(&mut self, fields: Value, answer: impl Fn(&Value) -> Value) -> Vec<Value> {
        self.next += 1;
        let mut msg = json!({"type": "chunk", "id": self.next, "start": 0, "state": [], "context": {"target": "t"}});
        if let (Some(msg), Some(fields)) = (msg.as_object_mut(), fields.as_object()) {
            msg.extend(fields.clone());
        }
        self.send(msg);
        let mut results = Vec::new();
        loop {
            let msg = self.read();
            match msg["type"].as_str() {
                Some("hook_result") => results.push(msg),
                Some("host_call") => {
                    let mut reply = answer(&msg);
                    reply["type"] = json!("host_result");
                    reply["id"] = msg["id"].clone();
                    self.send(reply);
                }
                Some("result") => return results,
                _ => panic!("unexpected {msg}"),
            }
        }
    }

    fn end(&mut self) {
        self.send(json!({"type": "end"}));
        let ended = self.read();
        assert_eq!(ended, json!({"type": "ended", "clean": true}));
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn no_host(_: &Value) -> Value {
    json!({"ok": false, "error": "no host calls here"})
}

fn findings(result: &Value) -> &Value {
    assert!(result.get("error").is_none(), "the hook failed: {result}");
    &result["findings"]
}

const SNOOP: &str = r#"
import json, builtins, sys, os, random
def execute(context, settings):
    seen = {
        'global': globals().get('LEFT'),
        'builtin': getattr(builtins, 'LEFT', None),
        'json_patched': json.dumps({}) != '{}',
        'modules': sorted(m for m in sys.modules if m.startswith('hook_')),
        'random': random.random(),
    }
    try:
        seen['tmp'] = os.listdir('/tmp')
    except OSError as e:
        seen['tmp'] = type(e).__name__
    return {'action': 'detect', 'findings': seen}
"#;

const LEAVE: &str = r#"
import json, builtins, sys
LEFT = 'module'
def execute(context, settings):
    global LEFT
    LEFT = context['outgoing']
    builtins.LEFT = context['outgoing']
    json.dumps = lambda *a, **k: 'patched'
    sys.modules['hook_spy'] = sys
    with open('/tmp/left', 'w') as f:
        f.write(context['outgoing'])
    return {'action': 'pass'}
"#;

#[test]
fn nothing_of_one_hook_or_trigger_point_reaches_the_next() {
    let mut s = Supervisor::start(256 << 20);
    let ack = s.init(
        "input",
        2000,
        &[("leave", "detect", LEAVE), ("snoop", "detect", SNOOP)],
    );
    assert_eq!(ack["hooks"][0]["ok"], true, "{ack}");
    let first = s.chunk(json!("secret-1"), no_host);
    let seen = findings(&first[1]).clone();
    // The hook after it in the same walk sees none of what it left, nor its module.
    assert_eq!(seen["global"], Value::Null, "{seen}");
    assert_eq!(seen["builtin"], Value::Null, "{seen}");
    assert_eq!(seen["json_patched"], false, "{seen}");
    assert_eq!(seen["modules"], json!([]), "{seen}");
    // /tmp works, and is the instance's own: empty for the next hook.
    assert_eq!(seen["tmp"], json!([]), "{seen}");
    s.end();
    // Nor does the next trigger point, in the same supervisor; and randomness is drawn afresh.
    s.init("input", 2000, &[("snoop", "detect", SNOOP)]);
    let again = s.chunk(json!("x"), no_host);
    let later = findings(&again[0]);
    assert_eq!(later["global"], Value::Null);
    assert_eq!(later["builtin"], Value::Null);
    assert_eq!(later["json_patched"], false);
    assert_ne!(
        later["random"], seen["random"],
        "two instances drew the same random number"
    );
    s.end();
}

#[test]
fn an_endless_loop_is_stopped_at_the_deadline_and_the_supervisor_serves_on() {
    let mut s = Supervisor::start(256 << 20);
    s.init(
        "input",
        300,
        &[(
            "spin",
            "detect",
            "def execute(context, settings):\n    while True:\n        pass\n",
        )],
    );
    let r = s.chunk(json!("x"), no_host);
    let error = r[0]["error"]
        .as_str()
        .expect("a timeout is the hook's error");
    assert!(error.contains("timed out after 300 ms"), "{error}");
    assert!(error.contains("endless loop"), "{error}");
    s.end();
    s.init("input", 300, &[("ok", "modify", "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': context['outgoing'] + '!'}\n")]);
    let r = s.chunk(json!("x"), no_host);
    assert_eq!(r[0]["outgoing"], "x!", "{r:?}");
    s.end();
}

#[test]
fn a_hook_that_eats_memory_fails_alone() {
    let mut s = Supervisor::start(96 << 20);
    s.init(
        "input",
        5000,
        &[
            ("eat", "detect", "def execute(context, settings):\n    x = bytearray(512 << 20)\n    return {'action': 'pass'}\n"),
            ("after", "modify", "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': 'fine'}\n"),
        ],
    );
    let r = s.chunk(json!("x"), no_host);
    let error = r[0]["error"].as_str().expect("the allocation fails");
    assert!(
        error.contains("MemoryError") || error.contains("out of memory"),
        "{error}"
    );
    assert_eq!(r[1]["outgoing"], "fine", "{r:?}");
    s.end();
}

#[test]
fn hook_output_never_reaches_the_protocol_and_comes_back_bounded_per_hook() {
    let mut s = Supervisor::start(256 << 20);
    let loud = "import os, sys\ndef execute(context, settings):\n    print('x' * 100000)\n    sys.stderr.write('{\"type\": \"result\"}\\n' * 100)\n    os.write(2, b'{\"type\": \"ended\", \"clean\": true}\\n')\n    os.write(1, b'out')\n    return {'action': 'modify', 'outgoing': 'quiet'}\n";
    let chatty = "def execute(context, settings):\n    print('seen', context['outgoing'])\n    return {'action': 'pass'}\n";
    let silent = "def execute(context, settings):\n    return {'action': 'pass'}\n";
    let spin = "def execute(context, settings):\n    print('before the loop')\n    while True:\n        pass\n";
    s.init(
        "input",
        1000,
        &[
            ("loud", "modify", loud),
            ("chatty", "detect", chatty),
            ("silent", "detect", silent),
            ("spin", "detect", spin),
        ],
    );
    let r = s.chunk(json!("x"), no_host);
    assert_eq!(r.len(), 4);
    assert_eq!(r[0]["outgoing"], "quiet", "{r:?}");
    // The end of what the hook wrote, stdout and stderr as written, bounded, saying what it dropped.
    let out = r[0]["output"].as_str().expect("the loud hook's output");
    assert!(
        out.ends_with("{\"type\": \"ended\", \"clean\": true}\nout"),
        "{out:.200}"
    );
    assert!(
        out.starts_with('[') && out.contains("earlier bytes of output dropped"),
        "{out:.200}"
    );
    assert!(out.len() < 4200, "{} bytes came back", out.len());
    // Each hook's own: the next one starts with nothing of it.
    assert_eq!(r[1]["output"], "seen quiet\n", "{:?}", r[1]);
    assert!(r[2].get("output").is_none(), "{:?}", r[2]);
    // Output written before a deadline is not lost in a buffer.
    assert!(
        r[3]["error"].as_str().unwrap().contains("timed out"),
        "{:?}",
        r[3]
    );
    assert_eq!(r[3]["output"], "before the loop\n", "{:?}", r[3]);
    s.end();
}

#[test]
fn tmp_is_private_in_memory_and_bounded_by_the_hooks_memory() {
    let files = r#"
import os
def execute(context, settings):
    os.makedirs('/tmp/a/b', exist_ok=True)
    with open('/tmp/a/b/t.txt', 'w') as f:
        f.write('héllo\n')
    with open('/tmp/a/b/t.txt', 'a') as f:
        print('again', file=f)
    with open('/tmp/bin', 'wb') as f:
        f.write(bytes(range(4)))
    os.replace('/tmp/bin', '/tmp/a/bin')
    seen = {
        'text': open('/tmp/a/b/t.txt').read(),
        'bin': list(open('/tmp/a/bin', 'rb').read()),
        'ls': os.listdir('/tmp/a'),
        'size': os.path.getsize('/tmp/a/bin'),
        'isdir': os.path.isdir('/tmp/a/b'),
    }
    os.remove('/tmp/a/bin')
    seen['gone'] = not os.path.exists('/tmp/a/bin')
    try:
        open('/tmp/missing')
    except FileNotFoundError:
        seen['missing'] = 'FileNotFoundError'
    try:
        open('/etc/hostname', 'w')
    except OSError:
        seen['elsewhere'] = 'OSError'
    return {'action': 'detect', 'findings': seen}
"#;
    let fill = "def execute(context, settings):\n    with open('/tmp/big', 'wb') as f:\n        for _ in range(64):\n            f.write(b'x' * (4 << 20))\n    return {'action': 'pass'}\n";
    let mut s = Supervisor::start(96 << 20);
    s.init(
        "input",
        5000,
        &[
            ("files", "detect", files),
            ("fill", "detect", fill),
            ("snoop", "detect", SNOOP),
        ],
    );
    let r = s.chunk(json!("x"), no_host);
    let seen = findings(&r[0]);
    assert_eq!(seen["text"], "héllo\nagain\n", "{seen}");
    assert_eq!(seen["bin"], json!([0, 1, 2, 3]), "{seen}");
    assert_eq!(seen["ls"], json!(["b", "bin"]), "{seen}");
    assert_eq!(seen["size"], 4, "{seen}");
    assert_eq!(seen["isdir"], true, "{seen}");
    assert_eq!(seen["gone"], true, "{seen}");
    assert_eq!(seen["missing"], "FileNotFoundError", "{seen}");
    assert_eq!(seen["elsewhere"], "OSError", "{seen}");
    // 256 MiB of files in a hook allowed 96 MiB: the hook's own memory error, nobody else's.
    let error = r[1]["error"].as_str().expect("filling /tmp fails");
    assert!(
        error.contains("MemoryError") || error.contains("out of memory"),
        "{error}"
    );
    assert_eq!(findings(&r[2])["tmp"], json!([]), "{:?}", r[2]);
    s.end();
}

#[test]
fn a_hook_has_no_processes_threads_sockets_or_host_files() {
    let probe = r#"
import os
def attempt(f):
    try:
        f()
        return 'allowed'
    except BaseException as e:
        return type(e).__name__
def thread():
    import threading
    threading.Thread(target=lambda: None).start()
def execute(context, settings):
    return {'action': 'detect', 'findings': {
        'cgroupfs': attempt(lambda: os.listdir('/sys/fs/cgroup')),
        'proc': attempt(lambda: os.listdir('/proc')),
        'root': attempt(lambda: os.listdir('/')),
        'etc': attempt(lambda: open('/etc/passwd').read()),
        'fork': attempt(lambda: os.fork()),
        'system': attempt(lambda: os.system('true')),
        'socket': attempt(lambda: __import__('socket').socket()),
        'subprocess': attempt(lambda: __import__('subprocess').run(['true'])),
        'thread': attempt(thread),
        'kill': attempt(lambda: os.kill(1, 9)),
    }}
"#;
    let mut s = Supervisor::start(256 << 20);
    s.init("input", 5000, &[("probe", "detect", probe)]);
    let r = s.chunk(json!("x"), no_host);
    let seen = findings(&r[0]);
    for (what, outcome) in seen.as_object().unwrap() {
        assert_ne!(outcome, "allowed", "{what} was allowed: {seen}");
    }
    s.end();
}

#[test]
fn an_unavailable_module_is_refused_with_a_reason_at_load() {
    let mut s = Supervisor::start(256 << 20);
    let ack = s.init(
        "input",
        2000,
        &[(
            "net",
            "detect",
            "import socket\ndef execute(context, settings):\n    return {'action': 'pass'}\n",
        )],
    );
    let error = ack["hooks"][0]["error"]
        .as_str()
        .expect("the import fails at load");
    assert!(
        error.contains("'socket'") && error.contains("sandbox"),
        "{error}"
    );
    assert_eq!(ack["hooks"][0]["line"], 1);
    s.end();
}

#[test]
fn host_calls_go_to_the_gateway_and_errors_carry_their_code() {
    let code = r#"
def execute(context, settings):
    got = context.host_call('echo', {'n': 1})
    try:
        context.host_call('credit.check', {})
        denied = None
    except HostCallError as e:
        denied = [str(e), e.code]
    return {'action': 'detect', 'findings': {'got': got, 'denied': denied, 'settings': settings}}
"#;
    let mut s = Supervisor::start(256 << 20);
    s.init("input", 2000, &[("caller", "detect", code)]);
    let r = s.chunk(json!("x"), |call| {
        if call["name"] == "echo" {
            json!({"ok": true, "result": {"echo": call["payload"], "hook": call["hook"]}})
        } else {
            json!({"ok": false, "error": "no credit left", "code": "denied"})
        }
    });
    let seen = findings(&r[0]);
    assert_eq!(seen["got"], json!({"echo": {"n": 1}, "hook": 0}));
    assert_eq!(seen["denied"], json!(["no credit left", "denied"]));
    assert_eq!(seen["settings"], json!({"k": "v"}));
    s.end();
}

#[test]
fn module_code_errors_and_syntax_errors_name_the_line() {
    let mut s = Supervisor::start(256 << 20);
    let ack = s.init(
        "input",
        2000,
        &[
            (
                "syntax",
                "detect",
                "def execute(context, settings):\n    return {'action': 'pass'\n",
            ),
            (
                "raises",
                "detect",
                "X = 1\nraise RuntimeError('at import')\n",
            ),
            ("none", "detect", "X = 1\n"),
            (
                "undeclared",
                "pass",
                "def execute(c, s):\n    return {'action': 'pass'}\n",
            ),
        ],
    );
    let hooks = ack["hooks"].as_array().unwrap();
    assert!(
        hooks[0]["error"]
            .as_str()
            .unwrap()
            .starts_with("SyntaxError"),
        "{ack}"
    );
    assert!(hooks[0]["line"].as_u64().is_some(), "{ack}");
    assert!(
        hooks[1]["error"]
            .as_str()
            .unwrap()
            .contains("RuntimeError: at import"),
        "{ack}"
    );
    assert_eq!(hooks[1]["line"], 2, "{ack}");
    assert!(
        hooks[2]["error"]
            .as_str()
            .unwrap()
            .contains("does not define a function execute"),
        "{ack}"
    );
    assert!(
        hooks[3]["error"]
            .as_str()
            .unwrap()
            .contains("declared action"),
        "{ack}"
    );
    s.end();
}

#[test]
fn the_modules_sluice_check_accepts_are_the_ones_an_instance_has() {
    let list = r#"
import sys
def execute(context, settings):
    # Importable: what the snapshot holds, and the modules built into the interpreter.
    names = sorted({m for m in list(sys.modules) + list(sys.builtin_module_names) if not any(p.startswith('_') for p in m.split('.'))})
    return {'action': 'detect', 'findings': names}
"#;
    let mut s = Supervisor::start(256 << 20);
    s.init("input", 5000, &[("list", "detect", list)]);
    let r = s.chunk(json!("x"), no_host);
    // The runner's own modules are there too, but are not for hooks.
    let internal = [
        "componentize_py_runtime",
        "componentize_py_types",
        "runner",
        "site",
        "tmpfs",
        "wit_world",
    ];
    let found: Vec<&str> = findings(&r[0])
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .filter(|m| !internal.contains(m))
        .collect();
    assert_eq!(
        found,
        sluice_crds::code::SANDBOX_MODULES,
        "update sluice_crds::code::SANDBOX_MODULES (and docs/hooks.md) to what the cell runtime has"
    );
    s.end();
}

/// CPU time (user + system) the process `pid` has used, from /proc/<pid>/stat.
fn cpu_of(pid: u32) -> std::time::Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    std::time::Duration::from_millis(ticks * 10) // USER_HZ is 100 on Linux
}

#[test]
fn an_open_cell_runs_nothing_while_it_waits() {
    // Module code that tries to leave something running: a thread (there are none), a loop that
    // never ends (stopped at the load's deadline). Then the cell waits, as a prepared cell in a
    // warm pool does, and must cost no CPU while it does.
    let spawner = "spin = lambda: [None for _ in iter(int, 1)]\n__import__('threading').Thread(target=spin, daemon=True).start()\ndef execute(context, settings):\n    return {'action': 'pass'}\n";
    let spinner =
        "while True:\n    pass\ndef execute(context, settings):\n    return {'action': 'pass'}\n";
    let fine =
        "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': 'fine'}\n";
    let mut s = Supervisor::start(256 << 20);
    let ack = s.init(
        "input",
        300,
        &[
            ("spawner", "detect", spawner),
            ("spinner", "detect", spinner),
            ("fine", "modify", fine),
        ],
    );
    assert_eq!(ack["hooks"][0]["ok"], false, "{ack}");
    assert_eq!(ack["hooks"][1]["ok"], false, "{ack}");
    assert!(
        ack["hooks"][1]["error"]
            .as_str()
            .unwrap()
            .contains("did not finish"),
        "{ack}"
    );
    let pid = s.child.id();
    let before = cpu_of(pid);
    std::thread::sleep(std::time::Duration::from_secs(2));
    let idle = cpu_of(pid) - before;
    // A thread or loop left running would use the whole 2 s; an idle supervisor uses ~0.
    assert!(
        idle < std::time::Duration::from_millis(200),
        "the waiting cell used {idle:?} of CPU in 2 s"
    );
    let r = s.chunk(json!("x"), no_host);
    assert_eq!(r[2]["outgoing"], "fine", "{r:?}");
    s.end();
}

#[test]
fn all_hooks_module_code_runs_within_the_chains_deadline() {
    // Each hook's module code alone fits in the 1 s deadline; all three together do not.
    let slow = "import time\ntime.sleep(0.4)\ndef execute(context, settings):\n    return {'action': 'pass'}\n";
    let mut s = Supervisor::start(256 << 20);
    let ack = s.init(
        "input",
        1000,
        &[
            ("a", "detect", slow),
            ("b", "detect", slow),
            ("c", "detect", &slow.replace("0.4", "0.41")),
        ],
    );
    assert_eq!(ack["hooks"][0]["ok"], true, "{ack}");
    assert_eq!(ack["hooks"][1]["ok"], true, "{ack}");
    assert_eq!(ack["hooks"][2]["ok"], false, "{ack}");
    let error = ack["hooks"][2]["error"].as_str().unwrap();
    assert!(
        error.contains("did not finish within the chain's spec.timeoutMs (1000 ms"),
        "{error}"
    );
    s.end();
}

/// `ping` is answered `pong` at once, with or without an open cell, and changes nothing: the
/// gateway's keepalive over a held sandbox's idle stream.
#[test]
fn a_ping_is_answered_with_or_without_a_cell() {
    let mut s = Supervisor::start(64 << 20);
    s.send(json!({"type": "ping"}));
    assert_eq!(s.read(), json!({"type": "pong"}));
    let ack = s.init("input", 2000, &[("p", "modify", "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': context['outgoing'] + '!'}")]);
    assert_eq!(ack["type"], "ack", "{ack}");
    s.send(json!({"type": "ping"}));
    assert_eq!(s.read(), json!({"type": "pong"}));
    s.send(json!({"type": "chunk", "id": 1, "start": 0, "outgoing": "hi", "state": [null], "context": {}}));
    let hook = s.read();
    assert_eq!(hook["outgoing"], "hi!", "{hook}");
    assert_eq!(s.read()["type"], "result");
}

#[test]
fn a_walk_only_calls_execute_its_module_code_ran_before() {
    // Module code (0.7 s) and execute (0.5 s) together exceed the 1 s deadline; each alone fits.
    // The instance each hook runs in was prepared, its module code run, before the trigger point:
    // the walk only calls execute, so every trigger point passes within its deadline. (Module code
    // run ahead of the walk reads the clocks at the epoch; execute reads the walk's start.)
    let slow = "import time\ntime.sleep(0.7)\nLOADED_AT = time.monotonic()\ndef execute(context, settings):\n    time.sleep(0.5)\n    return {'action': 'detect', 'findings': {'loaded_ahead': LOADED_AT == 0, 'now': time.monotonic() > 0}}\n";
    let mut s = Supervisor::start(256 << 20);
    for _ in 0..3 {
        let ack = s.init("input", 1000, &[("slow", "detect", slow)]);
        assert_eq!(ack["hooks"][0]["ok"], true, "{ack}");
        let r = s.chunk(json!("x"), no_host);
        assert_eq!(r[0].get("error"), None, "{r:?}");
        assert_eq!(findings(&r[0])["loaded_ahead"], true, "{r:?}");
        assert_eq!(findings(&r[0])["now"], true, "{r:?}");
        s.end();
    }
}

/// Reads every clock before and after some work, in module code and in `execute`.
const CLOCK_READER: &str = "import time, datetime\nAT_LOAD = [time.time_ns(), time.monotonic_ns()]\ndef execute(context, settings):\n    before = [time.time_ns(), time.monotonic_ns(), time.perf_counter_ns(), datetime.datetime.now().timestamp()]\n    n = sum(i % 7 for i in range(200000))\n    after = [time.time_ns(), time.monotonic_ns(), time.perf_counter_ns(), datetime.datetime.now().timestamp()]\n    return {'action': 'detect', 'findings': {'before': before, 'after': after, 'at_load': AT_LOAD, 'n': n}}\n";

/// Hooks of one run cannot time each other, whichever sandbox and cell serve its walks: every clock
/// an instance can read stands at the moment the `chunk` carries (`moment_ms`, the run's), in every
/// hook and every walk, and in another cell given the same moment; module code reads the epoch
/// when it ran ahead of the walk (a prepared instance), that same moment when it runs in the walk.
#[test]
fn the_clocks_read_the_moment_the_chunk_carries() {
    const MOMENT_MS: u64 = 1_767_225_600_000;
    let ns = MOMENT_MS * 1_000_000;
    let moment = json!([ns, ns, ns, (MOMENT_MS / 1000) as f64]);
    let mut s = Supervisor::start(256 << 20);
    for cell in 0..2 {
        s.init(
            "input",
            5000,
            &[("a", "detect", CLOCK_READER), ("b", "detect", CLOCK_READER)],
        );
        for _ in 0..2 {
            let results = s.chunk_at(json!("x"), MOMENT_MS);
            assert_eq!(results.len(), 2, "{results:?}");
            for r in &results {
                let f = findings(r);
                assert_eq!(f["before"], moment, "cell {cell}: {r}");
                assert_eq!(f["after"], moment, "cell {cell}: {r}");
                assert!(
                    f["at_load"] == json!([0, 0]) || f["at_load"] == json!([ns, ns]),
                    "{r}"
                );
            }
        }
        s.end();
    }
}

/// A `chunk` whose moment is not a whole number of milliseconds a clock can read is refused with a
/// clear `error`, before any hook runs.
#[test]
fn a_chunk_with_a_malformed_moment_is_refused() {
    let mut s = Supervisor::start(256 << 20);
    for bad in [json!(-1), json!(1.5), json!("soon"), json!(u64::MAX)] {
        s.init("input", 2000, &[("a", "detect", CLOCK_READER)]);
        s.send(json!({"type": "chunk", "id": 1, "start": 0, "outgoing": "x", "state": [], "context": {}, "moment_ms": bad}));
        let refused = s.read();
        assert_eq!(refused["type"], "error", "{bad}: {refused}");
        assert!(
            refused["message"]
                .as_str()
                .is_some_and(|m| m.contains("moment_ms")),
            "{refused}"
        );
        s.end();
    }
}

/// From a gateway that sends no moment (an older one), hooks of one walk still cannot time each
/// other: every clock stands at the moment the cell's first walk began, in every hook and every
/// walk of the cell; the next cell reads its own first walk's moment.
#[test]
fn without_a_moment_the_clocks_of_a_cell_stand_at_its_first_walk() {
    let reader = CLOCK_READER;
    let mut s = Supervisor::start(256 << 20);
    let mut cells = Vec::new();
    for _ in 0..2 {
        s.init(
            "input",
            5000,
            &[("a", "detect", reader), ("b", "detect", reader)],
        );
        let mut readings = Vec::new();
        for _ in 0..2 {
            for r in s.chunk(json!("x"), no_host) {
                if r["type"] == "hook_result" {
                    let f = findings(&r);
                    let walk = json!([f["before"][0], f["before"][1]]);
                    assert!(f["at_load"] == json!([0, 0]) || f["at_load"] == walk, "{r}");
                    readings.push(f["before"].clone());
                    readings.push(f["after"].clone());
                }
            }
        }
        s.end();
        assert_eq!(readings.len(), 8, "{readings:?}");
        assert!(
            readings[0][0].as_u64().is_some_and(|ns| ns > 0),
            "{readings:?}"
        );
        assert!(readings.iter().all(|r| r == &readings[0]), "{readings:?}");
        cells.push(readings[0].clone());
    }
    assert_ne!(
        cells[0], cells[1],
        "each cell reads its own first walk's moment"
    );
}

/// Resident memory of a process, in bytes.
fn rss_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

#[test]
fn instances_that_hold_much_memory_are_not_kept_and_the_supervisor_stays_small() {
    // Module code that fills 64 MiB, and execute that fills 64 MiB more: such an instance is not
    // kept prepared, and what any instance grew beyond the snapshot is given back when it is reset.
    // (Measured: ~70 MiB; keeping such instances prepared and 96 MiB resident per slot, ~240 MiB.)
    let big = "BIG = b'x' * (64 << 20)\ndef execute(context, settings):\n    more = b'y' * (64 << 20)\n    return {'action': 'detect', 'findings': {'n': len(BIG) + len(more)}}\n";
    let mut s = Supervisor::start(256 << 20);
    for _ in 0..8 {
        s.init("input", 5000, &[("a", "detect", big), ("b", "detect", big)]);
        let r = s.chunk(json!("x"), no_host);
        assert_eq!(findings(&r[0])["n"], 128 << 20, "{r:?}");
        assert_eq!(findings(&r[1])["n"], 128 << 20, "{r:?}");
        s.end();
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let rss = rss_of(s.child.id());
    assert!(rss < 150 << 20, "the supervisor holds {} MiB", rss >> 20);
}

/// Peak resident memory of a process, in bytes.
fn peak_rss_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

#[test]
fn a_sleeping_hook_is_stopped_at_its_deadline_in_execute_and_in_module_code() {
    // Epoch interruption stops running code only; a hook waiting in the host (sleep, select, any
    // poll) runs none. Each wait must still end at the deadline, as the hook's own error.
    let sleeper = "import time\ndef execute(context, settings):\n    time.sleep(3600)\n";
    let napper =
        "import time\ndef execute(context, settings):\n    while True:\n        time.sleep(0.01)\n";
    let slow_module = "import time\ntime.sleep(3600)\ndef execute(context, settings):\n    return {'action': 'pass'}\n";
    let after = "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': context['outgoing'] + '!'}\n";
    let mut s = Supervisor::start(256 << 20);
    let ack = s.init(
        "input",
        300,
        &[
            ("sleeper", "detect", sleeper),
            ("napper", "detect", napper),
            ("slow-module", "detect", slow_module),
            ("after", "modify", after),
        ],
    );
    let error = ack["hooks"][2]["error"].as_str().unwrap_or_default();
    assert!(error.contains("did not finish"), "{ack}");
    let r = s.chunk(json!("x"), no_host);
    assert_eq!(r.len(), 4, "{r:?}");
    for hook in &r[..2] {
        let error = hook["error"].as_str().unwrap_or_default();
        assert!(error.contains("timed out after 300 ms"), "{hook}");
    }
    assert_eq!(r[3]["outgoing"], "x!", "{r:?}");
    s.end();
}

#[test]
fn relayed_text_is_bounded_so_no_line_outgrows_the_gateways_limit() {
    // A host_call name of 3 MiB; an error forged through the runner's own json.dumps (the hook
    // shares its instance), at load (3 MiB) and at call (2 MiB, within what an answer may be):
    // each is that hook's error, and every line the supervisor sends stays small.
    let long_name = r#"
def execute(context, settings):
    try:
        context.host_call('x' * (3 << 20), {})
        return {'action': 'pass'}
    except HostCallError as e:
        return {'action': 'detect', 'findings': {'code': e.code, 'message': str(e)[:200]}}
"#;
    let forged_call = r#"
import json
real = json.dumps
def execute(context, settings):
    json.dumps = lambda *a, **k: real({'error': 'E' * (2 << 20)})
    return {'action': 'pass'}
"#;
    let forged_load = r#"
import json
real = json.dumps
json.dumps = lambda *a, **k: real({'error': 'L' * (3 << 20), 'line': 1})
raise RuntimeError('at load')
"#;
    let mut s = Supervisor::start(256 << 20);
    let ack = s.init(
        "input",
        5000,
        &[
            ("long-name", "detect", long_name),
            ("forged-call", "detect", forged_call),
            ("forged-load", "detect", forged_load),
        ],
    );
    let load_error = ack["hooks"][2]["error"].as_str().unwrap_or_default();
    assert!(load_error.contains("more bytes cut"), "{load_error:.300}");
    let r = s.chunk(json!("x"), |call| {
        json!({"ok": false, "error": format!("the host_call reached the gateway ({} bytes of name)", call["name"].as_str().map_or(0, str::len))})
    });
    let seen = findings(&r[0]);
    assert_eq!(seen["code"], "invalid", "{seen}");
    assert!(
        seen["message"]
            .as_str()
            .unwrap()
            .contains("host_call name is 3145728 bytes"),
        "{seen}"
    );
    let call_error = r[1]["error"].as_str().unwrap_or_default();
    assert!(call_error.starts_with("EEEE"), "{call_error:.300}");
    assert!(call_error.contains("more bytes cut"), "{call_error:.300}");
    assert!(
        s.longest < 64 << 10,
        "the supervisor sent a line of {} bytes",
        s.longest
    );
    s.end();
}

#[test]
fn a_huge_return_is_refused_unread_as_that_hooks_error() {
    // 100 MiB returned: refused before it is copied out of the instance (copying, parsing and
    // re-serialising it first peaked near 750 MiB), and the walk goes on.
    let huge = "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': 'x' * (100 << 20)}\n";
    let after = "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': context['outgoing'] + '!'}\n";
    let mut s = Supervisor::start(512 << 20);
    s.init(
        "input",
        20000,
        &[("huge", "modify", huge), ("after", "modify", after)],
    );
    let r = s.chunk(json!("x"), no_host);
    let error = r[0]["error"].as_str().unwrap_or_default();
    assert!(error.contains("refused unread"), "{error:.300}");
    assert_eq!(r[1]["outgoing"], "x!", "{r:?}");
    // The instance's own memory holds the text and its JSON (~200 MiB, within its 512 MiB);
    // nothing of it is copied beside them.
    let peak = peak_rss_of(s.child.id());
    assert!(
        peak < 550 << 20,
        "the supervisor peaked at {} MiB",
        peak >> 20
    );
    s.end();
}

#[test]
fn a_walk_of_hooks_each_within_its_memory_limit_never_holds_them_all() {
    // Four hooks of 100 MiB each, within a 128 MiB limit: each instance is reset as soon as its
    // hook answered, so the walk needs one hook's memory, not four.
    let big = "def execute(context, settings):\n    blob = b'x' * (100 << 20)\n    return {'action': 'detect', 'findings': {'n': len(blob)}}\n";
    let mut s = Supervisor::start(128 << 20);
    s.init(
        "input",
        20000,
        &[
            ("a", "detect", big),
            ("b", "detect", big),
            ("c", "detect", big),
            ("d", "detect", big),
        ],
    );
    let r = s.chunk(json!("x"), no_host);
    for hook in &r {
        assert_eq!(findings(hook)["n"], 100 << 20, "{hook}");
    }
    let peak = peak_rss_of(s.child.id());
    assert!(
        peak < 320 << 20,
        "the supervisor peaked at {} MiB: more than one hook's memory at once",
        peak >> 20
    );
    s.end();
}

const BRANCHES: &str = "import re\nP = re.compile('x')\ndef execute(context, settings):\n    if context['outgoing'] == 'boom':\n        raise ValueError('boom')\n    if context['outgoing'] == 'long':\n        return {'action': 'block', 'message': 'long'}\n    return {'action': 'pass'}\n";

/// A hook that makes every answer of its instance claim lines it did not run.
const FORGER: &str = "import json\n_dumps = json.dumps\njson.dumps = lambda o, **k: _dumps(dict(o, lines={'run': [1, 2, 3], 'code': [1, 2, 3]}) if isinstance(o, dict) else o, **k)\ndef execute(context, settings):\n    return {'action': 'pass'}\n";

/// Under `--trace-lines` each hook_result says which lines of the hook ran (module code counted,
/// a failed call's lines too) and which could have; without it none does, whatever the hook makes
/// its instance answer.
#[test]
fn lines_run_are_reported_under_trace_lines_only() {
    let mut s = Supervisor::start_with(256 << 20, &["--trace-lines"]);
    s.init("input", 2000, &[("branches", "block", BRANCHES)]);
    let code: Vec<u64> = vec![1, 2, 3, 4, 5, 6, 7, 8];
    let passed = s.chunk(json!("hi"), no_host);
    assert_eq!(passed[0]["lines"]["code"], json!(code), "{}", passed[0]);
    assert_eq!(
        passed[0]["lines"]["run"],
        json!([1, 2, 3, 4, 6, 8]),
        "{}",
        passed[0]
    );
    let blocked = s.chunk(json!("long"), no_host);
    assert_eq!(
        blocked[0]["lines"]["run"],
        json!([1, 2, 3, 4, 6, 7]),
        "{}",
        blocked[0]
    );
    let failed = s.chunk(json!("boom"), no_host);
    assert!(
        failed[0]["error"].as_str().unwrap().contains("ValueError"),
        "{}",
        failed[0]
    );
    assert_eq!(
        failed[0]["lines"]["run"],
        json!([1, 2, 3, 4, 5]),
        "{}",
        failed[0]
    );
    s.end();
    drop(s);

    let mut s = Supervisor::start(256 << 20);
    s.init(
        "input",
        2000,
        &[
            ("branches", "block", BRANCHES),
            ("forger", "detect", FORGER),
        ],
    );
    let results = s.chunk(json!("hi"), no_host);
    for r in &results {
        assert!(r.get("lines").is_none(), "{r}");
    }
    s.end();
}
