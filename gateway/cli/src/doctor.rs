//! `sluice doctor`: after an install, whether the cluster can really serve chains, read from the
//! cluster itself (KUBECONFIG): the CRDs are served, the operator and the gateway are available, the
//! RuntimeClass exists, and a pod of that RuntimeClass, made like a sandbox pod from the release's
//! supervisor image, runs a hook in a cell under gVisor. When it cannot, each check says why, in the
//! cluster's own words (the pod's events: a node without the `runsc` handler, an image that cannot
//! be pulled, a pod Pod Security refuses).

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::node::v1::RuntimeClass;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use sluice_crds::HookChain;
use sluice_crds::sandbox_pod::{RUNTIME, SUPERVISOR};
use std::time::{Duration, Instant};

/// What to look at.
#[derive(Clone, Debug)]
pub struct Options {
    /// The release's namespace (where the operator and the gateway run).
    pub namespace: String,
    /// The RuntimeClass to try; default: the operator's `--runtime-class`.
    pub runtime_class: Option<String>,
    /// How long the gVisor pod may take to run.
    pub timeout: Duration,
}

/// One check: what, whether it holds, and why.
#[derive(Clone, Debug)]
pub struct Check {
    pub what: &'static str,
    pub ok: bool,
    pub detail: String,
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mark = if self.ok { "ok  " } else { "FAIL" };
        write!(f, "{mark} {}: {}", self.what, self.detail)
    }
}

fn check(what: &'static str, ok: bool, detail: impl Into<String>) -> Check {
    Check {
        what,
        ok,
        detail: detail.into(),
    }
}

/// The operator's command-line value of `--flag=`, if it has one.
fn arg_of(deployment: &Deployment, flag: &str) -> Option<String> {
    let prefix = format!("{flag}=");
    deployment
        .spec
        .as_ref()?
        .template
        .spec
        .as_ref()?
        .containers
        .iter()
        .flat_map(|c| c.args.iter().flatten())
        .find_map(|a| a.strip_prefix(&prefix).map(str::to_string))
}

/// Why a component's Deployment was not found.
#[derive(Debug, thiserror::Error)]
enum NotFound {
    #[error("cannot list Deployments in {ns}: {source}")]
    List { ns: String, source: kube::Error },
    #[error("no {component} Deployment in namespace {ns} (is Sluice installed there? --namespace)")]
    Missing { component: String, ns: String },
}

async fn component(
    client: &kube::Client,
    ns: &str,
    component: &str,
) -> Result<Deployment, NotFound> {
    let list = Api::<Deployment>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!(
            "app.kubernetes.io/part-of=sluice,app.kubernetes.io/component={component}"
        )))
        .await
        .map_err(|source| NotFound::List {
            ns: ns.to_string(),
            source,
        })?;
    list.items
        .into_iter()
        .next()
        .ok_or_else(|| NotFound::Missing {
            component: component.to_string(),
            ns: ns.to_string(),
        })
}

fn availability(d: &Deployment) -> (bool, String) {
    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let available = d
        .status
        .as_ref()
        .and_then(|s| s.available_replicas)
        .unwrap_or(0);
    (
        available > 0,
        format!(
            "{} has {available} of {want} replicas available",
            d.metadata.name.as_deref().unwrap_or("?")
        ),
    )
}

/// Runs every check, in order; later checks that need what an earlier one found are skipped
/// (reported as failed, saying why) when it was not found.
pub async fn run(client: kube::Client, opts: &Options) -> Vec<Check> {
    let mut out = Vec::new();
    match Api::<HookChain>::all(client.clone())
        .list(&ListParams::default().limit(1))
        .await
    {
        Ok(_) => out.push(check("CRDs", true, "HookChain and Capability are served")),
        Err(e) => out.push(check(
            "CRDs",
            false,
            format!("HookChains cannot be listed: {e} (helm install applies charts/sluice/crds)"),
        )),
    }
    let operator = component(&client, &opts.namespace, "operator").await;
    match &operator {
        Ok(d) => {
            let (ok, detail) = availability(d);
            out.push(check("operator", ok, detail));
        }
        Err(e) => out.push(check("operator", false, e.to_string())),
    }
    match component(&client, &opts.namespace, "gateway").await {
        Ok(d) => {
            let (ok, detail) = availability(&d);
            out.push(check("gateway", ok, detail));
        }
        Err(e) => out.push(check("gateway", false, e.to_string())),
    }
    let Ok(operator) = operator else {
        out.push(check(
            "sandbox pod under gVisor",
            false,
            "not tried: the operator's settings (supervisor image, RuntimeClass) are read from its Deployment",
        ));
        return out;
    };
    let class = opts
        .runtime_class
        .clone()
        .or_else(|| arg_of(&operator, "--runtime-class"))
        .unwrap_or_else(|| "gvisor".into());
    match Api::<RuntimeClass>::all(client.clone())
        .get_opt(&class)
        .await
    {
        Ok(Some(rc)) => out.push(check(
            "RuntimeClass",
            true,
            format!("{class} (handler {:?})", rc.handler),
        )),
        Ok(None) => {
            out.push(check(
                "RuntimeClass",
                false,
                format!(
                    "RuntimeClass {class} does not exist (runtimeClass.create, or docs/nodes.md)"
                ),
            ));
            return out;
        }
        Err(e) => {
            out.push(check(
                "RuntimeClass",
                false,
                format!("cannot read RuntimeClass {class}: {e}"),
            ));
            return out;
        }
    }
    let Some(image) = arg_of(&operator, "--supervisor-image") else {
        out.push(check(
            "sandbox pod under gVisor",
            false,
            "the operator has no --supervisor-image",
        ));
        return out;
    };
    let pod_ns = arg_of(&operator, "--sandbox-namespace").unwrap_or_else(|| opts.namespace.clone());
    out.push(gvisor_pod(&client, &pod_ns, &class, &image, opts.timeout).await);
    out
}

