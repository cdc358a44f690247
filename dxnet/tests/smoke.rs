use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dxnet::{Config, Node, NodeId};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Hello {
    n: u64,
    text: String,
}
dxnet::message!(Hello, 1, 0);

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Add {
    a: u64,
    b: u64,
}
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Sum(u64);
dxnet::message!(Sum, 1, 2);
dxnet::request!(Add, 1, 1 => Sum);

#[test]
fn two_nodes_messages_and_requests() {
    run(
        Config::loopback(0, 2, "basic"),
        Config::loopback(1, 2, "basic"),
    );
}

#[test]
fn two_nodes_tcp() {
    run(
        Config::tcp_localhost(0, 2, 23400),
        Config::tcp_localhost(1, 2, 23400),
    );
}

fn run(ca: Config, cb: Config) {
    let a = Node::start(ca).unwrap();
    let b = Node::start(cb).unwrap();
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    b.register(move |src: NodeId, m: Hello| {
        assert_eq!(src, NodeId(0));
        assert_eq!(m.text, format!("hi {}", m.n));
        g.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    b.register_request(|_src, r: Add| Sum(r.a + r.b)).unwrap();
    for n in 0..1000 {
        a.send(
            NodeId(1),
            &Hello {
                n,
                text: format!("hi {n}"),
            },
        )
        .unwrap();
    }
    let s = a
        .request(NodeId(1), &Add { a: 2, b: 3 }, Duration::from_secs(5))
        .unwrap();
    assert_eq!(s, Sum(5));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while got.load(Ordering::SeqCst) < 1000 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(got.load(Ordering::SeqCst), 1000);
}
