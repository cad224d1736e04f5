//! The gateways' entries in `status.rollout.shadow` outlive a gateway that stops without taking
//! its own away (a crash, a lost node, a kill past its grace). Each gateway renews its entry at
//! least every heartbeat (`updatedAt`); an entry older than the claim deadline belongs to a gateway
//! that is gone, as a claim not renewed in that time does, and is removed here by a JSON patch
//! that tests each entry's gateway and time first, so an entry renewed meanwhile stays.

use super::super::context::Context;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, Patch, PatchParams};
use sluice_crds::HookChain;
use sluice_crds::rollout::GatewayShadow;
use std::time::Duration;

/// Which entries are stale at `now` (by index, highest first: the order they can be removed in),
/// and when the next of the others becomes stale.
pub(super) fn stale(
    entries: &[GatewayShadow],
    now: Timestamp,
    deadline: SignedDuration,
) -> (Vec<usize>, Option<Timestamp>) {
    let mut gone = Vec::new();
    let mut next: Option<Timestamp> = None;
    for (i, e) in entries.iter().enumerate() {
        // An entry whose time cannot be read was not written by a gateway: nothing renews it.
        let expiry = e
            .updated_at
            .parse::<Timestamp>()
            .ok()
            .map(|t| t.min(now))
            .and_then(|t| t.checked_add(deadline).ok());
        match expiry {
            Some(at) if at > now => next = Some(next.map_or(at, |n| n.min(at))),
            _ => gone.push(i),
        }
    }
    gone.reverse();
    (gone, next)
}

/// Removes the entries of gateways gone longer than the claim deadline; returns when to look
/// again (the next entry's expiry), if any entry is left.
pub(crate) async fn prune(
    chain: &HookChain,
    namespace: &str,
    name: &str,
    now: Timestamp,
    ctx: &Context,
) -> Option<Duration> {
    let entries = chain
        .status
        .as_ref()
        .and_then(|s| s.rollout.as_ref())
        .map(|r| r.shadow.as_slice())
        .unwrap_or_default();
    let deadline = SignedDuration::try_from(ctx.claim_deadline).unwrap_or(SignedDuration::MAX);
    let (gone, next) = stale(entries, now, deadline);
    let wait = |at: Timestamp| at.duration_since(now).unsigned_abs() + Duration::from_secs(1);
    if gone.is_empty() {
        return next.map(wait);
    }
    let mut ops = Vec::new();
    for &i in &gone {
        let e = &entries[i];
        for (field, value) in [("gateway", &e.gateway), ("updatedAt", &e.updated_at)] {
            ops.push(serde_json::json!({
                "op": "test",
                "path": format!("/status/rollout/shadow/{i}/{field}"),
                "value": value,
            }));
        }
        ops.push(
            serde_json::json!({"op": "remove", "path": format!("/status/rollout/shadow/{i}")}),
        );
    }
    let gateways: Vec<&str> = gone.iter().map(|&i| entries[i].gateway.as_str()).collect();
    let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(ops))
        .expect("a JSON patch of test and remove");
    let api: Api<HookChain> = Api::namespaced(ctx.client.clone(), namespace);
    match api
        .patch_status(name, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
    {
        Ok(_) => {
            tracing::info!(chain = %format!("{namespace}/{name}"), gateways = ?gateways, deadline_s = ctx.claim_deadline.as_secs(), "removed shadow comparisons of gateways that stopped renewing them");
            next.map(wait)
        }
        Err(e) => {
            // A test that failed (an entry renewed or moved meanwhile) or any other refusal: the
            // next reconcile reads the status again.
            tracing::debug!(chain = %format!("{namespace}/{name}"), error = %e, "shadow comparisons not pruned now; trying again");
            Some(Duration::from_secs(5))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(gateway: &str, at: &str) -> GatewayShadow {
        GatewayShadow {
            gateway: gateway.into(),
            updated_at: at.into(),
            ..Default::default()
        }
    }

    #[test]
    fn entries_older_than_the_deadline_or_unreadable_are_stale_the_rest_set_the_next_look() {
        let now: Timestamp = "2026-12-07T12:00:00Z".parse().unwrap();
        let five = SignedDuration::from_mins(5);
        let entries = [
            entry("a", "2026-12-07T11:54:59Z"),
            entry("b", "2026-12-07T11:58:00Z"),
            entry("c", "yesterday"),
            entry("d", "2026-12-07T11:56:00Z"),
            // From the future (a clock ahead): counted from now, not kept forever.
            entry("e", "2030-01-01T00:00:00Z"),
        ];
        let (gone, next) = stale(&entries, now, five);
        assert_eq!(gone, [2, 0], "highest index first");
        assert_eq!(next, Some("2026-12-07T12:01:00Z".parse().unwrap()));
        assert_eq!(stale(&[], now, five), (vec![], None));
        let (gone, next) = stale(&entries[1..2], now, five);
        assert!(gone.is_empty());
        assert_eq!(next, Some("2026-12-07T12:03:00Z".parse().unwrap()));
    }
}
