//! The engine: moves segments (memory range <-> file range) in parallel chunks.
//!
//! A transfer is a list of [`Segment`]s. The engine sorts them by file offset,
//! joins neighbouring segments under [`GATHER_BELOW`] bytes into runs (those
//! that touch, for writes; those less than [`READ_GAP`] apart, for reads; a
//! larger segment is a run of its own) and cuts each run into chunks on a grid
//! of `chunk_size` in file offsets, so every chunk but a run's first and last
//! starts and ends aligned. A chunk holds one piece of one segment (a large
//! tensor: moved straight between its memory and the file where alignment
//! allows) or pieces of many (small tensors and the headers between them:
//! gathered into, or scattered from, the thread's aligned staging buffer or
//! bounce slot, so one I/O serves them all). A pool of I/O threads takes
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
//! Device memory is touched only after the work the caller queued on its CUDA
//! streams before the call ([`crate::gpu::order`]), and is ready for any stream
//! when the call returns.
//!
//! Threads write neighbouring ranges at the same time, so no page is ever
//! written by two paths at once: host and bounce writes split on whole pages
//! ([`IoFile::write_unit`]), and under cuFile, whose unaligned writes
//! read-modify-write whole blocks, the chunks that share a page take turns on it.
//!
//! Each thread works in a [`Lane`]: its aligned staging buffer (for O_DIRECT
//! from memory that is not aligned) and its bounce buffers. Lanes are kept
//! between calls, so a steady stream of saves allocates nothing, and given
//! back on request, after a while idle, or when the pinned-memory cap is full
//! (see [`pool`]).
//!
//! Reads first choose, per file, between the memory path and the disk path
//! ([`memory`]): a file whose bytes are in memory is copied from its page cache.

mod config;
mod file;
mod lane;
mod memory;
mod owned;
mod pool;

use std::collections::HashSet;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crc32fast::Hasher;

use crate::gpu::order::After;
use crate::gpu::DevicePath;
pub use crate::gpu::Memory;
use crate::io::align;
use crate::io::file::IoFile;
use crate::workers::Caller;
use crate::{Error, Result};

pub use config::{default_memory_threads, parse_size, threads_from_env, EngineConfig};
pub use config::{
    DEFAULT_CHUNK_SIZE, DEFAULT_IDLE_RELEASE, DEFAULT_MEMORY_CHUNK_SIZE, DEFAULT_THREADS,
};
pub use file::{PathState, Report, Request, TransferFile};
pub(crate) use lane::Lane;
pub use memory::{MemoryPath, ReadPath, RESIDENT_MIN};
pub use owned::{Extent, Owned};
pub use pool::release_buffers;

/// Segments of a read this close in the file share one I/O: the bytes between
/// them (zip headers, records nobody asked for) are read and dropped, which
/// costs less than a request of its own (on a virtio disk a request costs
/// about what 100-200 KiB take to stream).
pub const READ_GAP: u64 = 128 << 10;

/// Segments of at least this many bytes are moved in I/Os of their own, in
/// place (no staging copy where alignment allows); smaller ones share I/Os
/// with their neighbours. A copy through staging costs about what an I/O
/// request costs at ~1 MiB; on the 2-core development machine, 64 storages of
/// 16 MiB gathered with their neighbours loaded at 0.54x torch.load, at
/// ~1.0x moved in place (benches/bench_tensors.py).
pub const GATHER_BELOW: u64 = 1 << 20;

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
    /// Reads: from memory or from the disk, and why.
    pub read_path: Option<ReadPath>,
}

