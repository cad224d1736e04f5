//! A sandbox backend that wraps another and makes each of its sandboxes die right after the hook
//! named `last_words` answered: the protocol stream ends after that hook's `hook_result`, as a
//! sandbox killed there looks to the gateway (which then destroys it). Under `failurePolicy: Open`
//! the walk resumes after that hook in a fresh sandbox.

use async_trait::async_trait;
use serde_json::Value;
use sluice_engine::{Sandbox, SandboxBackend, SandboxSpec, StartError};
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

pub(crate) struct DyingBackend {
    inner: Arc<dyn SandboxBackend>,
    last_words: String,
}

impl DyingBackend {
    pub(crate) fn new(inner: Arc<dyn SandboxBackend>, last_words: &str) -> Self {
        Self {
            inner,
            last_words: last_words.into(),
        }
    }
}

#[async_trait]
impl SandboxBackend for DyingBackend {
    async fn start(&self, spec: &SandboxSpec) -> Result<Sandbox, StartError> {
        let mut sandbox = self.inner.start(spec).await?;
        let (mut relayed, protocol) = tokio::io::duplex(1 << 20);
        let mut lines =
            BufReader::new(std::mem::replace(&mut sandbox.protocol, Box::pin(protocol)));
        let last_words = self.last_words.clone();
        tokio::spawn(async move {
            let mut line = Vec::new();
            loop {
                line.clear();
                match lines.read_until(b'\n', &mut line).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                if relayed.write_all(&line).await.is_err() {
                    return;
                }
                let msg: Value = serde_json::from_slice(&line).unwrap_or_default();
                if msg["type"] == "hook_result" && msg["name"] == last_words.as_str() {
                    // Dropping `relayed` ends the stream: the sandbox is dead to the gateway.
                    return;
                }
            }
        });
        Ok(sandbox)
    }

    async fn clean_leftovers(&self) -> usize {
        self.inner.clean_leftovers().await
    }

    async fn live(&self) -> Vec<String> {
        self.inner.live().await
    }
}
