//! One executable per pass for every bucket of a callable: after record,
//! the graphs of one pass (or clone slot) of one microbatch, one per
//! bucket, give up their executables for the largest bucket's where the
//! backend can load one into the other (`Graph::share_executable_of`);
//! those it cannot keep their own. Runs before rebinding plans are made.

use crate::backend::Graph;
use crate::error::Result;
use crate::orchestrate::instance::PassGraphs;

/// Shares executables between the buckets of each callable; returns how
/// many graphs gave theirs up. `by_callable[c]`: callable c's instances,
/// microbatch by microbatch, bucket by bucket (`buckets[c]` of them each).
pub(super) fn share(
    graphs: &mut [PassGraphs],
    by_callable: &[Vec<usize>],
    buckets: &[usize],
) -> Result<usize> {
    let mut shared = 0;
    for (per, &n) in by_callable.iter().zip(buckets) {
        if n < 2 {
            continue;
        }
        for group in per.chunks(n) {
            // The largest bucket's graphs lead: its instance is the last.
            let Some((&lead, rest)) = group.split_last() else {
                continue;
            };
            for &i in rest {
                let Some((leader, follower)) = pair_mut(graphs, lead, i) else {
                    continue;
                };
                for (l, f) in leader.passes.iter().zip(follower.passes.iter_mut()) {
                    if let (Some(l), Some(f)) = (l, f) {
                        shared += f.share_executable_of(l.as_ref())? as usize;
                    }
                }
                for (l, f) in leader.slots.iter().zip(follower.slots.iter_mut()) {
                    shared += f.graph.share_executable_of(l.graph.as_ref())? as usize;
                }
            }
        }
    }
    Ok(shared)
}

/// `v[a]` and `v[b]`; None when they are the same or either is missing.
fn pair_mut<T>(v: &mut [T], a: usize, b: usize) -> Option<(&T, &mut T)> {
    if a == b || a.max(b) >= v.len() {
        return None;
    }
    if a < b {
        let (lo, hi) = v.split_at_mut(b);
        Some((&lo[a], &mut hi[0]))
    } else {
        let (lo, hi) = v.split_at_mut(a);
        Some((&hi[0], &mut lo[b]))
    }
}

/// How many graphs of `graphs` launch an executable another graph made,
/// and how many loads of one graph into a shared executable their
/// launches made.
pub(crate) fn counts<'g>(graphs: impl Iterator<Item = &'g dyn Graph>) -> (usize, u64) {
    graphs.fold((0, 0), |(n, loads), g| {
        (
            n + g.shares_executable() as usize,
            loads + g.executable_loads(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{DevPtr, RebindPlan, StreamRef};
    use crate::core::PassKind;
    use crate::orchestrate::instance::SlotGraph;

    /// A graph named (instance, pass or slot) that records the leader it
    /// was offered and shares unless told not to.
    struct Named {
        name: (usize, usize),
        refuse: bool,
        offered: Option<(usize, usize)>,
    }

    impl Graph for Named {
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
        fn launch(&self, _: StreamRef) -> Result<()> {
            Ok(())
        }
        fn rebinder(&self, _: DevPtr, _: usize) -> Result<RebindPlan> {
            Ok(RebindPlan::Unreferenced)
        }
        fn share_executable_of(&mut self, leader: &dyn Graph) -> Result<bool> {
            let leader = leader.as_any().downcast_ref::<Named>().unwrap();
            self.offered = Some(leader.name);
            Ok(!self.refuse)
        }
        fn shares_executable(&self) -> bool {
            self.offered.is_some() && !self.refuse
        }
    }

    /// Instance i: a forward and a backward graph (passes 0, 1) and one
    /// clone slot (named pass 10).
    fn graphs(n: usize, refuse: usize) -> Vec<PassGraphs> {
        let g = |i, k| {
            Box::new(Named {
                name: (i, k),
                refuse: i == refuse,
                offered: None,
            }) as Box<dyn Graph>
        };
        (0..n)
            .map(|i| {
                let mut p = PassGraphs::default();
                p.passes[PassKind::Forward.index()] = Some(g(i, 0));
                p.passes[PassKind::Backward.index()] = Some(g(i, 1));
                p.slots.push(SlotGraph {
                    block: 0,
                    graph: g(i, 10),
                });
                p
            })
            .collect()
    }

    fn offered(g: &dyn Graph) -> Option<(usize, usize)> {
        g.as_any().downcast_ref::<Named>().unwrap().offered
    }

    #[test]
    fn each_microbatchs_buckets_follow_their_largest_bucket_pass_by_pass() {
        // Callable 0: 2 microbatches of 3 buckets (instances 0..6);
        // callable 1: no buckets (instance 6); instance 4 refuses.
        let mut all = graphs(7, 4);
        let by_callable = vec![vec![0, 1, 2, 3, 4, 5], vec![6]];
        let shared = share(&mut all, &by_callable, &[3, 1]).unwrap();
        // Instances 0, 1 follow 2; 3 follows 5, 4 refuses: 3 graphs each.
        assert_eq!(shared, 9);
        for (i, lead) in [(0, Some(2)), (1, Some(2)), (3, Some(5)), (4, Some(5))] {
            let p = &all[i];
            for (g, k) in p.passes.iter().flatten().zip([0, 1]) {
                assert_eq!(offered(g.as_ref()), lead.map(|l| (l, k)), "instance {i}");
            }
            assert_eq!(offered(p.slots[0].graph.as_ref()), lead.map(|l| (l, 10)));
        }
        for lead in [2, 5, 6] {
            assert!(
                all[lead].all().all(|g| offered(g).is_none()),
                "{lead} leads or is alone"
            );
        }
        assert_eq!(counts(all.iter().flat_map(|p| p.all())), (9, 0));
    }

    #[test]
    fn pair_mut_refuses_one_index_twice_and_out_of_range() {
        let mut v = [1, 2, 3];
        assert!(pair_mut(&mut v, 1, 1).is_none());
        assert!(pair_mut(&mut v, 0, 3).is_none());
        let (a, b) = pair_mut(&mut v, 2, 0).unwrap();
        *b += *a;
        assert_eq!(v, [4, 2, 3]);
    }
}
