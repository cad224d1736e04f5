//! The OpenAI-compatible proxy's added latency: the example services' fake OpenAI LLM called
//! directly, then through the gateway's proxy with the example chains (`input` PII redaction, the
//! platform's `before_model` baseline, the streaming `output` redactor, the tool guards), then
//! through LiteLLM's proxy on the same fake when `litellm` is installed (a venv under
//! /var/cache/sluice/litellm-venv, or $SLUICE_LITELLM), all in this run.

use crate::Bench;
use crate::report::{Row, Table, percentile};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use sluice_example_services::FakeOpenAi;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
>;

/// LiteLLM's master key (it refuses to start without one); every request of the bench sends it.
const LITELLM_KEY: &str = "sk-sluice-bench";

/// Requests per measured row (after a warm-up).
const SAMPLES: usize = 60;

/// A support question with personal data in it, as the example input chain sees every day.
const QUESTION: &str =
    "Hello, my order has not arrived. Call me at 010-1234-5678 or write to ann.lee@example.com.";

/// Where the example chains the proxy serves come from.
const EXAMPLE_CHAINS: [&str; 4] = [
    "pii-redaction.yaml",
    "stream-redactor.yaml",
    "support-tools.yaml",
    "policies/baseline/hookchain.yaml",
];

pub(crate) async fn bench(table: &mut Table) -> anyhow::Result<()> {
    let fake = FakeOpenAi::start("127.0.0.1:0".parse()?).await?;
    let upstream = format!("http://{}/v1", fake.addr);
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut files = Vec::new();
    for (i, f) in EXAMPLE_CHAINS.iter().enumerate() {
        files.push((
            format!("{i}.yaml"),
            std::fs::read_to_string(examples.join(f))?,
        ));
    }
    let files: Vec<(&str, String)> = files.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
    let upstream_for_gateway = upstream.clone();
    let bench = Bench::start_with(&files, move |o| {
        o.openai = Some(sluice_gateway::OpenAiOptions::new(
            "127.0.0.1:0".parse().expect("an address"),
            upstream_for_gateway,
        ));
    })
    .await?;
    let proxy = format!(
        "http://{}/v1",
        bench.gateway.openai_addr.expect("the proxy is served")
    );
    let client: Client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let pools = bench.gateway.engine.pools();
    // Every proxied request is timed with warm sandboxes waiting (as the Run rows are).
    let pace = || async {
        pools.wait_warm(Duration::from_secs(30)).await;
    };
    let no_pace = || async {};

    let direct = samples(&client, &upstream, false, false, no_pace).await?;
    let proxied = samples(&client, &proxy, false, true, pace).await?;
    let direct_ttft = samples(&client, &upstream, true, false, no_pace).await?;
    let proxied_ttft = samples(&client, &proxy, true, true, pace).await?;
    table.push(Row::latency(
        "OpenAI proxy, non-streamed (input + before_model + after_model + output)",
        &proxied,
    ));
    table.push(Row::latency(
        "  baseline: the fake upstream called directly",
        &direct,
    ));
    table.push(Row::value(
        "  added by the proxy (p50 · p99)",
        added(&proxied, &direct),
    ));
    table.push(Row::latency(
        "OpenAI proxy, streamed: time to first token (output flushChars 64)",
        &proxied_ttft,
    ));
    table.push(Row::latency(
        "  baseline: the fake upstream called directly",
        &direct_ttft,
    ));
    table.push(Row::value(
        "  added by the proxy (p50 · p99)",
        added(&proxied_ttft, &direct_ttft),
    ));
    match litellm(&upstream).await {
        Ok(Some(lite)) => {
            let base = format!("http://{}/v1", lite.addr);
            let lite_plain = samples(&client, &base, false, false, no_pace).await;
            let lite_ttft = samples(&client, &base, true, false, no_pace).await;
            match (lite_plain, lite_ttft) {
                (Ok(p), Ok(t)) => {
                    table.push(Row::value(
                        "  LiteLLM proxy 1.106.2, same upstream: added non-streamed (p50 · p99)",
                        added(&p, &direct),
                    ));
                    table.push(Row::value(
                        "  LiteLLM proxy 1.106.2: added time to first token (p50 · p99)",
                        added(&t, &direct_ttft),
                    ));
                }
                (Err(e), _) | (_, Err(e)) => table.push(Row::value(
                    "  LiteLLM proxy",
                    format!("skipped: it failed to answer: {e}"),
                )),
            }
        }
        Ok(None) => table.push(Row::value(
            "  LiteLLM proxy",
            "skipped: litellm is not installed (pip install 'litellm[proxy]==1.106.2' into /var/cache/sluice/litellm-venv)".into(),
        )),
        Err(e) => table.push(Row::value(
            "  LiteLLM proxy",
            format!("skipped: it did not start: {e}"),
        )),
    }
    bench.gateway.shutdown().await;
    fake.stop();
    Ok(())
}

