//! `sluice-supervisor`: the program inside every Sluice sandbox.
//!
//! It speaks the supervisor protocol (`supervisor/PROTOCOL.md`) with the gateway and runs each hook
//! of each trigger point in a fresh WebAssembly instance of a pre-initialised CPython
//! (`guest/runner.py`, made into a component by componentize-py and compiled by `compile` at build
//! time). Hook code has no system calls: no processes, threads, signals, sockets or host files. gVisor
//! stays the wall around the whole sandbox.
//!
//! Reading order: `protocol` (the wire) → `runtime` (wasmtime: engine, instances) → `prepare`
//! (instances made ahead of their call) → `deadline` → `blocking` (waits end at the deadline) → `relay`
//! (host calls) → `checks` (what a hook may return) → `supervisor` (the protocol loop) → this file
//! (the command line).

mod attach;
mod blocking;
mod checks;
mod clock;
mod deadline;
mod output;
mod prepare;
mod protocol;
mod python;
mod relay;
mod runtime;
mod supervisor;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::ExitCode;

use protocol::Channel;
use runtime::{Runtime, RuntimeError, SelfCheckError};
use supervisor::Supervisor;

const USAGE: &str = "usage:
  sluice-supervisor --runtime CWASM [--runtime-sha256 HEX] [--memory-bytes BYTES] [--trace-lines]   serve the protocol on stdin/stderr
  sluice-supervisor --listen --runtime CWASM [--runtime-sha256 HEX] [--memory-bytes BYTES]   a warm pod's main process: wait for one attach
  sluice-supervisor --probe --runtime CWASM [--runtime-sha256 HEX] [--memory-bytes BYTES] [--require-gvisor]   self-test: one hook through a real instance (and gVisor under it)
  sluice-supervisor attach [--probe]                                                         the relay a claimed pod's exec runs (or its readiness probe)
  sluice-supervisor compile COMPONENT.wasm OUT.cwasm                                         build step: precompile the cell component
  sluice-supervisor python --runtime CWASM [-I] [-S] -c PROGRAM                              run a Python program in a cell: stdin in, stdout out (how hook code is checked)
Without --runtime-sha256 the digest is read from CWASM.sha256 (in an image, beside the file).";

/// A hook's memory when the gateway names none (the chain's `resources.memory` normally).
const DEFAULT_MEMORY_BYTES: usize = 256 << 20;

#[derive(Debug, PartialEq, Eq)]
enum Mode {
    Serve,
    Listen,
    Probe,
}

