//! The CUDA driver API (libcuda), loaded at run time.
//!
//! ckptio never links against CUDA, so the same wheel imports on machines with
//! no GPU. On first use this module dlopens `libcuda.so.1`, resolves the few
//! driver calls the GPU paths need, and wraps them in small RAII types:
//! [`Stream`], [`Event`], [`PinnedBuffer`] and [`HostRegistration`].
//!
//! Work runs in each device's *primary* context. The CUDA runtime, and so
//! PyTorch, uses that context too, so device pointers handed over by torch are
//! valid in it. We retain each primary context once and keep it for the life
//! of the process. Releasing it could tear down torch's context.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, OsStr};
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::{Mutex, OnceLock, PoisonError};

use libloading::Library;

use crate::error::{Error, Result};
use crate::gpu::{budget, symbol};
use crate::io::hugepage::{self, AnonMap};

type CUresult = c_int;
type CUdevice = c_int;
type CUdeviceptr = u64;
type CUcontext = *mut c_void;
type CUstream = *mut c_void;
type CUevent = *mut c_void;

const CUDA_SUCCESS: CUresult = 0;
const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;

// CUpointer_attribute values (cuda.h).
const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
// CUmemorytype values.
const CU_MEMORYTYPE_DEVICE: c_uint = 2;
const CU_MEMORYTYPE_UNIFIED: c_uint = 4;

const CU_STREAM_NON_BLOCKING: c_uint = 1;
const CU_EVENT_DISABLE_TIMING: c_uint = 2;
const CU_MEMHOSTALLOC_PORTABLE: c_uint = 1;
const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 1;

/// The name used in [`Error::Library`].
const LIB_NAME: &str = "libcuda";
/// The driver ships as `libcuda.so.1`. The unversioned name exists only with
/// development packages or stubs.
const CANDIDATES: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// An opaque driver handle (context, stream) kept in shared state.
#[derive(Clone, Copy, Debug)]
struct Handle(*mut c_void);

// SAFETY: CUcontext and CUstream are opaque, process-wide driver handles, not
// pointers to Rust data. The driver API is thread-safe and accepts them from any
// thread.
unsafe impl Send for Handle {}
// SAFETY: as for Send. A shared `&Handle` only gives a copy of the value.
unsafe impl Sync for Handle {}

/// The driver entry points, resolved once. Each type is the exact C signature
/// from cuda.h. `_v2` names are the ones that cuda.h's macros select, with
/// 64-bit sizes and pointers.
struct Api {
    init: unsafe extern "C" fn(c_uint) -> CUresult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CUresult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CUresult,
    device_get: unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult,
    get_error_name: Option<unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult>,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, CUdeviceptr) -> CUresult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult,
    ctx_set_current: unsafe extern "C" fn(CUcontext) -> CUresult,
    ctx_get_current: unsafe extern "C" fn(*mut CUcontext) -> CUresult,
    stream_create: unsafe extern "C" fn(*mut CUstream, c_uint) -> CUresult,
    stream_destroy: unsafe extern "C" fn(CUstream) -> CUresult,
    stream_synchronize: unsafe extern "C" fn(CUstream) -> CUresult,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize, CUstream) -> CUresult,
    memcpy_htod_async:
        unsafe extern "C" fn(CUdeviceptr, *const c_void, usize, CUstream) -> CUresult,
    memcpy_dtod_async: unsafe extern "C" fn(CUdeviceptr, CUdeviceptr, usize, CUstream) -> CUresult,
    mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CUresult,
    mem_free_host: unsafe extern "C" fn(*mut c_void) -> CUresult,
    mem_host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult,
    mem_host_unregister: unsafe extern "C" fn(*mut c_void) -> CUresult,
    // Looked up tolerantly: a driver without them loads, and only the calls
    // that order work after the caller's stream fail (see [`Cuda::required`]).
    event_create: Option<unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult>,
    event_record: Option<unsafe extern "C" fn(CUevent, CUstream) -> CUresult>,
    event_synchronize: Option<unsafe extern "C" fn(CUevent) -> CUresult>,
    event_destroy: Option<unsafe extern "C" fn(CUevent) -> CUresult>,
    stream_wait_event: Option<unsafe extern "C" fn(CUstream, CUevent, c_uint) -> CUresult>,
}

impl Api {
    /// Resolves every entry point. A missing required symbol fails the whole load.
    fn load(lib: &Library) -> std::result::Result<Api, String> {
        // SAFETY: each type below is copied from the declaration in cuda.h
        // (CUresult, CUdevice = int; CUdeviceptr = unsigned long long;
        // CUcontext, CUstream = pointers; size_t = usize).
        unsafe {
            Ok(Api {
                init: symbol(lib, "cuInit")?,
                driver_get_version: symbol(lib, "cuDriverGetVersion")?,
                device_get_count: symbol(lib, "cuDeviceGetCount")?,
                device_get: symbol(lib, "cuDeviceGet")?,
                get_error_name: symbol(lib, "cuGetErrorName").ok(),
                pointer_get_attribute: symbol(lib, "cuPointerGetAttribute")?,
                primary_ctx_retain: symbol(lib, "cuDevicePrimaryCtxRetain")?,
                ctx_set_current: symbol(lib, "cuCtxSetCurrent")?,
                ctx_get_current: symbol(lib, "cuCtxGetCurrent")?,
                stream_create: symbol(lib, "cuStreamCreate")?,
                stream_destroy: symbol(lib, "cuStreamDestroy_v2")?,
                stream_synchronize: symbol(lib, "cuStreamSynchronize")?,
                memcpy_dtoh_async: symbol(lib, "cuMemcpyDtoHAsync_v2")?,
                memcpy_htod_async: symbol(lib, "cuMemcpyHtoDAsync_v2")?,
                memcpy_dtod_async: symbol(lib, "cuMemcpyDtoDAsync_v2")?,
                mem_host_alloc: symbol(lib, "cuMemHostAlloc")?,
                mem_free_host: symbol(lib, "cuMemFreeHost")?,
                mem_host_register: symbol(lib, "cuMemHostRegister_v2")?,
                mem_host_unregister: symbol(lib, "cuMemHostUnregister")?,
                event_create: symbol(lib, "cuEventCreate").ok(),
                event_record: symbol(lib, "cuEventRecord").ok(),
                event_synchronize: symbol(lib, "cuEventSynchronize").ok(),
                event_destroy: symbol(lib, "cuEventDestroy_v2").ok(),
                stream_wait_event: symbol(lib, "cuStreamWaitEvent").ok(),
            })
        }
    }
}

