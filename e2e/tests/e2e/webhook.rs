//! The operator's admission webhook as the API server meets it: real AdmissionReview JSON posted
//! over HTTPS (certificates made here with rcgen) to the running server. Refusals must say what
//! `sluice check` says about the same object written to a file (this suite lives in e2e so that the
//! operator crate needs no gateway crate, even for its tests).

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
use serde_json::{Value, json};
use sluice_crds::manifest::PlatformRules;
use sluice_operator::metrics::Metrics;
use sluice_operator::webhook::{CertReloader, Judge, Webhook};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::watch;

/// The interpreter `sluice check` parses with by default; the webhook is given the same one.
const PYTHON: &str = "/usr/bin/python3";

struct Pair {
    cert: String,
    key: String,
}

fn new_pair() -> Pair {
    let made = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    Pair {
        cert: made.cert.pem(),
        key: made.signing_key.serialize_pem(),
    }
}

/// Writes a file the way the kubelet updates a mounted Secret: a new file renamed over the old.
fn put(path: &Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

struct Server {
    addr: SocketAddr,
    dir: tempfile::TempDir,
    pair: Pair,
    metrics: Metrics,
    _stop: watch::Sender<bool>,
}

impl Server {
    fn cert_path(&self) -> PathBuf {
        self.dir.path().join("tls.crt")
    }
    fn key_path(&self) -> PathBuf {
        self.dir.path().join("tls.key")
    }
}

async fn start() -> Server {
    start_with(PYTHON).await
}

async fn start_with(python: &str) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let pair = new_pair();
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    put(&cert, &pair.cert);
    put(&key, &pair.key);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let webhook = Webhook::on(
        listener,
        CertReloader::load(&cert, &key).unwrap(),
        Judge {
            python: python.into(),
            rules: rules(),
        },
    );
    let metrics = Metrics::new();
    let webhook = webhook.with_metrics(metrics.clone());
    let addr = webhook.local_addr().unwrap();
    let (stop, stopped) = watch::channel(false);
    tokio::spawn(webhook.serve(stopped));
    Server {
        addr,
        dir,
        pair,
        metrics,
        _stop: stop,
    }
}

/// One HTTPS request, trusting only `trusted` (a certificate in PEM). `Err` when the TLS
/// handshake fails.
async fn post_trusting(
    addr: SocketAddr,
    trusted: &str,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, Vec<u8>), String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(trusted.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake::<_, Full<Bytes>>(hyper_util::rt::TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    Ok((status, body))
}

async fn post(server: &Server, body: Vec<u8>) -> (u16, Vec<u8>) {
    post_trusting(server.addr, &server.pair.cert, "POST", "/validate", body)
        .await
        .unwrap()
}

/// The AdmissionReview the API server sends for `object`; an UPDATE's old object had another spec.
fn review_of(uid: &str, operation: &str, object: &Value) -> Vec<u8> {
    let mut old = object.clone();
    old["spec"]["timeoutMs"] = json!(1999);
    review_with_old(uid, operation, object, &old)
}

fn review_with_old(uid: &str, operation: &str, object: &Value, old: &Value) -> Vec<u8> {
    let kind = object["kind"].as_str().unwrap();
    let resource = if kind == "HookChain" {
        "hookchains"
    } else {
        "capabilities"
    };
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "sluice.dev", "version": "v1alpha1", "kind": kind},
            "resource": {"group": "sluice.dev", "version": "v1alpha1", "resource": resource},
            "requestKind": {"group": "sluice.dev", "version": "v1alpha1", "kind": kind},
            "name": object["metadata"]["name"],
            "namespace": object["metadata"]["namespace"],
            "operation": operation,
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": object,
            "oldObject": if operation == "UPDATE" { old.clone() } else { Value::Null },
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    }))
    .unwrap()
}

