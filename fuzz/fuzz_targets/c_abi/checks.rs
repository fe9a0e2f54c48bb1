//! The checks every call gets (never INTERNAL, a known code, a message
//! naming the function on failure, the expected status), those after
//! every op (held clones intact, stats as the model says), and the out
//! structs of queries (headers fuzzed, untouched on failure, nothing
//! written past them).

use super::*;

pub fn msg() -> String {
    // SAFETY: graphed returns a NUL-terminated thread-local string.
    unsafe { CStr::from_ptr(graphed_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Marks the thread's last message, so that a failure that sets none shows.
pub fn mark() {
    let _ = graphed_buffer_retain(null_mut());
}

/// Every call's common checks: never INTERNAL, a known code, and a message
/// naming the function on failure.
pub fn post(st: graphed_status, func: &str) {
    let code = st as u32;
    assert!(
        code <= S::CollectiveMismatch as u32,
        "{func}: status {code} out of range"
    );
    assert!(st != S::Internal, "{func} returned INTERNAL: {}", msg());
    if st != S::Ok {
        let m = msg();
        assert!(
            m.starts_with(&format!("{func}: ")),
            "{func} failed with {st:?} but the message is {m:?}"
        );
        // SAFETY: a static NUL-terminated string.
        let name = unsafe { CStr::from_ptr(graphed_status_name(code)) };
        assert!(name.to_bytes().starts_with(b"GRAPHED_STATUS_"));
    }
}

/// Keeps the first error of a sequence of checks.
pub fn first(want: &mut Option<graphed_status>, e: Option<graphed_status>) {
    if want.is_none() {
        *want = e;
    }
}

/// A query of a session's instances in state `st`: refused before capture
/// and after a reset.
pub fn state_err(st: St) -> Option<graphed_status> {
    match st {
        St::Open => Some(S::WrongState),
        St::Reset => Some(S::SessionReset),
        St::Captured => None,
    }
}

/// A query of callable `c`'s microbatch `mb` of a session in state `st`
/// (of callables `cls` and `mbs` microbatches), after the checks in
/// `want`: its state, then an unknown callable or microbatch. The
/// callable, where it and the microbatch exist.
pub fn instance_at<'a>(
    want: &mut Option<graphed_status>,
    st: St,
    cls: &'a [Callable],
    mbs: u32,
    c: u32,
    mb: u32,
) -> Option<&'a Callable> {
    first(want, state_err(st));
    let cl = cls.get(c as usize).filter(|_| mb < mbs);
    first(want, cl.is_none().then_some(S::InvalidArgument));
    cl
}

pub fn expect(st: graphed_status, want: &[graphed_status], func: &str, what: &str) {
    post(st, func);
    assert!(
        want.contains(&st),
        "{func} ({what}) returned {st:?}, expected one of {want:?}; message: {}",
        msg()
    );
}

/// After a query that writes one value: the status `want` (OK where
/// None); on success the value `got` is the model's `answer`, on failure
/// it is still what it was `before` the call.
pub fn expect_answer<T: PartialEq + std::fmt::Debug>(
    r: graphed_status,
    want: Option<graphed_status>,
    func: &str,
    what: &str,
    (got, before): (T, T),
    answer: Option<T>,
) {
    expect(r, &[want.unwrap_or(S::Ok)], func, what);
    if r == S::Ok {
        assert_eq!(Some(got), answer, "{func}: {what}");
    } else {
        assert_eq!(got, before, "{func} ({what}) written on failure");
    }
}

/// Clones stay what they were until released, whatever ran since.
pub fn check_clones() {
    for b in w().blocks.borrow().iter() {
        for &(p, n, v) in &b.grads {
            assert!(
                all_bytes(p, n, v),
                "a held clone changed before its release"
            );
        }
        for &(p, n, v, width) in &b.words {
            assert!(
                all_words(p, n, v, width),
                "a held clone (a sum over microbatches) changed before its release"
            );
        }
    }
}

pub fn check_all_stats() {
    let wd = w();
    let n = wd.sessions.borrow().len();
    for k in 0..n {
        let (alive, h) = {
            let s = &wd.sessions.borrow()[k];
            (s.alive, s.h)
        };
        if !alive {
            continue;
        }
        let mut st = graphed_session_stats_default();
        // SAFETY: a full struct.
        let r = unsafe { graphed_session_stats_get(h as *mut _, &mut st) };
        expect(r, &[S::Ok], "graphed_session_stats_get", "idle session");
        check_stats(k, &st);
    }
}

/// A struct of the ABI that a query fills, headed by its size and magic.
pub trait OutStruct: Copy {
    fn header(&mut self) -> (&mut usize, &mut u32);
}

macro_rules! out_structs {
    ($($t:ty),*) => {$(
        impl OutStruct for $t {
            fn header(&mut self) -> (&mut usize, &mut u32) {
                (&mut self.struct_size, &mut self.magic)
            }
        }
    )*};
}

out_structs!(
    graphed_session_stats,
    graphed_memory_stats,
    graphed_callable_memory
);

/// A query's out struct as an op passes it: at the front of a buffer with
/// room past it, its header fuzzed, or NULL.
pub struct Out<T> {
    buf: Vec<u64>,
    before: Vec<u64>,
    /// The struct as written before the call.
    pub m: T,
    null: bool,
    /// The refusal its header or NULL asks for.
    pub err: Option<graphed_status>,
}

impl<T: OutStruct> Out<T> {
    /// `m` with a magic from `magics`, a size from `sizes`, a larger size,
    /// NULL instead, or as it is, as the input says.
    pub fn fuzzed(mut m: T, magics: &[u32], sizes: &[usize]) -> Out<T> {
        let i = &w().input;
        let mut err = None;
        let mut null = false;
        match i.below(8) {
            0 => {
                *m.header().1 = i.pick(magics);
                err = Some(S::BadStruct);
            }
            1 => {
                *m.header().0 = i.pick(sizes);
                err = Some(S::BadStruct);
            }
            2 => *m.header().0 = size_of::<T>() + 16,
            3 => {
                null = true;
                err = Some(S::NullPointer);
            }
            _ => {}
        }
        let mut buf = vec![0u64; size_of::<T>() / 8 + 4];
        // SAFETY: buf holds the struct.
        unsafe { (buf.as_mut_ptr() as *mut T).write(m) };
        let before = buf.clone();
        Out {
            buf,
            before,
            m,
            null,
            err,
        }
    }

    /// What the call is given.
    pub fn ptr(&mut self) -> *mut T {
        if self.null {
            null_mut()
        } else {
            self.buf.as_mut_ptr().cast()
        }
    }

    /// After the call that returned `r`: on a failure, nothing written
    /// (None); else nothing written past the struct, and the struct filled.
    pub fn filled(&self, r: graphed_status, what: &str) -> Option<T> {
        if r != S::Ok {
            assert_eq!(self.buf, self.before, "{what} written on failure");
            return None;
        }
        assert!(
            self.buf[size_of::<T>() / 8..].iter().all(|&x| x == 0),
            "{what} written past the struct"
        );
        // SAFETY: the struct graphed filled.
        Some(unsafe { (self.buf.as_ptr() as *const T).read() })
    }
}
