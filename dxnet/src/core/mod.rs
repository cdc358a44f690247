//! The transport-independent core: everything between the public API and a
//! transport engine, testable without sockets.
//!
//! - [`incoming`]: the bounded incoming queue feeding the handler threads
//!   (receive buffers come from [`crate::primitives::pool`]).
//! - [`flow`]: window-based flow control.
//! - [`requests`]: pending requests and their responses.
//! - [`connection`]: per-peer state and the connection table.
//! - [`inline`]: handling on receive threads and the receive role.
//! - [`regions`]: exposed memory regions and one-sided operations.
//! - [`events`]: connection events for the application.
//!
//! The ring buffer, write-interest queue, buffer pool and parking live in
//! [`crate::primitives`]; codec, reassembly and wire formats in
//! [`crate::proto`].
//!
//! [`Core`] ties them together; its methods are split by concern: start,
//! registration and shutdown here, the send path in `send.rs`, the
//! connection manager (open on first use, least-recently-used closing,
//! failure handling) in `connections.rs`, the hooks a [`Transport`] calls
//! (delivery, inline handling) in `receive.rs`, the handler threads
//! (decode and dispatch) in `handlers.rs`.

pub mod breakdown;
pub mod connection;
mod connections;
pub mod direct_write;
pub mod discovery;
mod engine_api;
pub mod events;
pub mod flow;
mod handlers;
pub mod incoming;
pub mod inline;
pub mod membership;
pub mod metrics;
pub(crate) mod pull;
mod receive;
pub mod regions;
pub mod requests;
pub(crate) mod send;
#[cfg(test)]
mod tests;
pub mod zero_copy;

use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, Sender};
use parking_lot::Mutex;

use crate::config::{Config, ParkConfig, TransportKind};
use crate::error::{Cancelled, Unreachable, Waited};
use crate::message::{type_key, MessageHeader, MessageKind, HEADER_LEN};
use crate::node::NodeStats;
use crate::transport::{Transport, STANDALONE_FRAME_MAX};
use crate::{Error, Message, NodeId, Request, Result};

use crate::primitives::deadline::Deadline;
use crate::primitives::orb::OrbError;
use crate::primitives::park::{self, Idle, Signal};
use crate::primitives::pool::{BufferPool, RecvBuffer};
use crate::primitives::stats::Stats;
use crate::primitives::write_interest::WriteInterest;
use crate::proto::decoder::{Decoder, Piece};
use crate::proto::{codec, identity, wire};
use connection::{ConnState, Connection, ConnectionTable, Incoming, Owned};
use flow::{FlowControl, FlowWaitError};
use incoming::IncomingQueue;
use requests::{Outcome, PendingResponse, RequestTable};

/// Error codes carried by error responses ([`MessageKind::ErrorResponse`]).
const REMOTE_UNKNOWN_TYPE: u8 = 1;
const REMOTE_DECODE: u8 = 2;
const REMOTE_PANIC: u8 = 3;

/// Buffers a handler thread processes from one connection before it moves
/// on to the next (fairness between connections).
const HANDLER_BUDGET: usize = 16;
/// Payload buffers of parallel jobs kept for reuse, and the largest kept.
const PARALLEL_SPARE: usize = 256;
const PARALLEL_SPARE_MAX_BYTES: usize = 256 << 10;
/// Nesting depth of handlers sending to their own node that cannot queue
/// behind one another (see `Core::locals`).
const LOCAL_DEPTHS: usize = 4;

type MessageFn = Box<dyn Fn(NodeId, &[u8]) -> Result<()> + Send + Sync>;
type RequestFn = Box<dyn Fn(&Core, NodeId, u32, &[u8]) + Send + Sync>;
type HeldFn = Box<dyn Fn(NodeId, crate::HeldMessage) + Send + Sync>;

/// A pooled receive buffer whose messages' payloads are lent to held
/// receivers (see [`crate::HeldMessage`]): back to the pool once the
/// handler and every message lent from it let go.
pub(crate) struct SharedRecv {
    buf: Option<RecvBuffer>,
    core: std::sync::Weak<Core>,
    /// A payload was lent from it: it counts in `Core::lent_buffers`.
    lent: AtomicBool,
}

impl SharedRecv {
    fn new(buf: RecvBuffer, core: std::sync::Weak<Core>) -> Self {
        Self {
            buf: Some(buf),
            core,
            lent: AtomicBool::new(false),
        }
    }

