//! The library's answers to what callers would otherwise work out for
//! themselves, through the C ABI on the host backend: the element size of
//! each dtype, which callables of a schedule get a weight-grad pass, what
//! each pass of a schedule lets go of with buffer reuse, how many buffers
//! a role has and how many refs a step returns, and the refusal to rebind
//! data that is not floating point.

use graphed::ffi::*;
use std::ffi::{c_char, c_void};
use std::ptr::{null, null_mut};

use graphed_status as S;

mod common;
use common::{msg, ok};

const FWD: u32 = graphed_pass::Forward as u32;
const BWD: u32 = graphed_pass::Backward as u32;
const WGRAD: u32 = graphed_pass::Wgrad as u32;
const OUTPUT: u32 = graphed_buffer_role::Output as u32;
const GRAD_INPUT: u32 = graphed_buffer_role::GradInput as u32;
const PARAM_GRADS: u32 = graphed_buffer_role::ParamGrads as u32;

fn step(pass: u32, chunk: u32) -> graphed_schedule_step {
    graphed_schedule_step { pass, chunk }
}

/// Steps from Transformer Engine's `_order` notation, as graphed reads it.
fn te(order: &[f64]) -> Vec<graphed_schedule_step> {
    let mut steps = vec![step(0, 0); order.len()];
    // SAFETY: room for one step per value.
    ok(unsafe {
        graphed_schedule_from_te_order(
            order.as_ptr(),
            order.len(),
            steps.as_mut_ptr(),
            size_of::<graphed_schedule_step>(),
        )
    });
    steps
}

/// Transformer Engine's scenario: two chunks of one layer, three microbatches.
fn te_steps() -> Vec<graphed_schedule_step> {
    te(&[
        1.0, 2.0, 1.0, 2.0, -2.0, -1.0, 1.0, 2.0, -2.0, -1.0, -2.0, -1.0,
    ])
}

#[test]
fn every_dtype_has_its_element_size_and_unknown_codes_are_refused() {
    use graphed_dtype as D;
    for (d, size) in [
        (D::F32, 4),
        (D::F16, 2),
        (D::Bf16, 2),
        (D::F64, 8),
        (D::I8, 1),
        (D::U8, 1),
        (D::I32, 4),
        (D::I64, 8),
        (D::Bool, 1),
    ] {
        let mut n = 0usize;
        // SAFETY: a local.
        ok(unsafe { graphed_dtype_size(d as u32, &mut n) });
        assert_eq!(n, size, "{d:?}");
    }
    for code in [9u32, 99, u32::MAX] {
        let mut n = 77usize;
        // SAFETY: a local.
        let st = unsafe { graphed_dtype_size(code, &mut n) };
        assert_eq!(st, S::InvalidArgument);
        assert!(
            msg().starts_with("graphed_dtype_size: ") && msg().contains("dtype"),
            "{}",
            msg()
        );
        assert_eq!(n, 77, "written on failure");
    }
    // SAFETY: NULL is refused.
    assert_eq!(unsafe { graphed_dtype_size(0, null_mut()) }, S::NullPointer);
}

/// graphed_schedule_passes or graphed_schedule_releases, as C declares it.
type ListFn<T> = unsafe extern "C" fn(
    *const graphed_schedule_step,
    usize,
    usize,
    *const u32,
    usize,
    *const u32,
    u32,
    *mut T,
    usize,
    usize,
    *mut usize,
) -> graphed_status;

/// A schedule as the helpers take it: `steps` (empty: none) over
/// `callables` split per `layers` (empty: evenly), `has_wgrad` (None: NULL).
struct Sched<'a> {
    steps: &'a [graphed_schedule_step],
    layers: &'a [u32],
    has_wgrad: Option<&'a [u32]>,
    callables: u32,
}

fn ptr_or_null<T>(v: &[T]) -> *const T {
    if v.is_empty() {
        null()
    } else {
        v.as_ptr()
    }
}

