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
use super::tensor::{Feed, ParamFeed, Rebinding};
use crate::backend::{Backend, DevPtr, DeviceMemory, RebindPlan, StreamRef};
use crate::core::dtype::DType;
use crate::core::layout::Role;
use crate::core::size;
use crate::core::ALIGN;
use crate::error::{Error, Result};
use std::sync::Arc;

/// Bytes of pattern made on the host per dtype; larger buffers are filled
/// by copying it over and over on the device. Not a power of two, so that
/// the pattern's period lines up with no stride a kernel is likely to use;
/// a multiple of every verified element size.
const CHUNK: usize = 98_296;

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

/// What is asked to be rebound: a tensor of the instance (an input or a
/// grad-output), or one of its parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum What {
    Tensor(Role, usize),
    Param(usize),
}

impl What {
    /// How messages name it.
    fn describe(self, inst: &Placed) -> String {
        match self {
            What::Tensor(role, i) => inst.tensors(role)[i].describe(),
            What::Param(j) => format!("param {j}"),
        }
    }
}

/// A tensor or parameter asked to be rebound, with its plans.
struct Candidate {
    what: What,
    ptr: DevPtr,
    bytes: usize,
    dtype: DType,
    rebinding: Rebinding,
}

/// What planning decided for one tensor or parameter asked to be rebound.
enum Planned {
    Candidate(Candidate),
    Refused(What, String),
    /// Another callable's buffer, used in place: it keeps its feed.
    InPlace(What),
}

/// What verification decided: the plans kept, or why not.
type Decision = std::result::Result<Rebinding, String>;

/// The tensors and parameters of `inst` whose registration asks for
/// rebinding.
fn asked(s: &Inputs, inst: &Placed) -> Vec<What> {
    let spec = &s.callables[inst.callable];
    let inputs = spec.inputs.iter().enumerate();
    let outputs = spec.outputs.iter().enumerate();
    let params = spec.params.iter().enumerate();
    inputs
        .filter(|(_, t)| t.rebind)
        .map(|(i, _)| What::Tensor(Role::Input, i))
        .chain(
            outputs
                .filter(|(_, t)| t.rebind)
                .map(|(o, _)| What::Tensor(Role::GradOutput, o)),
        )
        .chain(
            params
                .filter(|(_, p)| p.flags.rebind)
                .map(|(j, _)| What::Param(j)),
        )
        .collect()
}

/// Plans the rebinding of `what` in the instance's graphs.
fn plan(inst: &Placed, graphs: &PassGraphs, what: What) -> Result<Planned> {
    let refused = |why: &str| Ok(Planned::Refused(what, why.to_string()));
    let (ptr, bytes, dtype) = match what {
        What::Tensor(role, index) => {
            let t = &inst.tensors(role)[index];
            match t.feed {
                Feed::Chained => return Ok(Planned::InPlace(what)),
                Feed::NotFed => {
                    return refused("it has no static buffer (no grad flows to this output)")
                }
                _ => {}
            }
            (t.ptr, t.bytes, t.dtype)
        }
        What::Param(j) => {
            let p = &inst.params[j];
            (p.ptr, p.bytes, p.dtype)
        }
    };
    if !VERIFIED.contains(&dtype) {
        let kept = match what {
            What::Tensor(..) => "tensors are copied",
            What::Param(_) => "parameters stay where they were registered",
        };
        return refused(&format!(
            "rebinding is verified with floating-point data; {} {kept}",
            dtype.name()
        ));
    }
    let mut plans = Vec::new();
    for g in graphs.all() {
        match g.rebinder(ptr, bytes)? {
            RebindPlan::Plan(p) => plans.push(p),
            // A pass that does not read the buffer needs no plan (a forward
            // never reads a grad-output; a backward may not read the input).
            RebindPlan::Unreferenced => {}
            RebindPlan::Refused(why) => return refused(&why),
        }
    }
    // A parameter that no graph takes the address of may still be read
    // through memory: verification tells. A tensor is copied instead.
    if plans.is_empty() && matches!(what, What::Tensor(..)) {
        return refused("no graph of the callable takes the buffer's address");
    }
    Ok(Planned::Candidate(Candidate {
        what,
        ptr,
        bytes,
        dtype,
        rebinding: Rebinding::new(plans, ptr),
    }))
}

