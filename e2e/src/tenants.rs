//! Two tenants on one gateway, one of them hostile, behind one platform baseline: what the load test
//! (`e2e/tests/e2e/local_tenants.rs`) asserts on and `make bench` measures. The hostile tenant's chain
//! sleeps in its module code (every boot is slow), sleeps in its hook, prints megabytes, and half of
//! its clients disconnect mid-run; `reuse: None` makes each of its runs boot a sandbox.

use crate::chain_yaml;
use sluice_proto::{self as proto, gateway_client::GatewayClient};
use std::time::Duration;
use tonic::transport::Channel;

pub const HONEST_NS: &str = "default";
pub const HOSTILE_NS: &str = "hostile";
pub const TARGET: &str = "bot";
pub const HONEST_TEXT: &str = "call me at 010-1234-5678 about the secret";

const REDACT_PHONE: &str = "import re\nP = re.compile(r'\\b\\d{3}-\\d{4}-\\d{4}\\b')\ndef execute(context, settings):\n    t = P.sub('[phone]', context['outgoing'])\n    return {'action': 'modify', 'outgoing': t} if t != context['outgoing'] else {'action': 'pass'}\n";
const BASELINE: &str = "def execute(context, settings):\n    t = context['outgoing'].replace('secret', '[x]')\n    return {'action': 'modify', 'outgoing': t} if t != context['outgoing'] else {'action': 'pass'}\n";
const HOSTILE: &str = "import sys, time\ntime.sleep(2)\ndef execute(context, settings):\n    sys.stdout.write('x' * (2 << 20))\n    sys.stdout.flush()\n    time.sleep(1)\n    return {'action': 'pass'}\n";

/// The chain files: the baseline, the honest tenant's chain, and, with `hostile`, the other one.
pub fn files(hostile: bool) -> Vec<(&'static str, String)> {
    let baseline = chain_yaml(
        "baseline",
        "\"*\"",
        "input",
        "enforced: true\npool: {warm: 2, max: 6}",
        &[("secret", "modify", BASELINE)],
    )
    .replace("namespace: default", "namespace: sluice-system");
    let honest = chain_yaml(
        "honest",
        TARGET,
        "input",
        "pool: {warm: 2, max: 6, reuse: Recycle}",
        &[("redact-phone", "modify", REDACT_PHONE)],
    );
    let mut files = vec![("baseline.yaml", baseline), ("honest.yaml", honest)];
    if hostile {
        let chain = chain_yaml(
            "noisy",
            TARGET,
            "input",
            "timeoutMs: 5000\npool: {warm: 1, max: 4, reuse: None}",
            &[("slow", "detect", HOSTILE)],
        )
        .replace("namespace: default", &format!("namespace: {HOSTILE_NS}"));
        files.push(("hostile.yaml", chain));
    }
    files
}

fn request(namespace: &str, text: &str) -> proto::RunRequest {
    proto::RunRequest {
        namespace: namespace.into(),
        target: TARGET.into(),
        trigger_point: "input".into(),
        payload: Some(proto::run_request::Payload::Text(text.into())),
        session_id: format!("{namespace}-session"),
        ..Default::default()
    }
}

/// One run of the honest tenant; Err says what was wrong with it.
pub async fn honest_run(client: &GatewayClient<Channel>) -> Result<(), String> {
    let r = client
        .clone()
        .run(request(HONEST_NS, HONEST_TEXT))
        .await
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    let text = match &r.payload {
        Some(proto::run_response::Payload::Text(t)) => t.as_str(),
        _ => "",
    };
    if text != "call me at [phone] about the [x]" || !r.hooks.iter().all(|h| h.error.is_empty()) {
        return Err(format!("unexpected answer: {r:?}"));
    }
    Ok(())
}

/// The hostile tenant's clients, `workers` at once, until `stop` turns true: every other run is
/// abandoned by its client shortly after it starts.
pub async fn hostile_load(
    client: GatewayClient<Channel>,
    workers: usize,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let each = (0..workers).map(|w| {
        let client = client.clone();
        let stop = stop.clone();
        async move {
            let mut i = 0u64;
            while !*stop.borrow() {
                i += 1;
                let mut client = client.clone();
                let run = client.run(request(HOSTILE_NS, "anything"));
                if (i + w as u64).is_multiple_of(2) {
                    // The client goes away mid-run.
                    let _ = tokio::time::timeout(Duration::from_millis(300), run).await;
                } else {
                    let _ = run.await;
                }
            }
        }
    });
    futures::future::join_all(each).await;
}
