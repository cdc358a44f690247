//! TCP transport: non-blocking sockets on epoll (mio), one send thread and
//! one receive thread per node (not per connection), a listener thread, and
//! short-lived handshake threads for incoming connections.
//!
//! Wire format of a connection after the handshake: a sequence of chunks,
//! each an 8-byte header (data length, flow-control units) followed by that
//! many bytes of the sender's ring buffer. The send thread writes a chunk
//! with one `writev` straight out of the ring buffer (two slices when the
//! data wraps around); a chunk with no data carries flow control alone (the
//! TCP analogue of an RDMA zero-length send with immediate data). The
//! receive thread reads into pooled buffers and marks which byte ranges are
//! message data, so nothing is copied again before the handler threads
//! decode in place.
//!
//! With `[tls]` configured the same chunks travel inside TLS 1.3 records
//! (rustls): the send thread copies them from the ring buffer into rustls,
//! which encrypts into its own bounded buffer, and the receive thread
//! decrypts into the pooled buffers (see [`super::tls`]).
//!
//! Files: this one holds the engine's state, start-up and the [`Transport`]
//! methods; `setup.rs` the connection set-up (handshakes, listener),
//! `recv.rs` the receive side, `send.rs` the send side.

use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use parking_lot::{Mutex, MutexGuard};

use crate::core::connection::{ring_capacity, ConnState, Connection};
use crate::core::inline::{ReceiveRole, Turn};
use crate::core::{Core, InlineWork};
use crate::primitives::orb::Consumer;
use crate::primitives::park::{self, Idle};
use crate::primitives::pool::RecvBuffer;
use crate::primitives::read_lease::ReadLease;
use crate::primitives::ring_notes::RingNotes;
use crate::proto::bounds::MessageBounds;
use crate::proto::handshake::{Credentials, Event, Handshake, Progress};
use crate::proto::wire::{
    encode_chunk_header, ChunkParser, HandshakeError, Hello, Status, CHUNK_HEADER_LEN,
    ENDPOINT_LEN, HANDSHAKE_LEN,
};
use crate::transport::cannot_connect;
use crate::transport::driver::run_send_loop;
use crate::transport::tls::{self, TlsContext, TlsStream};
use crate::transport::{resolve, EngineThreads, Lent, ResponseWait, Transport};
use crate::{Error, NodeId, Result};

mod lease;
mod recv;
mod send;
mod setup;

use setup::SetupFailure;

const WAKER: Token = Token(usize::MAX);
const LISTENER: Token = Token(usize::MAX - 1);
/// Largest chunk one `writev` sends (bytes of ring-buffer data).
const MAX_CHUNK: usize = 1 << 20;
/// Chunks the send thread writes for one connection before serving the next.
const SEND_ROUNDS: usize = 4;
/// Longest poll for the end of another thread's write to a socket
/// (`TcpEngine::wait_for_writer`): a small write on loopback takes 5–7 µs.
const FLUSH_WAIT: Duration = Duration::from_micros(15);
/// With this many of a node's threads blocked for responses or more, its
/// send thread stays awake to gather their next requests
/// (`TcpSender::idle`).
const GATHER_REQUESTERS: usize = 2;
/// With this many requesters of the process blocked or more, a thread
/// leaves its urgent data to the send thread, which aggregates.
const FLUSH_WAIT_MAX_REQUESTERS: usize = 4;

/// Incoming handshakes in progress, oldest first: a clone of each socket so
/// that the listener can cut off the oldest.
#[derive(Default)]
struct HandshakeSlots {
    next: u64,
    pending: VecDeque<(u64, TcpStream)>,
}

/// One incoming handshake's place in [`HandshakeSlots`]; leaves it on drop.
struct HandshakeSlot<'a> {
    slots: &'a Mutex<HandshakeSlots>,
    id: u64,
}

impl HandshakeSlot<'_> {
    /// Leaves the slots before the socket becomes a connection; false if
    /// the handshake was evicted (its socket is shut down).
    fn finish(&self) -> bool {
        let mut sl = self.slots.lock();
        let before = sl.pending.len();
        sl.pending.retain(|(i, _)| *i != self.id);
        sl.pending.len() < before
    }
}

