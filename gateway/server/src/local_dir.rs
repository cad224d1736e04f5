//! Local mode's source of chains: every HookChain and Capability YAML under a directory, re-read when
//! anything in it changes. A bad file is reported with file and line and the rest keep serving.

use sluice_crds::code::Interpreter;
use sluice_crds::definition::{Definition, NotServed, Origin, Spec};
use sluice_crds::signing::{Policy, PolicyFile};
use sluice_crds::{code, manifest};
use sluice_engine::Registry;
use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Read as _;
use std::os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

/// The largest chain file read. The API server takes objects up to about 1.5 MiB, and a file may
/// hold several; anything larger is a mistake or an attack, and is refused before it is parsed.
pub(crate) const MAX_FILE_BYTES: u64 = 4 << 20;

/// How long one file's checks (YAML, schema, hook code analysis by python) may take before the file
/// is reported and not served. The same text is not checked again.
pub(crate) const CHECK_BOUND: Duration = Duration::from_secs(10);

/// How long a reload on a change waits for the changed files' checks before it swaps in what it has.
/// A file still being checked keeps serving its previous version, and lands on a later reload, so a
/// slow file never holds back the others.
pub(crate) const RELOAD_WAIT: Duration = Duration::from_millis(500);

/// What the walk found at one YAML path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Found {
    /// A regular file, to be read at `open` (the symlink's target, when `path` is a symlink).
    File { path: PathBuf, open: PathBuf },
    /// Not read, for the reason given.
    Refused { path: PathBuf, reason: String },
}

impl Found {
    fn path(&self) -> &Path {
        match self {
            Found::File { path, .. } | Found::Refused { path, .. } => path,
        }
    }
}

fn is_yaml(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml")
    )
}

fn kind_of(t: std::fs::FileType) -> &'static str {
    if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// Every YAML path under `dir`, sorted (so conflicts resolve the same way every time). Hidden
/// entries are skipped; real subdirectories are walked. Only regular files are read: a FIFO, socket
/// or device is refused (reading one would block or never end), and so is a symlink that leads out
/// of the directory. A symlink inside it is followed, as a ConfigMap volume's `name -> ..data/name`.
pub(crate) fn walk(dir: &Path) -> std::io::Result<Vec<Found>> {
    let root = dir.canonicalize()?;
    let mut out = Vec::new();
    walk_into(&root, dir, &mut out)?;
    out.sort_by(|a, b| a.path().cmp(b.path()));
    Ok(out)
}

fn walk_into(root: &Path, dir: &Path, out: &mut Vec<Found>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let kind = entry.file_type()?;
        if kind.is_dir() {
            walk_into(root, &path, out)?;
            continue;
        }
        if !is_yaml(&path) {
            continue;
        }
        let refused = |reason: String| Found::Refused {
            path: path.clone(),
            reason,
        };
        out.push(if kind.is_symlink() {
            match path.canonicalize() {
                Err(e) => refused(format!("a symlink that cannot be followed ({e}): not read")),
                Ok(target) if !target.starts_with(root) => refused(format!(
                    "a symlink to {}, outside the chain directory: not read",
                    target.display()
                )),
                Ok(target) => match std::fs::metadata(&target) {
                    Ok(m) if m.is_file() => Found::File {
                        path: path.clone(),
                        open: target,
                    },
                    Ok(m) => refused(format!(
                        "a symlink to {}, {}: not read",
                        target.display(),
                        kind_of(m.file_type())
                    )),
                    Err(e) => refused(format!("cannot read: {e}")),
                },
            }
        } else if kind.is_file() {
            Found::File {
                path: path.clone(),
                open: path.clone(),
            }
        } else {
            refused(Unread::NotRegular(kind_of(kind)).to_string())
        });
    }
    Ok(())
}

