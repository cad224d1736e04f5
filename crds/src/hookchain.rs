//! The `HookChain` resource: an ordered list of Python hooks run at one trigger point of one target.

#[cfg(feature = "kube")]
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
#[cfg(feature = "kube")]
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;

use crate::free_form;

/// Where in the conversation a chain runs; fixes the shape of the payload its hooks see.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum TriggerPoint {
    /// The user's message before the agent sees it (text).
    Input,
    /// The agent's reply before the user sees it (text; streamed through `Gateway.Stream`).
    Output,
    /// Before every model call: `{model, messages, tools, max_tokens, usage_so_far, turn}`.
    BeforeModel,
    /// After every model call: `{message, usage}`.
    AfterModel,
    /// Before every tool call: `{name, arguments}`.
    BeforeTool,
    /// After every tool call: `{name, result, error}`.
    AfterTool,
}

impl TriggerPoint {
    pub const ALL: [TriggerPoint; 6] = [
        Self::Input,
        Self::Output,
        Self::BeforeModel,
        Self::AfterModel,
        Self::BeforeTool,
        Self::AfterTool,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Input => "input",
            Self::Output => "output",
            Self::BeforeModel => "before_model",
            Self::AfterModel => "after_model",
            Self::BeforeTool => "before_tool",
            Self::AfterTool => "after_tool",
        }
    }

    /// `input` and `output` carry text; the agent-loop points carry a structured value.
    pub fn carries_text(self) -> bool {
        matches!(self, Self::Input | Self::Output)
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|tp| tp.as_str() == s)
    }
}

impl fmt::Display for TriggerPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a hook does with the payload. A hook declares one and may return only it or `pass`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Leave the payload as it is.
    Pass,
    /// Replace the payload with the hook's `outgoing`.
    Modify,
    /// Stop the walk and refuse; `message` is for the user.
    Block,
    /// Stop the walk; the agent is not called and `message` may answer instead.
    Skip,
    /// Leave the payload as it is and report `findings` to the audit.
    Detect,
}

impl Action {
    pub const ALL: [Action; 5] = [
        Self::Pass,
        Self::Modify,
        Self::Block,
        Self::Skip,
        Self::Detect,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pass => "pass",
            Self::Modify => "modify",
            Self::Block => "block",
            Self::Skip => "skip",
            Self::Detect => "detect",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.as_str() == s)
    }

    /// `block` and `skip` end the walk.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Block | Self::Skip)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What happens when a hook raises, times out or returns something it may not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum FailurePolicy {
    /// End the run as `block` with the reason stated.
    #[default]
    Closed,
    /// Pass the payload on unchanged, as if the failing hook had returned `pass`.
    Open,
}

/// Whether a sandbox serves more than one trigger point. Either way every trigger point runs in a
/// fresh cell (each hook its own process in fresh namespaces inside the sandbox).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Reuse {
    /// A sandbox whose cell ended clean serves the chain's next trigger point, up to `maxUses`; it is
    /// retired after a dirty end, a deadline kill or a broken stream. Costs a few forks per trigger
    /// point instead of a sandbox boot.
    #[default]
    Recycle,
    /// Every sandbox serves one trigger point and is destroyed: a fresh gVisor kernel each time, at
    /// the cost of a sandbox boot per trigger point.
    None,
}

