//! Node configuration: loadable from TOML or JSON, every field defaulted.
//!
//! ```toml
//! node_id = 1
//! transport = "tcp"
//! [limits]
//! request_timeout_ms = 2000
//! [[nodes]]
//! id = 1
//! address = "127.0.0.1:22221"
//! [[nodes]]
//! id = 2
//! address = "127.0.0.1:22222"
//! ```

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{Error, NodeId, Result};

/// Most outgoing ring buffers a TCP connection may have (`tcp.rings`).
pub(crate) const MAX_RINGS: usize = 16;

/// Which transport engine carries the bytes between nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum TransportKind {
    /// In-process: nodes of one process exchange buffers directly (tests,
    /// measuring the core pipeline alone).
    Loopback,
    /// TCP over any IP network.
    #[default]
    Tcp,
    /// InfiniBand / RoCE verbs (msgrc engine).
    Ib,
}

impl TransportKind {
    /// The Cargo feature that builds this engine into dxnet (`None`: always
    /// built in).
    pub fn feature(self) -> Option<&'static str> {
        match self {
            TransportKind::Loopback => None,
            TransportKind::Tcp => Some("tcp"),
            TransportKind::Ib => Some("ib"),
        }
    }

    /// Whether this build of dxnet contains the engine.
    pub fn is_available(self) -> bool {
        match self {
            TransportKind::Loopback => true,
            TransportKind::Tcp => cfg!(feature = "tcp"),
            TransportKind::Ib => cfg!(feature = "ib"),
        }
    }

    /// Why the engine is missing from this build (see [`Self::is_available`]).
    pub(crate) fn missing_feature(self) -> String {
        format!(
            "dxnet was built without the `{}` Cargo feature",
            self.feature().unwrap_or("?")
        )
    }
}

/// One entry of the node map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct NodeEntry {
    /// The node's id.
    pub id: u16,
    /// `host:port` the node listens on (TCP) or is discovered at (IB, UDP).
    /// Ignored by the loopback transport. With discovery it may be empty
    /// for other nodes: their address is learned when they probe this node
    /// (useful with identities, whose public keys must be listed).
    #[serde(default)]
    pub address: String,
    /// Hex Ed25519 public key of the node (its identity; needed for every
    /// node when `identity_key` is set). Default none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key: Option<String>,
}

impl NodeEntry {
    /// The entry of node `id` at `address` (no public key).
    pub fn new(id: u16, address: impl Into<String>) -> Self {
        NodeEntry {
            id,
            address: address.into(),
            public_key: None,
        }
    }
}

/// Settings of the load-adaptive parking of internal threads.
///
/// An idle thread first busy-polls for `spin_us`, then yields its core until
/// `yield_us` have passed, then parks until woken (new work wakes it at once).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct ParkConfig {
    /// Busy-poll time in microseconds before yielding. Default 50.
    pub spin_us: u64,
    /// Idle time in microseconds after which the thread parks. Default 1000.
    pub yield_us: u64,
    /// Longest single park in milliseconds (a safety net; wakes are explicit).
    /// Default 100.
    pub max_park_ms: u64,
    /// How many internal threads of the process may busy-poll at once
    /// (TCP receive threads, senders waiting for flow-control window;
    /// handler, send and InfiniBand receive threads never do); the others
    /// park at once. Default (`None`): half of the cores, at least one. A
    /// spinning thread gives its core away every few polls and parks as
    /// soon as that ran another thread (the core is wanted), and parks at
    /// once for a while after, so spinning does not starve working threads;
    /// it saves wake-ups while a core would otherwise be idle.
    pub max_spinning: Option<usize>,
    /// How long a blocking `request` to a slow peer busy-waits for its
    /// response before it parks, in microseconds (the caller's own thread;
    /// it counts as spinning, and idle threads park in its favour).
    /// Default 50.
    pub request_spin_us: u64,
    /// How long a blocking `request` busy-waits for its response before it
    /// parks, in microseconds, while at least half of the recent requests
    /// to that peer got their response within this time; to slower peers
    /// it waits `request_spin_us` (every 8th request still this long, to
    /// notice when the peer is fast again). A response that comes while
    /// the requester spins needs no wake-up. Default 1000.
    pub request_spin_max_us: u64,
    /// Up to how many blocked `request`s of the process wait for their
    /// response without parking (one of them reading the connection: TCP's
    /// read lease, InfiniBand's receive role; the others yielding their
    /// core between two looks);
    /// with more requesters blocked, a new one parks at once and the
    /// response wakes it. Default (`None`): no limit. A waiting requester
    /// yields its core to any thread with work at once and waits at most
    /// its spin time (`request_spin_us` / `request_spin_max_us`), and
    /// cores kept busy save the wake-ups of parked threads; a limit keeps
    /// the CPU that waiting requesters spend lower where that matters more
    /// than their latency.
    pub max_request_spinners: Option<usize>,
    /// Spin only where it pays (default): a thread spins and yields
    /// through an idle period only while most of its recent idle periods
    /// ended within `spin_us`, and parks at once otherwise, so that
    /// moderate rates (a message every 100 µs) cost wake-ups, not a core
    /// per spinning thread. `false`: every idle period spins `spin_us` and
    /// yields until `yield_us` (latency first, on cores the application
    /// does not need).
    pub adaptive: bool,
    /// A plain message that comes alone (the TCP send thread parked for
    /// 50 µs, nothing sent to that peer meanwhile, and recent such
    /// messages not followed by bursts) is written on the sender's thread
    /// instead of waking the send thread: at moderate rates about what
    /// blocking sockets cost per message. Default `false`: closed-loop
    /// round trips and many-thread throughput were slower with it
    /// (`docs/efficiency.md`).
    pub direct_writes: bool,
}

