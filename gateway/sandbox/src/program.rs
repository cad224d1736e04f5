//! The program every sandbox runs: the `sluice-supervisor` binary and the cell runtime it loads
//! (`sluice-cell.cwasm`, the pre-initialised CPython component compiled by
//! `supervisor/build-cell.sh`), with the runtime's SHA-256, which the supervisor checks before it
//! loads the file.

use std::path::{Path, PathBuf};

pub const SUPERVISOR_BINARY: &str = "sluice-supervisor";
pub const CELL_RUNTIME: &str = "sluice-cell.cwasm";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SupervisorProgram {
    pub binary: PathBuf,
    pub runtime: PathBuf,
    pub runtime_sha256: String,
    /// Authoring tools' mode (`sluice test`, `sluice run`): a hook that runs out of time stops at
    /// the line it is on and its error names it. Tracing lines is slow: never for serving.
    pub trace_lines: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    #[error(
        "no {what} found (looked for {looked}); build it with `make cell` (or `supervisor/build-cell.sh debug|release`), or name it with {flag}"
    )]
    Missing {
        what: &'static str,
        looked: String,
        flag: &'static str,
    },
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} does not hold a SHA-256 (64 hex digits)")]
    Digest { path: String },
}

impl SupervisorProgram {
    /// The supervisor and runtime at the given paths (the runtime's digest from `<runtime>.sha256`).
    pub fn at(binary: PathBuf, runtime: PathBuf) -> Result<Self, ProgramError> {
        for (path, what, flag) in [
            (&binary, "supervisor binary", "--supervisor"),
            (&runtime, "cell runtime", "--cell-runtime"),
        ] {
            if !path.is_file() {
                return Err(ProgramError::Missing {
                    what,
                    looked: path.display().to_string(),
                    flag,
                });
            }
        }
        let digest_file = sha256_file(&runtime);
        let text = std::fs::read_to_string(&digest_file).map_err(|source| ProgramError::Read {
            path: digest_file.display().to_string(),
            source,
        })?;
        let runtime_sha256 = text.trim().to_string();
        if runtime_sha256.len() != 64 || !runtime_sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ProgramError::Digest {
                path: digest_file.display().to_string(),
            });
        }
        Ok(Self {
            binary,
            runtime,
            runtime_sha256,
            trace_lines: false,
        })
    }

    /// This program in authoring tools' mode (see `trace_lines`).
    pub fn with_trace_lines(mut self) -> Self {
        self.trace_lines = true;
        self
    }

    /// `SLUICE_SUPERVISOR` and `SLUICE_CELL_RUNTIME` when set; otherwise both beside this
    /// executable, or one directory up (test binaries live in `target/<profile>/deps`).
    pub fn locate() -> Result<Self, ProgramError> {
        let env = |name| std::env::var_os(name).map(PathBuf::from);
        Self::locate_in(
            env("SLUICE_SUPERVISOR"),
            env("SLUICE_CELL_RUNTIME"),
            &candidate_dirs(),
        )
    }

    /// `binary` and `runtime` when given, else the first of `dirs` holding each. A file found
    /// nowhere is named with every path tried, so that a test run on a fresh clone says what
    /// `make cell` would have made.
    fn locate_in(
        binary: Option<PathBuf>,
        runtime: Option<PathBuf>,
        dirs: &[PathBuf],
    ) -> Result<Self, ProgramError> {
        let find = |file: &str, what: &'static str, flag: &'static str| {
            let tried: Vec<PathBuf> = dirs.iter().map(|d| d.join(file)).collect();
            match tried.iter().find(|p| p.is_file()) {
                Some(found) => Ok(found.clone()),
                None => Err(ProgramError::Missing {
                    what,
                    looked: tried
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    flag,
                }),
            }
        };
        let binary = match binary {
            Some(p) => p,
            None => find(
                SUPERVISOR_BINARY,
                "supervisor binary",
                "--supervisor or SLUICE_SUPERVISOR",
            )?,
        };
        let runtime = match runtime {
            Some(p) => p,
            None => find(
                CELL_RUNTIME,
                "cell runtime",
                "--cell-runtime or SLUICE_CELL_RUNTIME",
            )?,
        };
        Self::at(binary, runtime)
    }

    /// The supervisor's command line as a sandbox runs it, with the binary and the runtime at the
    /// given paths inside the sandbox. Settings are flags, never the environment.
    pub fn args(&self, binary: &str, runtime: &str, memory_bytes: u64) -> Vec<String> {
        let mut args = vec![
            binary.to_string(),
            "--runtime".into(),
            runtime.into(),
            "--runtime-sha256".into(),
            self.runtime_sha256.clone(),
            "--memory-bytes".into(),
            memory_bytes.to_string(),
        ];
        if self.trace_lines {
            args.push("--trace-lines".into());
        }
        args
    }
}

fn sha256_file(runtime: &Path) -> PathBuf {
    let mut name = runtime.as_os_str().to_owned();
    name.push(".sha256");
    PathBuf::from(name)
}

fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        if let Some(parent) = dir.parent() {
            dirs.push(dir.clone());
            dirs.push(parent.to_path_buf());
        } else {
            dirs.push(dir);
        }
    }
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runtime_without_its_digest_is_refused_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let binary = dir.path().join(SUPERVISOR_BINARY);
        let runtime = dir.path().join(CELL_RUNTIME);
        std::fs::write(&binary, b"").unwrap();
        std::fs::write(&runtime, b"").unwrap();
        let err = SupervisorProgram::at(binary.clone(), runtime.clone())
            .unwrap_err()
            .to_string();
        assert!(err.contains("sluice-cell.cwasm.sha256"), "{err}");
        std::fs::write(dir.path().join("sluice-cell.cwasm.sha256"), "not hex\n").unwrap();
        let err = SupervisorProgram::at(binary.clone(), runtime.clone())
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not hold a SHA-256"), "{err}");
        let digest = "ab".repeat(32);
        std::fs::write(
            dir.path().join("sluice-cell.cwasm.sha256"),
            format!("{digest}\n"),
        )
        .unwrap();
        let program = SupervisorProgram::at(binary, runtime).unwrap();
        assert_eq!(program.runtime_sha256, digest);
        assert_eq!(program.args("/s", "/r", 5)[4], digest);
    }

    #[test]
    fn a_missing_binary_says_how_to_build_it() {
        let dir = tempfile::tempdir().unwrap();
        let err = SupervisorProgram::at(dir.path().join("nope"), dir.path().join("nope.cwasm"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("make cell"), "{err}");
    }

    #[test]
    fn a_program_found_nowhere_names_each_file_tried_and_make_cell() {
        let dir = tempfile::tempdir().unwrap();
        let dirs = [dir.path().join("deps"), dir.path().to_path_buf()];
        let err = SupervisorProgram::locate_in(None, None, &dirs)
            .unwrap_err()
            .to_string();
        for d in &dirs {
            let tried = d.join(SUPERVISOR_BINARY);
            assert!(err.contains(&tried.display().to_string()), "{err}");
        }
        assert!(err.contains("make cell"), "{err}");

        // The supervisor there, its cell runtime not: the runtime is named.
        std::fs::write(dir.path().join(SUPERVISOR_BINARY), b"").unwrap();
        let err = SupervisorProgram::locate_in(None, None, &dirs)
            .unwrap_err()
            .to_string();
        let tried = dir.path().join(CELL_RUNTIME);
        assert!(err.contains("no cell runtime found"), "{err}");
        assert!(err.contains(&tried.display().to_string()), "{err}");
        assert!(err.contains("make cell"), "{err}");
    }
}
