//! Rebinding, the verification step of a capture: inputs and grad-outputs
//! asked to be rebound (`GRAPHED_TENSOR_FLAGS_REBIND`) are read by replays
//! where the caller's data is, instead of copied into the static buffer,
//! where capture can verify that this gives the same results.
//!
//! Per instance: the backend plans where its graphs take each buffer's
//! address (`Graph::rebinder`); then one verification replays the
//! instance's graphs twice on the capture stream, first copying (grad-
//! outputs filled with a pattern), then with every planned buffer moved to
//! a copy of its data while the static buffer holds another pattern; the
//! device compares every output and grad of the two runs, and one flag
//! comes back. Equal: every plan is kept. Different: each buffer is
//! verified alone, and those that differ are copied, with the reason. A
//! buffer that cannot be planned (opaque work, no parameter information,
//! not floating-point data) is copied too. Patterns and copies stay on the
//! device: nothing the size of a tensor crosses to the host.
//!
//! Replays then point the graphs at the caller's buffer (one node update
//! per reference) instead of copying it; the caller keeps that buffer
//! unchanged until the instance's last pass that reads it has run.

use super::clock::{CaptureTimes, Span};
use super::context::Inputs;
use super::instance::{PassGraphs, Placed};
use super::spec::LogLevel;
use super::tensor::{Feed, Rebinding};
use crate::backend::{Backend, DevPtr, DeviceMemory, RebindPlan, StreamRef};
use crate::core::dtype::DType;
use crate::core::layout::Role;
use crate::core::size;
use crate::error::Result;
use std::sync::Arc;

/// Bytes of pattern made on the host per dtype; larger buffers are filled
/// by copying it over and over on the device.
const CHUNK: usize = 64 << 10;

/// The dtypes rebinding is verified with (floating point: a pattern of
/// ordinary values, no NaN or infinity that a kernel could treat apart).
const VERIFIED: [DType; 4] = [DType::F32, DType::F16, DType::Bf16, DType::F64];

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

/// A tensor asked to be rebound, with its plans.
struct Candidate {
    role: Role,
    index: usize,
    ptr: DevPtr,
    bytes: usize,
    dtype: DType,
    rebinding: Rebinding,
}

/// What planning decided for one tensor asked to be rebound.
enum Planned {
    Candidate(Candidate),
    Refused(Role, usize, String),
}

/// The tensors of `inst` whose registration asks for rebinding.
fn asked(s: &Inputs, inst: &Placed) -> Vec<(Role, usize)> {
    let spec = &s.callables[inst.callable];
    let inputs = spec.inputs.iter().enumerate();
    let outputs = spec.outputs.iter().enumerate();
    inputs
        .filter(|(_, t)| t.rebind)
        .map(|(i, _)| (Role::Input, i))
        .chain(
            outputs
                .filter(|(_, t)| t.rebind)
                .map(|(o, _)| (Role::GradOutput, o)),
        )
        .collect()
}

/// Plans the rebinding of tensor (role, index) of `inst` in its graphs.
fn plan(inst: &Placed, graphs: &PassGraphs, role: Role, index: usize) -> Result<Planned> {
    let t = &inst.tensors(role)[index];
    let refused = |why: &str| Ok(Planned::Refused(role, index, why.to_string()));
    match t.feed {
        Feed::Chained => return refused("it is another callable's buffer, read in place"),
        Feed::NotFed => return refused("it has no static buffer (no grad flows to this output)"),
        _ => {}
    }
    if !VERIFIED.contains(&t.dtype) {
        return Ok(Planned::Refused(
            role,
            index,
            format!(
                "rebinding is verified with floating-point data; {} tensors are copied",
                t.dtype.name()
            ),
        ));
    }
    let mut plans = Vec::new();
    for g in graphs.all() {
        match g.rebinder(t.ptr, t.bytes)? {
            RebindPlan::Plan(p) => plans.push(p),
            // A pass that does not read the buffer needs no plan (a forward
            // never reads a grad-output; a backward may not read the input).
            RebindPlan::Unreferenced => {}
            RebindPlan::Refused(why) => return refused(&why),
        }
    }
    if plans.is_empty() {
        return refused("no graph of the callable takes the buffer's address");
    }
    Ok(Planned::Candidate(Candidate {
        role,
        index,
        ptr: t.ptr,
        bytes: t.bytes,
        dtype: t.dtype,
        rebinding: Rebinding::new(plans, t.ptr),
    }))
}

