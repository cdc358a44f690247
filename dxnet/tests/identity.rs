//! Identity keys (Ed25519) bind node ids: with `identity_key` and the node
//! map's `public_key`s, a member that knows the cluster secret still cannot
//! act as another node id — not even one that is down — in either
//! direction; the real node joins as usual. (The InfiniBand engine runs the
//! same signed handshake over UDP: every test of `ib.rs` runs with identity
//! keys.)

mod common;

use std::time::Duration;

use common::*;
use dxnet::proto::identity::generate_keypair;
use dxnet::{Config, Error, Node, NodeId};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Ping(u64);
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Pong(u64);
dxnet::message!(Pong, 31, 1);
dxnet::request!(Ping, 31, 0 => Pong);

const T: Duration = Duration::from_secs(5);

fn start(c: Config) -> Node {
    let n = Node::start(c).unwrap();
    n.register_request(|_, p: Ping| Pong(p.0 + 1)).unwrap();
    n
}

fn unreachable_why(r: Result<Pong, Error>, who: u16) -> String {
    match r {
        Err(Error::Unreachable(NodeId(n), why)) if n == who => why.to_string(),
        other => panic!("expected Unreachable({who}), got {other:?}"),
    }
}

#[test]
fn member_with_the_secret_cannot_act_as_another_node() {
    let cfgs = cluster_configs(Kind::Tcp, 3, |c| {
        c.cluster_secret = Some("shared by all members".into());
        c.limits.connect_timeout_ms = 1000;
        with_test_identities(c);
    });
    let a = start(cfgs[0].clone());
    let c = start(cfgs[2].clone());
    assert_eq!(a.request(NodeId(2), &Ping(1), T).unwrap(), Pong(2));

    // Node 1 is down. A member knows the secret and has a key of its own;
    // it claims id 1 with its key in its own copy of the node map.
    let (secret, public) = generate_keypair();
    let mut impostor = cfgs[1].clone();
    impostor.identity_key = Some(secret);
    impostor.nodes[1].public_key = Some(public);
    let imp = start(impostor);
    let why = unreachable_why(imp.request(NodeId(0), &Ping(5), T), 0);
    assert!(why.contains("authentication failed"), "{why}");
    // Node 0 dialing "node 1" finds a signature that is not node 1's.
    let why = unreachable_why(a.request(NodeId(1), &Ping(6), T), 1);
    assert!(why.contains("identity signature is not valid"), "{why}");
    // With another member's real key (node 2's) it fails the same way.
    drop(imp);
    let mut impostor = cfgs[1].clone();
    impostor.identity_key = cfgs[2].identity_key.clone();
    impostor.nodes[1].public_key = cfgs[2].nodes[2].public_key.clone();
    let imp = start(impostor);
    unreachable_why(imp.request(NodeId(0), &Ping(7), T), 0);
    drop(imp);
    assert_eq!(a.stats().connections_opened, 1, "only node 2 got in");

    // The real node 1 joins; 0 and 2 kept talking throughout.
    let b = start(cfgs[1].clone());
    assert_eq!(b.request(NodeId(0), &Ping(8), T).unwrap(), Pong(9));
    assert_eq!(a.request(NodeId(1), &Ping(9), T).unwrap(), Pong(10));
    assert_eq!(c.request(NodeId(0), &Ping(10), T).unwrap(), Pong(11));
}

#[test]
fn node_without_identity_keys_cannot_join_a_keyed_cluster() {
    let cfgs = cluster_configs(Kind::Tcp, 2, |c| {
        c.limits.connect_timeout_ms = 1000;
        with_test_identities(c);
    });
    let a = start(cfgs[0].clone());
    let mut plain = cfgs[1].clone();
    plain.identity_key = None;
    for n in &mut plain.nodes {
        n.public_key = None;
    }
    let p = start(plain);
    unreachable_why(p.request(NodeId(0), &Ping(1), T), 0);
    unreachable_why(a.request(NodeId(1), &Ping(2), T), 1);
    drop(p);
    let b = start(cfgs[1].clone());
    assert_eq!(b.request(NodeId(0), &Ping(3), T).unwrap(), Pong(4));
}

#[test]
fn identity_config_errors() {
    let mut c = Config::tcp_localhost(0, 2, base_port(2));
    with_test_identities(&mut c);
    c.nodes[1].public_key = None;
    match Node::start(c) {
        Err(Error::Config(m)) => assert!(m.contains("node 1 public_key missing"), "{m}"),
        other => panic!("expected a config error, got {:?}", other.err()),
    }
}
