//! A step's collective stage: the callback a step calls under capture to
//! record its collectives into its graph (graphed_step_desc.collective,
//! collective_at), what it receives, the export it declares each
//! collective with (its manifest), the caller's all-gather that compares
//! the ranks' manifests (collective_exchange), and the manifest's query.

use super::args::{arg_out, check_out_array, write_element};
use super::boundary::boundary;
use super::callback::{clear_failure, graphed_stream, take_failure};
use super::config::SendPtr;
use super::enums::{graphed_collective_at, graphed_collective_op, graphed_dtype};
use super::handles::graphed_session;
use super::session::session;
use super::status::graphed_status;
use crate::core::collective::{CollectiveEntry, CollectivePoint};
use crate::error::{Error, Result};
use crate::orchestrate::spec::{CollectiveRecord, CollectiveSpec, CollectiveView};
use std::cell::RefCell;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

/// graphed_collective_ctx.callable and graphed_collective_entry.callable:
/// the collectives recorded once after the last microbatch's backward,
/// with every callable's grads.
pub const GRAPHED_COLLECTIVE_ALL_CALLABLES: u32 = u32::MAX;

/// What a step's collective callback receives. Every array and pointer is
/// valid during the call only; the device memory they point to is valid
/// while the session's graphs exist.
///
/// The callback is called only under stream capture (never eagerly, so
/// warmup runs no collective), on the capturing stream, once per point in
/// each capture of the step's graph (one graph, or one per clone slot:
/// `slot` says which), after the grads it is given are summed over every
/// microbatch and before the step's update stage (so that a check sees
/// reduced grads); never inside a conditional node: a step looping on the
/// device (GRAPHED_STEP_LOOP_WHILE) runs its last microbatch after the
/// loop, and the collectives there. It enqueues its collectives on
/// `stream` (ncclAllReduce in place on `grads`, say) and declares each
/// with graphed_collective_record(ctx, ...), in the order it enqueues
/// them: the step's manifest, compared across ranks at the end of the
/// capture (graphed_step_desc.collective_exchange).
///
/// It may not synchronize, allocate device memory, call back into its own
/// session (GRAPHED_STATUS_BUSY), nor fork work to other streams that it
/// does not join back before it returns.
#[repr(C)]
pub struct graphed_collective_ctx {
    /// sizeof(graphed_collective_ctx) as the library was built.
    pub struct_size: usize,
    /// The step, as graphed_session_add_step returned it.
    pub step: u32,
    /// The session's index of the callable whose grads are ready
    /// (GRAPHED_COLLECTIVE_AT_PER_CALLABLE), or GRAPHED_COLLECTIVE_ALL_CALLABLES
    /// (GRAPHED_COLLECTIVE_AT_AFTER_BACKWARD: every callable of the step).
    pub callable: u32,
    /// Enqueue all work here (a CUstream being captured on CUDA, a host
    /// stream on the host backend).
    pub stream: graphed_stream,
    /// The clone slot whose graph is captured (0 without CLONE grads).
    pub slot: u32,
    /// The parameters (of `callable`, or of every callable of the step in
    /// order) where the step's graph reads them.
    pub num_params: usize,
    pub params: *const *mut c_void,
    /// [num_params] where each parameter's grad is, summed over the
    /// microbatches, in this graph (as graphed_update_ctx.grads says);
    /// NULL for a parameter without a grad.
    pub grads: *const *mut c_void,
    /// [num_params] each parameter's bytes.
    pub bytes: *const usize,
    /// [num_params] each parameter's graphed_dtype.
    pub dtypes: *const u32,
}

/// A step's collective callback (graphed_step_desc.collective). Return 0
/// on success; any other value fails the capture with
/// GRAPHED_STATUS_CALLBACK_FAILED, naming the step, the point and the
/// value (and what graphed_callback_fail_message said).
pub type graphed_collective_fn =
    Option<unsafe extern "C" fn(ctx: *const graphed_collective_ctx, user_data: *mut c_void) -> i32>;