/// A HookChain runs ordered Python hooks on every payload of one trigger point of one target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(
    feature = "kube",
    derive(CustomResource),
    kube(
        group = "sluice.dev",
        version = "v1alpha1",
        kind = "HookChain",
        plural = "hookchains",
        shortname = "hc",
        namespaced,
        status = "HookChainStatus",
        scale = r#"{"specReplicasPath":".spec.pool.warm","statusReplicasPath":".status.warm"}"#,
        printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
        printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
        printcolumn = r#"{"name":"Warm","type":"integer","jsonPath":".status.warm"}"#,
        printcolumn = r#"{"name":"Claimed","type":"integer","jsonPath":".status.claimed"}"#,
        printcolumn = r#"{"name":"Trigger","type":"string","jsonPath":".spec.triggerPoint"}"#,
        printcolumn = r#"{"name":"Target","type":"string","jsonPath":".spec.target"}"#,
        printcolumn = r#"{"name":"Rollout","type":"string","jsonPath":".status.rollout.phase"}"#,
        printcolumn = r#"{"name":"Canary","type":"integer","priority":1,"jsonPath":".status.rollout.canaryPercent"}"#,
        printcolumn = r#"{"name":"Revision","type":"string","priority":1,"jsonPath":".status.rollout.liveRevision"}"#,
        printcolumn = r#"{"name":"Enforced","type":"boolean","priority":1,"jsonPath":".spec.enforced"}"#,
        printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
    )
)]
#[serde(rename_all = "camelCase")]
pub struct HookChainSpec {
    /// The agent or application this chain serves; callers name it in every request.
    pub target: String,
    /// The trigger point the chain runs at: input, output, before_model, after_model, before_tool or after_tool.
    pub trigger_point: TriggerPoint,
    /// Closed (default) ends the run as block when a hook fails; Open passes the payload on unchanged.
    #[serde(default)]
    pub failure_policy: FailurePolicy,
    /// Budget in milliseconds for one sandbox call (host_call time excluded); past it the sandbox is killed.
    #[serde(default = "default_timeout_ms")]
    #[schemars(range(min = 10, max = 60000))]
    pub timeout_ms: u32,
    /// How Gateway.Stream batches an agent reply through this chain.
    #[serde(default)]
    pub streaming: StreamingSpec,
    /// Size and reuse of the warm sandbox pool.
    #[serde(default)]
    pub pool: PoolSpec,
    /// Limits of every sandbox of this chain.
    #[serde(default)]
    pub resources: ResourceSpec,
    /// Platform baseline: honoured only in the gateway's platform namespace (default sluice-system),
    /// with target "*". The chain then runs before every tenant's chain at its trigger point, for
    /// every target in every namespace, and no tenant chain can remove, reorder or weaken it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub enforced: bool,
    /// The hooks, run in this order.
    #[schemars(length(min = 1, max = 32))]
    pub hooks: Vec<HookSpec>,
    /// How a change to the hooks reaches traffic. Absent: at once, for every session (a rollout in
    /// progress is then promoted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutSpec>,
    /// Versions of the hooks kept as revisions (the live one, a candidate and those before), so a
    /// rollback can name one.
    #[serde(default = "default_revision_history_limit")]
    #[schemars(range(min = 1, max = 100))]
    pub revision_history_limit: u32,
}

fn default_revision_history_limit() -> u32 {
    10
}

/// How new hooks are rolled out: beside the live ones (Shadow) or to a growing share of sessions
/// (Canary). The hooks in `spec.hooks` are the candidate; the revision served before stays live
/// until the candidate is promoted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// Shadow: the candidate runs beside the live hooks on live traffic; its results are compared
    /// and recorded, never applied; promote by hand. Canary: a share of sessions (`steps`) is
    /// served by the candidate, stepping up while it stays within bounds of the live hooks, then
    /// promoted; out of bounds, it is rolled back.
    pub strategy: RolloutStrategy,
    /// Canary: percent of sessions served by the candidate at each step, ascending, each 1..100.
    #[serde(default = "default_steps")]
    #[schemars(length(min = 1, max = 20))]
    pub steps: Vec<u32>,
    /// Canary: how long each step lasts while the candidate stays within bounds (500ms, 30s, 5m, 1h).
    #[serde(default = "default_step_duration")]
    pub step_duration: String,
    /// Canary: trigger points the candidate must have served in a step before the step may end or
    /// the candidate be judged.
    #[serde(default = "default_min_runs")]
    #[schemars(range(min = 1, max = 1000000))]
    pub min_runs: u32,
    /// Canary: most percentage points the candidate's hook-error rate may exceed the live hooks'
    /// (same step) before it is rolled back.
    #[serde(default = "default_max_error_increase")]
    #[schemars(range(max = 100))]
    pub max_error_rate_increase: u32,
    /// Canary: most percentage points the candidate's block rate may exceed the live hooks'.
    #[serde(default = "default_max_block_increase")]
    #[schemars(range(max = 100))]
    pub max_block_rate_increase: u32,
    /// Shadow: most shadow runs of this chain in flight at once per gateway; past it, a shadow run
    /// is dropped (and counted), never queued behind live traffic.
    #[serde(default = "default_shadow_concurrency")]
    #[schemars(range(min = 1, max = 64))]
    pub shadow_concurrency: u32,
}

/// How a candidate revision meets traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum RolloutStrategy {
    Shadow,
    Canary,
}

impl RolloutStrategy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Shadow => "Shadow",
            Self::Canary => "Canary",
        }
    }
}

fn default_steps() -> Vec<u32> {
    vec![10, 50]
}
fn default_step_duration() -> String {
    "1m".into()
}
fn default_min_runs() -> u32 {
    20
}
fn default_max_error_increase() -> u32 {
    5
}
fn default_max_block_increase() -> u32 {
    10
}
fn default_shadow_concurrency() -> u32 {
    4
}