impl Sched<'_> {
    /// Calls `f` with `out` of `capacity` elements of `size` bytes and
    /// `count`.
    ///
    /// # Safety
    /// `out` has room for `capacity` elements of `size` bytes, or the call
    /// refuses them; `count` is NULL or writable.
    unsafe fn call<T>(
        &self,
        f: ListFn<T>,
        out: *mut T,
        capacity: usize,
        size: usize,
        count: *mut usize,
    ) -> graphed_status {
        // SAFETY: the arrays hold the stated counts; the rest is the
        // caller's promise.
        unsafe {
            f(
                ptr_or_null(self.steps),
                self.steps.len(),
                size_of::<graphed_schedule_step>(),
                ptr_or_null(self.layers),
                self.layers.len(),
                self.has_wgrad.map_or(null(), |w| w.as_ptr()),
                self.callables,
                out,
                capacity,
                size,
                count,
            )
        }
    }

    /// The status, the count (0x77 when untouched) and the list `f`
    /// writes into `capacity` elements of `size` bytes (NULL for 0),
    /// starting from `fill`.
    fn list<T: Copy>(
        &self,
        f: ListFn<T>,
        capacity: usize,
        size: usize,
        fill: T,
    ) -> (graphed_status, usize, Vec<T>) {
        let mut out = vec![fill; capacity];
        let p = if capacity == 0 {
            null_mut()
        } else {
            out.as_mut_ptr()
        };
        let mut count = 0x77;
        // SAFETY: `out` has room for `capacity` elements of their size, or
        // `size` is one the call refuses.
        let st = unsafe { self.call(f, p, capacity, size, &mut count) };
        (st, count, out)
    }

    /// graphed_schedule_passes: the status and the passes as (callable,
    /// microbatch, pass).
    fn passes(&self) -> (graphed_status, Vec<(u32, u32, u32)>) {
        let fill = graphed_pass_ref {
            callable: 0,
            microbatch: 0,
            pass: 0,
        };
        let (st, count, out) = self.list(
            graphed_schedule_passes,
            64,
            size_of::<graphed_pass_ref>(),
            fill,
        );
        let got = out[..count.min(64)]
            .iter()
            .map(|p| (p.callable, p.microbatch, p.pass))
            .collect();
        (st, got)
    }

    /// graphed_schedule_releases into `capacity` elements of `size` bytes:
    /// the status, the count and the releases.
    fn releases(&self, capacity: usize, size: usize) -> (graphed_status, usize, Vec<Rel>) {
        let fill = graphed_release {
            after: 7,
            callable: 7,
            microbatch: 7,
            role: 7,
        };
        let (st, count, out) = self.list(graphed_schedule_releases, capacity, size, fill);
        let got = out
            .iter()
            .map(|r| (r.after, r.callable, r.microbatch, r.role))
            .collect();
        (st, count, got)
    }
}

/// A release as (after, callable, microbatch, role).
type Rel = (u32, u32, u32, u32);

const REL: usize = size_of::<graphed_release>();

fn sched<'a>(steps: &'a [graphed_schedule_step], layers: &'a [u32], callables: u32) -> Sched<'a> {
    Sched {
        steps,
        layers,
        has_wgrad: None,
        callables,
    }
}

#[test]
fn without_has_wgrad_the_schedule_says_which_callables_have_a_weight_grad_pass() {
    // Two chunks of one layer; chunk 1 has weight-grad steps.
    let steps = [
        step(FWD, 0),
        step(FWD, 1),
        step(BWD, 1),
        step(WGRAD, 1),
        step(BWD, 0),
    ];
    let (st, as_scheduled) = sched(&steps, &[], 2).passes();
    assert_eq!(st, S::Ok, "{}", msg());
    assert_eq!(
        as_scheduled,
        vec![
            (0, 0, FWD),
            (1, 0, FWD),
            (1, 0, BWD),
            (1, 0, WGRAD),
            (0, 0, BWD)
        ]
    );
    let said = |w: &[u32]| {
        Sched {
            has_wgrad: Some(w),
            ..sched(&steps, &[], 2)
        }
        .passes()
    };
    // The same as saying it.
    assert_eq!(said(&[0, 1]).1, as_scheduled);
    // Saying otherwise is still refused with the rule.
    assert_eq!(said(&[0, 0]).0, S::InvalidSchedule);
    assert!(msg().contains("no weight-grad callback"), "{}", msg());
    // Without a schedule, NULL is none.
    assert_eq!(
        sched(&[], &[], 1).passes(),
        (S::Ok, vec![(0, 0, FWD), (0, 0, BWD)])
    );
}

