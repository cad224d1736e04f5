//! `sluice-bench cells`: what WebAssembly cells and recycled sandboxes buy. CPU per hook beside the
//! fork cell they replaced, memory per sandbox, warm Run latency and sustained runs/s for
//! `reuse: Recycle` and `reuse: None`, a one-hook chain, CPU per trigger point, a burst on an idle
//! chain, and the two ceilings measured in the same run: fresh sandboxes booted per second, and
//! trigger points per second of the 3-hook chain driven straight into sandboxes (no gateway), on
//! each gVisor platform.

use crate::report::{Row, Table, percentile};
use crate::{Bench, chain_yaml, text_1k};
use anyhow::Context;
use sluice_engine::{Limits, SandboxBackend, SupervisorConn};
use sluice_sandbox_local::{LocalBackend, LocalConfig};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WINDOW: Duration = Duration::from_secs(12);

fn pool(reuse: &str, warm: u32, max: u32) -> String {
    format!("{{warm: {warm}, max: {max}, reuse: {reuse}}}")
}

/// The one-hook chain: the phone redactor alone.
fn one_hook_yaml(reuse: &str) -> String {
    let mut y = chain_yaml("one", "one", "input", &pool(reuse, 4, 8), "");
    // Keep the first hook only.
    if let Some(cut) = y.find("    - name: redact-email") {
        y.truncate(cut);
    }
    y
}

/// CPU time (all cores, user + system) the machine has spent so far.
fn machine_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: u64 = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .take(3) // user, nice, system
        .filter_map(|t| t.parse::<u64>().ok())
        .sum();
    Duration::from_millis(ticks * 10) // USER_HZ is 100 on Linux
}

struct Sustained {
    rate: f64,
    errors: u64,
    cpu_per_run: Duration,
}

/// Runs/s with `clients` concurrent clients over `WINDOW`.
async fn sustained(bench: &Bench, target: &str, hooks: usize, clients: usize) -> Sustained {
    let text = text_1k();
    let cpu = machine_cpu();
    let began = Instant::now();
    let results = futures::future::join_all((0..clients).map(|_| {
        let text = &text;
        async move {
            let (mut done, mut errors) = (0u64, 0u64);
            while began.elapsed() < WINDOW {
                match bench.run(target, text).await {
                    Ok(r) if r.hooks.len() == hooks => done += 1,
                    _ => errors += 1,
                }
            }
            (done, errors)
        }
    }))
    .await;
    let elapsed = began.elapsed().as_secs_f64();
    let done: u64 = results.iter().map(|r| r.0).sum();
    let cpu = machine_cpu().saturating_sub(cpu);
    Sustained {
        rate: done as f64 / elapsed,
        errors: results.iter().map(|r| r.1).sum(),
        cpu_per_run: cpu / done.max(1) as u32,
    }
}

/// Warm Run latency: each run finds a sandbox with its cell open (the pool is refilled in between).
/// Beside each run, the time its hooks took as the supervisor measured them (from the chunk's
/// arrival to each result): the rest is the way there and back.
async fn warm_latency(
    bench: &Bench,
    target: &str,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let text = text_1k();
    for _ in 0..3 {
        bench.warm_run(target, &text).await?;
    }
    let (mut samples, mut in_hooks) = (Vec::new(), Vec::new());
    for _ in 0..60 {
        let (took, r) = bench.warm_run(target, &text).await?;
        anyhow::ensure!(r.hooks.len() == 3, "a run did not run the chain: {r:?}");
        samples.push(took);
        in_hooks.push(Duration::from_micros(
            r.hooks.iter().map(|h| h.latency_us).sum(),
        ));
    }
    Ok((samples, in_hooks))
}

async fn start(reuse: &str, platform: &str, warm: u32, max: u32) -> anyhow::Result<Bench> {
    Bench::start_with(
        &[(
            "c.yaml",
            chain_yaml("bench", "bench", "input", &pool(reuse, warm, max), ""),
        )],
        |o| o.sandbox.platform = platform.into(),
    )
    .await
}