/// The target an enforced baseline chain names: every target.
pub const ALL_TARGETS: &str = "*";

/// Most bytes of hook code one HookChain may hold, all hooks together: the whole object must stay
/// well under etcd's 1.5 MiB request limit (settings, status and managed fields ride along).
pub const MAX_CHAIN_CODE_BYTES: usize = 512 * 1024;

/// The namespace whose enforced chains are platform baselines, unless the gateway is told otherwise.
pub const DEFAULT_PLATFORM_NAMESPACE: &str = "sluice-system";

fn default_timeout_ms() -> u32 {
    2000
}

/// How a streamed reply is batched: run the chain every `flushChars`, hold back the last `lookbackChars`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StreamingSpec {
    /// Characters buffered before the chain runs on the stream path.
    #[serde(default = "default_flush_chars")]
    #[schemars(range(min = 1, max = 1048576))]
    pub flush_chars: u32,
    /// Characters of each result held back as the next batch's prefix, so a pattern split across chunks is seen whole.
    #[serde(default = "default_lookback_chars")]
    #[schemars(range(max = 65536))]
    pub lookback_chars: u32,
}

impl Default for StreamingSpec {
    fn default() -> Self {
        Self {
            flush_chars: default_flush_chars(),
            lookback_chars: default_lookback_chars(),
        }
    }
}

fn default_flush_chars() -> u32 {
    64
}
fn default_lookback_chars() -> u32 {
    48
}

/// The warm pool of sandboxes kept ready for this chain.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolSpec {
    /// Sandboxes kept started and waiting, so a trigger point never waits for a boot.
    #[serde(default = "default_warm")]
    #[schemars(range(max = 1000))]
    pub warm: u32,
    /// Upper bound on sandboxes of this chain, warm and claimed together.
    #[serde(default = "default_max")]
    #[schemars(range(min = 1, max = 10000))]
    pub max: u32,
    /// Recycle (default): a sandbox serves trigger point after trigger point of this chain, each in
    /// a fresh cell. None: one sandbox per trigger point.
    #[serde(default)]
    pub reuse: Reuse,
    /// Trigger points one sandbox serves before it is retired (Recycle only).
    #[serde(default = "default_max_uses")]
    #[schemars(range(min = 1, max = 1000000))]
    pub max_uses: u32,
}

impl Default for PoolSpec {
    fn default() -> Self {
        Self {
            warm: default_warm(),
            max: default_max(),
            reuse: Reuse::Recycle,
            max_uses: default_max_uses(),
        }
    }
}

fn default_warm() -> u32 {
    2
}
fn default_max() -> u32 {
    20
}
fn default_max_uses() -> u32 {
    1000
}

/// What each sandbox is given: CPU guaranteed (a request), memory and processes (limits).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceSpec {
    /// CPU each sandbox is guaranteed, as a Kubernetes quantity (250m is a quarter of a core): the
    /// pod's CPU request, its share of the node under contention. It is not a limit: a sandbox may
    /// burst up to the platform's sandbox CPU limit (one core by default), so a walk is never
    /// throttled to this; a runaway hook is stopped by its deadline (`timeoutMs`).
    #[serde(default = "default_cpu")]
    pub cpu: String,
    /// Memory limit as a Kubernetes quantity (128Mi); the sandbox is killed past it.
    #[serde(default = "default_memory")]
    pub memory: String,
    /// Most processes and threads the sandbox may hold.
    #[serde(default = "default_pids")]
    #[schemars(range(min = 8, max = 4096))]
    pub pids: u32,
}

impl Default for ResourceSpec {
    fn default() -> Self {
        Self {
            cpu: default_cpu(),
            memory: default_memory(),
            pids: default_pids(),
        }
    }
}

fn default_cpu() -> String {
    "250m".into()
}
fn default_memory() -> String {
    "128Mi".into()
}
fn default_pids() -> u32 {
    64
}

/// One hook: Python source defining `execute(context, settings)`, or a ready hook of the library
/// used by name, and the one action it may take.
///
/// `code` is what runs: the hook's own code, or the ready hook's when `uses` names one (resolved as
/// the spec is read, so every component runs and hashes the same code).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(from = "HookFields", into = "HookFields")]
pub struct HookSpec {
    pub name: String,
    pub action: Action,
    pub settings: Option<serde_json::Value>,
    pub capabilities: Vec<String>,
    /// The ready hook (`crate::library`) this hook runs instead of code of its own.
    pub uses: Option<String>,
    /// The code that runs.
    pub code: String,
    /// What the document gave: code of its own (with or without `uses`: both is refused by
    /// validation).
    pub(crate) wrote_code: bool,
    /// An SSH signature (sshsig, armored) of this hook as written in this chain (`crate::signing`).
    pub signature: Option<String>,
}

