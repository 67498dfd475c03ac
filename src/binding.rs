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
use crate::file::{DirectMode, IoFile};
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
    "The file is not a usable torch.save checkpoint."
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
                        Some(p) => PyOSError::new_err((errno, text, p)),
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
    #[pyo3(signature = (threads=None, chunk_size=None, direct=None))]
    fn new(
        threads: Option<usize>,
        chunk_size: Option<usize>,
        direct: Option<&str>,
    ) -> PyResult<Self> {
        let mut cfg = EngineConfig::from_env()?;
        if let Some(t) = threads {
            cfg.threads = t;
        }
        if let Some(c) = chunk_size {
            cfg.chunk_size = c;
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

    #[getter]
    fn chunk_size(&self) -> usize {
        self.inner.config().chunk_size
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

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "Engine(threads={}, chunk_size={}, direct={:?})",
            c.threads,
            c.chunk_size,
            self.direct()
        )
    }
}

/// (file offset, address, length, device) as the Python side hands them; device -1 is host memory.
type RawSegment = (u64, u64, u64, i32);

fn segments(raw: Vec<RawSegment>) -> Vec<Segment> {
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

fn stats_dict<'py>(py: Python<'py>, s: &Stats, file: &IoFile) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bytes", s.bytes)?;
    d.set_item("chunks", s.chunks)?;
    d.set_item("threads", s.threads)?;
    d.set_item("direct", s.direct)?;
    d.set_item("direct_reason", file.no_direct_reason())?;
    d.set_item("backend", "posix")?;
    Ok(d)
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
    atomic: AtomicFile,
    io: IoFile,
}

/// A checkpoint being written: a temp file beside the target, replaced atomically on commit.
#[pyclass(frozen, module = "ckptio._native")]
pub struct AtomicWriter {
    state: Mutex<Option<WriterState>>,
    fd: i32,
    tmp_path: PathBuf,
    target: PathBuf,
}

impl AtomicWriter {
    fn with_state<T>(&self, f: impl FnOnce(&mut WriterState) -> Result<T, Error>) -> PyResult<T> {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match g.as_mut() {
            Some(s) => Ok(f(s)?),
            None => Err(PyValueError::new_err(
                "the checkpoint writer is already committed or aborted",
            )),
        }
    }
}

#[pymethods]
impl AtomicWriter {
    #[new]
    #[pyo3(signature = (path, direct=None))]
    fn new(py: Python<'_>, path: PathBuf, direct: Option<&str>) -> PyResult<Self> {
        let mode = direct_mode(direct)?.unwrap_or(EngineConfig::from_env()?.direct);
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
                state: Mutex::new(Some(WriterState { atomic, io })),
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

    /// Map the archive written so far (by torch.save under skip_data).
    fn map_archive(&self, py: Python<'_>) -> PyResult<Vec<(String, u64, u64)>> {
        py.detach(|| {
            self.with_state(|s| {
                let a = zipmap::map_file(s.io.file(), Some(s.atomic.tmp_path()))?;
                Ok(records_list(&a))
            })
        })
    }

    /// Write each storage's bytes into its record `<prefix>/data/<key>`.
    /// `storages`: [(key, address, nbytes, device)], device -1 for host memory.
    ///
    /// The caller keeps every storage alive and unmodified until this returns.
    fn write_storages<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        storages: Vec<(String, u64, u64, i32)>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let engine = engine.inner.clone();
        let (stats, reason, direct) = py.detach(|| {
            self.with_state(|s| {
                let path = s.atomic.tmp_path().to_path_buf();
                let a = zipmap::map_file(s.io.file(), Some(&path))?;
                let mut raw = Vec::with_capacity(storages.len());
                for (key, addr, nbytes, dev) in storages {
                    let r = a.storage(&key).ok_or_else(|| {
                        Error::format(Some(&path), format!("no record for storage {key}"))
                    })?;
                    if r.size != nbytes {
                        return Err(Error::format(
                            Some(&path),
                            format!(
                                "record {} holds {} bytes, storage {key} has {nbytes}",
                                r.name, r.size
                            ),
                        ));
                    }
                    raw.push((r.data_offset, addr, nbytes, dev));
                }
                s.io.preallocate(a.file_len)?;
                // SAFETY: the Python caller keeps each storage alive and
                // unmodified for the duration of this call (documented contract).
                let st = unsafe { engine.write(&s.io, &segments(raw))? };
                Ok((
                    st,
                    s.io.no_direct_reason().map(str::to_owned),
                    s.io.is_direct(),
                ))
            })
        })?;
        let d = PyDict::new(py);
        d.set_item("bytes", stats.bytes)?;
        d.set_item("chunks", stats.chunks)?;
        d.set_item("threads", stats.threads)?;
        d.set_item("direct", direct)?;
        d.set_item("direct_reason", reason)?;
        d.set_item("backend", "posix")?;
        Ok(d)
    }

    /// fsync, rename over the target, fsync the folder.
    fn commit(&self, py: Python<'_>) -> PyResult<()> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(s) = state else {
            return Err(PyValueError::new_err(
                "the checkpoint writer is already committed or aborted",
            ));
        };
        py.detach(move || {
            drop(s.io);
            s.atomic.commit()
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
}

#[pymethods]
impl Reader {
    #[new]
    #[pyo3(signature = (path, direct=None))]
    fn new(py: Python<'_>, path: PathBuf, direct: Option<&str>) -> PyResult<Self> {
        let mode = direct_mode(direct)?.unwrap_or(EngineConfig::from_env()?.direct);
        py.detach(|| {
            let io = IoFile::open_read(&path, mode)?;
            let archive = zipmap::map_file(io.file(), Some(&path))?;
            Ok::<_, Error>(Reader { io, archive })
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
    /// The caller keeps every destination alive and untouched until this returns.
    fn read_into<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        segments_in: Vec<RawSegment>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let engine = engine.inner.clone();
        let stats = py.detach(|| {
            for &(off, _, len, _) in &segments_in {
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
            // SAFETY: the Python caller keeps each destination alive and
            // untouched for the duration of this call (documented contract).
            unsafe { engine.read(&self.io, &segments(segments_in)) }
        })?;
        stats_dict(py, &stats, &self.io)
    }
}

#[pymodule(gil_used = false)]
mod _native {
    #[pymodule_export]
    use super::{map_archive, AtomicWriter, Engine, Reader};

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
        Ok(())
    }
}
