//! Reading HookChain and Capability objects from YAML files, multi-document ones included, with the
//! file and line of every problem. Objects of other kinds are passed over, as `kubectl apply` of a
//! mixed directory would apply them elsewhere.

use crate::{Capability, HookChain, validate};
use std::fmt;
use std::path::{Path, PathBuf};

pub const API_VERSION: &str = "sluice.dev/v1alpha1";

/// A resource read from a file, with where it came from.
#[derive(Clone, Debug)]
pub enum Object {
    HookChain(Box<HookChain>),
    Capability(Box<Capability>),
}

#[derive(Clone, Debug)]
pub struct Located<T> {
    pub file: PathBuf,
    /// 1-based line of the document's first line.
    pub line: usize,
    pub value: T,
}

/// A document that could not be used: a YAML syntax error, a schema error or a semantic problem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadError {
    pub file: PathBuf,
    pub line: usize,
    pub message: String,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.file.display(), self.line, self.message)
    }
}

impl std::error::Error for LoadError {}

/// Splits a YAML stream into documents, returning each with the 1-based line it starts on.
fn documents(text: &str) -> Vec<(usize, String)> {
    let mut docs = Vec::new();
    let mut current = String::new();
    let mut start = 1;
    for (i, line) in text.lines().enumerate() {
        let is_separator = line == "---" || line.starts_with("--- ") || line.starts_with("---\t");
        if is_separator {
            if !current.trim().is_empty() {
                docs.push((start, std::mem::take(&mut current)));
            }
            current.clear();
            start = i + 2;
        } else {
            current.push_str(line);
            current.push('\n');
        }
    }
    if !current.trim().is_empty() {
        docs.push((start, current));
    }
    docs
}

/// Reads every HookChain and Capability in one YAML text. Each document stands alone: a bad one is an
/// error in the list and the rest still load.
pub fn parse(file: &Path, text: &str) -> Vec<Result<Located<Object>, LoadError>> {
    let mut out = Vec::new();
    for (start, doc) in documents(text) {
        let err = |line: usize, message: String| LoadError {
            file: file.to_path_buf(),
            line,
            message,
        };
        let line_of = |e: &serde_yaml::Error| {
            start
                + e.location()
                    .map(|l| l.line().saturating_sub(1))
                    .unwrap_or(0)
        };
        let head: serde_yaml::Value = match serde_yaml::from_str(&doc) {
            Ok(v) => v,
            Err(e) => {
                out.push(Err(err(line_of(&e), format!("invalid YAML: {e}"))));
                continue;
            }
        };
        let api_version = head
            .get("apiVersion")
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        let kind = head
            .get("kind")
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        if !api_version.starts_with("sluice.dev/") {
            continue;
        }
        if api_version != API_VERSION {
            out.push(Err(err(
                start,
                format!("apiVersion {api_version:?} is not served; use {API_VERSION}"),
            )));
            continue;
        }
        let object = match kind {
            "HookChain" => {
                serde_yaml::from_str::<HookChain>(&doc).map(|c| Object::HookChain(Box::new(c)))
            }
            "Capability" => {
                serde_yaml::from_str::<Capability>(&doc).map(|c| Object::Capability(Box::new(c)))
            }
            other => {
                out.push(Err(err(
                    start,
                    format!("kind {other:?} is not a sluice.dev kind (HookChain, Capability)"),
                )));
                continue;
            }
        };
        let object = match object {
            Ok(o) => o,
            Err(e) => {
                out.push(Err(err(line_of(&e), format!("{kind}: {e}"))));
                continue;
            }
        };
        let (name, problems) = match &object {
            Object::HookChain(c) => (c.metadata.name.clone(), validate::hookchain(&c.spec)),
            Object::Capability(c) => {
                let name = c.metadata.name.clone().unwrap_or_default();
                (Some(name.clone()), validate::capability(&name, &c.spec))
            }
        };
        let Some(name) = name.filter(|n| !n.is_empty()) else {
            out.push(Err(err(start, format!("{kind} has no metadata.name"))));
            continue;
        };
        if !problems.is_empty() {
            let list: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
            out.push(Err(err(
                start,
                format!("{kind} {name:?}: {}", list.join("; ")),
            )));
            continue;
        }
        let leading = doc
            .lines()
            .take_while(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
            .count();
        out.push(Ok(Located {
            file: file.to_path_buf(),
            line: start + leading,
            value: object,
        }));
    }
    out
}

/// Namespace of an object read from a file: its own, or `default` as kubectl would use.
pub fn namespace_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    meta.namespace
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "default".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = r#"# leading comment
apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {name: echo}
spec:
  endpoint: {builtin: echo}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: other}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: c}
spec:
  target: bot
  triggerPoint: sideways
  hooks: []
"#;

    #[test]
    fn multi_document_files_load_each_document_and_skip_other_kinds() {
        let got = parse(Path::new("x.yaml"), TWO);
        assert_eq!(got.len(), 2);
        assert!(matches!(
            &got[0],
            Ok(Located {
                line: 2,
                value: Object::Capability(_),
                ..
            })
        ));
        let err = got[1].as_ref().unwrap_err();
        // The bad value sits on line 17 of the file.
        assert_eq!(err.line, 17, "{err}");
        assert!(err.message.contains("sideways"), "{err}");
    }

    #[test]
    fn syntax_errors_carry_the_file_line() {
        let got = parse(
            Path::new("bad.yaml"),
            "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: [\n",
        );
        let err = got[0].as_ref().unwrap_err();
        assert!(err.message.starts_with("invalid YAML"), "{err}");
        assert!(err.line >= 3, "{err}");
    }

    #[test]
    fn semantic_problems_name_the_object_and_field() {
        let text = "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: c}\nspec:\n  target: ''\n  triggerPoint: input\n  hooks: [{name: a, action: block, code: 'x'}]\n";
        let err = parse(Path::new("c.yaml"), text).remove(0).unwrap_err();
        assert!(
            err.message.contains("\"c\"") && err.message.contains("spec.target"),
            "{err}"
        );
    }
}
