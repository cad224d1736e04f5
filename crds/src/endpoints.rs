//! Where capabilities may point: the platform's allowed endpoints. Whoever may write a Capability
//! decides where the gateway sends a hook's payload and the caller's identity, so the platform team
//! lists the places that may receive them, and everything else is refused: by `sluice check`, the
//! webhook, the operator's status and the gateway (at load and again at every call), all with the
//! message of [`AllowedEndpoints::check`].
//!
//! An entry is one of:
//! - `<namespace>/<service>`: a Service of the cluster, reached as `<service>.<namespace>`,
//!   `<service>.<namespace>.svc` or `<service>.<namespace>.svc.<cluster domain>`, and by no other
//!   name (`ledger.billing.svc.attacker.example` is someone else's). The cluster domain is the
//!   platform's setting ([`ClusterDomain`], `cluster.local` unless told). Either part may be `*`
//!   (`billing/*`: every Service of `billing`).
//! - a host: `ledger.example.com`, `*.example.com` (any name below `example.com`, not itself),
//!   `127.0.0.1`, `[::1]`.
//!
//! Either may end in `:<port>` to allow that port only. Built-in endpoints need no entry. With no
//! entries nothing but built-ins is allowed: the default of the operator, the gateway in a cluster
//! and the chart. Local mode and `sluice check` allow loopback addresses by default
//! ([`AllowedEndpoints::loopback`]), where the example services listen.

use crate::validate::Problem;
use crate::{CapabilitySpec, Endpoint};

/// The platform's list; see the module documentation for what an entry means.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllowedEndpoints {
    entries: Vec<Entry>,
    /// The only domain a Service's name may end in after `.svc`.
    cluster_domain: ClusterDomain,
}

/// The cluster's DNS domain (the kubelet's `clusterDomain`): a Service's full name is
/// `<service>.<namespace>.svc.<cluster domain>`. `cluster.local` unless the platform says otherwise
/// (`--cluster-domain`, the chart's `clusterDomain`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterDomain(String);

impl Default for ClusterDomain {
    fn default() -> Self {
        Self(DEFAULT_CLUSTER_DOMAIN.to_string())
    }
}

/// Kubernetes' default cluster domain.
pub const DEFAULT_CLUSTER_DOMAIN: &str = "cluster.local";

/// A cluster domain that is not a DNS name.
#[derive(Debug, thiserror::Error)]
#[error("cluster domain {0:?}: write it as a DNS name, such as cluster.local")]
pub struct BadClusterDomain(String);

impl std::str::FromStr for ClusterDomain {
    type Err = BadClusterDomain;

    fn from_str(s: &str) -> Result<Self, BadClusterDomain> {
        let domain = normal_host(s.trim());
        if domain.is_empty() || !domain.split('.').all(dns_label) {
            return Err(BadClusterDomain(s.to_string()));
        }
        Ok(Self(domain))
    }
}

