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
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, Linker, ResourceTable, WasmStr};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::blocking::{self, Waits};
use crate::clock::{Clocks, Moment};
use crate::deadline::{Deadline, Timer};
use crate::output::Output;
use crate::prepare::{Preparer, Slot, Slots};
use crate::relay::Relay;

wasmtime::component::bindgen!({
    path: "wit",
    world: "cell",
});

/// Hooks of a cell that have an instance prepared ahead of their call; later hooks of a longer chain
/// are instantiated when they run.
pub(crate) const MAX_PREPARED: usize = 4;
/// Instance slots the pool keeps: the prepared ones, the one running, one being prepared and one
/// being reset.
const POOL_SLOTS: u32 = MAX_PREPARED as u32 + 3;
/// The largest linear memory a prepared instance may keep while it waits (the snapshot is ~15 MiB):
/// a hook whose module code allocates more runs unprepared, so waiting instances cannot hold the
/// sandbox's memory.
const PREPARED_MEMORY_BYTES: usize = 32 << 20;
/// Linear memory kept resident per slot between instances, reset by copying the image back rather
/// than unmapping it: the snapshot's ~15 MiB, whose pages every instance touches and which would
/// otherwise fault in again (tens of microseconds each inside gVisor). What an instance grew beyond
/// it is given back to the system, so idle slots hold no more than the image each.
const KEEP_RESIDENT_BYTES: usize = 16 << 20;
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
    portable_isa(&mut config);
    config
}

/// The CPU features the generated code may use: a fixed set (x86-64-v3: SSE4.2, POPCNT, AVX2, FMA,
/// BMI1/2, LZCNT), not whatever the build machine has. The artefact is made once, by the build, and
/// runs inside gVisor on other machines, whose `cpuid` can differ: gVisor hides AVX-VNNI (and some
/// hosts' AVX-512) from the sandbox, and an artefact compiled where the host had them was refused
/// in every sandbox ("compilation settings of module incompatible with native host").
#[cfg(target_arch = "x86_64")]
fn portable_isa(config: &mut Config) {
    let on = [
        "has_sse3",
        "has_ssse3",
        "has_cmpxchg16b",
        "has_sse41",
        "has_sse42",
        "has_popcnt",
        "has_avx",
        "has_avx2",
        "has_fma",
        "has_bmi1",
        "has_bmi2",
        "has_lzcnt",
    ];
    let off = [
        "has_avx_vnni",
        "has_avx512bitalg",
        "has_avx512dq",
        "has_avx512vl",
        "has_avx512vbmi",
        "has_avx512f",
        "has_avx512vnni",
    ];
    for (flags, value) in [(&on[..], "true"), (&off[..], "false")] {
        for flag in flags {
            // Safety: wasmtime checks every enabled feature against the host when the engine is
            // made (a host without AVX2 is refused with an error, never run into); disabling one
            // is always safe.
            #[allow(unsafe_code)]
            unsafe {
                config.cranelift_flag_set(flag, value);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn portable_isa(_: &mut Config) {}

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
/// arguments; stdout and stderr into its own bounded `Output`; clocks that stand still, see
/// `clock`), its limits, the deadline it is running under, and the relay for host calls.
pub(crate) struct HookState {
    wasi: WasiCtx,
    clocks: Clocks,
    output: Output,
    table: ResourceTable,
    limits: Limits,
    deadline: Option<Deadline>,
    relay: Relay,
    /// What the running call answered (`answer`), and the longest answer it may give.
    answer: Option<Result<String, CallError>>,
    max_answer: usize,
}

impl WasiView for HookState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl HookState {
    /// What the bounded waits (`blocking`) see of the instance.
    fn waits(&mut self) -> Waits<'_> {
        Waits {
            table: &mut self.table,
            deadline: self.deadline.as_ref(),
        }
    }
}

/// The cell's imports (`wit/cell.wit`), defined by hand rather than through the bindings: their
/// strings are read in the instance's memory (`WasmStr`), so that one longer than any it may be is
/// refused before it is copied out.
fn add_imports(linker: &mut Linker<HookState>) -> wasmtime::Result<()> {
    let mut root = linker.root();
    root.func_wrap(
        "host-call",
        |store: wasmtime::StoreContextMut<'_, HookState>, (name, payload): (WasmStr, WasmStr)| {
            let mut relay = store.data().relay.clone();
            let name = name.to_str(&store)?;
            let payload = payload.to_str(&store)?;
            Ok((relay.host_call(&name, &payload),))
        },
    )?;
    root.func_wrap(
        "answer",
        |mut store: wasmtime::StoreContextMut<'_, HookState>, (json,): (WasmStr,)| {
            let max = store.data().max_answer;
            let read = {
                let text = json.to_str(&store)?;
                if text.len() > max {
                    Err(CallError::TooLong(text.len(), max))
                } else {
                    Ok(text.into_owned())
                }
            };
            store.data_mut().answer = Some(read);
            Ok(())
        },
    )?;
    Ok(())
}

/// What makes instances: engine, linked component, deadlines and the instance slots. Shared by the
/// protocol loop and the preparer thread.
pub(crate) struct Core {
    engine: Engine,
    pre: CellPre<HookState>,
    timer: Timer,
    slots: Slots,
    memory_bytes: usize,
}

/// The loaded runtime: instances made on demand, or ahead of their call by the preparer.
pub(crate) struct Runtime {
    core: Arc<Core>,
    preparer: Preparer,
    /// What the clocks of the hooks called from now on read (`None`: running clocks).
    clock: Mutex<Option<Moment>>,
}

/// One hook call: what the instance answered, and the end of what the hook wrote to stdout and
/// stderr (None when it wrote nothing).
pub(crate) struct Called {
    pub(crate) answer: Result<String, CallError>,
    pub(crate) output: Option<String>,
}

/// How one call in an instance ended, when it did not return.
#[derive(Clone, Debug, thiserror::Error)]
pub(crate) enum CallError {
    #[error("ran out of time")]
    Deadline,
    #[error("ran out of memory (the limit is {0} MiB)")]
    Memory(usize),
    #[error("the hook's instance failed: {0}")]
    Trap(String),
    /// The answer was longer than any result that passes the checks: refused before it is copied
    /// out of the instance, so a huge return costs the sandbox nothing.
    #[error(
        "returned {0} bytes of JSON, over the {1} a hook's result may have (outgoing, state, findings and message each within its limit): refused unread"
    )]
    TooLong(usize, usize),
    #[error("the hook's instance gave no answer")]
    NoAnswer,
}

