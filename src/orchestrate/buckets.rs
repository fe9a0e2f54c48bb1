//! Buckets on the device: the block after the static buffers where the
//! device holds each callable's actual size (written by a replay, read by
//! its kernels), the count of sizes no bucket held, and each bucketed
//! callable's table of bucket sizes; which padding rows of bucketed buffers
//! the host knows are zero; and the graphs that choose a bucket on the
//! device: per pass, the padding zeroed past the size, then a SWITCH node
//! whose body i is bucket i's graph of that pass, and which, for a size
//! above the largest bucket, zeroes what the pass writes instead.

use super::instance::Placed;
use super::spec::CallableSpec;
use super::tensor::{Feed, Tensor};
use crate::backend::{
    Backend, CaptureEnd, CaptureMode, Choice, DevPtr, Graph, Rows2d, StreamRef, Tail,
};
use crate::core::layout::Role;
use crate::core::padded::Padded;
use crate::core::size;
use crate::core::PassKind;
use crate::error::{Error, Result};

/// Where the device holds the sizes of a session's callables: u64 words,
/// the actual sizes (one per callable), the overflow counts (one per
/// callable), the actual second sizes of grids (one per callable), then
/// each bucketed callable's bucket sizes.
pub(crate) struct SizeBlock {
    pub base: DevPtr,
    callables: usize,
    /// Per callable: its table (0 without buckets).
    tables: Vec<DevPtr>,
    /// Per callable, the sizes the device holds, where the host knows
    /// them (written by a host-chosen forward; unknown after capture and
    /// after a forward that chose on the device).
    held: Vec<Option<u64>>,
    held2: Vec<Option<u64>>,
}

impl SizeBlock {
    /// Bytes the block of `callables` takes (0 when none has buckets).
    pub fn bytes(callables: &[CallableSpec]) -> Result<usize> {
        if callables.iter().all(|c| c.buckets.is_empty()) {
            return Ok(0);
        }
        let words = 3 * callables.len() + callables.iter().map(|c| c.buckets.len()).sum::<usize>();
        size::aligned(8 * words, "the bucket sizes")
    }

    /// The block of `callables` at `base` (0: none).
    pub fn at(base: DevPtr, callables: &[CallableSpec]) -> SizeBlock {
        let n = callables.len();
        let mut next = base + 24 * n as DevPtr;
        let tables = callables
            .iter()
            .map(|c| match c.buckets.len() {
                0 => 0,
                k => {
                    let t = next;
                    next += 8 * k as DevPtr;
                    t
                }
            })
            .collect();
        SizeBlock {
            base,
            callables: n,
            tables,
            held: vec![None; n],
            held2: vec![None; n],
        }
    }

    /// The u64 holding callable `c`'s actual size.
    pub fn actual(&self, c: usize) -> DevPtr {
        self.base + 8 * c as DevPtr
    }

    /// The u64 holding callable `c`'s actual second size (grids).
    pub fn actual2(&self, c: usize) -> DevPtr {
        self.base + 8 * (2 * self.callables + c) as DevPtr
    }

    /// Before a forward of callable `c`: puts its sizes where the device
    /// reads them (`n` rows and, with a grid, `n2` chosen on the host, or
    /// a copy of the u64 at `device_size`). Only its forwards write there:
    /// a size the device holds already is not written again.
    pub fn put(
        &mut self,
        backend: &dyn Backend,
        c: usize,
        (n, n2, device_size): (u64, u64, DevPtr),
        stream: StreamRef,
    ) -> Result<()> {
        let at = self.actual(c);
        if device_size != 0 {
            self.held[c] = None;
            return backend.copy(at, device_size, 8, stream);
        }
        Self::write(backend, (at, n), &mut self.held[c], stream)?;
        if n2 != 0 {
            Self::write(backend, (self.actual2(c), n2), &mut self.held2[c], stream)?;
        }
        Ok(())
    }

    /// Writes `n` at `at` unless `held` says it is there.
    fn write(
        backend: &dyn Backend,
        (at, n): (DevPtr, u64),
        held: &mut Option<u64>,
        stream: StreamRef,
    ) -> Result<()> {
        if *held != Some(n) {
            // Sizes fit in 32 bits (bounded by a bucket); the high word
            // stays zero.
            *held = None;
            backend.fill(at, n as u32, 4, 1, stream)?;
            *held = Some(n);
        }
        Ok(())
    }

