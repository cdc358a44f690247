//! The public face of a dxnet node: send, request, register receivers.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::core::{Core, Mode};
use crate::{Config, Error, Message, NodeId, Request, Result};

/// A running dxnet node. Cheap to share between threads (`&Node` is enough to
/// send); dropping it (or [`Node::shutdown`]) stops every thread it started.
pub struct Node {
    core: Arc<Core>,
}

/// Counters of one node since start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct NodeStats {
    /// Messages handed to `send`/`request`/responses.
    pub msgs_sent: u64,
    /// Messages dispatched to receivers (including responses).
    pub msgs_received: u64,
    /// Payload+header bytes serialized into ring buffers.
    pub bytes_sent: u64,
    /// Payload+header bytes decoded by handler threads.
    pub bytes_received: u64,
    /// Connections opened (outgoing and incoming).
    pub connections_opened: u64,
    /// Connections closed or broken after they opened (a connect that
    /// failed is not counted).
    pub connections_closed: u64,
    /// Messages dropped because no receiver was registered for their type.
    pub unknown_messages: u64,
    /// Received buffers handled on the receive thread itself because every
    /// handler thread was parked (`inline_receive_bytes`).
    pub inline_buffers: u64,
    /// Most received buffers queued for the handler threads at once (all
    /// connections); bounded by `incoming_max_buffers` (plus, on
    /// InfiniBand, the receives posted on the shared receive queue).
    pub incoming_peak_buffers: u64,
    /// Most received bytes queued for the handler threads at once.
    pub incoming_peak_bytes: u64,
    /// Connection events dropped because slow callbacks let their queue
    /// fill up (see [`crate::events`]).
    pub events_dropped: u64,
    /// Discovery datagrams not accepted: malformed, not authenticated
    /// (another cluster secret, no valid identity signature), answers to
    /// no probe of this node, probes of removed nodes.
    pub discovery_ignored: u64,
    /// Claims of one node id by two nodes that discovery saw.
    pub discovery_conflicts: u64,
    /// Accesses from or into a [`crate::Buffer`] of at least
    /// `zero_copy.min_bytes` that went in place (the device reads or
    /// fills the registered buffer).
    pub zero_copy_in_place: u64,
    /// Such accesses that were copied (the buffer not registered, or the
    /// engine without registered memory).
    pub zero_copy_copied: u64,
    /// Buffers registered with the device by the zero-copy policy or
    /// [`Node::register_buffer`].
    pub buffer_registrations: u64,
    /// Registrations that failed (over `zero_copy.max_pinned_bytes`, or
    /// refused by the device); those accesses were copied.
    pub buffer_registration_failures: u64,
    /// Registrations dropped to make room under `max_pinned_bytes`.
    pub buffer_evictions: u64,
    /// Bytes of buffers registered now.
    pub pinned_bytes: u64,
    /// Times speculative registration stopped because few buffers went on
    /// to be reused often (see [`crate::config::ZeroCopyConfig`]).
    pub speculation_stops: u64,
    /// Messages from a [`crate::Buffer`] whose payload the engine wrote
    /// to the peer from the buffer itself, with no copy and no
    /// registration (TCP, buffers of at least `tcp.send_in_place_from`
    /// bytes; see [`Node::send_buffer`]).
    pub buffer_sends_lent: u64,
}

/// A message given to a receiver registered with
/// [`Node::register_raw_held`]: its payload (`Deref` to `[u8]`) and its
/// share of the sender's flow-control window, both held until it drops.
///
/// The payload is lent from the receive buffer it arrived in (no copy)
/// when it is at least 4 KiB or a sixteenth of a receive buffer
/// ([`crate::Config::recv_buffer_size`]), whichever is less, and that
/// buffer is lent already or fewer than half of the node's receive buffers
/// ([`crate::Config::recv_pool_size`]) are;
/// otherwise it is a copy (or the reassembled bytes of a message that
/// spanned buffers; over TCP without TLS a message of at most half a
/// receive buffer is kept in one, unless its connection carries mostly
/// messages under 1 KiB). A lent payload keeps its whole receive buffer out of
/// the pool until every message lent from it dropped, so messages held
/// for long take at most half of the receive buffers, and receiving goes
/// on. A message to the own node holds no window.
#[must_use = "dropping it gives the window (and a lent buffer) back at once"]
pub struct HeldMessage {
    bytes: HeldBytes,
    /// Declared after `bytes`: the window goes back once the bytes are
    /// gone.
    _window: HeldWindow,
}

