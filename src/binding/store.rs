//! Object storage for Python: whole files to and from objects, small objects
//! (an index, a commit record) put conditionally and read back, listings and
//! deletes. Every call names its object by URL (`s3://bucket/key`, `gs://`,
//! `az://`), takes `options` over the standard variables, and runs detached.
//!
//! Clients are kept per bucket, options and the store variables of the moment,
//! and per process (a forked child makes its own): a checkpoint's many calls
//! share one connection pool.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::engine::{Memory, Segment};
use crate::format::parts::{PartedArchive, PartedImage};
use crate::format::zipwrite::Body;
use crate::format::{integrity, zipmap, zstd};
use crate::gpu::order::After;
use crate::store::{self, ObjectInfo, ObjectSource, Precondition, Store, Transferred, Version};

use super::owners::Owners;
use super::writer::{check_zstd_items, entries_of, zstd_items, RawBody, ZstdItem};
use super::{to_segments, RawSegment, Streams};
use crate::sync::lock;

type Options = Vec<(String, String)>;

/// The variables the clients read from the environment (the cache key holds
/// them: a test or a user that changes the endpoint gets a new client).
const ENV_PREFIXES: [&str; 3] = ["AWS_", "GOOGLE_", "AZURE_"];

type ClientKey = (u32, String, Options, Vec<(String, String)>);

static CLIENTS: Mutex<Option<HashMap<ClientKey, Store>>> = Mutex::new(None);

fn options(opts: Option<&Bound<'_, PyDict>>) -> PyResult<Options> {
    let mut out = Vec::new();
    if let Some(d) = opts {
        for (k, v) in d.iter() {
            if v.is_none() {
                continue; // None: unset (the environment's value or the default)
            }
            let v = match v.extract::<bool>() {
                Ok(b) => b.to_string(),
                Err(_) => v.str()?.to_string(),
            };
            out.push((k.extract::<String>()?, v));
        }
    }
    out.sort();
    Ok(out)
}

/// The store of `url` (one client per bucket, options and environment) and
/// the key it names. The client is kept under its bucket's base URL
/// (`Store::base`), the same whatever the form of the URL that made it (a
/// trailing `/`, path-style https).
fn store_of(url: &str, opts: &Options) -> crate::Result<(Store, String)> {
    let (_, key) = Store::parse_key(url)?;
    let env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| ENV_PREFIXES.iter().any(|p| k.starts_with(p)))
        .collect();
    let ck = (
        std::process::id(),
        Store::base(url, &key),
        opts.clone(),
        env,
    );
    let pairs: Vec<(&str, &str)> = opts.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    if let Some(s) = lock(&CLIENTS).get_or_insert_with(HashMap::new).get(&ck) {
        return Ok((s.clone(), key));
    }
    let (store, key) = Store::parse(url, &pairs)?;
    let mut clients = lock(&CLIENTS);
    let map = clients.get_or_insert_with(HashMap::new);
    // Another process's clients are never used again here.
    map.retain(|k, _| k.0 == ck.0);
    map.insert(ck, store.clone());
    Ok((store, key))
}

/// `op` on the store of `url` and its key, detached.
fn on_store<T: Send>(
    py: Python<'_>,
    url: &str,
    options: Option<&Bound<'_, PyDict>>,
    op: impl FnOnce(&Store, &str) -> crate::Result<T> + Send,
) -> PyResult<T> {
    let opts = self::options(options)?;
    let out = py.detach(|| {
        let (s, key) = store_of(url, &opts)?;
        op(&s, &key)
    })?;
    Ok(out)
}

fn version_dict<'py>(py: Python<'py>, v: &Version) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("e_tag", v.e_tag.as_deref())?;
    d.set_item("version", v.version.as_deref())?;
    Ok(d)
}

fn transferred_dict<'py>(py: Python<'py>, t: &Transferred) -> PyResult<Bound<'py, PyDict>> {
    let d = version_dict(py, &t.version)?;
    d.set_item("size", t.size)?;
    d.set_item("parts", t.parts)?;
    d.set_item("host_buffers", t.host_buffers)?;
    Ok(d)
}

