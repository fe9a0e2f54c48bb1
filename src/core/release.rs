//! How long each buffer of a schedule's instances is needed, in pass
//! positions of the capture order, by Transformer Engine's reuse rules
//! (`_make_graphed_callables` with `_reuse_graph_input_output_buffers`):
//!
//! - a static input from its forward to its backward (its weight-grad pass
//!   when it has one);
//! - an output from its forward to its backward;
//! - a grad-output during its backward (and weight-grad pass);
//! - an input grad from its backward until the layer before it in the
//!   chunk has run its backward (which takes it); a chunk's first-layer
//!   input grad, which leaves the chunk, until the first layer of the next
//!   backward step has run (its receiver is done with it by then) and, from
//!   chunk 1 on, until the previous chunk's backward of the same microbatch
//!   has taken it; after the last backward step it is kept;
//! - parameter grads a replay copies out (every policy but ALIAS) only
//!   during the pass that writes them (the backward, or the weight-grad
//!   pass when the callable has one).
//!
//! The buffer planner (`plan::lifetimes`) and the releases a caller asks
//! for (`graphed_schedule_releases`) both read them here.

use super::layout::Role;
use super::schedule::Schedule;
use super::PassKind;

/// The passes (inclusive) during which a buffer is needed; `end` is None
/// when it is needed to the end of the session (it is never released).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub end: Option<usize>,
}

/// One buffer that may be released once pass `after` has run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Release {
    pub after: usize,
    pub callable: usize,
    pub microbatch: usize,
    pub role: Role,
}

/// The roles whose buffers a caller may hand to graphed (external outputs,
/// input grads and parameter grads), in the order releases list them.
const RELEASED: [Role; 3] = [Role::Output, Role::GradInput, Role::ParamGrads];

const ROLES: [Role; 5] = [
    Role::Input,
    Role::Output,
    Role::GradOutput,
    Role::GradInput,
    Role::ParamGrads,
];

fn slot(role: Role) -> usize {
    ROLES.iter().position(|&r| r == role).unwrap_or(0)
}

/// The spans of every buffer role of every instance (callable, microbatch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spans {
    microbatches: usize,
    spans: Vec<[Span; 5]>,
}

impl Spans {
    /// The spans under schedule `s` (its passes in capture order).
    pub fn of(s: &Schedule) -> Spans {
        let mb = s.microbatches.max(1);
        let n: usize = s.layers_per_chunk.iter().sum();
        let at = |callable: usize, microbatch: usize| callable * mb + microbatch;
        let (mut fwd, mut bwd, mut wgrad) = (vec![0; n * mb], vec![0; n * mb], vec![None; n * mb]);
        for (pos, p) in s.passes.iter().enumerate() {
            let i = at(p.callable, p.microbatch);
            match p.kind {
                PassKind::Forward => fwd[i] = pos,
                PassKind::Backward => bwd[i] = pos,
                PassKind::Wgrad => wgrad[i] = Some(pos),
            }
        }
        let first_layer = |callable: usize| s.prefix[s.chunk_of(callable)] == callable;
        // The next pass after each position that is the backward of a
        // chunk's first layer: the end of a backward step.
        let mut next_step_end = vec![None; s.passes.len() + 1];
        for pos in (0..s.passes.len()).rev() {
            let p = &s.passes[pos];
            next_step_end[pos] = if p.kind == PassKind::Backward && first_layer(p.callable) {
                Some(pos)
            } else {
                next_step_end[pos + 1]
            };
        }
        let mut spans = Vec::with_capacity(n * mb);
        for callable in 0..n {
            for m in 0..mb {
                let i = at(callable, m);
                let (f, b) = (fwd[i], bwd[i]);
                let done = wgrad[i].unwrap_or(b);
                let grad_input_end = if !first_layer(callable) {
                    // Taken by the layer before it in the same step.
                    Some(bwd[at(callable - 1, m)])
                } else {
                    let chunk = s.chunk_of(callable);
                    let sent = next_step_end[b + 1];
                    if chunk == 0 {
                        sent
                    } else {
                        // Also taken by the previous chunk's last layer.
                        let taken = bwd[at(s.prefix[chunk] - 1, m)];
                        sent.map(|e| e.max(taken))
                    }
                };
                let span = |start, end| Span { start, end };
                spans.push([
                    span(f, Some(done)),
                    span(f, Some(b)),
                    span(b, Some(done)),
                    span(b, grad_input_end),
                    span(done, Some(done)),
                ]);
            }
        }
        Spans {
            microbatches: mb,
            spans,
        }
    }

    /// The span of `role`'s buffers of (callable, microbatch). For
    /// `Role::ParamGrads`, of the grads a replay copies out.
    pub fn get(&self, callable: usize, microbatch: usize, role: Role) -> Span {
        self.spans[callable * self.microbatches + microbatch][slot(role)]
    }

