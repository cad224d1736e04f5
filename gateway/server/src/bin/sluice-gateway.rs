//! `sluice-gateway --local DIR [--listen ADDR]`: the gateway in local mode (runsc sandboxes here);
//! `sluice-gateway --kube`: in a cluster (warm pods of the operator, reached over the exec API).

use anyhow::Context as _;
use clap::Parser;
use sluice_crds::endpoints::{AllowedEndpoints, ClusterDomain};
use sluice_engine::Audit;
use sluice_gateway::observability::{self, TracingConfig};
use sluice_gateway::{
    KubeOptions, LocalOptions, McpOptions, OpenAiOptions, Security, TlsFiles, start_kube,
    start_local,
};
use sluice_sandbox_kube::{ExecKeepalive, KubeConfig};
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
    #[arg(
        long,
        value_name = "DIR",
        required_unless_present = "kube",
        conflicts_with = "kube"
    )]
    local: Option<PathBuf>,
    /// Serve the cluster's HookChains and Capabilities from the operator's warm gVisor pods
    /// (in-cluster service account, or KUBECONFIG).
    #[arg(long)]
    kube: bool,
    /// kube mode: watch and claim only in this namespace (default: all namespaces); the platform
    /// namespace is watched as well, for its baselines.
    #[arg(long, requires = "kube")]
    namespace: Option<String>,
    /// kube mode: serve only the HookChains and Capabilities this label selector matches (the
    /// operator's `--selector`; `sluice.dev/release=staging`, `sluice.dev/release!=staging`), so
    /// that several releases share namespaces. Default: all.
    #[arg(long, requires = "kube")]
    selector: Option<String>,
    /// kube mode: the operator's `--sandbox-namespace`: sandbox pods are watched, claimed and
    /// exec'd into there only (default: beside their HookChains).
    #[arg(long, requires = "kube")]
    sandbox_namespace: Option<String>,
    /// kube mode: claim only pods under this RuntimeClass (the operator's --runtime-class); empty
    /// trusts any.
    #[arg(long, default_value = "gvisor")]
    runtime_class: String,
    /// kube mode: how long a run waits for a warm pod (e.g. 2s, 500ms).
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    claim_timeout: std::time::Duration,
    /// kube mode: how long the exec into a claimed pod may take to open; past it the pod is given
    /// back and the boot fails (the API server client would retry a 429 or 503 for minutes).
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    exec_timeout: std::time::Duration,
    /// kube mode: how often a websocket ping goes out on each exec connection (kubectl pings every
    /// 5 s); the API server answers each with a pong.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    exec_ping_every: std::time::Duration,
    /// kube mode: a ping unanswered this long ends the exec connection as lost (half-open, or a
    /// proxy that stopped relaying): the run on it fails at once and the pod is retired. At least
    /// --exec-ping-every.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    exec_ping_deadline: std::time::Duration,
    /// kube mode: pods per chain (at most its pool.warm) this gateway keeps claimed and attached
    /// ahead of demand, so a run pays neither the claim nor the exec; 0 claims per run.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=64))]
    kube_hold: u32,
    /// Warm sandboxes this gateway keeps ahead of demand across all chains (booted, booting or
    /// being recycled). Chains take turns up to it; a request waiting for a sandbox is served
    /// regardless (its boot goes before every warm-up boot).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    max_warm_sandboxes: u32,
    /// Bytes of what each hook printed (the end of it) a Run's answer carries, for debugging a
    /// chain; 0 (the default) carries none.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=65536))]
    hook_output_bytes: u32,
    /// gRPC listen address. A non-loopback address needs TLS and --callers, or --insecure.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    /// Serve gRPC over TLS with this PEM certificate chain (re-read when the file changes).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert (re-read when the file changes).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Mutual TLS: verify client certificates against these PEM CAs. Without --callers a client
    /// certificate is required; with it, optional (a caller may send a bearer token instead).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    client_ca: Option<PathBuf>,
    /// CallerPolicy YAML: which client certificates (URI/DNS SAN) and bearer tokens may call, and
    /// the namespaces each may use (re-read when the file changes).
    #[arg(long, value_name = "FILE")]
    callers: Option<PathBuf>,
    /// Allow a non-loopback --listen without TLS or without --callers (logged as a warning).
    #[arg(long)]
    insecure: bool,
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
    /// A Python interpreter to check hook code with (its compiler and `ast`) when chains are read.
    /// Default in local mode: the sandboxes' own CPython (the supervisor's WebAssembly cell), the
    /// interpreter hooks run on; in kube mode, python3 on PATH.
    #[arg(long)]
    python: Option<PathBuf>,
    #[command(flatten)]
    signing: sluice_crds::signing::SigningArgs,
    /// Local mode: the supervisor binary mounted into every sandbox (default: `sluice-supervisor`
    /// beside this binary).
    #[arg(long, requires = "cell_runtime")]
    supervisor: Option<PathBuf>,
    /// Local mode: the cell runtime the supervisor loads (default: `sluice-cell.cwasm` beside this
    /// binary; its SHA-256 is read from the `.sha256` file beside it).
    #[arg(long, requires = "supervisor")]
    cell_runtime: Option<PathBuf>,
    /// gVisor platform: ptrace, systrap, or auto (the faster of the two at making a cell, measured
    /// at start; either must be able to make cells or the gateway does not start).
    #[arg(long, default_value = "auto", value_parser = ["auto", "ptrace", "systrap", "kvm"])]
    platform: String,
    /// Local mode: the most CPU one sandbox may use (its CFS quota per 100 ms; `none` for no
    /// limit), as the operator's `--sandbox-cpu-limit` sets a pod's. A chain's `resources.cpu` is
    /// its sandboxes' share (`cpu.shares`), not a limit.
    #[arg(long, default_value = sluice_crds::cpu::DEFAULT_SANDBOX_CPU_LIMIT)]
    sandbox_cpu_limit: sluice_crds::cpu::SandboxCpuLimit,
    /// Namespace whose HookChains marked `enforced: true` are platform baselines: they run before
    /// every tenant's chain at their trigger point and cannot be bypassed.
    #[arg(long, default_value = sluice_crds::DEFAULT_PLATFORM_NAMESPACE)]
    platform_namespace: String,
    /// Where Capabilities may point, comma-separated: `<namespace>/<service>` (either may be `*`),
    /// `host`, `*.domain`, each with an optional `:port` (docs/capabilities.md). Others are refused
    /// at every call. Default: loopback addresses in local mode, built-in endpoints only in kube
    /// mode; given, it replaces the default. The operator takes the same list.
    #[arg(long, env = "SLUICE_ALLOWED_ENDPOINTS", value_name = "LIST")]
    allowed_endpoints: Option<AllowedEndpoints>,
    /// The cluster's DNS domain: a `<namespace>/<service>` entry of --allowed-endpoints allows
    /// `<service>.<namespace>.svc.<this>` and no other domain after `.svc`. Give the operator the
    /// same.
    #[arg(long, env = "SLUICE_CLUSTER_DOMAIN", default_value_t = ClusterDomain::default(), value_name = "DOMAIN")]
    cluster_domain: ClusterDomain,
    /// Directory of the credential sets Capabilities may name (`spec.endpoint.credentials`): one
    /// subdirectory per set, holding `token`, `tls.crt` and `tls.key`, and/or `ca.crt`.
    #[arg(long, value_name = "DIR")]
    capability_credentials: Option<PathBuf>,
    /// Also serve the OpenAI Chat Completions API on this address (`POST /v1/chat/completions`,
    /// `GET /v1/models`), running the chains on every request and reply (docs/openai-proxy.md).
    /// Same TLS and caller policy as --listen.
    #[arg(long, value_name = "ADDR", requires = "openai_upstream")]
    openai_listen: Option<SocketAddr>,
    /// The OpenAI-compatible endpoint the proxy forwards to, e.g. https://api.openai.com/v1.
    #[arg(long, value_name = "URL", requires = "openai_listen")]
    openai_upstream: Option<String>,
    /// A file holding the upstream's API key (re-read on every call; a mounted Secret).
    #[arg(long, value_name = "FILE", requires = "openai_listen")]
    openai_api_key_file: Option<PathBuf>,
    /// How long the upstream may take to answer (and to send the next piece of a stream).
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    openai_upstream_timeout: std::time::Duration,
    /// The target whose chains guard a proxied request whose model no chain serves (and that
    /// sends no x-sluice-target). Without it, such a request is refused (404 target_not_found).
    #[arg(long, value_name = "TARGET", requires = "openai_listen")]
    openai_default_target: Option<String>,
    /// A model the proxy lets through with the platform's baseline alone when no chain serves it
    /// (its answers carry `x-sluice-unguarded: baseline-only`). Repeat for more.
    #[arg(long, value_name = "MODEL", requires = "openai_listen")]
    openai_unguarded_model: Vec<String>,
    /// Also serve MCP servers on this address (Streamable HTTP, each at /mcp/NAME), running the
    /// chains of target NAME on tool lists, tool calls and results and the servers' sampling
    /// requests (docs/mcp.md). Same TLS and caller policy as --listen.
    #[arg(long, value_name = "ADDR", requires = "mcp_server")]
    mcp_listen: Option<SocketAddr>,
    /// An MCP server behind the proxy, as NAME=URL (its Streamable HTTP endpoint): served at
    /// /mcp/NAME and guarded by the chains of target NAME. Repeat for more.
    #[arg(long, value_name = "NAME=URL", requires = "mcp_listen")]
    mcp_server: Vec<sluice_gateway::McpServer>,
    /// How long an MCP server may take to answer (and to send the next event of a stream).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    mcp_upstream_timeout: std::time::Duration,
    /// An MCP server whose non-text content (images, audio, binary resources, which no chain
    /// reads) is passed on; from the others it is dropped. Repeat for more.
    #[arg(long, value_name = "NAME", requires = "mcp_listen")]
    mcp_pass_non_text: Vec<String>,
    /// A file holding the key MCP session ids are sealed under (at least 32 bytes): give every
    /// replica the same one (a Secret) so that any of them serves a session. Without it, a key of
    /// this process: its sessions end with it.
    #[arg(long, value_name = "FILE", requires = "mcp_listen")]
    mcp_session_key_file: Option<PathBuf>,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    log_format: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Traces only when the standard OTEL_* variables ask for them (docs/operations.md).
    let tracing = TracingConfig::from_env(|v| std::env::var(v).ok())?;
    let traces = observability::init(&args.log_format, tracing.as_ref())?;

    let audit = if args.audit == "-" {
        Audit::to_stdout()
    } else {
        Audit::to_file(args.audit.as_ref())?
    };
    let security = Security {
        tls: match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: args.client_ca.clone(),
            }),
            _ => None,
        },
        callers: args.callers.clone(),
        insecure: args.insecure,
    };
    let openai = match (args.openai_listen, &args.openai_upstream) {
        (Some(listen), Some(upstream)) => {
            let mut o = OpenAiOptions::new(listen, upstream.clone());
            o.api_key_file = args.openai_api_key_file.clone();
            o.upstream_timeout = args.openai_upstream_timeout;
            o.default_target = args.openai_default_target.clone();
            o.unguarded_models = args.openai_unguarded_model.clone();
            Some(o)
        }
        _ => None,
    };
    let mcp = args.mcp_listen.map(|listen| {
        let mut o = McpOptions::new(listen, args.mcp_server.clone());
        o.upstream_timeout = args.mcp_upstream_timeout;
        o.pass_non_text = args.mcp_pass_non_text.clone();
        o.session_key_file = args.mcp_session_key_file.clone();
        o
    });
    if let Some(unknown) = args
        .mcp_pass_non_text
        .iter()
        .find(|n| !args.mcp_server.iter().any(|s| &s.name == *n))
    {
        anyhow::bail!("--mcp-pass-non-text {unknown:?} names no --mcp-server");
    }
    let signing = match args.signing.load().map_err(anyhow::Error::msg)? {
        Some((file, problems)) => {
            for p in &problems {
                tracing::error!(file = %file.path().display(), "trusted signers: {p}");
            }
            Some(file)
        }
        None => None,
    };
    let gateway = match &args.local {
        Some(dir) => {
            let mut opts = LocalOptions::new(dir, &args.state_dir);
            opts.listen = args.listen;
            opts.security = security;
            opts.metrics = args.metrics;
            opts.sandbox.runsc = args.runsc;
            opts.python = args.python.clone();
            if let (Some(binary), Some(runtime)) = (args.supervisor, args.cell_runtime) {
                opts.sandbox.program = Some(
                    sluice_engine::SupervisorProgram::at(binary, runtime)
                        .context("the supervisor for local mode's sandboxes")?,
                );
            }
            opts.sandbox.platform = args.platform;
            opts.sandbox.cpu_limit = args.sandbox_cpu_limit;
            opts.platform_namespace = args.platform_namespace;
            if let Some(allowed) = args.allowed_endpoints {
                opts.trust.allowed = allowed;
            }
            opts.trust.allowed = std::mem::take(&mut opts.trust.allowed)
                .in_cluster_domain(args.cluster_domain.clone());
            opts.trust.credentials = args.capability_credentials;
            opts.audit = audit;
            opts.limits.warm_sandboxes = args.max_warm_sandboxes as usize;
            opts.limits.hook_output_bytes = args.hook_output_bytes as usize;
            opts.openai = openai;
            opts.mcp = mcp;
            opts.signing = signing;
            start_local(opts).await?
        }
        None => {
            let exec_keepalive = ExecKeepalive::new(args.exec_ping_every, args.exec_ping_deadline)
                .context("--exec-ping-every/--exec-ping-deadline")?;
            let config = kube::Config::infer()
                .await
                .context("finding the Kubernetes API (in-cluster or KUBECONFIG)")?;
            // kube's own client, on TCP connections with keepalive (a dead peer is noticed).
            let client =
                sluice_sandbox_kube::client(config).context("making the Kubernetes API client")?;
            // The pod's name (downward API) marks the pods this replica claims.
            let identity = std::env::var("POD_NAME")
                .or_else(|_| std::env::var("HOSTNAME"))
                .unwrap_or_else(|_| format!("sluice-gateway-{}", std::process::id()));
            let mut cfg = KubeConfig::new(identity);
            cfg.namespaces = args.namespace.iter().cloned().collect();
            cfg.selector = args.selector.clone().filter(|s| !s.is_empty());
            cfg.sandbox_namespace = args.sandbox_namespace.clone().filter(|ns| !ns.is_empty());
            cfg.claim_timeout = args.claim_timeout;
            cfg.exec_timeout = args.exec_timeout;
            cfg.exec_keepalive = exec_keepalive;
            cfg.hold = args.kube_hold as usize;
            cfg.runtime_class = Some(args.runtime_class.clone()).filter(|r| !r.is_empty());
            let mut opts = KubeOptions::new(client, cfg);
            opts.listen = args.listen;
            opts.security = security;
            opts.metrics = args.metrics;
            opts.audit = audit;
            opts.platform_namespace = args.platform_namespace;
            if let Some(allowed) = args.allowed_endpoints {
                opts.trust.allowed = allowed;
            }
            opts.trust.allowed = std::mem::take(&mut opts.trust.allowed)
                .in_cluster_domain(args.cluster_domain.clone());
            opts.trust.credentials = args.capability_credentials;
            if let Some(python) = args.python {
                opts.python = python.into();
            }
            opts.limits.claim_timeout = args.claim_timeout;
            opts.limits.warm_sandboxes = args.max_warm_sandboxes as usize;
            opts.limits.hook_output_bytes = args.hook_output_bytes as usize;
            opts.openai = openai;
            opts.mcp = mcp;
            opts.signing = signing;
            start_kube(opts).await?
        }
    };

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down: finishing in-flight runs, then destroying sandboxes");
    gateway.shutdown().await;
    traces.shutdown().await;
    Ok(())
}

/// `500ms`, `2s`, `1m`, `1h` (the rule every Sluice duration follows), at most a day: deadlines are
/// added to the clock.
fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let d = sluice_crds::duration::parse_duration(s).map_err(|e| e.to_string())?;
    if d > std::time::Duration::from_secs(24 * 3600) {
        return Err(format!("{s:?} is longer than 24h"));
    }
    Ok(d)
}
