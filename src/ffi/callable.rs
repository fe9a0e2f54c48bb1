//! Registering callables: the tensor, parameter and callable descriptors,
//! their defaults, and their conversion into the orchestration layer's
//! specs, and the element size of each dtype a descriptor names.
//! Everything in a descriptor is copied at registration.

use super::args::{
    arg_out, arg_slice, arg_str, assert_header, read_array, read_struct, write_answer, CStruct,
};
use super::boundary::boundary;
use super::callback::{graphed_pass_fn, CCallbacks};
use super::enums::{
    decode_bool, graphed_dtype, graphed_grad_policy, graphed_param_flags, graphed_tensor_flags,
};
use super::handles::graphed_session;
use super::session::session;
use super::status::graphed_status;
use crate::backend::DevPtr;
use crate::core::policy::ParamSpec;
use crate::error::{Error, Result};
use crate::orchestrate::{CallableSpec, TensorSpec};
use std::ffi::{c_char, c_void};
use std::mem::size_of;

/// The magics the _default() functions set.
pub const GRAPHED_TENSOR_DESC_MAGIC: u32 = 0x6772_0003;
pub const GRAPHED_PARAM_DESC_MAGIC: u32 = 0x6772_0004;
pub const GRAPHED_CALLABLE_DESC_MAGIC: u32 = 0x6772_0002;

/// The most buckets a callable may have (graphed_callable_desc.num_buckets).
pub const GRAPHED_MAX_BUCKETS: usize = 256;
const _: () = assert!(GRAPHED_MAX_BUCKETS == crate::orchestrate::registration::MAX_BUCKETS);

/// A static input or output of a callable. Initialise each with
/// graphed_tensor_desc_default().
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_tensor_desc {
    /// sizeof(graphed_tensor_desc); set by the _default() function. Every
    /// element of an array has the same.
    pub struct_size: usize,
    /// GRAPHED_TENSOR_DESC_MAGIC; set by the _default() function.
    pub magic: u32,
    /// A graphed_dtype value (default F32).
    pub dtype: u32,
    /// Size in bytes (non-zero, a multiple of the element size, at most 2^48).
    pub bytes: usize,
    /// Number of dimensions of `shape` (0: no shape, only bytes).
    pub ndim: u32,
    /// 1: inputs get a grad-input buffer that backward writes; outputs get
    /// a grad-output buffer that backward reads. 0 (default): none.
    pub requires_grad: u32,
    /// `ndim` dimensions; when given, their product times the element size
    /// must equal `bytes`. Copied at registration.
    pub shape: *const i64,
    /// Inputs only: device pointer to `bytes` of sample data, copied into
    /// the static input before warmup (NULL: the static input starts
    /// zeroed). Read during graphed_session_capture only.
    pub sample: *const c_void,
    /// graphed_tensor_flags bits.
    pub flags: u32,
    /// Inputs with GRAPHED_TENSOR_FLAGS_CHAINED: this input is output
    /// `chain_output` of the earlier callable `chain_callable` (same
    /// microbatch). It has no buffer of its own: it reads that output in
    /// place, and its grad is that output's grad-output, written in place.
    /// Bytes, dtype and requires_grad must match the output's. Chained to
    /// a DYNAMIC output it is DYNAMIC: without a shape it takes the
    /// output's, and a shape of its own must have the largest bucket as
    /// its first dimension (GRAPHED_STATUS_INVALID_ARGUMENT otherwise); a
    /// forward then runs the rows its producer's last forward ran, and is
    /// refused before the producer has run one. Chained to an output of
    /// one shape, it is read as the buffer holds it whatever the size: a
    /// forward of any size is accepted, before the producer's first
    /// forward too (the buffer then holds what the producer's capture
    /// left there).
    pub chain_callable: u32,
    pub chain_output: u32,
    /// GRAPHED_TENSOR_FLAGS_DYNAMIC tensors: the dimension of `shape` that
    /// is the bucket's size (graphed_callable_desc.bucket_sizes), 0 by
    /// default (the first: rows); GRAPHED_DIM_NONE where only the second
    /// size varies the tensor. Another dimension than the first (the time
    /// dimension of [B, T, H], ...) needs a shape.
    pub dynamic_dim: u32,
    /// With a grid of buckets (graphed_callable_desc.bucket_sizes2): the
    /// dimension of `shape` that is the bucket's second size
    /// (GRAPHED_DIM_NONE, the default: none). When both are set, the
    /// dimensions before the first of the two hold one element (the
    /// actual data is then rows of one pitch, graphed_ref.rows).
    pub dynamic_dim2: u32,
}