#[test]
fn releases_follow_transformer_engines_reuse_rules() {
    let steps = te_steps();
    let te = sched(&steps, &[], 2);
    // Pass positions: F00 F10 F01 F11 B10 B00 F02 F12 B11 B01 B12 B02
    //                  0   1   2   3   4   5   6   7   8   9  10  11
    let (st, count, _) = te.releases(0, REL);
    assert_eq!(st, S::Ok, "{}", msg());
    // Six outputs, six parameter-grad sets, five input grads (the last
    // backward step's is kept).
    assert_eq!(count, 17);
    let (st, _, all) = te.releases(count, REL);
    assert_eq!(st, S::Ok, "{}", msg());
    assert!(all.windows(2).all(|w| w[0] <= w[1]), "ordered: {all:?}");
    let after = |pos: u32| -> Vec<(u32, u32, u32)> {
        all.iter()
            .filter(|r| r.0 == pos)
            .map(|r| (r.1, r.2, r.3))
            .collect()
    };
    assert!(
        (0..4).all(|p| after(p).is_empty()),
        "forwards release nothing"
    );
    assert_eq!(after(4), vec![(1, 0, OUTPUT), (1, 0, PARAM_GRADS)]);
    // Chunk 1's first-layer input grad once chunk 0's backward took it.
    assert_eq!(
        after(5),
        vec![(0, 0, OUTPUT), (0, 0, PARAM_GRADS), (1, 0, GRAD_INPUT)]
    );
    // Chunk 0's once the next backward step ran.
    assert!(after(8).contains(&(0, 0, GRAD_INPUT)));
    assert!(!all.iter().any(|r| (r.1, r.2, r.3) == (0, 2, GRAD_INPUT)));
    // A short array gets the first ones and the full count.
    let (st, count, some) = te.releases(3, REL);
    assert_eq!((st, count), (S::Ok, 17));
    assert_eq!(some, all[..3]);
    // A larger element size (a newer caller) is accepted.
    let mut wide = vec![[0u32; 6]; 17];
    let mut n = 0;
    // SAFETY: room for 17 elements of 24 bytes.
    ok(unsafe {
        te.call(
            graphed_schedule_releases,
            wide.as_mut_ptr().cast(),
            17,
            24,
            &mut n,
        )
    });
    let firsts: Vec<Rel> = wide.iter().map(|w| (w[0], w[1], w[2], w[3])).collect();
    assert_eq!(firsts, all);
}

#[test]
fn a_first_layer_input_grad_is_kept_through_the_next_whole_backward_step() {
    // Two chunks of two layers: callables 0 1 | 2 3, two microbatches.
    let steps = te(&[1.0, 2.0, 1.0, 2.0, -2.0, -1.0, -2.0, -1.0]);
    // F00 F10 F20 F30 F01 F11 F21 F31 B30 B20 B10 B00 B31 B21 B11 B01
    //  0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15
    let (st, _, all) = sched(&steps, &[], 4).releases(64, REL);
    assert_eq!(st, S::Ok, "{}", msg());
    let when = |c: u32, m: u32| {
        all.iter()
            .find(|r| (r.1, r.2, r.3) == (c, m, GRAD_INPUT))
            .map(|r| r.0)
    };
    assert_eq!(when(3, 0), Some(9), "taken by the layer before it");
    assert_eq!(when(2, 0), Some(11), "until chunk 0's step ended");
    assert_eq!(
        when(0, 0),
        Some(13),
        "the whole next step, not its first pass"
    );
    assert_eq!(when(0, 1), None, "the last step's is kept");
}

