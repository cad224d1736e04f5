//! The `Capability` resource: an application function hooks may reach through `host_call`.

#[cfg(feature = "kube")]
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
#[cfg(feature = "kube")]
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::free_form;

/// A Capability is an application function that hooks may call by its `metadata.name`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(
    feature = "kube",
    derive(CustomResource),
    kube(
        group = "sluice.dev",
        version = "v1alpha1",
        kind = "Capability",
        plural = "capabilities",
        shortname = "cap",
        namespaced,
        status = "CapabilityStatus",
        printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
        printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
        printcolumn = r#"{"name":"Description","type":"string","jsonPath":".spec.description"}"#,
        printcolumn = r#"{"name":"Gates","type":"string","priority":1,"jsonPath":".spec.gates"}"#,
        printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
    )
)]
#[serde(rename_all = "camelCase")]
pub struct CapabilitySpec {
    /// What the capability does, for hook authors.
    #[serde(default)]
    pub description: String,
    /// JSON Schema every host_call payload must satisfy before anything else runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form")]
    pub schema: Option<serde_json::Value>,
    /// Capabilities called before execute with {capability, payload, caller}; each answers {allow, reason}.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gates: Vec<String>,
    /// Capabilities called after execute with {capability, payload, result, consumed}.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dispatch: Vec<String>,
    /// Where execute goes: exactly one of grpc, http or builtin.
    pub endpoint: Endpoint,
    /// Whether a call may be made again with the same payload without effect beyond the first (a
    /// lookup, a classifier): only such capabilities are called by hooks running in shadow during
    /// a rollout; others answer those hooks an error.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub safe_to_repeat: bool,
    /// Most milliseconds one call may take, gates and dispatch excluded.
    #[serde(default = "default_timeout_ms")]
    #[schemars(range(min = 1, max = 600000))]
    pub timeout_ms: u32,
}

fn default_timeout_ms() -> u32 {
    5000
}

/// What the operator reports about a Capability.
#[cfg(feature = "kube")]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CapabilityStatus {
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// SchemaValid (the spec and its JSON Schema are usable) and Ready (besides, every gate and
    /// dispatch step it names exists in its namespace and is valid), with reasons.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Exactly one of the three fields is set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(not(feature = "kube"), derive(JsonSchema))]
#[cfg_attr(feature = "kube", derive(KubeSchema), x_kube(validation = Rule::new("[has(self.grpc), has(self.http), has(self.builtin)].filter(x, x).size() == 1").message("set exactly one of grpc, http or builtin")))]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    /// URL of a service implementing sluice.v1.CapabilityService/Execute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<String>,
    /// URL that takes a JSON POST of {name, payload, caller} and answers {result, consumed}.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<String>,
    /// A function built into the gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub builtin: Option<Builtin>,
    /// What the gateway presents to a grpc or http endpoint: the name of a credential set the
    /// platform gave the gateway (`--capability-credentials`; the chart's `capabilities.credentials`).
    /// A set holds a bearer token (`token`), a client certificate (`tls.crt`, `tls.key`) and/or the CA
    /// that signed the endpoint's certificate (`ca.crt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<String>,
}

/// Functions built into the gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Builtin {
    /// Answers with the payload it was given.
    Echo,
    /// Executes nothing and reports `{credits: N}` consumed (the payload's `credits`, default 1):
    /// for a capability that only charges, gated by a credit check that reserves and settled by a
    /// dispatch step that consumes (the examples' `credit.charge`).
    Charge,
}

impl Endpoint {
    /// How many of grpc, http and builtin are set; a valid endpoint has exactly one.
    pub fn kinds_set(&self) -> usize {
        [
            self.grpc.is_some(),
            self.http.is_some(),
            self.builtin.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count()
    }
}
