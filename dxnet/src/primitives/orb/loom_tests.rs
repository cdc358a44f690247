//! Loom models: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release`.
//! Under loom the ring is 16 bytes (chunk threshold 8), deadlines are
//! ignored and waits block without a timeout, so a lost wakeup is reported
//! as a deadlock; a byte read not ordered after its write is reported as a
//! data race (see `ByteTracker`). As in dxnet, `on_commit` wakes the
//! consumer (here a loom `Notify`) instead of the consumer spinning: two
//! threads spinning on each other's progress would livelock loom's
//! exhaustive (unfair) scheduler.

use super::*;
use crate::primitives::sync::{thread, Arc};
use loom::sync::Notify;
use std::io::Write;
use std::time::{Duration, Instant};

fn far() -> Deadline {
    Deadline::at(Instant::now() + Duration::from_secs(3600))
}

/// A ring plus the consumer's wake-up signal.
#[derive(Clone)]
struct Ring {
    orb: Arc<Orb>,
    ready: Arc<Notify>,
    /// The ring's consumer role, used by `drain` (one thread; a std mutex,
    /// outside the model).
    consumer: std::sync::Arc<std::sync::Mutex<Consumer>>,
}

impl Ring {
    fn new() -> Self {
        let orb = Arc::new(Orb::new(16));
        let consumer = orb.consumer().expect("a new ring's consumer");
        Ring {
            orb,
            ready: Arc::new(Notify::new()),
            consumer: std::sync::Arc::new(std::sync::Mutex::new(consumer)),
        }
    }

    /// A 16-byte ring holding `[1; 8]` and `[2; 8]`: full.
    fn full() -> Self {
        let ring = Ring::new();
        ring.put(&[1; 8]).unwrap();
        ring.put(&[2; 8]).unwrap();
        ring
    }

    fn put(&self, data: &[u8]) -> Result<(), OrbError> {
        self.orb
            .write_message(data.len(), &far(), &|| self.ready.notify(), |w| {
                w.write_all(data)
            })
            .map(drop)
    }

    /// Consumes until `want` bytes arrived, posting and completing as
    /// it goes (completing one step late when `lazy`, like RDMA).
    fn drain(&self, want: usize, lazy: bool) -> Vec<u8> {
        let orb = &self.orb;
        let mut guard = self.consumer.lock().unwrap();
        let c = &mut *guard;
        let mut out = Vec::new();
        let mut outstanding = 0;
        while out.len() < want {
            let (a, b) = orb.unposted(c, usize::MAX);
            let n = a.len() + b.len();
            if n == 0 {
                // Nothing to send: all completions arrive, then sleep
                // until a producer commits.
                orb.mark_completed(c, outstanding);
                outstanding = 0;
                self.ready.wait();
                continue;
            }
            out.extend_from_slice(a);
            out.extend_from_slice(b);
            orb.mark_posted(c, n);
            if lazy {
                orb.mark_completed(c, outstanding);
                outstanding = n;
            } else {
                orb.mark_completed(c, n);
            }
        }
        orb.mark_completed(c, outstanding);
        out
    }
}

/// Two producers, one small message each, written across the ring's
/// end while the consumer drains: both arrive whole, in some order.
#[test]
fn two_producers_one_consumer() {
    loom::model(|| {
        let ring = Ring::new();
        ring.put(&[0; 8]).unwrap();
        assert_eq!(ring.drain(8, false), [0; 8]);
        let producers: Vec<_> = [1u8, 2]
            .into_iter()
            .map(|id| {
                let ring = ring.clone();
                thread::spawn(move || ring.put(&[id, id + 10, id + 20, id + 30, id + 40]).unwrap())
            })
            .collect();
        let got = ring.drain(10, false);
        for p in producers {
            p.join().unwrap();
        }
        let a = [1, 11, 21, 31, 41];
        let b = [2, 12, 22, 32, 42];
        assert!(got == [a, b].concat() || got == [b, a].concat(), "{got:?}");
        assert!(ring.orb.is_empty());
    });
}

/// A full ring drained while two producers wait: the first to look at
/// `front` again refreshes the producers' copy of it, and the other may
/// reserve on that copy alone. Its writes into the space the consumer just
/// read must still be ordered after those reads (through the copy), or
/// loom reports the race on those bytes.
#[test]
fn reservation_on_the_refreshed_front_copy() {
    loom::model(|| {
        let ring = Ring::full();
        let consumer = {
            let ring = ring.clone();
            thread::spawn(move || ring.drain(24, false))
        };
        let producers: Vec<_> = [3u8, 4]
            .into_iter()
            .map(|id| {
                let ring = ring.clone();
                thread::spawn(move || ring.put(&[id; 4]).unwrap())
            })
            .collect();
        for p in producers {
            p.join().unwrap();
        }
        let got = consumer.join().unwrap();
        assert_eq!(got[..16], [[1; 8], [2; 8]].concat());
        let (c, d) = ([3; 4], [4; 4]);
        assert!(got[16..] == [c, d].concat() || got[16..] == [d, c].concat());
    });
}

/// A producer blocked on a full ring gets its space once the consumer
/// completes (lazily): no lost wakeup.
#[test]
fn blocked_producer_is_woken() {
    loom::model(|| {
        let ring = Ring::full();
        let producer = {
            let ring = ring.clone();
            thread::spawn(move || ring.put(&[3; 8]).unwrap())
        };
        let got = ring.drain(24, true);
        producer.join().unwrap();
        assert_eq!(got, [[1; 8], [2; 8], [3; 8]].concat());
        assert!(ring.orb.is_empty());
    });
}

/// A message larger than the ring goes in chunks: the writer commits a
/// chunk, waits for the consumer to free space, writes the next.
#[test]
fn chunked_message() {
    loom::model(|| {
        let ring = Ring::new();
        let big: Vec<u8> = (100..120).collect();
        let chunked = {
            let (ring, big) = (ring.clone(), big.clone());
            thread::spawn(move || ring.put(&big).unwrap())
        };
        let got = ring.drain(big.len(), true);
        chunked.join().unwrap();
        assert_eq!(got, big);
        assert!(ring.orb.is_empty());
    });
}

/// A chunked message next to a small one: the small writer either
/// commits before the chunked one or waits for its exclusive flag;
/// nothing interleaves. (Kept small: a 17-byte message, three chunks
/// in some orders, takes minutes to explore.)
#[test]
fn chunked_message_with_concurrent_producer() {
    loom::model(|| {
        let ring = Ring::new();
        // 15 bytes: one chunk if it goes first, two (14 + 1, waiting
        // for the consumer in between) if the small message goes first.
        let big: Vec<u8> = (100..115).collect();
        let chunked = {
            let (ring, big) = (ring.clone(), big.clone());
            thread::spawn(move || ring.put(&big).unwrap())
        };
        let small = {
            let ring = ring.clone();
            thread::spawn(move || ring.put(&[7; 2]).unwrap())
        };
        let got = ring.drain(big.len() + 2, false);
        chunked.join().unwrap();
        small.join().unwrap();
        assert!(
            got == [&big[..], &[7; 2]].concat() || got == [&[7; 2], &big[..]].concat(),
            "{got:?}"
        );
        assert!(ring.orb.is_empty());
    });
}

/// Closing wakes a producer blocked on a full ring.
#[test]
fn close_wakes_blocked_producer() {
    loom::model(|| {
        let ring = Ring::full();
        let producer = {
            let ring = ring.clone();
            thread::spawn(move || ring.put(&[3; 4]))
        };
        ring.orb.close();
        assert_eq!(producer.join().unwrap(), Err(OrbError::Closed));
    });
}
