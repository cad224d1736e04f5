//! `sluice`: the command line for people who write and call hooks.
//!
//! - `sluice check FILE...`: validates HookChain and Capability YAML without a cluster.
//! - `sluice test FILE...`: runs declarative test cases against chains in local gVisor sandboxes.
//! - `sluice run FILE... --text ...`: one run (or `--stream`) in local sandboxes, printed as JSON.
//! - `sluice call`: calls a running gateway (Run, or Stream with `--stream`) and prints the answer as JSON.

use clap::{Parser, Subcommand};
use serde_json::{Value, json};
use sluice_proto::convert::to_proto;
use sluice_proto::{self as proto, gateway_client::GatewayClient};
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
    /// Check HookChain and Capability files (schema, hook code, capabilities) without a cluster.
    Check {
        /// Files or directories of YAML.
        #[arg(required = true)]
        files: Vec<std::path::PathBuf>,
        /// The Python that parses hook code: the one the sandboxes run, not whichever is first on
        /// PATH, so that syntax the sandbox would refuse is refused here.
        #[arg(long, default_value = sluice_cli::DEFAULT_PYTHON)]
        python: std::path::PathBuf,
    },
    /// Run declarative test cases (YAML) against their chains in local gVisor sandboxes.
    Test {
        #[arg(required = true)]
        files: Vec<std::path::PathBuf>,
    },
    /// Run the chains in FILE(s) once in local gVisor sandboxes and print the result as JSON.
    Run(RunArgs),
    /// Call a running gateway and print its answer as JSON.
    Call(CallArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// HookChain (and Capability) files.
    #[arg(required = true)]
    files: Vec<std::path::PathBuf>,
    /// The target; defaults to the only one in the files.
    #[arg(long)]
    target: Option<String>,
    /// Defaults to the only trigger point of the target.
    #[arg(long)]
    trigger_point: Option<String>,
    #[arg(long, conflicts_with = "value")]
    text: Option<String>,
    #[arg(long)]
    value: Option<String>,
    #[arg(long = "context", value_name = "KEY=VALUE")]
    context: Vec<String>,
    /// Stream the text in chunks of this many characters.
    #[arg(long, value_name = "CHARS")]
    stream: Option<usize>,
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

use sluice_cli::response_json;

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
        Command::Check { files, python } => return check(&files, &python),
        Command::Test { files } => return test(&files).await,
        Command::Run(a) => run(a).await,
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

fn parse_context(pairs: &[String]) -> Result<std::collections::BTreeMap<String, String>, String> {
    pairs
        .iter()
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or(format!("--context {kv:?} is not KEY=VALUE"))
        })
        .collect()
}

fn check(files: &[std::path::PathBuf], python: &std::path::Path) -> ExitCode {
    let files = sluice_cli::expand(files, false);
    let report = sluice_cli::check(&files, python);
    for f in &report.findings {
        println!("{f}");
    }
    if report.findings.is_empty() {
        println!(
            "ok: {} HookChain(s) and {} Capability(ies) in {} file(s)",
            report.chains,
            report.capabilities,
            files.len()
        );
        ExitCode::SUCCESS
    } else {
        println!("{} problem(s) found", report.findings.len());
        ExitCode::FAILURE
    }
}

async fn test(files: &[std::path::PathBuf]) -> ExitCode {
    quiet_logs();
    let (mut passed, mut failed) = (0, 0);
    for f in sluice_cli::expand(files, true) {
        match sluice_cli::run_file(&f).await {
            Ok((p, n)) => {
                passed += p;
                failed += n;
            }
            Err(e) => {
                println!("{}: {e:#}", f.display());
                failed += 1;
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Logs only warnings and errors, on stderr, unless RUST_LOG says otherwise.
fn quiet_logs() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

async fn run(a: RunArgs) -> Result<Value, String> {
    use sluice_cli::{Case, Expect, Local};
    quiet_logs();
    let mut chains = Vec::new();
    for f in &a.files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        for o in sluice_crds::manifest::parse(f, &text) {
            match o.map_err(|e| e.to_string())?.value {
                sluice_crds::manifest::Object::HookChain(hc) => chains.push((
                    hc.spec.target.clone(),
                    hc.spec.trigger_point.as_str().to_string(),
                    sluice_crds::manifest::namespace_of(&hc.metadata),
                )),
                sluice_crds::manifest::Object::Capability(_) => {}
            }
        }
    }
    let pick = chains
        .iter()
        .filter(|(t, tp, _)| {
            a.target.as_ref().is_none_or(|x| x == t)
                && a.trigger_point.as_ref().is_none_or(|x| x == tp)
        })
        .collect::<Vec<_>>();
    let (target, tp, ns) = match pick.as_slice() {
        [one] => (*one).clone(),
        [] => return Err("no HookChain in the files matches --target/--trigger-point".into()),
        _ => return Err("several chains match: name one with --target and --trigger-point".into()),
    };
    let value = a
        .value
        .as_deref()
        .map(serde_json::from_str::<Value>)
        .transpose()
        .map_err(|e| format!("--value is not JSON: {e}"))?;
    let case = Case {
        name: "run".into(),
        target,
        trigger_point: tp,
        namespace: ns,
        text: a.text.clone(),
        value,
        chunks: None,
        context: parse_context(&a.context)?,
        expect: Expect::default(),
    };
    let local = Local::start(&a.files, &Default::default())
        .await
        .map_err(|e| format!("{e:#}"))?;
    let result = match a.stream {
        Some(n) => {
            let chars: Vec<char> = a
                .text
                .clone()
                .ok_or("--stream needs --text")?
                .chars()
                .collect();
            let chunks: Vec<String> = chars.chunks(n.max(1)).map(|c| c.iter().collect()).collect();
            local.stream(&case, &chunks).await
        }
        None => local.run(&case).await,
    }
    .map_err(|e| e.to_string());
    local.stop().await;
    result
}
