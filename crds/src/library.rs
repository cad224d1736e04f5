//! Ready hooks: a library of hooks shipped and versioned with Sluice, used from a HookChain by name
//! (`uses: pii/iban`) with settings, instead of code. A ready hook runs in the same cells as any
//! hook: its code is ours (`crds/library/`), the chain's declared action decides what a match does
//! (modify masks, block blocks, detect reports), and its settings are checked against what it reads.
//!
//! Every component (webhook, operator, gateway, `sluice check`) resolves a name to the same code, so
//! the code hash, and with it the pods a chain runs in, covers the ready hook's code: a Sluice
//! release that changes a ready hook rolls it out as any code change.

use crate::Action;
use serde_json::Value;

/// What a setting's value must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Text,
    Integer,
    Number,
    Boolean,
    /// A list of texts.
    Texts,
    /// A list of integers.
    Integers,
    /// A list of texts, each one of these.
    OneOf(&'static [&'static str]),
}

impl Kind {
    fn accepts(self, v: &Value) -> bool {
        match self {
            Kind::Text => v.is_string(),
            Kind::Integer => v.as_i64().is_some_and(|n| n >= 0),
            Kind::Number => v.is_number(),
            Kind::Boolean => v.is_boolean(),
            Kind::Texts => v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
            Kind::Integers => v.as_array().is_some_and(|a| a.iter().all(|n| n.is_i64())),
            Kind::OneOf(names) => v.as_array().is_some_and(|a| {
                a.iter()
                    .all(|n| n.as_str().is_some_and(|n| names.contains(&n)))
            }),
        }
    }

    /// How the docs and errors name it.
    pub fn describe(self) -> String {
        match self {
            Kind::Text => "a string".into(),
            Kind::Integer => "a whole number (0 or more)".into(),
            Kind::Number => "a number".into(),
            Kind::Boolean => "true or false".into(),
            Kind::Texts => "a list of strings".into(),
            Kind::Integers => "a list of whole numbers".into(),
            Kind::OneOf(names) => format!("a list of: {}", names.join(", ")),
        }
    }
}

/// One setting a ready hook reads.
#[derive(Debug)]
pub struct Setting {
    pub name: &'static str,
    pub kind: Kind,
    /// The default, as the docs show it; `None`: the setting is required.
    pub default: Option<&'static str>,
    pub meaning: &'static str,
}

/// One ready hook.
#[derive(Debug)]
pub struct ReadyHook {
    /// What `uses:` names it by.
    pub name: &'static str,
    pub summary: &'static str,
    /// The actions a chain may declare for it.
    pub actions: &'static [Action],
    pub settings: &'static [Setting],
    code: &'static str,
}

const PRELUDE: &str = include_str!("../library/prelude.py");

const MASK: Setting = Setting {
    name: "mask",
    kind: Kind::Text,
    default: Some("\"[{kind}]\""),
    meaning: "what replaces a match under modify; `{kind}` is the kind of match",
};
const BLOCK_MESSAGE: Setting = Setting {
    name: "message",
    kind: Kind::Text,
    default: Some("says what was found"),
    meaning: "the block message; `{what}` is filled with what was found (kinds and counts)",
};
const FINDER: &[Action] = &[Action::Modify, Action::Block, Action::Detect];
const SIGNAL: &[Action] = &[Action::Block, Action::Detect];