    fn overflows(&self, c: usize) -> DevPtr {
        self.base + 8 * (self.callables + c) as DevPtr
    }

    /// Writes every table on `stream` (after the block was zeroed there:
    /// the sizes fit in 32 bits, the high words stay zero).
    pub fn write_tables(
        &self,
        backend: &dyn Backend,
        callables: &[CallableSpec],
        stream: StreamRef,
    ) -> Result<()> {
        for (c, spec) in callables.iter().enumerate() {
            for (i, &b) in spec.buckets.iter().enumerate() {
                backend.fill(self.tables[c] + 8 * i as DevPtr, b as u32, 4, 1, stream)?;
            }
        }
        Ok(())
    }

    /// Sizes no bucket held, over every callable, as the device counted
    /// them (0 without a block).
    pub fn overflow_count(&self, backend: &dyn Backend) -> Result<u64> {
        if self.base == 0 {
            return Ok(0);
        }
        let mut words = vec![0u8; 8 * self.callables];
        backend.download(&mut words, self.overflows(0))?;
        Ok(words
            .chunks(8)
            .map(|w| u64::from_ne_bytes(w.try_into().unwrap_or([0; 8])))
            .sum())
    }

    fn choice(&self, c: usize) -> Choice {
        Choice {
            size: self.actual(c),
            table: self.tables[c],
            overflows: self.overflows(c),
        }
    }
}

/// What the host knows of the padding of bucketed buffers the replays
/// fill (inputs, grad-outputs) whose data is a prefix, so that a replay
/// zeroes only bytes that may hold something: per buffer, bytes `[from,
/// to)` known zero.
/// Only replays write these buffers (callbacks read their inputs and
/// grad-outputs); anything the host did not see (a replay on what the
/// static buffer holds, a fill of the whole buffer, capture) forgets.
pub(crate) struct Zeroed {
    /// Per callable: its inputs' buffers, then its grad-outputs'.
    known: Vec<Vec<Option<(u64, u64)>>>,
    inputs: Vec<usize>,
}

impl Zeroed {
    pub fn new(callables: &[CallableSpec]) -> Zeroed {
        Zeroed {
            known: callables
                .iter()
                .map(|c| vec![None; c.inputs.len() + c.outputs.len()])
                .collect(),
            inputs: callables.iter().map(|c| c.inputs.len()).collect(),
        }
    }

    fn slot(&mut self, (c, role, i): (usize, Role, usize)) -> Option<&mut Option<(u64, u64)>> {
        let at = match role {
            Role::GradOutput => self.inputs[c] + i,
            _ => i,
        };
        self.known.get_mut(c)?.get_mut(at)
    }

    /// After its first `n` bytes were put into `t` (`copied` from the
    /// caller, or left as the caller wrote them): zeroes its bytes from `n`
    /// to its bucket's end unless they are known zero.
    pub fn pad(
        &mut self,
        backend: &dyn Backend,
        key: (usize, Role, usize),
        t: &Tensor,
        (n, copied): (u64, bool),
        stream: StreamRef,
    ) -> Result<()> {
        let end = t.bytes as u64;
        let Some(known) = self.slot(key) else {
            return Err(Error::Internal(
                "a bucketed buffer out of the padding table".into(),
            ));
        };
        match *known {
            Some((from, to)) if copied && from <= n && to >= end => {
                *known = Some((n, to));
            }
            _ => {
                *known = None;
                if n < end {
                    backend.zero(t.ptr + n as DevPtr, (end - n) as usize, stream)?;
                }
                *known = Some((n, end));
            }
        }
        Ok(())
    }

    /// Forgets what is known of a buffer filled otherwise.
    pub fn forget(&mut self, key: (usize, Role, usize)) {
        if let Some(known) = self.slot(key) {
            *known = None;
        }
    }
}

