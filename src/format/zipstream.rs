//! A torch.save archive as a sequence of parts, for a sink that takes parts
//! (a multipart upload) instead of a file: no byte goes through a local copy.
//!
//! Any thread may fill any part: its bytes come from the [`Layout`] (headers,
//! descriptors, small records) and from the storages' host memory. The one
//! thing a part cannot know alone is a CRC-32 written after the data: each
//! part records the CRC-32 of every storage piece it copies, and a part that
//! holds a data descriptor (or the central directory) waits until the parts
//! before it have copied theirs, then combines the pieces. Parts are taken in
//! order, so the wait is for copies already under way, never for uploads.

use std::sync::{Condvar, Mutex, OnceLock};

use crate::engine::Memory;
use crate::error::{Error, Result};
use crate::sync::{lock, wait};

use super::integrity;
use super::zipwrite::{Body, Entry, Layout};
use crate::engine::Segment;

/// The parts' shared state: which parts have copied their bytes, and the
/// CRC-32 of each storage piece copied so far.
#[derive(Default)]
struct Progress {
    copied: Vec<bool>,
    /// Per entry: (offset in the record, CRC-32, length) of each piece copied.
    pieces: Vec<Vec<(u64, u32, u64)>>,
    failed: bool,
}

/// An archive laid out and cut into parts of `part_size` bytes.
pub struct PartedArchive<'a> {
    entries: &'a [Entry],
    layout: Layout,
    /// Everything before the central directory, in file order, with the entry
    /// of each memory segment.
    segs: Vec<(Segment, Option<usize>)>,
    /// (file offset of a data descriptor's CRC-32 field, entry), in file order.
    fields: Vec<(u64, usize)>,
    part_size: u64,
    total: u64,
    comment: String,
    progress: Mutex<Progress>,
    changed: Condvar,
    tail: OnceLock<Vec<u8>>,
}

impl<'a> PartedArchive<'a> {
    /// Lay out `entries` (storages in host memory only) as parts of
    /// `part_size` bytes.
    ///
    /// # Safety
    /// Each `Body::Memory` range must stay readable and unmodified while the
    /// parts are filled.
    pub unsafe fn new(entries: &'a [Entry], part_size: u64) -> Result<Self> {
        if let Some(e) = entries
            .iter()
            .find(|e| matches!(e.body, Body::Memory { memory, len, .. } if len > 0 && memory != Memory::Host))
        {
            return Err(Error::invalid(format!(
                "record {:?}: parts are made from host memory only",
                e.name
            )));
        }
        let layout = Layout::new(entries)?;
        // Header segments point into the layout's heap buffers, which stay put
        // when the layout moves into the archive.
        let (segs, _, index) = layout.segments(entries);
        let mut owner = vec![None; segs.len()];
        for (i, s) in index.iter().enumerate() {
            if let Some(s) = s {
                owner[*s] = Some(i);
            }
        }
        let mut segs: Vec<(Segment, Option<usize>)> = segs.into_iter().zip(owner).collect();
        segs.sort_unstable_by_key(|(s, _)| s.file_offset);
        let fields = segs
            .iter()
            .filter_map(|(s, i)| i.map(|i| (s.file_offset + s.len + 4, i)))
            .collect();
        // Every CRC-32 is computed here: nothing is left unchecked.
        let comment = integrity::comment_for(&[], false);
        let total = layout.file_len(entries, comment.len());
        let part_size = part_size.max(1);
        let count = total.div_ceil(part_size) as usize;
        Ok(PartedArchive {
            entries,
            layout,
            segs,
            fields,
            part_size,
            total,
            comment,
            progress: Mutex::new(Progress {
                copied: vec![false; count],
                pieces: vec![Vec::new(); entries.len()],
                failed: false,
            }),
            changed: Condvar::new(),
            tail: OnceLock::new(),
        })
    }

    /// The same archive cut into parts of `part_size` bytes (a store's grid).
    pub fn with_part_size(mut self, part_size: u64) -> Self {
        self.part_size = part_size.max(1);
        let count = self.total.div_ceil(self.part_size) as usize;
        lock(&self.progress).copied = vec![false; count];
        self
    }