/// Device memory verification works in: per verified dtype two pattern
/// chunks (A fills grad-outputs, B the buffers moved away from), a flag,
/// and room for one instance's results and moved buffers.
struct Workspace {
    memory: DeviceMemory,
    /// Where room starts.
    room: DevPtr,
}

impl Workspace {
    fn new(backend: &Arc<dyn Backend>, room: usize) -> Result<Workspace> {
        const WHAT: &str = "the rebinding verification's workspace";
        let patterns = 2 * CHUNK * VERIFIED.len();
        let total = size::add(size::add(patterns, 256, WHAT)?, room, WHAT)?;
        let memory = DeviceMemory::new(backend, total)?;
        for (d, &dtype) in VERIFIED.iter().enumerate() {
            for k in 0..2 {
                let at = memory.ptr() + ((2 * d + k) * CHUNK) as DevPtr;
                backend.upload(at, &pattern(dtype, CHUNK, 7 + 92 * k as u32))?;
            }
        }
        let room = memory.ptr() + (patterns + 256) as DevPtr;
        Ok(Workspace { memory, room })
    }

    /// Pattern `k` (0: A, 1: B) of `dtype`.
    fn pattern(&self, dtype: DType, k: usize) -> DevPtr {
        let d = VERIFIED.iter().position(|&v| v == dtype).unwrap_or(0);
        self.memory.ptr() + ((2 * d + k) * CHUNK) as DevPtr
    }

    fn flag(&self) -> DevPtr {
        self.room - 256
    }

    /// Bytes of room.
    fn room_bytes(&self) -> usize {
        self.memory.bytes() - (self.room - self.memory.ptr()) as usize
    }
}

/// The room one verification of `inst` with candidates of `bytes` needs.
fn room(inst: &Placed, bytes: impl Iterator<Item = usize>) -> usize {
    let aligned = |n: usize| n.div_ceil(256) * 256;
    let results: usize = inst.results().iter().map(|&(_, n)| aligned(n)).sum();
    results + bytes.map(aligned).sum::<usize>()
}

/// One verification on the capture stream.
struct Verifier<'a> {
    backend: &'a dyn Backend,
    stream: StreamRef,
    ws: &'a Workspace,
}

