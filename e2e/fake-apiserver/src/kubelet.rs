//! The scheduler and kubelet stand-ins: what happens to a pod after its create, as a cluster does it.
//!
//! The pod is bound to the one fake node (a `pods/binding` write), waits the configured start latency
//! (image pull, sandbox creation on a real node), then its container starts as a local runsc sandbox
//! shaped like the pod's command (the supervisor, `--listen`). Its readiness probe (the exec command
//! of the pod spec, with its `periodSeconds`, `timeoutSeconds`, `failureThreshold` and
//! `successThreshold`) runs every period for the container's life and flips the `Ready` condition
//! and `containerStatuses[].ready` both ways; every failed probe is an `Unhealthy` Warning Event
//! (counted, as the kubelet's event correlator counts repeats). A container that exits by itself
//! leaves the pod `Succeeded` or `Failed` (restartPolicy `Never`). A deleted pod stays Terminating:
//! its container gets SIGTERM, is killed at the end of the grace period, and only then does the
//! kubelet remove the pod (its final delete), which watchers see as DELETED.

use crate::store::{Resource, now_rfc3339};
use crate::writes::Verb;
use crate::{PodSandbox, Shared};
use serde_json::{Value, json};
use sluice_engine::{SandboxBackend, SandboxHandle, SandboxSpec};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::sync::watch;
use tokio::time::Instant;

pub const NODE: &str = "fake-node";

/// Deadline by which a deleted pod's container must be gone; `None` while the pod is not deleted.
pub(crate) type Deletion = watch::Receiver<Option<Instant>>;

/// Resolves once the pod is deleted (at once if it is).
async fn deleted(deletion: &mut Deletion) {
    // The guard `wait_for` hands back is dropped here, never held across another await.
    let _ = deletion.wait_for(Option::is_some).await;
}

/// A probe of a pod's first container (`startupProbe` or `readinessProbe`), with the kubelet's
/// defaults.
#[derive(Clone, Debug)]
struct Probe {
    command: Vec<String>,
    initial_delay: Duration,
    period: Duration,
    timeout: Duration,
    failure_threshold: u32,
    success_threshold: u32,
}

impl Probe {
    fn of(pod: &Value) -> Option<Probe> {
        Self::of_kind(pod, "readinessProbe")
    }

    fn of_kind(pod: &Value, kind: &str) -> Option<Probe> {
        let p = &pod["spec"]["containers"][0][kind];
        let command: Vec<String> = p["exec"]["command"]
            .as_array()?
            .iter()
            .filter_map(|a| a.as_str().map(str::to_string))
            .collect();
        let secs =
            |field: &str, default: u64| Duration::from_secs(p[field].as_u64().unwrap_or(default));
        let count = |field: &str, default: u32| {
            p[field]
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(default)
                .max(1)
        };
        Some(Probe {
            command,
            initial_delay: secs("initialDelaySeconds", 0),
            period: secs("periodSeconds", 10).max(Duration::from_secs(1)),
            timeout: secs("timeoutSeconds", 1).max(Duration::from_secs(1)),
            failure_threshold: count("failureThreshold", 3),
            success_threshold: count("successThreshold", 1),
        })
    }
}

