//! TLS on the gRPC listener: rustls through tokio-rustls, with the certificate, key and client CA
//! re-read whenever their files change (cert-manager rotates them in place), so a rotated
//! certificate is served without a restart. tonic's own `ServerTlsConfig` is fixed at start, so the
//! server is fed already-handshaken streams through `serve_with_incoming`; tonic's
//! `Connected for TlsStream` still puts the peer's certificates on every request.
//!
//! With `--client-ca`, a client certificate that is presented must chain to it (else the handshake
//! fails). It is required when the gateway has no caller policy (plain mutual TLS), optional when it
//! has one: a caller may then authenticate with a bearer token instead.

use arc_swap::ArcSwap;
use prometheus::{IntCounterVec, IntGauge, Opts, Registry};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::{self, ServerConfig, server::WebPkiClientVerifier};
use tokio_rustls::server::TlsStream;

/// How often the certificate files are looked at.
pub(crate) const POLL: Duration = Duration::from_secs(2);
/// A client that has not finished its handshake by then is dropped: it holds no server task.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The files of the listener's TLS: `--tls-cert`, `--tls-key`, optionally `--client-ca`.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM bundle of the CAs that sign client certificates (mutual TLS).
    pub client_ca: Option<PathBuf>,
}

/// Why the TLS files could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} holds no PEM {what}")]
    Empty { path: PathBuf, what: &'static str },
    #[error("{path}: {message}")]
    Pem { path: PathBuf, message: String },
    #[error("the client CA bundle {path} cannot verify clients: {message}")]
    ClientCa { path: PathBuf, message: String },
    #[error("the certificate {cert} and key {key} do not make a TLS server: {source}")]
    Config {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
}

impl TlsFiles {
    /// Reads the files and builds a server configuration (HTTP/2 only, as gRPC needs).
    /// `require_client_cert`: refuse clients without a certificate (no caller policy to fall back on).
    pub(crate) fn server_config(
        &self,
        require_client_cert: bool,
    ) -> Result<ServerConfig, TlsError> {
        let certs = read_certs(&self.cert, "certificate")?;
        let key_pem = read(&self.key)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| pem_error(&self.key, e))?;
        let builder =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|source| self.config_error(source))?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in read_certs(ca, "CA certificate")? {
                    roots.add(c).map_err(|e| TlsError::ClientCa {
                        path: ca.clone(),
                        message: e.to_string(),
                    })?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    Arc::new(rustls::crypto::ring::default_provider()),
                );
                let verifier = if require_client_cert {
                    verifier
                } else {
                    verifier.allow_unauthenticated()
                };
                let verifier = verifier.build().map_err(|e| TlsError::ClientCa {
                    path: ca.clone(),
                    message: e.to_string(),
                })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|source| self.config_error(source))?;
        // h2 for gRPC; http/1.1 for the OpenAI-compatible proxy, which shares these certificates
        // (a client offering only http/1.1 would otherwise fail the handshake).
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }

    fn config_error(&self, source: rustls::Error) -> TlsError {
        TlsError::Config {
            cert: self.cert.clone(),
            key: self.key.clone(),
            source,
        }
    }

    /// What the watcher compares: the files' contents (a rotation may keep sizes and times).
    fn contents(&self) -> Vec<Option<Vec<u8>>> {
        let mut paths = vec![&self.cert, &self.key];
        paths.extend(self.client_ca.as_ref());
        paths.into_iter().map(|p| std::fs::read(p).ok()).collect()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn pem_error(path: &Path, e: rustls_pki_types::pem::Error) -> TlsError {
    TlsError::Pem {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn read_certs(path: &Path, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(path, e))?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            path: path.to_path_buf(),
            what,
        });
    }
    Ok(certs)
}

/// The listener's current TLS configuration; every new connection takes the latest.
pub(crate) struct ReloadingTls {
    files: TlsFiles,
    require_client_cert: bool,
    current: ArcSwap<ServerConfig>,
    /// notAfter of the certificate being served (Unix seconds), for the expiry gauge.
    not_after: std::sync::atomic::AtomicI64,
}

