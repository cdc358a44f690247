//! Pull receivers: every message once and in per-thread order with many
//! sender threads (one consumer, several consumers); a full receiver
//! slows its senders down through flow control without dropping and
//! without holding up other connections; dropping unregisters; shutdown
//! ends it after what is queued; the async forms.

mod common;

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use common::*;
use dxnet::{Error, Node, NodeId, RecvError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Ask(u32);
#[derive(Serialize, Deserialize, Debug)]
struct Answer(u32);
dxnet::message!(Answer, 43, 2);
dxnet::request!(Ask, 43, 1 => Answer);

const SENDERS: u16 = 16;
const PER: u64 = 300;

/// Nodes 1 and 2 send `SENDERS` threads × `PER` checked messages each to
/// node 0; returns once all sends returned.
fn flood(nodes: &[Arc<Node>]) {
    let threads: Vec<_> = (1..3)
        .flat_map(|n| (0..SENDERS).map(move |t| (n, t)))
        .map(|(n, t)| {
            let node = nodes[n].clone();
            std::thread::spawn(move || send_checked(&node, t, PER, 8192, |_| 0))
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

fn one_consumer_in_order(kind: Kind) {
    let nodes = start_all(cluster_configs(kind, 3, |_| {}));
    let rx = nodes[0].receiver::<Data>(8).unwrap();
    let checker = Arc::new(Checker::default());
    let consumer = {
        let checker = checker.clone();
        let rx = rx.clone();
        std::thread::spawn(move || {
            for _ in 0..2 * SENDERS as u64 * PER {
                let (from, m) = rx.recv_timeout(Duration::from_secs(60)).expect("a message");
                checker.check(from, &m);
            }
        })
    };
    flood(&nodes);
    consumer.join().unwrap();
    for from in 1..3 {
        for t in 0..SENDERS {
            assert_eq!(checker.next_seq(from, t), PER, "stream ({from}, {t})");
        }
    }
    checker.assert_ok();
    assert_eq!(checker.streams().len(), 2 * SENDERS as usize);
    assert_eq!(rx.try_recv().unwrap_err(), RecvError::Empty);
    assert_eq!(nodes[0].stats().unknown_messages, 0);
}

#[test]
fn one_consumer_gets_every_message_once_in_order_tcp() {
    one_consumer_in_order(Kind::Tcp);
}

#[test]
fn one_consumer_gets_every_message_once_in_order_loopback() {
    one_consumer_in_order(Kind::Loopback);
}

/// Four consumer threads share one receiver: together they see every
/// message exactly once.
#[test]
fn several_consumers_share_the_messages() {
    let nodes = start_all(cluster_configs(Kind::Tcp, 3, |_| {}));
    let rx = nodes[0].receiver::<Data>(4).unwrap();
    let seen = Arc::new(Mutex::new(HashSet::new()));
    let total = Arc::new(AtomicU64::new(0));
    let expected = 2 * SENDERS as u64 * PER;
    let consumers: Vec<_> = (0..4)
        .map(|_| {
            let (rx, seen, total) = (rx.clone(), seen.clone(), total.clone());
            std::thread::spawn(move || {
                while total.load(Ordering::SeqCst) < expected {
                    let Ok((from, m)) = rx.recv_timeout(Duration::from_millis(50)) else {
                        continue;
                    };
                    assert_eq!(from.0, m.from);
                    assert_eq!(
                        m.payload,
                        pattern(m.from, m.thread, m.seq, m.payload.len()),
                        "corrupt"
                    );
                    assert!(
                        seen.lock().unwrap().insert((m.from, m.thread, m.seq)),
                        "duplicate {:?}",
                        (m.from, m.thread, m.seq)
                    );
                    total.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    flood(&nodes);
    for c in consumers {
        c.join().unwrap();
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len() as u64, expected);
    for from in 1..3 {
        for t in 0..SENDERS {
            for s in 0..PER {
                assert!(seen.contains(&(from, t, s)), "lost {:?}", (from, t, s));
            }
        }
    }
}

/// Nobody takes from a receiver of capacity 4: its sender blocks once its
/// flow-control window is used up (sends time out), nothing is dropped,
/// the receiving node's queued bytes stay bounded, and requests from a
/// third node keep being answered. Taking the messages then delivers every
/// accepted one, in order.
#[test]
fn full_receiver_slows_its_sender_without_dropping() {
    const WINDOW: usize = 256 * 1024;
    let nodes = start_all(cluster_configs(Kind::Tcp, 3, |c| {
        c.limits.flow_control_window = WINDOW;
        c.limits.send_timeout_ms = 300;
    }));
    let rx = nodes[0].receiver::<Data>(4).unwrap();
    nodes[0]
        .register_request(|_, Ask(x): Ask| Answer(x + 1))
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let asker = {
        let (node, stop) = (nodes[2].clone(), stop.clone());
        std::thread::spawn(move || {
            let mut answered = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let a = node
                    .request(NodeId(0), &Ask(answered), Duration::from_secs(10))
                    .expect("requests from another node are answered");
                assert_eq!(a.0, answered + 1);
                answered += 1;
            }
            answered
        })
    };
    // 1 KiB messages until the sender is held back.
    let sender = &nodes[1];
    let mut accepted = 0u64;
    let blocked = loop {
        let m = Data {
            from: 1,
            thread: 0,
            seq: accepted,
            payload: pattern(1, 0, accepted, 1024),
        };
        match sender.send(NodeId(0), &m) {
            Ok(()) => accepted += 1,
            Err(e) => break e,
        }
        assert!(accepted < 100_000, "the sender was never held back");
    };
    assert!(matches!(blocked, Error::Timeout(_)), "{blocked:?}");
    assert_eq!(rx.len(), 4);
    stop.store(true, Ordering::SeqCst);
    assert!(asker.join().unwrap() > 0);
    // What waits at node 0 is bounded by the window, not by what was sent
    // (the ring and the socket buffers hold the rest at the sender).
    let peak = nodes[0].stats().incoming_peak_bytes as usize;
    assert!(peak <= 4 * WINDOW, "node 0 queued {peak} bytes");

    for seq in 0..accepted {
        let (from, m) = rx.recv_timeout(Duration::from_secs(30)).expect("a message");
        assert_eq!((from, m.seq), (NodeId(1), seq));
        assert_eq!(m.payload, pattern(1, 0, seq, 1024));
    }
    assert_eq!(rx.try_recv().unwrap_err(), RecvError::Empty);
    // The sender can go on.
    sender
        .send(
            NodeId(0),
            &Data {
                from: 1,
                thread: 0,
                seq: accepted,
                payload: vec![],
            },
        )
        .unwrap();
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(30)).unwrap().1.seq,
        accepted
    );
    assert_eq!(nodes[0].stats().unknown_messages, 0);
}

#[test]
fn dropping_unregisters_and_the_type_can_be_pulled_again() {
    let nodes = start_all(cluster_configs(Kind::Loopback, 2, |_| {}));
    let (a, b) = (&nodes[0], &nodes[1]);
    let rx = b.receiver::<Data>(16).unwrap();
    assert!(matches!(
        b.receiver::<Data>(16),
        Err(Error::AlreadyRegistered(10, 1))
    ));
    assert!(matches!(
        b.register(|_, _: Data| {}),
        Err(Error::AlreadyRegistered(10, 1))
    ));
    b.register_request(|_, Ask(x): Ask| Answer(x)).unwrap();
    assert!(matches!(
        b.receiver::<Ask>(16),
        Err(Error::AlreadyRegistered(43, 1))
    ));
    assert!(matches!(b.receiver::<Data>(0), Err(Error::Config(_))));

    let data = |seq| Data {
        from: 0,
        thread: 0,
        seq,
        payload: vec![seq as u8; 10],
    };
    a.send(NodeId(1), &data(0)).unwrap();
    let clone = rx.clone();
    assert_eq!(
        clone.recv_timeout(Duration::from_secs(10)).unwrap().1,
        data(0)
    );
    drop(rx);
    // A clone keeps it registered.
    a.send(NodeId(1), &data(1)).unwrap();
    assert_eq!(
        clone.recv_timeout(Duration::from_secs(10)).unwrap().1,
        data(1)
    );
    drop(clone);
    for seq in 2..7 {
        a.send(NodeId(1), &data(seq)).unwrap();
    }
    wait_for(10, "discarded messages counted", || {
        b.stats().unknown_messages == 5
    });
    let rx = b.receiver::<Data>(16).unwrap();
    a.send(NodeId(1), &data(7)).unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap().1, data(7));
    assert_eq!(b.stats().unknown_messages, 5);
}

/// A consumer blocked in `recv` and one that comes late both get the
/// queued messages, then `Shutdown`; the handler thread waiting for room
/// in the full receiver returns, so shutdown completes.
#[test]
fn shutdown_ends_receivers_after_what_is_queued() {
    let nodes = start_all(cluster_configs(Kind::Tcp, 2, |_| {}));
    let b = nodes[1].clone();
    let full = b.receiver::<Data>(2).unwrap();
    let waiting = b.receiver::<Answer>(2).unwrap();
    let blocked = {
        let waiting = waiting.clone();
        std::thread::spawn(move || waiting.recv())
    };
    for seq in 0..3 {
        nodes[0]
            .send(
                NodeId(1),
                &Data {
                    from: 0,
                    thread: 0,
                    seq,
                    payload: vec![],
                },
            )
            .unwrap();
    }
    wait_for(10, "the receiver filled up", || full.len() == 2);
    drop(nodes);
    // The last handle: shuts the node down.
    Arc::try_unwrap(b).ok().expect("only handle").shutdown();
    assert_eq!(blocked.join().unwrap().unwrap_err(), RecvError::Shutdown);
    assert_eq!(full.try_recv().unwrap().1.seq, 0);
    assert_eq!(full.recv().unwrap().1.seq, 1);
    assert_eq!(full.recv().unwrap_err(), RecvError::Shutdown);
    assert_eq!(full.iter().count(), 0);
}

/// A minimal executor: polls `f` on this thread, parking between polls.
fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_secs(1));
    }
}

/// The next item of a `Stream`, as a future.
struct Next<'a, S>(&'a mut S);
impl<S: futures_core::Stream + Unpin> Future for Next<'_, S> {
    type Output = Option<S::Item>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut *self.0).poll_next(cx)
    }
}