impl Verifier<'_> {
    /// Fills `bytes` at `dst` with pattern `k` of `dtype`: one chunk, then
    /// doubling copies of what is there.
    fn fill(&self, dst: DevPtr, bytes: usize, dtype: DType, k: usize) -> Result<()> {
        let b = self.backend;
        b.copy(
            dst,
            self.ws.pattern(dtype, k),
            bytes.min(CHUNK),
            self.stream,
        )?;
        let mut done = bytes.min(CHUNK);
        while done < bytes {
            let n = done.min(bytes - done);
            b.copy(dst + done as DevPtr, dst, n, self.stream)?;
            done += n;
        }
        Ok(())
    }

    fn run(&self, graphs: &PassGraphs) -> Result<()> {
        graphs.in_order().try_for_each(|g| g.launch(self.stream))
    }

    /// Whether the instance's graphs give the same results with every
    /// candidate moved to a copy of its data as when copying.
    fn same(
        &self,
        inst: &Placed,
        graphs: &PassGraphs,
        cands: &mut [&mut Candidate],
    ) -> Result<bool> {
        let (b, s) = (self.backend, self.stream);
        for t in inst.grad_outputs.iter().filter(|t| t.ptr != 0) {
            self.fill(t.ptr, t.bytes, t.dtype, 0)?;
        }
        self.run(graphs)?;
        let mut at = self.ws.room;
        let mut next = |n: usize| {
            let p = at;
            at += (n.div_ceil(256) * 256) as DevPtr;
            p
        };
        let results: Vec<(DevPtr, DevPtr, usize)> = inst
            .results()
            .into_iter()
            .map(|(p, n)| (p, next(n), n))
            .collect();
        for &(p, snap, n) in &results {
            b.copy(snap, p, n, s)?;
        }
        let moved: Vec<DevPtr> = cands.iter().map(|c| next(c.bytes)).collect();
        for (c, &other) in cands.iter().zip(&moved) {
            b.copy(other, c.ptr, c.bytes, s)?;
            self.fill(c.ptr, c.bytes, c.dtype, 1)?;
        }
        // Updates take effect for later launches only: the copying run
        // already enqueued reads the static buffers.
        let rebound = cands
            .iter_mut()
            .zip(&moved)
            .try_for_each(|(c, &other)| c.rebinding.bind(other))
            .and_then(|()| self.run(graphs));
        let compared = rebound.and_then(|()| {
            b.zero(self.ws.flag(), 4, s)?;
            results
                .iter()
                .try_for_each(|&(p, snap, n)| b.differ(p, snap, n, self.ws.flag(), s))
        });
        // Whatever happened, the graphs point back at the static buffers,
        // which get their data back.
        let mut restored = Ok(());
        for (c, &other) in cands.iter_mut().zip(&moved) {
            let r = c
                .rebinding
                .bind(c.ptr)
                .and_then(|()| b.copy(c.ptr, other, c.bytes, s));
            restored = restored.and(r);
        }
        compared?;
        restored?;
        b.synchronize(s)?;
        let mut flag = [0u8; 4];
        b.download(&mut flag, self.ws.flag())?;
        Ok(u32::from_ne_bytes(flag) == 0)
    }
}

/// Decides every tensor asked to be rebound, instance by instance (see the
/// module comment), and lets the graphs' templates go where no plan needs
/// them; returns how many a plan keeps. `stream` is idle.
pub(crate) fn resolve(
    s: &Inputs,
    placed: &mut [Placed],
    graphs: &mut [PassGraphs],
    stream: StreamRef,
    times: &mut CaptureTimes,
) -> Result<usize> {
    let mut kept = 0;
    let mut ws: Option<Workspace> = None;
    for (inst, g) in placed.iter_mut().zip(graphs.iter_mut()) {
        let wanted = asked(s, inst);
        if !wanted.is_empty() {
            let decided = decide(s, inst, g, &wanted, stream, times, &mut ws)?;
            for (role, index, feed) in decided {
                log(s, inst, role, index, &feed);
                inst.tensors_mut(role)[index].feed = feed;
            }
        }
        let slots = g.slots.iter_mut().map(|s| &mut s.graph);
        for graph in g.passes.iter_mut().flatten().chain(slots) {
            kept += graph.release_template() as usize;
        }
    }
    Ok(kept)
}

