//! The `sluice` CLI as a hook author uses it: `check` reports each class of error with the hook and
//! the line, `test` fails on a wrong expectation and passes on a right one, `run` prints what the
//! gateway would return.

use std::path::Path;
use std::process::Command;

fn sluice(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .expect("sluice runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().to_string()
}

const BROKEN: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: broken}
spec:
  target: bot
  triggerPoint: input
  hooks:
    - name: syntax
      action: modify
      code: |
        def execute(context, settings):
            return {"action": "modify", "outgoing": (}
    - name: no-execute
      action: modify
      code: |
        def run(context, settings):
            return {"action": "pass"}
    - name: wrong-action
      action: detect
      code: |
        def execute(context, settings):
            if "x" in context["outgoing"]:
                return {"action": "block"}
            return {"action": "pass"}
    - name: third-party
      action: modify
      capabilities: [llm.missing]
      code: |
        import requests
        def execute(context, settings):
            return {"action": "pass"}
    - name: networked
      action: detect
      code: |
        import json, os.path
        from xml.etree import ElementTree
        import socket, threading
        def execute(context, settings):
            return {"action": "pass"}
"#;

#[test]
fn check_reports_each_error_class_with_hook_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let broken = write(dir.path(), "broken.yaml", BROKEN);
    let bad_schema = write(
        dir.path(),
        "schema.yaml",
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: s}\nspec:\n  target: bot\n  triggerPoint: input\n  hooks:\n    - name: a\n      action: explode\n      code: x\n",
    );
    let gated = write(
        dir.path(),
        "gated.yaml",
        "apiVersion: sluice.dev/v1alpha1\nkind: Capability\nmetadata: {name: paid.run}\nspec: {gates: [credit.check], dispatch: [credit.consume], endpoint: {builtin: echo}}\n---\napiVersion: sluice.dev/v1alpha1\nkind: Capability\nmetadata: {name: credit.check}\nspec: {endpoint: {builtin: echo}}\n---\napiVersion: sluice.dev/v1alpha1\nkind: Capability\nmetadata: {name: credit.consume}\nspec: {endpoint: {builtin: echo}}\n---\napiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: g}\nspec:\n  target: g\n  triggerPoint: input\n  hooks:\n    - name: sneaky\n      action: detect\n      capabilities: [credit.check]\n      code: |\n        def execute(context, settings):\n            return {'action': 'pass'}\n",
    );
    let (code, out) = sluice(&["check", &broken, &bad_schema, &gated]);
    assert_eq!(code, 1, "{out}");
    let line = |needle: &str| {
        out.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?} in:\n{out}"))
            .to_string()
    };
    assert!(
        line("hook \"syntax\"").contains("broken.yaml:12:")
            && line("hook \"syntax\"").contains("SyntaxError"),
        "{out}"
    );
    assert!(
        line("hook \"no-execute\"").contains("does not define execute"),
        "{out}"
    );
    let wrong = line("hook \"wrong-action\"");
    assert!(
        wrong.contains("broken.yaml:23:")
            && wrong.contains("returns action 'block' but the hook declares 'detect'"),
        "{wrong}"
    );
    assert!(
        line("'requests'").contains("broken.yaml:29:")
            && line("'requests'").contains("standard library"),
        "{out}"
    );
    // Standard library, but not in a cell: said so, with the line; what is there passes.
    for (module, at) in [
        ("'socket'", "broken.yaml:37:"),
        ("'threading'", "broken.yaml:37:"),
    ] {
        let l = line(module);
        assert!(
            l.contains(at) && l.contains("not available in the sandbox"),
            "{l}"
        );
    }
    assert!(
        !out.contains("'json'") && !out.contains("'os.path'") && !out.contains("xml.etree"),
        "{out}"
    );
    let gate = line("hook \"sneaky\"");
    assert!(
        gate.contains("\"credit.check\" is a gate of \"paid.run\"")
            && gate.contains("list \"paid.run\" instead"),
        "{gate}"
    );
    assert!(
        line("llm.missing").contains("not defined in the files checked"),
        "{out}"
    );
    assert!(
        line("schema.yaml").contains("schema.yaml:9:") && line("schema.yaml").contains("explode"),
        "{out}"
    );

    let (code, out) = sluice(&[
        "check",
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples"),
    ]);
    assert_eq!(code, 0, "the examples check clean:\n{out}");
    assert!(out.contains("ok: "), "{out}");
}

const CHAIN: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: upper}
spec:
  target: bot
  triggerPoint: input
  pool: {warm: 1, max: 4}
  hooks:
    - name: upper
      action: modify
      code: |
        def execute(context, settings):
            return {"action": "modify", "outgoing": context["outgoing"].upper()}
"#;

