//! Certificates the operator makes and keeps itself (`--ca-secret`): the default of the chart, so
//! TLS for the gateway and the webhook needs nothing installed beforehand (no cert-manager).
//!
//! Every pass ([`Keeper::pass`], every `--certificate-check`):
//! 1. the CA in its Secret (`tls.crt`, `tls.key`, and `ca.crt`: the bundle of the CAs still
//!    trusted) is made when missing and made again in the last third of its lifetime;
//! 2. the bundle is published in a ConfigMap (`ca.crt`, for clients: no key beside it) and in the
//!    `caBundle` of every webhook of the ValidatingWebhookConfiguration, before any serving
//!    certificate a new CA signs is served;
//! 3. each serving certificate's Secret (`kubernetes.io/tls`: `tls.crt`, `tls.key`, `ca.crt`) is made
//!    again as `authority` decides;
//! 4. on every replica, the webhook's own pair is written to the files it serves (the operator
//!    cannot mount a Secret it has not made yet).
//!
//! Every replica runs it, leader or not: writes carry the resourceVersion they were decided on, so
//! when two replicas decide at once one write wins and the other replica finds it on its next pass.

pub mod authority;

use authority::{KeyedCert, Renewal};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

/// The key of the CA bundle in every Secret and in the ConfigMap, as cert-manager names it.
pub const BUNDLE_KEY: &str = "ca.crt";
/// How soon a pass that failed is tried again.
const RETRY: Duration = Duration::from_secs(5);

/// A serving certificate to keep: its Secret and the DNS names it must carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServingCert {
    pub secret: String,
    pub dns_names: Vec<String>,
}

impl std::str::FromStr for ServingCert {
    type Err = String;
    /// `SECRET=DNS[,DNS...]`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (secret, names) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected SECRET=DNS[,DNS...]"))?;
        let dns_names: Vec<String> = names
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect();
        if secret.is_empty() || dns_names.is_empty() {
            return Err(format!("{s:?}: expected SECRET=DNS[,DNS...]"));
        }
        Ok(Self {
            secret: secret.to_string(),
            dns_names,
        })
    }
}

/// Where this replica's webhook reads its pair: the serving certificate kept in `secret`.
#[derive(Clone, Debug)]
pub struct WebhookFiles {
    pub secret: String,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// What the keeper keeps (`--ca-secret` and the flags beside it).
#[derive(Clone, Debug)]
pub struct CertConfig {
    /// Where the Secrets and the ConfigMap live: the operator's namespace.
    pub namespace: String,
    pub ca_secret: String,
    pub ca_config_map: String,
    pub serving: Vec<ServingCert>,
    /// The ValidatingWebhookConfiguration whose `caBundle`s are kept.
    pub webhook_configuration: Option<String>,
    pub webhook_files: Option<WebhookFiles>,
    pub ca_lifetime: Duration,
    pub serving_lifetime: Duration,
    pub check_every: Duration,
}

/// Why a pass did not finish; the next one is tried in a few seconds.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{what}: {source}")]
    Api { what: String, source: kube::Error },
    #[error("making {what}: {source}")]
    Make { what: String, source: rcgen::Error },
    #[error("writing {path}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the webhook's Secret {0} holds no certificate yet")]
    NoWebhookPair(String),
}

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> CertError {
    let what = what.into();
    move |source| CertError::Api { what, source }
}

/// What one pass changed, for the log and the tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Each certificate made: (Secret, why).
    pub made: Vec<(String, String)>,
    /// The bundle was written somewhere (a Secret's ca.crt, the ConfigMap, the webhook).
    pub bundle_published: bool,
}

