//! A bounded queue from the runtime to the application: producers that may
//! wait for room (or give up at once), consumers that block, time out, poll
//! without blocking or `.await` (the queue stores their wakers), and a
//! close that ends both sides.
//!
//! Behind pull receivers (`crate::pull`) and connection-event channels
//! (`crate::events`). A lock and two condition variables rather than a
//! lock-free queue: its consumers are application threads taking decoded
//! messages, whose cost is the message's handling, and the same lock
//! serializes the wakers of async consumers with the pushes that must wake
//! them (no lost wake-up between a failed poll and registering its waker).

use std::collections::VecDeque;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

/// Why [`Mailbox::try_push`] did not queue an item (which it gives back).
#[derive(Debug, PartialEq, Eq)]
pub enum PushError<T> {
    /// The queue holds `capacity` items.
    Full(T),
    /// The queue was closed.
    Closed(T),
}

/// Why a pop returned no item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PopError {
    /// Nothing queued (`try_pop`) or nothing within the deadline.
    Empty,
    /// Closed and drained: nothing will come.
    Closed,
}

#[derive(Debug)]
struct State<T> {
    items: VecDeque<T>,
    closed: bool,
    /// Wakers of consumers polling an empty queue; all are woken by the
    /// next push or the close (each re-polls).
    wakers: Vec<Waker>,
}

/// A bounded multi-producer, multi-consumer queue (see the module docs).
#[derive(Debug)]
pub struct Mailbox<T> {
    state: Mutex<State<T>>,
    not_empty: Condvar,
    not_full: Condvar,
    capacity: usize,
}