/// graphed_tensor_desc.dynamic_dim, dynamic_dim2: no dimension.
pub const GRAPHED_DIM_NONE: u32 = u32::MAX;

// SAFETY: repr(C), integers and pointers only, header at offsets 0 and 8.
unsafe impl CStruct for graphed_tensor_desc {
    const NAME: &'static str = "graphed_tensor_desc";
    const MAGIC: u32 = GRAPHED_TENSOR_DESC_MAGIC;
    const MIN_SIZE: usize = 64;
    fn defaults() -> Self {
        graphed_tensor_desc_default()
    }
}
assert_header!(graphed_tensor_desc);

/// A tensor descriptor with its size and magic set: f32, no bytes yet, no
/// grad, no sample.
#[no_mangle]
pub extern "C" fn graphed_tensor_desc_default() -> graphed_tensor_desc {
    graphed_tensor_desc {
        struct_size: size_of::<graphed_tensor_desc>(),
        magic: GRAPHED_TENSOR_DESC_MAGIC,
        dtype: graphed_dtype::F32 as u32,
        bytes: 0,
        ndim: 0,
        requires_grad: 0,
        shape: std::ptr::null(),
        sample: std::ptr::null(),
        flags: 0,
        chain_callable: 0,
        chain_output: 0,
        dynamic_dim: 0,
        dynamic_dim2: GRAPHED_DIM_NONE,
    }
}

/// A parameter of a callable. The library never writes `data`; it hands
/// the pointer to the callbacks. Initialise each with
/// graphed_param_desc_default().
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_param_desc {
    /// sizeof(graphed_param_desc); set by the _default() function.
    pub struct_size: usize,
    /// GRAPHED_PARAM_DESC_MAGIC; set by the _default() function.
    pub magic: u32,
    /// A graphed_dtype value (default F32).
    pub dtype: u32,
    /// Caller-owned device pointer to the parameter; must stay valid while
    /// the session's graphs exist (they bake it in).
    pub data: *mut c_void,
    /// Size in bytes (non-zero, a multiple of the element size, at most 2^48).
    pub bytes: usize,
    /// graphed_param_flags bits (DELAYED_WGRAD, EXTERNAL_GRAD).
    pub flags: u32,
    /// A graphed_grad_policy value: GRAPHED_GRAD_POLICY_DEFAULT lets capture
    /// decide (CLONE; ALIAS for delayed-wgrad parameters or when the
    /// session opts out of clones).
    pub policy: u32,
    /// 1 (default): the parameter takes a gradient (a slot in the grad
    /// slab). 0: it does not.
    pub requires_grad: u32,
}

// SAFETY: repr(C), integers and pointers only, header at offsets 0 and 8.
unsafe impl CStruct for graphed_param_desc {
    const NAME: &'static str = "graphed_param_desc";
    const MAGIC: u32 = GRAPHED_PARAM_DESC_MAGIC;
    const MIN_SIZE: usize = 48;
    fn defaults() -> Self {
        graphed_param_desc_default()
    }
}
assert_header!(graphed_param_desc);

/// A parameter descriptor with its size and magic set: f32, requires a
/// gradient, default policy, no flags, no data yet.
#[no_mangle]
pub extern "C" fn graphed_param_desc_default() -> graphed_param_desc {
    graphed_param_desc {
        struct_size: size_of::<graphed_param_desc>(),
        magic: GRAPHED_PARAM_DESC_MAGIC,
        dtype: graphed_dtype::F32 as u32,
        data: std::ptr::null_mut(),
        bytes: 0,
        flags: 0,
        policy: graphed_grad_policy::Default as u32,
        requires_grad: 1,
    }
}

