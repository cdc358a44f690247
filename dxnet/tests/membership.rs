//! The node map at run time: a removed node's pending and later requests
//! fail with `Unreachable::Removed`, its connections are refused, other
//! nodes keep working, and adding it back restores it; a node added at run
//! time (with its identity key when identities are checked) is reachable
//! both ways.

mod common;

use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::*;
use dxnet::config::NodeEntry;
use dxnet::events::ConnectionEvent;
use dxnet::{Error, Node, NodeId, Unreachable};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Ping(u32);
#[derive(Serialize, Deserialize, Debug)]
struct Pong(u32);
dxnet::message!(Pong, 45, 2);
dxnet::request!(Ping, 45, 1 => Pong);

/// A request handler that answers `x + 1`, holding requests of `x == 999`
/// until the gate opens.
fn serve(node: &Node, gate: Arc<(Mutex<bool>, Condvar)>) {
    node.register_request(move |_, Ping(x): Ping| {
        if x == 999 {
            let (open, cv) = &*gate;
            let _g = cv
                .wait_timeout_while(open.lock().unwrap(), Duration::from_secs(30), |o| !*o)
                .unwrap();
        }
        Pong(x + 1)
    })
    .unwrap();
}

fn ask(from: &Node, to: u16, x: u32) -> dxnet::Result<u32> {
    from.request(NodeId(to), &Ping(x), Duration::from_secs(10))
        .map(|p| p.0)
}

#[test]
fn removed_node_fails_with_removed_and_comes_back_when_added() {
    let cfgs = cluster_configs(Kind::Tcp, 3, |c| c.limits.connect_timeout_ms = 2000);
    let entry1 = cfgs[0].nodes.iter().find(|n| n.id == 1).unwrap().clone();
    let nodes = start_all(cfgs);
    let gate = Arc::new((Mutex::new(false), Condvar::new()));
    for n in &nodes {
        serve(n, gate.clone());
    }
    let events = nodes[0].connection_events(16).unwrap();
    assert_eq!(ask(&nodes[0], 1, 1).unwrap(), 2);
    assert_eq!(ask(&nodes[0], 2, 1).unwrap(), 2);

    // A request node 1 holds, pending when node 1 is removed.
    let pending = nodes[0]
        .request_async(NodeId(1), &Ping(999), Duration::from_secs(20))
        .unwrap();
    nodes[0].remove_node(NodeId(1)).unwrap();
    let removed = |r: dxnet::Result<u32>| {
        matches!(r, Err(Error::Unreachable(NodeId(1), Unreachable::Removed)))
    };
    let r = pending.wait().map(|p| p.0);
    assert!(removed(r.clone()), "{r:?}");
    let r = ask(&nodes[0], 1, 2);
    assert!(removed(r.clone()), "{r:?}");
    let r = nodes[0].send(NodeId(1), &Pong(0)).map(|()| 0);
    assert!(removed(r.clone()), "{r:?}");
    assert_eq!(nodes[0].nodes(), vec![NodeId(0), NodeId(2)]);
    assert!(matches!(
        nodes[0].remove_node(NodeId(1)),
        Err(Error::Unreachable(NodeId(1), Unreachable::NotInNodeMap))
    ));
    // Node 1 cannot connect to node 0 any more.
    {
        let (open, cv) = &*gate;
        *open.lock().unwrap() = true;
        cv.notify_all();
    }
    let r = ask(&nodes[1], 0, 3);
    assert!(
        matches!(r, Err(Error::Unreachable(NodeId(0), _))),
        "a removed node connected: {r:?}"
    );
    // Other nodes are not affected.
    assert_eq!(ask(&nodes[0], 2, 5).unwrap(), 6);
    assert_eq!(ask(&nodes[2], 0, 5).unwrap(), 6);
    // The connection's end says why.
    let lost = std::iter::from_fn(|| events.recv_timeout(Duration::from_secs(10)).ok())
        .find(|e| e.node() == NodeId(1) && !matches!(e, ConnectionEvent::Connected { .. }))
        .expect("an event for node 1");
    assert_eq!(
        lost,
        ConnectionEvent::Lost {
            node: NodeId(1),
            cause: Unreachable::Removed
        }
    );

    // Added back: reachable both ways.
    nodes[0].add_node(entry1).unwrap();
    assert_eq!(nodes[0].nodes(), vec![NodeId(0), NodeId(1), NodeId(2)]);
    until_ok(|| ask(&nodes[0], 1, 7));
    until_ok(|| ask(&nodes[1], 0, 7));
}