/// Why the fake cannot start a pod's container.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ContainerError {
    #[error("the fake kubelet runs only the sandbox supervisor; the container's command is {0:?}")]
    NotASupervisor(Vec<String>),
    #[error("the container's {flag} is not a number: {value:?}")]
    BadFlag { flag: &'static str, value: String },
    #[error("the sandbox did not start: {0}")]
    Start(#[from] sluice_engine::StartError),
}

/// The local sandbox a pod's container becomes: its chain, limits and worker count, read from the
/// pod as the operator builds it.
fn sandbox_spec(namespace: &str, pod: &Value) -> Result<SandboxSpec, ContainerError> {
    let container = &pod["spec"]["containers"][0];
    let command: Vec<String> = container["command"]
        .as_array()
        .map(|c| {
            c.iter()
                .filter_map(|a| a.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    if !command
        .iter()
        .any(|a| a == sluice_crds::sandbox_pod::SUPERVISOR)
    {
        return Err(ContainerError::NotASupervisor(command));
    }
    let flag = |name: &'static str| -> Result<Option<u64>, ContainerError> {
        let Some(i) = command.iter().position(|a| a == name) else {
            return Ok(None);
        };
        let value = command.get(i + 1).cloned().unwrap_or_default();
        value
            .parse()
            .map(Some)
            .map_err(|_| ContainerError::BadFlag { flag: name, value })
    };
    let memory_bytes = flag("--memory-bytes")?.unwrap_or(256 << 20);
    let pids = flag("--pids")?.unwrap_or(64);
    // As a kubelet: the request is the sandbox's share, the limit (if any) its CFS quota.
    let resources = &container["resources"];
    let cpu = resources["requests"]["cpu"]
        .as_str()
        .or(resources["limits"]["cpu"].as_str())
        .unwrap_or("1")
        .to_string();
    let cpu_limit = resources["limits"]["cpu"].as_str().map(str::to_string);
    let chain = pod["metadata"]["labels"][sluice_crds::sandbox_pod::LABEL_CHAIN]
        .as_str()
        .or_else(|| pod["metadata"]["name"].as_str())
        .unwrap_or_default()
        .to_string();
    Ok(SandboxSpec {
        namespace: namespace.to_string(),
        chain,
        cpu,
        cpu_limit,
        // The sandbox's memory limit is the pod's; the supervisor's flag says it in bytes.
        memory: memory_bytes.to_string(),
        pids: u32::try_from(pids).unwrap_or(u32::MAX),
    })
}

/// Sets condition `type_` of a pod's status; its `lastTransitionTime` moves only when it flips.
fn set_condition(pod: &mut Value, type_: &str, status: bool, reason: Option<&str>) {
    let status = if status { "True" } else { "False" };
    if !pod["status"]["conditions"].is_array() {
        pod["status"]["conditions"] = json!([]);
    }
    let Some(conditions) = pod["status"]["conditions"].as_array_mut() else {
        return;
    };
    let mut condition =
        json!({"type": type_, "status": status, "lastTransitionTime": now_rfc3339()});
    if let Some(r) = reason {
        condition["reason"] = json!(r);
    }
    match conditions.iter_mut().find(|c| c["type"] == type_) {
        Some(c) if c["status"] == status => {
            if let Some(r) = reason {
                c["reason"] = json!(r);
            }
        }
        Some(c) => *c = condition,
        None => conditions.push(condition),
    }
}

/// The first container's status, created if missing.
fn container_status(pod: &mut Value) -> &mut Value {
    let name = pod["spec"]["containers"][0]["name"].clone();
    let image = pod["spec"]["containers"][0]["image"].clone();
    if !pod["status"]["containerStatuses"].is_array() {
        pod["status"]["containerStatuses"] = json!([{
            "name": name, "image": image, "imageID": "", "ready": false, "started": false,
            "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}},
        }]);
    }
    &mut pod["status"]["containerStatuses"][0]
}

impl Shared {
    /// Writes pod status as the kubelet does (a `pods/status` patch), if `change` changed it.
    fn write_status(&self, namespace: &str, name: &str, change: impl FnOnce(&mut Value)) -> bool {
        let mut changed = false;
        let stored = self.store.modify(Resource::Pods, namespace, name, |pod| {
            let before = pod["status"].clone();
            change(pod);
            changed = pod["status"] != before;
            changed
        });
        if changed {
            self.writes.count(Verb::Patch, "pods/status");
        }
        stored.is_some()
    }

    /// A core/v1 Event about a pod, from the kubelet or the scheduler. A repeat of the same reason
    /// and message on the same pod bumps the first one's `count` (a patch), as the kubelet's event
    /// correlator does.
    pub(crate) fn pod_event(
        &self,
        pod: &Value,
        type_: &str,
        reason: &str,
        message: &str,
        from: &str,
    ) {
        let namespace = pod["metadata"]["namespace"].as_str().unwrap_or("default");
        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
        let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
        let similar = format!("{uid}\0{reason}\0{message}");
        let now = now_rfc3339();
        let existing = self
            .kubelet_events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&similar)
            .cloned();
        if let Some(event) = existing {
            let bumped = self.store.modify(Resource::Events, namespace, &event, |e| {
                let count = e["count"].as_u64().unwrap_or(1) + 1;
                e["count"] = json!(count);
                e["lastTimestamp"] = json!(now);
                true
            });
            if bumped.is_some() {
                self.writes.count(Verb::Patch, "events");
                return;
            }
        }
        let event_name = format!("{name}.{}", self.store.next_suffix());
        let object = json!({
            "metadata": {"name": event_name, "namespace": namespace},
            "involvedObject": {
                "kind": "Pod", "apiVersion": "v1", "namespace": namespace, "name": name, "uid": uid,
                "fieldPath": "spec.containers{supervisor}",
            },
            "reason": reason,
            "message": message,
            "type": type_,
            "count": 1,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "source": {"component": from, "host": NODE},
            "reportingComponent": from,
            "reportingInstance": NODE,
        });
        if self.store.create(Resource::Events, object).is_ok() {
            self.writes.count(Verb::Create, "events");
            self.kubelet_events
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(similar, event_name);
        }
    }

    /// Runs the pod's readiness probe command in sandbox `id`, as the kubelet runs exec probes.
    /// The sandbox holds only what the supervisor image holds (`/opt/sluice/`); a probe of any
    /// other program (a test's own, to make a probe flap) runs on this host instead, as kwok runs
    /// exec: what is checked then is the kubelet's probing, not where the command ran.
    pub(crate) async fn probe(
        &self,
        id: &str,
        command: &[String],
        timeout: Duration,
    ) -> Result<(), String> {
        let in_image = command
            .first()
            .is_some_and(|c| c.starts_with("/opt/sluice/"));
        let child = if in_image {
            self.backend
                .exec(id, &self.in_sandbox(command))
                .await
                .map_err(|e| e.to_string())?
        } else {
            let (program, args) = command.split_first().ok_or("an empty probe command")?;
            tokio::process::Command::new(program)
                .args(args)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| format!("cannot run {program}: {e}"))?
        };
        let out = tokio::time::timeout(timeout, child.wait_with_output())
            .await
            .map_err(|_| format!("command timed out after {}s", timeout.as_secs()))?
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            let said = String::from_utf8_lossy(&out.stderr).trim().to_string();
            Err(format!(
                "command exited with {}: {said}",
                out.status.code().unwrap_or(-1)
            ))
        }
    }

    /// SIGTERM to the container's main process, as the kubelet asks the runtime to stop it.
    async fn sigterm(&self, id: &str) {
        let sent = tokio::process::Command::new("runsc")
            .arg("--root")
            .arg(&self.runsc_root)
            .args(["kill", id, "TERM"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .status();
        if let Ok(Err(e)) = tokio::time::timeout(Duration::from_secs(10), sent).await {
            tracing::debug!(sandbox = id, error = %e, "runsc kill TERM failed");
        }
    }

    /// The container's exit code, waited for as the runtime reports it (`None`: not known).
    async fn wait_exit(root: std::path::PathBuf, id: String) -> Option<i32> {
        let out = tokio::process::Command::new("runsc")
            .arg("--root")
            .arg(&root)
            .args(["wait", &id])
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .ok()?;
        let v: Value = serde_json::from_slice(&out.stdout).ok()?;
        // A wait status: the exit code in the high byte, or the signal that ended the process.
        let ws = i32::try_from(v["exitStatus"].as_i64()?).ok()?;
        Some(if ws & 0x7f == 0 {
            (ws >> 8) & 0xff
        } else {
            128 + (ws & 0x7f)
        })
    }
}

/// The life of one pod on the fake node, from its binding to its removal.
pub(crate) async fn run_pod(
    s: Arc<Shared>,
    namespace: String,
    name: String,
    mut deletion: Deletion,
) {
    let key = format!("{namespace}/{name}");
    // The scheduler binds the pod at once: the one node always fits.
    let bound = s.store.modify(Resource::Pods, &namespace, &name, |pod| {
        pod["spec"]["nodeName"] = json!(NODE);
        set_condition(pod, "PodScheduled", true, None);
        true
    });
    let Some(pod) = bound else {
        s.finish_pod(&namespace, &name).await;
        return;
    };
    s.writes.count(Verb::Create, "pods/binding");
    s.pod_event(
        &pod,
        "Normal",
        "Scheduled",
        &format!("Successfully assigned {key} to {NODE}"),
        "default-scheduler",
    );
    let started = tokio::select! {
        _ = tokio::time::sleep(s.pod_start_latency) => true,
        _ = deleted(&mut deletion) => false,
    };
    if !started {
        s.finish_pod(&namespace, &name).await;
        return;
    }
    let Some(pod) = s.store.get(Resource::Pods, &namespace, &name) else {
        return;
    };
    let started = match sandbox_spec(&namespace, &pod) {
        Ok(spec) => s.backend.start(&spec).await.map_err(ContainerError::from),
        Err(e) => Err(e),
    };
    let sandbox = match started {
        Ok(sandbox) => sandbox,
        Err(e) => {
            s.pod_event(&pod, "Warning", "Failed", &format!("Error: {e}"), "kubelet");
            s.write_status(&namespace, &name, |p| {
                p["status"]["phase"] = json!("Failed");
                let c = container_status(p);
                c["state"] = json!({"terminated": {"exitCode": 128, "reason": "StartError", "message": e.to_string(), "finishedAt": now_rfc3339()}});
                set_condition(p, "Ready", false, Some("PodFailed"));
            });
            deleted(&mut deletion).await;
            s.finish_pod(&namespace, &name).await;
            return;
        }
    };
    let id = sandbox.id.clone();
    let handle: Arc<dyn SandboxHandle> = Arc::from(sandbox.handle);
    s.set_sandbox(&key, Some((id.clone(), handle.clone())));
    // The container's log (the supervisor's own lines) is read so it never blocks; its end and the
    // runtime's exit status say the container is gone.
    let mut log = sandbox.protocol;
    let waited = tokio::spawn(Shared::wait_exit(s.runsc_root.clone(), id.clone()));
    let mut exited = tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        while let Ok(n) = log.read(&mut buf).await {
            if n == 0 {
                break;
            }
            tracing::debug!(log = %String::from_utf8_lossy(&buf[..n]).trim_end(), "fake pod");
        }
        waited.await.ok().flatten()
    });
    let image = pod["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    for (reason, message) in [
        (
            "Pulled",
            format!("Container image \"{image}\" already present on machine"),
        ),
        ("Created", "Created container supervisor".to_string()),
        ("Started", "Started container supervisor".to_string()),
    ] {
        s.pod_event(&pod, "Normal", reason, &message, "kubelet");
    }
    s.write_status(&namespace, &name, |p| {
        p["status"]["phase"] = json!("Running");
        p["status"]["hostIP"] = json!("10.0.0.1");
        p["status"]["podIP"] = json!("10.1.0.1");
        p["status"]["startTime"] = json!(now_rfc3339());
        set_condition(p, "Initialized", true, None);
        set_condition(p, "ContainersReady", false, Some("ContainersNotReady"));
        set_condition(p, "Ready", false, Some("ContainersNotReady"));
        let c = container_status(p);
        c["started"] = json!(true);
        c["containerID"] = json!(format!("runsc://{id}"));
        c["state"] = json!({"running": {"startedAt": now_rfc3339()}});
    });

    // As a kubelet: the startup probe (if any) runs until it succeeds once enough; then the
    // readiness probe (if any) runs for the pod's life; a container with neither is ready once
    // started (after its startup probe, once that passed).
    let startup = Probe::of_kind(&pod, "startupProbe");
    let readiness = Probe::of(&pod);
    let mut starting = startup.is_some();
    let mut probe = startup.clone().or_else(|| readiness.clone());
    let (mut ready, mut successes, mut failures) = (false, 0u32, 0u32);
    let mut next = Instant::now() + probe.as_ref().map(|p| p.initial_delay).unwrap_or_default();
    let ended_by_itself = loop {
        tokio::select! {
            biased;
            code = &mut exited => break Some(code.ok().flatten()),
            _ = deleted(&mut deletion) => break None,
            _ = tokio::time::sleep_until(next) => {
                let Some(p) = probe.clone() else {
                    // No (more) probe: ready once started, as the kubelet says.
                    ready = true;
                    s.set_ready(&namespace, &name, true);
                    next = Instant::now() + Duration::from_secs(3600);
                    continue;
                };
                // The kubelet's ticker runs every period, whatever the probe took.
                next += p.period;
                match s.probe(&id, &p.command, p.timeout).await {
                    Ok(()) => {
                        (successes, failures) = (successes + 1, 0);
                        if starting && successes >= p.success_threshold {
                            starting = false;
                            successes = 0;
                            probe = readiness.clone();
                            next = Instant::now();
                            continue;
                        }
                        if !ready && successes >= p.success_threshold {
                            ready = true;
                            s.set_ready(&namespace, &name, true);
                        }
                    }
                    Err(why) => {
                        (successes, failures) = (0, failures + 1);
                        let which = if starting { "Startup" } else { "Readiness" };
                        if let Some(pod) = s.store.get(Resource::Pods, &namespace, &name) {
                            s.pod_event(&pod, "Warning", "Unhealthy", &format!("{which} probe failed: {why}"), "kubelet");
                        }
                        if ready && failures >= p.failure_threshold {
                            ready = false;
                            s.set_ready(&namespace, &name, false);
                        }
                    }
                }
                let now = Instant::now();
                while next <= now {
                    next += p.period;
                }
            }
        }
    };
    let code = match ended_by_itself {
        Some(code) => code,
        None => {
            // Deleted: SIGTERM, then the kill at the grace period's end.
            if let Some(pod) = s.store.get(Resource::Pods, &namespace, &name) {
                s.pod_event(
                    &pod,
                    "Normal",
                    "Killing",
                    "Stopping container supervisor",
                    "kubelet",
                );
            }
            let deadline = deletion.borrow().unwrap_or_else(Instant::now);
            s.sigterm(&id).await;
            match tokio::time::timeout_at(deadline, &mut exited).await {
                Ok(code) => code.ok().flatten(),
                Err(_) => {
                    handle.destroy(true).await;
                    exited.await.ok().flatten().or(Some(137))
                }
            }
        }
    };
    // The container is gone: no exec reaches it any more, and what it left is cleaned up.
    s.set_sandbox(&key, None);
    handle.destroy(false).await;
    s.write_status(&namespace, &name, |p| {
        let (exit_code, reason) = match code {
            Some(0) => (0, "Completed"),
            Some(c) => (c, "Error"),
            None => (137, "ContainerStatusUnknown"),
        };
        p["status"]["phase"] = json!(if code == Some(0) { "Succeeded" } else { "Failed" });
        set_condition(p, "ContainersReady", false, Some("PodCompleted"));
        set_condition(p, "Ready", false, Some("PodCompleted"));
        let c = container_status(p);
        c["ready"] = json!(false);
        c["started"] = json!(false);
        c["state"] = json!({"terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": now_rfc3339()}});
    });
    deleted(&mut deletion).await;
    s.finish_pod(&namespace, &name).await;
}

