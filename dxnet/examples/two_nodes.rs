//! Two dxnet nodes exchanging typed messages and requests over TCP.
//!
//! One command, both nodes in this process (each with its own listener on
//! 127.0.0.1):
//!     cargo run --example two_nodes
//! Or one node per terminal (real separate processes):
//!     cargo run --example two_nodes -- --id 0
//!     cargo run --example two_nodes -- --id 1

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dxnet::{Config, Error, Node, NodeId};
use serde::{Deserialize, Serialize};

/// A chat line: any serde type becomes a message with a (type, subtype) id.
#[derive(Serialize, Deserialize, Debug)]
struct Chat {
    from: String,
    text: String,
    tags: Vec<String>,
}
dxnet::message!(Chat, 1, 0);

/// A request for the word count of a text, answered with `WordCount`.
#[derive(Serialize, Deserialize, Debug)]
struct CountWords(String);
#[derive(Serialize, Deserialize, Debug)]
struct WordCount(usize);
dxnet::message!(WordCount, 1, 2);
dxnet::request!(CountWords, 1, 1 => WordCount);

const BASE_PORT: u16 = 22220;

fn start(id: u16) -> Node {
    let mut cfg = Config::tcp_localhost(id, 2, BASE_PORT);
    cfg.cluster_secret = Some("example secret".into());
    let node = Node::start(cfg).expect("start node");
    let received = Arc::new(AtomicU64::new(0));
    node.register(move |src: NodeId, m: Chat| {
        received.fetch_add(1, Ordering::Relaxed);
        if m.text.ends_with(" 0") || m.text.ends_with("999") {
            println!("node {id}: from {src}: {m:?}");
        }
    })
    .unwrap();
    node.register_request(|_src, r: CountWords| WordCount(r.0.split_whitespace().count()))
        .unwrap();
    node
}

fn talk(node: &Node, peer: NodeId) {
    // Wait until the peer is up (it may start later in another terminal).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match node.request(
            peer,
            &CountWords("are you there".into()),
            Duration::from_secs(1),
        ) {
            Ok(WordCount(n)) => {
                println!("node {}: {peer} is up (counted {n} words)", node.id().0);
                break;
            }
            Err(Error::Unreachable(..)) | Err(Error::Timeout(_)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(e) => panic!("{e}"),
        }
    }
    let t0 = Instant::now();
    for i in 0..1000 {
        let m = Chat {
            from: format!("node {}", node.id().0),
            text: format!("hello {i}"),
            tags: vec!["demo".into()],
        };
        node.send(peer, &m).unwrap();
    }
    println!(
        "node {}: sent 1000 messages in {:?}",
        node.id().0,
        t0.elapsed()
    );
    // Many requests in flight at once, awaited later.
    let handles: Vec<_> = (0..100)
        .map(|i| {
            let text = "word ".repeat(i);
            node.request_async(peer, &CountWords(text), Duration::from_secs(5))
                .unwrap()
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.wait().unwrap().0, i);
    }
    println!(
        "node {}: 100 concurrent requests answered correctly",
        node.id().0
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(pos) = args.iter().position(|a| a == "--id") {
        let id: u16 = args[pos + 1].parse().expect("--id 0 or --id 1");
        let node = start(id);
        talk(&node, NodeId(1 - id));
        std::thread::sleep(Duration::from_secs(2)); // let the peer finish with us
        return;
    }
    let a = start(0);
    let b = start(1);
    std::thread::scope(|s| {
        s.spawn(|| talk(&a, NodeId(1)));
        s.spawn(|| talk(&b, NodeId(0)));
    });
    std::thread::sleep(Duration::from_millis(200));
    println!("stats node 0: {:?}", a.stats());
}
