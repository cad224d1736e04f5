//! The production shape (`cluster.sh up`: two nodes; `install.sh`: two gateways, two operators
//! electing a leader): what a managed cluster does to Sluice that one node with one replica of
//! everything cannot show. A node drained under traffic, a node lost, the operator's leader killed,
//! two gateways claiming the same warm pods, a canary judged by two gateways, a gateway's shadow
//! comparison when its pod goes, a sandbox pod's limits in its cgroup.

use super::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref()?.node_name.as_deref()
}

fn ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The cluster's nodes, by name.
async fn node_names(client: &Client) -> Vec<String> {
    let mut names: Vec<String> = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("list nodes")
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    names.sort();
    names
}

/// The release's pods of `component` (`gateway`, `operator`) not being deleted.
async fn release_pods(client: &Client, component: &str) -> Vec<Pod> {
    Api::<Pod>::namespaced(client.clone(), &release_namespace())
        .list(&ListParams::default().labels(&format!(
            "app.kubernetes.io/name=sluice,app.kubernetes.io/component={component}"
        )))
        .await
        .expect("list the release's pods")
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect()
}

/// The release's gateway pods once two are Ready (the production shape), within two minutes.
async fn two_ready_gateways(client: &Client) -> Vec<Pod> {
    poll(
        Duration::from_secs(120),
        "two ready gateway replicas",
        || async {
            let pods: Vec<Pod> = release_pods(client, "gateway")
                .await
                .into_iter()
                .filter(ready)
                .collect();
            (pods.len() >= 2).then_some(pods)
        },
    )
    .await
}

/// The port named `name` of the pod's first container.
fn port(pod: &Pod, name: &str) -> i32 {
    pod.spec.as_ref().unwrap().containers[0]
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("no port {name} on {:?}", pod.metadata.name))
        .container_port
}

fn pod_ip(pod: &Pod) -> String {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_else(|| panic!("pod {:?} has no IP", pod.metadata.name))
}

/// A client of one gateway pod (not the Service): the claim race needs both.
async fn connect_gateway_pod(pod: &Pod) -> GatewayClient {
    let auth = ClientAuth {
        ca: std::env::var_os("SLUICE_CA").map(Into::into),
        token: std::env::var("SLUICE_TOKEN").ok(),
        server_name: Some(format!("sluice-gateway.{}.svc", release_namespace())),
        ..Default::default()
    };
    let addr = format!("https://{}:{}", pod_ip(pod), port(pod, "grpc"));
    auth.connect(&addr)
        .await
        .unwrap_or_else(|e| panic!("gateway pod at {addr}: {e}"))
}

