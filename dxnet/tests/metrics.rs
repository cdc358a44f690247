//! Per-connection statistics (`Node::connection_stats`) and their export
//! through the `metrics` façade (`Node::publish_metrics`).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{cluster_configs, send_checked, start_all, wait_for, Data, Kind};
use dxnet::{ConnectionStats, NodeId};

/// Counts the [`Data`] messages `node` receives.
fn count_data(node: &dxnet::Node) -> Arc<AtomicU64> {
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    node.register(move |_, _: Data| {
        g.fetch_add(1, Ordering::Relaxed);
    })
    .unwrap();
    got
}

fn of(stats: &[ConnectionStats], peer: u16) -> ConnectionStats {
    stats
        .iter()
        .find(|c| c.peer == peer && c.state == "open")
        .unwrap_or_else(|| panic!("no open connection to {peer}: {stats:?}"))
        .clone()
}

/// 24 threads of node 0 (far more than cores) and 4 of node 1 send checked
/// messages of random sizes to each other over one connection: each
/// side's per-connection counts equal what the other side's receivers got
/// and the node-wide counters (the only connection carries everything).
fn counts_match(kind: Kind) {
    let cfgs = cluster_configs(kind, 2, |c| c.metrics.per_connection = true);
    let nodes = start_all(cfgs);
    let got: Vec<Arc<AtomicU64>> = nodes.iter().map(|n| count_data(n)).collect();
    let (threads, per) = ([24u16, 4], [500u64, 300]);
    std::thread::scope(|s| {
        for (i, n) in nodes.iter().enumerate() {
            for t in 0..threads[i] {
                let n = n.clone();
                s.spawn(move || send_checked(&n, t, per[i], 3000, |_| 1 - i as u16));
            }
        }
    });
    let want = [threads[0] as u64 * per[0], threads[1] as u64 * per[1]];
    wait_for(60, "every message", || {
        got[1].load(Ordering::Relaxed) == want[0] && got[0].load(Ordering::Relaxed) == want[1]
    });
    // A received buffer is counted once all its messages ran: perhaps just
    // after the receiver above saw the last one.
    wait_for(30, "the receiving counts", || {
        (0..2).all(|i| {
            of(&nodes[i].connection_stats(), 1 - i as u16).msgs_received == Some(want[1 - i])
        })
    });
    for (i, n) in nodes.iter().enumerate() {
        let peer = 1 - i as u16;
        let c = of(&n.connection_stats(), peer);
        let s = n.stats();
        assert_eq!(c.msgs_sent, Some(want[i]), "{kind:?} node {i}: {c:?}");
        assert_eq!(
            c.msgs_received,
            Some(want[1 - i]),
            "{kind:?} node {i}: {c:?}"
        );
        assert_eq!(c.msgs_sent, Some(s.msgs_sent), "{kind:?} node {i}");
        assert_eq!(c.bytes_sent, Some(s.bytes_sent), "{kind:?} node {i}");
        assert_eq!(c.msgs_received, Some(s.msgs_received), "{kind:?} node {i}");
        assert_eq!(
            c.bytes_received,
            Some(s.bytes_received),
            "{kind:?} node {i}"
        );
        // Every message went through the ring: its bytes were written there.
        assert_eq!(c.ring_written, s.bytes_sent, "{kind:?} node {i}: {c:?}");
        assert!(c.ring_used <= c.ring_capacity && c.ring_capacity > 0);
        assert_eq!((c.closes, c.errors), (0, 0));
    }
    // The other side's receiving counts are this side's sending counts.
    let (a, b) = (
        of(&nodes[0].connection_stats(), 1),
        of(&nodes[1].connection_stats(), 0),
    );
    assert_eq!(a.bytes_sent, b.bytes_received);
    assert_eq!(b.bytes_sent, a.bytes_received);
}

#[test]
fn connection_counters_match_the_messages_of_many_threads_tcp() {
    counts_match(Kind::Tcp);
}

#[test]
fn connection_counters_match_the_messages_of_many_threads_loopback() {
    counts_match(Kind::Loopback);
}

/// Without `metrics.per_connection` the per-message counts are not kept
/// (`None`), and what needs no count per message is still there.
#[test]
fn without_per_connection_counting_only_the_free_statistics_show() {
    let nodes = start_all(cluster_configs(Kind::Tcp, 2, |_| {}));
    let got = count_data(&nodes[1]);
    send_checked(&nodes[0], 0, 200, 500, |_| 1);
    wait_for(30, "200 messages", || got.load(Ordering::Relaxed) == 200);
    let c = of(&nodes[0].connection_stats(), 1);
    assert_eq!(
        (c.msgs_sent, c.bytes_sent, c.msgs_received),
        (None, None, None)
    );
    assert_eq!(c.ring_written, nodes[0].stats().bytes_sent);
}

