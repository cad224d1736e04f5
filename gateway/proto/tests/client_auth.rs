//! A bearer token is a password: a client sends it only over TLS, or over plain HTTP/2 to a loopback
//! address (this machine), as the Python client does. Anywhere else the connection is refused before
//! anything is sent, with an error that says how to fix it.

use sluice_proto::client::ClientAuth;
use std::net::{IpAddr, TcpListener, UdpSocket};
use std::time::Duration;

fn with_token() -> ClientAuth {
    ClientAuth {
        token: Some("s3cret".into()),
        ..Default::default()
    }
}

/// This machine's address on its default route, if it has one (a UDP "connect" sends nothing).
fn own_non_loopback_address() -> Option<IpAddr> {
    let probe = UdpSocket::bind("0.0.0.0:0").ok()?;
    probe.connect("192.0.2.1:9").ok()?;
    let ip = probe.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

async fn connect(auth: &ClientAuth, addr: &str) -> Result<(), String> {
    // Bounded only so that a client that does try to connect cannot hang the test.
    match tokio::time::timeout(Duration::from_secs(20), auth.connect(addr)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => panic!("{addr}: the client tried to connect and hung"),
    }
}

#[tokio::test]
async fn a_token_is_not_sent_over_plain_http_to_a_host_that_is_not_loopback() {
    for addr in [
        "http://gateway.example:50051",
        "http://10.1.2.3:50051",
        "http://[2001:db8::1]:50051",
    ] {
        let refused = connect(&with_token(), addr).await;
        let message = refused.expect_err(addr);
        assert!(
            message.contains("only over TLS") && message.contains("--ca"),
            "{addr}: {message}"
        );
    }
    // A real listener on this machine's own network address: no connection reaches it.
    if let Some(ip) = own_non_loopback_address() {
        let listener = TcpListener::bind((ip, 0)).expect("a listener on the host's address");
        listener.set_nonblocking(true).unwrap();
        let addr = format!("http://{}", listener.local_addr().unwrap());
        let refused = connect(&with_token(), &addr).await;
        assert!(refused.is_err(), "{addr}: the token would have gone out");
        match listener.accept() {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("{addr}: something connected: {other:?}"),
        }
    } else {
        eprintln!("no non-loopback address here; checked the refusals by address only");
    }
    // Without a token, plain HTTP/2 anywhere is the caller's choice.
    assert!(ClientAuth::default().bearer().is_ok());
}

#[tokio::test]
async fn a_token_may_go_over_plain_http_to_loopback() {
    for host in ["127.0.0.1", "[::1]", "localhost"] {
        let auth = with_token();
        // Nothing listens there: the connection fails, but not because of the token.
        let addr = format!("http://{host}:1");
        if let Err(e) = auth.connect(&addr).await {
            assert!(
                !e.to_string().contains("only over TLS"),
                "{addr}: loopback was refused: {e}"
            );
        }
    }
}
