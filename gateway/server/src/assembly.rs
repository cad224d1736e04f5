//! Assembly of a running gateway, in local mode (runsc backend, directory watcher) or kube mode (pod
//! claims over the API server, HookChain and Capability watches), around one gRPC server
//! (Gateway, health, reflection) and metrics, with graceful shutdown. The binary and the tests both
//! start gateways through here.

use crate::callers::ReloadingPolicy;
use crate::mcp::McpOptions;
use crate::openai::OpenAiOptions;
use crate::service::GatewayService;
use crate::tls::{ReloadingTls, TlsFiles, TlsMetrics};
use crate::{dir_watch, local_dir};
use anyhow::Context as _;
use sluice_capabilities::{Runner, Trust};
use sluice_crds::signing::PolicyFile;
use sluice_engine::{Audit, Engine, Limits, Metrics, Pools, SandboxBackend};
use sluice_proto::gateway_server::GatewayServer;
use sluice_sandbox_kube::{KubeBackend, KubeConfig};
use sluice_sandbox_local::{LocalBackend, LocalConfig};
use sluice_source_kube::KubeSource;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How the gRPC listener is secured: TLS (`tls`), who may call (`callers`), and the explicit
/// opt-out for a network-reachable listener without them.
#[derive(Clone, Debug, Default)]
pub struct Security {
    pub tls: Option<TlsFiles>,
    /// A `CallerPolicy` file (`--callers`).
    pub callers: Option<PathBuf>,
    /// Serve a non-loopback address without TLS or without a caller policy (`--insecure`).
    pub insecure: bool,
}

/// A listener anyone on the network could reach, left open without `--insecure`.
#[derive(Debug, thiserror::Error)]
#[error(
    "refusing to listen on {listen} without {missing}: any client that reaches it could pick any \
     namespace. Give --tls-cert/--tls-key and --callers, listen on a loopback address, or pass \
     --insecure to accept the risk"
)]
pub struct ExposureError {
    pub listen: SocketAddr,
    pub missing: &'static str,
}

impl Security {
    /// A loopback listener needs nothing; any other needs TLS and a caller policy, or `insecure`
    /// (then a warning is logged).
    pub fn check_exposure(&self, listen: SocketAddr) -> Result<(), ExposureError> {
        let missing = match (self.tls.is_some(), self.callers.is_some()) {
            (true, true) => return Ok(()),
            (false, false) => "TLS and a caller policy",
            (false, true) => "TLS",
            (true, false) => "a caller policy",
        };
        if listen.ip().is_loopback() {
            return Ok(());
        }
        if !self.insecure {
            return Err(ExposureError { listen, missing });
        }
        tracing::warn!(%listen, missing, "--insecure: serving a network-reachable gRPC listener without {missing}");
        Ok(())
    }

    /// Checks exposure and reads the TLS files and the caller policy: all before the port is bound.
    fn prepare(&self, listen: SocketAddr) -> anyhow::Result<Secured> {
        self.check_exposure(listen)?;
        let callers = match &self.callers {
            Some(path) => Some(Arc::new(ReloadingPolicy::new(path.clone())?)),
            None => None,
        };
        let tls = match &self.tls {
            // Without a caller policy a client certificate is the only way in.
            Some(files) => Some(Arc::new(ReloadingTls::new(
                files.clone(),
                callers.is_none(),
            )?)),
            None => None,
        };
        Ok(Secured { tls, callers })
    }
}

/// The listener's TLS and caller policy, loaded and ready to watch.
struct Secured {
    tls: Option<Arc<ReloadingTls>>,
    callers: Option<Arc<ReloadingPolicy>>,
}

/// The proxies' ports (OpenAI-compatible, MCP), bound at start beside the gRPC port (same TLS and
/// callers).
#[derive(Default)]
struct ProxyPorts {
    openai: Option<(OpenAiOptions, tokio::net::TcpListener)>,
    mcp: Option<(McpOptions, tokio::net::TcpListener)>,
}

