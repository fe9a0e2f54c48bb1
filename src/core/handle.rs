//! The handle table: every object a caller can name by handle (sessions,
//! returned clone blocks, the scratch allocator and capture collector of a
//! running callback, host-backend streams) is registered here and named by
//! an id that is never reused.
//!
//! An id is `TAG << 56 | kind << 48 | serial`, with a 48-bit serial from one
//! counter that only counts up. The top byte makes every id a non-canonical
//! address on 64-bit machines, so no id is ever a real pointer and no small
//! integer is ever an id; the kind byte tells a session from a buffer; and
//! because serials are never reused, an id whose object is gone is reported
//! as destroyed even when the memory it lived in was reused.
//!
//! A lookup pins the object for the duration of the call: it hands out an
//! `Arc` clone, and removal for destroy is refused (`Busy`) while any pin is
//! held. Per-call handles (those a callback receives) are removed when the
//! callback returns, so a kept copy is reported as destroyed afterwards.
//! Nothing here runs user code; objects leave the table before they are
//! dropped, outside its lock.

use crate::error::{Error, Result};
use std::any::Any;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// What a handle names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Session = 1,
    Buffer = 2,
    Scratch = 3,
    Capture = 4,
    HostStream = 5,
}

impl Kind {
    fn from_bits(b: u64) -> Option<Kind> {
        Some(match b {
            1 => Kind::Session,
            2 => Kind::Buffer,
            3 => Kind::Scratch,
            4 => Kind::Capture,
            5 => Kind::HostStream,
            _ => return None,
        })
    }

    /// The handle's type as the API names it.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Session => "session",
            Kind::Buffer => "clone buffer",
            Kind::Scratch => "scratch allocator",
            Kind::Capture => "capture",
            Kind::HostStream => "host stream",
        }
    }

    /// Why such a handle stops being valid, for messages.
    fn gone(self) -> &'static str {
        match self {
            Kind::Session => "was destroyed",
            Kind::Buffer => "was released: every reference to it is gone",
            Kind::Scratch | Kind::Capture => {
                "belonged to a callback that has returned: in-callback handles are valid only during \
                 the call they were passed to"
            }
            Kind::HostStream => {
                "was destroyed: a session's capture stream goes with its graphs (at a reset, a \
                 failed capture or the session's destroy), though the session may live on"
            }
        }
    }
}

const TAG: u64 = 0x67; // 'g'
const SERIAL_BITS: u32 = 48;
const SERIAL_MASK: u64 = (1 << SERIAL_BITS) - 1;

/// Ids hash by multiplication: they are unique serials already.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

struct Entry {
    obj: Arc<dyn Any + Send + Sync>,
    /// References handed out (clone blocks); 1 for other kinds.
    refs: usize,
}

type Map = HashMap<u64, Entry, BuildHasherDefault<IdHasher>>;

fn table() -> MutexGuard<'static, Map> {
    static TABLE: OnceLock<Mutex<Map>> = OnceLock::new();
    // Every update is a single map operation, so a poisoned lock (a panic
    // elsewhere while it was held) leaves nothing half written.
    TABLE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

static NEXT: AtomicU64 = AtomicU64::new(1);

fn describe(id: u64) -> String {
    format!("0x{id:x}")
}

/// Why `id` does not name a live object of `kind`.
fn not_found(kind: Kind, id: u64) -> Error {
    let tagged = id >> 56 == TAG;
    let actual = Kind::from_bits((id >> SERIAL_BITS) & 0xFF);
    let serial = id & SERIAL_MASK;
    match (tagged, actual) {
        (true, Some(k)) if k == kind && serial != 0 && serial < NEXT.load(Ordering::Relaxed) => {
            Error::UseAfterDestroy(format!("{} {} {}", kind.name(), describe(id), kind.gone()))
        }
        (true, Some(k)) if k != kind => Error::invalid(format!(
            "{} is a {} handle, not a {}",
            describe(id),
            k.name(),
            kind.name()
        )),
        _ => Error::invalid(format!(
            "{} is not a {} handle graphed gave out",
            describe(id),
            kind.name()
        )),
    }
}

