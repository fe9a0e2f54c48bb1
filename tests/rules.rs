//! The library's answers to what callers would otherwise work out for
//! themselves, through the C ABI on the host backend: which callables of a
//! schedule get a weight-grad pass, and what each pass of a schedule lets
//! go of with buffer reuse.

use graphed::ffi::*;
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

/// Transformer Engine's `_order` [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1].
fn te_steps() -> Vec<graphed_schedule_step> {
    [
        (FWD, 0),
        (FWD, 1),
        (FWD, 0),
        (FWD, 1),
        (BWD, 1),
        (BWD, 0),
        (FWD, 0),
        (FWD, 1),
        (BWD, 1),
        (BWD, 0),
        (BWD, 1),
        (BWD, 0),
    ]
    .iter()
    .map(|&(p, c)| step(p, c))
    .collect()
}

/// Calls graphed_schedule_passes with `has_wgrad` (None: NULL); returns
/// the status and the passes as (callable, microbatch, pass).
fn passes(
    steps: &[graphed_schedule_step],
    layers: &[u32],
    has_wgrad: Option<&[u32]>,
    n: u32,
) -> (graphed_status, Vec<(u32, u32, u32)>) {
    let mut out = vec![
        graphed_pass_ref {
            callable: 0,
            microbatch: 0,
            pass: 0
        };
        64
    ];
    let mut count = 0;
    // SAFETY: the arrays hold the stated counts; room for 64 passes.
    let st = unsafe {
        graphed_schedule_passes(
            if steps.is_empty() {
                null()
            } else {
                steps.as_ptr()
            },
            steps.len(),
            size_of::<graphed_schedule_step>(),
            if layers.is_empty() {
                null()
            } else {
                layers.as_ptr()
            },
            layers.len(),
            has_wgrad.map_or(null(), |w| w.as_ptr()),
            n,
            out.as_mut_ptr(),
            out.len(),
            size_of::<graphed_pass_ref>(),
            &mut count,
        )
    };
    let got = out[..count.min(64)]
        .iter()
        .map(|p| (p.callable, p.microbatch, p.pass))
        .collect();
    (st, got)
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
    let (st, as_scheduled) = passes(&steps, &[], None, 2);
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
    // The same as saying it.
    assert_eq!(passes(&steps, &[], Some(&[0, 1]), 2).1, as_scheduled);
    // Saying otherwise is still refused with the rule.
    let (st, _) = passes(&steps, &[], Some(&[0, 0]), 2);
    assert_eq!(st, S::InvalidSchedule);
    assert!(msg().contains("no weight-grad callback"), "{}", msg());
    // Without a schedule, NULL is none.
    assert_eq!(
        passes(&[], &[], None, 1),
        (S::Ok, vec![(0, 0, FWD), (0, 0, BWD)])
    );
}

/// Calls graphed_schedule_releases; the status, the count and the
/// releases as (after, callable, microbatch, role).
fn releases(
    steps: &[graphed_schedule_step],
    layers: &[u32],
    n: u32,
    capacity: usize,
    size: usize,
) -> (graphed_status, usize, Vec<(u32, u32, u32, u32)>) {
    let mut out = vec![
        graphed_release {
            after: 7,
            callable: 7,
            microbatch: 7,
            role: 7
        };
        capacity.min(64)
    ];
    let mut count = 0x77;
    // SAFETY: the arrays hold the stated counts; `out` has room for
    // `capacity` releases (or the call refuses the capacity).
    let st = unsafe {
        graphed_schedule_releases(
            if steps.is_empty() {
                null()
            } else {
                steps.as_ptr()
            },
            steps.len(),
            size_of::<graphed_schedule_step>(),
            if layers.is_empty() {
                null()
            } else {
                layers.as_ptr()
            },
            layers.len(),
            null(),
            n,
            if capacity == 0 {
                null_mut()
            } else {
                out.as_mut_ptr()
            },
            capacity,
            size,
            &mut count,
        )
    };
    let got = out
        .iter()
        .map(|r| (r.after, r.callable, r.microbatch, r.role))
        .collect();
    (st, count, got)
}

