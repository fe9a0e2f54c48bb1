//! Debug mode (`SessionOptions::debug`, or GRAPHED_DEBUG=1 when the
//! session is created): a replay synchronizes its stream before it
//! enqueues anything, after the copies of its data, right after each graph
//! it runs and after the copies of its grads, and an error found there is
//! returned naming where it surfaced: the session, the callable (name and
//! index), microbatch, bucket, pass and graph (main, clone slot, the
//! device's bucket choice), or the step and its graph. A step replays pass
//! by pass where it can, so that each pass is checked on its own. Off,
//! replays test the one bool at each point and do nothing else: the
//! places are written only once an error is found.

use super::Parts;
use crate::backend::StreamRef;
use crate::core::PassKind;
use crate::error::{Error, Result};
use crate::orchestrate::captured::Rows;
use std::ffi::OsStr;

/// The variable that turns debug mode on for every session created while
/// it is 1.
pub(crate) const ENV: &str = "GRAPHED_DEBUG";

/// Whether GRAPHED_DEBUG's value (`None`: unset) turns debug mode on: 1
/// does; unset, empty and 0 do not; anything else is refused, so that a
/// mode asked for is never silently off.
pub(crate) fn env_value(v: Option<&OsStr>) -> Result<bool> {
    match v.map(OsStr::to_str) {
        None | Some(Some("" | "0")) => Ok(false),
        Some(Some("1")) => Ok(true),
        Some(other) => Err(Error::invalid(format!(
            "{ENV} is {}: set it to 1 (debug replays) or 0, or unset it",
            other.map_or("not UTF-8".to_string(), |s| format!("'{s}'"))
        ))),
    }
}

/// Where in a pass's replay a check stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Point {
    /// Before the replay enqueued anything.
    Before,
    /// After the copies of its data into the static buffers (and the
    /// bucket's size), before its graph.
    Data,
    /// Right after its graph ran.
    Graph(Which),
    /// After the copies of its parameter grads (a clone block, COPY_INTO
    /// and ACCUMULATE_INTO destinations).
    Grads,
}

/// Which graph of a pass (or a step) ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Which {
    Main,
    Slot(usize),
    /// The graph choosing the bucket on the device (with clone slot k's
    /// bodies).
    Choice(Option<usize>),
}

impl std::fmt::Display for Which {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Which::Main => f.write_str("its main graph"),
            Which::Slot(k) => write!(f, "its clone slot {k} graph"),
            Which::Choice(None) => f.write_str("its graph choosing the bucket on the device"),
            Which::Choice(Some(k)) => write!(
                f,
                "its graph choosing the bucket on the device (clone slot {k})"
            ),
        }
    }
}

/// Synchronizes `s` and turns an error it reports into one naming `place`.
pub(super) fn check(p: &Parts, s: StreamRef, place: impl FnOnce() -> String) -> Result<()> {
    p.backend.synchronize(s).map_err(|cause| Error::Surfaced {
        place: format!("debug check in session '{}': {}", p.opts.name, place()),
        cause: Box::new(cause),
    })
}

/// The check at `point` of the `kind` replay of instance `idx`, running
/// `rows`.
pub(super) fn pass(
    p: &Parts,
    s: StreamRef,
    (idx, rows): (usize, Rows),
    kind: PassKind,
    point: Point,
) -> Result<()> {
    check(p, s, || {
        let what = describe(p, idx, rows);
        match point {
            Point::Before => format!(
                "an error was pending before the {kind} replay of {what} enqueued anything (it came from \
                 work enqueued earlier, on this stream or elsewhere on the device)"
            ),
            Point::Data => format!(
                "an error surfaced after the {kind} replay of {what} copied its data into the static \
                 buffers, before its graph ran"
            ),
            Point::Graph(which) => format!(
                "an error surfaced right after the {kind} pass of {what} ran {which}"
            ),
            Point::Grads => format!(
                "an error surfaced after the {kind} pass of {what} ran and its parameter grads were \
                 copied out (into a clone block or their destinations)"
            ),
        }
    })
}

/// "callable 'fc' (index 0), microbatch 0, bucket 1 (8 of 16 rows)".
fn describe(p: &Parts, idx: usize, rows: Rows) -> String {
    let inst = &p.cap.instances[idx];
    let spec = &p.callables[inst.callable];
    let bucket = match rows {
        Rows::All => "no buckets".to_string(),
        Rows::Host(n) => format!(
            "bucket {} ({n} of its {} rows)",
            inst.bucket,
            spec.buckets.get(inst.bucket as usize).copied().unwrap_or(0)
        ),
        Rows::Device => "the bucket chosen on the device".to_string(),
    };
    format!(
        "callable '{}' (index {}), microbatch {}, {bucket}",
        spec.name, inst.callable, inst.microbatch
    )
}

/// The check before (`graph` None) or right after a step's graph ran.
pub(super) fn step(p: &Parts, s: StreamRef, step: usize, graph: Option<Which>) -> Result<()> {
    check(p, s, || {
        let st = &p.cap.steps[step];
        let names: Vec<String> = st
            .instances
            .iter()
            .map(|&i| format!("'{}'", p.callables[p.cap.instances[i].callable].name))
            .collect();
        let of = format!(
            "step {step} (callables {}; {} microbatch(es))",
            names.join(", "),
            st.microbatches
        );
        match graph {
            None => format!(
                "an error was pending before the replay of {of} enqueued anything (it came from work \
                 enqueued earlier, on this stream or elsewhere on the device)"
            ),
            Some(which) => format!(
                "an error surfaced right after {of} ran {which}; the step runs its microbatches or its \
                 copies in one graph and has no pass-by-pass replay, so the pass is not known"
            ),
        }
    })
}

/// `e`, when debug mode found it, also saying that the pass ran in step
/// `step`, replayed pass by pass.
pub(super) fn in_step(e: Error, step: usize) -> Error {
    match e {
        Error::Surfaced { place, cause } => Error::Surfaced {
            place: format!("{place}, in step {step} (replayed pass by pass in debug mode)"),
            cause,
        },
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    #[test]
    fn the_variable_is_one_or_zero() {
        let v = |s: &str| env_value(Some(&OsString::from(s)));
        assert!(!env_value(None).unwrap());
        assert!(!v("").unwrap());
        assert!(!v("0").unwrap());
        assert!(v("1").unwrap());
        let e = v("yes").unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        assert!(e.to_string().contains("GRAPHED_DEBUG is 'yes'"), "{e}");
    }
}
