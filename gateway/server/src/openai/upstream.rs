//! The OpenAI-compatible endpoint behind the proxy: one HTTP/1 client (HTTPS with the system's
//! roots, or plain HTTP), the API key from a file (re-read on every call, so a rotated Secret is
//! picked up), and the mapping of its failures to the API's error shape.

use super::error::ApiError;
use super::{Body, OpenAiOptions};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Response, StatusCode};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use std::path::PathBuf;
use std::time::Duration;

/// The upstream could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("--openai-upstream {0:?} is not an http:// or https:// URL")]
    BadUrl(String),
    #[error("loading the system's root certificates for the upstream: {0}")]
    Roots(std::io::Error),
}

pub(crate) struct Upstream {
    /// The base URL without a trailing slash, e.g. `http://127.0.0.1:7003/v1`.
    base: String,
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    api_key_file: Option<PathBuf>,
    pub(crate) timeout: Duration,
}

impl Upstream {
    pub(crate) fn new(opts: &OpenAiOptions) -> Result<Self, UpstreamError> {
        let base = opts.upstream.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://"))
            || base.parse::<hyper::Uri>().is_err()
        {
            return Err(UpstreamError::BadUrl(opts.upstream.clone()));
        }
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_native_roots()
            .map_err(UpstreamError::Roots)?
            .https_or_http()
            .enable_http1()
            .build();
        let client = Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self {
            base,
            client,
            api_key_file: opts.api_key_file.clone(),
            timeout: opts.upstream_timeout,
        })
    }

    fn api_key(&self) -> Result<Option<String>, ApiError> {
        let Some(path) = &self.api_key_file else {
            return Ok(None);
        };
        std::fs::read_to_string(path)
            .map(|k| Some(k.trim().to_string()))
            .map_err(|e| {
                tracing::warn!(path = %path.display(), error = %e, "the upstream API key file cannot be read");
                ApiError::upstream(
                    StatusCode::BAD_GATEWAY,
                    "the gateway cannot read its upstream API key",
                )
            })
    }

    /// Sends a request and waits for the answer's head (within the timeout).
    async fn send(
        &self,
        method: hyper::Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Response<hyper::body::Incoming>, ApiError> {
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        if let Some(key) = self.api_key()? {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {key}"));
        }
        if body.is_some() {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| {
                ApiError::upstream(
                    StatusCode::BAD_GATEWAY,
                    format!("building the upstream request: {e}"),
                )
            })?;
        match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Err(_) => Err(ApiError::upstream(
                StatusCode::GATEWAY_TIMEOUT,
                format!(
                    "the upstream did not answer within {} s",
                    self.timeout.as_secs()
                ),
            )),
            Ok(Err(e)) => Err(ApiError::upstream(
                StatusCode::BAD_GATEWAY,
                format!("the upstream cannot be reached: {e}"),
            )),
            Ok(Ok(resp)) => Ok(resp),
        }
    }

    /// A chat completion request; a non-2xx answer becomes an error (`Err`) as the API shapes it.
    pub(crate) async fn chat(
        &self,
        body: &serde_json::Value,
    ) -> Result<Response<hyper::body::Incoming>, ApiError> {
        let resp = self
            .send(
                hyper::Method::POST,
                "/chat/completions",
                Some(body.to_string().into_bytes()),
            )
            .await?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        Err(self.failed(resp).await)
    }

    /// Reads a whole answer (within the timeout).
    pub(crate) async fn read(
        &self,
        resp: Response<hyper::body::Incoming>,
    ) -> Result<Bytes, ApiError> {
        match tokio::time::timeout(self.timeout, resp.into_body().collect()).await {
            Ok(Ok(b)) => Ok(b.to_bytes()),
            Ok(Err(e)) => Err(ApiError::upstream(
                StatusCode::BAD_GATEWAY,
                format!("the upstream's answer broke off: {e}"),
            )),
            Err(_) => Err(ApiError::upstream(
                StatusCode::GATEWAY_TIMEOUT,
                "the upstream's answer did not finish in time",
            )),
        }
    }

    /// `GET /models`, passed through as it is.
    pub(crate) async fn models(&self) -> Result<Response<Body>, ApiError> {
        let resp = self.send(hyper::Method::GET, "/models", None).await?;
        let status = resp.status();
        let body = self.read(resp).await?;
        let mut out = Response::new(Full::new(body).boxed());
        *out.status_mut() = status;
        out.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        Ok(out)
    }

    /// A non-2xx answer: its own OpenAI error object and status when it has one, else a 502 that
    /// says what came back.
    async fn failed(&self, resp: Response<hyper::body::Incoming>) -> ApiError {
        let status = resp.status();
        let body = match self.read(resp).await {
            Ok(b) => b,
            Err(e) => return e,
        };
        let parsed: Option<serde_json::Value> = serde_json::from_slice(&body).ok();
        let upstream_message = parsed
            .as_ref()
            .and_then(|v| v.pointer("/error/message"))
            .and_then(|m| m.as_str());
        match upstream_message {
            Some(m) => ApiError::from_upstream(status, parsed.clone().unwrap_or_default(), m),
            None => ApiError::upstream(
                StatusCode::BAD_GATEWAY,
                format!("the upstream answered HTTP {status} without an error object"),
            ),
        }
    }
}
