//! What a captured session can be asked of its callables: their arity,
//! their static buffers, which inputs and parameters replays rebind, their
//! frozen grad policies, the bucket a size runs, their instance numbers,
//! where their graphs read the parameters, the buffer plan as text, and the
//! captured graphs as DOT text.

use super::args::{arg_out, check_out_array, write_answer};
use super::boundary::boundary;
use super::enums::{graphed_buffer_role, graphed_grad_policy};
use super::handles::graphed_session;
use super::session::session;
use super::status::graphed_status;
use crate::core::policy::GradPolicy;
use crate::error::Error;
use std::ffi::{c_char, c_void};
use std::mem::size_of;

/// Writes the number of inputs, parameters and outputs of a registered
/// callable (the sizes of its replay arrays).
///
/// # Safety
/// The outputs must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_callable_arity(
    session: *mut graphed_session,
    callable: u32,
    num_inputs_out: *mut usize,
    num_params_out: *mut usize,
    num_outputs_out: *mut usize,
) -> graphed_status {
    boundary("graphed_session_callable_arity", || {
        let cell = self::session(session)?;
        let (i, p, o) = (
            arg_out(num_inputs_out, "num_inputs_out")?,
            arg_out(num_params_out, "num_params_out")?,
            arg_out(num_outputs_out, "num_outputs_out")?,
        );
        let (ni, np, no) = cell.lock()?.arity(callable)?;
        // SAFETY: all three checked non-NULL and aligned.
        unsafe {
            i.write(ni);
            p.write(np);
            o.write(no);
        }
        Ok(())
    })
}

/// Writes the static buffers of one role (a graphed_buffer_role value) of
/// (callable, microbatch) to `ptrs` (`count` must equal the number of
/// inputs, outputs or parameters; NULL where a buffer does not exist).
/// Passing a static input back as replay data skips its copy.
///
/// # Safety
/// `ptrs` must have room for `count` pointers.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_buffers(
    session: *mut graphed_session,
    callable: u32,
    microbatch: u32,
    role: u32,
    ptrs: *mut *mut c_void,
    count: usize,
) -> graphed_status {
    boundary("graphed_session_buffers", || {
        let cell = self::session(session)?;
        let role = graphed_buffer_role::decode(role, "role")?;
        let s = cell.lock()?;
        let b = s.buffers(callable, microbatch, role)?;
        if count != b.len() {
            return Err(Error::invalid(format!(
                "count is {count}; that role has {} buffers",
                b.len()
            )));
        }
        let stride = size_of::<*mut c_void>();
        check_out_array(ptrs, b.len(), stride, stride, "ptrs")?;
        for (i, &p) in b.iter().enumerate() {
            // SAFETY: checked: room for `count` aligned pointers.
            unsafe { ptrs.add(i).write(p as *mut c_void) };
        }
        Ok(())
    })
}

/// Writes the number of static buffers of one role (a graphed_buffer_role
/// value) of (callable, microbatch) of a captured session to
/// `*count_out`: the `count` graphed_session_buffers and
/// graphed_session_rebound take for that role.
///
/// # Safety
/// `count_out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_buffer_count(
    session: *mut graphed_session,
    callable: u32,
    microbatch: u32,
    role: u32,
    count_out: *mut usize,
) -> graphed_status {
    boundary("graphed_session_buffer_count", || {
        let cell = self::session(session)?;
        // SAFETY: per this function's contract.
        unsafe {
            write_answer(count_out, "count_out", || {
                let role = graphed_buffer_role::decode(role, "role")?;
                cell.lock()?.buffer_count(callable, microbatch, role)
            })
        }
    })
}

/// Writes the frozen graphed_grad_policy of each parameter of a captured
/// callable to `policies` (`count` = its parameter count;
/// GRAPHED_GRAD_POLICY_DEFAULT for parameters without a gradient).
///
/// # Safety
/// `policies` must have room for `count` values.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_param_policies(
    session: *mut graphed_session,
    callable: u32,
    policies: *mut u32,
    count: usize,
) -> graphed_status {
    boundary("graphed_session_param_policies", || {
        let cell = self::session(session)?;
        let s = cell.lock()?;
        let p = s.policies(callable)?;
        if count != p.len() {
            return Err(Error::invalid(format!(
                "count is {count}; the callable has {} parameters",
                p.len()
            )));
        }
        check_out_array(policies, p.len(), 4, 4, "policies")?;
        for (i, pol) in p.iter().enumerate() {
            let code = graphed_grad_policy::encode(pol.unwrap_or(GradPolicy::Default));
            // SAFETY: checked: room for `count` aligned values.
            unsafe { policies.add(i).write(code) };
        }
        Ok(())
    })
}

