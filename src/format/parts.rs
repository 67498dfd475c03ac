//! Checkpoints as sequences of parts, for a sink that takes parts (a
//! multipart upload) instead of a file: no byte goes through a local copy.
//! [`PartedImage`]: header bytes and memory ranges (a safetensors file, or a
//! DCP data file whose items' CRC-32 fields follow their data);
//! [`PartedArchive`]: a torch.save archive, whose CRC-32s follow the data.
//!
//! Any thread may fill any part: its bytes come from the layout (headers,
//! descriptors, small records) and from the storages' host memory. The one
//! thing an archive's part cannot know alone is a CRC-32 written after the
//! data: each part records the CRC-32 of every storage piece it copies, and a
//! part that holds a data descriptor (or the central directory) waits until
//! the parts before it have copied theirs, then combines the pieces. Parts are
//! taken in order, so the wait is for copies already under way, never for
//! uploads.

use std::sync::{Condvar, Mutex, OnceLock};

use crate::engine::Memory;
use crate::error::{Error, Result};
use crate::sync::{lock, wait};

use super::integrity;
use super::zipwrite::{Body, Entry, Layout};
use crate::engine::Segment;
use crate::gpu::cuda::Copies;

/// The parts' shared state: which parts have copied their bytes, and the
/// CRC-32 of each piece of a tracked range copied so far.
#[derive(Default)]
struct Progress {
    copied: Vec<bool>,
    /// Per range: (offset in the range, CRC-32, length) of each piece copied.
    pieces: Vec<Vec<(u64, u32, u64)>>,
    failed: bool,
}

/// CRC-32s of memory ranges (an archive's storages, a DCP file's tensors)
/// written after their data: each part records the CRC-32 of every piece it
/// copies, and a part that holds a CRC field waits until the parts before
/// the field have copied theirs, then combines the pieces.
struct Crcs {
    part_size: u64,
    progress: Mutex<Progress>,
    changed: Condvar,
}

impl Crcs {
    fn new(total: u64, part_size: u64, ranges: usize) -> Self {
        Crcs {
            part_size,
            progress: Mutex::new(Progress {
                copied: vec![false; total.div_ceil(part_size) as usize],
                pieces: vec![Vec::new(); ranges],
                failed: false,
            }),
            changed: Condvar::new(),
        }
    }

    fn parts(&self) -> usize {
        lock(&self.progress).copied.len()
    }

    /// Part `idx` has copied its bytes: `pieces` = (range, offset in it, CRC-32, length).
    fn copied(&self, idx: usize, pieces: Vec<(usize, u64, u32, u64)>) {
        {
            let mut p = lock(&self.progress);
            for (i, at, crc, n) in pieces {
                p.pieces[i].push((at, crc, n));
            }
            p.copied[idx] = true;
        }
        self.changed.notify_all();
    }

    /// A part failed: the parts waiting on it fail too.
    fn failed(&self) {
        lock(&self.progress).failed = true;
        self.changed.notify_all();
    }

    /// Waits until every part holding bytes before `upto` has copied them.
    fn wait_copied(&self, upto: u64) -> Result<std::sync::MutexGuard<'_, Progress>> {
        let last = (upto.saturating_sub(1) / self.part_size) as usize;
        let mut p = lock(&self.progress);
        loop {
            if p.failed {
                return Err(Error::invalid("another part of the object failed"));
            }
            if p.copied[..=last.min(p.copied.len() - 1)].iter().all(|&c| c) {
                return Ok(p);
            }
            p = wait(&self.changed, p);
        }
    }

    /// Range `i`'s CRC-32, once every piece of it (ending at `data_end`) is copied.
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
    total: u64,
    comment: String,
    crcs: Crcs,
    tail: OnceLock<Vec<u8>>,
}

impl<'a> PartedArchive<'a> {
    /// Lay out `entries` (storages in host or device memory) as parts of
    /// `part_size(archive length)` bytes (a store's grid for that length).
    ///
    /// # Safety
    /// Each `Body::Memory` range must stay readable and unmodified while the
    /// parts are filled (device memory: no stream of the caller's still
    /// writes it).
    pub unsafe fn new(
        entries: &'a [Entry],
        part_size: impl FnOnce(u64) -> Result<u64>,
    ) -> Result<Self> {
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
        let part_size = part_size(total)?.max(1);
        Ok(PartedArchive {
            entries,
            layout,
            segs,
            fields,
            total,
            comment,
            crcs: Crcs::new(total, part_size, entries.len()),
            tail: OnceLock::new(),
        })
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
        self.crcs.parts()
    }

