//! Criterion bench of the engine alone: parallel write and read of one large
//! host buffer to a file in the system temp folder (O_DIRECT where it works).
//! Throughput is reported in bytes/s; compare thread counts side by side.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::fs::OpenOptions;

use ckptio::engine::{Engine, EngineConfig, Memory, Segment};
use ckptio::io::align::AlignedBuf;
use ckptio::io::file::{DirectMode, IoFile};

const SIZE: usize = 256 << 20;

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("bench.bin");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("open");
    let file = IoFile::from_writable(f, &path, DirectMode::Auto).expect("io file");
    let mut buf = AlignedBuf::new(SIZE, 4096).expect("buffer");
    buf.as_mut_slice()
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = i as u8);
    let seg = Segment {
        file_offset: 0,
        addr: buf.as_mut_ptr() as u64,
        len: SIZE as u64,
        memory: Memory::Host,
    };

    let mut g = c.benchmark_group("engine");
    g.throughput(Throughput::Bytes(SIZE as u64));
    g.sample_size(10);
    for threads in [1, 4, 8] {
        let e = Engine::new(EngineConfig {
            threads,
            ..EngineConfig::default()
        })
        .expect("engine");
        g.bench_with_input(BenchmarkId::new("write", threads), &threads, |b, _| {
            // SAFETY: `buf` outlives the call and nothing else touches it.
            b.iter(|| unsafe { e.write(&file, &[seg]) }.expect("write"))
        });
        g.bench_with_input(BenchmarkId::new("read", threads), &threads, |b, _| {
            // SAFETY: as above; the read fills `buf` exclusively.
            b.iter(|| unsafe { e.read(&file, &[seg]) }.expect("read"))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
