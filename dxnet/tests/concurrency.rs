//! Many threads on one connection: two nodes, one connection between them,
//! and
//!
//! - 64 sender threads of checked messages to the peer (random sizes from a
//!   byte to a few KiB, some larger than a receive buffer): every message
//!   delivered exactly once, in per-thread order, intact;
//! - 100 requester threads doing blocking requests to the peer: every
//!   request answered once, by the response derived from it, none timed out;
//! - both at once in both directions.
//!
//! In one process (TCP on 127.0.0.1 and the loopback transport) and with the
//! nodes in separate processes over TCP (the test binary re-runs itself as
//! the child processes: `child_*` tests do nothing unless `DXNET_CHILD` is
//! set).
//!
//! These tests assert behaviour, never timing. The timeouts (send, request,
//! waits) are generous and only keep a hang from blocking the test run; a
//! correct run takes a small fraction of them.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::proc::*;
use common::*;
use dxnet::{Config, Node, NodeId};
use serde::{Deserialize, Serialize};

/// A checked request: the [`Data`] of (requester node, requester thread,
/// request number), checked at the server like a message stream.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Job(Data);

/// The answer to a [`Job`]: derived from the request it answers, so a
/// response matched to the wrong request, or corrupted, is noticed.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct JobReply {
    from: u16,
    thread: u16,
    seq: u64,
    /// Length and FNV-1a digest of the request's payload as received.
    len: usize,
    digest: u64,
    /// Bytes of a size and content derived from (from, thread, seq).
    payload: Vec<u8>,
}
dxnet::message!(JobReply, 40, 2);
dxnet::request!(Job, 40, 1 => JobReply);

/// Start barrier: the peer is up and connected.
#[derive(Serialize, Deserialize, Debug)]
struct Hello(u16);
#[derive(Serialize, Deserialize, Debug)]
struct HelloBack(u16);
dxnet::message!(HelloBack, 40, 4);
dxnet::request!(Hello, 40, 3 => HelloBack);

/// Request timeout: only guards against a hang (a lost request or response
/// would otherwise block its thread forever); a correct run answers every
/// request in a small fraction of it, even on the 2-core test machine.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a node waits for everything its peer sends (hang guard too).
const WAIT_SECS: u64 = 60;
/// Receive buffer size of the test nodes; [`MAX_SIZE`] is three times it,
/// so about one message in fifteen is larger than a receive buffer.
const RECV_BUFFER: usize = 4 << 10;
/// Largest payload (see [`size_for`]: 60 % up to 256 B, 30 % up to 4 KiB,
/// 10 % up to this).
const MAX_SIZE: usize = 3 * RECV_BUFFER;

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// The reply a correct server gives to `d` (computed by the server from
/// what it received and by the requester from what it sent).
fn reply_for(d: &Data) -> JobReply {
    let len = size_for(d.seq ^ (d.thread as u64) << 24 ^ 0x5a5a << 40, MAX_SIZE);
    JobReply {
        from: d.from,
        thread: d.thread,
        seq: d.seq,
        len: d.payload.len(),
        digest: fnv(&d.payload),
        payload: pattern(d.from ^ 0x8000, d.thread, d.seq, len),
    }
}

/// Settings shared by every test node (in-process and child processes).
fn tune(c: &mut Config) {
    c.limits.recv_buffer_size = Some(RECV_BUFFER);
    c.handler_threads = 2;
    // Hang guards only (see the module comment): 64 threads share one ring
    // and one flow-control window, so `send` blocks under back-pressure.
    c.limits.send_timeout_ms = 30_000;
    c.limits.request_timeout_ms = 30_000;
}

/// What one node does to its peer: `senders` threads send `per` checked
/// messages each, `requesters` threads make `reqs` blocking requests each,
/// all at the same time.
#[derive(Clone, Copy, Debug, Default)]
struct Load {
    senders: u16,
    per: u64,
    requesters: u16,
    reqs: u64,
}

impl Load {
    const NONE: Load = Load {
        senders: 0,
        per: 0,
        requesters: 0,
        reqs: 0,
    };

    fn to_env(self) -> String {
        format!(
            "{},{},{},{}",
            self.senders, self.per, self.requesters, self.reqs
        )
    }

