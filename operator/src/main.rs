//! `sluice-operator run` (the controller) and `sluice-operator render FILE` (what it would create).

use clap::{Args, Parser, Subcommand};
use kube::{Api, Client};
use sluice_crds::cpu::SandboxCpuLimit;
use sluice_crds::duration::parse_duration;
use sluice_crds::endpoints::{AllowedEndpoints, ClusterDomain};
use sluice_crds::manifest::PlatformRules;
use sluice_operator::certs::{CertConfig, Keeper, ServingCert, WebhookFiles};
use sluice_operator::controller::{self, LeaseTiming, RunConfig};
use sluice_operator::leader::{self, LeaseLock};
use sluice_operator::metrics::Metrics;
use sluice_operator::reconcile::build::{Settings, default_supervisor_image};
use sluice_operator::webhook::{Judge, Webhook, WebhookConfig};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use tokio::sync::watch;

#[derive(Parser)]
#[command(
    name = "sluice-operator",
    version,
    about = "Keeps warm gVisor sandbox pools for Sluice HookChains"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the controller (only the replica holding the leader lease reconciles).
    Run(Box<RunArgs>),
    /// Print as YAML the objects the operator would create for the HookChains in FILE.
    Render {
        file: PathBuf,
        #[command(flatten)]
        pod: PodArgs,
    },
}

#[derive(Args, Clone)]
struct PodArgs {
    /// RuntimeClass of every sandbox pod.
    #[arg(long, default_value = "gvisor")]
    runtime_class: String,
    /// Image of the sandbox pods (the supervisor).
    #[arg(long, default_value_t = default_supervisor_image())]
    supervisor_image: String,
    /// Create every sandbox pod (and its NetworkPolicy) in this namespace instead of beside its
    /// HookChain: the operator's pod rights and the gateway's exec rights are then that namespace's
    /// only. A chain's pods there are deleted with it through the operator's finalizer.
    #[arg(long)]
    sandbox_namespace: Option<String>,
    /// The most CPU one sandbox pod may use (its CPU limit; `none` for no limit). A chain's
    /// `resources.cpu` is its pods' request, and may not be more than this.
    #[arg(long, default_value = sluice_crds::cpu::DEFAULT_SANDBOX_CPU_LIMIT)]
    sandbox_cpu_limit: SandboxCpuLimit,
}

impl PodArgs {
    fn settings(&self) -> Settings {
        Settings {
            runtime_class: self.runtime_class.clone(),
            supervisor_image: self.supervisor_image.clone(),
            sandbox_namespace: self.sandbox_namespace.clone().filter(|ns| !ns.is_empty()),
            sandbox_cpu_limit: self.sandbox_cpu_limit,
        }
    }
}

/// The validating admission webhook (off unless --webhook-listen is given).
#[derive(Args, Clone, Debug)]
struct WebhookArgs {
    /// Serve the validating admission webhook for HookChains and Capabilities (HTTPS) on this
    /// address, on every replica (leader or not).
    #[arg(long, requires_all = ["webhook_cert", "webhook_key"])]
    webhook_listen: Option<SocketAddr>,
    /// PEM certificate chain the webhook serves; read again whenever the file changes.
    #[arg(long, requires = "webhook_listen")]
    webhook_cert: Option<PathBuf>,
    /// PEM private key of --webhook-cert; read again whenever the file changes.
    #[arg(long, requires = "webhook_listen")]
    webhook_key: Option<PathBuf>,
    /// A host Python to parse hook code with, for the webhook and the reconciler. Default: the
    /// sandboxes' own CPython (`sluice-supervisor` and `sluice-cell.cwasm` beside this binary, as
    /// the image has them), so the interpreter that runs a hook judges it; python3 where they are
    /// not.
    #[arg(long = "python", alias = "webhook-python")]
    python: Option<PathBuf>,
    #[command(flatten)]
    signing: sluice_crds::signing::SigningArgs,
    /// A review not finished in this long is refused as unfinished; keep it under the webhook's
    /// timeoutSeconds so the reason reaches kubectl (8s, 1500ms).
    #[arg(long, default_value = "8s", value_parser = parse_duration)]
    webhook_review_timeout: Duration,
}

