//! Claiming a warm pod: pick among the chain's Ready warm pods from the watch cache, then flip its
//! pool label with one PATCH preconditioned on the `resourceVersion` we saw. Two gateways racing for
//! one pod both send that PATCH; the API server applies the first and answers the second 409, which
//! then tries another pod. Nothing here trusts the cache to be fresh: the precondition is the lock.

use crate::labels;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use rand::seq::SliceRandom;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Field manager of the claim patch, so `managedFields` tell who flipped the label.
pub(crate) const FIELD_MANAGER: &str = "sluice-gateway";

/// What a run needs of a pod: its chain's, and (when set) under the right RuntimeClass.
pub(crate) struct Wanted<'a> {
    /// The chain's namespace.
    pub namespace: &'a str,
    /// Where its pods live: the chain's namespace, or the sandbox namespace.
    pub pod_namespace: &'a str,
    /// True when pods live in the sandbox namespace, where only the operator may create pods.
    pub in_sandbox_namespace: bool,
    pub chain: &'a str,
    pub runtime_class: Option<&'a str>,
}

/// True if `pod` is a warm pod a run may claim now: labelled warm, Running, Ready, not being
/// deleted, the operator's for this chain and under the expected RuntimeClass. Beside the chain,
/// labels alone are not trusted (anyone who may create pods in a tenant namespace can set them,
/// and a pod that is not the operator's, without gVisor or with a network, must never receive
/// hooks): the pod must be controlled by its HookChain. In the sandbox namespace, where only the
/// operator may create pods (the chart's RBAC) and owner references cannot point across
/// namespaces, the chain-namespace label says whose it is.
pub(crate) fn is_warm(pod: &Pod, wanted: &Wanted) -> bool {
    let meta = &pod.metadata;
    let label = |k: &str| {
        meta.labels
            .as_ref()
            .and_then(|l| l.get(k))
            .map(String::as_str)
    };
    let ready = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    let running = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Running");
    let owned_by_reference = meta.owner_references.as_ref().is_some_and(|refs| {
        refs.iter().any(|r| {
            r.controller == Some(true)
                && r.kind == "HookChain"
                && r.api_version.starts_with("sluice.dev/")
                && r.name == wanted.chain
        })
    });
    let owned = if wanted.in_sandbox_namespace {
        label(labels::LABEL_CHAIN_NAMESPACE) == Some(wanted.namespace)
    } else {
        owned_by_reference
    };
    let runtime = match wanted.runtime_class {
        None => true,
        Some(want) => {
            pod.spec
                .as_ref()
                .and_then(|s| s.runtime_class_name.as_deref())
                == Some(want)
        }
    };
    meta.namespace.as_deref() == Some(wanted.pod_namespace)
        && label(labels::LABEL_CHAIN) == Some(wanted.chain)
        && label(labels::LABEL_POOL) == Some(labels::POOL_WARM)
        && meta.deletion_timestamp.is_none()
        && !draining(pod)
        && ready
        && running
        && owned
        && runtime
}

/// The warm pods of a chain worth trying, in random order (so replicas spread over the pool instead
/// of all racing for the first), leaving out pods whose version we already lost a race on.
pub(crate) fn candidates(
    pods: &[Arc<Pod>],
    wanted: &Wanted,
    lost: &HashSet<(String, String)>,
) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = pods
        .iter()
        .filter(|p| is_warm(p, wanted))
        .filter_map(|p| {
            let name = p.metadata.name.clone()?;
            let rv = p.metadata.resource_version.clone()?;
            Some((name, rv))
        })
        .filter(|k| !lost.contains(k))
        .collect();
    out.shuffle(&mut rand::rng());
    out
}

/// The node the pod `name` (in `pod_namespace`) runs on, if the cache knows.
pub(crate) fn node_of<'a>(
    pods: &'a [Arc<Pod>],
    pod_namespace: &str,
    name: &str,
) -> Option<&'a str> {
    pods.iter()
        .find(|p| {
            p.metadata.name.as_deref() == Some(name)
                && p.metadata.namespace.as_deref() == Some(pod_namespace)
        })
        .and_then(|p| p.spec.as_ref()?.node_name.as_deref())
}

