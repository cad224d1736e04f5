//! The trusted side's verdict on a walk. The supervisor reports each hook's result; this module
//! re-derives everything from those results (payload, state, top action, terminal index) and never
//! takes the supervisor's summary on faith. A hook's own failure is handled by the chain's
//! `failurePolicy`; a result the supervisor should have refused, or a summary that disagrees with the
//! results, means the sandbox itself cannot be trusted, and the run ends as `block` under either policy.

use crate::chain::Chain;
use crate::limits::Limits;
use crate::state_vector::StateVector;
use crate::supervisor::{SandboxFailure, WalkReport};
use crate::wire::Lines;
use serde_json::Value;
use sluice_crds::fields::did_you_mean;
use sluice_crds::{Action, FailurePolicy, TriggerPoint};

/// Which chain of a run a hook belongs to. A hook's `name` is its own; `HookOutcome::shown_name`
/// adds the layer where people read it (answers, the audit, logs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layer {
    /// The chain the caller's target names.
    #[default]
    Own,
    /// The namespace's baseline chain, walked before it.
    Baseline,
    /// The baseline walked again over what the tenant's chain let through, shown when that changed
    /// or ended it.
    Recheck,
}

impl Layer {
    /// How a hook of this layer is named where it is shown: `baseline/<hook>`,
    /// `baseline-recheck/<hook>`.
    pub fn prefix(self) -> &'static str {
        match self {
            Self::Own => "",
            Self::Baseline => "baseline/",
            Self::Recheck => "baseline-recheck/",
        }
    }

    /// The hook belongs to the namespace's baseline chain (walked first or again).
    pub fn is_baseline(self) -> bool {
        self != Self::Own
    }
}

/// One hook's part in a run, as the gateway reports and audits it.
#[derive(Clone, Debug, PartialEq)]
pub struct HookOutcome {
    pub index: usize,
    /// The hook's own name, as its chain declares it.
    pub name: String,
    pub layer: Layer,
    pub action: Action,
    pub message: String,
    pub findings: Option<Value>,
    pub error: Option<String>,
    pub latency_us: u64,
    /// The end of what the hook printed, up to `Limits::hook_output_bytes` (None when it printed
    /// nothing or the gateway carries none).
    pub output: Option<String>,
    /// Which lines of its code ran, when its sandbox traces them (authoring tools only).
    pub lines: Option<Lines>,
}

impl HookOutcome {
    /// The name shown in answers and the audit: the baseline's hooks under their layer's prefix.
    pub fn shown_name(&self) -> String {
        format!("{}{}", self.layer.prefix(), self.name)
    }
}

/// The top action of a walk that goes on after one more non-terminal action: modify over detect over
/// pass (a terminal action ends the walk and is the top action by itself).
pub(crate) fn merge_action(top: Action, next: Action) -> Action {
    match (top, next) {
        (_, Action::Modify) | (Action::Modify, _) => Action::Modify,
        (_, Action::Detect) | (Action::Detect, _) => Action::Detect,
        _ => top,
    }
}

/// Where a walk stands after folding one report.
#[derive(Clone, Debug, PartialEq)]
pub struct Walk {
    pub payload: Value,
    pub action: Action,
    pub message: String,
    pub hooks: Vec<HookOutcome>,
    pub terminal_index: Option<usize>,
    /// Set when the sandbox failed at a hook and the policy is Open: continue from this index in a
    /// fresh sandbox.
    pub resume_at: Option<usize>,
    /// Hooks already given a second chance after their sandbox failed.
    pub retried: std::collections::BTreeSet<usize>,
}

impl Walk {
    pub fn new(payload: Value) -> Self {
        Self {
            payload,
            action: Action::Pass,
            message: String::new(),
            hooks: Vec::new(),
            terminal_index: None,
            resume_at: None,
            retried: Default::default(),
        }
    }

    fn end(&mut self, index: usize, action: Action, message: String) {
        self.terminal_index = Some(index);
        self.action = action;
        self.message = message;
        self.resume_at = None;
    }

