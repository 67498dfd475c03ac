//! Huge pages for ckptio's large host allocations.
//!
//! Fresh memory costs a page fault per page on its first touch, and with 4 KiB
//! pages those faults cost as much as the copy that fills the memory: on the
//! H200 host 16 threads fault 4 GiB in at 22 GiB/s with 4 KiB pages and at
//! 52 GiB/s with 2 MiB ones; on a 2-core development machine 1.6-1.9 against
//! 6.7 GiB/s. Both hosts run transparent huge pages in `madvise` mode: memory
//! gets huge pages only when it asks, with `madvise(MADV_HUGEPAGE)` before it is
//! first touched. [`AnonMap`] is such memory (private, anonymous), for the
//! engine's buffers and the pinned pools; the Python side asks the same way for
//! the host storages of a load and for private staging buffers.
//!
//! Shared memory (memfds, /dev/shm) gets huge pages only where
//! `/sys/kernel/mm/transparent_hugepage/shmem_enabled` allows it; on both hosts
//! it reads `never`. [`probe`] says what this host does, for `ckptio info`.
//!
//! One kind of host makes fresh huge pages slow: a VM whose guest hands free
//! 2 MiB blocks back to its hypervisor (virtio-balloon free page reporting, as
//! on the Firecracker development VMs). A huge page then comes from memory the
//! host must back again, and on such a VM 1 GiB of fresh huge pages faulted in
//! at 0.3-0.7 GiB/s against 2.8-3.4 for 4 KiB pages (which come from small free
//! blocks the host still backs); huge pages freed a moment before faulted in at
//! 10-22 GiB/s. There the advice is not given unless asked for.
//!
//! `CKPTIO_HUGE_PAGES`: `auto` (default: huge pages asked for, except under free
//! page reporting), `on` (always asked for), `off`/`0` (never: 4 KiB pages).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use crate::workers::Caller;
use crate::{Error, Result};

/// The size of a transparent huge page (x86-64 and most arm64 kernels).
pub const HUGE_PAGE: usize = 2 << 20;
const PAGE: usize = 4096;
/// madvise(2) advice that prefaults pages writable (Linux 5.14).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// `CKPTIO_HUGE_PAGES`: auto (None), on (Some(true)) or off (Some(false)).
fn advice_setting() -> Option<bool> {
    match std::env::var("CKPTIO_HUGE_PAGES")
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
        .as_str()
    {
        "0" | "off" | "false" | "no" => Some(false),
        "1" | "on" | "true" | "yes" => Some(true),
        _ => None,
    }
}

/// Whether ckptio asks for huge pages: `CKPTIO_HUGE_PAGES` (on/off), else
/// unless [`free_page_reporting`]. Read on every allocation, so a test can
/// turn it off.
pub fn advice_enabled() -> bool {
    advice_setting().unwrap_or_else(|| !free_page_reporting())
}

/// Whether this host hands free 2 MiB blocks back to a hypervisor: a
/// virtio-balloon device with free page reporting (feature bit 5), reporting
/// blocks of at most a huge page (`page_reporting_order` <= 9).
pub fn free_page_reporting() -> bool {
    static FOUND: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FOUND.get_or_init(|| {
        let order =
            std::fs::read_to_string("/sys/module/page_reporting/parameters/page_reporting_order")
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok());
        if order.is_some_and(|o| o > 9) {
            return false;
        }
        let Ok(devs) = std::fs::read_dir("/sys/bus/virtio/drivers/virtio_balloon") else {
            return false;
        };
        devs.flatten().any(|d| {
            std::fs::read_to_string(d.path().join("features"))
                .is_ok_and(|f| f.as_bytes().get(5) == Some(&b'1'))
        })
    })
}

/// The selected word of a sysfs THP setting (`always [madvise] never` -> "madvise").
fn sysfs_choice(path: &str) -> Option<String> {
    let s = std::fs::read_to_string(path).ok()?;
    let start = s.find('[')? + 1;
    let end = start + s[start..].find(']')?;
    Some(s[start..end].to_string())
}

