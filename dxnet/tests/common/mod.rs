//! Shared helpers of the integration tests: clusters, checked traffic.
#![allow(dead_code)]

pub mod netns;
pub mod proc;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dxnet::{Config, Node, NodeId};
use serde::{Deserialize, Serialize};

/// A checked test message: payload bytes derive from (from, thread, seq).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Data {
    pub from: u16,
    pub thread: u16,
    pub seq: u64,
    pub payload: Vec<u8>,
}
dxnet::message!(Data, 10, 1);

/// "I received everything": sent to every peer at the end of a multi-node
/// test (see [`end_barrier`]).
#[derive(Serialize, Deserialize, Debug)]
pub struct Done(pub u16);
dxnet::message!(Done, 10, 3);

/// One step of a sender thread of [`send_steps`]: (thread, sequence
/// number, padding).
#[derive(Serialize, Deserialize, Debug, PartialEq)]
pub struct Step(pub u16, pub u64, pub Vec<u8>);
dxnet::message!(Step, 10, 4);
/// A step sent as a request.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
pub struct StepReq(pub u16, pub u64);
/// The answer to a [`StepReq`].
#[derive(Serialize, Deserialize, Debug, PartialEq)]
pub struct StepAck(pub u64);
dxnet::message!(StepAck, 10, 6);
dxnet::request!(StepReq, 10, 5 => StepAck);

/// The steps a node received, per (source node, thread), in arrival order.
#[derive(Default)]
pub struct StepLog(Mutex<HashMap<(u16, u16), Vec<u64>>>);

impl StepLog {
    fn push(&self, src: NodeId, thread: u16, seq: u64) {
        self.0
            .lock()
            .unwrap()
            .entry((src.0, thread))
            .or_default()
            .push(seq);
    }

    /// Whether `threads` threads of `src` delivered `steps` steps each.
    pub fn complete(&self, src: u16, threads: u16, steps: u64) -> bool {
        let log = self.0.lock().unwrap();
        (0..threads).all(|t| log.get(&(src, t)).map_or(0, |v| v.len() as u64) >= steps)
    }

    /// Every thread's steps came exactly once and in send order.
    pub fn assert_in_order(&self, src: u16, threads: u16, steps: u64) {
        for t in 0..threads {
            self.assert_thread_in_order(src, t, steps);
        }
    }

    /// Steps received from `thread` of `src`.
    pub fn received(&self, src: u16, thread: u16) -> u64 {
        let log = self.0.lock().unwrap();
        log.get(&(src, thread)).map_or(0, |v| v.len() as u64)
    }

    /// `thread` of `src` delivered steps 0..`steps` exactly once, in order.
    pub fn assert_thread_in_order(&self, src: u16, thread: u16, steps: u64) {
        let log = self.0.lock().unwrap();
        let expect: Vec<u64> = (0..steps).collect();
        assert!(
            log.get(&(src, thread)).map_or(&[][..], |v| &v[..]) == &expect[..],
            "steps of node {src} thread {thread} out of order, lost or duplicated"
        );
    }
}

/// Logs the [`Step`]s and [`StepReq`]s `node` receives (answering the
/// requests).
pub fn register_step_log(node: &Node) -> Arc<StepLog> {
    let log = Arc::new(StepLog::default());
    let l = log.clone();
    node.register(move |src, Step(t, seq, _pad)| l.push(src, t, seq))
        .unwrap();
    let l = log.clone();
    node.register_request(move |src, StepReq(t, seq)| {
        l.push(src, t, seq);
        StepAck(seq)
    })
    .unwrap();
    log
}

/// Sends `steps` steps of `thread` to `dest`: about a third as requests not
/// waited for at once (up to 16 outstanding), the rest as plain messages
/// with up to `max_pad` bytes of padding. Small requests may leave outside
/// the ring buffer (standalone frames) while this thread's earlier
/// messages still wait in it: the receiver's [`StepLog`] shows whether
/// send order held.
pub fn send_steps(node: &Node, dest: NodeId, thread: u16, steps: u64, max_pad: usize) {
    send_steps_with(node, dest, thread, steps, max_pad, false);
}

