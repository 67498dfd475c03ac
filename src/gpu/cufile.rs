//! cuFile (GPUDirect Storage), with libcufile loaded at run time.
//!
//! cuFile moves data between GPU memory and a file. It uses P2P DMA when the
//! nvidia-fs driver is loaded. Otherwise it runs in "compat mode", with POSIX I/O
//! through its own bounce buffers. We dlopen libcufile so that ckptio works, and
//! falls back to its own pinned-buffer path, where the library is missing or
//! broken. Symbols are resolved tolerantly: optional ones are `Option`, and a
//! missing required one is an [`Error::Library`], never a panic.
//!
//! The driver is opened once per process and never closed. Other users in the
//! process (torch.cuda.gds, KvikIO) share cuFile's state, and a close at exit
//! would pull it from under them.

use std::ffi::{c_int, c_long, c_uint, c_void, OsString};
use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::OnceLock;

use libloading::Library;

use crate::error::{Error, Result};
use crate::gpu::symbol;

/// `CUfileError_t`: the cuFile status and, for CU_FILE_CUDA_DRIVER_ERROR, the CUresult.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUfileError {
    pub err: c_int,
    pub cu_err: c_int,
}

/// The union inside `CUfileDescr_t`: an fd on Linux, a HANDLE on Windows.
#[repr(C)]
#[derive(Clone, Copy)]
pub union CUfileDescrHandle {
    pub fd: c_int,
    pub handle: *mut c_void,
}

/// `CUfileDescr_t`. The C enum `type` is an int. On LP64 the union sits at
/// offset 8 and `fs_ops` at 16, 24 bytes in all (asserted in the tests).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUfileDescr {
    pub type_: c_int,
    pub handle: CUfileDescrHandle,
    /// `const CUfileFSOps_t *`. Null means a kernel file system.
    pub fs_ops: *const c_void,
}

/// `CU_FILE_HANDLE_TYPE_OPAQUE_FD`.
const CU_FILE_HANDLE_TYPE_OPAQUE_FD: c_int = 1;

/// The `nvfs` part of `CUfileDrvProps_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUfileDrvPropsNvfs {
    /// nvidia-fs kernel driver version. 0.0 means it is not loaded (compat mode only).
    pub major_version: c_uint,
    pub minor_version: c_uint,
    /// In KiB, like cufile.json's `poll_mode_max_size_kb`.
    pub poll_thresh_size: usize,
    /// In KiB, like cufile.json's `max_direct_io_size_kb`.
    pub max_direct_io_size: usize,
    /// Bit n set: file-system type n supported (CUfileDriverStatusFlags).
    pub dstatusflags: c_uint,
    /// Bit 0 poll mode, bit 1 compat mode allowed (CUfileDriverControlFlags).
    pub dcontrolflags: c_uint,
}

/// `CUfileDrvProps_t`, as in cufile.h from CUDA 11.6 to 13.x. The sizes are in KiB.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUfileDrvProps {
    pub nvfs: CUfileDrvPropsNvfs,
    pub fflags: c_uint,
    pub max_device_cache_size: c_uint,
    pub per_buffer_cache_size: c_uint,
    pub max_device_pinned_mem_size: c_uint,
    pub max_batch_io_size: c_uint,
    pub max_batch_io_timeout_msecs: c_uint,
}

/// `CU_FILE_ALLOW_COMPAT_MODE`, a bit index into `dcontrolflags`.
const CU_FILE_ALLOW_COMPAT_MODE: c_uint = 1;

const CU_FILE_SUCCESS: c_int = 0;
const CU_FILE_CUDA_DRIVER_ERROR: c_int = 5011;
const CU_FILE_DRIVER_ALREADY_OPEN: c_int = 5026;
const CU_FILE_HANDLE_NOT_REGISTERED: c_int = 5027;
/// cuFile status codes start above this (CUFILEOP_BASE_ERR).
const CUFILEOP_BASE_ERR: i64 = 5000;

