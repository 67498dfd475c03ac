//! The engine's tunables: threads and chunk sizes (separately for files on
//! disk and files in memory), O_DIRECT mode and preallocation, with their
//! defaults and the `CKPTIO_*` environment variables that override them.

use std::time::Duration;

use crate::io::align;
use crate::io::env;
pub use crate::io::env::parse_size;
use crate::io::file::{DirectMode, IoFile};
use crate::{Error, Result};

pub use super::memory::MemoryPath;

/// Default I/O threads: enough to keep an NVMe queue busy, few enough for small hosts.
pub const DEFAULT_THREADS: usize = 8;
/// Default chunk: large enough to amortise a syscall, small enough to spread over threads.
pub const DEFAULT_CHUNK_SIZE: usize = 16 << 20;
/// Default chunk for a file in memory (tmpfs): its chunks are memory copies,
/// cheap to cut small, and every thread's pinned lane holds two of them (on the
/// H200 host, /dev/shm to GPU with 4 to 16 MiB chunks: 25-33 GiB/s warm, no
/// trend; with 4 MiB, 32 threads' lanes take 256 MiB instead of 1 GiB, pinned
/// at ~0.5 s per GiB on an engine's first transfer).
pub const DEFAULT_MEMORY_CHUNK_SIZE: usize = 4 << 20;

/// Threads for a file in memory (tmpfs): its reads and writes are CPU copies
/// that scale with cores, not requests that a device queue absorbs. One per
/// core: on the H200 host (16 cores) 32 threads copied the page cache at 0.82x
/// the rate of 16 (memory_copy_floor), and 8 GiB loads in place from /dev/shm
/// to the GPU ran 1.1-1.2x faster on 16 than on 32 (2026-12-01). 12 against
/// 16 (2026-12-02, `probe_memory_lanes.py`, now `probe_memory_path.py`): 1.04x
/// on one host, 1.00x on another, where the copy floor ran 1.12x faster on 16:
/// one per core stays.
pub fn default_memory_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(DEFAULT_THREADS, |n| n.get());
    cores.clamp(DEFAULT_THREADS, 32)
}

/// How long an engine keeps an idle thread's buffers (its pinned bounce
/// buffers above all) before giving them back.
pub const DEFAULT_IDLE_RELEASE: Duration = Duration::from_secs(60);

/// Tunables. `from_env` reads `CKPTIO_THREADS`, `CKPTIO_MEMORY_THREADS`,
/// `CKPTIO_CHUNK_SIZE`, `CKPTIO_MEMORY_CHUNK_SIZE`, `CKPTIO_DIRECT`,
/// `CKPTIO_PREALLOCATE`, `CKPTIO_IDLE_RELEASE` and `CKPTIO_MEMORY_PATH`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    pub threads: usize,
    /// Threads for files in memory (tmpfs); see [`default_memory_threads`].
    pub memory_threads: usize,
    pub chunk_size: usize,
    /// Chunk for files in memory (tmpfs); see [`DEFAULT_MEMORY_CHUNK_SIZE`].
    pub memory_chunk_size: usize,
    pub direct: DirectMode,
    /// fallocate a file's full size before writing it (a full disk fails at once).
    pub preallocate: bool,
    /// How reads of files whose bytes are in memory run (see [`MemoryPath`]).
    pub memory_path: MemoryPath,
    /// Buffers of threads idle this long are given back; None keeps them.
    pub idle_release: Option<Duration>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            threads: DEFAULT_THREADS,
            memory_threads: default_memory_threads(),
            chunk_size: DEFAULT_CHUNK_SIZE,
            memory_chunk_size: DEFAULT_MEMORY_CHUNK_SIZE,
            direct: DirectMode::Auto,
            preallocate: true,
            memory_path: MemoryPath::default(),
            idle_release: Some(DEFAULT_IDLE_RELEASE),
        }
    }
}

/// `CKPTIO_THREADS` (None where unset), refused when malformed or outside
/// 1..=256: the one reading every user of the variable goes through (the
/// engine here, the stagers through the binding).
pub fn threads_from_env() -> Result<Option<usize>> {
    let n = env::size("CKPTIO_THREADS")?;
    if let Some(n) = n.filter(|n| !(1..=MAX_THREADS).contains(n)) {
        return Err(Error::invalid(format!(
            "CKPTIO_THREADS must be between 1 and {MAX_THREADS}, not {n}"
        )));
    }
    Ok(n)
}

