//! `sluice check`: everything that can be known about HookChain and Capability files without a
//! cluster and without running any hook. Hook code is only parsed (Python's `ast`, through
//! `sluice_crds::code`), never executed on the host.

use sluice_crds::code::Interpreter;
use sluice_crds::definition::Definition;
use sluice_crds::manifest::{self, Located, Object, PlatformRules};
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

/// Checks the given files together: each document is parsed and validated (every problem of it),
/// hook code is analysed by `python` (also in documents whose schema is wrong), the settings keys the
/// code reads must be declared, capabilities hooks list must be defined in one of the files, and
/// two chains must not serve the same target at the same trigger point.
pub fn check(files: &[PathBuf], python: &Interpreter, rules: &PlatformRules) -> Report {
    let mut report = Report::default();
    let mut objects: Vec<Located<Object>> = Vec::new();
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
                Ok(o) => objects.push(o),
                Err(e) => report.findings.push(Finding {
                    file: e.file,
                    line: e.line,
                    message: e.message,
                }),
            }
        }
        code_findings(file, &text, python, &mut report.findings);
    }
    let capabilities: Vec<(String, String)> = objects
        .iter()
        .filter_map(|o| match &o.value {
            Object::Capability(c) => Some((
                manifest::namespace_of(&c.metadata),
                c.metadata.name.clone().unwrap_or_default(),
            )),
            _ => None,
        })
        .collect();
    // Capabilities that others use as a gate or dispatch step: the gateway refuses them as a hook's
    // host_call (they reserve or settle on behalf of another call).
    let settling: Vec<(String, String, &'static str, String)> = objects
        .iter()
        .filter_map(|o| match &o.value {
            Object::Capability(c) => Some(c),
            _ => None,
        })
        .flat_map(|c| {
            let ns = manifest::namespace_of(&c.metadata);
            let of = c.metadata.name.clone().unwrap_or_default();
            let gates = c.spec.gates.iter().map(|g| (g.clone(), "gate"));
            let steps = c.spec.dispatch.iter().map(|d| (d.clone(), "dispatch step"));
            gates
                .chain(steps)
                .map(move |(name, role)| (ns.clone(), name, role, of.clone()))
                .collect::<Vec<_>>()
        })
        .collect();
    for o in &objects {
        // What the admission webhook refuses as well: the same rules, worded once.
        for message in manifest::object_problems(&o.value, rules) {
            report.findings.push(Finding {
                file: o.file.clone(),
                line: o.line,
                message,
            });
        }
        match &o.value {
            Object::Capability(c) => {
                report.capabilities += 1;
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
                let text = std::fs::read_to_string(&o.file).unwrap_or_default();
                for hook in &hc.spec.hooks {
                    for cap in &hook.capabilities {
                        if let Some((_, _, role, of)) = settling
                            .iter()
                            .find(|(n, name, ..)| *n == ns && name == cap)
                        {
                            report.findings.push(Finding {
                                file: o.file.clone(),
                                line: manifest::hook_code_line(&text, o.line, &hook.name)
                                    .unwrap_or(o.line),
                                message: format!("HookChain {chain:?}, hook {:?}: capability {cap:?} is a {role} of {of:?}: hooks cannot call it (the gateway does, settling what {of:?} reserves); list {of:?} instead", hook.name),
                            });
                        }
                        if !capabilities.contains(&(ns.clone(), cap.clone())) {
                            report.findings.push(Finding {
                                file: o.file.clone(),
                                line: manifest::hook_code_line(&text, o.line, &hook.name)
                                    .unwrap_or(o.line),
                                message: format!("HookChain {chain:?}, hook {:?}: capability {cap:?} is not defined in the files checked (namespace {ns})", hook.name),
                            });
                        }
                    }
                }
            }
        }
    }
    // Conflicts exactly as the gateway judges them: it is the gateway's registry that decides.
    let definitions: Vec<Definition> = objects
        .iter()
        .filter(|o| matches!(o.value, Object::HookChain(_)))
        .cloned()
        .map(Definition::from)
        .collect();
    // Signatures are reported per object above (`object_problems`); the conflicts alone here.
    let registry = sluice_engine::Registry::build_for(
        sluice_crds::DEFAULT_PLATFORM_NAMESPACE,
        definitions,
        vec![],
        &Default::default(),
    );
    for e in registry.errors() {
        if e.message.contains("only the first is served") {
            report.findings.push(Finding {
                file: e.origin.file.clone(),
                line: e.origin.line,
                message: format!("{} (the gateway reports this conflict)", e.message),
            });
        }
    }
    report
        .findings
        .sort_by(|a, b| (&a.file, a.line).cmp(&(&b.file, b.line)));
    report.findings.dedup();
    report
}

/// The hook code of every HookChain document in `text`, read from the raw YAML so that code is
/// checked even where the document's schema is wrong: the analyser's problems and settings keys the
/// code reads that the hook does not declare.
fn code_findings(file: &Path, text: &str, python: &Interpreter, out: &mut Vec<Finding>) {
    for (start, doc) in manifest::documents(text) {
        let Ok(value) = serde_saphyr::from_str::<serde_json::Value>(&doc) else {
            continue;
        };
        let found = match sluice_crds::code::document_findings(python, &value) {
            Ok(found) => found,
            Err(e) => {
                out.push(Finding {
                    file: file.to_path_buf(),
                    line: start,
                    message: format!("{e} (give the sandboxes' interpreter with --python)"),
                });
                continue;
            }
        };
        for f in found {
            let line = manifest::hook_code_line(text, start, &f.hook)
                .map(|b| b + f.line)
                .unwrap_or(start);
            out.push(Finding {
                file: file.to_path_buf(),
                line,
                message: f.message,
            });
        }
    }
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
