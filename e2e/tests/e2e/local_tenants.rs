//! Load with two tenants on one gateway, one of them hostile (slow module code, slow hooks, printing,
//! clients that disconnect): every run of the honest tenant succeeds. How fast it stays is measured by
//! `make bench` (the "two tenants" rows), not asserted here.

use sluice_e2e::Harness;
use sluice_e2e::tenants::{self, honest_run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_honest_tenants_runs_all_succeed_beside_a_hostile_one() {
    let files = tenants::files(true);
    let files: Vec<(&str, &str)> = files.iter().map(|(n, y)| (*n, y.as_str())).collect();
    let h = Harness::start(&files).await;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let hostile = tokio::spawn(tenants::hostile_load(h.client.clone(), 4, stopped));
    let mut failures = Vec::new();
    for i in 0..40 {
        if let Err(e) = honest_run(&h.client).await {
            failures.push(format!("run {i}: {e}"));
        }
    }
    stop.send_replace(true);
    let _ = hostile.await;
    assert!(
        failures.is_empty(),
        "honest runs failed:\n{}",
        failures.join("\n")
    );
    // The hostile tenant did run (and print, and sleep) all along.
    let hostile_runs = h
        .audit()
        .iter()
        .filter(|e| e["namespace"] == tenants::HOSTILE_NS)
        .count();
    assert!(hostile_runs > 0, "the hostile tenant never ran");
    h.stop_and_check_leaks().await;
}
