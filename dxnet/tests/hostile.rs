//! Hostile peers against a TCP cluster.
//!
//! A legit cluster (nodes 0 and 1 of a 10-node map, TCP on 127.0.0.1) is
//! attacked by a raw socket in the test acting as an independent peer:
//! random bytes, garbage after a valid handshake, 4 GiB and over-limit
//! lengths, truncated frames, unknown message types, a peer that never
//! reads, thousands of half-open connections (legit nodes in a child
//! process, to measure their memory), and, with a cluster secret, outsiders
//! and a member claiming a running node's id. For every scenario: the
//! hostile connection is closed within a few seconds (where it violates the
//! protocol), the node logs why, nothing panics, and the two legit nodes keep
//! answering each other's requests during and after the attack (a probe
//! thread runs requests both ways all along and must see no failure).

mod common;

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::proc::*;
use common::*;
use dxnet::message::{MessageHeader, FLAG_ERROR, FLAG_REQUEST, FLAG_RESPONSE, HEADER_LEN};
use dxnet::proto::codec;
use dxnet::proto::decoder::Decoder;
use dxnet::proto::wire::{
    self, encode_chunk_header, ChunkParser, HandshakeMsg, Hello, Status, HANDSHAKE_LEN,
    HANDSHAKE_MAGIC, PROTOCOL_VERSION,
};
use dxnet::{Config, Error, Node, NodeId};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Ping(u32);
#[derive(Serialize, Deserialize, Debug)]
struct Pong(u32);
dxnet::message!(Pong, 21, 2);
dxnet::request!(Ping, 21, 1 => Pong);

/// Raw message type the legit nodes count (payload ignored).
const COUNTED: (u8, u8) = (22, 1);
/// Ids in the node map; only 0 and 1 run, the others are free to claim.
const MAP: u16 = 10;

// ----- log capture -------------------------------------------------------------

static LOGS: Mutex<String> = Mutex::new(String::new());

struct LogSink;

impl Write for LogSink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let s = String::from_utf8_lossy(b);
        if std::env::var("DXNET_TEST_LOG").is_ok() {
            eprint!("{s}");
        }
        LOGS.lock().unwrap().push_str(&s);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn init_logs() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = tracing_subscriber::fmt()
            .with_writer(|| LogSink)
            .with_ansi(false)
            .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
            .try_init();
    });
}

