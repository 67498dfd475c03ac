//! One I/O thread's work: a [`Lane`] takes chunks until none is left, moving
//! host memory with (aligned) positional I/O, device memory through cuFile or
//! its pinned bounce lanes, with the copy of one chunk in flight while the
//! previous one's file I/O runs.

use crate::gpu::order::After;
use crate::gpu::{BounceLane, DevicePath, InFlight, Memory};
use crate::io::align::{self, AlignedBuf};
use crate::io::fault::{self, Point};
use crate::io::file::IoFile;
use crate::{Error, Result};

use super::{Chunk, Dir, PageLocks};

/// Largest read through a lane's staging buffer (reads into memory that
/// O_DIRECT cannot reach straight): 4 MiB reads run at the disk's full rate
/// (2.68 GiB/s against 2.69 for 16 MiB on the development VM, 8 threads).
pub(super) const STAGED_PIECE: usize = 4 << 20;

/// What every thread of one transfer shares.
pub(super) struct Ctx<'a> {
    pub(super) file: &'a IoFile,
    pub(super) dir: Dir,
    pub(super) path: Option<&'a DevicePath>,
    /// Events on the caller's streams that device copies wait for.
    pub(super) after: &'a After,
    /// Pages shared between segments, written by one chunk at a time.
    pub(super) locks: &'a PageLocks,
    /// Bytes of a staging or bounce buffer.
    pub(super) capacity: usize,
}

/// Per-thread resources, reused across calls.
pub struct Lane {
    pub(super) staging: AlignedBuf,
    /// Pinned double buffers and streams, per device, made on first use.
    pub(super) bounce: Vec<BounceLane>,
}

/// One chunk through cuFile, looping over short transfers.
///
/// # Safety
/// `c` must describe device memory valid for the transfer.
unsafe fn cufile_chunk(h: &crate::gpu::cufile::FileHandle, c: &Chunk, dir: Dir) -> Result<()> {
    let mut done = 0usize;
    while done < c.len {
        let off = c.file_offset + done as u64;
        // SAFETY: [addr+done, addr+len) lies in the caller's device range.
        let n = unsafe {
            match dir {
                Dir::Write => h.write(c.addr, c.len - done, off, done as u64)?,
                Dir::Read | Dir::Checksum => h.read(c.addr, c.len - done, off, done as u64)?,
            }
        };
        if n == 0 {
            return Err(match dir {
                Dir::Write => Error::io(
                    "cuFileWrite",
                    None,
                    std::io::Error::from(std::io::ErrorKind::WriteZero),
                ),
                Dir::Read | Dir::Checksum => Error::format(
                    None,
                    format!("file ends before byte {}", c.file_offset + c.len as u64),
                ),
            });
        }
        done += n;
    }
    Ok(())
}

