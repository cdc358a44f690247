//! Window-based flow control, as in DXNet.
//!
//! The sender counts bytes it has written for a connection but the receiver
//! has not yet confirmed as processed, and blocks (with a timeout) while that
//! count is at the window. The receiver counts processed bytes and confirms
//! them in units (`window × threshold` bytes); units travel back with the
//! next data (TCP chunk header, RDMA immediate data) or alone. So however
//! slow a receiver is, at most one window per connection is in flight.
//!
//! The window and unit are the *receiver's*: each side announces them in the
//! connection handshake, and the sender uses the peer's values.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::config::ParkConfig;
use crate::primitives::credit::Credit;
use crate::primitives::deadline::Deadline;
use crate::primitives::park::Idle;
use crate::primitives::wait_queue::{WaitError, WaitQueue};

/// Why a flow-control wait ended without a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowWaitError {
    /// The window stayed full until the deadline.
    Timeout,
    /// The connection closed while waiting.
    Closed,
}

/// Flow-control state of one connection (both directions).
#[derive(Debug)]
pub struct FlowControl {
    /// Sender side: the peer's window and unit (set at handshake).
    peer_window: AtomicU64,
    peer_unit: AtomicU64,
    /// Bytes sent and not confirmed, claimed per CPU in batches.
    in_flight: Credit,
    /// Receiver side: own unit.
    own_unit: u64,
    processed: AtomicU64,
    pending_units: AtomicU32,
    /// Senders blocked on a full window.
    waiters: WaitQueue,
    /// Sends that found the window full (the slow path only).
    stalls: AtomicU64,
    /// Nanoseconds those sends waited for the window.
    blocked_ns: AtomicU64,
}

/// What a connection's flow control shows (`Node::connection_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlowSnapshot {
    /// Sent bytes the peer has not confirmed yet.
    pub in_flight: u64,
    /// The peer's window.
    pub window: u64,
    /// Sends that found the window full.
    pub stalls: u64,
    /// Time those sends waited, in nanoseconds.
    pub blocked_ns: u64,
}

impl FlowControl {
    /// Receiver-side unit `own_unit`; sender side starts with the same
    /// values until [`FlowControl::set_peer`] sets the peer's.
    pub fn new(own_window: u64, own_unit: u64) -> Self {
        Self {
            peer_window: AtomicU64::new(own_window),
            peer_unit: AtomicU64::new(own_unit.max(1)),
            in_flight: Credit::new(),
            own_unit: own_unit.max(1),
            processed: AtomicU64::new(0),
            pending_units: AtomicU32::new(0),
            waiters: WaitQueue::new(),
            stalls: AtomicU64::new(0),
            blocked_ns: AtomicU64::new(0),
        }
    }

    /// A snapshot for statistics (each value read on its own).
    pub fn snapshot(&self) -> FlowSnapshot {
        FlowSnapshot {
            in_flight: self.in_flight.in_use(),
            window: self.peer_window.load(Ordering::Relaxed),
            stalls: self.stalls.load(Ordering::Relaxed),
            blocked_ns: self.blocked_ns.load(Ordering::Relaxed),
        }
    }

    /// Own unit from a window and threshold (always below the window).
    pub fn unit_for(window: u64, threshold: f64) -> u64 {
        ((window as f64 * threshold) as u64).clamp(1, window.saturating_sub(1).max(1))
    }

    /// Sets the peer's announced window and unit (handshake). A unit not
    /// below the window would deadlock, so it is clamped.
    pub fn set_peer(&self, window: u64, unit: u64) {
        let window = window.max(2);
        self.peer_window.store(window, Ordering::Relaxed);
        self.peer_unit
            .store(unit.clamp(1, window - 1), Ordering::Relaxed);
    }

    /// Bytes written but not confirmed.
    #[cfg(test)]
    pub fn in_flight(&self) -> u64 {
        self.in_flight.in_use()
    }