/// Registers `obj` under a new id of `kind`, with `refs` references
/// (1 unless the kind is reference-counted by the caller).
pub fn insert<T: Any + Send + Sync>(kind: Kind, obj: Arc<T>, refs: usize) -> u64 {
    let serial = NEXT.fetch_add(1, Ordering::Relaxed) & SERIAL_MASK;
    let id = TAG << 56 | (kind as u64) << SERIAL_BITS | serial;
    table().insert(id, Entry { obj, refs });
    id
}

/// The object behind `id`, pinned: while the returned `Arc` lives, the
/// object cannot be removed by [`remove_unpinned`].
pub fn get<T: Any + Send + Sync>(kind: Kind, id: u64) -> Result<Arc<T>> {
    let t = table();
    let e = t.get(&id).ok_or_else(|| not_found(kind, id))?;
    if (id >> SERIAL_BITS) & 0xFF != kind as u64 {
        return Err(not_found(kind, id));
    }
    e.obj
        .clone()
        .downcast::<T>()
        .map_err(|_| Error::Internal(format!("handle {} holds another type", describe(id))))
}

/// Removes `id` if no call has it pinned; `Busy` (with `busy` as the
/// message) otherwise. The object is returned so that it is dropped
/// outside the table's lock.
pub fn remove_unpinned(
    kind: Kind,
    id: u64,
    busy: impl FnOnce() -> String,
) -> Result<Arc<dyn Any + Send + Sync>> {
    let mut t = table();
    let e = t.get(&id).ok_or_else(|| not_found(kind, id))?;
    if (id >> SERIAL_BITS) & 0xFF != kind as u64 {
        return Err(not_found(kind, id));
    }
    if Arc::strong_count(&e.obj) > 1 {
        return Err(Error::Busy(busy()));
    }
    t.remove(&id)
        .map(|e| e.obj)
        .ok_or_else(|| Error::Internal("entry vanished under the lock".into()))
}

/// Removes a handle of `kind` whatever pins exist: calls in progress keep
/// the object alive until they return, later ones find it destroyed.
pub fn take(kind: Kind, id: u64) -> Result<Arc<dyn Any + Send + Sync>> {
    let mut t = table();
    match t.get(&id) {
        Some(_) if (id >> SERIAL_BITS) & 0xFF == kind as u64 => t
            .remove(&id)
            .map(|e| e.obj)
            .ok_or_else(|| Error::Internal("entry vanished under the lock".into())),
        _ => Err(not_found(kind, id)),
    }
}

/// Removes `id` whatever pins exist (they keep the object alive until they
/// drop). For per-call handles, when their call returns.
pub fn remove(id: u64) -> Option<Arc<dyn Any + Send + Sync>> {
    table().remove(&id).map(|e| e.obj)
}

/// Adds one reference to a reference-counted handle.
pub fn retain(kind: Kind, id: u64) -> Result<()> {
    let mut t = table();
    match t.get_mut(&id) {
        Some(e) if (id >> SERIAL_BITS) & 0xFF == kind as u64 => {
            e.refs = e.refs.checked_add(1).ok_or_else(|| {
                Error::invalid(format!(
                    "{} {} has too many references",
                    kind.name(),
                    describe(id)
                ))
            })?;
            Ok(())
        }
        _ => Err(not_found(kind, id)),
    }
}

/// Drops one reference; the last one removes the entry and returns the
/// object (to be dropped by the caller, outside the lock).
pub fn release(kind: Kind, id: u64) -> Result<Option<Arc<dyn Any + Send + Sync>>> {
    let mut t = table();
    match t.get_mut(&id) {
        Some(e) if (id >> SERIAL_BITS) & 0xFF == kind as u64 => {
            e.refs -= 1;
            if e.refs == 0 {
                Ok(t.remove(&id).map(|e| e.obj))
            } else {
                Ok(None)
            }
        }
        _ => Err(not_found(kind, id)),
    }
}

/// Every live object of `kind` (pinned while the returned `Arc`s live).
pub fn all<T: Any + Send + Sync>(kind: Kind) -> Vec<Arc<T>> {
    table()
        .iter()
        .filter(|(&id, _)| (id >> SERIAL_BITS) & 0xFF == kind as u64)
        .filter_map(|(_, e)| e.obj.clone().downcast::<T>().ok())
        .collect()
}

