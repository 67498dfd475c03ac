//! Staging: parallel copies of tensor memory (host or device) into host
//! buffers, each pinned (page-locked) before the first device copy into it.
//!
//! This is what an async checkpoint needs to take a training-safe snapshot:
//! the copy must run near PCIe speed (so device-to-host copies go to pinned
//! memory, from several streams at once), and the first snapshot, whose
//! buffers are fresh memory, must cost little more than faulting that memory
//! in and registering it with the driver. Those two costs behave differently
//! (H200 host, 8 GiB): faulting in scales with threads (16 threads: 22 GiB/s
//! with 4 KiB pages, 52 with huge pages), while cuMemHostRegister of faulted
//! memory is serial in the driver (0.2-0.38 s, no faster on 16 threads than
//! on one), and the copies themselves take 0.16 s.
//!
//! So a staging whose buffers are not pinned yet runs as a pipeline
//! ([`Pipeline`]): every copy thread faults in the new buffers piece by piece,
//! in the order their copies come; one thread at a time registers them in that
//! order, each as soon as its last piece is in; and copies into a buffer start
//! once it is registered. Fault-in, registration and copies overlap, and the
//! serial registration never waits behind a copy thread's own fault-in. (The
//! design before it pinned each buffer inside the copy thread that first
//! reached it: one thread faulted a buffer in alone, however large, while the
//! threads wanting its other pieces waited; `CKPTIO_STAGING_PIPELINE=off`
//! brings it back for A/B measurements.)
//!
//! A buffer is registered whole, never in pieces: the driver refuses a copy
//! whose host range spans two registrations ("invalid argument"), and the
//! caller's own copies out of a staged tensor (`staged.cuda()`) must work.
//!
//! The memory itself belongs to the caller (in ckptio, a torch storage in
//! anonymous or shared memory); a [`HostPin`] only holds the registration and
//! drops it when it goes.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

use crate::gpu::cuda::{self, HostRegistration, Stream};
use crate::gpu::Memory;
use crate::io::align;
use crate::io::hugepage;
use crate::workers::Caller;
use crate::{Error, Result};

const PAGE: u64 = 4096;
/// Most threads that fault in one large buffer before it is registered
/// (the unpipelined design only).
const POPULATE_THREADS: usize = 16;
/// A pipeline faults memory in by calls of this size, on a grid of it: a
/// 16 MiB buffer is faulted in by two threads at once, and a buffer's
/// registration can start a few milliseconds after its first piece.
const FAULT_PIECE: u64 = 8 << 20;
/// Longest a pipeline thread with nothing to do sleeps before it looks again
/// (each registration wakes it; this only bounds a missed wake-up).
const IDLE_WAIT: Duration = Duration::from_millis(1);

/// `CKPTIO_STAGING_PIPELINE`: `on` (default) runs a staging with buffers to
/// pin as a [`Pipeline`]; `off` pins each buffer in the copy thread that first
/// reaches it, the design before the pipeline (kept to compare the two).
pub fn pipelined() -> Result<bool> {
    let Ok(v) = std::env::var("CKPTIO_STAGING_PIPELINE") else {
        return Ok(true);
    };
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "1" | "on" | "true" | "yes" => Ok(true),
        "0" | "off" | "false" | "no" => Ok(false),
        _ => Err(Error::invalid(format!(
            "CKPTIO_STAGING_PIPELINE: expected on or off, not {v:?}"
        ))),
    }
}

/// Pinning state of a host range the caller owns. Dropping it unregisters it.
pub struct HostPin {
    base: u64,
    len: u64,
    /// Copies into the range are cut on this grid, so that several threads
    /// share a large buffer.
    chunk: u64,
    pin: bool,
    /// `Some` once registered, `None` if registration failed (copies then run
    /// unpinned, just slower).
    reg: OnceLock<Option<HostRegistration>>,
}

impl HostPin {
    /// Describes `[base, base+len)`, pinned whole before the first device copy
    /// into it (`pin == false`: never pinned); copies into it go in `chunk`-byte pieces.
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

    fn is_pinned(&self) -> bool {
        self.reg.get().is_some_and(Option::is_some)
    }

    /// Whether the range is to be pinned and registration was not tried yet.
    fn wants_pin(&self) -> bool {
        self.pin && self.len > 0 && self.reg.get().is_none()
    }

