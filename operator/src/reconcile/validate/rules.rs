//! Judging a HookChain before its pool grows: the semantic rules of `sluice_crds::validate`, the
//! hook code analysis `sluice check` uses (Python's `ast`, run by the host's python3 on the code as
//! text, never executed), and the capabilities its hooks name. The result is the `CodeValid`
//! condition.

use crate::reconcile::status::Verdict;
use sluice_crds::{CapabilitySpec, HookChainSpec, validate};

/// Problems per hook, as (line within the code, message).
pub type CodeProblems = Vec<Vec<(usize, String)>>;

/// Why hook code could not be checked at all: the verdict is then Unknown, never Invalid.
#[derive(Debug, thiserror::Error)]
pub enum CheckerError {
    #[error(transparent)]
    Analyser(#[from] sluice_crds::code::CodeCheckError),
    #[error("the code checker task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// The analyser's findings; `Err` when the checker cannot run.
pub type CodeCheck = Result<CodeProblems, CheckerError>;

/// Runs the code analyser (`crate::code_checker`). Blocking: it waits for the interpreter.
pub fn check_code(spec: &HookChainSpec) -> CodeCheck {
    let per_hook = sluice_crds::code::analyse_with(&crate::code_checker(), &spec.hooks)?;
    Ok(per_hook
        .into_iter()
        .map(|problems| problems.into_iter().map(|p| (p.line, p.message)).collect())
        .collect())
}

/// A capability as the operator's cache shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CapabilityState {
    Missing,
    /// Present, but unusable: why.
    Invalid(String),
    Valid,
}

/// Everything wrong with a Capability, in words: the shared semantic rules and its JSON Schema.
pub fn capability_problems(name: &str, spec: &CapabilitySpec) -> Vec<String> {
    let mut out: Vec<String> = validate::capability(name, spec)
        .iter()
        .map(|p| p.to_string())
        .collect();
    if let Some(schema) = &spec.schema
        && schema.is_object()
        && let Err(e) = sluice_crds::schema::check_schema(schema)
    {
        out.push(format!("spec.schema: not a valid JSON Schema: {e}"));
    }
    out
}

/// Longest condition message the operator writes; the API server allows 32 KiB.
const MAX_MESSAGE: usize = 2000;

fn bounded(s: String) -> String {
    crate::reconcile::text::bounded(s, MAX_MESSAGE)
}

/// Why a HookChain's name cannot be used: it is the value of the `sluice.dev/chain` label on every
/// pod and in the NetworkPolicy's selector, and the API server refuses invalid label values.
pub fn name_problem(name: &str) -> Option<String> {
    const LIMIT: &str = "HookChain names used as label values must be at most 63 characters";
    if name.len() > 63 {
        return Some(format!(
            "metadata.name is {} characters: {LIMIT}",
            name.len()
        ));
    }
    let edge_ok = |c: Option<char>| c.is_none_or(|c| c.is_ascii_alphanumeric());
    let chars_ok = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !chars_ok || !edge_ok(name.chars().next()) || !edge_ok(name.chars().last()) {
        return Some(format!(
            "metadata.name {name:?} is not a valid label value: HookChain names used as label values must begin and end with a letter or digit and contain only letters, digits, '-', '_' and '.'"
        ));
    }
    None
}

/// The `CodeValid` verdict. Problems of every kind are listed; the reason names the first kind.
pub fn verdict(
    name: &str,
    spec: &HookChainSpec,
    namespace: &str,
    code: &CodeCheck,
    capability: impl Fn(&str) -> CapabilityState,
) -> Verdict {
    let mut reason: Option<&'static str> = None;
    let mut problems: Vec<String> = Vec::new();
    let mut note = |r: &'static str, msg: String| {
        reason.get_or_insert(r);
        problems.push(msg);
    };
    if let Some(p) = name_problem(name) {
        note("InvalidName", p);
    }
    for p in validate::hookchain(spec) {
        note("InvalidSpec", p.to_string());
    }
    if let Ok(per_hook) = code {
        for (hook, found) in spec.hooks.iter().zip(per_hook) {
            for (line, message) in found {
                note(
                    "InvalidCode",
                    format!("hook {} line {line}: {message}", hook.name),
                );
            }
        }
    }
    for hook in &spec.hooks {
        for cap in &hook.capabilities {
            match capability(cap) {
                CapabilityState::Valid => {}
                CapabilityState::Missing => note(
                    "UnknownCapability",
                    format!(
                        "hook {}: capability {cap:?} is not defined in namespace {namespace}",
                        hook.name
                    ),
                ),
                CapabilityState::Invalid(why) => note(
                    "InvalidCapability",
                    format!("hook {}: capability {cap:?} is invalid: {why}", hook.name),
                ),
            }
        }
    }
    if let Some(reason) = reason {
        return Verdict {
            status: "False",
            reason,
            message: bounded(problems.join("; ")),
        };
    }
    match code {
        Err(e) => Verdict {
            status: "Unknown",
            reason: "CheckerUnavailable",
            message: bounded(format!("hook code could not be checked: {e}")),
        },
        Ok(_) => Verdict {
            status: "True",
            reason: "Valid",
            message: format!(
                "{} hook(s) checked: syntax, execute(context, settings), declared actions, capabilities",
                spec.hooks.len()
            ),
        },
    }
}

