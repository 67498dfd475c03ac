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
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::stream::{self, StreamExt};

use super::buffers::{Buffer, Buffers};
use super::source::gets_of;
use super::{part_grid, MultipartSink, ObjectInfo, ObjectSource, PartGrid, Store, Version};
use crate::engine::{Memory, Segment};
use crate::gpu::cuda::Copies;
use crate::sync::lock;
use crate::{Error, Result};

/// What a transfer moved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transferred {
    pub size: u64,
    pub parts: usize,
    pub version: Version,
    /// Where GPU memory was on the other side: "pinned" (page-locked host
    /// buffers) or "pageable" (the pinned-memory cap had no room); else None.
    pub host_buffers: Option<&'static str>,
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
    upload_parts(store, key, grid, threads, false, |idx, buf| {
        file.read_exact_at(buf, grid.range(idx).start)
            .map_err(|e| Error::io("read", Some(path.to_path_buf()), e))
    })
}

/// Upload an object cut as `grid` whose parts `fill(idx, buffer)` makes
/// (into a zeroed buffer), as one multipart upload: `threads` parts at a
/// time, taken in order (a part may wait for the parts before it, never
/// after), each in a buffer of its own, reused once its part is put, and
/// page-locked where `pinned` (GPU memory is copied into them); its
/// completion is the commit, and a failed upload is aborted.
pub fn upload_parts(
    store: &Store,
    key: &str,
    grid: PartGrid,
    threads: usize,
    pinned: bool,
    fill: impl Fn(usize, &mut [u8]) -> Result<()> + Sync,
) -> Result<Transferred> {
    let sink = MultipartSink::create(store, key, grid)?;
    let buffers = Buffers::new(grid.part_size.min(grid.total) as usize, pinned);
    each_part(grid.count, threads, |idx| {
        let r = grid.range(idx);
        let mut buf = buffers.take((r.end - r.start) as usize, true);
        fill(idx, buf.as_mut_slice())?;
        sink.put_part(idx, buf.into_bytes())
    })?;
    let version = sink.commit()?;
    Ok(Transferred {
        size: grid.total,
        parts: grid.count,
        version,
        host_buffers: buffers.kind(),
    })
}