/// A callable to register. Initialise with graphed_callable_desc_default().
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_callable_desc {
    /// sizeof(graphed_callable_desc); set by the _default() function.
    pub struct_size: usize,
    /// GRAPHED_CALLABLE_DESC_MAGIC; set by the _default() function.
    pub magic: u32,
    /// Name used in messages (copied; NULL: "callable N").
    pub name: *const c_char,
    /// Arrays of descriptors, each initialised by its _default() function
    /// (their struct_size is their stride).
    pub num_inputs: usize,
    pub inputs: *const graphed_tensor_desc,
    pub num_params: usize,
    pub params: *const graphed_param_desc,
    pub num_outputs: usize,
    pub outputs: *const graphed_tensor_desc,
    /// Required.
    pub forward: graphed_pass_fn,
    /// Required.
    pub backward: graphed_pass_fn,
    /// Optional delayed weight-gradient callback: when set, backward
    /// computes only input grads, this callback fills the parameter-grad
    /// slots, it is captured as its own graph, and
    /// graphed_backward_wgrad replays it and returns the parameter grads.
    pub wgrad: graphed_pass_fn,
    /// Passed to forward, backward and wgrad.
    pub user_data: *mut c_void,
    /// Optional hooks around every callback call, outside capture.
    pub pre_hook: graphed_pass_fn,
    pub post_hook: graphed_pass_fn,
    pub hook_data: *mut c_void,
    /// Buckets: `num_buckets` sizes of the dynamic dimension, strictly
    /// ascending, each 1 to 2^32 - 1 (NULL and 0: one shape). The callable
    /// is captured once per bucket, every bucket in the largest one's
    /// static memory; its GRAPHED_TENSOR_FLAGS_DYNAMIC tensors have the
    /// bucket's size as their first dimension. A forward replay names its
    /// actual size (graphed_replay_args.size) and runs the smallest bucket
    /// that holds it. A callable chained to one with buckets has the same
    /// buckets (its chained input takes the producer's rows, and its
    /// forward runs the size its producer's did). Not with a pipeline
    /// schedule or steps. Copied at registration.
    pub bucket_sizes: *const u64,
    pub num_buckets: usize,
    /// A grid of buckets: `num_buckets2` sizes of a second dynamic
    /// dimension (strictly ascending, each 1 to 2^32 - 1; NULL and 0:
    /// none), which the tensors' `dynamic_dim2` names. The callable is
    /// captured once per pair (size, size2), bucket `i * num_buckets2 + j`
    /// the pair (bucket_sizes[i], bucket_sizes2[j]), at most
    /// GRAPHED_MAX_BUCKETS pairs; a forward names both actual sizes
    /// (graphed_replay_args.size, size2) and runs the smallest size at
    /// least `size` with the smallest second size at least `size2`. Needs
    /// bucket_sizes. Copied at registration.
    pub bucket_sizes2: *const u64,
    pub num_buckets2: usize,
}

// SAFETY: repr(C), integers, pointers and nullable function pointers only
// (any bit pattern of those is a valid value), header at offsets 0 and 8.
unsafe impl CStruct for graphed_callable_desc {
    const NAME: &'static str = "graphed_callable_desc";
    const MAGIC: u32 = GRAPHED_CALLABLE_DESC_MAGIC;
    const MIN_SIZE: usize = 128;
    fn defaults() -> Self {
        graphed_callable_desc_default()
    }
}
assert_header!(graphed_callable_desc);

/// An empty callable descriptor with its size and magic set.
#[no_mangle]
pub extern "C" fn graphed_callable_desc_default() -> graphed_callable_desc {
    graphed_callable_desc {
        struct_size: size_of::<graphed_callable_desc>(),
        magic: GRAPHED_CALLABLE_DESC_MAGIC,
        name: std::ptr::null(),
        num_inputs: 0,
        inputs: std::ptr::null(),
        num_params: 0,
        params: std::ptr::null(),
        num_outputs: 0,
        outputs: std::ptr::null(),
        forward: None,
        backward: None,
        wgrad: None,
        user_data: std::ptr::null_mut(),
        pre_hook: None,
        post_hook: None,
        hook_data: std::ptr::null_mut(),
        bucket_sizes: std::ptr::null(),
        num_buckets: 0,
        bucket_sizes2: std::ptr::null(),
        num_buckets2: 0,
    }
}

