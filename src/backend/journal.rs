//! The first failing call under a capture, for the capture's error: while
//! graphed captures a pass on this thread (`arm` .. `take`), the first
//! driver call that fails (the CUDA backend's `check`) or graphed export
//! that fails (the C boundary; a host stream synchronized under capture,
//! say) is kept, so that a capture the driver invalidated names the
//! operation that broke it where graphed saw one. Thread-local: callbacks
//! run on the capturing thread.

use std::cell::RefCell;

thread_local! {
    /// None: not armed; Some(None): armed, nothing failed yet.
    static FIRST: RefCell<Option<Option<String>>> = const { RefCell::new(None) };
}

/// Starts watching for the first failing call on this thread (a capture
/// begins); forgets what an earlier capture left.
pub fn arm() {
    FIRST.with(|f| *f.borrow_mut() = Some(None));
}

/// Notes a failed call, `what` ("cuMemcpyDtoDAsync failed with ..."), when
/// armed and nothing failed before it.
pub fn note(what: impl FnOnce() -> String) {
    FIRST.with(|f| {
        if let Ok(mut slot) = f.try_borrow_mut() {
            if let Some(first @ None) = slot.as_mut() {
                *first = Some(what());
            }
        }
    });
}

/// The first failing call since `arm`, if any; stops watching.
pub fn take() -> Option<String> {
    FIRST.with(|f| f.borrow_mut().take().flatten())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_first_call_while_armed() {
        note(|| "before".into());
        arm();
        note(|| "first".into());
        note(|| "second".into());
        assert_eq!(take().as_deref(), Some("first"));
        note(|| "after".into());
        assert_eq!(take(), None, "disarmed");
    }
}