type FileTransfer = fn(&Store, &str, &std::path::Path, u64, usize) -> crate::Result<Transferred>;

/// One whole-file transfer between `path` and `url`, detached.
fn file_transfer<'py>(
    py: Python<'py>,
    url: &str,
    path: PathBuf,
    options: Option<&Bound<'py, PyDict>>,
    threads: usize,
    chunk: u64,
    run: FileTransfer,
) -> PyResult<Bound<'py, PyDict>> {
    let t = on_store(py, url, options, |s, key| {
        run(s, key, &path, chunk, threads)
    })?;
    transferred_dict(py, &t)
}

/// Upload the file at `path` to `url` (one multipart upload; its completion is
/// the commit).
#[pyfunction]
#[pyo3(signature = (url, path, options=None, threads=8, chunk=16777216))]
pub fn store_upload<'py>(
    py: Python<'py>,
    url: &str,
    path: PathBuf,
    options: Option<&Bound<'py, PyDict>>,
    threads: usize,
    chunk: u64,
) -> PyResult<Bound<'py, PyDict>> {
    file_transfer(py, url, path, options, threads, chunk, store::upload_file)
}

/// Download `url` into a new file at `path` (a scratch copy: not fsynced).
#[pyfunction]
#[pyo3(signature = (url, path, options=None, threads=8, chunk=16777216))]
pub fn store_download<'py>(
    py: Python<'py>,
    url: &str,
    path: PathBuf,
    options: Option<&Bound<'py, PyDict>>,
    threads: usize,
    chunk: u64,
) -> PyResult<Bound<'py, PyDict>> {
    file_transfer(py, url, path, options, threads, chunk, store::download_file)
}

/// Put `data` at `url` in one PUT: `create` only if no object is there,
/// `if_match` only if the object is still that ETag (else a
/// CommitConflictError).
#[pyfunction]
#[pyo3(signature = (url, data, options=None, *, create=false, if_match=None))]
pub fn store_put<'py>(
    py: Python<'py>,
    url: &str,
    data: &Bound<'py, PyBytes>,
    options: Option<&Bound<'py, PyDict>>,
    create: bool,
    if_match: Option<String>,
) -> PyResult<Bound<'py, PyDict>> {
    let pre = match (create, if_match) {
        (true, Some(_)) => {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "store_put: create and if_match exclude each other",
            ))
        }
        (true, None) => Precondition::Absent,
        (false, Some(e)) => Precondition::Matches(Version {
            e_tag: Some(e),
            version: None,
        }),
        (false, None) => Precondition::None,
    };
    let bytes = bytes::Bytes::copy_from_slice(data.as_bytes());
    let v = on_store(py, url, options, |s, key| s.put(key, bytes, pre))?;
    version_dict(py, &v)
}

/// The whole of a small object and its version.
#[pyfunction]
#[pyo3(signature = (url, options=None))]
pub fn store_get<'py>(
    py: Python<'py>,
    url: &str,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyDict>)> {
    let (data, v) = on_store(py, url, options, |s, key| s.get(key))?;
    Ok((PyBytes::new(py, &data), version_dict(py, &v)?))
}

/// Size and version of the object at `url`.
#[pyfunction]
#[pyo3(signature = (url, options=None))]
pub fn store_head<'py>(
    py: Python<'py>,
    url: &str,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let info = on_store(py, url, options, |s, key| s.head(key))?;
    info_dict(py, &info)
}

/// Every object under the folder `url` (all depths): (URL, size, ETag, the
/// store's time of its last change in seconds since the epoch).
#[pyfunction]
#[pyo3(signature = (url, options=None))]
pub fn store_list(
    py: Python<'_>,
    url: &str,
    options: Option<&Bound<'_, PyDict>>,
) -> PyResult<Vec<crate::store::Listed>> {
    on_store(py, url, options, |s, key| {
        let items = s.list(key)?;
        Ok(items
            .into_iter()
            .map(|(k, size, tag, modified)| (s.url(&k), size, tag, modified))
            .collect())
    })
}