impl std::fmt::Display for ClusterDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    place: Place,
    port: Option<u16>,
    text: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Place {
    Service {
        namespace: Part,
        name: Part,
    },
    Host(String),
    /// `*.<suffix>`: any name ending in `.<suffix>`.
    Below(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Any,
    Is(String),
}

impl Part {
    fn matches(&self, s: &str) -> bool {
        match self {
            Self::Any => true,
            Self::Is(p) => p == s,
        }
    }
}

/// An entry the platform wrote that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("allowed endpoint {entry:?}: {reason}")]
pub struct BadEntry {
    entry: String,
    reason: String,
}

/// Hosts are compared without case and without the root's trailing dot.
fn normal_host(host: &str) -> String {
    host.trim_end_matches('.').to_ascii_lowercase()
}

fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

impl std::str::FromStr for AllowedEndpoints {
    type Err = BadEntry;

    /// A comma-separated list, as flags and environment variables carry it.
    fn from_str(s: &str) -> Result<Self, BadEntry> {
        Self::parse(s.split(',').map(str::trim).filter(|e| !e.is_empty()))
    }
}

impl AllowedEndpoints {
    pub fn parse<'a>(entries: impl IntoIterator<Item = &'a str>) -> Result<Self, BadEntry> {
        let entries = entries
            .into_iter()
            .map(Entry::parse)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            entries,
            cluster_domain: ClusterDomain::default(),
        })
    }

    /// This list, for a cluster whose DNS domain is `domain` (instead of `cluster.local`).
    pub fn in_cluster_domain(mut self, domain: ClusterDomain) -> Self {
        self.cluster_domain = domain;
        self
    }

    pub fn cluster_domain(&self) -> &ClusterDomain {
        &self.cluster_domain
    }

    /// `localhost`, `127.0.0.1` and `[::1]`, any port: what local mode and `sluice check` allow
    /// when given no list.
    pub fn loopback() -> Self {
        Self::parse(["localhost", "127.0.0.1", "[::1]"]).expect("the loopback entries parse")
    }

    /// This list with `other`'s entries added.
    pub fn with(mut self, other: Self) -> Self {
        self.entries.extend(other.entries);
        self
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether a Capability may use `endpoint`; the refusal says why and what to do. A Service
    /// counts only by its full name: a short one resolves in the gateway's namespace.
    pub fn check(&self, endpoint: &Endpoint) -> Result<(), EndpointRefused> {
        let Some(url) = endpoint.grpc.as_deref().or(endpoint.http.as_deref()) else {
            return Ok(());
        };
        let (host, port) = host_and_port(url)?;
        if self
            .entries
            .iter()
            .any(|e| e.allows(&host, port, &self.cluster_domain))
        {
            return Ok(());
        }
        Err(EndpointRefused::NotAllowed {
            url: url.to_string(),
            allowed: self.entries.iter().map(|e| e.text.clone()).collect(),
            short_service_name: !(host.contains('.')
                || host.starts_with('[')
                || host == "localhost"),
        })
    }

    /// [`Self::check`] as a problem of a Capability's spec, for the places that list problems.
    pub fn problem(&self, spec: &CapabilitySpec) -> Option<Problem> {
        let field = if spec.endpoint.grpc.is_some() {
            "spec.endpoint.grpc"
        } else {
            "spec.endpoint.http"
        };
        self.check(&spec.endpoint).err().map(|refused| Problem {
            field: field.into(),
            message: refused.to_string(),
        })
    }
}

impl std::fmt::Display for AllowedEndpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.entries.is_empty() {
            return f.write_str("(built-in endpoints only)");
        }
        let texts: Vec<&str> = self.entries.iter().map(|e| e.text.as_str()).collect();
        f.write_str(&texts.join(", "))
    }
}

/// Why a Capability's endpoint may not be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EndpointRefused {
    #[error("endpoint {url:?} is not a URL: {reason}")]
    NotUrl { url: String, reason: String },
    #[error("endpoint {url:?} must start with http:// or https://")]
    Scheme { url: String },
    #[error("endpoint {url:?} names no host")]
    NoHost { url: String },
    #[error(
        "endpoint {url:?} carries user information: name the credentials in spec.endpoint.credentials"
    )]
    UserInfo { url: String },
    /// A well-formed URL no entry of the list allows. `short_service_name`: its host is one word,
    /// which the refusal explains (a Service counts only by its full name).
    #[error(
        "endpoint {url:?} is not among the platform's allowed endpoints ({}){}",
        listed(allowed),
        if *short_service_name { "; name a Service as <service>.<namespace>.svc" } else { "" }
    )]
    NotAllowed {
        url: String,
        allowed: Vec<String>,
        short_service_name: bool,
    },
}

/// The allowed entries as a refusal names them, or where to list them when there are none.
fn listed(allowed: &[String]) -> String {
    if allowed.is_empty() {
        "none are: the platform team lists them with --allowed-endpoints or the chart's \
         capabilities.allowedEndpoints"
            .to_string()
    } else {
        format!("allowed: {}", allowed.join(", "))
    }
}

