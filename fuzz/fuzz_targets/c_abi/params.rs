//! Parameters that move: the addresses replays and step replays are given
//! for the parameters (graphed_replay_args.params, graphed_step_args.params:
//! NULL arrays, NULL entries, the registered addresses, other addresses
//! aligned or not, wrong counts, NULL with a count, misaligned arrays,
//! counts that do not fit, an older struct without the fields), the query
//! graphed_session_params_movable, and what capture says of parameters
//! registered with GRAPHED_PARAM_FLAGS_REBIND (the stats, the plan dump).
//!
//! On the host backend every parameter stays where it was registered (the
//! graphs run user host tasks, which are opaque): a forward given another
//! address is refused with PARAM_MOVED, a backward or weight-grad replay
//! with INVALID_ARGUMENT, and either refusal changes nothing (the target
//! checks that the instance's buffers are untouched and that the same
//! replay with the registered addresses then goes through).

use super::*;

/// How a replay passes the parameters' addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PMode {
    /// A NULL array and a count of 0: every parameter where it is read.
    Null,
    /// Every entry the registered address.
    Registered,
    /// NULL and registered entries, mixed.
    NullEntries,
    /// One entry at another address (the others registered or NULL).
    Moved,
    /// One count too many.
    More,
    /// One count too few.
    Fewer,
    /// A NULL array with a non-zero count.
    NullCount,
    /// An array 4 bytes off its alignment, with a non-zero count.
    ArrayMisaligned,
    /// A count whose bytes do not fit in memory.
    HugeCount,
    /// The struct as callers built against the header before these fields
    /// (struct_size without them): whatever the fields hold is ignored.
    OldLayout,
}

pub const PMODES: [PMode; 10] = [
    PMode::Null,
    PMode::Registered,
    PMode::NullEntries,
    PMode::Moved,
    PMode::More,
    PMode::Fewer,
    PMode::NullCount,
    PMode::ArrayMisaligned,
    PMode::HugeCount,
    PMode::OldLayout,
];

/// The parameters' addresses a replay is given, and what graphed must say.
pub struct ParamsArg {
    pub mode: PMode,
    /// The array's storage (one spare word, for the misaligned array).
    pub store: Vec<u64>,
    pub ptr: *const *const c_void,
    pub count: usize,
    /// The entry at another address: (index, registered, given).
    pub moved: Option<(usize, usize, usize)>,
    /// Refused while the struct is read, before the session is locked.
    pub pre_err: Option<graphed_status>,
}

/// Another address for a parameter of `bytes` registered at `from`: fresh
/// memory aligned to 256 bytes or `off` past it, another parameter's, one
/// byte past its own, or an address nothing may read.
fn other_address(from: usize, bytes: usize, others: &[usize]) -> usize {
    let i = &w().input;
    let n = bytes.clamp(1, 1 << 16);
    match i.below(6) {
        0 | 1 => {
            let base = mem(n + 512, 0);
            let aligned = (base + 255) & !255;
            aligned + i.pick(&[0, 0, 1, 2, 4, 8, 16, 64, 128])
        }
        2 => match others.iter().copied().find(|&o| o != from && o != 0) {
            Some(o) => o,
            None => mem(n, 0),
        },
        3 => from.wrapping_add(1).max(1),
        4 => i.pick(&[0x10usize, 0x1000, usize::MAX & !7, 1 << 47]),
        _ => mem(n, i.below(8)),
    }
}

