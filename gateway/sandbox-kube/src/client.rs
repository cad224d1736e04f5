//! The gateway's client of the API server: kube's default stack (`Client::try_from(config)`: TLS,
//! auth with token refresh, extra headers, kube's retry of 429/503/504, connect and read timeouts),
//! on TCP connections that keep themselves honest. kube's own connector has no socket options, so
//! the stack is built here around one that has:
//! - TCP keepalive: an idle connection (a watch between events, a held pod's exec between trigger
//!   points) whose peer vanished without a FIN or RST is found by the kernel's probes and fails,
//!   instead of staying open forever;
//! - a TCP user timeout: data sent and not acknowledged (a request, a run's payload on an exec)
//!   fails the connection after `USER_TIMEOUT`, instead of the ~15 minutes of retransmissions
//!   Linux allows by default;
//! - `TCP_NODELAY`: the exec websocket carries small protocol frames (a hook's answer, the next
//!   request) that must leave at once, not wait for the previous segment's acknowledgement
//!   (Nagle's algorithm with delayed ACKs holds them up to 40 ms).
//!
//! Neither sees a connection whose peer's kernel still acknowledges but whose other end stopped
//! relaying (a stalled proxy): the exec's websocket heartbeat (`exec.rs`) covers that.

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::ConfigExt;
use std::time::Duration;
use tower::{BoxError, ServiceBuilder};

/// Idle time before the first keepalive probe, the time between probes, and how many unanswered
/// probes end the connection: a dead idle connection is found within about a minute.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_PROBES: u32 = 3;
/// How long sent data may stay unacknowledged before the connection is given up.
const USER_TIMEOUT: Duration = Duration::from_secs(60);

/// The TCP connector under the client: kube's (any scheme, TLS wraps it), with keepalive and a user
/// timeout.
fn connector() -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.enforce_http(false);
    connector.set_keepalive(Some(KEEPALIVE_IDLE));
    connector.set_keepalive_interval(Some(KEEPALIVE_INTERVAL));
    connector.set_keepalive_retries(Some(KEEPALIVE_PROBES));
    connector.set_tcp_user_timeout(Some(USER_TIMEOUT));
    connector.set_nodelay(true);
    connector
}

/// A kube client for `config`, as `kube::Client::try_from(config)` makes it, on the connector above.
pub fn client(config: kube::Config) -> Result<kube::Client, kube::Error> {
    let https = config.rustls_https_connector_with_connector(connector())?;
    let mut timed = hyper_timeout::TimeoutConnector::new(https);
    timed.set_connect_timeout(config.connect_timeout);
    timed.set_read_timeout(config.read_timeout);
    timed.set_write_timeout(config.write_timeout);
    timed.set_reset_reader_on_write(config.reset_reader_on_write);
    let http: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(timed);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.default_retry.then(|| {
            tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry())
        }))
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(http);
    Ok(kube::Client::new(service, config.default_namespace))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The options reach the sockets: a connection the connector makes carries them.
    #[tokio::test]
    async fn connections_carry_keepalive_a_user_timeout_and_nodelay() {
        use tower::Service;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = tokio::spawn(async move { listener.accept().await });
        let mut c = connector();
        let stream = c
            .call(format!("http://{addr}").parse().unwrap())
            .await
            .expect("connected");
        let socket = socket2::SockRef::from(stream.inner());
        assert!(socket.keepalive().unwrap());
        assert_eq!(socket.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(socket.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
        assert_eq!(socket.tcp_user_timeout().unwrap(), Some(USER_TIMEOUT));
        assert!(
            socket.tcp_nodelay().unwrap(),
            "small exec frames leave at once"
        );
        drop(accepted);
    }
}
