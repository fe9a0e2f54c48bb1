//! A step's collective stage (graphed_step_desc.collective, collective_at,
//! collective_exchange, collective_rank, collective_ranks;
//! graphed_collective_record; graphed_step_collectives), in a session of
//! its own: one callable `y = w * x` (backward `gw = x * gy`) over 1 to 3
//! microbatches copied in by io, unrolled or looping on the device, its
//! grad COPY_INTO or CLONE (with 0 to 2 clone slots). The collective
//! callback records 0 to 3 collectives of fuzzed operations and dtypes
//! (a refused record declares nothing), each valid one enqueuing a task
//! that doubles the grad (the "collective"); it may fail, break the
//! capture, record with a forged ctx, or record one more in the graph of
//! clone slot 1; a ctx kept from it is refused afterwards. An exchange
//! (1 rank, or 2 with a faked other rank: the same manifest, a failed
//! capture, one collective more, garbage, a huge count, a changed entry)
//! or none. Declarations, captures, replays (the grad doubled once per
//! valid record, bit for bit) and manifest queries (fuzzed capacity,
//! entry size, NULL pointers) are checked against a model.
//!
//! The callbacks and the faked ranks are `callbacks.rs`; the manifest
//! query's checks `query.rs`; the replays' checks `replays.rs`.

mod callbacks;
mod query;
mod replays;

use super::*;
use callbacks::*;
use query::query;
use replays::replays;