/// The caller's all-gather of the ranks' manifests
/// (graphed_step_desc.collective_exchange): every rank gives `bytes`
/// bytes at `mine` (the same count on every rank) and receives every
/// rank's at `all` (bytes * collective_ranks bytes, rank r's at r *
/// bytes), over a channel of its own (a gloo or MPI all-gather, or an
/// NCCL one on a stream it synchronizes; not recorded in any graph).
/// Called at the end of each capture of the step on every rank, twice: the
/// headers, then the padded manifests (once, the headers alone, where a
/// rank's capture failed or no rank records a collective: every rank reads
/// the same headers and decides alike). Return 0 on success; any other
/// value fails the capture with GRAPHED_STATUS_CALLBACK_FAILED.
pub type graphed_collective_exchange_fn = Option<
    unsafe extern "C" fn(
        mine: *const c_void,
        bytes: usize,
        all: *mut c_void,
        user_data: *mut c_void,
    ) -> i32,
>;

type CollectiveFnPtr = unsafe extern "C" fn(*const graphed_collective_ctx, *mut c_void) -> i32;
type ExchangeFnPtr = unsafe extern "C" fn(*const c_void, usize, *mut c_void, *mut c_void) -> i32;

thread_local! {
    /// The context of the collective callback running on this thread and
    /// what it declared so far.
    static RECORDING: RefCell<Option<(usize, Vec<CollectiveRecord>)>> =
        const { RefCell::new(None) };
}

/// The step descriptor's collective fields.
pub(super) struct CollectiveFields {
    pub callback: graphed_collective_fn,
    pub data: *mut c_void,
    pub at: u32,
    pub exchange: graphed_collective_exchange_fn,
    pub exchange_data: *mut c_void,
    pub rank: u32,
    pub ranks: u32,
}

/// A step's collective stage from the descriptor's fields; None for a
/// step without one. Data, an exchange or ranks without a callback are
/// refused.
pub(super) fn collective_of(f: CollectiveFields) -> Result<Option<CollectiveSpec>> {
    let at = graphed_collective_at::decode(f.at, "desc.collective_at")?;
    let Some(callback) = f.callback else {
        let stray = [
            (!f.data.is_null(), "collective_data"),
            (f.exchange.is_some(), "collective_exchange"),
            (!f.exchange_data.is_null(), "collective_exchange_data"),
            (
                f.rank != 0 || f.ranks != 1,
                "collective_rank or collective_ranks",
            ),
        ];
        if let Some((_, what)) = stray.iter().find(|(set, _)| *set) {
            return Err(Error::invalid(format!(
                "desc.{what} is set but desc.collective is NULL: set the callback, or neither"
            )));
        }
        return Ok(None);
    };
    if f.exchange.is_none() && !f.exchange_data.is_null() {
        return Err(Error::invalid(
            "desc.collective_exchange_data is set but desc.collective_exchange is NULL",
        ));
    }
    let data = SendPtr(f.data);
    let call = move |v: &CollectiveView| call_collective(callback, v, data.get());
    let exchange = f.exchange.map(|x| {
        let data = SendPtr(f.exchange_data);
        let gather = move |mine: &[u8], all: &mut [u8]| call_exchange(x, mine, all, data.get());
        Arc::new(gather) as crate::orchestrate::spec::ExchangeFn
    });
    Ok(Some(CollectiveSpec {
        callback: Arc::new(call),
        at,
        exchange,
        rank: f.rank,
        ranks: f.ranks,
    }))
}