/// The library, in the order the docs list it.
pub const LIBRARY: &[ReadyHook] = &[
    ReadyHook {
        name: "pii/email",
        summary: "e-mail addresses",
        actions: FINDER,
        settings: &[MASK, BLOCK_MESSAGE],
        code: include_str!("../library/pii/email.py"),
    },
    ReadyHook {
        name: "pii/phone",
        summary: "phone numbers, international (+44 20 7946 0958) and national in groups (010-1234-5678, (030) 1234 5678)",
        actions: FINDER,
        settings: &[
            Setting {
                name: "min_digits",
                kind: Kind::Integer,
                default: Some("8"),
                meaning: "fewer digits than this is not a phone number (at most 15, E.164's limit)",
            },
            Setting {
                name: "international_only",
                kind: Kind::Boolean,
                default: Some("false"),
                meaning: "only numbers written with + and a country code",
            },
            MASK,
            BLOCK_MESSAGE,
        ],
        code: include_str!("../library/pii/phone.py"),
    },
    ReadyHook {
        name: "pii/card",
        summary: "payment card numbers: 13 to 19 digits, grouped or not, that pass the Luhn check",
        actions: FINDER,
        settings: &[MASK, BLOCK_MESSAGE],
        code: include_str!("../library/pii/card.py"),
    },
    ReadyHook {
        name: "pii/iban",
        summary: "IBANs of every issuing country, with the country's length and the mod-97 checksum",
        actions: FINDER,
        settings: &[MASK, BLOCK_MESSAGE],
        code: include_str!("../library/pii/iban.py"),
    },
    ReadyHook {
        name: "pii/ip",
        summary: "IPv4 and IPv6 addresses (valid ones only)",
        actions: FINDER,
        settings: &[
            Setting {
                name: "versions",
                kind: Kind::Integers,
                default: Some("[4, 6]"),
                meaning: "which IP versions to find",
            },
            Setting {
                name: "private",
                kind: Kind::Boolean,
                default: Some("true"),
                meaning: "also private, loopback and link-local addresses (false: only global ones)",
            },
            MASK,
            BLOCK_MESSAGE,
        ],
        code: include_str!("../library/pii/ip.py"),
    },
    ReadyHook {
        name: "pii/secrets",
        summary: "API keys and secrets: known prefixes (OpenAI, GitHub, AWS, Slack, Google, Stripe, JWTs, private keys) and long random-looking tokens",
        actions: FINDER,
        settings: &[
            Setting {
                name: "entropy",
                kind: Kind::Boolean,
                default: Some("true"),
                meaning: "also tokens of letters and digits that look random (Shannon entropy)",
            },
            Setting {
                name: "min_length",
                kind: Kind::Integer,
                default: Some("32"),
                meaning: "the shortest token the entropy test looks at",
            },
            Setting {
                name: "min_entropy",
                kind: Kind::Number,
                default: Some("4.2"),
                meaning: "bits per character from which a token counts as random (hex digests stay under 4)",
            },
            MASK,
            BLOCK_MESSAGE,
        ],
        code: include_str!("../library/pii/secrets.py"),
    },
    ReadyHook {
        name: "pii/national-id",
        summary: "national identity numbers, each switched on by name: US SSN, UK National Insurance number, Spanish DNI (with its check letter)",
        actions: FINDER,
        settings: &[
            Setting {
                name: "ids",
                kind: Kind::OneOf(&["us_ssn", "uk_nino", "es_dni"]),
                default: None,
                meaning: "which identity numbers to find",
            },
            MASK,
            BLOCK_MESSAGE,
        ],
        code: include_str!("../library/pii/national-id.py"),
    },
    ReadyHook {
        name: "injection/heuristics",
        summary: "prompt injection and jailbreak phrasings (ignore previous instructions, reveal the system prompt, role overrides, chat markup)",
        actions: SIGNAL,
        settings: &[
            Setting {
                name: "threshold",
                kind: Kind::Integer,
                default: Some("1"),
                meaning: "how many distinct signals make an attempt",
            },
            Setting {
                name: "extra_patterns",
                kind: Kind::Texts,
                default: Some("[]"),
                meaning: "more signals, as Python regular expressions (case-insensitive)",
            },
            Setting {
                name: "message",
                kind: Kind::Text,
                default: Some("a refusal"),
                meaning: "the block message",
            },
        ],
        code: include_str!("../library/injection/heuristics.py"),
    },
    ReadyHook {
        name: "text/keywords",
        summary: "words and patterns of topics to keep out (competitors, banned terms)",
        actions: FINDER,
        settings: &[
            Setting {
                name: "words",
                kind: Kind::Texts,
                default: Some("[]"),
                meaning: "words or phrases, matched as written",
            },
            Setting {
                name: "patterns",
                kind: Kind::Texts,
                default: Some("[]"),
                meaning: "Python regular expressions",
            },
            Setting {
                name: "case_sensitive",
                kind: Kind::Boolean,
                default: Some("false"),
                meaning: "match case as written",
            },
            Setting {
                name: "whole_words",
                kind: Kind::Boolean,
                default: Some("true"),
                meaning: "a word matches only as a whole word",
            },
            Setting {
                name: "mask",
                kind: Kind::Text,
                default: Some("\"[removed]\""),
                meaning: "what replaces a match under modify",
            },
            Setting {
                name: "message",
                kind: Kind::Text,
                default: Some("a refusal"),
                meaning: "the block message",
            },
        ],
        code: include_str!("../library/text/keywords.py"),
    },
    ReadyHook {
        name: "text/length",
        summary: "a limit on the characters of text a payload carries (all its strings together)",
        actions: FINDER,
        settings: &[
            Setting {
                name: "max_chars",
                kind: Kind::Integer,
                default: None,
                meaning: "the most characters allowed",
            },
            Setting {
                name: "suffix",
                kind: Kind::Text,
                default: Some("\"…\""),
                meaning: "what ends a text cut short under modify (within max_chars)",
            },
            Setting {
                name: "message",
                kind: Kind::Text,
                default: Some("says the length and the limit"),
                meaning: "the block message; `{chars}` and `{max_chars}` are filled in",
            },
        ],
        code: include_str!("../library/text/length.py"),
    },
    ReadyHook {
        name: "text/script",
        summary: "a limit on the writing systems (scripts) a payload's letters may be in: a language limit by script, not a language detector",
        actions: SIGNAL,
        settings: &[
            Setting {
                name: "allowed",
                kind: Kind::OneOf(&[
                    "latin",
                    "cyrillic",
                    "greek",
                    "arabic",
                    "hebrew",
                    "han",
                    "kana",
                    "hangul",
                    "devanagari",
                    "thai",
                    "armenian",
                    "georgian",
                    "bengali",
                    "tamil",
                ]),
                default: None,
                meaning: "the scripts a payload may be written in",
            },
            Setting {
                name: "min_letters",
                kind: Kind::Integer,
                default: Some("20"),
                meaning: "shorter texts are not judged",
            },
            Setting {
                name: "max_other_share",
                kind: Kind::Number,
                default: Some("0.1"),
                meaning: "the share of letters in other scripts tolerated (names, quotes)",
            },
            Setting {
                name: "message",
                kind: Kind::Text,
                default: Some("a refusal"),
                meaning: "the block message",
            },
        ],
        code: include_str!("../library/text/script.py"),
    },
];

