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

use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use parking_lot::Mutex;

use crate::core::connection::{ConnState, Connection};
use crate::core::inline::{ReceiveRole, Turn};
use crate::core::{Core, InlineWork};
use crate::primitives::park::Idle;
use crate::primitives::pool::RecvBuffer;
use crate::proto::wire::{
    self, encode_chunk_header, ChunkParser, HandshakeError, HandshakeMsg, Hello, Status,
    CHUNK_HEADER_LEN, HANDSHAKE_LEN,
};
use crate::transport::cannot_connect;
use crate::transport::tls::{self, TlsContext, TlsStream};
use crate::transport::{resolve, Transport};
use crate::{Error, NodeId, Result};

const WAKER: Token = Token(usize::MAX);
const LISTENER: Token = Token(usize::MAX - 1);
/// Largest chunk one `writev` sends (bytes of ring-buffer data).
const MAX_CHUNK: usize = 1 << 20;
/// Chunks the send thread writes for one connection before serving the next.
const SEND_ROUNDS: usize = 4;
/// Incoming handshakes in progress at once. A new connection beyond it
/// evicts the oldest handshake still in progress (a legit dialer finishes in
/// a few round trips, a half-open flood holds its slots for the whole
/// connect timeout, so eviction keeps a slot for newcomers), so thousands of
/// half-open connections cannot exhaust threads or memory nor lock new
/// nodes out.
const MAX_PENDING_HANDSHAKES: usize = 64;
/// Accept backlog of the listening socket (capped by the kernel's
/// `net.core.somaxconn`).
const LISTEN_BACKLOG: i32 = 4096;
/// Handshake threads alive at once (evicted ones may take a moment to exit);
/// connections beyond it are refused.
const MAX_HANDSHAKE_THREADS: usize = MAX_PENDING_HANDSHAKES * 3 / 2;

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
    header: [u8; CHUNK_HEADER_LEN],
    /// Bytes of `header` already written (`CHUNK_HEADER_LEN`: none pending).
    header_off: usize,
    /// Data bytes of the current chunk not yet written.
    data_left: usize,
    /// The socket buffer was full; wait for a writable event.
    blocked: bool,
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
#[derive(Debug, Default)]
struct RecvState {
    parser: ChunkParser,
    /// Queued in the receive thread's readable list.
    readable: bool,
}

/// The engine's half of one connection.
struct TcpConn {
    conn: Arc<Connection>,
    stream: TcpStream,
    send: Mutex<SendState>,
    recv: Mutex<RecvState>,
    /// Send an empty chunk even if there is nothing to send (liveness probe).
    poke: AtomicBool,
    /// TLS state when the node uses TLS; locked by the send path (after
    /// `send`) and by the receive thread.
    tls: Option<Mutex<tls::Session>>,
}

/// The TCP engine of one node.
pub struct TcpEngine {
    core: Weak<Core>,
    own: NodeId,
    secret: Option<Vec<u8>>,
    tls: Option<TlsContext>,
    /// Connections the receive thread must read without a readiness event
    /// (TLS may hold data it already took off the socket in the handshake).
    kick: Mutex<Vec<Arc<TcpConn>>>,
    by_peer: Mutex<HashMap<u16, Arc<TcpConn>>>,
    by_token: Mutex<HashMap<usize, Arc<TcpConn>>>,
    recv_registry: mio::Registry,
    /// The receive role of the two receive threads.
    receiver: ReceiveRole<Receiver>,
    recv_waker: Waker,
    recv_sleeping: AtomicBool,
    send_registry: mio::Registry,
    send_waker: Waker,
    send_sleeping: AtomicBool,
    listen_waker: Waker,
    /// Handshake threads alive.
    pending_handshakes: AtomicUsize,
    handshakes: Mutex<HandshakeSlots>,
    stop: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// Why the dialer's side of a handshake failed: the peer's decision (which
/// the caller acts on) or anything else (reported as text).
#[derive(Debug)]
enum DialFailure {
    Rejected(Status),
    Failed(String),
}

impl From<String> for DialFailure {
    fn from(e: String) -> Self {
        Self::Failed(e)
    }
}

impl std::fmt::Display for DialFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Rejected(st) => write!(f, "{}", HandshakeError::Rejected(*st)),
            Self::Failed(e) => f.write_str(e),
        }
    }
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
    let mut listener = bind_listener(addr)
        .map_err(|e| Error::Transport(format!("cannot listen on {addr}: {e}")))?;
    let recv_poll = Poll::new().map_err(io_err)?;
    let send_poll = Poll::new().map_err(io_err)?;
    let listen_poll = Poll::new().map_err(io_err)?;
    listen_poll
        .registry()
        .register(&mut listener, LISTENER, Interest::READABLE)
        .map_err(io_err)?;
    let engine = Arc::new(TcpEngine {
        core: Arc::downgrade(core),
        own,
        secret: cfg.cluster_secret.as_ref().map(|s| s.as_bytes().to_vec()),
        tls: cfg.tls.as_ref().map(TlsContext::load).transpose()?,
        kick: Mutex::new(Vec::new()),
        by_peer: Mutex::new(HashMap::new()),
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
        listen_waker: Waker::new(listen_poll.registry(), WAKER).map_err(io_err)?,
        pending_handshakes: AtomicUsize::new(0),
        handshakes: Mutex::new(HandshakeSlots::default()),
        stop: AtomicBool::new(false),
        threads: Mutex::new(Vec::new()),
    });
    let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
        std::thread::Builder::new()
            .name(name)
            .spawn(f)
            .map_err(|e| Error::Transport(format!("cannot spawn thread: {e}")))
    };
    let mut threads = Vec::new();
    for _ in 0..2 {
        let (e, c) = (engine.clone(), core.clone());
        threads.push(spawn(
            format!("dxnet-tcp-recv-{}", own.0),
            Box::new(move || e.recv_thread(c)),
        )?);
    }
    let (e, c) = (engine.clone(), core.clone());
    threads.push(spawn(
        format!("dxnet-tcp-send-{}", own.0),
        Box::new(move || e.send_loop(c, send_poll)),
    )?);
    let e = engine.clone();
    threads.push(spawn(
        format!("dxnet-tcp-listen-{}", own.0),
        Box::new(move || e.listen_loop(listener, listen_poll)),
    )?);
    *engine.threads.lock() = threads;
    tracing::debug!("{own}: listening on {addr}");
    Ok(engine)
}