/// The value of a counter in a gateway pod's metrics, summed over the series whose labels contain
/// `labels` (`result="conflict"`).
async fn gateway_counter(pod: &Pod, metric: &str, labels: &str) -> f64 {
    let url = format!("http://{}:{}/metrics", pod_ip(pod), port(pod, "metrics"));
    let text = tokio::task::spawn_blocking(move || {
        std::process::Command::new("curl")
            .args(["-sf", "--max-time", "5", &url])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    })
    .await
    .expect("curl");
    text.lines()
        .filter(|l| l.starts_with(metric) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Every gateway pod's output, followed (`kubectl logs -f`, as a node's log collector does) from
/// now on, pods that start later included: the audit is a JSON line per run on the gateway's
/// stdout, and a drained gateway's pod (and its log) goes with the drain.
struct GatewayLogs {
    /// (pod, line)
    lines: Arc<Mutex<Vec<(String, String)>>>,
    stop: Arc<AtomicBool>,
    /// The `kubectl logs -f` of each gateway pod.
    children: Arc<Mutex<HashMap<String, std::process::Child>>>,
}

impl GatewayLogs {
    fn follow() -> Self {
        let logs = GatewayLogs {
            lines: Arc::default(),
            stop: Arc::default(),
            children: Arc::default(),
        };
        let (lines, stop, children) =
            (logs.lines.clone(), logs.stop.clone(), logs.children.clone());
        std::thread::spawn(move || {
            let ns = release_namespace();
            while !stop.load(Ordering::Relaxed) {
                let out = std::process::Command::new("kubectl")
                    .args([
                        "-n",
                        &ns,
                        "get",
                        "pods",
                        "-l",
                        "app.kubernetes.io/component=gateway",
                        "--field-selector",
                        "status.phase=Running",
                        "-o",
                        "name",
                    ])
                    .output();
                let names = out
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                    .unwrap_or_default();
                for pod in names
                    .lines()
                    .map(|l| l.trim_start_matches("pod/").to_string())
                {
                    // A follow the API server ended while the pod runs starts again from the top (the
                    // audit is read as a set of run ids: lines read twice count once).
                    let following = children
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_mut(&pod)
                        .is_some_and(|c| matches!(c.try_wait(), Ok(None)));
                    if pod.is_empty() || following {
                        continue;
                    }
                    let child = std::process::Command::new("kubectl")
                        .args(["-n", &ns, "logs", "-f", "--tail=-1", &pod])
                        .stdout(std::process::Stdio::piped())
                        .stderr(std::process::Stdio::null())
                        .spawn();
                    let Ok(mut child) = child else { continue };
                    let out = child.stdout.take().expect("piped");
                    let lines = lines.clone();
                    let reader_pod = pod.clone();
                    std::thread::spawn(move || {
                        let pod = reader_pod;
                        use std::io::BufRead;
                        // Bytes, not text: a line that is not UTF-8 must not end the reading.
                        for line in std::io::BufReader::new(out)
                            .split(b'\n')
                            .map_while(Result::ok)
                        {
                            let line = String::from_utf8_lossy(&line).into_owned();
                            lines
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .push((pod.clone(), line));
                        }
                    });
                    let pod = pod.clone();
                    children
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(pod, child);
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        });
        logs
    }

    /// How many lines of which pods were read, for a failure's message.
    fn describe(&self) -> String {
        let mut by: BTreeMap<String, usize> = BTreeMap::new();
        let mut first: BTreeMap<String, String> = BTreeMap::new();
        for (pod, line) in self.lines.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            *by.entry(pod.clone()).or_default() += 1;
            first
                .entry(pod.clone())
                .or_insert_with(|| line.chars().take(200).collect());
        }
        let by = format!("{by:?} {first:?}");
        format!("lines read by gateway pod: {by}")
    }

    /// The audit lines seen so far, as (gateway pod, audit record).
    fn audit(&self) -> Vec<(String, Value)> {
        self.lines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(|(pod, line)| {
                let v: Value = serde_json::from_str(line).ok()?;
                v.get("run_id")?;
                Some((pod.clone(), v))
            })
            .collect()
    }

    /// The gateway pods that wrote a line containing `needle` so far.
    fn said(&self, needle: &str) -> BTreeSet<String> {
        self.lines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, line)| line.contains(needle))
            .map(|(pod, _)| pod.clone())
            .collect()
    }

    /// Waits (up to `limit`) until every run of `run_ids` is in some gateway's audit; the ones
    /// that are not.
    async fn missing(&self, run_ids: &[String], limit: Duration) -> Vec<String> {
        let deadline = Instant::now() + limit;
        loop {
            let seen: HashSet<String> = self
                .audit()
                .iter()
                .filter_map(|(_, v)| v["run_id"].as_str().map(str::to_string))
                .collect();
            let missing: Vec<String> = run_ids
                .iter()
                .filter(|id| !seen.contains(*id))
                .cloned()
                .collect();
            if missing.is_empty() || Instant::now() >= deadline {
                return missing;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

impl Drop for GatewayLogs {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for c in self
            .children
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values_mut()
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts a stopped node's kubelet and containerd again when dropped (`cluster.sh node-start`), so
/// a failing test leaves the cluster whole.
struct StartNode(Option<String>);

impl Drop for StartNode {
    fn drop(&mut self) {
        if let Some(node) = self.0.take() {
            cluster_ctl(&["node-start", &node]);
        }
    }
}

/// The chain's pods by node (not being deleted, Ready or not).
async fn pods_by_node(c: &Cluster, chain: &str) -> BTreeMap<String, Vec<Pod>> {
    let mut by: BTreeMap<String, Vec<Pod>> = BTreeMap::new();
    for p in c.live_pods(chain, "").await {
        if let Some(n) = node_of(&p) {
            by.entry(n.to_string()).or_default().push(p);
        }
    }
    by
}

/// `kubectl drain` of a node while two clients call the gateways back to back, with the chain's
/// claimed pods on that node. The drain completes; no run that was answered failed (a client whose
/// gateway was evicted connects to the other, as behind a Service); the claimed pods were marked
/// draining by the operator and given back by their gateways when their trigger point ended, not
/// evicted under it (the chart's PodDisruptionBudget refuses that); nothing of Sluice is left on the
/// node; and every answered run is in a gateway's audit, the drained gateway's included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_under_traffic_fails_no_run_and_moves_the_pool() {
    let Some(c) = cluster("drain").await else {
        return;
    };
    let nodes = node_names(&c.client).await;
    assert!(
        nodes.len() >= 2,
        "the production shape has two nodes: {nodes:?}"
    );
    let logs = GatewayLogs::follow();
    c.apply_chain(
        "drained",
        "drain-bot",
        "input",
        json!({"pool": {"warm": 3, "max": 10}, "resources": {"cpu": "100m"}}),
        &[("upper", "modify", UPPER)],
    )
    .await;
    c.wait_pool_ready("drained").await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let loads: Vec<_> = (0..2)
        .map(|_| {
            tokio::spawn(traffic(
                c.client.clone(),
                c.ns.clone(),
                "drain-bot".into(),
                stop_rx.clone(),
            ))
        })
        .collect();
    // The node of a pod a gateway on another node holds: what the drain must not cut off, and what
    // only the operator's mark gives back (a gateway on the drained node is drained with it).
    let victim = poll(
        Duration::from_secs(60),
        "a claimed pod of the chain on a node other than its gateway's",
        || async {
            let gateway_node: HashMap<String, String> = release_pods(&c.client, "gateway")
                .await
                .iter()
                .filter_map(|g| Some((g.metadata.name.clone()?, node_of(g)?.to_string())))
                .collect();
            c.pool_pods("drained", "claimed")
                .await
                .iter()
                .find_map(|p| {
                    let node = node_of(p)?;
                    let by = p
                        .metadata
                        .annotations
                        .as_ref()?
                        .get(sluice_crds::sandbox_pod::ANNOTATION_CLAIMED_BY)?;
                    (gateway_node.get(by).map(String::as_str) != Some(node))
                        .then(|| node.to_string())
                })
        },
    )
    .await;
    let claimed_there: Vec<Pod> = c
        .pool_pods("drained", "claimed")
        .await
        .into_iter()
        .filter(|p| node_of(p) == Some(victim.as_str()))
        .collect();
    let held_there: Vec<String> = claimed_there
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    // A gateway on the drained node is drained too: it gives back what it holds as it stops, with
    // or without a mark. The pods held by gateways elsewhere are the ones the mark is for.
    let gateways_there: HashSet<String> = release_pods(&c.client, "gateway")
        .await
        .iter()
        .filter(|g| node_of(g) == Some(victim.as_str()))
        .filter_map(|g| g.metadata.name.clone())
        .collect();
    let held_from_elsewhere: Vec<String> = claimed_there
        .iter()
        .filter(|p| {
            let by = p
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(sluice_crds::sandbox_pod::ANNOTATION_CLAIMED_BY));
            !by.is_some_and(|g| gateways_there.contains(g))
        })
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    println!(
        "draining {victim}, where the gateways hold {held_there:?} ({held_from_elsewhere:?} by gateways on other nodes; gateways on {victim}: {gateways_there:?})"
    );
    let _uncordon = Uncordon(vec![victim.clone()]);
    let began = Instant::now();
    let node = victim.clone();
    // --force: sandbox pods in the sandbox namespace declare no controller (owner references do
    // not cross namespaces); they are still evicted through the eviction API, which the budget
    // governs. A managed node upgrade calls the eviction API itself.
    let said = tokio::task::spawn_blocking(move || {
        kubectl(&[
            "drain",
            &node,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--force",
            "--timeout=240s",
        ])
    })
    .await
    .expect("kubectl drain");
    println!("drained {victim} in {:?}:\n{said}", began.elapsed());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = stop_tx.send(true);
    let (mut served, mut resent, mut failed, mut run_ids) = (0, 0, Vec::new(), Vec::new());
    for load in loads {
        let t = load.await.expect("traffic");
        served += t.served;
        resent += t.resent;
        failed.extend(t.failed);
        run_ids.extend(t.run_ids);
    }
    println!("under the drain: {served} runs served, {resent} sent again on a new connection");
    assert!(
        failed.is_empty(),
        "runs failed under the drain: {failed:#?}"
    );
    assert!(
        served >= 20,
        "too little traffic to show anything: {served}"
    );

    let left: Vec<String> = Api::<Pod>::all(c.client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={victim}")))
        .await
        .expect("list pods")
        .items
        .iter()
        .filter(|p| {
            p.metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.values().any(|v| v.starts_with("sluice")))
        })
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    assert!(left.is_empty(), "Sluice pods left on {victim}: {left:?}");
    // The held pods were given back by their gateways once marked, not evicted mid-walk.
    let events = kubectl(&["-n", &c.ns, "get", "events.events.k8s.io", "-o", "json"]);
    let events: Value = serde_json::from_str(&events).expect("events");
    let draining: Vec<&str> = events["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["reason"] == "Draining")
        .filter_map(|e| e["note"].as_str())
        .collect();
    // The pods claimed there by gateways elsewhere when the drain began (a gateway may have given
    // one back just before the cordon: at least one is marked). Pods held by a gateway that was
    // on the node went with that gateway's stop (and are gone: no Sluice pod is left there).
    assert!(
        held_from_elsewhere
            .iter()
            .any(|pod| draining.iter().any(|n| n.contains(pod.as_str()))),
        "no Draining event names a pod held on {victim} by a gateway elsewhere ({held_from_elsewhere:?}): {draining:?}"
    );
    let missing = logs.missing(&run_ids, Duration::from_secs(30)).await;
    assert!(
        missing.is_empty(),
        "{} of {} answered runs are in no gateway's audit ({}): {:?}",
        missing.len(),
        run_ids.len(),
        logs.describe(),
        &missing[..missing.len().min(5)]
    );
    drop(_uncordon);
    c.wait_pool_ready("drained").await;
}

/// A node stops (its kubelet and containerd: its containers keep running, unreachable through the
/// API, as on a node cut off). Within 10 s the chain is served from the other node, and no run
/// waits out the exec timeout on a dead pod; once the node controller marks the node (its 50 s
/// grace), the operator makes the pool again on the serving node while the lost pods still exist:
/// `pool.max` counts only pods that can serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_node_is_served_around_within_seconds_and_its_pods_do_not_count() {
    let Some(c) = cluster("lost").await else {
        return;
    };
    let nodes = node_names(&c.client).await;
    assert!(
        nodes.len() >= 2,
        "the production shape has two nodes: {nodes:?}"
    );
    const WARM: u32 = 4;
    let apply = |max: u32| {
        c.apply_chain(
            "lost",
            "lost-bot",
            "input",
            json!({"pool": {"warm": WARM, "max": max}, "resources": {"cpu": "100m"}}),
            &[("upper", "modify", UPPER)],
        )
    };
    apply(WARM + 4).await;
    c.wait_pool_ready("lost").await;
    c.run("lost-bot", "before")
        .await
        .expect("Run before the loss");
    // Room for the pool as it is and one pod more: were the lost pods counted toward max, the
    // pool could not be made again beside them.
    let claimed = c.pool_pods("lost", "claimed").await.len() as u32;
    apply(WARM + claimed + 1).await;
    c.wait_pool_ready("lost").await;
    // At least two of the chain's pods on the node to lose, one elsewhere, and a gateway elsewhere
    // (the application's): until the scheduler has spread them so, a warm pod of the node that has
    // too many is replaced (it lands where there is more room).
    let victim = poll(
        Duration::from_secs(180),
        "two of the chain's pods on a node to lose, a pod and a gateway on another",
        || async {
            let by = pods_by_node(&c, "lost").await;
            let gateways: HashSet<String> = release_pods(&c.client, "gateway")
                .await
                .iter()
                .filter(|p| ready(p))
                .filter_map(|p| node_of(p).map(str::to_string))
                .collect();
            let ready_on = |n: &str| {
                by.get(n)
                    .map_or(0, |ps| ps.iter().filter(|p| ready(p)).count())
            };
            let victim = nodes
                .iter()
                .filter(|n| gateways.iter().any(|g| g != *n))
                .max_by_key(|n| ready_on(n))?
                .clone();
            let others: usize = nodes
                .iter()
                .filter(|n| **n != victim)
                .map(|n| ready_on(n))
                .sum();
            if ready_on(&victim) >= 2 && others >= 1 {
                return Some(victim);
            }
            let crowded = if ready_on(&victim) < 2 {
                nodes
                    .iter()
                    .filter(|n| **n != victim)
                    .max_by_key(|n| ready_on(n))?
                    .clone()
            } else {
                victim
            };
            if let Some(p) = by
                .get(&crowded)
                .and_then(|ps| ps.iter().find(|p| pool_of(p) == "warm"))
            {
                let _ = c
                    .pods()
                    .delete(p.metadata.name.as_deref()?, &DeleteParams::default())
                    .await;
            }
            None
        },
    )
    .await;
    let on_victim: Vec<String> = pods_by_node(&c, "lost").await[&victim]
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    assert!(on_victim.len() >= 2, "{on_victim:?}");
    // The application calls a gateway on a serving node, as its clients would: the lost node's
    // gateway is as unreachable as its kubelet (here only its containerd is gone, and with it the
    // reader of its stdout, where the audit goes: it would stall once the pipe is full).
    let gateway = release_pods(&c.client, "gateway")
        .await
        .into_iter()
        .find(|p| ready(p) && node_of(p) != Some(victim.as_str()))
        .expect("a ready gateway on a node that stays");
    let gateway = connect_gateway_pod(&gateway).await;
    println!(
        "stopping {victim}, which runs {on_victim:?}; max {}",
        WARM + claimed + 1
    );
    let _restart = StartNode(Some(victim.clone()));
    let Some(()) = cluster_ctl(&["node-stop", &victim]) else {
        return;
    };
    let stopped = Instant::now();
    let (mut late, mut slowest, mut n) = (Vec::new(), Duration::ZERO, 0);
    while stopped.elapsed() < Duration::from_secs(20) {
        let sent = stopped.elapsed();
        let began = Instant::now();
        let r = tokio::time::timeout(
            Duration::from_secs(30),
            run_input(gateway.clone(), &c.ns, "lost-bot", "after"),
        )
        .await;
        let took = began.elapsed();
        slowest = slowest.max(took);
        n += 1;
        let ok = matches!(&r, Ok(Ok(r)) if text(r) == "AFTER");
        if !ok {
            println!("run sent {sent:?} after the loss: {r:?} ({took:?})");
            if sent >= Duration::from_secs(10) {
                late.push(format!("sent {sent:?} after: {r:?}"));
            }
        }
        // Paced as the suite's traffic is (an agent's calls, not a flood): back to back, the held
        // pods would reach maxUses within the 20 s, and until the node controller's verdict the
        // scheduler still places their replacements on the lost node.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("{n} runs in the 20 s after the loss; the slowest took {slowest:?}");
    assert!(
        late.is_empty(),
        "runs sent 10 s or more after the node was lost failed: {late:#?}"
    );
    assert!(
        slowest < Duration::from_secs(5),
        "a run waited {slowest:?}: on a dead pod's exec?"
    );
    // The node controller's verdict (its grace), then the pool made again beside the lost pods.
    let chains = c.chains();
    let (warm, lost_left) = poll(
        Duration::from_secs(180),
        "the pool Ready again on the serving node while the lost node's pods still exist",
        || async {
            let all = c
                .pods()
                .list(&ListParams::default().labels(&format!(
                    "sluice.dev/chain-namespace={},sluice.dev/chain=lost",
                    c.ns
                )))
                .await
                .ok()?
                .items;
            let lost_left = all
                .iter()
                .filter(|p| {
                    on_victim
                        .iter()
                        .any(|v| p.metadata.name.as_deref() == Some(v.as_str()))
                })
                .count();
            let hc = chains.get("lost").await.ok()?;
            let status = hc.status?;
            let ready = status
                .conditions
                .iter()
                .any(|c| c.type_ == "PoolReady" && c.status == "True");
            (ready && status.warm >= WARM && lost_left >= 2).then_some((status.warm, lost_left))
        },
    )
    .await;
    println!(
        "{warm} warm pods on the serving node beside {lost_left} lost ones (max {})",
        WARM + claimed + 1
    );
    drop(_restart);
    c.wait_pool_ready("lost").await;
    let r = c
        .run("lost-bot", "back")
        .await
        .expect("Run once the node is back");
    assert_eq!(text(&r), "BACK");
}

/// Sends `signal` (`STOP`, `CONT`) to every process of the pod whose uid is `uid`: its containers'
/// processes on this machine, found by the pod's cgroup. How many it signalled.
fn signal_pod(uid: &str, signal: &str) -> usize {
    let mut n = 0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(cgroups) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
            continue;
        };
        if cgroups.contains(&format!("pod{uid}"))
            && std::process::Command::new("kill")
                .args([format!("-{signal}"), pid.to_string()])
                .status()
                .is_ok_and(|s| s.success())
        {
            n += 1;
        }
    }
    n
}

/// Resumes a stopped pod's processes when dropped.
struct Resume(String);

impl Drop for Resume {
    fn drop(&mut self) {
        signal_pod(&self.0, "CONT");
    }
}

/// The operator's leader hangs (its processes stopped: it renews nothing and hands nothing back,
/// as a leader cut off or wedged). The other replica takes the Lease when it expires and
/// reconciles: a chain's pod deleted right after is made again within the Lease's duration (15 s)
/// and a margin. Resumed, the old leader does not take the Lease back. (A pod, not a new chain: the
/// hung replica also serves the admission webhook until its readiness probe takes it out of the
/// Service, and a chain applied meanwhile may meet it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_operator_leader_hands_reconciling_over_within_the_lease() {
    let Some(c) = cluster("leader").await else {
        return;
    };
    let release = release_namespace();
    let leases = Api::<Lease>::namespaced(c.client.clone(), &release);
    let operators = poll(
        Duration::from_secs(120),
        "two ready operator replicas",
        || async {
            let pods = release_pods(&c.client, "operator").await;
            (pods.iter().filter(|p| ready(p)).count() >= 2).then_some(pods)
        },
    )
    .await;
    let holder_of = || async {
        leases
            .get("sluice-operator")
            .await
            .ok()?
            .spec?
            .holder_identity
            .filter(|h| !h.is_empty())
    };
    c.apply_chain(
        "failover",
        "failover-bot",
        "input",
        // max: the warm pod and one held by each gateway (chart: holdPerChain 1).
        json!({"pool": {"warm": 1, "max": 4}, "resources": {"cpu": "100m"}}),
        &[("upper", "modify", UPPER)],
    )
    .await;
    c.wait_pool_ready("failover").await;
    let holder = poll(
        Duration::from_secs(60),
        "the operator's Lease held",
        holder_of,
    )
    .await;
    let leader = operators
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(holder.as_str()))
        .unwrap_or_else(|| panic!("the Lease holder {holder} is not an operator pod"));
    let uid = leader.metadata.uid.clone().expect("uid");
    let _resume = Resume(uid.clone());
    let stopped = signal_pod(&uid, "STOP");
    assert!(stopped > 0, "no process of the leader {holder} found here");
    println!("stopped the leader {holder} ({stopped} processes)");
    let hung = Instant::now();
    let before = names(&c.live_pods("failover", "").await);
    for pod in &before {
        c.pods()
            .delete(pod, &DeleteParams::default())
            .await
            .expect("delete the chain's pod");
    }
    poll(
        Duration::from_secs(60),
        "a new pod of the chain, made by the new leader",
        || async {
            let now = names(&c.live_pods("failover", "").await);
            now.iter().any(|p| !before.contains(p)).then_some(())
        },
    )
    .await;
    let took = hung.elapsed();
    let new_holder = holder_of().await.unwrap_or_default();
    println!(
        "the new leader {new_holder} made the chain's pod again {took:?} after the old one hung"
    );
    assert_ne!(new_holder, holder, "the hung leader still holds the Lease");
    assert!(
        took <= Duration::from_secs(15 + 10),
        "reconciling came back after {took:?}: more than the Lease (15 s) and a margin"
    );
    drop(_resume);
    // Awake again, it finds the Lease taken and follows.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        holder_of().await.unwrap_or_default(),
        new_holder,
        "the old leader took the Lease back"
    );
    c.wait_pool_ready("failover").await;
}