/// The ready hook `name` names.
pub fn find(name: &str) -> Option<&'static ReadyHook> {
    LIBRARY.iter().find(|h| h.name == name)
}

/// Every name `uses:` accepts.
pub fn names() -> impl Iterator<Item = &'static str> {
    LIBRARY.iter().map(|h| h.name)
}

impl ReadyHook {
    /// The code a hook that uses this ready hook with `action` runs: the declared action, the
    /// library's shared part, the hook's own.
    pub fn code(&self, action: Action) -> String {
        format!(
            "# Sluice ready hook {name}.\nDECLARED_ACTION = {action:?}\n\n{PRELUDE}\n\n{code}",
            name = self.name,
            action = action.as_str(),
            code = self.code,
        )
    }

    /// What is wrong with `action` and `settings` for this ready hook: (field, message) pairs.
    pub fn problems(&self, action: Action, settings: Option<&Value>) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if !self.actions.contains(&action) {
            let can: Vec<&str> = self.actions.iter().map(|a| a.as_str()).collect();
            out.push((
                "action".to_string(),
                format!(
                    "{} can {}, not {}",
                    self.name,
                    can.join(", "),
                    action.as_str()
                ),
            ));
        }
        let given = settings.and_then(Value::as_object);
        for s in self.settings {
            match given.and_then(|g| g.get(s.name)) {
                None if s.default.is_none() => out.push((
                    format!("settings.{}", s.name),
                    format!(
                        "{} needs this setting ({}): {}",
                        self.name,
                        s.kind.describe(),
                        s.meaning
                    ),
                )),
                Some(v) if !s.kind.accepts(v) => out.push((
                    format!("settings.{}", s.name),
                    format!("must be {}, not {v}", s.kind.describe()),
                )),
                _ => {}
            }
        }
        for key in given.into_iter().flat_map(|g| g.keys()) {
            if self.settings.iter().any(|s| s.name == key) {
                continue;
            }
            let known: Vec<&str> = self.settings.iter().map(|s| s.name).collect();
            let hint = match crate::did_you_mean(key, known.iter().copied()) {
                Some(meant) => format!("did you mean {meant}?"),
                None => format!("it reads {}", known.join(", ")),
            };
            out.push((
                format!("settings.{key}"),
                format!("{} has no setting {key:?}: {hint}", self.name),
            ));
        }
        out
    }
}