/// CUfileOpError codes, enum names and messages, from cufile.h (CUDA 13 and
/// cuda-python's OpError). `cuFileGetErrorString` is a header macro, not an
/// exported symbol, so we keep our own table. Codes 5039-5050 are as of
/// CUDA 12.9/13. Before that, 5038 or 5039 was the unused IO_MAX_ERROR sentinel.
#[rustfmt::skip]
const OP_ERRORS: &[(i32, &str, &str)] = &[
    (0, "CU_FILE_SUCCESS", "success"),
    (5001, "CU_FILE_DRIVER_NOT_INITIALIZED", "nvidia-fs driver is not loaded and compat mode is off"),
    (5002, "CU_FILE_DRIVER_INVALID_PROPS", "invalid property"),
    (5003, "CU_FILE_DRIVER_UNSUPPORTED_LIMIT", "property range error"),
    (5004, "CU_FILE_DRIVER_VERSION_MISMATCH", "nvidia-fs driver version mismatch"),
    (5005, "CU_FILE_DRIVER_VERSION_READ_ERROR", "nvidia-fs driver version read error"),
    (5006, "CU_FILE_DRIVER_CLOSING", "driver shutdown in progress"),
    (5007, "CU_FILE_PLATFORM_NOT_SUPPORTED", "GPUDirect Storage not supported on this platform"),
    (5008, "CU_FILE_IO_NOT_SUPPORTED", "GPUDirect Storage not supported on this file"),
    (5009, "CU_FILE_DEVICE_NOT_SUPPORTED", "GPUDirect Storage not supported on this GPU"),
    (5010, "CU_FILE_NVFS_DRIVER_ERROR", "nvidia-fs driver ioctl error"),
    (5011, "CU_FILE_CUDA_DRIVER_ERROR", "CUDA driver API error"),
    (5012, "CU_FILE_CUDA_POINTER_INVALID", "invalid device pointer"),
    (5013, "CU_FILE_CUDA_MEMORY_TYPE_INVALID", "invalid pointer memory type"),
    (5014, "CU_FILE_CUDA_POINTER_RANGE_ERROR", "pointer range exceeds the allocated address range"),
    (5015, "CU_FILE_CUDA_CONTEXT_MISMATCH", "CUDA context mismatch"),
    (5016, "CU_FILE_INVALID_MAPPING_SIZE", "access beyond maximum pinned size"),
    (5017, "CU_FILE_INVALID_MAPPING_RANGE", "access beyond mapped size"),
    (5018, "CU_FILE_INVALID_FILE_TYPE", "unsupported file type"),
    (5019, "CU_FILE_INVALID_FILE_OPEN_FLAG", "unsupported file open flags"),
    (5020, "CU_FILE_DIO_NOT_SET", "fd direct I/O not set"),
    (5021, "CU_FILE_EXPECTED_FILE_MODE", "unexpected file mode"),
    (5022, "CU_FILE_INVALID_VALUE", "invalid arguments"),
    (5023, "CU_FILE_MEMORY_ALREADY_REGISTERED", "device pointer already registered"),
    (5024, "CU_FILE_MEMORY_NOT_REGISTERED", "device pointer lookup failure"),
    (5025, "CU_FILE_PERMISSION_DENIED", "driver or file access error"),
    (5026, "CU_FILE_DRIVER_ALREADY_OPEN", "driver is already open"),
    (5027, "CU_FILE_HANDLE_NOT_REGISTERED", "file descriptor is not registered"),
    (5028, "CU_FILE_HANDLE_ALREADY_REGISTERED", "file descriptor is already registered"),
    (5029, "CU_FILE_DEVICE_NOT_FOUND", "GPU device not found"),
    (5030, "CU_FILE_INTERNAL_ERROR", "internal error"),
    (5031, "CU_FILE_GETNEWFD_FAILED", "failed to obtain new file descriptor"),
    (5033, "CU_FILE_NVFS_SETUP_ERROR", "nvidia-fs driver initialization error"),
    (5034, "CU_FILE_IO_DISABLED", "GPUDirect Storage disabled by config on this file"),
    (5035, "CU_FILE_BATCH_SUBMIT_FAILED", "failed to submit batch operation"),
    (5036, "CU_FILE_GPU_MEMORY_PINNING_FAILED", "failed to allocate pinned GPU memory"),
    (5037, "CU_FILE_BATCH_FULL", "queue full for batch operation"),
    (5038, "CU_FILE_ASYNC_NOT_SUPPORTED", "cuFile stream operation not supported"),
    (5039, "CU_FILE_INTERNAL_BATCH_SETUP_ERROR", "batch setup internal error"),
    (5040, "CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR", "batch submit internal error"),
    (5041, "CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR", "batch get-status internal error"),
    (5042, "CU_FILE_INTERNAL_BATCH_CANCEL_ERROR", "batch cancel internal error"),
    (5043, "CU_FILE_NOMEM_ERROR", "out of memory"),
    (5044, "CU_FILE_IO_ERROR", "I/O error"),
    (5045, "CU_FILE_INTERNAL_BUF_REGISTER_ERROR", "buffer registration internal error"),
    (5046, "CU_FILE_HASH_OPR_ERROR", "hash operation error"),
    (5047, "CU_FILE_INVALID_CONTEXT_ERROR", "invalid context"),
    (5048, "CU_FILE_NVFS_INTERNAL_DRIVER_ERROR", "nvidia-fs internal driver error"),
    (5049, "CU_FILE_BATCH_NOCOMPAT_ERROR", "batch I/O needs compat mode, which is off"),
];

fn lookup(code: i32) -> Option<&'static (i32, &'static str, &'static str)> {
    OP_ERRORS.iter().find(|(c, _, _)| *c == code)
}

/// The enum name of a CUfileOpError code ("CU_FILE_HANDLE_NOT_REGISTERED").
/// Negative codes, as returned by cuFileRead/Write, are accepted too.
pub fn error_name(code: i32) -> &'static str {
    lookup(code.saturating_abs()).map_or("CU_FILE_UNKNOWN_ERROR", |e| e.1)
}

/// A one-line description of a CUfileOpError code.
pub fn error_description(code: i32) -> &'static str {
    lookup(code.saturating_abs()).map_or("unknown cuFile error", |e| e.2)
}

/// The [`Error::CuFile`] for a failed call that returned a `CUfileError_t`.
fn status_error(call: &'static str, status: CUfileError) -> Error {
    let mut reason = format!(
        "{}: {}",
        error_name(status.err),
        error_description(status.err)
    );
    if status.err == CU_FILE_HANDLE_NOT_REGISTERED && !Path::new("/run/udev").is_dir() {
        // The usual cause on VMs and in containers: cuFile reads the block device's
        // file-system type from udev's database.
        reason.push_str(" (no /run/udev: cuFile cannot identify the file system)");
    }
    Error::CuFile {
        call,
        code: status.err,
        cuda_code: if status.err == CU_FILE_CUDA_DRIVER_ERROR {
            status.cu_err
        } else {
            0
        },
        reason,
    }
}

/// Decodes cuFileRead/Write's `ssize_t`. A non-negative value is the bytes
/// moved. -1 means errno is set. Anything below is -CUfileOpError.
/// `last_os_error` is called only for -1, and must read errno at once.
fn decode_transfer(
    call: &'static str,
    ret: isize,
    last_os_error: impl FnOnce() -> io::Error,
) -> Result<usize> {
    if let Ok(n) = usize::try_from(ret) {
        return Ok(n);
    }
    if ret == -1 {
        return Err(Error::io(call, None, last_os_error()));
    }
    let code = i64::try_from(ret).map_or(i64::MAX, |r| r.saturating_neg());
    let code32 = i32::try_from(code).unwrap_or(i32::MAX);
    if code > CUFILEOP_BASE_ERR {
        Err(Error::CuFile {
            call,
            code: code32,
            cuda_code: 0,
            reason: format!("{}: {}", error_name(code32), error_description(code32)),
        })
    } else {
        // The header promises only -1 or -CUfileOpError. A small negative value is
        // most plausibly a negated errno, so report it as such.
        Err(Error::io(call, None, io::Error::from_raw_os_error(code32)))
    }
}

/// The libcufile entry points. The types are the C signatures from cufile.h
/// (off_t = i64 and ssize_t = isize on 64-bit Linux).
struct Api {
    driver_open: unsafe extern "C" fn() -> CUfileError,
    driver_get_properties: unsafe extern "C" fn(*mut CUfileDrvProps) -> CUfileError,
    handle_register: unsafe extern "C" fn(*mut *mut c_void, *mut CUfileDescr) -> CUfileError,
    handle_deregister: unsafe extern "C" fn(*mut c_void),
    read: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, i64, i64) -> isize,
    write: unsafe extern "C" fn(*mut c_void, *const c_void, usize, i64, i64) -> isize,
    // Optional. Older or stripped builds may lack them.
    buf_register: Option<unsafe extern "C" fn(*const c_void, usize, c_int) -> CUfileError>,
    buf_deregister: Option<unsafe extern "C" fn(*const c_void) -> CUfileError>,
    get_version: Option<unsafe extern "C" fn(*mut c_int) -> CUfileError>,
    use_count: Option<unsafe extern "C" fn() -> c_long>,
    /// cuFileDriverClose_v2 (what cufile.h's macro selects), else cuFileDriverClose.
    /// Resolved only so that `probe` can report it. We never call it (module doc).
    driver_close: Option<unsafe extern "C" fn() -> CUfileError>,
}