/// The verdict once the platform's sandbox CPU limit is applied: a chain that asks to be guaranteed
/// more CPU than one sandbox may use is invalid (the webhook refuses it too; this catches objects
/// written past it and limits lowered after the chain was applied).
pub fn within_cpu_limit(
    verdict: Verdict,
    spec: &HookChainSpec,
    limit: sluice_crds::cpu::SandboxCpuLimit,
) -> Verdict {
    match limit.refuses(&spec.resources.cpu) {
        Some(problem) => invalid_also(verdict, "CpuOverLimit", problem),
        None => verdict,
    }
}

/// `verdict` with one more problem: invalid, for the reason it had if it was invalid already.
fn invalid_also(verdict: Verdict, reason: &'static str, problem: String) -> Verdict {
    let (reason, message) = if verdict.is_invalid() {
        (verdict.reason, format!("{}; {problem}", verdict.message))
    } else {
        (reason, problem)
    };
    Verdict {
        status: "False",
        reason,
        message: bounded(message),
    }
}

/// The verdict with the platform's signing policy applied: where signed code is required, a chain
/// whose hooks do not all verify is invalid (`UnsignedCode`), as every gateway will not serve it.
pub fn signed(
    verdict: Verdict,
    namespace: &str,
    name: &str,
    spec: &HookChainSpec,
    signing: Option<&sluice_crds::signing::Policy>,
) -> Verdict {
    match signing.map(|p| p.check(namespace, name, spec)) {
        Some(Err(refused)) => invalid_also(verdict, "UnsignedCode", refused.to_string()),
        _ => verdict,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unsigned_chain_is_invalid_where_signed_code_is_required() {
        let s = spec(GOOD, &[]);
        let valid = verdict("chain", &s, "ns", &check_code(&s), |_| {
            CapabilityState::Valid
        });
        assert!(!valid.is_invalid(), "{valid:?}");
        let policy = sluice_crds::signing::Policy {
            signers: Default::default(),
            required: sluice_crds::signing::Required::parse("ns"),
        };
        let v = signed(valid.clone(), "ns", "chain", &s, Some(&policy));
        assert_eq!((v.status, v.reason), ("False", "UnsignedCode"), "{v:?}");
        assert!(v.message.contains("is not signed"), "{v:?}");
        let elsewhere = signed(valid.clone(), "other", "chain", &s, Some(&policy));
        assert!(!elsewhere.is_invalid(), "{elsewhere:?}");
        assert!(!signed(valid, "ns", "chain", &s, None).is_invalid());
    }

    #[test]
    fn a_chain_asking_more_cpu_than_the_platform_limit_is_invalid() {
        let mut s = spec(GOOD, &[]);
        let valid = verdict("chain", &s, "ns", &check_code(&s), |_| {
            CapabilityState::Valid
        });
        assert_eq!(valid.status, "True", "{valid:?}");
        let one = sluice_crds::cpu::SandboxCpuLimit(Some(1000));
        assert_eq!(within_cpu_limit(valid.clone(), &s, one), valid);
        s.resources.cpu = "2".into();
        let v = within_cpu_limit(valid, &s, one);
        assert_eq!((v.status, v.reason), ("False", "CpuOverLimit"), "{v:?}");
        assert!(v.message.contains("spec.resources.cpu 2"), "{}", v.message);
    }

    fn spec(code: &str, caps: &[&str]) -> HookChainSpec {
        serde_json::from_value(serde_json::json!({
            "target": "bot", "triggerPoint": "input",
            "hooks": [
                {"name": "ok", "action": "modify", "code": "def execute(context, settings):\n    return {'action': 'pass'}\n"},
                {"name": "redact-phone", "action": "modify", "capabilities": caps, "code": code}
            ]
        }))
        .unwrap()
    }

    const GOOD: &str =
        "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': 'x'}\n";

    #[test]
    fn names_must_be_valid_label_values() {
        let s = spec(GOOD, &[]);
        let ok = Ok(vec![vec![], vec![]]);
        let long = "a".repeat(64);
        let v = verdict(&long, &s, "ns", &ok, |_| CapabilityState::Valid);
        assert_eq!((v.status, v.reason), ("False", "InvalidName"), "{v:?}");
        assert!(
            v.message
                .contains("HookChain names used as label values must be at most 63 characters"),
            "{}",
            v.message
        );
        assert!(name_problem(&"a".repeat(63)).is_none());
        assert!(name_problem("redactor.v2").is_none());
        assert!(name_problem("-x").is_some());
        assert!(name_problem("x.").is_some());
        assert!(name_problem("a/b").is_some());
    }

    #[test]
    fn good_code_is_valid() {
        let s = spec(GOOD, &[]);
        let v = verdict("chain", &s, "ns", &check_code(&s), |_| {
            CapabilityState::Valid
        });
        assert_eq!((v.status, v.reason), ("True", "Valid"), "{v:?}");
    }

    #[test]
    fn a_syntax_error_names_the_hook_and_line() {
        let s = spec(
            "def execute(context, settings):\n    x = 1\n    return {'action': 'pass'\n",
            &[],
        );
        let v = verdict("chain", &s, "ns", &check_code(&s), |_| {
            CapabilityState::Valid
        });
        assert_eq!((v.status, v.reason), ("False", "InvalidCode"));
        assert!(
            v.message
                .starts_with("hook redact-phone line 3: SyntaxError"),
            "{}",
            v.message
        );
    }

    #[test]
    fn missing_execute_and_undeclared_actions_are_reported() {
        let s = spec("def run(c, s):\n    return {'action': 'block'}\n", &[]);
        let v = verdict("chain", &s, "ns", &check_code(&s), |_| {
            CapabilityState::Valid
        });
        assert!(
            v.message.contains("does not define execute"),
            "{}",
            v.message
        );
        let s = spec("def execute(c, s):\n    return {'action': 'block'}\n", &[]);
        let v = verdict("chain", &s, "ns", &check_code(&s), |_| {
            CapabilityState::Valid
        });
        assert!(
            v.message
                .contains("returns action 'block' but the hook declares 'modify'"),
            "{}",
            v.message
        );
    }

    #[test]
    fn capabilities_must_exist_and_be_valid() {
        let s = spec(GOOD, &["llm.run", "credit.check"]);
        let v = verdict("chain", &s, "team-a", &check_code(&s), |name| match name {
            "llm.run" => CapabilityState::Missing,
            _ => CapabilityState::Invalid("spec.endpoint: set one of grpc, http or builtin".into()),
        });
        assert_eq!((v.status, v.reason), ("False", "UnknownCapability"));
        assert!(
            v.message
                .contains("capability \"llm.run\" is not defined in namespace team-a"),
            "{}",
            v.message
        );
        assert!(
            v.message
                .contains("capability \"credit.check\" is invalid: spec.endpoint"),
            "{}",
            v.message
        );
    }

    #[test]
    fn spec_problems_come_first() {
        let mut s = spec(GOOD, &[]);
        s.resources.memory = "1Mi".into();
        let v = verdict("chain", &s, "ns", &Ok(vec![vec![], vec![]]), |_| {
            CapabilityState::Valid
        });
        assert_eq!(v.reason, "InvalidSpec");
        assert!(v.message.contains("spec.resources.memory"), "{}", v.message);
    }

    #[test]
    fn a_checker_that_cannot_run_leaves_the_verdict_unknown() {
        let s = spec(GOOD, &[]);
        let missing = std::io::Error::new(std::io::ErrorKind::NotFound, "no python3 on PATH");
        let cannot_run =
            Err(sluice_crds::code::CodeCheckError::Spawn("python3".into(), missing).into());
        let v = verdict("chain", &s, "ns", &cannot_run, |_| CapabilityState::Valid);
        assert_eq!((v.status, v.reason), ("Unknown", "CheckerUnavailable"));
        assert!(
            v.message
                .contains("cannot run python3 to check hook code: no python3 on PATH"),
            "{}",
            v.message
        );
    }

    #[test]
    fn capability_schemas_must_be_json_schema() {
        let spec: CapabilitySpec = serde_json::from_value(serde_json::json!({
            "endpoint": {"builtin": "echo"},
            "schema": {"type": "no-such-type"}
        }))
        .unwrap();
        let p = capability_problems("echo", &spec);
        assert!(p.iter().any(|p| p.starts_with("spec.schema")), "{p:?}");
        let ok: CapabilitySpec = serde_json::from_value(
            serde_json::json!({"endpoint": {"builtin": "echo"}, "schema": {"type": "object"}}),
        )
        .unwrap();
        assert!(capability_problems("echo", &ok).is_empty());
    }
}