/// Trigger points per second of the 3-hook chain, straight into one sandbox per core with no gateway
/// (walk the 1 KiB payload through the open cell's three hooks, each in a fresh instance, end the
/// cell, open the next), as fast as they go: the most the sandboxes themselves can serve.
async fn cell_ceiling(platform: &str) -> anyhow::Result<f64> {
    let (_state, backend) = local_backend(platform).await?;
    let chain = Arc::new(crate::naive::bench_chain()?);
    let limits = Limits::default();
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    let mut conns = Vec::new();
    for _ in 0..workers {
        conns.push(open_sandbox(&backend, &chain, &limits).await?);
    }
    let payload = serde_json::Value::String(text_1k());
    let payload = &payload;
    let began = Instant::now();
    let deaths = std::sync::atomic::AtomicU64::new(0);
    let counts = futures::future::join_all(conns.iter_mut().map(|conn| {
        let chain = &chain;
        let limits = &limits;
        let backend = &backend;
        let deaths = &deaths;
        async move {
            let mut n = 0u64;
            while began.elapsed() < WINDOW {
                let cycle = async {
                    walk(conn, payload, 3).await?;
                    conn.end(Duration::from_secs(30)).await?;
                    conn.prepare(chain, &limits.wire(), Duration::from_secs(30))
                        .await?;
                    anyhow::Ok(())
                };
                match cycle.await {
                    Ok(()) => n += 1,
                    Err(e) => {
                        // Counted and reported: a sandbox that dies here is a finding, not noise.
                        deaths.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        eprintln!("cell ceiling: a sandbox died after {n} cells: {e}");
                        let fresh = open_sandbox(backend, chain, limits).await?;
                        let dead = std::mem::replace(conn, fresh);
                        dead.close().await;
                    }
                }
            }
            anyhow::Ok(n)
        }
    }))
    .await;
    let elapsed = began.elapsed().as_secs_f64();
    for conn in conns {
        conn.close().await;
    }
    let total: u64 = counts
        .into_iter()
        .collect::<anyhow::Result<Vec<u64>>>()?
        .into_iter()
        .sum();
    let deaths = deaths.load(std::sync::atomic::Ordering::Relaxed);
    if deaths > 0 {
        eprintln!("cell ceiling ({platform}): {deaths} sandbox deaths");
    }
    Ok(total as f64 / elapsed)
}

/// 32 requests at once on a chain that has been idle (warm 2, max 8): errors and latency.
async fn burst(platform: &str) -> anyhow::Result<(Vec<Duration>, usize)> {
    let bench = start("Recycle", platform, 2, 8).await?;
    let text = text_1k();
    let runs = futures::future::join_all((0..32).map(|_| {
        let bench = &bench;
        let text = &text;
        async move {
            let began = Instant::now();
            let ok = matches!(bench.run("bench", text).await, Ok(r) if r.hooks.len() == 3);
            (began.elapsed(), ok)
        }
    }))
    .await;
    bench.gateway.shutdown().await;
    let errors = runs.iter().filter(|(_, ok)| !ok).count();
    Ok((runs.into_iter().map(|(d, _)| d).collect(), errors))
}