/// Builds, captures, replays, queries and destroys a session with a
/// collective step.
pub fn op_step_collective() {
    let i = &w().input;
    let what = "a step's collective";
    let mut u = Box::new(Coll {
        w: [0.5, -0.25, 1.0, 2.0],
        xg: [0.0; 6 * N],
        dst: [0.0; N],
        recs: Vec::new(),
        mode: 0,
        fake: 0,
        rank: 0,
        ranks: 1,
        garbage: [0; 24],
        calls: Vec::new(),
        kept: 0,
        tasks: Vec::new(),
    });
    let mut cfg = graphed_session_config_default();
    cfg.backend = graphed_backend::Host as u32;
    cfg.warmup_iterations = 1;
    let slots = i.below(3) as u32;
    cfg.clone_slots = slots;
    let mut h = null_mut();
    // SAFETY: a valid config and out pointer.
    let r = unsafe { graphed_session_create(&cfg, &mut h) };
    expect(r, &[S::Ok], "graphed_session_create", what);
    let policy = i.pick(&[graphed_grad_policy::CopyInto, graphed_grad_policy::Clone]);
    let t = graphed_tensor_desc {
        bytes: BYTES,
        ..graphed_tensor_desc_default()
    };
    let out = graphed_tensor_desc {
        requires_grad: 1,
        ..t
    };
    let params = [graphed_param_desc {
        data: u.w.as_mut_ptr().cast(),
        bytes: BYTES,
        policy: policy as u32,
        ..graphed_param_desc_default()
    }];
    let mut d = graphed_callable_desc_default();
    d.num_inputs = 1;
    d.inputs = &t;
    d.num_outputs = 1;
    d.outputs = &out;
    d.num_params = 1;
    d.params = params.as_ptr();
    d.forward = Some(fwd);
    d.backward = Some(bwd);
    let data: *mut Coll = &mut *u;
    d.user_data = data.cast();
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    let r = unsafe { graphed_session_add_callable(h, &d, &mut idx) };
    expect(r, &[S::Ok], "graphed_session_add_callable", what);
    // The step and its collective stage.
    let mbs = 1 + i.below(3);
    let looping = i.chance(100);
    let per_callable = i.chance(100);
    for _ in 0..i.below(4) {
        let op = i.pick(&[0u32, 0, 1, 2, 3, 4, 5, 99]);
        let dtype = i.pick(&[0u32, 0, 1, 8, 9, 200]);
        let bytes = i.pick(&[BYTES as u64, 0, 8, u64::MAX]);
        let comm = i.pick(&[7u64, 0, u64::MAX]);
        u.recs.push((op, dtype, bytes, comm));
    }
    u.mode = match i.below(24) {
        m @ 1..=5 => m as u8,
        _ => 0,
    };
    let with_exchange = i.chance(120);
    if with_exchange {
        u.ranks = 1 + i.below(2);
        u.rank = i.below(u.ranks);
        u.fake = match i.below(12) {
            f @ 1..=6 => f as u8,
            _ => 0,
        };
        for b in u.garbage.iter_mut() {
            *b = i.byte();
        }
    }
    // A fault in the declaration: 1 data without the callback, 2 a bad
    // point, 3 the rank out of range, 4 exchange data without the
    // exchange, 5 no collective stage at all (valid).
    let fault = match i.below(20) {
        f @ 1..=5 => f,
        _ => 0,
    };
    let xg = u.xg.as_mut_ptr();
    let io = [
        graphed_step_io {
            role: graphed_buffer_role::Input as u32,
            ptr: xg.cast(),
            stride: 2 * BYTES,
            ..graphed_step_io_default()
        },
        graphed_step_io {
            role: graphed_buffer_role::GradOutput as u32,
            // SAFETY: inside the op's buffer.
            ptr: unsafe { xg.add(N) }.cast(),
            stride: 2 * BYTES,
            ..graphed_step_io_default()
        },
    ];
    let dsts = [u.dst.as_mut_ptr().cast::<c_void>()];
    let callables = [0u32];
    let mut sd = graphed_step_desc_default();
    sd.callables = callables.as_ptr();
    sd.num_callables = 1;
    sd.microbatches = mbs as u32;
    sd.loop_mode = if looping {
        graphed_step_loop::While as u32
    } else {
        graphed_step_loop::Unrolled as u32
    };
    sd.io = io.as_ptr();
    sd.num_io = 2;
    if policy != graphed_grad_policy::Clone {
        sd.param_dsts = dsts.as_ptr();
        sd.num_param_dsts = 1;
    }
    sd.collective = Some(collective);
    sd.collective_data = data.cast();
    sd.collective_at = if per_callable {
        graphed_collective_at::PerCallable as u32
    } else {
        graphed_collective_at::AfterBackward as u32
    };
    if with_exchange {
        sd.collective_exchange = Some(exchange);
        sd.collective_exchange_data = data.cast();
    }
    sd.collective_rank = u.rank as u32;
    sd.collective_ranks = u.ranks as u32;
    match fault {
        1 => sd.collective = None,
        2 => sd.collective_at = 2,
        3 => sd.collective_rank = sd.collective_ranks,
        4 => {
            sd.collective_exchange = None;
            sd.collective_exchange_data = data.cast();
        }
        5 => {
            sd.collective = None;
            sd.collective_data = null_mut();
            sd.collective_exchange = None;
            sd.collective_exchange_data = null_mut();
            sd.collective_rank = 0;
            sd.collective_ranks = 1;
        }
        _ => {}
    }
    let declared = match fault {
        1..=4 => S::InvalidArgument,
        _ => S::Ok,
    };
    let mut step = 0;
    // SAFETY: valid descriptor and out pointer.
    let r = unsafe { graphed_session_add_step(h, &sd, &mut step) };
    expect(r, &[declared], "graphed_session_add_step", what);
    let stage = fault != 5;
    if declared == S::Ok {
        let r = graphed_session_capture(h);
        let graphs = if policy == graphed_grad_policy::Clone {
            slots as usize
        } else {
            1
        };
        let own = match u.mode {
            _ if policy == graphed_grad_policy::Clone && slots == 0 => Some(S::Incompatible),
            _ if !stage => None,
            1 | 4 => Some(S::CallbackFailed),
            2 => Some(S::CaptureInvalidated),
            5 if graphs > 1 => Some(S::CollectiveMismatch),
            _ => None,
        };
        let ex = match (stage && with_exchange, u.fake) {
            (false, _) => None,
            (true, 5) => Some(S::CallbackFailed),
            (true, _) if u.ranks == 1 => None,
            (true, 0) => None,
            (true, 6) if u.recs.iter().all(|r| !valid(r)) => None,
            (true, _) => Some(S::CollectiveMismatch),
        };
        let want: Vec<graphed_status> = match (own, ex) {
            (Some(S::Incompatible), _) => vec![S::Incompatible],
            (Some(o), Some(e)) => vec![o, e],
            (Some(o), None) => vec![o],
            (None, Some(e)) => vec![e],
            (None, None) => vec![S::Ok],
        };
        trace!(
            "  collective: {} records, mode {}, exchange {with_exchange} ({} of {}, fake {}), \
             {policy:?}, {slots} slots: capture {r:?}",
            u.recs.len(),
            u.mode,
            u.rank,
            u.ranks,
            u.fake
        );
        expect(r, &want, "graphed_session_capture", what);
        // A ctx kept from the callback is refused afterwards.
        if u.kept != 0 {
            // SAFETY: compared, never read.
            let st = unsafe {
                graphed_collective_record(u.kept as *const graphed_collective_ctx, 7, 0, 4, 0)
            };
            expect(
                st,
                &[S::WrongState],
                "graphed_collective_record",
                "a kept ctx",
            );
        }
        // SAFETY: a NULL ctx is refused.
        let st = unsafe { graphed_collective_record(null(), 7, 0, 4, 0) };
        expect(st, &[S::NullPointer], "graphed_collective_record", "NULL");
        if r == S::Ok {
            if stage {
                let want_calls = graphs.max(1);
                assert_eq!(u.calls.len(), want_calls, "called once per graph");
            } else {
                assert!(u.calls.is_empty(), "no collective stage, no call");
            }
            let manifest: Vec<Rec> = if stage {
                u.recs.iter().copied().filter(valid).collect()
            } else {
                Vec::new()
            };
            query(h, stage, &manifest, per_callable);
            replays(h, &mut u, mbs, looping, policy, manifest.len());
        } else {
            let mut n = 77usize;
            // SAFETY: a valid count pointer.
            let st = unsafe { graphed_step_collectives(h, 0, null_mut(), 0, ENTRY, &mut n) };
            post(st, "graphed_step_collectives");
            assert!(
                st != S::Ok && st != S::Internal,
                "graphed_step_collectives after a failed capture: {st:?}"
            );
            assert_eq!(n, 77, "written on failure");
        }
    }
    expect(
        graphed_session_destroy(h),
        &[S::Ok],
        "graphed_session_destroy",
        what,
    );
    drop(u);
}