    /// Whether a payload may be lent from this buffer: yes if one already
    /// was, else if fewer than `max` buffers are lent (this one then
    /// counts in `lent_buffers` until it goes back to the pool).
    fn may_lend(&self, lent_buffers: &AtomicUsize, max: usize) -> bool {
        if self.lent.load(Ordering::Relaxed) {
            return true;
        }
        let counted = lent_buffers
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok();
        if counted {
            self.lent.store(true, Ordering::Relaxed);
        }
        counted
    }

    fn buffer(&self) -> &RecvBuffer {
        self.buf.as_ref().expect("taken only on drop")
    }

    /// The whole buffer (offsets as in [`RecvBuffer::bytes`]).
    pub(crate) fn bytes(&self) -> &[u8] {
        self.buffer().bytes()
    }
}

impl Drop for SharedRecv {
    fn drop(&mut self) {
        if let (Some(b), Some(core)) = (self.buf.take(), self.core.upgrade()) {
            if *self.lent.get_mut() {
                core.lent_buffers.fetch_sub(1, Ordering::AcqRel);
            }
            core.give_back(b);
        }
    }
}

enum HandlerKind {
    /// Typed or raw message: decodes and calls the receiver.
    Message(MessageFn),
    /// Request: decodes, calls the handler, sends the response.
    Request(RequestFn),
    /// One of dxnet's own plain messages (type 0), handled by the runtime.
    Own(fn(&Core, NodeId, &[u8])),
    /// A type taken through a pull receiver (`crate::pull`).
    Pull(Arc<pull::PullSlot>),
    /// Raw message whose receiver keeps the message (payload and
    /// flow-control window) until it drops the [`crate::HeldMessage`] it
    /// gets.
    Held(HeldFn),
}

struct HandlerEntry {
    kind: HandlerKind,
    mode: Mode,
}

/// Which threads run a type's handler, and in what order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// The handler thread that holds the connection, in the connection's
    /// order.
    Ordered,
    /// The node's exclusive thread, all connections in one order.
    Exclusive,
    /// Any handler thread, several of one connection's messages at once
    /// (see [`ParallelJob`]).
    Parallel,
}

/// A message of a [`Mode::Parallel`] type taken out of its connection's
/// order: any handler thread runs it; its bytes count as processed for
/// flow control when its handler returns.
struct ParallelJob {
    conn: Arc<Connection>,
    header: MessageHeader,
    payload: Vec<u8>,
    /// Its buffer's arrival (latency breakdown; 0: not stamped).
    arrived: u64,
}

/// A message for the exclusive handler thread.
struct ExclusiveItem {
    src: NodeId,
    key: u16,
    payload: Vec<u8>,
}

/// A message decoded from a buffer, waiting for its handler: where its
/// payload is (inside the buffer, or copied when it was reassembled).
struct PendingMessage {
    header: MessageHeader,
    at: PayloadAt,
}

enum PayloadAt {
    In(std::ops::Range<usize>),
    Owned(Vec<u8>),
}

thread_local! {
    /// Reused lists of [`PendingMessage`] (a stack: handling may nest when a
    /// handler's blocking wait decodes ahead), so decoding allocates nothing
    /// once warm.
    static SCRATCH: std::cell::RefCell<Vec<Vec<PendingMessage>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

fn take_scratch() -> Vec<PendingMessage> {
    SCRATCH
        .try_with(|s| s.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default()
}

fn put_scratch(mut v: Vec<PendingMessage>) {
    v.clear();
    if v.capacity() <= 4096 {
        let _ = SCRATCH.try_with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < 8 {
                s.push(v);
            }
        });
    }
}

/// A received buffer a receive thread handles itself (see
/// [`Core::deliver_or_inline`]); its connection is taken until
/// [`Core::run_inline`] returns.
#[derive(Debug)]
pub struct InlineWork {
    conn: Owned,
    buf: RecvBuffer,
}

