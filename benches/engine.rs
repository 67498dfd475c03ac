//! The engine's throughput beside raw baselines, in one run (see
//! docs/benchmarks.md, "The Rust benches"):
//!
//! - `write`: [`Engine::write`] of one aligned host buffer into a file, against
//!   a plain threaded `pwrite` loop (same descriptor, O_DIRECT where the file
//!   takes it, same chunk and thread count);
//! - `read`: [`Engine::read`] of the file, cold (its pages dropped first), into
//!   the buffer, against a threaded `pread` loop;
//! - `memory`: a read of the same bytes from tmpfs (/dev/shm), which takes the
//!   memory path (copied from a mapping of the page cache), against a threaded
//!   `memcpy` of the bytes already in memory;
//! - `crc32 disk`: [`Engine::checksum`] of the cold file (what `verify` runs),
//!   against a threaded `pread` + `crc32fast` loop;
//! - `crc32 memory`: the same from tmpfs, against `crc32fast` over the bytes in
//!   memory on the same threads.
//!
//! `cargo bench --bench engine -- [--size 256M] [--rounds 5] [--threads 8] [--dir DIR] [FILTER]`

mod common;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use ckptio::engine::{Engine, EngineConfig, Memory, MemoryPath, Segment};
use ckptio::io::align::AlignedBuf;
use ckptio::io::file::{DirectMode, IoFile};

use common::{header, pair, time, Args};

const GIB: f64 = (1u64 << 30) as f64;

/// `threads` threads each taking the next `chunk` of `len` bytes: `f(offset, n)`.
fn threaded(threads: usize, len: usize, chunk: usize, f: impl Fn(usize, usize) + Sync) {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let off = next.fetch_add(1, Ordering::Relaxed) * chunk;
                if off >= len {
                    break;
                }
                f(off, chunk.min(len - off));
            });
        }
    });
}

