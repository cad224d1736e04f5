//! Stream and host_call benchmarks.

use crate::Bench;
use crate::report::{Row, Table, percentile};
use sluice_proto::{self as proto, stream_request::Msg as In, stream_response::Msg as Out};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

pub(crate) const REDACTOR: &str = "import re\nP = re.compile(r'\\b\\d{2,4}-\\d{3,4}-\\d{4}\\b')\ndef execute(context, settings):\n    t = P.sub('[phone]', context['outgoing'])\n    return {'action': 'modify', 'outgoing': t} if t != context['outgoing'] else {'action': 'pass'}\n";

fn stream_chain(pool: &str) -> String {
    let mut y = format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {{name: out, namespace: default}}\nspec:\n  target: bot\n  triggerPoint: output\n  timeoutMs: 5000\n  streaming: {{flushChars: 64, lookbackChars: 48}}\n  pool: {pool}\n  resources: {{cpu: '1', memory: 256Mi}}\n  hooks:\n    - name: redact\n      action: modify\n      code: |\n"
    );
    for l in REDACTOR.lines() {
        y.push_str(&format!("        {l}\n"));
    }
    y
}

fn open() -> proto::StreamRequest {
    proto::StreamRequest {
        msg: Some(In::Open(proto::StreamOpen {
            namespace: "default".into(),
            target: "bot".into(),
            trigger_point: "output".into(),
            ..Default::default()
        })),
    }
}

fn chunk(s: String) -> proto::StreamRequest {
    proto::StreamRequest {
        msg: Some(In::Chunk(s)),
    }
}

fn finish() -> proto::StreamRequest {
    proto::StreamRequest {
        msg: Some(In::Finish(proto::StreamFinish {})),
    }
}

/// A reply of `n` characters: chat text with a phone number every few lines.
fn reply(n: usize) -> String {
    let base =
        "The order ships Monday; for changes call 010-1234-5678 and quote your order number. ";
    base.repeat(n / base.len() + 1)[..n].to_string()
}

/// Streams `text` in chunks of `size` characters as fast as the client can; returns (chars/s, committed chars).
async fn blast(bench: &Bench, text: &str, size: usize) -> anyhow::Result<(f64, usize)> {
    let chars: Vec<char> = text.chars().collect();
    let mut msgs = vec![open()];
    msgs.extend(chars.chunks(size).map(|c| chunk(c.iter().collect())));
    msgs.push(finish());
    let began = Instant::now();
    let mut out = bench
        .client
        .clone()
        .stream(futures::stream::iter(msgs))
        .await?
        .into_inner();
    let mut committed = 0;
    let mut got_final = false;
    while let Some(m) = out.message().await? {
        match m.msg {
            Some(Out::Commit(c)) => committed += c.chars().count(),
            Some(Out::Final(_)) => got_final = true,
            _ => {}
        }
    }
    anyhow::ensure!(got_final, "stream ended without a final");
    Ok((
        chars.len() as f64 / began.elapsed().as_secs_f64(),
        committed,
    ))
}

async fn expect_commit(out: &mut tonic::Streaming<proto::StreamResponse>) -> anyhow::Result<()> {
    match out.message().await?.and_then(|m| m.msg) {
        Some(Out::Commit(_)) => Ok(()),
        other => anyhow::bail!("expected a commit, got {other:?}"),
    }
}

