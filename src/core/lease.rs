//! Alias leases. Every alias the library hands out (a static output, an
//! input grad, an ALIAS parameter grad) can be a lease with a generation.
//! With strict leases on, a replay that would overwrite a buffer under a
//! lease still held fails before anything runs, naming the slot, instead of
//! corrupting what the caller holds.

use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::{Error, Result};

#[derive(Clone, Debug)]
struct Slot {
    /// Human name: "param 1 grad of callable 'fc2' (microbatch 0)".
    name: String,
    /// Logical static buffer the alias points into.
    buffer: usize,
    generation: u32,
    held: bool,
}

/// The lease table of a captured session.
///
/// A token is `epoch << 40 | (slot + 1) << 20 | generation`: 24 bits of
/// capture epoch, 20 bits of slot and 20 bits of generation (never 0). The
/// epoch numbers every capture of the process ([`next_epoch`]), so a token
/// from an earlier capture of the session, or from another session, is
/// refused.
#[derive(Clone, Debug, Default)]
pub struct Leases {
    epoch: u32,
    slots: Vec<Slot>,
}

const SLOT_BITS: u32 = 20;
const GEN_MASK: u32 = (1 << SLOT_BITS) - 1;
const EPOCH_SHIFT: u32 = 2 * SLOT_BITS;
const EPOCH_MASK: u32 = (1 << (64 - EPOCH_SHIFT)) - 1;
/// The most lease slots one capture can have.
pub const MAX_SLOTS: usize = (1 << SLOT_BITS) - 2;

/// The epoch of a new capture: process-wide, never 0, distinct for the
/// next 2^24 - 1 captures of the process.
pub fn next_epoch() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    loop {
        let e = NEXT.fetch_add(1, Ordering::Relaxed) & EPOCH_MASK;
        if e != 0 {
            return e;
        }
    }
}

impl Leases {
    /// An empty table for the capture numbered `epoch` (from
    /// [`next_epoch`]).
    pub fn new(epoch: u32) -> Leases {
        Leases {
            epoch,
            slots: Vec::new(),
        }
    }

    fn token(&self, slot: usize, generation: u32) -> u64 {
        (self.epoch as u64) << EPOCH_SHIFT | (slot as u64 + 1) << SLOT_BITS | generation as u64
    }

    /// Registers an aliasable slot living in logical buffer `buffer`.
    pub fn add_slot(&mut self, name: String, buffer: usize) -> Result<usize> {
        if self.slots.len() >= MAX_SLOTS {
            return Err(Error::invalid(format!(
                "strict leases: the session has more than {MAX_SLOTS} aliases to track"
            )));
        }
        self.slots.push(Slot {
            name,
            buffer,
            generation: 0,
            held: false,
        });
        Ok(self.slots.len() - 1)
    }

