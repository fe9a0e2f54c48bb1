//! Steps: callables declared before capture to be captured once more as
//! one graph (every forward, then every backward, with the parameter grads
//! returned inside the graph), replayed with one launch.

use super::args::{
    arg_out, arg_slice, assert_header, read_array, read_struct, write_answer, CStruct,
};
use super::boundary::boundary;
use super::callback::graphed_stream;
use super::collective::{
    collective_of, graphed_collective_exchange_fn, graphed_collective_fn, CollectiveFields,
};
use super::config::{graphed_session_hook_fn, hook_of};
use super::enums::{graphed_buffer_role, graphed_collective_at, graphed_step_loop};
use super::handles::graphed_session;
use super::replay::{check_out, graphed_ref, ptrs, publish, write_refs};
use super::session::session;
use super::status::graphed_status;
use super::update::{graphed_update_fn, update_of};
use crate::backend::{DevPtr, StreamRef};
use crate::error::Result;
use crate::orchestrate::spec::{CaptureHook, StepIo};
use crate::orchestrate::steps::StepRequest;
use crate::orchestrate::StepCall;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

/// The magics the _default() functions set.
pub const GRAPHED_STEP_DESC_MAGIC: u32 = 0x6772_0007;
pub const GRAPHED_STEP_ARGS_MAGIC: u32 = 0x6772_0008;
pub const GRAPHED_STEP_IO_MAGIC: u32 = 0x6772_0011;

/// The most microbatches one step holds (graphed_step_desc.microbatches):
/// each is captured into its graph.
pub const GRAPHED_STEP_MAX_MICROBATCHES: u32 = 4096;

/// The most bytes of a step's scalar block (graphed_step_desc.scalar_bytes).
pub const GRAPHED_STEP_MAX_SCALAR_BYTES: usize = 4096;

