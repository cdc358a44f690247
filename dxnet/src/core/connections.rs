//! The connection manager: open on first use, accept, least-recently-used
//! closing, failures.

use super::*;

impl Core {
    /// The open connection to `dest`, creating it on first use. Waits at most
    /// until `deadline` (and the connect timeout) for it to open.
    pub fn connection(&self, dest: NodeId, deadline: Instant) -> Result<Arc<Connection>> {
        // Read the clock only when the connection is not open yet.
        let connect_deadline = || {
            deadline
                .min(Instant::now() + Duration::from_millis(self.config.limits.connect_timeout_ms))
        };
        // Dials refused because the peer does not know this node yet (it
        // answered, but discovery found it from its side first: it learns
        // of this node from this node's answer or next probe) are made
        // again until the connect timeout, pausing 5 ms doubling to 100 ms;
        // `refused` holds until when and the next pause.
        let mut refused: Option<(Instant, Duration)> = None;
        let mut dial_again = |c: &Connection| {
            if !(c.refused_as_unknown() && self.membership.discovery()) {
                return false;
            }
            let (until, pause) =
                *refused.get_or_insert_with(|| (connect_deadline(), Duration::from_millis(5)));
            if Instant::now() + pause >= until {
                return false;
            }
            tracing::debug!(
                "{}: node {dest} does not know this node yet; dialing again",
                self.own
            );
            std::thread::sleep(pause);
            refused = Some((until, (pause * 2).min(Duration::from_millis(100))));
            true
        };
        loop {
            if let Some(c) = self.connections.get(dest) {
                match c.state() {
                    ConnState::Open => return Ok(c),
                    ConnState::Connecting => {
                        inline::before_blocking();
                        c.state_changed
                            .wait_until(&self.config.park, connect_deadline(), || {
                                c.state() != ConnState::Connecting
                            });
                        match c.state() {
                            ConnState::Open => return Ok(c),
                            ConnState::Connecting => {
                                return Err(Error::Unreachable(
                                    dest,
                                    Unreachable::Connect(
                                        "connection not established in time".into(),
                                    ),
                                ))
                            }
                            ConnState::Closed if dial_again(&c) => continue,
                            ConnState::Closed => {
                                return Err(Error::Unreachable(
                                    dest,
                                    Unreachable::ConnectionLost(c.close_reason()),
                                ))
                            }
                        }
                    }
                    ConnState::Closed => {} // being removed; create a new one
                }
            }
            if self.is_shut_down() {
                return Err(Error::Shutdown);
            }
            match self.membership.dialable(dest) {
                Ok(()) => {}
                // Loopback nodes need no node-map entry.
                Err(Unreachable::NotInNodeMap)
                    if self.config.transport == TransportKind::Loopback => {}
                Err(cause) => return Err(Error::Unreachable(dest, cause)),
            }
            let Some(conn) = self.create_connection(dest, None)? else {
                continue; // somebody else created it meanwhile
            };
            inline::before_blocking(); // connecting blocks on the network
            let Some(t) = self.transport() else {
                return Err(Error::Shutdown);
            };
            match t.connect(&conn, connect_deadline()) {
                Ok(()) if conn.state() == ConnState::Open => {
                    // Removed while connecting: the removal may have missed
                    // this connection.
                    if let Err(Unreachable::Removed) = self.address_of(dest) {
                        self.close_connection_with(
                            &conn,
                            "node removed",
                            Some(Unreachable::Removed),
                        );
                        return Err(Error::Unreachable(dest, Unreachable::Removed));
                    }
                    tracing::debug!("{}: connected to {dest}", self.own);
                    return Ok(conn);
                }
                Ok(()) => {
                    return Err(Error::Unreachable(
                        dest,
                        Unreachable::Connect(conn.close_reason()),
                    ))
                }
                Err(e) => {
                    let cause = match e {
                        Error::Unreachable(_, cause) => cause,
                        other => Unreachable::Connect(other.to_string()),
                    };
                    self.close_connection(&conn, cause.detail(), true);
                    if dial_again(&conn) {
                        continue;
                    }
                    if !conn.refused_as_unknown() {
                        // Probed again before the next attempt (a peer that
                        // refused this node answered its probes).
                        self.membership.lost(dest);
                    }
                    return Err(Error::Unreachable(dest, cause));
                }
            }
        }
    }