    /// The slots that live in any of `buffers`: those a write of these
    /// buffers would overwrite.
    pub fn slots_in(&self, buffers: &[usize]) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| buffers.contains(&self.slots[i].buffer))
            .collect()
    }

    /// Fails with `AliasHeld` if any of `slots` is held; `what` names the
    /// replay that would overwrite them (only called on failure, so the
    /// check allocates nothing).
    pub fn check_free(&self, slots: &[usize], what: impl FnOnce() -> String) -> Result<()> {
        for &i in slots {
            let s = &self.slots[i];
            if s.held {
                return Err(Error::AliasHeld(format!(
                    "{} would overwrite {}, an alias handed out by replay {} that is still held \
                     (lease 0x{:x}); nothing was replayed. Release its lease once you are done with \
                     it, or take that grad as CLONE or COPY_INTO",
                    what(),
                    s.name,
                    s.generation,
                    self.token(i, s.generation)
                )));
            }
        }
        Ok(())
    }

    /// Hands out a new lease on `slot` (which must be free: callers check
    /// first). Returns the token the caller releases.
    pub fn acquire(&mut self, slot: usize) -> u64 {
        let s = &mut self.slots[slot];
        s.generation = (s.generation + 1) & GEN_MASK;
        if s.generation == 0 {
            s.generation = 1;
        }
        s.held = true;
        let generation = s.generation;
        self.token(slot, generation)
    }

    /// Releases a lease token.
    pub fn release(&mut self, lease: u64) -> Result<()> {
        let epoch = (lease >> EPOCH_SHIFT) as u32;
        let slot = ((lease >> SLOT_BITS) & GEN_MASK as u64) as usize;
        let generation = (lease as u32) & GEN_MASK;
        if epoch != self.epoch || self.epoch == 0 {
            return Err(Error::invalid(format!(
                "lease 0x{lease:x} was not issued by this capture of the session (it is from an earlier \
                 capture, another session, or not a lease)"
            )));
        }
        let Some(s) = slot.checked_sub(1).and_then(|i| self.slots.get_mut(i)) else {
            return Err(Error::invalid(format!(
                "lease 0x{lease:x} was not issued by this session"
            )));
        };
        if generation != s.generation || generation == 0 {
            return Err(Error::invalid(format!(
                "lease 0x{lease:x} on {} is not the current one (generation {generation}, current {})",
                s.name, s.generation
            )));
        }
        if !s.held {
            return Err(Error::invalid(format!(
                "lease 0x{lease:x} on {} was already released",
                s.name
            )));
        }
        s.held = false;
        Ok(())
    }

    pub fn held_count(&self) -> usize {
        self.slots.iter().filter(|s| s.held).count()
    }

    /// The first of `slots` whose lease is held: its name and token.
    pub fn held_in(&self, slots: &[usize]) -> Option<(String, u64)> {
        slots.iter().find_map(|&i| {
            let s = self.slots.get(i).filter(|s| s.held)?;
            Some((s.name.clone(), self.token(i, s.generation)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Leases {
        let mut l = Leases::new(3);
        l.add_slot("param 0 grad of callable 'a'".into(), 7)
            .unwrap();
        l.add_slot("output 0 of callable 'a'".into(), 3).unwrap();
        l.add_slot("param 1 grad of callable 'a'".into(), 7)
            .unwrap();
        l
    }

    #[test]
    fn held_alias_blocks_the_overwriting_replay() {
        let mut l = table();
        let bwd = l.slots_in(&[7]);
        assert_eq!(bwd, vec![0, 2]);
        l.check_free(&bwd, || "backward".into()).unwrap();
        let t = l.acquire(2);
        let err = l
            .check_free(&bwd, || "backward replay of callable 'a'".into())
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("param 1 grad of callable 'a'"), "{msg}");
        assert!(msg.contains("replay 1"), "{msg}");
        // The operation, not the C function (the C boundary names its own).
        assert!(msg.contains("Release its lease once"), "{msg}");
        assert!(!msg.contains("graphed_"), "{msg}");
        // A replay that writes other buffers is not blocked.
        l.check_free(&l.slots_in(&[3]), || "forward".into())
            .unwrap();
        l.release(t).unwrap();
        l.check_free(&bwd, || "backward".into()).unwrap();
    }

    #[test]
    fn held_in_names_the_first_held_slot() {
        let mut l = table();
        assert_eq!(l.held_in(&[0, 1, 2]), None);
        let t = l.acquire(1);
        let (name, token) = l.held_in(&[0, 1, 2]).unwrap();
        assert_eq!((name.as_str(), token), ("output 0 of callable 'a'", t));
        assert_eq!(l.held_in(&[0, 2, 99]), None, "unknown slots are not held");
        l.release(t).unwrap();
        assert_eq!(l.held_in(&[1]), None);
    }

    #[test]
    fn generations_advance_and_stale_tokens_are_rejected() {
        let mut l = table();
        let t1 = l.acquire(0);
        l.release(t1).unwrap();
        let t2 = l.acquire(0);
        assert_ne!(t1, t2);
        assert!(
            l.release(t1).is_err(),
            "an old generation cannot release the new lease"
        );
        l.release(t2).unwrap();
        assert!(l.release(t2).is_err(), "double release is an error");
        assert_eq!(l.held_count(), 0);
    }

    #[test]
    fn foreign_tokens_are_rejected() {
        let mut l = table();
        assert!(l.release(0).is_err());
        assert!(l.release(u64::MAX).is_err());
        assert!(l.release(l.token(99, 1)).is_err());
        // A token of an earlier capture (epoch) is refused even when its
        // slot and generation match.
        let t = l.acquire(0);
        let mut next = Leases::new(4);
        next.add_slot("param 0 grad of callable 'a'".into(), 7)
            .unwrap();
        next.acquire(0);
        assert!(next.release(t).is_err());
    }

    #[test]
    fn epochs_are_distinct_and_never_zero() {
        let a = next_epoch();
        let b = next_epoch();
        assert_ne!(a, 0);
        assert_ne!(b, 0);
        assert_ne!(a, b);
        // Two tables of the same shape from two captures issue different
        // tokens, and neither accepts the other's.
        let (mut x, mut y) = (Leases::new(a), Leases::new(b));
        x.add_slot("output 0 of callable 'a'".into(), 0).unwrap();
        y.add_slot("output 0 of callable 'b'".into(), 0).unwrap();
        let (tx, ty) = (x.acquire(0), y.acquire(0));
        assert_ne!(tx, ty);
        assert!(y.release(tx).is_err());
        assert!(x.release(ty).is_err());
        y.release(ty).unwrap();
    }
}
