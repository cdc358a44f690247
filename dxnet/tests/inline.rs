//! Handlers that block, and inline handling on the TCP receive thread
//! (`inline_receive_bytes`): inline handling is used when every handler
//! thread is parked, and a blocking handler (inline or on a handler thread)
//! never stops the node — a nested request, even back to the peer whose
//! message is being handled, gets its response (the connection decodes
//! ahead while its handler blocks, and an inline handler's standby receive
//! thread takes over at once), and a handler blocked outside dxnet is taken
//! over within `park.max_park_ms`. Messages behind a blocked handler still
//! run in arrival order, after it.

mod common;

use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use common::*;
use dxnet::{Error, Node, NodeId};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Get(u64);
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Got(u64);
dxnet::message!(Got, 50, 1);
dxnet::request!(Get, 50, 0 => Got);

/// Asks the receiving node to fetch `0` from node `1` first (a nested
/// request from inside the handler).
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Relay(u16, u64);
dxnet::request!(Relay, 50, 2 => Got);

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Go(u64);
dxnet::message!(Go, 50, 3);
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct WaitForGo;
dxnet::request!(WaitForGo, 50, 4 => Got);

const T: Duration = Duration::from_secs(3);

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Seq(u64);
dxnet::message!(Seq, 50, 5);

fn cluster(n: u16) -> Vec<Arc<Node>> {
    cluster_of(Kind::Tcp, n, true)
}

fn cluster_of(kind: Kind, n: u16, inline: bool) -> Vec<Arc<Node>> {
    cluster_with(kind, n, inline, |_| {})
}

fn cluster_with(
    kind: Kind,
    n: u16,
    inline: bool,
    tweak: impl Fn(&mut dxnet::Config),
) -> Vec<Arc<Node>> {
    let nodes = start_all(cluster_configs(kind, n, |c| {
        // Handler threads always park (as on a 2-core machine), so small
        // buffers are handled inline.
        c.park.max_spinning = Some(0);
        c.park.max_park_ms = 100;
        c.limits.request_timeout_ms = 3000;
        if !inline {
            c.inline_receive_bytes = 0;
        }
        tweak(c);
    }));
    for node in &nodes {
        node.register_request(|_, g: Get| Got(g.0 * 2)).unwrap();
        let me: Weak<Node> = Arc::downgrade(node);
        node.register_request(move |_, r: Relay| {
            let me = me.upgrade().expect("node alive");
            // Blocks this handler until the other node answers: its response
            // must be received while the handler waits.
            let got = me
                .request(NodeId(r.0), &Get(r.1), T)
                .expect("nested request");
            Got(got.0 + 1)
        })
        .unwrap();
    }
    nodes
}

#[test]
fn small_requests_are_handled_inline() {
    let nodes = cluster(2);
    for i in 0..200 {
        assert_eq!(nodes[0].request(NodeId(1), &Get(i), T).unwrap(), Got(2 * i));
    }
    let s = nodes[1].stats();
    assert!(s.inline_buffers > 0, "no buffer was handled inline: {s:?}");
}

#[test]
fn nested_request_from_an_inline_handler_completes() {
    nested_requests(Kind::Tcp, true);
}

#[test]
fn nested_request_from_a_handler_thread_completes() {
    nested_requests(Kind::Tcp, false);
}

#[test]
fn nested_request_over_loopback_completes() {
    nested_requests(Kind::Loopback, false);
}

