//! Outcomes of work numbered in the order it was queued, where the queue
//! finishes items in that order: a completion for item `s` means every
//! item before `s` has finished too. An RDMA send queue works so; with
//! selective signalling only some items report, and one report settles a
//! whole run of them.
//!
//! An item ends in one of three ways: done; refused (the first failure,
//! after which the queue is broken); or lost (queued after a refusal, or
//! still pending when the queue closed). Waiters check without locking,
//! park, or register a `Waker`.
//!
//! Updates ([`InOrderTrack::complete_through`], [`InOrderTrack::refuse`],
//! [`InOrderTrack::lose_pending`]) come from one thread at a time (the
//! caller holds the queue's lock). No lost wake-ups: a waiter counts
//! itself in `waiting` (under the lock) and issues a SeqCst fence before
//! it checks and sleeps; an update publishes its state, issues a SeqCst
//! fence and then reads `waiting`.

use std::task::Waker;
use std::time::Instant;

use super::sync::{
    self, fence, sleep_lock as lock, sleep_until as wait_until, AtomicU64, AtomicUsize, Ordering,
    SleepCondvar as Condvar, SleepMutex as Mutex,
};

/// How an item ended, as far as known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Not finished yet.
    Pending,
    /// Finished successfully.
    Done,
    /// Refused: the failure that broke the queue.
    Refused,
    /// Never finished: queued behind a refusal, or pending at close.
    Lost,
}

/// See the [module docs](self). Items are numbered from 1.
#[derive(Debug)]
pub struct InOrderTrack {
    /// Every item up to this one has its outcome.
    done: AtomicU64,
    /// The refused item (0: none).
    refused: AtomicU64,
    /// Items from this one on are lost (`u64::MAX`: none).
    lost_from: AtomicU64,
    /// Items up to this one will be reported without being asked for (the
    /// queue holds a request behind them that reports).
    reported: AtomicU64,
    /// Parked threads plus registered wakers.
    waiting: AtomicUsize,
    wakers: Mutex<Vec<Waker>>,
    cv: Condvar,
}

impl Default for InOrderTrack {
    fn default() -> Self {
        Self::new()
    }
}

// The reporting side is the InfiniBand engine's (and, through
// `transport::Lent`, TCP's sends in place, which use only part of it).
#[cfg_attr(not(feature = "ib"), allow(dead_code))]
impl InOrderTrack {
    /// A track with nothing finished.
    pub fn new() -> Self {
        Self {
            done: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            lost_from: AtomicU64::new(u64::MAX),
            reported: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            wakers: Mutex::new(Vec::new()),
            cv: Condvar::new(),
        }
    }

    /// The outcome of item `seq` (three loads, no lock).
    #[inline]
    pub fn outcome(&self, seq: u64) -> Outcome {
        // `done` first: what the update stored before it is visible then.
        if seq > self.done.load(Ordering::Acquire) {
            Outcome::Pending
        } else if seq >= self.lost_from.load(Ordering::Relaxed) {
            Outcome::Lost
        } else if seq == self.refused.load(Ordering::Relaxed) {
            Outcome::Refused
        } else {
            Outcome::Done
        }
    }

    /// Items up to `seq` will be reported without being asked for.
    #[inline]
    pub fn will_report(&self, seq: u64) {
        self.reported.store(seq, Ordering::Release);
    }

    /// Whether item `seq` will be reported without being asked for (or
    /// has its outcome already).
    #[inline]
    pub fn reports(&self, seq: u64) -> bool {
        seq <= self.reported.load(Ordering::Acquire) || seq <= self.done.load(Ordering::Acquire)
    }

    /// Items up to `seq` finished successfully.
    pub fn complete_through(&self, seq: u64) {
        if seq > self.done.load(Ordering::Relaxed) {
            self.done.store(seq, Ordering::Release);
            self.notify();
        }
    }

    /// Item `seq` was refused, every item before it finished.
    pub fn refuse(&self, seq: u64) {
        if seq > self.done.load(Ordering::Relaxed) {
            self.refused.store(seq, Ordering::Relaxed);
            self.done.store(seq, Ordering::Release);
            self.notify();
        }
    }

    /// The queue closed: every item not finished by now, and every later
    /// one, is lost.
    pub fn lose_pending(&self) {
        let done = self.done.load(Ordering::Relaxed);
        if done == u64::MAX {
            return;
        }
        self.lost_from.store(done + 1, Ordering::Relaxed);
        self.done.store(u64::MAX, Ordering::Release);
        self.notify();
    }

    fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let wakers = {
            let mut g = lock(&self.wakers);
            self.cv.notify_all();
            std::mem::take(&mut *g)
        };
        if !wakers.is_empty() {
            self.waiting.fetch_sub(wakers.len(), Ordering::SeqCst);
            for w in wakers {
                w.wake();
            }
        }
    }

    /// Parks until item `seq` has an outcome or `deadline` passes (under
    /// loom: no deadline); returns the outcome then.
    pub fn wait(&self, seq: u64, deadline: Instant) -> Outcome {
        let mut g = lock(&self.wakers);
        self.waiting.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let outcome = loop {
            let o = self.outcome(seq);
            if o != Outcome::Pending || sync::deadline_passed(deadline) {
                break o;
            }
            g = wait_until(&self.cv, g, deadline);
        };
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        drop(g);
        outcome
    }

    /// Has `waker` woken at the next update (unless it is registered
    /// already); returns item `seq`'s outcome as seen after registering.
    pub fn register(&self, seq: u64, waker: &Waker) -> Outcome {
        let o = self.outcome(seq);
        if o != Outcome::Pending {
            return o;
        }
        {
            let mut g = lock(&self.wakers);
            if !g.iter().any(|w| w.will_wake(waker)) {
                g.push(waker.clone());
                self.waiting.fetch_add(1, Ordering::SeqCst);
            }
        }
        fence(Ordering::SeqCst);
        self.outcome(seq)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::task::Wake;
    use std::time::Duration;

    #[test]
    fn outcomes_follow_completions_refusal_and_close() {
        let t = InOrderTrack::new();
        assert_eq!(t.outcome(1), Outcome::Pending);
        t.complete_through(3);
        assert_eq!(t.outcome(3), Outcome::Done);
        assert_eq!(t.outcome(4), Outcome::Pending);
        t.complete_through(2); // older report: no change
        assert_eq!(t.outcome(3), Outcome::Done);
        t.refuse(5);
        assert_eq!(t.outcome(4), Outcome::Done);
        assert_eq!(t.outcome(5), Outcome::Refused);
        assert_eq!(t.outcome(6), Outcome::Pending);
        t.lose_pending();
        assert_eq!(t.outcome(5), Outcome::Refused);
        assert_eq!(t.outcome(6), Outcome::Lost);
        assert_eq!(t.outcome(1 << 40), Outcome::Lost);
        t.complete_through(9); // after close: nothing changes
        assert_eq!(t.outcome(9), Outcome::Lost);
    }

    #[test]
    fn a_parked_waiter_wakes_on_completion_and_times_out_without() {
        let t = Arc::new(InOrderTrack::new());
        let t2 = t.clone();
        let h = std::thread::spawn(move || t2.wait(2, Instant::now() + Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(20));
        t.complete_through(1);
        t.complete_through(2);
        assert_eq!(h.join().unwrap(), Outcome::Done);
        let start = Instant::now();
        assert_eq!(
            t.wait(3, Instant::now() + Duration::from_millis(20)),
            Outcome::Pending
        );
        assert!(start.elapsed() >= Duration::from_millis(20));
    }

    struct Flag(AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn registered_wakers_are_woken_once_per_registration() {
        let t = InOrderTrack::new();
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let waker = Waker::from(flag.clone());
        assert_eq!(t.register(1, &waker), Outcome::Pending);
        assert_eq!(t.register(1, &waker), Outcome::Pending); // not twice
        assert_eq!(t.wakers.lock().len(), 1);
        t.lose_pending();
        assert!(flag.0.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(t.waiting.load(Ordering::SeqCst), 0);
        assert_eq!(t.register(1, &waker), Outcome::Lost);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicBool;
    use loom::sync::Arc;
    use std::task::Wake;

    fn far() -> Instant {
        Instant::now() + std::time::Duration::from_secs(3600)
    }

    /// A parked waiter is never left asleep: a missed wake-up deadlocks
    /// the model (loom's waits have no timeout).
    #[test]
    fn waiter_sees_completion() {
        loom::model(|| {
            let t = Arc::new(InOrderTrack::new());
            let t2 = t.clone();
            let h = loom::thread::spawn(move || t2.wait(2, far()));
            t.complete_through(1);
            t.complete_through(2);
            assert_eq!(h.join().unwrap(), Outcome::Done);
        });
    }

    /// A refusal and the close that follows it are seen consistently by a
    /// reader racing with them.
    #[test]
    fn refusal_then_close_read_consistently() {
        loom::model(|| {
            let t = Arc::new(InOrderTrack::new());
            let t2 = t.clone();
            let h = loom::thread::spawn(move || {
                let o3 = t2.outcome(3);
                let o2 = t2.outcome(2);
                let o1 = t2.outcome(1);
                (o1, o2, o3)
            });
            t.complete_through(1);
            t.refuse(2);
            t.lose_pending();
            let (o1, o2, o3) = h.join().unwrap();
            assert!(matches!(o3, Outcome::Pending | Outcome::Lost));
            if o3 == Outcome::Lost {
                assert_eq!(o2, Outcome::Refused);
            }
            assert!(matches!(o2, Outcome::Pending | Outcome::Refused));
            if o2 == Outcome::Refused {
                assert_eq!(o1, Outcome::Done);
            }
            assert!(matches!(o1, Outcome::Pending | Outcome::Done));
        });
    }

    struct Flag(AtomicBool);
    impl Wake for Flag {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// A registered waker is woken unless registering already saw the
    /// outcome.
    #[test]
    fn registered_waker_is_not_lost() {
        loom::model(|| {
            let t = Arc::new(InOrderTrack::new());
            let t2 = t.clone();
            let h = loom::thread::spawn(move || t2.complete_through(1));
            let flag = std::sync::Arc::new(Flag(AtomicBool::new(false)));
            let seen = t.register(1, &Waker::from(flag.clone()));
            h.join().unwrap();
            assert!(seen == Outcome::Done || flag.0.load(Ordering::SeqCst));
        });
    }
}
