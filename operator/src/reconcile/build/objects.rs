//! The objects the operator creates for a HookChain, as pure functions of the chain and the operator's
//! settings: the warm sandbox pod, the deny-all NetworkPolicy and the template hash that says when a
//! pod is out of date. The reconciler and `sluice-operator render` both build through here.

use k8s_openapi::api::core::v1::{
    Capabilities, Container, EmptyDirVolumeSource, ExecAction, Pod, PodSecurityContext, PodSpec,
    Probe, ResourceRequirements, SeccompProfile, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicySpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use sha2::{Digest, Sha256};
use sluice_crds::HookChain;
use sluice_crds::cpu::SandboxCpuLimit;
use std::collections::BTreeMap;

pub use sluice_crds::sandbox_pod::{
    ANNOTATION_CLAIMED_AT, ANNOTATION_CLAIMED_BY, ANNOTATION_DRAINING, ANNOTATION_SAFE_TO_EVICT,
    CONTAINER, FINALIZER, LABEL_CHAIN, LABEL_CHAIN_NAMESPACE, LABEL_CHAIN_UID, LABEL_MANAGED_BY,
    LABEL_NAME, LABEL_POOL, LABEL_TEMPLATE, POOL_CLAIMED, POOL_WARM, SANDBOX_NAME, SUPERVISOR,
    probe_command, supervisor_command,
};

pub const FIELD_MANAGER: &str = sluice_crds::sandbox_pod::OPERATOR;

/// Documents the pids limit: pod-level pids limits are a kubelet setting (podPidsLimit), and the
/// supervisor's RLIMIT_NPROC enforces it inside the sandbox.
pub const ANNOTATION_PIDS: &str = "sluice.dev/pids-limit";

/// Size of the memory-backed `/tmp` of every sandbox.
pub const TMP_SIZE: &str = "16Mi";
/// The user every sandbox runs as (nobody).
pub const SANDBOX_UID: i64 = 65534;

/// What the operator was started with that shapes the pods it builds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub runtime_class: String,
    pub supervisor_image: String,
    /// Where sandbox pods and their NetworkPolicies live (`--sandbox-namespace`). `None`: beside
    /// their HookChain, owned by it.
    pub sandbox_namespace: Option<String>,
    /// The most CPU one sandbox may use (`--sandbox-cpu-limit`): every pod's CPU limit, above the
    /// chain's `resources.cpu`, its request.
    pub sandbox_cpu_limit: SandboxCpuLimit,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            runtime_class: "gvisor".into(),
            supervisor_image: default_supervisor_image(),
            sandbox_namespace: None,
            sandbox_cpu_limit: SandboxCpuLimit::default(),
        }
    }
}

impl Settings {
    /// The namespace of the sandbox pods of chains in `chain_namespace`.
    pub fn pod_namespace<'a>(&'a self, chain_namespace: &'a str) -> &'a str {
        self.sandbox_namespace.as_deref().unwrap_or(chain_namespace)
    }
}

pub fn default_supervisor_image() -> String {
    format!(
        "ghcr.io/sluice-dev/sluice-supervisor:{}",
        env!("CARGO_PKG_VERSION")
    )
}

/// Hash of everything in the pod template: image, runtime class, resources and `/tmp` size. Hooks are
/// not in it: their code is sent to each trigger point's cell, so changing, adding or removing a hook
/// needs no new pods.
pub fn template_hash(chain: &HookChain, settings: &Settings) -> String {
    let r = &chain.spec.resources;
    let cpu_limit = settings.sandbox_cpu_limit.to_string();
    let parts = [
        // Bump when the shape of the pod built below changes, so running pools roll.
        "v5",
        settings.supervisor_image.as_str(),
        settings.runtime_class.as_str(),
        r.cpu.as_str(),
        cpu_limit.as_str(),
        r.memory.as_str(),
        &r.pids.to_string(),
        TMP_SIZE,
    ];
    let mut h = Sha256::new();
    for part in parts {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(h.finalize())[..16].to_string()
}

fn chain_name(chain: &HookChain) -> String {
    chain.metadata.name.clone().unwrap_or_default()
}

fn chain_namespace(chain: &HookChain) -> String {
    chain.metadata.namespace.clone().unwrap_or_default()
}

/// The labels that say whose a sandbox pod (or NetworkPolicy) is: the chain's namespace and name.
/// They select its pods wherever they live, and are what the finalizer deletes by.
pub fn chain_labels(chain_namespace: &str, chain_name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            LABEL_CHAIN_NAMESPACE.to_string(),
            chain_namespace.to_string(),
        ),
        (LABEL_CHAIN.to_string(), chain_name.to_string()),
    ])
}