/// `CKPTIO_IDLE_RELEASE`: seconds ("0.5", "60"), or "off" / "never" to keep
/// idle buffers for the life of the engine.
pub(super) fn parse_idle_release(v: &str) -> Result<Option<Duration>> {
    match v.trim().to_ascii_lowercase().as_str() {
        "off" | "never" => Ok(None),
        t => t
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0 && *s < 1e9)
            .map(|s| Some(Duration::from_secs_f64(s)))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "CKPTIO_IDLE_RELEASE: not a number of seconds or \"off\": {v:?}"
                ))
            }),
    }
}

/// Most I/O threads one engine runs.
const MAX_THREADS: usize = 256;

impl EngineConfig {
    /// Defaults overridden by the environment; a malformed variable is an error, not ignored.
    pub fn from_env() -> Result<Self> {
        let mut c = EngineConfig::default();
        if let Some(n) = threads_from_env()? {
            c.set_threads(n);
        }
        if let Some(n) = env::size("CKPTIO_MEMORY_THREADS")? {
            c.memory_threads = n;
        }
        if let Some(n) = env::size("CKPTIO_CHUNK_SIZE")? {
            c.set_chunk_size(n);
        }
        if let Some(n) = env::size("CKPTIO_MEMORY_CHUNK_SIZE")? {
            c.memory_chunk_size = n;
        }
        if let Ok(v) = std::env::var("CKPTIO_DIRECT") {
            c.direct = v.parse()?;
        }
        if let Ok(v) = std::env::var("CKPTIO_MEMORY_PATH") {
            c.memory_path = v.parse()?;
        }
        if let Ok(v) = std::env::var("CKPTIO_PREALLOCATE") {
            c.preallocate = match v.trim() {
                "1" | "true" | "on" | "yes" => true,
                "0" | "false" | "off" | "no" => false,
                other => {
                    return Err(Error::invalid(format!(
                        "CKPTIO_PREALLOCATE: not a boolean: {other:?}"
                    )))
                }
            };
        }
        if let Ok(v) = std::env::var("CKPTIO_IDLE_RELEASE") {
            c.idle_release = parse_idle_release(&v)?;
        }
        c.validate()?;
        Ok(c)
    }

    /// A thread count asked for explicitly holds for every file, tmpfs included.
    pub fn set_threads(&mut self, threads: usize) {
        self.threads = threads;
        self.memory_threads = threads;
    }

    /// A chunk size asked for explicitly holds for every file, tmpfs included.
    pub fn set_chunk_size(&mut self, chunk_size: usize) {
        self.chunk_size = chunk_size;
        self.memory_chunk_size = chunk_size;
    }

    /// Threads for transfers on `file`.
    pub fn threads_for(&self, file: &IoFile) -> usize {
        if file.is_in_memory() {
            self.memory_threads
        } else {
            self.threads
        }
    }

    /// Chunk size for transfers on `file`.
    pub fn chunk_for(&self, file: &IoFile) -> usize {
        if file.is_in_memory() {
            self.memory_chunk_size
        } else {
            self.chunk_size
        }
    }

    pub fn validate(&self) -> Result<()> {
        for (name, n) in [
            ("threads", self.threads),
            ("memory_threads", self.memory_threads),
        ] {
            if n == 0 || n > MAX_THREADS {
                return Err(Error::invalid(format!(
                    "{name} must be between 1 and {MAX_THREADS}, not {n}"
                )));
            }
        }
        for (name, n) in [
            ("chunk_size", self.chunk_size),
            ("memory_chunk_size", self.memory_chunk_size),
        ] {
            if !(align::DEFAULT_ALIGN..=(1 << 30)).contains(&n) || n % align::DEFAULT_ALIGN != 0 {
                return Err(Error::invalid(format!(
                    "{name} must be a multiple of 4096 between 4 KiB and 1 GiB, not {n}"
                )));
            }
        }
        Ok(())
    }
}
