//! `sluice test --coverage`: which lines of each hook's code the cases ran, summed over every test
//! file that uses a chain, as `opa test --coverage` or `go test -cover` show a policy's or a
//! package's.

use crate::FileReport;
use sluice_engine::HookCoverage;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Component, Path, PathBuf};

/// Every hook of the chains the reports' files used, its lines summed over all of them.
pub fn merge(reports: &[&FileReport]) -> Vec<HookCoverage> {
    let mut merged: BTreeMap<(String, String, String), HookCoverage> = BTreeMap::new();
    let mut order = Vec::new();
    for h in reports.iter().flat_map(|r| &r.coverage) {
        let file = tidy(&h.file);
        let key = (file.display().to_string(), h.chain.clone(), h.hook.clone());
        match merged.get_mut(&key) {
            Some(m) => {
                m.code.extend(&h.code);
                m.run.extend(&h.run);
                m.calls += h.calls;
            }
            None => {
                order.push(key.clone());
                merged.insert(key, HookCoverage { file, ..h.clone() });
            }
        }
    }
    order.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
    order.iter().filter_map(|k| merged.remove(k)).collect()
}

/// `tests/../chain.yaml` as `chain.yaml`: a chain named from a test file's directory, shown (and
/// summed) as one path however the test files reach it.
fn tidy(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir
                if matches!(out.components().next_back(), Some(Component::Normal(_))) =>
            {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// `21, 23-25, 31`: line numbers, runs of consecutive ones as ranges.
fn ranges(lines: impl IntoIterator<Item = usize>) -> String {
    let mut out = String::new();
    let mut run: Option<(usize, usize)> = None;
    let flush = |out: &mut String, (a, b): (usize, usize)| {
        let sep = if out.is_empty() { "" } else { ", " };
        let _ = if a == b {
            write!(out, "{sep}{a}")
        } else {
            write!(out, "{sep}{a}-{b}")
        };
    };
    for n in lines {
        run = match run {
            Some((a, b)) if n == b + 1 => Some((a, n)),
            Some(r) => {
                flush(&mut out, r);
                Some((n, n))
            }
            None => Some((n, n)),
        };
    }
    if let Some(r) = run {
        flush(&mut out, r);
    }
    out
}

fn percent(run: usize, code: usize) -> String {
    if code == 0 {
        "-".into()
    } else {
        format!("{:.0}%", 100.0 * run as f64 / code as f64)
    }
}

/// The report as printed: per file, one line per hook with the lines no case ran, then the total.
pub fn describe(hooks: &[HookCoverage]) -> Vec<String> {
    let mut out = vec!["coverage: lines of hook code the cases ran".to_string()];
    if hooks.is_empty() {
        out.push("  no hook written as code in the chains tested".into());
        return out;
    }
    let width = hooks
        .iter()
        .map(|h| h.chain.len() + h.hook.len() + 1)
        .max()
        .unwrap_or(0);
    let (mut run, mut code) = (0, 0);
    let mut file = None;
    for h in hooks {
        if file != Some(&h.file) {
            out.push(format!("  {}", h.file.display()));
            file = Some(&h.file);
        }
        let name = format!("{}/{}", h.chain, h.hook);
        if h.calls == 0 {
            out.push(format!("    {name:width$}  never run: no case reached it"));
            continue;
        }
        let ran = h.run.intersection(&h.code).count();
        run += ran;
        code += h.code.len();
        let mut line = format!(
            "    {name:width$}  {ran}/{} lines ({})",
            h.code.len(),
            percent(ran, h.code.len())
        );
        let missed: Vec<usize> = h.code.difference(&h.run).copied().collect();
        if !missed.is_empty() {
            let _ = write!(line, "  not run: line {}", ranges(missed));
            if !h.in_file {
                line.push_str(" of its code");
            }
        }
        out.push(line);
    }
    let never = hooks.iter().filter(|h| h.calls == 0).count();
    let mut total = format!("  total: {run}/{code} lines ({})", percent(run, code));
    if never > 0 {
        let _ = write!(total, ", {never} hook(s) never run");
    }
    out.push(total);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_reached_through_dot_dot_is_one_path() {
        assert_eq!(
            tidy(Path::new("examples/tests/../a.yaml")),
            Path::new("examples/a.yaml")
        );
        assert_eq!(
            tidy(Path::new("./t/./../../a.yaml")),
            Path::new("../a.yaml")
        );
        assert_eq!(tidy(Path::new("/x/../a.yaml")), Path::new("/a.yaml"));
    }

    #[test]
    fn consecutive_lines_read_as_ranges() {
        assert_eq!(ranges([3, 4, 5, 9, 11, 12]), "3-5, 9, 11-12");
        assert_eq!(ranges([7]), "7");
        assert_eq!(ranges([]), "");
    }

    #[test]
    fn a_hook_tested_in_two_files_sums_its_lines() {
        let hook = |run: &[usize]| HookCoverage {
            chain: "default/c".into(),
            hook: "h".into(),
            file: "c.yaml".into(),
            in_file: true,
            code: [10, 11, 12, 13].into(),
            run: run.iter().copied().collect(),
            calls: 1,
        };
        let a = FileReport {
            path: "a.test.yaml".into(),
            cases: vec![],
            coverage: vec![hook(&[10, 11])],
        };
        let b = FileReport {
            path: "b.test.yaml".into(),
            cases: vec![],
            coverage: vec![hook(&[10, 13])],
        };
        let merged = merge(&[&a, &b]);
        assert_eq!(merged.len(), 1);
        assert_eq!(merged[0].calls, 2);
        let text = describe(&merged).join("\n");
        assert!(
            text.contains("default/c/h  3/4 lines (75%)  not run: line 12"),
            "{text}"
        );
        assert!(text.ends_with("total: 3/4 lines (75%)"), "{text}");
    }
}
