//! Connection set-up, the queue-pair side: creating a queue pair, tying it
//! to a connection (ring registration, consumer role), connecting it to the
//! peer's, opening the connection, giving up a half that did not open, and
//! close notices. The handshake that decides all this runs on the
//! connection thread (`handshake.rs`).

use super::*;
use crate::proto::wire::{CloseNotice, Hello};

/// A queue pair in state INIT, not yet tied to a connection.
pub(super) struct NewQp {
    pub(super) qp: ibv::QueuePair,
    pub(super) local: ibv::Endpoint,
}

impl IbEngine {
    pub(super) fn secret(&self) -> Option<&[u8]> {
        self.secret.as_deref()
    }

    /// A queue pair in state INIT.
    pub(super) fn create_qp(&self) -> std::result::Result<NewQp, String> {
        let create = |max_inline_data| {
            self.pd.create_rc_qp(&ibv::QpInit {
                send_cq: &self.send_cq,
                recv_cq: &self.recv_cq,
                srq: Some(&self.srq),
                caps: ibv::QpCaps {
                    max_send_wr: self.sq_size + self.rdma_depth,
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
        let local = ibv::Endpoint::local(
            &self.ctx,
            &qp,
            self.attr.port,
            self.gid_index,
            self.attr.local_psn,
        )
        .map_err(|e| e.to_string())?;
        Ok(NewQp { qp, local })
    }

    /// Ties a queue pair to `conn`: registers its ring buffer and takes the
    /// ring's consumer role.
    pub(super) fn bind_qp(
        &self,
        conn: &Arc<Connection>,
        q: NewQp,
    ) -> std::result::Result<Arc<IbConn>, String> {
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
        Ok(Arc::new(IbConn {
            conn: conn.clone(),
            max_inline: q.qp.caps().max_inline_data.min(self.max_inline_data) as usize,
            qp: q.qp,
            orb_mr,
            local: q.local,
            remote: Mutex::new(None),
            send: Mutex::new(SendState {
                consumer,
                outstanding: 0,
                parts_outstanding: 0,
                chains: VecDeque::new(),
                quarantined: Vec::new(),
                front_seen: None,
                next_seq: 1,
                unsignalled: 0,
                last_remote: (0, 0),
                chain: ibv::SendChain::with_capacity(
                    self.sq_size as usize,
                    2 * self.sq_size as usize,
                ),
            }),
        }))
    }

    /// Gives up the half of a set-up that did not open (one that did,
    /// e.g. through its first data while its handshake was still
    /// finishing, is the connection's and stays). If its queue pair was
    /// connected, the peer may have opened its side: it gets a close
    /// notice. The queue pair goes, and the ring's consumer role goes back
    /// to the connection for another half.
    pub(super) fn abandon(&self, core: &Core, ic: Arc<IbConn>) {
        if ic
            .conn
            .engine::<IbConn>()
            .is_some_and(|c| Arc::ptr_eq(&c, &ic))
        {
            return;
        }
        // The entry in `verified` is the right to open: whoever takes it
        // out decides. Here: not opened, unless `open_verified` has it.
        let took = {
            let mut verified = self.verified.lock();
            match verified.get(&ic.conn.peer.0) {
                Some((c, _)) if Arc::ptr_eq(c, &ic) => verified.remove(&ic.conn.peer.0).is_some(),
                _ => false,
            }
        };
        let remote = *ic.remote.lock();
        if remote.is_some() && !took {
            return; // `open_verified` attaches it or closes the connection
        }
        {
            let mut by_qpn = self.by_qpn.lock();
            if by_qpn
                .get(&ic.qp.qp_num())
                .is_some_and(|c| Arc::ptr_eq(c, &ic))
            {
                by_qpn.remove(&ic.qp.qp_num());
            }
        }
        if let Some(remote) = remote {
            self.send_close_notice(core, &ic, &remote);
        }
        let _ = ic.qp.to_error();
        // A completion being handled, or the watchdog, may hold the half
        // for a moment.
        let mut ic = ic;
        for _ in 0..100 {
            match Arc::try_unwrap(ic) {
                Ok(IbConn { conn, send, .. }) => {
                    conn.orb.release_consumer(send.into_inner().consumer);
                    return;
                }
                Err(back) => ic = back,
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        tracing::warn!(
            "{}: an abandoned queue pair for {} stayed in use; its connection cannot open",
            self.own,
            ic.conn.peer
        );
        ic.conn.close("queue pair set-up abandoned while in use");
    }

    pub(super) fn send_close_notice(&self, core: &Core, ic: &IbConn, remote: &ibv::Endpoint) {
        let notice = CloseNotice {
            src: self.own.0,
            dst: ic.conn.peer.0,
            src_endpoint: ic.local.to_bytes(),
            dst_endpoint: remote.to_bytes(),
        };
        let d = notice.encode(self.secret(), core.identity.as_ref());
        self.send_datagram(core, ic.conn.peer.0, &d);
    }

    /// Connects `ic`'s queue pair to the peer's endpoint (RTR, RTS): it
    /// can receive. Completions find it through the queue-pair table until
    /// it is attached.
    pub(super) fn connect_qp(
        &self,
        ic: &Arc<IbConn>,
        endpoint: &[u8],
    ) -> std::result::Result<(), String> {
        let remote = ibv::Endpoint::from_bytes(endpoint).map_err(|e| e.to_string())?;
        ic.qp
            .to_rtr(&self.attr, &remote)
            .map_err(|e| e.to_string())?;
        ic.qp.to_rts(&self.attr).map_err(|e| e.to_string())?;
        *ic.remote.lock() = Some(remote);
        self.by_qpn.lock().insert(ic.qp.qp_num(), ic.clone());
        Ok(())
    }

    /// Attaches `ic` to its connection and opens it: data may flow.
    pub(super) fn attach_and_open(
        &self,
        core: &Core,
        ic: &Arc<IbConn>,
        theirs: &Hello,
    ) -> std::result::Result<(), String> {
        if !ic.conn.attach_engine(ic) {
            return Err("the connection already has a queue pair".into());
        }
        if !ic.conn.is_alive()
            || !core.opened(
                &ic.conn,
                theirs.instance,
                u64::from(theirs.fc_window),
                u64::from(theirs.fc_unit),
            )
        {
            // Closed meanwhile (marked closed before `Transport::close`
            // runs): that close may have found nothing to release yet.
            // Releasing twice is harmless (the table entry goes once).
            self.close(&ic.conn);
            return Err("connection closed during set-up".into());
        }
        core.on_write_interest(ic.conn.peer);
        Ok(())
    }

    /// Data arrived on a connecting connection's queue pair: the acceptor
    /// accepted (it sends only then), and its final answer is still on the
    /// way. Opens the connection now, so the data is not held up.
    pub(super) fn open_verified(&self, core: &Core, ic: &Arc<IbConn>) {
        let claimed = {
            let mut verified = self.verified.lock();
            match verified.get(&ic.conn.peer.0) {
                Some((c, _)) if Arc::ptr_eq(c, ic) => verified.remove(&ic.conn.peer.0),
                _ => None,
            }
        };
        if let Some((ic, theirs)) = claimed {
            if let Err(e) = self.attach_and_open(core, &ic, &theirs) {
                core.close_connection(&ic.conn, &format!("connection set-up failed: {e}"), true);
            }
        }
    }
}
