//! Probe hooks, built only with the `probes` feature (benches and probes; the
//! wheel leaves them out): `host_memory` and `memory_copy_floor`. They are
//! set on the module as plain attributes, outside `__all__` and the stub.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::gpu::cuda::PinnedBuffer;
use crate::io::hugepage::{self, AnonMap};
use crate::io::mapped::{self, FloorSource};
use crate::Error;

/// Host memory ckptio holds in its own mappings, once the mappings of files
/// read from memory that wait to be unmapped are gone: "file_mappings" (file
/// mappings alive: 0 between reads), "anon_bytes" (anonymous mappings: engine
/// buffers, pinned pools, `HostMemory` objects alive).
#[pyfunction]
pub(super) fn host_memory(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    py.detach(mapped::flush_unmaps);
    let d = PyDict::new(py);
    d.set_item("file_mappings", mapped::live_mappings())?;
    d.set_item("anon_bytes", hugepage::mapped_bytes())?;
    Ok(d)
}

/// The memory path's CPU floor, for the benches: (seconds, pinned) for
/// `threads` threads to copy the whole file at `path`, `chunk_size` bytes at a
/// time, into two slots each of one pinned buffer (pageable, faulted in, where
/// there is no CUDA), as the memory path fills its bounce lanes but without
/// the engine or the GPU. `source`: "map", "map-nt" or "pread". `pinned=False`:
/// pageable slots even with CUDA, for a floor timed beside running copies
/// (registering the slots would wait on them).
#[pyfunction]
#[pyo3(signature = (path, source="map", threads=8, chunk_size=4194304, pinned=true))]
pub(super) fn memory_copy_floor(
    py: Python<'_>,
    path: PathBuf,
    source: &str,
    threads: usize,
    chunk_size: usize,
    pinned: bool,
) -> PyResult<(f64, bool)> {
    let source: FloorSource = source.parse()?;
    if !(1..=256).contains(&threads) || chunk_size == 0 || chunk_size % 4096 != 0 {
        return Err(Error::invalid(format!(
            "memory_copy_floor: threads must be 1 to 256 and chunk_size a positive \
             multiple of 4096, not {threads} and {chunk_size}"
        ))
        .into());
    }
    let len = threads
        .checked_mul(2 * chunk_size)
        .filter(|&n| n <= 1 << 34)
        .ok_or_else(|| Error::invalid("memory_copy_floor: slots over 16 GiB"))?;
    let r = py.detach(|| -> crate::Result<(f64, bool)> {
        let file = std::fs::File::open(&path).map_err(|e| Error::io_at("open", &path, e))?;
        let mut pinned = pinned.then(|| PinnedBuffer::new(len).ok()).flatten();
        let mut anon = None;
        let ring = match pinned.as_mut() {
            Some(p) => p.as_mut_slice(),
            None => {
                let m = anon.insert(AnonMap::new(len, true)?);
                m.populate(threads, hugepage::HUGE_PAGE);
                m.as_mut_slice()
            }
        };
        let s = mapped::copy_floor(&file, &path, source, threads, chunk_size, ring);
        // Unmapped before the next measurement starts (not timed: the engine
        // unmaps off the caller's path too).
        mapped::flush_unmaps();
        Ok((s?, pinned.is_some()))
    })?;
    Ok(r)
}
