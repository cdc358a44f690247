//! How long single sends wait when many threads share one connection
//! whose ring buffer and flow-control window are small: the spread between
//! the mean and the longest wait shows whether blocked senders are served
//! fairly (none overtaken without bound) or some wait many turns.
//!
//! Two nodes in this process over TCP loopback; `THREADS` sender threads on
//! node 0 each send `PER` messages of random sizes (64 B up to `MAX`
//! bytes) to node 1:
//!     cargo run --release --example send_waits -- [THREADS] [PER] [MAX] [BASE_PORT]
//! Defaults: 16 threads, 400 messages, 192 KiB, port 23300; 64 KiB ring,
//! 512 KiB window (the multi-process flow-control test's settings).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dxnet::{Config, Node, NodeId};

fn config(id: u16, base: u16) -> Config {
    let mut c = Config::tcp_localhost(id, 2, base);
    c.limits.orb_size = 64 << 10;
    c.limits.recv_buffer_size = Some(16 << 10);
    c.limits.flow_control_window = 512 << 10;
    c.limits.send_timeout_ms = 120_000;
    c
}

fn arg(i: usize, default: u64) -> u64 {
    std::env::args()
        .nth(i)
        .map_or(default, |a| a.parse().expect("numeric argument"))
}

fn main() {
    let threads = arg(1, 16) as usize;
    let per = arg(2, 400);
    let max = arg(3, 192 << 10) as usize;
    let base = arg(4, 23300) as u16;
    let receiver = Node::start(config(1, base)).expect("start node 1");
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    receiver
        .register_raw(12, 1, move |_, _| {
            g.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
    let sender = Node::start(config(0, base)).expect("start node 0");
    let payload = vec![7u8; max];
    let t0 = Instant::now();
    let mut waits: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (sender, payload) = (&sender, &payload);
                s.spawn(move || {
                    let mut rng = (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    let mut waits = Vec::with_capacity(per as usize);
                    for _ in 0..per {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let len = 64 + (rng % (max as u64 - 63)) as usize;
                        let t = Instant::now();
                        sender
                            .send_raw(NodeId(1), 12, 1, &payload[..len])
                            .expect("send");
                        waits.push(t.elapsed().as_micros() as u64);
                    }
                    waits
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let total = threads as u64 * per;
    let deadline = Instant::now() + Duration::from_secs(120);
    while got.load(Ordering::Relaxed) < total {
        assert!(Instant::now() < deadline, "messages lost");
        std::thread::sleep(Duration::from_millis(1));
    }
    let secs = t0.elapsed().as_secs_f64();
    waits.sort_unstable();
    let pct = |p: f64| waits[((waits.len() - 1) as f64 * p) as usize];
    let mean = waits.iter().sum::<u64>() as f64 / waits.len() as f64;
    let max_wait = *waits.last().unwrap();
    println!(
        "threads={threads} messages={total} rate={:.0}/s send wait µs: mean={mean:.0} p50={} p99={} p99.9={} max={max_wait} max/mean={:.1}",
        total as f64 / secs,
        pct(0.5),
        pct(0.99),
        pct(0.999),
        max_wait as f64 / mean.max(1.0),
    );
    sender.shutdown();
    receiver.shutdown();
}