impl WebhookArgs {
    fn config(&self, rules: &PlatformRules) -> Option<WebhookConfig> {
        Some(WebhookConfig {
            listen: self.webhook_listen?,
            cert: self.webhook_cert.clone()?,
            key: self.webhook_key.clone()?,
            judge: Judge {
                python: sluice_operator::code_checker(),
                rules: rules.clone(),
            },
            review_timeout: self.webhook_review_timeout,
        })
    }
}

/// Certificates the operator makes and keeps itself (off unless --ca-secret is given).
#[derive(Args, Clone, Debug)]
struct CertArgs {
    /// Make a CA in this Secret (of the operator's namespace) and keep it: made again in the last
    /// third of its lifetime, the older one trusted until it expires.
    #[arg(long)]
    ca_secret: Option<String>,
    /// The ConfigMap its clients read the CA bundle from (key ca.crt); default: --ca-secret's name.
    #[arg(long, requires = "ca_secret")]
    ca_configmap: Option<String>,
    /// A serving certificate to keep, SECRET=DNS[,DNS...] (kubernetes.io/tls, with ca.crt); repeat
    /// for each.
    #[arg(long = "serving-certificate", requires = "ca_secret")]
    serving: Vec<ServingCert>,
    /// Keep the caBundle of every webhook of this ValidatingWebhookConfiguration.
    #[arg(long, requires = "ca_secret")]
    webhook_configuration: Option<String>,
    /// The webhook serves the certificate kept in this Secret (one of --serving-certificate),
    /// written to --webhook-cert and --webhook-key on every replica.
    #[arg(long, requires_all = ["ca_secret", "webhook_listen"])]
    webhook_cert_secret: Option<String>,
    #[arg(long, default_value = "87600h", value_parser = parse_duration)]
    ca_lifetime: Duration,
    /// Lifetime of each serving certificate; renewed in its last third.
    #[arg(long, default_value = "2160h", value_parser = parse_duration)]
    certificate_lifetime: Duration,
    /// How often the certificates are looked at.
    #[arg(long, default_value = "1m", value_parser = parse_duration)]
    certificate_check: Duration,
}

