//! `sluice-supervisor python`: a Python program run in a cell, as `python3 -I -S -c PROGRAM` would
//! run it, with its standard input and output. Tools that check hook code (`sluice check`, the local
//! gateway) run their analyser this way, so code is judged by the CPython that runs it, not by
//! whichever Python the host has.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use crate::relay::Relay;
use crate::runtime::{HookCode, Runtime};

/// What runs the program inside the instance: its standard input and output swapped for the text
/// given and a buffer, `SystemExit` taken as the exit status.
const WRAPPER: &str = r#"
import io, sys

def execute(context, settings):
    sys.stdin = io.StringIO(context["outgoing"])
    out = io.StringIO()
    sys.stdout = out
    status = 0
    try:
        exec(compile(settings["program"], "<program>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return {"action": "detect", "findings": {"stdout": out.getvalue(), "status": status}}
"#;

/// The most a program may take, and answer.
const DEADLINE: Duration = Duration::from_secs(60);
const MAX_OUTPUT: usize = 64 << 20;
const MEMORY: usize = 512 << 20;

pub(crate) fn run(args: &[String]) -> ExitCode {
    match program(args) {
        Ok(status) => status,
        Err(why) => {
            eprintln!("sluice-supervisor python: {why}");
            ExitCode::from(2)
        }
    }
}

fn program(args: &[String]) -> Result<ExitCode, String> {
    let mut runtime = None;
    let mut source = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--runtime" => runtime = args.next().map(PathBuf::from),
            "-c" => source = args.next().cloned(),
            // A cell is always isolated: no environment, no site, no user directory.
            "-I" | "-S" => {}
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let runtime = runtime.ok_or("--runtime is required")?;
    let source = source.ok_or("-c PROGRAM is required")?;
    let digest_file = format!("{}.sha256", runtime.display());
    let digest = std::fs::read_to_string(&digest_file)
        .map_err(|e| format!("cannot read {digest_file}: {e}"))?;
    let cells = Runtime::load(&runtime, digest.trim(), MEMORY).map_err(|e| e.to_string())?;
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .map_err(|e| format!("cannot read standard input: {e}"))?;
    let code = cells
        .load_hook("program", WRAPPER, DEADLINE)
        .map_err(|e| e.to_string())?
        .map_err(|refused| format!("the wrapper did not load: {refused}"))?;
    let hook = HookCode {
        key: [0; 32],
        name: "program".into(),
        code: Arc::new(code),
        timeout: DEADLINE,
    };
    let request = serde_json::json!({"outgoing": input, "state": null, "context": {},
        "settings": {"program": source}})
    .to_string();
    let deadline = cells.arm(DEADLINE);
    let called = cells.call_hook(
        &hook,
        &request,
        Relay::refusing("a program has no host calls"),
        &deadline,
        MAX_OUTPUT,
    );
    deadline.disarm();
    let answer = called.answer.map_err(|e| e.to_string())?;
    let answer: serde_json::Value =
        serde_json::from_str(&answer).map_err(|e| format!("the cell answered no JSON: {e}"))?;
    if let Some(error) = answer["error"].as_str() {
        eprintln!("{error}");
        return Ok(ExitCode::from(1));
    }
    let found = &answer["value"]["findings"];
    let stdout = found["stdout"].as_str().unwrap_or_default();
    std::io::stdout()
        .write_all(stdout.as_bytes())
        .map_err(|e| format!("cannot write standard output: {e}"))?;
    let status = found["status"].as_u64().unwrap_or(1).min(255) as u8;
    Ok(ExitCode::from(status))
}
