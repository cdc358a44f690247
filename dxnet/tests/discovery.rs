//! Discovery at run time (TCP): nodes that know only a seed address find
//! it and, through its member lists, each other, and talk; a listed node is dialed only once it answered, and
//! probed again after its connection is lost; two nodes claiming one id
//! get an error at both and no takeover; unauthenticated or malformed
//! probes are ignored and counted while the node keeps serving; traffic on
//! an existing connection goes on, every message once and in order, while
//! other nodes join and leave.

mod common;

use std::net::UdpSocket;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use dxnet::config::NodeEntry;
use dxnet::events::{ConnectionEvent, ConnectionEvents};
use dxnet::{Config, DiscoveryConfig, Error, Node, NodeId, Unreachable, Waited};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Who(u32);
#[derive(Serialize, Deserialize, Debug)]
struct Me {
    id: u16,
    port: u16,
    x: u32,
}
dxnet::request!(Who, 46, 1 => Me);
dxnet::message!(Me, 46, 2);

const INTERVAL_MS: u64 = 20;
const SECRET: &str = "discovery-test-secret";
const T: Duration = Duration::from_secs(10);

/// Answers with its id and listening port.
fn serve(node: &Node, port: u16) {
    let id = node.id().0;
    node.register_request(move |_, Who(x): Who| Me { id, port, x })
        .unwrap();
}

fn ask(from: &Node, to: u16, x: u32) -> dxnet::Result<Me> {
    from.request(NodeId(to), &Who(x), T)
}

fn port_of(address: &str) -> u16 {
    address.rsplit(':').next().unwrap().parse().unwrap()
}

/// Node `id` at `127.0.0.1:port`, knowing only itself, probing `seeds`.
fn seeded(id: u16, port: u16, seeds: &[u16], secret: &str) -> Config {
    let mut c = Config::tcp_localhost(id, 0, 0);
    c.nodes = vec![NodeEntry::new(id, format!("127.0.0.1:{port}"))];
    c.cluster_secret = Some(secret.into());
    c.discovery = Some(DiscoveryConfig::new(
        seeds.iter().map(|p| format!("127.0.0.1:{p}")).collect(),
        INTERVAL_MS,
    ));
    c.park.spin_us = 20;
    c.park.yield_us = 200;
    c.limits.connect_timeout_ms = 2000;
    c
}

fn start(c: Config) -> Arc<Node> {
    let port = port_of(&c.nodes.iter().find(|n| n.id == c.node_id).unwrap().address);
    let n = Arc::new(Node::start(c).unwrap());
    serve(&n, port);
    n
}

/// The events of `node` seen within `ms`, after waiting for `until`.
fn drain(events: &ConnectionEvents, ms: u64) -> Vec<ConnectionEvent> {
    let mut v = Vec::new();
    while let Ok(e) = events.recv_timeout(Duration::from_millis(ms)) {
        v.push(e);
    }
    v
}

fn discovered(evs: &[ConnectionEvent], node: u16) -> usize {
    evs.iter()
        .filter(|e| **e == ConnectionEvent::Discovered { node: NodeId(node) })
        .count()
}

#[test]
fn nodes_that_know_only_a_seed_discover_it_and_talk() {
    let base = base_port(5);
    let seed = start(seeded(0, base, &[], SECRET));
    let events = seed.connection_events(64).unwrap();
    let others: Vec<Arc<Node>> = (1..4)
        .map(|i| start(seeded(i, base + i, &[base], SECRET)))
        .collect();
    // The seed learns every prober, each prober the seed and, from the
    // seed's member lists, the other probers.
    let all: Vec<NodeId> = (0..4).map(NodeId).collect();
    assert_eq!(seed.wait_for_nodes(4, T).unwrap(), all);
    for n in &others {
        assert_eq!(n.wait_for_nodes(4, T).unwrap(), all);
    }
    // Both ways, each answered by the node it names.
    for n in &others {
        let me = ask(n, 0, 7).unwrap();
        assert_eq!((me.id, me.port, me.x), (0, base, 7));
        let me = ask(&seed, n.id().0, 8).unwrap();
        assert_eq!((me.id, me.port), (n.id().0, base + n.id().0));
    }
    // Probers reach each other directly.
    for a in &others {
        for b in &others {
            let me = ask(a, b.id().0, 9).unwrap();
            assert_eq!((me.id, me.port), (b.id().0, base + b.id().0));
        }
    }
    // A node with another cluster secret is never discovered, and its
    // probes are counted as ignored.
    let stranger = start(seeded(4, base + 4, &[base], "another-secret"));
    let r = stranger.wait_for_nodes(2, Duration::from_millis(500));
    assert!(matches!(r, Err(Error::Timeout(Waited::Nodes))), "{r:?}");
    assert!(!seed.nodes().contains(&NodeId(4)));
    assert!(seed.stats().discovery_ignored > 0);
    let evs = drain(&events, 100);
    for i in 1..4 {
        assert_eq!(discovered(&evs, i), 1, "node {i} in {evs:?}");
    }
    assert_eq!(discovered(&evs, 4), 0, "{evs:?}");
}

