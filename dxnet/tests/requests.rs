//! Requests: many outstanding, matched responses, futures, timeouts,
//! unknown types, dead and restarted nodes.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use common::*;
use dxnet::{Error, Node, NodeId};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Echo {
    id: u64,
    body: Vec<u8>,
    sleep_ms: u64,
}
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct EchoReply {
    id: u64,
    body_len: usize,
    sum: u64,
}
dxnet::message!(EchoReply, 20, 1);
dxnet::request!(Echo, 20, 0 => EchoReply);

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Nobody(u8);
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct NobodyReply(u8);
dxnet::message!(NobodyReply, 21, 1);
dxnet::request!(Nobody, 21, 0 => NobodyReply);

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Stall(u64);
dxnet::message!(Stall, 22, 0);
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Ask(u64);
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Answer(u64);
dxnet::message!(Answer, 23, 1);
dxnet::request!(Ask, 23, 0 => Answer);

fn serve(node: &Node) {
    node.register_request(|_src, r: Echo| {
        if r.sleep_ms > 0 {
            std::thread::sleep(Duration::from_millis(r.sleep_ms));
        }
        EchoReply {
            id: r.id,
            body_len: r.body.len(),
            sum: r.body.iter().map(|&b| b as u64).sum(),
        }
    })
    .unwrap();
}

fn req(id: u64, len: usize) -> Echo {
    Echo {
        id,
        body: (0..len).map(|i| (i as u64 * 7 + id) as u8).collect(),
        sleep_ms: 0,
    }
}

/// Minimal runtime-agnostic executor: proves the handle is a real Future.
fn block_on<F: Future>(f: F) -> F::Output {
    struct ThreadWaker(std::thread::Thread);
    impl Wake for ThreadWaker {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

fn thousands_outstanding(kind: Kind) {
    let cluster = start_all(cluster_configs(kind, 3, |_| {}));
    serve(&cluster[1]);
    serve(&cluster[2]);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let node = cluster[0].clone();
            s.spawn(move || {
                let mut pending = Vec::new();
                for i in 0..1500u64 {
                    let id = t << 32 | i;
                    let dest = NodeId(1 + (i % 2) as u16);
                    let h = node
                        .request_async(dest, &req(id, (i % 700) as usize), Duration::from_secs(60))
                        .unwrap();
                    pending.push((id, (i % 700) as usize, h));
                }
                // Half waited blocking, half as futures, in reverse order.
                for (n, (id, len, h)) in pending.into_iter().rev().enumerate() {
                    let r = if n % 2 == 0 { h.wait() } else { block_on(h) }.unwrap();
                    assert_eq!(r.id, id);
                    assert_eq!(r.body_len, len);
                    assert_eq!(
                        r.sum,
                        req(id, len).body.iter().map(|&b| b as u64).sum::<u64>()
                    );
                }
            });
        }
    });
}

#[test]
fn thousands_outstanding_loopback() {
    thousands_outstanding(Kind::Loopback);
}

#[test]
fn thousands_outstanding_tcp() {
    thousands_outstanding(Kind::Tcp);
}

#[test]
fn thousands_outstanding_tls() {
    thousands_outstanding(Kind::TcpTls);
}

#[test]
fn timeouts_fire_and_late_responses_are_dropped() {
    let cluster = start_all(cluster_configs(Kind::Tcp, 2, |c| c.handler_threads = 2));
    serve(&cluster[1]);
    // Connect first, so the short timeouts below measure only the request.
    assert_eq!(
        cluster[0]
            .request(NodeId(1), &req(9, 1), Duration::from_secs(10))
            .unwrap()
            .id,
        9
    );
    let slow = Echo {
        id: 1,
        body: vec![],
        sleep_ms: 300,
    };
    let t0 = Instant::now();
    let e = cluster[0]
        .request(NodeId(1), &slow, Duration::from_millis(50))
        .unwrap_err();
    assert_eq!(e, Error::Timeout(dxnet::Waited::Response));
    assert!(
        t0.elapsed() < Duration::from_millis(290),
        "timed out before the response came"
    );
    // As a future too.
    let h = cluster[0]
        .request_async(NodeId(1), &slow, Duration::from_millis(50))
        .unwrap();
    assert_eq!(
        block_on(h).unwrap_err(),
        Error::Timeout(dxnet::Waited::Response)
    );
    std::thread::sleep(Duration::from_millis(700)); // late responses arrive and are ignored
    let r = cluster[0]
        .request(NodeId(1), &req(5, 10), Duration::from_secs(10))
        .unwrap();
    assert_eq!(r.id, 5);
}

