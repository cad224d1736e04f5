//! Securing the gateway's gRPC listener, against a real local gateway (runsc sandboxes) and the real
//! gRPC client, with certificates made in the test: mutual TLS accepted and refused, SANs and bearer
//! tokens bound to namespaces, the caller's identity in the audit and in a capability's `caller`,
//! certificates and the caller policy reloaded without a restart, and `--insecure` required for a
//! plain non-loopback listener.

use crate::common;

use common::{Ca, Whoami, caller_of, chains, install, run_request, tls_client};
use serde_json::Value;
use sha2::{Digest, Sha256};
use sluice_engine::Audit;
use sluice_gateway::{LocalOptions, RunningGateway, Security, TlsFiles, start_local};
use sluice_proto::{self as proto, gateway_client::GatewayClient};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tonic::Code;

const SPIFFE_SUPPORT: &str = "spiffe://example.org/ns/support/sa/app";
const TOKEN: &str = "billing-s3cret-token";

fn sha256_hex(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn policy() -> String {
    format!(
        r#"apiVersion: sluice.dev/v1alpha1
kind: CallerPolicy
callers:
  - name: support-app
    match: {{uriSAN: "{SPIFFE_SUPPORT}"}}
    namespaces: [support]
  - name: billing-svc
    match: {{dnsSAN: billing.internal}}
    namespaces: [billing]
  - name: billing-batch
    match: {{tokenSha256: "{}"}}
    namespaces: [billing]
"#,
        sha256_hex(TOKEN)
    )
}

/// A local gateway over TLS (server cert of `ca`, client certs verified against `ca`) with the
/// caller policy above, serving the whoami chain in `support` and `billing`.
struct Secured {
    gateway: RunningGateway,
    ca: Ca,
    whoami: Whoami,
    files: tempfile::TempDir,
    _state: tempfile::TempDir,
}

impl Secured {
    async fn start() -> Self {
        let ca = Ca::new("test CA");
        let files = tempfile::tempdir().unwrap();
        let state = tempfile::Builder::new()
            .prefix("sluice-sec")
            .tempdir_in("/tmp")
            .unwrap();
        let whoami = Whoami::default();
        let url = whoami.serve().await;
        let chains_dir = files.path().join("chains");
        std::fs::create_dir(&chains_dir).unwrap();
        std::fs::write(
            chains_dir.join("who.yaml"),
            chains(&["support", "billing"], &url),
        )
        .unwrap();
        install(files.path(), "server", &ca.server());
        std::fs::write(files.path().join("ca.crt"), &ca.pem).unwrap();
        std::fs::write(files.path().join("callers.yaml"), policy()).unwrap();
        let mut opts = LocalOptions::new(&chains_dir, state.path().join("sandboxes"));
        opts.audit = Audit::to_file(&files.path().join("audit.jsonl")).unwrap();
        opts.security = Security {
            tls: Some(tls_files(files.path())),
            callers: Some(files.path().join("callers.yaml")),
            insecure: false,
        };
        let gateway = start_local(opts).await.expect("the gateway starts");
        Self {
            gateway,
            ca,
            whoami,
            files,
            _state: state,
        }
    }

    fn port(&self) -> u16 {
        self.gateway.addr.port()
    }

    fn audit(&self) -> Vec<Value> {
        std::fs::read_to_string(self.files.path().join("audit.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

fn tls_files(dir: &Path) -> TlsFiles {
    TlsFiles {
        cert: dir.join("server.crt"),
        key: dir.join("server.key"),
        client_ca: Some(dir.join("ca.crt")),
    }
}

async fn run(
    client: &mut GatewayClient<tonic::transport::Channel>,
    namespace: &str,
    token: Option<&str>,
) -> Result<proto::RunResponse, tonic::Status> {
    client
        .run(run_request(namespace, token))
        .await
        .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_are_verified_and_their_sans_bound_to_namespaces() {
    let g = Secured::start().await;
    let port = g.port();

    // A SPIFFE ID (URI SAN) signed by the client CA: its namespace, and no other.
    let support = g.ca.client_uri(SPIFFE_SUPPORT);
    let mut c = tls_client(port, &g.ca.pem, Some(&support)).await.unwrap();
    let r = run(&mut c, "support", None)
        .await
        .expect("support-app may use support");
    assert_eq!(caller_of(&r)["caller"], "support-app");
    let denied = run(&mut c, "billing", None)
        .await
        .expect_err("not its namespace");
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    assert!(denied.message().contains("support-app"), "{denied:?}");

    // A DNS SAN signed by the client CA.
    let billing = g.ca.client_dns("billing.internal");
    let mut c = tls_client(port, &g.ca.pem, Some(&billing)).await.unwrap();
    let r = run(&mut c, "billing", None)
        .await
        .expect("billing-svc may use billing");
    assert_eq!(caller_of(&r)["caller"], "billing-svc");
    let denied = run(&mut c, "support", None)
        .await
        .expect_err("not its namespace");
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");

    // A certificate with the right SAN from another CA: refused in the handshake (under TLS 1.3 the
    // client learns it at its first request, as a dropped connection).
    let rogue = Ca::new("rogue CA").client_uri(SPIFFE_SUPPORT);
    let refused = match tls_client(port, &g.ca.pem, Some(&rogue)).await {
        Err(_) => None,
        Ok(mut c) => Some(run(&mut c, "support", None).await),
    };
    if let Some(r) = refused {
        let status = r.expect_err("a certificate of an unknown CA must not get in");
        // The server's alert (UnknownCA) or the closed connection, depending on timing: a transport
        // failure either way, never an answer of the policy.
        assert!(
            matches!(
                status.code(),
                Code::Unavailable | Code::Cancelled | Code::Unknown
            ),
            "refused by the transport, not by the policy: {status:?}"
        );
    }

    // A verified certificate whose SANs name no caller, and no certificate at all: UNAUTHENTICATED.
    let stranger = g.ca.client_uri("spiffe://example.org/ns/other/sa/x");
    let mut c = tls_client(port, &g.ca.pem, Some(&stranger)).await.unwrap();
    let status = run(&mut c, "support", None).await.expect_err("unknown");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(
        status
            .message()
            .contains("spiffe://example.org/ns/other/sa/x"),
        "{status:?}"
    );
    let mut anonymous = tls_client(port, &g.ca.pem, None).await.unwrap();
    let status = run(&mut anonymous, "support", None)
        .await
        .expect_err("anonymous");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    // Health answers without credentials (probes, load balancers).
    let channel = tonic::transport::Channel::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(&g.ca.pem))
                .domain_name("localhost"),
        )
        .unwrap()
        .connect()
        .await
        .unwrap();
    let health = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await;
    assert!(health.is_ok(), "{health:?}");

    // Plain text to a TLS port gets nowhere.
    let mut plain = GatewayClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .expect("the TCP connection opens");
    assert!(run(&mut plain, "support", None).await.is_err());
    g.gateway.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_tokens_are_matched_by_their_sha256_and_bound_to_namespaces() {
    let g = Secured::start().await;
    // No client certificate: the token alone identifies the caller.
    let mut c = tls_client(g.port(), &g.ca.pem, None).await.unwrap();
    let r = run(&mut c, "billing", Some(TOKEN))
        .await
        .expect("the token may use billing");
    assert_eq!(caller_of(&r)["caller"], "billing-batch");
    let status = run(&mut c, "billing", Some("not-the-token"))
        .await
        .expect_err("wrong token");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("matches no caller"), "{status:?}");
    let status = run(&mut c, "support", Some(TOKEN))
        .await
        .expect_err("wrong namespace");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");

    // Stream: the same rules, from the stream's open.
    let open = |namespace: &str| proto::StreamRequest {
        msg: Some(proto::stream_request::Msg::Open(proto::StreamOpen {
            namespace: namespace.into(),
            target: "bot".into(),
            trigger_point: "output".into(),
            ..Default::default()
        })),
    };
    for (namespace, token, code) in [
        ("support", Some(TOKEN), Code::PermissionDenied),
        ("billing", Some("nope"), Code::Unauthenticated),
        // Admitted: the caller passes, and the request goes on to find no chain at output.
        ("billing", Some(TOKEN), Code::NotFound),
    ] {
        let mut req = tonic::Request::new(futures::stream::iter(vec![
            open(namespace),
            proto::StreamRequest {
                msg: Some(proto::stream_request::Msg::Finish(proto::StreamFinish {})),
            },
        ]));
        if let Some(t) = token {
            req.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        let status = match c.stream(req).await {
            Err(s) => s,
            Ok(resp) => {
                let mut out = resp.into_inner();
                let mut last = None;
                while let Some(m) = futures::StreamExt::next(&mut out).await {
                    if let Err(s) = m {
                        last = Some(s);
                    }
                }
                last.expect("the stream is refused")
            }
        };
        assert_eq!(status.code(), code, "{namespace} {token:?}: {status:?}");
    }
    g.gateway.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_identity_is_in_the_audit_and_the_capabilitys_caller_and_cannot_be_forged() {
    let g = Secured::start().await;
    let support = g.ca.client_uri(SPIFFE_SUPPORT);
    let mut c = tls_client(g.port(), &g.ca.pem, Some(&support))
        .await
        .unwrap();
    // The request's context says caller=forged (run_request puts it there).
    let r = run(&mut c, "support", None).await.unwrap();
    let caller = caller_of(&r);
    assert_eq!(caller["caller"], "support-app", "{caller}");
    assert_eq!(
        caller["user_id"], "u-1",
        "the application's context still passes"
    );
    let seen = g.whoami.callers.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0]["caller"], "support-app");
    let denied = run(&mut c, "billing", None).await.expect_err("denied");
    assert_eq!(denied.code(), Code::PermissionDenied);

    let audit = g.audit();
    let ok = audit
        .iter()
        .find(|e| e["run_id"] == r.run_id)
        .expect("audited");
    assert_eq!(ok["caller"], "support-app");
    let refused = audit
        .iter()
        .find(|e| e["namespace"] == "billing")
        .expect("the refusal is audited");
    assert_eq!(refused["caller"], "support-app");
    assert!(
        refused["error"].as_str().unwrap().contains("may not use"),
        "{refused}"
    );
    g.gateway.shutdown().await;
}

/// The value of a gauge or counter of the gateway's metrics, with `result` as its label if given.
fn metric(g: &Secured, name: &str, result: Option<&str>) -> f64 {
    let families = g.gateway.engine.metrics().registry.gather();
    let family = families
        .iter()
        .find(|f| f.name() == name)
        .unwrap_or_else(|| panic!("no metric {name}"));
    let gauge = family.get_field_type() == prometheus::proto::MetricType::GAUGE;
    family
        .get_metric()
        .iter()
        .find(|m| result.is_none_or(|r| m.get_label().iter().any(|l| l.value() == r)))
        .map(|m| {
            if gauge {
                m.get_gauge().get_value()
            } else {
                m.get_counter().get_value()
            }
        })
        .unwrap_or(0.0)
}

/// Polls `f` until it is true, for at most 20 s (the files are looked at every 2 s).
async fn eventually(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f().await {
        assert!(Instant::now() < deadline, "{what} never happened");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_and_a_changed_policy_are_served_without_a_restart() {
    let g = Secured::start().await;
    let port = g.port();
    let support = g.ca.client_uri(SPIFFE_SUPPORT);
    // The server certificate is rotated to one of a new CA (as a CA rotation would).
    let next_ca = Ca::new("next CA");
    assert!(
        tls_client(port, &next_ca.pem, Some(&support))
            .await
            .is_err(),
        "a client trusting only the next CA cannot connect yet"
    );
    install(g.files.path(), "server", &next_ca.server_until(2031));
    eventually("serving the rotated certificate", async || {
        tls_client(port, &next_ca.pem, Some(&support)).await.is_ok()
    })
    .await;
    assert!(
        tls_client(port, &g.ca.pem, Some(&support)).await.is_err(),
        "the old certificate is no longer served"
    );
    let mut c = tls_client(port, &next_ca.pem, Some(&support))
        .await
        .unwrap();
    run(&mut c, "support", None)
        .await
        .expect("served under the rotated certificate");
    // 2031-01-01T00:00:00Z: what an expiry alert watches.
    assert_eq!(
        metric(
            &g,
            "sluice_gateway_tls_certificate_expiry_timestamp_seconds",
            None
        ),
        1_924_992_000.0
    );

    // A broken rotation (a key that is not the certificate's) keeps the last good certificate:
    // once the gateway has read it and refused it, the last good one is still served.
    let tls_reloads = "sluice_gateway_tls_reloads_total";
    let failed = metric(&g, tls_reloads, Some("failed"));
    std::fs::write(g.files.path().join("server.key"), Ca::new("x").server().key).unwrap();
    eventually("the broken key refused", async || {
        metric(&g, tls_reloads, Some("failed")) > failed
    })
    .await;
    assert!(tls_client(port, &next_ca.pem, Some(&support)).await.is_ok());
    assert!(metric(&g, tls_reloads, Some("ok")) >= 1.0);
    assert!(metric(&g, tls_reloads, Some("failed")) >= 1.0);

    // The policy grows: support-app may now use billing too.
    assert_eq!(
        run(&mut c, "billing", None).await.unwrap_err().code(),
        Code::PermissionDenied
    );
    let grown = policy().replacen("namespaces: [support]", "namespaces: [support, billing]", 1);
    std::fs::write(g.files.path().join("callers.yaml"), grown).unwrap();
    eventually("the changed caller policy", async || {
        run(&mut c, "billing", None).await.is_ok()
    })
    .await;
    // A broken edit keeps the last good policy in force, once the gateway has read and refused it.
    let policy_reloads = "sluice_gateway_caller_policy_reloads_total";
    let failed = metric(&g, policy_reloads, Some("failed"));
    std::fs::write(g.files.path().join("callers.yaml"), "kind: [").unwrap();
    eventually("the broken policy refused", async || {
        metric(&g, policy_reloads, Some("failed")) > failed
    })
    .await;
    run(&mut c, "billing", None)
        .await
        .expect("the last good policy still serves");
    assert!(metric(&g, policy_reloads, Some("ok")) >= 1.0);
    assert!(metric(&g, policy_reloads, Some("failed")) >= 1.0);
    g.gateway.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_caller_policy_mutual_tls_requires_a_client_certificate() {
    let ca = Ca::new("test CA");
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "server", &ca.server());
    std::fs::write(dir.path().join("ca.crt"), &ca.pem).unwrap();
    let chains = dir.path().join("chains");
    std::fs::create_dir(&chains).unwrap();
    let mut opts = LocalOptions::new(&chains, dir.path().join("sandboxes"));
    opts.security = Security {
        tls: Some(tls_files(dir.path())),
        callers: None,
        insecure: false,
    };
    let gateway = start_local(opts).await.expect("the gateway starts");
    let port = gateway.addr.port();
    // With a certificate of the CA: in (and on to the chain lookup: there is no chain).
    let mut c = tls_client(port, &ca.pem, Some(&ca.client_dns("anyone.internal")))
        .await
        .unwrap();
    let status = run(&mut c, "support", None).await.expect_err("no chain");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    // Without one: the handshake refuses it (seen at the first request under TLS 1.3).
    let refused = match tls_client(port, &ca.pem, None).await {
        Err(_) => None,
        Ok(mut c) => Some(run(&mut c, "support", None).await),
    };
    if let Some(r) = refused {
        let status = r.expect_err("no client certificate must not get in");
        assert!(
            matches!(
                status.code(),
                Code::Unavailable | Code::Cancelled | Code::Unknown
            ),
            "{status:?}"
        );
    }
    gateway.shutdown().await;
}

fn bogus_runsc(dir: &Path) -> PathBuf {
    dir.join("no-such-runsc")
}

#[tokio::test]
async fn a_plain_non_loopback_listener_needs_insecure() {
    let dir = tempfile::tempdir().unwrap();
    let attempt = |security: Security| {
        let mut opts = LocalOptions::new(dir.path(), dir.path().join("state"));
        opts.listen = "0.0.0.0:0".parse().unwrap();
        opts.security = security;
        // The backend fails if it is ever reached: only the exposure check may stop a start first.
        opts.sandbox.runsc = bogus_runsc(dir.path());
        start_local(opts)
    };
    for (security, missing) in [
        (Security::default(), "TLS and a caller policy"),
        (
            Security {
                callers: Some(dir.path().join("callers.yaml")),
                ..Default::default()
            },
            "without TLS",
        ),
    ] {
        let err = match attempt(security).await {
            Ok(_) => panic!("a plain non-loopback listener started"),
            Err(e) => format!("{e:#}"),
        };
        assert!(err.contains("--insecure") && err.contains(missing), "{err}");
    }
    // With --insecure the start goes on (and fails later, at the missing runsc).
    let err = match attempt(Security {
        insecure: true,
        ..Default::default()
    })
    .await
    {
        Ok(_) => panic!("started with a runsc that does not exist"),
        Err(e) => format!("{e:#}"),
    };
    assert!(!err.contains("--insecure"), "{err}");
    assert!(err.contains("runsc"), "{err}");
}

#[test]
fn the_binary_refuses_a_plain_non_loopback_listener_without_insecure() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice-gateway"))
        .arg("--local")
        .arg(dir.path())
        .args(["--listen", "0.0.0.0:0", "--runsc"])
        .arg(bogus_runsc(dir.path()))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("refusing to listen on 0.0.0.0:0") && stderr.contains("--insecure"),
        "{stderr}"
    );
}

/// Heartbeat timings that would take every exec connection for lost are refused before the gateway
/// looks for the API server (the kubeconfig here does not exist).
#[test]
fn the_binary_refuses_an_exec_ping_deadline_shorter_than_its_interval() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice-gateway"))
        .args([
            "--kube",
            "--exec-ping-every",
            "10s",
            "--exec-ping-deadline",
            "5s",
        ])
        .env("KUBECONFIG", dir.path().join("missing"))
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--exec-ping-deadline")
            && stderr.contains("shorter than the interval between pings"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_tls_and_the_caller_policy_from_its_flags() {
    let ca = Ca::new("test CA");
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "server", &ca.server());
    std::fs::write(dir.path().join("ca.crt"), &ca.pem).unwrap();
    std::fs::write(dir.path().join("callers.yaml"), policy()).unwrap();
    let chains = dir.path().join("chains");
    std::fs::create_dir(&chains).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let arg = |name: &str| dir.path().join(name).to_string_lossy().to_string();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice-gateway"))
        .arg("--local")
        .arg(&chains)
        // Every address: allowed without --insecure because TLS and a policy are given.
        .args(["--listen", &format!("0.0.0.0:{port}")])
        .args([
            "--tls-cert",
            &arg("server.crt"),
            "--tls-key",
            &arg("server.key"),
        ])
        .args([
            "--client-ca",
            &arg("ca.crt"),
            "--callers",
            &arg("callers.yaml"),
        ])
        .args(["--state-dir", &arg("state"), "--audit", &arg("audit.jsonl")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut client = loop {
        if let Ok(c) = tls_client(port, &ca.pem, Some(&ca.client_dns("billing.internal"))).await {
            break c;
        }
        assert!(Instant::now() < deadline, "the gateway never served TLS");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // billing-svc (its DNS SAN) is admitted and finds no chain; support is not its namespace.
    let status = run(&mut client, "billing", None).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    let status = run(&mut client, "support", None).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    child.kill().await.unwrap();
}
