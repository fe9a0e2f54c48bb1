//! Step 2 of capture, warmup: every pass runs eagerly on the capture
//! stream, in capture order, `warmup_iterations` times, with the session's
//! warmup hooks around them; the first iteration measures the scratch
//! arena, which serves every later iteration and the captures.

use super::super::context::Inputs;
use super::super::instance::PassRef;
use super::super::pool::Arena;
use super::super::scratch::Scratch;
use super::super::spec::{HookPoint, LogLevel, Phase};
use super::run::{Call, GraphOf, Runner};
use crate::backend::StreamRef;
use crate::error::{Error, Result};

/// The warmup iterations, with the session's hooks around them; returns
/// the scratch arena measured in the first.
pub(super) fn warmup(r: &mut Runner, order: &[PassRef]) -> Result<Option<Arena>> {
    let s = r.s;
    let hook = |point| -> Result<()> {
        let Some(h) = &s.opts.warmup_hook else {
            return Ok(());
        };
        h(point).map_err(|code| Error::HookFailed {
            hook: format!(
                "the {} hook of session '{}'",
                match point {
                    HookPoint::Pre => "pre-warmup",
                    HookPoint::Post => "post-warmup",
                },
                s.opts.name
            ),
            code,
        })
    };
    hook(HookPoint::Pre)?;
    let iterations = s.opts.warmup_iterations;
    let mut arena = None;
    for it in 0..iterations {
        if it > 0 {
            r.scratch.restart();
        }
        for &p in order {
            let call = Call {
                phase: Phase::Warmup,
                iteration: it,
                hooks: true,
                provide: false,
                param_grads: None,
                step_microbatch: (0, 1),
                step_index: 0,
                graph: GraphOf::Pass,
            };
            r.call(p, call)?;
        }
        if it == 0 {
            arena = measured_arena(s, r.scratch, r.stream)?;
        }
    }
    if iterations == 0 {
        arena = measured_arena(s, r.scratch, r.stream)?;
    }
    hook(HookPoint::Post)?;
    s.backend.synchronize(r.stream)?;
    let bytes = arena.as_ref().map_or(0, |a| a.bytes);
    s.log(LogLevel::Debug, || {
        format!("warmup done: {iterations} iteration(s), scratch arena {bytes} bytes")
    });
    Ok(arena)
}

/// After the first warmup iteration: the real scratch allocations go, and
/// an arena of the measured size from the pool takes over.
fn measured_arena(s: &Inputs, scratch: &Scratch, stream: StreamRef) -> Result<Option<Arena>> {
    s.backend.synchronize(stream)?;
    let arena = s.pool.acquire(scratch.high_water())?;
    let (base, size) = arena.as_ref().map_or((0, 0), |a| (a.base, a.bytes));
    scratch.use_arena(base, size);
    Ok(arena)
}