#[test]
fn unknown_request_type_is_a_typed_error() {
    let cluster = start_all(cluster_configs(Kind::Tcp, 2, |_| {}));
    let e = cluster[0]
        .request(NodeId(1), &Nobody(1), Duration::from_secs(10))
        .unwrap_err();
    assert_eq!(e, Error::UnknownMessageType(21, 0));
    assert_eq!(cluster[1].stats().unknown_messages, 1);
}

#[test]
fn dead_node_is_unreachable_then_reconnects_after_restart() {
    dead_node_then_restart(Kind::Tcp);
}

#[test]
fn tls_dead_node_is_unreachable_then_reconnects_after_restart() {
    dead_node_then_restart(Kind::TcpTls);
}

fn dead_node_then_restart(kind: Kind) {
    let cfgs = cluster_configs(kind, 2, |c| c.limits.connect_timeout_ms = 500);
    let a = Node::start(cfgs[0].clone()).unwrap();
    // Node 1 not running: fails fast with a typed error, within the timeout.
    let t0 = Instant::now();
    let e = a
        .request(NodeId(1), &req(1, 1), Duration::from_secs(2))
        .unwrap_err();
    assert!(matches!(e, Error::Unreachable(NodeId(1), _)), "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    // Node 1 comes up: the next request connects.
    let b = Node::start(cfgs[1].clone()).unwrap();
    serve(&b);
    assert_eq!(
        a.request(NodeId(1), &req(2, 5), Duration::from_secs(5))
            .unwrap()
            .id,
        2
    );
    // A request pending while node 1 dies fails with "unreachable".
    let h = a
        .request_async(
            NodeId(1),
            &Echo {
                id: 3,
                body: vec![],
                sleep_ms: 500,
            },
            Duration::from_secs(30),
        )
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    drop(b);
    let t0 = Instant::now();
    let e = h.wait().unwrap_err();
    assert!(matches!(e, Error::Unreachable(NodeId(1), _)), "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    // Restarted with the same id: a new instance, reconnected.
    let b = Node::start(cfgs[1].clone()).unwrap();
    serve(&b);
    let mut ok = false;
    for _ in 0..50 {
        match a.request(NodeId(1), &req(4, 3), Duration::from_secs(5)) {
            Ok(r) => {
                assert_eq!(r.id, 4);
                ok = true;
                break;
            }
            Err(Error::Unreachable(..)) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("{e:?}"),
        }
    }
    assert!(ok, "reconnected after restart");
}

#[test]
fn shutdown_fails_pending_requests() {
    let cluster = start_all(cluster_configs(Kind::Loopback, 2, |_| {}));
    serve(&cluster[1]);
    let h = cluster[0]
        .request_async(
            NodeId(1),
            &Echo {
                id: 1,
                body: vec![],
                sleep_ms: 300,
            },
            Duration::from_secs(30),
        )
        .unwrap();
    let mut it = cluster.into_iter();
    let a = Arc::try_unwrap(it.next().unwrap()).ok().unwrap();
    let _b = it.next().unwrap(); // stays alive: the error must come from our own shutdown
    a.shutdown();
    assert_eq!(h.wait().unwrap_err(), Error::Shutdown);
}

/// Over TCP a requester reads its connection itself while it waits,
/// asleep on the socket once its busy-wait is over: the node's shutdown
/// ends that wait with `Shutdown`, long before the request's deadline.
#[test]
fn shutdown_wakes_a_requester_asleep_on_its_connection() {
    let cluster = start_all(cluster_configs(Kind::Tcp, 2, |_| {}));
    serve(&cluster[1]);
    let slow = Echo {
        id: 1,
        body: vec![],
        sleep_ms: 3000,
    };
    let h = cluster[0]
        .request_async(NodeId(1), &slow, Duration::from_secs(60))
        .unwrap();
    let waiter = std::thread::spawn(move || {
        let t0 = Instant::now();
        (h.wait(), t0.elapsed())
    });
    // Long past any busy-wait: the waiter sleeps on the socket.
    std::thread::sleep(Duration::from_millis(300));
    let mut it = cluster.into_iter();
    let a = Arc::try_unwrap(it.next().unwrap()).ok().unwrap();
    let _b = it.next().unwrap(); // stays alive: the error must come from our own shutdown
    a.shutdown();
    let (res, waited) = waiter.join().unwrap();
    assert_eq!(res.unwrap_err(), Error::Shutdown);
    assert!(
        waited < Duration::from_secs(30),
        "the waiter slept until its deadline ({waited:?})"
    );
}

/// A requester asleep on its connection is woken when another thread
/// completes its response: here a handler thread, as the response comes
/// behind a message whose handler stalls, on the same connection; the
/// requester that read both handed them to the handler thread and sleeps
/// on a socket that stays quiet.
#[test]
fn a_handler_thread_completing_the_response_wakes_a_requester_asleep_on_its_connection() {
    let cluster = start_all(cluster_configs(Kind::Tcp, 2, |_| {}));
    cluster[0]
        .register(|_src, Stall(ms)| std::thread::sleep(Duration::from_millis(ms)))
        .unwrap();
    let b = Arc::downgrade(&cluster[1]);
    cluster[1]
        .register_request(move |src, Ask(n)| {
            if let Some(b) = b.upgrade() {
                b.send(src, &Stall(if n == 0 { 0 } else { 200 })).unwrap();
            }
            Answer(n)
        })
        .unwrap();
    // Connected first.
    let r = cluster[0].request(NodeId(1), &Ask(0), Duration::from_secs(10));
    assert_eq!(r.unwrap(), Answer(0));
    // Several rounds: the requester may find a receive thread reading the
    // connection at that moment and then wait the usual way.
    for n in 1..=4 {
        let t0 = Instant::now();
        let r = cluster[0].request(NodeId(1), &Ask(n), Duration::from_secs(60));
        assert_eq!(r.unwrap(), Answer(n));
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the requester slept until its deadline ({:?})",
            t0.elapsed()
        );
    }
}

/// Requests and plain messages of one thread arrive in send order although
/// small requests may leave outside the ring buffer (standalone frames)
/// while the thread's earlier messages still wait in it: plain messages of
/// random sizes (some larger than a receive buffer) interleaved with
/// requests not waited for, from several threads (see [`send_steps`]).
///
/// With `blocking`, the requests are blocking ones: on TCP a requester that
/// finds another thread writing the socket writes after it itself.
fn requests_and_messages_keep_order(kind: Kind, blocking: bool) {
    const THREADS: u16 = 3;
    const STEPS: u64 = 3000;
    let cluster = start_all(cluster_configs(kind, 2, |c| {
        c.limits.recv_buffer_size = Some(4096);
    }));
    let log = register_step_log(&cluster[1]);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let a = cluster[0].clone();
            s.spawn(move || send_steps_with(&a, NodeId(1), t, STEPS, 9000, blocking));
        }
    });
    wait_for(30, "every step logged", || log.complete(0, THREADS, STEPS));
    log.assert_in_order(0, THREADS, STEPS);
}

