//! A step's update stage: the optimizer a step captures once into its
//! graph after the last microbatch's backward (graphed_step_desc's
//! update_check, update_apply and scalar_bytes), what its callback
//! receives, and the query of the device flag that skips it.

use super::args::arg_out;
use super::boundary::boundary;
use super::callback::{clear_failure, graphed_stream, take_failure};
use super::config::SendPtr;
use super::enums::{graphed_dtype, graphed_grad_policy, graphed_update_phase};
use super::handles::graphed_session;
use super::session::session;
use super::status::graphed_status;
use crate::core::policy::GradPolicy;
use crate::error::{Error, Result};
use crate::orchestrate::spec::{UpdateSpec, UpdateView};
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

/// What a step's update callback receives. Every array and pointer is
/// valid during the call only; the device memory they point to is valid
/// while the session's graphs exist.
///
/// The callback is called only under stream capture, once per phase in
/// each capture of the step's graph (one graph, or one per clone slot when
/// the step returns CLONE grads: `slot` says which, and `grads` point into
/// that slot's block), after the last microbatch's grads are where the
/// step puts them; never eagerly, so warmup does not update the weights.
/// What it may do there:
/// - enqueue kernels, copies and sets on `stream`, reading `params`,
///   `grads`, `scalars` and memory of its own (optimizer state), and
///   writing the parameters, its state and the scalars;
/// - the check phase writes a non-zero uint32_t to `*skip_flag` (device
///   memory, 0 when the check begins) to skip the apply phase this
///   replay, as loss scalers skip a step whose grads are not finite; it
///   may also do work that must run either way (update a loss scale);
/// - the apply phase is recorded, with a check, as the body of a
///   conditional IF node: kernels, copies and sets only (no event records
///   or waits, so no work forked to other streams, and no memory allocated
///   or freed under capture), as in a WHILE step's body.
///
/// It may not synchronize, allocate device memory (cudaMalloc, or
/// cudaMallocAsync outside a graph's pool), call back into its own session
/// (GRAPHED_STATUS_BUSY), nor launch a kernel its module loads lazily for
/// the first time: run the optimizer once eagerly (on scratch copies)
/// before capture so that its kernels are loaded.
#[repr(C)]
pub struct graphed_update_ctx {
    /// sizeof(graphed_update_ctx) as the library was built: fields past a
    /// caller's own sizeof are new to it.
    pub struct_size: usize,
    /// The step, as graphed_session_add_step returned it.
    pub step: u32,
    /// A graphed_update_phase value: CHECK or APPLY.
    pub phase: u32,
    /// Enqueue all work here (a CUstream being captured on CUDA, a host
    /// stream on the host backend).
    pub stream: graphed_stream,
    /// The clone slot whose graph is captured (0 for a step without
    /// CLONE grads, whose one graph this is).
    pub slot: u32,
    /// The microbatches the step was declared with.
    pub microbatches: u32,
    /// A step looping on the device (GRAPHED_STEP_LOOP_WHILE): device
    /// memory holding the count the replay runs (a uint32_t), for an
    /// average over microbatches; NULL otherwise (the count is
    /// `microbatches`).
    pub microbatch_count: *const u32,
    /// The parameters of the step's callables, in order (as
    /// graphed_step_param_count counts them): where the step's graph reads
    /// them (as registered).
    pub num_params: usize,
    pub params: *const *mut c_void,
    /// [num_params] where each parameter's grad is, summed over the
    /// microbatches, when the update runs: COPY_INTO and ACCUMULATE_INTO
    /// destinations (an ACCUMULATE_INTO destination holds what it held
    /// plus the sum), CLONE grads in this graph's clone slot block, ALIAS
    /// grads in their static buffer; NULL for a parameter without a grad.
    pub grads: *const *mut c_void,
    /// [num_params] each parameter's bytes.
    pub bytes: *const usize,
    /// [num_params] each parameter's graphed_dtype.
    pub dtypes: *const u32,
    /// [num_params] each parameter's frozen graphed_grad_policy
    /// (GRAPHED_GRAD_POLICY_DEFAULT for a parameter without a grad).
    pub policies: *const u32,
    /// The step's scalar block (graphed_step_desc.scalar_bytes bytes,
    /// 256-byte aligned, zeroed at capture): what a replay was given in
    /// graphed_step_args.scalars, copied in before its graph runs; the
    /// update may also change it on the device (a step count). NULL when
    /// the step declared none.
    pub scalars: *mut c_void,
    pub scalar_bytes: usize,
    /// The check's flag (a uint32_t of device memory, set to 0 before the
    /// check runs at each replay): non-zero skips the apply phase. NULL
    /// for a step without update_check.
    pub skip_flag: *mut u32,
}

/// A step's update callback (graphed_step_desc.update_check and
/// update_apply). Return 0 on success; any other value fails the capture
/// with GRAPHED_STATUS_CALLBACK_FAILED, naming the step, the phase and the
/// value (and what graphed_callback_fail_message said).
pub type graphed_update_fn =
    Option<unsafe extern "C" fn(ctx: *const graphed_update_ctx, user_data: *mut c_void) -> i32>;

type UpdateFnPtr = unsafe extern "C" fn(*const graphed_update_ctx, *mut c_void) -> i32;

