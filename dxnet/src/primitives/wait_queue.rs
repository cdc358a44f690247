//! A queue of threads blocked on a shared resource (ring-buffer space, a
//! flow-control window) that bounds how often any of them can be
//! overtaken.
//!
//! Strict first come, first served per message would make every sender
//! that finds others waiting sleep and be woken once per message: a convoy
//! that measured 0.04× the throughput of 16 racing senders. So, as Go's
//! `sync.Mutex` does, the queue has two modes. Normally a release wakes
//! every waiter and they race with threads that did not block (one that
//! runs can take the resource many times in a row). A waiter that was
//! woken and lost the race [`STARVING_AFTER`] times turns the queue
//! *starving*: then arrivals queue behind the waiters instead of racing,
//! only the oldest waiter may take the resource and only it is woken, and
//! each one that leaves wakes the next, until no starving waiter is left.
//! (Waking all of them there would make dozens of threads runnable for
//! one to proceed, and on a few cores the oldest then waits its turn in
//! the scheduler behind all the others: seconds with 64 senders on 2
//! cores.) So no blocked thread is overtaken without bound, and the common
//! case stays a race.
//!
//! No lost wake-ups: a waiter registers (under the lock, counting itself in
//! `queued`), issues a SeqCst fence and only then tries the resource and
//! sleeps, still holding the lock; a releaser changes the resource's state,
//! issues a SeqCst fence and then reads `queued`. Either the waiter's try
//! sees the new state, or the releaser sees the waiter and takes the lock,
//! which it gets only once the waiter sleeps.

use std::collections::VecDeque;
use std::time::Instant;

use super::sync::{
    self, fence, sleep_lock as lock, sleep_until as wait_until, Arc, AtomicBool, AtomicUsize,
    Ordering, SleepCondvar as Condvar, SleepGuard as MutexGuard, SleepMutex as Mutex,
};

/// Lost races after which a waiter makes the queue serve in order. (One
/// under loom, so the models reach the starving mode.)
#[cfg(not(loom))]
pub const STARVING_AFTER: u32 = 8;
/// Lost races after which a waiter makes the queue serve in order.
#[cfg(loom)]
pub const STARVING_AFTER: u32 = 1;

/// Why [`WaitQueue::wait`] gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitError {
    /// The deadline passed before the resource could be taken.
    Timeout,
    /// The resource was closed (the caller's `closed` returned true).
    Closed,
}

/// Threads blocked on a resource; see the module docs.
pub struct WaitQueue {
    /// Threads in the queue: lets releasers skip the lock and the wake-up
    /// when nobody waits.
    queued: AtomicUsize,
    /// Set while a starving waiter is queued: arrivals must queue.
    starving: AtomicBool,
    inner: Mutex<Waiters>,
    /// Where waiters sleep while the queue is not starving: a release wakes
    /// them all with one call.
    racing: Condvar,
}

struct Waiters {
    next_ticket: u64,
    /// In arrival order (a priority waiter at the front).
    queue: VecDeque<Waiter>,
    /// Queued waiters that lost [`STARVING_AFTER`] races.
    starvers: usize,
}

struct Waiter {
    ticket: u64,
    /// The waiter's own condition variable, where it sleeps while the
    /// queue is starving, so that mode wakes exactly the oldest waiter.
    wake: Arc<Condvar>,
}

impl Waiters {
    fn wake_each(&self) {
        for w in &self.queue {
            w.wake.notify_one();
        }
    }

    fn wake_front(&self) {
        if let Some(w) = self.queue.front() {
            w.wake.notify_one();
        }
    }
}

/// A queued waiter on its way out: removes it from the queue, ends the
/// starving mode it started and hands the turn on, on every exit of
/// [`WaitQueue::wait`] (a result, a timeout, a close or a panic in a
/// caller's closure).
struct Leave<'q> {
    queue: &'q WaitQueue,
    /// The queue's lock while the waiter holds it (always, except inside
    /// the wait itself).
    guard: Option<MutexGuard<'q, Waiters>>,
    ticket: u64,
    /// Races lost after a wake-up.
    lost: u32,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let q = self.queue;
        let mut guard = self.guard.take().unwrap_or_else(|| lock(&q.inner));
        let Some(at) = guard.queue.iter().position(|w| w.ticket == self.ticket) else {
            return; // unreachable: a waiter stays queued until it leaves
        };
        guard.queue.remove(at);
        q.queued.fetch_sub(1, Ordering::Relaxed);
        if self.lost >= STARVING_AFTER {
            guard.starvers -= 1;
            if guard.starvers == 0 {
                // Racing again: the others may take what is left now,
                // without waiting for the next release.
                q.starving.store(false, Ordering::Release);
                guard.wake_each();
                return;
            }
        }
        if at == 0 && guard.starvers > 0 {
            // Serving in order: the next waiter's turn (it may find the
            // resource taken again and sleep until the next release).
            guard.wake_front();
        }
    }
}

