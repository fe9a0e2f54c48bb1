//! The memory pool of scratch arenas, which sessions may share (the C
//! counterpart of sharing a graph pool between `make_graphed_callables`
//! calls). Everything scratch a capture allocated is free once its graphs
//! are captured, so a later capture into the same pool reuses the same
//! memory, on the condition PyTorch states for shared pools: graphs of
//! sessions sharing a pool are replayed in the order they were captured,
//! one whole iteration at a time. The pool enforces it: a replay of one
//! session while another session sharing the pool is in the middle of its
//! iteration is refused, naming both.

use crate::backend::{teardown, Backend, DevPtr};
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex, MutexGuard};

struct Chunk {
    ptr: DevPtr,
    bytes: usize,
    users: usize,
}

/// A captured session replaying from this pool.
struct Member {
    key: u64,
    name: String,
    /// Its passes in capture order, as messages name them.
    passes: Vec<String>,
    /// Capture-order position of its last replay, if any.
    last: Option<usize>,
}

impl Member {
    fn mid_iteration(&self) -> bool {
        self.last.is_some_and(|p| p + 1 < self.passes.len())
    }

    fn pass(&self, pos: usize) -> &str {
        self.passes.get(pos).map_or("?", |s| s.as_str())
    }
}

#[derive(Default)]
struct Order {
    members: Vec<Member>,
    /// The member that replayed last.
    current: Option<u64>,
}

pub struct Pool {
    backend: Arc<dyn Backend>,
    chunks: Mutex<Vec<Chunk>>,
    order: Mutex<Order>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update is complete before the lock is released.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A capture's arena in the pool; returned to the pool when dropped (the
/// owner has waited for the device first).
pub struct Arena {
    pool: Arc<Pool>,
    pub base: DevPtr,
    pub bytes: usize,
}

impl Drop for Arena {
    fn drop(&mut self) {
        self.pool.release(self.base);
    }
}

impl Pool {
    pub fn new(backend: Arc<dyn Backend>) -> Arc<Pool> {
        Arc::new(Pool {
            backend,
            chunks: Mutex::new(Vec::new()),
            order: Mutex::new(Order::default()),
        })
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// An arena of at least `bytes` for a capture (None for 0 bytes).
    /// Reuses the smallest chunk that fits, else allocates one.
    pub fn acquire(self: &Arc<Pool>, bytes: usize) -> Result<Option<Arena>> {
        if bytes == 0 {
            return Ok(None);
        }
        let mut chunks = lock(&self.chunks);
        let (base, size) = match chunks
            .iter_mut()
            .filter(|c| c.bytes >= bytes)
            .min_by_key(|c| c.bytes)
        {
            Some(c) => {
                c.users += 1;
                (c.ptr, c.bytes)
            }
            None => {
                let ptr = self.backend.alloc(bytes)?;
                chunks.push(Chunk {
                    ptr,
                    bytes,
                    users: 1,
                });
                (ptr, bytes)
            }
        };
        Ok(Some(Arena {
            pool: self.clone(),
            base,
            bytes: size,
        }))
    }

    /// A capture that used the arena at `base` is gone; a chunk no capture
    /// uses any more is freed.
    fn release(&self, base: DevPtr) {
        let mut chunks = lock(&self.chunks);
        if let Some(i) = chunks.iter().position(|c| c.ptr == base) {
            chunks[i].users -= 1;
            if chunks[i].users == 0 {
                let c = chunks.swap_remove(i);
                teardown::check("freeing a scratch arena", self.backend.free(c.ptr));
            }
        }
    }

    /// Bytes the pool holds.
    pub fn bytes(&self) -> usize {
        lock(&self.chunks).iter().map(|c| c.bytes).sum()
    }

    /// A session captured into this pool: from now on its replays are
    /// ordered against the other members'.
    pub fn join(&self, key: u64, name: &str, passes: Vec<String>) {
        let mut o = lock(&self.order);
        o.members.retain(|m| m.key != key);
        o.members.push(Member {
            key,
            name: name.to_string(),
            passes,
            last: None,
        });
    }

    /// A session's graphs are gone (reset or destroyed).
    pub fn leave(&self, key: u64) {
        let mut o = lock(&self.order);
        o.members.retain(|m| m.key != key);
        if o.current == Some(key) {
            o.current = None;
        }
    }

    /// Takes session `key`'s replay of its pass at capture-order position
    /// `pos` into the order, if it may run now: checked and recorded under
    /// one lock, so that two sessions replaying on two threads cannot both
    /// be allowed. The claim is given back when dropped, unless kept once
    /// the pass is launched (`Claim::keep`): a replay refused after its
    /// claim leaves the order as it was. With one member nothing is checked
    /// (a session alone may replay its graphs as it likes). With several, a
    /// session may take over from another only when that one finished its
    /// iteration, and must start with its first pass.
    pub fn claim(&self, key: u64, pos: usize) -> Result<Claim<'_>> {
        let mut o = lock(&self.order);
        Self::check(&o, key, pos)?;
        let before = (
            o.current,
            o.members.iter().find(|m| m.key == key).and_then(|m| m.last),
        );
        Self::record(&mut o, key, pos);
        Ok(Claim {
            pool: Some(self),
            key,
            pos,
            before,
        })
    }

