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
    let (code, out) = sluice(&["check", &broken, &bad_schema]);
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

#[test]
fn every_example_chain_passes_its_test_cases() {
    let (code, out) = sluice(&[
        "test",
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/tests"),
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(" passed, 0 failed"), "{out}");
}
