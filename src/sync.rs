//! Locks and background threads shared by the layers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

use crate::Error;

/// The first error of the threads of one parallel step, kept (the later ones
/// are dropped), and a flag the others poll to stop taking work.
#[derive(Default)]
pub(crate) struct FirstError {
    failed: AtomicBool,
    error: Mutex<Option<Error>>,
}

impl FirstError {
    /// Whether a thread has failed: stop taking work.
    pub(crate) fn failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    /// Record `e` (kept only if it is the first).
    pub(crate) fn set(&self, e: Error) {
        self.failed.store(true, Ordering::Relaxed);
        lock(&self.error).get_or_insert(e);
    }

    /// The first error, once every thread has ended.
    pub(crate) fn into_inner(self) -> Option<Error> {
        into_inner(self.error)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_error_of_many_threads_is_kept() {
        let first = FirstError::default();
        assert!(!first.failed());
        first.set(Error::invalid("first"));
        std::thread::scope(|s| {
            for i in 0..4 {
                let first = &first;
                s.spawn(move || first.set(Error::invalid(format!("later {i}"))));
            }
        });
        assert!(first.failed());
        let e = first.into_inner().unwrap();
        assert!(e.to_string().contains("first"), "{e}");
        assert!(FirstError::default().into_inner().is_none());
    }
}
