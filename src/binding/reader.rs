//! `Reader`: an existing torch.save checkpoint, mapped and opened for reading;
//! `map_archive`, the mapping alone; `map_archives`, archives held in memory
//! (DCP items); `check_archive`, the CRC-32s of one held in memory.

use std::path::{Path, PathBuf};

use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::engine::{Memory, TransferFile};
use crate::format::integrity::{self, Declared, State};
use crate::format::zipmap::{self, Archive};
use crate::io::file::{DirectMode, IoFile};
use crate::Error;

use super::engine::Engine;
use super::{detached, file_modes, report_dict, Ask, Owners, RawSegment, Streams};

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
/// `spans` = [(offset, length)] of each archive in `[addr, addr+len)`, host
/// memory of `owners`. For each: (offset of `data.pkl`, its size, [(storage
/// key, offset, size)]) with offsets in the same memory, or None where the
/// span is no usable archive (the caller lets torch read it and say why).
///
/// The caller leaves `[addr, addr+len)` unmodified until this returns.
#[pyfunction]
pub(super) fn map_archives(
    py: Python<'_>,
    addr: u64,
    len: u64,
    spans: Vec<(u64, u64)>,
    owners: Owners,
) -> PyResult<Vec<Option<ArchiveLayout>>> {
    if addr == 0 || usize::try_from(len).is_err() {
        return Err(PyValueError::new_err("map_archives needs a host buffer"));
    }
    owners.check(Memory::Host, addr, len, || "the buffer".to_string())?;
    for &(off, n) in &spans {
        if off.checked_add(n).is_none_or(|e| e > len) {
            return Err(PyValueError::new_err(format!(
                "span {off}..+{n} lies outside the {len}-byte buffer"
            )));
        }
    }
    let out = py.detach(|| {
        // SAFETY: the buffer lies inside the host memory of `owners` (checked
        // above), held until this returns; the caller leaves it unmodified
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
    });
    owners.release();
    Ok(out)
}