#[test]
fn test_fails_on_a_wrong_expectation_and_passes_on_a_right_one() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "chain.yaml", CHAIN);
    let right = write(
        dir.path(),
        "right.test.yaml",
        "chains: [chain.yaml]\ncases:\n  - name: shouts\n    target: bot\n    text: hi\n    expect: {action: modify, text: HI, hooks: {upper: modify}}\n",
    );
    let wrong = write(
        dir.path(),
        "wrong.test.yaml",
        "chains: [chain.yaml]\ncases:\n  - name: whispers\n    target: bot\n    text: hi\n    expect: {action: pass, text: hi}\n",
    );
    let (code, out) = sluice(&["test", &right]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("PASS  shouts") && out.contains("1 passed, 0 failed"),
        "{out}"
    );
    let (code, out) = sluice(&["test", &wrong]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL  whispers"), "{out}");
    assert!(
        out.contains("expected: \"hi\"") && out.contains("got:      \"HI\""),
        "a readable diff:\n{out}"
    );
}

#[test]
fn run_prints_what_the_gateway_would_return() {
    let dir = tempfile::tempdir().unwrap();
    let chain = write(dir.path(), "chain.yaml", CHAIN);
    let (code, out) = sluice(&["run", &chain, "--text", "hello"]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value =
        serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["action"], "modify");
    assert_eq!(v["payload"]["text"], "HELLO");
    assert_eq!(v["hooks"][0]["name"], "upper");
    let (code, out) = sluice(&["run", &chain, "--text", "hello world", "--stream", "3"]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["final"]["payload"]["text"], "HELLO WORLD");
}

/// Every example's test cases pass; two files at a time (`--jobs 2`), reported in file order.
#[test]
fn every_example_chain_passes_its_test_cases() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/tests");
    let (code, out) = sluice(&["test", "--jobs", "2", dir]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(" passed, 0 failed"), "{out}");
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".test.yaml"))
        .collect();
    files.sort();
    let reported: Vec<&str> = out
        .lines()
        .filter(|l| l.ends_with(".test.yaml"))
        .map(|l| l.rsplit('/').next().unwrap())
        .collect();
    assert_eq!(reported, files, "{out}");
}

/// Every mistake here is one `check` must name, with its line, in one pass over the file.
const MISTAKES: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: typo}
spec:
  target: bot
  triggerPoint: input
  failurepolicy: Closed
  hooks:
    - name: mask
      action: modify
      setting: {mask: "[id]"}
      code: |
        def execute(context, settings):
            return {"action": "modify", "outgoing": settings["mask_text"]}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: reads}
spec:
  target: bot
  triggerPoint: output
  hooks:
    - name: detect
      action: detect
      settings: {mask: x, limit: 3}
      code: |
        def execute(context, settings):
            n = settings.get("limt", 3)
            context["state"] = settings["mask"]
"#;

#[test]
fn check_names_unknown_fields_undeclared_settings_and_a_missing_return_in_one_pass() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "mistakes.yaml", MISTAKES);
    let (code, out) = sluice(&["check", &file]);
    assert_eq!(code, 1, "{out}");
    let line = |needle: &str| {
        out.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?} in:\n{out}"))
            .to_string()
    };
    let l = line("failurepolicy");
    assert!(
        l.contains("mistakes.yaml:7:") && l.contains("did you mean \"failurePolicy\""),
        "{l}"
    );
    let l = line("\"setting\"");
    assert!(
        l.contains("mistakes.yaml:11:") && l.contains("did you mean \"settings\""),
        "{l}"
    );
    // The schema errors do not hide the code's problems.
    let l = line("mask_text");
    assert!(
        l.contains("mistakes.yaml:14:") && l.contains("KeyError"),
        "{l}"
    );
    let l = line("limt");
    assert!(
        l.contains("mistakes.yaml:28:")
            && l.contains("always gets its default")
            && l.contains("did you mean \"limit\""),
        "{l}"
    );
    assert!(
        !out.contains("settings[\"mask\"]"),
        "a declared key is fine:\n{out}"
    );
    let l = line("never returns");
    assert!(l.contains("mistakes.yaml:27:"), "{l}");
    assert!(out.contains("5 problem(s) found"), "{out}");
}

#[test]
fn check_reports_chain_conflicts_as_the_gateway_does() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a.yaml", CHAIN);
    write(
        dir.path(),
        "b.yaml",
        &CHAIN.replace("name: upper}", "name: shout}"),
    );
    let (code, out) = sluice(&["check", &dir.path().to_string_lossy()]);
    assert_eq!(code, 1, "{out}");
    let l = out
        .lines()
        .find(|l| l.contains("only the first is served"))
        .unwrap_or_else(|| panic!("no conflict in:\n{out}"));
    assert!(
        l.contains("b.yaml:1:") && l.contains("\"shout\"") && l.contains("\"upper\""),
        "{l}"
    );
}