fn tensor(t: &graphed_tensor_desc, what: &str) -> Result<TensorSpec> {
    let flags = graphed_tensor_flags::decode(t.flags, &format!("{what}.flags"))?;
    let shape: Vec<i64> = if t.ndim == 0 {
        Vec::new()
    } else {
        // SAFETY: the caller passes `ndim` readable dimensions.
        unsafe { arg_slice(t.shape, t.ndim as usize, "shape") }?.to_vec()
    };
    Ok(TensorSpec {
        bytes: t.bytes,
        dtype: graphed_dtype::decode(t.dtype, &format!("{what}.dtype"))?,
        shape,
        requires_grad: decode_bool(t.requires_grad, &format!("{what}.requires_grad"))?,
        sample: t.sample as DevPtr,
        external: flags.external,
        chained: flags.chained.then_some((t.chain_callable, t.chain_output)),
        rebind: flags.rebind,
        dynamic: flags.dynamic,
        dims: dims(t, flags.dynamic, what)?,
    })
}

/// The dimensions a tensor varies on: (dynamic_dim, dynamic_dim2) of a
/// DYNAMIC one; none of another, whose fields keep their defaults.
fn dims(
    t: &graphed_tensor_desc,
    dynamic: bool,
    what: &str,
) -> Result<(Option<usize>, Option<usize>)> {
    let dim = |d: u32| (d != GRAPHED_DIM_NONE).then_some(d as usize);
    if !dynamic {
        if t.dynamic_dim != 0 || t.dynamic_dim2 != GRAPHED_DIM_NONE {
            return Err(Error::invalid(format!(
                "{what}.dynamic_dim or dynamic_dim2 is set, but the tensor is not DYNAMIC \
                 (GRAPHED_TENSOR_FLAGS_DYNAMIC): leave them at their defaults"
            )));
        }
        return Ok((None, None));
    }
    Ok((dim(t.dynamic_dim), dim(t.dynamic_dim2)))
}

fn param(p: &graphed_param_desc, what: &str) -> Result<ParamSpec> {
    Ok(ParamSpec {
        data: p.data as DevPtr,
        bytes: p.bytes,
        dtype: graphed_dtype::decode(p.dtype, &format!("{what}.dtype"))?,
        requires_grad: decode_bool(p.requires_grad, &format!("{what}.requires_grad"))?,
        flags: graphed_param_flags::decode(p.flags, &format!("{what}.flags"))?,
        policy: graphed_grad_policy::decode(p.policy, &format!("{what}.policy"))?,
    })
}

/// A callable descriptor as orchestration sees it (without its index-based
/// default name).
fn callable(d: &graphed_callable_desc) -> Result<(Option<String>, CallableSpec)> {
    // SAFETY: a non-NULL name is NUL-terminated per the contract.
    let name = unsafe { arg_str(d.name, "desc.name") }?;
    // SAFETY (three arrays): they hold the stated counts of descriptors.
    let inputs = unsafe { read_array(d.inputs, d.num_inputs, "desc.inputs") }?;
    let outputs = unsafe { read_array(d.outputs, d.num_outputs, "desc.outputs") }?;
    let params = unsafe { read_array(d.params, d.num_params, "desc.params") }?;
    let buckets = match d.num_buckets {
        0 if !d.bucket_sizes.is_null() => {
            return Err(Error::invalid(
                "desc.bucket_sizes is set but desc.num_buckets is 0",
            ))
        }
        0 => Vec::new(),
        // SAFETY: the caller passes `num_buckets` readable sizes.
        n => unsafe { arg_slice(d.bucket_sizes, n, "desc.bucket_sizes") }?.to_vec(),
    };
    let buckets2 = match d.num_buckets2 {
        0 if !d.bucket_sizes2.is_null() => {
            return Err(Error::invalid(
                "desc.bucket_sizes2 is set but desc.num_buckets2 is 0",
            ))
        }
        0 => Vec::new(),
        // SAFETY: the caller passes `num_buckets2` readable sizes.
        n => unsafe { arg_slice(d.bucket_sizes2, n, "desc.bucket_sizes2") }?.to_vec(),
    };
    let convert = |ts: &[graphed_tensor_desc], what: &str| -> Result<Vec<TensorSpec>> {
        ts.iter()
            .enumerate()
            .map(|(i, t)| tensor(t, &format!("{what}[{i}]")))
            .collect()
    };
    // Checked in this order: callbacks, inputs, outputs, parameters.
    let callbacks = CCallbacks {
        forward: d.forward.ok_or(Error::NullPointer {
            what: "desc.forward",
        })?,
        backward: d.backward.ok_or(Error::NullPointer {
            what: "desc.backward",
        })?,
        wgrad: d.wgrad,
        user_data: d.user_data,
        pre: d.pre_hook,
        post: d.post_hook,
        hook_data: d.hook_data,
    };
    let inputs = convert(&inputs, "desc.inputs")?;
    let outputs = convert(&outputs, "desc.outputs")?;
    if let Some(i) = outputs.iter().position(|t| t.chained.is_some()) {
        return Err(Error::invalid(format!(
            "desc.outputs[{i}].flags has GRAPHED_TENSOR_FLAGS_CHAINED: that is for inputs"
        )));
    }
    let params = params
        .iter()
        .enumerate()
        .map(|(i, p)| param(p, &format!("desc.params[{i}]")))
        .collect::<Result<Vec<_>>>()?;
    Ok((
        name,
        CallableSpec {
            name: String::new(),
            inputs,
            outputs,
            params,
            callbacks: Box::new(callbacks),
            buckets,
            buckets2,
        },
    ))
}

