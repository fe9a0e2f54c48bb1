//! Fuzz target over call sequences of graphed's C ABI, on the host backend.
//!
//! The input bytes are a program: each op reads an opcode and its arguments
//! from the input (an exhausted input reads zeros, which pick the plain,
//! valid choice, so short inputs still reach capture and replays). Ops
//! create sessions from fuzzed configs (garbage magic and sizes, flags of 2,
//! schedules, shared pools, allocators, hooks), register callables with
//! fuzzed descriptors, capture, replay forward/backward/weight-grad with
//! fuzzed arguments, release and retain clone blocks and leases (live,
//! stale and forged), query stats, buffers, policies and the plan dump,
//! the bucket a size runs, instance numbers and parameter addresses,
//! release callables of captured sessions and ask what graphed holds
//! (the process's figures, each callable's memory), write the captured
//! graphs as DOT text, make host kernels fault before replays of sessions
//! in debug mode and before synchronizes, declare steps (over
//! microbatches, with io copies into harness memory,
//! unrolled or looping on the device, over callables with external
//! buffers, with a capture hook that may fail, in descriptors of every
//! layout) and replay them (with a microbatch count); in a session of its
//! own (`steps/update.rs`), a step with an update stage (an optimizer
//! checked bit for bit against a model, a check that skips it, scalars of
//! every size, update callbacks that fail or break the capture, the skip
//! flag's query), and a step with a collective stage (`steps/collective.rs`:
//! fuzzed records, failing and capture-breaking callbacks, an exchange
//! with a faked second rank, the manifest's query with fuzzed capacity
//! and entry size, the grads the collectives doubled bit for bit), reset
//! and destroy in
//! any order; replays and step replays are given the
//! parameters' addresses (registered, NULL, moved, aligned or not, wrong
//! counts), which the host backend never follows here (PARAM_MOVED, and a
//! refusal changes nothing); in a session of their own whose callables
//! record no work (`moves`), parameters do move, and a model checks that a
//! refused call counts no move and leaves the addresses a later replay
//! given none reads where they were. The callbacks read their behaviour from
//! the input too: return non-zero, allocate scratch of any size, free it
//! twice, synchronize under capture, keep their in-call handles, call back
//! into their own session, replay another session on their capturing
//! stream, capture another session, destroy sessions, hand over external
//! buffers or not.
//!
//! A model of every session runs beside the library, and every call's
//! status is checked against it: the exact status where the model knows it
//! (argument checks in the library's order, BUSY from callbacks,
//! STREAM_CAPTURING, USE_AFTER_DESTROY for stale handles, INVALID_ARGUMENT
//! for forged ones, the failure a capture must report), never INTERNAL, a
//! message naming the function on every failure, outputs untouched on
//! failure. Successful replays are checked for what they return: ref kinds
//! by frozen policy, aliases and clones holding what the captured graph
//! wrote, COPY_INTO and ACCUMULATE_INTO destinations updated, clones kept
//! intact until released, leases never handed out twice, stats agreeing
//! with the model. At the end of each input everything is released, the
//! handle table must be empty and graphed must hold nothing (no byte, no
//! allocation, no session, no graph); LeakSanitizer checks the rest.
//!
//! Sizes are either small or impossible (at least 2^41 bytes, which no
//! allocator here grants), so that a run never needs real memory beyond a
//! few MiB. GRAPHED_FUZZ_WAIVE (comma-separated names, see `waived`) turns
//! off the checks of library bugs this target found (all fixed, each with a
//! reproducer in tests/abi_regressions.rs), to look past a regression of
//! one while hunting another.
//!
//! The target is split by area, under `c_abi/`: the input decoding and the
//! model, the per-call checks, handles and streams, then one module per
//! part of the API (sessions, callables, capture, callbacks, replays,
//! parameters that move, buffers and leases, queries, schedule helpers,
//! steps). `run` below reads
//! the ops and dispatches them.

#![no_main]

use graphed::core::handle::{self as table, Kind};
use graphed::ffi::*;
use libfuzzer_sys::fuzz_target;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::mem::size_of;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use graphed_status as S;

/// GRAPHED_FUZZ_TRACE=1 prints each op, to read a crashing input.
fn tracing() -> bool {
    static T: OnceLock<bool> = OnceLock::new();
    *T.get_or_init(|| std::env::var_os("GRAPHED_FUZZ_TRACE").is_some())
}

macro_rules! trace {
    ($($a:tt)*) => {
        if tracing() {
            eprintln!($($a)*);
        }
    };
}

#[path = "c_abi/answers.rs"]
mod answers;
#[path = "c_abi/buffers.rs"]
mod buffers;
#[path = "c_abi/callables.rs"]
mod callables;
#[path = "c_abi/callbacks/mod.rs"]
mod callbacks;
#[path = "c_abi/capture.rs"]
mod capture;
#[path = "c_abi/checks.rs"]
mod checks;
#[path = "c_abi/debug.rs"]
mod debug;
#[path = "c_abi/handles.rs"]
mod handles;
#[path = "c_abi/input.rs"]
mod input;
#[path = "c_abi/memory.rs"]
mod memory;
#[path = "c_abi/moves.rs"]
mod moves;
#[path = "c_abi/params.rs"]
mod params;
#[path = "c_abi/queries.rs"]
mod queries;
#[path = "c_abi/replay/mod.rs"]
mod replay;
#[path = "c_abi/schedules.rs"]
mod schedules;
#[path = "c_abi/sessions.rs"]
mod sessions;
#[path = "c_abi/steps/mod.rs"]
mod steps;
#[path = "c_abi/streams.rs"]
mod streams;
#[path = "c_abi/world.rs"]
mod world;

