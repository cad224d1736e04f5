//! The `kube` backend's own costs, without a cluster: a claim (watch-cache lookup + one
//! preconditioned PATCH) against the fake API server beside one plain GET round trip to it, and a
//! warm Run through the exec path (claim, websocket exec, channel framing, pod delete) beside the
//! same Run from the local backend's warm pool, all measured in this run. And what the claim path
//! starts inside a warm pod: the attach relay (the supervisor is already waiting) beside starting the
//! supervisor itself there, as exec'ing it per claim would.

use crate::report::{Row, Table, percentile};
use crate::{Bench, chain_yaml, text_1k};
use anyhow::Context;
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use sluice_fake_apiserver::{ExecProtocol, FakeApiServer, Resource};
use sluice_gateway::{KubeOptions, start_kube};
use sluice_proto::{self as proto, gateway_client::GatewayClient};
use sluice_sandbox_kube::{KubeBackend, KubeConfig};
use std::time::{Duration, Instant};

fn pod(i: usize) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("claimbench-{i:05}"), "namespace": "default",
            "labels": {
                "app.kubernetes.io/managed-by": "sluice-operator",
                "sluice.dev/chain": "claimbench", "sluice.dev/pool": "warm",
            },
            "ownerReferences": [{
                "apiVersion": "sluice.dev/v1alpha1", "kind": "HookChain", "name": "claimbench",
                "uid": "u-claimbench", "controller": true,
            }],
        },
        "spec": {"runtimeClassName": "gvisor", "containers": [{"name": "supervisor", "image": "x"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    })
}

fn spec_of(yaml: &str) -> anyhow::Result<sluice_engine::SandboxSpec> {
    let hc: sluice_crds::HookChain = serde_saphyr::from_str(yaml)?;
    let namespace = sluice_crds::manifest::namespace_of(&hc.metadata);
    let name = hc.metadata.name.clone().unwrap_or_default();
    Ok(sluice_engine::Chain::new(&namespace, &name, &hc.spec)?.sandbox)
}

/// Claim latency (cache + PATCH), beside one GET round trip to the same server.
async fn claims(table: &mut Table) -> anyhow::Result<()> {
    let api = FakeApiServer::start(ExecProtocol::V5).await?;
    let n = 200;
    for i in 0..n {
        api.apply(Resource::Pods, pod(i));
    }
    let backend = KubeBackend::new(
        api.client(),
        KubeConfig::new("bench"),
        sluice_engine::Metrics::new().pod_claims,
        Duration::from_secs(10),
    )
    .await?;
    let mut spec = spec_of(&chain_yaml(
        "claimbench",
        "b",
        "input",
        "{warm: 1, max: 8}",
        "",
    ))?;
    spec.chain = "claimbench".into();
    let pods: kube::Api<Pod> = kube::Api::namespaced(api.client(), "default");
    let mut gets = Vec::new();
    for i in 0..n {
        let began = Instant::now();
        pods.get(&format!("claimbench-{i:05}")).await?;
        gets.push(began.elapsed());
    }
    let mut samples = Vec::new();
    for _ in 0..n - 10 {
        let began = Instant::now();
        backend.claim(&spec).await.map_err(anyhow::Error::msg)?;
        samples.push(began.elapsed());
    }
    table.push(
        Row::latency(
            "kube claim: cache pick + preconditioned PATCH (fake API)",
            &samples,
        )
        .target("gateway side of ≤ 50 ms"),
    );
    table.push(Row::latency(
        "  baseline: one GET round trip to the same server",
        &gets,
    ));
    api.stop().await;
    Ok(())
}

/// A warm Run through claim + exec + framing, beside the same Run from a local warm pool.
/// One Run of the bench chain on `text`.
async fn run_text(
    mut client: GatewayClient<tonic::transport::Channel>,
    text: String,
) -> Result<proto::RunResponse, tonic::Status> {
    let req = proto::RunRequest {
        namespace: "default".into(),
        target: "bench".into(),
        trigger_point: "input".into(),
        payload: Some(proto::run_request::Payload::Text(text)),
        ..Default::default()
    };
    client.run(req).await.map(|r| r.into_inner())
}

const RUNS: usize = 33;

const BIG_RUNS: usize = 5;

