//! The `kube-cluster` section: Sluice installed in a real cluster (`make cluster-up cluster-install`,
//! then `. /var/lib/sluice-cluster/e2e.env`), measured through the API server and the gateway as an
//! application sees them. API writes are counted by the API server itself
//! (`apiserver_request_total`, write verbs, before and after, minus the idle rate of the same span);
//! latencies are client-side. Beside them, the local backend's Recycle Run in the same run.

use crate::report::{Row, Table, percentile};
use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use sluice_crds::HookChain;
use sluice_proto::client::{Client as GatewayClient, ClientAuth};
use sluice_proto::{self as proto};
use std::time::{Duration, Instant};

const NS: &str = "sluice-bench";
const WRITE_VERBS: [&str; 5] = ["POST", "PUT", "PATCH", "DELETE", "APPLY"];
/// Runs per held-pod row, cluster and local alike. Of 100, the p99 is the second-slowest run: one
/// stall of any process on a 2-core machine decides it; of 400, it is the fifth.
const HELD_SAMPLES: usize = 400;

/// Writes the API server has served so far (every resource, every client), by verb and resource
/// (`PATCH pods`, `POST events`, `PUT leases`, ...).
async fn api_writes(client: &Client) -> anyhow::Result<Writes> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(req).await.context("GET /metrics")?;
    let mut writes = Writes::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            let start = labels.find(&format!("{name}=\""))? + name.len() + 2;
            labels[start..].split('"').next()
        };
        let Some(verb) = label("verb").filter(|v| WRITE_VERBS.contains(v)) else {
            continue;
        };
        let resource = match (label("resource"), label("subresource")) {
            (Some(r), Some(s)) if !s.is_empty() => format!("{r}/{s}"),
            (Some(r), _) => r.to_string(),
            (None, _) => String::new(),
        };
        *writes.entry(format!("{verb} {resource}")).or_default() +=
            value.trim().parse::<f64>().unwrap_or(0.0);
    }
    Ok(writes)
}

/// API writes by "VERB resource".
type Writes = std::collections::BTreeMap<String, f64>;

/// The API server's audit log of service accounts' writes (`cluster.sh`'s policy), when this
/// cluster has one: `SLUICE_APISERVER_AUDIT_LOG`.
fn audit_log() -> Option<std::path::PathBuf> {
    std::env::var_os("SLUICE_APISERVER_AUDIT_LOG").map(Into::into)
}

/// How far the audit log has been written.
fn audit_offset(path: &std::path::Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// The writes of Sluice's service accounts (`sluice-gateway`, `sluice-operator`, in any namespace)
/// the audit log records past `from`, by "VERB resource".
fn audited_writes(path: &std::path::Path, from: u64) -> anyhow::Result<Writes> {
    use std::io::{Read, Seek};
    let mut file = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    file.seek(std::io::SeekFrom::Start(from))?;
    let mut text = String::new();
    file.read_to_string(&mut text)?;
    let mut writes = Writes::new();
    for line in text.lines() {
        let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if event["stage"] != "ResponseComplete" {
            continue;
        }
        let user = event["user"]["username"].as_str().unwrap_or_default();
        let ours = user.starts_with("system:serviceaccount:")
            && (user.ends_with(":sluice-gateway") || user.ends_with(":sluice-operator"));
        if !ours {
            continue;
        }
        let r = &event["objectRef"];
        let resource = match (r["resource"].as_str(), r["subresource"].as_str()) {
            (Some(res), Some(sub)) if !sub.is_empty() => format!("{res}/{sub}"),
            (Some(res), _) => res.to_string(),
            _ => String::new(),
        };
        let verb = event["verb"].as_str().unwrap_or_default().to_uppercase();
        *writes.entry(format!("{verb} {resource}")).or_default() += 1.0;
    }
    Ok(writes)
}

/// The operator leader's renewals of its Lease, as `audited_writes` names them.
const LEASE_RENEWALS: &str = "UPDATE leases";

/// Waits (at most a minute) until Sluice has written nothing for 3 s besides its Lease renewals;
/// says how long that took, or that it never was.
async fn wait_quiet(log: &std::path::Path) -> anyhow::Result<String> {
    let began = Instant::now();
    let mut from = audit_offset(log);
    let mut quiet_since = Instant::now();
    while began.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let to = audit_offset(log);
        let mut writes = audited_writes(log, from)?;
        writes.remove(LEASE_RENEWALS);
        from = to;
        if total(&writes) > 0.0 {
            quiet_since = Instant::now();
        } else if quiet_since.elapsed() >= Duration::from_secs(3) {
            return Ok(format!(
                "measured once Sluice had written nothing for 3 s, after {:.1} s",
                began.elapsed().as_secs_f64()
            ));
        }
    }
    Ok("Sluice never stopped writing for 3 s within a minute: measured anyway".into())
}

