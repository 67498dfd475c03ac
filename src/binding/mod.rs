//! The Python binding (`ckptio._native`), built with the `python` feature.
//!
//! Thin on purpose: it converts arguments into owned core values while attached
//! to the interpreter, runs every blocking call detached (`py.detach`), and turns
//! core errors into specific Python exceptions. No lock is ever waited for while
//! attached unless it is only ever held for a few instructions, never across a
//! detach or any I/O (the classes' own locks are taken inside `py.detach`), so
//! a thread holding the interpreter never waits for one that needs it back.
//! Every call that works on raw addresses takes the objects that own them
//! ([`Owners`]), checks every address range against the owners' own extents
//! before any byte moves, and holds them until it returns. Policy (which storages, which
//! offsets, torch semantics) lives in the Python package. One file per Python
//! class or group of functions; the helpers they share are here.

mod device_file;
mod engine;
mod errors;
mod faults;
mod hostmem;
mod owners;
mod pickled;
mod probe;
#[cfg(feature = "probes")]
mod probe_hooks;
mod reader;
mod safetensors;
mod staging;
mod store;
mod writer;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::engine::{EngineConfig, Memory, Patch, Report, Request, Segment};
use crate::format::integrity::Storage;
use crate::gpu::Backend;
use crate::io::file::DirectMode;

use device_file::{cufile_register_buffer, BufferRegistration, DeviceFile};
use engine::{env_threads, pinned_memory, release_buffers, Engine};
use errors::{BackendUnavailableError, CkptioError, CuFileError, CudaError, FormatError};
use faults::{_clear_faults, _op_log, _record_ops, _set_fault, _set_truncation};
use hostmem::{advise_huge, detach_mapping, HostMemory};
use pickled::{unpickle, StateDictPickler, Unpickled};
use probe::info;
use reader::{check_archive, map_archive, map_archives, verify_zstd_item, Reader};
use safetensors::safetensors_header;
use staging::{stage_copy, stage_device_copy, stage_pin, HostPin};
use writer::{clean_temps, AtomicWriter};

fn direct_mode(s: Option<&str>) -> PyResult<Option<DirectMode>> {
    Ok(match s {
        None => None,
        Some(s) => Some(s.parse::<DirectMode>()?),
    })
}

/// (file offset, address, length, device) as the Python side hands them; device -1 is host memory.
type RawSegment = (u64, u64, u64, i32);

/// (device, raw CUstream): the caller's current stream per device. Device
/// memory is touched only after the work queued there before the call.
type Streams = Vec<(i32, u64)>;

/// The objects that own the memory behind a call's addresses (storages,
/// tensors, a staging buffer): references taken while attached and held until
/// the call returns, so that no other Python thread can free that memory
/// while the engine works on it detached; every range the call moves is
/// checked against their extents first (see [`owners`]).
use owners::Owners;

fn memory(dev: i32) -> Memory {
    if dev < 0 {
        Memory::Host
    } else {
        Memory::Cuda(dev)
    }
}

fn to_segments(raw: Vec<RawSegment>) -> Vec<Segment> {
    raw.into_iter()
        .map(|(file_offset, addr, len, dev)| Segment {
            file_offset,
            addr,
            len,
            memory: memory(dev),
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

/// What a transfer asks for besides its segments, as the Python side hands it.
#[derive(Default)]
struct Ask {
    streams: Streams,
    file_len: Option<u64>,
    checksum: bool,
    /// Segments' CRC-32s to store in the file (writes).
    patches: Vec<Patch>,
}

/// Storages of a torch.save archive as the Python side hands them:
/// (key, address, nbytes, device), device -1 for host memory.
type RawStorage = (String, u64, u64, i32);

/// `write_storages` of `AtomicWriter` and `DeviceFile`: each storage checked
/// against the memory of `owners`, then `write` (the file's
/// `integrity::write_storages`) run detached with the storages and the
/// caller's streams; the report as a dict.
fn write_storages<'py>(
    py: Python<'py>,
    engine: &Engine,
    raw: Vec<RawStorage>,
    owners: Owners,
    streams: Streams,
    write: impl FnOnce(&crate::engine::Engine, &[Storage], &[(i32, u64)]) -> crate::Result<Report>
        + Send,
) -> PyResult<Bound<'py, PyDict>> {
    let storages: Vec<Storage> = raw
        .into_iter()
        .map(|(key, addr, len, dev)| Storage {
            key,
            addr,
            len,
            memory: memory(dev),
        })
        .collect();
    for s in &storages {
        owners.check(s.memory, s.addr, s.len, || format!("storage {}", s.key))?;
    }
    let ask = Ask {
        streams,
        ..Ask::default()
    };
    let rep = detached(py, engine, Vec::new(), owners, ask, |e, _, r| {
        write(e, &storages, r.streams)
    })?;
    report_dict(py, &rep)
}

/// Run one transfer of `segments` detached: `run` gets the core engine, the
/// segments and the request. Every segment must lie inside the memory of
/// `owners` (checked first), which are held until it returns (references
/// taken while attached, dropped once attached again).
fn detached<T: Send>(
    py: Python<'_>,
    engine: &engine::Engine,
    segments: Vec<RawSegment>,
    owners: Owners,
    ask: Ask,
    run: impl FnOnce(&crate::engine::Engine, &[Segment], Request<'_>) -> crate::Result<T> + Send,
) -> PyResult<T> {
    let engine = engine.inner.clone();
    let segs = to_segments(segments);
    owners.check_segments(&segs)?;
    let req = Request {
        checksum: ask.checksum,
        streams: &ask.streams,
        file_len: ask.file_len,
        patches: &ask.patches,
    };
    let out = py.detach(|| run(&engine, &segs, req));
    owners.release();
    Ok(out?)
}

/// A write's report, with each segment's CRC-32 ("crc32") when asked for.
fn write_dict<'py>(py: Python<'py>, rep: &Report, checksum: bool) -> PyResult<Bound<'py, PyDict>> {
    let d = report_dict(py, rep)?;
    if checksum {
        // Per segment: the CRC-32 of its bytes, None where cuFile moved them.
        d.set_item("crc32", &rep.stats.crc32)?;
    }
    Ok(d)
}