impl Default for ParkConfig {
    fn default() -> Self {
        Self {
            spin_us: 50,
            yield_us: 1000,
            max_park_ms: 100,
            max_spinning: None,
            request_spin_us: 50,
            request_spin_max_us: 1000,
            max_request_spinners: None,
            adaptive: true,
            direct_writes: false,
        }
    }
}

/// Zero-copy from reused [`crate::Buffer`]s (`[zero_copy]`): on an engine
/// with registered memory (InfiniBand), a buffer used often enough is
/// registered with the device and its bytes go from (or into) it in place
/// instead of through a copy into registered memory. Registering costs more
/// than one copy, so a buffer is registered only once its uses pay for it:
/// after `n > R / (C - V)` uses (R registration cost, C copy cost, V cost
/// of counting a use, all of the buffer's size), or speculatively at
/// `speculative_fraction` of that. The costs are measured on the device
/// when the first buffer is used (`Node::zero_copy_costs` shows them)
/// unless `reuse_threshold` fixes `n`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct ZeroCopyConfig {
    /// Off: every buffer's bytes are copied. Default on.
    pub enabled: bool,
    /// Buffers shorter than this are always copied (counting a use and
    /// naming a second memory region cost more than copying them).
    /// Default 128.
    pub min_bytes: usize,
    /// Uses after which a buffer is registered; `None` computes it per
    /// size from the measured costs. Default `None`.
    pub reuse_threshold: Option<u32>,
    /// A buffer is registered speculatively after this fraction of its
    /// threshold's uses (the frequent-buffer paper's 25 %); 1.0 waits for
    /// the whole threshold. Default 0.25.
    pub speculative_fraction: f64,
    /// Speculation stops when fewer than this fraction of the buffers
    /// registered speculatively went on to reach their threshold (the
    /// others were registered for nothing), and starts again when buffers
    /// reach it again. Default 0.2.
    pub min_frequent_fraction: f64,
    /// Most bytes of buffers registered at once; beyond it the least
    /// recently used registrations not in use are dropped, and a buffer
    /// that does not fit is copied. Default 256 MiB.
    pub max_pinned_bytes: u64,
}

impl Default for ZeroCopyConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            min_bytes: 128,
            reuse_threshold: None,
            speculative_fraction: 0.25,
            min_frequent_fraction: 0.2,
            max_pinned_bytes: 256 << 20,
        }
    }
}

/// Settings of the InfiniBand/RoCE engine (`transport = "ib"`). The
/// connection handshake (over UDP) uses each node's node-map address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct IbConfig {
    /// Verbs device name; empty picks the first device found.
    pub device: String,
    /// Port number on the device (1-based). Default 1.
    pub port: u8,
    /// GID table index (RoCE v2 needs the index of the IPv4/IPv6 GID). Default 0.
    pub gid_index: u8,
    /// Message work requests in flight per queue pair (its send queue
    /// holds these plus `rdma_depth`). Default 20.
    pub sq_size: u32,
    /// One-sided work requests (RDMA WRITE/READ parts) in flight per queue
    /// pair, on top of `sq_size`: one-sided traffic neither waits for
    /// message sends nor holds them up. Every quarter of it (at most 16
    /// parts in a row) one part asks for a completion. Default 64.
    pub rdma_depth: u32,
    /// Shared receive queue depth. Default 200.
    pub srq_size: u32,
    /// Send completion queue size. Default 400.
    pub send_cq_size: u32,
    /// Receive completion queue size. Default 400.
    pub recv_cq_size: u32,
    /// Scatter-gather entries (pool buffers) per receive work request: the
    /// largest receive is `recv_buffer_size` times this. Default 1: with
    /// 64 KiB buffers, one per request measured 1.18× the 64 B message
    /// rate of four (same 64 KiB throughput, round trips ~4 % shorter;
    /// Soft-RoCE VM, 3 alternating rounds); more suit small buffers.
    pub sges_per_recv: u32,
    /// Sends of at most this many bytes are copied into the work request
    /// (`IBV_SEND_INLINE`) instead of read by the device from the ring
    /// buffer: one memory access less per small send (what perftest does
    /// for its latency tests). 0 turns it off; a device that supports less
    /// gets queue pairs without it (logged). Default 128.
    pub max_inline_data: u32,
    /// Registered 64 KiB slots for the bytes of one-sided accesses in
    /// flight (`Node::write`/`read` copy through them; a part waits for a
    /// free slot), registered at the first access that needs one. Default
    /// 256 (16 MiB per node).
    pub staging_slots: u32,
}

impl Default for IbConfig {
    fn default() -> Self {
        Self {
            device: String::new(),
            port: 1,
            gid_index: 0,
            sq_size: 20,
            rdma_depth: 64,
            srq_size: 200,
            send_cq_size: 400,
            recv_cq_size: 400,
            sges_per_recv: 1,
            max_inline_data: 128,
            staging_slots: 256,
        }
    }
}