impl Drop for HandshakeSlot<'_> {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Send-side state of a connection's stream (send thread only).
#[derive(Debug)]
struct SendState {
    /// The consumer role of each of the connection's rings.
    consumers: Box<[Consumer]>,
    /// The ring the current chunk comes from.
    ring: usize,
    /// The current chunk stops short of its ring's published data (it may
    /// end inside a message): the next chunk comes from the same ring.
    cut: bool,
    header: [u8; CHUNK_HEADER_LEN],
    /// Bytes of `header` already written (`CHUNK_HEADER_LEN`: none pending).
    header_off: usize,
    /// Data bytes of the current chunk not yet written.
    data_left: usize,
    /// The socket buffer was full; wait for a writable event.
    blocked: bool,
    /// Lent payloads ([`Transport::lend`]) of the current chunk, in ring
    /// order, each with the ring position it follows (its message
    /// header's end): the chunk's data is the ring's bytes with each
    /// payload spliced in after its header. The first may have been
    /// started in an earlier chunk; a payload too large for one chunk goes
    /// on in chunks of its own, before anything else.
    lent: VecDeque<(u64, Lent)>,
    /// Bytes of the first of `lent` written out.
    lent_off: usize,
    /// Bytes of `lent` in the current chunk not yet written.
    lent_left: usize,
    /// When data was last written, and how much the last `write_locked`
    /// call wrote (kept only with write coalescing on).
    last_write: Option<Instant>,
    last_len: usize,
}

/// The receive role: the poll set and lists of the receive loop, held by
/// one of the two receive threads at a time.
struct Receiver {
    poll: Poll,
    events: Events,
    readable: VecDeque<Arc<TcpConn>>,
    /// Readable connections holding their share of the incoming queue.
    paused: Vec<Arc<TcpConn>>,
    idle: Idle,
    /// No receive buffer or queue room: wait for a wake-up.
    starved: bool,
}

/// Receive-side state (receive thread only).
#[derive(Debug)]
struct RecvState {
    parser: ChunkParser,
    /// Where messages begin in the stream (to keep each in one buffer);
    /// `None` once the stream showed itself a stream of small messages
    /// (see `TcpEngine::parse_and_deliver`).
    bounds: Option<MessageBounds>,
    /// The buffer the next read continues: it begins with a message the
    /// stream ended inside, so that message arrives whole in one buffer.
    carry: Option<Carry>,
    /// Queued in the receive thread's readable list.
    readable: bool,
}

impl RecvState {
    /// Receive state of a new connection. A TLS connection does not walk
    /// its messages: its reads end wherever decryption caught up with the
    /// socket, mostly inside a message of kilobytes, and carrying it would
    /// copy on the thread that also decrypts (measured slower than
    /// reassembling such messages on the handler threads).
    fn new(tls: bool) -> Self {
        Self {
            parser: ChunkParser::default(),
            bounds: (!tls).then(MessageBounds::new),
            carry: None,
            readable: false,
        }
    }
}

/// A receive buffer holding the first part of a message, for the next read
/// to go on filling.
#[derive(Debug)]
struct Carry {
    buf: RecvBuffer,
    /// Bytes of `buf` in use (stream bytes and chunk headers).
    filled: usize,
}

/// The engine's half of one connection.
struct TcpConn {
    conn: Arc<Connection>,
    stream: TcpStream,
    send: Mutex<SendState>,
    recv: Mutex<RecvState>,
    /// Send an empty chunk even if there is nothing to send (liveness probe).
    poke: AtomicBool,
    /// A request or response waits in the rings for the send thread: it
    /// writes them at once, without coalescing ([`TcpEngine::coalesces`]).
    urgent: AtomicBool,
    /// The receive poll reported the peer's end of the stream (or an error).
    read_closed: AtomicBool,
    /// TLS state when the node uses TLS; locked by the send path (after
    /// `send`) and by the receive thread.
    tls: Option<Mutex<tls::Session>>,
    /// Payloads lent in place, per ring, at the position of their message
    /// header's end (see `send.rs`).
    lent: RingNotes<Lent>,
    /// Held by the one thread reading the socket: a receive thread for one
    /// read, or a requester for its wait (see `lease.rs`).
    read: ReadLease,
    /// Whether the socket is in the receive poll.
    polled: Mutex<lease::Polled>,
}

