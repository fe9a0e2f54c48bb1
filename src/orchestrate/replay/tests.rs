//! Replays of host-backend sessions whose layers read their parameters
//! through library copies (which host graphs can point elsewhere): moved
//! parameters followed, refused, and checked, end to end.

use super::super::session::Session;
use super::super::spec::{ReplayArgs, StepCall};
use super::super::steps::StepRequest;
use super::super::testing::{floats, host_inputs, read_floats, Fixture, BYTES, N};
use crate::backend::{Backend, DevPtr, DeviceMemory, StreamRef};
use crate::core::layout::Role;
use crate::error::Error;
use std::sync::Arc;

/// A captured session of `f`'s callables.
fn session(f: Fixture) -> Session {
    let mut s = Session::new(f.backend.clone(), Some(f.pool.clone()), f.opts).unwrap();
    for c in f.callables {
        s.add_callable(c).unwrap();
    }
    for st in f.steps {
        s.add_step(StepRequest {
            callables: st.callables,
            param_dsts: Some(&st.param_dsts),
            microbatches: st.microbatches,
            io: st.io,
            looping: st.looping,
            capture_hook: st.capture_hook,
            update: st.update,
            collective: st.collective,
        })
        .unwrap();
    }
    s.capture().unwrap();
    s
}

fn args<'a>(
    callable: u32,
    data: Option<&'a [DevPtr]>,
    params: Option<&'a [DevPtr]>,
) -> ReplayArgs<'a> {
    ReplayArgs {
        callable,
        microbatch: 0,
        stream: StreamRef(0),
        side_stream: None,
        data,
        param_dsts: None,
        params,
        size: 0,
        size2: 0,
        device_size: 0,
    }
}

/// Memory holding `N` floats equal to `v`, `offset` bytes into a larger
/// allocation.
struct Moved {
    mem: DeviceMemory,
    offset: u64,
}

impl Moved {
    fn new(backend: &Arc<dyn Backend>, v: f32, offset: u64) -> Moved {
        let mem = DeviceMemory::new(backend, BYTES + 256).unwrap();
        backend.upload(mem.ptr() + offset, &floats(v)).unwrap();
        Moved { mem, offset }
    }
    fn ptr(&self) -> DevPtr {
        self.mem.ptr() + self.offset
    }
}

/// Memory made on `f`'s backend for each (value, offset) of `held` (as
/// `Moved::new`), the backend, and then a captured session of `f` (bound
/// in this order, the session is dropped first).
fn captured<const K: usize>(
    f: Fixture,
    held: [(f32, u64); K],
) -> ([Moved; K], Arc<dyn Backend>, Session) {
    let b = f.backend.clone();
    let held = held.map(|(v, offset)| Moved::new(&b, v, offset));
    (held, b, session(f))
}

/// One layer with two parameters (2.0 and 3.0) that its forward adds to
/// its input, both registered movable (or not).
fn layer(movable: bool) -> (Fixture, Vec<DeviceMemory>) {
    let mut f = host_inputs(&[("a", 2, false)]);
    let mem = f.reading_params(0, 2.0);
    f.backend.upload(mem[1].ptr(), &floats(3.0)).unwrap();
    for p in &mut f.callables[0].params {
        p.flags.rebind = movable;
    }
    (f, mem)
}

/// `layer(true)` run in buckets of 2 and `N` rows (its input and output
/// dynamic).
fn bucketed_layer() -> (Fixture, Vec<DeviceMemory>) {
    let (mut f, mem) = layer(true);
    let c = &mut f.callables[0];
    c.buckets = vec![2, N as u64];
    c.inputs[0].dynamic = true;
    c.outputs[0].dynamic = true;
    (f, mem)
}

/// The output of a forward of callable 0 on an input of ones.
fn forward(
    s: &mut Session,
    backend: &Arc<dyn Backend>,
    one: DevPtr,
    params: Option<&[DevPtr]>,
) -> crate::error::Result<f32> {
    let data = [one];
    let r = s.forward(&args(0, Some(&data), params))?;
    let out = r.first[0].ptr;
    Ok(read_floats(backend.as_ref(), out)[0])
}

