//! The static allocations of a captured session, each with its owners:
//! one per callable for the buffers only it uses, and one shared by the
//! callables whose buffers are chained or reuse each other's memory (with,
//! at its end, the block of bucket sizes the bucketed callables read).
//! Releasing a callable frees its own allocation at once, and the shared
//! one with the last callable that uses it.

use crate::backend::{Backend, DevPtr, DeviceMemory};
use crate::core::plan::Owned;
use crate::core::size;
use crate::error::Result;
use std::sync::Arc;

pub(crate) struct Statics {
    /// The shared allocation, while a callable that uses it is captured.
    shared: Option<DeviceMemory>,
    /// Bytes of the planned buffers in it (the bucket sizes follow).
    shared_planned: usize,
    /// Per callable: it uses the shared allocation and is not released.
    shared_users: Vec<bool>,
    /// Per callable: its own allocation, until released (None also when
    /// it has no buffer of its own).
    own: Vec<Option<DeviceMemory>>,
    /// Per callable: bytes of the shared allocation's buffers it uses.
    shared_use: Vec<usize>,
}

impl Statics {
    /// Allocates what `owned` plans, with `sizes_bytes` of bucket sizes
    /// after the shared buffers, read by the callables flagged in
    /// `bucketed`. Nothing for an allocation of 0 bytes.
    pub fn allocate(
        backend: &Arc<dyn Backend>,
        owned: &Owned,
        sizes_bytes: usize,
        bucketed: &[bool],
    ) -> Result<Statics> {
        let shared_bytes = size::add(owned.shared_bytes, sizes_bytes, "the static buffers")?;
        let alloc = |bytes: usize| match bytes {
            0 => Ok(None),
            n => DeviceMemory::new(backend, n).map(Some),
        };
        let shared = alloc(shared_bytes)?;
        let own = owned
            .own_bytes
            .iter()
            .map(|&b| alloc(b))
            .collect::<Result<Vec<_>>>()?;
        let shared_users = owned
            .shared_use
            .iter()
            .enumerate()
            .map(|(c, &u)| u > 0 || (sizes_bytes > 0 && bucketed.get(c) == Some(&true)))
            .collect();
        Ok(Statics {
            shared,
            shared_planned: owned.shared_bytes,
            shared_users,
            own,
            shared_use: owned.shared_use.clone(),
        })
    }

    /// The bases `Owned::at` takes: the shared allocation's, then each
    /// callable's own (0 where there is none).
    pub fn bases(&self) -> Vec<DevPtr> {
        let base = |m: &Option<DeviceMemory>| m.as_ref().map_or(0, DeviceMemory::ptr);
        std::iter::once(base(&self.shared))
            .chain(self.own.iter().map(base))
            .collect()
    }

    /// Where the bucket sizes are (after the shared buffers).
    pub fn sizes_base(&self) -> DevPtr {
        self.shared
            .as_ref()
            .map_or(0, |m| m.ptr() + self.shared_planned as DevPtr)
    }

    /// Every live allocation: (address, bytes).
    pub fn allocations(&self) -> impl Iterator<Item = (DevPtr, usize)> + '_ {
        self.shared
            .iter()
            .chain(self.own.iter().flatten())
            .map(|m| (m.ptr(), m.bytes()))
    }

    /// Bytes of every live allocation.
    pub fn bytes(&self) -> usize {
        self.allocations().map(|(_, b)| b).sum()
    }

    /// Bytes of callable `c`'s own allocation (0: none, or released).
    pub fn own_bytes(&self, c: usize) -> usize {
        self.own
            .get(c)
            .and_then(Option::as_ref)
            .map_or(0, DeviceMemory::bytes)
    }

    /// Bytes of the shared allocation's buffers callable `c` uses (0 once
    /// released).
    pub fn shared_bytes(&self, c: usize) -> usize {
        match self.shared_users.get(c) {
            Some(true) => self.shared_use[c],
            _ => 0,
        }
    }

    /// Whether the shared allocation is still held.
    pub fn has_shared(&self) -> bool {
        self.shared.is_some()
    }

    /// Callable `c` is released: frees its own allocation, and the shared
    /// one when `c` was its last user (after waiting for the device, as
    /// every free of device memory does). Returns the bytes freed.
    pub fn release(&mut self, c: usize) -> usize {
        let mut freed = 0;
        if let Some(m) = self.own.get_mut(c).and_then(Option::take) {
            freed += m.bytes();
            drop(m);
        }
        if let Some(u) = self.shared_users.get_mut(c) {
            *u = false;
        }
        if !self.shared_users.iter().any(|&u| u) {
            if let Some(m) = self.shared.take() {
                freed += m.bytes();
                drop(m);
            }
        }
        freed
    }
}
