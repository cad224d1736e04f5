//! Semantic rules beyond what the CRD schema can say. The gateway, the operator and `sluice check`
//! all apply these, so a chain is judged the same way everywhere.

use crate::{CapabilitySpec, HookChainSpec};
use std::collections::HashSet;

/// One problem with a resource: the field it concerns and what is wrong, in words a person can act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

fn problem(field: impl Into<String>, message: impl Into<String>) -> Problem {
    Problem {
        field: field.into(),
        message: message.into(),
    }
}

/// Hook names become label values and audit keys: DNS-label-like.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_' || b == b'.'
        })
        && name.as_bytes()[0].is_ascii_alphanumeric()
}

/// Smallest memory a sandbox with Python in it can start with.
pub const MIN_MEMORY_BYTES: u64 = 32 << 20;

pub fn hookchain(spec: &HookChainSpec) -> Vec<Problem> {
    let mut out = Vec::new();
    if spec.target.trim().is_empty() {
        out.push(problem(
            "spec.target",
            "must name the agent or app this chain serves",
        ));
    }
    if spec.enforced && spec.target != crate::ALL_TARGETS {
        out.push(problem(
            "spec.target",
            format!(
                "an enforced (baseline) chain applies to every target: set target \"*\", not {:?}",
                spec.target
            ),
        ));
    }
    if !spec.enforced && spec.target == crate::ALL_TARGETS {
        out.push(problem(
            "spec.target",
            "\"*\" (every target) is only for enforced baseline chains in the platform namespace (spec.enforced: true)",
        ));
    }
    if !(10..=60_000).contains(&spec.timeout_ms) {
        out.push(problem(
            "spec.timeoutMs",
            format!("{} is outside 10..60000", spec.timeout_ms),
        ));
    }
    if spec.streaming.flush_chars == 0 {
        out.push(problem("spec.streaming.flushChars", "must be at least 1"));
    }
    if spec.pool.max == 0 {
        out.push(problem("spec.pool.max", "must be at least 1"));
    }
    if spec.pool.max_uses == 0 {
        out.push(problem("spec.pool.maxUses", "must be at least 1"));
    }
    #[cfg(feature = "kube")]
    resources(spec, &mut out);
    if spec.resources.pids < 8 {
        out.push(problem("spec.resources.pids", "must be at least 8"));
    }
    if spec.hooks.is_empty() {
        out.push(problem("spec.hooks", "a chain needs at least one hook"));
    }
    let mut seen = HashSet::new();
    for (i, hook) in spec.hooks.iter().enumerate() {
        let at = format!("spec.hooks[{i}]");
        if !valid_name(&hook.name) {
            out.push(problem(
                format!("{at}.name"),
                format!(
                    "{:?} must be 1-63 lowercase letters, digits, '-', '_' or '.'",
                    hook.name
                ),
            ));
        } else if !seen.insert(hook.name.as_str()) {
            out.push(problem(
                format!("{at}.name"),
                format!("{:?} is used by an earlier hook", hook.name),
            ));
        }
        if hook.action == crate::Action::Pass {
            out.push(problem(
                format!("{at}.action"),
                "a hook declares what it may do besides pass: modify, block, skip or detect",
            ));
        }
        match &hook.uses {
            Some(_) if hook.wrote_code() => out.push(problem(
                format!("{at}.uses"),
                "a hook uses a ready hook or has code of its own, not both: remove code or uses",
            )),
            Some(name) => match crate::library::find(name) {
                Some(ready) => {
                    for (field, message) in ready.problems(hook.action, hook.settings.as_ref()) {
                        out.push(problem(format!("{at}.{field}"), message));
                    }
                }
                None => {
                    let hint = match crate::did_you_mean(name, crate::library::names()) {
                        Some(meant) => format!("did you mean {meant}? "),
                        None => String::new(),
                    };
                    out.push(problem(
                        format!("{at}.uses"),
                        format!(
                            "{name:?} is no ready hook: {hint}the library has {}",
                            crate::library::names().collect::<Vec<_>>().join(", ")
                        ),
                    ));
                }
            },
            None if hook.code.trim().is_empty() => out.push(problem(
                format!("{at}.code"),
                "is empty; it must define execute(context, settings) (or use a ready hook: uses)",
            )),
            None => {}
        }
        if let Some(s) = &hook.settings
            && !s.is_object()
        {
            out.push(problem(
                format!("{at}.settings"),
                "must be a mapping of names to values",
            ));
        }
    }
    if let Some(rollout) = &spec.rollout {
        rollout_rules(rollout, &mut out);
    }
    if spec.revision_history_limit == 0 {
        out.push(problem(
            "spec.revisionHistoryLimit",
            "must be at least 1 (the live revision is always kept)",
        ));
    }
    let code_bytes: usize = spec.hooks.iter().map(|h| h.code.len()).sum();
    if code_bytes > crate::MAX_CHAIN_CODE_BYTES {
        out.push(problem(
            "spec.hooks",
            format!(
                "the hooks' code together is {code_bytes} bytes, over the {} KiB a chain may hold (the object must stay well under etcd's 1.5 MiB): split the chain or move data out of the code",
                crate::MAX_CHAIN_CODE_BYTES / 1024
            ),
        ));
    }
    out
}