#[test]
fn releases_refuse_what_passes_refuses_and_bad_arrays() {
    let steps = te_steps();
    // A split that does not fit, as graphed_schedule_passes refuses it.
    let (st, count, out) = sched(&steps, &[1, 2], 2).releases(4, REL);
    assert_eq!(st, S::InvalidSchedule);
    assert!(
        msg().starts_with("graphed_schedule_releases: "),
        "{}",
        msg()
    );
    assert_eq!(count, 0x77, "count written on failure");
    assert!(out.iter().all(|r| r.0 == 7), "releases written on failure");
    let te = sched(&steps, &[], 2);
    // An element smaller than graphed_release.
    let (st, count, _) = te.releases(4, 12);
    assert_eq!((st, count), (S::InvalidArgument, 0x77));
    assert!(msg().contains("element size"), "{}", msg());
    // A capacity whose bytes overflow.
    let mut one = [graphed_release {
        after: 7,
        callable: 7,
        microbatch: 7,
        role: 7,
    }];
    let mut n = 0x77;
    // SAFETY: the capacity is refused before anything is written.
    let st = unsafe {
        te.call(
            graphed_schedule_releases,
            one.as_mut_ptr(),
            usize::MAX / 8,
            REL,
            &mut n,
        )
    };
    assert_eq!(st, S::InvalidArgument, "{}", msg());
    assert_eq!((n, one[0].after), (0x77, 7));
    // NULL count.
    // SAFETY: the NULL is refused.
    let st = unsafe { te.call(graphed_schedule_releases, null_mut(), 0, REL, null_mut()) };
    assert_eq!(st, S::NullPointer);
}

unsafe extern "C" fn noop(_: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    0
}

fn host() -> graphed_session_config {
    let mut c = graphed_session_config_default();
    c.backend = graphed_backend::Host as u32;
    c.warmup_iterations = 1;
    c
}

/// Registers a callable of `inputs` 16-byte inputs (of `dtype`, with
/// `flags`), `outputs` outputs and `params` parameters, every one taking
/// a grad.
fn add(s: *mut graphed_session, inputs: &[(u32, u32)], outputs: usize, params: usize) {
    let ins: Vec<graphed_tensor_desc> = inputs
        .iter()
        .map(|&(dtype, flags)| graphed_tensor_desc {
            bytes: 16,
            dtype,
            flags,
            requires_grad: 1,
            ..graphed_tensor_desc_default()
        })
        .collect();
    let outs: Vec<graphed_tensor_desc> = (0..outputs)
        .map(|_| graphed_tensor_desc {
            bytes: 16,
            requires_grad: 1,
            ..graphed_tensor_desc_default()
        })
        .collect();
    let ps: Vec<graphed_param_desc> = (0..params)
        .map(|_| graphed_param_desc {
            data: Box::leak(Box::new([0f32; 4])).as_mut_ptr().cast(),
            bytes: 16,
            requires_grad: 1,
            ..graphed_param_desc_default()
        })
        .collect();
    let mut d = graphed_callable_desc_default();
    d.num_inputs = ins.len();
    d.inputs = ins.as_ptr();
    d.num_outputs = outs.len();
    d.outputs = outs.as_ptr();
    d.num_params = ps.len();
    d.params = ps.as_ptr();
    d.forward = Some(noop);
    d.backward = Some(noop);
    let mut idx = 0;
    // SAFETY: the arrays hold the stated counts.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
}

fn create() -> *mut graphed_session {
    let mut s = null_mut();
    // SAFETY: a valid config and out pointer.
    ok(unsafe { graphed_session_create(&host(), &mut s) });
    s
}

fn buffer_count(s: *mut graphed_session, callable: u32, role: u32) -> (graphed_status, usize) {
    let mut n = 0x77;
    // SAFETY: a local.
    let st = unsafe { graphed_session_buffer_count(s, callable, 0, role, &mut n) };
    (st, n)
}

#[test]
fn each_role_has_as_many_buffers_as_graphed_session_buffers_takes() {
    let s = create();
    let f32 = graphed_dtype::F32 as u32;
    add(s, &[(f32, 0), (f32, 0), (f32, 0)], 2, 1);
    // Only a captured session has buffers.
    assert_eq!(buffer_count(s, 0, OUTPUT), (S::WrongState, 0x77));
    ok(graphed_session_capture(s));
    use graphed_buffer_role as R;
    for (role, want) in [
        (R::Input, 3),
        (R::Output, 2),
        (R::GradOutput, 2),
        (R::GradInput, 3),
        (R::ParamGrads, 1),
    ] {
        let (st, n) = buffer_count(s, 0, role as u32);
        assert_eq!((st, n), (S::Ok, want), "{role:?}: {}", msg());
        let mut ptrs = vec![null_mut::<c_void>(); n];
        // SAFETY: room for n pointers.
        ok(unsafe { graphed_session_buffers(s, 0, 0, role as u32, ptrs.as_mut_ptr(), n) });
    }
    assert_eq!(buffer_count(s, 0, 5), (S::InvalidArgument, 0x77));
    assert_eq!(buffer_count(s, 1, OUTPUT), (S::InvalidArgument, 0x77));
    let mut n = 0x77;
    // SAFETY: microbatch 1 does not exist; refused.
    let st = unsafe { graphed_session_buffer_count(s, 0, 1, OUTPUT, &mut n) };
    assert_eq!((st, n), (S::InvalidArgument, 0x77));
    // SAFETY: the NULL is refused.
    let st = unsafe { graphed_session_buffer_count(s, 0, 0, OUTPUT, null_mut()) };
    assert_eq!(st, S::NullPointer);
    ok(graphed_session_destroy(s));
}

