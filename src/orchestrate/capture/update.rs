//! Recording a step's update stage into the capture of its graph, after
//! the last microbatch's grads are where the step puts them: with a check,
//! the flag zeroed, the check part, then the apply part as the body of a
//! conditional node that runs it only when the flag is 0 (the device
//! counts the replays that skip it); without, the apply part alone. The
//! callback sees each parameter with where this graph leaves its grad.

use super::run::Runner;
use super::steps::Sequence;
use crate::backend::{Backend, CaptureEnd, DevPtr, StreamRef};
use crate::core::dtype::DType;
use crate::core::policy::GradPolicy;
use crate::core::returns::ParamReturn;
use crate::error::{Error, Result};
use crate::orchestrate::spec::{UpdatePhase, UpdateView};

/// Every parameter of a step as its update (or collective) sees it in
/// one graph.
pub(super) struct Params {
    pub ptrs: Vec<DevPtr>,
    pub grads: Vec<DevPtr>,
    pub bytes: Vec<usize>,
    pub dtypes: Vec<DType>,
    pub policies: Vec<Option<GradPolicy>>,
}

impl Runner<'_> {
    /// The step's parameters, in order, with where the graph whose CLONE
    /// grads go into `block(instance)` leaves each grad; `only`: those of
    /// that instance alone.
    pub(super) fn update_params(
        &self,
        seq: &Sequence,
        block: &dyn Fn(usize) -> Option<DevPtr>,
        only: Option<usize>,
    ) -> Params {
        let mut p = Params {
            ptrs: Vec::new(),
            grads: Vec::new(),
            bytes: Vec::new(),
            dtypes: Vec::new(),
            policies: Vec::new(),
        };
        for (k, &i) in seq.instances.iter().enumerate() {
            if only.is_some_and(|o| o != i) {
                continue;
            }
            let inst = &self.placed[i];
            for (j, (q, t)) in inst.params.iter().zip(&inst.param_grads).enumerate() {
                p.ptrs.push(q.ptr);
                p.bytes.push(q.bytes);
                p.dtypes.push(q.dtype);
                p.grads.push(match t.ret {
                    ParamReturn::CopyInto | ParamReturn::AccumulateInto { .. } => {
                        seq.dsts[seq.first[k] + j]
                    }
                    ParamReturn::Clone { offset } => {
                        block(i).map_or(t.ptr, |b| b + offset as DevPtr)
                    }
                    ParamReturn::Alias => t.ptr,
                    ParamReturn::None => 0,
                });
            }
            p.policies.extend(inst.returns.policies.iter().copied());
        }
        p
    }

    /// Records what follows a step's last microbatch: its collectives
    /// recorded once after the whole backward, then its update.
    pub(super) fn record_tail(
        &mut self,
        seq: &Sequence,
        block: &dyn Fn(usize) -> Option<DevPtr>,
        slot: u32,
    ) -> Result<()> {
        self.record_collective(seq, block, slot, None)?;
        self.record_update(seq, block, slot)
    }

    /// Records the step's update (see the module comment) on the
    /// capturing stream, for the graph of clone slot `slot` (0: the one
    /// graph) whose CLONE grads go into `block(instance)`.
    pub(super) fn record_update(
        &mut self,
        seq: &Sequence,
        block: &dyn Fn(usize) -> Option<DevPtr>,
        slot: u32,
    ) -> Result<()> {
        let Some(u) = seq.update else {
            return Ok(());
        };
        let params = self.update_params(seq, block, None);
        let backend = self.s.backend.clone();
        let main = self.stream;
        let call = |phase: UpdatePhase, stream: StreamRef| -> Result<()> {
            let view = UpdateView {
                step: seq.step as u32,
                phase,
                stream,
                slot,
                params: &params.ptrs,
                grads: &params.grads,
                bytes: &params.bytes,
                dtypes: &params.dtypes,
                policies: &params.policies,
                scalars: u.scalars,
                scalar_bytes: u.spec.scalar_bytes,
                skip_flag: u.flag,
                microbatches: seq.microbatches,
                microbatch_count: seq.state.map_or(0, |s| s + seq.count_at()),
            };
            let ran = (u.spec.callback)(&view);
            intact(backend.as_ref(), seq.step, phase, &[main, stream], &ran)?;
            ran.map_err(|(code, said)| Error::UpdateFailed {
                step: seq.step,
                phase: phase.name(),
                code,
                said,
            })
        };
        if !u.spec.check {
            return call(UpdatePhase::Apply, main);
        }
        // The flag starts at 0 in every replay: the check only sets it.
        backend.zero(u.flag, 4, main)?;
        call(UpdatePhase::Check, main)?;
        let mode = self.s.opts.capture_mode;
        backend.capture_unless(main, u.flag, u.counter, mode, &mut |cs| {
            call(UpdatePhase::Apply, cs)
        })
    }

    /// What the capture of a step's graph ended with, once its update
    /// (`attempted`, with `updated` its outcome) is accounted for: the
    /// update's own error, or an invalidation the update caused (the
    /// passes before it left the capture intact), named as the update's.
    pub(super) fn update_ended(
        &self,
        seq: &Sequence,
        attempted: bool,
        updated: Result<()>,
        ended: Result<CaptureEnd>,
    ) -> Result<Result<CaptureEnd>> {
        if !attempted {
            return Ok(ended);
        }
        updated?;
        match ended {
            Ok(CaptureEnd::Invalidated(detail)) => Err(Error::IllegalUnderCapture(format!(
                "the capture of step {}'s collectives or update was invalidated: {detail}",
                seq.step
            ))),
            ended => Ok(ended),
        }
    }
}

/// Whether the update's callback of `phase` (which returned `ran`) left
/// the captures on `streams` intact; the error naming it if not.
fn intact(
    backend: &dyn Backend,
    step: usize,
    phase: UpdatePhase,
    streams: &[StreamRef],
    ran: &std::result::Result<(), (i32, String)>,
) -> Result<()> {
    for (k, &s) in streams.iter().enumerate() {
        if !backend.capture_invalidated(s)? {
            continue;
        }
        let which = match (phase, k) {
            (UpdatePhase::Apply, 1) if streams[0] != s => {
                "the capture of its apply part (an IF node's body holds kernels, copies and sets \
                 only: no events, no forked work, no synchronisation, no allocation)"
            }
            _ => "the capture of the step's graph",
        };
        let mut detail = format!(
            "the update's {} callback of step {step} invalidated {which}",
            phase.name()
        );
        if let Err((code, _)) = ran {
            detail.push_str(&format!("; the callback then returned {code}"));
        }
        return Err(Error::IllegalUnderCapture(detail));
    }
    Ok(())
}
