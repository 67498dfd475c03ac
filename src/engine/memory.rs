//! The per-file, per-read choice between the memory path and the disk path.
//!
//! A file whose bytes are in memory (on tmpfs, or a disk file whose pages are
//! in the page cache: written by buffered I/O, read by another process or an
//! earlier run) is read from there: copied by the memory threads in memory
//! chunks, through a mapping of its page cache ([`crate::io::mapped`]), and
//! device memory filled through the pinned bounce lanes (cuFile would read the
//! disk again). Any other file keeps the disk path: O_DIRECT where the
//! filesystem takes it, cuFile or bounce for device memory.
//!
//! Residency is checked with mincore over the ranges to read (sampled when
//! large); [`RESIDENT_MIN`] of the pages looked at make a file "in memory".
//! [`ReadPath`] says which path ran and why (`last_report()` in Python).

use crate::io::file::IoFile;
use crate::io::mapped::FileMap;
use crate::{Error, Result};

use super::Segment;

/// How reads of files whose bytes are in memory run (`CKPTIO_MEMORY_PATH`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MemoryPath {
    /// Files in memory (tmpfs, or cached pages) copied from a mapping: no page
    /// is marked accessed, so the first read after a write is not slowed by
    /// the kernel's LRU bookkeeping ("auto", "map").
    #[default]
    Map,
    /// As `Map`, the copies written with non-temporal stores ("map-nt"): no
    /// read of the destination before it is written, no cache evicted
    /// ([`crate::io::mapped::copy_stream`]). Which is faster depends on the
    /// host's memory system and libc (benches/bench_memory.py measures both).
    MapNt,
    /// Files in memory read with pread ("pread").
    Pread,
    /// No page-cache check: tmpfs files read with pread, others from the disk
    /// (O_DIRECT where possible), as before the memory path existed ("off").
    Off,
}

impl std::str::FromStr for MemoryPath {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "map" | "" => Ok(MemoryPath::Map),
            "map-nt" => Ok(MemoryPath::MapNt),
            "pread" => Ok(MemoryPath::Pread),
            "off" | "0" | "no" | "false" => Ok(MemoryPath::Off),
            other => Err(Error::invalid(format!(
                "memory path must be auto, map, map-nt, pread or off, not {other:?}"
            ))),
        }
    }
}

impl MemoryPath {
    pub fn name(self) -> &'static str {
        match self {
            MemoryPath::Map => "map",
            MemoryPath::MapNt => "map-nt",
            MemoryPath::Pread => "pread",
            MemoryPath::Off => "off",
        }
    }
}

/// At least this share of the sampled pages in the page cache: the file is
/// read from memory (the rest is read through the page cache too).
pub const RESIDENT_MIN: f64 = 0.9;

/// How one read got its file's bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct ReadPath {
    /// From memory (the page cache, tmpfs) rather than from the disk.
    pub memory: bool,
    /// "map" (copied from a mapping), "map-nt" (the same with non-temporal
    /// stores), "pread", "direct" (O_DIRECT) or "buffered".
    pub source: &'static str,
    /// Why, in words: "tmpfs", "page cache: 100% of 2048 sampled pages
    /// resident", "cold: 0% of ... resident", ...
    pub reason: String,
}

/// The choice for one read: the path, and the file to read (a memory view of
/// the caller's file where the memory path runs through a mapping or a
/// buffered descriptor the caller's file lacks).
pub(super) struct Choice {
    pub view: Option<IoFile>,
    pub path: ReadPath,
}

