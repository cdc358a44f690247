//! Receivers that keep their messages and their flow-control window
//! (`Node::register_raw_held`): an application queue fed by one is bounded
//! by the senders' windows, the handler threads never block on it, and
//! every message arrives once and in order after the consumer lets go.
//! Large payloads are lent from receive buffers: they stay intact while
//! held, and lending stops before it could starve the receive pool.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use dxnet::{Error, HeldMessage, NodeId, Waited};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Ask(u32);
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Answer(u32);
dxnet::message!(Answer, 44, 2);
dxnet::request!(Ask, 44, 1 => Answer);

const WINDOW: usize = 64 << 10;
const SIZE: usize = 1000;

fn payload(i: u64) -> Vec<u8> {
    let mut p = vec![(i % 251) as u8; SIZE];
    p[..8].copy_from_slice(&i.to_le_bytes());
    p
}

type Queue = Arc<Mutex<Vec<(NodeId, HeldMessage)>>>;

/// Registers a held receiver of type (`msg_type`, 0) on `node` that
/// queues every message it gets.
fn hold_into_queue(node: &dxnet::Node, msg_type: u8) -> Queue {
    let q: Queue = Arc::default();
    let q2 = q.clone();
    node.register_raw_held(msg_type, 0, move |src, m| q2.lock().unwrap().push((src, m)))
        .unwrap();
    q
}

/// Takes everything queued, checks it continues the sequence at `next`,
/// and drops the windows.
fn take_checked(q: &Queue, next: &mut u64) -> usize {
    let taken = std::mem::take(&mut *q.lock().unwrap());
    for (src, m) in &taken {
        assert_eq!(*src, NodeId(1));
        assert_eq!(
            &m[..],
            &payload(*next)[..],
            "message {next} intact and in order"
        );
        assert!(m.window_bytes() >= SIZE as u64);
        *next += 1;
    }
    taken.len()
}

fn held_windows(kind: Kind) {
    let cluster = start_all(cluster_configs(kind, 3, |c| {
        c.limits.flow_control_window = WINDOW;
        c.limits.send_timeout_ms = 300;
        c.handler_threads = 1;
    }));
    let q = hold_into_queue(&cluster[0], 50);
    cluster[0].register_request(|_, Ask(n)| Answer(n)).unwrap();

    // Nobody consumes: node 1's sends stop at its window.
    let mut sent = 0u64;
    loop {
        match cluster[1].send_raw(NodeId(0), 50, 0, &payload(sent)) {
            Ok(()) => sent += 1,
            Err(Error::Timeout(Waited::FlowControl)) => break,
            Err(e) => panic!("send {sent}: {e:?}"),
        }
        assert!(
            sent as usize <= 2 * WINDOW / SIZE,
            "the held window did not hold the sender back"
        );
    }
    assert!(
        sent as usize * SIZE <= WINDOW,
        "{sent} messages in a window"
    );
    wait_for(10, "the sent messages queued", || {
        q.lock().unwrap().len() as u64 == sent
    });
    // The one handler thread is free meanwhile: another node's request to
    // node 0 is answered.
    let r = cluster[2].request(NodeId(0), &Ask(7), Duration::from_secs(10));
    assert_eq!(r.unwrap(), Answer(7));

    // The consumer takes the messages: the window comes back and node 1
    // goes on; every message once, in order.
    let next = std::cell::Cell::new(0u64);
    let mut n = 0;
    assert_eq!(take_checked(&q, &mut n), sent as usize);
    next.set(n);
    let more = 5 * (WINDOW / SIZE) as u64;
    let sender = {
        let node = cluster[1].clone();
        std::thread::spawn(move || {
            for i in sent..sent + more {
                let mut tries = 0;
                while let Err(e) = node.send_raw(NodeId(0), 50, 0, &payload(i)) {
                    assert_eq!(e, Error::Timeout(Waited::FlowControl));
                    tries += 1;
                    assert!(tries < 100, "the window never came back");
                }
            }
        })
    };
    wait_for(30, "every message taken", || {
        let mut n = next.get();
        take_checked(&q, &mut n);
        next.set(n);
        n == sent + more
    });
    sender.join().unwrap();
}

