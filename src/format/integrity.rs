//! Checksums of checkpoint records: the zip CRC-32 fields of files ckptio
//! writes, and checking any archive's records against them.
//!
//! torch.save under `skip_data` leaves the CRC-32 of every data record at 0
//! (it never saw the bytes). After the engine has written the data it knows
//! each record's CRC-32 (computed by the I/O threads as the bytes passed
//! through host memory); [`fill_crcs`] writes them into the record's central
//! directory entry and its data descriptor, so `zipfile` and `unzip -t` check
//! the file. Records whose bytes never touched host memory (cuFile) keep 0
//! and are listed in the archive comment, which torch and zip tools ignore:
//!
//! ```text
//! ckptio:crc32                      every CRC-32 field is real (0 included)
//! ckptio:crc32 unchecked=3,5-9      ... except data records 3, 5, 6, 7, 8, 9
//! ckptio:crc32 unchecked=*          ... except every data record
//! ```
//!
//! Keys are the storage keys of `<prefix>/data/<key>`. In an archive without
//! this comment (plain torch.save, other writers) a CRC-32 of 0 is taken as
//! "not computed" (torch with `compute_crc32` off, or `skip_data`).

use std::collections::HashSet;
use std::io;
use std::os::unix::fs::FileExt;

use std::collections::HashMap;
use std::path::Path;

use crate::engine::{Engine, Memory, Report, Request, Segment, TransferFile};
use crate::format::zipmap::{self, Archive, Record};
use crate::io::fault::{self, Point};
use crate::io::file::IoFile;
use crate::{Error, Result};

/// The comment ckptio puts on archives whose CRC-32 fields it filled.
pub const COMMENT_TAG: &str = "ckptio:crc32";
const UNCHECKED: &str = " unchecked=";
const DESCRIPTOR_SIG: u32 = 0x0807_4b50;
/// Longest comment a zip end record can carry.
const MAX_COMMENT: usize = u16::MAX as usize;

/// What a record's stored CRC-32 is worth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Declared {
    /// A real CRC-32 of the record's bytes.
    Crc(u32),
    /// None was computed (cuFile-written, or a writer that left 0).
    Unchecked,
}

/// The outcome of checking one record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Ok,
    Mismatch { stored: u32, actual: u32 },
    Unchecked,
}

impl State {
    pub fn name(self) -> &'static str {
        match self {
            State::Ok => "ok",
            State::Mismatch { .. } => "mismatch",
            State::Unchecked => "unchecked",
        }
    }
}

/// The storage key of a data record (`<prefix>/data/<key>`).
fn data_key<'a>(a: &Archive, r: &'a Record) -> Option<&'a str> {
    r.name
        .strip_prefix(a.prefix())
        .and_then(|rest| rest.strip_prefix("/data/"))
}

/// What each record's stored CRC-32 is worth, in record order.
pub fn declared(a: &Archive) -> Vec<Declared> {
    let comment = std::str::from_utf8(&a.comment).unwrap_or("");
    let Some(rest) = comment.strip_prefix(COMMENT_TAG) else {
        return a
            .records
            .iter()
            // 0 is what a writer that computed none leaves (cuFile's records),
            // and the true CRC-32 of an empty record: that one is checked.
            .map(|r| match r.crc32 {
                0 if r.size > 0 => Declared::Unchecked,
                c => Declared::Crc(c),
            })
            .collect();
    };
    let list = rest.strip_prefix(UNCHECKED).unwrap_or("");
    let all = list == "*";
    let keys = KeyList::parse(list);
    a.records
        .iter()
        .map(|r| match data_key(a, r) {
            Some(k) if all || keys.contains(k) => Declared::Unchecked,
            _ => Declared::Crc(r.crc32),
        })
        .collect()
}

/// The storage keys a comment's list names ("3,5-9,x"): ranges of numbered
/// keys kept as ranges, not spelled out (spelled out, 22 bytes of a hostile
/// comment made 100 MB of keys), and the other keys as they are.
struct KeyList {
    /// Sorted by start.
    ranges: Vec<(u64, u64)>,
    literal: HashSet<String>,
}