fn nested_requests(kind: Kind, inline: bool) {
    let nodes = cluster_of(kind, 3, inline);
    for i in 0..100 {
        // 0 → 1 (inline on 1's receive thread) → 2, and back.
        assert_eq!(
            nodes[0].request(NodeId(1), &Relay(2, i), T).unwrap(),
            Got(2 * i + 1)
        );
        // 0 → 1 → 0: the nested request goes back to the requester.
        assert_eq!(
            nodes[0].request(NodeId(1), &Relay(0, i), T).unwrap(),
            Got(2 * i + 1)
        );
        // 0 → 0 → 0: to itself, and back to itself from the handler.
        assert_eq!(
            nodes[0].request(NodeId(0), &Relay(0, i), T).unwrap(),
            Got(2 * i + 1)
        );
    }
    assert_eq!(nodes[1].stats().inline_buffers > 0, inline);
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct LoggedRelay(u64);
dxnet::request!(LoggedRelay, 50, 6 => Got);
/// Answered after 100 ms.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct SlowGet(u64);
dxnet::request!(SlowGet, 50, 7 => Got);

#[test]
fn messages_behind_a_blocked_handler_run_after_it_in_order() {
    for inline in [true, false] {
        // A small incoming queue: a connection may hold 4 buffers of it, so
        // the messages waiting behind the blocked handler must not count
        // one queue item per received buffer (or reception of the
        // connection, and the response the handler waits for, would stop).
        let nodes = cluster_with(Kind::Tcp, 2, inline, |c| c.limits.incoming_max_buffers = 16);
        let log = Arc::new(Mutex::new(Vec::<i64>::new()));
        let (l, me) = (log.clone(), Arc::downgrade(&nodes[1]));
        nodes[1]
            .register_request(move |src, r: LoggedRelay| {
                // Busy first (the Seq messages queue up behind it as
                // separate buffers, more than the connection's share of the
                // incoming queue), then blocks on a request back to the
                // sender, then logs -1.
                std::thread::sleep(Duration::from_millis(50));
                let me = me.upgrade().expect("node alive");
                let got = me.request(src, &SlowGet(r.0), T).expect("nested request");
                l.lock().unwrap().push(-1);
                Got(got.0 + 1)
            })
            .unwrap();
        let l = log.clone();
        nodes[1]
            .register(move |_, s: Seq| l.lock().unwrap().push(s.0 as i64))
            .unwrap();
        nodes[0]
            .register_request(|_, g: SlowGet| {
                std::thread::sleep(Duration::from_millis(100));
                Got(g.0 * 2)
            })
            .unwrap();
        // Sent by this thread, so the messages below follow it (one
        // thread's messages stay in order; another thread's may overtake).
        let h = nodes[0]
            .request_async(NodeId(1), &LoggedRelay(5), T)
            .unwrap();
        // Right behind it on the same connection, and before the response
        // to the nested request: one-way messages in many small chunks.
        for i in 0..300 {
            nodes[0].send(NodeId(1), &Seq(i)).unwrap();
            if i % 10 == 0 {
                std::thread::sleep(Duration::from_micros(500));
            }
        }
        assert_eq!(h.wait().unwrap(), Got(11));
        wait_for(10, "all Seq messages", || log.lock().unwrap().len() == 301);
        let got = log.lock().unwrap().clone();
        // Seq messages that arrived while the handler was blocked ran after
        // it; all of them in order, each once.
        let relay_at = got.iter().position(|&x| x == -1).unwrap();
        let seqs: Vec<i64> = got.iter().copied().filter(|&x| x >= 0).collect();
        assert_eq!(seqs, (0..300).collect::<Vec<i64>>(), "inline={inline}");
        assert!(
            got[relay_at + 1..].iter().all(|&x| x >= 0),
            "inline={inline}"
        );
        assert_eq!(
            got[..relay_at].len(),
            0,
            "a Seq ran before the blocked handler: {got:?}"
        );
    }
}

#[test]
fn handler_blocked_outside_dxnet_does_not_stop_reception() {
    let nodes = cluster(3);
    // Node 1's WaitForGo handler blocks on a channel fed by the receiver
    // of Go, which node 2 sends. If the blocked handler held node 1's only
    // receive thread, Go would never be received.
    let (tx, rx) = mpsc::channel::<u64>();
    let rx = Arc::new(Mutex::new(rx));
    let tx = Arc::new(Mutex::new(tx));
    let r = rx.clone();
    nodes[1]
        .register_request(move |_, _: WaitForGo| {
            let v = r.lock().unwrap().recv_timeout(Duration::from_secs(5));
            Got(v.unwrap_or(u64::MAX))
        })
        .unwrap();
    nodes[1]
        .register(move |_, g: Go| tx.lock().unwrap().send(g.0).unwrap())
        .unwrap();
    // Warm both connections up (handshakes done, handlers parked again).
    nodes[0].request(NodeId(1), &Get(1), T).unwrap();
    nodes[2].request(NodeId(1), &Get(1), T).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    for round in 0..5u64 {
        let waiting = nodes[0].request_async(NodeId(1), &WaitForGo, T).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        nodes[2].send(NodeId(1), &Go(round)).unwrap();
        match waiting.wait() {
            Ok(Got(v)) => assert_eq!(v, round),
            Err(e @ Error::Timeout(_)) => panic!("reception stopped: {e}"),
            Err(e) => panic!("{e}"),
        }
    }
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Hold(u64);
dxnet::message!(Hold, 50, 6);
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct First;
dxnet::request!(First, 50, 7 => Got);
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Second;
dxnet::request!(Second, 50, 8 => Got);
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct SawFirst;
dxnet::request!(SawFirst, 50, 9 => Got);

/// The responses of one received buffer's requests leave together after
/// its handlers ran, but a handler that blocks inside dxnet sends the
/// earlier ones first: `Second`'s handler asks the client (a nested
/// request) whether `First`'s response arrived, and the client answers
/// only once it has (or says no after 5 s). Both requests reach the server
/// while a `Hold` handler occupies the connection, so they are handled
/// from the same buffer.
#[test]
fn responses_held_back_for_a_buffer_leave_before_a_handler_blocks() {
    for kind in [Kind::Tcp, Kind::Loopback] {
        let nodes = cluster_with(kind, 2, true, |c| c.limits.request_timeout_ms = 20_000);
        let (client, server) = (&nodes[0], &nodes[1]);
        server
            .register(|_, h: Hold| std::thread::sleep(Duration::from_millis(h.0)))
            .unwrap();
        server.register_request(|_, _: First| Got(1)).unwrap();
        let me: Weak<Node> = Arc::downgrade(server);
        server
            .register_request(move |src, _: Second| {
                let me = me.upgrade().expect("node alive");
                me.request(src, &SawFirst, Duration::from_secs(20))
                    .unwrap_or(Got(0))
            })
            .unwrap();
        let seen = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = seen.clone();
        client
            .register_request(move |_, _: SawFirst| {
                let end = std::time::Instant::now() + Duration::from_secs(5);
                while !s.load(std::sync::atomic::Ordering::SeqCst) {
                    if std::time::Instant::now() > end {
                        return Got(0);
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Got(1)
            })
            .unwrap();
        for round in 0..5 {
            client.send(NodeId(1), &Hold(50)).unwrap();
            let first = client
                .request_async(NodeId(1), &First, Duration::from_secs(20))
                .unwrap();
            let second = client
                .request_async(NodeId(1), &Second, Duration::from_secs(20))
                .unwrap();
            seen.store(false, std::sync::atomic::Ordering::SeqCst);
            let s = seen.clone();
            let waiter = std::thread::spawn(move || {
                let r = first.wait();
                s.store(true, std::sync::atomic::Ordering::SeqCst);
                r
            });
            assert_eq!(second.wait().unwrap(), Got(1), "{kind:?} round {round}");
            assert_eq!(waiter.join().unwrap().unwrap(), Got(1));
        }
    }
}