/// The shared state of one node.
pub struct Core {
    /// Itself, for what outlives a call (a held window's release).
    me: std::sync::Weak<Core>,
    config: Config,
    own: NodeId,
    /// Random id of this node's lifetime (detects restarts).
    pub instance: u64,
    /// Own flow-control window (bytes accepted unprocessed per connection).
    pub fc_window: u64,
    /// Own flow-control unit.
    pub fc_unit: u64,
    /// Open connections.
    pub connections: ConnectionTable,
    /// Per-stage latency of requests (`metrics.breakdown`).
    breakdown: Option<Arc<breakdown::Breakdown>>,
    /// The node map as it is now.
    membership: membership::Membership,
    /// The discovery job's state, with discovery configured.
    discovery: Option<Box<discovery::Discovery>>,
    /// Connections with data or confirmations to send.
    wim: WriteInterest,
    /// Receive buffers.
    pool: BufferPool,
    /// Received buffers waiting for handler threads.
    incoming: IncomingQueue,
    /// Messages of parallel types waiting for any handler thread.
    parallel: crossbeam::queue::SegQueue<ParallelJob>,
    /// Set once a parallel type is registered.
    any_parallel: AtomicBool,
    /// A held receiver is registered: pooled buffers are shared so their
    /// payloads can be lent (see [`SharedRecv`]).
    any_held: AtomicBool,
    /// Receive buffers out of the pool for payloads lent to held
    /// receivers: at most half of the pool.
    lent_buffers: AtomicUsize,
    /// When held payloads are lent rather than copied.
    lend: handlers::LendPolicy,
    /// Emptied payload buffers of parallel jobs, for the next ones.
    parallel_spare: crossbeam::queue::ArrayQueue<Vec<u8>>,
    /// Pending requests.
    pub requests: Arc<RequestTable>,
    /// Exposed memory regions.
    regions: regions::RegionTable,
    /// Zero-copy from reused buffers: the policy and registration cache.
    zero_copy: zero_copy::ZeroCopy,
    /// Connection events for the application.
    events: events::Events,
    /// Counters.
    pub stats: Stats,
    /// Closes and errors of earlier connections, per peer.
    peer_history: Mutex<metrics::PeerHistory>,
    /// This node's identity key and the node map's public keys, if
    /// configured (signed connection set-up).
    pub identity: Option<identity::Identity>,
    /// One bit per (type, subtype): an unknown type was already logged at
    /// warn level (later ones only at debug, so a flood cannot flood the
    /// log; `stats().unknown_messages` counts them all).
    unknown_logged: Box<[AtomicU64]>,
    handlers: Box<[OnceLock<HandlerEntry>]>,
    transport: OnceLock<Arc<dyn Transport>>,
    shutdown: AtomicBool,
    /// Set at shutdown: until when the engine may still write out and
    /// close gracefully (`limits.shutdown_linger_ms` from then).
    linger_until: OnceLock<Instant>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Channel to the exclusive handler thread; taken at shutdown, which
    /// ends that thread. A read lock per message (no `Sender` clone).
    exclusive_tx: parking_lot::RwLock<Option<Sender<ExclusiveItem>>>,
    /// Pseudo-connections of messages to the own node, by nesting depth: a
    /// handler of a local message that sends to its own node again (e.g. a
    /// nested request to itself) uses the next one, so the nested message is
    /// not queued behind the blocked handler.
    locals: Vec<Arc<Connection>>,
    local_room: Signal,
    started: Instant,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("own", &self.own)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

impl Core {
    /// Validates the configuration, builds the core, starts the handler
    /// threads and the engine `start_engine` returns (the caller picks
    /// it: the runtime knows engines only through [`Transport`]).
    pub fn start_with(
        config: Config,
        start_engine: impl FnOnce(&Arc<Core>) -> Result<Arc<dyn Transport>>,
    ) -> Result<Arc<Core>> {
        config.validate()?;
        // Blocking waits in the primitives hand inline work over first.
        crate::primitives::set_blocking_hook(inline::before_blocking);
        if config.cluster_secret.is_none() && config.transport != TransportKind::Loopback {
            tracing::warn!(
                "node {}: no cluster_secret configured: any process that can reach this node can join the cluster",
                config.node_id
            );
        }
        let own = NodeId(config.node_id);
        let fc_window = config.limits.flow_control_window as u64;
        let fc_unit = FlowControl::unit_for(fc_window, config.limits.flow_control_threshold);
        let locals: Vec<Arc<Connection>> = (0..LOCAL_DEPTHS)
            .map(|_| {
                let local = Connection::new(
                    own,
                    0,
                    (4096, 1),
                    FlowControl::new(fc_window, fc_unit),
                    config.limits.max_message_size,
                    None,
                );
                local.mark_open(0);
                local
            })
            .collect();
        let (ex_tx, ex_rx) = crossbeam::channel::bounded(1024);
        let identity = config.identity()?;
        let breakdown = config
            .metrics
            .breakdown
            .then(|| Arc::new(breakdown::Breakdown::new()));
        let core = Arc::new_cyclic(|me| Core {
            me: me.clone(),
            own,
            identity,
            instance: loop {
                let v: u64 = rand::random();
                if v != 0 {
                    break v;
                }
            },
            fc_window,
            fc_unit,
            connections: ConnectionTable::default(),
            breakdown: breakdown.clone(),
            membership: membership::Membership::from_config(&config),
            discovery: discovery::Discovery::new(&config).map(Box::new),
            wim: WriteInterest::new(),
            pool: BufferPool::new(config.recv_pool_size(), config.recv_buffer_size()),
            incoming: IncomingQueue::new(
                config.limits.incoming_max_buffers,
                config.limits.incoming_max_bytes,
            ),
            parallel: crossbeam::queue::SegQueue::new(),
            any_parallel: AtomicBool::new(false),
            any_held: AtomicBool::new(false),
            lent_buffers: AtomicUsize::new(0),
            lend: handlers::LendPolicy::new(&config),
            parallel_spare: crossbeam::queue::ArrayQueue::new(PARALLEL_SPARE),
            requests: RequestTable::new(breakdown),
            regions: regions::RegionTable::default(),
            zero_copy: zero_copy::ZeroCopy::new(config.zero_copy.clone()),
            events: events::Events::default(),
            stats: {
                let s = Stats::default();
                s.sent.count_per_connection(config.metrics.per_connection);
                s
            },
            peer_history: Mutex::new(metrics::PeerHistory::default()),
            unknown_logged: (0..1024).map(|_| AtomicU64::new(0)).collect(),
            handlers: (0..=u16::MAX as usize).map(|_| OnceLock::new()).collect(),
            transport: OnceLock::new(),
            shutdown: AtomicBool::new(false),
            linger_until: OnceLock::new(),
            threads: Mutex::new(Vec::new()),
            exclusive_tx: parking_lot::RwLock::new(Some(ex_tx)),
            locals,
            local_room: Signal::new(),
            started: Instant::now(),
            config,
        });
        core.install_region_handlers();
        {
            let mut threads = core.threads.lock();
            for i in 0..core.config.handler_threads {
                let c = core.clone();
                threads.push(
                    std::thread::Builder::new()
                        .name(format!("dxnet-handler-{}-{i}", own.0))
                        .spawn(move || c.handler_loop())
                        .map_err(|e| Error::Config(format!("cannot spawn handler thread: {e}")))?,
                );
            }
            let c = core.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("dxnet-exclusive-{}", own.0))
                    .spawn(move || c.exclusive_loop(ex_rx))
                    .map_err(|e| Error::Config(format!("cannot spawn exclusive thread: {e}")))?,
            );
            #[cfg(feature = "metrics")]
            if core.config.metrics.publish_interval_ms > 0 {
                let weak = Arc::downgrade(&core);
                threads.push(
                    std::thread::Builder::new()
                        .name(format!("dxnet-metrics-{}", own.0))
                        .spawn(move || metrics::publish_loop(weak))
                        .map_err(|e| Error::Config(format!("cannot spawn metrics thread: {e}")))?,
                );
            }
        }
        match start_engine(&core) {
            Ok(t) => {
                let _ = core.transport.set(t);
            }
            Err(e) => {
                core.shutdown();
                return Err(e);
            }
        }
        if let Err(e) = core.start_discovery() {
            core.shutdown();
            return Err(e);
        }
        Ok(core)
    }

    /// This node's id.
    pub fn own_id(&self) -> NodeId {
        self.own
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Parking settings.
    pub fn park(&self) -> &ParkConfig {
        &self.config.park
    }

    /// True once shutdown began.
    pub fn is_shut_down(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    fn transport(&self) -> Option<&Arc<dyn Transport>> {
        self.transport.get()
    }

    /// Coarse time for least-recently-used tracking (milliseconds).
    fn tick(&self, now: Instant) -> u64 {
        now.duration_since(self.started).as_millis() as u64
    }

    // ----- registration ----------------------------------------------------

    fn register(&self, t: u8, s: u8, entry: HandlerEntry) -> Result<()> {
        if t == 0 {
            return Err(Error::Config("message type 0 is reserved for dxnet".into()));
        }
        let parallel = entry.mode == Mode::Parallel;
        let held = matches!(entry.kind, HandlerKind::Held(_));
        self.handlers[type_key(t, s) as usize]
            .set(entry)
            .map_err(|_| Error::AlreadyRegistered(t, s))?;
        if parallel {
            self.any_parallel.store(true, Ordering::Relaxed);
        }
        if held {
            self.any_held.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Registers a typed receiver.
    pub fn register_message<M, F>(&self, f: F, mode: Mode) -> Result<()>
    where
        M: Message,
        F: Fn(NodeId, M) + Send + Sync + 'static,
    {
        let kind = HandlerKind::Message(Box::new(move |src, bytes| {
            let m = codec::decode::<M>(bytes)?;
            f(src, m);
            Ok(())
        }));
        self.register(M::TYPE, M::SUBTYPE, HandlerEntry { kind, mode })
    }

    /// Registers a raw receiver.
    pub fn register_raw<F>(&self, t: u8, s: u8, f: F, mode: Mode) -> Result<()>
    where
        F: Fn(NodeId, &[u8]) + Send + Sync + 'static,
    {
        let kind = HandlerKind::Message(Box::new(move |src, bytes| {
            f(src, bytes);
            Ok(())
        }));
        self.register(t, s, HandlerEntry { kind, mode })
    }

    /// Registers a raw receiver that keeps each message (payload and
    /// flow-control window) until it drops the [`crate::HeldMessage`].
    pub fn register_raw_held<F>(&self, t: u8, s: u8, f: F) -> Result<()>
    where
        F: Fn(NodeId, crate::HeldMessage) + Send + Sync + 'static,
    {
        let kind = HandlerKind::Held(Box::new(f));
        self.register(
            t,
            s,
            HandlerEntry {
                kind,
                mode: Mode::Ordered,
            },
        )
    }

    /// Registers a request handler; its result is sent back as the response.
    pub fn register_request<R, F>(&self, f: F, mode: Mode) -> Result<()>
    where
        R: Request,
        F: Fn(NodeId, R) -> R::Response + Send + Sync + 'static,
    {
        let kind = HandlerKind::Request(Box::new(move |core, src, id, bytes| {
            let req = match codec::decode::<R>(bytes) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("request from {src} could not be decoded: {e}");
                    core.send_error_response(src, id, REMOTE_DECODE, R::TYPE, R::SUBTYPE);
                    return;
                }
            };
            let resp = match std::panic::catch_unwind(AssertUnwindSafe(|| f(src, req))) {
                Ok(r) => r,
                Err(_) => {
                    tracing::error!("request handler for ({}, {}) panicked", R::TYPE, R::SUBTYPE);
                    core.send_error_response(src, id, REMOTE_PANIC, R::TYPE, R::SUBTYPE);
                    return;
                }
            };
            if let Err(e) = core.send_response(src, id, &resp) {
                tracing::debug!("response to {src} not sent: {e}");
            }
        }));
        self.register(R::TYPE, R::SUBTYPE, HandlerEntry { kind, mode })
    }

    // ----- lifecycle -----------------------------------------------------------

    /// The per-stage latency histograms, if kept.
    pub fn latency_breakdown(&self) -> Option<crate::breakdown::LatencyBreakdown> {
        self.breakdown.as_ref().map(|b| b.snapshot())
    }

    /// Counters.
    pub fn stats(&self) -> NodeStats {
        let s = &self.stats;
        let (peak_buffers, peak_bytes) = self.incoming.peaks();
        let z = &self.zero_copy.stats;
        NodeStats {
            msgs_sent: s.sent.messages(),
            msgs_received: s.received.messages(),
            bytes_sent: s.sent.bytes(),
            bytes_received: s.received.bytes(),
            connections_opened: s.connections_opened.get(),
            connections_closed: s.connections_closed.get(),
            unknown_messages: s.unknown_messages.get(),
            inline_buffers: s.inline_buffers.get(),
            incoming_peak_buffers: peak_buffers as u64,
            incoming_peak_bytes: peak_bytes as u64,
            events_dropped: self.events.dropped.load(Ordering::Relaxed),
            discovery_ignored: self
                .discovery
                .as_ref()
                .map_or(0, |d| d.ignored.load(Ordering::Relaxed)),
            discovery_conflicts: self
                .discovery
                .as_ref()
                .map_or(0, |d| d.conflicts.load(Ordering::Relaxed)),
            zero_copy_in_place: z.in_place.load(Ordering::Relaxed),
            zero_copy_copied: z.copied.load(Ordering::Relaxed),
            buffer_registrations: z.registrations.load(Ordering::Relaxed),
            buffer_registration_failures: z.registration_failures.load(Ordering::Relaxed),
            buffer_evictions: z.evictions.load(Ordering::Relaxed),
            pinned_bytes: z.pinned_bytes.load(Ordering::Relaxed),
            speculation_stops: z.speculation_stops.load(Ordering::Relaxed),
            buffer_sends_lent: z.lent.load(Ordering::Relaxed),
        }
    }

    /// Stops everything: pending requests fail with `Shutdown`, connections
    /// close, threads are joined. Idempotent.
    pub fn shutdown(&self) {
        if self.shutdown.swap(true, Ordering::AcqRel) {
            return;
        }
        self.requests.close();
        // Before the engine stops: a receive or handler thread waiting for
        // room in a full pull receiver must return to be joined.
        self.close_pull_receivers();
        let linger = Duration::from_millis(self.config.limits.shutdown_linger_ms);
        self.linger(*self.linger_until.get_or_init(|| Instant::now() + linger));
        if let Some(t) = self.transport() {
            t.shutdown();
        }
        // Buffers the application keeps stop pinning memory (accesses in
        // flight hold their own registration until they end).
        self.zero_copy.clear();
        for c in self.connections.all() {
            self.close_connection(&c, "node shut down", false);
        }
        self.exclusive_tx.write().take();
        self.stop_events();
        self.incoming.handlers.notify_all();
        self.local_room.notify_all();
        let me = std::thread::current().id();
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}

impl Core {
    /// Gives the engine until `end` to write out what was sent before
    /// shutdown (sends fail with [`Error::Shutdown`] from now on, so the
    /// rings only drain): a message `send` accepted is not dropped just
    /// because the node stops right after.
    fn linger(&self, end: Instant) {
        let transport = self.transport();
        let unsent = || {
            self.connections.all().iter().any(|c| {
                c.state() == ConnState::Open
                    && (c.rings().any(|r| !r.is_empty())
                        || transport.as_ref().is_some_and(|t| t.holds_unsent(c)))
            })
        };
        while unsent() && Instant::now() < end {
            if let Some(t) = &transport {
                t.wake_sender();
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The whole message starting at `pos` of `seg`: its header and where it
/// ends; `None` if the header is invalid or the message does not end
/// within `seg`.
fn message_at(seg: &[u8], pos: usize, max_payload: usize) -> Option<(MessageHeader, usize)> {
    let header: &[u8; HEADER_LEN] = seg.get(pos..pos + HEADER_LEN)?.try_into().ok()?;
    let h = MessageHeader::decode(header, max_payload).ok()?;
    let end = pos + HEADER_LEN + h.payload_len as usize;
    (end <= seg.len()).then_some((h, end))
}

fn run_receiver(own: NodeId, f: &MessageFn, src: NodeId, key: u16, payload: &[u8]) {
    match std::panic::catch_unwind(AssertUnwindSafe(|| f(src, payload))) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(
            "{own}: message ({}, {}) from {src} dropped: {e}",
            key >> 8,
            key & 0xff
        ),
        Err(_) => tracing::error!(
            "{own}: receiver for ({}, {}) panicked",
            key >> 8,
            key & 0xff
        ),
    }
}

fn remote_error(h: &MessageHeader, payload: &[u8]) -> Error {
    match payload.first() {
        Some(&REMOTE_UNKNOWN_TYPE) => Error::UnknownMessageType(h.msg_type, h.subtype),
        Some(&REMOTE_DECODE) => {
            Error::Decode("the remote node could not decode the request".into())
        }
        Some(&REMOTE_PANIC) => Error::Cancelled(Cancelled::RemoteHandlerPanicked),
        _ => Error::Decode("malformed error response".into()),
    }
}