impl KeyList {
    fn parse(list: &str) -> KeyList {
        let mut ranges = Vec::new();
        let mut literal = HashSet::new();
        for item in list.split(',').filter(|s| !s.is_empty()) {
            match item
                .split_once('-')
                .map(|(a, b)| (a.parse::<u64>(), b.parse::<u64>()))
            {
                Some((Ok(a), Ok(b))) if a <= b => ranges.push((a, b)),
                _ => {
                    literal.insert(item.to_owned());
                }
            }
        }
        ranges.sort_unstable();
        KeyList { ranges, literal }
    }

    /// Whether `key` is named: as it is, or as a number (written as torch
    /// writes keys: no sign, no leading zero) inside a range.
    fn contains(&self, key: &str) -> bool {
        if self.literal.contains(key) {
            return true;
        }
        let Ok(n) = key.parse::<u64>() else {
            return false;
        };
        if n.to_string() != key {
            return false;
        }
        // Ranges starting at or before n; any of them may reach it.
        let upto = self.ranges.partition_point(|&(a, _)| a <= n);
        self.ranges[..upto].iter().rev().any(|&(_, b)| b >= n)
    }
}

/// The comment for an archive whose records `unchecked` (storage keys) have no CRC-32.
pub fn comment_for(unchecked: &[&str], all_data: bool) -> String {
    if unchecked.is_empty() {
        return COMMENT_TAG.to_owned();
    }
    if all_data {
        return format!("{COMMENT_TAG}{UNCHECKED}*");
    }
    let mut nums: Vec<u64> = Vec::new();
    let mut items: Vec<String> = Vec::new();
    for k in unchecked {
        match k.parse::<u64>() {
            Ok(n) if n.to_string() == *k => nums.push(n),
            _ => items.push((*k).to_owned()),
        }
    }
    // Keys the list cannot spell (torch's keys are plain numbers).
    let odd = items
        .iter()
        .any(|k| k.is_empty() || k.contains([',', ' ', '-', '*']));
    nums.sort_unstable();
    nums.dedup();
    let mut i = 0;
    while i < nums.len() {
        let mut j = i;
        while j + 1 < nums.len() && nums[j + 1] == nums[j] + 1 {
            j += 1;
        }
        items.push(if j > i {
            format!("{}-{}", nums[i], nums[j])
        } else {
            nums[i].to_string()
        });
        i = j + 1;
    }
    let s = format!("{COMMENT_TAG}{UNCHECKED}{}", items.join(","));
    if s.len() > MAX_COMMENT || odd {
        // Too long, or odd keys: every data record is unchecked.
        format!("{COMMENT_TAG}{UNCHECKED}*")
    } else {
        s
    }
}

