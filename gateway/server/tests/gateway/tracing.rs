//! OpenTelemetry tracing end to end: the `sluice-gateway` binary (local mode, real runsc sandboxes),
//! configured only through the standard `OTEL_*` environment, exports its spans to an OTLP receiver
//! this test runs (gRPC, and HTTP/protobuf), decoded with opentelemetry-proto. A Run carrying a W3C
//! `traceparent` must come back as one tree under that parent: the gRPC server span → `run` →
//! `claim` and one `hook` span per hook → the hook's `host_call` → its `capability_request`; and the
//! capability service (HTTP in one test, gRPC in the other) receives the `traceparent` of that
//! capability request span. A Stream is a `stream` span under its server span, the same way.

use http_body_util::BodyExt;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
    trace_service_server::{TraceService, TraceServiceServer},
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;
use sluice_proto::{self as proto, gateway_client::GatewayClient};
use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_SPAN: &str = "00f067aa0ba902b7";

/// Every export request a receiver got.
type Exports = Arc<Mutex<Vec<ExportTraceServiceRequest>>>;

/// One span as the receiver decoded it.
#[derive(Debug, Clone)]
struct Span {
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    kind: i32,
    attrs: HashMap<String, String>,
}

fn spans(exports: &Exports) -> (Vec<Span>, Vec<HashMap<String, String>>) {
    let mut spans = Vec::new();
    let mut resources = Vec::new();
    for req in exports.lock().unwrap().iter() {
        for rs in &req.resource_spans {
            if let Some(r) = &rs.resource {
                resources.push(attributes(&r.attributes));
            }
            for ss in &rs.scope_spans {
                for s in &ss.spans {
                    spans.push(Span {
                        name: s.name.clone(),
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent: hex(&s.parent_span_id),
                        kind: s.kind,
                        attrs: attributes(&s.attributes),
                    });
                }
            }
        }
    }
    (spans, resources)
}