async fn exec_path(table: &mut Table) -> anyhow::Result<()> {
    // One pod per trigger point: what these rows measure is the claim and the exec.
    let chain = chain_yaml(
        "execbench",
        "bench",
        "input",
        "{warm: 2, max: 8, reuse: None}",
        "",
    );
    let text = text_1k();
    // No node's pod start latency: pods are booted between samples (below), never inside one.
    let api = FakeApiServer::builder()
        .protocol(ExecProtocol::V5)
        .pod_start_latency(Duration::ZERO)
        .start()
        .await?;
    let mut hc: Value = serde_saphyr::from_str(&chain)?;
    hc["metadata"]["namespace"] = "default".into();
    api.apply(Resource::HookChains, hc);
    // Each run's pod is booted just before it, never during it: on two cores a replacement booting
    // beside a run (as the operator's backfill does, on other nodes, in a cluster) would be measured
    // with it. Nor are they all booted up front: an idle gVisor sandbox here costs about 3 % of a
    // core (systrap), so seventy waiting pods took both cores and the figure measured them (113 to
    // 623 ms for the same code; one run's module code missed its 5 s deadline).
    let spec = spec_of(&chain)?;
    let mut opts = KubeOptions::new(api.client(), KubeConfig::new("bench"));
    opts.limits.claim_timeout = Duration::from_secs(60);
    opts.kube.claim_timeout = Duration::from_secs(60);
    let gateway = start_kube(opts).await?;
    let client = GatewayClient::connect(format!("http://{}", gateway.addr)).await?;
    let run = |text: String| run_text(client.clone(), text);
    let mut samples = Vec::new();
    for i in 0..RUNS {
        api.add_warm_pod(&spec).await?;
        let began = Instant::now();
        let r = run(text.clone()).await?;
        anyhow::ensure!(
            r.hooks.len() == 3,
            "a kube run did not run the chain: {r:?}"
        );
        if i >= 3 {
            samples.push(began.elapsed());
        }
    }
    // Throughput of the framing itself: a 512 KiB payload through the same chain.
    let big = text.repeat(512);
    let mut big_samples = Vec::new();
    for _ in 0..BIG_RUNS {
        api.add_warm_pod(&spec).await?;
        let began = Instant::now();
        run(big.clone()).await?;
        big_samples.push(began.elapsed());
    }
    gateway.shutdown().await;

    // The same runs from a gateway holding one pod claimed and attached per chain (`--kube-hold 1`),
    // each run starting once the replacement is held again (paced below the backfill rate, as the
    // local warm-pool figure is). One pod to hold before the first run; each run's replacement is
    // added before it.
    api.add_warm_pod(&spec).await?;
    let mut opts = KubeOptions::new(api.client(), KubeConfig::new("bench-held"));
    opts.limits.claim_timeout = Duration::from_secs(60);
    opts.kube.claim_timeout = Duration::from_secs(60);
    opts.kube.hold = 1;
    let gateway = start_kube(opts).await?;
    let client = GatewayClient::connect(format!("http://{}", gateway.addr)).await?;
    let run_held = |text: String| run_text(client.clone(), text);
    let mut held_samples = Vec::new();
    for i in 0..RUNS {
        api.add_warm_pod(&spec).await?;
        anyhow::ensure!(
            gateway
                .engine
                .pools()
                .wait_warm(Duration::from_secs(60))
                .await,
            "the gateway never held a pod"
        );
        let began = Instant::now();
        let r = run_held(text.clone()).await?;
        anyhow::ensure!(
            r.hooks.len() == 3,
            "a held-pod run did not run the chain: {r:?}"
        );
        if i >= 3 {
            held_samples.push(began.elapsed());
        }
    }
    gateway.shutdown().await;
    api.stop().await;

    let local = Bench::start(&[("c.yaml", chain.clone())]).await?;
    let mut local_samples = Vec::new();
    let mut local_big = Vec::new();
    for i in 0..33 {
        let (took, _) = local.warm_run("bench", &text).await?;
        if i >= 3 {
            local_samples.push(took);
        }
    }
    for _ in 0..5 {
        let (took, _) = local.warm_run("bench", &big).await?;
        local_big.push(took);
    }
    local.gateway.shutdown().await;

    table.push(Row::latency(
        "kube Run: claim + exec (v5) + 3 hooks + delete, fake API",
        &samples,
    ));
    table.push(Row::latency(
        "kube Run from a held pod (--kube-hold 1): 3 hooks + delete, fake API",
        &held_samples,
    ));
    table.push(Row::latency(
        "  baseline: same Run from the local warm pool",
        &local_samples,
    ));
    let mbps = |s: &[Duration]| big.len() as f64 / percentile(s, 50.0).as_secs_f64() / 1e6;
    table.push(Row::value(
        "kube Run, 512 KiB payload through exec framing (p50)",
        format!("{:.1} MB/s", mbps(&big_samples)),
    ));
    table.push(Row::value(
        "  baseline: same payload, local pipes (p50)",
        format!("{:.1} MB/s", mbps(&local_big)),
    ));
    Ok(())
}

