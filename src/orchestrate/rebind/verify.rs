//! Verification replays: the device memory they work in (pattern chunks,
//! a flag, room for snapshots and copies), what one verification replays
//! and compares (`Subject`: an instance's graphs, or a step's), and the
//! experiment itself (`Verifier::same`): a copying run, then a run with
//! every candidate moved (one that is read to a copy of its data, one that
//! is written, a grad, to memory holding a pattern with a guard of pattern
//! after it) while its old memory holds another pattern, compared on the
//! device; one flag comes back.

use super::Candidate;
use crate::backend::{Backend, DevPtr, DeviceMemory, Graph, StreamRef};
use crate::core::dtype::DType;
use crate::core::size;
use crate::core::ALIGN;
use crate::error::Result;
use crate::orchestrate::instance::{PassGraphs, Placed};
use std::sync::Arc;

/// Bytes of pattern made on the host per dtype; larger buffers are filled
/// by copying it over and over on the device. Not a power of two, so that
/// the pattern's period lines up with no stride a kernel is likely to use;
/// a multiple of every verified element size.
pub(super) const CHUNK: usize = 98_296;

/// The dtypes rebinding is verified with (floating point: a pattern of
/// ordinary values, no NaN or infinity that a kernel could treat apart).
pub(super) const VERIFIED: [DType; 4] = [DType::F32, DType::F16, DType::Bf16, DType::F64];

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

/// Device memory verification works in: per verified dtype two pattern
/// chunks (A fills grad-outputs, B the buffers moved away from), a flag,
/// and room for one subject's results, its kept memory and two copies of
/// each buffer verified.
pub(super) struct Workspace {
    memory: DeviceMemory,
    /// Where room starts.
    room: DevPtr,
}

impl Workspace {
    /// A workspace with `room` bytes of room; its patterns are on the
    /// device when it returns.
    pub fn new(backend: &Arc<dyn Backend>, room: usize) -> Result<Workspace> {
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
    pub fn room_bytes(&self) -> usize {
        self.memory.bytes() - (self.room - self.memory.ptr()) as usize
    }
}

/// What one verification replays: its graphs, in order, the grad-outputs
/// they are fed (pattern A before each run), the results they write that
/// are compared, and the caller's memory they read and write (a step's
/// grad destinations), put back before the second run and at the end.
pub(super) struct Subject<'a> {
    pub graphs: Vec<&'a dyn Graph>,
    pub fed: Vec<(DevPtr, usize, DType)>,
    pub results: Vec<(DevPtr, usize)>,
    pub kept: Vec<(DevPtr, usize)>,
}