/// A pod made like a sandbox pod (same lockdown, same image and RuntimeClass) whose supervisor runs
/// its probe and requires gVisor under it; its outcome, and why when it fails.
async fn gvisor_pod(
    client: &kube::Client,
    ns: &str,
    class: &str,
    image: &str,
    timeout: Duration,
) -> Check {
    const WHAT: &str = "sandbox pod under gVisor";
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    let pod: Pod = match serde_json::from_value(serde_json::json!({
        "metadata": {"generateName": "sluice-doctor-", "namespace": ns,
                     "labels": {"app.kubernetes.io/name": "sluice-doctor", "app.kubernetes.io/part-of": "sluice"}},
        "spec": {
            "runtimeClassName": class,
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 1,
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65534, "runAsGroup": 65534,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "probe",
                "image": image,
                "command": [SUPERVISOR, "--probe", "--runtime", RUNTIME, "--require-gvisor"],
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
                "securityContext": {"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                                    "runAsNonRoot": true, "capabilities": {"drop": ["ALL"]},
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }],
        },
    })) {
        Ok(p) => p,
        Err(e) => return check(WHAT, false, format!("cannot make the pod: {e}")),
    };
    let made = match pods.create(&PostParams::default(), &pod).await {
        Ok(p) => p,
        Err(e) => {
            return check(
                WHAT,
                false,
                format!("the API server refused the pod in {ns}: {e}"),
            );
        }
    };
    let name = made.metadata.name.clone().unwrap_or_default();
    let began = Instant::now();
    let outcome = loop {
        let now = pods.get_opt(&name).await.ok().flatten();
        let phase = now
            .as_ref()
            .and_then(|p| p.status.as_ref())
            .and_then(|s| s.phase.clone())
            .unwrap_or_default();
        let message = now
            .as_ref()
            .and_then(|p| p.status.as_ref())
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|cs| cs.first())
            .and_then(|c| c.state.as_ref())
            .and_then(|s| s.terminated.as_ref())
            .and_then(|t| t.message.clone())
            .unwrap_or_default();
        match phase.as_str() {
            "Succeeded" => {
                break check(
                    WHAT,
                    true,
                    format!(
                        "pod {ns}/{name} ({class}, {image}) ran a hook in a cell under gVisor in {:.1} s",
                        began.elapsed().as_secs_f64()
                    ),
                );
            }
            "Failed" => {
                break check(
                    WHAT,
                    false,
                    format!("pod {ns}/{name} failed: {}", last_line(&message)),
                );
            }
            _ if began.elapsed() > timeout => {
                let why = events_of(client, ns, &name).await;
                break check(
                    WHAT,
                    false,
                    format!(
                        "pod {ns}/{name} did not run within {timeout:?} (phase {phase:?}){}",
                        if why.is_empty() {
                            String::new()
                        } else {
                            format!(": {why}")
                        }
                    ),
                );
            }
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    };
    let _ = pods
        .delete(&name, &DeleteParams::default().grace_period(0))
        .await;
    outcome
}

fn last_line(s: &str) -> &str {
    s.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no message")
        .trim()
}

/// The pod's warning events, as the kubelet and the scheduler word them.
async fn events_of(client: &kube::Client, ns: &str, pod: &str) -> String {
    let Ok(list) = Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default().fields(&format!("involvedObject.name={pod}")))
        .await
    else {
        return String::new();
    };
    let mut seen: Vec<String> = Vec::new();
    for e in list.items {
        if e.type_.as_deref() != Some("Warning") {
            continue;
        }
        let line = format!(
            "{}: {}",
            e.reason.unwrap_or_default(),
            e.message.unwrap_or_default().trim()
        );
        if !seen.contains(&line) {
            seen.push(line);
        }
    }
    // What stopped the pod first (FailedCreatePodSandBox, FailedScheduling, ErrImagePull, ...),
    // then the rest.
    seen.sort_by_key(|line| !(line.starts_with("Failed") || line.starts_with("Err")));
    seen.join("; ")
}