    fn from_env(name: &str) -> Self {
        let v: Vec<u64> = env(name).split(',').map(|x| x.parse().unwrap()).collect();
        Load {
            senders: v[0] as u16,
            per: v[1],
            requesters: v[2] as u16,
            reqs: v[3],
        }
    }
}

/// 64 sender threads × 300 messages.
const SENDERS: Load = Load {
    senders: 64,
    per: 300,
    requesters: 0,
    reqs: 0,
};
/// 100 requester threads × 50 blocking requests.
const REQUESTERS: Load = Load {
    senders: 0,
    per: 0,
    requesters: 100,
    reqs: 50,
};

/// One test node: checks the messages and requests it receives.
struct Side {
    node: Arc<Node>,
    /// The [`Data`] messages received.
    msgs: Arc<Checker>,
    /// The [`Job`]s served (each checked like a message stream).
    jobs: Arc<Checker>,
    /// [`Hello`]s answered.
    hellos: Arc<AtomicU64>,
    /// [`Done`]s received (end barrier of the child processes).
    done: Arc<AtomicU64>,
    /// Failures of this node's own sender and requester threads: (which
    /// thread and message, what went wrong).
    failures: Arc<Mutex<Vec<(String, String)>>>,
}

impl Side {
    fn start(cfg: Config) -> Side {
        let node = Arc::new(Node::start(cfg).unwrap());
        let msgs = Arc::new(Checker::default());
        let m = msgs.clone();
        node.register(move |src, d: Data| m.check(src, &d)).unwrap();
        let jobs = Arc::new(Checker::default());
        let j = jobs.clone();
        node.register_request(move |src, Job(d)| {
            j.check(src, &d);
            reply_for(&d)
        })
        .unwrap();
        let hellos = Arc::new(AtomicU64::new(0));
        let h = hellos.clone();
        let id = node.id().0;
        node.register_request(move |_, _: Hello| {
            h.fetch_add(1, Ordering::SeqCst);
            HelloBack(id)
        })
        .unwrap();
        let done = register_done(&node);
        Side {
            node,
            msgs,
            jobs,
            hellos,
            done,
            failures: Arc::default(),
        }
    }

    /// Opens the one connection to `peer` by a request (retried while the
    /// peer is still starting).
    fn hello(&self, peer: u16) {
        let back = until_reachable("hello", || {
            self.node
                .request(NodeId(peer), &Hello(self.node.id().0), REQUEST_TIMEOUT)
        });
        assert_eq!(back.0, peer);
    }

    /// Runs `load` toward `peer` from fresh threads; returns when every
    /// thread has finished. A failed send or request, or a wrong response,
    /// is recorded (see [`Side::assert_own_threads_ok`]).
    fn drive(&self, peer: u16, load: Load) {
        std::thread::scope(|s| {
            for t in 0..load.senders {
                let node = &self.node;
                let failures = &self.failures;
                s.spawn(move || {
                    let r = try_send_checked(node, t, load.per, MAX_SIZE, |_| peer);
                    if let Err((i, e)) = r {
                        let at = format!("sender thread {t}, send {i} of {}", load.per);
                        failures.lock().unwrap().push((at, format!("error: {e}")));
                    }
                });
            }
            for t in 0..load.requesters {
                let failures = &self.failures;
                s.spawn(move || {
                    if let Err(f) = self.requester(peer, t, load.reqs) {
                        failures.lock().unwrap().push(f);
                    }
                });
            }
        });
    }

    /// Requester thread `t`: `reqs` blocking requests to `peer`, each
    /// response checked against the request. Stops at the first failure
    /// (the later requests would not be checked anyway): (where, what).
    fn requester(&self, peer: u16, t: u16, reqs: u64) -> Result<(), (String, String)> {
        let me = self.node.id().0;
        for seq in 0..reqs {
            let len = size_for(seq ^ (t as u64) << 40 ^ (me as u64) << 50, MAX_SIZE);
            let d = checked_data(me, t, seq, len);
            let expect = reply_for(&d);
            let problem = match self.node.request(NodeId(peer), &Job(d), REQUEST_TIMEOUT) {
                Ok(r) if r == expect => continue,
                Ok(r) => format!("wrong response: {}, expected {}", brief(&r), brief(&expect)),
                Err(e) => format!("error: {e}"),
            };
            let at = format!("requester thread {t}, request {seq} of {reqs}");
            return Err((at, problem));
        }
        Ok(())
    }

