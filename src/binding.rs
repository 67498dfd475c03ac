//! The Python binding (`ckptio._native`), built with the `python` feature.
//!
//! Thin on purpose: it converts arguments into owned core values while attached
//! to the interpreter, runs every blocking call detached (`py.detach`), and turns
//! core errors into specific Python exceptions. Policy (which storages, which
//! offsets, torch semantics) lives in the Python package.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyKeyError, PyMemoryError, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::engine::{Engine as CoreEngine, EngineConfig, Memory, Segment, Stats};
use crate::fault;
use crate::file::{DirectMode, IoFile};
use crate::gpu::{self, Backend, DevicePath};
use crate::integrity::{self, Declared, State};
use crate::persist::AtomicFile;
use crate::zipmap::{self, Archive};
use crate::Error;

pyo3::create_exception!(
    ckptio,
    CkptioError,
    pyo3::exceptions::PyException,
    "Base class of ckptio's own errors."
);
pyo3::create_exception!(
    ckptio,
    FormatError,
    CkptioError,
    "The file is not a usable checkpoint (torch.save archive or safetensors file)."
);
pyo3::create_exception!(
    ckptio,
    BackendUnavailableError,
    CkptioError,
    "A library or backend (libcuda, libcufile) is not available."
);
pyo3::create_exception!(ckptio, CudaError, CkptioError, "A CUDA driver call failed.");
pyo3::create_exception!(
    ckptio,
    CuFileError,
    CkptioError,
    "A cuFile (GPUDirect Storage) call failed."
);

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        match e {
            Error::Io { op, path, source } => match source.raw_os_error() {
                // OSError(errno, strerror, filename) picks the subclass
                // (FileNotFoundError, PermissionError, ...) from errno.
                Some(errno) => {
                    let text = format!("{op} failed: {}", strip_os_suffix(&source.to_string()));
                    match path {
                        Some(p) => PyOSError::new_err((errno, text, p.into_os_string())),
                        None => PyOSError::new_err((errno, text)),
                    }
                }
                None if source.kind() == std::io::ErrorKind::OutOfMemory => {
                    PyMemoryError::new_err(msg)
                }
                None => PyOSError::new_err(msg),
            },
            Error::Format { .. } => FormatError::new_err(msg),
            Error::InvalidArgument(_) => PyValueError::new_err(msg),
            Error::Library { .. } => BackendUnavailableError::new_err(msg),
            Error::Cuda { .. } => CudaError::new_err(msg),
            Error::CuFile { .. } => CuFileError::new_err(msg),
        }
    }
}

fn strip_os_suffix(s: &str) -> &str {
    s.find(" (os error").map_or(s, |i| &s[..i])
}

fn direct_mode(s: Option<&str>) -> PyResult<Option<DirectMode>> {
    Ok(match s {
        None => None,
        Some(s) => Some(s.parse::<DirectMode>()?),
    })
}

/// A pool of I/O threads with its reusable buffers.
#[pyclass(frozen, module = "ckptio._native")]
pub struct Engine {
    inner: Arc<CoreEngine>,
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (threads=None, chunk_size=None, direct=None, memory_threads=None))]
    fn new(
        threads: Option<usize>,
        chunk_size: Option<usize>,
        direct: Option<&str>,
        memory_threads: Option<usize>,
    ) -> PyResult<Self> {
        let mut cfg = EngineConfig::from_env()?;
        if let Some(t) = threads {
            cfg.set_threads(t);
        }
        if let Some(t) = memory_threads {
            cfg.memory_threads = t;
        }
        if let Some(c) = chunk_size {
            cfg.set_chunk_size(c);
        }
        if let Some(d) = direct_mode(direct)? {
            cfg.direct = d;
        }
        Ok(Engine {
            inner: Arc::new(CoreEngine::new(cfg)?),
        })
    }

    #[getter]
    fn threads(&self) -> usize {
        self.inner.config().threads
    }

    /// Threads for files in memory (tmpfs).
    #[getter]
    fn memory_threads(&self) -> usize {
        self.inner.config().memory_threads
    }

    #[getter]
    fn chunk_size(&self) -> usize {
        self.inner.config().chunk_size
    }

    /// Chunk size for files in memory (tmpfs).
    #[getter]
    fn memory_chunk_size(&self) -> usize {
        self.inner.config().memory_chunk_size
    }

    #[getter]
    fn direct(&self) -> &'static str {
        match self.inner.config().direct {
            DirectMode::Auto => "auto",
            DirectMode::Off => "off",
            DirectMode::Required => "on",
        }
    }

    /// Host memory held by the engine's reusable staging buffers.
    fn pooled_bytes(&self) -> usize {
        self.inner.pooled_bytes()
    }

    /// Pinned host memory held by the engine's bounce buffers.
    fn pinned_bytes(&self) -> usize {
        self.inner.pinned_bytes()
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "Engine(threads={}, memory_threads={}, chunk_size={}, memory_chunk_size={}, direct={:?})",
            c.threads,
            c.memory_threads,
            c.chunk_size,
            c.memory_chunk_size,
            self.direct()
        )
    }
}

