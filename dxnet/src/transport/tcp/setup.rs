//! Connection set-up: the dialer's and the acceptor's handshake (TLS
//! first when configured), the listener thread and its bounded handshake
//! slots, and attaching an authenticated socket to its connection.

use super::*;

/// Why this side of a handshake failed: the protocol's typed error (which
/// the caller may act on, e.g. [`Status::Duplicate`]) or an I/O error.
#[derive(Debug)]
pub(super) enum SetupFailure {
    Protocol(HandshakeError),
    Io(String),
}

impl From<HandshakeError> for SetupFailure {
    fn from(e: HandshakeError) -> Self {
        Self::Protocol(e)
    }
}

impl std::fmt::Display for SetupFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Protocol(e) => write!(f, "{e}"),
            Self::Io(e) => f.write_str(e),
        }
    }
}

/// Sends what the handshake has queued.
fn flush<S: Write>(hs: &mut Handshake<'_>, s: &mut S) -> Result<(), SetupFailure> {
    let mut wrote = false;
    while let Some(m) = hs.poll_transmit() {
        s.write_all(&m)
            .map_err(|e| SetupFailure::Io(format!("handshake write: {e}")))?;
        wrote = true;
    }
    if wrote {
        s.flush()
            .map_err(|e| SetupFailure::Io(format!("handshake write: {e}")))?;
    }
    Ok(())
}

/// Runs `hs` over a blocking stream (its read and write timeouts bound the
/// wait) until it hands back an event or fails; on failure the peer still
/// gets what the handshake has to tell it. Reads at most the rest of the
/// expected message, so nothing of the data that follows is taken, and
/// feeds every read at once (a peer of another version is recognized from
/// the start of its message, whatever its length).
fn drive<S: Read + Write>(hs: &mut Handshake<'_>, s: &mut S) -> Result<Event, SetupFailure> {
    let mut b = [0u8; HANDSHAKE_LEN];
    loop {
        flush(hs, s)?;
        let want = hs.wants_read();
        if want == 0 {
            return Err(SetupFailure::Io("handshake already over".into()));
        }
        let n = loop {
            match s.read(&mut b[..want]) {
                Ok(0) => {
                    return Err(SetupFailure::Io(
                        "handshake read: the peer closed the connection".into(),
                    ))
                }
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(SetupFailure::Io(format!("handshake read: {e}"))),
            }
        };
        match hs.read(&b[..n]) {
            Ok(Progress {
                event: Some(ev), ..
            }) => return Ok(ev),
            Ok(_) => {}
            Err(e) => {
                let _ = flush(hs, s);
                return Err(e.into());
            }
        }
    }
}

impl TcpEngine {
    fn credentials<'a>(&'a self, core: &'a Core) -> Credentials<'a> {
        Credentials {
            secret: self.secret(),
            identity: core.identity.as_ref(),
        }
    }

