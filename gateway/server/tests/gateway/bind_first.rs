//! The gateway binds its port before it prepares any sandbox: a port already in use is reported at
//! once, not after the sandbox backend has been checked and pools have started booting.

use sluice_gateway::{LocalOptions, start_local};

#[tokio::test]
async fn an_address_in_use_is_reported_before_any_sandbox_work() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut opts = LocalOptions::new(dir.path(), dir.path().join("state"));
    opts.listen = taken.local_addr().expect("an address");
    // A runsc that does not exist: the backend would fail if it were prepared first.
    opts.sandbox.runsc = dir.path().join("no-such-runsc");
    let err = match start_local(opts).await {
        Ok(_) => panic!("a gateway started on a port that is in use"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains("binding") && err.to_lowercase().contains("in use"),
        "{err}"
    );
}