fn added(with: &[Duration], without: &[Duration]) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    format!(
        "{:+.2} ms · {:+.2} ms",
        ms(percentile(with, 50.0)) - ms(percentile(without, 50.0)),
        ms(percentile(with, 99.0)) - ms(percentile(without, 99.0)),
    )
}

/// `SAMPLES` requests to `base` after five of warm-up: the whole answer, or (streamed) the time to
/// the first content delta. `redacted`: the answers must not hold the personal data of the reply.
async fn samples<F, Fut>(
    client: &Client,
    base: &str,
    stream: bool,
    redacted: bool,
    pace: F,
) -> anyhow::Result<Vec<Duration>>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let (text, model) = if stream {
        ("contact: how do I reach you?", "support-bot")
    } else {
        (QUESTION, "support-bot")
    };
    let body = serde_json::json!({
        "model": model, "stream": stream,
        "messages": [{"role": "user", "content": text}],
    })
    .to_string();
    let mut out = Vec::new();
    for i in 0..SAMPLES + 5 {
        pace().await;
        let req = hyper::Request::post(format!("{base}/chat/completions"))
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {LITELLM_KEY}"))
            .body(Full::new(Bytes::from(body.clone())))?;
        let began = Instant::now();
        let resp = client.request(req).await?;
        anyhow::ensure!(
            resp.status().is_success(),
            "{base} answered {}",
            resp.status()
        );
        let mut body = resp.into_body();
        let mut took = None;
        let mut seen = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                seen.extend_from_slice(&data);
                if stream && took.is_none() && has_content(&seen) {
                    took = Some(began.elapsed());
                }
            }
        }
        let took = took.unwrap_or_else(|| began.elapsed());
        anyhow::ensure!(
            !redacted || !String::from_utf8_lossy(&seen).contains("555-0123-4567"),
            "personal data came through the proxy"
        );
        if i >= 5 {
            out.push(took);
        }
    }
    Ok(out)
}

/// Whether the events received so far hold a non-empty content delta.
fn has_content(seen: &[u8]) -> bool {
    String::from_utf8_lossy(seen)
        .split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d.trim()).ok())
        .any(|v| {
            v.pointer("/choices/0/delta/content")
                .and_then(|c| c.as_str())
                .is_some_and(|c| !c.is_empty())
        })
}

/// LiteLLM's proxy, started on a free port in front of `upstream`.
struct LiteLlm {
    addr: std::net::SocketAddr,
    child: tokio::process::Child,
    _dir: tempfile::TempDir,
}

impl Drop for LiteLlm {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

async fn litellm(upstream: &str) -> anyhow::Result<Option<LiteLlm>> {
    let bin = std::env::var_os("SLUICE_LITELLM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/sluice/litellm-venv/bin/litellm"));
    if !bin.exists() {
        return Ok(None);
    }
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "model_list:\n  - model_name: support-bot\n    litellm_params: {{model: openai/support-bot, api_base: \"{upstream}\", api_key: fake}}\n"
        ),
    )?;
    let log = std::env::temp_dir().join("sluice-bench-litellm.log");
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = tokio::process::Command::new(&bin)
        .arg("--config")
        .arg(&config)
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--num_workers",
            "1",
        ])
        .env("LITELLM_LOG", "ERROR")
        .env("LITELLM_MASTER_KEY", LITELLM_KEY)
        .env("LITELLM_TELEMETRY", "False")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .kill_on_drop(true)
        .spawn()?;
    let mut lite = LiteLlm {
        addr: format!("127.0.0.1:{port}").parse()?,
        child,
        _dir: dir,
    };
    let began = Instant::now();
    loop {
        if tokio::net::TcpStream::connect(lite.addr).await.is_ok() {
            // Listening; give it a moment to finish its start-up.
            tokio::time::sleep(Duration::from_secs(2)).await;
            return Ok(Some(lite));
        }
        if let Ok(Some(status)) = lite.child.try_wait() {
            anyhow::bail!("litellm exited with {status} (its log: {})", log.display());
        }
        anyhow::ensure!(
            began.elapsed() < Duration::from_secs(180),
            "{} was not listening after 180 s (its log: {})",
            bin.display(),
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
