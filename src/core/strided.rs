//! Strided regions of caller memory: `count` blocks of `bytes` bytes, block
//! i at `ptr + i * stride`. A step over several microbatches reads each
//! microbatch's inputs from such a region and writes its outputs to one;
//! here are the rules they must keep (no block past the address space, no
//! two blocks of one region overlapping) and the exact test of whether two
//! regions share a byte, which interleaved layouts (input and target of
//! each microbatch side by side) need instead of comparing hulls.

use std::ops::Range;

/// `count` blocks of `bytes` bytes, block i at `ptr + i * stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    pub ptr: u64,
    pub stride: u64,
    pub bytes: u64,
    pub count: u64,
}

impl Strided {
    /// Why the region is not usable (None: it is): a NULL start, no bytes,
    /// blocks that overlap each other, or an end past the address space.
    pub fn problem(&self) -> Option<String> {
        if self.ptr == 0 {
            return Some("is NULL".into());
        }
        if self.bytes == 0 || self.count == 0 {
            return Some("holds no bytes".into());
        }
        if self.count > 1 && self.stride < self.bytes {
            return Some(format!(
                "has a stride of {} bytes for blocks of {} bytes: microbatch i + 1 would overlap \
                 microbatch i (the stride must be at least the block's size)",
                self.stride, self.bytes
            ));
        }
        if self.end().is_none() {
            return Some(format!(
                "runs past the end of the address space ({} blocks of {} bytes every {} bytes from 0x{:x})",
                self.count, self.bytes, self.stride, self.ptr
            ));
        }
        None
    }

    /// One past the last byte of the last block (None: it overflows).
    pub fn end(&self) -> Option<u64> {
        let last = self.count.checked_sub(1)?.checked_mul(self.stride)?;
        self.ptr.checked_add(last)?.checked_add(self.bytes)
    }

    /// Block i.
    pub fn block(&self, i: u64) -> Range<u64> {
        let start = self.ptr + i * self.stride;
        start..start + self.bytes
    }

    /// Whether a byte of one of the blocks lies in `r`. The region must be
    /// usable (`problem()` None). Visits only the blocks that can reach
    /// `r`: at most `r.len() / stride + 2` of them.
    pub fn touches(&self, r: &Range<u64>) -> bool {
        let Some(end) = self.end() else { return true };
        if r.start >= end || r.end <= self.ptr || r.is_empty() {
            return false;
        }
        if self.count == 1 || self.stride == 0 {
            let b = self.block(0);
            return b.start < r.end && r.start < b.end;
        }
        // Blocks i with block(i).end > r.start and block(i).start < r.end.
        let first = (r.start + 1)
            .saturating_sub(self.ptr + self.bytes)
            .div_ceil(self.stride);
        let last = ((r.end - 1 - self.ptr.min(r.end - 1)) / self.stride).min(self.count - 1);
        (first..=last).any(|i| {
            let b = self.block(i);
            b.start < r.end && r.start < b.end
        })
    }

    /// Whether the two regions share a byte (both usable). Walks the
    /// region with fewer blocks, each block tested against the other.
    pub fn overlaps(&self, other: &Strided) -> bool {
        let (few, many) = if self.count <= other.count {
            (self, other)
        } else {
            (other, self)
        };
        (0..few.count).any(|i| many.touches(&few.block(i)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(ptr: u64, stride: u64, bytes: u64, count: u64) -> Strided {
        Strided {
            ptr,
            stride,
            bytes,
            count,
        }
    }

    /// Byte by byte: the reference the fast tests are checked against.
    fn slow_overlap(a: &Strided, b: &Strided) -> bool {
        (0..a.count).any(|i| {
            (0..b.count).any(|j| {
                let (x, y) = (a.block(i), b.block(j));
                x.start < y.end && y.start < x.end
            })
        })
    }

    #[test]
    fn problems_are_named() {
        assert!(s(0, 16, 16, 2).problem().unwrap().contains("NULL"));
        assert!(s(64, 16, 0, 2).problem().unwrap().contains("no bytes"));
        assert!(s(64, 16, 16, 0).problem().unwrap().contains("no bytes"));
        assert!(s(64, 8, 16, 2).problem().unwrap().contains("overlap"));
        assert!(s(64, 0, 16, 2).problem().unwrap().contains("overlap"));
        assert!(s(u64::MAX - 8, 16, 16, 1)
            .problem()
            .unwrap()
            .contains("address space"));
        assert!(s(64, u64::MAX, 16, 3)
            .problem()
            .unwrap()
            .contains("address space"));
        // One block: the stride does not matter.
        assert_eq!(s(64, 0, 16, 1).problem(), None);
        assert_eq!(s(64, 16, 16, 4).problem(), None);
        assert_eq!(s(64, 32, 16, 4).end(), Some(64 + 3 * 32 + 16));
    }

    #[test]
    fn interleaved_regions_do_not_overlap() {
        // x0 t0 x1 t1 ...: inputs and targets side by side in one buffer.
        let x = s(1024, 64, 32, 100);
        let t = s(1024 + 32, 64, 32, 100);
        assert!(!x.overlaps(&t));
        assert!(!t.overlaps(&x));
        // One byte more and they meet.
        let t = s(1024 + 31, 64, 32, 100);
        assert!(x.overlaps(&t));
    }

    #[test]
    fn a_plain_range_is_tested_against_only_the_blocks_near_it() {
        let x = s(1000, 100, 10, 1_000_000);
        assert!(!x.touches(&(1010..1100)));
        assert!(x.touches(&(1009..1100)));
        assert!(x.touches(&(1099..1101)));
        assert!(!x.touches(&(0..1000)));
        assert!(!x.touches(&(1000 + 100 * 1_000_000..u64::MAX)));
        assert!(x.touches(&(1000 + 100 * 999_999 + 9..u64::MAX)));
        assert!(!x.touches(&(5000..5000)));
    }

    #[test]
    fn the_fast_test_agrees_with_the_slow_one() {
        // Deterministic pseudo-random regions (xorshift), small enough for
        // the byte-by-byte reference.
        let mut v = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            v ^= v << 13;
            v ^= v >> 7;
            v ^= v << 17;
            v % m
        };
        for _ in 0..20_000 {
            let bytes = 1 + next(12);
            let a = s(1 + next(200), bytes + next(20), bytes, 1 + next(8));
            let bytes = 1 + next(12);
            let b = s(1 + next(200), bytes + next(20), bytes, 1 + next(8));
            assert_eq!(a.overlaps(&b), slow_overlap(&a, &b), "{a:?} {b:?}");
            let r = next(300)..next(300);
            // An empty range holds no byte.
            let slow = !r.is_empty()
                && (0..a.count).any(|i| {
                    let x = a.block(i);
                    x.start < r.end && r.start < x.end
                });
            assert_eq!(a.touches(&r), slow, "{a:?} {r:?}");
        }
    }
}