#[test]
fn a_step_says_how_many_refs_its_replay_returns() {
    let s = create();
    let f32 = graphed_dtype::F32 as u32;
    add(s, &[(f32, 0)], 1, 2);
    add(s, &[(f32, 0)], 1, 3);
    add(s, &[(f32, 0)], 1, 0);
    let callables = [0u32, 2, 1];
    let mut d = graphed_step_desc_default();
    let mut index = 0;
    for (k, list) in [&callables[..1], &[0, 1, 2]].into_iter().enumerate() {
        d.callables = list.as_ptr();
        d.num_callables = list.len();
        // SAFETY: a valid descriptor and out pointer.
        ok(unsafe { graphed_session_add_step(s, &d, &mut index) });
        assert_eq!(index as usize, k);
    }
    for (step, want) in [(0, 2), (1, 5)] {
        let mut n = 0;
        // SAFETY: a local.
        ok(unsafe { graphed_step_param_count(s, step, &mut n) });
        assert_eq!(n, want, "step {step}");
    }
    let mut n = 0x77;
    // SAFETY: a local; step 2 does not exist.
    let st = unsafe { graphed_step_param_count(s, 2, &mut n) };
    assert_eq!((st, n), (S::InvalidArgument, 0x77));
    assert!(msg().contains("step 2 does not exist"), "{}", msg());
    // SAFETY: the NULL is refused.
    assert_eq!(
        unsafe { graphed_step_param_count(s, 0, null_mut()) },
        S::NullPointer
    );
    ok(graphed_session_destroy(s));
}

/// The plan dump as text.
fn plan_dump(s: *mut graphed_session) -> String {
    let mut len = 0;
    // SAFETY: a NULL buffer asks for the length.
    ok(unsafe { graphed_session_plan_dump(s, null_mut(), 0, &mut len) });
    let mut buf = vec![0u8; len + 1];
    // SAFETY: room for len + 1 bytes.
    ok(unsafe {
        graphed_session_plan_dump(s, buf.as_mut_ptr() as *mut c_char, buf.len(), &mut len)
    });
    String::from_utf8_lossy(&buf[..len]).into_owned()
}

/// Callers may ask for rebinding whatever the dtype: graphed refuses, with
/// its reason, what it has not verified, including the bytes a caller
/// sends as U8 for types graphed has no code for.
#[test]
fn rebinding_data_that_is_not_floating_point_is_refused_with_the_reason() {
    let s = create();
    let rebind = graphed_tensor_flags::Rebind as u32;
    add(
        s,
        &[
            (graphed_dtype::U8 as u32, rebind),
            (graphed_dtype::I32 as u32, rebind),
            (graphed_dtype::F32 as u32, rebind),
        ],
        1,
        0,
    );
    ok(graphed_session_capture(s));
    let mut on = [7u32; 3];
    // SAFETY: room for three values.
    ok(unsafe {
        graphed_session_rebound(
            s,
            0,
            0,
            graphed_buffer_role::Input as u32,
            on.as_mut_ptr(),
            3,
        )
    });
    assert_eq!(on, [0, 0, 0]);
    let dump = plan_dump(s);
    let line = |k: usize| {
        dump.lines()
            .filter(|l| l.contains("copied at replay"))
            .nth(k)
            .unwrap_or_default()
            .to_string()
    };
    assert!(line(0).contains("u8 tensors are copied"), "{dump}");
    assert!(line(1).contains("i32 tensors are copied"), "{dump}");
    // A floating-point input is not refused for its dtype (the host
    // backend refuses it for its opaque tasks).
    assert!(!line(2).contains("tensors are copied"), "{dump}");
    ok(graphed_session_destroy(s));
}
