//! `Reader`: an existing torch.save checkpoint, mapped and opened for reading;
//! `map_archive`, the mapping alone; `map_archives`, archives held in memory
//! (DCP items).

use std::path::PathBuf;

use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::format::integrity::{self, Declared, State};
use crate::format::zipmap::{self, Archive};
use crate::gpu::Backend;
use crate::io::file::{DirectMode, IoFile};
use crate::Error;

use super::engine::Engine;
use super::{ensure_device_path, file_modes, report, to_segments, RawSegment};

fn records_list(a: &Archive) -> Vec<(String, u64, u64)> {
    a.records
        .iter()
        .map(|r| (r.name.clone(), r.data_offset, r.size))
        .collect()
}

/// Map a torch.save archive: [(record name, data offset, size)] in central-directory order.
#[pyfunction]
pub(super) fn map_archive(py: Python<'_>, path: PathBuf) -> PyResult<Vec<(String, u64, u64)>> {
    py.detach(|| {
        let f = IoFile::open_read(&path, DirectMode::Off)?;
        let a = zipmap::map_file(f.file(), Some(&path))?;
        Ok(records_list(&a))
    })
}

/// Where a torch.save archive held in memory keeps its pickle and storages.
type ArchiveLayout = (u64, u64, Vec<(String, u64, u64)>);

/// Map torch.save archives held in host memory (DCP items read whole):
/// `spans` = [(offset, length)] of each archive in `[addr, addr+len)`. For
/// each: (offset of `data.pkl`, its size, [(storage key, offset, size)])
/// with offsets in the same memory, or None where the span is no usable
/// archive (the caller lets torch read it and say why).
///
/// The caller keeps `[addr, addr+len)` alive and unmodified until this returns.
#[pyfunction]
pub(super) fn map_archives(
    py: Python<'_>,
    addr: u64,
    len: u64,
    spans: Vec<(u64, u64)>,
) -> PyResult<Vec<Option<ArchiveLayout>>> {
    if addr == 0 || usize::try_from(len).is_err() {
        return Err(PyValueError::new_err("map_archives needs a host buffer"));
    }
    for &(off, n) in &spans {
        if off.checked_add(n).is_none_or(|e| e > len) {
            return Err(PyValueError::new_err(format!(
                "span {off}..+{n} lies outside the {len}-byte buffer"
            )));
        }
    }
    Ok(py.detach(|| {
        // SAFETY: the caller keeps the buffer alive and unmodified for the call
        // (documented contract); every span lies inside it (checked above).
        let mem = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
        spans
            .iter()
            .map(|&(off, n)| {
                let bytes = &mem[off as usize..(off + n) as usize];
                let a = zipmap::map_bytes(bytes).ok()?;
                let prefix = a.prefix().to_owned();
                let pkl = a.get(&format!("{prefix}/data.pkl"))?;
                let data = a
                    .records
                    .iter()
                    .filter_map(|r| {
                        let key = r.name.strip_prefix(&prefix)?.strip_prefix("/data/")?;
                        Some((key.to_owned(), off + r.data_offset, r.size))
                    })
                    .collect();
                Some((off + pkl.data_offset, pkl.size, data))
            })
            .collect()
    }))
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
            // Records by data offset (they do not overlap: zipmap checks).
            let mut spans: Vec<(u64, u64)> = self
                .archive
                .records
                .iter()
                .map(|r| (r.data_offset, r.data_offset + r.size))
                .collect();
            spans.sort_unstable();
            for &(off, _, len, _) in &segments {
                let i = spans.partition_point(|s| s.0 <= off);
                let inside = i > 0 && off.checked_add(len).is_some_and(|e| e <= spans[i - 1].1);
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
            Some(ns) => {
                let index: std::collections::HashMap<&str, usize> = self
                    .archive
                    .records
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (r.name.as_str(), i))
                    .collect();
                Some(
                    ns.iter()
                        .map(|n| {
                            index.get(n.as_str()).copied().ok_or_else(|| {
                                PyKeyError::new_err(format!("no record {n:?} in the archive"))
                            })
                        })
                        .collect::<PyResult<Vec<usize>>>()?,
                )
            }
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