/// The feeds of the tensors of `inst` in `wanted`.
fn decide(
    s: &Inputs,
    inst: &Placed,
    graphs: &PassGraphs,
    wanted: &[(Role, usize)],
    stream: StreamRef,
    times: &mut CaptureTimes,
    ws: &mut Option<Workspace>,
) -> Result<Vec<(Role, usize, Feed)>> {
    let planned = times.time(Span::RebindPlan, |_| {
        wanted
            .iter()
            .map(|&(role, i)| plan(inst, graphs, role, i))
            .collect::<Result<Vec<_>>>()
    })?;
    let mut out = Vec::new();
    let mut cands = Vec::new();
    for p in planned {
        match p {
            Planned::Candidate(c) => cands.push(c),
            Planned::Refused(role, i, why) => out.push((role, i, Feed::Refused(why))),
        }
    }
    if cands.is_empty() {
        return Ok(out);
    }
    times.time(Span::RebindVerify, |_| {
        let need = room(inst, cands.iter().map(|c| c.bytes));
        if !ws.as_ref().is_some_and(|w| w.room_bytes() >= need) {
            *ws = None;
            *ws = Some(Workspace::new(s.backend, need)?);
        }
        let Some(ws) = ws.as_ref() else {
            return Ok(());
        };
        let v = Verifier {
            backend: s.backend.as_ref(),
            stream,
            ws,
        };
        let together = v.same(inst, graphs, &mut cands.iter_mut().collect::<Vec<_>>())?;
        for mut c in cands.drain(..) {
            // Together they agree; else each alone says which differs.
            let alone = together || v.same(inst, graphs, &mut [&mut c])?;
            out.push(if alone {
                (c.role, c.index, Feed::Rebound(c.rebinding))
            } else {
                (
                    c.role,
                    c.index,
                    Feed::Refused(
                        "a rebound replay at capture gave other results than a copying one: some \
                         kernel reads the buffer through memory (or is not deterministic)"
                            .into(),
                    ),
                )
            });
        }
        Ok(())
    })?;
    Ok(out)
}