    /// The byte range of part `idx`.
    fn range(&self, idx: usize) -> (u64, u64) {
        part_range(idx, self.crcs.part_size, self.total)
    }

    /// Fill `buf` (of part `idx`'s length) with the part's bytes.
    pub fn fill(&self, idx: usize, buf: &mut [u8]) -> Result<()> {
        let r = self.fill_inner(idx, buf);
        if r.is_err() {
            self.crcs.failed();
        }
        r
    }

    fn fill_inner(&self, idx: usize, buf: &mut [u8]) -> Result<()> {
        let (start, end) = self.range(idx);
        check_part(idx, buf, start, end)?;
        let cd = self.layout.cd_offset;
        let mut pieces = Vec::new();
        // SAFETY: header segments point into the layout, memory ones into the
        // caller's memory, readable per the contract of `new`.
        unsafe {
            copy_range(&self.segs, start, cd, buf, |entry, at, src| {
                if let Some(i) = entry {
                    pieces.push((i, at, crc32fast::hash(src), src.len() as u64));
                }
            })?
        };
        self.crcs.copied(idx, pieces);
        // Data descriptors in this part: their CRC-32 fields (4 bytes, which
        // may straddle two parts).
        put_fields(&self.fields, buf, start, end, |i, field| {
            self.crcs.crc_of(i, field - 4)
        })?;
        if end > cd {
            let tail = self.tail()?;
            let a = start.max(cd);
            buf[(a - start) as usize..]
                .copy_from_slice(&tail[(a - cd) as usize..(end - cd) as usize]);
        }
        Ok(())
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
                Body::Memory { len, .. } => self.crcs.crc_of(i, placed.data_offset + len)?,
            });
        }
        let tail = self.layout.tail(self.entries, &crcs, &self.comment)?;
        debug_assert_eq!(self.layout.cd_offset + tail.len() as u64, self.total);
        Ok(self.tail.get_or_init(|| tail))
    }
}

/// Copies into `buf` (the bytes from `start`) what `segs` (in file order, not
/// overlapping) hold of `[start, min(start + buf.len(), stop))`, calling
/// `piece(tag, offset in the segment, bytes)` for each piece copied. Host
/// memory is copied at once, device memory by copies on streams of this
/// thread's, all awaited before the first piece is reported.
///
/// # Safety
/// Every segment's `[addr, addr + len)` must be readable memory of its kind
/// (device memory no stream of the caller's still writes), unmodified meanwhile.
unsafe fn copy_range<T: Copy>(
    segs: &[(Segment, T)],
    start: u64,
    stop: u64,
    buf: &mut [u8],
    mut piece: impl FnMut(T, u64, &[u8]),
) -> Result<()> {
    let end = start + buf.len() as u64;
    let first = segs.partition_point(|(s, _)| s.file_offset + s.len <= start);
    let mut device: Option<Copies> = None;
    let mut copied = Vec::new();
    for (seg, tag) in &segs[first..] {
        let (s0, s1) = (seg.file_offset, seg.file_offset + seg.len);
        if s0 >= end {
            break;
        }
        let (a, b) = (s0.max(start), s1.min(end).min(stop));
        if a >= b {
            continue;
        }
        let (lo, hi) = ((a - start) as usize, (b - start) as usize);
        let src = seg.addr + (a - s0);
        match seg.memory {
            Memory::Host => {
                // SAFETY: readable (the caller's contract); [a, b) lies inside the segment.
                let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, hi - lo) };
                buf[lo..hi].copy_from_slice(bytes);
            }
            // SAFETY: the source per the caller's contract; `buf` is untouched
            // until the copies are awaited (`finish`, or the drop on an error).
            Memory::Cuda(d) => unsafe {
                let copies = device.get_or_insert_with(Copies::default);
                copies.queue_to_host(d, buf[lo..hi].as_mut_ptr(), src, hi - lo)?
            },
        }
        copied.push((*tag, a - s0, lo, hi));
    }
    if let Some(copies) = device {
        copies.finish()?;
    }
    for (tag, at, lo, hi) in copied {
        piece(tag, at, &buf[lo..hi]);
    }
    Ok(())
}

/// An object made of header bytes at offset 0 and memory ranges after them
/// (a safetensors file; a DCP data file, its items' headers and tails as
/// host ranges), cut into parts; each range's CRC-32 may be written into
/// fields after it (a zip's data descriptor and directory entry).
pub struct PartedImage {
    /// The header as a segment, then the memory ranges, in file order, each
    /// with its index among the ranges given (None: the header).
    segs: Vec<(Segment, Option<usize>)>,
    _head: Vec<u8>,
    /// (file offset of a CRC-32 field, range), in file order.
    fields: Vec<(u64, usize)>,
    /// The end of each range given.
    ends: Vec<u64>,
    total: u64,
    crcs: Crcs,
}

