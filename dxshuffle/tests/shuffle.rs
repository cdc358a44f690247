//! Shuffles among several in-process nodes over loopback and TCP, in both
//! modes: random record sizes (0 B to the largest a segment takes) and
//! destinations from more threads than cores, every record checked
//! exactly once, intact and in per-pusher order; tiny segments force the
//! full-remote, full-local and wrap paths; a dead peer ends the others'
//! pushers and pullers with typed errors, and hostile batches with a
//! typed `Corrupt`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{nodes, nodes_with, run, Case, Kind};
use dxnet::{Node, NodeId};
use dxshuffle::{Mode, Shuffle, ShuffleConfig, ShuffleError};

#[test]
fn one_sided_loopback_random_sizes() {
    run(Case {
        kind: Kind::Loopback,
        mode: Mode::OneSided,
        procs: 2,
        threads: 4,
        segment: 4096,
        batch: 1024,
        per_worker: 400,
    });
}

#[test]
fn one_sided_tiny_segments_force_back_pressure_and_wraps() {
    run(Case {
        kind: Kind::Loopback,
        mode: Mode::OneSided,
        procs: 3,
        threads: 3,
        segment: 128,
        batch: 40,
        per_worker: 300,
    });
}

#[test]
fn one_sided_tcp_sixteen_workers() {
    run(Case {
        kind: Kind::Tcp,
        mode: Mode::OneSided,
        procs: 2,
        threads: 8,
        segment: 8192,
        batch: 2048,
        per_worker: 300,
    });
}

#[test]
fn messages_loopback_and_tcp() {
    for kind in [Kind::Loopback, Kind::Tcp] {
        run(Case {
            kind,
            mode: Mode::Messages,
            procs: 3,
            threads: 3,
            segment: 1024,
            batch: 300,
            per_worker: 300,
        });
    }
}

/// Messages mode keeps the batches a process has not read within the
/// sending process's flow-control window: a pusher to a process that does
/// not pull yet cannot run ahead by more (nor does it block a handler
/// thread there), and once that process pulls, every record arrives once
/// and in order.
#[test]
fn messages_mode_holds_unread_batches_within_the_window() {
    const WINDOW: usize = 64 << 10;
    const RECORD: usize = 100;
    const RECORDS: u64 = (10 * WINDOW / RECORD) as u64;
    let nodes = nodes_with(Kind::Tcp, 2, |c| {
        c.limits.flow_control_window = WINDOW;
        c.limits.send_timeout_ms = 60_000;
    });
    let (a, b) = messages_pair(&nodes, 1024);
    let (pushing, done) = push_in_background(a.clone(), RECORDS, RECORD);
    // Ten windows of records and nobody pulls at process 1: the pusher
    // cannot be done, however long it has.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !done.load(std::sync::atomic::Ordering::SeqCst),
        "ten windows pushed while nobody pulled"
    );
    let a_pulls = {
        let a = a.clone();
        std::thread::spawn(move || a.puller(0).unwrap().count())
    };
    b.pusher(0).unwrap().finish().unwrap();
    assert_eq!(pull_numbered_in_order(&b, RECORD), RECORDS);
    pushing.join().unwrap();
    assert_eq!(a_pulls.join().unwrap(), 0);
}

