//! Unit tests of the ring buffer (threads, sizes, wrap-around, chunking).

use super::*;
use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::AtomicUsize as StdAtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn far() -> Deadline {
    Deadline::at(Instant::now() + Duration::from_secs(60))
}

fn nop() {}

/// Writes `data` as one message.
fn put(orb: &Orb, data: &[u8]) -> Result<(), OrbError> {
    orb.write_message(data.len(), &far(), &nop, |w| w.write_all(data))
        .map(drop)
}

/// Consumes up to `max` bytes (post + complete at once).
fn take(orb: &Orb, c: &mut Consumer, max: usize) -> Vec<u8> {
    let (a, b) = orb.unposted(c, max);
    let out = [a, b].concat();
    orb.mark_posted(c, out.len());
    orb.mark_completed(c, out.len());
    out
}

fn check_invariants(orb: &Orb) {
    let p = orb.positions();
    assert!(p.front <= p.front_posted, "{p:?}");
    assert!(p.front_posted <= p.committed, "{p:?}");
    assert!(p.committed <= p.reserved, "{p:?}");
    assert!(p.reserved <= p.front + orb.capacity() as u64, "{p:?}");
}

#[test]
fn capacity_is_rounded_up() {
    assert_eq!(Orb::new(0).capacity(), MIN_CAPACITY);
    assert_eq!(Orb::new(5000).capacity(), 8192);
    assert_eq!(Orb::new(8192).capacity(), 8192);
    let orb = Orb::new(4096);
    assert_eq!(orb.offset_of(4096 + 17), 17);
    assert!(orb.is_empty());
    assert_eq!(orb.positions(), OrbPositions::default());
}

#[test]
fn the_consumer_role_is_handed_out_once_until_released() {
    let orb = Orb::new(4096);
    let mut c = orb.consumer().unwrap();
    assert!(orb.consumer().is_none());
    let msg: Vec<u8> = (0..64).collect();
    put(&orb, &msg).unwrap();
    assert_eq!(take(&orb, &mut c, 40), &msg[..40]);
    orb.release_consumer(c);
    // The next consumer goes on where the first stopped.
    let mut c = orb.consumer().expect("released");
    assert_eq!(take(&orb, &mut c, 100), &msg[40..]);
    assert!(orb.consumer().is_none());
}

#[test]
fn wrap_around_gives_two_slices_and_correct_bytes() {
    let orb = Orb::new(4096);
    let mut c = orb.consumer().unwrap();
    let cap = orb.capacity();
    let mut pos = 0u64;
    // 1000-byte messages: the 5th straddles the end (4000..5000).
    for i in 0..12u8 {
        let msg: Vec<u8> = (0..1000)
            .map(|j| i.wrapping_mul(31).wrapping_add(j as u8))
            .collect();
        put(&orb, &msg).unwrap();
        check_invariants(&orb);
        assert_eq!(orb.unposted_len(&mut c), 1000);
        // SAFETY: single consumer, slices used before completion.
        let (a, b) = orb.unposted(&mut c, usize::MAX);
        let off = orb.offset_of(pos);
        if off + 1000 > cap {
            assert_eq!(a.len(), cap - off);
            assert_eq!(b.len(), 1000 - (cap - off));
        } else {
            assert_eq!(a.len(), 1000);
            assert!(b.is_empty());
        }
        assert_eq!([a, b].concat(), msg);
        // Post in two steps, complete later.
        orb.mark_posted(&mut c, 400);
        assert_eq!(orb.unposted_len(&mut c), 600);
        // SAFETY: as above.
        let (a, b) = orb.unposted(&mut c, usize::MAX);
        assert_eq!([a, b].concat(), &msg[400..]);
        orb.mark_posted(&mut c, 600);
        check_invariants(&orb);
        assert!(!orb.is_empty());
        orb.mark_completed(&mut c, 1000);
        pos += 1000;
        assert_eq!(
            orb.positions(),
            OrbPositions {
                front: pos,
                front_posted: pos,
                committed: pos,
                reserved: pos
            }
        );
        assert!(orb.is_empty());
    }
}

