//! Assembly of a running gateway in local mode: runsc backend, engine, directory watcher, gRPC server
//! (Gateway, health, reflection) and metrics, with graceful shutdown. The binary and the tests both
//! start gateways through here.

use crate::audit::Audit;
use crate::engine::Engine;
use crate::limits::Limits;
use crate::local_dir;
use crate::metrics::Metrics;
use crate::pool::Pools;
use crate::proto::gateway_server::GatewayServer;
use crate::sandbox::SandboxBackend;
use crate::sandbox::local::{LocalBackend, LocalConfig};
use crate::server::GatewayService;
use anyhow::Context as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub struct LocalOptions {
    /// Directory of HookChain and Capability YAML.
    pub dir: PathBuf,
    pub listen: SocketAddr,
    pub metrics: Option<SocketAddr>,
    pub sandbox: LocalConfig,
    pub audit: Audit,
    pub limits: Limits,
    /// Sandboxes booting at once.
    pub boot_concurrency: usize,
    /// Enforced HookChains in this namespace are platform baselines (`--platform-namespace`).
    pub platform_namespace: String,
}

impl LocalOptions {
    pub fn new(dir: impl Into<PathBuf>, state_dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            listen: "127.0.0.1:0".parse().expect("a valid address"),
            metrics: None,
            sandbox: LocalConfig::new(state_dir),
            audit: Audit::discard(),
            limits: Limits::default(),
            boot_concurrency: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2),
            platform_namespace: sluice_crds::DEFAULT_PLATFORM_NAMESPACE.into(),
        }
    }
}

pub struct RunningGateway {
    pub addr: SocketAddr,
    pub engine: Arc<Engine>,
    pub health: tonic_health::server::HealthReporter,
    shutdown: Option<oneshot::Sender<()>>,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningGateway {
    pub fn backend(&self) -> &Arc<dyn SandboxBackend> {
        self.engine.pools.backend()
    }

    /// Stops accepting, lets in-flight runs and streams finish, then destroys every sandbox.
    pub async fn shutdown(mut self) {
        self.engine.begin_shutdown();
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match tokio::time::timeout(Duration::from_secs(30), &mut self.server).await {
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "gRPC server ended with an error"),
            Err(_) => {
                tracing::warn!("in-flight requests did not finish within 30 s; closing anyway");
                self.server.abort();
            }
            _ => {}
        }
        for t in &self.tasks {
            t.abort();
        }
        self.engine.pools.shutdown(Duration::from_secs(15)).await;
        // Whatever a wedged sandbox left despite that goes too: the gateway exits owning nothing.
        let left = self.engine.pools.backend().clean_leftovers().await;
        if left > 0 {
            tracing::warn!(left, "removed sandboxes that outlived their teardown");
        }
    }
}

/// Starts a gateway serving the chains under `opts.dir` from local runsc sandboxes.
pub async fn start_local(opts: LocalOptions) -> anyhow::Result<RunningGateway> {
    let backend = LocalBackend::new(opts.sandbox.clone())
        .await
        .context("preparing the runsc sandbox backend")?;
    let removed = backend.clean_leftovers().await;
    if removed > 0 {
        tracing::warn!(
            removed,
            "removed sandboxes left behind by an earlier gateway"
        );
    }
    let metrics = Metrics::new();
    let pools = Pools::new(
        Arc::new(backend),
        opts.limits.clone(),
        metrics.clone(),
        opts.boot_concurrency,
    );
    let engine = Arc::new(Engine::new(
        pools,
        opts.audit,
        metrics.clone(),
        opts.limits.clone(),
    ));
    let registry = local_dir::load_for(&opts.dir, &opts.platform_namespace)
        .with_context(|| format!("reading {}", opts.dir.display()))?;
    report(&registry);
    engine.set_registry(registry).await;

    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_not_serving::<GatewayServer<GatewayService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building the reflection service")?;
    let service = GatewayServer::new(GatewayService {
        engine: engine.clone(),
    })
    .max_decoding_message_size(opts.limits.request_bytes)
    .max_encoding_message_size(opts.limits.request_bytes * 2);
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .with_context(|| format!("binding {}", opts.listen))?;
    let addr = listener.local_addr()?;
    let (tx, rx) = oneshot::channel::<()>();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .layer(tower::util::MapResponseLayer::new(
                oversized_is_invalid_argument,
            ))
            .add_service(health_service)
            .add_service(reflection)
            .add_service(service)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                async {
                    let _ = rx.await;
                },
            ),
    );
    let mut tasks = vec![tokio::spawn(watch(
        engine.clone(),
        opts.dir.clone(),
        opts.platform_namespace.clone(),
    ))];
    // Ready once the registry is loaded and the warm pools are filled.
    let ready = {
        let (engine, health) = (engine.clone(), health.clone());
        tokio::spawn(async move {
            while !engine.pools.wait_warm(Duration::from_secs(5)).await {
                tracing::info!("waiting for warm sandboxes before reporting ready");
            }
            health.set_serving::<GatewayServer<GatewayService>>().await;
        })
    };
    tasks.push(ready);
    if let Some(maddr) = opts.metrics {
        let m = metrics.clone();
        tasks.push(tokio::spawn(async move {
            if let Err(e) = m.serve(maddr).await {
                tracing::error!(error = %e, "metrics endpoint failed");
            }
        }));
    }
    tracing::info!(%addr, dir = %opts.dir.display(), "sluice gateway listening (local mode)");
    Ok(RunningGateway {
        addr,
        engine,
        health,
        shutdown: Some(tx),
        server,
        tasks,
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

fn report(registry: &crate::registry::Registry) {
    for e in &registry.errors {
        tracing::error!("{e}");
    }
    let mut chains: Vec<String> = registry
        .all_chains()
        .map(|c| {
            format!(
                "{} ({} at {}{})",
                c.qualified_name(),
                c.spec.target,
                c.spec.trigger_point,
                if c.spec.enforced { ", enforced" } else { "" }
            )
        })
        .collect();
    chains.sort();
    tracing::info!(
        chains = chains.len(),
        capabilities = registry.capabilities.len(),
        errors = registry.errors.len(),
        "registry loaded: {}",
        chains.join(", ")
    );
}

/// Re-reads the directory whenever its YAML files change and swaps the registry.
async fn watch(engine: Arc<Engine>, dir: PathBuf, platform_namespace: String) {
    let mut seen = local_dir::fingerprint(&dir);
    loop {
        tokio::time::sleep(local_dir::POLL).await;
        let now = local_dir::fingerprint(&dir);
        if now == seen {
            continue;
        }
        seen = now;
        match local_dir::load_for(&dir, &platform_namespace) {
            Ok(registry) => {
                report(&registry);
                engine.set_registry(registry).await;
            }
            Err(e) => {
                tracing::error!(dir = %dir.display(), error = %e, "cannot read the chain directory; keeping the last registry")
            }
        }
    }
}