impl Api {
    fn load(lib: &Library) -> std::result::Result<Api, String> {
        // SAFETY: every type is the declaration in cufile.h: CUfileError_t is
        // {int, int} returned by value; CUfileHandle_t is void*; off_t is i64.
        unsafe {
            Ok(Api {
                driver_open: symbol(lib, "cuFileDriverOpen")?,
                driver_get_properties: symbol(lib, "cuFileDriverGetProperties")?,
                handle_register: symbol(lib, "cuFileHandleRegister")?,
                handle_deregister: symbol(lib, "cuFileHandleDeregister")?,
                read: symbol(lib, "cuFileRead")?,
                write: symbol(lib, "cuFileWrite")?,
                buf_register: symbol(lib, "cuFileBufRegister").ok(),
                buf_deregister: symbol(lib, "cuFileBufDeregister").ok(),
                get_version: symbol(lib, "cuFileGetVersion").ok(),
                use_count: symbol(lib, "cuFileUseCount").ok(),
                driver_close: symbol(lib, "cuFileDriverClose_v2")
                    .or_else(|_| symbol(lib, "cuFileDriverClose"))
                    .ok(),
            })
        }
    }
}

/// The loaded libcufile. Obtain it with [`library`].
pub struct CuFileLib {
    api: Api,
    path: String,
    /// Keeps the code behind `api` mapped. Never dropped, since it lives in a static.
    _lib: Library,
}

impl fmt::Debug for CuFileLib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CuFileLib")
            .field("path", &self.path)
            .finish()
    }
}

impl CuFileLib {
    /// The file the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// cuFileGetVersion: 1000 * major + 10 * minor (1.15 gives 1150). `None`
    /// if the symbol is missing (cuFile < 1.7) or the call fails.
    pub fn version(&self) -> Option<i32> {
        let get = self.api.get_version?;
        let mut v: c_int = 0;
        // SAFETY: writes one int. It needs no open driver.
        let st = unsafe { get(&mut v) };
        (st.err == CU_FILE_SUCCESS).then_some(v)
    }

    /// Optional symbols this build lacks, for diagnostics.
    pub fn missing_optional_symbols(&self) -> Vec<&'static str> {
        let a = &self.api;
        let mut v = Vec::new();
        if a.buf_register.is_none() || a.buf_deregister.is_none() {
            v.push("cuFileBufRegister/cuFileBufDeregister");
        }
        if a.get_version.is_none() {
            v.push("cuFileGetVersion");
        }
        if a.use_count.is_none() {
            v.push("cuFileUseCount");
        }
        if a.driver_close.is_none() {
            v.push("cuFileDriverClose");
        }
        v
    }

    /// How many users hold the driver open in this process (cuFileUseCount), if known.
    pub fn use_count(&self) -> Option<c_long> {
        let f = self.api.use_count?;
        // SAFETY: takes no arguments and only reads a counter.
        Some(unsafe { f() })
    }
}

/// The name used in [`Error::Library`].
const LIB_NAME: &str = "libcufile";

/// Where to look for libcufile, in order.
///
/// Sonames come first. If torch (or anything else) already loaded libcufile,
/// dlopen by soname returns that same copy, so one process never holds two
/// cuFile instances with separate driver state. Then comes the explicit file
/// named by `CKPTIO_CUFILE_LIB`, then the usual toolkit directories.
fn candidates(explicit: Option<OsString>, cuda_home: Option<OsString>) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = vec!["libcufile.so.0".into(), "libcufile.so".into()];
    if let Some(p) = explicit.filter(|p| !p.is_empty()) {
        v.push(p.into());
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(h) = cuda_home.filter(|h| !h.is_empty()) {
        dirs.push(Path::new(&h).join("lib64"));
    }
    dirs.push("/usr/local/cuda/lib64".into());
    #[cfg(target_arch = "aarch64")]
    dirs.push("/usr/local/cuda/targets/sbsa-linux/lib".into());
    #[cfg(not(target_arch = "aarch64"))]
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    for d in dirs {
        v.push(d.join("libcufile.so.0"));
        v.push(d.join("libcufile.so"));
    }
    v
}

/// Opens the first loadable candidate and resolves the API. The error lists
/// every attempt.
fn load_from(candidates: &[PathBuf]) -> std::result::Result<CuFileLib, String> {
    let mut tried = Vec::new();
    for name in candidates {
        // SAFETY: loading runs libcufile's initialisers, as any cuFile program
        // does. The library is never unloaded.
        match unsafe { Library::new(name.as_os_str()) } {
            Ok(lib) => {
                let api = Api::load(&lib).map_err(|e| format!("{}: {e}", name.display()))?;
                let path = crate::gpu::cuda::loaded_path(api.driver_open as *const c_void)
                    .unwrap_or_else(|| name.display().to_string());
                return Ok(CuFileLib {
                    api,
                    path,
                    _lib: lib,
                });
            }
            Err(e) => tried.push(format!("{}: {e}", name.display())),
        }
    }
    Err(format!("not found (tried {})", tried.join("; ")))
}

static LIB: OnceLock<std::result::Result<CuFileLib, String>> = OnceLock::new();

/// libcufile, loaded once per process. A failure is remembered and reported
/// as [`Error::Library`] on every call. `CKPTIO_CUFILE_LIB` and `CUDA_HOME`
/// are read on the first call only.
pub fn library() -> Result<&'static CuFileLib> {
    let res = LIB.get_or_init(|| {
        let env = |k: &str| std::env::var_os(k);
        load_from(&candidates(env("CKPTIO_CUFILE_LIB"), env("CUDA_HOME")))
    });
    match res {
        Ok(lib) => Ok(lib),
        Err(reason) => Err(Error::Library {
            name: LIB_NAME.into(),
            reason: reason.clone(),
        }),
    }
}

