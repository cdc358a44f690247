//! The transport-independent core: everything between the public API and a
//! transport engine, testable without sockets.
//!
//! - [`incoming`]: the bounded incoming queue feeding the handler threads
//!   (receive buffers come from [`crate::primitives::pool`]).
//! - [`flow`]: window-based flow control.
//! - [`requests`]: pending requests and their responses.
//! - [`connection`]: per-peer state and the connection table.
//! - [`inline`]: handling on receive threads and the receive role.
//!
//! The ring buffer, write-interest queue, buffer pool and parking live in
//! [`crate::primitives`]; codec, reassembly and wire formats in
//! [`crate::proto`].
//!
//! [`Core`] ties them together: the send path (serialize into the ORB), the
//! handler threads (decode and dispatch), the connection manager (open on
//! first use, least-recently-used closing, failure handling) and the hooks a
//! [`Transport`] calls.

pub mod connection;
pub mod flow;
pub mod incoming;
pub mod inline;
pub mod requests;

use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, Sender};
use parking_lot::Mutex;

use crate::config::{Config, ParkConfig, TransportKind};
use crate::message::{
    type_key, MessageHeader, FLAG_ERROR, FLAG_REQUEST, FLAG_RESPONSE, HEADER_LEN,
};
use crate::node::NodeStats;
use crate::transport::{Transport, STANDALONE_FRAME_MAX};
use crate::{Error, Message, NodeId, Request, Result};

use crate::primitives::orb::OrbError;
use crate::primitives::park::{self, Idle, Signal};
use crate::primitives::pool::{BufferPool, RecvBuffer};
use crate::primitives::stats::Stats;
use crate::primitives::write_interest::WriteInterest;
use crate::proto::decoder::Decoder;
use crate::proto::{codec, identity, wire};
use connection::{ConnState, Connection, ConnectionTable, Incoming};
use flow::{FlowControl, FlowWaitError};
use incoming::IncomingQueue;
use requests::{Outcome, PendingResponse, RequestTable};

/// Error codes carried by error responses (`FLAG_ERROR`).
const REMOTE_UNKNOWN_TYPE: u8 = 1;
const REMOTE_DECODE: u8 = 2;
const REMOTE_PANIC: u8 = 3;

/// Buffers a handler thread processes from one connection before it moves
/// on to the next (fairness between connections).
const HANDLER_BUDGET: usize = 16;
/// Nesting depth of handlers sending to their own node that cannot queue
/// behind one another (see `Core::locals`).
const LOCAL_DEPTHS: usize = 4;

type MessageFn = Box<dyn Fn(NodeId, &[u8]) -> Result<()> + Send + Sync>;
type RequestFn = Box<dyn Fn(&Core, NodeId, u32, &[u8]) + Send + Sync>;

enum HandlerKind {
    /// Typed or raw message: decodes and calls the receiver.
    Message(MessageFn),
    /// Request: decodes, calls the handler, sends the response.
    Request(RequestFn),
}

struct HandlerEntry {
    kind: HandlerKind,
    exclusive: bool,
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
    conn: Arc<Connection>,
    buf: RecvBuffer,
}

/// The shared state of one node.
pub struct Core {
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
    /// Connections with data or confirmations to send.
    pub wim: WriteInterest,
    /// Receive buffers.
    pub pool: BufferPool,
    /// Received buffers waiting for handler threads.
    pub incoming: IncomingQueue,
    /// Pending requests.
    pub requests: Arc<RequestTable>,
    /// Counters.
    pub stats: Stats,
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
    /// threads and the transport.
    pub fn start(config: Config) -> Result<Arc<Core>> {
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
        let fc_window = config.flow_control_window as u64;
        let fc_unit = FlowControl::unit_for(fc_window, config.flow_control_threshold);
        let locals: Vec<Arc<Connection>> = (0..LOCAL_DEPTHS)
            .map(|_| {
                let local = Arc::new(Connection::new(
                    own,
                    0,
                    4096,
                    FlowControl::new(fc_window, fc_unit),
                    config.max_message_size,
                ));
                local.mark_open(0);
                local
            })
            .collect();
        let (ex_tx, ex_rx) = crossbeam::channel::bounded(1024);
        let identity = identity::Identity::from_config(&config)?;
        let core = Arc::new(Core {
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
            wim: WriteInterest::new(),
            pool: BufferPool::new(config.recv_pool_size, config.recv_buffer_size),
            incoming: IncomingQueue::new(config.incoming_max_buffers, config.incoming_max_bytes),
            requests: RequestTable::new(),
            stats: Stats::default(),
            unknown_logged: (0..1024).map(|_| AtomicU64::new(0)).collect(),
            handlers: (0..=u16::MAX as usize).map(|_| OnceLock::new()).collect(),
            transport: OnceLock::new(),
            shutdown: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            exclusive_tx: parking_lot::RwLock::new(Some(ex_tx)),
            locals,
            local_room: Signal::new(),
            started: Instant::now(),
            config,
        });
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
        }
        match crate::transport::start(&core) {
            Ok(t) => {
                let _ = core.transport.set(t);
            }
            Err(e) => {
                core.shutdown();
                return Err(e);
            }
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
        self.handlers[type_key(t, s) as usize]
            .set(entry)
            .map_err(|_| Error::AlreadyRegistered(t, s))
    }

    /// Registers a typed receiver.
    pub fn register_message<M, F>(&self, f: F, exclusive: bool) -> Result<()>
    where
        M: Message,
        F: Fn(NodeId, M) + Send + Sync + 'static,
    {
        let kind = HandlerKind::Message(Box::new(move |src, bytes| {
            let m = codec::decode::<M>(bytes)?;
            f(src, m);
            Ok(())
        }));
        self.register(M::TYPE, M::SUBTYPE, HandlerEntry { kind, exclusive })
    }

