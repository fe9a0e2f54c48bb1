//! A step's update stage once captured: the device memory it owns (the
//! check's flag, the count of skipped updates, the scalar block), the
//! replay's part (the scalars copied in before the launch, an event after
//! it where there is a flag to read), and the host's read of the flag,
//! only when asked. Freed with the step's graphs.

use super::spec::UpdateSpec;
use crate::backend::{Backend, DevPtr, DeviceMemory, Event, StreamRef};
use crate::error::{Error, Result};
use std::sync::Arc;

/// Where the scalar block starts in the update's memory (the flag and the
/// counter come first; the scalars get an alignment any load allows).
const SCALARS_AT: usize = 256;

/// What a captured step's update owns.
pub(crate) struct StepUpdate {
    /// The flag (u32 at 0), the skipped count (u64 at 8), the scalars (at
    /// `SCALARS_AT`), zeroed.
    memory: DeviceMemory,
    pub scalar_bytes: usize,
    /// With a check: recorded after each launch, for the host's read.
    event: Option<Event>,
    /// A replay recorded the event.
    launched: bool,
}

impl StepUpdate {
    /// The memory and event of a step's update as `spec` declares it.
    pub fn new(backend: &Arc<dyn Backend>, spec: &UpdateSpec) -> Result<StepUpdate> {
        let bytes = SCALARS_AT + spec.scalar_bytes;
        let memory = DeviceMemory::new(backend, bytes)?;
        backend.upload(memory.ptr(), &vec![0u8; bytes])?;
        let event = match spec.check {
            true => Some(Event::new(backend)?),
            false => None,
        };
        Ok(StepUpdate {
            memory,
            scalar_bytes: spec.scalar_bytes,
            event,
            launched: false,
        })
    }

    /// The check's flag (0 without a check).
    pub fn flag(&self) -> DevPtr {
        match self.event {
            Some(_) => self.memory.ptr(),
            None => 0,
        }
    }

    /// The count of replays whose check skipped the update.
    pub fn counter(&self) -> DevPtr {
        self.memory.ptr() + 8
    }

    /// The scalar block (0 without one).
    pub fn scalars(&self) -> DevPtr {
        match self.scalar_bytes {
            0 => 0,
            _ => self.memory.ptr() + SCALARS_AT as DevPtr,
        }
    }

    /// Why step `step`'s replay cannot take `given` scalars, if it cannot.
    pub fn check_scalars(
        update: Option<&StepUpdate>,
        step: u32,
        given: Option<&[u8]>,
    ) -> Result<()> {
        let Some(g) = given else { return Ok(()) };
        let declared = update.map_or(0, |u| u.scalar_bytes);
        if declared == 0 {
            return Err(Error::invalid(format!(
                "args.scalars: step {step} has no scalar block (graphed_step_desc.scalar_bytes is 0, \
                 or it has no update)"
            )));
        }
        if g.len() != declared {
            return Err(Error::invalid(format!(
                "args.scalar_bytes is {}; step {step}'s scalar block is {declared} bytes: give it whole",
                g.len()
            )));
        }
        Ok(())
    }

    /// Before the launch: the scalars given, copied in on `stream`.
    pub fn before_launch(
        &self,
        backend: &dyn Backend,
        scalars: Option<&[u8]>,
        stream: StreamRef,
    ) -> Result<()> {
        match scalars {
            Some(s) => backend.upload_async(self.scalars(), s, stream),
            None => Ok(()),
        }
    }

    /// After the launch: the event the host's read of the flag waits for.
    pub fn after_launch(&mut self, backend: &dyn Backend, stream: StreamRef) -> Result<()> {
        if let Some(e) = &self.event {
            backend.record(e.raw(), stream)?;
            self.launched = true;
        }
        Ok(())
    }

    /// Whether the last replay skipped the update, and how many did, read
    /// once that replay finished; None without a check.
    pub fn skipped(&self, backend: &dyn Backend) -> Result<Option<(bool, u64)>> {
        let Some(e) = &self.event else {
            return Ok(None);
        };
        let _ctx = backend.bind()?;
        if self.launched {
            backend.event_synchronize(e.raw())?;
        }
        let mut b = [0u8; 16];
        backend.download(&mut b, self.memory.ptr())?;
        let flag = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let mut count = [0u8; 8];
        count.copy_from_slice(&b[8..16]);
        Ok(Some((flag != 0, u64::from_le_bytes(count))))
    }
}