impl PartedImage {
    /// `head` at offset 0 and `segs` (host or device memory at their file
    /// offsets, after the head, not overlapping), `total` bytes in all (gaps
    /// are zeros), cut into parts of `part_size(total)` bytes; `patches` =
    /// [(index in `segs`, file offset)]: where a range's CRC-32 goes, after it.
    ///
    /// # Safety
    /// Each segment's memory must stay readable and unmodified while parts
    /// are filled (device memory: no stream of the caller's still writes it).
    pub unsafe fn new(
        head: Vec<u8>,
        segs: Vec<Segment>,
        total: u64,
        patches: &[(usize, u64)],
        part_size: impl FnOnce(u64) -> Result<u64>,
    ) -> Result<Self> {
        let ends: Vec<u64> = segs.iter().map(|s| s.file_offset + s.len).collect();
        let mut fields = Vec::with_capacity(patches.len());
        for &(i, at) in patches {
            match ends.get(i) {
                Some(&e) if at >= e && at.saturating_add(4) <= total => fields.push((at, i)),
                _ => {
                    return Err(Error::invalid(format!(
                        "CRC-32 field at {at} of range {i}: no such range, or not after it \
                         and inside the object ({total} bytes)"
                    )))
                }
            }
        }
        fields.sort_unstable();
        let mut all = vec![(
            Segment {
                file_offset: 0,
                addr: head.as_ptr() as u64,
                len: head.len() as u64,
                memory: Memory::Host,
            },
            None,
        )];
        all.extend(segs.into_iter().enumerate().map(|(i, s)| (s, Some(i))));
        all.sort_unstable_by_key(|(s, _)| s.file_offset);
        let mut end = 0;
        for (s, _) in &all {
            if s.file_offset < end || s.file_offset.saturating_add(s.len) > total {
                return Err(Error::invalid(format!(
                    "segment at {} of {} bytes overlaps another or lies past the end ({total})",
                    s.file_offset, s.len
                )));
            }
            end = s.file_offset + s.len;
        }
        let part_size = part_size(total)?.max(1);
        let crcs = Crcs::new(total, part_size, ends.len());
        Ok(PartedImage {
            segs: all,
            _head: head,
            fields,
            ends,
            total,
            crcs,
        })
    }

