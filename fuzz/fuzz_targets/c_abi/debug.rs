//! Where a replay faulted, and what the graphs hold:
//! graphed_session_export_dot on any target, in any state, with fuzzed
//! arguments (a NULL buffer, capacities of 0, short and whole, one that
//! cannot be memory, a NULL or misaligned length), checked against the
//! model in the library's order, nothing written on failure, and on
//! success a whole DOT text with one cluster per graph the stats count, a
//! comment per released callable, the same twice; and host kernels
//! (graphed_host_enqueue_kernel) that fault on the NULL stream, reported by
//! the next replay of a session in debug mode (config shape 10) as pending
//! before it, changing nothing, or by graphed_host_synchronize(NULL), once;
//! its refusals (a NULL kernel, a name that is not UTF-8, forged and gone
//! streams) enqueue nothing.

use super::*;

pub fn op_debug() {
    match w().input.below(4) {
        0 | 1 => op_export_dot(),
        2 => op_fault_then_replay(),
        _ => op_fault_then_synchronize(),
    }
}

/// graphed_session_stats of a live session (the call must succeed).
fn stats_of(h: *mut graphed_session) -> graphed_session_stats {
    let mut st = graphed_session_stats_default();
    // SAFETY: a full stats struct.
    let r = unsafe { graphed_session_stats_get(h, &mut st) };
    expect(r, &[S::Ok], "graphed_session_stats_get", "for the export");
    st
}

fn op_export_dot() {
    let wd = w();
    let i = &wd.input;
    let t = target();
    let model = match t {
        Target::Live(k) => {
            let s = &wd.sessions.borrow()[k];
            Some((s.st, s.released.len()))
        }
        _ => None,
    };
    let buf_pick = i.below(6);
    let len_pick = i.below(8);
    let mut want = t.lookup();
    match len_pick {
        0 => first(&mut want, Some(S::NullPointer)),
        1 => first(&mut want, Some(S::InvalidArgument)),
        _ => {}
    }
    first(&mut want, t.lock());
    if let Some((st, _)) = model {
        first(&mut want, state_err(st));
    }
    if buf_pick == 5 {
        // A capacity that cannot be memory, checked before any write.
        first(&mut want, Some(S::InvalidArgument));
    }
    // The length first, to size the buffer (when the call can succeed).
    let full = if want.is_none() {
        let mut n = 0usize;
        // SAFETY: a NULL buffer asks for the length.
        let r = unsafe { graphed_session_export_dot(t.ptr(), null_mut(), 0, &mut n) };
        expect(r, &[S::Ok], "graphed_session_export_dot", "length");
        n
    } else {
        64
    };
    let cap = match buf_pick {
        0 => 0,
        1 => 0,
        2 => 1 + i.below(full.max(1)),
        5 => usize::MAX,
        _ => full + 1,
    };
    let room = if buf_pick == 5 { 16 } else { cap + 16 };
    let mut buf = vec![0xa5u8; room];
    let bp: *mut c_char = if buf_pick == 0 {
        null_mut()
    } else {
        buf.as_mut_ptr().cast()
    };
    let mut lens = [0xdeadusize; 2];
    let lp: *mut usize = match len_pick {
        0 => null_mut(),
        // SAFETY: one byte into a two-word array.
        1 => unsafe { (lens.as_mut_ptr() as *mut u8).add(1) as *mut usize },
        _ => lens.as_mut_ptr(),
    };
    trace!("export_dot {t:?} buf {buf_pick} cap {cap} len {len_pick} want {want:?}");
    mark();
    // SAFETY: `bp` is NULL or has `room` bytes; a capacity past it is
    // refused before any write; `lp` NULL, misaligned (refused) or a word.
    let r = unsafe { graphed_session_export_dot(t.ptr(), bp, cap, lp) };
    expect(
        r,
        &[want.unwrap_or(S::Ok)],
        "graphed_session_export_dot",
        "export",
    );
    if r != S::Ok {
        assert!(buf.iter().all(|&b| b == 0xa5), "export written on failure");
        assert_eq!(lens, [0xdead; 2], "length written on failure");
        return;
    }
    assert_eq!(lens[0], full, "the length is the same twice");
    if bp.is_null() || cap == 0 {
        assert!(buf.iter().all(|&b| b == 0xa5), "written with no room");
        return;
    }
    let n = full.min(cap - 1);
    assert_eq!(buf[n], 0, "export not NUL-terminated");
    assert!(
        buf[cap..].iter().all(|&b| b == 0xa5),
        "export wrote past its capacity"
    );
    assert!(!buf[..n].contains(&0));
    if n < full {
        return;
    }
    let text = std::str::from_utf8(&buf[..n]).expect("the export is UTF-8");
    assert!(text.starts_with("// graphed "), "{text}");
    assert!(text.contains("digraph \"session '"), "{text}");
    assert!(text.ends_with("}\n"), "{text}");
    let st = stats_of(t.ptr());
    assert_eq!(
        text.matches("subgraph cluster_").count() as u32,
        st.graph_count + st.slot_graphs + st.step_graphs,
        "one cluster per graph the stats count:\n{text}"
    );
    let released = model.map_or(0, |(_, r)| r);
    assert_eq!(
        text.matches(") was released: its graphs are gone").count(),
        released
    );
}

