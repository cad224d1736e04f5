//! `sluice-operator render` through the real binary, on the repository's examples.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn render(args: &[&str]) -> (bool, Vec<Value>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice-operator"))
        .arg("render")
        .args(args)
        .output()
        .expect("run sluice-operator");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let docs: Vec<Value> = serde_saphyr::from_multiple(&stdout).expect("render prints valid YAML");
    let docs = docs.into_iter().filter(|v| !v.is_null()).collect();
    (
        out.status.success(),
        docs,
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn kinds(docs: &[Value]) -> Vec<&str> {
    docs.iter().map(|d| d["kind"].as_str().unwrap()).collect()
}

#[test]
fn renders_the_warm_pool_and_the_policy_of_an_example_chain() {
    let file = examples().join("pii-redaction.yaml");
    let (ok, docs, stderr) = render(&[file.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    // pool: {warm: 2}
    assert_eq!(kinds(&docs), ["NetworkPolicy", "Pod", "Pod"]);
    let policy = &docs[0];
    assert_eq!(policy["metadata"]["name"], "sluice-support-input-deny-all");
    assert_eq!(
        policy["spec"]["policyTypes"],
        serde_json::json!(["Ingress", "Egress"])
    );
    let pod = &docs[1];
    assert_eq!(pod["apiVersion"], "v1");
    assert_eq!(pod["metadata"]["generateName"], "support-input-");
    assert_eq!(pod["metadata"]["namespace"], "default");
    assert_eq!(
        pod["metadata"]["labels"]["sluice.dev/chain"],
        "support-input"
    );
    assert_eq!(pod["spec"]["runtimeClassName"], "gvisor");
    assert_eq!(
        pod["spec"]["containers"][0]["image"],
        format!(
            "ghcr.io/sluice-dev/sluice-supervisor:{}",
            env!("CARGO_PKG_VERSION")
        )
    );
    assert_eq!(
        pod["spec"]["containers"][0]["securityContext"]["capabilities"]["drop"],
        serde_json::json!(["ALL"])
    );
    assert_eq!(pod["spec"]["volumes"][0]["emptyDir"]["sizeLimit"], "16Mi");
}

#[test]
fn flags_choose_the_runtime_class_and_image() {
    let file = examples().join("pii-redaction.yaml");
    let (ok, docs, stderr) = render(&[
        file.to_str().unwrap(),
        "--runtime-class",
        "gvisor-kvm",
        "--supervisor-image",
        "registry.local/sup:dev",
    ]);
    assert!(ok, "{stderr}");
    let pod = &docs[1];
    assert_eq!(pod["spec"]["runtimeClassName"], "gvisor-kvm");
    assert_eq!(
        pod["spec"]["containers"][0]["image"],
        "registry.local/sup:dev"
    );
}

#[test]
fn every_example_chain_renders() {
    for entry in std::fs::read_dir(examples()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let (ok, docs, stderr) = render(&[path.to_str().unwrap()]);
        assert!(ok, "{}: {stderr}", path.display());
        for d in &docs {
            assert!(
                matches!(d["kind"].as_str(), Some("Pod" | "NetworkPolicy")),
                "{d}"
            );
        }
    }
}

#[test]
fn problems_name_the_file_line_hook_and_code_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.yaml");
    std::fs::write(
        &file,
        "# a chain with a typo\napiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: broken}\nspec:\n  target: bot\n  triggerPoint: input\n  hooks:\n    - name: redact-phone\n      action: modify\n      code: |\n        def execute(context, settings)\n            return {'action': 'pass'}\n---\napiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: typo}\nspec:\n  target: bot\n  triggerPoint: sideways\n  hooks: []\n",
    )
    .unwrap();
    let (ok, docs, stderr) = render(&[file.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        stderr.contains("bad.yaml:2: HookChain \"broken\": hook redact-phone line 1: SyntaxError"),
        "{stderr}"
    );
    assert!(
        stderr.contains("bad.yaml:20:") && stderr.contains("sideways"),
        "{stderr}"
    );
    // The broken chain still gets its policy, never pods.
    assert_eq!(kinds(&docs), ["NetworkPolicy"]);
}