/// A hook an instance can be prepared for: its name, compiled code and the time its module code
/// may take. `key` identifies name and code together.
#[derive(Clone)]
pub(crate) struct HookCode {
    pub(crate) key: [u8; 32],
    pub(crate) name: String,
    pub(crate) code: Arc<Vec<u8>>,
    pub(crate) timeout: Duration,
}

/// A store holding one of the pool's slots. Fields drop in order: the store (and with it the reset of
/// its slot), then the slot is counted free.
pub(crate) struct Instance {
    store: Store<HookState>,
    _slot: Slot,
}

/// A fresh instance with one hook's module code already run in it: its call only runs `execute`.
pub(crate) struct Prepared {
    instance: Instance,
    cell: Cell,
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
        // Waits (sleep, select, any poll) end at the hook's deadline.
        blocking::add_to_linker(&mut linker, HookState::waits).map_err(RuntimeError::Engine)?;
        add_imports(&mut linker).map_err(RuntimeError::Engine)?;
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
        let core = Arc::new(Core {
            timer: Timer::start(engine.clone()),
            engine,
            pre,
            slots: Slots::new(POOL_SLOTS),
            memory_bytes: memory_bytes.min(MAX_MEMORY_BYTES),
        });
        let preparer = Preparer::start(core.clone());
        Ok(Self {
            core,
            preparer,
            clock: Mutex::new(Some(Moment::EPOCH)),
        })
    }

    /// Compiles and loads a hook's code in a fresh instance (its module code runs once, as a check),
    /// within `timeout`. Ok(Ok(code)) is the compiled code; Ok(Err(json)) the runner's refusal.
    pub(crate) fn load_hook(
        &self,
        name: &str,
        code: &str,
        timeout: Duration,
    ) -> Result<Result<Vec<u8>, String>, CallError> {
        let mut instance = self.core.store(Relay::refusing(
            "a hook's module code cannot call host_call",
        ));
        let deadline = self.arm(timeout);
        let loaded = self
            .core
            .run(&mut instance.store, &deadline, |store, cell| {
                cell.call_load(store, name, code)
            });
        deadline.disarm();
        loaded
    }

    /// A deadline `timeout` from now, paused while a host call waits: the one a walk's hooks run
    /// under, until one of them runs out of it.
    pub(crate) fn arm(&self, timeout: Duration) -> Deadline {
        self.core.timer.arm(timeout)
    }

    /// Keeps an instance prepared for each of `hooks` (the open cell's, in walk order) from now on,
    /// and drops those prepared for other hooks. Returns when each is prepared, or could not be, or
    /// `wait` has passed.
    pub(crate) fn prepare(&self, hooks: Vec<HookCode>, wait: Duration) {
        self.preparer.want(hooks);
        self.preparer.wait(wait);
    }

    /// A walk of `hooks` begins: when each has its instance ready, the preparer waits until
    /// `walk_ended`, so the walk has the CPU; otherwise it goes on preparing beside the walk.
    pub(crate) fn walk_begins<'a>(&self, hooks: impl Iterator<Item = &'a [u8; 32]>) {
        self.preparer.walk_begins(hooks);
    }

    /// The clocks of every hook called from now on read `at` (`None`: they run, for the line
    /// tracer of `--trace-lines`).
    pub(crate) fn stand_clocks_at(&self, at: Option<Moment>) {
        *self.clock.lock().unwrap_or_else(|p| p.into_inner()) = at;
    }

    fn clock(&self) -> Option<Moment> {
        *self.clock.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The walk has answered: the preparer resets the used instances and prepares new ones.
    pub(crate) fn walk_ended(&self) {
        self.preparer.walk_ended();
    }

    /// One call of a hook (`key`) under `deadline` (paused while host calls wait): in the instance
    /// prepared for it when there is one, else in a fresh instance where its module code runs
    /// first, under the same deadline. An answer over `max_answer` bytes is refused unread.
    pub(crate) fn call_hook(
        &self,
        hook: &HookCode,
        request: &str,
        relay: Relay,
        deadline: &Deadline,
        max_answer: usize,
    ) -> Called {
        if let Some(mut prepared) = self.preparer.take(&hook.key) {
            let store = &mut prepared.instance.store;
            store.data_mut().relay = relay;
            store.data().clocks.set(self.clock());
            let cell = &prepared.cell;
            let answer = self.core.enter(store, deadline, |store| {
                answer_of(store, cell, request, max_answer)
            });
            let answer = answer.and_then(|a| a);
            let output = store.data().output.text();
            if store.data().limits.peak > PREPARED_MEMORY_BYTES {
                // An instance that grew is reset now, before the walk goes on: a walk of hooks
                // each within its memory limit never holds more than one such instance at once.
                drop(prepared);
            } else {
                // Its slot is reset by the preparer, after this answer has gone out.
                self.preparer.discard(prepared);
            }
            return Called { answer, output };
        }
        let mut instance = self.core.store(relay);
        instance.store.data().clocks.set(self.clock());
        let answer = self
            .core
            .run(&mut instance.store, deadline, |store, cell| {
                cell.call_prepare(&mut *store, &hook.name, &hook.code)?;
                answer_of(store, cell, request, max_answer)
            })
            .and_then(|a| a);
        Called {
            answer,
            output: instance.store.data().output.text(),
        }
    }
}

