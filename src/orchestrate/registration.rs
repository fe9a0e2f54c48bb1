//! Registration, while the session is open: callables (their tensors,
//! chains, buckets and parameters checked as they come), steps, and
//! parameter flags until capture freezes them; the counts and arities of
//! what was registered.

use super::session::Session;
use super::spec::{CallableSpec, Looping, TensorSpec};
use super::steps::{self, StepRequest};
use crate::core::policy::ParamFlags;
use crate::core::size;
use crate::error::{Error, Result};

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

/// Checks one list of bucket sizes (`field` names it in messages).
fn check_sizes(b: &[u64], field: &str, who: &str) -> Result<()> {
    if b[0] == 0 || b[b.len() - 1] > u32::MAX as u64 {
        return Err(Error::invalid(format!(
            "{who}: bucket sizes are 1 to 2^32 - 1 (got {field} {b:?})"
        )));
    }
    if b.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::invalid(format!(
            "{who}: bucket sizes must be strictly ascending (got {field} {b:?})"
        )));
    }
    Ok(())
}

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
        if !spec.buckets2.is_empty() {
            return Err(Error::invalid(format!(
                "{who}: desc.bucket_sizes2 is set without desc.bucket_sizes (a grid needs both lists)"
            )));
        }
        return match tensors().find(|(_, _, t)| t.dynamic) {
            Some((what, i, _)) => Err(Error::invalid(format!(
                "{who}: {what}[{i}] is DYNAMIC, but the callable has no buckets (desc.bucket_sizes)"
            ))),
            None => Ok(()),
        };
    };
    if spec.bucket_count() > MAX_BUCKETS {
        return Err(Error::invalid(format!(
            "{who} has {} buckets; at most {MAX_BUCKETS}",
            spec.bucket_count()
        )));
    }
    check_sizes(&spec.buckets, "bucket_sizes", who)?;
    if !spec.buckets2.is_empty() {
        check_sizes(&spec.buckets2, "bucket_sizes2", who)?;
    }
    if !tensors().any(|(_, _, t)| t.dynamic) {
        return Err(Error::invalid(format!(
            "{who} has buckets but no DYNAMIC input or output (GRAPHED_TENSOR_FLAGS_DYNAMIC marks the \
             tensors whose first dimension is the bucket size)"
        )));
    }
    let largest2 = spec.buckets2.last().copied();
    for (what, i, t) in tensors().filter(|(_, _, t)| t.dynamic) {
        check_dims(t, (largest, largest2), &format!("{who}: {what}[{i}]"))?;
    }
    Ok(())
}

/// Checks the dimensions a DYNAMIC tensor varies on: inside its shape,
/// the largest bucket's sizes there, and collapsible to rows of one pitch.
fn check_dims(t: &TensorSpec, (largest, largest2): (u64, Option<u64>), what: &str) -> Result<()> {
    let (d1, d2) = t.dims;
    if d2.is_some() && largest2.is_none() {
        return Err(Error::invalid(format!(
            "{what}: dynamic_dim2 is set, but the callable has one list of buckets (a second size needs \
             desc.bucket_sizes2)"
        )));
    }
    if d1.is_none() && d2.is_none() {
        return Err(Error::invalid(format!(
            "{what} is DYNAMIC, but dynamic_dim and dynamic_dim2 are both GRAPHED_DIM_NONE: name the \
             dimension the bucket's size is"
        )));
    }
    if d1 == d2 {
        return Err(Error::invalid(format!(
            "{what}: dynamic_dim and dynamic_dim2 are both {}: a dimension follows one size",
            d1.unwrap_or(0)
        )));
    }
    if t.shape.is_empty() && (d1 != Some(0) || d2.is_some()) {
        return Err(Error::invalid(format!(
            "{what} varies on another dimension than the first: it needs a shape (ndim and shape)"
        )));
    }
    for (d, size, field) in [
        (d1, Some(largest), "dynamic_dim"),
        (d2, largest2, "dynamic_dim2"),
    ] {
        let (Some(d), Some(size)) = (d, size) else {
            continue;
        };
        let Some(&n) = t.shape.get(d) else {
            return Err(Error::invalid(format!(
                "{what}: {field} is {d}, but its shape {:?} has {} dimensions",
                t.shape,
                t.shape.len()
            )));
        };
        if n != size as i64 && d == 0 && field == "dynamic_dim" {
            return Err(Error::invalid(format!(
                "{what} is DYNAMIC: its shape's first dimension must be the largest bucket ({size}); its \
                 shape is {:?}",
                t.shape
            )));
        }
        if n != size as i64 {
            let which = if field == "dynamic_dim" {
                "size"
            } else {
                "second size"
            };
            return Err(Error::invalid(format!(
                "{what} is DYNAMIC: dimension {d} of its shape ({field}) must be the largest bucket's \
                 {which} ({size}); its shape is {:?}",
                t.shape
            )));
        }
    }
    if t.collapsed().is_none() {
        return Err(Error::invalid(format!(
            "{what} varies on dimensions {} and {} of its shape {:?}: where it varies on two, the dimensions \
             before both must hold one element (its data must be rows of one pitch)",
            d1.unwrap_or(0),
            d2.unwrap_or(0),
            t.shape
        )));
    }
    Ok(())
}

impl Session {
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
                    t.dims = out.dims;
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
        if !producer.buckets2.is_empty() || !spec.buckets2.is_empty() {
            return Err(Error::invalid(format!(
                "{what}: a callable with a grid of buckets (bucket_sizes2) is not chained, nor chained to \
                 (its tensors are copied in and out)"
            )));
        }
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
        if out.collapsed().is_some_and(|c| !c.rows_first()) {
            return Err(Error::invalid(format!(
                "{what}: the output is DYNAMIC on another dimension than its first (dynamic_dim {:?}): such \
                 tensors are copied in and out, not chained",
                out.dims.0
            )));
        }
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
        if step.update.as_ref().is_some_and(|u| u.check) {
            if let Some(why) = self.backend.loops() {
                return Err(Error::Unsupported(format!(
                    "a step whose update checks its grads cannot be declared: skipping the update on \
                     the device needs a conditional IF node ({why}); declare it without update_check"
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
}