/// Upload an object whose bytes are made in order and whose size is not known
/// ahead (compressed frames): `make(put)` hands `put` the object's bytes in
/// order (see [`StreamUpload`]). An error of `make` (which is the upload's
/// where a write found a part failed) aborts the upload.
pub fn upload_stream(
    store: &Store,
    key: &str,
    chunk: u64,
    threads: usize,
    make: impl FnOnce(&mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>,
) -> Result<Transferred> {
    let mut up = StreamUpload::start(store, key, chunk, threads)?;
    match make(&mut |b: &[u8]| up.write(b)) {
        Ok(()) => up.finish(),
        Err(e) => {
            up.abort();
            Err(e)
        }
    }
}

/// An object written as a stream of bytes of a size not known ahead: they
/// are cut into parts of whole `chunk`s, at least [`super::MIN_PART`] (as
/// [`part_grid`] cuts any object's), doubled every [`GROW_EVERY`] parts (so
/// that 10,000 parts hold any checkpoint), the last shorter, each uploaded by
/// one of `threads` threads while the next fills; a full part waits for a
/// free uploader, so in-flight memory is `threads` + 1 parts. One multipart
/// upload: [`StreamUpload::finish`] completes it (the commit); aborted, or
/// dropped unfinished, it is aborted (the key keeps what it had).
pub struct StreamUpload {
    /// None once finished or aborted.
    sink: Option<Arc<MultipartSink>>,
    /// None once the uploaders were told to stop (the channel closed).
    tx: Option<std::sync::mpsc::SyncSender<(usize, Bytes)>>,
    uploaders: Vec<std::thread::JoinHandle<()>>,
    /// The first failed part's error: once set, no later part is put.
    first: Arc<Mutex<Option<Error>>>,
    url: String,
    part: u64,
    idx: usize,
    size: u64,
    buf: Vec<u8>,
}

impl StreamUpload {
    /// Start the multipart upload to `key` and its `threads` uploaders.
    pub fn start(store: &Store, key: &str, chunk: u64, threads: usize) -> Result<Self> {
        let part = part_grid(0, chunk)?.part_size;
        let sink = Arc::new(MultipartSink::create_open(store, key)?);
        let first: Arc<Mutex<Option<Error>>> = Arc::new(Mutex::new(None));
        // A rendezvous: a full part waits for a free uploader (no queue of parts).
        let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, Bytes)>(0);
        let rx = Arc::new(Mutex::new(rx));
        let mut uploaders = Vec::new();
        for _ in 0..threads.max(1) {
            let (sink, first, rx) = (sink.clone(), first.clone(), rx.clone());
            let spawned = std::thread::Builder::new()
                .name("ckptio-upload".into())
                .spawn(move || loop {
                    let Ok((idx, data)) = lock(&rx).recv() else {
                        return;
                    };
                    if lock(&first).is_some() {
                        continue; // drain: the writer sees the failure at its next part
                    }
                    if let Err(e) = sink.put_part(idx, data) {
                        lock(&first).get_or_insert(e);
                    }
                });
            match spawned {
                Ok(h) => uploaders.push(h),
                Err(e) if uploaders.is_empty() => {
                    return Err(Error::io("start an upload thread", None, e))
                }
                Err(_) => break, // fewer uploaders than asked: still correct
            }
        }
        Ok(StreamUpload {
            url: sink.url(),
            sink: Some(sink),
            tx: Some(tx),
            uploaders,
            first,
            part,
            idx: 0,
            size: 0,
            buf: Vec::new(),
        })
    }

    /// The URL written.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.size
    }

    /// Append `bytes`; blocks while a part is full and every uploader busy.
    /// After a failed part, the upload's error (then "closed" on later calls).
    pub fn write(&mut self, mut bytes: &[u8]) -> Result<()> {
        while !bytes.is_empty() {
            let want = part_len(self.part, self.idx);
            if self.buf.capacity() == 0 {
                self.buf.reserve_exact(want);
            }
            let n = (want - self.buf.len()).min(bytes.len());
            self.buf.extend_from_slice(&bytes[..n]);
            self.size += n as u64;
            bytes = &bytes[n..];
            if self.buf.len() == want {
                self.send()?;
            }
        }
        Ok(())
    }

    fn send(&mut self) -> Result<()> {
        let sent = match &self.tx {
            Some(tx) if lock(&self.first).is_none() => {
                let data = Bytes::from(std::mem::take(&mut self.buf));
                tx.send((self.idx, data)).is_ok()
            }
            _ => false,
        };
        if !sent {
            self.stop();
            return Err(lock(&self.first).take().unwrap_or_else(|| {
                Error::invalid(format!("{}: the upload was closed", self.url))
            }));
        }
        self.idx += 1;
        Ok(())
    }

    /// Close the channel and wait for the uploaders to finish their parts.
    fn stop(&mut self) {
        self.tx = None;
        for h in self.uploaders.drain(..) {
            let _ = h.join();
        }
    }

    /// The last part (an empty object: one empty part), then the completion:
    /// the object appears whole under its key.
    pub fn finish(mut self) -> Result<Transferred> {
        if !self.buf.is_empty() || self.idx == 0 {
            self.send()?;
        }
        self.stop();
        if let Some(e) = lock(&self.first).take() {
            return Err(e);
        }
        let sink = self.sink.take().and_then(|s| Arc::try_unwrap(s).ok());
        let sink = sink.ok_or_else(|| Error::invalid(format!("{}: upload closed", self.url)))?;
        let version = sink.commit()?;
        Ok(Transferred {
            size: self.size,
            parts: self.idx,
            version,
            host_buffers: None,
        })
    }

    /// Stop and abort the upload (the key keeps what it had).
    pub fn abort(mut self) {
        self.stop();
        self.sink = None; // the last hold of the sink: its drop aborts the upload
    }
}

impl Drop for StreamUpload {
    fn drop(&mut self) {
        self.stop(); // then the sink's drop (the last hold) aborts an unfinished upload
    }
}

/// Parts of an open upload double in size every this many parts.
pub const GROW_EVERY: usize = 1000;

/// The size of part `idx` of an open upload whose first parts are `part` bytes.
pub(super) fn part_len(part: u64, idx: usize) -> usize {
    let grown = part.saturating_mul(1 << (idx / GROW_EVERY).min(16));
    grown.min(super::MAX_PART) as usize
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
    let buffers = Buffers::new(grid.part_size.min(grid.total) as usize, false);
    each_part(grid.count, threads, |idx| {
        let r = grid.range(idx);
        let mut buf = buffers.take((r.end - r.start) as usize, false);
        source.read_at(r.start, buf.as_mut_slice())?;
        file.write_all_at(buf.as_mut_slice(), r.start)
            .map_err(|e| Error::io("write", Some(path.to_path_buf()), e))
    })?;
    Ok(Transferred {
        size: info.size,
        parts: grid.count,
        version: info.version,
        host_buffers: None,
    })
}