/// (file offset, address, length, device) as the Python side hands them; device -1 is host memory.
type RawSegment = (u64, u64, u64, i32);

fn to_segments(raw: Vec<RawSegment>) -> Vec<Segment> {
    raw.into_iter()
        .map(|(file_offset, addr, len, dev)| Segment {
            file_offset,
            addr,
            len,
            memory: if dev < 0 {
                Memory::Host
            } else {
                Memory::Cuda(dev)
            },
        })
        .collect()
}

fn records_list(a: &Archive) -> Vec<(String, u64, u64)> {
    a.records
        .iter()
        .map(|r| (r.name.clone(), r.data_offset, r.size))
        .collect()
}

/// Map a torch.save archive: [(record name, data offset, size)] in central-directory order.
#[pyfunction]
fn map_archive(py: Python<'_>, path: PathBuf) -> PyResult<Vec<(String, u64, u64)>> {
    py.detach(|| {
        let f = IoFile::open_read(&path, DirectMode::Off)?;
        let a = zipmap::map_file(f.file(), Some(&path))?;
        Ok(records_list(&a))
    })
}

struct WriterState {
    // Field order is drop order: a cuFile handle goes before the fd it uses.
    device: Option<DevicePath>,
    io: IoFile,
    atomic: AtomicFile,
}

/// O_DIRECT mode and device backend for a file: the arguments, else the environment.
fn file_modes(direct: Option<&str>, backend: Option<&str>) -> PyResult<(DirectMode, Backend)> {
    let mode = direct_mode(direct)?.unwrap_or(EngineConfig::from_env()?.direct);
    let backend = match backend {
        Some(s) => s.parse()?,
        None => Backend::from_env()?,
    };
    Ok((mode, backend))
}

/// What a transfer report says, gathered while the file's lock is held
/// (detached), turned into a dict once attached again.
struct Report {
    stats: Stats,
    direct_reason: Option<String>,
    gds_mode: Option<&'static str>,
    fallback_reason: Option<String>,
}

impl Report {
    fn new(stats: Stats, io: &IoFile, device: Option<&DevicePath>) -> Self {
        let dev = device.filter(|_| stats.device_path.is_some());
        Report {
            direct_reason: io.no_direct_reason().map(str::to_owned),
            gds_mode: dev.and_then(DevicePath::gds_mode),
            fallback_reason: dev.and_then(DevicePath::fallback_reason).map(str::to_owned),
            stats,
        }
    }

    fn into_dict(self, py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
        let (s, d) = (&self.stats, PyDict::new(py));
        d.set_item("bytes", s.bytes)?;
        d.set_item("chunks", s.chunks)?;
        d.set_item("threads", s.threads)?;
        d.set_item("direct", s.direct)?;
        d.set_item("direct_reason", self.direct_reason)?;
        d.set_item("backend", s.device_path.unwrap_or("posix"))?;
        d.set_item("gds_mode", self.gds_mode)?;
        d.set_item("fallback_reason", self.fallback_reason)?;
        Ok(d)
    }
}

fn report<'py>(
    py: Python<'py>,
    s: Stats,
    io: &IoFile,
    device: Option<&DevicePath>,
) -> PyResult<Bound<'py, PyDict>> {
    Report::new(s, io, device).into_dict(py)
}

/// The device path for a file, opened on first need (only when device memory moves).
///
/// # Safety
/// The returned path must be dropped before `io`.
unsafe fn ensure_device_path<'a>(
    slot: &'a mut Option<DevicePath>,
    io: &IoFile,
    backend: Backend,
    segs: &[Segment],
) -> Result<Option<&'a DevicePath>, Error> {
    if !segs.iter().any(|s| s.len > 0 && s.memory != Memory::Host) {
        return Ok(None);
    }
    if slot.is_none() {
        // SAFETY: the caller drops `slot` before `io`.
        *slot = Some(unsafe { gpu::open_device_path(io, backend)? });
    }
    Ok(slot.as_ref())
}

/// A checkpoint being written: a temp file beside the target, replaced atomically on commit.
#[pyclass(frozen, module = "ckptio._native")]
pub struct AtomicWriter {
    state: Mutex<Option<WriterState>>,
    fd: i32,
    tmp_path: PathBuf,
    target: PathBuf,
    backend: Backend,
}

/// What a write plan yields: segments, the final file length, for zip records
/// the archive with each segment's record index (so CRCs can be filled), and
/// whether to hand each segment's CRC-32 back to the caller.
type Planned = (
    Vec<RawSegment>,
    Option<u64>,
    Option<(Archive, Vec<usize>)>,
    bool,
);