/// Writes, for each input (role GRAPHED_BUFFER_ROLE_INPUT) or each output's
/// grad-output (GRAPHED_BUFFER_ROLE_GRAD_OUTPUT) of (callable, microbatch),
/// 1 where replays rebind it (GRAPHED_TENSOR_FLAGS_REBIND, verified at
/// capture) and 0 where they copy it (not asked for, or refused: the plan
/// dump says why) to `rebound` (`count` = the number of inputs or outputs).
/// Other roles are never rebound: GRAPHED_STATUS_INVALID_ARGUMENT.
///
/// # Safety
/// `rebound` must have room for `count` values.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_rebound(
    session: *mut graphed_session,
    callable: u32,
    microbatch: u32,
    role: u32,
    rebound: *mut u32,
    count: usize,
) -> graphed_status {
    boundary("graphed_session_rebound", || {
        let cell = self::session(session)?;
        let role = graphed_buffer_role::decode(role, "role")?;
        let on = cell.lock()?.rebound(callable, microbatch, role)?;
        write_flags(&on, rebound, count, "rebound", "that role has")
    })
}

/// Writes, for each parameter of (callable, microbatch), 1 where a forward
/// replay given another address for it points the graphs there
/// (GRAPHED_PARAM_FLAGS_REBIND, verified at capture) and 0 where it is
/// refused with GRAPHED_STATUS_PARAM_MOVED (not asked for, or refused: the
/// plan dump says why) to `movable` (`count` = its parameter count).
///
/// # Safety
/// `movable` must have room for `count` values.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_params_movable(
    session: *mut graphed_session,
    callable: u32,
    microbatch: u32,
    movable: *mut u32,
    count: usize,
) -> graphed_status {
    boundary("graphed_session_params_movable", || {
        let cell = self::session(session)?;
        let on = cell.lock()?.params_movable(callable, microbatch)?;
        write_flags(
            &on,
            movable,
            count,
            "movable",
            "the callable's parameters number",
        )
    })
}

/// Writes which bucket a forward replay of `callable` given `size` rows
/// (graphed_replay_args.size) runs to `*bucket_out`, and that bucket's size
/// (the first dimension of its DYNAMIC tensors, as ctx->bucket_size) to
/// `*bucket_size_out`: the smallest bucket holding `size`, by the rule
/// replays choose by. A callable without buckets answers 0 and 0 for a
/// size of 0. Answered from registration: before capture too.
/// GRAPHED_STATUS_INVALID_ARGUMENT, naming the callable: a callable that
/// does not exist; a size on a callable without buckets; 0 on one with
/// buckets; a size above its largest bucket (which a forward is refused,
/// and which a device-chosen replay runs no bucket for). After a reset:
/// GRAPHED_STATUS_SESSION_RESET.
///
/// # Safety
/// The outputs must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_bucket_of(
    session: *mut graphed_session,
    callable: u32,
    size: u64,
    bucket_out: *mut u32,
    bucket_size_out: *mut u64,
) -> graphed_status {
    boundary("graphed_session_bucket_of", || {
        let cell = self::session(session)?;
        let (b, n) = (
            arg_out(bucket_out, "bucket_out")?,
            arg_out(bucket_size_out, "bucket_size_out")?,
        );
        let (bucket, (bucket_size, _)) = cell.lock()?.bucket_of(callable, (size, 0))?;
        // SAFETY: both checked non-NULL and aligned.
        unsafe {
            b.write(bucket);
            n.write(bucket_size);
        }
        Ok(())
    })
}