/// What [`read_segments`] did: each segment's CRC-32 (where asked), and how
/// device memory's host side ran ([`Transferred::host_buffers`]).
#[derive(Debug)]
pub struct SegmentsRead {
    pub crcs: Vec<Option<u32>>,
    pub host_buffers: Option<&'static str>,
}

/// Read `segments` (each at its object offset) of `source` into their memory.
/// All in host memory: straight from the GETs. Any in device memory: every
/// segment through [`through_buffer`]'s host slots, page-locked (device pieces
/// copied up, host ones copied out), so that a storage's zip header (host) and
/// its data (device) come in one GET, as neighbouring small tensors do. With
/// `crc`, each segment's CRC-32, computed where its bytes are in host memory.
///
/// # Safety
/// Every segment's memory must be writable memory of its kind, alive until
/// this returns, overlapping no other segment, and used by no one else
/// meanwhile (device memory: the caller's streams are done with it).
pub unsafe fn read_segments(
    source: &ObjectSource,
    segments: &[(u64, Segment)],
    chunk: u64,
    threads: usize,
    crc: bool,
) -> Result<SegmentsRead> {
    // Per segment: (offset in it, CRC-32, length) of each piece hashed.
    let hashed: Mutex<Vec<Vec<(u64, u32, u64)>>> = Mutex::new(vec![Vec::new(); segments.len()]);
    let mut host_buffers = None;
    if segments.iter().all(|(_, s)| s.memory == Memory::Host) {
        let mut host: Vec<(u64, &mut [u8])> = segments
            .iter()
            .map(|&(offset, ref s)| {
                // SAFETY: writable and ours alone (the caller's contract).
                (offset, unsafe {
                    std::slice::from_raw_parts_mut(s.addr as *mut u8, s.len as usize)
                })
            })
            .collect();
        source.read_ranges(&mut host, chunk, threads)?;
        if crc {
            each_part(host.len(), threads, |k| {
                let c = crc32fast::hash(host[k].1);
                lock(&hashed)[k].push((0, c, host[k].1.len() as u64));
                Ok(())
            })?;
        }
    } else {
        // (object offset, segment, memory, address, length) pieces of at most `chunk`.
        let mut pieces: Vec<(u64, usize, Memory, u64, u64)> = Vec::new();
        for (i, &(offset, ref s)) in segments.iter().enumerate() {
            let mut at = 0;
            while at < s.len {
                let n = (s.len - at).min(chunk.max(1));
                pieces.push((offset + at, i, s.memory, s.addr + at, n));
                at += n;
            }
        }
        pieces.sort_unstable_by_key(|p| p.0);
        let spans: Vec<(u64, u64)> = pieces.iter().map(|p| (p.0, p.4)).collect();
        let copies = std::cell::RefCell::new(Copies::default());
        let slots = through_buffer(
            source,
            &spans,
            chunk,
            threads,
            true,
            |k, bytes| {
                let (offset, i, memory, addr, n) = pieces[k];
                match memory {
                    // SAFETY: writable host memory of `n` bytes, ours alone (the
                    // caller's contract); `bytes` is our buffer, apart from it.
                    Memory::Host => unsafe {
                        std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, n as usize)
                    },
                    // SAFETY: `bytes` (a slot) stays put until `slot_done` (the
                    // copies are awaited there, also after an error); the
                    // destination per the caller's contract.
                    Memory::Cuda(d) => unsafe {
                        copies
                            .borrow_mut()
                            .queue_to_device(d, addr, bytes.as_ptr(), n as usize)?
                    },
                }
                if crc {
                    lock(&hashed)[i].push((offset - segments[i].0, crc32fast::hash(bytes), n));
                }
                Ok(())
            },
            || copies.borrow_mut().wait(),
        )?;
        host_buffers = slots;
    }
    let hashed = hashed.into_inner().unwrap_or_else(|p| p.into_inner());
    let crcs = hashed
        .into_iter()
        .map(|mut ps| {
            if !crc {
                return None;
            }
            ps.sort_unstable_by_key(|p| p.0);
            let mut h = crc32fast::Hasher::new();
            for (_, c, n) in ps {
                h.combine(&crc32fast::Hasher::new_with_initial_len(c, n));
            }
            Some(h.finalize())
        })
        .collect();
    Ok(SegmentsRead { crcs, host_buffers })
}