/// Write the CRC-32 of each data record `(record index, crc or None)` into its
/// central directory entry and its data descriptor, and the archive comment
/// naming the data records without one: those given None here, and those not
/// given here that have none yet (so storages may be written in several calls).
/// The archive is a torch.save (skip_data) file, without a comment or with one
/// of ours.
pub fn fill_crcs(io: &IoFile, a: &Archive, crcs: &[(usize, Option<u32>)]) -> Result<()> {
    let path = io.path();
    fault::hit(Point::Crc, path)?;
    let f = io.file();
    let bad =
        |r: &Record, why: String| Error::format(Some(path), format!("record {:?}: {why}", r.name));
    let write = |bytes: &[u8], at: u64| {
        f.write_all_at(bytes, at)
            .map_err(|e| Error::io_at("write CRC-32 of", path, e))
    };
    if !a.comment.is_empty() && !a.comment.starts_with(COMMENT_TAG.as_bytes()) {
        return Err(Error::format(
            Some(path),
            "the archive already has a comment; ckptio writes its own",
        ));
    }
    let given: HashSet<usize> = crcs.iter().map(|c| c.0).collect();
    let mut unchecked: Vec<&str> = declared(a)
        .iter()
        .enumerate()
        .filter(|&(i, d)| *d == Declared::Unchecked && !given.contains(&i))
        .filter_map(|(i, _)| data_key(a, &a.records[i]))
        .collect();
    for &(i, crc) in crcs {
        let r = a
            .records
            .get(i)
            .ok_or_else(|| Error::invalid(format!("no record #{i}")))?;
        let Some(crc) = crc else {
            unchecked.push(data_key(a, r).unwrap_or(&r.name));
            continue;
        };
        if r.size == 0 {
            // CRC-32 of nothing is 0, already there (and torch writes no descriptor).
            continue;
        }
        // The data descriptor torch writes right after the data: signature,
        // CRC-32, then both sizes in 4 bytes (16 in all) or 8 (zip64, 24).
        let end = r.data_offset + r.size;
        let mut d = [0u8; 24];
        let n = read_upto(f, &mut d, end).map_err(|e| Error::io_at("pread", path, e))?;
        let le32 = |at: usize| u32::from_le_bytes([d[at], d[at + 1], d[at + 2], d[at + 3]]);
        let le64 = |at: usize| u64::from_le_bytes(d[at..at + 8].try_into().unwrap_or([0; 8]));
        let sized = (n >= 16 && u64::from(le32(8)) == r.size && u64::from(le32(12)) == r.size)
            || (n == 24 && le64(8) == r.size && le64(16) == r.size);
        if n < 16 || le32(0) != DESCRIPTOR_SIG || !sized {
            return Err(bad(r, format!("no data descriptor at offset {end}")));
        }
        write(&crc.to_le_bytes(), end + 4)?;
        write(&crc.to_le_bytes(), r.cd_entry_offset + 16)?;
    }
    let data_records = a
        .records
        .iter()
        .filter(|r| data_key(a, r).is_some())
        .count();
    let comment = comment_for(&unchecked, unchecked.len() == data_records);
    let at = a.eocd_offset + 22;
    write(comment.as_bytes(), at)?;
    write(&(comment.len() as u16).to_le_bytes(), a.eocd_offset + 20)?;
    // The end record was the file's tail: the comment is the new one.
    f.set_len(at + comment.len() as u64)
        .map_err(|e| Error::io_at("truncate", path, e))
}

fn read_upto(f: &std::fs::File, buf: &mut [u8], off: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The error for a record whose bytes do not match its CRC-32.
pub fn mismatch_error(path: &Path, name: &str, stored: u32, actual: u32) -> Error {
    Error::format(
        Some(path),
        format!(
            "record {name:?} is corrupt: its bytes have CRC-32 {actual:#010x}, \
             the archive stores {stored:#010x}"
        ),
    )
}

/// Compare computed CRC-32s (None: bytes not seen by the host) against what
/// the archive declares for those records.
pub fn judge(declared: Declared, actual: Option<u32>) -> State {
    match (declared, actual) {
        (Declared::Crc(stored), Some(actual)) if stored != actual => {
            State::Mismatch { stored, actual }
        }
        (Declared::Crc(_), Some(_)) => State::Ok,
        _ => State::Unchecked,
    }
}

/// Which records a verified read checked, by name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Whole records whose bytes match their stored CRC-32.
    pub verified: Vec<String>,
    /// Whole records read that have no usable CRC-32, or whose bytes the host
    /// never saw (cuFile).
    pub unchecked: Vec<String>,
}

/// Each segment's file range must lie inside one record of the archive: a
/// format error naming the bytes otherwise. O(log n) per segment.
pub fn check_inside_records(a: &Archive, path: &Path, segments: &[Segment]) -> Result<()> {
    // Records by data offset, each with the largest end among it and those
    // before it: a range starting at `off` lies inside one record exactly
    // when some record starting at or before `off` ends at or after its end.
    let mut spans: Vec<(u64, u64)> = a
        .records
        .iter()
        .map(|r| (r.data_offset, r.data_offset.saturating_add(r.size)))
        .collect();
    spans.sort_unstable();
    let mut reach = 0;
    for s in &mut spans {
        reach = reach.max(s.1);
        s.1 = reach;
    }
    for s in segments {
        let n = spans.partition_point(|sp| sp.0 <= s.file_offset);
        let inside = n > 0
            && s.file_offset
                .checked_add(s.len)
                .is_some_and(|end| end <= spans[n - 1].1);
        if !inside {
            return Err(Error::format(
                Some(path),
                format!(
                    "bytes {}..{} are not inside one record of the archive",
                    s.file_offset,
                    s.file_offset.saturating_add(s.len)
                ),
            ));
        }
    }
    Ok(())
}