#[derive(Debug)]
struct Options {
    mode: Mode,
    runtime: PathBuf,
    runtime_sha256: String,
    memory_bytes: usize,
    /// Authoring tools (`sluice test`, `sluice run`): a hook that runs out of time stops at the
    /// line it is on, and its error names that line (each call traces its lines; slower).
    trace_lines: bool,
    /// `--probe --require-gvisor` (`sluice doctor`): the probe fails unless the kernel it runs on
    /// is gVisor's.
    require_gvisor: bool,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut mode = Mode::Serve;
    let mut runtime = None;
    let mut runtime_sha256 = None;
    let mut memory_bytes = DEFAULT_MEMORY_BYTES;
    let mut trace_lines = false;
    let mut require_gvisor = false;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) => (flag, Some(value.to_string())),
            None => (arg.as_str(), None),
        };
        let mut value = |name: &str| {
            inline
                .clone()
                .or_else(|| args.next().cloned())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match flag {
            "--probe" | "--listen" => {
                if mode != Mode::Serve {
                    return Err("--listen and --probe exclude each other".into());
                }
                mode = if flag == "--probe" {
                    Mode::Probe
                } else {
                    Mode::Listen
                };
            }
            "--trace-lines" => trace_lines = true,
            "--require-gvisor" => require_gvisor = true,
            "--runtime" => runtime = Some(PathBuf::from(value("--runtime")?)),
            "--runtime-sha256" => runtime_sha256 = Some(value("--runtime-sha256")?),
            "--memory-bytes" => {
                let v = value("--memory-bytes")?;
                let n: usize = v.parse().map_err(|_| {
                    format!("--memory-bytes needs a non-negative integer, not {v:?}")
                })?;
                // 0 (no limit from the gateway) keeps the default.
                if n > 0 {
                    memory_bytes = n;
                }
            }
            // Process limits of the forked cells that came before: nothing here forks.
            "--pids" | "--cell-tmp-bytes" => {
                value(flag)?;
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let runtime: PathBuf = runtime.ok_or("--runtime is required")?;
    let runtime_sha256 = match runtime_sha256 {
        Some(hex) => hex,
        None => {
            let file = format!("{}.sha256", runtime.display());
            std::fs::read_to_string(&file)
                .map_err(|e| format!("no --runtime-sha256 and cannot read {file}: {e}"))?
                .trim()
                .to_string()
        }
    };
    Ok(Options {
        mode,
        runtime,
        runtime_sha256,
        memory_bytes,
        trace_lines,
        require_gvisor,
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("compile") => return compile(&args[1..]),
        Some("python") => return python::run(&args[1..]),
        Some("attach") => {
            return match &args[1..] {
                [] => ExitCode::from(attach::relay(false)),
                [p] if p == "--probe" => ExitCode::from(attach::relay(true)),
                _ => {
                    eprintln!("{USAGE}");
                    ExitCode::from(2)
                }
            };
        }
        _ => {}
    }
    let opts = match parse(&args) {
        Ok(opts) => opts,
        Err(e) => {
            eprintln!("{USAGE}\nsluice-supervisor: {e}");
            return ExitCode::from(2);
        }
    };
    match opts.mode {
        Mode::Probe => probe(&opts),
        Mode::Serve => serve(&opts),
        Mode::Listen => match start(&opts) {
            Ok(runtime) => ExitCode::from(attach::listen(runtime)),
            Err(why) => {
                eprintln!("sluice supervisor: cannot create cells: {why}");
                ExitCode::from(1)
            }
        },
    }
}

fn stdio_file(fd: impl AsFd) -> std::io::Result<File> {
    Ok(File::from(fd.as_fd().try_clone_to_owned()?))
}

/// Serves the protocol on stdin (requests) and stderr (answers).
fn serve(opts: &Options) -> ExitCode {
    let (reader, writer) = match (stdio_file(std::io::stdin()), stdio_file(std::io::stderr())) {
        (Ok(r), Ok(w)) => (r, w),
        _ => return ExitCode::from(1),
    };
    let mut channel = Channel::new(reader, writer);
    let runtime = match start(opts) {
        Ok(runtime) => runtime,
        Err(why) => {
            let _ = channel.send(&serde_json::json!({"type": "error", "message": format!("cannot create cells: {why}")}));
            return ExitCode::from(1);
        }
    };
    Supervisor::new(runtime, channel)
        .with_trace_lines(opts.trace_lines)
        .serve();
    ExitCode::SUCCESS
}

/// Why the supervisor cannot create cells: said before it exits, never `ready`.
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    SelfCheck(#[from] SelfCheckError),
}

/// Loads the runtime and proves an instance works here before the sandbox says `ready`.
fn start(opts: &Options) -> Result<Runtime, StartError> {
    let runtime = Runtime::load(&opts.runtime, &opts.runtime_sha256, opts.memory_bytes)?;
    runtime.self_check()?;
    Ok(runtime)
}

const PROBE_HOOK: &str = "def execute(context, settings):\n    return {'action': 'modify', 'outgoing': context['outgoing'].upper()}\n";

/// One chain of one hook through the real protocol loop and a real instance, over a pair of pipes;
/// every answer must be exactly the expected one.
fn probe(opts: &Options) -> ExitCode {
    let fail = |why: String| {
        eprintln!("sluice supervisor probe failed: {why}");
        ExitCode::from(1)
    };
    let runtime = match start(opts) {
        Ok(runtime) => runtime,
        Err(why) => return fail(format!("cannot create cells: {why}")),
    };
    let requests = [
        serde_json::json!({"type": "init", "trigger_point": "input", "failure_policy": "Closed",
            "hooks": [{"name": "probe", "action": "modify", "settings": {}, "code": PROBE_HOOK}]}),
        serde_json::json!({"type": "chunk", "id": 1, "start": 0, "outgoing": "ready?", "state": [null], "context": {}}),
        serde_json::json!({"type": "end"}),
        serde_json::json!({"type": "shutdown"}),
    ];
    let want = [
        serde_json::json!({"type": "ready", "protocol": supervisor::PROTOCOL_VERSION, "pid": std::process::id()}),
        serde_json::json!({"type": "ack", "hooks": [{"name": "probe", "ok": true}]}),
        serde_json::json!({"type": "hook_result", "id": 1, "index": 0, "name": "probe", "action": "modify", "outgoing": "READY?"}),
        serde_json::json!({"type": "result", "id": 1, "action": "modify", "terminal_index": null}),
        serde_json::json!({"type": "ended", "clean": true}),
    ];
    let (Ok((req_r, mut req_w)), Ok((resp_r, resp_w))) = (pipe(), pipe()) else {
        return fail("cannot make pipes".into());
    };
    // A few hundred bytes: they fit in the pipe before anyone reads.
    let text: String = requests.iter().map(|r| format!("{r}\n")).collect();
    if req_w.write_all(text.as_bytes()).is_err() {
        return fail("cannot write the requests".into());
    }
    drop(req_w);
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        let mut resp_r = resp_r;
        let _ = resp_r.read_to_string(&mut out);
        out
    });
    Supervisor::new(runtime, Channel::new(req_r, resp_w)).serve();
    let Ok(out) = reader.join() else {
        return fail("the reader thread failed".into());
    };
    let got: Vec<serde_json::Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|mut v| {
            if let Some(map) = v.as_object_mut() {
                map.remove("latency_us");
            }
            v
        })
        .collect();
    if got != want {
        return fail(format!(
            "answers {}, expected {}",
            serde_json::json!(got),
            serde_json::json!(want)
        ));
    }
    let kernel = std::fs::read_to_string("/proc/version").unwrap_or_default();
    let gvisor = kernel.trim() == GVISOR_KERNEL;
    if opts.require_gvisor && !gvisor {
        return fail(format!(
            "not running under gVisor: the kernel says {:?} (gVisor's says {GVISOR_KERNEL:?}); the pod's RuntimeClass handler is not runsc",
            kernel.trim()
        ));
    }
    eprintln!(
        "sluice supervisor probe: a hook ran in a cell{}",
        if gvisor { ", under gVisor" } else { "" }
    );
    ExitCode::SUCCESS
}