    fn check(o: &Order, key: u64, pos: usize) -> Result<()> {
        if o.members.len() < 2 || o.current == Some(key) {
            return Ok(());
        }
        let Some(me) = o.members.iter().find(|m| m.key == key) else {
            return Err(Error::Internal(
                "a session replays from a pool it did not join".into(),
            ));
        };
        let (name, this, first) = (&me.name, me.pass(pos), me.pass(0));
        if let Some(other) = o.members.iter().find(|m| m.key != key && m.mid_iteration()) {
            let last = other.last.unwrap_or(0);
            return Err(Error::state(format!(
                "session '{name}' cannot replay {this} now: it shares its scratch pool with session '{}', \
                 which is in the middle of its iteration (its last replay was {}, pass {} of {} in \
                 capture order; next is {}). Sessions sharing a pool must be replayed one whole \
                 iteration at a time, in capture order; nothing was replayed",
                other.name,
                other.pass(last),
                last + 1,
                other.passes.len(),
                other.pass(last + 1),
            )));
        }
        if pos != 0 && o.current.is_some() {
            let other = o
                .current
                .and_then(|k| o.members.iter().find(|m| m.key == k))
                .map_or("another session".to_string(), |m| {
                    format!("session '{}'", m.name)
                });
            return Err(Error::state(format!(
                "session '{name}' cannot replay {this} now: {other}, which shares its scratch pool, \
                 replayed last, so '{name}' must start its iteration with its first pass in capture \
                 order ({first}). Sessions sharing a pool must be replayed one whole iteration at a \
                 time, in capture order; nothing was replayed",
            )));
        }
        Ok(())
    }

    /// Records that session `key` replayed its pass at capture-order
    /// position `pos` (the passes of a step after the one it claimed).
    pub fn replayed(&self, key: u64, pos: usize) {
        Self::record(&mut lock(&self.order), key, pos);
    }

    fn record(o: &mut Order, key: u64, pos: usize) {
        o.current = Some(key);
        if let Some(m) = o.members.iter_mut().find(|m| m.key == key) {
            m.last = Some(pos);
        }
    }
}

/// A replay's place in its pool's order (`Pool::claim`), given back when
/// dropped unless kept.
#[must_use = "a claim is given back when dropped: keep it once the pass is launched"]
pub struct Claim<'p> {
    pool: Option<&'p Pool>,
    key: u64,
    pos: usize,
    /// The order's current session and this session's last pass before.
    before: (Option<u64>, Option<usize>),
}

