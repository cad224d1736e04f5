//! Section rollout: what a shadow version costs the live path. The same 3-hook chain, one client
//! calling back to back with a short pause (as an application's turn-taking would), first with no
//! rollout, then with a candidate in shadow beside it, alternating in blocks so that the machine's
//! drift hits both alike.

use crate::report::{Row, Table, percentile};
use crate::{Bench, chain_yaml, text_1k};
use std::time::{Duration, Instant};

/// Runs per block, blocks per mode.
const BLOCK: usize = 50;
const BLOCKS: usize = 4;
/// Pause between one answer and the next request.
const PAUSE: Duration = Duration::from_millis(20);

fn live() -> String {
    chain_yaml("bench", "bench", "input", "{warm: 3, max: 8}", "")
}

/// The same chain with the injection guard's check changed: a new revision, in shadow.
fn shadowed() -> String {
    live()
        .replace(
            "'ignore previous instructions'",
            "'ignore all previous instructions'",
        )
        .replace("  hooks:\n", "  rollout: {strategy: Shadow}\n  hooks:\n")
}

fn rollouts(bench: &Bench) -> serde_json::Value {
    serde_json::to_value(bench.gateway.engine.rollouts()).unwrap_or_default()
}

async fn phase(bench: &Bench, want: &str) -> anyhow::Result<()> {
    let until = Instant::now() + Duration::from_secs(30);
    while rollouts(bench)[0]["phase"] != want {
        anyhow::ensure!(Instant::now() < until, "the chain never reached {want}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

async fn block(bench: &Bench, text: &str, into: &mut Vec<Duration>) -> anyhow::Result<()> {
    for _ in 0..BLOCK {
        tokio::time::sleep(PAUSE).await;
        let began = Instant::now();
        let r = bench.run("bench", text).await?;
        into.push(began.elapsed());
        anyhow::ensure!(
            r.hooks.len() == 3,
            "a benchmark run did not run the chain: {r:?}"
        );
    }
    Ok(())
}

pub(crate) async fn bench(table: &mut Table) -> anyhow::Result<()> {
    let bench = Bench::start(&[("c.yaml", live())]).await?;
    let text = text_1k();
    for _ in 0..5 {
        bench.run("bench", &text).await?;
    }
    let (mut none, mut shadow) = (Vec::new(), Vec::new());
    let (mut runs, mut dropped) = (0, 0);
    for _ in 0..BLOCKS {
        bench.write("c.yaml", &live())?;
        phase(&bench, "RolledOut").await?;
        block(&bench, &text, &mut none).await?;
        bench.write("c.yaml", &shadowed())?;
        phase(&bench, "Shadowing").await?;
        block(&bench, &text, &mut shadow).await?;
        // The block's last shadow runs finish before its counts are read (each block's candidate
        // starts its counts afresh).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let status = rollouts(&bench);
        runs += status[0]["shadow"]["runs"].as_u64().unwrap_or(0);
        dropped += status[0]["shadow"]["dropped"].as_u64().unwrap_or(0);
    }
    bench.gateway.shutdown().await;
    let (p50_none, p50_shadow) = (percentile(&none, 50.0), percentile(&shadow, 50.0));
    table.push(Row::latency(
        "Run, no rollout (3 hooks, 1 KiB, Recycle, 1 client, 20 ms pauses)",
        &none,
    ));
    table.push(Row::latency(
        "Run, a shadow version active (same client, alternating blocks)",
        &shadow,
    ));
    let added = (p50_shadow.as_secs_f64() / p50_none.as_secs_f64() - 1.0) * 100.0;
    table.push(
        Row::value(
            "  added p50 on the live path with a shadow",
            format!("{added:+.1} %"),
        )
        .target("≤ 10 %"),
    );
    table.push(Row::value(
        "  shadow runs compared / dropped (no budget or no free sandbox)",
        format!("{runs} / {dropped} of {}", shadow.len()),
    ));
    Ok(())
}
