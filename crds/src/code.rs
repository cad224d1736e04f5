//! Static analysis of hook code, shared by `sluice check` and the operator's `CodeValid` condition:
//! the host's python3 parses each hook with `ast` (never executes it) and reports what would fail at
//! load or call time: what Python's compiler refuses, no `execute(context, settings)`, imports outside
//! the standard library or not available in the sandbox, a path through `execute` that returns
//! nothing, a result that is not a dict or has keys the gateway does not read, returned actions
//! other than the declared one or `pass` (in the result itself, not in dicts nested in it), and
//! `host_call`s of capabilities the hook does not list. It also lists the settings keys the code
//! reads (`settings["k"]`, `settings.get("k")`), so `sluice check` can compare them with the keys
//! the hook declares.

use crate::HookSpec;

/// The modules a hook can import inside a cell: what the cell runtime's snapshot holds
/// (`supervisor/guest/runner.py` imports them while the snapshot is made) and the modules built into
/// its interpreter; nothing else can be imported there. Modules whose name has a part starting with
/// `_` are not listed and not checked. supervisor/tests/cells.rs checks this list (sorted) against a
/// real instance.
pub const SANDBOX_MODULES: &[&str] = &[
    "abc",
    "annotationlib",
    "array",
    "ast",
    "atexit",
    "base64",
    "binascii",
    "bisect",
    "builtins",
    "calendar",
    "cmath",
    "codecs",
    "codeop",
    "collections",
    "collections.abc",
    "colorsys",
    "compression",
    "contextlib",
    "copy",
    "copyreg",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "encodings",
    "encodings.aliases",
    "encodings.utf_8",
    "enum",
    "errno",
    "faulthandler",
    "fnmatch",
    "fractions",
    "functools",
    "gc",
    "genericpath",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "html.entities",
    "html.parser",
    "importlib",
    "importlib.machinery",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "json.decoder",
    "json.encoder",
    "json.scanner",
    "keyword",
    "linecache",
    "locale",
    "marshal",
    "math",
    "numbers",
    "opcode",
    "operator",
    "os",
    "os.path",
    "posix",
    "posixpath",
    "pprint",
    "pyexpat",
    "pyexpat.errors",
    "pyexpat.model",
    "random",
    "re",
    "reprlib",
    "secrets",
    "select",
    "shlex",
    "stat",
    "statistics",
    "string",
    "struct",
    "sys",
    "textwrap",
    "time",
    "token",
    "tokenize",
    "traceback",
    "types",
    "typing",
    "unicodedata",
    "urllib",
    "urllib.parse",
    "uuid",
    "warnings",
    "weakref",
    "xml",
    "xml.etree",
    "xml.etree.ElementPath",
    "xml.etree.ElementTree",
    "zipimport",
    "zlib",
];

/// Static analysis of hook code, run by the host's python3 on the code as text.
const ANALYSER: &str = r#"
import ast, difflib, json, sys
ACTIONS = ("modify", "block", "skip", "detect")
KEYS = ("action", "outgoing", "message", "findings", "state")
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
TRY = (ast.Try,) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())
out = []
data = json.load(sys.stdin)
SANDBOX = set(data["sandbox"])

def own(f):
    """The nodes of f's body, not those of functions, lambdas or classes inside it."""
    stack = list(f.body)
    while stack:
        n = stack.pop()
        yield n
        if not isinstance(n, SCOPES):
            stack.extend(ast.iter_child_nodes(n))

def breaks(stmts):
    """Whether a break in stmts leaves the loop they are the body of."""
    stack = list(stmts)
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Break):
            return True
        if not isinstance(n, SCOPES + (ast.For, ast.AsyncFor, ast.While)):
            stack.extend(ast.iter_child_nodes(n))
    return False

def completes(stmts):
    """Whether running stmts can reach their end (a loop may run no times, except while True)."""
    return all(passes(s) for s in stmts)