#[test]
fn check_parses_with_the_sandboxes_python_not_the_first_on_path() {
    let dir = tempfile::tempdir().unwrap();
    let chain = write(dir.path(), "chain.yaml", CHAIN);
    // A python3 first on PATH that refuses everything: check must not use it.
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let script = |path: &Path, body: &str| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(path, body).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    script(
        &bin.join("python3"),
        "#!/bin/sh\necho 'not this python' >&2\nexit 3\n",
    );
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check", &chain])
        .env("PATH", &path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    // --python picks the interpreter.
    let marker = dir.path().join("used");
    let chosen = dir.path().join("chosen-python");
    script(
        &chosen,
        &format!(
            "#!/bin/sh\ntouch {}\nexec /usr/bin/python3 \"$@\"\n",
            marker.display()
        ),
    );
    let (code, out) = sluice(&["check", "--python", &chosen.to_string_lossy(), &chain]);
    assert_eq!(code, 0, "{out}");
    assert!(marker.exists(), "--python was not used");
}

#[test]
fn check_says_yaml_mistakes_in_plain_words() {
    let dir = tempfile::tempdir().unwrap();
    let tab = write(dir.path(), "tab.yaml", &CHAIN.replace("  pool:", "\tpool:"));
    let colon = write(
        dir.path(),
        "colon.yaml",
        &CHAIN.replace("  pool:", "  description: Sorry: we cannot\n  pool:"),
    );
    let dedent = write(
        dir.path(),
        "dedent.yaml",
        &CHAIN.replace("            return", "    x = 1\n            return"),
    );
    // The hook's last line falls out of its block: nothing follows it to show it was code.
    let last = write(
        dir.path(),
        "last.yaml",
        &CHAIN.replace(
            "            return {\"action\": \"modify\", \"outgoing\": context[\"outgoing\"].upper()}",
            "            return {\"action\": \"modify\",\n      \"outgoing\": \"X\"}",
        ),
    );
    let (code, out) = sluice(&["check", &tab, &colon, &dedent, &last]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("last.yaml:14: line 14 is indented less than the code above it")
            && out.contains("indent every line of the hook's code"),
        "{out}"
    );
    assert!(
        out.contains("tab.yaml:7: line 7 is indented with a tab"),
        "{out}"
    );
    assert!(
        out.contains("colon.yaml:7: the value on line 7 contains \": \""),
        "{out}"
    );
    assert!(
        out.contains("dedent.yaml:13: line 13 is indented less than the code above it"),
        "{out}"
    );
}

const FAILING: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: failing}
spec:
  target: bot
  triggerPoint: input
  failurePolicy: Closed
  timeoutMs: 500
  pool: {warm: 1, max: 4}
  hooks:
    - name: mask
      action: modify
      settings: {mask: "[id]"}
      code: |
        def execute(context, settings):
            print("looking at", context["outgoing"])
            if context["outgoing"] == "slow":
                while True:
                    pass
            text = settings["mask_text"]
            return {"action": "modify", "outgoing": text}
"#;

#[test]
fn a_failed_hook_reads_as_an_error_with_its_line_its_settings_and_its_budget() {
    let dir = tempfile::tempdir().unwrap();
    let chain = write(dir.path(), "chain.yaml", FAILING);
    let (code, out) = sluice(&["run", &chain, "--text", "CUST-123"]);
    assert_eq!(code, 1, "a run where a hook failed is not a success: {out}");
    let v: serde_json::Value =
        serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["action"], "block");
    assert_eq!(v["hooks"][0]["action"], "error", "never pass: {v:#}");
    let error = v["errors"][0]["error"].as_str().unwrap_or_default();
    assert!(error.starts_with("KeyError: 'mask_text'"), "{error}");
    assert!(
        error.contains("chain.yaml:20), in execute: text = settings[\"mask_text\"]"),
        "the source line and its file line: {error}"
    );
    assert!(error.contains("settings have mask"), "{error}");
    // What the hook printed comes back to its author, with the hook.
    assert_eq!(v["hooks"][0]["output"], "looking at CUST-123\n", "{v:#}");

    // An endless loop is stopped where it loops, and the error names that line in the file.
    let (_, out) = sluice(&["run", &chain, "--text", "slow"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let error = v["hooks"][0]["error"].as_str().unwrap_or_default();
    // The loop is caught on either of its two lines.
    let at = |line: usize, file_line: usize, source: &str| {
        error.starts_with(&format!(
            "TimeoutError: ran out of time at line {line}: an endless loop or slow code"
        )) && error.contains(&format!(
            "line {line} ({}:{file_line}), in execute: {source}",
            chain
        ))
    };
    assert!(
        (at(4, 18, "while True:") || at(5, 19, "pass")) && error.contains("spec.timeoutMs"),
        "{error}"
    );
    // It ran for most of its budget.
    let latency = v["hooks"][0]["latency_us"].as_u64().unwrap_or_default();
    assert!(latency >= 400_000, "{v:#}");

    // `sluice test` shows why a case failed: the hook's exception and the message.
    write(
        dir.path(),
        "mask.test.yaml",
        "chains: [chain.yaml]\ncases:\n  - name: masks\n    target: bot\n    text: CUST-123\n    expect: {action: modify, text: \"[id]\"}\n",
    );
    let (code, out) = sluice(&["test", &dir.path().join("mask.test.yaml").to_string_lossy()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL  masks"), "{out}");
    assert!(
        out.contains("hook \"mask\" failed:") && out.contains("KeyError: 'mask_text'"),
        "{out}"
    );
    assert!(out.contains("message: \"hook \\\"mask\\\" failed"), "{out}");
    // ... and what it printed, under the case.
    let printed = out
        .split_once("hook \"mask\" printed:\n")
        .and_then(|(_, rest)| rest.lines().next())
        .map(str::trim);
    assert_eq!(printed, Some("looking at CUST-123"), "{out}");
}

#[test]
fn init_writes_a_starter_that_checks_and_tests_clean() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("starter");
    let target = target.to_string_lossy();
    let (code, out) = sluice(&["init", &target]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = sluice(&["check", &target]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = sluice(&["test", &target]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("3 passed, 0 failed"), "{out}");
    let (code, out) = sluice(&["init", &target]);
    assert_eq!(code, 1, "never overwrites: {out}");
}

#[test]
fn test_runs_one_case_verbosely_writes_junit_and_a_misspelt_case_fails_alone() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "chain.yaml", CHAIN);
    let file = write(
        dir.path(),
        "cases.test.yaml",
        "chains: [chain.yaml]\ncases:\n  - name: shouts\n    target: bot\n    text: hi\n    expect: {action: modify, text: HI}\n  - name: misspelt\n    target: bot\n    text: hi\n    expct: {action: modify}\n  - name: wrong\n    target: bot\n    text: hi\n    expect: {text: hi}\n",
    );
    let junit = dir.path().join("junit.xml");
    let (code, out) = sluice(&["test", &file, "--junit", &junit.to_string_lossy()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("PASS  shouts"),
        "the other cases still run:\n{out}"
    );
    assert!(
        out.contains("FAIL  misspelt")
            && out.contains("unknown key \"expct\" in this case; did you mean \"expect\"?"),
        "{out}"
    );
    assert!(out.contains("1 passed, 2 failed"), "{out}");
    let xml = std::fs::read_to_string(&junit).unwrap();
    assert!(
        xml.contains("<testsuite name=") && xml.contains("tests=\"3\" failures=\"2\""),
        "{xml}"
    );
    assert!(xml.contains("<testcase name=\"shouts\"/>"), "{xml}");
    assert!(
        xml.contains("<testcase name=\"wrong\">\n      <failure"),
        "{xml}"
    );

    let (code, out) = sluice(&["test", &file, "--run", "shou", "-v"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("PASS  shouts") && !out.contains("misspelt") && !out.contains("wrong"),
        "{out}"
    );
    assert!(
        out.contains("\"action\": \"modify\""),
        "-v prints the answer:\n{out}"
    );
    assert!(out.contains("1 passed, 0 failed"), "{out}");
}

#[test]
fn without_runsc_test_runs_hooks_in_webassembly_only_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "chain.yaml", CHAIN);
    let file = write(
        dir.path(),
        "c.test.yaml",
        "chains: [chain.yaml]\ncases:\n  - name: shouts\n    target: bot\n    text: hi\n    expect: {action: modify, text: HI}\n",
    );
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["test", &file])
        .env("PATH", dir.path())
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stderr.contains("runsc (gVisor) is not on PATH"), "{stderr}");
    assert!(stderr.contains("WebAssembly cells only"), "{stderr}");
    assert!(stdout.contains("1 passed"), "{stdout}");
}

