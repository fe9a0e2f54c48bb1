//! Pipeline schedule steps, and the helpers callers would otherwise
//! re-derive: Transformer Engine's `_order` notation to steps, a
//! schedule's shape (chunks, microbatches, the layers of each chunk), its
//! passes and, with buffer reuse, what each pass lets go of.

use super::args::{arg_out, arg_slice, check_out_array, write_element};
use super::boundary::boundary;
use super::enums::{decode_bool, graphed_buffer_role, graphed_pass};
use super::status::graphed_status;
use crate::core::release::Spans;
use crate::core::schedule::{
    chunk_layers, from_te_order, Schedule, ScheduleStep, Shape, MAX_PASSES,
};
use crate::error::{Error, Result};
use crate::orchestrate::ScheduleSpec;
use std::mem::size_of;

/// One step of a pipeline schedule. Arrays of steps are passed with their
/// element size (sizeof(graphed_schedule_step)), so the struct can grow.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct graphed_schedule_step {
    /// A graphed_pass value: FORWARD, BACKWARD or WGRAD.
    pub pass: u32,
    /// The model chunk, from 0.
    pub chunk: u32,
}

/// The size of the first released layout of graphed_schedule_step.
const STEP_MIN: usize = 8;
const _: () = assert!(size_of::<graphed_schedule_step>() >= STEP_MIN);

/// Reads `n` steps of `stride` bytes each (the caller's element size).
///
/// # Safety
/// When `n > 0`, `p` must point to `n` elements of `stride` bytes.
pub(crate) unsafe fn read_steps(
    p: *const graphed_schedule_step,
    n: usize,
    stride: usize,
    what: &'static str,
) -> Result<Vec<ScheduleStep>> {
    if stride < STEP_MIN || stride % std::mem::align_of::<graphed_schedule_step>() != 0 {
        return Err(Error::invalid(format!(
            "{what}: the step size is {stride} bytes; pass sizeof(graphed_schedule_step)"
        )));
    }
    // Viewed as u32 words: `stride / 4` words per step.
    let words = stride / 4;
    let total = n
        .checked_mul(words)
        .ok_or_else(|| Error::invalid(format!("{what}: {n} steps do not fit in memory")))?;
    // SAFETY: per this function's contract, `n * stride` bytes of u32-aligned steps.
    let raw = unsafe { arg_slice(p as *const u32, total, what) }?;
    (0..n)
        .map(|i| {
            let (pass, chunk) = (raw[i * words], raw[i * words + 1]);
            Ok(ScheduleStep {
                kind: graphed_pass::decode(pass, &format!("{what}[{i}].pass"))
                    .map_err(|e| Error::InvalidSchedule(e.to_string()))?,
                chunk,
            })
        })
        .collect()
}

/// How a caller's schedule fields are named in messages.
pub(crate) struct ScheduleFields {
    pub steps: &'static str,
    pub num_steps: &'static str,
    pub layers_per_chunk: &'static str,
    pub num_layers_per_chunk: &'static str,
}

impl ScheduleFields {
    /// graphed_session_config's fields.
    pub const CONFIG: ScheduleFields = ScheduleFields {
        steps: "config.schedule",
        num_steps: "config.num_schedule_steps",
        layers_per_chunk: "config.layers_per_chunk",
        num_layers_per_chunk: "config.num_layers_per_chunk",
    };
    /// graphed_schedule_passes's arguments.
    pub const ARGS: ScheduleFields = ScheduleFields {
        steps: "steps",
        num_steps: "num_steps",
        layers_per_chunk: "layers_per_chunk",
        num_layers_per_chunk: "num_layers_per_chunk",
    };
}

