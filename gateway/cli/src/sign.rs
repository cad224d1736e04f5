//! `sluice sign` and `sluice verify`: SSH signatures on hooks (docs/signing.md).
//!
//! Signing writes each hook's `signature:` into the chain file itself, after the hook's `name:`
//! line, so the file a reviewer signed is the file the platform applies; everything else in the
//! file (comments, order, quoting) is left as it was. The file is written only when every hook it
//! signed verifies, read back from the new text, against the signing key.

use sluice_crds::manifest::{self, Object};
use sluice_crds::signing::{self, Policy, Required, TrustedSigners};
use ssh_key::PrivateKey;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Why a file could not be signed.
#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("cannot read the key {path}: {source}")]
    ReadKey {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is neither an OpenSSH private key nor a public key (for ssh-agent): {reason}")]
    NotAKey {
        path: String,
        reason: ssh_key::Error,
    },
    #[error("{path}: not an OpenSSH public key: {reason}")]
    NotAPublicKey {
        path: String,
        reason: ssh_key::Error,
    },
    #[error("cannot sign: {0}")]
    Sign(ssh_key::Error),
    #[error("cannot run ssh-keygen to sign with {path}: {source}")]
    SshKeygen {
        path: String,
        source: std::io::Error,
    },
    #[error("ssh-keygen -Y sign failed ({0})")]
    SshKeygenFailed(std::process::ExitStatus),
    #[error("ssh-keygen -Y sign wrote no signature")]
    NoSignature,
    #[error("{0}: fix it before signing")]
    Unreadable(Box<manifest::LoadError>),
    #[error(
        "{file}:{line}: HookChain {chain:?}, hook {hook:?}: no `name: {hook}` line of its own to sign under (a hook written in flow style, `{{name: ...}}`?): write it as a block mapping"
    )]
    FlowStyle {
        file: String,
        line: usize,
        chain: String,
        hook: String,
    },
    #[error("no hook named {hook:?} in {file}")]
    NoSuchHook { hook: String, file: String },
    #[error("the signed text does not read back: {0}")]
    ReadBack(Box<manifest::LoadError>),
    #[error(
        "HookChain {chain:?}, hook {hook:?}: the signed file does not verify ({reason}); nothing written"
    )]
    DoesNotVerify {
        chain: String,
        hook: String,
        reason: signing::HookSignatureError,
    },
}

/// What signs: a private key read here, or `ssh-keygen -Y sign` for keys only it can use (a
/// passphrase-protected key, asked for as ssh-keygen asks; a public key whose private half is in
/// ssh-agent; a security key).
pub enum Key {
    Plain(Box<PrivateKey>),
    SshKeygen(PathBuf),
}

impl Key {
    pub fn load(path: &Path) -> Result<Self, SignError> {
        let text = std::fs::read_to_string(path).map_err(|source| SignError::ReadKey {
            path: path.display().to_string(),
            source,
        })?;
        match PrivateKey::from_openssh(&text) {
            Ok(key) if !key.is_encrypted() => Ok(Self::Plain(Box::new(key))),
            Ok(_) => Ok(Self::SshKeygen(path.to_path_buf())),
            Err(_) if ssh_key::PublicKey::from_openssh(text.trim()).is_ok() => {
                Ok(Self::SshKeygen(path.to_path_buf()))
            }
            Err(reason) => Err(SignError::NotAKey {
                path: path.display().to_string(),
                reason,
            }),
        }
    }

    /// The public key, to check what was signed.
    fn public(&self) -> Result<ssh_key::PublicKey, SignError> {
        match self {
            Self::Plain(k) => Ok(k.public_key().clone()),
            Self::SshKeygen(path) => {
                let pub_path = if path.extension().is_some_and(|e| e == "pub") {
                    path.clone()
                } else {
                    let mut p = path.clone().into_os_string();
                    p.push(".pub");
                    PathBuf::from(p)
                };
                let text =
                    std::fs::read_to_string(&pub_path).map_err(|source| SignError::ReadKey {
                        path: pub_path.display().to_string(),
                        source,
                    })?;
                ssh_key::PublicKey::from_openssh(text.trim()).map_err(|reason| {
                    SignError::NotAPublicKey {
                        path: pub_path.display().to_string(),
                        reason,
                    }
                })
            }
        }
    }