impl Default for WaitQueue {
    fn default() -> Self {
        Self::new()
    }
}

impl WaitQueue {
    /// An empty queue.
    pub fn new() -> Self {
        WaitQueue {
            queued: AtomicUsize::new(0),
            starving: AtomicBool::new(false),
            inner: Mutex::new(Waiters {
                next_ticket: 0,
                queue: VecDeque::new(),
                starvers: 0,
            }),
            racing: Condvar::new(),
        }
    }

    /// Whether a thread that did not block yet may take the resource on its
    /// own: false while the queue is starving (it must call
    /// [`WaitQueue::wait`] and queue behind the waiters).
    #[inline]
    pub fn may_race(&self) -> bool {
        !self.starving.load(Ordering::Acquire)
    }

    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    /// Whether threads are queued (a snapshot).
    #[inline]
    pub fn has_waiters(&self) -> bool {
        self.queued.load(Ordering::SeqCst) != 0
    }

    /// Queues the calling thread until `attempt` succeeds, `closed()`
    /// holds or `deadline` passes. Racing (see the module docs), or, while
    /// the queue is starving, only as the oldest waiter.
    ///
    /// `attempt` and `closed` run under the queue's lock: they must be short
    /// and must not block or call into this queue. `on_block` runs (under
    /// the lock too) each time the thread is about to sleep.
    ///
    /// A `priority` waiter goes to the front and is never held back: the
    /// one thread whose progress every other waiter needs (a writer holding
    /// a ring buffer exclusively) must not wait behind them.
    pub fn wait<T>(
        &self,
        deadline: Instant,
        priority: bool,
        closed: impl Fn() -> bool,
        mut attempt: impl FnMut() -> Option<T>,
        on_block: impl Fn(),
    ) -> Result<T, WaitError> {
        let wake = own_condvar();
        let mut guard = lock(&self.inner);
        let ticket = guard.next_ticket;
        guard.next_ticket += 1;
        let waiter = Waiter {
            ticket,
            wake: wake.clone(),
        };
        if priority {
            guard.queue.push_front(waiter);
        } else {
            guard.queue.push_back(waiter);
        }
        self.queued.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        // From here on the waiter leaves through `Leave::drop`, also when a
        // caller's closure panics: nothing of it stays queued or starving.
        let mut leave = Leave {
            queue: self,
            guard: Some(guard),
            ticket,
            lost: 0,
        };
        let mut woken = false;
        loop {
            let guard = leave.guard.as_mut().expect("held while looping");
            if closed() {
                return Err(WaitError::Closed);
            }
            let turn = priority
                || guard.starvers == 0
                || guard.queue.front().map(|w| w.ticket) == Some(ticket);
            if turn {
                if let Some(v) = attempt() {
                    return Ok(v);
                }
                if woken && !priority {
                    leave.lost += 1;
                    if leave.lost == STARVING_AFTER {
                        guard.starvers += 1;
                        if guard.starvers == 1 {
                            self.starving.store(true, Ordering::Release);
                            // The others go back to sleep on their own
                            // condition variables.
                            self.racing.notify_all();
                        }
                    }
                }
            }
            if sync::deadline_passed(deadline) {
                return Err(WaitError::Timeout);
            }
            on_block();
            let guard = leave.guard.take().expect("held while looping");
            let cv = if guard.starvers > 0 {
                &*wake
            } else {
                &self.racing
            };
            leave.guard = Some(wait_until(cv, guard, deadline));
            woken = true;
        }
    }

