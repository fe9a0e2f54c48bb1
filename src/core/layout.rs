//! The static buffers of a session and where they live: the logical buffers
//! each captured instance needs (static inputs, outputs, grad-outputs,
//! grad-inputs and one parameter-grad slab), the slot layout inside each
//! slab, and their placement in the session's one static allocation.
//!
//! All parameter-grad slots of an instance share one contiguous slab, and
//! the CLONE slots come first in it, so that returning every cloned grad of
//! a backward costs one copy of one span.

use super::policy::GradPolicy;
use super::size;
use crate::error::{Error, Result};

/// What a logical buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Input,
    Output,
    GradOutput,
    GradInput,
    /// One entry per parameter: its slot in the parameter-grad slab.
    ParamGrads,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Input => "input",
            Role::Output => "output",
            Role::GradOutput => "grad-output",
            Role::GradInput => "grad-input",
            Role::ParamGrads => "param-grad slab",
        }
    }
}

/// One logical static buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferDesc {
    /// Index of the captured instance (callable x microbatch) it belongs to.
    pub instance: usize,
    pub role: Role,
    /// Index of the input/output it is for (0 for the slab).
    pub index: usize,
    pub bytes: usize,
}

/// A static input or output as the layout sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TensorShape {
    pub bytes: usize,
    pub requires_grad: bool,
    /// The buffer this callable writes for the tensor (its output, or its
    /// grad for an input) is provided by the callback at capture: the
    /// library places nothing for it.
    pub external: bool,
    /// Inputs only: this input is output `.1` of instance `.0` (an earlier
    /// instance): it has no buffer of its own but that output's, and its
    /// grad-input is that output's grad-output.
    pub chained: Option<(usize, usize)>,
}

/// A parameter's gradient slot as the layout sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamShape {
    pub bytes: usize,
    pub policy: GradPolicy,
    /// Provided by the callback at capture (not in the slab).
    pub external: bool,
}

/// Sizes and flags of one instance, as the layout needs them.
#[derive(Clone, Debug, Default)]
pub struct InstanceShape {
    pub inputs: Vec<TensorShape>,
    pub outputs: Vec<TensorShape>,
    /// Per parameter: None without a gradient.
    pub params: Vec<Option<ParamShape>>,
}

/// One parameter's slot in its slab; offset from the slab's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlabSlot {
    pub offset: usize,
    pub bytes: usize,
    pub policy: GradPolicy,
}

/// The slot layout of one instance's parameter-grad slab.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Slab {
    pub bytes: usize,
    /// One entry per parameter, None where the parameter takes no gradient.
    pub slots: Vec<Option<SlabSlot>>,
    /// The span [start, end) covering every CLONE slot: one copy returns them all.
    pub clone_span: Option<(usize, usize)>,
}

/// Policy order inside a slab: CLONE first (so clones form one span), then
/// the others.
fn group(p: GradPolicy) -> u8 {
    match p {
        GradPolicy::Clone => 0,
        GradPolicy::Alias => 1,
        GradPolicy::CopyInto => 2,
        GradPolicy::AccumulateInto => 3,
        GradPolicy::Default => 4,
    }
}

/// Lays out one slab: slots grouped by policy (CLONE first), in registration
/// order within a group, each aligned. External slots are not in the slab.
pub fn slab_layout(params: &[Option<ParamShape>]) -> Result<Slab> {
    let params: Vec<Option<(usize, GradPolicy)>> = params
        .iter()
        .map(|p| p.filter(|p| !p.external).map(|p| (p.bytes, p.policy)))
        .collect();
    let mut order: Vec<usize> = (0..params.len()).filter(|&i| params[i].is_some()).collect();
    order.sort_by_key(|&i| (params[i].map(|(_, p)| group(p)), i));
    let mut slots = vec![None; params.len()];
    let mut offset = 0;
    let mut clone_span: Option<(usize, usize)> = None;
    for i in order {
        let Some((bytes, policy)) = params[i] else {
            continue;
        };
        slots[i] = Some(SlabSlot {
            offset,
            bytes,
            policy,
        });
        const WHAT: &str = "a parameter-grad slab";
        if policy == GradPolicy::Clone {
            let start = clone_span.map_or(offset, |(s, _)| s);
            clone_span = Some((start, size::add(offset, bytes, WHAT)?));
        }
        offset = size::add(offset, size::aligned(bytes, WHAT)?, WHAT)?;
    }
    Ok(Slab {
        bytes: offset,
        slots,
        clone_span,
    })
}

