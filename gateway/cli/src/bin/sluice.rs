//! `sluice`: the command line for people who write and call hooks.
//!
//! - `sluice init DIR`: writes a starter chain and its test file.
//! - `sluice check FILE...`: validates HookChain and Capability YAML without a cluster.
//! - `sluice test FILE...`: runs declarative test cases against chains in local gVisor sandboxes.
//! - `sluice run FILE... --text ...`: one run (or `--stream`) in local sandboxes, printed as JSON.
//! - `sluice call`: calls a running gateway (Run, or Stream with `--stream`) and prints the answer as JSON.
//! - `sluice rollout status [CHAIN]`: a local gateway's rollouts, waiting until the newest hooks are live.

use clap::{Parser, Subcommand};
use serde_json::{Value, json};
use sluice_crds::manifest::PlatformRules;
use sluice_proto as proto;
use sluice_proto::convert::to_proto;
use std::process::ExitCode;

/// `println!` for what the commands print: a reader that went away (`sluice call ... | head -1`)
/// ends the program quietly with the status a pipe's writer gets (141, SIGPIPE's), instead of the
/// panic `println!` gives.
macro_rules! outln {
    ($($arg:tt)*) => {
        out_line(format_args!($($arg)*))
    };
}

fn out_line(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let written = out
        .write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(STDOUT_CLOSED),
        Err(e) => {
            eprintln!("sluice: cannot write to standard output: {e}");
            std::process::exit(STDOUT_CLOSED)
        }
    }
}