/// The loaded CUDA driver. Obtain it with [`driver`].
pub struct Cuda {
    api: Api,
    path: String,
    /// Primary context per device ordinal, retained once and never released.
    contexts: Mutex<Vec<Option<Handle>>>,
    /// Keeps the code behind `api` mapped. Never dropped, since `Cuda` lives in a static.
    _lib: Library,
}

impl fmt::Debug for Cuda {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cuda").field("path", &self.path).finish()
    }
}

static LIB: OnceLock<std::result::Result<Cuda, String>> = OnceLock::new();
/// The result of `cuInit(0)`, as a failed call's code.
static INIT: OnceLock<std::result::Result<(), CUresult>> = OnceLock::new();

/// Opens the first loadable file of `candidates` and resolves the API.
/// The error lists every attempt.
fn load_from(candidates: &[&OsStr]) -> std::result::Result<Cuda, String> {
    let mut tried = Vec::new();
    for &name in candidates {
        // SAFETY: loading runs the library's initialisers. libcuda's are those every
        // CUDA program runs. The library is never unloaded.
        match unsafe { Library::new(name) } {
            Ok(lib) => {
                let api =
                    Api::load(&lib).map_err(|e| format!("{}: {e}", name.to_string_lossy()))?;
                let path = loaded_path(api.init as *const c_void)
                    .unwrap_or_else(|| name.to_string_lossy().into_owned());
                return Ok(Cuda {
                    api,
                    path,
                    contexts: Mutex::new(Vec::new()),
                    _lib: lib,
                });
            }
            Err(e) => tried.push(format!("{}: {e}", name.to_string_lossy())),
        }
    }
    Err(format!("not found (tried {})", tried.join("; ")))
}

/// The file that holds `addr`: where the loader actually found the library.
pub(crate) fn loaded_path(addr: *const c_void) -> Option<String> {
    // SAFETY: Dl_info is plain C data. All-zero bytes are a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address and fills `info`.
    let found = unsafe { libc::dladdr(addr, &mut info) } != 0;
    if !found || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader. It stays
    // valid while the object is loaded, and we copy it at once.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(name.to_string_lossy().into_owned())
}

/// The loaded library, without initialising the driver (no cuInit).
fn library() -> Result<&'static Cuda> {
    let candidates: Vec<&OsStr> = CANDIDATES.iter().map(OsStr::new).collect();
    match LIB.get_or_init(|| load_from(&candidates)) {
        Ok(cuda) => Ok(cuda),
        Err(reason) => Err(Error::Library {
            name: LIB_NAME.into(),
            reason: reason.clone(),
        }),
    }
}

/// The CUDA driver, loaded and initialised (`cuInit(0)`) once per process.
///
/// Failures are remembered: a missing library gives [`Error::Library`] and a
/// failed `cuInit` (e.g. no GPU) gives [`Error::Cuda`], on every call.
pub fn driver() -> Result<&'static Cuda> {
    let cuda = library()?;
    // SAFETY: cuInit takes a flags word, which must be 0.
    let init = INIT.get_or_init(|| match unsafe { (cuda.api.init)(0) } {
        CUDA_SUCCESS => Ok(()),
        code => Err(code),
    });
    match init {
        Ok(()) => Ok(cuda),
        Err(code) => Err(cuda.error("cuInit", *code)),
    }
}

