//! Steps over microbatches, with io copies or looping on the device
//! ("looped"): what capture says of each declared step in turn, whether a
//! replay finds a clone slot free, and what a successful replay leaves in
//! caller memory (the copies out, up to its count).

use super::*;


/// A capture's refusal of a step: the statuses it may answer (the first
/// with `texts` in its message).
pub struct StepRefusal {
    pub statuses: Vec<graphed_status>,
    pub texts: Vec<String>,
}

fn refusal(st: graphed_status, texts: Vec<String>) -> Option<StepRefusal> {
    Some(StepRefusal {
        statuses: vec![st],
        texts,
    })
}

/// What capturing the declared steps of session `k` must fail with, step
/// by step as capture records them (after every pass; a callback's
/// failure before comes first), with texts of its message (None: every
/// step captures). Some are found before the step's callbacks run, the
/// grads no sum can hold while its microbatches are recorded.
pub fn step_capture_error(k: usize) -> Option<StepRefusal> {
    let s = &w().sessions.borrow()[k];
    for (si, st) in s.steps.iter().enumerate() {
        let slots = step_slots(s, st);
        let n = st.microbatches;
        let mut at = 0;
        for &c in &st.callables {
            for (j, p) in s.callables[c].params.iter().enumerate() {
                let pol = p.resolved(s.clone);
                if (pol == 3 || pol == 4) && st.dsts[at + j] == 0 {
                    return refusal(S::InvalidArgument, vec![format!("step {si}: param_dsts[")]);
                }
            }
            at += s.callables[c].params.len();
        }
        if n > 1 {
            for &c in &st.callables {
                let pols: Vec<u32> = s.callables[c]
                    .params
                    .iter()
                    .map(|p| p.resolved(s.clone))
                    .collect();
                let why = if let Some(j) = pols.iter().position(|&p| p == 2) {
                    format!("but param {j} of callable '")
                } else if pols.contains(&1) && slots == 0 {
                    "returns CLONE grads".into()
                } else {
                    continue;
                };
                return refusal(
                    S::Incompatible,
                    vec![format!("step {si} runs {n} microbatches"), why],
                );
            }
        }
        // From the second microbatch on, each CLONE and COPY_INTO grad is
        // added to its sum, which only f32, f16 and bf16 can be: refused
        // before anything is recorded.
        let unsummable = n > 1
            && st.callables.iter().any(|&c| {
                s.callables[c]
                    .params
                    .iter()
                    .any(|p| matches!(p.resolved(s.clone), 1 | 3) && !matches!(p.dtype, 0..=2))
            });
        if unsummable {
            return refusal(S::Incompatible, vec!["which graphed does not sum".into()]);
        }
        for (q, e) in st.io.iter().enumerate() {
            let cl = &s.callables[e.callable as usize];
            let absent = match e.role {
                2 => !cl.outputs[e.index as usize].grad,
                3 => !cl.inputs[e.index as usize].grad,
                _ => false,
            };
            if absent {
                return refusal(
                    S::InvalidArgument,
                    vec![
                        format!("step {si}: io[{q}] ("),
                        "there is no such buffer".into(),
                    ],
                );
            }
        }
        let cloned = st.callables.iter().any(|&c| clones(s, c));
        if st.looped() && cloned && slots == 0 {
            return refusal(
                S::Incompatible,
                vec![format!(
                    "step {si} copies data in or out and returns CLONE grads"
                )],
            );
        }
        // The hook runs around each capture of the step's graph: failing
        // before the first, nothing of it is recorded.
        let hook = |when: &str| {
            refusal(
                S::CallbackFailed,
                vec![format!(
                    "the capture hook {when} the capture of step {si} returned 11"
                )],
            )
        };
        let captured = graphs_of(s, st) > 0;
        if captured && st.hook == 2 {
            return hook("before");
        }
        // A loop on the device sums every microbatch's CLONE and COPY_INTO
        // grads from -0.0, even for one microbatch: only the dtypes graphed
        // adds, refused before its body is recorded.
        if st.device_loop {
            for &c in &st.callables {
                let ps = &s.callables[c].params;
                let bad = ps.iter().position(|p| {
                    matches!(p.resolved(s.clone), 1 | 3) && sum_width(p.dtype).is_none()
                });
                if let Some(j) = bad {
                    return refusal(
                        S::Incompatible,
                        vec![
                            format!("param {j} of callable '"),
                            "which graphed does not sum".into(),
                        ],
                    );
                }
            }
        }
        // Failing after a capture that succeeded (a failed one's error
        // stands).
        if captured && st.hook == 3 {
            return hook("after");
        }
    }
    None
}

