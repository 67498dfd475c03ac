//! Whole files to and from objects: a local commit drained to the store, a
//! remote checkpoint brought back to a local file.
//!
//! Both run `threads` plain threads, each taking the next part of the grid:
//! an upload reads its part from the file (`pread`) into a buffer of its own
//! and puts it; a download GETs its range into its buffer and writes it at its
//! offset. In-flight memory is threads x part, never the file.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use bytes::Bytes;

use super::{part_grid, MultipartSink, ObjectInfo, ObjectSource, PartGrid, Store, Version};
use crate::sync::lock;
use crate::{Error, Result};

/// What a transfer moved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transferred {
    pub size: u64,
    pub parts: usize,
    pub version: Version,
}

/// Run `work(idx)` for every part index below `count` on `threads` threads;
/// the first error stops the others from taking new parts and is returned.
fn each_part(
    count: usize,
    threads: usize,
    work: impl Fn(usize) -> Result<()> + Sync,
) -> Result<()> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, count.max(1)) {
            s.spawn(|| loop {
                if failed.load(Ordering::Acquire) {
                    return;
                }
                let idx = next.fetch_add(1, Ordering::AcqRel);
                if idx >= count {
                    return;
                }
                if let Err(e) = work(idx) {
                    failed.store(true, Ordering::Release);
                    lock(&first).get_or_insert(e);
                    return;
                }
            });
        }
    });
    match first.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Upload the file at `path` to `key` as one multipart upload of parts of
/// whole `chunk`s ([`part_grid`]); its completion is the commit, and a failed
/// upload is aborted (the key keeps what it had).
pub fn upload_file(
    store: &Store,
    key: &str,
    path: &Path,
    chunk: u64,
    threads: usize,
) -> Result<Transferred> {
    let file = File::open(path).map_err(|e| Error::io("open", Some(path.to_path_buf()), e))?;
    let size = file
        .metadata()
        .map_err(|e| Error::io("stat", Some(path.to_path_buf()), e))?
        .len();
    let grid = part_grid(size, chunk)?;
    upload_parts(store, key, grid, threads, |idx, buf| {
        file.read_exact_at(buf, grid.range(idx).start)
            .map_err(|e| Error::io("read", Some(path.to_path_buf()), e))
    })
}

/// Upload an object cut as `grid` whose parts `fill(idx, buffer)` makes, as
/// one multipart upload: `threads` parts at a time, taken in order (a part
/// may wait for the parts before it, never after), each in a buffer of its
/// own; its completion is the commit, and a failed upload is aborted.
pub fn upload_parts(
    store: &Store,
    key: &str,
    grid: PartGrid,
    threads: usize,
    fill: impl Fn(usize, &mut [u8]) -> Result<()> + Sync,
) -> Result<Transferred> {
    let sink = MultipartSink::create(store, key, grid)?;
    each_part(grid.count, threads, |idx| {
        let r = grid.range(idx);
        let mut buf = vec![0u8; (r.end - r.start) as usize];
        fill(idx, &mut buf)?;
        sink.put_part(idx, Bytes::from(buf))
    })?;
    let version = sink.commit()?;
    Ok(Transferred {
        size: grid.total,
        parts: grid.count,
        version,
    })
}

/// Download `key` into a new file at `path` (created, or truncated), by ranged
/// GETs of the object's part grid for `chunk`, all of the version the first
/// HEAD saw (an object replaced meanwhile is a conflict). The file is
/// not fsynced: it is a scratch copy (a caller that publishes it syncs it).
pub fn download_file(
    store: &Store,
    key: &str,
    path: &Path,
    chunk: u64,
    threads: usize,
) -> Result<Transferred> {
    let source = ObjectSource::open(store, key)?;
    let info: ObjectInfo = source.info().clone();
    let grid = part_grid(info.size, chunk)?;
    let file = File::create(path).map_err(|e| Error::io("create", Some(path.to_path_buf()), e))?;
    file.set_len(info.size)
        .map_err(|e| Error::io("ftruncate", Some(path.to_path_buf()), e))?;
    each_part(grid.count, threads, |idx| {
        let r = grid.range(idx);
        let mut buf = vec![0u8; (r.end - r.start) as usize];
        source.read_at(r.start, &mut buf)?;
        file.write_all_at(&buf, r.start)
            .map_err(|e| Error::io("write", Some(path.to_path_buf()), e))
    })?;
    Ok(Transferred {
        size: info.size,
        parts: grid.count,
        version: info.version,
    })
}
