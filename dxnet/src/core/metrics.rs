//! Per-connection statistics and their export through the `metrics`
//! façade.
//!
//! What costs nothing stays on: ring fill and bytes written (the rings'
//! positions), flow-control stalls and their time (counted only on the
//! slow path, where a sender waits anyway), the inbox, closes per peer
//! (counted when a connection closes). Messages and bytes per connection
//! each way are kept with `metrics.per_connection`: sent ones in the same
//! per-thread cells as the node's count (a slot per connection instead of
//! one total, see `SentTraffic`), received ones once per received buffer
//! (per message for receivers run on all handler threads).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
#[cfg(feature = "metrics")]
use std::sync::{Arc, Weak};
#[cfg(feature = "metrics")]
use std::time::{Duration, Instant};

use crate::core::connection::{ConnState, Connection};
use crate::core::Core;
use crate::NodeId;

/// One connection as [`crate::Node::connection_stats`] shows it.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
#[non_exhaustive]
pub struct ConnectionStats {
    /// The peer.
    pub peer: u16,
    /// The connection's id, unique in the process (a reconnect gets a new
    /// one).
    pub id: u64,
    /// `connecting`, `open` or `closed`.
    pub state: &'static str,
    /// Messages sent on it (`None` unless `metrics.per_connection`).
    pub msgs_sent: Option<u64>,
    /// Their bytes, header + payload (`None` unless `metrics.per_connection`).
    pub bytes_sent: Option<u64>,
    /// Messages received and dispatched from it (`None` unless
    /// `metrics.per_connection`).
    pub msgs_received: Option<u64>,
    /// Their bytes, header + payload.
    pub bytes_received: Option<u64>,
    /// Bytes written into its outgoing rings since it opened.
    pub ring_written: u64,
    /// Bytes in its rings not yet completed by the transport (ring fill).
    pub ring_used: u64,
    /// Capacity of its rings.
    pub ring_capacity: u64,
    /// Sent bytes the peer has not confirmed (flow control).
    pub flow_in_flight: u64,
    /// The peer's flow-control window.
    pub flow_window: u64,
    /// Sends that found the window full.
    pub flow_stalls: u64,
    /// Time those sends waited, in nanoseconds.
    pub flow_blocked_ns: u64,
    /// Received bytes waiting for a handler thread.
    pub inbox_bytes: u64,
    /// Received buffers waiting for a handler thread.
    pub inbox_buffers: u64,
    /// Earlier connections to this peer that closed cleanly.
    pub closes: u64,
    /// Earlier connections to this peer that broke (errors).
    pub errors: u64,
    /// Why the last earlier connection to this peer ended.
    pub last_close_reason: Option<String>,
}

/// Closes and errors of connections to each peer, kept after the
/// connections are gone.
#[derive(Debug, Default)]
pub struct PeerHistory {
    peers: HashMap<NodeId, (u64, u64, String)>,
}

impl PeerHistory {
    /// Records that `conn` closed (`failed`: it broke).
    pub fn closed(&mut self, conn: &Connection, reason: &str, failed: bool) {
        let e = self.peers.entry(conn.peer).or_default();
        if failed {
            e.1 += 1;
        } else {
            e.0 += 1;
        }
        e.2.clear();
        e.2.push_str(reason);
    }

    fn of(&self, peer: NodeId) -> (u64, u64, Option<String>) {
        self.peers
            .get(&peer)
            .map_or((0, 0, None), |(c, e, r)| (*c, *e, Some(r.clone())))
    }
}

/// Publishes every `metrics.publish_interval_ms` until the node shuts
/// down (looking every 20 ms, so shutdown does not wait for an interval).
#[cfg(feature = "metrics")]
pub(crate) fn publish_loop(core: Weak<Core>) {
    let mut next = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(20));
        let Some(core) = core.upgrade() else { return };
        if core.is_shut_down() {
            return;
        }
        if Instant::now() >= next {
            core.publish_metrics();
            next = Instant::now() + Duration::from_millis(core.config.metrics.publish_interval_ms);
        }
        drop::<Arc<Core>>(core);
    }
}

impl Core {
    /// Counts one message of `bytes` sent on `conn`.
    #[inline]
    pub(crate) fn count_sent(&self, conn: &Connection, bytes: u64) {
        self.stats.sent.add(conn.id, conn.sent_slot, bytes);
    }

