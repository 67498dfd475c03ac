//! zstd frames for DCP items written through torch's ZStandard stream transform
//! (`torch.distributed.checkpoint._extension.ZStandard`, descriptor
//! `stream.zstd/1`): each item, the torch.save zip of one tensor, becomes one
//! zstd frame (torch's reader decodes one frame per item), the frames back to
//! back in the file.
//!
//! Compression runs on the engine's thread count (at most one per core): items
//! in parallel, one per thread, and an item larger than [`BIG`] on zstd's own
//! workers (still one frame). The CRC-32 of each item's data is computed in the same pass and
//! written into the zip tail before the tail is compressed, so the archive
//! inside the frame checks as any torch.save file does. Frames carry their
//! content size and zstd's own checksum.

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::io::file::IoFile;
use crate::workers::Caller;
use crate::{Error, Result};

/// What [`decode_bounded`] made of an item's frames.
pub enum Decoded {
    /// The bytes, no more than the limit, starting as `starts` asked.
    Whole(Vec<u8>),
    /// More than the limit (or than this process could allocate): not decoded
    /// past that.
    TooLarge,
    /// The first bytes (up to 16), which do not start as asked: not decoded further.
    Other(Vec<u8>),
}

/// The zstd frames `compressed` yields, decoded, where they start with
/// `starts` and decode to no more than `limit` bytes (a hostile frame may
/// decode to any size: it is not decoded past that, and an allocation that
/// fails is no abort).
///
/// # Errors
/// [`Error::Format`] naming `path` where the bytes are no zstd frames or a
/// frame is damaged.
pub fn decode_bounded(
    compressed: impl std::io::Read,
    limit: u64,
    starts: &[u8],
    path: &std::path::Path,
) -> Result<Decoded> {
    use std::io::Read;
    let bad = |e: std::io::Error| Error::format(Some(path), format!("damaged zstd frames: {e}"));
    let mut dec = zstd::stream::read::Decoder::new(compressed).map_err(bad)?;
    let mut out: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        let n = match dec.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(bad(e)),
        };
        if (out.len() + n) as u64 > limit || out.try_reserve(n).is_err() {
            return Ok(Decoded::TooLarge);
        }
        out.extend_from_slice(&chunk[..n]);
        if out.len() >= starts.len() && !out.starts_with(starts) {
            out.truncate(16);
            return Ok(Decoded::Other(out));
        }
    }
    if !out.starts_with(starts) {
        return Ok(Decoded::Other(out));
    }
    Ok(Decoded::Whole(out))
}

/// Items above this many bytes are compressed by several zstd workers.
pub const BIG: usize = 32 << 20;
/// zstd's default level, the one torch's ZStandard extension uses.
pub const DEFAULT_LEVEL: i32 = 3;

/// One item: the zip before the tensor data, the data (host memory), the zip
/// after it, and where in `tail` the data's CRC-32 goes (little-endian u32).
pub struct Item<'a> {
    pub head: &'a [u8],
    pub data: &'a [u8],
    pub tail: &'a [u8],
    pub crc_at: &'a [usize],
}

impl Item<'_> {
    fn len(&self) -> usize {
        self.head.len() + self.data.len() + self.tail.len()
    }
}

fn zerr(e: std::io::Error) -> Error {
    Error::io("zstd compress", None, e)
}

/// One item as one zstd frame, compressed by `workers` zstd threads (1: this thread).
pub fn compress(item: &Item<'_>, level: i32, workers: u32) -> Result<Vec<u8>> {
    let mut tail = item.tail.to_vec();
    let outside = |&&at: &&usize| at.checked_add(4).is_none_or(|end| end > tail.len());
    if let Some(&bad) = item.crc_at.iter().find(outside) {
        return Err(Error::invalid(format!(
            "CRC-32 field at {bad} lies past the item's tail ({} bytes)",
            tail.len()
        )));
    }
    let out = Vec::with_capacity(zstd::zstd_safe::compress_bound(item.len()) / 2);
    let mut enc = zstd::stream::Encoder::new(out, level).map_err(zerr)?;
    enc.include_checksum(true).map_err(zerr)?;
    enc.include_contentsize(true).map_err(zerr)?;
    enc.set_pledged_src_size(Some(item.len() as u64))
        .map_err(zerr)?;
    if workers > 1 {
        enc.multithread(workers).map_err(zerr)?;
    }
    enc.write_all(item.head).map_err(zerr)?;
    let mut crc = crc32fast::Hasher::new();
    for chunk in item.data.chunks(1 << 20) {
        crc.update(chunk);
        enc.write_all(chunk).map_err(zerr)?;
    }
    let crc = crc.finalize().to_le_bytes();
    for &at in item.crc_at {
        tail[at..at + 4].copy_from_slice(&crc);
    }
    enc.write_all(&tail).map_err(zerr)?;
    enc.finish().map_err(zerr)
}

