//! The session: callables registered, then captured once into graphs that
//! share one pool, then replayed; reset releases everything captured. The
//! captured state (`Captured`) owns every device resource of the capture
//! and releases them all when dropped, so a failed capture leaves nothing
//! behind and the session can be captured again. Whatever fails while the
//! session releases its resources is counted in its stats and sent to its
//! log. Its queries are in `report`; callers reach it through `cell`.

use super::capture;
use super::captured::{Captured, LeaseBook};
use super::context::Inputs;
use super::pool::Pool;
use super::released::{released_error, CallableMemory};
use super::replay::{self, Replayed};
use super::spec::{
    CallableSpec, LogLevel, Looping, MemCounters, ReplayArgs, SessionOptions, StepSpec, TensorSpec,
};
use super::steps::{self, StepRequest};
use crate::backend::accounting::SessionMark;
use crate::backend::{teardown, Backend, BackendKind, DevPtr, StreamRef};
use crate::core::lease::{self, Leases};
use crate::core::policy::ParamFlags;
use crate::core::schedule::check_steps;
use crate::core::size;
use crate::core::PassKind;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub(crate) enum State {
    Open,
    Captured(Box<Captured>),
    Reset,
}

pub struct Session {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) pool: Arc<Pool>,
    pub(crate) opts: SessionOptions,
    pub(crate) callables: Vec<CallableSpec>,
    pub(crate) steps: Vec<StepSpec>,
    pub(crate) state: State,
    pub(crate) counters: Arc<MemCounters>,
    pub(crate) leases: Arc<LeaseBook>,
    /// Identifies the session to its pool.
    pub(crate) key: u64,
    /// Counted among the process's live sessions while it lives.
    _mark: SessionMark,
}

