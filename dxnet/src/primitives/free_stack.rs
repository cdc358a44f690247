//! A lock-free LIFO of items that each own a fixed index (a Treiber stack
//! of indices): the free receive buffers of a [`super::pool::BufferPool`].
//!
//! Last in, first out on purpose: the buffer handed back last is still in
//! the caches (the kernel's or the NIC's copy into it, the decoder's reads
//! of it), so a receiver that takes it writes into warm lines, and the
//! buffers a light load needs are the only ones ever touched.
//!
//! Neither side waits for the other: a push or pop retries its
//! compare-and-swap only when another one succeeded meanwhile. The top is
//! an index tagged with a count of pops, so a top that was popped and
//! pushed again between a pop's read and its swap (ABA) fails the swap.
//!
//! A taker that found the stack empty leaves a note ([`FreeStack::pop_or_note`]);
//! the next push reports it, so the taker, which stopped, is woken by
//! whoever returns an item. The loom models below check both.

use super::sync::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use crossbeam::utils::CachePadded;

#[cfg(loom)]
use loom::cell::UnsafeCell;

/// `std`'s cell with the access style of loom's, so the same code runs in
/// the models (where loom checks that slot accesses never overlap).
#[cfg(not(loom))]
#[derive(Debug)]
struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    fn new(v: T) -> Self {
        Self(std::cell::UnsafeCell::new(v))
    }

    fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

/// Low half of the top word: index + 1 of the top item (0: empty).
const INDEX_MASK: u64 = u32::MAX as u64;
/// High half: pops so far (wrapping), the ABA tag.
const TAG_ONE: u64 = 1 << 32;

/// Up to `capacity` items, item `i` stored in slot `i`.
#[derive(Debug)]
pub struct FreeStack<T> {
    /// Tag and index + 1 of the top item.
    top: CachePadded<AtomicU64>,
    /// Per slot: index + 1 of the item below it (0: the bottom).
    below: Box<[AtomicU32]>,
    /// Per slot: the item while it is on the stack.
    slots: Box<[UnsafeCell<Option<T>>]>,
    /// Items on the stack (approximate while pushes and pops run).
    len: AtomicUsize,
    /// A taker found the stack empty and stopped.
    starved: AtomicBool,
}

// SAFETY: a slot is accessed only by the thread that owns its item: the
// pusher before its swap publishes the index, the popper after its swap
// took the index off the stack; the swaps (SeqCst) order those accesses.
unsafe impl<T: Send> Sync for FreeStack<T> {}
// SAFETY: as above; the stack owns the items it holds.
unsafe impl<T: Send> Send for FreeStack<T> {}

impl<T> FreeStack<T> {
    /// An empty stack for items with indices `0..capacity`.
    pub fn new(capacity: usize) -> Self {
        assert!(capacity < u32::MAX as usize, "too many slots");
        Self {
            top: CachePadded::new(AtomicU64::new(0)),
            below: (0..capacity).map(|_| AtomicU32::new(0)).collect(),
            slots: (0..capacity).map(|_| UnsafeCell::new(None)).collect(),
            len: AtomicUsize::new(0),
            starved: AtomicBool::new(false),
        }
    }

    /// Puts `item`, whose index is `index`, on top. Returns true if a taker
    /// found the stack empty since the last push that returned true (it
    /// must be told that items are back).
    ///
    /// # Panics
    /// If `index` is out of range. Pushing an index that is on the stack
    /// already is a caller bug (each index belongs to one item, which is
    /// either on the stack or held by its caller).
    pub fn push(&self, index: usize, item: T) -> bool {
        assert!(index < self.slots.len(), "slot {index} out of range");
        // SAFETY: `index` is not on the stack (its item was held by the
        // caller), so no other thread accesses this slot until the swap
        // below publishes it.
        self.slots[index].with_mut(|s| unsafe { *s = Some(item) });
        // Counted before the item can be taken (the swap below), so the
        // taker's decrement never comes first.
        self.len.fetch_add(1, Ordering::Relaxed);
        let mut top = self.top.load(Ordering::SeqCst);
        loop {
            self.below[index].store((top & INDEX_MASK) as u32, Ordering::Relaxed);
            let new = (top & !INDEX_MASK) | (index as u64 + 1);
            match self
                .top
                .compare_exchange_weak(top, new, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => break,
                Err(now) => top = now,
            }
        }
        // Pairs with the fence in `pop_or_note`: either the taker's second
        // look finds this item, or this look finds its note.
        fence(Ordering::SeqCst);
        self.starved.load(Ordering::Relaxed) && self.starved.swap(false, Ordering::Relaxed)
    }

