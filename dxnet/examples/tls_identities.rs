//! TLS 1.3 with mutual certificates and Ed25519 node identities: a
//! development CA and node certificates are generated into a temporary
//! directory, each node gets an identity key and knows the others' public
//! keys, and a node that claims an id it has no key for is refused.
//!
//! `cargo run -p dxnet --example tls_identities --features pki-gen`
//! (for production, generate certificates with your own CA: see
//! docs/security.md).

use std::time::Duration;

use dxnet::config::NodeEntry;
use dxnet::{Config, Node, NodeId};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Whoami;
#[derive(Serialize, Deserialize)]
struct YouAre(u16);
dxnet::message!(YouAre, 6, 2);
dxnet::request!(Whoami, 6, 1 => YouAre);

const BASE: u16 = 22340;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let ids = [NodeId(1), NodeId(2)];
    let tls = dxnet::pki::generate_cluster_pki(dir.path(), &ids)?;
    let keys: Vec<(String, String)> = ids
        .iter()
        .map(|_| dxnet::proto::identity::generate_keypair())
        .collect();
    let config = |i: usize, secret: &str| {
        let mut c = Config::default();
        c.node_id = ids[i].0;
        c.nodes = ids
            .iter()
            .zip(&keys)
            .map(|(id, (_, public))| {
                let mut e = NodeEntry::new(id.0, format!("127.0.0.1:{}", BASE + id.0));
                e.public_key = Some(public.clone());
                e
            })
            .collect();
        c.tls = Some(tls[i].clone());
        c.identity_key = Some(secret.to_string());
        c
    };
    let a = Node::start(config(0, &keys[0].0))?;
    let b = Node::start(config(1, &keys[1].0))?;
    b.register_request(|from, Whoami| YouAre(from.0))?;
    let YouAre(seen) = a.request(NodeId(2), &Whoami, Duration::from_secs(5))?;
    println!("node 2 authenticated its caller as node {seen} over TLS");
    assert_eq!(seen, 1);
    drop(a);

    // A node with node 1's certificate but its own identity key (and so a
    // public key nobody else lists for node 1) is refused.
    let (forged, forged_public) = dxnet::proto::identity::generate_keypair();
    let mut cfg = config(0, &forged);
    cfg.nodes[0].public_key = Some(forged_public);
    let impostor = Node::start(cfg)?;
    let refused = impostor.request(NodeId(2), &Whoami, Duration::from_secs(2));
    match &refused {
        Err(e) => println!("an impostor of node 1 was refused: {e}"),
        Ok(_) => println!("an impostor of node 1 was accepted!"),
    }
    assert!(refused.is_err());
    Ok(())
}
