//! The checks every call gets (never INTERNAL, a known code, a message
//! naming the function on failure, the expected status), and those after
//! every op (held clones intact, stats as the model says).

use super::*;

pub fn msg() -> String {
    // SAFETY: graphed returns a NUL-terminated thread-local string.
    unsafe { CStr::from_ptr(graphed_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Marks the thread's last message, so that a failure that sets none shows.
pub fn mark() {
    let _ = graphed_buffer_retain(null_mut());
}

/// Every call's common checks: never INTERNAL, a known code, and a message
/// naming the function on failure.
pub fn post(st: graphed_status, func: &str) {
    let code = st as u32;
    assert!(
        code <= S::CallableReleased as u32,
        "{func}: status {code} out of range"
    );
    assert!(st != S::Internal, "{func} returned INTERNAL: {}", msg());
    if st != S::Ok {
        let m = msg();
        assert!(
            m.starts_with(&format!("{func}: ")),
            "{func} failed with {st:?} but the message is {m:?}"
        );
        // SAFETY: a static NUL-terminated string.
        let name = unsafe { CStr::from_ptr(graphed_status_name(code)) };
        assert!(name.to_bytes().starts_with(b"GRAPHED_STATUS_"));
    }
}

/// Keeps the first error of a sequence of checks.
pub fn first(want: &mut Option<graphed_status>, e: Option<graphed_status>) {
    if want.is_none() {
        *want = e;
    }
}

pub fn expect(st: graphed_status, want: &[graphed_status], func: &str, what: &str) {
    post(st, func);
    assert!(
        want.contains(&st),
        "{func} ({what}) returned {st:?}, expected one of {want:?}; message: {}",
        msg()
    );
}

/// Clones stay what they were until released, whatever ran since.
pub fn check_clones() {
    for b in w().blocks.borrow().iter() {
        for &(p, n, v) in &b.grads {
            assert!(
                all_bytes(p, n, v),
                "a held clone changed before its release"
            );
        }
        for &(p, n, v, width) in &b.words {
            assert!(
                all_words(p, n, v, width),
                "a held clone (a sum over microbatches) changed before its release"
            );
        }
    }
}

pub fn check_all_stats() {
    let wd = w();
    let n = wd.sessions.borrow().len();
    for k in 0..n {
        let (alive, h) = {
            let s = &wd.sessions.borrow()[k];
            (s.alive, s.h)
        };
        if !alive {
            continue;
        }
        let mut st = graphed_session_stats_default();
        // SAFETY: a full struct.
        let r = unsafe { graphed_session_stats_get(h as *mut _, &mut st) };
        expect(r, &[S::Ok], "graphed_session_stats_get", "idle session");
        check_stats(k, &st);
    }
}