#[test]
fn test_watch_runs_again_when_a_chain_changes() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "chain.yaml", CHAIN);
    let file = write(
        dir.path(),
        "c.test.yaml",
        "chains: [chain.yaml]\ncases:\n  - name: shouts\n    target: bot\n    text: hi\n    expect: {text: HI}\n",
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["test", "--watch", &file])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A guard, not an assertion: should the change never be picked up, the run is ended so that
    // the reads below see the end of its output instead of waiting forever.
    let pid = child.id();
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(180));
        let _ = Command::new("kill").arg(pid.to_string()).status();
    });
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next_summary = || {
        lines
            .by_ref()
            .map_while(Result::ok)
            .find(|l| l.contains(" passed, "))
            .unwrap_or_default()
    };
    assert_eq!(next_summary(), "1 passed, 0 failed");
    write(
        dir.path(),
        "chain.yaml",
        &CHAIN.replace(".upper()", ".lower()"),
    );
    assert_eq!(
        next_summary(),
        "0 passed, 1 failed",
        "the change was picked up"
    );
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A chain under test (from a pull request, say) names its own Capabilities, with any endpoint.
/// `sluice test` and `sluice run` never call them: a Capability without a stub answers an error that
/// says how to stub it, and nothing leaves the machine.
#[test]
fn unstubbed_capabilities_are_never_called() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let endpoint = format!("http://{}/steal", listener.local_addr().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let chain = format!(
        r#"apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata:
  name: "exfil.send"
spec: {{endpoint: {{http: "{endpoint}"}}}}
---
apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {{name: llm.run}}
spec: {{endpoint: {{grpc: "{endpoint}"}}}}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {{name: caller}}
spec:
  target: bot
  triggerPoint: input
  pool: {{warm: 1, max: 2}}
  hooks:
    - name: caller
      action: modify
      capabilities: [exfil.send, llm.run]
      code: |
        def execute(context, settings):
            seen = []
            for name in ("exfil.send", "llm.run"):
                try:
                    seen.append(name + " answered " + repr(context.host_call(name, {{"x": 1}})))
                except HostCallError as e:
                    seen.append(name + " failed: " + str(e))
            return {{"action": "modify", "outgoing": " | ".join(seen)}}
"#
    );
    let chain = write(dir.path(), "chain.yaml", &chain);
    let (code, out) = sluice(&["run", &chain, "--text", "hi"]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value =
        serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    let text = v["payload"]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    for name in ["exfil.send", "llm.run"] {
        assert!(
            text.contains(&format!("{name} failed"))
                && text.contains(&format!("{name:?} has no stub")),
            "{text}"
        );
    }
    // `sluice test` says the same, and how to stub it.
    let tests = write(
        dir.path(),
        "chain.test.yaml",
        "chains: [chain.yaml]\ncases:\n  - name: calls\n    target: bot\n    text: hi\n    expect: {contains: [\"add it under `capabilities:`\"]}\n",
    );
    let (code, out) = sluice(&["test", &tests]);
    assert_eq!(code, 0, "{out}");
    match listener.accept() {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        other => panic!("the chain's own endpoint was called: {other:?}"),
    }
}

/// What a support-operations author writes on a bad day: each hook here passed `sluice check` before
/// and then failed at run time (or, the last one, was refused though right).
const AUTHORING: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: authoring}
spec:
  target: bot
  triggerPoint: input
  hooks:
    - name: dedented-return
      action: block
      code: |
        def execute(context, settings):
            found = "rival" in context["outgoing"]
        return {"action": "pass"}  # dedented
    - name: some-path-returns-nothing
      action: block
      code: |
        def execute(context, settings):
            if "rival" in context["outgoing"]:
                return {"action": "block", "message": "We cannot discuss that."}
    - name: returns-a-word
      action: block
      code: |
        def execute(context, settings):
            return "block"
    - name: misspelt-key
      action: block
      code: |
        def execute(context, settings):
            result = {"action": "block", "msg": "We cannot discuss that."}
            return result
    - name: undeclared-call
      action: block
      capabilities: [credit.charge]
      code: |
        def execute(context, settings):
            context.host_call("credit.chrage", {"credits": 1})
            return {"action": "pass"}
    - name: nested-action-is-fine
      action: detect
      code: |
        def execute(context, settings):
            if context["outgoing"]:
                return {"action": "detect", "findings": {"action": "block", "rule": "rival"}}
            while True:
                return {"action": "pass"}
    - name: a-helpers-return-is-not-executes
      action: detect
      code: |
        def execute(context, settings):
            def helper():
                return "block"
            helper()
