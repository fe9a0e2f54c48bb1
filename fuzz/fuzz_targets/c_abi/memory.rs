//! Memory that has an owner: the process's figures
//! (graphed_memory_stats_get, with fuzzed structs) against the model's live
//! sessions, and nothing at all once every session is destroyed and every
//! clone released; a callable released from a captured session
//! (graphed_session_release_callable), after which the model refuses its
//! replays, the steps that include it and its buffers (CALLABLE_RELEASED);
//! and what one callable holds (graphed_session_callable_memory).

use super::*;

/// Whether callable `c` of session `k` was released.
pub fn released(k: usize, c: usize) -> bool {
    w().sessions.borrow()[k].released.contains(&c)
}

/// The process's figures (the call must succeed).
pub fn held() -> graphed_memory_stats {
    let mut m = graphed_memory_stats_default();
    // SAFETY: an initialised struct.
    let r = unsafe { graphed_memory_stats_get(&mut m) };
    expect(r, &[S::Ok], "graphed_memory_stats_get", "held");
    m
}

fn figures(m: &graphed_memory_stats) -> (u32, u64, u64, u64) {
    (m.sessions, m.device_bytes, m.allocations, m.graphs)
}

/// Once every session is destroyed and every clone released, graphed holds
/// nothing: no byte, no allocation, no session, no graph.
pub fn check_held_nothing() {
    assert_eq!(
        figures(&held()),
        (0, 0, 0, 0),
        "graphed still holds (sessions, bytes, allocations, graphs) after every session was destroyed and \
         every clone released"
    );
}

pub fn op_memory_stats() {
    let wd = w();
    let mut out = Out::fuzzed(
        graphed_memory_stats_default(),
        &[0, 0x6772_0006, 0x6772_0013],
        &[0, 12, 39],
    );
    mark();
    // SAFETY: NULL or a struct with spare room.
    let r = unsafe { graphed_memory_stats_get(out.ptr()) };
    expect(
        r,
        &[out.err.unwrap_or(S::Ok)],
        "graphed_memory_stats_get",
        "memory stats",
    );
    let Some(got) = out.filled(r, "memory stats") else {
        return;
    };
    assert_eq!(got.struct_size, out.m.struct_size, "header overwritten");
    assert_eq!(got.magic, out.m.magic, "header overwritten");
    // Between ops no call is in progress: the sessions alive are the
    // model's.
    let alive = wd.sessions.borrow().iter().filter(|s| s.alive).count();
    assert_eq!(got.sessions as usize, alive, "memory stats: sessions");
    if alive == 0 && wd.blocks.borrow().is_empty() {
        assert_eq!(
            (got.device_bytes, got.allocations, got.graphs),
            (0, 0, 0),
            "memory held with no session and no clone"
        );
    }
    assert_eq!(got.device_bytes == 0, got.allocations == 0);
}

/// A target for a call on one callable, mostly a captured session, and a
/// callable, mostly one it has: the target, the model's (index, state,
/// callables) of a live one, and the callable.
fn callable_target() -> (Target, Option<(usize, St, usize)>, u32) {
    let wd = w();
    let i = &wd.input;
    let t = target_where(|s| s.st == St::Captured);
    let model = match t {
        Target::Live(k) => {
            let s = &wd.sessions.borrow()[k];
            Some((k, s.st, s.callables.len()))
        }
        _ => None,
    };
    let n = model.map_or(0, |m| m.2);
    let c = if n > 0 && !i.chance(30) {
        i.below(n) as u32
    } else {
        i.pick(&[n as u32, u32::MAX])
    };
    (t, model, c)
}

/// The refusals of a call on callable `c` of a live session in state `st`
/// with `n` callables, kept in `want` after any earlier one.
fn callable_refusal(want: &mut Option<graphed_status>, st: St, n: usize, c: u32) {
    match st {
        St::Open => first(want, Some(S::WrongState)),
        St::Reset => first(want, Some(S::SessionReset)),
        St::Captured => {}
    }
    first(want, (c as usize >= n).then_some(S::InvalidArgument));
}

