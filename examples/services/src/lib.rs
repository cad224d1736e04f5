//! Example application services behind the example Capabilities (`examples/capabilities.yaml`):
//!
//! - a **fake LLM** over gRPC (`sluice.v1.CapabilityService/Execute`, capability `llm.run`): answers
//!   deterministically, a "summary" made of the prompt's first sentence, and reports what it used;
//! - a **credit ledger** over HTTP (the JSON POST of the design) serving two capabilities: the gate
//!   `credit.check`, which *reserves* the call's cost so concurrent runs can never overspend, and the
//!   dispatch step `credit.consume`, which settles the reservation with what was really used (or
//!   releases it when the call did not execute). Both are keyed by the gateway's `call_id`, so a
//!   settlement the gateway tries again is applied once.
//!
//! A third, `openai_llm`, is an OpenAI-compatible fake LLM over HTTP: the upstream of the gateway's
//! OpenAI proxy; a fourth, `mcp_tools`, a small MCP server with the support bot's tools, the
//! upstream of its MCP proxy.
//!
//! Both record every call they receive, so tests can assert the order of gate, execute and dispatch.
//!
//! Both can insist on the gateway's credentials ([`Guard`]): a bearer token, and a client
//! certificate signed by a given CA (then both speak TLS). A call without them is refused (HTTP 401,
//! gRPC `UNAUTHENTICATED`, or the TLS handshake fails) and never reaches the ledger or the model,
//! so the `caller` a request carries can be believed: only the gateway could have sent it.

mod mcp_tools;
mod openai_llm;
pub use mcp_tools::{FakeMcp, McpStats};
pub use openai_llm::{CONTACT_REPLY, FakeOpenAi, OpenAiStats};

use serde_json::{Value, json};
use sluice_proto::convert::{from_proto, to_proto};
use sluice_proto::{self as proto, capability_service_server::CapabilityService};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// One call a service received.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub service: &'static str,
    pub name: String,
    pub payload: Value,
    pub caller: HashMap<String, String>,
}

pub type Log = Arc<Mutex<Vec<Call>>>;

fn record(log: &Log, call: Call) {
    log.lock().unwrap_or_else(|p| p.into_inner()).push(call);
}

/// Credits one `llm.run` call costs: a base plus one per 100 characters of prompt.
/// What a call costs: `credits` when the payload names them (`credit.charge`), else 1 per started
/// 100 characters of `prompt` (`llm.run`).
pub fn cost(payload: &Value) -> i64 {
    if let Some(credits) = payload.get("credits").and_then(Value::as_i64) {
        return credits.max(0);
    }
    llm_cost(payload)
}

pub fn llm_cost(payload: &Value) -> i64 {
    let chars = payload
        .get("prompt")
        .and_then(Value::as_str)
        .map(|p| p.chars().count())
        .unwrap_or(0);
    1 + chars as i64 / 100
}

// ---------------------------------------------------------------- the gateway's credentials

/// What a caller must present before either service answers.
#[derive(Clone, Debug, Default)]
pub struct Guard {
    /// The bearer token the gateway sends (`authorization: Bearer <token>`).
    pub token: Option<String>,
    /// Serve TLS and require a client certificate signed by its `client_ca`.
    pub tls: Option<ServerTls>,
}

/// PEM: the services' certificate chain and key, and the CA client certificates must chain to.
#[derive(Clone, Debug)]
pub struct ServerTls {
    pub cert: Vec<u8>,
    pub key: Vec<u8>,
    pub client_ca: Vec<u8>,
}

impl Guard {
    /// Whether an `authorization` header value is the one the gateway sends.
    fn admits(&self, authorization: Option<&[u8]>) -> bool {
        match &self.token {
            None => true,
            Some(token) => {
                // Constant time: how much of a guess matched must not show in the answer's timing.
                let expected = format!("Bearer {token}");
                let given = authorization.unwrap_or_default();
                given.len() == expected.len()
                    && given
                        .iter()
                        .zip(expected.as_bytes())
                        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                        == 0
            }
        }
    }

    fn acceptor(&self) -> anyhow::Result<Option<tokio_rustls::TlsAcceptor>> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        let Some(tls) = &self.tls else {
            return Ok(None);
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(&tls.client_ca) {
            roots.add(ca?)?;
        }
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .build()?;
        let chain = CertificateDer::pem_slice_iter(&tls.cert).collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_slice(&tls.key)?;
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)?;
        Ok(Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))))
    }
}

// ---------------------------------------------------------------- fake LLM (gRPC)

pub struct FakeLlm {
    pub log: Log,
}

