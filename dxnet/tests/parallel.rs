//! Parallel handlers: messages and requests of one connection run on
//! several handler threads at once; every message exactly once with many
//! sender threads while an ordered type on the same connections keeps its
//! per-thread order; every response matched; flow control holds a sender
//! back while its parallel messages wait for handlers.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::*;
use dxnet::{Error, NodeId};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Work {
    from: u16,
    thread: u16,
    seq: u64,
    pad: Vec<u8>,
}
dxnet::message!(Work, 44, 1);

#[derive(Serialize, Deserialize, Debug)]
struct Square(u64);
#[derive(Serialize, Deserialize, Debug)]
struct Squared(u64);
dxnet::message!(Squared, 44, 3);
dxnet::request!(Square, 44, 2 => Squared);

/// Two handlers of one connection meet inside: possible only if they run
/// at once. Each waits (up to 60 s) for the other; true if they met.
#[derive(Default)]
struct Rendezvous {
    inside: Mutex<u32>,
    cv: Condvar,
}

impl Rendezvous {
    fn meet(&self) -> bool {
        let mut n = self.inside.lock().unwrap();
        *n += 1;
        self.cv.notify_all();
        let (n, timeout) = self
            .cv
            .wait_timeout_while(n, Duration::from_secs(60), |n| *n < 2)
            .unwrap();
        drop(n);
        !timeout.timed_out()
    }
}

fn configs(n: u16, tweak: impl Fn(&mut dxnet::Config)) -> Vec<dxnet::Config> {
    cluster_configs(Kind::Tcp, n, |c| {
        c.handler_threads = 4;
        tweak(c)
    })
}

