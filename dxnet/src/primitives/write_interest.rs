//! Write interest: which connections have data for the send thread.
//!
//! A producer that committed data into a connection's ring pushes the
//! connection's peer id; the single send thread pops ids round-robin (FIFO)
//! and drains those rings. Each id sits in the queue at most once, guarded
//! by one flag per possible id, so a busy connection cannot flood the queue
//! and every connection gets its turn. The queue is bounded by the number
//! of ids and allocated once: pushing never allocates (the send path is
//! allocation-free).
//!
//! No lost interest: `pop` clears the id's flag *before* returning it, and
//! the consumer reads the connection's state only after that. A producer
//! that publishes data and then finds the flag still set (push returns
//! `false`) knows the consumer has not yet cleared it, so the consumer's
//! later read sees the data; one that finds it cleared queues the id again.

use super::sync::{fence, AtomicBool, Ordering, Queue};

/// Size of the flag table: one per possible `u16` id. (Small under loom:
/// every loom atomic is tracked by the model; ids must stay below it.)
#[cfg(not(loom))]
const FLAGS: usize = 1 << 16;
#[cfg(loom)]
const FLAGS: usize = 16;

/// The send thread's round-robin queue of connections with ready data.
///
/// Any thread may `push`; `pop` is meant for the one send thread (it is
/// safe from several, each id is still handed out once per push).
pub struct WriteInterest {
    /// `queued[id]`: `id` is in `queue` or about to be pushed into it.
    queued: Box<[AtomicBool]>,
    /// Holds each id at most once, so `FLAGS` slots always suffice.
    queue: Queue<u16>,
}

impl WriteInterest {
    /// An empty queue; allocates the flag table (64 KiB) and the id queue
    /// (about 1 MiB) once.
    pub fn new() -> Self {
        WriteInterest {
            queued: (0..FLAGS).map(|_| AtomicBool::new(false)).collect(),
            queue: Queue::new(FLAGS),
        }
    }

    /// Registers interest for `id`, after the caller published its data.
    /// Returns `true` if `id` was newly queued (the caller then wakes the
    /// send thread), `false` if it was already queued.
    ///
    /// Most calls find the id queued already (many senders, one send
    /// thread), so the flag is read before it is written: a plain load
    /// leaves its cache line shared among the senders' cores instead of
    /// moving it to each of them in turn. The SeqCst fences here and in
    /// [`WriteInterest::pop`] make the load safe: either this load sees the
    /// consumer's clear (and queues the id again), or the consumer's reads
    /// after its clear see the data published before this call.
    pub fn push(&self, id: u16) -> bool {
        let flag = &self.queued[id as usize];
        fence(Ordering::SeqCst);
        if flag.load(Ordering::Relaxed) {
            return false;
        }
        // AcqRel: the Release half orders the caller's published data before
        // the flag, for the consumer's clearing swap that reads it.
        if flag.swap(true, Ordering::AcqRel) {
            return false;
        }
        // Cannot fail: an id is queued at most once (its flag), and the
        // queue has a slot for every id.
        let pushed = self.queue.push(id);
        assert!(pushed.is_ok(), "write-interest queue overflow");
        true
    }

    /// Takes the next connection with write interest. Its flag is cleared
    /// before it is returned: from here on a new `push` queues it again, and
    /// everything published before a `push` that saw the flag set is visible
    /// to the caller.
    pub fn pop(&self) -> Option<u16> {
        let id = self.queue.pop()?;
        // AcqRel: reading the flag (with Acquire) synchronizes with the last
        // `push` that set it, so that push's data is visible. The fence
        // pairs with the one in `push`: a producer whose load found the flag
        // still set published its data before a fence that precedes this
        // one, so the caller's reads see it.
        self.queued[id as usize].swap(false, Ordering::AcqRel);
        fence(Ordering::SeqCst);
        Some(id)
    }

    /// Whether no id is queued (a snapshot).
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

impl Default for WriteInterest {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for WriteInterest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteInterest")
            .field("empty", &self.is_empty())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, AtomicUsize};
    use std::sync::Arc;

    #[test]
    fn each_id_queued_once_fifo() {
        let wi = WriteInterest::new();
        assert!(wi.is_empty());
        assert!(wi.push(7));
        assert!(!wi.push(7));
        assert!(wi.push(65535));
        assert!(wi.push(0));
        assert!(!wi.push(65535));
        assert_eq!(wi.pop(), Some(7));
        // Popped: queued again behind the others.
        assert!(wi.push(7));
        assert_eq!(wi.pop(), Some(65535));
        assert_eq!(wi.pop(), Some(0));
        assert_eq!(wi.pop(), Some(7));
        assert_eq!(wi.pop(), None);
        assert!(wi.is_empty());
    }

    #[test]
    fn every_id_fits_at_once() {
        let wi = WriteInterest::new();
        assert!((0..=u16::MAX).all(|id| wi.push(id)));
        assert!((0..=u16::MAX).all(|id| wi.pop() == Some(id)));
        assert_eq!(wi.pop(), None);
    }

