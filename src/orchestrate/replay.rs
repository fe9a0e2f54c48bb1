//! Replay: copy new data into the static buffers (skipped where the caller
//! passes the static buffer itself), launch the graph on the caller's stream
//! (or on a side stream synced back by events), and return outputs and
//! grads. Everything that can be refused is checked before anything is
//! enqueued, and results are staged in vectors the session reuses, so the
//! steady-state path does no host allocation beyond one clone block.

use crate::backend::{AccItem, Backend, DevPtr, EventRef, Graph, MemCounters};
use crate::core::lease::Leases;
use crate::core::policy::GradPolicy;
use crate::error::{Error, Result};
use std::sync::Arc;

use super::returned::{publish, GradBlock, RefKind, Returned};
use super::session::{Captured, Instance, Session, State};
use super::spec::{CallableSpec, CloneAllocator, ReplayArgs};

/// The borrowed pieces of a captured session that one replay needs.
struct Replay<'a> {
    backend: &'a Arc<dyn Backend>,
    allocator: &'a Option<Arc<dyn CloneAllocator>>,
    counters: &'a Arc<MemCounters>,
    strict: bool,
    spec: &'a CallableSpec,
    inst: &'a Instance,
    leases: &'a mut Leases,
    stage_a: &'a mut Vec<Returned>,
    stage_b: &'a mut Vec<Returned>,
    stage_acc: &'a mut Vec<AccItem>,
    ev_in: EventRef,
    ev_out: EventRef,
}

impl Session {
    fn replay_parts(&mut self, a: &ReplayArgs) -> Result<Replay<'_>> {
        self.captured()?;
        let Session {
            backend,
            opts,
            callables,
            state,
            counters,
            ..
        } = self;
        let State::Captured(cap) = state else {
            return Err(Error::Internal("state changed".into()));
        };
        let idx = cap.instance_index(a.callable, a.microbatch)?;
        let Captured {
            instances,
            leases,
            stage_a,
            stage_b,
            stage_acc,
            ev_in,
            ev_out,
            ..
        } = &mut **cap;
        let inst = &instances[idx];
        Ok(Replay {
            backend,
            allocator: &opts.allocator,
            counters,
            strict: opts.strict_leases,
            spec: &callables[inst.callable],
            inst,
            leases,
            stage_a,
            stage_b,
            stage_acc,
            ev_in: *ev_in,
            ev_out: *ev_out,
        })
    }

    /// Replays the forward graph of (callable, microbatch) and returns the
    /// static outputs: aliases, valid until the next forward replay of the
    /// same instance.
    pub fn forward(&mut self, a: &ReplayArgs) -> Result<&[Returned]> {
        let mut r = self.replay_parts(a)?;
        let (inst, spec) = (r.inst, r.spec);
        check_data(a.data, inst.inputs.len(), |_| true, "inputs", spec)?;
        if r.strict {
            r.leases
                .check_free(&inst.check_fwd, || describe("forward", spec, inst))?;
        }
        let graph = graph(&inst.fwd, "forward", spec)?;
        let sizes = spec.inputs.iter().map(|t| t.bytes);
        r.run(a, inst.inputs.iter().copied().zip(sizes), graph, None)?;
        r.stage_a.clear();
        for (i, (&ptr, t)) in inst.outputs.iter().zip(&spec.outputs).enumerate() {
            let lease = if r.strict {
                r.leases.acquire(inst.lease_out[i])
            } else {
                0
            };
            r.stage_a.push(Returned {
                ptr,
                bytes: t.bytes,
                kind: RefKind::Alias,
                owner: 0,
                lease,
            });
        }
        Ok(r.stage_a)
    }

    /// Replays the backward graph; returns the input grads (aliases, valid
    /// until the next backward replay of the same instance) and the
    /// parameter grads per their frozen policies (all `None` when the
    /// callable has a weight-grad graph: `wgrad` returns them).
    pub fn backward(&mut self, a: &ReplayArgs) -> Result<(&[Returned], &[Returned])> {
        let mut r = self.replay_parts(a)?;
        let (inst, spec) = (r.inst, r.spec);
        let gout = &inst.grad_outputs;
        check_data(a.data, gout.len(), |i| gout[i] != 0, "grad_outputs", spec)?;
        let returns_params = !inst.has_wgrad();
        if returns_params {
            check_dsts(a.param_dsts, inst, spec)?;
        }
        if r.strict {
            r.leases
                .check_free(&inst.check_bwd, || describe("backward", spec, inst))?;
        }
        let graph = graph(&inst.bwd, "backward", spec)?;
        let sizes = spec.outputs.iter().map(|t| t.bytes);
        let block = r.run(
            a,
            gout.iter().copied().zip(sizes),
            graph,
            returns_params.then_some(a.param_dsts),
        )?;
        r.stage_a.clear();
        for (i, (&ptr, t)) in inst.grad_inputs.iter().zip(&spec.inputs).enumerate() {
            r.stage_a.push(if ptr == 0 {
                Returned::default()
            } else {
                let lease = match (r.strict, inst.lease_gin.get(i)) {
                    (true, Some(Some(slot))) => r.leases.acquire(*slot),
                    _ => 0,
                };
                Returned {
                    ptr,
                    bytes: t.bytes,
                    kind: RefKind::Alias,
                    owner: 0,
                    lease,
                }
            });
        }
        r.stage_b.clear();
        if returns_params {
            stage_params(inst, a.param_dsts, block, r.leases, r.strict, r.stage_b);
        } else {
            r.stage_b.resize(inst.policies.len(), Returned::default());
        }
        Ok((r.stage_a, r.stage_b))
    }

    /// Replays the weight-grad graph of a callable registered with a
    /// weight-grad callback; returns its parameter grads per policy.
    pub fn wgrad(&mut self, a: &ReplayArgs) -> Result<&[Returned]> {
        let mut r = self.replay_parts(a)?;
        let (inst, spec) = (r.inst, r.spec);
        if !inst.has_wgrad() {
            return Err(Error::invalid(format!(
                "callable '{}' has no weight-grad callback: its parameter grads are returned by backward",
                spec.name
            )));
        }
        if a.data.is_some() {
            return Err(Error::invalid(
                "a weight-grad replay takes no data: pass NULL",
            ));
        }
        check_dsts(a.param_dsts, inst, spec)?;
        if r.strict {
            r.leases
                .check_free(&inst.check_wgrad, || describe("weight-grad", spec, inst))?;
        }
        let graph = graph(&inst.wgrad, "weight-grad", spec)?;
        let block = r.run(a, std::iter::empty(), graph, Some(a.param_dsts))?;
        r.stage_b.clear();
        stage_params(inst, a.param_dsts, block, r.leases, r.strict, r.stage_b);
        Ok(r.stage_b)
    }
}

