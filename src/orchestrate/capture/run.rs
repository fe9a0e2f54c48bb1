//! Running one pass of one instance during warmup or capture: the view its
//! callback (or hook) gets of the static buffers, the per-callable hooks
//! around it, the callback itself (under capture, between the beginning and
//! the end of a stream capture), and what a failure is reported as.

use super::super::buckets::SizeBlock;
use super::super::clock::{CaptureTimes, Span};
use super::super::context::Inputs;
use super::super::external::Provided;
use super::super::instance::{PassRef, Placed};
use super::super::scratch::Scratch;
use super::super::spec::{HookPoint, PassView, Phase};
use super::super::tensor::{ptrs, Feed};
use crate::backend::{journal, CaptureEnd, DevPtr, Graph, StreamRef, Tail};
use crate::core::policy::GradPolicy;
use crate::error::{CapturePlace, Error, Result};
use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a callback sees of its instance, as address lists.
pub(super) struct ViewBuffers {
    inputs: Vec<DevPtr>,
    params: Vec<DevPtr>,
    outputs: Vec<DevPtr>,
    grad_outputs: Vec<DevPtr>,
    grad_inputs: Vec<DevPtr>,
    param_grads: Vec<DevPtr>,
    policies: Vec<Option<GradPolicy>>,
}

impl ViewBuffers {
    /// The instance's buffers; `param_grads`, where given, replaces the
    /// parameter-grad addresses (a clone slot's capture).
    pub fn of(inst: &Placed, param_grads: Option<Vec<DevPtr>>) -> ViewBuffers {
        ViewBuffers {
            inputs: ptrs(&inst.inputs),
            params: inst.params.iter().map(|p| p.ptr).collect(),
            outputs: ptrs(&inst.outputs),
            grad_outputs: ptrs(&inst.grad_outputs),
            grad_inputs: ptrs(&inst.grad_inputs),
            param_grads: param_grads.unwrap_or_else(|| ptrs(&inst.param_grads)),
            policies: inst.returns.policies.clone(),
        }
    }
}

fn phase_label(phase: Phase, hook: Option<HookPoint>) -> &'static str {
    match (phase, hook) {
        (Phase::Warmup, None) => "warmup",
        (Phase::Capture, None) => "capture",
        (Phase::Warmup, Some(HookPoint::Pre)) => "the pre-hook before a warmup pass",
        (Phase::Warmup, Some(HookPoint::Post)) => "the post-hook after a warmup pass",
        (Phase::Capture, Some(HookPoint::Pre)) => "the pre-hook before a capture",
        (Phase::Capture, Some(HookPoint::Post)) => "the post-hook after a capture",
    }
}

/// Which graph a capture records, for the messages of its failures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GraphOf {
    /// The pass's own graph (and warmup, which records none).
    Pass,
    /// Clone slot k's graph of the pass.
    Slot(usize),
    /// A step's graph: the step, and the microbatch of the step the pass
    /// was recorded for (None: the body of a loop on the device).
    Step(usize, Option<u32>),
}

impl GraphOf {
    fn label(self) -> String {
        match self {
            GraphOf::Pass => String::new(),
            GraphOf::Slot(k) => format!(", clone slot {k}"),
            GraphOf::Step(s, Some(mb)) => {
                format!(", in the capture of step {s} (its microbatch {mb})")
            }
            GraphOf::Step(s, None) => format!(", in the capture of step {s} (its loop's body)"),
        }
    }
}

/// How one pass is run.
#[derive(Clone, Copy)]
pub(super) struct Call<'a> {
    pub phase: Phase,
    pub iteration: u32,
    /// Run the per-callable hooks around the callback.
    pub hooks: bool,
    /// Record the external buffers the callback provides (the first
    /// capture of a pass; slot captures repeat it).
    pub provide: bool,
    /// A clone slot's parameter-grad addresses.
    pub param_grads: Option<&'a [DevPtr]>,
    /// Under a step's capture: its microbatch, of how many.
    pub step_microbatch: (u32, u32),
    /// In a loop's body: where the device holds the running microbatch.
    pub step_index: DevPtr,
    /// The graph it records (named in failures).
    pub graph: GraphOf,
}