impl HookSpec {
    /// A hook with code of its own.
    pub fn with_code(name: &str, action: Action, code: &str) -> Self {
        Self::from(HookFields {
            name: name.to_string(),
            action,
            settings: None,
            capabilities: Vec::new(),
            uses: None,
            code: Some(code.to_string()),
            signature: None,
        })
    }

    /// Whether the document gave code of its own.
    pub fn wrote_code(&self) -> bool {
        self.wrote_code
    }
}

/// One hook: Python source defining `execute(context, settings)`, or a ready hook of the Sluice library
/// used by name (`uses`), and the one action it may take.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.code) != has(self.uses)",
    "message": "a hook has code of its own or uses a ready hook, one of the two"
}]))]
struct HookFields {
    /// Name of the hook, unique within the chain; it appears in results, errors and the audit.
    #[schemars(length(min = 1, max = 63))]
    name: String,
    /// The action this hook may take besides pass: modify, block, skip or detect.
    action: Action,
    /// Free-form settings passed to execute as its second argument.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form")]
    settings: Option<serde_json::Value>,
    /// Capabilities (by name) this hook may call through host_call.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    capabilities: Vec<String>,
    /// A ready hook of the Sluice library to run instead of code (pii/email, pii/phone, pii/card,
    /// pii/iban, pii/ip, pii/secrets, pii/national-id, injection/heuristics, text/keywords,
    /// text/length, text/script; docs/hooks.md), configured by settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    uses: Option<String>,
    /// Python source that defines execute(context, settings) and returns a dict with an action. The
    /// code of all hooks of a chain together is at most 512 KiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 262144))]
    code: Option<String>,
    /// An SSH signature of this hook as written, bound to the chain's namespace and name (`sluice
    /// sign`; docs/signing.md): required where the platform requires signed code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 16384))]
    signature: Option<String>,
}

impl From<HookFields> for HookSpec {
    fn from(f: HookFields) -> Self {
        let wrote_code = f.code.is_some();
        let code = match (&f.uses, f.code) {
            // A name the library does not have leaves no code: validation says which names it has.
            (Some(uses), _) => crate::library::find(uses)
                .map(|ready| ready.code(f.action))
                .unwrap_or_default(),
            (None, code) => code.unwrap_or_default(),
        };
        Self {
            name: f.name,
            action: f.action,
            settings: f.settings,
            capabilities: f.capabilities,
            uses: f.uses,
            code,
            wrote_code,
            signature: f.signature,
        }
    }
}

impl From<HookSpec> for HookFields {
    fn from(h: HookSpec) -> Self {
        Self {
            name: h.name,
            action: h.action,
            settings: h.settings,
            capabilities: h.capabilities,
            code: (h.uses.is_none() || h.wrote_code).then_some(h.code),
            uses: h.uses,
            signature: h.signature,
        }
    }
}

impl JsonSchema for HookSpec {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        HookFields::schema_name()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        HookFields::json_schema(generator)
    }
}

/// What the operator and gateway report about a chain.
#[cfg(feature = "kube")]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HookChainStatus {
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Sandboxes started and waiting for a trigger point.
    #[serde(default)]
    pub warm: u32,
    /// Sandboxes serving a trigger point now.
    #[serde(default)]
    pub claimed: u32,
    /// SHA-256 of the chain's hooks (names, actions, settings, code), as recorded in the audit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code_hash: Option<String>,
    /// Ready, CodeValid, PoolReady and RolledOut, with reasons a platform engineer can act on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Which revision of the hooks is live, which is being rolled out and how far
    /// (`spec.rollout`; docs/rollout.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<crate::rollout::RolloutState>,
}

impl HookChainSpec {
    /// A stable hash of everything that decides what the hooks do; recorded in status and audit.
    pub fn code_hash(&self) -> String {
        let mut h = Sha256::new();
        for hook in &self.hooks {
            // serde_json::to_vec cannot fail for these plain types.
            let settings = hook
                .settings
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default();
            for part in [
                hook.name.as_str(),
                hook.action.as_str(),
                settings.as_str(),
                &hook.capabilities.join(","),
                hook.code.as_str(),
            ] {
                h.update((part.len() as u64).to_le_bytes());
                h.update(part.as_bytes());
            }
        }
        format!("sha256:{}", &hex::encode(h.finalize())[..16])
    }
}