    /// Asserts that every sender and requester thread of this node
    /// succeeded; else lists each kind of failure, how often it happened
    /// and where first.
    fn assert_own_threads_ok(&self) {
        let f = self.failures.lock().unwrap();
        let mut kinds: Vec<(&str, usize, &str)> = Vec::new();
        for (who, what) in f.iter() {
            match kinds.iter_mut().find(|k| k.0 == what) {
                Some(k) => k.1 += 1,
                None => kinds.push((what, 1, who)),
            }
        }
        let summary: Vec<String> = kinds
            .iter()
            .map(|(what, n, first)| format!("{n} x {what:?} (first: {first})"))
            .collect();
        assert!(
            f.is_empty(),
            "node {}: {} thread(s) failed: {summary:#?}",
            self.node.id(),
            f.len(),
        );
    }

    /// Waits for everything `peer` sends under `load`, then asserts that
    /// every message and every request arrived exactly once, in per-thread
    /// order, intact.
    fn expect_from(&self, peer: u16, load: Load) {
        let me = self.node.id();
        self.msgs.expect_streams(
            &format!("messages {peer} -> {me}"),
            peer,
            load.senders,
            load.per,
            WAIT_SECS,
        );
        self.jobs.expect_streams(
            &format!("requests {peer} -> {me}"),
            peer,
            load.requesters,
            load.reqs,
            WAIT_SECS,
        );
    }

    /// After everything arrived: nothing extra came later (a duplicate
    /// would show here or as a sequence error), and the one connection
    /// stayed up throughout (a broken one loses messages).
    fn assert_settled(&self, peer: u16, load: Load) {
        std::thread::sleep(Duration::from_millis(100));
        let p: Vec<String> = self
            .msgs
            .problems(peer, load.senders, load.per)
            .into_iter()
            .chain(self.jobs.problems(peer, load.requesters, load.reqs))
            .collect();
        assert!(p.is_empty(), "after settling: {p:#?}");
        let st = self.node.stats();
        assert_eq!(
            (st.connections_opened, st.connections_closed),
            (1, 0),
            "node {}: one connection, never broken ({st:?})",
            self.node.id()
        );
    }
}

/// A [`JobReply`] in short (without its payload bytes).
fn brief(r: &JobReply) -> String {
    format!(
        "(from {} thread {} seq {}, request len {} digest {:#x}, {} payload bytes)",
        r.from,
        r.thread,
        r.seq,
        r.len,
        r.digest,
        r.payload.len()
    )
}

/// The tests of this binary run one at a time: each starts up to 200
/// threads, and the machine may have 2 cores.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

// ----- in one process ---------------------------------------------------------

/// Nodes 0 and 1 in this process: node 0 runs `load0` toward node 1, node 1
/// `load1` toward node 0, at the same time.
fn in_process(kind: Kind, load0: Load, load1: Load) {
    in_process_with(kind, tune, load0, load1);
}

/// [`in_process`] with the nodes' settings made by `cfg`.
fn in_process_with(kind: Kind, cfg: impl Fn(&mut Config), load0: Load, load1: Load) {
    let _serial = serial();
    let t0 = Instant::now();
    let mut cfgs = cluster_configs(kind, 2, cfg).into_iter();
    let a = Side::start(cfgs.next().unwrap());
    let b = Side::start(cfgs.next().unwrap());
    a.hello(1);
    assert_eq!(b.hellos.load(Ordering::SeqCst), 1);
    std::thread::scope(|s| {
        s.spawn(|| a.drive(1, load0));
        s.spawn(|| b.drive(0, load1));
    });
    let driven = t0.elapsed();
    a.assert_own_threads_ok();
    b.assert_own_threads_ok();
    b.expect_from(0, load0);
    a.expect_from(1, load1);
    let received = t0.elapsed();
    b.assert_settled(0, load0);
    a.assert_settled(1, load1);
    drop((a, b));
    println!(
        "{kind:?} {load0:?} / {load1:?}: threads done {driven:?}, \
         all received {received:?}, shut down {:?}",
        t0.elapsed()
    );
}