    /// Registers the range if not yet tried (other threads wanting it wait
    /// meanwhile), its pages faulted in first on up to [`POPULATE_THREADS`]
    /// threads; with `timers`, the time each step took. Returns whether it is
    /// pinned. The unpipelined design.
    fn ensure_pinned(&self, timers: Option<&Timers>) -> bool {
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
            let t = Instant::now();
            self.populate();
            let t = timers.map_or(t, |c| c.add(&c.fault, t));
            let reg = self.register();
            if let Some(c) = timers {
                c.registered(t);
            }
            reg
        });
        reg.is_some()
    }

    /// Registers the range if not yet tried, without faulting it in first (a
    /// [`Pipeline`] has). Returns whether it is pinned.
    fn register_now(&self) -> bool {
        if !self.pin || self.len == 0 {
            return false;
        }
        self.reg
            .get_or_init(|| {
                cuda::driver().ok()?;
                self.register()
            })
            .is_some()
    }

    fn register(&self) -> Option<HostRegistration> {
        // SAFETY: the range is the caller's live host memory (contract of
        // `new`), registered once (callers run inside the OnceLock's
        // initialisation), and the registration is dropped with `self`,
        // before the memory goes.
        unsafe { cuda::host_register(self.base as *mut u8, self.len as usize) }.ok()
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

    /// The range's fault-in calls (address, bytes) on the [`FAULT_PIECE`] grid,
    /// whole pages (the first and last may reach past the range into the
    /// pages it starts and ends in, which are the caller's too).
    fn fault_pieces(&self) -> impl Iterator<Item = (u64, u64)> {
        let first = align::align_down(self.base, PAGE);
        let end = align::align_up(self.base + self.len, PAGE);
        let mut at = first;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let stop = (align::align_down(at, FAULT_PIECE) + FAULT_PIECE).min(end);
            let piece = (at, stop - at);
            at = stop;
            Some(piece)
        })
    }
}

/// Where a staging call's time went: thread-time summed per kind of work, and
/// moments counted from `start` (nanoseconds).
struct Timers {
    start: Instant,
    fault: AtomicU64,
    register: AtomicU64,
    copy: AtomicU64,
    sync: AtomicU64,
    idle: AtomicU64,
    /// When the last registration ended.
    pinned_at: AtomicU64,
    /// Registrations made (successful or not).
    registrations: AtomicUsize,
}

impl Timers {
    fn new() -> Self {
        Timers {
            start: Instant::now(),
            fault: AtomicU64::new(0),
            register: AtomicU64::new(0),
            copy: AtomicU64::new(0),
            sync: AtomicU64::new(0),
            idle: AtomicU64::new(0),
            pinned_at: AtomicU64::new(0),
            registrations: AtomicUsize::new(0),
        }
    }

    /// Adds the time since `t` to `what`; returns now.
    fn add(&self, what: &AtomicU64, t: Instant) -> Instant {
        let now = Instant::now();
        what.fetch_add(nanos(now - t), Ordering::Relaxed);
        now
    }

    /// A registration that started at `t` has just ended.
    fn registered(&self, t: Instant) {
        let now = self.add(&self.register, t);
        let at = nanos(now - self.start);
        self.pinned_at.fetch_max(at, Ordering::Relaxed);
        self.registrations.fetch_add(1, Ordering::Relaxed);
    }