/// The schedule a caller passed, with its layers-per-chunk split; `None`
/// when it passed none (steps NULL with a count of 0). The session config
/// and graphed_schedule_passes both read theirs here, so both refuse the
/// same inputs: a count without its array, steps without a count, a split
/// without a schedule.
///
/// # Safety
/// `steps` holds `num_steps` elements of `step_size` bytes and
/// `layers_per_chunk` holds `num_layers_per_chunk` values, where non-NULL.
pub(crate) unsafe fn read_schedule(
    steps: *const graphed_schedule_step,
    num_steps: usize,
    step_size: usize,
    layers_per_chunk: *const u32,
    num_layers_per_chunk: usize,
    names: &ScheduleFields,
) -> Result<Option<ScheduleSpec>> {
    let split = if layers_per_chunk.is_null() {
        if num_layers_per_chunk != 0 {
            return Err(Error::invalid(format!(
                "{} is NULL but {} is {num_layers_per_chunk}",
                names.layers_per_chunk, names.num_layers_per_chunk
            )));
        }
        None
    } else {
        // SAFETY: per this function's contract.
        Some(
            unsafe {
                arg_slice(
                    layers_per_chunk,
                    num_layers_per_chunk,
                    names.layers_per_chunk,
                )
            }?
            .to_vec(),
        )
    };
    if steps.is_null() && num_steps == 0 {
        if split.is_some() {
            return Err(Error::InvalidSchedule(format!(
                "{} is given without a schedule",
                names.layers_per_chunk
            )));
        }
        return Ok(None);
    }
    if num_steps == 0 {
        return Err(Error::InvalidSchedule(format!(
            "{} is given with {} = 0",
            names.steps, names.num_steps
        )));
    }
    // SAFETY: per this function's contract.
    let steps = unsafe { read_steps(steps, num_steps, step_size, names.steps) }?;
    Ok(Some(ScheduleSpec {
        steps,
        layers_per_chunk: split,
    }))
}

/// Converts Transformer Engine's `_order` notation into schedule steps:
/// `c` is the forward of chunk c (chunks numbered from 1 there), `-c` its
/// backward and `-c - 0.5` its delayed weight-gradient. Writes `num_order`
/// steps to `steps` (room for `num_order` elements of `step_size` bytes).
///
/// # Safety
/// `order` must hold `num_order` values; `steps` must have room for
/// `num_order` elements of `step_size` bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_schedule_from_te_order(
    order: *const f64,
    num_order: usize,
    steps: *mut graphed_schedule_step,
    step_size: usize,
) -> graphed_status {
    boundary("graphed_schedule_from_te_order", || {
        // SAFETY: per this function's contract.
        let order = unsafe { arg_slice(order, num_order, "order") }?;
        check_out_array(steps, num_order, step_size, STEP_MIN, "steps")?;
        let converted = from_te_order(order)?;
        for (i, s) in converted.iter().enumerate() {
            let step = graphed_schedule_step {
                pass: graphed_pass::encode(s.kind),
                chunk: s.chunk,
            };
            // SAFETY: checked above, i < num_order.
            unsafe { write_element(steps, step_size, i, &step) };
        }
        Ok(())
    })
}

/// One pass of a schedule, in capture order (graphed_schedule_passes).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct graphed_pass_ref {
    pub callable: u32,
    pub microbatch: u32,
    /// A graphed_pass value.
    pub pass: u32,
}

/// The schedule a caller describes to graphed_schedule_passes and
/// graphed_schedule_releases (`has_wgrad` NULL: as the schedule says).
///
/// # Safety
/// The arrays hold the counts stated, where non-NULL.
#[allow(clippy::too_many_arguments)]
unsafe fn build_schedule(
    steps: *const graphed_schedule_step,
    num_steps: usize,
    step_size: usize,
    layers_per_chunk: *const u32,
    num_layers_per_chunk: usize,
    has_wgrad: *const u32,
    num_callables: u32,
) -> Result<Schedule> {
    let n = num_callables as usize;
    // Every callable has at least two passes.
    if n > MAX_PASSES / 2 {
        return Err(Error::invalid(format!(
            "num_callables is {n}; a schedule has at most {MAX_PASSES} passes"
        )));
    }
    let wgrad: Option<Vec<bool>> = if has_wgrad.is_null() {
        None
    } else {
        // SAFETY: per this function's contract.
        let flags = unsafe { arg_slice(has_wgrad, n, "has_wgrad") }?;
        Some(
            flags
                .iter()
                .enumerate()
                .map(|(i, &v)| decode_bool(v, &format!("has_wgrad[{i}]")))
                .collect::<Result<_>>()?,
        )
    };
    // SAFETY: per this function's contract.
    let spec = unsafe {
        read_schedule(
            steps,
            num_steps,
            step_size,
            layers_per_chunk,
            num_layers_per_chunk,
            &ScheduleFields::ARGS,
        )
    }?;
    let steps = spec
        .as_ref()
        .map(|s| (&s.steps[..], s.layers_per_chunk.as_deref()));
    Schedule::resolve(steps, wgrad.as_deref(), n)
}