#[tonic::async_trait]
impl CapabilityService for FakeLlm {
    async fn execute(
        &self,
        request: tonic::Request<proto::ExecuteRequest>,
    ) -> Result<tonic::Response<proto::ExecuteResponse>, tonic::Status> {
        let r = request.into_inner();
        let payload = r.payload.as_ref().map(from_proto).unwrap_or(Value::Null);
        record(
            &self.log,
            Call {
                service: "llm",
                name: r.name.clone(),
                payload: payload.clone(),
                caller: r.caller.clone(),
            },
        );
        let prompt = payload
            .get("prompt")
            .and_then(Value::as_str)
            .ok_or_else(|| tonic::Status::invalid_argument("prompt is required"))?;
        let text = prompt
            .split_once(": ")
            .map(|(_, rest)| rest)
            .unwrap_or(prompt);
        let first = text
            .split_inclusive(['.', '!', '?'])
            .next()
            .unwrap_or(text)
            .trim();
        let summary = format!("Summary: {first}");
        let tokens = prompt.split_whitespace().count() + summary.split_whitespace().count();
        Ok(tonic::Response::new(proto::ExecuteResponse {
            result: Some(to_proto(&json!({"text": summary}))),
            consumed: Some(to_proto(
                &json!({"tokens": tokens, "credits": llm_cost(&payload)}),
            )),
        }))
    }
}

// ---------------------------------------------------------------- credit ledger (HTTP)

#[derive(Debug, Default)]
struct Account {
    balance: i64,
    reserved: i64,
    /// Open reservations by the gateway's call id.
    holds: HashMap<String, i64>,
}

#[derive(Clone, Default)]
pub struct Credit {
    accounts: Arc<Mutex<HashMap<String, Account>>>,
    /// Call ids already settled, with what each settled: a settlement tried again is answered from
    /// here, never applied twice.
    settled: Arc<Mutex<HashMap<String, i64>>>,
    pub log: Log,
}

impl Credit {
    pub fn set_balance(&self, user: &str, balance: i64) {
        self.accounts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(user.to_string())
            .or_default()
            .balance = balance;
    }

    pub fn balance(&self, user: &str) -> (i64, i64) {
        let a = self.accounts.lock().unwrap_or_else(|p| p.into_inner());
        a.get(user)
            .map(|a| (a.balance, a.reserved))
            .unwrap_or((0, 0))
    }

    /// Reservations still open for `user` (each should have been settled or released).
    pub fn open_holds(&self, user: &str) -> usize {
        let a = self.accounts.lock().unwrap_or_else(|p| p.into_inner());
        a.get(user).map_or(0, |a| a.holds.len())
    }

