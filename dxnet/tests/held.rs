//! Receivers that keep their messages' flow-control window
//! (`Node::register_raw_held`): an application queue fed by one is bounded
//! by the senders' windows, the handler threads never block on it, and
//! every message arrives once and in order after the consumer lets go.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use dxnet::{Error, HeldWindow, NodeId, Waited};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Ask(u32);
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Answer(u32);
dxnet::message!(Answer, 44, 2);
dxnet::request!(Ask, 44, 1 => Answer);

const WINDOW: usize = 64 << 10;
const SIZE: usize = 1000;

fn payload(i: u64) -> Vec<u8> {
    let mut p = vec![(i % 251) as u8; SIZE];
    p[..8].copy_from_slice(&i.to_le_bytes());
    p
}

type Queue = Arc<Mutex<Vec<(NodeId, Vec<u8>, HeldWindow)>>>;

/// Takes everything queued, checks it continues the sequence at `next`,
/// and drops the windows.
fn take_checked(q: &Queue, next: &mut u64) -> usize {
    let taken = std::mem::take(&mut *q.lock().unwrap());
    for (src, p, w) in &taken {
        assert_eq!(*src, NodeId(1));
        assert_eq!(p, &payload(*next), "message {next} intact and in order");
        assert!(w.bytes() >= SIZE as u64);
        *next += 1;
    }
    taken.len()
}

fn held_windows(kind: Kind) {
    let cluster = start_all(cluster_configs(kind, 3, |c| {
        c.limits.flow_control_window = WINDOW;
        c.limits.send_timeout_ms = 300;
        c.handler_threads = 1;
    }));
    let q: Queue = Arc::default();
    let q2 = q.clone();
    cluster[0]
        .register_raw_held(50, 0, move |src, p, w| {
            q2.lock().unwrap().push((src, p.to_vec(), w))
        })
        .unwrap();
    cluster[0].register_request(|_, Ask(n)| Answer(n)).unwrap();

    // Nobody consumes: node 1's sends stop at its window.
    let mut sent = 0u64;
    loop {
        match cluster[1].send_raw(NodeId(0), 50, 0, &payload(sent)) {
            Ok(()) => sent += 1,
            Err(Error::Timeout(Waited::FlowControl)) => break,
            Err(e) => panic!("send {sent}: {e:?}"),
        }
        assert!(
            sent as usize <= 2 * WINDOW / SIZE,
            "the held window did not hold the sender back"
        );
    }
    assert!(
        sent as usize * SIZE <= WINDOW,
        "{sent} messages in a window"
    );
    wait_for(10, "the sent messages queued", || {
        q.lock().unwrap().len() as u64 == sent
    });
    // The one handler thread is free meanwhile: another node's request to
    // node 0 is answered.
    let r = cluster[2].request(NodeId(0), &Ask(7), Duration::from_secs(10));
    assert_eq!(r.unwrap(), Answer(7));

    // The consumer takes the messages: the window comes back and node 1
    // goes on; every message once, in order.
    let next = std::cell::Cell::new(0u64);
    let mut n = 0;
    assert_eq!(take_checked(&q, &mut n), sent as usize);
    next.set(n);
    let more = 5 * (WINDOW / SIZE) as u64;
    let sender = {
        let node = cluster[1].clone();
        std::thread::spawn(move || {
            for i in sent..sent + more {
                let mut tries = 0;
                while let Err(e) = node.send_raw(NodeId(0), 50, 0, &payload(i)) {
                    assert_eq!(e, Error::Timeout(Waited::FlowControl));
                    tries += 1;
                    assert!(tries < 100, "the window never came back");
                }
            }
        })
    };
    wait_for(30, "every message taken", || {
        let mut n = next.get();
        take_checked(&q, &mut n);
        next.set(n);
        n == sent + more
    });
    sender.join().unwrap();
}

#[test]
fn held_windows_bound_the_queue_tcp() {
    held_windows(Kind::Tcp);
}

#[test]
fn held_windows_bound_the_queue_loopback() {
    held_windows(Kind::Loopback);
}