#[test]
fn a_moved_parameter_is_read_at_its_new_address_only() {
    let (f, mut old) = layer(true);
    let ([one, ten], b, mut s) = captured(f, [(1.0, 0), (10.0, 0)]);
    let backend = b.clone();
    let st = s.stats();
    assert_eq!((st.params_movable, st.params_move_refused), (2, 0));
    assert_eq!(s.params_movable(0, 0).unwrap(), [true, true]);
    assert_eq!(
        forward(&mut s, &b, one.ptr(), None).unwrap(),
        1.0 + 2.0 + 3.0
    );
    // Verification put the parameters' bytes back.
    assert_eq!(read_floats(backend.as_ref(), old[0].ptr()), vec![2.0; N]);
    // Param 0 moves; param 1 stays (a NULL entry).
    let at = [ten.ptr(), 0];
    assert_eq!(
        forward(&mut s, &b, one.ptr(), Some(&at)).unwrap(),
        1.0 + 10.0 + 3.0
    );
    // The old memory is gone: later replays without addresses read the new one.
    old.remove(0);
    assert_eq!(
        forward(&mut s, &b, one.ptr(), None).unwrap(),
        1.0 + 10.0 + 3.0
    );
    assert_eq!(s.stats().param_moves, 1);
    // The same address again is no move.
    assert_eq!(forward(&mut s, &b, one.ptr(), Some(&at)).unwrap(), 14.0);
    assert_eq!(s.stats().param_moves, 1);
}

#[test]
fn a_parameter_that_cannot_move_is_refused_with_both_addresses_and_nothing_runs() {
    let (f, mem) = layer(false);
    let ([one, two, ten], b, mut s) = captured(f, [(1.0, 0), (2.0, 0), (10.0, 0)]);
    assert_eq!(s.params_movable(0, 0).unwrap(), [false, false]);
    assert_eq!(s.stats().params_move_refused, 0, "not asked");
    assert_eq!(forward(&mut s, &b, one.ptr(), None).unwrap(), 6.0);
    let input = s.buffers(0, 0, Role::Input).unwrap()[0];
    let at = [ten.ptr(), 0];
    let e = forward(&mut s, &b, two.ptr(), Some(&at)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::ParamMoved(_)), "{msg}");
    for want in [
        "param 0".to_string(),
        "callable 'a'".into(),
        format!("0x{:x}", mem[0].ptr()),
        format!("0x{:x}", ten.ptr()),
        "REBIND".into(),
    ] {
        assert!(msg.contains(&want), "{want} in: {msg}");
    }
    // Refused before anything was enqueued: the input was not copied in.
    assert_eq!(read_floats(b.as_ref(), input), vec![1.0; N]);
    // Its registered address is no move.
    let here = [mem[0].ptr(), mem[1].ptr()];
    assert_eq!(forward(&mut s, &b, two.ptr(), Some(&here)).unwrap(), 7.0);
}

#[test]
fn a_less_aligned_address_and_a_wrong_count_are_refused() {
    let (f, _mem) = layer(true);
    let ([one, odd], b, mut s) = captured(f, [(1.0, 0), (10.0, 4)]);
    let e = forward(&mut s, &b, one.ptr(), Some(&[odd.ptr(), 0])).unwrap_err();
    assert!(matches!(e, Error::ParamMoved(_)), "{e}");
    assert!(e.to_string().contains("aligned to 4 bytes"), "{e}");
    let e = forward(&mut s, &b, one.ptr(), Some(&[0])).unwrap_err();
    assert!(
        e.to_string().contains("1 parameter addresses were passed"),
        "{e}"
    );
    assert_eq!(forward(&mut s, &b, one.ptr(), None).unwrap(), 6.0);
    assert_eq!(s.stats().param_moves, 0);
}