impl Cuda {
    /// The file the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Turns a CUresult into `Ok` or an [`Error::Cuda`] named after the code.
    fn check(&self, call: &'static str, code: CUresult) -> Result<()> {
        if code == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(self.error(call, code))
        }
    }

    /// An optional entry point, or the error naming the symbol this driver lacks.
    fn required<T>(&self, f: Option<T>, name: &str) -> Result<T> {
        f.ok_or_else(|| Error::Library {
            name: LIB_NAME.into(),
            reason: format!("{}: symbol {name} not found", self.path),
        })
    }

    fn error(&self, call: &'static str, code: CUresult) -> Error {
        Error::Cuda {
            call,
            code,
            name: self.error_name(code),
        }
    }

    /// The enum name of a CUresult ("CUDA_ERROR_NO_DEVICE"), from the driver itself.
    pub fn error_name(&self, code: i32) -> String {
        let mut s: *const c_char = ptr::null();
        if let Some(get_name) = self.api.get_error_name {
            // SAFETY: cuGetErrorName writes a pointer to a static string, or null
            // for an unknown code. It accepts any code.
            let rc = unsafe { get_name(code, &mut s) };
            if rc == CUDA_SUCCESS && !s.is_null() {
                // SAFETY: non-null means a NUL-terminated static string in libcuda.
                return unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
            }
        }
        format!("CUresult {code}")
    }

    /// The driver's CUDA version, 1000 * major + 10 * minor (e.g. 13000).
    pub fn driver_version(&self) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        self.check("cuDriverGetVersion", unsafe {
            (self.api.driver_get_version)(&mut v)
        })?;
        Ok(v)
    }

    /// The number of visible devices (honours CUDA_VISIBLE_DEVICES).
    pub fn device_count(&self) -> Result<i32> {
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        self.check("cuDeviceGetCount", unsafe {
            (self.api.device_get_count)(&mut n)
        })?;
        Ok(n)
    }

    /// The device ordinal of the memory at `ptr`, or `None` if CUDA does not
    /// know the address as device memory (pageable or pinned host memory, or garbage).
    ///
    /// Managed (unified) memory reports the device it was allocated on.
    pub fn pointer_device(&self, ptr: u64) -> Result<Option<i32>> {
        let mut mem_type: c_uint = 0;
        // SAFETY: MEMORY_TYPE writes one CUmemorytype (unsigned int) into `mem_type`.
        // The driver only looks `ptr` up in its tables and never dereferences it.
        let rc = unsafe {
            (self.api.pointer_get_attribute)(
                (&mut mem_type as *mut c_uint).cast(),
                CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                ptr,
            )
        };
        // INVALID_VALUE: an address that no CUDA allocation covers.
        if rc == CUDA_ERROR_INVALID_VALUE {
            return Ok(None);
        }
        self.check("cuPointerGetAttribute", rc)?;
        if mem_type != CU_MEMORYTYPE_DEVICE && mem_type != CU_MEMORYTYPE_UNIFIED {
            return Ok(None);
        }
        let mut ordinal: c_int = -1;
        // SAFETY: DEVICE_ORDINAL writes one int. `ptr` is only looked up, as above.
        self.check("cuPointerGetAttribute", unsafe {
            (self.api.pointer_get_attribute)(
                (&mut ordinal as *mut c_int).cast(),
                CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr,
            )
        })?;
        Ok(Some(ordinal))
    }

    /// The primary context of `device`, retained on first use and kept for the
    /// process lifetime. Torch uses the same context, so releasing it could tear
    /// it down under torch.
    fn primary_context(&self, device: i32) -> Result<Handle> {
        let index = usize::try_from(device)
            .map_err(|_| Error::invalid(format!("CUDA device {device} is negative")))?;
        // No code under this lock panics. Poisoning is harmless: the cache is
        // only written after a successful retain.
        let mut cache = self.contexts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(Some(ctx)) = cache.get(index) {
            return Ok(*ctx);
        }
        let mut dev: CUdevice = 0;
        // SAFETY: writes one CUdevice. A bad ordinal gives CUDA_ERROR_INVALID_DEVICE.
        self.check("cuDeviceGet", unsafe {
            (self.api.device_get)(&mut dev, device)
        })?;
        let mut ctx: CUcontext = ptr::null_mut();
        // SAFETY: writes one CUcontext for a valid device. We hold the lock, so each
        // device is retained once per process.
        self.check("cuDevicePrimaryCtxRetain", unsafe {
            (self.api.primary_ctx_retain)(&mut ctx, dev)
        })?;
        if cache.len() <= index {
            cache.resize(index + 1, None);
        }
        cache[index] = Some(Handle(ctx));
        Ok(Handle(ctx))
    }

    /// Makes `device`'s primary context current on the calling thread (the
    /// context PyTorch uses). Call it on each thread before touching that
    /// device. The context is retained on the first call for a device.
    ///
    /// The engine's threads call it once per chunk: the context is looked up
    /// in a per-thread cache (a device's primary context never changes once
    /// retained) and set only when another one is current, so the common call
    /// takes no lock of ours or the driver's.
    pub fn make_current(&self, device: i32) -> Result<()> {
        thread_local! {
            static LAST: std::cell::Cell<(i32, CUcontext)> =
                const { std::cell::Cell::new((-1, ptr::null_mut())) };
        }
        let (d, cached) = LAST.with(|c| c.get());
        let ctx = if d == device && !cached.is_null() {
            cached
        } else {
            let ctx = self.primary_context(device)?.0;
            LAST.with(|c| c.set((device, ctx)));
            ctx
        };
        let mut now: CUcontext = ptr::null_mut();
        // SAFETY: writes one CUcontext (null if none is current).
        if unsafe { (self.api.ctx_get_current)(&mut now) } == CUDA_SUCCESS && now == ctx {
            return Ok(());
        }
        // SAFETY: `ctx` is a retained context that is never released, so it is alive.
        self.check("cuCtxSetCurrent", unsafe {
            (self.api.ctx_set_current)(ctx)
        })
    }

    /// Runs `f`, then makes the calling thread's current context what it was
    /// before (none included): for work done on a thread the caller owns (one
    /// of Python's), whose current context the CUDA runtime reads as torch's
    /// current device.
    pub fn keeping_current<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let mut prev: CUcontext = ptr::null_mut();
        // SAFETY: writes one CUcontext (null if none is current).
        let rc = unsafe { (self.api.ctx_get_current)(&mut prev) };
        let out = f();
        if rc == CUDA_SUCCESS {
            // SAFETY: `prev` was current on this thread just before `f`; torch
            // keeps its contexts (primary ones) alive, and null unbinds.
            unsafe { (self.api.ctx_set_current)(prev) };
        }
        out
    }

    /// Makes sure the calling thread has a current context. Portable host
    /// allocations need one, whichever it is. If the thread has none, uses
    /// device 0's primary context.
    fn ensure_context(&self) -> Result<()> {
        let mut cur: CUcontext = ptr::null_mut();
        // SAFETY: writes one CUcontext (null if none is current).
        let rc = unsafe { (self.api.ctx_get_current)(&mut cur) };
        if rc == CUDA_ERROR_INVALID_CONTEXT || (rc == CUDA_SUCCESS && cur.is_null()) {
            return self.make_current(0);
        }
        self.check("cuCtxGetCurrent", rc)
    }

    /// Queues a device-to-host copy of `len` bytes on `stream`.
    ///
    /// The copy is truly asynchronous only when `dst` is pinned ([`PinnedBuffer`],
    /// [`host_register`]). Call it on a thread whose current context is the
    /// stream's device (see [`Cuda::make_current`]; [`Stream::new`] does this).
    ///
    /// # Safety
    /// - `dst..dst+len` must be host memory writable by us. It must stay valid,
    ///   and no one may read or write it, until `stream` is synchronized.
    /// - `src..src+len` must be device memory (any device, under unified
    ///   addressing) that stays allocated and unmodified until then.
    pub unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
        stream: &Stream,
    ) -> Result<()> {
        // SAFETY: the caller guarantees both ranges. `stream.raw` is alive while `stream` is.
        self.check("cuMemcpyDtoHAsync", unsafe {
            (self.api.memcpy_dtoh_async)(dst.cast(), src, len, stream.raw.0)
        })
    }

    /// Queues a host-to-device copy of `len` bytes on `stream`.
    ///
    /// Same context rule as [`Cuda::memcpy_dtoh_async`].
    ///
    /// # Safety
    /// - `src..src+len` must be readable host memory that stays valid and
    ///   unmodified until `stream` is synchronized.
    /// - `dst..dst+len` must be device memory that stays allocated, and that no
    ///   one else uses, until then.
    pub unsafe fn memcpy_htod_async(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
        stream: &Stream,
    ) -> Result<()> {
        // SAFETY: the caller guarantees both ranges. `stream.raw` is alive while `stream` is.
        self.check("cuMemcpyHtoDAsync", unsafe {
            (self.api.memcpy_htod_async)(dst, src.cast(), len, stream.raw.0)
        })
    }

    /// Queues device-to-device copies `(dst, src, len)` on a stream the caller
    /// owns (e.g. one of PyTorch's), in order, after making `device`'s primary
    /// context current. One driver call per copy, no kernel launch.
    ///
    /// # Safety
    /// - `stream` must be a live CUstream of `device`'s primary context.
    /// - Each `src..src+len` must be device memory that stays allocated and
    ///   unmodified, and each `dst..dst+len` device memory that stays allocated
    ///   and unused by others, until the stream has run the copies.
    pub unsafe fn memcpy_dtod_async_on(
        &self,
        device: i32,
        stream: *mut c_void,
        copies: &[(u64, u64, usize)],
    ) -> Result<()> {
        self.make_current(device)?;
        for &(dst, src, len) in copies {
            // SAFETY: the caller guarantees the ranges and the stream.
            self.check("cuMemcpyDtoDAsync", unsafe {
                (self.api.memcpy_dtod_async)(dst, src, len, stream)
            })?;
        }
        Ok(())
    }
}

