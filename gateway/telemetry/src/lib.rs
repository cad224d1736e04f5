//! The HTTP endpoint of a Sluice process (the gateway's and the operator's) and the Prometheus text
//! rendering behind it. One file: `serve_endpoint` answers `/metrics`, `/healthz` and `/readyz`;
//! `render` turns a registry into the text format. No gRPC, no Kubernetes.

use prometheus::{Encoder, Registry};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A JSON document served at a path of the endpoint, made afresh for each request.
pub type Page = (&'static str, Arc<dyn Fn() -> Vec<u8> + Send + Sync>);

/// Serves `listener` until the process ends: `GET /metrics` renders `registry`, `/healthz` answers
/// while the process runs, `/readyz` (when `ready` is given) answers 200 only while it is set, and
/// each of `pages` answers its JSON.
pub async fn serve_endpoint(
    listener: tokio::net::TcpListener,
    registry: Registry,
    ready: Option<Arc<AtomicBool>>,
    pages: Vec<Page>,
) -> std::io::Result<()> {
    let pages = Arc::new(pages);
    use http_body_util::Full;
    use hyper::{Response, StatusCode, body::Bytes, service::service_fn};
    loop {
        let (stream, _) = listener.accept().await?;
        let (registry, ready, pages) = (registry.clone(), ready.clone(), pages.clone());
        tokio::spawn(async move {
            let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let (registry, ready, pages) = (registry.clone(), ready.clone(), pages.clone());
                async move {
                    let is_ready = |r: &AtomicBool| r.load(Ordering::Relaxed);
                    let page = pages.iter().find(|(path, _)| *path == req.uri().path());
                    let (status, body) = match (req.uri().path(), &ready) {
                        _ if page.is_some() => {
                            (StatusCode::OK, page.map(|(_, f)| f()).unwrap_or_default())
                        }
                        ("/metrics", _) => (StatusCode::OK, render(&registry).into_bytes()),
                        ("/healthz", _) => (StatusCode::OK, b"ok\n".to_vec()),
                        ("/readyz", Some(r)) if is_ready(r) => {
                            (StatusCode::OK, b"ready\n".to_vec())
                        }
                        ("/readyz", Some(_)) => {
                            (StatusCode::SERVICE_UNAVAILABLE, b"not ready\n".to_vec())
                        }
                        _ => (StatusCode::NOT_FOUND, b"not found\n".to_vec()),
                    };
                    let mut r = Response::new(Full::new(Bytes::from(body)));
                    *r.status_mut() = status;
                    Ok::<_, std::convert::Infallible>(r)
                }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, svc)
                .await;
        });
    }
}

/// A registry in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut out = Vec::new();
    let _ = prometheus::TextEncoder::new().encode(&registry.gather(), &mut out);
    String::from_utf8(out).unwrap_or_default()
}