/// Reads how a replay passes the addresses of `registered` (the
/// parameters' registered addresses, in order, and their sizes in `bytes`;
/// empty when the model does not know the callable).
pub fn params_arg(registered: &[usize], bytes: &[usize]) -> ParamsArg {
    let i = &w().input;
    let mode = PMODES[i.below(PMODES.len())];
    let n = registered.len();
    let mut entries: Vec<usize> = registered.to_vec();
    let mut moved = None;
    match mode {
        PMode::NullEntries => {
            for e in entries.iter_mut() {
                if i.chance(128) {
                    *e = 0;
                }
            }
        }
        PMode::Moved if n > 0 => {
            for e in entries.iter_mut() {
                if i.chance(60) {
                    *e = 0;
                }
            }
            let j = i.below(n);
            let to = other_address(registered[j], bytes[j], registered);
            if to != registered[j] {
                entries[j] = to;
                moved = Some((j, registered[j], to));
            }
        }
        PMode::More => entries.push(if i.chance(128) { 0 } else { mem(8, 0) }),
        PMode::Fewer if n > 0 => {
            entries.pop();
        }
        PMode::Fewer => entries.push(0),
        _ => {}
    }
    let mut store: Vec<u64> = entries.iter().map(|&e| e as u64).collect();
    store.push(0);
    let mut p = ParamsArg {
        mode,
        ptr: null(),
        count: 0,
        moved,
        pre_err: None,
        store,
    };
    let base = p.store.as_ptr() as *const *const c_void;
    match mode {
        PMode::Null => {}
        PMode::NullCount => {
            p.count = 1 + i.below(3);
            p.pre_err = Some(S::InvalidArgument);
        }
        PMode::ArrayMisaligned => {
            // SAFETY: 4 bytes into the storage, which has a spare word.
            p.ptr = unsafe { (base as *const u8).add(4) }.cast();
            p.count = entries.len().max(1);
            p.pre_err = Some(S::InvalidArgument);
        }
        PMode::HugeCount => {
            p.ptr = base;
            p.count = i.pick(&[usize::MAX, usize::MAX / 8 + 1, 1 << 61]);
            p.pre_err = Some(S::InvalidArgument);
        }
        PMode::OldLayout => {
            // Garbage the library must not read.
            p.ptr = std::ptr::dangling::<*const c_void>();
            p.count = usize::MAX;
        }
        _ => {
            p.ptr = if entries.is_empty() && i.chance(128) {
                // An empty array may be anything, NULL included.
                std::ptr::dangling::<*const c_void>()
            } else {
                base
            };
            p.count = entries.len();
        }
    }
    p
}

impl ParamsArg {
    /// Whether the library reads the fields (not with the older layout).
    pub fn read(&self) -> bool {
        self.mode != PMode::OldLayout
    }

    /// The entries as the library reads them (None: no array).
    fn entries(&self) -> Option<Vec<usize>> {
        if !self.read() || self.ptr.is_null() || self.pre_err.is_some() {
            return None;
        }
        if self.count == 0 {
            return Some(Vec::new());
        }
        Some(
            self.store[..self.count]
                .iter()
                .map(|&e| e as usize)
                .collect(),
        )
    }

    /// What checking the addresses against the parameters at `registered`
    /// gives: a count other than theirs is INVALID_ARGUMENT; an address
    /// other than where the graphs read it is PARAM_MOVED for a forward
    /// (`moves`: the host backend moves none), INVALID_ARGUMENT for any
    /// other pass.
    pub fn check(&self, registered: &[usize], moves: bool) -> Option<graphed_status> {
        let e = self.entries()?;
        if e.len() != registered.len() {
            return Some(S::InvalidArgument);
        }
        let off = e
            .iter()
            .zip(registered)
            .any(|(&to, &at)| to != 0 && to != at);
        match (off, moves) {
            (false, _) => None,
            (true, true) => Some(S::ParamMoved),
            (true, false) => Some(S::InvalidArgument),
        }
    }

    /// Checks the message of the refusal `r` of these addresses: it names
    /// the callable, the moved parameter (`local`: its index in its
    /// callable) and both addresses.
    pub fn check_message(&self, r: graphed_status, func: &str, local: impl Fn(usize) -> usize) {
        let Some((j, from, to)) = self.moved else {
            return;
        };
        let m = msg();
        for want in [
            format!("param {} ", local(j)),
            format!("0x{from:x}"),
            format!("0x{to:x}"),
            "callable '".to_string(),
        ] {
            assert!(
                m.contains(&want),
                "{func}: the refusal ({r:?}) of a moved parameter does not say {want:?}: {m}"
            );
        }
    }

