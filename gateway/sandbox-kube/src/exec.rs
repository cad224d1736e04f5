//! Reaching the supervisor in a claimed pod through the exec API (websocket, `v5.channel.k8s.io`
//! with a fallback to v4, `tty=false`). The exec runs the attach relay, which hands the exec's own
//! pipes to the pod's waiting supervisor: requests go to stdin, the protocol comes back on stderr,
//! and stdout (empty unless something goes wrong) is counted and discarded here.
//!
//! The websocket is driven here rather than through kube's `AttachedProcess`, for its heartbeat:
//! every `Keepalive::every` a websocket ping goes out, which the API server answers with a pong
//! (as kubectl's own exec heartbeat expects). A ping left unanswered for `Keepalive::deadline`
//! means the connection is half-open or stalled (the API server's node gone without a FIN or RST,
//! a proxy that stopped relaying): nothing would ever arrive on it, and no TCP keepalive tells
//! while the peer's kernel still acknowledges. The connection is then dropped and the protocol
//! stream fails with that reason, so a run in the middle of a walk learns at once that the
//! connection to its sandbox was lost (and the pool retires and replaces it) instead of waiting
//! for its deadline, and a held pod's loss is noticed while it waits.

use crate::labels;
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use kube::api::AttachParams;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::io::{
    AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf, ReadHalf, SimplexStream, WriteHalf,
};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;

/// Buffers between the websocket and the supervisor conversation: large enough that a protocol line
/// of a big payload does not crawl through a small pipe.
const BUFFER: usize = 256 << 10;

/// The exec protocol's channels (the first byte of every binary frame).
const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const STATUS: u8 = 3;
/// v5 only: "this channel is done" (followed by the channel), how stdin's end is told.
const CLOSE: u8 = 255;

/// How the exec connection proves it is alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keepalive {
    /// A websocket ping goes out this often.
    pub every: Duration,
    /// A ping unanswered this long (or a frame that cannot be sent in this time) ends the
    /// connection as lost.
    pub deadline: Duration,
}

/// Heartbeat timings that cannot work.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeepaliveError {
    #[error("the exec ping interval must be more than 0")]
    NoInterval,
    #[error(
        "the exec ping deadline ({deadline:?}) is shorter than the interval between pings ({every:?}): every connection would be taken for lost"
    )]
    DeadlineBeforePing { every: Duration, deadline: Duration },
}

impl Keepalive {
    /// A ping every `every`, the connection lost when one is unanswered for `deadline`.
    pub fn new(every: Duration, deadline: Duration) -> Result<Self, KeepaliveError> {
        if every.is_zero() {
            return Err(KeepaliveError::NoInterval);
        }
        if deadline < every {
            return Err(KeepaliveError::DeadlineBeforePing { every, deadline });
        }
        Ok(Self { every, deadline })
    }
}

impl Default for Keepalive {
    /// kubectl's exec pings every 5 s; a deadline of a few pings rides out a busy API server.
    fn default() -> Self {
        Self {
            every: Duration::from_secs(5),
            deadline: Duration::from_secs(15),
        }
    }
}

pub(crate) struct Exec {
    pub stdin: WriteHalf<SimplexStream>,
    pub protocol: Protocol,
    pub stdout_bytes: Arc<AtomicU64>,
    pub connection: Connection,
}

/// The exec's websocket, driven by a task of its own. Dropping it (or `close`) ends the
/// connection at once, on purpose: that is not reported as a loss.
pub(crate) struct Connection {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Connection {
    pub(crate) fn close(&mut self) {
        self.stop.take();
    }
}

/// The supervisor's protocol (the exec's stderr) as the engine reads it: what arrived, then the
/// end; when the connection was lost rather than ended, an error that says why.
pub(crate) struct Protocol {
    pipe: ReadHalf<SimplexStream>,
    lost: Arc<Mutex<Option<String>>>,
}

impl AsyncRead for Protocol {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        ready!(Pin::new(&mut self.pipe).poll_read(cx, buf))?;
        if buf.filled().len() == before && buf.remaining() > 0 {
            let lost = self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some(why) = lost {
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionAborted, why)));
            }
        }
        Poll::Ready(Ok(()))
    }
}