/// The exit status when standard output is gone: 128 + SIGPIPE, as a shell reports a writer the
/// signal ended.
const STDOUT_CLOSED: i32 = 141;

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
        /// A host Python to parse hook code with instead of the sandboxes' own CPython (the cell
        /// runtime beside this binary, or SLUICE_CELL_RUNTIME), which checks it by default: the
        /// interpreter that runs a hook is the one that judges it.
        #[arg(long)]
        python: Option<std::path::PathBuf>,
        /// The platform's allowed endpoints (the gateway's and operator's --allowed-endpoints):
        /// Capabilities pointing elsewhere are reported. Default: loopback addresses, as local
        /// mode allows.
        #[arg(long, env = "SLUICE_ALLOWED_ENDPOINTS", value_name = "LIST")]
        allowed_endpoints: Option<sluice_crds::endpoints::AllowedEndpoints>,
        /// The platform's sandbox CPU limit (the operator's --sandbox-cpu-limit): a chain asking
        /// for more `resources.cpu` is reported.
        #[arg(long, env = "SLUICE_SANDBOX_CPU_LIMIT", value_name = "CPU", default_value = sluice_crds::cpu::DEFAULT_SANDBOX_CPU_LIMIT)]
        sandbox_cpu_limit: sluice_crds::cpu::SandboxCpuLimit,
        /// The cluster's DNS domain (the gateway's and operator's --cluster-domain): a Service
        /// entry allows no other domain after `.svc`.
        #[arg(long, env = "SLUICE_CLUSTER_DOMAIN", default_value_t = Default::default(), value_name = "DOMAIN")]
        cluster_domain: sluice_crds::endpoints::ClusterDomain,
        /// The platform's trusted signers and where it requires signatures: chains that would be
        /// refused there are reported.
        #[command(flatten)]
        signing: sluice_crds::signing::SigningArgs,
    },
    /// Check an installed Sluice from the cluster (KUBECONFIG): the CRDs, the operator and the
    /// gateway, the RuntimeClass, and a pod made like a sandbox pod that must run a hook in a cell
    /// under gVisor; each failed check says why, in the cluster's words. Exit code 0 when every
    /// check holds, 1 otherwise.
    Doctor {
        /// The release's namespace.
        #[arg(short, long, default_value = "sluice-system")]
        namespace: String,
        /// The RuntimeClass to try (default: the operator's --runtime-class).
        #[arg(long, value_name = "NAME")]
        runtime_class: Option<String>,
        /// How long the gVisor pod may take to run.
        #[arg(long, value_parser = sluice_crds::duration::parse_duration, default_value = "120s")]
        timeout: std::time::Duration,
    },
    /// Sign the hooks of chain files with an SSH key: each hook gets a `signature:` bound to its
    /// chain's namespace and name (docs/signing.md). The files are rewritten in place.
    Sign {
        /// Chain files (YAML).
        #[arg(required = true)]
        files: Vec<std::path::PathBuf>,
        /// The SSH key: a private key file (one with a passphrase, or a `.pub` whose private key is
        /// in ssh-agent, is used through `ssh-keygen -Y sign`).
        #[arg(short = 'k', long, value_name = "KEY")]
        key: std::path::PathBuf,
        /// Sign only the hook of this name.
        #[arg(long, value_name = "NAME")]
        hook: Option<String>,
    },
    /// Verify the hooks' signatures of chain files against trusted signers, offline. Exit code 0
    /// when every hook is signed by one of them, 1 otherwise.
    Verify {
        /// Chain files (YAML).
        #[arg(required = true)]
        files: Vec<std::path::PathBuf>,
        /// The trusted signers: an `allowed_signers` file, as git and `ssh-keygen -Y verify` use.
        #[arg(long, value_name = "FILE")]
        trusted_signers: std::path::PathBuf,
    },
    /// Run declarative test cases (YAML) against their chains in local gVisor sandboxes.
    ///
    /// Hooks run in the same WebAssembly cells as in the gateway, inside gVisor too where runsc
    /// and root are there (without, it says so and runs WebAssembly-only). Exit codes: 0 every case
    /// passed; 1 a case failed; 2 something could not be run at all (a test file that cannot be
    /// read, chains the local gateway refuses).
    Test {
        /// Test files (*.test.yaml) or directories of them.
        #[arg(required = true)]
        files: Vec<std::path::PathBuf>,
        /// Run only the cases whose name contains PATTERN.
        #[arg(long, value_name = "PATTERN")]
        run: Option<String>,
        /// Print each case's answer (action, payload, every hook's outcome).
        #[arg(short, long)]
        verbose: bool,
        /// Also write the results as JUnit XML to FILE.
        #[arg(long, value_name = "FILE")]
        junit: Option<std::path::PathBuf>,
        /// Run again whenever a test file or a chain it uses changes (Ctrl-C ends).
        #[arg(long)]
        watch: bool,
        /// Also show which lines of each hook's code the cases ran, and those none did.
        #[arg(long)]
        coverage: bool,
        /// Test files run at once, each against a local gateway of its own (default: the
        /// machine's cores, at most 4). Results are printed in file order either way.
        #[arg(short, long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
        jobs: Option<u16>,
    },
    /// Write a starter chain (DIR/redact-customer-ids.yaml) and its test file
    /// (DIR/tests/redact-customer-ids.test.yaml) that `sluice check` and `sluice test` pass.
    Init {
        /// Directory to write into (created if missing); existing files are never overwritten.
        dir: std::path::PathBuf,
        /// Start from a recipe instead of the starter: card-numbers (masked in streamed replies,
        /// Luhn-checked), competitors (blocked, the list in settings), ready-hooks (PII masked and
        /// injection blocked by ready hooks of the library, no code), charge-per-message (a credit
        /// per message through the ledger, blocked without credit).
        #[arg(long, value_name = "NAME", value_parser = RECIPES.iter().map(|r| r.name).collect::<Vec<_>>())]
        example: Option<String>,
    },
    /// Run the chains in FILE(s) once in local gVisor sandboxes and print the result as JSON.
    ///
    /// Exit codes: 0 every hook answered (whatever the chain decided: a block is an answer); 1 a
    /// hook failed (raised, ran out of time or memory: its error is in the JSON's `errors`, and the
    /// chain's failurePolicy decided the outcome) or the run could not be made.
    Run(RunArgs),
    /// Call a running gateway and print its answer as JSON.
    Call(CallArgs),
    /// What a local gateway's rollouts are doing (its `/rollouts`), as `kubectl rollout status`
    /// shows a cluster's.
    #[command(subcommand)]
    Rollout(RolloutCommand),
}

