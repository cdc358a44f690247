//! A window of bytes that many threads claim from, without a shared write
//! per claim: credit parked per CPU.
//!
//! Flow control admits a message while the bytes in flight are below the
//! window. Counting every message on one shared counter makes every sender
//! thread move that counter's cache line to its core: with many senders on
//! few cores that transfer was the largest cost of a small send. Here a
//! claim from the shared pool takes a batch more than it needs and parks
//! the rest in the claiming CPU's slot; the next claims on that CPU spend
//! from the slot, a line that stays in that CPU's cache.
//!
//! Invariant (every change to `claimed` and to the slots keeps it): bytes
//! handed out and not given back, plus the credit parked in the slots, never
//! exceed `claimed`. `claimed` grows only while it is below the window, by
//! one message plus a batch that fits under the window, so the bytes in
//! flight stay below window + one message, as with a single counter. A
//! batch is at most an eighth of the window over all slots, and a claim
//! that finds the pool full takes the parked credit back first, so credit
//! parked on an idle CPU never holds the window closed.

use crossbeam::utils::CachePadded;

use super::cpu;
use super::sync::{AtomicU64, Ordering};

/// Most credit one slot takes per batch.
const MAX_BATCH: u64 = 16 << 10;
/// Below this a batch is not worth it: claims go to the pool one by one.
const MIN_BATCH: u64 = 512;

/// Window credit claimed by many threads (see the module docs).
#[derive(Debug)]
pub struct Credit {
    /// Bytes claimed from the window: in flight plus parked in `slots`.
    claimed: CachePadded<AtomicU64>,
    /// Parked credit per CPU (indexed by the CPU a claim runs on).
    slots: Box<[CachePadded<AtomicU64>]>,
}

impl Credit {
    /// An empty pool with one slot per CPU of this machine (a power of two,
    /// at most 64).
    pub fn new() -> Self {
        let slots = slot_count();
        Credit {
            claimed: CachePadded::new(AtomicU64::new(0)),
            slots: (0..slots)
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
        }
    }

    /// One attempt to claim `len` bytes under `window`: from the parked
    /// credit of the calling CPU, else from the pool (while less than
    /// `window` is claimed), else after taking all parked credit back into
    /// the pool. Never waits.
    pub fn try_claim(&self, len: u64, window: u64) -> bool {
        self.try_claim_on(cpu::current(), len, window)
    }

    /// [`Credit::try_claim`] for a caller that already read its CPU
    /// ([`cpu::current`]); any value is correct, the right one is fastest.
    #[inline]
    pub fn try_claim_on(&self, cpu: usize, len: u64, window: u64) -> bool {
        let slot = &self.slots[cpu & (self.slots.len() - 1)];
        let parked = slot.load(Ordering::Relaxed);
        if parked >= len
            && slot
                .compare_exchange(parked, parked - len, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return true;
        }
        if self.claim_from_pool(slot, len, window) {
            return true;
        }
        self.reclaim_parked() > 0 && self.claim_from_pool(slot, len, window)
    }

    /// Claims `len` (plus a batch for `slot`, if it fits under the window)
    /// while less than `window` is claimed.
    fn claim_from_pool(&self, slot: &AtomicU64, len: u64, window: u64) -> bool {
        let batch = (window / (8 * self.slots.len() as u64)).min(MAX_BATCH);
        let batch = if batch < MIN_BATCH { 0 } else { batch };
        let mut parked = 0;
        let ok = self
            .claimed
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |cur| {
                if cur >= window {
                    return None;
                }
                parked = if cur + len + batch <= window {
                    batch
                } else {
                    0
                };
                Some(cur + len + parked)
            })
            .is_ok();
        if ok && parked > 0 {
            // After `claimed` grew: the invariant holds at every step.
            slot.fetch_add(parked, Ordering::Relaxed);
        }
        ok
    }

    /// Takes the credit parked in every slot back into the pool; returns
    /// how much.
    fn reclaim_parked(&self) -> u64 {
        let mut total = 0;
        for slot in self.slots.iter() {
            if slot.load(Ordering::Relaxed) > 0 {
                total += slot.swap(0, Ordering::Relaxed);
            }
        }
        if total > 0 {
            // After the slots shrank. Saturating: a peer that confirmed
            // more than it was sent may have emptied the pool already.
            self.give_back(total);
        }
        total
    }

    /// `bytes` of claimed window come back (confirmed by the peer, or never
    /// sent). Never goes below zero, whatever a peer claims.
    pub fn give_back(&self, bytes: u64) {
        let _ = self
            .claimed
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                Some(c.saturating_sub(bytes))
            });
    }

    /// Bytes handed out and not given back (a snapshot, for statistics).
    pub fn in_use(&self) -> u64 {
        let parked: u64 = self.slots.iter().map(|s| s.load(Ordering::Relaxed)).sum();
        self.claimed.load(Ordering::Relaxed).saturating_sub(parked)
    }
}

impl Default for Credit {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(not(loom))]
fn slot_count() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .next_power_of_two()
        .min(64)
}

