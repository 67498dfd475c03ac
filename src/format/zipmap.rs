//! Maps a torch.save archive (a zip file) to its records: name, data offset, size.
//!
//! torch.save stores every record uncompressed and aligned, so once the offsets
//! are known a checkpoint's bytes can be moved in place with pread/pwrite or
//! cuFile, without a zip library and without reading any tensor data here.
//! Offsets come from the central directory plus each local header's lengths,
//! exactly as `PyTorchStreamReader::getRecordOffset` computes them; local
//! header sizes and CRCs are ignored because torch writes zeros there.
//!
//! The input is untrusted: every offset and length is bounds-checked with
//! checked arithmetic, so a corrupt or hostile file yields a `Format` error,
//! never a panic, an endless loop or an allocation larger than the file.

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::{Error, Result};

const EOCD_SIG: u32 = 0x0605_4b50;
const EOCD_LEN: usize = 22;
const MAX_COMMENT_LEN: usize = u16::MAX as usize;
const LOCATOR_SIG: u32 = 0x0706_4b50;
const LOCATOR_LEN: usize = 20;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const ZIP64_EOCD_LEN: usize = 56;
const CD_SIG: u32 = 0x0201_4b50;
const CD_ENTRY_LEN: usize = 46;
const LH_SIG: u32 = 0x0403_4b50;
const LH_LEN: usize = 30;
const ZIP64_EXTRA_ID: u16 = 0x0001;
/// A 16-bit field with this value lives in the ZIP64 records instead.
const SAT16: u16 = u16::MAX;
/// A 32-bit field with this value lives in the ZIP64 records instead.
const SAT32: u32 = u32::MAX;
/// General-purpose flag bits torch's reader (miniz) refuses: 0 (encrypted),
/// 5 (compressed patch data), 6 (strong encryption), 13 (masked local headers).
const REFUSED_FLAGS: u16 = 0x2061;
/// The DOS directory bit of an entry's external attributes: miniz then takes
/// the record for a folder and torch reads no bytes of it.
const DOS_DIR_ATTRIBUTE: u32 = 0x10;
/// The smallest "size of the ZIP64 end record" field miniz accepts (56 - 12).
const ZIP64_EOCD_MIN_SIZE: u64 = 44;
const METHOD_STORED: u16 = 0;

/// One stored record of the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Full name in the archive, e.g. `"model/data/0"`.
    pub name: String,
    /// Offset of the record's local file header.
    pub header_offset: u64,
    /// Offset of the record's first data byte: where its bytes live in the file.
    pub data_offset: u64,
    /// Size of the data in bytes (stored, so on disk and in memory alike).
    pub size: u64,
    /// CRC-32 from the central directory (0 for files saved under `skip_data`;
    /// torch never checks it).
    pub crc32: u32,
    /// Offset of the record's central directory entry (its CRC-32 is at +16).
    pub cd_entry_offset: u64,
}

/// The records of an archive, in central-directory order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Archive {
    pub records: Vec<Record>,
    /// Length of the file when it was mapped.
    pub file_len: u64,
    /// Offset of the classic end-of-central-directory record.
    pub eocd_offset: u64,
    /// The archive comment (after the end record; torch writes none).
    pub comment: Vec<u8>,
}

impl Archive {
    /// The archive's top directory: the text before the first `/` of the first
    /// record's name, as torch's reader takes it ("" when there is none).
    pub fn prefix(&self) -> &str {
        self.records
            .first()
            .and_then(|r| r.name.split_once('/'))
            .map_or("", |(prefix, _)| prefix)
    }

    /// The record with this full name.
    pub fn get(&self, name: &str) -> Option<&Record> {
        self.records.iter().find(|r| r.name == name)
    }

    /// The record `<prefix>/data/<key>` holding the storage pickled under `key`.
    pub fn storage(&self, key: &str) -> Option<&Record> {
        self.storage_index(key).map(|i| &self.records[i])
    }

    /// Index in [`Archive::records`] of the record [`Archive::storage`] finds.
    pub fn storage_index(&self, key: &str) -> Option<usize> {
        let prefix = self.prefix();
        let is_it = |r: &&Record| {
            r.name
                .strip_prefix(prefix)
                .and_then(|rest| rest.strip_prefix("/data/"))
                == Some(key)
        };
        // torch writes data.pkl, .format_version, .storage_alignment, byteorder
        // (optional) and then data/0, data/1, ...: look there first so that a
        // lookup per storage stays O(1) on torch's own files.
        if let Ok(k) = key.parse::<usize>() {
            for i in [k.saturating_add(4), k.saturating_add(3)] {
                if self.records.get(i).filter(is_it).is_some() {
                    return Some(i);
                }
            }
        }
        self.records.iter().position(|r| is_it(&r))
    }
}

/// Maps the archive in `file` with positional reads; `path` only names the file in errors.
///
/// # Errors
/// [`Error::Format`] when the file is not a zip archive whose records are all
/// stored, in bounds and disjoint; [`Error::Io`] when fstat or pread fails.
pub fn map_file(file: &File, path: Option<&Path>) -> Result<Archive> {
    let meta = file
        .metadata()
        .map_err(|e| Error::io("fstat", path.map(Path::to_path_buf), e))?;
    let src = FileSource {
        file,
        size: meta.len(),
        path,
    };
    map(&src, path)
}

/// Maps the archive stored in bytes `[start, start + len)` of `file` (a DCP
/// item: a torch.save zip inside a larger file), with every check of
/// [`map_file`] confined to that range. Offsets in the result are offsets in
/// the file; `file_len` is the end of the range.
///
/// # Errors
/// As [`map_file`]; a range past the end of the file is an [`Error::Format`].
pub fn map_file_range(file: &File, path: Option<&Path>, start: u64, len: u64) -> Result<Archive> {
    let size = file
        .metadata()
        .map_err(|e| Error::io("fstat", path.map(Path::to_path_buf), e))?
        .len();
    let end = start
        .checked_add(len)
        .filter(|&e| e <= size)
        .ok_or_else(|| {
            Error::format(
                path,
                format!(
                    "bytes {start}..{} lie past the end of the file ({size} bytes)",
                    start.saturating_add(len)
                ),
            )
        })?;
    let src = RangeSource {
        inner: FileSource { file, size, path },
        start,
        len: end - start,
    };
    let mut a = map(&src, path).map_err(|e| match e {
        Error::Format { path, reason } => Error::Format {
            path,
            reason: format!("item at bytes {start}..{end}: {reason}"),
        },
        other => other,
    })?;
    for r in &mut a.records {
        r.header_offset += start;
        r.data_offset += start;
        r.cd_entry_offset += start;
    }
    a.file_len = end;
    a.eocd_offset += start;
    Ok(a)
}

/// Maps an archive held in memory (the same checks as [`map_file`]).
///
/// # Errors
/// [`Error::Format`] as for [`map_file`].
pub fn map_bytes(bytes: &[u8]) -> Result<Archive> {
    map(&BytesSource(bytes), None)
}

/// Random access to the archive, so files and memory share one parser.
/// Bytes read in batches: an object store answers many ranges in one call
/// (concurrent requests), where a file would read them one by one.
pub trait RangeReader {
    fn size(&self) -> u64;
    /// Fills each `(offset, buffer)`; callers only ask for ranges inside `size()`.
    fn read_ranges(&self, ranges: &mut [(u64, &mut [u8])]) -> Result<()>;
}

/// A torch.save archive mapped from a [`RangeReader`] in few batches.
#[derive(Debug)]
pub struct RemoteArchive {
    pub archive: Archive,
    /// The bytes of each record outside `<prefix>/data/` (the pickle, the
    /// version...), of at most [`SMALL_RECORD_MAX`] bytes each.
    pub small: Vec<(String, Vec<u8>)>,
    /// Storage records (under `<prefix>/data/`) whose data offset is
    /// predicted, not read: the caller reads `[header_offset, data_offset)`
    /// with the data and confirms it with [`local_header_matches`].
    pub predicted: Vec<usize>,
}

/// Records outside `<prefix>/data/` larger than this are not read by
/// [`map_remote`] (a pickle past it is torch.load's anyway).
pub const SMALL_RECORD_MAX: u64 = 64 << 20;