#[test]
fn loopback_64_senders_one_peer() {
    in_process(Kind::Loopback, SENDERS, Load::NONE);
}

#[test]
fn tcp_64_senders_one_peer() {
    in_process(Kind::Tcp, SENDERS, Load::NONE);
}

#[test]
fn tcp_64_senders_both_directions() {
    in_process(Kind::Tcp, SENDERS, SENDERS);
}

#[test]
fn loopback_100_requesters_one_peer() {
    in_process(Kind::Loopback, REQUESTERS, Load::NONE);
}

#[test]
fn tcp_100_requesters_one_peer() {
    in_process(Kind::Tcp, REQUESTERS, Load::NONE);
}

/// Write coalescing stretched far (more bytes than a write ever has ready,
/// 3 ms between writes under traffic): 24 senders and 16 requesters in each
/// direction, so the send thread defers connections all the time. Every
/// message arrives once, in order and intact; every response is matched.
#[test]
fn tcp_stretched_write_coalescing_loses_nothing() {
    let load = Load {
        senders: 24,
        per: 200,
        requesters: 16,
        reqs: 30,
    };
    let cfg = |c: &mut Config| {
        tune(c);
        c.tcp.coalesce_bytes = 64 << 20;
        c.tcp.coalesce_us = 3000;
    };
    in_process_with(Kind::Tcp, cfg, load, load);
}

/// The tail of a burst leaves even when nothing follows it: one thread
/// sends 30 bursts of 1–40 messages under stretched write coalescing and,
/// after each, waits until all of them arrived. No later send, request or
/// flow-control confirmation queues the connection again: the send thread
/// must come back to the data it held back by itself.
#[test]
fn tcp_coalesced_burst_tails_are_written() {
    let _serial = serial();
    let nodes = start_all(cluster_configs(Kind::Tcp, 2, |c| {
        tune(c);
        c.tcp.coalesce_bytes = 1 << 20;
        c.tcp.coalesce_us = 2000;
    }));
    let chk = Arc::new(Checker::default());
    let c = chk.clone();
    nodes[1]
        .register(move |src, m: Data| c.check(src, &m))
        .unwrap();
    let mut rng = Rng::new(0xb0a5);
    let mut seq = 0;
    for _ in 0..30 {
        for _ in 0..1 + rng.next_u64() % 40 {
            let len = size_for(rng.next_u64(), 600);
            nodes[0]
                .send(NodeId(1), &checked_data(0, 0, seq, len))
                .unwrap();
            seq += 1;
        }
        chk.expect_streams("burst", 0, 1, seq, WAIT_SECS);
    }
}

// ----- in separate processes over TCP -----------------------------------------

/// One node process. Env: NODE (0 or 1), BASE, LOAD0 and LOAD1 (what node
/// 0 and node 1 do, see [`Load::to_env`]).
#[test]
fn child_node() {
    if !is_child() {
        return;
    }
    init_child_log();
    let me: u16 = env_parse("NODE");
    let peer = 1 - me;
    let loads = [Load::from_env("LOAD0"), Load::from_env("LOAD1")];
    let mut cfg = Config::tcp_localhost(me, 2, env_parse("BASE"));
    cfg.park.spin_us = 20; // as cluster_configs: 2-core machine
    cfg.park.yield_us = 200;
    tune(&mut cfg);
    let side = Side::start(cfg);
    // Start barrier: node 0 opens the one connection; node 1 starts once
    // node 0 said hello (two dialing at once could make two connections).
    if me == 0 {
        side.hello(peer);
    } else {
        wait_for(WAIT_SECS, "hello from node 0", || {
            side.hellos.load(Ordering::SeqCst) > 0
        });
    }
    println!("READY");
    let t0 = Instant::now();
    side.drive(peer, loads[me as usize]);
    let sent = t0.elapsed();
    side.assert_own_threads_ok();
    side.expect_from(peer, loads[peer as usize]);
    let received = t0.elapsed();
    end_barrier(&side.node, &[peer], &side.done);
    side.assert_settled(peer, loads[peer as usize]);
    // Neither node exits (closing the connection) before both checked it.
    barrier_round(&side.node, &[peer], &side.done, 2);
    println!(
        "CHILD OK node={me} msgs={} jobs={} own_threads_done={sent:?} all_received={received:?}",
        side.msgs.received.load(Ordering::SeqCst),
        side.jobs.received.load(Ordering::SeqCst),
    );
}