    /// Wakes the queued threads, if any, to retry; costs a fence and a load
    /// when nobody waits. Call after making the resource available.
    #[inline]
    pub fn wake(&self) {
        fence(Ordering::SeqCst);
        if self.queued.load(Ordering::Relaxed) != 0 {
            let guard = lock(&self.inner);
            if guard.starvers > 0 {
                guard.wake_front();
            } else {
                self.racing.notify_all();
            }
        }
    }

    /// Wakes every queued thread, unconditionally (after the resource was
    /// closed: each sees `closed()` and leaves).
    pub fn wake_all(&self) {
        let guard = lock(&self.inner);
        guard.wake_each();
        self.racing.notify_all();
    }

    /// Threads queued now (a snapshot).
    pub fn len(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Whether no thread is queued (a snapshot).
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the queue serves in order now (a snapshot).
    pub fn is_starving(&self) -> bool {
        !self.may_race()
    }
}

/// The calling thread's condition variable: allocated once per thread, so
/// blocking allocates nothing. (A thread is in at most one queue at a
/// time.)
#[cfg(not(loom))]
fn own_condvar() -> Arc<Condvar> {
    thread_local! {
        static OWN: Arc<Condvar> = Arc::new(Condvar::new());
    }
    // `try_with`: blocking paths are reached from thread-local destructors
    // at thread exit, after `OWN` may be gone (a fresh one serves then).
    OWN.try_with(Arc::clone)
        .unwrap_or_else(|_| Arc::new(Condvar::new()))
}

#[cfg(loom)]
fn own_condvar() -> Arc<Condvar> {
    Arc::new(Condvar::new())
}

impl std::fmt::Debug for WaitQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitQueue")
            .field("queued", &self.len())
            .field("starving", &self.is_starving())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, AtomicU64};
    use std::time::Duration;

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(20)
    }

    /// Takes one token if there is one.
    fn take(tokens: &AtomicU64) -> Option<()> {
        tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| t.checked_sub(1))
            .ok()
            .map(|_| ())
    }

    fn wait_until(cond: impl Fn() -> bool) {
        while !cond() {
            std::thread::yield_now();
        }
    }

    /// Every waiter gets a token once enough are released, whether they
    /// come one at a time or all at once.
    #[test]
    fn every_waiter_is_served() {
        let q = WaitQueue::new();
        let tokens = AtomicU64::new(0);
        let n = 8;
        std::thread::scope(|s| {
            for _ in 0..n {
                let (q, tokens) = (&q, &tokens);
                s.spawn(move || {
                    q.wait(far(), false, || false, || take(tokens), || {})
                        .unwrap()
                });
            }
            wait_until(|| q.len() == n);
            tokens.fetch_add(2, Ordering::AcqRel);
            q.wake();
            wait_until(|| q.len() == n - 2);
            tokens.fetch_add((n - 2) as u64, Ordering::AcqRel);
            q.wake();
        });
        assert_eq!(tokens.load(Ordering::Acquire), 0);
        assert!(q.is_empty());
    }

    /// A waiter that keeps losing turns the queue starving: then threads
    /// that come later may neither race nor, queued, take the resource
    /// before it; once it is served, racing resumes.
    #[test]
    fn an_overtaken_waiter_is_served_before_later_ones() {
        let q = WaitQueue::new();
        let open = std::sync::atomic::AtomicBool::new(false);
        let attempts = AtomicU32::new(0);
        std::thread::scope(|s| {
            let (qr, or, ar) = (&q, &open, &attempts);
            let starver = s.spawn(move || {
                qr.wait(
                    far(),
                    false,
                    || false,
                    || {
                        ar.fetch_add(1, Ordering::AcqRel);
                        or.load(Ordering::Acquire).then_some(())
                    },
                    || {},
                )
            });
            wait_until(|| q.len() == 1);
            // Each release it loses (someone else took the resource).
            for round in 1..=STARVING_AFTER {
                assert!(q.may_race(), "round {round}");
                q.wake();
                wait_until(|| attempts.load(Ordering::Acquire) > round || q.is_starving());
            }
            wait_until(|| q.is_starving());
            assert!(!q.may_race());
            // A later waiter whose attempt would succeed gets no turn.
            assert_eq!(
                q.wait(soon(), false, || false, || Some(()), || {}),
                Err(WaitError::Timeout)
            );
            open.store(true, Ordering::Release);
            q.wake();
            starver.join().unwrap().unwrap();
        });
        assert!(q.may_race() && q.is_empty());
    }

    /// A waiter that times out leaves the queue; a priority waiter is never
    /// held back, even by a starving queue; closing wakes everyone.
    #[test]
    fn timeout_priority_and_close() {
        let q = WaitQueue::new();
        let closed = std::sync::atomic::AtomicBool::new(false);
        assert_eq!(
            q.wait(soon(), false, || false, || None::<()>, || {}),
            Err(WaitError::Timeout)
        );
        assert!(q.is_empty());
        std::thread::scope(|s| {
            let (qr, cr) = (&q, &closed);
            let waiters: Vec<_> = (0..3)
                .map(|_| {
                    s.spawn(move || {
                        qr.wait(
                            far(),
                            false,
                            || cr.load(Ordering::Acquire),
                            || None::<()>,
                            || {},
                        )
                    })
                })
                .collect();
            wait_until(|| q.len() == 3);
            // Make it starve: the waiters lose every release.
            while !q.is_starving() {
                q.wake();
                std::thread::yield_now();
            }
            q.wait(far(), true, || false, || Some(()), || {}).unwrap();
            closed.store(true, Ordering::Release);
            q.wake_all();
            for w in waiters {
                assert_eq!(w.join().unwrap(), Err(WaitError::Closed));
            }
        });
        assert!(q.is_empty() && q.may_race());
    }

    /// A waiter whose closure panics after it made the queue starving
    /// leaves nothing behind: the queue races again, is empty, and the
    /// next waiter is served.
    #[test]
    fn a_panicking_waiter_leaves_the_queue_clean() {
        let q = WaitQueue::new();
        let tokens = AtomicU64::new(0);
        let tries = AtomicU32::new(0);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                q.wait(
                    far(),
                    false,
                    || false,
                    || -> Option<()> {
                        if tries.fetch_add(1, Ordering::AcqRel) > STARVING_AFTER + 1 {
                            panic!("attempt fails hard");
                        }
                        None
                    },
                    || {},
                )
            });
            let mut saw_starving = false;
            while !waiter.is_finished() {
                saw_starving |= q.is_starving();
                q.wake();
                std::thread::yield_now();
            }
            assert!(waiter.join().is_err(), "the closure's panic propagates");
            assert!(saw_starving, "the waiter lost enough races to starve");
        });
        assert!(q.is_empty() && q.may_race());
        tokens.store(1, Ordering::Release);
        assert_eq!(
            q.wait(far(), false, || false, || take(&tokens), || {}),
            Ok(())
        );
    }
}