/// Judge the CRC-32s of a read (`crc32[i]` for `segments[i]`) against the
/// archive: segments covering a whole record are compared with its stored
/// CRC-32 (a mismatch is a format error naming the record); partial reads are
/// not judged.
pub fn judge_reads(
    a: &Archive,
    path: &Path,
    segments: &[Segment],
    crc32: &[Option<u32>],
) -> Result<Verdict> {
    let decl = declared(a);
    let by_offset: HashMap<u64, usize> = a
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| (r.data_offset, i))
        .collect();
    let mut v = Verdict::default();
    for (s, crc) in segments.iter().zip(crc32) {
        let whole = by_offset
            .get(&s.file_offset)
            .filter(|&&i| a.records[i].size == s.len);
        let Some(&i) = whole else { continue };
        let name = &a.records[i].name;
        match judge(decl[i], *crc) {
            State::Mismatch { stored, actual } => {
                return Err(mismatch_error(path, name, stored, actual))
            }
            State::Ok => v.verified.push(name.clone()),
            State::Unchecked => v.unchecked.push(name.clone()),
        }
    }
    Ok(v)
}

/// Read ranges of an archive's records into memory, each inside one record;
/// with `verify`, the CRC-32 of the bytes read for each whole record is
/// compared with the stored one ([`judge_reads`]).
///
/// # Safety
/// As for [`TransferFile::read`].
pub unsafe fn read_records(
    engine: &Engine,
    file: &TransferFile,
    a: &Archive,
    segments: &[Segment],
    verify: bool,
    streams: &[(i32, u64)],
) -> Result<(Report, Verdict)> {
    let path = file.io().path();
    check_inside_records(a, path, segments)?;
    let req = Request {
        checksum: verify,
        streams,
        ..Request::default()
    };
    // SAFETY: forwarded from the caller's contract.
    let rep = unsafe { file.read(engine, segments, req)? };
    let verdict = if verify {
        judge_reads(a, path, segments, &rep.stats.crc32)?
    } else {
        Verdict::default()
    };
    Ok((rep, verdict))
}

/// One storage to write: its pickle key and its memory.
#[derive(Clone, Debug)]
pub struct Storage {
    pub key: String,
    pub addr: u64,
    pub len: u64,
    pub memory: Memory,
}

/// The segments that put each storage into its record `<prefix>/data/<key>`
/// (sizes checked), and each one's record index.
pub fn storage_segments(
    a: &Archive,
    path: &Path,
    storages: &[Storage],
) -> Result<(Vec<Segment>, Vec<usize>)> {
    let mut segs = Vec::with_capacity(storages.len());
    let mut index = Vec::with_capacity(storages.len());
    for st in storages {
        let i = a.storage_index(&st.key).ok_or_else(|| {
            Error::format(Some(path), format!("no record for storage {}", st.key))
        })?;
        let r = &a.records[i];
        if r.size != st.len {
            return Err(Error::format(
                Some(path),
                format!(
                    "record {} holds {} bytes, storage {} has {}",
                    r.name, r.size, st.key, st.len
                ),
            ));
        }
        index.push(i);
        segs.push(Segment {
            file_offset: r.data_offset,
            addr: st.addr,
            len: st.len,
            memory: st.memory,
        });
    }
    Ok((segs, index))
}

/// Write each storage's bytes into its record of the torch.save archive in
/// `file` (written by torch.save under `skip_data`), then the records'
/// CRC-32s (computed as the bytes pass through host memory; records written
/// by cuFile are listed as unchecked in the archive comment).
///
/// # Safety
/// As for [`TransferFile::write`].
pub unsafe fn write_storages(
    engine: &Engine,
    file: &TransferFile,
    storages: &[Storage],
    streams: &[(i32, u64)],
) -> Result<Report> {
    let io = file.io();
    let a = zipmap::map_file(io.file(), Some(io.path()))?;
    let (segs, index) = storage_segments(&a, io.path(), storages)?;
    let req = Request {
        checksum: true,
        streams,
        file_len: Some(a.file_len),
        ..Request::default()
    };
    // SAFETY: forwarded from the caller's contract.
    let rep = unsafe { file.write(engine, &segs, req)? };
    // Data records not written yet stay listed as unchecked (fill_crcs).
    let crcs: Vec<(usize, Option<u32>)> = index
        .into_iter()
        .zip(rep.stats.crc32.iter().copied())
        .collect();
    fill_crcs(io, &a, &crcs)?;
    Ok(rep)
}