/// Why the connection ended.
enum Ended {
    /// The command's exit status arrived: None on Success, else what it said.
    Exited(Option<String>),
    /// Our side stopped it.
    Stopped,
    /// It broke or went silent: the connection to the sandbox is lost.
    Lost(String),
}

/// Why the exec into a claimed pod did not open.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExecError {
    #[error("cannot make the exec request: {0}")]
    Request(#[from] kube::core::request::Error),
    #[error(transparent)]
    Connect(#[from] kube::Error),
    /// The API server did not answer in time (the client would retry a 429 or 503 for minutes).
    #[error("the exec did not open within {} ms", .0.as_millis())]
    Timeout(Duration),
}

/// Attaches to the supervisor waiting in `pod` and starts driving the connection.
pub(crate) async fn start(
    client: &kube::Client,
    namespace: &str,
    pod: &str,
    keepalive: Keepalive,
) -> Result<Exec, ExecError> {
    let params = AttachParams::default()
        .container(labels::CONTAINER)
        .stdin(true)
        .stdout(true)
        .stderr(true)
        .tty(false);
    let request = kube::core::Request::new(format!("/api/v1/namespaces/{namespace}/pods")).exec(
        pod,
        labels::attach_command(),
        &params,
    )?;
    let connection = client.connect(request).await?;
    let v5 = connection.supports_stream_close();
    let (stdin_reader, stdin) = tokio::io::simplex(BUFFER);
    let (protocol, stderr) = tokio::io::simplex(BUFFER);
    let stdout_bytes = Arc::new(AtomicU64::new(0));
    let lost = Arc::new(Mutex::new(None));
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let drive = Drive {
        key: format!("{namespace}/{pod}"),
        stdin: stdin_reader,
        stderr,
        stdout_bytes: stdout_bytes.clone(),
        lost: lost.clone(),
        v5,
        keepalive,
    };
    tokio::spawn(drive.run(connection.into_stream(), stopped));
    Ok(Exec {
        stdin,
        protocol: Protocol {
            pipe: protocol,
            lost,
        },
        stdout_bytes,
        connection: Connection { stop: Some(stop) },
    })
}

/// What the connection's task moves between the websocket and the conversation.
struct Drive {
    /// The pod, as "namespace/name".
    key: String,
    stdin: ReadHalf<SimplexStream>,
    stderr: WriteHalf<SimplexStream>,
    stdout_bytes: Arc<AtomicU64>,
    /// Why the connection was lost, told to the protocol's reader before its end.
    lost: Arc<Mutex<Option<String>>>,
    v5: bool,
    keepalive: Keepalive,
}

impl Drive {
    async fn run<S>(mut self, ws: S, mut stopped: tokio::sync::oneshot::Receiver<()>)
    where
        S: futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>>
            + futures::Sink<Message, Error = tokio_tungstenite::tungstenite::Error>
            + Unpin,
    {
        let key = self.key.clone();
        match self.pump(ws, &mut stopped).await {
            Ended::Exited(Some(status)) => {
                tracing::warn!(pod = %key, %status, "supervisor exited with an error")
            }
            Ended::Exited(None) | Ended::Stopped => {}
            Ended::Lost(why) => {
                tracing::warn!(pod = %key, %why, "the exec connection to the sandbox was lost");
                // Before the end below, so the reader that meets the end knows why.
                *self.lost.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(format!("pod {key}: {why}"));
            }
        }
        // Whatever arrived is in the pipe; the conversation reads it, then the end.
        let _ = self.stderr.shutdown().await;
    }

    async fn pump<S>(
        &mut self,
        mut ws: S,
        stopped: &mut tokio::sync::oneshot::Receiver<()>,
    ) -> Ended
    where
        S: futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>>
            + futures::Sink<Message, Error = tokio_tungstenite::tungstenite::Error>
            + Unpin,
    {
        let Keepalive { every, deadline } = self.keepalive;
        let mut chunk = vec![0u8; 64 << 10];
        let mut stdin_open = true;
        let mut next_ping = Instant::now() + every;
        // The oldest ping not answered yet: a pong answers every ping sent before it.
        let mut unanswered: Option<Instant> = None;
        loop {
            let silent_by = unanswered.map(|t| t + deadline);
            let wake = silent_by.map_or(next_ping, |s| s.min(next_ping));
            let out = tokio::select! {
                _ = &mut *stopped => return Ended::Stopped,
                _ = tokio::time::sleep_until(wake) => {
                    if silent_by.is_some_and(|s| Instant::now() >= s) {
                        return Ended::Lost(format!(
                            "no answer to a keepalive ping in {} ms (a half-open or stalled connection)",
                            deadline.as_millis()
                        ));
                    }
                    next_ping = Instant::now() + every;
                    unanswered.get_or_insert_with(Instant::now);
                    Message::Ping(Bytes::new())
                }
                message = ws.next() => match message {
                    Some(Ok(Message::Binary(frame))) => match frame.first() {
                        Some(&STDOUT) => {
                            self.stdout_bytes.fetch_add(frame.len() as u64 - 1, Ordering::Relaxed);
                            continue;
                        }
                        Some(&STDERR) => {
                            // Waits while the conversation is behind (its pipe full), but not
                            // past being stopped.
                            tokio::select! {
                                written = self.stderr.write_all(&frame[1..]) => {
                                    if written.is_err() {
                                        return Ended::Stopped;
                                    }
                                }
                                _ = &mut *stopped => return Ended::Stopped,
                            }
                            continue;
                        }
                        Some(&STATUS) => return Ended::Exited(failure_of(&frame[1..])),
                        _ => continue,
                    },
                    Some(Ok(Message::Pong(_))) => {
                        unanswered = None;
                        continue;
                    }
                    Some(Ok(Message::Close(_))) | None => {
                        return Ended::Lost("it closed without the command's exit status".into());
                    }
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => return Ended::Lost(e.to_string()),
                },
                read = self.stdin.read(&mut chunk), if stdin_open => match read {
                    Ok(n) if n > 0 => {
                        let mut frame = Vec::with_capacity(n + 1);
                        frame.push(STDIN);
                        frame.extend_from_slice(&chunk[..n]);
                        Message::binary(frame)
                    }
                    _ => {
                        stdin_open = false;
                        if !self.v5 {
                            // v4 has no way to end stdin alone: the whole connection ends.
                            let _ = ws.close().await;
                            return Ended::Exited(None);
                        }
                        Message::binary(vec![CLOSE, STDIN])
                    }
                },
            };
            // A frame that cannot be handed to the connection within the deadline is a stalled
            // connection as surely as a missing pong.
            match tokio::time::timeout(deadline, ws.send(out)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Ended::Lost(e.to_string()),
                Err(_) => {
                    return Ended::Lost(format!(
                        "nothing could be sent for {} ms (a stalled connection)",
                        deadline.as_millis()
                    ));
                }
            }
        }
    }
}

/// The exit `Status` the API server sends on channel 3: None on Success, else what it says.
fn failure_of(status: &[u8]) -> Option<String> {
    let status: serde_json::Value = serde_json::from_slice(status).ok()?;
    if status["status"] == "Success" {
        return None;
    }
    Some(format!(
        "{} ({})",
        status["message"].as_str().unwrap_or("no message"),
        status["reason"].as_str().unwrap_or("no reason")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_timings_that_cannot_work_are_refused() {
        let s = Duration::from_secs;
        assert_eq!(Keepalive::new(s(5), s(15)), Ok(Keepalive::default()));
        assert_eq!(Keepalive::new(s(0), s(15)), Err(KeepaliveError::NoInterval));
        let late = Keepalive::new(s(10), s(5)).unwrap_err();
        assert_eq!(
            late,
            KeepaliveError::DeadlineBeforePing {
                every: s(10),
                deadline: s(5)
            }
        );
        assert!(
            late.to_string().contains("shorter than the interval"),
            "{late}"
        );
        assert!(
            Keepalive::new(s(5), s(5)).is_ok(),
            "one ping's worth is enough"
        );
    }
}