impl ProxyPorts {
    /// Checks each proxy's exposure as the gRPC port's, and binds its port.
    async fn bind(
        openai: Option<&OpenAiOptions>,
        mcp: Option<&McpOptions>,
        security: &Security,
    ) -> anyhow::Result<Self> {
        let mut ports = Self::default();
        if let Some(opts) = openai {
            security.check_exposure(opts.listen)?;
            let listener = bind(opts.listen).await?;
            let mut opts = opts.clone();
            opts.listen = listener.local_addr()?;
            ports.openai = Some((opts, listener));
        }
        if let Some(opts) = mcp {
            security.check_exposure(opts.listen)?;
            let listener = bind(opts.listen).await?;
            let mut opts = opts.clone();
            opts.listen = listener.local_addr()?;
            ports.mcp = Some((opts, listener));
        }
        Ok(ports)
    }
}

pub struct LocalOptions {
    /// Directory of HookChain and Capability YAML.
    pub dir: PathBuf,
    pub listen: SocketAddr,
    pub security: Security,
    pub metrics: Option<SocketAddr>,
    pub sandbox: LocalConfig,
    pub audit: Audit,
    pub limits: Limits,
    /// Sandboxes booting at once.
    pub boot_concurrency: usize,
    /// Enforced HookChains in this namespace are platform baselines (`--platform-namespace`).
    pub platform_namespace: String,
    /// A host Python to check hook code with when the directory is read (`--python`); by default
    /// code is checked by the CPython the sandboxes run (the supervisor's cell), so one interpreter
    /// judges and runs it.
    pub python: Option<PathBuf>,
    /// Sandboxes are gVisor containers (runsc, root). Without: the supervisor runs as a plain
    /// process and hooks are walled in by its WebAssembly instances alone (an author's machine
    /// without runsc or root, for `sluice test` and `sluice run`).
    pub gvisor: bool,
    /// Where capabilities may point (loopback by default) and the credentials they may name.
    pub trust: Trust,
    /// The OpenAI-compatible proxy, when it is served (`--openai-listen`).
    pub openai: Option<OpenAiOptions>,
    /// The MCP proxy, when it is served (`--mcp-listen`).
    pub mcp: Option<McpOptions>,
    /// Signed hook code: the trusted signers (read again when they change) and where signatures
    /// are required (`--trusted-signers`, `--signed-namespaces`; docs/signing.md).
    pub signing: Option<Arc<PolicyFile>>,
}

impl LocalOptions {
    pub fn new(dir: impl Into<PathBuf>, state_dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            listen: "127.0.0.1:0".parse().expect("a valid address"),
            security: Security::default(),
            metrics: None,
            sandbox: LocalConfig::new(state_dir),
            audit: Audit::discard(),
            limits: Limits::default(),
            boot_concurrency: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2),
            platform_namespace: sluice_crds::DEFAULT_PLATFORM_NAMESPACE.into(),
            python: None,
            gvisor: true,
            trust: Trust::local(),
            openai: None,
            mcp: None,
            signing: None,
        }
    }
}

pub struct RunningGateway {
    pub addr: SocketAddr,
    /// The OpenAI-compatible proxy's address, when it is served.
    pub openai_addr: Option<SocketAddr>,
    /// The MCP proxy's address, when it is served.
    pub mcp_addr: Option<SocketAddr>,
    pub engine: Arc<Engine>,
    pub health: tonic_health::server::HealthReporter,
    shutdown: Option<oneshot::Sender<()>>,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    /// The proxies' ports, drained beside the gRPC server.
    proxies: Vec<crate::http_port::Running>,
    tasks: Vec<JoinHandle<()>>,
    /// Tasks told to finish (not aborted) once the runs are drained.
    farewells: Vec<Farewell>,
}