---
apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {name: credit.charge}
spec: {endpoint: {builtin: charge}}
"#;

/// `check` refuses what Python's compiler refuses and what the gateway would fail on, each at its
/// YAML line, and no longer refuses a nested `"action"` key. The gateway uses the same analyser:
/// `sluice run` refuses the chain.
#[test]
fn check_catches_what_the_compiler_and_the_gateway_would_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "authoring.yaml", AUTHORING);
    let (code, out) = sluice(&["check", &file]);
    assert_eq!(code, 1, "{out}");
    let at = |needle: &str| {
        let n = AUTHORING
            .lines()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("{needle:?} not in the fixture"));
        format!("authoring.yaml:{}:", n + 1)
    };
    let line = |hook: &str| {
        out.lines()
            .find(|l| l.contains(&format!("hook \"{hook}\"")))
            .unwrap_or_else(|| panic!("nothing about {hook:?} in:\n{out}"))
            .to_string()
    };
    let l = line("dedented-return");
    assert!(
        l.contains(&at("# dedented")) && l.contains("'return' outside function"),
        "{l}"
    );
    let l = line("some-path-returns-nothing");
    assert!(
        l.contains(&at("\"message\": \"We cannot discuss that.\"}"))
            && l.contains("can end here without returning"),
        "{l}"
    );
    let l = line("returns-a-word");
    assert!(
        l.contains(&at("return \"block\"")) && l.contains("return {\"action\": 'block'}"),
        "{l}"
    );
    let l = line("misspelt-key");
    assert!(
        l.contains(&at("\"msg\"")) && l.contains("'msg'") && l.contains("did you mean 'message'"),
        "{l}"
    );
    let l = line("undeclared-call");
    assert!(
        l.contains(&at("credit.chrage"))
            && l.contains("forbidden")
            && l.contains("did you mean 'credit.charge'"),
        "{l}"
    );
    assert!(!out.contains("nested-action-is-fine"), "{out}");
    // Only a hint: an `execute` that never returns may mean to always raise.
    assert!(
        line("a-helpers-return-is-not-executes").contains("never returns a value"),
        "{out}"
    );
    assert!(out.contains("6 problem(s) found"), "{out}");

    let (code, out) = sluice(&["run", &file, "--text", "hello"]);
    assert_ne!(code, 0, "the gateway serves nothing check refuses:\n{out}");
    assert!(out.contains("can end here without returning"), "{out}");
}

/// Valid since Python 3.12 (quotes of the f-string reused inside it): the cells run CPython 3.14.
const PY312_CHAIN: &str = include_str!("../py312.yaml");