fn log(s: &Inputs, inst: &Placed, role: Role, index: usize, feed: &Feed) {
    let (name, mb) = (&s.callables[inst.callable].name, inst.microbatch);
    let what = inst.tensors(role)[index].describe();
    match feed {
        Feed::Rebound(r) => s.log(LogLevel::Info, || {
            format!(
                "{what} of callable '{name}' (microbatch {mb}) is rebound at replay: {} node(s)",
                r.nodes()
            )
        }),
        Feed::Refused(why) => s.log(LogLevel::Warn, || {
            format!("{what} of callable '{name}' (microbatch {mb}) is copied at replay: {why}")
        }),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{host_inputs, Fixture, BYTES};
    use super::*;
    use crate::backend::{Graph, Rebinder};
    use crate::core::PassKind;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

    /// A forward that copies its input to its output. An honest one reads
    /// where its plan points it; a sneaky one keeps reading the address it
    /// was captured with (as a kernel reading the address from memory
    /// would), though its plan claims to move it.
    struct CopyGraph {
        backend: Arc<dyn Backend>,
        src: Arc<AtomicU64>,
        dst: DevPtr,
        honest: bool,
        launches: Arc<AtomicUsize>,
    }

    struct MovePlan {
        src: Arc<AtomicU64>,
        honest: bool,
    }

    impl Rebinder for MovePlan {
        fn nodes(&self) -> usize {
            1
        }
        fn rebind(&mut self, base: DevPtr) -> Result<()> {
            if self.honest {
                self.src.store(base, Relaxed);
            }
            Ok(())
        }
    }

    impl Graph for CopyGraph {
        fn launch(&self, stream: StreamRef) -> Result<()> {
            self.launches.fetch_add(1, Relaxed);
            self.backend
                .copy(self.dst, self.src.load(Relaxed), BYTES, stream)
        }
        fn rebinder(&self, base: DevPtr, _bytes: usize) -> Result<RebindPlan> {
            if base != self.src.load(Relaxed) {
                return Ok(RebindPlan::Unreferenced);
            }
            Ok(RebindPlan::Plan(Box::new(MovePlan {
                src: self.src.clone(),
                honest: self.honest,
            })))
        }
    }

    /// Placed instances of `f` in host memory, and each one's forward
    /// graph (honest or not) with a launch counter.
    fn setup(
        f: &Fixture,
        honest: &[bool],
    ) -> (Vec<Placed>, Vec<PassGraphs>, Arc<AtomicUsize>, DeviceMemory) {
        let statics = DeviceMemory::new(&f.backend, f.static_bytes()).unwrap();
        let placed = f.placed(statics.ptr());
        let launches = Arc::new(AtomicUsize::new(0));
        let graphs = placed
            .iter()
            .zip(honest)
            .map(|(inst, &honest)| {
                f.backend.upload(inst.inputs[0].ptr, &[3u8; BYTES]).unwrap();
                let mut g = PassGraphs::default();
                g.passes[PassKind::Forward.index()] = Some(Box::new(CopyGraph {
                    backend: f.backend.clone(),
                    src: Arc::new(AtomicU64::new(inst.inputs[0].ptr)),
                    dst: inst.outputs[0].ptr,
                    honest,
                    launches: launches.clone(),
                }) as Box<dyn Graph>);
                g
            })
            .collect();
        (placed, graphs, launches, statics)
    }

    fn resolved(f: &Fixture, honest: &[bool]) -> (Vec<Placed>, usize) {
        let (mut placed, mut graphs, launches, _statics) = setup(f, honest);
        let mut times = CaptureTimes::default();
        resolve(
            &f.inputs(),
            &mut placed,
            &mut graphs,
            StreamRef(0),
            &mut times,
        )
        .unwrap();
        (placed, launches.load(Relaxed))
    }

    #[test]
    fn verification_keeps_what_gives_the_same_bits_and_refuses_the_rest() {
        let mut f = host_inputs(&[("honest", 1, false), ("sneaky", 1, false)]);
        for c in &mut f.callables {
            c.inputs[0].rebind = true;
        }
        let (placed, launches) = resolved(&f, &[true, false]);
        assert!(placed[0].inputs[0].feed.is_rebound());
        let Feed::Refused(why) = &placed[1].inputs[0].feed else {
            panic!("the sneaky graph reads the static buffer")
        };
        assert!(why.contains("other results"), "{why}");
        // The honest instance: one copying and one rebound replay of its
        // one graph. The sneaky one: the same together, then again alone.
        assert_eq!(launches, 2 + 4);
        // The graphs point back at the static buffers, which hold their data.
        let mut back = [0u8; BYTES];
        f.backend
            .download(&mut back, placed[1].inputs[0].ptr)
            .unwrap();
        assert_eq!(back, [3u8; BYTES]);
    }

    #[test]
    fn one_verification_decides_every_tensor_of_an_instance() {
        let mut f = host_inputs(&[("a", 1, false)]);
        f.callables[0].inputs[0].rebind = true;
        // Its grad-output is read by no graph here: refused before any replay.
        f.callables[0].outputs[0].rebind = true;
        let (placed, launches) = resolved(&f, &[true]);
        assert!(placed[0].inputs[0].feed.is_rebound());
        let Feed::Refused(why) = &placed[0].grad_outputs[0].feed else {
            panic!("no graph reads the grad-output")
        };
        assert!(why.contains("no graph"), "{why}");
        assert_eq!(launches, 2, "two replays, not two per tensor");
    }

    #[test]
    fn what_cannot_be_planned_is_refused_with_its_reason() {
        let mut f = host_inputs(&[("ints", 1, false), ("p", 1, false), ("c", 1, false)]);
        f.callables[0].inputs[0].dtype = DType::I32;
        f.callables[0].inputs[0].rebind = true;
        f.callables[0].outputs[0].requires_grad = false;
        f.callables[0].outputs[0].rebind = true;
        f.callables[2].inputs[0].chained = Some((1, 0));
        f.callables[2].inputs[0].rebind = true;
        let (placed, launches) = resolved(&f, &[true, true, true]);
        let why = |feed: &Feed| match feed {
            Feed::Refused(w) => w.clone(),
            _ => panic!("refused"),
        };
        assert!(why(&placed[0].inputs[0].feed).contains("floating-point"));
        assert!(why(&placed[0].grad_outputs[0].feed).contains("no static buffer"));
        assert!(why(&placed[2].inputs[0].feed).contains("read in place"));
        assert_eq!(launches, 0, "nothing was verified");
    }
}
