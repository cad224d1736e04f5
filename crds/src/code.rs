//! Static analysis of hook code, shared by `sluice check` and the operator's `CodeValid` condition:
//! the host's python3 parses each hook with `ast` (never executes it) and reports what would fail at
//! load or call time: a syntax error, no `execute(context, settings)`, imports outside the standard
//! library, returned actions other than the declared one or `pass`.

use crate::HookSpec;

/// Static analysis of hook code, run by the host's python3 on the code as text.
const ANALYSER: &str = r#"
import ast, json, sys
ACTIONS = ("modify", "block", "skip", "detect")
out = []
for hook in json.load(sys.stdin):
    problems = []
    try:
        tree = ast.parse(hook["code"], filename="<hook>")
    except SyntaxError as e:
        out.append([{"line": e.lineno or 1, "message": "SyntaxError: %s" % e.msg}])
        continue
    execute = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "execute"]
    if not execute:
        problems.append({"line": 1, "message": "the code does not define execute(context, settings) at the top level"})
    else:
        f = execute[-1]
        if isinstance(f, ast.AsyncFunctionDef):
            problems.append({"line": f.lineno, "message": "execute must be a plain def, not async def"})
        n = len(f.args.posonlyargs) + len(f.args.args)
        if n < 2 and f.args.vararg is None:
            problems.append({"line": f.lineno, "message": "execute takes %d argument(s); it is called as execute(context, settings)" % n})
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names:
                problems.append({"line": node.lineno, "message": "imports %r, which is not in Python's standard library (hooks can use only the standard library)" % top})
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "action" and isinstance(v, ast.Constant) and isinstance(v.value, str):
                    if v.value not in ("pass",) + ACTIONS:
                        problems.append({"line": v.lineno, "message": "returns action %r, which is not one of pass, %s" % (v.value, ", ".join(ACTIONS))})
                    elif v.value not in ("pass", hook["action"]):
                        problems.append({"line": v.lineno, "message": "returns action %r but the hook declares %r (a hook may return only its declared action or pass)" % (v.value, hook["action"])})
    out.append(problems)
print(json.dumps(out))
"#;

/// One problem in a hook's code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodeProblem {
    /// Line within the hook's code (1-based).
    pub line: usize,
    pub message: String,
}

/// Why the code could not be checked at all (not a problem in the code).
#[derive(Debug, thiserror::Error)]
pub enum CodeCheckError {
    #[error("cannot run python3 to check hook code: {0}")]
    Spawn(std::io::Error),
    #[error("talking to the code checker failed: {0}")]
    Io(std::io::Error),
    #[error("the code checker failed: {0}")]
    Failed(String),
    #[error("the code checker answered something unreadable: {0}")]
    Answer(#[from] serde_json::Error),
}

/// Per hook, in order, the problems found in its code, as the `python3` first on `PATH` parses it.
pub fn analyse(hooks: &[HookSpec]) -> Result<Vec<Vec<CodeProblem>>, CodeCheckError> {
    analyse_with(std::path::Path::new("python3"), hooks)
}

/// Per hook, in order, the problems found in its code, as `python` parses it: give the interpreter
/// the sandboxes run, so that syntax it would refuse is refused here too.
pub fn analyse_with(
    python: &std::path::Path,
    hooks: &[HookSpec],
) -> Result<Vec<Vec<CodeProblem>>, CodeCheckError> {
    use std::io::Write;
    let input: Vec<serde_json::Value> = hooks
        .iter()
        .map(|h| serde_json::json!({"action": h.action.as_str(), "code": h.code}))
        .collect();
    let mut child = std::process::Command::new(python)
        .args(["-I", "-S", "-c", ANALYSER])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(CodeCheckError::Spawn)?;
    let body = serde_json::to_vec(&input)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(&body).map_err(CodeCheckError::Io)?;
    }
    let out = child.wait_with_output().map_err(CodeCheckError::Io)?;
    if !out.status.success() {
        return Err(CodeCheckError::Failed(
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ));
    }
    let parsed: Vec<Vec<serde_json::Value>> = serde_json::from_slice(&out.stdout)?;
    Ok(parsed
        .into_iter()
        .map(|ps| {
            ps.into_iter()
                .map(|p| CodeProblem {
                    line: p["line"].as_u64().unwrap_or(1) as usize,
                    message: p["message"].as_str().unwrap_or_default().to_string(),
                })
                .collect()
        })
        .collect())
}
