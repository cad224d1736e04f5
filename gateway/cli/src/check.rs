//! `sluice check`: everything that can be known about HookChain and Capability files without a
//! cluster and without running any hook. Hook code is only parsed (Python's `ast`, through
//! `sluice_crds::code`), never executed on the host.

use sluice_crds::code::CodeProblem;
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
                    && let Err(e) = sluice_crds::schema::check_schema(schema)
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
                match sluice_crds::code::analyse(&hc.spec.hooks) {
                    Ok(per_hook) => {
                        for (hook, problems) in hc.spec.hooks.iter().zip(per_hook) {
                            for CodeProblem { line, message } in problems {
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
                        message: e.to_string(),
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
