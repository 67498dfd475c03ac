//! The pinned bounce-buffer pipeline for device memory.
//!
//! [`BounceLane`] is one I/O thread's share of the pipeline: two pinned
//! buffers and two streams, so the copy of chunk i+1 (D2H on save, H2D on
//! load) overlaps the file I/O of chunk i. Every copy is queued behind the
//! caller's stream ([`crate::gpu::order`]). Where the pinned-memory cap
//! ([`crate::gpu::budget`]) has no room, a lane runs on pageable buffers:
//! slower copies, same results.

use crate::gpu::cuda::{self, Event, PinnedBuffer, Stream};
use crate::io::align::{AlignedBuf, DEFAULT_ALIGN};
use crate::io::file::IoFile;
use crate::{Error, Result};

/// A slot's host buffer: pinned, or pageable when the cap had no room.
enum HostBuf {
    Pinned(PinnedBuffer),
    Pageable(AlignedBuf),
}

impl HostBuf {
    fn len(&self) -> usize {
        match self {
            HostBuf::Pinned(b) => b.len(),
            HostBuf::Pageable(b) => b.len(),
        }
    }

    fn pinned_len(&self) -> usize {
        match self {
            HostBuf::Pinned(b) => b.len(),
            HostBuf::Pageable(_) => 0,
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            HostBuf::Pinned(b) => b.as_slice(),
            HostBuf::Pageable(b) => b.as_slice(),
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            HostBuf::Pinned(b) => b.as_mut_slice(),
            HostBuf::Pageable(b) => b.as_mut_slice(),
        }
    }
}

/// One slot of a lane: a host buffer and the stream that fills or drains it.
struct Slot {
    buf: HostBuf,
    stream: Stream,
}

/// A chunk whose copy is in flight on one slot.
pub struct InFlight {
    slot: usize,
    file_offset: u64,
    len: usize,
}

/// One thread's double-buffered pipeline for one device.
pub struct BounceLane {
    device: i32,
    slots: [Slot; 2],
    next: usize,
}

impl BounceLane {
    /// Two pinned buffers of `capacity` bytes and two streams on `device`;
    /// None when the pinned-memory cap has no room for both buffers.
    pub fn pinned(device: i32, capacity: usize) -> Result<Option<Self>> {
        cuda::driver()?.make_current(device)?;
        let (Some(a), Some(b)) = (
            PinnedBuffer::within_budget(capacity)?,
            PinnedBuffer::within_budget(capacity)?,
        ) else {
            return Ok(None);
        };
        Self::with(device, [HostBuf::Pinned(a), HostBuf::Pinned(b)]).map(Some)
    }

    /// A lane on pageable buffers (for when the cap has no room left).
    pub fn pageable(device: i32, capacity: usize) -> Result<Self> {
        cuda::driver()?.make_current(device)?;
        let mk = || AlignedBuf::new(capacity, DEFAULT_ALIGN).map(HostBuf::Pageable);
        Self::with(device, [mk()?, mk()?])
    }

    fn with(device: i32, bufs: [HostBuf; 2]) -> Result<Self> {
        let [a, b] = bufs;
        Ok(BounceLane {
            device,
            slots: [
                Slot {
                    stream: Stream::new(device)?,
                    buf: a,
                },
                Slot {
                    stream: Stream::new(device)?,
                    buf: b,
                },
            ],
            next: 0,
        })
    }