/// The `response` of an answered review.
async fn judged(server: &Server, uid: &str, operation: &str, object: &Value) -> Value {
    let (status, body) = post(server, review_of(uid, operation, object)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let answer: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1", "{answer}");
    assert_eq!(answer["kind"], "AdmissionReview", "{answer}");
    assert_eq!(
        answer["response"]["uid"], uid,
        "the uid is echoed: {answer}"
    );
    answer["response"].clone()
}

/// The platform's rules both the webhook and `sluice check` judge by here: the default platform
/// namespace, and capabilities may point at the Service `ledger` of `billing` only.
fn rules() -> PlatformRules {
    PlatformRules::new("billing/ledger".parse().unwrap())
}

/// What `sluice check` prints for `object` written to a file: its messages, without file:line.
fn check_messages(object: &Value) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("object.yaml");
    std::fs::write(&file, serde_saphyr::to_string(object).unwrap()).unwrap();
    sluice_cli::check(
        &[file],
        &sluice_crds::code::Interpreter::Python(PYTHON.into()),
        &rules(),
    )
    .findings
    .into_iter()
    .map(|f| f.message)
    .collect()
}

/// A HookChain as the API server holds it after defaulting (metadata filled in).
fn chain(hooks: Value) -> Value {
    json!({
        "apiVersion": "sluice.dev/v1alpha1",
        "kind": "HookChain",
        "metadata": {
            "name": "support-input", "namespace": "team-a", "uid": "5b0c1d2e-0000-4000-8000-000000000001",
            "generation": 1, "creationTimestamp": "2026-11-26T00:00:00Z",
            "managedFields": [{"manager": "kubectl", "operation": "Apply", "apiVersion": "sluice.dev/v1alpha1",
                "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:target": {}}}}]
        },
        "spec": {
            "target": "support-bot", "triggerPoint": "input", "failurePolicy": "Closed", "timeoutMs": 2000,
            "hooks": hooks
        }
    })
}

const REDACT: &str = "import re\n\ndef execute(context, settings):\n    text = re.sub(r\"\\d{3}-\\d{4}-\\d{4}\", settings[\"mask\"], context[\"outgoing\"])\n    return {\"action\": \"modify\", \"outgoing\": text}\n";

fn redact_hook() -> Value {
    json!({"name": "redact-phone", "action": "modify", "settings": {"mask": "[phone]"}, "code": REDACT})
}

/// Asserts the refusal lists every message `sluice check` gives for the same object.
fn assert_refused_as_check_says(response: &Value, object: &Value) -> Vec<String> {
    assert_eq!(response["allowed"], false, "{response}");
    let message = response["status"]["message"].as_str().unwrap();
    let expected = check_messages(object);
    assert!(!expected.is_empty(), "sluice check finds nothing: {object}");
    for m in &expected {
        assert!(
            message.contains(m.as_str()),
            "the refusal does not say what sluice check says:\n  check: {m}\n  webhook: {message}"
        );
    }
    expected
}

#[tokio::test]
async fn a_valid_hookchain_is_admitted() {
    let server = start().await;
    let object = chain(json!([redact_hook()]));
    assert_eq!(check_messages(&object), Vec::<String>::new());
    for operation in ["CREATE", "UPDATE"] {
        let response = judged(&server, "uid-valid", operation, &object).await;
        assert_eq!(response["allowed"], true, "{response}");
        assert!(response.get("warnings").is_none(), "{response}");
    }
}

#[tokio::test]
async fn a_syntax_error_is_refused_as_check_says() {
    let server = start().await;
    let object = chain(json!([{
        "name": "redact-phone", "action": "modify",
        "code": "def execute(context, settings):\n    return {\"action\": \"modify\", \"outgoing\": context[\"outgoing\"]\n"
    }]));
    let response = judged(&server, "uid-syntax", "CREATE", &object).await;
    let said = assert_refused_as_check_says(&response, &object);
    assert!(
        said.iter().any(|m| m.contains("SyntaxError")
            && m.starts_with("HookChain \"support-input\", hook \"redact-phone\", line ")),
        "{said:?}"
    );
    assert_eq!(response["status"]["code"], 422, "{response}");
}

