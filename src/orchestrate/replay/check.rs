//! What a replay checks before it enqueues anything: the data it is fed
//! (one entry per buffer, no NULL where a buffer needs data, nothing but
//! the buffer itself for a chained one), the destinations of COPY_INTO and
//! ACCUMULATE_INTO grads, the parameters' addresses (a forward may move
//! those its graphs can follow; other passes read them where their forward
//! did), and that no stream it uses is capturing.

use super::super::instance::Placed;
use super::super::tensor::{Feed, Param, Tensor};
use crate::backend::{Backend, DevPtr, StreamRef};
use crate::error::{Error, Result};

/// Checks the data fed to `tensors` (the inputs or the grad-outputs of
/// callable `name`, `what` as the caller's array is called).
pub(super) fn data(
    data: Option<&[DevPtr]>,
    tensors: &[Tensor],
    what: &str,
    name: &str,
) -> Result<()> {
    let Some(d) = data else { return Ok(()) };
    let expected = tensors.len();
    let chained = |i: usize| matches!(tensors[i].feed, Feed::Chained);
    if let Some(i) =
        (0..d.len().min(expected)).find(|&i| chained(i) && d[i] != 0 && d[i] != tensors[i].ptr)
    {
        return Err(Error::invalid(format!(
            "{what}[{i}] of callable '{name}' is chained to another callable's buffer (0x{:x}); it takes no other \
             data: pass that buffer, NULL, or a NULL data array",
            tensors[i].ptr
        )));
    }
    if d.len() != expected {
        return Err(Error::invalid(format!(
            "{} {what} were passed; callable '{name}' has {expected}",
            d.len()
        )));
    }
    let needed = |i: usize| tensors[i].ptr != 0 && !chained(i);
    if let Some(i) = (0..d.len()).find(|&i| d[i] == 0 && needed(i)) {
        return Err(Error::invalid(format!(
            "{what}[{i}] of callable '{name}' is NULL (pass the whole {what} array as NULL to replay on what the \
             static buffers hold)"
        )));
    }
    Ok(())
}

/// Checks the destinations of COPY_INTO / ACCUMULATE_INTO slots: one per
/// parameter, each able to take its grad (`ParamReturn::destination_problem`).
pub(super) fn destinations(dsts: Option<&[DevPtr]>, inst: &Placed, name: &str) -> Result<()> {
    let grads = &inst.param_grads;
    let n = grads.len();
    let Some(d) = dsts else {
        return match grads.iter().position(|t| t.ret.needs_destination()) {
            Some(i) => Err(Error::invalid(format!(
                "callable '{name}' has parameters returned by COPY_INTO or ACCUMULATE_INTO (param {i}): pass param_dsts"
            ))),
            None => Ok(()),
        };
    };
    if d.len() != n {
        return Err(Error::invalid(format!(
            "{} param destinations were passed; callable '{name}' has {n} parameters",
            d.len()
        )));
    }
    for (i, (t, &dst)) in grads.iter().zip(d).enumerate() {
        if let Some(problem) = t.ret.destination_problem(dst) {
            return Err(Error::invalid(format!(
                "param_dsts[{i}] of callable '{name}' {problem}"
            )));
        }
    }
    Ok(())
}

/// Checks the parameters' addresses given to a replay of `who`: one per
/// parameter; a forward (`moves`) may give new ones its graphs can be
/// pointed at, any other pass only those its graphs read now (its
/// forward's).
pub(super) fn params(
    given: Option<&[DevPtr]>,
    params: &[Param],
    moves: bool,
    who: impl Fn() -> String,
) -> Result<()> {
    let Some(given) = given else { return Ok(()) };
    if given.len() != params.len() {
        return Err(Error::invalid(format!(
            "{} parameter addresses were passed to {}; it has {} parameters",
            given.len(),
            who(),
            params.len()
        )));
    }
    for (p, &to) in params.iter().zip(given) {
        if to == 0 || to == p.bound() {
            continue;
        }
        if !moves {
            return Err(Error::invalid(format!(
                "param {} was passed to {} at 0x{to:x}, but its forward read it at 0x{:x}: a pass reads \
                 the parameters where its forward did (move parameters before a forward, between \
                 iterations)",
                p.index,
                who(),
                p.bound()
            )));
        }
        movable(p, to, &who)?;
    }
    Ok(())
}

/// Refuses `to` for parameter `p` of `who` where its graphs cannot be
/// pointed there, naming both addresses.
pub(super) fn movable(p: &Param, to: DevPtr, who: impl Fn() -> String) -> Result<()> {
    match p.refusal(to) {
        None => Ok(()),
        Some(why) => Err(Error::ParamMoved(format!(
            "param {} of {} moved from 0x{:x} to 0x{to:x}, and its graphs cannot be pointed there: {why}",
            p.index,
            who(),
            p.bound()
        ))),
    }
}

/// Points the graphs at the parameters' given addresses (`params` checked
/// them); returns how many moved. A failure part way leaves the failed one
/// unknown (its next bind redoes it) and the others where they were
/// pointed.
pub(super) fn bind_params(given: Option<&[DevPtr]>, params: &mut [Param]) -> Result<u64> {
    let Some(given) = given else { return Ok(0) };
    let mut moved = 0;
    for (p, &to) in params.iter_mut().zip(given) {
        if to != 0 && to != p.bound() {
            p.bind(to)?;
            moved += 1;
        }
    }
    Ok(moved)
}

/// Refuses a replay on a stream that is capturing a graph.
pub(super) fn streams(
    backend: &dyn Backend,
    stream: StreamRef,
    side: Option<StreamRef>,
    who: impl Fn() -> String,
) -> Result<()> {
    for (s, what) in [(Some(stream), "stream"), (side, "side_stream")] {
        match s {
            Some(s) if backend.is_capturing(s)? => {
                return Err(Error::StreamCapturing(format!(
                    "{}: args.{what} is capturing a graph. graphed replays cannot be recorded into another \
                     capture (their clones and copies would outlive what the outer graph can own); replay \
                     outside the capture, or capture the callables together as a step. Nothing was enqueued",
                    who()
                )))
            }
            _ => {}
        }
    }
    Ok(())
}