#[test]
fn held_windows_bound_the_queue_tcp() {
    held_windows(Kind::Tcp);
}

#[test]
fn held_windows_bound_the_queue_loopback() {
    held_windows(Kind::Loopback);
}

/// Payload `i` of the lending test: 4–40 KiB, its bytes derived from `i`.
fn large_payload(i: u64) -> Vec<u8> {
    let len = 4096 + (i.wrapping_mul(0x9E37_79B9) % (36 << 10)) as usize;
    let mut p: Vec<u8> = (0..len).map(|k| (i as usize * 31 + k) as u8).collect();
    p[..8].copy_from_slice(&i.to_le_bytes());
    p
}

/// A consumer that holds every message while later ones keep arriving:
/// lent payloads stay intact (their buffers are not reused), lending stops
/// once half of the receive pool would be out, copies take over, and the
/// node keeps receiving meanwhile (another node's request is answered).
fn lent_payloads(kind: Kind) {
    const POOL: usize = 16;
    const COUNT: u64 = 300;
    let cluster = start_all(cluster_configs(kind, 3, |c| {
        c.limits.recv_pool_size = Some(POOL);
        c.limits.flow_control_window = 32 << 20;
        c.handler_threads = 1;
    }));
    let q = hold_into_queue(&cluster[0], 51);
    cluster[0].register_request(|_, Ask(n)| Answer(n)).unwrap();
    let sender = {
        let node = cluster[1].clone();
        std::thread::spawn(move || {
            for i in 0..COUNT {
                node.send_raw(NodeId(0), 51, 0, &large_payload(i)).unwrap();
            }
        })
    };
    wait_for(30, "every message held", || {
        q.lock().unwrap().len() as u64 == COUNT
    });
    sender.join().unwrap();
    // Everything is still held: the pool was not drained by the holds.
    let r = cluster[2].request(NodeId(0), &Ask(9), Duration::from_secs(10));
    assert_eq!(r.unwrap(), Answer(9));
    let held = std::mem::take(&mut *q.lock().unwrap());
    let lent = held.iter().filter(|(_, m)| m.is_lent()).count();
    for (i, (src, m)) in held.iter().enumerate() {
        assert_eq!(*src, NodeId(1));
        assert_eq!(
            &m[..],
            &large_payload(i as u64)[..],
            "message {i} intact and in order"
        );
    }
    assert!(lent > 0, "no payload was lent");
    assert!(lent < held.len(), "lending never stopped");
    drop(held);
    // The buffers came back: lending again, and still intact.
    let more = cluster[1].clone();
    more.send_raw(NodeId(0), 51, 0, &large_payload(COUNT))
        .unwrap();
    wait_for(10, "the last message", || q.lock().unwrap().len() == 1);
    let (_, m) = q.lock().unwrap().pop().unwrap();
    assert_eq!(&m[..], &large_payload(COUNT)[..]);
    assert!(m.window_bytes() >= m.len() as u64);
    // A message to the own node holds no window.
    cluster[0]
        .send_raw(NodeId(0), 51, 0, &large_payload(7))
        .unwrap();
    wait_for(10, "the own node's message", || {
        q.lock().unwrap().len() == 1
    });
    let (src, m) = q.lock().unwrap().pop().unwrap();
    assert_eq!((src, &m[..]), (NodeId(0), &large_payload(7)[..]));
    assert_eq!(m.window_bytes(), 0);
}

#[test]
fn lent_payloads_stay_intact_tcp() {
    lent_payloads(Kind::Tcp);
}

#[test]
fn lent_payloads_stay_intact_loopback() {
    lent_payloads(Kind::Loopback);
}