/// Nodes 0 and 1 as separate processes: node 0 runs `load0` toward node 1,
/// node 1 `load1` toward node 0, at the same time.
fn processes(load0: Load, load1: Load) {
    let _serial = serial();
    let t0 = Instant::now();
    let base = base_port(2);
    let children: Vec<ChildProc> = (0..2u16)
        .map(|id| {
            spawn_child(
                "child_node",
                &[
                    ("NODE", id.to_string()),
                    ("BASE", base.to_string()),
                    ("LOAD0", load0.to_env()),
                    ("LOAD1", load1.to_env()),
                ],
            )
        })
        .collect();
    let loads = [load0, load1];
    for (id, c) in children.into_iter().enumerate() {
        let from = loads[1 - id];
        let out = wait_child(c, 2 * WAIT_SECS + 60);
        let line = out
            .lines()
            .find_map(|l| l.split_once("CHILD OK ").map(|x| x.1))
            .unwrap_or_else(|| panic!("node {id}: no CHILD OK line:\n{out}"));
        assert_eq!(field::<u64>(line, "msgs="), from.senders as u64 * from.per);
        assert_eq!(
            field::<u64>(line, "jobs="),
            from.requesters as u64 * from.reqs
        );
        println!("node {id}: {line}");
    }
    println!("processes {load0:?} / {load1:?}: {:?}", t0.elapsed());
}

#[test]
fn processes_64_senders_one_peer() {
    processes(SENDERS, Load::NONE);
}

#[test]
fn processes_100_requesters_one_peer() {
    processes(REQUESTERS, Load::NONE);
}

/// Both nodes send with 64 threads and request with 100 threads at once.
///
/// Fails at 277771f and already before the ring-buffer rework (ea1a5a6): both
/// flow-control windows fill with plain messages and requests, then each
/// node's handler of the connection blocks in `send_response` waiting for
/// the peer's window (`FlowControl::acquire`), which only the peer's equally
/// blocked handler would free (decode-ahead confirms only the response
/// bytes it consumes). After `send_timeout_ms` every sender fails with
/// "send blocked by flow control" and every request times out.
#[test]
fn processes_senders_and_requesters_both_directions() {
    let both = Load {
        senders: SENDERS.senders,
        per: SENDERS.per,
        requesters: REQUESTERS.requesters,
        reqs: REQUESTERS.reqs,
    };
    processes(both, both);
}

// ----- several outgoing rings ------------------------------------------------

/// With several outgoing rings per connection (`tcp.rings`), each thread's
/// messages stay in order and whole, also when a ring's published bytes
/// end inside a message while the other rings have data: cut by the send
/// thread at 1 MiB, or published chunk by chunk (messages over half a
/// ring: 3 rings share 4 MiB, 1 MiB each). 12 threads on 3 rings, random
/// sizes up to 3 MiB, every message checked once, in order, intact.
#[test]
fn tcp_rings_keep_each_threads_order_across_chunk_cuts() {
    const THREADS: u16 = 12;
    const PER: u64 = 40;
    const BIG: usize = 3 << 20;
    let cfg = |c: &mut Config| {
        c.tcp.rings = 3;
        c.limits.orb_size = 4 << 20;
        c.limits.max_message_size = 4 << 20;
        c.limits.flow_control_window = 16 << 20;
        c.limits.send_timeout_ms = 60_000;
    };
    threads_to_one_peer_in_order("ring test", cfg, THREADS, PER, BIG);
}

