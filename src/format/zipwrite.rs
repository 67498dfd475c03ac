//! Writes a torch.save archive (a zip of stored records) in one engine pass,
//! with an alignment of its own for each record.
//!
//! torch's writer (PyTorchStreamWriter over miniz) pads every record's data to
//! one alignment, `config.save.storage_alignment`, 64 bytes by default. ckptio
//! wants large storages on 4 KiB boundaries (O_DIRECT and GPUDirect Storage move
//! them in place) but small ones packed at 64 bytes, as torch packs them:
//! thousands of 4 KiB tensors each padded to 4 KiB would double the file. So
//! the archive is laid out here, byte for byte as miniz lays it out but for the
//! padding: local header (zeroed CRC-32 and sizes, flag 0x0808, a ZIP64 extra
//! field only where a size or offset needs one, then torch's `FB` padding
//! field), data, a 16- or 24-byte data descriptor, and at the end the central
//! directory, the ZIP64 end record and locator, the classic end record and
//! ckptio's comment ([`crate::format::integrity`]). [`crate::format::zipmap`]
//! reads it back; torch.load and `zipfile` read it as any torch.save file.
//!
//! Every byte before the central directory is a segment of one engine write:
//! the headers from one buffer held here, the records' data straight from
//! their memory. The engine stores each record's CRC-32 in its data descriptor
//! as the bytes pass (a [`Patch`]); the central directory, which needs all of
//! them, is written last.

use crate::engine::{Engine, Memory, Patch, Report, Request, Segment, TransferFile};
use crate::format::integrity;
use crate::io::fault::{self, Point};
use crate::{Error, Result};

const LH_SIG: u32 = 0x0403_4b50;
const CD_SIG: u32 = 0x0201_4b50;
const DD_SIG: u32 = 0x0807_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const LOCATOR_SIG: u32 = 0x0706_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
/// Sizes and offsets at or past this go in a ZIP64 extra field (miniz's rule).
const SAT32: u64 = 0xFFFF_FFFF;
/// Data descriptor present, names in UTF-8.
const FLAGS_DATA: u16 = 0x0808;
/// An empty record has no descriptor.
const FLAGS_EMPTY: u16 = 0x0800;

/// Where a record's bytes come from.
#[derive(Clone, Debug)]
pub enum Body {
    /// Small records (the pickle, version strings): held here, written with the headers.
    Bytes(Vec<u8>),
    /// A storage: `len` bytes at `addr` in host or device memory.
    Memory { addr: u64, len: u64, memory: Memory },
}

impl Body {
    fn len(&self) -> u64 {
        match self {
            Body::Bytes(b) => b.len() as u64,
            Body::Memory { len, .. } => *len,
        }
    }
}

/// One record to write: its full name (`archive/data/0`), bytes and the
/// alignment of its data (a power of two).
#[derive(Clone, Debug)]
pub struct Entry {
    pub name: String,
    pub body: Body,
    pub align: u64,
}

/// Where one record landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    pub header_offset: u64,
    pub data_offset: u64,
    pub size: u64,
    /// The record needed ZIP64 fields (a 24-byte descriptor, an extra field).
    zip64: bool,
}

/// The archive laid out: headers in one buffer, where every record goes.
#[derive(Debug)]
pub struct Layout {
    pub placed: Vec<Placed>,
    /// Local headers, padding and data descriptors, back to back; with
    /// `Body::Bytes` records' data too.
    heads: Vec<u8>,
    /// (file offset, range in `heads`) of each run of header bytes, in file order.
    runs: Vec<(u64, usize, usize)>,
    /// CRC-32 of each `Body::Bytes` record (None for memory records).
    inline_crc: Vec<Option<u32>>,
    /// Offset of the central directory: the length of everything before it.
    pub cd_offset: u64,
}

fn put16(v: &mut Vec<u8>, x: u16) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

/// miniz's ZIP64 extra field: the sizes when the size needs it, the header
/// offset when it does.
fn zip64_extra(size: u64, header_offset: u64) -> Vec<u8> {
    let (big_size, big_off) = (size >= SAT32, header_offset >= SAT32);
    let mut body = Vec::new();
    if big_size {
        put64(&mut body, size);
        put64(&mut body, size);
    }
    if big_off {
        put64(&mut body, header_offset);
    }
    if body.is_empty() {
        return body;
    }
    let mut v = Vec::with_capacity(4 + body.len());
    put16(&mut v, 1);
    put16(&mut v, body.len() as u16);
    v.extend_from_slice(&body);
    v
}

