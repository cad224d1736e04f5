//! The local backend proves at start that its runsc can make cells, and picks the platform.

use sluice_sandbox_local::{LocalBackend, LocalConfig};
use std::os::unix::fs::PermissionsExt;

/// A runsc whose sandboxes cannot make cells, as bookworm's 20221219 cannot: the supervisor's
/// self-test fails with the reason it gives there.
const OLD_RUNSC: &str = r#"#!/bin/sh
case " $* " in
  *" --version "*) echo "runsc version 0.0~20221219.0"; exit 0 ;;
  *" run "*) echo "sluice supervisor probe failed: cannot create cells: cannot create a cell: [Errno 1] unshare: Operation not permitted" >&2; exit 1 ;;
  *) exit 0 ;;
esac
"#;

#[tokio::test]
async fn a_runsc_that_cannot_make_cells_fails_at_start_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let runsc = dir.path().join("runsc");
    std::fs::write(&runsc, OLD_RUNSC).unwrap();
    std::fs::set_permissions(&runsc, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg = LocalConfig::new(dir.path().join("state"));
    cfg.runsc = runsc;
    let err = match LocalBackend::new(cfg).await {
        Ok(_) => panic!("a runsc that cannot make cells was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("cannot run the sandboxes cells need"), "{err}");
    assert!(err.contains("Operation not permitted"), "{err}");
    assert!(err.contains("bookworm-backports"), "{err}");
    // Both platforms were tried.
    assert!(err.contains("systrap:") && err.contains("ptrace:"), "{err}");
}

#[tokio::test]
async fn auto_picks_a_platform_that_makes_cells() {
    if std::process::Command::new("runsc")
        .arg("--version")
        .output()
        .is_err()
    {
        panic!("runsc is not installed: `make deps` installs it");
    }
    let dir = tempfile::Builder::new()
        .prefix("sluice-cells-check")
        .tempdir_in("/tmp")
        .unwrap();
    let backend = LocalBackend::new(LocalConfig::new(dir.path()))
        .await
        .expect("this machine's runsc makes cells");
    assert!(
        ["ptrace", "systrap"].contains(&backend.platform()),
        "{}",
        backend.platform()
    );
    assert!(sluice_sandbox_local::leftover_cgroups(dir.path()).is_empty());
}
