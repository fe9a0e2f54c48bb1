//! Parameters that move, in a world of their own: a host session whose
//! callables record no work, so that a parameter registered with
//! GRAPHED_PARAM_FLAGS_REBIND can move there (no graph reads it), in the
//! callables' graphs and in the step's (unless two callables share it:
//! tied, the step's graph cannot follow it and replays pass by pass). The
//! rest of the target never sees a parameter move (its callables' host
//! tasks are opaque).
//!
//! The op builds the session from the input (one or two callables, one or
//! two parameters each, the grad policy, a weight-grad pass or not, clone
//! slots, a step over one or two microbatches), then runs a fuzzed
//! sequence of forwards, backwards, weight-grad replays and step replays
//! given the parameters' addresses (a NULL array, NULL entries, where they
//! are read, fresh memory aligned as registered or less), holding or
//! releasing the CLONE grads. A model follows where each instance's graphs
//! and the step's graphs read the parameters, where the step's last
//! successful replay had them (what a replay given no address uses), the
//! clone slots and the moves; every call's status is checked against it,
//! and after every call `param_moves`, the clone blocks outstanding and
//! where each callable's graphs read its parameters
//! (graphed_session_param_addresses) must be the model's. So a refused
//! call changes nothing: it counts no move, and the next replay given no
//! address runs where the last successful one had the parameters.

use super::*;

const FLOATS: usize = 8;
const PBYTES: usize = FLOATS * 4;
const MOVE_OPS: usize = 12;

/// Memory for a parameter, aligned to 256 bytes, plus `off`.
fn aligned(off: usize) -> usize {
    (mem(PBYTES + 512, 0) + 255) / 256 * 256 + off
}

/// A ref for a replay to fill (also the update op's).
pub(crate) fn empty_ref() -> graphed_ref {
    graphed_ref {
        ptr: null_mut(),
        bytes: 0,
        kind: 0,
        owner: null_mut(),
        lease: 0,
        rows: 0,
        row_bytes: 0,
        pitch: 0,
    }
}

unsafe extern "C" fn idle(_: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    0
}

/// The largest power of two dividing `p`, up to 256 (as the library
/// compares alignments).
fn alignment(p: usize) -> usize {
    if p == 0 {
        256
    } else {
        (1usize << p.trailing_zeros()).min(256)
    }
}

/// A held clone block: its owner and how many references it holds; whether
/// it is a clone slot's block.
struct Held {
    owner: *mut graphed_buffer,
    refs: usize,
    slot: bool,
}

/// What the model knows of the session.
struct Movers {
    h: *mut graphed_session,
    /// Per callable: its parameters' registered addresses.
    reg: Vec<Vec<usize>>,
    /// Per callable: where its graphs read each parameter now.
    inst: Vec<Vec<usize>>,
    /// Per parameter of the step (the callables' in order): where the
    /// step's graphs read it, where its last replay had it, and whether the
    /// step's graphs cannot follow it (tied to another callable's).
    sg: Vec<usize>,
    at: Vec<usize>,
    tied: Vec<bool>,
    /// Callable 0 returns CLONE grads (the only one that may).
    clone: bool,
    wgrad: bool,
    /// Per callable: where its COPY_INTO / ACCUMULATE_INTO grads go.
    dsts: Vec<Vec<usize>>,
    looped: bool,
    /// Clone slots of callable 0 not held.
    free_slots: u32,
    held: Vec<Held>,
    moves: u64,
}

impl Movers {
    fn step_params(&self) -> Vec<(usize, usize)> {
        (0..self.reg.len())
            .flat_map(|c| (0..self.reg[c].len()).map(move |j| (c, j)))
            .collect()
    }