impl Layout {
    /// Lay out `entries` from file offset 0.
    pub fn new(entries: &[Entry]) -> Result<Layout> {
        let mut heads = Vec::new();
        let mut runs: Vec<(u64, usize, usize)> = Vec::new();
        let mut placed = Vec::with_capacity(entries.len());
        let mut inline_crc = Vec::with_capacity(entries.len());
        let mut pos = 0u64;
        // Header bytes from `start` in `heads` go at file offset `at`: one
        // run with the previous bytes when they follow them in the file.
        let emit = |runs: &mut Vec<(u64, usize, usize)>, heads: &Vec<u8>, start: usize, at: u64| {
            match runs.last_mut() {
                Some(r) if r.0 + (r.2 - r.1) as u64 == at && r.2 == start => r.2 = heads.len(),
                _ => runs.push((at, start, heads.len())),
            }
        };
        for e in entries {
            if !e.align.is_power_of_two() || e.align > 1 << 20 {
                return Err(Error::invalid(format!(
                    "record {:?}: alignment {} is not a power of two up to 1 MiB",
                    e.name, e.align
                )));
            }
            if e.name.is_empty() || e.name.len() > u16::MAX as usize || e.name.starts_with('/') {
                return Err(Error::invalid(format!("bad record name {:?}", e.name)));
            }
            let size = e.body.len();
            let header_offset = pos;
            let z64 = zip64_extra(size, header_offset);
            // torch's getPadding: data starts after the header, the name, the
            // ZIP64 field and the 4 bytes of the FB field's own header.
            let start = header_offset + 30 + e.name.len() as u64 + z64.len() as u64 + 4;
            let pad = start.next_multiple_of(e.align) - start;
            if pad > u64::from(u16::MAX) - z64.len() as u64 - 4 {
                return Err(Error::invalid(format!(
                    "record {:?}: alignment {} needs more padding than a zip header holds",
                    e.name, e.align
                )));
            }
            let first = heads.len();
            put32(&mut heads, LH_SIG);
            put16(&mut heads, 0); // version needed
            put16(&mut heads, if size > 0 { FLAGS_DATA } else { FLAGS_EMPTY });
            put16(&mut heads, 0); // stored
            put32(&mut heads, 0); // time, date
            heads.extend_from_slice(&[0u8; 12]); // CRC-32, sizes: in the descriptor
            put16(&mut heads, e.name.len() as u16);
            put16(&mut heads, (z64.len() as u64 + 4 + pad) as u16);
            heads.extend_from_slice(e.name.as_bytes());
            heads.extend_from_slice(&z64);
            heads.extend_from_slice(b"FB");
            put16(&mut heads, pad as u16);
            heads.resize(heads.len() + pad as usize, b'Z');
            let data_offset = start + pad;
            let crc = match &e.body {
                Body::Bytes(b) => {
                    heads.extend_from_slice(b);
                    Some(crc32fast::hash(b))
                }
                Body::Memory { .. } => None,
            };
            emit(&mut runs, &heads, first, header_offset);
            let data_end = data_offset
                .checked_add(size)
                .filter(|&e| e <= i64::MAX as u64)
                .ok_or_else(|| Error::invalid(format!("record {:?} overflows", e.name)))?;
            pos = data_end;
            if size > 0 {
                let first = heads.len();
                put32(&mut heads, DD_SIG);
                put32(&mut heads, crc.unwrap_or(0));
                if z64.is_empty() {
                    put32(&mut heads, size as u32);
                    put32(&mut heads, size as u32);
                } else {
                    put64(&mut heads, size);
                    put64(&mut heads, size);
                }
                pos += (heads.len() - first) as u64;
                emit(&mut runs, &heads, first, data_end);
            }
            placed.push(Placed {
                header_offset,
                data_offset,
                size,
                zip64: !z64.is_empty(),
            });
            inline_crc.push(crc);
        }
        Ok(Layout {
            placed,
            heads,
            runs,
            inline_crc,
            cd_offset: pos,
        })
    }