impl Replay<'_> {
    /// Enqueues one replay: copy-ins, the graph, and (when `params` is
    /// given) the parameter grads' return. Returns the published clone
    /// block (handle and device pointer; 0 for none). The clone block is allocated before the
    /// graph is launched, so an allocation failure launches nothing.
    fn run(
        &mut self,
        a: &ReplayArgs,
        copies: impl Iterator<Item = (DevPtr, usize)>,
        graph: &dyn Graph,
        params: Option<Option<&[DevPtr]>>,
    ) -> Result<(usize, DevPtr)> {
        let backend = self.backend.as_ref();
        let inst = self.inst;
        let _ctx = backend.bind()?;
        let s = match a.side_stream {
            Some(side) => {
                backend.record_event(self.ev_in, a.stream)?;
                backend.wait_event(side, self.ev_in)?;
                side
            }
            None => a.stream,
        };
        let clone = &inst.clone;
        let mut block = if params.is_some() && clone.count > 0 {
            Some(GradBlock::alloc(
                self.backend,
                self.allocator,
                self.counters,
                clone.bytes,
                s,
            )?)
        } else {
            None
        };
        if let Some(data) = a.data {
            // Entries with no static buffer (dst 0) take no data.
            for ((dst, bytes), &src) in copies.zip(data) {
                if dst != 0 && src != 0 {
                    backend.copy(dst, src, bytes, s)?;
                }
            }
        }
        graph.launch(s)?;
        if let Some(dsts) = params {
            if let Some(b) = &block {
                // The slab's CLONE span in one copy, then any external CLONE slot.
                if let Some((start, end)) = clone.span {
                    backend.copy(b.ptr, inst.slab_base + start as DevPtr, end - start, s)?;
                }
                for &(i, offset) in &clone.external {
                    backend.copy(
                        b.ptr + offset as DevPtr,
                        inst.param_grads[i],
                        inst.param_bytes[i],
                        s,
                    )?;
                }
            }
            // check_dsts made sure these have destinations.
            let dst = |i: usize| dsts.map_or(0, |d| d[i]);
            for &i in &inst.destinations.copy_into {
                backend.copy(dst(i), inst.param_grads[i], inst.param_bytes[i], s)?;
            }
            // ACCUMULATE_INTO slots: one batched launch per dtype.
            for (dtype, params) in &inst.destinations.accumulate {
                self.stage_acc.clear();
                self.stage_acc.extend(params.iter().map(|&i| AccItem {
                    dst: dst(i),
                    src: inst.param_grads[i],
                    count: inst.param_bytes[i] / dtype.size(),
                }));
                backend.accumulate_batch(self.stage_acc, *dtype, s)?;
            }
        }
        if let Some(side) = a.side_stream {
            backend.record_event(self.ev_out, side)?;
            backend.wait_event(a.stream, self.ev_out)?;
        }
        Ok(match block.take() {
            Some(mut b) => {
                b.set_stream(a.stream);
                let ptr = b.ptr;
                (publish(b, clone.count), ptr)
            }
            None => (0, 0),
        })
    }
}