impl AtomicWriter {
    /// Run `plan` on the temp file (it returns the segments, the final file
    /// length and, for zip records, the archive and each segment's record
    /// index), preallocate, have the engine write the segments, then fill the
    /// records' CRC-32s.
    fn write_planned<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        plan: impl FnOnce(&IoFile, &std::path::Path) -> Result<Planned, Error> + Send,
    ) -> PyResult<Bound<'py, PyDict>> {
        let engine = engine.inner.clone();
        let backend = self.backend;
        // The writer's lock is taken and released while detached: a thread
        // waiting for it never holds the interpreter that this one needs back.
        let (rep, crc32) = py.detach(|| -> PyResult<_> {
            let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let Some(st) = g.as_mut() else {
                return Err(writer_done());
            };
            let path = st.atomic.tmp_path().to_path_buf();
            let (raw, file_len, records, checksum) = plan(&st.io, &path)?;
            if let Some(len) = file_len.filter(|_| engine.config().preallocate) {
                st.io.preallocate(len)?;
            }
            let segs = to_segments(raw);
            // SAFETY: `st.device` is dropped before `st.io` (field order).
            let device = unsafe { ensure_device_path(&mut st.device, &st.io, backend, &segs)? };
            let crc = checksum || records.is_some();
            // SAFETY: the Python caller keeps each range alive and
            // unmodified for the duration of this call (documented contract).
            let stats = unsafe { engine.write_via(&st.io, &segs, device, crc)? };
            if let Some((a, index)) = records {
                // Data records not written yet stay listed as unchecked (fill_crcs).
                let crcs: Vec<(usize, Option<u32>)> =
                    index.into_iter().zip(stats.crc32.iter().copied()).collect();
                integrity::fill_crcs(&st.io, &a, &crcs)?;
            }
            let crc32 = checksum.then(|| stats.crc32.clone());
            Ok((Report::new(stats, &st.io, st.device.as_ref()), crc32))
        })?;
        let d = rep.into_dict(py)?;
        if let Some(crc32) = crc32 {
            // Per segment: the CRC-32 of its bytes, None where cuFile moved them.
            d.set_item("crc32", crc32)?;
        }
        Ok(d)
    }
}

fn writer_done() -> PyErr {
    PyValueError::new_err("the checkpoint writer is already committed or aborted")
}