/// [`send_steps`], with each request a blocking [`Node::request`] when
/// `blocking` (the thread waits for its response before the next step).
pub fn send_steps_with(
    node: &Node,
    dest: NodeId,
    thread: u16,
    steps: u64,
    max_pad: usize,
    blocking: bool,
) {
    let mut pending = std::collections::VecDeque::new();
    for seq in 0..steps {
        let r = seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        if r % 3 == 0 && blocking {
            let ack = node
                .request(dest, &StepReq(thread, seq), Duration::from_secs(60))
                .unwrap();
            assert_eq!(ack, StepAck(seq));
        } else if r % 3 == 0 {
            let h = node
                .request_async(dest, &StepReq(thread, seq), Duration::from_secs(60))
                .unwrap();
            pending.push_back((seq, h));
            if pending.len() > 16 {
                let (seq, h) = pending.pop_front().unwrap();
                assert_eq!(h.wait().unwrap(), StepAck(seq));
            }
        } else {
            // Every fifth message up to `max_pad` (split across receive
            // buffers), the others small.
            let len = if r % 5 == 1 {
                r % (max_pad as u64 + 1)
            } else {
                r % 200
            };
            let pad = vec![thread as u8; len as usize];
            node.send(dest, &Step(thread, seq, pad)).unwrap();
        }
    }
    for (seq, h) in pending {
        assert_eq!(h.wait().unwrap(), StepAck(seq));
    }
}