/// Refuses parameters whose memory overlaps another candidate's: moved
/// apart, one plan would point the other's references away.
fn apart(inst: &Placed, cands: Vec<Candidate>, out: &mut Vec<(What, Decision)>) -> Vec<Candidate> {
    let overlaps = |a: &Candidate, b: &Candidate| {
        a.ptr < b.ptr + b.bytes as DevPtr && b.ptr < a.ptr + a.bytes as DevPtr
    };
    let shared: Vec<Option<What>> = cands
        .iter()
        .enumerate()
        .map(|(i, c)| match c.what {
            What::Param(_) => cands
                .iter()
                .enumerate()
                .find(|&(k, o)| k != i && overlaps(c, o))
                .map(|(_, o)| o.what),
            What::Tensor(..) => None,
        })
        .collect();
    let mut kept = Vec::with_capacity(cands.len());
    for (c, other) in cands.into_iter().zip(shared) {
        match other {
            Some(o) => out.push((
                c.what,
                Err(format!(
                    "its memory overlaps that of {} of the same callable: they cannot be \
                     pointed elsewhere apart",
                    o.describe(inst)
                )),
            )),
            None => kept.push(c),
        }
    }
    kept
}

/// Device memory verification works in: per verified dtype two pattern
/// chunks (A fills grad-outputs, B the buffers moved away from), a flag,
/// and room for one instance's results and two copies of each buffer
/// verified.
struct Workspace {
    memory: DeviceMemory,
    /// Where room starts.
    room: DevPtr,
}

impl Workspace {
    /// A workspace with `room` bytes of room; its patterns are on the
    /// device when it returns.
    fn new(backend: &Arc<dyn Backend>, room: usize) -> Result<Workspace> {
        const WHAT: &str = "the rebinding verification's workspace";
        let patterns = 2 * CHUNK * VERIFIED.len();
        let total = size::add(size::add(patterns, ALIGN, WHAT)?, room, WHAT)?;
        let memory = DeviceMemory::new(backend, total)?;
        for (d, &dtype) in VERIFIED.iter().enumerate() {
            for k in 0..2 {
                let at = memory.ptr() + ((2 * d + k) * CHUNK) as DevPtr;
                backend.upload(at, &pattern(dtype, CHUNK, 7 + 92 * k as u32))?;
            }
        }
        // A copy from pageable host memory may return before it has landed;
        // the capture stream is not ordered after it.
        backend.synchronize_all()?;
        let room = memory.ptr() + (patterns + ALIGN) as DevPtr;
        Ok(Workspace { memory, room })
    }

    /// Pattern `k` (0: A, 1: B) of `dtype`.
    fn pattern(&self, dtype: DType, k: usize) -> DevPtr {
        let d = VERIFIED.iter().position(|&v| v == dtype).unwrap_or(0);
        self.memory.ptr() + ((2 * d + k) * CHUNK) as DevPtr
    }

    fn flag(&self) -> DevPtr {
        self.room - ALIGN as DevPtr
    }

    /// Bytes of room.
    fn room_bytes(&self) -> usize {
        self.memory.bytes() - (self.room - self.memory.ptr()) as usize
    }
}

/// The results an instance's graphs write that verification compares:
/// outputs, input and parameter grads, and its clone slots' blocks.
fn results(inst: &Placed, graphs: &PassGraphs) -> Vec<(DevPtr, usize)> {
    let mut v = inst.results();
    let clone = inst.returns.clone.bytes;
    v.extend(graphs.slots.iter().map(|s| (s.block, clone)));
    v
}

/// The room one verification of `inst` with candidates of `bytes` needs:
/// its results, and two copies of each candidate.
fn room(results: &[(DevPtr, usize)], bytes: impl Iterator<Item = usize>) -> Result<usize> {
    const WHAT: &str = "the rebinding verification's workspace";
    let mut total = 0usize;
    for n in results.iter().map(|&(_, n)| n) {
        total = size::add(total, size::aligned(n, WHAT)?, WHAT)?;
    }
    for n in bytes {
        total = size::add(total, 2 * size::aligned(n, WHAT)?, WHAT)?;
    }
    Ok(total)
}

/// Places in the workspace's room, one after the other.
struct Room(DevPtr);

impl Room {
    fn take(&mut self, n: usize) -> DevPtr {
        let p = self.0;
        self.0 += n.div_ceil(ALIGN) as DevPtr * ALIGN as DevPtr;
        p
    }
}