/// The library as `docs/hooks.md` lists it: one section per ready hook, its actions and settings.
pub fn markdown() -> String {
    let mut out = String::new();
    for h in LIBRARY {
        let actions: Vec<String> = h
            .actions
            .iter()
            .map(|a| format!("`{}`", a.as_str()))
            .collect();
        out.push_str(&format!(
            "### `{}`\n\n{}. Actions: {}.\n\n| setting | type | default | meaning |\n|---|---|---|---|\n",
            h.name,
            capitalised(h.summary),
            actions.join(", ")
        ));
        for s in h.settings {
            out.push_str(&format!(
                "| `{}` | {} | {} | {} |\n",
                s.name,
                s.kind.describe(),
                s.default
                    .map_or("**required**".to_string(), |d| d.replace('"', "`")),
                s.meaning
            ));
        }
        out.push('\n');
    }
    out
}

fn capitalised(text: &str) -> String {
    let mut chars = text.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/hooks.md lists the library as it is (`SLUICE_BLESS=1` rewrites the list).
    #[test]
    fn the_hook_guide_lists_every_ready_hook_and_setting() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/hooks.md");
        let doc = std::fs::read_to_string(path).expect("docs/hooks.md");
        let (begin, end) = ("<!-- ready hooks: begin -->\n", "<!-- ready hooks: end -->");
        let from = doc.find(begin).expect("the begin marker") + begin.len();
        let to = doc.find(end).expect("the end marker");
        let listed = &doc[from..to];
        if std::env::var_os("SLUICE_BLESS").is_some() {
            std::fs::write(
                path,
                format!("{}{}{}", &doc[..from], markdown(), &doc[to..]),
            )
            .expect("written");
            return;
        }
        assert_eq!(
            listed,
            markdown(),
            "docs/hooks.md is behind the library: run with SLUICE_BLESS=1"
        );
    }

    #[test]
    fn names_are_unique_and_every_ready_hook_can_detect_or_block() {
        let mut seen = std::collections::HashSet::new();
        for h in LIBRARY {
            assert!(seen.insert(h.name), "{} twice", h.name);
            assert!(h.actions.contains(&Action::Detect), "{}", h.name);
            assert!(h.actions.contains(&Action::Block), "{}", h.name);
            assert!(
                h.code(Action::Detect).contains("def execute("),
                "{}",
                h.name
            );
        }
    }

    #[test]
    fn settings_are_checked_against_what_the_ready_hook_reads() {
        let iban = find("pii/iban").expect("pii/iban");
        assert!(iban.problems(Action::Modify, None).is_empty());
        let p = iban.problems(
            Action::Skip,
            Some(&serde_json::json!({"mask": 3, "maks": "x"})),
        );
        let text = format!("{p:?}");
        assert!(
            text.contains("pii/iban can modify, block, detect, not skip"),
            "{text}"
        );
        assert!(text.contains("must be a string, not 3"), "{text}");
        assert!(text.contains("did you mean mask?"), "{text}");
        let ids = find("pii/national-id").expect("national ids");
        let p = format!("{:?}", ids.problems(Action::Modify, None));
        assert!(p.contains("needs this setting"), "{p}");
        let p = format!(
            "{:?}",
            ids.problems(
                Action::Modify,
                Some(&serde_json::json!({"ids": ["us_ssn", "fr_insee"]}))
            )
        );
        assert!(p.contains("a list of: us_ssn, uk_nino, es_dni"), "{p}");
    }
}