/// What the listener's TLS tells Prometheus: when the served certificate expires (alert on it: a
/// rotation that keeps failing leaves the old one serving) and how reloads went.
pub(crate) struct TlsMetrics {
    expiry: IntGauge,
    reloads: IntCounterVec,
}

impl TlsMetrics {
    pub(crate) fn register(registry: &Registry) -> prometheus::Result<Self> {
        let expiry = IntGauge::new(
            "sluice_gateway_tls_certificate_expiry_timestamp_seconds",
            "notAfter of the certificate the gRPC listener serves, Unix seconds",
        )?;
        let reloads = IntCounterVec::new(
            Opts::new(
                "sluice_gateway_tls_reloads_total",
                "Changed TLS files read, by result (ok, failed: the last good certificate serves)",
            ),
            &["result"],
        )?;
        registry.register(Box::new(expiry.clone()))?;
        registry.register(Box::new(reloads.clone()))?;
        Ok(Self { expiry, reloads })
    }
}

/// notAfter of the first (leaf) certificate of a PEM chain, Unix seconds; 0 if it does not parse.
fn leaf_not_after(config_files: &TlsFiles) -> i64 {
    let Ok(certs) = read_certs(&config_files.cert, "certificate") else {
        return 0;
    };
    certs
        .first()
        .and_then(|c| x509_parser::parse_x509_certificate(c.as_ref()).ok())
        .map(|(_, c)| c.validity().not_after.timestamp())
        .unwrap_or(0)
}

impl ReloadingTls {
    /// Reads the files once; a bad file here stops the start.
    pub(crate) fn new(files: TlsFiles, require_client_cert: bool) -> Result<Self, TlsError> {
        let config = files.server_config(require_client_cert)?;
        let not_after = leaf_not_after(&files).into();
        Ok(Self {
            files,
            require_client_cert,
            current: ArcSwap::from_pointee(config),
            not_after,
        })
    }

    /// Re-reads the files whenever their contents change. A broken rotation (a key that does not
    /// match, a half-written file) is logged and the last good configuration keeps serving.
    pub(crate) async fn watch(self: Arc<Self>, metrics: Option<TlsMetrics>) {
        use std::sync::atomic::Ordering::Relaxed;
        let mut seen = self.files.contents();
        if let Some(m) = &metrics {
            m.expiry.set(self.not_after.load(Relaxed));
        }
        loop {
            tokio::time::sleep(POLL).await;
            let now = self.files.contents();
            if now == seen {
                continue;
            }
            seen = now;
            match self.files.server_config(self.require_client_cert) {
                Ok(config) => {
                    self.current.store(Arc::new(config));
                    self.not_after.store(leaf_not_after(&self.files), Relaxed);
                    tracing::info!(cert = %self.files.cert.display(), "TLS certificate reloaded");
                    if let Some(m) = &metrics {
                        m.reloads.with_label_values(&["ok"]).inc();
                        m.expiry.set(self.not_after.load(Relaxed));
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot use the changed TLS files; serving the last good certificate");
                    if let Some(m) = &metrics {
                        m.reloads.with_label_values(&["failed"]).inc();
                    }
                }
            }
        }
    }

    /// Accepts TCP connections and hands over those whose handshake succeeds. Each handshake runs in
    /// its own task, so a slow or silent client delays nobody else.
    pub(crate) fn incoming(
        self: Arc<Self>,
        listener: TcpListener,
    ) -> (
        tokio_stream::wrappers::ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>>,
        tokio::task::JoinHandle<()>,
    ) {
        let (tx, rx) = mpsc::channel(64);
        let task = tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors and the like: wait a little rather than spin.
                        tracing::warn!(error = %e, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                // The server is gone (shut down): stop accepting.
                if tx.is_closed() {
                    return;
                }
                crate::assembly::no_delay(&tcp);
                let acceptor = TlsAcceptor::from(self.current.load_full());
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send(Ok(tls)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::info!(%peer, error = %e, "TLS handshake refused")
                        }
                        Err(_) => tracing::info!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        (tokio_stream::wrappers::ReceiverStream::new(rx), task)
    }
}
