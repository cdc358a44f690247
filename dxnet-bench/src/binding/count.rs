//! The receive-side count of a benchmark run, striped by thread.
//!
//! Every received message is counted by the thread that delivers it (a
//! binding's receive or handler threads, often one per core). One shared
//! counter would move its cache line between those cores on every message,
//! a cost the benchmark would add to the binding it measures (about 7 % of
//! all CPU time in a 16-thread dxnet-tcp run with two handler threads).
//! Here each thread adds to its own stripe, and stripes are moved into the
//! shared total in batches of [`BATCH`], with one locked instruction per
//! message (messages and bytes share a word). Near the end (fewer than
//! `STRIPES * BATCH` messages missing from the total) every message sweeps
//! all stripes, so the thread that delivers the last message, or one that
//! sweeps after it, brings the total to exactly the expected count.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Stripes of a count; threads beyond it share them.
const STRIPES: usize = 16;
/// Messages a stripe gathers before it is moved into the total.
const BATCH: u64 = 256;
/// Messages missing from the total below which every message sweeps.
const NEAR: u64 = STRIPES as u64 * BATCH;
/// A stripe's word holds its messages above this bit, their bytes below.
const MSG_SHIFT: u32 = 40;
/// Larger messages add their bytes to the total at once, so that a
/// stripe's bytes (under `BATCH` messages) never reach [`MSG_SHIFT`].
const STRIPE_MAX_LEN: u64 = 1 << 30;

/// One thread's part, on lines of its own (128 bytes: the adjacent-line
/// prefetcher pairs lines).
#[repr(align(128))]
#[derive(Default)]
struct Stripe {
    /// Messages (above [`MSG_SHIFT`]) and payload bytes not yet moved into
    /// the totals.
    pending: AtomicU64,
}

fn messages_of(word: u64) -> u64 {
    word >> MSG_SHIFT
}

fn bytes_of(word: u64) -> u64 {
    word & ((1 << MSG_SHIFT) - 1)
}

/// Messages and bytes received, and whether the expected count was reached.
pub struct ArrivalCount {
    stripes: [Stripe; STRIPES],
    /// Messages moved out of the stripes.
    total: AtomicU64,
    /// Bytes moved out of the stripes.
    total_bytes: AtomicU64,
    expected: AtomicU64,
}

thread_local! {
    /// The calling thread's stripe, assigned in turn on first use.
    static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn stripe_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    STRIPE.with(|s| {
        if s.get() == usize::MAX {
            s.set(NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES);
        }
        s.get()
    })
}

impl ArrivalCount {
    /// A count expecting `expected` messages.
    pub fn new(expected: u64) -> Self {
        ArrivalCount {
            stripes: Default::default(),
            total: AtomicU64::new(0),
            total_bytes: AtomicU64::new(0),
            expected: AtomicU64::new(expected),
        }
    }

    /// Starts over, expecting `expected` messages. Only while nothing is
    /// counted.
    pub fn reset(&self, expected: u64) {
        for s in &self.stripes {
            s.pending.store(0, Ordering::SeqCst);
        }
        self.total.store(0, Ordering::SeqCst);
        self.total_bytes.store(0, Ordering::SeqCst);
        self.expected.store(expected, Ordering::SeqCst);
    }

    /// Counts one message of `len` payload bytes; true for exactly one
    /// call per phase: the one that completed the expected count.
    #[inline]
    pub fn add(&self, len: usize) -> bool {
        let s = &self.stripes[stripe_index()];
        let mut add = 1 << MSG_SHIFT;
        match len as u64 {
            len if len < STRIPE_MAX_LEN => add |= len,
            len => {
                self.total_bytes.fetch_add(len, Ordering::Relaxed);
            }
        }
        // SeqCst on the stripes and the total: the argument that the last
        // message is never left in a stripe needs one order of all of them.
        let pending = messages_of(s.pending.fetch_add(add, Ordering::SeqCst)) + 1;
        if pending >= BATCH || self.near(self.total.load(Ordering::SeqCst)) {
            self.move_out(s)
        } else {
            false
        }
    }

    fn near(&self, total: u64) -> bool {
        total.saturating_add(NEAR) >= self.expected.load(Ordering::Relaxed)
    }

    /// Moves `s` into the total, and every stripe once near the end: a
    /// stripe left by a thread that found the end far (before this move)
    /// is swept by whoever moves after it.
    fn move_out(&self, s: &Stripe) -> bool {
        let (reached, total) = self.take(s);
        if reached || !self.near(total) {
            return reached;
        }
        let mut reached = false;
        for other in &self.stripes {
            reached |= self.take(other).0;
        }
        reached
    }

    /// Adds `s`'s pending messages to the total: whether that reached the
    /// expected count, and the new total.
    fn take(&self, s: &Stripe) -> (bool, u64) {
        let word = s.pending.swap(0, Ordering::SeqCst);
        self.total_bytes
            .fetch_add(bytes_of(word), Ordering::Relaxed);
        let n = messages_of(word);
        if n == 0 {
            return (false, self.total.load(Ordering::SeqCst));
        }
        let total = self.total.fetch_add(n, Ordering::SeqCst) + n;
        (total == self.expected.load(Ordering::Relaxed), total)
    }

    /// Messages counted so far (exact once no thread is counting).
    pub fn messages(&self) -> u64 {
        self.total.load(Ordering::Acquire) + self.pending(messages_of)
    }

    /// Payload bytes counted so far (exact once no thread is counting).
    pub fn bytes(&self) -> u64 {
        self.total_bytes.load(Ordering::Acquire) + self.pending(bytes_of)
    }

    /// One part (`part` of each stripe's word) summed over the stripes.
    fn pending(&self, part: fn(u64) -> u64) -> u64 {
        self.stripes
            .iter()
            .map(|s| part(s.pending.load(Ordering::Acquire)))
            .sum()
    }

    /// The expected count.
    pub fn expected(&self) -> u64 {
        self.expected.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    /// Many threads (more than stripes), each counting a different share,
    /// some shares far below a batch: exactly one call reports the end, and
    /// the totals are exact.
    #[test]
    fn the_last_message_completes_the_count_exactly_once() {
        for round in 0..20u64 {
            let threads = 3 + (round as usize * 7) % 40;
            let shares: Vec<u64> = (0..threads as u64)
                .map(|t| (t * 977 + round * 131) % 2000)
                .collect();
            let expected: u64 = shares.iter().sum();
            let c = ArrivalCount::new(expected);
            let start = Barrier::new(threads);
            let completions: u64 = std::thread::scope(|s| {
                let handles: Vec<_> = shares
                    .iter()
                    .map(|&n| {
                        let (c, start) = (&c, &start);
                        s.spawn(move || {
                            start.wait();
                            (0..n).filter(|&i| c.add((i % 7) as usize)).count() as u64
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).sum()
            });
            assert_eq!(completions, u64::from(expected > 0), "round {round}");
            assert_eq!(c.messages(), expected);
            let bytes: u64 = shares
                .iter()
                .map(|&n| (0..n).map(|i| i % 7).sum::<u64>())
                .sum();
            assert_eq!(c.bytes(), bytes);
        }
    }

    #[test]
    fn a_count_starts_over() {
        let c = ArrivalCount::new(2);
        assert!(!c.add(3));
        assert!(c.add(1 << 31));
        assert_eq!((c.messages(), c.bytes()), (2, 3 + (1 << 31)));
        c.reset(1);
        assert_eq!((c.messages(), c.bytes(), c.expected()), (0, 0, 1));
        assert!(c.add(0));
    }
}