#[tokio::test]
async fn unknown_fields_are_refused_with_the_field_meant() {
    let server = start().await;
    let mut object = chain(json!([{
        "name": "redact-phone", "action": "modify", "setting": {"mask": "[phone]"},
        "code": "def execute(context, settings):\n    return {\"action\": \"pass\"}\n"
    }]));
    object["spec"]["failurepolicy"] = json!("Closed");
    let response = judged(&server, "uid-unknown", "UPDATE", &object).await;
    let said = assert_refused_as_check_says(&response, &object);
    let message = response["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("did you mean \"settings\"")
            && message.contains("did you mean \"failurePolicy\""),
        "{message}"
    );
    assert!(said.len() >= 2, "{said:?}");
}

#[tokio::test]
async fn an_undeclared_action_is_refused_as_check_says() {
    let server = start().await;
    let object = chain(json!([{
        "name": "redact-phone", "action": "modify",
        "code": "def execute(context, settings):\n    return {\"action\": \"block\", \"message\": \"no\"}\n"
    }]));
    let response = judged(&server, "uid-action", "CREATE", &object).await;
    assert_refused_as_check_says(&response, &object);
    let message = response["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("returns action 'block' but the hook declares 'modify'"),
        "{message}"
    );
}

#[tokio::test]
async fn every_problem_of_a_chain_is_listed_and_likely_mistakes_are_warnings() {
    let server = start().await;
    let mut object = chain(json!([
        {"name": "redact-phone", "action": "modify", "settings": {"mask": "[phone]"},
         "code": "import requests\n\ndef execute(context, settings):\n    return {\"action\": \"modify\", \"outgoing\": settings[\"mask_text\"]}\n"},
        {"name": "quiet", "action": "detect",
         "code": "def execute(context, settings):\n    settings.get(\"level\")\n"}
    ]));
    object["spec"]["timeoutMs"] = json!(5);
    let response = judged(&server, "uid-many", "CREATE", &object).await;
    assert_eq!(response["allowed"], false, "{response}");
    let message = response["status"]["message"].as_str().unwrap();
    // The schema-level problem and the code problems, all in one answer.
    for expected in [
        "HookChain \"support-input\": spec.timeoutMs: 5 is less than the minimum of 10",
        "imports 'requests', which is not in Python's standard library",
        "reads settings[\"mask_text\"], which raises KeyError at run time: its settings declare mask; did you mean \"mask\"?",
    ] {
        assert!(message.contains(expected), "{expected}\n in: {message}");
    }
    // What check reports as likely mistakes comes back as warnings, worded the same.
    let warnings: Vec<&str> = response["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    let check = check_messages(&object);
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("execute never returns a value")),
        "{warnings:?}"
    );
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("settings.get(\"level\")")),
        "{warnings:?}"
    );
    for w in &warnings {
        assert!(check.iter().any(|c| c == w), "{w} not in {check:?}");
    }
}

fn capability(schema: Value) -> Value {
    json!({
        "apiVersion": "sluice.dev/v1alpha1",
        "kind": "Capability",
        "metadata": {"name": "llm.run", "namespace": "team-a"},
        "spec": {"description": "Run an LLM completion", "endpoint": {"builtin": "echo"}, "timeoutMs": 5000,
                 "schema": schema}
    })
}

