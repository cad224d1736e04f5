//! Signed hook code: which hooks a platform has approved, by SSH signatures (the sshsig format of
//! `ssh-keygen -Y sign`, as git signs commits) checked against an `allowed_signers` file.
//!
//! What a signature covers ([`message`]): the hook as written (name, action, settings, capabilities,
//! `uses` or `code`: everything that changes what it does, its `signature` left out) together with
//! the chain's namespace, name and trigger point, in canonical JSON, signed under the sshsig
//! namespace [`NAMESPACE`]. A signed hook copied into another tenant's chain, another chain or
//! another trigger point no longer verifies; neither does one whose code, settings or action changed.
//!
//! Where signatures are required and who is trusted is the platform's ([`Policy`]): the webhook
//! refuses what does not verify, and every gateway verifies again before it serves a version.

use crate::{HookChainSpec, HookSpec, TriggerPoint};
use serde_json::Value;
use ssh_key::{HashAlg, LineEnding, PrivateKey, PublicKey, SshSig};
use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;

/// The sshsig namespace of hook signatures (`ssh-keygen -Y sign -n sluice.dev/hook`).
pub const NAMESPACE: &str = "sluice.dev/hook";

/// The bytes a hook's signature covers: the chain's namespace, name and trigger point and the hook
/// as written (without its signature), as canonical JSON (keys sorted, no spaces).
pub fn message(
    namespace: &str,
    chain: &str,
    trigger_point: TriggerPoint,
    hook: &HookSpec,
) -> Vec<u8> {
    let mut hook = hook.clone();
    hook.signature = None;
    let hook = serde_json::to_value(&hook).unwrap_or(Value::Null);
    let doc = serde_json::json!({
        "sluice": "hook signature v1",
        "chain": {"namespace": namespace, "name": chain, "triggerPoint": trigger_point},
        "hook": hook,
    });
    let mut out = String::new();
    canonical(&doc, &mut out);
    out.into_bytes()
}

fn canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            out.push('{');
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                canonical(&map[k], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// Who signed a hook, as the trusted signers name them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SignedBy {
    /// The principal(s) of the `allowed_signers` line that trusts the key.
    pub principal: String,
    /// The key's SHA-256 fingerprint, as `ssh-keygen -l` prints it.
    pub fingerprint: String,
}

impl fmt::Display for SignedBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.principal, self.fingerprint)
    }
}

/// Why one hook's signature is not accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HookSignatureError {
    #[error("is not signed")]
    Unsigned,
    #[error("has a signature that is not an SSH signature (sshsig, armored): {0}")]
    Malformed(String),
    #[error("is signed for {found:?}, not for hooks ({NAMESPACE:?})")]
    WrongNamespace { found: String },
    #[error("is signed by key {fingerprint}, which the trusted signers do not list")]
    Untrusted { fingerprint: String },
    #[error("is signed by {signer}, whose key is not trusted now ({why})")]
    Expired { signer: SignedBy, why: String },
    #[error(
        "has a signature by {signer} that does not match it: its code, settings or action changed since it was signed, or it was signed for another chain"
    )]
    Mismatch { signer: SignedBy },
}

/// Why one line of an `allowed_signers` file trusts nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
enum LineError {
    #[error(
        "the line starts with a key type ({0}): an allowed_signers line starts with who the key is (\"alice@example.com ssh-ed25519 AAAA...\")"
    )]
    KeyTypeFirst(String),
    #[error("no principals")]
    NoPrincipals,
    #[error("no key after the principals")]
    NoKeyAfterPrincipals,
    #[error("no key after the options")]
    NoKeyAfterOptions,
    #[error("no key after the key type {0:?}")]
    NoKeyAfterType(String),
    #[error("not an OpenSSH public key ({key_type}): {reason}")]
    NotAPublicKey { key_type: String, reason: String },
    #[error("cert-authority lines are not supported: list the signers' keys themselves")]
    CertAuthority,
    #[error("unknown option {0:?}")]
    UnknownOption(String),
    #[error("a quote is not closed")]
    UnclosedQuote,
    #[error("{0:?} is not a time (YYYYMMDD[HHMM[SS]][Z])")]
    BadTime(String),
}