#[test]
fn a_backward_reads_the_parameters_where_its_forward_did() {
    let (f, mem) = layer(true);
    let ([one, ten], b, mut s) = captured(f, [(1.0, 0), (10.0, 0)]);
    forward(&mut s, &b, one.ptr(), Some(&[ten.ptr(), 0])).unwrap();
    let grad = [one.ptr()];
    // NULL entries, and where its forward read them: accepted.
    assert!(s.backward(&args(0, Some(&grad), Some(&[0, 0]))).is_ok());
    // Where its forward read them: accepted.
    let same = [ten.ptr(), mem[1].ptr()];
    assert!(s.backward(&args(0, Some(&grad), Some(&same))).is_ok());
    forward(&mut s, &b, one.ptr(), Some(&same)).unwrap();
    let e = s
        .backward(&args(0, Some(&grad), Some(&[mem[0].ptr(), 0])))
        .err()
        .unwrap();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("where its forward did"), "{e}");
}

#[test]
fn parameters_the_host_cannot_see_into_are_refused_at_capture_with_the_reason() {
    // The fixture's plain layer runs library copies only; a layer of user
    // host tasks is opaque. Here: a parameter no graph reads at all is
    // verified (moving it changes nothing), an integer one is refused.
    let mut f = host_inputs(&[("a", 2, false)]);
    let _mem = f.reading_params(0, 2.0);
    f.callables[0].params[1].dtype = crate::core::dtype::DType::I32;
    for p in &mut f.callables[0].params {
        p.flags.rebind = true;
    }
    let s = session(f);
    assert_eq!(s.params_movable(0, 0).unwrap(), [true, false]);
    let st = s.stats();
    assert_eq!((st.params_movable, st.params_move_refused), (1, 1));
    let dump = s.plan_dump().unwrap();
    assert!(
        dump.contains("param 0 of a (microbatch 0): movable"),
        "{dump}"
    );
    assert!(
        dump.contains("param 1 of a (microbatch 0): fixed"),
        "{dump}"
    );
    assert!(dump.contains("i32 parameters stay"), "{dump}");
}

/// A step over layers a then b (b reads a's output), one parameter each
/// (2.0 and 3.0), both movable; with `tied`, b's parameter is a's.
fn step(tied: bool) -> (Session, Arc<dyn Backend>, Vec<DeviceMemory>) {
    let mut f = host_inputs(&[("a", 1, false), ("b", 1, false)]);
    let mut mem = f.reading_params(0, 2.0);
    mem.extend(f.reading_params(1, 3.0));
    if tied {
        f.callables[1].params[0].data = mem[0].ptr();
    }
    for c in &mut f.callables {
        c.params[0].flags.rebind = true;
    }
    f.callables[1].inputs[0].chained = Some((0, 0));
    f.steps
        .push(super::super::spec::StepSpec::plain(vec![0, 1], vec![0, 0]));
    let backend = f.backend.clone();
    let s = session(f);
    let input = s.buffers(0, 0, Role::Input).unwrap()[0];
    backend.upload(input, &floats(1.0)).unwrap();
    (s, backend, mem)
}

/// b's output after a replay of the step with the parameters at `at`.
fn step_out(
    s: &mut Session,
    b: &Arc<dyn Backend>,
    at: Option<&[DevPtr]>,
) -> crate::error::Result<f32> {
    s.step(&StepCall {
        params: at,
        ..StepCall::of(0, StreamRef(0))
    })?;
    let out = s.buffers(1, 0, Role::Output).unwrap()[0];
    Ok(read_floats(b.as_ref(), out)[0])
}

#[test]
fn a_step_follows_moved_parameters_in_its_own_graph() {
    let (mut s, b, mem) = step(false);
    let ten = Moved::new(&b, 10.0, 0);
    let odd = Moved::new(&b, 5.0, 4);
    assert_eq!(step_out(&mut s, &b, None).unwrap(), 1.0 + 2.0 + 3.0);
    assert_eq!(
        step_out(&mut s, &b, Some(&[ten.ptr(), 0])).unwrap(),
        1.0 + 10.0 + 3.0
    );
    assert_eq!(step_out(&mut s, &b, None).unwrap(), 1.0 + 10.0 + 3.0);
    // The step's graph moved, not a's own: a's forward alone still reads
    // the registered memory.
    let input = s_input(&s);
    assert_eq!(forward(&mut s, &b, input, None).unwrap(), 1.0 + 2.0);
    let call = |params| StepCall {
        params: Some(params),
        ..StepCall::of(0, StreamRef(0))
    };
    let e = s.step(&call(&[0])).err().unwrap();
    assert!(e.to_string().contains("passed to step 0"), "{e}");
    let e = s.step(&call(&[odd.ptr(), 0])).err().unwrap();
    assert!(matches!(e, Error::ParamMoved(_)), "{e}");
    assert!(e.to_string().contains("callable 'a'"), "{e}");
    // Back where it was registered.
    assert_eq!(step_out(&mut s, &b, Some(&[mem[0].ptr(), 0])).unwrap(), 6.0);
    assert_eq!(s.stats().param_moves, 2);
}