/// A step to declare. Initialise with graphed_step_desc_default().
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_step_desc {
    /// sizeof(graphed_step_desc); set by the _default() function.
    pub struct_size: usize,
    /// GRAPHED_STEP_DESC_MAGIC; set by the _default() function.
    pub magic: u32,
    /// The callables of the step, each once, in registration order (the
    /// session has no pipeline schedule). Callables with external buffers
    /// (GRAPHED_TENSOR_FLAGS_EXTERNAL, GRAPHED_PARAM_FLAGS_EXTERNAL_GRAD)
    /// may be part of it: in every capture of the step's graph each pass
    /// finds its external buffers at the addresses its own capture
    /// provided (ctx->outputs, ctx->grad_inputs, ctx->param_grads) and
    /// writes its results there; graphed_pass_set_buffer is refused there
    /// (GRAPHED_STATUS_WRONG_STATE). io entries may name them. A callable
    /// whose pass that writes the parameter grads (the weight-grad pass
    /// where there is one, else the backward) provides external grads gets
    /// no clone slots (graphed_session_config.clone_slots): its CLONE grads
    /// make the step replay pass by pass, and in a step over microbatches,
    /// with io or looping on the device they are
    /// GRAPHED_STATUS_INCOMPATIBLE at capture (give them COPY_INTO or
    /// ACCUMULATE_INTO).
    pub callables: *const u32,
    pub num_callables: usize,
    /// One destination per parameter of the step's callables, in order:
    /// where COPY_INTO and ACCUMULATE_INTO grads go at every replay (fixed
    /// at capture; NULL entries for other policies). NULL array when no
    /// parameter needs one.
    pub param_dsts: *const *mut c_void,
    pub num_param_dsts: usize,
    /// Copies of each microbatch's data between caller memory and the
    /// static buffers of the step's callables, done inside the step's
    /// graph (each element initialised by graphed_step_io_default(); their
    /// struct_size is their stride). NULL with 0: none (the callables read
    /// what their static buffers hold, as graphed_step_replay says). A step
    /// with io copies has no pass-by-pass replay, whatever its microbatch
    /// count: its CLONE grads need a clone slot (graphed_session_config
    /// .clone_slots), GRAPHED_STATUS_INCOMPATIBLE at capture without one,
    /// as over several microbatches or looping on the device.
    pub io: *const graphed_step_io,
    pub num_io: usize,
    /// How many microbatches one replay runs, in turn (default 1, at most
    /// GRAPHED_STEP_MAX_MICROBATCHES). Above 1 the step's graph holds the forward and backward of
    /// every microbatch (each captured: callbacks see which one in
    /// graphed_pass_ctx.step_microbatch), microbatch i reading its io
    /// inputs at ptr + i * stride, and the parameter grads are the sum over
    /// the microbatches, added in microbatch order as eager accumulation
    /// adds them: CLONE grads one owned clone of the sum (from a clone
    /// slot), COPY_INTO the sum, ACCUMULATE_INTO each microbatch's grad
    /// added into the destination. ALIAS grads (the last microbatch's
    /// only) and a session without clone slots for CLONE grads are
    /// GRAPHED_STATUS_INCOMPATIBLE at capture, and so are CLONE and
    /// COPY_INTO grads of a dtype graphed does not sum: it sums f32, f16 and
    /// bf16 (f64 and integer grads are refused, as they are for
    /// ACCUMULATE_INTO at registration; a step looping on the device sums
    /// even for one microbatch, so the same holds there). The static
    /// buffers and the scratch arena are those of one microbatch, reused
    /// by each. With GRAPHED_STEP_LOOP_WHILE, the most microbatches a
    /// replay may run.
    pub microbatches: u32,
    /// A graphed_step_loop value: UNROLLED (default; every microbatch
    /// captured, so the graph grows with the count and each callback sees
    /// its microbatch in graphed_pass_ctx.step_microbatch) or WHILE (one
    /// microbatch captured as the body of a conditional WHILE node: the
    /// graph's size does not depend on the count, a replay names how many
    /// to run, and callbacks read the running microbatch on the device at
    /// graphed_pass_ctx.step_microbatch_index). WHILE needs conditional
    /// graph nodes (a CUDA 12.4 driver): GRAPHED_STATUS_UNSUPPORTED here
    /// otherwise. The body may hold kernels, copies and sets only (no
    /// event records or waits: no work forked to other streams).
    pub loop_mode: u32,
    /// Optional hook around each capture of the step's graph (its one
    /// graph, each of its clone-slot graphs, or its looped graph): called
    /// outside stream capture with `when` 0 right before that capture
    /// begins and 1 right after it ended, also after a capture that failed
    /// (whose error then stands). The step's capture runs the callables
    /// again, back to back, and per-callable hooks do not run there: this
    /// is where a framework routes its allocator to the graph's private
    /// pool and makes its random generators graph-safe for the step's
    /// capture, and undoes that after. Non-zero fails the capture with
    /// GRAPHED_STATUS_CALLBACK_FAILED, naming the hook, the step and the
    /// value; the session is then as after any failed capture. NULL:
    /// none (default).
    pub capture_hook: graphed_session_hook_fn,
    /// Passed to capture_hook as `user_data`.
    pub capture_hook_data: *mut c_void,
    /// Optional update stage (an optimizer step), captured once into each
    /// of the step's graphs after the last microbatch's backward (after
    /// the loop, for GRAPHED_STEP_LOOP_WHILE), reading the accumulated
    /// grads where the step put them (graphed_update_ctx.grads): the whole
    /// iteration in one launch. update_apply is the parameter update
    /// (NULL: no update stage). update_check, optional, is recorded before
    /// it and writes the skip flag (graphed_update_ctx.skip_flag, zeroed at
    /// each replay before the check): with it, the apply part is the body
    /// of a conditional IF node that runs only when the flag is 0 (skipping
    /// the update of an iteration whose grads are not finite, as loss
    /// scalers do, decided on the device); graphed_step_skipped reads the
    /// flag when asked. The IF node needs a CUDA 12.4 driver
    /// (GRAPHED_STATUS_UNSUPPORTED here otherwise; the host backend
    /// emulates it). Both are called under capture only, never eagerly
    /// (graphed_update_ctx says what they may do). A step with an update
    /// has no pass-by-pass replay: its CLONE grads need a clone slot
    /// (GRAPHED_STATUS_INCOMPATIBLE at capture without one, ALIAS_HELD
    /// with every slot held), and a parameter given at another address is
    /// GRAPHED_STATUS_PARAM_MOVED (the update writes the parameters where
    /// capture had them). update_check without update_apply is
    /// GRAPHED_STATUS_INVALID_ARGUMENT.
    pub update_check: graphed_update_fn,
    pub update_apply: graphed_update_fn,
    /// Passed to update_check and update_apply as `user_data`.
    pub update_data: *mut c_void,
    /// Bytes of the step's scalar block (0: none; at most
    /// GRAPHED_STEP_MAX_SCALAR_BYTES; only with update_apply): device
    /// memory the step owns, zeroed at capture and freed with its graphs,
    /// that the update reads (graphed_update_ctx.scalars): learning rate,
    /// step count, loss scale, clip threshold. A replay given
    /// graphed_step_args.scalars copies them in before its graph runs, in
    /// stream order, with no recapture.
    pub scalar_bytes: usize,
    /// The step's collective stage (NULL: none): called under each capture
    /// of the step's graph, never eagerly, on the capturing stream, to
    /// enqueue the collectives of the step (an all-reduce of the grads)
    /// into its graph, declaring each with graphed_collective_record (see
    /// graphed_collective_ctx). It runs before the update stage, never
    /// inside a conditional node: with GRAPHED_STEP_LOOP_WHILE the loop
    /// runs all but the last microbatch (a replay of N runs N-1 in the
    /// loop, then the last after it), and a step with CLONE grads needs a
    /// clone slot (GRAPHED_STATUS_INCOMPATIBLE at capture without one).
    /// collective_data, collective_exchange or ranks without it are
    /// GRAPHED_STATUS_INVALID_ARGUMENT.
    pub collective: graphed_collective_fn,
    /// Passed to `collective` as `user_data`.
    pub collective_data: *mut c_void,
    /// A graphed_collective_at value: AFTER_BACKWARD (default) or
    /// PER_CALLABLE.
    pub collective_at: u32,
    /// The caller's all-gather (see graphed_collective_exchange_fn), called
    /// (twice, or once) at the end of each capture of the step on every rank, to
    /// compare the ranks' manifests before the first replay: a difference,
    /// or another rank's failed capture of the step, is
    /// GRAPHED_STATUS_COLLECTIVE_MISMATCH naming the first entry that
    /// differs on both sides, and the capture is abandoned. A rank whose
    /// capture of the step fails still calls it (so that the others fail
    /// instead of waiting), also when it failed before it reached the step
    /// (once per step it did not reach, for the headers alone); a rank
    /// whose process died leaves the others' all-gather waiting as the
    /// caller's channel does. NULL: the manifest is kept
    /// (graphed_step_collectives) but not compared.
    pub collective_exchange: graphed_collective_exchange_fn,
    /// Passed to collective_exchange as `user_data`.
    pub collective_exchange_data: *mut c_void,
    /// This rank (below collective_ranks) and how many ranks take part
    /// (default 0 of 1): what the exchange's all-gather returns.
    pub collective_rank: u32,
    pub collective_ranks: u32,
}