/// A step's update as the orchestration calls it, from the descriptor's
/// fields; None for a step without one. A check without an apply, and
/// scalars without an update, are refused.
pub(super) fn update_of(
    check: graphed_update_fn,
    apply: graphed_update_fn,
    data: *mut c_void,
    scalar_bytes: usize,
) -> Result<Option<UpdateSpec>> {
    let Some(apply) = apply else {
        if check.is_some() {
            return Err(Error::invalid(
                "desc.update_check is set but desc.update_apply is NULL: a check decides whether the \
                 apply part runs; set both, or neither",
            ));
        }
        if scalar_bytes != 0 {
            return Err(Error::invalid(format!(
                "desc.scalar_bytes is {scalar_bytes} but the step has no update (desc.update_apply is \
                 NULL): the scalar block is the update's"
            )));
        }
        return Ok(None);
    };
    let data = SendPtr(data);
    let callback = move |v: &UpdateView| {
        let f: UpdateFnPtr = match v.phase {
            crate::orchestrate::spec::UpdatePhase::Check => check.ok_or((-1, String::new()))?,
            crate::orchestrate::spec::UpdatePhase::Apply => apply,
        };
        call_update(f, v, data.get())
    };
    Ok(Some(UpdateSpec {
        callback: Arc::new(callback),
        check: check.is_some(),
        scalar_bytes,
    }))
}

/// Calls `f` with the context of `v`.
fn call_update(
    f: UpdateFnPtr,
    v: &UpdateView,
    data: *mut c_void,
) -> std::result::Result<(), (i32, String)> {
    clear_failure();
    let dtypes: Vec<u32> = v.dtypes.iter().map(|&d| graphed_dtype::encode(d)).collect();
    let policies: Vec<u32> = v
        .policies
        .iter()
        .map(|p| graphed_grad_policy::encode(p.unwrap_or(GradPolicy::Default)))
        .collect();
    let ctx = graphed_update_ctx {
        struct_size: size_of::<graphed_update_ctx>(),
        step: v.step,
        phase: graphed_update_phase::encode(v.phase),
        stream: v.stream.0 as graphed_stream,
        slot: v.slot,
        microbatches: v.microbatches,
        microbatch_count: v.microbatch_count as *const u32,
        num_params: v.params.len(),
        params: v.params.as_ptr().cast(),
        grads: v.grads.as_ptr().cast(),
        bytes: v.bytes.as_ptr(),
        dtypes: dtypes.as_ptr(),
        policies: policies.as_ptr(),
        scalars: v.scalars as *mut c_void,
        scalar_bytes: v.scalar_bytes,
        skip_flag: v.skip_flag as *mut u32,
    };
    // SAFETY: the caller registered `f` for this purpose; `ctx` and the
    // arrays it points to outlive the call.
    match unsafe { f(&ctx, data) } {
        0 => Ok(()),
        code => Err((code, take_failure())),
    }
}

/// Whether the last replay of `step` skipped its update's apply part
/// (its check set the flag): `*skipped_out` 1 or 0 (0 before any
/// replay); and, where `skipped_total_out` is not NULL, how many replays
/// since capture skipped it, counted on the device. Waits for the step's
/// last replay to finish first (the host reads the flag only here, never
/// on the replay path), so that it answers for that replay.
///
/// Checks, in this order: the session (NULL, destroyed, forged);
/// `skipped_out` NULL (GRAPHED_STATUS_NULL_POINTER) or misaligned, then
/// `skipped_total_out` misaligned (INVALID_ARGUMENT); BUSY; not captured
/// (WRONG_STATE) or reset (SESSION_RESET); a step that does not exist
/// (INVALID_ARGUMENT); a released callable of the step
/// (CALLABLE_RELEASED); a step without update_check (INVALID_ARGUMENT:
/// nothing is ever skipped); the wait failing (CUDA_ERROR, with the
/// error the step's work met). A refusal writes nothing.
///
/// # Safety
/// `skipped_out` must be NULL or writable; `skipped_total_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_step_skipped(
    session: *mut graphed_session,
    step: u32,
    skipped_out: *mut u32,
    skipped_total_out: *mut u64,
) -> graphed_status {
    boundary("graphed_step_skipped", || {
        let s = self::session(session)?;
        let out = arg_out(skipped_out, "skipped_out")?;
        let total = match skipped_total_out.is_null() {
            true => None,
            false => Some(arg_out(skipped_total_out, "skipped_total_out")?),
        };
        let (last, count) = s.lock()?.step_skipped(step)?;
        // SAFETY: checked non-NULL and aligned; written only on success.
        unsafe {
            out.write(last as u32);
            if let Some(t) = total {
                t.write(count);
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    unsafe extern "C" fn nothing(_: *const graphed_update_ctx, _: *mut c_void) -> i32 {
        0
    }

    #[test]
    fn a_check_needs_an_apply_and_scalars_need_an_update() {
        let e = update_of(Some(nothing), None, std::ptr::null_mut(), 0)
            .err()
            .unwrap();
        assert!(e.to_string().contains("update_apply is NULL"), "{e}");
        let e = update_of(None, None, std::ptr::null_mut(), 8)
            .err()
            .unwrap();
        assert!(e.to_string().contains("scalar_bytes is 8"), "{e}");
        assert!(update_of(None, None, std::ptr::null_mut(), 0)
            .unwrap()
            .is_none());
        let u = update_of(Some(nothing), Some(nothing), std::ptr::null_mut(), 16)
            .unwrap()
            .unwrap();
        assert!(u.check && u.scalar_bytes == 16);
    }
}