/// A task that has something to do before the gateway exits: told by `stop`, awaited a while.
struct Farewell {
    what: &'static str,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// How long the gateway waits at exit for its queued audit lines to be written.
const AUDIT_DRAIN_WITHIN: Duration = Duration::from_secs(10);

/// How long a farewell task may take before the gateway exits without it.
const FAREWELL_WITHIN: Duration = Duration::from_secs(5);

impl RunningGateway {
    pub fn backend(&self) -> &Arc<dyn SandboxBackend> {
        self.engine.pools().backend()
    }

    /// Stops accepting, lets in-flight runs and streams finish, then destroys every sandbox.
    pub async fn shutdown(mut self) {
        self.engine
            .metrics()
            .ready
            .store(false, std::sync::atomic::Ordering::Relaxed);
        // The ports close first: a client the ending of its stream wakes must find them closed.
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        for proxy in &mut self.proxies {
            proxy.stop_accepting().await;
        }
        self.engine.begin_shutdown();
        let proxies = std::mem::take(&mut self.proxies);
        let proxy = futures::future::join_all(
            proxies
                .into_iter()
                .map(|p| p.drain(Duration::from_secs(30))),
        );
        let grpc = tokio::time::timeout(Duration::from_secs(30), &mut self.server);
        let (_, grpc) = tokio::join!(proxy, grpc);
        match grpc {
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "gRPC server ended with an error"),
            Err(_) => {
                tracing::warn!("in-flight requests did not finish within 30 s; closing anyway");
                self.server.abort();
            }
            _ => {}
        }
        for f in std::mem::take(&mut self.farewells) {
            let _ = f.stop.send(());
            let abort = f.task.abort_handle();
            if tokio::time::timeout(FAREWELL_WITHIN, f.task).await.is_err() {
                abort.abort();
                tracing::warn!(
                    within_s = FAREWELL_WITHIN.as_secs(),
                    "stopping without {}: it did not finish in time",
                    f.what
                );
            }
        }
        for t in &self.tasks {
            t.abort();
        }
        self.engine.pools().shutdown(Duration::from_secs(15)).await;
        // Whatever a wedged sandbox left despite that goes too: the gateway exits owning nothing.
        let left = self.engine.pools().backend().clean_leftovers().await;
        if left > 0 {
            tracing::warn!(left, "removed sandboxes that outlived their teardown");
        }
        let engine = self.engine.clone();
        let drained = tokio::task::spawn_blocking(move || engine.drain_audit(AUDIT_DRAIN_WITHIN))
            .await
            .unwrap_or(false);
        if !drained {
            tracing::error!(
                within_s = AUDIT_DRAIN_WITHIN.as_secs(),
                "exiting with audit lines not written: nobody reads the gateway's output"
            );
        }
    }
}

