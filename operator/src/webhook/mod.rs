//! The validating admission webhook: an HTTPS server (rustls, HTTP/1.1) that every operator replica
//! runs, leader or not, answering `admission.k8s.io/v1` AdmissionReviews for HookChains and
//! Capabilities on `POST /validate` (`review` judges them) and `GET /healthz`. The certificate is
//! read again when its files change (`tls`).
//!
//! Bounds, so that no request can stall or crash it: bodies over [`MAX_BODY`] are refused with 413,
//! a TLS handshake, request head or body that takes longer than [`IO_TIMEOUT`] is dropped (408 for
//! a body), at most [`MAX_REVIEWS`] reviews run python at once (the rest wait their turn), and a
//! review that overruns its time ([`DEFAULT_REVIEW_TIMEOUT`] unless set) is refused with the reason.

mod review;
mod tls;

pub use review::{Judge, MalformedReview, Verdict, judge_object, review};
pub use tls::{CertReloader, TlsError};

use crate::metrics::Metrics;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

/// Largest AdmissionReview read. An UPDATE carries the object and the old one, each at most what
/// etcd stores (1.5 MiB by default).
pub const MAX_BODY: usize = 8 << 20;
/// Longest a client may take for its TLS handshake or to send a request.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Reviews judged at once; hook code analysis runs a python process each.
pub const MAX_REVIEWS: usize = 4;
/// Longest one review may take (waiting for its turn included) unless `--webhook-review-timeout`
/// says otherwise; under the API server's webhook timeout (`timeoutSeconds`, 10 s by default in the
/// chart, which passes 2 s less), so the refusal reaches the user instead of a timeout.
pub const DEFAULT_REVIEW_TIMEOUT: Duration = Duration::from_secs(8);

/// Where and how the webhook is served (`--webhook-*` flags).
#[derive(Clone, Debug)]
pub struct WebhookConfig {
    pub listen: SocketAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub judge: Judge,
    pub review_timeout: Duration,
}

/// Why the webhook cannot start.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("webhook certificate: {0}")]
    Tls(#[from] TlsError),
    #[error("cannot listen for the webhook on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A bound, ready-to-serve webhook: certificate loaded and port open, so configuration errors
/// surface before the operator reports itself started.
pub struct Webhook {
    listener: TcpListener,
    certs: Arc<CertReloader>,
    judge: Arc<Judge>,
    metrics: Option<Metrics>,
    review_timeout: Duration,
}

impl Webhook {
    pub async fn bind(config: WebhookConfig) -> Result<Self, WebhookError> {
        let certs = CertReloader::load(&config.cert, &config.key)?;
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| WebhookError::Listen {
                    addr: config.listen,
                    source,
                })?;
        Ok(Self::on(listener, certs, config.judge).with_review_timeout(config.review_timeout))
    }

    /// A webhook on a listener the caller bound (tests bind port 0).
    pub fn on(listener: TcpListener, certs: CertReloader, judge: Judge) -> Self {
        Self {
            listener,
            certs: Arc::new(certs),
            judge: Arc::new(judge),
            metrics: None,
            review_timeout: DEFAULT_REVIEW_TIMEOUT,
        }
    }

    /// How long one review may take before it is refused as unfinished.
    pub fn with_review_timeout(mut self, timeout: Duration) -> Self {
        self.review_timeout = timeout;
        self
    }

    /// Counts the reviews answered in `sluice_operator_webhook_reviews_total`.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `stop` turns true; connections in flight finish on their own.
    pub async fn serve(self, mut stop: watch::Receiver<bool>) {
        match self.listener.local_addr() {
            Ok(addr) => tracing::info!(%addr, "admission webhook listening"),
            Err(e) => tracing::info!(error = %e, "admission webhook listening"),
        }
        let turns = Arc::new(Semaphore::new(MAX_REVIEWS));
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors and the like: pause instead of spinning.
                        tracing::warn!(error = %e, "webhook accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                // The guard `wait_for` returns is not Send: drop it inside the branch's future.
                _ = async { stop.wait_for(|s| *s).await.is_ok() } => return,
            };
            let acceptor = tokio_rustls::TlsAcceptor::from(self.certs.current());
            let judge = self.judge.clone();
            let turns = turns.clone();
            let metrics = self.metrics.clone();
            let review_timeout = self.review_timeout;
            tokio::spawn(async move {
                let tls = match tokio::time::timeout(IO_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "webhook TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "webhook TLS handshake timed out");
                        return;
                    }
                };
                let service = hyper::service::service_fn(move |req| {
                    handle(
                        req,
                        judge.clone(),
                        turns.clone(),
                        metrics.clone(),
                        review_timeout,
                    )
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .header_read_timeout(IO_TIMEOUT)
                    .timer(hyper_util::rt::TokioTimer::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service);
                if let Err(e) = conn.await {
                    tracing::debug!(%peer, error = %e, "webhook connection ended with an error");
                }
            });
        }
    }
}