#[test]
fn releases_follow_transformer_engines_reuse_rules() {
    let steps = te_steps();
    // Pass positions: F00 F10 F01 F11 B10 B00 F02 F12 B11 B01 B12 B02
    //                  0   1   2   3   4   5   6   7   8   9  10  11
    let (st, count, _) = releases(&steps, &[], 2, 0, size_of::<graphed_release>());
    assert_eq!(st, S::Ok, "{}", msg());
    // Six outputs, six parameter-grad sets, five input grads (the last
    // backward step's is kept).
    assert_eq!(count, 17);
    let (st, _, all) = releases(&steps, &[], 2, count, size_of::<graphed_release>());
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
    let (st, count, some) = releases(&steps, &[], 2, 3, size_of::<graphed_release>());
    assert_eq!((st, count), (S::Ok, 17));
    assert_eq!(some, all[..3]);
    // A larger element size (a newer caller) is accepted.
    let mut wide = vec![[0u32; 6]; 17];
    let mut n = 0;
    // SAFETY: room for 17 elements of 24 bytes.
    ok(unsafe {
        graphed_schedule_releases(
            steps.as_ptr(),
            steps.len(),
            size_of::<graphed_schedule_step>(),
            null(),
            0,
            null(),
            2,
            wide.as_mut_ptr().cast(),
            17,
            24,
            &mut n,
        )
    });
    let firsts: Vec<(u32, u32, u32, u32)> = wide.iter().map(|w| (w[0], w[1], w[2], w[3])).collect();
    assert_eq!(firsts, all);
}

#[test]
fn a_first_layer_input_grad_is_kept_through_the_next_whole_backward_step() {
    // Two chunks of two layers: callables 0 1 | 2 3, two microbatches.
    let steps: Vec<graphed_schedule_step> = [
        (FWD, 0),
        (FWD, 1),
        (FWD, 0),
        (FWD, 1),
        (BWD, 1),
        (BWD, 0),
        (BWD, 1),
        (BWD, 0),
    ]
    .iter()
    .map(|&(p, c)| step(p, c))
    .collect();
    // F00 F10 F20 F30 F01 F11 F21 F31 B30 B20 B10 B00 B31 B21 B11 B01
    //  0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15
    let (st, _, all) = releases(&steps, &[], 4, 64, size_of::<graphed_release>());
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
    let (st, count, out) = releases(&steps, &[1, 2], 2, 4, size_of::<graphed_release>());
    assert_eq!(st, S::InvalidSchedule);
    assert!(
        msg().starts_with("graphed_schedule_releases: "),
        "{}",
        msg()
    );
    assert_eq!(count, 0x77, "count written on failure");
    assert!(out.iter().all(|r| r.0 == 7), "releases written on failure");
    // An element smaller than graphed_release.
    let (st, count, _) = releases(&steps, &[], 2, 4, 12);
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
        graphed_schedule_releases(
            steps.as_ptr(),
            steps.len(),
            size_of::<graphed_schedule_step>(),
            null(),
            0,
            null(),
            2,
            one.as_mut_ptr(),
            usize::MAX / 8,
            size_of::<graphed_release>(),
            &mut n,
        )
    };
    assert_eq!(st, S::InvalidArgument, "{}", msg());
    assert_eq!((n, one[0].after), (0x77, 7));
    // NULL count.
    // SAFETY: the NULL is refused.
    let st = unsafe {
        graphed_schedule_releases(
            steps.as_ptr(),
            steps.len(),
            size_of::<graphed_schedule_step>(),
            null(),
            0,
            null(),
            2,
            null_mut(),
            0,
            size_of::<graphed_release>(),
            null_mut(),
        )
    };
    assert_eq!(st, S::NullPointer);
}