    fn seconds(what: &AtomicU64) -> f64 {
        what.load(Ordering::Relaxed) as f64 * 1e-9
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The pinning of a staging's new buffers: faulted in piece by piece on every
/// thread, registered one at a time in order (whoever holds `turn`), each as
/// soon as its last piece is in. Threads call [`Pipeline::register_ready`],
/// [`Pipeline::fault_next`] and [`Pipeline::idle`] from their own loops;
/// `ready` says which buffers copies may go to.
struct Pipeline<'a> {
    /// Pins to register, in the order their copies come (indexes into the call's pins).
    order: Vec<usize>,
    /// Fault-in calls (pin, address, bytes), in `order`'s order.
    faults: Vec<(usize, u64, u64)>,
    next_fault: AtomicUsize,
    /// Per pin: fault-in calls not done yet.
    unfaulted: Vec<AtomicUsize>,
    /// Per pin: registration tried, so copies into it may start (true from
    /// the start for pins not in `order`).
    ready: Vec<AtomicBool>,
    /// The position in `order` of the next pin to register. Its lock is the
    /// registrar's turn: one thread registers at a time, in order.
    turn: Mutex<usize>,
    /// `*turn`, readable without the lock.
    registered: AtomicUsize,
    wake_lock: Mutex<()>,
    wake: Condvar,
    register: &'a (dyn Fn(usize) + Sync),
    timers: &'a Timers,
}

impl<'a> Pipeline<'a> {
    /// Registers `pins[k]` for each `k` of `order` through `register`.
    fn new(
        pins: &[&HostPin],
        order: Vec<usize>,
        register: &'a (dyn Fn(usize) + Sync),
        timers: &'a Timers,
    ) -> Self {
        let mut faults = Vec::new();
        let unfaulted: Vec<AtomicUsize> = pins.iter().map(|_| AtomicUsize::new(0)).collect();
        let ready: Vec<AtomicBool> = pins.iter().map(|_| AtomicBool::new(true)).collect();
        for &k in &order {
            ready[k].store(false, Ordering::Relaxed);
            for (addr, len) in pins[k].fault_pieces() {
                faults.push((k, addr, len));
                unfaulted[k].fetch_add(1, Ordering::Relaxed);
            }
        }
        Pipeline {
            order,
            faults,
            next_fault: AtomicUsize::new(0),
            unfaulted,
            ready,
            turn: Mutex::new(0),
            registered: AtomicUsize::new(0),
            wake_lock: Mutex::new(()),
            wake: Condvar::new(),
            register,
            timers,
        }
    }

    fn is_ready(&self, k: usize) -> bool {
        self.ready[k].load(Ordering::Acquire)
    }

    /// Whether every pin of `order` has been registered (or refused).
    fn finished(&self) -> bool {
        self.registered.load(Ordering::Acquire) >= self.order.len()
    }

    /// Whether the next pin to register has all its memory faulted in.
    fn next_faulted(&self) -> bool {
        let n = self.registered.load(Ordering::Acquire);
        self.order
            .get(n)
            .is_some_and(|&k| self.unfaulted[k].load(Ordering::Acquire) == 0)
    }

    /// Takes the registrar's turn unless another thread holds it, and
    /// registers, in order, every pin whose memory is all faulted in. Returns
    /// whether it registered any.
    fn register_ready(&self) -> bool {
        let mut did = false;
        while self.next_faulted() {
            let mut turn = match self.turn.try_lock() {
                Ok(g) => g,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => return did,
            };
            while let Some(&k) = self.order.get(*turn) {
                if self.unfaulted[k].load(Ordering::Acquire) != 0 {
                    break;
                }
                let t = Instant::now();
                (self.register)(k);
                self.timers.registered(t);
                self.ready[k].store(true, Ordering::Release);
                *turn += 1;
                self.registered.store(*turn, Ordering::Release);
                did = true;
                self.notify();
            }
            // The loop looks again: a thread that finished the next pin's
            // last piece meanwhile found the turn taken.
        }
        did
    }

    /// Faults in the next piece; false when none is left.
    fn fault_next(&self) -> bool {
        let i = self.next_fault.fetch_add(1, Ordering::Relaxed);
        let Some(&(k, addr, len)) = self.faults.get(i) else {
            return false;
        };
        let t = Instant::now();
        // Best effort: where the kernel lacks the advice, the registration
        // faults the pages in itself.
        hugepage::populate_quietly(addr as usize, len as usize);
        self.timers.add(&self.timers.fault, t);
        self.unfaulted[k].fetch_sub(1, Ordering::AcqRel);
        true
    }

    /// Sleeps until the next registration, or [`IDLE_WAIT`].
    fn idle(&self) {
        let t = Instant::now();
        let g = crate::sync::lock(&self.wake_lock);
        drop(crate::sync::wait_timeout(&self.wake, g, IDLE_WAIT));
        self.timers.add(&self.timers.idle, t);
    }

    /// Faults in and registers every buffer, on `threads` tasks.
    fn run(&self, threads: usize, caller: Caller) {
        let threads = threads.clamp(1, self.faults.len().max(1));
        crate::workers::run(threads, caller, |_| {
            while !self.finished() {
                if !self.register_ready() && !self.fault_next() {
                    self.idle();
                }
            }
        });
    }