def passes(s):
    if isinstance(s, (ast.Return, ast.Raise)):
        return False
    if isinstance(s, ast.If):
        return completes(s.body) or completes(s.orelse)
    if isinstance(s, ast.While) and isinstance(s.test, ast.Constant) and s.test.value:
        return breaks(s.body)
    if isinstance(s, (ast.With, ast.AsyncWith)):
        return completes(s.body)
    if isinstance(s, TRY):
        if not completes(s.finalbody):
            return False
        return (completes(s.body) and completes(s.orelse)) or any(completes(h.body) for h in s.handlers)
    if hasattr(ast, "Match") and isinstance(s, ast.Match):
        total = any(isinstance(c.pattern, ast.MatchAs) and c.pattern.pattern is None and c.guard is None for c in s.cases)
        return not total or any(completes(c.body) for c in s.cases)
    return True

KINDS = {str: "a string", int: "a number", float: "a number", bool: "True or False", bytes: "bytes"}

def result_problems(value, hook, problems):
    """What is wrong with one value execute returns (a literal, or a dict)."""
    line = value.lineno
    if isinstance(value, ast.Constant) and value.value is None:
        problems.append({"line": line, "message": "returns None, which is a hook error; return a dict, e.g. return {\"action\": \"pass\"}"})
    elif isinstance(value, ast.Constant) and type(value.value) in KINDS:
        said = value.value if isinstance(value.value, str) else None
        example = "{\"action\": %r}" % said if said in ("pass",) + ACTIONS else "{\"action\": \"pass\"}"
        problems.append({"line": line, "message": "returns %s, not a dict: the gateway needs a dict with an \"action\", e.g. return %s" % (KINDS[type(value.value)], example)})
    elif isinstance(value, (ast.List, ast.Tuple, ast.Set, ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.JoinedStr)):
        problems.append({"line": line, "message": "returns a %s, not a dict: the gateway needs a dict with an \"action\", e.g. return {\"action\": \"pass\"}" % {ast.List: "list", ast.ListComp: "list", ast.Tuple: "tuple", ast.Set: "set", ast.SetComp: "set", ast.GeneratorExp: "generator", ast.JoinedStr: "string"}[type(value)]})
    elif isinstance(value, ast.Dict):
        for k, v in zip(value.keys, value.values):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                continue
            if k.value not in KEYS:
                meant = difflib.get_close_matches(k.value, KEYS, n=1, cutoff=0.5)
                hint = "; did you mean %r?" % meant[0] if meant else ""
                problems.append({"line": k.lineno, "message": "returns the key %r, which the gateway does not read (it reads %s)%s" % (k.value, ", ".join(KEYS), hint)})
            elif k.value == "action" and isinstance(v, ast.Constant) and isinstance(v.value, str):
                if v.value not in ("pass",) + ACTIONS:
                    meant = difflib.get_close_matches(v.value.lower(), ("pass",) + ACTIONS, n=1, cutoff=0.6)
                    hint = ("; did you mean %r?%s" % (meant[0], " (actions are lower case)" if meant[0] == v.value.lower() else "")) if meant else ""
                    problems.append({"line": v.lineno, "message": "returns action %r, which is not one of pass, %s%s" % (v.value, ", ".join(ACTIONS), hint)})
                elif v.value not in ("pass", hook["action"]):
                    problems.append({"line": v.lineno, "message": "returns action %r but the hook declares %r (a hook may return only its declared action or pass)" % (v.value, hook["action"])})