#[test]
fn a_listed_node_is_dialed_only_once_discovered_and_again_after_loss() {
    let base = base_port(3);
    let cfg = |id: u16| {
        let mut c = seeded(id, base + id, &[], SECRET);
        c.nodes = (0..3)
            .map(|i| NodeEntry::new(i, format!("127.0.0.1:{}", base + i)))
            .collect();
        c
    };
    let n0 = start(cfg(0));
    let events = n0.connection_events(64).unwrap();
    let n1 = start(cfg(1));
    n0.wait_for_nodes(2, T).unwrap();
    assert_eq!(ask(&n0, 1, 1).unwrap().id, 1);
    // Node 2 has not started: not discovered, so not dialed.
    let r = ask(&n0, 2, 1);
    assert!(
        matches!(
            r,
            Err(Error::Unreachable(NodeId(2), Unreachable::Undiscovered))
        ),
        "{r:?}"
    );
    assert_eq!(n0.nodes(), vec![NodeId(0), NodeId(1)]);
    let n2 = start(cfg(2));
    n0.wait_for_nodes(3, T).unwrap();
    assert_eq!(ask(&n0, 2, 2).unwrap().id, 2);
    // Node 2 stops: its connection is lost, it goes back to probing ...
    drop(n2);
    wait_for(10, "node 2 undiscovered at node 0", || {
        !n0.nodes().contains(&NodeId(2))
    });
    let r = ask(&n0, 2, 3);
    assert!(matches!(r, Err(Error::Unreachable(NodeId(2), _))), "{r:?}");
    // ... and is discovered again when it comes back.
    let n2 = start(cfg(2));
    n0.wait_for_nodes(3, T).unwrap();
    assert_eq!(ask(&n0, 2, 4).unwrap().id, 2);
    assert_eq!(ask(&n0, 1, 5).unwrap().id, 1);
    let evs: Vec<ConnectionEvent> = drain(&events, 100)
        .into_iter()
        .filter(|e| e.node() == NodeId(2))
        .collect();
    let n = NodeId(2);
    assert_eq!(discovered(&evs, 2), 2, "{evs:?}");
    let first_lost = evs
        .iter()
        .position(|e| matches!(e, ConnectionEvent::Lost { .. }))
        .expect("lost");
    // Discovered before the first connection, again before the second.
    assert_eq!(evs[0], ConnectionEvent::Discovered { node: n }, "{evs:?}");
    assert!(evs[1..first_lost].contains(&ConnectionEvent::Connected { node: n }));
    let again = evs[first_lost..]
        .iter()
        .position(|e| *e == ConnectionEvent::Discovered { node: n })
        .expect("discovered again")
        + first_lost;
    assert!(evs[again..].contains(&ConnectionEvent::Connected { node: n }));
    assert!(evs[again..].contains(&ConnectionEvent::Restarted { node: n }));
    drop((n1, n2));
}

#[test]
fn two_nodes_claiming_one_id_get_an_error_at_both_and_no_takeover() {
    let base = base_port(4);
    let seed = start(seeded(0, base, &[], SECRET));
    let seed_events = seed.connection_events(64).unwrap();
    let first = start(seeded(1, base + 1, &[base], SECRET));
    let first_events = first.connection_events(64).unwrap();
    // Both ways: the seed learns node 1 from its probe, node 1 learns the
    // seed from the answer.
    seed.wait_for_nodes(2, T).unwrap();
    first.wait_for_nodes(2, T).unwrap();
    assert_eq!(ask(&seed, 1, 1).unwrap().port, base + 1);
    // A second node 1 probes the seed and the first node 1 itself (seeds
    // added after subscribing: events made before the first subscription
    // are not kept).
    let second = start(seeded(1, base + 2, &[], SECRET));
    let second_events = second.connection_events(64).unwrap();
    second.add_seed(&format!("127.0.0.1:{base}")).unwrap();
    second.add_seed(&format!("127.0.0.1:{}", base + 1)).unwrap();
    wait_for(10, "the conflict at all three", || {
        seed.stats().discovery_conflicts > 0
            && first.stats().discovery_conflicts > 0
            && second.stats().discovery_conflicts > 0
    });
    let dup = |port: u16| ConnectionEvent::DuplicateId {
        node: NodeId(1),
        address: format!("127.0.0.1:{port}"),
    };
    let evs = drain(&seed_events, 100);
    assert!(evs.contains(&dup(base + 2)), "seed: {evs:?}");
    let evs = drain(&first_events, 100);
    assert!(evs.contains(&dup(base + 2)), "first: {evs:?}");
    let evs = drain(&second_events, 100);
    assert!(evs.contains(&dup(base + 1)), "second: {evs:?}");
    // No takeover: the seed still reaches the first node 1, and the second
    // never learned the seed.
    for x in 0..20 {
        assert_eq!(ask(&seed, 1, x).unwrap().port, base + 1);
    }
    assert!(!second.nodes().contains(&NodeId(0)));
}