/// Starts a gateway serving the chains under `opts.dir` from local runsc sandboxes.
pub async fn start_local(opts: LocalOptions) -> anyhow::Result<RunningGateway> {
    // The listener's security (a few file reads), then the port: a refused exposure, a bad
    // certificate or "address in use" must not wait for the backend's checks or any boot.
    let secured = opts.security.prepare(opts.listen)?;
    let listener = bind(opts.listen).await?;
    let ports = ProxyPorts::bind(opts.openai.as_ref(), opts.mcp.as_ref(), &opts.security).await?;
    let rollouts_file = opts.sandbox.state_dir.join("rollouts.json");
    let backend: Arc<dyn SandboxBackend> = if opts.gvisor {
        Arc::new(
            LocalBackend::new(opts.sandbox.clone())
                .await
                .context("preparing the runsc sandbox backend")?,
        )
    } else {
        let program = match opts.sandbox.program.clone() {
            Some(p) => p,
            None => sluice_engine::SupervisorProgram::locate()
                .context("finding the supervisor for WebAssembly-only sandboxes")?,
        };
        Arc::new(sluice_sandbox_process::ProcessBackend::with_program(
            program,
        ))
    };
    let removed = backend.clean_leftovers().await;
    if removed > 0 {
        tracing::warn!(
            removed,
            "removed sandboxes left behind by an earlier gateway"
        );
    }
    let metrics = Metrics::new();
    let engine = engine(
        backend,
        opts.audit,
        metrics,
        &opts.limits,
        opts.boot_concurrency,
        opts.trust,
    );
    // A restart in the middle of a rollout goes on with the live hooks it had, not the chain
    // file's candidate.
    engine.keep_rollouts_in(rollouts_file);
    let checker = match &opts.python {
        Some(python) => sluice_crds::code::Interpreter::Python(python.clone()),
        None => local_dir::code_checker(opts.sandbox.program.as_ref()),
    };
    let mut source = local_dir::LocalSource::new(&opts.dir, &opts.platform_namespace, checker);
    if let Some(signing) = &opts.signing {
        source = source.with_signing(signing.clone());
    }
    // Reading checks hook code with python: kept off the async workers, each file bounded in time.
    let (source, registry) = tokio::task::spawn_blocking(move || {
        let registry = source.reload(local_dir::CHECK_BOUND);
        (source, registry)
    })
    .await
    .context("reading the chain directory")?;
    let registry = registry.with_context(|| format!("reading {}", opts.dir.display()))?;
    registry.log_summary();
    engine.set_registry(registry).await;
    let source = tokio::spawn(dir_watch::watch(engine.clone(), opts.dir.clone(), source));
    let running = serve(
        engine,
        listener,
        secured,
        ports,
        opts.metrics,
        &opts.limits,
        vec![source],
    )
    .await?;
    tracing::info!(addr = %running.addr, dir = %opts.dir.display(), "sluice gateway listening (local mode)");
    Ok(running)
}

pub struct KubeOptions {
    pub client: kube::Client,
    pub kube: KubeConfig,
    pub listen: SocketAddr,
    pub security: Security,
    pub metrics: Option<SocketAddr>,
    pub audit: Audit,
    pub limits: Limits,
    /// How long the watches may take to list everything at start.
    pub sync_timeout: Duration,
    /// Where enforced baseline chains live.
    pub platform_namespace: String,
    /// What checks each HookChain generation's code: the sandboxes' own CPython (the supervisor and
    /// cell runtime beside the gateway, as its image has them), else `python3` on `PATH`.
    pub python: sluice_crds::code::Interpreter,
    /// Where capabilities may point (built-ins only by default) and the credentials they may name.
    pub trust: Trust,
    /// The OpenAI-compatible proxy, when it is served (`--openai-listen`).
    pub openai: Option<OpenAiOptions>,
    /// The MCP proxy, when it is served (`--mcp-listen`).
    pub mcp: Option<McpOptions>,
    /// Signed hook code: the trusted signers (read again when they change) and where signatures
    /// are required (`--trusted-signers`, `--signed-namespaces`; docs/signing.md).
    pub signing: Option<Arc<PolicyFile>>,
}

impl KubeOptions {
    pub fn new(client: kube::Client, kube: KubeConfig) -> Self {
        Self {
            client,
            kube,
            listen: "127.0.0.1:0".parse().expect("a valid address"),
            security: Security::default(),
            metrics: None,
            audit: Audit::discard(),
            limits: Limits::default(),
            sync_timeout: Duration::from_secs(30),
            platform_namespace: sluice_crds::DEFAULT_PLATFORM_NAMESPACE.into(),
            python: sluice_crds::code::Interpreter::cell_or("python3"),
            trust: Trust::cluster(),
            openai: None,
            mcp: None,
            signing: None,
        }
    }
}