/// One walk at a time straight into a prepared sandbox (no gateway, no gRPC): `chunk` written to
/// `result` read, as the gateway's sandbox connection sees it. The cell is closed and the next one
/// opened after each walk, and the sandbox left alone a moment, as between a client's calls.
async fn straight_walks(platform: &str) -> anyhow::Result<Vec<Duration>> {
    let (_state, backend) = local_backend(platform).await?;
    let chain = Arc::new(crate::naive::bench_chain()?);
    let limits = Limits::default();
    let mut conn = open_sandbox(&backend, &chain, &limits).await?;
    let payload = serde_json::Value::String(text_1k());
    let mut samples = Vec::new();
    for i in 0..63 {
        if i > 0 {
            conn.prepare(&chain, &limits.wire(), Duration::from_secs(30))
                .await?;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let began = Instant::now();
        walk(&mut conn, &payload, 3).await?;
        if i >= 3 {
            samples.push(began.elapsed());
        }
        conn.end(Duration::from_secs(30)).await?;
    }
    conn.close().await;
    Ok(samples)
}

/// The warm-Run rows: Recycle on each platform, None on `none_platform`.
async fn warm_rows(
    table: &mut Table,
    platforms: &[&str],
    none_platform: &str,
) -> anyhow::Result<()> {
    for p in platforms {
        let bench = start("Recycle", p, 2, 8).await?;
        let (samples, in_hooks) = warm_latency(&bench, "bench").await?;
        bench.gateway.shutdown().await;
        table.push(
            Row::latency(
                &format!("Warm Run, Recycle, 3 hooks, 1 KiB ({p})"),
                &samples,
            )
            .target("p50 ≤ 2 ms"),
        );
        table.push(Row::latency(
            &format!("  of which the walk in the sandbox, as the supervisor timed it ({p})"),
            &in_hooks,
        ));
        table.push(Row::latency(
            &format!("  a walk straight into a sandbox, chunk to result, no gateway ({p})"),
            &straight_walks(p)
                .await
                .context("walks straight into a sandbox")?,
        ));
    }
    let bench = start("None", none_platform, 2, 8).await?;
    let (samples, _) = warm_latency(&bench, "bench").await?;
    bench.gateway.shutdown().await;
    table.push(Row::latency(
        &format!("Warm Run, None, 3 hooks, 1 KiB ({none_platform})"),
        &samples,
    ));
    Ok(())
}

/// `sluice-bench warm`: the warm-Run rows alone (None on systrap).
pub(crate) async fn warm_runs(table: &mut Table) -> anyhow::Result<()> {
    warm_rows(table, &["ptrace", "systrap"], "systrap").await
}

pub(crate) async fn bench(table: &mut Table) -> anyhow::Result<()> {
    cpu_per_hook(table).await.context("CPU per hook")?;
    let platforms = ["ptrace", "systrap"];
    // Ceilings first, on a quiet machine.
    let boots = crate::naive::boot_ceiling(WINDOW).await?;
    let mut cells = Vec::new();
    for p in platforms {
        cells.push((p, cell_ceiling(p).await?));
    }
    for (p, c) in &cells {
        table.push(Row::value(
            &format!("Ceiling: trigger points/s, 3-hook chain, straight into the sandboxes ({p})"),
            format!("{c:.1}/s"),
        ));
    }
    table.push(Row::value(
        "Ceiling: fresh sandboxes booted/s",
        format!("{boots:.1}/s"),
    ));
    let fastest = cells
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(p, c)| (p.to_string(), *c))
        .unwrap_or(("ptrace".into(), 1.0));

    warm_rows(table, &platforms, &fastest.0).await?;

    let mut recycle8 = 0.0;
    let mut none8 = 0.0;
    for clients in [8, 32] {
        for reuse in ["Recycle", "None"] {
            let bench = start(reuse, &fastest.0, 4, 8).await?;
            let s = sustained(&bench, "bench", 3, clients).await;
            bench.gateway.shutdown().await;
            if clients == 8 {
                if reuse == "Recycle" {
                    recycle8 = s.rate;
                } else {
                    none8 = s.rate;
                }
            }
            let mut row = Row::value(
                &format!(
                    "Sustained Run/s, {reuse}, {clients} clients, 3 hooks ({})",
                    fastest.0
                ),
                format!(
                    "{:.1}/s ({} errors, {:.0} ms CPU per trigger point, {:.0} % of the ceiling)",
                    s.rate,
                    s.errors,
                    s.cpu_per_run.as_secs_f64() * 1000.0,
                    100.0 * s.rate / fastest.1
                ),
            );
            if reuse == "Recycle" && clients == 8 {
                row = row.target("≥ 45/s");
            }
            table.push(row);
        }
    }
    table.push(
        Row::value(
            "  Recycle ÷ None, 8 clients",
            format!("{:.1}×", recycle8 / none8.max(0.001)),
        )
        .target("≥ 5×"),
    );
    let bench = Bench::start_with(&[("one.yaml", one_hook_yaml("Recycle"))], |o| {
        o.sandbox.platform = fastest.0.clone()
    })
    .await?;
    let s = sustained(&bench, "one", 1, 8).await;
    bench.gateway.shutdown().await;
    table.push(
        Row::value(
            &format!(
                "Sustained Run/s, Recycle, 8 clients, 1 hook ({})",
                fastest.0
            ),
            format!(
                "{:.1}/s ({} errors, {:.0} ms CPU per trigger point)",
                s.rate,
                s.errors,
                s.cpu_per_run.as_secs_f64() * 1000.0
            ),
        )
        .target("≥ 110/s"),
    );
    let (samples, errors) = burst(&fastest.0).await?;
    table.push(
        Row::value(
            &format!(
                "Burst: 32 Runs at once on an idle chain (warm 2, max 8, {})",
                fastest.0
            ),
            format!(
                "{errors} errors · p50 {:.0} ms · p99 {:.0} ms",
                percentile(&samples, 50.0).as_secs_f64() * 1000.0,
                percentile(&samples, 99.0).as_secs_f64() * 1000.0
            ),
        )
        .target("0 errors, p99 ≤ 1 s"),
    );
    Ok(())
}

