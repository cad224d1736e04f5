//! `pods/{name}/exec` over websocket with the Kubernetes channel protocol: every binary message starts
//! with its channel byte (0 stdin, 1 stdout, 2 stderr, 3 error/status); v5 adds 255 = CLOSE, whose
//! next byte names the channel the client finished writing. With v4 a client can only end stdin by
//! closing the whole websocket. The exit `Status` goes on channel 3 before the server closes.

use crate::store::{Resource, Route};
use crate::{Body, ExecProtocol, Shared, status};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Empty};
use hyper::{Request, Response, StatusCode};
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;

const V5: &str = "v5.channel.k8s.io";
const V4: &str = "v4.channel.k8s.io";
const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const STATUS: u8 = 3;
const CLOSE: u8 = 255;

/// The commands the contract allows into a sandbox pod: the gateway's attach relay and the readiness
/// probe. Anything else is refused, so a gateway that drifts from the contract fails here.
fn command_ok(command: &[String]) -> bool {
    command == sluice_crds::sandbox_pod::attach_command()
        || command == sluice_crds::sandbox_pod::probe_command()
}

pub(crate) async fn upgrade(
    shared: Arc<Shared>,
    route: Route,
    params: HashMap<String, String>,
    req: Request<hyper::body::Incoming>,
) -> Response<Body> {
    let ns = route.namespace.clone().unwrap_or_default();
    let name = route.name.clone().unwrap_or_default();
    if shared.store.get(Resource::Pods, &ns, &name).is_none() {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("pods \"{name}\" not found"),
        );
    }
    if params.get("container").map(String::as_str) != Some("supervisor") {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            &format!(
                "container {:?} is not valid for pod {name}",
                params.get("container")
            ),
        );
    }
    for stream in ["stdin", "stdout", "stderr"] {
        if params.get(stream).map(String::as_str) != Some("true") {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!("the gateway must attach {stream}"),
            );
        }
    }
    if params.get("tty").is_some_and(|t| t == "true") {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "tty must be false");
    }
    let command: Vec<String> = params
        .get("command")
        .map(|c| c.split('\0').map(str::to_string).collect())
        .unwrap_or_default();
    let Some(key) = req.headers().get("sec-websocket-key").cloned() else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "exec needs a websocket upgrade",
        );
    };
    let offered: Vec<String> = req
        .headers()
        .get("sec-websocket-protocol")
        .and_then(|h| h.to_str().ok())
        .map(|h| h.split(',').map(|p| p.trim().to_string()).collect())
        .unwrap_or_default();
    let chosen = if shared.protocol == ExecProtocol::V5 && offered.iter().any(|p| p == V5) {
        V5
    } else if offered.iter().any(|p| p == V4) {
        V4
    } else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "no supported channel protocol offered",
        );
    };
    let accept = derive_accept_key(key.as_bytes());
    let tracker = shared.clone();
    let bridge_task = tokio::spawn(async move {
        match hyper::upgrade::on(req).await {
            Ok(upgraded) => {
                let ws = WebSocketStream::from_raw_socket(
                    hyper_util::rt::TokioIo::new(upgraded),
                    Role::Server,
                    None,
                )
                .await;
                bridge(shared, ws, &ns, &name, &command, chosen == V5).await;
            }
            Err(e) => tracing::warn!(error = %e, "exec upgrade failed"),
        }
    });
    tracker.track(bridge_task.abort_handle());
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header("upgrade", "websocket")
        .header("connection", "Upgrade")
        .header("sec-websocket-accept", accept)
        .header("sec-websocket-protocol", chosen)
        .body(Empty::<Bytes>::new().boxed())
        .unwrap_or_else(|_| Response::new(Empty::new().boxed()))
}

fn frame(channel: u8, data: &[u8]) -> Message {
    let mut v = Vec::with_capacity(data.len() + 1);
    v.push(channel);
    v.extend_from_slice(data);
    Message::binary(v)
}