/// Writes a helper's list: min(len, capacity) elements of `size` bytes to
/// `out` (NULL: none, and `capacity` is not read), after checking the whole
/// array the caller describes, then the length to `count_out`.
///
/// # Safety
/// `out` is NULL or has room for `capacity` elements of `size` bytes;
/// `count_out` is writable (checked non-NULL).
unsafe fn write_list<T>(
    items: &[T],
    out: *mut T,
    capacity: usize,
    size: usize,
    count_out: *mut usize,
    what: &'static str,
) -> Result<()> {
    if !out.is_null() {
        check_out_array(out, capacity, size, size_of::<T>(), what)?;
        for (i, item) in items.iter().take(capacity).enumerate() {
            // SAFETY: checked: room for `capacity` elements of `size`
            // bytes, and i < capacity.
            unsafe { write_element(out, size, i, item) };
        }
    }
    // SAFETY: the caller's promise; written only on success.
    unsafe { count_out.write(items.len()) };
    Ok(())
}

/// The passes a session runs, in warmup and capture order, for
/// `num_callables` callables of which `has_wgrad` (one 0/1 per callable)
/// have a weight-grad callback; NULL: as the schedule says (the callables
/// of chunks with weight-grad steps; none without a schedule). With
/// `steps` (NULL and 0: no schedule) the schedule's expansion, else every
/// forward in registration order, then every backward in reverse, each
/// weight-grad after its backward. Writes min(count, capacity) passes to
/// `passes` (NULL: none, and `capacity` is not read) and the count to
/// `*count_out`. A capacity whose bytes (capacity * pass_size) overflow is
/// INVALID_ARGUMENT, as every array length; the schedule is checked first
/// (a schedule that breaks a rule answers that, whatever the capacity).
///
/// # Safety
/// The arrays must hold the counts stated; `passes` must have room for
/// `capacity` elements of `pass_size` bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_schedule_passes(
    steps: *const graphed_schedule_step,
    num_steps: usize,
    step_size: usize,
    layers_per_chunk: *const u32,
    num_layers_per_chunk: usize,
    has_wgrad: *const u32,
    num_callables: u32,
    passes: *mut graphed_pass_ref,
    capacity: usize,
    pass_size: usize,
    count_out: *mut usize,
) -> graphed_status {
    boundary("graphed_schedule_passes", || {
        let count_out = arg_out(count_out, "count_out")?;
        // SAFETY: per this function's contract.
        let schedule = unsafe {
            build_schedule(
                steps,
                num_steps,
                step_size,
                layers_per_chunk,
                num_layers_per_chunk,
                has_wgrad,
                num_callables,
            )
        }?;
        let list: Vec<graphed_pass_ref> = schedule
            .passes
            .iter()
            .map(|p| graphed_pass_ref {
                callable: p.callable as u32,
                microbatch: p.microbatch as u32,
                pass: graphed_pass::encode(p.kind),
            })
            .collect();
        // SAFETY: per this function's contract.
        unsafe { write_list(&list, passes, capacity, pass_size, count_out, "passes") }
    })
}

/// One buffer a schedule lets go of (graphed_schedule_releases).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct graphed_release {
    /// The position, in graphed_schedule_passes's order, of the pass after
    /// which the buffer is no longer needed.
    pub after: u32,
    pub callable: u32,
    pub microbatch: u32,
    /// A graphed_buffer_role value: OUTPUT, GRAD_INPUT or PARAM_GRADS.
    pub role: u32,
}

/// With buffer reuse: after which pass of the order graphed_schedule_passes
/// gives (the same arguments) each output, input grad and parameter grad
/// of every (callable, microbatch) is no longer needed, so that memory a
/// caller handed over for it (GRAPHED_TENSOR_FLAGS_EXTERNAL,
/// GRAPHED_PARAM_FLAGS_EXTERNAL_GRAD) may hold other buffers of the passes
/// captured after that one, as graphed's own static buffers do. Outputs go
/// after their backward; input grads once the layer before them in the
/// chunk took them, a chunk's first layer's once the next backward step
/// has run and the previous chunk's backward of the same microbatch took
/// it (the last backward step's are kept); parameter grads after the pass
/// that writes them (the backward, or the weight-grad pass), those a
/// replay copies out only: an ALIAS grad is the buffer itself and is kept.
/// Writes min(count, capacity) releases, ordered by `after`, then
/// callable, microbatch and role, to `releases` (NULL: none, and
/// `capacity` is not read) and the count to `*count_out`. A capacity whose
/// bytes (capacity * release_size) overflow is INVALID_ARGUMENT, as every
/// array length; the schedule is checked first (a schedule that breaks a
/// rule answers that, whatever the capacity).
///
/// # Safety
/// The arrays must hold the counts stated; `releases` must have room for
/// `capacity` elements of `release_size` bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_schedule_releases(
    steps: *const graphed_schedule_step,
    num_steps: usize,
    step_size: usize,
    layers_per_chunk: *const u32,
    num_layers_per_chunk: usize,
    has_wgrad: *const u32,
    num_callables: u32,
    releases: *mut graphed_release,
    capacity: usize,
    release_size: usize,
    count_out: *mut usize,
) -> graphed_status {
    boundary("graphed_schedule_releases", || {
        let count_out = arg_out(count_out, "count_out")?;
        // SAFETY: per this function's contract.
        let schedule = unsafe {
            build_schedule(
                steps,
                num_steps,
                step_size,
                layers_per_chunk,
                num_layers_per_chunk,
                has_wgrad,
                num_callables,
            )
        }?;
        // Positions are below MAX_PASSES, callables and microbatches below
        // u32::MAX.
        let list: Vec<graphed_release> = Spans::of(&schedule)
            .releases()
            .iter()
            .map(|r| graphed_release {
                after: r.after as u32,
                callable: r.callable as u32,
                microbatch: r.microbatch as u32,
                role: graphed_buffer_role::encode(r.role),
            })
            .collect();
        // SAFETY: per this function's contract.
        unsafe {
            write_list(
                &list,
                releases,
                capacity,
                release_size,
                count_out,
                "releases",
            )
        }
    })
}

