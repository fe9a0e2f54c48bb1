//! Clone slots: the pass that writes an instance's CLONE grads is captured
//! once more per slot, from the same scratch state and tape, with those
//! grads written straight into the slot's block. A replay that finds a
//! slot free launches that graph and hands the block out with no copy.

use super::super::instance::{PassRef, SlotGraph};
use super::super::scratch::Snapshot;
use super::super::spec::Phase;
use super::run::{Call, GraphOf, Runner};
use crate::error::Result;

/// Where a pass's capture started: the scratch arena and its tape.
pub(super) struct Start {
    arena: Snapshot,
    tape: usize,
}

impl Runner<'_> {
    /// How many clone slots pass `p` is captured for: the pass that writes
    /// the parameter grads of an instance with CLONE grads in a ring, when
    /// it neither provides external buffers nor returns external clones.
    pub fn slot_count(&self, p: PassRef) -> usize {
        let inst = &self.placed[p.instance];
        let eligible = p.kind == inst.grad_pass()
            && inst.ring.is_some()
            && inst.provided_by(p.kind).is_empty()
            && inst.returns.clone.external.is_empty();
        if eligible {
            self.s.opts.clone_slots as usize
        } else {
            0
        }
    }

    /// Where pass `p`'s capture starts, for its slot captures to start there
    /// too (a grad pass may consume the tape).
    pub fn start(&self, p: PassRef) -> Start {
        Start {
            arena: self.scratch.snapshot(),
            tape: self.tapes[p.instance].get(),
        }
    }

    /// Captures pass `p` again for each of `n` clone slots, from `start`,
    /// with its CLONE grads pointing into the slot's block; leaves the
    /// scratch arena and tape where the pass's own capture left them.
    pub fn capture_slots(
        &mut self,
        p: PassRef,
        iteration: u32,
        n: usize,
        start: Start,
    ) -> Result<Vec<SlotGraph>> {
        let Some(ring) = self.placed[p.instance].ring.clone() else {
            return Ok(Vec::new());
        };
        let after = (self.scratch.snapshot(), self.tapes[p.instance].get());
        let blocks = ring.add_slots(n, self.stream)?;
        let mut slots = Vec::with_capacity(n);
        for (k, block) in blocks.into_iter().enumerate() {
            let grads = self.placed[p.instance].param_grads_into(block);
            self.scratch.restore(start.arena.clone());
            self.tapes[p.instance].set(start.tape);
            // The slot captures repeat one capture: no hooks around them.
            let call = Call {
                phase: Phase::Capture,
                iteration,
                hooks: false,
                provide: false,
                param_grads: Some(&grads),
                step_microbatch: (0, 1),
                step_index: 0,
                graph: GraphOf::Slot(k),
            };
            if let Some(graph) = self.call(p, call)? {
                slots.push(SlotGraph { block, graph });
            }
        }
        self.scratch.restore(after.0);
        self.tapes[p.instance].set(after.1);
        Ok(slots)
    }
}
