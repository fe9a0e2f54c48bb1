//! Buckets on the device: the block after the static buffers where the
//! device holds each callable's actual size (written by a replay, read by
//! its kernels), the count of sizes no bucket held, and each bucketed
//! callable's table of bucket sizes; what the host knows the device holds
//! there; and the graphs that choose a bucket on the device: per pass, a
//! SWITCH node whose body i is bucket i's graph of that pass.

use super::spec::CallableSpec;
use crate::backend::{Backend, CaptureEnd, CaptureMode, Choice, DevPtr, Graph, StreamRef};
use crate::core::size;
use crate::error::{Error, Result};

/// Where the device holds the sizes of a session's callables: u64 words,
/// the actual sizes (one per callable), the overflow counts (one per
/// callable), then each bucketed callable's bucket sizes.
pub(crate) struct SizeBlock {
    pub base: DevPtr,
    callables: usize,
    /// Per callable: its table (0 without buckets).
    tables: Vec<DevPtr>,
}

impl SizeBlock {
    /// Bytes the block of `callables` takes (0 when none has buckets).
    pub fn bytes(callables: &[CallableSpec]) -> Result<usize> {
        if callables.iter().all(|c| c.buckets.is_empty()) {
            return Ok(0);
        }
        let words = 2 * callables.len() + callables.iter().map(|c| c.buckets.len()).sum::<usize>();
        size::aligned(8 * words, "the bucket sizes")
    }

    /// The block of `callables` at `base` (0: none).
    pub fn at(base: DevPtr, callables: &[CallableSpec]) -> SizeBlock {
        let n = callables.len();
        let mut next = base + 16 * n as DevPtr;
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
        }
    }

    /// The u64 holding callable `c`'s actual size.
    pub fn actual(&self, c: usize) -> DevPtr {
        self.base + 8 * c as DevPtr
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

/// The graph that chooses callable `c`'s bucket on the device and runs
/// `bodies[i]`, a bucket's graph of one pass (or of one clone slot of it),
/// for bucket i: a SWITCH node over copies of them. Recorded on `stream`,
/// which must not be capturing. None in `bodies`: a bucket without that
/// graph (an internal error).
pub(crate) fn capture_switch(
    (backend, (stream, mode), block): (&dyn Backend, (StreamRef, CaptureMode), &SizeBlock),
    c: usize,
    bodies: Option<Vec<&dyn Graph>>,
) -> Result<Box<dyn Graph>> {
    let bodies =
        bodies.ok_or_else(|| Error::Internal("a bucket without the graph to choose".into()))?;
    backend.begin_capture(stream, mode)?;
    let recorded = backend.capture_switch(stream, block.choice(c), &bodies);
    let ended = backend.end_capture(stream);
    recorded?;
    match ended? {
        CaptureEnd::Graph(g) => Ok(g),
        CaptureEnd::Invalidated(why) => Err(Error::Internal(format!(
            "the capture of a bucket choice was invalidated: {why}"
        ))),
    }
}
