//! The pinned bounce-buffer pipeline for device memory.
//!
//! [`BounceLane`] is one I/O thread's share of the pipeline: two pinned
//! buffers and two streams, so the copy of chunk i+1 (D2H on save, H2D on
//! load) overlaps the file I/O of chunk i. Every copy is queued behind the
//! caller's stream ([`crate::gpu::order`]). Where the pinned-memory cap
//! ([`crate::gpu::budget`]) has no room, a lane runs on pageable buffers:
//! slower copies, same results. A chunk may also be gathered from (or
//! scattered to) many pieces of host and device memory around one file I/O
//! (`*_gathered`): many small tensors, one request.

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
    /// The serial of the event the stream last waited for (0: none).
    waited: u64,
}

impl Slot {
    /// Read `len` bytes at `file_offset` into the buffer (with O_DIRECT, the
    /// aligned blocks around them); returns where the first byte landed.
    fn read(&mut self, file: &IoFile, file_offset: u64, len: usize) -> Result<usize> {
        let (start, span) = if file.is_direct() {
            let a = file.alignment().offset as u64;
            let start = crate::io::align::align_down(file_offset, a);
            let end = crate::io::align::align_up(file_offset + len as u64, a);
            (start, (end - start) as usize)
        } else {
            (file_offset, len)
        };
        let skip = (file_offset - start) as usize;
        if span > self.buf.len() {
            return Err(Error::invalid(format!(
                "chunk of {span} bytes exceeds the bounce buffer ({})",
                self.buf.len()
            )));
        }
        file.read_blocks_needed(&mut self.buf.as_mut_slice()[..span], start, skip + len)?;
        Ok(skip)
    }

    /// Queue the stream behind `after` (the caller's stream), once per
    /// transfer: a stream runs its work in order, so every copy queued after
    /// the wait is behind it too. One driver call less per chunk.
    fn wait_for(&mut self, after: Option<&Event>) -> Result<()> {
        if let Some(e) = after {
            if self.waited != e.serial() {
                self.stream.wait(e)?;
                self.waited = e.serial();
            }
        }
        Ok(())
    }
}

/// A chunk whose copy is in flight on one slot.
pub struct InFlight {
    slot: usize,
    file_offset: u64,
    len: usize,
    /// Where the chunk's first byte sits in the slot (gathered chunks are
    /// placed so that their aligned middle is aligned in memory too).
    skip: usize,
}