#[tokio::test]
async fn a_capability_with_a_bad_schema_is_refused_and_a_good_one_admitted() {
    let server = start().await;
    let good = capability(
        json!({"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}),
    );
    let response = judged(&server, "uid-cap-ok", "CREATE", &good).await;
    assert_eq!(response["allowed"], true, "{response}");

    let bad = capability(json!({"type": "no-such-type"}));
    let response = judged(&server, "uid-cap-bad", "CREATE", &bad).await;
    let said = assert_refused_as_check_says(&response, &bad);
    assert!(
        said.iter()
            .any(|m| m.starts_with("Capability \"llm.run\": spec.schema:")),
        "{said:?}"
    );
}

/// One message everywhere: the webhook refuses what `sluice check` reports, worded as the operator's
/// status and the gateway word it (`AllowedEndpoints::check`).
#[tokio::test]
async fn a_capability_pointing_outside_the_allowed_endpoints_is_refused_as_check_says() {
    let server = start().await;
    let mut object = capability(json!({"type": "object"}));
    object["spec"]["endpoint"] = json!({"http": "http://ledger.billing.svc:8080/execute"});
    let response = judged(&server, "uid-endpoint-ok", "CREATE", &object).await;
    assert_eq!(response["allowed"], true, "{response}");

    for (i, url) in [
        "http://collector.attacker.example/steal",
        "http://ledger.team-b.svc/execute",
        "http://169.254.169.254/latest/meta-data",
    ]
    .iter()
    .enumerate()
    {
        object["spec"]["endpoint"] = json!({"http": url});
        let response = judged(&server, &format!("uid-endpoint-{i}"), "CREATE", &object).await;
        let said = assert_refused_as_check_says(&response, &object);
        let reason = rules()
            .allowed_endpoints
            .check(&serde_json::from_value(object["spec"]["endpoint"].clone()).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            said.iter().any(|m| m.ends_with(&reason)),
            "{said:?} lacks {reason}"
        );
    }
}

#[tokio::test]
async fn an_enforced_chain_outside_the_platform_namespace_is_refused() {
    let server = start().await;
    let mut object = chain(json!([redact_hook()]));
    object["spec"]["enforced"] = json!(true);
    object["spec"]["target"] = json!("*");
    let response = judged(&server, "uid-enforced", "CREATE", &object).await;
    assert_refused_as_check_says(&response, &object);
    object["metadata"]["namespace"] = json!("sluice-system");
    let response = judged(&server, "uid-enforced-2", "CREATE", &object).await;
    assert_eq!(response["allowed"], true, "{response}");
}

#[tokio::test]
async fn a_chain_over_the_code_limit_is_refused() {
    let server = start().await;
    // Each hook is within the CRD's 256 KiB per hook; the three together are over the chain's limit.
    let padding = "# a comment line that pads the hook\n".repeat(5 << 10);
    let hooks: Vec<Value> = (0..3)
        .map(|i| {
            let mut h = redact_hook();
            h["name"] = json!(format!("redact-{i}"));
            h["code"] = json!(format!("{padding}{REDACT}"));
            h
        })
        .collect();
    let object = chain(json!(hooks));
    let response = judged(&server, "uid-big", "CREATE", &object).await;
    assert_refused_as_check_says(&response, &object);
    let message = response["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("over the 512 KiB a chain may hold"),
        "{message}"
    );

    // One hook past the CRD's own limit is said by its size, not quoted whole.
    let mut huge = redact_hook();
    huge["code"] = json!(format!("{}{REDACT}", padding.repeat(2)));
    let object = chain(json!([huge]));
    let response = judged(&server, "uid-huge", "CREATE", &object).await;
    assert_refused_as_check_says(&response, &object);
    let message = response["status"]["message"].as_str().unwrap();
    assert!(message.len() < 1000, "{message}");
    assert!(
        message.contains("spec.hooks[0].code: a text of ")
            && message.contains("is longer than 262144 characters"),
        "{message}"
    );
}

#[tokio::test]
async fn updates_that_leave_the_spec_alone_are_admitted() {
    // A chain applied before the webhook (or while it was ignored) must not block its own cleanup.
    let server = start().await;
    let broken = chain(json!([{"name": "x", "action": "modify", "code": "def ("}]));
    let mut labelled = broken.clone();
    labelled["metadata"]["labels"] = json!({"team": "a"});
    labelled["metadata"]["finalizers"] = json!(["example.com/cleanup"]);
    let answer = |body: Vec<u8>| async {
        let (status, body) = post(&server, body).await;
        assert_eq!(status, 200);
        serde_json::from_slice::<Value>(&body).unwrap()["response"].clone()
    };
    let response = answer(review_with_old("uid-meta", "UPDATE", &labelled, &broken)).await;
    assert_eq!(response["allowed"], true, "{response}");
    // A deletion under way: releasing the finalizer (spec untouched) is admitted; writing a spec is
    // judged like any other update.
    let mut deleting = labelled.clone();
    deleting["metadata"]["deletionTimestamp"] = json!("2026-11-26T01:00:00Z");
    let mut released = deleting.clone();
    released["metadata"]["finalizers"] = json!([]);
    let response = answer(review_with_old(
        "uid-released",
        "UPDATE",
        &released,
        &deleting,
    ))
    .await;
    assert_eq!(response["allowed"], true, "{response}");
    let mut rewritten = deleting.clone();
    rewritten["spec"]["timeoutMs"] = json!(1000);
    let response = answer(review_with_old(
        "uid-deleting",
        "UPDATE",
        &rewritten,
        &deleting,
    ))
    .await;
    assert_eq!(response["allowed"], false, "{response}");
    // A change to the spec is judged.
    let mut changed = broken.clone();
    changed["spec"]["timeoutMs"] = json!(1000);
    let response = answer(review_with_old("uid-changed", "UPDATE", &changed, &broken)).await;
    assert_eq!(response["allowed"], false, "{response}");
}

#[tokio::test]
async fn code_that_cannot_be_checked_is_not_admitted() {
    let server = start_with("/nonexistent/python3").await;
    let response = judged(
        &server,
        "uid-nopy",
        "CREATE",
        &chain(json!([redact_hook()])),
    )
    .await;
    assert_eq!(response["allowed"], false, "{response}");
    let message = response["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("cannot run /nonexistent/python3 to check hook code")
            && message.contains("the hook code was not checked"),
        "{message}"
    );
    // Capabilities carry no code: they are still judged.
    let good = capability(json!({"type": "object"}));
    let response = judged(&server, "uid-nopy-cap", "CREATE", &good).await;
    assert_eq!(response["allowed"], true, "{response}");
}

#[tokio::test]
async fn a_check_that_does_not_finish_in_time_is_refused_with_the_uid() {
    // A python that never answers in time: the review is refused with the reason, not left hanging.
    let dir = tempfile::tempdir().unwrap();
    let python = dir.path().join("python3");
    std::fs::write(&python, "#!/bin/sh\nexec sleep 2\n").unwrap();
    std::fs::set_permissions(&python, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let server = start_with(python.to_str().unwrap()).await;
    let (cert, key) = (server.cert_path(), server.key_path());
    // A second server on the same pair with a short review time.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let webhook = Webhook::on(
        listener,
        CertReloader::load(&cert, &key).unwrap(),
        Judge {
            python: sluice_crds::code::Interpreter::Python(python.clone()),
            rules: rules(),
        },
    )
    .with_review_timeout(std::time::Duration::from_millis(300));
    let addr = webhook.local_addr().unwrap();
    let (_stop, stopped) = watch::channel(false);
    tokio::spawn(webhook.serve(stopped));
    let body = review_of("uid-slow", "CREATE", &chain(json!([redact_hook()])));
    let (status, body) = post_trusting(addr, &server.pair.cert, "POST", "/validate", body)
        .await
        .unwrap();
    assert_eq!(status, 200);
    let response = serde_json::from_slice::<Value>(&body).unwrap()["response"].clone();
    assert_eq!(response["uid"], "uid-slow");
    assert_eq!(response["allowed"], false);
    assert!(
        response["status"]["message"]
            .as_str()
            .unwrap()
            .contains("the check did not finish within 300ms"),
        "{response}"
    );
}

#[tokio::test]
async fn deletes_and_other_kinds_are_not_judged() {
    let server = start().await;
    let broken = chain(json!([{"name": "x", "action": "modify", "code": "def ("}]));
    let response = judged(&server, "uid-delete", "DELETE", &broken).await;
    assert_eq!(response["allowed"], true, "{response}");
}

#[tokio::test]
async fn malformed_and_oversized_bodies_are_refused_cleanly() {
    let server = start().await;
    let (status, body) = post(&server, b"{not json".to_vec()).await;
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 400, "{text}");
    assert!(
        text.contains("malformed AdmissionReview: the body is not JSON"),
        "{text}"
    );

    let (status, body) = post(&server, br#"{"apiVersion": "v1", "kind": "Pod"}"#.to_vec()).await;
    assert_eq!(status, 400);
    assert!(
        String::from_utf8_lossy(&body).contains("not an admission.k8s.io/v1 AdmissionReview"),
        "{}",
        String::from_utf8_lossy(&body)
    );

    let (status, body) = post(
        &server,
        br#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}"#
            .to_vec(),
    )
    .await;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("no request.uid"));

    // A uid but a request that cannot be read: refused, and the uid still echoed.
    let response = {
        let (status, body) = post(
            &server,
            br#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "uid-odd", "operation": 7}}"#.to_vec(),
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        serde_json::from_slice::<Value>(&body).unwrap()["response"].clone()
    };
    assert_eq!(response["uid"], "uid-odd");
    assert_eq!(response["allowed"], false);
    assert!(
        response["status"]["message"]
            .as_str()
            .unwrap()
            .contains("cannot read the AdmissionReview's request"),
        "{response}"
    );

    let huge = vec![b' '; sluice_operator::webhook::MAX_BODY + 1];
    let (status, body) = post(&server, huge).await;
    assert_eq!(status, 413, "{}", String::from_utf8_lossy(&body));

    let wrong = post_trusting(server.addr, &server.pair.cert, "GET", "/validate", vec![])
        .await
        .unwrap();
    assert_eq!(wrong.0, 405);

    // The server is still there after all of it.
    let response = judged(
        &server,
        "uid-after",
        "CREATE",
        &chain(json!([redact_hook()])),
    )
    .await;
    assert_eq!(response["allowed"], true);
    let count = |result: &str| {
        server
            .metrics
            .webhook_reviews
            .with_label_values(&[result])
            .get()
    };
    assert_eq!(
        (count("malformed"), count("refused"), count("admitted")),
        (4, 1, 1)
    );
}

#[tokio::test]
async fn a_rotated_certificate_is_served_without_a_restart() {
    let server = start().await;
    let object = chain(json!([redact_hook()]));
    let body = review_of("uid-rotate", "CREATE", &object);
    let first = post_trusting(
        server.addr,
        &server.pair.cert,
        "POST",
        "/validate",
        body.clone(),
    )
    .await
    .unwrap();
    assert_eq!(first.0, 200);

    // cert-manager issues a new pair; the kubelet swaps the mounted files.
    let next = new_pair();
    put(&server.key_path(), &next.key);
    put(&server.cert_path(), &next.cert);
    let second = post_trusting(server.addr, &next.cert, "POST", "/validate", body.clone())
        .await
        .expect("the new certificate is served");
    assert_eq!(second.0, 200);
    let old = post_trusting(
        server.addr,
        &server.pair.cert,
        "POST",
        "/validate",
        body.clone(),
    )
    .await;
    assert!(old.is_err(), "the old certificate is no longer served");

    // A half-written rotation (a key that does not match) keeps the last good pair serving.
    put(&server.key_path(), &new_pair().key);
    let third = post_trusting(server.addr, &next.cert, "POST", "/validate", body)
        .await
        .expect("the last good pair keeps serving");
    assert_eq!(third.0, 200);
}

#[tokio::test]
async fn a_bad_certificate_stops_the_start_with_the_file_named() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert, "not a certificate").unwrap();
    std::fs::write(&key, new_pair().key).unwrap();
    let err = CertReloader::load(&cert, &key).err().unwrap().to_string();
    assert!(
        err.contains("tls.crt") && err.contains("no PEM certificate"),
        "{err}"
    );
    let err = CertReloader::load(&dir.path().join("missing.crt"), &key)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("cannot read") && err.contains("missing.crt"),
        "{err}"
    );
}
