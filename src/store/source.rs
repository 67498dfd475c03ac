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

/// Gaps of at most this many bytes between ranges are read and dropped
/// rather than cost a GET of their own.
pub(super) const GAP: usize = 1 << 20;

/// Where the bytes of one GET go, in turn.
enum Dst<'a> {
    Fill(&'a mut [u8]),
    Skip(usize),
}

impl Dst<'_> {
    fn len(&self) -> usize {
        match self {
            Dst::Fill(d) => d.len(),
            Dst::Skip(n) => *n,
        }
    }
}

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
        Self::with_info(store, key, info)
    }

    /// Open `key` as the version `e_tag` names (a read that began with an
    /// earlier call): a [`StoreErrorKind::Conflict`] where it changed since.
    pub fn open_version(store: &Store, key: &str, e_tag: &str) -> Result<Self> {
        let info = store.head(key)?;
        if info.version.e_tag.as_deref() != Some(e_tag) {
            return Err(Error::Store {
                kind: crate::StoreErrorKind::Conflict,
                url: store.url(key),
                reason: format!(
                    "the object changed while it was read (ETag {:?}, the read began at {e_tag:?})",
                    info.version.e_tag
                ),
            });
        }
        Self::with_info(store, key, info)
    }

    fn with_info(store: &Store, key: &str, info: ObjectInfo) -> Result<Self> {
        Ok(ObjectSource {
            store: store.clone(),
            key: key.to_string(),
            path: super::object_path(key),
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
    /// Ranges that follow each other in the object (a checkpoint's many small
    /// tensors), or lie within [`GAP`] of each other, share GETs up to `piece`
    /// bytes: one request fills several buffers in turn.
    pub fn read_ranges(
        &self,
        ranges: &mut [(u64, &mut [u8])],
        piece: u64,
        concurrency: usize,
    ) -> Result<()> {
        let piece = piece.max(1);
        let mut order: Vec<(u64, &mut [u8])> = Vec::with_capacity(ranges.len());
        for (offset, buf) in ranges.iter_mut() {
            self.check_range(*offset, buf.len() as u64)?;
            let mut at = *offset;
            for dst in buf.chunks_mut(usize::try_from(piece).unwrap_or(usize::MAX)) {
                let n = dst.len() as u64;
                order.push((at, dst));
                at += n;
            }
        }
        order.retain(|(_, dst)| !dst.is_empty());
        order.sort_by_key(|(at, _)| *at);
        let spans: Vec<(u64, u64)> = order.iter().map(|(at, d)| (*at, d.len() as u64)).collect();
        let mut pieces = order.into_iter();
        // Each GET fills its pieces in turn, reading and dropping the gaps.
        let gets: Vec<(u64, Vec<Dst<'_>>)> = gets_of(&spans, piece)
            .into_iter()
            .map(|(start, _, held)| {
                let (mut at, mut dsts) = (start, Vec::with_capacity(held.len()));
                for (offset, dst) in pieces.by_ref().take(held.len()) {
                    if offset > at {
                        dsts.push(Dst::Skip((offset - at) as usize));
                    }
                    at = offset + dst.len() as u64;
                    dsts.push(Dst::Fill(dst));
                }
                (start, dsts)
            })
            .collect();
        let work = stream::iter(gets)
            .map(|(offset, dsts)| self.get_into(offset, dsts))
            .buffer_unordered(concurrency.max(1))
            .try_collect::<()>();
        block_on(work)?
    }

    /// A typed error where `len` bytes from `offset` do not lie in the object.
    pub(super) fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.info.size) {
            return Err(Error::invalid(format!(
                "{}: bytes {offset}+{len} are past the object's end ({})",
                self.url(),
                self.info.size
            )));
        }
        Ok(())
    }

    /// One GET of `buf.len()` bytes from `offset` into `buf`.
    pub(super) async fn get_range_into(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.get_into(offset, vec![Dst::Fill(buf)]).await
    }

    /// One GET from `offset` filling (or skipping) `dsts` in turn (they follow
    /// each other in the object).
    async fn get_into(&self, offset: u64, mut dsts: Vec<Dst<'_>>) -> Result<()> {
        let want: usize = dsts.iter().map(Dst::len).sum();
        if want == 0 {
            return Ok(());
        }
        let opts = GetOptions {
            range: Some(GetRange::Bounded(offset..offset + want as u64)),
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
        // (destination, filled) as the body streams in.
        let (mut cur, mut filled, mut total) = (0usize, 0usize, 0usize);
        while let Some(bytes) = body.next().await {
            let mut bytes = &bytes.map_err(err)?[..];
            while !bytes.is_empty() {
                let Some(dst) = dsts.get_mut(cur) else {
                    return Err(self.short(offset, want, total + bytes.len()));
                };
                let n = (dst.len() - filled).min(bytes.len());
                if let Dst::Fill(d) = dst {
                    d[filled..filled + n].copy_from_slice(&bytes[..n]);
                }
                bytes = &bytes[n..];
                filled += n;
                total += n;
                if filled == dst.len() {
                    cur += 1;
                    filled = 0;
                }
            }
        }
        if total != want {
            return Err(self.short(offset, want, total));
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

/// The GETs of `spans` ((object offset, length), in object order): (start,
/// end, the spans it holds). Spans that follow each other, or lie within
/// [`GAP`] of each other (read and dropped: a torch.save archive's descriptors
/// and local headers between its storages), share a GET while it stays within
/// `chunk` bytes: a request costs more than the bytes of a small gap.
pub(super) fn gets_of(spans: &[(u64, u64)], chunk: u64) -> Vec<(u64, u64, std::ops::Range<usize>)> {
    let mut gets: Vec<(u64, u64, std::ops::Range<usize>)> = Vec::new();
    for (k, &(offset, len)) in spans.iter().enumerate() {
        // (The last GET so far holds the spans up to `k`.)
        if let Some(g) = gets.last_mut() {
            let joins = len == 0 // rides along: no bytes
                || (offset >= g.1 && offset - g.1 <= GAP as u64 && offset + len - g.0 <= chunk);
            if joins {
                g.1 = g.1.max(offset + len); // (an empty span leaves the end)
                g.2.end = k + 1;
                continue;
            }
        }
        gets.push((offset, offset + len, k..k + 1));
    }
    gets
}
