//! A file's bytes read from memory: through a mapping of its page cache, and
//! which of its pages are there.
//!
//! [`FileMap`] maps a file read-only (MAP_SHARED, MADV_SEQUENTIAL) and copies
//! ranges out of it. Read that way, a page cache page is not marked accessed:
//! `read()` marks every page it copies, and the second access of a page moves
//! it to the kernel's active LRU list under a lock all readers share. A crash-safe
//! save writes a new file, and write() counts as the first access, so the first
//! load after a save pays that move for every page when it reads with pread
//! (on the H200 host: 22.6 GiB/s for the first load from /dev/shm, 42.9 for the
//! next ones). A page fault on a mapping does not mark the page, and
//! MADV_SEQUENTIAL keeps the unmapping from marking it either.
//!
//! A mapping of a file that shrinks under it raises SIGBUS on the pages past the
//! new end. [`FileMap`] copies under a guard instead: a process-wide SIGBUS
//! handler that, for an address inside a guarded mapping, maps zero pages over
//! the rest of that mapping and flags it; the copy then ends and returns a
//! `Format` error naming the file. Faults anywhere else go to the handler that
//! was there before (Python's faulthandler, the Rust runtime's, or the default
//! action). A mapping that cannot be guarded (all slots busy) is not made: the
//! caller reads with pread.
//!
//! [`FileMap::residency`] says which pages of the ranges to read are in the
//! page cache (mincore over the mapping, sampled for large ranges).
//!
//! [`FileMap::streaming`] makes its copies write with non-temporal stores
//! ([`copy_stream`], `CKPTIO_MEMORY_PATH=map-nt`): the destination (a pinned
//! bounce slot the GPU reads next) is written without being read first, one
//! memory pass less per byte, and does not evict the cache. Which copy is
//! faster depends on the host's memory system and its libc's memcpy (which
//! streams too above a size it picks); [`copy_floor`] measures both, without
//! the engine, for the benches.
//!
//! Each copy drops the page-table entries it made once its bytes are out
//! ([`FileMap::read_upto`]), on the copying thread: unmapping a large mapping
//! whose entries were all left for the end zapped them under the process's
//! memory-map lock (about 0.06 s for 2 GiB on a 2-core VM, ~90 ms for 8 GiB on
//! the H200 host), and every thread start, stack unmapping or allocation in
//! the process waited for it. A mapping of more than [`DEFER_UNMAP_MIN`] bytes
//! is still unmapped by a background thread once dropped. [`pending_unmaps`]
//! counts those not done yet.
//!
//! No mapping outlives the read that made it (issue 37): a mapping kept for
//! the next read of the same file helped only a load repeating that file
//! within seconds, a pattern of benchmarks, and kept the file's pages pinned in
//! the page cache (`drop_caches` could not evict them) meanwhile.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use crate::workers::Caller;
use crate::{Error, Result};

const PAGE: usize = 4096;
/// Mappings larger than this are unmapped off the caller's thread (see the
/// module's documentation).
pub const DEFER_UNMAP_MIN: usize = 64 << 20;

/// Which pages of some file ranges are in the page cache.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Residency {
    /// Pages looked at (all of them, or a sample of large ranges).
    pub sampled: u64,
    pub resident: u64,
}

impl Residency {
    /// The resident share of the pages looked at (1.0 for no pages).
    pub fn fraction(&self) -> f64 {
        if self.sampled == 0 {
            1.0
        } else {
            self.resident as f64 / self.sampled as f64
        }
    }
}

/// A read-only mapping of a whole file, copied from under a SIGBUS guard.
pub struct FileMap {
    ptr: *mut u8,
    len: usize,
    slot: usize,
    path: PathBuf,
    /// Copies out of the mapping use non-temporal stores ([`copy_stream`]).
    stream: bool,
}

impl std::fmt::Debug for FileMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileMap")
            .field("path", &self.path)
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: the mapping is read-only and owned by this value; copies out of it
// from several threads at once are plain reads.
unsafe impl Send for FileMap {}
// SAFETY: as above: `&FileMap` only reads the mapping.
unsafe impl Sync for FileMap {}