/// CPU time a sandbox's processes (gVisor's sentry and its helpers) have used, from the cpuacct
/// cgroup runsc made for it (`cgroupsPath`); None where that cannot be read.
fn sandbox_cpu(cgroup: &str) -> Option<Duration> {
    let text = std::fs::read_to_string(format!("/sys/fs/cgroup/cpuacct/{cgroup}/cpuacct.usage"))
        .or_else(|_| {
            std::fs::read_to_string(format!("/sys/fs/cgroup/cpu,cpuacct/{cgroup}/cpuacct.usage"))
        })
        .ok()?;
    text.trim().parse().ok().map(Duration::from_nanos)
}

/// CPU used since `before` by the sandbox in `cgroup`, or by the whole machine where the cgroup
/// cannot be read.
struct CpuMeter {
    cgroup: String,
    sandbox: Option<Duration>,
    machine: Duration,
}

impl CpuMeter {
    fn start(cgroup: &str) -> Self {
        Self {
            cgroup: cgroup.into(),
            sandbox: sandbox_cpu(cgroup),
            machine: machine_cpu(),
        }
    }

    fn used(&self) -> Duration {
        match (self.sandbox, sandbox_cpu(&self.cgroup)) {
            (Some(before), Some(now)) => now.saturating_sub(before),
            _ => machine_cpu().saturating_sub(self.machine),
        }
    }
}

/// The hook both cell designs run: the benchmark chain's phone redactor on a 1 KiB payload.
const PHONE_HOOK: &str = "import re\nP = re.compile(r'\\b\\d{3}-\\d{4}-\\d{4}\\b')\ndef execute(context, settings):\n    t = P.sub('[phone]', context['outgoing'])\n    return {'action': 'modify', 'outgoing': t} if t != context['outgoing'] else {'action': 'pass'}\n";

/// What a WebAssembly cell costs its sandbox, steady state.
struct WasmCost {
    /// Host CPU per hook (the sandbox's cgroup, else the machine's).
    cpu: Duration,
    /// The sandbox's memory cgroup after the walks, and its peak: gVisor, the supervisor, the
    /// loaded runtime and the pool's resident instance slots.
    memory: Option<(u64, u64)>,
}

/// Bytes in use now and at most so far by the sandbox in `cgroup` (runsc's memory cgroup).
fn sandbox_memory(cgroup: &str) -> Option<(u64, u64)> {
    let read = |file: &str| {
        std::fs::read_to_string(format!("/sys/fs/cgroup/memory/{cgroup}/{file}"))
            .ok()?
            .trim()
            .parse::<u64>()
            .ok()
    };
    Some((
        read("memory.usage_in_bytes")?,
        read("memory.max_usage_in_bytes")?,
    ))
}