/// Runs `f`, and puts `fd` back if `f` closed it.
///
/// Some libcufile versions close fd 0 in cuFileDriverOpen's error path (seen
/// with nvidia-fs loaded but /dev/nvidia-fs* absent; fastsafetensors PR #102,
/// DALI PR #5902). Then the next file opened silently becomes "stdin". We keep a
/// duplicate and dup2 it back. If `fd` is open again afterwards, but on another
/// file, we leave it alone, since we cannot tell who owns it.
fn preserving_fd<T>(fd: RawFd, f: impl FnOnce() -> T) -> T {
    // SAFETY: F_DUPFD_CLOEXEC duplicates `fd` to a new descriptor >= 3 that we own.
    // -1 (fd not open) just means there is nothing to restore.
    let saved = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    let out = f();
    if saved >= 0 {
        // SAFETY: F_GETFD only queries the descriptor table.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1 {
            // SAFETY: `saved` is our descriptor. dup2 makes `fd` refer to the same
            // open file again, without close-on-exec, as before.
            unsafe { libc::dup2(saved, fd) };
        }
        // SAFETY: closes only the duplicate we made.
        unsafe { libc::close(saved) };
    }
    out
}

/// The opened cuFile driver and its properties. Obtain it with [`driver`].
#[derive(Debug)]
pub struct Driver {
    lib: &'static CuFileLib,
    props: CUfileDrvProps,
    version: Option<i32>,
}

/// A failed open, kept so that later calls report the same error.
#[derive(Clone, Debug)]
enum OpenFailure {
    Library(String),
    CuFile {
        call: &'static str,
        code: i32,
        cuda_code: i32,
        reason: String,
    },
}

impl OpenFailure {
    fn to_error(&self) -> Error {
        match self.clone() {
            OpenFailure::Library(reason) => Error::Library {
                name: LIB_NAME.into(),
                reason,
            },
            OpenFailure::CuFile {
                call,
                code,
                cuda_code,
                reason,
            } => Error::CuFile {
                call,
                code,
                cuda_code,
                reason,
            },
        }
    }

    fn from_error(e: Error) -> OpenFailure {
        match e {
            Error::CuFile {
                call,
                code,
                cuda_code,
                reason,
            } => OpenFailure::CuFile {
                call,
                code,
                cuda_code,
                reason,
            },
            Error::Library { reason, .. } => OpenFailure::Library(reason),
            other => OpenFailure::Library(other.to_string()),
        }
    }
}

static DRIVER: OnceLock<std::result::Result<Driver, OpenFailure>> = OnceLock::new();

/// The folder of `CUFILE_LOGFILE_PATH` (ckptio's Python package points it into
/// its cache folder at import, without making anything), made now that cuFile
/// first runs and writes its log there. Best effort: cuFile logs nothing where
/// the folder cannot be made.
fn make_log_folder() {
    use std::os::unix::fs::DirBuilderExt;
    if let Some(p) = std::env::var_os("CUFILE_LOGFILE_PATH") {
        if let Some(dir) = std::path::Path::new(&p).parent() {
            let _ = std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir);
        }
    }
}

fn open_driver() -> Result<Driver> {
    let lib = library()?;
    // cuFile needs a CUDA device; without one, libcufile 1.17's cuFileDriverOpen
    // was seen spinning forever (a CPU-only machine with the pip wheel). Never
    // call it unless the CUDA driver is up and sees a device.
    let cuda = crate::gpu::cuda::driver()?;
    if cuda.device_count()? < 1 {
        return Err(Error::Library {
            name: "libcufile".into(),
            reason: "no CUDA device: cuFile cannot run".into(),
        });
    }
    make_log_folder();
    // SAFETY: cuFileDriverOpen takes no arguments. preserving_fd undoes its known
    // fd-0 bug.
    let st = preserving_fd(0, || unsafe { (lib.api.driver_open)() });
    // ALREADY_OPEN: another user in the process (e.g. torch) opened it. That is fine,
    // since the driver is shared.
    if st.err != CU_FILE_SUCCESS && st.err != CU_FILE_DRIVER_ALREADY_OPEN {
        return Err(status_error("cuFileDriverOpen", st));
    }
    // Room beyond the struct we know, in case a newer libcufile writes a longer one.
    #[repr(C)]
    #[derive(Default)]
    struct Padded {
        props: CUfileDrvProps,
        _spare: [u64; 32],
    }
    let mut buf = Padded::default();
    // SAFETY: writes one CUfileDrvProps_t (the layout matches cufile.h) into
    // memory with spare room after it.
    let st = unsafe { (lib.api.driver_get_properties)(&mut buf.props) };
    if st.err != CU_FILE_SUCCESS {
        return Err(status_error("cuFileDriverGetProperties", st));
    }
    Ok(Driver {
        lib,
        props: buf.props,
        version: lib.version(),
    })
}

/// The cuFile driver, opened once per process (never closed). A failure is
/// remembered: a missing library gives [`Error::Library`], and a failed open
/// gives [`Error::CuFile`].
pub fn driver() -> Result<&'static Driver> {
    match DRIVER.get_or_init(|| open_driver().map_err(OpenFailure::from_error)) {
        Ok(d) => Ok(d),
        Err(f) => Err(f.to_error()),
    }
}