/// Why a trusted signers file cannot be used (as a whole).
#[derive(Debug, thiserror::Error)]
pub enum SignersFileError {
    #[error("cannot read the trusted signers {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("the trusted signers {path} list no usable key: {problems}")]
    NoUsableKey { path: String, problems: String },
}

/// One line of an `allowed_signers` file.
#[derive(Clone, Debug)]
struct Signer {
    principal: String,
    key: PublicKey,
    fingerprint: String,
    /// `namespaces="..."`: the sshsig namespaces the key is trusted for (patterns), all when None.
    namespaces: Option<Vec<String>>,
    /// `valid-after` / `valid-before`, as Unix seconds.
    valid_after: Option<i64>,
    valid_before: Option<i64>,
}

/// The keys a platform trusts to approve hook code, read from an `allowed_signers` file as git and
/// `ssh-keygen -Y verify` read it: `principals [options] keytype base64-key [comment]`, with the
/// options `namespaces="..."`, `valid-after=...` and `valid-before=...`. Certificate authorities
/// (`cert-authority`) are not supported: such a line is reported and trusts nothing.
#[derive(Clone, Debug, Default)]
pub struct TrustedSigners {
    signers: Vec<Signer>,
}

/// A line of an `allowed_signers` file that trusts nothing, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct SignersProblem {
    pub line: usize,
    pub message: String,
}

impl TrustedSigners {
    /// Reads an `allowed_signers` text; lines that cannot be used are returned beside the keys that
    /// can (one bad line never drops the others).
    pub fn parse(text: &str) -> (Self, Vec<SignersProblem>) {
        let mut signers = Vec::new();
        let mut problems = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            match Signer::parse(line) {
                Ok(s) => signers.push(s),
                Err(e) => problems.push(SignersProblem {
                    line: i + 1,
                    message: e.to_string(),
                }),
            }
        }
        (Self { signers }, problems)
    }

    /// Reads the `allowed_signers` file at `path`.
    pub fn read(path: &Path) -> std::io::Result<(Self, Vec<SignersProblem>)> {
        let text = std::fs::read_to_string(path)?;
        Ok(Self::parse(&text))
    }

    pub fn len(&self) -> usize {
        self.signers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.signers.is_empty()
    }

    /// Verifies one hook of the chain `namespace/chain` at `trigger_point`, at Unix time `now`.
    pub fn verify(
        &self,
        namespace: &str,
        chain: &str,
        trigger_point: TriggerPoint,
        hook: &HookSpec,
        now: i64,
    ) -> Result<SignedBy, HookSignatureError> {
        let armored = hook
            .signature
            .as_deref()
            .ok_or(HookSignatureError::Unsigned)?;
        let sig = SshSig::from_pem(armored.trim())
            .map_err(|e| HookSignatureError::Malformed(e.to_string()))?;
        if sig.namespace() != NAMESPACE {
            return Err(HookSignatureError::WrongNamespace {
                found: sig.namespace().to_string(),
            });
        }
        let fingerprint = sig.public_key().fingerprint(HashAlg::Sha256).to_string();
        let mut candidates = self
            .signers
            .iter()
            .filter(|s| s.key.key_data() == sig.public_key())
            .filter(|s| s.trusts_namespace(NAMESPACE))
            .peekable();
        if candidates.peek().is_none() {
            return Err(HookSignatureError::Untrusted { fingerprint });
        }
        let msg = message(namespace, chain, trigger_point, hook);
        let mut last = None;
        for signer in candidates {
            let by = SignedBy {
                principal: signer.principal.clone(),
                fingerprint: signer.fingerprint.clone(),
            };
            if let Some(why) = signer.outside_validity(now) {
                last = Some(HookSignatureError::Expired { signer: by, why });
                continue;
            }
            return match signer.key.verify(NAMESPACE, &msg, &sig) {
                Ok(()) => Ok(by),
                Err(_) => Err(HookSignatureError::Mismatch { signer: by }),
            };
        }
        Err(last.unwrap_or(HookSignatureError::Untrusted { fingerprint }))
    }
}

