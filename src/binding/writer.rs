//! `AtomicWriter`: a checkpoint being written into a temp file beside its
//! target, replaced atomically on commit.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::engine::{Memory, Patch, TransferFile};
use crate::format::integrity;
use crate::format::zipwrite::{self, Body, Entry};
use crate::format::zstd;
use crate::io::file::IoFile;
use crate::io::persist::{self, AtomicFile};
use crate::Error;

use super::engine::Engine;
use super::{
    detached, file_modes, memory, report_dict, write_dict, Ask, Owners, RawSegment, Streams,
};

struct WriterState {
    // Field order is drop order: the file (and its cuFile handle) before the
    // temp file it writes, which is removed unless committed.
    file: TransferFile,
    atomic: AtomicFile,
}

/// A checkpoint being written: a temp file beside the target, replaced atomically on commit.
///
/// Its lock is only ever taken detached (a write holds it for its whole
/// length): a thread waiting for it never holds the interpreter.
#[pyclass(frozen, module = "ckptio._native")]
pub struct AtomicWriter {
    state: Mutex<Option<WriterState>>,
    fd: i32,
    tmp_path: PathBuf,
    target: PathBuf,
}

/// (zip head, data address, data length, zip tail, CRC-32 offsets in the tail).
pub(super) type ZstdItem = (Vec<u8>, u64, u64, Vec<u8>, Vec<usize>);

/// Each item's data lies in host memory that `owners` own.
pub(super) fn check_zstd_items(items: &[ZstdItem], owners: &Owners) -> PyResult<()> {
    for (k, (_, addr, len, _, _)) in items.iter().enumerate() {
        owners.check(Memory::Host, *addr, *len, || format!("item {k}"))?;
        if usize::try_from(*len).is_err() {
            return Err(Error::invalid(format!("item {k}: {len} bytes")).into());
        }
    }
    Ok(())
}

/// The items as the zstd writer takes them: (zip head, address, nbytes, zip
/// tail, offsets of the data's CRC-32 in the tail).
///
/// # Safety
/// Each item's `[address, address + nbytes)` must be host memory that stays
/// allocated and unmodified while the returned items live
/// ([`check_zstd_items`] against owners the caller holds).
pub(super) unsafe fn zstd_items(items: &[ZstdItem]) -> Vec<zstd::Item<'_>> {
    items
        .iter()
        .map(|(head, addr, len, tail, crc_at)| {
            let data = if *len == 0 {
                &[][..]
            } else {
                // SAFETY: the caller's contract (above).
                unsafe { std::slice::from_raw_parts(*addr as *const u8, *len as usize) }
            };
            zstd::Item {
                head,
                data,
                tail,
                crc_at,
            }
        })
        .collect()
}

/// A record's bytes as Python hands them: (address, nbytes, device), or a
/// bytes object. (Storages first: the variants are tried in order, and a
/// failed try costs an exception object.)
#[derive(FromPyObject)]
pub(super) enum RawBody<'py> {
    Memory((u64, u64, i32)),
    Bytes(Bound<'py, PyBytes>),
}

