//! Pipeline schedules: the Megatron-style interleaved order of steps
//! (forward, backward or weight-grad of a model chunk), validated with
//! Transformer Engine's rules (`_make_graphed_callables`), and the passes
//! (callable, microbatch, kind) it expands to, in capture order. In steps
//! of their own: reading and checking the steps (`steps`), dividing the
//! callables into chunks (`chunks`); here, the expansion into passes.
//!
//! Chunks are numbered from 0 here (TE's `_order` numbers them from 1). The
//! k-th forward step of chunk c runs microbatch k through the chunk's
//! layers in order; the k-th backward step runs them in reverse; the k-th
//! weight-grad step runs the delayed weight-gradient of microbatch k.

mod chunks;
mod steps;

pub use chunks::{chunk_layers, wgrad_as_scheduled};
pub use steps::{check_steps, from_te_order, ScheduleStep, Shape, MAX_PASSES};

use super::PassKind;
use crate::error::{Error, Result};
use chunks::scheduled_wgrad;
use steps::bad;

/// One captured pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pass {
    pub callable: usize,
    pub microbatch: usize,
    pub kind: PassKind,
}

/// A validated schedule and its passes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub chunks: usize,
    pub microbatches: usize,
    pub layers_per_chunk: Vec<usize>,
    /// First callable of each chunk.
    pub prefix: Vec<usize>,
    /// Every pass, in warmup and capture order.
    pub passes: Vec<Pass>,
}

impl Schedule {
    /// The chunk a callable belongs to.
    pub fn chunk_of(&self, callable: usize) -> usize {
        self.prefix
            .iter()
            .rposition(|&p| p <= callable)
            .unwrap_or(0)
    }

    /// The default order without a schedule: one microbatch, forwards in
    /// registration order, backwards in reverse, each weight-grad right
    /// after its backward.
    pub fn sequential(has_wgrad: &[bool]) -> Schedule {
        let n = has_wgrad.len();
        let mut passes: Vec<Pass> = (0..n)
            .map(|c| Pass {
                callable: c,
                microbatch: 0,
                kind: PassKind::Forward,
            })
            .collect();
        for c in (0..n).rev() {
            passes.push(Pass {
                callable: c,
                microbatch: 0,
                kind: PassKind::Backward,
            });
            if has_wgrad[c] {
                passes.push(Pass {
                    callable: c,
                    microbatch: 0,
                    kind: PassKind::Wgrad,
                });
            }
        }
        Schedule {
            chunks: 1,
            microbatches: 1,
            layers_per_chunk: vec![n],
            prefix: vec![0],
            passes,
        }
    }

    /// The order of `n` callables: `steps` (with their layers per chunk)
    /// expanded, or without steps the order without a schedule.
    /// `has_wgrad` says which callables have a weight-grad pass; None: as
    /// the schedule says (none without steps).
    pub fn resolve(
        steps: Option<(&[ScheduleStep], Option<&[u32]>)>,
        has_wgrad: Option<&[bool]>,
        n: usize,
    ) -> Result<Schedule> {
        match (steps, has_wgrad) {
            (None, w) => Ok(Schedule::sequential(
                &w.map_or_else(|| vec![false; n], <[bool]>::to_vec),
            )),
            (Some((s, lpc)), Some(w)) => Schedule::derive(s, lpc, w),
            (Some((s, lpc)), None) => Schedule::derive(s, lpc, &wgrad_as_scheduled(s, lpc, n)?),
        }
    }