impl Signer {
    fn parse(line: &str) -> Result<Self, LineError> {
        let tokens = tokens(line)?;
        let mut rest = tokens.iter().map(String::as_str);
        let principal = rest.next().ok_or(LineError::NoPrincipals)?.to_string();
        if looks_like_key_type(&principal) {
            return Err(LineError::KeyTypeFirst(principal));
        }
        let mut next = rest.next().ok_or(LineError::NoKeyAfterPrincipals)?;
        let mut namespaces = None;
        let (mut valid_after, mut valid_before) = (None, None);
        if !looks_like_key_type(next) {
            for option in split_options(next) {
                let (name, value) = match option.split_once('=') {
                    Some((n, v)) => (
                        n.to_ascii_lowercase(),
                        Some(v.trim_matches('"').to_string()),
                    ),
                    None => (option.to_ascii_lowercase(), None),
                };
                match (name.as_str(), value) {
                    ("namespaces", Some(v)) => {
                        namespaces = Some(v.split(',').map(|s| s.trim().to_string()).collect())
                    }
                    ("valid-after", Some(v)) => valid_after = Some(ssh_time(&v)?),
                    ("valid-before", Some(v)) => valid_before = Some(ssh_time(&v)?),
                    ("cert-authority", _) => return Err(LineError::CertAuthority),
                    (other, _) => return Err(LineError::UnknownOption(other.to_string())),
                }
            }
            next = rest.next().ok_or(LineError::NoKeyAfterOptions)?;
        }
        let key_type = next;
        let body = rest
            .next()
            .ok_or_else(|| LineError::NoKeyAfterType(key_type.to_string()))?;
        let key = PublicKey::from_openssh(&format!("{key_type} {body}")).map_err(|e| {
            LineError::NotAPublicKey {
                key_type: key_type.to_string(),
                reason: e.to_string(),
            }
        })?;
        Ok(Self {
            principal,
            fingerprint: key.fingerprint(HashAlg::Sha256).to_string(),
            key,
            namespaces,
            valid_after,
            valid_before,
        })
    }

    fn trusts_namespace(&self, ns: &str) -> bool {
        self.namespaces
            .as_ref()
            .is_none_or(|list| list.iter().any(|p| glob(p, ns)))
    }

    fn outside_validity(&self, now: i64) -> Option<String> {
        if let Some(after) = self.valid_after
            && now < after
        {
            return Some(format!("valid after Unix time {after}"));
        }
        if let Some(before) = self.valid_before
            && now >= before
        {
            return Some(format!("valid before Unix time {before}"));
        }
        None
    }
}

/// Splits a line into whitespace-separated tokens; double quotes keep spaces inside one.
fn tokens(line: &str) -> Result<Vec<String>, LineError> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                cur.push(c);
            }
            c if c.is_whitespace() && !quoted => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if quoted {
        return Err(LineError::UnclosedQuote);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    Ok(out)
}

/// Splits an options token at commas outside quotes.
fn split_options(token: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in token.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                cur.push(c);
            }
            ',' if !quoted => out.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    out.push(cur);
    out
}

fn looks_like_key_type(token: &str) -> bool {
    token.starts_with("ssh-")
        || token.starts_with("ecdsa-sha2-")
        || token.starts_with("sk-")
        || token.starts_with("rsa-")
}

/// `*` and `?` patterns, as OpenSSH matches namespaces.
fn glob(pattern: &str, s: &str) -> bool {
    fn go(p: &[u8], s: &[u8]) -> bool {
        match (p.first(), s.first()) {
            (None, None) => true,
            (Some(b'*'), _) => go(&p[1..], s) || (!s.is_empty() && go(p, &s[1..])),
            (Some(b'?'), Some(_)) => go(&p[1..], &s[1..]),
            (Some(a), Some(b)) if a == b => go(&p[1..], &s[1..]),
            _ => false,
        }
    }
    go(pattern.as_bytes(), s.as_bytes())
}