#[test]
fn requests_and_messages_keep_order_loopback() {
    requests_and_messages_keep_order(Kind::Loopback, false);
}

#[test]
fn requests_and_messages_keep_order_tcp() {
    requests_and_messages_keep_order(Kind::Tcp, false);
}

#[test]
fn blocking_requests_and_messages_keep_order_tcp() {
    requests_and_messages_keep_order(Kind::Tcp, true);
}

/// A few threads of blocking requests on one TCP connection, of random
/// sizes (some split across receive buffers): each one finding another
/// thread writing the socket writes after it itself (see
/// `TcpEngine::wait_for_writer`); every response comes back to its
/// requester, intact.
#[test]
fn few_blocking_requesters_share_one_socket_tcp() {
    let cluster = start_all(cluster_configs(Kind::Tcp, 2, |c| {
        c.limits.recv_buffer_size = Some(4096);
    }));
    serve(&cluster[1]);
    std::thread::scope(|s| {
        for t in 0..3u64 {
            let node = cluster[0].clone();
            s.spawn(move || {
                let mut rng = Rng::new(t + 1);
                for i in 0..3000u64 {
                    let x = rng.next_u64();
                    let len = if x.is_multiple_of(8) {
                        x % 9000
                    } else {
                        x % 200
                    } as usize;
                    let id = t << 32 | i;
                    let r = node
                        .request(NodeId(1), &req(id, len), Duration::from_secs(60))
                        .unwrap();
                    assert_eq!(r.id, id);
                    assert_eq!(r.body_len, len);
                    assert_eq!(
                        r.sum,
                        req(id, len).body.iter().map(|&b| b as u64).sum::<u64>()
                    );
                }
            });
        }
    });
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Fill {
    seed: u64,
    len: usize,
    body: Vec<u8>,
}
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Filled {
    seed: u64,
    /// The request body's sum, and `len` bytes derived from `seed`.
    sum: u64,
    body: Vec<u8>,
}
dxnet::message!(Filled, 24, 1);
dxnet::request!(Fill, 24, 0 => Filled);

fn filled(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed) as u8)
        .collect()
}