/// The TCP engine of one node.
pub struct TcpEngine {
    core: Weak<Core>,
    own: NodeId,
    /// Incoming handshakes in progress at once (`tcp.max_pending_handshakes`):
    /// a new connection beyond it evicts the oldest one in progress.
    max_pending_handshakes: usize,
    /// Outgoing rings per connection (`tcp.rings`).
    rings: usize,
    /// Write coalescing (`tcp.coalesce_bytes`, `tcp.coalesce_us`); no
    /// bytes: off.
    coalesce_bytes: usize,
    coalesce_wait: Duration,
    /// Buffers from this size on are sent in place (`tcp.send_in_place_from`;
    /// 0: never).
    send_in_place_from: usize,
    /// A message the stream ends inside is carried to the start of the next
    /// buffer only while more buffers than this are free (half the pool):
    /// the buffers connections hold for their next read stay bounded.
    carry_min_free: usize,
    /// Handshake threads at once (each counted until the listener joined
    /// it, evicted ones too); connections beyond it are refused.
    max_handshake_threads: usize,
    secret: Option<Vec<u8>>,
    tls: Option<TlsContext>,
    /// Connections the receive thread must read without a readiness event
    /// (TLS may hold data it already took off the socket in the handshake).
    kick: Mutex<Vec<Arc<TcpConn>>>,
    /// The engine's halves of the attached connections, by poll token (the
    /// connection id): they own them (see [`Connection::engine`]).
    by_token: Mutex<HashMap<usize, Arc<TcpConn>>>,
    recv_registry: mio::Registry,
    /// The receive role of the two receive threads.
    receiver: ReceiveRole<Receiver>,
    recv_waker: Waker,
    recv_sleeping: AtomicBool,
    send_registry: mio::Registry,
    send_waker: Waker,
    send_sleeping: AtomicBool,
    /// When the send thread last parked (ns since `epoch`).
    send_parked_at: AtomicU64,
    /// Origin of `send_parked_at`.
    epoch: Instant,
    /// A thread polls for the end of another's write (`wait_for_writer`).
    flush_waiter: AtomicBool,
    listen_waker: Waker,
    handshakes: Mutex<HandshakeSlots>,
    stop: AtomicBool,
    threads: EngineThreads,
}

fn io_err(e: std::io::Error) -> Error {
    Error::Transport(e.to_string())
}