/// Both gateways claim from one warm pool at once, a pod per run (`reuse: None`), round after round
/// from a full pool, until the real API server has answered a claim 409 (the `resourceVersion`
/// precondition is the lock). No run fails, and no pod served runs of both gateways (their audits
/// name the pod of each run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_claiming_at_once_never_share_a_pod() {
    let Some(c) = cluster("race").await else {
        return;
    };
    let gateways = two_ready_gateways(&c.client).await;
    let logs = GatewayLogs::follow();
    c.apply_chain(
        "race",
        "race-bot",
        "input",
        // Each gateway takes a pod for its run and claims one ahead to hold: four claims a round.
        json!({"pool": {"warm": 4, "max": 12, "reuse": "None"}, "resources": {"cpu": "100m"}}),
        &[("upper", "modify", UPPER)],
    )
    .await;
    c.wait_pool_ready("race").await;
    let mut clients = Vec::new();
    for g in &gateways {
        clients.push(connect_gateway_pod(g).await);
    }
    let conflicts = || async {
        let mut total = 0.0;
        for g in &gateways {
            total +=
                gateway_counter(g, "sluice_gateway_pod_claims_total", "result=\"conflict\"").await;
        }
        total
    };
    let before = conflicts().await;
    let mut run_ids = Vec::new();
    let mut failed = Vec::new();
    for round in 0..40 {
        // A full pool each round: the runs race for its pods, not for the last one.
        c.wait_pool_ready("race").await;
        let ns = &c.ns;
        let calls = clients.iter().flat_map(|g| {
            (0..1).map(move |i| {
                    let g = g.clone();
                    let ns = ns.clone();
                    async move {
                        run_input(g, &ns, "race-bot", &format!("round {round} call {i}")).await
                    }
                })
        });
        for r in futures::future::join_all(calls).await {
            match r {
                Ok(r) if action(&r) == Action::Modify => run_ids.push(r.run_id.clone()),
                other => failed.push(format!("{other:?}")),
            }
        }
        if conflicts().await > before && round >= 2 {
            break;
        }
    }
    let raced = conflicts().await - before;
    println!(
        "{} runs through two gateways; {raced} claims answered 409",
        run_ids.len()
    );
    assert!(failed.is_empty(), "runs failed: {failed:#?}");
    assert!(
        raced > 0.0,
        "the gateways never raced for a pod (no claim answered 409)"
    );
    let missing = logs.missing(&run_ids, Duration::from_secs(30)).await;
    assert!(missing.is_empty(), "runs in no audit: {missing:?}");
    let mut served_by: HashMap<String, HashSet<String>> = HashMap::new();
    for (gateway, record) in logs.audit() {
        if let Some(sandbox) = record["sandbox"].as_str() {
            served_by
                .entry(sandbox.to_string())
                .or_default()
                .insert(gateway);
        }
    }
    let shared: Vec<_> = served_by.iter().filter(|(_, g)| g.len() > 1).collect();
    assert!(
        shared.is_empty(),
        "pods that served two gateways: {shared:?}"
    );
}

