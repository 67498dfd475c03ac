//! Staging: parallel copies of tensor memory (host or device) into host
//! buffers, each pinned on first use.
//!
//! This is what an async checkpoint needs to take a training-safe snapshot:
//! the copy must run near PCIe speed (so device-to-host copies go to pinned
//! memory, from several streams at once), and the first snapshot must not
//! stall on pinning every buffer up front. So a [`HostPin`] registers its
//! memory lazily, inside the copy threads, when the first copy reaches it:
//! the page faults and the pinning of fresh buffers spread over all threads
//! and overlap with the copies into other buffers.
//!
//! A buffer is registered whole, never in pieces: the driver refuses a copy
//! whose host range spans two registrations ("invalid argument"), and the
//! caller's own copies out of a staged tensor (`staged.cuda()`) must work.
//! The page faults of a large buffer are still taken in parallel, before the
//! registration.
//!
//! The memory itself belongs to the caller (in ckptio, a torch storage in
//! anonymous or shared memory); a [`HostPin`] only holds the registration and
//! drops it when it goes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::gpu::cuda::{self, HostRegistration, Stream};
use crate::gpu::Memory;
use crate::io::align;
use crate::io::hugepage;
use crate::workers::Caller;
use crate::{Error, Result};

const PAGE: u64 = 4096;
/// Most threads that fault in one large buffer before it is registered.
const POPULATE_THREADS: usize = 16;

/// Pinning state of a host range the caller owns. Dropping it unregisters it.
pub struct HostPin {
    base: u64,
    len: u64,
    /// Copies into the range are cut on this grid, so that several threads
    /// share a large buffer; its faults are taken in pieces of this size too.
    chunk: u64,
    pin: bool,
    /// `Some` once registered, `None` if registration failed (copies then run
    /// unpinned, just slower).
    reg: OnceLock<Option<HostRegistration>>,
}

