//! Statistics exported to Prometheus: a node publishes its counters and
//! per-connection statistics through the `metrics` façade, here to
//! `metrics-exporter-prometheus`, whose text format a Prometheus server
//! scrapes (serve `handle.render()` on your HTTP endpoint, or enable the
//! exporter's own listener).
//!
//! `cargo run -p dxnet --example metrics_prometheus --features metrics`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dxnet::{Config, Node, NodeId};
use metrics_exporter_prometheus::PrometheusBuilder;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let handle = PrometheusBuilder::new().install_recorder()?;
    let mut cfg = Config::tcp_localhost(0, 2, 22350);
    cfg.metrics.per_connection = true; // messages and bytes per connection
    let a = Node::start(cfg)?;
    let b = Node::start(Config::tcp_localhost(1, 2, 22350))?;
    let received = Arc::new(AtomicU64::new(0));
    let r = received.clone();
    b.register_raw(70, 0, move |_, _| {
        r.fetch_add(1, Ordering::Relaxed);
    })?;
    for i in 0..1000u32 {
        a.send_raw(NodeId(1), 70, 0, &i.to_le_bytes())?;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while received.load(Ordering::Relaxed) < 1000 {
        assert!(Instant::now() < deadline, "messages lost");
        std::thread::sleep(Duration::from_millis(1));
    }
    a.publish_metrics(); // or `metrics.publish_interval_ms` in the config
    let text = handle.render();
    for line in text.lines().filter(|l| {
        l.starts_with("dxnet_messages_sent") || l.starts_with("# HELP dxnet_messages_sent")
    }) {
        println!("{line}");
    }
    assert!(text.contains("dxnet_messages_sent"), "{text}");
    Ok(())
}
