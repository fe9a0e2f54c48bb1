//! Stream arguments: the host streams callbacks kept (live, capturing or
//! gone), NULL, and forged values.

use super::*;

pub fn stream_live(k: &KeptStream) -> bool {
    if w().frames.borrow().iter().any(|f| f.attempt == k.attempt) {
        return true;
    }
    let s = &w().sessions.borrow()[k.sess];
    s.alive && s.live_attempt == Some(k.attempt)
}

pub fn stream_capturing(h: usize) -> bool {
    w().frames
        .borrow()
        .iter()
        .any(|f| f.capturing && f.stream == h)
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