/// Hook code is judged by the interpreter that runs it, the cell's CPython, not the host's Python:
/// code valid only since 3.12 checks clean and runs; the host's python3 (3.11 on Debian 12), named
/// with --python, refuses it.
#[test]
fn check_judges_code_with_the_cells_python_not_the_hosts() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "py312.yaml", PY312_CHAIN);
    let (code, out) = sluice(&["check", &file]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = sluice(&["run", &file, "--text", "hi"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("\"HI!\""), "{out}");
    let host = Command::new("/usr/bin/python3")
        .args(["-c", "import sys; print(sys.version_info >= (3, 12))"])
        .output()
        .expect("python3");
    if String::from_utf8_lossy(&host.stdout).trim() == "False" {
        let (code, out) = sluice(&["check", &file, "--python", "/usr/bin/python3"]);
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("SyntaxError: f-string"), "{out}");
    }
}

/// A hook that uses a ready hook is checked against it: the name (with the library's names), the
/// declared action, the settings it reads, each at its line.
#[test]
fn check_names_what_is_wrong_with_a_ready_hook_at_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "ready.yaml",
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: ready}\nspec:\n  target: bot\n  triggerPoint: input\n  hooks:\n    - {name: a, action: modify, uses: pii/ibna}\n    - {name: b, action: skip, uses: pii/card, settings: {maks: x}}\n    - {name: c, action: block, uses: text/length}\n",
    );
    let (code, out) = sluice(&["check", &file]);
    assert_eq!(code, 1, "{out}");
    for expected in [
        "ready.yaml:8: HookChain \"ready\": spec.hooks[0].uses: \"pii/ibna\" is no ready hook: did you mean pii/iban? the library has pii/email,",
        "ready.yaml:9: HookChain \"ready\": spec.hooks[1].action: pii/card can modify, block, detect, not skip",
        "ready.yaml:9: HookChain \"ready\": spec.hooks[1].settings.maks: pii/card has no setting \"maks\": did you mean mask?",
        "ready.yaml:10: HookChain \"ready\": spec.hooks[2].settings.max_chars: text/length needs this setting",
    ] {
        assert!(out.contains(expected), "{expected:?} not in:\n{out}");
    }
}

/// Each recipe `sluice init --example` writes checks clean and passes its own tests, and its tests
/// can fail: broken on purpose (the card recipe's lookback cut to 4, the competitor list emptied,
/// the charge hook no longer blocking on `denied`), each fails.
#[test]
fn every_recipe_checks_and_tests_clean_and_its_tests_catch_a_broken_recipe() {
    let dir = tempfile::tempdir().unwrap();
    let breakages = [
        ("card-numbers", "lookbackChars: 24", "lookbackChars: 4", 3),
        ("competitors", "[Acme Corp, Globex, Initech]", "[]", 3),
        ("ready-hooks", "uses: pii/card}", "uses: pii/email}", 3),
        (
            "charge-per-message",
            "e.code == \"denied\"",
            "e.code == \"never\"",
            2,
        ),
    ];
    let targets: Vec<String> = breakages
        .iter()
        .map(|(name, ..)| dir.path().join(name).to_string_lossy().into_owned())
        .collect();
    for ((name, ..), target) in breakages.iter().zip(&targets) {
        let (code, out) = sluice(&["init", target, "--example", name]);
        assert_eq!(code, 0, "{out}");
        let (code, out) = sluice(&["check", target]);
        assert_eq!(code, 0, "{name}: {out}");
    }
    // Every recipe's tests in one run (its files side by side), then again with each recipe broken.
    let every = |out: &str| -> Vec<(String, String)> {
        let mut files: Vec<(String, String)> = Vec::new();
        for line in out.lines() {
            if line.ends_with(".test.yaml") {
                files.push((line.to_string(), String::new()));
            } else if let Some((_, cases)) = files.last_mut() {
                cases.push_str(line);
                cases.push('\n');
            }
        }
        files
    };
    let mut args = vec!["test"];
    args.extend(targets.iter().map(String::as_str));
    let (code, out) = sluice(&args);
    assert_eq!(code, 0, "{out}");
    for (name, _, _, cases) in breakages {
        let passed: usize = every(&out)
            .iter()
            .filter(|(file, _)| file.contains(&format!("/{name}/")))
            .map(|(_, c)| c.matches("  PASS  ").count())
            .sum();
        assert_eq!(passed, cases, "{name}: {out}");
    }
    for (name, good, bad, _) in breakages {
        let chain = dir.path().join(name).join(format!("{name}.yaml"));
        let text = std::fs::read_to_string(&chain).unwrap();
        assert!(text.contains(good), "{name}");
        std::fs::write(&chain, text.replace(good, bad)).unwrap();
    }
    let (code, out) = sluice(&args);
    assert_eq!(code, 1, "{out}");
    for (name, ..) in breakages {
        let failed = every(&out)
            .iter()
            .any(|(file, c)| file.contains(&format!("/{name}/")) && c.contains("  FAIL  "));
        assert!(failed, "{name} broken still passes: {out}");
    }
    let (code, out) = sluice(&["init", "x", "--example", "no-such-recipe"]);
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("card-numbers"), "lists the recipes: {out}");
}