/// Keeps the CA and the serving certificates of [`CertConfig`].
pub struct Keeper {
    config: CertConfig,
    secrets: Api<Secret>,
    config_maps: Api<ConfigMap>,
    webhooks: Api<ValidatingWebhookConfiguration>,
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn text(secret: &Secret, key: &str) -> Option<String> {
    let bytes = secret.data.as_ref()?.get(key)?;
    String::from_utf8(bytes.0.clone()).ok()
}

fn keyed(secret: &Secret) -> Option<KeyedCert> {
    Some(KeyedCert {
        cert: text(secret, "tls.crt")?,
        key: text(secret, "tls.key")?,
    })
}

impl Keeper {
    pub fn new(client: Client, config: CertConfig) -> Self {
        Self {
            secrets: Api::namespaced(client.clone(), &config.namespace),
            config_maps: Api::namespaced(client.clone(), &config.namespace),
            webhooks: Api::all(client),
            config,
        }
    }

    /// Passes until one succeeds (or `stop`): the webhook is served only once its pair exists.
    pub async fn first_pass(&self, stop: &mut watch::Receiver<bool>) -> Option<PassReport> {
        loop {
            match self.pass(now()).await {
                Ok(report) => {
                    self.log(&report);
                    return Some(report);
                }
                Err(e) => tracing::warn!(error = %e, "certificates not ready yet; trying again"),
            }
            tokio::select! {
                _ = tokio::time::sleep(RETRY) => {}
                _ = stop.changed() => return None,
            }
        }
    }