/// graphed_session_bucket_of for a callable with a grid of buckets
/// (graphed_callable_desc.bucket_sizes2): writes which bucket a forward
/// replay given `size` and `size2` (graphed_replay_args.size, size2) runs
/// to `*bucket_out` and that bucket's sizes (ctx->bucket_size,
/// ctx->bucket_size2) to `*bucket_size_out` and `*bucket_size2_out`: the
/// smallest size at least `size` with the smallest second size at least
/// `size2`. Without a grid it answers as graphed_session_bucket_of for
/// `size2` 0 (and writes 0 as the second size). Refused as
/// graphed_session_bucket_of is, and: a second size without a grid, 0 or
/// above the largest second size with one.
///
/// # Safety
/// The outputs must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_bucket_of2(
    session: *mut graphed_session,
    callable: u32,
    size: u64,
    size2: u64,
    bucket_out: *mut u32,
    bucket_size_out: *mut u64,
    bucket_size2_out: *mut u64,
) -> graphed_status {
    boundary("graphed_session_bucket_of2", || {
        let cell = self::session(session)?;
        let (b, n, n2) = (
            arg_out(bucket_out, "bucket_out")?,
            arg_out(bucket_size_out, "bucket_size_out")?,
            arg_out(bucket_size2_out, "bucket_size2_out")?,
        );
        let (bucket, (s1, s2)) = cell.lock()?.bucket_of(callable, (size, size2))?;
        // SAFETY: all checked non-NULL and aligned.
        unsafe {
            b.write(bucket);
            n.write(s1);
            n2.write(s2);
        }
        Ok(())
    })
}

/// Writes the instance number of (callable, microbatch, bucket) of a
/// captured session to `*instance_out`: what graphed_pass_ctx.instance
/// was in the callbacks of its passes. Instances are numbered callable by
/// callable, microbatch by microbatch, bucket by bucket, from 0 to
/// graphed_session_stats.instances - 1; a released callable keeps its
/// numbers. `bucket` is 0 for a callable without buckets; a callable with
/// buckets has one microbatch. A callable, microbatch or bucket that does
/// not exist is GRAPHED_STATUS_INVALID_ARGUMENT.
///
/// # Safety
/// `instance_out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_instance_of(
    session: *mut graphed_session,
    callable: u32,
    microbatch: u32,
    bucket: u32,
    instance_out: *mut u32,
) -> graphed_status {
    boundary("graphed_session_instance_of", || {
        let cell = self::session(session)?;
        // SAFETY: per this function's contract.
        unsafe {
            write_answer(instance_out, "instance_out", || {
                cell.lock()?.instance_of(callable, microbatch, bucket)
            })
        }
    })
}

/// Writes where the graphs of (callable, microbatch) of a captured session
/// read each parameter now to `addresses` (`count` = its parameter count):
/// where it was registered, until a forward replay given another address
/// (graphed_replay_args.params, also a step replayed pass by pass) pointed
/// them there; every bucket follows the same moves. The next forward
/// given no address (NULL) for a parameter reads it there. A step's own
/// graphs keep addresses of their own (where its last replay had them).
/// NULL where the graphs do not read it at one known address (a driver
/// error while they were pointed elsewhere: the next replay given an
/// address points them all again). Refused for a released callable
/// (GRAPHED_STATUS_CALLABLE_RELEASED: its graphs are gone).
///
/// # Safety
/// `addresses` must have room for `count` pointers.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_param_addresses(
    session: *mut graphed_session,
    callable: u32,
    microbatch: u32,
    addresses: *mut *mut c_void,
    count: usize,
) -> graphed_status {
    boundary("graphed_session_param_addresses", || {
        let cell = self::session(session)?;
        let at = cell.lock()?.param_addresses(callable, microbatch)?;
        if count != at.len() {
            return Err(Error::invalid(format!(
                "count is {count}; the callable has {} parameters",
                at.len()
            )));
        }
        let stride = size_of::<*mut c_void>();
        check_out_array(addresses, at.len(), stride, stride, "addresses")?;
        for (i, &p) in at.iter().enumerate() {
            // SAFETY: checked: room for `count` aligned pointers.
            unsafe { addresses.add(i).write(p as *mut c_void) };
        }
        Ok(())
    })
}