/// Loom models: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p
/// dxnet --release --lib loom`. Deadlines never pass under loom and waits
/// have no timeout, so a lost wake-up shows up as a deadlock.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicU64;

    fn take(tokens: &AtomicU64) -> Option<()> {
        tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| t.checked_sub(1))
            .ok()
            .map(|_| ())
    }

    /// Two threads wait for one token each while another thread releases
    /// them one at a time: both get theirs (no lost wake-up, whether they
    /// queue before or after a release, and each leaving head wakes the
    /// next), and the queue ends empty.
    #[test]
    fn loom_every_waiter_is_served() {
        loom::model(|| {
            let q = Arc::new(WaitQueue::new());
            let tokens = Arc::new(AtomicU64::new(0));
            let waiters: Vec<_> = (0..2)
                .map(|_| {
                    let (q, tokens) = (q.clone(), tokens.clone());
                    loom::thread::spawn(move || {
                        let far = Instant::now() + std::time::Duration::from_secs(3600);
                        q.wait(far, false, || false, || take(&tokens), || {})
                            .unwrap();
                    })
                })
                .collect();
            for _ in 0..2 {
                tokens.fetch_add(1, Ordering::AcqRel);
                q.wake();
            }
            for w in waiters {
                w.join().unwrap();
            }
            assert_eq!(tokens.load(Ordering::Acquire), 0);
            assert!(q.is_empty());
        });
    }

    /// Two blocked waiters and a thread that races (takes the resource
    /// without queueing while the queue lets it) share three releases:
    /// each gets one, through every interleaving of the normal and the
    /// starving mode (entered after one lost race under loom), including
    /// the starving mode ending while tokens are left.
    #[test]
    fn loom_racer_and_waiters() {
        loom::model(|| {
            let q = Arc::new(WaitQueue::new());
            let tokens = Arc::new(AtomicU64::new(0));
            let far = || Instant::now() + std::time::Duration::from_secs(3600);
            let mut threads: Vec<_> = (0..2)
                .map(|_| {
                    let (q, tokens) = (q.clone(), tokens.clone());
                    loom::thread::spawn(move || {
                        q.wait(far(), false, || false, || take(&tokens), || {})
                            .unwrap();
                    })
                })
                .collect();
            threads.push({
                let (q, tokens) = (q.clone(), tokens.clone());
                loom::thread::spawn(move || {
                    if q.may_race() && take(&tokens).is_some() {
                        return;
                    }
                    q.wait(far(), false, || false, || take(&tokens), || {})
                        .unwrap();
                })
            });
            for _ in 0..3 {
                tokens.fetch_add(1, Ordering::AcqRel);
                q.wake();
            }
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(tokens.load(Ordering::Acquire), 0);
            assert!(q.is_empty() && q.may_race());
        });
    }

    /// A waiter racing with close leaves with `Closed` (close wakes it
    /// whichever order the two take).
    #[test]
    fn loom_close_wakes_waiters() {
        loom::model(|| {
            let q = Arc::new(WaitQueue::new());
            let closed = Arc::new(loom::sync::atomic::AtomicBool::new(false));
            let waiter = {
                let (q, closed) = (q.clone(), closed.clone());
                loom::thread::spawn(move || {
                    let far = Instant::now() + std::time::Duration::from_secs(3600);
                    q.wait(
                        far,
                        false,
                        || closed.load(Ordering::Acquire),
                        || None::<()>,
                        || {},
                    )
                })
            };
            closed.store(true, Ordering::Release);
            q.wake_all();
            assert_eq!(waiter.join().unwrap(), Err(WaitError::Closed));
        });
    }

    /// Two waiters that lose races (the queue starves) leave with `Closed`
    /// when the resource closes, and leave the queue empty and racing.
    #[test]
    fn loom_close_while_starving() {
        loom::model(|| {
            let q = Arc::new(WaitQueue::new());
            let closed = Arc::new(loom::sync::atomic::AtomicBool::new(false));
            let waiters: Vec<_> = (0..2)
                .map(|_| {
                    let (q, closed) = (q.clone(), closed.clone());
                    loom::thread::spawn(move || {
                        let far = Instant::now() + std::time::Duration::from_secs(3600);
                        q.wait(
                            far,
                            false,
                            || closed.load(Ordering::Acquire),
                            || None::<()>,
                            || {},
                        )
                    })
                })
                .collect();
            q.wake(); // nothing to take: a woken waiter loses and starves
            closed.store(true, Ordering::Release);
            q.wake_all();
            for w in waiters {
                assert_eq!(w.join().unwrap(), Err(WaitError::Closed));
            }
            assert!(q.is_empty() && q.may_race());
        });
    }

    /// A priority waiter (the exclusive writer) that arrives while another
    /// waiter may be starving is not held back behind it; both get their
    /// token and the queue ends empty and racing.
    #[test]
    fn loom_priority_while_starving() {
        loom::model(|| {
            let q = Arc::new(WaitQueue::new());
            let tokens = Arc::new(AtomicU64::new(0));
            let far = || Instant::now() + std::time::Duration::from_secs(3600);
            let normal = {
                let (q, tokens) = (q.clone(), tokens.clone());
                loom::thread::spawn(move || {
                    q.wait(far(), false, || false, || take(&tokens), || {})
                        .unwrap();
                })
            };
            q.wake(); // nothing to take: if woken, the waiter starves
            let priority = {
                let (q, tokens) = (q.clone(), tokens.clone());
                loom::thread::spawn(move || {
                    q.wait(far(), true, || false, || take(&tokens), || {})
                        .unwrap();
                })
            };
            for _ in 0..2 {
                tokens.fetch_add(1, Ordering::AcqRel);
                q.wake();
            }
            normal.join().unwrap();
            priority.join().unwrap();
            assert_eq!(tokens.load(Ordering::Acquire), 0);
            assert!(q.is_empty() && q.may_race());
        });
    }
}