/// `YYYYMMDD[HHMM[SS]][Z]` as `ssh-keygen` reads it; taken as UTC (OpenSSH reads it as local time
/// without `Z`; Sluice's components run in UTC).
fn ssh_time(v: &str) -> Result<i64, LineError> {
    let digits = v.trim_end_matches(['Z', 'z']);
    let bad = || LineError::BadTime(v.to_string());
    if !digits.chars().all(|c| c.is_ascii_digit()) || ![8, 12, 14].contains(&digits.len()) {
        return Err(bad());
    }
    let num = |r: std::ops::Range<usize>| digits.get(r).map_or(Ok(0), |s| s.parse::<i16>());
    let (y, mo, d) = (num(0..4), num(4..6), num(6..8));
    let (h, mi, s) = (num(8..10), num(10..12), num(12..14));
    let (Ok(y), Ok(mo), Ok(d), Ok(h), Ok(mi), Ok(s)) = (y, mo, d, h, mi, s) else {
        return Err(bad());
    };
    let at = jiff::civil::DateTime::new(y, mo as i8, d as i8, h as i8, mi as i8, s as i8, 0)
        .map_err(|_| bad())?;
    at.to_zoned(jiff::tz::TimeZone::UTC)
        .map(|z| z.timestamp().as_second())
        .map_err(|_| bad())
}

/// Where the platform requires signed hook code.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Required {
    /// Nowhere: signatures are neither required nor checked.
    #[default]
    Nowhere,
    /// In every namespace.
    Everywhere,
    /// In these namespaces.
    In(BTreeSet<String>),
}

impl Required {
    /// `*` (every namespace) or a comma-separated list of namespaces.
    pub fn parse(s: &str) -> Self {
        let names: BTreeSet<String> = s
            .split(',')
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect();
        if names.contains("*") {
            Self::Everywhere
        } else if names.is_empty() {
            Self::Nowhere
        } else {
            Self::In(names)
        }
    }

    pub fn covers(&self, namespace: &str) -> bool {
        match self {
            Self::Nowhere => false,
            Self::Everywhere => true,
            Self::In(names) => names.contains(namespace),
        }
    }
}

/// The platform's signing policy: where signed code is required and whose signatures count.
#[derive(Clone, Debug, Default)]
pub struct Policy {
    pub signers: TrustedSigners,
    pub required: Required,
}

/// A chain that is refused for its signatures: per hook that fails, its name and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused(pub Vec<(String, HookSignatureError)>);

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|(hook, e)| format!("hook {hook:?} {e}"))
            .collect();
        write!(
            f,
            "{}; this namespace serves only hook code signed by a trusted key (docs/signing.md)",
            parts.join("; ")
        )
    }
}

impl Policy {
    pub fn requires(&self, namespace: &str) -> bool {
        self.required.covers(namespace)
    }

    /// Whether the chain `namespace/name` may be served: where signatures are required, every hook
    /// must verify, and its signer is returned per hook; elsewhere nothing is checked (`None`s).
    pub fn check(
        &self,
        namespace: &str,
        name: &str,
        spec: &HookChainSpec,
    ) -> Result<Vec<Option<SignedBy>>, Refused> {
        if !self.requires(namespace) {
            return Ok(vec![None; spec.hooks.len()]);
        }
        let now = jiff::Timestamp::now().as_second();
        let mut signers = Vec::new();
        let mut refused = Vec::new();
        for hook in &spec.hooks {
            match self
                .signers
                .verify(namespace, name, spec.trigger_point, hook, now)
            {
                Ok(by) => signers.push(Some(by)),
                Err(e) => refused.push((hook.name.clone(), e)),
            }
        }
        if refused.is_empty() {
            Ok(signers)
        } else {
            Err(Refused(refused))
        }
    }
}

/// A policy whose trusted signers are read from a file (an `allowed_signers` file, or the
/// platform's ConfigMap mounted as one) and read again when it changes: a key added or removed
/// takes effect without a restart. A file that cannot be read or trusts no key at all while it has
/// lines keeps the policy it had (a half-written or broken file never widens or empties trust by
/// accident); the error is returned for the log.
#[derive(Debug)]
pub struct PolicyFile {
    path: std::path::PathBuf,
    required: Required,
    state: std::sync::Mutex<(String, std::sync::Arc<Policy>)>,
}