impl Driver {
    pub fn library(&self) -> &'static CuFileLib {
        self.lib
    }

    /// cuFileGetVersion (1150 for 1.15), if the library has it.
    pub fn version(&self) -> Option<i32> {
        self.version
    }

    /// The nvidia-fs kernel driver's version. (0, 0) means it is not loaded.
    pub fn nvfs_version(&self) -> (u32, u32) {
        (self.props.nvfs.major_version, self.props.nvfs.minor_version)
    }

    /// True when nvidia-fs is absent (version 0.0, KvikIO's test). Then every
    /// cuFile transfer goes through cuFile's own POSIX compat path, with no P2P
    /// DMA, and our own pinned-buffer path is usually as fast or faster.
    pub fn is_compat_mode(&self) -> bool {
        self.nvfs_version() == (0, 0)
    }

    /// Whether cufile.json allows compat mode (`properties.allow_compat_mode`).
    pub fn allows_compat_mode(&self) -> bool {
        self.props.nvfs.dcontrolflags & (1 << CU_FILE_ALLOW_COMPAT_MODE) != 0
    }

    /// The largest single DMA the driver issues, in KiB, as reported
    /// (cufile.json's `max_direct_io_size_kb`, 16384 by default).
    pub fn max_direct_io_size(&self) -> usize {
        self.props.nvfs.max_direct_io_size
    }

    /// All the properties, as cuFileDriverGetProperties reported them at open.
    pub fn properties(&self) -> &CUfileDrvProps {
        &self.props
    }

    /// Registers an open file with cuFile.
    ///
    /// cuFile < 1.7 needs O_DIRECT, newer builds do not. On VMs and in containers
    /// without `/run/udev`, this fails with CU_FILE_HANDLE_NOT_REGISTERED (5027).
    /// Callers should then fall back to the pinned-buffer path for the file.
    ///
    /// # Safety
    /// `fd` must be an open regular file. It must stay open, referring to the
    /// same file, until the returned handle is dropped. cuFile keeps using the
    /// number, and once closed it could be reused for another file.
    pub unsafe fn register(&'static self, fd: RawFd) -> Result<FileHandle> {
        let mut descr = CUfileDescr {
            type_: CU_FILE_HANDLE_TYPE_OPAQUE_FD,
            // Zero the whole union first (it is 8 bytes, fd only 4).
            handle: CUfileDescrHandle {
                handle: ptr::null_mut(),
            },
            fs_ops: ptr::null(),
        };
        descr.handle.fd = fd;
        let mut raw: *mut c_void = ptr::null_mut();
        // SAFETY: `descr` is a valid CUfileDescr_t that cuFile only reads during the
        // call. `raw` receives the handle. The caller keeps `fd` open.
        let st = unsafe { (self.lib.api.handle_register)(&mut raw, &mut descr) };
        if st.err != CU_FILE_SUCCESS {
            return Err(status_error("cuFileHandleRegister", st));
        }
        Ok(FileHandle {
            raw,
            fd,
            lib: self.lib,
        })
    }

    /// Registers device memory with cuFile (cuFileBufRegister, flags 0) for
    /// reuse across many transfers. It pays only for a buffer reused many
    /// times: cuFile otherwise stages through its own pinned buffers, and the
    /// pinned-memory limit (max_device_pinned_mem_size) bounds what can be
    /// registered (CU_FILE_INVALID_MAPPING_SIZE, 5016).
    ///
    /// # Safety
    /// `dev_ptr..dev_ptr+len` must be one live device allocation (cuMemAlloc or
    /// torch's allocator) that stays allocated until the returned guard is
    /// dropped.
    pub unsafe fn register_buffer(
        &'static self,
        dev_ptr: u64,
        len: usize,
    ) -> Result<BufferRegistration> {
        let (Some(reg), Some(dereg)) = (self.lib.api.buf_register, self.lib.api.buf_deregister)
        else {
            return Err(Error::Library {
                name: LIB_NAME.into(),
                reason: "cuFileBufRegister/cuFileBufDeregister not found".into(),
            });
        };
        let ptr = dev_ptr as usize as *const c_void;
        // SAFETY: the caller guarantees the range is a live device allocation that
        // outlives the registration. cuFile only records and pins it.
        let st = unsafe { reg(ptr, len, 0) };
        if st.err != CU_FILE_SUCCESS {
            return Err(status_error("cuFileBufRegister", st));
        }
        Ok(BufferRegistration {
            dev_ptr,
            len,
            deregister: dereg,
        })
    }
}

/// A file registered with cuFile. Dropping it deregisters the file, but does
/// not close the fd.
///
/// cuFile's I/O calls are thread-safe. Several threads may issue reads and
/// writes at different offsets on one handle at once.
#[derive(Debug)]
pub struct FileHandle {
    raw: *mut c_void,
    fd: RawFd,
    lib: &'static CuFileLib,
}

// SAFETY: CUfileHandle_t is an opaque handle into cuFile's process-wide tables.
// cuFile may use and deregister it from any thread.
unsafe impl Send for FileHandle {}
// SAFETY: cuFileRead/cuFileWrite are documented thread-safe (GDS best-practices
// guide). `&FileHandle` exposes only those calls and plain getters.
unsafe impl Sync for FileHandle {}

/// An offset as `off_t`, or an error if it does not fit.
fn off_t(what: &str, v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::invalid(format!("{what} {v} exceeds off_t")))
}

impl FileHandle {
    /// The registered fd.
    pub fn fd(&self) -> RawFd {
        self.fd
    }

    /// Reads up to `size` bytes at `file_offset` into device memory at
    /// `dev_ptr + buf_offset`. Returns the bytes read, which is fewer than
    /// `size` only at end of file. Loop for the rest.
    ///
    /// Call it with the buffer's device context current on this thread
    /// (`cuda::Cuda::make_current`), or cuFile reports
    /// CU_FILE_CUDA_CONTEXT_MISMATCH. For P2P, 4 KiB-aligned offsets and sizes
    /// are fastest. Unaligned ones are staged by cuFile.
    ///
    /// # Safety
    /// `dev_ptr + buf_offset .. + size` must lie within one live device
    /// allocation (or registered buffer) that no one else uses during the call.
    /// The fd must still be open on the registered file.
    pub unsafe fn read(
        &self,
        dev_ptr: u64,
        size: usize,
        file_offset: u64,
        buf_offset: u64,
    ) -> Result<usize> {
        let (fo, bo) = (
            off_t("file offset", file_offset)?,
            off_t("buffer offset", buf_offset)?,
        );
        let base = dev_ptr as usize as *mut c_void;
        // SAFETY: the caller guarantees the destination range and the fd. `raw` is
        // registered until `self` drops.
        let ret = unsafe { (self.lib.api.read)(self.raw, base, size, fo, bo) };
        decode_transfer("cuFileRead", ret, io::Error::last_os_error)
    }

    /// Writes `size` bytes from device memory at `dev_ptr + buf_offset` to the
    /// file at `file_offset`. Returns the bytes written. Loop if fewer.
    ///
    /// The same context and alignment notes apply as for [`FileHandle::read`].
    ///
    /// # Safety
    /// `dev_ptr + buf_offset .. + size` must lie within one live device
    /// allocation that is not modified during the call. The fd must still be
    /// open on the registered file.
    pub unsafe fn write(
        &self,
        dev_ptr: u64,
        size: usize,
        file_offset: u64,
        buf_offset: u64,
    ) -> Result<usize> {
        let (fo, bo) = (
            off_t("file offset", file_offset)?,
            off_t("buffer offset", buf_offset)?,
        );
        let base = dev_ptr as usize as *const c_void;
        // SAFETY: the caller guarantees the source range and the fd. `raw` is
        // registered until `self` drops.
        let ret = unsafe { (self.lib.api.write)(self.raw, base, size, fo, bo) };
        decode_transfer("cuFileWrite", ret, io::Error::last_os_error)
    }
}

