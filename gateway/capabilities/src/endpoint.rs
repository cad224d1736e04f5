//! Where a capability's execute goes: a gRPC `sluice.v1.CapabilityService/Execute`, an HTTP JSON POST,
//! or a built-in. Connections are reused across calls; nothing is retried, so a call that may have
//! charged credit is never made twice.

use serde_json::{Value, json};
use sluice_crds::{Builtin, Endpoint};
use sluice_engine::Caller;
use sluice_proto::convert::{from_proto, to_proto};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

type HttpClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<bytes::Bytes>,
>;

/// Why an endpoint gave no answer; the runner reports it as the capability having failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EndpointError {
    #[error("capability has no endpoint")]
    NoEndpoint,
    #[error("bad endpoint URL {url:?}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("cannot reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("reading the answer of {url} failed: {reason}")]
    Read { url: String, reason: String },
    #[error("{url} answered {status}: {text}")]
    Status {
        url: String,
        status: String,
        text: String,
    },
    #[error("{url} answered invalid JSON: {reason}")]
    Json { url: String, reason: String },
    #[error("{url}: {message} ({code:?})")]
    Grpc {
        url: String,
        message: String,
        code: tonic::Code,
    },
    #[error("{0}")]
    Encode(#[from] serde_json::Error),
}

/// Clients of every endpoint kind, shared by all runs.
#[derive(Clone)]
pub(crate) struct Transport {
    http: HttpClient,
    grpc: Arc<Mutex<HashMap<String, tonic::transport::Channel>>>,
}

impl Default for Transport {
    fn default() -> Self {
        let http =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_idle_timeout(std::time::Duration::from_secs(30))
                .build_http();
        Self {
            http,
            grpc: Arc::default(),
        }
    }
}

impl Transport {
    /// Calls the endpoint; answers (result, consumed).
    pub(crate) async fn execute(
        &self,
        name: &str,
        endpoint: &Endpoint,
        payload: Value,
        caller: &Caller,
    ) -> Result<(Value, Option<Value>), EndpointError> {
        if let Some(builtin) = endpoint.builtin {
            return Ok(match builtin {
                Builtin::Echo => (payload, None),
                Builtin::Charge => {
                    let credits = payload
                        .get("credits")
                        .and_then(Value::as_i64)
                        .unwrap_or(1)
                        .max(0);
                    (
                        json!({"charged": credits}),
                        Some(json!({"credits": credits})),
                    )
                }
            });
        }
        if let Some(url) = &endpoint.http {
            return self.http(url, name, payload, caller).await;
        }
        if let Some(url) = &endpoint.grpc {
            return self.grpc(url, name, payload, caller).await;
        }
        Err(EndpointError::NoEndpoint)
    }

    async fn http(
        &self,
        url: &str,
        name: &str,
        payload: Value,
        caller: &Caller,
    ) -> Result<(Value, Option<Value>), EndpointError> {
        use http_body_util::BodyExt;
        let at = |reason: &dyn std::fmt::Display| (url.to_string(), reason.to_string());
        let body = serde_json::to_vec(
            &json!({"name": name, "payload": payload, "caller": caller.to_json()}),
        )?;
        let mut req = hyper::Request::post(url)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .map_err(|e| {
                let (url, reason) = at(&e);
                EndpointError::BadUrl { url, reason }
            })?;
        crate::propagation::inject_http(req.headers_mut());
        let resp = self.http.request(req).await.map_err(|e| {
            let (url, reason) = at(&e);
            EndpointError::Unreachable { url, reason }
        })?;
        let status = resp.status();
        let bytes = http_body_util::Limited::new(resp.into_body(), 4 << 20)
            .collect()
            .await
            .map_err(|e| {
                let (url, reason) = at(&e);
                EndpointError::Read { url, reason }
            })?
            .to_bytes();
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).to_string();
            return Err(EndpointError::Status {
                url: url.to_string(),
                status: status.to_string(),
                text,
            });
        }
        let answer: Value = serde_json::from_slice(&bytes).map_err(|e| {
            let (url, reason) = at(&e);
            EndpointError::Json { url, reason }
        })?;
        let result = answer.get("result").cloned().unwrap_or(Value::Null);
        let consumed = answer.get("consumed").cloned().filter(|c| !c.is_null());
        Ok((result, consumed))
    }

    async fn grpc(
        &self,
        url: &str,
        name: &str,
        payload: Value,
        caller: &Caller,
    ) -> Result<(Value, Option<Value>), EndpointError> {
        let channel = {
            let mut cache = self.grpc.lock().unwrap_or_else(|p| p.into_inner());
            match cache.get(url) {
                Some(c) => c.clone(),
                None => {
                    let c = tonic::transport::Endpoint::from_shared(url.to_string())
                        .map_err(|e| EndpointError::BadUrl {
                            url: url.to_string(),
                            reason: e.to_string(),
                        })?
                        .connect_lazy();
                    cache.insert(url.to_string(), c.clone());
                    c
                }
            }
        };
        let mut client =
            sluice_proto::capability_service_client::CapabilityServiceClient::new(channel);
        let mut req = tonic::Request::new(sluice_proto::ExecuteRequest {
            name: name.to_string(),
            payload: Some(to_proto(&payload)),
            caller: caller.0.clone().into_iter().collect(),
        });
        crate::propagation::inject_grpc(req.metadata_mut());
        let resp = client
            .execute(req)
            .await
            .map_err(|s| EndpointError::Grpc {
                url: url.to_string(),
                message: s.message().to_string(),
                code: s.code(),
            })?
            .into_inner();
        let result = resp.result.map(|v| from_proto(&v)).unwrap_or(Value::Null);
        let consumed = resp
            .consumed
            .map(|v| from_proto(&v))
            .filter(|c| !c.is_null());
        Ok((result, consumed))
    }
}