/// Writes `on` as 0/1 values to the caller's array of `count` values.
fn write_flags(
    on: &[bool],
    out: *mut u32,
    count: usize,
    what: &'static str,
    of: &str,
) -> crate::error::Result<()> {
    if count != on.len() {
        return Err(Error::invalid(format!(
            "count is {count}; {of} {}",
            on.len()
        )));
    }
    check_out_array(out, on.len(), 4, 4, what)?;
    for (i, &r) in on.iter().enumerate() {
        // SAFETY: checked: room for `count` aligned values.
        unsafe { out.add(i).write(r as u32) };
    }
    Ok(())
}

/// Writes the static-buffer plan of a captured session as text (one line
/// per buffer: callable, microbatch, role, size, offset, memory slot,
/// lifetime in capture-order pass positions) into `buffer` (`capacity`
/// bytes, NUL-terminated, truncated if short) and its full length (without
/// the NUL) to `*length_out`. Pass a NULL buffer to ask for the length.
///
/// # Safety
/// `buffer` must be NULL or have room for `capacity` bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_plan_dump(
    session: *mut graphed_session,
    buffer: *mut c_char,
    capacity: usize,
    length_out: *mut usize,
) -> graphed_status {
    boundary("graphed_session_plan_dump", || {
        let cell = self::session(session)?;
        let len_out = arg_out(length_out, "length_out")?;
        let text = cell.lock()?.plan_dump()?;
        // SAFETY: per this function's contract.
        unsafe { write_text(&text, buffer, capacity, len_out) }
    })
}

/// Writes the captured graphs of a session as Graphviz DOT text into
/// `buffer` (`capacity` bytes, NUL-terminated, truncated if short) and its
/// full length (without the NUL) to `*length_out`; pass a NULL buffer to
/// ask for the length. One digraph, one cluster per graph the session
/// holds now (each pass of each (callable, microbatch, bucket), its clone
/// slots, the graphs choosing a bucket on the device, each step's graphs),
/// labelled with the callable (name and index), pass, microbatch and
/// bucket, or the step, and which graph it is; each node labelled with its
/// kind and, for a kernel, its name (CUDA: as the driver names it, CUDA
/// 12.3 drivers and newer; host backend: a host kernel's name), with the
/// cluster's label as its tooltip; edges are the dependencies. The nodes
/// are those recorded when the capture ended, so the text is the same
/// after templates are released. Released callables' graphs are gone (a
/// comment says so). Refused, writing nothing: a NULL, destroyed or forged
/// session; `length_out` NULL (NULL_POINTER) or misaligned
/// (INVALID_ARGUMENT); BUSY; a `buffer` whose `capacity` bytes do not fit
/// in memory (INVALID_ARGUMENT); not captured (WRONG_STATE) or reset
/// (SESSION_RESET).
///
/// # Safety
/// `buffer` must be NULL or have room for `capacity` bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_export_dot(
    session: *mut graphed_session,
    buffer: *mut c_char,
    capacity: usize,
    length_out: *mut usize,
) -> graphed_status {
    boundary("graphed_session_export_dot", || {
        let cell = self::session(session)?;
        let len_out = arg_out(length_out, "length_out")?;
        let text = cell.lock()?.export_dot()?;
        // SAFETY: per this function's contract.
        unsafe { write_text(&text, buffer, capacity, len_out) }
    })
}

/// Writes `text` into `buffer` (`capacity` bytes, NUL-terminated, truncated
/// if short; nothing when NULL) and its full length to `len_out`.
///
/// # Safety
/// `buffer` is NULL or has room for `capacity` bytes; `len_out` is
/// writable (checked non-NULL).
pub(super) unsafe fn write_text(
    text: &str,
    buffer: *mut c_char,
    capacity: usize,
    len_out: *mut usize,
) -> crate::error::Result<()> {
    if !buffer.is_null() && capacity > 0 {
        check_out_array(buffer, capacity, 1, 1, "buffer")?;
        let n = text.len().min(capacity - 1);
        // SAFETY: the caller's buffer has `capacity` bytes; we write n + 1 <= capacity.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buffer as *mut u8, n);
            buffer.add(n).write(0);
        }
    }
    // SAFETY: the caller's promise.
    unsafe { len_out.write(text.len()) };
    Ok(())
}