/// A WebAssembly cell's cost: one sandbox on `platform`, a one-hook chain, `n` walks (each a fresh
/// instance); CPU over them divided by `n`, and the sandbox's memory after them.
async fn wasm_cell_cost(platform: &str, n: u32) -> anyhow::Result<WasmCost> {
    let (_state, backend) = local_backend(platform).await?;
    let yaml = format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: HookChain\nmetadata: {{name: cpu, namespace: default}}\nspec:\n  target: cpu\n  triggerPoint: input\n  hooks:\n    - name: redact-phone\n      action: modify\n      code: |\n{}",
        PHONE_HOOK
            .lines()
            .map(|l| format!("        {l}\n"))
            .collect::<String>()
    );
    let chain = Arc::new(crate::naive::chain_from_yaml(&yaml)?);
    let mut conn = open_sandbox(&backend, &chain, &Limits::default()).await?;
    let payload = serde_json::Value::String(text_1k());
    for _ in 0..20 {
        walk(&mut conn, &payload, 1).await?;
    }
    let meter = CpuMeter::start(&format!("sluice/{}", conn.id));
    for _ in 0..n {
        walk(&mut conn, &payload, 1).await?;
    }
    let used = meter.used();
    let memory = sandbox_memory(&format!("sluice/{}", conn.id));
    conn.close().await;
    Ok(WasmCost {
        cpu: used / n,
        memory,
    })
}

/// What a bench walk tells its hooks of a run: nothing but the moment.
pub(crate) fn no_run() -> sluice_engine::RunContext {
    sluice_engine::RunContext {
        context: serde_json::json!({}),
        moment: sluice_engine::Moment::now(),
    }
}

/// One walk of an open cell of `hooks` hooks; an error unless every hook answered.
async fn walk(
    conn: &mut SupervisorConn,
    payload: &serde_json::Value,
    hooks: usize,
) -> anyhow::Result<()> {
    let r = conn
        .walk(
            0,
            payload,
            &vec![serde_json::Value::Null; hooks],
            &no_run(),
            Duration::from_secs(5),
            &sluice_engine::NoHostCalls,
        )
        .await;
    anyhow::ensure!(
        r.failure.is_none() && r.hooks.len() == hooks && r.hooks.iter().all(|h| h.error.is_none()),
        "a walk failed: {r:?}"
    );
    Ok(())
}

/// A local backend on `platform` whose state lives in a temporary directory (kept with it).
async fn local_backend(platform: &str) -> anyhow::Result<(tempfile::TempDir, LocalBackend)> {
    let state = tempfile::Builder::new()
        .prefix("sluice-cells")
        .tempdir_in("/tmp")?;
    let mut cfg = LocalConfig::new(state.path());
    cfg.platform = platform.into();
    let backend = LocalBackend::new(cfg).await?;
    Ok((state, backend))
}

/// A sandbox of `backend` serving `chain`, its first cell open.
async fn open_sandbox(
    backend: &LocalBackend,
    chain: &Arc<sluice_engine::Chain>,
    limits: &Limits,
) -> anyhow::Result<SupervisorConn> {
    let mut conn = SupervisorConn::new(backend.start(&chain.sandbox).await?, limits.max_line());
    conn.wait_ready(Duration::from_secs(30)).await?;
    conn.prepare(chain, &limits.wire(), Duration::from_secs(30))
        .await?;
    Ok(conn)
}

