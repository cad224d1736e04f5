//! Which lines of each hook's code the runs of an authoring tool ran (`sluice test --coverage`). Off
//! unless switched on (`Engine::record_coverage`): only sandboxes under `--trace-lines` report lines,
//! and only an engine that asked for them keeps them, so a gateway that serves keeps nothing.

use crate::chain::Chain;
use crate::chains::Chains;
use crate::outcome::Walk;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Mutex;

/// One hook's lines, in the file its chain was read from where that is known (else in its code).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HookCoverage {
    /// The chain's `namespace/name`.
    pub chain: String,
    pub hook: String,
    /// The file the chain was read from, and whether the lines below are that file's (true) or
    /// the hook's code's own (false: the file or the code's place in it is not known).
    pub file: PathBuf,
    pub in_file: bool,
    /// Lines that can run, and those that ran in at least one call. Empty when the hook never ran.
    pub code: BTreeSet<usize>,
    pub run: BTreeSet<usize>,
    /// Calls that reported lines.
    pub calls: u64,
}

/// Every hook's lines so far, by chain and hook.
#[derive(Default)]
pub(crate) struct Coverage {
    hooks: Mutex<BTreeMap<(String, String), HookCoverage>>,
}

impl Coverage {
    /// Adds the lines a walk's hooks reported, each against the chain it belongs to.
    pub(crate) fn record(&self, chains: &Chains, walk: &Walk) {
        let mut hooks = self.hooks.lock().unwrap_or_else(|e| e.into_inner());
        for h in &walk.hooks {
            let Some(lines) = &h.lines else { continue };
            let baseline = h.layer.is_baseline();
            let Some((chain, _)) = chains.ordered().find(|(_, b)| *b == baseline) else {
                continue;
            };
            // What the sandbox says can only name lines the hook's code has.
            let Some(spec) = chain.spec.hooks.get(h.index).filter(|s| s.name == h.name) else {
                continue;
            };
            let last = spec.code.lines().count();
            let base = chain.code_lines.get(h.index).copied().flatten();
            let place = |n: &u32| {
                let n = *n as usize;
                (1..=last).contains(&n).then(|| base.map_or(n, |b| b + n))
            };
            let entry = hooks
                .entry((chain.qualified_name(), h.name.clone()))
                .or_insert_with(|| empty(chain, &h.name));
            entry.code.extend(lines.code.iter().filter_map(place));
            entry.run.extend(lines.run.iter().filter_map(place));
            entry.calls += 1;
        }
    }

    /// Every hook written as code in `served` (ready hooks are the library's, tested with it), with
    /// the lines its runs reported: a hook no run reached has none.
    pub(crate) fn report<'a>(&self, served: impl Iterator<Item = &'a Chain>) -> Vec<HookCoverage> {
        let hooks = self.hooks.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<HookCoverage> = served
            .flat_map(|chain| {
                chain
                    .spec
                    .hooks
                    .iter()
                    .filter(|h| h.uses.is_none())
                    .map(|h| {
                        hooks
                            .get(&(chain.qualified_name(), h.name.clone()))
                            .cloned()
                            .unwrap_or_else(|| empty(chain, &h.name))
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        out.sort_by(|a, b| (&a.file, &a.chain).cmp(&(&b.file, &b.chain)));
        out
    }
}

fn empty(chain: &Chain, hook: &str) -> HookCoverage {
    let index = chain.spec.hooks.iter().position(|h| h.name == hook);
    HookCoverage {
        chain: chain.qualified_name(),
        hook: hook.to_string(),
        file: chain.origin.file.clone(),
        in_file: index
            .and_then(|i| chain.code_lines.get(i).copied().flatten())
            .is_some(),
        ..Default::default()
    }
}