/// Stages the parameter grads of a backward or weight-grad replay.
fn stage_params(
    inst: &Instance,
    dsts: Option<&[DevPtr]>,
    (block, block_ptr): (usize, DevPtr),
    leases: &mut Leases,
    strict: bool,
    out: &mut Vec<Returned>,
) {
    for (i, pol) in inst.policies.iter().enumerate() {
        let bytes = inst.param_bytes[i];
        let dst = dsts.map_or(0, |d| d[i]);
        out.push(match pol {
            None | Some(GradPolicy::Default) => Returned::default(),
            Some(GradPolicy::Clone) => Returned {
                ptr: block_ptr + inst.clone.offsets[i].unwrap_or(0) as DevPtr,
                bytes,
                kind: RefKind::Clone,
                owner: block,
                lease: 0,
            },
            Some(GradPolicy::Alias) => {
                let lease = match (strict, inst.lease_param.get(i)) {
                    (true, Some(Some(l))) => leases.acquire(*l),
                    _ => 0,
                };
                Returned {
                    ptr: inst.param_grads[i],
                    bytes,
                    kind: RefKind::Alias,
                    owner: 0,
                    lease,
                }
            }
            Some(GradPolicy::CopyInto) => Returned {
                ptr: dst,
                bytes,
                kind: RefKind::CopyInto,
                owner: 0,
                lease: 0,
            },
            Some(GradPolicy::AccumulateInto) => Returned {
                ptr: dst,
                bytes,
                kind: RefKind::AccumulateInto,
                owner: 0,
                lease: 0,
            },
        });
    }
}

fn graph<'a>(
    g: &'a Option<Box<dyn Graph>>,
    what: &str,
    spec: &CallableSpec,
) -> Result<&'a dyn Graph> {
    g.as_deref().ok_or_else(|| {
        Error::Internal(format!(
            "the {what} graph of callable '{}' is missing",
            spec.name
        ))
    })
}

fn describe(what: &str, spec: &CallableSpec, inst: &Instance) -> String {
    format!(
        "the {what} replay of callable '{}' (microbatch {})",
        spec.name, inst.microbatch
    )
}

/// Checks a copy-in array: the right length, and no NULL where a buffer
/// needs data (`needed`).
fn check_data(
    data: Option<&[DevPtr]>,
    expected: usize,
    needed: impl Fn(usize) -> bool,
    what: &str,
    spec: &CallableSpec,
) -> Result<()> {
    let Some(d) = data else { return Ok(()) };
    if d.len() != expected {
        return Err(Error::invalid(format!(
            "{} {what} were passed; callable '{}' has {expected}",
            d.len(),
            spec.name
        )));
    }
    if let Some(i) = (0..d.len()).find(|&i| d[i] == 0 && needed(i)) {
        return Err(Error::invalid(format!(
            "{what}[{i}] of callable '{}' is NULL (pass the whole {what} array as NULL to replay on what the \
             static buffers hold)",
            spec.name
        )));
    }
    Ok(())
}

/// Checks the destinations of COPY_INTO / ACCUMULATE_INTO slots.
fn check_dsts(dsts: Option<&[DevPtr]>, inst: &Instance, spec: &CallableSpec) -> Result<()> {
    let needs = |i: usize| inst.policies[i].is_some_and(|p| p.needs_destination());
    let n = inst.policies.len();
    match dsts {
        Some(d) if d.len() != n => Err(Error::invalid(format!(
            "{} param destinations were passed; callable '{}' has {n} parameters",
            d.len(),
            spec.name
        ))),
        Some(d) => match (0..d.len()).find(|&i| needs(i) && d[i] == 0) {
            Some(i) => Err(Error::invalid(format!(
                "param_dsts[{i}] of callable '{}' is NULL, but that parameter's grad policy ({}) needs a destination",
                spec.name,
                inst.policies[i].map_or("?", |p| p.name())
            ))),
            None => Ok(()),
        },
        None => match (0..n).find(|&i| needs(i)) {
            Some(i) => Err(Error::invalid(format!(
                "callable '{}' has parameters returned by COPY_INTO or ACCUMULATE_INTO (param {i}): pass param_dsts",
                spec.name
            ))),
            None => Ok(()),
        },
    }
}
