//! Steps that loop on the device: one capture holds a prologue (the loop's
//! index set to 0, the sums the grads go into started at -0.0) and one
//! conditional WHILE node whose body is one microbatch (its copies in, at
//! offsets the device computes from the index, the passes, its copies
//! out, every grad added to its sum). The graph is the same size whatever
//! the count, and a replay names the count. Adding to -0.0 gives each sum's
//! first grad exactly (-0.0 + x is x for every x), so the sums equal eager
//! accumulation bit for bit, as the unrolled capture's do. The step's
//! update, if it has one, follows the loop (update.rs). A step with
//! collectives runs all but its last microbatch in the loop (none when a
//! replay runs one: a flag the replay sets makes the kernel before the
//! WHILE node skip it; the loop is not nested in an IF node, as CUDA
//! refuses the child graph that would hold it)
//! and records the last after it, outside any conditional node, where its
//! collectives go (NCCL cannot run inside a conditional node).

use super::super::external::Provided;
use super::super::grads::enqueue_sums;
use super::super::instance::PassRef;
use super::run::{Call, GraphOf, Runner, ViewBuffers};
use super::step_io::summable;
use super::steps::{Sequence, PEELED_SKIP, PEELED_SKIPS};
use crate::backend::{journal, AccItem, CaptureEnd, DevPtr, Graph, StreamRef};
use crate::core::returns::ParamReturn;
use crate::error::{Error, Result};

/// -0.0's bits in an element of `size` bytes (f32; f16 and bf16).
fn negative_zero(size: usize) -> Option<u32> {
    match size {
        4 => Some(0x8000_0000),
        2 => Some(0x8000),
        _ => None,
    }
}

