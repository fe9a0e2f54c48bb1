//! The scratch arena's offset allocator: first fit over a free list with
//! coalescing, in units of `ALIGN`. It only computes offsets; the memory
//! behind them is the backend's. Warmup runs it unbounded to measure the
//! high-water mark; capture runs it bounded by the arena that was allocated
//! from that measurement. Memory freed by one capture is reused by later
//! captures, as in PyTorch's graph pools (capture order is replay order).

use super::size::align_up;
use std::collections::BTreeMap;

#[derive(Clone, Debug, Default)]
pub struct Arena {
    /// None: unbounded (measuring).
    capacity: Option<usize>,
    /// Free ranges inside [0, top): offset -> length.
    free: BTreeMap<usize, usize>,
    /// Live allocations: offset -> length.
    live: BTreeMap<usize, usize>,
    top: usize,
    high_water: usize,
}

impl Arena {
    pub fn unbounded() -> Arena {
        Arena::default()
    }

    pub fn bounded(capacity: usize) -> Arena {
        Arena {
            capacity: Some(capacity),
            ..Arena::default()
        }
    }

    /// The bound (None: unbounded).
    pub fn capacity(&self) -> Option<usize> {
        self.capacity
    }

    /// Offset of a new allocation of `bytes`, or None when a bounded arena
    /// has no room (or the size would overflow the address space).
    pub fn alloc(&mut self, bytes: usize) -> Option<usize> {
        let len = align_up(bytes.max(1))?;
        let fit = self
            .free
            .iter()
            .find(|(_, &l)| l >= len)
            .map(|(&o, &l)| (o, l));
        let offset = if let Some((o, l)) = fit {
            self.free.remove(&o);
            if l > len {
                self.free.insert(o + len, l - len);
            }
            o
        } else {
            // Grow at the top, absorbing a free range that ends there.
            let (start, absorbed) = match self.free.iter().next_back() {
                Some((&o, &l)) if o + l == self.top => (o, true),
                _ => (self.top, false),
            };
            let end = start.checked_add(len)?;
            if self.capacity.is_some_and(|c| end > c) {
                return None;
            }
            if absorbed {
                self.free.remove(&start);
            }
            self.top = end;
            self.high_water = self.high_water.max(self.top);
            start
        };
        self.live.insert(offset, len);
        Some(offset)
    }

    /// Frees the allocation at `offset`; false if there is none.
    pub fn free(&mut self, offset: usize) -> bool {
        let Some(len) = self.live.remove(&offset) else {
            return false;
        };
        let (mut start, mut end) = (offset, offset + len);
        if let Some((&po, &pl)) = self.free.range(..offset).next_back() {
            if po + pl == start {
                self.free.remove(&po);
                start = po;
            }
        }
        if let Some(nl) = self.free.remove(&end) {
            end += nl;
        }
        if end == self.top {
            self.top = start;
        } else {
            self.free.insert(start, end - start);
        }
        true
    }

    /// Highest offset ever used: the arena size capture needs.
    pub fn high_water(&self) -> usize {
        self.high_water
    }

    pub fn live_bytes(&self) -> usize {
        self.live.values().sum()
    }

    pub fn live_count(&self) -> usize {
        self.live.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ALIGN;

    #[test]
    fn reuses_freed_space_and_tracks_high_water() {
        let mut a = Arena::unbounded();
        let x = a.alloc(1000).unwrap();
        let y = a.alloc(10).unwrap();
        assert_eq!((x, y), (0, 1024));
        assert_eq!(a.high_water(), 1024 + ALIGN);
        assert!(a.free(x));
        let z = a.alloc(500).unwrap();
        assert_eq!(z, 0, "first fit reuses the freed range");
        assert_eq!(a.high_water(), 1024 + ALIGN);
        assert!(!a.free(12345));
    }

    #[test]
    fn sizes_that_would_wrap_are_refused() {
        let mut a = Arena::unbounded();
        assert_eq!(a.alloc(usize::MAX), None);
        a.alloc(ALIGN).unwrap();
        assert_eq!(a.alloc(usize::MAX - 300), None, "top + len would wrap");
        let mut b = Arena::bounded(4 * ALIGN);
        b.alloc(ALIGN).unwrap();
        assert_eq!(b.alloc(usize::MAX), None);
        assert_eq!(b.high_water(), ALIGN);
    }

    #[test]
    fn coalesces_neighbours() {
        let mut a = Arena::unbounded();
        let p: Vec<usize> = (0..4).map(|_| a.alloc(ALIGN).unwrap()).collect();
        a.free(p[1]);
        a.free(p[2]);
        // [1] and [2] merged: a 2-unit allocation fits without growing.
        assert_eq!(a.alloc(2 * ALIGN).unwrap(), p[1]);
        assert_eq!(a.high_water(), 4 * ALIGN);
        a.free(p[3]);
        a.free(p[0]);
        a.free(p[1]);
        assert_eq!(a.live_count(), 0);
        assert_eq!(a.alloc(4 * ALIGN).unwrap(), 0, "everything merged back");
    }

    #[test]
    fn bounded_arena_refuses_overflow() {
        let mut a = Arena::bounded(2 * ALIGN);
        assert!(a.alloc(ALIGN).is_some());
        assert!(a.alloc(ALIGN).is_some());
        assert!(a.alloc(1).is_none());
    }

    #[test]
    fn same_sequence_fits_in_its_own_high_water() {
        // The capture-sizing contract: replaying the alloc/free sequence of
        // warmup in a bounded arena of the measured size always succeeds.
        let mut seed = 12345u64;
        let mut rnd = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as usize
        };
        for _ in 0..50 {
            let ops: Vec<(bool, usize)> = (0..200)
                .map(|_| (rnd() % 3 != 0, rnd() % 5000 + 1))
                .collect();
            let run = |a: &mut Arena| -> bool {
                let mut live = Vec::new();
                for &(alloc, n) in &ops {
                    if alloc || live.is_empty() {
                        match a.alloc(n) {
                            Some(o) => live.push(o),
                            None => return false,
                        }
                    } else {
                        let o = live.remove(n % live.len());
                        assert!(a.free(o));
                    }
                }
                true
            };
            let mut m = Arena::unbounded();
            assert!(run(&mut m));
            let mut b = Arena::bounded(m.high_water());
            assert!(run(&mut b));
            assert_eq!(b.high_water(), m.high_water());
        }
    }

    #[test]
    fn live_allocations_never_overlap() {
        let mut a = Arena::unbounded();
        let mut live: Vec<(usize, usize)> = Vec::new();
        let mut seed = 7u64;
        for step in 0..2000 {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            let r = (seed >> 33) as usize;
            if r % 3 == 0 && !live.is_empty() {
                let (o, _) = live.remove(r % live.len());
                assert!(a.free(o));
            } else {
                let n = r % 3000 + 1;
                let o = a.alloc(n).unwrap();
                for &(lo, ln) in &live {
                    assert!(o + n <= lo || lo + ln <= o, "step {step}: overlap");
                }
                live.push((o, n));
            }
        }
    }
}
