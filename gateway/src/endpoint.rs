//! Where a capability's execute goes: a gRPC `sluice.v1.CapabilityService/Execute`, an HTTP JSON POST,
//! or a built-in. Connections are reused across calls; nothing is retried, so a call that may have
//! charged credit is never made twice.

use crate::proto;
use crate::runner::Caller;
use serde_json::{Value, json};
use sluice_crds::{Builtin, Endpoint};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

type HttpClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<bytes::Bytes>,
>;

#[derive(Clone)]
pub struct Transport {
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
    pub async fn execute(
        &self,
        name: &str,
        endpoint: &Endpoint,
        payload: Value,
        caller: &Caller,
    ) -> Result<(Value, Option<Value>), String> {
        if let Some(builtin) = endpoint.builtin {
            return Ok(match builtin {
                Builtin::Echo => (payload, None),
            });
        }
        if let Some(url) = &endpoint.http {
            return self.http(url, name, payload, caller).await;
        }
        if let Some(url) = &endpoint.grpc {
            return self.grpc(url, name, payload, caller).await;
        }
        Err("capability has no endpoint".into())
    }

    async fn http(
        &self,
        url: &str,
        name: &str,
        payload: Value,
        caller: &Caller,
    ) -> Result<(Value, Option<Value>), String> {
        use http_body_util::BodyExt;
        let body = serde_json::to_vec(
            &json!({"name": name, "payload": payload, "caller": caller.to_json()}),
        )
        .map_err(|e| e.to_string())?;
        let req = hyper::Request::post(url)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .map_err(|e| format!("bad endpoint URL {url:?}: {e}"))?;
        let resp = self
            .http
            .request(req)
            .await
            .map_err(|e| format!("cannot reach {url}: {e}"))?;
        let status = resp.status();
        let bytes = http_body_util::Limited::new(resp.into_body(), 4 << 20)
            .collect()
            .await
            .map_err(|e| format!("reading the answer of {url} failed: {e}"))?
            .to_bytes();
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).to_string();
            return Err(format!("{url} answered {status}: {text}"));
        }
        let answer: Value = serde_json::from_slice(&bytes)
            .map_err(|e| format!("{url} answered invalid JSON: {e}"))?;
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
    ) -> Result<(Value, Option<Value>), String> {
        let channel = {
            let mut cache = self.grpc.lock().unwrap_or_else(|p| p.into_inner());
            match cache.get(url) {
                Some(c) => c.clone(),
                None => {
                    let c = tonic::transport::Endpoint::from_shared(url.to_string())
                        .map_err(|e| format!("bad endpoint URL {url:?}: {e}"))?
                        .connect_lazy();
                    cache.insert(url.to_string(), c.clone());
                    c
                }
            }
        };
        let mut client = proto::capability_service_client::CapabilityServiceClient::new(channel);
        let req = proto::ExecuteRequest {
            name: name.to_string(),
            payload: Some(crate::convert::to_proto(&payload)),
            caller: caller.0.clone().into_iter().collect(),
        };
        let resp = client
            .execute(req)
            .await
            .map_err(|s| format!("{url}: {} ({:?})", s.message(), s.code()))?
            .into_inner();
        let result = resp
            .result
            .map(|v| crate::convert::from_proto(&v))
            .unwrap_or(Value::Null);
        let consumed = resp
            .consumed
            .map(|v| crate::convert::from_proto(&v))
            .filter(|c| !c.is_null());
        Ok((result, consumed))
    }
}

/// Validates `payload` against a JSON Schema; the reason names the first failing place.
pub fn validate(schema: &Value, payload: &Value) -> Result<(), String> {
    let validator = compiled(schema)?;
    let errors: Vec<String> = validator
        .iter_errors(payload)
        .take(3)
        .map(|e| {
            let at = e.instance_path().to_string();
            if at.is_empty() {
                e.to_string()
            } else {
                format!("{at}: {e}")
            }
        })
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// Compiles (once per distinct schema) a validator.
fn compiled(schema: &Value) -> Result<Arc<jsonschema::Validator>, String> {
    static CACHE: std::sync::OnceLock<Mutex<HashMap<String, Arc<jsonschema::Validator>>>> =
        std::sync::OnceLock::new();
    let key = schema.to_string();
    let cache = CACHE.get_or_init(Mutex::default);
    if let Some(v) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(v.clone());
    }
    let v = Arc::new(
        jsonschema::validator_for(schema)
            .map_err(|e| format!("the capability's schema is invalid: {e}"))?,
    );
    let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
    if c.len() > 1024 {
        c.clear();
    }
    c.insert(key, v.clone());
    Ok(v)
}

/// Checks that a schema compiles; used when capabilities are loaded.
pub fn check_schema(schema: &Value) -> Result<(), String> {
    compiled(schema).map(|_| ())
}