/// The first `key` value of a cgroup file under the pod's cgroup (any hierarchy holding `file`).
fn pod_cgroup_file(uid: &str, file: &str) -> Option<String> {
    fn find(dir: &std::path::Path, name: &str, depth: u32) -> Option<std::path::PathBuf> {
        for e in std::fs::read_dir(dir).ok()?.flatten() {
            let p = e.path();
            if !p.is_dir() {
                continue;
            }
            if p.file_name().is_some_and(|n| n == name) {
                return Some(p);
            }
            if depth > 0
                && let Some(hit) = find(&p, name, depth - 1)
            {
                return Some(hit);
            }
        }
        None
    }
    let hierarchy = file.split('.').next()?;
    let roots = match hierarchy {
        "cpu" => vec!["cpu", "cpu,cpuacct"],
        other => vec![other],
    };
    roots.into_iter().find_map(|h| {
        let pod = find(
            &std::path::Path::new("/sys/fs/cgroup").join(h),
            &format!("pod{uid}"),
            5,
        )?;
        std::fs::read_to_string(pod.join(file))
            .ok()
            .map(|s| s.trim().to_string())
    })
}

const EAT_MEMORY: &str = "def execute(context, settings):\n    keep = []\n    while True:\n        keep.append(bytearray(1 << 20))\n";