/// Starts a gateway serving the cluster's HookChains from warm pods the operator keeps, claimed and
/// reached through the API server.
pub async fn start_kube(mut opts: KubeOptions) -> anyhow::Result<RunningGateway> {
    // A gateway confined to some namespaces still serves the platform's baselines: it watches the
    // platform namespace's chains, capabilities and pods too.
    if !opts.kube.namespaces.is_empty() && !opts.kube.namespaces.contains(&opts.platform_namespace)
    {
        opts.kube.namespaces.push(opts.platform_namespace.clone());
    }
    let secured = opts.security.prepare(opts.listen)?;
    let listener = bind(opts.listen).await?;
    let ports = ProxyPorts::bind(opts.openai.as_ref(), opts.mcp.as_ref(), &opts.security).await?;
    let metrics = Metrics::new();
    let backend = KubeBackend::new(
        opts.client.clone(),
        opts.kube.clone(),
        metrics.pod_claims.clone(),
        opts.sync_timeout,
    )
    .await
    .context("watching sandbox pods")?;
    let removed = backend.clean_leftovers().await;
    if removed > 0 {
        tracing::warn!(
            removed,
            "deleted pods an earlier run of this gateway had claimed"
        );
    }
    // A run waits a little longer than one pod claim may take, so that the claim's own error (no
    // warm pod, API failure) is what the caller hears.
    let mut limits = opts.limits.clone();
    limits.claim_timeout = limits
        .claim_timeout
        .max(opts.kube.claim_timeout + Duration::from_millis(250));
    // A held pod's exec stream crosses the API server and the kubelet, which cut it after 4 h idle
    // and may leave it half-open: its supervisor is pinged when silent this long.
    limits.keepalive.get_or_insert(KUBE_KEEPALIVE);
    // Claims are API calls, not boots: many may be in flight at once.
    let engine = engine(
        Arc::new(backend),
        opts.audit,
        metrics,
        &limits,
        256,
        opts.trust.clone(),
    );
    // A canary this gateway finds out of bounds is rolled back for the whole cluster: the
    // operator and the other gateways follow the annotation as they would a person's.
    engine.report_rollbacks_to(Arc::new(sluice_source_kube::AnnotateRollback::new(
        opts.client.clone(),
    )));
    let mut source = KubeSource::start(
        opts.client.clone(),
        &opts.kube.namespaces,
        opts.kube.selector.as_deref(),
        &opts.platform_namespace,
        opts.python.clone(),
        opts.sync_timeout,
    )
    .await?;
    if let Some(signing) = &opts.signing {
        source = source.with_signing(signing.clone());
    }
    let registry = source.registry().await;
    registry.log_summary();
    engine.set_registry(registry).await;
    let feed = tokio::spawn(source.feed(engine.clone()));
    let (stop_shadows, stop) = oneshot::channel();
    let shadows = tokio::spawn(sluice_source_kube::publish_shadows(
        opts.client.clone(),
        opts.kube.identity.clone(),
        sluice_source_kube::ShadowTimes {
            every: opts.kube.shadow_status_every,
            renew: opts.kube.heartbeat,
        },
        Arc::downgrade(&engine),
        stop,
    ));
    let mut running = serve(
        engine,
        listener,
        secured,
        ports,
        opts.metrics,
        &limits,
        vec![feed],
    )
    .await?;
    running.farewells.push(Farewell {
        what: "taking this gateway's shadow comparisons out of the chains' status",
        stop: stop_shadows,
        task: shadows,
    });
    tracing::info!(addr = %running.addr, identity = %opts.kube.identity, "sluice gateway listening (kube mode)");
    Ok(running)
}

/// How long a held pod's supervisor may stay silent before the gateway pings it.
const KUBE_KEEPALIVE: Duration = Duration::from_secs(30);