/// A producer that blocks for space calls the blocked hook (after it
/// registered as waiter): the consumer, told so, completes posted
/// bytes and the producer goes on. Without the hook call nobody would
/// complete them here and the write would time out.
#[test]
fn blocked_producer_calls_the_hook_and_is_released_by_completion() {
    let orb = Arc::new(Orb::new(4096));
    let mut c = orb.consumer().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let tx = std::sync::Mutex::new(tx);
    orb.on_blocked(Box::new(move || {
        let _ = tx.lock().unwrap().send(());
    }));
    put(&orb, &[1; 4000]).unwrap();
    // SAFETY: single consumer; nothing is read after completion.
    let n = orb.unposted(&mut c, usize::MAX).0.len();
    orb.mark_posted(&mut c, n);
    assert!(rx.try_recv().is_err(), "no producer blocked yet");
    let o2 = orb.clone();
    let producer = std::thread::spawn(move || {
        o2.write_message(
            1000,
            &Deadline::at(Instant::now() + Duration::from_secs(30)),
            &nop,
            |w| w.write_all(&[2; 1000]),
        )
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("the blocked producer called the hook");
    assert!(orb.has_waiters());
    orb.mark_completed(&mut c, n);
    assert_eq!(
        producer.join().unwrap(),
        Ok(5000),
        "the position after the message"
    );
    assert!(!orb.has_waiters());
    assert_eq!(take(&orb, &mut c, usize::MAX), vec![2; 1000]);
}

#[test]
fn unposted_respects_max_and_pieces_are_written_across_the_wrap() {
    let orb = Orb::new(4096);
    let mut c = orb.consumer().unwrap();
    put(&orb, &[7; 4000]).unwrap();
    assert_eq!(take(&orb, &mut c, 4000).len(), 4000);
    // Written in odd pieces, wrapping at 4096.
    let msg: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
    orb.write_message(msg.len(), &far(), &nop, |w| {
        for piece in msg.chunks(7) {
            w.write_all(piece)?;
        }
        assert_eq!(w.remaining(), 0);
        Ok(())
    })
    .unwrap();
    // SAFETY: single consumer.
    let (a, b) = orb.unposted(&mut c, 50);
    assert_eq!((a.len(), b.len()), (50, 0));
    // SAFETY: single consumer.
    let (a, b) = orb.unposted(&mut c, 200);
    assert_eq!((a.len(), b.len()), (96, 104));
    assert_eq!([a, b].concat(), &msg[..200]);
    assert_eq!(take(&orb, &mut c, usize::MAX), msg);
}

#[test]
fn wrong_length_is_corrupted_and_closes() {
    let orb = Orb::new(4096);
    let mut c = orb.consumer().unwrap();
    let short = orb.write_message(10, &far(), &nop, |w| w.write_all(&[1; 9]));
    assert_eq!(short, Err(OrbError::Corrupted));
    assert!(orb.is_closed());
    // The span was published anyway (the consumer must be able to pass it).
    assert_eq!(orb.unposted_len(&mut c), 10);
    assert_eq!(orb.positions().committed, 10);
    assert_eq!(put(&orb, &[1; 8]), Err(OrbError::Closed));

    let orb = Orb::new(4096);
    let mut c = orb.consumer().unwrap();
    let long = orb.write_message(10, &far(), &nop, |w| {
        let err = w.write_all(&[1; 11]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WriteZero);
        Ok(())
    });
    assert_eq!(long, Err(OrbError::Corrupted));
    assert_eq!(orb.unposted_len(&mut c), 10);

    let orb = Orb::new(4096);
    let failed = orb.write_message(8, &far(), &nop, |w| {
        w.write_all(&[1; 8])?;
        Err(io::Error::other("serializer failed"))
    });
    assert_eq!(failed, Err(OrbError::Corrupted));

    // Chunked message written too short.
    let orb = Orb::new(4096);
    let mut c = orb.consumer().unwrap();
    let consumer_orb = &orb;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let stop = &stop;
    std::thread::scope(|s| {
        s.spawn(move || {
            while !stop.load(Ordering::Acquire) {
                take(consumer_orb, &mut c, usize::MAX);
                std::thread::yield_now();
            }
        });
        let r = orb.write_message(10_000, &far(), &nop, |w| w.write_all(&[3; 9_000]));
        assert_eq!(r, Err(OrbError::Corrupted));
        stop.store(true, Ordering::Release);
    });
    assert!(orb.is_closed());
}

#[test]
fn on_commit_runs_once_per_commit() {
    let orb = Orb::new(4096);
    let calls = StdAtomicUsize::new(0);
    let count = || {
        calls.fetch_add(1, Ordering::Relaxed);
    };
    assert_eq!(
        orb.write_message(12, &far(), &count, |w| w.write_all(b"hello, world")),
        Ok(12)
    );
    assert_eq!(calls.load(Ordering::Relaxed), 1);
    assert_eq!(
        orb.write_message(0, &far(), &count, |_| unreachable!()),
        Ok(0)
    );
    assert_eq!(calls.load(Ordering::Relaxed), 1);
}

#[test]
fn full_ring_times_out_without_writing() {
    let orb = Orb::new(4096);
    let mut c = orb.consumer().unwrap();
    for _ in 0..4 {
        put(&orb, &[9; 1024]).unwrap();
    }
    let before = orb.positions();
    assert_eq!(before.reserved, 4096);
    let deadline = Deadline::at(Instant::now() + Duration::from_millis(5));
    let r = orb.write_message(8, &deadline, &nop, |_| panic!("must not be called"));
    assert_eq!(r, Err(OrbError::Timeout));
    // A chunked message can't get its first chunk either: Timeout, and
    // its exclusive flag is released again.
    let deadline = Deadline::at(Instant::now() + Duration::from_millis(5));
    let r = orb.write_message(10_000, &deadline, &nop, |_| panic!("must not be called"));
    assert_eq!(r, Err(OrbError::Timeout));
    assert_eq!(orb.positions(), before);
    assert!(!orb.is_closed());
    // Freeing space makes writes work again.
    assert_eq!(take(&orb, &mut c, 1024), vec![9; 1024]);
    put(&orb, &[1; 1024]).unwrap();
    check_invariants(&orb);
}

#[test]
fn chunked_message_times_out_midway_as_corrupted() {
    let orb = Orb::new(4096);
    let mut c = orb.consumer().unwrap();
    let commits = StdAtomicUsize::new(0);
    let on_commit = || {
        commits.fetch_add(1, Ordering::Relaxed);
    };
    let deadline = Deadline::at(Instant::now() + Duration::from_millis(5));
    // Nobody consumes: the first chunk (whole ring) is committed, the
    // second never gets space.
    let r = orb.write_message(3 * 4096, &deadline, &on_commit, |w| {
        w.write_all(&[5; 3 * 4096])
    });
    assert_eq!(r, Err(OrbError::Corrupted));
    assert!(orb.is_closed());
    assert_eq!(commits.load(Ordering::Relaxed), 1);
    assert_eq!(orb.unposted_len(&mut c), 4096);
    let p = orb.positions();
    assert_eq!((p.committed, p.reserved), (4096, 4096));
    assert_eq!(take(&orb, &mut c, usize::MAX), vec![5; 4096]);
}

/// The published bytes of a message written in chunks end inside it until
/// its last chunk; whole messages before it end at their boundary.
#[test]
fn published_bytes_inside_a_chunked_message_are_reported() {
    let orb = Orb::new(4096);
    let mut c = orb.consumer().unwrap();
    put(&orb, &[1; 64]).unwrap();
    assert!(!orb.ends_inside_message(&mut c, 64), "a whole message");
    assert_eq!(take(&orb, &mut c, usize::MAX), vec![1; 64]);
    std::thread::scope(|s| {
        s.spawn(|| put(&orb, &[2; 3 * 4096]).unwrap());
        let mut got = Vec::new();
        while got.len() < 3 * 4096 {
            let n = orb.unposted_len(&mut c);
            if n == 0 {
                std::thread::yield_now();
                continue;
            }
            let inside = orb.ends_inside_message(&mut c, n);
            got.extend(take(&orb, &mut c, n));
            assert_eq!(inside, got.len() < 3 * 4096, "after {} bytes", got.len());
        }
        assert_eq!(got, vec![2; 3 * 4096]);
    });
    put(&orb, &[3; 64]).unwrap();
    assert!(!orb.ends_inside_message(&mut c, 64), "past the chunked one");
}

#[test]
fn close_wakes_blocked_producers() {
    let orb = Arc::new(Orb::new(4096));
    let mut c = orb.consumer().unwrap();
    put(&orb, &[0; 2048]).unwrap();
    put(&orb, &[0; 2048]).unwrap();
    let handles: Vec<_> = [100usize, 10_000]
        .into_iter()
        .map(|len| {
            let orb = Arc::clone(&orb);
            std::thread::spawn(move || {
                orb.write_message(len, &far(), &nop, |w| w.write_all(&vec![1; len]))
            })
        })
        .collect();
    // Give them a chance to block (correctness does not depend on it).
    std::thread::sleep(Duration::from_millis(20));
    orb.close();
    for h in handles {
        assert_eq!(h.join().unwrap(), Err(OrbError::Closed));
    }
    // Already committed bytes stay readable.
    assert_eq!(take(&orb, &mut c, usize::MAX).len(), 4096);
}

#[test]
fn blocked_producer_gets_space_when_consumer_completes() {
    let orb = Arc::new(Orb::new(4096));
    let mut c = orb.consumer().unwrap();
    put(&orb, &[1; 2000]).unwrap();
    put(&orb, &[2; 2000]).unwrap();
    let producer = {
        let orb = Arc::clone(&orb);
        std::thread::spawn(move || put(&orb, &[3; 2000]))
    };
    std::thread::sleep(Duration::from_millis(10));
    // Post everything, complete lazily.
    // SAFETY: single consumer, copied before completion.
    let (a, b) = orb.unposted(&mut c, usize::MAX);
    assert_eq!(a.len() + b.len(), 4000);
    orb.mark_posted(&mut c, 4000);
    orb.mark_completed(&mut c, 2000);
    producer.join().unwrap().unwrap();
    orb.mark_completed(&mut c, 2000);
    assert_eq!(take(&orb, &mut c, usize::MAX), vec![3; 2000]);
    assert!(orb.is_empty());
}

#[test]
fn panic_in_fill_closes_and_commits() {
    let orb = Orb::new(4096);
    let mut c = orb.consumer().unwrap();
    put(&orb, b"ok, fine").unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = orb.write_message(10, &far(), &nop, |w| {
            w.write_all(b"abc")?;
            panic!("serializer bug")
        });
    }));
    assert!(r.is_err());
    assert!(orb.is_closed());
    assert_eq!(orb.unposted_len(&mut c), 18);
    let p = orb.positions();
    assert_eq!((p.committed, p.reserved), (18, 18));
}