/// Remove the object at `url` (one that is not there is not an error).
#[pyfunction]
#[pyo3(signature = (url, options=None))]
pub fn store_delete(
    py: Python<'_>,
    url: &str,
    options: Option<&Bound<'_, PyDict>>,
) -> PyResult<()> {
    on_store(py, url, options, |s, key| s.delete(key))
}

fn open_source(s: &Store, key: &str, e_tag: Option<&str>) -> crate::Result<ObjectSource> {
    match e_tag {
        Some(t) => ObjectSource::open_version(s, key, t),
        None => ObjectSource::open(s, key),
    }
}

fn info_dict<'py>(py: Python<'py>, info: &ObjectInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = version_dict(py, &info.version)?;
    d.set_item("size", info.size)?;
    Ok(d)
}

/// `length` bytes of `url` from `offset` (fewer at its end), of the version
/// `e_tag` names where given (else a CommitConflictError); with the object's
/// size and version.
#[pyfunction]
#[pyo3(signature = (url, offset, length, options=None, e_tag=None))]
pub fn store_read<'py>(
    py: Python<'py>,
    url: &str,
    offset: u64,
    length: u64,
    options: Option<&Bound<'py, PyDict>>,
    e_tag: Option<String>,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyDict>)> {
    let (data, info) = on_store(py, url, options, |s, key| {
        let source = open_source(s, key, e_tag.as_deref())?;
        let n = length.min(source.len().saturating_sub(offset));
        let mut buf = vec![0u8; n as usize];
        source.read_at(offset.min(source.len()), &mut buf)?;
        Ok((buf, source.info().clone()))
    })?;
    Ok((PyBytes::new(py, &data), info_dict(py, &info)?))
}

/// Upload a torch.save archive straight from memory to `url`: `entries` =
/// [(record name, bytes or (address, nbytes, device), alignment)] in file
/// order, the storages' memory (host, or CUDA device `device`) owned by
/// `owners` (checked, held until this returns; left unmodified meanwhile),
/// `streams` = [(device, raw CUstream)] the caller's streams, whose queued
/// work the copies wait for. The archive is laid out as a file save lays it
/// out and made part by part of the grid for `chunk`, `threads` parts at a
/// time, CRC-32s as the bytes pass: one multipart upload, no local copy; its
/// completion is the commit.
#[pyfunction]
#[pyo3(signature = (url, entries, owners, options=None, threads=8, chunk=16777216, streams=Vec::new()))]
#[allow(clippy::too_many_arguments)] // the Python signature
pub fn store_upload_archive<'py>(
    py: Python<'py>,
    url: &str,
    entries: Vec<(String, RawBody<'py>, u64)>,
    owners: Owners,
    options: Option<&Bound<'py, PyDict>>,
    threads: usize,
    chunk: u64,
    streams: Streams,
) -> PyResult<Bound<'py, PyDict>> {
    let entries = entries_of(entries, &owners)?;
    let devices = entries.iter().filter_map(|e| match e.body {
        Body::Memory {
            memory: Memory::Cuda(d),
            len,
            ..
        } if len > 0 => Some(d),
        _ => None,
    });
    let after = caller_order(devices, &streams)?;
    let on_device = !after.is_empty();
    let t = on_store(py, url, options, |s, key| {
        after.wait_on_host()?;
        // SAFETY: every memory record lies inside its owners' memory (checked
        // by entries_of), held until this returns and left unmodified by the
        // caller (documented contract); the caller's streams are done with it.
        let a =
            unsafe { PartedArchive::new(&entries, |n| Ok(store::part_grid(n, chunk)?.part_size))? };
        let grid = store::part_grid(a.len(), chunk)?;
        store::upload_parts(s, key, grid, threads, on_device, |idx, buf| {
            a.fill(idx, buf)
        })
    })?;
    transferred_dict(py, &t)
}