    /// A pass every `check_every` (sooner after a failure) until `stop`.
    pub async fn run(self, mut stop: watch::Receiver<bool>) {
        loop {
            let wait = match self.pass(now()).await {
                Ok(report) => {
                    self.log(&report);
                    self.config.check_every
                }
                Err(e) => {
                    tracing::warn!(error = %e, "certificate pass failed; trying again");
                    RETRY
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stop.changed() => return,
            }
        }
    }

    fn log(&self, report: &PassReport) {
        for (secret, why) in &report.made {
            tracing::info!(secret = %secret, namespace = %self.config.namespace, reason = %why, "certificate made");
        }
    }

    /// One pass at `now` (Unix seconds): see the module's text for the order.
    pub async fn pass(&self, now: i64) -> Result<PassReport, CertError> {
        let mut report = PassReport::default();
        let (ca, bundle) = self.keep_ca(now, &mut report).await?;
        self.publish_bundle(&bundle, &mut report).await?;
        for serving in &self.config.serving {
            self.keep_serving(serving, &ca, &bundle, now, &mut report)
                .await?;
        }
        if let Some(files) = &self.config.webhook_files {
            self.write_webhook_files(files).await?;
        }
        Ok(report)
    }

    async fn keep_ca(
        &self,
        now: i64,
        report: &mut PassReport,
    ) -> Result<(KeyedCert, String), CertError> {
        let name = &self.config.ca_secret;
        let found = read(&self.secrets, "Secret", name).await?;
        let current = found.as_ref().and_then(keyed);
        let stored_bundle = found
            .as_ref()
            .and_then(|s| text(s, BUNDLE_KEY))
            .unwrap_or_default();
        let ca = match (authority::ca_renewal(current.as_ref(), now), &current) {
            (None, Some(current)) => current.clone(),
            (why, _) => {
                let why = why.unwrap_or(Renewal::Missing);
                let made = authority::make_ca(
                    &format!("{}.{}", name, self.config.namespace),
                    self.config.ca_lifetime,
                    now,
                )
                .map_err(|source| CertError::Make {
                    what: format!("the CA {name}"),
                    source,
                })?;
                report.made.push((name.clone(), why.to_string()));
                made
            }
        };
        let bundle = authority::bundle_with(&ca.cert, &stored_bundle, now);
        if current.as_ref() != Some(&ca) || bundle != stored_bundle {
            self.write_tls_secret(name, found, &ca, &bundle).await?;
        }
        Ok((ca, bundle))
    }

    async fn publish_bundle(&self, bundle: &str, report: &mut PassReport) -> Result<(), CertError> {
        let name = &self.config.ca_config_map;
        let found = read(&self.config_maps, "ConfigMap", name).await?;
        let stored = found
            .as_ref()
            .and_then(|c| c.data.as_ref()?.get(BUNDLE_KEY).cloned());
        if stored.as_deref() != Some(bundle) {
            let data = BTreeMap::from([(BUNDLE_KEY.to_string(), bundle.to_string())]);
            let what = format!("writing ConfigMap {name}");
            match found {
                Some(mut cm) => {
                    cm.data = Some(data);
                    self.config_maps
                        .replace(name, &PostParams::default(), &cm)
                        .await
                        .map_err(api_err(what))?;
                }
                None => {
                    let cm = ConfigMap {
                        metadata: self.meta(name),
                        data: Some(data),
                        ..Default::default()
                    };
                    create(&self.config_maps, &cm, what).await?;
                }
            }
            report.bundle_published = true;
        }
        let Some(name) = &self.config.webhook_configuration else {
            return Ok(());
        };
        let Some(mut vwc) = read(&self.webhooks, "ValidatingWebhookConfiguration", name).await?
        else {
            // Installed with the operator by the chart; absent only while it is being installed.
            tracing::warn!(webhook_configuration = %name, "no such ValidatingWebhookConfiguration yet");
            return Ok(());
        };
        let want = ByteString(bundle.as_bytes().to_vec());
        let mut changed = false;
        for hook in vwc.webhooks.iter_mut().flatten() {
            if hook.client_config.ca_bundle.as_ref() != Some(&want) {
                hook.client_config.ca_bundle = Some(want.clone());
                changed = true;
            }
        }
        if changed {
            self.webhooks
                .replace(name, &PostParams::default(), &vwc)
                .await
                .map_err(api_err(format!("writing the caBundle of {name}")))?;
            report.bundle_published = true;
        }
        Ok(())
    }

    async fn keep_serving(
        &self,
        serving: &ServingCert,
        ca: &KeyedCert,
        bundle: &str,
        now: i64,
        report: &mut PassReport,
    ) -> Result<(), CertError> {
        let name = &serving.secret;
        let found = read(&self.secrets, "Secret", name).await?;
        let current = found.as_ref().and_then(keyed);
        let renewal: Option<Renewal> =
            authority::leaf_renewal(current.as_ref(), bundle, &serving.dns_names, now);
        let pair = match (renewal, current) {
            (None, Some(current)) => current,
            (why, _) => {
                let made =
                    authority::make_leaf(ca, &serving.dns_names, self.config.serving_lifetime, now)
                        .map_err(|source| CertError::Make {
                            what: format!("the certificate of {name}"),
                            source,
                        })?;
                let why = why.map_or_else(|| "it was missing".into(), |w| w.to_string());
                report.made.push((name.clone(), why));
                made
            }
        };
        let stored_bundle = found.as_ref().and_then(|s| text(s, BUNDLE_KEY));
        let unchanged = found.as_ref().and_then(keyed).as_ref() == Some(&pair)
            && stored_bundle.as_deref() == Some(bundle);
        if !unchanged {
            self.write_tls_secret(name, found, &pair, bundle).await?;
            report.bundle_published = true;
        }
        Ok(())
    }

    fn meta(&self, name: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(self.config.namespace.clone()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_string(),
                "sluice-operator".to_string(),
            )])),
            ..Default::default()
        }
    }

    /// Writes a `kubernetes.io/tls` Secret: created when absent, else replaced at the version it was
    /// read (a replica that decided on an older version gets a conflict and passes again).
    async fn write_tls_secret(
        &self,
        name: &str,
        found: Option<Secret>,
        pair: &KeyedCert,
        bundle: &str,
    ) -> Result<(), CertError> {
        let data = BTreeMap::from([
            (
                "tls.crt".to_string(),
                ByteString(pair.cert.clone().into_bytes()),
            ),
            (
                "tls.key".to_string(),
                ByteString(pair.key.clone().into_bytes()),
            ),
            (
                BUNDLE_KEY.to_string(),
                ByteString(bundle.as_bytes().to_vec()),
            ),
        ]);
        let what = format!("writing Secret {name}");
        match found {
            Some(mut secret) if secret.type_.as_deref() == Some("kubernetes.io/tls") => {
                secret.data = Some(data);
                secret.string_data = None;
                self.secrets
                    .replace(name, &PostParams::default(), &secret)
                    .await
                    .map_err(api_err(what))?;
            }
            Some(other) => {
                // A Secret's type cannot change: one of another type (a leftover) is replaced whole,
                // at the version it was read.
                let rv = other.resource_version();
                self.secrets
                    .delete(
                        name,
                        &kube::api::DeleteParams {
                            preconditions: Some(kube::api::Preconditions {
                                resource_version: rv,
                                uid: None,
                            }),
                            ..Default::default()
                        },
                    )
                    .await
                    .map_err(api_err(format!("replacing Secret {name} of another type")))?;
                self.create_tls_secret(name, data, what).await?;
            }
            None => self.create_tls_secret(name, data, what).await?,
        }
        Ok(())
    }

    async fn create_tls_secret(
        &self,
        name: &str,
        data: BTreeMap<String, ByteString>,
        what: String,
    ) -> Result<(), CertError> {
        let secret = Secret {
            metadata: self.meta(name),
            type_: Some("kubernetes.io/tls".into()),
            data: Some(data),
            ..Default::default()
        };
        create(&self.secrets, &secret, what).await
    }

    async fn write_webhook_files(&self, files: &WebhookFiles) -> Result<(), CertError> {
        let secret = read(&self.secrets, "Secret", &files.secret).await?;
        let pair = secret
            .as_ref()
            .and_then(keyed)
            .ok_or_else(|| CertError::NoWebhookPair(files.secret.clone()))?;
        // The key first: the webhook reloads when either changes, and a certificate whose key is
        // not there yet does not load (the previous pair keeps serving until both are new).
        replace_file(&files.key, &pair.key, 0o600)?;
        replace_file(&files.cert, &pair.cert, 0o644)?;
        Ok(())
    }
}

