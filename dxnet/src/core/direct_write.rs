//! When a plain message is written on the sender's own thread instead of
//! waking the parked send thread (`park.direct_writes`), one per connection.
//!
//! Waking the send thread is what lets back-to-back and concurrent sends
//! aggregate: by the time it runs, the messages that followed are in the
//! ring too and leave in one write. A message that nothing follows gains
//! nothing from the wake-up and pays a thread switch for it, which at
//! moderate rates (a message every 100 µs) is most of its cost. So the
//! sender writes directly when the message comes alone: the send thread has
//! been parked for [`ALONE_GAP`] (no traffic on any connection meanwhile),
//! the last message to this peer that found it parked came at least
//! [`ALONE_GAP`] before, and most recent such lonely messages were not
//! followed by another within [`ALONE_GAP`] (a burst after a pause starts
//! with a lonely message: writing it directly would split the burst into
//! two writes, and two wake-ups at the receiver). Sans clock: the caller
//! passes the time.
//!
//! Updated with plain loads and stores: two senders racing on one
//! connection may lose an update of the score, which only shifts a
//! heuristic.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// A message that finds the send thread parked this long after the last
/// one that did comes alone (20 k messages/s to the peer and fewer).
pub const ALONE_GAP: Duration = Duration::from_micros(50);

/// Every this many lonely messages one is written directly whatever the
/// score, so that a burst pattern that has ended is noticed.
const PROBE_EVERY: u32 = 16;

/// Score of lonely messages that stayed alone, out of this (moving
/// average, weight 1/8).
const FULL: u32 = 256;

/// The per-connection state (see the module documentation).
#[derive(Debug)]
pub struct DirectWrites {
    /// Time (ns, the caller's origin) of the last message that found the
    /// send thread parked, shifted left by one; low bit: it came alone.
    last: AtomicU64,
    /// How often recent lonely messages stayed alone (0..=[`FULL`]).
    score: AtomicU32,
    /// Lonely messages seen (for the probes).
    lonely: AtomicU32,
}

impl Default for DirectWrites {
    fn default() -> Self {
        Self::new()
    }
}

impl DirectWrites {
    /// No message yet: the first one comes alone and is written directly.
    pub const fn new() -> Self {
        Self {
            last: AtomicU64::new(0),
            score: AtomicU32::new(FULL),
            lonely: AtomicU32::new(0),
        }
    }

    /// A plain message found the send thread parked at `now_ns`, parked
    /// for [`ALONE_GAP`] or longer if `quiet`: whether to write it on this
    /// thread.
    pub fn decide(&self, now_ns: u64, quiet: bool) -> bool {
        let prev = self.last.load(Ordering::Relaxed);
        let (prev_ns, prev_alone) = (prev >> 1, prev & 1 == 1);
        let alone =
            quiet && (prev == 0 || now_ns.saturating_sub(prev_ns) >= ALONE_GAP.as_nanos() as u64);
        if prev_alone {
            // The previous lonely message: was it followed within the gap?
            let s = self.score.load(Ordering::Relaxed);
            let hit = if alone { FULL / 8 } else { 0 };
            self.score.store(s - s / 8 + hit, Ordering::Relaxed);
        }
        self.last
            .store((now_ns << 1) | u64::from(alone), Ordering::Relaxed);
        if !alone {
            return false;
        }
        let n = self.lonely.fetch_add(1, Ordering::Relaxed);
        self.score.load(Ordering::Relaxed) >= FULL / 2 || n.is_multiple_of(PROBE_EVERY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1000;

    /// Feeds messages at the given times; returns which were written
    /// directly.
    fn run(d: &DirectWrites, times: impl IntoIterator<Item = u64>) -> Vec<bool> {
        times.into_iter().map(|t| d.decide(t, true)).collect()
    }

    #[test]
    fn messages_far_apart_are_written_directly() {
        let d = DirectWrites::new();
        // 10 k messages/s: every one alone.
        let direct = run(&d, (1..=100).map(|i| i * 100 * US));
        assert!(direct.iter().all(|&x| x));
    }

    #[test]
    fn a_send_thread_parked_briefly_is_woken() {
        // The send thread was at work until just now: others' traffic.
        let d = DirectWrites::new();
        assert!(!d.decide(100 * US, false));
        assert!(d.decide(200 * US, true));
    }

    #[test]
    fn close_messages_wake_the_send_thread() {
        let d = DirectWrites::new();
        let direct = run(&d, (1..=100).map(|i| i * 5 * US));
        assert!(direct[0], "the first comes alone");
        assert!(direct[1..].iter().all(|&x| !x));
    }

    #[test]
    fn bursts_after_pauses_stop_direct_writes_but_probe() {
        let d = DirectWrites::new();
        // Bursts of 5 messages 1 µs apart, every 60 µs: the burst's first
        // message is lonely by its gap but is followed at once.
        let times = (0..200u64).flat_map(|b| (0..5).map(move |k| 1 + b * 60 * US + k * US));
        let direct = run(&d, times);
        let firsts: Vec<bool> = direct.iter().step_by(5).copied().collect();
        assert!(direct.iter().skip(1).step_by(5).all(|&x| !x));
        let late = &firsts[50..];
        let n = late.iter().filter(|&&x| x).count();
        assert!(
            n <= late.len() / PROBE_EVERY as usize + 1,
            "{n} of {} bursts split",
            late.len()
        );
        assert!(n >= 1, "still probing");
        // The bursts end, messages come alone again: direct writes resume.
        let resume = run(&d, (1..=60u64).map(|i| 1_000_000 * US + i * 200 * US));
        assert!(resume[30..].iter().all(|&x| x));
    }
}