/// Check the records of the zip archive `blob` (a torch.save archive held in
/// memory: a DCP non-tensor value fetched from a store) against the CRC-32s
/// it declares, detached and with no copy of the bytes (immutable, held by
/// the caller's reference): a FormatError naming `where` and the record on a
/// mismatch, or naming `where` when the bytes are no zip of stored records.
#[pyfunction]
pub(super) fn check_archive(py: Python<'_>, blob: &[u8], r#where: &str) -> PyResult<()> {
    py.detach(|| integrity::check_bytes(blob, Path::new(r#where)))?;
    Ok(())
}

/// What `verify_zstd_item` found: "checked" and the rows, "large" (decodes to
/// more than the limit: not judged), or "other" and the first decoded bytes
/// (no zip: the caller judges).
type ZstdVerdict = (&'static str, Option<VerifyRows>, Option<Vec<u8>>);

/// Verify a DCP item stored as zstd frames (torch's ZStandard transform) at
/// bytes `[offset, offset + length)` of `path`: streamed from the file and
/// decoded in memory (no more than `limit` bytes), each record of the
/// torch.save zip inside judged against its CRC-32, as `Reader.verify` rows. A
/// FormatError naming the file and the item where the item lies past the
/// file's end, its frames are damaged, or the zip inside is.
#[pyfunction]
pub(super) fn verify_zstd_item(
    py: Python<'_>,
    path: PathBuf,
    offset: u64,
    length: u64,
    limit: u64,
) -> PyResult<ZstdVerdict> {
    use crate::format::zstd::{decode_bounded, Decoded};
    let verdict = py.detach(|| -> crate::Result<ZstdVerdict> {
        use std::io::{Read, Seek, SeekFrom};
        let f = IoFile::open_read(&path, DirectMode::Off)?;
        let io_err = |op, e| Error::io(op, Some(path.clone()), e);
        let size = f.file().metadata().map_err(|e| io_err("fstat", e))?.len();
        let item = PathBuf::from(format!("{}@{offset}", path.display()));
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(Error::format(
                Some(&item),
                format!("the item's {length} bytes lie past the end of the file ({size} bytes)"),
            ));
        }
        // Streamed from the file: only the decoded bytes are held.
        let mut file = f.file();
        file.seek(SeekFrom::Start(offset))
            .map_err(|e| io_err("seek", e))?;
        let frames = std::io::BufReader::new(file.take(length));
        let zip = match decode_bounded(frames, limit, b"PK\x03\x04", &item)? {
            Decoded::Whole(zip) => zip,
            Decoded::TooLarge => return Ok(("large", None, None)),
            Decoded::Other(head) => return Ok(("other", None, Some(head))),
        };
        let rows = integrity::judge_bytes(&zip, &item)?
            .into_iter()
            .map(|(name, state, crc)| row(name, state, crc))
            .collect();
        Ok(("checked", Some(rows), None))
    })?;
    Ok(verdict)
}

/// An existing checkpoint opened for reading.
#[pyclass(frozen, module = "ckptio._native")]
pub struct Reader {
    file: TransferFile,
    archive: Archive,
}

#[pymethods]
impl Reader {
    /// `offset`, `length`: the archive is bytes `[offset, offset + length)` of
    /// the file (a DCP item), not the whole file.
    #[new]
    #[pyo3(signature = (path, direct=None, backend=None, offset=0, length=None))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        direct: Option<&str>,
        backend: Option<&str>,
        offset: u64,
        length: Option<u64>,
    ) -> PyResult<Self> {
        let (mode, backend) = file_modes(direct, backend)?;
        py.detach(|| {
            let io = IoFile::open_read(&path, mode)?;
            let archive = match length {
                Some(len) => zipmap::map_file_range(io.file(), Some(&path), offset, len)?,
                None if offset == 0 => zipmap::map_file(io.file(), Some(&path))?,
                None => return Err(Error::invalid("an offset needs a length")),
            };
            Ok::<_, Error>(Reader {
                file: TransferFile::new(io, backend),
                archive,
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
        self.file.io().is_direct()
    }

    /// The descriptor of the open file (so other readers can open the very same file).
    fn fileno(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.file.io().file().as_raw_fd()
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
            self.file.io().read_at(&mut buf, off).map(|()| buf)
        })?;
        Ok(PyBytes::new(py, &buf))
    }

    /// Read file ranges into memory. `segments`: [(file offset, address, nbytes, device)],
    /// after the work queued on `streams` ([(device, CUstream)]); each range must
    /// lie inside one data record of the archive. `owners` (the objects owning
    /// the destinations) are held until this returns; nobody else may touch the
    /// destinations meanwhile.
    ///
    /// With `verify`, the CRC-32 of the bytes read for each whole record is
    /// compared with the stored one (FormatError naming the record on a
    /// mismatch); the result's "verified" and "unchecked" list the records.
    #[pyo3(signature = (engine, segments, owners, streams, verify=false))]
    fn read_segments<'py>(
        &self,
        py: Python<'py>,
        engine: &Engine,
        segments: Vec<RawSegment>,
        owners: Owners,
        streams: Streams,
        verify: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ask = Ask {
            streams,
            ..Ask::default()
        };
        // SAFETY: every destination lies inside its owners' memory (checked
        // by `detached`), which they keep allocated until this returns; the
        // caller leaves it untouched (documented contract) and hands its own
        // streams; the engine refuses destinations that overlap.
        let (rep, verdict) = detached(py, engine, segments, owners, ask, |e, s, r| unsafe {
            integrity::read_records(e, &self.file, &self.archive, s, verify, r.streams)
        })?;
        let d = report_dict(py, &rep)?;
        if verify {
            d.set_item("verified", verdict.verified)?;
            d.set_item("unchecked", verdict.unchecked)?;
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
        let checks = py.detach(|| {
            integrity::check(&engine, self.file.io(), &self.archive, which.as_deref())
        })?;
        let mut out = Vec::with_capacity(checks.len());
        for (i, state) in checks {
            let r = &self.archive.records[i];
            if let (true, State::Mismatch { stored, actual }) = (strict, state) {
                let path = self.file.io().path();
                return Err(integrity::mismatch_error(path, &r.name, stored, actual).into());
            }
            out.push(row(r.name.clone(), state, r.crc32));
        }
        Ok(out)
    }
}

type VerifyRows = Vec<(String, &'static str, Option<u32>, Option<u32>)>;

/// A verify row: (record, state, the CRC-32 stored, the one computed; None
/// where unchecked). `crc`: the CRC-32 the record declares.
fn row(name: String, state: State, crc: u32) -> (String, &'static str, Option<u32>, Option<u32>) {
    let (stored, actual) = match state {
        State::Mismatch { stored, actual } => (Some(stored), Some(actual)),
        State::Ok => (Some(crc), Some(crc)),
        State::Unchecked => (None, None),
    };
    (name, state.name(), stored, actual)
}
