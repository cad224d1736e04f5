//! The OpenAI-compatible proxy end to end, from Rust: a real local gateway (runsc sandboxes) serving
//! the shipped example chains in front of the example services' fake OpenAI LLM. The official
//! `openai` client's view is `clients/python/tests/test_openai_proxy.py`; these cover what is
//! easier to arrange here: the platform's `before_model` baseline stopping a long conversation, an
//! upstream that cannot be reached, and the audit of a proxied stream.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use sluice_e2e::Harness;
use sluice_example_services::{CONTACT_REPLY, FakeOpenAi};

const EXAMPLES: [&str; 4] = [
    "pii-redaction.yaml",
    "stream-redactor.yaml",
    "support-tools.yaml",
    "policies/baseline/hookchain.yaml",
];

async fn gateway(upstream: &str) -> Harness {
    gateway_with(upstream, |_| {}).await
}

/// The gateway with the example chains, each file's text passed through `tweak`.
async fn gateway_with(upstream: &str, tweak: impl Fn(&mut String)) -> Harness {
    let files: Vec<(String, String)> = EXAMPLES
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let path = format!("{}/../examples/{f}", env!("CARGO_MANIFEST_DIR"));
            let mut text = std::fs::read_to_string(path).expect("example chain");
            tweak(&mut text);
            (format!("{i}.yaml"), text)
        })
        .collect();
    let files: Vec<(&str, &str)> = files
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str()))
        .collect();
    let upstream = upstream.to_string();
    Harness::start_with(&files, move |o| {
        o.openai = Some(sluice_gateway::OpenAiOptions::new(
            "127.0.0.1:0".parse().expect("address"),
            upstream,
        ));
    })
    .await
}

/// POSTs `body` to the proxy: the status and the whole answer.
async fn post(h: &Harness, body: &Value) -> (u16, Bytes) {
    post_to(h.gateway().openai_addr.expect("the proxy is served"), body).await
}