/// Registers a callable before capture; writes its index to `*index_out`.
/// Everything in the descriptor is copied: changing it afterwards changes
/// nothing.
///
/// # Safety
/// `desc` must point to a graphed_callable_desc initialised by its
/// _default() function, whose arrays hold the counts it states.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_add_callable(
    session: *mut graphed_session,
    desc: *const graphed_callable_desc,
    index_out: *mut u32,
) -> graphed_status {
    boundary("graphed_session_add_callable", || {
        let s = self::session(session)?;
        let out = arg_out(index_out, "index_out")?;
        // SAFETY: per this function's contract.
        let d = unsafe { read_struct(desc, "desc") }?;
        let (name, mut spec) = callable(&d)?;
        let mut guard = s.lock()?;
        spec.name = name.unwrap_or_else(|| format!("callable {}", guard.callable_count()));
        let index = guard.add_callable(spec)?;
        // SAFETY: checked non-NULL; written only on success.
        unsafe { out.write(index) };
        Ok(())
    })
}

/// Changes the graphed_param_flags of a registered parameter. Allowed only
/// before capture: capture freezes every parameter's grad policy, and a
/// later change gives GRAPHED_STATUS_WRONG_STATE.
#[no_mangle]
pub extern "C" fn graphed_session_set_param_flags(
    session: *mut graphed_session,
    callable: u32,
    param: u32,
    flags: u32,
) -> graphed_status {
    boundary("graphed_session_set_param_flags", || {
        let flags = graphed_param_flags::decode(flags, "flags")?;
        self::session(session)?
            .lock()?
            .set_param_flags(callable, param, flags)
    })
}

/// Writes the size in bytes of one element of `dtype` (a graphed_dtype
/// value) to `*size_out`: what a descriptor's `bytes` counts per element.
/// An unknown code is GRAPHED_STATUS_INVALID_ARGUMENT.
///
/// # Safety
/// `size_out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_dtype_size(dtype: u32, size_out: *mut usize) -> graphed_status {
    boundary("graphed_dtype_size", || {
        // SAFETY: per this function's contract.
        unsafe {
            write_answer(size_out, "size_out", || {
                Ok(graphed_dtype::decode(dtype, "dtype")?.size())
            })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_released_layouts_are_todays() {
        assert_eq!(graphed_tensor_desc::MIN_SIZE, 64);
        assert_eq!(
            size_of::<graphed_param_desc>(),
            graphed_param_desc::MIN_SIZE
        );
        assert_eq!(graphed_callable_desc::MIN_SIZE, 128);
        assert_eq!(
            size_of::<graphed_callable_desc>(),
            160,
            "with a grid of buckets"
        );
        assert_eq!(size_of::<graphed_tensor_desc>(), 72, "with dynamic_dim");
    }
}