/// Binds the listening socket with a deep accept backlog (mio's `bind` uses
/// 128, which a burst of connecting nodes overflows: the kernel then drops
/// SYNs and dialers wait a second for the retransmit). The kernel caps it
/// at `net.core.somaxconn`.
fn bind_listener(addr: std::net::SocketAddr) -> std::io::Result<mio::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&addr.into())?;
    sock.listen(LISTEN_BACKLOG)?;
    Ok(mio::net::TcpListener::from_std(sock.into()))
}

impl TcpEngine {
    fn hello(&self, core: &Core, target: u16) -> Hello {
        Hello {
            node_id: self.own.0,
            target_id: target,
            instance: core.instance,
            fc_window: core.fc_window.min(u32::MAX as u64) as u32,
            fc_unit: core.fc_unit.min(u32::MAX as u64) as u32,
            nonce: rand::random(),
        }
    }

    fn secret(&self) -> Option<&[u8]> {
        self.secret.as_deref()
    }

    // ----- connection set-up ---------------------------------------------

    /// Dialer side of the handshake; returns the acceptor's hello.
    fn dial_handshake<S: Read + Write>(
        &self,
        core: &Core,
        s: &mut S,
        peer: NodeId,
    ) -> std::result::Result<Hello, DialFailure> {
        let mine = self.hello(core, peer.0);
        write_msg(s, &HandshakeMsg::Hello(mine)).map_err(|e| format!("handshake write: {e}"))?;
        let theirs = match read_msg(s)? {
            HandshakeMsg::Reply(h, mac) => {
                if h.node_id != peer.0 {
                    return Err(
                        format!("node {} answered at the address of {peer}", h.node_id).into(),
                    );
                }
                if !wire::verify_proof(
                    self.secret(),
                    b"acceptor",
                    &h.nonce,
                    &mine.nonce,
                    h.node_id,
                    self.own.0,
                    h.instance,
                    &mac,
                ) {
                    return Err(HandshakeError::Auth.to_string().into());
                }
                h
            }
            HandshakeMsg::Final(st) => return Err(DialFailure::Rejected(st)),
            other => return Err(format!("unexpected handshake message {other:?}").into()),
        };
        if let Some(id) = &core.identity {
            let t = wire::transcript(
                b"acceptor",
                &theirs.nonce,
                &mine.nonce,
                theirs.node_id,
                self.own.0,
                theirs.instance,
            );
            match read_msg(s)? {
                HandshakeMsg::Signature(sig) if id.verify(theirs.node_id, &t, &sig) => {}
                HandshakeMsg::Signature(_) => {
                    return Err(format!("{peer}'s identity signature is not valid").into())
                }
                other => {
                    return Err(format!("expected an identity signature, got {other:?}").into())
                }
            }
        }
        let proof = wire::proof(
            self.secret(),
            b"dialer",
            &mine.nonce,
            &theirs.nonce,
            self.own.0,
            peer.0,
            core.instance,
        );
        write_msg(s, &HandshakeMsg::Proof(proof)).map_err(|e| format!("handshake write: {e}"))?;
        if let Some(id) = &core.identity {
            let t = wire::transcript(
                b"dialer",
                &mine.nonce,
                &theirs.nonce,
                self.own.0,
                peer.0,
                core.instance,
            );
            write_msg(s, &HandshakeMsg::Signature(id.sign(&t)))
                .map_err(|e| format!("handshake write: {e}"))?;
        }
        match read_msg(s)? {
            HandshakeMsg::Final(Status::Accept) => Ok(theirs),
            HandshakeMsg::Final(st) => Err(DialFailure::Rejected(st)),
            other => Err(format!("unexpected handshake message {other:?}").into()),
        }
    }