impl<'a> Subject<'a> {
    /// An instance's graphs (passes in order, then its clone slots); its
    /// results are its outputs, its input and parameter grads and its
    /// slots' blocks.
    pub fn instance(inst: &Placed, graphs: &'a PassGraphs) -> Subject<'a> {
        let mut results = inst.results();
        let clone = inst.returns.clone.bytes;
        results.extend(graphs.slots.iter().map(|s| (s.block, clone)));
        Subject {
            graphs: graphs.all().collect(),
            fed: fed(std::iter::once(inst)),
            results,
            kept: Vec::new(),
        }
    }

    /// The room one verification with candidates of `bytes` needs: its
    /// results and kept memory, and two copies of each candidate.
    pub fn room(&self, bytes: impl Iterator<Item = usize>) -> Result<usize> {
        const WHAT: &str = "the rebinding verification's workspace";
        let mut total = 0usize;
        let ones = self.results.iter().chain(&self.kept).map(|&(_, n)| n);
        for n in ones.chain(bytes.flat_map(|n| [n, n])) {
            total = size::add(total, size::aligned(n, WHAT)?, WHAT)?;
        }
        Ok(total)
    }
}

/// The grad-outputs of `insts` that have a buffer, as verification feeds
/// them.
pub(super) fn fed<'p>(insts: impl Iterator<Item = &'p Placed>) -> Vec<(DevPtr, usize, DType)> {
    insts
        .flat_map(|i| &i.grad_outputs)
        .filter(|t| t.ptr != 0)
        .map(|t| (t.ptr, t.bytes, t.dtype))
        .collect()
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
pub(super) struct Verifier<'a> {
    pub backend: &'a dyn Backend,
    pub stream: StreamRef,
    pub ws: &'a Workspace,
    pub subject: &'a Subject<'a>,
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

    /// Fills the subject's grad-outputs, but those at `except`, with
    /// pattern A: the data a backward is fed.
    fn feed(&self, except: &[DevPtr]) -> Result<()> {
        let fed = self.subject.fed.iter().filter(|t| !except.contains(&t.0));
        for &(p, n, dtype) in fed {
            self.fill(p, n, dtype, 0)?;
        }
        Ok(())
    }

    /// Every graph of the subject, in order.
    fn run(&self) -> Result<()> {
        self.subject
            .graphs
            .iter()
            .try_for_each(|g| g.launch(self.stream))
    }

    /// Copies each of `from` to the place of the same index in `to` (or
    /// back, `back`).
    fn copy_all(&self, from: &[(DevPtr, usize)], to: &[DevPtr], back: bool) -> Result<()> {
        for (&(p, n), &q) in from.iter().zip(to) {
            let (dst, src) = if back { (p, q) } else { (q, p) };
            self.backend.copy(dst, src, n, self.stream)?;
        }
        Ok(())
    }

    /// Whether the subject's graphs give the same results with every
    /// candidate moved to a copy of its data as when copying, and leave
    /// that copy as they found it; a written candidate (a grad) moved to
    /// memory holding a pattern, where the moved run must write what the
    /// copying run wrote into its buffer, and nothing into the guard after
    /// it. Every experiment starts from the data the static buffers hold
    /// when it is called, and puts it back (and the kept memory), with the
    /// graphs pointing at the static buffers again, whatever happens.
    pub fn same(&self, cands: &mut [&mut Candidate]) -> Result<bool> {
        let (b, s) = (self.backend, self.stream);
        let (results, kept) = (&self.subject.results, &self.subject.kept);
        let mut room = Room(self.ws.room);
        let snaps: Vec<DevPtr> = results.iter().map(|&(_, n)| room.take(n)).collect();
        let keeps: Vec<DevPtr> = kept.iter().map(|&(_, n)| room.take(n)).collect();
        // Per candidate: its data before anything ran, and the copy the
        // rebound run reads (for a grad: the memory it writes, then the
        // guard).
        let copies: Vec<(DevPtr, DevPtr)> = cands
            .iter()
            .map(|c| (room.take(c.bytes), room.take(c.room())))
            .collect();
        let moved_away: Vec<DevPtr> = cands.iter().map(|c| c.ptr).collect();
        // Where the moved run leaves each result: a grad where it was moved.
        let written_at = |p: DevPtr| {
            cands
                .iter()
                .zip(&copies)
                .find(|(c, _)| c.what.written() && c.ptr == p)
                .map_or(p, |(_, &(_, moved))| moved)
        };
        let result_at: Vec<DevPtr> = results.iter().map(|&(p, _)| written_at(p)).collect();
        self.copy_all(kept, &keeps, false)?;
        let experiment = |cands: &mut [&mut Candidate]| -> Result<()> {
            self.feed(&[])?;
            for (c, &(orig, _)) in cands.iter().zip(&copies) {
                b.copy(orig, c.ptr, c.bytes, s)?;
            }
            self.run()?;
            self.copy_all(results, &snaps, false)?;
            self.copy_all(kept, &keeps, true)?;
            for (c, &(orig, moved)) in cands.iter().zip(&copies) {
                if c.what.written() {
                    self.fill(moved, c.bytes, c.dtype, 1)?;
                    self.fill(moved + c.bytes as DevPtr, CHUNK, c.dtype, 1)?;
                } else {
                    b.copy(moved, orig, c.bytes, s)?;
                }
                self.fill(c.ptr, c.bytes, c.dtype, 1)?;
            }
            // Updates take effect for later launches only: the copying run
            // already enqueued reads the static buffers.
            // The others are fed as in the copying run, which may have
            // changed them.
            self.feed(&moved_away)?;
            for (c, &(_, moved)) in cands.iter_mut().zip(&copies) {
                c.rebinding.bind(moved)?;
            }
            self.run()?;
            b.zero(self.ws.flag(), 4, s)?;
            for ((&(_, n), &snap), &p) in results.iter().zip(&snaps).zip(&result_at) {
                b.differ(p, snap, n, self.ws.flag(), s)?;
            }
            for (c, &(orig, moved)) in cands.iter().zip(&copies) {
                if c.what.written() {
                    // Nothing past its end: a temporary the plan moved with
                    // it would reach there.
                    let guard = moved + c.bytes as DevPtr;
                    b.differ(guard, self.ws.pattern(c.dtype, 1), CHUNK, self.ws.flag(), s)?;
                } else {
                    // A graph that writes what it is fed would write the
                    // caller's data once rebound.
                    b.differ(moved, orig, c.bytes, self.ws.flag(), s)?;
                }
            }
            Ok(())
        };
        let ran = experiment(cands);
        // Back to the static buffers and their data, on every path.
        let mut restored = self.copy_all(kept, &keeps, true);
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
