//! Connection set-up: queue pairs, the signed UDP exchange of their
//! endpoints (the connection thread), and opening a connection once both
//! sides are ready.

use super::*;

impl IbEngine {
    pub(super) fn secret(&self) -> Option<&[u8]> {
        self.secret.as_deref()
    }

    /// A queue pair for `conn` in state INIT, its ring buffer registered.
    pub(super) fn create_ibconn(
        &self,
        conn: &Arc<Connection>,
    ) -> std::result::Result<Arc<IbConn>, String> {
        let create = |max_inline_data| {
            self.pd.create_rc_qp(&ibv::QpInit {
                send_cq: &self.send_cq,
                recv_cq: &self.recv_cq,
                srq: Some(&self.srq),
                caps: ibv::QpCaps {
                    max_send_wr: self.sq_size,
                    max_recv_wr: 1,
                    max_send_sge: 2,
                    max_recv_sge: 1,
                    max_inline_data,
                },
                sq_sig_all: false,
            })
        };
        let qp = match create(self.max_inline_data) {
            Ok(qp) => qp,
            Err(e) if self.max_inline_data > 0 => {
                tracing::debug!(
                    "{}: no queue pair with {} bytes of inline data ({e}); without",
                    self.own,
                    self.max_inline_data
                );
                create(0).map_err(|e| e.to_string())?
            }
            Err(e) => return Err(e.to_string()),
        };
        qp.to_init(self.attr.port, self.attr.access)
            .map_err(|e| e.to_string())?;
        // SAFETY: the ring buffer's memory never moves and lives as long as
        // `conn`, which the IbConn (and so the registration) keeps alive.
        let orb_mr = unsafe {
            self.pd.register_raw(
                conn.orb.base_ptr(),
                conn.orb.capacity(),
                ibv::AccessFlags::LOCAL_WRITE,
            )
        }
        .map_err(|e| e.to_string())?;
        let consumer = conn
            .orb
            .consumer()
            .ok_or("the connection's ring buffer already has a consumer")?;
        let local = ibv::Endpoint::local(
            &self.ctx,
            &qp,
            self.attr.port,
            self.gid_index,
            self.attr.local_psn,
        )
        .map_err(|e| e.to_string())?;
        Ok(Arc::new(IbConn {
            conn: conn.clone(),
            max_inline: qp.caps().max_inline_data.min(self.max_inline_data) as usize,
            qp,
            orb_mr,
            local,
            remote: Mutex::new(None),
            send: Mutex::new(SendState {
                consumer,
                outstanding: 0,
                chains: VecDeque::new(),
                chain: ibv::SendChain::with_capacity(
                    self.sq_size as usize,
                    2 * self.sq_size as usize,
                ),
            }),
        }))
    }

    pub(super) fn exchange(
        &self,
        core: &Core,
        kind: ExchangeKind,
        dst: u16,
        local: &ibv::Endpoint,
    ) -> Exchange {
        let mut endpoint = [0u8; ENDPOINT_LEN];
        endpoint.copy_from_slice(&local.to_bytes());
        Exchange {
            kind,
            src: self.own.0,
            dst,
            instance: core.instance,
            fc_window: core.fc_window.min(u32::MAX as u64) as u32,
            fc_unit: core.fc_unit.min(u32::MAX as u64) as u32,
            endpoint,
            nonce: rand::random(),
        }
    }

    pub(super) fn send_exchange(&self, core: &Core, peer: NodeId, x: &Exchange) {
        let Some(addr) = core.config().address_of(peer).and_then(|a| resolve(a).ok()) else {
            return;
        };
        if let Err(e) = self
            .udp
            .send_to(&x.encode(self.secret(), core.identity.as_ref()), addr)
        {
            tracing::debug!("{}: exchange datagram to {peer} failed: {e}", self.own);
        }
    }

    /// Connects `ic`'s queue pair to the peer's (RTR, RTS) and makes it
    /// known to the send and receive threads.
    pub(super) fn connect_qp(
        &self,
        ic: &Arc<IbConn>,
        x: &Exchange,
    ) -> std::result::Result<(), String> {
        let remote = ibv::Endpoint::from_bytes(&x.endpoint).map_err(|e| e.to_string())?;
        ic.qp
            .to_rtr(&self.attr, &remote)
            .map_err(|e| e.to_string())?;
        ic.qp.to_rts(&self.attr).map_err(|e| e.to_string())?;
        *ic.remote.lock() = Some(remote);
        self.by_qpn.lock().insert(ic.qp.qp_num(), ic.clone());
        let attached = ic.conn.attach_engine(ic);
        debug_assert!(attached, "a connection's queue pair is connected once");
        if !ic.conn.is_alive() {
            // Closed meanwhile (marked closed before `Transport::close`
            // runs): that close may have found nothing to release yet.
            // Releasing twice is harmless (the table entry goes once).
            self.close(&ic.conn);
            return Err("connection closed during set-up".into());
        }
        Ok(())
    }