/// Reads `spans` ((object offset, length), in object order, each at most
/// `chunk`) of `source` through 2 x `threads` host slots of `chunk` bytes: a
/// reader thread keeps `threads` GETs in flight (neighbouring spans within
/// [`GAP`](super::source) share one, up to `chunk` bytes), each into a free
/// slot, and hands the slots back in object order; the caller gives each
/// span's bytes to `each(k, bytes)` (span `k`), then `slot_done()` (called after
/// an error too) before the slot is reused or freed. No round waits for its
/// slowest GET: a GET starts as soon as a slot is free. In-flight memory:
/// 2 x threads x chunk, page-locked where `pinned` (as
/// [`Transferred::host_buffers`] says, returned).
pub(super) fn through_buffer(
    source: &ObjectSource,
    spans: &[(u64, u64)],
    chunk: u64,
    threads: usize,
    pinned: bool,
    mut each: impl FnMut(usize, &[u8]) -> Result<()>,
    mut slot_done: impl FnMut() -> Result<()>,
) -> Result<Option<&'static str>> {
    for &(offset, len) in spans {
        source.check_range(offset, len)?;
    }
    let gets = gets_of(spans, chunk.max(1));
    let Some(most) = gets.iter().map(|g| (g.1 - g.0) as usize).max() else {
        return Ok(None);
    };
    let threads = threads.max(1);
    let slots = (2 * threads).min(gets.len());
    let buffers = Buffers::new(most, pinned);
    let pool: Mutex<Vec<Buffer>> =
        Mutex::new((0..slots).map(|_| buffers.take(most, false)).collect());
    let free = tokio::sync::Semaphore::new(slots);
    let (full_tx, full_rx) = std::sync::mpsc::channel::<(usize, Buffer, Result<()>)>();
    std::thread::scope(|scope| {
        // Closed when the caller leaves (an error too): a reader waiting for a
        // slot then stops, and the scope can join it.
        struct Close<'a>(&'a tokio::sync::Semaphore);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                self.0.close();
            }
        }
        let _close = Close(&free);
        let (gets, pool, free) = (&gets, &pool, &free);
        scope.spawn(move || {
            let reads = stream::iter(gets.iter().enumerate())
                .map(|(i, g)| async move {
                    let permit = free.acquire().await.ok()?;
                    permit.forget(); // given back with the slot, by the caller
                    let mut slot = lock(pool).pop()?;
                    let got = source
                        .get_range_into(g.0, &mut slot.as_mut_slice()[..(g.1 - g.0) as usize])
                        .await;
                    Some((i, slot, got))
                })
                .buffered(threads);
            let _ = super::block_on(async {
                futures::pin_mut!(reads);
                while let Some(Some((i, slot, got))) = reads.next().await {
                    let failed = got.is_err();
                    if full_tx.send((i, slot, got)).is_err() || failed {
                        return;
                    }
                }
            });
        });
        for (i, g) in gets.iter().enumerate() {
            let Ok((at, slot, got)) = full_rx.recv() else {
                return Err(Error::invalid("the object-store reader thread stopped"));
            };
            debug_assert_eq!(at, i);
            let mut taken = got;
            for k in g.2.clone() {
                let (offset, len) = spans[k];
                let from = (offset - g.0) as usize;
                let bytes = &slot.as_ref()[from..from + len as usize];
                taken = taken.and_then(|()| each(k, bytes));
            }
            // Even after an error: what `each` started on the slot ends before it goes.
            let done = slot_done();
            taken?;
            done?;
            lock(pool).push(slot);
            free.add_permits(1);
        }
        Ok(buffers.kind())
    })
}

/// The CRC-32 of each of `ranges` ((object offset, length)) of `source`,
/// read by GETs of at most `chunk` bytes through a buffer of `threads`
/// of them: no more memory than that, whatever the object's size.
pub fn hash_ranges(
    source: &ObjectSource,
    ranges: &[(u64, u64)],
    chunk: u64,
    threads: usize,
) -> Result<Vec<u32>> {
    let chunk = chunk.max(1);
    let mut spans: Vec<(u64, u64, usize)> = Vec::new();
    for (i, &(offset, len)) in ranges.iter().enumerate() {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(chunk);
            spans.push((offset + at, n, i));
            at += n;
        }
    }
    spans.sort_unstable_by_key(|s| s.0);
    let mut hashers: Vec<crc32fast::Hasher> = vec![crc32fast::Hasher::new(); ranges.len()];
    let flat: Vec<(u64, u64)> = spans.iter().map(|s| (s.0, s.1)).collect();
    // Pieces of a range come in object order: each extends its range's hash.
    through_buffer(
        source,
        &flat,
        chunk,
        threads,
        false,
        |k, bytes| {
            hashers[spans[k].2].update(bytes);
            Ok(())
        },
        || Ok(()),
    )?;
    Ok(hashers.into_iter().map(|h| h.finalize()).collect())
}
