//! Test-only fault injection and a log of durable operations.
//!
//! Every stage of a save or load that can fail for real (temp file creation,
//! fallocate, each chunk write or read, the CRC patch, fsync of the file,
//! rename, fsync of the folder) calls [`hit`] with its [`Point`]. Normally that
//! is one relaxed load of a static flag that is never set: nothing else runs.
//!
//! Tests arm it with [`set_fault`] (fail the `nth` next hit of a point with an
//! errno) or [`record`] (log every hit, in order, to check that data is written
//! before the fsync that makes it durable, and that before the rename). Both
//! refuse unless `CKPTIO_TEST_FAULTS=1` was in the environment when the process
//! first asked ([`latch_env`], called when the Python module is imported), so
//! production code cannot be made to fail by a stray call.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::{Error, Result};

/// A place where an operating-system call can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    /// Creating the temp file beside the target.
    Create,
    /// Preallocating the temp file.
    Fallocate,
    /// One chunk of data written by the engine.
    Write,
    /// One chunk of data read by the engine.
    Read,
    /// Writing the CRC-32 fields after the data.
    Crc,
    /// fsync of the temp file.
    Fsync,
    /// rename of the temp file over the target.
    Rename,
    /// fsync of the folder, making the rename durable.
    FsyncDir,
}

const POINTS: [(Point, &str, &str); 8] = [
    (Point::Create, "create", "create temp file"),
    (Point::Fallocate, "fallocate", "fallocate"),
    (Point::Write, "write", "pwrite"),
    (Point::Read, "read", "pread"),
    (Point::Crc, "crc", "write CRC-32 of"),
    (Point::Fsync, "fsync", "fsync"),
    (Point::Rename, "rename", "rename"),
    (Point::FsyncDir, "fsync_dir", "fsync folder of"),
];

impl Point {
    pub fn name(self) -> &'static str {
        POINTS.iter().find(|p| p.0 == self).map_or("?", |p| p.1)
    }

    /// The step name the real failure carries in its error (`Error::Io::op`).
    fn op(self) -> &'static str {
        POINTS.iter().find(|p| p.0 == self).map_or("?", |p| p.2)
    }
}

impl std::str::FromStr for Point {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        POINTS
            .iter()
            .find(|p| p.1 == s)
            .map(|p| p.0)
            .ok_or_else(|| {
                let names: Vec<&str> = POINTS.iter().map(|p| p.1).collect();
                Error::invalid(format!(
                    "fault point must be one of {}, not {s:?}",
                    names.join(", ")
                ))
            })
    }
}

struct Fault {
    point: Point,
    errno: i32,
    /// Hits left before this one fails (1: the next).
    left: u64,
    /// Instead of failing: truncate the file to this length, and go on.
    truncate: Option<u64>,
}

#[derive(Default)]
struct State {
    faults: Vec<Fault>,
    log: Option<Vec<String>>,
}

/// Set while a fault is pending or the log records: the only thing the hot path reads.
static ARMED: AtomicBool = AtomicBool::new(false);
static STATE: Mutex<State> = Mutex::new(State {
    faults: Vec::new(),
    log: None,
});

/// Whether `CKPTIO_TEST_FAULTS=1` was set when first asked (then fixed for the process).
pub fn latch_env() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var_os("CKPTIO_TEST_FAULTS").is_some_and(|v| v == "1"))
}

fn state() -> std::sync::MutexGuard<'static, State> {
    crate::sync::lock(&STATE)
}

fn rearm(s: &State) {
    ARMED.store(!s.faults.is_empty() || s.log.is_some(), Ordering::SeqCst);
}

fn require_enabled() -> Result<()> {
    if latch_env() {
        Ok(())
    } else {
        Err(Error::invalid(
            "fault injection is for tests: set CKPTIO_TEST_FAULTS=1 before the process starts",
        ))
    }
}

/// Make the `nth` next hit of `point` (1 = the next one) fail with `errno`, once.
pub fn set_fault(point: Point, errno: i32, nth: u64) -> Result<()> {
    require_enabled()?;
    if nth == 0 || errno <= 0 {
        return Err(Error::invalid(format!(
            "nth must be >= 1 and errno > 0, not nth={nth}, errno={errno}"
        )));
    }
    let mut s = state();
    s.faults.push(Fault {
        point,
        errno,
        left: nth,
        truncate: None,
    });
    rearm(&s);
    Ok(())
}

/// At the `nth` next hit of `point`, truncate the file being transferred to
/// `len` bytes (as another process might), then let the operation go on.
pub fn set_truncation(point: Point, len: u64, nth: u64) -> Result<()> {
    require_enabled()?;
    if nth == 0 {
        return Err(Error::invalid("nth must be >= 1"));
    }
    let mut s = state();
    s.faults.push(Fault {
        point,
        errno: 0,
        left: nth,
        truncate: Some(len),
    });
    rearm(&s);
    Ok(())
}

/// Drop every pending fault and stop recording; returns the faults that never fired.
pub fn clear() -> Vec<(Point, i32)> {
    let mut s = state();
    let left = s.faults.drain(..).map(|f| (f.point, f.errno)).collect();
    s.log = None;
    rearm(&s);
    left
}

/// Start (or restart, emptying it) the operation log.
pub fn record() -> Result<()> {
    require_enabled()?;
    let mut s = state();
    s.log = Some(Vec::new());
    rearm(&s);
    Ok(())
}

/// The operations logged since [`record`], as `"point name"` lines; keeps recording.
pub fn take_log() -> Vec<String> {
    state().log.as_mut().map(std::mem::take).unwrap_or_default()
}

/// Called at each fault point; `path` names the file in the injected error.
#[inline]
pub fn hit(point: Point, path: &Path) -> Result<()> {
    if !ARMED.load(Ordering::Relaxed) {
        return Ok(());
    }
    hit_armed(point, path)
}

#[cold]
fn hit_armed(point: Point, path: &Path) -> Result<()> {
    let mut s = state();
    if let Some(log) = s.log.as_mut() {
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        log.push(format!("{} {name}", point.name()));
    }
    let Some(i) = s.faults.iter().position(|f| f.point == point) else {
        return Ok(());
    };
    s.faults[i].left -= 1;
    if s.faults[i].left > 0 {
        return Ok(());
    }
    let f = s.faults.remove(i);
    rearm(&s);
    if let Some(len) = f.truncate {
        let f = std::fs::OpenOptions::new().write(true).open(path);
        return f
            .and_then(|f| f.set_len(len))
            .map_err(|e| Error::io_at("truncate (test fault)", path, e));
    }
    Err(Error::io_at(
        point.op(),
        path,
        io::Error::from_raw_os_error(f.errno),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_parse_and_unknown_is_invalid() {
        for (p, name, _) in POINTS {
            assert_eq!(name.parse::<Point>().unwrap(), p);
            assert_eq!(p.name(), name);
        }
        assert!(matches!(
            "nope".parse::<Point>(),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn disarmed_hits_are_free_and_pass() {
        // Not armed in unit tests unless a test sets a fault (none does without the env).
        if !latch_env() {
            assert!(set_fault(Point::Write, 5, 1).is_err());
            assert!(hit(Point::Write, Path::new("/x")).is_ok());
        }
    }
}