/// A host kernel that faults.
unsafe extern "C" fn faulting(_: *mut c_void) -> i32 {
    7
}

/// A host kernel that does not.
unsafe extern "C" fn fine(_: *mut c_void) -> i32 {
    0
}

/// Enqueues a faulting host kernel named "fuzz.fault" on the NULL stream.
fn fault_now() {
    mark();
    // SAFETY: a kernel that ignores its data; the name is NUL-terminated.
    let r = unsafe {
        graphed_host_enqueue_kernel(
            null_mut(),
            c"fuzz.fault".as_ptr(),
            Some(faulting),
            null_mut(),
        )
    };
    expect(r, &[S::Ok], "graphed_host_enqueue_kernel", "a fault");
}

/// graphed_host_synchronize(NULL) reports the NULL stream's fault once.
fn synchronize_reports_it() {
    mark();
    let r = graphed_host_synchronize(null_mut());
    expect(
        r,
        &[S::CudaError],
        "graphed_host_synchronize",
        "a pending fault",
    );
    assert!(
        msg().contains("host kernel 'fuzz.fault' returned 7"),
        "{}",
        msg()
    );
    let r = graphed_host_synchronize(null_mut());
    expect(r, &[S::Ok], "graphed_host_synchronize", "reported once");
}

/// A fault on the NULL stream, then a forward replay of callable 0 of a
/// live session in debug mode: after the arguments, BUSY, the callable and
/// the output count, the state and a released callable, it reports the
/// fault as pending before it and changes nothing (the stats after each
/// op say so); refused before that, the fault stays for the synchronize.
fn op_fault_then_replay() {
    let wd = w();
    let debug: Vec<usize> = {
        let ss = wd.sessions.borrow();
        (0..ss.len())
            .filter(|&k| ss[k].alive && ss[k].debug)
            .collect()
    };
    if debug.is_empty() || w().frames.borrow().iter().any(|f| f.capturing) {
        return op_fault_then_synchronize();
    }
    let k = debug[wd.input.below(debug.len())];
    let (h, st, outputs, released) = {
        let s = &wd.sessions.borrow()[k];
        (
            s.h,
            s.st,
            s.callables.first().map(|c| c.outputs.len()),
            s.released.contains(&0),
        )
    };
    let t = Target::Live(k);
    let Some(n) = outputs else {
        // No callable 0: refused at the arguments; the fault stays.
        fault_now();
        let a = graphed_replay_args_default();
        let mut out = [0u8; 64];
        mark();
        // SAFETY: room for no refs is enough for a refusal.
        let r = unsafe { graphed_forward(h as *mut _, &a, out.as_mut_ptr().cast(), 0) };
        post(r, "graphed_forward");
        assert_ne!(r, S::Ok, "a forward of a callable that does not exist");
        assert_ne!(r, S::CudaError, "the check came before the callable's");
        return synchronize_reports_it();
    };
    let mut want = t.lock();
    first(&mut want, state_err(st));
    first(&mut want, released.then_some(S::CallableReleased));
    fault_now();
    let a = graphed_replay_args_default();
    let mut refs: Vec<graphed_ref> = (0..n)
        .map(|_| graphed_ref {
            ptr: null_mut(),
            bytes: 0,
            kind: 0,
            owner: null_mut(),
            lease: 0,
            rows: 0,
            row_bytes: 0,
            pitch: 0,
        })
        .collect();
    mark();
    // SAFETY: room for the callable's outputs.
    let r = unsafe { graphed_forward(h as *mut _, &a, refs.as_mut_ptr(), n) };
    trace!("fault then debug forward of session #{k}: {r:?} want {want:?}");
    match want {
        Some(e) => {
            expect(r, &[e], "graphed_forward", "refused before the check");
            synchronize_reports_it();
        }
        None => {
            expect(r, &[S::CudaError], "graphed_forward", "a pending fault");
            let m = msg();
            assert!(
                m.contains("debug check in session '")
                    && m.contains("an error was pending before the forward replay of callable")
                    && m.contains("host kernel 'fuzz.fault' returned 7"),
                "{m}"
            );
            let r = graphed_host_synchronize(null_mut());
            expect(
                r,
                &[S::Ok],
                "graphed_host_synchronize",
                "the replay took it",
            );
        }
    }
    assert!(
        refs.iter().all(|r| r.ptr.is_null()),
        "refs written on failure"
    );
}