/// The object `name` of `api`, if there is one.
async fn read<K>(api: &Api<K>, kind: &str, name: &str) -> Result<Option<K>, CertError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.get_opt(name)
        .await
        .map_err(api_err(format!("reading {kind} {name}")))
}

async fn create<K>(api: &Api<K>, object: &K, what: String) -> Result<(), CertError>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.create(&PostParams::default(), object)
        .await
        .map(|_| ())
        .map_err(api_err(what))
}

/// Writes `contents` to `path` through a new file renamed over it (readers see the old file or the
/// new one, never half of one), unless it already holds exactly that.
fn replace_file(path: &Path, contents: &str, mode: u32) -> Result<(), CertError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if std::fs::read_to_string(path).is_ok_and(|old| old == contents) {
        return Ok(());
    }
    let err = |source| CertError::File {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("new");
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    file.write_all(contents.as_bytes()).map_err(err)?;
    file.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_certificates_are_named_secret_then_dns_names() {
        let s: ServingCert = "sluice-gateway-tls=sluice-gateway, sluice-gateway.ns.svc"
            .parse()
            .unwrap();
        assert_eq!(s.secret, "sluice-gateway-tls");
        assert_eq!(s.dns_names, vec!["sluice-gateway", "sluice-gateway.ns.svc"]);
        for bad in ["nodns", "=a.svc", "secret=", "secret= , "] {
            let err = bad.parse::<ServingCert>().unwrap_err();
            assert!(err.contains("SECRET=DNS"), "{bad}: {err}");
        }
    }

    #[test]
    fn files_are_replaced_whole_and_left_alone_when_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tls.key");
        replace_file(&path, "one", 0o600).unwrap();
        let first = std::fs::metadata(&path).unwrap();
        replace_file(&path, "one", 0o600).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), first.ino());
        replace_file(&path, "two", 0o600).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "two");
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        assert!(!path.with_extension("new").exists());
    }
}
