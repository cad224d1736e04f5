//! `sluice rollout status`: a local gateway's rollouts (`GET /rollouts` on its metrics port) read the
//! way `kubectl rollout status` reads a Deployment's: one line per change, waiting until the
//! candidate is live or rolled back.

use serde_json::Value;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How a watch ended, or what a look found.
#[derive(Debug, PartialEq, Eq)]
pub enum Settled {
    /// The newest hooks are live.
    RolledOut,
    /// The candidate was rolled back: the live hooks are the older ones.
    RolledBack,
    /// Still shadowing or in a canary (a look without `--watch`).
    InProgress,
}

/// The largest `/rollouts` answer read (every chain's status and history).
const MAX_ANSWER: u64 = 16 << 20;

/// `GET /rollouts` at `addr` (`host:port`, or an `http://` URL): every chain's status entry.
pub async fn fetch(addr: &str) -> Result<Vec<Value>, String> {
    let host = addr
        .strip_prefix("http://")
        .unwrap_or(addr)
        .trim_end_matches('/');
    if addr.starts_with("https://") {
        return Err(format!(
            "{addr}: the metrics port serves plain HTTP; give it as host:port"
        ));
    }
    let unreachable = |e: std::io::Error| {
        format!(
            "cannot reach the gateway's metrics port at {host}: {e} (the local gateway's --metrics address; `make run` uses 127.0.0.1:9464)"
        )
    };
    let mut stream =
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(host))
            .await
            .map_err(|_| format!("{host}: no answer within 5 s"))?
            .map_err(unreachable)?;
    let request = format!("GET /rollouts HTTP/1.0\r\nHost: {host}\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(unreachable)?;
    let mut answer = Vec::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        (&mut stream).take(MAX_ANSWER).read_to_end(&mut answer),
    )
    .await
    .map_err(|_| format!("{host}: /rollouts did not answer within 10 s"))?
    .map_err(unreachable)?;
    let answer = String::from_utf8_lossy(&answer);
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{host}: not an HTTP answer"))?;
    let status = head.split_whitespace().nth(1).unwrap_or_default();
    if status == "404" {
        return Err(format!(
            "{host} has no /rollouts: is it a Sluice gateway's metrics port?"
        ));
    }
    if status != "200" {
        return Err(format!("{host}: /rollouts answered {status}"));
    }
    let body: Value = serde_json::from_str(body)
        .map_err(|e| format!("{host}: /rollouts is not the JSON a gateway writes: {e}"))?;
    body["rollouts"]
        .as_array()
        .cloned()
        .ok_or_else(|| format!("{host}: /rollouts has no `rollouts` list"))
}

/// The entry of `chain` (`NAMESPACE/NAME`, or `NAME` in `default`), or what there is instead.
pub fn find<'a>(rollouts: &'a [Value], chain: &str) -> Result<&'a Value, String> {
    let wanted = if chain.contains('/') {
        chain.to_string()
    } else {
        format!("default/{chain}")
    };
    rollouts
        .iter()
        .find(|r| r["chain"].as_str() == Some(wanted.as_str()))
        .ok_or_else(|| {
            let there: Vec<&str> = rollouts
                .iter()
                .filter_map(|r| r["chain"].as_str())
                .collect();
            if there.is_empty() {
                format!("no chain {wanted}: the gateway serves no chain")
            } else {
                format!(
                    "no chain {wanted}: the gateway serves {} (name one as NAMESPACE/NAME)",
                    there.join(", ")
                )
            }
        })
}

/// Where an entry stands.
pub fn settled(entry: &Value) -> Settled {
    match entry["phase"].as_str() {
        Some("RolledOut") => Settled::RolledOut,
        Some("RolledBack") => Settled::RolledBack,
        _ => Settled::InProgress,
    }
}

fn short(revision: &Value) -> &str {
    let r = revision.as_str().unwrap_or("?");
    &r[..r.len().min(10)]
}

