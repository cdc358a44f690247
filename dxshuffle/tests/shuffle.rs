//! Shuffles among several in-process nodes over loopback and TCP, in both
//! modes: random record sizes (0 B to the largest a segment takes) and
//! destinations from more threads than cores, every record checked
//! exactly once, intact and in per-pusher order; tiny segments force the
//! full-remote, full-local and wrap paths; a dead peer ends the others'
//! pushers and pullers with typed errors.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dxnet::{Config, Node, NodeId};
use dxshuffle::{Mode, Shuffle, ShuffleConfig, ShuffleError};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Loopback,
    Tcp,
}

fn base_port(n: u16) -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    if NEXT.load(Ordering::SeqCst) == 0 {
        let seed = 30000 + (std::process::id() % 1000) as u16 * 20;
        let _ = NEXT.compare_exchange(0, seed, Ordering::SeqCst, Ordering::SeqCst);
    }
    loop {
        let p = NEXT.fetch_add(n + 1, Ordering::SeqCst);
        if (0..n).all(|i| std::net::TcpListener::bind(("127.0.0.1", p + i)).is_ok()) {
            return p;
        }
    }
}

fn nodes(kind: Kind, n: u16) -> Vec<Arc<Node>> {
    static FABRIC: AtomicU64 = AtomicU64::new(0);
    let fabric = format!("shuffle-{}", FABRIC.fetch_add(1, Ordering::SeqCst));
    let base = if kind == Kind::Tcp { base_port(n) } else { 0 };
    (0..n)
        .map(|i| {
            let mut c = match kind {
                Kind::Loopback => Config::loopback(i, n, &fabric),
                Kind::Tcp => Config::tcp_localhost(i, n, base),
            };
            // 2-core machine: idle threads must not hog it.
            c.park.spin_us = 20;
            c.park.yield_us = 200;
            Arc::new(Node::start(c).unwrap())
        })
        .collect()
}

/// Record `seq` from worker `from` to `to`: `[from u32][seq u64][bytes]`,
/// its bytes derived from the three.
fn record(from: usize, to: usize, seq: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(12 + len);
    v.extend_from_slice(&(from as u32).to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    let mut x =
        (from as u64) << 40 ^ (to as u64) << 20 ^ seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    v.extend((0..len).map(|_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x as u8
    }));
    v
}

struct Case {
    kind: Kind,
    mode: Mode,
    procs: u16,
    threads: usize,
    segment: usize,
    batch: usize,
    /// Records each worker pushes.
    per_worker: u64,
}

/// Runs a whole shuffle; returns the records received per (from, to).
fn run(case: Case) {
    let nodes = nodes(case.kind, case.procs);
    let ids: Vec<NodeId> = nodes.iter().map(|n| n.id()).collect();
    let workers = case.procs as usize * case.threads;
    // pushed[from][to], received[from][to]
    let pushed = Arc::new(Mutex::new(vec![vec![0u64; workers]; workers]));
    let received = Arc::new(Mutex::new(vec![vec![0u64; workers]; workers]));
    std::thread::scope(|s| {
        for node in &nodes {
            let (ids, pushed, received) = (ids.clone(), pushed.clone(), received.clone());
            let node = node.clone();
            let case = &case;
            s.spawn(move || {
                let mut cfg = ShuffleConfig::new(ids, case.threads);
                cfg.mode = case.mode;
                cfg.segment_bytes = case.segment;
                cfg.batch_bytes = case.batch;
                cfg.timeout = Duration::from_secs(60);
                let shuffle = Shuffle::new(node, cfg).unwrap();
                // Room for the marker byte and serde's length.
                let max = shuffle.max_record() - 12 - 9;
                std::thread::scope(|s| {
                    for t in 0..case.threads {
                        let me = shuffle.worker(t);
                        let mut pusher = shuffle.pusher(t).unwrap();
                        let pushed = &pushed;
                        s.spawn(move || {
                            let mut x = (me as u64 + 1).wrapping_mul(0x2545_F491_4F6C_DD1D);
                            let mut next = move || {
                                x ^= x << 13;
                                x ^= x >> 7;
                                x ^= x << 17;
                                x
                            };
                            let mut seqs = vec![0u64; workers];
                            for i in 0..case.per_worker {
                                let to = (next() % workers as u64) as usize;
                                let len = match next() % 8 {
                                    0 => 0,
                                    1 => max,
                                    2 => (next() % (max as u64 + 1)) as usize,
                                    _ => ((next() % 120) as usize).min(max),
                                };
                                let r = record(me, to, seqs[to], len);
                                if i % 2 == 0 {
                                    let mut raw = vec![RAW];
                                    raw.extend_from_slice(&r);
                                    pusher.push_bytes(to, &raw).unwrap();
                                } else {
                                    pusher.push(to, &(SERDE, r)).unwrap();
                                }
                                seqs[to] += 1;
                                if i % 97 == 0 {
                                    pusher.flush().unwrap();
                                }
                            }
                            pusher.finish().unwrap();
                            pushed.lock().unwrap()[me] = seqs;
                        });
                        let mut puller = shuffle.puller(t).unwrap();
                        let received = &received;
                        s.spawn(move || {
                            let mut next_seq: HashMap<usize, u64> = HashMap::new();
                            let mut n = 0u64;
                            for r in puller.by_ref() {
                                let r = r.unwrap();
                                let bytes = match r.bytes()[0] {
                                    RAW => r.bytes()[1..].to_vec(),
                                    _ => {
                                        let (m, b) = r.decode::<(u8, Vec<u8>)>().unwrap();
                                        assert_eq!(m, SERDE);
                                        b
                                    }
                                };
                                let from = u32::from_le_bytes(bytes[..4].try_into().unwrap());
                                assert_eq!(from as usize, r.from, "sender");
                                let seq = u64::from_le_bytes(bytes[4..12].try_into().unwrap());
                                let want = next_seq.entry(r.from).or_insert(0);
                                assert_eq!(seq, *want, "worker {me}: order from {}", r.from);
                                *want += 1;
                                assert!(
                                    bytes == record(r.from, me, seq, bytes.len() - 12),
                                    "worker {me}: record {seq} from {} damaged",
                                    r.from
                                );
                                n += 1;
                            }
                            assert!(puller.is_finished());
                            let mut rec = received.lock().unwrap();
                            for (from, count) in next_seq {
                                rec[from][me] = count;
                            }
                            let _ = n;
                        });
                    }
                });
            });
        }
    });
    let pushed = pushed.lock().unwrap();
    let received = received.lock().unwrap();
    let total: u64 = pushed.iter().flatten().sum();
    assert_eq!(total, workers as u64 * case.per_worker);
    assert!(*pushed == *received, "every record exactly once");
}

/// First byte of a record pushed as raw bytes; serde-pushed records are
/// `(SERDE, bytes)`.
const RAW: u8 = 1;
const SERDE: u8 = 2;

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
