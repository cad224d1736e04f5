//! The WebAssembly side of a cell: one wasmtime engine per supervisor, the pre-initialised CPython
//! component (`guest/runner.py` made into a component at build time), and a fresh instance of it for
//! every hook call.
//!
//! Why an instance per call is cheap: the pooling allocator keeps a few instance slots whose linear
//! memory starts from the component's copy-on-write image and stays resident between instances
//! (`linear_memory_keep_resident`): inside gVisor every page fault costs tens of microseconds, so
//! resetting resident memory beats mapping it afresh. Why it is fresh: nothing of one instance
//! survives into the next (the slot's memory is reset to the image, tables and globals are new).

use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::output::Output;
use crate::relay::Relay;

wasmtime::component::bindgen!({
    path: "wit",
    world: "cell",
});

/// Instance slots the pool keeps: a supervisor runs one hook at a time, plus one spare so the next
/// instance never waits for the last one's slot to be reset.
const POOL_SLOTS: u32 = 2;
/// Linear memory kept resident per slot (reset by copying, not by unmapping) between instances.
const KEEP_RESIDENT_BYTES: usize = 96 << 20;
/// The largest linear memory an instance may ever have; a hook's own limit is lower.
const MAX_MEMORY_BYTES: usize = 1 << 30;

#[derive(Debug, thiserror::Error)]
pub(crate) enum RuntimeError {
    #[error("cannot read the cell runtime {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "the cell runtime {path} has SHA-256 {found}, expected {expected}: refusing to load it"
    )]
    Digest {
        path: String,
        found: String,
        expected: String,
    },
    #[error("the cell runtime {path} cannot be loaded: {source}")]
    Load {
        path: String,
        source: wasmtime::Error,
    },
    #[error("cannot compile the cell component: {0}")]
    Compile(wasmtime::Error),
    #[error("cannot set up the WebAssembly engine: {0}")]
    Engine(wasmtime::Error),
}

/// The engine settings. Compiling (`compile`) and loading must use the same ones: wasmtime refuses
/// a precompiled artefact made under settings that change the generated code.
fn engine_config() -> Config {
    let mut config = Config::new();
    config.wasm_component_model(true);
    // Deadlines: the generated code checks an epoch counter, which a timer thread bumps when a hook
    // runs past its time.
    config.epoch_interruption(true);
    config.memory_init_cow(true);
    let mut pool = PoolingAllocationConfig::new();
    pool.total_component_instances(POOL_SLOTS)
        .total_core_instances(POOL_SLOTS * 32)
        .max_core_instances_per_component(32)
        .total_memories(POOL_SLOTS * 2)
        .max_memories_per_component(2)
        .total_tables(POOL_SLOTS * 16)
        .max_tables_per_component(16)
        .max_memory_size(MAX_MEMORY_BYTES)
        .max_component_instance_size(1 << 20)
        .max_core_instance_size(1 << 20)
        .table_elements(1 << 16)
        .total_stacks(POOL_SLOTS)
        .linear_memory_keep_resident(KEEP_RESIDENT_BYTES)
        .table_keep_resident(1 << 20);
    config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    config
}

/// Compiles the component (`guest/runner.py` as componentize-py made it) to the native artefact the
/// supervisor loads. Done by the build, never inside a sandbox.
pub(crate) fn compile(component: &[u8]) -> Result<Vec<u8>, RuntimeError> {
    let engine = Engine::new(&engine_config()).map_err(RuntimeError::Engine)?;
    engine
        .precompile_component(component)
        .map_err(RuntimeError::Compile)
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// What one instance's store holds: its WASI context (no preopened directory, no environment, no
/// arguments; stdout and stderr into its own bounded `Output`), its limits, and the relay for host
/// calls.
pub(crate) struct HookState {
    wasi: WasiCtx,
    output: Output,
    table: ResourceTable,
    limits: Limits,
    relay: Relay,
}

impl WasiView for HookState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl CellImports for HookState {
    fn host_call(&mut self, name: String, payload_json: String) -> Result<String, String> {
        self.relay.host_call(name, payload_json)
    }
}

/// The loaded runtime: engine, linked component, and the deadline timer.
pub(crate) struct Runtime {
    engine: Engine,
    pre: CellPre<HookState>,
    timer: Timer,
    memory_bytes: usize,
}

/// One hook call: what the instance answered, the time left of the budget it was given, and the
/// end of what the hook wrote to stdout and stderr (None when it wrote nothing).
pub(crate) struct Called {
    pub(crate) answer: Result<String, CallError>,
    pub(crate) left: Duration,
    pub(crate) output: Option<String>,
}

/// How one call in an instance ended, when it did not return.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    #[error("ran out of time")]
    Deadline,
    #[error("ran out of memory (the limit is {0} MiB)")]
    Memory(usize),
    #[error("the hook's instance failed: {0}")]
    Trap(String),
}