#[test]
fn refusals_are_typed() {
    let nodes = nodes(Kind::Loopback, 1);
    let mut cfg = ShuffleConfig::new(vec![NodeId(0)], 2);
    cfg.segment_bytes = 100; // not a multiple of 8
    assert!(matches!(
        Shuffle::new(nodes[0].clone(), cfg.clone()),
        Err(ShuffleError::Config(_))
    ));
    cfg.nodes = vec![NodeId(5)];
    // Room for the largest record and the end of the stream behind it:
    // `finish` waits until the destination has read what does not fit.
    cfg.segment_bytes = 256;
    assert!(matches!(
        Shuffle::new(nodes[0].clone(), cfg.clone()),
        Err(ShuffleError::Config(_))
    ));
    cfg.nodes = vec![NodeId(0)];
    let shuffle = Shuffle::new(nodes[0].clone(), cfg).unwrap();
    assert_eq!(shuffle.max_record(), 252);
    let mut p = shuffle.pusher(0).unwrap();
    assert!(matches!(shuffle.pusher(0), Err(ShuffleError::State(_))));
    assert!(matches!(
        p.push_bytes(1, &[0; 253]),
        Err(ShuffleError::RecordTooLarge { len: 253, max: 252 })
    ));
    assert!(matches!(
        p.push_bytes(2, b"x"),
        Err(ShuffleError::Config(_))
    ));
    p.push_bytes(1, &[7; 240]).unwrap();
    p.finish().unwrap();
    assert!(matches!(p.push_bytes(1, b"x"), Err(ShuffleError::State(_))));
    drop(shuffle.pusher(1).unwrap()); // dropping finishes
    let mut q = shuffle.puller(1).unwrap();
    let r = q.next().unwrap().unwrap();
    assert_eq!((r.from, r.bytes()), (0, &[7u8; 240][..]));
    assert!(q.next().is_none(), "both workers finished");
}

