//! [`TransferFile`]: one open file and the path its device memory takes.
//!
//! Every native class that moves tensors to or from a file (the writer of a
//! new checkpoint, the reader of an existing one, `GdsFile`'s file) holds one:
//! the file (its buffered and O_DIRECT descriptors) and its device path, a
//! cuFile handle where cuFile takes the file, else the bounce pipeline. The
//! path is opened by the first transfer that moves device memory (or by
//! [`TransferFile::open_device_path`]) and kept for the next ones. A transfer
//! runs whole here: its checks, the caller's stream order, the engine, and
//! what it did ([`Report`]).
//!
//! Threads may share one. The device path sits behind a lock that is held
//! only to look at it or swap it, never across I/O, so a thread waiting for it
//! waits microseconds. A transfer keeps the path it started with alive (an
//! `Arc`) even when another thread closes it meanwhile: the cuFile handle is
//! deregistered when the last transfer using it ends.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::gpu::{open_device_path, Backend, DevicePath, Memory};
use crate::io::file::IoFile;
use crate::{Error, Result};

use super::{Engine, Options, Patch, Segment, Stats};

/// The device path's state.
enum Slot {
    /// Not opened yet: the first transfer of device memory opens it.
    Unopened,
    Open(Arc<DevicePath>),
    /// Closed on request: device memory takes the bounce pipeline until
    /// [`TransferFile::open_device_path`].
    Closed,
}

/// An open file and the path its device memory takes.
pub struct TransferFile {
    // Field order is drop order: a cuFile handle goes before the descriptor it uses.
    device: Mutex<Slot>,
    /// Held while a thread registers the file with cuFile (which may take
    /// seconds the first time), so that two threads never register it twice.
    opening: Mutex<()>,
    io: IoFile,
    backend: Backend,
}

/// What a transfer asks for, besides its segments.
#[derive(Clone, Copy, Debug, Default)]
pub struct Request<'a> {
    /// Compute each segment's CRC-32 ([`Stats::crc32`]).
    pub checksum: bool,
    /// The caller's CUDA stream per device (see [`Options::streams`]).
    pub streams: &'a [(i32, u64)],
    /// Writes: the file's final length, preallocated first when the engine
    /// preallocates, so that a full disk fails before any data moves.
    pub file_len: Option<u64>,
    /// Writes: segments' CRC-32s to store in the file (see [`Options::patches`]).
    pub patches: &'a [Patch],
}

/// What a transfer did, and along which paths.
#[derive(Clone, Debug)]
pub struct Report {
    pub stats: Stats,
    /// The backend asked for (what `Stats::device_path` was chosen under).
    pub backend: Backend,
    /// Why O_DIRECT was not used, when it was not.
    pub direct_reason: Option<String>,
    /// With cuFile: "p2p" or "compat".
    pub gds_mode: Option<&'static str>,
    /// Why device memory did not go through cuFile, when it did not.
    pub fallback_reason: Option<String>,
}

/// The device path in use, as reports show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathState {
    /// "cufile" or "bounce".
    pub name: &'static str,
    pub gds_mode: Option<&'static str>,
    pub fallback_reason: Option<String>,
}

impl PathState {
    fn of(p: &DevicePath) -> PathState {
        PathState {
            name: p.name(),
            gds_mode: p.gds_mode(),
            fallback_reason: p.fallback_reason().map(str::to_owned),
        }
    }
}

const CLOSED_REASON: &str = "the file's cuFile handle is deregistered";

impl TransferFile {
    pub fn new(io: IoFile, backend: Backend) -> Self {
        TransferFile {
            device: Mutex::new(Slot::Unopened),
            opening: Mutex::new(()),
            io,
            backend,
        }
    }

    pub fn io(&self) -> &IoFile {
        &self.io
    }

