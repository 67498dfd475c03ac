//! The engine: moves segments (memory range <-> file range) in parallel chunks.
//!
//! A transfer is a list of [`Segment`]s. The engine sorts them by file offset,
//! joins neighbours into runs (segments that touch, for writes; segments less
//! than [`READ_GAP`] apart, for reads) and cuts each run into chunks on a grid
//! of `chunk_size` in file offsets, so every chunk but a run's first and last
//! starts and ends aligned. A chunk holds one piece of one segment (a large
//! tensor: moved straight between its memory and the file where alignment
//! allows) or pieces of many (small tensors and the headers between them:
//! gathered into, or scattered from, the thread's aligned staging buffer or
//! pinned bounce slot, so one I/O serves them all). A pool of I/O threads takes
//! chunks in file order until none is left. The call returns when every chunk
//! is done, or with the first error; the other threads stop taking chunks as
//! soon as one fails, so an error never goes unreported and a write is never
//! silently partial.
//!
//! On request every piece's CRC-32 is computed by the thread that moved it,
//! over the bytes as they pass through host memory (the caller's memory, the
//! staging buffer or a pinned bounce slot), and the pieces' values are combined
//! into one CRC-32 per segment. Bytes that never touch host memory (cuFile)
//! get no value rather than a wrong one. A write may also ask for a segment's
//! CRC-32 to be stored at a file offset ([`Patch`]: a zip data descriptor after
//! the record): it goes into the same I/O when the segment and that offset
//! fall in one gathered chunk, else it is written once every chunk is done.
//!
//! Each thread works in a [`Lane`]: its aligned staging buffer (for O_DIRECT
//! from memory that is not aligned, and for gathered chunks). Lanes are kept
//! between calls, so a steady stream of saves allocates nothing.

mod config;
mod lane;

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crc32fast::Hasher;

pub use crate::gpu::Memory;
use crate::gpu::{BounceLane, DevicePath};
use crate::io::align::{self, AlignedBuf};
use crate::io::file::IoFile;
use crate::{Error, Result};

pub use config::{default_memory_threads, parse_size, EngineConfig};
pub use config::{DEFAULT_CHUNK_SIZE, DEFAULT_MEMORY_CHUNK_SIZE, DEFAULT_THREADS};
pub use lane::Lane;

/// Segments of a read this close in the file share one I/O: the bytes between
/// them (zip headers, records nobody asked for) are read and dropped, which
/// costs less than a request of its own (on a virtio disk a request costs
/// about what 100-200 KiB take to stream).
pub const READ_GAP: u64 = 128 << 10;

/// One contiguous memory range and the file range it maps to.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    pub file_offset: u64,
    pub addr: u64,
    pub len: u64,
    pub memory: Memory,
}

/// Store segment `seg`'s CRC-32 (4 bytes, little-endian) at file offset `at`,
/// outside the segment: written in the I/O that carries `at` when the segment
/// and `at` fall in one gathered chunk, else once the data is down. Nothing is
/// stored for a segment whose bytes did not pass through host memory (cuFile).
/// The CRC-32s computed for other segments are those of their source memory,
/// before any patch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Patch {
    pub seg: usize,
    pub at: u64,
}

/// What a transfer did.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub bytes: u64,
    /// I/Os (chunks) the transfer was cut into.
    pub chunks: usize,
    pub threads: usize,
    /// O_DIRECT was available on the file.
    pub direct: bool,
    /// How device memory moved: None (host only), "bounce" or "cufile".
    pub device_path: Option<&'static str>,
    /// When checksums were asked for: the CRC-32 of each segment's bytes, in
    /// segment order; None for a segment whose bytes did not pass through host
    /// memory (cuFile). Empty otherwise.
    pub crc32: Vec<Option<u32>>,
    /// Patches written after the data rather than in the I/O that carried them.
    pub late_patches: usize,
}

/// A piece of one segment inside one chunk.
#[derive(Clone, Copy, Debug)]
struct Piece {
    /// Index of the segment it belongs to.
    seg: usize,
    file_offset: u64,
    addr: u64,
    len: usize,
    memory: Memory,
}

/// One I/O: the file range `[file_offset, file_offset + len)` and the pieces
/// of segments in it (for reads, possibly with gaps between them).
#[derive(Clone, Debug)]
struct Chunk {
    file_offset: u64,
    len: usize,
    pieces: Range<usize>,
    /// Into [`Plan::patches`]: CRC-32s stored inside this chunk.
    patches: Range<usize>,
    /// The CUDA device of its device pieces, if any (one per chunk).
    device: Option<i32>,
}

/// A patch that lands inside a gathered chunk: `rel` bytes into it.
#[derive(Clone, Copy, Debug)]
struct InChunk {
    rel: usize,
    /// Index of the (only) piece of the segment whose CRC-32 goes there.
    piece: usize,
}

#[derive(Debug, Default)]
struct Plan {
    chunks: Vec<Chunk>,
    /// In chunk order; a segment's pieces in file order.
    pieces: Vec<Piece>,
    patches: Vec<InChunk>,
    /// Patches written after the data.
    late: Vec<Patch>,
}

impl Plan {
    fn pieces_of(&self, c: &Chunk) -> &[Piece] {
        &self.pieces[c.pieces.clone()]
    }

