//! The session: callables registered, then captured once into graphs that
//! share one pool, then replayed; reset releases everything captured. The
//! captured state (`Captured`) owns every device resource of the capture and
//! releases them all when dropped, so a failed capture leaves nothing behind
//! and the session can be captured again.

use crate::backend::{
    AccItem, Backend, BackendKind, DevPtr, EventRef, Graph, MemCounters, StreamRef,
};
use crate::core::layout::{BufferDesc, CloneLayout, Role};
use crate::core::lease::Leases;
use crate::core::plan::{Lifetime, Plan};
use crate::core::policy::{Destinations, GradPolicy, KNOWN_PARAM_FLAGS};
use crate::error::{Error, Result};
use std::cell::Cell;
use std::sync::Arc;

use super::pool::Pool;
use super::returned::Returned;
use super::spec::{CallableSpec, LogLevel, SessionOptions, TensorSpec};

/// One captured (callable, microbatch) pair: its static buffers, its frozen
/// policies, its graphs and its lease bookkeeping.
pub(crate) struct Instance {
    pub callable: usize,
    pub microbatch: u32,
    pub inputs: Vec<DevPtr>,
    pub outputs: Vec<DevPtr>,
    pub grad_outputs: Vec<DevPtr>,
    pub grad_inputs: Vec<DevPtr>,
    pub params: Vec<DevPtr>,
    pub param_grads: Vec<DevPtr>,
    pub param_bytes: Vec<usize>,
    /// Frozen grad policy of each parameter (None: no grad).
    pub policies: Vec<Option<GradPolicy>>,
    /// The COPY_INTO and ACCUMULATE_INTO parameters, derived from `policies`.
    pub destinations: Destinations,
    pub slab_base: DevPtr,
    /// Where the CLONE grads of a replay go in their block.
    pub clone: CloneLayout,
    /// The external buffers each pass provides at capture.
    pub external: ExternalBuffers,
    pub fwd: Option<Box<dyn Graph>>,
    pub bwd: Option<Box<dyn Graph>>,
    pub wgrad: Option<Box<dyn Graph>>,
    /// Lease slots each replay would overwrite (strict leases only).
    pub check_fwd: Vec<usize>,
    pub check_bwd: Vec<usize>,
    pub check_wgrad: Vec<usize>,
    /// Lease slot of each output / grad-input / ALIAS param slot.
    pub lease_out: Vec<usize>,
    pub lease_gin: Vec<Option<usize>>,
    pub lease_param: Vec<Option<usize>>,
}

/// (role, index) of the external buffers each pass of an instance provides.
#[derive(Clone, Debug, Default)]
pub(crate) struct ExternalBuffers {
    pub forward: Vec<(Role, usize)>,
    pub backward: Vec<(Role, usize)>,
    pub wgrad: Vec<(Role, usize)>,
}

impl Instance {
    /// Whether parameter grads come from a separate weight-grad replay.
    pub fn has_wgrad(&self) -> bool {
        self.wgrad.is_some()
    }
}

/// Everything a capture made. Dropping it waits for the device, destroys
/// the graphs, frees the static buffers and returns the arena to the pool.
pub(crate) struct Captured {
    pub backend: Arc<dyn Backend>,
    pub pool: Arc<Pool>,
    pub counters: Arc<MemCounters>,
    pub statics: DevPtr,
    pub statics_bytes: usize,
    pub arena: (DevPtr, usize),
    pub side: StreamRef,
    pub ev_in: EventRef,
    pub ev_out: EventRef,
    pub instances: Vec<Instance>,
    /// Instance index by [callable][microbatch].
    pub by_callable: Vec<Vec<usize>>,
    pub leases: Leases,
    pub tapes: Box<[Cell<usize>]>,
    pub graph_count: u32,
    /// The static-buffer plan, with the buffers and lifetimes it placed.
    pub plan: Plan,
    pub buffers: Vec<BufferDesc>,
    pub lifetimes: Vec<Lifetime>,
    pub stage_a: Vec<Returned>,
    pub stage_b: Vec<Returned>,
    pub stage_acc: Vec<AccItem>,
}

impl Captured {
    pub fn empty(
        backend: Arc<dyn Backend>,
        pool: Arc<Pool>,
        counters: Arc<MemCounters>,
    ) -> Captured {
        Captured {
            backend,
            pool,
            counters,
            statics: 0,
            statics_bytes: 0,
            arena: (0, 0),
            side: StreamRef(0),
            ev_in: EventRef(0),
            ev_out: EventRef(0),
            instances: Vec::new(),
            by_callable: Vec::new(),
            leases: Leases::default(),
            tapes: Box::new([]),
            graph_count: 0,
            plan: Plan::default(),
            buffers: Vec::new(),
            lifetimes: Vec::new(),
            stage_a: Vec::new(),
            stage_b: Vec::new(),
            stage_acc: Vec::new(),
        }
    }