/// Upload an object made of `head` (at offset 0) and `segments` = [(object
/// offset, address, nbytes, device)] of host or CUDA memory that `owners` own
/// (checked, held until this returns, left unmodified meanwhile), `total`
/// bytes in all, after the work queued on `streams` (as for
/// `store_upload_archive`): made part by part of the grid for `chunk`,
/// `threads` parts at a time, as one multipart upload (a safetensors file
/// straight from its tensors; a DCP data file, `patches` = [(segment index,
/// object offset)] saying where each segment's CRC-32 goes, after it).
#[pyfunction]
#[pyo3(signature = (url, head, segments, owners, total, options=None, threads=8, chunk=16777216, streams=Vec::new(), patches=Vec::new()))]
#[allow(clippy::too_many_arguments)] // the Python signature
pub fn store_upload_image<'py>(
    py: Python<'py>,
    url: &str,
    head: Vec<u8>,
    segments: Vec<RawSegment>,
    owners: Owners,
    total: u64,
    options: Option<&Bound<'py, PyDict>>,
    threads: usize,
    chunk: u64,
    streams: Streams,
    patches: Vec<(usize, u64)>,
) -> PyResult<Bound<'py, PyDict>> {
    let segs = to_segments(segments);
    for (i, s) in segs.iter().enumerate() {
        owners.check(s.memory, s.addr, s.len, || format!("segment {i}"))?;
    }
    let devices = segs.iter().filter_map(|s| match s.memory {
        Memory::Cuda(d) if s.len > 0 => Some(d),
        _ => None,
    });
    let after = caller_order(devices, &streams)?;
    let on_device = !after.is_empty();
    let t = on_store(py, url, options, |s, key| {
        after.wait_on_host()?;
        // SAFETY: every segment lies inside its owners' memory (checked above),
        // held until this returns and left unmodified by the caller
        // (documented contract); the caller's streams are done with it.
        let image = unsafe {
            PartedImage::new(head, segs, total, &patches, |n| {
                Ok(store::part_grid(n, chunk)?.part_size)
            })?
        };
        let grid = store::part_grid(image.len(), chunk)?;
        store::upload_parts(s, key, grid, threads, on_device, |idx, buf| {
            image.fill(idx, buf)
        })
    })?;
    transferred_dict(py, &t)
}

/// Compress each item (as `AtomicWriter.write_zstd` takes them: data in host
/// memory that `owners` own, held until this returns, left unmodified
/// meanwhile) into one zstd frame, on `workers` threads, and upload the frames
/// back to back to `url` as they are made: parts of `chunk` bytes (growing for
/// very large objects), `threads` uploads at a time, one multipart upload whose
/// completion is the commit. The transfer's dict, with "spans": each item's
/// (offset, length) in the object.
#[pyfunction]
#[pyo3(signature = (url, items, owners, options=None, threads=8, chunk=16777216, workers=4, level=3))]
#[allow(clippy::too_many_arguments)] // the Python signature
pub fn store_upload_zstd<'py>(
    py: Python<'py>,
    url: &str,
    items: Vec<ZstdItem>,
    owners: Owners,
    options: Option<&Bound<'py, PyDict>>,
    threads: usize,
    chunk: u64,
    workers: usize,
    level: i32,
) -> PyResult<Bound<'py, PyDict>> {
    check_zstd_items(&items, &owners)?;
    let (t, spans) = on_store(py, url, options, |s, key| {
        // SAFETY: checked above against `owners`, held until this returns.
        let parts = unsafe { zstd_items(&items) };
        let mut spans = Vec::new();
        let t = store::upload_stream(s, key, chunk, threads, |put| {
            spans = zstd::compress_items(&parts, level, workers, put)?;
            Ok(())
        })?;
        Ok((t, spans))
    })?;
    owners.release();
    let d = transferred_dict(py, &t)?;
    d.set_item("spans", spans)?;
    Ok(d)
}

/// An object written as a byte stream of a size not known ahead (what
/// torch.save writes into a file object): `write` cuts the bytes into parts
/// uploaded by `threads` threads while the next fills (in flight: threads + 1
/// parts of `chunk`, growing for very large objects), `commit` completes the
/// multipart upload (the object appears whole), `abort` (or a drop without
/// `commit`) removes it, the key keeping what it had.
///
/// Its lock is only ever taken detached: a writer blocked on a busy upload
/// never holds the interpreter.
#[pyclass(frozen, module = "ckptio._native")]
pub struct ObjectWriter {
    up: Mutex<Option<store::StreamUpload>>,
    url: String,
}