for hook in data["hooks"]:
    problems = []
    reads = []
    hints = []
    try:
        tree = ast.parse(hook["code"], filename="<hook>")
        # What the parser lets through and the compiler does not ('return' outside function,
        # 'break' outside loop, nonlocal at module level...).
        compile(tree, "<hook>", "exec")
    except SyntaxError as e:
        out.append({"problems": [{"line": e.lineno or 1, "message": "SyntaxError: %s" % e.msg}], "reads": [], "hints": []})
        continue
    except ValueError as e:
        out.append({"problems": [{"line": 1, "message": "the code cannot be compiled: %s" % e}], "reads": [], "hints": []})
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
        returns = [r for r in own(f) if isinstance(r, ast.Return)]
        if not any(r.value is not None for r in returns):
            hints.append({"line": f.lineno, "message": "execute never returns a value, so it returns None, which is a hook error; end it with a return, e.g. return {\"action\": \"pass\"}"})
        else:
            if completes(f.body):
                last = f.body[-1]
                problems.append({"line": getattr(last, "end_lineno", None) or last.lineno, "message": "execute can end here without returning, which gives None, a hook error (under failurePolicy Closed the message is blocked); end every path with a return, e.g. return {\"action\": \"pass\"}"})
            for r in returns:
                if r.value is None:
                    problems.append({"line": r.lineno, "message": "a bare return gives None, which is a hook error; return a dict, e.g. return {\"action\": \"pass\"}"})
        # What execute returns: literals in its return statements, and dicts assigned to a name it
        # returns (result = {...}; return result). Only the top level of a result is read: a dict
        # nested in findings may have any keys.
        returned = {r.value.id for r in returns if isinstance(r.value, ast.Name)}
        for r in returns:
            if r.value is not None:
                result_problems(r.value, hook, problems)
        for a in own(f):
            if isinstance(a, ast.Assign) and isinstance(a.value, ast.Dict) and any(isinstance(t, ast.Name) and t.id in returned for t in a.targets):
                result_problems(a.value, hook, problems)
        params = f.args.posonlyargs + f.args.args
        settings = params[1].arg if len(params) >= 2 else None
        for node in ast.walk(tree) if settings else ():
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == settings and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                reads.append({"line": node.lineno, "key": node.slice.value, "subscript": True})
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) and node.func.value.id == settings and node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                reads.append({"line": node.lineno, "key": node.args[0].value, "subscript": False})
    listed = hook.get("capabilities") or []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names:
                problems.append({"line": node.lineno, "message": "imports %r, which is not in Python's standard library (hooks can use only the standard library modules docs/hooks.md lists)" % top})
            elif name not in SANDBOX and not any(part.startswith("_") for part in name.split(".")):
                problems.append({"line": node.lineno, "message": "imports %r, which is not available in the sandbox (hooks have no files, network, processes or threads; docs/hooks.md lists the modules they can use)" % name})
        # context.host_call("name", ...) with a name the hook does not list: refused at run time.
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "host_call" and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            name = node.args[0].value
            if name not in listed:
                meant = difflib.get_close_matches(name, listed, n=1, cutoff=0.6)
                hint = "; did you mean %r?" % meant[0] if meant else ""
                where = "they list %s" % ", ".join(listed) if listed else "it lists none"
                problems.append({"line": node.lineno, "message": "calls host_call(%r), which the hook's capabilities do not list (%s), so the gateway refuses the call as forbidden; add it under the hook's capabilities%s" % (name, where, hint)})
    out.append({"problems": problems, "reads": reads, "hints": hints})
print(json.dumps(out))
"#;

/// One problem in a hook's code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodeProblem {
    /// Line within the hook's code (1-based).
    pub line: usize,
    pub message: String,
}

/// A settings key the code reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettingsRead {
    /// Line within the hook's code (1-based).
    pub line: usize,
    pub key: String,
    /// `settings["key"]` (a `KeyError` when missing) rather than `settings.get("key")`.
    pub subscript: bool,
}

/// What the analyser found in one hook's code.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HookAnalysis {
    pub problems: Vec<CodeProblem>,
    pub settings_reads: Vec<SettingsRead>,
    /// Likely mistakes that are not certain failures (an `execute` with no `return` may mean to
    /// always raise): `sluice check` reports them, the gateway and operator do not refuse on them.
    pub hints: Vec<CodeProblem>,
}

/// Why the code could not be checked at all (not a problem in the code).
#[derive(Debug, thiserror::Error)]
pub enum CodeCheckError {
    #[error("cannot run {0} to check hook code: {1}")]
    Spawn(String, std::io::Error),
    #[error("talking to the code checker failed: {0}")]
    Io(std::io::Error),
    #[error("the code checker failed: {0}")]
    Failed(String),
    #[error("the code checker answered something unreadable: {0}")]
    Answer(#[from] serde_json::Error),
}

/// What runs the analyser: a Python on the host, or the cell, the CPython hooks run on, through the
/// supervisor (`sluice-supervisor python`), so that code is judged by the interpreter that runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Interpreter {
    Python(std::path::PathBuf),
    Cell {
        supervisor: std::path::PathBuf,
        runtime: std::path::PathBuf,
    },
}

impl Interpreter {
    fn command(&self) -> std::process::Command {
        match self {
            Self::Python(python) => std::process::Command::new(python),
            Self::Cell {
                supervisor,
                runtime,
            } => {
                let mut c = std::process::Command::new(supervisor);
                c.arg("python").arg("--runtime").arg(runtime);
                c
            }
        }
    }

