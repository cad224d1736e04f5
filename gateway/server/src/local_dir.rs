//! Local mode's source of chains: every HookChain and Capability YAML under a directory, re-read when
//! anything in it changes. A bad file is reported with file and line and the rest keep serving.

use sluice_crds::definition::{Definition, NotServed, Origin};
use sluice_crds::{code, manifest};
use sluice_engine::Registry;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name();
        if name.to_string_lossy().starts_with('.') {
            continue;
        }
        if entry.file_type()?.is_dir() {
            yaml_files(&path, out)?;
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            out.push(path);
        }
    }
    Ok(())
}

/// Reads every YAML file under `dir` (sorted, so conflicts resolve the same way every time), with
/// the default platform namespace and `/usr/bin/python3` to check hook code.
pub fn load(dir: &Path) -> std::io::Result<Registry> {
    load_for(dir, sluice_crds::DEFAULT_PLATFORM_NAMESPACE)
}

/// Reads every YAML file under `dir` once; enforced chains in `platform_namespace` become baselines.
pub fn load_for(dir: &Path, platform_namespace: &str) -> std::io::Result<Registry> {
    LocalSource::new(dir, platform_namespace, DEFAULT_PYTHON).reload()
}

/// The interpreter local sandboxes run, and so the one that judges hook code.
pub(crate) const DEFAULT_PYTHON: &str = "/usr/bin/python3";

/// What one read of one file gave: the definitions that passed every check, and every problem.
#[derive(Clone)]
struct FileRead {
    definitions: Vec<Definition>,
    problems: Vec<NotServed>,
}

/// One file as the source last saw it.
struct FileState {
    /// The text last read, so an unchanged file is not parsed and analysed again.
    text: String,
    read: FileRead,
    /// The definitions of the last version of this file with no problem at all, and when it was read.
    last_valid: Option<(Vec<Definition>, SystemTime)>,
}

/// The chain directory across reloads. A file that fails any check (YAML, schema, unknown fields,
/// semantic rules, hook code analysis) keeps serving its last valid version, so a bad save never
/// takes a chain away or breaks it; its problems are reported, and runs on the older version say so
/// in their audit. A file with no valid version yet serves the documents of it that pass.
pub(crate) struct LocalSource {
    dir: PathBuf,
    platform_namespace: String,
    python: PathBuf,
    files: BTreeMap<PathBuf, FileState>,
}

impl LocalSource {
    pub(crate) fn new(dir: &Path, platform_namespace: &str, python: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.to_path_buf(),
            platform_namespace: platform_namespace.to_string(),
            python: python.into(),
            files: BTreeMap::new(),
        }
    }

    /// Reads the directory again (only changed files are checked again) and builds the registry.
    pub(crate) fn reload(&mut self) -> std::io::Result<Registry> {
        let mut paths = Vec::new();
        yaml_files(&self.dir, &mut paths)?;
        paths.sort();
        self.files.retain(|p, _| paths.contains(p));
        let mut definitions = Vec::new();
        let mut errors = Vec::new();
        for file in paths {
            let text = match std::fs::read(&file) {
                Ok(bytes) => match String::from_utf8(bytes) {
                    Ok(t) => Ok(t),
                    Err(_) => Err("not UTF-8 text".to_string()),
                },
                Err(e) => Err(format!("cannot read: {e}")),
            };
            let text = match text {
                Ok(t) => t,
                Err(message) => {
                    let problem = NotServed {
                        origin: Origin {
                            file: file.clone(),
                            line: 1,
                        },
                        message,
                    };
                    match self.files.get(&file).and_then(|f| f.last_valid.as_ref()) {
                        Some((defs, since)) => {
                            definitions.extend(superseded(
                                defs,
                                &file,
                                *since,
                                std::slice::from_ref(&problem),
                            ));
                            errors.push(keeps_serving(problem));
                        }
                        None => errors.push(problem),
                    }
                    continue;
                }
            };
            let state = match self.files.remove(&file) {
                Some(state) if state.text == text => state,
                old => {
                    let read = check_file(&file, &text, &self.python);
                    let last_valid = if read.problems.is_empty() {
                        Some((read.definitions.clone(), SystemTime::now()))
                    } else {
                        old.and_then(|o| o.last_valid)
                    };
                    FileState {
                        text,
                        read,
                        last_valid,
                    }
                }
            };
            match (&state.last_valid, state.read.problems.is_empty()) {
                (_, true) | (None, false) => {
                    definitions.extend(state.read.definitions.iter().cloned());
                    errors.extend(state.read.problems.iter().cloned());
                }
                (Some((defs, since)), false) => {
                    definitions.extend(superseded(defs, &file, *since, &state.read.problems));
                    errors.extend(state.read.problems.iter().cloned().map(keeps_serving));
                }
            }
            self.files.insert(file, state);
        }
        Ok(Registry::build_for(
            &self.platform_namespace,
            definitions,
            errors,
        ))
    }
}