/// Decide how to read `segments` of `file`.
pub(super) fn choose(file: &IoFile, segments: &[Segment], mode: MemoryPath) -> Result<Choice> {
    let disk = if file.is_direct() {
        "direct"
    } else {
        "buffered"
    };
    if mode == MemoryPath::Off {
        let (memory, source) = if file.is_in_memory() {
            (true, "pread")
        } else {
            (false, disk)
        };
        return Ok(Choice {
            view: None,
            path: ReadPath {
                memory,
                source,
                reason: "page-cache check off (CKPTIO_MEMORY_PATH=off)".into(),
            },
        });
    }
    let mapped = matches!(mode, MemoryPath::Map | MemoryPath::MapNt);
    let map_it = mapped || !file.is_in_memory();
    let map = if map_it {
        FileMap::new(file.file(), file.path())?
    } else {
        None
    };
    let reason = if file.is_in_memory() {
        "tmpfs".to_string()
    } else {
        let Some(m) = &map else {
            return Ok(Choice {
                view: None,
                path: ReadPath {
                    memory: false,
                    source: disk,
                    reason: "the file could not be mapped to check its page cache".into(),
                },
            });
        };
        let ranges: Vec<(u64, u64)> = segments
            .iter()
            .filter(|s| s.len > 0)
            .map(|s| (s.file_offset, s.len))
            .collect();
        let r = m.residency(&ranges);
        let what = format!(
            "{:.0}% of {} sampled pages in the page cache",
            100.0 * r.fraction(),
            r.sampled
        );
        if r.fraction() < RESIDENT_MIN {
            return Ok(Choice {
                view: None,
                path: ReadPath {
                    memory: false,
                    source: disk,
                    reason: format!("cold: {what}"),
                },
            });
        }
        format!("page cache: {what}")
    };
    let map = map
        .filter(|_| mapped)
        .map(|m| m.streaming(mode == MemoryPath::MapNt));
    let source = match &map {
        Some(_) => mode.name(),
        None => "pread",
    };
    let view = file.memory_view(map, &format!("read from memory ({reason})"))?;
    Ok(Choice {
        view: Some(view),
        path: ReadPath {
            memory: true,
            source,
            reason,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Engine, EngineConfig, Memory};
    use crate::io::file::DirectMode;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    fn written(dir: &std::path::Path, n: usize) -> (std::path::PathBuf, Vec<u8>) {
        let p = dir.join(format!("mem-{}", std::process::id()));
        let data: Vec<u8> = (0..n).map(|i| (i * 7 % 253) as u8).collect();
        let mut f = std::fs::File::create(&p).unwrap();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
        (p, data)
    }

    fn segs(buf: &mut [u8], parts: usize) -> Vec<Segment> {
        let step = buf.len() / parts;
        (0..parts)
            .map(|i| Segment {
                file_offset: (i * step) as u64,
                addr: buf.as_mut_ptr() as u64 + (i * step) as u64,
                len: if i + 1 == parts {
                    buf.len() - i * step
                } else {
                    step
                } as u64,
                memory: Memory::Host,
            })
            .collect()
    }

    #[test]
    fn cold_cached_and_tmpfs_files_take_their_paths_with_the_same_bytes() {
        let n = 3 << 20;
        let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let shm = std::path::Path::new("/dev/shm");
        for (dir, tmpfs) in [(disk.path(), false), (shm, true)] {
            if !dir.is_dir() {
                continue;
            }
            let (path, data) = written(dir, n);
            for mode in [
                MemoryPath::Map,
                MemoryPath::MapNt,
                MemoryPath::Pread,
                MemoryPath::Off,
            ] {
                let e = Engine::new(EngineConfig {
                    memory_path: mode,
                    chunk_size: 1 << 20,
                    memory_chunk_size: 1 << 20,
                    ..EngineConfig::default()
                })
                .unwrap();
                let f = IoFile::open_read(&path, DirectMode::Auto).unwrap();
                for cached in [false, true] {
                    if !tmpfs {
                        // SAFETY: advice on our own open file.
                        unsafe {
                            libc::posix_fadvise(
                                f.file().as_raw_fd(),
                                0,
                                0,
                                libc::POSIX_FADV_DONTNEED,
                            )
                        };
                        if cached {
                            std::fs::read(&path).unwrap();
                        }
                    }
                    let mut back = vec![0u8; n];
                    let s = segs(&mut back, 5);
                    // SAFETY: `back` outlives the call and the segments do not overlap.
                    let st = unsafe { e.read(&f, &s) }.unwrap();
                    assert_eq!(back, data, "{mode:?} tmpfs={tmpfs} cached={cached}");
                    let rp = st.read_path.unwrap();
                    let memory = tmpfs || (cached && mode != MemoryPath::Off);
                    assert_eq!(rp.memory, memory, "{rp:?}");
                    let source = match (memory, mode) {
                        (true, MemoryPath::Map | MemoryPath::MapNt) => mode.name(),
                        (true, _) => "pread",
                        (false, _) if f.is_direct() => "direct",
                        (false, _) => "buffered",
                    };
                    assert_eq!(rp.source, source, "{rp:?}");
                    let threads = if memory {
                        e.config().memory_threads
                    } else {
                        e.config().threads
                    };
                    assert_eq!(st.threads, threads.min(st.chunks).max(1));
                    // Checksums of a verified read come through the same path.
                    let ck = e.checksum(&f, &[(0, n as u64)]).unwrap();
                    assert_eq!(ck.crc32, vec![Some(crc32fast::hash(&data))]);
                }
            }
            std::fs::remove_file(&path).unwrap();
        }
        crate::io::mapped::flush_unmaps();
    }

    #[test]
    fn modes_parse() {
        assert_eq!("AUTO".parse::<MemoryPath>().unwrap(), MemoryPath::Map);
        assert_eq!("pread".parse::<MemoryPath>().unwrap(), MemoryPath::Pread);
        assert_eq!("map-nt".parse::<MemoryPath>().unwrap(), MemoryPath::MapNt);
        assert_eq!(MemoryPath::MapNt.name(), "map-nt");
        assert_eq!("off".parse::<MemoryPath>().unwrap(), MemoryPath::Off);
        assert!("sometimes".parse::<MemoryPath>().is_err());
        assert_eq!(MemoryPath::default().name(), "map");
    }
}