    /// Counts `msgs` messages of `bytes` in total dispatched from `conn`.
    #[inline]
    pub(crate) fn count_received(&self, conn: &Connection, msgs: u64, bytes: u64) {
        self.stats.received.add(msgs, bytes);
        if let Some(c) = &conn.counters {
            c.received_messages.fetch_add(msgs, Ordering::Relaxed);
            c.received_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// Every current connection's statistics, by peer, plus peers that
    /// had connections and have none now.
    pub fn connection_stats(&self) -> Vec<ConnectionStats> {
        let history = self.peer_history.lock();
        let mut out: Vec<ConnectionStats> = self
            .connections
            .all()
            .iter()
            .filter(|c| c.id != 0)
            .map(|c| {
                let (closes, errors, last_close_reason) = history.of(c.peer);
                let (mut written, mut used, mut capacity) = (0, 0, 0);
                for r in c.rings() {
                    let p = r.positions();
                    written += p.reserved;
                    used += p.reserved.saturating_sub(p.front);
                    capacity += r.capacity() as u64;
                }
                let flow = c.flow.snapshot();
                let (inbox_bytes, inbox_buffers) = {
                    let i = c.inbox.lock();
                    (i.bytes() as u64, i.len() as u64)
                };
                let counters = c.counters.as_deref();
                let sent = counters.map(|_| self.stats.sent.of_connection(c.id, c.sent_slot));
                ConnectionStats {
                    peer: c.peer.0,
                    id: c.id,
                    state: match c.state() {
                        ConnState::Connecting => "connecting",
                        ConnState::Open => "open",
                        ConnState::Closed => "closed",
                    },
                    msgs_sent: sent.map(|s| s.0),
                    bytes_sent: sent.map(|s| s.1),
                    msgs_received: counters.map(|k| k.received_messages.load(Ordering::Relaxed)),
                    bytes_received: counters.map(|k| k.received_bytes.load(Ordering::Relaxed)),
                    ring_written: written,
                    ring_used: used,
                    ring_capacity: capacity,
                    flow_in_flight: flow.in_flight,
                    flow_window: flow.window,
                    flow_stalls: flow.stalls,
                    flow_blocked_ns: flow.blocked_ns,
                    inbox_bytes,
                    inbox_buffers,
                    closes,
                    errors,
                    last_close_reason,
                }
            })
            .collect();
        for (&peer, (closes, errors, reason)) in &history.peers {
            if !out.iter().any(|c| c.peer == peer.0) {
                out.push(ConnectionStats {
                    peer: peer.0,
                    state: "closed",
                    closes: *closes,
                    errors: *errors,
                    last_close_reason: Some(reason.clone()),
                    ..ConnectionStats::default()
                });
            }
        }
        out.sort_by_key(|c| (c.peer, c.id));
        out
    }

    /// Publishes the node's and every connection's counters through the
    /// `metrics` façade (to whatever recorder the application installed:
    /// a Prometheus exporter, a logger, ...): counters as absolute values,
    /// fills as gauges, labelled with `node` and (per connection) `peer`.
    #[cfg(feature = "metrics")]
    pub fn publish_metrics(&self) {
        use metrics::{counter, gauge};
        let node = self.own.0.to_string();
        let s = self.stats();
        for (name, v) in [
            ("dxnet_messages_sent", s.msgs_sent),
            ("dxnet_messages_received", s.msgs_received),
            ("dxnet_bytes_sent", s.bytes_sent),
            ("dxnet_bytes_received", s.bytes_received),
            ("dxnet_connections_opened", s.connections_opened),
            ("dxnet_connections_closed", s.connections_closed),
            ("dxnet_unknown_messages", s.unknown_messages),
            ("dxnet_inline_buffers", s.inline_buffers),
            ("dxnet_events_dropped", s.events_dropped),
        ] {
            counter!(name, "node" => node.clone()).absolute(v);
        }
        gauge!("dxnet_incoming_peak_buffers", "node" => node.clone())
            .set(s.incoming_peak_buffers as f64);
        gauge!("dxnet_incoming_peak_bytes", "node" => node.clone())
            .set(s.incoming_peak_bytes as f64);
        for c in self.connection_stats() {
            let peer = c.peer.to_string();
            let labels = [("node", node.clone()), ("peer", peer)];
            for (name, v) in [
                ("dxnet_connection_messages_sent", c.msgs_sent),
                ("dxnet_connection_bytes_sent", c.bytes_sent),
                ("dxnet_connection_messages_received", c.msgs_received),
                ("dxnet_connection_bytes_received", c.bytes_received),
            ] {
                if let Some(v) = v {
                    counter!(name, &labels).absolute(v);
                }
            }
            for (name, v) in [
                ("dxnet_connection_ring_written_bytes", c.ring_written),
                ("dxnet_connection_flow_stalls", c.flow_stalls),
                ("dxnet_connection_flow_blocked_ns", c.flow_blocked_ns),
                ("dxnet_connection_closes", c.closes),
                ("dxnet_connection_errors", c.errors),
            ] {
                counter!(name, &labels).absolute(v);
            }
            for (name, v) in [
                ("dxnet_connection_ring_used_bytes", c.ring_used),
                ("dxnet_connection_flow_in_flight_bytes", c.flow_in_flight),
                ("dxnet_connection_inbox_bytes", c.inbox_bytes),
                ("dxnet_connection_inbox_buffers", c.inbox_buffers),
            ] {
                gauge!(name, &labels).set(v as f64);
            }
        }
    }
}
