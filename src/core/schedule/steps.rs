//! The steps of a schedule as the caller gives them: one step is the
//! forward, backward or weight-grad of a model chunk. They are read from
//! Transformer Engine's `_order` notation (`from_te_order`) or given as
//! they are, and checked by the rules that need no callable (`Shape`:
//! counts and order, one message per rule).

use super::super::PassKind;
use crate::error::{Error, Result};

/// One step of a schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduleStep {
    pub kind: PassKind,
    /// The model chunk, from 0.
    pub chunk: u32,
}

pub(super) fn bad(msg: String) -> Error {
    Error::InvalidSchedule(msg)
}

/// Checks what the steps alone can be checked for (counts and order), before
/// any callable is registered.
pub fn check_steps(steps: &[ScheduleStep]) -> Result<()> {
    Shape::check(steps).map(|_| ())
}

/// The most passes a schedule may expand to: a bound on what numbers from
/// a caller make the library build (real sessions are far below).
pub const MAX_PASSES: usize = 1 << 22;

/// What the steps alone say: chunk and microbatch counts, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shape {
    pub chunks: usize,
    pub microbatches: usize,
    /// Weight-grad steps per chunk.
    pub wgrad_steps: Vec<usize>,
}

impl Shape {
    /// Checks the steps' counts and order and returns their shape.
    pub fn check(steps: &[ScheduleStep]) -> Result<Shape> {
        if steps.is_empty() {
            return Err(bad("the schedule has no steps".into()));
        }
        let chunks = steps.iter().map(|s| s.chunk as usize).max().unwrap_or(0) + 1;
        if chunks > 4096 {
            return Err(bad(format!(
                "chunk {} is out of range (at most 4096 chunks)",
                chunks - 1
            )));
        }
        // Steps of each kind and chunk, counted in one pass.
        let mut seen = vec![vec![0usize; chunks]; 3];
        for s in steps {
            seen[s.kind.index()][s.chunk as usize] += 1;
        }
        let count = |k: PassKind, c: usize| seen[k.index()][c];
        let fb = steps.iter().filter(|s| s.kind != PassKind::Wgrad).count();
        if fb % (2 * chunks) != 0 {
            return Err(bad(format!(
                "the schedule has {fb} forward and backward steps over {chunks} chunks; it needs \
                 chunks x microbatches x 2 of them"
            )));
        }
        let mb = fb / (2 * chunks);
        for c in 0..chunks {
            let (f, b) = (count(PassKind::Forward, c), count(PassKind::Backward, c));
            if f != mb || b != mb {
                return Err(bad(format!(
                    "chunk {c} has {f} forward and {b} backward steps; with {chunks} chunks and {mb} microbatches \
                     every chunk needs {mb} of each"
                )));
            }
            let w = count(PassKind::Wgrad, c);
            if w != 0 && w != b {
                return Err(bad(format!(
                    "chunk {c} has {w} weight-grad steps and {b} backward steps; they must be as many"
                )));
            }
        }
        // Position of the k-th step of each kind and chunk.
        let mut pos = vec![vec![vec![usize::MAX; mb]; chunks]; 3];
        let mut next = vec![vec![0usize; chunks]; 3];
        for (i, s) in steps.iter().enumerate() {
            let (k, c) = (s.kind.index(), s.chunk as usize);
            let n = &mut next[k][c];
            if *n < mb {
                pos[k][c][*n] = i;
            }
            *n += 1;
        }
        let (fwd, bwd, wg) = (&pos[0], &pos[1], &pos[2]);
        for c in 0..chunks {
            for m in 0..mb {
                if bwd[c][m] < fwd[c][m] {
                    return Err(bad(format!(
                        "step {}: the backward of chunk {c} for microbatch {m} comes before its forward (step {})",
                        bwd[c][m], fwd[c][m]
                    )));
                }
                if c > 0 && fwd[c][m] < fwd[c - 1][m] {
                    return Err(bad(format!(
                        "step {}: the forward of chunk {c} for microbatch {m} comes before the forward of chunk {} \
                         (step {}) whose output it takes",
                        fwd[c][m],
                        c - 1,
                        fwd[c - 1][m]
                    )));
                }
                if c + 1 < chunks && bwd[c][m] < bwd[c + 1][m] {
                    return Err(bad(format!(
                        "step {}: the backward of chunk {c} for microbatch {m} comes before the backward of chunk {} \
                         (step {}) whose input grad it takes",
                        bwd[c][m],
                        c + 1,
                        bwd[c + 1][m]
                    )));
                }
                if seen[2][c] > 0 && wg[c][m] < bwd[c][m] {
                    return Err(bad(format!(
                        "step {}: the weight-grad of chunk {c} for microbatch {m} comes before its backward (step {})",
                        wg[c][m], bwd[c][m]
                    )));
                }
            }
        }
        Ok(Shape {
            chunks,
            microbatches: mb,
            wgrad_steps: seen[2].clone(),
        })
    }
}

/// Steps from Transformer Engine's `_order` notation: `c` is the forward of
/// chunk c (chunks from 1), `-c` its backward and `-c - 0.5` its delayed
/// weight-gradient.
pub fn from_te_order(order: &[f64]) -> Result<Vec<ScheduleStep>> {
    order
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let invalid = || {
                bad(format!(
                    "order[{i}] is {v}: Transformer Engine's order holds c (forward of chunk c, from 1), -c \
                     (its backward) or -c - 0.5 (its weight-grad)"
                ))
            };
            if !v.is_finite() || v == 0.0 || v.abs() > 4096.5 {
                return Err(invalid());
            }
            let (kind, chunk) = if v.fract() == 0.0 {
                let kind = if v > 0.0 { PassKind::Forward } else { PassKind::Backward };
                (kind, v.abs())
            } else if v < 0.0 && v.fract() == -0.5 && v <= -1.5 {
                (PassKind::Wgrad, -v - 0.5)
            } else {
                return Err(invalid());
            };
            Ok(ScheduleStep {
                kind,
                // 1 <= chunk <= 4096, integral.
                chunk: chunk as u32 - 1,
            })
        })
        .collect()
}
