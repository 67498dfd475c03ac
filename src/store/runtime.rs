//! The process's one async runtime for object-store requests: made on first
//! use, and made again in a forked child (the parent's runtime threads do not
//! exist there, and its locks may be held: it is leaked, never used or
//! dropped), as the worker pool does (`src/workers.rs`).
//!
//! Callers are plain threads (the engine's lanes, a Python thread with the
//! GIL released): each call blocks its thread on [`block_on`]; the runtime's
//! few threads drive the connections.

use std::future::Future;
use std::sync::atomic::{AtomicPtr, Ordering};

use tokio::runtime::{Builder, Runtime};

use crate::{Error, Result};

/// Threads of the runtime: they only drive sockets and TLS (the callers copy
/// the bytes), so a few serve any number of parallel requests.
const RUNTIME_THREADS: usize = 2;

struct Rt {
    pid: u32,
    rt: Runtime,
}

static RT: AtomicPtr<Rt> = AtomicPtr::new(std::ptr::null_mut());

fn runtime() -> Result<&'static Runtime> {
    let pid = std::process::id();
    loop {
        let p = RT.load(Ordering::Acquire);
        // SAFETY: a non-null pointer in RT comes from `Box::leak` below and is
        // never freed: runtimes live for the rest of the process.
        if let Some(current) = unsafe { p.as_ref() } {
            if current.pid == pid {
                return Ok(&current.rt);
            }
        }
        let rt = Builder::new_multi_thread()
            .worker_threads(RUNTIME_THREADS)
            .thread_name("ckptio-store")
            .enable_all()
            .build()
            .map_err(|e| Error::io("start the object-store runtime", None, e))?;
        let fresh: &'static Rt = Box::leak(Box::new(Rt { pid, rt }));
        let fresh_ptr = fresh as *const Rt as *mut Rt;
        if RT
            .compare_exchange(p, fresh_ptr, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            // The parent's runtime (after a fork) stays leaked: its threads are gone.
            return Ok(&fresh.rt);
        }
        // Another thread installed its runtime first: shut this one down.
        // SAFETY: `fresh` was never shared; it came from `Box::leak` above.
        let mine = unsafe { Box::from_raw(fresh_ptr) };
        mine.rt.shutdown_background();
    }
}

/// Run `fut` to completion on the process's runtime, blocking this thread.
/// Refused (not a panic) on a thread that is already inside an async runtime.
pub fn block_on<F: Future>(fut: F) -> Result<F::Output> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(Error::invalid(
            "ckptio's object-store calls block: call them outside an async runtime \
             (e.g. from tokio::task::spawn_blocking)",
        ));
    }
    Ok(runtime()?.block_on(fut))
}

/// Run `fut` on the runtime without waiting (a best-effort abort from a drop
/// on a thread that may not block).
pub(crate) fn spawn_detached<F>(fut: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    if let Ok(rt) = runtime() {
        drop(rt.spawn(fut));
    }
}