/// Waits until the captured log has a line containing every one of `parts`;
/// returns that line.
fn wait_log(parts: &[&str], secs: u64) -> String {
    let end = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(l) = LOGS
            .lock()
            .unwrap()
            .lines()
            .find(|l| parts.iter().all(|p| l.contains(p)))
        {
            return l.to_string();
        }
        assert!(
            Instant::now() < end,
            "no log line with {parts:?} within {secs} s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ----- the legit cluster ---------------------------------------------------------

struct Cluster {
    nodes: Vec<Arc<Node>>,
    base: u16,
    counted: Arc<AtomicU64>,
}

fn test_config(id: u16, base: u16) -> Config {
    let mut c = Config::tcp_localhost(id, MAP, base);
    // Generous: the box may be loaded by other work (debug builds, 2 cores).
    c.limits.connect_timeout_ms = 1500;
    c.limits.send_timeout_ms = 500;
    c.limits.request_timeout_ms = 2000;
    c.park.spin_us = 20;
    c.park.yield_us = 200;
    c
}

fn cluster(tweak: impl Fn(&mut Config)) -> Cluster {
    init_logs();
    let base = base_port(MAP);
    let counted = Arc::new(AtomicU64::new(0));
    let nodes: Vec<Arc<Node>> = (0..2)
        .map(|i| {
            let mut c = test_config(i, base);
            tweak(&mut c);
            let n = Arc::new(Node::start(c).unwrap());
            n.register_request(|_, p: Ping| Pong(p.0 + 1)).unwrap();
            let k = counted.clone();
            n.register_raw(COUNTED.0, COUNTED.1, move |_, _| {
                k.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
            n
        })
        .collect();
    let c = Cluster {
        nodes,
        base,
        counted,
    };
    c.check_legit();
    c
}

impl Cluster {
    /// Both legit nodes answer each other.
    fn check_legit(&self) {
        legit_exchange(&self.nodes);
    }

    fn probe(&self) -> Probe {
        Probe::start(self.nodes.clone())
    }

    fn connect(&self, node: u16) -> TcpStream {
        let s = TcpStream::connect(("127.0.0.1", self.base + node)).unwrap();
        s.set_nodelay(true).unwrap();
        s
    }
}

fn legit_exchange(nodes: &[Arc<Node>]) {
    for (a, b) in [(0, 1), (1, 0)] {
        let r = nodes[a]
            .request(NodeId(b as u16), &Ping(7), Duration::from_secs(3))
            .unwrap_or_else(|e| panic!("legit request {a} -> {b}: {e}"));
        assert_eq!(r.0, 8);
    }
}

/// Requests between the legit nodes, both ways, all along an attack.
struct Probe {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<(u64, Vec<String>, Duration)>,
}

impl Probe {
    fn start(nodes: Vec<Arc<Node>>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            let (mut ok, mut errs, mut worst) = (0u64, Vec::new(), Duration::ZERO);
            let mut i = 0u32;
            while !s.load(Ordering::SeqCst) {
                let (a, b) = if i.is_multiple_of(2) { (0, 1) } else { (1, 0) };
                let t = Instant::now();
                match nodes[a].request(NodeId(b), &Ping(i), Duration::from_secs(5)) {
                    Ok(p) if p.0 == i + 1 => ok += 1,
                    Ok(p) => errs.push(format!("{a}->{b}: wrong answer {}", p.0)),
                    Err(e) => errs.push(format!("{a}->{b}: {e}")),
                }
                worst = worst.max(t.elapsed());
                i += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            (ok, errs, worst)
        });
        Self { stop, handle }
    }

    /// Stops the probe; asserts every request was answered. Returns (count,
    /// slowest request).
    fn finish(self) -> (u64, Duration) {
        self.stop.store(true, Ordering::SeqCst);
        let (ok, errs, worst) = self.handle.join().expect("probe panicked");
        assert!(
            errs.is_empty(),
            "legit requests failed during the attack: {errs:?}"
        );
        assert!(ok > 0, "probe made no request");
        (ok, worst)
    }
}

// ----- the hostile peer -----------------------------------------------------------

fn random_u64() -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u64(unix_ms());
    h.finish()
}

/// Deterministic pseudo-random bytes (xorshift).
fn noise(seed: u64, len: usize) -> Vec<u8> {
    Rng::from_state(seed | 1).bytes(len)
}

fn hello(claim: u16, target: u16, window: u32) -> Hello {
    Hello {
        node_id: claim,
        target_id: target,
        instance: random_u64() | 1,
        fc_window: window,
        fc_unit: window / 2,
        nonce: noise(random_u64(), 16).try_into().unwrap(),
        codec: codec::CODEC_ID,
        endpoint: [0; wire::ENDPOINT_LEN],
    }
}

fn read_hs(s: &mut TcpStream) -> Result<HandshakeMsg, String> {
    let mut b = [0u8; HANDSHAKE_LEN];
    s.read_exact(&mut b).map_err(|e| format!("read: {e}"))?;
    HandshakeMsg::decode(&b).map_err(|e| e.to_string())
}

/// Dialer side of the handshake claiming node id `claim` (the acceptor is
/// `target`), proving `secret` if given. Returns the acceptor's final status.
fn handshake(
    s: &mut TcpStream,
    claim: u16,
    target: u16,
    window: u32,
    secret: Option<&[u8]>,
) -> Result<Status, String> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mine = hello(claim, target, window);
    s.write_all(&HandshakeMsg::Hello(mine).encode())
        .map_err(|e| e.to_string())?;
    let theirs = match read_hs(s)? {
        HandshakeMsg::Reply(h, _) => h,
        HandshakeMsg::Final(st) => return Ok(st),
        m => return Err(format!("unexpected {m:?}")),
    };
    assert_eq!(theirs.node_id, target);
    let p = wire::proof(secret, b"dialer", &mine, &theirs);
    s.write_all(&HandshakeMsg::Proof(p).encode())
        .map_err(|e| e.to_string())?;
    match read_hs(s)? {
        HandshakeMsg::Final(st) => Ok(st),
        m => Err(format!("unexpected {m:?}")),
    }
}

/// A hostile connection that completed the handshake as node `claim`.
fn joined(c: &Cluster, claim: u16, window: u32) -> TcpStream {
    let mut s = c.connect(0);
    assert_eq!(
        handshake(&mut s, claim, 0, window, None),
        Ok(Status::Accept)
    );
    s
}

fn msg(t: u8, sub: u8, flags: u8, id: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = [0u8; HEADER_LEN];
    MessageHeader {
        msg_type: t,
        subtype: sub,
        flags,
        request_id: id,
        payload_len: payload.len() as u32,
    }
    .encode(&mut b);
    let mut v = b.to_vec();
    v.extend_from_slice(payload);
    v
}

fn chunk(data: &[u8]) -> Vec<u8> {
    let mut v = encode_chunk_header(data.len() as u32, 0).to_vec();
    v.extend_from_slice(data);
    v
}

/// Reads (discarding) until the node closes the connection; panics if it
/// is still open after `secs`. Returns how long it took.
fn assert_closed(s: &mut TcpStream, secs: u64) -> Duration {
    let t = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return t.elapsed(),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return t.elapsed(), // reset
        }
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "hostile connection still open after {secs} s"
        );
    }
}