/// A node that discovered a peer before the peer heard of it (the peer's
/// probe arrived, this node's answer or probe not yet) may send to it at
/// once: the peer's refusal of an unknown node is dialed again until it
/// knows this node, within the connect timeout.
#[test]
fn sending_to_a_peer_that_has_not_heard_of_this_node_yet_succeeds() {
    let base = base_port(2);
    // Probes every 3 s: node 1 hears of node 0 only at node 0's next
    // round, long after node 0 learned node 1 and sent.
    let slow = |id: u16, port: u16| {
        let mut c = seeded(id, port, &[], SECRET);
        c.discovery.as_mut().unwrap().interval_ms = 3000;
        c.limits.connect_timeout_ms = 10_000;
        c
    };
    let a = start(slow(0, base));
    let b = start(slow(1, base + 1));
    // Node 1's probe, as node 1 would send it (same secret, its address),
    // from another socket: node 0 learns node 1 and answers that socket.
    let probe = probe_from(1, 77, 7, format!("127.0.0.1:{}", base + 1));
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    sock.send_to(
        &probe.encode(Some(SECRET.as_bytes()), None),
        format!("127.0.0.1:{base}"),
    )
    .unwrap();
    a.wait_for_nodes(2, T).unwrap();
    assert!(
        !b.nodes().contains(&NodeId(0)),
        "node 1 heard of node 0 too early"
    );
    // Refused while node 1 does not know node 0; answered once it does.
    assert_eq!(ask(&a, 1, 1).unwrap().port, base + 1);
    assert!(b.nodes().contains(&NodeId(0)));
    assert_eq!(ask(&b, 0, 2).unwrap().port, base);
}

#[test]
fn unauthenticated_and_malformed_probes_are_ignored_and_counted() {
    let base = base_port(3);
    let a = start(seeded(0, base, &[], SECRET));
    let b = start(seeded(1, base + 1, &[base], SECRET));
    a.wait_for_nodes(2, T).unwrap();
    let before = a.stats().discovery_ignored;
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let to = format!("127.0.0.1:{base}");
    // Garbage, a truncated probe, a probe with another secret, one with no
    // MAC, one claiming node 1 from another address with a wrong MAC.
    let forged = probe_from(9, 1, 1, format!("127.0.0.1:{}", base + 2));
    let mut takeover = forged.clone();
    takeover.sender = 1;
    takeover.subject = 1;
    let datagrams: Vec<Vec<u8>> = vec![
        b"DXdp and then nothing useful".to_vec(),
        forged.encode(Some(SECRET.as_bytes()), None)[..30].to_vec(),
        forged.encode(Some(b"wrong"), None),
        forged.encode(None, None),
        takeover.encode(Some(b"wrong"), None),
        vec![0xff; 2000],
    ];
    for d in &datagrams {
        sock.send_to(d, &to).unwrap();
    }
    // An unsolicited answer with the right secret: no probe had its nonce.
    let mut answer = forged.clone();
    answer.kind = dxnet::proto::discovery::Kind::Answer;
    sock.send_to(&answer.encode(Some(SECRET.as_bytes()), None), &to)
        .unwrap();
    // A member list with the right secret that answers no probe either.
    let mut members = forged.clone();
    members.kind = dxnet::proto::discovery::Kind::Members;
    members.address = "10.9.9.9:1,10.9.9.8:1".into();
    sock.send_to(&members.encode(Some(SECRET.as_bytes()), None), &to)
        .unwrap();
    wait_for(10, "every bad datagram counted", || {
        a.stats().discovery_ignored >= before + datagrams.len() as u64 + 2
    });
    assert!(!a.nodes().contains(&NodeId(9)));
    // Nothing answered the socket, and the node keeps serving.
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 512];
    assert!(sock.recv_from(&mut buf).is_err(), "answered a bad probe");
    assert_eq!(ask(&b, 0, 3).unwrap().port, base);
    assert_eq!(ask(&a, 1, 4).unwrap().port, base + 1);
}