#[test]
fn a_step_that_cannot_follow_replays_pass_by_pass() {
    // b's parameter is a's: in the step's graphs they overlap, so the step
    // cannot move them apart; each callable's own graphs can.
    let (mut s, b, _mem) = step(true);
    let ten = Moved::new(&b, 10.0, 0);
    assert_eq!(step_out(&mut s, &b, None).unwrap(), 1.0 + 2.0 + 2.0);
    let at = [ten.ptr(), ten.ptr()];
    assert_eq!(step_out(&mut s, &b, Some(&at)).unwrap(), 1.0 + 10.0 + 10.0);
    // No addresses: where the last replay had them, pass by pass again.
    assert_eq!(step_out(&mut s, &b, None).unwrap(), 1.0 + 10.0 + 10.0);
    // Pass by pass: a's own forward followed.
    let input = s_input(&s);
    assert_eq!(forward(&mut s, &b, input, None).unwrap(), 1.0 + 10.0);
    let dump = s.plan_dump().unwrap();
    assert!(dump.contains("movable"), "{dump}");
}

/// Callable 0's static input (which holds ones).
fn s_input(s: &Session) -> DevPtr {
    s.buffers(0, 0, Role::Input).unwrap()[0]
}

#[test]
fn a_parameter_moved_in_one_bucket_is_read_there_by_every_bucket() {
    let (f, mut old) = bucketed_layer();
    let ([one, ten], b, mut s) = captured(f, [(1.0, 0), (10.0, 0)]);
    let run = |s: &mut Session, size: u64, params: Option<&[DevPtr]>| {
        let data = [one.ptr()];
        let a = ReplayArgs {
            size,
            ..args(0, Some(&data), params)
        };
        let r = s.forward(&a)?;
        assert_eq!(r.first[0].bytes, 4 * size as usize, "the actual rows");
        let out = r.first[0].ptr;
        crate::error::Result::Ok(read_floats(b.as_ref(), out)[0])
    };
    assert_eq!(run(&mut s, N as u64, None).unwrap(), 1.0 + 2.0 + 3.0);
    // Moved by a forward in the small bucket...
    assert_eq!(run(&mut s, 2, Some(&[ten.ptr(), 0])).unwrap(), 14.0);
    old.remove(0);
    // ... and read at the new address by the large one.
    assert_eq!(run(&mut s, N as u64, None).unwrap(), 14.0);
    assert_eq!(s.stats().param_moves, 1);
    assert!(matches!(
        run(&mut s, N as u64 + 1, None),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn param_addresses_say_where_the_graphs_read_the_parameters_after_each_move() {
    let (f, mem) = layer(true);
    let ([one, ten, odd], b, mut s) = captured(f, [(1.0, 0), (10.0, 0), (5.0, 4)]);
    let reg = [mem[0].ptr(), mem[1].ptr()];
    assert_eq!(s.param_addresses(0, 0).unwrap(), reg, "registered");
    forward(&mut s, &b, one.ptr(), Some(&[ten.ptr(), 0])).unwrap();
    let moved = [ten.ptr(), mem[1].ptr()];
    assert_eq!(s.param_addresses(0, 0).unwrap(), moved);
    // A refused move changes nothing; a backward moves nothing.
    assert!(forward(&mut s, &b, one.ptr(), Some(&[odd.ptr(), 0])).is_err());
    let grad = [one.ptr()];
    s.backward(&args(0, Some(&grad), None)).unwrap();
    assert_eq!(s.param_addresses(0, 0).unwrap(), moved);
    // What a forward given no address reads.
    assert_eq!(forward(&mut s, &b, one.ptr(), None).unwrap(), 14.0);
    forward(&mut s, &b, one.ptr(), Some(&reg)).unwrap();
    assert_eq!(s.param_addresses(0, 0).unwrap(), reg, "moved back");
    let e = s.param_addresses(0, 1).unwrap_err();
    assert!(e.to_string().contains("microbatch 1 does not exist"), "{e}");
    let e = s.param_addresses(1, 0).unwrap_err();
    assert!(e.to_string().contains("callable 1 does not exist"), "{e}");
    s.release_callable(0).unwrap();
    let e = s.param_addresses(0, 0).unwrap_err();
    assert!(matches!(e, Error::CallableReleased(_)), "{e}");
    s.reset().unwrap();
    let e = s.param_addresses(0, 0).unwrap_err();
    assert!(matches!(e, Error::SessionReset(_)), "{e}");
}

#[test]
fn param_addresses_of_a_step_s_callables_move_only_pass_by_pass() {
    // The step's own graph follows: its callables' graphs stay.
    let (mut s, b, mem) = step(false);
    let ten = Moved::new(&b, 10.0, 0);
    step_out(&mut s, &b, Some(&[ten.ptr(), 0])).unwrap();
    assert_eq!(s.param_addresses(0, 0).unwrap(), [mem[0].ptr()]);
    assert_eq!(s.param_addresses(1, 0).unwrap(), [mem[1].ptr()]);
    // Tied parameters: the step replays pass by pass, each forward moving
    // its callable's graphs.
    let (mut s, b, _mem) = step(true);
    let ten = Moved::new(&b, 10.0, 0);
    step_out(&mut s, &b, Some(&[ten.ptr(), ten.ptr()])).unwrap();
    assert_eq!(s.param_addresses(0, 0).unwrap(), [ten.ptr()]);
    assert_eq!(s.param_addresses(1, 0).unwrap(), [ten.ptr()]);
}

#[test]
fn buckets_answer_the_bucket_a_size_runs_their_instances_and_one_address() {
    let (f, mem) = bucketed_layer();
    let ([one, ten, other], _, mut s) = captured(f, [(1.0, 0), (10.0, 0), (7.0, 0)]);
    let n = N as u64;
    assert_eq!(s.bucket_of(0, (1, 0)).unwrap(), (0, (2, 0)));
    assert_eq!(s.bucket_of(0, (2, 0)).unwrap(), (0, (2, 0)));
    assert_eq!(s.bucket_of(0, (3, 0)).unwrap(), (1, (n, 0)));
    assert_eq!(s.bucket_of(0, (n, 0)).unwrap(), (1, (n, 0)));
    for (size, words) in [
        (n + 1, format!("size {} is above the largest bucket", n + 1)),
        (0, "names its actual size (size)".to_string()),
    ] {
        let e = s.bucket_of(0, (size, 0)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains(&words), "{e}");
        assert!(e.to_string().contains("callable 'a'"), "{e}");
    }
    assert_eq!(
        (
            s.instance_of(0, 0, 0).unwrap(),
            s.instance_of(0, 0, 1).unwrap()
        ),
        (0, 1)
    );
    let e = s.instance_of(0, 0, 2).unwrap_err();
    assert!(e.to_string().contains("it has 2 buckets"), "{e}");
    let e = s.instance_of(0, 1, 0).unwrap_err();
    assert!(e.to_string().contains("microbatch 1 does not exist"), "{e}");
    // A forward in the small bucket moves every bucket's graphs.
    let data = [one.ptr()];
    let at = [ten.ptr(), 0];
    s.forward(&ReplayArgs {
        size: 2,
        ..args(0, Some(&data), Some(&at))
    })
    .unwrap();
    assert_eq!(s.param_addresses(0, 0).unwrap(), [ten.ptr(), mem[1].ptr()]);
    // Buckets whose graphs read a parameter at different addresses (as
    // after a rebind that failed part way): no one address to answer.
    let super::super::session::State::Captured(cap) = &mut s.state else {
        panic!("captured")
    };
    let first = cap.by_callable[0][0];
    cap.instances[first].params[0].bind(other.ptr()).unwrap();
    assert_eq!(s.param_addresses(0, 0).unwrap(), [0, mem[1].ptr()]);
}

/// What step 0 of `s` says when it refuses its parameter moved to `to`.
fn refused_move(s: &mut Session, to: DevPtr) -> String {
    let e = s
        .step(&StepCall {
            params: Some(&[to]),
            ..StepCall::of(0, StreamRef(0))
        })
        .err()
        .unwrap();
    assert!(matches!(e, Error::ParamMoved(_)), "{e}");
    e.to_string()
}

#[test]
fn a_step_with_an_update_refuses_a_move_its_callables_could_follow() {
    use super::super::spec::{UpdateSpec, UpdateView};
    let mut f = host_inputs(&[("a", 1, false)]);
    let mem = f.reading_params(0, 2.0);
    f.callables[0].params[0].flags.rebind = true;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let mut st = super::super::spec::StepSpec::plain(vec![0], vec![0]);
    st.update = Some(UpdateSpec {
        callback: Arc::new(move |v: &UpdateView| {
            log.lock().unwrap().push((v.phase, v.params[0], v.grads[0]));
            Ok(())
        }),
        check: false,
        scalar_bytes: 0,
    });
    f.steps.push(st);
    let backend = f.backend.clone();
    let mut s = session(f);
    // One apply per clone slot's graph, each told where its block is.
    let calls = seen.lock().unwrap().clone();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls.iter().all(|c| c.1 == mem[0].ptr()));
    assert_ne!(calls[0].2, calls[1].2, "each slot's own block");
    let moved = Moved::new(&backend, 7.0, 0);
    // The callable's own forward follows the move...
    let input = s_input(&s);
    assert_eq!(
        forward(&mut s, &backend, input, Some(&[moved.ptr()])).unwrap(),
        7.0
    );
    // ... the step with an update does not, and says why.
    let text = refused_move(&mut s, moved.ptr());
    assert!(
        text.contains("runs its passes and its update in one graph"),
        "{text}"
    );
    assert!(
        text.contains("the step updates its parameters in its graph"),
        "{text}"
    );
    assert_eq!(s.stats().param_moves, 1, "the forward's move only");
}

#[test]
fn a_step_with_collectives_is_not_replayed_to_verify_a_move() {
    use super::super::spec::{CollectiveAt, CollectiveRecord, CollectiveSpec, CollectiveView};
    use crate::core::collective::CollectiveOp;
    use crate::core::dtype::DType;
    let mut f = host_inputs(&[("a", 1, false)]);
    let _mem = f.reading_params(0, 2.0);
    f.callables[0].params[0].flags.rebind = true;
    let backend = f.backend.clone();
    // The "collective" sets a word: any replay of the step's graph shows.
    let ran = DeviceMemory::new(&backend, 4).unwrap();
    backend.upload(ran.ptr(), &[0; 4]).unwrap();
    let (b, word) = (backend.clone(), ran.ptr());
    let mut st = super::super::spec::StepSpec::plain(vec![0], vec![0]);
    st.collective = Some(CollectiveSpec {
        callback: Arc::new(move |v: &CollectiveView| {
            b.fill(word, 1, 4, 1, v.stream)
                .map_err(|e| (1, e.to_string()))?;
            Ok(vec![CollectiveRecord {
                communicator: 1,
                op: CollectiveOp::AllReduce,
                bytes: 4,
                dtype: DType::F32,
            }])
        }),
        at: CollectiveAt::AfterBackward,
        exchange: None,
        rank: 0,
        ranks: 1,
    });
    f.steps.push(st);
    let mut s = session(f);
    let mut word = [0u8; 4];
    backend.download(&mut word, ran.ptr()).unwrap();
    assert_eq!(word, [0; 4], "capture replayed the step's collectives");
    let moved = Moved::new(&backend, 7.0, 0);
    let text = refused_move(&mut s, moved.ptr());
    assert!(text.contains("records collectives in its graph"), "{text}");
}
