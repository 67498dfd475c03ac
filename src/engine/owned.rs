//! The memory a call's owners hold, and the check that every range the call
//! moves lies inside it.
//!
//! A caller hands raw addresses together with the objects that own that
//! memory. The binding reads each owner's extent (address, length, host or
//! CUDA device) from the owner itself; [`Owned`] then checks, before any byte
//! moves, that every range lies inside one owner's extent on the same memory,
//! so a wrong address is a typed error instead of a write into someone else's
//! memory. Extents that overlap (a tensor and its storage, two views of one
//! allocation) are merged: their union is memory the owners hold. Extents that
//! only touch stay apart, so one range never spans two allocations.
//!
//! Zero-length ranges are accepted whatever their address: nothing is read or
//! written there (the engine skips them).

use crate::{Error, Result};

use super::Memory;

/// One owner's memory: `[addr, addr + len)` on `memory`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub memory: Memory,
    pub addr: u64,
    pub len: u64,
}

/// The owners' extents, sorted and merged for a binary search per range.
#[derive(Clone, Debug, Default)]
pub struct Owned {
    /// (memory key, start, end), sorted, disjoint.
    spans: Vec<(i64, u64, u64)>,
}

/// Host memory sorts before every device.
fn key(m: Memory) -> i64 {
    match m {
        Memory::Host => -1,
        Memory::Cuda(d) => i64::from(d),
    }
}

/// "host memory", "CUDA device 1 memory": for error messages.
pub fn describe(m: Memory) -> String {
    match m {
        Memory::Host => "host memory".into(),
        Memory::Cuda(d) => format!("CUDA device {d} memory"),
    }
}

impl Owned {
    /// The extents of a call's owners. Empty extents and those at address 0
    /// (an empty storage) own nothing; an extent that overflows is cut at the
    /// end of the address space (no range can pass it anyway).
    pub fn new(extents: impl IntoIterator<Item = Extent>) -> Self {
        let mut spans: Vec<(i64, u64, u64)> = extents
            .into_iter()
            .filter(|e| e.len > 0 && e.addr != 0)
            .map(|e| (key(e.memory), e.addr, e.addr.saturating_add(e.len)))
            .collect();
        spans.sort_unstable();
        let mut merged: Vec<(i64, u64, u64)> = Vec::with_capacity(spans.len());
        for s in spans {
            match merged.last_mut() {
                // Overlapping (not merely touching) extents of one memory.
                Some(m) if m.0 == s.0 && s.1 < m.2 => m.2 = m.2.max(s.2),
                _ => merged.push(s),
            }
        }
        Owned { spans: merged }
    }

    /// Whether `[addr, addr + len)` on `memory` lies inside one owner's extent
    /// (always, for an empty range).
    pub fn contains(&self, memory: Memory, addr: u64, len: u64) -> bool {
        if len == 0 {
            return true;
        }
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        let k = key(memory);
        // The last span starting at or before `addr` (spans are disjoint).
        let i = self.spans.partition_point(|s| (s.0, s.1) <= (k, addr));
        i > 0 && {
            let s = self.spans[i - 1];
            s.0 == k && end <= s.2
        }
    }