/// Check the records `which` (indexes; all when None): read their bytes in
/// parallel through the engine and compare with the stored CRC-32s. Records
/// without a usable CRC-32 are not read.
pub fn check(
    engine: &Engine,
    io: &IoFile,
    a: &Archive,
    which: Option<&[usize]>,
) -> Result<Vec<(usize, State)>> {
    let decl = declared(a);
    let all: Vec<usize> = (0..a.records.len()).collect();
    let which = which.unwrap_or(&all);
    let mut out = Vec::with_capacity(which.len());
    let mut to_read = Vec::new();
    for &i in which {
        let r = a
            .records
            .get(i)
            .ok_or_else(|| Error::invalid(format!("no record #{i}")))?;
        match decl[i] {
            Declared::Crc(_) => to_read.push((i, (r.data_offset, r.size))),
            Declared::Unchecked => out.push((i, State::Unchecked)),
        }
    }
    let ranges: Vec<(u64, u64)> = to_read.iter().map(|x| x.1).collect();
    let st = engine.checksum(io, &ranges)?;
    for ((i, _), crc) in to_read.iter().zip(st.crc32) {
        out.push((*i, judge(decl[*i], crc)));
    }
    out.sort_unstable_by_key(|x| x.0);
    Ok(out)
}

/// Each record of an archive held in memory judged against the CRC-32 it
/// declares: (record, its state, the CRC-32 its header declares).
///
/// # Errors
/// [`Error::Format`] naming `path` where the bytes are no zip of stored records.
pub fn judge_bytes(bytes: &[u8], path: &Path) -> Result<Vec<(String, State, u32)>> {
    let a = zipmap::map_bytes(bytes).map_err(|e| e.with_path(path))?;
    let mut out = Vec::with_capacity(a.records.len());
    for (r, d) in a.records.iter().zip(declared(&a)) {
        if d == Declared::Unchecked {
            out.push((r.name.clone(), State::Unchecked, r.crc32));
            continue;
        }
        // map_bytes keeps every record inside the bytes; refused all the same otherwise.
        let data = usize::try_from(r.data_offset)
            .ok()
            .zip(usize::try_from(r.size).ok())
            .and_then(|(at, n)| bytes.get(at..at.checked_add(n)?))
            .ok_or_else(|| {
                Error::format(
                    Some(path),
                    format!("record {:?} runs past the archive's end", r.name),
                )
            })?;
        out.push((
            r.name.clone(),
            judge(d, Some(crc32fast::hash(data))),
            r.crc32,
        ));
    }
    Ok(out)
}

