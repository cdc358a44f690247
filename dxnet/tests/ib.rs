//! The InfiniBand/RoCE engine on a real verbs device. These tests run where
//! an RDMA device exists (`RDMA_DEV` set, as inside the Soft-RoCE VM of
//! `scripts/test-ib.sh`); elsewhere they print that they were skipped.
//!
//! Nodes are separate processes (this binary re-run as `child_ib_node`):
//! random sizes from 1 byte to several MiB, many sender threads, all-to-all,
//! requests, a slow receiver, and a node killed and restarted.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::proc::*;
use common::*;
use dxnet::{Config, Error, Node, NodeId, TransportKind};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Ping(u64);
#[derive(Serialize, Deserialize, Debug)]
struct Pong(u64);
dxnet::message!(Pong, 13, 2);
dxnet::request!(Ping, 13, 1 => Pong);

/// Logs to stderr when RUST_LOG is set.
fn init_log() {
    if std::env::var("RUST_LOG").is_ok() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
}

fn device() -> Option<String> {
    init_log();
    let d = std::env::var("RDMA_DEV").ok();
    if d.is_none() {
        println!("skipped: no RDMA device (RDMA_DEV unset); run scripts/test-ib.sh");
    }
    d
}

fn ib_config(id: u16, n: u16, base: u16) -> Config {
    let mut c = Config::tcp_localhost(id, n, base); // UDP handshakes on these addresses
    c.transport = TransportKind::Ib;
    c.ib.device = std::env::var("RDMA_DEV").unwrap_or_default();
    c.ib.gid_index = std::env::var("RDMA_GID_INDEX")
        .ok()
        .and_then(|g| g.parse().ok())
        .unwrap_or(0);
    c.limits.orb_size = 1 << 20;
    c.limits.recv_buffer_size = Some(16 << 10);
    c.limits.recv_pool_size = Some(256);
    c.limits.flow_control_window = 1 << 20;
    c.limits.connect_timeout_ms = 3000;
    // Soft-RoCE under software emulation moves a few MB/s at times (and
    // retransmits after 67 ms ACK timeouts): multi-MiB messages need time.
    c.limits.send_timeout_ms = 60_000;
    c.limits.request_timeout_ms = 60_000;
    c.cluster_secret = Some("ib test".into());
    // Every IB test also signs its connection handshakes (identity keys).
    with_test_identities(&mut c);
    c.park.spin_us = 20;
    c.park.yield_us = 200;
    // Both receive layouts: several buffers per receive work request (and
    // so sends sliced at 4 × 16 KiB) in the 4-node tests, one in the others.
    c.ib.sges_per_recv = if n >= 4 { 4 } else { 1 };
    c
}

#[test]
fn child_ib_node() {
    if !is_child() {
        return;
    }
    init_log();
    let id: u16 = env_parse("NODE");
    let n: u16 = env_parse("NODES");
    let threads: u16 = env_parse("THREADS");
    let per: u64 = env_parse("PER");
    let max: usize = env_parse("MAX");
    let reqs: u64 = env_parse("REQS");
    let slow_us: u64 = env_parse("SLOW_US");
    let node = Arc::new(Node::start(ib_config(id, n, env_parse("BASE"))).unwrap());
    let chk = Arc::new(Checker::default());
    let c = chk.clone();
    node.register(move |src, m: Data| {
        if slow_us > 0 {
            std::thread::sleep(Duration::from_micros(slow_us));
        }
        c.check(src, &m)
    })
    .unwrap();
    node.register_request(|_, p: Ping| Pong(p.0 * 2)).unwrap();
    let steps: u64 = env_parse("STEPS");
    let step_log = register_step_log(&node);
    let done = register_done(&node);
    let peers: Vec<u16> = (0..n).filter(|&p| p != id).collect();
    for &p in &peers {
        until_reachable("ping", || {
            node.request(NodeId(p), &Ping(1), Duration::from_secs(3))
        });
    }
    let senders = if slow_us > 0 && id == 0 { 0 } else { threads };
    std::thread::scope(|s| {
        for t in 0..senders {
            let node = node.clone();
            let peers = &peers;
            s.spawn(move || {
                send_checked(&node, t, per * peers.len() as u64, max, |i| {
                    peers[(i % peers.len() as u64) as usize]
                })
            });
        }
        // Requests and messages of one thread in send order (standalone
        // frames beside the ring buffer).
        for t in 0..if steps > 0 { 3 } else { 0 } {
            let node = node.clone();
            let peers = &peers;
            s.spawn(move || {
                for &p in peers {
                    send_steps(&node, NodeId(p), t, steps, 40_000);
                }
            });
        }
        // Many requests outstanding at once.
        if reqs > 0 {
            let node = node.clone();
            let peers = &peers;
            s.spawn(move || {
                let hs: Vec<_> = (0..reqs)
                    .map(|i| {
                        let p = peers[(i % peers.len() as u64) as usize];
                        (
                            i,
                            node.request_async(NodeId(p), &Ping(i), Duration::from_secs(60))
                                .unwrap(),
                        )
                    })
                    .collect();
                for (i, h) in hs {
                    assert_eq!(h.wait().unwrap().0, 2 * i);
                }
            });
        }
    });
    let expect = if slow_us > 0 {
        if id == 0 {
            per * threads as u64
        } else {
            0
        }
    } else {
        per * threads as u64 * (n as u64 - 1)
    };
    wait_for(300, "all messages", || {
        chk.received.load(Ordering::SeqCst) >= expect
    });
    chk.assert_ok();
    for &p in &peers {
        wait_for(300, "all steps", || step_log.complete(p, 3, steps));
        step_log.assert_in_order(p, 3, steps);
    }
    end_barrier(&node, &peers, &done);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(chk.received.load(Ordering::SeqCst), expect, "no duplicates");
    println!("CHILD OK received={expect} hwm_kib={}", hwm_kib());
}

