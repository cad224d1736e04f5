//! The certificate decisions, pure: when a CA or a serving certificate must be made again, and the
//! making. Times are Unix seconds passed in, so every rule is tested without waiting.
//!
//! The rules (cert-manager's defaults, so nothing surprises whoever knows it):
//! - a certificate is renewed once less than a third of its lifetime is left;
//! - the CA bundle holds the newest CA first and every older one not yet expired, so a client that
//!   trusts the bundle trusts every serving certificate still in use;
//! - a serving certificate is made again when it is missing or unreadable, names other DNS names,
//!   is signed by a CA no longer in the bundle, or nears its end. A new CA alone does not re-sign
//!   it: it moves to the new CA at its own renewal, by which time clients have the new bundle.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use std::fmt;
use std::time::Duration;
use x509_parser::prelude::{FromDer, GeneralName, ParsedExtension, X509Certificate};

/// A certificate and its private key, PEM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyedCert {
    pub cert: String,
    pub key: String,
}

/// Why a certificate is made (again); logged and put in the Event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Renewal {
    Missing,
    Unreadable(Unreadable),
    /// Less than a third of its lifetime left (or past it).
    Expiring {
        not_after: i64,
    },
    /// Signed by a CA that is not in the bundle (any more).
    UnknownIssuer,
    /// The DNS names differ from the ones asked for.
    Names,
}

impl fmt::Display for Renewal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Renewal::Missing => f.write_str("there is none"),
            Renewal::Unreadable(why) => write!(f, "the one there cannot be read: {why}"),
            Renewal::Expiring { not_after } => {
                write!(
                    f,
                    "less than a third of its lifetime is left (it ends at {not_after}, Unix time)"
                )
            }
            Renewal::UnknownIssuer => f.write_str("its issuer is not in the CA bundle"),
            Renewal::Names => f.write_str("it names other DNS names"),
        }
    }
}

/// Why the certificate or key stored is not used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    #[error("its key: {0}")]
    Key(String),
    #[error("no PEM certificate")]
    NoCertificate,
    /// The PEM block is malformed.
    #[error("{0}")]
    Pem(String),
    /// The certificate's DER does not parse.
    #[error("{0}")]
    Der(String),
    #[error("it is not a CA certificate with a subject key identifier")]
    NotCa,
}

/// What the decisions need of a parsed certificate.
#[derive(Clone, Debug)]
struct Facts {
    not_before: i64,
    not_after: i64,
    subject_key_id: Option<Vec<u8>>,
    authority_key_id: Option<Vec<u8>>,
    is_ca: bool,
    dns_names: Vec<String>,
}