/// Compress `items` on `threads` threads, one frame each, and write the frames
/// back to back into `io` from `start`. Returns each item's (offset, length).
pub fn write_items(
    io: &IoFile,
    start: u64,
    items: &[Item<'_>],
    level: i32,
    threads: usize,
) -> Result<Vec<(u64, u64)>> {
    let mut at = start;
    let spans = compress_items(items, level, threads, &mut |frame| {
        io.write_at(frame, at)?;
        at += frame.len() as u64;
        Ok(())
    })
    .map_err(|e| e.with_path(io.path()))?;
    Ok(spans
        .into_iter()
        .map(|(off, len)| (start + off, len))
        .collect())
}

/// Compress `items` on `threads` threads, one frame each, and hand the frames
/// in order to `put` (a file's writes, a streamed upload's parts). Returns
/// each item's (offset, length) from the first frame's start.
///
/// Memory stays bounded: items go in windows of about `threads` x [`BIG`]
/// bytes, each window handed over (in order) before the next is compressed.
pub fn compress_items(
    items: &[Item<'_>],
    level: i32,
    threads: usize,
    put: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<Vec<(u64, u64)>> {
    // More compressing threads than cores only add switching.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = threads.clamp(1, cores);
    let mut out = Vec::with_capacity(items.len());
    let mut at = 0u64;
    let mut emit = |frame: &[u8]| -> Result<()> {
        put(frame)?;
        out.push((at, frame.len() as u64));
        at += frame.len() as u64;
        Ok(())
    };
    let mut i = 0;
    while i < items.len() {
        if items[i].len() > BIG {
            let workers = u32::try_from(threads).unwrap_or(u32::MAX);
            emit(&compress(&items[i], level, workers)?)?;
            i += 1;
            continue;
        }
        let mut j = i;
        let mut sum = 0;
        while j < items.len() && items[j].len() <= BIG && sum + items[j].len() <= threads * BIG {
            sum += items[j].len();
            j += 1;
        }
        for frame in compress_window(&items[i..j], level, threads)? {
            emit(&frame)?;
        }
        i = j;
    }
    Ok(out)
}

/// Every item of a window compressed, in order, by up to `threads` worker
/// threads (the caller included).
fn compress_window(items: &[Item<'_>], level: i32, threads: usize) -> Result<Vec<Vec<u8>>> {
    let next = AtomicUsize::new(0);
    let done: Mutex<Vec<Option<Result<Vec<u8>>>>> =
        Mutex::new((0..items.len()).map(|_| None).collect());
    let tasks = threads.clamp(1, items.len().max(1));
    crate::workers::run(tasks, Caller::Helps, |_| loop {
        let k = next.fetch_add(1, Ordering::Relaxed);
        let Some(item) = items.get(k) else { break };
        let r = compress(item, level, 1);
        crate::sync::lock(&done)[k] = Some(r);
    });
    crate::sync::into_inner(done)
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(Error::invalid("an item was not compressed"))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::file::DirectMode;

    fn item<'a>(data: &'a [u8], tail: &'a [u8], crc_at: &'a [usize]) -> Item<'a> {
        Item {
            head: b"HEAD",
            data,
            tail,
            crc_at,
        }
    }

    #[test]
    fn frame_decodes_to_the_item_with_its_crc() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let tail = [0u8; 12];
        let frame = compress(&item(&data, &tail, &[2, 8]), DEFAULT_LEVEL, 1).unwrap();
        let back = zstd::decode_all(&frame[..]).unwrap();
        let crc = crc32fast::hash(&data).to_le_bytes();
        assert_eq!(&back[..4], b"HEAD");
        assert_eq!(&back[4..4 + data.len()], &data[..]);
        let t = &back[4 + data.len()..];
        assert_eq!((&t[2..6], &t[8..12]), (&crc[..], &crc[..]));
        assert!(frame.len() < data.len() / 2);
    }

    #[test]
    fn crc_field_past_the_tail_is_refused() {
        for at in [1, usize::MAX - 3, usize::MAX] {
            // (near usize::MAX, at + 4 wrapped and passed the check, then panicked)
            let e = compress(&item(b"x", &[0; 4], &[at]), DEFAULT_LEVEL, 1).unwrap_err();
            assert!(e.to_string().contains("past the item's tail"), "{e}");
        }
    }

    #[test]
    fn items_are_written_back_to_back_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"").unwrap();
        let file = std::fs::File::options().read(true).write(true).open(&path);
        let io = IoFile::from_writable(file.unwrap(), &path, DirectMode::Off).unwrap();
        let big: Vec<u8> = (0..BIG + 10).map(|i| (i % 13) as u8).collect();
        let datas = [vec![1u8; 1000], big, vec![], vec![9u8; 5000]];
        let items: Vec<Item<'_>> = datas.iter().map(|d| item(d, b"TAIL", &[])).collect();
        let at = write_items(&io, 100, &items, DEFAULT_LEVEL, 3).unwrap();
        assert_eq!(at[0].0, 100);
        let bytes = std::fs::read(&path).unwrap();
        for (k, (off, len)) in at.iter().enumerate() {
            if k > 0 {
                assert_eq!(*off, at[k - 1].0 + at[k - 1].1);
            }
            let frame = &bytes[*off as usize..(*off + *len) as usize];
            let back = zstd::decode_all(frame).unwrap();
            assert_eq!(back.len(), 8 + datas[k].len());
            assert_eq!(&back[4..4 + datas[k].len()], &datas[k][..]);
        }
    }
}
