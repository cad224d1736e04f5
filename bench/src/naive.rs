//! Baselines measured in the same run: the hooks in one Python process (the floor), a fresh
//! `runsc run` per call (the naive design), and how many fresh sandboxes this machine boots per second.

use crate::HOOKS;
use crate::cells::no_run;
use serde_json::{Value, json};
use sluice_engine::Chain;
use sluice_engine::Limits;
use sluice_engine::{NoHostCalls, SupervisorConn};
use sluice_engine::{SandboxBackend, SandboxSpec};
use sluice_sandbox_local::{LocalBackend, LocalConfig};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) async fn in_process_floor(text: &str, n: usize) -> anyhow::Result<Vec<Duration>> {
    hooks_in_process(&HOOKS, text, n).await
}

/// The floor of a chain: its hooks called one after another in one Python process, `n` times.
pub(crate) async fn hooks_in_process(
    hooks: &[(&str, &str)],
    text: &str,
    n: usize,
) -> anyhow::Result<Vec<Duration>> {
    let script = format!(
        r#"
import json, time
hooks = {hooks}
fns = []
for name, code in hooks:
    ns = {{}}
    exec(compile(code, name, 'exec'), ns)
    fns.append(ns['execute'])
text = {text}
out = []
for _ in range({n}):
    t0 = time.perf_counter_ns()
    payload = text
    for f in fns:
        r = f({{'outgoing': payload, 'state': None}}, {{}})
        if r['action'] == 'modify':
            payload = r['outgoing']
    out.append(time.perf_counter_ns() - t0)
print(json.dumps(out))
"#,
        hooks = serde_json::to_string(
            &hooks
                .iter()
                .map(|(n, c)| vec![n.to_string(), c.to_string()])
                .collect::<Vec<_>>()
        )?,
        text = serde_json::to_string(text)?,
    );
    let out = tokio::process::Command::new("python3")
        .args(["-c", &script])
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "python floor failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ns: Vec<u64> = serde_json::from_slice(&out.stdout)?;
    Ok(ns.into_iter().map(Duration::from_nanos).collect())
}

pub(crate) fn bench_chain() -> anyhow::Result<Chain> {
    let yaml = crate::chain_yaml("naive", "naive", "input", "{warm: 0, max: 1}", "");
    let hc: sluice_crds::HookChain = hookchain_from(&yaml)?;
    let namespace = sluice_crds::manifest::namespace_of(&hc.metadata);
    let name = hc.metadata.name.clone().unwrap_or_default();
    Ok(Chain::new(&namespace, &name, &hc.spec)?)
}

/// A chain from one HookChain document.
pub(crate) fn chain_from_yaml(yaml: &str) -> anyhow::Result<Chain> {
    let hc: sluice_crds::HookChain = hookchain_from(yaml)?;
    let namespace = sluice_crds::manifest::namespace_of(&hc.metadata);
    let name = hc.metadata.name.clone().unwrap_or_default();
    Ok(Chain::new(&namespace, &name, &hc.spec)?)
}

fn hookchain_from(y: &str) -> anyhow::Result<sluice_crds::HookChain> {
    let parsed = sluice_crds::manifest::parse(std::path::Path::new("bench.yaml"), y);
    match parsed.into_iter().next() {
        Some(Ok(located)) => match located.value {
            sluice_crds::manifest::Object::HookChain(hc) => Ok(*hc),
            _ => anyhow::bail!("not a chain"),
        },
        Some(Err(e)) => anyhow::bail!("{e}"),
        None => anyhow::bail!("empty"),
    }
}

async fn backend() -> anyhow::Result<(LocalBackend, tempfile::TempDir)> {
    let state = tempfile::Builder::new()
        .prefix("sluice-naive")
        .tempdir_in("/tmp")?;
    let b = LocalBackend::new(LocalConfig::new(state.path())).await?;
    Ok((b, state))
}