/// Runs test `name` as a child process with `vars` and the RDMA device
/// settings of this process.
fn spawn_ib_child(name: &str, vars: &[(&str, String)]) -> ChildProc {
    let mut all = vars.to_vec();
    for k in ["RDMA_DEV", "RDMA_GID_INDEX"] {
        all.push((k, std::env::var(k).unwrap_or_default()));
    }
    spawn_child(name, &all)
}

fn run(
    n: u16,
    threads: u16,
    per: u64,
    max: usize,
    reqs: u64,
    slow_us: u64,
    steps: u64,
) -> Vec<String> {
    let base = base_port(n);
    let kids: Vec<_> = (0..n)
        .map(|id| {
            spawn_ib_child(
                "child_ib_node",
                &[
                    ("NODE", id.to_string()),
                    ("NODES", n.to_string()),
                    ("BASE", base.to_string()),
                    ("THREADS", threads.to_string()),
                    ("PER", per.to_string()),
                    ("MAX", max.to_string()),
                    ("REQS", reqs.to_string()),
                    ("SLOW_US", slow_us.to_string()),
                    ("STEPS", steps.to_string()),
                ],
            )
        })
        .collect();
    kids.into_iter().map(|k| wait_child(k, 600)).collect()
}

#[test]
fn ib_two_nodes_random_sizes_up_to_mibs() {
    if device().is_none() {
        return;
    }
    // 1 B .. 3 MiB: larger than the 1 MiB ring and the 64 KiB receive size.
    for out in run(2, 2, 20, 3 << 20, 0, 0, 0) {
        assert!(out.contains("CHILD OK received=40"), "{out}");
    }
}

#[test]
fn ib_two_nodes_sixteen_threads_and_requests() {
    if device().is_none() {
        return;
    }
    for out in run(2, 16, 30, 8 << 10, 2000, 0, 1500) {
        assert!(out.contains("CHILD OK received=480"), "{out}");
    }
}

#[test]
fn ib_four_nodes_all_to_all() {
    if device().is_none() {
        return;
    }
    for out in run(4, 2, 30, 64 << 10, 200, 0, 0) {
        assert!(out.contains("CHILD OK received=180"), "{out}");
    }
}

#[test]
fn ib_slow_receiver_stays_bounded() {
    if device().is_none() {
        return;
    }
    // Node 1 sends 4 threads × 300 messages of up to 64 KiB to node 0,
    // which handles each slowly; flow control bounds node 0's memory.
    let outs = run(2, 4, 300, 64 << 10, 0, 300, 0);
    assert!(outs[1].contains("CHILD OK received=0"), "{}", outs[1]);
    assert!(outs[0].contains("CHILD OK received=1200"), "{}", outs[0]);
}

#[test]
fn child_ib_echo() {
    if !is_child() {
        return;
    }
    init_log();
    let node = Node::start(ib_config(1, 2, env_parse("BASE"))).unwrap();
    node.register_request(|_, p: Ping| Pong(p.0 * 2)).unwrap();
    println!("READY");
    read_command("exit");
}

#[test]
fn ib_node_killed_and_restarted() {
    if device().is_none() {
        return;
    }
    let base = base_port(2);
    let vars = [("BASE", base.to_string())];
    let mut cfg = ib_config(0, 2, base);
    cfg.limits.request_timeout_ms = 3000;
    cfg.limits.send_timeout_ms = 3000;
    let a = Node::start(cfg).unwrap();
    let mut b = spawn_ib_child("child_ib_echo", &vars);
    b.wait_line("READY", 60);
    assert_eq!(
        until_reachable("first", || a.request(
            NodeId(1),
            &Ping(1),
            Duration::from_secs(3)
        ))
        .0,
        2
    );
    b.kill9();
    // Requests to the dead node fail cleanly (unreachable or timeout), never hang.
    let t0 = Instant::now();
    let mut saw_unreachable = false;
    while t0.elapsed() < Duration::from_secs(30) {
        match a.request(NodeId(1), &Ping(2), Duration::from_secs(2)) {
            Err(Error::Unreachable(..)) => {
                saw_unreachable = true;
                break;
            }
            Err(Error::Timeout(_)) => {}
            other => panic!("request to a killed node: {other:?}"),
        }
    }
    assert!(saw_unreachable, "the broken queue pair was detected");
    println!("unreachable after {:?}", t0.elapsed());
    // Restarted with the same id: a new instance; the node reconnects.
    let mut b = spawn_ib_child("child_ib_echo", &vars);
    b.wait_line("READY", 60);
    assert_eq!(
        until_reachable("after restart", || a.request(
            NodeId(1),
            &Ping(3),
            Duration::from_secs(3)
        ))
        .0,
        6
    );
    b.command("exit");
    wait_child(b, 30);
}