impl FileMap {
    /// Map `file` (at its current size) read-only. None for an empty file, a
    /// file the kernel will not map, or when no guard slot is free: read it
    /// with pread then.
    pub fn new(file: &File, path: &Path) -> Result<Option<FileMap>> {
        let meta = file.metadata().map_err(|e| Error::io_at("stat", path, e))?;
        let Ok(len) = usize::try_from(meta.len()) else {
            return Ok(None);
        };
        if len == 0 || !guard::install() {
            return Ok(None);
        }
        // SAFETY: a fresh read-only shared mapping of a file we hold open.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Ok(None);
        }
        // SAFETY: advice on the mapping just made: faults read ahead, and
        // neither faults nor the unmapping mark pages accessed.
        unsafe { libc::madvise(p, len, libc::MADV_SEQUENTIAL) };
        let Some(slot) = guard::claim(p as usize, len) else {
            // SAFETY: our own mapping, never handed out.
            unsafe { libc::munmap(p, len) };
            return Ok(None);
        };
        Ok(Some(FileMap {
            ptr: p.cast(),
            len,
            slot,
            path: path.to_path_buf(),
            stream: false,
        }))
    }

    /// Copy out with non-temporal stores ([`copy_stream`]) when `on`.
    pub fn streaming(mut self, on: bool) -> Self {
        self.stream = on;
        self
    }

    /// The file's length when it was mapped.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copy the file's bytes from `off` into `dst`, up to the mapped length;
    /// returns the bytes copied. A file that shrank meanwhile is a `Format`
    /// error (never a SIGBUS).
    pub fn read_upto(&self, dst: &mut [u8], off: u64) -> Result<usize> {
        let Ok(off) = usize::try_from(off) else {
            return Ok(0);
        };
        if off >= self.len {
            return Ok(0);
        }
        let n = dst.len().min(self.len - off);
        // SAFETY: [off, off+n) lies inside the mapping, which lives as long as
        // `self`; a page the file lost meanwhile reads as zeros (the guard maps
        // them) and is reported below. `dst` is the caller's writable memory.
        unsafe {
            if self.stream {
                copy_stream(self.ptr.add(off), dst.as_mut_ptr(), n);
            } else {
                std::ptr::copy_nonoverlapping(self.ptr.add(off), dst.as_mut_ptr(), n);
            }
        }
        self.zap(off, n);
        if guard::hit(self.slot) {
            let now = std::fs::metadata(&self.path).map_or(0, |m| m.len());
            return Err(Error::format(
                Some(&self.path),
                format!(
                    "the file shrank while it was read (it was {} bytes, now {now})",
                    self.len
                ),
            ));
        }
        Ok(n)
    }

    /// Drop the page-table entries of the whole pages of `[off, off+n)`, just
    /// copied (MADV_DONTNEED: the page cache keeps the pages; a later access
    /// faults them in again). Each copy thread tears down what it made, in
    /// parallel, so unmapping a large mapping has nothing left to zap: on the
    /// H200 host the background munmap of 8 GiB of entries held the process's
    /// memory-map lock for ~90 ms, stalling the next thread start, stack
    /// unmapping and allocation of every thread in the process.
    fn zap(&self, off: usize, n: usize) {
        let start = off.next_multiple_of(PAGE);
        let end = (off + n) / PAGE * PAGE;
        if end > start {
            // SAFETY: whole pages inside our own read-only mapping, which
            // stays mapped; the advice changes no byte of the file.
            unsafe { libc::madvise(self.ptr.add(start).cast(), end - start, libc::MADV_DONTNEED) };
        }
    }

    /// Which pages of the file ranges `(offset, len)` are in the page cache:
    /// every page for ranges of up to 256 MiB in all, else evenly spread
    /// windows of 64 KiB covering about that much.
    pub fn residency(&self, ranges: &[(u64, u64)]) -> Residency {
        const BUDGET: u64 = 65536; // pages looked at, at most about
        const WINDOW: u64 = 16; // pages per sampled window
        let ranges: Vec<(u64, u64)> = ranges
            .iter()
            .filter_map(|&(off, len)| {
                let start = off.min(self.len as u64) / PAGE as u64;
                let end = off
                    .saturating_add(len)
                    .min(self.len as u64)
                    .div_ceil(PAGE as u64);
                (end > start).then_some((start, end - start))
            })
            .collect();
        let total: u64 = ranges.iter().map(|r| r.1).sum();
        let mut r = Residency::default();
        let stride = if total <= BUDGET {
            None
        } else {
            Some(total / (BUDGET / WINDOW))
        };
        let mut vec = Vec::new();
        let mut count = |first: u64, pages: u64, r: &mut Residency| {
            vec.resize(pages as usize, 0u8);
            // SAFETY: the pages lie inside our mapping; mincore only writes
            // one byte per page into `vec`, which holds `pages` bytes.
            let rc = unsafe {
                libc::mincore(
                    self.ptr.add(first as usize * PAGE).cast(),
                    pages as usize * PAGE,
                    vec.as_mut_ptr(),
                )
            };
            if rc == 0 {
                r.sampled += pages;
                r.resident += vec.iter().filter(|&&b| b & 1 == 1).count() as u64;
            }
        };
        match stride {
            None => {
                for &(first, pages) in &ranges {
                    count(first, pages, &mut r);
                }
            }
            Some(stride) => {
                // Window k starts at the k*stride-th page of the ranges laid end to end.
                let mut at = 0u64; // position of the current range's first page
                let mut next = 0u64; // position of the next window
                for &(first, pages) in &ranges {
                    while next < at + pages {
                        let take = WINDOW.min(at + pages - next);
                        count(first + (next - at), take, &mut r);
                        next += stride;
                    }
                    at += pages;
                }
            }
        }
        r
    }
}