    #[test]
    fn concurrent_pushes_queue_an_id_once() {
        let wi = Arc::new(WriteInterest::new());
        for round in 0..20u16 {
            let barrier = Arc::new(std::sync::Barrier::new(4));
            let newly: Vec<_> = (0..4)
                .map(|_| {
                    let wi = Arc::clone(&wi);
                    let barrier = Arc::clone(&barrier);
                    std::thread::spawn(move || {
                        barrier.wait();
                        (0..64u16).filter(|i| wi.push(round * 64 + i)).count()
                    })
                })
                .collect();
            let newly: usize = newly.into_iter().map(|h| h.join().unwrap()).sum();
            assert_eq!(newly, 64);
            let mut popped: Vec<u16> = std::iter::from_fn(|| wi.pop()).collect();
            popped.sort_unstable();
            assert_eq!(popped, (round * 64..round * 64 + 64).collect::<Vec<_>>());
        }
    }

    /// Producers publish work items for their ids and push; the consumer
    /// pops and takes everything published. At the end nothing is left
    /// unprocessed and no id was ever handed out twice for one push.
    #[test]
    fn no_lost_interest() {
        const PRODUCERS: usize = 4;
        const IDS_PER_PRODUCER: usize = 8;
        const ITEMS: u64 = 5_000;
        let ids = PRODUCERS * IDS_PER_PRODUCER;
        let wi = Arc::new(WriteInterest::new());
        let published: Arc<Vec<AtomicU64>> =
            Arc::new((0..ids).map(|_| AtomicU64::new(0)).collect());
        let newly_queued = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicUsize::new(0));
        let consumer = {
            let (wi, published, done) =
                (Arc::clone(&wi), Arc::clone(&published), Arc::clone(&done));
            std::thread::spawn(move || {
                let mut processed = vec![0u64; ids];
                let mut pops = 0usize;
                loop {
                    let finished = done.load(Ordering::Acquire) == PRODUCERS;
                    match wi.pop() {
                        Some(id) => {
                            pops += 1;
                            // "Drain" the connection: take all work so far.
                            let now = published[id as usize].load(Ordering::Acquire);
                            assert!(now >= processed[id as usize]);
                            processed[id as usize] = now;
                        }
                        None if finished => break,
                        None => std::thread::yield_now(),
                    }
                }
                (processed, pops)
            })
        };
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let (wi, published, done, newly_queued) = (
                    Arc::clone(&wi),
                    Arc::clone(&published),
                    Arc::clone(&done),
                    Arc::clone(&newly_queued),
                );
                std::thread::spawn(move || {
                    for item in 1..=ITEMS {
                        let id = p * IDS_PER_PRODUCER + item as usize % IDS_PER_PRODUCER;
                        published[id].fetch_add(1, Ordering::Release);
                        if wi.push(id as u16) {
                            newly_queued.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    done.fetch_add(1, Ordering::Release);
                })
            })
            .collect();
        for p in producers {
            p.join().unwrap();
        }
        let (processed, pops) = consumer.join().unwrap();
        let expected = ITEMS / IDS_PER_PRODUCER as u64;
        assert_eq!(processed, vec![expected; ids], "work left unprocessed");
        // Every queue entry came from exactly one successful push.
        assert_eq!(pops, newly_queued.load(Ordering::Relaxed));
        assert!(wi.is_empty());
        for id in 0..ids as u16 {
            assert!(wi.push(id), "flag of {id} left set");
        }
    }
}

/// Loom model of the flag protocol: `RUSTFLAGS="--cfg loom" cargo test --release`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::primitives::sync::{thread, Arc, AtomicUsize};

    /// A producer publishes work twice (pushing after each) while the
    /// consumer pops and processes concurrently. Afterwards either all work
    /// was processed or the id is still queued: interest is never lost.
    /// The loom queue also asserts an id is never queued twice at once.
    #[test]
    fn push_pop_race_loses_no_work() {
        loom::model(|| {
            let wi = Arc::new(WriteInterest::new());
            let work = Arc::new(AtomicUsize::new(0));
            let producer = {
                let (wi, work) = (Arc::clone(&wi), Arc::clone(&work));
                thread::spawn(move || {
                    for item in 1..=2 {
                        work.store(item, Ordering::Release);
                        wi.push(3);
                    }
                })
            };
            let mut processed = 0;
            for _ in 0..2 {
                if let Some(id) = wi.pop() {
                    assert_eq!(id, 3);
                    processed = work.load(Ordering::Acquire);
                }
            }
            producer.join().unwrap();
            assert!(processed == 2 || !wi.is_empty(), "interest lost");
            while wi.pop().is_some() {
                processed = work.load(Ordering::Acquire);
            }
            assert_eq!(processed, 2);
        });
    }

    /// Two producers push the same id while the consumer pops.
    #[test]
    fn concurrent_pushes_of_one_id() {
        loom::model(|| {
            let wi = Arc::new(WriteInterest::new());
            let work = Arc::new(AtomicUsize::new(0));
            let producers: Vec<_> = (0..2)
                .map(|_| {
                    let (wi, work) = (Arc::clone(&wi), Arc::clone(&work));
                    thread::spawn(move || {
                        work.fetch_add(1, Ordering::Release);
                        wi.push(5);
                    })
                })
                .collect();
            let mut processed = 0;
            if wi.pop().is_some() {
                processed = work.load(Ordering::Acquire);
            }
            for p in producers {
                p.join().unwrap();
            }
            assert!(processed == 2 || !wi.is_empty(), "interest lost");
            while wi.pop().is_some() {
                processed = work.load(Ordering::Acquire);
            }
            assert_eq!(processed, 2);
        });
    }
}