    /// The backend asked for when the file was opened.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    fn slot(&self) -> MutexGuard<'_, Slot> {
        crate::sync::lock(&self.device)
    }

    /// The device path in use; None before it is opened or once closed.
    pub fn path_state(&self) -> Option<PathState> {
        match &*self.slot() {
            Slot::Open(p) => Some(PathState::of(p)),
            Slot::Unopened | Slot::Closed => None,
        }
    }

    /// Open the device path now (cuFile where it takes the file, else the
    /// bounce pipeline; an error when the backend is cufile and cuFile cannot).
    pub fn open_device_path(&self) -> Result<()> {
        self.open(true).map(drop)
    }

    /// Close the device path: device memory takes the bounce pipeline until
    /// [`TransferFile::open_device_path`]. A cuFile handle is deregistered here,
    /// or when the last transfer still using it ends.
    pub fn close_device_path(&self) {
        let old = std::mem::replace(&mut *self.slot(), Slot::Closed);
        drop(old); // outside the lock: deregistering calls into cuFile
    }

    /// The open path (opened now if `reopen`, or if never opened).
    fn open(&self, reopen: bool) -> Result<Option<Arc<DevicePath>>> {
        let current = |s: &Slot| match s {
            Slot::Open(p) => Some(Some(p.clone())),
            Slot::Closed if !reopen => Some(None),
            _ => None,
        };
        if let Some(p) = current(&self.slot()) {
            return Ok(p);
        }
        let _one = crate::sync::lock(&self.opening);
        if let Some(p) = current(&self.slot()) {
            return Ok(p);
        }
        // SAFETY: the path is kept in `self.device`, declared before `self.io`,
        // or in the `Arc`s of transfers that borrow `self`: it goes before `io`.
        let p = Arc::new(unsafe { open_device_path(&self.io, self.backend)? });
        *self.slot() = Slot::Open(p.clone());
        Ok(Some(p))
    }

    /// The path for a transfer of `segments` (None for host memory only).
    fn path_for(&self, segments: &[Segment]) -> Result<Option<Arc<DevicePath>>> {
        if segments
            .iter()
            .all(|s| s.len == 0 || s.memory == Memory::Host)
        {
            return Ok(None);
        }
        self.open(false)
    }

    /// Write every segment's memory to its file range.
    ///
    /// # Safety
    /// As for [`Engine::write_with`]: each range stays alive and unmodified
    /// (but by work queued before the call on `req.streams`) for the whole
    /// call, and each stream is a live CUstream of its device (or 0).
    pub unsafe fn write(
        &self,
        engine: &Engine,
        segments: &[Segment],
        req: Request<'_>,
    ) -> Result<Report> {
        if let Some(len) = req.file_len.filter(|_| engine.config().preallocate) {
            self.io.preallocate(len)?;
        }
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.run(engine, segments, req, true) }
    }

    /// Read every segment's file range into its memory. A range past the end
    /// of the file is a format error, before any byte moves.
    ///
    /// # Safety
    /// As for [`Engine::read_with`].
    pub unsafe fn read(
        &self,
        engine: &Engine,
        segments: &[Segment],
        req: Request<'_>,
    ) -> Result<Report> {
        let len = self.io.len()?;
        for (i, s) in segments.iter().enumerate() {
            let end = s.file_offset.checked_add(s.len);
            if end.is_none_or(|end| end > len) {
                return Err(Error::format(
                    Some(self.io.path()),
                    format!(
                        "segment {i} (bytes {}..{}) lies past the end of the file ({len} bytes)",
                        s.file_offset,
                        s.file_offset.saturating_add(s.len)
                    ),
                ));
            }
        }
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.run(engine, segments, req, false) }
    }

    /// # Safety
    /// As for [`TransferFile::write`] or [`TransferFile::read`].
    unsafe fn run(
        &self,
        engine: &Engine,
        segments: &[Segment],
        req: Request<'_>,
        write: bool,
    ) -> Result<Report> {
        let path = self.path_for(segments)?;
        let opts = Options {
            path: path.as_deref(),
            checksum: req.checksum,
            streams: req.streams,
            patches: req.patches,
        };
        // SAFETY: forwarded from the caller's contract.
        let stats = unsafe {
            if write {
                engine.write_with(&self.io, segments, opts)?
            } else {
                engine.read_with(&self.io, segments, opts)?
            }
        };
        Ok(self.report(stats, path.as_deref()))
    }

    fn report(&self, stats: Stats, path: Option<&DevicePath>) -> Report {
        let moved = stats.device_path.is_some();
        // A file read from memory fills device memory through the bounce lanes
        // even where cuFile could take it ([`super::memory`]): say so.
        let from_memory = stats.read_path.as_ref().filter(|r| r.memory);
        let (gds_mode, fallback_reason) = match path.filter(|_| moved) {
            Some(DevicePath::CuFile { .. }) if stats.device_path == Some("bounce") => (
                None,
                from_memory.map(|r| format!("the file is read from memory ({})", r.reason)),
            ),
            Some(p) => (p.gds_mode(), p.fallback_reason().map(str::to_owned)),
            None if moved => (None, Some(CLOSED_REASON.to_owned())),
            None => (None, None),
        };
        let direct_reason = self.io.no_direct_reason().map(str::to_owned).or_else(|| {
            from_memory
                .filter(|_| !stats.direct)
                .map(|r| format!("read from memory ({})", r.reason))
        });
        Report {
            backend: self.backend,
            direct_reason,
            gds_mode,
            fallback_reason,
            stats,
        }
    }
}