/// Host CPU per hook of the fork cell (`fork_cell.py`, a namespaced fork of a warm Python per hook)
/// inside a runsc sandbox on `platform`, steady state over `n` cells.
async fn fork_cell_cpu(platform: &str, n: u32) -> anyhow::Result<Duration> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let dir = tempfile::Builder::new()
        .prefix("sluice-forkcell")
        .tempdir_in("/tmp")?;
    let rootfs = dir.path().join("rootfs");
    for d in [
        "usr", "lib", "lib64", "bin", "etc", "tmp", "proc", "dev", "bench",
    ] {
        std::fs::create_dir_all(rootfs.join(d))?;
    }
    std::fs::write(
        dir.path().join("fork_cell.py"),
        include_str!("fork_cell.py"),
    )?;
    let id = format!("sluice-forkcell-{}", std::process::id());
    let bind = |p: &str| serde_json::json!({"destination": p, "type": "bind", "source": p, "options": ["rbind", "ro"]});
    let config = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 65534, "gid": 65534},
            "args": ["/usr/bin/python3", "-I", "-S", "/bench/fork_cell.py", n.to_string()],
            "env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"],
            "cwd": "/tmp",
            "capabilities": {"bounding": [], "effective": [], "permitted": [], "inheritable": [], "ambient": []},
            "noNewPrivileges": true
        },
        "root": {"path": rootfs, "readonly": true},
        "hostname": "sandbox",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777", "size=16777216"]},
            bind("/usr"), bind("/lib"), bind("/lib64"), bind("/bin"), bind("/etc"),
            {"destination": "/bench", "type": "bind", "source": dir.path(), "options": ["rbind", "ro"]}
        ],
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
            "cgroupsPath": format!("/sluice-bench/{id}")
        }
    });
    std::fs::write(dir.path().join("config.json"), config.to_string())?;
    let root = dir.path().join("runsc-root");
    std::fs::create_dir_all(&root)?;
    let mut child = tokio::process::Command::new("runsc")
        .arg("--root")
        .arg(&root)
        .args([
            "--platform",
            platform,
            "--network",
            "none",
            "run",
            "--bundle",
        ])
        .arg(dir.path())
        .arg(&id)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdin = child.stdin.take().expect("piped");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("piped")).lines();
    let expect = |line: Option<String>, want: &str| match line {
        Some(l) if l == want => Ok(()),
        other => Err(anyhow::anyhow!(
            "the fork-cell baseline said {other:?}, expected {want}"
        )),
    };
    expect(
        tokio::time::timeout(Duration::from_secs(60), lines.next_line()).await??,
        "warm",
    )?;
    let meter = CpuMeter::start(&format!("sluice-bench/{id}"));
    stdin.write_all(b"go\n").await?;
    expect(
        tokio::time::timeout(Duration::from_secs(600), lines.next_line()).await??,
        "done",
    )?;
    let used = meter.used();
    drop(stdin);
    let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
    let _ = tokio::process::Command::new("runsc")
        .arg("--root")
        .arg(&root)
        .args(["delete", "--force", &id])
        .status()
        .await;
    // runsc removes the cgroups it limited and leaves its empty directory in the others.
    if let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") {
        for h in hierarchies.flatten() {
            let _ = std::fs::remove_dir(h.path().join("sluice-bench").join(&id));
            let _ = std::fs::remove_dir(h.path().join("sluice-bench"));
        }
    }
    Ok(used / n)
}

/// `CPU per hook`: the WebAssembly cell beside the fork cell it replaced, both under ptrace.
pub(crate) async fn cpu_per_hook(table: &mut Table) -> anyhow::Result<()> {
    let cost = wasm_cell_cost("ptrace", 300).await?;
    let wasm = cost.cpu;
    let fork = fork_cell_cpu("ptrace", 100).await?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    table.push(
        Row::value(
            "CPU per hook (ms), WebAssembly cell (ptrace)",
            format!("{:.1}", ms(wasm)),
        )
        .target("≤ 1/5 of the fork cell (gate ≤ 1/3)"),
    );
    table.push(Row::value(
        "CPU per hook (ms), fork cell (ptrace)",
        format!("{:.1}", ms(fork)),
    ));
    table.push(Row::value(
        "CPU per hook, fork cell / WebAssembly cell (ptrace)",
        format!("{:.1}×", ms(fork) / ms(wasm).max(0.001)),
    ));
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    table.push(Row::value(
        "Memory per sandbox (MiB), a cell open, after 320 hooks (ptrace)",
        match cost.memory {
            Some((now, peak)) => format!(
                "{:.0} (peak {:.0}; gVisor, supervisor, runtime, resident instance slots)",
                mib(now),
                mib(peak)
            ),
            None => "n/a (no memory cgroup readable)".into(),
        },
    ));
    Ok(())
}
