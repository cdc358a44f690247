//! Synchronization shim.
//!
//! Everything in `orb/`, `write_interest.rs`, `credit.rs`, `wait_queue.rs`,
//! `in_order.rs`, `free_stack.rs`, `park.rs` (its `Signal`),
//! `ring_notes.rs` and (for its device-access count) `buffer_mem.rs`
//! takes its atomics and threads from
//! here: the std primitives normally, loom's under `--cfg loom`, so the
//! loom models check the real code rather than a copy. (Locks:
//! `wait_queue.rs`, `Signal` and `RingNotes` use parking_lot's normally, loom's under
//! loom; the loom-only helpers below serve them and the model queue.)

#[cfg(loom)]
pub use loom::{
    sync::atomic::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering},
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread,
};
#[cfg(not(loom))]
pub use std::{
    hint::spin_loop,
    sync::atomic::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering},
    sync::Arc,
    thread,
};

#[cfg(loom)]
use std::sync::PoisonError;
use std::time::Instant;

/// Locks loom's `m`, ignoring poisoning: the data these mutexes guard
/// stays consistent even if a holder panicked.
#[cfg(loom)]
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether `deadline` has passed. Always `false` under loom: loom cannot
/// model time, and a real clock would make its executions nondeterministic.
pub fn deadline_passed(deadline: Instant) -> bool {
    #[cfg(loom)]
    {
        let _ = deadline;
        false
    }
    #[cfg(not(loom))]
    {
        Instant::now() >= deadline
    }
}

/// Blocks on loom's `cv` until notified. Loom cannot model time, so the
/// wait has no timeout: a lost wake-up shows up as a deadlock in the model
/// instead of being papered over by a timer.
#[cfg(loom)]
pub fn wait_until<'a, T>(
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    _deadline: Instant,
) -> MutexGuard<'a, T> {
    cv.wait(guard).unwrap_or_else(PoisonError::into_inner)
}

/// A mutex and condition variable for threads that sleep on a primitive's
/// state: parking_lot's normally (its condition variable moves the threads
/// a `notify_all` wakes onto the mutex's queue instead of waking them all
/// to fight for it: a release that wakes a dozen blocked senders then
/// costs one wake-up at a time), loom's under loom, for the models.
#[cfg(loom)]
pub use loom::sync::{Condvar as SleepCondvar, Mutex as SleepMutex, MutexGuard as SleepGuard};
#[cfg(not(loom))]
pub use parking_lot::{Condvar as SleepCondvar, Mutex as SleepMutex, MutexGuard as SleepGuard};

/// Locks a [`SleepMutex`].
pub fn sleep_lock<T>(m: &SleepMutex<T>) -> SleepGuard<'_, T> {
    #[cfg(loom)]
    return lock(m);
    #[cfg(not(loom))]
    return m.lock();
}

/// Sleeps on `cv` until notified or `deadline` (no timeout under loom,
/// see [`wait_until`]).
pub fn sleep_until<'a, T>(
    cv: &SleepCondvar,
    mut guard: SleepGuard<'a, T>,
    deadline: Instant,
) -> SleepGuard<'a, T> {
    #[cfg(loom)]
    {
        let _ = &mut guard;
        wait_until(cv, guard, deadline)
    }
    #[cfg(not(loom))]
    {
        cv.wait_until(&mut guard, deadline);
        guard
    }
}

/// Bounded MPMC queue, allocated once: crossbeam's lock-free `ArrayQueue`
/// normally (no allocation per push, unlike `SegQueue`); under loom a
/// mutex-protected `VecDeque` (loom cannot see inside crossbeam) that also
/// asserts an element is never queued twice at once.
pub struct Queue<T> {
    #[cfg(not(loom))]
    inner: crossbeam::queue::ArrayQueue<T>,
    #[cfg(loom)]
    inner: Mutex<std::collections::VecDeque<T>>,
    #[cfg(loom)]
    capacity: usize,
}

impl<T: PartialEq + std::fmt::Debug> Queue<T> {
    /// An empty queue holding at most `capacity` elements.
    pub fn new(capacity: usize) -> Self {
        Queue {
            #[cfg(not(loom))]
            inner: crossbeam::queue::ArrayQueue::new(capacity),
            #[cfg(loom)]
            inner: Mutex::new(std::collections::VecDeque::with_capacity(capacity)),
            #[cfg(loom)]
            capacity,
        }
    }

    /// Appends `v` at the back; gives it back if the queue is full.
    pub fn push(&self, v: T) -> Result<(), T> {
        #[cfg(not(loom))]
        return self.inner.push(v);
        #[cfg(loom)]
        {
            let mut q = lock(&self.inner);
            assert!(!q.contains(&v), "{v:?} queued twice");
            if q.len() == self.capacity {
                return Err(v);
            }
            q.push_back(v);
            Ok(())
        }
    }

    /// Takes the front element, if any.
    pub fn pop(&self) -> Option<T> {
        #[cfg(not(loom))]
        return self.inner.pop();
        #[cfg(loom)]
        return lock(&self.inner).pop_front();
    }

    /// Whether the queue is empty (a snapshot).
    pub fn is_empty(&self) -> bool {
        #[cfg(not(loom))]
        return self.inner.is_empty();
        #[cfg(loom)]
        return lock(&self.inner).is_empty();
    }
}

/// Data-race detector for the ring's bytes, which live in a plain
/// `UnsafeCell<u8>` buffer that loom cannot see. Under loom it shadows every
/// byte with a loom cell and registers each write (producer) and read
/// (consumer), so loom reports an access not ordered by the ring's
/// Acquire/Release protocol. Without loom it is empty and costs nothing.
pub struct ByteTracker {
    #[cfg(loom)]
    cells: Box<[loom::cell::UnsafeCell<()>]>,
}

impl ByteTracker {
    /// Shadows a ring of `capacity` bytes (a power of two).
    pub fn new(capacity: usize) -> Self {
        #[cfg(loom)]
        return ByteTracker {
            cells: (0..capacity)
                .map(|_| loom::cell::UnsafeCell::new(()))
                .collect(),
        };
        #[cfg(not(loom))]
        {
            let _ = capacity;
            ByteTracker {}
        }
    }

    /// Registers a write of `len` bytes starting at ring position `pos`.
    #[inline]
    pub fn write(&self, pos: u64, len: usize) {
        #[cfg(loom)]
        for i in 0..len as u64 {
            let idx = ((pos + i) % self.cells.len() as u64) as usize;
            self.cells[idx].with_mut(|_| ());
        }
        #[cfg(not(loom))]
        let _ = (pos, len);
    }

    /// Registers a read of `len` bytes starting at ring position `pos`.
    #[inline]
    pub fn read(&self, pos: u64, len: usize) {
        #[cfg(loom)]
        for i in 0..len as u64 {
            let idx = ((pos + i) % self.cells.len() as u64) as usize;
            self.cells[idx].with(|_| ());
        }
        #[cfg(not(loom))]
        let _ = (pos, len);
    }
}
