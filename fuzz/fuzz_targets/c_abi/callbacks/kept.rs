//! Handles a callback kept (its scratch, its capture, its stream): they die
//! when its call ends, and are then used from later ops and callbacks.

use super::*;

/// Handles kept during this call die with it.
pub(super) fn end_kept(ctx: &graphed_pass_ctx) {
    let wd = w();
    for k in wd
        .kept_scratch
        .borrow_mut()
        .iter_mut()
        .filter(|k| k.h == ctx.scratch as usize)
    {
        k.live = false;
    }
    for k in wd
        .kept_capture
        .borrow_mut()
        .iter_mut()
        .filter(|k| k.h == ctx.capture as usize)
    {
        k.live = false;
    }
}

/// Uses a handle a callback kept after its call ended.
pub fn use_kept() {
    let wd = w();
    let i = &wd.input;
    match i.below(3) {
        0 => {
            let h = wd
                .kept_scratch
                .borrow()
                .iter()
                .filter(|k| !k.live)
                .map(|k| k.h)
                .last();
            if let Some(h) = h {
                let mut p: *mut c_void = null_mut();
                // SAFETY: a local out pointer.
                let r = unsafe { graphed_scratch_alloc(h as *mut graphed_scratch, 64, &mut p) };
                expect(
                    r,
                    &[S::UseAfterDestroy],
                    "graphed_scratch_alloc",
                    "kept scratch",
                );
                let r = graphed_scratch_free(h as *mut graphed_scratch, 0x100 as *mut c_void);
                expect(
                    r,
                    &[S::UseAfterDestroy],
                    "graphed_scratch_free",
                    "kept scratch",
                );
            }
        }
        1 => {
            let h = wd
                .kept_capture
                .borrow()
                .iter()
                .filter(|k| !k.live)
                .map(|k| k.h)
                .last();
            if let Some(h) = h {
                let role = i.pick(&[ROLE_OUT, 8]);
                let r = graphed_pass_set_buffer(
                    h as *mut graphed_capture,
                    role,
                    0,
                    0x100 as *mut c_void,
                );
                let want = if role > 4 {
                    S::InvalidArgument
                } else {
                    S::UseAfterDestroy
                };
                expect(r, &[want], "graphed_pass_set_buffer", "kept capture");
            }
        }
        _ => {
            let n = wd.kept_streams.borrow().len();
            if n > 0 {
                let at = i.below(n);
                let (h, live) = {
                    let ks = wd.kept_streams.borrow();
                    (ks[at].h, stream_live(&ks[at]))
                };
                let capturing = stream_capturing(h);
                let r = graphed_host_synchronize(h as graphed_stream);
                let want = if !live {
                    S::UseAfterDestroy
                } else if capturing {
                    S::CaptureInvalidated
                } else {
                    S::Ok
                };
                expect(r, &[want], "graphed_host_synchronize", "kept stream");
                if capturing && want == S::CaptureInvalidated {
                    break_captures_on(h);
                }
                if live && !capturing {
                    let mut x = [0u8; 8];
                    let fill = Box::new(Fill::plain(vec![(x.as_mut_ptr() as usize, 8, 9)], 0, 0));
                    let fp = &*fill as *const Fill as *mut c_void;
                    // SAFETY: runs now (the stream is not capturing).
                    let r =
                        unsafe { graphed_host_enqueue(h as graphed_stream, Some(fill_task), fp) };
                    expect(r, &[S::Ok], "graphed_host_enqueue", "kept stream");
                    assert!(
                        x.iter().all(|&b| b == 9 ^ EPOCH.load(Ordering::Relaxed)),
                        "a task on an idle stream did not run now"
                    );
                }
            }
        }
    }
}
