//! Calls into graphed made from inside a call in progress (by callbacks
//! and the host tasks they record): into the session the call holds (BUSY),
//! synchronizing the NULL stream, releasing leases and clone blocks.

use super::*;

/// A call into session `k`, which a call in progress holds: BUSY (lease
/// release never is).
pub fn own_session_call(k: usize) {
    let wd = w();
    let (h, alive) = {
        let s = &wd.sessions.borrow()[k];
        (s.h as *mut graphed_session, s.alive)
    };
    if !alive || !wd.pinned.borrow().contains(&k) {
        return;
    }
    let i = &wd.input;
    mark();
    match i.below(9) {
        8 => {
            // Gone for every later call at once; destroyed when the call in
            // progress returns.
            expect(
                graphed_session_destroy_when_idle(h),
                &[S::Ok],
                "graphed_session_destroy_when_idle",
                "own session",
            );
            wd.sessions.borrow_mut()[k].alive = false;
        }
        0 => {
            let mut st = graphed_session_stats_default();
            // SAFETY: a full struct.
            let r = unsafe { graphed_session_stats_get(h, &mut st) };
            expect(r, &[S::Busy], "graphed_session_stats_get", "own session");
        }
        1 => expect(
            graphed_session_destroy(h),
            &[S::Busy],
            "graphed_session_destroy",
            "own session",
        ),
        2 => expect(
            graphed_session_capture(h),
            &[S::Busy],
            "graphed_session_capture",
            "own session",
        ),
        3 => expect(
            graphed_session_reset(h),
            &[S::Busy],
            "graphed_session_reset",
            "own session",
        ),
        4 => {
            let a = graphed_replay_args_default();
            let mut out = [0u8; 64];
            // SAFETY: args and room for one ref.
            let r = unsafe { graphed_forward(h, &a, out.as_mut_ptr().cast(), 0) };
            expect(r, &[S::Busy], "graphed_forward", "own session");
        }
        5 => expect(
            graphed_session_set_param_flags(h, 0, 0, 0),
            &[S::Busy],
            "graphed_session_set_param_flags",
            "own session",
        ),
        6 => {
            let mut len = 0;
            // SAFETY: NULL buffer.
            let r = unsafe { graphed_session_plan_dump(h, null_mut(), 0, &mut len) };
            expect(r, &[S::Busy], "graphed_session_plan_dump", "own session");
            // The answers a callback might ask for (no input read).
            let (mut b, mut n, mut inst) = (7u32, 7u64, 7u32);
            let mut at = [null_mut::<c_void>(); 1];
            // SAFETY: locals; room for the one address asked.
            let r = unsafe { graphed_session_bucket_of(h, 0, 1, &mut b, &mut n) };
            expect(r, &[S::Busy], "graphed_session_bucket_of", "own session");
            // SAFETY: as above.
            let r = unsafe { graphed_session_instance_of(h, 0, 0, 0, &mut inst) };
            expect(r, &[S::Busy], "graphed_session_instance_of", "own session");
            // SAFETY: as above.
            let r = unsafe { graphed_session_param_addresses(h, 0, 0, at.as_mut_ptr(), 1) };
            expect(
                r,
                &[S::Busy],
                "graphed_session_param_addresses",
                "own session",
            );
            assert_eq!((b, n, inst, at[0]), (7, 7, 7, null_mut()), "written while BUSY");
        }
        _ if !waived("lease-in-replay") => {
            let r = graphed_lease_release(h, 0x1_0000_0100_0001);
            expect(
                r,
                &[S::InvalidArgument, S::Ok],
                "graphed_lease_release",
                "own session (never BUSY)",
            );
            if r == S::Ok {
                forget_lease(k, 0x1_0000_0100_0001);
            }
        }
        _ => {}
    }
}

pub fn sync_null() {
    let capturing = w().frames.borrow().iter().any(|f| f.capturing);
    mark();
    let r = graphed_host_synchronize(null_mut());
    if capturing {
        expect(
            r,
            &[S::CaptureInvalidated],
            "graphed_host_synchronize",
            "NULL under capture",
        );
        for f in w().frames.borrow_mut().iter_mut().filter(|f| f.capturing) {
            f.invalidated = true;
            f.broke |= if f.body != 0 { 3 } else { 1 };
        }
    } else {
        expect(r, &[S::Ok], "graphed_host_synchronize", "NULL");
    }
}

pub fn forget_lease(k: usize, token: u64) {
    let mut ls = w().leases.borrow_mut();
    if let Some(at) = ls.iter().position(|l| l.sess == k && l.token == token) {
        let l = ls.remove(at);
        w().stale_leases.borrow_mut().push((l.sess, l.token));
    }
}

/// Releases one lease the model holds for session `k` (from a deleter).
pub fn release_lease_of(k: usize) {
    let wd = w();
    let tok = wd
        .leases
        .borrow()
        .iter()
        .find(|l| l.sess == k)
        .map(|l| l.token);
    let Some(tok) = tok else { return };
    let h = wd.sessions.borrow()[k].h as *mut graphed_session;
    mark();
    let r = graphed_lease_release(h, tok);
    expect(
        r,
        &[S::Ok],
        "graphed_lease_release",
        "a held lease, from a callback",
    );
    forget_lease(k, tok);
}

pub fn release_some_block() {
    let wd = w();
    let n = wd.blocks.borrow().len();
    if n == 0 {
        return;
    }
    let at = wd.input.below(n);
    let owner = wd.blocks.borrow()[at].owner;
    mark();
    let r = graphed_buffer_release(owner as *mut graphed_buffer);
    expect(r, &[S::Ok], "graphed_buffer_release", "held block");
    let mut bs = wd.blocks.borrow_mut();
    bs[at].refs -= 1;
    if bs[at].refs == 0 {
        let b = bs.remove(at);
        wd.stale_blocks.borrow_mut().push(b.owner);
    }
}