/// Maps a torch.save archive that lies behind a [`RangeReader`] (an object):
/// the end records and the central directory from the last `tail` bytes (a
/// second read only where the directory is longer); every record outside
/// `<prefix>/data/` read whole with its local header in one batch; each
/// storage's data offset predicted from the layout torch.save writes (records
/// back to back, each followed by its data descriptor, data aligned to the
/// `.storage_alignment` record, 64 without one), for the caller to confirm
/// from the local header it reads in the same request as the data. Storages
/// thus cost no request of their own before their data is read.
pub fn map_remote<R: RangeReader>(
    src: &R,
    path: Option<&Path>,
    tail: u64,
) -> Result<RemoteArchive> {
    let bad = |reason: String| Error::format(path, reason);
    let cached = Cached::new(src, tail)?;
    let (mut records, end, cd_end) = directory(&cached, path)?;
    let prefix = records
        .first()
        .and_then(|r| r.name.split_once('/'))
        .map_or(String::new(), |(p, _)| p.to_owned());
    let data_prefix = format!("{prefix}/data/");
    for r in &records {
        // Every header inside the object (as resolve_data_offsets checks a
        // file's): each span below then ends inside it, and no sum wraps.
        let head = (LH_LEN + r.name.len()) as u64;
        if r.header_offset
            .checked_add(head)
            .is_none_or(|e| e > end.cd_offset)
        {
            return Err(bad(format!(
                "record {:?}: local header at offset {} lies past the central directory                  (at {})",
                r.name, r.header_offset, end.cd_offset
            )));
        }
    }
    let mut order: Vec<usize> = (0..records.len()).collect();
    order.sort_unstable_by_key(|&i| records[i].header_offset);
    // Where each record's span (local header, data, descriptor) ends.
    let mut next = vec![end.cd_offset; records.len()];
    for w in order.windows(2) {
        next[w[0]] = records[w[1]].header_offset;
    }
    let small_ids: Vec<usize> = order
        .iter()
        .copied()
        // Empty storages too: their headers alone say where their (no) data is.
        .filter(|&i| !records[i].name.starts_with(&data_prefix) || records[i].size == 0)
        .filter(|&i| records[i].size <= SMALL_RECORD_MAX)
        .collect();
    let mut bufs = Vec::with_capacity(small_ids.len());
    for &i in &small_ids {
        let r = &records[i];
        // To the next record, or as far as its header, data and descriptor can reach.
        let most = (LH_LEN + r.name.len() + usize::from(u16::MAX) + 24) as u64 + r.size;
        let span = next[i]
            .checked_sub(r.header_offset)
            .filter(|&n| n >= (LH_LEN + r.name.len()) as u64)
            .map(|n| n.min(most));
        let Some(span) = span else {
            return Err(bad(format!(
                "record {:?}: its local header at offset {} does not fit before the next \
                 record (at {})",
                r.name, r.header_offset, next[i]
            )));
        };
        bufs.push(vec![0u8; span as usize]);
    }
    {
        let mut ranges: Vec<(u64, &mut [u8])> = small_ids
            .iter()
            .zip(bufs.iter_mut())
            .map(|(&i, b)| (records[i].header_offset, b.as_mut_slice()))
            .collect();
        src.read_ranges(&mut ranges)?;
    }
    let mut small = Vec::with_capacity(small_ids.len());
    for (&i, buf) in small_ids.iter().zip(bufs) {
        let r = &mut records[i];
        resolve_one(r, &buf[..LH_LEN + r.name.len()], src.size(), &bad)?;
        let at = (r.data_offset - r.header_offset) as usize;
        let data = buf.get(at..at + r.size as usize).ok_or_else(|| {
            bad(format!(
                "record {:?}: {} bytes of data at offset {} run into the next record",
                r.name, r.size, r.data_offset
            ))
        })?;
        small.push((r.name.clone(), data.to_vec()));
    }
    let align = small
        .iter()
        .find(|(n, _)| *n == format!("{prefix}/.storage_alignment"))
        .and_then(|(_, b)| std::str::from_utf8(b).ok()?.trim().parse::<u64>().ok())
        .filter(|&a| a > 0)
        .unwrap_or(64);
    let mut predicted = Vec::new();
    for &i in &order {
        let r = &mut records[i];
        if !r.name.starts_with(&data_prefix) || r.size == 0 {
            continue; // read with the small records
        }
        let first = r.header_offset + (LH_LEN + r.name.len()) as u64;
        // Data descriptor: 16 bytes (signed), 24 (ZIP64), 12 (unsigned), none.
        let guess = [16u64, 24, 12, 0]
            .iter()
            .filter_map(|d| next[i].checked_sub(d + r.size))
            .find(|&d| d >= first && d % align == 0)
            .unwrap_or(first);
        if guess.checked_add(r.size).is_none_or(|e| e > src.size()) {
            return Err(bad(format!(
                "record {:?}: {} bytes of data at offset {guess} run past the end of the \
                 file ({} bytes); is it truncated?",
                r.name,
                r.size,
                src.size()
            )));
        }
        r.data_offset = guess;
        predicted.push(i);
    }
    check_layout(&records, end.cd_offset, cd_end, &bad)?;
    Ok(RemoteArchive {
        archive: Archive {
            records,
            file_len: src.size(),
            eocd_offset: end.eocd_offset,
            comment: end.comment,
        },
        small,
        predicted,
    })
}

/// Whether `head`, the bytes from `r`'s local header to its data, is that
/// record's local header and puts its data at `r.data_offset`.
pub fn local_header_matches(r: &Record, head: &[u8]) -> bool {
    let want = LH_LEN + r.name.len();
    if head.len() < want {
        return false;
    }
    let mut c = r.clone();
    let ok = resolve_one(&mut c, &head[..want], u64::MAX, &|m| Error::format(None, m)).is_ok();
    ok && c.data_offset == r.data_offset
}

/// A [`RangeReader`]'s tail, read once, as a [`Source`]: the end records and
/// (usually) the central directory come from it; other reads go to the reader.
struct Cached<'a, R> {
    inner: &'a R,
    tail_start: u64,
    tail: Vec<u8>,
}

impl<'a, R: RangeReader> Cached<'a, R> {
    fn new(inner: &'a R, tail: u64) -> Result<Self> {
        let n = inner
            .size()
            .min(tail.max((EOCD_LEN + MAX_COMMENT_LEN) as u64));
        let tail_start = inner.size() - n;
        let mut buf = vec![0u8; n as usize];
        inner.read_ranges(&mut [(tail_start, buf.as_mut_slice())])?;
        Ok(Cached {
            inner,
            tail_start,
            tail: buf,
        })
    }
}

impl<R: RangeReader> Source for Cached<'_, R> {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        if offset >= self.tail_start {
            let at = (offset - self.tail_start) as usize;
            if let Some(src) = self.tail.get(at..at + buf.len()) {
                buf.copy_from_slice(src);
                return Ok(());
            }
        }
        self.inner.read_ranges(&mut [(offset, buf)])
    }
}

trait Source {
    fn size(&self) -> u64;
    /// Fills `buf` from `offset`; callers only ask for ranges inside `size()`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
}

struct FileSource<'a> {
    file: &'a File,
    size: u64,
    path: Option<&'a Path>,
}

impl Source for FileSource<'_> {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| Error::io("pread", self.path.map(Path::to_path_buf), e))
    }
}

/// A byte range of a file, seen as a file of its own.
struct RangeSource<'a> {
    inner: FileSource<'a>,
    start: u64,
    len: u64,
}

impl Source for RangeSource<'_> {
    fn size(&self) -> u64 {
        self.len
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        // Callers stay inside size(), so this stays inside the file.
        self.inner.read_at(buf, self.start + offset)
    }
}

struct BytesSource<'a>(&'a [u8]);