    /// The chunk's single piece when it covers the whole chunk (moved without
    /// gathering), else None.
    fn whole(&self, c: &Chunk) -> Option<(usize, &Piece)> {
        let i = c.pieces.start;
        (c.pieces.len() == 1)
            .then(|| &self.pieces[i])
            .filter(|p| p.file_offset == c.file_offset && p.len == c.len)
            .map(|p| (i, p))
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    Write,
    Read,
    /// Read into the staging buffer only, to checksum the file's bytes.
    Checksum,
}

pub struct Engine {
    cfg: EngineConfig,
    lanes: Mutex<Vec<Lane>>,
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Engine {
            cfg,
            lanes: Mutex::new(Vec::new()),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Write every segment's memory to its file range.
    ///
    /// # Safety
    /// For the whole call, each segment's `[addr, addr+len)` must be readable
    /// memory of its kind (host, or device memory of that CUDA device) that
    /// nobody frees or writes to. Segments must not overlap in the file.
    pub unsafe fn write(&self, file: &IoFile, segments: &[Segment]) -> Result<Stats> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.transfer(file, segments, Dir::Write, None, false, &[]) }
    }

    /// [`Engine::write`], with device memory moved along `path`
    /// (cuFile or bounce; without one, bounce), and with `checksum` the
    /// CRC-32 of each segment in [`Stats::crc32`].
    ///
    /// # Safety
    /// As for [`Engine::write`].
    pub unsafe fn write_via(
        &self,
        file: &IoFile,
        segments: &[Segment],
        path: Option<&DevicePath>,
        checksum: bool,
    ) -> Result<Stats> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.transfer(file, segments, Dir::Write, path, checksum, &[]) }
    }

    /// [`Engine::write_via`] with checksums, each [`Patch`] storing a
    /// segment's CRC-32 at its file offset.
    ///
    /// # Safety
    /// As for [`Engine::write`].
    pub unsafe fn write_patched(
        &self,
        file: &IoFile,
        segments: &[Segment],
        patches: &[Patch],
        path: Option<&DevicePath>,
    ) -> Result<Stats> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.transfer(file, segments, Dir::Write, path, true, patches) }
    }

    /// [`Engine::read`], with device memory moved along `path`, and with
    /// `checksum` the CRC-32 of the bytes read for each segment.
    ///
    /// # Safety
    /// As for [`Engine::read`].
    pub unsafe fn read_via(
        &self,
        file: &IoFile,
        segments: &[Segment],
        path: Option<&DevicePath>,
        checksum: bool,
    ) -> Result<Stats> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.transfer(file, segments, Dir::Read, path, checksum, &[]) }
    }

    /// The CRC-32 of each file range `(offset, len)`, read in parallel chunks
    /// through the lanes' staging buffers (no destination memory needed).
    pub fn checksum(&self, file: &IoFile, ranges: &[(u64, u64)]) -> Result<Stats> {
        let segs: Vec<Segment> = ranges
            .iter()
            .map(|&(file_offset, len)| Segment {
                file_offset,
                addr: 0,
                len,
                memory: Memory::Host,
            })
            .collect();
        // SAFETY: Dir::Checksum never touches segment memory (addresses are 0).
        unsafe { self.transfer(file, &segs, Dir::Checksum, None, true, &[]) }
    }

    /// Read every segment's file range into its memory.
    ///
    /// # Safety
    /// For the whole call, each segment's `[addr, addr+len)` must be writable
    /// memory of its kind that nobody else reads, writes or frees, and the
    /// segments must not overlap each other in memory.
    pub unsafe fn read(&self, file: &IoFile, segments: &[Segment]) -> Result<Stats> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.read_via(file, segments, None, false) }
    }

    /// # Safety
    /// See [`Engine::write`] and [`Engine::read`].
    unsafe fn transfer(
        &self,
        file: &IoFile,
        segments: &[Segment],
        dir: Dir,
        path: Option<&DevicePath>,
        checksum: bool,
        patches: &[Patch],
    ) -> Result<Stats> {
        let plan = plan(segments, dir, self.cfg.chunk_for(file), patches)?;
        let bytes = segments.iter().map(|s| s.len).sum();
        let threads = self.cfg.threads_for(file).min(plan.chunks.len()).max(1);
        let has_device = dir != Dir::Checksum
            && segments
                .iter()
                .any(|s| s.len > 0 && s.memory != Memory::Host);
        let mut stats = Stats {
            bytes,
            chunks: plan.chunks.len(),
            threads,
            direct: file.is_direct(),
            device_path: has_device.then(|| path.map_or("bounce", DevicePath::name)),
            crc32: Vec::new(),
            late_patches: plan.late.len(),
        };
        if plan.chunks.is_empty() {
            if checksum {
                stats.crc32 = vec![Some(0); segments.len()];
            }
            return Ok(stats);
        }
        let mut lanes = self.take_lanes(threads, file)?;
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let first_error: Mutex<Option<Error>> = Mutex::new(None);
        let capacity = self.lane_capacity(file);
        // (piece index, its CRC-32): filled by the threads, combined below.
        let crcs: Mutex<Vec<(usize, Option<u32>)>> = Mutex::new(Vec::new());

        std::thread::scope(|s| {
            for lane in lanes.iter_mut() {
                let (plan, next, failed, first_error, crcs) =
                    (&plan, &next, &failed, &first_error, &crcs);
                s.spawn(move || {
                    let take = || {
                        if failed.load(Ordering::Relaxed) {
                            return None;
                        }
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        plan.chunks.get(i).map(|c| (i, c))
                    };
                    let mut mine = Vec::new();
                    let out = checksum.then_some(&mut mine);
                    // SAFETY: piece ranges lie inside the caller's segments
                    // (see `plan`), whose validity the caller guarantees.
                    let r = unsafe { lane.run(file, dir, path, capacity, plan, take, out) };
                    match r {
                        Ok(()) => crcs
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .append(&mut mine),
                        Err(e) => {
                            failed.store(true, Ordering::Relaxed);
                            let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                            slot.get_or_insert(e);
                        }
                    }
                });
            }
        });
        self.return_lanes(lanes);
        if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        if checksum {
            let per_piece = crcs.into_inner().unwrap_or_else(|p| p.into_inner());
            stats.crc32 = combine(segments.len(), &plan.pieces, per_piece);
            for p in &plan.late {
                if let Some(crc) = stats.crc32[p.seg] {
                    file.write_at(&crc.to_le_bytes(), p.at)?;
                }
            }
        }
        Ok(stats)
    }

    /// Bytes each staging or pinned buffer needs for this file: a chunk plus
    /// room to widen it to aligned bounds at both ends.
    fn lane_capacity(&self, file: &IoFile) -> usize {
        let a = file.alignment();
        self.cfg.chunk_for(file) + 2 * a.offset.max(a.memory).max(align::DEFAULT_ALIGN)
    }

    fn take_lanes(&self, n: usize, file: &IoFile) -> Result<Vec<Lane>> {
        let want = self.lane_capacity(file);
        let mut pool = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        let mut lanes = Vec::with_capacity(n);
        // Lanes too small for this file stay pooled (a file of the other kind,
        // disk or memory, may come next); return_lanes bounds the pool.
        let mut i = pool.len();
        while lanes.len() < n && i > 0 {
            i -= 1;
            let l = &pool[i];
            if l.staging.len() >= want && l.staging.align() >= file.alignment().memory {
                lanes.push(pool.swap_remove(i));
            }
        }
        drop(pool);
        while lanes.len() < n {
            let align = file.alignment().memory.max(align::DEFAULT_ALIGN);
            lanes.push(Lane {
                staging: AlignedBuf::new(want, align)?,
                bounce: Vec::new(),
            });
        }
        Ok(lanes)
    }

    fn return_lanes(&self, lanes: Vec<Lane>) {
        let mut pool = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        pool.extend(lanes);
        let keep = self.cfg.threads.max(self.cfg.memory_threads);
        if pool.len() > keep {
            // Keep the largest: they serve files of either kind.
            pool.sort_by_key(|l| std::cmp::Reverse(l.staging.len()));
            pool.truncate(keep);
        }
    }

    /// Host memory held by the lane pool (staging buffers), in bytes.
    pub fn pooled_bytes(&self) -> usize {
        let pool = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        pool.iter().map(|l| l.staging.len()).sum()
    }

    /// Pinned host memory held by the lanes' bounce buffers, in bytes: at most
    /// max(threads, memory_threads) x 2 x (the larger chunk size + alignment slack) per
    /// device, whatever the checkpoint size.
    pub fn pinned_bytes(&self) -> usize {
        let pool = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        pool.iter()
            .flat_map(|l| &l.bounce)
            .map(BounceLane::pinned_bytes)
            .sum()
    }
}

