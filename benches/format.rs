//! The zip mapper beside a raw walk, in one run (see docs/benchmarks.md, "The
//! Rust benches"):
//!
//! - `zipmap`: [`zipmap::map_bytes`] of a torch.save-style archive of 100,000
//!   records held in memory (ckptio's own layout: ZIP64 end records, 64-byte
//!   aligned records, data descriptors), against a walk of its central
//!   directory that only reads each entry's lengths and offset: no checks, no
//!   local headers, no names kept. The ratio is what the mapper's checks cost.
//!
//! `cargo bench --bench format -- [--rounds 5] [--records 100000] [FILTER]`

mod common;

use ckptio::engine::{Engine, EngineConfig};
use ckptio::format::zipmap;
use ckptio::format::zipwrite::{self, Body, Entry};
use ckptio::gpu::Backend;
use ckptio::io::file::{DirectMode, IoFile};

use common::{pair, time};

fn u16_at(b: &[u8], at: usize) -> usize {
    u16::from_le_bytes([b[at], b[at + 1]]) as usize
}
fn u32_at(b: &[u8], at: usize) -> u64 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as u64
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// The least a reader of the directory does: find the end records, then step
/// over every central directory entry. Returns (entries, sum of offsets).
fn raw_walk(b: &[u8]) -> (usize, u64) {
    let eocd = (0..=b.len() - 22)
        .rev()
        .find(|&i| u32_at(b, i) == 0x0605_4b50)
        .expect("end record");
    let (mut count, mut cd) = (u16_at(b, eocd + 10) as u64, u32_at(b, eocd + 16));
    if cd == 0xFFFF_FFFF || count == 0xFFFF {
        let z = u64_at(b, eocd - 20 + 8) as usize; // the ZIP64 locator's pointer
        count = u64_at(b, z + 32);
        cd = u64_at(b, z + 48);
    }
    let (mut at, mut sum) = (cd as usize, 0u64);
    for _ in 0..count {
        assert_eq!(u32_at(b, at), 0x0201_4b50, "central directory entry");
        let (name, extra, comment) = (u16_at(b, at + 28), u16_at(b, at + 30), u16_at(b, at + 32));
        sum = sum.wrapping_add(u32_at(b, at + 42));
        at += 46 + name + extra + comment;
    }
    (count as usize, sum)
}

/// A torch.save-style archive of `n` small data records, laid out and written
/// by ckptio's own writer, read back into memory.
fn archive(n: usize) -> Vec<u8> {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("archive.pt");
    let f = std::fs::File::create(&path).expect("create");
    let io = IoFile::from_writable(f, &path, DirectMode::Off).expect("io file");
    let file = ckptio::engine::TransferFile::new(io, Backend::Bounce);
    let engine = Engine::new(EngineConfig::default()).expect("engine");
    let mut entries = vec![Entry {
        name: "archive/data.pkl".into(),
        body: Body::Bytes(vec![0x80; 4096]),
        align: 64,
    }];
    entries.extend((0..n).map(|i| Entry {
        name: format!("archive/data/{i}"),
        body: Body::Bytes((i as u32).to_le_bytes().repeat(4)),
        align: 64,
    }));
    entries.push(Entry {
        name: "archive/version".into(),
        body: Body::Bytes(b"3\n".to_vec()),
        align: 64,
    });
    // SAFETY: every record's bytes are held by `entries` (no memory records).
    unsafe { zipwrite::write(&engine, &file, &entries, "archive", &[]) }.expect("write");
    std::fs::read(&path).expect("read back")
}

fn main() {
    let args = common::Args::parse();
    let records = args.records;
    if !args.wants("zipmap") {
        return;
    }
    let bytes = archive(records);
    let n = records + 2;
    let m = zipmap::map_bytes(&bytes).expect("map");
    assert_eq!(m.records.len(), n);
    assert_eq!(raw_walk(&bytes).0, n);
    println!(
        "format, {} records ({:.1} MiB archive): {} rounds, median of the rounds \
         (ratio: median of each round's baseline time / mapper time)",
        n,
        bytes.len() as f64 / (1 << 20) as f64,
        args.rounds
    );
    println!(
        "{:<14} {:>15} {:>15} {:>8}   baseline is",
        "case", "mapper", "baseline", "ratio"
    );
    pair(
        "zipmap",
        "central directory walk (no checks)",
        args.rounds,
        n as f64 / 1e6,
        "Mrec",
        || {
            time(|| {
                drop(std::hint::black_box(
                    zipmap::map_bytes(&bytes).expect("map"),
                ))
            })
        },
        || {
            time(|| {
                std::hint::black_box(raw_walk(&bytes));
            })
        },
    );
}
