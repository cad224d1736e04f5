//! The `cpu` section: what the sandbox CPU model costs a trigger point. The same 3-hook chain with
//! the chart's default resources (`cpu: 250m`, a request) under three platform limits: the old model
//! (the limit is the chain's 250m), the default (one core) and none; each paced (a warm sandbox
//! waiting) and back to back (one client, the next run as soon as the answer is in), with the CFS
//! periods its sandboxes were throttled in per trigger point (their cgroups' `cpu.stat`, through
//! the gateway's metric).

use crate::report::{Row, Table, percentile};
use crate::{Bench, chain_yaml, text_1k};
use sluice_crds::cpu::SandboxCpuLimit;
use std::time::{Duration, Instant};

/// The bench chain with the chart's default resources (no `resources:` at all).
pub(crate) fn default_resources_chain(name: &str, pool: &str) -> String {
    chain_yaml(name, name, "input", pool, "")
        .replace("  resources: {cpu: '1', memory: 256Mi, pids: 64}\n", "")
}

/// Latencies and throttled periods per trigger point of `n` runs.
pub(crate) struct Measured {
    pub paced: Vec<Duration>,
    pub back_to_back: Vec<Duration>,
    pub throttled_per_run: f64,
}

fn throttled_periods(bench: &Bench) -> u64 {
    bench
        .gateway
        .engine
        .metrics()
        .sandbox_cpu_throttled_periods
        .with_label_values(&["default", "cpu", "input"])
        .get()
}

/// `n` paced and `n` back-to-back runs of the default-resources chain under `limit`.
pub(crate) async fn local(limit: SandboxCpuLimit, n: usize) -> anyhow::Result<Measured> {
    let bench = Bench::start_with(
        &[(
            "c.yaml",
            default_resources_chain("cpu", "{warm: 2, max: 8}"),
        )],
        |opts| opts.sandbox.cpu_limit = limit,
    )
    .await?;
    let text = text_1k();
    for _ in 0..3 {
        bench.warm_run("cpu", &text).await?;
    }
    let before = throttled_periods(&bench);
    let mut paced = Vec::with_capacity(n);
    for _ in 0..n {
        paced.push(bench.warm_run("cpu", &text).await?.0);
    }
    let mut back_to_back = Vec::with_capacity(n);
    for _ in 0..n {
        let began = Instant::now();
        let r = bench.run("cpu", &text).await?;
        anyhow::ensure!(r.hooks.len() == 3, "a run did not run the chain: {r:?}");
        back_to_back.push(began.elapsed());
    }
    // The last trigger points' sandboxes are counted when they are handed back.
    bench
        .gateway
        .engine
        .pools()
        .wait_warm(Duration::from_secs(30))
        .await;
    let throttled = throttled_periods(&bench).saturating_sub(before);
    bench.gateway.shutdown().await;
    Ok(Measured {
        paced,
        back_to_back,
        throttled_per_run: throttled as f64 / (2 * n) as f64,
    })
}

pub(crate) async fn bench(table: &mut Table) -> anyhow::Result<()> {
    let n = 100;
    let cases = [
        (
            "old model: limit = the chain's 250m",
            SandboxCpuLimit(Some(250)),
        ),
        (
            "default: 250m requested, limit 1 core",
            SandboxCpuLimit::default(),
        ),
        ("no CPU limit", SandboxCpuLimit(None)),
    ];
    for (name, limit) in cases {
        let m = local(limit, n).await?;
        let target = if limit == SandboxCpuLimit::default() {
            "p99 ≤ 20 ms"
        } else {
            "baseline"
        };
        table.push(
            Row::latency(
                &format!("Run, chart's default resources, paced ({name})"),
                &m.paced,
            )
            .target(target),
        );
        table.push(Row::latency(
            &format!("  back to back, one client ({name})"),
            &m.back_to_back,
        ));
        table.push(Row::value(
            &format!("  throttled CFS periods per trigger point ({name})"),
            format!(
                "{:.2} (p50 paced {:?})",
                m.throttled_per_run,
                percentile(&m.paced, 50.0)
            ),
        ));
    }
    Ok(())
}