/// `spec.rollout`: canary steps that climb within 1..100, a readable step duration.
fn rollout_rules(rollout: &crate::RolloutSpec, out: &mut Vec<Problem>) {
    if rollout.steps.is_empty() {
        out.push(problem(
            "spec.rollout.steps",
            "needs at least one step (percent of sessions, like [10, 50])",
        ));
    }
    let mut last = 0;
    for (i, step) in rollout.steps.iter().enumerate() {
        if !(1..=100).contains(step) {
            out.push(problem(
                format!("spec.rollout.steps[{i}]"),
                format!("{step} is not a percent of sessions in 1..100"),
            ));
        } else if *step <= last {
            out.push(problem(
                format!("spec.rollout.steps[{i}]"),
                format!("{step} does not climb: each step serves more sessions than the one before ({last})"),
            ));
        }
        last = last.max(*step);
    }
    match crate::duration::parse_duration(&rollout.step_duration) {
        Ok(d) if d.is_zero() => out.push(problem(
            "spec.rollout.stepDuration",
            "must be longer than zero",
        )),
        Ok(_) => {}
        Err(e) => out.push(problem("spec.rollout.stepDuration", e.to_string())),
    }
    for (field, value) in [
        ("maxErrorRateIncrease", rollout.max_error_rate_increase),
        ("maxBlockRateIncrease", rollout.max_block_rate_increase),
    ] {
        if value > 100 {
            out.push(problem(
                format!("spec.rollout.{field}"),
                format!("{value} percentage points is more than 100"),
            ));
        }
    }
    if rollout.min_runs == 0 {
        out.push(problem("spec.rollout.minRuns", "must be at least 1"));
    }
    if rollout.shadow_concurrency == 0 {
        out.push(problem(
            "spec.rollout.shadowConcurrency",
            "must be at least 1",
        ));
    }
}

/// `spec.resources`' Kubernetes quantities: readable, CPU above zero, enough memory for Python.
#[cfg(feature = "kube")]
fn resources(spec: &HookChainSpec, out: &mut Vec<Problem>) {
    use crate::quantity;
    match quantity::cpu_millis(&spec.resources.cpu) {
        Ok(0) => out.push(problem("spec.resources.cpu", "must be more than 0")),
        Ok(_) => {}
        Err(e) => out.push(problem("spec.resources.cpu", e.to_string())),
    }
    match quantity::memory_bytes(&spec.resources.memory) {
        Ok(b) if b < MIN_MEMORY_BYTES => out.push(problem(
            "spec.resources.memory",
            format!(
                "{} is below the 32Mi a Python sandbox needs",
                spec.resources.memory
            ),
        )),
        Ok(_) => {}
        Err(e) => out.push(problem("spec.resources.memory", e.to_string())),
    }
}

