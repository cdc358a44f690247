//! `send_to_many` to 8 nodes against 8 single `send`s of the same message,
//! side by side in alternating rounds: 9 nodes in this process over TCP
//! loopback; node 0 sends `PER` messages of `SIZE` bytes (a `Vec<u8>`
//! payload, so serialization copies it) to nodes 1..=8 either way, and a
//! round ends when all 8 have them all.
//!     cargo run --release --example multisend -- [PER] [SIZE] [ROUNDS] [BASE_PORT] [THREADS]
//! Defaults: 100 000 messages, 64 B, 6 rounds, port 23400, 1 sender thread
//! (with more, each sends its share of the messages). Prints messages
//! per second (counted per destination) for each way and round, and the
//! median ratio.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dxnet::{Config, Node, NodeId};

#[derive(serde::Serialize, serde::Deserialize)]
struct Blob(Vec<u8>);
dxnet::message!(Blob, 40, 1);

const DESTS: u16 = 8;

fn arg(i: usize, default: u64) -> u64 {
    std::env::args()
        .nth(i)
        .map_or(default, |a| a.parse().expect("numeric argument"))
}

fn main() {
    let per = arg(1, 100_000);
    let size = arg(2, 64) as usize;
    let rounds = arg(3, 6);
    let base = arg(4, 23400) as u16;
    let threads = arg(5, 1).max(1);
    let n = DESTS + 1;
    let got = Arc::new(AtomicU64::new(0));
    let nodes: Vec<Node> = (0..n)
        .map(|i| {
            let mut c = Config::tcp_localhost(i, n, base);
            c.park.spin_us = 20;
            c.park.yield_us = 200;
            let node = Node::start(c).expect("start node");
            let g = got.clone();
            node.register(move |_, _: Blob| {
                g.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
            node
        })
        .collect();
    let dests: Vec<NodeId> = (1..n).map(NodeId).collect();
    let msg = Blob(vec![7; size]);
    // Connections up before measuring.
    nodes[0].send_to_many(&dests, &msg).into_result().unwrap();
    wait(&got, DESTS as u64);
    let mut ratios = Vec::new();
    for r in 0..rounds {
        let mut rate = [0.0; 2];
        // Alternate which way goes first.
        for k in 0..2 {
            let many = (k + r as usize).is_multiple_of(2);
            got.store(0, Ordering::SeqCst);
            let t0 = Instant::now();
            std::thread::scope(|sc| {
                for t in 0..threads {
                    let (node, dests, msg) = (&nodes[0], &dests, &msg);
                    let share = per / threads + u64::from(t < per % threads);
                    sc.spawn(move || {
                        for _ in 0..share {
                            if many {
                                node.send_to_many(dests, msg).into_result().unwrap();
                            } else {
                                for d in dests {
                                    node.send(*d, msg).unwrap();
                                }
                            }
                        }
                    });
                }
            });
            wait(&got, per * DESTS as u64);
            let secs = t0.elapsed().as_secs_f64();
            rate[usize::from(!many)] = (per * DESTS as u64) as f64 / secs;
        }
        println!(
            "round {r}: send_to_many {:.2} M msg/s, 8 sends {:.2} M msg/s, ratio {:.2}",
            rate[0] / 1e6,
            rate[1] / 1e6,
            rate[0] / rate[1]
        );
        ratios.push(rate[0] / rate[1]);
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "median send_to_many / 8 sends: {:.2}",
        ratios[ratios.len() / 2]
    );
}

fn wait(got: &AtomicU64, n: u64) {
    let end = Instant::now() + Duration::from_secs(120);
    while got.load(Ordering::Relaxed) < n {
        assert!(
            Instant::now() < end,
            "only {} of {n} arrived",
            got.load(Ordering::Relaxed)
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}