/// A receiver slower than its senders with a small window: the senders'
/// waits for the window are counted and timed.
#[test]
fn flow_control_stalls_are_counted_and_timed() {
    let nodes = start_all(cluster_configs(Kind::Tcp, 2, |c| {
        c.limits.flow_control_window = 64 << 10;
        c.limits.flow_control_threshold = 0.5;
    }));
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    nodes[1]
        .register(move |_, _: Data| {
            std::thread::sleep(Duration::from_micros(200));
            g.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
    std::thread::scope(|s| {
        for t in 0..4u16 {
            let n = nodes[0].clone();
            s.spawn(move || {
                for i in 0..100 {
                    n.send(NodeId(1), &common::checked_data(0, t, i, 4000))
                        .unwrap();
                }
            });
        }
    });
    wait_for(60, "400 messages", || got.load(Ordering::Relaxed) == 400);
    let c = of(&nodes[0].connection_stats(), 1);
    assert!(c.flow_stalls > 0, "{c:?}");
    assert!(c.flow_blocked_ns > 0, "{c:?}");
    assert_eq!(c.flow_window, 64 << 10);
}

/// A peer that goes away: its connection is listed as closed, with the
/// close counted and its reason kept.
#[test]
fn closes_of_earlier_connections_are_kept() {
    let mut nodes = start_all(cluster_configs(Kind::Tcp, 2, |_| {}));
    let got = count_data(&nodes[1]);
    send_checked(&nodes[0], 0, 10, 100, |_| 1);
    wait_for(30, "10 messages", || got.load(Ordering::Relaxed) == 10);
    let n1 = nodes.pop().unwrap();
    drop(n1);
    wait_for(30, "the close seen", || {
        nodes[0]
            .connection_stats()
            .iter()
            .any(|c| c.peer == 1 && c.closes + c.errors == 1)
    });
    let c = nodes[0].connection_stats();
    let c = c.iter().find(|c| c.peer == 1).unwrap();
    assert_eq!(c.state, "closed", "{c:?}");
    assert!(c
        .last_close_reason
        .as_deref()
        .is_some_and(|r| !r.is_empty()));
}

/// `publish_metrics` hands the same numbers to the installed recorder,
/// labelled by node and peer.
#[test]
fn published_through_the_metrics_facade() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let nodes = start_all(cluster_configs(Kind::Loopback, 2, |c| {
        c.metrics.per_connection = true
    }));
    let got = count_data(&nodes[1]);
    send_checked(&nodes[0], 0, 321, 200, |_| 1);
    wait_for(30, "321 messages", || got.load(Ordering::Relaxed) == 321);
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || nodes[0].publish_metrics());
    // (A snapshot takes the counters' values: one for all the lookups.)
    let snapshot = snapshotter.snapshot().into_vec();
    // (`DebugValue` is not `Clone`: compared by its `Debug` form.)
    let find = |name: &str, peer: Option<&str>| -> Option<String> {
        snapshot
            .iter()
            .find(|(k, _, _, _)| {
                let key = k.key();
                key.name() == name
                    && key.labels().any(|l| l.key() == "node" && l.value() == "0")
                    && peer
                        .is_none_or(|p| key.labels().any(|l| l.key() == "peer" && l.value() == p))
            })
            .map(|(_, _, _, v)| format!("{v:?}"))
    };
    assert_eq!(
        find("dxnet_connection_messages_sent", Some("1")),
        Some(format!("{:?}", DebugValue::Counter(321)))
    );
    assert_eq!(
        find("dxnet_messages_sent", None),
        Some(format!(
            "{:?}",
            DebugValue::Counter(nodes[0].stats().msgs_sent)
        ))
    );
    assert!(
        find("dxnet_connection_ring_used_bytes", Some("1")).is_some_and(|v| v.starts_with("Gauge"))
    );
}

/// `metrics.publish_interval_ms`: a thread of the node publishes by itself
/// (to the global recorder; the only test here that installs one), and
/// stops with the node.
#[test]
fn published_periodically_by_the_node() {
    use metrics_util::debugging::DebuggingRecorder;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();
    let nodes = start_all(cluster_configs(Kind::Loopback, 2, |c| {
        c.metrics.publish_interval_ms = 30
    }));
    let got = count_data(&nodes[1]);
    send_checked(&nodes[0], 0, 77, 100, |_| 1);
    wait_for(30, "77 messages", || got.load(Ordering::Relaxed) == 77);
    wait_for(30, "node 1's count published", || {
        snapshotter
            .snapshot()
            .into_vec()
            .iter()
            .any(|(k, _, _, v)| {
                k.key().name() == "dxnet_messages_received"
                    && k.key()
                        .labels()
                        .any(|l| l.key() == "node" && l.value() == "1")
                    && format!("{v:?}") == "Counter(77)"
            })
    });
    // Shutting down joins the publishing thread (a hang fails the test).
    drop(nodes);
}