    fn sign(&self, msg: &[u8]) -> Result<String, SignError> {
        match self {
            Self::Plain(k) => k
                .sign(signing::NAMESPACE, ssh_key::HashAlg::Sha512, msg)
                .and_then(|s| s.to_pem(ssh_key::LineEnding::LF))
                .map_err(SignError::Sign),
            Self::SshKeygen(path) => {
                let mut child = Command::new("ssh-keygen")
                    .args(["-q", "-Y", "sign", "-n", signing::NAMESPACE, "-f"])
                    .arg(path)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()
                    .map_err(|source| SignError::SshKeygen {
                        path: path.display().to_string(),
                        source,
                    })?;
                let failed = |source| SignError::SshKeygen {
                    path: path.display().to_string(),
                    source,
                };
                if let Some(mut stdin) = child.stdin.take() {
                    use std::io::Write as _;
                    stdin.write_all(msg).map_err(failed)?;
                }
                let out = child.wait_with_output().map_err(failed)?;
                if !out.status.success() {
                    return Err(SignError::SshKeygenFailed(out.status));
                }
                String::from_utf8(out.stdout).map_err(|_| SignError::NoSignature)
            }
        }
    }
}

/// One hook signed.
pub struct Signed {
    pub chain: String,
    pub hook: String,
}

/// Signs the hooks of every HookChain in `text` (only `only` when given) and returns the new text.
pub fn sign_text(
    file: &Path,
    text: &str,
    key: &Key,
    only: Option<&str>,
) -> Result<(String, Vec<Signed>), SignError> {
    let mut edits: Vec<Edit> = Vec::new();
    let mut signed = Vec::new();
    for item in manifest::parse(file, text) {
        let o = item.map_err(|e| SignError::Unreadable(Box::new(e)))?;
        let Object::HookChain(hc) = &o.value else {
            continue;
        };
        let ns = manifest::namespace_of(&hc.metadata);
        let name = hc.metadata.name.clone().unwrap_or_default();
        for hook in &hc.spec.hooks {
            if only.is_some_and(|h| h != hook.name) {
                continue;
            }
            let msg = signing::message(&ns, &name, hc.spec.trigger_point, hook);
            let signature = key.sign(&msg)?;
            edits.push(
                Edit::find(text, o.line, &hook.name, signature).ok_or_else(|| {
                    SignError::FlowStyle {
                        file: file.display().to_string(),
                        line: o.line,
                        chain: name.clone(),
                        hook: hook.name.clone(),
                    }
                })?,
            );
            signed.push(Signed {
                chain: format!("{ns}/{name}"),
                hook: hook.name.clone(),
            });
        }
    }
    if let Some(only) = only
        && signed.is_empty()
    {
        return Err(SignError::NoSuchHook {
            hook: only.to_string(),
            file: file.display().to_string(),
        });
    }
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    edits.sort_by_key(|e| std::cmp::Reverse(e.name_line));
    for e in edits {
        e.apply(&mut lines);
    }
    let mut out = lines.join("\n");
    if text.ends_with('\n') {
        out.push('\n');
    }
    // What was written must be what was signed: read it back and verify with the key.
    let public = key.public()?;
    let (trusted, _) = TrustedSigners::parse(&format!(
        "signer {}",
        public.to_openssh().map_err(SignError::Sign)?
    ));
    let policy = Policy {
        signers: trusted,
        required: Required::Everywhere,
    };
    for item in manifest::parse(file, &out) {
        let o = item.map_err(|e| SignError::ReadBack(Box::new(e)))?;
        if let Object::HookChain(hc) = &o.value {
            let ns = manifest::namespace_of(&hc.metadata);
            let name = hc.metadata.name.clone().unwrap_or_default();
            for hook in &hc.spec.hooks {
                let wanted = signed
                    .iter()
                    .any(|s| s.chain == format!("{ns}/{name}") && s.hook == hook.name);
                if wanted
                    && let Err(reason) =
                        policy
                            .signers
                            .verify(&ns, &name, hc.spec.trigger_point, hook, 0)
                {
                    return Err(SignError::DoesNotVerify {
                        chain: name,
                        hook: hook.name.clone(),
                        reason,
                    });
                }
            }
        }
    }
    Ok((out, signed))
}

/// A signature to put under one hook's `name:` line (replacing one it has).
struct Edit {
    name_line: usize,
    column: usize,
    /// Lines of an existing `signature:` to remove: [from, to).
    remove: Option<(usize, usize)>,
    signature: String,
}