    /// Whether its buffers are pinned (not the pageable fallback).
    pub fn is_pinned(&self) -> bool {
        self.pinned_bytes() > 0
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    pub fn capacity(&self) -> usize {
        self.slots[0].buf.len()
    }

    /// Pinned bytes held.
    pub fn pinned_bytes(&self) -> usize {
        self.slots.iter().map(|s| s.buf.pinned_len()).sum()
    }

    fn take_slot(&mut self) -> usize {
        let s = self.next;
        self.next ^= 1;
        s
    }

    /// Save, first half: queue the D2H copy of a chunk into a free slot,
    /// behind `after` (the caller's stream, see [`crate::gpu::order`]).
    ///
    /// # Safety
    /// `[src, src+len)` must be readable device memory of this lane's device,
    /// `len <= capacity`, and the slot taken must not hold a chunk in flight.
    pub unsafe fn start_save(
        &mut self,
        src: u64,
        len: usize,
        file_offset: u64,
        after: Option<&Event>,
    ) -> Result<InFlight> {
        let cuda = cuda::driver()?;
        cuda.make_current(self.device)?;
        let slot = self.take_slot();
        let s = &mut self.slots[slot];
        if let Some(e) = after {
            s.stream.wait(e)?;
        }
        let dst = s.buf.as_mut_slice()[..len].as_mut_ptr();
        // SAFETY: the buffer holds `len` bytes (the slice above checked) and is
        // not in use (the caller finished this slot); the source is valid per the caller.
        unsafe { cuda.memcpy_dtoh_async(dst, src, len, &s.stream)? };
        Ok(InFlight {
            slot,
            file_offset,
            len,
        })
    }

    /// Save, second half: wait for the copy, write the bytes; with `crc`,
    /// their CRC-32, computed on the pinned slot (the bytes the file gets).
    pub fn finish_save(&mut self, f: InFlight, file: &IoFile, crc: bool) -> Result<Option<u32>> {
        let s = &self.slots[f.slot];
        s.stream.synchronize()?;
        let bytes = &s.buf.as_slice()[..f.len];
        let sum = crc.then(|| crc32fast::hash(bytes));
        file.write_at(bytes, f.file_offset)?;
        Ok(sum)
    }

    /// Load, first half: read a chunk into a free slot (O_DIRECT over its
    /// aligned superset), then queue its H2D copy behind `after` (the
    /// caller's stream: work queued there may still use the destination).
    /// With `crc`, also returns the CRC-32 of the bytes read (computed on the slot).
    ///
    /// # Safety
    /// `[dst, dst+len)` must be writable device memory of this lane's device
    /// that nobody else touches until the copy is finished, and
    /// `len + 2 * alignment <= capacity`.
    pub unsafe fn start_load(
        &mut self,
        dst: u64,
        len: usize,
        file_offset: u64,
        file: &IoFile,
        crc: bool,
        after: Option<&Event>,
    ) -> Result<(InFlight, Option<u32>)> {
        let slot = self.take_slot();
        let s = &mut self.slots[slot];
        let a = file.alignment().offset as u64;
        let start = if file.is_direct() {
            crate::io::align::align_down(file_offset, a)
        } else {
            file_offset
        };
        let skip = (file_offset - start) as usize;
        let span = if file.is_direct() {
            (crate::io::align::align_up(file_offset + len as u64, a) - start) as usize
        } else {
            len
        };
        if span > s.buf.len() {
            return Err(Error::invalid(format!(
                "chunk of {span} bytes exceeds the pinned buffer ({})",
                s.buf.len()
            )));
        }
        file.read_blocks_needed(&mut s.buf.as_mut_slice()[..span], start, skip + len)?;
        let sum = crc.then(|| crc32fast::hash(&s.buf.as_slice()[skip..skip + len]));
        let cuda = cuda::driver()?;
        cuda.make_current(self.device)?;
        if let Some(e) = after {
            s.stream.wait(e)?;
        }
        let src = s.buf.as_slice()[skip..skip + len].as_ptr();
        // SAFETY: the slot holds the bytes just read and stays untouched until
        // `finish_load` synchronizes; the destination is valid per the caller.
        unsafe { cuda.memcpy_htod_async(dst, src, len, &s.stream)? };
        Ok((
            InFlight {
                slot,
                file_offset,
                len,
            },
            sum,
        ))
    }

    /// Load, second half: wait for the H2D copy.
    pub fn finish_load(&mut self, f: InFlight) -> Result<()> {
        self.slots[f.slot].stream.synchronize()
    }

    /// Wait for every copy of this lane (after an error too: no copy may
    /// outlive the call that queued it).
    pub fn quiesce(&self) {
        for s in &self.slots {
            let _ = s.stream.synchronize();
        }
    }
}