    /// The engine's segments for everything before the central directory
    /// (header runs from this layout, memory records from `entries`), the
    /// patches that store each memory record's CRC-32 in its descriptor, and
    /// the segment index of each memory record (None for the others).
    ///
    /// The header segments point into this layout: it must outlive the write.
    pub fn segments(&self, entries: &[Entry]) -> (Vec<Segment>, Vec<Patch>, Vec<Option<usize>>) {
        let mut segs: Vec<Segment> = self
            .runs
            .iter()
            .map(|&(at, a, b)| Segment {
                file_offset: at,
                addr: self.heads[a..b].as_ptr() as u64,
                len: (b - a) as u64,
                memory: Memory::Host,
            })
            .collect();
        let mut patches = Vec::new();
        let mut index = vec![None; entries.len()];
        for (i, (e, p)) in entries.iter().zip(&self.placed).enumerate() {
            if let Body::Memory { addr, len, memory } = e.body {
                if len == 0 {
                    continue;
                }
                index[i] = Some(segs.len());
                // The descriptor's CRC-32 field, right after the data.
                patches.push(Patch {
                    seg: segs.len(),
                    at: p.data_offset + len + 4,
                });
                segs.push(Segment {
                    file_offset: p.data_offset,
                    addr,
                    len,
                    memory,
                });
            }
        }
        (segs, patches, index)
    }

    /// The central directory, the ZIP64 end record and locator, the end record
    /// and `comment`: what follows the data, given each record's CRC-32.
    pub fn tail(&self, entries: &[Entry], crcs: &[u32], comment: &str) -> Result<Vec<u8>> {
        if comment.len() > u16::MAX as usize {
            return Err(Error::invalid("archive comment over 64 KiB"));
        }
        let mut v = Vec::new();
        for ((e, p), &crc) in entries.iter().zip(&self.placed).zip(crcs) {
            let z64 = if p.zip64 {
                zip64_extra(p.size, p.header_offset)
            } else {
                Vec::new()
            };
            put32(&mut v, CD_SIG);
            put16(&mut v, 0); // made by
            put16(&mut v, 0); // needed
            put16(&mut v, if p.size > 0 { FLAGS_DATA } else { FLAGS_EMPTY });
            put16(&mut v, 0); // stored
            put32(&mut v, 0); // time, date
            put32(&mut v, crc);
            put32(&mut v, p.size.min(SAT32) as u32);
            put32(&mut v, p.size.min(SAT32) as u32);
            put16(&mut v, e.name.len() as u16);
            put16(&mut v, z64.len() as u16);
            put16(&mut v, 0); // comment
            put16(&mut v, 0); // disk
            put16(&mut v, 0); // internal attributes
            put32(&mut v, 0); // external attributes
            put32(&mut v, p.header_offset.min(SAT32) as u32);
            v.extend_from_slice(e.name.as_bytes());
            v.extend_from_slice(&z64);
        }
        let n = entries.len() as u64;
        let cd_size = v.len() as u64;
        let z64_offset = self.cd_offset + cd_size;
        put32(&mut v, ZIP64_EOCD_SIG);
        put64(&mut v, 44);
        put16(&mut v, 0x031E); // made by
        put16(&mut v, 45); // needed
        put32(&mut v, 0); // disk
        put32(&mut v, 0); // central directory disk
        put64(&mut v, n);
        put64(&mut v, n);
        put64(&mut v, cd_size);
        put64(&mut v, self.cd_offset);
        put32(&mut v, LOCATOR_SIG);
        put32(&mut v, 0);
        put64(&mut v, z64_offset);
        put32(&mut v, 1);
        put32(&mut v, EOCD_SIG);
        put16(&mut v, 0);
        put16(&mut v, 0);
        put16(&mut v, n.min(0xFFFF) as u16);
        put16(&mut v, n.min(0xFFFF) as u16);
        put32(&mut v, cd_size.min(SAT32) as u32);
        put32(&mut v, self.cd_offset.min(SAT32) as u32);
        put16(&mut v, comment.len() as u16);
        v.extend_from_slice(comment.as_bytes());
        Ok(v)
    }

    /// The file's length with a comment of `comment_len` bytes.
    pub fn file_len(&self, entries: &[Entry], comment_len: usize) -> u64 {
        let cd: u64 = entries
            .iter()
            .zip(&self.placed)
            .map(|(e, p)| {
                let z = if p.zip64 {
                    zip64_extra(p.size, p.header_offset).len()
                } else {
                    0
                };
                46 + e.name.len() as u64 + z as u64
            })
            .sum();
        self.cd_offset + cd + 56 + 20 + 22 + comment_len as u64
    }
}

/// What [`write`] did: the transfer's report and each record's CRC-32 (None
/// where cuFile moved its bytes: stored as 0 and named in the comment).
#[derive(Debug)]
pub struct Written {
    pub report: Report,
    pub crc32: Vec<Option<u32>>,
}

