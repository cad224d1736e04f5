//! Reading HookChain and Capability objects from YAML files, multi-document ones included, with the
//! file and line of every problem. Objects of other kinds are passed over, as `kubectl apply` of a
//! mixed directory would apply them elsewhere.

use crate::{Capability, HookChain, fields, validate};
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
fn parsed_documents(stream: &str) -> Vec<Document> {
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

/// Splits a YAML stream into documents, with the YAML parser (a broken document still gets its
/// text): each with the 1-based line of its root node and its text, preceded by as many empty lines
/// as come before it in the stream (so that a line within the text is a line of the file).
pub fn documents(text: &str) -> Vec<(usize, String)> {
    parsed_documents(text)
        .into_iter()
        .map(|d| (d.line(), d.text(text)))
        .collect()
}

/// The `openAPIV3Schema` of a kind's CRD, as the API server would check objects against it.
fn open_api(kind: &str) -> Option<&'static serde_json::Value> {
    use std::sync::OnceLock;
    static HC: OnceLock<serde_json::Value> = OnceLock::new();
    static CAP: OnceLock<serde_json::Value> = OnceLock::new();
    let of = |crd: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition| {
        crd.spec
            .versions
            .first()
            .and_then(|v| v.schema.as_ref())
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .and_then(|s| serde_json::to_value(s).ok())
            .unwrap_or_default()
    };
    match kind {
        "HookChain" => Some(HC.get_or_init(|| of(crate::crd::hookchain()))),
        "Capability" => Some(CAP.get_or_init(|| of(crate::crd::capability()))),
        _ => None,
    }
}

