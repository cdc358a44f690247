//! Membership at run time: three nodes that know only a seed address find
//! each other through discovery, report it as connection events, and talk;
//! one leaves and the others see it go.
//!
//! `cargo run -p dxnet --example discovery`

use std::time::Duration;

use dxnet::config::NodeEntry;
use dxnet::events::ConnectionEvent;
use dxnet::{Config, DiscoveryConfig, Node, NodeId};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Hello(u16);
#[derive(Serialize, Deserialize)]
struct Welcome(u16);
dxnet::message!(Welcome, 4, 2);
dxnet::request!(Hello, 4, 1 => Welcome);

const BASE: u16 = 22320;

/// Node `id`: its own entry only, node 0's address as the seed.
fn start(id: u16) -> dxnet::Result<Node> {
    let mut cfg = Config::default();
    cfg.node_id = id;
    cfg.nodes = vec![NodeEntry::new(id, format!("127.0.0.1:{}", BASE + id))];
    cfg.discovery = Some(DiscoveryConfig::new(vec![format!("127.0.0.1:{BASE}")], 50));
    let node = Node::start(cfg)?;
    node.register_request(move |_, Hello(_)| Welcome(id))?;
    Ok(node)
}

fn main() -> dxnet::Result<()> {
    let seed = start(0)?;
    let events = seed.connection_events(64)?;
    let others = [start(1)?, start(2)?];
    let all = seed.wait_for_nodes(3, Duration::from_secs(10))?;
    println!("node 0 knows {all:?}");
    for n in [NodeId(1), NodeId(2)] {
        let Welcome(from) = seed.request(n, &Hello(0), Duration::from_secs(2))?;
        assert_eq!(from, n.0);
    }
    for n in &others {
        let map = n.wait_for_nodes(3, Duration::from_secs(10))?;
        // Nodes 1 and 2 learned of each other through node 0.
        let peer = NodeId(3 - n.id().0);
        let Welcome(from) = n.request(peer, &Hello(n.id().0), Duration::from_secs(2))?;
        println!("{} knows {map:?}, and {peer} answered as {from}", n.id());
        assert_eq!(from, peer.0);
    }
    let [one, two] = others;
    drop(two); // node 2 leaves: it closes its connections with a notice
    let _ = one;
    loop {
        match events
            .recv_timeout(Duration::from_secs(10))
            .expect("events")
        {
            ConnectionEvent::Closed { node, .. } | ConnectionEvent::Lost { node, .. }
                if node == NodeId(2) =>
            {
                println!("node 0 saw {node} leave");
                break;
            }
            e => println!("node 0: {e:?}"),
        }
    }
    Ok(())
}
