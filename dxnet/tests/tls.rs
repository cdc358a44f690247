//! TLS on the TCP transport: certificate identities bind node ids, so a
//! member cannot claim another node's id (not even a node that is down), and
//! nodes without a certificate from the cluster's CA cannot join. Traffic
//! over TLS itself is tested by the `tls_*` cases of `pipeline.rs` and
//! `requests.rs`.

mod common;

use std::time::Duration;

use common::*;
use dxnet::pki::generate_cluster_pki;
use dxnet::{Config, Error, Node, NodeId, TlsConfig};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Ping(u64);
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Pong(u64);
dxnet::message!(Pong, 30, 1);
dxnet::request!(Ping, 30, 0 => Pong);

const T: Duration = Duration::from_secs(5);

fn start(c: Config) -> Node {
    let n = Node::start(c).unwrap();
    n.register_request(|_, p: Ping| Pong(p.0 + 1)).unwrap();
    n
}

/// Three ids (0, 1, 2) with TLS; only 0 and 2 run.
fn cluster() -> (Vec<Config>, Node, Node) {
    let cfgs = cluster_configs(Kind::TcpTls, 3, |c| {
        c.limits.connect_timeout_ms = 1000;
        c.limits.send_timeout_ms = 1000;
    });
    let a = start(cfgs[0].clone());
    let c = start(cfgs[2].clone());
    assert_eq!(a.request(NodeId(2), &Ping(1), T).unwrap(), Pong(2));
    (cfgs, a, c)
}

fn assert_unreachable(r: Result<Pong, Error>, who: u16) -> String {
    match r {
        Err(Error::Unreachable(NodeId(n), why)) if n == who => why.to_string(),
        other => panic!("expected Unreachable({who}), got {other:?}"),
    }
}

#[test]
fn member_cannot_claim_the_id_of_a_node_that_is_down() {
    let (cfgs, a, c) = cluster();
    // Node 1 is down. Node 2's operator starts a second node that claims
    // id 1, with the one certificate it has: node 2's.
    let mut impostor = cfgs[1].clone();
    impostor.tls = cfgs[2].tls.clone();
    let imp = start(impostor);
    // Dialing node 0 as "node 1" is refused: the certificate names node-2.
    let why = assert_unreachable(imp.request(NodeId(0), &Ping(5), T), 0);
    assert!(why.contains("authentication failed"), "{why}");
    // Node 0 dialing node 1's address finds a certificate for node-2.
    let why = assert_unreachable(a.request(NodeId(1), &Ping(6), T), 1);
    assert!(why.contains("TLS handshake"), "{why}");
    // Nothing reached node 0 from the impostor; 0 and 2 still talk.
    assert_eq!(a.request(NodeId(2), &Ping(7), T).unwrap(), Pong(8));
    assert_eq!(c.request(NodeId(0), &Ping(9), T).unwrap(), Pong(10));
    assert_eq!(a.stats().connections_opened, 1, "only node 2 connected");
}

#[test]
fn nodes_without_a_cluster_certificate_cannot_join() {
    let (cfgs, a, _c) = cluster();
    // Plaintext node claiming id 1.
    let mut plain = cfgs[1].clone();
    plain.tls = None;
    let p = start(plain);
    assert_unreachable(p.request(NodeId(0), &Ping(1), T), 0);
    drop(p);
    // A node 1 with a valid-looking certificate from another CA.
    let other = generate_cluster_pki(&pki_dir(), &[NodeId(1)]).unwrap();
    let mut foreign = cfgs[1].clone();
    foreign.tls = Some(other[0].clone());
    let f = start(foreign);
    assert_unreachable(f.request(NodeId(0), &Ping(2), T), 0);
    // And node 0 refuses to talk to it in the other direction as well.
    assert_unreachable(a.request(NodeId(1), &Ping(3), T), 1);
    drop(f);
    // The real node 1 joins.
    let b = start(cfgs[1].clone());
    assert_eq!(b.request(NodeId(0), &Ping(4), T).unwrap(), Pong(5));
    assert_eq!(a.request(NodeId(2), &Ping(5), T).unwrap(), Pong(6));
}

#[test]
fn bad_tls_files_are_config_errors_naming_the_field() {
    let mut cfg = Config::tcp_localhost(0, 1, base_port(1));
    let dir = pki_dir();
    let good = generate_cluster_pki(&dir, &[NodeId(0)]).unwrap().remove(0);
    let cases = [
        (
            TlsConfig::new(
                dir.join("missing.pem").display().to_string(),
                &good.key,
                &good.ca,
            ),
            "tls.cert",
        ),
        (
            // A certificate is not a key.
            TlsConfig::new(&good.cert, &good.cert, &good.ca),
            "tls.key",
        ),
        (
            // A key holds no CA certificate.
            TlsConfig::new(&good.cert, &good.key, &good.key),
            "tls.ca",
        ),
    ];
    for (tls, field) in cases {
        cfg.tls = Some(tls);
        match Node::start(cfg.clone()) {
            Err(Error::Config(m)) => assert!(m.contains(field), "{field}: {m}"),
            other => panic!("{field}: expected a config error, got {:?}", other.err()),
        }
    }
    cfg.tls = Some(good);
    let n = Node::start(cfg).unwrap();
    drop(n);
}

#[test]
fn garbage_to_a_tls_node_is_closed() {
    use std::io::{Read, Write};
    let (cfgs, a, c) = cluster();
    let addr = cfgs[0].address_of(NodeId(0)).unwrap().to_string();
    let mut noise = vec![0u8; 4096];
    for (i, b) in noise.iter_mut().enumerate() {
        *b = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1];
    }
    // Random bytes, then a TLS-looking record header announcing 4 GiB-ish.
    for bytes in [noise.clone(), vec![0x16, 0x03, 0x01, 0xff, 0xff, 1, 2, 3]] {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(&bytes);
        let mut buf = [0u8; 256];
        // The node answers with at most a TLS alert, then closes.
        let mut total = 0;
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => total += n,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e) => panic!("connection not closed: {e}"),
            }
            assert!(total < 256, "unexpected reply of {total} bytes");
        }
    }
    // Everyone else is still served.
    assert_eq!(a.request(NodeId(2), &Ping(1), T).unwrap(), Pong(2));
    assert_eq!(c.request(NodeId(0), &Ping(3), T).unwrap(), Pong(4));
}
