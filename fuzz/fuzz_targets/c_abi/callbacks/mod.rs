//! The callbacks: forward, backward, weight-grad and hooks read what to do
//! from the input (fail, ask for scratch, synchronize, keep their handles,
//! call back into their session, replay or destroy sessions, hand over
//! external buffers), the host tasks they record, and in-callback handles
//! used after their call.
//!
//! `callback` below runs one call in the steps its submodules hold: check
//! what the call was given (`seen`), do what the input asks (`behaviours`,
//! with the calls into graphed of `nested`), do the pass's plain work
//! (`work`), end the handles kept during the call (`kept`), then decide the
//! failure the call reports.

use super::*;

mod behaviours;
mod kept;
mod nested;
mod seen;
mod work;

use behaviours::*;
pub use kept::*;
pub use nested::*;
use seen::*;
pub use work::*;

pub fn callback(ctx: *const graphed_pass_ctx, ud: *mut c_void, which: u32) -> i32 {
    // SAFETY: graphed passes the user data registered with this callable.
    let cb = unsafe { &*(ud as *const Cb) };
    assert!(!ctx.is_null());
    // SAFETY: valid for the call.
    let ctx = unsafe { &*ctx };
    let seen = check_ctx(ctx, cb, which);
    let mut b = fuzzed_behaviours(ctx, cb, &seen);
    pass_work(ctx, cb, &seen, b.code, b.skip_provide, &mut b.provided);
    let _ = (b.extra_scratch, seen.sess_h);
    end_kept(ctx);
    decide_failure(cb, &seen, b.code, &b.provided);
    b.code
}

/// The failure this run decides, recorded in the innermost capture frame,
/// and the message a failing callback leaves.
fn decide_failure(cb: &Cb, seen: &Seen, code: i32, provided: &[(u32, usize)]) {
    let wd = w();
    let (cl, pass, capture_phase) = (&seen.cl, seen.pass, seen.capture_phase);
    let mut fs = wd.frames.borrow_mut();
    let f = fs.last_mut().unwrap();
    // A refused scratch request fails the capture only through the
    // callback: one that carries on without it is fine; one that fails is
    // reported as the refusal. An invalidated capture is the root cause
    // before either.
    let decided = if capture_phase && f.invalidated {
        Some(S::CaptureInvalidated)
    } else if code != 0 && !cb.hook && f.scratch_fail {
        Some(S::ScratchExhausted)
    } else if code != 0 {
        Some(S::CallbackFailed)
    } else if capture_phase
        && !seen.in_step
        && externals(cl, pass)
            .iter()
            .any(|&(r, j, _)| !provided.contains(&(r, j)))
    {
        Some(S::InvalidArgument)
    } else {
        None
    };
    if decided == Some(S::CaptureInvalidated) && f.first.is_none() && f.body != 0 {
        // Broken from a loop's body: named by its pass, the body's own
        // capture (only) said to be its, the callback's code kept.
        let pass = ["forward", "backward", "weight-grad"][pass as usize];
        f.named = vec![format!("capture of the {pass} pass of callable '")];
        if f.broke == 2 {
            f.named
                .push("the capture of the loop's body was invalidated".into());
        }
        if code != 0 {
            f.named.push(format!("; the callback then returned {code}"));
        }
    }
    if !cb.hook {
        f.capturing = false;
        f.body = 0;
        f.broke = 0;
    }
    // A failing callback says why (some codes), or clears what it said.
    let said = matches!(code, 1 | 7 | i32::MAX).then(|| format!("fuzz callback says {code}"));
    if code != 0 {
        let text = said
            .as_ref()
            .map(|t| std::ffi::CString::new(t.as_str()).unwrap());
        mark();
        // SAFETY: NULL or a NUL-terminated string.
        let r =
            unsafe { graphed_callback_fail_message(text.as_ref().map_or(null(), |t| t.as_ptr())) };
        expect(
            r,
            &[S::Ok],
            "graphed_callback_fail_message",
            "before failing",
        );
    }
    if let Some(e) = decided {
        if f.first.is_none() && e == S::CallbackFailed {
            f.said = said;
        }
        f.first.get_or_insert(e);
    }
}