    /// The buffers of the released roles (`RELEASED`) that may be let go,
    /// each after the pass that ends its span, ordered by that pass, then
    /// callable, microbatch and role. Buffers needed to the end of the
    /// session are not listed.
    pub fn releases(&self) -> Vec<Release> {
        let mut out: Vec<Release> = self
            .spans
            .iter()
            .enumerate()
            .flat_map(|(i, roles)| {
                let (callable, microbatch) = (i / self.microbatches, i % self.microbatches);
                RELEASED.iter().filter_map(move |&role| {
                    roles[slot(role)].end.map(|after| Release {
                        after,
                        callable,
                        microbatch,
                        role,
                    })
                })
            })
            .collect();
        out.sort_by_key(|r| (r.after, r.callable, r.microbatch, slot(r.role)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::schedule::tests::{te, TE_ORDER};
    use crate::core::schedule::ScheduleStep;

    fn span(start: usize, end: Option<usize>) -> Span {
        Span { start, end }
    }

    #[test]
    fn te_scenario() {
        let s = Schedule::derive(&te(&TE_ORDER), None, &[false, false]).unwrap();
        // Pass positions: F00 F10 F01 F11 B10 B00 F02 F12 B11 B01 B12 B02
        //                  0   1   2   3   4   5   6   7   8   9  10  11
        let sp = Spans::of(&s);
        assert_eq!(sp.get(0, 0, Role::Input), span(0, Some(5)));
        assert_eq!(sp.get(1, 2, Role::Output), span(7, Some(10)));
        assert_eq!(sp.get(1, 0, Role::GradOutput), span(4, Some(4)));
        assert_eq!(sp.get(1, 1, Role::ParamGrads), span(8, Some(8)));
        // Chunk 1's input grad: until chunk 0's backward of microbatch 0 took it.
        assert_eq!(sp.get(1, 0, Role::GradInput), span(4, Some(5)));
        // Chunk 0's: until the next backward step (B11) has run.
        assert_eq!(sp.get(0, 0, Role::GradInput), span(5, Some(8)));
        // The last step's is kept.
        assert_eq!(sp.get(0, 2, Role::GradInput), span(11, None));
        let r = sp.releases();
        assert!(r.windows(2).all(|w| w[0].after <= w[1].after));
        let after = |pos: usize| -> Vec<(usize, usize, Role)> {
            r.iter()
                .filter(|x| x.after == pos)
                .map(|x| (x.callable, x.microbatch, x.role))
                .collect()
        };
        assert!(
            after(0).is_empty() && after(3).is_empty(),
            "forwards release nothing"
        );
        assert_eq!(
            after(4),
            vec![(1, 0, Role::Output), (1, 0, Role::ParamGrads)]
        );
        assert_eq!(
            after(5),
            vec![
                (0, 0, Role::Output),
                (0, 0, Role::ParamGrads),
                (1, 0, Role::GradInput)
            ]
        );
        assert!(after(8).contains(&(0, 0, Role::GradInput)));
        assert!(!r
            .iter()
            .any(|x| (x.callable, x.microbatch, x.role) == (0, 2, Role::GradInput)));
        // Every instance's output and parameter grads are released once.
        assert_eq!(r.len(), 6 + 6 + 5);
    }

    #[test]
    fn a_first_layer_input_grad_lives_through_the_next_whole_backward_step() {
        // Two chunks of two layers: callables 0 1 | 2 3.
        let s = Schedule::derive(
            &te(&[1.0, 2.0, 1.0, 2.0, -2.0, -1.0, -2.0, -1.0]),
            None,
            &[false; 4],
        )
        .unwrap();
        // F00 F10 F20 F30 F01 F11 F21 F31 B30 B20 B10 B00 B31 B21 B11 B01
        //  0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15
        let sp = Spans::of(&s);
        // Inside a step: taken by the layer before it.
        assert_eq!(sp.get(3, 0, Role::GradInput), span(8, Some(9)));
        assert_eq!(sp.get(1, 0, Role::GradInput), span(10, Some(11)));
        // Chunk 1's first layer (2): taken by chunk 0's last layer at 10,
        // and kept until the next step (chunk 0's) ended at 11.
        assert_eq!(sp.get(2, 0, Role::GradInput), span(9, Some(11)));
        // Chunk 0's first layer: until the next step ended (B21 at 13), not
        // only its first pass (B31 at 12).
        assert_eq!(sp.get(0, 0, Role::GradInput), span(11, Some(13)));
        assert_eq!(sp.get(0, 1, Role::GradInput), span(15, None));
    }

    #[test]
    fn weight_grad_passes_hold_inputs_and_write_the_parameter_grads() {
        let steps = [
            ScheduleStep {
                kind: PassKind::Forward,
                chunk: 0,
            },
            ScheduleStep {
                kind: PassKind::Backward,
                chunk: 0,
            },
            ScheduleStep {
                kind: PassKind::Wgrad,
                chunk: 0,
            },
        ];
        let s = Schedule::derive(&steps, None, &[true]).unwrap();
        let sp = Spans::of(&s);
        assert_eq!(sp.get(0, 0, Role::Output), span(0, Some(1)));
        assert_eq!(sp.get(0, 0, Role::Input), span(0, Some(2)));
        assert_eq!(sp.get(0, 0, Role::GradOutput), span(1, Some(2)));
        assert_eq!(sp.get(0, 0, Role::ParamGrads), span(2, Some(2)));
        let r: Vec<(usize, Role)> = sp.releases().iter().map(|x| (x.after, x.role)).collect();
        assert_eq!(r, vec![(1, Role::Output), (2, Role::ParamGrads)]);
    }

    #[test]
    fn without_a_schedule_each_input_grad_is_taken_by_the_callable_before_it() {
        let s = Schedule::sequential(&[false, false, false]);
        // F0 F1 F2 B2 B1 B0
        let sp = Spans::of(&s);
        assert_eq!(sp.get(2, 0, Role::GradInput), span(3, Some(4)));
        assert_eq!(sp.get(1, 0, Role::GradInput), span(4, Some(5)));
        assert_eq!(sp.get(0, 0, Role::GradInput), span(5, None));
    }
}