/// Copy `n` bytes from `src` to `dst` with non-temporal (streaming) stores
/// where the CPU has them (x86-64: SSE2, always there): every destination line
/// is written whole without being read first, and bypasses the cache. Other
/// CPUs: a plain copy.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src` readable and `dst` writable for
/// `n` bytes, not overlapping.
pub unsafe fn copy_stream(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Streaming stores need 16-byte aligned destinations: the head up to
        // the first one, and the tail past the last whole 64 bytes, are plain.
        let head = (dst as usize).wrapping_neg() & 15;
        if n < head + 64 {
            // SAFETY: the caller's contract.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
            return;
        }
        let body = (n - head) & !63;
        // SAFETY: every access lies in [0, n) of the caller's ranges; the
        // stores start at a 16-byte aligned address (`head` skipped it), and
        // the fence orders the streamed lines before anything that follows
        // (the bounce lane's DMA is queued after this returns).
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let (s, d) = (src.add(head), dst.add(head));
            let mut i = 0;
            while i < body {
                let a = _mm_loadu_si128(s.add(i).cast::<__m128i>());
                let b = _mm_loadu_si128(s.add(i + 16).cast::<__m128i>());
                let c = _mm_loadu_si128(s.add(i + 32).cast::<__m128i>());
                let e = _mm_loadu_si128(s.add(i + 48).cast::<__m128i>());
                _mm_stream_si128(d.add(i).cast::<__m128i>(), a);
                _mm_stream_si128(d.add(i + 16).cast::<__m128i>(), b);
                _mm_stream_si128(d.add(i + 32).cast::<__m128i>(), c);
                _mm_stream_si128(d.add(i + 48).cast::<__m128i>(), e);
                i += 64;
            }
            _mm_sfence();
            std::ptr::copy_nonoverlapping(s.add(body), d.add(body), n - head - body);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, n)
    }
}

/// How [`copy_floor`] reads the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloorSource {
    /// Copied from a [`FileMap`] (memcpy), as `CKPTIO_MEMORY_PATH=map`.
    Map,
    /// Copied from a [`FileMap`] with [`copy_stream`], as `map-nt`.
    MapNt,
    /// pread, as `CKPTIO_MEMORY_PATH=pread`.
    Pread,
}

impl std::str::FromStr for FloorSource {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "map" => Ok(FloorSource::Map),
            "map-nt" => Ok(FloorSource::MapNt),
            "pread" => Ok(FloorSource::Pread),
            other => Err(Error::invalid(format!(
                "copy floor source must be map, map-nt or pread, not {other:?}"
            ))),
        }
    }
}

