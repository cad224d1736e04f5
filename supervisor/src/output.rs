//! What a hook writes to its stdout and stderr (`print()`, `sys.stderr`, `os.write(1, ...)`): kept in
//! memory, per instance, to its last `OUTPUT_BYTES` bytes. An instance has no host descriptor at all,
//! so nothing a hook writes can reach the protocol on the supervisor's stderr, and a hook that prints
//! without end costs a bounded buffer, never the sandbox's memory.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// The bytes of output a hook's result carries: the end of what it wrote, where the error usually is.
pub(crate) const OUTPUT_BYTES: usize = 4096;

/// One instance's stdout and stderr, interleaved as written.
#[derive(Clone, Default)]
pub(crate) struct Output(Arc<Mutex<Tail>>);

#[derive(Default)]
struct Tail {
    kept: VecDeque<u8>,
    written: u64,
}

impl Output {
    fn push(&self, bytes: &[u8]) {
        let mut tail = self.0.lock().unwrap_or_else(|e| e.into_inner());
        tail.written += bytes.len() as u64;
        let bytes = &bytes[bytes.len().saturating_sub(OUTPUT_BYTES)..];
        let overflow = (tail.kept.len() + bytes.len()).saturating_sub(OUTPUT_BYTES);
        tail.kept.drain(..overflow);
        tail.kept.extend(bytes);
    }

    /// What the hook wrote, as text (invalid UTF-8 replaced), headed by how much was dropped when it
    /// wrote more than the bound; None when it wrote nothing.
    pub(crate) fn text(&self) -> Option<String> {
        let tail = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if tail.written == 0 {
            return None;
        }
        let (a, b) = tail.kept.as_slices();
        let kept = String::from_utf8_lossy(&[a, b].concat()).into_owned();
        let dropped = tail.written - tail.kept.len() as u64;
        Some(if dropped > 0 {
            format!("[{dropped} earlier bytes of output dropped]\n{kept}")
        } else {
            kept
        })
    }
}

impl IsTerminal for Output {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for Output {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }

    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
}

#[async_trait::async_trait]
impl Pollable for Output {
    async fn ready(&mut self) {}
}

impl OutputStream for Output {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        // Always room: the tail drops the oldest bytes instead of refusing new ones.
        Ok(64 * 1024)
    }
}

impl tokio::io::AsyncWrite for Output {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_bytes_and_says_how_many_were_dropped() {
        let out = Output::default();
        assert_eq!(out.text(), None);
        out.push(b"hello ");
        out.push(b"world");
        assert_eq!(out.text().as_deref(), Some("hello world"));
        let big = vec![b'x'; OUTPUT_BYTES * 3];
        out.push(&big);
        out.push(b"END");
        let text = out.text().unwrap();
        let dropped = 11 + OUTPUT_BYTES * 3 + 3 - OUTPUT_BYTES;
        assert!(
            text.starts_with(&format!("[{dropped} earlier bytes of output dropped]\n")),
            "{text}"
        );
        assert!(text.ends_with("xxEND"));
        assert_eq!(text.lines().nth(1).unwrap().len(), OUTPUT_BYTES);
    }
}