#[test]
fn traffic_keeps_flowing_in_order_while_nodes_join_and_leave() {
    let base = base_port(8);
    let hub = start(seeded(0, base, &[], SECRET));
    let log = register_step_log(&hub);
    let sender = start(seeded(1, base + 1, &[base], SECRET));
    hub.wait_for_nodes(2, T).unwrap();
    sender.wait_for_nodes(2, T).unwrap();
    const STEPS: u64 = 20_000;
    let s = sender.clone();
    let traffic = std::thread::spawn(move || {
        let ts: Vec<_> = (0..4u16)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || send_steps(&s, NodeId(0), t, STEPS, 200))
            })
            .collect();
        for t in ts {
            t.join().unwrap();
        }
    });
    // Nodes join (discovered, asked) and leave (shut down) meanwhile.
    for round in 0..3u16 {
        let joined: Vec<Arc<Node>> = (2..6)
            .map(|i| start(seeded(i, base + i, &[base], SECRET)))
            .collect();
        for j in &joined {
            j.wait_for_nodes(2, T).unwrap();
            assert_eq!(ask(j, 0, u32::from(round)).unwrap().id, 0);
            assert_eq!(ask(&hub, j.id().0, 1).unwrap().id, j.id().0);
        }
        drop(joined);
    }
    traffic.join().unwrap();
    wait_for(30, "every step at the hub", || log.complete(1, 4, STEPS));
    log.assert_in_order(1, 4, STEPS);
}

#[test]
fn a_removed_node_is_no_longer_probed_or_accepted_until_added_again() {
    let base = base_port(3);
    let a = start(seeded(0, base, &[], SECRET));
    // Node 1 probes node 0; node 2 is found through a seed added later.
    let b = start(seeded(1, base + 1, &[base], SECRET));
    let c = start(seeded(2, base + 2, &[], SECRET));
    a.wait_for_nodes(2, T).unwrap();
    // A host name: every address it resolves to is probed.
    a.add_seed(&format!("localhost:{}", base + 2)).unwrap();
    assert_eq!(a.wait_for_nodes(3, T).unwrap().len(), 3);
    assert_eq!(ask(&a, 2, 1).unwrap().port, base + 2);
    assert_eq!(ask(&c, 0, 1).unwrap().port, base);

    a.remove_node(NodeId(1)).unwrap();
    assert_eq!(a.nodes(), vec![NodeId(0), NodeId(2)]);
    // Node 1 lost its connection (closed by node 0) and keeps probing:
    // ignored and counted, never rediscovered.
    let ignored = a.stats().discovery_ignored;
    wait_for(10, "node 1's probes ignored", || {
        a.stats().discovery_ignored > ignored + 2
    });
    assert!(!a.nodes().contains(&NodeId(1)));
    let r = ask(&a, 1, 2);
    assert!(
        matches!(r, Err(Error::Unreachable(NodeId(1), Unreachable::Removed))),
        "{r:?}"
    );
    // Added again: probed, discovered, reachable.
    a.add_node(NodeEntry::new(1, format!("127.0.0.1:{}", base + 1)))
        .unwrap();
    a.wait_for_nodes(3, T).unwrap();
    assert_eq!(ask(&a, 1, 3).unwrap().port, base + 1);
    assert_eq!(ask(&b, 0, 4).unwrap().port, base);
}

#[test]
fn with_identities_only_listed_keys_are_discovered_at_addresses_learned() {
    let base = base_port(3);
    // Nodes 0 and 1 list each other by id and public key, no address; node
    // 1 probes node 0's address. Node 2 has the secret but no listed key.
    let cfg = |id: u16, seeds: &[u16], listed: &[u16]| {
        let mut c = seeded(id, base + id, seeds, SECRET);
        for &o in listed {
            c.nodes.push(NodeEntry::new(o, ""));
        }
        with_test_identities(&mut c);
        c
    };
    let a = start(cfg(0, &[], &[1]));
    let b = start(cfg(1, &[base], &[0]));
    a.wait_for_nodes(2, T).unwrap();
    b.wait_for_nodes(2, T).unwrap();
    assert_eq!(ask(&a, 1, 1).unwrap().port, base + 1);
    assert_eq!(ask(&b, 0, 2).unwrap().port, base);
    let ignored = a.stats().discovery_ignored;
    let c = start(cfg(2, &[base], &[]));
    wait_for(10, "the unlisted node's probes ignored", || {
        a.stats().discovery_ignored > ignored
    });
    assert_eq!(a.nodes(), vec![NodeId(0), NodeId(1)]);
    assert!(c.nodes() == vec![NodeId(2)]);
}
