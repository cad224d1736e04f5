//! `sluice sign`, `sluice verify` and `sluice check --trusted-signers` as a reviewer and a platform
//! team use them (docs/signing.md): keys made by `ssh-keygen`, signatures made in-process and by
//! `ssh-keygen -Y sign` itself (a key with a passphrase), both verified the same way.

use std::path::Path;
use std::process::Command;

fn sluice(args: &[&str], envs: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .expect("sluice runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// A new ed25519 key at `dir/name` (with `passphrase`, or none), made by ssh-keygen.
fn keygen(dir: &Path, name: &str, passphrase: &str) -> String {
    let path = dir.join(name);
    let out = Command::new("ssh-keygen")
        .args([
            "-q",
            "-t",
            "ed25519",
            "-C",
            &format!("{name}@example"),
            "-N",
            passphrase,
            "-f",
        ])
        .arg(&path)
        .output()
        .expect("ssh-keygen runs (openssh-client: make deps installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    path.to_string_lossy().to_string()
}

/// `text` without its `signature:` blocks.
fn unsigned(text: &str) -> String {
    let mut out = String::new();
    let mut inside: Option<usize> = None;
    for line in text.split_inclusive('\n') {
        let indent = line.len() - line.trim_start().len();
        if let Some(at) = inside {
            if indent > at && !line.trim().is_empty() {
                continue;
            }
            inside = None;
        }
        if line.trim_start().starts_with("signature: |") {
            inside = Some(indent);
            continue;
        }
        out.push_str(line);
    }
    out
}

fn example(dir: &Path, name: &str) -> String {
    let from = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/");
    let to = dir.join(name);
    std::fs::copy(format!("{from}{name}"), &to).unwrap();
    to.to_string_lossy().to_string()
}

#[test]
fn a_reviewer_signs_and_anyone_verifies_and_a_change_after_signing_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let key = keygen(d, "reviewer", "");
    let chains = d.join("chains");
    std::fs::create_dir(&chains).unwrap();
    let pii = example(&chains, "pii-redaction.yaml");
    let injection = example(&chains, "prompt-injection.yaml");
    let before = std::fs::read_to_string(&pii).unwrap();
    let allowed = d.join("allowed_signers");
    let public = std::fs::read_to_string(format!("{key}.pub")).unwrap();
    std::fs::write(&allowed, format!("reviewer@example {public}")).unwrap();
    let allowed = allowed.to_string_lossy().to_string();

    let (code, out) = sluice(&["sign", "--key", &key, &pii], &[]);
    assert_eq!(code, 0, "{out}");
    for hook in ["redact-card", "redact-phone", "redact-email"] {
        assert!(
            out.contains(&format!(
                "signed HookChain default/support-input, hook \"{hook}\""
            )),
            "{out}"
        );
    }
    // Only signatures were added: the file is otherwise as written.
    let after = std::fs::read_to_string(&pii).unwrap();
    assert_eq!(unsigned(&after), before);
    assert_eq!(
        after
            .matches("      signature: |\n        -----BEGIN SSH SIGNATURE-----\n")
            .count(),
        3,
        "{after}"
    );
    // Signing again replaces the signatures: the same text (ed25519 signatures are deterministic).
    let (code, out) = sluice(&["sign", "-k", &key, &pii], &[]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(std::fs::read_to_string(&pii).unwrap(), after);

    let (code, out) = sluice(&["verify", "--trusted-signers", &allowed, &pii], &[]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out.matches("signed by reviewer@example (SHA256:").count(),
        3,
        "{out}"
    );
    let (code, out) = sluice(
        &["verify", "--trusted-signers", &allowed, &pii, &injection],
        &[],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("hook \"injection-blocker\" is not signed"),
        "{out}"
    );

    // `check` reports the unsigned chain where signatures are required, and only there.
    let dir_arg = chains.to_string_lossy().to_string();
    let (code, out) = sluice(&["check", "--trusted-signers", &allowed, &dir_arg], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("prompt-injection.yaml") && out.contains("is not signed"),
        "{out}"
    );
    assert!(!out.contains("pii-redaction.yaml"), "{out}");
    let (code, out) = sluice(
        &[
            "check",
            "--trusted-signers",
            &allowed,
            "--signed-namespaces",
            "team-a",
            &dir_arg,
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}");

    // A change after signing: the hook's signature no longer matches, and verify says which.
    std::fs::write(&pii, after.replace("[card]", "[CARD]")).unwrap();
    let (code, out) = sluice(&["verify", "--trusted-signers", &allowed, &pii], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("hook \"redact-card\" has a signature by reviewer@example")
            && out.contains("does not match"),
        "{out}"
    );
    assert_eq!(
        out.matches("signed by reviewer@example").count(),
        2,
        "{out}"
    );
}

#[test]
fn a_key_with_a_passphrase_signs_through_ssh_keygen_and_verifies_alike() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let key = keygen(d, "careful", "correct horse");
    let askpass = d.join("askpass");
    std::fs::write(&askpass, "#!/bin/sh\necho 'correct horse'\n").unwrap();
    Command::new("chmod")
        .arg("755")
        .arg(&askpass)
        .status()
        .unwrap();
    let pii = example(d, "pii-redaction.yaml");
    let askpass = askpass.to_string_lossy().to_string();
    let env = [
        ("SSH_ASKPASS", askpass.as_str()),
        ("SSH_ASKPASS_REQUIRE", "force"),
        ("DISPLAY", ":0"),
    ];
    let (code, out) = sluice(
        &["sign", "--key", &key, "--hook", "redact-phone", &pii],
        &env,
    );
    assert_eq!(code, 0, "{out}");
    let public = std::fs::read_to_string(format!("{key}.pub")).unwrap();
    let allowed = d.join("allowed_signers");
    std::fs::write(
        &allowed,
        format!("careful@example namespaces=\"sluice.dev/hook\" {public}"),
    )
    .unwrap();
    let (code, out) = sluice(
        &[
            "verify",
            "--trusted-signers",
            &allowed.to_string_lossy(),
            &pii,
        ],
        &[],
    );
    assert_eq!(code, 1, "two hooks were not signed:\n{out}");
    assert!(
        out.contains("hook \"redact-phone\": signed by careful@example"),
        "{out}"
    );
    assert!(out.contains("hook \"redact-card\" is not signed"), "{out}");
    // A wrong passphrase signs nothing and changes nothing.
    let before = std::fs::read_to_string(&pii).unwrap();
    std::fs::write(&askpass, "#!/bin/sh\necho wrong\n").unwrap();
    let (code, out) = sluice(&["sign", "--key", &key, &pii], &env);
    assert_ne!(code, 0, "{out}");
    assert_eq!(std::fs::read_to_string(&pii).unwrap(), before);
}

#[test]
fn hooks_that_cannot_be_signed_are_refused_with_why() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let key = keygen(d, "k", "");
    let flow = d.join("flow.yaml");
    std::fs::write(
        &flow,
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: f}\nspec:\n  target: t\n  triggerPoint: input\n  hooks:\n    - {name: h, action: detect, code: \"def execute(c, s):\\n    return {'action': 'pass'}\\n\"}\n",
    )
    .unwrap();
    let before = std::fs::read_to_string(&flow).unwrap();
    let (code, out) = sluice(&["sign", "-k", &key, &flow.to_string_lossy()], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("flow style") && out.contains("hook \"h\""),
        "{out}"
    );
    assert_eq!(
        std::fs::read_to_string(&flow).unwrap(),
        before,
        "nothing written"
    );
    let (code, out) = sluice(
        &[
            "sign",
            "-k",
            &format!("{key}.nope"),
            &flow.to_string_lossy(),
        ],
        &[],
    );
    assert_eq!(code, 2, "{out}");
    let (code, out) = sluice(
        &[
            "sign",
            "-k",
            &key,
            "--hook",
            "missing",
            &flow.to_string_lossy(),
        ],
        &[],
    );
    assert_eq!(code, 1, "{out}");
}

#[test]
fn a_key_held_by_ssh_agent_signs_from_its_public_half() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let key = keygen(d, "agent", "");
    let socket = d.join("agent.sock");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _agent = Kill(
        Command::new("ssh-agent")
            .args(["-D", "-a"])
            .arg(&socket)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("ssh-agent runs"),
    );
    let sock = socket.to_string_lossy().to_string();
    for _ in 0..100 {
        if socket.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let added = Command::new("ssh-add")
        .arg("-q")
        .arg(&key)
        .env("SSH_AUTH_SOCK", &sock)
        .output()
        .expect("ssh-add runs");
    assert!(
        added.status.success(),
        "{}",
        String::from_utf8_lossy(&added.stderr)
    );
    // Only the agent holds the private key now.
    std::fs::remove_file(&key).unwrap();
    let pii = example(d, "pii-redaction.yaml");
    let (code, out) = sluice(
        &["sign", "--key", &format!("{key}.pub"), &pii],
        &[("SSH_AUTH_SOCK", &sock)],
    );
    assert_eq!(code, 0, "{out}");
    let public = std::fs::read_to_string(format!("{key}.pub")).unwrap();
    let allowed = d.join("allowed_signers");
    std::fs::write(&allowed, format!("agent@example {public}")).unwrap();
    let (code, out) = sluice(
        &[
            "verify",
            "--trusted-signers",
            &allowed.to_string_lossy(),
            &pii,
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(out.matches("signed by agent@example").count(), 3, "{out}");
}