#[pymethods]
impl AtomicWriter {
    #[new]
    #[pyo3(signature = (path, direct=None, backend=None))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        direct: Option<&str>,
        backend: Option<&str>,
    ) -> PyResult<Self> {
        let (mode, backend) = file_modes(direct, backend)?;
        py.detach(|| {
            let atomic = AtomicFile::create(&path)?;
            let file = atomic
                .file()
                .try_clone()
                .map_err(|e| Error::io_at("dup", atomic.tmp_path(), e))?;
            let io = IoFile::from_writable(file, atomic.tmp_path(), mode)?;
            use std::os::fd::AsRawFd;
            Ok::<_, Error>(AtomicWriter {
                fd: atomic.file().as_raw_fd(),
                tmp_path: atomic.tmp_path().to_path_buf(),
                target: atomic.target().to_path_buf(),
                backend,
                state: Mutex::new(Some(WriterState {
                    device: None,
                    io,
                    atomic,
                })),
            })
        })
        .map_err(Into::into)
    }

    /// The temp file's descriptor (valid until commit/abort; dup it before wrapping).
    fn fileno(&self) -> i32 {
        self.fd
    }

    #[getter]
    fn tmp_path(&self) -> PathBuf {
        self.tmp_path.clone()
    }

    /// The file that commit replaces (symbolic links resolved).
    #[getter]
    fn target(&self) -> PathBuf {
        self.target.clone()
    }

    /// Write each storage's bytes into its record `<prefix>/data/<key>`, then
    /// the records' CRC-32s (computed as the bytes pass through host memory;
    /// records written by cuFile are listed as unchecked in the archive comment).
    /// `storages`: [(key, address, nbytes, device)], device -1 for host memory.
    ///
    /// The caller keeps every storage alive and unmodified until this returns.
    fn write_storages<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        storages: Vec<(String, u64, u64, i32)>,
    ) -> PyResult<Bound<'py, PyDict>> {
        self.write_planned(py, engine, |io, path| {
            let a = zipmap::map_file(io.file(), Some(path))?;
            let mut raw = Vec::with_capacity(storages.len());
            let mut index = Vec::with_capacity(storages.len());
            for (key, addr, nbytes, dev) in storages {
                let i = a.storage_index(&key).ok_or_else(|| {
                    Error::format(Some(path), format!("no record for storage {key}"))
                })?;
                let r = &a.records[i];
                index.push(i);
                if r.size != nbytes {
                    return Err(Error::format(
                        Some(path),
                        format!(
                            "record {} holds {} bytes, storage {key} has {nbytes}",
                            r.name, r.size
                        ),
                    ));
                }
                raw.push((r.data_offset, addr, nbytes, dev));
            }
            let len = a.file_len;
            Ok((raw, Some(len), Some((a, index)), false))
        })
    }

    /// Write memory ranges at given file offsets: `segments` =
    /// [(file offset, address, nbytes, device)], device -1 for host memory.
    /// `file_len`: the final size of the file, preallocated up front (when the
    /// engine preallocates) so that a full disk fails before any data moves.
    ///
    /// `checksum`: also return each segment's CRC-32 (`"crc32"`, None where
    /// cuFile moved the bytes), computed in the I/O threads.
    ///
    /// The caller keeps every range alive and unmodified until this returns.
    #[pyo3(signature = (engine, segments, file_len=None, checksum=false))]
    fn write_segments<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        segments: Vec<RawSegment>,
        file_len: Option<u64>,
        checksum: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        self.write_planned(py, engine, |_, _| Ok((segments, file_len, None, checksum)))
    }

    /// Write a small byte string (a header) at `offset`.
    fn write_bytes(&self, py: Python<'_>, offset: u64, data: &[u8]) -> PyResult<()> {
        py.detach(|| {
            let g = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let Some(st) = g.as_ref() else {
                return Err(writer_done());
            };
            Ok(st.io.write_at(data, offset)?)
        })
    }

    /// fsync, rename over the target, fsync the folder.
    fn commit(&self, py: Python<'_>) -> PyResult<()> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(s) = state else {
            return Err(writer_done());
        };
        py.detach(move || {
            let WriterState { device, io, atomic } = s;
            drop(device);
            drop(io);
            atomic.commit()
        })?;
        Ok(())
    }

    /// Remove the temp file; the target stays as it was. Idempotent.
    fn abort(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

/// An existing checkpoint opened for reading.
#[pyclass(frozen, module = "ckptio._native")]
pub struct Reader {
    io: IoFile,
    archive: Archive,
    backend: Backend,
}

#[pymethods]
impl Reader {
    #[new]
    #[pyo3(signature = (path, direct=None, backend=None))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        direct: Option<&str>,
        backend: Option<&str>,
    ) -> PyResult<Self> {
        let (mode, backend) = file_modes(direct, backend)?;
        py.detach(|| {
            let io = IoFile::open_read(&path, mode)?;
            let archive = zipmap::map_file(io.file(), Some(&path))?;
            Ok::<_, Error>(Reader {
                io,
                archive,
                backend,
            })
        })
        .map_err(Into::into)
    }

    /// [(record name, data offset, size)] in central-directory order.
    fn records(&self) -> Vec<(String, u64, u64)> {
        records_list(&self.archive)
    }

    #[getter]
    fn prefix(&self) -> String {
        self.archive.prefix().to_owned()
    }

    #[getter]
    fn direct(&self) -> bool {
        self.io.is_direct()
    }

    /// The descriptor of the open file (so other readers can open the very same file).
    fn fileno(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.io.file().as_raw_fd()
    }

    /// The bytes of a small record (at most 64 MiB), e.g. `byteorder`.
    fn read_record<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        let r = self
            .archive
            .get(name)
            .ok_or_else(|| PyKeyError::new_err(format!("no record {name:?} in the archive")))?;
        if r.size > 64 << 20 {
            return Err(PyValueError::new_err(format!(
                "record {name:?} is too large to read whole ({} bytes)",
                r.size
            )));
        }
        let (off, size) = (r.data_offset, r.size as usize);
        let buf = py.detach(|| {
            let mut buf = vec![0u8; size];
            self.io.read_at(&mut buf, off).map(|()| buf)
        })?;
        Ok(PyBytes::new(py, &buf))
    }

    /// Read file ranges into memory. `segments`: [(file offset, address, nbytes, device)].
    /// Each range must lie inside one data record of the archive.
    ///
    /// With `verify`, the CRC-32 of the bytes read for each whole record is
    /// compared with the stored one (FormatError naming the record on a
    /// mismatch); the result's "verified" and "unchecked" list the records.
    ///
    /// The caller keeps every destination alive and untouched until this returns.
    #[pyo3(signature = (engine, segments, verify=false))]
    fn read_into<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        segments: Vec<RawSegment>,
        verify: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let engine = engine.inner.clone();
        let mut verified = Vec::new();
        let mut unchecked = Vec::new();
        let (stats, device) = py.detach(|| {
            for &(off, _, len, _) in &segments {
                let inside = self.archive.records.iter().any(|r| {
                    off >= r.data_offset
                        && off
                            .checked_add(len)
                            .is_some_and(|e| e <= r.data_offset + r.size)
                });
                if !inside {
                    return Err(Error::format(
                        Some(self.io.path()),
                        format!(
                            "bytes {off}..{} are not inside one record of the archive",
                            off.saturating_add(len)
                        ),
                    ));
                }
            }
            let segs = to_segments(segments);
            let mut device = None;
            // SAFETY: `device` is dropped (end of this call) before `self.io`.
            let path = unsafe { ensure_device_path(&mut device, &self.io, self.backend, &segs)? };
            // SAFETY: the Python caller keeps each destination alive and
            // untouched for the duration of this call (documented contract).
            let st = unsafe { engine.read_via(&self.io, &segs, path, verify)? };
            if verify {
                let decl = integrity::declared(&self.archive);
                let by_offset: std::collections::HashMap<u64, usize> = self
                    .archive
                    .records
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (r.data_offset, i))
                    .collect();
                for (s, crc) in segs.iter().zip(&st.crc32) {
                    let whole = by_offset
                        .get(&s.file_offset)
                        .filter(|&&i| self.archive.records[i].size == s.len);
                    let Some(&i) = whole else { continue };
                    let name = &self.archive.records[i].name;
                    match integrity::judge(decl[i], *crc) {
                        State::Mismatch { stored, actual } => {
                            return Err(integrity::mismatch_error(
                                self.io.path(),
                                name,
                                stored,
                                actual,
                            ))
                        }
                        State::Ok => verified.push(name.clone()),
                        State::Unchecked => unchecked.push(name.clone()),
                    }
                }
            }
            Ok::<_, Error>((st, device))
        })?;
        let d = report(py, stats, &self.io, device.as_ref())?;
        if verify {
            d.set_item("verified", verified)?;
            d.set_item("unchecked", unchecked)?;
        }
        Ok(d)
    }

    /// The stored CRC-32 of each record, None where the archive has none
    /// (cuFile-written records, or a writer that left 0): [(name, crc)].
    fn checksums(&self) -> Vec<(String, Option<u32>)> {
        self.archive
            .records
            .iter()
            .zip(integrity::declared(&self.archive))
            .map(|(r, d)| {
                let crc = match d {
                    Declared::Crc(c) => Some(c),
                    Declared::Unchecked => None,
                };
                (r.name.clone(), crc)
            })
            .collect()
    }

    /// Check records against their CRC-32s (all when `names` is None), reading
    /// them in parallel: [(name, state, stored, actual)], state "ok",
    /// "mismatch" or "unchecked" (no CRC-32 stored: nothing read). With
    /// `strict`, the first mismatch raises FormatError naming the record.
    #[pyo3(signature = (engine, names=None, strict=false))]
    fn verify(
        &self,
        py: Python<'_>,
        engine: &Engine,
        names: Option<Vec<String>>,
        strict: bool,
    ) -> PyResult<VerifyRows> {
        let which = match names {
            None => None,
            Some(ns) => Some(
                ns.iter()
                    .map(|n| {
                        self.archive
                            .records
                            .iter()
                            .position(|r| &r.name == n)
                            .ok_or_else(|| {
                                PyKeyError::new_err(format!("no record {n:?} in the archive"))
                            })
                    })
                    .collect::<PyResult<Vec<usize>>>()?,
            ),
        };
        let engine = engine.inner.clone();
        let checks =
            py.detach(|| integrity::check(&engine, &self.io, &self.archive, which.as_deref()))?;
        let mut out = Vec::with_capacity(checks.len());
        for (i, state) in checks {
            let r = &self.archive.records[i];
            let (stored, actual) = match state {
                State::Mismatch { stored, actual } => {
                    if strict {
                        return Err(integrity::mismatch_error(
                            self.io.path(),
                            &r.name,
                            stored,
                            actual,
                        )
                        .into());
                    }
                    (Some(stored), Some(actual))
                }
                State::Ok => (Some(r.crc32), Some(r.crc32)),
                State::Unchecked => (None, None),
            };
            out.push((r.name.clone(), state.name(), stored, actual));
        }
        Ok(out)
    }
}

