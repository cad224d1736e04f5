//! An HTTP/1.1 port of the gateway's proxies (OpenAI-compatible, MCP): its accept loop (plain or
//! with the gRPC port's reloading TLS), every connection watched so that a drain lets the request in
//! flight finish, and the caller's identity from its TLS client certificate or `authorization`
//! header.

use crate::callers::ReloadingPolicy;
use crate::tls::ReloadingTls;
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use hyper::{Request, Response};
use sluice_engine::CallerAuth;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

pub(crate) type Body = BoxBody<Bytes, Infallible>;
/// A TLS client's certificate chain.
pub(crate) type Certs = Vec<rustls_pki_types::CertificateDer<'static>>;

/// A running port: its accept loop, which on [`Running::drain`] stops accepting and waits for the
/// requests in flight.
pub(crate) struct Running {
    /// What the port serves, for the logs ("OpenAI-compatible", "MCP").
    what: &'static str,
    stop: tokio::sync::watch::Sender<bool>,
    serving: tokio::task::JoinHandle<()>,
    /// The TLS handshakes' task, when the port has TLS.
    handshakes: Option<tokio::task::JoinHandle<()>>,
    /// Resolves once the accept loop has let go of the listening socket.
    closed: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl Running {
    /// Stops accepting connections and returns once the port is closed: a client that connects
    /// after this is refused, whatever the requests in flight are doing.
    pub(crate) async fn stop_accepting(&mut self) {
        self.stop.send_replace(true);
        if let Some(h) = self.handshakes.take() {
            h.abort();
            let _ = h.await;
        }
        if let Some(closed) = self.closed.take() {
            let _ = closed.await;
        }
    }

    /// Stops accepting connections, lets every request in flight finish (a streamed reply to its
    /// end) for at most `within`, then closes what is left.
    pub(crate) async fn drain(mut self, within: Duration) {
        self.stop_accepting().await;
        if tokio::time::timeout(within, &mut self.serving)
            .await
            .is_err()
        {
            tracing::warn!(
                "{} requests did not finish within {within:?}; closing anyway",
                self.what
            );
            self.serving.abort();
        }
    }
}

/// Serves `handle` on a listener already bound: every request with the caller's certificates (TLS
/// ports) beside it.
pub(crate) fn serve<H, F>(
    what: &'static str,
    listener: tokio::net::TcpListener,
    tls: Option<Arc<ReloadingTls>>,
    handle: H,
) -> Running
where
    H: Fn(Request<hyper::body::Incoming>, Arc<Option<Certs>>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    use tokio_stream::StreamExt;
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    // Every connection is watched: on drain, idle ones close and busy ones finish their request.
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let (closing, closed) = tokio::sync::oneshot::channel();
    let (serving, handshakes) = match tls {
        None => (
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        accepted = listener.accept() => {
                            let Ok((tcp, _)) = accepted else {
                                tokio::time::sleep(Duration::from_millis(100)).await;
                                continue;
                            };
                            crate::assembly::no_delay(&tcp);
                            tokio::spawn(connection(tcp, None, handle.clone(), &graceful));
                        }
                        _ = stopped.changed() => break,
                    }
                }
                drop(listener);
                let _ = closing.send(());
                graceful.shutdown().await;
            }),
            None,
        ),
        Some(tls) => {
            let (mut incoming, accept) = tls.incoming(listener);
            let serving = tokio::spawn(async move {
                loop {
                    tokio::select! {
                        conn = incoming.next() => {
                            let Some(conn) = conn else { break };
                            let Ok(conn) = conn else { continue };
                            let certs = conn.get_ref().1.peer_certificates().map(|c| c.to_vec());
                            tokio::spawn(connection(conn, certs, handle.clone(), &graceful));
                        }
                        _ = stopped.changed() => break,
                    }
                }
                // The listener is the handshakes' task's, which `stop_accepting` ends.
                drop(incoming);
                let _ = closing.send(());
                graceful.shutdown().await;
            });
            (serving, Some(accept))
        }
    };
    Running {
        what,
        stop,
        serving,
        handshakes,
        closed: Some(closed),
    }
}

/// Serves one HTTP/1.1 connection, watched by `graceful` so that a drain lets its request in
/// flight finish.
fn connection<S, H, F>(
    io: S,
    certs: Option<Certs>,
    handle: H,
    graceful: &hyper_util::server::graceful::GracefulShutdown,
) -> impl Future<Output = ()> + Send + 'static
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<hyper::body::Incoming>, Arc<Option<Certs>>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let certs = Arc::new(certs);
    let svc = hyper::service::service_fn(move |req| {
        let answer = handle(req, certs.clone());
        async move { Ok::<_, Infallible>(answer.await) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .serve_connection(hyper_util::rt::TokioIo::new(io), svc);
    let conn = graceful.watch(conn);
    async move {
        let _ = conn.await;
    }
}

/// Who sent `req`: its TLS client certificate and `authorization` header only. Without a caller
/// policy every caller is unchecked.
pub(crate) fn caller<B>(
    callers: Option<&ReloadingPolicy>,
    req: &Request<B>,
    certs: Option<&[rustls_pki_types::CertificateDer<'static>]>,
) -> CallerAuth {
    let Some(callers) = callers else {
        return CallerAuth::Unchecked;
    };
    let authorization = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    callers.current().identify(certs, authorization)
}

/// The namespace of a request that names none: the caller's, when the policy gives it exactly one,
/// else `default`.
pub(crate) fn default_namespace(auth: &CallerAuth) -> String {
    match auth {
        CallerAuth::Verified(i) if i.namespaces.len() == 1 && i.namespaces[0] != "*" => {
            i.namespaces[0].clone()
        }
        _ => "default".to_string(),
    }
}

/// A header's value as text, when it is.
pub(crate) fn header<B>(req: &Request<B>, name: &str) -> Option<String> {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}