/// Check the segments, join them into runs and cut the runs into chunks on
/// the `chunk_size` grid of file offsets (see the module doc); place patches.
fn plan(segments: &[Segment], dir: Dir, chunk_size: usize, patches: &[Patch]) -> Result<Plan> {
    let cs = chunk_size as u64;
    for (i, s) in segments.iter().enumerate() {
        let end_file = s.file_offset.checked_add(s.len);
        let end_mem = s.addr.checked_add(s.len);
        if end_file.is_none() || end_mem.is_none() || end_file > Some(i64::MAX as u64) {
            return Err(Error::invalid(format!(
                "segment {i} (offset {}, length {}) overflows",
                s.file_offset, s.len
            )));
        }
        if s.len > 0 && s.addr == 0 && dir != Dir::Checksum {
            return Err(Error::invalid(format!("segment {i} has a null address")));
        }
    }
    let mut order: Vec<usize> = (0..segments.len())
        .filter(|&i| segments[i].len > 0)
        .collect();
    order.sort_by_key(|&i| (segments[i].file_offset, i));

    // Pieces tagged with (run, cell) so that a stable sort groups them into
    // chunks while keeping each segment's pieces in file order.
    let mut tagged: Vec<(u64, u64, Piece)> = Vec::with_capacity(order.len());
    let (mut run, mut run_end) = (0u64, None::<u64>);
    for &i in &order {
        let s = &segments[i];
        if let Some(end) = run_end {
            if dir == Dir::Write && s.file_offset < end {
                return Err(Error::invalid(format!(
                    "segment {i} (offset {}, length {}) overlaps another one written",
                    s.file_offset, s.len
                )));
            }
            let joins = match dir {
                Dir::Write => s.file_offset == end,
                Dir::Read | Dir::Checksum => s.file_offset <= end.saturating_add(READ_GAP),
            };
            if !joins {
                run += 1;
            }
        }
        let end = s.file_offset + s.len;
        run_end = Some(run_end.map_or(end, |e| e.max(end)));
        let mut off = s.file_offset;
        while off < end {
            let cell = off / cs;
            let stop = ((cell + 1) * cs).min(end);
            tagged.push((
                run,
                cell,
                Piece {
                    seg: i,
                    file_offset: off,
                    addr: s.addr + (off - s.file_offset),
                    len: (stop - off) as usize,
                    memory: s.memory,
                },
            ));
            off = stop;
        }
    }
    tagged.sort_by_key(|t| (t.0, t.1));

    let mut out = Plan {
        pieces: Vec::with_capacity(tagged.len()),
        ..Plan::default()
    };
    // The chunk being filled: (run, cell, first piece, start, end, device).
    let mut cur: Option<(u64, u64, usize, u64, u64, Option<i32>)> = None;
    let flush = |out: &mut Plan, c: (u64, u64, usize, u64, u64, Option<i32>)| {
        out.chunks.push(Chunk {
            file_offset: c.3,
            len: (c.4 - c.3) as usize,
            pieces: c.2..out.pieces.len(),
            patches: 0..0,
            device: c.5,
        });
    };
    for (run, cell, p) in tagged {
        let dev = match p.memory {
            Memory::Cuda(d) => Some(d),
            Memory::Host => None,
        };
        // One CUDA device per chunk: its copies run on that device's streams.
        let same = cur.is_some_and(|c| {
            (c.0, c.1) == (run, cell) && !(dev.is_some() && c.5.is_some() && dev != c.5)
        });
        if !same {
            if let Some(c) = cur.take() {
                flush(&mut out, c);
            }
            cur = Some((
                run,
                cell,
                out.pieces.len(),
                p.file_offset,
                p.file_offset,
                None,
            ));
        }
        if let Some(c) = cur.as_mut() {
            c.3 = c.3.min(p.file_offset);
            c.4 = c.4.max(p.file_offset + p.len as u64);
            c.5 = c.5.or(dev);
        }
        out.pieces.push(p);
    }
    if let Some(c) = cur {
        flush(&mut out, c);
    }
    place_patches(&mut out, segments, patches)?;
    Ok(out)
}