type VerifyRows = Vec<(String, &'static str, Option<u32>, Option<u32>)>;

/// An open file for moving storages at given offsets (what `ckptio.GdsFile` wraps).
///
/// `register_handle` picks the device path (cuFile, or the bounce pipeline when
/// cuFile cannot take the file); transfers work either way.
#[pyclass(frozen, module = "ckptio._native")]
pub struct DeviceFile {
    // Field order is drop order: the cuFile handle before the fd.
    device: Mutex<Option<DevicePath>>,
    io: IoFile,
    backend: Backend,
}

impl DeviceFile {
    fn with_path<T>(&self, f: impl FnOnce(&DevicePath) -> T) -> Option<T> {
        self.device
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(f)
    }

    fn transfer(&self, engine: &Engine, seg: RawSegment, write: bool) -> Result<Stats, Error> {
        let segs = to_segments(vec![seg]);
        let g = self.device.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the Python caller keeps the storage alive and untouched for
        // the duration of the call (documented contract).
        unsafe {
            if write {
                engine.inner.write_via(&self.io, &segs, g.as_ref(), false)
            } else {
                engine.inner.read_via(&self.io, &segs, g.as_ref(), false)
            }
        }
    }
}

#[pymethods]
impl DeviceFile {
    #[new]
    #[pyo3(signature = (path, writable, direct=None, backend=None))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        writable: bool,
        direct: Option<&str>,
        backend: Option<&str>,
    ) -> PyResult<Self> {
        let (mode, backend) = file_modes(direct, backend)?;
        py.detach(|| {
            let io = if writable {
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(|e| Error::io_at("open", &path, e))?;
                IoFile::from_writable(f, &path, mode)?
            } else {
                IoFile::open_read(&path, mode)?
            };
            Ok::<_, Error>(DeviceFile {
                device: Mutex::new(None),
                io,
                backend,
            })
        })
        .map_err(Into::into)
    }

    /// Choose the device path: cuFile where it works (or an error when the
    /// backend is forced to cuFile), else the bounce pipeline.
    fn register_handle(&self, py: Python<'_>) -> PyResult<()> {
        let mut g = self.device.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            // SAFETY: `device` is declared before `io`, so it drops first.
            *g = Some(py.detach(|| unsafe { gpu::open_device_path(&self.io, self.backend) })?);
        }
        Ok(())
    }

    fn deregister_handle(&self) {
        self.device.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// "cufile", "bounce", or None before register_handle.
    #[getter]
    fn backend(&self) -> Option<&'static str> {
        self.with_path(DevicePath::name)
    }

    #[getter]
    fn gds_mode(&self) -> Option<&'static str> {
        self.with_path(DevicePath::gds_mode).flatten()
    }

    #[getter]
    fn fallback_reason(&self) -> Option<String> {
        self.with_path(|p| p.fallback_reason().map(str::to_owned))
            .flatten()
    }

    /// Write `nbytes` at `addr` (device -1 = host) to the file at `offset`.
    fn write(
        &self,
        py: Python<'_>,
        engine: &Engine,
        offset: u64,
        addr: u64,
        nbytes: u64,
        device: i32,
    ) -> PyResult<()> {
        py.detach(|| self.transfer(engine, (offset, addr, nbytes, device), true))?;
        Ok(())
    }

    /// Read `nbytes` from the file at `offset` into `addr`.
    fn read(
        &self,
        py: Python<'_>,
        engine: &Engine,
        offset: u64,
        addr: u64,
        nbytes: u64,
        device: i32,
    ) -> PyResult<()> {
        py.detach(|| self.transfer(engine, (offset, addr, nbytes, device), false))?;
        Ok(())
    }

    /// The buffered descriptor of the open file (for reading a header beside the engine).
    fn fileno(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.io.file().as_raw_fd()
    }

    /// Read file ranges into memory in one engine pass: `segments` =
    /// [(file offset, address, nbytes, device)], device -1 for host memory.
    /// A range past the end of the file is a `FormatError`; the device path
    /// (cuFile or bounce) is chosen on first need, as `register_handle` does.
    ///
    /// The caller keeps every destination alive and untouched until this returns.
    fn read_segments<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        segments: Vec<RawSegment>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let engine = engine.inner.clone();
        // The lock is taken and released while detached: a thread waiting for
        // it never holds the interpreter.
        let stats = py.detach(|| {
            let len = self.io.len()?;
            for (i, &(off, _, n, _)) in segments.iter().enumerate() {
                if off.checked_add(n).is_none_or(|end| end > len) {
                    return Err(Error::format(
                        Some(self.io.path()),
                        format!(
                            "segment {i} (bytes {off}..{}) lies past the end of the file ({len} bytes)",
                            off.saturating_add(n)
                        ),
                    ));
                }
            }
            let segs = to_segments(segments);
            let mut g = self.device.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: `self.device` is declared before `self.io`, so it drops first.
            let path = unsafe { ensure_device_path(&mut g, &self.io, self.backend, &segs)? };
            // SAFETY: the Python caller keeps each destination alive and
            // untouched for the duration of this call (documented contract).
            unsafe { engine.read_via(&self.io, &segs, path, false) }
        })?;
        let g = self.device.lock().unwrap_or_else(|p| p.into_inner());
        report(py, stats, &self.io, g.as_ref())
    }
}

