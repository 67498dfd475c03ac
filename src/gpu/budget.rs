//! One cap on the host memory ckptio page-locks, for the whole process.
//!
//! Pinned memory is taken out of the machine's RAM until it is given back,
//! and every engine's bounce buffers and every stager's pinned buffers count
//! against one limit: `CKPTIO_PINNED_LIMIT` (a size, "0" pins nothing), by
//! default half of the RAM. What does not fit runs unpinned, slower but never
//! failing: bounce lanes fall back to pageable buffers, staging buffers stay
//! pageable. [`held`] is what ckptio has pinned right now.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::io::env;
use crate::{Error, Result};

/// Bytes pinned now, by every holder of a [`Reservation`].
static HELD: AtomicUsize = AtomicUsize::new(0);
/// The cap; [`UNREAD`] until the environment is first read (or [`set_limit`]).
static LIMIT: AtomicUsize = AtomicUsize::new(UNREAD);
const UNREAD: usize = usize::MAX;

/// Half of the physical memory (all of it where sysconf cannot tell).
fn default_limit() -> usize {
    // SAFETY: sysconf only reads system values.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages <= 0 || page <= 0 {
        return UNREAD - 1;
    }
    (pages as usize).saturating_mul(page as usize) / 2
}

/// The cap in bytes: [`set_limit`]'s, else `CKPTIO_PINNED_LIMIT`, else half of
/// the RAM. A malformed variable is an error naming it.
pub fn limit() -> Result<usize> {
    let l = LIMIT.load(Ordering::Relaxed);
    if l != UNREAD {
        return Ok(l);
    }
    let from_env = env::size("CKPTIO_PINNED_LIMIT")?
        .unwrap_or_else(default_limit)
        .min(UNREAD - 1);
    // A concurrent set_limit wins over the environment.
    let _ = LIMIT.compare_exchange(UNREAD, from_env, Ordering::Relaxed, Ordering::Relaxed);
    Ok(LIMIT.load(Ordering::Relaxed))
}

/// Set the cap (overrides the environment). Memory already pinned stays
/// pinned; only new pins are refused past it.
pub fn set_limit(bytes: usize) {
    LIMIT.store(bytes.min(UNREAD - 1), Ordering::Relaxed);
}

/// Bytes ckptio holds pinned right now (bounce buffers and staging pins).
pub fn held() -> usize {
    HELD.load(Ordering::Relaxed)
}

/// A share of the cap, given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    bytes: usize,
}

impl Reservation {
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        HELD.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Count `bytes` against the cap; None when they do not fit.
pub fn reserve(bytes: usize) -> Result<Option<Reservation>> {
    let cap = limit()?;
    // `then`, not `then_some`: a Reservation made eagerly and dropped on a
    // refusal would give back bytes that were never taken.
    Ok(take(&HELD, cap, bytes).then(|| Reservation { bytes }))
}

/// Add `bytes` to `held` if the sum stays within `cap`.
fn take(held: &AtomicUsize, cap: usize, bytes: usize) -> bool {
    let mut cur = held.load(Ordering::Relaxed);
    loop {
        let Some(next) = cur.checked_add(bytes).filter(|&n| n <= cap) else {
            return false;
        };
        match held.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return true,
            Err(now) => cur = now,
        }
    }
}

/// The error for pinning `bytes` past the cap.
pub fn over_limit(bytes: usize) -> Error {
    let cap = limit().unwrap_or(0);
    Error::io(
        "pin host memory",
        None,
        std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!(
                "{bytes} more bytes would pass the pinned-memory limit \
                 ({cap} bytes, {} held; CKPTIO_PINNED_LIMIT)",
                held()
            ),
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_count_against_the_cap() {
        // On a counter of its own: the process-wide one moves with other tests.
        let held = AtomicUsize::new(0);
        assert!(take(&held, 10_000, 6_000));
        assert!(!take(&held, 10_000, 6_000), "past the cap");
        assert!(take(&held, 10_000, 4_000), "fits exactly");
        assert_eq!(held.load(Ordering::Relaxed), 10_000);
        assert!(take(&held, 10_000, 0), "nothing always fits");
        assert!(!take(&held, usize::MAX, usize::MAX), "no overflow");
        assert!(!take(&AtomicUsize::new(0), 0, 1));
    }

    #[test]
    fn a_refused_reservation_gives_nothing_back() {
        // Other tests move the counter by MiBs meanwhile; a refusal that gave
        // back its bytes would move it by half the address space.
        let before = held();
        assert!(reserve(usize::MAX / 2).unwrap().is_none());
        assert!(held().wrapping_sub(before) < (1 << 40) || before.wrapping_sub(held()) < (1 << 40));
    }

    #[test]
    fn reservations_come_back_when_dropped() {
        let r = reserve(0).unwrap().expect("nothing always fits");
        assert_eq!(r.bytes(), 0);
        drop(r);
        assert!(limit().unwrap() > 0);
        assert!(default_limit() > 0);
    }
}
