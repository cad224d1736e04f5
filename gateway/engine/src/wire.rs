//! The supervisor's wire protocol (supervisor/PROTOCOL.md) as Rust types, and a bounded line reader.
//! Everything read here came out of a sandbox: it is parsed strictly and never trusted beyond its
//! shape; `outcome.rs` decides what it means.

use crate::moment::Moment;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use tokio::io::{AsyncBufRead, AsyncBufReadExt};

pub(crate) const PROTOCOL_VERSION: u32 = 3;

/// Messages the gateway sends on the supervisor's stdin.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum ToSupervisor<'a> {
    Init {
        trigger_point: &'a str,
        failure_policy: &'a str,
        /// The chain's `spec.timeoutMs`: the supervisor stops a hook at it (host-call time not
        /// counted) and reports it as that hook's error; the gateway's own deadline is a backstop.
        timeout_ms: u64,
        hooks: Vec<InitHook<'a>>,
        limits: &'a WireLimits,
    },
    Chunk {
        id: u64,
        start: usize,
        outgoing: &'a Value,
        state: &'a [Value],
        context: &'a Value,
        /// The run's moment: what every clock of its hooks reads, the same in every walk of the
        /// run, whichever sandbox serves it (`moment`).
        moment_ms: Moment,
    },
    HostResult {
        id: u64,
        ok: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        result: Option<Value>,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<String>,
        /// Set with `error`: how the call failed (`HostCallCode`), the hook's `HostCallError.code`.
        #[serde(skip_serializing_if = "Option::is_none")]
        code: Option<&'static str>,
    },
    /// Closes the open cell; answered by `ended`.
    End,
    /// A keepalive over an idle stream; answered by `pong`.
    Ping,
    Shutdown,
}

#[derive(Debug, Serialize)]
pub(crate) struct InitHook<'a> {
    pub name: &'a str,
    pub action: &'a str,
    pub settings: &'a Value,
    pub code: &'a str,
}

/// Bounds the supervisor applies to what hooks return (the gateway re-applies them).
#[derive(Clone, Debug, Serialize)]
pub struct WireLimits {
    pub payload_bytes: usize,
    pub state_bytes: usize,
    pub findings_bytes: usize,
    pub message_chars: usize,
    pub depth: usize,
    pub host_calls: u32,
}

/// Messages the supervisor writes on its protocol descriptor (the sandbox's stderr).
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum FromSupervisor {
    Ready {
        protocol: u32,
    },
    /// One entry per hook; a hook that failed to load is reported again, as that hook's error,
    /// when a walk reaches it, so only the count is read here.
    Ack {
        hooks: Vec<serde::de::IgnoredAny>,
    },
    HookResult(HookResult),
    HostCall {
        id: u64,
        hook: usize,
        name: String,
        #[serde(default)]
        payload: Value,
    },
    Result {
        id: u64,
        action: String,
        terminal_index: Option<usize>,
    },
    /// The cell is gone; `clean` says whether the sandbox may serve another trigger point.
    Ended {
        clean: bool,
        #[serde(default)]
        reason: Option<String>,
    },
    /// Answer to `ping`.
    Pong,
    Error {
        message: String,
    },
}

/// One hook's result as the supervisor reports it. `state` is `Some` only when the hook returned a
/// `state` key (`Some(Value::Null)` clears the slot).
#[derive(Clone, Debug, Deserialize)]
pub struct HookResult {
    pub id: u64,
    pub index: usize,
    pub name: String,
    pub action: String,
    #[serde(default, deserialize_with = "present")]
    pub outgoing: Option<Value>,
    #[serde(default)]
    pub message: Option<String>,
    #[serde(default, deserialize_with = "present")]
    pub findings: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    pub state: Option<Value>,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub latency_us: u64,
    /// The hook ran out of the walk's deadline: the hooks after it share a fresh one, on both sides.
    #[serde(default)]
    pub ran_out: bool,
    /// The end of what the hook wrote to stdout and stderr, when it wrote anything.
    #[serde(default)]
    pub output: Option<String>,
    /// Under `--trace-lines` (authoring tools): which lines of the hook's code ran.
    #[serde(default)]
    pub lines: Option<Box<Lines>>,
}

/// Which lines of a hook's code ran in one call, and which could have (code line numbers, from 1).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Lines {
    pub run: Vec<u32>,
    pub code: Vec<u32>,
}

/// A key that is present is `Some`, even when its value is `null`.
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error("the sandbox closed its protocol stream")]
    Eof,
    #[error("a protocol line was longer than {0} bytes")]
    TooLong(usize),
    #[error("reading the protocol stream failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("malformed protocol message ({error}): {snippet}")]
    Malformed { error: String, snippet: String },
}

/// Reads one newline-terminated JSON message, refusing lines over `max` bytes without buffering them.
pub(crate) async fn read_message<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> Result<FromSupervisor, ReadError> {
    buf.clear();
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            return Err(ReadError::Eof);
        }
        let (take, done) = match available.iter().position(|b| *b == b'\n') {
            Some(i) => (i + 1, true),
            None => (available.len(), false),
        };
        if buf.len() + take > max + 1 {
            return Err(ReadError::TooLong(max));
        }
        buf.extend_from_slice(&available[..take]);
        reader.consume(take);
        if done {
            break;
        }
    }
    serde_json::from_slice(buf).map_err(|e| ReadError::Malformed {
        error: e.to_string(),
        snippet: String::from_utf8_lossy(&buf[..buf.len().min(200)])
            .trim_end()
            .to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn reads_messages_and_bounds_lines() {
        let data = b"{\"type\":\"ready\",\"protocol\":1}\n{\"type\":\"ended\",\"clean\":false,\"reason\":\"x\"}\n{\"type\":\"hook_result\",\"id\":1,\"index\":0,\"name\":\"a\",\"action\":\"pass\",\"state\":null}\nnot json\n".to_vec();
        let mut r = tokio::io::BufReader::new(&data[..]);
        let mut buf = Vec::new();
        assert!(matches!(
            read_message(&mut r, &mut buf, 1024).await,
            Ok(FromSupervisor::Ready { protocol: 1 })
        ));
        assert!(matches!(
            read_message(&mut r, &mut buf, 1024).await,
            Ok(FromSupervisor::Ended { clean: false, reason: Some(r) }) if r == "x"
        ));
        match read_message(&mut r, &mut buf, 1024).await {
            Ok(FromSupervisor::HookResult(h)) => {
                assert_eq!(h.state, Some(Value::Null));
                assert_eq!(h.outgoing, None);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            read_message(&mut r, &mut buf, 1024).await,
            Err(ReadError::Malformed { .. })
        ));
        assert!(matches!(
            read_message(&mut r, &mut buf, 1024).await,
            Err(ReadError::Eof)
        ));

        let long = vec![b'x'; 5000];
        let mut r = tokio::io::BufReader::new(&long[..]);
        assert!(matches!(
            read_message(&mut r, &mut buf, 1024).await,
            Err(ReadError::TooLong(1024))
        ));
    }
}
