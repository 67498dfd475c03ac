//! Locks and background threads shared by the layers.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// `m` locked, also after a thread panicked while holding it: the data the
/// core guards this way stays consistent at every step (counters, lists).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `m`'s data once no thread holds it any more (the end of a thread scope),
/// also after one panicked holding it (as [`lock`]).
pub(crate) fn into_inner<T>(m: Mutex<T>) -> T {
    m.into_inner().unwrap_or_else(|p| p.into_inner())
}

/// `cv` waited on with `g`, also after a thread panicked holding its lock (as [`lock`]).
pub(crate) fn wait<'a, T>(cv: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(g).unwrap_or_else(|p| p.into_inner())
}

/// [`wait`] for at most `timeout`.
pub(crate) fn wait_timeout<'a, T>(
    cv: &Condvar,
    g: MutexGuard<'a, T>,
    timeout: Duration,
) -> MutexGuard<'a, T> {
    cv.wait_timeout(g, timeout)
        .unwrap_or_else(|p| p.into_inner())
        .0
}

/// Starts `run` on a thread named `name` unless `running` holds this
/// process's pid (a forked child starts its own); whether one runs now. A
/// thread that cannot start (a pid limit) leaves `running` as it was.
/// `run` clears `running` itself, under its lock, if it ever stops.
pub(crate) fn ensure_thread(running: &Mutex<Option<u32>>, name: &str, run: fn()) -> bool {
    let pid = std::process::id();
    let mut now = lock(running);
    if *now == Some(pid) {
        return true;
    }
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .spawn(run)
        .is_ok();
    if spawned {
        *now = Some(pid);
    }
    spawned
}