#[test]
fn messages_of_one_connection_run_at_once() {
    let nodes = start_all(configs(2, |_| {}));
    let rv = Arc::new(Rendezvous::default());
    let met = Arc::new(AtomicU64::new(0));
    {
        let (rv, met) = (rv.clone(), met.clone());
        nodes[1]
            .register_parallel(move |_, w: Work| {
                if w.seq < 2 && rv.meet() {
                    met.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap();
    }
    // One sender thread, one connection.
    for seq in 0..2 {
        let w = Work {
            from: 0,
            thread: 0,
            seq,
            pad: vec![],
        };
        nodes[0].send(NodeId(1), &w).unwrap();
    }
    wait_for(90, "both handlers returned", || {
        met.load(Ordering::SeqCst) == 2
    });
}

#[test]
fn requests_of_one_connection_run_at_once() {
    let nodes = start_all(configs(2, |_| {}));
    let rv = Arc::new(Rendezvous::default());
    {
        let rv = rv.clone();
        nodes[1]
            .register_request_parallel(move |_, Square(x): Square| {
                assert!(rv.meet(), "the other request's handler never came");
                Squared(x * x)
            })
            .unwrap();
    }
    let a = nodes[0].request_async(NodeId(1), &Square(3), Duration::from_secs(90));
    let b = nodes[0].request_async(NodeId(1), &Square(4), Duration::from_secs(90));
    assert_eq!(a.unwrap().wait().unwrap().0, 9);
    assert_eq!(b.unwrap().wait().unwrap().0, 16);
}

/// Two nodes × 16 threads send parallel `Work` and ordered `Data`
/// interleaved to node 0: every `Work` exactly once, every `Data` once and
/// in per-thread order. Then 16 requester threads: every response matched.
#[test]
fn many_threads_every_message_once_and_ordered_types_stay_ordered() {
    const THREADS: u16 = 16;
    const PER: u64 = 400;
    let nodes = start_all(configs(3, |_| {}));
    let seen = Arc::new(Mutex::new(HashSet::new()));
    {
        let seen = seen.clone();
        nodes[0]
            .register_parallel(move |src, w: Work| {
                assert_eq!(src.0, w.from);
                assert_eq!(w.pad, pattern(w.from, w.thread, w.seq, w.pad.len()));
                assert!(
                    seen.lock().unwrap().insert((w.from, w.thread, w.seq)),
                    "duplicate {:?}",
                    (w.from, w.thread, w.seq)
                );
            })
            .unwrap();
    }
    let checker = Arc::new(Checker::default());
    {
        let checker = checker.clone();
        nodes[0]
            .register(move |src, m: Data| checker.check(src, &m))
            .unwrap();
    }
    nodes[0]
        .register_request_parallel(|_, Square(x): Square| Squared(x.wrapping_mul(x)))
        .unwrap();
    let senders: Vec<_> = (1..3u16)
        .flat_map(|n| (0..THREADS).map(move |t| (n, t)))
        .map(|(n, t)| {
            let node = nodes[n as usize].clone();
            std::thread::spawn(move || {
                for seq in 0..PER {
                    let len = size_for(seq ^ (t as u64) << 20 ^ (n as u64) << 40, 2048);
                    let w = Work {
                        from: n,
                        thread: t,
                        seq,
                        pad: pattern(n, t, seq, len),
                    };
                    node.send(NodeId(0), &w).unwrap();
                    let d = Data {
                        from: n,
                        thread: t,
                        seq,
                        payload: pattern(n, t, seq, len / 2),
                    };
                    node.send(NodeId(0), &d).unwrap();
                }
            })
        })
        .collect();
    for s in senders {
        s.join().unwrap();
    }
    let total = 2 * THREADS as usize * PER as usize;
    wait_for(60, "every parallel message", || {
        seen.lock().unwrap().len() == total
    });
    wait_for(60, "every ordered message", || {
        checker.received.load(Ordering::SeqCst) == total as u64
    });
    checker.assert_ok();
    for n in 1..3 {
        for t in 0..THREADS {
            assert_eq!(checker.next_seq(n, t), PER);
        }
    }

    let requesters: Vec<_> = (0..THREADS as u64)
        .map(|t| {
            let node = nodes[1].clone();
            std::thread::spawn(move || {
                for i in 0..200u64 {
                    let x = t << 32 | i;
                    let r = node
                        .request(NodeId(0), &Square(x), Duration::from_secs(30))
                        .unwrap();
                    assert_eq!(r.0, x.wrapping_mul(x));
                }
            })
        })
        .collect();
    for r in requesters {
        r.join().unwrap();
    }
    assert_eq!(nodes[0].stats().unknown_messages, 0);
}

/// Parallel receivers that do not return hold their messages' window:
/// the sender is held back (its sends time out) and nothing is lost once
/// they return.
#[test]
fn waiting_parallel_handlers_hold_the_sender_back() {
    let nodes = start_all(configs(2, |c| {
        c.limits.flow_control_window = 256 * 1024;
        c.limits.send_timeout_ms = 300;
    }));
    let gate = Arc::new((Mutex::new(false), Condvar::new()));
    let seen = Arc::new(Mutex::new(HashSet::new()));
    {
        let (gate, seen) = (gate.clone(), seen.clone());
        nodes[1]
            .register_parallel(move |_, w: Work| {
                let (open, cv) = &*gate;
                let _open = cv.wait_while(open.lock().unwrap(), |o| !*o).unwrap();
                assert!(seen.lock().unwrap().insert(w.seq), "duplicate {}", w.seq);
            })
            .unwrap();
    }
    let mut accepted = 0u64;
    let blocked = loop {
        let w = Work {
            from: 0,
            thread: 0,
            seq: accepted,
            pad: vec![7; 1024],
        };
        match nodes[0].send(NodeId(1), &w) {
            Ok(()) => accepted += 1,
            Err(e) => break e,
        }
        assert!(accepted < 100_000, "the sender was never held back");
    };
    assert!(matches!(blocked, Error::Timeout(_)), "{blocked:?}");
    *gate.0.lock().unwrap() = true;
    gate.1.notify_all();
    wait_for(60, "every accepted message", || {
        seen.lock().unwrap().len() as u64 == accepted
    });
    let seen = seen.lock().unwrap();
    assert!((0..accepted).all(|s| seen.contains(&s)));
}
