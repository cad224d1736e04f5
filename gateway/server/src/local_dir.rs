//! Local mode's source of chains: every HookChain and Capability YAML under a directory, re-read when
//! anything in it changes. A bad file is reported with file and line and the rest keep serving.

use sluice_crds::definition::{Definition, NotServed, Origin};
use sluice_crds::manifest;
use sluice_engine::Registry;
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
/// the default platform namespace.
pub fn load(dir: &Path) -> std::io::Result<Registry> {
    load_for(dir, sluice_crds::DEFAULT_PLATFORM_NAMESPACE)
}

/// Reads every YAML file under `dir`; enforced chains in `platform_namespace` become baselines.
pub fn load_for(dir: &Path, platform_namespace: &str) -> std::io::Result<Registry> {
    let mut files = Vec::new();
    yaml_files(dir, &mut files)?;
    files.sort();
    let mut objects = Vec::new();
    let mut errors = Vec::new();
    for file in files {
        let text = match std::fs::read(&file) {
            Ok(bytes) => match String::from_utf8(bytes) {
                Ok(t) => t,
                Err(_) => {
                    errors.push(NotServed {
                        origin: Origin { file, line: 1 },
                        message: "not UTF-8 text".into(),
                    });
                    continue;
                }
            },
            Err(e) => {
                errors.push(NotServed {
                    origin: Origin { file, line: 1 },
                    message: format!("cannot read: {e}"),
                });
                continue;
            }
        };
        for item in manifest::parse(&file, &text) {
            match item {
                Ok(o) => objects.push(Definition::from(o)),
                Err(e) => errors.push(NotServed::from(e)),
            }
        }
    }
    Ok(Registry::build_for(platform_namespace, objects, errors))
}

/// A cheap fingerprint of the directory: paths, sizes and modification times.
pub fn fingerprint(dir: &Path) -> Vec<(PathBuf, u64, SystemTime)> {
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
pub const POLL: Duration = Duration::from_millis(250);