/// Node 0 of the flood test: a receiver with slow message handlers, small
/// incoming limits and a window far larger than them (so flow control does
/// not hold the flooding peer back: only the incoming limits do).
fn flood_receiver_config(base: u16) -> Config {
    let mut c = ib_config(0, 3, base);
    c.limits.incoming_max_buffers = 16;
    c.limits.incoming_max_bytes = 16 * c.recv_buffer_size();
    c.limits.flow_control_window = 8 << 20;
    c.ib.srq_size = 32;
    c
}

#[test]
fn child_ib_flood() {
    if !is_child() {
        return;
    }
    init_log();
    let id: u16 = env_parse("NODE");
    let base: u16 = env_parse("BASE");
    let threads: u16 = env_parse("THREADS");
    let per: u64 = env_parse("PER");
    let reqs: u64 = env_parse("REQS");
    let cfg = if id == 0 {
        flood_receiver_config(base)
    } else {
        ib_config(id, 3, base)
    };
    let node = Arc::new(Node::start(cfg).unwrap());
    let chk = Arc::new(Checker::default());
    let c = chk.clone();
    node.register(move |src, m: Data| {
        std::thread::sleep(Duration::from_micros(500));
        c.check(src, &m)
    })
    .unwrap();
    node.register_request(|_, p: Ping| Pong(p.0 * 2)).unwrap();
    let done = register_done(&node);
    let peers: Vec<u16> = (0..3).filter(|&p| p != id).collect();
    if id != 0 {
        until_reachable("ping", || {
            node.request(NodeId(0), &Ping(1), Duration::from_secs(3))
        });
    }
    match id {
        0 => {
            let expect = per * threads as u64;
            wait_for(600, "the flood", || {
                chk.received.load(Ordering::SeqCst) >= expect
            });
            chk.assert_ok();
        }
        1 => std::thread::scope(|s| {
            for t in 0..threads {
                let node = node.clone();
                s.spawn(move || send_checked(&node, t, per, 16 << 10, |_| 0));
            }
        }),
        _ => {
            // Requests while node 1 floods node 0: each must be answered.
            for i in 0..reqs {
                let r = node.request(NodeId(0), &Ping(i), Duration::from_secs(60));
                assert_eq!(r.unwrap().0, 2 * i, "request {i}");
            }
        }
    }
    end_barrier(&node, &peers, &done);
    let st = node.stats();
    println!(
        "CHILD OK received={} requests={reqs} peak_buffers={}",
        chk.received.load(Ordering::SeqCst),
        st.incoming_peak_buffers
    );
}

/// One peer floods a node whose handlers are slow while another peer sends
/// it requests: the requests are answered, and the node queues no more
/// received buffers than its incoming limit plus the receives it posts.
#[test]
fn ib_flooding_peer_stays_within_incoming_limits() {
    if device().is_none() {
        return;
    }
    let base = base_port(3);
    let (threads, per, reqs) = (4u16, 400u64, 100u64);
    let kids: Vec<_> = (0..3u16)
        .map(|id| {
            spawn_ib_child(
                "child_ib_flood",
                &[
                    ("NODE", id.to_string()),
                    ("BASE", base.to_string()),
                    ("THREADS", threads.to_string()),
                    ("PER", per.to_string()),
                    ("REQS", reqs.to_string()),
                ],
            )
        })
        .collect();
    let outs: Vec<String> = kids.into_iter().map(|k| wait_child(k, 600)).collect();
    let expect = format!("CHILD OK received={}", threads as u64 * per);
    assert!(outs[0].contains(&expect), "{}", outs[0]);
    assert!(outs[2].contains(&format!("requests={reqs}")), "{}", outs[2]);
    let peak: u64 = outs[0]
        .split("peak_buffers=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no peak in {}", outs[0]));
    let cfg = flood_receiver_config(base);
    let bound = cfg.limits.incoming_max_buffers as u64 + cfg.ib.srq_size as u64;
    println!("node 0 queued at most {peak} buffers (bound {bound})");
    assert!(
        peak <= bound,
        "node 0 queued {peak} buffers, more than its incoming limit and posted receives ({bound})"
    );
}