/// `threads` threads of node 0 each send `per` checked messages of random
/// sizes up to `max` to node 1 (over TCP, configured by `cfg`); every
/// message arrives once, in its thread's order, intact.
fn threads_to_one_peer_in_order(
    what: &str,
    cfg: impl Fn(&mut Config),
    threads: u16,
    per: u64,
    max: usize,
) {
    threads_to_one_peer_in_order_with(what, cfg, threads, per, max, |_, _| {});
}

/// [`threads_to_one_peer_in_order`], calling `before(thread, i)` on the
/// sending thread before its message `i`.
fn threads_to_one_peer_in_order_with(
    what: &str,
    cfg: impl Fn(&mut Config),
    threads: u16,
    per: u64,
    max: usize,
    before: impl Fn(u16, u64) + Sync,
) {
    let nodes = start_all(cluster_configs(Kind::Tcp, 2, cfg));
    let chk = Arc::new(Checker::default());
    let c = chk.clone();
    nodes[1]
        .register(move |src, m: Data| c.check(src, &m))
        .unwrap();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (node, before) = (&nodes[0], &before);
            s.spawn(move || {
                send_checked(node, t, per, max, |i| {
                    before(t, i);
                    1
                })
            });
        }
    });
    chk.expect_streams(what, 0, threads, per, WAIT_SECS);
}

/// The send thread writes the chunks of many rings in one call: with 16
/// rings of 8 KiB (sharing 128 KiB) and 48 threads, most calls carry
/// several rings' chunks, and messages over 4 KiB are published chunk by
/// chunk (a cut chunk ends the call). Random sizes up to 6 KiB, every
/// message checked once, in order, intact.
#[test]
fn tcp_sixteen_small_rings_written_together_keep_each_threads_order() {
    let cfg = |c: &mut Config| {
        c.tcp.rings = 16;
        c.limits.orb_size = 128 << 10;
        c.limits.send_timeout_ms = 60_000;
    };
    threads_to_one_peer_in_order("sixteen rings", cfg, 48, 300, 6 << 10);
}

/// The CPUs this process may run on.
#[cfg(target_os = "linux")]
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed `cpu_set_t` is a valid empty set; the kernel fills
    // it (`0`: the calling thread).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Moves the calling thread to `cpu`.
#[cfg(target_os = "linux")]
fn move_to_cpu(cpu: usize) {
    // SAFETY: as in `allowed_cpus`; the set names one allowed CPU.
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) == 0
    };
    assert!(ok, "cannot move to CPU {cpu}");
}

/// A thread writes into the ring of the CPU it runs on and changes rings
/// when it moves: here every sender moves to another CPU every few
/// messages (random sizes up to 12 KiB, so some messages are chunked),
/// and still every message arrives once, intact and in its thread's
/// order. Several rings of 32 KiB, 24 threads.
#[cfg(target_os = "linux")]
#[test]
fn tcp_threads_moving_between_cpus_keep_their_order() {
    let cpus = allowed_cpus();
    if cpus.len() < 2 {
        eprintln!("skipped: needs two CPUs");
        return;
    }
    let cfg = |c: &mut Config| {
        c.tcp.rings = 4;
        c.limits.orb_size = 128 << 10;
        c.limits.send_timeout_ms = 60_000;
    };
    threads_to_one_peer_in_order_with(
        "threads moving between CPUs",
        cfg,
        24,
        1500,
        12 << 10,
        |t, i| {
            let hop = 3 + u64::from(t) % 5;
            if i % hop == 0 {
                move_to_cpu(cpus[(i / hop + u64::from(t)) as usize % cpus.len()]);
            }
        },
    );
}