    fn notify(&self) {
        let _g = crate::sync::lock(&self.wake_lock);
        self.wake.notify_all();
    }
}

/// Pins every range of `pins` not yet tried, on up to `threads` threads, ahead
/// of the copies (a stager's warm-up, off the training thread's path), as a
/// [`Pipeline`] (or each range on one thread, its fault-in spread over up to
/// 16, where `CKPTIO_STAGING_PIPELINE` is off). Returns the bytes now pinned
/// through `pins`. Memory the driver refuses stays pageable.
pub fn pin_all(pins: &[&HostPin], threads: usize) -> Result<u64> {
    if pipelined()? {
        let order: Vec<usize> = (0..pins.len()).filter(|&k| pins[k].wants_pin()).collect();
        if !order.is_empty() && cuda::driver().is_ok() {
            let timers = Timers::new();
            let register = |k: usize| {
                pins[k].register_now();
            };
            let pipe = Pipeline::new(pins, order, &register, &timers);
            // Registration makes a context current: pool threads only.
            pipe.run(threads, Caller::Waits);
        }
    } else {
        hugepage::for_each_on_threads(pins.len(), threads, |i| {
            pins[i].ensure_pinned(None);
        });
    }
    Ok(pins.iter().map(|p| p.pinned_bytes()).sum())
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

/// What a staging copy did, and where its time went.
#[derive(Clone, Debug, Default)]
pub struct CopyStats {
    pub bytes: u64,
    pub device_bytes: u64,
    pub pieces: usize,
    pub threads: usize,
    /// Device bytes that landed in memory the driver could not pin.
    pub unpinned_device_bytes: u64,
    /// Whether the buffers to pin went through a [`Pipeline`].
    pub pipelined: bool,
    /// Buffers registered by this call (0 once all are pinned).
    pub registrations: usize,
    /// Seconds the call took, and the moment its last registration ended.
    pub seconds: f64,
    pub pinned_at_s: f64,
    /// Thread-seconds spent faulting memory in, registering it, queueing
    /// copies, waiting for them, and idle (waiting for a registration).
    pub fault_s: f64,
    pub register_s: f64,
    pub copy_s: f64,
    pub sync_s: f64,
    pub idle_s: f64,
}

#[derive(Clone, Copy)]
struct Piece {
    src: u64,
    memory: Memory,
    dst: usize,
    dst_addr: u64,
    len: usize,
}

/// The pieces of `jobs`, each job cut on its destination's chunk grid, in job
/// order, or with `interleave`, every job's first piece, then every job's
/// second, and so on (the unpipelined design: the first copy into a buffer
/// pins it while the threads wanting its other pieces wait, so this order
/// has the threads pin different buffers at once). Destinations that overlap
/// each other or a host source are refused.
fn plan(pins: &[&HostPin], jobs: &[CopyJob], interleave: bool) -> Result<Vec<Piece>> {
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
    if interleave {
        out.sort_by_key(|&(rank, _)| rank); // stable: jobs keep their order within a rank
    }
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

/// One copy thread's streams (one per device) and the device copies queued
/// on them since it last waited: many small tensors cost a queued copy each,
/// not a round trip.
#[derive(Default)]
struct Copier {
    streams: Vec<Stream>,
    queued: (usize, usize),
}

impl Copier {
    /// Copies `p`: a memcpy, or an async copy on this thread's stream of its
    /// device (waited for every [`QUEUED_COPIES`] copies or [`QUEUED_BYTES`] bytes).
    ///
    /// # Safety
    /// `p`'s source must be readable memory of its kind and its destination
    /// writable host memory, disjoint, both left alone by everyone else until
    /// [`Copier::wait`] has returned.
    unsafe fn copy(&mut self, p: &Piece, timers: &Timers) -> Result<()> {
        let t = Instant::now();
        match p.memory {
            Memory::Host => {
                // SAFETY: the caller's contract.
                unsafe {
                    std::ptr::copy_nonoverlapping(p.src as *const u8, p.dst_addr as *mut u8, p.len)
                }
            }
            Memory::Cuda(dev) => {
                let k = match self.streams.iter().position(|s| s.device() == dev) {
                    Some(k) => k,
                    None => {
                        self.streams.push(Stream::new(dev)?);
                        self.streams.len() - 1
                    }
                };
                let cuda = cuda::driver()?;
                cuda.make_current(dev)?;
                // SAFETY: the caller's contract; the copy is waited for in `wait`.
                unsafe {
                    cuda.memcpy_dtoh_async(p.dst_addr as *mut u8, p.src, p.len, &self.streams[k])?
                };
                self.queued = (self.queued.0 + 1, self.queued.1 + p.len);
                if self.queued.0 >= QUEUED_COPIES || self.queued.1 >= QUEUED_BYTES {
                    timers.add(&timers.copy, t);
                    return self.wait(timers);
                }
            }
        }
        timers.add(&timers.copy, t);
        Ok(())
    }

    /// Waits for every copy queued on this thread's streams.
    fn wait(&mut self, timers: &Timers) -> Result<()> {
        if self.queued.0 == 0 {
            return Ok(());
        }
        let t = Instant::now();
        let r = self.streams.iter().try_for_each(Stream::synchronize);
        self.queued = (0, 0);
        timers.add(&timers.sync, t);
        r
    }
}

/// Copies `pieces` in order on `threads` tasks, each piece once its
/// destination is ready in `pipe`; meanwhile the tasks fault in and register
/// `pipe`'s buffers. With `pin_inline` (the unpipelined design) a device
/// piece pins its destination itself first. Returns the device bytes copied
/// into memory that is not pinned; the first error wins.
///
/// # Safety
/// Every piece's source must be readable memory of its kind that nobody frees
/// or writes during the call, and its destination writable host memory inside
/// its pin, disjoint from every other piece's destination and host source,
/// that nobody else touches during the call.
unsafe fn run_pieces(
    pins: &[&HostPin],
    pieces: &[Piece],
    pipe: &Pipeline,
    threads: usize,
    caller: Caller,
    pin_inline: bool,
) -> Result<u64> {
    let next = AtomicUsize::new(0);
    let unpinned = AtomicUsize::new(0);
    let first_error = crate::sync::FirstError::default();
    let timers = pipe.timers;
    crate::workers::run(threads, caller, |_| {
        let mut copier = Copier::default();
        let r = (|| -> Result<()> {
            while !first_error.failed() {
                pipe.register_ready();
                let i = next.load(Ordering::Acquire);
                let Some(p) = pieces.get(i) else {
                    break;
                };
                if pipe.is_ready(p.dst) {
                    if next
                        .compare_exchange(i, i + 1, Ordering::AcqRel, Ordering::Relaxed)
                        .is_err()
                    {
                        continue; // another thread took it
                    }
                    if p.memory != Memory::Host {
                        let pinned = if pin_inline {
                            pins[p.dst].ensure_pinned(Some(timers))
                        } else {
                            pins[p.dst].is_pinned()
                        };
                        if !pinned {
                            unpinned.fetch_add(p.len, Ordering::Relaxed);
                        }
                    }
                    // SAFETY: the caller's contract, and `wait` below runs
                    // before the task ends.
                    unsafe { copier.copy(p, timers)? };
                } else if !pipe.fault_next() {
                    pipe.idle(); // until its buffer is registered
                }
            }
            Ok(())
        })();
        // Every copy queued has landed (or failed) before the task ends:
        // none may outlive the call.
        let waited = copier.wait(timers);
        if let Err(e) = r.and(waited) {
            first_error.set(e);
        }
    });
    match first_error.into_inner() {
        Some(e) => Err(e),
        None => Ok(unpinned.into_inner() as u64),
    }
}

/// Runs `jobs` as `threads` tasks on the worker threads (host copies on the
/// caller's thread too): device pieces as async copies on a stream per task
/// and device (into pinned buffers where the driver allows), host pieces as
/// memcpy. Destinations not pinned yet are pinned first, as a [`Pipeline`]
/// that the copies follow. Returns when every byte has landed; the first
/// error wins.
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
    let pipelined = pipelined()?;
    let mut pieces = plan(pins, jobs, !pipelined)?;
    let timers = Timers::new();
    // The buffers to pin: those device copies go to, in the order of their
    // first copies.
    let mut order = Vec::new();
    if pipelined && pieces.iter().any(|p| p.memory != Memory::Host) && cuda::driver().is_ok() {
        let mut seen = vec![false; pins.len()];
        for p in &pieces {
            if p.memory != Memory::Host && !seen[p.dst] && pins[p.dst].wants_pin() {
                seen[p.dst] = true;
                order.push(p.dst);
            }
        }
    }
    let register = |k: usize| {
        pins[k].register_now();
    };
    // Copies that wait for no registration first (buffers pinned or refused
    // before), then the others buffer by buffer, in the order the buffers
    // are registered.
    let mut turn = vec![0usize; pins.len()];
    for (i, &k) in order.iter().enumerate() {
        turn[k] = i + 1;
    }
    pieces.sort_by_key(|p| turn[p.dst]);
    let pipe = Pipeline::new(pins, order, &register, &timers);
    let threads = threads.clamp(1, pieces.len().max(pipe.faults.len()).max(1));
    let mut stats = CopyStats {
        bytes: jobs.iter().map(|j| j.len).sum(),
        device_bytes: jobs
            .iter()
            .filter(|j| j.memory != Memory::Host)
            .map(|j| j.len)
            .sum(),
        pieces: pieces.len(),
        threads,
        pipelined,
        ..CopyStats::default()
    };
    if pieces.is_empty() {
        return Ok(stats);
    }
    // Device copies make a CUDA context current on the thread that queues
    // them: those run on pool threads only, never on the caller's.
    let caller = if jobs.iter().all(|j| j.memory == Memory::Host) {
        Caller::Helps
    } else {
        Caller::Waits
    };
    // SAFETY: the caller's contract; `plan` kept every destination inside
    // its pin and refused overlaps.
    let unpinned = unsafe { run_pieces(pins, &pieces, &pipe, threads, caller, !pipelined) }?;
    stats.unpinned_device_bytes = unpinned;
    stats.registrations = timers.registrations.load(Ordering::Relaxed);
    stats.seconds = timers.start.elapsed().as_secs_f64();
    stats.pinned_at_s = Timers::seconds(&timers.pinned_at);
    stats.fault_s = Timers::seconds(&timers.fault);
    stats.register_s = Timers::seconds(&timers.register);
    stats.copy_s = Timers::seconds(&timers.copy);
    stats.sync_s = Timers::seconds(&timers.sync);
    stats.idle_s = Timers::seconds(&timers.idle);
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
        // Unpipelined, each destination's first piece comes before any second
        // one; else the pieces keep the jobs' order.
        let order = |interleave| -> Vec<usize> {
            let pieces = plan(&[&pa, &pb], &jobs, interleave).unwrap();
            pieces.iter().map(|p| p.dst).collect()
        };
        assert_eq!(&order(true)[..4], &[0, 1, 0, 1]);
        assert_eq!(&order(false)[7..10], &[0, 1, 1]);
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
            let n = pin_all(&[&p], 4).unwrap();
            assert!(n == 0 || n == len, "{n}");
            assert_eq!(p.pinned_bytes(), n);
            assert_eq!(n > 0, cuda::driver().is_ok());
        }
        let kept = |(i, &b): (usize, &u8)| b == (i % 253) as u8;
        assert!(a.as_slice().iter().enumerate().all(kept));
    }

