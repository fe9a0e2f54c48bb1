//! The callables of each chunk: how the registered callables divide into
//! a schedule's chunks (`chunk_layers`), and which of them get a
//! weight-grad pass because their chunk has weight-grad steps.

use super::steps::{bad, ScheduleStep, Shape};
use crate::error::Result;

/// Which callables get a weight-grad pass by the schedule's steps: every
/// callable of a chunk that has weight-grad steps (one per callable, for
/// the chunks' `layers` starting at `prefix`).
pub(super) fn scheduled_wgrad(shape: &Shape, layers: &[usize], prefix: &[usize]) -> Vec<bool> {
    let n = prefix.last().zip(layers.last()).map_or(0, |(p, l)| p + l);
    let mut out = vec![false; n];
    for c in 0..shape.chunks {
        if shape.wgrad_steps[c] > 0 {
            out[prefix[c]..prefix[c] + layers[c]].fill(true);
        }
    }
    out
}

/// Which of `n` callables get a weight-grad pass as the schedule says (the
/// callables of chunks with weight-grad steps). The steps and the split
/// are checked as by `Schedule::derive`.
pub fn wgrad_as_scheduled(
    steps: &[ScheduleStep],
    layers_per_chunk: Option<&[u32]>,
    n: usize,
) -> Result<Vec<bool>> {
    let shape = Shape::check(steps)?;
    let (layers, prefix) = chunk_layers(&shape, layers_per_chunk, n)?;
    Ok(scheduled_wgrad(&shape, &layers, &prefix))
}

/// The layers (callables) of each chunk and the first callable of each:
/// `layers_per_chunk` when given (checked against `n` callables), else the
/// callables split evenly.
pub fn chunk_layers(
    shape: &Shape,
    layers_per_chunk: Option<&[u32]>,
    n: usize,
) -> Result<(Vec<usize>, Vec<usize>)> {
    let chunks = shape.chunks;
    let layers: Vec<usize> = match layers_per_chunk {
        Some(l) => {
            if l.len() != chunks {
                return Err(bad(format!(
                    "layers_per_chunk has {} entries; the schedule has {chunks} chunks",
                    l.len()
                )));
            }
            if let Some(c) = l.iter().position(|&x| x == 0) {
                return Err(bad(format!(
                    "layers_per_chunk[{c}] is 0; every chunk needs at least one layer"
                )));
            }
            let total: usize = l.iter().map(|&x| x as usize).sum();
            if total != n {
                return Err(bad(format!(
                    "the chunks hold {total} layers in all (layers_per_chunk) but {n} callables are registered; \
                     there must be one callable per layer"
                )));
            }
            l.iter().map(|&x| x as usize).collect()
        }
        None => {
            if n == 0 || n % chunks != 0 {
                return Err(bad(format!(
                    "{n} callables cannot be split evenly into {chunks} chunks; give layers_per_chunk"
                )));
            }
            vec![n / chunks; chunks]
        }
    };
    let mut prefix = vec![0; chunks];
    for c in 1..chunks {
        prefix[c] = prefix[c - 1] + layers[c - 1];
    }
    Ok((layers, prefix))
}
