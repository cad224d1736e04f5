//! The reference agent loop reaches a secured gateway (TLS with a CA, mutual TLS, a bearer token)
//! through the same options as `sluice call`, and hears a refusal as a refusal. No chain is needed:
//! an admitted call reaches the chain lookup (nothing at `before_model`, so the payload goes on).

use rcgen::{
    BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, SanType,
};
use serde_json::json;
use sha2::{Digest, Sha256};
use sluice_agent_loop::hooks::{HookError, Hooks};
use sluice_gateway::{LocalOptions, Security, TlsFiles, start_local};
use sluice_proto::client::ClientAuth;
use std::path::{Path, PathBuf};

fn leaf(
    issuer: &Issuer<'_, KeyPair>,
    san: SanType,
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.subject_alt_names = vec![san];
    params.extended_key_usages = vec![usage];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_loop_connects_with_tls_a_client_certificate_or_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap();
    let ca_pem = ca_params.self_signed(&ca_key).unwrap().pem();
    let ca = Issuer::new(ca_params, ca_key);
    let (server_cert, server_key) = leaf(
        &ca,
        SanType::DnsName("localhost".try_into().unwrap()),
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_cert, client_key) = leaf(
        &ca,
        SanType::DnsName("agent.internal".try_into().unwrap()),
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let digest: String = Sha256::digest(b"agent-token")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let chains = dir.path().join("chains");
    std::fs::create_dir(&chains).unwrap();
    let ca_file = write(dir.path(), "ca.crt", &ca_pem);
    let callers = write(
        dir.path(),
        "callers.yaml",
        &format!(
            "apiVersion: sluice.dev/v1alpha1\nkind: CallerPolicy\ncallers:\n  - name: agent\n    match: {{dnsSAN: agent.internal}}\n    namespaces: [default]\n  - name: agent-token\n    match: {{tokenSha256: \"{digest}\"}}\n    namespaces: [default]\n"
        ),
    );
    let mut opts = LocalOptions::new(&chains, dir.path().join("sandboxes"));
    opts.security = Security {
        tls: Some(TlsFiles {
            cert: write(dir.path(), "server.crt", &server_cert),
            key: write(dir.path(), "server.key", &server_key),
            client_ca: Some(ca_file.clone()),
        }),
        callers: Some(callers),
        insecure: false,
    };
    let gateway = start_local(opts).await.expect("the gateway starts");
    let addr = format!("https://localhost:{}", gateway.addr.port());
    let payload = json!({"model": "m", "messages": [], "tools": [], "max_tokens": 10});

    let with = |auth: ClientAuth| {
        let (addr, payload) = (addr.clone(), payload.clone());
        async move {
            let hooks = Hooks::connect_with(&addr, &auth, "default", "agent", "s-1")
                .await
                .expect("connects");
            hooks.check("before_model", payload).await
        }
    };
    let tls = ClientAuth {
        ca: Some(ca_file.clone()),
        ..Default::default()
    };
    // A client certificate, then a token: admitted (no chain at before_model, so the payload goes on).
    with(ClientAuth {
        cert: Some(write(dir.path(), "client.crt", &client_cert)),
        key: Some(write(dir.path(), "client.key", &client_key)),
        ..tls.clone()
    })
    .await
    .expect("admitted with a client certificate");
    with(ClientAuth {
        token: Some("agent-token".into()),
        ..tls.clone()
    })
    .await
    .expect("admitted with a token");
    // A wrong token: the loop hears UNAUTHENTICATED and stops.
    match with(ClientAuth {
        token: Some("not-it".into()),
        ..tls.clone()
    })
    .await
    {
        Err(HookError::Gateway { code, .. }) => assert_eq!(code, tonic::Code::Unauthenticated),
        other => panic!("a wrong token was not refused: {other:?}"),
    }
    gateway.shutdown().await;
}