/// Reads the node's messages to a hostile peer with dxnet's own parsers.
struct Inbound {
    parser: ChunkParser,
    dec: Decoder,
    got: Vec<(MessageHeader, Vec<u8>)>,
}

impl Inbound {
    fn new() -> Self {
        Self {
            parser: ChunkParser::default(),
            dec: Decoder::new(1 << 20),
            got: Vec::new(),
        }
    }

    /// Reads until `pred` holds for the messages so far (panics after `secs`).
    fn read_until(
        &mut self,
        s: &mut TcpStream,
        secs: u64,
        pred: impl Fn(&[(MessageHeader, Vec<u8>)]) -> bool,
    ) {
        let end = Instant::now() + Duration::from_secs(secs);
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut buf = vec![0u8; 64 << 10];
        while !pred(&self.got) {
            assert!(Instant::now() < end, "expected messages not received");
            let n = match s.read(&mut buf) {
                Ok(0) => panic!("node closed the connection"),
                Ok(n) => n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    continue
                }
                Err(e) => panic!("read: {e}"),
            };
            let mut ranges = Vec::new();
            self.parser.parse(&buf[..n], |r| ranges.push(r), |_| ());
            for r in ranges {
                let got = &mut self.got;
                self.dec
                    .feed(&buf[r], |h, p| got.push((*h, p.to_vec())))
                    .expect("node sent a bad stream");
            }
        }
    }
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    let mut out = Vec::new();
    codec::encode_into(&mut out, v).unwrap();
    out
}

// ----- scenarios ------------------------------------------------------------------

#[test]
fn random_bytes_instead_of_a_handshake() {
    let c = cluster(|_| {});
    let probe = c.probe();

    // Plenty of random bytes: rejected at the magic at once.
    let mut s = c.connect(0);
    let from = s.local_addr().unwrap().to_string();
    let mut junk = noise(1, 4096);
    junk[0] = b'X';
    let _ = s.write_all(&junk);
    let t = assert_closed(&mut s, 3);
    wait_log(&[&from, "bad handshake magic"], 3);
    println!("random bytes: closed after {t:?}");

    // A few random bytes: rejected at the magic too (checked as soon as
    // it is in).
    let mut s = c.connect(0);
    let from = s.local_addr().unwrap().to_string();
    let mut few = noise(2, 40);
    few[0] = b'X';
    s.write_all(&few).unwrap();
    let t = assert_closed(&mut s, 3);
    wait_log(&[&from, "bad handshake magic"], 3);
    println!("40 random bytes: closed after {t:?}");

    // The start of a valid hello and silence: closed after
    // connect_timeout_ms.
    let mut s = c.connect(0);
    let from = s.local_addr().unwrap().to_string();
    s.write_all(&HandshakeMsg::Hello(hello(1, 0, 4096)).encode()[..40])
        .unwrap();
    let t = assert_closed(&mut s, 5);
    wait_log(&[&from, "handshake read"], 3);
    assert!(t >= Duration::from_millis(1400), "closed after {t:?}");
    println!("40 bytes of a hello then silence: closed after {t:?}");

    // Valid magic and version, garbage kind.
    let mut s = c.connect(0);
    let from = s.local_addr().unwrap().to_string();
    let mut b = noise(3, HANDSHAKE_LEN);
    b[..8].copy_from_slice(&HANDSHAKE_MAGIC);
    b[8..10].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    b[10] = 77;
    s.write_all(&b).unwrap();
    assert_closed(&mut s, 3);
    wait_log(&[&from, "unexpected handshake message kind 77"], 3);

    // Well-formed hellos the node must refuse.
    for (claim, target, want) in [
        (999, 0, Status::UnknownNode),
        (0, 0, Status::UnknownNode),
        (5, 1, Status::WrongTarget),
    ] {
        let mut s = c.connect(0);
        assert_eq!(handshake(&mut s, claim, target, 1 << 20, None), Ok(want));
        assert_closed(&mut s, 3);
    }

    let (n, worst) = probe.finish();
    println!("probe: {n} requests, slowest {worst:?}");
    c.check_legit();
}