/// Calls `execute` in an instance (its `call` export) and takes the answer it gave (`answer`),
/// refused before it was copied out of the instance's memory when it was over `max` bytes.
fn answer_of(
    store: &mut Store<HookState>,
    cell: &Cell,
    request: &str,
    max: usize,
) -> wasmtime::Result<Result<String, CallError>> {
    store.data_mut().answer = None;
    store.data_mut().max_answer = max;
    cell.call_call(&mut *store, request)?;
    Ok(store
        .data_mut()
        .answer
        .take()
        .unwrap_or(Err(CallError::NoAnswer)))
}

impl Core {
    /// A new store for one instance, holding one of the pool's slots (waiting for one to be reset
    /// when all are taken).
    fn store(&self, relay: Relay) -> Instance {
        let slot = self.slots.take();
        let limits = Limits {
            memory_bytes: self.memory_bytes,
            refused: false,
            peak: 0,
        };
        let output = Output::default();
        let clocks = Clocks::standing();
        let wasi = WasiCtxBuilder::new()
            .stdout(output.clone())
            .stderr(output.clone())
            .wall_clock(clocks.wall())
            .monotonic_clock(clocks.monotonic())
            .build();
        let mut store = Store::new(
            &self.engine,
            HookState {
                wasi,
                clocks,
                output,
                table: ResourceTable::new(),
                limits,
                deadline: None,
                relay,
                answer: None,
                max_answer: 0,
            },
        );
        store.limiter(|state| &mut state.limits);
        // Every tick of the epoch (some instance's deadline passed) asks each running instance
        // whether its own deadline has.
        store.epoch_deadline_callback(|store| match &store.data().deadline {
            Some(deadline) if deadline.expired() => Err(wasmtime::Trap::Interrupt.into()),
            _ => Ok(wasmtime::UpdateDeadline::Continue(1)),
        });
        Instance { store, _slot: slot }
    }