    /// Checks the stats against the model.
    fn check(&self, after: &str) {
        let mut st = graphed_session_stats_default();
        // SAFETY: a full struct.
        let r = unsafe { graphed_session_stats_get(self.h, &mut st) };
        expect(
            r,
            &[S::Ok],
            "graphed_session_stats_get",
            "moving parameters",
        );
        assert_eq!(
            st.param_moves, self.moves,
            "stats.param_moves after {after} (a refused call must change nothing)"
        );
        assert_eq!(
            st.clone_blocks_outstanding,
            self.held.len() as u64,
            "stats.clone_blocks_outstanding after {after}"
        );
        // Where each callable's graphs read its parameters.
        for (c, now) in self.inst.iter().enumerate() {
            let mut at = vec![0usize; now.len()];
            // SAFETY: room for the callable's parameters.
            let r = unsafe {
                graphed_session_param_addresses(self.h, c as u32, 0, at.as_mut_ptr().cast(), at.len())
            };
            expect(
                r,
                &[S::Ok],
                "graphed_session_param_addresses",
                "moving parameters",
            );
            assert_eq!(
                &at, now,
                "where callable {c}'s graphs read its parameters after {after}"
            );
        }
    }

    /// A block a grad pass of callable 0 takes: a free slot's if there is
    /// one.
    fn take(&mut self, refs: &[graphed_ref]) {
        let clones: Vec<&graphed_ref> = refs
            .iter()
            .filter(|r| r.kind == graphed_ref_kind::Clone as u32)
            .collect();
        let Some(first) = clones.first() else { return };
        assert!(
            clones.iter().all(|r| r.owner == first.owner),
            "one replay's CLONE grads in several blocks"
        );
        let slot = self.free_slots > 0;
        if slot {
            self.free_slots -= 1;
        }
        self.held.push(Held {
            owner: first.owner,
            refs: clones.len(),
            slot,
        });
    }

    /// Releases held block `k`.
    fn release(&mut self, k: usize) {
        let b = self.held.swap_remove(k);
        for _ in 0..b.refs {
            expect(
                graphed_buffer_release(b.owner),
                &[S::Ok],
                "graphed_buffer_release",
                "a moving parameters' clone",
            );
        }
        if b.slot {
            self.free_slots += 1;
        }
    }
}

/// The addresses a replay is given for parameters now at `now` (registered
/// at `reg`): None (a NULL array), or one entry each: NULL, where they are
/// now, registered, or fresh memory aligned as registered or less; now and
/// then one entry too many or too few.
fn addresses(now: &[usize]) -> Option<Vec<usize>> {
    let i = &w().input;
    if i.below(4) == 0 {
        return None;
    }
    let mut v: Vec<usize> = now
        .iter()
        .map(|&p| match i.below(6) {
            0 => 0,
            1 | 2 => p,
            3 => aligned(0),
            4 => aligned(i.pick(&[4, 8, 64])),
            _ => aligned(0),
        })
        .collect();
    match i.below(16) {
        0 => v.push(0),
        1 => {
            v.pop();
        }
        _ => {}
    }
    Some(v)
}

fn as_ptrs(v: &Option<Vec<usize>>) -> (*const *const c_void, usize) {
    match v {
        None => (null(), 0),
        Some(v) if v.is_empty() => (std::ptr::dangling(), 0),
        Some(v) => (v.as_ptr() as *const *const c_void, v.len()),
    }
}