/// Where a [`HeldMessage`]'s payload is.
enum HeldBytes {
    Lent {
        buf: Arc<crate::core::SharedRecv>,
        start: usize,
        len: usize,
    },
    Owned(Vec<u8>),
}

impl HeldMessage {
    pub(crate) fn lent(
        buf: Arc<crate::core::SharedRecv>,
        start: usize,
        len: usize,
        window: HeldWindow,
    ) -> Self {
        debug_assert!(start + len <= buf.bytes().len());
        Self {
            bytes: HeldBytes::Lent { buf, start, len },
            _window: window,
        }
    }

    pub(crate) fn owned(bytes: Vec<u8>, window: HeldWindow) -> Self {
        Self {
            bytes: HeldBytes::Owned(bytes),
            _window: window,
        }
    }

    /// The payload.
    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            HeldBytes::Lent { buf, start, len } => &buf.bytes()[*start..*start + *len],
            HeldBytes::Owned(v) => v,
        }
    }

    /// Whether the payload is lent from a receive buffer (not a copy).
    pub fn is_lent(&self) -> bool {
        matches!(self.bytes, HeldBytes::Lent { .. })
    }

    /// Bytes of the sender's window held (the message with its header; 0
    /// for a message to the own node).
    pub fn window_bytes(&self) -> u64 {
        if self._window.conn.id == 0 {
            0
        } else {
            self._window.bytes()
        }
    }
}

impl std::ops::Deref for HeldMessage {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.bytes()
    }
}

impl std::fmt::Debug for HeldMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldMessage")
            .field("len", &self.bytes().len())
            .field("lent", &self.is_lent())
            .field("window", &self._window)
            .finish()
    }
}

/// One received message's share of its sender's flow-control window: the
/// bytes go back to the sender's window when this drops. A message to the
/// own node holds nothing.
pub(crate) struct HeldWindow {
    core: std::sync::Weak<Core>,
    conn: Arc<crate::core::connection::Connection>,
    bytes: u64,
}

impl HeldWindow {
    pub(crate) fn new(
        core: std::sync::Weak<Core>,
        conn: &Arc<crate::core::connection::Connection>,
        bytes: u64,
    ) -> Self {
        Self {
            core,
            conn: conn.clone(),
            bytes,
        }
    }

