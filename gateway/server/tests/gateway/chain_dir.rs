//! Local mode's chain directory against odd and hostile files: only regular files are read (FIFOs,
//! sockets and devices are reported and skipped), symlinks leaving the directory are refused, sizes
//! and nesting are bounded before anything is parsed, and a file whose checks hang is reported
//! without holding back the other files. No sandbox is needed: this is the reading side.

use sluice_gateway::LocalSource;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

const PLATFORM: &str = sluice_crds::DEFAULT_PLATFORM_NAMESPACE;

fn chain(name: &str, target: &str, tag: &str) -> String {
    format!(
        r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {{name: {name}}}
spec:
  target: {target}
  triggerPoint: input
  hooks:
    - name: tag
      action: modify
      settings: {{tag: {tag}}}
      code: |
        def execute(context, settings):
            return {{"action": "modify", "outgoing": settings["tag"]}}
"#
    )
}

/// The registry's served chains as `target=tag`, and its problems as `file: message`.
struct Seen {
    chains: Vec<String>,
    problems: Vec<String>,
}

fn seen(registry: &sluice_engine::Registry) -> Seen {
    let mut chains: Vec<String> = registry
        .all_chains()
        .map(|c| {
            format!(
                "{}={}",
                c.spec.target,
                c.settings[0]["tag"].as_str().unwrap_or("?")
            )
        })
        .collect();
    chains.sort();
    let problems = registry
        .errors()
        .iter()
        .map(|p| {
            format!(
                "{}: {}",
                p.origin
                    .file
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy(),
                p.message
            )
        })
        .collect();
    Seen { chains, problems }
}

/// Reloads on another thread: a reader that blocks (on a FIFO, say) fails the test instead of
/// hanging it.
fn reload(mut source: LocalSource, wait: Duration) -> (LocalSource, Seen) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let registry = source.reload(wait).expect("directory readable");
        let s = seen(&registry);
        let _ = tx.send((source, s));
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("reloading the chain directory did not finish: a file blocked it")
}

fn source(dir: &Path) -> LocalSource {
    LocalSource::new(dir, PLATFORM, "/usr/bin/python3")
}

fn has(problems: &[String], file: &str, words: &str) -> bool {
    problems
        .iter()
        .any(|p| p.starts_with(&format!("{file}: ")) && p.contains(words))
}

#[test]
fn fifos_sockets_and_devices_are_reported_and_skipped_and_the_rest_serves() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("good.yaml"), chain("good", "bot", "v1")).unwrap();
    let fifo = dir.path().join("zz.yaml");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let _socket = std::os::unix::net::UnixListener::bind(dir.path().join("sock.yaml")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.path().join("zero.yaml")).unwrap();

    let (_, s) = reload(source(dir.path()), Duration::from_secs(10));
    assert_eq!(s.chains, vec!["bot=v1"], "problems: {:?}", s.problems);
    assert!(
        has(&s.problems, "zz.yaml", "a FIFO, not a regular file"),
        "{:?}",
        s.problems
    );
    assert!(
        has(&s.problems, "sock.yaml", "a socket, not a regular file"),
        "{:?}",
        s.problems
    );
    assert!(
        has(&s.problems, "zero.yaml", "outside the chain directory"),
        "{:?}",
        s.problems
    );
}

#[test]
fn symlinks_out_of_the_directory_are_refused_and_symlinks_inside_are_followed() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(
        outside.path().join("stolen.yaml"),
        chain("stolen", "other", "x"),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(
        outside.path().join("stolen.yaml"),
        dir.path().join("out.yaml"),
    )
    .unwrap();
    // A ConfigMap volume's layout: name -> ..data/name, ..data -> a timestamped directory.
    std::fs::create_dir(dir.path().join("..2026_11_26")).unwrap();
    std::fs::write(
        dir.path().join("..2026_11_26/bot.yaml"),
        chain("bot", "bot", "configmap"),
    )
    .unwrap();
    std::os::unix::fs::symlink("..2026_11_26", dir.path().join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/bot.yaml", dir.path().join("bot.yaml")).unwrap();

    let (_, s) = reload(source(dir.path()), Duration::from_secs(10));
    assert_eq!(
        s.chains,
        vec!["bot=configmap"],
        "problems: {:?}",
        s.problems
    );
    assert!(
        has(
            &s.problems,
            "out.yaml",
            "outside the chain directory: not read"
        ),
        "{:?}",
        s.problems
    );
}

#[test]
fn oversized_and_deeply_nested_files_are_refused_before_they_are_parsed() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("good.yaml"), chain("good", "bot", "v1")).unwrap();
    // Over the size cap: a valid chain followed by 5 MiB of comment.
    let mut big = chain("big", "big", "v1");
    big.push_str(&format!("# {}\n", "x".repeat(5 << 20)));
    std::fs::write(dir.path().join("big.yaml"), big).unwrap();
    // 390 KiB of nested flow sequences.
    std::fs::write(dir.path().join("nested.yaml"), "[".repeat(390 << 10)).unwrap();

    let (_, s) = reload(source(dir.path()), Duration::from_secs(10));
    assert_eq!(s.chains, vec!["bot=v1"], "problems: {:?}", s.problems);
    assert!(
        has(
            &s.problems,
            "big.yaml",
            "more than the 4 MiB a chain file may have"
        ),
        "{:?}",
        s.problems
    );
    assert!(
        has(&s.problems, "nested.yaml", "recursion limit"),
        "{:?}",
        s.problems
    );
}

/// A python that hangs on code containing `HANG`, and is the real one otherwise: a file whose
/// checks never end, next to files whose checks are quick.
fn hanging_python(dir: &Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let path = dir.join("python3");
    std::fs::write(
        &path,
        "#!/bin/sh\nin=$(cat)\ncase \"$in\" in *HANG*) sleep 30;; esac\nprintf '%s' \"$in\" | exec /usr/bin/python3 \"$@\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[test]
fn a_file_whose_checks_hang_is_reported_and_never_holds_back_the_others() {
    let tools = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("good.yaml"), chain("good", "bot", "v1")).unwrap();
    let source = LocalSource::new(dir.path(), PLATFORM, hanging_python(tools.path()))
        .with_check_bound(Duration::from_secs(8));
    let (source, s) = reload(source, Duration::from_secs(10));
    assert_eq!(s.chains, vec!["bot=v1"], "problems: {:?}", s.problems);

    // A file whose check hangs appears, and the good file changes in the same reload.
    std::fs::write(
        dir.path().join("hang.yaml"),
        chain("hang", "hang", "v1").replace("settings[\"tag\"]}", "settings[\"tag\"]}  # HANG"),
    )
    .unwrap();
    std::fs::write(dir.path().join("good.yaml"), chain("good", "bot", "v2")).unwrap();
    let (source, s) = reload(source, Duration::from_secs(4));
    assert_eq!(s.chains, vec!["bot=v2"], "problems: {:?}", s.problems);
    assert!(
        source.has_pending(),
        "the hanging file is still being checked"
    );

    // Past the bound it is reported, and its text is not checked again.
    std::thread::sleep(Duration::from_secs(5));
    let (source, s) = reload(source, Duration::from_millis(100));
    assert_eq!(s.chains, vec!["bot=v2"], "problems: {:?}", s.problems);
    assert!(
        has(&s.problems, "hang.yaml", "took longer than 8 s"),
        "{:?}",
        s.problems
    );
    assert!(!source.has_pending());
}