impl Runtime {
    /// Loads the precompiled artefact at `path` after checking its digest: it is native code,
    /// loaded as such, so nothing but the exact file the build made may be loaded.
    pub(crate) fn load(
        path: &Path,
        expected_sha256: &str,
        memory_bytes: usize,
    ) -> Result<Self, RuntimeError> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| RuntimeError::Read {
            path: shown.clone(),
            source,
        })?;
        let found = sha256_hex(&bytes);
        if !found.eq_ignore_ascii_case(expected_sha256) {
            return Err(RuntimeError::Digest {
                path: shown,
                found,
                expected: expected_sha256.to_string(),
            });
        }
        let engine = Engine::new(&engine_config()).map_err(RuntimeError::Engine)?;
        // SAFETY: `deserialize` trusts the bytes to be an artefact wasmtime made; they are, because
        // their SHA-256 is the one the build recorded (checked above), and wasmtime itself checks
        // that they were made by this version with these settings.
        #[allow(unsafe_code)]
        let component = unsafe { Component::deserialize(&engine, &bytes) }.map_err(|source| {
            RuntimeError::Load {
                path: shown.clone(),
                source,
            }
        })?;
        let mut linker = Linker::<HookState>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(RuntimeError::Engine)?;
        Cell::add_to_linker::<_, HasSelf<_>>(&mut linker, |state| state)
            .map_err(RuntimeError::Engine)?;
        let pre = linker
            .instantiate_pre(&component)
            .map_err(|source| RuntimeError::Load {
                path: shown.clone(),
                source,
            })?;
        let pre = CellPre::new(pre).map_err(|source| RuntimeError::Load {
            path: shown,
            source,
        })?;
        let timer = Timer::start(engine.clone());
        Ok(Self {
            engine,
            pre,
            timer,
            memory_bytes: memory_bytes.min(MAX_MEMORY_BYTES),
        })
    }

    fn store(&self, relay: Relay) -> Store<HookState> {
        let limits = Limits {
            memory_bytes: self.memory_bytes,
            refused: false,
        };
        let output = Output::default();
        let wasi = WasiCtxBuilder::new()
            .stdout(output.clone())
            .stderr(output.clone())
            .build();
        let mut store = Store::new(
            &self.engine,
            HookState {
                wasi,
                output,
                table: ResourceTable::new(),
                limits,
                relay,
            },
        );
        store.limiter(|state| &mut state.limits);
        store.set_epoch_deadline(1);
        store
    }

    /// Compiles and loads a hook's code in a fresh instance (its module code runs once, as a check),
    /// within `timeout`. Ok(Ok(code)) is the compiled code; Ok(Err(json)) the runner's refusal.
    pub(crate) fn load_hook(
        &self,
        name: &str,
        code: &str,
        timeout: Duration,
    ) -> Result<Result<Vec<u8>, String>, CallError> {
        let mut store = self.store(Relay::refusing(
            "a hook's module code cannot call host_call",
        ));
        self.run(&mut store, timeout, |store, cell| {
            cell.call_load(store, name, code)
        })
        .0
    }

    /// One call of a hook in a fresh instance, within `timeout` (host-call time excluded): what it
    /// answered, the time left and what it wrote.
    pub(crate) fn call_hook(
        &self,
        name: &str,
        code: &[u8],
        request: &str,
        relay: Relay,
        timeout: Duration,
    ) -> Called {
        let mut store = self.store(relay);
        let (answer, left) = self.run(&mut store, timeout, |store, cell| {
            cell.call_call(store, name, code, request)
        });
        Called {
            answer,
            left,
            output: store.data().output.text(),
        }
    }

    /// Runs `f` in a fresh instance within `timeout`; what it returned and the time left of
    /// `timeout` (host-call time not counted).
    fn run<R>(
        &self,
        store: &mut Store<HookState>,
        timeout: Duration,
        f: impl FnOnce(&mut Store<HookState>, &Cell) -> wasmtime::Result<R>,
    ) -> (Result<R, CallError>, Duration) {
        let deadline = self.timer.arm(timeout);
        store.data_mut().relay.set_deadline(deadline.clone());
        let result = self
            .pre
            .instantiate(&mut *store)
            .and_then(|cell| f(store, &cell));
        let (expired, left) = deadline.disarm();
        let result = result.map_err(|e| {
            if expired
                || matches!(
                    e.downcast_ref::<wasmtime::Trap>(),
                    Some(wasmtime::Trap::Interrupt)
                )
            {
                CallError::Deadline
            } else if store.data().limits.refused {
                CallError::Memory(self.memory_bytes >> 20)
            } else {
                CallError::Trap(trap_text(&e))
            }
        });
        (result, left)
    }
}

/// Per-store limits that remember a refusal: a refused `memory.grow` usually surfaces inside Python
/// as `MemoryError` (the runner reports it), but where CPython cannot recover it aborts, and the trap
/// is then reported as the memory limit it is.
pub(crate) struct Limits {
    memory_bytes: usize,
    refused: bool,
}

impl wasmtime::ResourceLimiter for Limits {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let allow = desired <= self.memory_bytes;
        self.refused |= !allow;
        Ok(allow)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 1 << 16)
    }
}

