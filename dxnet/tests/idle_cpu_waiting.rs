//! Threads blocked for slow responses park, and so do the node's internal
//! threads while they wait with them (the send thread stays awake for
//! blocked requesters only briefly after its last write). Alone in this
//! test binary, so no other test's threads are counted.

mod common;

use std::time::Duration;

use common::*;
use dxnet::NodeId;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Slow(u32);
#[derive(Serialize, Deserialize, Debug)]
struct Done(u32);
dxnet::message!(Done, 41, 1);
dxnet::request!(Slow, 41, 0 => Done);

#[test]
fn requesters_blocked_on_slow_responses_leave_the_cores_idle() {
    // Four requesters wait about 1.5 s for handlers that sleep: no thread
    // of either node may spin meanwhile (one spinning thread alone would
    // use about the whole second measured).
    let cluster = start_all(cluster_configs(Kind::Tcp, 2, |c| {
        c.park = Default::default()
    }));
    cluster[1]
        .register_request_parallel(|_, q: Slow| {
            std::thread::sleep(Duration::from_millis(1500));
            Done(q.0)
        })
        .unwrap();
    let requesters: Vec<_> = (0..4u32)
        .map(|i| {
            let n = cluster[0].clone();
            std::thread::spawn(move || n.request(NodeId(1), &Slow(i), Duration::from_secs(30)))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let before = cpu_time();
    std::thread::sleep(Duration::from_secs(1));
    let used = cpu_time() - before;
    for (i, r) in requesters.into_iter().enumerate() {
        let Done(v) = r.join().unwrap().unwrap();
        assert_eq!(v, i as u32);
    }
    assert!(
        used < Duration::from_millis(300),
        "nodes with four requesters blocked on slow handlers used {used:?} CPU in 1 s"
    );
}