/// Drop the file's pages from the page cache: the next read comes from the disk.
fn drop_cache(f: &File) {
    // SAFETY: advice on a descriptor we own; it changes no contents.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

fn open(path: &Path, mode: DirectMode) -> IoFile {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .expect("open the bench file");
    IoFile::from_writable(f, path, mode).expect("io file")
}

fn seg(buf: &mut AlignedBuf, len: usize) -> Segment {
    Segment {
        file_offset: 0,
        addr: buf.as_mut_ptr() as u64,
        len: len as u64,
        memory: Memory::Host,
    }
}

fn main() {
    let args = Args::parse();
    let (size, threads) = (args.size, args.threads);
    let gib = size as f64 / GIB;
    let engine = Engine::new(EngineConfig {
        threads,
        memory_threads: threads,
        memory_path: MemoryPath::Map,
        idle_release: None,
        ..EngineConfig::default()
    })
    .expect("engine");
    let (chunk, memory_chunk) = (
        engine.config().chunk_size,
        engine.config().memory_chunk_size,
    );
    let dir = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let path = dir.join(format!("ckptio-bench-{}", std::process::id()));
    let mut buf = AlignedBuf::new(size, 4096).expect("buffer");
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = (i * 31 + i / 4099) as u8;
    }
    let file = open(&path, DirectMode::Auto);
    header(
        &format!(
            "engine, {} MiB, {} MiB chunks, {} (O_DIRECT {})",
            size >> 20,
            chunk >> 20,
            dir.display(),
            if file.is_direct() { "on" } else { "off" }
        ),
        &args,
    );
    let raw = file.fd_for_device_io();
    // SAFETY: `raw` is a descriptor of `file`, alive for the whole run; the
    // `File` made from it is never dropped (forget below), so it is not closed.
    let raw =
        std::mem::ManuallyDrop::new(unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(raw) });
    let s = seg(&mut buf, size);
    // The file exists at its full size before the first timed write.
    // SAFETY: `buf` outlives the call and nothing else touches it.
    unsafe { engine.write(&file, &[s]) }.expect("write");

    if args.wants("write") {
        let src = buf.as_slice();
        pair(
            "write",
            "threaded pwrite",
            args.rounds,
            gib,
            "GiB",
            // SAFETY: as above.
            || time(|| drop(unsafe { engine.write(&file, &[s]) }.expect("write"))),
            || {
                time(|| {
                    threaded(threads, size, chunk, |off, n| {
                        raw.write_all_at(&src[off..off + n], off as u64)
                            .expect("pwrite")
                    })
                })
            },
        );
    }
    if args.wants("read") {
        let dst = buf.as_mut_ptr() as usize;
        pair(
            "read",
            "threaded pread (cold)",
            args.rounds,
            gib,
            "GiB",
            || {
                drop_cache(file.file());
                // SAFETY: `buf` outlives the call and nothing else touches it.
                time(|| drop(unsafe { engine.read(&file, &[s]) }.expect("read")))
            },
            || {
                drop_cache(file.file());
                time(|| {
                    threaded(threads, size, chunk, |off, n| {
                        // SAFETY: each thread fills its own chunk of `buf`.
                        let d =
                            unsafe { std::slice::from_raw_parts_mut((dst + off) as *mut u8, n) };
                        raw.read_exact_at(d, off as u64).expect("pread")
                    })
                })
            },
        );
    }
    if args.wants("crc32") {
        pair(
            "crc32 disk",
            "threaded pread + crc32fast (cold)",
            args.rounds,
            gib,
            "GiB",
            || {
                drop_cache(file.file());
                time(|| drop(engine.checksum(&file, &[(0, size as u64)]).expect("crc")))
            },
            || {
                drop_cache(file.file());
                time(|| {
                    let mut bufs: Vec<AlignedBuf> = (0..threads)
                        .map(|_| AlignedBuf::new(chunk, 4096).expect("buffer"))
                        .collect();
                    let slots: Vec<std::sync::Mutex<&mut AlignedBuf>> =
                        bufs.iter_mut().map(std::sync::Mutex::new).collect();
                    let turn = AtomicUsize::new(0);
                    threaded(threads, size, chunk, |off, n| {
                        let k = turn.fetch_add(1, Ordering::Relaxed) % threads;
                        let mut b = slots[k].lock().unwrap();
                        let d = &mut b.as_mut_slice()[..n];
                        raw.read_exact_at(d, off as u64).expect("pread");
                        std::hint::black_box(crc32fast::hash(d));
                    })
                })
            },
        );
    }
    drop(file);
    std::fs::remove_file(&path).ok();

    // The memory path: the same bytes in a tmpfs file.
    let shm = Path::new("/dev/shm");
    if !(args.wants("memory") || args.wants("crc32")) {
        return;
    }
    if !shm.is_dir() {
        println!("(no /dev/shm: memory and crc32 memory skipped)");
        return;
    }
    let mpath = shm.join(format!("ckptio-bench-{}", std::process::id()));
    let mfile = open(&mpath, DirectMode::Auto);
    // SAFETY: `buf` outlives the call.
    unsafe { engine.write(&mfile, &[s]) }.expect("write tmpfs");
    let mut src = AlignedBuf::new(size, 4096).expect("buffer");
    src.as_mut_slice().copy_from_slice(buf.as_slice());
    if args.wants("memory") {
        let dst = buf.as_mut_ptr() as usize;
        let from = src.as_slice();
        pair(
            "memory",
            "threaded memcpy",
            args.rounds,
            gib,
            "GiB",
            // SAFETY: `buf` outlives the call and nothing else touches it.
            || time(|| drop(unsafe { engine.read(&mfile, &[s]) }.expect("read tmpfs"))),
            || {
                time(|| {
                    threaded(threads, size, memory_chunk, |off, n| {
                        // SAFETY: each thread fills its own chunk of `buf`.
                        let d =
                            unsafe { std::slice::from_raw_parts_mut((dst + off) as *mut u8, n) };
                        d.copy_from_slice(&from[off..off + n]);
                    })
                })
            },
        );
    }
    if args.wants("crc32") {
        let from = src.as_slice();
        pair(
            "crc32 memory",
            "threaded crc32fast in memory",
            args.rounds,
            gib,
            "GiB",
            || time(|| drop(engine.checksum(&mfile, &[(0, size as u64)]).expect("crc"))),
            || {
                time(|| {
                    threaded(threads, size, memory_chunk, |off, n| {
                        std::hint::black_box(crc32fast::hash(&from[off..off + n]));
                    })
                })
            },
        );
    }
    drop(mfile);
    std::fs::remove_file(&mpath).ok();
}
