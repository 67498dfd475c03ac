//! Staging: parallel copies of tensor memory (host or device) into host
//! buffers, pinned chunk by chunk on first use.
//!
//! This is what an async checkpoint needs to take a training-safe snapshot:
//! the copy must run near PCIe speed (so device-to-host copies go to pinned
//! memory, from several streams at once), and the first snapshot must not
//! stall on pinning a multi-GiB buffer up front. So a [`HostPin`] registers its
//! memory lazily, one chunk per registration, inside the copy threads: the
//! page faults and the pinning of a fresh buffer spread over all threads and
//! overlap with the copies of other chunks.
//!
//! The memory itself belongs to the caller (in ckptio, a torch storage in
//! anonymous or shared memory); a [`HostPin`] only holds the registrations and
//! drops them when it goes.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::align;
use crate::cuda::{self, HostRegistration, Stream};
use crate::engine::Memory;
use crate::{Error, Result};

const PAGE: u64 = 4096;
/// madvise(2) advice that prefaults pages writable (Linux 5.14).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Pinning state of a host range the caller owns. Dropping it unregisters
/// every chunk it registered.
pub struct HostPin {
    base: u64,
    len: u64,
    chunk: u64,
    pin: bool,
    /// One slot per chunk: `Some` once registered, `None` if registration failed
    /// (the copy then runs unpinned, just slower).
    regs: Vec<OnceLock<Option<HostRegistration>>>,
}

impl HostPin {
    /// Describes `[base, base+len)`, to be pinned in `chunk`-byte pieces as copies
    /// reach them (`pin == false`: never pinned).
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
        // Chunks of a range that does not start on a page would share pages
        // with their neighbours, which the driver refuses: register it whole.
        let chunk = if base % PAGE == 0 { chunk } else { len.max(1) };
        let n = len.div_ceil(chunk) as usize;
        Ok(HostPin {
            base,
            len,
            chunk,
            pin,
            regs: (0..n).map(|_| OnceLock::new()).collect(),
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
        self.regs
            .iter()
            .filter_map(|r| r.get().and_then(Option::as_ref))
            .map(|r| r.len() as u64)
            .sum()
    }

    /// Registers chunk `i` if not yet tried. Returns whether it is pinned.
    fn ensure_pinned(&self, i: usize) -> bool {
        if !self.pin {
            return false;
        }
        let reg = self.regs[i].get_or_init(|| {
            let start = i as u64 * self.chunk;
            let len = self.chunk.min(self.len - start) as usize;
            let ptr = (self.base + start) as *mut libc::c_void;
            // Fault the pages in here, in this copy thread, before the driver pins
            // them: page faults of a fresh buffer then spread over all threads
            // instead of running inside cuMemHostRegister. Best effort: older
            // kernels lack MADV_POPULATE_WRITE and registration faults them anyway.
            // SAFETY: the range is the caller's live, writable host memory.
            let _ = unsafe { libc::madvise(ptr, len, MADV_POPULATE_WRITE) };
            // SAFETY: the range is part of the caller's live host range
            // (contract of `new`), registered once (OnceLock), and the
            // registration is dropped with `self`, before the memory goes.
            unsafe { cuda::host_register((self.base + start) as *mut u8, len) }.ok()
        });
        reg.is_some()
    }
}

/// Pins every chunk of `pins` not yet tried, on up to `threads` threads, ahead
/// of the copies (a stager's warm-up, off the training thread's path). Returns
/// the bytes now pinned through `pins`.
pub fn pin_all(pins: &[&HostPin], threads: usize) -> u64 {
    let work: Vec<(usize, usize)> = pins
        .iter()
        .enumerate()
        .filter(|(_, p)| p.pin)
        .flat_map(|(k, p)| (0..p.regs.len()).map(move |i| (k, i)))
        .collect();
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, work.len().max(1)) {
            s.spawn(|| {
                while let Some(&(k, i)) = work.get(next.fetch_add(1, Ordering::Relaxed)) {
                    pins[k].ensure_pinned(i);
                }
            });
        }
    });
    pins.iter().map(|p| p.pinned_bytes()).sum()
}

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
    chunk: usize,
    dst_addr: u64,
    len: usize,
}

fn plan(pins: &[&HostPin], jobs: &[CopyJob]) -> Result<Vec<Piece>> {
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
        while off < end {
            let stop = (align::align_down(off, pin.chunk) + pin.chunk).min(end);
            out.push(Piece {
                src: j.src + (off - j.dst_offset),
                memory: j.memory,
                dst: j.dst,
                chunk: (off / pin.chunk) as usize,
                dst_addr: pin.base + off,
                len: (stop - off) as usize,
            });
            off = stop;
        }
    }
    Ok(out)
}

/// Runs `jobs` on `threads` threads: device pieces as async copies on a stream
/// per thread and device (into pinned chunks where the driver allows), host
/// pieces as memcpy. Returns when every byte has landed; the first error wins.
///
/// # Safety
/// Each source range must be readable memory of its kind that nobody frees or
/// writes for the whole call; destination ranges must not overlap each other
/// or any source, and nobody else may touch them during the call.
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
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut streams: Vec<Stream> = Vec::new();
                let r = (|| -> Result<()> {
                    while !failed.load(Ordering::Relaxed) {
                        let Some(p) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) else {
                            break;
                        };
                        match p.memory {
                            Memory::Host => {
                                // SAFETY: both ranges are valid and disjoint (caller's
                                // contract; `plan` kept the destination inside its pin).
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        p.src as *const u8,
                                        p.dst_addr as *mut u8,
                                        p.len,
                                    )
                                }
                            }
                            Memory::Cuda(dev) => {
                                if !pins[p.dst].ensure_pinned(p.chunk) {
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
                                st.synchronize()?;
                            }
                        }
                    }
                    Ok(())
                })();
                if let Err(e) = r {
                    failed.store(true, Ordering::Relaxed);
                    let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                    slot.get_or_insert(e);
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
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
        // Page-aligned destinations are cut on the chunk grid; a plain Vec is one chunk.
        let mut a = crate::align::AlignedBuf::new(70_000, 4096).unwrap();
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
        assert_eq!(st.pieces, 8 + 1);
        drop((pa, pb));
        assert_eq!(&a.as_slice()[5..60_005], &src[..60_000]);
        assert_eq!(&b[..], &src[60_000..]);
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
        // SAFETY: nothing is registered for a null, empty range.
        assert!(unsafe { HostPin::new(0, 8, 4096, true) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { HostPin::new(4096, 8, 100, true) }.is_err());
    }
}