/// What a re-read found.
#[derive(Debug)]
pub enum Reread {
    Unchanged,
    /// The trusted signers changed (lines that trust nothing listed).
    Changed(Vec<SignersProblem>),
    /// The file cannot be used now; the previous signers stay.
    Kept(SignersFileError),
}

fn read_signers(path: &Path) -> Result<String, SignersFileError> {
    std::fs::read_to_string(path).map_err(|source| SignersFileError::Read {
        path: path.display().to_string(),
        source,
    })
}

fn no_usable_key(path: &Path, problems: &[SignersProblem]) -> SignersFileError {
    SignersFileError::NoUsableKey {
        path: path.display().to_string(),
        problems: problems
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join("; "),
    }
}

impl PolicyFile {
    /// Reads `path` once; a file that cannot be read or has unusable lines only is an error.
    pub fn load(
        path: &Path,
        required: Required,
    ) -> Result<(Self, Vec<SignersProblem>), SignersFileError> {
        let text = read_signers(path)?;
        let (signers, problems) = TrustedSigners::parse(&text);
        if signers.is_empty() && !problems.is_empty() {
            return Err(no_usable_key(path, &problems));
        }
        let policy = Policy {
            signers,
            required: required.clone(),
        };
        Ok((
            Self {
                path: path.to_path_buf(),
                required,
                state: std::sync::Mutex::new((text, std::sync::Arc::new(policy))),
            },
            problems,
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The policy now.
    pub fn current(&self) -> std::sync::Arc<Policy> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .clone()
    }

    /// Reads the file again; the policy changes only when its text did and is usable.
    pub fn reread(&self) -> Reread {
        let text = match read_signers(&self.path) {
            Ok(t) => t,
            Err(e) => return Reread::Kept(e),
        };
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.0 == text {
            return Reread::Unchanged;
        }
        let (signers, problems) = TrustedSigners::parse(&text);
        if signers.is_empty() && !problems.is_empty() {
            return Reread::Kept(no_usable_key(&self.path, &problems));
        }
        *state = (
            text,
            std::sync::Arc::new(Policy {
                signers,
                required: self.required.clone(),
            }),
        );
        Reread::Changed(problems)
    }
}

/// The flags of signed hook code, the same in the gateway, the operator and `sluice check`.
#[cfg(feature = "clap")]
#[derive(Clone, Debug, clap::Args)]
pub struct SigningArgs {
    /// Serve (admit, check) only hook code signed by a key this `allowed_signers` file trusts (SSH
    /// signatures, as git uses them; docs/signing.md), in the namespaces `--signed-namespaces`
    /// names. Read again when it changes.
    #[arg(long, value_name = "FILE")]
    pub trusted_signers: Option<std::path::PathBuf>,
    /// Where signed hook code is required: `*` (every namespace) or a comma-separated list.
    #[arg(
        long,
        value_name = "NAMESPACES",
        default_value = "*",
        requires = "trusted_signers"
    )]
    pub signed_namespaces: String,
}

/// A policy file as loaded, with the lines of it that trust nothing.
#[cfg(feature = "clap")]
pub type Loaded = (std::sync::Arc<PolicyFile>, Vec<SignersProblem>);

#[cfg(feature = "clap")]
impl SigningArgs {
    /// The policy file the flags name, with the lines of it that trust nothing; None without
    /// `--trusted-signers`.
    pub fn load(&self) -> Result<Option<Loaded>, SignersFileError> {
        let Some(path) = &self.trusted_signers else {
            return Ok(None);
        };
        let (file, problems) = PolicyFile::load(path, Required::parse(&self.signed_namespaces))?;
        Ok(Some((std::sync::Arc::new(file), problems)))
    }
}

