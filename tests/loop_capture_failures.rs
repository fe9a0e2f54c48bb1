//! A looped step's body (a WHILE step on the host backend) whose callback
//! breaks a capture: the loop's own (a synchronize of the callback's
//! stream) or the one around the loop (a synchronize of every stream).
//! Either is GRAPHED_STATUS_CAPTURE_INVALIDATED naming the pass that did
//! it, no later callback of the body runs, and the session captures again
//! once the callback behaves.
//!
//! One test in this binary: synchronizing every host stream would break
//! the captures of tests running beside it.

use graphed::ffi::*;
use std::cell::Cell;
use std::ffi::c_void;
use std::ptr::null_mut;

mod common;
use common::{empty_ref, layer_desc, msg, ok};

const N: usize = 8;
const BYTES: usize = N * 4;

/// What the forward does while the loop's body is captured.
#[derive(Clone, Copy, PartialEq)]
enum Misdeed {
    None,
    /// Synchronizes its own (the loop's) stream, then returns `code`.
    BreakLoop {
        code: i32,
    },
    /// Synchronizes every stream (the capture around the loop too).
    BreakAll,
}

thread_local! {
    static MISDEED: Cell<Misdeed> = const { Cell::new(Misdeed::None) };
    /// Backward callbacks run inside a loop's body.
    static BODY_BACKWARDS: Cell<u32> = const { Cell::new(0) };
}

/// In a loop's body (a device index to read): `step_microbatch_index`
/// is set there and nowhere else.
fn in_body(c: &graphed_pass_ctx) -> bool {
    c.phase == graphed_phase::Capture as u32 && !c.step_microbatch_index.is_null()
}

unsafe extern "C" fn forward(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: the context is valid during the call.
    let c = unsafe { &*ctx };
    if in_body(c) {
        match MISDEED.get() {
            Misdeed::None => {}
            Misdeed::BreakLoop { code } => {
                assert_eq!(
                    graphed_host_synchronize(c.stream),
                    graphed_status::CaptureInvalidated
                );
                return code;
            }
            Misdeed::BreakAll => {
                assert_eq!(
                    graphed_host_synchronize(null_mut()),
                    graphed_status::CaptureInvalidated
                );
                return 0;
            }
        }
    }
    0
}

unsafe extern "C" fn backward(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: as above.
    if in_body(unsafe { &*ctx }) {
        BODY_BACKWARDS.set(BODY_BACKWARDS.get() + 1);
    }
    0
}

/// A host session with one layer (its grad COPY_INTO `dst`) and a WHILE
/// step over 3 microbatches of `x`.
fn session(w: &mut [f32], dst: &mut [f32], x: &mut [f32]) -> *mut graphed_session {
    let mut cfg = graphed_session_config_default();
    cfg.backend = graphed_backend::Host as u32;
    cfg.warmup_iterations = 1;
    let mut s = null_mut();
    // SAFETY: a valid config and out pointer.
    ok(unsafe { graphed_session_create(&cfg, &mut s) });
    let t = graphed_tensor_desc {
        bytes: BYTES,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    };
    let params = [graphed_param_desc {
        data: w.as_mut_ptr().cast(),
        bytes: BYTES,
        policy: graphed_grad_policy::CopyInto as u32,
        ..graphed_param_desc_default()
    }];
    let desc = layer_desc(&t, &t, &params, Some(forward), Some(backward));
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_callable(s, &desc, &mut idx) });
    let io = [graphed_step_io {
        callable: 0,
        role: graphed_buffer_role::Input as u32,
        ptr: x.as_mut_ptr().cast(),
        stride: BYTES,
        ..graphed_step_io_default()
    }];
    let dsts = [dst.as_mut_ptr().cast::<c_void>()];
    let callables = [0u32];
    let mut d = graphed_step_desc_default();
    d.loop_mode = graphed_step_loop::While as u32;
    d.callables = callables.as_ptr();
    d.num_callables = 1;
    d.microbatches = 3;
    d.io = io.as_ptr();
    d.num_io = 1;
    d.param_dsts = dsts.as_ptr();
    d.num_param_dsts = 1;
    // SAFETY: as above.
    ok(unsafe { graphed_session_add_step(s, &d, &mut idx) });
    s
}

/// Captures with `m` in force; returns the status, the message and the
/// backward callbacks the loop's body ran.
fn capture(s: *mut graphed_session, m: Misdeed) -> (graphed_status, String, u32) {
    MISDEED.set(m);
    BODY_BACKWARDS.set(0);
    let st = graphed_session_capture(s);
    let text = msg();
    MISDEED.set(Misdeed::None);
    (st, text, BODY_BACKWARDS.get())
}

#[test]
fn a_body_that_breaks_a_capture_is_named_and_stops_the_body() {
    let (mut w, mut dst, mut x) = (vec![0.5f32; N], vec![0f32; N], vec![1f32; 3 * N]);
    let cases = [
        (
            Misdeed::BreakLoop { code: 0 },
            "loop's body was invalidated",
        ),
        (
            Misdeed::BreakLoop { code: 5 },
            "the callback then returned 5",
        ),
        (Misdeed::BreakAll, "was invalidated"),
    ];
    for (m, says) in cases {
        let s = session(&mut w, &mut dst, &mut x);
        let (st, text, backwards) = capture(s, m);
        assert_eq!(st, graphed_status::CaptureInvalidated, "{text}");
        assert!(text.contains(says), "{text}");
        assert!(
            text.contains("capture of the forward pass of callable"),
            "the message names the forward: {text}"
        );
        assert_eq!(backwards, 0, "no callback runs after the break: {text}");
        // Nothing half-applied: the same session captures once the
        // callback behaves, and its step replays.
        let (st, text, backwards) = capture(s, Misdeed::None);
        assert_eq!(st, graphed_status::Ok, "{text}");
        assert_eq!(backwards, 1, "the body holds one microbatch's backward");
        let a = graphed_step_args_default();
        let mut refs = [empty_ref()];
        // SAFETY: valid args and room for the one grad's ref.
        ok(unsafe { graphed_step_replay(s, &a, refs.as_mut_ptr(), 1) });
        ok(graphed_session_destroy(s));
    }
}
