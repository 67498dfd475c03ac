//! Host buffers of one transfer between memory and a store: the part being
//! uploaded, the slot a GET fills. A call's buffers are reused part after
//! part (a fresh 16 MiB buffer per part pays its page faults every time), and
//! where GPU memory is on the other side they are page-locked, so that its
//! copies run at full speed and truly asynchronously; where the pinned-memory
//! cap has no room (or the driver refuses), they are pageable and the call
//! says so. Nothing outlives the call: memory goes when the call's
//! [`Buffers`] and the last part the client still holds are dropped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::gpu::cuda::PinnedBuffer;
use crate::sync::lock;

enum Memory {
    Heap(Vec<u8>),
    Pinned(PinnedBuffer),
}

impl Memory {
    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Memory::Heap(v) => v,
            Memory::Pinned(p) => p.as_mut_slice(),
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            Memory::Heap(v) => v,
            Memory::Pinned(p) => p.as_slice(),
        }
    }
}

/// The buffers of one call, each `len` bytes; page-locked if asked.
pub(super) struct Buffers {
    len: usize,
    pinned: bool,
    idle: Arc<Mutex<Vec<Memory>>>,
    /// A buffer asked pinned came pageable.
    fell_back: AtomicBool,
}

impl Buffers {
    pub(super) fn new(len: usize, pinned: bool) -> Buffers {
        Buffers {
            len,
            pinned,
            idle: Arc::new(Mutex::new(Vec::new())),
            fell_back: AtomicBool::new(false),
        }
    }

    /// A buffer of `n` bytes (at most the call's `len`), an idle one if
    /// there is one; zeroed if `zeroed` (a reused buffer holds its last part).
    pub(super) fn take(&self, n: usize, zeroed: bool) -> Buffer {
        debug_assert!(n <= self.len);
        let reused = lock(&self.idle).pop();
        let mem = match reused {
            Some(mut m) => {
                if zeroed {
                    m.as_mut_slice()[..n].fill(0);
                }
                m
            }
            // cuMemHostAlloc's memory is zero only in practice.
            None => match self.fresh() {
                Memory::Pinned(mut p) if zeroed => {
                    p.as_mut_slice()[..n].fill(0);
                    Memory::Pinned(p)
                }
                m => m,
            },
        };
        Buffer {
            mem: Some(mem),
            used: n,
            home: self.idle.clone(),
        }
    }

    /// A new buffer: pinned where asked and the cap has room.
    fn fresh(&self) -> Memory {
        if self.pinned {
            match PinnedBuffer::within_budget(self.len) {
                Ok(Some(p)) => return Memory::Pinned(p),
                Ok(None) | Err(_) => self.fell_back.store(true, Ordering::Relaxed),
            }
        }
        Memory::Heap(vec![0u8; self.len])
    }

    /// How the host side ran: "pinned", or "pageable" (asked pinned, some
    /// buffer was not); None where pinned memory was not asked for.
    pub(super) fn kind(&self) -> Option<&'static str> {
        match (self.pinned, self.fell_back.load(Ordering::Relaxed)) {
            (false, _) => None,
            (true, false) => Some("pinned"),
            (true, true) => Some("pageable"),
        }
    }
}

/// One buffer of a [`Buffers`], given back to it when dropped (after the
/// client is done with it, where it went into a [`Bytes`]).
pub(super) struct Buffer {
    /// None only while being dropped.
    mem: Option<Memory>,
    used: usize,
    home: Arc<Mutex<Vec<Memory>>>,
}

impl Buffer {
    pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
        let used = self.used;
        match &mut self.mem {
            Some(m) => &mut m.as_mut_slice()[..used],
            None => &mut [],
        }
    }

    /// The buffer as the bytes of a part (no copy: it comes home when the
    /// client drops the part).
    pub(super) fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        match &self.mem {
            Some(m) => &m.as_slice()[..self.used],
            None => &[],
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if let Some(m) = self.mem.take() {
            lock(&self.home).push(m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_zeroed_and_sized() {
        let b = Buffers::new(64, false);
        let mut first = b.take(64, true);
        first.as_mut_slice().fill(7);
        drop(first.into_bytes()); // the client drops the part: it comes home
        let again = b.take(10, true);
        assert_eq!(again.as_ref(), &[0u8; 10]);
        assert_eq!(lock(&b.idle).len(), 0, "the idle buffer was taken again");
        let mut raw = b.take(64, false);
        assert_eq!(raw.as_mut_slice().len(), 64);
        assert_eq!(b.kind(), None);
    }

    #[test]
    fn a_part_kept_past_the_call_frees_its_memory_after() {
        let b = Buffers::new(8, false);
        let part = b.take(8, true).into_bytes();
        drop(b);
        assert_eq!(&part[..], &[0u8; 8]); // still valid: it owns its memory
    }
}