/// `/sys/kernel/mm/transparent_hugepage/enabled`: "always", "madvise" or "never".
pub fn thp_enabled() -> Option<String> {
    sysfs_choice("/sys/kernel/mm/transparent_hugepage/enabled")
}

/// `/sys/kernel/mm/transparent_hugepage/shmem_enabled`: "always", "within_size",
/// "advise", "never", "deny" or "force".
pub fn shmem_enabled() -> Option<String> {
    sysfs_choice("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
}

/// Whether private anonymous memory that asks gets huge pages on this host.
pub fn private_huge_possible() -> bool {
    matches!(thp_enabled().as_deref(), Some("always" | "madvise"))
}

/// Whether shared memory (memfd, tmpfs) that asks gets huge pages on this host.
pub fn shared_huge_possible() -> bool {
    matches!(
        shmem_enabled().as_deref(),
        Some("always" | "within_size" | "advise" | "force")
    )
}

/// Bytes held in [`AnonMap`]s right now (for tests and reports).
static MAPPED: AtomicUsize = AtomicUsize::new(0);

/// Host bytes ckptio holds in its own anonymous mappings (engine staging
/// buffers, pinned pools).
pub fn mapped_bytes() -> usize {
    MAPPED.load(Ordering::Relaxed)
}

/// Private anonymous memory, zero-filled, page aligned, unmapped on drop. With
/// `huge`, the mapping starts on a huge-page boundary and is advised
/// MADV_HUGEPAGE before anything touches it, so that its whole huge pages are
/// faulted in 2 MiB at a time (the tail past the last whole one uses 4 KiB pages).
pub struct AnonMap {
    ptr: *mut u8,
    len: usize,
    /// The mapping's own length (`len` rounded up to whole pages).
    map_len: usize,
    huge: bool,
}

impl std::fmt::Debug for AnonMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnonMap")
            .field("len", &self.len)
            .field("huge", &self.huge)
            .finish()
    }
}

// SAFETY: AnonMap owns its mapping exclusively, like a Vec<u8>.
unsafe impl Send for AnonMap {}
// SAFETY: shared references only give out `&[u8]` and a const pointer.
unsafe impl Sync for AnonMap {}

/// A fresh private anonymous mapping of `len` bytes (read and write), the
/// caller's to unmap.
pub(crate) fn map_anonymous(len: usize) -> std::io::Result<*mut libc::c_void> {
    // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(raw)
}

impl AnonMap {
    /// `len` bytes (at least one page); huge pages asked for when `huge`, the
    /// size is at least one huge page, and [`advice_enabled`].
    pub fn new(len: usize, huge: bool) -> Result<Self> {
        Self::with_advice(len, huge && advice_enabled())
    }

