//! Replays and what they return: the replay arguments, the refs written
//! back (outputs, input grads, parameter grads), and strict-mode lease
//! release. The arrays of refs are written only when the whole replay was
//! enqueued.

use super::args::{arg_slice, assert_header, check_out_array, read_struct, write_element, CStruct};
use super::boundary::boundary;
use super::callback::graphed_stream;
use super::enums::graphed_ref_kind;
use super::handles::{graphed_buffer, graphed_session, ptr};
use super::session::session;
use super::status::graphed_status;
use crate::backend::{DevPtr, StreamRef};
use crate::core::handle::{self, Kind};
use crate::error::{Error, Result};
use crate::orchestrate::{RefKind, ReplayArgs, Replayed, Returned, Session};
use std::ffi::c_void;
use std::mem::size_of;

// Device pointers cross the ABI as `void*` and live inside as u64.
const _: () = assert!(size_of::<*const c_void>() == size_of::<DevPtr>());

/// The magic graphed_replay_args_default() sets.
pub const GRAPHED_REPLAY_ARGS_MAGIC: u32 = 0x6772_0005;

/// Arguments of a replay call. Initialise with graphed_replay_args_default().
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_replay_args {
    /// sizeof(graphed_replay_args); set by the _default() function.
    pub struct_size: usize,
    /// GRAPHED_REPLAY_ARGS_MAGIC; set by the _default() function.
    pub magic: u32,
    pub callable: u32,
    /// 0 unless the session has a pipeline schedule.
    pub microbatch: u32,
    /// The caller's stream; the replay is ordered on it. It must not be
    /// capturing a graph (GRAPHED_STATUS_STREAM_CAPTURING).
    pub stream: graphed_stream,
    /// Optional: launch there instead, synced with `stream` by events.
    pub side_stream: graphed_stream,
    /// New data to copy into the static inputs (forward) or grad-outputs
    /// (backward), one device pointer per input/output; an entry equal to
    /// the static buffer is not copied. NULL array: replay on what the
    /// static buffers hold.
    pub data: *const *const c_void,
    pub num_data: usize,
    /// Destinations of COPY_INTO and ACCUMULATE_INTO parameter slots, one
    /// per parameter (NULL entries for other slots); NULL array when the
    /// callable has no such slot. ACCUMULATE_INTO destinations are aligned
    /// to their element size.
    pub param_dsts: *const *mut c_void,
    pub num_param_dsts: usize,
    /// The element size of the graphed_ref arrays the call writes:
    /// sizeof(graphed_ref); set by the _default() function.
    pub ref_size: usize,
    /// The parameters' current addresses, one per parameter (a NULL entry:
    /// where the graphs read it now); NULL array: every parameter where
    /// the graphs read it now (at first, where it was registered). A
    /// forward replay points the instance's graphs (forward, backward,
    /// weight-grad, clone slots) at a parameter's new address when capture
    /// verified it can (GRAPHED_PARAM_FLAGS_REBIND; the address aligned at
    /// least as the registered one, up to 256 bytes), and refuses the
    /// replay with GRAPHED_STATUS_PARAM_MOVED otherwise. Backward and
    /// weight-grad replays read the parameters where their forward did:
    /// other addresses there are GRAPHED_STATUS_INVALID_ARGUMENT, except
    /// after a forward that chose its bucket on the device (device_size),
    /// whose backward and weight-grad replays read every parameter where
    /// capture did: another address there is GRAPHED_STATUS_PARAM_MOVED.
    pub params: *const *const c_void,
    pub num_params: usize,
    /// Callables with buckets (graphed_callable_desc.bucket_sizes): the
    /// actual size of the dynamic dimension, 1 to the largest bucket. A
    /// forward must give it: the smallest bucket that holds it runs, the
    /// DYNAMIC inputs' first `size` rows are copied in and the rest of the
    /// bucket zeroed, and the DYNAMIC outputs come back as their first
    /// `size` rows. Backward and weight-grad replays run the bucket of the
    /// callable's last forward (0 here, or that forward's size). 0 for
    /// callables without buckets.
    pub size: u64,
    /// Callables with buckets, in a session created with
    /// bucket_choice_on_device, instead of `size` (which is then 0):
    /// device memory holding the actual size as a uint64_t, read when the
    /// forward runs (a router's token count): the bucket is chosen on the
    /// device, with no host synchronisation. The data of the DYNAMIC
    /// inputs must then hold the largest bucket's rows (all are copied; the
    /// device zeroes the rows past the size), and the DYNAMIC outputs come
    /// back with the largest bucket's bytes, their first `*device_size`
    /// rows the result. Its backward and weight-grad replays (size 0, no
    /// device_size) run the same bucket; their grad-outputs likewise hold
    /// the largest bucket's rows. The device cannot refuse a size above the
    /// largest bucket: such a pass (the forward, and its backward and
    /// weight-grad, which read the same size) runs none of the callable's
    /// bucket graphs and writes zeros where it writes its results instead:
    /// the outputs (forward), the input grads (backward) and the parameter
    /// grads (the pass that writes them), whole, so that CLONE grads are
    /// zeros, COPY_INTO destinations get zeros and ACCUMULATE_INTO
    /// destinations get zeros added. Each such pass is counted in
    /// graphed_session_stats.bucket_overflows. Parameters are read where
    /// they were captured: another address given to such a forward, or to
    /// the backward and weight-grad replays after it, is
    /// GRAPHED_STATUS_PARAM_MOVED. NULL: the host chooses (`size`).
    pub device_size: *const u64,
    /// Callables with a grid of buckets (graphed_callable_desc.
    /// bucket_sizes2): the actual second size, 1 to the largest second
    /// size, given with `size` by a forward (0 or that forward's by its
    /// backward and weight-grad). 0 for other callables.
    pub size2: u64,
}