fn total(w: &Writes) -> f64 {
    // From +0.0: an empty sum of f64 is -0.0, printed "-0.00".
    w.values().fold(0.0, |a, b| a + b)
}

/// What was written between two counts, by verb and resource (those that changed).
fn since(after: &Writes, before: &Writes) -> Writes {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v > 0.0)
        .collect()
}

/// The gateway the bench talks to: one ready endpoint of its Service (gRPC, and its metrics port on
/// the same pod, so that what the gateway counted is what this client caused).
struct Endpoint {
    client: GatewayClient,
    metrics: Option<String>,
}

async fn gateway(client: &Client) -> anyhow::Result<Endpoint> {
    gateways(client)
        .await?
        .into_iter()
        .next()
        .context("no ready gateway endpoint")
}

/// Every ready gateway behind `SLUICE_GATEWAY_SERVICE` (the chart runs two).
async fn gateways(client: &Client) -> anyhow::Result<Vec<Endpoint>> {
    let service = std::env::var("SLUICE_GATEWAY_SERVICE").context("SLUICE_GATEWAY_SERVICE")?;
    let (ns, name) = service
        .split_once('/')
        .context("SLUICE_GATEWAY_SERVICE is <namespace>/<service>")?;
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={name}")))
        .await?;
    let ready: Vec<(String, i32, Option<i32>)> = slices
        .items
        .iter()
        .flat_map(|s| {
            let port = |name: &str| {
                s.ports
                    .as_ref()?
                    .iter()
                    .find(|p| p.name.as_deref() == Some(name))?
                    .port
            };
            let (grpc, metrics) = (port("grpc"), port("metrics"));
            s.endpoints
                .iter()
                .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
                .filter_map(move |e| Some((e.addresses.first()?.clone(), grpc?, metrics)))
        })
        .collect();
    let auth = ClientAuth {
        ca: std::env::var_os("SLUICE_CA").map(Into::into),
        token: std::env::var("SLUICE_TOKEN").ok(),
        server_name: Some(format!("{name}.{ns}.svc")),
        ..Default::default()
    };
    let mut out = Vec::new();
    for (ip, grpc, metrics) in ready {
        out.push(Endpoint {
            client: auth.connect(&format!("https://{ip}:{grpc}")).await?,
            metrics: metrics.map(|port| format!("{ip}:{port}")),
        });
    }
    Ok(out)
}