    /// Bytes of the window held (the message with its header).
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl std::fmt::Debug for HeldWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldWindow")
            .field("peer", &self.conn.peer)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Drop for HeldWindow {
    fn drop(&mut self) {
        if let Some(core) = self.core.upgrade() {
            core.release_held(&self.conn, self.bytes);
        }
    }
}

/// A response that has not arrived yet. Wait for it with
/// [`ResponseHandle::wait`] or `.await` it (runtime-agnostic `Future`).
pub struct ResponseHandle<T> {
    inner: crate::core::requests::PendingResponse,
    core: Arc<Core>,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl Node {
    /// Starts a node: validates `config`, starts the transport, handler
    /// threads and (for TCP) the listener.
    pub fn start(config: Config) -> Result<Node> {
        let core = Core::start_with(config, crate::transport::start)?;
        Ok(Node { core })
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.core.own_id()
    }

    /// The configuration the node started with (its `nodes` is the node map
    /// at start; [`Node::nodes`] gives the map now).
    pub fn config(&self) -> &Config {
        self.core.config()
    }

    /// Registers a receiver for message type `M`; it runs on the
    /// message-handler threads (messages of one connection in order).
    pub fn register<M, F>(&self, f: F) -> Result<()>
    where
        M: Message,
        F: Fn(NodeId, M) + Send + Sync + 'static,
    {
        self.core.register_message::<M, F>(f, Mode::Ordered)
    }

    /// Registers a receiver for `M` that processes every message of this type,
    /// from all connections, serially on one dedicated thread.
    pub fn register_exclusive<M, F>(&self, f: F) -> Result<()>
    where
        M: Message,
        F: Fn(NodeId, M) + Send + Sync + 'static,
    {
        self.core.register_message::<M, F>(f, Mode::Exclusive)
    }

    /// Registers a receiver for `M` whose messages may be handled by
    /// several handler threads at once, also those of one connection:
    /// one handler thread decodes the connection's stream and hands each
    /// message of this type to whichever handler thread is free. So a slow
    /// receiver uses every handler thread, even with a single sender; in
    /// exchange messages of `M` have no order (not even those of one
    /// sender thread), and none with the connection's other messages. A
    /// message's bytes count as processed for flow control when its
    /// receiver returns, so a sender cannot run ahead of the handlers.
    pub fn register_parallel<M, F>(&self, f: F) -> Result<()>
    where
        M: Message,
        F: Fn(NodeId, M) + Send + Sync + 'static,
    {
        self.core.register_message::<M, F>(f, Mode::Parallel)
    }

    /// Registers a receiver for raw payloads of (`msg_type`, `subtype`): no
    /// serde on either side (see [`Node::send_raw`]).
    pub fn register_raw<F>(&self, msg_type: u8, subtype: u8, f: F) -> Result<()>
    where
        F: Fn(NodeId, &[u8]) + Send + Sync + 'static,
    {
        self.core.register_raw(msg_type, subtype, f, Mode::Ordered)
    }

    /// [`Node::register_raw`] whose receiver keeps each message, its
    /// payload and its share of the sender's flow-control window, until it
    /// drops the [`HeldMessage`] (not when it returns). A receiver that
    /// puts messages into its own queue thereby bounds that queue by the
    /// senders' windows (`limits.flow_control_window` per connection)
    /// without ever blocking a handler thread: a sender whose window is
    /// held blocks (or times out) until the consumer takes its messages.
    /// Large payloads are lent from the receive buffer, not copied (see
    /// [`HeldMessage`]). Messages come in connection order on the
    /// connection's handler thread, as with `register_raw`.
    pub fn register_raw_held<F>(&self, msg_type: u8, subtype: u8, f: F) -> Result<()>
    where
        F: Fn(NodeId, HeldMessage) + Send + Sync + 'static,
    {
        self.core.register_raw_held(msg_type, subtype, f)
    }

    /// [`Node::register_raw`] whose receiver runs on several handler
    /// threads at once, without order (see [`Node::register_parallel`]).
    pub fn register_raw_parallel<F>(&self, msg_type: u8, subtype: u8, f: F) -> Result<()>
    where
        F: Fn(NodeId, &[u8]) + Send + Sync + 'static,
    {
        self.core.register_raw(msg_type, subtype, f, Mode::Parallel)
    }

    /// Registers the handler of request type `R`; its return value is sent
    /// back as the response bound to the request.
    pub fn register_request<R, F>(&self, f: F) -> Result<()>
    where
        R: Request,
        F: Fn(NodeId, R) -> R::Response + Send + Sync + 'static,
    {
        self.core.register_request::<R, F>(f, Mode::Ordered)
    }

    /// Registers the handler of request type `R` to run on several handler
    /// threads at once, also for requests of one connection (see
    /// [`Node::register_parallel`]): requests of `R` are answered in any
    /// order, each response still bound to its request.
    pub fn register_request_parallel<R, F>(&self, f: F) -> Result<()>
    where
        R: Request,
        F: Fn(NodeId, R) -> R::Response + Send + Sync + 'static,
    {
        self.core.register_request::<R, F>(f, Mode::Parallel)
    }

    /// A receiver to take messages of type `M` from when the application
    /// wants them (blocking, with a timeout, as an iterator or an async
    /// `Stream`), holding up to `capacity` of them; a full receiver slows
    /// the senders down through flow control. Dropping it unregisters the
    /// type. See [`crate::pull`].
    pub fn receiver<M: Message>(&self, capacity: usize) -> Result<crate::PullReceiver<M>> {
        self.core.register_pull::<M>(capacity)
    }

    /// Sends `msg` to `dest`. Returns once the message is serialized into the
    /// connection's ring buffer; blocks only under back-pressure and then
    /// fails with [`crate::Error::Timeout`] after `send_timeout_ms`.
    pub fn send<M: Message>(&self, dest: NodeId, msg: &M) -> Result<()> {
        self.core.send_message(dest, msg)
    }

    /// Sends `msg` to every node of `dests`, each once (a node listed twice
    /// gets it once). The message is serialized once and its bytes copied
    /// into each destination's ring buffer; per destination it behaves as
    /// [`Node::send`]: in order with this thread's other sends to that
    /// node, exactly once on a live connection, blocking only under that
    /// destination's back-pressure. One destination failing (unreachable,
    /// timed out) does not keep the others from getting it; the result says
    /// per destination what happened.
    pub fn send_to_many<M: Message>(&self, dests: &[NodeId], msg: &M) -> MultiSend {
        MultiSend(self.core.send_message_many(dests, msg))
    }

    /// Adds a node to the node map at run time (or gives a listed node a
    /// new address, closing its connection to the old one, or brings back
    /// a removed node). With identities configured the entry needs its
    /// `public_key`. The node is connected on first use as any other; with
    /// discovery, once it answered a probe.
    pub fn add_node(&self, entry: crate::config::NodeEntry) -> Result<()> {
        self.core.add_node(entry)
    }

    /// Adds a seed address to discovery: it is probed (every
    /// `discovery.interval_ms`) until a node answers there, which then
    /// joins the node map. Needs [`crate::Config::discovery`].
    pub fn add_seed(&self, address: &str) -> Result<()> {
        self.core.add_seed(address)
    }

    /// Removes a node from the node map: its connection closes, its pending
    /// requests fail with [`crate::Unreachable::Removed`], and so do later
    /// sends and requests to it; its connection attempts are refused until
    /// it is added again. With discovery it is no longer probed and its
    /// probes are ignored (counted in `discovery_ignored`).
    pub fn remove_node(&self, node: NodeId) -> Result<()> {
        self.core.remove_node(node)
    }

    /// The nodes of the node map now (this one included), in id order;
    /// with discovery, the discovered ones.
    pub fn nodes(&self) -> Vec<NodeId> {
        self.core.member_nodes()
    }

    /// Waits until [`Node::nodes`] lists at least `count` nodes (this one
    /// included) and returns them, or fails with
    /// [`crate::Error::Timeout`]`(`[`crate::Waited::Nodes`]`)` after
    /// `timeout`. With discovery this is how an application waits for its
    /// cluster to come up.
    pub fn wait_for_nodes(&self, count: usize, timeout: Duration) -> Result<Vec<NodeId>> {
        self.core.wait_for_nodes(count, timeout)
    }

    /// [`Node::send_to_many`] to every other node of the node map (with
    /// discovery, every discovered one).
    pub fn send_to_all<M: Message>(&self, msg: &M) -> MultiSend {
        let own = self.id();
        let dests: Vec<NodeId> = self
            .core
            .member_nodes()
            .into_iter()
            .filter(|n| *n != own)
            .collect();
        self.send_to_many(&dests, msg)
    }

    /// Sends raw bytes as a message of (`msg_type`, `subtype`), copied
    /// straight into the ring buffer without serde.
    pub fn send_raw(&self, dest: NodeId, msg_type: u8, subtype: u8, payload: &[u8]) -> Result<()> {
        self.core.send_raw(dest, msg_type, subtype, payload)
    }

    /// Sends request `req` and blocks until its response arrives or `timeout`
    /// passes.
    pub fn request<R: Request>(
        &self,
        dest: NodeId,
        req: &R,
        timeout: Duration,
    ) -> Result<R::Response> {
        let pending = self.core.send_request(dest, req, timeout, true)?;
        decode_response(self.core.wait_response(pending)?)
    }

    /// Sends request `req` and returns a handle to wait for the response
    /// later; the handle is also a `Future`.
    pub fn request_async<R: Request>(
        &self,
        dest: NodeId,
        req: &R,
        timeout: Duration,
    ) -> Result<ResponseHandle<R::Response>> {
        let inner = self.core.send_request(dest, req, timeout, false)?;
        Ok(ResponseHandle {
            inner,
            core: self.core.clone(),
            _t: std::marker::PhantomData,
        })
    }

    /// Calls `f` with every connection event from now on (on the node's
    /// events thread; see [`crate::events`]). Several may be registered.
    pub fn on_connection_event<F>(&self, f: F) -> Result<()>
    where
        F: Fn(crate::events::ConnectionEvent) + Send + Sync + 'static,
    {
        self.core.on_connection_event(Box::new(f))
    }

    /// Subscribes to connection events from now on through a channel of
    /// `capacity` events (a full one drops events for itself alone; see
    /// [`crate::events`]).
    pub fn connection_events(&self, capacity: usize) -> Result<crate::events::ConnectionEvents> {
        self.core.connection_events(capacity)
    }

    pub(crate) fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// Counters since start.
    pub fn stats(&self) -> NodeStats {
        self.core.stats()
    }

    /// Every connection's statistics (ring fill, flow-control stalls and
    /// time blocked, queued received data, closes and errors of earlier
    /// connections to the peer; messages and bytes each way with
    /// `metrics.per_connection`), sorted by peer. Peers without a
    /// connection now but with earlier ones are listed as `closed`.
    pub fn connection_stats(&self) -> Vec<crate::ConnectionStats> {
        self.core.connection_stats()
    }

    /// Per-stage latency histograms of the requests this node sent and
    /// served since it started (see [`crate::breakdown`]); `None` unless
    /// `metrics.breakdown` is on. Subtract an earlier reading
    /// ([`LatencyBreakdown::since`](crate::breakdown::LatencyBreakdown::since))
    /// for a phase of its own.
    pub fn latency_breakdown(&self) -> Option<crate::breakdown::LatencyBreakdown> {
        self.core.latency_breakdown()
    }

    /// Publishes [`Node::stats`] and [`Node::connection_stats`] through
    /// the `metrics` façade to the recorder the application installed
    /// (e.g. `metrics-exporter-prometheus`): counters as absolute values
    /// (`dxnet_messages_sent`, `dxnet_connection_bytes_sent`, ...), fills as
    /// gauges, labelled `node` and `peer`. `metrics.publish_interval_ms`
    /// does this from a thread of the node.
    #[cfg(feature = "metrics")]
    pub fn publish_metrics(&self) {
        self.core.publish_metrics()
    }

    /// Stops the node: pending requests (and later sends) fail with
    /// [`crate::Error::Shutdown`]; messages already sent are written out
    /// first (for at most `limits.shutdown_linger_ms`); connections are
    /// closed and threads joined. Dropping the node does the same.
    pub fn shutdown(self) {
        drop(self)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.core.shutdown();
    }
}

impl<T: Message> ResponseHandle<T> {
    /// Blocks until the response arrives, the request times out, or its
    /// connection fails.
    pub fn wait(self) -> Result<T> {
        decode_response(self.core.wait_response(self.inner)?)
    }