/// A cuFileBufRegister registration; deregistered when dropped or on `close()`.
#[pyclass(frozen, module = "ckptio._native")]
pub struct BufferRegistration {
    inner: Mutex<Option<crate::cufile::BufferRegistration>>,
}

#[pymethods]
impl BufferRegistration {
    fn close(&self) {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

/// Register device memory with cuFile. The caller keeps the memory allocated
/// until the registration is closed.
#[pyfunction]
fn cufile_register_buffer(
    py: Python<'_>,
    addr: u64,
    nbytes: usize,
) -> PyResult<BufferRegistration> {
    let reg = py.detach(|| {
        let d = crate::cufile::driver()?;
        // SAFETY: the Python caller keeps the storage allocated until close().
        unsafe { d.register_buffer(addr, nbytes) }
    })?;
    Ok(BufferRegistration {
        inner: Mutex::new(Some(reg)),
    })
}

/// Pinning state of host memory the caller owns (a staging buffer): page-locked
/// whole by the first copy that reaches it (copies into it go in `chunk_size`
/// pieces), and unlocked on `close()` or when this object goes.
#[pyclass(frozen, module = "ckptio._native")]
pub struct HostPin {
    inner: Mutex<Option<Arc<crate::staging::HostPin>>>,
    nbytes: u64,
}

impl HostPin {
    fn get(&self) -> PyResult<Arc<crate::staging::HostPin>> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| PyValueError::new_err("the HostPin is closed"))
    }
}