    /// Handles one capability call: `credit.check` (gate) or `credit.consume` (dispatch).
    pub fn handle(&self, body: &Value) -> Result<Value, String> {
        let name = body.get("name").and_then(Value::as_str).unwrap_or_default();
        let payload = body.get("payload").cloned().unwrap_or(Value::Null);
        let caller: HashMap<String, String> = body
            .get("caller")
            .and_then(Value::as_object)
            .map(|o| {
                o.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect()
            })
            .unwrap_or_default();
        record(
            &self.log,
            Call {
                service: "credit",
                name: name.to_string(),
                payload: payload.clone(),
                caller: caller.clone(),
            },
        );
        let user = caller.get("user_id").cloned().unwrap_or_default();
        let call = payload
            .get("call_id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let inner = payload.get("payload").cloned().unwrap_or(Value::Null);
        let mut accounts = self.accounts.lock().unwrap_or_else(|p| p.into_inner());
        match name {
            "credit.check" => {
                if user.is_empty() {
                    return Ok(
                        json!({"result": {"allow": false, "reason": "no user_id in the caller context"}}),
                    );
                }
                if call.is_empty() {
                    return Err("no call_id: reservations are keyed by it".into());
                }
                let cost = cost(&inner);
                let account = accounts.entry(user.clone()).or_default();
                if let Some(held) = account.holds.get(&call) {
                    return Ok(
                        json!({"result": {"allow": true, "reason": format!("reserved {held}")}}),
                    );
                }
                let available = account.balance - account.reserved;
                if available < cost {
                    return Ok(
                        json!({"result": {"allow": false, "reason": format!("balance {available} is below the cost {cost}")}}),
                    );
                }
                account.reserved += cost;
                account.holds.insert(call, cost);
                Ok(json!({"result": {"allow": true, "reason": format!("reserved {cost}")}}))
            }
            "credit.consume" => {
                let mut settled = self.settled.lock().unwrap_or_else(|p| p.into_inner());
                let account = accounts.entry(user).or_default();
                if let Some(used) = settled.get(&call) {
                    return Ok(
                        json!({"result": {"settled": used, "balance": account.balance, "again": true}}),
                    );
                }
                let hold = account.holds.remove(&call).unwrap_or(0);
                account.reserved -= hold;
                // The call did not execute (denied, failed, timed out): nothing was used, the
                // reservation is released.
                let used = payload
                    .get("consumed")
                    .and_then(|c| c.get("credits"))
                    .and_then(Value::as_i64)
                    .unwrap_or(0);
                account.balance -= used;
                if !call.is_empty() {
                    settled.insert(call, used);
                }
                Ok(json!({"result": {"settled": used, "balance": account.balance}}))
            }
            other => Err(format!("unknown capability {other:?}")),
        }
    }
}

async fn serve_credit(
    credit: Credit,
    listener: tokio::net::TcpListener,
    guard: Guard,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
) {
    use http_body_util::{BodyExt, Full};
    use hyper::{Response, StatusCode, body::Bytes, service::service_fn};
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let (credit, guard, acceptor) = (credit.clone(), guard.clone(), acceptor.clone());
        tokio::spawn(async move {
            let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let credit = credit.clone();
                let admitted = guard.admits(
                    req.headers()
                        .get(hyper::header::AUTHORIZATION)
                        .map(|v| v.as_bytes()),
                );
                async move {
                    let body = match http_body_util::Limited::new(req.into_body(), 1 << 20)
                        .collect()
                        .await
                    {
                        Ok(b) => b.to_bytes(),
                        Err(_) => Bytes::new(),
                    };
                    let (status, answer) = if !admitted {
                        (
                            StatusCode::UNAUTHORIZED,
                            json!({"error": "the gateway's bearer token is missing or wrong"}),
                        )
                    } else {
                        match serde_json::from_slice::<Value>(&body) {
                            Ok(v) => match credit.handle(&v) {
                                Ok(a) => (StatusCode::OK, a),
                                Err(e) => (StatusCode::BAD_REQUEST, json!({"error": e})),
                            },
                            Err(e) => (StatusCode::BAD_REQUEST, json!({"error": e.to_string()})),
                        }
                    };
                    let mut resp = Response::new(Full::new(Bytes::from(answer.to_string())));
                    *resp.status_mut() = status;
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            let http = hyper::server::conn::http1::Builder::new();
            match acceptor {
                None => {
                    let _ = http
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                }
                // Without a client certificate the CA signed, the handshake fails: nothing is read.
                Some(acceptor) => {
                    if let Ok(tls) = acceptor.accept(stream).await {
                        let _ = http
                            .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                            .await;
                    }
                }
            }
        });
    }
}

/// Both services, started on the given addresses (port 0 picks a free one).
pub struct Services {
    pub llm_addr: SocketAddr,
    pub credit_addr: SocketAddr,
    pub credit: Credit,
    /// Calls to both services, in the order they arrived.
    pub log: Log,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Services {
    /// Both services, open to any caller.
    pub async fn start(llm: SocketAddr, credit_addr: SocketAddr) -> anyhow::Result<Self> {
        Self::start_guarded(llm, credit_addr, Guard::default()).await
    }

    /// Both services, answering only callers that present what `guard` asks for.
    pub async fn start_guarded(
        llm: SocketAddr,
        credit_addr: SocketAddr,
        guard: Guard,
    ) -> anyhow::Result<Self> {
        let acceptor = guard.acceptor()?;
        let llm_listener = tokio::net::TcpListener::bind(llm).await?;
        let credit_listener = tokio::net::TcpListener::bind(credit_addr).await?;
        let (llm_addr, credit_addr) = (llm_listener.local_addr()?, credit_listener.local_addr()?);
        let log = Log::default();
        let credit = Credit {
            log: log.clone(),
            ..Credit::default()
        };
        let token_guard = guard.clone();
        let llm_service =
            proto::capability_service_server::CapabilityServiceServer::with_interceptor(
                FakeLlm { log: log.clone() },
                move |req: tonic::Request<()>| {
                    let authorization = req.metadata().get("authorization").map(|v| v.as_bytes());
                    if token_guard.admits(authorization) {
                        Ok(req)
                    } else {
                        Err(tonic::Status::unauthenticated(
                            "the gateway's bearer token is missing or wrong",
                        ))
                    }
                },
            );
        let mut server = tonic::transport::Server::builder();
        if let Some(tls) = &guard.tls {
            server = server.tls_config(
                tonic::transport::ServerTlsConfig::new()
                    .identity(tonic::transport::Identity::from_pem(&tls.cert, &tls.key))
                    .client_ca_root(tonic::transport::Certificate::from_pem(&tls.client_ca)),
            )?;
        }
        let grpc = tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(llm_listener);
            if let Err(e) = server
                .add_service(llm_service)
                .serve_with_incoming(incoming)
                .await
            {
                tracing::error!(error = %e, "fake LLM stopped");
            }
        });
        let http = tokio::spawn(serve_credit(
            credit.clone(),
            credit_listener,
            guard,
            acceptor,
        ));
        Ok(Self {
            llm_addr,
            credit_addr,
            credit,
            log,
            tasks: vec![grpc, http],
        })
    }

    /// Every call either service received, in arrival order.
    pub fn calls(&self) -> Vec<Call> {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn stop(self) {
        for t in self.tasks {
            t.abort();
        }
    }
}