    /// Creates and installs a connection to `peer` in state Connecting,
    /// closing the least recently used one if the limit is reached. Returns
    /// `None` if a live connection exists (and `replace` is not it).
    pub(super) fn create_connection(
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
            if *count >= self.config.limits.max_connections {
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
            let rings = self.transport().map_or(1, |t| t.rings());
            let conn = Connection::new(
                peer,
                self.connections.next_id(),
                (self.config.limits.orb_size, rings),
                FlowControl::new(self.fc_window, self.fc_unit),
                self.config.limits.max_message_size,
                self.config
                    .metrics
                    .per_connection
                    .then(|| self.stats.sent.take_slot()),
            );
            conn.touch(self.tick(Instant::now()));
            if let Some(t) = self.transport() {
                for r in conn.rings() {
                    let t = Arc::downgrade(t);
                    r.on_blocked(Box::new(move || {
                        if let Some(t) = t.upgrade() {
                            t.wake_sender();
                        }
                    }));
                }
            }
            // Messages on the new connection wait for those the previous
            // one (closed, or being replaced) still has to handle.
            if let Some(prev) = self.connections.succeed(&conn) {
                prev.inbox.lock().hold_successor(&conn);
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
            // An authenticated peer is alive: discovered, if discovery had
            // not found it yet (it found this node first).
            if self.membership.connected(conn.peer) {
                self.emit(crate::events::ConnectionEvent::Discovered { node: conn.peer });
            }
            self.emit_opened(conn.peer, peer_instance);
        }
        ok
    }

    /// Closes `conn`: removes it, tells the transport, fails its pending
    /// requests (`failed`: with "destination unreachable", otherwise
    /// "cancelled"). Idempotent.
    pub fn close_connection(&self, conn: &Arc<Connection>, reason: &str, failed: bool) {
        let cause = failed.then(|| Unreachable::ConnectionLost(reason.to_string()));
        self.close_connection_with(conn, reason, cause);
    }

    /// [`Core::close_connection`] failing pending requests with `cause`
    /// (`None`: cancelled).
    pub fn close_connection_with(
        &self,
        conn: &Arc<Connection>,
        reason: &str,
        cause: Option<Unreachable>,
    ) {
        let failed = cause.is_some();
        let Some(was) = conn.close(reason) else {
            return;
        };
        if conn.counters.is_some() {
            self.stats.sent.give_slot(conn.sent_slot);
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
        let err = match cause {
            Some(cause) => Error::Unreachable(conn.peer, cause),
            None => Error::Cancelled(Cancelled::ConnectionClosed),
        };
        // A dial the peer refused as from a node it does not know yet is
        // repeated (see `connection`): the requests waiting for it stay.
        if !(was == ConnState::Connecting && conn.refused_as_unknown()) {
            self.requests.fail_peer(conn.peer, &err);
        }
        if was == ConnState::Open
            && failed
            && !matches!(err, Error::Unreachable(_, Unreachable::Removed))
        {
            // Back to the nodes discovery probes.
            self.membership.lost(conn.peer);
        }
        if was == ConnState::Open {
            // Counted as opened: a connection that never opened (a refused
            // connect) is neither.
            self.stats.connections_closed.add(1);
            self.peer_history.lock().closed(conn, reason, failed);
            if self.stats.sent.any_moved() {
                let live: std::collections::HashSet<u64> =
                    self.connections.all().iter().map(|c| c.id).collect();
                self.stats.sent.retain(|id| live.contains(&id));
            }
            self.emit(match err {
                Error::Unreachable(_, cause) => crate::events::ConnectionEvent::Lost {
                    node: conn.peer,
                    cause,
                },
                _ => crate::events::ConnectionEvent::Closed {
                    node: conn.peer,
                    reason: reason.to_string(),
                },
            });
        }
    }
}
