//! The pinned bounce-buffer pipeline for device memory.
//!
//! [`BounceLane`] is one I/O thread's share of the pipeline: two pinned
//! buffers and two streams, so the copy of chunk i+1 (D2H on save, H2D on
//! load) overlaps the file I/O of chunk i. A chunk may also be gathered from
//! (or scattered to) many pieces of host and device memory around one file
//! I/O (`*_gathered`): many small tensors, one request.

use crate::gpu::cuda::{self, PinnedBuffer, Stream};
use crate::io::file::IoFile;
use crate::{Error, Result};

/// One slot of a lane: a pinned buffer and the stream that fills or drains it.
struct Slot {
    buf: PinnedBuffer,
    stream: Stream,
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
    /// Two pinned buffers of `capacity` bytes and two streams on `device`.
    pub fn new(device: i32, capacity: usize) -> Result<Self> {
        cuda::driver()?.make_current(device)?;
        let mk = || -> Result<Slot> {
            Ok(Slot {
                stream: Stream::new(device)?,
                buf: PinnedBuffer::new(capacity)?,
            })
        };
        Ok(BounceLane {
            device,
            slots: [mk()?, mk()?],
            next: 0,
        })
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    pub fn capacity(&self) -> usize {
        self.slots[0].buf.len()
    }

    /// Pinned bytes held.
    pub fn pinned_bytes(&self) -> usize {
        self.slots.iter().map(|s| s.buf.len()).sum()
    }

    fn take_slot(&mut self) -> usize {
        let s = self.next;
        self.next ^= 1;
        s
    }

    /// Save, first half: queue the D2H copy of a chunk into a free slot.
    ///
    /// # Safety
    /// `[src, src+len)` must be readable device memory of this lane's device,
    /// `len <= capacity`, and the slot taken must not hold a chunk in flight.
    pub unsafe fn start_save(
        &mut self,
        src: u64,
        len: usize,
        file_offset: u64,
    ) -> Result<InFlight> {
        let cuda = cuda::driver()?;
        cuda.make_current(self.device)?;
        let slot = self.take_slot();
        let s = &mut self.slots[slot];
        // SAFETY: the buffer holds `len` bytes (caller checked) and is not in use
        // (the caller finished this slot); the source is valid per the caller.
        unsafe { cuda.memcpy_dtoh_async(s.buf.as_mut_ptr(), src, len, &s.stream)? };
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
    /// aligned superset), then queue its H2D copy. With `crc`, also returns
    /// the CRC-32 of the bytes read (computed on the slot).
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
        // SAFETY: the pinned range holds the bytes just read and stays untouched
        // until `finish_load` synchronizes; the destination is valid per the caller.
        unsafe { cuda.memcpy_htod_async(dst, s.buf.as_ptr().add(skip), len, &s.stream)? };
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
    /// D2H copy of each device piece. Bytes no piece covers are left as they are.
    ///
    /// # Safety
    /// Each piece's memory must be readable memory of its kind (device memory
    /// of this lane's device), `at + len <= len` of the chunk for each piece,
    /// `skip + len <= capacity`, and the slot taken must not hold a chunk in flight.
    pub unsafe fn start_save_gathered(
        &mut self,
        file_offset: u64,
        len: usize,
        skip: usize,
        pieces: &[SlotPiece],
    ) -> Result<InFlight> {
        let cuda = cuda::driver()?;
        cuda.make_current(self.device)?;
        let slot = self.take_slot();
        let s = &mut self.slots[slot];
        if skip + len > s.buf.len() {
            return Err(Error::invalid(format!(
                "chunk of {len} bytes exceeds the pinned buffer ({})",
                s.buf.len()
            )));
        }
        let base = s.buf.as_mut_ptr();
        for p in pieces {
            // SAFETY: [skip+at, skip+at+len) lies in the slot (checked above and
            // by the caller); the source is valid per the caller.
            unsafe {
                let dst = base.add(skip + p.at);
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
    /// file_offset+len)` into a free slot (O_DIRECT over its aligned superset).
    /// Its bytes are then [`Self::slot_bytes`]; device pieces are queued with
    /// [`Self::queue_htod`], and [`Self::finish_load`] waits for them.
    ///
    /// # Safety
    /// The slot taken must not hold a chunk in flight.
    pub unsafe fn read_gathered(
        &mut self,
        file_offset: u64,
        len: usize,
        file: &IoFile,
    ) -> Result<InFlight> {
        let slot = self.take_slot();
        let s = &mut self.slots[slot];
        let (start, span) = if file.is_direct() {
            let a = file.alignment().offset as u64;
            let start = crate::io::align::align_down(file_offset, a);
            let end = crate::io::align::align_up(file_offset + len as u64, a);
            (start, (end - start) as usize)
        } else {
            (file_offset, len)
        };
        let skip = (file_offset - start) as usize;
        if span > s.buf.len() {
            return Err(Error::invalid(format!(
                "chunk of {span} bytes exceeds the pinned buffer ({})",
                s.buf.len()
            )));
        }
        file.read_blocks_needed(&mut s.buf.as_mut_slice()[..span], start, skip + len)?;
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
        // SAFETY: the slot holds the chunk's bytes and stays untouched until
        // `finish_load` synchronizes; the destination is valid per the caller.
        unsafe { cuda.memcpy_htod_async(dst, s.buf.as_ptr().add(f.skip + at), len, &s.stream) }
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
