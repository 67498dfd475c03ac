//! The caller's stream order: the one rule every device transfer follows.
//!
//! The caller (PyTorch) queues kernels on its streams and returns at once, so
//! the memory of a save may still be being written, and the destination of a
//! load still being read or written, by work queued before the call. The
//! engine moves device memory from its own non-blocking streams (the bounce
//! lanes) or through cuFile, which knows no stream at all. So, per device, an
//! event is recorded on the caller's stream when a transfer starts ([`After`]):
//! every bounce copy is queued behind it (its stream waits, the host does not),
//! and before any cuFile transfer the host waits for it. Copies that fill a
//! destination are finished (synchronized) before the transfer returns, so the
//! caller's streams may use the data as soon as the call is back.

use std::ffi::c_void;

use crate::gpu::cuda::{self, Event};
use crate::Result;

/// Events recorded on the caller's streams, one per device a transfer touches.
#[derive(Debug, Default)]
pub struct After {
    events: Vec<Event>,
}

impl After {
    /// No ordering (host memory only).
    pub fn none() -> After {
        After::default()
    }

    /// Record, for each of `devices`, an event on that device's stream in
    /// `streams` ((device, raw CUstream) pairs); a device not listed gets the
    /// legacy default stream (0), what CUDA programs without streams use.
    ///
    /// Runs on the caller's thread, whose current CUDA context is left as it was.
    ///
    /// # Safety
    /// Each stream must be a live CUstream of its device's primary context
    /// (or 0), alive for the duration of this call.
    pub unsafe fn record(devices: &[i32], streams: &[(i32, u64)]) -> Result<After> {
        cuda::driver()?.keeping_current(|| {
            let mut events = Vec::with_capacity(devices.len());
            for &d in devices {
                let stream = streams.iter().find(|s| s.0 == d).map_or(0, |s| s.1);
                // SAFETY: the caller vouches for the stream.
                events.push(unsafe { Event::record(d, stream as *mut c_void)? });
            }
            Ok(After { events })
        })
    }

    /// Whether the transfer touches no device memory.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// The event of `device`, if the transfer touches it.
    pub fn event(&self, device: i32) -> Option<&Event> {
        self.events.iter().find(|e| e.device() == device)
    }

    /// Block until the work queued before the transfer on every device is done
    /// (for cuFile, which is ordered with no stream).
    pub fn wait_on_host(&self) -> Result<()> {
        self.events.iter().try_for_each(Event::synchronize)
    }
}