/// TLS for the TCP transport (off unless `[tls]` is given): TLS 1.3 with
/// mutual certificate authentication. Every node's certificate must be
/// signed by a CA in `ca` and carry the DNS subject alternative name
/// `node-<id>.dxnet` of its own node id; a peer whose certificate does not
/// name the id it claims is refused. `cargo run -p dxnet --example gen_certs`
/// writes a CA and node certificates for a node map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct TlsConfig {
    /// PEM file with this node's certificate chain, leaf first.
    pub cert: String,
    /// PEM file with this node's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: String,
    /// PEM file with the CA certificate(s) that sign the nodes' certificates.
    pub ca: String,
}

impl TlsConfig {
    /// TLS from the PEM files of this node's certificate chain, its private
    /// key and the cluster's CA.
    pub fn new(cert: impl Into<String>, key: impl Into<String>, ca: impl Into<String>) -> Self {
        TlsConfig {
            cert: cert.into(),
            key: key.into(),
            ca: ca.into(),
        }
    }

    /// The DNS name a node's certificate must carry: `node-<id>.dxnet`.
    pub fn node_name(id: NodeId) -> String {
        format!("node-{}.dxnet", id.0)
    }
}

/// Resource bounds of a node: ring buffers, receive buffers, the incoming
/// queue, flow control, connections, message size, and how long calls
/// wait (`[limits]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct Limits {
    /// Outgoing ring buffer size per connection in bytes (rounded up to a
    /// power of two). Default 2 MiB.
    pub orb_size: usize,
    /// Size of one pooled receive buffer in bytes. Default (`None`): the
    /// transport's, see [`Config::recv_buffer_size`].
    pub recv_buffer_size: Option<usize>,
    /// Number of pooled receive buffers. Default (`None`): as many as make
    /// 32 MiB, see [`Config::recv_pool_size`].
    pub recv_pool_size: Option<usize>,
    /// Incoming buffer queue limit in buffers (all connections). Default 256.
    pub incoming_max_buffers: usize,
    /// Incoming buffer queue limit in bytes (all connections). Default 16 MiB.
    pub incoming_max_bytes: usize,
    /// Flow-control window: bytes a sender may have unconfirmed per
    /// connection before it blocks. Default 4 MiB.
    pub flow_control_window: usize,
    /// Fraction of the window after which the receiver confirms processed
    /// bytes (0 < threshold <= 1). Default 0.5.
    pub flow_control_threshold: f64,
    /// Maximum number of open connections; the least recently used one is
    /// closed beyond it. Default 100.
    pub max_connections: usize,
    /// Largest message payload accepted from the network, in bytes. Default
    /// 64 MiB. Anything larger is treated as hostile and closes the connection.
    pub max_message_size: usize,
    /// Default request timeout in milliseconds. Default 5000.
    pub request_timeout_ms: u64,
    /// How long a send may block under back-pressure before it fails, in
    /// milliseconds. Default 5000.
    pub send_timeout_ms: u64,
    /// Connection-creation timeout (connect + handshake) in milliseconds.
    /// Default 2000.
    pub connect_timeout_ms: u64,
    /// How long [`crate::Node::shutdown`] (or dropping the node) waits for
    /// messages already sent to be written out before it closes the
    /// connections, in milliseconds (a peer that does not read makes it
    /// wait this long). 0: close at once, dropping unsent messages.
    /// Default 1000.
    pub shutdown_linger_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            orb_size: 2 << 20,
            recv_buffer_size: None,
            recv_pool_size: None,
            incoming_max_buffers: 256,
            incoming_max_bytes: 16 << 20,
            flow_control_window: 4 << 20,
            flow_control_threshold: 0.5,
            max_connections: 100,
            max_message_size: 64 << 20,
            request_timeout_ms: 5000,
            send_timeout_ms: 5000,
            connect_timeout_ms: 2000,
            shutdown_linger_ms: 1000,
        }
    }
}

