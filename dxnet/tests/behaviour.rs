//! API behaviour: connection limit, exclusive receivers, idle CPU, config
//! files, argument errors, delivery across shutdown.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use dxnet::{Config, Error, Node, NodeId};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Q(u32);
#[derive(Serialize, Deserialize, Debug)]
struct A(u32);
dxnet::message!(A, 40, 1);
dxnet::request!(Q, 40, 0 => A);

#[derive(Serialize, Deserialize, Debug)]
struct Serial(u64);
dxnet::message!(Serial, 40, 2);

#[test]
fn max_connections_closes_least_recently_used_and_reconnects() {
    let cluster = start_all(cluster_configs(Kind::Tcp, 3, |c| {
        if c.node_id == 0 {
            c.limits.max_connections = 1;
        }
    }));
    for n in &cluster[1..] {
        n.register_request(|_, q: Q| A(q.0 + 1)).unwrap();
    }
    for round in 0..4u32 {
        for dest in 1..3u16 {
            let a = cluster[0].request(NodeId(dest), &Q(round), Duration::from_secs(10));
            let a = match a {
                Ok(a) => a,
                // The peer may still be closing the evicted connection.
                Err(Error::Unreachable(..)) => cluster[0]
                    .request(NodeId(dest), &Q(round), Duration::from_secs(10))
                    .unwrap(),
                Err(e) => panic!("{e}"),
            };
            assert_eq!(a.0, round + 1);
        }
    }
    let st = cluster[0].stats();
    assert!(st.connections_opened >= 8, "{st:?}");
    assert!(st.connections_closed >= 7, "{st:?}");
}