fn closed_writer(url: &str) -> crate::Error {
    crate::Error::invalid(format!(
        "{url}: the object writer is already committed or aborted"
    ))
}

#[pymethods]
impl ObjectWriter {
    #[new]
    #[pyo3(signature = (url, options=None, threads=8, chunk=16777216))]
    fn new(
        py: Python<'_>,
        url: &str,
        options: Option<&Bound<'_, PyDict>>,
        threads: usize,
        chunk: u64,
    ) -> PyResult<Self> {
        let up = on_store(py, url, options, |s, key| {
            store::StreamUpload::start(s, key, chunk, threads)
        })?;
        Ok(ObjectWriter {
            up: Mutex::new(Some(up)),
            url: url.to_string(),
        })
    }

    /// Append `data`; returns its length. Blocks (detached) while a part is
    /// full and every uploader busy; a failed part's error here, or at a later
    /// call (the upload is then aborted).
    fn write(&self, py: Python<'_>, data: &[u8]) -> PyResult<usize> {
        self.append(py, data)?;
        Ok(data.len())
    }

    /// Append `nbytes` of host memory at `address`, which `owners` own (checked,
    /// held until this returns, left unmodified meanwhile): a large record
    /// written with no copy into a bytes object first.
    fn write_memory(
        &self,
        py: Python<'_>,
        address: u64,
        nbytes: u64,
        owners: Owners,
    ) -> PyResult<u64> {
        owners.check(Memory::Host, address, nbytes, || "the bytes written".into())?;
        let len = usize::try_from(nbytes).map_err(|_| crate::Error::invalid("too many bytes"))?;
        let bytes: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: `[address, address + nbytes)` lies in host memory that
            // `owners` own (checked above) and hold until this returns; the
            // caller leaves it unmodified meanwhile (documented contract).
            unsafe { std::slice::from_raw_parts(address as *const u8, len) }
        };
        self.append(py, bytes)?;
        owners.release();
        Ok(nbytes)
    }

    /// Bytes written so far.
    fn tell(&self, py: Python<'_>) -> PyResult<u64> {
        let n = py.detach(|| lock(&self.up).as_ref().map(|u| u.written()));
        Ok(n.ok_or_else(|| closed_writer(&self.url))?)
    }

    /// The last part, then the completion: the object appears whole. The
    /// transfer's dict (size, parts, e_tag, version).
    fn commit<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = py.detach(|| {
            let up = lock(&self.up)
                .take()
                .ok_or_else(|| closed_writer(&self.url))?;
            up.finish()
        })?;
        transferred_dict(py, &t)
    }

    /// Abort the upload: the key keeps what it had. Idempotent.
    fn abort(&self, py: Python<'_>) {
        py.detach(|| {
            if let Some(up) = lock(&self.up).take() {
                up.abort();
            }
        });
    }

    /// Whether `commit` or `abort` ran (or a write failed).
    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        py.detach(|| lock(&self.up).is_none())
    }
}

impl ObjectWriter {
    fn append(&self, py: Python<'_>, bytes: &[u8]) -> PyResult<()> {
        py.detach(|| {
            let mut g = lock(&self.up);
            let up = g.as_mut().ok_or_else(|| closed_writer(&self.url))?;
            let r = up.write(bytes);
            if r.is_err() {
                if let Some(up) = g.take() {
                    up.abort();
                }
            }
            r
        })?;
        Ok(())
    }
}

/// The CRC-32 of each of `ranges` = [(object offset, length)] of `url` (of
/// the version `e_tag` names where given), read by ranged GETs of at most
/// `chunk` bytes through a buffer of `threads` of them: a whole object
/// checked in bounded memory, nothing kept.
#[pyfunction]
#[pyo3(signature = (url, ranges, options=None, threads=8, chunk=16777216, e_tag=None))]
pub fn store_crc32<'py>(
    py: Python<'py>,
    url: &str,
    ranges: Vec<(u64, u64)>,
    options: Option<&Bound<'py, PyDict>>,
    threads: usize,
    chunk: u64,
    e_tag: Option<String>,
) -> PyResult<Vec<u32>> {
    on_store(py, url, options, |s, key| {
        let source = open_source(s, key, e_tag.as_deref())?;
        store::hash_ranges(&source, &ranges, chunk, threads)
    })
}

