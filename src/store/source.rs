//! One object read by ranged GETs into the caller's buffers.
//!
//! [`ObjectSource::open`] takes the object's size and version (a HEAD); every
//! later GET asks for that version (If-Match on its ETag), so an object
//! replaced while it is read fails with a [`StoreErrorKind::Conflict`] instead
//! of mixing two generations' bytes. Each response body is copied into its
//! destination as it streams in: no buffer the size of a range is made.
//!
//! [`StoreErrorKind::Conflict`]: crate::StoreErrorKind::Conflict

use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{GetOptions, GetRange};

use super::runtime::block_on;
use super::{ObjectInfo, Store};
use crate::{Error, Result};

#[derive(Debug)]
pub struct ObjectSource {
    store: Store,
    key: String,
    path: Path,
    info: ObjectInfo,
}

impl ObjectSource {
    /// Open `key` for reading: its size and version now.
    pub fn open(store: &Store, key: &str) -> Result<Self> {
        let info = store.head(key)?;
        Ok(ObjectSource {
            store: store.clone(),
            key: key.to_string(),
            path: Path::from(key),
            info,
        })
    }

    pub fn len(&self) -> u64 {
        self.info.size
    }

    pub fn is_empty(&self) -> bool {
        self.info.size == 0
    }

    pub fn info(&self) -> &ObjectInfo {
        &self.info
    }

    pub fn url(&self) -> String {
        self.store.url(&self.key)
    }

    /// Fill `buf` with the object's bytes from `offset` (one GET).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.read_ranges(&mut [(offset, buf)], u64::MAX, 1)
    }

    /// Fill each `(offset, buffer)` with the object's bytes from `offset`:
    /// ranges cut into GETs of at most `piece` bytes (the part grid, so each
    /// GET is served by one stored part), `concurrency` of them at a time.
    pub fn read_ranges(
        &self,
        ranges: &mut [(u64, &mut [u8])],
        piece: u64,
        concurrency: usize,
    ) -> Result<()> {
        let piece = usize::try_from(piece.max(1)).unwrap_or(usize::MAX);
        let mut gets: Vec<(u64, &mut [u8])> = Vec::new();
        for (offset, buf) in ranges.iter_mut() {
            let end = offset.checked_add(buf.len() as u64);
            if end.is_none_or(|e| e > self.info.size) {
                return Err(Error::invalid(format!(
                    "{}: bytes {offset}+{} are past the object's end ({})",
                    self.url(),
                    buf.len(),
                    self.info.size
                )));
            }
            let mut at = *offset;
            for dst in buf.chunks_mut(piece) {
                let n = dst.len() as u64;
                gets.push((at, dst));
                at += n;
            }
        }
        let work = stream::iter(gets)
            .map(|(offset, dst)| self.get_into(offset, dst))
            .buffer_unordered(concurrency.max(1))
            .try_collect::<()>();
        block_on(work)?
    }

    async fn get_into(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let opts = GetOptions {
            range: Some(GetRange::Bounded(offset..offset + dst.len() as u64)),
            if_match: self.info.version.e_tag.clone(),
            ..Default::default()
        };
        let err = |e| self.store.error(&self.key, e);
        let mut body = self
            .store
            .objects()?
            .get_opts(&self.path, opts)
            .await
            .map_err(err)?
            .into_stream();
        let mut filled = 0;
        while let Some(bytes) = body.next().await {
            let bytes = bytes.map_err(err)?;
            let end = filled + bytes.len();
            if end > dst.len() {
                return Err(self.short(offset, dst.len(), end));
            }
            dst[filled..end].copy_from_slice(&bytes);
            filled = end;
        }
        if filled != dst.len() {
            return Err(self.short(offset, dst.len(), filled));
        }
        Ok(())
    }

    fn short(&self, offset: u64, want: usize, got: usize) -> Error {
        Error::Store {
            kind: crate::StoreErrorKind::Other,
            url: self.url(),
            reason: format!("a GET of {want} bytes at {offset} returned {got}"),
        }
    }
}