/// Put each patch in the gathered chunk that carries both its segment (whole)
/// and its 4 bytes, else on the list written after the data.
fn place_patches(out: &mut Plan, segments: &[Segment], patches: &[Patch]) -> Result<()> {
    if patches.is_empty() {
        return Ok(());
    }
    // segment -> (its piece, that piece's chunk), for segments moved in one piece.
    let mut only: Vec<Option<(usize, usize)>> = vec![None; segments.len()];
    let mut count = vec![0u32; segments.len()];
    for (c, chunk) in out.chunks.iter().enumerate() {
        for i in chunk.pieces.clone() {
            let s = out.pieces[i].seg;
            count[s] += 1;
            only[s] = Some((i, c));
        }
    }
    let mut placed: Vec<(usize, InChunk)> = Vec::new();
    for p in patches {
        let s = segments.get(p.seg).ok_or_else(|| {
            Error::invalid(format!("patch for segment {} of {}", p.seg, segments.len()))
        })?;
        let end =
            p.at.checked_add(4)
                .ok_or_else(|| Error::invalid(format!("patch at {} overflows", p.at)))?;
        if p.at < s.file_offset + s.len && end > s.file_offset {
            return Err(Error::invalid(format!(
                "patch at {} lies inside its own segment {}",
                p.at, p.seg
            )));
        }
        let inside = match only[p.seg] {
            Some((piece, c)) if count[p.seg] == 1 => {
                let ch = &out.chunks[c];
                let gathered = out.whole(ch).is_none();
                // A write's chunk is covered by its pieces end to end (runs
                // of touching segments), and the patch is outside its own.
                let covered = ch.file_offset <= p.at && end <= ch.file_offset + ch.len as u64;
                (gathered && covered).then(|| {
                    (
                        c,
                        InChunk {
                            rel: (p.at - ch.file_offset) as usize,
                            piece,
                        },
                    )
                })
            }
            _ => None,
        };
        match inside {
            Some(x) => placed.push(x),
            None => out.late.push(*p),
        }
    }
    placed.sort_by_key(|x| x.0);
    let mut j = 0;
    for (c, chunk) in out.chunks.iter_mut().enumerate() {
        let first = j;
        while j < placed.len() && placed[j].0 == c {
            j += 1;
        }
        chunk.patches = first..j;
    }
    out.patches = placed.into_iter().map(|x| x.1).collect();
    Ok(())
}

/// One CRC-32 per segment from the pieces' values (pieces of a segment are in
/// file order in `pieces`); None where any piece of the segment has none.
fn combine(
    segments: usize,
    pieces: &[Piece],
    per_piece: Vec<(usize, Option<u32>)>,
) -> Vec<Option<u32>> {
    let mut by_piece = vec![None; pieces.len()];
    for (i, crc) in per_piece {
        by_piece[i] = crc;
    }
    let mut out: Vec<Option<Hasher>> = (0..segments).map(|_| Some(Hasher::new())).collect();
    for (p, crc) in pieces.iter().zip(by_piece) {
        match (&mut out[p.seg], crc) {
            (Some(h), Some(v)) => h.combine(&Hasher::new_with_initial_len(v, p.len as u64)),
            (slot, None) => *slot = None,
            (None, Some(_)) => {}
        }
    }
    out.into_iter().map(|h| h.map(Hasher::finalize)).collect()
}