/// Why a chain file was not read.
#[derive(Debug, thiserror::Error)]
enum Unread {
    #[error("cannot read: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}, not a regular file: not read")]
    NotRegular(&'static str),
    #[error("{0} bytes, more than the {max} MiB a chain file may have: not read", max = MAX_FILE_BYTES >> 20)]
    TooLarge(u64),
    #[error("not UTF-8 text")]
    NotUtf8,
}

/// The text of the regular file at `open`, at most `MAX_FILE_BYTES`. Opened without blocking and
/// without following a symlink, and checked again once open: a file swapped for a FIFO after the
/// walk is refused, not waited on.
fn read_text(open: &Path) -> Result<String, Unread> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(open)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(Unread::NotRegular(kind_of(meta.file_type())));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(Unread::TooLarge(meta.len()));
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(Unread::TooLarge(bytes.len() as u64));
    }
    String::from_utf8(bytes).map_err(|_| Unread::NotUtf8)
}

/// Reads every YAML file under `dir` (sorted, so conflicts resolve the same way every time), with
/// the default platform namespace and the cell's CPython to check hook code.
pub fn load(dir: &Path) -> std::io::Result<Registry> {
    load_for(dir, sluice_crds::DEFAULT_PLATFORM_NAMESPACE)
}

/// Reads every YAML file under `dir` once; enforced chains in `platform_namespace` become baselines.
pub fn load_for(dir: &Path, platform_namespace: &str) -> std::io::Result<Registry> {
    LocalSource::new(dir, platform_namespace, code_checker(None)).reload(CHECK_BOUND)
}

/// What judges hook code in local mode: `python` when given, else the CPython the sandboxes run,
/// through `program` (or the supervisor found beside this binary); the host's `/usr/bin/python3`
/// only where no supervisor is found.
pub fn code_checker(program: Option<&sluice_engine::SupervisorProgram>) -> Interpreter {
    let program = match program {
        Some(p) => Ok(p.clone()),
        None => sluice_engine::SupervisorProgram::locate(),
    };
    match program {
        Ok(p) => Interpreter::Cell {
            supervisor: p.binary,
            runtime: p.runtime,
        },
        Err(e) => {
            tracing::warn!(error = %e, "hook code is checked with /usr/bin/python3, not the sandboxes' CPython");
            Interpreter::Python(PathBuf::from("/usr/bin/python3"))
        }
    }
}

/// What one read of one file gave: the definitions that passed every check, and every problem.
#[derive(Clone)]
struct FileRead {
    definitions: Vec<Definition>,
    problems: Vec<NotServed>,
}

/// One file as the source last saw it.
struct FileState {
    /// The text last checked, so an unchanged file is not parsed and analysed again.
    text: String,
    read: FileRead,
    /// The definitions of the last version of this file with no problem at all, and when it was read.
    last_valid: Option<(Vec<Definition>, SystemTime)>,
}

/// A file's checks running on their own thread.
struct Pending {
    text: String,
    started: Instant,
    done: mpsc::Receiver<FileRead>,
}

impl Pending {
    fn start(file: &Path, text: String, python: &Interpreter) -> Self {
        let (tx, done) = mpsc::channel();
        let (file, body, python) = (file.to_path_buf(), text.clone(), python.clone());
        let spawned = std::thread::Builder::new()
            .name("sluice-chain-check".into())
            .spawn(move || {
                // The receiver is gone when the file changed or timed out meanwhile: nothing to do.
                let _ = tx.send(check_file(&file, &body, &python));
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a thread to check a chain file");
        }
        Self {
            text,
            started: Instant::now(),
            done,
        }
    }
}

/// The chain directory across reloads. A file that fails any check (YAML, schema, unknown fields,
/// semantic rules, hook code analysis) keeps serving its last valid version, so a bad save never
/// takes a chain away or breaks it; its problems are reported, and runs on the older version say so
/// in their audit. A file with no valid version yet serves the documents of it that pass. Each
/// changed file is checked on a thread of its own, bounded by `CHECK_BOUND`.
pub struct LocalSource {
    dir: PathBuf,
    platform_namespace: String,
    python: Interpreter,
    check_bound: Duration,
    files: BTreeMap<PathBuf, FileState>,
    pending: BTreeMap<PathBuf, Pending>,
    /// Where signed hook code is required and whose signatures count (`--trusted-signers`).
    signing: Option<Arc<PolicyFile>>,
}

impl LocalSource {
    /// `python` checks hook code: the cell's CPython (through the supervisor) in local mode.
    pub fn new(dir: &Path, platform_namespace: &str, python: impl Into<Interpreter>) -> Self {
        Self {
            dir: dir.to_path_buf(),
            platform_namespace: platform_namespace.to_string(),
            python: python.into(),
            check_bound: CHECK_BOUND,
            files: BTreeMap::new(),
            pending: BTreeMap::new(),
            signing: None,
        }
    }