/// Requests and responses of random sizes up to 1.5 MiB, many larger than
/// a receive buffer and than the decoder's kept scratch (reassembled
/// payloads handed over instead of copied), from 8 threads at once, in
/// both directions between two nodes: every response matches its request
/// and is intact.
fn large_requests_and_responses_arrive_intact(kind: Kind) {
    const THREADS: u64 = 8;
    const PER: u64 = 6;
    let nodes = start_all(cluster_configs(kind, 2, |c| {
        c.limits.max_message_size = 2 << 20;
        c.limits.send_timeout_ms = 60_000;
    }));
    for n in &nodes {
        n.register_request(|_src, r: Fill| Filled {
            seed: r.seed,
            sum: r.body.iter().map(|&b| b as u64).sum(),
            body: filled(r.seed, r.len),
        })
        .unwrap();
    }
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (from, to) = (&nodes[(t % 2) as usize], NodeId(1 - (t % 2) as u16));
            s.spawn(move || {
                let mut rng = Rng::new(t);
                let mut next = move |max: u64| (rng.next_u64() % max) as usize;
                for i in 0..PER {
                    let seed = t << 32 | i;
                    let (req_len, resp_len) = (next(1_500_000), next(1_500_000));
                    let body = filled(seed ^ 0xff, req_len);
                    let want_sum: u64 = body.iter().map(|&b| b as u64).sum();
                    let r = from
                        .request(
                            to,
                            &Fill {
                                seed,
                                len: resp_len,
                                body,
                            },
                            Duration::from_secs(60),
                        )
                        .unwrap();
                    assert_eq!(r.seed, seed);
                    assert_eq!(r.sum, want_sum, "request {seed:#x} arrived changed");
                    assert!(
                        r.body == filled(seed, resp_len),
                        "response {seed:#x} changed"
                    );
                }
            });
        }
    });
}

#[test]
fn large_requests_and_responses_arrive_intact_tcp() {
    large_requests_and_responses_arrive_intact(Kind::Tcp);
}

#[test]
fn large_requests_and_responses_arrive_intact_loopback() {
    large_requests_and_responses_arrive_intact(Kind::Loopback);
}
