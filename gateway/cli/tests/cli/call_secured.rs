//! `sluice call` against a secured gateway (TLS, mutual TLS, bearer tokens, a caller policy), with
//! certificates made in the test: the options a platform hands to an application team work, and
//! what the gateway refuses is refused.

use rcgen::{
    BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, SanType,
};
use sha2::{Digest, Sha256};
use sluice_gateway::{LocalOptions, Security, TlsFiles, start_local};
use std::path::Path;

const CHAIN: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: upper, namespace: support}
spec:
  target: bot
  triggerPoint: input
  pool: {warm: 1, max: 2}
  hooks:
    - name: upper
      action: modify
      code: |
        def execute(context, settings):
            return {"action": "modify", "outgoing": context["outgoing"].upper()}
"#;

fn leaf(
    issuer: &Issuer<'_, KeyPair>,
    sans: Vec<SanType>,
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.subject_alt_names = sans;
    params.extended_key_usages = vec![usage];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().to_string()
}

async fn sluice(args: Vec<String>) -> (bool, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(&args)
        .env_remove("SLUICE_TOKEN")
        .output()
        .await
        .expect("sluice runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluice_call_speaks_tls_mutual_tls_and_bearer_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let state = tempfile::Builder::new()
        .prefix("sluice-call")
        .tempdir_in("/tmp")
        .unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap();
    let ca_pem = ca_params.self_signed(&ca_key).unwrap().pem();
    let ca = Issuer::new(ca_params, ca_key);
    let (server_cert, server_key) = leaf(
        &ca,
        vec![
            SanType::IpAddress([127, 0, 0, 1].into()),
            SanType::DnsName("sluice-gateway.sluice-system.svc".try_into().unwrap()),
        ],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_cert, client_key) = leaf(
        &ca,
        vec![SanType::URI(
            "spiffe://example.org/ns/support/sa/app".try_into().unwrap(),
        )],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let token_digest: String = Sha256::digest(b"t0ken")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let chains = dir.path().join("chains");
    std::fs::create_dir(&chains).unwrap();
    write(&chains, "chain.yaml", CHAIN);
    let ca_file = write(dir.path(), "ca.crt", &ca_pem);
    let callers = write(
        dir.path(),
        "callers.yaml",
        &format!(
            "apiVersion: sluice.dev/v1alpha1\nkind: CallerPolicy\ncallers:\n  - name: app\n    match: {{uriSAN: \"spiffe://example.org/ns/support/sa/app\"}}\n    namespaces: [support]\n  - name: batch\n    match: {{tokenSha256: \"{token_digest}\"}}\n    namespaces: [support]\n"
        ),
    );
    let mut opts = LocalOptions::new(&chains, state.path().join("sandboxes"));
    opts.security = Security {
        tls: Some(TlsFiles {
            cert: write(dir.path(), "server.crt", &server_cert).into(),
            key: write(dir.path(), "server.key", &server_key).into(),
            client_ca: Some(ca_file.clone().into()),
        }),
        callers: Some(callers.into()),
        insecure: false,
    };
    let gateway = start_local(opts).await.expect("the gateway starts");
    let addr = format!("https://127.0.0.1:{}", gateway.addr.port());
    let call = |extra: &[&str]| {
        let mut args: Vec<String> = [
            "call",
            "--addr",
            &addr,
            "--namespace",
            "support",
            "--target",
            "bot",
            "--text",
            "hi",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let cert = write(dir.path(), "client.crt", &client_cert);
    let key = write(dir.path(), "client.key", &client_key);
    let token_file = write(dir.path(), "token", "t0ken\n");

    // Mutual TLS.
    let (ok, out) = sluice(call(&["--ca", &ca_file, "--cert", &cert, "--key", &key])).await;
    assert!(ok, "{out}");
    assert!(out.contains("\"HI\""), "{out}");
    // A token from a file (TLS without a client certificate).
    let (ok, out) = sluice(call(&["--ca", &ca_file, "--token-file", &token_file])).await;
    assert!(ok, "{out}");
    assert!(out.contains("\"HI\""), "{out}");
    // The certificate's name given apart from the address (a port-forward).
    let (ok, out) = sluice(call(&[
        "--ca",
        &ca_file,
        "--token-file",
        &token_file,
        "--tls-server-name",
        "sluice-gateway.sluice-system.svc",
    ]))
    .await;
    assert!(ok, "{out}");
    let (ok, out) = sluice(call(&[
        "--ca",
        &ca_file,
        "--token-file",
        &token_file,
        "--tls-server-name",
        "someone-else.example",
    ]))
    .await;
    assert!(
        !ok,
        "a certificate without the name asked for must fail: {out}"
    );
    // A wrong token, no credentials at all, and a gateway certificate not trusted: refused.
    let (ok, out) = sluice(call(&["--ca", &ca_file, "--token", "wrong"])).await;
    assert!(!ok && out.contains("matches no caller"), "{out}");
    let (ok, out) = sluice(call(&["--ca", &ca_file])).await;
    assert!(
        !ok && out.contains("no verified client certificate"),
        "{out}"
    );
    let (ok, out) = sluice(call(&["--token-file", &token_file])).await;
    assert!(
        !ok,
        "an https gateway whose CA is not trusted must fail: {out}"
    );
    gateway.shutdown().await;
}