fn attributes(kvs: &[opentelemetry_proto::tonic::common::v1::KeyValue]) -> HashMap<String, String> {
    kvs.iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(AnyValue::StringValue(s)) => s.clone(),
                Some(AnyValue::IntValue(i)) => i.to_string(),
                Some(AnyValue::BoolValue(b)) => b.to_string(),
                Some(other) => format!("{other:?}"),
                None => String::new(),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An OTLP/gRPC trace receiver on a free port.
struct GrpcReceiver(Exports);

#[tonic::async_trait]
impl TraceService for GrpcReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

async fn grpc_receiver() -> (String, Exports) {
    let exports = Exports::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = TraceServiceServer::new(GrpcReceiver(exports.clone()));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (format!("http://{addr}"), exports)
}

/// A small HTTP/1 server: `handle` gets each request's path, headers and body and answers a body.
async fn http_server<F>(handle: F) -> std::net::SocketAddr
where
    F: Fn(&str, &hyper::HeaderMap, bytes::Bytes) -> (u16, Vec<u8>) + Send + Sync + 'static,
{
    let handle = Arc::new(handle);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let handle = handle.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let handle = handle.clone();
                        async move {
                            let (parts, body) = req.into_parts();
                            let body = body.collect().await?.to_bytes();
                            let (status, out) = handle(parts.uri.path(), &parts.headers, body);
                            let mut resp = hyper::Response::new(http_body_util::Full::new(
                                bytes::Bytes::from(out),
                            ));
                            *resp.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                            Ok::<_, hyper::Error>(resp)
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// An OTLP/HTTP (protobuf) trace receiver: POST /v1/traces.
async fn http_receiver() -> (String, Exports) {
    let exports = Exports::default();
    let kept = exports.clone();
    let addr = http_server(move |path, _, body| {
        if path != "/v1/traces" {
            return (404, vec![]);
        }
        match ExportTraceServiceRequest::decode(body) {
            Ok(req) => {
                kept.lock().unwrap().push(req);
                (200, ExportTraceServiceResponse::default().encode_to_vec())
            }
            Err(_) => (400, vec![]),
        }
    })
    .await;
    (format!("http://{addr}"), exports)
}

/// The `traceparent`s the capability service received.
type Seen = Arc<Mutex<Vec<Option<String>>>>;

async fn http_capability() -> (String, Seen) {
    let seen = Seen::default();
    let kept = seen.clone();
    let addr = http_server(move |_, headers, _| {
        kept.lock().unwrap().push(
            headers
                .get("traceparent")
                .and_then(|v| v.to_str().ok())
                .map(String::from),
        );
        (200, br#"{"result": {"text": "looked up"}}"#.to_vec())
    })
    .await;
    (format!("http://{addr}/execute"), seen)
}

struct GrpcCapability(Seen);

#[tonic::async_trait]
impl proto::capability_service_server::CapabilityService for GrpcCapability {
    async fn execute(
        &self,
        request: tonic::Request<proto::ExecuteRequest>,
    ) -> Result<tonic::Response<proto::ExecuteResponse>, tonic::Status> {
        self.0.lock().unwrap().push(
            request
                .metadata()
                .get("traceparent")
                .and_then(|v| v.to_str().ok())
                .map(String::from),
        );
        let result = sluice_proto::convert::to_proto(&serde_json::json!({"text": "looked up"}));
        Ok(tonic::Response::new(proto::ExecuteResponse {
            result: Some(result),
            consumed: None,
        }))
    }
}

async fn grpc_capability() -> (String, Seen) {
    let seen = Seen::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = proto::capability_service_server::CapabilityServiceServer::new(GrpcCapability(
        seen.clone(),
    ));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (format!("http://{addr}"), seen)
}

fn chain_dir(endpoint: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        r#"apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {{name: lookup}}
spec:
  endpoint: {endpoint}
  timeoutMs: 5000
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {{name: traced}}
spec:
  target: bot
  triggerPoint: input
  pool: {{warm: 1, max: 2}}
  hooks:
    - name: ask
      action: modify
      capabilities: [lookup]
      code: |
        def execute(context, settings):
            answer = context.host_call("lookup", {{"q": context["outgoing"]}})
            return {{"action": "modify", "outgoing": answer["text"]}}
    - name: look
      action: detect
      code: |
        def execute(context, settings):
            return {{"action": "pass"}}
"#
    );
    std::fs::write(dir.path().join("chain.yaml"), yaml).unwrap();
    dir
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

type Client = GatewayClient<tonic::transport::Channel>;

/// The gateway binary, stopped (SIGTERM, then waited for) when dropped.
struct Gateway(Child);

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

/// Starts the gateway with the OTLP environment, and runs `hello` through `bot` with a traceparent.
/// The gateway keeps running (and exporting) until the returned guard is dropped.
async fn traced_run(
    protocol: &str,
    otlp: &str,
    capability_endpoint: &str,
) -> (String, Client, Gateway, tempfile::TempDir) {
    let dir = chain_dir(capability_endpoint);
    let state = tempfile::Builder::new()
        .prefix("sluice-otel")
        .tempdir_in("/tmp")
        .unwrap();
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_sluice-gateway"))
        .arg("--local")
        .arg(dir.path())
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--state-dir")
        .arg(state.path())
        .arg("--audit")
        .arg(state.path().join("audit.jsonl"))
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", otlp)
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        .env(
            "OTEL_SERVICE_NAME",
            format!("gateway-under-test-{protocol}"),
        )
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("gateway binary starts");
    let gateway = Gateway(child);
    let addr = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut client = loop {
        if let Ok(c) = GatewayClient::connect(addr.clone()).await {
            break c;
        }
        assert!(Instant::now() < deadline, "the gateway never listened");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut req = tonic::Request::new(proto::RunRequest {
        namespace: "default".into(),
        target: "bot".into(),
        trigger_point: "input".into(),
        payload: Some(proto::run_request::Payload::Text("hello".into())),
        ..Default::default()
    });
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{TRACE_ID}-{PARENT_SPAN}-01").parse().unwrap(),
    );
    let answer = client.run(req).await.expect("the run answers").into_inner();
    let text = match answer.payload {
        Some(proto::run_response::Payload::Text(t)) => t,
        other => panic!("a text answer: {other:?}"),
    };
    assert_eq!(text, "looked up", "the hook's host_call went through");
    (answer.run_id, client, gateway, dir)
}

/// The span names of a traced Run (or, with `stream`, of a traced Stream), server span first.
fn tree_names(stream: bool) -> [&'static str; 6] {
    let (server, top) = if stream {
        ("sluice.v1.Gateway/Stream", "stream")
    } else {
        ("sluice.v1.Gateway/Run", "run")
    };
    [
        server,
        top,
        "claim",
        "hook",
        "host_call",
        "capability_request",
    ]
}

/// Waits until the receiver holds every kind of span of a traced Run (or Stream).
async fn until_exported(
    exports: &Exports,
    stream: bool,
) -> (Vec<Span>, Vec<HashMap<String, String>>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (spans, resources) = spans(exports);
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        if tree_names(stream).iter().all(|n| names.contains(n)) {
            return (spans, resources);
        }
        assert!(
            Instant::now() < deadline,
            "spans never all arrived; got {names:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn one<'a>(spans: &'a [Span], name: &str, parent: &Span) -> &'a Span {
    let found: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == name && s.parent == parent.span_id)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one {name:?} span under {:?}: {spans:#?}",
        parent.name
    );
    found[0]
}

/// The whole tree under the caller's traceparent, and the capability service's traceparent.
fn assert_tree(
    spans: &[Span],
    resources: &[HashMap<String, String>],
    run_id: &str,
    protocol: &str,
    seen: &Seen,
) {
    assert!(
        resources
            .iter()
            .all(|r| r.get("service.name").map(String::as_str)
                == Some(&format!("gateway-under-test-{protocol}"))),
        "OTEL_SERVICE_NAME names the service: {resources:?}"
    );
    let server: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "sluice.v1.Gateway/Run")
        .collect();
    assert_eq!(server.len(), 1, "{spans:#?}");
    let server = server[0];
    assert_eq!(server.trace_id, TRACE_ID, "the caller's trace continues");
    assert_eq!(
        server.parent, PARENT_SPAN,
        "the caller's span is the parent"
    );
    assert_eq!(server.kind, SpanKind::Server as i32);
    for s in spans {
        assert_eq!(
            s.trace_id, TRACE_ID,
            "every span is in the caller's trace: {s:?}"
        );
        // Nothing else of the process is exported: no library's (h2, hyper, tonic) spans.
        assert!(
            tree_names(false).contains(&s.name.as_str()),
            "unexpected {s:?}"
        );
    }

    let run = one(spans, "run", server);
    assert_eq!(run.attrs.get("run_id").map(String::as_str), Some(run_id));
    assert_eq!(
        run.attrs.get("chain").map(String::as_str),
        Some("default/traced")
    );
    assert_eq!(run.attrs.get("action").map(String::as_str), Some("modify"));
    assert_eq!(run.attrs.get("target").map(String::as_str), Some("bot"));
    one(spans, "claim", run);
    let hooks: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "hook" && s.parent == run.span_id)
        .collect();
    let names: Vec<&str> = hooks
        .iter()
        .map(|h| h.attrs.get("hook").map_or("", String::as_str))
        .collect();
    assert_eq!(names.len(), 2, "a span per hook: {hooks:#?}");
    assert!(
        names.contains(&"ask") && names.contains(&"look"),
        "{names:?}"
    );
    let ask = hooks
        .iter()
        .find(|h| h.attrs.get("hook").map(String::as_str) == Some("ask"))
        .unwrap();
    assert_eq!(ask.attrs.get("action").map(String::as_str), Some("modify"));
    let host_call = one(spans, "host_call", ask);
    assert_eq!(
        host_call.attrs.get("capability").map(String::as_str),
        Some("lookup")
    );
    let request = one(spans, "capability_request", host_call);
    assert_eq!(request.kind, SpanKind::Client as i32);
    assert_eq!(
        seen.lock().unwrap().clone(),
        vec![Some(format!("00-{TRACE_ID}-{}-01", request.span_id))],
        "the capability service got the capability request span as its parent"
    );
}

// Multi-threaded: the receivers must answer while the test waits on the gateway process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_go_over_otlp_grpc_under_the_callers_traceparent() {
    let (otlp, exports) = grpc_receiver().await;
    let (capability, seen) = http_capability().await;
    let endpoint = format!("{{http: \"{capability}\"}}");
    let (run_id, client, _gateway, _dir) = traced_run("grpc", &otlp, &endpoint).await;
    let (spans, resources) = until_exported(&exports, false).await;
    assert_tree(&spans, &resources, &run_id, "grpc", &seen);

    // A Stream joins its caller's trace the same way: its flushes and final path under one span.
    exports.lock().unwrap().clear();
    let run_id = traced_stream(client).await;
    let (spans, _) = until_exported(&exports, true).await;
    assert!(
        spans.iter().all(|s| s.trace_id == STREAM_TRACE_ID),
        "{spans:#?}"
    );
    let server: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "sluice.v1.Gateway/Stream")
        .collect();
    assert_eq!(server.len(), 1, "{spans:#?}");
    assert_eq!(server[0].parent, PARENT_SPAN);
    let stream = one(&spans, "stream", server[0]);
    assert_eq!(
        stream.attrs.get("run_id").map(String::as_str),
        Some(run_id.as_str())
    );
    assert_eq!(
        stream.attrs.get("action").map(String::as_str),
        Some("modify")
    );
    one(&spans, "claim", stream);
    let asks: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "hook" && s.parent == stream.span_id)
        .filter(|s| s.attrs.get("hook").map(String::as_str) == Some("ask"))
        .collect();
    assert!(!asks.is_empty(), "hook spans under the stream: {spans:#?}");
    for ask in asks {
        let call = one(&spans, "host_call", ask);
        one(&spans, "capability_request", call);
    }
}