    /// Acceptor side: authenticates the dialer (TLS first when configured),
    /// asks the core whether to accept, attaches the connection.
    fn accept_handshake(
        &self,
        core: &Arc<Core>,
        mut s: TcpStream,
        slot: HandshakeSlot<'_>,
    ) -> std::result::Result<(), String> {
        let timeout = Duration::from_millis(core.config().connect_timeout_ms);
        s.set_read_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        s.set_write_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        let mut tls_conn = match &self.tls {
            Some(t) => Some(t.accept(&mut s)?),
            None => None,
        };
        let (conn, theirs) = match tls_conn.as_mut() {
            Some(c) => {
                let cert = tls::peer_cert(c);
                let check = |id: NodeId| tls::check_cert_names(cert.as_ref(), id);
                let mut ts = TlsStream {
                    conn: c,
                    sock: &mut s,
                };
                self.accept_exchange(core, &mut ts, timeout, &check)?
            }
            None => self.accept_exchange(core, &mut s, timeout, &|_| Ok(()))?,
        };
        if !slot.finish() {
            let why = "handshake evicted by newer connections (handshake slots full)";
            core.close_connection(&conn, why, true);
            return Err(why.into());
        }
        self.attach(core, &conn, s, tls_conn, &theirs)
            .inspect_err(|e| core.close_connection(&conn, e, true))
    }

    /// The handshake messages of the acceptor; `identity` checks the
    /// claimed node id against the TLS certificate (when TLS is on).
    fn accept_exchange<S: Read + Write>(
        &self,
        core: &Arc<Core>,
        s: &mut S,
        timeout: Duration,
        identity: &dyn Fn(NodeId) -> std::result::Result<(), String>,
    ) -> std::result::Result<(Arc<Connection>, Hello), String> {
        let theirs = match read_msg(s)? {
            HandshakeMsg::Hello(h) => h,
            other => return Err(format!("expected hello, got {other:?}")),
        };
        let reject = |s: &mut S, st: Status| {
            let _ = write_msg(s, &HandshakeMsg::Final(st));
            Err(format!("rejected node {}: {st}", theirs.node_id))
        };
        if theirs.target_id != self.own.0 {
            return reject(s, Status::WrongTarget);
        }
        if core.config().address_of(NodeId(theirs.node_id)).is_none()
            || theirs.node_id == self.own.0
        {
            return reject(s, Status::UnknownNode);
        }
        if let Err(e) = identity(NodeId(theirs.node_id)) {
            let _ = write_msg(s, &HandshakeMsg::Final(Status::AuthFailed));
            return Err(format!("rejected node {}: {e}", theirs.node_id));
        }
        let mine = self.hello(core, 0);
        let mac = wire::proof(
            self.secret(),
            b"acceptor",
            &mine.nonce,
            &theirs.nonce,
            self.own.0,
            theirs.node_id,
            core.instance,
        );
        write_msg(s, &HandshakeMsg::Reply(mine, mac)).map_err(|e| e.to_string())?;
        if let Some(id) = &core.identity {
            let t = wire::transcript(
                b"acceptor",
                &mine.nonce,
                &theirs.nonce,
                self.own.0,
                theirs.node_id,
                core.instance,
            );
            write_msg(s, &HandshakeMsg::Signature(id.sign(&t))).map_err(|e| e.to_string())?;
        }
        match read_msg(s)? {
            HandshakeMsg::Proof(p) => {
                if !wire::verify_proof(
                    self.secret(),
                    b"dialer",
                    &theirs.nonce,
                    &mine.nonce,
                    theirs.node_id,
                    self.own.0,
                    theirs.instance,
                    &p,
                ) {
                    return reject(s, Status::AuthFailed);
                }
            }
            other => return Err(format!("expected proof, got {other:?}")),
        }
        if let Some(id) = &core.identity {
            let t = wire::transcript(
                b"dialer",
                &theirs.nonce,
                &mine.nonce,
                theirs.node_id,
                self.own.0,
                theirs.instance,
            );
            match read_msg(s)? {
                HandshakeMsg::Signature(sig) if id.verify(theirs.node_id, &t, &sig) => {}
                HandshakeMsg::Signature(_) => {
                    let _ = write_msg(s, &HandshakeMsg::Final(Status::AuthFailed));
                    return Err(format!(
                        "rejected node {}: identity signature not valid for that id",
                        theirs.node_id
                    ));
                }
                other => {
                    let _ = write_msg(s, &HandshakeMsg::Final(Status::AuthFailed));
                    return Err(format!(
                        "rejected node {}: expected an identity signature, got {other:?}",
                        theirs.node_id
                    ));
                }
            }
        }
        let peer = NodeId(theirs.node_id);
        if !self.old_connection_gone(core, peer, theirs.instance, timeout / 2) {
            return reject(s, Status::Duplicate);
        }
        let conn = match core.accept_incoming(peer, theirs.instance) {
            Ok(c) => c,
            Err(st) => return reject(s, st),
        };
        write_msg(s, &HandshakeMsg::Final(Status::Accept)).map_err(|e| e.to_string())?;
        Ok((conn, theirs))
    }