fn trap_text(e: &wasmtime::Error) -> String {
    match e.downcast_ref::<wasmtime::Trap>() {
        Some(wasmtime::Trap::StackOverflow) => {
            "the hook recursed too deeply (stack overflow)".to_string()
        }
        Some(trap) => format!("{trap}"),
        None => {
            let text = format!("{e:#}");
            text.lines().next().unwrap_or("unknown failure").to_string()
        }
    }
}

/// Bumps the engine's epoch when an armed deadline passes, so the running instance traps. Idle
/// (no hook running) it sleeps on its channel: a prepared sandbox costs no CPU.
struct Timer {
    arm: Mutex<mpsc::Sender<Arc<DeadlineState>>>,
}

/// One armed deadline. Host calls pause it (their time is not the hook's), `disarm` ends it.
#[derive(Debug)]
pub(crate) struct DeadlineState {
    inner: Mutex<DeadlineInner>,
    changed: std::sync::Condvar,
}

#[derive(Debug)]
struct DeadlineInner {
    /// When the hook's time runs out, or None while paused.
    at: Option<Instant>,
    /// Time left, kept while paused.
    left: Duration,
    done: bool,
    expired: bool,
}

#[derive(Clone, Debug)]
pub(crate) struct Deadline(Arc<DeadlineState>);

impl Deadline {
    /// Stops the clock (a host call started); `resume` starts it again with what was left.
    pub(crate) fn pause(&self) {
        let mut inner = self.0.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = inner.at.take() {
            inner.left = at.saturating_duration_since(Instant::now());
        }
        self.0.changed.notify_all();
    }

    pub(crate) fn resume(&self) {
        let mut inner = self.0.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.at.is_none() && !inner.done {
            inner.at = Some(Instant::now() + inner.left);
        }
        self.0.changed.notify_all();
    }

    /// Ends this deadline: whether it had expired, and the time that was left.
    fn disarm(&self) -> (bool, Duration) {
        let mut inner = self.0.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.done = true;
        if let Some(at) = inner.at.take() {
            inner.left = at.saturating_duration_since(Instant::now());
        }
        self.0.changed.notify_all();
        (
            inner.expired,
            if inner.expired {
                Duration::ZERO
            } else {
                inner.left
            },
        )
    }
}

impl Timer {
    fn start(engine: Engine) -> Self {
        let (tx, rx) = mpsc::channel::<Arc<DeadlineState>>();
        thread::Builder::new()
            .name("deadline".into())
            .spawn(move || {
                while let Ok(deadline) = rx.recv() {
                    watch(&engine, &deadline);
                }
            })
            .expect("spawning the deadline thread");
        Self {
            arm: Mutex::new(tx),
        }
    }

    fn arm(&self, timeout: Duration) -> Deadline {
        let state = Arc::new(DeadlineState {
            inner: Mutex::new(DeadlineInner {
                at: Some(Instant::now() + timeout),
                left: timeout,
                done: false,
                expired: false,
            }),
            changed: std::sync::Condvar::new(),
        });
        // The thread only ends with the process; a send cannot fail before that.
        let _ = self
            .arm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(state.clone());
        Deadline(state)
    }
}

/// Waits for one deadline to pass or be disarmed; on passing, interrupts the running instance.
fn watch(engine: &Engine, deadline: &DeadlineState) {
    let mut inner = deadline.inner.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if inner.done {
            return;
        }
        match inner.at {
            None => {
                inner = deadline
                    .changed
                    .wait(inner)
                    .unwrap_or_else(|e| e.into_inner())
            }
            Some(at) => {
                let now = Instant::now();
                if now >= at {
                    inner.expired = true;
                    inner.done = true;
                    engine.increment_epoch();
                    return;
                }
                inner = deadline
                    .changed
                    .wait_timeout(inner, at - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
    }
}

const SELF_CHECK_HOOK: &str = "import os\ndef execute(context, settings):\n    return {'action': 'detect', 'findings': {'n': len(context['outgoing'])}}\n";

impl Runtime {
    /// One hook loaded and called in real instances: the runtime works here.
    pub(crate) fn self_check(&self) -> Result<(), String> {
        let timeout = Duration::from_secs(10);
        let code = match self.load_hook("self-check", SELF_CHECK_HOOK, timeout) {
            Ok(Ok(code)) => code,
            Ok(Err(refusal)) => return Err(format!("the self-check hook did not load: {refusal}")),
            Err(e) => return Err(format!("the self-check hook did not load: {e}")),
        };
        let answer = self
            .call_hook(
                "self-check",
                &code,
                r#"{"outgoing": "abc", "state": null, "context": {}, "settings": {}}"#,
                Relay::refusing("no host calls in the self-check"),
                timeout,
            )
            .answer
            .map_err(|e| format!("the self-check hook failed: {e}"))?;
        if answer != r#"{"value": {"action": "detect", "findings": {"n": 3}}}"# {
            return Err(format!("the self-check hook answered {answer}"));
        }
        Ok(())
    }
}
