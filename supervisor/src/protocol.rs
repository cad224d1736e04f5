//! The wire: newline-delimited JSON, requests on one descriptor, answers on another
//! (`supervisor/PROTOCOL.md`).

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};

use serde_json::Value;

/// The longest request line read (a chunk carries at most the payload, the state vector and the
/// context, each bounded by the gateway well below this).
const MAX_LINE_BYTES: usize = 64 << 20;

pub(crate) struct Channel {
    reader: BufReader<File>,
    writer: BufWriter<File>,
}

/// What `receive` found.
pub(crate) enum Incoming {
    Message(Value),
    /// A line that is not a JSON object: answered with an `error`, the loop goes on.
    Malformed(String),
    /// The gateway closed the stream.
    Closed,
}

impl Channel {
    pub(crate) fn new(reader: File, writer: File) -> Self {
        Self {
            reader: BufReader::with_capacity(64 << 10, reader),
            writer: BufWriter::with_capacity(64 << 10, writer),
        }
    }

    /// Queues one message; `flush` sends what is queued. Every write is a system call inside gVisor
    /// (tens of microseconds), so answers go out in as few writes as keep the protocol's promises.
    pub(crate) fn queue(&mut self, msg: &Value) -> io::Result<()> {
        serde_json::to_writer(&mut self.writer, msg)?;
        self.writer.write_all(b"\n")
    }

    pub(crate) fn send(&mut self, msg: &Value) -> io::Result<()> {
        self.queue(msg)?;
        self.flush()
    }

    pub(crate) fn flush(&mut self) -> io::Result<()> {
        self.writer.flush()
    }

    pub(crate) fn receive(&mut self) -> io::Result<Incoming> {
        let mut line = Vec::new();
        let read = (&mut self.reader)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut line)?;
        if read == 0 {
            return Ok(Incoming::Closed);
        }
        if line.len() > MAX_LINE_BYTES {
            // The rest of an oversized line is unreadable in step: nothing after it can be trusted.
            return Ok(Incoming::Closed);
        }
        Ok(match serde_json::from_slice::<Value>(&line) {
            Ok(value @ Value::Object(_)) => Incoming::Message(value),
            Ok(_) => Incoming::Malformed("a request must be a JSON object".into()),
            Err(e) => Incoming::Malformed(format!("malformed request: {e}")),
        })
    }
}
