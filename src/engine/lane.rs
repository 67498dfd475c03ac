//! One I/O thread's work: a [`Lane`] takes chunks until none is left, moving
//! host memory with (aligned) positional I/O, device memory through cuFile or
//! its pinned bounce lanes, with the copy of one chunk in flight while the
//! previous one's file I/O runs. A chunk of several pieces is gathered into
//! (or scattered from) the staging buffer, or a bounce slot when some of its
//! pieces are device memory, around a single file I/O.

use crate::gpu::order::After;
use crate::gpu::{BounceLane, DevicePath, InFlight, Memory, SlotPiece};
use crate::io::align::{self, AlignedBuf};
use crate::io::fault::{self, Point};
use crate::io::file::IoFile;
use crate::{Error, Result};

use super::{Chunk, Dir, PageLocks, Piece, Plan};

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
    /// The chunks' pieces and patches.
    pub(super) plan: &'a Plan,
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
unsafe fn cufile_chunk(h: &crate::gpu::cufile::FileHandle, c: &Piece, dir: Dir) -> Result<()> {
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

/// A device chunk whose copy is in flight on a bounce lane.
enum Pending {
    /// One whole piece (its index): finished by `Lane::finish`.
    Whole(usize, usize, InFlight),
    /// A gathered save (chunk index): checksummed, patched and written once
    /// its D2H copies are done.
    GatheredSave(usize, usize, InFlight),
    /// A gathered load: its H2D copies to wait for.
    GatheredLoad(usize, InFlight),
}

impl Lane {
    /// Take chunks until none is left, pipelining device chunks through the
    /// bounce buffers: the copy of one chunk is in flight while the previous
    /// one's file I/O runs. With `crcs`, push each piece's CRC-32 there.
    ///
    /// # Safety
    /// Every chunk `take` yields (with its pieces in `ctx.plan`) must satisfy
    /// the engine's memory contract.
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
            plan,
        } = *ctx;
        let want_crc = crcs.is_some();
        let mut note = |i: usize, crc: Option<u32>| {
            if let Some(v) = crcs.as_mut() {
                v.push((i, crc));
            }
        };
        let mut in_flight: Option<Pending> = None;
        let r = (|| {
            while let Some((ci, chunk)) = take() {
                fault::hit(
                    if dir == Dir::Write {
                        Point::Write
                    } else {
                        Point::Read
                    },
                    file.path(),
                )?;
                // Held until this chunk's bytes are written (cuFile transfers only).
                let _pages = locks.hold(chunk.shared);
                let Some((i, c)) = plan.whole(chunk) else {
                    let started = match (chunk.device, dir) {
                        (_, Dir::Checksum) => {
                            let bytes = self.read_staged(file, chunk.file_offset, chunk.len)?;
                            for (k, p) in plan.pieces_of(chunk).iter().enumerate() {
                                let at = (p.file_offset - chunk.file_offset) as usize;
                                note(
                                    chunk.pieces.start + k,
                                    Some(crc32fast::hash(&bytes[at..at + p.len])),
                                );
                            }
                            None
                        }
                        // SAFETY: the caller's contract covers the chunk's pieces.
                        (None, Dir::Write) => unsafe {
                            self.write_gathered(file, plan, chunk, want_crc, &mut note)?;
                            None
                        },
                        // SAFETY: as above.
                        (None, Dir::Read) => unsafe {
                            self.read_gathered(file, plan, chunk, want_crc, &mut note)?;
                            None
                        },
                        // SAFETY: as above; the slot taken was finished before.
                        (Some(dev), Dir::Write) => unsafe {
                            let (l, f) =
                                self.start_save_gathered(ctx, chunk, dev, after.event(dev))?;
                            Some(Pending::GatheredSave(l, ci, f))
                        },
                        // SAFETY: as above.
                        (Some(dev), Dir::Read) => unsafe {
                            let (l, f) = self.start_load_gathered(
                                ctx,
                                chunk,
                                dev,
                                after.event(dev),
                                want_crc,
                                &mut note,
                            )?;
                            Some(Pending::GatheredLoad(l, f))
                        },
                    };
                    if let Some(p) = started {
                        if let Some(prev) = in_flight.replace(p) {
                            self.settle(prev, dir, file, plan, want_crc, &mut note)?;
                        }
                    }
                    continue;
                };
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
                        if let Some(prev) = in_flight.replace(Pending::Whole(lane, i, started)) {
                            self.settle(prev, dir, file, plan, want_crc, &mut note)?;
                        }
                    }
                }
            }
            if let Some(prev) = in_flight.take() {
                self.settle(prev, dir, file, plan, want_crc, &mut note)?;
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

    /// Finish a device chunk in flight.
    fn settle(
        &mut self,
        p: Pending,
        dir: Dir,
        file: &IoFile,
        plan: &Plan,
        want_crc: bool,
        note: &mut impl FnMut(usize, Option<u32>),
    ) -> Result<()> {
        match p {
            Pending::Whole(l, j, f) => {
                if let Some(crc) = self.finish(l, f, dir, file, want_crc)? {
                    note(j, Some(crc));
                }
            }
            Pending::GatheredSave(l, ci, f) => {
                let chunk = &plan.chunks[ci];
                let bytes = self.bounce[l].wait_gathered(&f)?;
                seal(bytes, plan, chunk, want_crc, note);
                self.bounce[l].write_gathered(f, file)?;
            }
            Pending::GatheredLoad(l, f) => self.bounce[l].finish_load(f)?,
        }
        Ok(())
    }

    /// Where a gathered chunk starting at `file_offset` begins in an aligned
    /// buffer, so that its direct middle (from the first whole write unit) is
    /// aligned in memory as well.
    fn gather_skip(file: &IoFile, file_offset: u64) -> usize {
        if !file.is_direct() {
            return 0;
        }
        let unit = file.write_unit();
        let m = unit.max(file.alignment().memory as u64);
        let head = align::align_up(file_offset, unit) - file_offset;
        ((m - head % m) % m) as usize
    }

    /// A gathered chunk of host pieces: copied into the staging buffer,
    /// checksummed and patched there, then written with one I/O.
    ///
    /// # Safety
    /// The pieces' memory must be readable host memory (see [`super::Engine::write`]).
    unsafe fn write_gathered(
        &mut self,
        file: &IoFile,
        plan: &Plan,
        chunk: &Chunk,
        crc: bool,
        note: &mut impl FnMut(usize, Option<u32>),
    ) -> Result<()> {
        let skip = Self::gather_skip(file, chunk.file_offset);
        let buf = &mut self.staging.as_mut_slice()[skip..skip + chunk.len];
        for p in plan.pieces_of(chunk) {
            let at = (p.file_offset - chunk.file_offset) as usize;
            // SAFETY: the caller guarantees [addr, addr+len) is readable; the
            // piece lies inside the chunk (see `plan`).
            let src = unsafe { std::slice::from_raw_parts(p.addr as *const u8, p.len) };
            buf[at..at + p.len].copy_from_slice(src);
        }
        seal(buf, plan, chunk, crc, note);
        file.write_at(buf, chunk.file_offset)
    }

    /// A gathered chunk of host pieces read with one I/O into the staging
    /// buffer and scattered to the pieces' memory (CRC-32s over the destinations).
    ///
    /// # Safety
    /// The pieces' memory must be writable host memory (see [`super::Engine::read`]).
    unsafe fn read_gathered(
        &mut self,
        file: &IoFile,
        plan: &Plan,
        chunk: &Chunk,
        crc: bool,
        note: &mut impl FnMut(usize, Option<u32>),
    ) -> Result<()> {
        let bytes = self.read_staged(file, chunk.file_offset, chunk.len)?;
        for (k, p) in plan.pieces_of(chunk).iter().enumerate() {
            let at = (p.file_offset - chunk.file_offset) as usize;
            // SAFETY: the caller guarantees [addr, addr+len) is writable and unshared.
            let dst = unsafe { std::slice::from_raw_parts_mut(p.addr as *mut u8, p.len) };
            dst.copy_from_slice(&bytes[at..at + p.len]);
            note(chunk.pieces.start + k, crc.then(|| crc32fast::hash(dst)));
        }
        Ok(())
    }

    /// First half of a gathered chunk with device pieces: its pieces copied
    /// (host) or queued for copy behind `after` (device) into a bounce slot of
    /// `device`.
    ///
    /// # Safety
    /// As for [`Self::write_gathered`], device pieces being device memory of `device`.
    unsafe fn start_save_gathered(
        &mut self,
        ctx: &Ctx<'_>,
        chunk: &Chunk,
        device: i32,
        after: Option<&crate::gpu::cuda::Event>,
    ) -> Result<(usize, InFlight)> {
        let lane = self.bounce_lane(device, ctx.capacity)?;
        let pieces = slot_pieces(ctx.plan, chunk);
        let skip = Self::gather_skip(ctx.file, chunk.file_offset);
        // SAFETY: forwarded; the pieces lie inside the chunk.
        let f = unsafe {
            self.bounce[lane].start_save_gathered(
                chunk.file_offset,
                chunk.len,
                skip,
                &pieces,
                after,
            )?
        };
        Ok((lane, f))
    }

    /// First half of a gathered load with device pieces: the chunk read into
    /// a bounce slot, host pieces copied out (CRC-32s over the destinations),
    /// device pieces queued for their H2D copy behind `after` (CRC-32s over
    /// the slot).
    ///
    /// # Safety
    /// As for [`Self::read_gathered`], device pieces being device memory of `device`.
    unsafe fn start_load_gathered(
        &mut self,
        ctx: &Ctx<'_>,
        chunk: &Chunk,
        device: i32,
        after: Option<&crate::gpu::cuda::Event>,
        crc: bool,
        note: &mut impl FnMut(usize, Option<u32>),
    ) -> Result<(usize, InFlight)> {
        let lane = self.bounce_lane(device, ctx.capacity)?;
        let b = &mut self.bounce[lane];
        // SAFETY: the slot taken was finished before (two slots, one in flight).
        let f = unsafe { b.read_gathered(chunk.file_offset, chunk.len, ctx.file, after)? };
        for (k, p) in ctx.plan.pieces_of(chunk).iter().enumerate() {
            let at = (p.file_offset - chunk.file_offset) as usize;
            let src = &b.slot_bytes(&f)[at..at + p.len];
            let sum = match p.memory {
                Memory::Host => {
                    // SAFETY: the caller guarantees [addr, addr+len) is writable.
                    let dst = unsafe { std::slice::from_raw_parts_mut(p.addr as *mut u8, p.len) };
                    dst.copy_from_slice(src);
                    crc.then(|| crc32fast::hash(dst))
                }
                Memory::Cuda(_) => {
                    let sum = crc.then(|| crc32fast::hash(src));
                    // SAFETY: the caller guarantees the destination; it lies in the chunk.
                    unsafe { b.queue_htod(&f, at, p.addr, p.len)? };
                    sum
                }
            };
            note(chunk.pieces.start + k, sum);
        }
        Ok((lane, f))
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
    unsafe fn write_chunk(&mut self, file: &IoFile, c: &Piece, crc: bool) -> Result<Option<u32>> {
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
    unsafe fn write_host(&mut self, file: &IoFile, c: &Piece, src: &[u8]) -> Result<()> {
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
    unsafe fn read_chunk(&mut self, file: &IoFile, c: &Piece, crc: bool) -> Result<Option<u32>> {
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

/// A gathered chunk's pieces as the bounce lane takes them.
fn slot_pieces(plan: &Plan, chunk: &Chunk) -> Vec<SlotPiece> {
    plan.pieces_of(chunk)
        .iter()
        .map(|p| SlotPiece {
            at: (p.file_offset - chunk.file_offset) as usize,
            addr: p.addr,
            len: p.len,
            device: p.memory != Memory::Host,
        })
        .collect()
}

/// A gathered chunk's bytes, about to be written: each piece's CRC-32 noted,
/// then the chunk's patches (segments' CRC-32s stored in it) applied.
fn seal(
    buf: &mut [u8],
    plan: &Plan,
    chunk: &Chunk,
    crc: bool,
    note: &mut impl FnMut(usize, Option<u32>),
) {
    if !crc {
        return;
    }
    let first = chunk.pieces.start;
    let mut sums = Vec::with_capacity(chunk.pieces.len());
    for p in plan.pieces_of(chunk) {
        let at = (p.file_offset - chunk.file_offset) as usize;
        sums.push(crc32fast::hash(&buf[at..at + p.len]));
    }
    for x in &plan.patches[chunk.patches.clone()] {
        let v = sums[x.piece - first].to_le_bytes();
        buf[x.rel..x.rel + 4].copy_from_slice(&v);
    }
    for (k, v) in sums.into_iter().enumerate() {
        note(first + k, Some(v));
    }
}
