//! One object written as a multipart upload to its final key.
//!
//! Parts are numbered by the part grid ([`super::part_grid`]) the sink is made
//! with and may be put in any order, from any number of threads at once (the
//! engine's lanes, each blocking on its own part); each must have its grid
//! size, and the commit wants every one of them, so an upload is never
//! completed short. An object whose size is not known ahead (compressed
//! frames, made as they are uploaded) has no grid ([`MultipartSink::create_open`]):
//! its parts are whatever sizes the writer cuts, numbered from 0 with no gap. Until [`MultipartSink::commit`] completes the upload, the
//! store shows the key as it was (the old object whole, or none); the
//! completion is the commit. A sink dropped uncommitted, or whose part
//! failed, aborts its upload so that no part stays stored (and billed).

use std::sync::Mutex;

use bytes::Bytes;
use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::multipart::PartId;
use object_store::path::Path;
use object_store::MultipartId;

use super::runtime::{block_on, spawn_detached};
use super::{PartGrid, Store, Version};
use crate::sync::lock;
use crate::{Error, Result};

pub struct MultipartSink {
    store: Store,
    key: String,
    path: Path,
    id: MultipartId,
    /// None: an object of a size not known ahead (parts of any size).
    grid: Option<PartGrid>,
    /// Each part's id once stored, by part number.
    parts: Mutex<Vec<Option<PartId>>>,
    /// Completed or aborted: nothing left to abort on drop.
    finished: bool,
}

impl std::fmt::Debug for MultipartSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultipartSink")
            .field("url", &self.store.url(&self.key))
            .field("id", &self.id)
            .finish()
    }
}

impl MultipartSink {
    /// Start a multipart upload to `key` of an object cut as `grid`.
    pub fn create(store: &Store, key: &str, grid: PartGrid) -> Result<Self> {
        Self::start(store, key, Some(grid))
    }

    /// Start a multipart upload to `key` of an object whose size is not known
    /// ahead: parts of any size (S3 wants 5 MiB or more but for the last).
    pub fn create_open(store: &Store, key: &str) -> Result<Self> {
        Self::start(store, key, None)
    }

    fn start(store: &Store, key: &str, grid: Option<PartGrid>) -> Result<Self> {
        store.an_object(key)?;
        let path = super::object_path(key);
        let id = block_on(store.multipart()?.create_multipart(&path))?
            .map_err(|e| store.error(key, e))?;
        Ok(MultipartSink {
            store: store.clone(),
            key: key.to_string(),
            path,
            id,
            grid,
            parts: Mutex::new(vec![None; grid.map_or(0, |g| g.count)]),
            finished: false,
        })
    }

    /// The URL this sink writes.
    pub fn url(&self) -> String {
        self.store.url(&self.key)
    }

    /// Store part `idx` (0-based), `data` of the grid's size for it. Blocks
    /// until the store has it; safe to call from many threads at once.
    pub fn put_part(&self, idx: usize, data: Bytes) -> Result<()> {
        if let Some(grid) = self.grid {
            let want = grid.range(idx);
            if idx >= grid.count || data.len() as u64 != want.end - want.start {
                return Err(Error::invalid(format!(
                    "{}: part {idx} of {} bytes does not fit the grid ({} parts of {} bytes, {} in all)",
                    self.url(),
                    data.len(),
                    grid.count,
                    grid.part_size,
                    grid.total
                )));
            }
        } else if idx as u64 >= super::MAX_PARTS {
            return Err(Error::invalid(format!(
                "{}: part {idx}: a multipart upload holds at most {} parts",
                self.url(),
                super::MAX_PARTS
            )));
        }
        let id = block_on(self.put_part_async(idx, data))??;
        self.record(idx, id);
        Ok(())
    }

    async fn put_part_async(&self, idx: usize, data: Bytes) -> Result<PartId> {
        self.store
            .multipart()?
            .put_part(&self.path, &self.id, idx, data.into())
            .await
            .map_err(|e| self.store.error(&self.key, e))
    }

    fn record(&self, idx: usize, id: PartId) {
        let mut parts = lock(&self.parts);
        if parts.len() <= idx {
            parts.resize(idx + 1, None); // an open upload: parts come as they are cut
        }
        parts[idx] = Some(id);
    }

    /// Upload `data` (the whole object, in memory) as the grid's parts,
    /// `concurrency` requests at a time. Each part is copied once into a
    /// buffer of its own, so at most `concurrency` parts are held at once.
    pub fn upload(&self, data: &[u8], concurrency: usize) -> Result<()> {
        let Some(grid) = self.grid else {
            return Err(Error::invalid(format!(
                "{}: no part grid to cut",
                self.url()
            )));
        };
        if data.len() as u64 != grid.total {
            return Err(Error::invalid(format!(
                "{}: {} bytes given for an object of {}",
                self.url(),
                data.len(),
                grid.total
            )));
        }
        let work = stream::iter(0..grid.count)
            .map(|idx| {
                let r = grid.range(idx);
                let part = Bytes::copy_from_slice(&data[r.start as usize..r.end as usize]);
                async move { self.put_part_async(idx, part).await.map(|id| (idx, id)) }
            })
            .buffer_unordered(concurrency.max(1))
            .try_for_each(|(idx, id)| {
                self.record(idx, id);
                async { Ok(()) }
            });
        block_on(work)?
    }

    /// Complete the upload: the object appears whole under its key, replacing
    /// what was there. Refused (and the upload aborted) unless every part of
    /// the grid was stored.
    pub fn commit(mut self) -> Result<Version> {
        let parts = std::mem::take(&mut *lock(&self.parts));
        let count = parts.len();
        let mut ids = Vec::with_capacity(count);
        for (idx, p) in parts.into_iter().enumerate() {
            match p {
                Some(id) => ids.push(id),
                None => {
                    return Err(Error::invalid(format!(
                        "{}: part {idx} of {count} was never stored: not committed",
                        self.url(),
                    )))
                }
            }
        }
        if ids.is_empty() {
            return Err(Error::invalid(format!(
                "{}: no part stored: not committed",
                self.url()
            )));
        }
        let done = block_on(
            self.store
                .multipart()?
                .complete_multipart(&self.path, &self.id, ids),
        )?
        .map_err(|e| self.store.error(&self.key, e));
        // Completed, or failed: either way drop aborts (a failed completion
        // leaves an upload the store may still hold).
        let r = done?;
        self.finished = true;
        Ok(Version {
            e_tag: r.e_tag,
            version: r.version,
        })
    }

    /// Abort the upload: its parts are removed, the key is as it was.
    pub fn abort(mut self) -> Result<()> {
        self.finished = true;
        block_on(
            self.store
                .multipart()?
                .abort_multipart(&self.path, &self.id),
        )?
        .map_err(|e| self.store.error(&self.key, e))
    }
}

impl Drop for MultipartSink {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // In a forked child the upload is the parent's: left alone.
        let Ok(store) = self.store.multipart().cloned() else {
            return;
        };
        let path = self.path.clone();
        let id = self.id.clone();
        let abort = async move {
            // Best effort: the store's lifecycle rule and `ckptio clean` catch
            // what a dead process or a failed abort leaves.
            let _ = store.abort_multipart(&path, &id).await;
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            spawn_detached(abort);
        } else {
            let _ = block_on(abort);
        }
    }
}