/// Orders memories so that one device's ranges sort together.
fn memory_rank(m: Memory) -> i64 {
    match m {
        Memory::Host => -1,
        Memory::Cuda(d) => d as i64,
    }
}

/// Events on the caller's `streams` for each device in `devices`: the
/// upload's copies start once the work queued there before the call is done.
fn caller_order(devices: impl Iterator<Item = i32>, streams: &Streams) -> PyResult<After> {
    let mut devices: Vec<i32> = devices.collect();
    devices.sort_unstable();
    devices.dedup();
    if devices.is_empty() {
        return Ok(After::none());
    }
    // SAFETY: the caller hands its live current streams (devices.streams()).
    Ok(unsafe { After::record(&devices, streams)? })
}

/// An object as the zip mapper's batched reader: each batch one
/// [`ObjectSource::read_ranges`] (concurrent GETs of one version).
struct ObjectRanges<'a> {
    source: &'a ObjectSource,
    threads: usize,
    chunk: u64,
}

impl zipmap::RangeReader for ObjectRanges<'_> {
    fn size(&self) -> u64 {
        self.source.len()
    }

    fn read_ranges(&self, ranges: &mut [(u64, &mut [u8])]) -> crate::Result<()> {
        self.source.read_ranges(ranges, self.chunk, self.threads)
    }
}

/// What [`store_torch_map`] returns: the object's size and version, the
/// archive's prefix, [(record, data offset, size, declared CRC-32 or None)],
/// the small records' bytes,
/// and [(record, local header offset, predicted data offset)].
type TorchMap<'py> = (
    Bound<'py, PyDict>,
    String,
    Vec<(String, u64, u64, Option<u32>)>,
    Bound<'py, PyDict>,
    Vec<(String, u64, u64)>,
);

/// Map the torch.save archive at `url` in few requests
/// ([`zipmap::map_remote`]): its end and directory from the last `tail`
/// bytes, the small records (pickle, version...) read whole in one batch, each
/// storage's data offset predicted, to be confirmed by [`zip_headers_match`]
/// over the bytes from its local header to its data, read with the data.
#[pyfunction]
#[pyo3(signature = (url, options=None, threads=8, chunk=16777216, tail=1048576))]
pub fn store_torch_map<'py>(
    py: Python<'py>,
    url: &str,
    options: Option<&Bound<'py, PyDict>>,
    threads: usize,
    chunk: u64,
    tail: u64,
) -> PyResult<TorchMap<'py>> {
    let (m, info) = on_store(py, url, options, |s, key| {
        let source = ObjectSource::open(s, key)?;
        let ranges = ObjectRanges {
            source: &source,
            threads: threads.max(1),
            chunk: chunk.max(1),
        };
        let shown = std::path::PathBuf::from(source.url());
        Ok((
            zipmap::map_remote(&ranges, Some(&shown), tail)?,
            source.info().clone(),
        ))
    })?;
    let small = PyDict::new(py);
    for (name, data) in &m.small {
        small.set_item(name, PyBytes::new(py, data))?;
    }
    let a = &m.archive;
    // Each record's CRC-32 where the archive declares one (for verify=True).
    let records = a
        .records
        .iter()
        .zip(integrity::declared(a))
        .map(|(r, d)| {
            let crc = match d {
                integrity::Declared::Crc(c) => Some(c),
                integrity::Declared::Unchecked => None,
            };
            (r.name.clone(), r.data_offset, r.size, crc)
        })
        .collect();
    let heads = m
        .predicted
        .iter()
        .map(|&i| {
            let r = &a.records[i];
            (r.name.clone(), r.header_offset, r.data_offset)
        })
        .collect();
    Ok((
        info_dict(py, &info)?,
        a.prefix().to_owned(),
        records,
        small,
        heads,
    ))
}