/// One verification on the capture stream.
struct Verifier<'a> {
    backend: &'a dyn Backend,
    stream: StreamRef,
    ws: &'a Workspace,
    results: &'a [(DevPtr, usize)],
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

    /// Fills the instance's grad-outputs, but those at `except`, with
    /// pattern A: the data a backward is fed.
    fn feed_grad_outputs(&self, inst: &Placed, except: &[DevPtr]) -> Result<()> {
        let fed = inst
            .grad_outputs
            .iter()
            .filter(|t| t.ptr != 0 && !except.contains(&t.ptr));
        for t in fed {
            self.fill(t.ptr, t.bytes, t.dtype, 0)?;
        }
        Ok(())
    }

    /// Every graph of the instance, passes in order then the clone slots.
    fn run(&self, graphs: &PassGraphs) -> Result<()> {
        graphs.all().try_for_each(|g| g.launch(self.stream))
    }

    /// Whether the instance's graphs give the same results with every
    /// candidate moved to a copy of its data as when copying, and leave
    /// that copy as they found it. Every experiment starts from the data
    /// the static buffers hold when it is called, and puts it back, with
    /// the graphs pointing at the static buffers again, whatever happens.
    fn same(
        &self,
        inst: &Placed,
        graphs: &PassGraphs,
        cands: &mut [&mut Candidate],
    ) -> Result<bool> {
        let (b, s) = (self.backend, self.stream);
        let mut room = Room(self.ws.room);
        let snaps: Vec<DevPtr> = self.results.iter().map(|&(_, n)| room.take(n)).collect();
        // Per candidate: its data before anything ran, and the copy the
        // rebound run reads.
        let copies: Vec<(DevPtr, DevPtr)> = cands
            .iter()
            .map(|c| (room.take(c.bytes), room.take(c.bytes)))
            .collect();
        let moved_away: Vec<DevPtr> = cands.iter().map(|c| c.ptr).collect();
        let experiment = |cands: &mut [&mut Candidate]| -> Result<()> {
            self.feed_grad_outputs(inst, &[])?;
            for (c, &(orig, _)) in cands.iter().zip(&copies) {
                b.copy(orig, c.ptr, c.bytes, s)?;
            }
            self.run(graphs)?;
            for (&(p, n), &snap) in self.results.iter().zip(&snaps) {
                b.copy(snap, p, n, s)?;
            }
            for (c, &(orig, moved)) in cands.iter().zip(&copies) {
                b.copy(moved, orig, c.bytes, s)?;
                self.fill(c.ptr, c.bytes, c.dtype, 1)?;
            }
            // Updates take effect for later launches only: the copying run
            // already enqueued reads the static buffers.
            // The others are fed as in the copying run, which may have
            // changed them.
            self.feed_grad_outputs(inst, &moved_away)?;
            for (c, &(_, moved)) in cands.iter_mut().zip(&copies) {
                c.rebinding.bind(moved)?;
            }
            self.run(graphs)?;
            b.zero(self.ws.flag(), 4, s)?;
            for (&(p, n), &snap) in self.results.iter().zip(&snaps) {
                b.differ(p, snap, n, self.ws.flag(), s)?;
            }
            // A graph that writes what it is fed would write the caller's
            // data once rebound.
            for (c, &(orig, moved)) in cands.iter().zip(&copies) {
                b.differ(moved, orig, c.bytes, self.ws.flag(), s)?;
            }
            Ok(())
        };
        let ran = experiment(cands);
        // Back to the static buffers and their data, on every path.
        let mut restored = Ok(());
        for (c, &(orig, _)) in cands.iter_mut().zip(&copies) {
            let r = c
                .rebinding
                .bind(c.ptr)
                .and_then(|()| b.copy(c.ptr, orig, c.bytes, s));
            restored = restored.and(r);
        }
        let synced = b.synchronize(s);
        ran?;
        restored?;
        synced?;
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
            for (what, decision) in decided {
                log(s, inst, what, &decision);
                match what {
                    What::Tensor(role, i) => {
                        inst.tensors_mut(role)[i].feed = match decision {
                            Ok(r) => Feed::Rebound(r),
                            Err(why) => Feed::Refused(why),
                        }
                    }
                    What::Param(j) => {
                        inst.params[j].feed = match decision {
                            Ok(r) => ParamFeed::Rebound(r),
                            Err(why) => ParamFeed::Fixed(why),
                        }
                    }
                }
            }
        }
        let slots = g.slots.iter_mut().map(|s| &mut s.graph);
        for graph in g.passes.iter_mut().flatten().chain(slots) {
            kept += graph.release_template() as usize;
        }
    }
    Ok(kept)
}