/// Settings of the TCP engine (`[tcp]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct TcpConfig {
    /// Accept backlog of the listening socket (the kernel caps it at
    /// `net.core.somaxconn`). A burst of connecting nodes beyond it makes
    /// the kernel drop SYNs, and dialers wait a second for the retransmit.
    /// Default 4096.
    pub listen_backlog: u32,
    /// Incoming handshakes in progress at once; a new connection beyond it
    /// cuts off the oldest handshake still in progress (a legitimate dialer
    /// finishes in a few round trips, a half-open flood holds its slot for
    /// the whole connect timeout), so half-open connections cannot exhaust
    /// threads or memory nor lock new nodes out. Default 64.
    pub max_pending_handshakes: usize,
    /// Outgoing ring buffers per connection, sharing `limits.orb_size`
    /// (each gets the largest power of two within its share, at least
    /// 4 KiB; a ring's memory is touched only once a thread writes into
    /// it). A sending thread writes into the ring of the CPU it runs on
    /// (CPU number modulo the rings), and the send thread writes the rings'
    /// data out together, each ring's in chunks. Threads on different
    /// cores then do not share the cache lines of one ring: with one ring,
    /// every sender's reservation and every message's lines move between
    /// the cores that send. A thread moved to another CPU keeps writing
    /// into its old ring until everything it wrote there was written out,
    /// so a thread's messages to one node stay in order.
    /// With one ring, a message sent after other threads' sends to the
    /// same node returned (ordered by a join, a barrier, a channel)
    /// arrives after theirs; with more, it may overtake them (a thread
    /// marking the end of other threads' data must then not rely on
    /// arrival order: see docs/failures.md, Order).
    /// 0 (the default): twice the CPUs this process may use, at least 2
    /// and at most 16 ([`TcpConfig::ring_count`]); else 1 to 16.
    pub rings: usize,
    /// Write coalescing of the send thread: while a connection's data keeps
    /// coming, the send thread writes it once at least this many bytes are
    /// ready or [`TcpConfig::coalesce_us`] passed since its last write to
    /// that connection, whichever comes first, instead of writing whatever
    /// arrived during the previous write. Fewer, larger writes leave more
    /// CPU to the threads that make the data (a small write on a local
    /// link costs about as much as a large one). A connection written to
    /// longer ago than `coalesce_us`, or whose last write carried less
    /// than 256 bytes, is written at once; requests, responses and
    /// flow-control confirmations are never held back. At most half of a
    /// ring ([`TcpConfig::rings`] share `limits.orb_size`) and of
    /// `limits.flow_control_window` counts. 0
    /// turns coalescing off. Default 65536.
    pub coalesce_bytes: usize,
    /// The longest a connection's ready data waits for more to coalesce
    /// with, in microseconds (see [`TcpConfig::coalesce_bytes`]); the send
    /// thread gives its core away meanwhile. At most 10 000. Default 30.
    pub coalesce_us: u64,
    /// Messages from a [`crate::Buffer`] of at least this many bytes
    /// (`Node::send_buffer`, `Node::send_buffer_async`) go to the socket
    /// from the buffer itself instead of through a copy into the
    /// connection's ring: only the message header goes into the ring, and
    /// the send thread writes the payload right behind it in the same
    /// chunk, so the message arrives as a copied one does. A send in place
    /// holds the buffer until its bytes are written out and costs a
    /// completion: smaller buffers are cheaper to copy. 0 turns it off.
    /// Default 262144 (256 KiB).
    pub send_in_place_from: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            listen_backlog: 4096,
            max_pending_handshakes: 64,
            rings: 0,
            coalesce_bytes: 64 << 10,
            coalesce_us: 30,
            send_in_place_from: 256 << 10,
        }
    }
}

impl TcpConfig {
    /// The outgoing rings of each connection: [`TcpConfig::rings`], or
    /// for 0 twice the CPUs this process may use, within 2..=16.
    pub fn ring_count(&self) -> usize {
        match self.rings {
            0 => std::thread::available_parallelism()
                .map_or(2, |n| n.get() * 2)
                .clamp(2, MAX_RINGS),
            n => n.min(MAX_RINGS),
        }
    }
}

/// Settings of the in-process loopback engine (`[loopback]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct LoopbackConfig {
    /// Nodes of one process find each other in the fabric of this name.
    /// Default `"default"`.
    pub fabric: String,
}

impl Default for LoopbackConfig {
    fn default() -> Self {
        Self {
            fabric: "default".into(),
        }
    }
}

/// Discovery of the cluster's nodes at run time (`[discovery]`): a node
/// probes the addresses it knows (the node map's entries and `seeds`) over
/// UDP until they answer, and connects only to the nodes discovered so;
/// see docs/guide.md, Discovery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct DiscoveryConfig {
    /// `host:port` addresses (host names are resolved at every probe) of
    /// nodes whose ids this node does not know; they are probed like the
    /// node map's entries and join the map when they answer. Default none.
    pub seeds: Vec<String>,
    /// Time between two probes of an address not discovered yet (and of a
    /// discovered node without a connection, which keeps its claim fresh).
    /// Default 100 ms.
    pub interval_ms: u64,
    /// The address announced to the others (`host:port`, at most 255
    /// bytes). Default: this node's node-map address.
    pub advertise: Option<String>,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            seeds: Vec::new(),
            interval_ms: 100,
            advertise: None,
        }
    }
}

impl DiscoveryConfig {
    /// Discovery probing `seeds` (besides the node map) every
    /// `interval_ms`.
    pub fn new(seeds: Vec<String>, interval_ms: u64) -> Self {
        Self {
            seeds,
            interval_ms,
            advertise: None,
        }
    }
}

/// Per-connection statistics and their export (`[metrics]`); see
/// [`crate::Node::connection_stats`] and `Node::publish_metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct MetricsConfig {
    /// Count messages and bytes per connection and direction (each sent
    /// message adds to a counter of its own thread, each received buffer
    /// to its connection's). The rest of a connection's statistics (ring
    /// fill, flow-control stalls, inbox, closes) is always kept. Default
    /// false.
    pub per_connection: bool,
    /// With the `metrics` feature: a thread publishes the node's and every
    /// connection's counters through the `metrics` façade this often, in
    /// milliseconds; 0: only when `Node::publish_metrics` is called.
    /// Default 0.
    pub publish_interval_ms: u64,
    /// Keep per-stage latency histograms of requests (see
    /// [`crate::breakdown`] and `Node::latency_breakdown`): about eight
    /// clock reads per round trip, and 18 KiB of histogram cells for each
    /// thread that records (requesters, receive and handler threads).
    /// Default false.
    pub breakdown: bool,
}