impl Call<'_> {
    /// A pass in step `step`'s capture: no per-callable hooks, nothing
    /// provided; microbatch `mb` of `n` (the loop's `index` on the device
    /// in a looped body, else 0).
    pub fn in_step(step: usize, iteration: u32, (mb, n): (u32, u32), index: DevPtr) -> Self {
        Call {
            graph: GraphOf::Step(step, (index == 0).then_some(mb)),
            phase: Phase::Capture,
            iteration,
            hooks: false,
            provide: false,
            param_grads: None,
            step_microbatch: (mb, n),
            step_index: index,
        }
    }
}

/// The state warmup and capture share: the session, its placed instances,
/// the scratch allocator, one tape slot per instance, the stream, and the
/// clock.
pub(super) struct Runner<'a> {
    pub s: &'a Inputs<'a>,
    pub placed: &'a mut [Placed],
    pub scratch: &'a Arc<Scratch>,
    pub tapes: Box<[Cell<usize>]>,
    pub stream: StreamRef,
    /// Where the device holds each callable's actual size (None: no
    /// callable has buckets).
    pub sizes: Option<&'a SizeBlock>,
    pub times: &'a mut CaptureTimes,
    /// The steps up to which this rank has taken part in the collective
    /// exchanges (the first step whose exchange it still owes).
    pub exchanged: &'a Cell<usize>,
}