    /// The response if it has arrived, without blocking.
    pub fn try_take(&mut self) -> Option<Result<T>> {
        self.inner.try_take().map(|r| r.and_then(decode_response))
    }
}

impl<T: Message> Future for ResponseHandle<T> {
    type Output = Result<T>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match this.inner.poll_take(cx) {
            Poll::Ready(r) => Poll::Ready(r.and_then(decode_response)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Decodes a response payload and hands its buffer back for the thread's
/// next request (see `core::requests::recycle_payload`).
fn decode_response<T: Message>(bytes: Vec<u8>) -> Result<T> {
    let resp = crate::proto::codec::decode::<T>(&bytes).map_err(Error::from);
    crate::core::requests::recycle_payload(bytes);
    resp
}

/// What [`Node::send_to_many`] did, per destination (in the order of their
/// first appearance in the list).
#[derive(Debug)]
pub struct MultiSend(Vec<(NodeId, Result<()>)>);

impl MultiSend {
    /// True if every destination got the message.
    pub fn is_ok(&self) -> bool {
        self.0.iter().all(|(_, r)| r.is_ok())
    }

    /// The destinations that did not get it, with why.
    pub fn failed(&self) -> impl Iterator<Item = (NodeId, &crate::Error)> {
        self.0
            .iter()
            .filter_map(|(n, r)| r.as_ref().err().map(|e| (*n, e)))
    }

    /// Every destination with its outcome.
    pub fn results(&self) -> &[(NodeId, Result<()>)] {
        &self.0
    }

    /// The first failure, if any, as a `Result` (for `?`).
    pub fn into_result(self) -> Result<()> {
        match self.0.into_iter().find_map(|(_, r)| r.err()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