/// What gVisor's Sentry reports as the kernel in `/proc/version`, whatever the host runs.
const GVISOR_KERNEL: &str = "Linux version 4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016";

fn pipe() -> std::io::Result<(File, File)> {
    let (r, w) = std::io::pipe()?;
    Ok((
        File::from(std::os::fd::OwnedFd::from(r)),
        File::from(std::os::fd::OwnedFd::from(w)),
    ))
}

/// `compile COMPONENT OUT`: writes the precompiled artefact and, beside it, `OUT.sha256`, the digest
/// the gateway passes to every sandbox's supervisor.
fn compile(args: &[String]) -> ExitCode {
    let [input, output] = args else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let component = match std::fs::read(input) {
        Ok(bytes) => bytes,
        Err(e) => {
            eprintln!("sluice-supervisor: cannot read {input}: {e}");
            return ExitCode::from(1);
        }
    };
    let artefact = match runtime::compile(&component) {
        Ok(bytes) => bytes,
        Err(e) => {
            eprintln!("sluice-supervisor: {e}");
            return ExitCode::from(1);
        }
    };
    let digest = runtime::sha256_hex(&artefact);
    let tmp = format!("{output}.tmp");
    let written = std::fs::write(&tmp, &artefact)
        .and_then(|()| std::fs::rename(&tmp, output))
        .and_then(|()| std::fs::write(format!("{output}.sha256"), format!("{digest}\n")));
    if let Err(e) = written {
        eprintln!("sluice-supervisor: cannot write {output}: {e}");
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}
