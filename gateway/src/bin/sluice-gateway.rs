//! `sluice-gateway --local DIR [--listen ADDR]`: the gateway in local mode.

use clap::Parser;
use sluice_gateway::audit::Audit;
use sluice_gateway::gateway::{LocalOptions, start_local};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "sluice-gateway",
    version,
    about = "Sluice gRPC gateway: runs HookChains in gVisor sandboxes"
)]
struct Args {
    /// Serve the HookChain and Capability YAML under this directory with local runsc sandboxes.
    #[arg(long, value_name = "DIR")]
    local: PathBuf,
    /// gRPC listen address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    /// Prometheus metrics address (GET /metrics).
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Where audit events go, one JSON line per run: a file, or - for stdout.
    #[arg(long, default_value = "-")]
    audit: String,
    /// Directory for sandbox state (runsc root, bundles); leftovers in it are removed at start.
    #[arg(long, default_value = "/run/sluice/gateway")]
    state_dir: PathBuf,
    /// The runsc binary.
    #[arg(long, default_value = "runsc")]
    runsc: PathBuf,
    /// The Python interpreter mounted (read-only) into sandboxes.
    #[arg(long, default_value = "/usr/bin/python3")]
    python: PathBuf,
    /// gVisor platform (ptrace works everywhere).
    #[arg(long, default_value = "ptrace")]
    platform: String,
    /// Namespace whose HookChains marked `enforced: true` are platform baselines: they run before
    /// every tenant's chain at their trigger point and cannot be bypassed.
    #[arg(long, default_value = sluice_crds::DEFAULT_PLATFORM_NAMESPACE)]
    platform_namespace: String,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    log_format: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if args.log_format == "json" {
        logs.json().init()
    } else {
        logs.init()
    }

    let mut opts = LocalOptions::new(&args.local, &args.state_dir);
    opts.listen = args.listen;
    opts.metrics = args.metrics;
    opts.sandbox.runsc = args.runsc;
    opts.sandbox.python = args.python;
    opts.sandbox.platform = args.platform;
    opts.platform_namespace = args.platform_namespace;
    opts.audit = if args.audit == "-" {
        Audit::to_stdout()
    } else {
        Audit::to_file(args.audit.as_ref())?
    };
    let gateway = start_local(opts).await?;

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down: finishing in-flight runs, then destroying sandboxes");
    gateway.shutdown().await;
    Ok(())
}
