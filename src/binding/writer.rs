//! `AtomicWriter`: a checkpoint being written into a temp file beside its
//! target, replaced atomically on commit.

use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::engine::{Memory, Patch, Segment};
use crate::format::integrity;
use crate::format::zipmap::{self, Archive};
use crate::format::zipwrite::{self, Body, Entry};
use crate::gpu::{Backend, DevicePath};
use crate::io::file::IoFile;
use crate::io::persist::AtomicFile;
use crate::Error;

use super::engine::Engine;
use super::{ensure_device_path, file_modes, to_segments, RawSegment, Report};

struct WriterState {
    // Field order is drop order: a cuFile handle goes before the fd it uses.
    device: Option<DevicePath>,
    io: IoFile,
    atomic: AtomicFile,
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
/// the archive with each segment's record index (so CRCs can be filled),
/// whether to hand each segment's CRC-32 back to the caller, and where to
/// store segments' CRC-32s in the file.
type Planned = (
    Vec<RawSegment>,
    Option<u64>,
    Option<(Archive, Vec<usize>)>,
    bool,
    Vec<Patch>,
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
            let (raw, file_len, records, checksum, patches) = plan(&st.io, &path)?;
            if let Some(len) = file_len.filter(|_| engine.config().preallocate) {
                st.io.preallocate(len)?;
            }
            let segs = to_segments(raw);
            // SAFETY: `st.device` is dropped before `st.io` (field order).
            let device = unsafe { ensure_device_path(&mut st.device, &st.io, backend, &segs)? };
            let crc = checksum || records.is_some();
            // SAFETY: the Python caller keeps each range alive and
            // unmodified for the duration of this call (documented contract).
            let stats = unsafe {
                if patches.is_empty() {
                    engine.write_via(&st.io, &segs, device, crc)?
                } else {
                    engine.write_patched(&st.io, &segs, &patches, device)?
                }
            };
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

/// A record's bytes as Python hands them: (address, nbytes, device), or a
/// bytes object. (Storages first: the variants are tried in order, and a
/// failed try costs an exception object.)
#[derive(FromPyObject)]
enum RawBody<'py> {
    Memory((u64, u64, i32)),
    Bytes(Bound<'py, PyBytes>),
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
            Ok((raw, Some(len), Some((a, index)), false, Vec::new()))
        })
    }

    /// Write a whole torch.save archive into the (empty) temp file, laid out
    /// here with an alignment per record: `entries` = [(full record name,
    /// bytes or (address, nbytes, device), alignment)] in file order, device -1
    /// for host memory. Headers and data go in one engine pass (small records
    /// gathered into shared I/Os, CRC-32s stored as the bytes pass), then the
    /// central directory. `prefix` is the archive's folder (`<prefix>/data/*`
    /// are its data records).
    ///
    /// The caller keeps every storage alive and unmodified until this returns.
    fn write_archive<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        entries: Vec<(String, RawBody<'py>, u64)>,
        prefix: String,
    ) -> PyResult<Bound<'py, PyDict>> {
        let entries: Vec<Entry> = entries
            .into_iter()
            .map(|(name, body, align)| Entry {
                name,
                body: match body {
                    RawBody::Bytes(b) => Body::Bytes(b.as_bytes().to_vec()),
                    RawBody::Memory((addr, len, dev)) => Body::Memory {
                        addr,
                        len,
                        memory: if dev < 0 {
                            Memory::Host
                        } else {
                            Memory::Cuda(dev)
                        },
                    },
                },
                align,
            })
            .collect();
        let engine = engine.inner.clone();
        let backend = self.backend;
        let rep = py.detach(|| -> PyResult<_> {
            let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let Some(st) = g.as_mut() else {
                return Err(writer_done());
            };
            let device_segs: Vec<Segment> = entries
                .iter()
                .filter_map(|e| match e.body {
                    Body::Memory { addr, len, memory } if memory != Memory::Host => Some(Segment {
                        file_offset: 0,
                        addr,
                        len,
                        memory,
                    }),
                    _ => None,
                })
                .collect();
            // SAFETY: `st.device` is dropped before `st.io` (field order).
            let device =
                unsafe { ensure_device_path(&mut st.device, &st.io, backend, &device_segs)? };
            // SAFETY: the Python caller keeps each storage alive and
            // unmodified for the duration of this call (documented contract).
            let w = unsafe { zipwrite::write(&engine, &st.io, device, &entries, &prefix)? };
            Ok(Report::new(w.stats, &st.io, st.device.as_ref()))
        })?;
        rep.into_dict(py)
    }

    /// Write memory ranges at given file offsets: `segments` =
    /// [(file offset, address, nbytes, device)], device -1 for host memory.
    /// `file_len`: the final size of the file, preallocated up front (when the
    /// engine preallocates) so that a full disk fails before any data moves.
    ///
    /// `checksum`: also return each segment's CRC-32 (`"crc32"`, None where
    /// cuFile moved the bytes), computed in the I/O threads. `patches`:
    /// [(segment index, file offset)]: store that segment's CRC-32 (4 bytes,
    /// little-endian) at that offset, outside the segment (a zip data
    /// descriptor or central directory entry), in the same I/O where the
    /// engine can; nothing where cuFile moved the bytes.
    ///
    /// The caller keeps every range alive and unmodified until this returns.
    #[pyo3(signature = (engine, segments, file_len=None, checksum=false, patches=None))]
    fn write_segments<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        segments: Vec<RawSegment>,
        file_len: Option<u64>,
        checksum: bool,
        patches: Option<Vec<(usize, u64)>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let patches: Vec<Patch> = patches
            .unwrap_or_default()
            .into_iter()
            .map(|(seg, at)| Patch { seg, at })
            .collect();
        self.write_planned(py, engine, |_, _| {
            Ok((segments, file_len, None, checksum, patches))
        })
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