/// Runs of `chain` (`reuse: None`: a claim of a warm pod each) through each of `gws` at once, one
/// per gateway a round, a round every 500 ms so that the pool refills: each run's time.
async fn fresh_claims(
    gws: &[GatewayClient],
    chain: &str,
    rounds: usize,
) -> anyhow::Result<Vec<Duration>> {
    let mut out = Vec::new();
    for _ in 0..rounds {
        let runs = gws.iter().map(|g| {
            let mut g = g.clone();
            async move { run_when_ready(&mut g, chain).await }
        });
        for r in futures::future::join_all(runs).await {
            out.push(r?);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(out)
}

/// What one gateway counted for the bench's Recycle chain so far (its `/metrics`): runs, their
/// time from request to answer, the time they waited for a sandbox, the time hooks took in their
/// cells (as the supervisor measured it), and claims that found no sandbox waiting.
#[derive(Clone, Copy, Debug, Default)]
struct GatewayCounts {
    runs: f64,
    run_seconds: f64,
    claim_seconds: f64,
    hook_seconds: f64,
    cold_claims: f64,
}

impl GatewayCounts {
    async fn read(addr: &str, target: &str) -> anyhow::Result<Self> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .with_context(|| format!("the gateway's metrics at {addr}"))?;
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: gateway\r\n\r\n")
            .await?;
        let mut text = String::new();
        stream.read_to_string(&mut text).await?;
        let ours = format!("namespace=\"{NS}\"");
        let chain = format!("target=\"{target}\"");
        let sum = |metric: &str, extra: &str| -> f64 {
            text.lines()
                .filter(|l| {
                    l.starts_with(metric)
                        && l[metric.len()..].starts_with('{')
                        && l.contains(&ours)
                        && l.contains(&chain)
                        && l.contains(extra)
                })
                .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
                .sum()
        };
        Ok(Self {
            runs: sum("sluice_gateway_run_duration_seconds_count", ""),
            run_seconds: sum("sluice_gateway_run_duration_seconds_sum", ""),
            claim_seconds: sum("sluice_gateway_claim_wait_seconds_sum", ""),
            hook_seconds: sum("sluice_gateway_hook_duration_seconds_sum", ""),
            cold_claims: sum("sluice_gateway_claims_total", "result=\"cold\""),
        })
    }

    /// Means per run between two readings, beside the client's own mean: where a trigger point's
    /// time goes.
    fn breakdown(&self, before: &Self, client: &[Duration]) -> String {
        let runs = (self.runs - before.runs).max(1.0);
        let ms = |after: f64, before: f64| (after - before) / runs * 1000.0;
        let client_ms = client.iter().map(Duration::as_secs_f64).sum::<f64>()
            / client.len().max(1) as f64
            * 1000.0;
        let run = ms(self.run_seconds, before.run_seconds);
        let claim = ms(self.claim_seconds, before.claim_seconds);
        let hooks = ms(self.hook_seconds, before.hook_seconds);
        format!(
            "mean {client_ms:.2} ms = {:.2} client ↔ gateway + {claim:.2} claim wait + {hooks:.2} hooks in cells + {:.2} gateway ↔ supervisor (exec path, protocol, supervisor); cold claims {:.0} of {runs:.0}",
            client_ms - run,
            run - claim - hooks,
            self.cold_claims - before.cold_claims,
        )
    }
}

async fn run(gw: &mut GatewayClient, target: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    gw.run(proto::RunRequest {
        namespace: NS.into(),
        target: target.into(),
        trigger_point: "input".into(),
        payload: Some(proto::run_request::Payload::Text(crate::text_1k())),
        context: Default::default(),
        session_id: "bench".into(),
    })
    .await?;
    Ok(started.elapsed())
}

/// A run that waits (up to a minute) for a sandbox to be there: warm-up, and `reuse: None`, where
/// every run takes a fresh pod.
async fn run_when_ready(gw: &mut GatewayClient, target: &str) -> anyhow::Result<Duration> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match run(gw, target).await {
            Ok(d) => return Ok(d),
            Err(e) if Instant::now() < deadline => {
                tracing_free_note(&e);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

fn tracing_free_note(e: &anyhow::Error) {
    if std::env::var_os("SLUICE_BENCH_VERBOSE").is_some() {
        eprintln!("kube-cluster: retrying a run: {e}");
    }
}

/// Waits until the chain has `n` Ready warm pods (read from the pods: status counts lag a minute).
async fn wait_warm_pods(client: &Client, chain: &str, n: usize) -> anyhow::Result<()> {
    let ns =
        std::env::var("SLUICE_SANDBOX_NAMESPACE").unwrap_or_else(|_| "sluice-sandboxes".into());
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    let selector =
        format!("sluice.dev/chain-namespace={NS},sluice.dev/chain={chain},sluice.dev/pool=warm");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let ready = pods
            .list(&ListParams::default().labels(&selector))
            .await?
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .count();
        if ready >= n {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{chain}: {n} warm pods not Ready in 120 s");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Waits until the pods the rows before made have gone and every sandbox pod is running: a gVisor
/// sandbox being torn down or booting takes a core of this machine for a moment, and a held-pod row
/// measures a trigger point, not the churn of the row before.
async fn settled(client: &Client) -> anyhow::Result<()> {
    let ns =
        std::env::var("SLUICE_SANDBOX_NAMESPACE").unwrap_or_else(|_| "sluice-sandboxes".into());
    let sandboxes = Api::<Pod>::namespaced(client.clone(), &ns);
    let ours = Api::<Pod>::namespaced(client.clone(), NS);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let churning = sandboxes
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .chain(ours.list(&ListParams::default()).await?.items)
            .filter(|p| {
                p.metadata.deletion_timestamp.is_some()
                    || p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running")
            })
            .count();
        if churning == 0 {
            // The last teardown's processes exit shortly after its pod object is gone.
            tokio::time::sleep(Duration::from_secs(2)).await;
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{churning} pods still starting or stopping after 120 s");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Applies the bench chain with the chart's default resources (as the local baseline has them).
async fn apply(client: &Client, name: &str, reuse: &str, warm: u32) -> anyhow::Result<()> {
    let yaml = crate::cpu::default_resources_chain(
        name,
        &format!("{{warm: {warm}, max: {}, reuse: {reuse}}}", warm + 4),
    )
    .replace("namespace: default", &format!("namespace: {NS}"));
    let hc: HookChain = serde_saphyr::from_str(&yaml)?;
    Api::<HookChain>::namespaced(client.clone(), NS)
        .patch(
            name,
            &PatchParams::apply("sluice-bench").force(),
            &Patch::Apply(&hc),
        )
        .await?;
    wait_ready(client, name, warm).await
}

async fn wait_ready(client: &Client, name: &str, warm: u32) -> anyhow::Result<()> {
    let api = Api::<HookChain>::namespaced(client.clone(), NS);
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let hc = api.get(name).await?;
        if let Some(s) = &hc.status
            && s.conditions
                .iter()
                .any(|c| c.type_ == "PoolReady" && c.status == "True")
            && s.warm >= warm
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("HookChain {name} not PoolReady in 300 s");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Where the writes per trigger point were counted.
fn writes_source() -> &'static str {
    match audit_log() {
        Some(_) => "the API server's audit log, Sluice's service accounts",
        None => "apiserver_request_total, write verbs, less the idle rate",
    }
}

/// API writes per trigger point: writes during `n` runs and until the pool is full again, minus
/// what the cluster writes anyway over the same span (leases, node status), measured idle. What
/// was written, by verb and resource, is printed beside it (idle span, then the runs' span).
async fn writes_per_trigger_point(
    client: &Client,
    gw: &mut GatewayClient,
    chain: &str,
    n: usize,
) -> anyhow::Result<f64> {
    if let Some(log) = audit_log() {
        // Exact: Sluice's own writes, from the API server's audit log, once what the rows before
        // caused (another chain's first claims, its pool refilled, its status) has been written.
        let quiet = wait_quiet(&log).await?;
        let from = audit_offset(&log);
        let start = Instant::now();
        for _ in 0..n {
            run_when_ready(gw, chain).await?;
        }
        wait_warm_pods(client, chain, 2).await?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let mut during = audited_writes(&log, from)?;
        println!(
            "kube-cluster: {chain}: Sluice's writes in the API server's audit log over {:.1} s of {n} trigger points ({quiet}):",
            start.elapsed().as_secs_f64()
        );
        for (key, count) in &during {
            println!("  {key:<40} {count:>6}");
        }
        // The operator leader's Lease renewals come with time, not with trigger points.
        if let Some(leases) = during.remove(LEASE_RENEWALS) {
            println!(
                "  ({leases} Lease renewals of the operator's leader: with time, not per trigger point)"
            );
        }
        return Ok(total(&during) / n as f64);
    }
    let idle_from = (Instant::now(), api_writes(client).await?);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let idle = since(&api_writes(client).await?, &idle_from.1);
    let idle_rate = total(&idle) / idle_from.0.elapsed().as_secs_f64();
    let (start, before) = (Instant::now(), api_writes(client).await?);
    for _ in 0..n {
        run_when_ready(gw, chain).await?;
    }
    wait_warm_pods(client, chain, 2).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = since(&api_writes(client).await?, &before);
    let background = idle_rate * start.elapsed().as_secs_f64();
    println!(
        "kube-cluster: {chain}: writes over {:.1} s idle, then over {:.1} s of {n} trigger points:",
        idle_from.0.elapsed().as_secs_f64() - start.elapsed().as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    for key in idle
        .keys()
        .chain(during.keys())
        .collect::<std::collections::BTreeSet<_>>()
    {
        let (i, d) = (idle.get(key), during.get(key));
        println!(
            "  {key:<40} {:>6} {:>6}",
            i.copied().unwrap_or(0.0),
            d.copied().unwrap_or(0.0)
        );
    }
    Ok(((total(&during) - background) / n as f64).max(0.0))
}

/// The bench namespace, made afresh: a previous run's, still terminating, is waited out first (its
/// chains would otherwise vanish under this run's apply).
async fn fresh_namespace(client: &Client) -> anyhow::Result<()> {
    let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone());
    gone(&namespaces).await?;
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NS}}))?,
        )
        .await
        .with_context(|| format!("creating namespace {NS}"))?;
    Ok(())
}

/// Deletes the bench namespace (if there) and waits until it is gone, up to three minutes.
async fn gone(namespaces: &Api<k8s_openapi::api::core::v1::Namespace>) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        match namespaces.get_opt(NS).await? {
            None => return Ok(()),
            Some(ns) if ns.metadata.deletion_timestamp.is_none() => {
                namespaces.delete(NS, &DeleteParams::default()).await?;
            }
            Some(_) => {}
        }
        if Instant::now() > deadline {
            bail!("namespace {NS} still there 180 s after its deletion");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// CFS periods the chain's pods were throttled in so far, from their pod cgroups on this machine
/// (the test cluster's node); `None` when a pod's cgroup is not found here.
async fn throttled_periods(client: &Client, chain: &str) -> anyhow::Result<Option<u64>> {
    let ns =
        std::env::var("SLUICE_SANDBOX_NAMESPACE").unwrap_or_else(|_| "sluice-sandboxes".into());
    let pods = Api::<Pod>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels(&format!(
            "sluice.dev/chain-namespace={NS},sluice.dev/chain={chain}"
        )))
        .await?;
    let mut total = 0;
    for pod in &pods.items {
        let Some(uid) = &pod.metadata.uid else {
            continue;
        };
        match sluice_e2e::pod_cpu_throttling(uid) {
            Some(t) => total += t.periods,
            None => return Ok(None),
        }
    }
    Ok(Some(total))
}

/// Pod create → Ready with gVisor: pods of the supervisor image, one at a time.
async fn pod_ready(client: &Client, n: usize) -> anyhow::Result<Vec<Duration>> {
    let pods = Api::<Pod>::namespaced(client.clone(), NS);
    let image = std::env::var("SLUICE_SUPERVISOR_IMAGE")
        .unwrap_or_else(|_| "sluice.test/sluice-supervisor:e2e".into());
    let mut samples = Vec::new();
    for i in 0..n {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("bench-ready-{i}")},
            "spec": {
                "runtimeClassName": "gvisor", "restartPolicy": "Never",
                "automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
                "containers": [{
                    "name": "s", "image": image, "imagePullPolicy": "Never",
                    "command": ["python3", "-c", "import time; time.sleep(3600)"],
                    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
                }],
            },
        }))?;
        let started = Instant::now();
        pods.create(&PostParams::default(), &pod).await?;
        loop {
            let p = pods.get(&format!("bench-ready-{i}")).await?;
            let ready = p
                .status
                .and_then(|s| s.conditions)
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            if ready {
                break;
            }
            if started.elapsed() > Duration::from_secs(120) {
                bail!("pod bench-ready-{i} not Ready in 120 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        samples.push(started.elapsed());
        pods.delete(&format!("bench-ready-{i}"), &DeleteParams::default())
            .await?;
    }
    Ok(samples)
}

/// Runs per second of `clients` clients back to back for `span` against the local gateway, the same
/// chain and resources as the cluster's, with as many warm sandboxes as clients.
async fn local_runs_per_second(clients: usize, span: Duration) -> anyhow::Result<f64> {
    let pool = format!("{{warm: {clients}, max: {}}}", clients + 4);
    let bench =
        crate::Bench::start(&[("c.yaml", crate::cpu::default_resources_chain("cpu", &pool))])
            .await?;
    let text = crate::text_1k();
    bench.run("cpu", &text).await?;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let mut client = bench.client.clone();
        let text = text.clone();
        tasks.push(tokio::spawn(async move {
            let mut done = 0u32;
            while started.elapsed() < span {
                let req = proto::RunRequest {
                    namespace: "default".into(),
                    target: "cpu".into(),
                    trigger_point: "input".into(),
                    payload: Some(proto::run_request::Payload::Text(text.clone())),
                    ..Default::default()
                };
                if client.run(req).await.is_ok() {
                    done += 1;
                }
            }
            done
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await?;
    }
    let rate = f64::from(total) / started.elapsed().as_secs_f64();
    bench.gateway.shutdown().await;
    Ok(rate)
}

pub(crate) async fn bench(table: &mut Table) -> anyhow::Result<()> {
    if std::env::var_os("KUBECONFIG").is_none()
        || std::env::var_os("SLUICE_GATEWAY_SERVICE").is_none()
    {
        println!(
            "kube-cluster: no cluster (KUBECONFIG and SLUICE_GATEWAY_SERVICE unset; `make cluster-up cluster-install`, then `. /var/lib/sluice-cluster/e2e.env`)"
        );
        return Ok(());
    }
    let client = Client::try_default().await?;
    let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone());
    fresh_namespace(&client).await?;
    let endpoint = gateway(&client).await?;
    let mut gw = endpoint.client.clone();
    apply(&client, "bench-recycle", "Recycle", 2).await?;
    apply(&client, "bench-none", "None", 2).await?;
    run_when_ready(&mut gw, "bench-recycle").await?;
    run_when_ready(&mut gw, "bench-none").await?;
    wait_warm_pods(&client, "bench-none", 2).await?;

    let recycle = writes_per_trigger_point(&client, &mut gw, "bench-recycle", 100).await?;
    table.push(Row::value(
        "API writes per trigger point (Recycle)",
        format!("{recycle:.2} ({})", writes_source()),
    ));
    // One at a time, each from a fresh pod: slow by design.
    let none = writes_per_trigger_point(&client, &mut gw, "bench-none", 6).await?;
    table.push(Row::value(
        "API writes per trigger point (None)",
        format!("{none:.2} ({})", writes_source()),
    ));

    // Claims: a run of the None chain claims a warm pod (the preconditioned PATCH) and attaches.
    // Both gateways at once race for the same pods; one alone is the baseline, in the same run.
    let all = gateways(&client).await?;
    if all.len() >= 2 {
        let clients: Vec<GatewayClient> = all.iter().map(|e| e.client.clone()).collect();
        let alone = fresh_claims(&clients[..1], "bench-none", 10).await?;
        let both = fresh_claims(&clients, "bench-none", 10).await?;
        table.push(Row::latency(
            &format!(
                "Run from a fresh claim (None), {} gateways claiming at once",
                clients.len()
            ),
            &both,
        ));
        table.push(
            Row::latency("  one gateway claiming, same chain, same run", &alone).target("baseline"),
        );
    } else {
        table.push(Row::value(
            "Run from a fresh claim (None), two gateways claiming at once",
            format!("not measured: {} ready gateway(s)", all.len()),
        ));
    }

    table.push(Row::latency(
        "pod create → Ready with gVisor",
        &pod_ready(&client, 5).await?,
    ));

    wait_warm_pods(&client, "bench-recycle", 2).await?;
    settled(&client).await?;
    run_when_ready(&mut gw, "bench-recycle").await?;
    let throttled_before = throttled_periods(&client, "bench-recycle").await?;
    let counts = |endpoint: &Endpoint| {
        let addr = endpoint.metrics.clone();
        async move {
            match addr {
                Some(addr) => GatewayCounts::read(&addr, "bench-recycle").await.ok(),
                None => None,
            }
        }
    };
    // Paced as the local baseline is (a warm sandbox waiting: the gateway's pod is prepared again
    // well within the pause), then back to back (the next run leaves as soon as the answer is in).
    let before = counts(&endpoint).await;
    let mut paced = Vec::new();
    for _ in 0..HELD_SAMPLES {
        tokio::time::sleep(Duration::from_millis(50)).await;
        paced.push(run_when_ready(&mut gw, "bench-recycle").await?);
    }
    let paced_breakdown = counts(&endpoint).await;
    let mut held = Vec::new();
    for _ in 0..HELD_SAMPLES {
        held.push(run_when_ready(&mut gw, "bench-recycle").await?);
    }
    let held_breakdown = counts(&endpoint).await;
    let throttled = match (
        throttled_before,
        throttled_periods(&client, "bench-recycle").await?,
    ) {
        (Some(before), Some(after)) => format!(
            "{:.2}",
            after.saturating_sub(before) as f64 / (paced.len() + held.len()) as f64
        ),
        _ => "not readable here (the pods' cgroups are not on this machine)".into(),
    };
    // The same chain, resources and sandbox CPU limit (the chart's defaults) on one machine.
    let local =
        crate::cpu::local(sluice_crds::cpu::SandboxCpuLimit::default(), HELD_SAMPLES).await?;
    let target = |local: &[Duration]| {
        format!(
            "p50 ≤ {:.1} ms (local + 3 ms), p99 ≤ 20 ms",
            (percentile(local, 50.0) + Duration::from_millis(3)).as_secs_f64() * 1000.0
        )
    };
    let breakdown = |after: Option<GatewayCounts>, before: Option<GatewayCounts>, samples| match (
        after, before,
    ) {
        (Some(a), Some(b)) => a.breakdown(&b, samples),
        _ => "the gateway's metrics were not readable".into(),
    };
    let ways = [
        ("paced", &paced, paced_breakdown, before, &local.paced),
        (
            "back to back",
            &held,
            held_breakdown,
            paced_breakdown,
            &local.back_to_back,
        ),
    ];
    for (way, samples, after, before, local) in ways {
        table.push(
            Row::latency(
                &format!("Run from a held pod, {way} (Recycle, chart's default resources)"),
                samples,
            )
            .target(&target(local)),
        );
        table.push(Row::value(
            "  where it goes (the gateway's own counts)",
            breakdown(after, before, samples),
        ));
        table.push(
            Row::latency(
                &format!("  local Recycle Run, {way}, same chain and resources, same run"),
                local,
            )
            .target("baseline"),
        );
    }
    table.push(Row::value(
        "  throttled CFS periods per trigger point (pod cgroups)",
        throttled,
    ));
    table.push(Row::value(
        "  local: throttled CFS periods per trigger point",
        format!("{:.2}", local.throttled_per_run),
    ));
    let local_rate = local_runs_per_second(8, Duration::from_secs(15)).await?;

    let clients = 8;
    let span = Duration::from_secs(15);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let mut gw = gw.clone();
        tasks.push(tokio::spawn(async move {
            let mut done = 0u32;
            while started.elapsed() < span {
                if run(&mut gw, "bench-recycle").await.is_ok() {
                    done += 1;
                }
            }
            done
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await?;
    }
    let rate = f64::from(total) / started.elapsed().as_secs_f64();
    table.push(
        Row::value(
            "runs/s at 8 clients (Recycle, held pods)",
            format!(
                "{rate:.1} ({:.0} % of local)",
                rate / local_rate.max(f64::MIN_POSITIVE) * 100.0
            ),
        )
        .target("≥ 60 % of local"),
    );
    table.push(
        Row::value(
            "  local runs/s at 8 clients, same chain, same run",
            format!("{local_rate:.1}"),
        )
        .target("baseline"),
    );
    gone(&namespaces).await?;
    Ok(())
}