    /// Whether every page of `[addr, addr + len)` is resident.
    fn resident(addr: u64, len: u64) -> bool {
        let first = align::align_down(addr, PAGE);
        let n = (addr + len - first).div_ceil(PAGE) as usize;
        let mut v = vec![0u8; n];
        // SAFETY: mincore reads the page tables of a mapping of ours into `v`,
        // one byte per page.
        let rc = unsafe {
            libc::mincore(
                first as *mut libc::c_void,
                n * PAGE as usize,
                v.as_mut_ptr(),
            )
        };
        rc == 0 && v.iter().all(|b| b & 1 == 1)
    }

    /// Fresh (untouched) buffers of `sizes`, a pin each (`pin`: to be pinned).
    fn fresh(sizes: &[usize]) -> Vec<hugepage::AnonMap> {
        sizes
            .iter()
            .map(|&n| hugepage::AnonMap::with_advice(n, false).unwrap())
            .collect()
    }

    fn pins_of(maps: &[hugepage::AnonMap], chunk: u64) -> Vec<HostPin> {
        maps.iter()
            .map(|m| {
                // SAFETY: each map outlives its pin (the tests drop pins first).
                unsafe { HostPin::new(m.as_ptr() as u64, m.len() as u64, chunk, true) }.unwrap()
            })
            .collect()
    }