const MOVED: &str = "a rebound replay at capture gave other results than a copying one, or wrote \
                     the data it was fed: some kernel reads the buffer through memory, writes it in \
                     place, or is not deterministic";

/// What verification decided for each of `wanted` (tensors read in place
/// keep their feed, with a message).
fn decide(
    s: &Inputs,
    inst: &Placed,
    graphs: &PassGraphs,
    wanted: &[What],
    stream: StreamRef,
    times: &mut CaptureTimes,
    ws: &mut Option<Workspace>,
) -> Result<Vec<(What, Decision)>> {
    let planned = times.time(Span::RebindPlan, |_| {
        wanted
            .iter()
            .map(|&what| plan(inst, graphs, what))
            .collect::<Result<Vec<_>>>()
    })?;
    let mut out = Vec::new();
    let mut cands = Vec::new();
    for p in planned {
        match p {
            Planned::Candidate(c) => cands.push(c),
            Planned::Refused(what, why) => out.push((what, Err(why))),
            Planned::InPlace(what) => log_in_place(s, inst, what),
        }
    }
    let mut cands = apart(inst, cands, &mut out);
    if cands.is_empty() {
        return Ok(out);
    }
    let results = results(inst, graphs);
    let kept = times.time(Span::RebindVerify, |_| -> Result<Result<Vec<bool>, String>> {
        let need = room(&results, cands.iter().map(|c| c.bytes))?;
        if !ws.as_ref().is_some_and(|w| w.room_bytes() >= need) {
            *ws = None;
            match Workspace::new(s.backend, need) {
                Ok(w) => *ws = Some(w),
                Err(e) => {
                    return Ok(Err(format!(
                        "verifying it needs {need} bytes of device memory, which could not be had: {e}"
                    )))
                }
            }
        }
        let Some(ws) = ws.as_ref() else {
            return Err(Error::Internal("no verification workspace".into()));
        };
        let v = Verifier {
            backend: s.backend.as_ref(),
            stream,
            ws,
            results: &results,
        };
        verify(&v, inst, graphs, &mut cands).map(Ok)
    })?;
    for (i, c) in cands.into_iter().enumerate() {
        let decision = match &kept {
            Ok(k) if k[i] => Ok(c.rebinding),
            Ok(_) => Err(MOVED.into()),
            Err(why) => Err(why.clone()),
        };
        out.push((c.what, decision));
    }
    Ok(out)
}

/// Which candidates to keep: all when they agree together; else each is
/// tried alone, and those that agree alone are tried together again (what
/// replays bind together must agree together), all refused when they do not.
fn verify(
    v: &Verifier,
    inst: &Placed,
    graphs: &PassGraphs,
    cands: &mut [Candidate],
) -> Result<Vec<bool>> {
    let mut all: Vec<&mut Candidate> = cands.iter_mut().collect();
    if v.same(inst, graphs, &mut all)? {
        return Ok(vec![true; cands.len()]);
    }
    if cands.len() == 1 {
        return Ok(vec![false]);
    }
    let mut keep = Vec::with_capacity(cands.len());
    for c in cands.iter_mut() {
        keep.push(v.same(inst, graphs, &mut [c])?);
    }
    let n = keep.iter().filter(|&&k| k).count();
    if n >= 2 && n < cands.len() {
        let mut kept: Vec<&mut Candidate> = cands
            .iter_mut()
            .zip(&keep)
            .filter(|(_, &k)| k)
            .map(|(c, _)| c)
            .collect();
        if !v.same(inst, graphs, &mut kept)? {
            keep.iter_mut().for_each(|k| *k = false);
        }
    }
    Ok(keep)
}

fn log_in_place(s: &Inputs, inst: &Placed, what: What) {
    let (name, mb) = (&s.callables[inst.callable].name, inst.microbatch);
    let what = what.describe(inst);
    s.log(LogLevel::Info, || {
        format!(
            "{what} of callable '{name}' (microbatch {mb}) is another callable's buffer, used in place: \
             it is never copied, so rebinding does not apply"
        )
    });
}

