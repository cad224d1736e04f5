//! The calls a cell can make that block (`time.sleep`, `select`, any wait on a WASI pollable) end at
//! the hook's deadline. Epoch interruption stops a hook only while its code runs; a hook waiting in
//! the host runs no code, so without this a `time.sleep(60)` would outlive its deadline by a minute.
//! Every wait of a WASI program goes through `wasi:io/poll` (`poll`, `pollable.block`): both are
//! replaced here by the same waits bounded by the deadline, which trap as the deadline's interrupt
//! when it passes first.

use std::time::Duration;

use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi::p2::DynPollable;
use wasmtime_wasi::p2::bindings::io::poll as async_poll;
use wasmtime_wasi::p2::bindings::sync::io::poll as sync_poll;
use wasmtime_wasi::runtime::in_tokio;

use crate::deadline::Deadline;

/// What a wait needs: the instance's resources and the deadline it runs under (None: nothing runs
/// under a deadline, so the wait is not bounded here).
pub(crate) struct Waits<'a> {
    pub(crate) table: &'a mut ResourceTable,
    pub(crate) deadline: Option<&'a Deadline>,
}

struct HasWaits;

impl HasData for HasWaits {
    type Data<'a> = Waits<'a>;
}

/// Replaces `wasi:io/poll` in `linker` (after `wasmtime_wasi::p2::add_to_linker_sync`) by the
/// bounded waits; `waits` gives them their instance's state.
pub(crate) fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    waits: fn(&mut T) -> Waits<'_>,
) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let added = sync_poll::add_to_linker::<T, HasWaits>(linker, waits);
    linker.allow_shadowing(false);
    added
}

impl Waits<'_> {
    /// Runs `wait` until it ends or the deadline passes, whichever is first.
    fn bounded<R>(
        deadline: Option<&Deadline>,
        wait: impl Future<Output = wasmtime::Result<R>>,
    ) -> wasmtime::Result<R> {
        let Some(deadline) = deadline else {
            return in_tokio(wait);
        };
        let Some(left) = deadline.left() else {
            return Err(wasmtime::Trap::Interrupt.into());
        };
        // A little past the deadline itself, so that the deadline has passed (the timer marks it
        // expired) when the wait ends: the call is then reported as out of time.
        let left = left + Duration::from_millis(1);
        in_tokio(async {
            match tokio::time::timeout(left, wait).await {
                Ok(done) => done,
                Err(_) => Err(wasmtime::Trap::Interrupt.into()),
            }
        })
    }
}

impl sync_poll::Host for Waits<'_> {
    fn poll(&mut self, pollables: Vec<Resource<DynPollable>>) -> wasmtime::Result<Vec<u32>> {
        Self::bounded(
            self.deadline,
            async_poll::Host::poll(&mut *self.table, pollables),
        )
    }
}

impl sync_poll::HostPollable for Waits<'_> {
    fn ready(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<bool> {
        // Never waits: it only looks.
        sync_poll::HostPollable::ready(&mut *self.table, pollable)
    }

    fn block(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<()> {
        Self::bounded(
            self.deadline,
            async_poll::HostPollable::block(&mut *self.table, pollable),
        )
    }

    fn drop(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<()> {
        sync_poll::HostPollable::drop(&mut *self.table, pollable)
    }
}
