//! The fake behaves as an API server and a kubelet do where the gateway and the operator can tell:
//! graceful pod deletion, probes every period, watch expiry (410) and bookmarks, counted writes.
//! Real runsc sandboxes; nothing here is timed, only waited for (with a bound, so a bug fails).

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Preconditions, WatchEvent, WatchParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::{Value, json};
use sluice_engine::SandboxSpec;
use sluice_fake_apiserver::{ExecProtocol, FakeApiServer, Resource, Verb};
use std::time::Duration;

fn spec(chain: &str) -> SandboxSpec {
    SandboxSpec {
        namespace: "default".into(),
        chain: chain.into(),
        cpu: "250m".into(),
        cpu_limit: None,
        memory: "256Mi".into(),
        pids: 64,
    }
}

async fn fake() -> FakeApiServer {
    FakeApiServer::builder()
        .protocol(ExecProtocol::V5)
        .pod_start_latency(Duration::from_millis(200))
        .start()
        .await
        .expect("fake API server")
}

/// Polls `check` every 50 ms, up to `secs` seconds; the last value it saw otherwise.
async fn eventually<T>(secs: u64, mut check: impl FnMut() -> Option<T>) -> Option<T> {
    for _ in 0..secs * 20 {
        if let Some(v) = check() {
            return Some(v);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

fn ready(pod: &Value) -> bool {
    pod["status"]["conditions"].as_array().is_some_and(|cs| {
        cs.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_pod_is_terminating_until_its_container_is_gone() {
    let api = fake().await;
    let name = api.add_warm_pod(&spec("grace")).await.expect("a Ready pod");
    let pods: Api<Pod> = Api::namespaced(api.client(), "default");
    let before = api.get(Resource::Pods, "default", &name).expect("pod");
    assert!(ready(&before), "{before}");
    assert_eq!(before["status"]["containerStatuses"][0]["ready"], true);
    // A watch from now on sees what happens to it.
    let rv = before["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    let mut events = pods
        .watch(&WatchParams::default(), &rv)
        .await
        .expect("watch")
        .boxed();
    // A stale precondition is refused, and nothing happens to the pod.
    let stale = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: Some("1".into()),
            uid: None,
        }),
        ..Default::default()
    };
    match pods.delete(&name, &stale).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 409, "{s:?}"),
        other => panic!("a stale precondition was not refused: {other:?}"),
    }
    // The delete with a grace period: the pod stays, Terminating.
    let long = DeleteParams {
        grace_period_seconds: Some(20),
        ..Default::default()
    };
    pods.delete(&name, &long).await.expect("delete");
    let terminating = api.get(Resource::Pods, "default", &name);
    let terminating = terminating.expect("a deleted pod stays until its container is gone");
    assert!(
        terminating["metadata"]["deletionTimestamp"].is_string(),
        "{terminating}"
    );
    assert_eq!(terminating["metadata"]["deletionGracePeriodSeconds"], 20);
    // A second delete with a longer grace keeps the earlier deadline.
    let longer = DeleteParams {
        grace_period_seconds: Some(300),
        ..Default::default()
    };
    pods.delete(&name, &longer).await.expect("second delete");
    let again = api.get(Resource::Pods, "default", &name);
    if let Some(again) = again {
        assert_eq!(
            again["metadata"]["deletionTimestamp"], terminating["metadata"]["deletionTimestamp"],
            "the deadline moved"
        );
    }
    // Watchers see it Terminating (MODIFIED), then gone (DELETED) once SIGTERM ended it.
    let mut seen = Vec::new();
    loop {
        let next = tokio::time::timeout(Duration::from_secs(60), events.try_next()).await;
        let ev = match next {
            Ok(Ok(Some(ev))) => ev,
            other => panic!("the watch ended before the pod went: {other:?} after {seen:?}"),
        };
        match ev {
            WatchEvent::Modified(p) => seen.push(format!(
                "MODIFIED deleting={}",
                p.metadata.deletion_timestamp.is_some()
            )),
            WatchEvent::Deleted(_) => {
                seen.push("DELETED".into());
                break;
            }
            WatchEvent::Bookmark(_) => {}
            other => seen.push(format!("{other:?}")),
        }
    }
    assert!(
        seen.first().is_some_and(|s| s == "MODIFIED deleting=true"),
        "{seen:?}"
    );
    assert_eq!(seen.last().map(String::as_str), Some("DELETED"), "{seen:?}");
    assert!(api.get(Resource::Pods, "default", &name).is_none());
    assert!(api.live_sandboxes().await.is_empty());
    // What this pod's life cost, as the audit log would count it.
    let w = api.writes();
    println!("{w}");
    assert_eq!(w.get(Verb::Create, "pods"), 1);
    assert_eq!(w.get(Verb::Create, "pods/binding"), 1);
    assert!(w.get(Verb::Patch, "pods/status") >= 3, "{w}");
    // The stale delete, the two client deletes, the kubelet's final one.
    assert_eq!(w.get(Verb::Delete, "pods"), 4, "{w}");
    assert!(
        w.on("events") >= 5,
        "Scheduled, Pulled, Created, Started, Killing: {w}"
    );
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kubelet_probes_every_period_and_flips_ready_both_ways() {
    let api = fake().await;
    // A probe that passes and fails in turns of a few seconds, checked every second.
    let flapping = [
        "python3",
        "-c",
        "import sys,time; sys.exit(int(time.time()) // 3 % 2)",
    ];
    let pod = json!({
        "metadata": {"generateName": "flap-", "namespace": "default", "labels": {"sluice.dev/chain": "flap"}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "supervisor", "image": "fake",
                "command": sluice_crds::sandbox_pod::supervisor_command(256 << 20, 64),
                "readinessProbe": {"exec": {"command": flapping}, "periodSeconds": 1, "failureThreshold": 1},
            }],
        },
    });
    let created = api.create_pod(pod).expect("created");
    let name = created["metadata"]["name"].as_str().unwrap().to_string();
    assert_eq!(created["status"]["phase"], "Pending");
    let get = || {
        api.get(Resource::Pods, "default", &name)
            .unwrap_or(Value::Null)
    };
    assert!(
        eventually(60, || ready(&get()).then_some(()))
            .await
            .is_some(),
        "never Ready: {}",
        get()
    );
    assert!(
        eventually(60, || (!ready(&get())).then_some(()))
            .await
            .is_some(),
        "never NotReady again: {}",
        get()
    );
    assert_eq!(get()["status"]["containerStatuses"][0]["ready"], false);
    assert!(
        eventually(60, || ready(&get()).then_some(()))
            .await
            .is_some(),
        "never Ready again: {}",
        get()
    );
    // Each failed probe is an Unhealthy Warning, repeats counted on one Event.
    let unhealthy: Vec<Value> = api
        .list(Resource::Events, "default")
        .into_iter()
        .filter(|e| e["reason"] == "Unhealthy" && e["involvedObject"]["name"] == name.as_str())
        .collect();
    assert!(!unhealthy.is_empty(), "no Unhealthy event");
    assert!(
        unhealthy
            .iter()
            .all(|e| e["type"] == "Warning" && e["count"].as_u64() >= Some(1))
    );
    // Its container dies: the pod is Failed, as the kubelet reports a killed container.
    api.kill_pod("default", &name).await;
    let pod = get();
    assert_eq!(pod["status"]["phase"], "Failed", "{pod}");
    assert!(
        pod["status"]["containerStatuses"][0]["state"]["terminated"].is_object(),
        "{pod}"
    );
    assert!(!ready(&pod));
    api.stop().await;
}

fn static_pod(i: usize) -> Value {
    json!({"metadata": {"name": format!("p{i}"), "namespace": "default"}, "spec": {}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kube_watcher_relists_after_410_gone() {
    let api = FakeApiServer::builder()
        .watch_history(5)
        .start()
        .await
        .expect("fake");
    api.apply(Resource::Pods, static_pod(0));
    let pods: Api<Pod> = Api::namespaced(api.client(), "default");
    let (reader, writer) = reflector::store::<Pod>();
    let mut stream = watcher(pods, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .boxed();
    let mut inits = 0;
    // The first list.
    while let Ok(Some(Ok(ev))) = tokio::time::timeout(Duration::from_secs(30), stream.next()).await
    {
        if matches!(ev, watcher::Event::InitDone) {
            inits += 1;
            break;
        }
    }
    assert_eq!(inits, 1);
    // While it is not looking, more changes than the fake keeps, and its connection drops.
    for i in 1..20 {
        api.apply(Resource::Pods, static_pod(i));
    }
    api.restart();
    for i in 20..30 {
        api.apply(Resource::Pods, static_pod(i));
    }
    // It resumes from a version the fake no longer has, is told 410, and lists again.
    while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_secs(30), stream.next()).await {
        if matches!(ev, Ok(watcher::Event::InitDone)) {
            inits += 1;
        }
        if reader.state().len() == 30 && inits >= 2 {
            break;
        }
    }
    assert!(inits >= 2, "the watcher never listed again");
    assert_eq!(reader.state().len(), 30, "the relisted cache is complete");
    let lists = api
        .requests()
        .iter()
        .filter(|r| r.method == "GET" && !r.query.contains("watch=true"))
        .count();
    assert!(lists >= 2, "it listed again");
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn watches_that_allow_bookmarks_get_them() {
    let api = FakeApiServer::builder()
        .bookmark_interval(Duration::from_millis(200))
        .start()
        .await
        .expect("fake");
    api.apply(Resource::Pods, static_pod(0));
    let pods: Api<Pod> = Api::namespaced(api.client(), "default");
    // Periodic bookmarks on a plain watch.
    let mut events = pods
        .watch(&WatchParams::default(), "0")
        .await
        .expect("watch")
        .boxed();
    let mut bookmark = None;
    while let Ok(Some(Ok(ev))) = tokio::time::timeout(Duration::from_secs(30), events.next()).await
    {
        if let WatchEvent::Bookmark(b) = ev {
            bookmark = Some(b);
            break;
        }
    }
    let bookmark = bookmark.expect("a bookmark");
    assert!(bookmark.metadata.resource_version.parse::<u64>().is_ok());
    // A streaming list (sendInitialEvents) ends its initial events with the annotated bookmark,
    // which is what lets kube's watcher say it is done listing.
    let (reader, writer) = reflector::store::<Pod>();
    let mut stream = watcher(pods, watcher::Config::default().streaming_lists())
        .reflect(writer)
        .boxed();
    let mut done = false;
    while let Ok(Some(Ok(ev))) = tokio::time::timeout(Duration::from_secs(30), stream.next()).await
    {
        if matches!(ev, watcher::Event::InitDone) {
            done = true;
            break;
        }
    }
    assert!(done, "the streaming list never ended");
    assert_eq!(reader.state().len(), 1);
    api.stop().await;
}

/// Finalizers and JSON patches as the API server does them, as kube's finalizer helper relies on:
/// a `test` against null passes on an object without finalizers, a failed `test` is refused, a
/// delete only marks an object with finalizers, and removing the last one deletes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn finalizers_hold_a_deleted_object_until_they_are_removed() {
    use kube::api::{Patch, PatchParams};
    use sluice_crds::HookChain;
    let api = fake().await;
    api.apply(
        Resource::HookChains,
        json!({"apiVersion": "sluice.dev/v1alpha1", "kind": "HookChain",
               "metadata": {"name": "held", "namespace": "default"},
               "spec": {"target": "bot", "triggerPoint": "input",
                        "hooks": [{"name": "h", "action": "block", "code": "x"}]}}),
    );
    let chains: Api<HookChain> = Api::namespaced(api.client(), "default");
    let add = json!([
        {"op": "test", "path": "/metadata/finalizers", "value": null},
        {"op": "add", "path": "/metadata/finalizers", "value": ["sluice.dev/sandboxes"]}
    ]);
    let patch = |v: &Value| Patch::<()>::Json(serde_json::from_value(v.clone()).unwrap());
    let held = chains
        .patch("held", &PatchParams::default(), &patch(&add))
        .await
        .expect("the finalizer is added");
    assert_eq!(
        held.metadata.finalizers,
        Some(vec!["sluice.dev/sandboxes".into()])
    );
    // The same patch again: its test fails now, and the server says so.
    let again = chains
        .patch("held", &PatchParams::default(), &patch(&add))
        .await;
    assert!(matches!(again, Err(kube::Error::Api(_))), "{again:?}");

    chains
        .delete("held", &DeleteParams::default())
        .await
        .expect("delete");
    let marked = api
        .get(Resource::HookChains, "default", "held")
        .expect("still there while a finalizer holds it");
    assert!(
        marked["metadata"]["deletionTimestamp"].is_string(),
        "{marked}"
    );

    let remove = json!([
        {"op": "test", "path": "/metadata/finalizers/0", "value": "sluice.dev/sandboxes"},
        {"op": "remove", "path": "/metadata/finalizers/0"}
    ]);
    chains
        .patch("held", &PatchParams::default(), &patch(&remove))
        .await
        .expect("the finalizer is removed");
    assert!(
        api.get(Resource::HookChains, "default", "held").is_none(),
        "gone with its last finalizer"
    );
    api.stop().await;
}

/// The host processes whose command line names sandbox `id` (its runsc, sandbox and gofer).
fn processes_of(id: &str) -> Vec<String> {
    let suffix = format!("/{id}");
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let names = cmdline
                .split(|b| *b == 0)
                .any(|a| a == id.as_bytes() || a.ends_with(suffix.as_bytes()));
            names.then(|| String::from_utf8_lossy(&cmdline).replace('\0', " "))
        })
        .collect()
}

/// A test that fails (panics) before `stop` leaves none of its pods' sandboxes behind: no process,
/// no cgroup.
#[test]
fn a_test_that_panics_leaves_no_sandbox_behind() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let record = seen.clone();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(async move {
            let api = fake().await;
            api.add_warm_pod(&spec("leak")).await.expect("a Ready pod");
            let live = api.live_sandboxes().await;
            *record.lock().unwrap() = Some((api.state_dir().to_path_buf(), live));
            panic!("the test failed with its fake API server running");
        })
    }));
    assert!(panicked.is_err());
    let (dir, live) = seen.lock().unwrap().take().expect("the test got that far");
    assert_eq!(live.len(), 1, "the pod's sandbox ran: {live:?}");
    for id in &live {
        let left = processes_of(id);
        assert!(left.is_empty(), "sandbox {id} outlived its test: {left:?}");
    }
    let cgroups = sluice_sandbox_local::leftover_cgroups(&dir);
    assert!(cgroups.is_empty(), "cgroups left: {cgroups:?}");
}