/// Builds the session; None when capture refused it as the model says.
fn build() -> Option<Movers> {
    let i = &w().input;
    let mut cfg = graphed_session_config_default();
    cfg.backend = graphed_backend::Host as u32;
    cfg.warmup_iterations = 1;
    cfg.clone_slots = i.below(3) as u32;
    let mut h = null_mut();
    // SAFETY: a valid config and out pointer.
    let r = unsafe { graphed_session_create(&cfg, &mut h) };
    expect(r, &[S::Ok], "graphed_session_create", "moving parameters");
    let ncallables = 1 + i.below(2);
    let clone = i.below(3) != 0;
    let wgrad = i.chance(80);
    let microbatches = 1 + i.below(2) as u32;
    let tie = ncallables == 2 && i.chance(100);
    let tensor = graphed_tensor_desc {
        bytes: PBYTES,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    };
    let mut reg: Vec<Vec<usize>> = Vec::new();
    let mut dsts: Vec<Vec<usize>> = Vec::new();
    for c in 0..ncallables {
        let n = 1 + i.below(2);
        let policy = match (c, clone) {
            (0, true) => graphed_grad_policy::Clone,
            _ => match i.below(3) {
                0 if microbatches == 1 => graphed_grad_policy::Alias,
                1 => graphed_grad_policy::AccumulateInto,
                _ => graphed_grad_policy::CopyInto,
            },
        };
        let addrs: Vec<usize> = (0..n)
            .map(|j| match (c, j, tie) {
                (1, 0, true) => reg[0][0],
                _ => aligned(0),
            })
            .collect();
        let needs = matches!(
            policy,
            graphed_grad_policy::CopyInto | graphed_grad_policy::AccumulateInto
        );
        dsts.push((0..n).map(|_| if needs { aligned(0) } else { 0 }).collect());
        let params: Vec<graphed_param_desc> = addrs
            .iter()
            .map(|&p| graphed_param_desc {
                data: p as *mut c_void,
                bytes: PBYTES,
                flags: graphed_param_flags::Rebind as u32,
                policy: policy as u32,
                ..graphed_param_desc_default()
            })
            .collect();
        let mut d = graphed_callable_desc_default();
        d.num_inputs = 1;
        d.inputs = &tensor;
        d.num_outputs = 1;
        d.outputs = &tensor;
        d.num_params = params.len();
        d.params = params.as_ptr();
        d.forward = Some(idle);
        d.backward = Some(idle);
        if wgrad {
            d.wgrad = Some(idle);
        }
        let mut idx = 0;
        // SAFETY: the descriptor and its arrays are valid locals.
        let r = unsafe { graphed_session_add_callable(h, &d, &mut idx) };
        expect(
            r,
            &[S::Ok],
            "graphed_session_add_callable",
            "moving parameters",
        );
        reg.push(addrs);
    }
    let callables: Vec<u32> = (0..ncallables as u32).collect();
    let flat_dsts: Vec<*mut c_void> = dsts.iter().flatten().map(|&d| d as *mut c_void).collect();
    let mut sd = graphed_step_desc_default();
    sd.callables = callables.as_ptr();
    sd.num_callables = callables.len();
    sd.param_dsts = flat_dsts.as_ptr().cast();
    sd.num_param_dsts = flat_dsts.len();
    sd.microbatches = microbatches;
    let mut idx = 0;
    // SAFETY: a valid descriptor and its arrays.
    let r = unsafe { graphed_session_add_step(h, &sd, &mut idx) };
    expect(r, &[S::Ok], "graphed_session_add_step", "moving parameters");
    let looped = microbatches > 1;
    let refused = looped && clone && cfg.clone_slots == 0;
    let r = graphed_session_capture(h);
    let want = if refused { S::Incompatible } else { S::Ok };
    expect(r, &[want], "graphed_session_capture", "moving parameters");
    if r != S::Ok {
        expect(
            graphed_session_destroy(h),
            &[S::Ok],
            "graphed_session_destroy",
            "moving parameters",
        );
        return None;
    }
    // Every parameter can move in its callable's graphs.
    for (c, r) in reg.iter().enumerate() {
        let mut on = vec![7u32; r.len()];
        // SAFETY: room for the callable's parameters.
        let q =
            unsafe { graphed_session_params_movable(h, c as u32, 0, on.as_mut_ptr(), on.len()) };
        expect(
            q,
            &[S::Ok],
            "graphed_session_params_movable",
            "moving parameters",
        );
        assert!(
            on.iter().all(|&v| v == 1),
            "a parameter no graph reads cannot move: {on:?}"
        );
    }
    let flat: Vec<usize> = reg.iter().flatten().copied().collect();
    let tied: Vec<bool> = reg
        .iter()
        .enumerate()
        .flat_map(|(c, r)| (0..r.len()).map(move |j| tie && j == 0 && c < 2))
        .collect();
    let m = Movers {
        h,
        inst: reg.clone(),
        sg: flat.clone(),
        at: flat,
        tied,
        reg,
        clone,
        wgrad,
        dsts,
        looped,
        free_slots: if clone { cfg.clone_slots } else { 0 },
        held: Vec::new(),
        moves: 0,
    };
    m.check("capture");
    Some(m)
}

