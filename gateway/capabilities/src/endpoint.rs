//! Where a capability's execute goes: a gRPC `sluice.v1.CapabilityService/Execute`, an HTTP JSON POST,
//! or a built-in. Connections are reused across calls; nothing is retried, so a call that may have
//! charged credit is never made twice.

use crate::trust::{CredentialError, CredentialSet, Credentials, HttpClient};
use serde_json::{Value, json};
use sluice_crds::{Builtin, Endpoint};
use sluice_engine::Caller;
use sluice_proto::convert::{from_proto, to_proto};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

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
    #[error("{0}")]
    Credentials(#[from] CredentialError),
    #[error(
        "{url}: credentials go over https only (or to a loopback address), never over plain http"
    )]
    Insecure { url: String },
}

/// Clients of every endpoint kind, shared by all runs.
#[derive(Clone)]
pub(crate) struct Transport {
    /// HTTPS (system roots) or plain HTTP, for endpoints that name no credentials.
    http: HttpClient,
    grpc: Arc<Mutex<HashMap<String, tonic::transport::Channel>>>,
    credentials: Arc<Credentials>,
}

impl Transport {
    pub(crate) fn new(credentials: Option<PathBuf>) -> Self {
        let config = crate::trust::tls_config(None, None)
            .expect("the system's roots and no client certificate always make a configuration");
        Self {
            http: crate::trust::https_client(config),
            grpc: Arc::default(),
            credentials: Arc::new(Credentials::new(credentials)),
        }
    }
}

/// A channel to `url` from `cache`, made (lazily connecting) when missing, with TLS for https.
fn channel(
    cache: &Mutex<HashMap<String, tonic::transport::Channel>>,
    url: &str,
    set: Option<&CredentialSet>,
) -> Result<tonic::transport::Channel, EndpointError> {
    let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = cache.get(url) {
        return Ok(c.clone());
    }
    let bad = |reason: String| EndpointError::BadUrl {
        url: url.to_string(),
        reason,
    };
    let mut endpoint =
        tonic::transport::Endpoint::from_shared(url.to_string()).map_err(|e| bad(e.to_string()))?;
    if url.starts_with("https://") {
        let mut tls = tonic::transport::ClientTlsConfig::new();
        match set.and_then(|s| s.ca.as_ref()) {
            Some(ca) => tls = tls.ca_certificate(tonic::transport::Certificate::from_pem(ca)),
            None => tls = tls.with_native_roots(),
        }
        if let Some((cert, key)) = set.and_then(|s| s.identity.as_ref()) {
            tls = tls.identity(tonic::transport::Identity::from_pem(cert, key));
        }
        endpoint = endpoint.tls_config(tls).map_err(|e| bad(e.to_string()))?;
    }
    let c = endpoint.connect_lazy();
    cache.insert(url.to_string(), c.clone());
    Ok(c)
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
        let set = match &endpoint.credentials {
            Some(name) => Some(self.credentials.get(name).await?),
            None => None,
        };
        let url = endpoint.http.as_deref().or(endpoint.grpc.as_deref());
        if let (Some(set), Some(url)) = (&set, url)
            && set.token.is_some()
            && !url.starts_with("https://")
            && !sluice_proto::client::is_loopback(url)
        {
            return Err(EndpointError::Insecure {
                url: url.to_string(),
            });
        }
        if let Some(url) = &endpoint.http {
            return self.http(url, name, payload, caller, set.as_deref()).await;
        }
        if let Some(url) = &endpoint.grpc {
            return self.grpc(url, name, payload, caller, set.as_deref()).await;
        }
        Err(EndpointError::NoEndpoint)
    }

    async fn http(
        &self,
        url: &str,
        name: &str,
        payload: Value,
        caller: &Caller,
        set: Option<&CredentialSet>,
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
        if let Some(token) = set.and_then(|s| s.token.clone()) {
            req.headers_mut().insert(http::header::AUTHORIZATION, token);
        }
        let client = set.map_or(&self.http, |s| &s.http);
        let resp = client.request(req).await.map_err(|e| {
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
        set: Option<&CredentialSet>,
    ) -> Result<(Value, Option<Value>), EndpointError> {
        let channel = channel(set.map_or(&*self.grpc, |s| &s.channels), url, set)?;
        let mut client =
            sluice_proto::capability_service_client::CapabilityServiceClient::new(channel);
        let mut req = tonic::Request::new(sluice_proto::ExecuteRequest {
            name: name.to_string(),
            payload: Some(to_proto(&payload)),
            caller: caller.0.clone().into_iter().collect(),
        });
        crate::propagation::inject_grpc(req.metadata_mut());
        if let Some(token) = set.and_then(|s| s.token.as_ref())
            && let Ok(value) = token.to_str()
            && let Ok(value) = value.parse()
        {
            req.metadata_mut().insert("authorization", value);
        }
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

#[cfg(test)]
mod tests {
    use sluice_proto::client::is_loopback;

    #[test]
    fn only_this_machine_counts_as_loopback() {
        for url in [
            "http://127.0.0.1:7002/x",
            "http://localhost/",
            "http://[::1]:9/",
        ] {
            assert!(is_loopback(url), "{url}");
        }
        for url in [
            "http://ledger.billing.svc/",
            "http://10.0.0.1/",
            "http://127.0.0.1.nip.io/",
            "http://localhost.evil.example/",
        ] {
            assert!(!is_loopback(url), "{url}");
        }
    }
}