/// An archive's records from Python's (name, body, alignment), every memory
/// record checked against `owners`.
pub(super) fn entries_of(
    raw: Vec<(String, RawBody<'_>, u64)>,
    owners: &Owners,
) -> PyResult<Vec<Entry>> {
    let entries: Vec<Entry> = raw
        .into_iter()
        .map(|(name, body, align)| Entry {
            name,
            body: match body {
                RawBody::Bytes(b) => Body::Bytes(b.as_bytes().to_vec()),
                RawBody::Memory((addr, len, dev)) => Body::Memory {
                    addr,
                    len,
                    memory: memory(dev),
                },
            },
            align,
        })
        .collect();
    for e in &entries {
        if let Body::Memory { addr, len, memory } = e.body {
            owners.check(memory, addr, len, || format!("record {:?}", e.name))?;
        }
    }
    Ok(entries)
}

/// What a call on a committed or aborted writer meets.
fn done_error() -> Error {
    Error::invalid("the checkpoint writer is already committed or aborted")
}

impl AtomicWriter {
    /// Run `f` on the open state under the writer's lock. Only ever called
    /// detached: the lock may be held for a whole write.
    fn locked<T>(&self, f: impl FnOnce(&WriterState) -> Result<T, Error>) -> Result<T, Error> {
        let g = crate::sync::lock(&self.state);
        f(g.as_ref().ok_or_else(done_error)?)
    }

    /// Take the state out (commit, abort), detached.
    fn take_state(&self, py: Python<'_>) -> Option<WriterState> {
        py.detach(|| crate::sync::lock(&self.state).take())
    }
}

/// Remove the temp files of dead saves in `folder` (ckptio's temp-name pattern
/// only, only files whose liveness lock can be taken); the names removed.
#[pyfunction]
pub(super) fn clean_temps(py: Python<'_>, folder: PathBuf) -> PyResult<Vec<OsString>> {
    Ok(py.detach(|| persist::remove_stale_temps(&folder))?)
}

#[pymethods]
impl AtomicWriter {
    /// `sweep`: first remove the temp files of dead saves in the folder (a
    /// save of many files asks once, for its first file).
    #[new]
    #[pyo3(signature = (path, direct=None, backend=None, sweep=true))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        direct: Option<&str>,
        backend: Option<&str>,
        sweep: bool,
    ) -> PyResult<Self> {
        let (mode, backend) = file_modes(direct, backend)?;
        py.detach(|| {
            let atomic = AtomicFile::create_with(&path, sweep)?;
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
                state: Mutex::new(Some(WriterState {
                    file: TransferFile::new(io, backend),
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

    /// The file that commit replaces (a symbolic link there followed by the kernel).
    #[getter]
    fn target(&self) -> PathBuf {
        self.target.clone()
    }

    /// Write each storage's bytes into its record `<prefix>/data/<key>`, then
    /// the records' CRC-32s (computed as the bytes pass through host memory;
    /// records written by cuFile are listed as unchecked in the archive comment).
    /// `storages`: [(key, address, nbytes, device)], device -1 for host memory;
    /// `owners` and `streams` as for `write_segments`.
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
            self.locked(|s| unsafe { integrity::write_storages(e, &s.file, st, streams) })
        })
    }

    /// Write a whole torch.save archive into the (empty) temp file, laid out
    /// with an alignment per record: `entries` = [(full record name, bytes or
    /// (address, nbytes, device), alignment)] in file order, device -1 for
    /// host memory. Headers and data go in one engine pass (small records
    /// gathered into shared I/Os, CRC-32s stored as the bytes pass), then the
    /// central directory. `prefix` is the archive's folder (`<prefix>/data/*`
    /// are its data records); `owners` and `streams` as for `write_segments`.
    fn write_archive<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        entries: Vec<(String, RawBody<'py>, u64)>,
        prefix: String,
        owners: Owners,
        streams: Streams,
    ) -> PyResult<Bound<'py, PyDict>> {
        let entries = entries_of(entries, &owners)?;
        let ask = Ask {
            streams,
            ..Ask::default()
        };
        let rep = detached(py, engine, Vec::new(), owners, ask, |e, _, r| {
            // SAFETY: every record's memory lies inside its owners' (checked
            // above), which they keep allocated until this returns; the caller
            // leaves it unmodified (documented contract) and hands its own streams.
            self.locked(|st| unsafe { zipwrite::write(e, &st.file, &entries, &prefix, r.streams) })
        })?;
        report_dict(py, &rep.report)
    }

    /// Write memory ranges at given file offsets: `segments` =
    /// [(file offset, address, nbytes, device)], device -1 for host memory,
    /// after the work queued on `streams` ([(device, CUstream)]). `owners`
    /// (the objects owning the ranges) are held until this returns; nobody may
    /// modify the ranges meanwhile. `file_len`: the final size of the file,
    /// preallocated up front (when the engine preallocates) so that a full
    /// disk fails before any data moves.
    ///
    /// `checksum`: also return each segment's CRC-32 (`"crc32"`, None where
    /// cuFile moved the bytes), computed in the I/O threads. `patches`:
    /// [(segment index, file offset)]: store that segment's CRC-32 (4 bytes,
    /// little-endian) at that offset, outside the segment (a zip data
    /// descriptor or central directory entry), in the same I/O where the
    /// engine can; nothing where cuFile moved the bytes.
    #[pyo3(signature = (engine, segments, owners, streams, file_len=None, checksum=false, patches=None))]
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
        patches: Option<Vec<(usize, u64)>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ask = Ask {
            streams,
            file_len,
            checksum,
            patches: patches
                .unwrap_or_default()
                .into_iter()
                .map(|(seg, at)| Patch { seg, at })
                .collect(),
        };
        let rep = detached(py, engine, segments, owners, ask, |e, s, r| {
            // SAFETY: every segment lies inside its owners' memory (checked by
            // `detached`); otherwise as in write_storages.
            self.locked(|st| unsafe { st.file.write(e, s, r) })
        })?;
        write_dict(py, &rep, checksum)
    }

    /// Compress each item (`items` = [(zip head, address, nbytes, zip tail,
    /// offsets of the data's CRC-32 in the tail)], data in host memory) into one
    /// zstd frame, on the engine's thread count, and write the frames back to
    /// back from `start`: [(offset, length)] per item. The frames are what
    /// torch's ZStandard stream transform decodes. `level` 3 is zstd's default
    /// (`format::zstd::DEFAULT_LEVEL`), the one torch's extension uses.
    ///
    /// `owners` (the objects owning the data) are held until this returns;
    /// nobody may modify the data meanwhile.
    #[pyo3(signature = (engine, start, items, owners, level=3))]
    fn write_zstd(
        &self,
        py: Python<'_>,
        engine: &Engine,
        start: u64,
        items: Vec<ZstdItem>,
        owners: Owners,
        level: i32,
    ) -> PyResult<Vec<(u64, u64)>> {
        let threads = engine.inner.config().threads;
        check_zstd_items(&items, &owners)?;
        let out = py.detach(|| {
            self.locked(|st| {
                // SAFETY: checked above against `owners`, held until this returns.
                let parts = unsafe { zstd_items(&items) };
                zstd::write_items(st.file.io(), start, &parts, level, threads)
            })
        })?;
        owners.release();
        Ok(out)
    }

    /// Write a small byte string (a header) at `offset`.
    fn write_bytes(&self, py: Python<'_>, offset: u64, data: &[u8]) -> PyResult<()> {
        py.detach(|| self.locked(|st| st.file.io().write_at(data, offset)))?;
        Ok(())
    }

    /// fsync, rename over the target, fsync the folder.
    fn commit(&self, py: Python<'_>) -> PyResult<()> {
        let Some(WriterState { file, atomic }) = self.take_state(py) else {
            return Err(done_error().into());
        };
        py.detach(move || {
            drop(file);
            atomic.commit()
        })?;
        Ok(())
    }

    /// Remove the temp file; the target stays as it was. Idempotent.
    fn abort(&self, py: Python<'_>) {
        let state = self.take_state(py);
        py.detach(move || drop(state));
    }
}
