//! Stream arguments: the host streams callbacks kept (live, capturing or
//! gone), NULL, and forged values.

use super::*;

pub fn stream_live(k: &KeptStream) -> bool {
    if k.body {
        // Destroyed when its body's capture ended.
        return w().frames.borrow().iter().any(|f| f.body == k.h);
    }
    if w().frames.borrow().iter().any(|f| f.attempt == k.attempt) {
        return true;
    }
    let s = &w().sessions.borrow()[k.sess];
    s.alive && s.live_attempt == Some(k.attempt)
}

/// Whether `h` is a stream a running capture holds: its side stream, or
/// the stream of the loop body whose callback runs.
pub fn stream_capturing(h: usize) -> bool {
    w().frames
        .borrow()
        .iter()
        .any(|f| f.capturing && (f.stream == h || f.body == h))
}

/// A synchronize of `h` broke the captures that hold it.
pub fn break_captures_on(h: usize) {
    for f in w().frames.borrow_mut().iter_mut().filter(|f| f.capturing) {
        if f.stream == h {
            f.invalidated = true;
            f.broke |= 1;
        }
        if f.body == h {
            f.invalidated = true;
            f.broke |= 2;
        }
    }
}

/// A stream argument: (value, what looking it up gives: None = usable).
pub fn stream_arg(allow_null: bool) -> (usize, Option<graphed_status>) {
    let i = &w().input;
    let r = i.below(8);
    let kept = w().kept_streams.borrow();
    if r < 3 && !kept.is_empty() {
        let k = &kept[i.below(kept.len())];
        let st = if stream_live(k) {
            stream_capturing(k.h).then_some(S::StreamCapturing)
        } else {
            Some(S::UseAfterDestroy)
        };
        return (k.h, st);
    }
    drop(kept);
    if r == 3 || !allow_null {
        return (forged_id(), Some(S::InvalidArgument));
    }
    (0, None)
}
