//! A step's copies in and out resolved against placement (which static
//! buffer each names, refused where it is another callable's, does not
//! exist, or where the caller memory overlaps the session's buffers), and
//! what a step over several microbatches needs of its parameter grads.

use super::super::instance::{PassRef, Placed};
use super::super::spec::{CallableSpec, StepSpec};
use super::super::steps::region;
use super::super::tensor::{Feed, Place};
use crate::backend::{Backend, DevPtr, IndexedCopy, StreamRef};
use crate::core::dtype::DType;
use crate::core::layout::Role;
use crate::core::returns::ParamReturn;
use crate::core::strided::Strided;
use crate::core::PassKind;
use crate::error::{Error, Result};

/// One copy of a step's graph, per microbatch: between the static buffer
/// `buffer` of `instance` and block i of `caller`, before (copied in) or
/// after (copied out) its pass `kind`.
pub(crate) struct IoCopy {
    pub instance: usize,
    pub kind: PassKind,
    pub copied_in: bool,
    pub buffer: DevPtr,
    pub caller: Strided,
}

impl IoCopy {
    /// Enqueues this copy of microbatch `mb` if it goes `before` (or after)
    /// pass `p`.
    pub fn enqueue(
        &self,
        backend: &dyn Backend,
        p: PassRef,
        before: bool,
        mb: u32,
        s: StreamRef,
    ) -> Result<()> {
        if self.instance != p.instance || self.kind != p.kind || self.copied_in != before {
            return Ok(());
        }
        let at = self.caller.block(mb as u64).start;
        let bytes = self.caller.bytes as usize;
        match self.copied_in {
            true => backend.copy(self.buffer, at, bytes, s),
            false => backend.copy(at, self.buffer, bytes, s),
        }
    }
}

impl IoCopy {
    /// Enqueues this copy, for the microbatch whose index the device holds
    /// at `index`, if it goes `before` (or after) pass `p` (in a loop's
    /// body).
    pub fn enqueue_indexed(
        &self,
        backend: &dyn Backend,
        p: PassRef,
        before: bool,
        index: DevPtr,
        s: StreamRef,
    ) -> Result<()> {
        if self.instance != p.instance || self.kind != p.kind || self.copied_in != before {
            return Ok(());
        }
        let (caller, stride) = (self.caller.ptr, self.caller.stride as usize);
        let (dst, dst_stride, src, src_stride) = match self.copied_in {
            true => (self.buffer, 0, caller, stride),
            false => (caller, stride, self.buffer, 0),
        };
        let c = IndexedCopy {
            dst,
            dst_stride,
            src,
            src_stride,
            bytes: self.caller.bytes as usize,
            index,
        };
        backend.copy_indexed(c, s)
    }
}

/// The copies of step `si` (`instances[k]` holds `spec.callables[k]`).
pub(crate) fn resolve(
    si: usize,
    spec: &StepSpec,
    all: &[CallableSpec],
    instances: &[usize],
    placed: &[&Placed],
) -> Result<Vec<IoCopy>> {
    let statics: Vec<(DevPtr, usize)> = placed
        .iter()
        .flat_map(|p| {
            let ts = [
                Role::Input,
                Role::Output,
                Role::GradOutput,
                Role::GradInput,
                Role::ParamGrads,
            ];
            ts.into_iter().flat_map(move |r| p.tensors(r))
        })
        .filter(|t| t.place == Place::Static && t.ptr != 0)
        .map(|t| (t.ptr, t.bytes))
        .collect();
    spec.io
        .iter()
        .enumerate()
        .map(|(k, e)| {
            let at = spec.callables.iter().position(|&c| c == e.callable);
            let instance = instances[at.unwrap_or(0)];
            let t = &placed[instance].tensors(e.role)[e.index];
            let what = || {
                format!(
                    "step {si}: io[{k}] ({} {} of callable '{}')",
                    e.role.name(),
                    e.index,
                    all[e.callable as usize].name
                )
            };
            if t.place == Place::Absent {
                return Err(Error::invalid(format!(
                    "{}: there is no such buffer (its tensor takes no grad)",
                    what()
                )));
            }
            if t.place == Place::Chained || matches!(t.feed, Feed::Chained) {
                return Err(Error::invalid(format!(
                    "{}: the buffer is chained (another callable's output or its grad); copy into the \
                     buffer of the callable that owns it",
                    what()
                )));
            }
            let caller = region(all, e, spec.microbatches);
            if let Some(&(p, b)) = statics
                .iter()
                .find(|&&(p, b)| caller.touches(&(p..p + b as u64)))
            {
                return Err(Error::invalid(format!(
                    "{}: the caller memory overlaps the session's static buffer at 0x{p:x} ({b} bytes)",
                    what()
                )));
            }
            let kind = match e.role {
                Role::Input | Role::Output => PassKind::Forward,
                _ => PassKind::Backward,
            };
            Ok(IoCopy {
                instance,
                kind,
                copied_in: e.copied_in(),
                buffer: t.ptr,
                caller,
            })
        })
        .collect()
}