/// Datagrams anyone can send to the handshake port: random bytes, headers
/// of real node pairs with guessed sessions carrying hellos, finals and
/// junk, and close notices without the secret. None of them may stop a
/// connection from being set up at the first attempt or close it.
#[test]
fn ib_forged_handshake_datagrams_do_not_disturb_connections() {
    use dxnet::proto::wire::{
        CloseNotice, DatagramHeader, HandshakeMsg, Hello, Status, ENDPOINT_LEN,
    };
    use std::sync::atomic::{AtomicBool, AtomicU64};
    if device().is_none() {
        return;
    }
    let base = base_port(2);
    let vars = [("BASE", base.to_string())];
    let a = Node::start(ib_config(0, 2, base)).unwrap();
    let mut b = spawn_ib_child("child_ib_echo", &vars);
    b.wait_line("READY", 60);

    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let spammer = {
        let (stop, sent) = (stop.clone(), sent.clone());
        std::thread::spawn(move || {
            let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let to = |id: u16| format!("127.0.0.1:{}", base + id);
            let mut rng = Rng::new(1);
            let mut next = move || rng.next_u64();
            while !stop.load(Ordering::Acquire) {
                let r = next();
                let session = next().to_le_bytes();
                let hello = Hello {
                    node_id: 0,
                    target_id: 1,
                    instance: r | 1,
                    fc_window: 1 << 20,
                    fc_unit: 1 << 16,
                    nonce: [r as u8; 16],
                    codec: dxnet::proto::codec::CODEC_ID,
                    endpoint: [7; ENDPOINT_LEN],
                };
                let msg = match r % 4 {
                    0 => HandshakeMsg::Hello(hello),
                    1 => HandshakeMsg::Final(Status::AuthFailed),
                    2 => HandshakeMsg::Final(Status::Duplicate),
                    _ => HandshakeMsg::Reply(
                        Hello {
                            node_id: 1,
                            ..hello
                        },
                        [1; 32],
                    ),
                };
                // To node 1 as node 0's dial, and to node 0 as node 1's
                // answer to it.
                for (to_acceptor, dst) in [(true, 1), (false, 0)] {
                    let mut d = DatagramHeader {
                        dialer: 0,
                        acceptor: 1,
                        to_acceptor,
                        session,
                    }
                    .encode()
                    .to_vec();
                    d.extend_from_slice(&msg.encode());
                    let _ = udp.send_to(&d, to(dst));
                }
                let notice = CloseNotice {
                    src: 1,
                    dst: 0,
                    src_endpoint: [r as u8; ENDPOINT_LEN],
                    dst_endpoint: [(r >> 8) as u8; ENDPOINT_LEN],
                };
                let _ = udp.send_to(&notice.encode(Some(b"not the secret"), None), to(0));
                let junk: Vec<u8> = (0..(r % 300) as usize).map(|_| next() as u8).collect();
                let _ = udp.send_to(&junk, to((r >> 16) as u16 % 2));
                sent.fetch_add(4, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    // The first request opens the connection while the forgeries fly.
    let t0 = Instant::now();
    let pong = a
        .request(NodeId(1), &Ping(1), Duration::from_secs(10))
        .expect("connection set up despite forged datagrams");
    assert_eq!(pong.0, 2);
    println!("connected after {:?}", t0.elapsed());
    for i in 0..300u64 {
        let p = a
            .request(NodeId(1), &Ping(i), Duration::from_secs(10))
            .expect("connection kept");
        assert_eq!(p.0, 2 * i);
    }
    stop.store(true, Ordering::Release);
    spammer.join().unwrap();
    println!("{} forged datagrams sent", sent.load(Ordering::Relaxed));
    assert_eq!(
        a.stats().connections_closed,
        0,
        "nothing closed a connection"
    );
    b.command("exit");
    wait_child(b, 30);
}

/// The owner of two regions for `ib_one_sided_*`: 16 MiB read-write and
/// 64 KiB read-only; checks every write notification against the pattern
/// the writer used; answers `sum`, `notes`, `revoke` and `quit`.
#[test]
fn child_ib_region_owner() {
    if !is_child() {
        return;
    }
    let base: u16 = env_parse("BASE");
    let node = Node::start(ib_config(0, 2, base)).unwrap();
    let rw = Arc::new(node.expose(16 << 20, dxnet::Access::ReadWrite).unwrap());
    let ro = node.expose(64 << 10, dxnet::Access::ReadOnly).unwrap();
    ro.write(0, &one_sided_pattern(7, 0, 64 << 10)).unwrap();
    let notes = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let bad = Arc::new(std::sync::atomic::AtomicU64::new(0));
    {
        let (rw, notes, bad) = (rw.clone(), notes.clone(), bad.clone());
        node.on_region_write(move |w| {
            let mut got = vec![0u8; w.len as usize];
            rw.read(w.offset as usize, &mut got).unwrap();
            if got != one_sided_pattern(9, w.imm as u64, w.len as usize) {
                bad.fetch_add(1, Ordering::Relaxed);
            }
            notes.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
    }
    println!("RW {}", serde_json::to_string(&rw.descriptor()).unwrap());
    println!("RO {}", serde_json::to_string(&ro.descriptor()).unwrap());
    let mut ro = Some(ro);
    loop {
        match next_command().as_str() {
            "sum" => println!("SUM {}", fnv(&rw.to_vec())),
            "notes" => println!(
                "NOTES {} {}",
                notes.load(Ordering::Relaxed),
                bad.load(Ordering::Relaxed)
            ),
            "revoke" => {
                ro.take();
                println!("REVOKED");
            }
            _ => return,
        }
    }
}

/// Starts `child_ib_region_owner` as node 0 of a pair at `base`; returns
/// it with its read-write and read-only regions' descriptors.
fn spawn_region_owner(base: u16) -> (ChildProc, dxnet::RemoteRegion, dxnet::RemoteRegion) {
    let mut owner = spawn_ib_child("child_ib_region_owner", &[("BASE", base.to_string())]);
    let rw_line = owner.wait_line("RW ", 60);
    let ro_line = owner.wait_line("RO ", 60);
    let rw = serde_json::from_str(&rw_line[3..]).unwrap();
    let ro = serde_json::from_str(&ro_line[3..]).unwrap();
    (owner, rw, ro)
}

/// Waits until the region owner counted `expect` write notifications
/// (within 60 s; more is a failure).
fn wait_notes(owner: &mut ChildProc, expect: u64) {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let mark = owner.mark();
        owner.command("notes");
        let notes = owner.wait_line_since(mark, "NOTES ", 60);
        let n: u64 = notes.split(' ').nth(1).unwrap().parse().unwrap();
        if n == expect {
            return;
        }
        assert!(
            Instant::now() < end && n < expect,
            "{notes}, {expect} expected"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn one_sided_pattern(seed: u64, i: u64, len: usize) -> Vec<u8> {
    pattern(seed as u16, 0, i, len)
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// One-sided operations on real RDMA WRITE/READ: the descriptors carry
/// remote keys; 8 threads write and read random ranges (1 B to 1 MiB,
/// blocking and async) and the owner's bytes match; writes with
/// notification arrive after their data; rights and bounds are refused
/// before anything is posted; a read from a revoked region and one with a
/// forged descriptor fail with `Revoked` and the connection comes back; a
/// killed owner ends every access in flight with a typed error.
#[test]
fn ib_one_sided_write_read_notify_revoke_kill() {
    use dxnet::{RegionError, RemoteRegion};
    if device().is_none() {
        return;
    }
    let base = base_port(2);
    let (mut owner, rw, ro) = spawn_region_owner(base);
    let json = serde_json::to_value(rw).unwrap();
    assert!(!json["rdma"].is_null(), "no remote key: {json}");
    let mut cfg = ib_config(1, 2, base);
    cfg.limits.request_timeout_ms = 15_000;
    // Few staging slots: reads of up to 16 parts from 8 threads share 8
    // of them, and they must come back whether or not anyone waits.
    cfg.ib.staging_slots = 8;
    let node = Arc::new(Node::start(cfg).unwrap());
    until_reachable("owner", || node.read(&rw, 0, &mut [0u8; 1]));

    // Random ranges, every byte read back; the owner's view at the end.
    const SLICE: usize = 2 << 20;
    let shadows: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8u64)
            .map(|t| {
                let node = node.clone();
                s.spawn(move || {
                    let base = t as usize * SLICE;
                    let mut shadow = vec![0u8; SLICE];
                    let mut rng = Rng::new(t);
                    let mut next = move || rng.next_u64();
                    for i in 0..30u64 {
                        let len = match next() % 6 {
                            0 => 1,
                            1 => 1 + (next() % (1 << 20)) as usize,
                            _ => 1 + (next() % 9000) as usize,
                        };
                        let off = (next() % (SLICE - len + 1) as u64) as usize;
                        let data = pattern(t as u16, 1, i, len);
                        if i % 3 == 0 {
                            node.write_async(&rw, (base + off) as u64, &data)
                                .unwrap()
                                .wait()
                                .unwrap();
                        } else {
                            node.write(&rw, (base + off) as u64, &data).unwrap();
                        }
                        shadow[off..off + len].copy_from_slice(&data);
                        let back = if i % 2 == 0 {
                            node.read_async(&rw, (base + off) as u64, len)
                                .unwrap()
                                .wait()
                                .unwrap()
                        } else {
                            let mut b = vec![0u8; len];
                            node.read(&rw, (base + off) as u64, &mut b).unwrap();
                            b
                        };
                        assert!(back == data, "thread {t} op {i}: {len} B at {off}");
                    }
                    shadow
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mark = owner.mark();
    owner.command("sum");
    assert_eq!(
        owner.wait_line_since(mark, "SUM ", 60),
        format!("SUM {}", fnv(&shadows.concat()))
    );

    // Writes with notification: the owner checks each one's data.
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let node = node.clone();
            s.spawn(move || {
                for i in 0..25u64 {
                    let imm = t * 1000 + i;
                    let len = 1 + (imm as usize * 7919) % 160_000;
                    let d = one_sided_pattern(9, imm, len);
                    // Each to bytes of its own: a later write may land
                    // before the owner's receiver of an earlier one runs.
                    let at = t * (4 << 20) + i * 160_000;
                    node.write_with_notify(&rw, at, &d, imm as u32).unwrap();
                }
            });
        }
    });
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let mark = owner.mark();
        owner.command("notes");
        let notes = owner.wait_line_since(mark, "NOTES ", 60);
        if notes == "NOTES 100 0" {
            break;
        }
        assert!(Instant::now() < end && notes.ends_with(" 0"), "{notes}");
        std::thread::sleep(Duration::from_millis(20));
    }

    // Accesses dropped without waiting (and a window of them in flight):
    // their staging slots come back, the connection stays open, and later
    // accesses see the dropped writes in place.
    let closed = node.stats().connections_closed;
    let at = 12u64 << 20;
    for i in 0..200u64 {
        drop(node.read_async(&rw, at, 64 << 10).unwrap());
        drop(
            node.write_async(&rw, at + (i % 8) * 300, &[i as u8; 300])
                .unwrap(),
        );
        drop(
            node.write_async(&rw, at + (1 << 20), &one_sided_pattern(5, i, 70_000))
                .unwrap(),
        );
    }
    let mut window = std::collections::VecDeque::new();
    for i in 0..64u64 {
        window.push_back(node.read_async(&rw, at + (2 << 20), 100_000).unwrap());
        if i % 4 == 3 {
            window.pop_front().unwrap().wait().unwrap();
        }
    }
    drop(window);
    let mut back = vec![0u8; 8 * 300];
    node.read(&rw, at, &mut back).unwrap();
    for k in 0..8u64 {
        let last = 192 + k; // the last write to bytes k*300..
        assert!(back[k as usize * 300..][..300]
            .iter()
            .all(|&b| b == last as u8));
    }
    let mut big = vec![0u8; 70_000];
    node.read(&rw, at + (1 << 20), &mut big).unwrap();
    assert_eq!(big, one_sided_pattern(5, 199, 70_000));
    assert_eq!(
        node.stats().connections_closed,
        closed,
        "no connection closed"
    );

    // Refused before posting.
    let region_err = |r: dxnet::Result<()>| match r {
        Err(Error::Region(e)) => e,
        other => panic!("expected a region error, got {other:?}"),
    };
    assert_eq!(
        region_err(node.write(&ro, 0, b"x")),
        RegionError::WriteNotPermitted
    );
    assert!(matches!(
        region_err(node.read(&ro, 60 << 10, &mut [0; 8 << 10])),
        RegionError::OutOfBounds { .. }
    ));
    let mut got = vec![0u8; 4096];
    node.read(&ro, 100, &mut got).unwrap();
    assert_eq!(got, one_sided_pattern(7, 0, 64 << 10)[100..4196]);
    // Refused by the device: a descriptor claiming write access.
    let mut forged = serde_json::to_value(ro).unwrap();
    forged["access"] = "ReadWrite".into();
    let forged: RemoteRegion = serde_json::from_value(forged).unwrap();
    assert_eq!(
        region_err(node.write(&forged, 0, &[1; 300])),
        RegionError::Revoked
    );
    // The connection comes back for the next access.
    until_reachable("owner after a refused access", || {
        node.read(&ro, 0, &mut got)
    });
    owner.command("revoke");
    owner.wait_line("REVOKED", 60);
    assert_eq!(
        region_err(node.read(&ro, 0, &mut got)),
        RegionError::Revoked
    );
    until_reachable("owner after a revoked region", || {
        node.write(&rw, 0, b"still here")
    });

    // The owner dies during accesses: each ends with a typed error.
    let failures = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let node = node.clone();
            let failures = &failures;
            s.spawn(move || {
                let mut buf = vec![3u8; 1 << 20];
                loop {
                    let r = if t % 2 == 0 {
                        node.write(&rw, t << 20, &buf)
                    } else {
                        node.read(&rw, t << 20, &mut buf)
                    };
                    if let Err(e) = r {
                        assert!(
                            matches!(e, Error::Unreachable(..) | Error::Timeout(_)),
                            "thread {t}: {e:?}"
                        );
                        failures.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
            });
        }
        std::thread::sleep(Duration::from_millis(500));
        owner.kill9();
    });
    assert_eq!(failures.load(Ordering::Relaxed), 4);
}

/// In-place accesses on real RDMA: 8 threads write from and read into
/// slices of a registered own region (`write_from`, `read_into`, async,
/// with notification), every byte checked at both ends; a source region
/// dropped while its write is in flight still gives its bytes (the access
/// keeps the memory), a destination dropped before its read completes
/// costs nothing; accesses from own memory and the copying ones share the
/// connection without closing it.
#[test]
fn ib_in_place_write_read() {
    if device().is_none() {
        return;
    }
    let base = base_port(2);
    let (mut owner, rw, _) = spawn_region_owner(base);
    let mut cfg = ib_config(1, 2, base);
    cfg.limits.request_timeout_ms = 15_000;
    let node = Arc::new(Node::start(cfg).unwrap());
    until_reachable("owner", || node.read(&rw, 0, &mut [0u8; 1]));
    assert!(
        node.writes_from_region_in_place(),
        "the device reads regions"
    );
    const SLICE: usize = 2 << 20;
    const THREADS: u64 = 8;
    const OPS: u64 = 24;
    let local = node
        .expose(THREADS as usize * SLICE, dxnet::Access::LocalOnly)
        .unwrap();
    let shadows: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (node, local) = (node.clone(), &local);
                let at = t as usize * SLICE;
                s.spawn(move || in_place_phase(&node, &rw, local, t, (at, at, SLICE), OPS))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mark = owner.mark();
    owner.command("sum");
    assert_eq!(
        owner.wait_line_since(mark, "SUM ", 60),
        format!("SUM {}", fnv(&shadows.concat()))
    );
    let expect = THREADS * (0..OPS).filter(|i| i % 3 == 2).count() as u64;
    wait_notes(&mut owner, expect);
    let closed = node.stats().connections_closed;
    for i in 0..20u64 {
        let src = node.expose(300_000, dxnet::Access::LocalOnly).unwrap();
        let data = one_sided_pattern(4, i, 300_000);
        src.write(0, &data).unwrap();
        let h = node
            .write_from_async(&rw, 1000, &src, 0, data.len())
            .unwrap();
        drop(src);
        h.wait().unwrap();
        let mut back = vec![0u8; data.len()];
        node.read(&rw, 1000, &mut back).unwrap();
        assert!(back == data, "round {i}: a dropped source's write");
        let dst = node.expose(300_000, dxnet::Access::LocalOnly).unwrap();
        let h = node.read_into_async(&rw, 1000, &dst, 0, 300_000).unwrap();
        drop(dst);
        if i % 2 == 0 {
            h.wait().unwrap();
        } else {
            drop(h);
        }
    }
    node.write(&rw, 0, b"still here").unwrap();
    assert_eq!(
        node.stats().connections_closed,
        closed,
        "no connection closed"
    );
}

/// `ib_config` for node `id` (0 or 1) that knows only its own address and
/// probes `seeds` (ports on 127.0.0.1) for the rest: discovery over the
/// engine's UDP handshake socket.
fn ib_seeded_config(id: u16, port: u16, seeds: &[u16]) -> Config {
    let mut c = ib_config(id, 0, 0);
    // The other node is listed by id and public key only (identities are
    // checked): its address is discovered.
    let other = 1 - id;
    c.nodes = vec![
        dxnet::config::NodeEntry::new(id, format!("127.0.0.1:{port}")),
        dxnet::config::NodeEntry::new(other, ""),
    ];
    with_test_identities(&mut c);
    c.cluster_secret = Some("ib-discovery".into());
    c.discovery = Some(dxnet::DiscoveryConfig::new(
        seeds.iter().map(|p| format!("127.0.0.1:{p}")).collect(),
        50,
    ));
    c
}

/// Node 1 of the discovery test: knows only itself and the seed (node 0).
#[test]
fn child_ib_seeded() {
    if !is_child() {
        return;
    }
    init_log();
    let base: u16 = env_parse("BASE");
    let node = Node::start(ib_seeded_config(1, base + 1, &[base])).unwrap();
    node.register_request(|_, p: Ping| Pong(p.0 * 2)).unwrap();
    node.wait_for_nodes(2, Duration::from_secs(60)).unwrap();
    let r = until_reachable("seed", || {
        node.request(NodeId(0), &Ping(5), Duration::from_secs(3))
    });
    assert_eq!(r.0, 6);
    println!("READY");
    read_command("exit");
}

#[test]
fn ib_discovery_finds_seeded_nodes_and_finds_a_restarted_one_again() {
    if device().is_none() {
        return;
    }
    let base = base_port(2);
    let vars = [("BASE", base.to_string())];
    let mut cfg = ib_seeded_config(0, base, &[]);
    cfg.limits.request_timeout_ms = 3000;
    // A killed peer is found by its sends' missing completions within
    // this (as in `ib_node_killed_and_restarted`).
    cfg.limits.send_timeout_ms = 3000;
    let a = Node::start(cfg).unwrap();
    a.register_request(|_, p: Ping| Pong(p.0 + 1)).unwrap();
    let events = a.connection_events(64).unwrap();
    let mut b = spawn_ib_child("child_ib_seeded", &vars);
    b.wait_line("READY", 60);
    assert_eq!(a.nodes(), vec![NodeId(0), NodeId(1)]);
    assert_eq!(
        a.request(NodeId(1), &Ping(1), Duration::from_secs(3))
            .unwrap()
            .0,
        2
    );
    // Forged and malformed discovery datagrams at the engine's socket are
    // ignored and counted.
    let ignored = a.stats().discovery_ignored;
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let forged = probe_from(1, 1, 0, "127.0.0.1:1".into());
    for d in [forged.encode(Some(b"wrong"), None), b"DXdp".to_vec()] {
        sock.send_to(&d, ("127.0.0.1", base)).unwrap();
    }
    wait_for(30, "forged datagrams counted", || {
        a.stats().discovery_ignored >= ignored + 2
    });
    b.kill9();
    // The lost node goes back to probing: undiscovered, then found again
    // when it restarts.
    wait_for(60, "node 1 undiscovered", || {
        let _ = a.request(NodeId(1), &Ping(2), Duration::from_secs(1));
        !a.nodes().contains(&NodeId(1))
    });
    let mut b = spawn_ib_child("child_ib_seeded", &vars);
    b.wait_line("READY", 60);
    a.wait_for_nodes(2, Duration::from_secs(30)).unwrap();
    assert_eq!(
        until_reachable("after restart", || a.request(
            NodeId(1),
            &Ping(3),
            Duration::from_secs(3)
        ))
        .0,
        6
    );
    b.command("exit");
    wait_child(b, 30);
    let evs: Vec<_> = std::iter::from_fn(|| events.try_recv().ok()).collect();
    let found = evs
        .iter()
        .filter(|e| **e == dxnet::events::ConnectionEvent::Discovered { node: NodeId(1) })
        .count();
    assert_eq!(found, 2, "{evs:?}");
}

/// Accesses from and into reused `Buffer`s over real RDMA: the zero-copy
/// policy registers buffers after a quarter of their threshold and the
/// device reads and fills them in place; under a pinned-memory limit far
/// below what the threads reuse, registrations are evicted and what does
/// not fit is copied. 8 threads change each buffer right after its access
/// returns, drop and replace buffers (their addresses reused) and check
/// every read-back; the owner's checksum matches; a buffer over the limit
/// is refused with a typed error and still written (copied); accesses
/// whose handles are dropped in flight close no connection.
#[test]
fn ib_buffers_zero_copy() {
    use dxnet::{Buffer, Error, RegionError};
    if device().is_none() {
        return;
    }
    let base = base_port(2);
    let (mut owner, rw, _) = spawn_region_owner(base);
    let mut cfg = ib_config(1, 2, base);
    cfg.limits.request_timeout_ms = 15_000;
    cfg.zero_copy.reuse_threshold = Some(8);
    cfg.zero_copy.max_pinned_bytes = 512 << 10;
    let node = Arc::new(Node::start(cfg).unwrap());
    until_reachable("owner", || node.read(&rw, 0, &mut [0u8; 1]));
    const SLICE: usize = 2 << 20;
    const THREADS: u64 = 8;
    const OPS: u64 = 40;
    let results: Vec<(Vec<u8>, u64)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let node = node.clone();
                s.spawn(move || buffer_phase(&node, &rw, t, (t as usize * SLICE, SLICE), OPS))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let shadows: Vec<u8> = results.iter().flat_map(|(s, _)| s.clone()).collect();
    let mark = owner.mark();
    owner.command("sum");
    assert_eq!(
        owner.wait_line_since(mark, "SUM ", 60),
        format!("SUM {}", fnv(&shadows[..]))
    );
    let expect: u64 = results.iter().map(|(_, n)| n).sum();
    wait_notes(&mut owner, expect);
    let st = node.stats();
    println!(
        "in place {} copied {} registrations {} failures {} evictions {} pinned {}",
        st.zero_copy_in_place,
        st.zero_copy_copied,
        st.buffer_registrations,
        st.buffer_registration_failures,
        st.buffer_evictions,
        st.pinned_bytes
    );
    assert!(
        st.zero_copy_in_place > THREADS * OPS,
        "most accesses in place"
    );
    assert!(st.zero_copy_copied > 0, "fresh buffers are copied");
    assert!(st.buffer_evictions > 0, "the limit evicts");
    assert!(st.pinned_bytes <= 512 << 10);
    // Over the limit: refused, and copied.
    let big = Buffer::from(one_sided_pattern(6, 1, 1 << 20));
    assert!(matches!(
        node.register_buffer(&big),
        Err(Error::Region(RegionError::Registration { len, .. })) if len == 1 << 20
    ));
    for _ in 0..10 {
        node.write_buffer(&rw, 0, &big).unwrap();
    }
    assert!(!big.is_registered());
    let mut back = Buffer::new(1 << 20);
    node.read_buffer(&rw, 0, &mut back).unwrap();
    assert!(back[..] == big[..]);
    // Handles dropped while their accesses run.
    let closed = node.stats().connections_closed;
    let mut pool: Vec<Buffer> = (0..4).map(|_| Buffer::new(64 << 10)).collect();
    for i in 0..40u64 {
        let k = (i % 4) as usize;
        let b = std::mem::replace(&mut pool[k], Buffer::new(64 << 10));
        if i % 2 == 0 {
            drop(node.write_buffer_async(&rw, 4096, b));
        } else {
            drop(node.read_buffer_async(&rw, 4096, b));
        }
    }
    let mut last = Buffer::from(b"after the drops".to_vec());
    node.write_buffer(&rw, 0, &last).unwrap();
    last.fill(0);
    node.read_buffer(&rw, 0, &mut last).unwrap();
    assert_eq!(&last[..], b"after the drops");
    assert_eq!(
        node.stats().connections_closed,
        closed,
        "no connection closed"
    );
}

/// Messages from reused buffers sent in place over real RDMA
/// (`send_buffer`: header and payload gathered by one work request, behind
/// the ring's data), mixed with ring messages: 16 threads, payloads up to
/// 100 KB (several receives), every buffer overwritten as soon as its send
/// returns; each message arrives once, intact, in per-thread order; most
/// sends went in place.
#[test]
fn ib_buffer_messages_in_place() {
    if device().is_none() {
        return;
    }
    let base = base_port(2);
    let mut cfg = ib_config(1, 2, base);
    cfg.zero_copy.reuse_threshold = Some(4);
    let a = Node::start(ib_config(0, 2, base)).unwrap();
    let b = Arc::new(Node::start(cfg).unwrap());
    let log = BufferSendLog::register(&a);
    until_reachable("node 0", || b.send_raw(NodeId(0), 62, 0, b""));
    const THREADS: u32 = 16;
    const PER: u64 = 100;
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let b = b.clone();
            s.spawn(move || buffer_sends(&b, NodeId(0), t, PER, 100_000));
        }
    });
    log.expect(THREADS as u64 * PER, 120);
    let st = b.stats();
    println!(
        "in place {} copied {} registrations {}",
        st.zero_copy_in_place, st.zero_copy_copied, st.buffer_registrations
    );
    assert!(
        st.zero_copy_in_place > THREADS as u64 * PER / 2,
        "{} of {} sends in place",
        st.zero_copy_in_place,
        THREADS as u64 * PER
    );
    assert_eq!(st.connections_closed, 0);
}