/// One copy of a step over microbatches: a static buffer of one of the
/// step's callables, and caller memory holding one block per microbatch
/// (microbatch i at `ptr + i * stride`; the stride at least the buffer's
/// bytes when there is more than one microbatch). INPUT and GRAD_OUTPUT
/// buffers are filled from it before the pass that reads them (the
/// callable's forward, its backward); OUTPUT and GRAD_INPUT buffers are
/// copied to it after the pass that writes them. Fixed at capture: the
/// memory must stay valid while the session's graphs exist, and capture
/// already runs the copies (verification replays the step). A buffer that
/// is another callable's (a chained input or its grad), a buffer that does
/// not exist (the grad of a tensor that takes none) and memory that
/// overlaps the session's static buffers are refused at capture; memory a
/// copy out writes may not overlap that of another entry.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_step_io {
    /// sizeof(graphed_step_io); set by the _default() function.
    pub struct_size: usize,
    /// GRAPHED_STEP_IO_MAGIC; set by the _default() function.
    pub magic: u32,
    /// A callable of the step.
    pub callable: u32,
    /// A graphed_buffer_role value: INPUT, OUTPUT, GRAD_OUTPUT or
    /// GRAD_INPUT.
    pub role: u32,
    /// The tensor's index among the callable's inputs (INPUT, GRAD_INPUT)
    /// or outputs (OUTPUT, GRAD_OUTPUT).
    pub index: u32,
    /// Caller device memory, microbatch 0's block.
    pub ptr: *mut c_void,
    /// Bytes from one microbatch's block to the next.
    pub stride: usize,
}

