//! The input bytes as a program: how an op reads each of its choices. An
//! exhausted input reads zeros, which pick the plain, valid choice. How a
//! choice is read is what every committed corpus input means: change it
//! only on purpose.

use super::*;

pub struct Input {
    pub data: Vec<u8>,
    pub pos: Cell<usize>,
}

impl Input {
    pub fn byte(&self) -> u8 {
        let p = self.pos.get();
        self.pos.set(p + 1);
        self.data.get(p).copied().unwrap_or(0)
    }
    pub fn below(&self, n: usize) -> usize {
        if n <= 1 {
            return 0;
        }
        if n <= 256 {
            self.byte() as usize % n
        } else {
            (self.byte() as usize | (self.byte() as usize) << 8) % n
        }
    }
    /// True with probability k/256 (false on an exhausted input).
    pub fn chance(&self, k: u8) -> bool {
        self.byte() >= 255 - k.saturating_sub(1) && k > 0
    }
    pub fn pick<T: Copy>(&self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
    pub fn u64(&self) -> u64 {
        (0..8).fold(0u64, |a, _| a << 8 | self.byte() as u64)
    }
    pub fn done(&self) -> bool {
        self.pos.get() >= self.data.len()
    }
}
