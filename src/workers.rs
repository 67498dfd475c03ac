//! The process's worker threads: one pool that every parallel step of the
//! core runs on (the engine's file and memory-path transfers, staging copies,
//! page population, zstd compression, the copy-floor probe), so that a call
//! hands its work to threads that already exist instead of starting its own.
//!
//! A parallel step is a *batch* of `n` tasks, `f(0)` to `f(n - 1)`, each run
//! once, on threads of the pool and, where the caller allows it, on the
//! calling thread too ([`Caller`]). [`run`] returns once every task has
//! returned, so tasks may borrow from the caller's stack, as with
//! `std::thread::scope`; a task's panic is raised in the caller after that.
//! Tasks are usually worker loops that take chunks from a shared counter until
//! none is left, so a batch's first error can stop the others (the engine's
//! `FirstError`).
//!
//! The pool is bounded: it starts threads only when a batch finds too few
//! idle, up to the most that any batch has asked for (the engine's `threads`
//! and `memory_threads`, a stager's `threads`: the machine and the knobs), and
//! never more than [`MAX_THREADS`]. Its threads park between batches and are
//! kept for the life of the process.
//!
//! A thread that waits for a batch while being a pool thread itself (a task
//! that starts a nested batch) always runs that batch's tasks too, so a
//! nested batch finishes even when every pool thread is busy: no deadlock.
//!
//! Fork: a child has none of the parent's threads, and the parent's queue
//! lock may have been held at the fork. The pool records its process id; a
//! process that finds a pool of another pid makes its own (the old one is
//! left alone, leaked) and never touches the parent's locks.

use std::any::Any;
use std::cell::Cell;
use std::collections::VecDeque;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::sync::{lock, wait};

/// Most threads the pool ever holds (the engine's own cap on `threads`).
pub const MAX_THREADS: usize = 256;

/// Whether the calling thread runs tasks of its batch besides the pool's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// It runs tasks too: a batch of `n` needs `n - 1` pool threads, and a
    /// batch of one runs inline. For work that touches no thread state the
    /// caller cares about (host memory copies, file I/O, compression).
    Helps,
    /// It only waits: the tasks run on pool threads (a pool thread waiting
    /// for a nested batch still helps). For work that sets per-thread state,
    /// such as the current CUDA context, which a user's thread must keep.
    Waits,
}

/// Run `f(0)`, ..., `f(n - 1)` in parallel, each once, and return when all
/// have returned. A task's panic is raised here, once every task has ended.
pub fn run(n: usize, caller: Caller, f: impl Fn(usize) + Sync) {
    if n == 0 {
        return;
    }
    let in_pool = IN_POOL.with(Cell::get);
    if n == 1 && (caller == Caller::Helps || in_pool) {
        f(0);
        return;
    }
    let f: &(dyn Fn(usize) + Sync) = &f;
    // SAFETY: the lifetime is erased only to store the reference in the
    // batch. It is called only by `Batch::run_one`, for a task index below
    // `n`, and this function does not return, nor unwind, before every task
    // so claimed has returned (`Finish` waits for them, and on unwinding first
    // withdraws the tasks nobody claimed), so `f` outlives every call.
    let f: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
    let batch = Arc::new(Batch {
        f,
        n,
        next: AtomicUsize::new(0),
        left: Mutex::new(n),
        done: Condvar::new(),
        panic: Mutex::new(None),
    });
    let mut finish = Finish {
        batch: &batch,
        unwinding: true,
    };
    let helps = caller == Caller::Helps || in_pool;
    let want = if helps { n - 1 } else { n };
    let threads = pool().submit(&batch, want);
    if helps || threads == 0 {
        // With no pool thread at all (none could start), the caller is the
        // only one left to run the batch, whatever it asked for.
        while batch.run_one() {}
    }
    finish.unwinding = false;
    drop(finish);
    let panicked = lock(&batch.panic).take();
    if let Some(p) = panicked {
        resume_unwind(p);
    }
}

/// Waits, when dropped, until no task of the batch runs or will run; where
/// `run` is unwinding (its flag never cleared), it first withdraws the tasks
/// nobody has claimed. (A flag, not `std::thread::panicking()`: `run` may be
/// called by a destructor while a panic unwinds, and must then still finish.)
struct Finish<'a> {
    batch: &'a Batch,
    unwinding: bool,
}

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        if self.unwinding {
            self.batch.withdraw();
        }
        self.batch.wait_done();
    }
}

/// Run `job` on a pool thread, without waiting for it (work that must not
/// hold up its caller, such as freeing a replaced file's blocks). Where no
/// pool thread can start, it runs here.
pub fn detach(job: impl FnOnce() + Send + 'static) {
    if let Some(job) = pool().detach(Box::new(job)) {
        job();
    }
}

/// Threads of this process's pool now.
#[cfg(test)]
pub fn threads() -> usize {
    lock(&pool().queue).threads
}

thread_local! {
    /// Set on the pool's own threads.
    static IN_POOL: Cell<bool> = const { Cell::new(false) };
}