// SAFETY: repr(C), integers and pointers only, header at offsets 0 and 8.
unsafe impl CStruct for graphed_replay_args {
    const NAME: &'static str = "graphed_replay_args";
    const MAGIC: u32 = GRAPHED_REPLAY_ARGS_MAGIC;
    const MIN_SIZE: usize = 80;
    fn defaults() -> Self {
        graphed_replay_args_default()
    }
}
assert_header!(graphed_replay_args);

/// Replay arguments for callable 0, microbatch 0, the default stream, no
/// data (replay on the static buffers) and no destinations.
#[no_mangle]
pub extern "C" fn graphed_replay_args_default() -> graphed_replay_args {
    graphed_replay_args {
        struct_size: size_of::<graphed_replay_args>(),
        magic: GRAPHED_REPLAY_ARGS_MAGIC,
        callable: 0,
        microbatch: 0,
        stream: std::ptr::null_mut(),
        side_stream: std::ptr::null_mut(),
        data: std::ptr::null(),
        num_data: 0,
        param_dsts: std::ptr::null(),
        num_param_dsts: 0,
        ref_size: size_of::<graphed_ref>(),
        params: std::ptr::null(),
        num_params: 0,
        size: 0,
        device_size: std::ptr::null(),
        size2: 0,
    }
}

/// One output or gradient handed back by a replay.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_ref {
    /// Device pointer (NULL when kind is GRAPHED_REF_KIND_NONE).
    pub ptr: *mut c_void,
    pub bytes: usize,
    /// A graphed_ref_kind value.
    pub kind: u32,
    /// CLONE: one reference to the block holding the clone; release it
    /// with graphed_buffer_release. NULL otherwise.
    pub owner: *mut graphed_buffer,
    /// ALIAS under strict leases: release with graphed_lease_release when
    /// done with the alias. 0 otherwise.
    pub lease: u64,
    /// How the `bytes` at `ptr` lie: `rows` blocks of `row_bytes` bytes,
    /// block i at `ptr + i * pitch`. Contiguous data (every ref but the
    /// DYNAMIC outputs and input grads of a bucket whose tensors vary on
    /// another dimension than the first) is one block: `rows` 1,
    /// `row_bytes` and `pitch` equal to `bytes`. Such a tensor of a
    /// [B, T, H] bucket run on t <= T positions is B blocks of t * H
    /// elements every T * H. Written when `ref_size` holds them: a
    /// replay whose refs would be blocks of a pitch is refused when it
    /// does not (a caller built against an older header).
    pub rows: usize,
    pub row_bytes: usize,
    pub pitch: usize,
}

/// The size of the first released layout of graphed_ref.
const REF_MIN: usize = 40;
/// The size of graphed_ref with the layout of its data (rows, row_bytes,
/// pitch).
const REF_ROWS: usize = 64;
const _: () = assert!(size_of::<graphed_ref>() >= REF_ROWS);
const _: () = assert!(size_of::<graphed_ref>() >= REF_MIN);

pub(crate) fn ptrs<'a>(
    p: *const *const c_void,
    n: usize,
    what: &'static str,
) -> Result<Option<&'a [DevPtr]>> {
    if p.is_null() {
        if n != 0 {
            return Err(Error::invalid(format!(
                "{what} is NULL but its count is {n}"
            )));
        }
        return Ok(None);
    }
    // SAFETY: the caller passes `n` readable pointers; u64 and pointers have
    // the same size and alignment (asserted above).
    Ok(Some(unsafe { arg_slice(p as *const DevPtr, n, what) }?))
}