/// Write `entries` as a torch.save archive into `file` (an empty temp file):
/// headers and data in one engine pass (device memory after the work queued
/// on `streams`), then the central directory with every CRC-32 and ckptio's
/// comment naming the data records whose bytes no host memory saw. `prefix`
/// is the archive's top folder (records `<prefix>/data/<key>` are the data
/// records).
///
/// # Safety
/// Each `Body::Memory` range must stay readable and unmodified for the call,
/// and `streams` be live CUstreams of their devices (see [`TransferFile::write`]).
pub unsafe fn write(
    engine: &Engine,
    file: &TransferFile,
    entries: &[Entry],
    prefix: &str,
    streams: &[(i32, u64)],
) -> Result<Written> {
    let layout = Layout::new(entries)?;
    let (segs, patches, index) = layout.segments(entries);
    let req = Request {
        checksum: true,
        streams,
        file_len: Some(layout.file_len(entries, integrity::COMMENT_TAG.len())),
        patches: &patches,
    };
    // SAFETY: header segments point into `layout`, alive for the call; memory
    // records are the caller's (contract above).
    let report = unsafe { file.write(engine, &segs, req)? };
    let crc32: Vec<Option<u32>> = index
        .iter()
        .zip(&layout.inline_crc)
        .map(|(seg, inline)| match seg {
            Some(s) => report.stats.crc32[*s],
            None => Some(inline.unwrap_or(0)),
        })
        .collect();
    let data_key = |name: &str| {
        name.strip_prefix(prefix)
            .and_then(|r| r.strip_prefix("/data/"))
            .map(str::to_owned)
    };
    let unchecked: Vec<String> = entries
        .iter()
        .zip(&crc32)
        .filter(|(_, c)| c.is_none())
        .map(|(e, _)| data_key(&e.name).unwrap_or_else(|| e.name.clone()))
        .collect();
    let data_records = entries
        .iter()
        .filter(|e| data_key(&e.name).is_some())
        .count();
    let refs: Vec<&str> = unchecked.iter().map(String::as_str).collect();
    let comment = integrity::comment_for(&refs, !refs.is_empty() && refs.len() == data_records);
    let crcs: Vec<u32> = crc32.iter().map(|c| c.unwrap_or(0)).collect();
    let tail = layout.tail(entries, &crcs, &comment)?;
    let io = file.io();
    fault::hit(Point::Crc, io.path())?;
    io.write_at(&tail, layout.cd_offset)?;
    let len = layout.cd_offset + tail.len() as u64;
    io.file()
        .set_len(len)
        .map_err(|e| Error::io_at("truncate", io.path(), e))?;
    Ok(Written { report, crc32 })
}

