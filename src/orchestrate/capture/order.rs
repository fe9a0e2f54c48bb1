//! The order of capture: the schedule's passes (or the default order:
//! forwards in registration order, backwards in reverse, each weight-grad
//! after its backward), bucket round by bucket round, as placed instance
//! indices; and what buckets do not work with yet.

use super::super::context::Inputs;
use super::super::instance::PassRef;
use super::super::place;
use crate::core::schedule::Schedule;
use crate::error::{Error, Result};

/// The order of the session's passes: the schedule's, or the default.
pub(super) fn order_of(s: &Inputs) -> Result<(Schedule, Vec<PassRef>)> {
    let has_wgrad: Vec<bool> = s
        .callables
        .iter()
        .map(|c| c.callbacks.has_wgrad())
        .collect();
    let schedule = match &s.opts.schedule {
        Some(spec) => Schedule::derive(&spec.steps, spec.layers_per_chunk.as_deref(), &has_wgrad)?,
        None => Schedule::sequential(&has_wgrad),
    };
    let m = schedule.microbatches;
    check_buckets(s, m)?;
    // Bucket by bucket: each round runs the schedule's passes of every
    // callable that has that many buckets, so that the scratch a round's
    // forwards keep for its backwards is free again before the next round
    // (buckets share one scratch arena, sized for the largest).
    let first = place::first_instances(s, m);
    let rounds = s.callables.iter().map(|c| c.bucket_count()).max();
    let mut order = Vec::with_capacity(schedule.passes.len());
    for b in 0..rounds.unwrap_or(1) {
        for p in &schedule.passes {
            let buckets = s.callables[p.callable].bucket_count();
            if b < buckets {
                order.push(PassRef {
                    instance: first[p.callable] + p.microbatch * buckets + b,
                    kind: p.kind,
                });
            }
        }
    }
    Ok((schedule, order))
}

/// Refuses buckets where the session has what they do not work with yet:
/// a pipeline schedule, a step over a callable with buckets, or the
/// device's choice over buffers each bucket's capture provided, over a
/// grid or over tensors that vary on another dimension than the first.
fn check_buckets(s: &Inputs, microbatches: usize) -> Result<()> {
    let Some(c) = s.callables.iter().find(|c| !c.buckets.is_empty()) else {
        return Ok(());
    };
    if microbatches > 1 || s.opts.schedule.is_some() {
        return Err(Error::invalid(format!(
            "callable '{}' has buckets, and the session has a pipeline schedule: buckets need the \
             default order (one microbatch)",
            c.name
        )));
    }
    for (i, step) in s.steps.iter().enumerate() {
        if let Some(&k) = step
            .callables
            .iter()
            .find(|&&k| !s.callables[k as usize].buckets.is_empty())
        {
            return Err(Error::invalid(format!(
                "step {i} holds callable '{}', which has buckets: steps hold callables of one shape",
                s.callables[k as usize].name
            )));
        }
    }
    if s.opts.device_buckets {
        for c in s.callables.iter().filter(|c| !c.buckets.is_empty()) {
            if !c.buckets2.is_empty() || c.strided() {
                return Err(Error::invalid(format!(
                    "callable '{}' has {}: bucket_choice_on_device chooses among buckets of one size whose \
                     tensors vary on their first dimension",
                    c.name,
                    match c.buckets2.is_empty() {
                        true => "a DYNAMIC tensor that varies on another dimension than its first",
                        false => "a grid of buckets (bucket_sizes2)",
                    }
                )));
            }
            let outputs = c.outputs.iter().position(|t| t.external);
            let grads = c.inputs.iter().position(|t| t.external && t.requires_grad);
            let params = c
                .params
                .iter()
                .position(|p| p.external_grad() && p.requires_grad);
            let what = match (outputs, grads, params) {
                (Some(o), _, _) => format!("output {o}"),
                (_, Some(i), _) => format!("the grad of input {i}"),
                (_, _, Some(j)) => format!("the grad of param {j}"),
                _ => continue,
            };
            return Err(Error::invalid(format!(
                "callable '{}' has buckets and an external buffer ({what}): each bucket's capture provides \
                 its own, so a replay whose bucket the device chooses could not say where its results are; \
                 bucket_choice_on_device needs buffers the library places",
                c.name
            )));
        }
    }
    Ok(())
}