#[cfg(test)]
// Test buffers outlive every engine call that borrows their addresses.
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;
    use crate::io::file::DirectMode;
    use std::fs::OpenOptions;

    fn engine(threads: usize, chunk: usize) -> Engine {
        Engine::new(EngineConfig {
            threads,
            memory_threads: threads,
            chunk_size: chunk,
            memory_chunk_size: chunk,
            direct: DirectMode::Auto,
            preallocate: true,
        })
        .unwrap()
    }

    fn host(file_offset: u64, buf: &[u8]) -> Segment {
        Segment {
            file_offset,
            addr: buf.as_ptr() as u64,
            len: buf.len() as u64,
            memory: Memory::Host,
        }
    }

    fn open(path: &std::path::Path, mode: DirectMode) -> IoFile {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .unwrap();
        IoFile::from_writable(f, path, mode).unwrap()
    }

    #[test]
    fn parallel_roundtrip_many_shapes() {
        let d = tempfile::tempdir().unwrap();
        for mode in [DirectMode::Auto, DirectMode::Off] {
            let f = open(&d.path().join(format!("{mode:?}")), mode);
            // Odd sizes, odd offsets, a segment spanning many chunks, an empty one.
            let layout: &[(u64, usize)] = &[
                (4096, 300_000),
                (1_000_000, 5),
                (1_003_000, 4096),
                (2_000_001, 123_457),
                (3_000_000, 0),
            ];
            let data: Vec<Vec<u8>> = layout
                .iter()
                .enumerate()
                .map(|(k, &(_, n))| (0..n).map(|i| (i * 7 + k * 13) as u8).collect())
                .collect();
            // Misaligned source memory: slice one byte in.
            let shifted: Vec<Vec<u8>> = data.iter().map(|v| [&[0u8][..], v].concat()).collect();
            let segs: Vec<Segment> = layout
                .iter()
                .zip(&shifted)
                .map(|(&(o, _), v)| host(o, &v[1..]))
                .collect();
            let e = engine(4, 64 << 10);
            let st = unsafe { e.write(&f, &segs) }.unwrap();
            assert_eq!(st.bytes, data.iter().map(|v| v.len() as u64).sum::<u64>());
            assert!(st.chunks > 5);
            let mut back: Vec<Vec<u8>> = data.iter().map(|v| vec![0xAA; v.len()]).collect();
            let rsegs: Vec<Segment> = layout
                .iter()
                .zip(&back)
                .map(|(&(o, _), v)| host(o, v))
                .collect();
            unsafe { e.read(&f, &rsegs) }.unwrap();
            for v in back.iter_mut().zip(&data) {
                assert_eq!(v.0, v.1);
            }
            // Aligned destination memory takes the zero-copy path.
            let mut ab = AlignedBuf::new(300_000, 4096).unwrap();
            let seg = Segment {
                file_offset: 4096,
                addr: ab.as_mut_ptr() as u64,
                len: 300_000,
                memory: Memory::Host,
            };
            unsafe { e.read(&f, &[seg]) }.unwrap();
            assert_eq!(&ab.as_slice()[..300_000], &data[0][..]);
        }
    }

    #[test]
    fn reading_past_the_end_is_an_error_from_any_thread() {
        let d = tempfile::tempdir().unwrap();
        let f = open(&d.path().join("short"), DirectMode::Auto);
        let data = vec![1u8; 100_000];
        unsafe { engine(2, 4096).write(&f, &[host(0, &data)]) }.unwrap();
        let mut big = vec![0u8; 200_000];
        let seg = Segment {
            file_offset: 0,
            addr: big.as_mut_ptr() as u64,
            len: 200_000,
            memory: Memory::Host,
        };
        match unsafe { engine(4, 4096).read(&f, &[seg]) } {
            Err(Error::Format { .. }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn checksums_combine_over_chunks_threads_and_directions() {
        let d = tempfile::tempdir().unwrap();
        for mode in [DirectMode::Auto, DirectMode::Off] {
            let f = open(&d.path().join(format!("crc{mode:?}")), mode);
            let layout: &[(u64, usize)] = &[(4096, 300_001), (400_000, 0), (401_000, 4096 * 3 + 5)];
            let data: Vec<Vec<u8>> = layout
                .iter()
                .map(|&(o, n)| (0..n).map(|i| (i as u64 * 31 + o) as u8).collect())
                .collect();
            let want: Vec<Option<u32>> = data.iter().map(|v| Some(crc32fast::hash(v))).collect();
            let segs: Vec<Segment> = layout
                .iter()
                .zip(&data)
                .map(|(&(o, _), v)| host(o, v))
                .collect();
            let e = engine(3, 8192);
            let st = unsafe { e.write_via(&f, &segs, None, true) }.unwrap();
            assert_eq!(st.crc32, want);
            let mut back: Vec<Vec<u8>> = data.iter().map(|v| vec![0; v.len()]).collect();
            let rsegs: Vec<Segment> = layout
                .iter()
                .zip(back.iter_mut())
                .map(|(&(o, _), v)| Segment {
                    file_offset: o,
                    addr: v.as_mut_ptr() as u64,
                    len: v.len() as u64,
                    memory: Memory::Host,
                })
                .collect();
            let st = unsafe { e.read_via(&f, &rsegs, None, true) }.unwrap();
            assert_eq!(st.crc32, want);
            assert_eq!(back, data);
            let ranges: Vec<(u64, u64)> = layout.iter().map(|&(o, n)| (o, n as u64)).collect();
            assert_eq!(e.checksum(&f, &ranges).unwrap().crc32, want);
            // Without checksums nothing is computed.
            assert!(unsafe { e.write(&f, &segs) }.unwrap().crc32.is_empty());
        }
    }

    #[test]
    fn lanes_are_reused_and_bounded() {
        let d = tempfile::tempdir().unwrap();
        let f = open(&d.path().join("x"), DirectMode::Auto);
        let e = engine(3, 64 << 10);
        let data = vec![3u8; 1 << 20];
        for _ in 0..5 {
            unsafe { e.write(&f, &[host(1, &data)]) }.unwrap();
        }
        assert!(e.pooled_bytes() <= 3 * ((64 << 10) + 2 * 4096 + 4096));
    }

    /// 2 threads and `chunk` for disk files, 5 threads and `memory_chunk` for tmpfs.
    fn disk_and_memory_engine(chunk: usize, memory_chunk: usize) -> Engine {
        Engine::new(EngineConfig {
            threads: 2,
            memory_threads: 5,
            chunk_size: chunk,
            memory_chunk_size: memory_chunk,
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn lanes_too_small_for_a_file_stay_pooled() {
        // Memory files take small lanes, disk files large ones: a disk transfer
        // after a memory one keeps the small lanes (within the pool's bound,
        // largest first) instead of freeing them, for the next memory transfer.
        let shm = std::path::Path::new("/dev/shm");
        if !shm.is_dir() {
            return;
        }
        let e = disk_and_memory_engine(16384, 4096);
        let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let data = vec![5u8; 64 * 4096];
        let (small, large) = (4096 + 2 * 4096, 16384 + 2 * 4096);
        for (dir, pooled) in [
            (shm, 5 * small),
            (disk.path(), 2 * large + 3 * small),
            (shm, 2 * large + 3 * small),
        ] {
            let path = dir.join(format!("ckptio-lanes-{}", std::process::id()));
            let f = open(&path, DirectMode::Auto);
            unsafe { e.write(&f, &[host(0, &data)]) }.unwrap();
            drop(f);
            std::fs::remove_file(&path).unwrap();
            assert_eq!(e.pooled_bytes(), pooled, "{}", dir.display());
        }
    }

    #[test]
    fn config_validation_and_sizes() {
        assert_eq!(parse_size("16M").unwrap(), 16 << 20);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size(" 12 ").unwrap(), 12);
        assert!(parse_size("x").is_err());
        assert!(parse_size("3q").is_err());
        assert!(Engine::new(EngineConfig {
            threads: 0,
            ..Default::default()
        })
        .is_err());
        assert!(Engine::new(EngineConfig {
            chunk_size: 1000,
            ..Default::default()
        })
        .is_err());
        assert!(Engine::new(EngineConfig {
            memory_threads: 0,
            ..Default::default()
        })
        .is_err());
        let mut c = EngineConfig::default();
        assert!(c.memory_threads >= c.threads);
        c.set_threads(3);
        assert_eq!((c.threads, c.memory_threads), (3, 3));
    }

    #[test]
    fn files_in_memory_take_memory_threads_and_chunks() {
        let e = disk_and_memory_engine(4096, 8192);
        let data = vec![7u8; 64 * 4096];
        let shm = std::path::Path::new("/dev/shm");
        let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        for dir in [shm, disk.path()] {
            if !dir.is_dir() {
                continue;
            }
            let path = dir.join(format!("ckptio-threads-{}", std::process::id()));
            let f = open(&path, DirectMode::Auto);
            // SAFETY: `data` outlives the call.
            let st = unsafe { e.write(&f, &[host(0, &data)]) }.unwrap();
            let (threads, chunks) = if f.is_in_memory() { (5, 32) } else { (2, 64) };
            assert_eq!(
                (st.threads, st.chunks),
                (threads, chunks),
                "{}",
                dir.display()
            );
            drop(f);
            std::fs::remove_file(&path).unwrap();
        }
        assert!(e.pooled_bytes() <= 5 * (8192 + 2 * 4096));
    }

    /// A file image tiled by segments: headers (host bytes we own) between
    /// records (the "tensors"), each record's CRC-32 patched into the 4
    /// bytes after it, as a zip data descriptor holds it.
    struct Tiled {
        segs: Vec<Segment>,
        patches: Vec<Patch>,
        /// The bytes the file must hold.
        want: Vec<u8>,
        /// Index of each record's segment.
        records: Vec<usize>,
        _bufs: Vec<Vec<u8>>,
    }

    /// `sizes`: record sizes; each record is preceded by a header of
    /// `head` bytes (the first holds the previous record's CRC-32), the last
    /// followed by a tail header. Sources start `shift` bytes into their buffer.
    fn tiled(sizes: &[usize], head: usize, shift: usize) -> Tiled {
        let head = head.max(4);
        let mut bufs = Vec::new();
        let mut pos = 0u64;
        let mut t = Tiled {
            segs: Vec::new(),
            patches: Vec::new(),
            want: Vec::new(),
            records: Vec::new(),
            _bufs: Vec::new(),
        };
        let mut push = |t: &mut Tiled, bytes: Vec<u8>, pos: &mut u64| {
            let mut b = vec![0u8; shift];
            b.extend_from_slice(&bytes);
            t.segs.push(Segment {
                file_offset: *pos,
                addr: b[shift..].as_ptr() as u64,
                len: bytes.len() as u64,
                memory: Memory::Host,
            });
            t.want.extend_from_slice(&bytes);
            *pos += bytes.len() as u64;
            bufs.push(b);
        };
        for (k, &n) in sizes.iter().enumerate() {
            let hdr: Vec<u8> = (0..head).map(|i| (i * 3 + k) as u8 | 0x80).collect();
            if k > 0 {
                // The previous record's CRC-32 goes in this header's first 4 bytes.
                let prev = *t.records.last().unwrap();
                t.patches.push(Patch { seg: prev, at: pos });
            }
            push(&mut t, hdr, &mut pos);
            let rec: Vec<u8> = (0..n).map(|i| (i * 7 + k * 11) as u8).collect();
            t.records.push(t.segs.len());
            push(&mut t, rec, &mut pos);
        }
        if let Some(&last) = t.records.last() {
            t.patches.push(Patch { seg: last, at: pos });
        }
        push(&mut t, vec![0xEE; head], &mut pos);
        for p in &t.patches {
            let s = t.segs[p.seg];
            let at = s.file_offset as usize;
            let crc = crc32fast::hash(&t.want[at..at + s.len as usize]);
            t.want[p.at as usize..p.at as usize + 4].copy_from_slice(&crc.to_le_bytes());
        }
        t._bufs = bufs;
        t
    }

    #[test]
    fn many_small_segments_share_one_io_and_carry_their_crcs() {
        let d = tempfile::tempdir().unwrap();
        for mode in [DirectMode::Auto, DirectMode::Off] {
            let path = d.path().join(format!("small{mode:?}"));
            let f = open(&path, mode);
            // 2,000 records of 1..=700 bytes, 40-byte headers, misaligned sources.
            let sizes: Vec<usize> = (0..2000).map(|i| 1 + (i * 37) % 700).collect();
            let t = tiled(&sizes, 40, 3);
            let e = engine(3, 64 << 10);
            let st = unsafe { e.write_patched(&f, &t.segs, &t.patches, None) }.unwrap();
            let total = t.want.len();
            assert_eq!(
                st.chunks,
                total.div_ceil(64 << 10),
                "one I/O per chunk of the grid"
            );
            // Only records cut by a chunk boundary (or whose CRC slot is) are patched late.
            assert!(st.late_patches <= 2 * st.chunks, "{}", st.late_patches);
            for &r in &t.records {
                let s = t.segs[r];
                let at = s.file_offset as usize;
                assert_eq!(
                    st.crc32[r],
                    Some(crc32fast::hash(&t.want[at..at + s.len as usize]))
                );
            }
            assert_eq!(std::fs::read(&path).unwrap(), t.want);
            // Read the records back (not the headers): one I/O per chunk, gaps dropped.
            let mut back: Vec<Vec<u8>> = t
                .records
                .iter()
                .map(|&r| vec![0u8; t.segs[r].len as usize])
                .collect();
            let rsegs: Vec<Segment> = t
                .records
                .iter()
                .zip(back.iter_mut())
                .map(|(&r, b)| Segment {
                    file_offset: t.segs[r].file_offset,
                    addr: b.as_mut_ptr() as u64,
                    len: b.len() as u64,
                    memory: Memory::Host,
                })
                .collect();
            let st2 = unsafe { e.read_via(&f, &rsegs, None, true) }.unwrap();
            assert!(st2.chunks <= st.chunks, "{} > {}", st2.chunks, st.chunks);
            for ((&r, b), crc) in t.records.iter().zip(&back).zip(&st2.crc32) {
                let at = t.segs[r].file_offset as usize;
                assert_eq!(&t.want[at..at + b.len()], &b[..]);
                assert_eq!(*crc, Some(crc32fast::hash(b)));
            }
            let ranges: Vec<(u64, u64)> = rsegs.iter().map(|s| (s.file_offset, s.len)).collect();
            assert_eq!(e.checksum(&f, &ranges).unwrap().crc32, st2.crc32);
        }
    }

    #[test]
    fn reads_join_across_small_gaps_only() {
        let d = tempfile::tempdir().unwrap();
        let f = open(&d.path().join("gaps"), DirectMode::Auto);
        let data: Vec<u8> = (0..4 << 20).map(|i: usize| (i % 251) as u8).collect();
        let e = engine(2, 1 << 20);
        unsafe { e.write(&f, &[host(0, &data)]) }.unwrap();
        let read = |ranges: &[(u64, usize)]| {
            let mut bufs: Vec<Vec<u8>> = ranges.iter().map(|r| vec![0; r.1]).collect();
            let segs: Vec<Segment> = ranges
                .iter()
                .zip(bufs.iter_mut())
                .map(|(r, b)| Segment {
                    file_offset: r.0,
                    addr: b.as_mut_ptr() as u64,
                    len: r.1 as u64,
                    memory: Memory::Host,
                })
                .collect();
            let st = unsafe { e.read(&f, &segs) }.unwrap();
            for (r, b) in ranges.iter().zip(&bufs) {
                assert_eq!(&data[r.0 as usize..r.0 as usize + r.1], &b[..]);
            }
            st.chunks
        };
        // Small gaps: one I/O; a gap past READ_GAP: two; overlapping reads share one.
        assert_eq!(read(&[(10, 100), (200, 50), (5000, 7)]), 1);
        assert_eq!(read(&[(10, 100), (110 + READ_GAP + 1, 50)]), 2);
        assert_eq!(read(&[(1000, 3000), (1500, 100), (1000, 3000)]), 1);
        // Grid cells still bound an I/O: 3 MiB of 1 KiB records in 1 MiB cells.
        let small: Vec<(u64, usize)> = (0..3072).map(|i| (i * 1024, 1000)).collect();
        assert_eq!(read(&small), 3);
    }

    #[test]
    fn overlapping_writes_and_bad_patches_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let f = open(&d.path().join("bad"), DirectMode::Auto);
        let a = vec![1u8; 100];
        let e = engine(2, 4096);
        match unsafe { e.write(&f, &[host(0, &a), host(50, &a)]) } {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("overlaps"), "{m}"),
            other => panic!("{other:?}"),
        }
        let segs = [host(0, &a), host(100, &a)];
        for (p, needle) in [
            (Patch { seg: 0, at: 10 }, "inside its own segment"),
            (Patch { seg: 5, at: 10 }, "patch for segment 5"),
            (
                Patch {
                    seg: 0,
                    at: u64::MAX - 1,
                },
                "overflows",
            ),
        ] {
            match unsafe { e.write_patched(&f, &segs, &[p], None) } {
                Err(Error::InvalidArgument(m)) => assert!(m.contains(needle), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_failed_gathered_write_is_reported() {
        // A read-only descriptor: every gathered write fails; the error surfaces.
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("ro");
        std::fs::write(&path, b"").unwrap();
        let f = IoFile::open_read(&path, DirectMode::Off).unwrap();
        let t = tiled(&[10, 20, 30], 16, 0);
        match unsafe { engine(2, 4096).write_patched(&f, &t.segs, &t.patches, None) } {
            Err(Error::Io { op: "pwrite", .. }) => {}
            other => panic!("{other:?}"),
        }
    }

    mod prop {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

            /// Any tiling of records and headers, any grid, threads and source
            /// alignment: the file is exactly the image, every record's CRC-32
            /// is right and stored where asked, and reads of any subset of the
            /// records (gathered across gaps) return their bytes and CRC-32s.
            #[test]
            fn coalesced_writes_and_reads_round_trip(
                sizes in proptest::collection::vec(
                    prop_oneof![0usize..64, 64usize..5000, 5000usize..70_000], 1..120),
                head in 4usize..200,
                shift in 0usize..9,
                chunk_pages in 1usize..24,
                threads in 1usize..5,
                direct in any::<bool>(),
                pick in proptest::collection::vec(any::<bool>(), 120),
            ) {
                let d = tempfile::tempdir().unwrap();
                let path = d.path().join("p");
                let mode = if direct { DirectMode::Auto } else { DirectMode::Off };
                let f = open(&path, mode);
                let t = tiled(&sizes, head, shift);
                let e = engine(threads, chunk_pages * 4096);
                let st = unsafe { e.write_patched(&f, &t.segs, &t.patches, None) }.unwrap();
                prop_assert_eq!(std::fs::read(&path).unwrap(), t.want.clone());
                for &r in &t.records {
                    let s = t.segs[r];
                    let at = s.file_offset as usize;
                    prop_assert_eq!(
                        st.crc32[r],
                        Some(crc32fast::hash(&t.want[at..at + s.len as usize]))
                    );
                }
                let chosen: Vec<usize> = t
                    .records
                    .iter()
                    .zip(&pick)
                    .filter(|(_, &p)| p)
                    .map(|(&r, _)| r)
                    .collect();
                let mut back: Vec<Vec<u8>> =
                    chosen.iter().map(|&r| vec![0u8; t.segs[r].len as usize + shift]).collect();
                let rsegs: Vec<Segment> = chosen
                    .iter()
                    .zip(back.iter_mut())
                    .map(|(&r, b)| Segment {
                        file_offset: t.segs[r].file_offset,
                        addr: b[shift..].as_mut_ptr() as u64,
                        len: t.segs[r].len,
                        memory: Memory::Host,
                    })
                    .collect();
                let st2 = unsafe { e.read_via(&f, &rsegs, None, true) }.unwrap();
                for ((&r, b), crc) in chosen.iter().zip(&back).zip(&st2.crc32) {
                    let s = t.segs[r];
                    let at = s.file_offset as usize;
                    let want = &t.want[at..at + s.len as usize];
                    prop_assert_eq!(&b[shift..], want);
                    prop_assert_eq!(*crc, Some(crc32fast::hash(want)));
                }
            }
        }
    }
}