/// A forward, backward or weight-grad replay of callable `c`.
fn pass(m: &mut Movers, c: usize, kind: u32) {
    let given = addresses(&m.inst[c]);
    let np = m.reg[c].len();
    let mut want = None;
    if let Some(g) = &given {
        if g.len() != np {
            want = Some(S::InvalidArgument);
        }
    }
    // A weight-grad replay of a callable without one: its backward.
    let kind = if kind == 2 && !m.wgrad { 1 } else { kind };
    let grad_pass = kind == if m.wgrad { 2 } else { 1 };
    if want.is_none() {
        if let Some(g) = &given {
            for (j, &to) in g.iter().enumerate() {
                if to == 0 || to == m.inst[c][j] {
                    continue;
                }
                let refused = if kind == 0 {
                    (alignment(to) < alignment(m.reg[c][j])).then_some(S::ParamMoved)
                } else {
                    Some(S::InvalidArgument)
                };
                if let Some(e) = refused {
                    want = Some(e);
                    break;
                }
            }
        }
    }
    let (pp, pn) = as_ptrs(&given);
    let dsts: Vec<*mut c_void> = m.dsts[c].iter().map(|&d| d as *mut c_void).collect();
    let mut a = graphed_replay_args_default();
    a.callable = c as u32;
    a.params = pp;
    a.num_params = pn;
    if grad_pass && dsts.iter().any(|d| !d.is_null()) {
        a.param_dsts = dsts.as_ptr().cast();
        a.num_param_dsts = dsts.len();
    }
    let mut first = [empty_ref()];
    let mut grads = vec![empty_ref(); np];
    mark();
    // SAFETY: valid args and room for the stated refs.
    let (r, func) = unsafe {
        match kind {
            0 => (
                graphed_forward(m.h, &a, first.as_mut_ptr(), 1),
                "graphed_forward",
            ),
            1 => (
                graphed_backward(m.h, &a, first.as_mut_ptr(), 1, grads.as_mut_ptr(), np),
                "graphed_backward",
            ),
            _ => (
                graphed_backward_wgrad(m.h, &a, grads.as_mut_ptr(), np),
                "graphed_backward_wgrad",
            ),
        }
    };
    trace!("moves: {func} of {c} given {given:x?} want {want:?} got {r:?}");
    expect(r, &[want.unwrap_or(S::Ok)], func, "moving parameters");
    if r == S::Ok {
        if kind == 0 {
            if let Some(g) = &given {
                for (j, &to) in g.iter().enumerate() {
                    if to != 0 && to != m.inst[c][j] {
                        m.moves += 1;
                        m.inst[c][j] = to;
                    }
                }
            }
        }
        if grad_pass && c == 0 {
            m.take(&grads);
        }
    } else {
        assert!(
            first[0].ptr.is_null() && grads.iter().all(|g| g.ptr.is_null()),
            "{func} wrote refs on failure"
        );
    }
    m.check(func);
}

