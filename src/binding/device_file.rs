//! `DeviceFile`: an open file for storages at given offsets (what
//! `ckptio.GdsFile` wraps), and cuFile buffer registrations.

use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::engine::Stats;
use crate::gpu::{Backend, DevicePath};
use crate::io::file::IoFile;
use crate::Error;

use super::engine::Engine;
use super::{ensure_device_path, file_modes, report, to_segments, RawSegment};

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
            *g = Some(
                py.detach(|| unsafe { crate::gpu::open_device_path(&self.io, self.backend) })?,
            );
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
    /// `checksum`: also return each segment's CRC-32 (`"crc32"`, None where
    /// cuFile moved the bytes), computed in the I/O threads.
    ///
    /// The caller keeps every destination alive and untouched until this returns.
    #[pyo3(signature = (engine, segments, checksum=false))]
    fn read_segments<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        segments: Vec<RawSegment>,
        checksum: bool,
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
            unsafe { engine.read_via(&self.io, &segs, path, checksum) }
        })?;
        let crc32 = checksum.then(|| stats.crc32.clone());
        let g = self.device.lock().unwrap_or_else(|p| p.into_inner());
        let d = report(py, stats, &self.io, g.as_ref())?;
        if let Some(crc32) = crc32 {
            d.set_item("crc32", crc32)?;
        }
        Ok(d)
    }
}

/// A cuFileBufRegister registration; deregistered when dropped or on `close()`.
#[pyclass(frozen, module = "ckptio._native")]
pub struct BufferRegistration {
    inner: Mutex<Option<crate::gpu::cufile::BufferRegistration>>,
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
pub(super) fn cufile_register_buffer(
    py: Python<'_>,
    addr: u64,
    nbytes: usize,
) -> PyResult<BufferRegistration> {
    let reg = py.detach(|| {
        let d = crate::gpu::cufile::driver()?;
        // SAFETY: the Python caller keeps the storage allocated until close().
        unsafe { d.register_buffer(addr, nbytes) }
    })?;
    Ok(BufferRegistration {
        inner: Mutex::new(Some(reg)),
    })
}
