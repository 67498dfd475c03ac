//! `DeviceFile`: an open file for storages at given offsets (what
//! `ckptio.GdsFile` wraps and the safetensors and DCP readers use), and
//! cuFile buffer registrations.

use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::engine::{Memory, Owned, TransferFile};
use crate::format::integrity;
use crate::gpu::Backend;
use crate::io::file::IoFile;
use crate::Error;

use super::engine::Engine;
use super::{detached, file_modes, write_dict, Ask, Owners, RawSegment, Streams};

/// An open file for moving memory to and from given offsets.
///
/// Its device path (cuFile where it takes the file, else the bounce pipeline)
/// opens on the first transfer of device memory or on `register_handle`, and
/// stays until `deregister_handle`, after which device memory takes the bounce
/// pipeline until `register_handle` opens it again.
#[pyclass(frozen, module = "ckptio._native")]
pub struct DeviceFile {
    file: TransferFile,
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
                file: TransferFile::new(io, backend),
            })
        })
        .map_err(Into::into)
    }

    /// Open `path` with `os.open` `flags` (as `GdsFile` does; O_DIRECT is
    /// left to the second descriptor, added where the filesystem takes it),
    /// after checking `direct` and `backend` (and, for "cufile", that the
    /// cuFile driver opens): an argument refused leaves the file untouched.
    #[staticmethod]
    #[pyo3(signature = (path, flags, direct=None, backend=None))]
    fn open(
        py: Python<'_>,
        path: PathBuf,
        flags: i32,
        direct: Option<&str>,
        backend: Option<&str>,
    ) -> PyResult<Self> {
        let (mode, backend) = file_modes(direct, backend)?;
        py.detach(|| {
            if backend == Backend::CuFile {
                crate::gpu::cufile::driver()?;
            }
            let io = IoFile::open_flags(&path, flags, mode)?;
            Ok::<_, Error>(DeviceFile {
                file: TransferFile::new(io, backend),
            })
        })
        .map_err(Into::into)
    }

    /// Open the device path now: cuFile where it takes the file (an error
    /// when the backend is "cufile" and it cannot), else the bounce pipeline.
    fn register_handle(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.file.open_device_path())?;
        Ok(())
    }

    /// Close the device path (cuFileHandleDeregister, once transfers still
    /// using the handle end); device memory then takes the bounce pipeline.
    fn deregister_handle(&self, py: Python<'_>) {
        py.detach(|| self.file.close_device_path());
    }

    /// The backend asked for: "auto", "cufile" or "bounce".
    #[getter]
    fn backend(&self) -> &'static str {
        self.file.backend().name()
    }

    /// The device path open now: "cufile", "bounce", or None (not opened yet,
    /// or closed by deregister_handle).
    #[getter]
    fn device_path(&self) -> Option<&'static str> {
        self.file.path_state().map(|p| p.name)
    }

    /// With cuFile: "p2p" or "compat".
    #[getter]
    fn gds_mode(&self) -> Option<&'static str> {
        self.file.path_state().and_then(|p| p.gds_mode)
    }

    /// Why the open device path is not cuFile, when it is not.
    #[getter]
    fn fallback_reason(&self) -> Option<String> {
        self.file.path_state().and_then(|p| p.fallback_reason)
    }

    /// The buffered descriptor of the open file (for reading a header beside the engine).
    fn fileno(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.file.io().file().as_raw_fd()
    }

    /// Read file ranges into memory in one engine pass: `segments` =
    /// [(file offset, address, nbytes, device)], device -1 for host memory,
    /// after the work queued on `streams` ([(device, CUstream)]). A range past
    /// the end of the file is a `FormatError`. `owners` (the objects owning
    /// the destinations) are held until this returns; nobody else may touch
    /// the destinations meanwhile.
    ///
    /// `checksum`: also return each segment's CRC-32 (`"crc32"`, None where
    /// cuFile moved the bytes), computed in the I/O threads.
    #[pyo3(signature = (engine, segments, owners, streams, checksum=false))]
    fn read_segments<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        segments: Vec<RawSegment>,
        owners: Owners,
        streams: Streams,
        checksum: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ask = Ask {
            streams,
            checksum,
            ..Ask::default()
        };
        // SAFETY: every destination lies inside its owners' memory (checked
        // by `detached`), which they keep allocated until this returns; the
        // caller leaves it untouched (documented contract) and hands its own
        // streams; the engine refuses destinations that overlap.
        let rep = detached(py, engine, segments, owners, ask, |e, s, r| unsafe {
            self.file.read(e, s, r)
        })?;
        write_dict(py, &rep, checksum)
    }

    /// Write memory ranges to the file: `segments`, `owners` and `streams` as
    /// for `read_segments`; nobody may modify the sources until this returns.
    /// `file_len` and `checksum` as for `AtomicWriter.write_segments`.
    #[pyo3(signature = (engine, segments, owners, streams, file_len=None, checksum=false))]
    #[allow(clippy::too_many_arguments)] // the Python signature
    fn write_segments<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        segments: Vec<RawSegment>,
        owners: Owners,
        streams: Streams,
        file_len: Option<u64>,
        checksum: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ask = Ask {
            streams,
            file_len,
            checksum,
            ..Ask::default()
        };
        // SAFETY: as in read_segments, for sources.
        let rep = detached(py, engine, segments, owners, ask, |e, s, r| unsafe {
            self.file.write(e, s, r)
        })?;
        write_dict(py, &rep, checksum)
    }

    /// Into a torch.save archive that torch wrote here under `skip_data` (a
    /// save into a file object): each storage's bytes into its record
    /// `<prefix>/data/<key>`, then the records' CRC-32s, as
    /// `AtomicWriter.write_storages` does for a path. `storages`: [(key,
    /// address, nbytes, device)]; `owners` and `streams` as for `write_segments`.
    fn write_storages<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        storages: Vec<super::RawStorage>,
        owners: Owners,
        streams: Streams,
    ) -> PyResult<Bound<'py, PyDict>> {
        super::write_storages(py, engine, storages, owners, streams, |e, st, streams| {
            // SAFETY: every storage lies inside its owners' memory (checked
            // first), which they keep allocated until this returns; the caller
            // leaves it unmodified (documented contract) and hands its own streams.
            unsafe { integrity::write_storages(e, &self.file, st, streams) }
        })
    }
}

