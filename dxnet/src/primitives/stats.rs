//! Cheap counters for hot paths: striped over cache lines so concurrent
//! sender threads do not contend on one atomic.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam::utils::CachePadded;

const STRIPES: usize = 16;

thread_local! {
    static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
}
static NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);

fn stripe() -> usize {
    STRIPE.with(|s| {
        let v = s.get();
        if v != usize::MAX {
            return v;
        }
        let v = NEXT_STRIPE.fetch_add(1, Ordering::Relaxed) % STRIPES;
        s.set(v);
        v
    })
}

/// A counter that many threads add to and few read.
#[derive(Debug, Default)]
pub struct Counter {
    stripes: [CachePadded<AtomicU64>; STRIPES],
}

impl Counter {
    /// Adds `n`.
    #[inline]
    pub fn add(&self, n: u64) {
        self.stripes[stripe()].fetch_add(n, Ordering::Relaxed);
    }

    /// The sum (not a snapshot across stripes; fine for statistics).
    pub fn get(&self) -> u64 {
        self.stripes.iter().map(|s| s.load(Ordering::Relaxed)).sum()
    }
}

/// Counters of one node.
#[derive(Debug, Default)]
pub struct Stats {
    /// Messages sent.
    pub msgs_sent: Counter,
    /// Bytes (header + payload) sent.
    pub bytes_sent: Counter,
    /// Messages dispatched.
    pub msgs_received: Counter,
    /// Bytes dispatched.
    pub bytes_received: Counter,
    /// Connections opened.
    pub connections_opened: Counter,
    /// Connections closed.
    pub connections_closed: Counter,
    /// Messages with no receiver.
    pub unknown_messages: Counter,
    /// Received buffers handled on a receive thread (inline handling).
    pub inline_buffers: Counter,
}