/// Host kernels on the NULL stream, forged and gone streams, with a NULL
/// function or a name that is not UTF-8: the refusals enqueue nothing
/// (the synchronize after reports only what ran), a fault is reported
/// once.
fn op_fault_then_synchronize() {
    let wd = w();
    let i = &wd.input;
    if wd.frames.borrow().iter().any(|f| f.capturing) {
        // A synchronize of NULL would break the running captures.
        return;
    }
    let faults = i.chance(160);
    let stale = {
        let kept = wd.kept_streams.borrow();
        kept.iter().find(|k| !stream_live(k)).map(|k| k.h)
    };
    let (stream, mut want) = match i.below(6) {
        0 => (forged_id(), Some(S::InvalidArgument)),
        1 if stale.is_some() => (stale.unwrap(), Some(S::UseAfterDestroy)),
        _ => (0, None),
    };
    let names: [&[u8]; 3] = [b"fuzz.fault\0", b"\xff\xfe\0", b"\0"];
    let pick = i.below(4);
    let name: *const c_char = match pick {
        3 => null(),
        p => names[p].as_ptr().cast(),
    };
    let null_fn = i.chance(20);
    // The order: the kernel, the name, the stream.
    let mut first_err = null_fn.then_some(S::NullPointer);
    first(&mut first_err, (pick == 1).then_some(S::InvalidArgument));
    first(&mut first_err, want.take());
    let f = match (null_fn, faults) {
        (true, _) => None,
        (false, true) => Some(faulting as unsafe extern "C" fn(*mut c_void) -> i32),
        (false, false) => Some(fine as unsafe extern "C" fn(*mut c_void) -> i32),
    };
    mark();
    // SAFETY: kernels that ignore their data; names NUL-terminated or NULL.
    let r = unsafe { graphed_host_enqueue_kernel(stream as graphed_stream, name, f, null_mut()) };
    expect(
        r,
        &[first_err.unwrap_or(S::Ok)],
        "graphed_host_enqueue_kernel",
        "a kernel",
    );
    mark();
    let r = graphed_host_synchronize(null_mut());
    if r == S::CudaError {
        assert!(
            first_err.is_none() && faults,
            "a fault from a kernel that did not run"
        );
        let m = msg();
        let named = match pick {
            0 => m.contains("host kernel 'fuzz.fault' returned 7"),
            _ => m.contains("a host kernel returned 7"),
        };
        assert!(named, "{m}");
        let r = graphed_host_synchronize(null_mut());
        expect(r, &[S::Ok], "graphed_host_synchronize", "reported once");
    } else {
        expect(r, &[S::Ok], "graphed_host_synchronize", "nothing faulted");
        assert!(
            first_err.is_some() || !faults,
            "a fault not reported at the synchronize"
        );
    }
}