/// The records of `heads` ([(record, local header offset, data offset)], as
/// [`store_torch_map`] gives them) whose local header, in `bytes` (each
/// record's bytes from its header to its data, back to back in that order),
/// does not put the data where predicted: empty when every guess held.
#[pyfunction]
pub fn zip_headers_match(heads: Vec<(String, u64, u64)>, bytes: &[u8]) -> Vec<String> {
    let mut at = 0usize;
    let mut wrong = Vec::new();
    for (name, header_offset, data_offset) in heads {
        let n = data_offset.saturating_sub(header_offset) as usize;
        let head = bytes.get(at..at.saturating_add(n)).unwrap_or(&[]);
        at = at.saturating_add(n);
        let r = zipmap::Record {
            name,
            header_offset,
            data_offset,
            size: 0,
            crc32: 0,
            cd_entry_offset: 0,
        };
        if !zipmap::local_header_matches(&r, head) {
            wrong.push(r.name);
        }
    }
    wrong
}

/// Read (object offset, address, nbytes, device) segments of `url` straight
/// into memory that `owners` own (checked first, held until the call
/// returns): host memory (device -1) from ranged GETs of at most `chunk`
/// bytes, `threads` at a time, neighbouring segments sharing a GET; CUDA
/// memory through a host buffer of threads x chunk, after the work queued on
/// the caller's `streams`; all of the version `e_tag` names where given.
/// `crc`: the answer's "crc32" holds each segment's CRC-32.
#[pyfunction]
#[pyo3(signature = (url, segments, owners, options=None, threads=8, chunk=16777216, e_tag=None, streams=Vec::new(), crc=false))]
#[allow(clippy::too_many_arguments)]
pub fn store_read_into<'py>(
    py: Python<'py>,
    url: &str,
    segments: Vec<(u64, u64, u64, i32)>,
    owners: Owners,
    options: Option<&Bound<'py, PyDict>>,
    threads: usize,
    chunk: u64,
    e_tag: Option<String>,
    streams: Streams,
    crc: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let mut segs: Vec<(u64, Segment)> = Vec::with_capacity(segments.len());
    for (i, &(offset, addr, len, dev)) in segments.iter().enumerate() {
        let memory = super::memory(dev);
        owners.check(memory, addr, len, || format!("segment {i}"))?;
        segs.push((
            offset,
            Segment {
                file_offset: offset,
                addr,
                len,
                memory,
            },
        ));
    }
    // Two destinations that overlap would be two writers of one byte.
    let mut spans: Vec<(Memory, u64, u64)> = segs
        .iter()
        .map(|(_, s)| (s.memory, s.addr, s.len))
        .collect();
    spans.sort_unstable_by_key(|s| (memory_rank(s.0), s.1));
    if let Some(w) = spans
        .windows(2)
        .find(|w| w[0].0 == w[1].0 && w[0].1 + w[0].2 > w[1].1 && w[1].2 > 0)
    {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "destinations overlap at address {:#x}",
            w[1].1
        )));
    }
    let devices = segs.iter().filter_map(|(_, s)| match s.memory {
        Memory::Cuda(d) if s.len > 0 => Some(d),
        _ => None,
    });
    let after = caller_order(devices, &streams)?;
    let on_device = segs
        .iter()
        .any(|(_, s)| s.memory != Memory::Host && s.len > 0);
    let info = on_store(py, url, options, |s, key| {
        let source = open_source(s, key, e_tag.as_deref())?;
        after.wait_on_host()?;
        // SAFETY: every range lies inside memory one of `owners` owns
        // (checked above), held until the call returns; no two overlap
        // (checked above); the caller's streams are done with device memory.
        let read = || unsafe { store::read_segments(&source, &segs, chunk, threads, crc) };
        // Device copies run on this (Python's) thread: its current context,
        // torch's current device, is put back after them.
        let got = if on_device {
            crate::gpu::cuda::driver()?.keeping_current(read)?
        } else {
            read()?
        };
        Ok((source.info().clone(), got))
    });
    owners.release();
    let (info, got) = info?;
    let d = info_dict(py, &info)?;
    d.set_item("host_buffers", got.host_buffers)?;
    if crc {
        d.set_item("crc32", got.crcs)?;
    }
    Ok(d)
}