pub(crate) async fn bench(table: &mut Table) -> anyhow::Result<()> {
    let bench = Bench::start(&[("out.yaml", stream_chain("{warm: 4, max: 60}"))]).await?;

    // Time to first commit, and per-flush latency: send one flush worth, wait for its commit.
    let mut first = Vec::new();
    let mut flushes = Vec::new();
    for _ in 0..20 {
        bench
            .gateway
            .engine
            .pools()
            .wait_warm(Duration::from_secs(30))
            .await;
        let (tx, rx) = mpsc::channel(4);
        let began = Instant::now();
        tx.send(open()).await?;
        tx.send(chunk(reply(64))).await?;
        let mut out = bench
            .client
            .clone()
            .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        expect_commit(&mut out).await?;
        first.push(began.elapsed());
        for _ in 0..10 {
            let t = Instant::now();
            tx.send(chunk(reply(64))).await?;
            expect_commit(&mut out).await?;
            flushes.push(t.elapsed());
        }
        tx.send(finish()).await?;
        while out.message().await?.is_some() {}
    }
    let floor = crate::naive::stream_flush_floor(&reply(64 + 48), 2000).await?;
    table.push(Row::latency(
        "Stream: time to first commit (open + 64 chars)",
        &first,
    ));
    table.push(Row::latency(
        "Stream: per-flush round trip (64 chars, 1 hook)",
        &flushes,
    ));
    table.push(Row::latency(
        "  baseline: the hook on the same batch in one Python process",
        &floor,
    ));
    let added = percentile(&flushes, 50.0).saturating_sub(percentile(&floor, 50.0));
    table.push(
        Row::value(
            "  added by the gateway per flush (p50)",
            format!("{:.2} ms", added.as_secs_f64() * 1e3),
        )
        .target("≤ 1 ms"),
    );

    let paced = 64.0 / percentile(&flushes, 50.0).as_secs_f64();
    table.push(
        Row::value(
            "Stream: chars/s, 1 stream, one flush at a time (client awaits each commit)",
            format!("{paced:.0}"),
        )
        .target("≥ 100,000"),
    );

    // Throughput of one stream and of 50 at once.
    bench
        .gateway
        .engine
        .pools()
        .wait_warm(Duration::from_secs(30))
        .await;
    let (rate, _) = blast(&bench, &reply(200_000), 16).await?;
    table.push(
        Row::value(
            "Stream: chars/s, 1 stream, client ahead (200k chars, 16-char chunks, coalesced)",
            format!("{rate:.0}"),
        )
        .target("≥ 100,000"),
    );
    bench
        .gateway
        .engine
        .pools()
        .wait_warm(Duration::from_secs(60))
        .await;
    let began = Instant::now();
    let text = reply(20_000);
    let runs = futures::future::join_all((0..50).map(|_| blast(&bench, &text, 16))).await;
    let elapsed = began.elapsed().as_secs_f64();
    let rates: Vec<f64> = runs
        .into_iter()
        .map(|r| r.map(|x| x.0))
        .collect::<anyhow::Result<_>>()?;
    let mean = rates.iter().sum::<f64>() / rates.len() as f64;
    table.push(Row::value(
        "Stream: chars/s per stream, 50 concurrent (20k chars each)",
        format!("{mean:.0} (aggregate {:.0})", 50.0 * 20_000.0 / elapsed),
    ));
    table.push(Row::value(
        "  visible hold-back",
        "lookbackChars = 48 chars (NeMo Guardrails: 200 tokens)".into(),
    ));
    bench.gateway.shutdown().await;
    Ok(())
}

/// host_call round trip inside a running hook, built-in echo: a hook's 200 calls, timed by the
/// supervisor around the hook (a hook's own clocks stand still, docs/hooks.md), per call.
pub(crate) async fn host_call(table: &mut Table) -> anyhow::Result<()> {
    let chain = "apiVersion: sluice.dev/v1alpha1\nkind: Capability\nmetadata: {name: echo, namespace: default}\nspec: {endpoint: {builtin: echo}}\n---\napiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: hc, namespace: default}\nspec:\n  target: caller\n  triggerPoint: input\n  timeoutMs: 10000\n  pool: {warm: 1, max: 4}\n  resources: {cpu: '1', memory: 256Mi}\n  hooks:\n    - name: caller\n      action: detect\n      capabilities: [echo]\n      code: |\n        def execute(context, settings):\n            for i in range(200):\n                context.host_call('echo', {'i': i})\n            return {'action': 'detect', 'findings': {'calls': 200}}\n".to_string();
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("c.yaml"), chain)?;
    let state = tempfile::Builder::new()
        .prefix("sluice-bench")
        .tempdir_in("/tmp")?;
    let mut opts = sluice_gateway::LocalOptions::new(dir.path(), state.path());
    opts.limits.host_calls_per_run = 1000;
    let gateway = sluice_gateway::start_local(opts).await?;
    gateway
        .engine
        .pools()
        .wait_warm(Duration::from_secs(60))
        .await;
    let mut client =
        proto::gateway_client::GatewayClient::connect(format!("http://{}", gateway.addr)).await?;
    let mut samples = Vec::new();
    for _ in 0..10 {
        gateway
            .engine
            .pools()
            .wait_warm(Duration::from_secs(60))
            .await;
        let req = proto::RunRequest {
            namespace: "default".into(),
            target: "caller".into(),
            trigger_point: "input".into(),
            payload: Some(proto::run_request::Payload::Text("x".into())),
            ..Default::default()
        };
        let r = client.run(req).await?.into_inner();
        let hook = r
            .hooks
            .first()
            .filter(|h| h.error.is_empty())
            .ok_or_else(|| anyhow::anyhow!("the hook did not run: {r:?}"))?;
        samples.push(Duration::from_micros(hook.latency_us) / 200);
    }
    gateway.shutdown().await;
    table.push(
        Row::latency(
            "host_call round trip in a hook (builtin echo, mean of 200 per run)",
            &samples,
        )
        .target("p50 ≤ 0.5 ms"),
    );
    Ok(())
}