async fn post_to(addr: std::net::SocketAddr, body: &Value) -> (u16, Bytes) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let req = hyper::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let resp = client.request(req).await.expect("the proxy answers");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_platform_baseline_stops_a_conversation_over_its_turn_limit_before_the_model() {
    let fake = FakeOpenAi::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let h = gateway(&format!("http://{}/v1", fake.addr)).await;
    // 100 model calls so far: this request would be the 101st.
    let mut messages = Vec::new();
    for i in 0..100 {
        messages.push(json!({"role": "user", "content": format!("question {i}")}));
        messages.push(json!({"role": "assistant", "content": format!("answer {i}")}));
    }
    messages.push(json!({"role": "user", "content": "one more"}));
    let before = fake
        .stats
        .requests
        .load(std::sync::atomic::Ordering::Relaxed);
    let (status, body) = post(&h, &json!({"model": "support-bot", "messages": messages})).await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "content_filter", "{v}");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "The platform's limit of 100 model calls per conversation is reached."
    );
    assert_eq!(
        fake.stats
            .requests
            .load(std::sync::atomic::Ordering::Relaxed),
        before,
        "the blocked request reached the model"
    );
    // One turn fewer goes through.
    messages.drain(0..2);
    let (status, body) = post(&h, &json!({"model": "support-bot", "messages": messages})).await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "echo: one more");
    let audit = h.audit();
    assert!(
        audit
            .iter()
            .any(|e| e["trigger_point"] == "before_model" && e["action"] == "block"),
        "the block is audited: {audit:?}"
    );
    h.stop_and_check_leaks().await;
    fake.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_that_cannot_be_reached_is_a_502_error_object() {
    // A port bound and never listened on, held for the whole test: a connection is refused at once.
    // (A port bound and freed again can be taken by another test's server meanwhile, which accepts
    // and never answers: the proxy's upstream timeout, a 504, instead of the 502.)
    let closed = tokio::net::TcpSocket::new_v4().unwrap();
    closed.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = closed.local_addr().unwrap().port();
    let h = gateway(&format!("http://127.0.0.1:{port}/v1")).await;
    for stream in [false, true] {
        let (status, body) = post(
            &h,
            &json!({"model": "support-bot", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
        assert_eq!(status, 502);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "upstream_error", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("cannot be reached"),
            "{v}"
        );
    }
    drop(closed);
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_proxied_stream_is_redacted_and_audited_as_a_stream() {
    let fake = FakeOpenAi::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let h = gateway(&format!("http://{}/v1", fake.addr)).await;
    let (status, body) = post(
        &h,
        &json!({"model": "support-bot", "stream": true, "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": "contact: please"}]}),
    )
    .await;
    assert_eq!(status, 200);
    let text = String::from_utf8(body.to_vec()).unwrap();
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(text.trim_end().ends_with("data: [DONE]"));
    let content: String = events
        .iter()
        .filter_map(|e| {
            e.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
        })
        .collect();
    let expected = CONTACT_REPLY
        .replace("555-0123-4567", "[phone]")
        .replace("020-7946-0958", "[phone]")
        .replace("sam.jones@example.com", "[email]")
        .replace("oncall@example.org", "[email]");
    assert_eq!(content, expected);
    // The usage chunk the client asked for comes last, as the upstream sent it.
    let last = events.last().unwrap();
    assert!(
        last["usage"]["total_tokens"].as_u64().unwrap() > 0,
        "{last}"
    );
    assert!(
        events
            .iter()
            .all(|e| e["id"].as_str().unwrap().starts_with("chatcmpl-fake-"))
    );
    let audit = h.audit();
    let stream = audit
        .iter()
        .find(|e| e["mode"] == "stream" && e["trigger_point"] == "output")
        .expect("the stream is audited");
    assert_eq!(stream["action"], "modify", "{stream}");
    assert!(
        stream["stream"]["flushes"].as_u64().unwrap() > 1,
        "{stream}"
    );
    h.stop_and_check_leaks().await;
    fake.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reply_that_breaks_off_is_finished_as_it_is_under_an_open_output_chain() {
    let fake = FakeOpenAi::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    // The example output chain, failing open.
    let h = gateway_with(&format!("http://{}/v1", fake.addr), |text| {
        if text.contains("name: support-output") {
            *text = text.replace("failurePolicy: Closed", "failurePolicy: Open");
        }
    })
    .await;
    let (status, body) = post(
        &h,
        &json!({"model": "support-bot", "stream": true,
                "messages": [{"role": "user", "content": "break: call 555-0123-4567"}]}),
    )
    .await;
    assert_eq!(status, 200);
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(!text.contains("\"error\""), "{text}");
    assert!(text.contains("\"finish_reason\":\"stop\""), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"));
    let content: String = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|e| {
            e.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .collect();
    // Everything the upstream sent (half of the echo), through the chain: the input chain masked
    // the number before the model saw it.
    let full = "echo:  call [phone] ".repeat(20);
    assert!(full.starts_with(&content), "{content:?}");
    assert!(content.len() >= full.len() / 2 - 10, "{content:?}");
    h.stop_and_check_leaks().await;
    fake.stop();
}

/// A gateway told to stop (SIGTERM in a rolling update) stops accepting proxy connections at once
/// and closes the ones it has only after their answers: a reply that is streaming is ended as the
/// engine ends every open stream on shutdown, with an error event and `[DONE]` (never a cut
/// connection), and its upstream call is cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopping_gateway_refuses_new_connections_and_ends_streaming_replies_cleanly() {
    use std::sync::atomic::Ordering;
    let fake = FakeOpenAi::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let mut h = gateway(&format!("http://{}/v1", fake.addr)).await;
    let addr = h.gateway().openai_addr.expect("the proxy is served");
    let body = json!({"model": "support-bot", "stream": true,
                      "messages": [{"role": "user", "content": "slow: tick"}]});
    let streaming = tokio::spawn(async move { post_to(addr, &body).await });
    let started = std::time::Instant::now();
    while fake.stats.requests.load(Ordering::Relaxed) == 0 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "the stream never started"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let gateway = h.gateway.take().expect("the gateway");
    let stopping = tokio::spawn(gateway.shutdown());
    let (status, body) = streaming.await.expect("the client task");
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.contains("the gateway is shutting down") && text.trim_end().ends_with("data: [DONE]"),
        "the reply ends with an error event and [DONE]: ...{}",
        &text[text.len().saturating_sub(400)..]
    );
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "a stopping gateway takes no new proxy connection"
    );
    stopping.await.expect("the gateway stops");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while fake.stats.streams_cancelled.load(Ordering::Relaxed) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the upstream call was cancelled"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(fake.stats.streams_finished.load(Ordering::Relaxed), 0);
    fake.stop();
}