    /// Sender: claims `len` bytes of window, waiting while the window is
    /// full: briefly spinning (as `park` allows), then blocked in a
    /// [`WaitQueue`], which serves blocked senders in order once one of
    /// them was overtaken too often. `open` tells whether the connection
    /// still lives.
    /// A message is admitted whenever the window is not full, so the
    /// in-flight total stays below window + one message. `cpu` is the
    /// caller's CPU ([`crate::primitives::cpu::current`]).
    pub fn acquire(
        &self,
        cpu: usize,
        len: u64,
        deadline: &Deadline,
        park: &ParkConfig,
        open: impl Fn() -> bool,
    ) -> Result<(), FlowWaitError> {
        if self.waiters.may_race()
            && self
                .in_flight
                .try_claim_on(cpu, len, self.peer_window.load(Ordering::Relaxed))
        {
            return Ok(());
        }
        // The window is full: counted, and timed until this send goes on.
        let since = std::time::Instant::now();
        self.stalls.fetch_add(1, Ordering::Relaxed);
        let r = self.acquire_slow(len, deadline, park, open);
        self.blocked_ns
            .fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    fn acquire_slow(
        &self,
        len: u64,
        deadline: &Deadline,
        park: &ParkConfig,
        open: impl Fn() -> bool,
    ) -> Result<(), FlowWaitError> {
        let mut idle = Idle::new(park);
        while self.waiters.may_race() && !idle.step() {
            if self.try_acquire(len) {
                return Ok(());
            }
        }
        crate::primitives::before_blocking();
        self.waiters
            .wait(
                deadline.get(),
                false,
                || !open(),
                || self.try_acquire(len).then_some(()),
                || {},
            )
            .map_err(|e| match e {
                WaitError::Timeout => FlowWaitError::Timeout,
                WaitError::Closed => FlowWaitError::Closed,
            })
    }

    /// One attempt to claim `len` bytes (see [`Credit::try_claim`]).
    fn try_acquire(&self, len: u64) -> bool {
        self.in_flight
            .try_claim(len, self.peer_window.load(Ordering::Relaxed))
    }

    /// Sender: the peer confirmed `units`. Never underflows, whatever a peer
    /// claims.
    pub fn on_confirm(&self, units: u32) {
        if units == 0 {
            return;
        }
        self.on_confirm_bytes(units as u64 * self.peer_unit.load(Ordering::Relaxed));
    }

    /// Sender: `bytes` of window come back (confirmed, or never sent).
    pub fn on_confirm_bytes(&self, bytes: u64) {
        self.in_flight.give_back(bytes);
        self.waiters.wake();
    }

    /// Wakes senders blocked on this window (the connection closed).
    pub fn wake_all(&self) {
        self.waiters.wake_all();
    }

    /// Receiver: `bytes` were processed; true if a new unit became due (the
    /// caller then registers write interest so it is sent).
    pub fn on_processed(&self, bytes: u64) -> bool {
        // Several threads may report at once: the handler holding the
        // connection, and a receiving thread completing responses that
        // arrived outside the stream (standalone). Every byte is added
        // once; whole units are taken out by exactly one of them.
        let mut p = self.processed.fetch_add(bytes, Ordering::AcqRel) + bytes;
        while p >= self.own_unit {
            let units = p / self.own_unit;
            match self.processed.compare_exchange_weak(
                p,
                p - units * self.own_unit,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.pending_units
                        .fetch_add(units.min(u32::MAX as u64) as u32, Ordering::AcqRel);
                    return true;
                }
                Err(cur) => p = cur,
            }
        }
        false
    }

    /// Receiver: takes up to `max` due units for sending.
    pub fn take_units(&self, max: u32) -> u32 {
        let mut taken = 0;
        let _ = self
            .pending_units
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
                taken = c.min(max);
                Some(c - taken)
            });
        taken
    }

    /// Receiver: units due.
    pub fn pending_units(&self) -> u32 {
        self.pending_units.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn window_blocks_and_confirm_releases() {
        let f = FlowControl::new(1000, 500);
        let park = ParkConfig::default();
        let soon = || Deadline::at(Instant::now() + Duration::from_millis(5));
        f.acquire(0, 600, &soon(), &park, || true).unwrap();
        f.acquire(0, 600, &soon(), &park, || true).unwrap(); // 600 < 1000: admitted
        assert_eq!(
            f.acquire(0, 1, &soon(), &park, || true),
            Err(FlowWaitError::Timeout)
        );
        f.on_confirm(1);
        assert_eq!(f.in_flight(), 700);
        f.acquire(0, 1, &soon(), &park, || true).unwrap();
        f.acquire(0, 400, &soon(), &park, || true).unwrap();
        assert_eq!(
            f.acquire(0, 1, &soon(), &park, || false),
            Err(FlowWaitError::Closed)
        );
        f.on_confirm(u32::MAX);
        assert_eq!(f.in_flight(), 0, "hostile confirmations do not underflow");
    }

    #[test]
    fn receiver_units() {
        let f = FlowControl::new(1000, 300);
        assert!(!f.on_processed(200));
        assert!(f.on_processed(500));
        assert_eq!(f.take_units(1), 1);
        assert_eq!(f.take_units(10), 1);
        assert_eq!(f.take_units(10), 0);
        assert_eq!(f.pending_units(), 0);
        assert_eq!(FlowControl::unit_for(1000, 1.0), 999);
    }

    /// A handler thread and receiving threads report processed bytes at
    /// the same time (responses outside the stream): none may be lost, or
    /// the sender's window would shrink for good.
    #[test]
    fn processed_bytes_from_several_threads_add_up() {
        let f = std::sync::Arc::new(FlowControl::new(1 << 20, 1000));
        let threads: u64 = 4;
        let per: u64 = 400_000;
        let start = std::sync::Barrier::new(threads as usize);
        std::thread::scope(|s| {
            for t in 0..threads {
                let f = f.clone();
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    for i in 0..per {
                        f.on_processed(1 + (i * 7 + t) % 97);
                    }
                });
            }
        });
        let total: u64 = (0..threads)
            .map(|t| (0..per).map(|i| 1 + (i * 7 + t) % 97).sum::<u64>())
            .sum();
        let units = u64::from(f.take_units(u32::MAX));
        assert_eq!(units, total / 1000);
        assert_eq!(f.processed.load(Ordering::Relaxed), total % 1000);
    }
}