impl Lane {
    /// Take chunks until none is left, pipelining device chunks through the
    /// bounce buffers: the copy of one chunk is in flight while the previous
    /// one's file I/O runs. With `crcs`, push each chunk's CRC-32 there.
    ///
    /// # Safety
    /// Every chunk `take` yields must satisfy the engine's memory contract.
    pub(super) unsafe fn run<'c>(
        &mut self,
        ctx: &Ctx<'_>,
        mut take: impl FnMut() -> Option<(usize, &'c Chunk)>,
        mut crcs: Option<&mut Vec<(usize, Option<u32>)>>,
    ) -> Result<()> {
        let Ctx {
            file,
            dir,
            path,
            after,
            locks,
            capacity,
        } = *ctx;
        let want_crc = crcs.is_some();
        let mut note = |i: usize, crc: Option<u32>| {
            if let Some(v) = crcs.as_mut() {
                v.push((i, crc));
            }
        };
        let mut in_flight: Option<(usize, usize, InFlight)> = None;
        let r = (|| {
            while let Some((i, c)) = take() {
                fault::hit(
                    if dir == Dir::Write {
                        Point::Write
                    } else {
                        Point::Read
                    },
                    file.path(),
                )?;
                // Held until this chunk's bytes are written (cuFile transfers only).
                let _pages = locks.hold(c.shared);
                match (c.memory, path) {
                    (_, _) if dir == Dir::Checksum => {
                        let bytes = self.read_staged(file, c.file_offset, c.len)?;
                        note(i, Some(crc32fast::hash(bytes)));
                    }
                    // SAFETY: the caller's contract covers `c`.
                    (Memory::Host, _) => unsafe {
                        let crc = match dir {
                            Dir::Write => self.write_chunk(file, c, want_crc)?,
                            _ => self.read_chunk(file, c, want_crc)?,
                        };
                        note(i, crc);
                    },
                    (Memory::Cuda(dev), Some(DevicePath::CuFile { handle, .. })) => {
                        crate::gpu::cuda::driver()?.make_current(dev)?;
                        // SAFETY: the caller's contract covers `c`.
                        unsafe { cufile_chunk(handle, c, dir)? }
                        // The bytes went device <-> file: nothing to checksum here.
                        note(i, None);
                    }
                    (Memory::Cuda(dev), _) => {
                        let lane = self.bounce_lane(dev, capacity)?;
                        let after = after.event(dev);
                        // SAFETY: the caller's contract covers `c`; chunks are at
                        // most chunk_size, within the lane's capacity; the slot
                        // taken was finished before (two slots, one in flight).
                        let started = unsafe {
                            match dir {
                                Dir::Write => self.bounce[lane].start_save(
                                    c.addr,
                                    c.len,
                                    c.file_offset,
                                    after,
                                )?,
                                _ => {
                                    let (f, crc) = self.bounce[lane].start_load(
                                        c.addr,
                                        c.len,
                                        c.file_offset,
                                        file,
                                        want_crc,
                                        after,
                                    )?;
                                    note(i, crc);
                                    f
                                }
                            }
                        };
                        if let Some((l, j, f)) = in_flight.replace((lane, i, started)) {
                            if let Some(crc) = self.finish(l, f, dir, file, want_crc)? {
                                note(j, Some(crc));
                            }
                        }
                    }
                }
            }
            if let Some((l, j, f)) = in_flight.take() {
                if let Some(crc) = self.finish(l, f, dir, file, want_crc)? {
                    note(j, Some(crc));
                }
            }
            Ok(())
        })();
        if r.is_err() {
            for b in &self.bounce {
                b.quiesce();
            }
        }
        r
    }

    /// Second half of a bounce chunk; on save with `crc`, the chunk's CRC-32.
    fn finish(
        &mut self,
        lane: usize,
        f: InFlight,
        dir: Dir,
        file: &IoFile,
        crc: bool,
    ) -> Result<Option<u32>> {
        match dir {
            Dir::Write => self.bounce[lane].finish_save(f, file, crc),
            _ => self.bounce[lane].finish_load(f).map(|()| None),
        }
    }

    /// Index of this thread's bounce lane for `device`, made on first use.
    /// Its capacity is at least this lane's staging buffer, so that a lane first
    /// used for a file in memory (small chunks) does not reallocate its pinned
    /// buffers when a disk file with larger chunks comes next.
    fn bounce_lane(&mut self, device: i32, capacity: usize) -> Result<usize> {
        let capacity = capacity.max(self.staging.len());
        if let Some(i) = self
            .bounce
            .iter()
            .position(|b| b.device() == device && b.capacity() >= capacity)
        {
            return Ok(i);
        }
        self.bounce.retain(|b| b.device() != device);
        let lane = match BounceLane::pinned(device, capacity)? {
            Some(l) => l,
            None => {
                // The pinned-memory cap is full: every engine's idle lanes go
                // back first; if that is not enough, this lane runs pageable.
                super::pool::release_buffers();
                match BounceLane::pinned(device, capacity)? {
                    Some(l) => l,
                    None => BounceLane::pageable(device, capacity)?,
                }
            }
        };
        self.bounce.push(lane);
        Ok(self.bounce.len() - 1)
    }

