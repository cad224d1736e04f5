//! A mock API server for the operator's tests, after the `ApiServerVerifier` of kube-rs/controller-rs:
//! the code under test runs on a task with a `kube::Client` whose transport is a `tower_test` mock,
//! and the test answers each request in turn after asserting what it is.

use http::{Request, Response};
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;
use tokio::task::JoinHandle;

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;
type Reply = tower_test::mock::SendResponse<Response<Body>>;

/// Generous: only a bug makes the operator go silent, and then the test should fail, not hang.
const PATIENCE: Duration = Duration::from_secs(60);

pub(crate) struct ApiServer {
    handle: Handle,
    /// ControllerRevisions the operator created: their requests are answered here, so that a
    /// test's script of requests is the pool's and the status's, as before rollouts.
    revisions: Vec<Value>,
    /// Answer every ControllerRevision request 500, as an API server that fails them would.
    pub(crate) fail_revisions: bool,
}

/// One request the operator made.
pub(crate) struct Call {
    pub method: String,
    pub path: String,
    pub query: HashMap<String, String>,
    pub content_type: String,
    pub body: Value,
    reply: Option<Reply>,
}

impl std::fmt::Debug for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} {:?} {}",
            self.method, self.path, self.query, self.body
        )
    }
}

impl Call {
    /// Asserts method and path.
    pub(crate) fn is(&self, method: &str, path: &str) -> &Self {
        assert_eq!(
            (self.method.as_str(), self.path.as_str()),
            (method, path),
            "unexpected request {self:?}"
        );
        self
    }

    pub(crate) fn query(&self, key: &str) -> Option<&str> {
        self.query.get(key).map(String::as_str)
    }

    /// Answers with `status` and a JSON body.
    pub(crate) fn reply(mut self, status: u16, body: Value) {
        let reply = self.reply.take().expect("answered once");
        reply.send_response(
            Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(Body::from(serde_json::to_vec(&body).unwrap()))
                .unwrap(),
        );
    }

    /// Answers 200 with the request's own body, as an API server echoes what it stored.
    pub(crate) fn echo(self) {
        let body = self.body.clone();
        self.reply(200, body);
    }
}

pub(crate) fn status_error(code: u16, reason: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
           "message": format!("{reason} (mock)"), "reason": reason, "code": code})
}

pub(crate) fn mock_client() -> (Client, ApiServer) {
    let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (
        Client::new(svc, "default"),
        ApiServer {
            handle,
            revisions: Vec::new(),
            fail_revisions: false,
        },
    )
}

impl ApiServer {
    /// The next request, or a panic if none comes.
    pub(crate) async fn next(&mut self) -> Call {
        self.try_next().await.expect("the client is gone")
    }

    /// The next request, or `None` once every client is dropped. Requests about ControllerRevisions
    /// (a chain's revisions: listed, created, pruned) are answered on the way, from a store of
    /// their own.
    pub(crate) async fn try_next(&mut self) -> Option<Call> {
        loop {
            let call = self.try_next_any().await?;
            if !call.path.contains("/controllerrevisions") {
                return Some(call);
            }
            self.answer_revision(call);
        }
    }

    fn answer_revision(&mut self, call: Call) {
        if self.fail_revisions {
            return call.reply(500, status_error(500, "InternalError"));
        }
        match call.method.as_str() {
            "GET" => {
                let selector = call.query("labelSelector").unwrap_or_default().to_string();
                let items: Vec<Value> = self
                    .revisions
                    .iter()
                    .filter(|r| {
                        selector.split(',').all(|kv| match kv.split_once('=') {
                            Some((k, v)) => r["metadata"]["labels"][k] == v,
                            None => true,
                        })
                    })
                    .cloned()
                    .collect();
                call.reply(
                    200,
                    json!({"kind": "ControllerRevisionList", "apiVersion": "apps/v1", "metadata": {}, "items": items}),
                );
            }
            "POST" => {
                self.revisions.push(call.body.clone());
                let body = call.body.clone();
                call.reply(201, body);
            }
            "DELETE" => {
                let name = call.path.rsplit('/').next().unwrap_or_default().to_string();
                self.revisions
                    .retain(|r| r["metadata"]["name"] != name.as_str());
                call.reply(200, status_error(200, "Success"));
            }
            _ => panic!("unexpected request {call:?}"),
        }
    }

    async fn try_next_any(&mut self) -> Option<Call> {
        let (req, reply) = tokio::time::timeout(PATIENCE, self.handle.next_request())
            .await
            .expect("the operator made no further request")?;
        let (parts, body) = req.into_parts();
        let bytes = body.collect_bytes().await.unwrap();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .or_else(|_| serde_saphyr::from_slice(&bytes))
                .unwrap_or_else(|e| panic!("request body is neither JSON nor YAML: {e}"))
        };
        let query = parts
            .uri
            .query()
            .unwrap_or_default()
            .split('&')
            .filter(|kv| !kv.is_empty())
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                (
                    k.to_string(),
                    v.replace("%2F", "/")
                        .replace("%3D", "=")
                        .replace("%2C", ","),
                )
            })
            .collect();
        Some(Call {
            method: parts.method.to_string(),
            path: parts.uri.path().to_string(),
            query,
            content_type: parts
                .headers
                .get("content-type")
                .map(|v| v.to_str().unwrap_or_default().to_string())
                .unwrap_or_default(),
            body,
            reply: Some(reply),
        })
    }

    /// Waits for the task to end, failing on any request it makes meanwhile.
    pub(crate) async fn finish<T>(&mut self, task: JoinHandle<T>) -> T {
        let mut task = task;
        tokio::select! {
            biased;
            done = &mut task => done.expect("the task panicked"),
            req = self.handle.next_request() => match req {
                Some((req, _)) => panic!("unexpected request {} {}", req.method(), req.uri()),
                // The task dropped its client on the way out.
                None => task.await.expect("the task panicked"),
            }
        }
    }
}

/// Runs `f` on its own task.
pub(crate) fn spawn<F: Future + Send + 'static>(f: F) -> JoinHandle<F::Output>
where
    F::Output: Send + 'static,
{
    tokio::spawn(f)
}
