//! Idle nodes use (almost) no CPU: their threads park. Alone in this test
//! binary, so no other test's threads are counted.

mod common;

use std::time::Duration;

use common::*;
use dxnet::NodeId;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Q(u32);
#[derive(Serialize, Deserialize, Debug)]
struct A(u32);
dxnet::message!(A, 40, 1);
dxnet::request!(Q, 40, 0 => A);

#[test]
fn idle_nodes_park_their_threads() {
    // Connected nodes with default parking, then idle for a second: the
    // threads must park, not spin (a spinning thread alone would use ~1 s).
    let cluster = start_all(cluster_configs(Kind::Tcp, 2, |c| {
        c.park = Default::default()
    }));
    cluster[1].register_request(|_, q: Q| A(q.0)).unwrap();
    cluster[0]
        .request(NodeId(1), &Q(1), Duration::from_secs(10))
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let before = cpu_time();
    std::thread::sleep(Duration::from_secs(1));
    let used = cpu_time() - before;
    assert!(
        used < Duration::from_millis(300),
        "idle cluster used {used:?} CPU in 1 s"
    );
}