/// Retries `f` for up to 20 s (a refused connection may still be closing
/// at the peer).
fn until_ok(f: impl Fn() -> dxnet::Result<u32>) -> u32 {
    let end = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) if std::time::Instant::now() > end => panic!("still failing: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Node 0 starts without node 2 in its map (with identities checked):
/// node 2 cannot reach it until node 0 adds node 2 with its public key.
#[test]
fn node_added_at_run_time_is_reachable_both_ways() {
    let mut cfgs = cluster_configs(Kind::Tcp, 3, |c| {
        c.limits.connect_timeout_ms = 2000;
        with_test_identities(c);
    });
    let entry2 = cfgs[0].nodes.iter().find(|n| n.id == 2).unwrap().clone();
    cfgs[0].nodes.retain(|n| n.id != 2);
    let nodes = start_all(cfgs);
    let gate = Arc::new((Mutex::new(true), Condvar::new()));
    for n in &nodes {
        serve(n, gate.clone());
    }
    assert_eq!(nodes[0].nodes(), vec![NodeId(0), NodeId(1)]);
    let r = ask(&nodes[0], 2, 1);
    assert!(
        matches!(
            r,
            Err(Error::Unreachable(NodeId(2), Unreachable::NotInNodeMap))
        ),
        "{r:?}"
    );
    let r = ask(&nodes[2], 0, 1);
    assert!(matches!(r, Err(Error::Unreachable(NodeId(0), _))), "{r:?}");

    // Without its key the entry is refused: node 0 checks identities.
    let mut keyless = entry2.clone();
    keyless.public_key = None;
    assert!(matches!(nodes[0].add_node(keyless), Err(Error::Config(_))));
    // With a wrong key the node cannot authenticate.
    let mut wrong = entry2.clone();
    wrong.public_key = cfgs_key(1);
    nodes[0].add_node(wrong).unwrap();
    let r = ask(&nodes[0], 2, 1);
    assert!(matches!(r, Err(Error::Unreachable(NodeId(2), _))), "{r:?}");

    nodes[0].add_node(entry2).unwrap();
    assert_eq!(until_ok(|| ask(&nodes[0], 2, 10)), 11);
    assert_eq!(until_ok(|| ask(&nodes[2], 0, 20)), 21);
    assert_eq!(nodes[0].nodes(), vec![NodeId(0), NodeId(1), NodeId(2)]);
    assert!(matches!(
        nodes[0].add_node(NodeEntry::new(0, "127.0.0.1:1")),
        Err(Error::Config(_))
    ));
}

/// Node `id`'s test public key as hex.
fn cfgs_key(id: u16) -> Option<String> {
    let mut c = dxnet::Config::tcp_localhost(id, id + 1, 1);
    with_test_identities(&mut c);
    c.nodes
        .iter()
        .find(|n| n.id == id)
        .unwrap()
        .public_key
        .clone()
}

/// Four sender threads of node 0 stream checked messages to nodes 1, 2
/// and 3 while node 0 removes node 3 and adds it back, twice (each change
/// once the senders saw the previous one: 500 more messages accepted for
/// node 3, 50 more refused): nodes 1 and 2 get every message exactly once
/// and in order; a send to node 3 succeeds or fails as unreachable, and
/// what node 3 received is, per sender thread, an ordered subset of what
/// was accepted for it (what a removal cut off in flight is lost). Every
/// message a thread sent to node 3 after it was added back the last time
/// (at least 100 each) arrives.
#[test]
fn removing_and_adding_a_node_during_traffic() {
    const THREADS: u16 = 4;
    const PER: u64 = 3000;
    let cfgs = cluster_configs(Kind::Tcp, 4, |c| c.limits.connect_timeout_ms = 2000);
    let entry3 = cfgs[0].nodes.iter().find(|n| n.id == 3).unwrap().clone();
    let nodes = start_all(cfgs);
    let checkers: Vec<Arc<Checker>> = (0..4).map(|_| Arc::new(Checker::default())).collect();
    let seqs3: Arc<Mutex<Vec<(u16, u64)>>> = Arc::default();
    for i in 1..3 {
        let c = checkers[i].clone();
        nodes[i]
            .register(move |src, m: Data| c.check(src, &m))
            .unwrap();
    }
    {
        let seqs3 = seqs3.clone();
        nodes[3]
            .register(move |_, m: Data| seqs3.lock().unwrap().push((m.thread, m.seq)))
            .unwrap();
    }
    let accepted3: Arc<Mutex<Vec<(u16, u64)>>> = Arc::default();
    let ev3 = nodes[3].connection_events(64).unwrap();
    let refused3 = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Set once node 3 is back for good; sends to it started after that
    // are kept apart: no removal can cut them off.
    let final_add = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let after3: Arc<Mutex<Vec<(u16, u64)>>> = Arc::default();
    let senders: Vec<_> = (0..THREADS)
        .map(|t| {
            let node = nodes[0].clone();
            let (accepted3, refused3, stop) = (accepted3.clone(), refused3.clone(), stop.clone());
            let (final_add, after3) = (final_add.clone(), after3.clone());
            std::thread::spawn(move || {
                let mut seq = [0u64; 4];
                let mut i = 0u64;
                // Nodes 1 and 2 get PER each; node 3 gets messages until
                // the membership changes are done.
                while seq[1] < PER || seq[2] < PER || !stop.load(SeqCst) {
                    i += 1;
                    let dest = 1 + (i % 3) as u16;
                    if (dest < 3 && seq[dest as usize] == PER) || (dest == 3 && stop.load(SeqCst)) {
                        continue;
                    }
                    let s = seq[dest as usize];
                    let m = Data {
                        from: 0,
                        thread: t,
                        seq: s,
                        payload: pattern(0, t, s, size_for(i, 512)),
                    };
                    let after = final_add.load(SeqCst);
                    match node.send(NodeId(dest), &m) {
                        Ok(()) => {
                            seq[dest as usize] += 1;
                            if dest == 3 {
                                accepted3.lock().unwrap().push((t, s));
                                if after {
                                    after3.lock().unwrap().push((t, s));
                                }
                            }
                        }
                        Err(Error::Unreachable(NodeId(3), _)) => {
                            refused3.fetch_add(1, SeqCst);
                        }
                        Err(e) => panic!("send to {dest}: {e}"),
                    }
                }
            })
        })
        .collect();
    let accepted = || accepted3.lock().unwrap().len();
    for _ in 0..2 {
        let before = accepted();
        wait_for(60, "messages to node 3", || accepted() >= before + 500);
        nodes[0].remove_node(NodeId(3)).unwrap();
        let refused = refused3.load(SeqCst);
        wait_for(60, "refused sends to node 3", || {
            refused3.load(SeqCst) >= refused + 50
        });
        nodes[0].add_node(entry3.clone()).unwrap();
    }
    final_add.store(true, SeqCst);
    // Every thread sends some, not just the ones the scheduler favours.
    wait_for(
        60,
        "messages of every thread to node 3 after it came back",
        || {
            let a = after3.lock().unwrap();
            (0..THREADS).all(|t| a.iter().filter(|x| x.0 == t).count() >= 100)
        },
    );
    stop.store(true, SeqCst);
    for s in senders {
        s.join().unwrap();
    }
    for (i, c) in checkers.iter().enumerate().take(3).skip(1) {
        c.expect_streams(&format!("node {i}"), 0, THREADS, PER, 60);
    }
    // Node 3: each thread's messages that arrived came in order, and
    // every one of them was accepted by `send`.
    wait_for(
        30,
        "node 3 got the messages sent after it came back",
        || {
            let got = seqs3.lock().unwrap();
            let after = after3.lock().unwrap();
            let got: std::collections::HashSet<&(u16, u64)> = got.iter().collect();
            after.iter().all(|a| got.contains(a))
        },
    );
    let got = seqs3.lock().unwrap();
    let acc: std::collections::HashSet<(u16, u64)> =
        accepted3.lock().unwrap().iter().copied().collect();
    for t in 0..THREADS {
        let mine: Vec<u64> = got.iter().filter(|g| g.0 == t).map(|g| g.1).collect();
        if let Some(k) = mine.windows(2).position(|w| w[0] >= w[1]) {
            let acc = accepted3.lock().unwrap();
            let pos = |x: u64| acc.iter().position(|a| *a == (t, x));
            panic!(
                "thread {t}: {} then {} at node 3 (received around: {:?}; accepted as #{:?} and #{:?} of {}; node 3 events {:?})",
                mine[k],
                mine[k + 1],
                &mine[k.saturating_sub(3)..(k + 4).min(mine.len())],
                pos(mine[k]),
                pos(mine[k + 1]),
                acc.len(),
                std::iter::from_fn(|| ev3.try_recv().ok()).collect::<Vec<_>>(),
            );
        }
        assert!(mine.iter().all(|s| acc.contains(&(t, *s))));
    }
}