/// The host (normalised) and port (explicit or the scheme's) of an endpoint URL.
fn host_and_port(url: &str) -> Result<(String, u16), EndpointRefused> {
    let uri: http::Uri =
        url.parse()
            .map_err(|e: http::uri::InvalidUri| EndpointRefused::NotUrl {
                url: url.to_string(),
                reason: e.to_string(),
            })?;
    let default_port = match uri.scheme_str() {
        Some("http") => 80,
        Some("https") => 443,
        _ => {
            return Err(EndpointRefused::Scheme {
                url: url.to_string(),
            });
        }
    };
    let no_host = || EndpointRefused::NoHost {
        url: url.to_string(),
    };
    let authority = uri.authority().ok_or_else(no_host)?;
    if authority.as_str().contains('@') {
        return Err(EndpointRefused::UserInfo {
            url: url.to_string(),
        });
    }
    let host = normal_host(authority.host());
    if host.is_empty() {
        return Err(no_host());
    }
    Ok((host, authority.port_u16().unwrap_or(default_port)))
}

impl Entry {
    fn parse(text: &str) -> Result<Self, BadEntry> {
        let bad = |reason: &str| BadEntry {
            entry: text.to_string(),
            reason: reason.to_string(),
        };
        let lowered = text.trim().to_ascii_lowercase();
        // The port: after the last ':' that is not inside an IPv6 literal's brackets.
        let (place, port) = match lowered.rsplit_once(':') {
            Some((place, port)) if !port.contains(']') && !place.ends_with(':') => {
                let port = port
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| bad("the port must be a number from 1 to 65535"))?;
                (place.to_string(), Some(port))
            }
            _ => (lowered.clone(), None),
        };
        let place = if let Some((namespace, name)) = place.split_once('/') {
            let part = |s: &str| -> Result<Part, BadEntry> {
                match s {
                    "*" => Ok(Part::Any),
                    s if dns_label(s) => Ok(Part::Is(s.to_string())),
                    _ => Err(bad(
                        "write a Service as <namespace>/<service>, each a DNS label or *",
                    )),
                }
            };
            Place::Service {
                namespace: part(namespace)?,
                name: part(name)?,
            }
        } else if let Some(suffix) = place.strip_prefix("*.") {
            let suffix = normal_host(suffix);
            if suffix.is_empty() || !suffix.split('.').all(dns_label) {
                return Err(bad("write a host pattern as *.<domain>"));
            }
            Place::Below(suffix)
        } else {
            let host = normal_host(&place);
            let ipv6 = host.starts_with('[') && host.ends_with(']');
            if host.is_empty() || !(ipv6 || host.split('.').all(dns_label)) {
                return Err(bad(
                    "write a host as a DNS name, *.<domain>, an IPv4 address or [IPv6]",
                ));
            }
            Place::Host(host)
        };
        Ok(Self {
            place,
            port,
            text: text.trim().to_string(),
        })
    }

    fn allows(&self, host: &str, port: u16, cluster_domain: &ClusterDomain) -> bool {
        if self.port.is_some_and(|p| p != port) {
            return false;
        }
        match &self.place {
            Place::Host(h) => h == host,
            Place::Below(suffix) => host
                .strip_suffix(suffix.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            Place::Service { namespace, name } => {
                // <svc>.<ns>, then nothing, `svc`, or `svc.<the cluster domain>`: nothing else.
                let mut labels = host.splitn(3, '.');
                let (Some(svc), Some(ns)) = (labels.next(), labels.next()) else {
                    return false;
                };
                let in_cluster = match labels.next() {
                    None | Some("svc") => true,
                    Some(rest) => rest
                        .strip_prefix("svc.")
                        .is_some_and(|domain| domain == cluster_domain.0),
                };
                in_cluster
                    && dns_label(svc)
                    && dns_label(ns)
                    && namespace.matches(ns)
                    && name.matches(svc)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn http(url: &str) -> Endpoint {
        Endpoint {
            http: Some(url.into()),
            ..Default::default()
        }
    }

    fn allowed(list: &str, url: &str) -> bool {
        list.parse::<AllowedEndpoints>()
            .unwrap()
            .check(&http(url))
            .is_ok()
    }

    #[test]
    fn a_service_entry_allows_every_name_of_that_service_only() {
        let list = "billing/ledger";
        for url in [
            "http://ledger.billing:8080/x",
            "http://ledger.billing.svc/x",
            "https://ledger.billing.svc.cluster.local.:8443/x",
            "http://LEDGER.Billing.svc/x",
        ] {
            assert!(allowed(list, url), "{url}");
        }
        for url in [
            "http://ledger/x",
            "http://other.billing.svc/x",
            "http://ledger.team-a.svc/x",
            "http://ledger.billing.example.com/x",
            "http://ledger.billing.svc@evil.example.com/x",
        ] {
            assert!(!allowed(list, url), "{url}");
        }
        assert!(allowed("billing/*", "http://anything.billing.svc/"));
        assert!(!allowed("billing/*", "http://anything.other.svc/"));
    }

    #[test]
    fn a_service_entry_allows_no_domain_after_svc_but_the_cluster_domain() {
        for url in [
            "http://ledger.billing.svc.attacker.example/x",
            "http://ledger.billing.svc.cluster.local.attacker.example/x",
            "http://ledger.billing.svc.cluster/x",
            "http://ledger.billing.svc.local/x",
            "http://ledger.billing.svc.svc/x",
            "http://ledger.billing.svc.cluster.local.cluster.local/x",
        ] {
            assert!(!allowed("billing/ledger", url), "{url}");
            assert!(!allowed("billing/*", url), "{url}");
            assert!(!allowed("*/ledger", url), "{url}");
        }
    }

    #[test]
    fn the_cluster_domain_is_the_platforms() {
        let list = "billing/ledger"
            .parse::<AllowedEndpoints>()
            .unwrap()
            .in_cluster_domain("Corp.Internal.".parse().unwrap());
        let ok = |url: &str| list.check(&http(url)).is_ok();
        assert!(ok("http://ledger.billing.svc.corp.internal/x"));
        assert!(ok("http://ledger.billing.svc/x"));
        assert!(!ok("http://ledger.billing.svc.cluster.local/x"));
        assert!(!ok(
            "http://ledger.billing.svc.corp.internal.evil.example/x"
        ));
        for bad in ["", ".", "a..b", "bad domain", "*.local"] {
            assert!(bad.parse::<ClusterDomain>().is_err(), "{bad:?}");
        }
        assert_eq!(ClusterDomain::default().to_string(), "cluster.local");
    }

    /// The names a Service entry `ns/name` allows, as lowercase hosts without the root's dot.
    fn service_names(ns: &str, name: &str, domain: &str) -> [String; 3] {
        [
            format!("{name}.{ns}"),
            format!("{name}.{ns}.svc"),
            format!("{name}.{ns}.svc.{domain}"),
        ]
    }

    /// Hostnames an attacker would try against `billing/ledger`: the allowed names with labels
    /// added before, after or between, the cluster domain replaced or repeated, case and the root's
    /// dot changed, user information and ports put in.
    fn hostile_host() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let label = "[a-z0-9-]{1,12}";
        let base = prop_oneof![
            Just("ledger.billing".to_string()),
            Just("ledger.billing.svc".to_string()),
            Just("ledger.billing.svc.cluster.local".to_string()),
            Just("ledger.billing.svc.cluster".to_string()),
            label.prop_map(|l| format!("ledger.billing.svc.{l}")),
            (label, label).prop_map(|(a, b)| format!("{a}.{b}")),
        ];
        let edit = prop_oneof![
            Just(String::new()),
            label.prop_map(|l| format!(".{l}")),
            (label, label).prop_map(|(a, b)| format!(".{a}.{b}")),
            Just(".cluster.local".to_string()),
            Just(".attacker.example".to_string()),
            Just(".".to_string()),
            Just("@evil.example".to_string()),
        ];
        (
            prop::option::of(label),
            base,
            edit,
            any::<bool>(),
            prop::option::of(1u16..),
        )
            .prop_map(|(before, base, after, upper, port)| {
                let mut host = match before {
                    Some(b) => format!("{b}.{base}{after}"),
                    None => format!("{base}{after}"),
                };
                if upper {
                    host = host.to_ascii_uppercase();
                }
                match port {
                    Some(p) => format!("{host}:{p}"),
                    None => host,
                }
            })
    }

    proptest::proptest! {
        /// A Service entry allows its three names and nothing else, whatever an attacker puts
        /// around them.
        #[test]
        fn a_service_entry_allows_exactly_its_names(authority in hostile_host()) {
            let url = format!("http://{authority}/x");
            let host = authority.rsplit_once(':').map_or(authority.as_str(), |(h, _)| h);
            let names = service_names("billing", "ledger", "cluster.local");
            let expected = !host.contains('@')
                && names.contains(&host.trim_end_matches('.').to_ascii_lowercase());
            proptest::prop_assert_eq!(allowed("billing/ledger", &url), expected, "{}", url);
            let any_service = !host.contains('@')
                && host.trim_end_matches('.').to_ascii_lowercase().starts_with("ledger.");
            if allowed("*/ledger", &url) {
                proptest::prop_assert!(any_service, "{}", url);
            }
        }
    }

    #[test]
    fn host_entries_match_exactly_or_below_a_domain_and_ports_narrow() {
        assert!(allowed("api.example.com", "https://api.example.com/v1"));
        assert!(!allowed(
            "api.example.com",
            "https://api.example.com.evil.io/"
        ));
        assert!(allowed("*.example.com", "https://a.b.example.com/"));
        assert!(!allowed("*.example.com", "https://example.com/"));
        assert!(!allowed("*.example.com", "https://badexample.com/"));
        assert!(allowed("api.example.com:443", "https://api.example.com/"));
        assert!(!allowed("api.example.com:443", "http://api.example.com/"));
        assert!(allowed("127.0.0.1:8081", "http://127.0.0.1:8081/"));
        assert!(!allowed("127.0.0.1:8081", "http://127.0.0.1:8082/"));
        assert!(allowed("[::1]", "http://[::1]:9/"));
    }

    #[test]
    fn nothing_but_builtins_without_entries_and_the_refusal_says_what_to_do() {
        let none = AllowedEndpoints::default();
        let builtin = Endpoint {
            builtin: Some(crate::Builtin::Echo),
            ..Default::default()
        };
        assert!(none.check(&builtin).is_ok());
        let err = none
            .check(&http("http://ledger.billing.svc/"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--allowed-endpoints"), "{err}");
        let refused = "billing/ledger"
            .parse::<AllowedEndpoints>()
            .unwrap()
            .check(&http("http://ledger:80/"))
            .unwrap_err();
        assert_eq!(
            refused,
            EndpointRefused::NotAllowed {
                url: "http://ledger:80/".into(),
                allowed: vec!["billing/ledger".into()],
                short_service_name: true,
            }
        );
        let err = refused.to_string();
        assert!(
            err.contains("allowed: billing/ledger") && err.contains("<service>.<namespace>.svc"),
            "{err}"
        );
        assert!(
            AllowedEndpoints::loopback()
                .check(&http("http://127.0.0.1:9/"))
                .is_ok()
        );
        assert!(
            AllowedEndpoints::loopback()
                .check(&http("http://10.0.0.1:9/"))
                .is_err()
        );
    }

    #[test]
    fn unreadable_entries_are_refused() {
        for entry in [
            "billing/",
            "a/b/c",
            "*.",
            "host:0",
            "host:http",
            "bad host",
            "*",
        ] {
            assert!(entry.parse::<AllowedEndpoints>().is_err(), "{entry}");
        }
    }
}