/// Full configuration of one node. Every field has a documented default; a
/// file only needs `node_id` and `nodes`. Settings of one concern are in
/// their section: `[limits]`, `[park]`, `[tcp]`, `[tls]`, `[ib]`,
/// `[loopback]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct Config {
    /// This node's id. Default 0.
    pub node_id: u16,
    /// The node map: id → address. Default empty (only the own node).
    pub nodes: Vec<NodeEntry>,
    /// Transport engine. Default `tcp`.
    pub transport: TransportKind,
    /// Message-handler threads. Default 2.
    pub handler_threads: usize,
    /// Received buffers of at most this many bytes are handled (receivers
    /// run) on the TCP/IB receive thread itself when every handler thread is
    /// parked, saving a thread wake-up per message in request/response
    /// traffic; the receive thread hands its role to a standby while it
    /// does (see `core/inline.rs`). 0 hands everything to the handler
    /// threads. Default 8192 (a 4 KiB message with its header).
    pub inline_receive_bytes: usize,
    /// Shared cluster secret for authenticating connections (HMAC-SHA256
    /// challenge–response). `None` accepts any peer and logs a warning.
    pub cluster_secret: Option<String>,
    /// Hex Ed25519 private key (32-byte seed) of this node's identity: the
    /// connection set-up is then signed by each side and checked against
    /// the node map's `public_key`s, so no node can act as another node id
    /// (see `dxnet::proto::identity`). Default none.
    pub identity_key: Option<String>,
    /// Resource bounds and timeouts.
    pub limits: Limits,
    /// Parking of idle internal threads.
    pub park: ParkConfig,
    /// TCP engine settings.
    pub tcp: TcpConfig,
    /// TLS encryption and certificate authentication of TCP connections.
    /// Default `None` (plaintext; use on trusted networks only).
    pub tls: Option<TlsConfig>,
    /// InfiniBand/RoCE engine settings.
    pub ib: IbConfig,
    /// Loopback engine settings.
    pub loopback: LoopbackConfig,
    /// Discovery of nodes at run time. Default `None`: every node-map
    /// entry counts as discovered from the start.
    pub discovery: Option<DiscoveryConfig>,
    /// Zero-copy from reused buffers.
    pub zero_copy: ZeroCopyConfig,
    /// Per-connection statistics and their export.
    pub metrics: MetricsConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            node_id: 0,
            nodes: Vec::new(),
            transport: TransportKind::Tcp,
            handler_threads: 2,
            inline_receive_bytes: 8192,
            cluster_secret: None,
            identity_key: None,
            limits: Limits::default(),
            park: ParkConfig::default(),
            tcp: TcpConfig::default(),
            tls: None,
            ib: IbConfig::default(),
            loopback: LoopbackConfig::default(),
            discovery: None,
            zero_copy: ZeroCopyConfig::default(),
            metrics: MetricsConfig::default(),
        }
    }
}

/// Receive memory a node's pool has by default (`limits.recv_pool_size`
/// unset): 512 buffers of 64 KiB, or 128 of 256 KiB.
const DEFAULT_RECV_POOL_BYTES: usize = 32 << 20;

impl Config {
    /// Size of one pooled receive buffer: `limits.recv_buffer_size`, or by
    /// default 256 KiB over TCP and 64 KiB over InfiniBand and loopback.
    ///
    /// TCP reads a busy connection's stream one buffer per system call and
    /// hands each buffer to the handler threads: larger buffers mean fewer
    /// reads, hand-overs and messages cut at a buffer's end per byte
    /// (docs/configuration.md has the measurement). InfiniBand posts
    /// each buffer as one receive work request (a message of any size
    /// takes one), so more, smaller buffers keep more receives posted.
    pub fn recv_buffer_size(&self) -> usize {
        self.limits
            .recv_buffer_size
            .unwrap_or(match self.transport {
                TransportKind::Tcp => 256 << 10,
                _ => 64 << 10,
            })
    }

    /// Number of pooled receive buffers: `limits.recv_pool_size`, or by
    /// default as many as make 32 MiB (at least 2).
    pub fn recv_pool_size(&self) -> usize {
        self.limits
            .recv_pool_size
            .unwrap_or((DEFAULT_RECV_POOL_BYTES / self.recv_buffer_size()).max(2))
    }

    /// This node's identity (`identity_key` and the node map's public
    /// keys), if configured.
    pub(crate) fn identity(&self) -> Result<Option<crate::proto::identity::Identity>> {
        let nodes: Vec<(u16, Option<&str>)> = self
            .nodes
            .iter()
            .map(|n| (n.id, n.public_key.as_deref()))
            .collect();
        crate::proto::identity::Identity::from_config(
            self.node_id,
            self.identity_key.as_deref(),
            &nodes,
        )
        .map_err(|e| Error::Config(e.0))
    }

    /// A loopback configuration for node `id` among `n` nodes with ids 0..n.
    pub fn loopback(id: u16, n: u16, fabric: &str) -> Self {
        Self {
            node_id: id,
            nodes: (0..n)
                .map(|i| NodeEntry {
                    id: i,
                    address: String::new(),
                    public_key: None,
                })
                .collect(),
            transport: TransportKind::Loopback,
            loopback: LoopbackConfig {
                fabric: fabric.to_string(),
            },
            ..Self::default()
        }
    }

