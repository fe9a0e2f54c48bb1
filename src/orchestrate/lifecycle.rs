//! The session's changes of state: capture (open to captured; a failed
//! capture releases what it made and leaves the session open), releasing
//! one callable while the others keep replaying, reset (to reset) and
//! drop. Whatever fails while the session releases its resources is
//! counted in its stats and sent to its log.

use super::capture;
use super::context::Inputs;
use super::released::{released_error, CallableMemory};
use super::session::{Session, State};
use super::spec::{LogLevel, MemCounters};
use crate::backend::teardown;
use crate::core::lease::{self, Leases};
use crate::error::{Error, Result};

impl Session {
    /// Warmup and capture of every registered callable. On failure,
    /// everything the attempt made is released and the session stays open.
    pub fn capture(&mut self) -> Result<()> {
        self.open("capture")?;
        if self.callables.is_empty() {
            return Err(Error::state(
                "no callables are registered: add at least one before capture",
            ));
        }
        let _ctx = self.backend.bind()?;
        let inputs = Inputs {
            backend: &self.backend,
            pool: &self.pool,
            opts: &self.opts,
            callables: &self.callables,
            steps: &self.steps,
            counters: &self.counters,
        };
        // A failed capture releases what it made: errors on the way are
        // this session's teardown errors.
        let (captured, errors) =
            teardown::collect(|| capture::capture(&inputs, lease::next_epoch()));
        self.note_teardown(errors);
        let (captured, leases) = captured?;
        let (n, st, sc) = (
            captured.graph_counts().0,
            captured.resources.statics_bytes(),
            captured.resources.arena_bytes(),
        );
        *self.leases.lock() = leases;
        self.state = State::Captured(Box::new(captured));
        self.join_pool();
        self.log(LogLevel::Info, || {
            format!(
                "captured {n} graphs for {} callables: {st} bytes of static buffers, {sc} bytes of scratch",
                self.callables.len()
            )
        });
        Ok(())
    }

    /// Joins the pool with the passes of the callables not released, in
    /// capture order: their positions in that order become those the
    /// pool's order checks (a released callable's passes never replay, so
    /// they leave the iteration).
    fn join_pool(&mut self) {
        let State::Captured(cap) = &mut self.state else {
            return;
        };
        let mut passes = Vec::with_capacity(cap.order.len());
        for p in &cap.order {
            let inst = &cap.instances[p.instance];
            if cap.released.get(inst.callable).copied().unwrap_or(false) {
                continue;
            }
            passes.push(format!(
                "the {} of callable '{}' (microbatch {})",
                p.kind, self.callables[inst.callable].name, inst.microbatch
            ));
        }
        let mut pos = 0;
        for i in 0..cap.order.len() {
            let p = cap.order[i];
            let inst = &mut cap.instances[p.instance];
            if !cap.released.get(inst.callable).copied().unwrap_or(false) {
                inst.position[p.kind.index()] = Some(pos);
                pos += 1;
            }
        }
        self.pool.leave(self.key);
        self.pool.join(self.key, &self.opts.name, passes);
    }

    /// Releases one callable of the captured session while the others
    /// keep replaying (`released`): waits for the device, destroys every
    /// graph of its instances and of every step that includes it, frees
    /// its clone blocks kept for reuse, its own static memory, and the
    /// shared static memory once no captured callable uses it. Refused,
    /// changing nothing, while a strict lease on one of its aliases is held.
    /// Releasing a released callable again does nothing.
    pub fn release_callable(&mut self, callable: u32) -> Result<()> {
        self.captured()?;
        let c = callable as usize;
        let name = match self.callables.get(c) {
            Some(spec) => spec.name.clone(),
            None => {
                return Err(Error::invalid(format!(
                    "callable {callable} does not exist (the session has {})",
                    self.callables.len()
                )))
            }
        };
        let State::Captured(cap) = &mut self.state else {
            return Err(Error::Internal("state changed".into()));
        };
        if cap.is_released(c) {
            return Ok(());
        }
        if self.opts.strict_leases {
            if let Some((slot, token)) = self.leases.lock().held_in(&cap.lease_slots(c)) {
                return Err(Error::AliasHeld(format!(
                    "callable '{name}' cannot be released: {slot}, an alias it handed out, is still held \
                     (lease 0x{token:x}); release that lease first (graphed_lease_release). Nothing was \
                     released"
                )));
            }
        }
        let _ctx = self.backend.bind()?;
        // Its graphs may still run on the caller's streams.
        self.backend.synchronize_all()?;
        let ((), errors) = teardown::collect(|| cap.release(c));
        self.note_teardown(errors);
        self.join_pool();
        self.log(LogLevel::Info, || {
            format!(
                "released callable '{name}': its graphs and the static memory only it used are freed"
            )
        });
        Ok(())
    }

    /// What callable `callable` of the captured session holds.
    pub fn callable_memory(&self, callable: u32) -> Result<CallableMemory> {
        let cap = self.captured()?;
        if callable as usize >= self.callables.len() {
            return Err(Error::invalid(format!(
                "callable {callable} does not exist (the session has {})",
                self.callables.len()
            )));
        }
        Ok(cap.callable_memory(callable as usize))
    }

    /// Refuses `what` of callable `callable` once it is released.
    pub(crate) fn check_live(&self, callable: u32, what: &str) -> Result<()> {
        if let State::Captured(cap) = &self.state {
            if cap.is_released(callable as usize) {
                let name = self
                    .callables
                    .get(callable as usize)
                    .map_or("?", |c| &c.name);
                return Err(released_error(name, what));
            }
        }
        Ok(())
    }

    /// Releases every graph and static buffer; later replays fail with
    /// SessionReset. Clones already returned stay valid. Idempotent.
    pub fn reset(&mut self) -> Result<()> {
        let _ctx = self.backend.bind()?;
        self.pool.leave(self.key);
        let ((), errors) = teardown::collect(|| self.state = State::Reset);
        self.note_teardown(errors);
        *self.leases.lock() = Leases::default();
        Ok(())
    }

    /// Counts teardown errors of this session and sends each to its log.
    fn note_teardown(&self, errors: Vec<String>) {
        MemCounters::add(&self.counters.teardown_errors, errors.len());
        for e in errors {
            self.log(LogLevel::Error, || {
                format!("session '{}': {e}", self.opts.name)
            });
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ctx = self.backend.bind();
        self.pool.leave(self.key);
        let ((), errors) = teardown::collect(|| self.state = State::Reset);
        self.note_teardown(errors);
    }
}
