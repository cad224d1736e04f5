//! Load and soak: the highest sustainable rate with its latency, errors, sandbox churn and CPU per
//! run; 1,000 sequential runs; leaks (sandboxes, descriptors, memory) measured before and after; and
//! what per-hook process isolation costs against the same work in one inline hook.

use crate::report::{Row, Table, percentile};
use crate::{Bench, HOOKS, chain_yaml, text_1k};
use std::time::{Duration, Instant};

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Busy CPU time of the whole machine (all processes: gateway, runsc, sandboxes), in seconds.
fn machine_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal: busy = all but idle and iowait.
    let busy: f64 = fields
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, v)| v)
        .sum();
    busy / 100.0
}

/// One hook doing the work of the three HOOKS, so it runs inline (no worker processes). A hook may
/// return only its declared action (or pass), so this one, declared `modify`, replaces an injection
/// with a marker where the chain's third hook blocks: the same work, one action.
fn combined_chain() -> String {
    let code = "import re\nP = re.compile(r'\\b\\d{3}-\\d{4}-\\d{4}\\b')\nE = re.compile(r'[\\w.+-]+@[\\w-]+\\.[\\w.]+')\ndef execute(context, settings):\n    t = E.sub('[email]', P.sub('[phone]', context['outgoing']))\n    if 'ignore previous instructions' in t.lower():\n        return {'action': 'modify', 'outgoing': '[blocked]'}\n    return {'action': 'modify', 'outgoing': t} if t != context['outgoing'] else {'action': 'pass'}\n";
    let mut y = String::from(
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: one, namespace: default}\nspec:\n  target: one\n  triggerPoint: input\n  timeoutMs: 5000\n  pool: {warm: 2, max: 8}\n  resources: {cpu: '1', memory: 256Mi, pids: 64}\n  hooks:\n    - name: all-in-one\n      action: modify\n      code: |\n",
    );
    for l in code.lines() {
        y.push_str(&format!("        {l}\n"));
    }
    y
}

