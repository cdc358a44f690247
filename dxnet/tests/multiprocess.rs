//! Nodes in separate OS processes over TCP on 127.0.0.1: all-to-all traffic
//! with random sizes from many threads, every message checked once and in
//! order; and a slow receiver whose and whose sender's memory stay flat.
//!
//! The test binary re-runs itself as the child processes (`child_*` tests
//! that do nothing unless `DXNET_CHILD` is set).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::proc::*;
use common::*;
use dxnet::{Config, Node, NodeId};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Ping(u16);
#[derive(Serialize, Deserialize, Debug)]
struct Pong(u16);
dxnet::message!(Pong, 11, 2);
dxnet::request!(Ping, 11, 1 => Pong);

fn child_config(id: u16, n: u16, base: u16) -> Config {
    let mut c = fc_config(id, n, base);
    c.limits.orb_size = 64 << 10;
    c
}

/// Flow-control test settings: 1 MiB ring, 512 KiB window.
fn fc_config(id: u16, n: u16, base: u16) -> Config {
    let mut c = Config::tcp_localhost(id, n, base);
    c.limits.orb_size = 1 << 20;
    c.limits.recv_buffer_size = Some(16 << 10);
    c.limits.flow_control_window = 512 << 10;
    c.park.spin_us = 20;
    c.park.yield_us = 200;
    // Behaviour, not time: 16 threads share a 64 KiB ring and a 512 KiB
    // window with messages up to 192 KiB; on a loaded machine a single
    // send can wait seconds for its turn.
    c.limits.send_timeout_ms = 60_000;
    c
}

#[test]
fn child_all_to_all() {
    if std::env::var("DXNET_CHILD").is_err() {
        return;
    }
    let id: u16 = env("NODE").parse().unwrap();
    let n: u16 = env("NODES").parse().unwrap();
    let base: u16 = env("BASE").parse().unwrap();
    let threads: u16 = env("THREADS").parse().unwrap();
    let per: u64 = env("PER").parse().unwrap();
    let node = Arc::new(Node::start(child_config(id, n, base)).unwrap());
    let chk = Arc::new(Checker::default());
    let c = chk.clone();
    node.register(move |src, m: Data| c.check(src, &m)).unwrap();
    node.register_request(|_, p: Ping| Pong(p.0)).unwrap();
    let done = register_done(&node);
    let peers: Vec<u16> = (0..n).filter(|&p| p != id).collect();
    // Start barrier: every peer answers a ping.
    for &p in &peers {
        until_reachable("ping", || {
            node.request(NodeId(p), &Ping(id), Duration::from_secs(2))
        });
    }
    let max = 3 * (64 << 10);
    std::thread::scope(|s| {
        for t in 0..threads {
            let node = node.clone();
            s.spawn(move || {
                send_checked(&node, t, per * (n as u64 - 1), max, |i| {
                    ((id as u64 + 1 + i % (n as u64 - 1)) % n as u64) as u16
                })
            });
        }
    });
    let expect = per * threads as u64 * (n as u64 - 1);
    wait_for(120, "all messages", || {
        chk.received.load(Ordering::SeqCst) >= expect
    });
    chk.assert_ok();
    end_barrier(&node, &peers, &done);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(chk.received.load(Ordering::SeqCst), expect, "no duplicates");
    println!("CHILD OK received={}", chk.received.load(Ordering::SeqCst));
}

fn run_all_to_all(n: u16, threads: u16, per: u64) {
    let base = base_port(n);
    let children: Vec<ChildProc> = (0..n)
        .map(|id| {
            spawn_child(
                "child_all_to_all",
                &[
                    ("NODE", id.to_string()),
                    ("NODES", n.to_string()),
                    ("BASE", base.to_string()),
                    ("THREADS", threads.to_string()),
                    ("PER", per.to_string()),
                ],
            )
        })
        .collect();
    let expect = per * threads as u64 * (n as u64 - 1);
    for c in children {
        let out = wait_child(c, 240);
        assert!(
            out.contains(&format!("CHILD OK received={expect}")),
            "{out}"
        );
    }
}

#[test]
fn processes_two_nodes_sixteen_threads() {
    run_all_to_all(2, 16, 100);
}

#[test]
fn processes_four_nodes_all_to_all() {
    run_all_to_all(4, 3, 150);
}

#[test]
fn child_slow_receiver() {
    if std::env::var("DXNET_CHILD").is_err() {
        return;
    }
    let base: u16 = env("BASE").parse().unwrap();
    let count: u64 = env("COUNT").parse().unwrap();
    let node = Node::start(fc_config(1, 2, base)).unwrap();
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    node.register_raw(12, 1, move |_, p| {
        assert_eq!(p.len(), 64 << 10);
        std::thread::sleep(Duration::from_micros(500)); // deliberately slow
        g.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    let start_rss = rss_kib();
    wait_for(300, "all messages", || got.load(Ordering::SeqCst) >= count);
    std::thread::sleep(Duration::from_millis(200));
    println!(
        "CHILD OK got={} start_rss_kib={start_rss} hwm_kib={}",
        got.load(Ordering::SeqCst),
        hwm_kib()
    );
}

#[test]
fn slow_receiver_memory_stays_bounded() {
    let base = base_port(2);
    let count = 3000u64; // 3000 × 64 KiB = 192 MiB through a 512 KiB window
    let child = spawn_child(
        "child_slow_receiver",
        &[("BASE", base.to_string()), ("COUNT", count.to_string())],
    );
    let node = Node::start(fc_config(0, 2, base)).unwrap();
    let payload = vec![3u8; 64 << 10];
    until_reachable("first send", || node.send_raw(NodeId(1), 12, 1, &payload));
    let rss0 = rss_kib();
    let mut peak = rss0;
    for i in 1..count {
        node.send_raw(NodeId(1), 12, 1, &payload).unwrap();
        if i % 100 == 0 {
            peak = peak.max(rss_kib());
        }
    }
    let out = wait_child(child, 300);
    let field = |k: &str| -> u64 {
        out.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .unwrap_or_else(|| panic!("{k} in {out}"))
            .parse()
            .unwrap()
    };
    assert_eq!(field("got="), count);
    // Sender: fixed ring buffer, blocked by flow control; receiver: pool,
    // bounded queue, one window. Neither grows with the 192 MiB sent.
    assert!(
        peak - rss0 < 16 << 10,
        "sender RSS grew by {} KiB",
        peak - rss0
    );
    let recv_growth = field("hwm_kib=").saturating_sub(field("start_rss_kib="));
    assert!(
        recv_growth < 48 << 10,
        "receiver peak RSS grew by {recv_growth} KiB"
    );
}