/// Reads every HookChain and Capability in one YAML text. Each document stands alone: a bad one is an
/// error in the list (one per problem, every problem of it at once) and the rest still load.
pub fn parse(file: &Path, text: &str) -> Vec<Result<Located<Object>, LoadError>> {
    let options = || serde_saphyr::options! { with_snippet: false };
    let mut out = Vec::new();
    for (start, doc) in documents(text) {
        let err = |line: usize, message: String| LoadError {
            file: file.to_path_buf(),
            line,
            message,
        };
        // The text is padded to its place in the file: error lines are lines of the file.
        let line_of = |e: &serde_saphyr::Error| {
            e.location()
                .map(|l| l.line() as usize)
                .filter(|l| *l > 0)
                .unwrap_or(start)
        };
        let head: serde_json::Value = match serde_saphyr::from_str_with_options(&doc, options()) {
            Ok(v) => v,
            Err(e) => {
                let at = line_of(&e);
                // yaml_hint counts lines of the text from 0; the text is padded to its place in the file.
                let message = match yaml_hint(&doc, at.saturating_sub(1), &e.to_string()) {
                    Some((line, hint)) => {
                        out.push(Err(err(line + 1, format!("{hint} (YAML said: {e})"))));
                        continue;
                    }
                    None => format!("invalid YAML: {e}"),
                };
                out.push(Err(err(at, message)));
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
        let Some(schema) = open_api(kind) else {
            out.push(Err(err(
                start,
                format!("kind {kind:?} is not a sluice.dev kind (HookChain, Capability)"),
            )));
            continue;
        };
        let shown_name = head
            .get("metadata")
            .and_then(|m| m.get("name"))
            .and_then(|n| n.as_str())
            .map(|n| format!("{kind} {n:?}"))
            .unwrap_or_else(|| kind.to_string());
        let at_path = |path: &[fields::Seg]| match fields::line_of(&doc, path) {
            0 => start,
            line => line + 1,
        };
        // Every field problem of the document at once; the typed read below would stop at the first.
        let problems = fields::check(schema, &head);
        if !problems.is_empty() {
            let mut problems: Vec<(usize, fields::FieldProblem)> = problems
                .into_iter()
                .map(|p| (at_path(&p.path), p))
                .collect();
            problems.sort_by_key(|(line, _)| *line);
            for (line, p) in problems {
                let place = fields::display(&p.path);
                let message = if place.is_empty() {
                    format!("{shown_name}: {}", p.message)
                } else {
                    format!("{shown_name}: {place}: {}", p.message)
                };
                out.push(Err(err(line, message)));
            }
            continue;
        }
        let object = match kind {
            "HookChain" => serde_saphyr::from_str_with_options::<HookChain>(&doc, options())
                .map(|c| Object::HookChain(Box::new(c))),
            _ => serde_saphyr::from_str_with_options::<Capability>(&doc, options())
                .map(|c| Object::Capability(Box::new(c))),
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
            for p in problems {
                let line = at_path(&fields::parse_dotted(&p.field));
                out.push(Err(err(line, format!("{kind} {name:?}: {p}"))));
            }
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

fn indent_of(line: &str) -> usize {
    line.len() - line.trim_start_matches([' ', '\t']).len()
}

/// A plain-language reading of a YAML syntax error, for the mistakes people make most: a tab in
/// the indentation, an unquoted `: ` inside a value, code that slips out of its `code: |` block.
/// `at` is the 0-based line of the document the parser stopped on; the answer is the 0-based line
/// the mistake is on and what to do.
pub fn yaml_hint(doc: &str, at: usize, error: &str) -> Option<(usize, String)> {
    let lines: Vec<&str> = doc.lines().collect();
    let upto = (at + 1).min(lines.len());
    // A tab: the parser may name the line before the one that has it (it notices at the next token).
    let upto_tab = (at + 2).min(lines.len());
    if let Some(i) = (0..upto_tab).find(|&i| lines[i][..indent_of(lines[i])].contains('\t')) {
        return Some((
            i,
            format!(
                "line {} is indented with a tab; YAML indents with spaces only: replace the tab with spaces",
                i + 1
            ),
        ));
    }
    // Code dedented out of its block: a line indented less than the code above it, then code again.
    let block = (0..upto).rev().find(|&i| {
        let t = lines[i].trim_start();
        let t = t.strip_prefix("- ").unwrap_or(t);
        t.starts_with("code: |") || t.starts_with("code: >")
    });
    if let Some(m) = block {
        let key_indent = indent_of(lines[m]);
        let content = lines[m + 1..]
            .iter()
            .find(|l| !l.trim().is_empty())
            .map(|l| indent_of(l));
        if let Some(c) = content.filter(|c| *c > key_indent) {
            let end = (at + 2).min(lines.len());
            let dedented =
                (m + 1..end).find(|&i| !lines[i].trim().is_empty() && indent_of(lines[i]) < c);
            // What a YAML key of the hook looks like (`settings:`, `- name: x`): a line that is
            // not one, where the parser stopped, is code that fell out too (often the last line).
            let yaml_key = |line: &str| {
                let t = line.trim_start();
                let t = t.strip_prefix("- ").unwrap_or(t);
                t.split_once(':').is_some_and(|(k, rest)| {
                    !k.is_empty()
                        && k.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '_')
                        && (rest.is_empty() || rest.starts_with(' '))
                })
            };
            if let Some(x) = dedented
                && ((x + 1..end).any(|j| !lines[j].trim().is_empty() && indent_of(lines[j]) >= c)
                    || (x + 1 >= at && x <= at + 1 && !yaml_key(lines[x])))
            {
                return Some((
                    x,
                    format!(
                        "line {} is indented less than the code above it, so it falls out of `code: |` (line {}): indent every line of the hook's code by at least {c} spaces",
                        x + 1,
                        m + 1
                    ),
                ));
            }
        }
    }
    if error.contains("mapping values are not allowed")
        || error.contains("did not find expected ',' or '}'")
    {
        // A plain value holding ": ", in block style or inside a flow mapping's `{key: value}`.
        fn unquoted_colon(value: &str) -> bool {
            let value = value.trim_start();
            if let Some(inner) = value.strip_prefix('{') {
                return inner
                    .split_once(": ")
                    .is_some_and(|(_, v)| unquoted_colon(v.trim_end_matches('}')));
            }
            value.contains(": ") && !value.starts_with(['"', '\'', '['])
        }
        let line = (0..upto).rev().find(|&i| {
            lines[i]
                .trim_start()
                .split_once(": ")
                .is_some_and(|(_, value)| unquoted_colon(value))
        })?;
        return Some((
            line,
            format!(
                "the value on line {} contains \": \", which YAML reads as another key: put the whole value in quotes, e.g. message: \"Sorry: ...\"",
                line + 1
            ),
        ));
    }
    None
}

/// Where hook `hook`'s code sits in a file: given the 1-based line its document starts on, the
/// 1-based line such that line n of the hook's code is file line `result + n` (the `code: |` line
/// for a block scalar). `None` when the hook or its code cannot be found in the text.
pub fn hook_code_line(text: &str, start: usize, hook: &str) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let is_name = |l: &str| {
        let t = l.trim_start();
        let t = t.strip_prefix("- ").unwrap_or(t).trim_start();
        t.strip_prefix("name:").is_some_and(|v| {
            let v = v.split(" #").next().unwrap_or(v).trim();
            v.trim_matches(['"', '\'']) == hook
        })
    };
    let from = start.saturating_sub(1);
    let name_at = (from..lines.len()).find(|&i| is_name(lines[i]))?;
    // The item's own keys: from its `- ` line (at or above the name) down to the next item.
    let item_indent = {
        let item_line = (from..=name_at)
            .rev()
            .find(|&i| lines[i].trim_start().starts_with("- "))?;
        lines[item_line].len() - lines[item_line].trim_start().len()
    };
    let mut i = name_at;
    while i < lines.len() {
        let l = lines[i];
        let t = l.trim_start();
        let ind = l.len() - t.len();
        if i > name_at
            && !t.is_empty()
            && (ind < item_indent || (ind == item_indent && t.starts_with("- ")))
        {
            return None;
        }
        let key = t.strip_prefix("- ").unwrap_or(t).trim_start();
        if let Some(v) = key.strip_prefix("code:") {
            let v = v.trim();
            // A block scalar's text starts on the next line; a one-line value is on this one.
            return Some(
                if v.starts_with('|') || v.starts_with('>') || v.is_empty() {
                    i + 1
                } else {
                    i
                },
            );
        }
        i += 1;
    }
    None
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

/// What the platform team decides that judging an object depends on: the namespace whose enforced
/// chains are baselines, and where capabilities may point.
#[derive(Clone, Debug)]
pub struct PlatformRules {
    pub platform_namespace: String,
    pub allowed_endpoints: crate::endpoints::AllowedEndpoints,
    /// The most CPU one sandbox may use; a chain may not ask to be guaranteed more.
    pub sandbox_cpu_limit: crate::cpu::SandboxCpuLimit,
    /// Where signed hook code is required and whose signatures count (`--trusted-signers`).
    pub signing: Option<std::sync::Arc<crate::signing::PolicyFile>>,
}

impl PlatformRules {
    /// The default platform namespace and `allowed_endpoints`.
    pub fn new(allowed_endpoints: crate::endpoints::AllowedEndpoints) -> Self {
        Self {
            platform_namespace: crate::DEFAULT_PLATFORM_NAMESPACE.to_string(),
            allowed_endpoints,
            sandbox_cpu_limit: crate::cpu::SandboxCpuLimit::default(),
            signing: None,
        }
    }
}

/// What is wrong with one object that its schema and the semantic rules cannot see alone, worded as
/// `sluice check` prints it: a Capability's JSON Schema that does not compile or endpoint outside the
/// allowed ones, and an enforced HookChain outside the platform namespace (the gateway would not
/// serve it). The admission webhook refuses on the same findings.
pub fn object_problems(object: &Object, rules: &PlatformRules) -> Vec<String> {
    let platform_namespace = rules.platform_namespace.as_str();
    let mut out = Vec::new();
    match object {
        Object::Capability(c) => {
            let name = c.metadata.name.clone().unwrap_or_default();
            if let Some(schema) = &c.spec.schema
                && let Err(e) = crate::schema::check_schema(schema)
            {
                out.push(format!("Capability {name:?}: spec.schema: {e}"));
            }
            if let Some(p) = rules.allowed_endpoints.problem(&c.spec) {
                out.push(format!("Capability {name:?}: {p}"));
            }
        }
        Object::HookChain(hc) => {
            let ns = namespace_of(&hc.metadata);
            if hc.spec.enforced && ns != platform_namespace {
                out.push(format!(
                    "HookChain {:?}: spec.enforced is honoured only in the platform namespace ({platform_namespace:?} unless the gateway runs with --platform-namespace), not in {ns:?}; the gateway will not serve it",
                    hc.metadata.name.clone().unwrap_or_default()
                ));
            }
            if let Some(p) = rules.sandbox_cpu_limit.refuses(&hc.spec.resources.cpu) {
                out.push(format!(
                    "HookChain {:?}: {p}",
                    hc.metadata.name.clone().unwrap_or_default()
                ));
            }
            if let Some(signing) = &rules.signing {
                let name = hc.metadata.name.clone().unwrap_or_default();
                if let Err(why) = signing.current().check(&ns, &name, &hc.spec) {
                    out.push(format!("HookChain {name:?}: {why}"));
                }
            }
        }
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
        assert_eq!(got.len(), 3, "{got:#?}");
        assert!(matches!(
            &got[0],
            Ok(Located {
                line: 2,
                value: Object::Capability(_),
                ..
            })
        ));
        let err = got[1].as_ref().unwrap_err();
        // The bad value sits on line 17 of the file; the empty hook list on 18 is said too.
        assert_eq!(err.line, 17, "{err}");
        assert!(err.message.contains("sideways"), "{err}");
        let err = got[2].as_ref().unwrap_err();
        assert_eq!(err.line, 18, "{err}");
        assert!(err.message.contains("spec.hooks"), "{err}");
    }

    #[test]
    fn unknown_fields_are_errors_with_the_field_meant_and_every_problem_is_said() {
        let text = "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: c}\nspec:\n  target: bot\n  triggerPoint: Input\n  failurepolicy: Closed\n  hooks:\n    - name: a\n      action: block\n      setting: {x: 1}\n      code: |\n        def execute(context, settings):\n            return {\"action\": \"pass\"}\n";
        let got: Vec<LoadError> = parse(Path::new("c.yaml"), text)
            .into_iter()
            .map(|r| r.unwrap_err())
            .collect();
        let said: Vec<String> = got.iter().map(|e| e.to_string()).collect();
        assert_eq!(got.len(), 3, "{said:#?}");
        assert!(
            said[0].starts_with("c.yaml:6: ") && said[0].contains("Input"),
            "{said:#?}"
        );
        assert!(
            said[1].starts_with("c.yaml:7: ") && said[1].contains("did you mean \"failurePolicy\""),
            "{said:#?}"
        );
        assert!(
            said[2].starts_with("c.yaml:11: ")
                && said[2].contains("spec.hooks[0].setting")
                && said[2].contains("did you mean \"settings\""),
            "{said:#?}"
        );
    }

    #[test]
    fn hook_code_lines_are_found_per_hook() {
        let text = "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: c}\nspec:\n  hooks:\n    - name: a\n      code: |\n        x = 1\n    - name: b\n      action: block\n      code: |\n        def execute(c, s):\n            pass\n";
        // Hook b's code line 1 is file line 12.
        assert_eq!(hook_code_line(text, 1, "b"), Some(11));
        assert_eq!(hook_code_line(text, 1, "a"), Some(7));
        assert_eq!(hook_code_line(text, 1, "zz"), None);
    }

    #[test]
    fn common_yaml_mistakes_are_said_in_plain_words() {
        let head = "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {name: c}\nspec:\n  target: bot\n  triggerPoint: input\n  hooks:\n    - name: a\n      action: block\n";
        let first = |text: &str| parse(Path::new("c.yaml"), text).remove(0).unwrap_err();
        let tab = first(&format!("{head}\tsettings: {{}}\n      code: x\n"));
        assert!(
            tab.message.contains("line 10 is indented with a tab") && tab.line == 10,
            "{tab}"
        );
        let colon = first(&format!(
            "{head}      settings: {{}}\n      message: Sorry: we cannot\n      code: x\n"
        ));
        assert!(
            colon.message.contains("put the whole value in quotes") && colon.line == 11,
            "{colon}"
        );
        let flow = first(&format!(
            "{head}      settings: {{message: Sorry: we cannot}}\n      code: x\n"
        ));
        assert!(
            flow.message.contains("put the whole value in quotes") && flow.line == 10,
            "{flow}"
        );
        let dedent = first(&format!(
            "{head}      code: |\n        def execute(context, settings):\n    x = 1\n            return {{\"action\": \"pass\"}}\n"
        ));
        assert!(
            dedent.message.contains("falls out of `code: |` (line 10)") && dedent.line == 12,
            "{dedent}"
        );
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
    fn a_chain_asking_more_cpu_than_the_platform_allows_is_a_problem() {
        let text = |cpu: &str| {
            format!(
                "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {{name: c}}\nspec:\n  target: bot\n  triggerPoint: input\n  resources: {{cpu: '{cpu}'}}\n  hooks: [{{name: a, action: block, code: 'x'}}]\n"
            )
        };
        let rules = PlatformRules::new(Default::default());
        let problems = |cpu: &str| {
            let object = parse(Path::new("c.yaml"), &text(cpu))
                .remove(0)
                .unwrap()
                .value;
            object_problems(&object, &rules)
        };
        assert_eq!(problems("1"), Vec::<String>::new());
        let over = problems("1500m");
        assert!(
            over.len() == 1 && over[0].contains("sandbox CPU limit (1)"),
            "{over:?}"
        );
        let unlimited = PlatformRules {
            sandbox_cpu_limit: crate::cpu::SandboxCpuLimit(None),
            ..rules.clone()
        };
        let object = parse(Path::new("c.yaml"), &text("8"))
            .remove(0)
            .unwrap()
            .value;
        assert!(object_problems(&object, &unlimited).is_empty());
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