/// The exit `Status` the API server sends on channel 3: Success, or the exit code as the kubelet
/// reports it.
fn exit_status(code: Option<i32>, command: &[String], why: &str) -> Message {
    let status = match code {
        Some(0) => json!({"metadata": {}, "status": "Success"}),
        Some(code) => json!({
            "metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
            "message": format!("command terminated with non-zero exit code: error executing command {command:?}, exit code {code}"),
            "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
        }),
        None => json!({
            "metadata": {}, "status": "Failure", "reason": "InternalError",
            "message": format!("error executing command {command:?}: {why}"),
        }),
    };
    frame(STATUS, status.to_string().as_bytes())
}

async fn bridge<S>(
    shared: Arc<Shared>,
    ws: WebSocketStream<S>,
    ns: &str,
    name: &str,
    command: &[String],
    v5: bool,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sink, mut source) = ws.split();
    let (out, mut out_rx) = tokio::sync::mpsc::channel::<Message>(64);
    let (silenced, pod) = (shared.clone(), format!("{ns}/{name}"));
    let writer = tokio::spawn(async move {
        while let Some(m) = out_rx.recv().await {
            if silenced.is_half_open(&pod) {
                // Nothing more reaches the client, and the connection is never closed.
                std::future::pending::<()>().await;
            }
            if sink.send(m).await.is_err() {
                return;
            }
        }
        let _ = sink.close().await;
    });
    shared.track(writer.abort_handle());
    // The API server announces the channels with one empty frame each.
    for ch in [STDOUT, STDERR] {
        let _ = out.send(frame(ch, &[])).await;
    }
    let started = if command_ok(command) {
        shared.exec(ns, name, command).await
    } else {
        Err(format!(
            "command {command:?} is not a command of the sandbox pod contract"
        ))
    };
    let mut child = match started {
        Ok(child) => child,
        Err(why) => {
            let _ = out.send(exit_status(None, command, &why)).await;
            drop(out);
            let _ = writer.await;
            return;
        }
    };
    let (Some(stdin), Some(stdout), Some(stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        let _ = out
            .send(exit_status(None, command, "started without pipes"))
            .await;
        return;
    };
    let (seen_by, key) = (shared.clone(), format!("{ns}/{name}"));
    let reader = tokio::spawn(async move {
        let mut stdin = Some(stdin);
        while let Some(msg) = source.next().await {
            if seen_by.is_half_open(&key) {
                // Nothing the client sends arrives any more (not even its pings' pongs go back).
                std::future::pending::<()>().await;
            }
            match msg {
                Ok(Message::Binary(b)) if !b.is_empty() => match b[0] {
                    STDIN => {
                        seen_by
                            .stdin_seen
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .entry(key.clone())
                            .or_default()
                            .extend_from_slice(&b[1..]);
                        if let Some(w) = stdin.as_mut()
                            && (w.write_all(&b[1..]).await.is_err() || w.flush().await.is_err())
                        {
                            stdin = None;
                        }
                    }
                    CLOSE if v5 && b.get(1) == Some(&STDIN) => {
                        if let Some(mut w) = stdin.take() {
                            let _ = w.shutdown().await;
                        }
                    }
                    _ => {}
                },
                Ok(Message::Close(_)) | Err(_) => break,
                Ok(_) => {}
            }
        }
        // The client went away (v4's only way to end stdin): the process sees EOF.
        if let Some(mut w) = stdin.take() {
            let _ = w.shutdown().await;
        }
    });
    let pump = |mut r: Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                channel: u8,
                out: tokio::sync::mpsc::Sender<Message>| async move {
        let mut buf = vec![0u8; 32 << 10];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if out.send(frame(channel, &buf[..n])).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    shared.track(reader.abort_handle());
    let o = tokio::spawn(pump(Box::new(stdout), STDOUT, out.clone()));
    let e = tokio::spawn(pump(Box::new(stderr), STDERR, out.clone()));
    shared.track(o.abort_handle());
    shared.track(e.abort_handle());
    let _ = tokio::join!(o, e);
    // Both outputs ended: the process exited (or its sandbox died under it).
    let code = match child.wait().await {
        Ok(s) => Some(s.code().unwrap_or(137)),
        Err(_) => None,
    };
    let _ = out
        .send(exit_status(code, command, "the process was lost"))
        .await;
    drop(out);
    let _ = writer.await;
    reader.abort();
}