/// The label selector (`k=v,k=v`) of the pods of one chain, for lists and deletes.
pub fn chain_selector(chain_namespace: &str, chain_name: &str) -> String {
    let mut parts = vec![format!("{LABEL_MANAGED_BY}={FIELD_MANAGER}")];
    parts.extend(
        chain_labels(chain_namespace, chain_name)
            .into_iter()
            .map(|(k, v)| format!("{k}={v}")),
    );
    parts.join(",")
}

/// Labels every sandbox pod of `chain` carries, the pool state and template excepted.
pub fn selector_labels(chain: &HookChain) -> BTreeMap<String, String> {
    let mut labels = chain_labels(&chain_namespace(chain), &chain_name(chain));
    labels.insert(LABEL_NAME.to_string(), SANDBOX_NAME.to_string());
    labels.insert(LABEL_MANAGED_BY.to_string(), FIELD_MANAGER.to_string());
    if let Some(uid) = &chain.metadata.uid {
        labels.insert(LABEL_CHAIN_UID.to_string(), uid.clone());
    }
    labels
}

/// The HookChain as the controlling owner, when it has a uid (objects read from a file have none)
/// and the object lives in the chain's namespace (owner references cannot cross namespaces: pods in
/// a sandbox namespace are deleted by the chain's finalizer instead). Without
/// `blockOwnerDeletion`: setting it needs `update` on `hookchains/finalizers` under
/// OwnerReferencesPermissionEnforcement (OpenShift, hardened clusters), and nothing here needs the
/// chain's deletion to wait for its pods (the finalizer already does).
pub fn owner_reference(chain: &HookChain, settings: &Settings) -> Option<OwnerReference> {
    if settings.sandbox_namespace.is_some() {
        return None;
    }
    let uid = chain.metadata.uid.clone()?;
    Some(OwnerReference {
        api_version: "sluice.dev/v1alpha1".into(),
        kind: "HookChain".into(),
        name: chain_name(chain),
        uid,
        controller: Some(true),
        block_owner_deletion: None,
    })
}

fn quantity(s: &str) -> Quantity {
    Quantity(s.to_string())
}