/// What a step over `n` microbatches needs of its instances' parameter
/// grads: sums it can keep (no ALIAS grad, which would hold the last
/// microbatch's only) and, for CLONE grads, clone slots to sum them in
/// (`no_slots`: why there are none).
pub(crate) fn check_sums(
    si: usize,
    n: u32,
    placed: &[&Placed],
    names: &[&str],
    clone_slots: usize,
    no_slots: &str,
) -> Result<()> {
    if n <= 1 {
        return Ok(());
    }
    for (inst, name) in placed.iter().zip(names) {
        if let Some(j) = inst
            .param_grads
            .iter()
            .position(|t| t.ret == ParamReturn::Alias)
        {
            return Err(Error::Incompatible(format!(
                "step {si} runs {n} microbatches, but param {j} of callable '{name}' returns ALIAS grads, \
                 which would hold the last microbatch's grad only: give it CLONE, COPY_INTO or \
                 ACCUMULATE_INTO"
            )));
        }
        let cloned = inst
            .param_grads
            .iter()
            .any(|t| matches!(t.ret, ParamReturn::Clone { .. }));
        if cloned && clone_slots == 0 {
            return Err(Error::Incompatible(format!(
                "step {si} runs {n} microbatches and callable '{name}' returns CLONE grads: their sums are \
                 made in clone slots, and the step has none ({no_slots})"
            )));
        }
    }
    // Every later microbatch's grads are added to the first's: only the
    // dtypes graphed adds (ACCUMULATE_INTO grads were checked at
    // registration).
    for (inst, name) in placed.iter().zip(names) {
        for (j, t) in inst.param_grads.iter().enumerate() {
            if matches!(t.ret, ParamReturn::Clone { .. } | ParamReturn::CopyInto) {
                summable(name, j, t.dtype)?;
            }
        }
    }
    Ok(())
}

/// Refuses grads of a dtype graphed does not add (it adds f32, f16, bf16).
pub(crate) fn summable(callable: &str, j: usize, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F16 | DType::Bf16 => Ok(()),
        other => Err(Error::Incompatible(format!(
            "param {j} of callable '{callable}' has {} grads, which graphed does not sum over \
             microbatches (it sums f32, f16 and bf16)",
            other.name()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::spec::{StepIo, StepSpec};
    use super::super::super::testing::{host_inputs, BYTES};
    use super::super::capture;
    use super::*;

    #[test]
    fn caller_memory_over_a_static_buffer_is_refused() {
        let mut f = host_inputs(&[("a", 1, false), ("b", 1, false)]);
        f.steps = vec![StepSpec::plain(vec![0, 1], vec![0, 0])];
        let (cap, _) = capture(&f.inputs(), 1).unwrap();
        let placed: Vec<&Placed> = cap.instances.iter().map(|i| &i.placed).collect();
        let out = placed[1].outputs[0].ptr;
        let mut spec = f.steps[0].clone();
        let io = |ptr: DevPtr| StepIo {
            callable: 0,
            role: Role::Input,
            index: 0,
            ptr,
            stride: 2 * BYTES,
        };
        // Microbatch 1's block lands on b's static output.
        spec.microbatches = 2;
        spec.io = vec![io(out - 2 * BYTES as DevPtr + 8)];
        let err = resolve(0, &spec, &f.callables, &[0, 1], &placed).err();
        let err = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            err.contains("overlaps the session's static buffer"),
            "{err}"
        );
        assert!(err.contains(&format!("0x{out:x}")), "{err}");
        // Between the blocks: clear.
        spec.io = vec![io(out - 2 * BYTES as DevPtr - BYTES as DevPtr)];
        let ok = resolve(0, &spec, &f.callables, &[0, 1], &placed);
        assert!(ok.is_ok(), "{:?}", ok.err());
        let c = &ok.unwrap()[0];
        assert_eq!(
            (c.instance, c.kind, c.copied_in),
            (0, PassKind::Forward, true)
        );
        assert_eq!(c.buffer, placed[0].inputs[0].ptr);
    }
}