/// The memory path's CPU floor, for the benches: the whole of `file` copied
/// into `ring` by `threads` threads, `chunk` bytes at a time, the chunks taken
/// in file order from a shared counter as the engine's lanes take them, each
/// thread filling its own two slots of `ring` in turn (as a lane fills its two
/// bounce buffers). No GPU, no engine. Returns the seconds, the mapping
/// included (its unmapping, as the engine's, runs off the caller's thread).
/// `ring` must hold `threads * 2 * chunk` bytes.
pub fn copy_floor(
    file: &File,
    path: &Path,
    source: FloorSource,
    threads: usize,
    chunk: usize,
    ring: &mut [u8],
) -> Result<f64> {
    if threads == 0 || chunk == 0 || ring.len() < threads * 2 * chunk {
        return Err(Error::invalid(format!(
            "copy floor: {threads} threads of two {chunk}-byte slots need more than {} bytes",
            ring.len()
        )));
    }
    let t0 = std::time::Instant::now();
    let map = match source {
        FloorSource::Pread => None,
        _ => Some(
            FileMap::new(file, path)?
                .ok_or_else(|| Error::invalid(format!("{}: cannot be mapped", path.display())))?
                .streaming(source == FloorSource::MapNt),
        ),
    };
    let len = file
        .metadata()
        .map_err(|e| Error::io_at("stat", path, e))?
        .len();
    let next = AtomicUsize::new(0);
    let failed = crate::sync::FirstError::default();
    let slots: Vec<Mutex<&mut [u8]>> = ring
        .chunks_mut(2 * chunk)
        .take(threads)
        .map(Mutex::new)
        .collect();
    crate::workers::run(slots.len(), Caller::Helps, |t| {
        let mut slots = crate::sync::lock(&slots[t]);
        let mut turn = 0;
        loop {
            let off = (next.fetch_add(1, Ordering::Relaxed) * chunk) as u64;
            if off >= len {
                break;
            }
            let n = chunk.min((len - off) as usize);
            let slot = &mut slots[(turn % 2) * chunk..][..n];
            turn += 1;
            let r = match &map {
                Some(m) => m.read_upto(slot, off).map(drop),
                None => {
                    use std::os::unix::fs::FileExt;
                    file.read_exact_at(slot, off)
                        .map_err(|e| Error::io_at("pread", path, e))
                }
            };
            if let Err(e) = r {
                failed.set(e);
                break;
            }
        }
    });
    drop(map);
    if let Some(e) = failed.into_inner() {
        return Err(e);
    }
    Ok(t0.elapsed().as_secs_f64())
}

impl Drop for FileMap {
    fn drop(&mut self) {
        // Nothing reads the mapping any more: it stops being guarded, then goes.
        guard::release(self.slot);
        unmap(self.ptr as usize, self.len);
    }
}

