//! `sluice check`: everything that can be known about HookChain and Capability files without a
//! cluster and without running any hook. Hook code is only parsed (Python's `ast`), never executed
//! on the host.

use sluice_crds::manifest::{self, Located, Object};
use std::path::{Path, PathBuf};

/// One finding, with the file line it concerns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub file: PathBuf,
    pub line: usize,
    pub message: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}", self.file.display(), self.line, self.message)
    }
}

#[derive(Debug, Default)]
pub struct Report {
    pub findings: Vec<Finding>,
    pub chains: usize,
    pub capabilities: usize,
}

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

/// Per hook, the problems found in its code: (line within the code, message).
pub fn analyse_code(hooks: &[(String, String)]) -> Result<Vec<Vec<(usize, String)>>, String> {
    use std::io::Write;
    let input: Vec<serde_json::Value> = hooks
        .iter()
        .map(|(action, code)| serde_json::json!({"action": action, "code": code}))
        .collect();
    let mut child = std::process::Command::new("python3")
        .args(["-I", "-S", "-c", ANALYSER])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run python3 to check hook code: {e}"))?;
    let body = serde_json::to_vec(&input).map_err(|e| e.to_string())?;
    child
        .stdin
        .take()
        .ok_or("no stdin")?
        .write_all(&body)
        .map_err(|e| e.to_string())?;
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "the code checker failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let parsed: Vec<Vec<serde_json::Value>> =
        serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    Ok(parsed
        .into_iter()
        .map(|ps| {
            ps.into_iter()
                .map(|p| {
                    (
                        p["line"].as_u64().unwrap_or(1) as usize,
                        p["message"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect()
        })
        .collect())
}

/// The file line holding line `code_line` of hook `hook`'s code, found by the code's first line.
fn file_line(text: &str, doc_line: usize, hook: &str, code: &str, code_line: usize) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    let start = doc_line.saturating_sub(1);
    let name_at = (start..lines.len()).find(|&i| {
        let l = lines[i].trim_start().trim_start_matches("- ");
        l == format!("name: {hook}")
            || l == format!("name: \"{hook}\"")
            || l == format!("name: '{hook}'")
    });
    let first = code
        .lines()
        .find(|l| !l.trim().is_empty())
        .map(str::trim)
        .unwrap_or_default();
    let lead = code.lines().take_while(|l| l.trim().is_empty()).count();
    if let Some(n) = name_at {
        if let Some(i) = (n..lines.len()).find(|&i| !first.is_empty() && lines[i].trim() == first) {
            return i + 1 + code_line.saturating_sub(1 + lead);
        }
        return n + 1;
    }
    doc_line
}

/// Checks the given files together: each is parsed and validated, hook code is analysed, and the
/// capabilities hooks list must be defined in one of the files.
pub fn check(files: &[PathBuf]) -> Report {
    let mut report = Report::default();
    let mut objects: Vec<(Located<Object>, String)> = Vec::new();
    for file in files {
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) => {
                report.findings.push(Finding {
                    file: file.clone(),
                    line: 1,
                    message: format!("cannot read: {e}"),
                });
                continue;
            }
        };
        let docs = manifest::parse(file, &text);
        if docs.is_empty() {
            report.findings.push(Finding {
                file: file.clone(),
                line: 1,
                message: "no HookChain or Capability (apiVersion sluice.dev/v1alpha1) in this file"
                    .into(),
            });
        }
        for d in docs {
            match d {
                Ok(o) => objects.push((o, text.clone())),
                Err(e) => report.findings.push(Finding {
                    file: e.file,
                    line: e.line,
                    message: e.message,
                }),
            }
        }
    }
    let capabilities: Vec<(String, String)> = objects
        .iter()
        .filter_map(|(o, _)| match &o.value {
            Object::Capability(c) => Some((
                manifest::namespace_of(&c.metadata),
                c.metadata.name.clone().unwrap_or_default(),
            )),
            _ => None,
        })
        .collect();
    for (o, text) in &objects {
        match &o.value {
            Object::Capability(c) => {
                report.capabilities += 1;
                if let Some(schema) = &c.spec.schema
                    && let Err(e) = crate::endpoint::check_schema(schema)
                {
                    report.findings.push(Finding {
                        file: o.file.clone(),
                        line: o.line,
                        message: format!(
                            "Capability {:?}: spec.schema: {e}",
                            c.metadata.name.clone().unwrap_or_default()
                        ),
                    });
                }
                let ns = manifest::namespace_of(&c.metadata);
                for step in c.spec.gates.iter().chain(&c.spec.dispatch) {
                    if !capabilities.contains(&(ns.clone(), step.clone())) {
                        report.findings.push(Finding {
                            file: o.file.clone(),
                            line: o.line,
                            message: format!("Capability {:?}: gate or dispatch step {step:?} is not defined in the files checked", c.metadata.name.clone().unwrap_or_default()),
                        });
                    }
                }
            }
            Object::HookChain(hc) => {
                report.chains += 1;
                let chain = hc.metadata.name.clone().unwrap_or_default();
                let ns = manifest::namespace_of(&hc.metadata);
                if hc.spec.enforced && ns != sluice_crds::DEFAULT_PLATFORM_NAMESPACE {
                    report.findings.push(Finding {
                        file: o.file.clone(),
                        line: o.line,
                        message: format!(
                            "HookChain {chain:?}: spec.enforced is honoured only in the platform namespace ({:?} unless the gateway runs with --platform-namespace), not in {ns:?}; the gateway will not serve it",
                            sluice_crds::DEFAULT_PLATFORM_NAMESPACE
                        ),
                    });
                }
                let hooks: Vec<(String, String)> = hc
                    .spec
                    .hooks
                    .iter()
                    .map(|h| (h.action.as_str().to_string(), h.code.clone()))
                    .collect();
                match analyse_code(&hooks) {
                    Ok(per_hook) => {
                        for (hook, problems) in hc.spec.hooks.iter().zip(per_hook) {
                            for (line, message) in problems {
                                report.findings.push(Finding {
                                    file: o.file.clone(),
                                    line: file_line(text, o.line, &hook.name, &hook.code, line),
                                    message: format!("HookChain {chain:?}, hook {:?}, line {line} of its code: {message}", hook.name),
                                });
                            }
                        }
                    }
                    Err(e) => report.findings.push(Finding {
                        file: o.file.clone(),
                        line: o.line,
                        message: e,
                    }),
                }
                for hook in &hc.spec.hooks {
                    for cap in &hook.capabilities {
                        if !capabilities.contains(&(ns.clone(), cap.clone())) {
                            report.findings.push(Finding {
                                file: o.file.clone(),
                                line: file_line(text, o.line, &hook.name, &hook.code, 1),
                                message: format!("HookChain {chain:?}, hook {:?}: capability {cap:?} is not defined in the files checked (namespace {ns})", hook.name),
                            });
                        }
                    }
                }
            }
        }
    }
    report
        .findings
        .sort_by(|a, b| (&a.file, a.line).cmp(&(&b.file, b.line)));
    report
}

/// Files given on the command line, with directories expanded to the YAML files inside: test files
/// (`*.test.yaml`) when `tests` is set, every other YAML file otherwise.
pub fn expand(paths: &[PathBuf], tests: bool) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut files: Vec<PathBuf> = walk(p)
                .into_iter()
                .filter(|f| f.to_string_lossy().ends_with(".test.yaml") == tests)
                .collect();
            files.sort();
            out.extend(files);
        } else {
            out.push(p.clone());
        }
    }
    out
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else if matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")) {
            out.push(p);
        }
    }
    out
}
