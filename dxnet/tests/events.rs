//! Connection events: connected, restarted, closed and lost, as a callback
//! and as a channel, in order per node; a blocked callback never stalls
//! the network; a full channel drops for itself alone.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::proc::*;
use common::*;
use dxnet::events::{ConnectionEvent, EventsEnded};
use dxnet::{Node, NodeId};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Ping(u32);
#[derive(Serialize, Deserialize, Debug)]
struct Pong(u32);
dxnet::message!(Pong, 41, 2);
dxnet::request!(Ping, 41, 1 => Pong);

fn serve(node: &Node) {
    node.register_request(|_, Ping(x): Ping| Pong(x)).unwrap();
}

fn next(ev: &dxnet::events::ConnectionEvents) -> ConnectionEvent {
    ev.recv_timeout(Duration::from_secs(30))
        .expect("an event within 30 s")
}

#[test]
fn connected_restarted_closed_and_shutdown_in_order() {
    let cfgs = cluster_configs(Kind::Tcp, 3, |c| c.limits.connect_timeout_ms = 2000);
    let a = Node::start(cfgs[0].clone()).unwrap();
    let events = a.connection_events(64).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    {
        let seen = seen.clone();
        a.on_connection_event(move |e| seen.lock().unwrap().push(e))
            .unwrap();
    }
    let b = Node::start(cfgs[1].clone()).unwrap();
    serve(&b);
    let c = Node::start(cfgs[2].clone()).unwrap();
    serve(&c);
    a.request(NodeId(1), &Ping(1), Duration::from_secs(10))
        .unwrap();
    assert_eq!(
        next(&events),
        ConnectionEvent::Connected { node: NodeId(1) }
    );
    a.request(NodeId(2), &Ping(2), Duration::from_secs(10))
        .unwrap();
    assert_eq!(
        next(&events),
        ConnectionEvent::Connected { node: NodeId(2) }
    );

    // B stops and starts again: a new instance.
    drop(b);
    let gone = next(&events);
    assert_eq!(gone.node(), NodeId(1));
    assert!(
        matches!(
            gone,
            ConnectionEvent::Closed { .. } | ConnectionEvent::Lost { .. }
        ),
        "{gone:?}"
    );
    let b = Node::start(cfgs[1].clone()).unwrap();
    serve(&b);
    until_reachable("restarted node 1", || {
        a.request(NodeId(1), &Ping(3), Duration::from_secs(5))
    });
    assert_eq!(
        next(&events),
        ConnectionEvent::Connected { node: NodeId(1) }
    );
    assert_eq!(
        next(&events),
        ConnectionEvent::Restarted { node: NodeId(1) }
    );

    // Our own shutdown closes what is open, then the channel ends.
    a.shutdown();
    let mut closed: Vec<NodeId> = (0..2)
        .map(|_| match next(&events) {
            ConnectionEvent::Closed { node, .. } => node,
            other => panic!("expected Closed, got {other:?}"),
        })
        .collect();
    closed.sort();
    assert_eq!(closed, vec![NodeId(1), NodeId(2)]);
    assert_eq!(
        events.recv_timeout(Duration::from_secs(30)),
        Err(EventsEnded::Shutdown)
    );
    // The callback saw the same events in the same order.
    let from_channel = 2 + 1 + 2 + 2;
    assert_eq!(seen.lock().unwrap().len(), from_channel);
    drop((b, c));
}

/// A callback that blocks holds back later events, not the network; a
/// channel of one event drops what does not fit and counts it.
#[test]
fn blocked_callback_and_full_channel_do_not_stall_traffic() {
    let cfgs = cluster_configs(Kind::Tcp, 4, |_| {});
    let a = Node::start(cfgs[0].clone()).unwrap();
    let (release_tx, release_rx) = crossbeam::channel::bounded::<()>(0);
    let release_rx = Mutex::new(release_rx);
    a.on_connection_event(move |_| {
        // Blocks the events thread until the test lets go, once.
        let _ = release_rx.lock().unwrap().recv();
    })
    .unwrap();
    let tiny = a.connection_events(1).unwrap();
    let peers: Vec<Node> = cfgs[1..]
        .iter()
        .map(|c| {
            let n = Node::start(c.clone()).unwrap();
            serve(&n);
            n
        })
        .collect();
    // Connections open and requests complete while the callback blocks.
    for round in 0..20u32 {
        for p in 1..4u16 {
            let Pong(x) = a
                .request(NodeId(p), &Ping(round), Duration::from_secs(10))
                .unwrap();
            assert_eq!(x, round);
        }
    }
    drop(release_tx); // every later recv returns at once
    wait_for(30, "the tiny channel to fill and drop", || {
        tiny.dropped() >= 2
    });
    // What fit is the first event.
    assert_eq!(
        tiny.recv_timeout(Duration::from_secs(10)),
        Ok(ConnectionEvent::Connected { node: NodeId(1) })
    );
    assert_eq!(a.stats().events_dropped, 0);
    drop(peers);
}

#[test]
fn child_events_peer() {
    if !is_child() {
        return;
    }
    let base: u16 = env_parse("BASE");
    let node = Node::start(dxnet::Config::tcp_localhost(1, 2, base)).unwrap();
    serve(&node);
    println!("READY");
    let _ = next_command();
}

/// A peer killed with SIGKILL: the connection is lost, with the cause the
/// failed requests see.
#[test]
fn killed_peer_is_lost() {
    let base = base_port(2);
    let mut child = spawn_child("child_events_peer", &[("BASE", base.to_string())]);
    child.wait_line("READY", 60);
    let mut cfg = dxnet::Config::tcp_localhost(0, 2, base);
    cfg.limits.connect_timeout_ms = 500;
    let a = Node::start(cfg).unwrap();
    let events = a.connection_events(16).unwrap();
    until_reachable("child", || {
        a.request(NodeId(1), &Ping(1), Duration::from_secs(5))
    });
    assert_eq!(
        next(&events),
        ConnectionEvent::Connected { node: NodeId(1) }
    );
    child.kill9();
    // Traffic notices the broken connection.
    let lost = loop {
        let _ = a.request(NodeId(1), &Ping(2), Duration::from_millis(500));
        if let Ok(e) = events.recv_timeout(Duration::from_millis(100)) {
            break e;
        }
    };
    assert!(
        matches!(
            lost,
            ConnectionEvent::Lost {
                node: NodeId(1),
                cause: dxnet::Unreachable::ConnectionLost(_)
            }
        ),
        "{lost:?}"
    );
}