impl Drop for FileHandle {
    fn drop(&mut self) {
        // SAFETY: `raw` was registered by `Driver::register` and is deregistered
        // once. Any I/O on it has returned, since it needs `&self`.
        unsafe { (self.lib.api.handle_deregister)(self.raw) };
    }
}

/// Device memory registered with cuFile. Dropping it deregisters the memory.
#[derive(Debug)]
pub struct BufferRegistration {
    dev_ptr: u64,
    len: usize,
    deregister: unsafe extern "C" fn(*const c_void) -> CUfileError,
}

// SAFETY: the guard holds an address and a function pointer. cuFile may
// deregister it from any thread.
unsafe impl Send for BufferRegistration {}
// SAFETY: `&BufferRegistration` exposes only plain getters.
unsafe impl Sync for BufferRegistration {}

impl BufferRegistration {
    pub fn dev_ptr(&self) -> u64 {
        self.dev_ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for BufferRegistration {
    fn drop(&mut self) {
        // SAFETY: the pointer was registered by `register_buffer` and is deregistered
        // once. Its allocation is still live (register_buffer's contract). A Drop
        // cannot report the status.
        let _ = unsafe { (self.deregister)(self.dev_ptr as usize as *const c_void) };
    }
}

/// What `ckptio info` prints about cuFile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Probe {
    /// libcufile loaded, with all required symbols.
    pub found: bool,
    /// The file it was loaded from.
    pub path: Option<String>,
    /// cuFileGetVersion: 1000 * major + 10 * minor.
    pub version: Option<i32>,
    /// cuFileDriverOpen succeeded.
    pub driver_open: bool,
    /// The nvidia-fs version. (0, 0) means it is not loaded.
    pub nvfs_version: Option<(u32, u32)>,
    /// No nvidia-fs: cuFile can only run in compat mode (no P2P DMA).
    pub compat_mode: Option<bool>,
    /// cufile.json allows compat mode.
    pub allow_compat_mode: Option<bool>,
    /// Whether `/run/udev` exists. Without it cuFile cannot register files (VMs, containers).
    pub run_udev: bool,
    /// Running under WSL, where cuFile is not supported.
    pub wsl: bool,
    /// Optional symbols this libcufile lacks.
    pub missing_symbols: Vec<&'static str>,
    /// Why cuFile cannot be used, if it cannot.
    pub reason: Option<String>,
}

impl Probe {
    /// Whether cuFile is worth trying for file registration here.
    pub fn usable(&self) -> bool {
        self.driver_open && self.run_udev && !self.wsl
    }
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
        f.write_str(self.path.as_deref().unwrap_or(LIB_NAME))?;
        if let Some(v) = self.version {
            write!(f, ", cuFile {}.{}", v / 1000, (v % 1000) / 10)?;
        }
        match (self.driver_open, self.nvfs_version) {
            (true, Some((0, 0))) => {
                f.write_str(", driver open, no nvidia-fs (compat mode only)")?
            }
            (true, Some((a, b))) => write!(f, ", driver open, nvidia-fs {a}.{b} (P2P DMA)")?,
            (true, None) => f.write_str(", driver open")?,
            (false, _) => f.write_str(", driver not open")?,
        }
        if !self.run_udev {
            f.write_str(", no /run/udev (file registration will fail)")?;
        }
        if self.wsl {
            f.write_str(", WSL (unsupported)")?;
        }
        if let Some(r) = &self.reason {
            write!(f, " ({r})")?;
        }
        Ok(())
    }
}

fn is_wsl() -> bool {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.to_ascii_lowercase().contains("microsoft"))
        .unwrap_or(false)
}