/// Check every record of a zip archive held in memory (a DCP non-tensor
/// value fetched from an object store: a small torch.save archive) against
/// the CRC-32 it declares ([`declared`]; one the archive says it did not
/// compute is not judged). `path` names where the bytes came from in errors:
/// a format error naming it and the record on a mismatch, or naming it where
/// the bytes are no zip archive of stored records inside them ([`zipmap::map_bytes`]).
pub fn check_bytes(bytes: &[u8], path: &Path) -> Result<Verdict> {
    let mut v = Verdict::default();
    for (name, state, _) in judge_bytes(bytes, path)? {
        match state {
            State::Mismatch { stored, actual } => {
                return Err(mismatch_error(path, &name, stored, actual))
            }
            State::Ok => v.verified.push(name),
            State::Unchecked => v.unchecked.push(name),
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arch(names: &[(&str, u32)], comment: &str) -> Archive {
        Archive {
            records: names
                .iter()
                .map(|&(n, crc)| Record {
                    name: n.into(),
                    header_offset: 0,
                    data_offset: 0,
                    size: 1,
                    crc32: crc,
                    cd_entry_offset: 0,
                })
                .collect(),
            comment: comment.as_bytes().to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn comments_round_trip() {
        assert_eq!(comment_for(&[], false), "ckptio:crc32");
        assert_eq!(
            comment_for(&["3", "5", "6", "7", "9", "8", "11"], false),
            "ckptio:crc32 unchecked=3,5-9,11"
        );
        assert_eq!(comment_for(&["1"], true), "ckptio:crc32 unchecked=*");
        assert_eq!(comment_for(&["a,b"], false), "ckptio:crc32 unchecked=*");
        let many: Vec<String> = (0..40_000).map(|i| (i * 2).to_string()).collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(comment_for(&refs, false), "ckptio:crc32 unchecked=*");
    }

    #[test]
    fn declared_follows_the_comment() {
        let recs = [
            ("m/data.pkl", 7),
            ("m/data/0", 0),
            ("m/data/1", 0),
            ("m/data/2", 5),
        ];
        // Foreign archive: 0 means not computed.
        let d = declared(&arch(&recs, ""));
        assert_eq!(
            d,
            [
                Declared::Crc(7),
                Declared::Unchecked,
                Declared::Unchecked,
                Declared::Crc(5)
            ]
        );
        // ...but for an empty record, whose CRC-32 is 0.
        let mut empty = arch(&recs, "");
        empty.records[1].size = 0;
        assert_eq!(declared(&empty)[1], Declared::Crc(0));
        // ckptio archive: 0 is a real value unless listed.
        let d = declared(&arch(&recs, "ckptio:crc32 unchecked=1"));
        assert_eq!(
            d,
            [
                Declared::Crc(7),
                Declared::Crc(0),
                Declared::Unchecked,
                Declared::Crc(5)
            ]
        );
        let d = declared(&arch(&recs, "ckptio:crc32 unchecked=*"));
        assert_eq!(d[0], Declared::Crc(7));
        assert!(d[1..].iter().all(|x| *x == Declared::Unchecked));
        // Ranges are kept as ranges: a hostile one allocates nothing, and
        // names what it spans (keys as torch writes them: no leading zero).
        let d = declared(&arch(&recs, "ckptio:crc32 unchecked=0-99999999999"));
        assert!(d[1..].iter().all(|x| *x == Declared::Unchecked));
        let recs = [("m/data/01", 0), ("m/data/7", 0), ("m/data/x-1", 0)];
        let d = declared(&arch(&recs, "ckptio:crc32 unchecked=0-5,x-1"));
        assert_eq!(d, [Declared::Crc(0), Declared::Crc(0), Declared::Unchecked]);
        // A 64 KiB comment of 2^20-key ranges (spelled out: some 300 GB).
        let list: Vec<String> = (0..2900u64)
            .map(|i| {
                format!(
                    "{}-{}",
                    1_000_000_000 + (i << 20),
                    1_000_000_000 + (i << 20) + (1 << 20) - 1
                )
            })
            .collect();
        let comment = format!("ckptio:crc32 unchecked={}", list.join(","));
        let recs = [("m/data/1000000005", 0), ("m/data/5", 0)];
        let t = std::time::Instant::now();
        let d = declared(&arch(&recs, &comment));
        assert!(t.elapsed() < std::time::Duration::from_secs(2));
        assert_eq!(d, [Declared::Unchecked, Declared::Crc(0)]);
    }

    #[test]
    fn judge_states() {
        assert_eq!(judge(Declared::Crc(1), Some(1)), State::Ok);
        assert_eq!(
            judge(Declared::Crc(1), Some(2)),
            State::Mismatch {
                stored: 1,
                actual: 2
            }
        );
        assert_eq!(judge(Declared::Crc(1), None), State::Unchecked);
        assert_eq!(judge(Declared::Unchecked, Some(2)), State::Unchecked);
    }

    fn placed(recs: &[(&str, u64, u64, u32)], comment: &str) -> Archive {
        Archive {
            records: recs
                .iter()
                .map(|&(n, off, size, crc)| Record {
                    name: n.into(),
                    header_offset: 0,
                    data_offset: off,
                    size,
                    crc32: crc,
                    cd_entry_offset: 0,
                })
                .collect(),
            comment: comment.as_bytes().to_vec(),
            ..Default::default()
        }
    }

    fn seg(file_offset: u64, len: u64) -> Segment {
        Segment {
            file_offset,
            addr: 1,
            len,
            memory: Memory::Host,
        }
    }

    #[test]
    fn reads_must_stay_inside_one_record() {
        // Records out of file order, as a central directory may list them.
        let a = placed(
            &[
                ("m/data/1", 8192, 100, 0),
                ("m/data.pkl", 64, 500, 0),
                ("m/data/0", 4096, 4000, 0),
                ("m/data/2", 8292, 0, 0),
            ],
            "",
        );
        let p = Path::new("x.pt");
        let ok = [
            seg(4096, 4000),
            seg(5000, 10),
            seg(8192, 100),
            seg(8200, 92),
            seg(64, 1),
            seg(8292, 0),
        ];
        check_inside_records(&a, p, &ok).unwrap();
        for bad in [
            seg(4096, 4001),     // past its record's end
            seg(4000, 200),      // starts between records
            seg(8096, 200),      // spans two records
            seg(0, 10),          // before the first
            seg(9000, 1),        // after the last
            seg(8192, u64::MAX), // overflows
        ] {
            let e = check_inside_records(&a, p, &[bad]).unwrap_err();
            assert!(e.to_string().contains("not inside one record"), "{e}");
        }
    }

    #[test]
    fn whole_records_read_are_judged_partial_ones_not() {
        let a = placed(
            &[
                ("m/data.pkl", 64, 10, 7),
                ("m/data/0", 4096, 100, 0x1111),
                ("m/data/1", 8192, 50, 0),
            ],
            "ckptio:crc32 unchecked=1",
        );
        let p = Path::new("x.pt");
        let segs = [seg(4096, 100), seg(8192, 50), seg(64, 5)];
        let v = judge_reads(&a, p, &segs, &[Some(0x1111), Some(3), Some(9)]).unwrap();
        assert_eq!(v.verified, ["m/data/0"]);
        assert_eq!(v.unchecked, ["m/data/1"]);
        // cuFile read it: no value, unchecked.
        let v = judge_reads(&a, p, &segs[..1], &[None]).unwrap();
        assert_eq!((v.verified.len(), v.unchecked.len()), (0, 1));
        let e = judge_reads(&a, p, &segs[..1], &[Some(0x2222)]).unwrap_err();
        assert!(e.to_string().contains("\"m/data/0\" is corrupt"), "{e}");
    }

    #[test]
    fn storages_map_to_their_records_with_sizes_checked() {
        let a = placed(
            &[
                ("m/data.pkl", 64, 10, 0),
                ("m/.format_version", 100, 1, 0),
                ("m/.storage_alignment", 200, 2, 0),
                ("m/byteorder", 300, 6, 0),
                ("m/data/0", 4096, 100, 0),
                ("m/data/1", 8192, 50, 0),
            ],
            "",
        );
        let p = Path::new("x.pt");
        let st = |key: &str, len| Storage {
            key: key.into(),
            addr: 7,
            len,
            memory: Memory::Cuda(0),
        };
        let (segs, index) = storage_segments(&a, p, &[st("1", 50), st("0", 100)]).unwrap();
        assert_eq!(index, [5, 4]);
        assert_eq!(
            (segs[0].file_offset, segs[0].len, segs[0].memory),
            (8192, 50, Memory::Cuda(0))
        );
        let e = storage_segments(&a, p, &[st("0", 99)]).unwrap_err();
        assert!(
            e.to_string().contains("holds 100 bytes, storage 0 has 99"),
            "{e}"
        );
        let e = storage_segments(&a, p, &[st("9", 1)]).unwrap_err();
        assert!(e.to_string().contains("no record for storage 9"), "{e}");
    }

    fn fixture(name: &str) -> Vec<u8> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
        std::fs::read(Path::new(dir).join(name)).unwrap()
    }

    /// `bytes` with the archive comment `comment` (the end record is the tail).
    fn with_comment(bytes: &[u8], comment: &str) -> Vec<u8> {
        let at = zipmap::map_bytes(bytes).unwrap().eocd_offset as usize;
        let mut v = bytes[..at + 22].to_vec();
        v[at + 20..at + 22].copy_from_slice(&(comment.len() as u16).to_le_bytes());
        v.extend(comment.as_bytes());
        v
    }

    #[test]
    fn bytes_in_memory_are_checked_against_their_crcs() {
        let where_ = Path::new("s3://b/c/__0_0.distcp, item 'cfg'");
        let good = fixture("torch_small_a64.pt");
        let a = zipmap::map_bytes(&good).unwrap();
        let v = check_bytes(&good, where_).unwrap();
        assert_eq!(v.verified.len(), a.records.len());
        assert!(v.unchecked.is_empty());
        // A flipped byte in a record: a format error naming where and the record.
        let r = a.storage("0").unwrap();
        let mut bad = good.clone();
        bad[r.data_offset as usize + 3] ^= 1;
        let e = check_bytes(&bad, where_).unwrap_err();
        assert!(matches!(e, Error::Format { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.starts_with("s3://b/c/__0_0.distcp, item 'cfg': "),
            "{msg}"
        );
        assert!(
            msg.contains("\"torch_small_a64/data/0\" is corrupt"),
            "{msg}"
        );
        // ... unless the comment says that record's CRC-32 was not computed.
        let v = check_bytes(&with_comment(&bad, "ckptio:crc32 unchecked=0"), where_).unwrap();
        assert_eq!(v.unchecked, [r.name.as_str()]);
        assert_eq!(v.verified.len(), a.records.len() - 1);
        let v = check_bytes(&with_comment(&bad, "ckptio:crc32 unchecked=*"), where_).unwrap();
        assert_eq!(
            v.unchecked,
            ["torch_small_a64/data/0", "torch_small_a64/data/1"]
        );
        let e = check_bytes(&with_comment(&bad, "ckptio:crc32 unchecked=1"), where_);
        assert!(e.unwrap_err().to_string().contains("data/0\" is corrupt"));
    }

    #[test]
    fn a_zero_crc_is_unchecked_only_without_our_comment() {
        let where_ = Path::new("item");
        let mut v = fixture("torch_small_a64.pt");
        let a = zipmap::map_bytes(&v).unwrap();
        let r = a.storage("1").unwrap();
        let at = r.cd_entry_offset as usize + 16;
        v[at..at + 4].copy_from_slice(&[0; 4]);
        // A foreign archive: 0 means none computed.
        let got = check_bytes(&v, where_).unwrap();
        assert_eq!(got.unchecked, [r.name.as_str()]);
        // Ours: 0 is a real value, wrong here, unless listed.
        let e = check_bytes(&with_comment(&v, "ckptio:crc32"), where_).unwrap_err();
        assert!(
            e.to_string().contains("the archive stores 0x00000000"),
            "{e}"
        );
        check_bytes(&with_comment(&v, "ckptio:crc32 unchecked=1"), where_).unwrap();
    }

    #[test]
    fn bytes_that_are_no_archive_of_stored_records_are_refused() {
        let where_ = Path::new("s3://b/o, item 'x'");
        let stored = fixture("zipfile_stored.zip");
        check_bytes(&stored, where_).unwrap();
        // A record running past the end: its sizes in the central directory.
        let a = zipmap::map_bytes(&stored).unwrap();
        let mut long = stored.clone();
        let cd = a.records[1].cd_entry_offset as usize;
        for at in [cd + 20, cd + 24] {
            long[at..at + 4].copy_from_slice(&1_000_000u32.to_le_bytes());
        }
        let cases: [(&[u8], &str); 4] = [
            (b"PK\x03\x04 not a zip at all", "not a usable checkpoint"),
            (&[], "not a usable checkpoint"),
            (&fixture("zipfile_deflated.zip"), "is compressed (method 8)"),
            (&long, "archive/data/0"),
        ];
        for (bytes, says) in cases {
            let e = check_bytes(bytes, where_).unwrap_err();
            assert!(matches!(e, Error::Format { .. }), "{e:?}");
            let msg = e.to_string();
            assert!(msg.starts_with("s3://b/o, item 'x': "), "{msg}");
            assert!(msg.contains(says), "{says}: {msg}");
        }
    }
}
