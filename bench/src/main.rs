//! `make bench`: every number an issue asks for, printed as a table beside baselines measured in the
//! same run on the same machine. `sluice-bench [SECTION...]` runs some sections only
//! (cells, cpu, cpu-model, run, stream, host_call, load, tenants, rollout, openai, mcp, kube; kube-recycle runs the kube section's
//! recycled-pod rows alone; kube-cluster measures a real cluster, `make bench-cluster`).

use anyhow::Context as _;
use sluice_gateway::{LocalOptions, RunningGateway, start_local};
use sluice_proto::{self as proto, gateway_client::GatewayClient};
use std::time::{Duration, Instant};

mod cells;
mod cluster;
mod cpu;
mod kube;
mod load;
mod mcp;
mod naive;
mod openai;
mod report;
mod rollout;
mod stream;

use report::{Row, Table, percentile};

/// The 3-hook chain of the Run benchmark: idempotent regex redactors, as a real input chain.
pub const HOOKS: [(&str, &str); 3] = [
    (
        "redact-phone",
        "import re\nP = re.compile(r'\\b\\d{3}-\\d{4}-\\d{4}\\b')\ndef execute(context, settings):\n    t = P.sub('[phone]', context['outgoing'])\n    return {'action': 'modify', 'outgoing': t} if t != context['outgoing'] else {'action': 'pass'}\n",
    ),
    (
        "redact-email",
        "import re\nE = re.compile(r'[\\w.+-]+@[\\w-]+\\.[\\w.]+')\ndef execute(context, settings):\n    t = E.sub('[email]', context['outgoing'])\n    return {'action': 'modify', 'outgoing': t} if t != context['outgoing'] else {'action': 'pass'}\n",
    ),
    (
        "block-injection",
        "def execute(context, settings):\n    if 'ignore previous instructions' in context['outgoing'].lower():\n        return {'action': 'block', 'message': 'no'}\n    return {'action': 'pass'}\n",
    ),
];

pub fn chain_yaml(name: &str, target: &str, tp: &str, pool: &str, extra: &str) -> String {
    let mut y = format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  target: {target}\n  triggerPoint: {tp}\n  timeoutMs: 5000\n  pool: {pool}\n  resources: {{cpu: '1', memory: 256Mi, pids: 64}}\n{extra}  hooks:\n"
    );
    for (i, (hname, code)) in HOOKS.iter().enumerate() {
        let action = if i == 2 { "block" } else { "modify" };
        y.push_str(&format!(
            "    - name: {hname}\n      action: {action}\n      code: |\n"
        ));
        for l in code.lines() {
            y.push_str(&format!("        {l}\n"));
        }
    }
    y
}

/// About 1 KiB of chat text with a phone number and an email address in it.
pub fn text_1k() -> String {
    let base = "Hello, I need help with my order. Call me at 010-1234-5678 or write to ann.lee@example.com. ";
    base.repeat(1024 / base.len() + 1)[..1024].to_string()
}

pub struct Bench {
    pub gateway: RunningGateway,
    pub client: GatewayClient<tonic::transport::Channel>,
    dir: tempfile::TempDir,
    _state: tempfile::TempDir,
}

impl Bench {
    pub async fn start(files: &[(&str, String)]) -> anyhow::Result<Self> {
        Self::start_with(files, |_| {}).await
    }

    pub async fn start_with(
        files: &[(&str, String)],
        tweak: impl FnOnce(&mut LocalOptions),
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text)?;
        }
        let state = tempfile::Builder::new()
            .prefix("sluice-bench")
            .tempdir_in("/tmp")?;
        let mut opts = LocalOptions::new(dir.path(), state.path());
        opts.limits.claim_timeout = Duration::from_secs(60);
        tweak(&mut opts);
        let gateway = start_local(opts).await?;
        gateway
            .engine
            .pools()
            .wait_warm(Duration::from_secs(120))
            .await;
        let client = GatewayClient::connect(format!("http://{}", gateway.addr)).await?;
        Ok(Self {
            gateway,
            client,
            dir,
            _state: state,
        })
    }

    /// Writes a file of the chain directory as an editor would (atomically).
    pub fn write(&self, name: &str, text: &str) -> anyhow::Result<()> {
        let tmp = self.dir.path().join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, self.dir.path().join(name))?;
        Ok(())
    }

    /// One run timed from the moment a warm sandbox is waiting for it (paced below the backfill
    /// rate, so every request finds one).
    pub async fn warm_run(
        &self,
        target: &str,
        text: &str,
    ) -> anyhow::Result<(Duration, proto::RunResponse)> {
        self.gateway
            .engine
            .pools()
            .wait_warm(Duration::from_secs(30))
            .await;
        let began = Instant::now();
        let r = self.run(target, text).await?;
        Ok((began.elapsed(), r))
    }

    pub async fn run(&self, target: &str, text: &str) -> anyhow::Result<proto::RunResponse> {
        let req = proto::RunRequest {
            namespace: "default".into(),
            target: target.into(),
            trigger_point: "input".into(),
            payload: Some(proto::run_request::Payload::Text(text.into())),
            ..Default::default()
        };
        Ok(self.client.clone().run(req).await?.into_inner())
    }
}