// SAFETY: repr(C), integers and pointers only, header at offsets 0 and 8.
unsafe impl CStruct for graphed_step_io {
    const NAME: &'static str = "graphed_step_io";
    const MAGIC: u32 = GRAPHED_STEP_IO_MAGIC;
    const MIN_SIZE: usize = 40;
    fn defaults() -> Self {
        graphed_step_io_default()
    }
}
assert_header!(graphed_step_io);

/// A step io entry with its size and magic set: callable 0's input 0, no
/// memory yet.
#[no_mangle]
pub extern "C" fn graphed_step_io_default() -> graphed_step_io {
    graphed_step_io {
        struct_size: size_of::<graphed_step_io>(),
        magic: GRAPHED_STEP_IO_MAGIC,
        callable: 0,
        role: graphed_buffer_role::Input as u32,
        index: 0,
        ptr: std::ptr::null_mut(),
        stride: 0,
    }
}

// SAFETY: repr(C), integers and pointers only, header at offsets 0 and 8.
unsafe impl CStruct for graphed_step_desc {
    const NAME: &'static str = "graphed_step_desc";
    const MAGIC: u32 = GRAPHED_STEP_DESC_MAGIC;
    const MIN_SIZE: usize = 48;
    fn defaults() -> Self {
        graphed_step_desc_default()
    }
}
assert_header!(graphed_step_desc);

/// An empty step descriptor with its size and magic set.
#[no_mangle]
pub extern "C" fn graphed_step_desc_default() -> graphed_step_desc {
    graphed_step_desc {
        struct_size: size_of::<graphed_step_desc>(),
        magic: GRAPHED_STEP_DESC_MAGIC,
        callables: std::ptr::null(),
        num_callables: 0,
        param_dsts: std::ptr::null(),
        num_param_dsts: 0,
        io: std::ptr::null(),
        num_io: 0,
        microbatches: 1,
        loop_mode: graphed_step_loop::Unrolled as u32,
        capture_hook: None,
        capture_hook_data: std::ptr::null_mut(),
        update_check: None,
        update_apply: None,
        update_data: std::ptr::null_mut(),
        scalar_bytes: 0,
        collective: None,
        collective_data: std::ptr::null_mut(),
        collective_at: graphed_collective_at::AfterBackward as u32,
        collective_exchange: None,
        collective_exchange_data: std::ptr::null_mut(),
        collective_rank: 0,
        collective_ranks: 1,
    }
}