/// Calls `f` with the context of `v`; what it declares with
/// graphed_collective_record meanwhile.
fn call_collective(
    f: CollectiveFnPtr,
    v: &CollectiveView,
    data: *mut c_void,
) -> std::result::Result<Vec<CollectiveRecord>, (i32, String)> {
    clear_failure();
    let dtypes: Vec<u32> = v.dtypes.iter().map(|&d| graphed_dtype::encode(d)).collect();
    let ctx = graphed_collective_ctx {
        struct_size: size_of::<graphed_collective_ctx>(),
        step: v.step,
        callable: v.callable.unwrap_or(GRAPHED_COLLECTIVE_ALL_CALLABLES),
        stream: v.stream.0 as graphed_stream,
        slot: v.slot,
        num_params: v.params.len(),
        params: v.params.as_ptr().cast(),
        grads: v.grads.as_ptr().cast(),
        bytes: v.bytes.as_ptr(),
        dtypes: dtypes.as_ptr(),
    };
    let at = &ctx as *const graphed_collective_ctx as usize;
    let before = RECORDING.with(|r| r.borrow_mut().replace((at, Vec::new())));
    // SAFETY: the caller registered `f` for this purpose; `ctx` and the
    // arrays it points to outlive the call.
    let code = unsafe { f(&ctx, data) };
    let recorded = RECORDING.with(|r| std::mem::replace(&mut *r.borrow_mut(), before));
    match code {
        0 => Ok(recorded.map(|(_, v)| v).unwrap_or_default()),
        code => Err((code, take_failure())),
    }
}

/// Calls the caller's all-gather.
fn call_exchange(
    f: ExchangeFnPtr,
    mine: &[u8],
    all: &mut [u8],
    data: *mut c_void,
) -> std::result::Result<(), (i32, String)> {
    clear_failure();
    // SAFETY: the caller registered `f` for this purpose; `all` has room
    // for every rank's `mine.len()` bytes, as the step's ranks say.
    let code = unsafe {
        f(
            mine.as_ptr().cast(),
            mine.len(),
            all.as_mut_ptr().cast(),
            data,
        )
    };
    match code {
        0 => Ok(()),
        code => Err((code, take_failure())),
    }
}

/// Declares one collective that a step's collective callback records
/// (enqueues on ctx->stream), in order: the communicator (any id of the
/// caller's that names the same group on every rank, such as a hash of
/// its ncclUniqueId, or a small index), a graphed_collective_op, the bytes
/// each rank gives it and their graphed_dtype. The library keeps the
/// step's ordered list (graphed_step_collectives) and compares it across
/// ranks at the end of the capture.
///
/// Checks: `ctx` NULL (GRAPHED_STATUS_NULL_POINTER); called outside a
/// collective callback, or with another ctx than the running callback's
/// (GRAPHED_STATUS_WRONG_STATE); an unknown op or dtype
/// (GRAPHED_STATUS_INVALID_ARGUMENT). A refusal declares nothing.
///
/// # Safety
/// `ctx` must be NULL or the pointer the running collective callback was
/// given (it is compared, not read).
#[no_mangle]
pub unsafe extern "C" fn graphed_collective_record(
    ctx: *const graphed_collective_ctx,
    communicator: u64,
    op: u32,
    bytes: u64,
    dtype: u32,
) -> graphed_status {
    boundary("graphed_collective_record", || {
        if ctx.is_null() {
            return Err(Error::NullPointer { what: "ctx" });
        }
        let op = graphed_collective_op::decode(op, "op")?;
        let dtype = graphed_dtype::decode(dtype, "dtype")?;
        RECORDING.with(|r| match &mut *r.borrow_mut() {
            Some((at, v)) if *at == ctx as usize => {
                v.push(CollectiveRecord {
                    communicator,
                    op,
                    bytes,
                    dtype,
                });
                Ok(())
            }
            Some(_) => Err(Error::state(
                "graphed_collective_record was given another ctx than the running collective \
                 callback's",
            )),
            None => Err(Error::state(
                "graphed_collective_record is called only from a step's collective callback \
                 (graphed_step_desc.collective), with the ctx it was given",
            )),
        })
    })
}

/// One collective of a step's manifest (graphed_step_collectives).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct graphed_collective_entry {
    /// As graphed_collective_record was given them.
    pub communicator: u64,
    pub bytes: u64,
    /// A graphed_collective_op value.
    pub op: u32,
    /// A graphed_dtype value.
    pub dtype: u32,
    /// The session's index of the callable after whose backward it was
    /// recorded (GRAPHED_COLLECTIVE_AT_PER_CALLABLE), or
    /// GRAPHED_COLLECTIVE_ALL_CALLABLES (after the whole backward).
    pub callable: u32,
    /// Zero.
    pub reserved: u32,
}