/// True if the operator marked `pod` for its node's drain (or loss): it serves no new claim, and
/// its holder gives it back when its trigger point ends.
pub(crate) fn draining(pod: &Pod) -> bool {
    pod.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(labels::ANNOTATION_DRAINING))
}

/// Renews a held pod's `claimed-at` every `every` until aborted (when the pod is let go).
pub(crate) async fn heartbeat(api: Api<Pod>, name: String, every: Duration) {
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    loop {
        tokio::time::sleep(every).await;
        let now = jiff::Timestamp::now().to_string();
        let patch = serde_json::json!({
            "metadata": {"annotations": {labels::ANNOTATION_CLAIMED_AT: now}}
        });
        if let Err(e) = api.patch(&name, &params, &Patch::Merge(&patch)).await {
            tracing::warn!(pod = %name, error = %e, "renewing a held pod's claim failed");
        }
    }
}

/// The merge patch that claims a pod: the label flip and who claimed it when, valid only if the pod
/// is still at `resource_version`.
pub(crate) fn claim_patch(resource_version: &str, identity: &str, now: &str) -> serde_json::Value {
    serde_json::json!({
        "metadata": {
            "resourceVersion": resource_version,
            "labels": {labels::LABEL_POOL: labels::POOL_CLAIMED},
            "annotations": {
                labels::ANNOTATION_CLAIMED_BY: identity,
                labels::ANNOTATION_CLAIMED_AT: now,
                labels::ANNOTATION_SAFE_TO_EVICT: "false",
            },
        }
    })
}

pub(crate) enum Outcome {
    /// The pod is ours now.
    Claimed,
    /// Someone else changed or took the pod first (409), or it is gone (404).
    Lost,
}

/// A claim that neither won nor lost by the deadline.
#[derive(Debug, thiserror::Error)]
#[error("{why}")]
pub(crate) struct Unanswered {
    pub why: String,
    /// The PATCH may have been applied without our hearing it (no answer, a 504, a broken
    /// connection): the pod may be ours, stamped `stamp`, and must then be given back.
    pub maybe_ours: bool,
    /// The claimed-at value of our PATCH, which tells our claim from anyone else's.
    pub stamp: String,
}

/// First pause between two tries of a claim the API server could not take (429, 503, 5xx).
const RETRY_FIRST: Duration = Duration::from_millis(100);
/// Longest pause between two tries.
const RETRY_MAX: Duration = Duration::from_secs(1);
/// What the ownership check of a claim whose answer was lost may take at least, past the deadline.
const CHECK_AT_LEAST: Duration = Duration::from_secs(1);