/// A process dies mid-shuffle: the survivor's pullers end with a timeout
/// (its records never finish) and its pushers to the dead process with an
/// error, within the timeout, never a hang.
#[test]
fn dead_peer_ends_with_typed_errors() {
    for mode in [Mode::OneSided, Mode::Messages] {
        let nodes = nodes(Kind::Tcp, 2);
        let ids: Vec<NodeId> = nodes.iter().map(|n| n.id()).collect();
        let make = |node: Arc<Node>| {
            let ids = ids.clone();
            std::thread::spawn(move || {
                let mut cfg = ShuffleConfig::new(ids, 2);
                cfg.mode = mode;
                cfg.segment_bytes = 1024;
                cfg.batch_bytes = 256;
                cfg.timeout = Duration::from_secs(3);
                Shuffle::new(node, cfg).unwrap()
            })
        };
        let a = make(nodes[0].clone());
        let b = make(nodes[1].clone());
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        let mut victim = nodes.into_iter();
        let (survivor, dead) = (victim.next().unwrap(), victim.next().unwrap());
        drop(b);
        let started = Instant::now();
        match Arc::try_unwrap(dead) {
            Ok(node) => node.shutdown(),
            Err(_) => panic!("the dead node is still referenced"),
        }
        let mut puller = a.puller(0).unwrap();
        let mut pusher = a.pusher(0).unwrap();
        let mut failed = false;
        for i in 0..10_000u32 {
            if let Err(e) = pusher
                .push_bytes(3, &i.to_le_bytes())
                .and_then(|()| pusher.flush())
            {
                assert!(
                    matches!(e, ShuffleError::Net(_) | ShuffleError::Timeout(_)),
                    "{mode:?}: {e:?}"
                );
                failed = true;
                break;
            }
        }
        assert!(failed, "{mode:?}: pushes to a dead process kept succeeding");
        let end = loop {
            match puller.next() {
                Some(Ok(_)) => continue,
                other => break other,
            }
        };
        assert!(
            matches!(end, Some(Err(ShuffleError::Timeout(_)))),
            "{mode:?}: {end:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(30), "{mode:?}");
        drop(pusher);
        drop(survivor);
    }
}

/// The puller as a `Stream`, polled by a minimal executor (a thread that
/// parks until a waker unparks it): every record arrives, the stream
/// ends, and no wake-up is lost (a lost one would leave the executor
/// parked: that fails instead of passing slowly).
#[test]
fn puller_as_a_stream() {
    use futures_core::Stream;
    use std::pin::Pin;
    use std::task::{Context, Poll, Wake, Waker};

    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    for mode in [Mode::OneSided, Mode::Messages] {
        let nodes = nodes(Kind::Tcp, 2);
        let ids: Vec<NodeId> = nodes.iter().map(|n| n.id()).collect();
        let total: usize = std::thread::scope(|s| {
            let hs: Vec<_> = nodes
                .iter()
                .map(|node| {
                    let (node, ids) = (node.clone(), ids.clone());
                    s.spawn(move || {
                        let mut cfg = ShuffleConfig::new(ids, 2);
                        cfg.mode = mode;
                        cfg.segment_bytes = 1024;
                        cfg.batch_bytes = 256;
                        let shuffle = Shuffle::new(node, cfg).unwrap();
                        std::thread::scope(|s| {
                            for t in 0..2 {
                                let mut p = shuffle.pusher(t).unwrap();
                                s.spawn(move || {
                                    for i in 0..400u32 {
                                        p.push(i as usize % 4, &i).unwrap();
                                    }
                                });
                            }
                            let hs: Vec<_> = (0..2)
                                .map(|t| {
                                    let mut q = shuffle.puller(t).unwrap();
                                    s.spawn(move || {
                                        let waker =
                                            Waker::from(Arc::new(Unpark(std::thread::current())));
                                        let mut cx = Context::from_waker(&waker);
                                        let mut n = 0;
                                        loop {
                                            match Pin::new(&mut q).poll_next(&mut cx) {
                                                Poll::Ready(Some(r)) => {
                                                    let v: u32 = r.unwrap().decode().unwrap();
                                                    assert!(v < 400);
                                                    n += 1;
                                                }
                                                Poll::Ready(None) => break n,
                                                Poll::Pending => {
                                                    let t0 = Instant::now();
                                                    std::thread::park_timeout(Duration::from_secs(
                                                        20,
                                                    ));
                                                    assert!(
                                                        t0.elapsed() < Duration::from_secs(20),
                                                        "{mode:?}: a wake-up was lost"
                                                    );
                                                }
                                            }
                                        }
                                    })
                                })
                                .collect();
                            hs.into_iter().map(|h| h.join().unwrap()).sum::<usize>()
                        })
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(total, 4 * 400, "{mode:?}");
    }
}

/// Messages mode: batches to a puller of the own process bypass dxnet and
/// are bounded by that puller's credits. A pusher cannot run ahead of a
/// local puller that does not read (with a short timeout it fails with a
/// typed error), and once it reads, every record arrives once and in order.
#[test]
fn messages_mode_bounds_batches_to_own_pullers() {
    const RECORD: usize = 100;
    const RECORDS: u64 = 6400; // ten times the local credits' worth
    let first = nodes(Kind::Loopback, 1);
    let mut cfg = ShuffleConfig::new(vec![NodeId(0)], 2);
    cfg.mode = Mode::Messages;
    cfg.batch_bytes = 1024;
    cfg.timeout = Duration::from_millis(300);
    let record = |i: u64| numbered(i, RECORD);
    {
        let s = Shuffle::new(first[0].clone(), cfg.clone()).unwrap();
        let mut p = s.pusher(0).unwrap();
        let failed = (0..RECORDS).find_map(|i| p.push_bytes(1, &record(i)).err());
        assert!(
            matches!(failed, Some(ShuffleError::Timeout(_))),
            "pushing to an unread local puller: {failed:?}"
        );
    }
    // A shuffle takes its node's message types: a fresh node.
    let again = nodes(Kind::Loopback, 1);
    cfg.timeout = Duration::from_secs(60);
    let s = Shuffle::new(again[0].clone(), cfg).unwrap();
    let (pushing, done) = push_in_background(s.clone(), RECORDS, RECORD);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !done.load(std::sync::atomic::Ordering::SeqCst),
        "ten times the credits pushed while nobody pulled"
    );
    // Pullers run alongside the pushers (a full local puller holds back
    // every pusher of its process, as a full window does remote ones).
    let pulls = |t: usize| {
        let s = s.clone();
        std::thread::spawn(move || {
            s.puller(t)
                .unwrap()
                .map(|r| {
                    let r = r.unwrap();
                    (r.from, r.bytes().to_vec())
                })
                .collect::<Vec<_>>()
        })
    };
    let (zero, one) = (pulls(0), pulls(1));
    s.pusher(1).unwrap().finish().unwrap();
    pushing.join().unwrap();
    let got = one.join().unwrap();
    assert_eq!(got.len() as u64, RECORDS);
    for (i, (from, bytes)) in got.iter().enumerate() {
        assert_eq!(*from, 0);
        assert_eq!(bytes, &record(i as u64), "record {i} once and in order");
    }
    assert!(zero.join().unwrap().is_empty());
}

/// A pusher moved from thread to thread (each new thread writes into
/// another of the connection's rings, `tcp.rings`, where its batches may
/// overtake those of the thread before) still delivers its records once
/// and in order, and its end after them.
#[test]
fn messages_mode_keeps_a_moved_pushers_order() {
    const RECORD: usize = 100;
    const HOPS: u64 = 24;
    const PER_HOP: u64 = 150;
    let nodes = nodes_with(Kind::Tcp, 2, |c| c.tcp.rings = 4);
    let (a, b) = messages_pair(&nodes, 512);
    let a_pulls = {
        let a = a.clone();
        std::thread::spawn(move || a.puller(0).unwrap().count())
    };
    b.pusher(0).unwrap().finish().unwrap();
    let pushing = std::thread::spawn(move || {
        let mut p = a.pusher(0).unwrap();
        for hop in 0..HOPS {
            p = std::thread::spawn(move || {
                for i in hop * PER_HOP..(hop + 1) * PER_HOP {
                    p.push_bytes(1, &numbered(i, RECORD)).unwrap();
                }
                p
            })
            .join()
            .unwrap();
        }
        std::thread::spawn(move || p.finish().unwrap())
            .join()
            .unwrap();
    });
    assert_eq!(pull_numbered_in_order(&b, RECORD), HOPS * PER_HOP);
    pushing.join().unwrap();
    assert_eq!(a_pulls.join().unwrap(), 0);
}

/// A messages-mode shuffle of one worker on each of `nodes[0]` and
/// `nodes[1]` (4 KiB segments, batches of `batch_bytes`, 60 s timeout),
/// set up on both at once.
fn messages_pair(nodes: &[Arc<Node>], batch_bytes: usize) -> (Shuffle, Shuffle) {
    let mut cfg = ShuffleConfig::new(vec![NodeId(0), NodeId(1)], 1);
    cfg.mode = Mode::Messages;
    cfg.segment_bytes = 4096;
    cfg.batch_bytes = batch_bytes;
    cfg.timeout = Duration::from_secs(60);
    let make = |n: Arc<Node>| {
        let cfg = cfg.clone();
        std::thread::spawn(move || Shuffle::new(n, cfg).unwrap())
    };
    let (a, b) = (make(nodes[0].clone()), make(nodes[1].clone()));
    (a.join().unwrap(), b.join().unwrap())
}

/// Pulls worker 1's records of `s` (all from worker 0) until every worker
/// finished, checks each is the next [`numbered`] record of `len` bytes,
/// and returns how many came.
fn pull_numbered_in_order(s: &Shuffle, len: usize) -> u64 {
    let mut next = 0u64;
    for r in s.puller(0).unwrap() {
        let r = r.unwrap();
        assert_eq!(r.from, 0);
        assert_eq!(
            r.bytes(),
            &numbered(next, len)[..],
            "record {next} once and in order"
        );
        next += 1;
    }
    next
}

/// Record `i` of the back-pressure tests: `len` bytes (at least 8) that
/// carry `i`.
fn numbered(i: u64, len: usize) -> Vec<u8> {
    let mut r = vec![(i % 251) as u8; len];
    r[..8].copy_from_slice(&i.to_le_bytes());
    r
}

/// Thread 0 of `s` pushes records `0..n` ([`numbered`]) to worker 1 on a
/// thread of its own, then finishes; the flag turns true once it did.
fn push_in_background(
    s: Shuffle,
    n: u64,
    len: usize,
) -> (
    std::thread::JoinHandle<()>,
    Arc<std::sync::atomic::AtomicBool>,
) {
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = done.clone();
    let pushing = std::thread::spawn(move || {
        let mut p = s.pusher(0).unwrap();
        for i in 0..n {
            p.push_bytes(1, &numbered(i, len)).unwrap();
        }
        p.finish().unwrap();
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    (pushing, done)
}

/// Hostile batches (raw messages in the messages mode's wire format, sent
/// straight from a peer's node) end the puller with a typed `Corrupt`
/// error, never a panic or a hang; batches addressed to no worker of the
/// receiving process, or from no worker at all, are dropped and the
/// shuffle goes on.
#[test]
fn hostile_batches_are_typed_errors() {
    // The wire format: message type 201, subtype 4; a head of [to u32]
    // [from u32][batch number u64], then frames of [len u32][bytes].
    const TYPE: u8 = 201;
    const SUB: u8 = 4;
    let batch = |to: u32, from: u32, n: u64, body: &[u8]| {
        let mut b = Vec::new();
        b.extend_from_slice(&to.to_le_bytes());
        b.extend_from_slice(&from.to_le_bytes());
        b.extend_from_slice(&n.to_le_bytes());
        b.extend_from_slice(body);
        b
    };
    let frame = |bytes: &[u8]| [&(bytes.len() as u32).to_le_bytes()[..], bytes].concat();
    let past_end = [&1000u32.to_le_bytes()[..], &[0; 10]].concat();
    let end = (u32::MAX - 1).to_le_bytes();
    let cases = [
        (
            "a record running past its batch",
            vec![batch(1, 0, 0, &past_end)],
            "runs past",
        ),
        (
            "a batch ending inside a header",
            vec![batch(1, 0, 0, &[1, 2])],
            "inside a header",
        ),
        (
            "a wrap marker in a batch",
            vec![batch(1, 0, 0, &u32::MAX.to_le_bytes())],
            "wrap marker",
        ),
        (
            "a record after the end of stream in its batch",
            vec![batch(1, 0, 0, &[&end[..], &frame(b"evil")].concat())],
            "after the end of stream",
        ),
        (
            "a batch after the end of stream",
            vec![
                batch(1, 0, 0, &[frame(b"ok"), end.to_vec()].concat()),
                batch(1, 0, 1, &frame(b"late")),
            ],
            "after the end of stream",
        ),
        (
            "the end of stream before a batch numbered earlier",
            vec![batch(1, 0, 0, &end), batch(1, 0, 2, &frame(b"lost"))],
            "end of stream",
        ),
        (
            "a batch numbered far ahead",
            vec![batch(1, 0, 1 << 40, &frame(b"far"))],
            "far ahead",
        ),
        (
            "a record after a good one running past the batch",
            vec![batch(1, 0, 0, &[frame(b"good"), past_end.clone()].concat())],
            "runs past",
        ),
        (
            "a batch number twice",
            vec![
                batch(1, 0, 0, &frame(b"ok")),
                batch(1, 0, 0, &frame(b"again")),
            ],
            "twice",
        ),
    ];
    for (what, messages, why) in cases {
        let nodes = nodes(Kind::Loopback, 2);
        let (_a, b) = messages_pair(&nodes, 512);
        for m in &messages {
            nodes[0].send_raw(NodeId(1), TYPE, SUB, m).unwrap();
        }
        let mut q = b.puller(0).unwrap();
        let mut good = 0;
        let err = loop {
            match q.next() {
                Some(Ok(r)) => {
                    assert_eq!(r.from, 0, "{what}");
                    good += 1;
                }
                Some(Err(e)) => break e,
                None => panic!("{what}: ended without an error"),
            }
        };
        assert!(
            matches!(&err, ShuffleError::Corrupt { from: 0, why: w } if w.contains(why)),
            "{what}: {err:?}"
        );
        assert!(good <= 1, "{what}: {good} records");
    }
    // Addressed to a worker of the other process, to no worker, from no
    // worker, from a worker of another process than the sender (here the
    // receiver's own), too short for a head: dropped; the honest stream
    // still ends.
    let nodes = nodes(Kind::Loopback, 2);
    let (a, b) = messages_pair(&nodes, 512);
    for m in [
        batch(0, 0, 0, &frame(b"x")),
        batch(7, 0, 0, &frame(b"x")),
        batch(1, 9, 0, &frame(b"x")),
        batch(1, 1, 0, &frame(b"x")),
        vec![1, 0, 0],
    ] {
        nodes[0].send_raw(NodeId(1), TYPE, SUB, &m).unwrap();
    }
    let mut p = a.pusher(0).unwrap();
    p.push_bytes(1, b"honest").unwrap();
    p.finish().unwrap();
    b.pusher(0).unwrap().finish().unwrap();
    let got: Vec<_> = b.puller(0).unwrap().map(|r| r.unwrap()).collect();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].from, got[0].bytes()), (0, &b"honest"[..]));
}
