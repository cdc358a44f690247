//! In-process clusters (loopback and TCP on 127.0.0.1): all-to-all traffic
//! from many threads with random sizes; every message checked exactly once,
//! intact and in order per (sender thread, destination).

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::*;
use dxnet::NodeId;

fn all_to_all(kind: Kind, nodes: u16, threads: u16, per_thread: u64, orb: usize) {
    let cfgs = cluster_configs(kind, nodes, |c| {
        c.limits.orb_size = orb;
        c.limits.recv_buffer_size = Some(8 << 10);
        c.limits.flow_control_window = 256 << 10;
        c.handler_threads = 2;
        // Behaviour, not time: a loaded machine must not fail a send.
        c.limits.send_timeout_ms = 60_000;
    });
    let cluster = start_all(cfgs);
    let checkers: Vec<Arc<Checker>> = (0..nodes).map(|_| Arc::new(Checker::default())).collect();
    for (node, chk) in cluster.iter().zip(&checkers) {
        let chk = chk.clone();
        node.register(move |src, m: Data| chk.check(src, &m))
            .unwrap();
    }
    let max = orb * 3; // larger than the ring: split across it
    std::thread::scope(|s| {
        for node in &cluster {
            for t in 0..threads {
                let node = node.clone();
                s.spawn(move || {
                    let me = node.id().0;
                    let mut seq = vec![0u64; nodes as usize];
                    for i in 0..per_thread * (nodes as u64 - 1) {
                        let dest = ((me as u64 + 1 + i % (nodes as u64 - 1)) % nodes as u64) as u16;
                        let sq = seq[dest as usize];
                        seq[dest as usize] += 1;
                        let len = size_for(i ^ (t as u64) << 40 ^ (me as u64) << 50, max);
                        let m = Data {
                            from: me,
                            thread: t,
                            seq: sq,
                            payload: pattern(me, t, sq, len),
                        };
                        node.send(NodeId(dest), &m).unwrap();
                    }
                });
            }
        }
    });
    let expect = per_thread * threads as u64 * (nodes as u64 - 1);
    for chk in &checkers {
        wait_for(120, "all messages", || {
            chk.received.load(Ordering::SeqCst) >= expect || !chk.errors.lock().unwrap().is_empty()
        });
        chk.assert_ok();
        assert_eq!(chk.received.load(Ordering::SeqCst), expect);
    }
    // Nothing extra arrives later.
    std::thread::sleep(std::time::Duration::from_millis(50));
    for chk in &checkers {
        assert_eq!(chk.received.load(Ordering::SeqCst), expect);
    }
}

#[test]
fn loopback_two_nodes_one_thread() {
    all_to_all(Kind::Loopback, 2, 1, 2000, 64 << 10);
}

#[test]
fn loopback_four_nodes_eight_threads() {
    all_to_all(Kind::Loopback, 4, 8, 150, 64 << 10);
}

#[test]
fn tcp_two_nodes_sixteen_threads() {
    all_to_all(Kind::Tcp, 2, 16, 150, 64 << 10);
}

#[test]
fn tcp_three_nodes_four_threads_small_ring() {
    all_to_all(Kind::Tcp, 3, 4, 200, 16 << 10);
}

#[test]
fn send_to_self_is_delivered_locally() {
    let cluster = start_all(cluster_configs(Kind::Tcp, 1, |_| {}));
    let chk = Arc::new(Checker::default());
    let c = chk.clone();
    cluster[0]
        .register(move |src, m: Data| c.check(src, &m))
        .unwrap();
    for seq in 0..500 {
        let p = pattern(0, 0, seq, (seq as usize * 13) % 3000);
        cluster[0]
            .send(
                NodeId(0),
                &Data {
                    from: 0,
                    thread: 0,
                    seq,
                    payload: p,
                },
            )
            .unwrap();
    }
    wait_for(30, "local messages", || {
        chk.received.load(Ordering::SeqCst) == 500
    });
    chk.assert_ok();
    assert_eq!(
        cluster[0].stats().connections_opened,
        0,
        "no transport connection to self"
    );
}

#[test]
fn tls_three_nodes_four_threads_small_ring() {
    all_to_all(Kind::TcpTls, 3, 4, 200, 16 << 10);
}