/// One claim of one pod, ended by `deadline` whatever the API server does. The kube client retries
/// 429, 503 and 504 itself (honouring `Retry-After`, without a bound a claim can afford): the
/// deadline cuts it. 429 and 503 were not applied and are tried again while time is left; a 504 or
/// a broken connection may have been, and so may a request the deadline cut. A 409 is checked: it
/// may answer the client's retry of our own PATCH that was applied (then the pod is ours).
pub(crate) async fn try_claim(
    api: &Api<Pod>,
    name: &str,
    resource_version: &str,
    identity: &str,
    deadline: Instant,
) -> Result<Outcome, Unanswered> {
    let stamp = jiff::Timestamp::now().to_string();
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    let patch = claim_patch(resource_version, identity, &stamp);
    let mut maybe_applied = false;
    let mut pause = RETRY_FIRST;
    loop {
        let unanswered = |why: String, maybe_ours: bool| Unanswered {
            why,
            maybe_ours,
            stamp: stamp.clone(),
        };
        let why = match tokio::time::timeout_at(
            deadline,
            api.patch(name, &params, &Patch::Merge(&patch)),
        )
        .await
        {
            Ok(Ok(_)) => return Ok(Outcome::Claimed),
            Ok(Err(kube::Error::Api(s))) if s.code == 404 => return Ok(Outcome::Lost),
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => {
                let check_by = deadline.max(Instant::now() + CHECK_AT_LEAST);
                return match claimed_by_us(api, name, identity, &stamp, check_by).await {
                    Ok(true) => Ok(Outcome::Claimed),
                    Ok(false) => Ok(Outcome::Lost),
                    Err(why) => Err(unanswered(
                        format!("a conflict on the claim, then {why}"),
                        true,
                    )),
                };
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 429 || s.code == 503 => {
                format!("the API server answered {} ({})", s.code, s.message)
            }
            Ok(Err(e)) => {
                maybe_applied = true;
                e.to_string()
            }
            Err(_) => {
                return Err(unanswered(
                    "the API server did not answer the claim in time".into(),
                    true,
                ));
            }
        };
        if Instant::now() + pause >= deadline {
            return Err(unanswered(why, maybe_applied));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RETRY_MAX);
    }
}

/// Why a pod could not be read back to see whose claim it carries.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadBackError {
    #[error("no answer to reading the pod back")]
    Unanswered,
    #[error("reading the pod back failed: {0}")]
    Failed(#[from] kube::Error),
}

/// Whether pod `name` carries our claim (made at `stamp`), as the API server has it now.
pub(crate) async fn claimed_by_us(
    api: &Api<Pod>,
    name: &str,
    identity: &str,
    stamp: &str,
    deadline: Instant,
) -> Result<bool, ReadBackError> {
    match tokio::time::timeout_at(deadline, api.get_opt(name)).await {
        Err(_) => Err(ReadBackError::Unanswered),
        Ok(Err(e)) => Err(e.into()),
        Ok(Ok(None)) => Ok(false),
        Ok(Ok(Some(pod))) => {
            let annotations = pod.metadata.annotations.unwrap_or_default();
            let annotation = |k: &str| annotations.get(k).map(String::as_str);
            Ok(annotation(labels::ANNOTATION_CLAIMED_BY) == Some(identity)
                && annotation(labels::ANNOTATION_CLAIMED_AT) == Some(stamp))
        }
    }
}

/// Whether the pod `name` (in `pod_namespace`) is outdated: the operator marked it for its node's
/// drain, or the newest pod of its chain there has another template (the operator now makes pods of
/// another template, such as a new supervisor image after an upgrade; it makes only current ones).
/// The newest decides, so a template rolled back to makes its older pods current again. Unknown
/// (not in `pods`): not outdated.
pub(crate) fn outdated(pods: &[Arc<Pod>], pod_namespace: &str, name: &str) -> bool {
    let label = |p: &Pod, k: &str| p.metadata.labels.as_ref()?.get(k).cloned();
    let Some(me) = pods.iter().find(|p| {
        p.metadata.name.as_deref() == Some(name)
            && p.metadata.namespace.as_deref() == Some(pod_namespace)
    }) else {
        return false;
    };
    if draining(me) {
        return true;
    }
    let chain = |p: &Pod| {
        (
            label(p, labels::LABEL_CHAIN_NAMESPACE),
            label(p, labels::LABEL_CHAIN),
        )
    };
    let newest = pods
        .iter()
        .filter(|p| p.metadata.namespace.as_deref() == Some(pod_namespace))
        .filter(|p| p.metadata.deletion_timestamp.is_none() && chain(p) == chain(me))
        .max_by_key(|p| p.metadata.creation_timestamp.as_ref().map(|t| t.0));
    newest.is_some_and(|n| label(n, labels::LABEL_TEMPLATE) != label(me, labels::LABEL_TEMPLATE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    use kube::api::ObjectMeta;

    const WANTED: Wanted = Wanted {
        namespace: "team",
        pod_namespace: "team",
        in_sandbox_namespace: false,
        chain: "redact",
        runtime_class: Some("gvisor"),
    };

    fn pod(name: &str, pool: &str, ready: bool, phase: &str) -> Arc<Pod> {
        Arc::new(Pod {
            spec: Some(k8s_openapi::api::core::v1::PodSpec {
                runtime_class_name: Some("gvisor".into()),
                ..Default::default()
            }),
            metadata: ObjectMeta {
                owner_references: Some(vec![OwnerReference {
                    api_version: "sluice.dev/v1alpha1".into(),
                    kind: "HookChain".into(),
                    name: "redact".into(),
                    uid: "u-1".into(),
                    controller: Some(true),
                    ..Default::default()
                }]),
                name: Some(name.into()),
                namespace: Some("team".into()),
                resource_version: Some("7".into()),
                labels: Some(
                    [
                        (labels::LABEL_CHAIN.to_string(), "redact".to_string()),
                        (labels::LABEL_POOL.to_string(), pool.to_string()),
                    ]
                    .into(),
                ),
                ..Default::default()
            },
            status: Some(PodStatus {
                phase: Some(phase.into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        })
    }

    #[test]
    fn only_ready_running_warm_pods_of_the_chain_are_candidates() {
        let pods = vec![
            pod("a", labels::POOL_WARM, true, "Running"),
            pod("b", labels::POOL_CLAIMED, true, "Running"),
            pod("c", labels::POOL_WARM, false, "Running"),
            pod("d", labels::POOL_WARM, true, "Pending"),
            pod("e", labels::POOL_WARM, true, "Running"),
        ];
        let mut got: Vec<String> = candidates(&pods, &WANTED, &HashSet::new())
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        got.sort();
        assert_eq!(got, ["a", "e"]);
        let elsewhere = Wanted {
            namespace: "other",
            pod_namespace: "other",
            ..WANTED
        };
        assert!(candidates(&pods, &elsewhere, &HashSet::new()).is_empty());
        let other_chain = Wanted {
            chain: "other",
            ..WANTED
        };
        assert!(candidates(&pods, &other_chain, &HashSet::new()).is_empty());
        let lost = HashSet::from([("a".to_string(), "7".to_string())]);
        let got: Vec<String> = candidates(&pods, &WANTED, &lost)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(got, ["e"]);
    }

    #[test]
    fn a_pod_being_deleted_is_not_warm() {
        let mut p = (*pod("a", labels::POOL_WARM, true, "Running")).clone();
        assert!(is_warm(&p, &WANTED));
        p.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            jiff::Timestamp::now(),
        ));
        assert!(!is_warm(&p, &WANTED));
    }

    #[test]
    fn a_pod_marked_for_its_nodes_drain_is_not_claimed_and_its_holder_gives_it_back() {
        let mut p = (*pod("a", labels::POOL_WARM, true, "Running")).clone();
        let mut claimed = (*pod_of("held", "a", 100, "redact")).clone();
        let pods = vec![Arc::new(claimed.clone())];
        assert!(is_warm(&p, &WANTED));
        assert!(!outdated(&pods, "sandboxes", "held"));
        for q in [&mut p, &mut claimed] {
            q.metadata.annotations.get_or_insert_default().insert(
                labels::ANNOTATION_DRAINING.into(),
                "node n1 is cordoned".into(),
            );
        }
        assert!(!is_warm(&p, &WANTED), "a draining pod is never claimed");
        let pods = vec![Arc::new(claimed)];
        assert!(
            outdated(&pods, "sandboxes", "held"),
            "its holder retires it when its trigger point ends"
        );
    }

    #[test]
    fn a_pod_with_the_labels_but_not_the_operators_is_never_claimed() {
        let good = (*pod("a", labels::POOL_WARM, true, "Running")).clone();
        let mut runc = good.clone();
        runc.spec.as_mut().unwrap().runtime_class_name = None;
        assert!(!is_warm(&runc, &WANTED), "not under gVisor");
        let mut orphan = good.clone();
        orphan.metadata.owner_references = None;
        assert!(!is_warm(&orphan, &WANTED), "not controlled by the chain");
        let mut foreign = good.clone();
        foreign.metadata.owner_references.as_mut().unwrap()[0].name = "other".into();
        assert!(!is_warm(&foreign, &WANTED), "controlled by another chain");
        let any_runtime = Wanted {
            runtime_class: None,
            ..WANTED
        };
        assert!(is_warm(&runc, &any_runtime));
    }

    #[test]
    fn in_the_sandbox_namespace_the_chain_namespace_label_says_whose_pod_it_is() {
        let sandboxed = Wanted {
            namespace: "team",
            pod_namespace: "sluice-sandboxes",
            in_sandbox_namespace: true,
            ..WANTED
        };
        let mut p = (*pod("a", labels::POOL_WARM, true, "Running")).clone();
        p.metadata.owner_references = None;
        p.metadata.namespace = Some("sluice-sandboxes".into());
        assert!(!is_warm(&p, &sandboxed), "no chain-namespace label");
        p.metadata
            .labels
            .as_mut()
            .unwrap()
            .insert(labels::LABEL_CHAIN_NAMESPACE.into(), "other-team".into());
        assert!(!is_warm(&p, &sandboxed), "a chain of another namespace");
        p.metadata
            .labels
            .as_mut()
            .unwrap()
            .insert(labels::LABEL_CHAIN_NAMESPACE.into(), "team".into());
        assert!(is_warm(&p, &sandboxed));
        // Beside the chains, the same labels without the owner reference are not enough.
        let mut beside = p.clone();
        beside.metadata.namespace = Some("team".into());
        assert!(
            !is_warm(&beside, &WANTED),
            "labels alone in a tenant namespace"
        );
        // And a pod of the right labels in a tenant namespace is not one of the sandbox namespace.
        assert!(!is_warm(&beside, &sandboxed));
    }

    #[test]
    fn the_claim_patch_carries_the_precondition_and_the_label_flip() {
        let p = claim_patch("42", "gw-1", "2026-11-22T03:00:00Z");
        assert_eq!(p["metadata"]["resourceVersion"], "42");
        assert_eq!(
            p["metadata"]["labels"][labels::LABEL_POOL],
            labels::POOL_CLAIMED
        );
        assert_eq!(
            p["metadata"]["annotations"][labels::ANNOTATION_CLAIMED_BY],
            "gw-1"
        );
        assert_eq!(
            p["metadata"]["annotations"][labels::ANNOTATION_CLAIMED_AT],
            "2026-11-22T03:00:00Z"
        );
        // The autoscaler may take a node from under warm pods, never from under a held one.
        assert_eq!(
            p["metadata"]["annotations"][labels::ANNOTATION_SAFE_TO_EVICT],
            "false"
        );
    }

    fn pod_of(name: &str, template: &str, created: i64, chain: &str) -> Arc<Pod> {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let labels = [
            (labels::LABEL_CHAIN_NAMESPACE, "team"),
            (labels::LABEL_CHAIN, chain),
            (labels::LABEL_TEMPLATE, template),
        ];
        Arc::new(Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("sandboxes".into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                creation_timestamp: Some(Time(
                    jiff::Timestamp::from_second(created).expect("a time"),
                )),
                ..Default::default()
            },
            ..Default::default()
        })
    }

    #[test]
    fn a_pod_is_outdated_when_the_newest_of_its_chain_has_another_template() {
        let old = pod_of("old", "a", 100, "redact");
        let mut pods = vec![old.clone(), pod_of("sibling", "a", 110, "redact")];
        assert!(
            !outdated(&pods, "sandboxes", "old"),
            "one template: current"
        );
        // Another chain's newer pods say nothing about this one.
        pods.push(pod_of("other-chain", "z", 200, "summarise"));
        assert!(!outdated(&pods, "sandboxes", "old"));
        pods.push(pod_of("new", "b", 300, "redact"));
        assert!(
            outdated(&pods, "sandboxes", "old"),
            "the operator makes template b now"
        );
        assert!(!outdated(&pods, "sandboxes", "new"));
        // Rolled back to a: the newest pod is an a again, and the old pod is current.
        pods.push(pod_of("back", "a", 400, "redact"));
        assert!(!outdated(&pods, "sandboxes", "old"));
        assert!(outdated(&pods, "sandboxes", "new"));
        assert!(
            !outdated(&pods, "sandboxes", "unknown"),
            "a pod not in the cache is not judged"
        );
        assert!(
            !outdated(&pods, "elsewhere", "old"),
            "nor one of another namespace"
        );
    }
}
