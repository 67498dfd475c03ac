//! The engine: moves segments (memory range <-> file range) in parallel chunks.
//!
//! A transfer is a list of [`Segment`]s. The engine cuts them into chunks on a
//! grid of `chunk_size` in file offsets (so every chunk but a segment's first
//! and last starts and ends aligned), and a pool of I/O threads takes chunks in
//! file order until none is left. The call returns when every chunk is done,
//! or with the first error; the other threads stop taking chunks as soon as one
//! fails, so an error never goes unreported and a write is never silently partial.
//!
//! On request every chunk's CRC-32 is computed by the thread that moved it,
//! over the bytes as they pass through host memory (the caller's memory, the
//! staging buffer or a pinned bounce slot), and the chunks' values are combined
//! into one CRC-32 per segment. Bytes that never touch host memory (cuFile)
//! get no value rather than a wrong one.
//!
//! Device memory is touched only after the work the caller queued on its CUDA
//! streams before the call ([`crate::gpu::order`]), and is ready for any stream
//! when the call returns.
//!
//! Threads write neighbouring ranges at the same time, so no page is ever
//! written by two paths at once: host and bounce writes split on whole pages
//! ([`IoFile::write_unit`]), and under cuFile, whose unaligned writes
//! read-modify-write whole blocks, the chunks that share a page with another
//! segment take turns on it.
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
mod pool;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crc32fast::Hasher;

use crate::gpu::order::After;
use crate::gpu::DevicePath;
pub use crate::gpu::Memory;
use crate::io::align;
use crate::io::file::IoFile;
use crate::{Error, Result};

pub use config::{default_memory_threads, parse_size, threads_from_env, EngineConfig};
pub use config::{
    DEFAULT_CHUNK_SIZE, DEFAULT_IDLE_RELEASE, DEFAULT_MEMORY_CHUNK_SIZE, DEFAULT_THREADS,
};
pub use file::{PathState, Report, Request, TransferFile};
pub use lane::Lane;
pub use memory::{MemoryPath, ReadPath, RESIDENT_MIN};
pub use pool::release_buffers;

/// One contiguous memory range and the file range it maps to.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    pub file_offset: u64,
    pub addr: u64,
    pub len: u64,
    pub memory: Memory,
}

/// What a transfer did.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub bytes: u64,
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
}