/// A failing case says why without `-v`: the hook that ended the walk and its message, or the hook
/// that failed and its error. Nothing in the output names a temporary file, and no colour codes
/// reach a pipe.
#[test]
fn a_failing_case_says_why_without_verbose_and_names_only_the_authors_files() {
    // The author's files live outside /tmp, so any /tmp path in the output is one of sluice's own.
    let dir = tempfile::Builder::new()
        .prefix("author")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap();
    write(
        dir.path(),
        "chain.yaml",
        r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: rivals}
spec:
  target: bot
  triggerPoint: input
  hooks:
    - name: block-rivals
      action: block
      code: |
        def execute(context, settings):
            if "boom" in context["outgoing"]:
                raise ValueError("cannot read " + context["outgoing"])
            if "rival" in context["outgoing"]:
                return {"action": "block", "message": "We cannot discuss rivals."}
            return {"action": "pass"}
"#,
    );
    let tests = write(
        dir.path(),
        "chain.test.yaml",
        "chains: [chain.yaml]\ncases:\n  - name: rival\n    target: bot\n    text: tell me about rival\n    expect: {action: pass}\n  - name: boom\n    target: bot\n    text: boom\n    expect: {action: pass}\n",
    );
    let (code, out) = sluice(&["test", &tests]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(
            "hook \"block-rivals\" returned block with message \"We cannot discuss rivals.\""
        ),
        "{out}"
    );
    assert!(
        out.contains("ValueError: cannot read boom") && out.contains("chain.yaml:13"),
        "{out}"
    );
    assert!(
        !out.contains("/tmp/.tmp") && !out.contains("/tmp/sluice-cli"),
        "{out}"
    );
    assert!(!out.contains('\u{1b}'), "colour codes in a pipe: {out:?}");
}

const BROKEN_BLOCKER: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: guard}
spec:
  target: bot
  triggerPoint: input
  failurePolicy: Closed
  pool: {warm: 1, max: 4}
  hooks:
    - name: competitors
      action: block
      code: |
        def execute(context, settings):
            for name in settings["competitors"]:
                if name in context["outgoing"]:
                    return {"action": "block", "message": "no"}
            return {"action": "pass"}
"#;

/// Under `failurePolicy: Closed` a blocking hook that raises on every call still "blocks": a case
/// expecting the block must fail all the same, and pass only when it says it expects the failure.
#[test]
fn a_hook_that_fails_fails_its_case_even_when_the_policy_gives_the_expected_action() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "chain.yaml", BROKEN_BLOCKER);
    let blocks = write(
        dir.path(),
        "blocks.test.yaml",
        "chains: [chain.yaml]\ncases:\n  - name: blocks a competitor\n    target: bot\n    text: Acme is cheaper\n    expect: {action: block}\n",
    );
    let (code, out) = sluice(&["test", &blocks]);
    assert_eq!(code, 1, "a broken hook passed its test: {out}");
    assert!(out.contains("FAIL  blocks a competitor"), "{out}");
    assert!(
        out.contains("hook \"competitors\" failed, and the case does not expect a failure")
            && out.contains("came from its failurePolicy"),
        "says the block was the policy's: {out}"
    );
    assert!(
        out.contains("KeyError: 'competitors'"),
        "and why the hook failed: {out}"
    );

    let expected = write(
        dir.path(),
        "expected.test.yaml",
        "chains: [chain.yaml]\ncases:\n  - name: fails closed\n    target: bot\n    text: Acme is cheaper\n    expect: {action: block, errors: {competitors: \"KeyError\"}}\n  - name: fails closed, said as an action\n    target: bot\n    text: Acme is cheaper\n    expect: {action: block, hooks: {competitors: error}}\n",
    );
    let (code, out) = sluice(&["test", &expected]);
    assert_eq!(code, 0, "a failure the case expects: {out}");
    assert!(out.contains("2 passed, 0 failed"), "{out}");
}

/// `sluice ... | head -1`: a reader that goes away ends the program quietly, as it does any Unix
/// tool that writes to a pipe, never with a panic and its backtrace.
#[test]
fn output_to_a_reader_that_went_away_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let chain = write(dir.path(), "chain.yaml", CHAIN);
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check", &chain])
        .stdout(writer)
        .output()
        .expect("sluice runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(141), "{stderr}");
}

/// A chain path that is not there says paths are relative to the test file; a target no chain
/// serves lists the ones the chains serve.
#[test]
fn a_wrong_chain_path_or_target_says_what_is_there() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "chain.yaml", CHAIN);
    std::fs::create_dir(dir.path().join("tests")).unwrap();
    let wrong_path = write(
        &dir.path().join("tests"),
        "path.test.yaml",
        "chains: [chain.yaml]\ncases:\n  - name: shouts\n    target: bot\n    text: hi\n    expect: {action: modify}\n",
    );
    let (code, out) = sluice(&["test", &wrong_path]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("path.test.yaml:1: chains: chain.yaml: there is no")
            && out.contains("relative to the test file's directory"),
        "{out}"
    );
    let wrong_target = write(
        dir.path(),
        "target.test.yaml",
        "chains: [chain.yaml]\ncases:\n  - name: shouts\n    target: bto\n    text: hi\n    expect: {action: modify}\n",
    );
    let (code, out) = sluice(&["test", &wrong_target]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("no chain serves target \"bto\" at \"input\"")
            && out.contains("the chains here serve: bot (input)"),
        "{out}"
    );
}

