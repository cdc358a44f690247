//! Shared pieces of the shuffle tests: nodes of a cluster, and a whole
//! shuffle run whose every record is checked.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dxnet::{Config, Node, NodeId, TransportKind};
use dxshuffle::{Mode, Shuffle, ShuffleConfig};

/// A node on the RDMA device of `RDMA_DEV` (connection exchange over UDP
/// on the TCP node map's addresses).
fn ib_config(id: u16, n: u16, base: u16) -> Config {
    let mut c = Config::tcp_localhost(id, n, base);
    c.transport = TransportKind::Ib;
    c.ib.device = std::env::var("RDMA_DEV").unwrap_or_default();
    c.ib.gid_index = std::env::var("RDMA_GID_INDEX")
        .ok()
        .and_then(|g| g.parse().ok())
        .unwrap_or(0);
    c.limits.orb_size = 1 << 20;
    c.limits.recv_buffer_size = Some(16 << 10);
    c.limits.recv_pool_size = Some(256);
    c.limits.connect_timeout_ms = 3000;
    // Soft-RoCE under CPU emulation is slow at times.
    c.limits.send_timeout_ms = 60_000;
    c.limits.request_timeout_ms = 60_000;
    c
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Loopback,
    Tcp,
    /// InfiniBand/RoCE on the device in `RDMA_DEV` (the Soft-RoCE VM).
    Ib,
}

/// A base port for `n` nodes, in 15000..32000: below the kernel's
/// ephemeral range (32768 up), where any outgoing connection could take a
/// port between a test's bind check and its node's listen.
fn base_port(n: u16) -> u16 {
    const LOW: u16 = 15_000;
    const HIGH: u16 = 32_000;
    static NEXT: AtomicU16 = AtomicU16::new(0);
    if NEXT.load(Ordering::SeqCst) == 0 {
        let seed = LOW + (std::process::id() % 800) as u16 * 20;
        let _ = NEXT.compare_exchange(0, seed, Ordering::SeqCst, Ordering::SeqCst);
    }
    loop {
        let p = NEXT.fetch_add(n + 1, Ordering::SeqCst);
        if p + n >= HIGH {
            let _ = NEXT.compare_exchange(p + n + 1, LOW, Ordering::SeqCst, Ordering::SeqCst);
            continue;
        }
        if (0..n).all(|i| std::net::TcpListener::bind(("127.0.0.1", p + i)).is_ok()) {
            return p;
        }
    }
}

pub fn nodes(kind: Kind, n: u16) -> Vec<Arc<Node>> {
    nodes_with(kind, n, |_| {})
}

/// [`nodes`] with each configuration changed by `tweak`.
pub fn nodes_with(kind: Kind, n: u16, tweak: impl Fn(&mut Config)) -> Vec<Arc<Node>> {
    static FABRIC: AtomicU64 = AtomicU64::new(0);
    let fabric = format!("shuffle-{}", FABRIC.fetch_add(1, Ordering::SeqCst));
    let base = if kind == Kind::Loopback {
        0
    } else {
        base_port(n)
    };
    (0..n)
        .map(|i| {
            let mut c = match kind {
                Kind::Loopback => Config::loopback(i, n, &fabric),
                Kind::Tcp => Config::tcp_localhost(i, n, base),
                Kind::Ib => ib_config(i, n, base),
            };
            // 2-core machine: idle threads must not hog it.
            c.park.spin_us = 20;
            c.park.yield_us = 200;
            tweak(&mut c);
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

pub struct Case {
    pub kind: Kind,
    pub mode: Mode,
    pub procs: u16,
    pub threads: usize,
    pub segment: usize,
    pub batch: usize,
    /// Records each worker pushes.
    pub per_worker: u64,
}

/// Runs a whole shuffle and checks every record arrived exactly once,
/// intact and in per-pusher order.
pub fn run(case: Case) {
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
                            // Half the pullers borrow each record's bytes.
                            let lend = t % 2 == 1;
                            loop {
                                let (r_from, raw) = if lend {
                                    match puller.next_with(|f, b| (f, b.to_vec())).unwrap() {
                                        Some(x) => x,
                                        None => break,
                                    }
                                } else {
                                    match puller.next() {
                                        Some(r) => {
                                            let r = r.unwrap();
                                            (r.from, r.into_bytes())
                                        }
                                        None => break,
                                    }
                                };
                                let bytes = match raw[0] {
                                    RAW => raw[1..].to_vec(),
                                    _ => {
                                        let (m, b) =
                                            dxnet::proto::codec::decode::<(u8, Vec<u8>)>(&raw)
                                                .unwrap();
                                        assert_eq!(m, SERDE);
                                        b
                                    }
                                };
                                let from = u32::from_le_bytes(bytes[..4].try_into().unwrap());
                                assert_eq!(from as usize, r_from, "sender");
                                let seq = u64::from_le_bytes(bytes[4..12].try_into().unwrap());
                                let want = next_seq.entry(r_from).or_insert(0);
                                assert_eq!(seq, *want, "worker {me}: order from {r_from}");
                                *want += 1;
                                assert!(
                                    bytes == record(r_from, me, seq, bytes.len() - 12),
                                    "worker {me}: record {seq} from {r_from} damaged"
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