    pub fn instance_index(&self, callable: u32, microbatch: u32) -> Result<usize> {
        let per = self.by_callable.get(callable as usize).ok_or_else(|| {
            Error::invalid(format!(
                "callable {callable} does not exist (the session has {} callables)",
                self.by_callable.len()
            ))
        })?;
        per.get(microbatch as usize).copied().ok_or_else(|| {
            Error::invalid(format!(
                "microbatch {microbatch} does not exist for callable {callable} (it was captured for {} microbatch(es))",
                per.len()
            ))
        })
    }
}

impl Drop for Captured {
    fn drop(&mut self) {
        let _ctx = self.backend.bind();
        // Replays may still be running on the caller's streams.
        let _ = self.backend.synchronize_device();
        for inst in &mut self.instances {
            inst.fwd = None;
            inst.bwd = None;
            inst.wgrad = None;
        }
        if self.statics != 0 {
            self.backend.free(self.statics);
            MemCounters::sub(&self.counters.static_bytes, self.statics_bytes);
        }
        if self.arena.0 != 0 {
            self.pool.release(self.arena.0);
            MemCounters::sub(&self.counters.scratch_bytes, self.arena.1);
        }
        for e in [self.ev_in, self.ev_out] {
            if e.0 != 0 {
                self.backend.destroy_event(e);
            }
        }
        if self.side.0 != 0 {
            self.backend.destroy_stream(self.side);
        }
    }
}

pub(crate) enum State {
    Open,
    Captured(Box<Captured>),
    Reset,
}

/// Memory and graph figures of a session, from the library's own accounting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub static_bytes: u64,
    /// The static bytes without reuse, and the least any plan could use.
    pub static_bytes_without_reuse: u64,
    pub peak_live_bytes: u64,
    pub microbatches: u32,
    pub scratch_bytes: u64,
    pub pool_bytes: u64,
    pub clone_bytes_outstanding: u64,
    pub clone_blocks_outstanding: u64,
    pub graph_count: u32,
    pub callables: u32,
    pub instances: u32,
    pub leases_held: u32,
    pub captured: bool,
}

pub struct Session {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) pool: Arc<Pool>,
    pub(crate) opts: SessionOptions,
    pub(crate) callables: Vec<CallableSpec>,
    pub(crate) state: State,
    pub(crate) counters: Arc<MemCounters>,
}

fn check_tensor(t: &TensorSpec, what: &str) -> Result<()> {
    if t.bytes == 0 {
        return Err(Error::invalid(format!("{what}.bytes is 0")));
    }
    if t.bytes % t.dtype.size() != 0 {
        return Err(Error::invalid(format!(
            "{what}.bytes ({}) is not a multiple of the {} element size ({})",
            t.bytes,
            t.dtype.name(),
            t.dtype.size()
        )));
    }
    if !t.shape.is_empty() {
        if let Some(d) = t.shape.iter().find(|&&d| d < 0) {
            return Err(Error::invalid(format!(
                "{what}.shape has a negative dimension ({d})"
            )));
        }
        let elems = t
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
        if elems.and_then(|e| e.checked_mul(t.dtype.size() as u64)) != Some(t.bytes as u64) {
            return Err(Error::invalid(format!(
                "{what}: shape {:?} of {} does not hold {} bytes",
                t.shape,
                t.dtype.name(),
                t.bytes
            )));
        }
    }
    Ok(())
}

impl Session {
    pub fn new(
        backend: Arc<dyn Backend>,
        pool: Option<Arc<Pool>>,
        opts: SessionOptions,
    ) -> Result<Session> {
        let pool = match pool {
            Some(p) => {
                let other = p.backend();
                if other.kind() != backend.kind() || other.ordinal() != backend.ordinal() {
                    return Err(Error::invalid(format!(
                        "share_pool_with: that session runs on the {} backend, device {}; this one on {}, device {}",
                        other.kind().name(),
                        other.ordinal(),
                        backend.kind().name(),
                        backend.ordinal()
                    )));
                }
                p
            }
            None => Pool::new(backend.clone()),
        };
        match &opts.schedule {
            Some(spec) => crate::core::schedule::check_steps(&spec.steps)?,
            None if opts.reuse_buffers => {
                return Err(Error::InvalidSchedule(
                    "reuse_buffers needs a pipeline schedule: buffer lifetimes come from the schedule's order".into(),
                ))
            }
            None => {}
        }
        let s = Session {
            backend,
            pool,
            opts,
            callables: Vec::new(),
            state: State::Open,
            counters: Arc::new(MemCounters::default()),
        };
        if !s.opts.clone_param_grads_on_return {
            s.log(LogLevel::Warn, || {
                "clone_param_grads_on_return is false: parameter grads are returned as aliases of static \
                 buffers that the callable's next backward replay overwrites. Use this only when you consume \
                 each grad before that replay (e.g. fused main_grad accumulation); turn on strict_leases to \
                 have a violation reported instead of silently corrupting the grad"
                    .to_string()
            });
        }
        Ok(s)
    }