    /// The older layout's fields as a struct of another size reads them:
    /// where the struct's size is not the older one, no array at all.
    pub fn neutral(&mut self) {
        if self.mode == PMode::OldLayout {
            self.mode = PMode::Null;
            self.ptr = null();
            self.count = 0;
        }
    }

    /// The same replay with every parameter at its registered address (or
    /// NULL, where it is read now).
    pub fn registered(registered: &[usize]) -> ParamsArg {
        let i = &w().input;
        let nulls = i.chance(60);
        let mut store: Vec<u64> = registered
            .iter()
            .map(|&a| if nulls && i.chance(128) { 0 } else { a as u64 })
            .collect();
        store.push(0);
        let ptr = store.as_ptr() as *const *const c_void;
        ParamsArg {
            mode: PMode::Registered,
            count: registered.len(),
            store,
            ptr,
            moved: None,
            pre_err: None,
        }
    }
}

/// The bytes of an instance's static buffers (every role) and of its
/// parameters' memory, to see that a refused replay changed none.
pub fn instance_bytes(h: *mut graphed_session, c: u32, mb: u32, cl: &Callable) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for role in 0..5u32 {
        let sizes: Vec<usize> = match role {
            0 | 3 => cl.inputs.iter().map(|t| t.bytes).collect(),
            1 | 2 => cl.outputs.iter().map(|t| t.bytes).collect(),
            _ => cl.params.iter().map(|p| p.bytes).collect(),
        };
        let mut ptrs = vec![0usize; sizes.len()];
        // SAFETY: room for the stated count.
        let r = unsafe {
            graphed_session_buffers(h, c, mb, role, ptrs.as_mut_ptr().cast(), ptrs.len())
        };
        if r != S::Ok {
            continue;
        }
        for (&p, &n) in ptrs.iter().zip(&sizes) {
            if p != 0 && n <= 1 << 20 {
                // SAFETY: a static buffer (or external memory) of n bytes.
                out.push(unsafe { std::slice::from_raw_parts(p as *const u8, n) }.to_vec());
            }
        }
    }
    for p in &cl.params {
        if p.data != 0 {
            let n = p.bytes.min(1 << 16);
            // SAFETY: harness memory of at least min(bytes, 64 KiB).
            out.push(unsafe { std::slice::from_raw_parts(p.data as *const u8, n) }.to_vec());
        }
    }
    out
}

/// graphed_session_params_movable on any target, with any callable,
/// microbatch, count and output pointer.
pub fn op_params_movable() {
    let wd = w();
    let i = &wd.input;
    let t = target_where(|s| s.st == St::Captured);
    let model = if let Target::Live(k) = t {
        let s = &wd.sessions.borrow()[k];
        Some((s.st, s.callables.clone(), s.mb))
    } else {
        None
    };
    let c = i.below(3) as u32;
    let m = i.below(3) as u32;
    let n = model
        .as_ref()
        .and_then(|(_, cls, _)| cls.get(c as usize))
        .map_or(0, |cl| cl.params.len());
    let count = match i.below(6) {
        0 => n + 1,
        1 => n.saturating_sub(1),
        2 => i.below(4),
        _ => n,
    };
    let mut on = vec![0xeeu32; count + 1];
    let mut p = on.as_mut_ptr();
    let fault = i.below(6);
    if fault == 0 {
        p = null_mut();
    } else if fault == 1 {
        // SAFETY: 1 byte into the array, which has a spare element.
        p = unsafe { (p as *mut u8).add(1) as *mut u32 };
    }
    let mut want = t.lock();
    if want.is_none() {
        let (st, cls, mb) = model.clone().unwrap();
        want = match st {
            St::Open => Some(S::WrongState),
            St::Reset => Some(S::SessionReset),
            St::Captured => match cls.get(c as usize) {
                Some(_) if m < mb => {
                    if n != count {
                        Some(S::InvalidArgument)
                    } else if n > 0 && fault == 0 {
                        Some(S::NullPointer)
                    } else if n > 0 && fault == 1 {
                        Some(S::InvalidArgument)
                    } else {
                        None
                    }
                }
                _ => Some(S::InvalidArgument),
            },
        };
    }
    trace!("params_movable {t:?} c {c} mb {m} count {count}/{n} fault {fault} want {want:?}");
    mark();
    // SAFETY: p has room for count values, or is refused.
    let r = unsafe { graphed_session_params_movable(t.ptr(), c, m, p, count) };
    expect(
        r,
        &[want.unwrap_or(S::Ok)],
        "graphed_session_params_movable",
        "query",
    );
    if fault > 1 {
        // The host backend moves nothing: 0 on success, untouched on
        // failure; never past count.
        let v = if r == S::Ok { 0 } else { 0xee };
        assert!(
            on[..count].iter().all(|&x| x == v),
            "params_movable: {on:?}"
        );
        assert_eq!(on[count], 0xee, "params_movable wrote past count");
    } else {
        assert!(
            r != S::Ok || n == 0,
            "params_movable accepted a bad output array"
        );
    }
}