#[test]
fn exclusive_receiver_runs_serially_on_one_thread() {
    let cluster = start_all(cluster_configs(Kind::Loopback, 3, |c| {
        c.handler_threads = 4
    }));
    let busy = Arc::new(AtomicBool::new(false));
    let threads = Arc::new(Mutex::new(std::collections::HashSet::new()));
    let count = Arc::new(AtomicU64::new(0));
    let (b, t, c) = (busy.clone(), threads.clone(), count.clone());
    cluster[0]
        .register_exclusive(move |_, _m: Serial| {
            assert!(
                !b.swap(true, Ordering::SeqCst),
                "two exclusive receivers at once"
            );
            t.lock().unwrap().insert(std::thread::current().id());
            std::hint::black_box((0..200).sum::<u64>());
            b.store(false, Ordering::SeqCst);
            c.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    std::thread::scope(|s| {
        for n in &cluster[1..] {
            for _ in 0..2 {
                s.spawn(|| {
                    for i in 0..2000 {
                        n.send(NodeId(0), &Serial(i)).unwrap();
                    }
                });
            }
        }
    });
    wait_for(60, "exclusive messages", || {
        count.load(Ordering::SeqCst) == 8000
    });
    assert_eq!(threads.lock().unwrap().len(), 1);
}

#[test]
fn config_files_toml_and_json() {
    let dir = std::env::temp_dir().join(format!("dxnet-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let toml = dir.join("n.toml");
    std::fs::write(
        &toml,
        "node_id = 3\n[[nodes]]\nid = 3\naddress = \"127.0.0.1:1\"\n",
    )
    .unwrap();
    assert_eq!(Config::from_file(&toml).unwrap().node_id, 3);
    let json = dir.join("n.json");
    std::fs::write(
        &json,
        r#"{"node_id": 4, "transport": "loopback", "orb_size": 1024}"#,
    )
    .unwrap();
    let e = Config::from_file(&json).unwrap_err();
    assert!(e.to_string().contains("orb_size"), "{e}");
    assert!(matches!(
        Config::from_file(dir.join("missing.toml")),
        Err(Error::Config(_))
    ));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn argument_errors_are_typed() {
    let cluster = start_all(cluster_configs(Kind::Loopback, 2, |c| {
        c.limits.max_message_size = 1000
    }));
    let n = &cluster[0];
    assert!(matches!(
        n.send_raw(NodeId(1), 50, 0, &[0; 1001]),
        Err(Error::TooLarge {
            size: 1001,
            max: 1000
        })
    ));
    assert!(matches!(
        n.send_raw(NodeId(1), 0, 0, b"x"),
        Err(Error::Config(_))
    ));
    n.register_raw(50, 0, |_, _| {}).unwrap();
    assert_eq!(
        n.register_raw(50, 0, |_, _| {}),
        Err(Error::AlreadyRegistered(50, 0))
    );
    // Unknown type at the receiver: counted and dropped, node keeps working.
    n.send_raw(NodeId(1), 51, 0, b"nobody listens").unwrap();
    wait_for(10, "unknown counted", || {
        cluster[1].stats().unknown_messages == 1
    });
    assert!(matches!(
        n.send_raw(NodeId(9), 50, 0, b"x"),
        Err(Error::Unreachable(NodeId(9), _))
    ));
    let mut c = Config::default();
    c.node_id = 1;
    let e = Node::start(c);
    assert!(
        matches!(e, Err(Error::Config(_))),
        "own id must be in the node map for TCP"
    );
}

/// What `send` accepted is delivered even if the sender shuts down right
/// after: shutdown waits (`limits.shutdown_linger_ms`) until the rings are
/// written out, and TCP closes its sockets with a FIN, not a reset (which
/// would make the peer's kernel drop what the peer has not read yet).
///
/// `per_message`: how long the receiver takes per message once it runs. A
/// slow receiver keeps the sender's socket full to the end, so what the
/// sender's engine took out of its ring but could not write yet (with
/// TLS, records rustls holds) must go out before shutdown closes it too.
fn sent_before_shutdown_is_delivered(kind: Kind, per_message: Duration) {
    // 24 MiB in all: more than the sockets and the receiver's incoming
    // queue hold while its handler is held back, so most of it is still in
    // the sender's ring when the sender shuts down.
    const MSGS: u64 = 384;
    const PAD: usize = 64 << 10;
    let cfgs = cluster_configs(kind, 2, |c| {
        // One ring of 32 MiB takes all of it (several rings share it).
        c.tcp.rings = 1;
        c.limits.orb_size = 32 << 20;
        c.limits.flow_control_window = 64 << 20;
        c.limits.incoming_max_bytes = 1 << 20;
        // Hang guards only.
        c.limits.shutdown_linger_ms = 120_000;
        c.limits.send_timeout_ms = 120_000;
    });
    let a = Node::start(cfgs[0].clone()).unwrap();
    let b = Node::start(cfgs[1].clone()).unwrap();
    let open = Arc::new(AtomicBool::new(false));
    let got = Arc::new(Mutex::new(Vec::new()));
    let (o, g) = (open.clone(), got.clone());
    b.register(move |src, Step(t, seq, pad)| {
        while !o.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!((src, t, pad.len()), (NodeId(0), 7, PAD));
        assert!(pad.iter().all(|&x| x == seq as u8), "payload of {seq}");
        std::thread::sleep(per_message);
        g.lock().unwrap().push(seq);
    })
    .unwrap();
    for seq in 0..MSGS {
        a.send(NodeId(1), &Step(7, seq, vec![seq as u8; PAD]))
            .unwrap();
    }
    let sender = std::thread::spawn(move || drop(a));
    open.store(true, Ordering::SeqCst);
    wait_for(120, "every message sent before shutdown", || {
        got.lock().unwrap().len() as u64 >= MSGS
    });
    sender.join().unwrap();
    assert_eq!(*got.lock().unwrap(), (0..MSGS).collect::<Vec<_>>());
}

#[test]
fn tcp_sent_before_shutdown_is_delivered() {
    sent_before_shutdown_is_delivered(Kind::Tcp, Duration::ZERO);
}

#[test]
fn tcp_sent_before_shutdown_to_a_slow_receiver_is_delivered() {
    sent_before_shutdown_is_delivered(Kind::Tcp, Duration::from_millis(2));
}

#[test]
fn tls_sent_before_shutdown_is_delivered() {
    sent_before_shutdown_is_delivered(Kind::TcpTls, Duration::ZERO);
}

#[test]
fn tls_sent_before_shutdown_to_a_slow_receiver_is_delivered() {
    sent_before_shutdown_is_delivered(Kind::TcpTls, Duration::from_millis(2));
}

#[test]
fn loopback_sent_before_shutdown_is_delivered() {
    sent_before_shutdown_is_delivered(Kind::Loopback, Duration::ZERO);
}