/// Starts the TCP engine: binds the listener on the own node-map address and
/// starts the listener, send and receive threads.
pub fn start(core: &Arc<Core>) -> Result<Arc<dyn Transport>> {
    let cfg = core.config();
    let own = core.own_id();
    let addr = cfg
        .address_of(own)
        .ok_or_else(|| Error::Config(format!("own node id {} is not in the node map", own.0)))?;
    let addr = resolve(addr).map_err(|e| Error::Config(format!("address of {own}: {e}")))?;
    let mut listener = bind_listener(addr, cfg.tcp.listen_backlog)
        .map_err(|e| Error::Transport(format!("cannot listen on {addr}: {e}")))?;
    let recv_poll = Poll::new().map_err(io_err)?;
    let send_poll = Poll::new().map_err(io_err)?;
    let listen_poll = Poll::new().map_err(io_err)?;
    listen_poll
        .registry()
        .register(&mut listener, LISTENER, Interest::READABLE)
        .map_err(io_err)?;
    let rings = cfg.tcp.ring_count();
    let engine = Arc::new(TcpEngine {
        core: Arc::downgrade(core),
        own,
        max_pending_handshakes: cfg.tcp.max_pending_handshakes,
        rings,
        // Never more than half of what a sender may have outstanding: data
        // must not wait for more that its ring or the window cannot take.
        coalesce_bytes: cfg
            .tcp
            .coalesce_bytes
            .min(ring_capacity(cfg.limits.orb_size, rings) / 2)
            .min(cfg.limits.flow_control_window / 2),
        coalesce_wait: Duration::from_micros(cfg.tcp.coalesce_us),
        send_in_place_from: cfg.tcp.send_in_place_from,
        carry_min_free: cfg.recv_pool_size() / 2,
        max_handshake_threads: cfg.tcp.max_pending_handshakes * 3 / 2,
        secret: cfg.cluster_secret.as_ref().map(|s| s.as_bytes().to_vec()),
        tls: cfg.tls.as_ref().map(TlsContext::load).transpose()?,
        kick: Mutex::new(Vec::new()),
        by_token: Mutex::new(HashMap::new()),
        recv_registry: recv_poll.registry().try_clone().map_err(io_err)?,
        recv_waker: Waker::new(recv_poll.registry(), WAKER).map_err(io_err)?,
        receiver: ReceiveRole::new(Receiver {
            poll: recv_poll,
            events: Events::with_capacity(256),
            readable: VecDeque::new(),
            paused: Vec::new(),
            idle: Idle::new(core.park()),
            starved: false,
        }),
        recv_sleeping: AtomicBool::new(false),
        send_registry: send_poll.registry().try_clone().map_err(io_err)?,
        send_waker: Waker::new(send_poll.registry(), WAKER).map_err(io_err)?,
        send_sleeping: AtomicBool::new(false),
        send_parked_at: AtomicU64::new(0),
        epoch: Instant::now(),
        flush_waiter: AtomicBool::new(false),
        listen_waker: Waker::new(listen_poll.registry(), WAKER).map_err(io_err)?,
        handshakes: Mutex::new(HandshakeSlots::default()),
        stop: AtomicBool::new(false),
        threads: EngineThreads::default(),
    });
    let spawned = (|| {
        for _ in 0..2 {
            let (e, c) = (engine.clone(), core.clone());
            engine
                .threads
                .spawn(format!("dxnet-tcp-recv-{}", own.0), move || {
                    e.recv_thread(c)
                })?;
        }
        let (e, c) = (engine.clone(), core.clone());
        engine
            .threads
            .spawn(format!("dxnet-tcp-send-{}", own.0), move || {
                let mut side = send::TcpSender {
                    engine: e,
                    poll: send_poll,
                    events: Events::with_capacity(256),
                    failed: false,
                    deferred: Vec::new(),
                    round_over: false,
                    awake_until: None,
                    gather_idle_since: None,
                };
                run_send_loop(&mut side, &c);
            })?;
        let e = engine.clone();
        engine
            .threads
            .spawn(format!("dxnet-tcp-listen-{}", own.0), move || {
                e.listen_loop(listener, listen_poll)
            })
    })();
    if let Err(e) = spawned {
        // The threads already running hold the engine: stop them.
        engine.shutdown();
        return Err(e);
    }
    tracing::debug!("{own}: listening on {addr}");
    Ok(engine)
}

/// Binds the listening socket with a deep accept backlog (mio's `bind` uses
/// 128, which a burst of connecting nodes overflows: the kernel then drops
/// SYNs and dialers wait a second for the retransmit). The kernel caps it
/// at `net.core.somaxconn`.
fn bind_listener(
    addr: std::net::SocketAddr,
    backlog: u32,
) -> std::io::Result<mio::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&addr.into())?;
    sock.listen(backlog.min(i32::MAX as u32) as i32)?;
    Ok(mio::net::TcpListener::from_std(sock.into()))
}

impl TcpEngine {
    /// Another thread is writing to `tc`'s socket (a system call of a few
    /// microseconds): one caller at a time looks for its end, up to
    /// [`FLUSH_WAIT`], rather than wake the send thread to write after it.
    /// Between looks it yields its core: the threads that write and that
    /// answer (the peer's receive thread on loopback) may need it. `None`
    /// if another caller waits already or the writer takes longer
    /// (preempted, or a full socket).
    fn wait_for_writer<'a>(&self, tc: &'a TcpConn) -> Option<MutexGuard<'a, SendState>> {
        if self.flush_waiter.swap(true, Ordering::Acquire) {
            return None;
        }
        let until = Instant::now() + FLUSH_WAIT;
        let mut got = None;
        loop {
            if let Some(st) = tc.send.try_lock() {
                got = Some(st);
                break;
            }
            if Instant::now() >= until {
                break;
            }
            std::thread::yield_now();
        }
        self.flush_waiter.store(false, Ordering::Release);
        got
    }

    fn secret(&self) -> Option<&[u8]> {
        self.secret.as_deref()
    }
}

