//! Replays: forward, backward and weight-grad with fuzzed arguments and
//! faults, checked against the frozen policies (ref kinds, clone contents,
//! COPY_INTO and ACCUMULATE_INTO destinations, leases).
//!
//! A replay runs in steps, one submodule each: build the arguments from the
//! input (`args`), work out the status graphed must answer (`expected`),
//! make the call, and again with the registered parameters' addresses after
//! a refusal for them (`execute`), then check what it returned (`results`).

use super::*;

mod args;
mod execute;
mod expected;
mod results;

pub use args::*;
use execute::*;
pub use expected::*;
pub use results::*;

/// A forward (0), backward (1) or weight-grad (2) replay. `streams`: the
/// (stream, side stream) a callback replays on.
pub fn op_replay(t: Target, kind: u32, streams: Option<(usize, usize)>) {
    replay_with(t, kind, streams, false)
}

/// A replay of a captured session (mostly) given the parameters' addresses
/// (see `params`).
pub fn op_replay_params(kind: u32) {
    replay_with(target_where(|s| s.st == St::Captured), kind, None, true)
}

/// A replay; with `params`, given the parameters' addresses in one of the
/// ways `params_arg` reads (read after every other choice, so that replays
/// without them read their input as before).
fn replay_with(t: Target, kind: u32, streams: Option<(usize, usize)>, params: bool) {
    let mut built = build_args(t, kind, streams, params);
    let e = expected(t, kind, &built);
    let func = [
        "graphed_forward",
        "graphed_backward",
        "graphed_backward_wgrad",
    ][kind as usize];
    let (r, epoch) = execute(t, kind, func, &mut built, &e);
    if let (S::Ok, 0, Some(k), Some(rows)) = (r, kind, built.sess, built.bucket_rows) {
        // The bucket (and rows) a bucketed callable's backward runs next.
        wd_last_forward(k, built.c as usize, rows);
    }
    if r != S::Ok {
        check_untouched(&built, func);
        return;
    }
    if let (Some(k), Some(FRows::Device(true))) = (built.sess, built.bucket_rows) {
        // The device counted the pass (a session destroyed by its own
        // callback is forgotten after the results).
        w().sessions.borrow_mut()[k].overflows += 1;
    }
    check_results(kind, func, epoch, built);
}

/// Records the rows of a bucketed callable's successful forward replay.
fn wd_last_forward(k: usize, c: usize, rows: FRows) {
    let mut ss = w().sessions.borrow_mut();
    if let Some(slot) = ss[k].last_fwd.get_mut(c) {
        *slot = Some(rows);
    }
}