fn keeps_serving(mut p: NotServed) -> NotServed {
    p.message
        .push_str(" (the file's last valid version keeps serving until this is fixed)");
    p
}

/// The last valid definitions of `file`, marked with why its newest version is not served.
fn superseded(
    defs: &[Definition],
    file: &Path,
    since: SystemTime,
    problems: &[NotServed],
) -> Vec<Definition> {
    let read_at = since
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let first = problems.first().map(|p| p.to_string()).unwrap_or_default();
    let more = match problems.len() {
        0 | 1 => String::new(),
        n => format!(" (and {} more)", n - 1),
    };
    let note = format!(
        "serving the last valid version of {} (read at unix time {read_at}); the newest fails its checks: {first}{more}",
        file.display()
    );
    defs.iter()
        .cloned()
        .map(|mut d| {
            d.superseded = Some(note.clone());
            d
        })
        .collect()
}

/// Every check of one file's text: the loader's (YAML, schema, unknown fields, semantic rules) and
/// the hook code analysis by `python`, the interpreter the sandboxes run.
fn check_file(file: &Path, text: &str, python: &Path) -> FileRead {
    let mut definitions = Vec::new();
    let mut problems = Vec::new();
    for item in manifest::parse(file, text) {
        let o = match item {
            Ok(o) => o,
            Err(e) => {
                problems.push(NotServed::from(e));
                continue;
            }
        };
        if let manifest::Object::HookChain(hc) = &o.value {
            match code::analyse_with(python, &hc.spec.hooks) {
                Ok(per_hook) => {
                    let found: Vec<NotServed> = per_hook
                        .iter()
                        .zip(&hc.spec.hooks)
                        .flat_map(|(ps, hook)| {
                            let code_line = code_line_of(text, o.line, &hook.name);
                            ps.iter().map(move |p| NotServed {
                                origin: Origin {
                                    file: file.to_path_buf(),
                                    line: code_line.map(|l| l + p.line).unwrap_or(o.line),
                                },
                                message: format!(
                                    "HookChain {:?}: hook {:?}, line {} of its code: {}",
                                    hc.metadata.name.as_deref().unwrap_or_default(),
                                    hook.name,
                                    p.line,
                                    p.message
                                ),
                            })
                        })
                        .collect();
                    if !found.is_empty() {
                        problems.extend(found);
                        continue;
                    }
                }
                Err(e) => tracing::warn!(
                    file = %file.display(),
                    error = %e,
                    "hook code not analysed; serving it unchecked"
                ),
            }
        }
        let code_lines = match &o.value {
            manifest::Object::HookChain(hc) => hc
                .spec
                .hooks
                .iter()
                .map(|h| code_line_of(text, o.line, &h.name))
                .collect(),
            manifest::Object::Capability(_) => Vec::new(),
        };
        let mut d = Definition::from(o);
        d.code_lines = code_lines;
        definitions.push(d);
    }
    FileRead {
        definitions,
        problems,
    }
}

/// The 1-based line of the `code: |` key of hook `hook` in the document starting at line `start`:
/// the hook's code line n is file line `code_line + n`.
pub(crate) fn code_line_of(text: &str, start: usize, hook: &str) -> Option<usize> {
    sluice_crds::manifest::hook_code_line(text, start, hook)
}

/// A cheap fingerprint of the directory: paths, sizes and modification times.
pub(crate) fn fingerprint(dir: &Path) -> Vec<(PathBuf, u64, SystemTime)> {
    let mut files = Vec::new();
    let _ = yaml_files(dir, &mut files);
    files.sort();
    files
        .into_iter()
        .filter_map(|f| {
            let m = std::fs::metadata(&f).ok()?;
            Some((f, m.len(), m.modified().ok()?))
        })
        .collect()
}

/// How often the directory is checked for changes.
pub(crate) const POLL: Duration = Duration::from_millis(250);