    /// Validates `steps` against the registered callables and expands them.
    /// `layers_per_chunk` is derived (callables split evenly) when absent.
    pub fn derive(
        steps: &[ScheduleStep],
        layers_per_chunk: Option<&[u32]>,
        has_wgrad: &[bool],
    ) -> Result<Schedule> {
        let shape = Shape::check(steps)?;
        let (chunks, mb) = (shape.chunks, shape.microbatches);
        let n = has_wgrad.len();
        let (layers, prefix) = chunk_layers(&shape, layers_per_chunk, n)?;
        let scheduled = scheduled_wgrad(&shape, &layers, &prefix);
        for c in 0..chunks {
            let members = prefix[c]..prefix[c] + layers[c];
            let with_wgrad = members.clone().filter(|&i| has_wgrad[i]).count();
            if scheduled[prefix[c]] {
                if layers[c] != 1 {
                    return Err(bad(format!(
                        "chunk {c} has weight-grad steps and {} layers; weight-grad steps need one layer per chunk",
                        layers[c]
                    )));
                }
                if let Some(i) = members.clone().find(|&i| !has_wgrad[i]) {
                    return Err(bad(format!(
                        "chunk {c} has weight-grad steps, but callable {i} has no weight-grad callback \
                         (weight-grad steps are only for delayed weight-gradient callables)"
                    )));
                }
            } else if with_wgrad > 0 {
                let i = members.clone().find(|&i| has_wgrad[i]).unwrap_or(prefix[c]);
                return Err(bad(format!(
                    "callable {i} has a weight-grad callback, but chunk {c} has no weight-grad steps to capture it"
                )));
            }
        }

        // Bounded before anything is built: the numbers may be a caller's.
        let total = steps
            .iter()
            .try_fold(0usize, |a, s| a.checked_add(layers[s.chunk as usize]))
            .filter(|&t| t <= MAX_PASSES)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "the schedule expands to more than {MAX_PASSES} passes over {n} callables"
                ))
            })?;
        let mut passes = Vec::with_capacity(total);
        let mut seen = [
            vec![0usize; chunks],
            vec![0usize; chunks],
            vec![0usize; chunks],
        ];
        for step in steps {
            let kind = step.kind;
            let c = step.chunk as usize;
            let k = &mut seen[kind.index()][c];
            let m = *k;
            *k += 1;
            let ls: Vec<usize> = match kind {
                PassKind::Forward => (0..layers[c]).collect(),
                _ => (0..layers[c]).rev().collect(),
            };
            passes.extend(ls.into_iter().map(|l| Pass {
                callable: prefix[c] + l,
                microbatch: m,
                kind,
            }));
        }
        Ok(Schedule {
            chunks,
            microbatches: mb,
            layers_per_chunk: layers,
            prefix,
            passes,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use PassKind::*;

    fn p(callable: usize, microbatch: usize, kind: PassKind) -> Pass {
        Pass {
            callable,
            microbatch,
            kind,
        }
    }

    fn w(chunk: u32) -> ScheduleStep {
        ScheduleStep { kind: Wgrad, chunk }
    }

    pub(crate) const TE_ORDER: [f64; 12] = [
        1.0, 2.0, 1.0, 2.0, -2.0, -1.0, 1.0, 2.0, -2.0, -1.0, -2.0, -1.0,
    ];

    /// Steps from a Transformer Engine order that is valid notation.
    pub(crate) fn te(order: &[f64]) -> Vec<ScheduleStep> {
        from_te_order(order).unwrap()
    }

    #[test]
    fn te_scenario_two_chunks_three_microbatches() {
        let s = Schedule::derive(&te(&TE_ORDER), None, &[false, false]).unwrap();
        assert_eq!((s.chunks, s.microbatches), (2, 3));
        assert_eq!(s.layers_per_chunk, vec![1, 1]);
        assert_eq!(
            s.passes,
            vec![
                p(0, 0, Forward),
                p(1, 0, Forward),
                p(0, 1, Forward),
                p(1, 1, Forward),
                p(1, 0, Backward),
                p(0, 0, Backward),
                p(0, 2, Forward),
                p(1, 2, Forward),
                p(1, 1, Backward),
                p(0, 1, Backward),
                p(1, 2, Backward),
                p(0, 2, Backward),
            ]
        );
        assert_eq!(s.chunk_of(1), 1);
    }

    #[test]
    fn layers_expand_forward_in_order_and_backward_in_reverse() {
        let steps = te(&[1.0, 2.0, 3.0, -3.0, -2.0, -1.0]);
        let s = Schedule::derive(&steps, Some(&[1, 2, 1]), &[false; 4]).unwrap();
        assert_eq!(s.prefix, vec![0, 1, 3]);
        let kinds: Vec<(usize, PassKind)> = s.passes.iter().map(|p| (p.callable, p.kind)).collect();
        assert_eq!(
            kinds,
            vec![
                (0, Forward),
                (1, Forward),
                (2, Forward),
                (3, Forward),
                (3, Backward),
                (2, Backward),
                (1, Backward),
                (0, Backward)
            ]
        );
        assert_eq!((s.chunk_of(0), s.chunk_of(2), s.chunk_of(3)), (0, 1, 2));
        // Derived: 6 callables over 3 chunks is 2 layers each.
        let s = Schedule::derive(&steps, None, &[false; 6]).unwrap();
        assert_eq!(s.layers_per_chunk, vec![2, 2, 2]);
        assert_eq!(s.passes.len(), 12);
    }

    #[test]
    fn weight_grad_steps_expand_after_their_backward() {
        let mut steps = te(&[1.0, 2.0, -2.0]);
        steps.push(w(1));
        steps.extend(te(&[-1.0]));
        steps.push(w(0));
        let s = Schedule::derive(&steps, None, &[true, true]).unwrap();
        assert_eq!(
            s.passes,
            vec![
                p(0, 0, Forward),
                p(1, 0, Forward),
                p(1, 0, Backward),
                p(1, 0, Wgrad),
                p(0, 0, Backward),
                p(0, 0, Wgrad)
            ]
        );
    }

    #[test]
    fn weight_grad_callables_as_the_schedule_says() {
        let mut steps = te(&[1.0, 2.0, -2.0]);
        steps.push(w(1));
        steps.extend(te(&[-1.0]));
        assert_eq!(
            wgrad_as_scheduled(&steps, None, 2).unwrap(),
            vec![false, true]
        );
        assert_eq!(
            Schedule::resolve(Some((&steps, None)), None, 2).unwrap(),
            Schedule::derive(&steps, None, &[false, true]).unwrap()
        );
        assert_eq!(
            Schedule::resolve(None, None, 2).unwrap(),
            Schedule::sequential(&[false, false])
        );
        assert_eq!(
            wgrad_as_scheduled(&te(&[1.0, 2.0, -2.0, -1.0]), Some(&[2, 1]), 3).unwrap(),
            vec![false; 3]
        );
        // The steps and the split are checked as by derive.
        assert!(wgrad_as_scheduled(&[], None, 1).is_err());
        assert!(wgrad_as_scheduled(&steps, None, 3).is_err());
    }

    #[test]
    fn sequential_order() {
        let s = Schedule::sequential(&[false, true, false]);
        let k: Vec<(usize, PassKind)> = s.passes.iter().map(|p| (p.callable, p.kind)).collect();
        assert_eq!(
            k,
            vec![
                (0, Forward),
                (1, Forward),
                (2, Forward),
                (2, Backward),
                (1, Backward),
                (1, Wgrad),
                (0, Backward)
            ]
        );
    }

    fn rejects(steps: &[ScheduleStep], layers: Option<&[u32]>, wgrad: &[bool], needle: &str) {
        match Schedule::derive(steps, layers, wgrad) {
            Err(Error::InvalidSchedule(m)) => assert!(m.contains(needle), "'{needle}' not in: {m}"),
            other => {
                panic!("expected an InvalidSchedule error containing '{needle}', got {other:?}")
            }
        }
    }

    #[test]
    fn every_rule_has_its_own_message() {
        let te_steps = te(&TE_ORDER);
        rejects(&[], None, &[false], "no steps");
        rejects(
            &te_steps[..11],
            None,
            &[false, false],
            "chunks x microbatches x 2",
        );
        rejects(
            &te(&[1.0, 1.0, -2.0, -2.0]),
            None,
            &[false, false],
            "chunk 0 has 2 forward and 0 backward",
        );
        rejects(
            &te(&[-1.0, 1.0]),
            None,
            &[false],
            "comes before its forward",
        );
        rejects(
            &te(&[2.0, 1.0, -2.0, -1.0]),
            None,
            &[false, false],
            "whose output it takes",
        );
        rejects(
            &te(&[1.0, 2.0, -1.0, -2.0]),
            None,
            &[false, false],
            "whose input grad it takes",
        );
        rejects(
            &te_steps,
            Some(&[1]),
            &[false, false],
            "layers_per_chunk has 1 entries",
        );
        rejects(
            &te_steps,
            Some(&[1, 0]),
            &[false, false],
            "layers_per_chunk[1] is 0",
        );
        rejects(
            &te_steps,
            Some(&[1, 2]),
            &[false, false],
            "hold 3 layers in all",
        );
        rejects(
            &te_steps,
            None,
            &[false, false, false],
            "cannot be split evenly",
        );
        let mut two_w = te(&[1.0, -1.0]);
        two_w.extend([w(0), w(0)]);
        rejects(&two_w, None, &[true], "2 weight-grad steps and 1 backward");
        let mut early_w = vec![te(&[1.0])[0], w(0)];
        early_w.extend(te(&[-1.0]));
        rejects(
            &early_w,
            None,
            &[true],
            "weight-grad of chunk 0 for microbatch 0 comes before its backward",
        );
        let mut ok_w = te(&[1.0, -1.0]);
        ok_w.push(w(0));
        rejects(&ok_w, None, &[false], "no weight-grad callback");
        rejects(&ok_w, None, &[true, true], "one layer per chunk");
        rejects(
            &te(&[1.0, -1.0]),
            None,
            &[true],
            "no weight-grad steps to capture it",
        );
    }

    #[test]
    fn te_order_with_weight_grad_steps() {
        let steps = te(&[1.0, 2.0, -2.0, -2.5, -1.0, -1.5]);
        assert_eq!(
            steps,
            vec![
                ScheduleStep {
                    kind: Forward,
                    chunk: 0
                },
                ScheduleStep {
                    kind: Forward,
                    chunk: 1
                },
                ScheduleStep {
                    kind: Backward,
                    chunk: 1
                },
                w(1),
                ScheduleStep {
                    kind: Backward,
                    chunk: 0
                },
                w(0),
            ]
        );
        let s = Schedule::derive(&steps, None, &[true, true]).unwrap();
        assert_eq!(s.passes.len(), 6);
        for bad in [0.0, 0.5, -0.5, 1.5, -1.25, f64::NAN, f64::INFINITY, 5000.0] {
            let e = from_te_order(&[bad]).unwrap_err();
            assert!(matches!(e, Error::InvalidSchedule(_)), "{bad}: {e}");
            assert!(e.to_string().contains("order[0]"), "{e}");
        }
    }

    #[test]
    fn shape_and_chunk_layers() {
        let shape = Shape::check(&te(&TE_ORDER)).unwrap();
        assert_eq!((shape.chunks, shape.microbatches), (2, 3));
        assert_eq!(
            chunk_layers(&shape, None, 4).unwrap(),
            (vec![2, 2], vec![0, 2])
        );
        assert_eq!(
            chunk_layers(&shape, Some(&[1, 3]), 4).unwrap(),
            (vec![1, 3], vec![0, 1])
        );
        assert!(chunk_layers(&shape, None, 3).is_err());
    }

    #[test]
    fn a_long_schedule_over_many_chunks_is_checked_in_linear_time() {
        // 4096 chunks x 64 microbatches: half a million steps. Counting them
        // per chunk once took minutes; one pass takes milliseconds.
        let (chunks, mb) = (4096u32, 64);
        let mut steps = Vec::new();
        for _ in 0..mb {
            steps.extend((0..chunks).map(|c| ScheduleStep {
                kind: PassKind::Forward,
                chunk: c,
            }));
        }
        for _ in 0..mb {
            steps.extend((0..chunks).rev().map(|c| ScheduleStep {
                kind: PassKind::Backward,
                chunk: c,
            }));
        }
        let t = std::time::Instant::now();
        let shape = Shape::check(&steps).unwrap();
        assert_eq!((shape.chunks, shape.microbatches), (4096, 64));
        assert!(t.elapsed().as_secs() < 5, "{:?}", t.elapsed());
    }
}
