//! The instructions a one-way send costs, for counting with callgrind
//! (deterministic, unlike time on a shared machine): node 0 sends 100 000
//! raw 64 B messages to node 1 over the loopback engine from one thread,
//! inside `send_all`, with per-connection counting on or off:
//!
//!     cargo build --release -p dxnet --example send_cost
//!     valgrind --tool=callgrind --toggle-collect='*send_all*' \
//!         target/release/examples/send_cost on|off
//!
//! "Collected" / 100 000 is the instructions per message. The ring and the
//! flow-control window hold every message, so no send waits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dxnet::{Config, Node, NodeId};

const MESSAGES: u64 = 100_000;

fn main() {
    let on = match std::env::args().nth(1).as_deref() {
        Some("on") => true,
        Some("off") | None => false,
        Some(other) => panic!("argument {other:?}: on or off"),
    };
    let config = |id| {
        let mut c = Config::loopback(id, 2, "send-cost");
        c.limits.orb_size = 32 << 20;
        c.limits.flow_control_window = 64 << 20;
        c.metrics.per_connection = on;
        c
    };
    let sender = Node::start(config(0)).expect("start node 0");
    let receiver = Node::start(config(1)).expect("start node 1");
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    receiver
        .register_raw(7, 1, move |_, _: &[u8]| {
            g.fetch_add(1, Ordering::Relaxed);
        })
        .expect("register");
    send_all(&sender, MESSAGES);
    while got.load(Ordering::Relaxed) < MESSAGES {
        std::thread::yield_now();
    }
    println!("{MESSAGES} messages sent and received (per-connection counting {on})");
}

/// The measured part (not inlined, so callgrind can collect just it).
#[inline(never)]
fn send_all(node: &Node, n: u64) {
    let payload = [5u8; 64];
    for _ in 0..n {
        node.send_raw(NodeId(1), 7, 1, &payload).expect("send");
    }
}
