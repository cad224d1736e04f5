//! The names the operator and the gateway agree on for warm sandbox pods: the labels the operator
//! sets and the gateway selects and flips to claim a pod, the annotations of a claim, and where the
//! supervisor lives in the pod. One place, so the two sides cannot drift apart.

pub const LABEL_NAME: &str = "app.kubernetes.io/name";
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// The value of `LABEL_MANAGED_BY` on every sandbox pod (and the operator's field manager).
pub const OPERATOR: &str = "sluice-operator";
pub const LABEL_CHAIN: &str = "sluice.dev/chain";
pub const LABEL_TEMPLATE: &str = "sluice.dev/template";
/// `warm` when created; the gateway flips it to `claimed` in the claim PATCH.
pub const LABEL_POOL: &str = "sluice.dev/pool";
pub const POOL_WARM: &str = "warm";
pub const POOL_CLAIMED: &str = "claimed";
pub const ANNOTATION_CLAIMED_BY: &str = "sluice.dev/claimed-by";
pub const ANNOTATION_CLAIMED_AT: &str = "sluice.dev/claimed-at";
pub const SANDBOX_NAME: &str = "sluice-sandbox";
/// The container the gateway execs into.
pub const CONTAINER: &str = "supervisor";
/// The supervisor's path in the supervisor image.
pub const SUPERVISOR: &str = "/opt/sluice/supervisor.py";