/// Payload `seq` of sender thread `t` in the whole-message test: `len`
/// bytes derived from both.
fn threaded_payload(t: u64, seq: u64, len: usize) -> Vec<u8> {
    let mut p: Vec<u8> = (0..len)
        .map(|k| (t * 7 + seq * 13 + k as u64) as u8)
        .collect();
    p[..8].copy_from_slice(&t.to_le_bytes());
    p[8..16].copy_from_slice(&seq.to_le_bytes());
    p
}

/// Messages of up to half a receive buffer arrive whole in one buffer over
/// TCP, wherever the stream's reads cut them: every such payload is lent
/// (none reassembled), intact and in per-thread order, while small
/// messages of another type shift where the large ones fall. Over TLS
/// (`whole` false: its messages are reassembled) the same stream arrives
/// intact and in order.
fn whole_messages(kind: Kind, whole: bool) {
    const THREADS: u64 = 4;
    const COUNT: u64 = 400;
    const BUF: usize = 64 << 10;
    // The largest message (header included) that is kept whole.
    const MAX_PAYLOAD: usize = BUF / 2 - 12;
    let cluster = start_all(cluster_configs(kind, 2, |c| {
        c.limits.recv_buffer_size = Some(BUF);
        c.handler_threads = 2;
    }));
    let next: Arc<Mutex<Vec<u64>>> = Arc::new(Mutex::new(vec![0; THREADS as usize]));
    let copies = Arc::new(Mutex::new(Vec::new()));
    {
        let (next, copies) = (next.clone(), copies.clone());
        cluster[0]
            .register_raw_held(53, 0, move |src, m| {
                assert_eq!(src, NodeId(1));
                let t = u64::from_le_bytes(m[..8].try_into().unwrap());
                let seq = u64::from_le_bytes(m[8..16].try_into().unwrap());
                let mut next = next.lock().unwrap();
                assert_eq!(seq, next[t as usize], "thread {t}: in order");
                assert_eq!(&m[..], &threaded_payload(t, seq, m.len())[..], "intact");
                next[t as usize] += 1;
                if !m.is_lent() {
                    copies.lock().unwrap().push(m.len());
                }
            })
            .unwrap();
    }
    let small = Arc::new(std::sync::atomic::AtomicU64::new(0));
    {
        let small = small.clone();
        cluster[0]
            .register_raw(54, 0, move |_, b| {
                assert!(b.iter().all(|&x| x == b.len() as u8));
                small.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
            .unwrap();
    }
    let senders: Vec<_> = (0..THREADS)
        .map(|t| {
            let node = cluster[1].clone();
            std::thread::spawn(move || {
                let mut rng = 0x2545_f491_4f6c_dd1du64 ^ (t + 1).wrapping_mul(0x9e37_79b9);
                for seq in 0..COUNT {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let len = 4096 + rng as usize % (MAX_PAYLOAD - 4096 + 1);
                    node.send_raw(NodeId(0), 53, 0, &threaded_payload(t, seq, len))
                        .unwrap();
                    let n = 1 + (rng >> 32) as usize % 200;
                    node.send_raw(NodeId(0), 54, 0, &vec![n as u8; n]).unwrap();
                }
            })
        })
        .collect();
    for s in senders {
        s.join().unwrap();
    }
    wait_for(30, "every message", || {
        next.lock().unwrap().iter().all(|&n| n == COUNT)
            && small.load(std::sync::atomic::Ordering::Relaxed) == THREADS * COUNT
    });
    let copies = copies.lock().unwrap();
    assert!(
        copies.is_empty() || !whole,
        "{} of {} payloads were copies (lengths {:?}...)",
        copies.len(),
        THREADS * COUNT,
        &copies[..copies.len().min(8)]
    );
}

#[test]
fn messages_up_to_half_a_buffer_arrive_whole_tcp() {
    whole_messages(Kind::Tcp, true);
}

#[test]
fn mixed_sizes_arrive_intact_over_tls() {
    whole_messages(Kind::TcpTls, false);
}
