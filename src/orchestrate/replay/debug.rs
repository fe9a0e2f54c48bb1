//! Debug mode (`SessionOptions::debug`, or GRAPHED_DEBUG=1 when the
//! session is created): a replay synchronizes its stream before it
//! enqueues anything and right after its pass (its graph and the copies
//! around it), and an error found there is returned naming where it
//! surfaced: the session, the callable (name and index), microbatch,
//! bucket, pass and graph (main, clone slot, the device's bucket choice),
//! or the step and its graph. A step replays pass by pass where it can, so
//! that each pass is checked on its own. The checks wrap the replay from
//! outside, out of line: without debug mode a replay runs the code it ran
//! before debug mode existed, after one test of the flag; the places are
//! written only once an error is found.

use super::super::captured::Rows;
use super::super::spec::{ReplayArgs, StepCall};
use super::{resolve, run_pass as replay_pass, step as steps, Parts, Replayed};
use crate::backend::StreamRef;
use crate::core::PassKind;
use crate::error::{Error, Result};
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

/// Which graph of a pass (or a step) ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Which {
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
fn check(p: &Parts, s: StreamRef, place: impl FnOnce() -> String) -> Result<()> {
    p.backend.synchronize(s).map_err(|cause| Error::Surfaced {
        place: format!("debug check in session '{}': {}", p.opts.name, place()),
        cause: Box::new(cause),
    })
}

/// Checks `s` for an error pending from earlier work, unless it is
/// capturing (synchronizing it would invalidate that capture; the replay
/// refuses it) or cannot be asked.
fn before(p: &Parts, s: StreamRef, what: impl FnOnce() -> String) -> Result<()> {
    if p.backend.is_capturing(s).unwrap_or(true) {
        return Ok(());
    }
    check(p, s, || {
        format!(
            "an error was pending before {} enqueued anything (it came from work enqueued earlier, on \
             this stream or elsewhere on the device)",
            what()
        )
    })
}

/// A pass's replay in debug mode (see the module comment): the pending
/// error checked first, then the replay as without debug mode (its
/// refusals unchanged), then the error its pass met.
#[cold]
#[inline(never)]
pub(super) fn run_pass(p: &mut Parts, a: &ReplayArgs, kind: PassKind) -> Result<()> {
    let _ctx = p.backend.bind()?;
    // What the replay will run, to name it (None: the replay refuses).
    let run = resolve(p, a, kind).ok();
    before(p, a.stream, || {
        format!("the {kind} replay of {}", describe(p, a, run))
    })?;
    replay_pass(p, a, kind)?;
    // A side stream was joined back: the caller's stream waits for it.
    check(p, a.stream, || {
        format!(
            "an error surfaced right after the {kind} pass of {} ran {} and the copies around it",
            describe(p, a, run),
            which(p, run)
        )
    })
}

/// "callable 'fc' (index 0), microbatch 0, bucket 1 (8 of its 16 rows)".
fn describe(p: &Parts, a: &ReplayArgs, run: Option<(usize, Rows)>) -> String {
    let Some((idx, rows)) = run else {
        let name = p
            .callables
            .get(a.callable as usize)
            .map_or("?", |c| &c.name);
        return format!(
            "callable '{name}' (index {}), microbatch {}",
            a.callable, a.microbatch
        );
    };
    let inst = &p.cap.instances[idx];
    let spec = &p.callables[inst.callable];
    let bucket = match rows {
        Rows::All => "no buckets".to_string(),
        Rows::Host(n, 0) => format!(
            "bucket {} ({n} of its {} rows)",
            inst.bucket,
            spec.bucket_size(inst.bucket as usize)
        ),
        Rows::Host(n, n2) => {
            let (b, b2) = spec.sizes(inst.bucket as usize);
            format!("bucket {} ({n} x {n2} of its {b} x {b2})", inst.bucket)
        }
        Rows::Device => "the bucket chosen on the device".to_string(),
    };
    format!(
        "callable '{}' (index {}), microbatch {}, {bucket}",
        spec.name, inst.callable, inst.microbatch
    )
}

/// The graph the pass that just ran launched: a clone slot's when the
/// block it returned its CLONE grads in (the stage's last) is a slot's
/// that has a graph, the device's choice when its rows were, else its main
/// graph (as `launch` chooses).
fn which(p: &Parts, run: Option<(usize, Rows)>) -> Which {
    let Some((idx, rows)) = run else {
        return Which::Main;
    };
    let c = p.cap.instances[idx].callable;
    let slot = p.cap.stage.blocks.last().and_then(|b| b.slot);
    let slot = slot.filter(|&k| match rows {
        Rows::Device => p.cap.switches[c].slot(k).is_some(),
        _ => p.cap.instances[idx].slot_graph(k).is_some(),
    });
    match (rows, slot) {
        (Rows::Device, k) => Which::Choice(k),
        (_, Some(k)) => Which::Slot(k),
        _ => Which::Main,
    }
}

/// A step's replay in debug mode: the pending error checked first; then
/// pass by pass where the step can be (each pass checked by `run_pass`),
/// else its one graph, checked right after.
#[cold]
#[inline(never)]
pub(crate) fn step<'a>(p: Parts<'a>, call: &StepCall) -> Result<Replayed<'a>> {
    let (step, stream) = (call.step, call.stream);
    let _ctx = p.backend.bind()?;
    let looped = p.cap.steps.get(step as usize).map(|st| st.looped);
    before(&p, stream, || {
        format!("the replay of {}", of_step(&p, step))
    })?;
    if looped != Some(true) {
        return steps::step(p, call);
    }
    let name = p.opts.name.clone();
    let of = of_step(&p, step);
    let backend = p.backend.clone();
    let st = &p.cap.steps[step as usize];
    let main = st.graph.is_some();
    let what = match st.update.is_some() {
        true => "its microbatches, its copies and its update",
        false => "its microbatches or its copies",
    };
    let r = steps::step(p, call)?;
    // The slot blocks the replay returned name the slot whose graph ran.
    let which = match r.blocks.last().and_then(|b| b.slot) {
        Some(k) if !main => Which::Slot(k),
        _ => Which::Main,
    };
    backend.synchronize(stream).map_err(|cause| Error::Surfaced {
        place: format!(
            "debug check in session '{name}': an error surfaced right after {of} ran {which}; the step \
             runs {what} in one graph and has no pass-by-pass replay, so the pass is not known"
        ),
        cause: Box::new(cause),
    })?;
    Ok(r)
}

/// "step 0 (callables 'a', 'b'; 2 microbatch(es))".
fn of_step(p: &Parts, step: u32) -> String {
    let Some(st) = p.cap.steps.get(step as usize) else {
        return format!("step {step}");
    };
    let names: Vec<String> = st
        .instances
        .iter()
        .map(|&i| format!("'{}'", p.callables[p.cap.instances[i].callable].name))
        .collect();
    format!(
        "step {step} (callables {}; {} microbatch(es))",
        names.join(", "),
        st.microbatches
    )
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