fn log(s: &Inputs, inst: &Placed, what: What, decision: &Decision) {
    let (name, mb) = (&s.callables[inst.callable].name, inst.microbatch);
    let (moved, kept) = match what {
        What::Tensor(..) => ("is rebound at replay", "is copied at replay"),
        What::Param(_) => (
            "can move: replays point its graphs at its new address",
            "cannot move: a replay at another address is refused",
        ),
    };
    let what = what.describe(inst);
    match decision {
        Ok(r) => s.log(LogLevel::Info, || {
            format!(
                "{what} of callable '{name}' (microbatch {mb}) {moved}: {} node(s)",
                r.nodes()
            )
        }),
        Err(why) => s.log(LogLevel::Warn, || {
            format!("{what} of callable '{name}' (microbatch {mb}) {kept}: {why}")
        }),
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
        /// Zeroes its input after reading it (an in-place writer).
        writes_input: bool,
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
            let src = self.src.load(Relaxed);
            self.backend.copy(self.dst, src, BYTES, stream)?;
            if self.writes_input {
                self.backend.zero(src, BYTES, stream)?;
            }
            Ok(())
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
        writes_input: bool,
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
                    writes_input,
                    launches: launches.clone(),
                }) as Box<dyn Graph>);
                g
            })
            .collect();
        (placed, graphs, launches, statics)
    }

    /// The placed instances after `resolve`, the launches it made, and
    /// their static memory (kept alive for the caller to read).
    fn resolved(f: &Fixture, honest: &[bool]) -> (Vec<Placed>, usize, DeviceMemory) {
        resolved_with(f, honest, false)
    }

    fn resolved_with(
        f: &Fixture,
        honest: &[bool],
        writes_input: bool,
    ) -> (Vec<Placed>, usize, DeviceMemory) {
        let (mut placed, mut graphs, launches, statics) = setup(f, honest, writes_input);
        let mut times = CaptureTimes::default();
        let s = f.inputs();
        resolve(&s, &mut placed, &mut graphs, StreamRef(0), &mut times).unwrap();
        (placed, launches.load(Relaxed), statics)
    }

    #[test]
    fn verification_keeps_what_gives_the_same_bits_and_refuses_the_rest() {
        let mut f = host_inputs(&[("honest", 1, false), ("sneaky", 1, false)]);
        for c in &mut f.callables {
            c.inputs[0].rebind = true;
        }
        let (placed, launches, _statics) = resolved(&f, &[true, false]);
        assert!(placed[0].inputs[0].feed.is_rebound());
        let Feed::Refused(why) = &placed[1].inputs[0].feed else {
            panic!("the sneaky graph reads the static buffer")
        };
        assert!(why.contains("other results"), "{why}");
        // One copying and one rebound replay of each instance's graph: with
        // one tensor, "together" is "alone".
        assert_eq!(launches, 2 + 2);
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
        let (placed, launches, _statics) = resolved(&f, &[true]);
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
        let (placed, launches, _statics) = resolved(&f, &[true, true, true]);
        let why = |feed: &Feed| match feed {
            Feed::Refused(w) => w.clone(),
            _ => panic!("refused"),
        };
        assert!(why(&placed[0].inputs[0].feed).contains("floating-point"));
        assert!(why(&placed[0].grad_outputs[0].feed).contains("no static buffer"));
        assert!(
            matches!(placed[2].inputs[0].feed, Feed::Chained),
            "a chained input keeps its feed (and its replay checks)"
        );
        assert_eq!(launches, 0, "nothing was verified");
    }

    #[test]
    fn a_graph_that_writes_what_it_is_fed_is_not_rebound() {
        let mut f = host_inputs(&[("in_place", 1, false)]);
        f.callables[0].inputs[0].rebind = true;
        let (placed, _, _statics) = resolved_with(&f, &[true], true);
        let Feed::Refused(why) = &placed[0].inputs[0].feed else {
            panic!("rebound, the graph would zero the caller's input")
        };
        assert!(why.contains("wrote the data it was fed"), "{why}");
        // The static input holds what it held before verification.
        let mut back = [0u8; BYTES];
        f.backend
            .download(&mut back, placed[0].inputs[0].ptr)
            .unwrap();
        assert_eq!(back, [3u8; BYTES]);
    }
}