/// Declares a step before capture; writes its index to `*step_out`. At
/// capture the step's callables are captured once more, back to back, as
/// one graph: every forward in order, then every backward in reverse (each
/// weight-grad right after its backward), each grad pass followed by its
/// COPY_INTO and ACCUMULATE_INTO returns. Per-callable hooks do not run
/// around these captures (desc->capture_hook does). Per-callable replays
/// keep working. Callables with external buffers are fine: the step's
/// passes write them where their own captures provided them. Steps do not
/// go with a pipeline schedule: GRAPHED_STATUS_INCOMPATIBLE.
///
/// # Safety
/// `desc` must point to a graphed_step_desc initialised by its _default()
/// function whose arrays hold the counts it states.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_add_step(
    session: *mut graphed_session,
    desc: *const graphed_step_desc,
    step_out: *mut u32,
) -> graphed_status {
    boundary("graphed_session_add_step", || {
        let s = self::session(session)?;
        let out = arg_out(step_out, "step_out")?;
        // SAFETY: per this function's contract.
        let d = unsafe { read_struct(desc, "desc") }?;
        // SAFETY: per this function's contract.
        let callables =
            unsafe { arg_slice(d.callables, d.num_callables, "desc.callables") }?.to_vec();
        let param_dsts = ptrs(d.param_dsts.cast(), d.num_param_dsts, "desc.param_dsts")?;
        // SAFETY: per this function's contract.
        let io = unsafe { read_array(d.io, d.num_io, "desc.io") }?
            .iter()
            .enumerate()
            .map(|(k, e)| {
                Ok(StepIo {
                    callable: e.callable,
                    role: graphed_buffer_role::decode(e.role, &format!("desc.io[{k}].role"))?,
                    index: e.index as usize,
                    ptr: e.ptr as DevPtr,
                    stride: e.stride,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let index = s.lock()?.add_step(StepRequest {
            callables,
            param_dsts,
            microbatches: d.microbatches,
            io,
            looping: graphed_step_loop::decode(d.loop_mode, "desc.loop_mode")?,
            capture_hook: hook_of(d.capture_hook, d.capture_hook_data)
                .map(|h| CaptureHook(Arc::new(h))),
            update: update_of(
                d.update_check,
                d.update_apply,
                d.update_data,
                d.scalar_bytes,
            )?,
            collective: collective_of(CollectiveFields {
                callback: d.collective,
                data: d.collective_data,
                at: d.collective_at,
                exchange: d.collective_exchange,
                exchange_data: d.collective_exchange_data,
                rank: d.collective_rank,
                ranks: d.collective_ranks,
            })?,
        })?;
        // SAFETY: checked non-NULL; written only on success.
        unsafe { out.write(index) };
        Ok(())
    })
}

/// Writes the number of refs a replay of `step` writes to `*count_out`:
/// one per parameter of the step's callables (graphed_step_replay's
/// `num_param_grads`). An unknown step is GRAPHED_STATUS_INVALID_ARGUMENT.
///
/// # Safety
/// `count_out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_step_param_count(
    session: *mut graphed_session,
    step: u32,
    count_out: *mut usize,
) -> graphed_status {
    boundary("graphed_step_param_count", || {
        let s = self::session(session)?;
        // SAFETY: per this function's contract.
        unsafe { write_answer(count_out, "count_out", || s.lock()?.step_params(step)) }
    })
}

/// Arguments of a step replay. Initialise with graphed_step_args_default().
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_step_args {
    /// sizeof(graphed_step_args); set by the _default() function.
    pub struct_size: usize,
    /// GRAPHED_STEP_ARGS_MAGIC; set by the _default() function.
    pub magic: u32,
    /// The step, as graphed_session_add_step returned it.
    pub step: u32,
    /// The caller's stream; the step is ordered on it (not capturing).
    pub stream: graphed_stream,
    /// sizeof(graphed_ref); set by the _default() function.
    pub ref_size: usize,
    /// The current addresses of the parameters of the step's callables, in
    /// order (graphed_step_param_count of them; a NULL entry: where the
    /// last step replay had it); NULL array: all where the last step
    /// replay had them (at first, where they were registered). The step's
    /// graph follows moved parameters that capture verified in it
    /// (GRAPHED_PARAM_FLAGS_REBIND) with one launch; a parameter only its
    /// callable's own graphs can follow (say, one tied to another
    /// callable's) makes the step replay pass by pass, each forward moving
    /// it; one that nothing can follow is GRAPHED_STATUS_PARAM_MOVED, before
    /// anything is enqueued.
    pub params: *const *const c_void,
    pub num_params: usize,
    /// How many microbatches this replay runs: 0 (default) all the step
    /// was declared with; a step declared with GRAPHED_STEP_LOOP_WHILE
    /// takes any count from 1 to that (its io regions hold no more), an
    /// unrolled step only its own. Others are
    /// GRAPHED_STATUS_INVALID_ARGUMENT, before anything is enqueued.
    pub microbatches: u32,
    /// New values for the step's scalar block (graphed_step_desc
    /// .scalar_bytes), copied in before its graph runs, in stream order:
    /// host memory, read before the call returns. `scalar_bytes` must be
    /// the block's whole size. NULL with 0 (default): the block keeps what
    /// it holds (the last values given, or what the update wrote there).
    /// Scalars for a step without a block, or another size, are
    /// GRAPHED_STATUS_INVALID_ARGUMENT, before anything is enqueued.
    pub scalars: *const c_void,
    pub scalar_bytes: usize,
}

// SAFETY: repr(C), integers and pointers only, header at offsets 0 and 8.
unsafe impl CStruct for graphed_step_args {
    const NAME: &'static str = "graphed_step_args";
    const MAGIC: u32 = GRAPHED_STEP_ARGS_MAGIC;
    const MIN_SIZE: usize = 32;
    fn defaults() -> Self {
        graphed_step_args_default()
    }
}
assert_header!(graphed_step_args);

/// Step replay arguments for step 0 on the default stream.
#[no_mangle]
pub extern "C" fn graphed_step_args_default() -> graphed_step_args {
    graphed_step_args {
        struct_size: size_of::<graphed_step_args>(),
        magic: GRAPHED_STEP_ARGS_MAGIC,
        step: 0,
        stream: std::ptr::null_mut(),
        ref_size: size_of::<graphed_ref>(),
        params: std::ptr::null(),
        num_params: 0,
        microbatches: 0,
        scalars: std::ptr::null(),
        scalar_bytes: 0,
    }
}

/// Replays a step with one graph launch on args->stream. The step's
/// callables read what their static buffers hold: fill the first inputs
/// (graphed_session_buffers) or chain them, or declare the step's io
/// copies (graphed_step_desc.io), which its graph makes itself. Writes
/// one ref per parameter of the step's callables, in order, to
/// `param_grads` (`num_param_grads` must be their total): per policy, as
/// graphed_backward does. CLONE grads come from a clone slot free in every
/// callable; when none is, the step replays pass by pass (same results,
/// one launch per pass), except a step over microbatches, with io copies
/// or looping on the device: GRAPHED_STATUS_ALIAS_HELD, and a moved
/// parameter its graph cannot follow is GRAPHED_STATUS_PARAM_MOVED.
///
/// A refused step replay changes nothing: its graphs are not pointed at
/// the addresses it was given, no move is counted, and a later replay
/// given no address (args->params NULL, or a NULL entry) reads the
/// parameters where the last successful one had them. Where several
/// refusals apply, the first of these answers: the session handle and
/// args; BUSY; the step, the refs array, then the pointer and count of
/// args->params and of args->scalars; the session's state (not captured,
/// reset) and a released callable of the step; the microbatch count; the
/// scalars' size against the step's scalar block; the stream
/// (capturing); strict leases; the parameters' addresses (their count,
/// then moves neither the step's graphs nor its callables' can follow);
/// the order of sessions sharing a pool; and, with every clone slot held,
/// a step that cannot replay pass by pass (ALIAS_HELD).
///
/// # Safety
/// `args` must point to a graphed_step_args initialised by its _default()
/// function; `param_grads` must have room for `num_param_grads` refs of
/// args->ref_size bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_step_replay(
    session: *mut graphed_session,
    args: *const graphed_step_args,
    param_grads: *mut graphed_ref,
    num_param_grads: usize,
) -> graphed_status {
    boundary("graphed_step_replay", || {
        let cell = self::session(session)?;
        // SAFETY: per this function's contract.
        let a = unsafe { read_struct(args, "args") }?;
        let mut s = cell.lock()?;
        let n = s.step_params(a.step)?;
        let out = check_out(param_grads, num_param_grads, n, a.ref_size, "param_grads")?;
        let params = ptrs(a.params, a.num_params, "args.params")?;
        let scalars = match a.scalars.is_null() && a.scalar_bytes == 0 {
            true => None,
            // SAFETY: per this function's contract.
            false => {
                Some(unsafe { arg_slice(a.scalars.cast::<u8>(), a.scalar_bytes, "args.scalars") }?)
            }
        };
        let call = StepCall {
            step: a.step,
            stream: StreamRef(a.stream as usize),
            params,
            microbatches: a.microbatches,
            scalars,
        };
        let mut r = s.step(&call)?;
        let owners = publish(&mut r);
        write_refs(&out, a.ref_size, r.second, &owners);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_released_layouts_are_todays() {
        // Since the first release: copies in and out, microbatches, loop.
        // Then the capture hook and its data.
        // Then the update stage and its scalar block.
        // Then the collective stage, its exchange and ranks.
        assert_eq!(
            size_of::<graphed_step_desc>(),
            graphed_step_desc::MIN_SIZE + 24 + 16 + 32 + 48
        );
        assert_eq!(
            GRAPHED_STEP_MAX_SCALAR_BYTES,
            crate::orchestrate::steps::MAX_SCALAR_BYTES
        );
        assert_eq!(size_of::<graphed_step_io>(), graphed_step_io::MIN_SIZE);
        assert_eq!(
            GRAPHED_STEP_MAX_MICROBATCHES,
            crate::orchestrate::steps::MAX_MICROBATCHES
        );
        // Since the first release: the parameters' addresses.
        // Then the microbatch count.
        // Then the scalars.
        assert_eq!(
            size_of::<graphed_step_args>(),
            graphed_step_args::MIN_SIZE + 24 + 16
        );
    }
}