#[cfg(loom)]
fn slot_count() -> usize {
    2
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn small_windows_are_counted_exactly() {
        let c = Credit::new();
        assert!(c.try_claim(600, 1000));
        assert!(c.try_claim(600, 1000), "admitted while below the window");
        assert!(!c.try_claim(1, 1000));
        assert_eq!(c.in_use(), 1200);
        c.give_back(500);
        assert!(c.try_claim(1, 1000));
        assert_eq!(c.in_use(), 701);
        c.give_back(u64::MAX);
        assert_eq!(c.in_use(), 0, "hostile give-backs do not underflow");
    }

    #[test]
    fn parked_credit_is_spent_and_taken_back_when_the_window_fills() {
        let window = 1 << 20;
        let c = Credit::new();
        assert!(c.try_claim(100, window));
        assert_eq!(c.in_use(), 100, "the batch is parked, not in use");
        assert!(c.claimed.load(Ordering::Relaxed) > 100);
        let mut n = 1;
        while c.try_claim(100, window) {
            n += 1;
        }
        // Admitted while below the window: everything claimed was used,
        // nothing stays parked once the pool is full.
        assert!(n * 100 >= window && n * 100 < window + 100 + MAX_BATCH);
        assert_eq!(c.in_use(), n * 100);
        c.give_back(n * 100);
        assert_eq!(c.in_use(), 0);
        assert!(c.try_claim(window - 1, window));
    }

    /// Many threads claim and give back: the bytes in use never pass
    /// window + one message, and every byte comes back.
    #[test]
    fn many_threads_stay_within_the_window() {
        let window: u64 = 256 << 10;
        let c = Arc::new(Credit::new());
        let in_use = Arc::new(AtomicU64::new(0));
        std::thread::scope(|s| {
            for t in 0..16u64 {
                let (c, in_use) = (c.clone(), in_use.clone());
                s.spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..20_000u64 {
                        let len = 64 + (i * 31 + t * 7) % 2000;
                        if c.try_claim(len, window) {
                            let now = in_use.fetch_add(len, Ordering::SeqCst) + len;
                            assert!(now < window + 2064, "{now} bytes in use");
                            held.push(len);
                        }
                        if held.len() > 8 || !held.is_empty() && i % 3 == 0 {
                            let back = held.remove(0);
                            in_use.fetch_sub(back, Ordering::SeqCst);
                            c.give_back(back);
                        }
                    }
                    for back in held {
                        in_use.fetch_sub(back, Ordering::SeqCst);
                        c.give_back(back);
                    }
                });
            }
        });
        assert_eq!(c.in_use(), 0);
        assert!(c.try_claim(window - 1, window), "no credit lost");
    }
}

/// Loom models of the credit pool (`RUSTFLAGS="--cfg loom" cargo test -p
/// dxnet --release --lib loom`): the code above, with loom's atomics.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::primitives::sync::{thread, Arc};

    const WINDOW: u64 = 8192; // batches of 512 with two slots

    /// One thread parks a batch and spends from it while another finds the
    /// pool full and takes the parked credit back: no claim is lost or
    /// granted twice, the bytes in use stay below window + one message,
    /// and all credit comes back.
    #[test]
    fn loom_credit_parks_spends_and_reclaims() {
        loom::model(|| {
            let c = Arc::new(Credit::new());
            assert!(c.try_claim(7000, WINDOW), "first claim: pool empty");
            assert_eq!(c.in_use(), 7000);
            let other = {
                let c = Arc::clone(&c);
                thread::spawn(move || {
                    let mut got = 0;
                    for len in [1000, 100] {
                        if c.try_claim(len, WINDOW) {
                            got += len;
                        }
                    }
                    got
                })
            };
            let mine = if c.try_claim(200, WINDOW) { 200 } else { 0 };
            let theirs = other.join().unwrap();
            let used = 7000 + mine + theirs;
            assert!(used < WINDOW + 1000, "{used} bytes in use");
            assert_eq!(c.in_use(), used);
            c.give_back(used);
            assert_eq!(c.in_use(), 0, "all credit back");
            assert!(
                c.try_claim(WINDOW - 1, WINDOW),
                "the whole window is free again"
            );
        });
    }

    /// Two threads claim from the pool at once while a confirmation gives
    /// window back: the counts add up exactly.
    #[test]
    fn loom_credit_concurrent_claims_and_give_back() {
        loom::model(|| {
            let c = Arc::new(Credit::new());
            assert!(c.try_claim(8000, WINDOW));
            let claimers: Vec<_> = (0..2)
                .map(|_| {
                    let c = Arc::clone(&c);
                    thread::spawn(move || if c.try_claim(600, WINDOW) { 600 } else { 0 })
                })
                .collect();
            c.give_back(8000);
            let got: u64 = claimers.into_iter().map(|t| t.join().unwrap()).sum();
            assert_eq!(c.in_use(), got);
            c.give_back(got);
            assert_eq!(c.in_use(), 0);
        });
    }
}