    /// Applies a hook failure under the chain's policy.
    fn hook_failed(
        &mut self,
        chain: &Chain,
        index: usize,
        error: String,
        latency_us: u64,
        (output, lines): (Option<String>, Option<Lines>),
    ) {
        let error = explain(chain, index, &error);
        let name = chain.spec.hooks[index].name.clone();
        let reason = format!("hook {name:?} failed: {error}");
        self.hooks.push(HookOutcome {
            index,
            name,
            layer: Layer::Own,
            action: Action::Pass,
            message: String::new(),
            findings: None,
            error: Some(error),
            latency_us,
            output,
            lines,
        });
        if chain.spec.failure_policy == FailurePolicy::Closed {
            self.end(index, Action::Block, reason);
        }
    }

    /// The sandbox reported something no honest supervisor would: stop, whatever the policy.
    fn untrusted(&mut self, index: usize, why: Untrusted) {
        self.hooks.retain(|h| h.index < index);
        let message = format!("the sandbox returned an invalid result: {why}");
        self.hooks.push(HookOutcome {
            index,
            name: String::new(),
            layer: Layer::Own,
            action: Action::Pass,
            message: String::new(),
            findings: None,
            error: Some(message.clone()),
            latency_us: 0,
            output: None,
            lines: None,
        });
        self.end(index, Action::Block, message);
    }

    pub fn is_terminal(&self) -> bool {
        self.terminal_index.is_some()
    }
}

/// The keys of a structured payload the application reads back, with what they must stay: a hook
/// rewrites their values (fewer tools, compacted messages), never their kind, so an application
/// never receives a payload it cannot use. A key the caller did not send is not required.
fn shape_of(trigger_point: TriggerPoint) -> &'static [(&'static str, &'static str)] {
    match trigger_point {
        TriggerPoint::BeforeModel => &[
            ("model", "a string"),
            ("messages", "an array"),
            ("tools", "an array"),
            ("max_tokens", "a number"),
        ],
        TriggerPoint::AfterModel => &[("message", "an object")],
        TriggerPoint::BeforeTool => &[("name", "a string")],
        TriggerPoint::AfterTool => &[("name", "a string")],
        TriggerPoint::Input | TriggerPoint::Output => &[],
    }
}

/// Why the gateway does not trust what a sandbox answered for a hook: a supervisor that obeys the
/// protocol never sends it, so the walk stops at that hook and the sandbox is retired.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Untrusted {
    #[error("results continued after the walk ended")]
    AfterTheEnd,
    #[error("result for hook #{index} {name:?} where #{due} was due")]
    OutOfOrder {
        index: usize,
        name: String,
        due: usize,
    },
    #[error("{0}")]
    Forged(String),
    #[error("summary says {said} at {said_at:?}, results say {derived} at {derived_at:?}")]
    SummaryDisagrees {
        said: String,
        said_at: Option<usize>,
        derived: Action,
        derived_at: Option<usize>,
    },
    #[error("the walk stopped at hook #{0} without a terminal action")]
    NoTerminalAction(usize),
    #[error("no result summary")]
    NoSummary,
    #[error("unknown action {0:?}")]
    UnknownAction(String),
    #[error("hook {hook:?} returned {returned} but declared {declared}")]
    Undeclared {
        hook: String,
        returned: Action,
        declared: Action,
    },
    #[error("modify without outgoing")]
    ModifyWithoutOutgoing,
    #[error("outgoing has the wrong type for {0}")]
    WrongType(TriggerPoint),
    #[error("outgoing {trigger_point} payload must keep {key:?} as {kind}")]
    LostShape {
        trigger_point: TriggerPoint,
        key: &'static str,
        kind: &'static str,
    },
    #[error("{what} is nested deeper than {limit} levels")]
    TooDeep { what: &'static str, limit: usize },
    #[error("{what} is {size} bytes, over the limit of {limit}")]
    TooBig {
        what: &'static str,
        size: usize,
        limit: usize,
    },
    #[error("message over {0} characters")]
    MessageTooLong(usize),
}

fn keeps_shape(
    trigger_point: TriggerPoint,
    incoming: &Value,
    out: &Value,
) -> Result<(), Untrusted> {
    for (key, kind) in shape_of(trigger_point) {
        let Some(was) = incoming.get(key) else {
            continue;
        };
        let same = match out.get(key) {
            Some(now) => {
                std::mem::discriminant(was) == std::mem::discriminant(now) || was.is_null()
            }
            None => false,
        };
        if !same {
            return Err(Untrusted::LostShape {
                trigger_point,
                key,
                kind,
            });
        }
    }
    Ok(())
}

fn json_size(v: &Value) -> usize {
    serde_json::to_vec(v).map(|b| b.len()).unwrap_or(usize::MAX)
}