    /// Registers a raw receiver.
    pub fn register_raw<F>(&self, t: u8, s: u8, f: F) -> Result<()>
    where
        F: Fn(NodeId, &[u8]) + Send + Sync + 'static,
    {
        let kind = HandlerKind::Message(Box::new(move |src, bytes| {
            f(src, bytes);
            Ok(())
        }));
        self.register(
            t,
            s,
            HandlerEntry {
                kind,
                exclusive: false,
            },
        )
    }

    /// Registers a request handler; its result is sent back as the response.
    pub fn register_request<R, F>(&self, f: F) -> Result<()>
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
        self.register(
            R::TYPE,
            R::SUBTYPE,
            HandlerEntry {
                kind,
                exclusive: false,
            },
        )
    }

    // ----- send path ---------------------------------------------------------

    /// Sends a typed message.
    pub fn send_message<M: Message>(&self, dest: NodeId, msg: &M) -> Result<()> {
        let len = codec::encoded_len(msg)?;
        self.send_frame(
            dest,
            M::TYPE,
            M::SUBTYPE,
            0,
            0,
            len,
            None,
            Instant::now(),
            |w| codec::encode_into(w, msg),
        )
    }

    /// Sends raw bytes as a message.
    pub fn send_raw(&self, dest: NodeId, t: u8, s: u8, payload: &[u8]) -> Result<()> {
        if t == 0 {
            return Err(Error::Config("message type 0 is reserved for dxnet".into()));
        }
        self.send_frame(dest, t, s, 0, 0, payload.len(), None, Instant::now(), |w| {
            w.write_all(payload)
        })
    }

    /// Sends a request; the handle waits for its response.
    pub fn send_request<R: Request>(
        &self,
        dest: NodeId,
        req: &R,
        timeout: Duration,
    ) -> Result<PendingResponse> {
        let len = codec::encoded_len(req)?;
        let now = Instant::now();
        let (id, pending) = self.requests.insert_at(dest, now, timeout)?;
        let deadline = pending.deadline();
        self.send_frame(
            dest,
            R::TYPE,
            R::SUBTYPE,
            FLAG_REQUEST,
            id,
            len,
            Some(deadline),
            now,
            |w| codec::encode_into(w, req),
        )?;
        Ok(pending)
    }

    /// Blocks until `p`'s outcome is known: busy-waits first (a response
    /// that arrives meanwhile is taken without waking this thread; on an
    /// engine that supports it this thread even receives it itself, see
    /// `ReceiveRole::help`), then parks. How long: [`park::RequestSpinPolicy`].
    pub fn wait_response(&self, p: PendingResponse) -> Outcome {
        let park = &self.config.park;
        if park.request_spin_us == 0 || p.is_done() {
            return p.wait();
        }
        let mut waiting = park::RequestWait::enter(park);
        if !waiting.may_spin() {
            // Many requesters are blocked: park and leave the cores to the
            // threads that carry the responses.
            return p.wait();
        }
        let start = Instant::now();
        let conn = self.connections.get(p.peer());
        let spin = conn.as_ref().map_or_else(
            || park::RequestSpinPolicy::full(park),
            |c| c.request_spin.spin(park),
        );
        inline::before_blocking();
        {
            let until = (start + spin).min(p.deadline());
            let helped = self
                .transport()
                .is_some_and(|t| t.receive_while_waiting(&|| p.is_done(), until));
            if !helped {
                p.spin_until(until);
            }
        }
        waiting.stop_spinning();
        if let Some(c) = &conn {
            let spun = spin.min(p.deadline().saturating_duration_since(start));
            c.request_spin.record(park, spun, p.is_done());
        }
        p.wait()
    }

    fn send_response<M: Message>(&self, dest: NodeId, id: u32, resp: &M) -> Result<()> {
        let len = codec::encoded_len(resp)?;
        self.send_frame(
            dest,
            M::TYPE,
            M::SUBTYPE,
            FLAG_RESPONSE,
            id,
            len,
            None,
            Instant::now(),
            |w| codec::encode_into(w, resp),
        )
    }

    fn send_error_response(&self, dest: NodeId, id: u32, code: u8, t: u8, s: u8) {
        let payload = [code, t, s];
        let res = self.send_frame(
            dest,
            t,
            s,
            FLAG_RESPONSE | FLAG_ERROR,
            id,
            3,
            None,
            Instant::now(),
            |w| w.write_all(&payload),
        );
        if let Err(e) = res {
            tracing::debug!("error response to {dest} not sent: {e}");
        }
    }

    /// Serializes one message (header + payload of `payload_len` bytes
    /// written by `fill`) into the destination's ring buffer, or sends a
    /// small request or response at once (see
    /// [`Transport::send_standalone`]). `now`: the caller's clock reading.
    #[allow(clippy::too_many_arguments)]
    fn send_frame<F>(
        &self,
        dest: NodeId,
        t: u8,
        s: u8,
        flags: u8,
        request_id: u32,
        payload_len: usize,
        deadline: Option<Instant>,
        now: Instant,
        fill: F,
    ) -> Result<()>
    where
        F: FnOnce(&mut dyn Write) -> std::io::Result<()>,
    {
        if payload_len > self.config.max_message_size {
            return Err(Error::TooLarge {
                size: payload_len,
                max: self.config.max_message_size,
            });
        }
        if self.is_shut_down() {
            return Err(Error::Shutdown);
        }
        let header = MessageHeader {
            msg_type: t,
            subtype: s,
            flags,
            request_id,
            payload_len: payload_len as u32,
        };
        let mut hb = [0u8; HEADER_LEN];
        header.encode(&mut hb);
        let total = HEADER_LEN + payload_len;
        let send_deadline = now + Duration::from_millis(self.config.send_timeout_ms);
        let deadline = deadline.map_or(send_deadline, |d| d.min(send_deadline));

        if dest == self.own {
            return self.send_local(&hb, total, deadline, fill);
        }
        let guard = self.connections.guard(dest);
        let slow;
        let conn: &Arc<Connection> = match &*guard {
            Some(c) if c.state() == ConnState::Open => c,
            _ => {
                slow = self.connection(dest, deadline)?;
                &slow
            }
        };
        conn.touch(self.tick(now));
        // Responses are sent by handler threads. Once a response to this
        // peer timed out (a peer that does not read, or ignores flow
        // control), the next ones are tried without waiting until one fits
        // again: otherwise such a peer, sending requests, would hold a
        // handler thread for `send_timeout_ms` per request and its
        // unprocessed buffers would fill the incoming queue of every
        // connection.
        let response = flags & FLAG_RESPONSE != 0;
        let deadline = if response && conn.responses_stalled.load(Ordering::Relaxed) {
            now
        } else {
            deadline
        };
        let res = self.send_frame_on(conn, dest, &hb, total, flags, deadline, now, fill);
        if response {
            let stalled = matches!(res, Err(Error::Timeout(_)));
            if conn.responses_stalled.load(Ordering::Relaxed) != stalled {
                conn.responses_stalled.store(stalled, Ordering::Relaxed);
            }
        }
        res
    }

    /// [`Core::send_frame`] once the connection is known and open.
    #[allow(clippy::too_many_arguments)]
    fn send_frame_on<F>(
        &self,
        conn: &Arc<Connection>,
        dest: NodeId,
        hb: &[u8; HEADER_LEN],
        total: usize,
        flags: u8,
        deadline: Instant,
        now: Instant,
        fill: F,
    ) -> Result<()>
    where
        F: FnOnce(&mut dyn Write) -> std::io::Result<()>,
    {
        // Responses are outside the flow-control window: the requester
        // asked for them (its outstanding requests bound them) and takes
        // them off the wire at once, even while its handler is blocked.
        // Counting them would let two nodes whose windows are full of each
        // other's messages deadlock: each one's handler waits for window
        // to answer a request, which only the other's blocked handler
        // could free.
        let flow_controlled = flags & FLAG_RESPONSE == 0;
        let window_back = |total: usize| {
            if flow_controlled {
                conn.flow.on_confirm_bytes(total as u64);
            }
        };
        if flow_controlled {
            let open = || conn.state() == ConnState::Open;
            conn.flow
                .acquire(total as u64, deadline, &self.config.park, open)
                .map_err(|e| match e {
                    FlowWaitError::Timeout => Error::Timeout("send blocked by flow control"),
                    FlowWaitError::Closed => Error::Unreachable(dest, conn.close_reason()),
                })?;
        }
        let urgent = flags & (FLAG_REQUEST | FLAG_RESPONSE) != 0;
        // A small request or response goes out at once, outside the ring
        // buffer, where the engine has such a path (InfiniBand, loopback): encoded on
        // the stack first, and into the ring after all if the engine
        // declines (see `Transport::send_standalone`).
        let mut small;
        let mut encoded_frame: Option<&[u8]> = None;
        let mut fill = Some(fill);
        if urgent && total <= STANDALONE_FRAME_MAX {
            if let Some(t) = self.transport().filter(|t| total <= t.standalone_max()) {
                small = [0u8; STANDALONE_FRAME_MAX];
                small[..HEADER_LEN].copy_from_slice(hb);
                let mut rest: &mut [u8] = &mut small[HEADER_LEN..total];
                let encoded = fill.take().map_or(Ok(()), |f| f(&mut rest)).and_then(|()| {
                    if rest.is_empty() {
                        Ok(())
                    } else {
                        Err(std::io::Error::other(
                            "serialized size differs from computed size",
                        ))
                    }
                });
                if let Err(e) = encoded {
                    // Nothing was written: give the window back.
                    window_back(total);
                    return Err(Error::Decode(format!("cannot serialize message: {e}")));
                }
                if t.send_standalone(self, conn, &small[..total], now) {
                    self.stats.msgs_sent.add(1);
                    self.stats.bytes_sent.add(total as u64);
                    return Ok(());
                }
                encoded_frame = Some(&small[..total]);
            }
        }
        let notify = || {
            if urgent {
                self.on_urgent_write_interest(dest)
            } else {
                self.on_write_interest(dest)
            }
        };
        let res =
            conn.orb
                .write_message(total, deadline, &notify, |w| match (fill, encoded_frame) {
                    (Some(fill), _) => {
                        w.write_all(hb)?;
                        fill(w)
                    }
                    (None, Some(frame)) => w.write_all(frame),
                    (None, None) => unreachable!("a frame is either encoded or still to fill"),
                });
        match res {
            Ok(()) => {
                self.stats.msgs_sent.add(1);
                self.stats.bytes_sent.add(total as u64);
                Ok(())
            }
            Err(OrbError::Timeout) => {
                // Nothing was written: give the window back.
                window_back(total);
                Err(Error::Timeout("send blocked by a full ring buffer"))
            }
            Err(OrbError::Closed) => Err(Error::Unreachable(dest, conn.close_reason())),
            Err(OrbError::Corrupted) => {
                self.close_connection(conn, "message stream corrupted by a failed send", true);
                Err(Error::Timeout(
                    "send of a large message interrupted; connection closed",
                ))
            }
        }
    }

    /// Delivers a message to the own node through the handler threads.
    fn send_local<F>(
        &self,
        hb: &[u8; HEADER_LEN],
        total: usize,
        deadline: Instant,
        fill: F,
    ) -> Result<()>
    where
        F: FnOnce(&mut dyn Write) -> std::io::Result<()>,
    {
        let mut v = Vec::with_capacity(total);
        v.extend_from_slice(hb);
        fill(&mut v).map_err(|e| Error::Decode(format!("cannot serialize message: {e}")))?;
        if v.len() != total {
            return Err(Error::Decode(
                "serialized size differs from computed size".into(),
            ));
        }
        if !self.incoming.has_room()
            && !self.local_room.wait_until(&self.config.park, deadline, || {
                self.incoming.has_room() || self.is_shut_down()
            })
        {
            return Err(Error::Timeout(
                "local delivery blocked by a full incoming queue",
            ));
        }
        let depth = match inline::current_conn() {
            Some(c) if c.id == 0 => self
                .locals
                .iter()
                .position(|l| Arc::ptr_eq(l, &c))
                .map_or(0, |i| (i + 1).min(LOCAL_DEPTHS - 1)),
            _ => 0,
        };
        self.enqueue(&self.locals[depth], Incoming::Local(v));
        self.stats.msgs_sent.add(1);
        self.stats.bytes_sent.add(total as u64);
        Ok(())
    }

    // ----- connection manager -------------------------------------------------

    /// The open connection to `dest`, creating it on first use. Waits at most
    /// until `deadline` (and the connect timeout) for it to open.
    pub fn connection(&self, dest: NodeId, deadline: Instant) -> Result<Arc<Connection>> {
        let connect_deadline =
            deadline.min(Instant::now() + Duration::from_millis(self.config.connect_timeout_ms));
        loop {
            if let Some(c) = self.connections.get(dest) {
                match c.state() {
                    ConnState::Open => return Ok(c),
                    ConnState::Connecting => {
                        inline::before_blocking();
                        c.state_changed
                            .wait_until(&self.config.park, connect_deadline, || {
                                c.state() != ConnState::Connecting
                            });
                        match c.state() {
                            ConnState::Open => return Ok(c),
                            ConnState::Connecting => {
                                return Err(Error::Unreachable(
                                    dest,
                                    "connection not established in time".into(),
                                ))
                            }
                            ConnState::Closed => {
                                return Err(Error::Unreachable(dest, c.close_reason()))
                            }
                        }
                    }
                    ConnState::Closed => {} // being removed; create a new one
                }
            }
            if self.is_shut_down() {
                return Err(Error::Shutdown);
            }
            if self.config.transport != TransportKind::Loopback
                && self.config.address_of(dest).is_none()
            {
                return Err(Error::Unreachable(dest, "not in the node map".into()));
            }
            let Some(conn) = self.create_connection(dest, None)? else {
                continue; // somebody else created it meanwhile
            };
            inline::before_blocking(); // connecting blocks on the network
            let Some(t) = self.transport() else {
                return Err(Error::Shutdown);
            };
            match t.connect(&conn, connect_deadline) {
                Ok(()) if conn.state() == ConnState::Open => {
                    tracing::debug!("{}: connected to {dest}", self.own);
                    return Ok(conn);
                }
                Ok(()) => return Err(Error::Unreachable(dest, conn.close_reason())),
                Err(e) => {
                    let reason = match &e {
                        Error::Unreachable(_, r) => r.clone(),
                        other => other.to_string(),
                    };
                    self.close_connection(&conn, &reason, true);
                    return Err(Error::Unreachable(dest, reason));
                }
            }
        }
    }

    /// Creates and installs a connection to `peer` in state Connecting,
    /// closing the least recently used one if the limit is reached. Returns
    /// `None` if a live connection exists (and `replace` is not it).
    fn create_connection(
        &self,
        peer: NodeId,
        replace: Option<&Arc<Connection>>,
    ) -> Result<Option<Arc<Connection>>> {
        let mut evict = None;
        let conn = {
            let mut count = self.connections.lock.lock();
            if let Some(c) = self.connections.get(peer) {
                let replacing = replace.is_some_and(|r| r.id == c.id);
                if c.is_alive() && !replacing {
                    return Ok(None);
                }
                if !c.is_alive() {
                    self.connections.remove_if_current(&mut count, &c);
                }
            }
            if *count >= self.config.max_connections {
                // Prefer idle connections: closing one with queued data
                // loses that data (as a broken connection would).
                let lru = self
                    .connections
                    .all()
                    .into_iter()
                    .filter(|c| c.peer != peer)
                    .min_by_key(|c| (!c.is_idle(), c.last_used()));
                if let Some(l) = lru {
                    self.connections.remove_if_current(&mut count, &l);
                    evict = Some(l);
                }
            }
            let conn = Arc::new(Connection::new(
                peer,
                self.connections.next_id(),
                self.config.orb_size,
                FlowControl::new(self.fc_window, self.fc_unit),
                self.config.max_message_size,
            ));
            conn.touch(self.tick(Instant::now()));
            if let Some(t) = self.transport() {
                let t = Arc::downgrade(t);
                conn.orb.on_blocked(Box::new(move || {
                    if let Some(t) = t.upgrade() {
                        t.wake_sender();
                    }
                }));
            }
            self.connections.install(&mut count, conn.clone());
            conn
        };
        if let Some(l) = evict {
            tracing::debug!(
                "{}: closing least recently used connection to {}",
                self.own,
                l.peer
            );
            self.close_connection(&l, "closed to stay within max_connections", false);
        }
        if let Some(r) = replace {
            self.close_connection(
                r,
                "replaced by a new connection from the restarted peer",
                true,
            );
        }
        Ok(Some(conn))
    }

    /// A transport accepted an authenticated connection from `peer`. Returns
    /// the connection to attach to (then call [`Core::opened`]), or the
    /// status to reject with: the lower node id's dial wins a simultaneous
    /// connect, and a known peer instance already connected is a duplicate.
    pub fn accept_incoming(
        &self,
        peer: NodeId,
        instance: u64,
    ) -> std::result::Result<Arc<Connection>, wire::Status> {
        if self.is_shut_down() {
            return Err(wire::Status::ShuttingDown);
        }
        loop {
            let existing = self.connections.get(peer);
            let replace = match &existing {
                Some(c) => match c.state() {
                    ConnState::Connecting => {
                        return if self.own < peer {
                            Err(wire::Status::Duplicate)
                        } else {
                            Ok(c.clone())
                        };
                    }
                    ConnState::Open if c.peer_instance() == instance => {
                        return Err(wire::Status::Duplicate)
                    }
                    ConnState::Open => existing.as_ref(),
                    ConnState::Closed => None,
                },
                None => None,
            };
            match self.create_connection(peer, replace) {
                Ok(Some(c)) => return Ok(c),
                Ok(None) => continue,
                Err(_) => return Err(wire::Status::ShuttingDown),
            }
        }
    }

    /// A transport finished attaching `conn`: data may flow.
    pub fn opened(
        &self,
        conn: &Arc<Connection>,
        peer_instance: u64,
        peer_window: u64,
        peer_unit: u64,
    ) -> bool {
        conn.flow.set_peer(peer_window, peer_unit);
        let ok = conn.mark_open(peer_instance);
        if ok {
            self.stats.connections_opened.add(1);
        }
        ok
    }

    /// Closes `conn`: removes it, tells the transport, fails its pending
    /// requests (`failed`: with "destination unreachable", otherwise
    /// "cancelled"). Idempotent.
    pub fn close_connection(&self, conn: &Arc<Connection>, reason: &str, failed: bool) {
        if !conn.mark_closed(reason) {
            return;
        }
        {
            let mut count = self.connections.lock.lock();
            self.connections.remove_if_current(&mut count, conn);
        }
        if failed {
            tracing::info!("{}: connection to {} closed: {reason}", self.own, conn.peer);
        }
        if let Some(t) = self.transport() {
            t.close(conn);
        }
        let err = if failed {
            Error::Unreachable(conn.peer, reason.to_string())
        } else {
            Error::Cancelled("connection closed")
        };
        self.requests.fail_peer(conn.peer, &err);
        self.stats.connections_closed.add(1);
    }

    // ----- transport hooks ----------------------------------------------------

    /// `peer`'s connection has data or confirmations to send.
    #[inline]
    pub fn on_write_interest(&self, peer: NodeId) {
        if self.wim.push(peer.0) {
            if let Some(t) = self.transport() {
                t.wake_sender();
            }
        }
    }

    /// Like [`Core::on_write_interest`] for requests and responses, whose
    /// latency matters more than aggregation: if the send thread is parked,
    /// the engine may write the data on this thread rather than wake it.
    /// (Plain messages keep the wake: the time it takes is what lets
    /// concurrent and back-to-back sends aggregate into one write.)
    fn on_urgent_write_interest(&self, peer: NodeId) {
        if inline::defer_flush(peer.0) {
            return;
        }
        self.flush_deferred(peer);
    }

    /// Writes out `peer`'s urgent data now (on this thread if the engine
    /// can, see [`Core::on_urgent_write_interest`]).
    pub(crate) fn flush_deferred(&self, peer: NodeId) {
        match self.transport() {
            Some(t) if t.try_flush(peer) => {}
            _ => self.on_write_interest(peer),
        }
    }

    /// A transport received `buf` (segments set) on `conn`.
    pub fn deliver(self: &Arc<Self>, conn: &Arc<Connection>, buf: RecvBuffer) {
        if buf.data_len() == 0 {
            self.pool.put(buf);
            return;
        }
        if let Err(buf) = self.complete_responses_inline(conn, buf) {
            self.enqueue(conn, Incoming::Pooled(buf));
        }
    }

    /// Like [`Core::deliver`], for receive threads that can hand their
    /// receive role to a standby (see [`inline`]): a small buffer on an idle
    /// connection while every handler thread is parked is not queued but
    /// returned, with the connection taken, for the caller to run through
    /// [`Core::run_inline`] after giving up its receive role.
    pub fn deliver_or_inline(
        self: &Arc<Self>,
        conn: &Arc<Connection>,
        buf: RecvBuffer,
    ) -> Option<InlineWork> {
        let len = buf.data_len();
        if len == 0 || len > self.config.inline_receive_bytes {
            self.deliver(conn, buf);
            return None;
        }
        let buf = match self.complete_responses_inline(conn, buf) {
            Ok(()) => return None,
            Err(b) => b,
        };
        if !self.incoming.is_idle()
            || self.incoming.handlers.sleepers() < self.config.handler_threads
        {
            self.enqueue(conn, Incoming::Pooled(buf));
            return None;
        }
        {
            let mut inbox = conn.inbox.lock();
            if inbox.scheduled || !inbox.items.is_empty() {
                drop(inbox);
                self.enqueue(conn, Incoming::Pooled(buf));
                return None;
            }
            inbox.scheduled = true; // taken, as by a handler thread
        }
        Some(InlineWork {
            conn: conn.clone(),
            buf,
        })
    }

    /// Handles an [`InlineWork`] on the calling thread, then any buffers
    /// that arrived for its connection meanwhile (within the handler
    /// budget; the rest goes to the handler threads).
    pub fn run_inline(self: &Arc<Self>, work: InlineWork) {
        self.stats.inline_buffers.add(1);
        let InlineWork { conn, buf } = work;
        self.process_item(&conn, Incoming::Pooled(buf));
        self.process_connection(conn);
    }

    /// A buffer of whole response messages on an otherwise idle connection
    /// completes its requests right here on the receiving thread: no user
    /// code runs, and the waiting requester is woken one thread hop earlier.
    /// Anything else goes to the handler threads.
    fn complete_responses_inline(
        self: &Arc<Self>,
        conn: &Arc<Connection>,
        buf: RecvBuffer,
    ) -> std::result::Result<(), RecvBuffer> {
        let only_responses = {
            let mut segs = buf.segments();
            match (segs.next(), segs.next()) {
                (Some(seg), None) => {
                    let mut pos = 0;
                    let mut ok = true;
                    while ok && pos < seg.len() {
                        match message_at(seg, pos, self.config.max_message_size) {
                            Some((h, end)) if h.flags & FLAG_RESPONSE != 0 => pos = end,
                            _ => ok = false,
                        }
                    }
                    ok
                }
                _ => false,
            }
        };
        if !only_responses {
            return Err(buf);
        }
        if buf.is_standalone() {
            // Outside the stream and responses only (which are not ordered
            // with the connection's other messages): nothing to serialize
            // with the connection's handler or decoder, and the headers
            // were just checked: complete them straight away.
            self.complete_standalone_responses(conn, buf);
            return Ok(());
        }
        {
            // Take the connection like a handler thread would.
            let mut inbox = conn.inbox.lock();
            if inbox.scheduled || !inbox.items.is_empty() || !conn.decoder.lock().is_idle() {
                return Err(buf);
            }
            inbox.scheduled = true;
        }
        self.process_item(conn, Incoming::Pooled(buf));
        let more = {
            let mut inbox = conn.inbox.lock();
            if inbox.items.is_empty() {
                inbox.scheduled = false;
                false
            } else {
                true
            }
        };
        if more {
            self.incoming.reschedule(conn.clone());
        }
        Ok(())
    }

    /// Completes the responses of a standalone buffer that holds nothing
    /// else (checked by the caller) and returns the buffer: the requester's
    /// own path when it receives its response itself (see
    /// `ReceiveRole::help`), so kept short.
    fn complete_standalone_responses(&self, conn: &Arc<Connection>, buf: RecvBuffer) {
        let mut processed = 0u64;
        let mut count = 0u64;
        if let Some(seg) = buf.segments().next() {
            let mut pos = 0;
            while let Some((h, end)) = message_at(seg, pos, self.config.max_message_size) {
                self.dispatch(conn.peer, &h, &seg[pos + HEADER_LEN..end]);
                processed += (end - pos) as u64;
                count += 1;
                pos = end;
            }
        }
        self.stats.msgs_received.add(count);
        self.stats.bytes_received.add(processed);
        if self.pool.put(buf) {
            self.resources_freed();
        }
        // Responses only: outside the flow-control window, nothing to
        // confirm.
    }

    /// Transports call this when a receive resource frees up (for local
    /// delivery waiters too).
    fn resources_freed(&self) {
        if let Some(t) = self.transport() {
            t.wake_receiver();
        }
        self.local_room.notify_all();
    }

    /// Queues a received item for its connection's handler; decodes it at
    /// once instead while that handler is blocked (see
    /// [`Core::owner_blocking`]).
    fn enqueue(&self, conn: &Arc<Connection>, item: Incoming) {
        let mut item = item;
        while let Some(back) = self.incoming.push(conn, item) {
            let mut freed = false;
            let mut failed = None;
            {
                let mut dec = conn.decoder.lock();
                let mut inbox = conn.inbox.lock();
                if !inbox.owner_blocked {
                    item = back; // unblocked meanwhile: queue it as usual
                    continue;
                }
                let new = match self.decode_ahead(conn, &mut dec, back, &mut freed) {
                    Ok(v) => v,
                    Err(e) => {
                        failed = Some(e);
                        Vec::new()
                    }
                };
                inbox.bytes += new.len();
                // Appended to the last decoded item if there is one: waiting
                // messages then count as one item against the connection's
                // share of the incoming queue, and bytes stay bounded by
                // the sender's flow-control window.
                match inbox.items.back_mut() {
                    Some(Incoming::Decoded(last)) => {
                        self.incoming.resized(last.len(), last.len() + new.len());
                        last.extend_from_slice(&new);
                    }
                    _ => {
                        self.incoming.added(new.len());
                        inbox.items.push_back(Incoming::Decoded(new));
                    }
                }
            }
            self.after_decode_ahead(conn, freed, failed);
            return;
        }
    }

    /// A handler of `conn` (held by the calling thread) is about to block
    /// inside dxnet, e.g. on a nested request to `conn`'s peer. The
    /// response would arrive behind the blocked handler on the same
    /// connection, so `conn` switches to decode-ahead until the handler
    /// returns: queued and newly received buffers are decoded at once,
    /// responses complete, other messages wait (copied) for their turn.
    pub(crate) fn owner_blocking(&self, conn: &Arc<Connection>) {
        let mut freed = false;
        let mut failed = None;
        {
            let mut dec = conn.decoder.lock();
            let mut inbox = conn.inbox.lock();
            if inbox.owner_blocked {
                return;
            }
            inbox.owner_blocked = true;
            // Everything queued becomes one item (decoded ahead, in order):
            // the connection then holds one item of the incoming queue,
            // below its share, and its receiver reads on — the response
            // the handler waits for may be behind the queued buffers
            // (see `IncomingQueue::over_share`). Bytes still count.
            let k = inbox.items.len();
            if k > 0 {
                let mut merged: Vec<u8> = Vec::new();
                let mut old = 0;
                for it in std::mem::take(&mut inbox.items) {
                    old += it.data_len();
                    match it {
                        Incoming::Decoded(v) if merged.is_empty() => merged = v,
                        Incoming::Decoded(v) => merged.extend_from_slice(&v),
                        raw => match self.decode_ahead(conn, &mut dec, raw, &mut freed) {
                            Ok(v) => merged.extend_from_slice(&v),
                            Err(e) => failed = Some(e),
                        },
                    }
                }
                self.incoming.resized(old, merged.len());
                self.incoming.merged(k - 1);
                inbox.bytes = inbox.bytes - old + merged.len();
                inbox.items.push_back(Incoming::Decoded(merged));
            }
        }
        // A receiver that paused this connection (over its share of the
        // incoming queue) reads it again now (see `IncomingQueue::over_share`).
        if let Some(t) = self.transport() {
            t.wake_receiver();
        }
        self.after_decode_ahead(conn, freed, failed);
    }

    /// Decodes `item` with `conn`'s decoder (held): completes responses,
    /// returns the other whole messages as one byte stream.
    fn decode_ahead(
        &self,
        conn: &Arc<Connection>,
        dec: &mut Decoder,
        item: Incoming,
        freed: &mut bool,
    ) -> std::result::Result<Vec<u8>, crate::message::HeaderError> {
        let mut out = Vec::new();
        let mut done = 0u64;
        let mut on_msg = |h: &MessageHeader, p: &[u8]| {
            if h.flags & FLAG_RESPONSE != 0 {
                done += (HEADER_LEN + p.len()) as u64;
                self.stats.msgs_received.add(1);
                self.dispatch(conn.peer, h, p);
            } else {
                let mut hb = [0u8; HEADER_LEN];
                h.encode(&mut hb);
                out.extend_from_slice(&hb);
                out.extend_from_slice(p);
            }
        };
        let res = match &item {
            Incoming::Pooled(b) if b.is_standalone() => self.feed_standalone(b, &mut on_msg),
            Incoming::Pooled(b) => b.segments().try_for_each(|seg| dec.feed(seg, &mut on_msg)),
            Incoming::Local(v) | Incoming::Decoded(v) => dec.feed(v, &mut on_msg),
        };
        if let Incoming::Pooled(b) = item {
            *freed |= self.pool.put(b);
        }
        // Only responses were processed: outside the flow-control window,
        // nothing to confirm.
        self.stats.bytes_received.add(done);
        res.map(|()| out)
    }

    /// Decodes a standalone buffer (whole messages outside the stream, see
    /// [`RecvBuffer::mark_standalone`]) with a decoder of its own.
    fn feed_standalone(
        &self,
        b: &RecvBuffer,
        on_msg: &mut impl FnMut(&MessageHeader, &[u8]),
    ) -> std::result::Result<(), crate::message::HeaderError> {
        let mut dec = Decoder::new(self.config.max_message_size);
        b.segments()
            .try_for_each(|seg| dec.feed(seg, &mut *on_msg))?;
        if dec.is_idle() {
            Ok(())
        } else {
            Err(crate::message::HeaderError::Truncated)
        }
    }

    fn after_decode_ahead(
        &self,
        conn: &Arc<Connection>,
        freed: bool,
        failed: Option<crate::message::HeaderError>,
    ) {
        if freed {
            self.resources_freed();
        }
        if let Some(e) = failed {
            tracing::warn!(
                "{}: protocol error from {}: {e}; closing the connection",
                self.own,
                conn.peer
            );
            self.close_connection(conn, &format!("protocol error: {e}"), true);
        }
    }

    // ----- handler threads -------------------------------------------------

    fn handler_loop(self: Arc<Self>) {
        let mut idle = Idle::new(&self.config.park);
        loop {
            if let Some(conn) = self.incoming.pop_ready() {
                idle.reset();
                self.process_connection(conn);
                continue;
            }
            if self.is_shut_down() {
                return;
            }
            if idle.step() {
                let max = idle.max_park;
                self.incoming
                    .handlers
                    .park_unless(|| !self.incoming.is_idle() || self.is_shut_down(), max);
            }
        }
    }

    fn process_connection(self: &Arc<Self>, conn: Arc<Connection>) {
        for _ in 0..HANDLER_BUDGET {
            let (item, wake) = self.incoming.next_item(&conn);
            if wake {
                self.resources_freed();
            }
            let Some(item) = item else { return };
            self.process_item(&conn, item);
        }
        // Budget used up: let other connections go first.
        self.incoming.reschedule(conn);
    }

    /// Handles one buffer of a connection the caller holds, in two steps:
    /// decode it all (completing responses at once), then run the handlers
    /// of its other messages in order without holding the decoder. So a
    /// handler may block on a nested request to the very peer it is
    /// handling: its response is completed by the decode-ahead (see
    /// [`Core::owner_blocking`]).
    fn process_item(self: &Arc<Self>, conn: &Arc<Connection>, item: Incoming) {
        let mut processed = 0u64;
        let mut responses = 0u64;
        let mut count = 0u64;
        let mut pending = take_scratch();
        let base: &[u8] = match &item {
            Incoming::Pooled(b) => b.bytes(),
            Incoming::Local(v) | Incoming::Decoded(v) => v,
        };
        let res = {
            let mut on_msg = |h: &MessageHeader, p: &[u8]| {
                if h.flags & FLAG_RESPONSE != 0 {
                    // Outside the flow-control window: counted in the
                    // stats only.
                    responses += (HEADER_LEN + p.len()) as u64;
                    count += 1;
                    self.dispatch(conn.peer, h, p);
                    return;
                }
                // Payloads inside the buffer are referenced, reassembled
                // ones (split across buffers) copied out of the decoder.
                let off = (p.as_ptr() as usize).wrapping_sub(base.as_ptr() as usize);
                let at = if !p.is_empty() && off <= base.len() && p.len() <= base.len() - off {
                    PayloadAt::In(off..off + p.len())
                } else {
                    PayloadAt::Owned(p.to_vec())
                };
                pending.push(PendingMessage { header: *h, at });
            };
            match &item {
                // Whole messages outside the stream: its decoder is
                // neither needed nor touched.
                Incoming::Pooled(b) if b.is_standalone() => self.feed_standalone(b, &mut on_msg),
                Incoming::Pooled(b) => {
                    let mut dec = conn.decoder.lock();
                    b.segments().try_for_each(|seg| dec.feed(seg, &mut on_msg))
                }
                Incoming::Local(v) => conn.decoder.lock().feed(v, &mut on_msg),
                // Whole messages: no decoder state involved.
                Incoming::Decoded(v) => {
                    Decoder::new(self.config.max_message_size).feed(v, &mut on_msg)
                }
            }
        };
        if !pending.is_empty() {
            let several = pending.len() > 1;
            let mut run = || {
                for m in pending.drain(..) {
                    let payload = match &m.at {
                        PayloadAt::In(r) => &base[r.clone()],
                        PayloadAt::Owned(v) => v,
                    };
                    processed += (HEADER_LEN + payload.len()) as u64;
                    count += 1;
                    self.dispatch(conn.peer, &m.header, payload);
                    if inline::take_blocked() {
                        conn.inbox.lock().owner_blocked = false;
                    }
                }
            };
            inline::handling(self, conn, || {
                if several {
                    inline::deferring_flushes(run, |p| self.flush_deferred(NodeId(p)));
                } else {
                    run();
                }
            });
        }
        put_scratch(pending);
        self.stats.msgs_received.add(count);
        self.stats.bytes_received.add(processed + responses);
        if let Incoming::Pooled(b) = item {
            if self.pool.put(b) {
                self.resources_freed();
            }
        }
        if conn.id != 0 && conn.flow.on_processed(processed) && conn.is_alive() {
            self.on_write_interest(conn.peer);
        }
        if let Err(e) = res {
            if conn.id == 0 {
                tracing::error!("{}: local message stream corrupted: {e}", self.own);
            } else {
                tracing::warn!(
                    "{}: protocol error from {}: {e}; closing the connection",
                    self.own,
                    conn.peer
                );
                self.close_connection(conn, &format!("protocol error: {e}"), true);
            }
        }
    }

    fn dispatch(&self, src: NodeId, h: &MessageHeader, payload: &[u8]) {
        if h.flags & FLAG_RESPONSE != 0 {
            let completed = if h.flags & FLAG_ERROR != 0 {
                self.requests
                    .complete(h.request_id, src, Err(remote_error(h, payload)))
            } else {
                self.requests.complete_payload(h.request_id, src, payload)
            };
            if !completed {
                tracing::debug!(
                    "{}: response {} from {src} matches no pending request",
                    self.own,
                    h.request_id
                );
            }
            return;
        }
        let Some(entry) = self.handlers[h.type_key() as usize].get() else {
            self.stats.unknown_messages.add(1);
            let key = h.type_key() as usize;
            let bit = 1u64 << (key % 64);
            if self.unknown_logged[key / 64].fetch_or(bit, Ordering::Relaxed) & bit == 0 {
                tracing::warn!(
                    "{}: message of unknown type ({}, {}) from {src} dropped (further ones of this type are logged at debug level)",
                    self.own,
                    h.msg_type,
                    h.subtype
                );
            } else {
                tracing::debug!(
                    "{}: message of unknown type ({}, {}) from {src} dropped",
                    self.own,
                    h.msg_type,
                    h.subtype
                );
            }
            if h.flags & FLAG_REQUEST != 0 {
                self.send_error_response(
                    src,
                    h.request_id,
                    REMOTE_UNKNOWN_TYPE,
                    h.msg_type,
                    h.subtype,
                );
            }
            return;
        };
        match &entry.kind {
            HandlerKind::Request(f) => {
                if h.flags & FLAG_REQUEST == 0 {
                    tracing::warn!(
                        "{}: request type ({}, {}) sent without request flag by {src}",
                        self.own,
                        h.msg_type,
                        h.subtype
                    );
                    return;
                }
                f(self, src, h.request_id, payload)
            }
            HandlerKind::Message(_) if entry.exclusive => {
                let item = ExclusiveItem {
                    src,
                    key: h.type_key(),
                    payload: payload.to_vec(),
                };
                if let Some(tx) = &*self.exclusive_tx.read() {
                    let _ = tx.send(item);
                }
            }
            HandlerKind::Message(f) => run_receiver(self.own, f, src, h.type_key(), payload),
        }
    }

    fn exclusive_loop(self: Arc<Self>, rx: Receiver<ExclusiveItem>) {
        while let Ok(item) = rx.recv() {
            if let Some(HandlerEntry {
                kind: HandlerKind::Message(f),
                ..
            }) = self.handlers[item.key as usize].get()
            {
                run_receiver(self.own, f, item.src, item.key, &item.payload);
            }
        }
    }

    // ----- lifecycle -----------------------------------------------------------

    /// Counters.
    pub fn stats(&self) -> NodeStats {
        let s = &self.stats;
        NodeStats {
            msgs_sent: s.msgs_sent.get(),
            msgs_received: s.msgs_received.get(),
            bytes_sent: s.bytes_sent.get(),
            bytes_received: s.bytes_received.get(),
            connections_opened: s.connections_opened.get(),
            connections_closed: s.connections_closed.get(),
            unknown_messages: s.unknown_messages.get(),
            inline_buffers: s.inline_buffers.get(),
        }
    }

    /// Stops everything: pending requests fail with `Shutdown`, connections
    /// close, threads are joined. Idempotent.
    pub fn shutdown(&self) {
        if self.shutdown.swap(true, Ordering::AcqRel) {
            return;
        }
        self.requests.close();
        if let Some(t) = self.transport() {
            t.shutdown();
        }
        for c in self.connections.all() {
            self.close_connection(&c, "node shut down", false);
        }
        self.exclusive_tx.write().take();
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
        Some(&REMOTE_PANIC) => Error::Cancelled("the remote request handler panicked"),
        _ => Error::Decode("malformed error response".into()),
    }
}
