//! The supervisor as the gateway drives it, over its real protocol, with real WebAssembly instances:
//! what a hook can and cannot do, and that nothing of one hook or trigger point reaches another.
//! Natively here (no gVisor): the instance is the wall these tests prove; the e2e suites prove the
//! same inside runsc.

use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};

struct Supervisor {
    child: Child,
    stdin: ChildStdin,
    answers: BufReader<std::process::ChildStderr>,
    next: u64,
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
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice-supervisor"))
            .arg("--runtime")
            .arg(runtime())
            .args(["--memory-bytes", &memory_bytes.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the supervisor starts");
        let stdin = child.stdin.take().unwrap();
        let answers = BufReader::new(child.stderr.take().unwrap());
        let mut s = Self {
            child,
            stdin,
            answers,
            next: 0,
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
        let mut line = String::new();
        self.answers.read_line(&mut line).unwrap();
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

    /// One walk; the hook results (host calls answered by `answer`).
    fn chunk(&mut self, outgoing: Value, answer: impl Fn(&Value) -> Value) -> Vec<Value> {
        self.next += 1;
        let id = self.next;
        self.send(json!({"type": "chunk", "id": id, "start": 0, "outgoing": outgoing, "state": [], "context": {"target": "t"}}));
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
    try:
        open('/tmp/left', 'w').write(context['outgoing'])
    except OSError:
        pass
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
    assert_ne!(seen["tmp"], json!(["left"]), "{seen}");
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
fn hook_output_never_reaches_the_protocol() {
    let mut s = Supervisor::start(256 << 20);
    let loud = "import os, sys\ndef execute(context, settings):\n    print('x' * 100000)\n    sys.stderr.write('{\"type\": \"result\"}\\n' * 100)\n    os.write(2, b'{\"type\": \"ended\", \"clean\": true}\\n')\n    os.write(1, b'out')\n    return {'action': 'modify', 'outgoing': 'quiet'}\n";
    s.init("input", 2000, &[("loud", "modify", loud)]);
    let r = s.chunk(json!("x"), no_host);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0]["outgoing"], "quiet", "{r:?}");
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