#[pymethods]
impl HostPin {
    /// `addr..addr+nbytes`: host memory the caller keeps mapped until `close()`.
    #[new]
    #[pyo3(signature = (addr, nbytes, pin=true, chunk_size=67108864))]
    fn new(addr: u64, nbytes: u64, pin: bool, chunk_size: u64) -> PyResult<Self> {
        // SAFETY: the Python caller keeps the memory mapped until close()
        // (documented contract; ckptio.staging closes pins before freeing).
        let p = unsafe { crate::staging::HostPin::new(addr, nbytes, chunk_size, pin) }?;
        Ok(HostPin {
            inner: Mutex::new(Some(Arc::new(p))),
            nbytes,
        })
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// Bytes page-locked so far (0 once closed).
    fn pinned_bytes(&self) -> u64 {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or(0, |p| p.pinned_bytes())
    }

    /// Unlock the memory (after copies in flight finish). Idempotent.
    fn close(&self, py: Python<'_>) {
        let p = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        py.detach(move || drop(p));
    }
}

/// Pin every one of `pins` not yet pinned, on `threads` threads (the GIL
/// released); returns the bytes now pinned. Memory the driver refuses stays pageable.
#[pyfunction]
#[pyo3(signature = (pins, threads=8))]
fn stage_pin(py: Python<'_>, pins: Vec<Bound<'_, HostPin>>, threads: usize) -> PyResult<u64> {
    let pins = pins
        .iter()
        .map(|p| p.get().get())
        .collect::<PyResult<Vec<_>>>()?;
    Ok(py.detach(move || {
        let refs: Vec<&crate::staging::HostPin> = pins.iter().map(|p| p.as_ref()).collect();
        crate::staging::pin_all(&refs, threads)
    }))
}

/// Queue device-to-device copies `(dst, src, nbytes)` on the CUDA stream
/// `stream` (a raw CUstream of `device`, e.g. ``torch.cuda.Stream.cuda_stream``)
/// and return at once: the device snapshot of a stager, without a kernel launch
/// or a tensor object per storage. The caller keeps both ranges alive until the
/// stream has run the copies.
#[pyfunction]
fn stage_device_copy(
    py: Python<'_>,
    device: i32,
    stream: u64,
    copies: Vec<(u64, u64, u64)>,
) -> PyResult<()> {
    if device < 0 {
        return Err(Error::invalid(format!("device must be >= 0, not {device}")).into());
    }
    let mut jobs = Vec::with_capacity(copies.len());
    for (i, (dst, src, len)) in copies.into_iter().enumerate() {
        if len == 0 {
            continue;
        }
        if dst == 0 || src == 0 || dst.checked_add(len).is_none() || src.checked_add(len).is_none()
        {
            return Err(Error::invalid(format!(
                "device copy {i}: null or overflowing range (dst {dst:#x}, src {src:#x}, {len} bytes)"
            ))
            .into());
        }
        jobs.push((dst, src, len as usize));
    }
    py.detach(|| {
        let cuda = crate::cuda::driver()?;
        // SAFETY: the Python caller passes live storages of `device` and one of
        // its streams, and keeps them until the stream has run (documented contract).
        unsafe { cuda.memcpy_dtod_async_on(device, stream as *mut std::ffi::c_void, &jobs) }
    })?;
    Ok(())
}

/// One staging copy as Python hands it: (source address, source device (-1 host),
/// destination pin, destination offset, nbytes).
type RawCopy<'py> = (u64, i32, Bound<'py, HostPin>, u64, u64);

/// Copy tensor memory into staging buffers on `threads` threads; returns when
/// every byte has landed. The caller keeps sources unmodified until then.
#[pyfunction]
#[pyo3(signature = (copies, threads=8))]
fn stage_copy<'py>(
    py: Python<'py>,
    copies: Vec<RawCopy<'py>>,
    threads: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let mut pins: Vec<Arc<crate::staging::HostPin>> = Vec::new();
    let mut jobs = Vec::with_capacity(copies.len());
    for (src, dev, pin, dst_offset, len) in copies {
        let p = pin.get().get()?;
        let dst = match pins.iter().position(|q| Arc::ptr_eq(q, &p)) {
            Some(i) => i,
            None => {
                pins.push(p);
                pins.len() - 1
            }
        };
        jobs.push(crate::staging::CopyJob {
            src,
            memory: if dev < 0 {
                Memory::Host
            } else {
                Memory::Cuda(dev)
            },
            dst,
            dst_offset,
            len,
        });
    }
    let st = py.detach(|| {
        let refs: Vec<&crate::staging::HostPin> = pins.iter().map(|p| p.as_ref()).collect();
        // SAFETY: the Python caller keeps sources alive and unmodified and owns
        // the destinations (documented contract); pins are held by `pins`.
        unsafe { crate::staging::copy_to_host(&refs, &jobs, threads) }
    })?;
    let d = PyDict::new(py);
    d.set_item("bytes", st.bytes)?;
    d.set_item("device_bytes", st.device_bytes)?;
    d.set_item("unpinned_device_bytes", st.unpinned_device_bytes)?;
    d.set_item("pieces", st.pieces)?;
    d.set_item("threads", st.threads)?;
    Ok(d)
}