/// Counts the [`Done`] messages `node` receives.
pub fn register_done(node: &Node) -> Arc<AtomicU64> {
    let done = Arc::new(AtomicU64::new(0));
    let d = done.clone();
    node.register(move |_, _: Done| {
        d.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    done
}

/// End barrier: tells every peer that this node received everything, then
/// waits until every peer said so too (`done` from [`register_done`]), so
/// that nobody exits while others may still send to it.
pub fn end_barrier(node: &Node, peers: &[u16], done: &AtomicU64) {
    barrier_round(node, peers, done, 1);
}

/// Round `round` (1, 2, ...) of a barrier on the [`Done`] messages counted
/// in `done`: e.g. a second round after checks that must see every peer
/// still running (a peer that exits closes its connection).
pub fn barrier_round(node: &Node, peers: &[u16], done: &AtomicU64, round: u64) {
    for &p in peers {
        node.send(NodeId(p), &Done(node.id().0)).unwrap();
    }
    wait_for(120, "done from all", || {
        done.load(Ordering::SeqCst) >= round * peers.len() as u64
    });
}

/// Sends `count` checked [`Data`] messages from thread `thread` of this
/// node, the `i`-th to `dest_of(i)`, numbered per destination, of
/// [`size_for`] sizes up to `max`. Panics if a send fails.
pub fn send_checked(
    node: &Node,
    thread: u16,
    count: u64,
    max: usize,
    dest_of: impl Fn(u64) -> u16,
) {
    if let Err((i, e)) = try_send_checked(node, thread, count, max, dest_of) {
        panic!("thread {thread}: send {i} of {count} failed: {e}");
    }
}

/// [`send_checked`] that stops at the first failed send instead of
/// panicking: returns its index `i` and the error.
pub fn try_send_checked(
    node: &Node,
    thread: u16,
    count: u64,
    max: usize,
    dest_of: impl Fn(u64) -> u16,
) -> Result<(), (u64, dxnet::Error)> {
    let id = node.id().0;
    let mut seq: HashMap<u16, u64> = HashMap::new();
    for i in 0..count {
        let dest = dest_of(i);
        let next = seq.entry(dest).or_insert(0);
        let sq = *next;
        *next += 1;
        let len = size_for(i ^ (thread as u64) << 40 ^ (id as u64) << 50, max);
        node.send(NodeId(dest), &checked_data(id, thread, sq, len))
            .map_err(|e| (i, e))?;
    }
    Ok(())
}

/// Message `seq` of thread `thread` of node `from`, with a payload of
/// `len` bytes derived from those three (what [`Checker`] verifies).
pub fn checked_data(from: u16, thread: u16, seq: u64, len: usize) -> Data {
    Data {
        from,
        thread,
        seq,
        payload: pattern(from, thread, seq, len),
    }
}

/// A discovery probe from `node` (as its own subject) announcing
/// `address`, for tests that forge or replay one.
pub fn probe_from(
    node: u16,
    instance: u64,
    nonce: u8,
    address: String,
) -> dxnet::proto::discovery::Announcement {
    dxnet::proto::discovery::Announcement {
        kind: dxnet::proto::discovery::Kind::Probe,
        sender: node,
        subject: node,
        instance,
        nonce: [nonce; 16],
        address,
    }
}

pub fn pattern(from: u16, thread: u16, seq: u64, len: usize) -> Vec<u8> {
    Rng::from_state(
        (from as u64) << 48 ^ (thread as u64) << 32 ^ seq.wrapping_mul(0x9E37_79B9_7F4A_7C15),
    )
    .bytes(len)
}

/// A deterministic xorshift64 generator: the tests' random sizes, choices
/// and bytes, the same on every run for a seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The stream of `seed` (distinct seeds, distinct streams).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The stream that continues from `state` as it is (0 stays 0).
    pub fn from_state(state: u64) -> Rng {
        Rng(state)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// The next `len` values' low bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next_u64() as u8).collect()
    }
}

/// Deterministic pseudo-random sizes: mostly small, some several times
/// `big`.
pub fn size_for(seed: u64, max: usize) -> usize {
    let mut x = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0xDEAD_BEEF;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    match x % 10 {
        0 => 1 + (x >> 8) as usize % max,
        1..=3 => 1 + (x >> 8) as usize % 4096,
        _ => 1 + (x >> 8) as usize % 256,
    }
}

/// Per-(sender node, thread) next expected sequence number at one receiver,
/// and every failure seen.
#[derive(Default)]
pub struct Checker {
    next: Mutex<HashMap<(u16, u16), u64>>,
    pub received: AtomicU64,
    pub errors: Mutex<Vec<String>>,
}

impl Checker {
    pub fn check(&self, src: NodeId, m: &Data) {
        if src.0 != m.from {
            self.errors
                .lock()
                .unwrap()
                .push(format!("source {src} claims {}", m.from));
        }
        if m.payload != pattern(m.from, m.thread, m.seq, m.payload.len()) {
            self.errors
                .lock()
                .unwrap()
                .push(format!("corrupt payload {m:?}"));
        }
        let mut next = self.next.lock().unwrap();
        let e = next.entry((m.from, m.thread)).or_insert(0);
        if *e != m.seq {
            self.errors.lock().unwrap().push(format!(
                "from {} thread {}: expected seq {}, got {}",
                m.from, m.thread, e, m.seq
            ));
        }
        *e = m.seq + 1;
        self.received.fetch_add(1, Ordering::SeqCst);
    }

    /// The next sequence number expected from stream (`from`, `thread`):
    /// the number of its messages received, in order, so far.
    pub fn next_seq(&self, from: u16, thread: u16) -> u64 {
        *self.next.lock().unwrap().get(&(from, thread)).unwrap_or(&0)
    }

    /// Every stream seen and its next expected sequence number.
    pub fn streams(&self) -> Vec<((u16, u16), u64)> {
        let mut v: Vec<_> = self
            .next
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect();
        v.sort();
        v
    }

    /// What is wrong with what arrived, given that node `from` was to send
    /// exactly `per` messages on each of its streams (threads) `0..threads`
    /// and nobody else sends here: every error seen (gap, duplicate,
    /// reordering, corruption), every stream short of or beyond `per`, any
    /// unexpected stream, a total other than `threads × per`. Empty when
    /// everything arrived exactly once, in order, intact.
    pub fn problems(&self, from: u16, threads: u16, per: u64) -> Vec<String> {
        let mut p: Vec<String> = self
            .errors
            .lock()
            .unwrap()
            .iter()
            .take(5)
            .cloned()
            .collect();
        let n_err = self.errors.lock().unwrap().len();
        if n_err > 5 {
            p.push(format!("... {} errors in all", n_err));
        }
        let streams = self.streams();
        for t in 0..threads {
            let got = streams
                .iter()
                .find(|(k, _)| *k == (from, t))
                .map_or(0, |s| s.1);
            if got != per {
                p.push(format!(
                    "stream (node {from}, thread {t}): next seq {got}, expected {per}"
                ));
            }
        }
        for ((f, t), next) in &streams {
            if *f != from || *t >= threads {
                p.push(format!("unexpected stream (node {f}, thread {t}): {next}"));
            }
        }
        let received = self.received.load(Ordering::SeqCst);
        if received != threads as u64 * per {
            p.push(format!(
                "received {received} messages, expected {}",
                threads as u64 * per
            ));
        }
        p
    }

    /// Waits (at most `secs`) until `threads × per` messages arrived from
    /// node `from` (or an error was seen), then asserts that every stream
    /// delivered exactly `per` messages once, in order, intact (see
    /// [`Checker::problems`]). The panic message names the short streams.
    pub fn expect_streams(&self, what: &str, from: u16, threads: u16, per: u64, secs: u64) {
        let expect = threads as u64 * per;
        let end = Instant::now() + Duration::from_secs(secs);
        while self.received.load(Ordering::SeqCst) < expect
            && self.errors.lock().unwrap().is_empty()
            && Instant::now() < end
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        let p = self.problems(from, threads, per);
        assert!(
            p.is_empty(),
            "{what}: {} problem(s) after waiting up to {secs} s: {p:#?}",
            p.len()
        );
    }

    pub fn assert_ok(&self) {
        let e = self.errors.lock().unwrap();
        assert!(
            e.is_empty(),
            "{} errors, first: {:?}",
            e.len(),
            &e[..e.len().min(5)]
        );
    }
}

/// Waits until `f` is true or panics after `secs`.
pub fn wait_for(secs: u64, what: &str, f: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

static NEXT_PORT: AtomicU16 = AtomicU16::new(0);

/// First port of the kernel's ephemeral range (`ip_local_port_range`).
/// Test listeners stay below it: a port inside it can be taken by any
/// outgoing connection (another test's, or a survivor redialling a killed
/// node) between a node's death and its restart on the same port.
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// A base port for `n` nodes unlikely to collide with other tests in this
/// process or other test binaries running at the same time, below the
/// ephemeral range.
pub fn base_port(n: u16) -> u16 {
    const LOW: u16 = 10_000;
    let high = ephemeral_low().max(LOW + 4_000);
    let slots = (high - LOW - 1_000) / 10;
    if NEXT_PORT.load(Ordering::SeqCst) == 0 {
        let seed = LOW + (std::process::id() % slots as u32) as u16 * 10;
        let _ = NEXT_PORT.compare_exchange(0, seed, Ordering::SeqCst, Ordering::SeqCst);
    }
    loop {
        let p = NEXT_PORT.fetch_add(n + 1, Ordering::SeqCst);
        if u32::from(p) + u32::from(n) >= u32::from(high) {
            // Past the top: one thread moves the counter back to the bottom.
            let _ = NEXT_PORT.compare_exchange(
                p.wrapping_add(n + 1),
                LOW,
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
            continue;
        }
        if (0..n).all(|i| std::net::TcpListener::bind(("127.0.0.1", p + i)).is_ok()) {
            return p;
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Loopback,
    Tcp,
    /// TCP with TLS: a fresh CA and node certificates per cluster.
    TcpTls,
}

/// A fresh directory for a cluster's certificates, under cargo's
/// `target/tmp` (not the system's temp directory).
pub fn pki_dir() -> std::path::PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "dxnet-test-pki-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ))
}

static FABRIC: AtomicU64 = AtomicU64::new(0);

/// Configs for an `n`-node cluster of `kind`, adjusted by `tweak`.
pub fn cluster_configs(kind: Kind, n: u16, tweak: impl Fn(&mut Config)) -> Vec<Config> {
    let fabric = format!("test-{}", FABRIC.fetch_add(1, Ordering::SeqCst));
    let base = if kind == Kind::Loopback {
        0
    } else {
        base_port(n)
    };
    let ids: Vec<NodeId> = (0..n).map(NodeId).collect();
    let mut tls = if kind == Kind::TcpTls {
        dxnet::pki::generate_cluster_pki(&pki_dir(), &ids).unwrap()
    } else {
        Vec::new()
    }
    .into_iter();
    (0..n)
        .map(|i| {
            let mut c = match kind {
                Kind::Loopback => Config::loopback(i, n, &fabric),
                Kind::Tcp => Config::tcp_localhost(i, n, base),
                Kind::TcpTls => {
                    let mut c = Config::tcp_localhost(i, n, base);
                    c.tls = tls.next();
                    c
                }
            };
            c.park.spin_us = 20; // 2-core machine: do not let idle threads hog it
            c.park.yield_us = 200;
            tweak(&mut c);
            c
        })
        .collect()
}

/// The test identity key seed of node `id` (fixed, so separate processes
/// agree on the node map's public keys).
pub fn test_identity_seed(id: u16) -> [u8; 32] {
    let mut seed = [0x5e; 32];
    seed[..2].copy_from_slice(&id.to_le_bytes());
    seed
}

/// Gives `c` identity keys: its own (from [`test_identity_seed`]) and every
/// node-map entry's public key.
pub fn with_test_identities(c: &mut Config) {
    use dxnet::proto::identity::Identity;
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    c.identity_key = Some(hex(&test_identity_seed(c.node_id)));
    for n in &mut c.nodes {
        let pk = Identity::from_keys(test_identity_seed(n.id), &[])
            .unwrap()
            .public_key();
        n.public_key = Some(hex(&pk));
    }
}

pub fn start_all(cfgs: Vec<Config>) -> Vec<Arc<Node>> {
    cfgs.into_iter()
        .map(|c| Arc::new(Node::start(c).unwrap()))
        .collect()
}

/// A thread's random in-place accesses (`write_from`, `read_into`, their
/// async forms and the notifying write) between its slice
/// `[local_base, local_base + slice)` of the own region `local` and its
/// slice `[base, base + slice)` of `remote`: each write's bytes are staged
/// in `local` first, each read-back lands in another part of `local` and
/// is checked byte for byte. Returns the remote slice as the thread wrote
/// it.
pub fn in_place_phase(
    node: &Node,
    remote: &dxnet::RemoteRegion,
    local: &dxnet::Region,
    t: u64,
    (base, local_base, slice): (usize, usize, usize),
    ops: u64,
) -> Vec<u8> {
    let half = slice / 2;
    let mut shadow = vec![0u8; slice];
    let mut rng = Rng::new(t + 77);
    let mut next = move || rng.next_u64();
    for i in 0..ops {
        let len = match next() % 6 {
            0 => 1,
            1 => 1 + (next() % (half as u64)) as usize,
            _ => 1 + (next() % 9000) as usize,
        };
        let off = (next() % (slice - len + 1) as u64) as usize;
        // The source: somewhere in the first half of the local slice.
        let src = local_base + (next() % (half - len + 1) as u64) as usize;
        let data = pattern(9, t as u16, i, len);
        local.write(src, &data).unwrap();
        let at = (base + off) as u64;
        match i % 3 {
            0 => node.write_from(remote, at, local, src, len).unwrap(),
            1 => node
                .write_from_async(remote, at, local, src, len)
                .unwrap()
                .wait()
                .unwrap(),
            _ => node
                .write_with_notify_from(remote, at, local, src, len, i as u32)
                .unwrap(),
        }
        shadow[off..off + len].copy_from_slice(&data);
        // The read-back: into the second half.
        let dst = local_base + half + (next() % (half - len + 1) as u64) as usize;
        if i % 2 == 0 {
            node.read_into(remote, at, local, dst, len).unwrap();
        } else {
            node.read_into_async(remote, at, local, dst, len)
                .unwrap()
                .wait()
                .unwrap();
        }
        let mut back = vec![0u8; len];
        local.read(dst, &mut back).unwrap();
        assert!(
            back == data,
            "thread {t} op {i}: in-place read-back of {len} B at {off}"
        );
    }
    shadow
}

/// A thread's random accesses from and into reused [`dxnet::Buffer`]s
/// (`write_buffer`, its async and notifying forms, `read_buffer` and its
/// async form) within its slice `[base, base + slice)` of `remote`: a few
/// buffers per size are reused (what the zero-copy policy registers), some
/// are fresh, some are dropped and replaced (their addresses reused), and
/// a buffer is changed right after each write returns or hands it back.
/// Every read-back is checked byte for byte. Returns the slice as the
/// thread wrote it, and how many notifying writes it made.
pub fn buffer_phase(
    node: &Node,
    remote: &dxnet::RemoteRegion,
    t: u64,
    (base, slice): (usize, usize),
    ops: u64,
) -> (Vec<u8>, u64) {
    use dxnet::Buffer;
    let mut shadow = vec![0u8; slice];
    let mut rng = Rng::new(t + 91);
    let mut next = move || rng.next_u64();
    const SIZES: [usize; 4] = [200, 4096, 8192, 100_000];
    // Two buffers per size, reused across the phase.
    let mut pool: Vec<Buffer> = SIZES
        .iter()
        .flat_map(|&n| [Buffer::new(n), Buffer::new(n)])
        .collect();
    let mut notified = 0;
    for i in 0..ops {
        let k = (next() % pool.len() as u64) as usize;
        if i % 17 == 16 {
            // Dropped and replaced: a new buffer, likely at the old address.
            let len = pool[k].len();
            pool[k] = Buffer::new(len);
        }
        let fresh = i % 11 == 10;
        let mut src = if fresh {
            Buffer::from(vec![0u8; pool[k].len()])
        } else {
            std::mem::replace(&mut pool[k], Buffer::new(0))
        };
        let len = src.len();
        let off = (next() % (slice - len + 1) as u64) as usize;
        let data = pattern(11, t as u16, i, len);
        src.copy_from_slice(&data);
        let at = (base + off) as u64;
        let src = match i % 4 {
            0 => {
                node.write_buffer(remote, at, &src).unwrap();
                src
            }
            1 => {
                let (res, back) = node.write_buffer_async(remote, at, src).wait();
                res.unwrap();
                back
            }
            2 => {
                notified += 1;
                node.write_with_notify_buffer(remote, at, &src, i as u32)
                    .unwrap();
                src
            }
            _ => {
                notified += 1;
                let (res, back) = node
                    .write_with_notify_buffer_async(remote, at, src, i as u32)
                    .wait();
                res.unwrap();
                back
            }
        };
        shadow[off..off + len].copy_from_slice(&data);
        // Changed at once: the written bytes must not change with it.
        let mut src = src;
        src.fill(0xEE);
        // The read-back, into another reused buffer of the same size.
        let other = if k.is_multiple_of(2) { k + 1 } else { k - 1 };
        let mut dst = std::mem::replace(&mut pool[other], Buffer::new(0));
        if i % 2 == 0 {
            node.read_buffer(remote, at, &mut dst).unwrap();
        } else {
            let (res, back) = node.read_buffer_async(remote, at, dst).wait();
            res.unwrap();
            dst = back;
        }
        assert!(
            dst[..] == data[..],
            "thread {t} op {i}: read-back of {len} B at {off} into a buffer"
        );
        pool[other] = dst;
        if !fresh {
            pool[k] = src;
        }
    }
    (shadow, notified)
}

/// Raw message type of [`buffer_sends`].
pub const BUFFER_MSG: (u8, u8) = (61, 1);

/// Checks the messages [`buffer_sends`] sends: per sending thread in
/// order, each exactly once, its bytes intact.
#[derive(Default)]
pub struct BufferSendLog {
    next: Mutex<HashMap<(u16, u32), u64>>,
    bad: Mutex<Vec<String>>,
    pub received: AtomicU64,
}

impl BufferSendLog {
    /// Registers the checking receiver on `node`.
    pub fn register(node: &Node) -> Arc<BufferSendLog> {
        Self::register_slow(node, Duration::ZERO)
    }

    /// [`BufferSendLog::register`] with a receiver that takes `per_message`
    /// for each message (the sender's socket fills up).
    pub fn register_slow(node: &Node, per_message: Duration) -> Arc<BufferSendLog> {
        let log = Arc::new(BufferSendLog::default());
        let l = log.clone();
        node.register_raw(BUFFER_MSG.0, BUFFER_MSG.1, move |src, p| {
            if !per_message.is_zero() {
                std::thread::sleep(per_message);
            }
            l.check(src.0, p)
        })
        .unwrap();
        log
    }

    /// Checks one received message (for a test's own receiver).
    pub fn check_message(&self, src: u16, p: &[u8]) {
        self.check(src, p)
    }

    fn check(&self, src: u16, p: &[u8]) {
        let problem = (|| {
            let head = p.get(..16).ok_or("shorter than its header")?;
            let t = u32::from_le_bytes(head[..4].try_into().unwrap());
            let seq = u64::from_le_bytes(head[4..12].try_into().unwrap());
            let len = u32::from_le_bytes(head[12..16].try_into().unwrap()) as usize;
            if len != p.len() {
                return Err(format!(
                    "thread {t} seq {seq}: {} bytes, {len} sent",
                    p.len()
                ));
            }
            if p[16..] != pattern(src, t as u16, seq, len - 16)[..] {
                return Err(format!("thread {t} seq {seq}: bytes differ ({len} B)"));
            }
            let mut next = self.next.lock().unwrap();
            let want = next.entry((src, t)).or_insert(0);
            if seq != *want {
                return Err(format!("thread {t}: seq {seq}, {want} expected"));
            }
            *want += 1;
            Ok(())
        })();
        if let Err(e) = problem {
            self.bad.lock().unwrap().push(e);
        }
        self.received.fetch_add(1, Ordering::SeqCst);
    }

    /// Waits until `total` messages came; panics on any problem.
    pub fn expect(&self, total: u64, secs: u64) {
        wait_for(secs, "every buffer message", || {
            self.received.load(Ordering::SeqCst) >= total || !self.bad.lock().unwrap().is_empty()
        });
        let bad = self.bad.lock().unwrap();
        assert!(
            bad.is_empty(),
            "{} problems, first: {:?}",
            bad.len(),
            &bad[..bad.len().min(5)]
        );
        assert_eq!(self.received.load(Ordering::SeqCst), total);
    }
}

/// Thread `t`'s `count` messages to `dest`, most from a few reused
/// [`dxnet::Buffer`]s (`send_buffer`, and `send_buffer_async` kept in
/// flight while the next messages go), every fifth through `send_raw`
/// (the ring) in between, sizes from 16 B to `max`: each buffer is
/// overwritten right after its send returns or hands it back, so a send
/// that let go of it before the device read the bytes shows as corrupt
/// at the receiver.
/// Message `seq` of thread `t` of node `own` for [`BufferSendLog`], `len`
/// bytes (at least 16).
pub fn buffer_message(own: u16, t: u32, seq: u64, len: usize) -> Vec<u8> {
    let mut msg = Vec::with_capacity(len);
    msg.extend_from_slice(&t.to_le_bytes());
    msg.extend_from_slice(&seq.to_le_bytes());
    msg.extend_from_slice(&(len as u32).to_le_bytes());
    msg.extend_from_slice(&pattern(own, t as u16, seq, len - 16));
    msg
}

pub fn buffer_sends(node: &Node, dest: NodeId, t: u32, count: u64, max: usize) {
    use dxnet::Buffer;
    let own = node.id().0;
    let sizes = [16usize, 200, 4096, 8192, max];
    let mut pool: Vec<Buffer> = sizes.iter().map(|&n| Buffer::new(n)).collect();
    let mut rng = Rng::new(t as u64 + 5);
    // An async send in flight while the next messages go: its buffer's
    // place in the pool, and its handle.
    let mut pending: Option<(usize, dxnet::SendHandle)> = None;
    for seq in 0..count {
        let k = (rng.next_u64() % pool.len() as u64) as usize;
        if let Some((at, h)) = pending.take_if(|(at, _)| *at == k) {
            let (res, mut back) = h.wait();
            res.unwrap();
            back.fill(0xEE);
            pool[at] = back;
        }
        let len = pool[k].len();
        let msg = buffer_message(own, t, seq, len);
        if seq % 5 == 4 {
            node.send_raw(dest, BUFFER_MSG.0, BUFFER_MSG.1, &msg)
                .unwrap();
            continue;
        }
        pool[k].copy_from_slice(&msg);
        if seq % 5 == 2 && pending.is_none() {
            let b = std::mem::replace(&mut pool[k], Buffer::new(0));
            pending = Some((
                k,
                node.send_buffer_async(dest, BUFFER_MSG.0, BUFFER_MSG.1, b),
            ));
            continue;
        }
        node.send_buffer(dest, BUFFER_MSG.0, BUFFER_MSG.1, &pool[k])
            .unwrap();
        pool[k].fill(0xEE);
    }
    if let Some((_, h)) = pending {
        h.wait().0.unwrap();
    }
}

/// CPU time (user and system) used by this process so far: for tests that
/// check that idle or waiting threads park (alone in their binary).
pub fn cpu_time() -> Duration {
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a rusage struct.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}