/// Whether a replay of looped step `st` of session `k` finds a clone slot
/// free in every callable that returns clones: Some(true) when it must
/// (fewer blocks of theirs are held than there are slots, or none returns
/// clones), Some(false) when it cannot (one callable holds as many slot
/// blocks, known from earlier looped replays, as there are slots), None
/// when the model cannot tell (held blocks of per-callable replays may or
/// may not be slot blocks).
pub fn slot_free(k: usize, st: &StepModel) -> Option<bool> {
    let wd = w();
    let s = &wd.sessions.borrow()[k];
    if !st.looped() {
        return Some(true);
    }
    let cloned: Vec<usize> = st
        .callables
        .iter()
        .copied()
        .filter(|&c| clones(s, c))
        .collect();
    if cloned.is_empty() {
        return Some(true);
    }
    let slots = step_slots(s, st) as usize;
    let blocks = wd.blocks.borrow();
    let of = |c: usize, known: bool| {
        blocks
            .iter()
            .filter(|b| b.sess == k && b.inst == (c, 0) && (b.slot || !known))
            .count()
    };
    if cloned.iter().map(|&c| of(c, false)).sum::<usize>() < slots {
        return Some(true);
    }
    if cloned.iter().any(|&c| of(c, true) >= slots) {
        return Some(false);
    }
    None
}

/// The blocks of step `st`'s copies out (of session `k`) that a replay of
/// `count` microbatches leaves alone (those from `count` on), as they are.
pub fn copies_out_kept(k: usize, st: &StepModel, count: u32) -> Vec<Vec<u8>> {
    let s = &w().sessions.borrow()[k];
    st.io
        .iter()
        .map(
            |e| match io_bytes(&s.callables[e.callable as usize], e.role, e.index) {
                Some(b) if matches!(e.role, 1 | 3) => (count..st.microbatches)
                    .flat_map(|m| {
                        let p = e.ptr + m as usize * e.stride;
                        // SAFETY: harness memory holding every block.
                        unsafe { std::slice::from_raw_parts(p as *const u8, b) }.to_vec()
                    })
                    .collect(),
                _ => Vec::new(),
            },
        )
        .collect()
}

/// After a successful replay of step `st` of session `k` (writing with
/// `epoch`) over `count` microbatches: every block of every copy out up to
/// `count` holds what its pass wrote, the later ones what they held
/// (`kept`, from `copies_out_kept`).
pub fn check_copies_out(k: usize, st: &StepModel, epoch: u8, count: u32, kept: &[Vec<u8>]) {
    let s = &w().sessions.borrow()[k];
    for (q, e) in st.io.iter().enumerate() {
        let (role, t) = match e.role {
            1 => (
                ROLE_OUT,
                &s.callables[e.callable as usize].outputs[e.index as usize],
            ),
            3 => (
                ROLE_GIN,
                &s.callables[e.callable as usize].inputs[e.index as usize],
            ),
            _ => continue,
        };
        let b = seed(k, e.callable as usize, 0, role, e.index as usize) ^ epoch;
        for m in 0..st.microbatches as usize {
            let p = e.ptr + m * e.stride;
            let ok = if m < count as usize {
                all_bytes(p, t.bytes, b)
            } else {
                let at = (m - count as usize) * t.bytes;
                // SAFETY: as copies_out_kept.
                let now = unsafe { std::slice::from_raw_parts(p as *const u8, t.bytes) };
                now == &kept[q][at..at + t.bytes]
            };
            assert!(
                ok,
                "step io[{q}] (role {} {} of callable {}): microbatch {m}'s copy out {} (the replay ran {count})",
                e.role,
                e.index,
                e.callable,
                if m < count as usize {
                    "does not hold what the pass wrote"
                } else {
                    "changed"
                }
            );
        }
    }
}