fn text(status: StatusCode, body: impl Into<String>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.into())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

async fn handle(
    req: Request<Incoming>,
    judge: Arc<Judge>,
    turns: Arc<Semaphore>,
    metrics: Option<Metrics>,
    review_timeout: Duration,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
        (&Method::POST, "/validate") => {
            let (response, result) = validate(req, judge, turns, review_timeout).await;
            if let Some(m) = &metrics {
                m.webhook_reviews.with_label_values(&[result]).inc();
            }
            response
        }
        (_, "/validate") => text(
            StatusCode::METHOD_NOT_ALLOWED,
            "POST an admission.k8s.io/v1 AdmissionReview\n",
        ),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: the webhook serves POST /validate and GET /healthz\n",
        ),
    })
}

async fn validate(
    req: Request<Incoming>,
    judge: Arc<Judge>,
    turns: Arc<Semaphore>,
    review_timeout: Duration,
) -> (Response<Full<Bytes>>, &'static str) {
    let read = tokio::time::timeout(
        IO_TIMEOUT,
        Limited::new(req.into_body(), MAX_BODY).collect(),
    );
    let body = match read.await {
        Err(_) => {
            return (
                text(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "the request body did not arrive within {}s\n",
                        IO_TIMEOUT.as_secs()
                    ),
                ),
                "malformed",
            );
        }
        Ok(read) => read,
    };
    let body = match body {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return (
                text(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "the AdmissionReview is over the webhook's limit of {MAX_BODY} bytes\n"
                    ),
                ),
                "malformed",
            );
        }
        Err(e) => {
            return (
                text(
                    StatusCode::BAD_REQUEST,
                    format!("cannot read the request body: {e}\n"),
                ),
                "malformed",
            );
        }
    };
    let judged = async {
        // Closed only if the semaphore is dropped, which it never is while serving.
        let turn = turns.acquire_owned().await.ok();
        let judge = judge.clone();
        let body = body.clone();
        // The turn is held by the work, not by the wait: a review that overruns its time keeps
        // its turn until python ends, so stuck checks cannot pile up past MAX_REVIEWS.
        tokio::task::spawn_blocking(move || {
            let _turn = turn;
            review(&body, &judge)
        })
        .await
    };
    let answer = match tokio::time::timeout(review_timeout, judged).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => {
            tracing::error!(error = %e, "webhook review panicked");
            return (
                text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the review failed inside the webhook\n",
                ),
                "failed",
            );
        }
        Err(_) => timed_out(&body, review_timeout),
    };
    match answer {
        Ok(review) => match serde_json::to_vec(&review) {
            Ok(json) => {
                let allowed = review.response.as_ref().is_some_and(|r| r.allowed);
                if let Some(r) = &review.response {
                    tracing::info!(uid = %r.uid, allowed, "admission review");
                }
                let mut r = Response::new(Full::new(Bytes::from(json)));
                r.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/json"),
                );
                (r, if allowed { "admitted" } else { "refused" })
            }
            Err(e) => (
                text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("cannot write the answer: {e}\n"),
                ),
                "failed",
            ),
        },
        Err(malformed) => (
            text(
                StatusCode::BAD_REQUEST,
                format!("malformed AdmissionReview: {malformed}\n"),
            ),
            "malformed",
        ),
    }
}

/// The refusal for a review that did not finish in time, answered with its uid when it has one.
fn timed_out(
    body: &[u8],
    limit: Duration,
) -> Result<kube::core::admission::AdmissionReview<kube::core::DynamicObject>, MalformedReview> {
    let raw: serde_json::Value = serde_json::from_slice(body).map_err(MalformedReview::NotJson)?;
    let uid = raw["request"]["uid"]
        .as_str()
        .filter(|u| !u.is_empty())
        .ok_or(MalformedReview::NoUid)?;
    let mut response = kube::core::admission::AdmissionResponse::invalid(format!(
        "sluice admission webhook: the check did not finish within {:?} (the webhook is busy or python is stuck); try again",
        limit
    ));
    response.uid = uid.to_string();
    response.result.code = 503;
    Ok(response.into_review())
}