/// One parallel step: its tasks, claimed by index.
struct Batch {
    /// The tasks. Not really `'static`: see the SAFETY comment in [`run`].
    f: &'static (dyn Fn(usize) + Sync),
    n: usize,
    /// The next task index to claim.
    next: AtomicUsize,
    /// Tasks not yet returned.
    left: Mutex<usize>,
    done: Condvar,
    /// The first panic of a task, raised by the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Batch {
    /// Claim and run the next task; false when none is left to claim.
    fn run_one(&self) -> bool {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        if i >= self.n {
            return false;
        }
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.f)(i))) {
            lock(&self.panic).get_or_insert(p);
        }
        let mut left = lock(&self.left);
        *left -= 1;
        if *left == 0 {
            self.done.notify_all();
        }
        true
    }

    /// Withdraw the tasks nobody has claimed yet (they will never run).
    fn withdraw(&self) {
        let before = self.next.fetch_max(self.n, Ordering::Relaxed);
        let unclaimed = self.n.saturating_sub(before);
        if unclaimed > 0 {
            let mut left = lock(&self.left);
            *left -= unclaimed;
            if *left == 0 {
                self.done.notify_all();
            }
        }
    }

    fn claimed(&self) -> bool {
        self.next.load(Ordering::Relaxed) >= self.n
    }

    fn wait_done(&self) {
        let mut left = lock(&self.left);
        while *left > 0 {
            left = wait(&self.done, left);
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

struct Queue {
    batches: VecDeque<Arc<Batch>>,
    jobs: VecDeque<Job>,
    /// Threads started (alive: they never end) and those parked now.
    threads: usize,
    idle: usize,
    /// The most threads any batch has wanted: the pool's size bound.
    limit: usize,
}

struct Pool {
    pid: u32,
    queue: Mutex<Queue>,
    work: Condvar,
}

/// This process's pool (see the module doc on fork).
static POOL: AtomicPtr<Pool> = AtomicPtr::new(std::ptr::null_mut());

fn pool() -> &'static Pool {
    let pid = std::process::id();
    loop {
        let p = POOL.load(Ordering::Acquire);
        // SAFETY: a non-null pointer in POOL comes from `Box::leak` below and
        // is never freed: pools live for the rest of the process.
        if let Some(current) = unsafe { p.as_ref() } {
            if current.pid == pid {
                return current;
            }
        }
        let fresh: &'static Pool = Box::leak(Box::new(Pool {
            pid,
            queue: Mutex::new(Queue {
                batches: VecDeque::new(),
                jobs: VecDeque::new(),
                threads: 0,
                idle: 0,
                limit: 1,
            }),
            work: Condvar::new(),
        }));
        let fresh_ptr = fresh as *const Pool as *mut Pool;
        if POOL
            .compare_exchange(p, fresh_ptr, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            // The parent's pool (after a fork) stays leaked: its lock may be held.
            return fresh;
        }
        // Another thread of this process installed its pool first: use that.
        // SAFETY: `fresh` was never shared; it came from `Box::leak` above.
        drop(unsafe { Box::from_raw(fresh_ptr) });
    }
}

impl Pool {
    /// Queue `batch` for `want` pool threads, starting threads where too few
    /// are idle (within the bound); returns the pool's thread count.
    fn submit(&'static self, batch: &Arc<Batch>, want: usize) -> usize {
        if want == 0 {
            return lock(&self.queue).threads;
        }
        let start = {
            let mut q = lock(&self.queue);
            q.batches.push_back(batch.clone());
            q.limit = q.limit.max(want.min(MAX_THREADS));
            let short = want.saturating_sub(q.idle);
            let start = short.min(q.limit - q.threads.min(q.limit));
            q.threads += start;
            for _ in 0..want.min(q.idle) {
                self.work.notify_one();
            }
            start
        };
        self.start(start)
    }

    /// Start `n` threads (counted already); returns the pool's thread count.
    fn start(&'static self, n: usize) -> usize {
        let mut failed = 0;
        for _ in 0..n {
            let spawned = std::thread::Builder::new()
                .name("ckptio-io".into())
                .spawn(move || self.serve());
            failed += usize::from(spawned.is_err());
        }
        let mut q = lock(&self.queue);
        q.threads -= failed;
        q.threads
    }

    /// Queue a detached job; gives it back where no thread can run it.
    fn detach(&'static self, job: Job) -> Option<Job> {
        let start = {
            let mut q = lock(&self.queue);
            q.jobs.push_back(job);
            let start = usize::from(q.idle == 0 && q.threads < q.limit.max(1));
            q.threads += start;
            self.work.notify_one();
            start
        };
        if self.start(start) == 0 {
            return lock(&self.queue).jobs.pop_back();
        }
        None
    }