fn engine(
    backend: Arc<dyn SandboxBackend>,
    audit: Audit,
    metrics: Metrics,
    limits: &Limits,
    boot_concurrency: usize,
    trust: Trust,
) -> Arc<Engine> {
    tracing::info!(allowed_endpoints = %trust.allowed, credentials = ?trust.credentials, "capability trust");
    let pools = Pools::new(backend, limits.clone(), metrics.clone(), boot_concurrency);
    let capabilities = Arc::new(Runner::new(metrics.clone(), limits.clone(), trust));
    Engine::new(pools, audit, metrics, limits.clone(), capabilities)
}

/// Answers go out as soon as they are written: without TCP_NODELAY, a reply written in two pieces
/// (headers, then data and trailers) waits for the client's delayed ACK, ~40 ms on Linux. tonic sets
/// it only on listeners it binds itself, and this one is bound ahead (`bind`).
pub(crate) fn no_delay(stream: &tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "could not set TCP_NODELAY");
    }
}

/// The accepted connections of a plain (non-TLS) listener, each with `no_delay`.
fn plain_incoming(
    listener: tokio::net::TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener)
        .map(|accepted| accepted.inspect(no_delay))
}

/// Binds the gRPC port. Done before anything else at start, so a port in use is reported at once.
async fn bind(listen: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))
}

/// The gRPC server (Gateway, health, reflection) and metrics around an engine whose registry is
/// loaded, on a port already bound. Health turns SERVING once every gateway-kept pool is warm.
async fn serve(
    engine: Arc<Engine>,
    listener: tokio::net::TcpListener,
    secured: Secured,
    ports: ProxyPorts,
    metrics_addr: Option<SocketAddr>,
    limits: &Limits,
    mut tasks: Vec<JoinHandle<()>>,
) -> anyhow::Result<RunningGateway> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_not_serving::<GatewayServer<GatewayService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(sluice_proto::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building the reflection service")?;
    let registry = &engine.metrics().registry;
    if let Some(callers) = &secured.callers {
        let reloads = crate::callers::reload_counter(registry)
            .inspect_err(|e| tracing::warn!(error = %e, "caller policy metrics not registered"))
            .ok();
        tasks.push(tokio::spawn(callers.clone().watch(reloads)));
    }
    let mut proxies = Vec::new();
    let openai_addr = match ports.openai {
        Some((opts, listener)) => {
            proxies.push(crate::openai::start(
                engine.clone(),
                secured.callers.clone(),
                secured.tls.clone(),
                listener,
                &opts,
            )?);
            Some(opts.listen)
        }
        None => None,
    };
    let mcp_addr = match ports.mcp {
        Some((opts, listener)) => {
            proxies.push(crate::mcp::start(
                engine.clone(),
                secured.callers.clone(),
                secured.tls.clone(),
                listener,
                &opts,
            )?);
            Some(opts.listen)
        }
        None => None,
    };
    let service = GatewayServer::new(GatewayService {
        engine: engine.clone(),
        callers: secured.callers,
    })
    .max_decoding_message_size(limits.request_bytes)
    .max_encoding_message_size(limits.request_bytes * 2);
    let addr = listener.local_addr()?;
    let (tx, rx) = oneshot::channel::<()>();
    // Health and reflection answer anyone (probes, grpcurl); only Gateway checks callers.
    let router = tonic::transport::Server::builder()
        .layer(tower::util::MapResponseLayer::new(
            oversized_is_invalid_argument,
        ))
        .layer(tower::util::MapResponseLayer::new(
            crate::handback::after_answer,
        ))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(service);
    let stop = async {
        let _ = rx.await;
    };
    let server = match secured.tls {
        Some(tls) => {
            let metrics = TlsMetrics::register(registry)
                .inspect_err(|e| tracing::warn!(error = %e, "TLS metrics not registered"))
                .ok();
            tasks.push(tokio::spawn(tls.clone().watch(metrics)));
            let (incoming, accept) = tls.incoming(listener);
            tasks.push(accept);
            tokio::spawn(router.serve_with_incoming_shutdown(incoming, stop))
        }
        None => tokio::spawn(router.serve_with_incoming_shutdown(plain_incoming(listener), stop)),
    };
    let ready = {
        let (engine, health) = (engine.clone(), health.clone());
        tokio::spawn(async move {
            let began = std::time::Instant::now();
            let needs_warm = engine.pools().ready_needs_warm();
            if needs_warm {
                let p = engine.pools().warm_progress();
                tracing::info!(
                    chains = p.chains,
                    warm_target = p.target,
                    max_warm = p.cap,
                    "warming up sandboxes before reporting ready"
                );
            }
            while needs_warm && !engine.pools().wait_warm(Duration::from_secs(5)).await {
                let p = engine.pools().warm_progress();
                tracing::info!(
                    warm = p.warm,
                    warm_target = p.target,
                    booting = p.booting,
                    max_warm = p.cap,
                    "waiting for warm sandboxes before reporting ready; below target: {}",
                    p.below.join(", ")
                );
            }
            let p = engine.pools().warm_progress();
            tracing::info!(
                chains = p.chains,
                warm = p.warm,
                warm_target = p.target,
                after_ms = began.elapsed().as_millis() as u64,
                "ready to serve"
            );
            health.set_serving::<GatewayServer<GatewayService>>().await;
            engine
                .metrics()
                .ready
                .store(true, std::sync::atomic::Ordering::Relaxed);
        })
    };
    tasks.push(ready);
    if let Some(maddr) = metrics_addr {
        let m = engine.metrics().clone();
        let weak = Arc::downgrade(&engine);
        tasks.push(tokio::spawn(async move {
            if let Err(e) = serve_metrics(m, weak, maddr).await {
                tracing::error!(error = %e, "metrics endpoint failed");
            }
        }));
    }
    Ok(RunningGateway {
        addr,
        openai_addr,
        mcp_addr,
        proxies,
        engine,
        health,
        shutdown: Some(tx),
        server,
        tasks,
        farewells: Vec::new(),
    })
}