    /// The top item, or `None` if the stack is empty.
    pub fn pop(&self) -> Option<T> {
        let mut top = self.top.load(Ordering::SeqCst);
        loop {
            let index = (top & INDEX_MASK) as usize;
            if index == 0 {
                return None;
            }
            let slot = index - 1;
            // The pusher of `slot` wrote this before its swap, which this
            // thread's load of `top` saw (every write of `top` is a
            // read-modify-write, so any later value carries that order on).
            // If `slot` left the stack since, `top` changed (the pop counted
            // in the tag), so the swap below fails and a stale value here
            // is never used.
            let below = self.below[slot].load(Ordering::Relaxed);
            let new = (top & !INDEX_MASK).wrapping_add(TAG_ONE) | u64::from(below);
            match self
                .top
                .compare_exchange_weak(top, new, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => {
                    self.len.fetch_sub(1, Ordering::Relaxed);
                    // SAFETY: the swap took `slot` off the stack: this
                    // thread owns its item now, and nobody else touches the
                    // slot until it is pushed again.
                    let item = self.slots[slot].with_mut(|s| unsafe { (*s).take() });
                    return Some(item.expect("an index on the stack has its item"));
                }
                Err(now) => top = now,
            }
        }
    }

    /// The top item; if the stack is empty, leaves a note that the next
    /// [`FreeStack::push`] reports, and looks once more (an item pushed
    /// before the note was seen by its pusher is found here).
    pub fn pop_or_note(&self) -> Option<T> {
        if let Some(item) = self.pop() {
            return Some(item);
        }
        self.starved.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        self.pop()
    }

    /// Items on the stack now (exact when nothing runs concurrently).
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::{Arc, Mutex};

    #[test]
    fn last_in_first_out_and_starvation_notes() {
        let s = FreeStack::new(4);
        assert!(s.pop().is_none());
        assert!(!s.push(2, "two"));
        assert!(!s.push(0, "zero"));
        assert_eq!(s.len(), 2);
        assert_eq!(s.pop(), Some("zero"));
        assert_eq!(s.pop(), Some("two"));
        assert!(s.pop_or_note().is_none(), "empty");
        assert!(s.push(3, "three"), "the taker's note is reported");
        assert!(!s.push(1, "one"), "once");
        assert_eq!(s.pop_or_note(), Some("one"));
        assert_eq!(s.pop_or_note(), Some("three"));
    }

    #[test]
    fn items_left_are_dropped_with_the_stack() {
        let item = Arc::new(());
        let s = FreeStack::new(3);
        s.push(0, item.clone());
        s.push(2, item.clone());
        assert_eq!(Arc::strong_count(&item), 3);
        drop(s);
        assert_eq!(Arc::strong_count(&item), 1);
    }

    /// Many threads popping and pushing back: no item is ever held by two
    /// threads at once, none is lost.
    #[test]
    fn threads_never_share_an_item() {
        const N: usize = 8;
        let s = Arc::new(FreeStack::new(N));
        for i in 0..N {
            s.push(i, i);
        }
        let held = Arc::new(Mutex::new(HashSet::new()));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (s, held) = (s.clone(), held.clone());
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        if let Some(i) = s.pop() {
                            assert!(held.lock().unwrap().insert(i), "item {i} taken twice");
                            assert!(held.lock().unwrap().remove(&i));
                            s.push(i, i);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let mut all: Vec<_> = std::iter::from_fn(|| s.pop()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..N).collect::<Vec<_>>());
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::primitives::sync::{thread, Arc};

    /// One thread pops while another pops two items and pushes the first
    /// back (the ABA case: the top the first thread read is the top again,
    /// with another item below it): every item is held by exactly one
    /// thread or on the stack, never both; loom's cells also check that no
    /// slot is touched by two threads at once.
    #[test]
    fn loom_items_are_never_shared_or_lost() {
        loom::model(|| {
            let s = Arc::new(FreeStack::new(3));
            for i in (0..3).rev() {
                s.push(i, i);
            }
            let popper = {
                let s = s.clone();
                thread::spawn(move || s.pop())
            };
            let first = s.pop();
            let second = s.pop();
            if let Some(i) = first {
                s.push(i, i);
            }
            let other = popper.join().unwrap();
            let mut all: Vec<usize> = other.into_iter().chain(second).collect();
            for _ in 0..3 {
                match s.pop() {
                    Some(i) => all.push(i),
                    None => break,
                }
            }
            all.sort_unstable();
            assert_eq!(all, vec![0, 1, 2], "an item lost or held twice");
        });
    }

    /// A taker that finds the stack empty while another thread returns an
    /// item: it gets the item, or the returner learns of the note.
    #[test]
    fn loom_an_empty_pop_is_never_missed() {
        loom::model(|| {
            let s = Arc::new(FreeStack::new(1));
            let returner = {
                let s = s.clone();
                thread::spawn(move || s.push(0, 7u8))
            };
            let got = s.pop_or_note().is_some();
            let told = returner.join().unwrap();
            assert!(got || told, "the taker stopped and nobody was told");
        });
    }
}
