//! The Python binding (`ckptio._native`), built with the `python` feature.
//!
//! Thin on purpose: it converts arguments into owned core values while attached
//! to the interpreter, runs every blocking call detached (`py.detach`), and turns
//! core errors into specific Python exceptions. Policy (which storages, which
//! offsets, torch semantics) lives in the Python package. One file per Python
//! class or group of functions; the helpers they share are here.

mod device_file;
mod engine;
mod errors;
mod faults;
mod pickled;
mod probe;
mod reader;
mod safetensors;
mod staging;
mod writer;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::engine::{EngineConfig, Memory, Segment, Stats};
use crate::gpu::{self, Backend, DevicePath};
use crate::io::file::{DirectMode, IoFile};
use crate::Error;

use device_file::{cufile_register_buffer, BufferRegistration, DeviceFile};
use engine::Engine;
use errors::{BackendUnavailableError, CkptioError, CuFileError, CudaError, FormatError};
use faults::{_clear_faults, _op_log, _record_ops, _set_fault};
use pickled::{unpickle, StateDictPickler, Unpickled};
use probe::info;
use reader::{map_archive, map_archives, Reader};
use safetensors::safetensors_header;
use staging::{stage_copy, stage_device_copy, stage_pin, HostPin};
use writer::AtomicWriter;

fn direct_mode(s: Option<&str>) -> PyResult<Option<DirectMode>> {
    Ok(match s {
        None => None,
        Some(s) => Some(s.parse::<DirectMode>()?),
    })
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

#[pymodule(gil_used = false)]
mod _native {
    #[pymodule_export]
    use super::{
        _clear_faults, _op_log, _record_ops, _set_fault, cufile_register_buffer, info, map_archive,
        map_archives, safetensors_header, stage_copy, stage_device_copy, stage_pin, unpickle,
        AtomicWriter, BufferRegistration, DeviceFile, Engine, HostPin, Reader, StateDictPickler,
        Unpickled,
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
        crate::io::fault::latch_env();
        Ok(())
    }
}