/// Signs one hook of the chain `namespace/chain` at `trigger_point` with `key` (unencrypted); the
/// armored signature, ready for the hook's `signature` field.
pub fn sign(
    key: &PrivateKey,
    namespace: &str,
    chain: &str,
    trigger_point: TriggerPoint,
    hook: &HookSpec,
) -> Result<String, ssh_key::Error> {
    let msg = message(namespace, chain, trigger_point, hook);
    key.sign(NAMESPACE, HashAlg::Sha512, &msg)?
        .to_pem(LineEnding::LF)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Action;

    const KEY: &str = "-----BEGIN OPENSSH PRIVATE KEY-----
b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW
QyNTUxOQAAACBPB4bR2A8CI9jbaJLQ8dk9EQX+clgiI+tkZ7hbpnYjXwAAAJjqNZw/6jWc
PwAAAAtzc2gtZWQyNTUxOQAAACBPB4bR2A8CI9jbaJLQ8dk9EQX+clgiI+tkZ7hbpnYjXw
AAAEBjdPzRGwSkMQxpEPaIpn+FRtnJ5d7ZPF3zqrKrSi7WjE8HhtHYDwIj2NtoktDx2T0R
Bf5yWCIj62RnuFumdiNfAAAAEHJldmlld2VyQGV4YW1wbGUBAgMEBQ==
-----END OPENSSH PRIVATE KEY-----
";

    fn key() -> PrivateKey {
        PrivateKey::from_openssh(KEY).unwrap()
    }

    fn trusted(extra: &str) -> TrustedSigners {
        let public = key().public_key().to_openssh().unwrap();
        let (t, problems) = TrustedSigners::parse(&format!("reviewer@example {extra}{public}\n"));
        assert_eq!(problems, vec![]);
        t
    }

    fn hook() -> HookSpec {
        HookSpec::with_code(
            "h",
            Action::Modify,
            "def execute(c, s):\n    return {'action': 'pass'}\n",
        )
    }

    fn signed(ns: &str, chain: &str) -> HookSpec {
        let mut h = hook();
        h.signature = Some(sign(&key(), ns, chain, TriggerPoint::Input, &h).unwrap());
        h
    }

    #[test]
    fn a_signed_hook_verifies_in_its_own_chain_only() {
        let t = trusted("");
        let h = signed("team-a", "guard");
        let by = t
            .verify("team-a", "guard", TriggerPoint::Input, &h, 0)
            .unwrap();
        assert_eq!(by.principal, "reviewer@example");
        assert!(by.fingerprint.starts_with("SHA256:"), "{by}");
        for (ns, chain, tp) in [
            ("team-b", "guard", TriggerPoint::Input),
            ("team-a", "other", TriggerPoint::Input),
            ("team-a", "guard", TriggerPoint::Output),
        ] {
            assert!(
                matches!(
                    t.verify(ns, chain, tp, &h, 0),
                    Err(HookSignatureError::Mismatch { .. })
                ),
                "replayed into {ns}/{chain} at {tp}"
            );
        }
    }

    #[test]
    fn any_change_to_what_a_hook_does_breaks_its_signature() {
        let t = trusted("");
        let base = signed("ns", "c");
        let mut changes = Vec::new();
        let mut h = base.clone();
        h.code.push_str("# more\n");
        changes.push(h);
        let mut h = base.clone();
        h.action = Action::Block;
        changes.push(h);
        let mut h = base.clone();
        h.settings = Some(serde_json::json!({"k": 1}));
        changes.push(h);
        let mut h = base.clone();
        h.capabilities = vec!["credit".into()];
        changes.push(h);
        let mut h = base.clone();
        h.name = "renamed".into();
        changes.push(h);
        for h in changes {
            assert!(
                matches!(
                    t.verify("ns", "c", TriggerPoint::Input, &h, 0),
                    Err(HookSignatureError::Mismatch { .. })
                ),
                "{h:?}"
            );
        }
        assert!(t.verify("ns", "c", TriggerPoint::Input, &base, 0).is_ok());
    }

    #[test]
    fn unsigned_untrusted_malformed_and_foreign_signatures_are_named() {
        let t = trusted("");
        let other = PrivateKey::random(&mut ssh_key::rand_core::OsRng, ssh_key::Algorithm::Ed25519)
            .unwrap();
        let mut h = hook();
        assert_eq!(
            t.verify("n", "c", TriggerPoint::Input, &h, 0),
            Err(HookSignatureError::Unsigned)
        );
        h.signature = Some(sign(&other, "n", "c", TriggerPoint::Input, &h).unwrap());
        assert!(matches!(
            t.verify("n", "c", TriggerPoint::Input, &h, 0),
            Err(HookSignatureError::Untrusted { .. })
        ));
        h.signature =
            Some("-----BEGIN SSH SIGNATURE-----\nnope\n-----END SSH SIGNATURE-----".into());
        assert!(matches!(
            t.verify("n", "c", TriggerPoint::Input, &h, 0),
            Err(HookSignatureError::Malformed(_))
        ));
        let msg = message("n", "c", TriggerPoint::Input, &hook());
        let git = key()
            .sign("git", HashAlg::Sha512, &msg)
            .unwrap()
            .to_pem(LineEnding::LF)
            .unwrap();
        h.signature = Some(git);
        assert_eq!(
            t.verify("n", "c", TriggerPoint::Input, &h, 0),
            Err(HookSignatureError::WrongNamespace {
                found: "git".into()
            })
        );
    }

    #[test]
    fn allowed_signers_options_limit_a_key() {
        let h = signed("n", "c");
        let only_git = trusted("namespaces=\"git\" ");
        assert!(matches!(
            only_git.verify("n", "c", TriggerPoint::Input, &h, 0),
            Err(HookSignatureError::Untrusted { .. })
        ));
        let ours = trusted("namespaces=\"git,sluice.dev/*\" ");
        assert!(ours.verify("n", "c", TriggerPoint::Input, &h, 0).is_ok());
        let window = trusted("valid-after=\"20260101\",valid-before=\"20270101Z\" ");
        let in_2026 = 1_780_000_000;
        assert!(
            window
                .verify("n", "c", TriggerPoint::Input, &h, in_2026)
                .is_ok()
        );
        assert!(matches!(
            window.verify("n", "c", TriggerPoint::Input, &h, 1_700_000_000),
            Err(HookSignatureError::Expired { .. })
        ));
        assert!(matches!(
            window.verify("n", "c", TriggerPoint::Input, &h, 1_900_000_000),
            Err(HookSignatureError::Expired { .. })
        ));
    }

    #[test]
    fn bad_allowed_signers_lines_are_reported_and_the_rest_kept() {
        let public = key().public_key().to_openssh().unwrap();
        let text = format!(
            "# a comment\n\nalice {public}\nbob cert-authority {public}\ncarol ssh-ed25519 AAAAnotbase64\ndave\nerin valid-after=\"tomorrow\" {public}\n{public}\n"
        );
        let (t, problems) = TrustedSigners::parse(&text);
        assert_eq!(t.len(), 1);
        let lines: Vec<usize> = problems.iter().map(|p| p.line).collect();
        assert_eq!(lines, vec![4, 5, 6, 7, 8], "{problems:?}");
        assert!(
            problems[4].message.contains("starts with a key type"),
            "{problems:?}"
        );
        assert!(
            problems[0].message.contains("cert-authority"),
            "{problems:?}"
        );
    }

    #[test]
    fn required_is_a_list_of_namespaces_or_every_one() {
        assert_eq!(Required::parse(""), Required::Nowhere);
        assert!(Required::parse("*").covers("x"));
        let some = Required::parse("a, b");
        assert!(some.covers("a") && some.covers("b") && !some.covers("c"));
    }

    #[test]
    fn the_message_is_canonical_json() {
        let mut h = hook();
        h.settings = Some(serde_json::json!({"z": 1, "a": {"y": [1, 2], "b": null}}));
        let m = String::from_utf8(message("n", "c", TriggerPoint::Input, &h)).unwrap();
        assert!(m.starts_with("{\"chain\":{\"name\":\"c\",\"namespace\":\"n\",\"triggerPoint\":\"input\"},\"hook\":{"), "{m}");
        assert!(
            m.contains("\"settings\":{\"a\":{\"b\":null,\"y\":[1,2]},\"z\":1}"),
            "{m}"
        );
        assert!(!m.contains("\"signature\""), "{m}");
        assert!(m.ends_with(",\"sluice\":\"hook signature v1\"}"), "{m}");
    }
}