/// `n` local Recycle Runs with a warm sandbox waiting (the same chain and text as the Run rows).
pub async fn local_recycle_samples(n: usize) -> anyhow::Result<Vec<Duration>> {
    let bench = Bench::start(&[(
        "c.yaml",
        chain_yaml("bench", "bench", "input", "{warm: 2, max: 8}", ""),
    )])
    .await?;
    let text = text_1k();
    bench.run("bench", &text).await?;
    let mut samples = Vec::new();
    for _ in 0..n {
        samples.push(bench.warm_run("bench", &text).await?.0);
    }
    bench.gateway.shutdown().await;
    Ok(samples)
}

/// Run latency with a warm sandbox waiting, beside the in-process floor and a fresh runsc per call.
async fn run_latency(table: &mut Table) -> anyhow::Result<()> {
    let bench = Bench::start(&[(
        "c.yaml",
        chain_yaml("bench", "bench", "input", "{warm: 2, max: 8}", ""),
    )])
    .await?;
    let text = text_1k();
    // Warm-up: first runs pay for lazy connections.
    for _ in 0..3 {
        bench.run("bench", &text).await?;
        bench
            .gateway
            .engine
            .pools()
            .wait_warm(Duration::from_secs(30))
            .await;
    }
    let mut samples = Vec::new();
    for _ in 0..60 {
        let (took, r) = bench.warm_run("bench", &text).await?;
        samples.push(took);
        anyhow::ensure!(
            r.hooks.len() == 3,
            "a benchmark run did not run the chain: {r:?}"
        );
    }
    bench.gateway.shutdown().await;
    let floor = naive::in_process_floor(&text, 2000).await?;
    let fresh = naive::fresh_runsc_per_call(&text, 15).await?;
    let p50 = percentile(&samples, 50.0);
    table.push(
        Row::latency(
            "Run via gRPC, warm sandbox (3 hooks, 1 KiB, Recycle)",
            &samples,
        )
        .target("p50 ≤ 3 ms"),
    );
    table.push(Row::latency(
        "  baseline: same hooks in one Python process",
        &floor,
    ));
    table.push(Row::latency(
        "  baseline: fresh `runsc run` per call",
        &fresh,
    ));
    let speedup = percentile(&fresh, 50.0).as_secs_f64() / p50.as_secs_f64();
    table.push(
        Row::value(
            "  speed-up over fresh runsc per call (p50)",
            format!("{speedup:.0}×"),
        )
        .target("≥ 20×"),
    );
    Ok(())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let wanted: Vec<String> = std::env::args().skip(1).collect();
    let on = |s: &str| wanted.is_empty() || wanted.iter().any(|w| w == s);
    let mut table = Table::default();
    println!(
        "sluice bench on {} cores; every baseline is measured in this run\n",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    if wanted.iter().any(|w| w == "breakdown") {
        return naive::breakdown(&text_1k()).await;
    }
    if on("cells") {
        cells::bench(&mut table).await.context("cells")?;
    } else if wanted.iter().any(|w| w == "warm") {
        // The cells section's warm-Run rows alone.
        cells::warm_runs(&mut table).await.context("warm Run")?;
    } else if wanted.iter().any(|w| w == "cpu") {
        // The cells section's CPU-per-hook rows alone.
        cells::cpu_per_hook(&mut table)
            .await
            .context("CPU per hook")?;
    }
    if on("cpu-model") {
        cpu::bench(&mut table).await.context("cpu model")?;
    }
    if on("run") {
        run_latency(&mut table).await.context("run latency")?;
    }
    if on("stream") {
        stream::bench(&mut table).await.context("stream")?;
    }
    if on("load") {
        load::bench(&mut table).await.context("load")?;
    }
    if on("tenants") {
        load::two_tenants(&mut table).await.context("two tenants")?;
    }
    if on("rollout") {
        rollout::bench(&mut table).await.context("rollout")?;
    }
    if on("openai") {
        openai::bench(&mut table).await.context("openai proxy")?;
    }
    if on("mcp") {
        mcp::bench(&mut table).await.context("mcp proxy")?;
    }
    if on("host_call") {
        stream::host_call(&mut table).await.context("host_call")?;
    }
    // Only the recycled-pod rows of the kube section, when asked by name.
    if wanted.iter().any(|w| w == "kube-recycle") {
        kube::recycled(&mut table).await.context("kube-recycle")?;
    }
    if on("kube") {
        kube::bench(&mut table).await.context("kube")?;
    }
    // A real cluster only when asked by name (`make bench-cluster`).
    if wanted.iter().any(|w| w == "kube-cluster") {
        cluster::bench(&mut table).await.context("kube-cluster")?;
    }
    table.print();
    Ok(())
}