/// A non-blocking CUDA stream on one device. Dropping it destroys the stream.
#[derive(Debug)]
pub struct Stream {
    raw: Handle,
    device: i32,
    cuda: &'static Cuda,
}

impl Stream {
    /// Creates a stream on `device` (flag CU_STREAM_NON_BLOCKING, so it does not
    /// wait on the legacy default stream). It first makes `device`'s primary
    /// context current on the calling thread, and leaves it current.
    pub fn new(device: i32) -> Result<Stream> {
        let cuda = driver()?;
        cuda.make_current(device)?;
        let mut raw: CUstream = ptr::null_mut();
        // SAFETY: writes one CUstream, created in the context just made current.
        cuda.check("cuStreamCreate", unsafe {
            (cuda.api.stream_create)(&mut raw, CU_STREAM_NON_BLOCKING)
        })?;
        Ok(Stream {
            raw: Handle(raw),
            device,
            cuda,
        })
    }

    /// The device this stream was created on.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// The raw CUstream, e.g. for cuFile's stream APIs. Valid while `self` lives.
    pub fn as_raw(&self) -> *mut c_void {
        self.raw.0
    }

    /// Work queued on this stream from now on starts only once `event` has
    /// completed (cuStreamWaitEvent): the stream waits, the host does not.
    pub fn wait(&self, event: &Event) -> Result<()> {
        let f = self
            .cuda
            .required(self.cuda.api.stream_wait_event, "cuStreamWaitEvent")?;
        // SAFETY: both handles are alive while `self` and `event` are; flags must be 0.
        self.cuda.check("cuStreamWaitEvent", unsafe {
            f(self.raw.0, event.raw.0, 0)
        })
    }

    /// Blocks until all work queued on the stream has finished. Errors from
    /// earlier asynchronous copies surface here.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the stream is alive until `self` is dropped.
        self.cuda.check("cuStreamSynchronize", unsafe {
            (self.cuda.api.stream_synchronize)(self.raw.0)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: we own the stream and nothing uses it after this. Queued work still
        // completes (the driver defers the release). A Drop cannot report an
        // error, and there is nothing to do about one.
        let _ = unsafe { (self.cuda.api.stream_destroy)(self.raw.0) };
    }
}

// SAFETY: a CUstream may be used and destroyed from any thread. The driver API
// is thread-safe, and `Stream` holds no thread-local state.
unsafe impl Send for Stream {}

/// Copies between device memory and host memory the caller owns, queued on
/// streams of their own (one per device) and awaited together: what a thread
/// that fills a store's part from GPU memory, or fills GPU memory from a
/// GET's bytes, needs. Dropped unfinished (an error midway), it still waits
/// for what it queued, so no copy outlives its host memory.
#[derive(Debug, Default)]
pub struct Copies {
    streams: Vec<Stream>,
}

impl Copies {
    fn stream(&mut self, device: i32) -> Result<&Stream> {
        let k = match self.streams.iter().position(|s| s.device() == device) {
            Some(k) => k,
            None => {
                self.streams.push(Stream::new(device)?);
                self.streams.len() - 1
            }
        };
        driver()?.make_current(device)?;
        Ok(&self.streams[k])
    }