    /// A dialer claims to be `peer` with another instance id than our open
    /// connection to `peer`: a restarted node, or a member of the cluster
    /// (it knows the secret) claiming a running node's id. Only a dead
    /// connection may be replaced: probe it with an empty chunk (a restarted
    /// or rebooted peer host answers with a reset, which closes it) and wait
    /// at most `wait` for it to close. False if it stays open.
    fn old_connection_gone(
        &self,
        core: &Core,
        peer: NodeId,
        instance: u64,
        wait: Duration,
    ) -> bool {
        let Some(old) = core.connections.get(peer) else {
            return true;
        };
        if old.state() != ConnState::Open || old.peer_instance() == instance {
            return true; // Connecting or Closed: the core decides.
        }
        let tc = self.by_peer.lock().get(&peer.0).cloned();
        if let Some(tc) = tc {
            tc.poke.store(true, Ordering::Release);
            core.on_write_interest(peer);
        }
        old.state_changed
            .wait_until(core.park(), Instant::now() + wait, || {
                old.state() != ConnState::Open
            });
        if old.state() == ConnState::Open {
            tracing::warn!(
                "{}: refused a second connection claiming to be {peer} (instance {instance:#x}) while its connection is alive",
                self.own
            );
            return false;
        }
        tracing::info!(
            "{}: {peer} restarted (instance {instance:#x}); its stale connection failed the probe",
            self.own
        );
        true
    }

    /// Registers an authenticated socket for `conn` and opens it.
    fn attach(
        &self,
        core: &Core,
        conn: &Arc<Connection>,
        s: TcpStream,
        tls_conn: Option<tls::Session>,
        theirs: &Hello,
    ) -> std::result::Result<(), String> {
        s.set_nonblocking(true).map_err(|e| e.to_string())?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        let token = Token(conn.id as usize);
        let tc = Arc::new(TcpConn {
            conn: conn.clone(),
            stream: s,
            send: Mutex::new(SendState {
                header: [0; CHUNK_HEADER_LEN],
                header_off: CHUNK_HEADER_LEN,
                data_left: 0,
                blocked: false,
            }),
            recv: Mutex::new(RecvState::default()),
            poke: AtomicBool::new(false),
            tls: tls_conn.map(Mutex::new),
        });
        {
            let mut by_peer = self.by_peer.lock();
            if let Some(old) = by_peer.get(&conn.peer.0) {
                if old.conn.id == conn.id {
                    return Err("connection already attached".into());
                }
            }
            by_peer.insert(conn.peer.0, tc.clone());
            self.by_token.lock().insert(token.0, tc.clone());
        }
        let fd = tc.stream.as_raw_fd();
        self.recv_registry
            .register(&mut SourceFd(&fd), token, Interest::READABLE)
            .map_err(|e| e.to_string())?;
        self.send_registry
            .register(&mut SourceFd(&fd), token, Interest::WRITABLE)
            .map_err(|e| e.to_string())?;
        if !core.opened(
            conn,
            theirs.instance,
            theirs.fc_window as u64,
            theirs.fc_unit as u64,
        ) {
            return Err("connection closed during set-up".into());
        }
        core.on_write_interest(conn.peer);
        if tc.tls.is_some() {
            self.kick.lock().push(tc);
            self.wake_receiver();
        }
        Ok(())
    }

