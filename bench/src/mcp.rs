//! The MCP proxy's added latency per `tools/call`: the example MCP server called directly, then
//! through the gateway's proxy with a 3-hook `before_tool` chain (argument redaction, a path guard,
//! a size check) and a 3-hook `after_tool` chain (secrets, phone numbers, e-mail addresses), in
//! the same run, one session each.

use crate::Bench;
use crate::report::{Row, Table, percentile};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use sluice_example_services::FakeMcp;
use std::time::{Duration, Instant};

type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
>;

/// Calls per measured row (after a warm-up).
const SAMPLES: usize = 100;

const CHAINS: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: bench-tools-before, namespace: default}
spec:
  target: bench-tools
  triggerPoint: before_tool
  pool: {warm: 2, max: 4}
  hooks:
    - name: redact-arguments
      action: modify
      code: |
        import re
        PHONE = re.compile(r"\d{3}-\d{4}-\d{4}")
        def execute(context, settings):
            call = context["outgoing"]
            args = {k: PHONE.sub("[phone]", v) if isinstance(v, str) else v for k, v in call["arguments"].items()}
            if args == call["arguments"]:
                return {"action": "pass"}
            call["arguments"] = args
            return {"action": "modify", "outgoing": call}
    - name: path-guard
      action: block
      code: |
        def execute(context, settings):
            path = context["outgoing"]["arguments"].get("path", "")
            if isinstance(path, str) and not path.startswith("/srv/support/"):
                return {"action": "block", "message": "outside /srv/support"}
            return {"action": "pass"}
    - name: size-check
      action: detect
      code: |
        def execute(context, settings):
            size = len(str(context["outgoing"]["arguments"]))
            return {"action": "detect", "findings": {"size": size}} if size > 4096 else {"action": "pass"}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: bench-tools-after, namespace: default}
spec:
  target: bench-tools
  triggerPoint: after_tool
  pool: {warm: 2, max: 4}
  hooks:
    - name: secrets
      action: modify
      code: |
        import re
        SECRET = re.compile(r"(password\s*[=:]\s*)\S+", re.IGNORECASE)
        def execute(context, settings):
            out = context["outgoing"]
            text = out.get("result")
            if not isinstance(text, str) or not SECRET.search(text):
                return {"action": "pass"}
            out["result"] = SECRET.sub(r"\1[secret]", text)
            return {"action": "modify", "outgoing": out}
    - name: phones
      action: modify
      code: |
        import re
        PHONE = re.compile(r"\d{3}-\d{4}-\d{4}")
        def execute(context, settings):
            out = context["outgoing"]
            text = out.get("result")
            if not isinstance(text, str) or not PHONE.search(text):
                return {"action": "pass"}
            out["result"] = PHONE.sub("[phone]", text)
            return {"action": "modify", "outgoing": out}
    - name: emails
      action: modify
      code: |
        import re
        EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
        def execute(context, settings):
            out = context["outgoing"]
            text = out.get("result")
            if not isinstance(text, str) or not EMAIL.search(text):
                return {"action": "pass"}
            out["result"] = EMAIL.sub("[email]", text)
            return {"action": "modify", "outgoing": out}
"#;

pub(crate) async fn bench(table: &mut Table) -> anyhow::Result<()> {
    let server = FakeMcp::start("127.0.0.1:0".parse()?).await?;
    let direct_url = format!("http://{}/mcp", server.addr);
    let upstream = sluice_gateway::McpServer {
        name: "bench-tools".into(),
        url: direct_url.clone(),
    };
    let bench = Bench::start_with(&[("tools.yaml", CHAINS.to_string())], move |o| {
        o.mcp = Some(sluice_gateway::McpOptions::new(
            "127.0.0.1:0".parse().expect("an address"),
            vec![upstream],
        ));
    })
    .await?;
    let proxied_url = format!(
        "http://{}/mcp/bench-tools",
        bench.gateway.mcp_addr.expect("the proxy is served")
    );
    let client: Client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let pools = bench.gateway.engine.pools();
    let direct = samples(&client, &direct_url, None).await?;
    let proxied = samples(&client, &proxied_url, Some(pools)).await?;
    table.push(Row::latency(
        "MCP proxy, tools/call (before_tool 3 hooks + after_tool 3 hooks)",
        &proxied,
    ));
    table.push(Row::latency(
        "  baseline: the MCP server called directly",
        &direct,
    ));
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    table.push(Row::value(
        "  added by the proxy (p50 · p99; target p50 <= 5 ms)",
        format!(
            "{:+.2} ms · {:+.2} ms",
            ms(percentile(&proxied, 50.0)) - ms(percentile(&direct, 50.0)),
            ms(percentile(&proxied, 99.0)) - ms(percentile(&direct, 99.0)),
        ),
    ));
    bench.gateway.shutdown().await;
    server.stop();
    Ok(())
}

/// One JSON-RPC POST; the answer's session header and message.
async fn post(
    client: &Client,
    url: &str,
    session: Option<&str>,
    message: &Value,
) -> anyhow::Result<(Option<String>, Value)> {
    let mut req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream");
    if let Some(s) = session {
        req = req.header("mcp-session-id", s);
    }
    let resp = client
        .request(req.body(Full::new(Bytes::from(message.to_string())))?)
        .await?;
    anyhow::ensure!(
        resp.status().is_success(),
        "{url} answered {}",
        resp.status()
    );
    let session = resp
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = resp.into_body().collect().await?.to_bytes();
    let text = String::from_utf8_lossy(&body);
    // A JSON answer, or the last event of an SSE one.
    let json = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .next_back()
        .unwrap_or(&text);
    Ok((session, serde_json::from_str(json)?))
}

/// `SAMPLES` calls of `read_file` in one session of `url`, after ten of warm-up; through the proxy
/// (`pools`), each with warm sandboxes waiting, as the Run rows are timed.
async fn samples(
    client: &Client,
    url: &str,
    pools: Option<&sluice_engine::Pools>,
) -> anyhow::Result<Vec<Duration>> {
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "sluice-bench", "version": "0"}}});
    let (session, _) = post(client, url, None, &init).await?;
    let session = session.ok_or_else(|| anyhow::anyhow!("{url} opened no session"))?;
    let mut out = Vec::new();
    for i in 0..SAMPLES + 10 {
        if let Some(p) = pools {
            p.wait_warm(Duration::from_secs(30)).await;
        }
        let call = json!({"jsonrpc": "2.0", "id": i + 1, "method": "tools/call", "params": {
            "name": "read_file", "arguments": {"path": "/srv/support/faq.md"}}});
        let began = Instant::now();
        let (_, answer) = post(client, url, Some(&session), &call).await?;
        let took = began.elapsed();
        let text = answer
            .pointer("/result/content/0/text")
            .and_then(Value::as_str)
            .ok_or_else(|| anyhow::anyhow!("{url} answered {answer}"))?;
        anyhow::ensure!(
            pools.is_none() || !text.contains("hunter2"),
            "a secret came through the proxy: {text}"
        );
        if i >= 10 {
            out.push(took);
        }
    }
    Ok(out)
}