    /// The archive's length.
    pub fn len(&self) -> u64 {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// How many parts.
    pub fn parts(&self) -> usize {
        lock(&self.progress).copied.len()
    }

    /// The byte range of part `idx`.
    fn range(&self, idx: usize) -> (u64, u64) {
        let start = idx as u64 * self.part_size;
        (start, (start + self.part_size).min(self.total))
    }

    /// Fill `buf` (of part `idx`'s length) with the part's bytes.
    pub fn fill(&self, idx: usize, buf: &mut [u8]) -> Result<()> {
        let r = self.fill_inner(idx, buf);
        if r.is_err() {
            lock(&self.progress).failed = true;
            self.changed.notify_all();
        }
        r
    }

    fn fill_inner(&self, idx: usize, buf: &mut [u8]) -> Result<()> {
        let (start, end) = self.range(idx);
        if buf.len() as u64 != end - start {
            return Err(Error::invalid(format!(
                "part {idx}: {} bytes given for {}",
                buf.len(),
                end - start
            )));
        }
        let cd = self.layout.cd_offset;
        let mut pieces = Vec::new();
        let first = self
            .segs
            .partition_point(|(s, _)| s.file_offset + s.len <= start);
        for (seg, entry) in &self.segs[first..] {
            let (s0, s1) = (seg.file_offset, seg.file_offset + seg.len);
            if s0 >= end {
                break;
            }
            let (a, b) = (s0.max(start), s1.min(end).min(cd));
            if a >= b {
                continue;
            }
            // SAFETY: header segments point into the layout, memory ones into
            // the caller's host memory (checked host in `new`, readable per its
            // contract); [a, b) lies inside the segment.
            let src = unsafe {
                std::slice::from_raw_parts((seg.addr + (a - s0)) as *const u8, (b - a) as usize)
            };
            buf[(a - start) as usize..(b - start) as usize].copy_from_slice(src);
            if let Some(i) = entry {
                pieces.push((*i, a - s0, crc32fast::hash(src), b - a));
            }
        }
        {
            let mut p = lock(&self.progress);
            for (i, at, crc, n) in pieces {
                p.pieces[i].push((at, crc, n));
            }
            p.copied[idx] = true;
        }
        self.changed.notify_all();
        // Data descriptors in this part: their CRC-32 fields (4 bytes, which
        // may straddle two parts).
        let first = self.fields.partition_point(|&(f, _)| f + 4 <= start);
        for &(field, i) in &self.fields[first..] {
            if field >= end {
                break;
            }
            let crc = self.crc_of(i, field - 4)?;
            put_clipped(buf, start, field, &crc.to_le_bytes());
        }
        if end > cd {
            let tail = self.tail()?;
            let a = start.max(cd);
            buf[(a - start) as usize..]
                .copy_from_slice(&tail[(a - cd) as usize..(end - cd) as usize]);
        }
        Ok(())
    }

    /// Waits until every part holding bytes before `upto` has copied them.
    fn wait_copied(&self, upto: u64) -> Result<std::sync::MutexGuard<'_, Progress>> {
        let last = (upto.saturating_sub(1) / self.part_size) as usize;
        let mut p = lock(&self.progress);
        loop {
            if p.failed {
                return Err(Error::invalid("another part of the archive failed"));
            }
            if p.copied[..=last.min(p.copied.len() - 1)].iter().all(|&c| c) {
                return Ok(p);
            }
            p = wait(&self.changed, p);
        }
    }

    /// Entry `i`'s CRC-32, once every piece of it (ending at `data_end`) is copied.
    fn crc_of(&self, i: usize, data_end: u64) -> Result<u32> {
        let p = self.wait_copied(data_end)?;
        let mut pieces = p.pieces[i].clone();
        drop(p);
        pieces.sort_unstable_by_key(|x| x.0);
        let mut h = crc32fast::Hasher::new();
        for (_, crc, n) in pieces {
            h.combine(&crc32fast::Hasher::new_with_initial_len(crc, n));
        }
        Ok(h.finalize())
    }

