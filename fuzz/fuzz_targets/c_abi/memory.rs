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
    let i = &wd.input;
    let mut buf = vec![0u64; size_of::<graphed_memory_stats>() / 8 + 4];
    let mut m = graphed_memory_stats_default();
    let mut want = S::Ok;
    let mut null = false;
    match i.below(8) {
        0 => {
            m.magic = i.pick(&[0, 0x6772_0006, 0x6772_0013]);
            want = S::BadStruct;
        }
        1 => {
            m.struct_size = i.pick(&[0, 12, 39]);
            want = S::BadStruct;
        }
        2 => m.struct_size = size_of::<graphed_memory_stats>() + 16,
        3 => {
            null = true;
            want = S::NullPointer;
        }
        _ => {}
    }
    // SAFETY: buf holds the struct.
    unsafe { (buf.as_mut_ptr() as *mut graphed_memory_stats).write(m) };
    let p: *mut graphed_memory_stats = if null {
        null_mut()
    } else {
        buf.as_mut_ptr().cast()
    };
    let before = buf.clone();
    mark();
    // SAFETY: NULL or a struct with spare room.
    let r = unsafe { graphed_memory_stats_get(p) };
    expect(r, &[want], "graphed_memory_stats_get", "memory stats");
    if r != S::Ok {
        assert_eq!(buf, before, "memory stats written on failure");
        return;
    }
    // SAFETY: the struct graphed filled.
    let got = unsafe { (buf.as_ptr() as *const graphed_memory_stats).read() };
    assert_eq!(got.struct_size, m.struct_size, "header overwritten");
    assert_eq!(got.magic, m.magic, "header overwritten");
    assert!(
        buf[size_of::<graphed_memory_stats>() / 8..]
            .iter()
            .all(|&x| x == 0),
        "memory stats written past the struct"
    );
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

/// graphed_session_release_callable on any target, mostly a captured one.
pub fn op_release_callable() {
    let wd = w();
    let i = &wd.input;
    let t = target_where(|s| s.st == St::Captured);
    let model = match t {
        Target::Live(k) => {
            let s = &wd.sessions.borrow()[k];
            Some((k, s.st, s.callables.len(), s.strict))
        }
        _ => None,
    };
    let n = model.map_or(0, |m| m.2);
    let c = if n > 0 && !i.chance(30) {
        i.below(n) as u32
    } else {
        i.pick(&[n as u32, u32::MAX])
    };
    let mut want = t.lock();
    if let Some((k, st, n, strict)) = model {
        match st {
            St::Open => first(&mut want, Some(S::WrongState)),
            St::Reset => first(&mut want, Some(S::SessionReset)),
            St::Captured => {}
        }
        first(&mut want, (c as usize >= n).then_some(S::InvalidArgument));
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
    let Some((k, ..)) = model else {
        assert_eq!(
            figures(&after),
            figures(&before),
            "a refusal changed memory"
        );
        return;
    };
    if r != S::Ok {
        assert_eq!(
            figures(&after),
            figures(&before),
            "a refusal changed memory"
        );
        if r == S::AliasHeld {
            assert!(msg().contains("cannot be released"), "{}", msg());
        }
        return;
    }
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
    let mut buf = vec![0u64; size_of::<graphed_callable_memory>() / 8 + 4];
    let mut m = graphed_callable_memory_default();
    let mut struct_err = None;
    let mut null = false;
    match i.below(8) {
        0 => {
            m.magic = i.pick(&[0, 0x6772_0012]);
            struct_err = Some(S::BadStruct);
        }
        1 => {
            m.struct_size = i.pick(&[8, 55]);
            struct_err = Some(S::BadStruct);
        }
        2 => m.struct_size = size_of::<graphed_callable_memory>() + 16,
        3 => {
            null = true;
            struct_err = Some(S::NullPointer);
        }
        _ => {}
    }
    // SAFETY: buf holds the struct.
    unsafe { (buf.as_mut_ptr() as *mut graphed_callable_memory).write(m) };
    let p: *mut graphed_callable_memory = if null {
        null_mut()
    } else {
        buf.as_mut_ptr().cast()
    };
    let mut want = t.lookup();
    first(&mut want, struct_err);
    first(&mut want, t.lock());
    if let Some((_, st, n)) = model {
        match st {
            St::Open => first(&mut want, Some(S::WrongState)),
            St::Reset => first(&mut want, Some(S::SessionReset)),
            St::Captured => {}
        }
        first(&mut want, (c as usize >= n).then_some(S::InvalidArgument));
    }
    let before = buf.clone();
    mark();
    // SAFETY: NULL or a struct with spare room.
    let r = unsafe { graphed_session_callable_memory(t.ptr(), c, p) };
    expect(
        r,
        &[want.unwrap_or(S::Ok)],
        "graphed_session_callable_memory",
        "callable memory",
    );
    if r != S::Ok {
        assert_eq!(buf, before, "callable memory written on failure");
        return;
    }
    assert!(
        buf[size_of::<graphed_callable_memory>() / 8..]
            .iter()
            .all(|&x| x == 0),
        "callable memory written past the struct"
    );
    if let Some((k, ..)) = model {
        check_callable_memory(k, c);
    }
}