fn replay_args(a: &graphed_replay_args) -> Result<ReplayArgs<'_>> {
    Ok(ReplayArgs {
        callable: a.callable,
        microbatch: a.microbatch,
        stream: StreamRef(a.stream as usize),
        side_stream: (!a.side_stream.is_null()).then_some(StreamRef(a.side_stream as usize)),
        data: ptrs(a.data, a.num_data, "args.data")?,
        param_dsts: ptrs(a.param_dsts.cast(), a.num_param_dsts, "args.param_dsts")?,
        params: ptrs(a.params, a.num_params, "args.params")?,
        size: a.size,
        size2: a.size2,
        device_size: a.device_size as DevPtr,
    })
}

/// An output array of refs, checked before the replay runs.
pub(crate) struct Out {
    p: *mut graphed_ref,
    n: usize,
}

pub(crate) fn check_out(
    p: *mut graphed_ref,
    n: usize,
    expected: usize,
    stride: usize,
    what: &'static str,
) -> Result<Out> {
    if n != expected {
        return Err(Error::invalid(format!(
            "{what} has room for {n} refs; the callable has {expected}"
        )));
    }
    check_out_array(p, n, stride, REF_MIN, what)?;
    Ok(Out { p, n })
}

/// The handles of a replay's clone blocks, by block index.
pub(crate) enum Owners {
    None,
    One(u64),
    Many(Vec<u64>),
}

impl Owners {
    fn get(&self, i: u32) -> u64 {
        match self {
            Owners::None => 0,
            Owners::One(id) => *id,
            Owners::Many(ids) => ids.get(i as usize).copied().unwrap_or(0),
        }
    }
}

/// Registers a replay's clone blocks as handles, each holding one
/// reference per CLONE ref in it. A single block (every per-pass replay)
/// needs no allocation.
pub(crate) fn publish(r: &mut Replayed) -> Owners {
    let refs = |b: usize| {
        r.second
            .iter()
            .filter(|x| x.kind == RefKind::Clone && x.block as usize == b)
            .count()
            .max(1)
    };
    match r.blocks.len() {
        0 => Owners::None,
        1 => {
            let n = refs(0);
            Owners::One(handle::insert(Kind::Buffer, r.blocks.remove(0), n))
        }
        _ => {
            let counts: Vec<usize> = (0..r.blocks.len()).map(refs).collect();
            Owners::Many(
                r.blocks
                    .drain(..)
                    .zip(counts)
                    .map(|(b, n)| handle::insert(Kind::Buffer, b, n))
                    .collect(),
            )
        }
    }
}

/// Writes the refs of a replay; CLONE refs name their block's handle.
pub(crate) fn write_refs(out: &Out, stride: usize, refs: &[Returned], owners: &Owners) {
    for (i, r) in refs.iter().take(out.n).enumerate() {
        let c = graphed_ref {
            ptr: r.ptr as *mut c_void,
            bytes: r.bytes,
            kind: graphed_ref_kind::encode(r.kind),
            owner: if r.kind == RefKind::Clone {
                ptr(owners.get(r.block))
            } else {
                std::ptr::null_mut()
            },
            lease: r.lease,
            rows: r.rows.max(1),
            row_bytes: match r.rows {
                0 => r.bytes,
                n => r.bytes / n,
            },
            pitch: match r.rows {
                0 => r.bytes,
                _ => r.pitch,
            },
        };
        // SAFETY: check_out verified the array (non-NULL, `n` elements of
        // `stride` bytes, aligned), and i < n.
        unsafe { write_element(out.p, stride, i, &c) };
    }
}