/// What this machine offers: libcuda, libcufile, and (for `folder`) whether
/// O_DIRECT and cuFile handles work on files there, and why not.
#[pyfunction]
#[pyo3(signature = (folder=None))]
fn info<'py>(py: Python<'py>, folder: Option<PathBuf>) -> PyResult<Bound<'py, PyDict>> {
    let (c, f, folder_info) = py.detach(|| {
        let c = crate::cuda::probe();
        let f = crate::cufile::probe();
        let fi = folder.map(|dir| probe_folder(&dir));
        (c, f, fi)
    });
    let d = PyDict::new(py);
    let cd = PyDict::new(py);
    cd.set_item("found", c.found)?;
    cd.set_item("path", c.path)?;
    cd.set_item("driver_version", c.driver_version)?;
    cd.set_item("device_count", c.device_count)?;
    cd.set_item("reason", c.reason)?;
    d.set_item("cuda", cd)?;
    let fd = PyDict::new(py);
    fd.set_item("found", f.found)?;
    fd.set_item("path", f.path.clone())?;
    fd.set_item("version", f.version)?;
    fd.set_item("driver_open", f.driver_open)?;
    fd.set_item("nvfs_version", f.nvfs_version)?;
    fd.set_item("compat_mode", f.compat_mode)?;
    fd.set_item("run_udev", f.run_udev)?;
    fd.set_item("reason", f.reason.clone())?;
    d.set_item("cufile", fd)?;
    if let Some((path, direct, direct_reason, align, cufile, cufile_reason)) = folder_info {
        let x = PyDict::new(py);
        x.set_item("path", path)?;
        x.set_item("o_direct", direct)?;
        x.set_item("o_direct_reason", direct_reason)?;
        x.set_item("alignment", align)?;
        x.set_item("cufile_handle", cufile)?;
        x.set_item("cufile_reason", cufile_reason)?;
        d.set_item("folder", x)?;
    }
    Ok(d)
}

type FolderProbe = (
    PathBuf,
    bool,
    Option<String>,
    (usize, usize),
    bool,
    Option<String>,
);

fn probe_folder(dir: &std::path::Path) -> FolderProbe {
    let fail = |why: String| {
        (
            dir.to_path_buf(),
            false,
            Some(why.clone()),
            (0, 0),
            false,
            Some(why),
        )
    };
    let tmp = match AtomicFile::create(&dir.join(".ckptio-probe")) {
        Ok(t) => t,
        Err(e) => return fail(e.to_string()),
    };
    let file = match tmp.file().try_clone() {
        Ok(f) => f,
        Err(e) => return fail(e.to_string()),
    };
    let io = match IoFile::from_writable(file, tmp.tmp_path(), DirectMode::Auto) {
        Ok(io) => io,
        Err(e) => return fail(e.to_string()),
    };
    let a = io.alignment();
    // SAFETY: the handle is dropped at the end of this expression, before `io`.
    let (cufile, why) = match unsafe { gpu::open_device_path(&io, Backend::CuFile) } {
        Ok(p) => (
            true,
            p.gds_mode()
                .map(|m| format!("cuFile handle registered ({m} mode)")),
        ),
        Err(e) => (false, Some(e.to_string())),
    };
    let r = (
        dir.to_path_buf(),
        io.is_direct(),
        io.no_direct_reason().map(str::to_owned),
        (a.offset, a.memory),
        cufile,
        why,
    );
    drop(io);
    drop(tmp);
    r
}

/// Test only (needs CKPTIO_TEST_FAULTS=1 at process start): make the `nth`
/// next hit of a fault point fail with `errno`. Points: create, fallocate,
/// write, read, crc, fsync, rename, fsync_dir.
#[pyfunction]
#[pyo3(signature = (point, errno, nth=1))]
fn _set_fault(point: &str, errno: i32, nth: u64) -> PyResult<()> {
    fault::set_fault(point.parse()?, errno, nth)?;
    Ok(())
}

/// Test only: drop pending faults and stop recording; returns the points of
/// faults that never fired.
#[pyfunction]
fn _clear_faults() -> Vec<&'static str> {
    fault::clear().into_iter().map(|(p, _)| p.name()).collect()
}

/// Test only: start logging every fault point reached, in order.
#[pyfunction]
fn _record_ops() -> PyResult<()> {
    fault::record()?;
    Ok(())
}

/// Test only: the points logged since `_record_ops` ("point file-name").
#[pyfunction]
fn _op_log() -> Vec<String> {
    fault::take_log()
}

#[pymodule(gil_used = false)]
mod _native {
    #[pymodule_export]
    use super::{
        _clear_faults, _op_log, _record_ops, _set_fault, cufile_register_buffer, info, map_archive,
        stage_copy, stage_device_copy, stage_pin, AtomicWriter, BufferRegistration, DeviceFile,
        Engine, HostPin, Reader,
    };

    use super::*;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        let py = m.py();
        m.add("CkptioError", py.get_type::<CkptioError>())?;
        m.add("FormatError", py.get_type::<FormatError>())?;
        m.add(
            "BackendUnavailableError",
            py.get_type::<BackendUnavailableError>(),
        )?;
        m.add("CudaError", py.get_type::<CudaError>())?;
        m.add("CuFileError", py.get_type::<CuFileError>())?;
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        // Fault injection is decided once, from the environment at import.
        crate::fault::latch_env();
        Ok(())
    }
}
