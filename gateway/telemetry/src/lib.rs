//! The HTTP endpoint of a Sluice process (the gateway's and the operator's) and the Prometheus text
//! rendering behind it. One file: `serve_endpoint` answers `/metrics`, `/healthz` and `/readyz`;
//! `render` turns a registry into the text format. No gRPC, no Kubernetes.

use prometheus::{Encoder, Registry};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Serves `listener` until the process ends: `GET /metrics` renders `registry`, `/healthz` answers
/// while the process runs, and `/readyz` (when `ready` is given) answers 200 only while it is set.
pub async fn serve_endpoint(
    listener: tokio::net::TcpListener,
    registry: Registry,
    ready: Option<Arc<AtomicBool>>,
) -> std::io::Result<()> {
    use http_body_util::Full;
    use hyper::{Response, StatusCode, body::Bytes, service::service_fn};
    loop {
        let (stream, _) = listener.accept().await?;
        let (registry, ready) = (registry.clone(), ready.clone());
        tokio::spawn(async move {
            let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let (registry, ready) = (registry.clone(), ready.clone());
                async move {
                    let is_ready = |r: &AtomicBool| r.load(Ordering::Relaxed);
                    let (status, body) = match (req.uri().path(), &ready) {
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
