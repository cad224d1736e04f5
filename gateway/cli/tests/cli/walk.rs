//! The authoring walk of `docs/hooks.md` (§7½), run as written: each `<!-- walk: run -->` block's
//! command is run in a fresh directory and must print exactly what the page shows, each
//! `<!-- walk: append PATH -->` block is added to that file. The page cannot drift from `sluice`.

use std::path::Path;
use std::process::Command;

enum Step {
    /// The command (after `$ `) and the standard output the page shows for it.
    Run { args: Vec<String>, shown: String },
    /// Text appended to a file, relative to the walk's directory.
    Append { path: String, text: String },
}

/// The steps of the walk, in the page's order: a marker, then the fenced block after it.
fn steps(page: &str) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut lines = page.lines();
    while let Some(line) = lines.next() {
        let Some(marker) = line
            .strip_prefix("<!-- walk: ")
            .and_then(|m| m.strip_suffix(" -->"))
        else {
            continue;
        };
        let fence = lines.next().unwrap_or_default();
        assert!(
            fence.starts_with("```"),
            "a walk marker is followed by a fenced block: {line}"
        );
        let block: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        match marker.split_once(' ') {
            Some(("append", path)) => steps.push(Step::Append {
                path: path.to_string(),
                text: block.iter().map(|l| format!("{l}\n")).collect(),
            }),
            None if marker == "run" => {
                let (command, shown) = block.split_first().expect("a command");
                let command = command.strip_prefix("$ sluice ").expect("`$ sluice ...`");
                steps.push(Step::Run {
                    args: command.split_whitespace().map(str::to_string).collect(),
                    shown: shown.iter().map(|l| format!("{l}\n")).collect(),
                });
            }
            _ => panic!("unknown walk marker: {line}"),
        }
    }
    steps
}

#[test]
fn the_authoring_walk_in_the_guide_works() {
    let page = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/hooks.md");
    let page = std::fs::read_to_string(&page).expect("docs/hooks.md");
    let steps = steps(&page);
    assert!(
        steps
            .iter()
            .filter(|s| matches!(s, Step::Run { .. }))
            .count()
            >= 3
            && steps.iter().any(|s| matches!(s, Step::Append { .. })),
        "the walk is on the page"
    );
    let dir = tempfile::tempdir().unwrap();
    for step in steps {
        match step {
            Step::Append { path, text } => {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .append(true)
                    .open(dir.path().join(&path))
                    .unwrap_or_else(|e| {
                        panic!("the walk appends to {path}, which is not there: {e}")
                    });
                f.write_all(text.as_bytes()).unwrap();
            }
            Step::Run { args, shown } => {
                let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
                    .args(&args)
                    .current_dir(dir.path())
                    .output()
                    .expect("sluice runs");
                let printed = String::from_utf8_lossy(&out.stdout);
                assert!(
                    out.status.success(),
                    "`sluice {}` failed: {printed}{}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                );
                assert_eq!(
                    printed,
                    shown,
                    "`sluice {}` prints something else than docs/hooks.md shows",
                    args.join(" ")
                );
            }
        }
    }
}