    /// Dialer side of the handshake; returns the acceptor's hello.
    pub(super) fn dial_handshake<S: Read + Write>(
        &self,
        core: &Core,
        s: &mut S,
        peer: NodeId,
    ) -> std::result::Result<Hello, SetupFailure> {
        let mut hs = Handshake::dialer(
            self.credentials(core),
            core.hello(peer.0, [0; ENDPOINT_LEN]),
        );
        loop {
            match drive(&mut hs, s)? {
                // Nothing to set up before the proof goes out.
                Event::Verified(_) => {}
                Event::Established(theirs) => return Ok(theirs),
                other => return Err(SetupFailure::Io(format!("dialer got {other:?}"))),
            }
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
        let timeout = Duration::from_millis(core.config().limits.connect_timeout_ms);
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
        let mut hs = Handshake::acceptor(self.credentials(core), core.hello(0, [0; ENDPOINT_LEN]));
        let failed = |hs: &Handshake<'_>, e: SetupFailure| match hs.peer() {
            Some(h) => format!("rejected node {}: {e}", h.node_id),
            None => e.to_string(),
        };
        let reject = |hs: &mut Handshake<'_>, s: &mut S, st: Status, why: String| {
            hs.reject(st);
            let _ = flush(hs, s);
            Err(format!(
                "rejected node {}: {why}",
                hs.peer().map_or(0, |h| h.node_id)
            ))
        };
        let theirs = match drive(&mut hs, s) {
            Ok(Event::Introduced(h)) => h,
            Ok(other) => return Err(format!("acceptor got {other:?}")),
            Err(e) => return Err(failed(&hs, e)),
        };
        let peer = NodeId(theirs.node_id);
        if core.address_of(peer).is_err() {
            return reject(
                &mut hs,
                s,
                Status::UnknownNode,
                Status::UnknownNode.to_string(),
            );
        }
        if let Err(e) = identity(peer) {
            return reject(&mut hs, s, Status::AuthFailed, e);
        }
        hs.admit();
        let theirs = match drive(&mut hs, s) {
            Ok(Event::Authenticated(h)) => h,
            Ok(other) => return Err(format!("acceptor got {other:?}")),
            Err(e) => return Err(failed(&hs, e)),
        };
        if !self.old_connection_gone(core, peer, theirs.instance, timeout / 2) {
            return reject(&mut hs, s, Status::Duplicate, Status::Duplicate.to_string());
        }
        let conn = match core.accept_incoming(peer, theirs.instance) {
            Ok(c) => c,
            Err(st) => return reject(&mut hs, s, st, st.to_string()),
        };
        hs.accept();
        if let Err(e) = flush(&mut hs, s) {
            let why = e.to_string();
            core.close_connection(&conn, &why, true);
            return Err(why);
        }
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
        if let Some(tc) = old.engine::<TcpConn>() {
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
        let consumers = conn
            .rings()
            .map(|r| r.consumer())
            .collect::<Option<Box<[Consumer]>>>()
            .ok_or("the connection's ring buffer already has a consumer")?;
        let lent = RingNotes::new(consumers.len());
        let token = Token(conn.id as usize);
        let tc = Arc::new(TcpConn {
            conn: conn.clone(),
            stream: s,
            send: Mutex::new(SendState {
                consumers,
                ring: 0,
                cut: false,
                header: [0; CHUNK_HEADER_LEN],
                header_off: CHUNK_HEADER_LEN,
                data_left: 0,
                blocked: false,
                last_write: None,
                last_len: 0,
                lent: VecDeque::new(),
                lent_off: 0,
                lent_left: 0,
            }),
            recv: Mutex::new(RecvState::new(tls_conn.is_some())),
            poke: AtomicBool::new(false),
            urgent: AtomicBool::new(false),
            read_closed: AtomicBool::new(false),
            tls: tls_conn.map(Mutex::new),
            lent,
            read: ReadLease::new(),
            polled: Mutex::new(lease::Polled::default()),
        });
        if !conn.attach_engine(&tc) {
            return Err("connection already attached".into());
        }
        self.by_token.lock().insert(token.0, tc.clone());
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
        // The handshake threads, each counted until joined (until the OS
        // released it), so at most `max_handshake_threads` exist at once
        // however fast a flood of connections ends and replaces them.
        let mut hs_threads: Vec<std::thread::JoinHandle<()>> = Vec::new();
        let reap = |hs: &mut Vec<std::thread::JoinHandle<()>>| {
            let mut i = 0;
            while i < hs.len() {
                if hs[i].is_finished() {
                    let _ = hs.swap_remove(i).join();
                } else {
                    i += 1;
                }
            }
        };
        while !self.stop.load(Ordering::Acquire) {
            if let Err(e) = poll.poll(&mut events, Some(Duration::from_millis(500))) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!("{}: listener poll failed: {e}", self.own);
                    return;
                }
            }
            reap(&mut hs_threads);
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
                if hs_threads.len() >= self.max_handshake_threads {
                    reap(&mut hs_threads);
                }
                if hs_threads.len() >= self.max_handshake_threads {
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
                    continue;
                };
                let id = {
                    let mut sl = self.handshakes.lock();
                    if sl.pending.len() >= self.max_pending_handshakes {
                        if let Some((_, oldest)) = sl.pending.pop_front() {
                            let peer = oldest.peer_addr().ok();
                            let _ = oldest.shutdown(std::net::Shutdown::Both);
                            tracing::warn!(
                                "{}: {} handshakes in progress; cut off the oldest (from {peer:?}) for {from}",
                                self.own,
                                self.max_pending_handshakes
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
                    });
                match spawned {
                    Ok(h) => hs_threads.push(h),
                    Err(_) => self.handshakes.lock().pending.retain(|(i, _)| *i != id),
                }
            }
        }
    }
}