    #[test]
    fn a_pipeline_registers_in_order_once_faulted_in_and_copies_wait_for_it() {
        // Buffers of one page to several fault-in pieces, each registered (a
        // stand-in for cuMemHostRegister that checks its memory) once all its
        // pages are faulted in, in order, before any copy into it; then every
        // byte lands. On one thread and on several.
        let sizes = [3 * FAULT_PIECE as usize + 12_345, 4096, 5 << 20, 1 << 20];
        let total: usize = sizes.iter().sum();
        let src: Vec<u8> = (0..total).map(|i| (i % 251) as u8 + 1).collect();
        for threads in [1, 4] {
            let maps = fresh(&sizes);
            let pins = pins_of(&maps, 1 << 20);
            let refs: Vec<&HostPin> = pins.iter().collect();
            let mut at = 0;
            let jobs: Vec<CopyJob> = sizes
                .iter()
                .enumerate()
                .map(|(k, &n)| {
                    at += n;
                    CopyJob {
                        src: src.as_ptr() as u64 + (at - n) as u64,
                        memory: Memory::Host,
                        dst: k,
                        dst_offset: 0,
                        len: n as u64,
                    }
                })
                .collect();
            let log = Mutex::new(Vec::new());
            let register = |k: usize| {
                let (p, m) = (&pins[k], &maps[k]);
                assert!(
                    resident(p.base, p.len),
                    "buffer {k} registered before its fault-in"
                );
                assert!(
                    m.as_slice().iter().all(|&b| b == 0),
                    "a copy into {k} ran first"
                );
                crate::sync::lock(&log).push(k);
            };
            let timers = Timers::new();
            // Registered in the order 2, 0, 3, 1; copies follow it.
            let mut pieces = plan(&refs, &jobs, false).unwrap();
            let turn = [2, 4, 1, 3];
            pieces.sort_by_key(|p| turn[p.dst]);
            let pipe = Pipeline::new(&refs, vec![2, 0, 3, 1], &register, &timers);
            assert!(pipe.faults.len() > sizes.len());
            // SAFETY: sources and destinations are live, disjoint buffers.
            let unpinned =
                unsafe { run_pieces(&refs, &pieces, &pipe, threads, Caller::Helps, false) };
            assert_eq!(unpinned.unwrap(), 0);
            assert_eq!(*crate::sync::lock(&log), [2, 0, 3, 1]);
            assert!(pipe.finished());
            assert_eq!(timers.registrations.load(Ordering::Relaxed), 4);
            drop(pins);
            let got: Vec<u8> = maps.iter().flat_map(|m| m.as_slice().to_vec()).collect();
            assert!(got == src, "threads {threads}");
        }
    }