/// Time from `runsc exec` to the supervisor's `ready` line inside a warm pod-shaped sandbox: through
/// the attach relay (what a claim runs) and, as the baseline, starting a whole supervisor with its
/// runtime loaded and self-checked (what a claim would run if the pod's main process did not wait warmed
/// up). Each sample uses a fresh sandbox, as each claim uses a fresh pod.
async fn attach_vs_start(table: &mut Table) -> anyhow::Result<()> {
    use sluice_engine::{SandboxBackend, SandboxSpec};
    use sluice_sandbox_local::{LocalBackend, LocalConfig};
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};

    let dir = tempfile::tempdir()?;
    let mut cfg = LocalConfig::new(dir.path());
    cfg.pod_shape = true;
    let backend = LocalBackend::new(cfg).await?;
    let spec = SandboxSpec {
        namespace: "default".into(),
        chain: "attachbench".into(),
        cpu: "1".into(),
        cpu_limit: None,
        memory: "256Mi".into(),
        pids: 64,
    };
    let supervisor = sluice_sandbox_local::SUPERVISOR_IN_SANDBOX.to_string();
    let relay = vec![supervisor.clone(), "attach".into()];
    let probe = [relay.clone(), vec!["--probe".into()]].concat();
    let whole = backend.program().args(
        sluice_sandbox_local::SUPERVISOR_IN_SANDBOX,
        sluice_sandbox_local::RUNTIME_IN_SANDBOX,
        256 << 20,
    );
    let (mut attach, mut start) = (Vec::new(), Vec::new());
    for i in 0..36 {
        let sandbox = backend.start(&spec).await?;
        let mut log = sandbox.protocol;
        tokio::spawn(async move { while log.read(&mut [0u8; 1024]).await.unwrap_or(0) > 0 {} });
        let mut ready = false;
        for _ in 0..3000 {
            if backend
                .exec(&sandbox.id, &probe)
                .await?
                .wait()
                .await?
                .success()
            {
                ready = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        anyhow::ensure!(ready, "a pod-shaped sandbox never became ready");
        let command = [&relay, &whole][i % 2];
        let began = Instant::now();
        let mut child = backend.exec(&sandbox.id, command).await?;
        let stderr = child.stderr.take().context("exec without stderr")?;
        let mut line = String::new();
        tokio::io::BufReader::new(stderr)
            .read_line(&mut line)
            .await?;
        let took = began.elapsed();
        let said: Option<serde_json::Value> = serde_json::from_str(&line).ok();
        anyhow::ensure!(
            said.as_ref().and_then(|v| v.get("type")?.as_str()) == Some("ready"),
            "exec {command:?} said {line:?}"
        );
        if i >= 6 {
            [&mut attach, &mut start][i % 2].push(took);
        }
        drop(child.stdin.take());
        let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
        sandbox.handle.destroy(false).await;
    }
    table.push(Row::latency(
        "claim path in a warm pod: exec attach relay until `ready`",
        &attach,
    ));
    table.push(Row::latency(
        "  baseline: exec that starts the supervisor (runtime loaded, self-check) until `ready`",
        &start,
    ));
    Ok(())
}

pub(crate) async fn bench(table: &mut Table) -> anyhow::Result<()> {
    recycled(table).await?;
    claims(table).await?;
    exec_path(table).await?;
    attach_vs_start(table).await
}

/// A gateway in kube mode on the fake API server, one pod held (`--kube-hold 1`), serving a chain
/// whose warm pods a stand-in for the operator keeps (started without a node's latency).
async fn held_gateway(
    reuse: &str,
) -> anyhow::Result<(
    FakeApiServer,
    sluice_gateway::RunningGateway,
    GatewayClient<tonic::transport::Channel>,
)> {
    let chain = chain_yaml(
        "recyclebench",
        "bench",
        "input",
        &format!("{{warm: 2, max: 8, reuse: {reuse}}}"),
        "",
    );
    let api = FakeApiServer::builder()
        .protocol(ExecProtocol::V5)
        .pod_start_latency(Duration::ZERO)
        .start()
        .await?;
    let mut hc: Value = serde_saphyr::from_str(&chain)?;
    hc["metadata"]["namespace"] = "default".into();
    api.apply(Resource::HookChains, hc);
    api.keep_warm(spec_of(&chain)?, 2);
    let mut opts = KubeOptions::new(api.client(), KubeConfig::new("bench-recycle"));
    opts.limits.claim_timeout = Duration::from_secs(60);
    opts.kube.claim_timeout = Duration::from_secs(60);
    opts.kube.hold = 1;
    let gateway = start_kube(opts).await?;
    let client = GatewayClient::connect(format!("http://{}", gateway.addr)).await?;
    Ok((api, gateway, client))
}

/// API writes per trigger point with recycled pods and with a pod per trigger point; Run latency
/// from a recycled held pod and runs/s at 8 clients, beside the local Recycle figure.
pub(crate) async fn recycled(table: &mut Table) -> anyhow::Result<()> {
    let text = text_1k();
    let mut writes = Vec::new();
    for (reuse, runs) in [("Recycle", 200usize), ("None", 20)] {
        let (api, gateway, client) = held_gateway(reuse).await?;
        // Warm: the first run claims and attaches.
        run_text(client.clone(), text.clone()).await?;
        let before = api.writes();
        for _ in 0..runs {
            let r = run_text(client.clone(), text.clone()).await?;
            anyhow::ensure!(
                r.hooks.len() == 3,
                "a kube run did not run the chain: {r:?}"
            );
        }
        let during = api.writes().since(&before);
        writes.push((
            reuse,
            during.total() as f64 / runs as f64,
            during.get(sluice_fake_apiserver::Verb::Create, "pods"),
        ));
        if reuse == "Recycle" {
            // Each sample starts once the pod is back in the held set with its next cell open (the
            // recycling happens after the answer), as the local figure beside it does.
            let mut samples = Vec::new();
            for _ in 0..60 {
                gateway
                    .engine
                    .pools()
                    .wait_warm(Duration::from_secs(60))
                    .await;
                let began = Instant::now();
                run_text(client.clone(), text.clone()).await?;
                samples.push(began.elapsed());
            }
            let window = Duration::from_secs(10);
            let began = Instant::now();
            let done = futures::future::join_all((0..8).map(|_| {
                let client = client.clone();
                let text = text.clone();
                async move {
                    let mut n = 0u64;
                    while began.elapsed() < window {
                        if run_text(client.clone(), text.clone()).await.is_ok() {
                            n += 1;
                        }
                    }
                    n
                }
            }))
            .await;
            let rate = done.iter().sum::<u64>() as f64 / began.elapsed().as_secs_f64();
            gateway.shutdown().await;
            api.stop().await;
            let local = Bench::start(&[(
                "c.yaml",
                chain_yaml(
                    "bench",
                    "bench",
                    "input",
                    "{warm: 2, max: 8, reuse: Recycle}",
                    "",
                ),
            )])
            .await?;
            let mut local_samples = Vec::new();
            for _ in 0..60 {
                let (took, _) = local.warm_run("bench", &text).await?;
                local_samples.push(took);
            }
            local.gateway.shutdown().await;
            table.push(
                Row::latency(
                    "kube Run from a held, recycled pod (Recycle), fake API",
                    &samples,
                )
                .target("within 2 ms of local Recycle p50"),
            );
            table.push(Row::latency(
                "  baseline: local Recycle warm Run",
                &local_samples,
            ));
            table.push(Row::value(
                "kube Run/s from recycled pods, 8 clients",
                format!("{rate:.1}/s"),
            ));
        } else {
            gateway.shutdown().await;
            api.stop().await;
        }
    }
    for (reuse, per, created) in writes {
        table.push(Row::value(
            &format!("API writes per trigger point ({reuse})"),
            format!("{per:.2} (pods created while measured: {created})"),
        ));
    }
    Ok(())
}