impl CertArgs {
    fn config(&self, namespace: &str, webhook: &WebhookArgs) -> Result<Option<CertConfig>, String> {
        let Some(ca_secret) = self.ca_secret.clone() else {
            return Ok(None);
        };
        let webhook_files = match &self.webhook_cert_secret {
            None => None,
            Some(secret) => {
                if !self.serving.iter().any(|s| &s.secret == secret) {
                    return Err(format!(
                        "--webhook-cert-secret {secret} is not one of the --serving-certificate Secrets"
                    ));
                }
                let (Some(cert), Some(key)) = (&webhook.webhook_cert, &webhook.webhook_key) else {
                    return Err(
                        "--webhook-cert-secret needs --webhook-cert and --webhook-key".into(),
                    );
                };
                Some(WebhookFiles {
                    secret: secret.clone(),
                    cert: cert.clone(),
                    key: key.clone(),
                })
            }
        };
        Ok(Some(CertConfig {
            namespace: namespace.to_string(),
            ca_config_map: self
                .ca_configmap
                .clone()
                .unwrap_or_else(|| ca_secret.clone()),
            ca_secret,
            serving: self.serving.clone(),
            webhook_configuration: self.webhook_configuration.clone(),
            webhook_files,
            ca_lifetime: self.ca_lifetime,
            serving_lifetime: self.certificate_lifetime,
            check_every: self.certificate_check,
        }))
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    pod: PodArgs,
    #[command(flatten)]
    webhook: WebhookArgs,
    #[command(flatten)]
    certs: CertArgs,
    /// Address of the /metrics and /healthz server.
    #[arg(long, default_value = "0.0.0.0:9465")]
    metrics: SocketAddr,
    /// Namespace of the leader Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "sluice-system")]
    lease_namespace: String,
    /// Name of the leader Lease.
    #[arg(long, default_value = "sluice-operator")]
    lease_name: String,
    /// Claimed pods held longer than this are deleted (300s, 5m, 1500ms).
    #[arg(long, default_value = "300s", value_parser = parse_duration)]
    claim_deadline: Duration,
    /// New pods not ready this long after they were scheduled are deleted and replaced (one at a time
    /// while they keep failing), unless the scheduler cannot place them.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    start_deadline: Duration,
    /// Watch only this namespace (default: all), and the platform namespace besides.
    #[arg(long)]
    namespace: Option<String>,
    /// Keep only the HookChains and Capabilities this label selector matches
    /// (`sluice.dev/release=staging`, `sluice.dev/release!=staging`; give the gateway the same), so
    /// that several releases share namespaces. Default: all.
    #[arg(long)]
    selector: Option<String>,
    /// The namespace whose enforced HookChains are platform baselines (as the gateway's flag):
    /// with --namespace, its chains, Capabilities and pods are kept as well.
    #[arg(long, default_value = sluice_crds::DEFAULT_PLATFORM_NAMESPACE)]
    platform_namespace: String,
    /// Where Capabilities may point, comma-separated: `<namespace>/<service>` (either may be `*`),
    /// `host`, `*.domain`, each with an optional `:port`. Others are refused by the webhook and
    /// marked Ready=False (EndpointNotAllowed). Empty: built-in endpoints only. Give the gateway
    /// the same list.
    #[arg(long, env = "SLUICE_ALLOWED_ENDPOINTS", default_value = "")]
    allowed_endpoints: AllowedEndpoints,
    /// The cluster's DNS domain: a `<namespace>/<service>` entry of --allowed-endpoints allows
    /// `<service>.<namespace>.svc.<this>` and no other domain after `.svc`. Give the gateway the
    /// same.
    #[arg(long, env = "SLUICE_CLUSTER_DOMAIN", default_value_t = ClusterDomain::default(), value_name = "DOMAIN")]
    cluster_domain: ClusterDomain,
    /// This replica's identity in the Lease and in Events.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Watch the cluster's nodes: claimed pods on a cordoned or lost node are marked draining and
    /// the pool is made again elsewhere (docs/kubernetes.md, "Drains, lost nodes and operator
    /// failover"). `--watch-nodes=false` for installs without the right to read nodes.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    watch_nodes: bool,
}

fn identity(given: Option<String>) -> String {
    given.filter(|s| !s.is_empty()).unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "sluice-operator".into());
        format!("{host}-{}", std::process::id())
    })
}