const STREAM_TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";

/// Streams a short reply through `bot` (stream path and final path) with a traceparent; answers
/// the final answer's run id.
async fn traced_stream(mut client: Client) -> String {
    use proto::stream_request::Msg;
    let msgs = [
        Msg::Open(proto::StreamOpen {
            namespace: "default".into(),
            target: "bot".into(),
            trigger_point: "input".into(),
            ..Default::default()
        }),
        Msg::Chunk("hello ".into()),
        Msg::Chunk("there".into()),
        Msg::Finish(proto::StreamFinish {}),
    ]
    .map(|m| proto::StreamRequest { msg: Some(m) });
    let mut req = tonic::Request::new(futures::stream::iter(msgs));
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{STREAM_TRACE_ID}-{PARENT_SPAN}-01")
            .parse()
            .unwrap(),
    );
    let mut responses = client
        .stream(req)
        .await
        .expect("the stream opens")
        .into_inner();
    while let Some(m) = responses.message().await.expect("the stream answers") {
        if let Some(proto::stream_response::Msg::Final(f)) = m.msg {
            return f.run_id;
        }
    }
    panic!("the stream ended without a final answer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_go_over_otlp_http_protobuf_and_grpc_capabilities_carry_the_context() {
    let (otlp, exports) = http_receiver().await;
    let (capability, seen) = grpc_capability().await;
    let endpoint = format!("{{grpc: \"{capability}\"}}");
    let (run_id, _client, _gateway, _dir) = traced_run("http/protobuf", &otlp, &endpoint).await;
    let (spans, resources) = until_exported(&exports, false).await;
    assert_tree(&spans, &resources, &run_id, "http/protobuf", &seen);
}