fn check_tensor(t: &TensorSpec, what: &str) -> Result<()> {
    if t.bytes == 0 {
        return Err(Error::invalid(format!("{what}.bytes is 0")));
    }
    size::check_bytes(t.bytes, &format!("{what}.bytes"))?;
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

/// The most buckets a callable may have: each is captured on its own.
pub(crate) const MAX_BUCKETS: usize = 256;

/// Checks a callable's buckets against its DYNAMIC tensors.
fn check_buckets(spec: &CallableSpec, who: &str) -> Result<()> {
    let tensors = || {
        let ins = spec
            .inputs
            .iter()
            .enumerate()
            .map(|(i, t)| ("inputs", i, t));
        ins.chain(
            spec.outputs
                .iter()
                .enumerate()
                .map(|(i, t)| ("outputs", i, t)),
        )
    };
    let Some(&largest) = spec.buckets.last() else {
        return match tensors().find(|(_, _, t)| t.dynamic) {
            Some((what, i, _)) => Err(Error::invalid(format!(
                "{who}: {what}[{i}] is DYNAMIC, but the callable has no buckets (desc.bucket_sizes)"
            ))),
            None => Ok(()),
        };
    };
    let b = &spec.buckets;
    if b.len() > MAX_BUCKETS {
        return Err(Error::invalid(format!(
            "{who} has {} buckets; at most {MAX_BUCKETS}",
            b.len()
        )));
    }
    if b[0] == 0 || largest > u32::MAX as u64 {
        return Err(Error::invalid(format!(
            "{who}: bucket sizes are 1 to 2^32 - 1 (got {b:?})"
        )));
    }
    if b.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::invalid(format!(
            "{who}: bucket sizes must be strictly ascending (got {b:?})"
        )));
    }
    if !tensors().any(|(_, _, t)| t.dynamic) {
        return Err(Error::invalid(format!(
            "{who} has buckets but no DYNAMIC input or output (GRAPHED_TENSOR_FLAGS_DYNAMIC marks the \
             tensors whose first dimension is the bucket size)"
        )));
    }
    for (what, i, t) in tensors().filter(|(_, _, t)| t.dynamic) {
        if t.shape.first() != Some(&(largest as i64)) {
            return Err(Error::invalid(format!(
                "{who}: {what}[{i}] is DYNAMIC: its shape's first dimension must be the largest bucket \
                 ({largest}); its shape is {:?}",
                t.shape
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
        static KEYS: AtomicU64 = AtomicU64::new(1);
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
        if opts.device_buckets {
            if let Some(why) = backend.switches() {
                return Err(Error::Unsupported(format!(
                    "bucket_choice_on_device: {why}"
                )));
            }
        }
        if opts.capture_stream.is_some() && backend.kind() == BackendKind::Host {
            return Err(Error::invalid(
                "capture_stream: the host backend captures on streams of its own; leave it NULL",
            ));
        }
        match &opts.schedule {
            Some(spec) => check_steps(&spec.steps)?,
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
            steps: Vec::new(),
            state: State::Open,
            counters: Arc::new(MemCounters::default()),
            leases: Arc::new(LeaseBook::default()),
            key: KEYS.fetch_add(1, Ordering::Relaxed),
            _mark: SessionMark::new(),
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

    pub fn name(&self) -> &str {
        &self.opts.name
    }

    pub(crate) fn log(&self, level: LogLevel, msg: impl FnOnce() -> String) {
        self.opts.log(level, msg)
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
                "the session is not captured yet: capture it first",
            )),
            State::Reset => Err(Error::SessionReset(
                "its graphs and static buffers were released by its reset; destroy it".into(),
            )),
        }
    }

    /// Registers a callable; returns its index.
    pub fn add_callable(&mut self, mut spec: CallableSpec) -> Result<u32> {
        self.open("registering a callable")?;
        let n = self.callables.len();
        let who = format!("callable {n} ('{}')", spec.name);
        for (i, t) in spec.inputs.iter().enumerate() {
            check_tensor(t, &format!("{who}: inputs[{i}]"))?;
        }
        for (i, t) in spec.outputs.iter().enumerate() {
            check_tensor(t, &format!("{who}: outputs[{i}]"))?;
        }
        for i in 0..spec.inputs.len() {
            if let Some(src) = spec.inputs[i].chained {
                self.check_chain(&spec, i, src, &who)?;
                // A DYNAMIC output chains a DYNAMIC input (its rows).
                let out = &self.callables[src.0 as usize].outputs[src.1 as usize];
                if out.dynamic {
                    let t = &mut spec.inputs[i];
                    t.dynamic = true;
                    if t.shape.is_empty() {
                        t.shape = out.shape.clone();
                    }
                }
            }
        }
        check_buckets(&spec, &who)?;
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
        if n >= u32::MAX as usize {
            return Err(Error::invalid("a session holds at most 2^32 - 1 callables"));
        }
        self.callables.push(spec);
        Ok(n as u32)
    }

    /// Checks that input `i` of a callable being registered may be chained
    /// to output `j` of callable `p`.
    fn check_chain(
        &self,
        spec: &CallableSpec,
        i: usize,
        (p, j): (u32, u32),
        who: &str,
    ) -> Result<()> {
        let t = &spec.inputs[i];
        let what = format!("{who}: inputs[{i}] (chained to output {j} of callable {p})");
        let producer = self.callables.get(p as usize).ok_or_else(|| {
            Error::invalid(format!(
                "{what}: callable {p} is not registered yet (the session has {}); chain to an earlier callable",
                self.callables.len()
            ))
        })?;
        // A producer with buckets runs in one of them: its consumer runs in
        // the same (a consumer with buckets may read a producer of one shape).
        if !producer.buckets.is_empty() && producer.buckets != spec.buckets {
            return Err(Error::invalid(format!(
                "{what}: callable '{}' has buckets {:?}; a callable chained to it has the same buckets \
                 (here {:?})",
                producer.name, producer.buckets, spec.buckets
            )));
        }
        let out = producer.outputs.get(j as usize).ok_or_else(|| {
            Error::invalid(format!(
                "{what}: callable '{}' has {} outputs",
                producer.name,
                producer.outputs.len()
            ))
        })?;
        if out.external || t.external {
            return Err(Error::invalid(format!(
                "{what}: external buffers cannot be chained (the output and the input's grad must be the \
                 library's static buffers)"
            )));
        }
        if (out.bytes, out.dtype, out.requires_grad) != (t.bytes, t.dtype, t.requires_grad) {
            return Err(Error::invalid(format!(
                "{what}: the output is {} bytes of {} (requires_grad {}), the input {} bytes of {} \
                 (requires_grad {}); they must match",
                out.bytes,
                out.dtype.name(),
                out.requires_grad,
                t.bytes,
                t.dtype.name(),
                t.requires_grad
            )));
        }
        if t.requires_grad {
            let taken = self
                .callables
                .iter()
                .flat_map(|c| c.inputs.iter())
                .chain(spec.inputs[..i].iter())
                .any(|other| other.requires_grad && other.chained == Some((p, j)));
            if taken {
                return Err(Error::invalid(format!(
                    "{what}: another input already chains that output with a gradient; two would write \
                     its grad-output. Chain it once and pass it as data to the others"
                )));
            }
        }
        Ok(())
    }

    /// Declares a step (see `StepSpec`); returns its index. Checked here as
    /// far as registration allows (steps::declare), and against placement
    /// and the frozen policies at capture.
    pub fn add_step(&mut self, request: StepRequest) -> Result<u32> {
        self.open("declaring a step")?;
        if self.opts.schedule.is_some() {
            return Err(Error::Incompatible(
                "steps are for sessions without a pipeline schedule (one microbatch per callable)"
                    .into(),
            ));
        }
        let step = steps::declare(&self.callables, request)?;
        if step.looping == Looping::Device {
            if let Some(why) = self.backend.loops() {
                return Err(Error::Unsupported(format!(
                    "a step that loops on the device cannot be declared: {why}; declare it unrolled \
                     (GRAPHED_STEP_LOOP_UNROLLED) instead"
                )));
            }
        }
        if self.steps.len() >= u32::MAX as usize {
            return Err(Error::invalid("a session holds at most 2^32 - 1 steps"));
        }
        self.steps.push(step);
        Ok(self.steps.len() as u32 - 1)
    }

    /// The number of parameters of a step's callables.
    pub fn step_params(&self, step: u32) -> Result<usize> {
        let s = self.steps.get(step as usize).ok_or_else(|| {
            Error::invalid(format!(
                "step {step} does not exist (the session has {})",
                self.steps.len()
            ))
        })?;
        // One destination (or 0) per parameter, checked at declaration.
        Ok(s.param_dsts.len())
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
    pub fn set_param_flags(&mut self, callable: u32, param: u32, flags: ParamFlags) -> Result<()> {
        self.open("changing parameter flags")?;
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
        let mut changed = p.clone();
        changed.flags = flags;
        changed.validate(&format!("callable {callable}: params[{param}]"))?;
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
                    "callable '{name}' cannot be released: {slot}, an alias it handed out, is still held                      (lease 0x{token:x}); release that lease first (graphed_lease_release). Nothing was                      released"
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

    /// What a replay uses of the session, once it is captured.
    fn parts(&mut self) -> Result<replay::Parts<'_>> {
        self.captured()?;
        let State::Captured(cap) = &mut self.state else {
            return Err(Error::Internal("state changed".into()));
        };
        Ok(replay::Parts {
            key: self.key,
            backend: &self.backend,
            opts: &self.opts,
            callables: &self.callables,
            cap,
            counters: &self.counters,
            pool: &self.pool,
            leases: &self.leases,
        })
    }

    /// Replays the forward graph of (callable, microbatch) and returns the
    /// static outputs: aliases, valid until the next forward replay of the
    /// same instance.
    pub fn forward(&mut self, a: &ReplayArgs) -> Result<Replayed<'_>> {
        self.captured()?;
        self.check_live(a.callable, "a forward replay")?;
        replay::pass(self.parts()?, a, PassKind::Forward)
    }

    /// Replays the backward graph; returns the input grads (aliases, valid
    /// until the next backward replay of the same instance) and the
    /// parameter grads per the return plan (all NONE when the callable has
    /// a weight-grad graph: `wgrad` returns them).
    pub fn backward(&mut self, a: &ReplayArgs) -> Result<Replayed<'_>> {
        self.captured()?;
        self.check_live(a.callable, "a backward replay")?;
        replay::pass(self.parts()?, a, PassKind::Backward)
    }

    /// Replays the weight-grad graph of a callable registered with a
    /// weight-grad callback; returns its parameter grads per the return plan.
    pub fn wgrad(&mut self, a: &ReplayArgs) -> Result<Replayed<'_>> {
        self.captured()?;
        self.check_live(a.callable, "a weight-grad replay")?;
        replay::pass(self.parts()?, a, PassKind::Wgrad)
    }

    /// Replays a step on `stream`; returns the parameter grads of its
    /// callables, in order, per their return plans.
    pub fn step(
        &mut self,
        step: u32,
        stream: StreamRef,
        params: Option<&[DevPtr]>,
        microbatches: u32,
    ) -> Result<Replayed<'_>> {
        if let State::Captured(cap) = &self.state {
            if let Some(c) = cap.step_released(step as usize) {
                return Err(released_error(
                    &self.callables[c].name,
                    &format!("step {step}, which includes it,"),
                ));
            }
        }
        replay::step(self.parts()?, step, stream, params, microbatches)
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
