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
//! Each thread works in a [`Lane`]: its aligned staging buffer (for O_DIRECT
//! from memory that is not aligned). Lanes are kept between calls, so a
//! steady stream of saves allocates nothing.
//!
//! Reads first choose, per file, between the memory path and the disk path
//! ([`memory`]): a file whose bytes are in memory is copied from its page cache.

mod config;
mod lane;
mod memory;

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
pub use memory::{MemoryPath, ReadPath, RESIDENT_MIN};

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

#[derive(Clone, Copy, Debug)]
struct Chunk {
    /// Index of the segment it belongs to.
    seg: usize,
    file_offset: u64,
    addr: u64,
    len: usize,
    memory: Memory,
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
    /// nobody frees or writes to.
    pub unsafe fn write(&self, file: &IoFile, segments: &[Segment]) -> Result<Stats> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.transfer(file, segments, Dir::Write, None, false) }
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
        unsafe { self.transfer(file, segments, Dir::Write, path, checksum) }
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
        unsafe { self.transfer(file, segments, Dir::Read, path, checksum) }
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
        unsafe { self.transfer(file, &segs, Dir::Checksum, None, true) }
    }

    /// Read every segment's file range into its memory.
    ///
    /// # Safety
    /// For the whole call, each segment's `[addr, addr+len)` must be writable
    /// memory of its kind that nobody else reads, writes or frees, and the
    /// segments must not overlap each other.
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
    ) -> Result<Stats> {
        // Reads: the memory path reads a view of the file (through a mapping of
        // its page cache), device memory through the bounce lanes.
        let choice = match dir {
            Dir::Write => None,
            Dir::Read | Dir::Checksum => {
                Some(memory::choose(file, segments, self.cfg.memory_path)?)
            }
        };
        let (file, path) = match choice.as_ref().and_then(|c| c.view.as_ref()) {
            Some(view) => (view, path.filter(|p| p.is_requested())),
            None => (file, path),
        };
        let chunks = self.plan(segments, dir, self.cfg.chunk_for(file))?;
        let bytes = segments.iter().map(|s| s.len).sum();
        let threads = self.cfg.threads_for(file).min(chunks.len()).max(1);
        let has_device = dir != Dir::Checksum
            && segments
                .iter()
                .any(|s| s.len > 0 && s.memory != Memory::Host);
        let mut stats = Stats {
            bytes,
            chunks: chunks.len(),
            threads,
            direct: file.is_direct(),
            device_path: has_device.then(|| path.map_or("bounce", DevicePath::name)),
            crc32: Vec::new(),
            read_path: choice.as_ref().map(|c| c.path.clone()),
        };
        if chunks.is_empty() {
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
        // (chunk index, its CRC-32): filled by the threads, combined below.
        let crcs: Mutex<Vec<(usize, Option<u32>)>> = Mutex::new(Vec::new());

        std::thread::scope(|s| {
            for lane in lanes.iter_mut() {
                let (chunks, next, failed, first_error, crcs) =
                    (&chunks, &next, &failed, &first_error, &crcs);
                s.spawn(move || {
                    let take = || {
                        if failed.load(Ordering::Relaxed) {
                            return None;
                        }
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        chunks.get(i).map(|c| (i, c))
                    };
                    let mut mine = Vec::new();
                    let out = checksum.then_some(&mut mine);
                    // SAFETY: chunk ranges lie inside the caller's segments
                    // (see `plan`), whose validity the caller guarantees.
                    let r = unsafe { lane.run(file, dir, path, capacity, take, out) };
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
            let per_chunk = crcs.into_inner().unwrap_or_else(|p| p.into_inner());
            stats.crc32 = combine(segments.len(), &chunks, per_chunk);
        }
        Ok(stats)
    }

    /// Bytes each staging or pinned buffer needs for this file: a chunk plus
    /// room to widen it to aligned bounds at both ends.
    fn lane_capacity(&self, file: &IoFile) -> usize {
        self.cfg.chunk_for(file) + 2 * file.alignment().offset.max(align::DEFAULT_ALIGN)
    }

    /// Cut segments into chunks on the `chunk_size` grid of file offsets.
    fn plan(&self, segments: &[Segment], dir: Dir, chunk_size: usize) -> Result<Vec<Chunk>> {
        let cs = chunk_size as u64;
        let mut out = Vec::new();
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
                });
                off = stop;
            }
        }
        Ok(out)
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
            memory_path: MemoryPath::Map,
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
}