impl<T> Mailbox<T> {
    /// An empty queue holding at most `capacity` items (at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Mailbox {
            state: Mutex::new(State {
                items: VecDeque::with_capacity(capacity.min(1024)),
                closed: false,
                wakers: Vec::new(),
            }),
            not_empty: Condvar::new(),
            not_full: Condvar::new(),
            capacity,
        }
    }

    /// The most items it holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Items queued now.
    pub fn len(&self) -> usize {
        self.state.lock().items.len()
    }

    /// True if nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues `item` if there is room, without waiting.
    pub fn try_push(&self, item: T) -> Result<(), PushError<T>> {
        let s = self.state.lock();
        if s.closed {
            return Err(PushError::Closed(item));
        }
        if s.items.len() >= self.capacity {
            return Err(PushError::Full(item));
        }
        self.queue(s, item);
        Ok(())
    }

    /// Queues `item`, waiting while the queue is full; gives it back if
    /// the queue is (or gets) closed. Calls the blocking hook
    /// ([`super::before_blocking`]) before it first waits: a handler thread
    /// waiting here hands its work over like any blocking wait in dxnet.
    pub fn push_wait(&self, item: T) -> Result<(), T> {
        let mut s = self.state.lock();
        let mut hooked = false;
        loop {
            if s.closed {
                return Err(item);
            }
            if s.items.len() < self.capacity {
                self.queue(s, item);
                return Ok(());
            }
            if !hooked {
                hooked = true;
                drop(s);
                super::before_blocking();
                s = self.state.lock();
                continue;
            }
            self.not_full.wait(&mut s);
        }
    }

    fn queue(&self, mut s: parking_lot::MutexGuard<'_, State<T>>, item: T) {
        s.items.push_back(item);
        let wakers = std::mem::take(&mut s.wakers);
        drop(s);
        self.not_empty.notify_one();
        for w in wakers {
            w.wake();
        }
    }

    fn took(&self, s: parking_lot::MutexGuard<'_, State<T>>) {
        drop(s);
        self.not_full.notify_one();
    }

    /// The next item if one is queued.
    pub fn try_pop(&self) -> Result<T, PopError> {
        let mut s = self.state.lock();
        match s.items.pop_front() {
            Some(item) => {
                self.took(s);
                Ok(item)
            }
            None if s.closed => Err(PopError::Closed),
            None => Err(PopError::Empty),
        }
    }

    /// The next item, waiting for one until `deadline` (`None`: without
    /// limit). Items queued before a close are still handed out.
    pub fn pop_wait(&self, deadline: Option<Instant>) -> Result<T, PopError> {
        let mut s = self.state.lock();
        loop {
            if let Some(item) = s.items.pop_front() {
                self.took(s);
                return Ok(item);
            }
            if s.closed {
                return Err(PopError::Closed);
            }
            match deadline {
                None => self.not_empty.wait(&mut s),
                Some(d) => {
                    if self.not_empty.wait_until(&mut s, d).timed_out() && s.items.is_empty() {
                        return Err(if s.closed {
                            PopError::Closed
                        } else {
                            PopError::Empty
                        });
                    }
                }
            }
        }
    }

    /// The next item for an async consumer: `Ready(None)` once closed and
    /// drained; `Pending` registers `cx`'s waker for the next push.
    pub fn poll_pop(&self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut s = self.state.lock();
        if let Some(item) = s.items.pop_front() {
            self.took(s);
            return Poll::Ready(Some(item));
        }
        if s.closed {
            return Poll::Ready(None);
        }
        if !s.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            s.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Closes the queue: pushes fail from now on (waiting ones return their
    /// item), consumers get what is queued, then [`PopError::Closed`].
    /// Returns the items still queued if `drain` is set (they are dropped
    /// by the caller rather than handed out).
    pub fn close(&self, drain: bool) -> Vec<T> {
        let mut s = self.state.lock();
        s.closed = true;
        let left: Vec<T> = if drain {
            s.items.drain(..).collect()
        } else {
            Vec::new()
        };
        let wakers = std::mem::take(&mut s.wakers);
        drop(s);
        self.not_empty.notify_all();
        self.not_full.notify_all();
        for w in wakers {
            w.wake();
        }
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;
    use std::time::Duration;

    #[test]
    fn bounded_in_order_and_closed() {
        let m = Mailbox::new(2);
        m.try_push(1).unwrap();
        m.try_push(2).unwrap();
        assert_eq!(m.try_push(3), Err(PushError::Full(3)));
        assert_eq!(m.try_pop(), Ok(1));
        m.try_push(3).unwrap();
        m.close(false);
        assert_eq!(m.try_push(4), Err(PushError::Closed(4)));
        assert_eq!(m.push_wait(5), Err(5));
        assert_eq!(m.pop_wait(None), Ok(2));
        assert_eq!(m.try_pop(), Ok(3));
        assert_eq!(m.try_pop(), Err(PopError::Closed));
        assert_eq!(m.pop_wait(None), Err(PopError::Closed));
    }

    #[test]
    fn close_with_drain_hands_back_the_rest() {
        let m = Mailbox::new(4);
        m.try_push(1).unwrap();
        m.try_push(2).unwrap();
        assert_eq!(m.close(true), vec![1, 2]);
        assert_eq!(m.try_pop(), Err(PopError::Closed));
    }

    #[test]
    fn pop_times_out_when_empty() {
        let m: Mailbox<u32> = Mailbox::new(1);
        let d = Instant::now() + Duration::from_millis(20);
        assert_eq!(m.pop_wait(Some(d)), Err(PopError::Empty));
        assert!(Instant::now() >= d);
    }

    /// Producers wait while full and every item arrives once, in each
    /// producer's order, with more producers and consumers than cores.
    #[test]
    fn waiting_producers_and_consumers_lose_nothing() {
        const PRODUCERS: usize = 8;
        const CONSUMERS: usize = 4;
        const PER: usize = 5_000;
        let m = Arc::new(Mailbox::new(3));
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for i in 0..PER {
                        m.push_wait((p, i)).unwrap();
                    }
                })
            })
            .collect();
        let consumers: Vec<_> = (0..CONSUMERS)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    while let Ok(x) = m.pop_wait(None) {
                        got.push(x);
                    }
                    got
                })
            })
            .collect();
        for p in producers {
            p.join().unwrap();
        }
        // Everything pushed; close so the consumers end once it is taken.
        m.close(false);
        let mut seen = vec![vec![false; PER]; PRODUCERS];
        for c in consumers {
            // Within one consumer, a producer's items come in order.
            let mut mine = [None::<usize>; PRODUCERS];
            for (p, i) in c.join().unwrap() {
                assert!(mine[p].is_none_or(|j| j < i), "out of order");
                mine[p] = Some(i);
                assert!(!seen[p][i], "duplicate");
                seen[p][i] = true;
            }
        }
        assert!(seen.iter().all(|s| s.iter().all(|&x| x)), "item lost");
    }

    struct CountWake(AtomicUsize);
    impl Wake for CountWake {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn poll_registers_a_waker_that_a_push_and_a_close_wake() {
        let m = Mailbox::new(2);
        let count = Arc::new(CountWake(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        assert_eq!(m.poll_pop(&mut cx), Poll::Pending);
        assert_eq!(m.poll_pop(&mut cx), Poll::Pending); // registered once
        m.try_push(7).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert_eq!(m.poll_pop(&mut cx), Poll::Ready(Some(7)));
        assert_eq!(m.poll_pop(&mut cx), Poll::Pending);
        m.close(false);
        assert_eq!(count.0.load(Ordering::SeqCst), 2);
        assert_eq!(m.poll_pop(&mut cx), Poll::Ready(None));
    }
}