/// A step replay.
fn step(m: &mut Movers) {
    let flat: Vec<(usize, usize)> = m.step_params();
    let given = addresses(&m.at);
    let mut want = None;
    let mut to: Vec<usize> = m.at.clone();
    if let Some(g) = &given {
        if g.len() != flat.len() {
            want = Some(S::InvalidArgument);
        } else {
            for (k, &p) in g.iter().enumerate() {
                if p != 0 {
                    to[k] = p;
                }
            }
        }
    }
    // Whether the step's graphs follow every address; else whether the
    // callables' graphs do.
    let mut follows = true;
    if want.is_none() {
        for (k, &(c, j)) in flat.iter().enumerate() {
            let step_can =
                to[k] == m.sg[k] || (!m.tied[k] && alignment(to[k]) >= alignment(m.reg[c][j]));
            if !step_can {
                follows = false;
            }
        }
        if !follows {
            let inst_can = flat.iter().enumerate().all(|(k, &(c, j))| {
                to[k] == m.inst[c][j] || alignment(to[k]) >= alignment(m.reg[c][j])
            });
            if !inst_can || m.looped {
                want = Some(S::ParamMoved);
            }
        }
    }
    // graph: the step's graph; a slot's: with a free one; pass by pass.
    #[derive(Debug, PartialEq)]
    enum Path {
        Graph,
        Slot,
        ByPass,
    }
    let path = if !follows {
        Path::ByPass
    } else if !m.clone {
        Path::Graph
    } else if m.free_slots > 0 {
        Path::Slot
    } else {
        Path::ByPass
    };
    if want.is_none() && path == Path::ByPass && follows && m.looped {
        want = Some(S::AliasHeld);
    }
    let (pp, pn) = as_ptrs(&given);
    let mut a = graphed_step_args_default();
    a.params = pp;
    a.num_params = pn;
    let mut refs = vec![empty_ref(); flat.len()];
    mark();
    // SAFETY: valid args and room for one ref per parameter.
    let r = unsafe { graphed_step_replay(m.h, &a, refs.as_mut_ptr(), refs.len()) };
    trace!("moves: step given {given:x?} path {path:?} want {want:?} got {r:?}");
    expect(
        r,
        &[want.unwrap_or(S::Ok)],
        "graphed_step_replay",
        "moving parameters",
    );
    if r != S::Ok {
        assert!(
            refs.iter().all(|r| r.ptr.is_null()),
            "graphed_step_replay wrote refs on failure"
        );
        if r == S::AliasHeld {
            assert!(msg().contains("are held"), "{}", msg());
        }
        m.check("a refused step replay");
        return;
    }
    match path {
        Path::Graph | Path::Slot => {
            for k in 0..flat.len() {
                if to[k] != m.sg[k] {
                    m.moves += 1;
                    m.sg[k] = to[k];
                }
            }
        }
        Path::ByPass => {
            for (k, &(c, j)) in flat.iter().enumerate() {
                if to[k] != m.inst[c][j] {
                    m.moves += 1;
                    m.inst[c][j] = to[k];
                }
            }
        }
    }
    m.at = to;
    if m.clone {
        let n0 = m.reg[0].len();
        m.take(&refs[..n0]);
    }
    m.check("a step replay");
}

/// Builds a session whose parameters move, runs a fuzzed sequence of
/// replays against the model, and destroys it.
pub fn op_moving_params() {
    let Some(mut m) = build() else { return };
    let i = &w().input;
    let n = m.reg.len();
    for _ in 0..1 + i.below(MOVE_OPS) {
        match i.below(8) {
            0 | 1 => step(&mut m),
            2 | 3 => pass(&mut m, i.below(n), 0),
            4 => pass(&mut m, i.below(n), 1),
            5 => pass(&mut m, i.below(n), 2),
            _ if !m.held.is_empty() => {
                let k = i.below(m.held.len());
                m.release(k);
                m.check("a release");
            }
            _ => step(&mut m),
        }
    }
    while !m.held.is_empty() {
        m.release(0);
    }
    m.check("the releases");
    expect(
        graphed_session_destroy(m.h),
        &[S::Ok],
        "graphed_session_destroy",
        "moving parameters",
    );
}