    /// Instantiates in `store` and runs `f` in the new instance, all under `deadline`.
    fn run<R>(
        &self,
        store: &mut Store<HookState>,
        deadline: &Deadline,
        f: impl FnOnce(&mut Store<HookState>, &Cell) -> wasmtime::Result<R>,
    ) -> Result<R, CallError> {
        self.enter(store, deadline, |store| {
            let cell = self.pre.instantiate(&mut *store)?;
            f(store, &cell)
        })
    }

    /// Runs `f` (guest code) under `deadline` (armed by the caller, paused while host calls wait).
    fn enter<R>(
        &self,
        store: &mut Store<HookState>,
        deadline: &Deadline,
        f: impl FnOnce(&mut Store<HookState>) -> wasmtime::Result<R>,
    ) -> Result<R, CallError> {
        store.data_mut().relay.set_deadline(deadline.clone());
        store.data_mut().deadline = Some(deadline.clone());
        // Set before the deadline is looked at: a deadline that passes after the look ticks the
        // epoch after this, and stops the code; one that passed before is never entered.
        store.set_epoch_deadline(1);
        if deadline.expired() {
            store.data_mut().deadline = None;
            return Err(CallError::Deadline);
        }
        let result = f(&mut *store);
        let expired = deadline.expired();
        store.data_mut().deadline = None;
        result.map_err(|e| {
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
        })
    }

    /// A fresh instance with `hook`'s module code run in it, or None when that failed in a way a
    /// call would not repeat the same (time, memory, a trap) or left the instance larger than a
    /// prepared one may stay: such a hook is run unprepared.
    pub(crate) fn prepare(&self, hook: &HookCode) -> Option<Prepared> {
        let mut instance = self.store(Relay::refusing(
            "a hook's module code cannot call host_call",
        ));
        let deadline = self.timer.arm(hook.timeout);
        let prepared = self.enter(&mut instance.store, &deadline, |store| {
            let cell = self.pre.instantiate(&mut *store)?;
            cell.call_prepare(&mut *store, &hook.name, &hook.code)?;
            Ok(cell)
        });
        deadline.disarm();
        let cell = prepared.ok()?;
        (instance.store.data().limits.peak <= PREPARED_MEMORY_BYTES)
            .then_some(Prepared { instance, cell })
    }
}