    pub fn backend_kind(&self) -> BackendKind {
        self.backend.kind()
    }

    pub fn pool(&self) -> Arc<Pool> {
        self.pool.clone()
    }

    pub(crate) fn log(&self, level: LogLevel, msg: impl FnOnce() -> String) {
        if let Some(log) = &self.opts.log {
            if level <= self.opts.log_level {
                log(level, &msg());
            }
        }
    }

    fn open(&self, what: &str) -> Result<()> {
        match self.state {
            State::Open => Ok(()),
            State::Captured(_) => Err(Error::state(format!(
                "{what} is only allowed before capture; this session is already captured \
                 (its policies and buffers were frozen then)"
            ))),
            State::Reset => Err(Error::SessionReset(format!("{what}: destroy the session"))),
        }
    }

    pub(crate) fn captured(&self) -> Result<&Captured> {
        match &self.state {
            State::Captured(c) => Ok(c),
            State::Open => Err(Error::state(
                "the session is not captured yet: call graphed_session_capture first",
            )),
            State::Reset => Err(Error::SessionReset(
                "its graphs and static buffers were released by graphed_session_reset; destroy it"
                    .into(),
            )),
        }
    }

    pub(crate) fn captured_mut(&mut self) -> Result<&mut Captured> {
        self.captured()?;
        match &mut self.state {
            State::Captured(c) => Ok(c),
            _ => Err(Error::Internal("state changed".into())),
        }
    }

    /// Registers a callable; returns its index.
    pub fn add_callable(&mut self, spec: CallableSpec) -> Result<u32> {
        self.open("registering a callable")?;
        let n = self.callables.len();
        let who = format!("callable {n} ('{}')", spec.name);
        for (i, t) in spec.inputs.iter().enumerate() {
            check_tensor(t, &format!("{who}: inputs[{i}]"))?;
        }
        for (i, t) in spec.outputs.iter().enumerate() {
            check_tensor(t, &format!("{who}: outputs[{i}]"))?;
        }
        for (i, p) in spec.params.iter().enumerate() {
            p.validate(&format!("{who}: params[{i}]"))?;
            if p.data == 0 {
                return Err(Error::NullPointer {
                    what: "params[].data",
                });
            }
        }
        if spec.callbacks.has_wgrad() && !spec.params.iter().any(|p| p.requires_grad) {
            return Err(Error::invalid(format!(
                "{who} has a weight-grad callback but no parameter that requires a gradient"
            )));
        }
        self.callables.push(spec);
        Ok(n as u32)
    }

    pub fn callable_count(&self) -> usize {
        self.callables.len()
    }

    /// (inputs, parameters, outputs) of a registered callable.
    pub fn arity(&self, callable: u32) -> Result<(usize, usize, usize)> {
        let c = self.callables.get(callable as usize).ok_or_else(|| {
            Error::invalid(format!(
                "callable {callable} does not exist (the session has {})",
                self.callables.len()
            ))
        })?;
        Ok((c.inputs.len(), c.params.len(), c.outputs.len()))
    }