/// One chain's status, the way a person reads it: `CHAIN: PHASE: message`, then the numbers of this
/// step (a canary's tallies per version, a shadow's comparison).
pub fn describe(entry: &Value) -> Vec<String> {
    let mut lines = vec![format!(
        "{}: {}: {}",
        entry["chain"].as_str().unwrap_or("?"),
        entry["phase"].as_str().unwrap_or("?"),
        entry["message"].as_str().unwrap_or_default()
    )];
    let tally = |t: &Value| {
        format!(
            "{} runs, {} with a failed hook, {} blocked",
            t["runs"], t["errors"], t["blocks"]
        )
    };
    if let Some([live, candidate]) = entry["canary"].as_array().map(Vec::as_slice) {
        lines.push(format!(
            "  live {}: {}",
            short(&entry["live_revision"]),
            tally(live)
        ));
        lines.push(format!(
            "  candidate {}: {}",
            short(&entry["candidate_revision"]),
            tally(candidate)
        ));
    }
    let shadow = &entry["shadow"];
    if shadow.is_object() {
        lines.push(format!(
            "  shadow of {}: {} runs compared, {} agreed, {} other action, {} other output ({}% disagree), {} with a failed hook, {} dropped",
            short(&entry["candidate_revision"]),
            shadow["runs"],
            shadow["agreed"],
            shadow["action_differs"],
            shadow["output_differs"],
            shadow["disagreement_percent"].as_f64().map(|p| format!("{p:.1}")).unwrap_or_default(),
            shadow["errors"],
            shadow["dropped"],
        ));
    }
    lines
}

/// What `watch` shows of an entry at once when it changes: the phase, the step, the message.
fn seen(entry: &Value) -> (Value, Value, Value, Value) {
    (
        entry["phase"].clone(),
        entry["step"].clone(),
        entry["message"].clone(),
        entry["candidate_revision"].clone(),
    )
}

/// The numbers of a step: shown again when they change, at most every `PROGRESS_EVERY`.
fn counted(entry: &Value) -> (Value, Value) {
    (entry["canary"].clone(), entry["shadow"]["runs"].clone())
}

const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// Follows `chain` until its newest hooks are live or rolled back (or `timeout`, when given, passes),
/// calling `show` with each change of phase, step or message, and with the step's numbers when they
/// have changed (at most every 10 s); a gateway that does not answer for a while is waited for.
pub async fn watch(
    addr: &str,
    chain: &str,
    timeout: Option<Duration>,
    every: Duration,
    mut show: impl FnMut(&Value),
) -> Result<Settled, String> {
    let until = timeout.map(|t| Instant::now() + t);
    let mut last = None;
    let (mut last_numbers, mut shown) = (counted(&Value::Null), Instant::now());
    let mut last_error: Option<String>;
    loop {
        match fetch(addr).await.and_then(|r| find(&r, chain).cloned()) {
            Ok(entry) => {
                last_error = None;
                let now = seen(&entry);
                let numbers = counted(&entry);
                let progressed = shown.elapsed() >= PROGRESS_EVERY && last_numbers != numbers;
                if last.as_ref() != Some(&now) || progressed {
                    show(&entry);
                    last = Some(now);
                    last_numbers = numbers;
                    shown = Instant::now();
                }
                match settled(&entry) {
                    Settled::InProgress => {}
                    done => return Ok(done),
                }
            }
            // Before the first answer, a mistake (a wrong address, an unknown chain) is said at once;
            // afterwards a gateway that restarts is waited for.
            Err(e) if last.is_none() => return Err(e),
            Err(e) => last_error = Some(e),
        }
        if let Some(until) = until
            && Instant::now() >= until
        {
            return Err(match last_error {
                Some(e) => format!("timed out waiting for {chain}: {e}"),
                None => format!("timed out waiting for {chain} to be rolled out"),
            });
        }
        tokio::time::sleep(every).await;
    }
}