impl Shared {
    fn set_ready(&self, namespace: &str, name: &str, ready: bool) {
        self.write_status(namespace, name, |p| {
            let reason = (!ready).then_some("ContainersNotReady");
            set_condition(p, "ContainersReady", ready, reason);
            set_condition(p, "Ready", ready, reason);
            container_status(p)["ready"] = json!(ready);
        });
    }

    pub(crate) fn set_sandbox(&self, key: &str, sandbox: Option<PodSandbox>) {
        if let Some(rt) = self
            .pods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(key)
        {
            rt.sandbox = sandbox;
        }
    }

    /// The kubelet's last word on a deleted pod whose containers are gone: it removes the object
    /// (a delete with grace 0, preconditioned on the uid) and forgets the pod.
    async fn finish_pod(&self, namespace: &str, name: &str) {
        if self
            .store
            .remove(Resource::Pods, namespace, name, None)
            .is_ok()
        {
            self.writes.count(Verb::Delete, "pods");
        }
        self.pods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&format!("{namespace}/{name}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sandbox_follows_the_pods_command_and_limits() {
        let pod = json!({
            "metadata": {"name": "c-x", "labels": {"sluice.dev/chain": "c"}},
            "spec": {"containers": [{
                "command": sluice_crds::sandbox_pod::supervisor_command(1 << 27, 48),
                "resources": {"requests": {"cpu": "250m"}, "limits": {"cpu": "1"}},
                "readinessProbe": {"exec": {"command": ["true"]}, "periodSeconds": 4, "failureThreshold": 2},
            }]},
        });
        let spec = sandbox_spec("ns", &pod).unwrap();
        assert_eq!(
            (
                spec.chain.as_str(),
                spec.memory.as_str(),
                spec.pids,
                spec.cpu.as_str()
            ),
            ("c", "134217728", 48, "250m")
        );
        assert_eq!(spec.cpu_limit.as_deref(), Some("1"));
        let p = Probe::of(&pod).unwrap();
        assert_eq!(
            (
                p.period,
                p.timeout,
                p.failure_threshold,
                p.success_threshold
            ),
            (Duration::from_secs(4), Duration::from_secs(1), 2, 1)
        );
        let other = json!({"spec": {"containers": [{"command": ["nginx"]}]}});
        assert!(matches!(
            sandbox_spec("ns", &other),
            Err(ContainerError::NotASupervisor(_))
        ));
    }

    #[test]
    fn conditions_move_their_transition_time_only_on_a_flip() {
        let mut pod = json!({"spec": {"containers": [{"name": "supervisor"}]}});
        set_condition(&mut pod, "Ready", false, None);
        pod["status"]["conditions"][0]["lastTransitionTime"] = json!("then");
        set_condition(&mut pod, "Ready", false, Some("ContainersNotReady"));
        assert_eq!(pod["status"]["conditions"][0]["lastTransitionTime"], "then");
        set_condition(&mut pod, "Ready", true, None);
        assert_ne!(pod["status"]["conditions"][0]["lastTransitionTime"], "then");
        assert_eq!(pod["status"]["conditions"][0]["status"], "True");
    }
}