/// A sandbox pod's resources reach its cgroup on the node (memory limit, CPU shares and quota), and
/// a hook that eats memory ends its own run, with its chain's failure policy, and nobody else's:
/// another chain's pods on the same nodes keep serving, none restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_limits_reach_the_pods_cgroup_and_a_hook_eating_memory_costs_only_its_run() {
    let Some(c) = cluster("limits").await else {
        return;
    };
    c.apply_chain(
        "neighbour",
        "neighbour-bot",
        "input",
        json!({"pool": {"warm": 2, "max": 4}, "resources": {"cpu": "200m", "memory": "64Mi"}}),
        &[("upper", "modify", UPPER)],
    )
    .await;
    c.apply_chain(
        "hog",
        "hog-bot",
        "input",
        json!({"pool": {"warm": 1, "max": 3}, "failurePolicy": "Closed", "timeoutMs": 10000,
               "resources": {"cpu": "200m", "memory": "64Mi"}}),
        &[("eat", "detect", EAT_MEMORY)],
    )
    .await;
    c.wait_pool_ready("neighbour").await;
    c.wait_pool_ready("hog").await;
    let pod = c.pool_pods("neighbour", "warm").await.remove(0);
    let uid = pod.metadata.uid.clone().expect("uid");
    let limits = pod.spec.as_ref().unwrap().containers[0]
        .resources
        .clone()
        .expect("resources");
    let memory_limit =
        sluice_crds::quantity::memory_bytes(&limits.limits.as_ref().unwrap()["memory"].0)
            .expect("a memory quantity");
    assert_eq!(
        pod_cgroup_file(&uid, "memory.limit_in_bytes").as_deref(),
        Some(memory_limit.to_string().as_str()),
        "the pod's memory limit is its cgroup's"
    );
    // 200m requested: cpu.shares 1024 * 0.2; the platform's CPU limit (one core): a 100 ms quota per
    // 100 ms period.
    assert_eq!(pod_cgroup_file(&uid, "cpu.shares").as_deref(), Some("204"));
    if let Some(cpu) = limits.limits.as_ref().unwrap().get("cpu") {
        let quota: i64 = pod_cgroup_file(&uid, "cpu.cfs_quota_us")
            .and_then(|q| q.parse().ok())
            .expect("a CFS quota");
        let period: i64 = pod_cgroup_file(&uid, "cpu.cfs_period_us")
            .and_then(|q| q.parse().ok())
            .expect("a CFS period");
        let millis = sluice_crds::quantity::cpu_millis(&cpu.0).expect("a cpu quantity") as i64;
        assert_eq!(
            quota * 1000 / period,
            millis,
            "the CPU limit {} is its CFS quota",
            cpu.0
        );
    }
    let neighbours_before: BTreeMap<String, i32> = c
        .live_pods("neighbour", "")
        .await
        .iter()
        .map(|p| (p.metadata.name.clone().unwrap_or_default(), restarts(p)))
        .collect();
    let began = Instant::now();
    let r = c.run("hog-bot", "eat").await;
    let took = began.elapsed();
    println!("the hog's run: {r:?} after {took:?}");
    let r = r.expect("a Run under Closed answers (blocked), it does not error");
    assert_eq!(action(&r), Action::Block, "{r:?}");
    assert!(
        took < Duration::from_secs(15),
        "the hog's run took {took:?}"
    );
    for i in 0..5 {
        let r = c
            .run("neighbour-bot", &format!("still here {i}"))
            .await
            .expect("the neighbour serves");
        assert_eq!(text(&r), format!("STILL HERE {i}"));
    }
    for p in c.live_pods("neighbour", "").await {
        let name = p.metadata.name.clone().unwrap_or_default();
        if let Some(before) = neighbours_before.get(&name) {
            assert_eq!(
                restarts(&p),
                *before,
                "the neighbour's pod {name} restarted"
            );
        }
    }
    c.wait_pool_ready("hog").await;
}