#[derive(Subcommand)]
enum RolloutCommand {
    /// Shows a chain's rollout and, by default, waits until its newest hooks are live or rolled
    /// back, printing each step.
    ///
    /// Exit codes: 0 the newest hooks are live (or, with --watch=false or no CHAIN, the status was
    /// shown); 1 the candidate was rolled back, the wait timed out, or the gateway could not be read.
    Status {
        /// The chain, NAMESPACE/NAME (NAME alone: in `default`). Without it: every chain, once.
        chain: Option<String>,
        /// The local gateway's metrics address (its --metrics).
        #[arg(
            long,
            env = "SLUICE_METRICS",
            default_value = "127.0.0.1:9464",
            value_name = "ADDR"
        )]
        metrics: String,
        /// Wait until the rollout ends (--watch=false: show it once).
        #[arg(short, long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL",
              num_args = 0..=1, require_equals = true, default_missing_value = "true")]
        watch: bool,
        /// Give up waiting after this long (30s, 10m); 0 waits as long as it takes.
        #[arg(long, value_parser = sluice_crds::duration::parse_duration, default_value = "0s")]
        timeout: std::time::Duration,
        /// `json`: the gateway's status entries as they are.
        #[arg(short, long, value_parser = ["json"])]
        output: Option<String>,
    },
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
    /// Answer host_calls of capability NAME with this JSON result (others answer an error: no
    /// endpoint is called).
    #[arg(long = "stub", value_name = "NAME=JSON")]
    stubs: Vec<String>,
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
    /// Stream the text through Gateway.Stream in chunks of this many characters, each handled as
    /// if it came on its own (a pattern split across chunks meets the window's lookback).
    #[arg(long, value_name = "CHARS")]
    stream: Option<usize>,
    /// With --stream: wait this long between chunks, as a model streaming its reply does (5ms,
    /// 100ms).
    #[arg(long, requires = "stream", value_parser = sluice_crds::duration::parse_duration)]
    pace: Option<std::time::Duration>,
    /// How to reach a secured gateway (the same options as the reference agent loop).
    #[command(flatten)]
    auth: proto::client::ClientAuth,
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
    let mut client = a.auth.connect(&a.addr).await.map_err(|e| e.to_string())?;
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
                chunk_by_chunk: true,
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
        let pace = a.pace.unwrap_or_default();
        let paced = futures::StreamExt::then(futures::stream::iter(msgs), move |m| async move {
            if matches!(m.msg, Some(proto::stream_request::Msg::Chunk(_))) && !pace.is_zero() {
                tokio::time::sleep(pace).await;
            }
            m
        });
        let mut out = client
            .stream(paced)
            .await
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
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
        Command::Check {
            files,
            python,
            allowed_endpoints,
            sandbox_cpu_limit,
            cluster_domain,
            signing,
        } => {
            let allowed = allowed_endpoints
                .unwrap_or_else(sluice_crds::endpoints::AllowedEndpoints::loopback)
                .in_cluster_domain(cluster_domain);
            let signing = match signing.load() {
                Ok(loaded) => loaded.map(|(file, problems)| {
                    for p in problems {
                        eprintln!("{}:{p}", file.path().display());
                    }
                    file
                }),
                Err(e) => {
                    eprintln!("sluice check: {e}");
                    return ExitCode::from(2);
                }
            };
            let rules = PlatformRules {
                sandbox_cpu_limit,
                signing,
                ..PlatformRules::new(allowed)
            };
            quiet_logs();
            let python = match python {
                Some(python) => sluice_crds::code::Interpreter::Python(python),
                None => sluice_gateway::code_checker(None),
            };
            return check(&files, &python, &rules);
        }
        Command::Doctor {
            namespace,
            runtime_class,
            timeout,
        } => {
            let opts = sluice_cli::doctor::Options {
                namespace,
                runtime_class,
                timeout,
            };
            let checks = match kube::Client::try_default().await {
                Ok(client) => Ok(sluice_cli::doctor::run(client, &opts).await),
                Err(e) => Err(e),
            };
            return match checks {
                Ok(checks) => {
                    for c in &checks {
                        println!("{c}");
                    }
                    if checks.iter().all(|c| c.ok) {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::FAILURE
                    }
                }
                Err(e) => {
                    eprintln!("sluice doctor: no cluster (KUBECONFIG, or in-cluster): {e}");
                    ExitCode::from(2)
                }
            };
        }
        Command::Sign { files, key, hook } => {
            let key = match sluice_cli::sign::Key::load(&key) {
                Ok(k) => k,
                Err(e) => {
                    eprintln!("sluice sign: {e}");
                    return ExitCode::from(2);
                }
            };
            for file in &files {
                let signed = (|| -> anyhow::Result<Vec<sluice_cli::sign::Signed>> {
                    use anyhow::Context as _;
                    let text = std::fs::read_to_string(file)
                        .with_context(|| format!("cannot read {}", file.display()))?;
                    let (text, signed) =
                        sluice_cli::sign::sign_text(file, &text, &key, hook.as_deref())?;
                    std::fs::write(file, text)
                        .with_context(|| format!("cannot write {}", file.display()))?;
                    Ok(signed)
                })();
                match signed {
                    Ok(signed) => {
                        for s in signed {
                            println!(
                                "{}: signed HookChain {}, hook {:?}",
                                file.display(),
                                s.chain,
                                s.hook
                            );
                        }
                    }
                    Err(e) => {
                        eprintln!("sluice sign: {e:#}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            return ExitCode::SUCCESS;
        }
        Command::Verify {
            files,
            trusted_signers,
        } => {
            let trusted = match sluice_crds::signing::TrustedSigners::read(&trusted_signers) {
                Ok((trusted, problems)) => {
                    for p in problems {
                        eprintln!("{}:{p}", trusted_signers.display());
                    }
                    trusted
                }
                Err(e) => {
                    eprintln!(
                        "sluice verify: cannot read {}: {e}",
                        trusted_signers.display()
                    );
                    return ExitCode::from(2);
                }
            };
            return if sluice_cli::sign::verify(&files, &trusted) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            };
        }
        Command::Test {
            files,
            run,
            verbose,
            junit,
            watch,
            coverage,
            jobs,
        } => {
            let opts = sluice_cli::RunOptions {
                only: run,
                verbose,
                gvisor: gvisor_or_say_why("sluice test"),
            };
            let jobs = jobs.map_or_else(
                || std::thread::available_parallelism().map_or(1, |n| n.get().min(4)),
                usize::from,
            );
            let report = Report {
                junit,
                coverage,
                jobs,
            };
            return test(&files, &opts, &report, watch).await;
        }
        Command::Init { dir, example } => return init(&dir, example.as_deref()),
        Command::Rollout(RolloutCommand::Status {
            chain,
            metrics,
            watch,
            timeout,
            output,
        }) => {
            let json = output.is_some();
            return rollout_status(&metrics, chain.as_deref(), watch, timeout, json).await;
        }
        Command::Run(a) => {
            let result = run(a).await;
            // An author's run where a hook failed is not a success, whatever the policy made of it.
            if let Ok(v) = &result
                && hooks_failed(v)
            {
                outln!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
                return ExitCode::FAILURE;
            }
            result
        }
    };
    match result {
        Ok(v) => {
            outln!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn rollout_status(
    metrics: &str,
    chain: Option<&str>,
    watch: bool,
    timeout: std::time::Duration,
    json: bool,
) -> ExitCode {
    use sluice_cli::rollout::{self, Settled};
    let show = |entry: &Value| {
        if json {
            outln!("{}", serde_json::to_string(entry).unwrap_or_default());
        } else {
            for line in rollout::describe(entry) {
                outln!("{line}");
            }
        }
    };
    let settled = match chain {
        None => rollout::fetch(metrics).await.map(|all| {
            all.iter().for_each(show);
            Settled::InProgress
        }),
        Some(chain) if !watch => rollout::fetch(metrics).await.and_then(|all| {
            let entry = rollout::find(&all, chain)?;
            show(entry);
            Ok(rollout::settled(entry))
        }),
        Some(chain) => {
            let limit = (!timeout.is_zero()).then_some(timeout);
            let every = std::time::Duration::from_millis(250);
            rollout::watch(metrics, chain, limit, every, show).await
        }
    };
    match settled {
        Ok(Settled::RolledBack) => ExitCode::FAILURE,
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice rollout status: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Whether a printed answer (`response_json`, or a stream's with its `final`) lists a failed hook.
fn hooks_failed(v: &Value) -> bool {
    let listed = |v: &Value| v["errors"].as_array().is_some_and(|e| !e.is_empty());
    listed(v) || listed(&v["final"])
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

fn check(
    files: &[std::path::PathBuf],
    python: &sluice_crds::code::Interpreter,
    rules: &PlatformRules,
) -> ExitCode {
    let files = sluice_cli::expand(files, false);
    let report = sluice_cli::check(&files, python, rules);
    for f in &report.findings {
        outln!("{f}");
    }
    if report.findings.is_empty() {
        outln!(
            "ok: {} HookChain(s) and {} Capability(ies) in {} file(s)",
            report.chains,
            report.capabilities,
            files.len()
        );
        ExitCode::SUCCESS
    } else {
        outln!("{} problem(s) found", report.findings.len());
        ExitCode::FAILURE
    }
}

/// Exit code of `sluice test` when something could not be run at all.
const TEST_COULD_NOT_RUN: u8 = 2;

/// What `sluice test` reports besides each case.
struct Report {
    /// JUnit XML written here.
    junit: Option<std::path::PathBuf>,
    /// The lines of hook code the cases ran.
    coverage: bool,
    /// Test files run at once.
    jobs: usize,
}

async fn test(
    files: &[std::path::PathBuf],
    opts: &sluice_cli::RunOptions,
    report: &Report,
    watch: bool,
) -> ExitCode {
    quiet_logs();
    // Taken before the run, so that a change made while it runs starts the next one.
    let mut seen = watched(files);
    let mut code = test_once(files, opts, report).await;
    if !watch {
        return code;
    }
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return code,
            _ = tokio::time::sleep(std::time::Duration::from_millis(500)) => {}
        }
        let now = watched(files);
        if now != seen {
            seen = now;
            outln!("--- changed; running again ---");
            code = test_once(files, opts, report).await;
        }
    }
}

async fn test_once(
    files: &[std::path::PathBuf],
    opts: &sluice_cli::RunOptions,
    report: &Report,
) -> ExitCode {
    let (mut passed, mut failed, mut broken) = (0, 0, 0);
    let mut reports = Vec::new();
    let files = sluice_cli::expand(files, true);
    // Up to `jobs` files at once, each against a gateway of its own; answers in file order.
    let mut results = futures::StreamExt::buffered(
        futures::stream::iter(files.iter().map(|f| sluice_cli::run_file(f, opts))),
        report.jobs.max(1),
    );
    while let Some(result) = futures::StreamExt::next(&mut results).await {
        match result {
            Ok(report) => {
                outln!("{}", report.path.display());
                for c in &report.cases {
                    outln!("  {}  {}", if c.passed { "PASS" } else { "FAIL" }, c.name);
                    for line in c.details.iter().flat_map(|d| d.lines()) {
                        outln!("        {line}");
                    }
                    if let Some(answer) = &c.answer {
                        let pretty = serde_json::to_string_pretty(answer).unwrap_or_default();
                        for line in pretty.lines() {
                            outln!("        {line}");
                        }
                    }
                }
                passed += report.passed();
                failed += report.failed();
                reports.push(Ok(report));
            }
            Err(e) => {
                outln!("{e}");
                broken += 1;
                reports.push(Err(e.to_string()));
            }
        }
    }
    if broken > 0 {
        outln!("{passed} passed, {failed} failed, {broken} file(s) could not be run");
    } else {
        outln!("{passed} passed, {failed} failed");
    }
    let ran: Vec<&sluice_cli::FileReport> = reports.iter().flatten().collect();
    if report.coverage && !ran.is_empty() {
        for line in sluice_cli::coverage::describe(&sluice_cli::coverage::merge(&ran)) {
            outln!("{line}");
        }
    }
    if let Some(path) = &report.junit
        && let Err(e) = std::fs::write(path, sluice_cli::junit(&reports))
    {
        outln!("sluice test: cannot write {}: {e}", path.display());
        return ExitCode::from(TEST_COULD_NOT_RUN);
    }
    if broken > 0 {
        ExitCode::from(TEST_COULD_NOT_RUN)
    } else if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Whether hooks can run inside gVisor here, as the gateway runs them (runsc on PATH and root).
fn preflight() -> Result<(), String> {
    let runsc = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("runsc").is_file()))
        .unwrap_or(false);
    let root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|euid| euid == "0"))
        })
        .unwrap_or(false);
    let missing = match (runsc, root) {
        (true, true) => return Ok(()),
        (false, true) => "runsc (gVisor) is not on PATH",
        (true, false) => "it is not running as root",
        (false, false) => "runsc (gVisor) is not on PATH and it is not running as root",
    };
    Err(format!(
        "{missing}: hooks run in their WebAssembly cells only, without gVisor's wall around them (the gateway runs them inside gVisor as well; for that here, install runsc from bookworm-backports and run as root)"
    ))
}

/// True when gVisor is there; otherwise says so once (on stderr) and runs WebAssembly-only.
fn gvisor_or_say_why(command: &str) -> bool {
    match preflight() {
        Ok(()) => true,
        Err(why) => {
            eprintln!("{command}: {why}");
            false
        }
    }
}

/// Paths, sizes and modification times of the test files and the chain files they use.
fn watched(
    files: &[std::path::PathBuf],
) -> Vec<(std::path::PathBuf, u64, Option<std::time::SystemTime>)> {
    let mut paths = Vec::new();
    for f in sluice_cli::expand(files, true) {
        let chains = std::fs::read_to_string(&f)
            .ok()
            .and_then(|t| serde_saphyr::from_str::<Value>(&t).ok())
            .and_then(|v| v["chains"].as_array().cloned())
            .unwrap_or_default();
        let base = f.parent().map(|p| p.to_path_buf()).unwrap_or_default();
        paths.extend(
            chains
                .iter()
                .filter_map(Value::as_str)
                .map(|c| base.join(c)),
        );
        paths.push(f);
    }
    paths.sort();
    paths.dedup();
    paths
        .into_iter()
        .map(|p| {
            let m = std::fs::metadata(&p).ok();
            let len = m.as_ref().map(|m| m.len()).unwrap_or(0);
            let modified = m.and_then(|m| m.modified().ok());
            (p, len, modified)
        })
        .collect()
}

const STARTER_CHAIN: &str = r#"# A starter HookChain from `sluice init`: check it with `sluice check`, test it with `sluice test`.
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata:
  name: redact-customer-ids
  namespace: default
spec:
  target: support-bot        # the agent or app this chain serves
  triggerPoint: input        # the user's message, before the agent sees it
  failurePolicy: Closed      # a failing hook blocks the message
  timeoutMs: 2000
  hooks:
    - name: redact-customer-id
      action: modify
      settings:
        mask: "[customer id]"
      code: |
        import re

        def execute(context, settings):
            text = context["outgoing"]
            redacted = re.sub(r"CUST-\d{6}", settings["mask"], text)
            if redacted == text:
                return {"action": "pass"}
            return {"action": "modify", "outgoing": redacted}
    - name: block-competitor
      action: block
      settings:
        competitors: ["Acme Corp"]
        message: "Sorry, we cannot discuss other companies."
      code: |
        def execute(context, settings):
            text = context["outgoing"].lower()
            for name in settings["competitors"]:
                if name.lower() in text:
                    return {"action": "block", "message": settings["message"]}
            return {"action": "pass"}
"#;

const STARTER_TESTS: &str = r#"# Cases for ../redact-customer-ids.yaml: `sluice test tests/`
chains: [../redact-customer-ids.yaml]
cases:
  - name: redacts a customer id
    target: support-bot
    text: "my account is CUST-123456"
    expect:
      action: modify
      text: "my account is [customer id]"
      hooks: {redact-customer-id: modify, block-competitor: pass}
  - name: blocks a competitor
    target: support-bot
    text: "is Acme Corp cheaper?"
    expect:
      action: block
      message: "Sorry, we cannot discuss other companies."
  - name: leaves other messages alone
    target: support-bot
    text: "where is my order?"
    expect: {action: pass, text: "where is my order?"}
"#;

/// A recipe `sluice init --example` writes: its chain file and test files (in `tests/`).
struct Recipe {
    name: &'static str,
    chain: &'static str,
    tests: &'static [(&'static str, &'static str)],
}

const RECIPES: &[Recipe] = &[
    Recipe {
        name: "card-numbers",
        chain: include_str!("../../recipes/card-numbers.yaml"),
        tests: &[(
            "card-numbers.test.yaml",
            include_str!("../../recipes/card-numbers.test.yaml"),
        )],
    },
    Recipe {
        name: "competitors",
        chain: include_str!("../../recipes/competitors.yaml"),
        tests: &[(
            "competitors.test.yaml",
            include_str!("../../recipes/competitors.test.yaml"),
        )],
    },
    Recipe {
        name: "ready-hooks",
        chain: include_str!("../../recipes/ready-hooks.yaml"),
        tests: &[(
            "ready-hooks.test.yaml",
            include_str!("../../recipes/ready-hooks.test.yaml"),
        )],
    },
    Recipe {
        name: "charge-per-message",
        chain: include_str!("../../recipes/charge-per-message.yaml"),
        tests: &[
            (
                "charge-per-message.test.yaml",
                include_str!("../../recipes/charge-per-message.test.yaml"),
            ),
            (
                "charge-per-message-no-credit.test.yaml",
                include_str!("../../recipes/charge-per-message-no-credit.test.yaml"),
            ),
        ],
    },
];

fn init(dir: &std::path::Path, example: Option<&str>) -> ExitCode {
    let files: Vec<(std::path::PathBuf, &str)> = match example
        .and_then(|name| RECIPES.iter().find(|r| r.name == name))
    {
        Some(recipe) => std::iter::once((dir.join(format!("{}.yaml", recipe.name)), recipe.chain))
            .chain(
                recipe
                    .tests
                    .iter()
                    .map(|(file, text)| (dir.join("tests").join(file), *text)),
            )
            .collect(),
        None => vec![
            (dir.join("redact-customer-ids.yaml"), STARTER_CHAIN),
            (
                dir.join("tests").join("redact-customer-ids.test.yaml"),
                STARTER_TESTS,
            ),
        ],
    };
    if let Some((existing, _)) = files.iter().find(|(p, _)| p.exists()) {
        eprintln!(
            "sluice init: {} already exists; nothing written",
            existing.display()
        );
        return ExitCode::FAILURE;
    }
    for (path, text) in &files {
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(path, text));
        if let Err(e) = written {
            eprintln!("sluice init: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        outln!("wrote {}", path.display());
    }
    outln!("next: sluice check {0} && sluice test {0}", dir.display());
    ExitCode::SUCCESS
}

/// Logs only warnings and errors, on stderr, unless RUST_LOG says otherwise. The registry's own
/// report of a chain that does not load is left out: the command says it once, with the author's
/// path (the registry's names the copy the local gateway reads).
fn quiet_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "warn,sluice_engine::registry=off".into());
    use std::io::IsTerminal;
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
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
    let mut stubs = std::collections::BTreeMap::new();
    for s in &a.stubs {
        let (name, result) = s
            .split_once('=')
            .ok_or_else(|| format!("--stub {s:?}: expected NAME=JSON"))?;
        let result = serde_json::from_str::<Value>(result)
            .map_err(|e| format!("--stub {name}: the result is not JSON: {e}"))?;
        stubs.insert(
            name.to_string(),
            sluice_cli::Stub {
                result,
                error: None,
                denied: None,
            },
        );
    }
    let local = Local::start(&a.files, &stubs, gvisor_or_say_why("sluice run"))
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