fn facts(pem: &str) -> Result<Facts, Unreadable> {
    let der = first_der(pem)?;
    let (_, cert) = X509Certificate::from_der(&der).map_err(|e| Unreadable::Der(e.to_string()))?;
    let mut out = Facts {
        not_before: cert.validity().not_before.timestamp(),
        not_after: cert.validity().not_after.timestamp(),
        subject_key_id: None,
        authority_key_id: None,
        is_ca: false,
        dns_names: Vec::new(),
    };
    for ext in cert.extensions() {
        match ext.parsed_extension() {
            ParsedExtension::SubjectKeyIdentifier(id) => out.subject_key_id = Some(id.0.to_vec()),
            ParsedExtension::AuthorityKeyIdentifier(aki) => {
                out.authority_key_id = aki.key_identifier.as_ref().map(|id| id.0.to_vec());
            }
            ParsedExtension::BasicConstraints(bc) => out.is_ca = bc.ca,
            ParsedExtension::SubjectAlternativeName(san) => {
                for name in &san.general_names {
                    if let GeneralName::DNSName(dns) = name {
                        out.dns_names.push(dns.to_string());
                    }
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// The DER of the first certificate in a PEM text.
fn first_der(pem: &str) -> Result<Vec<u8>, Unreadable> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .ok_or(Unreadable::NoCertificate)?
        .map(|der| der.to_vec())
        .map_err(|e| Unreadable::Pem(e.to_string()))
}

/// Each `CERTIFICATE` block of a PEM text, as its own PEM text.
pub fn pem_certificates(pem: &str) -> Vec<String> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let mut out = Vec::new();
    let mut rest = pem;
    while let Some(start) = rest.find(BEGIN) {
        let Some(len) = rest[start..].find(END) else {
            break;
        };
        let end = start + len + END.len();
        out.push(format!("{}\n", &rest[start..end]));
        rest = &rest[end..];
    }
    out
}

/// Whether less than a third of [not_before, not_after] is left at `now`.
fn nearing_end(f: &Facts, now: i64) -> bool {
    let lifetime = (f.not_after - f.not_before).max(0);
    f.not_after - now < lifetime / 3
}

/// Why the CA must be made again, if it must.
pub fn ca_renewal(ca: Option<&KeyedCert>, now: i64) -> Option<Renewal> {
    let Some(ca) = ca else {
        return Some(Renewal::Missing);
    };
    if let Err(e) = KeyPair::from_pem(&ca.key) {
        return Some(Renewal::Unreadable(Unreadable::Key(e.to_string())));
    }
    match facts(&ca.cert) {
        Err(e) => Some(Renewal::Unreadable(e)),
        Ok(f) if !f.is_ca || f.subject_key_id.is_none() => {
            Some(Renewal::Unreadable(Unreadable::NotCa))
        }
        Ok(f) if nearing_end(&f, now) => Some(Renewal::Expiring {
            not_after: f.not_after,
        }),
        Ok(_) => None,
    }
}

/// Why a serving certificate must be made again, if it must: `bundle` is the PEM of the CAs its
/// clients trust.
pub fn leaf_renewal(
    leaf: Option<&KeyedCert>,
    bundle: &str,
    dns_names: &[String],
    now: i64,
) -> Option<Renewal> {
    let Some(leaf) = leaf else {
        return Some(Renewal::Missing);
    };
    if let Err(e) = KeyPair::from_pem(&leaf.key) {
        return Some(Renewal::Unreadable(Unreadable::Key(e.to_string())));
    }
    let f = match facts(&leaf.cert) {
        Ok(f) => f,
        Err(e) => return Some(Renewal::Unreadable(e)),
    };
    let trusted = pem_certificates(bundle)
        .iter()
        .filter_map(|ca| facts(ca).ok())
        .any(|ca| {
            ca.not_after > now
                && ca.subject_key_id.is_some()
                && ca.subject_key_id == f.authority_key_id
        });
    if !trusted {
        return Some(Renewal::UnknownIssuer);
    }
    let mut want: Vec<&str> = dns_names.iter().map(String::as_str).collect();
    let mut have: Vec<&str> = f.dns_names.iter().map(String::as_str).collect();
    want.sort_unstable();
    have.sort_unstable();
    if want != have {
        return Some(Renewal::Names);
    }
    nearing_end(&f, now).then_some(Renewal::Expiring {
        not_after: f.not_after,
    })
}

/// The bundle after `newest` became the CA: it first, then every other CA of `previous` that has
/// not expired, each once.
pub fn bundle_with(newest: &str, previous: &str, now: i64) -> String {
    let mut out = vec![normalise(newest)];
    for ca in pem_certificates(previous) {
        let ca = normalise(&ca);
        let live = facts(&ca).is_ok_and(|f| f.not_after > now);
        if live && !out.contains(&ca) {
            out.push(ca);
        }
    }
    out.concat()
}

fn normalise(pem: &str) -> String {
    pem_certificates(pem).into_iter().next().unwrap_or_default()
}

fn time_at(unix: i64) -> Result<time::OffsetDateTime, rcgen::Error> {
    time::OffsetDateTime::from_unix_timestamp(unix).map_err(|_| rcgen::Error::Time)
}

/// A new self-signed CA (ECDSA P-256) named `common_name`, valid from a minute before `now` (clock
/// skew) for `lifetime`.
pub fn make_ca(common_name: &str, lifetime: Duration, now: i64) -> Result<KeyedCert, rcgen::Error> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params.not_before = time_at(now - 60)?;
    params.not_after = time_at(now + lifetime.as_secs() as i64)?;
    let cert = params.self_signed(&key)?;
    Ok(KeyedCert {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// A new serving certificate for `dns_names` signed by `ca`, valid from a minute before `now` for
/// `lifetime`.
pub fn make_leaf(
    ca: &KeyedCert,
    dns_names: &[String],
    lifetime: Duration,
    now: i64,
) -> Result<KeyedCert, rcgen::Error> {
    let issuer = Issuer::from_ca_cert_pem(&ca.cert, KeyPair::from_pem(&ca.key)?)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(dns_names.to_vec())?;
    params.distinguished_name = DistinguishedName::new();
    if let Some(first) = dns_names.first() {
        params
            .distinguished_name
            .push(DnType::CommonName, first.as_str());
    }
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.not_before = time_at(now - 60)?;
    params.not_after = time_at(now + lifetime.as_secs() as i64)?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok(KeyedCert {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: i64 = 86_400;
    const NOW: i64 = 1_800_000_000;

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_ca_is_made_when_missing_unreadable_or_in_its_last_third() {
        assert_eq!(ca_renewal(None, NOW), Some(Renewal::Missing));
        let ca = make_ca("sluice-ca", Duration::from_secs(300 * DAY as u64), NOW).unwrap();
        assert_eq!(ca_renewal(Some(&ca), NOW), None);
        assert_eq!(ca_renewal(Some(&ca), NOW + 190 * DAY), None);
        assert!(matches!(
            ca_renewal(Some(&ca), NOW + 201 * DAY),
            Some(Renewal::Expiring { .. })
        ));
        let garbled = KeyedCert {
            cert: "not a certificate".into(),
            key: ca.key.clone(),
        };
        assert_eq!(
            ca_renewal(Some(&garbled), NOW),
            Some(Renewal::Unreadable(Unreadable::NoCertificate))
        );
        let leaf = make_leaf(
            &ca,
            &names(&["a.svc"]),
            Duration::from_secs(DAY as u64),
            NOW,
        )
        .unwrap();
        assert_eq!(
            ca_renewal(Some(&leaf), NOW),
            Some(Renewal::Unreadable(Unreadable::NotCa)),
            "a serving certificate put where the CA belongs is not used to sign"
        );
    }

    #[test]
    fn a_serving_certificate_is_renewed_for_each_reason_and_kept_otherwise() {
        let ca = make_ca("ca", Duration::from_secs(3650 * DAY as u64), NOW).unwrap();
        let dns = names(&["sluice-gateway.ns.svc", "sluice-gateway"]);
        let leaf = make_leaf(&ca, &dns, Duration::from_secs(90 * DAY as u64), NOW).unwrap();
        let renewal = |leaf: Option<&KeyedCert>, bundle: &str, dns: &[String], now| {
            leaf_renewal(leaf, bundle, dns, now)
        };
        assert_eq!(renewal(Some(&leaf), &ca.cert, &dns, NOW), None);
        // The order of the names asked for does not matter.
        let reversed: Vec<String> = dns.iter().rev().cloned().collect();
        assert_eq!(renewal(Some(&leaf), &ca.cert, &reversed, NOW), None);
        assert_eq!(renewal(None, &ca.cert, &dns, NOW), Some(Renewal::Missing));
        assert_eq!(
            renewal(Some(&leaf), &ca.cert, &names(&["other.svc"]), NOW),
            Some(Renewal::Names)
        );
        assert_eq!(renewal(Some(&leaf), &ca.cert, &dns, NOW + 59 * DAY), None);
        assert!(matches!(
            renewal(Some(&leaf), &ca.cert, &dns, NOW + 61 * DAY),
            Some(Renewal::Expiring { .. })
        ));
        let other_ca = make_ca("other", Duration::from_secs(3650 * DAY as u64), NOW).unwrap();
        assert_eq!(
            renewal(Some(&leaf), &other_ca.cert, &dns, NOW),
            Some(Renewal::UnknownIssuer)
        );
        let bad_key = KeyedCert {
            cert: leaf.cert.clone(),
            key: "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n".into(),
        };
        assert!(matches!(
            renewal(Some(&bad_key), &ca.cert, &dns, NOW),
            Some(Renewal::Unreadable(Unreadable::Key(_)))
        ));
    }

    #[test]
    fn a_new_ca_keeps_the_old_one_trusted_until_it_expires_and_serving_certificates_move_at_their_renewal()
     {
        let old = make_ca("ca", Duration::from_secs(300 * DAY as u64), NOW).unwrap();
        let dns = names(&["webhook.ns.svc"]);
        let leaf = make_leaf(
            &old,
            &dns,
            Duration::from_secs(90 * DAY as u64),
            NOW + 200 * DAY,
        )
        .unwrap();
        // At day 201 the CA is renewed; the bundle carries both.
        let later = NOW + 201 * DAY;
        let new = make_ca("ca", Duration::from_secs(300 * DAY as u64), later).unwrap();
        let bundle = bundle_with(&new.cert, &old.cert, later);
        assert_eq!(pem_certificates(&bundle).len(), 2);
        assert!(bundle.starts_with(&new.cert));
        // The serving certificate signed by the old CA stays: its clients trust it.
        assert_eq!(leaf_renewal(Some(&leaf), &bundle, &dns, later), None);
        // Once the old CA has expired it leaves the bundle, and a certificate it signed is replaced.
        let after_old = NOW + 301 * DAY;
        let bundle = bundle_with(&new.cert, &bundle, after_old);
        assert_eq!(pem_certificates(&bundle), vec![new.cert.clone()]);
        assert_eq!(
            leaf_renewal(Some(&leaf), &bundle, &dns, after_old),
            Some(Renewal::UnknownIssuer)
        );
        // Making the same CA current again does not list it twice.
        assert_eq!(
            pem_certificates(&bundle_with(&new.cert, &bundle, after_old)).len(),
            1
        );
    }

    #[test]
    fn what_is_made_names_its_issuer_its_names_and_its_lifetime() {
        let ca = make_ca("ca", Duration::from_secs(DAY as u64), NOW).unwrap();
        let leaf = make_leaf(
            &ca,
            &names(&["x.ns.svc"]),
            Duration::from_secs(DAY as u64),
            NOW,
        )
        .unwrap();
        let f = facts(&leaf.cert).unwrap();
        assert!(!f.is_ca);
        assert_eq!(f.dns_names, vec!["x.ns.svc".to_string()]);
        assert_eq!(f.authority_key_id, facts(&ca.cert).unwrap().subject_key_id);
        assert_eq!(f.not_after - f.not_before, DAY + 60);
    }
}