    /// # Safety
    /// `c` must describe readable host memory (see [`Engine::write`]).
    unsafe fn write_chunk(&mut self, file: &IoFile, c: &Chunk, crc: bool) -> Result<Option<u32>> {
        debug_assert_eq!(c.memory, Memory::Host);
        // SAFETY: the caller guarantees [addr, addr+len) is readable.
        let src = unsafe { std::slice::from_raw_parts(c.addr as *const u8, c.len) };
        let sum = crc.then(|| crc32fast::hash(src));
        // SAFETY: forwarded.
        unsafe { self.write_host(file, c, src)? };
        Ok(sum)
    }

    /// # Safety
    /// `src` is the chunk's memory (see [`Engine::write`]).
    unsafe fn write_host(&mut self, file: &IoFile, c: &Chunk, src: &[u8]) -> Result<()> {
        let a = file.alignment();
        if !file.is_direct()
            || align::is_aligned(c.addr, a.memory as u64)
                && align::is_aligned(c.file_offset, a.offset as u64)
        {
            // Buffered, or O_DIRECT straight from the caller's memory.
            return file.write_at(src, c.file_offset);
        }
        // O_DIRECT from misaligned memory: stage the middle of whole write units.
        let ao = file.write_unit();
        let mid_start = align::align_up(c.file_offset, ao).min(c.file_offset + c.len as u64);
        let mid_end = align::align_down(c.file_offset + c.len as u64, ao).max(mid_start);
        let h = (mid_start - c.file_offset) as usize;
        let m = (mid_end - mid_start) as usize;
        file.write_at(&src[..h], c.file_offset)?;
        if m > 0 {
            let stage = &mut self.staging.as_mut_slice()[..m];
            stage.copy_from_slice(&src[h..h + m]);
            file.write_blocks(stage, mid_start)?;
        }
        file.write_at(&src[h + m..], mid_end)
    }

    /// # Safety
    /// `c` must describe writable host memory (see [`Engine::read`]).
    unsafe fn read_chunk(&mut self, file: &IoFile, c: &Chunk, crc: bool) -> Result<Option<u32>> {
        debug_assert_eq!(c.memory, Memory::Host);
        // SAFETY: the caller guarantees [addr, addr+len) is writable and unshared.
        let dst = unsafe { std::slice::from_raw_parts_mut(c.addr as *mut u8, c.len) };
        let a = file.alignment();
        if !file.is_direct()
            || align::is_aligned(c.addr, a.memory as u64)
                && align::is_aligned(c.file_offset, a.offset as u64)
        {
            file.read_at(dst, c.file_offset)?;
        } else {
            // Through the staging buffer a piece at a time: misaligned
            // destinations (a model's own tensors, loaded in place) keep at
            // most STAGED_PIECE of each lane's buffer resident, not a chunk.
            let mut done = 0;
            while done < c.len {
                let n = (c.len - done).min(STAGED_PIECE);
                let staged = self.read_staged(file, c.file_offset + done as u64, n)?;
                dst[done..done + n].copy_from_slice(staged);
                done += n;
            }
        }
        // Over the destination, after the read: what the caller gets is what is checked.
        Ok(crc.then(|| crc32fast::hash(dst)))
    }

    /// Read `[off, off+len)` through the staging buffer (O_DIRECT over the
    /// aligned superset where the file has it); returns the bytes.
    fn read_staged(&mut self, file: &IoFile, off: u64, len: usize) -> Result<&[u8]> {
        if !file.is_direct() {
            let stage = &mut self.staging.as_mut_slice()[..len];
            file.read_at(stage, off)?;
            return Ok(stage);
        }
        let ao = file.alignment().offset as u64;
        let start = align::align_down(off, ao);
        let end = align::align_up(off + len as u64, ao);
        let span = (end - start) as usize;
        let stage = &mut self.staging.as_mut_slice()[..span];
        let skip = (off - start) as usize;
        file.read_blocks_needed(stage, start, skip + len)?;
        Ok(&stage[skip..skip + len])
    }
}