/// How one transfer runs, besides its segments.
#[derive(Clone, Copy, Default)]
pub struct Options<'a> {
    /// How device memory moves: cuFile or bounce (None: bounce).
    pub path: Option<&'a DevicePath>,
    /// Compute the CRC-32 of each segment ([`Stats::crc32`]).
    pub checksum: bool,
    /// The caller's CUDA stream per device, `(device, raw CUstream)`: device
    /// memory is touched only after the work queued there before the call. A
    /// device not listed is ordered after its legacy default stream (0).
    pub streams: &'a [(i32, u64)],
    /// Writes: segments' CRC-32s to store in the file (computed, as with
    /// `checksum`, whether asked for or not).
    pub patches: &'a [Patch],
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
    /// Pages (in write units) this chunk shares with another chunk and must
    /// hold while it writes (only under cuFile; see [`PageLocks`]).
    shared: [Option<u64>; 2],
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
    pool: Arc<pool::Pool>,
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Result<Self> {
        cfg.validate()?;
        let pool = pool::Pool::new(cfg.threads.max(cfg.memory_threads), cfg.idle_release);
        Ok(Engine { cfg, pool })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Write every segment's memory to its file range.
    ///
    /// # Safety
    /// For the whole call, each segment's `[addr, addr+len)` must be readable
    /// memory of its kind (host, or device memory of that CUDA device) that
    /// nobody frees, and that nobody writes except work queued before the call
    /// on the streams of `opts` (for [`Engine::write_with`]).
    pub unsafe fn write(&self, file: &IoFile, segments: &[Segment]) -> Result<Stats> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.transfer(file, segments, Dir::Write, Options::default()) }
    }

    /// [`Engine::write`] with options: device memory moved along `opts.path`
    /// (cuFile or bounce; without one, bounce) after the work queued on
    /// `opts.streams`, and with `opts.checksum` the CRC-32 of each segment in
    /// [`Stats::crc32`].
    ///
    /// # Safety
    /// As for [`Engine::write`]; every stream in `opts.streams` must be a live
    /// CUstream of its device's primary context (or 0).
    pub unsafe fn write_with(
        &self,
        file: &IoFile,
        segments: &[Segment],
        opts: Options<'_>,
    ) -> Result<Stats> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.transfer(file, segments, Dir::Write, opts) }
    }

    /// Read every segment's file range into its memory.
    ///
    /// # Safety
    /// For the whole call, each segment's `[addr, addr+len)` must be writable
    /// memory of its kind that nobody else frees, and that nobody reads or
    /// writes except work queued before the call on the streams of `opts` (for
    /// [`Engine::read_with`]. Segments that overlap each other in memory are
    /// refused (an `InvalidArgument` error before any byte moves).
    pub unsafe fn read(&self, file: &IoFile, segments: &[Segment]) -> Result<Stats> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.transfer(file, segments, Dir::Read, Options::default()) }
    }

    /// [`Engine::read`] with options (see [`Engine::write_with`]); with
    /// `opts.checksum` the CRC-32 of the bytes read for each segment.
    ///
    /// # Safety
    /// As for [`Engine::read`] and [`Engine::write_with`].
    pub unsafe fn read_with(
        &self,
        file: &IoFile,
        segments: &[Segment],
        opts: Options<'_>,
    ) -> Result<Stats> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.transfer(file, segments, Dir::Read, opts) }
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
        let opts = Options {
            checksum: true,
            ..Options::default()
        };
        // SAFETY: Dir::Checksum never touches segment memory (addresses are 0).
        unsafe { self.transfer(file, &segs, Dir::Checksum, opts) }
    }

    /// # Safety
    /// See [`Engine::write_with`] and [`Engine::read_with`].
    unsafe fn transfer(
        &self,
        file: &IoFile,
        segments: &[Segment],
        dir: Dir,
        opts: Options<'_>,
    ) -> Result<Stats> {
        // Reads: the memory path reads a view of the file (through a mapping of
        // its page cache), device memory through the bounce lanes.
        let choice = match dir {
            Dir::Write => None,
            Dir::Read | Dir::Checksum => {
                Some(memory::choose(file, segments, self.cfg.memory_path)?)
            }
        };
        let mut opts = opts;
        let file = match choice.as_ref().and_then(|c| c.view.as_ref()) {
            Some(view) => {
                opts.path = opts.path.filter(|p| p.is_requested());
                view
            }
            None => file,
        };
        let mut devices: Vec<i32> = Vec::new();
        if dir != Dir::Checksum {
            for s in segments.iter().filter(|s| s.len > 0) {
                if let Memory::Cuda(d) = s.memory {
                    if !devices.contains(&d) {
                        devices.push(d);
                    }
                }
            }
        }
        let cufile = matches!(opts.path, Some(DevicePath::CuFile { .. })) && !devices.is_empty();
        let serialize = dir == Dir::Write && cufile;
        let plan = plan(
            segments,
            dir,
            self.cfg.chunk_for(file),
            opts.patches,
            serialize.then(|| file.write_unit()),
        )?;
        let checksum = opts.checksum || !opts.patches.is_empty();
        let bytes = segments.iter().map(|s| s.len).sum();
        let threads = self.cfg.threads_for(file).min(plan.chunks.len()).max(1);
        let mut stats = Stats {
            bytes,
            chunks: plan.chunks.len(),
            threads,
            direct: file.is_direct(),
            device_path: (!devices.is_empty())
                .then(|| opts.path.map_or("bounce", DevicePath::name)),
            crc32: Vec::new(),
            late_patches: plan.late.len(),
            read_path: choice.as_ref().map(|c| c.path.clone()),
        };
        if plan.chunks.is_empty() {
            if checksum {
                stats.crc32 = vec![Some(0); segments.len()];
            }
            return Ok(stats);
        }
        let after = if devices.is_empty() {
            After::none()
        } else {
            // SAFETY: the caller vouches for the streams (contract of write_with).
            unsafe { After::record(&devices, opts.streams)? }
        };
        if cufile {
            // cuFile follows no stream: the host waits for the caller's work.
            after.wait_on_host()?;
        }
        let lanes = self.pool.take(
            threads,
            self.lane_capacity(file),
            file.alignment().memory.max(align::DEFAULT_ALIGN),
        )?;
        let next = AtomicUsize::new(0);
        let first_error = crate::sync::FirstError::default();
        let locks = PageLocks::default();
        let ctx = lane::Ctx {
            file,
            dir,
            path: opts.path,
            after: &after,
            locks: &locks,
            capacity: self.lane_capacity(file),
            plan: &plan,
        };
        // (piece index, its CRC-32): filled by the threads, combined below.
        let crcs: Mutex<Vec<(usize, Option<u32>)>> = Mutex::new(Vec::new());

        // One task per lane on the process's worker threads; a transfer of
        // host memory only also runs a lane on the calling thread, while one of
        // device memory leaves the caller's CUDA context alone.
        let lanes: Vec<Mutex<Lane>> = lanes.into_iter().map(Mutex::new).collect();
        let caller = if devices.is_empty() {
            Caller::Helps
        } else {
            Caller::Waits
        };
        crate::workers::run(lanes.len(), caller, |t| {
            let mut lane = crate::sync::lock(&lanes[t]);
            let take = || {
                if first_error.failed() {
                    return None;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                plan.chunks.get(i).map(|c| (i, c))
            };
            let mut mine = Vec::new();
            let out = checksum.then_some(&mut mine);
            // SAFETY: piece ranges lie inside the caller's segments (see
            // `plan`), whose validity the caller guarantees.
            let r = unsafe { lane.run(&ctx, take, out) };
            match r {
                Ok(()) => crate::sync::lock(&crcs).append(&mut mine),
                Err(e) => first_error.set(e),
            }
        });
        let lanes = lanes.into_iter().map(crate::sync::into_inner).collect();
        self.pool.give_back(lanes);
        if let Some(e) = first_error.into_inner() {
            // Errors of layers that do not know the file (cuFile's) name it here.
            return Err(e.with_path(file.path()));
        }
        if checksum {
            let per_piece = crate::sync::into_inner(crcs);
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
    /// room to widen it to whole write units at both ends.
    fn lane_capacity(&self, file: &IoFile) -> usize {
        self.cfg.chunk_for(file) + 2 * file.write_unit().max(align::DEFAULT_ALIGN as u64) as usize
    }

    /// Give back the host memory of the lanes not in use (staging and pinned
    /// bounce buffers); the engine stays usable and allocates again on need.
    /// Returns the bytes given back.
    pub fn release_buffers(&self) -> usize {
        self.pool.release()
    }

    /// Give back every idle buffer now and keep none from now on: each
    /// transfer allocates its buffers and frees them when it ends (the engine
    /// stays usable). Returns the bytes given back.
    pub fn close(&self) -> usize {
        self.pool.close()
    }

    /// Host memory held by the lane pool (staging buffers), in bytes.
    pub fn pooled_bytes(&self) -> usize {
        self.pool.pooled_bytes()
    }

    /// Pinned host memory held by the idle lanes' bounce buffers, in bytes: at
    /// most max(threads, memory_threads) x 2 x (the larger chunk size + alignment
    /// slack) per device, whatever the checkpoint size.
    pub fn pinned_bytes(&self) -> usize {
        self.pool.pinned_bytes()
    }
}

/// Check the segments, join them into runs and cut the runs into chunks on
/// the `chunk_size` grid of file offsets (see the module doc); place patches.
/// Written segments must not overlap in the file, read ones not in memory (two
/// threads would fill the same bytes). With `serialize` (the page
/// size in bytes: cuFile writes), each chunk lists the pages it shares with a
/// neighbouring chunk.
fn plan(
    segments: &[Segment],
    dir: Dir,
    chunk_size: usize,
    patches: &[Patch],
    serialize: Option<u64>,
) -> Result<Plan> {
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
    if dir == Dir::Read {
        disjoint_in_memory(segments, &mut order)?;
    }
    order.sort_by_key(|&i| (segments[i].file_offset, i));

    // Pieces tagged with (run, cell) so that a stable sort groups them into
    // chunks while keeping each segment's pieces in file order.
    let mut tagged: Vec<(u64, u64, Piece)> = Vec::with_capacity(order.len());
    let (mut run, mut run_end, mut alone) = (0u64, None::<u64>, false);
    for &i in &order {
        let s = &segments[i];
        let was_alone = std::mem::replace(&mut alone, s.len >= GATHER_BELOW);
        if let Some(end) = run_end {
            if dir == Dir::Write && s.file_offset < end {
                return Err(Error::invalid(format!(
                    "segment {i} (offset {}, length {}) overlaps another one written",
                    s.file_offset, s.len
                )));
            }
            let joins = !alone
                && !was_alone
                && match dir {
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
            shared: [None, None],
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
    if let Some(unit) = serialize {
        share_pages(&mut out.chunks, unit);
    }
    place_patches(&mut out, segments, patches)?;
    Ok(out)
}

/// Refuse read segments (`order`: the non-empty ones) that overlap in memory;
/// `order` is left sorted by memory.
fn disjoint_in_memory(segments: &[Segment], order: &mut [usize]) -> Result<()> {
    let mem = |i: usize| {
        let s = &segments[i];
        let dev = match s.memory {
            Memory::Host => -1,
            Memory::Cuda(d) => i64::from(d),
        };
        (dev, s.addr)
    };
    order.sort_unstable_by_key(|&i| mem(i));
    // The segment reaching furthest so far, on the current memory.
    let mut reach: Option<(i64, u64, usize)> = None;
    for &i in order.iter() {
        let (dev, addr) = mem(i);
        let end = addr + segments[i].len; // checked above: no overflow
        if let Some((d, far, j)) = reach.filter(|r| r.0 == dev) {
            if addr < far {
                return Err(Error::invalid(format!(
                    "segment {i} ({} bytes at {addr:#x}) overlaps segment {j} in {}: \
                     two reads cannot fill the same memory",
                    segments[i].len,
                    owned::describe(segments[i].memory)
                )));
            }
            if end > far {
                reach = Some((d, end, i));
            }
        } else {
            reach = Some((dev, end, i));
        }
    }
    Ok(())
}

/// Mark the pages (of `unit` bytes) that neighbouring chunks (in file order,
/// as `plan` makes them) share: each chunk holds them while it writes.
fn share_pages(chunks: &mut [Chunk], unit: u64) {
    let mut shared = HashSet::new();
    for w in chunks.windows(2) {
        let a_end = w[0].file_offset + w[0].len as u64;
        if a_end > 0 && (a_end - 1) / unit == w[1].file_offset / unit {
            shared.insert(w[1].file_offset / unit);
        }
    }
    let page = |off: u64| Some(off / unit).filter(|p| shared.contains(p));
    for c in chunks {
        let end = c.file_offset + c.len as u64;
        c.shared = [page(c.file_offset), page(end - 1)];
    }
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

/// Pages that neighbouring chunks share, held by one chunk at a time.
#[derive(Default)]
pub(crate) struct PageLocks {
    held: Mutex<HashSet<u64>>,
    freed: Condvar,
}

/// A chunk's hold on its shared pages, released when dropped.
pub(crate) struct PageGuard<'a> {
    locks: &'a PageLocks,
    pages: [Option<u64>; 2],
}

impl PageLocks {
    /// Wait until none of `pages` is held, then hold them all (all at once:
    /// a thread never waits while holding one).
    pub(crate) fn hold(&self, pages: [Option<u64>; 2]) -> PageGuard<'_> {
        if pages != [None, None] {
            let mut held = crate::sync::lock(&self.held);
            while pages.iter().flatten().any(|p| held.contains(p)) {
                held = crate::sync::wait(&self.freed, held);
            }
            held.extend(pages.iter().flatten());
        }
        PageGuard { locks: self, pages }
    }
}

impl Drop for PageGuard<'_> {
    fn drop(&mut self) {
        if self.pages == [None, None] {
            return;
        }
        let mut held = crate::sync::lock(&self.locks.held);
        for p in self.pages.iter().flatten() {
            held.remove(p);
        }
        drop(held);
        self.locks.freed.notify_all();
    }
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
#[cfg(test)]
// Test buffers outlive every engine call that borrows their addresses.
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;
    use crate::io::align::AlignedBuf;
    use crate::io::file::DirectMode;

    fn engine(threads: usize, chunk: usize) -> Engine {
        Engine::new(EngineConfig {
            threads,
            memory_threads: threads,
            chunk_size: chunk,
            memory_chunk_size: chunk,
            direct: DirectMode::Auto,
            preallocate: true,
            memory_path: MemoryPath::Map,
            idle_release: None,
        })
        .unwrap()
    }

    /// Held by tests that count a pool's bytes exactly and by the one that calls
    /// the process-wide [`release_buffers`], which empties every engine's pool.
    static EXACT_POOLS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn crc() -> Options<'static> {
        Options {
            checksum: true,
            ..Options::default()
        }
    }

    fn host(file_offset: u64, buf: &[u8]) -> Segment {
        Segment {
            file_offset,
            addr: buf.as_ptr() as u64,
            len: buf.len() as u64,
            memory: Memory::Host,
        }
    }

    use crate::io::file::scratch as open;

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
    fn misaligned_reads_go_through_staging_piece_by_piece() {
        let d = tempfile::tempdir().unwrap();
        let f = open(&d.path().join("pieces"), DirectMode::Auto);
        let n = 2 * lane::STAGED_PIECE + 12_345;
        let data: Vec<u8> = (0..n).map(|i| (i * 31 + i / 4099) as u8).collect();
        let e = engine(2, 16 << 20);
        unsafe { e.write(&f, &[host(8192, &data)]) }.unwrap();
        // One byte past an aligned buffer: no O_DIRECT straight into it.
        let mut back = AlignedBuf::new(n + 1, 4096).unwrap();
        let seg = Segment {
            file_offset: 8192,
            addr: back.as_mut_ptr() as u64 + 1,
            len: n as u64,
            memory: Memory::Host,
        };
        unsafe { e.read(&f, &[seg]) }.unwrap();
        assert_eq!(&back.as_slice()[1..n + 1], &data[..]);
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
            let st = unsafe { e.write_with(&f, &segs, crc()) }.unwrap();
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
            let st = unsafe { e.read_with(&f, &rsegs, crc()) }.unwrap();
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
        let _exact = crate::sync::lock(&EXACT_POOLS);
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

    /// Segments packed back to back at odd offsets (as in a safetensors file),
    /// half from memory O_DIRECT can take as is, half from memory it cannot.
    fn packed(sizes: &[usize], seed: u8) -> (Vec<Vec<u8>>, Vec<u64>) {
        let mut offsets = Vec::new();
        let mut at = 100u64;
        let data = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                offsets.push(at);
                at += n as u64;
                (0..n)
                    .map(|i| (i as u8).wrapping_mul(31) ^ (k as u8) ^ seed)
                    .collect()
            })
            .collect();
        (data, offsets)
    }

    #[test]
    fn no_page_is_written_buffered_and_direct_at_once() {
        // A drive with 512-byte O_DIRECT blocks (faked): one segment's buffered
        // tail and the next one's direct middle would share a 4 KiB page.
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let mut f = open(&d.path().join("packed"), DirectMode::Auto);
        if !f.is_direct() {
            eprintln!("no O_DIRECT here: skipped");
            return;
        }
        f.fake_alignment(align::DioAlign {
            offset: 512,
            memory: 512,
        });
        let page = align::page_size();
        assert_eq!(f.write_unit(), page.max(512));
        let sizes = [
            5000,
            700,
            9000,
            4096,
            3000,
            12_345,
            1,
            8192 + 513,
            2000,
            30_000,
        ];
        let e = engine(4, 8192);
        for round in 0..40u8 {
            let (data, offsets) = packed(&sizes, round);
            // Every other segment from memory one byte off its alignment.
            let shifted: Vec<Vec<u8>> = data.iter().map(|v| [&[0u8][..], v].concat()).collect();
            let mut aligned: Vec<AlignedBuf> = Vec::new();
            let segs: Vec<Segment> = (0..data.len())
                .map(|k| {
                    if k % 2 == 0 {
                        host(offsets[k], &shifted[k][1..])
                    } else {
                        let mut b = AlignedBuf::new(data[k].len(), 4096).unwrap();
                        b.as_mut_slice()[..data[k].len()].copy_from_slice(&data[k]);
                        let seg = Segment {
                            file_offset: offsets[k],
                            addr: b.as_ptr() as u64,
                            len: data[k].len() as u64,
                            memory: Memory::Host,
                        };
                        aligned.push(b);
                        seg
                    }
                })
                .collect();
            unsafe { e.write(&f, &segs) }.unwrap();
            let trace = f.take_trace();
            assert!(trace.iter().any(|t| t.0), "nothing went through O_DIRECT");
            let mut direct = HashSet::new();
            let mut buffered = HashSet::new();
            for &(is_direct, off, len) in &trace {
                let pages = (off / page)..=((off + len as u64 - 1) / page);
                if is_direct {
                    direct.extend(pages);
                } else {
                    buffered.extend(pages);
                }
            }
            let both: Vec<_> = direct.intersection(&buffered).collect();
            assert!(
                both.is_empty(),
                "round {round}: pages {both:?} written both ways"
            );
            // Direct writes cover whole pages.
            for &(_, off, len) in trace.iter().filter(|t| t.0) {
                assert!(align::is_aligned(off, page) && align::is_aligned(len as u64, page));
            }
            // And the bytes: every page as written, byte for byte.
            let mut back: Vec<Vec<u8>> = data.iter().map(|v| vec![0xEE; v.len()]).collect();
            let rsegs: Vec<Segment> = offsets
                .iter()
                .zip(back.iter_mut())
                .map(|(&o, v)| Segment {
                    file_offset: o,
                    addr: v.as_mut_ptr() as u64,
                    len: v.len() as u64,
                    memory: Memory::Host,
                })
                .collect();
            unsafe { e.read(&f, &rsegs) }.unwrap();
            assert!(back == data, "round {round}: bytes differ");
        }
    }

    #[test]
    fn written_segments_must_not_overlap_and_shared_pages_are_found() {
        let buf = vec![0u8; 10_000];
        let seg = |off: u64, len: usize| Segment {
            file_offset: off,
            addr: buf.as_ptr() as u64,
            len: len as u64,
            memory: Memory::Host,
        };
        // Overlapping writes are refused before any byte moves.
        let err = plan(&[seg(0, 5000), seg(4000, 100)], Dir::Write, 8192, &[], None).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        // Reads may overlap in the file (one range into two memories)...
        let apart = Segment {
            addr: buf.as_ptr() as u64 + 5000,
            ..seg(4000, 100)
        };
        plan(&[seg(0, 5000), apart], Dir::Read, 8192, &[], None).unwrap();
        // ... but not in memory: two threads would fill the same bytes. On
        // another memory the same addresses are apart; empty segments never overlap.
        for (a, b, ok) in [
            (seg(0, 5000), seg(6000, 100), false),
            (seg(0, 100), seg(9000, 100), false),
            (
                seg(0, 100),
                Segment {
                    memory: Memory::Cuda(0),
                    ..seg(100, 100)
                },
                true,
            ),
            (seg(0, 100), seg(100, 0), true),
        ] {
            match plan(&[a, b], Dir::Read, 8192, &[], None) {
                Ok(_) => assert!(ok),
                Err(Error::InvalidArgument(m)) => {
                    assert!(
                        !ok && m.contains("overlaps segment 0 in host memory"),
                        "{m}"
                    )
                }
                Err(e) => panic!("{e}"),
            }
        }
        // Touching in memory is fine; a segment nested in an earlier long one is not.
        let at = |off: u64, mem: u64, len: usize| Segment {
            addr: buf.as_ptr() as u64 + mem,
            ..seg(off, len)
        };
        plan(&[at(0, 0, 10), at(20, 10, 10)], Dir::Read, 8192, &[], None).unwrap();
        let err = plan(
            &[at(0, 0, 1000), at(2000, 1000, 5), at(3000, 500, 5)],
            Dir::Read,
            8192,
            &[],
            None,
        )
        .unwrap_err();
        assert!(err.to_string().contains("segment 2"), "{err}");
        // Under cuFile, the pages neighbouring chunks share are held by both
        // (chunks of 8 KiB on the grid, pages of 4 KiB): touching segments are
        // one run cut on the grid (no page shared), a run that ends in the page
        // where the next one starts shares it.
        let segs = [
            seg(0, 5000),
            seg(5000, 4000),
            seg(9000, 100),
            seg(9100, 9000),
            seg(18_200, 10),
            seg(20_480, 10),
        ];
        let p = plan(&segs, Dir::Write, 8192, &[], Some(4096)).unwrap();
        let shared: Vec<(u64, [Option<u64>; 2])> =
            p.chunks.iter().map(|c| (c.file_offset, c.shared)).collect();
        assert_eq!(
            shared,
            [
                (0, [None, None]),
                (8192, [None, None]),
                (16_384, [Some(4), Some(4)]),
                (18_200, [Some(4), Some(4)]),
                (20_480, [None, None]),
            ]
        );
        // Without cuFile nothing is held.
        let p = plan(&segs, Dir::Write, 8192, &[], None).unwrap();
        assert!(p.chunks.iter().all(|c| c.shared == [None, None]));
    }

    #[test]
    fn shared_pages_are_held_by_one_chunk_at_a_time() {
        let locks = std::sync::Arc::new(PageLocks::default());
        let inside = std::sync::Arc::new(AtomicUsize::new(0));
        let worst = std::sync::Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (locks, inside, worst) = (locks.clone(), inside.clone(), worst.clone());
                std::thread::spawn(move || {
                    for i in 0..200u64 {
                        // Every thread wants page 7, with another page of its own.
                        let pages = if t % 2 == 0 {
                            [Some(7), Some(100 + i)]
                        } else {
                            [Some(200 + i), Some(7)]
                        };
                        let _g = locks.hold(pages);
                        let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        worst.fetch_max(n, Ordering::SeqCst);
                        std::thread::yield_now();
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(worst.load(Ordering::SeqCst), 1);
        assert!(locks.held.lock().unwrap().is_empty());
        // A chunk that shares nothing takes no lock at all.
        let _a = locks.hold([None, None]);
        let _b = locks.hold([None, None]);
    }

    #[test]
    fn buffers_go_back_on_request_on_close_and_when_idle() {
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let f = open(&d.path().join("idle"), DirectMode::Auto);
        let data = vec![9u8; 256 << 10];
        let write = |e: &Engine| unsafe { e.write(&f, &[host(0, &data)]) }.unwrap();
        // On request: this engine, then every engine at once.
        let _exact = crate::sync::lock(&EXACT_POOLS);
        let (a, b) = (engine(3, 64 << 10), engine(2, 64 << 10));
        write(&a);
        write(&b);
        assert!(a.pooled_bytes() > 0 && b.pooled_bytes() > 0);
        let held = a.pooled_bytes();
        assert_eq!(a.release_buffers(), held);
        assert_eq!(a.pooled_bytes(), 0);
        write(&a);
        assert!(release_buffers() >= a.pooled_bytes() + b.pooled_bytes());
        assert_eq!((a.pooled_bytes(), b.pooled_bytes()), (0, 0));
        // Closed: usable, but keeps nothing between transfers.
        write(&a);
        a.close();
        write(&a);
        assert_eq!(a.pooled_bytes(), 0);
        // Idle: the reaper frees lanes idle longer than idle_release.
        let idle = Engine::new(EngineConfig {
            threads: 2,
            memory_threads: 2,
            chunk_size: 64 << 10,
            memory_chunk_size: 64 << 10,
            idle_release: Some(std::time::Duration::from_millis(50)),
            ..Default::default()
        })
        .unwrap();
        write(&idle);
        let start = std::time::Instant::now();
        while idle.pooled_bytes() > 0 && start.elapsed() < std::time::Duration::from_secs(30) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(idle.pooled_bytes(), 0, "idle lanes were never given back");
        // Zero: nothing is kept after a transfer.
        let none = Engine::new(EngineConfig {
            idle_release: Some(std::time::Duration::ZERO),
            ..Default::default()
        })
        .unwrap();
        write(&none);
        assert_eq!(none.pooled_bytes(), 0);
    }

    #[test]
    fn idle_release_from_the_environment() {
        assert_eq!(
            config::parse_idle_release("2.5").unwrap(),
            Some(std::time::Duration::from_millis(2500))
        );
        assert_eq!(config::parse_idle_release(" OFF ").unwrap(), None);
        assert_eq!(config::parse_idle_release("never").unwrap(), None);
        assert!(config::parse_idle_release("-1").is_err());
        assert!(config::parse_idle_release("soon").is_err());
    }

    #[test]
    fn a_transfer_file_opens_its_device_path_on_need_and_checks_reads() {
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = d.path().join("tf");
        let io = open(&path, DirectMode::Auto);
        let tf = TransferFile::new(io, crate::gpu::Backend::Bounce);
        let e = engine(2, 8192);
        let data: Vec<u8> = (0..50_000u32).map(|i| i as u8).collect();
        let req = Request {
            checksum: true,
            file_len: Some(60_000),
            ..Request::default()
        };
        let rep = unsafe { tf.write(&e, &[host(10, &data)], req) }.unwrap();
        assert_eq!(rep.stats.crc32, [Some(crc32fast::hash(&data))]);
        assert_eq!(rep.stats.device_path, None);
        assert_eq!(rep.backend, crate::gpu::Backend::Bounce);
        // Host memory only: no device path was opened.
        assert_eq!(tf.path_state(), None);
        let mut back = vec![0u8; 50_000];
        let seg = Segment {
            file_offset: 10,
            addr: back.as_mut_ptr() as u64,
            len: 50_000,
            memory: Memory::Host,
        };
        unsafe { tf.read(&e, &[seg], Request::default()) }.unwrap();
        assert_eq!(back, data);
        // Past the end: a format error before any byte moves.
        let past = Segment {
            file_offset: 59_990,
            len: 100,
            ..seg
        };
        match unsafe { tf.read(&e, &[past], Request::default()) } {
            Err(Error::Format { reason, .. }) => {
                assert!(reason.contains("past the end"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        // Opened on request (the bounce pipeline, as asked), closed on request.
        tf.open_device_path().unwrap();
        let st = tf.path_state().unwrap();
        assert_eq!((st.name, st.gds_mode), ("bounce", None));
        assert!(st
            .fallback_reason
            .unwrap()
            .contains("bounce backend requested"));
        tf.close_device_path();
        assert_eq!(tf.path_state(), None);
    }

    /// A write storing each patch's CRC-32 (checksums on).
    ///
    /// # Safety
    /// As [`Engine::write`]: every segment's memory stays valid and unchanged
    /// until the call returns.
    unsafe fn write_patched(
        e: &Engine,
        f: &IoFile,
        segs: &[Segment],
        patches: &[Patch],
    ) -> Result<Stats> {
        let opts = Options {
            patches,
            ..Options::default()
        };
        unsafe { e.write_with(f, segs, opts) }
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
            let st = unsafe { write_patched(&e, &f, &t.segs, &t.patches) }.unwrap();
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
            let st2 = unsafe { e.read_with(&f, &rsegs, crc()) }.unwrap();
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
        // A segment of GATHER_BELOW bytes or more moves alone: 3 cells for it,
        // one for each small neighbour.
        let big = 2 << 20;
        assert_eq!(read(&[(0, 100), (4096, big), (4096 + big as u64, 100)]), 5);
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
            match unsafe { write_patched(&e, &f, &segs, &[p]) } {
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
        match unsafe { write_patched(&engine(2, 4096), &f, &t.segs, &t.patches) } {
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
                    prop_oneof![
                        8 => 0usize..64,
                        8 => 64usize..5000,
                        8 => 5000usize..70_000,
                        // Past GATHER_BELOW: I/Os of their own between gathered ones.
                        1 => (GATHER_BELOW as usize)..(GATHER_BELOW as usize + 9000),
                    ],
                    1..120),
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
                let st = unsafe { write_patched(&e, &f, &t.segs, &t.patches) }.unwrap();
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
                let st2 = unsafe { e.read_with(&f, &rsegs, crc()) }.unwrap();
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