/// A cuFileBufRegister registration and the object owning its memory (held
/// so the memory cannot be freed while registered); deregistered when
/// dropped or on `close()`.
#[pyclass(frozen, module = "ckptio._native")]
pub struct BufferRegistration {
    // Held only to take its contents (never across a detach or I/O).
    inner: Mutex<Option<(crate::gpu::cufile::BufferRegistration, Py<PyAny>)>>,
}

#[pymethods]
impl BufferRegistration {
    /// Deregister, then let go of the owner. Idempotent.
    fn close(&self, py: Python<'_>) {
        let taken = crate::sync::lock(&self.inner).take();
        if let Some((reg, owner)) = taken {
            py.detach(move || drop(reg));
            drop(owner);
        }
    }
}

/// Register `nbytes` of device memory at `addr`, owned by `owner` (a
/// storage or tensor, whose CUDA memory must hold the range), with cuFile;
/// the registration holds `owner` until closed.
#[pyfunction]
pub(super) fn cufile_register_buffer(
    py: Python<'_>,
    owner: Bound<'_, PyAny>,
    addr: u64,
    nbytes: usize,
) -> PyResult<BufferRegistration> {
    let e = super::owners::extent_of(&owner)?;
    let Memory::Cuda(_) = e.memory else {
        return Err(Error::invalid(
            "cufile_register_buffer: the owner's memory is not CUDA memory",
        )
        .into());
    };
    Owned::new([e]).check(e.memory, addr, nbytes as u64, || "the buffer".to_string())?;
    let owner = owner.unbind();
    let reg = py.detach(|| {
        let d = crate::gpu::cufile::driver()?;
        // SAFETY: the range lies inside `owner`'s device memory (checked
        // above), which `owner` keeps allocated for as long as the
        // registration lives (both sit in the returned object).
        unsafe { d.register_buffer(addr, nbytes) }
    })?;
    Ok(BufferRegistration {
        inner: Mutex::new(Some((reg, owner))),
    })
}
