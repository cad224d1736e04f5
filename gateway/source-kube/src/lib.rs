//! Sluice's kube-mode source of chains: the HookChains and Capabilities of the watched namespaces,
//! kept in watch caches and handed to the engine's registry as a new snapshot whenever either
//! changes; and what the gateway writes back (a rollout's rollback annotation, its shadow
//! comparison). The sandboxes themselves come from `sluice-sandbox-kube`, which knows nothing of
//! chains or of the engine.

mod source;

pub use source::{AnnotateRollback, KubeSource, ShadowTimes, publish_shadows, reread_signers};