/// One complete call the naive way: boot a sandbox, load the chain, run it. Teardown not counted.
async fn one_fresh_call(
    b: &LocalBackend,
    chain: &Arc<Chain>,
    text: &str,
) -> anyhow::Result<(Duration, SupervisorConn)> {
    let limits = Limits::default();
    let began = Instant::now();
    let sandbox = b.start(&chain.sandbox).await?;
    let mut conn = SupervisorConn::new(sandbox, limits.max_line());
    conn.wait_ready(Duration::from_secs(30)).await?;
    conn.prepare(chain, &limits.wire(), Duration::from_secs(30))
        .await?;
    let state = vec![Value::Null; 3];
    let report = conn
        .walk(
            0,
            &json!(text),
            &state,
            &no_run(),
            Duration::from_secs(10),
            &NoHostCalls,
        )
        .await;
    anyhow::ensure!(
        report.hooks.len() == 3,
        "naive call failed: {:?}",
        report.failure
    );
    Ok((began.elapsed(), conn))
}

pub(crate) async fn fresh_runsc_per_call(text: &str, n: usize) -> anyhow::Result<Vec<Duration>> {
    let (b, _state) = backend().await?;
    let chain = Arc::new(bench_chain()?);
    let mut out = Vec::new();
    for _ in 0..n {
        let (d, conn) = one_fresh_call(&b, &chain, text).await?;
        out.push(d);
        conn.close().await;
    }
    Ok(out)
}

/// Fresh sandboxes booted to ready (and torn down) per second, as many at once as there are cores.
pub(crate) async fn boot_ceiling(window: Duration) -> anyhow::Result<f64> {
    let (b, _state) = backend().await?;
    let spec = SandboxSpec {
        namespace: "bench".into(),
        chain: "boot-ceiling".into(),
        cpu: "1".into(),
        cpu_limit: None,
        memory: "256Mi".into(),
        pids: 64,
    };
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    let began = Instant::now();
    let b = &b;
    let spec = &spec;
    let counts = futures::future::join_all((0..workers).map(|_| async move {
        let mut n = 0u64;
        while began.elapsed() < window {
            let sandbox = b.start(spec).await?;
            let mut conn = SupervisorConn::new(sandbox, 1 << 20);
            conn.wait_ready(Duration::from_secs(30)).await?;
            conn.close().await;
            n += 1;
        }
        anyhow::Ok(n)
    }))
    .await;
    let total: u64 = counts
        .into_iter()
        .collect::<anyhow::Result<Vec<u64>>>()?
        .into_iter()
        .sum();
    Ok(total as f64 / began.elapsed().as_secs_f64())
}

/// Where the time of one warm call goes (printed by `sluice-bench breakdown`).
pub(crate) async fn breakdown(text: &str) -> anyhow::Result<()> {
    let (b, _state) = backend().await?;
    let chain = Arc::new(bench_chain()?);
    let limits = Limits::default();
    for _ in 0..5 {
        let t0 = Instant::now();
        let sandbox = b.start(&chain.sandbox).await?;
        let mut conn = SupervisorConn::new(sandbox, limits.max_line());
        conn.wait_ready(Duration::from_secs(30)).await?;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let t1 = Instant::now();
        conn.prepare(&chain, &limits.wire(), Duration::from_secs(10))
            .await?;
        let t2 = Instant::now();
        let state = vec![Value::Null; 3];
        conn.walk(
            0,
            &json!(text),
            &state,
            &no_run(),
            Duration::from_secs(10),
            &NoHostCalls,
        )
        .await;
        let t3 = Instant::now();
        conn.walk(
            0,
            &json!(text),
            &state,
            &no_run(),
            Duration::from_secs(10),
            &NoHostCalls,
        )
        .await;
        let t4 = Instant::now();
        conn.end(Duration::from_secs(10)).await?;
        conn.prepare(&chain, &limits.wire(), Duration::from_secs(10))
            .await?;
        let t5 = Instant::now();
        conn.close().await;
        let t6 = Instant::now();
        println!(
            "boot {:?} cell {:?} walk1 {:?} walk2 {:?} end+cell {:?} close {:?}",
            t1 - t0,
            t2 - t1,
            t3 - t2,
            t4 - t3,
            t5 - t4,
            t6 - t5
        );
    }
    Ok(())
}

/// The stream benchmark's hook run on one batch in one Python process: the floor of a flush.
pub(crate) async fn stream_flush_floor(batch: &str, n: usize) -> anyhow::Result<Vec<Duration>> {
    hooks_in_process(&[("redact", crate::stream::REDACTOR)], batch, n).await
}
