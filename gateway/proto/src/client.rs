//! How a Sluice client reaches a gateway that is secured: TLS trusting `--ca` (or the system's roots),
//! a client certificate for mutual TLS (`--cert`/`--key`), and a bearer token sent as
//! `authorization: Bearer ...` (`--token` or `--token-file`). `sluice call`, the reference agent
//! loop and the tests connect through here, so they all take the same options.

use crate::gateway_client::GatewayClient;
use std::path::{Path, PathBuf};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// The TLS and token options of a client. All empty: plain HTTP/2, no token. With the `clap`
/// feature it is also the command-line options (`#[command(flatten)]`) of `sluice call` and the
/// reference agent loop, so both spell them the same way.
#[derive(Clone, Debug, Default)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct ClientAuth {
    /// Use TLS, trusting this PEM CA bundle for the gateway's certificate (https:// addresses
    /// without it trust the system's roots).
    #[cfg_attr(feature = "clap", arg(long, value_name = "FILE"))]
    pub ca: Option<PathBuf>,
    /// Mutual TLS: present this PEM client certificate (with --key).
    #[cfg_attr(feature = "clap", arg(long, value_name = "FILE", requires = "key"))]
    pub cert: Option<PathBuf>,
    /// The PEM private key of --cert.
    #[cfg_attr(feature = "clap", arg(long, value_name = "FILE", requires = "cert"))]
    pub key: Option<PathBuf>,
    /// Send `authorization: Bearer TOKEN` (prefer SLUICE_TOKEN or --token-file: arguments show in
    /// ps).
    #[cfg_attr(
        feature = "clap",
        arg(
            long,
            env = "SLUICE_TOKEN",
            hide_env_values = true,
            conflicts_with = "token_file"
        )
    )]
    pub token: Option<String>,
    /// Read the bearer token from this file (surrounding whitespace ignored), e.g. a mounted Secret.
    #[cfg_attr(feature = "clap", arg(long, value_name = "FILE"))]
    pub token_file: Option<PathBuf>,
    /// The name the gateway's certificate must carry when it is not the address's host (e.g.
    /// sluice-gateway.sluice-system.svc through a port-forward to 127.0.0.1).
    #[cfg_attr(feature = "clap", arg(long = "tls-server-name", value_name = "NAME"))]
    pub server_name: Option<String>,
}

/// Why no client could be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--cert and --key go together")]
    HalfIdentity,
    #[error("the token is empty")]
    EmptyToken,
    #[error("the token cannot be sent as gRPC metadata (only visible ASCII is allowed)")]
    BadToken,
    #[error(
        "a bearer token is sent only over TLS or to a loopback address, and {addr} is neither: \
         use https:// with --ca (or the system's roots), or reach the gateway on 127.0.0.1"
    )]
    PlainTextToken { addr: String },
    #[error("{addr:?} is not a gateway address (http://HOST:PORT or https://HOST:PORT)")]
    Address { addr: String },
    #[error("cannot reach the gateway at {addr}: {source}")]
    Connect {
        addr: String,
        source: tonic::transport::Error,
    },
}

/// Adds `authorization: Bearer <token>` to every request, when there is a token.
#[derive(Clone, Debug)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A gateway client carrying the token, if any.
pub type Client = GatewayClient<InterceptedService<Channel, Bearer>>;

fn read(path: &Path) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|source| ConnectError::Read {
        path: path.to_path_buf(),
        source,
    })
}

impl ClientAuth {
    /// Whether the connection is TLS: an https address, or any TLS option given.
    fn wants_tls(&self, addr: &str) -> bool {
        addr.starts_with("https://")
            || self.ca.is_some()
            || self.cert.is_some()
            || self.server_name.is_some()
    }

    fn tls(&self) -> Result<ClientTlsConfig, ConnectError> {
        let mut tls = ClientTlsConfig::new();
        if let Some(name) = &self.server_name {
            tls = tls.domain_name(name);
        }
        tls = match &self.ca {
            Some(ca) => tls.ca_certificate(Certificate::from_pem(read(ca)?)),
            None => tls.with_native_roots(),
        };
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                Ok(tls.identity(Identity::from_pem(read(cert)?, read(key)?)))
            }
            (None, None) => Ok(tls),
            _ => Err(ConnectError::HalfIdentity),
        }
    }

    /// The bearer interceptor: the token given, or the one in the token file.
    pub fn bearer(&self) -> Result<Bearer, ConnectError> {
        let token = match (&self.token, &self.token_file) {
            (Some(t), _) => Some(t.trim().to_string()),
            (None, Some(path)) => Some(String::from_utf8_lossy(&read(path)?).trim().to_string()),
            (None, None) => None,
        };
        let Some(token) = token else {
            return Ok(Bearer(None));
        };
        if token.is_empty() {
            return Err(ConnectError::EmptyToken);
        }
        format!("Bearer {token}")
            .parse()
            .map(|v| Bearer(Some(v)))
            .map_err(|_| ConnectError::BadToken)
    }

    /// A channel to `addr` (http:// or https://; TLS options turn http:// into https://).
    pub async fn channel(&self, addr: &str) -> Result<Channel, ConnectError> {
        let addr = if self.wants_tls(addr) {
            match addr.strip_prefix("http://") {
                Some(rest) => format!("https://{rest}"),
                None => addr.to_string(),
            }
        } else {
            addr.to_string()
        };
        let bad = || ConnectError::Address { addr: addr.clone() };
        let mut endpoint = Channel::from_shared(addr.clone()).map_err(|_| bad())?;
        if addr.starts_with("https://") {
            endpoint =
                endpoint
                    .tls_config(self.tls()?)
                    .map_err(|source| ConnectError::Connect {
                        addr: addr.clone(),
                        source,
                    })?;
        }
        endpoint
            .connect()
            .await
            .map_err(|source| ConnectError::Connect { addr, source })
    }

    /// A gateway client to `addr` with these options. A token goes only over TLS or to this
    /// machine: over plain HTTP/2 anyone on the path could read it and call as its owner.
    pub async fn connect(&self, addr: &str) -> Result<Client, ConnectError> {
        let bearer = self.bearer()?;
        if bearer.0.is_some() && !self.wants_tls(addr) && !is_loopback(addr) {
            return Err(ConnectError::PlainTextToken {
                addr: addr.to_string(),
            });
        }
        let channel = self.channel(addr).await?;
        Ok(GatewayClient::with_interceptor(channel, bearer))
    }
}

/// Whether `addr` (http://HOST:PORT) names this machine: `localhost` or a loopback IP. Decided on
/// the address as written, so nothing is resolved or sent to find out. The one place a bearer token
/// may go over plain http (the gateway's own clients and its calls to capabilities alike).
pub fn is_loopback(addr: &str) -> bool {
    let Ok(uri) = addr.parse::<tonic::codegen::http::Uri>() else {
        return false;
    };
    let Some(host) = uri.host() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}
