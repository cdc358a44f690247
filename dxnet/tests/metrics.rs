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

/// A request whose handler takes at least `spin_us` of CPU and answers
/// with its bytes' sum.
#[derive(serde::Serialize, serde::Deserialize, Debug)]
struct Work {
    bytes: Vec<u8>,
    spin_us: u64,
}
/// The answer to a [`Work`].
#[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
struct WorkSum(u64);
dxnet::message!(WorkSum, 11, 2);
dxnet::request!(Work, 11, 1 => WorkSum);

fn serve_work(node: &dxnet::Node, parallel: bool) {
    let f = |_, w: Work| {
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_micros(w.spin_us) {
            std::hint::spin_loop();
        }
        WorkSum(w.bytes.iter().map(|&b| b as u64).sum())
    };
    if parallel {
        node.register_request_parallel(f).unwrap();
    } else {
        node.register_request(f).unwrap();
    }
}

/// Requests from `threads` threads of `from` to `to` (sizes up to 3000
/// bytes, blocking and through the handle in turn), every answer checked;
/// returns the round trips' total time as the callers measured it.
fn work_requests(from: &dxnet::Node, to: u16, threads: u64, per: u64, spin_us: u64) -> Duration {
    let total = std::sync::Mutex::new(Duration::ZERO);
    std::thread::scope(|s| {
        for t in 0..threads {
            let total = &total;
            s.spawn(move || {
                let mut mine = Duration::ZERO;
                for i in 0..per {
                    let len = common::size_for(t * 1_000_003 + i, 3000);
                    let bytes: Vec<u8> = (0..len).map(|k| (k as u64 * 7 + t + i) as u8).collect();
                    let want = WorkSum(bytes.iter().map(|&b| b as u64).sum());
                    let req = Work { bytes, spin_us };
                    let started = std::time::Instant::now();
                    let got = if i % 2 == 0 {
                        from.request(NodeId(to), &req, Duration::from_secs(60))
                    } else {
                        from.request_async(NodeId(to), &req, Duration::from_secs(60))
                            .and_then(|h| h.wait())
                    };
                    mine += started.elapsed();
                    assert_eq!(got.unwrap(), want);
                }
                *total.lock().unwrap() += mine;
            });
        }
    });
    total.into_inner().unwrap()
}

/// Both nodes request from each other with many more threads than cores:
/// every answered request is split once at each end, the requester's
/// stages add up to its round trip, the round trips lie within what the
/// callers measured, and the handler stage holds the handlers' time.
fn breakdown_covers_every_round_trip(kind: Kind, parallel: bool) {
    let nodes = start_all(cluster_configs(kind, 2, |c| c.metrics.breakdown = true));
    for n in &nodes {
        serve_work(n, parallel);
    }
    let (threads, per, spin_us) = ([24u64, 3], [60u64, 80], [20u64, 0]);
    let measured: Vec<Duration> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|i| {
                let n = &nodes[i];
                s.spawn(move || work_requests(n, 1 - i as u16, threads[i], per[i], spin_us[i]))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // A responder records a request's stages when its dispatch ends, after
    // the response has left: the last ones may still be on their way into
    // the histograms when the requesters hold every response. Read until
    // each node's served count is complete (an overcount still fails below).
    let served_of = |i: usize| threads[1 - i] * per[1 - i];
    let breakdowns = || -> Vec<_> {
        nodes
            .iter()
            .map(|n| n.latency_breakdown().expect("breakdown is on"))
            .collect()
    };
    wait_for(30, "the responders' records", || {
        let b = breakdowns();
        (0..2).all(|i| b[i].served() >= served_of(i))
    });
    let b = breakdowns();
    for i in 0..2 {
        let (me, peer) = (&b[i], &b[1 - i]);
        let sent = threads[i] * per[i];
        let served = served_of(i);
        let what = format!("{kind:?} parallel={parallel} node {i}");
        for (name, h) in me.stages() {
            let want =
                if ["request_queue", "handler", "response_send", "response_post"].contains(&name) {
                    served
                } else {
                    sent
                };
            assert_eq!(h.count(), want, "{what}: {name}");
        }
        // Each round trip is split into its four stages exactly.
        let parts = me.send.sum_ns()
            + me.post.sum_ns()
            + me.awaiting.sum_ns()
            + me.response_receive.sum_ns()
            + me.wake.sum_ns();
        assert_eq!(parts, me.round_trip.sum_ns(), "{what}");
        // Inside the callers' own measurement (how much of it depends on
        // when the callers' threads ran after their responses came: no
        // bound on that here).
        let rt = me.round_trip.sum_ns() as f64;
        let callers = measured[i].as_nanos() as f64;
        assert!(rt > 0.0 && rt <= callers, "{what}: {rt} of {callers} ns");
        // The peer's handlers ran at least their spin on its side of the
        // requests, which lies within this node's wait for responses.
        assert!(
            peer.handler.sum_ns() >= sent * spin_us[i] * 1000,
            "{what}: handler {} ns",
            peer.handler.sum_ns()
        );
        // Not asserted: `transport_ns(me, peer) > 0`. A thread preempted
        // between a commit and its clock read stretches its own stage over
        // the other side's (a responder's post past the response's
        // arrival), so under load the difference of the means can go
        // below zero: a matter of timing, not of what is recorded.
        // Arrival times reached both ends' dispatch (unstamped, these
        // stages would be 0 for every request).
        assert!(me.response_receive.sum_ns() > 0, "{what}");
        // Commits were stamped: each split from the write after it.
        assert!(
            me.post.sum_ns() > 0 && peer.response_post.sum_ns() > 0,
            "{what}"
        );
        assert!(peer.request_queue.sum_ns() > 0, "{what}");
        let p50 = me.round_trip.quantile_ns(0.5);
        assert!(p50 > 0 && p50 <= me.round_trip.quantile_ns(0.99));
    }
    // A later reading less an earlier one holds only what came between.
    let before = nodes[0].latency_breakdown().unwrap();
    work_requests(&nodes[0], 1, 2, 5, 0);
    let d = nodes[0].latency_breakdown().unwrap().since(&before);
    assert_eq!(d.round_trip.count(), 10);
    assert_eq!(d.handler.count(), 0);
}

#[test]
fn latency_breakdown_covers_every_round_trip_tcp() {
    breakdown_covers_every_round_trip(Kind::Tcp, false);
}

#[test]
fn latency_breakdown_covers_every_round_trip_parallel_handlers() {
    breakdown_covers_every_round_trip(Kind::Tcp, true);
}

#[test]
fn latency_breakdown_covers_every_round_trip_loopback() {
    breakdown_covers_every_round_trip(Kind::Loopback, false);
}

#[test]
fn latency_breakdown_is_off_by_default() {
    let nodes = start_all(cluster_configs(Kind::Loopback, 2, |_| {}));
    serve_work(&nodes[1], false);
    work_requests(&nodes[0], 1, 2, 5, 0);
    assert!(nodes.iter().all(|n| n.latency_breakdown().is_none()));
}