    pub fn len(&self) -> u64 {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Fill `buf` (of part `idx`'s length) with the part's bytes (zeros where
    /// no segment is).
    pub fn fill(&self, idx: usize, buf: &mut [u8]) -> Result<()> {
        let r = self.fill_inner(idx, buf);
        if r.is_err() {
            self.crcs.failed();
        }
        r
    }

    fn fill_inner(&self, idx: usize, buf: &mut [u8]) -> Result<()> {
        let (start, end) = part_range(idx, self.crcs.part_size, self.total);
        check_part(idx, buf, start, end)?;
        buf.fill(0);
        let tracked = !self.fields.is_empty();
        let mut pieces = Vec::new();
        // SAFETY: the head is ours; the rest is memory readable per the
        // contract of `new`.
        unsafe {
            copy_range(&self.segs, start, u64::MAX, buf, |tag, at, src| {
                if let (true, Some(i)) = (tracked, tag) {
                    pieces.push((i, at, crc32fast::hash(src), src.len() as u64));
                }
            })?
        };
        self.crcs.copied(idx, pieces);
        put_fields(&self.fields, buf, start, end, |i, _| {
            self.crcs.crc_of(i, self.ends[i])
        })
    }
}

/// The byte range of part `idx` of an object of `total` bytes.
fn part_range(idx: usize, part_size: u64, total: u64) -> (u64, u64) {
    let start = idx as u64 * part_size;
    (start, (start + part_size).min(total))
}

/// An error where `buf` is not of part `idx`'s length.
fn check_part(idx: usize, buf: &[u8], start: u64, end: u64) -> Result<()> {
    if buf.len() as u64 != end - start {
        return Err(Error::invalid(format!(
            "part {idx}: {} bytes given for {}",
            buf.len(),
            end - start
        )));
    }
    Ok(())
}

/// Fills the CRC-32 fields of `fields` ((file offset, range), in file order)
/// that fall in the part `[start, end)` with `crc(range, field offset)`
/// (4 bytes, which may straddle two parts).
fn put_fields(
    fields: &[(u64, usize)],
    buf: &mut [u8],
    start: u64,
    end: u64,
    crc: impl Fn(usize, u64) -> Result<u32>,
) -> Result<()> {
    let first = fields.partition_point(|&(f, _)| f + 4 <= start);
    for &(field, i) in &fields[first..] {
        if field >= end {
            break;
        }
        put_clipped(buf, start, field, &crc(i, field)?.to_le_bytes());
    }
    Ok(())
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

    /// The parts of an archive, filled by `threads` threads taking them in
    /// order (as an upload does), joined.
    fn image(a: &PartedArchive, threads: usize) -> Vec<u8> {
        let ranges: Vec<(u64, u64)> = (0..a.parts()).map(|i| a.range(i)).collect();
        filled(&ranges, threads, |i, buf| a.fill(i, buf))
    }

    /// Parts of these byte ranges, filled by `threads` threads taking them in
    /// order, joined.
    fn filled(
        ranges: &[(u64, u64)],
        threads: usize,
        fill: impl Fn(usize, &mut [u8]) -> Result<()> + Sync,
    ) -> Vec<u8> {
        let bufs: Vec<Mutex<Vec<u8>>> = ranges
            .iter()
            .map(|(s, e)| Mutex::new(vec![9u8; (e - s) as usize]))
            .collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if i >= bufs.len() {
                        return;
                    }
                    fill(i, &mut lock(&bufs[i])).unwrap();
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
            let a = unsafe { PartedArchive::new(&es, |_| Ok(part)).unwrap() };
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
    fn device_memory_needs_the_driver() {
        if crate::gpu::cuda::driver().is_ok() {
            return; // a GPU host: the GPU tests cover device parts
        }
        let mut es = entries(&[vec![1u8; 8]]);
        if let Body::Memory { memory, .. } = &mut es[2].body {
            *memory = Memory::Cuda(0);
        }
        // SAFETY: no device memory is read: there is no driver.
        let a = unsafe { PartedArchive::new(&es, Ok) }.unwrap();
        let mut buf = vec![0u8; a.len() as usize];
        let e = a.fill(0, &mut buf).err().unwrap();
        assert!(e.to_string().to_lowercase().contains("cuda"), "{e}");
    }

    #[test]
    fn an_image_is_its_head_segments_and_crc_fields_in_any_part() {
        let a: Vec<u8> = (0..1000).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..333).map(|i| (i * 3) as u8).collect();
        let seg = |at: u64, v: &Vec<u8>| Segment {
            file_offset: at,
            addr: v.as_ptr() as u64,
            len: v.len() as u64,
            memory: Memory::Host,
        };
        let head = b"header!!".to_vec();
        let mut want = vec![0u8; 1800];
        want[..8].copy_from_slice(&head);
        want[8..1008].copy_from_slice(&a);
        want[1400..1733].copy_from_slice(&b);
        // CRC-32 fields after their ranges: `a`'s twice (one straddling parts), `b`'s once.
        let patches = [(1, 1010), (0, 1790), (1, 1200)];
        want[1010..1014].copy_from_slice(&crc32fast::hash(&a).to_le_bytes());
        want[1200..1204].copy_from_slice(&crc32fast::hash(&a).to_le_bytes());
        want[1790..1794].copy_from_slice(&crc32fast::hash(&b).to_le_bytes());
        for (part, threads) in [(1u64, 3), (7, 2), (100, 4), (1800, 1)] {
            let segs = vec![seg(1400, &b), seg(8, &a)];
            // SAFETY: `a` and `b` outlive the image.
            let img = unsafe { PartedImage::new(head.clone(), segs, 1800, &patches, |_| Ok(part)) }
                .unwrap();
            let ranges: Vec<(u64, u64)> = (0..1800usize.div_ceil(part as usize))
                .map(|i| part_range(i, part, 1800))
                .collect();
            let got = filled(&ranges, threads, |i, buf| img.fill(i, buf));
            assert_eq!(got, want, "part {part}");
        }
        let ok = |_| Ok(1800);
        // SAFETY: nothing is read: refused before.
        let overlap = unsafe { PartedImage::new(head.clone(), vec![seg(4, &a)], 1800, &[], ok) };
        assert!(overlap.is_err());
        // SAFETY: as above.
        let past = unsafe { PartedImage::new(head.clone(), vec![seg(1000, &a)], 1800, &[], ok) };
        assert!(past.err().unwrap().to_string().contains("past the end"));
        // SAFETY: as above.
        let before = unsafe { PartedImage::new(head, vec![seg(8, &a)], 1800, &[(0, 500)], ok) };
        assert!(before.err().unwrap().to_string().contains("not after it"));
    }
}