impl Claim<'_> {
    /// The pass was launched: the order keeps it.
    pub fn keep(mut self) {
        self.pool = None;
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let Some(pool) = self.pool else { return };
        let mut o = lock(&pool.order);
        // Given back only where nothing was recorded since.
        let (key, pos) = (self.key, self.pos);
        let mine = o
            .members
            .iter()
            .any(|m| m.key == key && m.last == Some(pos));
        if o.current == Some(key) && mine {
            o.current = self.before.0;
            if let Some(m) = o.members.iter_mut().find(|m| m.key == key) {
                m.last = self.before.1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::host::HostBackend;

    /// A replay as the replay path makes it: claimed, then kept.
    fn replay(p: &Pool, key: u64, pos: usize) -> Result<()> {
        p.claim(key, pos)?.keep();
        Ok(())
    }

    fn names(key: u64, n: usize) -> Vec<String> {
        (0..n).map(|pos| format!("s{key}p{pos}")).collect()
    }

    #[test]
    fn a_lone_session_replays_as_it_likes() {
        let p = Pool::new(HostBackend::new());
        p.join(1, "a", names(1, 4));
        for pos in [2, 0, 0, 3, 1] {
            replay(&p, 1, pos).unwrap();
        }
    }

    #[test]
    fn sharing_sessions_take_whole_iterations_in_turn() {
        let p = Pool::new(HostBackend::new());
        p.join(1, "a", names(1, 3));
        p.join(2, "b", names(2, 2));
        replay(&p, 1, 0).unwrap();
        replay(&p, 1, 1).unwrap();
        let e = replay(&p, 2, 0).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("session 'b'") && m.contains("session 'a'"),
            "{m}"
        );
        assert!(m.contains("s1p1") && m.contains("next is s1p2"), "{m}");
        replay(&p, 1, 2).unwrap();
        let e = replay(&p, 2, 1).unwrap_err();
        assert!(
            e.to_string().contains("first pass in capture order (s2p0)"),
            "{e}"
        );
        replay(&p, 2, 0).unwrap();
        replay(&p, 2, 1).unwrap();
        replay(&p, 1, 0).unwrap();
        // A member that leaves no longer blocks anyone.
        p.leave(1);
        replay(&p, 2, 1).unwrap();
    }

    #[test]
    fn a_claim_is_checked_and_recorded_at_once() {
        let p = Pool::new(HostBackend::new());
        p.join(1, "a", names(1, 2));
        p.join(2, "b", names(2, 2));
        // While `a`'s first pass is claimed (not yet launched), `b` may not
        // start: two threads cannot both be allowed.
        let claim = p.claim(1, 0).unwrap();
        let e = p.claim(2, 0).map(|c| c.keep()).unwrap_err();
        assert!(
            e.to_string().contains("in the middle of its iteration"),
            "{e}"
        );
        claim.keep();
        replay(&p, 1, 1).unwrap();
        replay(&p, 2, 0).unwrap();
    }

    #[test]
    fn a_claim_given_back_changes_no_order() {
        let p = Pool::new(HostBackend::new());
        p.join(1, "a", names(1, 2));
        p.join(2, "b", names(2, 2));
        replay(&p, 1, 0).unwrap();
        replay(&p, 1, 1).unwrap();
        // `b` may start, but its claim is given back (its replay was then
        // refused for something else): `a` may start its next iteration.
        drop(p.claim(2, 0).unwrap());
        replay(&p, 1, 0).unwrap();
        // Had `b` replayed its first pass, `a` would wait for its iteration.
        let e = replay(&p, 2, 0).unwrap_err();
        assert!(e.to_string().contains("session 'a'"), "{e}");
        replay(&p, 1, 1).unwrap();
        replay(&p, 2, 0).unwrap();
        let e = replay(&p, 1, 0).unwrap_err();
        assert!(
            e.to_string().contains("in the middle of its iteration"),
            "{e}"
        );
    }

    #[test]
    fn arenas_are_shared_and_freed_by_the_last_user() {
        let p = Pool::new(HostBackend::new());
        let a = p.acquire(1000).unwrap().unwrap();
        let b = p.acquire(500).unwrap().unwrap();
        assert_eq!(a.base, b.base, "the smaller request reuses the chunk");
        assert_eq!(p.bytes(), 1000);
        drop(a);
        assert_eq!(p.bytes(), 1000);
        drop(b);
        assert_eq!(p.bytes(), 0);
        assert!(p.acquire(0).unwrap().is_none());
    }
}