/// Where the CLONE grads of one replay go in their block: the slab's clone
/// span first (one copy), then each external CLONE slot (one copy each).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CloneLayout {
    pub bytes: usize,
    /// The slab span [start, end), copied to block offset 0.
    pub span: Option<(usize, usize)>,
    /// (parameter, block offset) of each external CLONE slot.
    pub external: Vec<(usize, usize)>,
    /// Block offset of each parameter's clone (None: not CLONE).
    pub offsets: Vec<Option<usize>>,
    /// How many grads the block holds (references handed out).
    pub count: usize,
}

pub fn clone_layout(slab: &Slab, params: &[Option<ParamShape>]) -> Result<CloneLayout> {
    const WHAT: &str = "a block of returned clones";
    let span = slab.clone_span;
    let mut bytes = match span {
        Some((a, b)) => size::aligned(b - a, WHAT)?,
        None => 0,
    };
    let mut offsets = vec![None; params.len()];
    let mut external = Vec::new();
    for (i, p) in params.iter().enumerate() {
        match (p, slab.slots.get(i).copied().flatten()) {
            (Some(p), _) if p.policy == GradPolicy::Clone && p.external => {
                offsets[i] = Some(bytes);
                external.push((i, bytes));
                bytes = size::add(bytes, size::aligned(p.bytes, WHAT)?, WHAT)?;
            }
            (_, Some(slot)) if slot.policy == GradPolicy::Clone => {
                offsets[i] = span.map(|(a, _)| slot.offset - a);
            }
            _ => {}
        }
    }
    let count = offsets.iter().flatten().count();
    Ok(CloneLayout {
        bytes,
        span,
        external,
        offsets,
        count,
    })
}

/// The logical buffers of one instance, by id into `Layout::buffers`
/// (None where there is none, or where the callback provides it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InstanceBuffers {
    pub inputs: Vec<usize>,
    pub outputs: Vec<Option<usize>>,
    pub grad_outputs: Vec<Option<usize>>,
    pub grad_inputs: Vec<Option<usize>>,
    pub slab: Option<usize>,
    pub slab_layout: Slab,
}

/// A buffer also used by an instance other than its owner: a chained
/// input (the producer's output) or its grad (the producer's grad-output).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedUse {
    pub buffer: usize,
    pub instance: usize,
    pub role: Role,
}

/// Every logical static buffer of a session.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    pub buffers: Vec<BufferDesc>,
    pub instances: Vec<InstanceBuffers>,
    /// Uses of buffers by instances other than their owners (chaining).
    pub shared: Vec<SharedUse>,
}