/// Puts the data of a DYNAMIC tensor whose data is rows of a pitch (`at`)
/// into its buffer at `dst`: copied from `src` (contiguous rows; 0: left
/// as the buffer holds it), and every padding byte of the bucket zeroed
/// (each row's tail, then the bytes past the last row).
pub(crate) fn pad_rows(
    backend: &dyn Backend,
    (dst, src): (DevPtr, DevPtr),
    at: Padded,
    stream: StreamRef,
) -> Result<()> {
    let (rows, width, pitch) = (at.rows as usize, at.width as usize, at.pitch as usize);
    let r = Rows2d {
        dst,
        dst_pitch: pitch,
        src,
        src_pitch: width,
        width,
        rows,
    };
    if src != 0 {
        backend.copy_2d(r, stream)?;
    }
    if pitch > width {
        let tails = Rows2d {
            dst: dst + width as DevPtr,
            src: 0,
            width: pitch - width,
            ..r
        };
        backend.zero_2d(tails, stream)?;
    }
    let end = (at.rows * at.pitch) as usize;
    if end < at.bytes as usize {
        backend.zero(dst + end as DevPtr, at.bytes as usize - end, stream)?;
    }
    Ok(())
}

/// What pass `kind` of `inst` writes, as (address, bytes): its outputs
/// (forward), its input grads (backward) and, from the pass that writes
/// them, its parameter grads (the CLONE ones into `slot`, the block of a
/// clone slot's graph, when given). A pass whose size no bucket holds
/// writes zeros there instead (`capture_switch`).
pub(crate) fn written(inst: &Placed, kind: PassKind, slot: Option<DevPtr>) -> Vec<(DevPtr, usize)> {
    let tensors: &[Tensor] = match kind {
        PassKind::Forward => &inst.outputs,
        PassKind::Backward => &inst.grad_inputs,
        PassKind::Wgrad => &[],
    };
    let mut v: Vec<(DevPtr, usize)> = tensors.iter().map(|t| (t.ptr, t.bytes)).collect();
    if kind != PassKind::Forward && kind == inst.grad_pass() {
        let at = match slot {
            Some(b) => inst.param_grads_into(b),
            None => inst.param_grads.iter().map(|t| t.ptr).collect(),
        };
        v.extend(
            at.into_iter()
                .zip(&inst.param_grads)
                .map(|(p, t)| (p, t.bytes)),
        );
    }
    v.retain(|&(p, n)| p != 0 && n > 0);
    v
}

/// The graph that chooses the bucket of `largest`'s callable on the device
/// for pass `kind` and runs `bodies[i]`, a bucket's graph of that pass (or
/// of one clone slot of it, whose block is `slot`), for bucket i: the rows
/// of the fed DYNAMIC buffers past the size zeroed (a replay fills them
/// whole), then a SWITCH node over copies of the bodies, which for a size
/// above the largest bucket counts it and zeroes what the pass writes
/// (`written`: outputs, input grads, parameter grads are then defined).
/// Recorded on `stream`, which must not be capturing. None in `bodies`: a
/// bucket without that graph (an internal error).
pub(crate) fn capture_switch(
    (backend, (stream, mode), block): (&dyn Backend, (StreamRef, CaptureMode), &SizeBlock),
    (largest, kind, slot): (&Placed, PassKind, Option<DevPtr>),
    bodies: Option<Vec<&dyn Graph>>,
) -> Result<Box<dyn Graph>> {
    let bodies =
        bodies.ok_or_else(|| Error::Internal("a bucket without the graph to choose".into()))?;
    let c = largest.callable;
    backend.begin_capture(stream, mode)?;
    let recorded = (|| {
        if let Some(role) = Placed::fed_role(kind) {
            // Chained buffers are their producer's (their rows past the
            // size are the producer's, finite).
            let fed =
                |t: &&Tensor| t.row_bytes > 0 && t.ptr != 0 && !matches!(t.feed, Feed::Chained);
            for t in largest.tensors(role).iter().filter(fed) {
                let tail = Tail {
                    dst: t.ptr,
                    row: t.row_bytes,
                    size: block.actual(c),
                    bytes: t.bytes,
                    most: t.bytes,
                };
                backend.zero_tail(tail, stream)?;
            }
        }
        backend.capture_switch(
            stream,
            block.choice(c),
            &bodies,
            &written(largest, kind, slot),
        )
    })();
    let ended = backend.end_capture(stream);
    recorded?;
    match ended? {
        CaptureEnd::Graph(g) => Ok(g),
        CaptureEnd::Invalidated(why) => Err(Error::Internal(format!(
            "the capture of a bucket choice was invalidated: {why}"
        ))),
    }
}