    /// The central directory and end records, made once every CRC-32 is known.
    fn tail(&self) -> Result<&Vec<u8>> {
        if let Some(t) = self.tail.get() {
            return Ok(t);
        }
        let mut crcs = Vec::with_capacity(self.entries.len());
        for (i, (e, placed)) in self.entries.iter().zip(&self.layout.placed).enumerate() {
            crcs.push(match &e.body {
                Body::Bytes(b) => crc32fast::hash(b),
                Body::Memory { len: 0, .. } => 0,
                Body::Memory { len, .. } => self.crc_of(i, placed.data_offset + len)?,
            });
        }
        let tail = self.layout.tail(self.entries, &crcs, &self.comment)?;
        debug_assert_eq!(self.layout.cd_offset + tail.len() as u64, self.total);
        Ok(self.tail.get_or_init(|| tail))
    }
}

/// Writes the part of `bytes` (at file offset `at`) that falls in the buffer
/// of the part starting at `start`.
fn put_clipped(buf: &mut [u8], start: u64, at: u64, bytes: &[u8]) {
    for (k, &b) in bytes.iter().enumerate() {
        let pos = at + k as u64;
        if pos >= start && pos - start < buf.len() as u64 {
            buf[(pos - start) as usize] = b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::zipmap;

    fn entries(data: &[Vec<u8>]) -> Vec<Entry> {
        let mut v = vec![
            Entry {
                name: "archive/data.pkl".into(),
                body: Body::Bytes(b"pickle".to_vec()),
                align: 64,
            },
            Entry {
                name: "archive/version".into(),
                body: Body::Bytes(b"3\n".to_vec()),
                align: 64,
            },
        ];
        for (k, d) in data.iter().enumerate() {
            v.push(Entry {
                name: format!("archive/data/{k}"),
                body: Body::Memory {
                    addr: d.as_ptr() as u64,
                    len: d.len() as u64,
                    memory: Memory::Host,
                },
                align: 64,
            });
        }
        v
    }

    /// The parts, filled by `threads` threads taking them in order (as an
    /// upload does), joined.
    fn image(a: &PartedArchive, threads: usize) -> Vec<u8> {
        let bufs: Vec<Mutex<Vec<u8>>> = (0..a.parts())
            .map(|i| {
                let (s, e) = a.range(i);
                Mutex::new(vec![0u8; (e - s) as usize])
            })
            .collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if i >= bufs.len() {
                        return;
                    }
                    a.fill(i, &mut lock(&bufs[i])).unwrap();
                });
            }
        });
        bufs.into_iter()
            .flat_map(|b| b.into_inner().unwrap())
            .collect()
    }

    #[test]
    fn parts_join_into_the_archive_the_file_writer_makes() {
        let data: Vec<Vec<u8>> = [100usize, 0, 5000, 64, 70_000, 3]
            .iter()
            .enumerate()
            .map(|(k, &n)| (0..n).map(|i| (i * 7 + k) as u8).collect())
            .collect();
        let es = entries(&data);
        for (part, threads) in [
            (1u64, 3),
            (7, 4),
            (64, 2),
            (1000, 8),
            (4096, 1),
            (1 << 20, 2),
        ] {
            // SAFETY: `data` outlives the archive.
            let a = unsafe { PartedArchive::new(&es, part).unwrap() };
            let bytes = image(&a, threads);
            assert_eq!(bytes.len() as u64, a.len());
            let m = zipmap::map_bytes(&bytes).unwrap();
            for (k, d) in data.iter().enumerate() {
                let r = m.get(&format!("archive/data/{k}")).unwrap();
                let at = r.data_offset as usize;
                assert_eq!(&bytes[at..at + d.len()], &d[..]);
                if !d.is_empty() {
                    assert_eq!(r.crc32, crc32fast::hash(d), "part {part}, record {k}");
                    // The descriptor after the data holds the same CRC-32.
                    let f = at + d.len() + 4;
                    assert_eq!(&bytes[f..f + 4], &crc32fast::hash(d).to_le_bytes());
                }
            }
        }
    }

    #[test]
    fn device_memory_is_refused() {
        let mut es = entries(&[vec![1u8; 8]]);
        if let Body::Memory { memory, .. } = &mut es[2].body {
            *memory = Memory::Cuda(0);
        }
        // SAFETY: nothing is read.
        let e = unsafe { PartedArchive::new(&es, 64) }.err().unwrap();
        assert!(e.to_string().contains("host memory"), "{e}");
    }
}
