//! `Node::send_to_many`: one serialization, every live destination gets
//! every message exactly once, in order with the sending thread's single
//! sends to it; a dead destination fails alone, with its own typed error.

mod common;

use std::sync::Arc;

use common::*;
use dxnet::{Error, NodeId};

fn many_to_many(kind: Kind) {
    const LIVE: u16 = 4;
    const THREADS: u16 = 4;
    const PER: u64 = 400;
    // Node 4 is in the node map but never started.
    let mut cfgs = cluster_configs(kind, LIVE + 1, |c| c.limits.connect_timeout_ms = 300);
    cfgs.truncate(LIVE as usize);
    let nodes = start_all(cfgs);
    let checkers: Vec<Arc<Checker>> = nodes[1..]
        .iter()
        .map(|n| {
            let c = Arc::new(Checker::default());
            let cc = c.clone();
            n.register(move |src, m: Data| cc.check(src, &m)).unwrap();
            c
        })
        .collect();
    let dead = NodeId(LIVE);
    let live: Vec<NodeId> = (1..LIVE).map(NodeId).collect();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let node = nodes[0].clone();
            let live = live.clone();
            s.spawn(move || {
                for seq in 0..PER {
                    let len = size_for(seq ^ (t as u64) << 40, 70_000);
                    let m = Data {
                        from: 0,
                        thread: t,
                        seq,
                        payload: pattern(0, t, seq, len),
                    };
                    match seq % 3 {
                        // To every live node, listed twice: each gets it once.
                        0 => {
                            let mut dests = live.clone();
                            dests.extend_from_slice(&live);
                            let r = node.send_to_many(&dests, &m);
                            assert!(r.is_ok(), "{:?}", r.results());
                            assert_eq!(r.results().len(), live.len());
                        }
                        // With the dead node among them (a few times: each
                        // costs its connect timeout).
                        1 if seq < 20 => {
                            let mut dests = vec![live[0], dead];
                            dests.extend_from_slice(&live[1..]);
                            let r = node.send_to_many(&dests, &m);
                            let failed: Vec<_> = r.failed().map(|(n, _)| n).collect();
                            assert_eq!(failed, vec![dead], "{:?}", r.results());
                            assert!(matches!(
                                r.failed().next(),
                                Some((_, Error::Unreachable(n, _))) if *n == dead
                            ));
                        }
                        // One by one.
                        _ => {
                            for d in &live {
                                node.send(*d, &m).unwrap();
                            }
                        }
                    }
                }
            });
        }
    });
    for (i, c) in checkers.iter().enumerate() {
        c.expect_streams(&format!("node {}", i + 1), 0, THREADS, PER, 60);
    }
    // Too large for the limit: every destination gets the typed error.
    let big = Data {
        from: 0,
        thread: 99,
        seq: 0,
        payload: vec![0; nodes[0].config().limits.max_message_size + 1],
    };
    let r = nodes[0].send_to_many(&live, &big);
    assert_eq!(r.failed().count(), live.len());
    assert!(r.failed().all(|(_, e)| matches!(e, Error::TooLarge { .. })));
    assert!(r.into_result().is_err());
    // To every other node of the node map: the dead one fails.
    let r = nodes[1].send_to_all(&Done(1));
    let failed: Vec<_> = r.failed().map(|(n, _)| n).collect();
    assert_eq!(failed, vec![dead]);
    assert_eq!(r.results().len(), LIVE as usize);
}

#[test]
fn send_to_many_over_loopback() {
    many_to_many(Kind::Loopback);
}

#[test]
fn send_to_many_over_tcp() {
    many_to_many(Kind::Tcp);
}