    /// Queues a copy of `len` bytes from `src` on `device` to `dst`.
    ///
    /// # Safety
    /// - `dst..dst+len` must be host memory writable by us that no one reads
    ///   or writes until [`Copies::finish`] returns or `self` is dropped.
    /// - `src..src+len` must be memory of `device` that stays allocated and
    ///   unmodified until then (the caller's streams are done with it).
    pub unsafe fn queue_to_host(
        &mut self,
        device: i32,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<()> {
        let stream = self.stream(device)?;
        // SAFETY: the caller guarantees both ranges until the streams are synchronized.
        unsafe { driver()?.memcpy_dtoh_async(dst, src, len, stream) }
    }

    /// Queues a copy of `len` bytes from host memory `src` to `dst` on `device`.
    ///
    /// # Safety
    /// - `src..src+len` must be readable host memory, unmodified and alive
    ///   until [`Copies::finish`] returns or `self` is dropped.
    /// - `dst..dst+len` must be memory of `device` that no one else uses until
    ///   then (the caller's streams are done with it).
    pub unsafe fn queue_to_device(
        &mut self,
        device: i32,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<()> {
        let stream = self.stream(device)?;
        // SAFETY: the caller guarantees both ranges until the streams are synchronized.
        unsafe { driver()?.memcpy_htod_async(dst, src, len, stream) }
    }

    /// Waits until every queued copy is done; the first copy error surfaces here.
    pub fn finish(mut self) -> Result<()> {
        self.wait()
    }

    /// Waits until every queued copy is done, keeping the streams for more
    /// copies. Every stream is waited for, even after one fails (the host
    /// memory may be freed once this returns); the first error is returned.
    pub fn wait(&mut self) -> Result<()> {
        let mut first = Ok(());
        for s in &self.streams {
            let r = s.synchronize();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

impl Drop for Copies {
    fn drop(&mut self) {
        for s in &self.streams {
            // Unfinished: the destinations may be freed right after this.
            let _ = s.synchronize();
        }
    }
}

/// A point in a stream's work (cuEvent, without timing): recorded on a
/// stream the caller owns (one of torch's), then waited for by another stream
/// or by the host. Dropping it destroys the event; work already waiting on it
/// is not affected.
#[derive(Debug)]
pub struct Event {
    raw: Handle,
    device: i32,
    /// Unique in the process: which event a stream last waited for (a freed
    /// event's handle or address may be reused, its serial never is).
    serial: u64,
    cuda: &'static Cuda,
}

static EVENT_SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Event {
    /// Records an event on `stream` of `device`: it completes once every piece
    /// of work queued on that stream before now has. Makes `device`'s primary
    /// context current on the calling thread.
    ///
    /// # Safety
    /// `stream` must be a live CUstream of `device`'s primary context, or null
    /// (the legacy default stream), and must stay alive for this call.
    pub unsafe fn record(device: i32, stream: *mut c_void) -> Result<Event> {
        let cuda = driver()?;
        let create = cuda.required(cuda.api.event_create, "cuEventCreate")?;
        let record = cuda.required(cuda.api.event_record, "cuEventRecord")?;
        cuda.required(cuda.api.event_destroy, "cuEventDestroy_v2")?;
        cuda.make_current(device)?;
        let mut raw: CUevent = ptr::null_mut();
        // SAFETY: writes one CUevent, created in the context just made current.
        cuda.check("cuEventCreate", unsafe {
            create(&mut raw, CU_EVENT_DISABLE_TIMING)
        })?;
        let event = Event {
            raw: Handle(raw),
            device,
            serial: EVENT_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            cuda,
        };
        // SAFETY: the event is ours and alive; the caller vouches for the stream.
        cuda.check("cuEventRecord", unsafe { record(raw, stream) })?;
        Ok(event)
    }

    /// The device whose stream the event was recorded on.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// This event's serial number, unique in the process (never 0).
    pub fn serial(&self) -> u64 {
        self.serial
    }

    /// Blocks the calling thread until the event has completed.
    pub fn synchronize(&self) -> Result<()> {
        let f = self
            .cuda
            .required(self.cuda.api.event_synchronize, "cuEventSynchronize")?;
        // SAFETY: the event is alive until `self` is dropped.
        self.cuda
            .check("cuEventSynchronize", unsafe { f(self.raw.0) })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // `record` checked that the symbol exists before creating the event.
        if let Some(destroy) = self.cuda.api.event_destroy {
            // SAFETY: we own the event and nothing uses it after this; streams
            // still waiting on it are unaffected (the driver defers the release).
            let _ = unsafe { destroy(self.raw.0) };
        }
    }
}

// SAFETY: a CUevent may be waited for, synchronized and destroyed from any
// thread; the driver API is thread-safe and `Event` holds no thread-local state.
unsafe impl Send for Event {}
// SAFETY: `&Event` only allows waiting for it, which the driver allows from
// several threads at once.
unsafe impl Sync for Event {}

/// Page-locked host memory (PORTABLE: pinned for every context). Copies to
/// and from it run at full PCIe speed and truly asynchronously. Dropping it
/// frees the memory.
///
/// The memory is an anonymous mapping with huge pages asked for, faulted in
/// and then registered (cuMemHostRegister), or where that fails (or
/// `CKPTIO_PINNED_ALLOC=driver`) cuMemHostAlloc's. On the H200 host
/// cuMemHostAlloc took 0.65 s per GiB; 8 GiB of huge pages faulted in in
/// 0.19-0.21 s and registered in 0.20-0.25 s.
#[derive(Debug)]
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// `None` for an empty buffer, which owns no allocation.
    cuda: Option<&'static Cuda>,
    /// Our own mapping, registered with the driver (None: cuMemHostAlloc's memory).
    mapped: Option<AnonMap>,
    /// Its share of the process-wide cap, given back after the memory (drop order).
    _budget: Option<budget::Reservation>,
}

impl PinnedBuffer {
    /// Allocates `len` bytes of pinned host memory.
    ///
    /// Uses the calling thread's current context, or device 0's primary context
    /// if the thread has none. PORTABLE makes the memory pinned for all
    /// contexts anyway. The initial contents are whatever the driver mapped
    /// (fresh pages from the kernel, so in practice zero). Pinning is slow
    /// (about 0.65 s per GiB on the H200 VM), so reuse buffers. Counted
    /// against the pinned-memory cap ([`budget`]): an error past it.
    pub fn new(len: usize) -> Result<PinnedBuffer> {
        Self::within_budget(len)?.ok_or_else(|| budget::over_limit(len))
    }

    /// [`PinnedBuffer::new`], or None when the pinned-memory cap has no room.
    pub fn within_budget(len: usize) -> Result<Option<PinnedBuffer>> {
        if len == 0 {
            return Ok(Some(PinnedBuffer {
                ptr: NonNull::dangling(),
                len: 0,
                cuda: None,
                mapped: None,
                _budget: None,
            }));
        }
        let cuda = driver()?;
        let Some(reservation) = budget::reserve(len)? else {
            return Ok(None);
        };
        cuda.ensure_context()?;
        if std::env::var("CKPTIO_PINNED_ALLOC").map_or(true, |v| v != "driver") {
            if let Some((ptr, map)) = Self::registered(cuda, len) {
                return Ok(Some(PinnedBuffer {
                    ptr,
                    len,
                    cuda: Some(cuda),
                    mapped: Some(map),
                    _budget: Some(reservation),
                }));
            }
        }
        let mut p: *mut c_void = ptr::null_mut();
        // SAFETY: writes one pointer to a new allocation of `len` bytes.
        cuda.check("cuMemHostAlloc", unsafe {
            (cuda.api.mem_host_alloc)(&mut p, len, CU_MEMHOSTALLOC_PORTABLE)
        })?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| Error::Cuda {
            call: "cuMemHostAlloc",
            code: CUDA_SUCCESS,
            name: "returned a null pointer".into(),
        })?;
        Ok(Some(PinnedBuffer {
            ptr,
            len,
            cuda: Some(cuda),
            mapped: None,
            _budget: Some(reservation),
        }))
    }

    /// Huge-page memory of ours, faulted in, then registered; None where the
    /// mapping or the registration fails.
    fn registered(cuda: &'static Cuda, len: usize) -> Option<(NonNull<u8>, AnonMap)> {
        let mut map = AnonMap::new(len, true).ok()?;
        // Faulted in first: a registration faults untouched pages one by one.
        map.populate(1, hugepage::HUGE_PAGE);
        let ptr = NonNull::new(map.as_mut_ptr())?;
        // SAFETY: the mapping is ours; the PinnedBuffer that keeps it
        // unregisters it in Drop before the mapping goes (field order).
        let rc = unsafe {
            (cuda.api.mem_host_register)(ptr.as_ptr().cast(), len, CU_MEMHOSTREGISTER_PORTABLE)
        };
        (rc == CUDA_SUCCESS).then_some((ptr, map))
    }

    /// Whether the memory is a registered mapping of ours (else cuMemHostAlloc's).
    pub fn is_registered_mapping(&self) -> bool {
        self.mapped.is_some()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` bytes that we own. They are mapped and
        // initialised by the driver (or `ptr` is dangling and `len` is 0), and live
        // until drop. `&self` rules out concurrent mutation through this API.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`. `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let Some(cuda) = self.cuda else { return };
        // cuMemFreeHost and cuMemHostUnregister need some current context on
        // this thread. The memory is PORTABLE, so any context will do. A Drop
        // cannot report errors.
        let _ = cuda.ensure_context();
        if self.mapped.is_some() {
            // SAFETY: registered once in `registered`; the mapping itself is
            // unmapped after this, when `mapped` drops.
            let _ = unsafe { (cuda.api.mem_host_unregister)(self.ptr.as_ptr().cast()) };
            return;
        }
        // SAFETY: `ptr` came from cuMemHostAlloc, is freed once, and no borrow of
        // it outlives `self`.
        let _ = unsafe { (cuda.api.mem_free_host)(self.ptr.as_ptr().cast()) };
    }
}

// SAFETY: the buffer owns its allocation exclusively, like a Box<[u8]>. Pinned
// memory may be accessed and freed from any thread.
unsafe impl Send for PinnedBuffer {}
// SAFETY: `&PinnedBuffer` only gives `&[u8]` and a const pointer, like `&[u8]`.
unsafe impl Sync for PinnedBuffer {}

/// Existing host memory, page-locked with cuMemHostRegister (PORTABLE). Dropping
/// the guard unregisters it. Use [`HostRegistration::unregister`] to see the error.
#[derive(Debug)]
pub struct HostRegistration {
    ptr: *mut u8,
    len: usize,
    cuda: &'static Cuda,
    /// Its share of the pinned-memory cap, given back after the unregister.
    _budget: budget::Reservation,
}

/// Page-locks `len` bytes at `ptr` so that async copies to and from them run at
/// pinned speed. Registering is much cheaper than a fresh [`PinnedBuffer`]
/// (about 0.2 s for 4 GiB on the H200 VM), but it is not free. Register large,
/// long-lived buffers.
///
/// # Safety
/// `ptr..ptr+len` must be one valid host allocation (e.g. an aligned buffer),
/// not registered already. It must stay allocated until the returned guard is
/// dropped or unregistered, and must not be freed while registered.
///
/// Counted against the pinned-memory cap ([`budget`]): an error past it.
pub unsafe fn host_register(ptr: *mut u8, len: usize) -> Result<HostRegistration> {
    if ptr.is_null() || len == 0 {
        return Err(Error::invalid(
            "host_register needs a non-empty, non-null range",
        ));
    }
    let cuda = driver()?;
    let reservation = budget::reserve(len)?.ok_or_else(|| budget::over_limit(len))?;
    cuda.ensure_context()?;
    // SAFETY: the caller guarantees the range is a live allocation that outlives
    // the registration.
    cuda.check("cuMemHostRegister", unsafe {
        (cuda.api.mem_host_register)(ptr.cast(), len, CU_MEMHOSTREGISTER_PORTABLE)
    })?;
    Ok(HostRegistration {
        ptr,
        len,
        cuda,
        _budget: reservation,
    })
}

impl HostRegistration {
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Unregisters now and reports the driver's verdict.
    pub fn unregister(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        let r = this.release();
        // SAFETY: `this` is never dropped (ManuallyDrop), so the reservation is
        // read out and dropped exactly once, here: its bytes go back to the cap.
        drop(unsafe { std::ptr::read(&this._budget) });
        r
    }

    fn release(&self) -> Result<()> {
        self.cuda.ensure_context()?;
        // SAFETY: `ptr` was registered by `host_register` and is unregistered once,
        // either here via `unregister` (which skips Drop) or in Drop.
        self.cuda.check("cuMemHostUnregister", unsafe {
            (self.cuda.api.mem_host_unregister)(self.ptr.cast())
        })
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

// SAFETY: the guard holds only an address and the driver. Unregistering from
// any thread is allowed, since the driver API is thread-safe.
unsafe impl Send for HostRegistration {}
// SAFETY: `&HostRegistration` only reads the address and length; it gives no
// access to the memory itself.
unsafe impl Sync for HostRegistration {}

/// What `ckptio info` prints about the CUDA driver.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Probe {
    /// libcuda was found and has every symbol we need.
    pub found: bool,
    /// The file it was loaded from.
    pub path: Option<String>,
    /// 1000 * major + 10 * minor (e.g. 13000 for CUDA 13.0).
    pub driver_version: Option<i32>,
    /// Visible devices. `None` if cuInit failed.
    pub device_count: Option<i32>,
    /// Why the driver cannot be used, if it cannot.
    pub reason: Option<String>,
}

impl fmt::Display for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.found {
            return write!(
                f,
                "not available: {}",
                self.reason.as_deref().unwrap_or("unknown reason")
            );
        }
        f.write_str(self.path.as_deref().unwrap_or("libcuda"))?;
        if let Some(v) = self.driver_version {
            write!(f, ", CUDA {}.{}", v / 1000, (v % 1000) / 10)?;
        }
        if let Some(n) = self.device_count {
            write!(f, ", {n} device(s)")?;
        }
        if let Some(r) = &self.reason {
            write!(f, " ({r})")?;
        }
        Ok(())
    }
}

/// Loads libcuda and initialises it, and reports what it found. It never
/// panics, and has no effects beyond loading the library and cuInit.
pub fn probe() -> Probe {
    let lib = match library() {
        Ok(lib) => lib,
        Err(e) => {
            return Probe {
                reason: Some(e.to_string()),
                ..Probe::default()
            }
        }
    };
    let mut p = Probe {
        found: true,
        path: Some(lib.path().to_owned()),
        // cuDriverGetVersion works without cuInit, so it is reported even
        // when init fails.
        driver_version: lib.driver_version().ok(),
        ..Probe::default()
    };
    match driver().and_then(Cuda::device_count) {
        Ok(n) => p.device_count = Some(n),
        Err(e) => p.reason = Some(e.to_string()),
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The driver, or `None` (test skipped) on machines without a usable GPU.
    fn gpu() -> Option<&'static Cuda> {
        match driver() {
            Ok(c) if c.device_count().unwrap_or(0) > 0 => Some(c),
            _ => {
                eprintln!("no usable CUDA device: skipped");
                None
            }
        }
    }

    #[test]
    fn missing_library_is_reported_not_panicked() {
        let names = [
            OsStr::new("libckptio-no-such-lib.so.1"),
            OsStr::new("/nonexistent/libcuda.so.1"),
        ];
        let err = load_from(&names).unwrap_err();
        assert!(err.contains("libckptio-no-such-lib.so.1"), "{err}");
        assert!(err.contains("/nonexistent/libcuda.so.1"), "{err}");
    }

    #[test]
    fn library_without_cuda_symbols_is_reported() {
        // libc loads everywhere but has no cuInit.
        let err = load_from(&[OsStr::new("libc.so.6")]).unwrap_err();
        assert!(err.contains("cuInit"), "{err}");
    }

    #[test]
    fn driver_fails_cleanly_or_works() {
        match driver() {
            Ok(c) => assert!(!c.path().is_empty()),
            Err(Error::Library { name, reason }) => {
                assert_eq!(name, "libcuda");
                assert!(!reason.is_empty());
            }
            Err(Error::Cuda { call, .. }) => assert_eq!(call, "cuInit"),
            Err(e) => panic!("unexpected error kind: {e:?}"),
        }
        // Remembered: a second call gives the same kind of answer.
        assert_eq!(driver().is_ok(), driver().is_ok());
    }

    #[test]
    fn probe_never_panics_and_explains_absence() {
        let p = probe();
        if !p.found {
            assert!(p.reason.is_some());
            assert!(p.path.is_none());
        }
        assert!(!p.to_string().is_empty());
    }

    #[test]
    fn probe_display() {
        let p = Probe {
            found: true,
            path: Some("/usr/lib/libcuda.so.1".into()),
            driver_version: Some(13000),
            device_count: Some(2),
            reason: None,
        };
        assert_eq!(
            p.to_string(),
            "/usr/lib/libcuda.so.1, CUDA 13.0, 2 device(s)"
        );
        let q = Probe {
            reason: Some("libcuda unavailable: not found".into()),
            ..Probe::default()
        };
        assert_eq!(
            q.to_string(),
            "not available: libcuda unavailable: not found"
        );
    }

    #[test]
    fn empty_pinned_buffer_needs_no_driver() {
        let mut b = PinnedBuffer::new(0).unwrap();
        assert!(b.is_empty());
        assert!(b.as_slice().is_empty());
        assert!(b.as_mut_slice().is_empty());
    }

    #[test]
    fn host_register_rejects_empty_range() {
        let mut x = [0u8; 4];
        // SAFETY: the range is invalid on purpose and rejected before any driver call.
        let r = unsafe { host_register(x.as_mut_ptr(), 0) };
        assert!(matches!(r, Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn handles_are_send() {
        fn send<T: Send>() {}
        fn sync<T: Sync>() {}
        send::<Stream>();
        send::<PinnedBuffer>();
        sync::<PinnedBuffer>();
        send::<HostRegistration>();
        sync::<Cuda>();
    }

    // The tests below run only where a GPU is present. Elsewhere they return early.

    /// cuMemAlloc / cuMemFree for tests, from the same (already loaded) library.
    struct DevMem(u64, &'static Cuda);
    type MemAlloc = unsafe extern "C" fn(*mut u64, usize) -> CUresult;
    type MemFree = unsafe extern "C" fn(u64) -> CUresult;

    impl DevMem {
        fn new(cuda: &'static Cuda, len: usize) -> DevMem {
            // SAFETY: the signature is cuMemAlloc_v2's in cuda.h.
            let alloc: MemAlloc = unsafe { symbol(&cuda._lib, "cuMemAlloc_v2") }.unwrap();
            let mut p = 0u64;
            // SAFETY: writes one device pointer. The context is current (caller).
            cuda.check("cuMemAlloc", unsafe { alloc(&mut p, len) })
                .unwrap();
            DevMem(p, cuda)
        }
    }

    impl Drop for DevMem {
        fn drop(&mut self) {
            // SAFETY: the signature is cuMemFree_v2's in cuda.h.
            let free: MemFree = unsafe { symbol(&self.1._lib, "cuMemFree_v2") }.unwrap();
            // SAFETY: frees our own allocation once.
            unsafe { free(self.0) };
        }
    }

    #[test]
    fn gpu_roundtrip_through_pinned_memory() {
        let Some(cuda) = gpu() else { return };
        assert!(cuda.driver_version().unwrap() >= 11000);
        let stream = Stream::new(0).unwrap();
        assert_eq!(stream.device(), 0);
        let len = 8 << 20;
        let dev = DevMem::new(cuda, len);
        assert_eq!(cuda.pointer_device(dev.0).unwrap(), Some(0));
        assert_eq!(cuda.pointer_device(dev.0 + 4096).unwrap(), Some(0));
        // Also from a thread with no current context (no make_current).
        let p = dev.0;
        let other = std::thread::spawn(move || driver().unwrap().pointer_device(p).unwrap());
        assert_eq!(other.join().unwrap(), Some(0));

        let mut src = PinnedBuffer::new(len).unwrap();
        for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        // Pinned host memory is not device memory.
        assert_eq!(cuda.pointer_device(src.as_ptr() as u64).unwrap(), None);
        let heap = Box::new([0u8; 64]);
        assert_eq!(cuda.pointer_device(heap.as_ptr() as u64).unwrap(), None);

        let mut dst = PinnedBuffer::new(len).unwrap();
        // SAFETY: both ranges are `len` bytes, live until after synchronize.
        unsafe {
            cuda.memcpy_htod_async(dev.0, src.as_ptr(), len, &stream)
                .unwrap();
            cuda.memcpy_dtoh_async(dst.as_mut_ptr(), dev.0, len, &stream)
                .unwrap();
        }
        stream.synchronize().unwrap();
        assert!(src.as_slice() == dst.as_slice());
    }

    #[test]
    fn gpu_host_register_and_threads() {
        let Some(cuda) = gpu() else { return };
        let len = 4 << 20;
        let mut host = vec![0u8; len];
        // A fresh thread has no current context. make_current gives it torch's one.
        let ptr = host.as_mut_ptr() as usize;
        std::thread::spawn(move || {
            let cuda = driver().unwrap();
            let stream = Stream::new(0).unwrap();
            let dev = DevMem::new(cuda, len);
            // SAFETY: `host` outlives this scope (joined below) and is registered once.
            let reg = unsafe { host_register(ptr as *mut u8, len) }.unwrap();
            let mut pattern = PinnedBuffer::new(len).unwrap();
            pattern.as_mut_slice().fill(0xA5);
            // SAFETY: all ranges are `len` bytes and live until synchronize.
            unsafe {
                cuda.memcpy_htod_async(dev.0, pattern.as_ptr(), len, &stream)
                    .unwrap();
                cuda.memcpy_dtoh_async(reg.as_ptr(), dev.0, len, &stream)
                    .unwrap();
            }
            stream.synchronize().unwrap();
            reg.unregister().unwrap();
            // Dropped on another thread from the one that allocated: still fine.
            std::thread::spawn(move || drop(stream)).join().unwrap();
        })
        .join()
        .unwrap();
        assert!(host.iter().all(|&b| b == 0xA5));
        assert!(cuda.make_current(i32::MAX).is_err());
        assert!(matches!(
            cuda.make_current(-1),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn gpu_events_order_streams_and_the_host() {
        let Some(_) = gpu() else { return };
        let s = Stream::new(0).unwrap();
        // SAFETY: `s` is a live stream of device 0, and null is the legacy stream.
        let (on_s, on_legacy) = unsafe {
            (
                Event::record(0, s.as_raw()).unwrap(),
                Event::record(0, ptr::null_mut()).unwrap(),
            )
        };
        assert_eq!(on_s.device(), 0);
        let other = Stream::new(0).unwrap();
        other.wait(&on_s).unwrap();
        other.wait(&on_legacy).unwrap();
        on_s.synchronize().unwrap();
        on_legacy.synchronize().unwrap();
        other.synchronize().unwrap();
        // An event may go while a stream still waits on it.
        // SAFETY: as above.
        let e = unsafe { Event::record(0, s.as_raw()) }.unwrap();
        other.wait(&e).unwrap();
        // Serials tell events apart (a bounce slot's stream waits once per event).
        assert!(on_s.serial() > 0 && on_legacy.serial() > on_s.serial());
        assert!(e.serial() > on_legacy.serial());
        drop(e);
        other.synchronize().unwrap();
    }

    #[test]
    fn gpu_make_current_sets_a_context_it_finds_unset() {
        let Some(cuda) = gpu() else { return };
        std::thread::spawn(move || {
            let current = || {
                let mut c: CUcontext = ptr::null_mut();
                // SAFETY: writes one CUcontext.
                assert_eq!(unsafe { (cuda.api.ctx_get_current)(&mut c) }, CUDA_SUCCESS);
                c
            };
            assert!(current().is_null(), "a fresh thread has no context");
            cuda.make_current(0).unwrap();
            let primary = current();
            assert!(!primary.is_null());
            cuda.make_current(0).unwrap(); // the cached path
            assert_eq!(current(), primary);
            // Someone else unbinds it (as torch may on its threads): the next
            // call must notice, not trust its cache.
            // SAFETY: null unbinds the thread's context.
            unsafe { (cuda.api.ctx_set_current)(ptr::null_mut()) };
            cuda.make_current(0).unwrap();
            assert_eq!(current(), primary);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn gpu_pinned_buffers_count_against_the_cap() {
        let Some(_) = gpu() else { return };
        let b = PinnedBuffer::new(1 << 20).unwrap();
        assert!(budget::held() >= 1 << 20);
        drop(b);
        // A request larger than any cap can allow is refused, not allocated.
        assert!(PinnedBuffer::within_budget(usize::MAX / 2)
            .unwrap()
            .is_none());
        assert!(PinnedBuffer::new(usize::MAX / 2).is_err());
    }

    #[test]
    fn gpu_error_names_come_from_the_driver() {
        let Some(cuda) = gpu() else { return };
        assert_eq!(cuda.error_name(100), "CUDA_ERROR_NO_DEVICE");
        assert_eq!(cuda.error_name(1), "CUDA_ERROR_INVALID_VALUE");
        assert_eq!(cuda.error_name(123456), "CUresult 123456");
    }
}