    /// [`Owned::contains`], or an `InvalidArgument` error naming the range
    /// (`what()`: "segment 3", "copy 7 source", ...).
    pub fn check(
        &self,
        memory: Memory,
        addr: u64,
        len: u64,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        if self.contains(memory, addr, len) {
            return Ok(());
        }
        Err(Error::invalid(format!(
            "{} ({len} bytes at {addr:#x}, {}) is not inside the memory of any of its owners",
            what(),
            describe(memory)
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(memory: Memory, addr: u64, len: u64) -> Extent {
        Extent { memory, addr, len }
    }

    #[test]
    fn ranges_must_lie_inside_one_owner_on_the_same_memory() {
        let o = Owned::new([
            ext(Memory::Host, 1000, 100),
            ext(Memory::Host, 1100, 50), // touches the first: a separate allocation
            ext(Memory::Cuda(0), 1000, 4096),
            ext(Memory::Cuda(1), 1 << 40, 10),
        ]);
        assert!(o.contains(Memory::Host, 1000, 100));
        assert!(o.contains(Memory::Host, 1010, 10));
        assert!(o.contains(Memory::Host, 1100, 50));
        // Past the end, before the start, across two owners that only touch.
        assert!(!o.contains(Memory::Host, 1000, 101));
        assert!(!o.contains(Memory::Host, 999, 2));
        assert!(!o.contains(Memory::Host, 1090, 20));
        assert!(!o.contains(Memory::Host, 1150, 1));
        // The same addresses on another memory.
        assert!(o.contains(Memory::Cuda(0), 1000, 4096));
        assert!(!o.contains(Memory::Cuda(1), 1000, 10));
        assert!(!o.contains(Memory::Host, 2000, 10));
        assert!(o.contains(Memory::Cuda(1), (1 << 40) + 9, 1));
        // Overflowing ranges never pass; empty ones always do.
        assert!(!o.contains(Memory::Host, u64::MAX, 2));
        assert!(o.contains(Memory::Host, 0, 0));
        assert!(o.contains(Memory::Cuda(7), u64::MAX, 0));
        // No owners: nothing but empty ranges.
        let none = Owned::new([]);
        assert!(!none.contains(Memory::Host, 1, 1));
        assert!(none.contains(Memory::Host, 1, 0));
    }

    #[test]
    fn overlapping_extents_merge_and_empty_ones_own_nothing() {
        let o = Owned::new([
            ext(Memory::Host, 100, 50),
            ext(Memory::Host, 0, 10),   // address 0: an empty storage
            ext(Memory::Host, 500, 0),  // empty
            ext(Memory::Host, 120, 80), // overlaps the first: [100, 200)
            ext(Memory::Host, 110, 5),  // nested
            ext(Memory::Host, u64::MAX - 4, 100),
        ]);
        assert!(o.contains(Memory::Host, 100, 100));
        assert!(!o.contains(Memory::Host, 100, 101));
        assert!(!o.contains(Memory::Host, 1, 5));
        assert!(!o.contains(Memory::Host, 500, 1));
        assert!(o.contains(Memory::Host, u64::MAX - 4, 4));
        let e = o
            .check(Memory::Cuda(2), 100, 8, || "segment 4".into())
            .unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::InvalidArgument(_)), "{msg}");
        assert!(msg.contains("segment 4") && msg.contains("0x64"), "{msg}");
        assert!(msg.contains("CUDA device 2"), "{msg}");
    }

    mod prop {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// The binary search agrees with a scan of every owner (after
            /// merging overlaps) for any owners and range.
            #[test]
            fn contains_agrees_with_a_scan(
                owners in proptest::collection::vec((0i32..3, 0u64..2000, 0u64..300), 0..40),
                dev in 0i32..3,
                addr in 0u64..2400,
                len in 0u64..400,
            ) {
                let mem = |d: i32| if d == 0 { Memory::Host } else { Memory::Cuda(d - 1) };
                let extents: Vec<Extent> =
                    owners.iter().map(|&(d, a, n)| ext(mem(d), a, n)).collect();
                let o = Owned::new(extents.iter().copied());
                // The scan: grow each owner by every owner overlapping it, to a fixpoint.
                let mut spans: Vec<(Memory, u64, u64)> = extents
                    .iter()
                    .filter(|e| e.len > 0 && e.addr != 0)
                    .map(|e| (e.memory, e.addr, e.addr + e.len))
                    .collect();
                loop {
                    let mut grew = false;
                    for i in 0..spans.len() {
                        for j in 0..spans.len() {
                            let (a, b) = (spans[i], spans[j]);
                            if a.0 == b.0 && b.1 < a.2 && a.1 < b.2 {
                                let u = (a.0, a.1.min(b.1), a.2.max(b.2));
                                if u != a {
                                    spans[i] = u;
                                    grew = true;
                                }
                            }
                        }
                    }
                    if !grew {
                        break;
                    }
                }
                let want = len == 0
                    || spans
                        .iter()
                        .any(|s| s.0 == mem(dev) && s.1 <= addr && addr + len <= s.2);
                prop_assert_eq!(o.contains(mem(dev), addr, len), want);
            }
        }
    }
}