/// Whether `[addr, addr+len)` is wholly private, writable mappings of the file
/// open as `fd` (by inode, as /proc/self/maps lists them): what [`detach`] may
/// replace. Anything else (the heap, a library, nothing) is not. Not by
/// device: on btrfs, stat's device (the subvolume's) is not the one the
/// mapping lists (the file system's).
pub fn maps_private_file(addr: usize, len: usize, fd: std::os::fd::RawFd) -> Result<bool> {
    // SAFETY: a plain C struct, all zeros a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes only into the struct it is given (a bad fd is EBADF).
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(Error::io("fstat", None, std::io::Error::last_os_error()));
    }
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| Error::io("read /proc/self/maps", None, e))?;
    let Some(end) = addr.checked_add(len.next_multiple_of(PAGE)) else {
        return Ok(false);
    };
    // Entries are sorted by address: walk those that meet the range, in order.
    let mut at = addr;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms), Some(_), Some(_), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        else {
            continue;
        };
        if hi <= at {
            continue;
        }
        if lo > at {
            return Ok(false); // a hole
        }
        let same_file = inode.parse::<u64>() == Ok(st.st_ino) && st.st_ino != 0;
        if !(perms.starts_with("rw") && perms.ends_with('p') && same_file) {
            return Ok(false);
        }
        at = hi;
        if at >= end {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Make the private file mapping `[addr, addr+len)` (torch's, of `path`)
/// private anonymous memory holding the same bytes at the same address: the
/// tensors that view it keep their values and stop depending on the file, so
/// that a rewrite of it no longer changes them and a truncation no longer
/// kills the process with SIGBUS. One copy, then one `mremap` over the
/// mapping (atomic for the process's other threads); whoever unmaps the
/// range later unmaps the new memory. A file that shrank meanwhile is a
/// `Format` error (what the copy met past its end reads as zeros).
///
/// # Safety
/// `[addr, addr+len)` must be one writable private mapping of this process
/// (page-aligned `addr`), mapped for the whole call, that nothing writes
/// meanwhile.
pub unsafe fn detach(addr: usize, len: usize, path: &Path) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    if addr % PAGE != 0 {
        return Err(Error::invalid(format!(
            "{}: a mapping starts on a page boundary, not at {addr:#x}",
            path.display()
        )));
    }
    let span = len.next_multiple_of(PAGE);
    // Ours until mremap moves it.
    let anon =
        crate::io::hugepage::map_anonymous(span).map_err(|e| Error::io_at("mmap", path, e))?;
    // Guarded where a slot is free: a page the file lost reads as zeros, flagged.
    let slot = if guard::install() {
        guard::claim(addr, len)
    } else {
        None
    };
    // SAFETY: [addr, addr+len) is mapped (the caller's contract) and `anon`
    // is `span` >= `len` bytes of ours; they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, anon.cast::<u8>(), len) };
    let shrank = slot.is_some_and(guard::hit);
    if let Some(s) = slot {
        guard::release(s);
        LIVE.fetch_sub(1, Ordering::SeqCst); // (claim counted it as a mapping of ours)
    }
    if shrank {
        // SAFETY: our own mapping, never handed out.
        unsafe { libc::munmap(anon, span) };
        return Err(Error::format(
            Some(path),
            "the file shrank while its tensors were copied out of its mapping",
        ));
    }
    // SAFETY: `anon` is ours; MREMAP_FIXED replaces the caller's mapping at
    // `addr` (page aligned, `span` bytes: its length rounded as the kernel
    // rounds it) with it in one step.
    let moved = unsafe {
        libc::mremap(
            anon,
            span,
            span,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            addr as *mut libc::c_void,
        )
    };
    if moved == libc::MAP_FAILED {
        let e = std::io::Error::last_os_error();
        // SAFETY: still ours: mremap failed.
        unsafe { libc::munmap(anon, span) };
        return Err(Error::io_at("mremap", path, e));
    }
    Ok(())
}

/// Mappings alive or waiting to be unmapped.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// How many dropped mappings the background thread has not unmapped yet.
pub fn pending_unmaps() -> usize {
    unmapper::pending()
}

/// How many file mappings exist (in use, or dropped and not unmapped yet).
pub fn live_mappings() -> usize {
    LIVE.load(Ordering::SeqCst)
}

/// Wait until every dropped mapping is unmapped (tests, and a caller about to
/// measure memory).
pub fn flush_unmaps() {
    while unmapper::pending() > 0 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

fn unmap(addr: usize, len: usize) {
    if len < DEFER_UNMAP_MIN || !unmapper::queue(addr, len) {
        unmapper::munmap(addr, len);
    }
}

/// The background thread that unmaps large mappings (tearing down the page
/// tables of gigabytes takes a while), started again in a forked child: the
/// child's copies of the mappings queued at the fork are unmapped there.
mod unmapper {
    use super::*;
    use crate::sync::{ensure_thread, lock, wait};

    struct Queue {
        maps: std::collections::VecDeque<(usize, usize)>,
        /// Being unmapped by the thread of process `pid`.
        busy: usize,
        pid: u32,
    }

    static QUEUE: Mutex<Queue> = Mutex::new(Queue {
        maps: std::collections::VecDeque::new(),
        busy: 0,
        pid: 0,
    });
    static QUEUED: Condvar = Condvar::new();
    /// The pid of the process whose unmapping thread runs, if one does.
    static RUNNING: Mutex<Option<u32>> = Mutex::new(None);

    /// `QUEUE` as this process sees it: a mapping the parent's thread was
    /// unmapping at a fork stays mapped in the child, and is not waited for.
    fn ours() -> std::sync::MutexGuard<'static, Queue> {
        let mut q = lock(&QUEUE);
        let pid = std::process::id();
        if q.pid != pid {
            q.pid = pid;
            q.busy = 0;
        }
        q
    }

    pub(super) fn munmap(addr: usize, len: usize) {
        // SAFETY: a mapping made by FileMap::new, no longer guarded nor read,
        // unmapped once.
        unsafe { libc::munmap(addr as *mut libc::c_void, len) };
        LIVE.fetch_sub(1, Ordering::SeqCst);
    }

    /// Hand the mapping to the thread; false where no thread can run.
    pub(super) fn queue(addr: usize, len: usize) -> bool {
        if !ensure_thread(&RUNNING, "ckptio-unmap", run) {
            return false;
        }
        ours().maps.push_back((addr, len));
        QUEUED.notify_one();
        true
    }

    pub(super) fn pending() -> usize {
        let q = ours();
        q.maps.len() + q.busy
    }

    fn run() {
        loop {
            let mut q = ours();
            let (addr, len) = loop {
                match q.maps.pop_front() {
                    Some(m) => break m,
                    None => q = wait(&QUEUED, q),
                }
            };
            q.busy += 1;
            drop(q);
            munmap(addr, len);
            ours().busy -= 1;
        }
    }
}

/// The SIGBUS guard: slots of guarded ranges and the handler that reads them.
mod guard {
    use super::*;

    const SLOTS: usize = 256;

    struct Slot {
        start: AtomicUsize,
        end: AtomicUsize,
        hit: AtomicBool,
    }

    #[allow(clippy::declare_interior_mutable_const)]
    const EMPTY: Slot = Slot {
        start: AtomicUsize::new(0),
        end: AtomicUsize::new(0),
        hit: AtomicBool::new(false),
    };
    static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];
    /// The handler ours replaced (leaked: the signal handler may read it at any time).
    static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
    static INSTALL: Mutex<()> = Mutex::new(());

    /// Claim a slot for `[start, start+len)`; None when all are busy.
    pub(super) fn claim(start: usize, len: usize) -> Option<usize> {
        for (i, s) in TABLE.iter().enumerate() {
            if s.start
                .compare_exchange(0, start, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                s.hit.store(false, Ordering::SeqCst);
                s.end.store(start + len, Ordering::SeqCst);
                LIVE.fetch_add(1, Ordering::SeqCst);
                return Some(i);
            }
        }
        None
    }

    pub(super) fn hit(slot: usize) -> bool {
        TABLE[slot].hit.load(Ordering::SeqCst)
    }

    pub(super) fn release(slot: usize) {
        let s = &TABLE[slot];
        s.end.store(0, Ordering::SeqCst);
        s.start.store(0, Ordering::SeqCst);
    }

    /// Install the handler unless it is the current one (someone may have
    /// replaced it since: faulthandler.enable() does). False when sigaction fails.
    pub(super) fn install() -> bool {
        let _one = crate::sync::lock(&INSTALL);
        // SAFETY: sigaction with a null new action only reads the current one
        // into plain old data.
        let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut cur) } != 0 {
            return false;
        }
        if cur.sa_sigaction == handler_addr() {
            return true;
        }
        let prev = Box::into_raw(Box::new(cur));
        PREVIOUS.store(prev, Ordering::SeqCst);
        // SAFETY: zeroed sigaction is valid plain data; we fill the fields.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction = handler_addr();
        act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: `act.sa_mask` is ours to initialise; the handler is an
        // `extern "C"` function of the SA_SIGINFO signature.
        unsafe {
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(libc::SIGBUS, &act, std::ptr::null_mut()) == 0
        }
    }

    fn handler_addr() -> usize {
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = on_sigbus;
        f as *const () as usize
    }

    /// Map zero pages over `[page, end)`: the faulting access and every later
    /// one in this mapping read zeros.
    fn zero_fill(page: usize, end: usize) -> bool {
        // SAFETY: the range is the tail of a guarded mapping of ours; replacing
        // it is what the guard is for (async-signal-safe: one system call).
        let p = unsafe {
            libc::mmap(
                page as *mut libc::c_void,
                end - page,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        p != libc::MAP_FAILED
    }

    extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
        // SAFETY: the kernel hands a valid siginfo_t to an SA_SIGINFO handler.
        let addr = unsafe { (*info).si_addr() } as usize;
        for s in TABLE.iter() {
            let (start, end) = (s.start.load(Ordering::SeqCst), s.end.load(Ordering::SeqCst));
            if start != 0 && addr >= start && addr < end {
                // Flag first: whoever reads the zeros then sees the flag.
                s.hit.store(true, Ordering::SeqCst);
                if zero_fill(addr & !(PAGE - 1), end) {
                    return;
                }
            }
        }
        let prev = PREVIOUS.load(Ordering::SeqCst);
        // SAFETY: `prev` was leaked by `install` and is never freed.
        let prev = unsafe { prev.as_ref() };
        match prev.map(|p| (p.sa_sigaction, p.sa_flags)) {
            Some((h, flags)) if h != libc::SIG_DFL && h != libc::SIG_IGN => {
                if flags & libc::SA_SIGINFO != 0 {
                    // SAFETY: an SA_SIGINFO handler has this signature.
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        unsafe { std::mem::transmute(h) };
                    f(sig, info, ctx);
                } else {
                    // SAFETY: a plain handler has this signature.
                    let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(h) };
                    f(sig);
                }
            }
            _ => {
                // Not ours and nobody else's: the default action, as if we
                // had never been here (the access faults again and kills).
                // SAFETY: zeroed sigaction is SIG_DFL with an empty mask.
                let dfl: libc::sigaction = unsafe { std::mem::zeroed() };
                // SAFETY: restoring the default action of SIGBUS.
                unsafe { libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut()) };
            }
        }
    }

    #[cfg(test)]
    pub(super) fn slots_in_use() -> usize {
        TABLE
            .iter()
            .filter(|s| s.start.load(Ordering::SeqCst) != 0)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_with(dir: &Path, n: usize) -> (PathBuf, Vec<u8>) {
        let path = dir.join("m.bin");
        let data: Vec<u8> = (0..n).map(|i| (i * 13 % 251) as u8).collect();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&data)
            .unwrap();
        (path, data)
    }

    #[test]
    fn copies_ranges_and_stops_at_the_end() {
        let d = tempfile::tempdir().unwrap();
        let (path, data) = file_with(d.path(), 3 * PAGE + 100);
        let f = File::open(&path).unwrap();
        let m = FileMap::new(&f, &path).unwrap().unwrap();
        assert_eq!(m.len(), data.len() as u64);
        for (off, n) in [(0, 10), (4095, 5000), (3 * PAGE, 100), (3 * PAGE + 50, 200)] {
            let mut buf = vec![0u8; n];
            let got = m.read_upto(&mut buf, off as u64).unwrap();
            let want = n.min(data.len() - off);
            assert_eq!(got, want);
            assert_eq!(&buf[..got], &data[off..off + got]);
        }
        assert_eq!(m.read_upto(&mut [0u8; 4], 1 << 40).unwrap(), 0);
        // An empty file is not mapped.
        let empty = d.path().join("e");
        std::fs::File::create(&empty).unwrap();
        assert!(FileMap::new(&File::open(&empty).unwrap(), &empty)
            .unwrap()
            .is_none());
    }

    #[test]
    fn streaming_copies_match_plain_ones_at_any_alignment() {
        let src: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; 10_100];
        for (so, dof) in [(0, 0), (1, 0), (0, 3), (5, 17), (16, 15), (63, 1)] {
            for n in [0, 1, 15, 63, 64, 65, 127, 1000, 4097, 9_000] {
                dst.fill(0xEE);
                // SAFETY: both ranges lie inside their vectors, which do not overlap.
                unsafe { copy_stream(src.as_ptr().add(so), dst.as_mut_ptr().add(dof), n) };
                assert_eq!(&dst[dof..dof + n], &src[so..so + n], "{so} {dof} {n}");
                assert!(dst[..dof].iter().all(|&b| b == 0xEE));
                assert!(dst[dof + n..].iter().all(|&b| b == 0xEE));
            }
        }
    }

    #[test]
    fn the_copy_floor_reads_every_chunk_into_its_ring() {
        let d = tempfile::tempdir().unwrap();
        let chunk = 2 * PAGE;
        let (path, data) = file_with(d.path(), 3 * chunk + 100);
        let f = File::open(&path).unwrap();
        for source in ["map", "map-nt", "pread"] {
            let source: FloorSource = source.parse().unwrap();
            // One thread: chunk j lands in slot j % 2, so the last two stay there.
            let mut ring = vec![0u8; 2 * chunk];
            let s = copy_floor(&f, &path, source, 1, chunk, &mut ring).unwrap();
            assert!(s >= 0.0);
            assert_eq!(&ring[..chunk], &data[2 * chunk..3 * chunk], "{source:?}");
            assert_eq!(&ring[chunk..chunk + 100], &data[3 * chunk..], "{source:?}");
            let mut four = vec![0u8; 4 * chunk];
            copy_floor(&f, &path, source, 2, chunk, &mut four).unwrap();
        }
        let mut small = vec![0u8; chunk];
        let e = copy_floor(&f, &path, FloorSource::Map, 1, chunk, &mut small).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!("mmap".parse::<FloorSource>().is_err());
        flush_unmaps();
    }

    #[test]
    fn a_file_truncated_under_its_mapping_is_an_error_not_a_sigbus() {
        let dirs = [std::env::temp_dir(), PathBuf::from("/dev/shm")];
        for (dir, stream) in dirs.iter().flat_map(|d| [(d, false), (d, true)]) {
            if !dir.is_dir() {
                continue;
            }
            let d = tempfile::tempdir_in(dir).unwrap();
            let (path, data) = file_with(d.path(), 64 * PAGE);
            let f = File::open(&path).unwrap();
            let m = FileMap::new(&f, &path).unwrap().unwrap().streaming(stream);
            let mut buf = vec![0u8; 64 * PAGE];
            assert_eq!(m.read_upto(&mut buf, 0).unwrap(), 64 * PAGE);
            assert_eq!(buf, data);
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(10 * PAGE as u64 + 7)
                .unwrap();
            // Bytes still in the file read fine; the copy past the new end fails.
            let mut head = vec![0u8; 10 * PAGE];
            assert_eq!(m.read_upto(&mut head, 0).unwrap(), 10 * PAGE);
            assert_eq!(head, data[..10 * PAGE]);
            match m.read_upto(&mut buf, 0) {
                Err(Error::Format {
                    path: Some(p),
                    reason,
                }) => {
                    assert_eq!(p, path);
                    assert!(reason.contains("shrank"), "{reason}");
                }
                other => panic!("expected a Format error, got {other:?}"),
            }
            drop(m);
        }
        flush_unmaps();
    }

    #[test]
    fn residency_counts_cached_pages_and_samples_large_ranges() {
        let d = tempfile::tempdir().unwrap();
        let (path, _) = file_with(d.path(), 1 << 20);
        let f = File::open(&path).unwrap();
        let m = FileMap::new(&f, &path).unwrap().unwrap();
        // Just written: in the page cache.
        let r = m.residency(&[(0, 1 << 20)]);
        assert_eq!(r.sampled, 256);
        assert_eq!(r.fraction(), 1.0);
        // Dropped from the cache: none resident (fsync first so it can go).
        f.sync_all().unwrap();
        // SAFETY: advice on our own open file.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let r = m.residency(&[(0, 1 << 20), (4096, 10)]);
        assert_eq!(r.sampled, 257);
        assert!(r.fraction() < 0.5, "{r:?}");
        assert_eq!(m.residency(&[]).fraction(), 1.0);
        // A large range is sampled: about 64k pages looked at.
        let big = d.path().join("big");
        let g = std::fs::File::create(&big).unwrap();
        g.set_len(2 << 30).unwrap(); // sparse: mapping and mincore cost nothing
        let g = File::open(&big).unwrap();
        let mb = FileMap::new(&g, &big).unwrap().unwrap();
        let r = mb.residency(&[(0, 1 << 30), (1 << 30, 1 << 30)]);
        assert!(r.sampled > 60_000 && r.sampled <= 66_000, "{r:?}");
    }

    /// Lines of /proc/self/maps that map `path`.
    fn maps_of(path: &Path) -> Vec<String> {
        let name = path.to_string_lossy().into_owned();
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter(|l| l.ends_with(name.as_str()))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn a_detached_mapping_keeps_its_bytes_when_the_file_changes() {
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = file_with(dir.path(), 3 * PAGE + 100);
        let file = File::open(&path).unwrap();
        // SAFETY: a private writable mapping of the file, as torch makes it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                data.len(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: the mapping above, mapped until the end of the test.
        unsafe { detach(p as usize, data.len(), &path) }.unwrap();
        std::fs::write(&path, vec![0xEEu8; 10]).unwrap(); // rewritten and shrunk
                                                          // SAFETY: the (now anonymous) mapping is still ours, `data.len()` bytes.
        let now = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), data.len()) };
        assert_eq!(now, &data[..]);
        // SAFETY: the mapping above, unmapped once.
        unsafe { libc::munmap(p, data.len()) };
        // SAFETY: a misaligned address is refused before anything is touched.
        let e = unsafe { detach(p as usize + 1, 10, &path) }.unwrap_err();
        assert!(e.to_string().contains("page boundary"), "{e}");
    }

    #[test]
    fn no_mapping_of_a_file_outlives_its_reads() {
        let d = tempfile::tempdir().unwrap();
        for (name, len) in [("small", 3 * PAGE + 5), ("large", DEFER_UNMAP_MIN + PAGE)] {
            let path = d.path().join(name);
            let (path, data) = {
                let f = std::fs::File::create(&path).unwrap();
                f.set_len(len as u64).unwrap();
                (path, vec![0u8; len])
            };
            let f = File::open(&path).unwrap();
            let m = FileMap::new(&f, &path).unwrap().unwrap();
            assert_eq!(maps_of(&path).len(), 1, "{name}: mapped while in use");
            let mut back = vec![1u8; len];
            assert_eq!(m.read_upto(&mut back, 0).unwrap(), len);
            assert_eq!(back, data);
            drop(m);
            flush_unmaps();
            assert_eq!(maps_of(&path), Vec::<String>::new(), "{name}");
            // The next read of the same file maps it anew, and lets go of it too.
            let again = FileMap::new(&f, &path).unwrap().unwrap();
            assert_eq!(again.read_upto(&mut back[..10], 0).unwrap(), 10);
            drop(again);
            flush_unmaps();
            assert!(maps_of(&path).is_empty(), "{name}");
        }
    }

    #[test]
    fn guard_slots_are_released_and_large_maps_unmapped_in_the_background() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("big");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(DEFER_UNMAP_MIN as u64)
            .unwrap();
        let f = File::open(&path).unwrap();
        let m = FileMap::new(&f, &path).unwrap().unwrap();
        let mut b = [1u8; 8];
        m.read_upto(&mut b, 12345).unwrap();
        assert_eq!(b, [0u8; 8]);
        drop(m);
        flush_unmaps();
        assert_eq!(pending_unmaps(), 0);
        // Other tests may hold slots meanwhile; none is leaked by this one.
        assert!(guard::slots_in_use() < 256);
    }
}
