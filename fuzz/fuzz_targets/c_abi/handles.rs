//! Session handles as the ops pass them (live, destroyed, NULL, forged),
//! and the pins of sessions that a call in progress holds.

use super::*;

/// A session handle as an op passes it, and what the model expects of it.
#[derive(Clone, Copy, Debug)]
pub enum Target {
    Null,
    Forged(usize),
    Dead(usize),
    Live(usize),
}

impl Target {
    pub fn ptr(self) -> *mut graphed_session {
        match self {
            Target::Null => null_mut(),
            Target::Forged(h) => h as *mut _,
            Target::Dead(i) | Target::Live(i) => w().sessions.borrow()[i].h as *mut _,
        }
    }
    /// The status of looking the session up (None: found).
    pub fn lookup(self) -> Option<graphed_status> {
        match self {
            Target::Null => Some(S::NullPointer),
            Target::Forged(_) => Some(S::InvalidArgument),
            Target::Dead(_) => Some(S::UseAfterDestroy),
            Target::Live(_) => None,
        }
    }
    /// The status of pinning and locking it (None: locked).
    pub fn lock(self) -> Option<graphed_status> {
        self.lookup().or_else(|| match self {
            Target::Live(i) if w().pinned.borrow().contains(&i) => Some(S::Busy),
            _ => None,
        })
    }
}

pub fn forged() -> usize {
    let i = &w().input;
    match i.below(6) {
        0 => 1,
        1 => 0x1000 + i.below(64) * 8,
        2 => usize::MAX,
        // A well-formed id that was never issued.
        3 => 0x67 << 56 | 1 << 48 | 0xFFFF_FFFF_FFF0,
        // A handle of another kind: a host stream's or a buffer's, if any.
        4 => w()
            .kept_streams
            .borrow()
            .first()
            .map_or(0x67 << 56 | 5 << 48 | 1, |k| k.h),
        _ => 0x67 << 56,
    }
}

/// A forged id that is no live handle of any kind.
pub fn forged_id() -> usize {
    let i = &w().input;
    i.pick(&[
        1,
        0x1000 + 8 * i.below(64),
        usize::MAX,
        0x67 << 56 | 1 << 48 | 0xFFFF_FFFF_FFF0,
        0x67 << 56,
    ])
}

pub fn target() -> Target {
    let i = &w().input;
    let n = w().sessions.borrow().len();
    let r = i.byte();
    if n == 0 || r >= 240 {
        return match r % 3 {
            0 if n > 0 => Target::Null,
            _ => Target::Forged(forged()),
        };
    }
    let k = i.below(n);
    if w().sessions.borrow()[k].alive {
        Target::Live(k)
    } else {
        Target::Dead(k)
    }
}

pub fn live_target() -> Option<usize> {
    let ss = w().sessions.borrow();
    let live: Vec<usize> = (0..ss.len()).filter(|&k| ss[k].alive).collect();
    drop(ss);
    if live.is_empty() {
        None
    } else {
        Some(live[w().input.below(live.len())])
    }
}

pub struct Pin(pub usize);

pub fn pin(i: usize) -> Pin {
    w().pinned.borrow_mut().push(i);
    Pin(i)
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut p = w().pinned.borrow_mut();
        let at = p.iter().rposition(|&x| x == self.0).expect("pinned");
        p.remove(at);
    }
}

/// Mostly a live session that `fits` (when there is one), else any target:
/// the step ops need sessions in particular states to get far.
pub fn target_where(fits: impl Fn(&Sess) -> bool) -> Target {
    let i = &w().input;
    let ss = w().sessions.borrow();
    let good: Vec<usize> = (0..ss.len())
        .filter(|&k| ss[k].alive && fits(&ss[k]))
        .collect();
    drop(ss);
    if !good.is_empty() && !i.chance(50) {
        Target::Live(good[i.below(good.len())])
    } else {
        target()
    }
}