/// The shape of a schedule for `num_callables` callables: its chunks and
/// microbatches, and, when `chunk_layers` and `chunk_first` are given
/// (room for `chunk_capacity` entries each, at least the chunk count), the
/// number of layers (callables) of each chunk and the first callable of
/// each. `layers_per_chunk` as in the session config (NULL: split evenly).
/// The schedule's rules are checked as at capture, before the chunk
/// arrays: a schedule that breaks a rule answers that, whatever the
/// capacity. A `chunk_capacity` whose bytes overflow, or one below the
/// chunk count, is INVALID_ARGUMENT.
///
/// # Safety
/// `steps` must hold `num_steps` elements of `step_size` bytes;
/// `layers_per_chunk` `num_layers_per_chunk` values; the outputs must be
/// writable (the arrays for `chunk_capacity` values) or NULL where allowed.
#[no_mangle]
pub unsafe extern "C" fn graphed_schedule_shape(
    steps: *const graphed_schedule_step,
    num_steps: usize,
    step_size: usize,
    layers_per_chunk: *const u32,
    num_layers_per_chunk: usize,
    num_callables: u32,
    chunks_out: *mut u32,
    microbatches_out: *mut u32,
    chunk_layers_out: *mut u32,
    chunk_first_out: *mut u32,
    chunk_capacity: usize,
) -> graphed_status {
    boundary("graphed_schedule_shape", || {
        let chunks_out = arg_out(chunks_out, "chunks_out")?;
        let mb_out = arg_out(microbatches_out, "microbatches_out")?;
        // SAFETY: per this function's contract.
        let steps = unsafe { read_steps(steps, num_steps, step_size, "steps") }?;
        let lpc = if layers_per_chunk.is_null() {
            None
        } else {
            // SAFETY: per this function's contract.
            Some(unsafe { arg_slice(layers_per_chunk, num_layers_per_chunk, "layers_per_chunk") }?)
        };
        let shape = Shape::check(&steps)?;
        let (layers, first) = chunk_layers(&shape, lpc, num_callables as usize)?;
        let want_arrays = !chunk_layers_out.is_null() || !chunk_first_out.is_null();
        if want_arrays {
            let a = arg_out(chunk_layers_out, "chunk_layers_out")?;
            let b = arg_out(chunk_first_out, "chunk_first_out")?;
            check_out_array(a, chunk_capacity, 4, 4, "chunk_layers_out")?;
            check_out_array(b, chunk_capacity, 4, 4, "chunk_first_out")?;
            if chunk_capacity < shape.chunks {
                return Err(Error::invalid(format!(
                    "chunk_capacity is {chunk_capacity}; the schedule has {} chunks",
                    shape.chunks
                )));
            }
            for c in 0..shape.chunks {
                // SAFETY: checked, room for chunk_capacity >= chunks values;
                // counts fit u32 (they sum to num_callables).
                unsafe {
                    a.add(c).write(layers[c] as u32);
                    b.add(c).write(first[c] as u32);
                }
            }
        }
        // SAFETY: both checked non-NULL; written only on success. At most
        // 4096 chunks; microbatches are a count of steps.
        unsafe {
            chunks_out.write(shape.chunks as u32);
            mb_out.write(u32::try_from(shape.microbatches).unwrap_or(u32::MAX));
        }
        Ok(())
    })
}