/// After capture: no parameter of any instance can move (0 from
/// graphed_session_params_movable), and the plan dump says why for each
/// one registered with REBIND ("fixed at its registered address: why").
/// Reads no input.
pub fn params_after_capture(h: *mut graphed_session, callables: &[Callable], mb: u32) {
    let mut flagged: Vec<(usize, u32)> = Vec::new();
    for (c, cl) in callables.iter().enumerate() {
        for m in 0..mb {
            let n = cl.params.len();
            let mut on = vec![0xeeu32; n + 1];
            // SAFETY: room for n values.
            let r = unsafe { graphed_session_params_movable(h, c as u32, m, on.as_mut_ptr(), n) };
            expect(
                r,
                &[S::Ok],
                "graphed_session_params_movable",
                "after capture",
            );
            assert!(
                on[..n].iter().all(|&v| v == 0),
                "a parameter can move on the host backend: {on:?}"
            );
            assert_eq!(on[n], 0xee, "params_movable wrote past count");
            // The dump has a line per bucket of a bucketed callable.
            for (j, p) in cl.params.iter().enumerate() {
                if p.rebind {
                    for _ in 0..cl.buckets.len().max(1) {
                        flagged.push((j, m));
                    }
                }
            }
        }
    }
    let mut len = 0usize;
    // SAFETY: a NULL buffer asks for the length.
    let r = unsafe { graphed_session_plan_dump(h, null_mut(), 0, &mut len) };
    expect(r, &[S::Ok], "graphed_session_plan_dump", "length");
    let mut buf = vec![0u8; len + 1];
    // SAFETY: room for len + 1 bytes.
    let r = unsafe { graphed_session_plan_dump(h, buf.as_mut_ptr().cast(), len + 1, &mut len) };
    expect(r, &[S::Ok], "graphed_session_plan_dump", "text");
    let text = String::from_utf8_lossy(&buf[..len]).into_owned();
    let mut said: Vec<(usize, u32)> = Vec::new();
    for line in text.lines().filter(|l| l.starts_with("param ")) {
        assert!(
            !line.contains("): movable ("),
            "the plan dump says a parameter can move on the host backend: {line}"
        );
        let Some(at) = line.find("): fixed at its registered address: ") else {
            continue;
        };
        let why = &line[at + "): fixed at its registered address: ".len()..];
        assert!(!why.trim().is_empty(), "no reason: {line}");
        let j: usize = line["param ".len()..]
            .split(' ')
            .next()
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("plan dump line: {line}"));
        // "(microbatch m)", or "(microbatch m, bucket b (n rows))".
        let m: u32 = line[..at]
            .split("(microbatch ")
            .nth(1)
            .and_then(|x| x.split([',', ')']).next())
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("plan dump line: {line}"));
        said.push((j, m));
    }
    flagged.sort();
    said.sort();
    assert_eq!(
        said, flagged,
        "the plan dump's fixed parameters are not those registered with REBIND:\n{text}"
    );
}