/// Connections of several nodes in one process are told apart by the
/// sending threads' ring choice: 16 threads each send, alternately and
/// moving between CPUs every few messages, through two nodes of the process
/// to a third (whose connections from each have the same place in their
/// own node). Each (node, thread) stream arrives once, intact, in order.
#[cfg(target_os = "linux")]
#[test]
fn tcp_threads_sending_through_two_nodes_of_one_process_keep_each_order() {
    const THREADS: u16 = 16;
    const PER: u64 = 800;
    let cpus = allowed_cpus();
    if cpus.len() < 2 {
        eprintln!("skipped: needs two CPUs");
        return;
    }
    let nodes = start_all(cluster_configs(Kind::Tcp, 3, |c: &mut Config| {
        c.tcp.rings = 4;
        c.limits.orb_size = 128 << 10;
        c.limits.send_timeout_ms = 60_000;
    }));
    let (a, dest, b) = (&nodes[0], nodes[1].id(), &nodes[2]);
    let (from_a, from_b) = (Arc::new(Checker::default()), Arc::new(Checker::default()));
    let (ca, cb, a_id) = (from_a.clone(), from_b.clone(), a.id());
    nodes[1]
        .register(move |src, m: Data| {
            if src == a_id {
                ca.check(src, &m)
            } else {
                cb.check(src, &m)
            }
        })
        .unwrap();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let cpus = &cpus;
            s.spawn(move || {
                let hop = 3 + u64::from(t) % 5;
                for i in 0..PER {
                    if i % hop == 0 {
                        move_to_cpu(cpus[(i / hop + u64::from(t)) as usize % cpus.len()]);
                    }
                    let order = if (i * 7 + u64::from(t)) % 3 == 0 {
                        [b, a]
                    } else {
                        [a, b]
                    };
                    for n in order {
                        let id = n.id().0;
                        let len = size_for(i ^ u64::from(t) << 40 ^ u64::from(id) << 50, 12 << 10);
                        n.send(dest, &checked_data(id, t, i, len)).unwrap();
                    }
                }
            });
        }
    });
    from_a.expect_streams("through the first node", a.id().0, THREADS, PER, WAIT_SECS);
    from_b.expect_streams("through the second node", b.id().0, THREADS, PER, WAIT_SECS);
}

/// Marks the end of a round in [`round_marks_overtaking_data`]: sent by
/// another thread than the data, after the data senders' sends returned.
#[derive(Serialize, Deserialize, Debug)]
struct RoundEnd {
    round: u64,
    /// Data messages sent to the receiver before this mark (all rounds).
    sent_before: u64,
}
dxnet::message!(RoundEnd, 40, 5);

/// [`RoundEnd`] as a request (requests may be written by the requesting
/// thread itself, past the ring, when the send thread sleeps); answered
/// with whether it came after all data before it.
#[derive(Serialize, Deserialize, Debug)]
struct RoundEndRequest(RoundEnd);
#[derive(Serialize, Deserialize, Debug)]
struct InOrder(bool);
dxnet::message!(InOrder, 40, 7);
dxnet::request!(RoundEndRequest, 40, 6 => InOrder);