/// `Block` for `block`, in the YAML and in what the code returns: each place names every action
/// there is and the one meant.
#[test]
fn check_names_the_action_meant() {
    let dir = tempfile::tempdir().unwrap();
    let chain = write(
        dir.path(),
        "block.yaml",
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: b}\nspec:\n  target: bot\n  triggerPoint: input\n  hooks:\n    - name: guard\n      action: Block\n      code: |\n        def execute(context, settings):\n            if 'x' in context['outgoing']:\n                return {'action': 'Block', 'message': 'no'}\n            return {'action': 'modfy'}\n",
    );
    let (code, out) = sluice(&["check", &chain]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("block.yaml:9:")
            && out.contains(
                "spec.hooks[0].action: \"Block\" is not one of \"pass\", \"modify\", \"block\", \"skip\", \"detect\"; did you mean \"block\"?"
            ),
        "{out}"
    );
    assert!(
        out.contains("block.yaml:13:")
            && out.contains("returns action 'Block', which is not one of pass, modify, block, skip, detect; did you mean 'block'? (actions are lower case)"),
        "{out}"
    );
    assert!(
        out.contains("block.yaml:14:")
            && out.contains("returns action 'modfy'")
            && out.contains("did you mean 'modify'?"),
        "{out}"
    );
}

/// A chain that does not compile is said once by `sluice run`, with the author's file and line: not
/// again by the local gateway's log, naming the temporary copy it loaded.
#[test]
fn a_chain_that_does_not_compile_is_said_once_with_the_authors_path() {
    let dir = tempfile::tempdir().unwrap();
    let chain = write(
        dir.path(),
        "broken.yaml",
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: broken}\nspec:\n  target: bot\n  triggerPoint: input\n  hooks:\n    - name: h\n      action: modify\n      code: |\n        def execute(context, settings)\n            return {\"action\": \"pass\"}\n",
    );
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["run", &chain, "--text", "hi"])
        .env_remove("RUST_LOG")
        .output()
        .expect("sluice runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert_eq!(err.matches("SyntaxError").count(), 1, "{err}");
    assert!(err.contains(&format!("{chain}:11:")), "{err}");
    assert!(!err.contains("ERROR"), "{err}");
}

const COVERED: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: support-input}
spec:
  target: support-bot
  triggerPoint: input
  hooks:
    - name: limit
      action: block
      code: |
        def execute(context, settings):
            text = context["outgoing"]
            if len(text) > 20:
                return {"action": "block", "message": "too long"}
            return {"action": "pass"}
    - name: shout
      action: modify
      code: |
        def execute(context, settings):
            return {"action": "modify", "outgoing": context["outgoing"].upper()}
    - {name: cards, action: modify, uses: pii/card}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: other-input}
spec:
  target: other-bot
  triggerPoint: input
  hooks:
    - name: untested
      action: modify
      code: |
        def execute(context, settings):
            return {"action": "modify", "outgoing": "x"}
"#;

/// `sluice test --coverage` names, at the chain file's lines, what no case ran: the branch a case
/// never took, a hook behind a block, a chain no case calls; ready hooks are the library's and not
/// listed. Another case that takes the branch covers it.
#[test]
fn test_coverage_names_the_lines_no_case_ran() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "chain.yaml", COVERED);
    let line_of = |needle: &str| COVERED.lines().position(|l| l.contains(needle)).unwrap() + 1;
    let long = "chains: [chain.yaml]\ncases:\n  - name: too long\n    target: support-bot\n    text: this text is far longer than twenty characters\n    expect: {action: block}\n";
    let tests = write(dir.path(), "chain.test.yaml", long);
    let (code, out) = sluice(&["test", "--coverage", &tests]);
    assert_eq!(code, 0, "{out}");
    let chain = dir.path().join("chain.yaml").display().to_string();
    assert!(out.contains(&format!("\n  {chain}\n")), "{out}");
    // `limit` has 5 lines that can run (the def line among them); the pass line never ran.
    let pass = line_of(r#"return {"action": "pass"}"#);
    assert!(
        out.contains(&format!(
            "default/support-input/limit   4/5 lines (80%)  not run: line {pass}\n"
        )),
        "{out}"
    );
    assert!(
        out.contains("default/support-input/shout   never run: no case reached it"),
        "{out}"
    );
    assert!(
        out.contains("default/other-input/untested  never run: no case reached it"),
        "{out}"
    );
    assert!(!out.contains("cards"), "ready hooks are not listed: {out}");
    assert!(
        out.contains("total: 4/5 lines (80%), 2 hook(s) never run"),
        "{out}"
    );
    // Without --coverage, none of it.
    let (code, out) = sluice(&["test", &tests]);
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("coverage"), "{out}");

    let both = format!(
        "{long}  - name: short\n    target: support-bot\n    text: hi\n    expect: {{action: modify, text: HI}}\n"
    );
    let tests = write(dir.path(), "chain.test.yaml", &both);
    let (code, out) = sluice(&["test", "--coverage", &tests]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("default/support-input/limit   5/5 lines (100%)\n"),
        "{out}"
    );
    assert!(
        out.contains("default/support-input/shout   2/2 lines (100%)\n"),
        "{out}"
    );
    assert!(
        out.contains("total: 7/7 lines (100%), 1 hook(s) never run"),
        "{out}"
    );
}