#[test]
fn valid_handshake_then_garbage() {
    let c = cluster(|_| {});
    let probe = c.probe();

    let mut s = joined(&c, 2, 1 << 20);
    s.write_all(b"GET / HTTP/1.1\r\nHost: dxnet\r\n\r\n")
        .unwrap();
    let t = assert_closed(&mut s, 3);
    wait_log(&["protocol error from node 2", "bad header magic"], 3);
    println!("HTTP after handshake: closed after {t:?}");

    let mut s = joined(&c, 3, 1 << 20);
    let _ = s.write_all(&noise(4, 10_000));
    let t = assert_closed(&mut s, 3);
    wait_log(&["protocol error from node 3"], 3);
    println!("random bytes after handshake: closed after {t:?}");

    // Valid chunking, garbage flags in a message header.
    let mut s = joined(&c, 4, 1 << 20);
    let mut m = msg(COUNTED.0, COUNTED.1, 0, 0, &[1, 2, 3]);
    m[3] = 0x80;
    s.write_all(&chunk(&m)).unwrap();
    assert_closed(&mut s, 3);
    wait_log(&["protocol error from node 4", "bad header flags 0x80"], 3);

    probe.finish();
    c.check_legit();
    assert_eq!(c.counted.load(Ordering::SeqCst), 0);
}

