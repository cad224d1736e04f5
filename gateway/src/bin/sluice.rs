//! `sluice`: the command line for people who write and call hooks.
//!
//! - `sluice call`: calls a running gateway (Run, or Stream with `--stream`) and prints the answer as JSON.

use clap::{Parser, Subcommand};
use serde_json::{Value, json};
use sluice_gateway::convert::{from_proto, to_proto};
use sluice_gateway::proto::{self, gateway_client::GatewayClient};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Write, check, test and call Sluice hooks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Call a running gateway and print its answer as JSON.
    Call(CallArgs),
}

#[derive(clap::Args)]
struct CallArgs {
    /// Gateway address.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    addr: String,
    #[arg(long, default_value = "default")]
    namespace: String,
    #[arg(long)]
    target: String,
    /// input, output, before_model, after_model, before_tool or after_tool.
    #[arg(long, default_value = "input")]
    trigger_point: String,
    /// Text payload (input and output).
    #[arg(long, conflicts_with = "value")]
    text: Option<String>,
    /// JSON payload (the agent-loop trigger points).
    #[arg(long)]
    value: Option<String>,
    /// Caller context entries, KEY=VALUE (repeatable).
    #[arg(long = "context", value_name = "KEY=VALUE")]
    context: Vec<String>,
    #[arg(long, default_value = "")]
    session_id: String,
    /// Stream the text through Gateway.Stream in chunks of this many characters.
    #[arg(long, value_name = "CHARS")]
    stream: Option<usize>,
}

fn response_json(r: &proto::RunResponse) -> Value {
    let action = |a: i32| {
        proto::Action::try_from(a)
            .map(|a| a.as_str_name().to_lowercase())
            .unwrap_or_default()
    };
    let payload = match &r.payload {
        Some(proto::run_response::Payload::Text(t)) => json!({"text": t}),
        Some(proto::run_response::Payload::Value(v)) => json!({"value": from_proto(v)}),
        None => Value::Null,
    };
    json!({
        "run_id": r.run_id,
        "action": action(r.action),
        "payload": payload,
        "message": r.message,
        "terminal_index": r.terminal_index,
        "hooks": r.hooks.iter().map(|h| json!({
            "name": h.name,
            "action": action(h.action),
            "message": h.message,
            "findings": h.findings.as_ref().map(from_proto),
            "error": h.error,
            "latency_us": h.latency_us,
        })).collect::<Vec<_>>(),
    })
}

async fn call(a: CallArgs) -> Result<Value, String> {
    let context = a
        .context
        .iter()
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or(format!("--context {kv:?} is not KEY=VALUE"))
        })
        .collect::<Result<_, _>>()?;
    let mut client = GatewayClient::connect(a.addr.clone())
        .await
        .map_err(|e| format!("cannot reach the gateway at {}: {e}", a.addr))?;
    if let Some(size) = a.stream {
        let text = a.text.ok_or("--stream needs --text")?;
        let chars: Vec<char> = text.chars().collect();
        let mut msgs = vec![proto::StreamRequest {
            msg: Some(proto::stream_request::Msg::Open(proto::StreamOpen {
                namespace: a.namespace,
                target: a.target,
                trigger_point: a.trigger_point,
                context,
                session_id: a.session_id,
            })),
        }];
        for piece in chars.chunks(size.max(1)) {
            msgs.push(proto::StreamRequest {
                msg: Some(proto::stream_request::Msg::Chunk(piece.iter().collect())),
            });
        }
        msgs.push(proto::StreamRequest {
            msg: Some(proto::stream_request::Msg::Finish(proto::StreamFinish {})),
        });
        let mut out = client
            .stream(futures::stream::iter(msgs))
            .await
            .map_err(|s| s.message().to_string())?
            .into_inner();
        let (mut commits, mut blocked, mut final_) = (vec![], Value::Null, Value::Null);
        while let Some(msg) = out
            .message()
            .await
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
        {
            match msg.msg {
                Some(proto::stream_response::Msg::Commit(c)) => commits.push(c),
                Some(proto::stream_response::Msg::Blocked(b)) => {
                    blocked = json!({"message": b.message, "hook": b.hook})
                }
                Some(proto::stream_response::Msg::Final(f)) => final_ = response_json(&f),
                None => {}
            }
        }
        return Ok(json!({"commits": commits, "blocked": blocked, "final": final_}));
    }
    let payload = match (a.text, a.value) {
        (Some(t), _) => Some(proto::run_request::Payload::Text(t)),
        (None, Some(v)) => {
            let v: Value =
                serde_json::from_str(&v).map_err(|e| format!("--value is not JSON: {e}"))?;
            Some(proto::run_request::Payload::Value(to_proto(&v)))
        }
        (None, None) => return Err("give --text or --value".into()),
    };
    let req = proto::RunRequest {
        namespace: a.namespace,
        target: a.target,
        trigger_point: a.trigger_point,
        payload,
        context,
        session_id: a.session_id,
    };
    let resp = client
        .run(req)
        .await
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    Ok(response_json(&resp))
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Call(a) => call(a).await,
    };
    match result {
        Ok(v) => {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice: {e}");
            ExitCode::FAILURE
        }
    }
}