pub fn capability(name: &str, spec: &CapabilitySpec) -> Vec<Problem> {
    let mut out = Vec::new();
    if name.is_empty() {
        out.push(problem(
            "metadata.name",
            "a capability needs the name hooks call it by",
        ));
    }
    match spec.endpoint.kinds_set() {
        1 => {}
        0 => out.push(problem("spec.endpoint", "set one of grpc, http or builtin")),
        _ => out.push(problem(
            "spec.endpoint",
            "set only one of grpc, http or builtin",
        )),
    }
    for (field, url) in [
        ("spec.endpoint.grpc", &spec.endpoint.grpc),
        ("spec.endpoint.http", &spec.endpoint.http),
    ] {
        if let Some(url) = url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            out.push(problem(
                field,
                format!("{url:?} must start with http:// or https://"),
            ));
        }
    }
    if let Some(set) = &spec.endpoint.credentials {
        if spec.endpoint.builtin.is_some() {
            out.push(problem(
                "spec.endpoint.credentials",
                "a built-in endpoint takes no credentials",
            ));
        } else if !valid_name(set) || set.contains('.') {
            out.push(problem(
                "spec.endpoint.credentials",
                format!(
                    "{set:?} is not a credential set's name: lowercase letters, digits, '-' and '_'"
                ),
            ));
        }
    }
    if let Some(schema) = &spec.schema
        && !schema.is_object()
    {
        out.push(problem("spec.schema", "must be a JSON Schema object"));
    }
    for (field, list) in [
        ("spec.gates", &spec.gates),
        ("spec.dispatch", &spec.dispatch),
    ] {
        if list.iter().any(|g| g == name) {
            out.push(problem(
                field,
                format!("{name:?} cannot be its own gate or dispatch step"),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Action, HookSpec, TriggerPoint};

    fn chain() -> HookChainSpec {
        serde_json::from_value(serde_json::json!({
            "target": "bot", "triggerPoint": "input",
            "hooks": [{"name": "a", "action": "modify", "code": "def execute(c, s): return {'action': 'pass'}"}]
        }))
        .unwrap()
    }

    #[test]
    fn a_rollout_that_cannot_be_followed_is_refused_with_the_field_and_why() {
        let mut c = chain();
        c.rollout = Some(
            serde_json::from_value(serde_json::json!({
                "strategy": "Canary", "steps": [50, 10, 0], "stepDuration": "30",
                "minRuns": 0, "maxErrorRateIncrease": 101, "shadowConcurrency": 0
            }))
            .unwrap(),
        );
        c.revision_history_limit = 0;
        let found: Vec<String> = hookchain(&c).iter().map(|p| p.to_string()).collect();
        for expected in [
            "spec.rollout.steps[1]: 10 does not climb",
            "spec.rollout.steps[2]: 0 is not a percent of sessions in 1..100",
            "spec.rollout.stepDuration: \"30\" has no unit",
            "spec.rollout.maxErrorRateIncrease: 101 percentage points is more than 100",
            "spec.rollout.minRuns: must be at least 1",
            "spec.rollout.shadowConcurrency: must be at least 1",
            "spec.revisionHistoryLimit: must be at least 1",
        ] {
            assert!(
                found.iter().any(|f| f.starts_with(expected)),
                "{expected:?} not in {found:#?}"
            );
        }
        // The defaults are a valid canary.
        c = chain();
        c.rollout =
            Some(serde_json::from_value(serde_json::json!({"strategy": "Canary"})).unwrap());
        assert_eq!(hookchain(&c), vec![]);
    }

    #[test]
    fn a_good_chain_has_no_problems() {
        assert_eq!(hookchain(&chain()), vec![]);
        assert_eq!(chain().trigger_point, TriggerPoint::Input);
    }

    #[test]
    fn a_hook_that_uses_a_ready_hook_runs_its_code_and_is_checked_against_it() {
        let spec = |hooks: serde_json::Value| -> HookChainSpec {
            serde_json::from_value(
                serde_json::json!({"target": "bot", "triggerPoint": "input", "hooks": hooks}),
            )
            .unwrap()
        };
        let good = spec(serde_json::json!([
            {"name": "iban", "action": "modify", "uses": "pii/iban", "settings": {"mask": "[IBAN]"}}
        ]));
        assert_eq!(hookchain(&good), vec![]);
        assert!(good.hooks[0].code.contains("DECLARED_ACTION = \"modify\""));
        assert!(
            good.hooks[0]
                .code
                .contains("def execute(context, settings)")
        );
        // Written back as the author wrote it: the name, not the library's code.
        let back = serde_json::to_value(&good).unwrap();
        assert_eq!(back["hooks"][0]["uses"], "pii/iban");
        assert!(back["hooks"][0].get("code").is_none(), "{back}");

        let bad = spec(serde_json::json!([
            {"name": "a", "action": "modify", "uses": "pii/ibna"},
            {"name": "b", "action": "skip", "uses": "pii/card", "settings": {"mask": 1}},
            {"name": "c", "action": "block", "uses": "pii/card", "code": "def execute(c, s):\n    return {'action': 'pass'}\n"},
            {"name": "d", "action": "block"}
        ]));
        let found: Vec<String> = hookchain(&bad).iter().map(|p| p.to_string()).collect();
        for expected in [
            "spec.hooks[0].uses: \"pii/ibna\" is no ready hook: did you mean pii/iban? the library has pii/email,",
            "spec.hooks[1].action: pii/card can modify, block, detect, not skip",
            "spec.hooks[1].settings.mask: must be a string, not 1",
            "spec.hooks[2].uses: a hook uses a ready hook or has code of its own, not both",
            "spec.hooks[3].code: is empty",
        ] {
            assert!(
                found.iter().any(|f| f.starts_with(expected)),
                "{expected:?} not in {found:#?}"
            );
        }
        // Each hook's code is part of the chain's hash: a ready hook's too, and its declared action.
        let detect = spec(serde_json::json!([
            {"name": "iban", "action": "detect", "uses": "pii/iban", "settings": {"mask": "[IBAN]"}}
        ]));
        assert_ne!(good.code_hash(), detect.code_hash());
    }

    #[test]
    fn duplicate_names_pass_action_and_bad_memory_are_reported() {
        let mut c = chain();
        c.hooks.push(HookSpec {
            action: Action::Pass,
            ..c.hooks[0].clone()
        });
        c.resources.memory = "1Mi".into();
        let problems: Vec<String> = hookchain(&c).iter().map(|p| p.to_string()).collect();
        assert!(
            problems.iter().any(|p| p.starts_with("spec.hooks[1].name")),
            "{problems:?}"
        );
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("spec.hooks[1].action")),
            "{problems:?}"
        );
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("spec.resources.memory")),
            "{problems:?}"
        );
    }

    #[test]
    fn the_code_of_a_whole_chain_is_bounded() {
        let mut c = chain();
        let body = format!(
            "# {}\ndef execute(c, s):\n    return {{'action': 'pass'}}\n",
            "x".repeat(200 * 1024)
        );
        c.hooks[0].code = body.clone();
        for name in ["b", "c"] {
            let mut h = c.hooks[0].clone();
            h.name = name.into();
            c.hooks.push(h);
        }
        // Each hook is under its own 256 KiB limit; together they are over 512 KiB.
        let problems = hookchain(&c);
        assert!(
            problems
                .iter()
                .any(|p| p.field == "spec.hooks" && p.message.contains("512 KiB")),
            "{problems:?}"
        );
        c.hooks.pop();
        assert!(hookchain(&c).is_empty(), "two hooks of 200 KiB fit");
    }

    #[test]
    fn enforced_goes_with_every_target() {
        let mut c = chain();
        c.enforced = true;
        let p = hookchain(&c);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].message.contains("every target"), "{p:?}");
        c.target = "*".into();
        assert_eq!(hookchain(&c), vec![]);
        c.enforced = false;
        let p = hookchain(&c);
        assert!(p[0].message.contains("only for enforced"), "{p:?}");
    }

    #[test]
    fn capability_endpoint_must_be_exactly_one() {
        let mut spec: CapabilitySpec =
            serde_json::from_value(serde_json::json!({"endpoint": {"builtin": "echo"}})).unwrap();
        assert!(capability("x", &spec).is_empty());
        spec.endpoint.http = Some("ftp://nope".into());
        let p = capability("x", &spec);
        assert_eq!(p.len(), 2, "{p:?}");
    }
}
