//! The session: callables registered, then captured once into graphs that
//! share one pool, then replayed; reset releases everything captured. Here
//! are its states, what it is made of, its creation and the replays'
//! entry (forward, backward, weight-grad, step). Registration is in
//! `registration`; its changes of state (capture, releasing one callable,
//! reset, drop) in `lifecycle`; its queries in `report`; callers reach it
//! through `cell`. The captured state (`Captured`) owns every device
//! resource of the capture and releases them all when dropped, so a failed
//! capture leaves nothing behind and the session can be captured again.

use super::captured::{Captured, LeaseBook};
use super::pool::Pool;
use super::released::released_error;
use super::replay::{self, Replayed};
use super::spec::{
    CallableSpec, LogLevel, MemCounters, ReplayArgs, SessionOptions, StepCall, StepSpec,
};
use crate::backend::accounting::SessionMark;
use crate::backend::{Backend, BackendKind};
use crate::core::collective::CollectiveEntry;
use crate::core::schedule::check_steps;
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

impl Session {
    /// A session of `opts`, debug mode also on when GRAPHED_DEBUG is 1
    /// now (read once, here).
    pub fn new(
        backend: Arc<dyn Backend>,
        pool: Option<Arc<Pool>>,
        mut opts: SessionOptions,
    ) -> Result<Session> {
        static KEYS: AtomicU64 = AtomicU64::new(1);
        opts.debug |= replay::debug_env_value(std::env::var_os(replay::DEBUG_ENV).as_deref())?;
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
        if s.opts.debug {
            s.log(LogLevel::Info, || {
                "debug mode is on: every replay synchronizes its stream around each graph it runs, and an \
                 error found there names the callable, pass and graph"
                    .to_string()
            });
        }
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

    pub(super) fn open(&self, what: &str) -> Result<()> {
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
    pub fn step(&mut self, call: &StepCall) -> Result<Replayed<'_>> {
        self.step_live(call.step)?;
        if self.opts.debug {
            return replay::debug_step(self.parts()?, call);
        }
        replay::step(self.parts()?, call)
    }

    /// Refuses a step that includes a released callable.
    fn step_live(&self, step: u32) -> Result<()> {
        if let State::Captured(cap) = &self.state {
            if let Some(c) = cap.step_released(step as usize) {
                return Err(released_error(
                    &self.callables[c].name,
                    &format!("step {step}, which includes it,"),
                ));
            }
        }
        Ok(())
    }

    /// The collectives `step`'s graphs record, in order.
    pub fn step_collectives(&self, step: u32) -> Result<Vec<CollectiveEntry>> {
        let cap = self.captured()?;
        let n = cap.steps.len();
        let st = cap.steps.get(step as usize).ok_or_else(|| {
            Error::invalid(format!("step {step} does not exist (the session has {n})"))
        })?;
        st.collectives.clone().ok_or_else(|| {
            Error::invalid(format!(
                "step {step} has no collective stage (graphed_step_desc.collective is NULL)"
            ))
        })
    }

    /// Whether the last replay of `step` skipped its update (its check set
    /// the flag) and how many replays did, once that replay finished.
    pub fn step_skipped(&self, step: u32) -> Result<(bool, u64)> {
        let cap = self.captured()?;
        let n = cap.steps.len();
        let st = cap.steps.get(step as usize).ok_or_else(|| {
            Error::invalid(format!("step {step} does not exist (the session has {n})"))
        })?;
        self.step_live(step)?;
        let answer = match &st.update {
            Some(u) => u.skipped(self.backend.as_ref())?,
            None => None,
        };
        answer.ok_or_else(|| {
            Error::invalid(format!(
                "step {step} has no update_check: nothing is ever skipped (graphed_step_skipped reads \
                 the flag its check writes)"
            ))
        })
    }
}