    /// The cell beside this executable (`sluice-supervisor` and `sluice-cell.cwasm`, as the images
    /// and the tarball place them), or named by `SLUICE_SUPERVISOR` and `SLUICE_CELL_RUNTIME`; else
    /// `python`. What the operator and the gateway judge hook code with unless told otherwise.
    pub fn cell_or(python: &str) -> Self {
        let env = |name| std::env::var_os(name).map(std::path::PathBuf::from);
        let beside = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(std::path::Path::to_path_buf));
        let supervisor = env("SLUICE_SUPERVISOR")
            .or_else(|| beside.as_ref().map(|d| d.join("sluice-supervisor")));
        let runtime = env("SLUICE_CELL_RUNTIME")
            .or_else(|| beside.as_ref().map(|d| d.join("sluice-cell.cwasm")));
        match (supervisor, runtime) {
            (Some(supervisor), Some(runtime)) if supervisor.is_file() && runtime.is_file() => {
                Self::Cell {
                    supervisor,
                    runtime,
                }
            }
            _ => Self::Python(python.into()),
        }
    }
}

impl std::fmt::Display for Interpreter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Python(python) => write!(f, "{}", python.display()),
            Self::Cell { runtime, .. } => write!(f, "the cell runtime {}", runtime.display()),
        }
    }
}

impl From<std::path::PathBuf> for Interpreter {
    fn from(python: std::path::PathBuf) -> Self {
        Self::Python(python)
    }
}

impl From<&str> for Interpreter {
    fn from(python: &str) -> Self {
        Self::Python(python.into())
    }
}

/// Per hook, in order, the problems found in its code, as the `python3` first on `PATH` parses it.
pub fn analyse(hooks: &[HookSpec]) -> Result<Vec<Vec<CodeProblem>>, CodeCheckError> {
    analyse_with(&Interpreter::from("python3"), hooks)
}

/// Per hook, in order, the problems found in its code, as `python` parses it: give the interpreter
/// the sandboxes run, so that syntax it would refuse is refused here too.
pub fn analyse_with(
    python: &Interpreter,
    hooks: &[HookSpec],
) -> Result<Vec<Vec<CodeProblem>>, CodeCheckError> {
    let texts: Vec<HookText<'_>> = hooks
        .iter()
        .map(|h| HookText {
            action: h.action.as_str(),
            code: &h.code,
            capabilities: h.capabilities.iter().map(String::as_str).collect(),
        })
        .collect();
    Ok(analyse_code(python, &texts)?
        .into_iter()
        .map(|a| a.problems)
        .collect())
}

/// One hook as the analyser reads it: as text, so that a document whose schema is wrong still has
/// its code checked.
#[derive(Clone, Debug, Default)]
pub struct HookText<'a> {
    /// The declared action.
    pub action: &'a str,
    pub code: &'a str,
    /// The capabilities it lists (the only names its `host_call`s may use).
    pub capabilities: Vec<&'a str>,
}

/// Per hook, in order, everything the analyser finds, as `python` parses it.
pub fn analyse_code(
    python: &Interpreter,
    hooks: &[HookText<'_>],
) -> Result<Vec<HookAnalysis>, CodeCheckError> {
    use std::io::Write;
    let hooks: Vec<serde_json::Value> = hooks
        .iter()
        .map(|h| serde_json::json!({"action": h.action, "code": h.code, "capabilities": h.capabilities}))
        .collect();
    let input = serde_json::json!({"sandbox": SANDBOX_MODULES, "hooks": hooks});
    let mut child = python
        .command()
        .args(["-I", "-S", "-c", ANALYSER])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| CodeCheckError::Spawn(python.to_string(), e))?;
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
    let parsed: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)?;
    let list = |v: &serde_json::Value| v.as_array().cloned().unwrap_or_default();
    let problem = |p: &serde_json::Value| CodeProblem {
        line: p["line"].as_u64().unwrap_or(1) as usize,
        message: p["message"].as_str().unwrap_or_default().to_string(),
    };
    Ok(parsed
        .iter()
        .map(|hook| HookAnalysis {
            problems: list(&hook["problems"]).iter().map(problem).collect(),
            hints: list(&hook["hints"]).iter().map(problem).collect(),
            settings_reads: list(&hook["reads"])
                .iter()
                .map(|r| SettingsRead {
                    line: r["line"].as_u64().unwrap_or(1) as usize,
                    key: r["key"].as_str().unwrap_or_default().to_string(),
                    subscript: r["subscript"].as_bool().unwrap_or(false),
                })
                .collect(),
        })
        .collect())
}

