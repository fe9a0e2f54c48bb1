//! Recording a step's graph unrolled: its passes back to back in one
//! stream capture, once per microbatch (each callback sees which in
//! ctx->step_microbatch), with the io copies in before the pass that reads
//! them and out after the pass that writes them, and every grad pass
//! followed by its returns: COPY_INTO and ACCUMULATE_INTO into the step's
//! destinations, CLONE grads into a clone slot's block, the grads of later
//! microbatches added to the first's; then the step's update, if it has
//! one (update.rs). The passes see their external buffers where their own
//! captures provided them.

use super::super::external::Provided;
use super::super::grads::{enqueue_destinations, enqueue_sums};
use super::run::{Call, GraphOf, Runner, ViewBuffers};
use super::steps::Sequence;
use crate::backend::{DevPtr, Graph};
use crate::error::Result;

impl Runner<'_> {
    /// Records a sequence of passes back to back into one graph, each grad
    /// pass followed by its COPY_INTO and ACCUMULATE_INTO returns; an
    /// instance with a block (`block(instance)`) writes its CLONE grads
    /// there. Over several microbatches, the passes run once per
    /// microbatch in turn (the scratch arena laid out again for each), with
    /// the copies in before the pass that reads them and the copies out
    /// after the pass that writes them; from the second microbatch on, the
    /// grads are added to the first's (`enqueue_sums`).
    pub(super) fn record_unrolled(
        &mut self,
        seq: &Sequence,
        block: &dyn Fn(usize) -> Option<DevPtr>,
        slot: u32,
        iteration: u32,
    ) -> Result<Box<dyn Graph>> {
        self.scratch.restart();
        let backend = self.s.backend.clone();
        let first = GraphOf::Step(seq.step, Some(0));
        self.begin(seq.passes[0], first)?;
        let (mut ran, mut enqueued, mut collected) = (Ok(()), Ok(()), Ok(()));
        let (mut last, mut graph) = (seq.passes[0], first);
        let mut acc = Vec::new();
        'microbatches: for mb in 0..seq.microbatches {
            if mb > 0 {
                self.scratch.restart();
            }
            let call = Call::in_step(seq.step, iteration, (mb, seq.microbatches), 0);
            for &p in seq.passes {
                (last, graph) = (p, call.graph);
                let inst = &self.placed[p.instance];
                let copies = |before: bool| -> Result<()> {
                    for c in seq.io {
                        c.enqueue(backend.as_ref(), p, before, mb, self.stream)?;
                    }
                    Ok(())
                };
                enqueued = copies(true);
                if enqueued.is_err() {
                    break 'microbatches;
                }
                let context = self.context(p, "the capture of a step");
                // Under capture every callback gets ctx->capture; in a step
                // its external buffers are already provided (the view holds
                // them), so it refuses any.
                let provided = Provided::in_step(seq.step, context.clone());
                self.scratch
                    .set_context(context, self.placed[p.instance].callable);
                // The first microbatch writes CLONE grads straight into the
                // block; later ones into the static buffers, added after.
                let into = block(p.instance).filter(|_| mb == 0);
                let grads = into.map(|b| inst.param_grads_into(b));
                let bufs = ViewBuffers::of(inst, grads);
                let view = self.view(&bufs, p, &call, Some(self.scratch), Some(&provided));
                ran = self.s.callables[inst.callable].callbacks.run(&view);
                // A failed callback, or an invalidated capture, ends the
                // sequence: the passes after it would only be discarded. (No
                // `?` before the capture ends: a failed query just goes on.)
                if ran.is_err() || matches!(backend.capture_invalidated(self.stream), Ok(true)) {
                    break 'microbatches;
                }
                enqueued = copies(false);
                if enqueued.is_ok() && p.kind == inst.grad_pass() {
                    let dst = seq.dsts_of(p.instance);
                    enqueued = match mb {
                        0 => enqueue_destinations(
                            backend.as_ref(),
                            inst,
                            dst,
                            |_| false,
                            &mut acc,
                            self.stream,
                        ),
                        _ => {
                            let b = block(p.instance);
                            enqueue_sums(backend.as_ref(), inst, dst, b, &mut acc, self.stream)
                        }
                    };
                }
                if enqueued.is_err() {
                    break 'microbatches;
                }
                // The last microbatch's grads of this callable are final.
                if mb + 1 == seq.microbatches && p.kind == inst.grad_pass() {
                    collected = self.record_collective(seq, block, slot, Some(p.instance));
                    if collected.is_err() {
                        break 'microbatches;
                    }
                }
            }
        }
        // The collectives and the update, once every pass is recorded and
        // the capture intact.
        let attempted = (seq.update.is_some() || seq.collective.is_some())
            && ran.is_ok()
            && enqueued.is_ok()
            && collected.is_ok()
            && matches!(backend.capture_invalidated(self.stream), Ok(false));
        let updated = match attempted {
            true => self.record_tail(seq, block, slot),
            false => Ok(()),
        };
        let ended = backend.end_capture(self.stream);
        // A collective's own error stands over the capture's end.
        if let Err(e) = collected {
            drop(ended);
            return Err(e);
        }
        let ended = self.update_ended(seq, attempted, updated, ended)?;
        let g = self.finish(last, graph, ran, ended)?;
        enqueued?;
        Ok(g)
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::spec::{Looping, StepIo};
    use super::super::super::testing::{external_step, floats, read_floats, BYTES, N};
    use super::super::capture;
    use crate::backend::{DevPtr, DeviceMemory, StreamRef};
    use crate::core::layout::Role;
    use crate::core::PassKind;
    use crate::error::Error;

    #[test]
    fn a_step_writes_external_buffers_where_their_passes_provided_them() {
        let (mut f, dst) = external_step(false);
        let log = f.external(0, false);
        let (cap, _) = capture(&f.inputs(), 1).unwrap();
        let a = &cap.instances[0];
        let (out, grad) = (a.outputs[0].ptr, a.param_grads[0].ptr);
        let writes = log.lock().unwrap().writes.clone();
        // a's own forward and backward provided them; each slot graph of
        // the step was handed them and wrote there.
        let own = [
            (PassKind::Forward, out, false),
            (PassKind::Backward, grad, false),
        ];
        assert_eq!(writes[..2], own[..]);
        let step = [
            (PassKind::Forward, out, true),
            (PassKind::Backward, grad, true),
        ];
        assert_eq!(writes[2..], [step, step].concat()[..], "{writes:x?}");
        let st = &cap.steps[0];
        assert_eq!(st.slots.len(), 2, "b's CLONE grads take the slots");
        let backend = f.backend.as_ref();
        let s = StreamRef(0);
        backend.upload(a.inputs[0].ptr, &floats(1.0)).unwrap();
        // The per-pass replays.
        backend.upload(a.grad_outputs[0].ptr, &floats(2.0)).unwrap();
        a.graph(PassKind::Forward).unwrap().launch(s).unwrap();
        a.graph(PassKind::Backward).unwrap().launch(s).unwrap();
        let per_pass = (read_floats(backend, out), read_floats(backend, grad));
        assert_eq!(per_pass, (vec![1.0; N], vec![2.0; N]));
        // The step, after the buffers were cleared.
        for p in [out, grad] {
            backend.upload(p, &floats(0.0)).unwrap();
        }
        st.slots[1].launch(s).unwrap();
        assert_eq!(read_floats(backend, out), per_pass.0);
        assert_eq!(read_floats(backend, grad), per_pass.1);
        assert_eq!(
            read_floats(backend, dst.ptr()),
            per_pass.1,
            "COPY_INTO read it"
        );
    }

    #[test]
    fn step_io_reads_and_writes_external_buffers_unrolled_and_looped() {
        for looping in [Looping::Unrolled, Looping::Device] {
            let (mut f, dst) = external_step(false);
            let backend = f.backend.clone();
            let xs = DeviceMemory::new(&backend, 2 * BYTES).unwrap();
            let ys = DeviceMemory::new(&backend, 2 * BYTES).unwrap();
            let gs = DeviceMemory::new(&backend, 2 * BYTES).unwrap();
            backend
                .upload(xs.ptr(), &[floats(1.0), floats(3.0)].concat())
                .unwrap();
            backend
                .upload(gs.ptr(), &[floats(2.0), floats(5.0)].concat())
                .unwrap();
            let io = |role, ptr| StepIo {
                callable: 0,
                role,
                index: 0,
                ptr,
                stride: BYTES,
            };
            let st = &mut f.steps[0];
            st.microbatches = 2;
            st.looping = looping;
            st.io = vec![
                io(Role::Input, xs.ptr()),
                io(Role::Output, ys.ptr()),
                io(Role::GradOutput, gs.ptr()),
            ];
            let (cap, _) = capture(&f.inputs(), 1).unwrap();
            cap.steps[0].slots[0].launch(StreamRef(0)).unwrap();
            let b = backend.as_ref();
            let out = cap.instances[0].outputs[0].ptr;
            assert_eq!(read_floats(b, ys.ptr()), vec![1.0; N], "{looping:?}");
            assert_eq!(read_floats(b, ys.ptr() + BYTES as DevPtr), vec![3.0; N]);
            assert_eq!(read_floats(b, out), vec![3.0; N], "the external output");
            assert_eq!(
                read_floats(b, dst.ptr()),
                vec![7.0; N],
                "{looping:?}: 2 + 5"
            );
        }
    }

    #[test]
    fn providing_a_buffer_again_in_a_step_is_refused_saying_where_it_is() {
        let (mut f, _dst) = external_step(true);
        let log = f.external(0, true);
        let err = capture(&f.inputs(), 1).err().unwrap();
        assert!(
            matches!(err, Error::CallbackFailed { code: 3, .. }),
            "{err}"
        );
        let refusals = log.lock().unwrap().refusals.clone();
        assert_eq!(refusals.len(), 1, "{refusals:?}");
        let r = &refusals[0];
        for words in [
            "the forward callback of callable 'a'",
            "output 0 cannot be provided in the capture of step 0",
            "where the pass's own capture provided them (ctx->outputs",
            "write the results there",
        ] {
            assert!(r.contains(words), "{r}");
        }
    }
}