impl Runner<'_> {
    /// Captures the looped form of a step (see the module comment); an
    /// instance with a block (`block(instance)`) sums its CLONE grads
    /// there. `state` holds the loop's index and count.
    pub(super) fn capture_looped(
        &mut self,
        seq: &Sequence,
        state: DevPtr,
        block: &dyn Fn(usize) -> Option<DevPtr>,
        slot: u32,
        iteration: u32,
    ) -> Result<Box<dyn Graph>> {
        self.scratch.restart();
        let backend = self.s.backend.clone();
        let mode = self.s.opts.capture_mode;
        let main = self.stream;
        let graph = GraphOf::Step(seq.step, None);
        self.begin(seq.passes[0], graph)?;
        let mut prologue = backend.fill(state, 0, 4, 1, main);
        if prologue.is_ok() {
            prologue = self.start_sums(seq, block);
        }
        let (mut ran, mut last) = (Ok(()), seq.passes[0]);
        let mut body = Ok(());
        let mut collected = Ok(());
        let mut acc = Vec::new();
        if prologue.is_ok() {
            let mut in_loop = |ls: StreamRef| {
                self.stream = ls;
                let at = (main, None);
                let out = self.loop_body(
                    seq,
                    state,
                    block,
                    iteration,
                    at,
                    (&mut ran, &mut collected),
                    &mut last,
                    &mut acc,
                );
                self.stream = main;
                out
            };
            // The loop runs all but the last microbatch: none at a count of
            // 1, where the flag skips it (set on the device before the
            // loop, not an IF around it: CUDA refuses the child graph that
            // would hold the nested loop).
            let skip = seq
                .peeled()
                .then_some((state + PEELED_SKIP, state + PEELED_SKIPS));
            body = backend.capture_loop(main, state, skip, mode, &mut in_loop);
        }
        // With collectives, the last microbatch after the loop, on the
        // capture around it (its index where the loop left it).
        if seq.peeled() && prologue.is_ok() && body.is_ok() && ran.is_ok() {
            // Its scratch from the start again, as each unrolled
            // microbatch's: the loop has finished when it runs.
            self.scratch.restart();
            let at = (main, Some(slot));
            body = self.loop_body(
                seq,
                state,
                block,
                iteration,
                at,
                (&mut ran, &mut collected),
                &mut last,
                &mut acc,
            );
        }
        // The collectives and the update after the loop, on the capture
        // around it.
        let attempted = (seq.update.is_some() || seq.collective.is_some())
            && prologue.is_ok()
            && body.is_ok()
            && ran.is_ok()
            && matches!(backend.capture_invalidated(main), Ok(false));
        let updated = match attempted {
            true => self.record_tail(seq, block, slot),
            false => Ok(()),
        };
        let ended = backend.end_capture(main);
        // A collective's own error stands over the capture's end.
        if let Err(e) = collected {
            drop(ended);
            return Err(e);
        }
        let ended = self.update_ended(seq, attempted, updated, ended)?;
        // A body that broke the loop's own capture (the enclosing one
        // still valid) is the root cause, also when its callback failed
        // after.
        let main_broken = matches!(ended, Ok(CaptureEnd::Invalidated(_)));
        if !main_broken {
            if let Err(e @ Error::CaptureInvalidated { .. }) = body {
                drop(ended);
                return Err(e);
            }
        }
        let g = self.finish(last, graph, ran, ended)?;
        prologue?;
        body?;
        Ok(g)
    }

    /// Sets every sum the loop adds grads to (COPY_INTO destinations, CLONE
    /// places in the blocks) to -0.0, on the capturing stream.
    fn start_sums(&self, seq: &Sequence, block: &dyn Fn(usize) -> Option<DevPtr>) -> Result<()> {
        let backend = self.s.backend.as_ref();
        for (k, &i) in seq.instances.iter().enumerate() {
            let inst = &self.placed[i];
            for (j, t) in inst.param_grads.iter().enumerate() {
                let at = match t.ret {
                    ParamReturn::CopyInto => seq.dsts[seq.first[k] + j],
                    ParamReturn::Clone { offset } => match block(i) {
                        Some(b) => b + offset as DevPtr,
                        None => continue,
                    },
                    _ => continue,
                };
                summable(&self.s.callables[inst.callable].name, j, t.dtype)?;
                let size = t.dtype.size();
                let pattern = negative_zero(size)
                    .ok_or_else(|| Error::Internal(format!("-0.0 of {}", t.dtype.name())))?;
                backend.fill(at, pattern, size, t.bytes / size, self.stream)?;
            }
        }
        Ok(())
    }

    /// One microbatch, recorded on the loop's stream (`self.stream` while
    /// it runs; `main` holds the capture around the loop), or, with
    /// `peeled` (the graph's clone slot), the last one after the loop on
    /// `main` itself, with the step's collectives after each callable's
    /// grads. A failed callback leaves its code in `ran` and stops; so
    /// does a callback that broke either capture, and a collective, whose
    /// error goes into `collected`.
    #[allow(clippy::too_many_arguments)]
    fn loop_body(
        &mut self,
        seq: &Sequence,
        state: DevPtr,
        block: &dyn Fn(usize) -> Option<DevPtr>,
        iteration: u32,
        (main, peeled): (StreamRef, Option<u32>),
        (ran, collected): (&mut std::result::Result<(), i32>, &mut Result<()>),
        last: &mut PassRef,
        acc: &mut Vec<AccItem>,
    ) -> Result<()> {
        let backend = self.s.backend.clone();
        let s: StreamRef = self.stream;
        let call = Call::in_step(seq.step, iteration, (0, seq.microbatches), state);
        for &p in seq.passes {
            *last = p;
            let inst = &self.placed[p.instance];
            for c in seq.io {
                c.enqueue_indexed(backend.as_ref(), p, true, state, s)?;
            }
            let context = self.context(p, "the capture of a step's loop");
            let provided = Provided::in_step(seq.step, context.clone());
            self.scratch.set_context(context, inst.callable);
            let bufs = ViewBuffers::of(inst, None);
            let view = self.view(&bufs, p, &call, Some(self.scratch), Some(&provided));
            *ran = self.s.callables[inst.callable].callbacks.run(&view);
            // The enclosing capture broken: no later callback runs, and
            // `finish` names this pass from the capture's end.
            if backend.capture_invalidated(main)? {
                return Err(Error::state("the capture around the loop was invalidated"));
            }
            if backend.capture_invalidated(s)? {
                let mut detail = "the capture of the loop's body was invalidated (a loop's body \
                     holds kernels, copies and sets only: no events, no forked work, no \
                     synchronisation)"
                    .to_string();
                if let Some(seen) = journal::take() {
                    detail.push_str(&format!(
                        "; the first call that failed under this capture: {seen}"
                    ));
                }
                if let Err(code) = ran {
                    detail.push_str(&format!("; the callback then returned {code}"));
                }
                return Err(Error::CaptureInvalidated {
                    place: Box::new(self.place(p, call.graph)),
                    pass: p.kind,
                    detail,
                });
            }
            if ran.is_err() {
                return Err(Error::state("a callback of the loop's body failed"));
            }
            for c in seq.io {
                c.enqueue_indexed(backend.as_ref(), p, false, state, s)?;
            }
            if p.kind == inst.grad_pass() {
                let dst = seq.dsts_of(p.instance);
                enqueue_sums(backend.as_ref(), inst, dst, block(p.instance), acc, s)?;
                if let Some(slot) = peeled {
                    *collected = self.record_collective(seq, block, slot, Some(p.instance));
                    if collected.is_err() {
                        return Err(Error::state("a collective of the last microbatch failed"));
                    }
                }
            }
        }
        Ok(())
    }
}