/// Sends `rounds` rounds: `producers` threads each send `per` checked
/// messages, then one other thread, woken once all their sends returned,
/// sends a [`RoundEnd`] (every other round as a request). Returns the
/// number of marks that arrived before data sent ahead of them (and the
/// first such mark).
fn round_marks_overtaking_data(
    kind: Kind,
    cfg: impl Fn(&mut Config),
    producers: u16,
    rounds: u64,
    per: u64,
) -> (u64, Option<String>) {
    let nodes = start_all(cluster_configs(kind, 2, cfg));
    let chk = Arc::new(Checker::default());
    let received = Arc::new(AtomicU64::new(0));
    let (c, r) = (chk.clone(), received.clone());
    nodes[1]
        .register(move |src, m: Data| {
            c.check(src, &m);
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    let early = Arc::new(Mutex::new((0u64, None::<String>)));
    let check = {
        let (r, e) = (received.clone(), early.clone());
        move |m: &RoundEnd, kind: &str| {
            let got = r.load(Ordering::SeqCst);
            let in_order = got >= m.sent_before;
            if !in_order {
                let mut e = e.lock().unwrap();
                e.0 += 1;
                e.1.get_or_insert(format!(
                    "round {} ({kind}): {got} of the {} messages sent before the mark had arrived",
                    m.round, m.sent_before
                ));
            }
            in_order
        }
    };
    let c = check.clone();
    nodes[1]
        .register(move |_, m: RoundEnd| {
            c(&m, "message");
        })
        .unwrap();
    nodes[1]
        .register_request(move |_, RoundEndRequest(m)| InOrder(check(&m, "request")))
        .unwrap();
    let node = &nodes[0];
    let barrier = std::sync::Barrier::new(producers as usize + 1);
    std::thread::scope(|s| {
        for t in 0..producers {
            let barrier = &barrier;
            s.spawn(move || {
                for round in 0..rounds {
                    for i in 0..per {
                        let seq = round * per + i;
                        let len = size_for(t as u64 ^ seq.wrapping_mul(31), 1024);
                        node.send(NodeId(1), &checked_data(node.id().0, t, seq, len))
                            .unwrap();
                    }
                    barrier.wait(); // this round's data sends returned
                    barrier.wait(); // the mark was sent
                }
            });
        }
        for round in 0..rounds {
            barrier.wait();
            let sent_before = (round + 1) * per * producers as u64;
            let mark = RoundEnd { round, sent_before };
            if round % 2 == 0 {
                node.send(NodeId(1), &mark).unwrap();
            } else {
                node.request(NodeId(1), &RoundEndRequest(mark), REQUEST_TIMEOUT)
                    .unwrap();
            }
            barrier.wait();
        }
    });
    chk.expect_streams("round marks", 0, producers, rounds * per, WAIT_SECS);
    let e = early.lock().unwrap().clone();
    e
}

/// A message sent after other threads' sends to the same node returned
/// (ordered by a barrier, a join, a channel) arrives after theirs, as over
/// one socket: with one ring per TCP connection (`tcp.rings = 1`; the
/// loopback transport always has one), the marks sent by another thread
/// never overtake the data before them. (With several rings, the
/// default, they may.)
#[test]
fn a_send_after_other_threads_sends_returned_arrives_after_them() {
    for kind in [Kind::Tcp, Kind::Loopback] {
        let (early, first) = round_marks_overtaking_data(kind, |c| c.tcp.rings = 1, 3, 300, 40);
        assert_eq!(
            early, 0,
            "{kind:?}: {early} marks overtook data, first: {first:?}"
        );
    }
}

// ----- the checks can fail ----------------------------------------------------

/// The checks above notice a lost, duplicated, reordered or corrupted
/// message, and a wrong response.
#[test]
fn checks_catch_loss_duplication_reordering_corruption() {
    let msg = |thread: u16, seq: u64| checked_data(3, thread, seq, 100);
    // Node 3's thread 0 sends 0, 1, 2 intact; thread 1 sends `seqs`; 3
    // messages per thread are expected.
    let run = |seqs: &[u64]| {
        let c = Checker::default();
        for s in 0..3 {
            c.check(NodeId(3), &msg(0, s));
        }
        for &s in seqs {
            c.check(NodeId(3), &msg(1, s));
        }
        c.problems(3, 2, 3)
    };
    assert!(run(&[0, 1, 2]).is_empty(), "{:?}", run(&[0, 1, 2]));
    assert!(!run(&[0, 2]).is_empty(), "gap");
    assert!(!run(&[0, 1]).is_empty(), "lost at the end");
    assert!(!run(&[1, 2]).is_empty(), "lost at the start");
    assert!(!run(&[0, 1, 1, 2]).is_empty(), "duplicate");
    assert!(!run(&[0, 1, 2, 2]).is_empty(), "duplicate at the end");
    assert!(!run(&[0, 2, 1]).is_empty(), "reordered");
    assert!(!run(&[0, 1, 2, 3]).is_empty(), "one too many");
    let c = Checker::default();
    c.check(NodeId(3), &msg(0, 0));
    let mut bad = msg(1, 0);
    bad.payload[7] ^= 1;
    c.check(NodeId(3), &bad);
    assert!(!c.problems(3, 2, 1).is_empty(), "corrupt payload");
    let c = Checker::default();
    c.check(NodeId(3), &msg(0, 0));
    c.check(NodeId(2), &msg(1, 0));
    assert!(!c.problems(3, 2, 1).is_empty(), "wrong source");
    // A response to another request (other thread or sequence number) or
    // with other payload bytes does not match.
    let r = reply_for(&msg(1, 5));
    assert_ne!(r, reply_for(&msg(1, 4)));
    assert_ne!(r, reply_for(&msg(0, 5)));
    let mut other = msg(1, 5);
    other.payload[0] ^= 1;
    assert_ne!(r, reply_for(&other));
}