impl HostPin {
    /// Describes `[base, base+len)`, pinned whole when a copy first reaches it
    /// (`pin == false`: never pinned); copies into it go in `chunk`-byte pieces.
    ///
    /// # Safety
    /// The range must be host memory, writable by us, that stays mapped until
    /// this value is dropped, and no other registration may cover it.
    pub unsafe fn new(base: u64, len: u64, chunk: u64, pin: bool) -> Result<Self> {
        if len > 0 && base == 0 {
            return Err(Error::invalid("HostPin: null address"));
        }
        if base.checked_add(len).is_none() {
            return Err(Error::invalid("HostPin: range overflows"));
        }
        if chunk == 0 || chunk % PAGE != 0 {
            return Err(Error::invalid(format!(
                "HostPin: chunk size {chunk} is not a positive multiple of {PAGE}"
            )));
        }
        Ok(HostPin {
            base,
            len,
            chunk,
            pin,
            reg: OnceLock::new(),
        })
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes currently page-locked through this pin.
    pub fn pinned_bytes(&self) -> u64 {
        self.reg
            .get()
            .and_then(Option::as_ref)
            .map_or(0, |r| r.len() as u64)
    }

    /// Registers the range if not yet tried (other threads wanting it wait
    /// meanwhile). Returns whether it is pinned.
    fn ensure_pinned(&self) -> bool {
        if !self.pin || self.len == 0 {
            return false;
        }
        let reg = self.reg.get_or_init(|| {
            // Nothing to register with: leave the pages alone.
            cuda::driver().ok()?;
            // Fault the pages in first, in pieces on several threads for a large
            // buffer, instead of inside cuMemHostRegister, which takes them one
            // by one. Best effort: older kernels lack MADV_POPULATE_WRITE, and
            // registration faults the pages in anyway.
            self.populate();
            // SAFETY: the range is the caller's live host memory (contract of
            // `new`), registered once (OnceLock), and the registration is
            // dropped with `self`, before the memory goes.
            unsafe { cuda::host_register(self.base as *mut u8, self.len as usize) }.ok()
        });
        reg.is_some()
    }

    /// MADV_POPULATE_WRITE over the range, a `chunk` per call, on up to
    /// [`POPULATE_THREADS`] threads (fewer on a small host).
    fn populate(&self) {
        let (first, end) = (align::align_down(self.base, PAGE), self.base + self.len);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        hugepage::populate(
            first as usize,
            (end - first) as usize,
            POPULATE_THREADS.min(cores),
            self.chunk as usize,
        );
    }
}

/// Pins every range of `pins` not yet tried, on up to `threads` threads, ahead
/// of the copies (a stager's warm-up, off the training thread's path). Returns
/// the bytes now pinned through `pins`.
pub fn pin_all(pins: &[&HostPin], threads: usize) -> u64 {
    hugepage::for_each_on_threads(pins.len(), threads, |i| {
        pins[i].ensure_pinned();
    });
    pins.iter().map(|p| p.pinned_bytes()).sum()
}

/// Device copies a thread queues before it waits for them (small tensors:
/// one wait for many), or bytes: whichever comes first.
const QUEUED_COPIES: usize = 256;
const QUEUED_BYTES: usize = 256 << 20;

/// Copy `len` bytes from `src` (host or device memory) into `pins[dst]` at `dst_offset`.
#[derive(Clone, Copy, Debug)]
pub struct CopyJob {
    pub src: u64,
    pub memory: Memory,
    pub dst: usize,
    pub dst_offset: u64,
    pub len: u64,
}

/// What a staging copy did.
#[derive(Clone, Debug, Default)]
pub struct CopyStats {
    pub bytes: u64,
    pub device_bytes: u64,
    pub pieces: usize,
    pub threads: usize,
    /// Device bytes that landed in memory the driver could not pin.
    pub unpinned_device_bytes: u64,
}

#[derive(Clone, Copy)]
struct Piece {
    src: u64,
    memory: Memory,
    dst: usize,
    dst_addr: u64,
    len: usize,
}

/// The pieces of `jobs`, each job cut on its destination's chunk grid, in the
/// order the threads take them: every job's first piece, then every job's
/// second, and so on. The first copy into a buffer pins it while the threads
/// wanting its other pieces wait, so this order has the threads pin different
/// buffers at once instead of queueing behind one. Destinations that overlap
/// each other or a host source are refused.
fn plan(pins: &[&HostPin], jobs: &[CopyJob]) -> Result<Vec<Piece>> {
    check_disjoint(pins, jobs)?;
    let mut out = Vec::new();
    for (i, j) in jobs.iter().enumerate() {
        let pin = pins.get(j.dst).ok_or_else(|| {
            Error::invalid(format!("copy {i}: destination {} does not exist", j.dst))
        })?;
        let end = j.dst_offset.checked_add(j.len);
        if end.is_none_or(|e| e > pin.len) {
            return Err(Error::invalid(format!(
                "copy {i}: bytes {}..+{} do not fit the {}-byte destination",
                j.dst_offset, j.len, pin.len
            )));
        }
        if j.len > 0 && j.src == 0 {
            return Err(Error::invalid(format!("copy {i}: null source address")));
        }
        if j.src.checked_add(j.len).is_none() {
            return Err(Error::invalid(format!("copy {i}: source range overflows")));
        }
        let mut off = j.dst_offset;
        let end = j.dst_offset + j.len;
        let mut rank = 0;
        while off < end {
            let stop = (align::align_down(off, pin.chunk) + pin.chunk).min(end);
            let piece = Piece {
                src: j.src + (off - j.dst_offset),
                memory: j.memory,
                dst: j.dst,
                dst_addr: pin.base + off,
                len: (stop - off) as usize,
            };
            out.push((rank, piece));
            rank += 1;
            off = stop;
        }
    }
    out.sort_by_key(|&(rank, _)| rank); // stable: jobs keep their order within a rank
    Ok(out.into_iter().map(|(_, p)| p).collect())
}

/// Refuse jobs whose destinations overlap each other (two threads would write
/// the same bytes) or a host source (a copy would read what another writes),
/// before any copy. It runs before `plan`'s checks of each job: a range that
/// overflows or names no destination is skipped here and refused there.
fn check_disjoint(pins: &[&HostPin], jobs: &[CopyJob]) -> Result<()> {
    // (destination start, end, job), for the jobs with bytes and a destination.
    let mut dst: Vec<(u64, u64, usize)> = jobs
        .iter()
        .enumerate()
        .filter(|(_, j)| j.len > 0)
        .filter_map(|(i, j)| {
            let pin = pins.get(j.dst)?;
            let start = pin.base.checked_add(j.dst_offset)?;
            Some((start, start.checked_add(j.len)?, i))
        })
        .collect();
    dst.sort_unstable();
    for w in dst.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::invalid(format!(
                "copy {}: its destination overlaps that of copy {}",
                w[1].2.max(w[0].2),
                w[1].2.min(w[0].2)
            )));
        }
    }
    for (i, j) in jobs.iter().enumerate() {
        if j.len == 0 || j.memory != Memory::Host {
            continue;
        }
        let Some(end) = j.src.checked_add(j.len) else {
            continue; // refused by `plan`
        };
        // Destinations are disjoint and sorted: only the last one starting
        // before `end` can overlap.
        let k = dst.partition_point(|d| d.0 < end);
        if let Some(&(_, dend, other)) = k.checked_sub(1).map(|k| &dst[k]) {
            if dend > j.src {
                return Err(Error::invalid(format!(
                    "copy {i}: its source overlaps the destination of copy {other}"
                )));
            }
        }
    }
    Ok(())
}