impl From<&CollectiveEntry> for graphed_collective_entry {
    fn from(e: &CollectiveEntry) -> Self {
        graphed_collective_entry {
            communicator: e.communicator,
            bytes: e.bytes,
            op: graphed_collective_op::encode(e.op),
            dtype: graphed_dtype::encode(e.dtype),
            callable: match e.point {
                CollectivePoint::AfterBackward => GRAPHED_COLLECTIVE_ALL_CALLABLES,
                CollectivePoint::Callable(c) => c,
            },
            reserved: 0,
        }
    }
}

/// The manifest of a captured step with a collective stage: writes its
/// entries, in the order its graph records them, to `entries` (at most
/// `capacity`, each `entry_size` bytes: sizeof(graphed_collective_entry))
/// and their total to `*count_out` (call with `capacity` 0 to learn it).
/// Kept whether or not the step compared it across ranks (without
/// graphed_step_desc.collective_exchange it is not compared).
///
/// Checks, in this order: the session; `count_out` NULL
/// (GRAPHED_STATUS_NULL_POINTER); `entries` NULL with `capacity` above 0
/// (NULL_POINTER), misaligned or `entry_size` too small
/// (INVALID_ARGUMENT); BUSY; not captured (WRONG_STATE) or reset
/// (SESSION_RESET); a step that does not exist or has no collective stage
/// (INVALID_ARGUMENT). A refusal writes nothing.
///
/// # Safety
/// `entries` must have room for `capacity` elements of `entry_size`
/// bytes; `count_out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_step_collectives(
    session: *mut graphed_session,
    step: u32,
    entries: *mut graphed_collective_entry,
    capacity: usize,
    entry_size: usize,
    count_out: *mut usize,
) -> graphed_status {
    boundary("graphed_step_collectives", || {
        let s = self::session(session)?;
        let out = arg_out(count_out, "count_out")?;
        let min = size_of::<graphed_collective_entry>();
        check_out_array(entries, capacity, entry_size, min, "entries")?;
        let manifest = s.lock()?.step_collectives(step)?;
        for (i, e) in manifest.iter().take(capacity).enumerate() {
            // SAFETY: checked for `capacity` elements of `entry_size`.
            unsafe { write_element(entries, entry_size, i, &e.into()) };
        }
        // SAFETY: checked non-NULL and aligned; written only on success.
        unsafe { out.write(manifest.len()) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    unsafe extern "C" fn nothing(_: *const graphed_collective_ctx, _: *mut c_void) -> i32 {
        0
    }

    fn fields() -> CollectiveFields {
        CollectiveFields {
            callback: None,
            data: std::ptr::null_mut(),
            at: 0,
            exchange: None,
            exchange_data: std::ptr::null_mut(),
            rank: 0,
            ranks: 1,
        }
    }

    #[test]
    fn data_without_a_callback_and_bad_points_are_refused() {
        assert!(collective_of(fields()).unwrap().is_none());
        let mut f = fields();
        f.data = 8 as *mut c_void;
        let e = collective_of(f).err().unwrap().to_string();
        assert!(
            e.contains("desc.collective_data is set but desc.collective is NULL"),
            "{e}"
        );
        let mut f = fields();
        f.ranks = 2;
        let e = collective_of(f).err().unwrap().to_string();
        assert!(e.contains("collective_rank or collective_ranks"), "{e}");
        let mut f = fields();
        f.callback = Some(nothing);
        f.at = 7;
        let e = collective_of(f).err().unwrap().to_string();
        assert!(e.contains("desc.collective_at: 7 is not"), "{e}");
    }

    #[test]
    fn recording_outside_a_callback_is_refused() {
        let ctx = 16 as *const graphed_collective_ctx;
        // SAFETY: the pointer is compared, never read.
        let st = unsafe { graphed_collective_record(ctx, 1, 0, 4, 0) };
        assert_eq!(st, graphed_status::WrongState);
    }
}