fn restarts(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map(|cs| cs.iter().map(|c| c.restart_count).sum())
        .unwrap_or(0)
}

const RAISES: &str = "def execute(context, settings):\n    raise ValueError('broken candidate')\n";

/// The gateway pods' names whose entries are in the chain's `status.rollout.shadow`.
async fn shadow_gateways(c: &Cluster, chain: &str) -> BTreeSet<String> {
    c.chains()
        .get(chain)
        .await
        .ok()
        .and_then(|hc| hc.status?.rollout)
        .map(|r| r.shadow.into_iter().map(|e| e.gateway).collect())
        .unwrap_or_default()
}

/// Two gateways and one rollout. A canary whose candidate fails is judged by each gateway on its
/// own traffic: the one that serves enough of the candidate's sessions finds it out of bounds and
/// sets `sluice.dev/rollback`; the other, which served the candidate to some sessions but never
/// judged, rolls back too and serves every session the live hooks. Then a shadow candidate: both
/// gateways write their comparison into the chain's status, and a gateway pod deleted (as a
/// rollout or a drain deletes it) takes its own entry away as it stops, while the other's stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_judged_by_two_gateways_and_a_stopped_gateways_shadow_entry() {
    let Some(c) = cluster("canary2").await else {
        return;
    };
    let gateways = two_ready_gateways(&c.client).await;
    let names: Vec<String> = gateways
        .iter()
        .map(|g| g.metadata.name.clone().unwrap())
        .collect();
    let (judge, follower) = (
        connect_gateway_pod(&gateways[0]).await,
        connect_gateway_pod(&gateways[1]).await,
    );
    let logs = GatewayLogs::follow();
    c.apply_chain(
        "canary2",
        "canary2-bot",
        "input",
        json!({"failurePolicy": "Open", "pool": {"warm": 2, "max": 8}}),
        &[("case", "modify", UPPER)],
    )
    .await;
    c.wait_pool_ready("canary2").await;
    let ns = c.ns.clone();
    let answer = |g: GatewayClient, session: String| {
        let ns = ns.clone();
        async move {
            let r = run_in_session(g, &ns, "canary2-bot", "Mixed Case", &session)
                .await
                .unwrap_or_else(|e| panic!("Run in {session}: {e}"));
            text(&r).to_string()
        }
    };
    assert_eq!(answer(judge.clone(), "first".into()).await, "MIXED CASE");

    c.apply_chain(
        "canary2",
        "canary2-bot",
        "input",
        json!({"failurePolicy": "Open", "pool": {"warm": 2, "max": 8},
               "rollout": {"strategy": "Canary", "steps": [50], "stepDuration": "1h", "minRuns": 5}}),
        &[("case", "modify", RAISES)],
    )
    .await;
    let api = c.chains();
    poll(Duration::from_secs(60), "the canary Progressing", || {
        let api = api.clone();
        async move {
            let r = api.get("canary2").await.ok()?.status?.rollout?;
            (r.phase == "Progressing").then_some(())
        }
    })
    .await;
    // The follower serves the candidate to a session or two (fewer than minRuns: it cannot judge).
    let mut follower_canary = Vec::new();
    for i in 0..60 {
        let session = format!("follower-{i}");
        if answer(follower.clone(), session.clone()).await == "Mixed Case" {
            follower_canary.push(session);
            if follower_canary.len() == 2 {
                break;
            }
        }
    }
    assert_eq!(
        follower_canary.len(),
        2,
        "the follower never served the candidate"
    );
    // The judge serves sessions until it rolls the candidate back.
    let mut candidate_runs = 0;
    let until = Instant::now() + Duration::from_secs(120);
    for i in 0.. {
        let r = api
            .get("canary2")
            .await
            .ok()
            .and_then(|hc| hc.status?.rollout);
        if r.as_ref().is_some_and(|r| r.phase == "RolledBack") {
            break;
        }
        assert!(
            Instant::now() < until,
            "the canary was never rolled back: {r:?}"
        );
        if answer(judge.clone(), format!("judge-{i}")).await == "Mixed Case" {
            candidate_runs += 1;
        }
    }
    let annotations = api
        .get("canary2")
        .await
        .expect("the chain")
        .metadata
        .annotations
        .unwrap_or_default();
    assert!(
        annotations.contains_key("sluice.dev/rollback"),
        "{annotations:?}"
    );
    let judged = poll(
        Duration::from_secs(30),
        "the judge's log of the rollback",
        || async {
            let said = logs.said("canary rolled back for the cluster");
            (!said.is_empty()).then_some(said)
        },
    )
    .await;
    assert_eq!(
        judged,
        BTreeSet::from([names[0].clone()]),
        "who judged: {}",
        logs.describe()
    );
    // The follower rolls back too: its canary sessions, and every other, get the live hooks.
    let until = Instant::now() + Duration::from_secs(30);
    for s in &follower_canary {
        loop {
            let got = answer(follower.clone(), s.clone()).await;
            if got == "MIXED CASE" {
                break;
            }
            assert!(
                Instant::now() < until,
                "the follower still serves {s} the candidate: {got:?}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    for i in 0..20 {
        assert_eq!(
            answer(follower.clone(), format!("after-{i}")).await,
            "MIXED CASE"
        );
        assert_eq!(
            answer(judge.clone(), format!("after-{i}")).await,
            "MIXED CASE"
        );
    }
    println!(
        "canary rolled back by {judged:?} after {candidate_runs} candidate runs on it; {} followed",
        names[1]
    );

    // A shadow candidate: both gateways compare and write their entries.
    c.apply_chain(
        "canary2",
        "canary2-bot",
        "input",
        json!({"failurePolicy": "Open", "pool": {"warm": 2, "max": 8}, "rollout": {"strategy": "Shadow"}}),
        &[("case", "modify", LOWER)],
    )
    .await;
    let both: BTreeSet<String> = names.iter().cloned().collect();
    let mut i = 0;
    poll(
        Duration::from_secs(120),
        "both gateways' shadow entries",
        || {
            i += 1;
            let runs = futures::future::join(
                answer(judge.clone(), format!("shadow-{i}")),
                answer(follower.clone(), format!("shadow-{i}")),
            );
            let both = both.clone();
            let c = &c;
            async move {
                let (a, b) = runs.await;
                assert_eq!(
                    (a.as_str(), b.as_str()),
                    ("MIXED CASE", "MIXED CASE"),
                    "a shadow candidate answered"
                );
                (shadow_gateways(c, "canary2").await == both).then_some(())
            }
        },
    )
    .await;
    // The judge's pod is deleted (graceful, as by a rollout or a drain): its entry goes with it.
    let deleted = Instant::now();
    kubectl(&[
        "delete",
        "pod",
        "-n",
        &release_namespace(),
        &names[0],
        "--wait=false",
    ]);
    let gone = poll(
        Duration::from_secs(90),
        "the deleted gateway's shadow entry gone",
        || async {
            let left = shadow_gateways(&c, "canary2").await;
            (!left.contains(&names[0])).then_some(left)
        },
    )
    .await;
    let took = deleted.elapsed();
    assert!(
        gone.contains(&names[1]),
        "the other gateway's entry went too: {gone:?}"
    );
    assert!(
        took < Duration::from_secs(60),
        "the entry went after {took:?}: the operator's pruning (claim deadline), not the gateway's farewell"
    );
    println!(
        "a deleted gateway's shadow entry was gone {took:?} after the delete; the other's stayed"
    );
    // The Deployment's new replica, for the tests after this one.
    two_ready_gateways(&c.client).await;
}
