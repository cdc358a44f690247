//! Notes pinned to positions of ring buffers: a producer attaches an item
//! to the message it is writing (at the message's end position) before it
//! commits the message, and the ring's consumer finds the item when it
//! reaches that position. The TCP engine keeps the payloads lent to it
//! (`Transport::lend`) so: the ring holds only their message headers.
//!
//! Visibility: the producer adds the note before its commit (a Release
//! store the consumer acquires before it sees the message), so a consumer
//! that sees a message also sees its note, and the count it reads (without
//! the lock) to skip the queues when there are none. The loom model below
//! runs this with the real ring buffer.

use std::collections::VecDeque;

use super::sync::{sleep_lock, AtomicUsize, Ordering, SleepMutex};

/// One ring's notes, by position.
#[derive(Debug)]
struct Queue<T> {
    queued: VecDeque<(u64, T)>,
    /// [`RingNotes::close`] ran: no more are taken.
    closed: bool,
}

/// The notes of a connection's rings (see the module docs).
#[derive(Debug)]
pub struct RingNotes<T> {
    queues: Box<[SleepMutex<Queue<T>>]>,
    /// Notes queued, or taken and not yet [`RingNotes::finished`].
    count: AtomicUsize,
}

impl<T> RingNotes<T> {
    /// Empty queues for `rings` rings.
    pub fn new(rings: usize) -> Self {
        Self {
            queues: (0..rings)
                .map(|_| {
                    SleepMutex::new(Queue {
                        queued: VecDeque::new(),
                        closed: false,
                    })
                })
                .collect(),
            count: AtomicUsize::new(0),
        }
    }

    /// Attaches `item` to position `at` of ring `ring`: called by the
    /// producer of the message ending there, before its commit. Gives the
    /// item back after [`RingNotes::close`] (or for a ring out of range).
    pub fn add(&self, ring: usize, at: u64, item: T) -> Result<(), T> {
        let Some(q) = self.queues.get(ring) else {
            return Err(item);
        };
        let mut q = sleep_lock(q);
        if q.closed {
            return Err(item);
        }
        // Messages are reserved in ring order but filled in any order.
        let k = q.queued.partition_point(|&(p, _)| p < at);
        q.queued.insert(k, (at, item));
        // Ordered before the consumer's look by the commit that follows.
        self.count.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The position of ring `ring`'s first note, if any. For the consumer,
    /// after it acquired the ring's commits: notes of the messages it sees
    /// are there.
    pub fn next_at(&self, ring: usize) -> Option<u64> {
        self.peek(ring, |at, _| at)
    }

    /// `f` of ring `ring`'s first note and its position, if any (the
    /// consumer, as [`RingNotes::next_at`]).
    pub fn peek<R>(&self, ring: usize, f: impl FnOnce(u64, &T) -> R) -> Option<R> {
        if self.count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        sleep_lock(&self.queues[ring])
            .queued
            .front()
            .map(|(p, item)| f(*p, item))
    }

    /// Takes ring `ring`'s first note if it is attached to position `at`.
    /// It counts (see [`RingNotes::pending`]) until
    /// [`RingNotes::finished`].
    pub fn take_at(&self, ring: usize, at: u64) -> Option<T> {
        if self.count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut q = sleep_lock(&self.queues[ring]);
        if q.queued.front().is_some_and(|&(p, _)| p == at) {
            q.queued.pop_front().map(|(_, item)| item)
        } else {
            None
        }
    }

    /// A taken note's work is over.
    pub fn finished(&self) {
        self.count.fetch_sub(1, Ordering::Release);
    }

    /// Whether notes are queued or taken and not finished.
    pub fn pending(&self) -> bool {
        self.count.load(Ordering::Acquire) > 0
    }

    /// Takes no more notes and hands back the queued ones.
    pub fn close(&self) -> Vec<T> {
        let mut out = Vec::new();
        for q in self.queues.iter() {
            let mut q = sleep_lock(q);
            q.closed = true;
            out.extend(q.queued.drain(..).map(|(_, item)| item));
        }
        self.count.fetch_sub(out.len(), Ordering::Release);
        out
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn notes_come_out_by_position_and_not_after_close() {
        let n = RingNotes::new(2);
        assert_eq!(n.next_at(0), None);
        n.add(0, 40, 'b').unwrap();
        n.add(0, 20, 'a').unwrap();
        n.add(1, 8, 'x').unwrap();
        assert!(n.pending());
        assert_eq!(n.next_at(0), Some(20));
        assert_eq!(n.take_at(0, 40), None, "not the first");
        assert_eq!(n.take_at(0, 20), Some('a'));
        assert_eq!(n.next_at(0), Some(40));
        assert_eq!(n.take_at(1, 8), Some('x'));
        n.finished();
        n.finished();
        assert!(n.pending(), "'b' is still queued");
        assert_eq!(n.close(), vec!['b']);
        assert!(!n.pending());
        assert_eq!(n.add(0, 60, 'c'), Err('c'));
        assert_eq!(n.add(5, 60, 'd'), Err('d'));
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::primitives::deadline::Deadline;
    use crate::primitives::orb::Orb;
    use crate::primitives::sync::{thread, Arc};
    use std::io::Write;
    use std::time::{Duration, Instant};

    /// Two producers write an 8-byte message each into a ring, attaching a
    /// note to its end inside the fill, before the commit (as `Core`
    /// lends a payload). The consumer, at every message end it sees
    /// committed, finds that message's note first in the queue.
    #[test]
    fn loom_a_committed_message_has_its_note() {
        loom::model(|| {
            let orb = Arc::new(Orb::new(16));
            let notes = Arc::new(RingNotes::new(1));
            let ready = Arc::new(loom::sync::Notify::new());
            let producers: Vec<_> = (0..2u8)
                .map(|k| {
                    let (orb, notes, ready) = (orb.clone(), notes.clone(), ready.clone());
                    thread::spawn(move || {
                        let far = Deadline::at(Instant::now() + Duration::from_secs(3600));
                        orb.write_message(8, &far, &|| ready.notify(), |w| {
                            notes.add(0, w.msg_end(), k).expect("open");
                            w.write_all(&[k; 8])
                        })
                        .unwrap();
                    })
                })
                .collect();
            let mut c = orb.consumer().unwrap();
            let mut seen = Vec::new();
            while seen.len() < 2 {
                let n = orb.unposted_len(&mut c);
                if n == 0 {
                    ready.wait();
                    continue;
                }
                let posted = orb.posted(&mut c);
                for end in (posted + 8..=posted + n as u64).step_by(8) {
                    assert_eq!(notes.next_at(0), Some(end), "a message without its note");
                    let k = notes.take_at(0, end).expect("the note at its end");
                    let (a, b) = orb.unposted(&mut c, 8);
                    assert_eq!([a, b].concat(), [k; 8], "the note of another message");
                    orb.mark_posted(&mut c, 8);
                    orb.mark_completed(&mut c, 8);
                    notes.finished();
                    seen.push(k);
                }
            }
            for p in producers {
                p.join().unwrap();
            }
            assert!(!notes.pending());
        });
    }
}