/// The logical buffers of a list of instances. A chained input takes its
/// producer's output buffer (and its grad-input the producer's grad-output)
/// instead of a buffer of its own; producers come before their consumers
/// and their shapes agree (checked at registration).
pub fn layout(shapes: &[InstanceShape]) -> Result<Layout> {
    let mut buffers = Vec::new();
    let mut shared = Vec::new();
    let mut add = |instance, role, index, bytes| {
        buffers.push(BufferDesc {
            instance,
            role,
            index,
            bytes,
        });
        buffers.len() - 1
    };
    let mut instances: Vec<InstanceBuffers> = Vec::with_capacity(shapes.len());
    let producer = |instances: &[InstanceBuffers], (p, j): (usize, usize), grad: bool| {
        let b = instances.get(p).and_then(|ib| {
            if grad {
                ib.grad_outputs.get(j).copied().flatten()
            } else {
                ib.outputs.get(j).copied().flatten()
            }
        });
        b.ok_or_else(|| {
            Error::Internal(format!(
                "a chained input names {} {j} of instance {p}, which has no such buffer",
                if grad { "grad-output" } else { "output" }
            ))
        })
    };
    for (n, s) in shapes.iter().enumerate() {
        let mut inputs = Vec::with_capacity(s.inputs.len());
        for (i, t) in s.inputs.iter().enumerate() {
            inputs.push(match t.chained {
                Some(src) => {
                    let b = producer(&instances, src, false)?;
                    shared.push(SharedUse {
                        buffer: b,
                        instance: n,
                        role: Role::Input,
                    });
                    b
                }
                None => add(n, Role::Input, i, t.bytes),
            });
        }
        let outputs = s
            .outputs
            .iter()
            .enumerate()
            .map(|(i, t)| (!t.external).then(|| add(n, Role::Output, i, t.bytes)))
            .collect();
        let grad_outputs = s
            .outputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.requires_grad
                    .then(|| add(n, Role::GradOutput, i, t.bytes))
            })
            .collect();
        let mut grad_inputs = Vec::with_capacity(s.inputs.len());
        for (i, t) in s.inputs.iter().enumerate() {
            grad_inputs.push(match (t.requires_grad && !t.external, t.chained) {
                (false, _) => None,
                (true, Some(src)) => {
                    let b = producer(&instances, src, true)?;
                    shared.push(SharedUse {
                        buffer: b,
                        instance: n,
                        role: Role::GradInput,
                    });
                    Some(b)
                }
                (true, None) => Some(add(n, Role::GradInput, i, t.bytes)),
            });
        }
        let slab_layout = slab_layout(&s.params)?;
        let slab = (slab_layout.bytes > 0).then(|| add(n, Role::ParamGrads, 0, slab_layout.bytes));
        instances.push(InstanceBuffers {
            inputs,
            outputs,
            grad_outputs,
            grad_inputs,
            slab,
            slab_layout,
        });
    }
    Ok(Layout {
        buffers,
        instances,
        shared,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use GradPolicy::*;
    const MAXB: usize = crate::core::size::MAX_BYTES;

    fn p(bytes: usize, policy: GradPolicy) -> Option<ParamShape> {
        Some(ParamShape {
            bytes,
            policy,
            external: false,
        })
    }

    fn t(bytes: usize, requires_grad: bool) -> TensorShape {
        TensorShape {
            bytes,
            requires_grad,
            external: false,
            chained: None,
        }
    }

    #[test]
    fn clone_slots_come_first_and_form_one_span() {
        let params = [
            p(100, Alias),
            p(512, Clone),
            None,
            p(300, Clone),
            p(64, AccumulateInto),
        ];
        let slab = slab_layout(&params).unwrap();
        let s = |i: usize| slab.slots[i].unwrap();
        assert_eq!(s(1).offset, 0);
        assert_eq!(s(3).offset, 512);
        assert_eq!(slab.clone_span, Some((0, 512 + 300)));
        assert_eq!(s(0).offset, 512 + 512);
        assert_eq!(s(4).offset, 512 + 512 + 256);
        assert!(slab.slots[2].is_none());
        assert_eq!(slab.bytes, 512 + 512 + 256 + 256);
        for slot in slab.slots.iter().flatten() {
            assert_eq!(slot.offset % crate::core::ALIGN, 0);
        }
    }

    #[test]
    fn no_clone_slots_no_span() {
        let slab = slab_layout(&[p(8, Alias), p(8, CopyInto)]).unwrap();
        assert_eq!(slab.clone_span, None);
        assert_eq!(slab_layout(&[]).unwrap().bytes, 0);
    }

    #[test]
    fn slots_never_overlap() {
        let params: Vec<_> = (0..40)
            .map(|i| match i % 5 {
                0 => None,
                1 => p(i * 37 + 1, Clone),
                2 => p(i * 11 + 3, Alias),
                3 => p(i * 5 + 7, CopyInto),
                _ => p(i * 3 + 2, Clone),
            })
            .collect();
        let slab = slab_layout(&params).unwrap();
        let mut spans: Vec<_> = slab
            .slots
            .iter()
            .flatten()
            .map(|s| (s.offset, s.offset + s.bytes))
            .collect();
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "{w:?} overlap");
        }
        let (a, b) = slab.clone_span.unwrap();
        let clones: usize = slab
            .slots
            .iter()
            .flatten()
            .filter(|s| s.policy == Clone)
            .count();
        let inside = slab
            .slots
            .iter()
            .flatten()
            .filter(|s| s.offset >= a && s.offset + s.bytes <= b)
            .count();
        assert_eq!(
            clones, inside,
            "the clone span holds exactly the clone slots"
        );
    }

    #[test]
    fn clone_layout_puts_the_span_first_then_external_slots() {
        let ext = |bytes, policy| {
            Some(ParamShape {
                bytes,
                policy,
                external: true,
            })
        };
        let params = [
            p(512, Clone),
            ext(100, Clone),
            p(64, Alias),
            ext(64, Alias),
            p(300, Clone),
        ];
        let slab = slab_layout(&params).unwrap();
        let c = clone_layout(&slab, &params).unwrap();
        assert_eq!(c.span, Some((0, 512 + 300)));
        assert_eq!(c.offsets, vec![Some(0), Some(1024), None, None, Some(512)]);
        assert_eq!(c.external, vec![(1, 1024)]);
        assert_eq!(c.bytes, 1024 + 256);
        assert_eq!(c.count, 3);
        let none = clone_layout(&slab_layout(&[p(8, Alias)]).unwrap(), &[p(8, Alias)]).unwrap();
        assert_eq!((none.bytes, none.count, none.span), (0, 0, None));
    }

    #[test]
    fn external_buffers_are_not_placed() {
        let ext = |bytes| TensorShape {
            bytes,
            requires_grad: true,
            external: true,
            chained: None,
        };
        let shape = InstanceShape {
            inputs: vec![ext(64)],
            outputs: vec![ext(128)],
            params: vec![
                Some(ParamShape {
                    bytes: 256,
                    policy: Clone,
                    external: true,
                }),
                p(512, Clone),
            ],
        };
        let l = layout(&[shape]).unwrap();
        let i = &l.instances[0];
        assert_eq!(i.outputs, vec![None], "the callback provides the output");
        assert_eq!(i.grad_inputs, vec![None], "and the input's grad");
        assert!(
            i.grad_outputs[0].is_some(),
            "the grad-output is still the library's"
        );
        assert!(i.slab_layout.slots[0].is_none());
        assert_eq!(i.slab_layout.slots[1].unwrap().offset, 0);
        assert_eq!(l.buffers.len(), 3, "input, grad-output, slab");
    }

    #[test]
    fn chained_inputs_share_the_producers_buffers() {
        let a = InstanceShape {
            inputs: vec![t(64, false)],
            outputs: vec![t(128, true)],
            params: vec![],
        };
        let mut b = a.clone();
        b.inputs = vec![TensorShape {
            chained: Some((0, 0)),
            ..t(128, true)
        }];
        let l = layout(&[a, b]).unwrap();
        let (ia, ib) = (&l.instances[0], &l.instances[1]);
        assert_eq!(
            ib.inputs[0],
            ia.outputs[0].unwrap(),
            "b reads a's output in place"
        );
        assert_eq!(
            ib.grad_inputs[0], ia.grad_outputs[0],
            "a's backward reads b's input grad in place"
        );
        // a: input, output, grad-output; b: output, grad-output.
        assert_eq!(l.buffers.len(), 5);
        assert_eq!(l.shared.len(), 2);
        assert!(l.shared.iter().all(|u| u.instance == 1));
    }

    #[test]
    fn sizes_that_would_wrap_are_refused() {
        let big = MAXB;
        let shape = InstanceShape {
            inputs: vec![],
            outputs: vec![],
            params: (0..70_000).map(|_| p(big, Clone)).collect(),
        };
        let e = layout(&[shape]).unwrap_err();
        assert!(matches!(e, crate::error::Error::OutOfMemory(_)), "{e}");
        assert!(e.to_string().contains("slab"), "{e}");
    }

    #[test]
    fn layout_creates_buffers_for_grads_only_where_needed() {
        let shape = InstanceShape {
            inputs: vec![t(64, true), t(32, false)],
            outputs: vec![t(128, true), t(16, false)],
            params: vec![p(256, Clone)],
        };
        let l = layout(&[shape.clone(), shape]).unwrap();
        assert_eq!(l.instances.len(), 2);
        let i0 = &l.instances[0];
        assert_eq!(i0.grad_inputs[1], None);
        assert!(i0.grad_inputs[0].is_some());
        assert_eq!(i0.grad_outputs[1], None);
        assert!(i0.outputs.iter().all(|o| o.is_some()));
        assert_eq!(l.buffers.len(), 2 * (2 + 2 + 1 + 1 + 1));
        let p = crate::core::plan::disjoint(&l.buffers).unwrap();
        for (i, b) in l.buffers.iter().enumerate() {
            for (j, c) in l.buffers.iter().enumerate() {
                if i < j {
                    let (a0, a1) = (p.offsets[i], p.offsets[i] + b.bytes);
                    let (b0, b1) = (p.offsets[j], p.offsets[j] + c.bytes);
                    assert!(a1 <= b0 || b1 <= a0);
                }
            }
        }
    }
}