/// Every live object of `kind` with its id.
pub fn all_with_ids<T: Any + Send + Sync>(kind: Kind) -> Vec<(u64, Arc<T>)> {
    table()
        .iter()
        .filter(|(&id, _)| (id >> SERIAL_BITS) & 0xFF == kind as u64)
        .filter_map(|(&id, e)| e.obj.clone().downcast::<T>().ok().map(|o| (id, o)))
        .collect()
}

/// Live handles of `kind`, for tests and leak checks.
pub fn count(kind: Kind) -> usize {
    table()
        .keys()
        .filter(|&&id| (id >> SERIAL_BITS) & 0xFF == kind as u64)
        .count()
}

/// A handle registered for the duration of a scope: removed when dropped.
pub struct Scoped(u64);

impl Scoped {
    pub fn new<T: Any + Send + Sync>(kind: Kind, obj: Arc<T>) -> Scoped {
        Scoped(insert(kind, obj, 1))
    }

    pub fn id(&self) -> u64 {
        self.0
    }
}

impl Drop for Scoped {
    fn drop(&mut self) {
        drop(remove(self.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_tagged_and_never_small() {
        let a = insert(Kind::Session, Arc::new(1u32), 1);
        let b = insert(Kind::Session, Arc::new(2u32), 1);
        assert_ne!(a, b);
        assert_eq!(a >> 56, TAG);
        assert!(a > u32::MAX as u64);
        assert_eq!(*get::<u32>(Kind::Session, b).unwrap(), 2);
        remove(a);
        remove(b);
    }

    #[test]
    fn gone_ids_are_use_after_destroy_and_garbage_is_invalid() {
        let a = insert(Kind::Buffer, Arc::new(7u8), 1);
        assert!(release(Kind::Buffer, a).unwrap().is_some());
        assert!(matches!(
            get::<u8>(Kind::Buffer, a),
            Err(Error::UseAfterDestroy(_))
        ));
        assert!(matches!(
            release(Kind::Buffer, a),
            Err(Error::UseAfterDestroy(_))
        ));
        for garbage in [0u64, 1, 2, 0x1000, u64::MAX, TAG << 56] {
            assert!(
                matches!(
                    get::<u8>(Kind::Buffer, garbage),
                    Err(Error::InvalidArgument(_))
                ),
                "{garbage:x}"
            );
        }
        // A serial never issued yet is not "destroyed".
        let future = TAG << 56 | (Kind::Buffer as u64) << SERIAL_BITS | SERIAL_MASK;
        assert!(matches!(
            get::<u8>(Kind::Buffer, future),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn kinds_do_not_mix() {
        let s = insert(Kind::Session, Arc::new(1u32), 1);
        let e = get::<u32>(Kind::Buffer, s).unwrap_err();
        assert!(e.to_string().contains("session handle"), "{e}");
        remove(s);
    }

    #[test]
    fn pinned_objects_cannot_be_removed() {
        let s = insert(Kind::Session, Arc::new(5u64), 1);
        let pin = get::<u64>(Kind::Session, s).unwrap();
        let e = remove_unpinned(Kind::Session, s, || "in use".into()).unwrap_err();
        assert!(matches!(e, Error::Busy(_)));
        drop(pin);
        assert!(remove_unpinned(Kind::Session, s, || "in use".into()).is_ok());
        assert!(matches!(
            get::<u64>(Kind::Session, s),
            Err(Error::UseAfterDestroy(_))
        ));
    }

    #[test]
    fn references_count_down_to_removal() {
        let b = insert(Kind::Buffer, Arc::new(0u8), 2);
        retain(Kind::Buffer, b).unwrap();
        assert!(release(Kind::Buffer, b).unwrap().is_none());
        assert!(release(Kind::Buffer, b).unwrap().is_none());
        assert!(release(Kind::Buffer, b).unwrap().is_some());
        assert!(retain(Kind::Buffer, b).is_err());
    }

    #[test]
    fn scoped_handles_end_with_their_scope() {
        let id = {
            let s = Scoped::new(Kind::Scratch, Arc::new(3i32));
            assert_eq!(*get::<i32>(Kind::Scratch, s.id()).unwrap(), 3);
            s.id()
        };
        let e = get::<i32>(Kind::Scratch, id).unwrap_err();
        assert!(matches!(e, Error::UseAfterDestroy(_)));
        assert!(e.to_string().contains("callback that has returned"), "{e}");
    }
}