/// Loads libcufile, opens the driver, and reports what it found. It never
/// panics, and has no effects beyond loading the library and opening the driver.
/// The first open can take a while (cuFile initialises CUDA and reads
/// cufile.json). It is cached for the process.
pub fn probe() -> Probe {
    let mut p = Probe {
        run_udev: Path::new("/run/udev").is_dir(),
        wsl: is_wsl(),
        ..Probe::default()
    };
    let lib = match library() {
        Ok(lib) => lib,
        Err(e) => {
            p.reason = Some(e.to_string());
            return p;
        }
    };
    p.found = true;
    p.path = Some(lib.path().to_owned());
    p.version = lib.version();
    p.missing_symbols = lib.missing_optional_symbols();
    match driver() {
        Ok(d) => {
            p.driver_open = true;
            p.nvfs_version = Some(d.nvfs_version());
            p.compat_mode = Some(d.is_compat_mode());
            p.allow_compat_mode = Some(d.allows_compat_mode());
        }
        Err(e) => p.reason = Some(e.to_string()),
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn struct_layouts_match_cufile_h() {
        assert_eq!(size_of::<CUfileError>(), 8);
        assert_eq!(size_of::<CUfileDescrHandle>(), 8);
        assert_eq!(size_of::<CUfileDescr>(), 24);
        assert_eq!(offset_of!(CUfileDescr, type_), 0);
        assert_eq!(offset_of!(CUfileDescr, handle), 8);
        assert_eq!(offset_of!(CUfileDescr, fs_ops), 16);

        assert_eq!(size_of::<CUfileDrvPropsNvfs>(), 32);
        assert_eq!(offset_of!(CUfileDrvPropsNvfs, major_version), 0);
        assert_eq!(offset_of!(CUfileDrvPropsNvfs, minor_version), 4);
        assert_eq!(offset_of!(CUfileDrvPropsNvfs, poll_thresh_size), 8);
        assert_eq!(offset_of!(CUfileDrvPropsNvfs, max_direct_io_size), 16);
        assert_eq!(offset_of!(CUfileDrvPropsNvfs, dstatusflags), 24);
        assert_eq!(offset_of!(CUfileDrvPropsNvfs, dcontrolflags), 28);
        assert_eq!(size_of::<CUfileDrvProps>(), 56);
        assert_eq!(offset_of!(CUfileDrvProps, fflags), 32);
        assert_eq!(offset_of!(CUfileDrvProps, max_batch_io_timeout_msecs), 52);
    }

    #[test]
    fn error_table() {
        assert_eq!(error_name(5016), "CU_FILE_INVALID_MAPPING_SIZE");
        assert_eq!(error_name(5020), "CU_FILE_DIO_NOT_SET");
        assert_eq!(error_name(5027), "CU_FILE_HANDLE_NOT_REGISTERED");
        assert_eq!(error_name(5030), "CU_FILE_INTERNAL_ERROR");
        assert_eq!(error_name(5036), "CU_FILE_GPU_MEMORY_PINNING_FAILED");
        assert_eq!(error_name(5040), "CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR");
        assert_eq!(error_name(-5027), "CU_FILE_HANDLE_NOT_REGISTERED");
        assert_eq!(error_name(0), "CU_FILE_SUCCESS");
        assert_eq!(error_name(5032), "CU_FILE_UNKNOWN_ERROR");
        assert_eq!(error_name(i32::MIN), "CU_FILE_UNKNOWN_ERROR");
        assert_eq!(error_description(5027), "file descriptor is not registered");
        // Every code from 5001 to 5049, except the unassigned 5032, has a name.
        for code in (5001..=5049).filter(|&c| c != 5032) {
            assert_ne!(error_name(code), "CU_FILE_UNKNOWN_ERROR", "{code}");
        }
        // Codes are unique and sorted.
        assert!(OP_ERRORS.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn transfer_results_are_decoded() {
        let no_errno = || -> io::Error { panic!("errno read for a non -1 value") };
        assert_eq!(decode_transfer("cuFileRead", 4096, no_errno).unwrap(), 4096);
        assert_eq!(decode_transfer("cuFileRead", 0, no_errno).unwrap(), 0);

        let e = decode_transfer("cuFileRead", -1, || io::Error::from_raw_os_error(libc::EIO))
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        assert!(matches!(
            e,
            Error::Io {
                op: "cuFileRead",
                ..
            }
        ));

        match decode_transfer("cuFileWrite", -5016, no_errno).unwrap_err() {
            Error::CuFile {
                call, code, reason, ..
            } => {
                assert_eq!(call, "cuFileWrite");
                assert_eq!(code, 5016);
                assert!(
                    reason.starts_with("CU_FILE_INVALID_MAPPING_SIZE"),
                    "{reason}"
                );
            }
            e => panic!("{e:?}"),
        }
        // Defensive: a small negative value is read as -errno.
        let e = decode_transfer("cuFileRead", -(libc::ENOSPC as isize), no_errno).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert!(decode_transfer("cuFileRead", isize::MIN, no_errno).is_err());
    }

    #[test]
    fn status_errors_carry_the_cuda_code_only_for_driver_errors() {
        let e = status_error(
            "cuFileDriverOpen",
            CUfileError {
                err: 5011,
                cu_err: 100,
            },
        );
        assert!(matches!(
            e,
            Error::CuFile {
                code: 5011,
                cuda_code: 100,
                ..
            }
        ));
        let e = status_error(
            "cuFileBufRegister",
            CUfileError {
                err: 5016,
                cu_err: 7,
            },
        );
        assert!(matches!(
            e,
            Error::CuFile {
                code: 5016,
                cuda_code: 0,
                ..
            }
        ));
        assert!(
            e.to_string().contains("CU_FILE_INVALID_MAPPING_SIZE"),
            "{e}"
        );
    }

    #[test]
    fn candidate_order() {
        let c = candidates(
            Some("/opt/x/libcufile.so.0".into()),
            Some("/opt/cuda".into()),
        );
        assert_eq!(c[0], Path::new("libcufile.so.0"));
        assert_eq!(c[1], Path::new("libcufile.so"));
        assert_eq!(c[2], Path::new("/opt/x/libcufile.so.0"));
        assert_eq!(c[3], Path::new("/opt/cuda/lib64/libcufile.so.0"));
        assert!(c.contains(&PathBuf::from("/usr/local/cuda/lib64/libcufile.so.0")));
        // Empty variables are ignored.
        let d = candidates(Some(OsString::new()), Some(OsString::new()));
        assert_eq!(d[2], Path::new("/usr/local/cuda/lib64/libcufile.so.0"));
    }

    #[test]
    fn missing_library_is_an_error_not_a_panic() {
        let err = load_from(&[
            PathBuf::from("libckptio-no-such-cufile.so.0"),
            PathBuf::from("/nonexistent/dir/libcufile.so.0"),
        ])
        .unwrap_err();
        assert!(err.contains("libckptio-no-such-cufile.so.0"), "{err}");
        assert!(err.contains("/nonexistent/dir/libcufile.so.0"), "{err}");
        // A library without cuFile symbols names the first missing one.
        let err = load_from(&[PathBuf::from("libc.so.6")]).unwrap_err();
        assert!(err.contains("cuFileDriverOpen"), "{err}");
    }

    #[test]
    fn library_and_driver_fail_cleanly_or_work() {
        match library() {
            Ok(l) => assert!(!l.path().is_empty()),
            Err(Error::Library { name, reason }) => {
                assert_eq!(name, "libcufile");
                assert!(reason.contains("libcufile.so.0"), "{reason}");
            }
            Err(e) => panic!("{e:?}"),
        }
        match driver() {
            Ok(d) => assert_eq!(d.is_compat_mode(), d.nvfs_version() == (0, 0)),
            Err(Error::Library { .. } | Error::CuFile { .. }) => {}
            Err(e) => panic!("{e:?}"),
        }
        assert_eq!(driver().is_ok(), driver().is_ok());
    }

    #[test]
    fn probe_never_panics() {
        let p = probe();
        assert_eq!(p.run_udev, Path::new("/run/udev").is_dir());
        if !p.found {
            assert!(p.reason.is_some());
            assert!(!p.usable());
        }
        assert!(!p.to_string().is_empty());
    }

    #[test]
    fn probe_display() {
        let p = Probe {
            found: true,
            path: Some("/usr/lib/libcufile.so.0".into()),
            version: Some(1150),
            driver_open: true,
            nvfs_version: Some((0, 0)),
            compat_mode: Some(true),
            allow_compat_mode: Some(true),
            run_udev: false,
            ..Probe::default()
        };
        assert_eq!(
            p.to_string(),
            "/usr/lib/libcufile.so.0, cuFile 1.15, driver open, no nvidia-fs (compat mode only), \
             no /run/udev (file registration will fail)"
        );
        assert!(!p.usable());
    }

    #[test]
    fn closed_fd_is_restored() {
        use std::os::fd::AsRawFd;
        let f = std::fs::File::open("/proc/self/cmdline").unwrap();
        // A high descriptor of our own stands in for fd 0, so the test harness's
        // stdin is never touched.
        let fd: RawFd = 917;
        // SAFETY: dup2 onto a number nothing else in this test process uses.
        assert_eq!(unsafe { libc::dup2(f.as_raw_fd(), fd) }, fd);
        let ino = |fd: RawFd| {
            // SAFETY: fstat writes one struct stat. All-zero bytes are a valid value.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st.st_ino)
        };
        let before = ino(fd);
        // SAFETY: closes the descriptor we created, as the cuFile bug would.
        let r = preserving_fd(fd, || unsafe { libc::close(fd) });
        assert_eq!(r, 0);
        assert_eq!(ino(fd), before, "fd was not restored");
        // Untouched when `f` leaves it alone. Nothing happens when it was never open.
        assert_eq!(preserving_fd(fd, || 7), 7);
        assert_eq!(ino(fd), before);
        // SAFETY: our own descriptor, closed once.
        unsafe { libc::close(fd) };
        preserving_fd(fd, || ());
        assert_eq!(ino(fd), None);
    }

    #[test]
    fn handles_are_send_and_sync() {
        fn both<T: Send + Sync>() {}
        both::<FileHandle>();
        both::<BufferRegistration>();
        both::<Driver>();
        both::<CuFileLib>();
    }

    #[test]
    fn offsets_beyond_off_t_are_rejected() {
        assert_eq!(off_t("x", 5).unwrap(), 5);
        assert!(matches!(
            off_t("x", u64::MAX),
            Err(Error::InvalidArgument(_))
        ));
    }

    /// Runs only where cuFile and a GPU work. Elsewhere it returns early.
    /// Writes a pattern from GPU memory through cuFile, reads it back into
    /// other GPU memory, and compares on the host.
    #[test]
    fn gpu_roundtrip_through_cufile() {
        let Ok(cuda) = crate::gpu::cuda::driver() else {
            eprintln!("no CUDA: skipped");
            return;
        };
        if cuda.device_count().unwrap_or(0) == 0 {
            return;
        }
        cuda.make_current(0).unwrap();
        let drv = match driver() {
            Ok(d) => d,
            Err(e) => {
                eprintln!("cuFile driver unavailable: {e}: skipped");
                return;
            }
        };
        let dir = std::env::temp_dir();
        let path = dir.join(format!("ckptio-cufile-test-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let _cleanup = Cleanup(path.clone());
        use std::os::fd::AsRawFd;
        // SAFETY: `file` outlives `fh` (declared before it, dropped after).
        let fh = match unsafe { drv.register(file.as_raw_fd()) } {
            Ok(h) => h,
            Err(e) => {
                assert!(
                    !Path::new("/run/udev").is_dir() || matches!(e, Error::CuFile { .. }),
                    "{e}"
                );
                eprintln!("cuFileHandleRegister failed ({e}): skipped");
                return;
            }
        };
        let len = 4 << 20;
        let stream = crate::gpu::cuda::Stream::new(0).unwrap();
        let mut host = crate::gpu::cuda::PinnedBuffer::new(len).unwrap();
        for (i, b) in host.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 253) as u8;
        }
        let a = test_alloc(len);
        let b = test_alloc(len);
        // SAFETY: all ranges are `len` bytes, live until synchronize and after.
        unsafe {
            cuda.memcpy_htod_async(a.0, host.as_ptr(), len, &stream)
                .unwrap()
        };
        stream.synchronize().unwrap();
        // SAFETY: `a` and `b` are live `len`-byte device allocations. `file` is open.
        unsafe {
            // Two halves from two threads on one handle.
            std::thread::scope(|s| {
                for half in 0..2u64 {
                    let fh = &fh;
                    let a = a.0;
                    s.spawn(move || {
                        crate::gpu::cuda::driver().unwrap().make_current(0).unwrap();
                        let h = len as u64 / 2;
                        let n = fh.write(a, len / 2, half * h, half * h).unwrap();
                        assert_eq!(n, len / 2);
                    });
                }
            });
            assert_eq!(fh.read(b.0, len, 0, 0).unwrap(), len);
            // Reading past the end returns 0 bytes, not an error.
            assert_eq!(fh.read(b.0, 4096, len as u64, 0).unwrap(), 0);
        }
        let mut back = crate::gpu::cuda::PinnedBuffer::new(len).unwrap();
        // SAFETY: as above.
        unsafe {
            cuda.memcpy_dtoh_async(back.as_mut_ptr(), b.0, len, &stream)
                .unwrap()
        };
        stream.synchronize().unwrap();
        assert!(host.as_slice() == back.as_slice());

        // Buffer registration, if this build has it. 5016 and similar are
        // acceptable in compat mode.
        // SAFETY: `b` stays allocated until after `reg` drops.
        match unsafe { drv.register_buffer(b.0, len) } {
            Ok(reg) => assert_eq!(reg.len(), len),
            Err(e) => eprintln!("cuFileBufRegister: {e}"),
        }
        drop(fh);
        drop(file);
    }

    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// A device allocation for tests (cuMemAlloc_v2 / cuMemFree_v2).
    struct DevMem(u64);
    type MemAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
    type MemFree = unsafe extern "C" fn(u64) -> c_int;

    fn cuda_lib() -> Library {
        // SAFETY: libcuda is already loaded by `cuda::driver`. This just takes
        // another reference to it.
        unsafe { Library::new("libcuda.so.1") }.unwrap()
    }

    fn test_alloc(len: usize) -> DevMem {
        let lib = cuda_lib();
        // SAFETY: the signature is cuMemAlloc_v2's in cuda.h.
        let alloc: MemAlloc = unsafe { symbol(&lib, "cuMemAlloc_v2") }.unwrap();
        let mut p = 0u64;
        // SAFETY: writes one device pointer. A context is current.
        assert_eq!(unsafe { alloc(&mut p, len) }, 0);
        DevMem(p)
    }

    impl Drop for DevMem {
        fn drop(&mut self) {
            let lib = cuda_lib();
            // SAFETY: the signature is cuMemFree_v2's in cuda.h.
            let free: MemFree = unsafe { symbol(&lib, "cuMemFree_v2") }.unwrap();
            // SAFETY: frees our own allocation once.
            unsafe { free(self.0) };
        }
    }
}