/// What kind of finding a [`HookFinding`] is: whether it stops a hook from serving.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FindingKind {
    /// The hook fails at load or call time (syntax, `execute`, imports, undeclared actions).
    Problem,
    /// A likely mistake that is not a certain failure (an `execute` that never returns).
    Hint,
    /// A settings key the code reads that the hook does not declare: `subscript` reads
    /// (`settings["k"]`) raise `KeyError`; `settings.get("k")` reads always get their default.
    UndeclaredSetting { subscript: bool },
}

/// One finding in one hook's code, worded as `sluice check` prints it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookFinding {
    /// The hook's `name`.
    pub hook: String,
    /// Line within the hook's code (1-based).
    pub line: usize,
    pub kind: FindingKind,
    /// `HookChain "c", hook "h", line 3 of its code: ...`.
    pub message: String,
}

/// Everything the analyser finds in the hooks of one HookChain document, read as a JSON value (a
/// YAML document or an object sent to the admission webhook) so that code is checked even where the
/// document's schema is wrong. Documents that are not sluice.dev HookChains have no findings.
/// `sluice check` and the operator's admission webhook both word their findings with this.
#[cfg(feature = "kube")]
pub fn document_findings(
    python: &Interpreter,
    doc: &serde_json::Value,
) -> Result<Vec<HookFinding>, CodeCheckError> {
    if doc["kind"] != "HookChain"
        || !doc["apiVersion"]
            .as_str()
            .is_some_and(|v| v.starts_with("sluice.dev/"))
    {
        return Ok(Vec::new());
    }
    let chain = doc["metadata"]["name"].as_str().unwrap_or_default();
    let hooks: Vec<&serde_json::Value> = doc["spec"]["hooks"]
        .as_array()
        .map(|h| h.iter().filter(|h| h["code"].is_string()).collect())
        .unwrap_or_default();
    if hooks.is_empty() {
        return Ok(Vec::new());
    }
    let texts: Vec<HookText<'_>> = hooks
        .iter()
        .map(|h| HookText {
            action: h["action"].as_str().unwrap_or_default(),
            code: h["code"].as_str().unwrap_or_default(),
            capabilities: h["capabilities"]
                .as_array()
                .map(|c| c.iter().filter_map(|c| c.as_str()).collect())
                .unwrap_or_default(),
        })
        .collect();
    let mut out = Vec::new();
    for (hook, found) in hooks.iter().zip(analyse_code(python, &texts)?) {
        let name = hook["name"].as_str().unwrap_or_default();
        let finding = |line: usize, kind: FindingKind, message: String| HookFinding {
            hook: name.to_string(),
            line,
            kind,
            message: format!(
                "HookChain {chain:?}, hook {name:?}, line {line} of its code: {message}"
            ),
        };
        for p in found.problems {
            out.push(finding(p.line, FindingKind::Problem, p.message));
        }
        for p in found.hints {
            out.push(finding(p.line, FindingKind::Hint, p.message));
        }
        let declared: Vec<&str> = hook["settings"]
            .as_object()
            .map(|m| m.keys().map(String::as_str).collect())
            .unwrap_or_default();
        for read in found.settings_reads {
            if declared.contains(&read.key.as_str()) {
                continue;
            }
            let how = if read.subscript {
                format!(
                    "settings[{:?}], which raises KeyError at run time",
                    read.key
                )
            } else {
                format!(
                    "settings.get({:?}), which always gets its default",
                    read.key
                )
            };
            let meant = crate::fields::did_you_mean(&read.key, declared.iter().copied())
                .map(|k| format!("; did you mean {k:?}?"))
                .unwrap_or_default();
            let list = if declared.is_empty() {
                "the hook declares no settings".to_string()
            } else {
                format!("its settings declare {}", declared.join(", "))
            };
            out.push(finding(
                read.line,
                FindingKind::UndeclaredSetting {
                    subscript: read.subscript,
                },
                format!("reads {how}: {list}{meant}"),
            ));
        }
    }
    Ok(out)
}