#[test]
#[should_panic(expected = "past the committed")]
fn mark_posted_past_committed_panics() {
    let orb = Orb::new(4096);
    let mut c = orb.consumer().unwrap();
    put(&orb, b"abcdefgh").unwrap();
    assert_eq!(orb.unposted_len(&mut c), 8);
    orb.mark_posted(&mut c, 9);
}

#[test]
#[should_panic(expected = "past the posted")]
fn mark_completed_past_posted_panics() {
    let orb = Orb::new(4096);
    let mut c = orb.consumer().unwrap();
    put(&orb, b"abcdefgh").unwrap();
    assert_eq!(orb.unposted_len(&mut c), 8);
    orb.mark_posted(&mut c, 2);
    orb.mark_completed(&mut c, 3);
}

/// Small deterministic PRNG (xorshift64*), no extra dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const HEADER: usize = 16;

fn payload_byte(producer: u32, seq: u64, i: usize) -> u8 {
    (producer as u64 * 131 + seq * 31 + i as u64 * 7 + (i as u64 >> 8)) as u8
}

fn payload(producer: u32, seq: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| payload_byte(producer, seq, i)).collect()
}

/// Parses complete messages off the front of `stream`, checking them.
fn parse(stream: &mut VecDeque<u8>, next_seq: &mut [u64]) {
    loop {
        if stream.len() < HEADER {
            return;
        }
        let head: Vec<u8> = stream.iter().take(HEADER).copied().collect();
        let producer = u32::from_le_bytes(head[0..4].try_into().unwrap());
        let seq = u64::from_le_bytes(head[4..12].try_into().unwrap());
        let len = u32::from_le_bytes(head[12..16].try_into().unwrap()) as usize;
        assert!(
            (producer as usize) < next_seq.len(),
            "bad producer id {producer}"
        );
        assert_eq!(
            seq, next_seq[producer as usize],
            "producer {producer}: lost, duplicated or reordered"
        );
        if stream.len() < HEADER + len {
            return;
        }
        stream.drain(..HEADER);
        for (i, b) in stream.drain(..len).enumerate() {
            assert_eq!(
                b,
                payload_byte(producer, seq, i),
                "producer {producer} seq {seq} byte {i}"
            );
        }
        next_seq[producer as usize] += 1;
    }
}

