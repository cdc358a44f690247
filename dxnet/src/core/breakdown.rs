//! Per-stage latency of requests (`metrics.breakdown`): where the clock is
//! read along a request's path and the histograms it goes into. The
//! stages are described at [`crate::breakdown`].
//!
//! Off (the default) the runtime holds no [`Breakdown`] and each place
//! below costs one test of an `Option`. On, a request reads the clock five
//! times at its requester and three times at its responder, and each node
//! adds to histograms in its threads' own cells.
//!
//! The receive buffer carries its arrival time (set by
//! [`Core::deliver`](super::Core::deliver) and its inline variant); while
//! a buffer's messages are dispatched the time sits in a thread-local
//! ([`ArrivalScope`]), where the response completion and the request
//! handler read it.

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::Instant;

use crate::breakdown::{Histogram, LatencyBreakdown};
use crate::primitives::histogram::Histograms;

/// Histogram indices, in [`LatencyBreakdown::stages`] order.
const SEND: usize = 0;
const REQUEST_QUEUE: usize = 6;
const STAGES: usize = 10;

static EPOCH: OnceLock<Instant> = OnceLock::new();

fn epoch() -> Instant {
    *EPOCH.get_or_init(Instant::now)
}

/// `t` in nanoseconds since the process's epoch (never 0 after the first
/// call: 0 means "not stamped").
#[inline]
pub fn ns(t: Instant) -> u64 {
    (t.saturating_duration_since(epoch()).as_nanos() as u64).max(1)
}

/// Now, in nanoseconds since the process's epoch.
#[inline]
pub fn now_ns() -> u64 {
    ns(Instant::now())
}

thread_local! {
    /// Arrival time of the buffer whose messages this thread dispatches.
    static ARRIVAL: Cell<u64> = const { Cell::new(0) };
    /// When the request handler running on this thread returned (set as
    /// its response is sent).
    static HANDLER_DONE: Cell<u64> = const { Cell::new(0) };
    /// When this thread last committed a request or response (before
    /// writing it out itself or leaving that to the send thread).
    static COMMITTED: Cell<u64> = const { Cell::new(0) };
}

/// Notes that this thread just committed a request or response.
pub fn committed() {
    COMMITTED.with(|c| c.set(now_ns()));
}

/// When this thread last committed a request or response since the last
/// call (0: not since).
pub fn take_committed() -> u64 {
    COMMITTED.with(|c| c.replace(0))
}

/// Sets the arrival time of the buffer being dispatched on this thread
/// until dropped (nests: a handler blocking on a nested request may
/// dispatch another buffer meanwhile).
pub struct ArrivalScope(u64);

impl ArrivalScope {
    /// Enters a buffer that arrived at `arrived` (0: unknown).
    pub fn enter(arrived: u64) -> Self {
        Self(ARRIVAL.with(|a| a.replace(arrived)))
    }
}

impl Drop for ArrivalScope {
    fn drop(&mut self) {
        ARRIVAL.with(|a| a.set(self.0));
    }
}

/// The arrival time of the buffer this thread dispatches, or `fallback`
/// when unknown (messages to the own node, decoded ahead).
pub fn arrival_or(fallback: u64) -> u64 {
    match ARRIVAL.with(|a| a.get()) {
        0 => fallback,
        t => t.min(fallback),
    }
}

/// Marks the request handler on this thread as returned (its response is
/// being sent).
pub fn handler_returned() {
    HANDLER_DONE.with(|h| h.set(now_ns()));
}

/// A request's times at its requester, stamped along its path.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequesterTimes {
    pub start: u64,
    pub committed: u64,
    pub sent: u64,
    pub arrived: u64,
    pub completed: u64,
}

/// A node's histograms.
#[derive(Debug)]
pub struct Breakdown {
    hist: Histograms,
}

impl Breakdown {
    pub fn new() -> Self {
        epoch();
        Self {
            hist: Histograms::new(STAGES),
        }
    }

    /// Records a request answered at `taken` (the requesting thread holds
    /// the response).
    pub fn record_requester(&self, t: RequesterTimes, taken: u64) {
        let sent = t.sent.max(t.start);
        // Not stamped (nothing committed on this thread): all of it `send`.
        let committed = if t.committed == 0 {
            sent
        } else {
            t.committed.clamp(t.start, sent)
        };
        let arrived = t.arrived.clamp(sent, t.completed.max(sent));
        let completed = t.completed.max(arrived);
        let taken = taken.max(completed);
        self.hist.record(
            SEND,
            &[
                committed - t.start,
                sent - committed,
                arrived - sent,
                completed - arrived,
                taken - completed,
                taken - t.start,
            ],
        );
    }

    /// Runs the request handler `f` on this thread and records its
    /// responder stages if it returned a response.
    pub fn handle(&self, f: impl FnOnce()) {
        let start = now_ns();
        let arrived = arrival_or(start);
        let outer = HANDLER_DONE.with(|h| h.replace(0));
        take_committed();
        f();
        let done = HANDLER_DONE.with(|h| h.replace(outer));
        if done != 0 {
            let done = done.max(start);
            let end = now_ns().max(done);
            let committed = match take_committed() {
                0 => end,
                c => c.clamp(done, end),
            };
            self.hist.record(
                REQUEST_QUEUE,
                &[
                    start - arrived,
                    done - start,
                    committed - done,
                    end - committed,
                ],
            );
        }
    }

    /// What the histograms hold now.
    pub fn snapshot(&self) -> LatencyBreakdown {
        let h = |i| Histogram::from_snapshot(&self.hist.snapshot(i));
        LatencyBreakdown {
            send: h(0),
            post: h(1),
            awaiting: h(2),
            response_receive: h(3),
            wake: h(4),
            round_trip: h(5),
            request_queue: h(6),
            handler: h(7),
            response_send: h(8),
            response_post: h(9),
        }
    }
}