    /// Changes a parameter's flags before capture (at capture they freeze).
    pub fn set_param_flags(&mut self, callable: u32, param: u32, flags: u32) -> Result<()> {
        self.open("changing parameter flags")?;
        if flags & !KNOWN_PARAM_FLAGS != 0 {
            return Err(Error::invalid(format!(
                "flags has unknown bits 0x{:x}",
                flags & !KNOWN_PARAM_FLAGS
            )));
        }
        let n = self.callables.len();
        let c = self.callables.get_mut(callable as usize).ok_or_else(|| {
            Error::invalid(format!(
                "callable {callable} does not exist (the session has {n})"
            ))
        })?;
        let np = c.params.len();
        let p = c.params.get_mut(param as usize).ok_or_else(|| {
            Error::invalid(format!(
                "param {param} does not exist (callable {callable} has {np} parameters)"
            ))
        })?;
        p.flags = flags;
        Ok(())
    }

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
        let captured = super::capture::capture(self)?;
        let (n, st, sc) = (
            captured.graph_count,
            captured.statics_bytes,
            captured.arena.1,
        );
        self.state = State::Captured(Box::new(captured));
        self.log(LogLevel::Info, || {
            format!(
                "captured {n} graphs for {} callables: {st} bytes of static buffers, {sc} bytes of scratch",
                self.callables.len()
            )
        });
        Ok(())
    }

    /// Releases every graph and static buffer; later replays fail with
    /// SessionReset. Clones already returned stay valid. Idempotent.
    pub fn reset(&mut self) -> Result<()> {
        let _ctx = self.backend.bind()?;
        self.state = State::Reset;
        Ok(())
    }

    pub fn release_lease(&mut self, lease: u64) -> Result<()> {
        self.captured_mut()?.leases.release(lease)
    }

    /// The static buffers of one role of an instance (0 where absent).
    pub fn buffers(&self, callable: u32, microbatch: u32, role: Role) -> Result<Vec<DevPtr>> {
        let cap = self.captured()?;
        let inst = &cap.instances[cap.instance_index(callable, microbatch)?];
        Ok(match role {
            Role::Input => inst.inputs.clone(),
            Role::Output => inst.outputs.clone(),
            Role::GradOutput => inst.grad_outputs.clone(),
            Role::GradInput => inst.grad_inputs.clone(),
            Role::ParamGrads => inst.param_grads.clone(),
        })
    }

    /// The frozen grad policy of each parameter of a callable (None where
    /// it takes no gradient).
    pub fn policies(&self, callable: u32) -> Result<Vec<Option<GradPolicy>>> {
        let cap = self.captured()?;
        let inst = &cap.instances[cap.instance_index(callable, 0)?];
        Ok(inst.policies.clone())
    }

    pub fn stats(&self) -> Stats {
        let get = MemCounters::get;
        let mut st = Stats {
            static_bytes: get(&self.counters.static_bytes),
            scratch_bytes: get(&self.counters.scratch_bytes),
            pool_bytes: self.pool.bytes() as u64,
            clone_bytes_outstanding: get(&self.counters.clone_bytes),
            clone_blocks_outstanding: get(&self.counters.clone_blocks),
            callables: self.callables.len() as u32,
            ..Stats::default()
        };
        if let State::Captured(c) = &self.state {
            st.static_bytes_without_reuse = c.plan.disjoint_bytes as u64;
            st.peak_live_bytes = c.plan.peak_live_bytes as u64;
            st.microbatches = c.by_callable.first().map_or(0, |v| v.len() as u32);
            st.graph_count = c.graph_count;
            st.instances = c.instances.len() as u32;
            st.leases_held = c.leases.held_count() as u32;
            st.captured = true;
        }
        st
    }

    /// The static-buffer plan as text: one line per buffer with its
    /// instance, role, size, offset, memory slot and lifetime (in pass
    /// positions of the capture order).
    pub fn plan_dump(&self) -> Result<String> {
        use std::fmt::Write;
        let cap = self.captured()?;
        let p = &cap.plan;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "static bytes {} (without reuse {}, peak live {}), {} buffers in {} slots",
            p.total_bytes,
            p.disjoint_bytes,
            p.peak_live_bytes,
            cap.buffers.len(),
            p.slot_of.iter().max().map_or(0, |m| m + 1)
        );
        let _ = writeln!(
            out,
            "callable  microbatch  role             index  bytes       offset      slot  lifetime"
        );
        for (i, b) in cap.buffers.iter().enumerate() {
            let inst = &cap.instances[b.instance];
            let lt = cap
                .lifetimes
                .get(i)
                .copied()
                .unwrap_or(Lifetime { start: 0, end: 0 });
            let _ = writeln!(
                out,
                "{:<9} {:<11} {:<16} {:<6} {:<11} {:<11} {:<5} [{}, {}]",
                self.callables[inst.callable].name,
                inst.microbatch,
                b.role.name(),
                b.index,
                b.bytes,
                p.offsets[i],
                p.slot_of[i],
                lt.start,
                lt.end
            );
        }
        Ok(out)
    }

    /// (free, total) device memory as the driver reports it.
    pub fn device_memory(&self) -> Result<(usize, usize)> {
        let _ctx = self.backend.bind()?;
        self.backend.mem_info()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ctx = self.backend.bind();
        self.state = State::Reset;
    }
}