pub(crate) async fn bench(table: &mut Table) -> anyhow::Result<()> {
    let _ = HOOKS;
    let bench = Bench::start(&[
        (
            "c.yaml",
            chain_yaml("bench", "bench", "input", "{warm: 4, max: 16}", ""),
        ),
        ("one.yaml", combined_chain()),
    ])
    .await?;
    let text = text_1k();

    // What isolation costs: three isolated hooks against the same work inline in one.
    let mut isolated = Vec::new();
    let mut inline = Vec::new();
    for _ in 0..30 {
        isolated.push(bench.warm_run("bench", &text).await?.0);
        inline.push(bench.warm_run("one", &text).await?.0);
    }
    table.push(Row::latency(
        "Isolation: 3 hooks, one process each (warm)",
        &isolated,
    ));
    table.push(Row::latency(
        "  baseline: the same work as 1 hook, inline",
        &inline,
    ));
    table.push(Row::value(
        "  cost of per-hook processes (p50)",
        format!(
            "{:.2} ms",
            (percentile(&isolated, 50.0).as_secs_f64() - percentile(&inline, 50.0).as_secs_f64())
                * 1e3
        ),
    ));

    // Leak baseline after warm-up.
    bench
        .gateway
        .engine
        .pools()
        .wait_warm(Duration::from_secs(30))
        .await;
    let (fds0, rss0) = (fds(), rss_kib());

    // 1,000 sequential runs.
    let began = Instant::now();
    let mut errors = 0;
    for _ in 0..1000 {
        if bench
            .run("bench", &text)
            .await
            .map(|r| r.hooks.len() != 3)
            .unwrap_or(true)
        {
            errors += 1;
        }
    }
    let seq_rate = 1000.0 / began.elapsed().as_secs_f64();
    table.push(Row::value(
        "Soak: 1,000 sequential runs",
        format!("{seq_rate:.1} runs/s, {errors} errors"),
    ));

    // 60 s at the highest sustainable rate: 8 clients, each as fast as answers come.
    let started0 = bench.gateway.engine.metrics().boots();
    let cpu0 = machine_cpu_seconds();
    let began = Instant::now();
    let window = Duration::from_secs(60);
    let clients = (0..8).map(|_| {
        let (bench, text) = (&bench, &text);
        async move {
            let mut lat = Vec::new();
            let mut errors = 0u64;
            while began.elapsed() < window {
                let t = Instant::now();
                match bench.run("bench", text).await {
                    Ok(r) if r.hooks.len() == 3 => lat.push(t.elapsed()),
                    _ => errors += 1,
                }
            }
            (lat, errors)
        }
    });
    let results = futures::future::join_all(clients).await;
    let elapsed = began.elapsed().as_secs_f64();
    let cpu = machine_cpu_seconds() - cpu0;
    let started = bench.gateway.engine.metrics().boots() - started0;
    let lat: Vec<Duration> = results.iter().flat_map(|r| r.0.clone()).collect();
    let errors: u64 = results.iter().map(|r| r.1).sum();
    let runs = lat.len() as f64;
    table.push(
        Row::value(
            "Load: 60 s, 8 clients",
            format!("{:.1} runs/s, {errors} errors", runs / elapsed),
        )
        .target("errors = 0"),
    );
    table.push(Row::latency("  latency under load", &lat));
    table.push(Row::value(
        "  sandboxes created/s",
        format!("{:.1}", started as f64 / elapsed),
    ));
    table.push(Row::value(
        "  machine CPU per run (gateway + runsc + sandboxes)",
        format!("{:.0} ms", 1000.0 * cpu / runs.max(1.0)),
    ));

    // After: let teardown finish, then compare.
    bench
        .gateway
        .engine
        .pools()
        .wait_warm(Duration::from_secs(60))
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let live = bench.gateway.backend().live().await.len();
    let warm: usize = bench
        .gateway
        .engine
        .pools()
        .sizes()
        .iter()
        .map(|s| s.1)
        .sum();
    let (fds1, rss1) = (fds(), rss_kib());
    table.push(Row::value(
        "Leaks after soak + load",
        format!(
            "sandboxes {live} live = {warm} warm; fds {fds0} → {fds1}; gateway RSS {} → {} MiB",
            rss0 / 1024,
            rss1 / 1024
        ),
    ));
    bench.gateway.shutdown().await;
    Ok(())
}

/// The honest tenant's run latency alone, then beside a hostile tenant (`sluice_e2e::tenants`: slow
/// module code, slow hooks, printing, clients that disconnect), on the same gateway setup. Target:
/// p99 within 2x of alone, and no failed honest run.
pub(crate) async fn two_tenants(table: &mut Table) -> anyhow::Result<()> {
    use sluice_e2e::tenants;
    const RUNS: usize = 200;
    let measure = |bench: &Bench| {
        let client = bench.client.clone();
        async move {
            let (mut samples, mut failed) = (Vec::with_capacity(RUNS), 0);
            for _ in 0..RUNS {
                let began = Instant::now();
                match tenants::honest_run(&client).await {
                    Ok(()) => samples.push(began.elapsed()),
                    Err(_) => failed += 1,
                }
            }
            (samples, failed)
        }
    };
    let alone = Bench::start(&tenants::files(false)).await?;
    let (solo, solo_failed) = measure(&alone).await;
    alone.gateway.shutdown().await;

    let shared = Bench::start(&tenants::files(true)).await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let hostile = tokio::spawn(tenants::hostile_load(shared.client.clone(), 4, stopped));
    let (beside, beside_failed) = measure(&shared).await;
    stop.send_replace(true);
    let _ = hostile.await;
    shared.gateway.shutdown().await;

    table.push(Row::latency(
        &format!("Two tenants: honest runs alone ({solo_failed} failed)"),
        &solo,
    ));
    table.push(Row::latency(
        &format!("  honest runs beside a hostile tenant ({beside_failed} failed)"),
        &beside,
    ));
    let ratio = percentile(&beside, 99.0).as_secs_f64() / percentile(&solo, 99.0).as_secs_f64();
    table.push(
        Row::value("  p99 beside / p99 alone", format!("{ratio:.2}x"))
            .target("within 2x, none failed"),
    );
    Ok(())
}
