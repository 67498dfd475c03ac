//! The engine's idle lanes, and giving their memory back.
//!
//! A lane (one I/O thread's staging buffer and pinned bounce buffers) is kept
//! between transfers so that a steady stream of saves allocates nothing. But
//! pinned memory is taken from the machine for as long as it is held, so it
//! goes back three ways: [`Pool::release`] (an engine's `release_buffers`,
//! and [`release_buffers`] for every engine at once), lanes idle longer than
//! the engine's `idle_release` (a reaper thread, started while some pool holds
//! lanes), and, when a new bounce lane does not fit the pinned-memory cap,
//! every engine's idle lanes before the new lane falls back to pageable memory.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::io::align::AlignedBuf;
use crate::sync::{ensure_thread, lock};
use crate::Result;

use super::Lane;

/// Lanes not in use, and when each was returned.
pub(super) struct Pool {
    idle: Mutex<Vec<(Lane, Instant)>>,
    /// Most lanes kept.
    keep: usize,
    idle_release: Option<Duration>,
    /// Closed: lanes are freed as soon as a transfer returns them.
    closed: AtomicBool,
}

/// Every live engine's pool, for [`release_buffers`] and the reaper.
static POOLS: Mutex<Vec<Weak<Pool>>> = Mutex::new(Vec::new());

impl Pool {
    pub(super) fn new(keep: usize, idle_release: Option<Duration>) -> Arc<Pool> {
        let p = Arc::new(Pool {
            idle: Mutex::new(Vec::new()),
            keep,
            idle_release,
            closed: AtomicBool::new(false),
        });
        let mut all = lock(&POOLS);
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&p));
        p
    }

    /// `n` lanes whose staging buffers hold `want` bytes aligned to `align`:
    /// pooled ones first (lanes too small stay pooled: a file of the other
    /// kind, disk or memory, may come next), new ones for the rest.
    pub(super) fn take(&self, n: usize, want: usize, align: usize) -> Result<Vec<Lane>> {
        let mut lanes = Vec::with_capacity(n);
        {
            let mut idle = lock(&self.idle);
            let mut i = idle.len();
            while lanes.len() < n && i > 0 {
                i -= 1;
                let l = &idle[i].0;
                if l.staging.len() >= want && l.staging.align() >= align {
                    lanes.push(idle.swap_remove(i).0);
                }
            }
        }
        while lanes.len() < n {
            lanes.push(Lane {
                staging: AlignedBuf::new(want, align)?,
                bounce: Vec::new(),
            });
        }
        Ok(lanes)
    }

    /// Pool `lanes` again, at most `keep` (the largest: they serve files of
    /// either kind). Pageable bounce lanes (made when the pinned cap was full)
    /// are not kept: the next transfer tries to pin again.
    pub(super) fn give_back(&self, lanes: Vec<Lane>) {
        let now = Instant::now();
        let dropped = {
            let mut idle = lock(&self.idle);
            for mut l in lanes {
                l.bounce.retain(|b| b.is_pinned());
                idle.push((l, now));
            }
            let mut extra = Vec::new();
            if idle.len() > self.keep {
                idle.sort_by_key(|(l, _)| std::cmp::Reverse(l.staging.len()));
                extra = idle.split_off(self.keep);
            }
            extra
        };
        drop(dropped); // freeing pinned memory is slow: outside the lock
        if self.closed.load(Ordering::Relaxed) {
            self.release();
        } else if let Some(after) = self.idle_release {
            if after.is_zero() {
                self.release();
            } else {
                reaper::ensure_running();
            }
        }
    }

    /// Free every idle lane, and from now on every lane a transfer returns.
    pub(super) fn close(&self) -> usize {
        self.closed.store(true, Ordering::Relaxed);
        self.release()
    }

    /// Free every idle lane; returns the host bytes given back.
    pub(super) fn release(&self) -> usize {
        let lanes = std::mem::take(&mut *lock(&self.idle));
        lanes.iter().map(|(l, _)| lane_bytes(l)).sum()
    }

    /// Free the lanes idle for at least `idle_release` at `now`; returns
    /// whether lanes that will expire later are left.
    fn trim(&self, now: Instant) -> bool {
        let Some(after) = self.idle_release else {
            return false;
        };
        let expired: Vec<(Lane, Instant)> = {
            let mut idle = lock(&self.idle);
            let (old, young) = std::mem::take(&mut *idle)
                .into_iter()
                .partition(|(_, since)| now.saturating_duration_since(*since) >= after);
            *idle = young;
            old
        };
        drop(expired);
        !lock(&self.idle).is_empty()
    }

    pub(super) fn pooled_bytes(&self) -> usize {
        lock(&self.idle).iter().map(|(l, _)| l.staging.len()).sum()
    }

    pub(super) fn pinned_bytes(&self) -> usize {
        lock(&self.idle)
            .iter()
            .flat_map(|(l, _)| &l.bounce)
            .map(|b| b.pinned_bytes())
            .sum()
    }
}

/// Host bytes a lane holds (staging and pinned bounce buffers).
fn lane_bytes(l: &Lane) -> usize {
    l.staging.len() + l.bounce.iter().map(|b| b.pinned_bytes()).sum::<usize>()
}

fn live_pools() -> Vec<Arc<Pool>> {
    let mut all = lock(&POOLS);
    all.retain(|w| w.strong_count() > 0);
    all.iter().filter_map(Weak::upgrade).collect()
}

/// Free the idle lanes of every engine in the process (lanes in use by a
/// transfer are freed when it ends only if their engine releases again).
/// Returns the host bytes given back.
pub fn release_buffers() -> usize {
    live_pools().iter().map(|p| p.release()).sum()
}

/// The thread that frees lanes left idle too long. It runs while some pool
/// holds lanes that will expire, and is started again by the next pool that
/// gets lanes back (in a forked child too: the pid is part of the check).
mod reaper {
    use super::*;

    /// The pid of the process whose reaper runs, if one does.
    static RUNNING: Mutex<Option<u32>> = Mutex::new(None);

    pub(super) fn ensure_running() {
        // No thread (a pid limit): idle lanes then stay until released by hand.
        ensure_thread(&RUNNING, "ckptio-release", run);
    }

    fn run() {
        loop {
            let pools = live_pools();
            let period = pools
                .iter()
                .filter_map(|p| p.idle_release)
                .min()
                .map_or(Duration::from_secs(1), |d| d / 2)
                .clamp(Duration::from_millis(10), Duration::from_secs(5));
            drop(pools);
            std::thread::sleep(period);
            // Under the lock that `ensure_running` takes after a pool gets
            // lanes back: either this pass sees them, or a new reaper starts.
            let mut running = lock(&RUNNING);
            let now = Instant::now();
            let mut left = false;
            for p in live_pools() {
                left |= p.trim(now);
            }
            if !left {
                *running = None;
                return;
            }
        }
    }
}