    /// [`AnonMap::new`] with the advice given when `huge` and the size is at
    /// least one huge page, whatever [`advice_enabled`] says.
    pub fn with_advice(len: usize, huge: bool) -> Result<Self> {
        let map_len = len.max(1).div_ceil(PAGE) * PAGE;
        let huge = huge && map_len >= HUGE_PAGE;
        // A huge-page boundary: reserve one huge page more, then give back the
        // head and tail around the aligned range.
        let reserve = if huge { map_len + HUGE_PAGE } else { map_len };
        let raw =
            map_anonymous(reserve).map_err(|e| Error::io("mmap anonymous memory", None, e))?;
        let raw = raw as usize;
        let ptr = if huge {
            let start = raw.next_multiple_of(HUGE_PAGE);
            let (head, tail) = (start - raw, reserve - (start - raw) - map_len);
            // SAFETY: both ranges are parts of the reservation just made, outside
            // [start, start + map_len), and nothing uses them.
            unsafe {
                if head > 0 {
                    libc::munmap(raw as *mut libc::c_void, head);
                }
                if tail > 0 {
                    libc::munmap((start + map_len) as *mut libc::c_void, tail);
                }
                // Advice, not a demand: where THP is off it changes nothing.
                libc::madvise(start as *mut libc::c_void, map_len, libc::MADV_HUGEPAGE);
            }
            start
        } else {
            raw
        };
        MAPPED.fetch_add(map_len, Ordering::Relaxed);
        Ok(AnonMap {
            ptr: ptr as *mut u8,
            len,
            map_len,
            huge,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether MADV_HUGEPAGE was given (not whether the kernel granted it).
    pub fn huge_advised(&self) -> bool {
        self.huge
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `map_len >= len` zero-initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Fault every page in now, in pieces of `piece` bytes on up to `threads`
    /// threads: cheaper than one fault per page later (and than the one-by-one
    /// faults of a cuMemHostRegister of untouched memory).
    pub fn populate(&self, threads: usize, piece: usize) {
        populate(self.ptr as usize, self.map_len, threads, piece);
    }
}

/// MADV_POPULATE_WRITE over `[addr, addr+len)` (page aligned, writable memory
/// the caller owns) in `piece`-byte calls on up to `threads` threads; where the
/// kernel lacks it (before 5.14), one write per page instead.
pub fn populate(addr: usize, len: usize, threads: usize, piece: usize) {
    let piece = piece.max(HUGE_PAGE);
    let pieces = len.div_ceil(piece);
    for_each_on_threads(pieces, threads, |i| {
        let start = addr + i * piece;
        let n = piece.min(addr + len - start);
        // SAFETY: the range lies in the caller's writable memory; the advice
        // faults its pages in without changing their contents.
        let rc = unsafe { libc::madvise(start as *mut libc::c_void, n, MADV_POPULATE_WRITE) };
        if rc != 0 {
            for p in (start..start + n).step_by(PAGE) {
                // SAFETY: as above; rewriting a byte with its own value.
                unsafe {
                    let b = p as *mut u8;
                    b.write_volatile(b.read_volatile());
                }
            }
        }
    });
}

/// Runs `f(0..n)` on up to `threads` threads (the worker threads, this one
/// included), each taking the next index until none is left.
pub fn for_each_on_threads(n: usize, threads: usize, f: impl Fn(usize) + Sync) {
    let next = AtomicUsize::new(0);
    crate::workers::run(threads.clamp(1, n.max(1)), Caller::Helps, |_| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
    });
}

impl Drop for AnonMap {
    fn drop(&mut self) {
        MAPPED.fetch_sub(self.map_len, Ordering::Relaxed);
        // SAFETY: the mapping was made in `new` with this length, is unmapped
        // once, and no borrow of it outlives `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.map_len) };
    }
}

/// Bytes of the mapping that starts at `addr` that sit in huge pages, from
/// /proc/self/smaps (`AnonHugePages` for private memory, `ShmemPmdMapped` /
/// `FilePmdMapped` for shared memory). None where smaps cannot tell.
pub fn huge_bytes_at(addr: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let head = format!("{addr:x}-");
    let mut lines = smaps.lines();
    lines.find(|l| l.starts_with(&head))?;
    let mut total = 0u64;
    for l in lines {
        // The next mapping's header: "start-end perms ...".
        if l.split_whitespace().next().is_some_and(|w| w.contains('-')) {
            break;
        }
        let mut it = l.split_whitespace();
        if let (Some(k), Some(v)) = (it.next(), it.next()) {
            if matches!(k, "AnonHugePages:" | "ShmemPmdMapped:" | "FilePmdMapped:") {
                total += v.parse::<u64>().unwrap_or(0) * 1024;
            }
        }
    }
    Some(total)
}

/// What this host does with huge pages, for `ckptio info`.
#[derive(Clone, Debug, Default)]
pub struct Probe {
    /// `transparent_hugepage/enabled` and `shmem_enabled` (None: no THP here).
    pub enabled: Option<String>,
    pub shmem_enabled: Option<String>,
    /// ckptio asks for huge pages ([`advice_enabled`]).
    pub advice: bool,
    /// The VM hands free huge-page blocks back to its host ([`free_page_reporting`]).
    pub free_page_reporting: bool,
    /// Private / shared memory that asked got huge pages (a 16 MiB test).
    pub private_huge: bool,
    pub shared_huge: bool,
    /// Fault-in speed of fresh memory, GiB/s, one thread, 64 MiB: private with
    /// 4 KiB pages, private with huge pages (advice on), shared (a memfd, advised).
    pub private_4k_gib_s: f64,
    pub private_huge_gib_s: f64,
    pub shared_gib_s: f64,
}

fn fault_in_rate(addr: usize, len: usize) -> f64 {
    let t0 = Instant::now();
    populate(addr, len, 1, len);
    len as f64 / (1u64 << 30) as f64 / t0.elapsed().as_secs_f64().max(1e-9)
}

/// Measure what huge pages do here: a few 64 MiB mappings faulted in (~0.1 s).
pub fn probe() -> Probe {
    const N: usize = 64 << 20;
    let mut p = Probe {
        enabled: thp_enabled(),
        shmem_enabled: shmem_enabled(),
        advice: advice_enabled(),
        free_page_reporting: free_page_reporting(),
        ..Probe::default()
    };
    if let Ok(m) = AnonMap::new(N, false) {
        p.private_4k_gib_s = fault_in_rate(m.as_ptr() as usize, N);
    }
    if let Ok(m) = AnonMap::with_advice(N, true) {
        p.private_huge_gib_s = fault_in_rate(m.as_ptr() as usize, N);
        p.private_huge = huge_bytes_at(m.as_ptr() as usize).unwrap_or(0) > 0;
    }
    if let Some((rate, huge)) = shared_fault_in(N, true) {
        p.shared_gib_s = rate;
        p.shared_huge = huge;
    }
    p
}

/// A memfd of `len` bytes, mapped shared, advised MADV_HUGEPAGE when `advise`,
/// faulted in: (GiB/s, whether it got huge pages).
fn shared_fault_in(len: usize, advise: bool) -> Option<(f64, bool)> {
    // SAFETY: a NUL-terminated name; the fd is owned by the File below.
    let fd = unsafe { libc::memfd_create(c"ckptio-probe".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    file.set_len(len as u64).ok()?;
    // SAFETY: maps the memfd just sized; unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    if advise {
        // SAFETY: advice on our own fresh mapping.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
    }
    let rate = fault_in_rate(p as usize, len);
    let huge = huge_bytes_at(p as usize).unwrap_or(0) > 0;
    // SAFETY: the mapping made above, unmapped once.
    unsafe { libc::munmap(p, len) };
    Some((rate, huge))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anon_maps_are_zeroed_aligned_and_accounted() {
        for (len, huge) in [(1, false), (4097, true), (3 << 20, true), (5 << 20, false)] {
            let mut m = AnonMap::new(len, huge).unwrap();
            assert_eq!(m.len(), len);
            assert_eq!(m.as_ptr() as usize % PAGE, 0);
            assert!(m.as_slice().iter().all(|&b| b == 0));
            m.as_mut_slice()[len - 1] = 9;
            assert_eq!(m.as_slice()[len - 1], 9);
            if m.huge_advised() {
                assert_eq!(m.as_ptr() as usize % HUGE_PAGE, 0);
                assert!(len >= HUGE_PAGE);
            }
            m.populate(2, HUGE_PAGE);
            assert_eq!(m.as_slice()[len - 1], 9);
            // Other tests map and unmap meanwhile: only this map's share is sure.
            assert!(mapped_bytes() >= len);
        }
        // Small maps never ask for huge pages.
        assert!(!AnonMap::new(PAGE, true).unwrap().huge_advised());
    }

    #[test]
    fn huge_page_advice_is_recorded_where_the_host_allows_it() {
        let m = AnonMap::new(8 << 20, true).unwrap();
        m.populate(1, 8 << 20);
        let huge = huge_bytes_at(m.as_ptr() as usize);
        // smaps finds the mapping; it holds huge pages only where THP may hand them out.
        assert!(huge.is_some());
        assert_eq!(m.huge_advised(), advice_enabled());
        if !private_huge_possible() || !advice_enabled() {
            assert_eq!(huge, Some(0));
        }
    }

    #[test]
    fn sysfs_choices_parse() {
        if let Some(e) = thp_enabled() {
            assert!(["always", "madvise", "never"].contains(&e.as_str()), "{e}");
        }
        let p = probe();
        assert!(p.private_4k_gib_s > 0.0);
        assert!(!p.private_huge || private_huge_possible());
        assert!(!p.shared_huge || shared_huge_possible());
    }
}