impl Runner<'_> {
    /// Runs `f`, adding its time less the graphs it made to `span` (the
    /// graphs' instantiation and upload have spans of their own).
    pub fn spent<T>(&mut self, span: Span, f: impl FnOnce(&mut Self) -> T) -> T {
        let made = |t: &CaptureTimes| t.instantiate + t.upload;
        let before = made(self.times);
        let t = Instant::now();
        let out = f(self);
        let inside = Duration::from_nanos(made(self.times).saturating_sub(before));
        self.times.add(span, t.elapsed().saturating_sub(inside));
        out
    }

    /// Where pass `p` is, recording `graph`: the session, the callable
    /// (name and index), the microbatch, the bucket.
    pub fn place(&self, p: PassRef, graph: GraphOf) -> CapturePlace {
        let inst = &self.placed[p.instance];
        let spec = &self.s.callables[inst.callable];
        CapturePlace {
            session: self.s.opts.name.clone(),
            callable: spec.name.clone(),
            index: inst.callable as u32,
            microbatch: inst.microbatch,
            bucket: (!spec.buckets.is_empty())
                .then(|| (inst.bucket, spec.bucket_size(inst.bucket as usize))),
            graph: graph.label(),
        }
    }

    /// What the callback of pass `p` said about its failure (from
    /// `graphed_callback_fail_message`), then under capture the first
    /// failing call graphed saw (`journal`): ": ..." or "".
    fn said(&self, p: PassRef, seen: Option<String>) -> String {
        let spec = &self.s.callables[self.placed[p.instance].callable];
        let mut said = spec
            .callbacks
            .failure_message()
            .map_or(String::new(), |m| format!(": {m}"));
        if let Some(seen) = seen {
            said.push_str(&format!(
                "{}the first call that failed under this capture: {seen}",
                if said.is_empty() { ": " } else { "; " }
            ));
        }
        said
    }

    fn failed(
        &self,
        p: PassRef,
        call: (Phase, GraphOf),
        hook: Option<HookPoint>,
        code: i32,
    ) -> Error {
        let seen = (call.0 == Phase::Capture && hook.is_none())
            .then(journal::take)
            .flatten();
        Error::CallbackFailed {
            place: Box::new(self.place(p, call.1)),
            pass: p.kind,
            phase: phase_label(call.0, hook),
            code,
            said: self.said(p, seen),
        }
    }

    /// What the callbacks (with scratch and, under capture, the external
    /// buffer collector) or hooks (with neither) of pass `p` see.
    pub fn view<'v>(
        &'v self,
        bufs: &'v ViewBuffers,
        p: PassRef,
        call: &Call,
        scratch: Option<&'v Arc<Scratch>>,
        provided: Option<&'v Arc<Provided>>,
    ) -> PassView<'v> {
        let inst = &self.placed[p.instance];
        let spec = &self.s.callables[inst.callable];
        let bucketed = !spec.buckets.is_empty();
        // Every pass that runs is in the order (placement numbered them).
        let position = inst.position[p.kind.index()];
        debug_assert!(position.is_some(), "a pass outside the capture order");
        PassView {
            position: position.unwrap_or(0) as u32,
            instance: p.instance as u32,
            bucket: inst.bucket,
            buckets: match bucketed {
                true => spec.bucket_count() as u32,
                false => 0,
            },
            bucket_size: spec.bucket_size(inst.bucket as usize),
            actual_size: match bucketed {
                true => self.actual_size(inst.callable),
                false => 0,
            },
            bucket_size2: spec.sizes(inst.bucket as usize).1,
            actual_size2: match spec.buckets2.is_empty() {
                false => self.sizes.map_or(0, |b| b.actual2(inst.callable)),
                true => 0,
            },
            callable: inst.callable as u32,
            microbatch: inst.microbatch,
            pass: p.kind,
            phase: call.phase,
            iteration: call.iteration,
            step_microbatch: call.step_microbatch.0,
            step_microbatches: call.step_microbatch.1,
            step_index: call.step_index,
            stream: self.stream,
            inputs: &bufs.inputs,
            params: &bufs.params,
            outputs: &bufs.outputs,
            grad_outputs: &bufs.grad_outputs,
            grad_inputs: &bufs.grad_inputs,
            param_grads: &bufs.param_grads,
            param_policies: &bufs.policies,
            tape: self.tapes[p.instance].as_ptr().cast(),
            scratch,
            provided,
        }
    }

    /// Where the device holds callable `c`'s actual size.
    fn actual_size(&self, c: usize) -> DevPtr {
        self.sizes.map_or(0, |b| b.actual(c))
    }

    /// Before a warmup pass of a callable with buckets: its actual size is
    /// its bucket's (replays write theirs before they launch).
    fn set_size(&self, p: PassRef) -> Result<()> {
        let inst = &self.placed[p.instance];
        let (size, size2) = self.s.callables[inst.callable].sizes(inst.bucket as usize);
        let c = inst.callable;
        // Bucket sizes fit in 32 bits (checked at registration); the high
        // words stay zero from the zeroed static memory.
        let fill = |at: DevPtr, n: u64| self.s.backend.fill(at, n as u32, 4, 1, self.stream);
        if size2 != 0 {
            fill(self.sizes.map_or(0, |b| b.actual2(c)), size2)?;
        }
        match size {
            0 => Ok(()),
            n => fill(self.actual_size(c), n),
        }
    }

    /// Before a warmup callback of a pass of a bucketed callable: the rows
    /// of its fed DYNAMIC buffers (inputs of a forward, grad-outputs of a
    /// backward) past its bucket's size are zeroed, as replays zero them
    /// (the buffers held the largest bucket's samples).
    fn zero_tails(&self, p: PassRef) -> Result<()> {
        let inst = &self.placed[p.instance];
        let Some(role) = Placed::fed_role(p.kind) else {
            return Ok(());
        };
        let size = self.actual_size(inst.callable);
        for t in inst.tensors(role) {
            // Chained buffers are their producer's.
            let chained = matches!(t.feed, Feed::Chained);
            if t.row_bytes > 0 && t.ptr != 0 && size != 0 && !chained {
                let tail = Tail {
                    dst: t.ptr,
                    row: t.row_bytes,
                    size,
                    bytes: t.bytes,
                    most: t.bytes,
                };
                self.s.backend.zero_tail(tail, self.stream)?;
            }
        }
        Ok(())
    }

    /// The text naming pass `p` in the messages of its callback.
    pub fn context(&self, p: PassRef, during: &str) -> String {
        let inst = &self.placed[p.instance];
        let name = &self.s.callables[inst.callable].name;
        format!(
            "the {} callback of callable '{name}' (microbatch {}) during {during}",
            p.kind, inst.microbatch
        )
    }

    fn hook(&self, p: PassRef, call: &Call, point: HookPoint) -> Result<()> {
        if !call.hooks {
            return Ok(());
        }
        let bufs = ViewBuffers::of(&self.placed[p.instance], None);
        let view = self.view(&bufs, p, call, None, None);
        let spec = &self.s.callables[self.placed[p.instance].callable];
        spec.callbacks
            .hook(point, &view)
            .map_err(|c| self.failed(p, (call.phase, call.graph), Some(point), c))
    }

    /// Runs the hooks and the callback of pass `p` once; under capture the
    /// callback alone is captured into the graph this returns.
    pub fn call(&mut self, p: PassRef, call: Call) -> Result<Option<Box<dyn Graph>>> {
        let context = self.context(p, call.phase.name());
        let capture = call.phase == Phase::Capture;
        // Under capture, the external buffers this pass must provide.
        let provided = capture
            .then(|| Provided::new(self.placed[p.instance].provided_by(p.kind), context.clone()));
        if !capture {
            self.set_size(p)?;
        }
        self.hook(p, &call, HookPoint::Pre)?;
        self.scratch
            .set_context(context, self.placed[p.instance].callable);
        let graph = {
            let inst = &self.placed[p.instance];
            let bufs = ViewBuffers::of(inst, call.param_grads.map(<[DevPtr]>::to_vec));
            let view = self.view(&bufs, p, &call, Some(self.scratch), provided.as_ref());
            let spec = &self.s.callables[inst.callable];
            if capture {
                self.begin(p, call.graph)?;
                let ran = spec.callbacks.run(&view);
                let ended = self.s.backend.end_capture(self.stream);
                Some(self.finish(p, call.graph, ran, ended)?)
            } else {
                self.zero_tails(p)?;
                let ran = spec.callbacks.run(&view);
                let refused = self.scratch.take_failure();
                ran.map_err(|c| {
                    refused.unwrap_or_else(|| self.failed(p, (call.phase, call.graph), None, c))
                })?;
                None
            }
        };
        if let (Some(provided), true) = (&provided, call.provide) {
            let inst = &mut self.placed[p.instance];
            for (role, i, ptr) in provided.finish()? {
                inst.tensors_mut(role)[i].ptr = ptr;
            }
        }
        self.hook(p, &call, HookPoint::Post)?;
        Ok(graph)
    }

    /// Begins the capture of pass `p` into `graph` on the runner's stream,
    /// watching for the first call that fails under it (`journal`).
    pub fn begin(&self, p: PassRef, graph: GraphOf) -> Result<()> {
        journal::arm();
        let mode = self.s.opts.capture_mode;
        self.s
            .backend
            .begin_capture(self.stream, mode)
            .map_err(|cause| {
                journal::take();
                Error::Surfaced {
                    place: format!(
                        "beginning the capture of the {} pass of {}",
                        p.kind,
                        self.place(p, graph)
                    ),
                    cause: Box::new(cause),
                }
            })
    }

    /// The graph of a capture (into `graph`) that ended with `ended`, whose
    /// last callback (of pass `p`) returned `ran`; or why there is none,
    /// naming where it was and what broke it.
    pub fn finish(
        &mut self,
        p: PassRef,
        graph: GraphOf,
        ran: std::result::Result<(), i32>,
        ended: Result<CaptureEnd>,
    ) -> Result<Box<dyn Graph>> {
        // A refused scratch request explains a failed callback better than
        // its code; a callback that carried on without it is fine.
        let refused = self.scratch.take_failure();
        // An invalidated capture is the root cause even when the callback
        // also failed (its next launch fails because of it).
        match (ran, ended) {
            (ran, Ok(CaptureEnd::Invalidated(mut detail))) => {
                if let Some(seen) = journal::take() {
                    detail.push_str(&format!(
                        "; the first call that failed under this capture: {seen}"
                    ));
                }
                if let Err(code) = ran {
                    let said = self.said(p, None);
                    detail.push_str(&format!("; the callback then returned {code}{said}"));
                }
                Err(Error::CaptureInvalidated {
                    place: Box::new(self.place(p, graph)),
                    pass: p.kind,
                    detail,
                })
            }
            (Err(code), _) => match refused {
                Some(e) => {
                    journal::take();
                    Err(e)
                }
                None => Err(self.failed(p, (Phase::Capture, graph), None, code)),
            },
            (Ok(()), Err(cause)) => {
                journal::take();
                Err(Error::Surfaced {
                    place: format!(
                        "ending the capture of the {} pass of {}",
                        p.kind,
                        self.place(p, graph)
                    ),
                    cause: Box::new(cause),
                })
            }
            (Ok(()), Ok(CaptureEnd::Graph(g))) => {
                journal::take();
                let made = g.made();
                self.times.add(Span::Instantiate, made.instantiate);
                self.times.add(Span::Upload, made.upload);
                Ok(g)
            }
        }
    }
}