    #[test]
    fn a_pipeline_alone_faults_in_and_registers_everything() {
        // prepare()'s path: no copies; every buffer registered once, in order.
        let maps = fresh(&[FAULT_PIECE as usize * 2 + 1, 4096, 3 << 20]);
        let pins = pins_of(&maps, 1 << 20);
        let refs: Vec<&HostPin> = pins.iter().collect();
        let log = Mutex::new(Vec::new());
        let register = |k: usize| {
            assert!(resident(pins[k].base, pins[k].len));
            crate::sync::lock(&log).push(k);
        };
        let timers = Timers::new();
        let pipe = Pipeline::new(&refs, vec![0, 1, 2], &register, &timers);
        pipe.run(3, Caller::Waits);
        assert!(pipe.finished() && (0..3).all(|k| pipe.is_ready(k)));
        assert_eq!(*crate::sync::lock(&log), [0, 1, 2]);
        // Nothing to pin: nothing runs.
        let empty = Pipeline::new(&refs, vec![], &register, &timers);
        assert!(empty.finished() && empty.faults.is_empty());
        empty.run(4, Caller::Helps);
    }

    #[test]
    fn fault_pieces_cover_the_pages_of_a_range_on_the_grid() {
        let m = hugepage::AnonMap::with_advice(3 * FAULT_PIECE as usize, false).unwrap();
        let base = m.as_ptr() as u64;
        // From inside the first page to inside a page past the second grid line.
        let (start, len) = (base + 100, FAULT_PIECE + 8192);
        // SAFETY: `m` outlives the pin and holds the range.
        let p = unsafe { HostPin::new(start, len, 1 << 20, true) }.unwrap();
        let pieces: Vec<(u64, u64)> = p.fault_pieces().collect();
        assert_eq!(pieces.first().unwrap().0, base);
        let end = pieces.last().map(|&(a, n)| a + n).unwrap();
        assert_eq!(end, align::align_up(start + len, PAGE));
        for w in pieces.windows(2) {
            assert_eq!(w[0].0 + w[0].1, w[1].0);
            assert_eq!(w[1].0 % FAULT_PIECE, 0);
        }
        assert!(pieces.iter().all(|&(_, n)| n > 0 && n <= FAULT_PIECE));
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