fn stress(producers: u32, messages: u64, seed: u64) {
    let orb = Arc::new(Orb::new(4096));
    let mut c = orb.consumer().unwrap();
    let cap = orb.capacity();
    let done = Arc::new(StdAtomicUsize::new(0));
    let commits = Arc::new(StdAtomicUsize::new(0));
    let consumer = {
        let orb = Arc::clone(&orb);
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let mut rng = Rng(seed ^ 0xc0ffee);
            let mut stream = VecDeque::new();
            let mut next_seq = vec![0u64; producers as usize];
            let mut in_flight: VecDeque<usize> = VecDeque::new();
            loop {
                let finished = done.load(Ordering::Acquire) == producers as usize;
                let max = 1 + rng.below(cap as u64 * 3 / 4) as usize;
                // SAFETY: the only consumer; the bytes are copied
                // before they are marked completed.
                let (a, b) = orb.unposted(&mut c, max);
                let n = a.len() + b.len();
                stream.extend(a);
                stream.extend(b);
                if n > 0 {
                    orb.mark_posted(&mut c, n);
                    in_flight.push_back(n);
                }
                // Complete lazily, like RDMA completions: sometimes
                // keep a few posts outstanding.
                let keep = if n == 0 { 0 } else { rng.below(4) as usize };
                while in_flight.len() > keep {
                    orb.mark_completed(&mut c, in_flight.pop_front().unwrap());
                }
                parse(&mut stream, &mut next_seq);
                if n == 0 {
                    if finished && in_flight.is_empty() && orb.unposted_len(&mut c) == 0 {
                        break;
                    }
                    std::thread::yield_now();
                }
            }
            assert!(orb.is_empty());
            assert!(stream.is_empty(), "{} trailing bytes", stream.len());
            next_seq
        })
    };
    let handles: Vec<_> = (0..producers)
        .map(|p| {
            let orb = Arc::clone(&orb);
            let done = Arc::clone(&done);
            let commits = Arc::clone(&commits);
            std::thread::spawn(move || {
                let mut rng = Rng(seed
                    .wrapping_add(p as u64 + 1)
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    | 1);
                let on_commit = || {
                    commits.fetch_add(1, Ordering::Relaxed);
                };
                for seq in 0..messages {
                    // Mostly small, some up to half the ring, a few
                    // chunked ones up to 3x the ring.
                    let total = match rng.below(100) {
                        0..=69 => 1 + rng.below(64),
                        70..=94 => 1 + rng.below(cap as u64 / 2),
                        _ => 1 + rng.below(3 * cap as u64),
                    } as usize;
                    let len = total.max(HEADER) - HEADER;
                    let body = payload(p, seq, len);
                    let piece = 1 + rng.below(700) as usize;
                    orb.write_message(HEADER + len, &far(), &on_commit, |w| {
                        w.write_all(&p.to_le_bytes())?;
                        w.write_all(&seq.to_le_bytes())?;
                        w.write_all(&(len as u32).to_le_bytes())?;
                        for part in body.chunks(piece) {
                            w.write_all(part)?;
                        }
                        Ok(())
                    })
                    .unwrap_or_else(|e| panic!("producer {p} seq {seq}: {e}"));
                }
                done.fetch_add(1, Ordering::Release);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let next_seq = consumer.join().unwrap();
    assert_eq!(next_seq, vec![messages; producers as usize]);
    assert!(commits.load(Ordering::Relaxed) >= (producers as u64 * messages) as usize);
}

#[test]
fn stress_1_producer() {
    stress(1, 20000, 1);
}

#[test]
fn stress_2_producers() {
    stress(2, 10000, 2);
}

/// Many more producers than cores (2 here): preempted producers hold
/// spans all the time.
#[test]
fn stress_32_producers() {
    stress(32, 600, 5);
}

/// A producer paused inside `fill` (as if preempted) does not hold up
/// the others: their writes return while ring space lasts; the consumer
/// gets nothing past the paused span until it is published, then every
/// message exactly once, in each producer's order.
#[test]
fn paused_producer_does_not_block_the_others() {
    let orb = Arc::new(Orb::new(4096));
    let mut c = orb.consumer().unwrap();
    let (paused_tx, paused_rx) = std::sync::mpsc::channel::<()>();
    let (resume_tx, resume_rx) = std::sync::mpsc::channel::<()>();
    let paused = {
        let orb = Arc::clone(&orb);
        std::thread::spawn(move || {
            orb.write_message(HEADER, &far(), &nop, |w| {
                w.write_all(&99u32.to_le_bytes())?;
                paused_tx.send(()).unwrap();
                resume_rx.recv().unwrap();
                w.write_all(&0u64.to_le_bytes())?;
                w.write_all(&0u32.to_le_bytes())
            })
        })
    };
    paused_rx.recv().unwrap();
    // 3 producers x 20 messages of 64 bytes: fits behind the paused span.
    let (done_tx, done_rx) = std::sync::mpsc::channel::<u32>();
    let others: Vec<_> = (0..3u32)
        .map(|p| {
            let (orb, done_tx) = (Arc::clone(&orb), done_tx.clone());
            std::thread::spawn(move || {
                for seq in 0..20u64 {
                    let body = payload(p, seq, 64 - HEADER);
                    orb.write_message(64, &far(), &nop, |w| {
                        w.write_all(&p.to_le_bytes())?;
                        w.write_all(&seq.to_le_bytes())?;
                        w.write_all(&(body.len() as u32).to_le_bytes())?;
                        w.write_all(&body)
                    })
                    .unwrap();
                }
                done_tx.send(p).unwrap();
            })
        })
        .collect();
    for _ in 0..3 {
        done_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("a producer is held up by the paused one");
    }
    assert_eq!(
        orb.unposted_len(&mut c),
        0,
        "nothing passes the paused span"
    );
    assert_eq!(orb.positions().reserved, (HEADER + 3 * 20 * 64) as u64);
    assert!(orb.has_unsent());
    resume_tx.send(()).unwrap();
    paused.join().unwrap().unwrap();
    for h in others {
        h.join().unwrap();
    }
    let mut stream: VecDeque<u8> = take(&orb, &mut c, usize::MAX).into();
    assert_eq!(stream.len(), HEADER + 3 * 20 * 64);
    let first: Vec<u8> = stream.drain(..HEADER).collect();
    assert_eq!(&first[..4], &99u32.to_le_bytes());
    let mut next_seq = vec![0u64; 3];
    parse(&mut stream, &mut next_seq);
    assert!(stream.is_empty());
    assert_eq!(next_seq, vec![20; 3]);
    assert!(orb.is_empty() && !orb.has_unsent());
}

/// Chunked messages never leave a tail shorter than a commit granule.
#[test]
fn chunk_tails_fill_a_granule() {
    let g = MIN_MESSAGE_LEN as u64;
    assert_eq!(chunk_len(1000, 5000), 1000);
    assert_eq!(chunk_len(5000, 5000), 5000);
    assert_eq!(chunk_len(4999, 5000), 5000 - g);
    assert_eq!(chunk_len(5000 - g, 5000), 5000 - g);
    assert_eq!(chunk_len(5000 - g + 1, 5000), 5000 - g);
}

#[test]
fn stress_4_producers() {
    stress(4, 5000, 3);
}

#[test]
fn stress_8_producers() {
    stress(8, 2500, 4);
}

/// The consumer role exists once per ring and serves only its own ring.
#[test]
fn one_consumer_per_ring() {
    let orb = Orb::new(4096);
    let mut c = orb.consumer().expect("first");
    assert!(orb.consumer().is_none(), "handed out twice");
    put(&orb, &[1; 16]).unwrap();
    assert_eq!(take(&orb, &mut c, usize::MAX), vec![1; 16]);
    let other = Orb::new(4096);
    let wrong =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| other.unposted_len(&mut c)));
    assert!(wrong.is_err(), "another ring's consumer is refused");
}