    fn listen_loop(self: Arc<Self>, listener: mio::net::TcpListener, mut poll: Poll) {
        let mut events = Events::with_capacity(16);
        while !self.stop.load(Ordering::Acquire) {
            if let Err(e) = poll.poll(&mut events, Some(Duration::from_millis(500))) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!("{}: listener poll failed: {e}", self.own);
                    return;
                }
            }
            loop {
                let (s, from) = match listener.accept() {
                    Ok(x) => x,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        tracing::warn!("{}: accept failed: {e}", self.own);
                        std::thread::sleep(Duration::from_millis(10));
                        break;
                    }
                };
                if self.pending_handshakes.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKE_THREADS {
                    self.pending_handshakes.fetch_sub(1, Ordering::AcqRel);
                    tracing::warn!(
                        "{}: too many handshakes in progress; refusing {from}",
                        self.own
                    );
                    continue;
                }
                // mio's stream owns the fd; hand it to std.
                let std_stream: TcpStream = {
                    use std::os::fd::{FromRawFd, IntoRawFd};
                    let fd = s.into_raw_fd();
                    // SAFETY: `fd` was just released by mio's stream, so this
                    // std stream is its only owner.
                    unsafe { TcpStream::from_raw_fd(fd) }
                };
                let Ok(clone) = std_stream.try_clone() else {
                    self.pending_handshakes.fetch_sub(1, Ordering::AcqRel);
                    continue;
                };
                let id = {
                    let mut sl = self.handshakes.lock();
                    if sl.pending.len() >= MAX_PENDING_HANDSHAKES {
                        if let Some((_, oldest)) = sl.pending.pop_front() {
                            let peer = oldest.peer_addr().ok();
                            let _ = oldest.shutdown(std::net::Shutdown::Both);
                            tracing::warn!(
                                "{}: {MAX_PENDING_HANDSHAKES} handshakes in progress; cut off the oldest (from {peer:?}) for {from}",
                                self.own
                            );
                        }
                    }
                    sl.next += 1;
                    let id = sl.next;
                    sl.pending.push_back((id, clone));
                    id
                };
                let e = self.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("dxnet-tcp-hs-{}", self.own.0))
                    .spawn(move || {
                        let slot = HandshakeSlot {
                            slots: &e.handshakes,
                            id,
                        };
                        if let Some(core) = e.core.upgrade() {
                            if let Err(err) = std_stream
                                .set_nonblocking(false)
                                .map_err(|x| x.to_string())
                                .and_then(|_| e.accept_handshake(&core, std_stream, slot))
                            {
                                tracing::info!(
                                    "{}: incoming connection from {from} failed: {err}",
                                    e.own
                                );
                            }
                        } else {
                            drop(slot);
                        }
                        e.pending_handshakes.fetch_sub(1, Ordering::AcqRel);
                    });
                if spawned.is_err() {
                    self.handshakes.lock().pending.retain(|(i, _)| *i != id);
                    self.pending_handshakes.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
    }

    // ----- receive thread ---------------------------------------------------

    /// Body of the two receive threads: the one holding the receive role
    /// receives; the other is the standby (see [`crate::core::inline`]).
    fn recv_thread(self: Arc<Self>, core: Arc<Core>) {
        self.receiver.run(
            &core,
            &self.stop,
            |r| self.receive(&core, r).map_or(Turn::Stop, Turn::Inline),
            |_| {}, // no helpers on TCP: never called
            |_| {}, // `receive` never asks to sleep
            |_| {},
        );
    }

    /// The receive loop, run by the holder of the receive role until the
    /// engine stops (`None`) or a buffer is to be handled inline.
    fn receive(&self, core: &Arc<Core>, r: &mut Receiver) -> Option<InlineWork> {
        let Receiver {
            poll,
            events,
            readable,
            paused,
            idle,
            starved,
        } = r;
        let mut inline = None;
        while !self.stop.load(Ordering::Acquire) {
            let can_read = !readable.is_empty() && !*starved;
            let timeout = if can_read {
                Some(Duration::ZERO)
            } else if idle.step() {
                self.recv_sleeping.store(true, Ordering::SeqCst);
                Some(idle.max_park)
            } else {
                Some(Duration::ZERO)
            };
            let res = poll.poll(events, timeout);
            self.recv_sleeping.store(false, Ordering::SeqCst);
            if let Err(e) = res {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!("{}: receive poll failed: {e}", self.own);
                    return None;
                }
            }
            let mut woke = false;
            for ev in events.iter() {
                if ev.token() == WAKER {
                    woke = true;
                    continue;
                }
                let tc = self.by_token.lock().get(&ev.token().0).cloned();
                if let Some(tc) = tc {
                    let mut rs = tc.recv.lock();
                    if !rs.readable {
                        rs.readable = true;
                        drop(rs);
                        readable.push_back(tc);
                    }
                }
            }
            if woke {
                *starved = false;
                for tc in std::mem::take(&mut *self.kick.lock()) {
                    let mut rs = tc.recv.lock();
                    if !rs.readable {
                        rs.readable = true;
                        drop(rs);
                        readable.push_back(tc);
                    }
                }
            }
            if !paused.is_empty() {
                paused.retain(|tc| {
                    let keep = tc.conn.is_alive() && core.incoming_over_share(&tc.conn);
                    if !keep {
                        readable.push_back(tc.clone());
                    }
                    keep
                });
            }
            if readable.is_empty() {
                if !events.is_empty() {
                    idle.reset();
                }
                continue;
            }
            idle.reset();
            // One buffer per readable connection per round (fairness).
            for _ in 0..readable.len() {
                let Some(tc) = readable.pop_front() else {
                    break;
                };
                match self.read_once(core, &tc, &mut inline) {
                    ReadOutcome::More => readable.push_back(tc),
                    ReadOutcome::Drained => tc.recv.lock().readable = false,
                    ReadOutcome::Starved => {
                        *starved = true;
                        readable.push_front(tc);
                        break;
                    }
                    ReadOutcome::Paused => paused.push(tc),
                    ReadOutcome::Closed => tc.recv.lock().readable = false,
                }
                if inline.is_some() {
                    return inline;
                }
            }
            if *starved {
                // Resources may have come back before the flags were set.
                *starved = !(core.incoming_has_room() && core.recv_buffers_available() > 0);
            }
        }
        None
    }

    fn read_once(
        &self,
        core: &Arc<Core>,
        tc: &TcpConn,
        inline: &mut Option<InlineWork>,
    ) -> ReadOutcome {
        if !tc.conn.is_alive() {
            return ReadOutcome::Closed;
        }
        if !core.incoming_has_room() {
            return ReadOutcome::Starved;
        }
        if core.incoming_over_share(&tc.conn) {
            return ReadOutcome::Paused;
        }
        let Some(mut buf) = core.take_recv_buffer() else {
            return ReadOutcome::Starved;
        };
        if let Some(tls) = &tc.tls {
            return self.read_tls(core, tc, tls, buf, inline);
        }
        let cap = buf.capacity();
        let n = match (&tc.stream).read(buf.space()) {
            Ok(0) => {
                core.return_recv_buffer(buf);
                core.close_connection(&tc.conn, "peer closed the connection", true);
                return ReadOutcome::Closed;
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                core.return_recv_buffer(buf);
                return ReadOutcome::Drained;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {
                core.return_recv_buffer(buf);
                return ReadOutcome::More;
            }
            Err(e) => {
                core.return_recv_buffer(buf);
                core.close_connection(&tc.conn, &format!("receive failed: {e}"), true);
                return ReadOutcome::Closed;
            }
        };
        self.parse_and_deliver(core, tc, buf, n, inline);
        if n < cap {
            // A short read of a stream socket means its queue is empty now;
            // with edge-triggered polling new data raises a new event, so
            // the extra read that would only return EAGAIN is skipped.
            ReadOutcome::Drained
        } else {
            ReadOutcome::More
        }
    }

    /// Marks the message data among the first `n` bytes of `buf` and hands
    /// the buffer to the incoming queue, or to `inline` (at most one buffer
    /// per turn of the receive role).
    fn parse_and_deliver(
        &self,
        core: &Arc<Core>,
        tc: &TcpConn,
        mut buf: RecvBuffer,
        n: usize,
        inline: &mut Option<InlineWork>,
    ) {
        {
            let mut rs = tc.recv.lock();
            let (data, mut segs) = buf.space_and_segments();
            rs.parser
                .parse(&data[..n], |r| segs.push(r), |u| tc.conn.flow.on_confirm(u));
        }
        if inline.is_none() {
            *inline = core.deliver_or_inline(&tc.conn, buf);
        } else {
            core.deliver(&tc.conn, buf);
        }
    }

    /// [`TcpEngine::read_once`] of a TLS connection: decrypted data first,
    /// then more records from the socket until it would block.
    fn read_tls(
        &self,
        core: &Arc<Core>,
        tc: &TcpConn,
        tls: &Mutex<tls::Session>,
        mut buf: RecvBuffer,
        inline: &mut Option<InlineWork>,
    ) -> ReadOutcome {
        let mut t = tls.lock();
        let fail = |t: &mut tls::Session, buf: RecvBuffer, why: String| {
            core.return_recv_buffer(buf);
            // Best effort: tell the peer why (a TLS alert).
            let _ = t.write_tls(&mut &tc.stream);
            core.close_connection(&tc.conn, &why, true);
            ReadOutcome::Closed
        };
        loop {
            match t.reader().read(buf.space()) {
                Ok(0) => {
                    return fail(&mut t, buf, "peer closed the connection (TLS)".into());
                }
                Ok(n) => {
                    let wants_write = t.wants_write();
                    drop(t);
                    if wants_write {
                        core.on_write_interest(tc.conn.peer);
                    }
                    self.parse_and_deliver(core, tc, buf, n, inline);
                    return ReadOutcome::More;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return fail(&mut t, buf, format!("TLS receive failed: {e}")),
            }
            match t.read_tls(&mut &tc.stream) {
                Ok(0) => return fail(&mut t, buf, "peer closed the connection".into()),
                Ok(_) => {
                    if let Err(e) = t.process_new_packets() {
                        return fail(&mut t, buf, format!("TLS error: {e}"));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let wants_write = t.wants_write();
                    drop(t);
                    core.return_recv_buffer(buf);
                    if wants_write {
                        core.on_write_interest(tc.conn.peer);
                    }
                    return ReadOutcome::Drained;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return fail(&mut t, buf, format!("receive failed: {e}")),
            }
        }
    }

    // ----- send thread ---------------------------------------------------------

    fn send_loop(self: Arc<Self>, core: Arc<Core>, mut poll: Poll) {
        let mut events = Events::with_capacity(256);
        let mut idle = Idle::new(core.park());
        while !self.stop.load(Ordering::Acquire) {
            let mut worked = false;
            while let Some(peer) = core.next_write_interest() {
                worked = true;
                let tc = self.by_peer.lock().get(&peer).cloned();
                if let Some(tc) = tc {
                    self.write_some(&core, &tc);
                }
            }
            let timeout = if worked {
                idle.reset();
                Duration::ZERO
            } else if idle.step() {
                self.send_sleeping.store(true, Ordering::SeqCst);
                if core.write_interest_is_empty() {
                    idle.max_park
                } else {
                    Duration::ZERO
                }
            } else {
                Duration::ZERO
            };
            let res = poll.poll(&mut events, Some(timeout));
            self.send_sleeping.store(false, Ordering::SeqCst);
            if let Err(e) = res {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!("{}: send poll failed: {e}", self.own);
                    return;
                }
            }
            for ev in events.iter() {
                if ev.token() == WAKER {
                    continue;
                }
                let tc = self.by_token.lock().get(&ev.token().0).cloned();
                if let Some(tc) = tc {
                    let was_blocked = std::mem::replace(&mut tc.send.lock().blocked, false);
                    if was_blocked {
                        idle.reset();
                        self.write_some(&core, &tc);
                    }
                }
            }
        }
    }

    /// Writes chunks of `tc`'s ring buffer until it is empty, the socket is
    /// full, or the round budget is used up.
    fn write_some(&self, core: &Core, tc: &TcpConn) {
        let mut st = tc.send.lock();
        if self.write_locked(core, tc, &mut st) {
            core.requeue_write_interest(tc.conn.peer.0);
        }
    }

    /// [`TcpEngine::write_some`] with the send state held; returns true if
    /// data is left that the socket would take (round budget used up).
    fn write_locked(&self, core: &Core, tc: &TcpConn, st: &mut SendState) -> bool {
        let conn = &tc.conn;
        if conn.state() != ConnState::Open || st.blocked {
            return false;
        }
        // With TLS, chunks are copied from the ring buffer into rustls
        // (bounded by its buffer limit, so a chunk counts as sent once
        // rustls holds it) and its records written out, pending records
        // before new data.
        let mut tls = tc.tls.as_ref().map(|t| t.lock());
        for _ in 0..SEND_ROUNDS {
            if let Some(t) = tls.as_deref_mut() {
                if let Err(e) = flush_tls(t, &tc.stream) {
                    self.write_failed(core, conn, st, e);
                    return false;
                }
            }
            if st.header_off == CHUNK_HEADER_LEN && st.data_left == 0 {
                let units = conn.flow.take_units(u32::MAX);
                let avail = conn.orb.unposted_len().min(MAX_CHUNK);
                let poke = tc.poke.swap(false, Ordering::AcqRel);
                if avail == 0 && units == 0 && !poke {
                    return false;
                }
                st.header = encode_chunk_header(avail as u32, units);
                st.header_off = 0;
                st.data_left = avail;
            }
            // SAFETY: the caller holds the send state, so it is the ring's
            // only consumer; the slices are written out (or copied into
            // rustls) before `mark_completed` frees them.
            let (a, b) = unsafe { conn.orb.unposted(st.data_left) };
            let hdr = &st.header[st.header_off..];
            let iov = [IoSlice::new(hdr), IoSlice::new(a), IoSlice::new(b)];
            let written = match tls.as_deref_mut() {
                None => (&tc.stream).write_vectored(&iov),
                Some(t) => t.writer().write_vectored(&iov),
            };
            match written {
                Ok(n) => {
                    let h = n.min(hdr.len());
                    st.header_off += h;
                    let d = n - h;
                    if d > 0 {
                        conn.orb.mark_posted(d);
                        conn.orb.mark_completed(d);
                        st.data_left -= d;
                    }
                }
                Err(e) => {
                    if !self.write_failed(core, conn, st, e) {
                        return false;
                    }
                }
            }
        }
        if let Some(t) = tls.as_deref_mut() {
            if let Err(e) = flush_tls(t, &tc.stream) {
                self.write_failed(core, conn, st, e);
                return false;
            }
        }
        // Budget used: come back after the other connections.
        st.data_left > 0
            || st.header_off < CHUNK_HEADER_LEN
            || conn.orb.unposted_len() > 0
            || conn.flow.pending_units() > 0
    }

    /// Handles a failed write: a full socket waits for a writable event,
    /// an interrupted call is retried (true), anything else closes the
    /// connection.
    fn write_failed(
        &self,
        core: &Core,
        conn: &Arc<Connection>,
        st: &mut SendState,
        e: std::io::Error,
    ) -> bool {
        match e.kind() {
            std::io::ErrorKind::WouldBlock => st.blocked = true,
            std::io::ErrorKind::Interrupted => return true,
            _ => core.close_connection(conn, &format!("send failed: {e}"), true),
        }
        false
    }
}

enum ReadOutcome {
    /// Read a buffer; there may be more.
    More,
    /// The socket has no more data now.
    Drained,
    /// No receive buffer or queue room: stop until woken.
    Starved,
    /// The connection holds its share of the incoming queue: read the others
    /// until handlers drained it.
    Paused,
    /// The connection closed.
    Closed,
}

/// Writes a TLS connection's pending records to its socket.
fn flush_tls(t: &mut tls::Session, mut stream: &TcpStream) -> std::io::Result<()> {
    while t.wants_write() {
        match t.write_tls(&mut stream) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_msg(s: &mut impl Write, m: &HandshakeMsg) -> std::io::Result<()> {
    s.write_all(&m.encode())?;
    s.flush()
}

fn read_msg(s: &mut impl Read) -> std::result::Result<HandshakeMsg, String> {
    let mut b = [0u8; HANDSHAKE_LEN];
    s.read_exact(&mut b)
        .map_err(|e| format!("handshake read: {e}"))?;
    HandshakeMsg::decode(&b).map_err(|e| e.to_string())
}

impl Transport for TcpEngine {
    fn connect(&self, conn: &Arc<Connection>, deadline: Instant) -> Result<()> {
        let core = self.core.upgrade().ok_or(Error::Shutdown)?;
        let peer = conn.peer;
        let addr = core.config().address_of(peer).ok_or(Error::Unreachable(
            peer,
            crate::error::Unreachable::NotInNodeMap,
        ))?;
        let addr = resolve(addr).map_err(|e| cannot_connect(peer, e.to_string()))?;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(cannot_connect(peer, "connection not established in time"));
            }
            let mut s = TcpStream::connect_timeout(&addr, left)
                .map_err(|e| cannot_connect(peer, format!("connect to {addr}: {e}")))?;
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
                    if theirs.instance == 0 {
                        return Err(cannot_connect(peer, "peer sent instance id 0"));
                    }
                    return self
                        .attach(&core, conn, s, tls_conn, &theirs)
                        .map_err(|e| cannot_connect(peer, e));
                }
                Err(DialFailure::Rejected(Status::Duplicate)) => {
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
                Err(e) => return Err(cannot_connect(peer, e.to_string())),
            }
        }
    }

    fn close(&self, conn: &Arc<Connection>) {
        let tc = {
            let mut by_peer = self.by_peer.lock();
            match by_peer.get(&conn.peer.0) {
                Some(t) if t.conn.id == conn.id => by_peer.remove(&conn.peer.0),
                _ => None,
            }
        };
        self.by_token.lock().remove(&(conn.id as usize));
        if let Some(tc) = tc {
            let fd = tc.stream.as_raw_fd();
            let _ = self.recv_registry.deregister(&mut SourceFd(&fd));
            let _ = self.send_registry.deregister(&mut SourceFd(&fd));
            let _ = tc.stream.shutdown(std::net::Shutdown::Both);
        }
    }

    fn try_flush(&self, peer: NodeId) -> bool {
        if !self.send_sleeping.load(Ordering::Acquire) {
            return false; // the send thread is awake and aggregates
        }
        let Some(core) = self.core.upgrade() else {
            return false;
        };
        let Some(tc) = self.by_peer.lock().get(&peer.0).cloned() else {
            return false;
        };
        let Some(mut st) = tc.send.try_lock() else {
            return false;
        };
        if self.write_locked(&core, &tc, &mut st) {
            drop(st);
            if core.requeue_write_interest(peer.0) {
                self.wake_sender();
            }
        }
        true
    }

    fn wake_sender(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.send_sleeping.load(Ordering::SeqCst) {
            let _ = self.send_waker.wake();
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
        let me = std::thread::current().id();
        for t in std::mem::take(&mut *self.threads.lock()) {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}