fn depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 1usize)];
    while let Some((v, d)) = stack.pop() {
        deepest = deepest.max(d);
        match v {
            Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            Value::Object(o) => stack.extend(o.values().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    deepest
}

fn bounded(
    v: &Value,
    what: &'static str,
    max_bytes: usize,
    limits: &Limits,
) -> Result<(), Untrusted> {
    if depth(v) > limits.depth {
        return Err(Untrusted::TooDeep {
            what,
            limit: limits.depth,
        });
    }
    let size = json_size(v);
    if size > max_bytes {
        return Err(Untrusted::TooBig {
            what,
            size,
            limit: max_bytes,
        });
    }
    Ok(())
}

/// What a hook's `context` holds (the supervisor's runner makes it), for a KeyError's hint.
const CONTEXT_KEYS: &[&str] = &[
    "outgoing",
    "state",
    "caller",
    "target",
    "trigger_point",
    "namespace",
    "session_id",
    "run_id",
    "hook",
    "host_call",
];

/// A hook's error made readable where the hook was written: each traceback line the supervisor
/// sends (`  line N, in f: source`) gets its source line from the hook's code when the sandbox had
/// none, and the line of the file it came from; a `KeyError` on a key the hook's settings do not
/// have lists the keys they do have.
pub(crate) fn explain(chain: &Chain, index: usize, error: &str) -> String {
    let Some(hook) = chain.spec.hooks.get(index) else {
        return error.to_string();
    };
    let code: Vec<&str> = hook.code.lines().collect();
    let base = chain.code_lines.get(index).copied().flatten();
    let mut out: Vec<String> = error
        .lines()
        .map(|line| {
            let Some(rest) = line.strip_prefix("  line ") else {
                return line.to_string();
            };
            let Some((n, rest)) = rest.split_once(", in ") else {
                return line.to_string();
            };
            let Ok(n) = n.parse::<usize>() else {
                return line.to_string();
            };
            let (func, source) = rest
                .split_once(": ")
                .unwrap_or((rest.trim_end_matches(':'), ""));
            let source = match source.trim() {
                "" => code
                    .get(n.wrapping_sub(1))
                    .map(|l| l.trim())
                    .unwrap_or_default(),
                s => s,
            };
            let at = base
                .map(|b| format!(" ({}:{})", chain.origin.file.display(), b + n))
                .unwrap_or_default();
            format!("  line {n}{at}, in {func}: {source}")
        })
        .collect();
    // The line that raised: the last traceback line. A hint names the dict that line reads, never
    // another one (a `context["plan"]` KeyError is no reason to list the settings).
    let raised = out
        .iter()
        .rev()
        .find(|l| l.starts_with("  line "))
        .cloned()
        .unwrap_or_default();
    if let Some(key) = out
        .first()
        .and_then(|l| l.strip_prefix("KeyError: "))
        .map(|k| k.trim().trim_matches(['\'', '"']).to_string())
        && raised.contains("context")
        && !raised.contains("settings")
    {
        out.push(match did_you_mean(&key, CONTEXT_KEYS.iter().copied()) {
            Some(meant) => format!("  (did you mean context[{meant:?}]?)"),
            None => format!(
                "  (if this is context[{key:?}]: context has {}; what the application sent is in context[\"caller\"], e.g. context[\"caller\"].get({key:?}))",
                CONTEXT_KEYS.join(", ")
            ),
        });
    } else if let Some(key) = out
        .first()
        .and_then(|l| l.strip_prefix("KeyError: "))
        .map(|k| k.trim().trim_matches(['\'', '"']).to_string())
    {
        let settings = chain.settings.get(index).and_then(Value::as_object);
        if !settings.is_some_and(|s| s.contains_key(&key)) {
            let keys: Vec<&str> = settings
                .map(|s| s.keys().map(String::as_str).collect())
                .unwrap_or_default();
            let meant = did_you_mean(&key, keys.iter().copied());
            out.push(if let Some(meant) = meant {
                format!(
                    "  (if this is settings[{key:?}]: did you mean settings[{meant:?}]? hook {:?}'s settings have {})",
                    hook.name,
                    keys.join(", ")
                )
            } else if keys.is_empty() {
                format!(
                    "  (if this is settings[{key:?}]: hook {:?} declares no settings)",
                    hook.name
                )
            } else {
                format!(
                    "  (if this is settings[{key:?}]: hook {:?}'s settings have {})",
                    hook.name,
                    keys.join(", ")
                )
            });
        }
    }
    // No network in a cell: say so, and where the way out is.
    if out.first().is_some_and(|l| {
        [
            "urllib.request",
            "http.client",
            "socket",
            "ssl",
            "requests",
            "Errno -3",
            "Name or service not known",
        ]
        .iter()
        .any(|n| l.contains(n))
    }) {
        out.push(
            "  (hooks have no network: reach an application service through a capability, context.host_call(name, payload); docs/hooks.md §6)"
                .into(),
        );
    }
    out.join("\n")
}

/// What a sandbox failure says about the hook it stopped, and how long that hook ran.
fn failure_text(chain: &Chain, failure: &SandboxFailure) -> (String, u64) {
    match failure {
        SandboxFailure::Timeout(ms) => (
            format!(
                "timed out after {ms} ms: an endless loop or slow code (the chain's spec.timeoutMs is {} ms, time in host_calls not counted); fix the loop, make the hook faster or raise spec.timeoutMs",
                chain.spec.timeout_ms
            ),
            ms.saturating_mul(1000),
        ),
        other => (other.to_string(), 0),
    }
}

/// Folds one walk report (hooks from `start`) into `walk`, updating `state`.
pub(crate) fn fold(
    chain: &Chain,
    start: usize,
    report: &WalkReport,
    walk: &mut Walk,
    state: &mut StateVector,
    limits: &Limits,
) {
    let hooks = &chain.spec.hooks;
    let text = chain.spec.trigger_point.carries_text();
    let mut expected = start;
    for r in &report.hooks {
        if walk.is_terminal() {
            return walk.untrusted(r.index, Untrusted::AfterTheEnd);
        }
        if r.index != expected || r.index >= hooks.len() || r.name != hooks[r.index].name {
            let why = Untrusted::OutOfOrder {
                index: r.index,
                name: r.name.clone(),
                due: expected,
            };
            return walk.untrusted(expected, why);
        }
        let hook = &hooks[r.index];
        expected += 1;
        if let Some(error) = &r.error {
            walk.hook_failed(
                chain,
                r.index,
                error.clone(),
                r.latency_us,
                (
                    output_tail(r.output.as_deref(), limits.hook_output_bytes),
                    r.lines.as_deref().cloned(),
                ),
            );
            continue;
        }
        let Some(action) = Action::parse(&r.action) else {
            return walk.untrusted(r.index, Untrusted::UnknownAction(r.action.clone()));
        };
        if action != Action::Pass && action != hook.action {
            let why = Untrusted::Undeclared {
                hook: hook.name.clone(),
                returned: action,
                declared: hook.action,
            };
            return walk.untrusted(r.index, why);
        }
        let checked = (|| {
            if action == Action::Modify {
                let out = r
                    .outgoing
                    .as_ref()
                    .ok_or(Untrusted::ModifyWithoutOutgoing)?;
                if text != out.is_string() || (!text && !out.is_object()) {
                    return Err(Untrusted::WrongType(chain.spec.trigger_point));
                }
                bounded(out, "outgoing", limits.payload_bytes, limits)?;
                keeps_shape(chain.spec.trigger_point, &walk.payload, out)?;
            }
            if let Some(f) = &r.findings {
                bounded(f, "findings", limits.findings_bytes, limits)?;
            }
            if let Some(s) = &r.state {
                bounded(s, "state", limits.state_bytes, limits)?;
            }
            match &r.message {
                Some(m) if m.chars().count() > limits.message_chars => {
                    Err(Untrusted::MessageTooLong(limits.message_chars))
                }
                _ => Ok(()),
            }
        })();
        if let Err(why) = checked {
            return walk.untrusted(r.index, why);
        }
        if let Some(s) = &r.state {
            state.set(r.index, s.clone());
        }
        if let (Action::Modify, Some(out)) = (action, &r.outgoing) {
            walk.payload = out.clone();
        }
        let message = r.message.clone().unwrap_or_default();
        walk.hooks.push(HookOutcome {
            index: r.index,
            name: hook.name.clone(),
            layer: Layer::Own,
            action,
            message: message.clone(),
            findings: r.findings.clone(),
            error: None,
            latency_us: r.latency_us,
            output: output_tail(r.output.as_deref(), limits.hook_output_bytes),
            lines: r.lines.as_deref().cloned(),
        });
        match action {
            Action::Block | Action::Skip => walk.end(r.index, action, message),
            _ => walk.action = merge_action(walk.action, action),
        }
    }
    if let Some(SandboxFailure::Forged(why)) = &report.failure {
        let why = Untrusted::Forged(why.clone());
        return walk.untrusted(expected.min(hooks.len().saturating_sub(1)), why);
    }
    if let Some(failure) = &report.failure {
        if walk.is_terminal() || expected >= hooks.len() {
            // Everything that mattered arrived before the sandbox failed.
            return;
        }
        // Under Open the hook due next gets one more try in a fresh sandbox before it is blamed:
        // what killed the sandbox may have been left running by a hook before it.
        if chain.spec.failure_policy == FailurePolicy::Open && walk.retried.insert(expected) {
            walk.resume_at = Some(expected);
            return;
        }
        let (error, latency_us) = failure_text(chain, failure);
        walk.hook_failed(chain, expected, error, latency_us, (None, None));
        if !walk.is_terminal() && expected + 1 < hooks.len() {
            walk.resume_at = Some(expected + 1);
        }
        return;
    }
    match &report.summary {
        Some((action, terminal)) => {
            if (action.as_str(), *terminal) != (walk.action.as_str(), walk.terminal_index) {
                let why = Untrusted::SummaryDisagrees {
                    said: action.clone(),
                    said_at: *terminal,
                    derived: walk.action,
                    derived_at: walk.terminal_index,
                };
                walk.untrusted(expected.min(hooks.len().saturating_sub(1)), why);
            } else if !walk.is_terminal() && expected < hooks.len() {
                walk.untrusted(expected, Untrusted::NoTerminalAction(expected));
            }
        }
        None => walk.untrusted(
            expected.min(hooks.len().saturating_sub(1)),
            Untrusted::NoSummary,
        ),
    }
}

/// The last `max` bytes of a hook's output (at a character boundary), or None. The supervisor
/// bounds it too; this bound is the gateway's own, as for everything else a sandbox sends.
fn output_tail(output: Option<&str>, max: usize) -> Option<String> {
    let text = output.filter(|o| !o.is_empty() && max > 0)?;
    let mut cut = text.len().saturating_sub(max);
    while !text.is_char_boundary(cut) {
        cut += 1;
    }
    Some(text[cut..].to_string())
}

/// Convenience for failures before any hook ran (init timeout, sandbox death at init).
pub(crate) fn failure_before_walk(
    chain: &Chain,
    failure: &SandboxFailure,
    walk: &mut Walk,
    start: usize,
) {
    let report = WalkReport {
        failure: Some(failure.clone()),
        ..Default::default()
    };
    let mut unused = StateVector::fresh(chain.spec.hooks.len());
    fold(chain, start, &report, walk, &mut unused, &Limits::default());
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_top_action_is_modify_over_detect_over_pass_whatever_the_order() {
        use Action::{Detect, Modify, Pass};
        let rank = |a: Action| [Pass, Detect, Modify].iter().position(|x| *x == a).unwrap();
        for top in [Pass, Detect, Modify] {
            for next in [Pass, Detect, Modify] {
                let merged = merge_action(top, next);
                assert_eq!(
                    rank(merged),
                    rank(top).max(rank(next)),
                    "{top:?} then {next:?}"
                );
                assert_eq!(merged, merge_action(next, top), "{top:?} and {next:?}");
            }
        }
    }

    use super::*;
    use crate::wire::HookResult;
    use serde_json::json;

    fn chain(policy: &str) -> Chain {
        let spec: sluice_crds::HookChainSpec = serde_json::from_value(json!({
            "target": "bot", "triggerPoint": "input", "failurePolicy": policy, "hooks": [
                {"name": "a", "action": "modify", "code": "x"},
                {"name": "b", "action": "detect", "code": "x"},
                {"name": "c", "action": "block", "code": "x"}
            ]
        }))
        .unwrap();
        Chain::new("ns", "c", &spec).unwrap()
    }

    #[test]
    fn a_misspelt_context_key_gets_the_key_it_meant() {
        let spec: sluice_crds::HookChainSpec = serde_json::from_value(json!({
            "target": "bot", "triggerPoint": "input", "hooks": [
                {"name": "a", "action": "modify",
                 "code": "def execute(context, settings):\n    t = context['outgonig']\n    return {'action': 'pass'}\n"}
            ]
        }))
        .unwrap();
        let chain = Chain::new("ns", "c", &spec).unwrap();
        let said = explain(&chain, 0, "KeyError: 'outgonig'\n  line 2, in execute: ");
        assert!(
            said.ends_with("\n  (did you mean context[\"outgoing\"]?)"),
            "{said}"
        );
        // A key the application may have sent: where what it sent is.
        let said = explain(
            &chain,
            0,
            "KeyError: 'user_id'\n  line 2, in execute: t = context['user_id']",
        );
        assert!(
            said.contains("context[\"caller\"].get(\"user_id\")"),
            "{said}"
        );
    }

    #[test]
    fn errors_point_at_the_file_line_and_name_the_settings_keys() {
        let spec: sluice_crds::HookChainSpec = serde_json::from_value(json!({
            "target": "bot", "triggerPoint": "input", "hooks": [
                {"name": "mask", "action": "modify", "settings": {"mask": "x", "limit": 2},
                 "code": "def execute(context, settings):\n    m = settings['mask_text']\n    return {'action': 'pass'}\n"}
            ]
        }))
        .unwrap();
        let mut chain = Chain::new("ns", "c", &spec).unwrap();
        chain.origin.file = "chains/mask.yaml".into();
        chain.code_lines = vec![Some(20)];
        let said = explain(&chain, 0, "KeyError: 'mask_text'\n  line 2, in execute: ");
        assert_eq!(
            said,
            "KeyError: 'mask_text'\n  line 2 (chains/mask.yaml:22), in execute: m = settings['mask_text']\n  (if this is settings[\"mask_text\"]: did you mean settings[\"mask\"]? hook \"mask\"'s settings have limit, mask)"
        );
        let said = explain(
            &chain,
            0,
            "KeyError: 'colour'\n  line 2, in execute: settings['colour']",
        );
        assert!(
            said.ends_with(
                "(if this is settings[\"colour\"]: hook \"mask\"'s settings have limit, mask)"
            ),
            "nothing close, no guess: {said}"
        );
        // A context key read is no settings mistake: the hint is about context.
        let said = explain(
            &chain,
            0,
            "KeyError: 'plan'\n  line 2, in execute: p = context['plan']",
        );
        assert!(
            said.contains("if this is context[\"plan\"]") && !said.contains("settings have"),
            "{said}"
        );
        let said = explain(
            &chain,
            0,
            "ModuleNotFoundError: No module named 'urllib.request'\n  line 1, in <module>: x",
        );
        assert!(said.contains("hooks have no network"), "{said}");
        // A key the settings have is someone else's KeyError: nothing is added.
        let said = explain(&chain, 0, "KeyError: 'mask'\n  line 2, in execute: x");
        assert!(!said.contains("settings have"), "{said}");
    }

    fn result(index: usize, name: &str, action: &str) -> HookResult {
        serde_json::from_value(json!({"id": 1, "index": index, "name": name, "action": action}))
            .unwrap()
    }

    fn report(hooks: Vec<HookResult>, summary: (&str, Option<usize>)) -> WalkReport {
        WalkReport {
            hooks,
            summary: Some((summary.0.into(), summary.1)),
            ..Default::default()
        }
    }

    fn run(c: &Chain, r: &WalkReport) -> (Walk, StateVector) {
        let mut w = Walk::new(json!("hi"));
        let mut s = StateVector::fresh(3);
        fold(c, 0, r, &mut w, &mut s, &Limits::default());
        (w, s)
    }

    #[test]
    fn state_and_payload_are_threaded_from_results() {
        let c = chain("Closed");
        let mut a = result(0, "a", "modify");
        a.outgoing = Some(json!("HI"));
        a.state = Some(json!({"n": 1}));
        let mut b = result(1, "b", "detect");
        b.findings = Some(json!(["x"]));
        let (w, s) = run(
            &c,
            &report(vec![a, b, result(2, "c", "pass")], ("modify", None)),
        );
        assert_eq!(w.payload, json!("HI"));
        assert_eq!(w.action, Action::Modify);
        assert_eq!(s.as_slice(), &[json!({"n": 1}), Value::Null, Value::Null]);
        assert_eq!(w.hooks.len(), 3);
    }

    #[test]
    fn a_rewrite_that_breaks_the_payload_shape_is_refused() {
        let spec: sluice_crds::HookChainSpec = serde_json::from_value(json!({
            "target": "bot", "triggerPoint": "before_model", "failurePolicy": "Open",
            "hooks": [{"name": "a", "action": "modify", "code": "x"}]
        }))
        .unwrap();
        let c = Chain::new("ns", "c", &spec).unwrap();
        let incoming = json!({"model": "m", "messages": [], "tools": [], "max_tokens": 5});
        let fold_one = |out: Value| {
            let mut a = result(0, "a", "modify");
            a.outgoing = Some(out);
            let mut w = Walk::new(incoming.clone());
            let mut s = StateVector::fresh(1);
            fold(
                &c,
                0,
                &report(vec![a], ("modify", None)),
                &mut w,
                &mut s,
                &Limits::default(),
            );
            w
        };
        let fine = fold_one(
            json!({"model": "m", "messages": [{"role": "system"}], "tools": [], "max_tokens": 5}),
        );
        assert_eq!(fine.action, Action::Modify);
        for broken in [
            json!({"model": "m", "messages": "gone", "tools": [], "max_tokens": 5}),
            json!({"model": "m", "tools": [], "max_tokens": 5}),
            json!({"model": "m", "messages": [], "tools": {}, "max_tokens": "5"}),
        ] {
            let w = fold_one(broken.clone());
            assert_eq!(w.action, Action::Block, "{broken}");
            assert!(w.message.contains("must keep"), "{broken}: {}", w.message);
        }
    }

    #[test]
    fn an_undeclared_action_is_refused_even_under_open() {
        let c = chain("Open");
        let (w, _) = run(
            &c,
            &report(vec![result(0, "a", "block")], ("block", Some(0))),
        );
        assert_eq!((w.action, w.terminal_index), (Action::Block, Some(0)));
        assert!(w.message.contains("invalid result"), "{}", w.message);
    }

    #[test]
    fn a_summary_that_disagrees_is_refused() {
        let c = chain("Closed");
        let rs = vec![
            result(0, "a", "pass"),
            result(1, "b", "pass"),
            result(2, "c", "pass"),
        ];
        let (w, _) = run(&c, &report(rs, ("modify", None)));
        assert_eq!(w.action, Action::Block);
    }

    #[test]
    fn a_timeout_blocks_under_closed_and_resumes_under_open() {
        let failure = SandboxFailure::Timeout(2000);
        let r = WalkReport {
            hooks: vec![result(0, "a", "pass")],
            failure: Some(failure),
            ..Default::default()
        };
        let (w, _) = run(&chain("Closed"), &r);
        assert_eq!((w.action, w.terminal_index), (Action::Block, Some(1)));
        assert!(
            w.message.contains("\"b\"") && w.message.contains("timed out"),
            "{}",
            w.message
        );
        // Open: hook "b" gets a second try in a fresh sandbox, and only then is skipped.
        let c = chain("Open");
        let mut w = Walk::new(json!("hi"));
        let mut s = StateVector::fresh(3);
        fold(&c, 0, &r, &mut w, &mut s, &Limits::default());
        assert_eq!((w.resume_at, w.hooks.len()), (Some(1), 1));
        let again = WalkReport {
            failure: Some(SandboxFailure::Timeout(2000)),
            ..Default::default()
        };
        w.resume_at = None;
        fold(&c, 1, &again, &mut w, &mut s, &Limits::default());
        assert_eq!(
            (w.action, w.terminal_index, w.resume_at),
            (Action::Pass, None, Some(2))
        );
        let error = w.hooks[1].error.as_deref().unwrap_or_default();
        assert!(
            error.starts_with("timed out after 2000 ms: an endless loop or slow code (the chain's spec.timeoutMs is 2000 ms"),
            "{error}"
        );
        assert_eq!(w.hooks[1].latency_us, 2_000_000, "the time spent is stated");
    }

    #[test]
    fn out_of_order_results_are_refused() {
        let c = chain("Open");
        let (w, _) = run(&c, &report(vec![result(1, "b", "pass")], ("pass", None)));
        assert_eq!(w.action, Action::Block);
    }

    #[test]
    fn oversized_state_is_refused() {
        let c = chain("Open");
        let mut a = result(0, "a", "pass");
        a.state = Some(json!("x".repeat(100_000)));
        let (w, s) = run(&c, &report(vec![a], ("pass", None)));
        assert_eq!(w.action, Action::Block);
        assert_eq!(s.get(0), Some(&Value::Null));
    }
}