#[test]
fn async_recv_and_stream() {
    let nodes = start_all(cluster_configs(Kind::Tcp, 2, |_| {}));
    let mut rx = nodes[1].receiver::<Data>(8).unwrap();
    let mut events = nodes[1].connection_events(8).unwrap();
    let sender = {
        let a = nodes[0].clone();
        std::thread::spawn(move || {
            for seq in 0..200 {
                std::thread::sleep(Duration::from_micros(200 * (seq % 3)));
                a.send(
                    NodeId(1),
                    &Data {
                        from: 0,
                        thread: 0,
                        seq,
                        payload: vec![1; seq as usize],
                    },
                )
                .unwrap();
            }
        })
    };
    for seq in 0..100 {
        let (from, m) = block_on(rx.recv_async()).expect("a message");
        assert_eq!((from, m.seq), (NodeId(0), seq));
    }
    for seq in 100..200 {
        let (_, m) = block_on(Next(&mut rx)).expect("a message");
        assert_eq!(m.seq, seq);
    }
    sender.join().unwrap();
    assert_eq!(
        block_on(Next(&mut events)),
        Some(dxnet::events::ConnectionEvent::Connected { node: NodeId(0) })
    );
    // Shutdown ends both streams.
    let b = nodes[1].clone();
    drop(nodes);
    Arc::try_unwrap(b).ok().expect("only handle").shutdown();
    assert_eq!(block_on(Next(&mut rx)).map(|x| x.1.seq), None);
    // Node 0's end and node 1's shutdown may still be queued; then the end.
    let mut left = 0;
    while block_on(Next(&mut events)).is_some() {
        left += 1;
        assert!(left <= 2, "more events than connections closed");
    }
}