    /// A pool thread: run the queued batches' tasks and the detached jobs.
    fn serve(&self) {
        IN_POOL.with(|c| c.set(true));
        loop {
            let work = {
                let mut q = lock(&self.queue);
                loop {
                    while q.batches.front().is_some_and(|b| b.claimed()) {
                        q.batches.pop_front();
                    }
                    if let Some(b) = q.batches.front() {
                        break Ok(b.clone());
                    }
                    if let Some(j) = q.jobs.pop_front() {
                        break Err(j);
                    }
                    q.idle += 1;
                    q = wait(&self.work, q);
                    q.idle -= 1;
                }
            };
            match work {
                Ok(batch) => while batch.run_one() {},
                // A detached job's panic ends the job, not the thread.
                Err(job) => drop(catch_unwind(AssertUnwindSafe(job))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    #[test]
    fn every_task_runs_once_and_may_borrow_the_callers_stack() {
        for caller in [Caller::Helps, Caller::Waits] {
            for n in [1, 2, 7, 64] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                run(n, caller, |i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
        run(0, Caller::Waits, |_| unreachable!());
    }

    #[test]
    fn tasks_run_in_parallel_on_pool_threads() {
        // Four tasks that each wait for all four to have started: only
        // possible when they run at once. A waiting caller runs none of them.
        let started = AtomicUsize::new(0);
        let here = std::thread::current().id();
        let on_caller = AtomicBool::new(false);
        run(4, Caller::Waits, |_| {
            if std::thread::current().id() == here {
                on_caller.store(true, Ordering::Relaxed);
            }
            started.fetch_add(1, Ordering::SeqCst);
            let t0 = Instant::now();
            while started.load(Ordering::SeqCst) < 4 {
                assert!(
                    t0.elapsed() < Duration::from_secs(30),
                    "tasks did not overlap"
                );
                std::thread::yield_now();
            }
        });
        assert!(!on_caller.load(Ordering::Relaxed));
        assert!(threads() >= 4 && threads() <= MAX_THREADS);
    }

    #[test]
    fn threads_are_reused_not_started_per_batch() {
        run(3, Caller::Waits, |_| {});
        let before = threads();
        for _ in 0..200 {
            run(3, Caller::Waits, |_| {});
            run(3, Caller::Helps, |_| {});
        }
        // Other tests may grow the pool meanwhile, but never past the bound.
        assert!(threads() >= before && threads() <= MAX_THREADS);
    }

    #[test]
    fn nested_batches_finish_when_every_thread_is_busy() {
        // Many outer tasks each start an inner batch and wait for it: the
        // pool threads running outer tasks help their inner batches.
        let sum = AtomicUsize::new(0);
        run(16, Caller::Waits, |_| {
            run(8, Caller::Waits, |j| {
                sum.fetch_add(j, Ordering::Relaxed);
            });
        });
        assert_eq!(sum.load(Ordering::Relaxed), 16 * 28);
    }

    #[test]
    fn a_panic_reaches_the_caller_after_every_task_ended() {
        let ended = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            run(6, Caller::Waits, |i| {
                std::thread::sleep(Duration::from_millis(5));
                ended.fetch_add(1, Ordering::SeqCst);
                if i == 2 {
                    panic!("task 2 fails");
                }
            });
        }));
        let p = r.unwrap_err();
        assert_eq!(p.downcast_ref::<&str>(), Some(&"task 2 fails"));
        assert_eq!(ended.load(Ordering::SeqCst), 6);
        // The pool still works.
        let n = AtomicUsize::new(0);
        run(5, Caller::Waits, |_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 5);
    }

    #[test]
    fn a_batch_started_while_a_panic_unwinds_still_runs_every_task() {
        struct OnDrop<'a>(&'a AtomicUsize);
        impl Drop for OnDrop<'_> {
            fn drop(&mut self) {
                run(4, Caller::Waits, |_| {
                    self.0.fetch_add(1, Ordering::SeqCst);
                });
            }
        }
        let n = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            let _g = OnDrop(&n);
            panic!("unwinding");
        }));
        assert!(r.is_err());
        assert_eq!(n.load(Ordering::SeqCst), 4);
    }

    #[test]
    fn detached_jobs_run_on_the_pool() {
        let (tx, rx) = std::sync::mpsc::channel();
        let here = std::thread::current().id();
        detach(move || tx.send(std::thread::current().id()).unwrap());
        let id = rx.recv_timeout(Duration::from_secs(30)).unwrap();
        assert_ne!(id, here);
    }

    #[test]
    fn a_forked_child_makes_its_own_pool() {
        run(2, Caller::Waits, |_| {});
        let parent = pool() as *const Pool;
        // SAFETY: the child only runs async-signal-safe-enough Rust that
        // allocates (as any Rust child after fork in a test) and exits with
        // `_exit`; the parent waits for it.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let n = AtomicUsize::new(0);
            run(3, Caller::Waits, |_| {
                n.fetch_add(1, Ordering::Relaxed);
            });
            let ok = n.load(Ordering::Relaxed) == 3 && !std::ptr::eq(pool(), parent);
            // SAFETY: ends the child at once, without running the parent's destructors.
            unsafe { libc::_exit(if ok { 0 } else { 3 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child started above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "{status}"
        );
        assert!(std::ptr::eq(pool(), parent));
    }
}