#[derive(Clone, Copy, Debug)]
struct Chunk {
    /// Index of the segment it belongs to.
    seg: usize,
    file_offset: u64,
    addr: u64,
    len: usize,
    memory: Memory,
    /// Pages (in write units) this chunk shares with another segment and must
    /// hold while it writes (only under cuFile; see [`PageLocks`]).
    shared: [Option<u64>; 2],
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
    /// [`Engine::read_with`]); the segments must not overlap each other.
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
        let chunks = self.plan(
            segments,
            dir,
            self.cfg.chunk_for(file),
            file.write_unit(),
            serialize,
        )?;
        let bytes = segments.iter().map(|s| s.len).sum();
        let threads = self.cfg.threads_for(file).min(chunks.len()).max(1);
        let mut stats = Stats {
            bytes,
            chunks: chunks.len(),
            threads,
            direct: file.is_direct(),
            device_path: (!devices.is_empty())
                .then(|| opts.path.map_or("bounce", DevicePath::name)),
            crc32: Vec::new(),
            read_path: choice.as_ref().map(|c| c.path.clone()),
        };
        if chunks.is_empty() {
            if opts.checksum {
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
        let mut lanes = self.pool.take(
            threads,
            self.lane_capacity(file),
            file.alignment().memory.max(align::DEFAULT_ALIGN),
        )?;
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let first_error: Mutex<Option<Error>> = Mutex::new(None);
        let locks = PageLocks::default();
        let ctx = lane::Ctx {
            file,
            dir,
            path: opts.path,
            after: &after,
            locks: &locks,
            capacity: self.lane_capacity(file),
        };
        // (chunk index, its CRC-32): filled by the threads, combined below.
        let crcs: Mutex<Vec<(usize, Option<u32>)>> = Mutex::new(Vec::new());

        std::thread::scope(|s| {
            for lane in lanes.iter_mut() {
                let (chunks, next, failed, first_error, crcs, ctx) =
                    (&chunks, &next, &failed, &first_error, &crcs, &ctx);
                s.spawn(move || {
                    let take = || {
                        if failed.load(Ordering::Relaxed) {
                            return None;
                        }
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        chunks.get(i).map(|c| (i, c))
                    };
                    let mut mine = Vec::new();
                    let out = opts.checksum.then_some(&mut mine);
                    // SAFETY: chunk ranges lie inside the caller's segments
                    // (see `plan`), whose validity the caller guarantees.
                    let r = unsafe { lane.run(ctx, take, out) };
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
        self.pool.give_back(lanes);
        if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            // Errors of layers that do not know the file (cuFile's) name it here.
            return Err(e.with_path(file.path()));
        }
        if opts.checksum {
            let per_chunk = crcs.into_inner().unwrap_or_else(|p| p.into_inner());
            stats.crc32 = combine(segments.len(), &chunks, per_chunk);
        }
        Ok(stats)
    }

    /// Bytes each staging or pinned buffer needs for this file: a chunk plus
    /// room to widen it to whole write units at both ends.
    fn lane_capacity(&self, file: &IoFile) -> usize {
        self.cfg.chunk_for(file) + 2 * file.write_unit().max(align::DEFAULT_ALIGN as u64) as usize
    }

    /// Cut segments into chunks on the `chunk_size` grid of file offsets.
    /// Segments written must not overlap in the file. With `serialize`, each
    /// chunk lists the pages (of `unit` bytes) it shares with another segment.
    fn plan(
        &self,
        segments: &[Segment],
        dir: Dir,
        chunk_size: usize,
        unit: u64,
        serialize: bool,
    ) -> Result<Vec<Chunk>> {
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
        let shared = if dir == Dir::Write {
            shared_pages(segments, unit, serialize)?
        } else {
            HashSet::new()
        };
        let page = |off: u64| Some(off / unit).filter(|p| shared.contains(p));
        let mut out = Vec::new();
        for (i, s) in segments.iter().enumerate() {
            let mut off = s.file_offset;
            let end = s.file_offset + s.len;
            while off < end {
                let stop = (align::align_down(off, cs) + cs).min(end);
                out.push(Chunk {
                    seg: i,
                    file_offset: off,
                    addr: s.addr + (off - s.file_offset),
                    len: (stop - off) as usize,
                    memory: s.memory,
                    shared: [page(off), page(stop - 1)],
                });
                off = stop;
            }
        }
        Ok(out)
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

/// Check that the written segments do not overlap, and (with `serialize`)
/// find the pages of `unit` bytes that two of them share.
fn shared_pages(segments: &[Segment], unit: u64, serialize: bool) -> Result<HashSet<u64>> {
    let mut order: Vec<usize> = (0..segments.len())
        .filter(|&i| segments[i].len > 0)
        .collect();
    order.sort_unstable_by_key(|&i| segments[i].file_offset);
    let mut shared = HashSet::new();
    for w in order.windows(2) {
        let (a, b) = (&segments[w[0]], &segments[w[1]]);
        let a_end = a.file_offset + a.len;
        if a_end > b.file_offset {
            return Err(Error::invalid(format!(
                "segments {} and {} overlap in the file (bytes {}..{} and {}..{})",
                w[0],
                w[1],
                a.file_offset,
                a_end,
                b.file_offset,
                b.file_offset + b.len
            )));
        }
        if serialize && (a_end - 1) / unit == b.file_offset / unit {
            shared.insert(b.file_offset / unit);
        }
    }
    Ok(shared)
}

/// Pages that chunks of different segments share, held by one chunk at a time.
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
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            while pages.iter().flatten().any(|p| held.contains(p)) {
                held = self.freed.wait(held).unwrap_or_else(|p| p.into_inner());
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
        let mut held = self.locks.held.lock().unwrap_or_else(|p| p.into_inner());
        for p in self.pages.iter().flatten() {
            held.remove(p);
        }
        drop(held);
        self.locks.freed.notify_all();
    }
}

/// One CRC-32 per segment from the chunks' values (chunks of a segment are in
/// file order in `chunks`); None where any chunk of the segment has none.
fn combine(
    segments: usize,
    chunks: &[Chunk],
    per_chunk: Vec<(usize, Option<u32>)>,
) -> Vec<Option<u32>> {
    let mut by_chunk = vec![None; chunks.len()];
    for (i, crc) in per_chunk {
        by_chunk[i] = crc;
    }
    let mut out: Vec<Option<Hasher>> = (0..segments).map(|_| Some(Hasher::new())).collect();
    for (c, crc) in chunks.iter().zip(by_chunk) {
        match (&mut out[c.seg], crc) {
            (Some(h), Some(v)) => h.combine(&Hasher::new_with_initial_len(v, c.len as u64)),
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
    use std::fs::OpenOptions;

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
        let e = engine(2, 8192);
        let buf = vec![0u8; 10_000];
        let seg = |off: u64, len: usize| Segment {
            file_offset: off,
            addr: buf.as_ptr() as u64,
            len: len as u64,
            memory: Memory::Host,
        };
        // Overlapping writes are refused before any byte moves.
        let err = e
            .plan(
                &[seg(0, 5000), seg(4000, 100)],
                Dir::Write,
                8192,
                4096,
                false,
            )
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        // Reads may overlap in the file (one range into two memories).
        e.plan(
            &[seg(0, 5000), seg(4000, 100)],
            Dir::Read,
            8192,
            4096,
            false,
        )
        .unwrap();
        // Under cuFile, the pages two segments share are held by their chunks
        // (chunks of 8 KiB, pages of 4 KiB): page 1 (segments 0 and 1), page 2
        // (1, 2 and 3); pages 3, 4 and 5 are one segment's own.
        let segs = [
            seg(0, 5000),
            seg(5000, 4000),
            seg(9000, 100),
            seg(9100, 9000),
            seg(20_480, 10),
        ];
        let chunks = e.plan(&segs, Dir::Write, 8192, 4096, true).unwrap();
        let shared: Vec<(usize, [Option<u64>; 2])> =
            chunks.iter().map(|c| (c.seg, c.shared)).collect();
        assert_eq!(
            shared,
            [
                (0, [None, Some(1)]),
                (1, [Some(1), Some(1)]),
                (1, [Some(2), Some(2)]),
                (2, [Some(2), Some(2)]),
                (3, [Some(2), None]),
                (3, [None, None]),
                (4, [None, None]),
            ]
        );
        // Without cuFile nothing is held.
        let chunks = e.plan(&segs, Dir::Write, 8192, 4096, false).unwrap();
        assert!(chunks.iter().all(|c| c.shared == [None, None]));
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
}
