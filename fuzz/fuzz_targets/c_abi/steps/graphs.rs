//! The model of declared steps: how many clone slots and step graphs a
//! capture makes of them, and the capture hook a step may have.

use super::*;
use std::collections::HashSet;

/// Whether callable `c` of `s` returns CLONE grads.
pub fn clones(s: &Sess, c: usize) -> bool {
    s.callables[c]
        .params
        .iter()
        .any(|p| p.resolved(s.clone) == 1)
}

/// Whether the pass that writes callable `cl`'s grads gets clone slots:
/// not when it provides external buffers or returns external clones.
fn grad_pass_has_slots(s: &Sess, cl: &Callable) -> bool {
    let grad_pass = if cl.wgrad { 2 } else { 1 };
    externals(cl, grad_pass).is_empty()
        && !cl
            .params
            .iter()
            .any(|p| p.external && p.grad && p.resolved(s.clone) == 1)
}

/// The clone slots step `st` gets: none with a caller allocator, or when
/// one of its callables that returns CLONE grads has none.
pub fn step_slots(s: &Sess, st: &StepModel) -> u32 {
    let without = st
        .callables
        .iter()
        .any(|&c| clones(s, c) && !grad_pass_has_slots(s, &s.callables[c]));
    if s.custom_alloc || without {
        0
    } else {
        s.clone_slots
    }
}

/// The graphs capture makes of step `st`: one, or with CLONE grads one
/// per clone slot (none without slots: the step replays pass by pass).
pub fn graphs_of(s: &Sess, st: &StepModel) -> u32 {
    if st.callables.iter().any(|&c| clones(s, c)) {
        step_slots(s, st)
    } else {
        1
    }
}

/// The step graphs capture makes of session `k`'s steps.
pub fn step_graphs(k: usize) -> u32 {
    let s = &w().sessions.borrow()[k];
    s.steps.iter().map(|st| graphs_of(s, st)).sum()
}

thread_local! {
    /// The sessions whose step hook was called before a capture and not
    /// yet after it.
    static HOOK_OPEN: RefCell<HashSet<usize>> = RefCell::new(HashSet::new());
}

/// What a step's capture_hook_data holds: the session, and the mode.
pub fn hook_data(sess: usize, mode: usize) -> *mut c_void {
    ((sess << 4) | mode) as *mut c_void
}

/// A step's capture hook: runs inside its session's capture, before (0)
/// and after (1) each capture of the step's graph, in turn; returns 11
/// before a capture in mode 2 and after one in mode 3.
pub unsafe extern "C" fn step_hook(when: u32, data: *mut c_void) -> i32 {
    let (sess, mode) = (data as usize >> 4, data as usize & 15);
    assert!(
        w().frames.borrow().iter().any(|f| f.sess == sess),
        "a step hook outside its session's capture"
    );
    let open = HOOK_OPEN.with(|o| o.borrow().contains(&sess));
    trace!("  step hook sess {sess} mode {mode} when {when}");
    match when {
        0 => assert!(!open, "a step hook called before a capture twice"),
        1 => assert!(open, "a step hook called after a capture it was not called before"),
        _ => panic!("step hook: when is {when}"),
    }
    let code = match (mode, when) {
        (2, 0) | (3, 1) => 11,
        _ => 0,
    };
    HOOK_OPEN.with(|o| {
        let mut o = o.borrow_mut();
        if when == 0 && code == 0 {
            o.insert(sess);
        } else {
            o.remove(&sess);
        }
    });
    code
}
