//! Steps over microbatches or with io copies ("looped"): what capture says
//! of each declared step in turn, whether a replay finds a clone slot free,
//! and what a successful replay leaves in caller memory (the copies out)
//! and in its grads (sums over the microbatches).

use super::*;

/// The clone slots a session's steps get (none with a caller allocator).
fn slots_of(s: &Sess) -> u32 {
    if s.custom_alloc {
        0
    } else {
        s.clone_slots
    }
}

/// Whether callable `c` of `s` returns CLONE grads.
fn clones(s: &Sess, c: usize) -> bool {
    s.callables[c]
        .params
        .iter()
        .any(|p| p.resolved(s.clone) == 1)
}

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
    let slots = slots_of(s);
    for (si, st) in s.steps.iter().enumerate() {
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
    let slots = slots_of(s) as usize;
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

/// `w` added to itself `n` times in f32, in order (the sum of `n`
/// microbatches' equal grads).
pub fn f32_times(w: u32, n: u32) -> u32 {
    (1..n).fold(w, |acc, _| f32_add(acc, w))
}

/// An ACCUMULATE_INTO destination after `n` microbatches each added the
/// grad `b` (every byte of it) in f32.
pub fn check_accumulated_n(before: &[u8], dst: usize, b: u8, n: u32, what: &str) {
    // SAFETY: harness memory of before.len() bytes.
    let got = unsafe { std::slice::from_raw_parts(dst as *const u8, before.len()) };
    let g = u32::from_ne_bytes([b; 4]);
    for e in 0..before.len() / 4 {
        let was = u32::from_ne_bytes(before[e * 4..e * 4 + 4].try_into().unwrap());
        let want = (0..n).fold(was, |acc, _| f32_add(acc, g));
        let x = u32::from_ne_bytes(got[e * 4..e * 4 + 4].try_into().unwrap());
        assert!(
            x == want || (f32::from_bits(x).is_nan() && f32::from_bits(want).is_nan()),
            "{what}: ACCUMULATE_INTO over {n} microbatches, element {e}: 0x{x:08x}, expected 0x{want:08x}"
        );
    }
}

/// After a successful replay of step `st` of session `k` (writing with
/// `epoch`): every block of every copy out holds what its pass wrote.
pub fn check_copies_out(k: usize, st: &StepModel, epoch: u8) {
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
            assert!(
                all_bytes(e.ptr + m * e.stride, t.bytes, b),
                "step io[{q}] (role {} {} of callable {}): microbatch {m}'s copy out does not hold what the pass wrote",
                e.role,
                e.index,
                e.callable
            );
        }
    }
}
