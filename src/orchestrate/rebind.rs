//! Rebinding inputs and grad-outputs instead of copying them (opt-in per
//! tensor): at capture the backend plans where an instance's graphs take
//! the static buffer's address, and a verification replays the instance
//! once copying and once rebound to another buffer (the static buffer then
//! holding other data); only when both give the same bits is the buffer
//! rebound at replay. A replay then points the graphs at the caller's
//! buffer (one node update per reference) instead of copying it; the caller
//! keeps that buffer unchanged until the instance's last pass that reads it
//! has run (an input: its backward, as autograd would; a grad-output: the
//! backward, or the weight-grad pass where there is one).

use super::captured::Instance;
use super::clock::{CaptureTimes, Span};
use crate::backend::{Backend, DevPtr, DeviceMemory, RebindPlan, Rebinder, StreamRef};
use crate::core::dtype::DType;
use crate::error::Result;
use std::sync::Arc;

/// Addresses a rebound input may take: the static buffers' alignment, which
/// kernels (vector loads, tensor-memory descriptors) may rely on. Other
/// addresses are copied.
pub const REBIND_ALIGN: u64 = 256;

/// Whether and how an input is rebound.
pub(crate) enum Rebind {
    /// Copied at replay (the default).
    Off,
    /// Rebound: the plans of every graph of the instance that reads it, and
    /// the address they point at now.
    On {
        plans: Vec<Box<dyn Rebinder>>,
        bound: DevPtr,
    },
    /// Asked for, refused at capture: copied, for this reason.
    Refused(String),
}

impl Rebind {
    /// Whether replays point the graphs at the caller's data.
    pub fn is_on(&self) -> bool {
        matches!(self, Rebind::On { .. })
    }

    /// Nodes a rebind updates.
    pub fn nodes(&self) -> usize {
        match self {
            Rebind::On { plans, .. } => plans.iter().map(|p| p.nodes()).sum(),
            _ => 0,
        }
    }

    /// Points the graphs at `target` if they are not already.
    pub fn bind(&mut self, target: DevPtr) -> Result<()> {
        if let Rebind::On { plans, bound } = self {
            if *bound != target {
                // Unknown until every plan points at `target`: a failure
                // part way makes the next bind redo them all.
                *bound = 0;
                for p in plans.iter_mut() {
                    p.rebind(target)?;
                }
                *bound = target;
            }
        }
        Ok(())
    }
}

/// A float pattern that differs from real data: values in [-1, 1) from a
/// fixed sequence, as `dtype` elements.
fn pattern(dtype: DType, bytes: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        (x >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
    };
    let mut out = Vec::with_capacity(bytes);
    while out.len() < bytes {
        match dtype {
            DType::F64 => out.extend_from_slice(&(next() as f64).to_ne_bytes()),
            DType::F16 => {
                out.extend_from_slice(&crate::core::dtype::f32_to_f16(next()).to_ne_bytes())
            }
            DType::Bf16 => {
                out.extend_from_slice(&crate::core::dtype::f32_to_bf16(next()).to_ne_bytes())
            }
            _ => out.extend_from_slice(&next().to_ne_bytes()),
        }
    }
    out.truncate(bytes);
    out
}

/// What one verification replay of an instance leaves in its buffers.
fn results(
    backend: &dyn Backend,
    inst: &Instance,
    in_bytes: &[usize],
    out_bytes: &[usize],
) -> Result<Vec<Vec<u8>>> {
    let b = &inst.buffers;
    let mut all = Vec::new();
    let sized = b
        .outputs
        .iter()
        .zip(out_bytes)
        .chain(b.grad_inputs.iter().zip(in_bytes))
        .chain(b.param_grads.iter().zip(&b.param_bytes))
        .map(|(&p, &n)| (p, n));
    for (p, n) in sized {
        if p != 0 && n > 0 {
            let mut v = vec![0u8; n];
            backend.download(&mut v, p)?;
            all.push(v);
        }
    }
    Ok(all)
}

/// Plans and verifies the rebinding of the static buffer at `stat` of
/// `inst` (an input or a grad-output, of `dtype`, `bytes`). The instance's
/// grad-outputs are filled with a pattern for the verification; `stream`
/// is idle.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prepare(
    backend: &Arc<dyn Backend>,
    inst: &Instance,
    stat: DevPtr,
    dtype: DType,
    bytes: usize,
    input_bytes: &[usize],
    out_bytes: &[usize],
    stream: StreamRef,
    times: &mut CaptureTimes,
) -> Result<Rebind> {
    let refused = |why: String| Ok(Rebind::Refused(why));
    if !matches!(dtype, DType::F32 | DType::F16 | DType::Bf16 | DType::F64) {
        return refused(format!(
            "rebinding is verified with floating-point data; {} inputs are copied",
            dtype.name()
        ));
    }
    let planning = std::time::Instant::now();
    let graphs = inst.graphs.iter().flatten().chain(inst.rotating.iter());
    let mut plans = Vec::new();
    for g in graphs {
        match g.rebinder(stat, bytes)? {
            RebindPlan::Plan(p) => plans.push(p),
            // A pass that does not read the buffer needs no plan (a forward
            // never reads a grad-output; a backward may not read the input).
            RebindPlan::Unreferenced => {}
            RebindPlan::Refused(why) => return refused(why),
        }
    }
    times.add(Span::RebindPlan, planning.elapsed());
    if plans.is_empty() {
        return refused("no graph of the callable takes the buffer's address".into());
    }
    let verifying = std::time::Instant::now();
    // Verification: the same replays, copying and rebound, must agree.
    for (k, (&g, &n)) in inst.buffers.grad_outputs.iter().zip(out_bytes).enumerate() {
        if g != 0 {
            backend.upload(g, &pattern(dtype, n, 7 + k as u32))?;
        }
    }
    let real = {
        let mut v = vec![0u8; bytes];
        backend.download(&mut v, stat)?;
        v
    };
    let run = || -> Result<()> {
        for g in inst.graphs.iter().flatten() {
            g.launch(stream)?;
        }
        backend.synchronize(stream)
    };
    run()?;
    let copied = results(backend.as_ref(), inst, input_bytes, out_bytes)?;
    let other = DeviceMemory::new(backend, bytes)?;
    backend.upload(other.ptr(), &real)?;
    backend.upload(stat, &pattern(dtype, bytes, 99))?;
    let mut on = Rebind::On { plans, bound: stat };
    on.bind(other.ptr())?;
    let rebound = run().and_then(|_| results(backend.as_ref(), inst, input_bytes, out_bytes));
    on.bind(stat)?;
    backend.upload(stat, &real)?;
    times.add(Span::RebindVerify, verifying.elapsed());
    if rebound? != copied {
        return refused(
            "a rebound replay at capture gave other results than a copying one: some kernel reads the \
             buffer through memory (or is not deterministic)"
                .into(),
        );
    }
    Ok(on)
}