    /// Opens the connection: data may flow.
    pub(super) fn open(
        &self,
        core: &Core,
        ic: &IbConn,
        x: &Exchange,
    ) -> std::result::Result<(), String> {
        if !core.opened(&ic.conn, x.instance, x.fc_window as u64, x.fc_unit as u64) {
            return Err("connection closed during set-up".into());
        }
        core.on_write_interest(ic.conn.peer);
        Ok(())
    }

    pub(super) fn is_remote(ic: &IbConn, x: &Exchange) -> bool {
        ic.remote
            .lock()
            .is_some_and(|r| r.to_bytes()[..] == x.endpoint[..])
    }

    // ----- connection thread ------------------------------------------------

    pub(super) fn connection_loop(self: Arc<Self>, jobs: Receiver<Job>) {
        let mut buf = [0u8; 2 * wire::EXCHANGE_LEN];
        let mut lingering: VecDeque<(Instant, Arc<IbConn>)> = VecDeque::new();
        let mut last_retry = Instant::now();
        while !self.stop.load(Ordering::Acquire) {
            let Some(core) = self.core.upgrade() else {
                return;
            };
            while let Ok(job) = jobs.try_recv() {
                match job {
                    Job::Create(conn) => self.job_create(&core, &conn),
                    Job::Close(ic) => {
                        let x =
                            self.exchange(&core, ExchangeKind::Close, ic.conn.peer.0, &ic.local);
                        self.send_exchange(&core, ic.conn.peer, &x);
                        lingering.push_back((Instant::now() + CLOSE_LINGER, ic));
                    }
                }
            }
            while lingering.front().is_some_and(|(t, _)| *t <= Instant::now()) {
                lingering.pop_front();
            }
            if last_retry.elapsed() >= REQUEST_RETRY {
                last_retry = Instant::now();
                let pending: Vec<_> = self.pending.lock().values().cloned().collect();
                for ic in pending {
                    if ic.conn.state() == ConnState::Connecting {
                        let x =
                            self.exchange(&core, ExchangeKind::Request, ic.conn.peer.0, &ic.local);
                        self.send_exchange(&core, ic.conn.peer, &x);
                    } else {
                        self.pending.lock().remove(&ic.conn.peer.0);
                    }
                }
                let awaiting: Vec<_> = self.awaiting.lock().values().cloned().collect();
                for (ic, _) in awaiting {
                    if ic.conn.state() == ConnState::Connecting {
                        let a =
                            self.exchange(&core, ExchangeKind::Accept, ic.conn.peer.0, &ic.local);
                        self.send_exchange(&core, ic.conn.peer, &a);
                    } else {
                        self.awaiting.lock().remove(&ic.conn.peer.0);
                    }
                }
            }
            match self.udp.recv_from(&mut buf) {
                Ok((n, from)) => {
                    match Exchange::decode(&buf[..n], self.secret(), core.identity.as_ref()) {
                        Ok(x) if x.dst == self.own.0 => self.on_exchange(&core, &x),
                        Ok(x) => tracing::info!(
                            "{}: exchange for node {} from {from} ignored",
                            self.own,
                            x.dst
                        ),
                        Err(e) => {
                            tracing::warn!("{}: bad exchange datagram from {from}: {e}", self.own)
                        }
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => {
                    tracing::warn!("{}: exchange socket: {e}", self.own);
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    pub(super) fn job_create(&self, core: &Core, conn: &Arc<Connection>) {
        if conn.state() != ConnState::Connecting || conn.engine::<IbConn>().is_some() {
            return; // the peer's request got there first
        }
        match self.create_ibconn(conn) {
            Ok(ic) => {
                let x = self.exchange(core, ExchangeKind::Request, conn.peer.0, &ic.local);
                self.pending.lock().insert(conn.peer.0, ic);
                self.send_exchange(core, conn.peer, &x);
            }
            Err(e) => {
                tracing::warn!(
                    "{}: cannot create a queue pair for {}: {e}",
                    self.own,
                    conn.peer
                );
                conn.close(&format!("queue pair creation failed: {e}"));
            }
        }
    }

    pub(super) fn on_exchange(&self, core: &Arc<Core>, x: &Exchange) {
        let peer = NodeId(x.src);
        if core.config().address_of(peer).is_none() || x.src == self.own.0 {
            tracing::warn!("{}: exchange from unknown node {} ignored", self.own, x.src);
            return;
        }
        match x.kind {
            ExchangeKind::Request => {
                // A repeated request for a queue pair we already connected:
                // answer again (our accept was lost).
                if let Some(ic) = core.engine_half::<IbConn>(peer) {
                    if Self::is_remote(&ic, x) && ic.conn.is_alive() {
                        let a = self.exchange(core, ExchangeKind::Accept, x.src, &ic.local);
                        self.send_exchange(core, peer, &a);
                        return;
                    }
                }
                let conn = match core.accept_incoming(peer, x.instance) {
                    Ok(c) => c,
                    Err(Status::Duplicate) => return, // our own request wins
                    Err(s) => {
                        tracing::info!("{}: connection request from {peer} refused: {s}", self.own);
                        return;
                    }
                };
                // Reuse the queue pair of our own pending request, if any.
                let ic = match self.pending.lock().remove(&x.src) {
                    Some(ic) if ic.conn.id == conn.id => Ok(ic),
                    _ => self.create_ibconn(&conn),
                };
                let res = ic.and_then(|ic| {
                    self.connect_qp(&ic, x)?;
                    // Data may flow only once the requester's queue pair is
                    // connected too: it says so with "ready" (or by sending).
                    self.awaiting.lock().insert(x.src, (ic.clone(), *x));
                    let a = self.exchange(core, ExchangeKind::Accept, x.src, &ic.local);
                    self.send_exchange(core, peer, &a);
                    Ok(())
                });
                if let Err(e) = res {
                    core.close_connection(&conn, &format!("connection set-up failed: {e}"), true);
                }
            }
            ExchangeKind::Accept => {
                let ic = self.pending.lock().remove(&x.src);
                match ic {
                    Some(ic) if ic.conn.state() == ConnState::Connecting => {
                        let res = self
                            .connect_qp(&ic, x)
                            .and_then(|_| self.open(core, &ic, x));
                        match res {
                            Ok(()) => {
                                let r = self.exchange(core, ExchangeKind::Ready, x.src, &ic.local);
                                self.send_exchange(core, peer, &r);
                            }
                            Err(e) => core.close_connection(
                                &ic.conn,
                                &format!("connection set-up failed: {e}"),
                                true,
                            ),
                        }
                    }
                    _ => {
                        // A repeated accept: our "ready" was lost.
                        let ic = core.engine_half::<IbConn>(peer);
                        if let Some(ic) = ic.filter(|ic| Self::is_remote(ic, x)) {
                            let r = self.exchange(core, ExchangeKind::Ready, x.src, &ic.local);
                            self.send_exchange(core, peer, &r);
                        }
                    }
                }
            }
            ExchangeKind::Ready => self.on_ready(core, x.src, Some(&x.endpoint)),
            ExchangeKind::Close => {
                let ic = core.engine_half::<IbConn>(peer);
                if let Some(ic) = ic {
                    let ours = ic
                        .remote
                        .lock()
                        .is_some_and(|r| r.to_bytes()[..] == x.endpoint[..]);
                    if ours {
                        core.close_connection(&ic.conn, "peer closed the connection", true);
                    }
                }
            }
        }
    }

    /// The requester's queue pair is connected (it said so, or its data
    /// arrived): open the accepted connection.
    pub(super) fn on_ready(&self, core: &Core, src: u16, endpoint: Option<&[u8; ENDPOINT_LEN]>) {
        let entry = {
            let mut aw = self.awaiting.lock();
            match aw.get(&src) {
                Some((ic, x))
                    if endpoint.map_or(true, |e| {
                        Self::is_remote(ic, &Exchange { endpoint: *e, ..*x })
                    }) =>
                {
                    aw.remove(&src)
                }
                _ => None,
            }
        };
        if let Some((ic, x)) = entry {
            if let Err(e) = self.open(core, &ic, &x) {
                core.close_connection(&ic.conn, &format!("connection set-up failed: {e}"), true);
            }
        }
    }
}