use answers::*;
use buffers::*;
use callables::*;
use callbacks::*;
use capture::*;
use checks::*;
use debug::*;
use handles::*;
use input::*;
use memory::*;
use moves::*;
use params::*;
use queries::*;
use replay::*;
use schedules::*;
use sessions::*;
use steps::*;
use streams::*;
use world::*;

/// Releases everything, destroys every session, and checks that nothing of
/// graphed's is left.
fn teardown() {
    let wd = w();
    loop {
        let b = wd.blocks.borrow_mut().pop();
        let Some(b) = b else { break };
        for _ in 0..b.refs {
            assert_eq!(
                graphed_buffer_release(b.owner as *mut _),
                S::Ok,
                "{}",
                msg()
            );
        }
    }
    let n = wd.sessions.borrow().len();
    // Destroy in a fuzzed order.
    let mut order: Vec<usize> = (0..n).collect();
    for j in (1..n).rev() {
        order.swap(j, wd.input.below(j + 1));
    }
    for k in order {
        let (alive, h) = {
            let s = &wd.sessions.borrow()[k];
            (s.alive, s.h)
        };
        if alive {
            assert_eq!(
                graphed_session_destroy(h as *mut _),
                S::Ok,
                "teardown: {}",
                msg()
            );
            wd.sessions.borrow_mut()[k].alive = false;
        }
    }
    for kind in [
        Kind::Session,
        Kind::Buffer,
        Kind::Scratch,
        Kind::Capture,
        Kind::HostStream,
    ] {
        assert_eq!(
            table::count(kind),
            0,
            "{} handles left after every session was destroyed",
            kind.name()
        );
    }
    assert!(
        wd.allocs.borrow().is_empty(),
        "clone_alloc memory never given back through clone_free"
    );
    check_held_nothing();
}

fn run(data: &[u8]) {
    let world = World {
        input: Input {
            data: data.to_vec(),
            pos: Cell::new(0),
        },
        sessions: RefCell::default(),
        mem: RefCell::default(),
        fills: RefCell::default(),
        cbs: RefCell::default(),
        ctxs: RefCell::default(),
        ext: RefCell::default(),
        blocks: RefCell::default(),
        stale_blocks: RefCell::default(),
        leases: RefCell::default(),
        stale_leases: RefCell::default(),
        kept_scratch: RefCell::default(),
        kept_capture: RefCell::default(),
        kept_streams: RefCell::default(),
        allocs: RefCell::default(),
        frames: RefCell::default(),
        pinned: RefCell::default(),
        attempts: Cell::new(0),
        depth: Cell::new(0),
        pools: Cell::new(0),
    };
    WORLD.with(|c| c.set(&world));
    let i = &world.input;
    let mut ops = 0;
    while !i.done() && ops < 200 {
        ops += 1;
        let at = i.pos.get();
        let b = i.byte();
        let op = b % 24;
        trace!("op {op} ({b}) at {at}");
        if b >= 248 {
            // The parameters' addresses and whether they can move, and
            // steps over microbatches with io copies: the last byte values
            // (read as ops 8 to 15 before), so that inputs without them
            // keep their meaning.
            match b {
                248 | 250 => op_replay_params(0),
                // Once op_replay_params(0) too: the inputs that read it
                // here (18 of the committed 2083) now declare a step.
                249 => op_add_step_io(),
                251 => op_replay_params(1),
                252 => op_replay_params(2),
                253 => op_step_replay_params(),
                // Once op_step_replay_params too.
                254 => op_debug(),
                _ => op_params_movable(),
            }
        } else {
            match op {
                0 | 1 => op_create(),
                2 | 3 | 4 => op_add_callable(),
                5 => op_set_param_flags(),
                // Sessions with steps are the rarest to capture: preferred.
                6 | 7 => op_capture(target_where(|s| s.st == St::Open && !s.steps.is_empty())),
                8 | 9 | 10 => op_replay(target(), 0, None),
                11 | 12 => op_replay(target(), 1, None),
                13 => op_replay(target(), 2, None),
                14 | 15 => op_buffer(),
                16 => op_lease(),
                17 => op_stats(),
                18 => op_query(),
                19 => op_reset(target()),
                20 => op_destroy(target()),
                21 => op_schedule_helpers(),
                22 => use_kept(),
                // i.below(12), read as its byte: 251 (once op_misc)
                // moves parameters in a session of its own; 248 to 250
                // (once op_driver_version, op_release_on and
                // op_schedule_passes) ask about and give back memory; 252
                // to 254 (once op_add_step) ask which bucket a size runs,
                // instance numbers and parameter addresses; 247 (once
                // op_arity) which bucket of a grid two sizes run; every
                // other byte keeps its meaning.
                _ => match i.byte() {
                    251 => op_moving_params(),
                    248 => op_memory_stats(),
                    249 => op_release_callable(),
                    250 => op_callable_memory(),
                    252 => op_bucket_of(),
                    247 => op_bucket_of2(),
                    253 => op_instance_of(),
                    254 => op_param_addresses(),
                    // Once op_step_replay (255 % 12) too.
                    255 => op_step_update(),
                    // Once op_step_replay (243 % 12) too.
                    243 => op_step_collective(),
                    b => match b % 12 {
                        0..=2 => op_add_step(),
                        3..=5 => op_step_replay(),
                        6 => op_destroy_when_idle(target()),
                        7 => op_arity(),
                        8 => op_driver_version(),
                        9 => op_release_on(),
                        10 => op_schedule_passes(),
                        _ => op_misc(),
                    },
                },
            }
        }
        assert!(world.frames.borrow().is_empty() && world.pinned.borrow().is_empty());
        check_clones();
        check_all_stats();
    }
    teardown();
    WORLD.with(|c| c.set(null()));
    drop(world);
}

fuzz_target!(|data: &[u8]| {
    run(data);
});