/// Per-store limits that remember a refusal: a refused `memory.grow` usually surfaces inside Python
/// as `MemoryError` (the runner reports it), but where CPython cannot recover it aborts, and the trap
/// is then reported as the memory limit it is. `peak` is the largest linear memory asked for.
pub(crate) struct Limits {
    memory_bytes: usize,
    refused: bool,
    peak: usize,
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
        if allow {
            self.peak = self.peak.max(desired);
        }
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

const SELF_CHECK_HOOK: &str = "import os\ndef execute(context, settings):\n    return {'action': 'detect', 'findings': {'n': len(context['outgoing'])}}\n";

/// Why the self-check (one hook loaded and called before the sandbox says `ready`) failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SelfCheckError {
    #[error("the self-check hook did not load: {0}")]
    Refused(String),
    #[error("the self-check hook did not load: {0}")]
    Load(CallError),
    #[error("the self-check hook failed: {0}")]
    Call(CallError),
    #[error("the self-check hook answered {0}")]
    Answer(String),
}

impl Runtime {
    /// One hook loaded and called in real instances: the runtime works here.
    pub(crate) fn self_check(&self) -> Result<(), SelfCheckError> {
        let timeout = Duration::from_secs(10);
        let code = self
            .load_hook("self-check", SELF_CHECK_HOOK, timeout)
            .map_err(SelfCheckError::Load)?
            .map_err(SelfCheckError::Refused)?;
        let hook = HookCode {
            key: [0; 32],
            name: "self-check".into(),
            code: Arc::new(code),
            timeout,
        };
        let deadline = self.arm(timeout);
        let answer = self
            .call_hook(
                &hook,
                r#"{"outgoing": "abc", "state": null, "context": {}, "settings": {}}"#,
                Relay::refusing("no host calls in the self-check"),
                &deadline,
                1 << 10,
            )
            .answer;
        deadline.disarm();
        let answer = answer.map_err(SelfCheckError::Call)?;
        if answer != r#"{"value": {"action": "detect", "findings": {"n": 3}}}"# {
            return Err(SelfCheckError::Answer(answer));
        }
        Ok(())
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// What a gVisor sandbox's `cpuid` shows of a host that has AVX-VNNI and AVX-512: neither (the
    /// rest as the host has it).
    fn gvisor_cpu(feature: &str) -> Option<bool> {
        if feature == "avxvnni" || feature.starts_with("avx512") {
            return Some(false);
        }
        Some(match feature {
            "sse3" => std::is_x86_feature_detected!("sse3"),
            "ssse3" => std::is_x86_feature_detected!("ssse3"),
            "cmpxchg16b" => std::is_x86_feature_detected!("cmpxchg16b"),
            "sse4.1" => std::is_x86_feature_detected!("sse4.1"),
            "sse4.2" => std::is_x86_feature_detected!("sse4.2"),
            "popcnt" => std::is_x86_feature_detected!("popcnt"),
            "avx" => std::is_x86_feature_detected!("avx"),
            "avx2" => std::is_x86_feature_detected!("avx2"),
            "fma" => std::is_x86_feature_detected!("fma"),
            "bmi1" => std::is_x86_feature_detected!("bmi1"),
            "bmi2" => std::is_x86_feature_detected!("bmi2"),
            "lzcnt" => std::is_x86_feature_detected!("lzcnt"),
            _ => return None,
        })
    }

    #[test]
    fn an_artefact_built_on_the_host_loads_where_gvisor_hides_cpu_features() {
        let built = Engine::new(&engine_config()).expect("engine");
        let empty_module = b"\0asm\x01\0\0\0";
        let artefact = wasmtime::Module::new(&built, empty_module)
            .expect("module")
            .serialize()
            .expect("serialised");
        let mut config = engine_config();
        // Safety: the features it reports absent are not used; the others are the host's own.
        #[allow(unsafe_code)]
        unsafe {
            config.detect_host_feature(gvisor_cpu);
        }
        let sandbox = Engine::new(&config).expect("engine in the sandbox");
        #[allow(unsafe_code)]
        let loaded = unsafe { wasmtime::Module::deserialize(&sandbox, &artefact) };
        assert!(loaded.is_ok(), "{:?}", loaded.err());
    }
}