#[cfg(test)]
// Test buffers outlive every engine call that borrows their addresses.
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;
    use crate::format::zipmap;
    use crate::io::file::DirectMode;
    use std::os::unix::fs::FileExt;

    fn engine() -> Engine {
        Engine::new(EngineConfig {
            threads: 3,
            memory_threads: 3,
            chunk_size: 16 << 10,
            memory_chunk_size: 16 << 10,
            ..Default::default()
        })
        .unwrap()
    }

    fn mem(b: &[u8]) -> Body {
        Body::Memory {
            addr: b.as_ptr() as u64,
            len: b.len() as u64,
            memory: Memory::Host,
        }
    }

    fn entry(name: &str, body: Body, align: u64) -> Entry {
        Entry {
            name: name.into(),
            body,
            align,
        }
    }

    #[test]
    fn records_land_at_their_alignment_with_their_crcs() {
        let d = tempfile::tempdir().unwrap();
        let small: Vec<Vec<u8>> = (0..300).map(|i| vec![i as u8; 1 + i * 13 % 900]).collect();
        let big: Vec<u8> = (0..200_000).map(|i| (i % 253) as u8).collect();
        let mut entries = vec![
            entry("archive/data.pkl", Body::Bytes(vec![0x80; 333]), 64),
            entry("archive/byteorder", Body::Bytes(b"little".to_vec()), 64),
        ];
        for (k, s) in small.iter().enumerate() {
            entries.push(entry(&format!("archive/data/{k}"), mem(s), 64));
        }
        entries.push(entry("archive/data/300", mem(&big), 4096));
        entries.push(entry("archive/data/301", mem(&[]), 64));
        entries.push(entry("archive/version", Body::Bytes(b"3\n".to_vec()), 64));
        for mode in [DirectMode::Auto, DirectMode::Off] {
            let path = d.path().join(format!("a{mode:?}"));
            let io = crate::io::file::scratch(&path, mode);
            let tf = TransferFile::new(io, crate::gpu::Backend::Auto);
            let w = unsafe { write(&engine(), &tf, &entries, "archive", &[]) }.unwrap();
            let io = tf.io();
            let bytes = std::fs::read(&path).unwrap();
            // One I/O per 16 KiB of the grid, not one per record.
            let grid = bytes.len().div_ceil(16 << 10);
            assert!(
                w.report.stats.chunks <= grid,
                "{} I/Os",
                w.report.stats.chunks
            );
            let a = zipmap::map_bytes(&bytes).unwrap();
            assert_eq!(a.comment, integrity::COMMENT_TAG.as_bytes());
            assert_eq!(a.records.len(), entries.len());
            for (r, e) in a.records.iter().zip(&entries) {
                assert_eq!(r.name, e.name);
                assert_eq!(r.data_offset % e.align, 0, "{}", r.name);
                let data = &bytes[r.data_offset as usize..(r.data_offset + r.size) as usize];
                let want: &[u8] = match &e.body {
                    Body::Bytes(b) => b,
                    Body::Memory { addr, len, .. } => unsafe {
                        std::slice::from_raw_parts(*addr as *const u8, *len as usize)
                    },
                };
                assert_eq!(data, want, "{}", r.name);
                assert_eq!(r.crc32, crc32fast::hash(want), "{}", r.name);
                if r.size > 0 {
                    // The data descriptor after the data holds the same CRC-32.
                    let dd = r.data_offset as usize + r.size as usize;
                    assert_eq!(&bytes[dd..dd + 4], &DD_SIG.to_le_bytes());
                    assert_eq!(&bytes[dd + 4..dd + 8], &r.crc32.to_le_bytes());
                }
            }
            // Packed: small records sit next to each other, not 4 KiB apart.
            let r0 = a.storage("0").unwrap();
            let r1 = a.storage("1").unwrap();
            assert!(r1.data_offset - r0.data_offset <= 128, "{r0:?} {r1:?}");
            let checks = integrity::check(&engine(), io, &a, None).unwrap();
            assert!(
                checks.iter().all(|(_, s)| *s == integrity::State::Ok),
                "{checks:?}"
            );
        }
    }

    #[test]
    fn zip64_fields_where_sizes_and_offsets_need_them() {
        // A 5 GiB record (never written: a hole), then small ones past 4 GiB.
        let entries = vec![
            entry("a/data.pkl", Body::Bytes(vec![1; 10]), 64),
            entry(
                "a/data/0",
                Body::Memory {
                    addr: 1,
                    len: 5 << 30,
                    memory: Memory::Host,
                },
                4096,
            ),
            entry(
                "a/data/1",
                Body::Memory {
                    addr: 1,
                    len: 100,
                    memory: Memory::Host,
                },
                64,
            ),
            entry("a/version", Body::Bytes(b"3\n".to_vec()), 64),
        ];
        let l = Layout::new(&entries).unwrap();
        assert!(l.placed[1].zip64 && l.placed[2].zip64 && l.placed[3].zip64);
        assert!(!l.placed[0].zip64);
        let f = tempfile::tempfile().unwrap();
        for &(at, a, b) in &l.runs {
            f.write_all_at(&l.heads[a..b], at).unwrap();
        }
        let tail = l.tail(&entries, &[7, 8, 9, 10], "ckptio:crc32").unwrap();
        f.write_all_at(&tail, l.cd_offset).unwrap();
        assert_eq!(l.file_len(&entries, 12), l.cd_offset + tail.len() as u64);
        let a = zipmap::map_file(&f, None).unwrap();
        for (r, p) in a.records.iter().zip(&l.placed) {
            assert_eq!(
                (r.header_offset, r.data_offset, r.size),
                (p.header_offset, p.data_offset, p.size)
            );
        }
        assert_eq!(a.records[2].crc32, 9);
        assert_eq!(a.records[1].data_offset % 4096, 0);
        // 24-byte descriptors after records that needed ZIP64 fields.
        assert_eq!(
            a.records[3].header_offset,
            a.records[2].data_offset + 100 + 24
        );
    }

    #[test]
    fn bad_entries_are_refused() {
        for (e, needle) in [
            (entry("x", Body::Bytes(vec![]), 3), "power of two"),
            (entry("", Body::Bytes(vec![]), 64), "bad record name"),
            (entry("/x", Body::Bytes(vec![]), 64), "bad record name"),
            (entry("x", Body::Bytes(vec![]), 1 << 21), "power of two"),
        ] {
            match Layout::new(&[e]) {
                Err(Error::InvalidArgument(m)) => assert!(m.contains(needle), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    }
}