impl Source for BytesSource<'_> {
    fn size(&self) -> u64 {
        self.0.len() as u64
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let src = usize::try_from(offset)
            .ok()
            .and_then(|start| self.0.get(start..start.checked_add(buf.len())?))
            .ok_or_else(|| Error::io("read", None, io::ErrorKind::UnexpectedEof.into()))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

/// Where the central directory is, from the end records.
struct End {
    entries: u64,
    cd_offset: u64,
    cd_size: u64,
    /// Offset of the first end record; the central directory must end at or before it.
    end_start: u64,
    eocd_offset: u64,
    comment: Vec<u8>,
}

fn map<S: Source>(src: &S, path: Option<&Path>) -> Result<Archive> {
    let bad = |reason: String| Error::format(path, reason);
    let (mut records, end, cd_end) = directory(src, path)?;
    resolve_data_offsets(src, &mut records, &bad)?;
    check_layout(&records, end.cd_offset, cd_end, &bad)?;
    Ok(Archive {
        records,
        file_len: src.size(),
        eocd_offset: end.eocd_offset,
        comment: end.comment,
    })
}

/// The records of the central directory (data offsets not resolved yet), the
/// end records, and where the directory ends.
fn directory<S: Source>(src: &S, path: Option<&Path>) -> Result<(Vec<Record>, End, u64)> {
    let bad = |reason: String| Error::format(path, reason);
    let file_len = src.size();
    let end = find_end(src, &bad)?;

    let cd_end = end
        .cd_offset
        .checked_add(end.cd_size)
        .filter(|&e| e <= end.end_start)
        .ok_or_else(|| {
            bad(format!(
                "central directory at offset {} of {} bytes lies outside the file \
                 ({file_len} bytes, end records at {})",
                end.cd_offset, end.cd_size, end.end_start
            ))
        })?;
    // Every entry takes at least 46 bytes: this bounds the entry count by the
    // file length before anything is allocated for it.
    if end.entries > end.cd_size / CD_ENTRY_LEN as u64 {
        return Err(bad(format!(
            "the end record declares {} entries, but a central directory of {} bytes \
             holds at most {}",
            end.entries,
            end.cd_size,
            end.cd_size / CD_ENTRY_LEN as u64
        )));
    }
    let cd = read_vec(src, end.cd_offset, end.cd_size, path)?;
    let records = parse_central_directory(&cd, &end, &bad)?;

    let mut names = HashSet::with_capacity(records.len());
    if let Some(dup) = records.iter().find(|r| !names.insert(r.name.as_str())) {
        return Err(bad(format!("duplicate record name {:?}", dup.name)));
    }
    Ok((records, end, cd_end))
}

/// Finds the classic end record, then the ZIP64 one through its locator if present.
fn find_end<S: Source>(src: &S, bad: &impl Fn(String) -> Error) -> Result<End> {
    let len = src.size();
    if len < EOCD_LEN as u64 {
        return Err(bad(format!(
            "file is {len} bytes, too short to be a zip archive"
        )));
    }
    // The end record is the last 22 bytes plus a comment of at most 64 KiB.
    let tail_len = len.min((EOCD_LEN + MAX_COMMENT_LEN) as u64);
    let tail_start = len - tail_len;
    let mut tail = vec![0u8; tail_len as usize];
    src.read_at(&mut tail, tail_start)?;
    let pos = locate_eocd(&tail).ok_or_else(|| {
        bad(format!(
            "no end-of-central-directory record in the last {tail_len} bytes \
             (the file is truncated or not a zip archive)"
        ))
    })?;
    let e = &tail[pos..pos + EOCD_LEN];
    let eocd_offset = tail_start + pos as u64;
    // locate_eocd only returns a record whose comment lies inside the tail.
    let comment_len = usize::from(le16(e, 20));
    let comment = tail[pos + EOCD_LEN..pos + EOCD_LEN + comment_len].to_vec();
    let disk = le16(e, 4);
    let cd_disk = le16(e, 6);
    let disk_entries = le16(e, 8);
    let entries = le16(e, 10);
    let cd_size = le32(e, 12);
    let cd_offset = le32(e, 16);

    let mut locator = [0u8; LOCATOR_LEN];
    let locator_offset = eocd_offset.checked_sub(LOCATOR_LEN as u64);
    if let Some(at) = locator_offset {
        src.read_at(&mut locator, at)?;
    }
    let (Some(locator_offset), LOCATOR_SIG) = (locator_offset, le32(&locator, 0)) else {
        // No ZIP64 records (e.g. Python's zipfile on a small archive): the
        // classic fields are the real values.
        if disk != 0 || cd_disk != 0 || disk_entries != entries {
            return Err(bad(format!(
                "archive spans several disks (disk {disk}, central directory on disk \
                 {cd_disk}, {disk_entries} of {entries} entries on this disk)"
            )));
        }
        return Ok(End {
            entries: u64::from(entries),
            cd_offset: u64::from(cd_offset),
            cd_size: u64::from(cd_size),
            end_start: eocd_offset,
            eocd_offset,
            comment,
        });
    };

    let z64_disk = le32(&locator, 4);
    let z64_offset = le64(&locator, 8);
    let total_disks = le32(&locator, 16);
    // torch's reader wants exactly one disk here (it writes 1).
    if z64_disk != 0 || total_disks != 1 {
        return Err(bad(format!(
            "archive spans several disks (ZIP64 end record on disk {z64_disk}, \
             {total_disks} disks)"
        )));
    }
    if z64_offset
        .checked_add(ZIP64_EOCD_LEN as u64)
        .is_none_or(|e| e > locator_offset)
    {
        return Err(bad(format!(
            "the ZIP64 locator points to offset {z64_offset}, where no ZIP64 end record \
             fits before the locator at {locator_offset}"
        )));
    }
    let mut z = [0u8; ZIP64_EOCD_LEN];
    src.read_at(&mut z, z64_offset)?;
    if le32(&z, 0) != ZIP64_EOCD_SIG {
        return Err(bad(format!(
            "no ZIP64 end record at offset {z64_offset}, where the locator points \
             (found {:#010x})",
            le32(&z, 0)
        )));
    }
    let z_size = le64(&z, 4);
    if z_size < ZIP64_EOCD_MIN_SIZE {
        return Err(bad(format!(
            "the ZIP64 end record at offset {z64_offset} declares a size of {z_size} bytes \
             (at least {ZIP64_EOCD_MIN_SIZE}), which torch's reader refuses"
        )));
    }
    let z_disk = le32(&z, 16);
    let z_cd_disk = le32(&z, 20);
    let z_disk_entries = le64(&z, 24);
    let z_entries = le64(&z, 32);
    if z_disk != 0 || z_cd_disk != 0 || z_disk_entries != z_entries {
        return Err(bad(format!(
            "archive spans several disks (disk {z_disk}, central directory on disk \
             {z_cd_disk}, {z_disk_entries} of {z_entries} entries on this disk)"
        )));
    }
    // A classic field is either the real value (torch writes it when it fits)
    // or saturated; anything else means the two end records disagree.
    let pick = |what: &str, classic: u64, saturated: u64, z: u64| {
        if classic == saturated || classic == z {
            Ok(z)
        } else {
            Err(bad(format!(
                "the end record says {what} is {classic} but the ZIP64 end record says {z}"
            )))
        }
    };
    for (what, classic) in [("the disk number", disk), ("the directory disk", cd_disk)] {
        pick(what, u64::from(classic), u64::from(SAT16), 0)?;
    }
    Ok(End {
        entries: pick(
            "the entry count",
            u64::from(entries),
            u64::from(SAT16),
            z_entries,
        )?,
        cd_offset: pick(
            "the central directory offset",
            u64::from(cd_offset),
            u64::from(SAT32),
            le64(&z, 48),
        )?,
        cd_size: pick(
            "the central directory size",
            u64::from(cd_size),
            u64::from(SAT32),
            le64(&z, 40),
        )?,
        end_start: z64_offset,
        eocd_offset,
        comment,
    })
}

/// Position of the end record in `tail` (the file's last bytes): the one
/// nearest the end whose comment ends exactly at the end of the file, else
/// the nearest whose comment fits (trailing bytes after the archive).
fn locate_eocd(tail: &[u8]) -> Option<usize> {
    let last = tail.len().checked_sub(EOCD_LEN)?;
    let mut fallback = None;
    for pos in (0..=last).rev() {
        if le32(tail, pos) != EOCD_SIG {
            continue;
        }
        let end = pos + EOCD_LEN + usize::from(le16(tail, pos + 20));
        if end == tail.len() {
            return Some(pos);
        }
        if end < tail.len() && fallback.is_none() {
            fallback = Some(pos);
        }
    }
    fallback
}

/// Walks the central directory; data offsets are filled in later from the local headers.
fn parse_central_directory(
    cd: &[u8],
    end: &End,
    bad: &impl Fn(String) -> Error,
) -> Result<Vec<Record>> {
    // `end.entries` is at most cd.len() / 46, checked by the caller.
    let mut records = Vec::with_capacity(usize::try_from(end.entries).unwrap_or(0));
    let mut p = 0usize;
    // torch's words, which users search for.
    let not_in_folder = |top: &str, name: &str| {
        bad(format!(
            "file in archive is not in a subdirectory {top}: {name:?} (torch's reader refuses it)"
        ))
    };
    let mut prefix: Option<String> = None;
    for i in 0..end.entries {
        let at = end.cd_offset.saturating_add(p as u64);
        let Some(h) = cd.get(p..p.saturating_add(CD_ENTRY_LEN)) else {
            return Err(bad(format!(
                "the end record declares {} entries, but the central directory \
                 ({} bytes) ends after {i}",
                end.entries,
                cd.len()
            )));
        };
        if le32(h, 0) != CD_SIG {
            return Err(bad(format!(
                "central directory entry #{i} at offset {at} has a bad signature \
                 ({:#010x})",
                le32(h, 0)
            )));
        }
        let flags = le16(h, 8);
        let method = le16(h, 10);
        let crc32 = le32(h, 16);
        let csize32 = le32(h, 20);
        let usize32 = le32(h, 24);
        let name_end = p + CD_ENTRY_LEN + usize::from(le16(h, 28));
        let extra_end = name_end + usize::from(le16(h, 30));
        let entry_end = extra_end + usize::from(le16(h, 32));
        let disk16 = le16(h, 34);
        let lho32 = le32(h, 42);
        if entry_end > cd.len() {
            return Err(bad(format!(
                "central directory entry #{i} at offset {at} runs past the end of the \
                 central directory"
            )));
        }
        let name_bytes = &cd[p + CD_ENTRY_LEN..name_end];
        let Ok(name) = std::str::from_utf8(name_bytes) else {
            return Err(bad(format!(
                "central directory entry #{i} at offset {at} has a name that is not \
                 UTF-8: {:?}",
                String::from_utf8_lossy(name_bytes)
            )));
        };
        if flags & REFUSED_FLAGS != 0 {
            return Err(bad(format!(
                "record {name:?} has flags {flags:#06x}: encrypted, patch data or masked \
                 headers (bits {:#06x}), which torch's reader refuses",
                flags & REFUSED_FLAGS
            )));
        }
        // torch's reader takes the first entry's top folder as the archive's
        // and lists every entry when torch.load opens it, refusing one outside.
        let top: &str = match &prefix {
            Some(top) => top,
            None => prefix.insert(match name.split_once('/') {
                Some((top, _)) => format!("{top}/"),
                None => return Err(not_in_folder("", name)),
            }),
        };
        if !name.starts_with(top) {
            return Err(not_in_folder(top, name));
        }
        // A folder entry (an unzipped checkpoint zipped again by a tool that
        // lists folders) holds nothing torch reads.
        let external = le32(h, 38);
        if external & DOS_DIR_ATTRIBUTE != 0 || name.ends_with('/') {
            p = entry_end;
            continue;
        }
        if method != METHOD_STORED {
            return Err(bad(format!(
                "record {name:?} is compressed (method {method}): torch.load inflates it; \
                 ckptio reads stored records only"
            )));
        }

        // Saturated fields live in the zip64 extra, in this order, and only those.
        let mut z64: &[u8] = &[];
        if usize32 == SAT32 || csize32 == SAT32 || lho32 == SAT32 {
            z64 = zip64_extra(&cd[name_end..extra_end]).ok_or_else(|| {
                bad(format!(
                    "record {name:?} defers its sizes or offset to a zip64 extra field \
                     that is missing or garbled"
                ))
            })?;
        }
        let mut widen = |what: &str, v: u32| -> Result<u64> {
            if v != SAT32 {
                return Ok(u64::from(v));
            }
            let (field, rest) = z64.split_first_chunk::<8>().ok_or_else(|| {
                bad(format!(
                    "record {name:?}: the zip64 extra field lacks the {what}"
                ))
            })?;
            z64 = rest;
            Ok(u64::from_le_bytes(*field))
        };
        let size = widen("uncompressed size", usize32)?;
        let csize = widen("compressed size", csize32)?;
        let header_offset = widen("local header offset", lho32)?;
        // A saturated disk number (deferred to the zip64 extra) is refused by
        // torch's reader too: the record must start on disk 0.
        if disk16 != 0 {
            return Err(bad(format!(
                "record {name:?} starts on disk {disk16}; multi-disk archives are not supported"
            )));
        }
        if csize != size {
            return Err(bad(format!(
                "record {name:?} has compressed size {csize} but uncompressed size {size}"
            )));
        }
        records.push(Record {
            name: name.to_owned(),
            header_offset,
            data_offset: 0,
            size,
            crc32,
            cd_entry_offset: at,
        });
        p = entry_end;
    }
    if p != cd.len() {
        return Err(bad(format!(
            "the end record declares {} entries, but the central directory has {} more \
             bytes after them",
            end.entries,
            cd.len() - p
        )));
    }
    Ok(records)
}

/// The body of the zip64 extra block (id 0x0001) in an extra field, if well formed.
fn zip64_extra(mut extra: &[u8]) -> Option<&[u8]> {
    // Fewer than 4 trailing bytes cannot hold a block; some writers pad with them.
    while let Some((head, rest)) = extra.split_first_chunk::<4>() {
        let id = le16(head, 0);
        let len = usize::from(le16(head, 2));
        let body = rest.get(..len)?;
        if id == ZIP64_EXTRA_ID {
            return Some(body);
        }
        extra = &rest[len..];
    }
    None
}

/// Local headers closer than this to the previous one are read in the same
/// read: one read of the gap costs less than a read of its own on a cold disk
/// (about one seek: 100,000 records 10 KiB apart took 5.6 s header by header on
/// the development VM's disk).
const HEADER_GAP: u64 = 64 << 10;
/// At most this many bytes in one read of neighbouring local headers.
const HEADER_WINDOW: u64 = 1 << 20;

/// Reads each local header for its name and extra lengths: data starts right after.
/// Headers close together (small records) are read together, in file order.
fn resolve_data_offsets<S: Source>(
    src: &S,
    records: &mut [Record],
    bad: &impl Fn(String) -> Error,
) -> Result<()> {
    let len = src.size();
    let want = |r: &Record| (LH_LEN + r.name.len()) as u64;
    for r in records.iter() {
        // Header and name: names are at most 64 KiB.
        if r.header_offset.checked_add(want(r)).is_none_or(|e| e > len) {
            return Err(bad(format!(
                "record {:?}: local header at offset {} lies past the end of the file \
                 ({len} bytes)",
                r.name, r.header_offset
            )));
        }
    }
    let mut order: Vec<usize> = (0..records.len()).collect();
    order.sort_unstable_by_key(|&i| records[i].header_offset);
    let mut buf = Vec::new();
    let mut i = 0;
    while i < order.len() {
        // One read from this header to the last of its close neighbours.
        let first = records[order[i]].header_offset;
        let mut end = first + want(&records[order[i]]);
        let mut j = i + 1;
        while let Some(&k) = order.get(j) {
            let (at, stop) = (
                records[k].header_offset,
                records[k].header_offset + want(&records[k]),
            );
            if at > end.saturating_add(HEADER_GAP) || stop - first > HEADER_WINDOW {
                break;
            }
            end = end.max(stop);
            j += 1;
        }
        buf.resize((end - first) as usize, 0);
        src.read_at(&mut buf, first)?;
        for &k in &order[i..j] {
            let r = &mut records[k];
            let at = (r.header_offset - first) as usize;
            resolve_one(r, &buf[at..at + want(r) as usize], len, bad)?;
        }
        i = j;
    }
    Ok(())
}

/// A record's data offset from its local header (`head`: the fixed part and the name).
fn resolve_one(
    r: &mut Record,
    head: &[u8],
    len: u64,
    bad: &impl Fn(String) -> Error,
) -> Result<()> {
    if le32(head, 0) != LH_SIG {
        return Err(bad(format!(
            "record {:?}: no local header at offset {} (found {:#010x})",
            r.name,
            r.header_offset,
            le32(head, 0)
        )));
    }
    let name_len = le16(head, 26);
    let extra_len = le16(head, 28);
    if usize::from(name_len) != r.name.len() || &head[LH_LEN..] != r.name.as_bytes() {
        return Err(bad(format!(
            "record {:?}: the local header at offset {} names another record",
            r.name, r.header_offset
        )));
    }
    let data_offset = r
        .header_offset
        .checked_add((LH_LEN + usize::from(name_len) + usize::from(extra_len)) as u64);
    let data_end = data_offset.and_then(|d| d.checked_add(r.size));
    match (data_offset, data_end) {
        (Some(d), Some(e)) if e <= len => r.data_offset = d,
        _ => {
            return Err(bad(format!(
                "record {:?}: {} bytes of data at offset {} run past the end of the \
                 file ({len} bytes); is it truncated?",
                r.name,
                r.size,
                data_offset.map_or_else(|| "(overflow)".to_owned(), |d| d.to_string())
            )))
        }
    }
    Ok(())
}

/// Records may not overlap one another nor the central directory.
fn check_layout(
    records: &[Record],
    cd_offset: u64,
    cd_end: u64,
    bad: &impl Fn(String) -> Error,
) -> Result<()> {
    // Ends cannot overflow: resolve_data_offsets bounded them by the file length.
    let span = |r: &Record| (r.header_offset, r.data_offset.saturating_add(r.size));
    let mut order: Vec<&Record> = records.iter().collect();
    order.sort_unstable_by_key(|r| r.header_offset);
    for pair in order.windows(2) {
        let ((a0, a1), (b0, b1)) = (span(pair[0]), span(pair[1]));
        if a1 > b0 {
            return Err(bad(format!(
                "records {:?} [{a0}, {a1}) and {:?} [{b0}, {b1}) overlap",
                pair[0].name, pair[1].name
            )));
        }
    }
    if let Some(last) = order.last() {
        let (a0, a1) = span(last);
        if a1 > cd_offset {
            return Err(bad(format!(
                "record {:?} [{a0}, {a1}) overlaps the central directory \
                 [{cd_offset}, {cd_end})",
                last.name
            )));
        }
    }
    Ok(())
}

/// Reads `len` bytes at `offset` into a new vector; `len` was bounded by the
/// file length, and an allocation failure is an error rather than an abort.
fn read_vec<S: Source>(src: &S, offset: u64, len: u64, path: Option<&Path>) -> Result<Vec<u8>> {
    let oom = || {
        Error::io(
            "allocate",
            path.map(Path::to_path_buf),
            io::ErrorKind::OutOfMemory.into(),
        )
    };
    let n = usize::try_from(len).map_err(|_| oom())?;
    let mut buf = Vec::new();
    buf.try_reserve_exact(n).map_err(|_| oom())?;
    buf.resize(n, 0);
    src.read_at(&mut buf, offset)?;
    Ok(buf)
}

// Little-endian field readers. Callers pass offsets inside slices whose length
// they have already checked, so the indexing cannot fail.
fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a mapped archive promises: every record (header to end of data)
    /// inside the file, and no two records overlapping.
    fn assert_records_fit(a: &Archive, file_len: usize) {
        let mut spans: Vec<_> = a
            .records
            .iter()
            .map(|r| (r.header_offset, r.data_offset + r.size))
            .collect();
        spans.sort_unstable();
        assert!(spans.iter().all(|s| s.1 <= file_len as u64));
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));
    }
    use std::path::PathBuf;

    const BIG: u64 = 0xFFFF_FFFF;
    const GIB: u64 = 1 << 30;
    const PKL: [u8; 297] = [0x80; 297];

    enum Data<'a> {
        Bytes(&'a [u8]),
        /// Reserved but never written: a hole in a sparse file.
        Hole(u64),
    }

    #[derive(Clone, Debug)]
    struct Placed {
        name: Vec<u8>,
        header_offset: u64,
        data_offset: u64,
        size: u64,
        crc32: u32,
    }

    /// Writes archives the way torch's PyTorchStreamWriter does: zeroed local
    /// header sizes, zip64 extra only when needed, 'FB' padding to the
    /// alignment, 16/24-byte data descriptors, ZIP64 end records.
    struct Builder {
        align: u64,
        pos: u64,
        chunks: Vec<(u64, Vec<u8>)>,
        placed: Vec<Placed>,
        /// Put every size and offset in the central directory's zip64 extra,
        /// as some writers do, to exercise that path without 4 GiB files.
        zip64_everywhere: bool,
    }

    /// A built archive: its written chunks (the rest are holes) and where things are.
    struct Image {
        len: u64,
        chunks: Vec<(u64, Vec<u8>)>,
        placed: Vec<Placed>,
        align: u64,
        cd_offset: u64,
        cd_entries: Vec<u64>,
        zip64_eocd: Option<u64>,
        eocd: u64,
    }

    impl Builder {
        fn new(align: u64) -> Self {
            Builder {
                align,
                pos: 0,
                chunks: Vec::new(),
                placed: Vec::new(),
                zip64_everywhere: false,
            }
        }

        fn put(&mut self, bytes: &[u8]) {
            match self.chunks.last_mut() {
                Some((at, buf)) if *at + buf.len() as u64 == self.pos => {
                    buf.extend_from_slice(bytes)
                }
                _ => self.chunks.push((self.pos, bytes.to_vec())),
            }
            self.pos += bytes.len() as u64;
        }

        fn add(&mut self, name: impl AsRef<[u8]>, data: Data) -> &mut Self {
            let name = name.as_ref();
            let size = match data {
                Data::Bytes(b) => b.len() as u64,
                Data::Hole(n) => n,
            };
            let lho = self.pos;
            let crc32 = (size as u32).wrapping_mul(0x9E37_79B9) ^ name.len() as u32;
            let (big_size, big_off) = (size >= BIG, lho >= BIG);
            let mut z64 = Vec::new();
            if big_size {
                z64.extend(size.to_le_bytes());
                z64.extend(0u64.to_le_bytes());
            }
            if big_off {
                z64.extend(lho.to_le_bytes());
            }
            // getPadding in caffe2/serialize/inline_container.cc
            let mut start = lho + 30 + name.len() as u64 + 4;
            if !z64.is_empty() {
                start += 4 + z64.len() as u64;
            }
            let pad = (self.align - start % self.align) % self.align;
            let mut extra = Vec::new();
            if !z64.is_empty() {
                extra.extend(1u16.to_le_bytes());
                extra.extend((z64.len() as u16).to_le_bytes());
                extra.extend(&z64);
            }
            extra.extend(b"FB");
            extra.extend((pad as u16).to_le_bytes());
            extra.extend(std::iter::repeat_n(b'Z', pad as usize));

            let mut lh = Vec::new();
            lh.extend(LH_SIG.to_le_bytes());
            lh.extend(0u16.to_le_bytes()); // version needed
            lh.extend(0x0808u16.to_le_bytes()); // data descriptor, UTF-8
            lh.extend(0u16.to_le_bytes()); // stored
            lh.extend([0u8; 4]); // time, date
            lh.extend([0u8; 12]); // crc, csize, usize: zero, as torch writes them
            lh.extend((name.len() as u16).to_le_bytes());
            lh.extend((extra.len() as u16).to_le_bytes());
            lh.extend(name);
            lh.extend(&extra);
            self.put(&lh);
            let data_offset = self.pos;
            assert_eq!(data_offset % self.align, 0);
            match data {
                Data::Bytes(b) => self.put(b),
                Data::Hole(n) => self.pos += n,
            }
            let mut dd = Vec::new();
            dd.extend(0x0807_4b50u32.to_le_bytes());
            dd.extend(crc32.to_le_bytes());
            if big_size || big_off {
                dd.extend(size.to_le_bytes());
                dd.extend(size.to_le_bytes());
            } else {
                dd.extend((size as u32).to_le_bytes());
                dd.extend((size as u32).to_le_bytes());
            }
            self.put(&dd);
            self.placed.push(Placed {
                name: name.to_vec(),
                header_offset: lho,
                data_offset,
                size,
                crc32,
            });
            self
        }

        /// Writes the central directory and end records; `zip64_end` adds the
        /// ZIP64 end record and locator (torch always does, zipfile only when needed).
        fn finish(&mut self, zip64_end: bool) -> Image {
            let cd_offset = self.pos;
            let mut cd_entries = Vec::new();
            for p in self.placed.clone() {
                let sat = |v: u64| self.zip64_everywhere || v >= BIG;
                let mut z64 = Vec::new();
                if sat(p.size) {
                    z64.extend(p.size.to_le_bytes()); // usize
                    z64.extend(p.size.to_le_bytes()); // csize
                }
                if sat(p.header_offset) {
                    z64.extend(p.header_offset.to_le_bytes());
                }
                let mut e = Vec::new();
                e.extend(CD_SIG.to_le_bytes());
                e.extend([0u8; 4]); // made by, needed
                e.extend(0x0808u16.to_le_bytes());
                e.extend(0u16.to_le_bytes()); // stored
                e.extend([0u8; 4]); // time, date
                e.extend(p.crc32.to_le_bytes());
                let size32 = if sat(p.size) { SAT32 } else { p.size as u32 };
                e.extend(size32.to_le_bytes());
                e.extend(size32.to_le_bytes());
                e.extend((p.name.len() as u16).to_le_bytes());
                let extra_len = if z64.is_empty() { 0 } else { 4 + z64.len() };
                e.extend((extra_len as u16).to_le_bytes());
                e.extend([0u8; 10]); // comment len, disk, internal and external attributes
                let lho32 = if sat(p.header_offset) {
                    SAT32
                } else {
                    p.header_offset as u32
                };
                e.extend(lho32.to_le_bytes());
                e.extend(&p.name);
                if !z64.is_empty() {
                    e.extend(1u16.to_le_bytes());
                    e.extend((z64.len() as u16).to_le_bytes());
                    e.extend(&z64);
                }
                cd_entries.push(self.pos);
                self.put(&e);
            }
            let cd_size = self.pos - cd_offset;
            let n = self.placed.len() as u64;
            let zip64_eocd = zip64_end.then_some(self.pos);
            if let Some(z64_offset) = zip64_eocd {
                let mut z = Vec::new();
                z.extend(ZIP64_EOCD_SIG.to_le_bytes());
                z.extend(44u64.to_le_bytes());
                z.extend(0x031Eu16.to_le_bytes());
                z.extend(45u16.to_le_bytes());
                z.extend([0u8; 8]); // disk, cd disk
                z.extend(n.to_le_bytes());
                z.extend(n.to_le_bytes());
                z.extend(cd_size.to_le_bytes());
                z.extend(cd_offset.to_le_bytes());
                z.extend(LOCATOR_SIG.to_le_bytes());
                z.extend(0u32.to_le_bytes());
                z.extend(z64_offset.to_le_bytes());
                z.extend(1u32.to_le_bytes());
                self.put(&z);
            }
            let eocd = self.pos;
            let mut e = Vec::new();
            e.extend(EOCD_SIG.to_le_bytes());
            e.extend([0u8; 4]); // disk, cd disk
            e.extend((n.min(0xFFFF) as u16).to_le_bytes());
            e.extend((n.min(0xFFFF) as u16).to_le_bytes());
            e.extend((cd_size.min(BIG) as u32).to_le_bytes());
            e.extend((cd_offset.min(BIG) as u32).to_le_bytes());
            e.extend(0u16.to_le_bytes());
            self.put(&e);
            Image {
                len: self.pos,
                chunks: self.chunks.clone(),
                placed: self.placed.clone(),
                align: self.align,
                cd_offset,
                cd_entries,
                zip64_eocd,
                eocd,
            }
        }
    }

    impl Image {
        fn to_vec(&self) -> Vec<u8> {
            let mut v = vec![0u8; self.len as usize];
            for (at, bytes) in &self.chunks {
                v[*at as usize..*at as usize + bytes.len()].copy_from_slice(bytes);
            }
            v
        }

        /// A sparse temporary file: only the headers are written.
        fn to_file(&self) -> File {
            let f = tempfile::tempfile().unwrap();
            f.set_len(self.len).unwrap();
            for (at, bytes) in &self.chunks {
                f.write_all_at(bytes, *at).unwrap();
            }
            f
        }

        fn expected(&self) -> Vec<Record> {
            self.placed
                .iter()
                .zip(&self.cd_entries)
                .map(|(p, &cd)| Record {
                    name: String::from_utf8(p.name.clone()).unwrap(),
                    header_offset: p.header_offset,
                    data_offset: p.data_offset,
                    size: p.size,
                    crc32: p.crc32,
                    cd_entry_offset: cd,
                })
                .collect()
        }

        fn check(&self, a: &Archive) {
            assert_eq!(a.records, self.expected());
            assert_eq!(a.file_len, self.len);
            for r in &a.records {
                assert_eq!(r.data_offset % self.align, 0, "{r:?}");
            }
        }
    }

    fn torch_like(align: u64, storages: &[Data]) -> Image {
        let align_text = align.to_string();
        let mut b = Builder::new(align);
        b.add("archive/data.pkl", Data::Bytes(&PKL))
            .add("archive/.format_version", Data::Bytes(b"1"))
            .add(
                "archive/.storage_alignment",
                Data::Bytes(align_text.as_bytes()),
            )
            .add("archive/byteorder", Data::Bytes(b"little"));
        for (k, data) in storages.iter().enumerate() {
            let data = match data {
                Data::Bytes(b) => Data::Bytes(b),
                Data::Hole(n) => Data::Hole(*n),
            };
            b.add(format!("archive/data/{k}"), data);
        }
        b.add("archive/version", Data::Bytes(b"3\n"))
            .add("archive/.data/serialization_id", Data::Bytes(&[b'7'; 40]))
            .finish(true)
    }

    /// Nine records: data/0 of 64 bytes, an empty data/1, data/2 of 100 bytes.
    fn small() -> Image {
        torch_like(
            64,
            &[
                Data::Bytes(&[7; 64]),
                Data::Bytes(&[]),
                Data::Bytes(&[9; 100]),
            ],
        )
    }

    /// The same records without ZIP64 end records, as Python's zipfile writes small archives.
    fn small_classic() -> Image {
        let mut b = Builder::new(64);
        b.add("archive/data.pkl", Data::Bytes(&PKL))
            .add("archive/data/0", Data::Bytes(&[7; 64]))
            .add("archive/data/1", Data::Bytes(&[5; 3]));
        b.finish(false)
    }

    fn set16(v: &mut [u8], at: u64, x: u16) {
        v[at as usize..at as usize + 2].copy_from_slice(&x.to_le_bytes());
    }
    fn set32(v: &mut [u8], at: u64, x: u32) {
        v[at as usize..at as usize + 4].copy_from_slice(&x.to_le_bytes());
    }
    fn set64(v: &mut [u8], at: u64, x: u64) {
        v[at as usize..at as usize + 8].copy_from_slice(&x.to_le_bytes());
    }

    fn reason(r: Result<Archive>) -> String {
        match r {
            Err(Error::Format { reason, .. }) => reason,
            other => panic!("expected a Format error, got {other:?}"),
        }
    }

    #[track_caller]
    fn rejects(bytes: &[u8], needle: &str) {
        let msg = reason(map_bytes(bytes));
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }

    /// Maps `v` after `patch`, expecting a Format error containing `needle`.
    #[track_caller]
    fn rejects_patched(v: &[u8], needle: &str, patch: impl FnOnce(&mut Vec<u8>)) {
        let mut v = v.to_vec();
        patch(&mut v);
        rejects(&v, needle);
    }

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures")).join(name)
    }

    fn map_fixture(name: &str) -> Result<Archive> {
        let path = fixture(name);
        map_file(&File::open(&path).unwrap(), Some(&path))
    }

    #[track_caller]
    fn assert_records(a: &Archive, want: &[(&str, u64, u64, u64, u32)]) {
        let got: Vec<_> = a
            .records
            .iter()
            .map(|r| {
                (
                    r.name.as_str(),
                    r.header_offset,
                    r.data_offset,
                    r.size,
                    r.crc32,
                )
            })
            .collect();
        assert_eq!(got, want);
    }

    // ---- accepted archives ----

    /// Counts the reads made through it.
    struct Counted<'a>(BytesSource<'a>, std::cell::Cell<usize>);

    impl Source for Counted<'_> {
        fn size(&self) -> u64 {
            self.0.size()
        }

        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            self.1.set(self.1.get() + 1);
            self.0.read_at(buf, offset)
        }
    }

    #[test]
    fn close_local_headers_are_read_together_far_ones_alone() {
        // 300 records of 1 KiB: their headers in a few reads (a window is at
        // most 1 MiB), not one each; 3 records 200 KiB apart: one read each.
        for (count, size, most) in [(300usize, 1024usize, 6usize), (3, 200 << 10, 3)] {
            let data = vec![5u8; size];
            let mut b = Builder::new(64);
            b.add("archive/data.pkl", Data::Bytes(&PKL));
            for i in 0..count {
                b.add(format!("archive/data/{i}"), Data::Bytes(&data));
            }
            let img = b.finish(false);
            let bytes = img.to_vec();
            let src = Counted(BytesSource(&bytes), std::cell::Cell::new(0));
            let a = map(&src, None).unwrap();
            img.check(&a);
            // The end records and the central directory take their own reads.
            let header_reads = src.1.get() - 3;
            assert!(
                header_reads <= most,
                "{count} records: {header_reads} header reads"
            );
        }
    }

    #[test]
    fn torch_layout_alignment_64() {
        let img = small();
        let bytes = img.to_vec();
        let a = map_bytes(&bytes).unwrap();
        img.check(&a);
        assert_eq!(a, map_file(&img.to_file(), None).unwrap());
        assert_eq!(a.prefix(), "archive");
        let r0 = a.storage("0").unwrap();
        assert_eq!(r0.name, "archive/data/0");
        let d0 = r0.data_offset as usize;
        assert_eq!(&bytes[d0..d0 + 64], &[7; 64]);
        let r1 = a.storage("1").unwrap();
        assert_eq!((r1.size, r1.data_offset % 64), (0, 0));
        assert_eq!(a.storage("2").unwrap().size, 100);
        assert!(a.storage("3").is_none());
        assert!(a.storage("x").is_none());
        assert_eq!(a.get("archive/version").unwrap().size, 2);
        assert!(a.get("version").is_none());
        // Data descriptors of 16 bytes separate the records, as in torch's files.
        for w in a.records.windows(2) {
            assert_eq!(w[0].data_offset + w[0].size + 16, w[1].header_offset);
        }
    }

    #[test]
    fn torch_layout_alignment_4096() {
        let big = vec![3u8; 5000];
        let img = torch_like(4096, &[Data::Bytes(&big), Data::Bytes(&[1; 4096])]);
        let a = map_bytes(&img.to_vec()).unwrap();
        img.check(&a);
        assert_eq!(a, map_file(&img.to_file(), None).unwrap());
        assert_eq!(a.storage("0").unwrap().size, 5000);
        assert_eq!(a.storage("1").unwrap().data_offset % 4096, 0);
    }

    #[test]
    fn one_tiny_record() {
        for zip64_end in [true, false] {
            let mut b = Builder::new(64);
            b.add("t/x", Data::Bytes(b"z"));
            let img = b.finish(zip64_end);
            let a = map_bytes(&img.to_vec()).unwrap();
            img.check(&a);
            assert_eq!(a.records[0].data_offset, 64);
            assert_eq!(a.prefix(), "t");
        }
    }

    #[test]
    fn empty_records_and_empty_archives() {
        let img = torch_like(64, &[Data::Bytes(&[]), Data::Bytes(&[]), Data::Bytes(&[])]);
        img.check(&map_bytes(&img.to_vec()).unwrap());
        for zip64_end in [true, false] {
            let img = Builder::new(64).finish(zip64_end);
            let a = map_bytes(&img.to_vec()).unwrap();
            assert!(a.records.is_empty());
            assert_eq!(a.prefix(), "");
            assert!(a.storage("0").is_none());
        }
    }

    #[test]
    fn classic_archive_without_zip64_records() {
        let img = small_classic();
        assert!(img.zip64_eocd.is_none());
        img.check(&map_bytes(&img.to_vec()).unwrap());
    }

    #[test]
    fn zip64_extra_in_every_entry() {
        let mut b = Builder::new(64);
        b.zip64_everywhere = true;
        b.add("archive/data.pkl", Data::Bytes(&PKL))
            .add("archive/data/0", Data::Bytes(&[7; 64]));
        let img = b.finish(true);
        img.check(&map_bytes(&img.to_vec()).unwrap());
    }

    #[test]
    fn trailing_bytes_and_comments() {
        let img = small();
        let mut v = img.to_vec();
        v.extend(b"trailing junk");
        img.check(&map_bytes(&v).unwrap().clone_with_len(img.len));
        // A real archive comment.
        let mut v = img.to_vec();
        set16(&mut v, img.eocd + 20, 5);
        v.extend(b"hello");
        img.check(&map_bytes(&v).unwrap().clone_with_len(img.len));
    }

    impl Archive {
        fn clone_with_len(&self, file_len: u64) -> Archive {
            Archive {
                file_len,
                ..self.clone()
            }
        }
    }

    #[test]
    fn storage_lookup_does_not_depend_on_record_order() {
        let rec = |name: &str, off: u64| Record {
            name: name.to_owned(),
            header_offset: off,
            data_offset: off + 64,
            size: 1,
            crc32: 0,
            cd_entry_offset: 0,
        };
        let a = Archive {
            records: vec![
                rec("m/data.pkl", 0),
                rec("m/data/1", 100),
                rec("m/data/0", 200),
                rec("m/data/10", 300),
                rec("m/.format_version", 400),
                rec("m/data/2", 500),
            ],
            file_len: 1000,
            ..Default::default()
        };
        assert_eq!(a.prefix(), "m");
        for key in ["0", "1", "2", "10"] {
            assert_eq!(a.storage(key).unwrap().name, format!("m/data/{key}"));
        }
        assert!(a.storage("3").is_none());
        assert!(a.storage("").is_none());
        let a = Archive {
            records: vec![rec("noslash", 0)],
            file_len: 100,
            ..Default::default()
        };
        assert_eq!(a.prefix(), "");
    }

    #[test]
    fn zip64_record_of_4_gib_in_a_sparse_file() {
        let size = 4 * GIB + 123;
        let img = torch_like(64, &[Data::Hole(size), Data::Bytes(&[1; 256])]);
        let f = img.to_file();
        let a = map_file(&f, None).unwrap();
        img.check(&a);
        let (r0, r1) = (a.storage("0").unwrap(), a.storage("1").unwrap());
        assert_eq!(r0.size, size);
        assert!(r0.header_offset < BIG);
        // 24-byte descriptor after a zip64 record, as torch writes it.
        assert_eq!(r1.header_offset, r0.data_offset + size + 24);
        assert!(r1.header_offset > BIG);
        let mut got = [0u8; 256];
        f.read_exact_at(&mut got, r1.data_offset).unwrap();
        assert_eq!(got, [1; 256]);
        // The classic end record overflowed: the ZIP64 one carried the offset.
        let mut e = [0u8; EOCD_LEN];
        f.read_exact_at(&mut e, img.eocd).unwrap();
        assert_eq!(le32(&e, 16), SAT32);
    }

    #[test]
    fn zip64_header_offsets_past_4_gib_in_a_sparse_file() {
        // No record reaches 4 GiB, but the later headers start past it.
        let img = torch_like(
            4096,
            &[
                Data::Hole(5 * GIB / 2),
                Data::Hole(5 * GIB / 2),
                Data::Bytes(&[2; 10]),
                Data::Bytes(&[]),
            ],
        );
        let a = map_file(&img.to_file(), None).unwrap();
        img.check(&a);
        assert!(a.records.iter().all(|r| r.size < BIG));
        assert!(a.storage("1").unwrap().header_offset < BIG);
        for key in ["2", "3"] {
            assert!(a.storage(key).unwrap().header_offset > BIG);
        }
        assert!(img.cd_offset > BIG);
    }

    // ---- committed fixtures, written by torch and Python's zipfile ----

    #[test]
    fn torch_fixture_alignment_64() {
        let a = map_fixture("torch_small_a64.pt").unwrap();
        assert_records(
            &a,
            &[
                ("torch_small_a64/data.pkl", 0, 64, 297, 0xa865_e613),
                ("torch_small_a64/.format_version", 377, 448, 1, 0x83dc_efb7),
                (
                    "torch_small_a64/.storage_alignment",
                    465,
                    576,
                    2,
                    0xe971_773f,
                ),
                ("torch_small_a64/byteorder", 594, 704, 6, 0x19e3_3d85),
                ("torch_small_a64/data/0", 726, 832, 64, 0x21c0_b223),
                ("torch_small_a64/data/1", 912, 1024, 64, 0x747c_2f27),
                ("torch_small_a64/version", 1104, 1216, 2, 0x5567_9ed1),
                (
                    "torch_small_a64/.data/serialization_id",
                    1234,
                    1344,
                    40,
                    0xe673_04d7,
                ),
            ],
        );
        assert_eq!(a.file_len, 2085);
        assert_eq!(a.prefix(), "torch_small_a64");
        // _checkpoint_offset of tensors a (and its view a[4:8]) and b.
        assert_eq!(a.storage("0").map(|r| r.data_offset), Some(832));
        assert_eq!(a.storage("1").map(|r| r.data_offset), Some(1024));
    }

    #[test]
    fn torch_fixture_alignment_4096() {
        let a = map_fixture("torch_small_a4096.pt").unwrap();
        assert_records(
            &a,
            &[
                ("torch_small_a4096/data.pkl", 0, 4096, 297, 0xa865_e613),
                (
                    "torch_small_a4096/.format_version",
                    4409,
                    8192,
                    1,
                    0x83dc_efb7,
                ),
                (
                    "torch_small_a4096/.storage_alignment",
                    8209,
                    12288,
                    4,
                    0xbb58_4d59,
                ),
                ("torch_small_a4096/byteorder", 12308, 16384, 6, 0x19e3_3d85),
                ("torch_small_a4096/data/0", 16406, 20480, 64, 0x21c0_b223),
                ("torch_small_a4096/data/1", 20560, 24576, 64, 0x747c_2f27),
                ("torch_small_a4096/version", 24656, 28672, 2, 0x5567_9ed1),
                (
                    "torch_small_a4096/.data/serialization_id",
                    28690,
                    32768,
                    40,
                    0xb270_679b,
                ),
            ],
        );
        assert_eq!(a.storage("0").map(|r| r.data_offset), Some(20480));
        assert_eq!(a.storage("1").map(|r| r.data_offset), Some(24576));
    }

    #[test]
    fn python_zipfile_stored_fixture() {
        let a = map_fixture("zipfile_stored.zip").unwrap();
        assert_records(
            &a,
            &[
                ("archive/data.pkl", 0, 46, 104, 0xe961_536a),
                ("archive/data/0", 150, 194, 256, 0x2905_8c73),
            ],
        );
        let bytes = std::fs::read(fixture("zipfile_stored.zip")).unwrap();
        let want: Vec<u8> = (0..=255).collect();
        assert_eq!(&bytes[194..194 + 256], &want[..]);
    }

    #[test]
    fn python_zipfile_deflated_fixture_is_rejected() {
        let err = map_fixture("zipfile_deflated.zip").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(
                "record \"archive/data.pkl\" is compressed (method 8): torch.load inflates it"
            ),
            "{text}"
        );
        assert!(text.contains("zipfile_deflated.zip"), "{text}");
    }

    // ---- rejected archives ----

    #[test]
    fn rejects_missing_or_garbled_end_record() {
        rejects(&[], "too short");
        rejects(&[0; 21], "too short");
        rejects(&[0; 1000], "no end-of-central-directory record");
        let img = small();
        let v = img.to_vec();
        rejects(&v[..v.len() - 1], "no end-of-central-directory record");
        rejects(&v[..v.len() / 2], "no end-of-central-directory record");
        // A comment longer than what follows the record.
        rejects_patched(&v, "no end-of-central-directory record", |v| {
            set16(v, img.eocd + 20, 100)
        });
        rejects_patched(&v, "no end-of-central-directory record", |v| {
            set32(v, img.eocd, 0)
        });
    }

    #[test]
    fn rejects_bad_zip64_end_records() {
        let img = small();
        let v = img.to_vec();
        let loc = img.eocd - LOCATOR_LEN as u64;
        rejects_patched(&v, "no ZIP64 end record at offset 0", |v| {
            set64(v, loc + 8, 0)
        });
        rejects_patched(&v, "no ZIP64 end record fits", |v| {
            set64(v, loc + 8, u64::MAX - 10)
        });
        rejects_patched(&v, "no ZIP64 end record fits", |v| set64(v, loc + 8, loc));
        // The classic and ZIP64 records must agree where the classic field is not saturated.
        rejects_patched(&v, "ZIP64 end record says", |v| set16(v, img.eocd + 10, 3));
        rejects_patched(&v, "ZIP64 end record says", |v| set32(v, img.eocd + 16, 1));
    }

    #[test]
    fn rejects_central_directory_out_of_bounds() {
        let img = small_classic();
        let v = img.to_vec();
        let needle = "lies outside the file";
        rejects_patched(&v, needle, |v| set32(v, img.eocd + 16, img.len as u32));
        rejects_patched(&v, needle, |v| set32(v, img.eocd + 12, SAT32 - 1));
        rejects_patched(&v, needle, |v| {
            set32(v, img.eocd + 12, (img.eocd - img.cd_offset + 1) as u32)
        });
        let img = small();
        let z = img.zip64_eocd.unwrap();
        let v = img.to_vec();
        rejects_patched(&v, needle, |v| {
            set32(v, img.eocd + 16, SAT32);
            set64(v, z + 48, u64::MAX - 5);
        });
        rejects_patched(&v, needle, |v| {
            set32(v, img.eocd + 12, SAT32);
            set64(v, z + 40, 1 << 40);
        });
    }

    #[test]
    fn rejects_entry_count_mismatch() {
        let img = small();
        let z = img.zip64_eocd.unwrap();
        let v = img.to_vec();
        let set_count = |v: &mut Vec<u8>, n: u64| {
            set16(v, img.eocd + 8, n as u16);
            set16(v, img.eocd + 10, n as u16);
            set64(v, z + 24, n);
            set64(v, z + 32, n);
        };
        rejects_patched(&v, "declares 10 entries, but the central directory", |v| {
            set_count(v, 10)
        });
        rejects_patched(
            &v,
            "declares 8 entries, but the central directory has",
            |v| set_count(v, 8),
        );
        let img = small_classic();
        let v = img.to_vec();
        // More entries than could fit in the directory's bytes: refused before allocating.
        rejects_patched(&v, "holds at most", |v| {
            set16(v, img.eocd + 8, 0xFFFF);
            set16(v, img.eocd + 10, 0xFFFF);
        });
        let img = small();
        let z = img.zip64_eocd.unwrap();
        rejects_patched(&img.to_vec(), "holds at most", |v| {
            set16(v, img.eocd + 8, 0xFFFF);
            set16(v, img.eocd + 10, 0xFFFF);
            set64(v, z + 24, u64::MAX);
            set64(v, z + 32, u64::MAX);
        });
    }

    #[test]
    fn rejects_bad_signatures() {
        let img = small();
        let v = img.to_vec();
        rejects_patched(&v, "central directory entry #0 at offset", |v| {
            set32(v, img.cd_entries[0], 0x0403_4b50)
        });
        rejects_patched(&v, "central directory entry #5 at offset", |v| {
            set32(v, img.cd_entries[5], 0)
        });
        let lho = img.placed[4].header_offset;
        rejects_patched(
            &v,
            "record \"archive/data/0\": no local header at offset",
            |v| set32(v, lho, 0x0201_4b50),
        );
        // The local header must name the same record.
        rejects_patched(&v, "names another record", |v| v[lho as usize + 30] = b'X');
        rejects_patched(&v, "names another record", |v| set16(v, lho + 26, 3));
    }

    #[test]
    fn rejects_compressed_encrypted_and_size_mismatch() {
        let img = small();
        let v = img.to_vec();
        let e = img.cd_entries[4];
        rejects_patched(
            &v,
            "record \"archive/data/0\" is compressed (method 8): torch.load inflates it",
            |v| set16(v, e + 10, 8),
        );
        rejects_patched(
            &v,
            "record \"archive/data/0\" has flags 0x0809: encrypted",
            |v| set16(v, e + 8, 0x0809),
        );
        rejects_patched(&v, "has flags 0x0848: encrypted", |v| {
            set16(v, e + 8, 0x0848)
        });
        rejects_patched(
            &v,
            "record \"archive/data/0\" has compressed size 63 but uncompressed size 64",
            |v| set32(v, e + 20, 63),
        );
    }

    #[test]
    fn rejects_data_past_end_of_file() {
        let img = small();
        let last = *img.cd_entries.last().unwrap();
        rejects_patched(&img.to_vec(), "run past the end of the file", |v| {
            set32(v, last + 20, 0x7FFF_0000);
            set32(v, last + 24, 0x7FFF_0000);
        });
        rejects_patched(&img.to_vec(), "local header at offset", |v| {
            set32(v, last + 42, (img.len - 10) as u32);
        });
    }

    #[test]
    fn rejects_overlapping_records() {
        let img = small();
        let (a, b) = (&img.placed[4], &img.placed[5]);
        // data/0 grows one byte into data/1's local header.
        let size = (b.header_offset - a.data_offset + 1) as u32;
        let e = img.cd_entries[4];
        rejects_patched(&img.to_vec(), "\"archive/data/0\" [", |v| {
            set32(v, e + 20, size);
            set32(v, e + 24, size);
        });
        // A second entry whose header hides inside the first record's data.
        let mut fake = Vec::new();
        fake.extend(LH_SIG.to_le_bytes());
        fake.extend([0u8; 22]);
        fake.extend(9u16.to_le_bytes());
        fake.extend(0u16.to_le_bytes());
        fake.extend(b"archive/b2");
        let mut b = Builder::new(64);
        b.add("archive/a", Data::Bytes(&fake))
            .add("archive/b", Data::Bytes(b"2"));
        let img = b.finish(true);
        let inner = img.placed[0].data_offset as u32;
        rejects_patched(&img.to_vec(), "records \"archive/a\" [", |v| {
            set32(v, img.cd_entries[1] + 42, inner)
        });
        // The last record runs into the central directory.
        let img = small();
        let last = *img.cd_entries.last().unwrap();
        let p = img.placed.last().unwrap();
        let size = (img.cd_offset - p.data_offset + 1) as u32;
        rejects_patched(&img.to_vec(), "overlaps the central directory", |v| {
            set32(v, last + 20, size);
            set32(v, last + 24, size);
        });
    }

    #[test]
    fn rejects_duplicate_and_non_utf8_names() {
        let mut b = Builder::new(64);
        b.add("archive/x", Data::Bytes(b"1"))
            .add("archive/x", Data::Bytes(b"2"));
        rejects(
            &b.finish(true).to_vec(),
            "duplicate record name \"archive/x\"",
        );
        let mut b = Builder::new(64);
        b.add(b"archive/\xff\xfe", Data::Bytes(b"1"));
        rejects(&b.finish(true).to_vec(), "name that is not UTF-8");
    }

    #[test]
    fn rejects_disk_spanning() {
        let img = small_classic();
        let v = img.to_vec();
        rejects_patched(&v, "spans several disks", |v| set16(v, img.eocd + 4, 1));
        rejects_patched(&v, "spans several disks", |v| set16(v, img.eocd + 6, 1));
        rejects_patched(&v, "spans several disks", |v| set16(v, img.eocd + 8, 1));
        rejects_patched(&v, "starts on disk 2", |v| {
            set16(v, img.cd_entries[1] + 34, 2)
        });
        let img = small();
        let z = img.zip64_eocd.unwrap();
        let loc = img.eocd - LOCATOR_LEN as u64;
        let v = img.to_vec();
        rejects_patched(&v, "spans several disks", |v| set32(v, z + 16, 1));
        rejects_patched(&v, "spans several disks", |v| set32(v, z + 20, 1));
        rejects_patched(&v, "spans several disks", |v| set64(v, z + 24, 1));
        rejects_patched(&v, "spans several disks", |v| set32(v, loc + 4, 1));
        rejects_patched(&v, "spans several disks", |v| set32(v, loc + 16, 2));
        rejects_patched(&v, "the disk number is 1", |v| set16(v, img.eocd + 4, 1));
    }

    #[test]
    fn an_archive_inside_a_larger_file() {
        let img = small();
        let inner = img.to_vec();
        let mut whole = vec![0xAB; 5000];
        whole.extend(&inner);
        whole.extend([0xCD; 300]);
        let mut f = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut f, &whole).unwrap();
        let a = map_file_range(&f, None, 5000, inner.len() as u64).unwrap();
        let alone = map_bytes(&inner).unwrap();
        assert_eq!(a.records.len(), alone.records.len());
        for (r, s) in a.records.iter().zip(&alone.records) {
            assert_eq!(
                (r.data_offset, r.size, r.crc32),
                (s.data_offset + 5000, s.size, s.crc32)
            );
            assert_eq!(
                &whole[r.data_offset as usize..][..r.size as usize],
                &inner[s.data_offset as usize..][..s.size as usize]
            );
        }
        // The range is the whole world: its end records must be inside it.
        let e = map_file_range(&f, None, 5000, inner.len() as u64 - 1).unwrap_err();
        assert!(e.to_string().contains("item at bytes 5000.."), "{e}");
        let e = map_file_range(&f, None, 5000, whole.len() as u64).unwrap_err();
        assert!(e.to_string().contains("past the end of the file"), "{e}");
    }

    #[test]
    fn rejects_what_torch_refuses() {
        // Flag bits torch's reader refuses (encryption, patch data, masked
        // headers); the data-descriptor and UTF-8 bits it writes itself pass.
        let img = small();
        let v = img.to_vec();
        for bit in [0, 5, 6, 13] {
            rejects_patched(&v, "which torch's reader refuses", |v| {
                set16(v, img.cd_entries[2] + 8, 0x0808 | 1 << bit)
            });
        }
        for bit in [1, 2, 4, 7, 12, 15] {
            let mut w = v.clone();
            set16(&mut w, img.cd_entries[2] + 8, 0x0808 | 1 << bit);
            img.check(&map_bytes(&w).unwrap());
        }
        // The ZIP64 end record's own size field, and the locator's disk count.
        let z = img.zip64_eocd.unwrap();
        for size in [0, 43] {
            rejects_patched(&v, "declares a size of", |v| set64(v, z + 4, size));
        }
        let loc = img.eocd - LOCATOR_LEN as u64;
        rejects_patched(&v, "spans several disks", |v| set32(v, loc + 16, 0));
        // An entry miniz takes for a folder (DOS directory bit): torch reads
        // none of it, and neither does the map.
        let mut w = v.clone();
        set32(&mut w, img.cd_entries[2] + 38, 0xD6);
        let a = map_bytes(&w).unwrap();
        assert_eq!(a.records.len(), img.placed.len() - 1);
        let folder = std::str::from_utf8(&img.placed[2].name).unwrap();
        assert!(a.get(folder).is_none());
        let mut w = v.clone();
        set32(&mut w, img.cd_entries[2] + 38, 0o644 << 16); // Unix mode bits: a file
        img.check(&map_bytes(&w).unwrap());
    }

    #[test]
    fn folder_entries_are_passed_over_and_every_entry_lies_in_the_archives_folder() {
        // An unzipped checkpoint zipped again with its folders listed (Info-ZIP's `zip -r`).
        let mut b = Builder::new(64);
        b.add("m/", Data::Bytes(&[]))
            .add("m/data.pkl", Data::Bytes(&PKL))
            .add("m/data/", Data::Bytes(&[]))
            .add("m/data/0", Data::Bytes(&[7; 64]));
        let a = map_bytes(&b.finish(true).to_vec()).unwrap();
        let names: Vec<&str> = a.records.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["m/data.pkl", "m/data/0"]);
        assert_eq!(a.prefix(), "m");
        assert_eq!(a.storage("0").unwrap().size, 64);
        // torch.load lists every entry and refuses one outside the first one's folder.
        for (names, outside) in [
            (
                &["m/data.pkl", "notes/readme.txt"][..],
                "subdirectory m/: \"notes/readme.txt\"",
            ),
            (
                &["m/data.pkl", "mx/data/0"],
                "subdirectory m/: \"mx/data/0\"",
            ),
            (&["data.pkl", "m/data/0"], "subdirectory : \"data.pkl\""),
        ] {
            let mut b = Builder::new(64);
            for n in names {
                b.add(n, Data::Bytes(&[1; 8]));
            }
            rejects(&b.finish(true).to_vec(), outside);
        }
    }

    #[test]
    fn rejects_missing_zip64_fields() {
        let img = small();
        let e = img.cd_entries[4];
        rejects_patched(
            &img.to_vec(),
            "zip64 extra field that is missing or garbled",
            |v| set32(v, e + 24, SAT32),
        );
        rejects_patched(&img.to_vec(), "starts on disk 65535", |v| {
            set16(v, e + 34, SAT16)
        });
        let mut b = Builder::new(64);
        b.zip64_everywhere = true;
        b.add("archive/data/0", Data::Bytes(&[7; 64]));
        let img = b.finish(true);
        let e = img.cd_entries[0];
        let extra = e + 46 + 14;
        // A disk number deferred to the extra is refused, as torch's reader does.
        rejects_patched(&img.to_vec(), "starts on disk 65535", |v| {
            set16(v, e + 34, SAT16)
        });
        // A block whose length overruns the extra field.
        rejects_patched(
            &img.to_vec(),
            "zip64 extra field that is missing or garbled",
            |v| set16(v, extra + 2, 25),
        );
        // Only 16 of the 24 bytes are a zip64 block: the offset is missing.
        rejects_patched(&img.to_vec(), "lacks the local header offset", |v| {
            set16(v, extra + 2, 16);
            set16(v, extra + 20, 0x4246);
            set16(v, extra + 22, 0);
        });
        rejects_patched(
            &img.to_vec(),
            "zip64 extra field that is missing or garbled",
            |v| set16(v, extra, 0x4246),
        );
    }

    #[test]
    fn io_errors_keep_their_source() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.pt");
        std::fs::write(&path, small().to_vec()).unwrap();
        // Opened for writing only: pread fails with EBADF.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        match map_file(&f, Some(&path)) {
            Err(e @ Error::Io { op: "pread", .. }) => {
                assert_eq!(e.raw_os_error(), Some(libc::EBADF));
                assert!(e.to_string().contains("w.pt"), "{e}");
            }
            other => panic!("expected a pread error, got {other:?}"),
        }
    }

    /// Cheap deterministic fuzzing: truncations and random byte changes must
    /// give errors or consistent archives, never panics.
    #[test]
    fn corrupted_archives_never_panic() {
        let mut zip64_all = Builder::new(64);
        zip64_all.zip64_everywhere = true;
        zip64_all
            .add("archive/data.pkl", Data::Bytes(&PKL))
            .add("archive/data/0", Data::Bytes(&[7; 64]));
        let images = [small(), small_classic(), zip64_all.finish(true)];
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for img in images {
            let base = img.to_vec();
            for cut in 0..base.len() {
                assert!(map_bytes(&base[..cut]).is_err(), "prefix of {cut} bytes");
            }
            // Headers live past the data and at the start of each record: aim there.
            let hot: Vec<usize> = img
                .placed
                .iter()
                .flat_map(|p| p.header_offset as usize..p.data_offset as usize)
                .chain(img.cd_offset as usize..base.len())
                .collect();
            for _ in 0..20_000 {
                let mut v = base.clone();
                for _ in 0..1 + next() % 4 {
                    let at = hot[next() as usize % hot.len()];
                    v[at] = match next() % 4 {
                        0 => 0,
                        1 => 0xFF,
                        _ => next() as u8,
                    };
                }
                if let Ok(a) = map_bytes(&v) {
                    assert_records_fit(&a, v.len());
                }
            }
        }
    }

    /// proptest: mutated, truncated, spliced and random archives (built ones and real torch
    /// files) never panic; every refusal is a typed `Format` error; anything accepted is
    /// in bounds and disjoint, and its comment parses.
    mod fuzz {
        use super::*;
        use proptest::collection::vec;
        use proptest::prelude::*;
        use proptest::sample::Index;

        fn seeds() -> Vec<Vec<u8>> {
            let mut zip64_all = Builder::new(64);
            zip64_all.zip64_everywhere = true;
            zip64_all
                .add("archive/data.pkl", Data::Bytes(&PKL))
                .add("archive/data/0", Data::Bytes(&[7; 64]));
            let mut out = vec![
                small().to_vec(),
                small_classic().to_vec(),
                zip64_all.finish(true).to_vec(),
            ];
            for f in [
                "torch_small_a64.pt",
                "torch_small_a4096.pt",
                "zipfile_stored.zip",
            ] {
                out.push(std::fs::read(fixture(f)).unwrap());
            }
            out
        }

        #[derive(Debug, Clone)]
        enum Edit {
            Set(Index, u8),
            Flip(Index, u8),
            Truncate(Index),
            /// Copy `len` bytes from one place to another.
            Splice(Index, Index, u8),
            /// A 32-bit field set to a boundary value.
            Field(Index, u32),
        }

        fn edit() -> impl Strategy<Value = Edit> {
            prop_oneof![
                (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
                (any::<Index>(), 0u8..8).prop_map(|(i, b)| Edit::Flip(i, b)),
                any::<Index>().prop_map(Edit::Truncate),
                (any::<Index>(), any::<Index>(), any::<u8>())
                    .prop_map(|(a, b, n)| Edit::Splice(a, b, n)),
                (
                    any::<Index>(),
                    prop_oneof![
                        Just(0u32),
                        Just(u32::MAX),
                        Just(u32::MAX - 1),
                        Just(1u32 << 31),
                        any::<u32>()
                    ]
                )
                    .prop_map(|(i, v)| Edit::Field(i, v)),
            ]
        }

        fn apply(v: &mut Vec<u8>, e: &Edit) {
            if v.is_empty() {
                return;
            }
            match e {
                Edit::Set(i, b) => {
                    let at = i.index(v.len());
                    v[at] = *b;
                }
                Edit::Flip(i, bit) => {
                    let at = i.index(v.len());
                    v[at] ^= 1 << bit;
                }
                Edit::Truncate(i) => v.truncate(i.index(v.len())),
                Edit::Splice(from, to, n) => {
                    let (a, b) = (from.index(v.len()), to.index(v.len()));
                    let n = usize::from(*n).min(v.len() - a).min(v.len() - b);
                    let chunk = v[a..a + n].to_vec();
                    v[b..b + n].copy_from_slice(&chunk);
                }
                Edit::Field(i, x) => {
                    if v.len() >= 4 {
                        let at = i.index(v.len() - 3);
                        v[at..at + 4].copy_from_slice(&x.to_le_bytes());
                    }
                }
            }
        }

        fn check(v: &[u8]) {
            match map_bytes(v) {
                Ok(a) => {
                    assert_records_fit(&a, v.len());
                    assert_eq!(
                        crate::format::integrity::declared(&a).len(),
                        a.records.len()
                    );
                }
                Err(Error::Format { .. }) => {}
                Err(e) => panic!("untyped refusal: {e:?}"),
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

            #[test]
            fn mutated_archives(seed in 0usize..6, edits in vec(edit(), 1..6)) {
                let mut v = seeds().swap_remove(seed);
                for e in &edits {
                    apply(&mut v, e);
                }
                check(&v);
            }

            #[test]
            fn random_bytes_with_an_end_record(
                body in vec(any::<u8>(), 0..600),
                fields in vec(any::<u8>(), 18),
                comment in vec(any::<u8>(), 0..40),
            ) {
                // An end record (so parsing gets past the first check) after random bytes.
                let mut v = body;
                v.extend(EOCD_SIG.to_le_bytes());
                v.extend(&fields[..16]);
                v.extend((comment.len() as u16).to_le_bytes());
                v.extend(&comment);
                check(&v);
            }
        }
    }

    /// Bytes behind a [`RangeReader`] that counts its batches.
    struct Batches(Vec<u8>, std::cell::Cell<usize>);

    impl RangeReader for Batches {
        fn size(&self) -> u64 {
            self.0.len() as u64
        }

        fn read_ranges(&self, ranges: &mut [(u64, &mut [u8])]) -> Result<()> {
            self.1.set(self.1.get() + 1);
            for (at, buf) in ranges.iter_mut() {
                let at = *at as usize;
                buf.copy_from_slice(&self.0[at..at + buf.len()]);
            }
            Ok(())
        }
    }

    /// What map_remote finds: map()'s records, the small records' bytes, and
    /// every predicted data offset confirmed by its local header.
    #[track_caller]
    fn check_remote(bytes: Vec<u8>, tail: u64, batches: usize) -> RemoteArchive {
        let want = map_bytes(&bytes).unwrap();
        let src = Batches(bytes, std::cell::Cell::new(0));
        let got = map_remote(&src, None, tail).unwrap();
        assert_eq!(src.1.get(), batches);
        for (a, b) in got.archive.records.iter().zip(&want.records) {
            assert_eq!(
                (&a.name, a.header_offset, a.size),
                (&b.name, b.header_offset, b.size)
            );
            if a.size > 0 {
                assert_eq!(a.data_offset, b.data_offset, "{}", a.name);
            }
        }
        for (name, data) in &got.small {
            let r = want.get(name).unwrap();
            let at = r.data_offset as usize;
            assert_eq!(&src.0[at..at + r.size as usize], &data[..], "{name}");
        }
        for &i in &got.predicted {
            let r = &got.archive.records[i];
            let head = &src.0[r.header_offset as usize..r.data_offset as usize];
            assert!(local_header_matches(r, head), "{}", r.name);
        }
        got
    }

    #[test]
    fn remote_maps_torch_archives_in_two_batches() {
        for name in ["torch_small_a64.pt", "torch_small_a4096.pt"] {
            let got = check_remote(std::fs::read(fixture(name)).unwrap(), 1 << 20, 2);
            assert!(!got.predicted.is_empty());
            assert!(got.small.iter().any(|(n, _)| n.ends_with("/data.pkl")));
        }
        check_remote(small().to_vec(), 1 << 20, 2);
        // A tail too short for the directory: one more read.
        let many: Vec<Data> = (0..2000).map(|_| Data::Bytes(&[3; 100])).collect();
        let bytes = torch_like(64, &many).to_vec();
        check_remote(bytes, 0, 3);
    }

    #[test]
    fn remote_refuses_a_local_header_past_the_directory() {
        // A storage's central-directory entry pointing past the directory (past
        // the object's end: its span once ran past it, an untyped error).
        let good = std::fs::read(fixture("torch_small_a64.pt")).unwrap();
        let cd_sig = 0x0201_4b50u32.to_le_bytes();
        let at = (0..good.len() - 46)
            .filter(|&i| good[i..i + 4] == cd_sig)
            .find(|&i| {
                let n = u16::from_le_bytes([good[i + 28], good[i + 29]]) as usize;
                good[i + 46..i + 46 + n].windows(6).any(|w| w == b"/data/")
            })
            .unwrap();
        for lho in [good.len() as u32 + 100, 0xFFFF_FF00] {
            let mut bad = good.clone();
            bad[at + 42..at + 46].copy_from_slice(&lho.to_le_bytes());
            let src = Batches(bad, std::cell::Cell::new(0));
            let e = map_remote(&src, None, 1 << 20).unwrap_err();
            assert!(
                e.to_string().contains("lies past the central directory"),
                "{e}"
            );
        }
    }

    #[test]
    fn remote_prediction_is_refused_by_another_layout() {
        // Python's zipfile: no descriptors, no alignment; the guess is wrong and
        // the local header says so.
        let bytes = std::fs::read(fixture("zipfile_stored.zip")).unwrap();
        let src = Batches(bytes.clone(), std::cell::Cell::new(0));
        let got = map_remote(&src, None, 1 << 20).unwrap();
        let want = map_bytes(&bytes).unwrap();
        for &i in &got.predicted {
            let r = &got.archive.records[i];
            let right = r.data_offset == want.records[i].data_offset;
            let end = (r.data_offset as usize).max(r.header_offset as usize);
            let head = &bytes[r.header_offset as usize..end];
            assert_eq!(local_header_matches(r, head), right, "{}", r.name);
        }
        // A header that names another record, or is cut short, never matches.
        let r = &got.archive.records[0];
        assert!(!local_header_matches(r, &bytes[..10]));
    }
}