/// tonic refuses a request over the message limit with OUT_OF_RANGE before our code sees it; the API
/// promises INVALID_ARGUMENT for an oversized request, so that one status is rewritten.
fn oversized_is_invalid_argument<B>(
    mut resp: tonic::codegen::http::Response<B>,
) -> tonic::codegen::http::Response<B> {
    let headers = resp.headers_mut();
    // grpc-message is percent-encoded (spaces as %20).
    let too_large = headers
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .is_some_and(|m| m.replace("%20", " ").contains("message length too large"));
    if too_large && headers.get("grpc-status").is_some_and(|s| s == "11") {
        headers.insert(
            "grpc-status",
            tonic::codegen::http::HeaderValue::from_static("3"),
        );
    }
    resp
}

/// Serves `GET /metrics`, `/healthz` (the process answers), `/readyz` (ready to serve runs) and
/// `/rollouts` (every chain's rollout as JSON, `docs/rollout.md`) on `addr` until the process ends.
async fn serve_metrics(
    metrics: Metrics,
    engine: std::sync::Weak<Engine>,
    addr: SocketAddr,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "metrics listening");
    let rollouts: sluice_telemetry::Page = (
        "/rollouts",
        Arc::new(move || {
            let status = engine.upgrade().map(|e| e.rollouts()).unwrap_or_default();
            let mut body = serde_json::to_vec_pretty(&serde_json::json!({ "rollouts": status }))
                .unwrap_or_default();
            body.push(b'\n');
            body
        }),
    );
    sluice_telemetry::serve_endpoint(
        listener,
        metrics.registry.clone(),
        Some(metrics.ready.clone()),
        vec![rollouts],
    )
    .await
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn accepted_connections_do_not_wait_for_delayed_acks() {
        use tokio_stream::StreamExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = std::pin::pin!(super::plain_incoming(listener));
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(accepted.nodelay().unwrap(), "TCP_NODELAY is not set");
    }
}
