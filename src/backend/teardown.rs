//! Errors of teardown: a free, a destroy or a synchronize that fails while
//! something is released (a `Drop`, a reset, a session's destroy) cannot
//! fail its caller, but it is never dropped silently either. Every one is
//! counted and kept as the process's last teardown error (the C API's
//! query), and handed to whoever collects on the failing thread: a session
//! collects around its own teardown, to count the errors in its stats and
//! send them to its log.

use crate::error::Error;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

static COUNT: AtomicU64 = AtomicU64::new(0);
static LAST: Mutex<String> = Mutex::new(String::new());

thread_local! {
    /// Open collections on this thread, innermost last.
    static COLLECTING: RefCell<Vec<Vec<String>>> = const { RefCell::new(Vec::new()) };
}

/// Records that `what` failed during teardown with `error`.
pub fn failed(what: &str, error: &Error) {
    let msg = format!("{what} failed during teardown: {error}");
    COUNT.fetch_add(1, Ordering::Relaxed);
    *LAST.lock().unwrap_or_else(|p| p.into_inner()) = msg.clone();
    // A thread being torn down has no collections left: the count and the
    // last message still hold it.
    let _ = COLLECTING.try_with(|c| {
        if let Some(open) = c.borrow_mut().last_mut() {
            open.push(msg);
        }
    });
}

/// Records the error of a teardown step, if it failed.
pub fn check(what: &str, r: crate::error::Result<()>) {
    if let Err(e) = r {
        failed(what, &e);
    }
}

/// Runs `f` and returns, with its result, the teardown errors recorded on
/// this thread meanwhile (those of a collection nested inside stay with
/// it). On a thread whose locals are being destroyed nothing is collected;
/// the count and the last message still hold every error. When `f`
/// unwinds, what it collected is lost with it (also but for those).
pub fn collect<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
    struct Open(bool);
    impl Drop for Open {
        fn drop(&mut self) {
            // Pops this collection even when `f` unwinds.
            if self.0 {
                let _ = COLLECTING.try_with(|c| c.borrow_mut().pop());
            }
        }
    }
    let open = Open(
        COLLECTING
            .try_with(|c| c.borrow_mut().push(Vec::new()))
            .is_ok(),
    );
    let out = f();
    let errors = COLLECTING
        .try_with(|c| c.borrow_mut().last_mut().map(std::mem::take))
        .ok()
        .flatten();
    drop(open);
    (out, errors.unwrap_or_default())
}

/// How many teardown errors the process has seen, and the last one's text.
pub fn last() -> (u64, Option<String>) {
    let count = COUNT.load(Ordering::Relaxed);
    let last = LAST.lock().unwrap_or_else(|p| p.into_inner()).clone();
    (count, (!last.is_empty()).then_some(last))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_reach_the_innermost_collection_and_the_process_record() {
        let before = last().0;
        let ((), outer) = collect(|| {
            failed("a free", &Error::invalid("CUDA_ERROR_INVALID_VALUE"));
            let ((), inner) = collect(|| check("a destroy", Err(Error::Internal("x".into()))));
            assert_eq!(inner.len(), 1);
            assert!(inner[0].starts_with("a destroy failed during teardown"));
        });
        assert_eq!(outer.len(), 1, "{outer:?}");
        assert!(outer[0].contains("a free") && outer[0].contains("CUDA_ERROR_INVALID_VALUE"));
        let (count, text) = last();
        assert!(count >= before + 2);
        assert!(text.is_some());
        // Outside any collection a failure is still counted.
        check("a sync", Err(Error::Internal("y".into())));
        assert!(last().0 > count);
    }
}