#[test]
fn four_gib_and_over_limit_lengths() {
    let c = cluster(|c| c.limits.max_message_size = 1 << 20);
    let probe = c.probe();

    // Message header claiming a 4 GiB payload.
    let mut s = joined(&c, 2, 1 << 20);
    let mut h = msg(COUNTED.0, COUNTED.1, 0, 0, &[]);
    h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    s.write_all(&chunk(&h)).unwrap();
    let t = assert_closed(&mut s, 3);
    wait_log(
        &[
            "protocol error from node 2",
            "payload length 4294967295 exceeds max_message_size 1048576",
        ],
        3,
    );
    println!("4 GiB payload length: closed after {t:?}");

    // One byte over max_message_size.
    let mut s = joined(&c, 3, 1 << 20);
    let mut h = msg(COUNTED.0, COUNTED.1, 0, 0, &[]);
    h[8..12].copy_from_slice(&((1u32 << 20) + 1).to_le_bytes());
    s.write_all(&chunk(&h)).unwrap();
    assert_closed(&mut s, 3);
    wait_log(&["protocol error from node 3", "payload length 1048577"], 3);

    // A 4 GiB chunk length allocates nothing: the messages in it arrive.
    let mut s = joined(&c, 4, 1 << 20);
    let mut v = encode_chunk_header(u32::MAX, 0).to_vec();
    for _ in 0..3 {
        v.extend(msg(COUNTED.0, COUNTED.1, 0, 0, &[9; 100]));
    }
    s.write_all(&v).unwrap();
    wait_for(3, "messages in a 4 GiB chunk", || {
        c.counted.load(Ordering::SeqCst) == 3
    });
    // A payload of exactly the limit, of which only 1000 bytes come: the
    // node waits for the rest (legal), buffering what arrived, then the
    // peer leaves.
    let mut h = msg(COUNTED.0, COUNTED.1, 0, 0, &[]);
    h[8..12].copy_from_slice(&(1u32 << 20).to_le_bytes());
    s.write_all(&h).unwrap();
    s.write_all(&[5; 1000]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    s.shutdown(Shutdown::Both).unwrap();
    wait_log(
        &["connection to node 4 closed", "peer closed the connection"],
        3,
    );
    assert_eq!(c.counted.load(Ordering::SeqCst), 3);

    probe.finish();
    c.check_legit();
}

#[test]
fn truncated_frames_then_close() {
    let c = cluster(|_| {});
    let probe = c.probe();

    // Half a message, then close.
    let mut s = joined(&c, 2, 1 << 20);
    let m = msg(COUNTED.0, COUNTED.1, 0, 0, &[1; 88]);
    let mut v = encode_chunk_header(100, 0).to_vec();
    v.extend_from_slice(&m[..50]);
    s.write_all(&v).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(s);
    wait_log(
        &["connection to node 2 closed: peer closed the connection"],
        3,
    );

    // Three bytes of a chunk header, then close.
    let mut s = joined(&c, 3, 1 << 20);
    s.write_all(&[1, 0, 0]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(s);
    wait_log(
        &["connection to node 3 closed: peer closed the connection"],
        3,
    );

    // Half a hello, then close.
    let mut s = c.connect(0);
    let from = s.local_addr().unwrap().to_string();
    s.write_all(&HandshakeMsg::Hello(hello(4, 0, 1 << 20)).encode()[..50])
        .unwrap();
    drop(s);
    wait_log(&[&from, "handshake read"], 3);

    // A hello, the reply read, then close instead of the proof.
    let mut s = c.connect(0);
    let from = s.local_addr().unwrap().to_string();
    s.write_all(&HandshakeMsg::Hello(hello(5, 0, 1 << 20)).encode())
        .unwrap();
    assert!(matches!(read_hs(&mut s), Ok(HandshakeMsg::Reply(..))));
    drop(s);
    wait_log(&[&from, "handshake read"], 3);

    probe.finish();
    c.check_legit();
    assert_eq!(c.counted.load(Ordering::SeqCst), 0, "no partial message");
}

#[test]
fn unknown_message_types_are_counted_and_the_connection_kept() {
    let c = cluster(|_| {});
    let mut s = joined(&c, 2, 1 << 20);
    let mut v = Vec::new();
    v.extend(msg(200, 1, 0, 0, &[1, 2, 3])); // unknown type
    v.extend(msg(0, 0, 0, 0, &[])); // reserved type 0
    v.extend(msg(21, 9, 0, 0, &[7; 10])); // known type, unknown subtype
    v.extend(msg(201, 1, FLAG_REQUEST, 77, &[])); // unknown request
    v.extend(msg(21, 2, FLAG_RESPONSE, 12345, &[0; 4])); // response to nothing
    v.extend(msg(21, 1, 0, 0, &encode(&Ping(1)))); // request without flag
    v.extend(msg(21, 1, FLAG_REQUEST, 78, &[0x80])); // undecodable request (a varint cut short)
    s.write_all(&chunk(&v)).unwrap();
    wait_for(3, "unknown messages counted", || {
        c.nodes[0].stats().unknown_messages == 4
    });

    // The error responses come back on the same connection...
    let mut inb = Inbound::new();
    let has = |g: &[(MessageHeader, Vec<u8>)], id: u32| g.iter().any(|(h, _)| h.request_id == id);
    inb.read_until(&mut s, 3, |g| has(g, 77) && has(g, 78));
    let (h, p) = inb.got.iter().find(|(h, _)| h.request_id == 77).unwrap();
    assert_eq!(h.flags, FLAG_RESPONSE | FLAG_ERROR);
    assert_eq!(p, &[1, 201, 1], "unknown-type error response");
    let (h, p) = inb.got.iter().find(|(h, _)| h.request_id == 78).unwrap();
    assert_eq!(h.flags, FLAG_RESPONSE | FLAG_ERROR);
    assert_eq!(p[0], 2, "decode error response");

    // ...and the connection still carries valid requests.
    s.write_all(&chunk(&msg(21, 1, FLAG_REQUEST, 79, &encode(&Ping(41)))))
        .unwrap();
    inb.read_until(&mut s, 3, |g| has(g, 79));
    let (h, p) = inb.got.iter().find(|(h, _)| h.request_id == 79).unwrap();
    assert_eq!((h.msg_type, h.subtype, h.flags), (21, 2, FLAG_RESPONSE));
    assert_eq!(p, &encode(&Pong(42)));
    assert_eq!(c.nodes[0].stats().unknown_messages, 4);

    // A flood of one unknown type: all counted, logged at warn level once.
    let flood: Vec<u8> = (0..500).flat_map(|_| msg(202, 7, 0, 0, &[9; 5])).collect();
    s.write_all(&chunk(&flood)).unwrap();
    wait_for(3, "flood counted", || {
        c.nodes[0].stats().unknown_messages == 504
    });
    wait_log(&["unknown type (202, 7)"], 3);
    let warned = LOGS
        .lock()
        .unwrap()
        .lines()
        .filter(|l| l.contains("unknown type (202, 7)"))
        .count();
    assert_eq!(warned, 1, "one warning for 500 unknown messages");
    c.check_legit();
}

/// Sends 16 KiB messages from `node` to `dest` until one fails; returns the
/// error and how long the failing call blocked.
fn send_until_error(node: &Node, dest: u16) -> (Error, Duration, u64) {
    let payload = vec![1u8; 16 << 10];
    let mut sent = 0u64;
    loop {
        let t = Instant::now();
        match node.send_raw(NodeId(dest), COUNTED.0, COUNTED.1, &payload) {
            Ok(()) => sent += 1,
            Err(e) => return (e, t.elapsed(), sent),
        }
        assert!(
            sent < 100_000,
            "sends to a peer that never reads never block"
        );
    }
}

#[test]
fn peer_that_never_reads() {
    let c = cluster(|c| c.limits.orb_size = 64 << 10);
    let probe = c.probe();
    let node = &c.nodes[0];

    // Huge announced window: the ring buffer and socket buffers fill.
    let s2 = joined(&c, 2, u32::MAX);
    let (e, blocked, sent) = send_until_error(node, 2);
    println!("never-reading peer, big window: {e} after {sent} sends; blocked {blocked:?}");
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    assert!(
        blocked >= Duration::from_millis(450) && blocked < Duration::from_millis(2500),
        "blocked {blocked:?} with send_timeout_ms = 500"
    );

    // Small announced window: flow control blocks.
    let s3 = joined(&c, 3, 4096);
    let (e, blocked, sent) = send_until_error(node, 3);
    println!("never-reading peer, 4 KiB window: {e} after {sent} sends; blocked {blocked:?}");
    assert_eq!(e, Error::Timeout(dxnet::Waited::FlowControl));
    assert!(
        blocked >= Duration::from_millis(450) && blocked < Duration::from_millis(2500),
        "blocked {blocked:?}"
    );
    // A request to it: its response never comes.
    let t = Instant::now();
    let r = node.request(NodeId(3), &Ping(1), Duration::from_millis(800));
    assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
    assert!(t.elapsed() < Duration::from_millis(2500));

    // The others are unaffected all along.
    let (n, worst) = probe.finish();
    println!("probe: {n} requests, slowest {worst:?}");
    c.check_legit();

    // The peer leaves: the node notices and sends fail cleanly.
    drop(s2);
    drop(s3);
    wait_for(3, "unreachable after the peer left", || {
        matches!(
            node.send_raw(NodeId(3), COUNTED.0, COUNTED.1, &[0]),
            Err(Error::Unreachable(..))
        )
    });
}

#[test]
fn peer_that_floods_requests_and_never_reads() {
    // A long send timeout: a handler blocked on a response to the flooder
    // must not stall the other connections for that long (with the default
    // two handler threads; with one, the first blocked response stalls the
    // node for one send timeout, see FAULTS.md).
    let c = cluster(|c| c.limits.send_timeout_ms = 5000);
    let probe = c.probe();
    let mut s = joined(&c, 2, 4096);
    s.set_write_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut batch = Vec::new();
    for i in 0..1000 {
        batch.extend(msg(21, 1, FLAG_REQUEST, i, &encode(&Ping(i))));
    }
    let batch = chunk(&batch);
    let end = Instant::now() + Duration::from_secs(3);
    let (mut written, mut off) = (0usize, 0usize);
    while Instant::now() < end {
        match s.write(&batch[off..]) {
            Ok(n) => {
                written += n;
                off = (off + n) % batch.len();
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => panic!("write: {e}"),
        }
    }
    println!("flooding peer wrote {written} bytes of requests in 3 s");
    let (n, worst) = probe.finish();
    println!("probe during the flood: {n} requests, slowest {worst:?}");
    assert!(worst < Duration::from_millis(2500), "slowest {worst:?}");
    c.check_legit();
}

#[test]
fn outsider_without_the_secret_is_rejected() {
    let c = cluster(|c| c.cluster_secret = Some("s3cret".into()));
    let probe = c.probe();
    for (claim, secret) in [(2, None), (3, Some(&b"wrong"[..])), (1, None)] {
        let mut s = c.connect(0);
        assert_eq!(
            handshake(&mut s, claim, 0, 1 << 20, secret),
            Ok(Status::AuthFailed)
        );
        assert_closed(&mut s, 3);
        wait_log(
            &[&format!("rejected node {claim}: authentication failed")],
            3,
        );
    }
    // The secret works (sanity check of the hostile's handshake).
    let mut s = c.connect(0);
    assert_eq!(
        handshake(&mut s, 4, 0, 1 << 20, Some(b"s3cret")),
        Ok(Status::Accept)
    );
    probe.finish();
    c.check_legit();
}

#[test]
fn member_with_the_secret_cannot_hijack_a_running_node() {
    let c = cluster(|c| c.cluster_secret = Some("s3cret".into()));
    let probe = c.probe();
    // Claim node 1 (running, connected to node 0) with a new instance id.
    let mut s = c.connect(0);
    let st = handshake(&mut s, 1, 0, 1 << 20, Some(b"s3cret"));
    println!("hijack attempt: {st:?}");
    // Whatever the node answered, node 0's messages to node 1 keep reaching
    // node 1, not the impostor.
    let before = c.counted.load(Ordering::SeqCst);
    for _ in 0..50 {
        c.nodes[0]
            .send_raw(NodeId(1), COUNTED.0, COUNTED.1, &[1])
            .unwrap();
    }
    wait_for(3, "node 1 receives node 0's messages", || {
        c.counted.load(Ordering::SeqCst) == before + 50
    });
    assert_eq!(st, Ok(Status::Duplicate), "impostor accepted as node 1");
    assert_closed(&mut s, 3);
    wait_log(&["refused a second connection claiming to be node 1"], 3);
    probe.finish();
    c.check_legit();
}

// ----- thousands of half-open connections (legit nodes in a child) ------------

#[test]
fn child_half_open_target() {
    if !is_child() {
        return;
    }
    let base: u16 = env_parse("BASE");
    let nodes: Vec<Arc<Node>> = (0..2)
        .map(|i| {
            let n = Arc::new(Node::start(test_config(i, base)).unwrap());
            n.register_request(|_, p: Ping| Pong(p.0 + 1)).unwrap();
            n
        })
        .collect();
    legit_exchange(&nodes);
    let (rss0, threads0) = (rss_kib(), threads());
    println!("READY rss_kib={rss0} threads={threads0}");
    let probe = Probe::start(nodes.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let sampler = std::thread::spawn(move || {
        let (mut rss, mut thr) = (0, 0);
        while !st.load(Ordering::SeqCst) {
            rss = rss.max(rss_kib());
            thr = thr.max(threads());
            std::thread::sleep(Duration::from_millis(20));
        }
        (rss, thr)
    });
    read_command("DONE");
    stop.store(true, Ordering::SeqCst);
    let (peak_rss, peak_threads) = sampler.join().unwrap();
    let (n, worst) = probe.finish();
    legit_exchange(&nodes);
    println!(
        "CHILD OK requests={n} worst_ms={} peak_rss_kib={peak_rss} peak_threads={peak_threads} rss0_kib={rss0} threads0={threads0}",
        worst.as_millis()
    );
}

#[test]
fn thousands_of_half_open_connections() {
    init_logs();
    let base = base_port(MAP);
    let mut child = ChildProc::spawn("child_half_open_target", &[("BASE", base.to_string())]);
    child.wait_line("READY", 60);

    // The legit newcomers bind their ports before the attack's 2000 client
    // sockets take ephemeral ports (which could be theirs).
    let mut cfg = test_config(2, base);
    cfg.limits.connect_timeout_ms = 2000;
    let n2 = Node::start(cfg).unwrap();
    let newcomers: Vec<Node> = (3..MAP)
        .map(|id| Node::start(test_config(id, base)).unwrap())
        .collect();

    // 2000 connections in 4 threads: half send nothing, half a partial hello.
    let t = Instant::now();
    let socks: Vec<TcpStream> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4)
            .map(|k| {
                sc.spawn(move || {
                    let mut v = Vec::new();
                    for i in 0..500 {
                        let addr = ("127.0.0.1", base).into_addr();
                        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(3))
                        else {
                            continue;
                        };
                        if (i + k) % 2 == 0 {
                            let _ = s.write_all(
                                &HandshakeMsg::Hello(hello(2, 0, 1 << 20)).encode()[..40],
                            );
                        }
                        v.push(s);
                    }
                    v
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    println!(
        "opened {} half-open connections in {:?}",
        socks.len(),
        t.elapsed()
    );
    assert!(socks.len() >= 2000, "only {} connections", socks.len());

    // A new legit node joins while they are held open.
    let t = Instant::now();
    let during = n2.request(NodeId(0), &Ping(1), Duration::from_secs(3));
    println!(
        "new legit connection during the attack: {:?} after {:?}",
        during.as_ref().map(|p| p.0),
        t.elapsed()
    );

    // Every half-open connection is closed by the node.
    let t = Instant::now();
    let mut open: Vec<TcpStream> = socks;
    while !open.is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{} half-open connections still open",
            open.len()
        );
        open.retain(|s| {
            s.set_nonblocking(true).unwrap();
            let mut b = [0u8; 256];
            match (&*s).read(&mut b) {
                Ok(0) => false,
                Ok(_) => true,
                Err(e) if e.kind() == ErrorKind::WouldBlock => true,
                Err(_) => false,
            }
        });
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("all closed by the node within {:?}", t.elapsed());

    // A sustained attack: partial hellos opened faster than the handshake
    // timeout frees the 64 handshake slots. Connections already open keep
    // working (the child's probe), and new nodes still get in: a new
    // connection evicts the oldest handshake in progress, and a legit
    // handshake completes long before 64 newer attackers arrive (allowing
    // two retries per node for a loaded machine).
    let stop = AtomicBool::new(false);
    let (mut ok, mut failed) = (0, Vec::new());
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let mut held = std::collections::VecDeque::new();
            while !stop.load(Ordering::SeqCst) {
                if let Ok(mut s) = TcpStream::connect(("127.0.0.1", base)) {
                    let _ = s.write_all(&HandshakeMsg::Hello(hello(2, 0, 1 << 20)).encode()[..40]);
                    held.push_back(s);
                }
                if held.len() > 300 {
                    held.pop_front();
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        std::thread::sleep(Duration::from_millis(500));
        for n in &newcomers {
            for attempt in 0..3 {
                match n.request(NodeId(0), &Ping(1), Duration::from_secs(3)) {
                    Ok(_) => {
                        ok += 1;
                        break;
                    }
                    Err(e) if attempt == 2 => failed.push(e.to_string()),
                    Err(_) => {}
                }
            }
        }
        stop.store(true, Ordering::SeqCst);
    });
    println!(
        "new legit connections during a sustained half-open attack: {ok} of {} succeeded; errors: {:?}",
        MAP - 3,
        failed.first()
    );
    assert_eq!(ok, MAP - 3, "new nodes locked out by the flood: {failed:?}");

    let t = Instant::now();
    let after = until_reachable("new legit connection after the attack", || {
        n2.request(NodeId(0), &Ping(2), Duration::from_secs(3))
    });
    assert_eq!(after.0, 3);
    println!(
        "new legit connections work again {:?} after the attack",
        t.elapsed()
    );

    child.command("DONE");
    let out = child.finish(30);
    let line = out.lines().find(|l| l.starts_with("CHILD OK")).unwrap();
    println!("{line}");
    let growth = field::<u64>(line, "peak_rss_kib=") - field::<u64>(line, "rss0_kib=");
    let threads = field::<u64>(line, "peak_threads=") - field::<u64>(line, "threads0=");
    assert!(growth < 32 << 10, "node RSS grew by {growth} KiB");
    // 96 handshake threads at most (64 running, evicted ones exiting: each
    // counts until the listener joined it), plus the node's own threads
    // started for new connections.
    assert!(threads <= 128, "node started {threads} extra threads");
    assert!(field::<u64>(line, "worst_ms=") < 5000);
}

trait IntoAddr {
    fn into_addr(self) -> std::net::SocketAddr;
}

impl IntoAddr for (&str, u16) {
    fn into_addr(self) -> std::net::SocketAddr {
        std::net::ToSocketAddrs::to_socket_addrs(&self)
            .unwrap()
            .next()
            .unwrap()
    }
}