/// One warm sandbox pod of `chain`, named by the API server from `generateName`.
pub fn pod(chain: &HookChain, settings: &Settings) -> Pod {
    let name = chain_name(chain);
    let namespace = chain_namespace(chain);
    let mut labels = selector_labels(chain);
    labels.insert(LABEL_TEMPLATE.to_string(), template_hash(chain, settings));
    labels.insert(LABEL_POOL.to_string(), POOL_WARM.to_string());
    let r = &chain.spec.resources;
    // Validated before any pod is built; 0 (no address-space limit, the cgroup still holds) otherwise.
    let memory_bytes = sluice_crds::quantity::memory_bytes(&r.memory).unwrap_or(0);
    // Memory: request = limit, what the chain asked for each hook's instance with gVisor and the
    // supervisor's runtime on top. CPU: the chain's cpu is requested (guaranteed, its share under
    // contention); the platform's sandbox CPU limit caps it. A limit equal to the request would
    // throttle every walk past its quota per 100 ms period (sluice_crds::cpu).
    let pod_memory = quantity(&format!(
        "{}Mi",
        (memory_bytes + sluice_crds::sandbox_pod::RUNTIME_MEMORY_BYTES).div_ceil(1 << 20)
    ));
    let requests = BTreeMap::from([
        ("cpu".to_string(), quantity(&r.cpu)),
        ("memory".to_string(), pod_memory.clone()),
    ]);
    let mut limits = BTreeMap::from([("memory".to_string(), pod_memory)]);
    if let Some(cpu) = settings.sandbox_cpu_limit.quantity() {
        limits.insert("cpu".to_string(), quantity(&cpu));
    }
    let security = SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        run_as_user: Some(SANDBOX_UID),
        run_as_group: Some(SANDBOX_UID),
        privileged: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            add: None,
        }),
        seccomp_profile: Some(runtime_default()),
        ..Default::default()
    };
    let container = Container {
        name: CONTAINER.into(),
        image: Some(settings.supervisor_image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        // The supervisor itself, ready before the pod is: a claim only attaches to it.
        // Settings are flags: every process of the sandbox can read the initial environment.
        command: Some(supervisor_command(memory_bytes, r.pids)),
        resources: Some(ResourceRequirements {
            requests: Some(requests),
            limits: Some(limits),
            ..Default::default()
        }),
        // Ready once the supervisor answers, its runtime loaded and its self-check passed. A
        // startup probe, not a readiness probe: a claimed pod serves trigger point after trigger
        // point attached to one gateway, and an exec every period would cost CPU inside gVisor. A
        // kubelet that restarts runs the startup probe again: an attached supervisor answers it
        // (`attached`), so held pods survive kubelet restarts. After startup the pod stays
        // Ready until its supervisor exits, which ends the pod.
        startup_probe: Some(Probe {
            exec: Some(ExecAction {
                command: Some(probe_command()),
            }),
            period_seconds: Some(1),
            timeout_seconds: Some(5),
            // The operator's --start-deadline replaces a pod that never starts before this does.
            failure_threshold: Some(300),
            success_threshold: Some(1),
            ..Default::default()
        }),
        security_context: Some(security),
        volume_mounts: Some(vec![VolumeMount {
            name: "tmp".into(),
            mount_path: "/tmp".into(),
            ..Default::default()
        }]),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    };
    Pod {
        metadata: ObjectMeta {
            // In a sandbox namespace shared by every tenant, the name says whose pod it is.
            generate_name: Some(match settings.sandbox_namespace {
                Some(_) => format!("{namespace}-{name}-"),
                None => format!("{name}-"),
            }),
            namespace: Some(settings.pod_namespace(&namespace).to_string()),
            labels: Some(labels),
            annotations: Some(BTreeMap::from([
                (ANNOTATION_PIDS.to_string(), r.pids.to_string()),
                // A warm pod may go with its node (the claim turns this to "false").
                (ANNOTATION_SAFE_TO_EVICT.to_string(), "true".to_string()),
            ])),
            owner_references: owner_reference(chain, settings).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            runtime_class_name: Some(settings.runtime_class.clone()),
            restart_policy: Some("Never".into()),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            termination_grace_period_seconds: Some(1),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(SANDBOX_UID),
                run_as_group: Some(SANDBOX_UID),
                seccomp_profile: Some(runtime_default()),
                ..Default::default()
            }),
            containers: vec![container],
            volumes: Some(vec![Volume {
                name: "tmp".into(),
                empty_dir: Some(EmptyDirVolumeSource {
                    medium: Some("Memory".into()),
                    size_limit: Some(quantity(TMP_SIZE)),
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}

fn runtime_default() -> SeccompProfile {
    SeccompProfile {
        type_: "RuntimeDefault".into(),
        localhost_profile: None,
    }
}

/// Name of the chain's NetworkPolicy. In a sandbox namespace it carries the chain's namespace
/// too, before a dot: namespace names have no dots, so no two chains share a policy name.
pub fn network_policy_name(chain_namespace: &str, chain_name: &str, settings: &Settings) -> String {
    match settings.sandbox_namespace {
        Some(_) => format!("sluice-{chain_namespace}.{chain_name}-deny-all"),
        None => format!("sluice-{chain_name}-deny-all"),
    }
}

/// Denies all ingress and egress of the chain's sandboxes: a policy that selects the pods, names
/// both directions and lists no rule.
pub fn network_policy(chain: &HookChain, settings: &Settings) -> NetworkPolicy {
    let (namespace, name) = (chain_namespace(chain), chain_name(chain));
    NetworkPolicy {
        metadata: ObjectMeta {
            name: Some(network_policy_name(&namespace, &name, settings)),
            namespace: Some(settings.pod_namespace(&namespace).to_string()),
            labels: Some(selector_labels(chain)),
            owner_references: owner_reference(chain, settings).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(NetworkPolicySpec {
            // Beside the chain, the policy's namespace says whose pods: the chain label selects
            // them (and pods made before the namespace label existed); in a sandbox namespace
            // both labels do.
            pod_selector: Some(LabelSelector {
                match_labels: Some(match settings.sandbox_namespace {
                    Some(_) => chain_labels(&namespace, &name),
                    None => BTreeMap::from([(LABEL_CHAIN.to_string(), name)]),
                }),
                match_expressions: None,
            }),
            policy_types: Some(vec!["Ingress".into(), "Egress".into()]),
            ingress: None,
            egress: None,
        }),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn chain(yaml_spec: serde_json::Value) -> HookChain {
        let mut c = HookChain::new(
            "redactor",
            serde_json::from_value(yaml_spec).expect("test spec"),
        );
        c.metadata.namespace = Some("team-a".into());
        c.metadata.uid = Some("uid-1".into());
        c.metadata.generation = Some(3);
        c
    }

    fn pod_of(chain: &HookChain, settings: &Settings) -> ResourceRequirements {
        pod(chain, settings).spec.unwrap().containers[0]
            .resources
            .clone()
            .unwrap()
    }

    pub(crate) fn simple() -> HookChain {
        chain(serde_json::json!({
            "target": "bot", "triggerPoint": "input",
            "pool": {"warm": 2, "max": 5},
            "resources": {"cpu": "500m", "memory": "256Mi", "pids": 32},
            "hooks": [{"name": "a", "action": "modify", "code": "def execute(c, s):\n    return {'action': 'pass'}\n"}]
        }))
    }

    #[test]
    fn the_pod_is_locked_down() {
        let pod = pod(&simple(), &Settings::default());
        let spec = pod.spec.unwrap();
        assert_eq!(spec.runtime_class_name.as_deref(), Some("gvisor"));
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(spec.automount_service_account_token, Some(false));
        assert_eq!(spec.enable_service_links, Some(false));
        assert_eq!(spec.termination_grace_period_seconds, Some(1));
        let psc = spec.security_context.unwrap();
        assert_eq!(psc.run_as_non_root, Some(true));
        assert_eq!(psc.run_as_user, Some(65534));
        assert_eq!(psc.seccomp_profile.unwrap().type_, "RuntimeDefault");
        assert_eq!(spec.containers.len(), 1);
        let c = &spec.containers[0];
        assert_eq!(c.name, "supervisor");
        let sc = c.security_context.clone().unwrap();
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.run_as_non_root, Some(true));
        assert_eq!(sc.capabilities.unwrap().drop, Some(vec!["ALL".to_string()]));
        assert_eq!(sc.seccomp_profile.unwrap().type_, "RuntimeDefault");
        // The pod's main process is the supervisor, listening for the gateway's attach: 256Mi is
        // each hook instance's memory limit, the chain's pids its nproc.
        assert_eq!(
            c.command.clone().unwrap(),
            [
                "/opt/sluice/sluice-supervisor",
                "--listen",
                "--runtime",
                "/opt/sluice/sluice-cell.cwasm",
                "--memory-bytes",
                "268435456",
                "--pids",
                "32"
            ]
        );
        assert_eq!(
            c.env, None,
            "settings are flags: hooks can read the initial environment"
        );
    }

    #[test]
    fn cpu_is_requested_up_to_the_platform_limit_and_memory_is_exact() {
        let pod = pod(&simple(), &Settings::default());
        let spec = pod.spec.unwrap();
        let res = spec.containers[0].resources.clone().unwrap();
        let (requests, limits) = (res.requests.unwrap(), res.limits.unwrap());
        // The chain's cpu is guaranteed; the platform's default limit (one core) caps the bursts.
        assert_eq!(requests["cpu"].0, "500m");
        assert_eq!(limits["cpu"].0, "1");
        for amounts in [&requests, &limits] {
            // The chain's 256Mi for its hooks, 256Mi for gVisor and the supervisor's runtime.
            assert_eq!(amounts["memory"].0, "512Mi");
        }
        // No limit at all when the platform says none; another limit rolls the pool.
        let unlimited = Settings {
            sandbox_cpu_limit: SandboxCpuLimit(None),
            ..Settings::default()
        };
        let res = pod_of(&simple(), &unlimited);
        assert!(!res.limits.unwrap().contains_key("cpu"));
        assert_eq!(res.requests.unwrap()["cpu"].0, "500m");
        assert_ne!(
            template_hash(&simple(), &unlimited),
            template_hash(&simple(), &Settings::default())
        );
        let vol = &spec.volumes.unwrap()[0];
        let dir = vol.empty_dir.clone().unwrap();
        assert_eq!(dir.medium.as_deref(), Some("Memory"));
        assert_eq!(dir.size_limit.unwrap().0, "16Mi");
        let mount = &spec.containers[0].volume_mounts.clone().unwrap()[0];
        assert_eq!(
            (mount.name.as_str(), mount.mount_path.as_str()),
            ("tmp", "/tmp")
        );
        assert_eq!(pod.metadata.annotations.unwrap()[ANNOTATION_PIDS], "32");
    }

    #[test]
    fn labels_owner_and_probe() {
        let chain = simple();
        let pod = pod(&chain, &Settings::default());
        let labels = pod.metadata.labels.unwrap();
        // A node of warm pods only may be scaled down by the cluster autoscaler.
        assert_eq!(
            pod.metadata.annotations.as_ref().unwrap()[ANNOTATION_SAFE_TO_EVICT],
            "true"
        );
        assert_eq!(labels[LABEL_NAME], "sluice-sandbox");
        assert_eq!(labels[LABEL_MANAGED_BY], "sluice-operator");
        assert_eq!(labels[LABEL_CHAIN], "redactor");
        assert_eq!(labels[LABEL_POOL], "warm");
        assert_eq!(
            labels[LABEL_TEMPLATE],
            template_hash(&chain, &Settings::default())
        );
        assert_eq!(pod.metadata.generate_name.as_deref(), Some("redactor-"));
        assert_eq!(pod.metadata.namespace.as_deref(), Some("team-a"));
        assert_eq!(labels[LABEL_CHAIN_NAMESPACE], "team-a");
        assert_eq!(labels[LABEL_CHAIN_UID], "uid-1");
        let owner = &pod.metadata.owner_references.unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("HookChain", "uid-1", Some(true))
        );
        // OwnerReferencesPermissionEnforcement refuses blockOwnerDeletion without update on
        // hookchains/finalizers: it is not set.
        assert_eq!(owner.block_owner_deletion, None);
        let container = &pod.spec.unwrap().containers[0];
        assert!(
            container.readiness_probe.is_none(),
            "no exec per period into a pod that serves trigger points"
        );
        let probe = container.startup_probe.clone().unwrap();
        assert_eq!(
            probe.exec.unwrap().command.unwrap(),
            ["/opt/sluice/sluice-supervisor", "attach", "--probe"]
        );
    }

    #[test]
    fn settings_choose_runtime_class_and_image() {
        let settings = Settings {
            runtime_class: "runsc-kvm".into(),
            supervisor_image: "registry.local/sup:dev".into(),
            sandbox_namespace: None,
            ..Settings::default()
        };
        let spec = pod(&simple(), &settings).spec.unwrap();
        assert_eq!(spec.runtime_class_name.as_deref(), Some("runsc-kvm"));
        assert_eq!(
            spec.containers[0].image.as_deref(),
            Some("registry.local/sup:dev")
        );
    }

    #[test]
    fn template_hash_follows_the_pod_template_not_the_code() {
        let s = Settings::default();
        let base = simple();
        let h = template_hash(&base, &s);
        assert_eq!(h.len(), 16);
        let mut code = base.clone();
        code.spec.hooks[0].code = "def execute(c, s):\n    return {'action': 'modify'}\n".into();
        assert_eq!(template_hash(&code, &s), h, "code changes keep pods");
        // Hooks reach each trigger point's cell from the gateway: a second hook keeps pods too.
        let mut two = base.clone();
        two.spec.hooks.push(two.spec.hooks[0].clone());
        two.spec.hooks[1].name = "b".into();
        assert_eq!(template_hash(&two, &s), h);
        let mut mem = base.clone();
        mem.spec.resources.memory = "512Mi".into();
        assert_ne!(template_hash(&mem, &s), h);
        let mut img = s.clone();
        img.supervisor_image = "other:1".into();
        assert_ne!(template_hash(&base, &img), h);
        let mut rc = s.clone();
        rc.runtime_class = "kata".into();
        assert_ne!(template_hash(&base, &rc), h);
    }

    #[test]
    fn network_policy_denies_everything_for_the_chain() {
        let np = network_policy(&simple(), &Settings::default());
        assert_eq!(
            np.metadata.name.as_deref(),
            Some("sluice-redactor-deny-all")
        );
        assert_eq!(np.metadata.namespace.as_deref(), Some("team-a"));
        let spec = np.spec.unwrap();
        assert_eq!(
            spec.pod_selector.unwrap().match_labels.unwrap(),
            BTreeMap::from([(LABEL_CHAIN.to_string(), "redactor".to_string())])
        );
        assert_eq!(
            spec.policy_types.unwrap(),
            ["Ingress".to_string(), "Egress".to_string()]
        );
        assert!(spec.ingress.is_none() && spec.egress.is_none());
        // Serialized, no rule lists appear at all (an empty list would mean the same, but say less).
        let json = serde_json::to_value(network_policy(&simple(), &Settings::default())).unwrap();
        assert!(json["spec"].get("ingress").is_none(), "{json}");
    }

    fn sandboxed() -> Settings {
        Settings {
            sandbox_namespace: Some("sluice-sandboxes".into()),
            ..Settings::default()
        }
    }

    #[test]
    fn in_a_sandbox_namespace_pods_and_policy_live_there_labelled_not_owned() {
        let chain = simple();
        let pod = pod(&chain, &sandboxed());
        assert_eq!(pod.metadata.namespace.as_deref(), Some("sluice-sandboxes"));
        assert_eq!(
            pod.metadata.generate_name.as_deref(),
            Some("team-a-redactor-")
        );
        assert!(
            pod.metadata.owner_references.is_none(),
            "owner references cannot cross namespaces"
        );
        let labels = pod.metadata.labels.unwrap();
        assert_eq!(
            (
                labels[LABEL_CHAIN_NAMESPACE].as_str(),
                labels[LABEL_CHAIN].as_str(),
                labels[LABEL_CHAIN_UID].as_str()
            ),
            ("team-a", "redactor", "uid-1")
        );
        let np = network_policy(&chain, &sandboxed());
        assert_eq!(np.metadata.namespace.as_deref(), Some("sluice-sandboxes"));
        assert_eq!(
            np.metadata.name.as_deref(),
            Some("sluice-team-a.redactor-deny-all")
        );
        assert!(np.metadata.owner_references.is_none());
        // Chains of the same name in two namespaces get two policies, each selecting its own pods.
        assert_eq!(
            np.spec.unwrap().pod_selector.unwrap().match_labels.unwrap(),
            chain_labels("team-a", "redactor")
        );
        assert_eq!(
            chain_selector("team-a", "redactor"),
            "app.kubernetes.io/managed-by=sluice-operator,sluice.dev/chain=redactor,sluice.dev/chain-namespace=team-a"
        );
    }

    #[test]
    fn no_object_blocks_its_owners_deletion() {
        // OwnerReferencesPermissionEnforcement: blockOwnerDeletion needs update on
        // hookchains/finalizers, which the operator is not granted.
        let chain = simple();
        let settings = Settings::default();
        let pod_refs = pod(&chain, &settings).metadata.owner_references.unwrap();
        let np_refs = network_policy(&chain, &settings)
            .metadata
            .owner_references
            .unwrap();
        for r in pod_refs.iter().chain(&np_refs) {
            assert_eq!(r.block_owner_deletion, None, "{r:?}");
        }
    }

    #[test]
    fn objects_from_a_file_have_no_owner() {
        let mut c = simple();
        c.metadata.uid = None;
        assert!(
            pod(&c, &Settings::default())
                .metadata
                .owner_references
                .is_none()
        );
    }
}