/// Runs `jobs` as `threads` tasks on the worker threads (host copies on the
/// caller's thread too): device pieces as async copies on a stream per task
/// and device (into pinned buffers where the driver allows; waited
/// for every [`QUEUED_COPIES`] copies or [`QUEUED_BYTES`] bytes), host pieces
/// as memcpy. Returns when every byte has landed; the first error wins.
///
/// # Safety
/// Each source range must be readable memory of its kind that nobody frees or
/// writes for the whole call, and nobody else may touch the destinations
/// during the call. (Destinations that overlap each other or a host source are
/// refused.)
pub unsafe fn copy_to_host(
    pins: &[&HostPin],
    jobs: &[CopyJob],
    threads: usize,
) -> Result<CopyStats> {
    let pieces = plan(pins, jobs)?;
    let threads = threads.clamp(1, pieces.len().max(1));
    let mut stats = CopyStats {
        bytes: jobs.iter().map(|j| j.len).sum(),
        device_bytes: jobs
            .iter()
            .filter(|j| j.memory != Memory::Host)
            .map(|j| j.len)
            .sum(),
        pieces: pieces.len(),
        threads,
        unpinned_device_bytes: 0,
    };
    if pieces.is_empty() {
        return Ok(stats);
    }
    let next = AtomicUsize::new(0);
    let unpinned = AtomicUsize::new(0);
    let first_error = crate::sync::FirstError::default();
    // Device copies make a CUDA context current on the thread that queues
    // them: those run on pool threads only, never on the caller's.
    let caller = if jobs.iter().all(|j| j.memory == Memory::Host) {
        Caller::Helps
    } else {
        Caller::Waits
    };
    crate::workers::run(threads, caller, |_| {
        let mut streams: Vec<Stream> = Vec::new();
        // Device copies queued on this task's streams since the last wait:
        // many small tensors cost a queued copy each, not a round trip.
        let mut queued = (0usize, 0usize);
        let r = (|| -> Result<()> {
            while !first_error.failed() {
                let Some(p) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    break;
                };
                match p.memory {
                    Memory::Host => {
                        // SAFETY: both ranges are valid and disjoint (caller's
                        // contract; `plan` kept the destination inside its pin
                        // and refused overlaps).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                p.src as *const u8,
                                p.dst_addr as *mut u8,
                                p.len,
                            )
                        }
                    }
                    Memory::Cuda(dev) => {
                        if !pins[p.dst].ensure_pinned() {
                            unpinned.fetch_add(p.len, Ordering::Relaxed);
                        }
                        let k = match streams.iter().position(|s| s.device() == dev) {
                            Some(k) => k,
                            None => {
                                streams.push(Stream::new(dev)?);
                                streams.len() - 1
                            }
                        };
                        let st = &streams[k];
                        cuda::driver()?.make_current(dev)?;
                        // SAFETY: source is live device memory and the
                        // destination is ours until the sync below.
                        unsafe {
                            cuda::driver()?.memcpy_dtoh_async(
                                p.dst_addr as *mut u8,
                                p.src,
                                p.len,
                                st,
                            )?
                        };
                        queued = (queued.0 + 1, queued.1 + p.len);
                        if queued.0 >= QUEUED_COPIES || queued.1 >= QUEUED_BYTES {
                            for st in &streams {
                                st.synchronize()?;
                            }
                            queued = (0, 0);
                        }
                    }
                }
            }
            Ok(())
        })();
        // Every copy queued has landed (or failed) before the task ends:
        // none may outlive the call.
        let waited = streams.iter().try_for_each(Stream::synchronize);
        if let Err(e) = r.and(waited) {
            first_error.set(e);
        }
    });
    if let Some(e) = first_error.into_inner() {
        return Err(e);
    }
    stats.unpinned_device_bytes = unpinned.into_inner() as u64;
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pin_of(buf: &mut [u8], chunk: u64) -> HostPin {
        // SAFETY: `buf` outlives the pin in each test.
        unsafe { HostPin::new(buf.as_mut_ptr() as u64, buf.len() as u64, chunk, false) }.unwrap()
    }

    #[test]
    fn host_copies_land_at_their_offsets() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        // Copies are cut on each destination's chunk grid.
        let mut a = crate::io::align::AlignedBuf::new(70_000, 4096).unwrap();
        let mut b = vec![0u8; 40_000];
        let (pa, pb) = (pin_of(a.as_mut_slice(), 8192), pin_of(&mut b, 4096));
        let jobs = [
            CopyJob {
                src: src.as_ptr() as u64,
                memory: Memory::Host,
                dst: 0,
                dst_offset: 5,
                len: 60_000,
            },
            CopyJob {
                src: src.as_ptr() as u64 + 60_000,
                memory: Memory::Host,
                dst: 1,
                dst_offset: 0,
                len: 40_000,
            },
        ];
        // SAFETY: all ranges are live vectors, disjoint.
        let st = unsafe { copy_to_host(&[&pa, &pb], &jobs, 4) }.unwrap();
        assert_eq!(st.bytes, 100_000);
        assert_eq!(st.pieces, 8 + 10);
        // Each destination's first piece comes before any second one.
        let order: Vec<usize> = plan(&[&pa, &pb], &jobs)
            .unwrap()
            .iter()
            .map(|p| p.dst)
            .collect();
        assert_eq!(&order[..4], &[0, 1, 0, 1]);
        drop((pa, pb));
        assert_eq!(&a.as_slice()[5..60_005], &src[..60_000]);
        assert_eq!(&b[..], &src[60_000..]);
    }

    #[test]
    fn pinning_registers_the_whole_range_and_keeps_its_bytes() {
        // Five chunks, faulted in on several threads, then one registration
        // (none without a CUDA driver), for a page-aligned range and one that
        // starts and ends inside pages; the contents stay as they were.
        let mut a = crate::io::align::AlignedBuf::new(6 * 8192, 4096).unwrap();
        for (i, b) in a.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 253) as u8;
        }
        for (skip, len) in [(0, 5 * 8192 + 100), (100, 5 * 8192)] {
            let base = a.as_mut_slice().as_mut_ptr() as u64 + skip;
            // SAFETY: `a` outlives the pin, and no other registration covers it.
            let p = unsafe { HostPin::new(base, len, 8192, true) }.unwrap();
            let n = pin_all(&[&p], 4);
            assert!(n == 0 || n == len, "{n}");
            assert_eq!(p.pinned_bytes(), n);
            assert_eq!(n > 0, cuda::driver().is_ok());
        }
        let kept = |(i, &b): (usize, &u8)| b == (i % 253) as u8;
        assert!(a.as_slice().iter().enumerate().all(kept));
    }

    #[test]
    fn bad_jobs_are_typed_errors() {
        let mut a = vec![0u8; 4096];
        let pa = pin_of(&mut a, 4096);
        let src = [1u8; 8];
        let job = |dst, dst_offset, len, s| CopyJob {
            src: s,
            memory: Memory::Host,
            dst,
            dst_offset,
            len,
        };
        for j in [
            job(1, 0, 8, src.as_ptr() as u64),
            job(0, 4090, 8, src.as_ptr() as u64),
            job(0, u64::MAX, 8, src.as_ptr() as u64),
            job(0, 0, 8, 0),
        ] {
            // SAFETY: rejected before any copy.
            let e = unsafe { copy_to_host(&[&pa], &[j], 2) }.unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        }
        // Destinations overlapping each other, or a source.
        let mut b = vec![0u8; 4096];
        let pb = pin_of(&mut b, 4096);
        let inside = b.as_ptr() as u64 + 100;
        for (jobs, needle) in [
            (
                vec![
                    job(0, 0, 8, src.as_ptr() as u64),
                    job(0, 4, 8, src.as_ptr() as u64),
                ],
                "copy 1: its destination overlaps that of copy 0",
            ),
            (
                vec![job(1, 0, 8, src.as_ptr() as u64), job(1, 96, 8, inside)],
                "copy 1: its source overlaps the destination of copy 1",
            ),
            (
                vec![
                    job(0, 0, 8, inside - 4),
                    job(1, 0, 200, src.as_ptr() as u64),
                ],
                "copy 0: its source overlaps the destination of copy 1",
            ),
        ] {
            // SAFETY: rejected before any copy.
            let e = unsafe { copy_to_host(&[&pa, &pb], &jobs, 2) }.unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }
        // Touching is fine, and so is an empty copy anywhere.
        let ok = [
            job(1, 0, 8, src.as_ptr() as u64),
            job(1, 8, 8, src.as_ptr() as u64),
            job(1, 50, 0, inside),
        ];
        // SAFETY: `src` and `b` outlive the call; the copies are disjoint.
        unsafe { copy_to_host(&[&pa, &pb], &ok, 2) }.unwrap();
        drop(pb);
        assert_eq!(&b[..16], &[1u8; 16]);
        // SAFETY: nothing is registered for a null, empty range.
        assert!(unsafe { HostPin::new(0, 8, 4096, true) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { HostPin::new(4096, 8, 100, true) }.is_err());
    }
}