    /// Serves only hook code signed by a key `signing` trusts, where it requires signed code.
    pub fn with_signing(mut self, signing: Arc<PolicyFile>) -> Self {
        self.signing = Some(signing);
        self
    }

    /// The trusted signers this source verifies with, if any.
    pub fn signing(&self) -> Option<Arc<PolicyFile>> {
        self.signing.clone()
    }

    fn policy(&self) -> Arc<Policy> {
        self.signing
            .as_ref()
            .map_or_else(|| Arc::new(Policy::default()), |s| s.current())
    }

    /// How long one file's checks may take (`CHECK_BOUND` unless set).
    pub fn with_check_bound(mut self, bound: Duration) -> Self {
        self.check_bound = bound;
        self
    }

    /// Whether some file's checks are still running: reload again soon to pick up their result.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Reads the directory again and builds the registry. Only changed files are checked again, each
    /// on its own thread; the reload waits at most `wait` for them. A file whose checks are still
    /// running serves what it served before (and is picked up by a later reload); one whose checks
    /// outlast the check bound is reported and not served.
    pub fn reload(&mut self, wait: Duration) -> std::io::Result<Registry> {
        let found = walk(&self.dir)?;
        self.files
            .retain(|p, _| found.iter().any(|f| f.path() == p));
        self.pending
            .retain(|p, _| found.iter().any(|f| f.path() == p));
        // Read every file and start the checks of the changed ones.
        let mut refused: BTreeMap<PathBuf, String> = BTreeMap::new();
        for f in &found {
            let (path, text) = match f {
                Found::Refused { path, reason } => {
                    refused.insert(path.clone(), reason.clone());
                    continue;
                }
                Found::File { path, open } => match read_text(open) {
                    Ok(text) => (path, text),
                    Err(reason) => {
                        refused.insert(path.clone(), reason.to_string());
                        continue;
                    }
                },
            };
            let checked = self.files.get(path).is_some_and(|s| s.text == text);
            let checking = self.pending.get(path).is_some_and(|p| p.text == text);
            if !checked && !checking {
                self.pending
                    .insert(path.clone(), Pending::start(path, text, &self.python));
            }
        }
        self.collect(Instant::now() + wait);
        let policy = self.policy();
        let mut definitions = Vec::new();
        let mut errors = Vec::new();
        for f in &found {
            let file = f.path();
            if let Some(reason) = refused.get(file) {
                let problem = NotServed {
                    origin: Origin {
                        file: file.to_path_buf(),
                        line: 1,
                    },
                    message: reason.clone(),
                };
                match self.files.get(file).and_then(|s| s.last_valid.as_ref()) {
                    Some((defs, since)) => {
                        definitions.extend(superseded(
                            defs,
                            file,
                            *since,
                            std::slice::from_ref(&problem),
                        ));
                        errors.push(keeps_serving(problem));
                    }
                    None => errors.push(problem),
                }
                continue;
            }
            let Some(state) = self.files.get(file) else {
                // First seen and still being checked: served once its checks finish.
                continue;
            };
            // Signatures are checked against the signers trusted now, not when the file was read.
            let (signed, unsigned) = by_signatures(&policy, &state.read.definitions);
            let mut problems = state.read.problems.clone();
            problems.extend(unsigned);
            match (&state.last_valid, problems.is_empty()) {
                (_, true) | (None, false) => {
                    definitions.extend(signed);
                    errors.extend(problems);
                }
                (Some((defs, since)), false) => {
                    definitions.extend(superseded(defs, file, *since, &problems));
                    errors.extend(problems.into_iter().map(keeps_serving));
                }
            }
        }
        Ok(Registry::build_for(
            &self.platform_namespace,
            definitions,
            errors,
            &policy,
        ))
    }

