//! Returned clone blocks: the `owner` of a CLONE grad. A block holds one
//! reference per CLONE grad of its replay; the last release returns it to
//! its session's ring (or frees it), ordered after the work enqueued on the
//! stream it was returned on.

use super::boundary::boundary;
use super::callback::graphed_stream;
use super::handles::{graphed_buffer, id};
use super::status::graphed_status;
use crate::backend::{host, BackendKind, StreamRef};
use crate::core::handle::{self, Kind};
use crate::error::{Error, Result};
use crate::orchestrate::CloneBlock;

/// Drops one reference to a block of returned clones; the last one gives
/// the memory back, ordered after the work already enqueued on the stream
/// the clones were returned on (that stream must still exist; synchronize
/// other streams that used the clones with it first, as with PyTorch's
/// record_stream). NULL is a no-op. Safe from any thread at any time; a
/// released block gives GRAPHED_STATUS_USE_AFTER_DESTROY.
#[no_mangle]
pub extern "C" fn graphed_buffer_release(buffer: *mut graphed_buffer) -> graphed_status {
    boundary("graphed_buffer_release", || release(buffer, None))
}

/// graphed_buffer_release, ordered on `stream` instead: the block's memory
/// is given back after the work enqueued there so far (and not after that
/// of the stream it was returned on). For a clone used and released on
/// another stream, or whose return stream is gone. `stream` is NULL or a
/// stream of the block's backend: on the host backend, anything but a
/// host stream is GRAPHED_STATUS_INVALID_ARGUMENT (a destroyed one
/// GRAPHED_STATUS_USE_AFTER_DESTROY), as for a replay, and the reference
/// is kept.
#[no_mangle]
pub extern "C" fn graphed_buffer_release_on(
    buffer: *mut graphed_buffer,
    stream: graphed_stream,
) -> graphed_status {
    boundary("graphed_buffer_release_on", || {
        release(buffer, Some(StreamRef(stream as usize)))
    })
}

/// Drops one reference (NULL: nothing); the last gives the block back,
/// ordered on `stream` when one is given.
fn release(buffer: *mut graphed_buffer, stream: Option<StreamRef>) -> Result<()> {
    if buffer.is_null() {
        return Ok(());
    }
    if let Some(s) = stream {
        let block = handle::get::<CloneBlock>(Kind::Buffer, id(buffer))?;
        if block.backend_kind() == BackendKind::Host {
            host::check_stream(s)?;
        }
        block.set_stream(s);
    }
    match handle::release(Kind::Buffer, id(buffer))? {
        Some(last) => last
            .downcast::<CloneBlock>()
            .map_err(|_| Error::Internal("a buffer handle holds another type".into()))?
            .release(),
        None => Ok(()),
    }
}

/// Adds one reference to a block of returned clones.
#[no_mangle]
pub extern "C" fn graphed_buffer_retain(buffer: *mut graphed_buffer) -> graphed_status {
    boundary("graphed_buffer_retain", || {
        if buffer.is_null() {
            return Err(Error::NullPointer { what: "buffer" });
        }
        handle::retain(Kind::Buffer, id(buffer))
    })
}