impl Edit {
    fn find(text: &str, doc_line: usize, hook: &str, signature: String) -> Option<Self> {
        let lines: Vec<&str> = text.lines().collect();
        let key_of = |l: &str| -> (usize, String) {
            let t = l.trim_start();
            let mut col = l.len() - t.len();
            let t = match t.strip_prefix("- ") {
                Some(rest) => {
                    col += 2 + (rest.len() - rest.trim_start().len());
                    rest.trim_start()
                }
                None => t,
            };
            (col, t.to_string())
        };
        let from = doc_line.saturating_sub(1);
        let is_name = |t: &str| {
            t.strip_prefix("name:").is_some_and(|v| {
                let v = v.split(" #").next().unwrap_or(v).trim();
                v.trim_matches(['"', '\'']) == hook
            })
        };
        let name_line = (from..lines.len()).find(|&i| {
            is_name(&key_of(lines[i]).1)
                && (lines[i].trim_start().starts_with("- ") || is_hook_item_key(&lines, i))
        })?;
        let (column, _) = key_of(lines[name_line]);
        // The item's own lines: down to a line indented less than its keys, or the next item.
        let mut end = name_line + 1;
        while end < lines.len() {
            let l = lines[end];
            let t = l.trim_start();
            let ind = l.len() - t.len();
            if !t.is_empty() && ind < column {
                break;
            }
            end += 1;
        }
        // An item's first line may sit above its name (`- action: ...`): look from there too.
        let mut start = name_line;
        while start > from {
            let l = lines[start];
            if l.trim_start().starts_with("- ") && key_of(l).0 == column {
                break;
            }
            start -= 1;
        }
        let mut remove = None;
        for i in start..end {
            let (col, t) = key_of(lines[i]);
            if col == column
                && t.starts_with("signature:")
                && !lines[i].trim_start().starts_with("- ")
            {
                let mut j = i + 1;
                while j < end {
                    let l = lines[j];
                    let t = l.trim_start();
                    if !t.is_empty() && l.len() - t.len() <= column {
                        break;
                    }
                    j += 1;
                }
                remove = Some((i, j));
            }
        }
        Some(Self {
            name_line,
            column,
            remove,
            signature,
        })
    }

    fn apply(self, lines: &mut Vec<String>) {
        let pad = " ".repeat(self.column);
        let mut block = vec![format!("{pad}signature: |")];
        block.extend(
            self.signature
                .lines()
                .filter(|l| !l.is_empty())
                .map(|l| format!("{pad}  {l}")),
        );
        // Remove first when the old signature is below the name line (indices above stay put).
        match self.remove {
            Some((a, b)) if a > self.name_line => {
                lines.drain(a..b);
                lines.splice(self.name_line + 1..self.name_line + 1, block);
            }
            Some((a, b)) => {
                lines.splice(self.name_line + 1..self.name_line + 1, block);
                lines.drain(a..b);
            }
            None => {
                lines.splice(self.name_line + 1..self.name_line + 1, block);
            }
        }
    }
}

/// Whether line `i` (a `name:` key not starting an item) belongs to an item of a `hooks:` list:
/// some line above at a smaller indentation starts with `- `.
fn is_hook_item_key(lines: &[&str], i: usize) -> bool {
    let ind = lines[i].len() - lines[i].trim_start().len();
    lines[..i].iter().rev().find_map(|l| {
        let t = l.trim_start();
        let li = l.len() - t.len();
        (!t.is_empty() && li < ind).then(|| t.starts_with("- "))
    }) == Some(true)
}

/// `sluice verify`: every hook of every HookChain in `files` must verify against `trusted`.
/// Prints one line per hook; false when any does not.
pub fn verify(files: &[PathBuf], trusted: &TrustedSigners) -> bool {
    let now = jiff_now();
    let mut ok = true;
    let mut hooks = 0;
    for file in files {
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) => {
                println!("{}: cannot read: {e}", file.display());
                ok = false;
                continue;
            }
        };
        for item in manifest::parse(file, &text) {
            let o = match item {
                Ok(o) => o,
                Err(e) => {
                    println!("{e}");
                    ok = false;
                    continue;
                }
            };
            let Object::HookChain(hc) = &o.value else {
                continue;
            };
            let ns = manifest::namespace_of(&hc.metadata);
            let name = hc.metadata.name.clone().unwrap_or_default();
            for hook in &hc.spec.hooks {
                hooks += 1;
                let line = manifest::hook_code_line(&text, o.line, &hook.name).unwrap_or(o.line);
                match trusted.verify(&ns, &name, hc.spec.trigger_point, hook, now) {
                    Ok(by) => println!(
                        "{}:{line}: HookChain {ns}/{name}, hook {:?}: signed by {by}",
                        file.display(),
                        hook.name
                    ),
                    Err(e) => {
                        ok = false;
                        println!(
                            "{}:{line}: HookChain {ns}/{name}, hook {:?} {e}",
                            file.display(),
                            hook.name
                        );
                    }
                }
            }
        }
    }
    if hooks == 0 {
        println!("no hooks to verify");
        return false;
    }
    ok
}

fn jiff_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default()
}