/// graphed_session_release_callable on any target, mostly a captured one.
pub fn op_release_callable() {
    let wd = w();
    let (t, model, c) = callable_target();
    let mut want = t.lock();
    if let Some((k, st, n)) = model {
        callable_refusal(&mut want, st, n, c);
        let strict = wd.sessions.borrow()[k].strict;
        if strict && (c as usize) < n && !released(k, c as usize) {
            let held = wd
                .leases
                .borrow()
                .iter()
                .any(|l| l.sess == k && l.slot.0 == c as usize);
            first(&mut want, held.then_some(S::AliasHeld));
        }
    }
    let before = held();
    mark();
    let r = graphed_session_release_callable(t.ptr(), c);
    expect(
        r,
        &[want.unwrap_or(S::Ok)],
        "graphed_session_release_callable",
        "release",
    );
    trace!("release_callable {t:?} {c}: {r:?}");
    let after = held();
    // Only a live target can be released (the others are refused).
    let (Some((k, ..)), S::Ok) = (model, r) else {
        assert_eq!(
            figures(&after),
            figures(&before),
            "a refusal changed memory"
        );
        if r == S::AliasHeld {
            assert!(msg().contains("cannot be released"), "{}", msg());
        }
        return;
    };
    let again = released(k, c as usize);
    if again {
        assert_eq!(
            figures(&after),
            figures(&before),
            "a second release changed memory"
        );
    } else {
        wd.sessions.borrow_mut()[k].released.push(c as usize);
        assert!(after.device_bytes <= before.device_bytes);
        assert!(after.graphs <= before.graphs);
    }
    check_callable_memory(k, c);
}

/// graphed_session_callable_memory of a live session's callable, checked
/// against the model (it must succeed).
fn check_callable_memory(k: usize, c: u32) {
    let h = w().sessions.borrow()[k].h as *mut graphed_session;
    let mut m = graphed_callable_memory_default();
    // SAFETY: an initialised struct.
    let r = unsafe { graphed_session_callable_memory(h, c, &mut m) };
    expect(r, &[S::Ok], "graphed_session_callable_memory", "model");
    let gone = released(k, c as usize);
    assert_eq!(m.released, gone as u32, "callable_memory.released");
    if gone {
        assert_eq!(
            (
                m.own_static_bytes,
                m.shared_static_bytes,
                m.graphs,
                m.step_graphs
            ),
            (0, 0, 0, 0),
            "a released callable holds static memory or graphs"
        );
        assert_eq!(m.clone_bytes_cached, 0);
    } else {
        assert!(m.graphs > 0, "a captured callable without graphs");
    }
    let custom = w().sessions.borrow()[k].custom_alloc;
    let held_blocks = w()
        .blocks
        .borrow()
        .iter()
        .any(|b| b.sess == k && b.inst.0 == c as usize);
    if custom || !held_blocks {
        assert_eq!(
            m.clone_bytes_outstanding, 0,
            "callable_memory.clone_bytes_outstanding"
        );
    }
}

/// graphed_session_callable_memory on any target, with fuzzed structs.
pub fn op_callable_memory() {
    let (t, model, c) = callable_target();
    let mut out = Out::fuzzed(
        graphed_callable_memory_default(),
        &[0, 0x6772_0012],
        &[8, 55],
    );
    let mut want = t.lookup();
    first(&mut want, out.err);
    first(&mut want, t.lock());
    if let Some((_, st, n)) = model {
        callable_refusal(&mut want, st, n, c);
    }
    mark();
    // SAFETY: NULL or a struct with spare room.
    let r = unsafe { graphed_session_callable_memory(t.ptr(), c, out.ptr()) };
    expect(
        r,
        &[want.unwrap_or(S::Ok)],
        "graphed_session_callable_memory",
        "callable memory",
    );
    if out.filled(r, "callable memory").is_none() {
        return;
    }
    if let Some((k, ..)) = model {
        check_callable_memory(k, c);
    }
}