    /// A TCP configuration for node `id`; node `i` listens on
    /// `127.0.0.1:(base_port + i)` for `i` in 0..n.
    pub fn tcp_localhost(id: u16, n: u16, base_port: u16) -> Self {
        Self {
            node_id: id,
            nodes: (0..n)
                .map(|i| NodeEntry {
                    id: i,
                    address: format!("127.0.0.1:{}", base_port + i),
                    public_key: None,
                })
                .collect(),
            transport: TransportKind::Tcp,
            ..Self::default()
        }
    }

    /// Reads a configuration from a `.toml` or `.json` file (by extension;
    /// anything else is tried as TOML).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("cannot read {}: {e}", path.display())))?;
        let cfg = if path.extension().is_some_and(|e| e == "json") {
            Self::from_json(&text)?
        } else {
            Self::from_toml(&text)?
        };
        Ok(cfg)
    }

    /// Parses TOML text and validates it.
    pub fn from_toml(text: &str) -> Result<Self> {
        let de = toml::Deserializer::parse(text).map_err(|e| Error::Config(e.to_string()))?;
        let cfg: Self = serde_path_to_error::deserialize(de).map_err(config_error)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses JSON text and validates it.
    pub fn from_json(text: &str) -> Result<Self> {
        let mut de = serde_json::Deserializer::from_str(text);
        let cfg: Self = serde_path_to_error::deserialize(&mut de).map_err(config_error)?;
        de.end().map_err(|e| Error::Config(e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// This node's id.
    pub fn own_id(&self) -> NodeId {
        NodeId(self.node_id)
    }

    /// The address of `node` in the node map.
    pub fn address_of(&self, node: NodeId) -> Option<&str> {
        self.nodes
            .iter()
            .find(|n| n.id == node.0)
            .map(|n| n.address.as_str())
    }

    /// The default request timeout.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.limits.request_timeout_ms)
    }

    /// Checks every field; the error names the field and the reason.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        let mut seen = std::collections::HashSet::new();
        for n in &self.nodes {
            if !seen.insert(n.id) {
                return bad(format!("nodes: node id {} listed twice", n.id));
            }
            // With discovery a listed node may have no address (its id and
            // key are known, where it runs is discovered); not this node.
            let may_lack = self.discovery.is_some() && n.id != self.node_id;
            if self.transport != TransportKind::Loopback && n.address.is_empty() && !may_lack {
                return bad(format!("nodes: node {} has no address", n.id));
            }
        }
        if self.limits.orb_size < 4096 || self.limits.orb_size > (1 << 31) {
            return bad(format!(
                "limits.orb_size {} must be within 4 KiB..=2 GiB",
                self.limits.orb_size
            ));
        }
        let recv_buffer_size = self.recv_buffer_size();
        if !(1024..=(1 << 30)).contains(&recv_buffer_size) {
            return bad(format!(
                "limits.recv_buffer_size {recv_buffer_size} must be within 1 KiB..=1 GiB"
            ));
        }
        if self.recv_pool_size() < 2 {
            return bad("limits.recv_pool_size must be at least 2".into());
        }
        if self.limits.incoming_max_buffers == 0
            || self.limits.incoming_max_bytes < recv_buffer_size
        {
            return bad(
                "limits.incoming_max_buffers must be > 0 and limits.incoming_max_bytes >= limits.recv_buffer_size"
                    .into(),
            );
        }
        if self.handler_threads == 0 {
            return bad("handler_threads must be at least 1".into());
        }
        if self.limits.flow_control_window < 1024 {
            return bad("limits.flow_control_window must be at least 1024 bytes".into());
        }
        if !(self.limits.flow_control_threshold > 0.0 && self.limits.flow_control_threshold <= 1.0)
        {
            return bad("limits.flow_control_threshold must be in (0, 1]".into());
        }
        if self.limits.max_connections == 0 {
            return bad("limits.max_connections must be at least 1".into());
        }
        if self.limits.max_message_size == 0 || self.limits.max_message_size > u32::MAX as usize {
            return bad("limits.max_message_size must be within 1..=4 GiB-1".into());
        }
        if self.limits.connect_timeout_ms == 0
            || self.limits.request_timeout_ms == 0
            || self.limits.send_timeout_ms == 0
        {
            return bad("limits: timeouts must be > 0 ms".into());
        }
        if self.tcp.max_pending_handshakes == 0 || self.tcp.listen_backlog == 0 {
            return bad("tcp: max_pending_handshakes and listen_backlog must be > 0".into());
        }
        if self.tcp.coalesce_us > 10_000 {
            return bad(format!(
                "tcp: coalesce_us must be at most 10000 (10 ms), not {}",
                self.tcp.coalesce_us
            ));
        }
        if self.tcp.rings > MAX_RINGS {
            return bad(format!(
                "tcp: rings must be 0 (automatic) or 1 to {MAX_RINGS}, not {}",
                self.tcp.rings
            ));
        }
        let zc = &self.zero_copy;
        let fractions_ok = zc.speculative_fraction > 0.0
            && zc.speculative_fraction <= 1.0
            && (0.0..=1.0).contains(&zc.min_frequent_fraction);
        if !fractions_ok {
            return bad(
                "zero_copy: speculative_fraction must be in (0, 1] and min_frequent_fraction in [0, 1]"
                    .into(),
            );
        }
        if zc.reuse_threshold == Some(0) {
            return bad("zero_copy.reuse_threshold must be at least 1".into());
        }
        self.identity()?;
        if !self.transport.is_available() {
            return bad(format!(
                "transport {:?}: {}",
                self.transport,
                self.transport.missing_feature()
            ));
        }
        if let Some(d) = &self.discovery {
            if self.transport == TransportKind::Loopback {
                return bad("discovery: needs a network transport (tcp or ib)".into());
            }
            if d.interval_ms == 0 {
                return bad("discovery.interval_ms must be > 0".into());
            }
            let advertise = match &d.advertise {
                Some(a) => a.as_str(),
                None => match self.address_of(NodeId(self.node_id)) {
                    Some(a) => a,
                    None => {
                        return bad(format!(
                            "discovery: node {} (this node) needs its address in nodes or discovery.advertise",
                            self.node_id
                        ))
                    }
                },
            };
            if advertise.is_empty() || advertise.len() > crate::proto::discovery::MAX_ADDRESS_LEN {
                return bad(format!(
                    "discovery.advertise {advertise:?} must be 1..=255 bytes"
                ));
            }
            if let Some(s) = d.seeds.iter().find(|s| s.is_empty()) {
                return bad(format!("discovery.seeds: empty address {s:?}"));
            }
        }
        if let Some(t) = &self.tls {
            if !cfg!(feature = "tls") {
                return bad("tls: dxnet was built without the `tls` Cargo feature".into());
            }
            if self.transport != TransportKind::Tcp {
                return bad("tls: only the tcp transport supports TLS".into());
            }
            if t.cert.is_empty() || t.key.is_empty() || t.ca.is_empty() {
                return bad("tls: cert, key and ca must all name PEM files".into());
            }
        }
        if self.ib.sges_per_recv == 0
            || self.ib.sq_size == 0
            || self.ib.rdma_depth == 0
            || self.ib.srq_size == 0
            || self.ib.staging_slots == 0
        {
            return bad(
                "ib: sges_per_recv, sq_size, rdma_depth, srq_size and staging_slots must be > 0"
                    .into(),
            );
        }
        Ok(())
    }
}

/// A parse error that names where in the file it arose (`ib`, `nodes[2]`),
/// so an unknown key is reported with its section.
fn config_error<E: std::fmt::Display>(e: serde_path_to_error::Error<E>) -> Error {
    let path = e.path().to_string();
    let inner = e.into_inner();
    if path == "." || path.is_empty() {
        Error::Config(inner.to_string())
    } else {
        Error::Config(format!("in `{path}`: {inner}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_and_json_with_defaults() {
        let t = Config::from_toml(
            "node_id = 2\ntransport = \"tcp\"\n[[nodes]]\nid = 2\naddress = \"127.0.0.1:5000\"\n",
        )
        .unwrap();
        assert_eq!(t.node_id, 2);
        assert_eq!(t.limits.orb_size, Config::default().limits.orb_size);
        let sec = Config::from_toml(
            "node_id = 1\n[limits]\norb_size = 65536\nrequest_timeout_ms = 10\n[tcp]\nmax_pending_handshakes = 8\n[loopback]\nfabric = \"f\"\n",
        )
        .unwrap();
        assert_eq!(sec.limits.orb_size, 65536);
        assert_eq!(sec.limits.request_timeout_ms, 10);
        assert_eq!(
            sec.limits.send_timeout_ms, 5000,
            "the section's other defaults stay"
        );
        assert_eq!(sec.tcp.max_pending_handshakes, 8);
        assert_eq!(sec.tcp.listen_backlog, 4096);
        assert_eq!(sec.loopback.fabric, "f");
        assert_eq!(t.address_of(NodeId(2)), Some("127.0.0.1:5000"));
        let j = Config::from_json(
            r#"{"node_id":1,"transport":"loopback","handler_threads":4,"park":{"spin_us":0}}"#,
        )
        .unwrap();
        assert_eq!(j.handler_threads, 4);
        assert_eq!(j.park.spin_us, 0);
        assert_eq!(j.park.yield_us, ParkConfig::default().yield_us);
        assert_eq!(j.park.request_spin_max_us, 1000);
        assert_eq!(j.ib.max_inline_data, 128);
        let j = Config::from_json(
            r#"{"node_id":1,"park":{"request_spin_max_us":300},"ib":{"max_inline_data":0}}"#,
        )
        .unwrap();
        assert_eq!(j.park.request_spin_max_us, 300);
        assert_eq!(j.ib.max_inline_data, 0);
    }

    #[test]
    fn receive_buffers_by_transport_unless_set() {
        let tcp = Config::from_toml("transport = \"tcp\"").unwrap();
        assert_eq!(
            (tcp.recv_buffer_size(), tcp.recv_pool_size()),
            (256 << 10, 128)
        );
        for kind in ["ib", "loopback"] {
            let c = Config::from_toml(&format!("transport = \"{kind}\"")).unwrap();
            assert_eq!((c.recv_buffer_size(), c.recv_pool_size()), (64 << 10, 512));
        }
        // A size alone: the pool keeps its memory; both set: as given.
        let c = Config::from_toml("[limits]\nrecv_buffer_size = 1048576").unwrap();
        assert_eq!((c.recv_buffer_size(), c.recv_pool_size()), (1 << 20, 32));
        let c = Config::from_toml(
            "[limits]\nrecv_buffer_size = 1073741824\nincoming_max_bytes = 1073741824",
        )
        .unwrap();
        assert_eq!(c.recv_pool_size(), 2, "at least two buffers");
        let c = Config::from_toml("[limits]\nrecv_buffer_size = 4096\nrecv_pool_size = 3").unwrap();
        assert_eq!((c.recv_buffer_size(), c.recv_pool_size()), (4096, 3));
        let e = Config::from_toml("[limits]\nrecv_buffer_size = 512").unwrap_err();
        assert!(e.to_string().contains("limits.recv_buffer_size"), "{e}");
        let e = Config::from_toml("[limits]\nrecv_pool_size = 1").unwrap_err();
        assert!(e.to_string().contains("limits.recv_pool_size"), "{e}");
    }

    /// A typo in any section is an error naming the key and its section,
    /// in TOML and in JSON.
    #[test]
    fn every_section_rejects_unknown_keys() {
        let node = "[[nodes]]\nid = 0\naddress = \"127.0.0.1:7000\"\n";
        let cases = [
            ("", "typo = 1", "typo"),
            (
                "nodes[1]",
                "[[nodes]]\nid = 1\naddress = \"a:1\"\nadress = \"b\"",
                "adress",
            ),
            ("limits", "[limits]\norb_sise = 1", "orb_sise"),
            ("park", "[park]\nspin = 1", "spin"),
            ("tcp", "[tcp]\nnodelay = true", "nodelay"),
            (
                "tls",
                "[tls]\ncert = \"a\"\nkey = \"b\"\nca = \"c\"\ncrl = \"d\"",
                "crl",
            ),
            ("ib", "[ib]\ndevce = \"rxe0\"", "devce"),
            ("loopback", "[loopback]\nlatency = 1", "latency"),
            ("discovery", "[discovery]\nseed = []", "seed"),
            ("zero_copy", "[zero_copy]\nenable = true", "enable"),
            ("metrics", "[metrics]\nexport = true", "export"),
        ];
        for (section, text, key) in cases {
            let e = Config::from_toml(&format!("{node}{text}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{section}: {e}");
            if !section.is_empty() {
                assert!(
                    e.contains(&format!("in `{section}.{key}`")),
                    "{section}: {e}"
                );
            }
        }
        let e = Config::from_json(r#"{"ib": {"devce": "rxe0"}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("in `ib.devce`"), "{e}");
        let e = Config::from_json(r#"{"node_id": 0} trailing"#).unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{e}");
    }

    #[test]
    fn rejects_bad_values_with_field_name() {
        let e = Config::from_toml("handler_threads = 0").unwrap_err();
        assert!(e.to_string().contains("handler_threads"), "{e}");
        let e = Config::from_toml("no_such_field = 1").unwrap_err();
        assert!(e.to_string().contains("no_such_field"), "{e}");
        // A limit at the top level (outside its section) is an unknown field.
        let e = Config::from_toml("orb_size = 65536").unwrap_err();
        assert!(e.to_string().contains("orb_size"), "{e}");
        let e = Config::from_toml("[limits]\norb_size = 16").unwrap_err();
        assert!(e.to_string().contains("limits.orb_size"), "{e}");
        let e = Config::from_toml("[tcp]\nmax_pending_handshakes = 0").unwrap_err();
        assert!(e.to_string().contains("tcp"), "{e}");
        let e = Config::from_toml(
            "[[nodes]]\nid = 1\naddress = \"a:1\"\n[[nodes]]\nid = 1\naddress = \"a:2\"",
        )
        .unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
    }

    #[test]
    fn discovery_section() {
        let node = "node_id = 1\n[[nodes]]\nid = 1\naddress = \"10.0.0.1:7000\"\n";
        let c = Config::from_toml(&format!(
            "{node}[[nodes]]\nid = 2\n[discovery]\nseeds = [\"10.0.0.9:7000\", \"seed.example:7000\"]\n"
        ))
        .unwrap();
        let d = c.discovery.unwrap();
        assert_eq!(d.seeds.len(), 2);
        assert_eq!(d.interval_ms, 100);
        // Without discovery an entry needs its address.
        let e = Config::from_toml(&format!("{node}[[nodes]]\nid = 2\n")).unwrap_err();
        assert!(e.to_string().contains("no address"), "{e}");
        let e = Config::from_toml(&format!("{node}[discovery]\ninterval_ms = 0\n")).unwrap_err();
        assert!(e.to_string().contains("discovery.interval_ms"), "{e}");
        let e = Config::from_toml("transport = \"loopback\"\n[discovery]\n").unwrap_err();
        assert!(e.to_string().contains("discovery"), "{e}");
        let e = Config::from_toml("node_id = 3\n[discovery]\n").unwrap_err();
        assert!(e.to_string().contains("this node"), "{e}");
        let e = Config::from_toml(&format!(
            "{node}[discovery]\nadvertise = \"{}\"\n",
            "x".repeat(300)
        ))
        .unwrap_err();
        assert!(e.to_string().contains("advertise"), "{e}");
    }
}