/// Resolves on the first SIGTERM or SIGINT.
async fn signalled() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; stop with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let client = Client::try_default().await?;
    let metrics = Metrics::new();
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        signalled().await;
        stop_tx.send_replace(true);
    });
    // Certificates first: the webhook below serves the pair the keeper writes.
    let certs = args
        .certs
        .config(&args.lease_namespace, &args.webhook)
        .map_err(|e| anyhow::anyhow!(e))?;
    if let Some(certs) = certs {
        let keeper = Keeper::new(client.clone(), certs);
        if keeper.first_pass(&mut stop_rx.clone()).await.is_none() {
            return Ok(());
        }
        tokio::spawn(keeper.run(stop_rx.clone()));
    }
    // Every replica answers admission reviews; only the leader reconciles. Bound before /healthz
    // answers, so a replica is never ready (in the webhook Service) without its webhook.
    let allowed_endpoints = args
        .allowed_endpoints
        .clone()
        .in_cluster_domain(args.cluster_domain.clone());
    let rules = PlatformRules {
        platform_namespace: args.platform_namespace.clone(),
        allowed_endpoints: allowed_endpoints.clone(),
        sandbox_cpu_limit: args.pod.sandbox_cpu_limit,
        signing: sluice_operator::signing(),
    };
    if let Some(webhook) = args.webhook.config(&rules) {
        let webhook = Webhook::bind(webhook).await?.with_metrics(metrics.clone());
        tokio::spawn(webhook.serve(stop_rx.clone()));
    }
    let listener = tokio::net::TcpListener::bind(args.metrics)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen for metrics on {}: {e}", args.metrics))?;
    tokio::spawn(metrics.clone().serve_on(listener));

    let config = RunConfig {
        settings: args.pod.settings(),
        claim_deadline: args.claim_deadline,
        start_deadline: args.start_deadline,
        namespace: args.namespace,
        selector: args.selector.filter(|s| !s.is_empty()),
        platform_namespace: args.platform_namespace,
        allowed_endpoints,
        identity: identity(args.identity),
        watch_nodes: args.watch_nodes,
    };
    tracing::info!(identity = %config.identity, runtime_class = %config.settings.runtime_class,
        image = %config.settings.supervisor_image,
        sandbox_namespace = ?config.settings.sandbox_namespace, namespaces = ?config.watched_namespaces(), "starting");

    let lock = LeaseLock::new(
        Api::namespaced(client.clone(), &args.lease_namespace),
        &args.lease_name,
        &config.identity,
        leader::LEASE_DURATION,
    );
    controller::run_when_leading(
        client,
        config,
        metrics,
        lock,
        LeaseTiming::default(),
        stop_rx,
    )
    .await;
    tracing::info!("stopped");
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Render { file, pod } => {
            let out = sluice_operator::render::render(&file, &pod.settings());
            print!("{}", out.yaml);
            for p in &out.problems {
                eprintln!("{p}");
            }
            if out.problems.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Command::Run(args) => {
            if let Some(python) = &args.webhook.python {
                sluice_operator::set_code_checker(python.clone().into());
            }
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| "info,kube=warn".into()),
                )
                .json()
                .init();
            if let Err(e) = trust_signers(&args.webhook.signing) {
                eprintln!("sluice-operator: {e}");
                return ExitCode::FAILURE;
            }
            let rt = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("sluice-operator: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(run(*args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(error = %e, "sluice-operator failed");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// Loads the trusted signers at `path` for the webhook and the reconciler, and reads them again
/// every few seconds: a key added or removed needs no restart.
fn trust_signers(args: &sluice_crds::signing::SigningArgs) -> anyhow::Result<()> {
    use sluice_crds::signing::Reread;
    let Some((file, problems)) = args.load().map_err(anyhow::Error::msg)? else {
        return Ok(());
    };
    for p in &problems {
        tracing::error!(file = %file.path().display(), "trusted signers: {p}");
    }
    sluice_operator::set_signing(file.clone());
    std::thread::Builder::new()
        .name("trusted-signers".into())
        .spawn(move || {
            loop {
                std::thread::sleep(Duration::from_secs(2));
                match file.reread() {
                    Reread::Unchanged => {}
                    Reread::Changed(problems) => {
                        for p in &problems {
                            tracing::error!(file = %file.path().display(), "trusted signers: {p}");
                        }
                        tracing::info!(file = %file.path().display(), "trusted signers changed");
                    }
                    Reread::Kept(why) => {
                        tracing::error!("{why}; the signers read before stay trusted")
                    }
                }
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_follow_the_one_rule_and_refuse_bare_numbers() {
        let parse = |flag: &str| {
            Cli::try_parse_from(["sluice-operator", "run", flag]).map(|c| match c.command {
                Command::Run(args) => (args.claim_deadline, args.start_deadline),
                Command::Render { .. } => unreachable!(),
            })
        };
        assert_eq!(
            parse("--claim-deadline=5m").unwrap(),
            (Duration::from_secs(300), Duration::from_secs(120))
        );
        assert_eq!(
            parse("--start-deadline=1m30s").unwrap().1,
            Duration::from_secs(90)
        );
        let err = parse("--claim-deadline=300").err().unwrap().to_string();
        assert!(
            err.contains("has no unit") && err.contains("500ms"),
            "{err}"
        );
    }

    #[test]
    fn the_webhook_is_off_by_default_and_needs_its_certificate() {
        let run = |args: &[&str]| {
            Cli::try_parse_from(args).map(|c| match c.command {
                Command::Run(args) => args
                    .webhook
                    .config(&PlatformRules::new(AllowedEndpoints::default())),
                Command::Render { .. } => unreachable!(),
            })
        };
        assert!(run(&["sluice-operator", "run"]).unwrap().is_none());
        let err = run(&["sluice-operator", "run", "--webhook-listen=0.0.0.0:9443"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--webhook-cert"), "{err}");
        let on = run(&[
            "sluice-operator",
            "run",
            "--webhook-listen=0.0.0.0:9443",
            "--webhook-cert=/tls/tls.crt",
            "--webhook-key=/tls/tls.key",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(on.listen.port(), 9443);
        assert_eq!(on.judge.rules.platform_namespace, "sluice-system");
    }

    #[test]
    fn certificates_are_off_by_default_and_the_webhook_serves_one_it_keeps() {
        let config = |args: &[&str]| match Cli::try_parse_from(args).map(|c| c.command) {
            Ok(Command::Run(args)) => args.certs.config("sluice-system", &args.webhook),
            Ok(Command::Render { .. }) => unreachable!(),
            Err(e) => Err(e.to_string()),
        };
        assert!(config(&["sluice-operator", "run"]).unwrap().is_none());
        let webhook = [
            "--webhook-listen=0.0.0.0:9443",
            "--webhook-cert=/run/tls/tls.crt",
            "--webhook-key=/run/tls/tls.key",
        ];
        let with = |more: &[&str]| {
            let mut args = vec!["sluice-operator", "run", "--ca-secret=sluice-ca"];
            args.extend(webhook);
            args.extend(more);
            config(&args)
        };
        let on = with(&[
            "--serving-certificate=hook-tls=a.ns.svc,a.ns.svc.cluster.local",
            "--webhook-cert-secret=hook-tls",
            "--certificate-lifetime=24h",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            on.ca_config_map, "sluice-ca",
            "the ConfigMap defaults to the CA's name"
        );
        assert_eq!(on.namespace, "sluice-system");
        assert_eq!(on.serving_lifetime, Duration::from_secs(86_400));
        let files = on.webhook_files.expect("the webhook's files");
        assert_eq!(files.cert, PathBuf::from("/run/tls/tls.crt"));
        let err = with(&[
            "--serving-certificate=other=b.svc",
            "--webhook-cert-secret=hook-tls",
        ])
        .unwrap_err();
        assert!(
            err.contains("not one of the --serving-certificate"),
            "{err}"
        );
        let err = with(&["--serving-certificate=nodns"]).unwrap_err();
        assert!(err.contains("SECRET=DNS"), "{err}");
        let err = config(&["sluice-operator", "run", "--serving-certificate=a=b.svc"]).unwrap_err();
        assert!(err.contains("--ca-secret"), "{err}");
    }

    #[test]
    fn the_platform_namespace_defaults_to_the_gateways() {
        let run = |args: &[&str]| match Cli::try_parse_from(args).unwrap().command {
            Command::Run(args) => (args.namespace, args.platform_namespace),
            Command::Render { .. } => unreachable!(),
        };
        assert_eq!(
            run(&["sluice-operator", "run", "--namespace", "team"]),
            (Some("team".into()), "sluice-system".into())
        );
        assert_eq!(
            run(&["sluice-operator", "run", "--platform-namespace=platform"]),
            (None, "platform".into())
        );
    }
}
