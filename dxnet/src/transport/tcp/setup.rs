//! Connection set-up: the dialer's and the acceptor's handshake (TLS
//! first when configured), the listener thread and its bounded handshake
//! slots, and attaching an authenticated socket to its connection.

use super::*;

/// Why the dialer's side of a handshake failed: the peer's decision (which
/// the caller acts on) or anything else (reported as text).
#[derive(Debug)]
pub(super) enum DialFailure {
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

impl TcpEngine {
    /// Dialer side of the handshake; returns the acceptor's hello.
    pub(super) fn dial_handshake<S: Read + Write>(
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
    pub(super) fn accept_handshake(
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
    pub(super) fn accept_exchange<S: Read + Write>(
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
    pub(super) fn old_connection_gone(
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
    pub(super) fn attach(
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

    pub(super) fn listen_loop(self: Arc<Self>, listener: mio::net::TcpListener, mut poll: Poll) {
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
}

pub(super) fn write_msg(s: &mut impl Write, m: &HandshakeMsg) -> std::io::Result<()> {
    s.write_all(&m.encode())?;
    s.flush()
}

pub(super) fn read_msg(s: &mut impl Read) -> std::result::Result<HandshakeMsg, String> {
    let mut b = [0u8; HANDSHAKE_LEN];
    s.read_exact(&mut b)
        .map_err(|e| format!("handshake read: {e}"))?;
    HandshakeMsg::decode(&b).map_err(|e| e.to_string())
}