/// A transfer's report as the Python side reads it (see `IOReport`).
fn report_dict<'py>(py: Python<'py>, rep: &Report) -> PyResult<Bound<'py, PyDict>> {
    let (s, d) = (&rep.stats, PyDict::new(py));
    d.set_item("bytes", s.bytes)?;
    d.set_item("chunks", s.chunks)?;
    d.set_item("threads", s.threads)?;
    d.set_item("direct", s.direct)?;
    d.set_item("direct_reason", rep.direct_reason.as_deref())?;
    d.set_item("backend", rep.backend.name())?;
    d.set_item("device_path", s.device_path)?;
    d.set_item("gds_mode", rep.gds_mode)?;
    d.set_item("fallback_reason", rep.fallback_reason.as_deref())?;
    d.set_item("pinned_bytes", crate::gpu::budget::held())?;
    if let Some(r) = &s.read_path {
        d.set_item("read_path", if r.memory { "memory" } else { "disk" })?;
        d.set_item("read_source", r.source)?;
        d.set_item("read_reason", &r.reason)?;
    }
    Ok(d)
}

#[pymodule(gil_used = false)]
mod _native {
    // Everything listed here is public API and goes into `__all__`. The test
    // and probe hooks are set as plain attributes in `init` instead.
    #[pymodule_export]
    use super::{
        advise_huge, check_archive, clean_temps, cufile_register_buffer, detach_mapping,
        env_threads, info, map_archive, map_archives, pinned_memory, release_buffers,
        safetensors_header, stage_copy, stage_device_copy, stage_pin, store::store_crc32,
        store::store_delete, store::store_download, store::store_get, store::store_head,
        store::store_list, store::store_put, store::store_read, store::store_read_into,
        store::store_torch_map, store::store_upload, store::store_upload_archive,
        store::store_upload_image, store::store_upload_zstd, store::zip_headers_match,
        store::ObjectWriter, unpickle, verify_zstd_item, AtomicWriter, BufferRegistration,
        DeviceFile, Engine, HostMemory, HostPin, Reader, StateDictPickler, Unpickled,
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
        for (name, cls) in errors::store_classes(py)? {
            m.add(name, cls)?;
        }
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("CORRUPT_HINT", crate::error::CORRUPT_HINT)?;
        // Test hooks: importable by name (`from ckptio._native import _set_fault`),
        // never in `__all__` (`add` would put them there; `setattr` does not).
        m.setattr("_set_fault", wrap_pyfunction!(_set_fault, m)?)?;
        m.setattr("_set_truncation", wrap_pyfunction!(_set_truncation, m)?)?;
        m.setattr("_clear_faults", wrap_pyfunction!(_clear_faults, m)?)?;
        m.setattr("_record_ops", wrap_pyfunction!(_record_ops, m)?)?;
        m.setattr("_op_log", wrap_pyfunction!(_op_log, m)?)?;
        // Probe hooks, only in a build with the `probes` feature (benches, probes).
        #[cfg(feature = "probes")]
        {
            m.setattr(
                "host_memory",
                wrap_pyfunction!(probe_hooks::host_memory, m)?,
            )?;
            m.setattr(
                "memory_copy_floor",
                wrap_pyfunction!(probe_hooks::memory_copy_floor, m)?,
            )?;
        }
        // Fault injection is decided once, from the environment at import.
        crate::io::fault::latch_env();
        Ok(())
    }
}