/// Runs one replay on a pinned, locked session: `arity` picks the expected
/// sizes of the two output arrays from (inputs, params, outputs).
fn replay(
    func: &'static str,
    session_p: *mut graphed_session,
    args: *const graphed_replay_args,
    first: (*mut graphed_ref, usize, &'static str),
    second: (*mut graphed_ref, usize, &'static str),
    arity: fn((usize, usize, usize)) -> (usize, usize),
    run: for<'s> fn(&'s mut Session, &ReplayArgs) -> Result<Replayed<'s>>,
) -> graphed_status {
    boundary(func, || {
        let cell = session(session_p)?;
        // SAFETY: `args` is NULL or a caller struct per the export's contract.
        let a = unsafe { read_struct(args, "args") }?;
        let ra = replay_args(&a)?;
        let mut s = cell.lock()?;
        let (n1, n2) = arity(s.arity(a.callable)?);
        if a.ref_size < REF_ROWS && s.returns_rows(a.callable) {
            return Err(Error::invalid(format!(
                "callable {} returns DYNAMIC tensors that vary on another dimension than their first, as \
                 rows of a pitch (graphed_ref.rows, row_bytes, pitch), and args.ref_size ({}) has no room \
                 for them: build against this header (ref_size = sizeof(graphed_ref), {})",
                a.callable,
                a.ref_size,
                size_of::<graphed_ref>()
            )));
        }
        let o1 = check_out(first.0, first.1, n1, a.ref_size, first.2)?;
        let o2 = check_out(second.0, second.1, n2, a.ref_size, second.2)?;
        let mut r = run(&mut s, &ra)?;
        let owners = publish(&mut r);
        write_refs(&o1, a.ref_size, r.first, &owners);
        write_refs(&o2, a.ref_size, r.second, &owners);
        Ok(())
    })
}

/// Replays the forward graph of (args->callable, args->microbatch) on
/// args->stream, after copying args->data into the static inputs. Writes
/// one GRAPHED_REF_KIND_ALIAS ref per output to `outputs`
/// (`num_outputs` must equal the callable's output count): the static
/// outputs, valid until the next forward replay of the same instance.
///
/// A refused replay changes nothing: every refusal comes before anything
/// is enqueued, a parameter is pointed elsewhere or a move counted. Where
/// several apply, this one (as graphed_backward and
/// graphed_backward_wgrad) answers the first of: the arguments as read
/// (the session handle, args, its arrays' pointers and counts); BUSY; the
/// callable and the output arrays' counts; the session's state (not
/// captured, reset) and a released callable; the microbatch, then the
/// size (buckets: args.size, args.device_size, a chained input's rows);
/// after the device's choice, the parameters' addresses; then the data,
/// the weight-grad callback, the destinations, the parameters' addresses,
/// the streams (capturing), strict leases, the order of sessions sharing
/// a pool, and last the parameters of the callable's other buckets.
///
/// # Safety
/// `args` must point to a graphed_replay_args initialised by its
/// _default() function; `outputs` must have room for `num_outputs` refs of
/// args->ref_size bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_forward(
    session: *mut graphed_session,
    args: *const graphed_replay_args,
    outputs: *mut graphed_ref,
    num_outputs: usize,
) -> graphed_status {
    replay(
        "graphed_forward",
        session,
        args,
        (outputs, num_outputs, "outputs"),
        (std::ptr::null_mut(), 0, "(none)"),
        |(_, _, o)| (o, 0),
        |s, a| s.forward(a),
    )
}

/// Replays the backward graph of (args->callable, args->microbatch) after
/// copying args->data into the static grad-outputs. Writes one ref per
/// input to `input_grads` (ALIAS, valid until the next backward replay of
/// the instance; NONE for inputs without requires_grad) and one per
/// parameter to `param_grads`, each per its frozen policy: CLONE (an owned
/// copy: release `owner` with graphed_buffer_release), ALIAS, COPY_INTO or
/// ACCUMULATE_INTO (into args->param_dsts[i]), NONE (no grad, or a callable
/// with a weight-grad callback, whose grads graphed_backward_wgrad returns).
///
/// # Safety
/// As graphed_forward; the arrays must have room for the stated counts.
#[no_mangle]
pub unsafe extern "C" fn graphed_backward(
    session: *mut graphed_session,
    args: *const graphed_replay_args,
    input_grads: *mut graphed_ref,
    num_input_grads: usize,
    param_grads: *mut graphed_ref,
    num_param_grads: usize,
) -> graphed_status {
    replay(
        "graphed_backward",
        session,
        args,
        (input_grads, num_input_grads, "input_grads"),
        (param_grads, num_param_grads, "param_grads"),
        |(i, p, _)| (i, p),
        |s, a| s.backward(a),
    )
}

/// Replays the weight-grad graph of a callable registered with a wgrad
/// callback, and writes its parameter grads (per policy) to `param_grads`.
/// It takes no data: it reads the grad-outputs as the callable's last
/// backward replay left them (and, with buckets, runs its last forward's
/// bucket). Replay it after the backward of its forward: after a forward
/// of another size with no backward between, it reads the earlier
/// backward's grad-outputs, whose rows past the new size are that
/// backward's data, not zeros.
///
/// # Safety
/// As graphed_backward.
#[no_mangle]
pub unsafe extern "C" fn graphed_backward_wgrad(
    session: *mut graphed_session,
    args: *const graphed_replay_args,
    param_grads: *mut graphed_ref,
    num_param_grads: usize,
) -> graphed_status {
    replay(
        "graphed_backward_wgrad",
        session,
        args,
        (std::ptr::null_mut(), 0, "(none)"),
        (param_grads, num_param_grads, "param_grads"),
        |(_, p, _)| (0, p),
        |s, a| s.wgrad(a),
    )
}

/// Releases a strict-mode lease (the `lease` of an ALIAS ref): the alias
/// is no longer used, so the replay that overwrites it may run. Never
/// GRAPHED_STATUS_BUSY: it does not wait for calls in progress on the
/// session, so it is safe from any thread (a tensor's deleter) at any time.
#[no_mangle]
pub extern "C" fn graphed_lease_release(
    session: *mut graphed_session,
    lease: u64,
) -> graphed_status {
    boundary("graphed_lease_release", || {
        self::session(session)?.leases.release(lease)
    })
}