    /// Takes the results of finished checks (waiting until `deadline` for the rest), and turns a
    /// check that outlasted the bound into a problem of its file.
    fn collect(&mut self, deadline: Instant) {
        let paths: Vec<PathBuf> = self.pending.keys().cloned().collect();
        for path in paths {
            let Some(p) = self.pending.get(&path) else {
                continue;
            };
            let until = deadline.min(p.started + self.check_bound);
            let read = match p
                .done
                .recv_timeout(until.saturating_duration_since(Instant::now()))
            {
                Ok(read) => read,
                Err(mpsc::RecvTimeoutError::Timeout) if p.started.elapsed() < self.check_bound => {
                    continue;
                }
                Err(_) => FileRead {
                    definitions: Vec::new(),
                    problems: vec![NotServed {
                        origin: Origin {
                            file: path.clone(),
                            line: 1,
                        },
                        message: format!(
                            "checking this file took longer than {} s: not served",
                            self.check_bound.as_secs_f64()
                        ),
                    }],
                },
            };
            let Some(p) = self.pending.remove(&path) else {
                continue;
            };
            let old = self.files.remove(&path);
            let last_valid = if read.problems.is_empty()
                && by_signatures(&self.policy(), &read.definitions)
                    .1
                    .is_empty()
            {
                Some((read.definitions.clone(), SystemTime::now()))
            } else {
                old.and_then(|o| o.last_valid)
            };
            self.files.insert(
                path,
                FileState {
                    text: p.text,
                    read,
                    last_valid,
                },
            );
        }
    }
}

/// A file's definitions that `policy` lets serve, and why each other one is refused.
fn by_signatures(policy: &Policy, defs: &[Definition]) -> (Vec<Definition>, Vec<NotServed>) {
    let mut signed = Vec::new();
    let mut refused = Vec::new();
    for d in defs {
        if let Spec::HookChain(spec) = &d.spec
            && let Err(why) = policy.check(&d.namespace, &d.name, spec)
        {
            refused.push(NotServed {
                origin: d.origin.clone(),
                message: format!("HookChain {:?}: {why}", d.name),
            });
            continue;
        }
        signed.push(d.clone());
    }
    (signed, refused)
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
fn check_file(file: &Path, text: &str, python: &Interpreter) -> FileRead {
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
                    file = %sluice_crds::log_text::Escaped(&file.display().to_string()),
                    error = %sluice_crds::log_text::Escaped(&e.to_string()),
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

/// A cheap fingerprint of the directory: each YAML path, what it leads to, its size and time.
pub(crate) fn fingerprint(dir: &Path) -> Vec<(Found, u64, Option<SystemTime>)> {
    walk(dir)
        .unwrap_or_default()
        .into_iter()
        .map(|f| {
            let meta = match &f {
                Found::File { open, .. } => std::fs::metadata(open).ok(),
                Found::Refused { .. } => None,
            };
            let len = meta.as_ref().map(|m| m.len()).unwrap_or_default();
            let modified = meta.and_then(|m| m.modified().ok());
            (f, len, modified)
        })
        .collect()
}