impl Transport for TcpEngine {
    fn connect(&self, conn: &Arc<Connection>, deadline: Instant) -> Result<()> {
        let core = self.core.upgrade().ok_or(Error::Shutdown)?;
        let peer = conn.peer;
        let addr = core
            .address_of(peer)
            .map_err(|cause| Error::Unreachable(peer, cause))?;
        let addr = resolve(&addr).map_err(|e| cannot_connect(peer, e.to_string()))?;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(cannot_connect(peer, "connection not established in time"));
            }
            let mut s = TcpStream::connect_timeout(&addr, left)
                .map_err(|e| cannot_connect(peer, format!("connect to {addr}: {e}")))?;
            if s.local_addr().ok() == Some(addr) {
                // TCP simultaneous open with itself: nothing listened at
                // `addr` and the kernel picked `addr` as the local port.
                // Closing it with a reset (no FIN, no TIME_WAIT) frees the
                // port for the peer's listener at once.
                let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
                return Err(cannot_connect(
                    peer,
                    format!("connect to {addr}: nothing listens there (connected to itself)"),
                ));
            }
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let _ = s.set_read_timeout(Some(left));
            let _ = s.set_write_timeout(Some(left));
            let mut tls_conn = match &self.tls {
                Some(t) => Some(t.dial(&mut s, peer).map_err(|e| cannot_connect(peer, e))?),
                None => None,
            };
            let res = match tls_conn.as_mut() {
                Some(c) => {
                    let mut ts = TlsStream {
                        conn: c,
                        sock: &mut s,
                    };
                    self.dial_handshake(&core, &mut ts, peer)
                }
                None => self.dial_handshake(&core, &mut s, peer),
            };
            match res {
                Ok(theirs) => {
                    if conn.state() == ConnState::Open {
                        // Opened meanwhile from the other side: keep that one.
                        return Ok(());
                    }
                    return self
                        .attach(&core, conn, s, tls_conn, &theirs)
                        .map_err(|e| cannot_connect(peer, e));
                }
                Err(SetupFailure::Protocol(HandshakeError::Rejected(Status::Duplicate))) => {
                    // The peer's own dial wins; it will open `conn`.
                    let wait = deadline.min(Instant::now() + Duration::from_millis(100));
                    conn.state_changed
                        .wait_until(core.park(), wait, || conn.state() != ConnState::Connecting);
                    match conn.state() {
                        ConnState::Open => return Ok(()),
                        ConnState::Closed => return Err(cannot_connect(peer, conn.close_reason())),
                        ConnState::Connecting => continue,
                    }
                }
                Err(e) => {
                    if let SetupFailure::Protocol(HandshakeError::Rejected(Status::UnknownNode)) = e
                    {
                        conn.set_refused_as_unknown();
                    }
                    return Err(cannot_connect(peer, e.to_string()));
                }
            }
        }
    }

    fn close(&self, conn: &Arc<Connection>) {
        let tc = self.by_token.lock().remove(&(conn.id as usize));
        if let Some(tc) = tc {
            // Lent payloads not started end lost (their senders learn that
            // the connection closed); one being written ends with the send
            // state, which the send path drops once it sees the close.
            drop(tc.lent.close());
            // The connection is closed already, so no read puts a carried
            // buffer back after this (`TcpEngine::put_back`).
            let carried = tc.recv.lock().carry.take();
            if let (Some(c), Some(core)) = (carried, self.core.upgrade()) {
                core.return_recv_buffer(c.buf);
            }
            self.close_poll(&tc);
            let fd = tc.stream.as_raw_fd();
            let _ = self.send_registry.deregister(&mut SourceFd(&fd));
            let _ = tc.stream.shutdown(std::net::Shutdown::Both);
        }
    }

    fn try_flush(&self, core: &Core, peer: NodeId, may_wait: bool) -> bool {
        let sleeping = self.send_sleeping.load(Ordering::Acquire);
        if !sleeping && self.coalesce_bytes == 0 {
            return false; // the send thread is awake and aggregates
        }
        let Some(tc) = core.engine_half::<TcpConn>(peer) else {
            return false;
        };
        // Whoever writes next (the send thread, unless this thread does):
        // not to hold the data back for coalescing. Stored before the
        // caller queues write interest, which orders it for the send thread.
        tc.urgent.store(true, Ordering::Release);
        if !sleeping {
            return false; // the send thread is awake and aggregates
        }
        let st = match tc.send.try_lock() {
            Some(st) => Some(st),
            // A requester that will block on its response anyway, with
            // few requests in flight: nothing to aggregate by waiting for
            // the send thread.
            None if may_wait && park::request_waiters() < FLUSH_WAIT_MAX_REQUESTERS => {
                self.wait_for_writer(&tc)
            }
            None => None,
        };
        let Some(mut st) = st else {
            return false;
        };
        if self.write_locked(core, &tc, &mut st, false) {
            drop(st);
            if core.requeue_write_interest(peer.0) {
                self.wake_sender();
            }
        }
        true
    }

    fn sender_parked_for(&self, now: Instant) -> Option<Duration> {
        if !self.send_sleeping.load(Ordering::Acquire) {
            return None;
        }
        let at = self.epoch + Duration::from_nanos(self.send_parked_at.load(Ordering::Relaxed));
        Some(now.saturating_duration_since(at))
    }

    fn read_while_waiting(&self, w: &ResponseWait<'_>) -> Option<bool> {
        TcpEngine::read_while_waiting(self, w)
    }

    fn rings(&self) -> usize {
        self.rings
    }

    fn wake_sender(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.send_sleeping.load(Ordering::SeqCst) {
            let _ = self.send_waker.wake();
        }
    }

    fn holds_unsent(&self, conn: &Connection) -> bool {
        conn.engine::<TcpConn>().is_some_and(|tc| {
            tc.lent.pending() || tc.tls.as_ref().is_some_and(|t| t.lock().wants_write())
        })
    }

    fn lends_from(&self) -> Option<usize> {
        (self.send_in_place_from > 0).then_some(self.send_in_place_from)
    }

    fn lend(&self, conn: &Connection, ring: usize, at: u64, payload: Lent) -> Result<(), Lent> {
        match conn.engine::<TcpConn>() {
            Some(tc) => tc.lent.add(ring, at, payload),
            None => Err(payload),
        }
    }

    fn wake_receiver(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        let _ = self.recv_waker.wake();
    }

    fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.recv_waker.wake();
        self.receiver.stopping();
        let _ = self.send_waker.wake();
        let _ = self.listen_waker.wake();
        self.threads.join_all();
        let until = self
            .core
            .upgrade()
            .map_or_else(Instant::now, |c| c.linger_until());
        let conns: Vec<_> = self.by_token.lock().values().cloned().collect();
        close_gracefully(&conns, until);
    }
}

/// Ends each stream with a FIN after the data written so far and reads
/// (discarding) until the peer's FIN or `until`: a socket closed with
/// unread received data sends a reset instead, and a reset makes the
/// peer's kernel drop what the peer has not read yet (this node's last
/// messages among it).
fn close_gracefully(conns: &[Arc<TcpConn>], until: Instant) {
    let mut open: Vec<&TcpStream> = conns
        .iter()
        .map(|tc| &tc.stream)
        .filter(|s| s.shutdown(std::net::Shutdown::Write).is_ok())
        .collect();
    let mut scratch = [0u8; 16 << 10];
    while !open.is_empty() {
        open.retain(|&(mut s)| loop {
            match s.read(&mut scratch) {
                Ok(0) => return false,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return e.kind() == std::io::ErrorKind::WouldBlock,
            }
        });
        if Instant::now() >= until {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
