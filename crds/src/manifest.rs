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

/// One document of a YAML stream, as the YAML parser delimits it.
struct Document {
    /// Byte range in the stream, from the start of the line the document begins on.
    range: std::ops::Range<usize>,
    /// 1-based line of the stream the range starts on.
    first_line: usize,
    /// 1-based line of the document's root node (past comments and `---`), when it has one.
    root_line: Option<usize>,
}

impl Document {
    /// The document's text preceded by as many empty lines as come before it in the stream, so
    /// that serde-saphyr's error lines and messages are lines of the file.
    fn text(&self, stream: &str) -> String {
        let mut text = "\n".repeat(self.first_line - 1);
        text.push_str(&stream[self.range.clone()]);
        text
    }

    fn line(&self) -> usize {
        self.root_line.unwrap_or(self.first_line)
    }
}

/// Splits a YAML stream into its documents with the YAML parser itself (granit-parser, the parser
/// under serde-saphyr). A document with a syntax error still gets its range: the parser resumes at
/// the next document boundary (`---` or `...` at column 0, where the YAML spec forbids content),
/// so one broken document does not hide the ones after it.
fn documents(stream: &str) -> Vec<Document> {
    use serde_saphyr::granit_parser::{Event, Marker, Parser};
    let offset = |m: &Marker| m.byte_offset().unwrap_or(stream.len()).min(stream.len());
    let line_start = |at: usize| stream[..at].rfind('\n').map_or(0, |i| i + 1);
    let document = |start: usize, end: usize, root_line: Option<usize>| {
        let start = line_start(start);
        Document {
            range: start..end.max(start),
            first_line: stream[..start].matches('\n').count() + 1,
            root_line,
        }
    };
    let mut docs = Vec::new();
    let mut parser = Parser::new_from_str(stream);
    // Where the current document started, and where its root node is.
    let mut current: Option<(usize, Option<usize>)> = None;
    // Where a broken document started: it ends where the parser resumes.
    let mut broken: Option<usize> = None;
    let mut previous_end = 0;
    while let Some(event) = parser.next() {
        match event {
            Ok((Event::DocumentStart(..), span)) => {
                let at = offset(&span.start);
                if let Some(start) = broken.take() {
                    docs.push(document(start, at, None));
                }
                current = Some((at, None));
            }
            Ok((Event::DocumentEnd, span)) => {
                let end = offset(&span.end);
                let (start, root) = current.take().unwrap_or((previous_end, None));
                docs.push(document(start, end, root));
                previous_end = end;
            }
            Ok((event, span)) => {
                let is_node = matches!(
                    event,
                    Event::Scalar(..)
                        | Event::SequenceStart(..)
                        | Event::MappingStart(..)
                        | Event::Alias(..)
                );
                if let Some((_, root @ None)) = &mut current
                    && is_node
                {
                    *root = Some(span.start.line());
                }
            }
            Err(_) => {
                // serde-saphyr reports the error when it reads the document's text.
                let start = current.take().map_or(previous_end, |(at, _)| at);
                broken = Some(start);
                if !matches!(parser.proceed_next_document(), Ok(true)) {
                    break;
                }
            }
        }
    }
    if let Some(start) = broken {
        docs.push(document(start, stream.len(), None));
    }
    docs
}

/// Reads every HookChain and Capability in one YAML text. Each document stands alone: a bad one is an
/// error in the list and the rest still load.
pub fn parse(file: &Path, text: &str) -> Vec<Result<Located<Object>, LoadError>> {
    let options = || serde_saphyr::options! { with_snippet: false };
    let mut out = Vec::new();
    for document in documents(text) {
        let start = document.line();
        let doc = document.text(text);
        let err = |line: usize, message: String| LoadError {
            file: file.to_path_buf(),
            line,
            message,
        };
        let line_of = |e: &serde_saphyr::Error| {
            e.location()
                .and_then(|l| usize::try_from(l.line()).ok())
                .filter(|l| *l > 0)
                .unwrap_or(start)
        };
        let head: serde_json::Value = match serde_saphyr::from_str_with_options(&doc, options()) {
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
            "HookChain" => serde_saphyr::from_str_with_options::<HookChain>(&doc, options())
                .map(|c| Object::HookChain(Box::new(c))),
            "Capability" => serde_saphyr::from_str_with_options::<Capability>(&doc, options())
                .map(|c| Object::Capability(Box::new(c))),
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
        out.push(Ok(Located {
            file: file.to_path_buf(),
            line: start,
            value: object,
        }));
    }
    out
}

/// An object as YAML, the way Sluice writes manifests (`make crds`, `sluice-operator render`): a
/// long one-line string stays on one line (serde-saphyr would fold it at 80 columns), a
/// multi-line one is a literal block.
pub fn to_yaml<T: serde::Serialize>(value: &T) -> Result<String, serde_saphyr::SerializeError> {
    serde_saphyr::to_string_with_options(
        value,
        serde_saphyr::ser_options! { folded_wrap_chars: usize::MAX },
    )
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
    fn a_syntax_error_does_not_hide_the_documents_after_it() {
        let text = "apiVersion: sluice.dev/v1alpha1\nkind: Capability\nmetadata: {name: a}\nspec: {endpoint: {builtin: echo}}\n---\napiVersion: sluice.dev/v1alpha1\nkind: Capability\nmetadata: {name: [\n---\n# comment\napiVersion: sluice.dev/v1alpha1\nkind: Capability\nmetadata: {name: c}\nspec: {endpoint: {builtin: echo}}\n";
        let got = parse(Path::new("x.yaml"), text);
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(matches!(&got[0], Ok(Located { line: 1, .. })), "{got:?}");
        let err = got[1].as_ref().unwrap_err();
        assert!(err.message.starts_with("invalid YAML"), "{err}");
        assert!((8..=9).contains(&err.line), "{err}");
        assert!(matches!(&got[2], Ok(Located { line: 11, .. })), "{got:?}");
    }

    #[test]
    fn document_markers_are_yaml_ones_not_lines_of_dashes() {
        // `--- {...}` and `...` are markers; a `---` inside a block scalar is text.
        let text = r#"--- {apiVersion: sluice.dev/v1alpha1, kind: Capability, metadata: {name: a}, spec: {endpoint: {builtin: echo}}}
...
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: c}
spec:
  target: bot
  triggerPoint: input
  hooks:
  - name: h
    action: block
    code: |
      x = """
      ---
      """
---
---
"#;
        let got = parse(Path::new("x.yaml"), text);
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(
            matches!(
                &got[0],
                Ok(Located {
                    line: 1,
                    value: Object::Capability(_),
                    ..
                })
            ),
            "{got:?}"
        );
        let Ok(Located {
            line: 4,
            value: Object::HookChain(c),
            ..
        }) = &got[1]
        else {
            panic!("{got:?}")
        };
        assert!(c.spec.hooks[0].code.contains("---"), "{c:?}");
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
