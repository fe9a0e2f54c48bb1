//! The model of declared steps: whether their callables have external
//! buffers, and how many step graphs a capture makes of them.

use super::*;

/// Whether a callable of a declared step has external buffers.
pub fn step_has_external(s: &Sess) -> bool {
    s.steps
        .iter()
        .flat_map(|st| &st.callables)
        .any(|&c| callable_is_external(&s.callables[c]))
}

pub fn callable_is_external(cl: &Callable) -> bool {
    cl.inputs.iter().chain(&cl.outputs).any(|t| t.external) || cl.params.iter().any(|p| p.external)
}

/// The step graphs capture makes: one per step, or with CLONE grads one
/// per clone slot (none with a caller allocator or no slots: those steps
/// replay pass by pass).
pub fn step_graphs(k: usize) -> u32 {
    let s = &w().sessions.borrow()[k];
    s.steps
        .iter()
        .map(|st| {
            let cloned = st.callables.iter().any(|&c| {
                s.callables[c]
                    .params
                    .iter()
                    .any(|p| p.resolved(s.clone) == 1)
            });
            match (cloned, s.custom_alloc) {
                (false, _) => 1,
                (true, true) => 0,
                (true, false) => s.clone_slots,
            }
        })
        .sum()
}
