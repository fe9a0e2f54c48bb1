//! Steps declared before capture: what registration can already check of
//! a step (its callables, its grad destinations, its microbatch count and
//! the copies of each microbatch's data in and out). Capture checks the
//! rest, where placement and policies are known (capture/steps.rs).

use super::spec::{
    CallableSpec, CaptureHook, CollectiveSpec, Looping, StepIo, StepSpec, UpdateSpec,
};
use crate::backend::DevPtr;
use crate::core::layout::Role;
use crate::core::strided::Strided;
use crate::error::{Error, Result};

/// The most microbatches one step's graph holds: each is captured into it
/// (unrolled), so capture time and graph size grow with the count.
pub(crate) const MAX_MICROBATCHES: u32 = 4096;

/// The most bytes of a step's device scalar block (learning rate, step
/// count, loss scale, clip threshold: a few words; a replay copies them
/// all when it is given them).
pub(crate) const MAX_SCALAR_BYTES: usize = 4096;

/// A step's declaration, as the caller gave it.
pub struct StepRequest<'a> {
    pub callables: Vec<u32>,
    pub param_dsts: Option<&'a [DevPtr]>,
    pub microbatches: u32,
    pub io: Vec<StepIo>,
    pub looping: Looping,
    pub capture_hook: Option<CaptureHook>,
    pub update: Option<UpdateSpec>,
    pub collective: Option<CollectiveSpec>,
}

/// Checks a step's declaration against the session's callables and makes
/// its spec.
pub(crate) fn declare(all: &[CallableSpec], r: StepRequest) -> Result<StepSpec> {
    let StepRequest {
        callables,
        param_dsts,
        microbatches,
        io,
        looping,
        capture_hook,
        update,
        collective,
    } = r;
    if callables.is_empty() {
        return Err(Error::invalid("a step needs at least one callable"));
    }
    if microbatches == 0 {
        return Err(Error::invalid(
            "microbatches is 0: a step runs at least one microbatch",
        ));
    }
    if microbatches > MAX_MICROBATCHES {
        return Err(Error::invalid(format!(
            "microbatches is {microbatches}: a step's graph holds at most {MAX_MICROBATCHES} (each is \
             captured into it)"
        )));
    }
    let mut params = 0usize;
    for (k, &c) in callables.iter().enumerate() {
        let spec = all.get(c as usize).ok_or_else(|| {
            Error::invalid(format!(
                "callables[{k}] is {c}; the session has {} callables",
                all.len()
            ))
        })?;
        if k > 0 && c <= callables[k - 1] {
            return Err(Error::invalid(format!(
                "callables[{k}] is {c}, after {}: a step lists its callables once each, in registration order",
                callables[k - 1]
            )));
        }
        params += spec.params.len();
    }
    let param_dsts = match param_dsts {
        None => vec![0; params],
        Some(d) if d.len() == params => d.to_vec(),
        Some(d) => {
            let given = d.len();
            return Err(Error::invalid(format!(
                "{given} param destinations were given; the step's callables have {params} parameters"
            )));
        }
    };
    check_io(all, &callables, microbatches, &io)?;
    if let Some(u) = &update {
        if u.scalar_bytes > MAX_SCALAR_BYTES {
            return Err(Error::invalid(format!(
                "scalar_bytes is {}: a step's scalar block holds at most {MAX_SCALAR_BYTES} bytes",
                u.scalar_bytes
            )));
        }
    }
    if let Some(c) = &collective {
        if c.ranks == 0 || c.rank >= c.ranks {
            return Err(Error::invalid(format!(
                "collective_rank is {} and collective_ranks {}: the rank is below the count, and there \
                 is at least one",
                c.rank, c.ranks
            )));
        }
    }
    Ok(StepSpec {
        callables,
        param_dsts,
        microbatches,
        io,
        looping,
        capture_hook,
        update,
        collective,
    })
}

/// The caller memory an io entry covers over `microbatches`.
pub(crate) fn region(all: &[CallableSpec], e: &StepIo, microbatches: u32) -> Strided {
    Strided {
        ptr: e.ptr,
        stride: e.stride as u64,
        bytes: tensor_bytes(&all[e.callable as usize], e.role, e.index).unwrap_or(0) as u64,
        count: microbatches as u64,
    }
}

/// The bytes of tensor `index` of `role` (None: there is no such tensor).
fn tensor_bytes(c: &CallableSpec, role: Role, index: usize) -> Option<usize> {
    match role {
        Role::Input | Role::GradInput => c.inputs.get(index).map(|t| t.bytes),
        Role::Output | Role::GradOutput => c.outputs.get(index).map(|t| t.bytes),
        Role::ParamGrads => None,
    }
}

/// Each io entry names a tensor of one of the step's callables once, with
/// usable caller memory; what is written does not overlap what else the
/// step reads or writes there.
fn check_io(all: &[CallableSpec], callables: &[u32], n: u32, io: &[StepIo]) -> Result<()> {
    for (k, e) in io.iter().enumerate() {
        let what = || {
            format!(
                "io[{k}] ({} {} of callable {})",
                e.role.name(),
                e.index,
                e.callable
            )
        };
        if !callables.contains(&e.callable) {
            return Err(Error::invalid(format!(
                "io[{k}] names callable {}, which is not one of the step's",
                e.callable
            )));
        }
        let c = &all[e.callable as usize];
        if e.role == Role::ParamGrads {
            return Err(Error::invalid(format!(
                "io[{k}]: the role is the parameter grads, which the step returns by their policies; io \
                 copies inputs and grad-outputs in, outputs and grad-inputs out"
            )));
        }
        let Some(_) = tensor_bytes(c, e.role, e.index) else {
            let have = match e.role {
                Role::Input | Role::GradInput => c.inputs.len(),
                _ => c.outputs.len(),
            };
            return Err(Error::invalid(format!(
                "{}: callable '{}' has {have} {}s",
                what(),
                c.name,
                match e.role {
                    Role::Input | Role::GradInput => "input",
                    _ => "output",
                }
            )));
        };
        if let Some(p) = io[..k]
            .iter()
            .position(|o| (o.callable, o.role, o.index) == (e.callable, e.role, e.index))
        {
            return Err(Error::invalid(format!(
                "{}: io[{p}] names the same buffer; name each once",
                what()
            )));
        }
        if let Some(problem) = region(all, e, n).problem() {
            return Err(Error::invalid(format!(
                "{}: the caller memory {problem}",
                what()
            )));
        }
    }
    // What a copy out writes must not be what another entry reads or
    // writes: the graph's copies would then depend on their order.
    for (k, e) in io.iter().enumerate().filter(|(_, e)| !e.copied_in()) {
        let mine = region(all, e, n);
        for (j, o) in io.iter().enumerate().filter(|&(j, _)| j != k) {
            if mine.overlaps(&region(all, o, n)) {
                return Err(Error::invalid(format!(
                    "io[{k}] ({} {} of callable {}) writes caller memory that io[{j}] also {}: copies out \
                     need memory of their own",
                    e.role.name(),
                    e.index,
                    e.callable,
                    if o.copied_in() { "reads" } else { "writes" }
                )));
            }
        }
    }
    Ok(())
}