/// Where one piece of a gathered chunk comes from or goes to.
#[derive(Clone, Copy, Debug)]
pub struct SlotPiece {
    /// Offset of the piece in the chunk.
    pub at: usize,
    pub addr: u64,
    pub len: usize,
    /// Device memory of the lane's device (else host memory).
    pub device: bool,
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
                    waited: 0,
                },
                Slot {
                    stream: Stream::new(device)?,
                    buf: b,
                    waited: 0,
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
        s.wait_for(after)?;
        let dst = s.buf.as_mut_slice()[..len].as_mut_ptr();
        // SAFETY: the buffer holds `len` bytes (the slice above checked) and is
        // not in use (the caller finished this slot); the source is valid per the caller.
        unsafe { cuda.memcpy_dtoh_async(dst, src, len, &s.stream)? };
        Ok(InFlight {
            slot,
            file_offset,
            len,
            skip: 0,
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
        let skip = s.read(file, file_offset, len)?;
        let sum = crc.then(|| crc32fast::hash(&s.buf.as_slice()[skip..skip + len]));
        let cuda = cuda::driver()?;
        cuda.make_current(self.device)?;
        s.wait_for(after)?;
        let src = s.buf.as_slice()[skip..skip + len].as_ptr();
        // SAFETY: the slot holds the bytes just read and stays untouched until
        // `finish_load` synchronizes; the destination is valid per the caller.
        unsafe { cuda.memcpy_htod_async(dst, src, len, &s.stream)? };
        Ok((
            InFlight {
                slot,
                file_offset,
                len,
                skip: 0,
            },
            sum,
        ))
    }

    /// Save, first half, of a gathered chunk of `len` bytes at `file_offset`:
    /// in a free slot from byte `skip` on, copy each host piece and queue the
    /// D2H copy of each device piece behind `after` (the caller's stream).
    /// Bytes no piece covers are left as they are.
    ///
    /// # Safety
    /// Each piece's memory must be readable memory of its kind (device memory
    /// of this lane's device), `at + len` within the chunk for each piece,
    /// and the slot taken must not hold a chunk in flight.
    pub unsafe fn start_save_gathered(
        &mut self,
        file_offset: u64,
        len: usize,
        skip: usize,
        pieces: &[SlotPiece],
        after: Option<&Event>,
    ) -> Result<InFlight> {
        let cuda = cuda::driver()?;
        cuda.make_current(self.device)?;
        let slot = self.take_slot();
        let s = &mut self.slots[slot];
        if skip + len > s.buf.len() {
            return Err(Error::invalid(format!(
                "chunk of {len} bytes exceeds the bounce buffer ({})",
                s.buf.len()
            )));
        }
        s.wait_for(after)?;
        let base = s.buf.as_mut_slice()[skip..skip + len].as_mut_ptr();
        for p in pieces {
            if p.at + p.len > len {
                return Err(Error::invalid("a piece lies outside its chunk"));
            }
            // SAFETY: [at, at+len) lies in the chunk's part of the slot (checked
            // above); the source is valid per the caller.
            unsafe {
                let dst = base.add(p.at);
                if p.device {
                    cuda.memcpy_dtoh_async(dst, p.addr, p.len, &s.stream)?;
                } else {
                    std::ptr::copy_nonoverlapping(p.addr as *const u8, dst, p.len);
                }
            }
        }
        Ok(InFlight {
            slot,
            file_offset,
            len,
            skip,
        })
    }

    /// Save of a gathered chunk: wait for its copies and hand its bytes over
    /// (to checksum and patch them before [`Self::write_gathered`]).
    pub fn wait_gathered(&mut self, f: &InFlight) -> Result<&mut [u8]> {
        let s = &mut self.slots[f.slot];
        s.stream.synchronize()?;
        Ok(&mut s.buf.as_mut_slice()[f.skip..f.skip + f.len])
    }

    /// Save of a gathered chunk, second half: write its bytes.
    pub fn write_gathered(&self, f: InFlight, file: &IoFile) -> Result<()> {
        let s = &self.slots[f.slot];
        file.write_at(&s.buf.as_slice()[f.skip..f.skip + f.len], f.file_offset)
    }

    /// Load, first half, of a gathered chunk: read `[file_offset,
    /// file_offset+len)` into a free slot (O_DIRECT over its aligned superset)
    /// and order the slot's stream behind `after` (the caller's stream: work
    /// queued there may still use the destinations). Its bytes are then
    /// [`Self::slot_bytes`]; device pieces are queued with
    /// [`Self::queue_htod`], and [`Self::finish_load`] waits for them.
    ///
    /// # Safety
    /// The slot taken must not hold a chunk in flight.
    pub unsafe fn read_gathered(
        &mut self,
        file_offset: u64,
        len: usize,
        file: &IoFile,
        after: Option<&Event>,
    ) -> Result<InFlight> {
        let slot = self.take_slot();
        let s = &mut self.slots[slot];
        let skip = s.read(file, file_offset, len)?;
        if after.is_some() {
            cuda::driver()?.make_current(self.device)?;
            s.wait_for(after)?;
        }
        Ok(InFlight {
            slot,
            file_offset,
            len,
            skip,
        })
    }

    /// The bytes of a gathered chunk read by [`Self::read_gathered`].
    pub fn slot_bytes(&self, f: &InFlight) -> &[u8] {
        &self.slots[f.slot].buf.as_slice()[f.skip..f.skip + f.len]
    }

    /// Queue the H2D copy of `len` bytes from offset `at` of a gathered chunk
    /// (read by [`Self::read_gathered`]) to `dst`.
    ///
    /// # Safety
    /// `[dst, dst+len)` must be writable device memory of this lane's device
    /// that nobody else touches until [`Self::finish_load`], and `at + len`
    /// at most the chunk's length.
    pub unsafe fn queue_htod(&self, f: &InFlight, at: usize, dst: u64, len: usize) -> Result<()> {
        let cuda = cuda::driver()?;
        cuda.make_current(self.device)?;
        let s = &self.slots[f.slot];
        let src = s.buf.as_slice()[f.skip + at..f.skip + at + len].as_ptr();
        // SAFETY: the slot holds the chunk's bytes and stays untouched until
        // `finish_load` synchronizes; the destination is valid per the caller.
        unsafe { cuda.memcpy_htod_async(dst, src, len, &s.stream) }
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
