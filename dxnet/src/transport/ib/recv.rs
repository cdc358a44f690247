//! The receive side: the receive role's loop over the shared completion
//! queue, delivery of received buffers, and refilling the shared receive
//! queue within the incoming queue's limits.

use super::*;

impl IbEngine {
    /// Body of the two receive threads: the one holding the receive role
    /// receives, the other is the standby (see [`crate::core::inline`]).
    pub(super) fn recv_thread(self: Arc<Self>, core: Arc<Core>) {
        self.receiver.run(
            &core,
            &self.stop,
            |r| self.receive(&core, r),
            |r| {
                self.poll_once(&core, r, false);
            },
            |d| {
                if let Err(e) = self.recv_channel.wait_timeout(Some(d)) {
                    tracing::error!("{}: waiting for receive completions failed: {e}", self.own);
                    std::thread::sleep(Duration::from_millis(1));
                }
            },
            |r| {
                for bufs in r.posted.iter_mut() {
                    for b in bufs.drain(..) {
                        core.return_recv_buffer(b);
                    }
                }
            },
        );
    }

    /// The receive loop, run by the holder of the receive role until the
    /// engine stops, a buffer is to be handled inline, the thread is to
    /// sleep on the completion channel, or requesters receive themselves.
    pub(super) fn receive(&self, core: &Arc<Core>, r: &mut IbReceiver) -> Turn {
        while !self.stop.load(Ordering::Acquire) {
            let (n, inline) = self.poll_once(core, r, true);
            if let Some(work) = inline {
                r.idle.reset();
                return Turn::Inline(work);
            }
            if n > 0 {
                r.idle.reset();
                continue;
            }
            if self.receiver.helpers_waiting() {
                r.idle.reset();
                return Turn::StepAside;
            }
            if r.armed {
                // Sleep until the next completion (or max_park).
                r.armed = false;
                return Turn::Sleep(r.idle.max_park);
            }
            if r.idle.step() {
                let can_post = || {
                    core.recv_buffers_available() >= self.sges_per_recv && core.incoming_has_room()
                };
                if !r.empty_slots.is_empty() && !can_post() {
                    // Receive queue not full, and no buffers or no room in
                    // the incoming queue: wait for handlers to return some
                    // (`wake_receiver`).
                    self.recv_signal.park_unless(
                        || self.stop.load(Ordering::Acquire) || can_post(),
                        Duration::from_millis(1),
                    );
                } else if let Err(e) = self.recv_cq.req_notify(false) {
                    tracing::error!(
                        "{}: arming the receive completion queue failed: {e}",
                        self.own
                    );
                    self.recv_signal.park_unless(
                        || self.stop.load(Ordering::Acquire),
                        Duration::from_micros(200),
                    );
                } else {
                    // Poll once more before sleeping: a completion may have
                    // arrived before the queue was armed.
                    r.armed = true;
                }
            }
        }
        Turn::Stop
    }

    /// One pass over the receive queue: refill it, take up to a batch of
    /// completions and deliver their buffers. With `inline_ok`, one small
    /// buffer may come back for the caller to handle inline (see
    /// [`Core::deliver_or_inline`]). Returns the number of completions.
    pub(super) fn poll_once(
        &self,
        core: &Arc<Core>,
        r: &mut IbReceiver,
        inline_ok: bool,
    ) -> (usize, Option<InlineWork>) {
        let IbReceiver {
            wcs,
            posted,
            empty_slots,
            chain,
            sges,
            filled,
            taken,
            ..
        } = r;
        let mut inline = None;
        self.refill(core, posted, empty_slots, chain, sges, filled);
        let n = match self.recv_cq.poll(wcs) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(
                    "{}: polling the receive completion queue failed: {e}",
                    self.own
                );
                return (0, None);
            }
        };
        for wc in &wcs[..n] {
            let slot = wc.wr_id() as usize;
            let mut bufs = std::mem::replace(&mut posted[slot], std::mem::take(taken));
            empty_slots.push(slot);
            'wc: {
                if !wc.is_success() {
                    for b in bufs.drain(..) {
                        core.return_recv_buffer(b);
                    }
                    let ic = self.by_qpn.lock().get(&wc.qp_num()).cloned();
                    if let (Some(ic), false) = (&ic, wc.is_flush()) {
                        core.close_connection(
                            &ic.conn,
                            &format!("receive completion error: {}", wc.status_name()),
                            true,
                        );
                    }
                    break 'wc;
                }
                let (src, units, flags) = wire::decode_imm(wc.imm().unwrap_or(0));
                // The sender's node id travels in the immediate data: its
                // current connection, if the queue pair matches; else the
                // queue pair's own (a connection replaced meanwhile, or a
                // peer claiming another id, warned about below).
                let ic = self.completion_conn(core, NodeId(src), wc.qp_num());
                let Some(ic) = ic else {
                    for b in bufs.drain(..) {
                        core.return_recv_buffer(b);
                    }
                    break 'wc;
                };
                if ic.conn.state() == ConnState::Connecting {
                    self.open_verified(core, &ic);
                }
                let standalone = u32::from(flags) == wire::IMM_STANDALONE;
                let len = wc.byte_len() as usize;
                let bad = if u32::from(flags) & !wire::IMM_STANDALONE != 0 {
                    Some(format!("unknown immediate-data flags {flags:#04x}"))
                } else if standalone && bufs.first().is_none_or(|b| len > b.capacity()) {
                    Some(format!("a standalone send of {len} bytes"))
                } else {
                    None
                };
                if let Some(why) = bad {
                    for b in bufs.drain(..) {
                        core.return_recv_buffer(b);
                    }
                    core.close_connection(&ic.conn, &format!("protocol error: {why}"), true);
                    break 'wc;
                }
                if src != ic.conn.peer.0 {
                    tracing::warn!(
                        "{}: data on the queue pair of {} claims node {src}",
                        self.own,
                        ic.conn.peer
                    );
                }
                if units > 0 {
                    tracing::trace!(
                        "{}: {units} flow-control units from {}",
                        self.own,
                        ic.conn.peer
                    );
                }
                ic.conn.flow.on_confirm(units as u32);
                let mut left = len;
                for mut b in bufs.drain(..) {
                    if left == 0 {
                        // No data: kept for the slot's next work request (as if
                        // returned to the pool and taken again, minus the cost).
                        posted[slot].push(b);
                        continue;
                    }
                    let take = left.min(b.capacity());
                    b.push_segment(0..take);
                    if standalone {
                        b.mark_standalone();
                    }
                    left -= take;
                    // At most one buffer per turn is handled inline, after
                    // the whole batch is delivered.
                    if inline_ok && inline.is_none() {
                        inline = core.deliver_or_inline(&ic.conn, b);
                    } else {
                        core.deliver(&ic.conn, b);
                    }
                }
            }
            for b in bufs.drain(..) {
                core.return_recv_buffer(b);
            }
            *taken = bufs;
        }
        (n, inline)
    }

    /// Posts receive work requests for empty slots while the pool has
    /// buffers: each slot's buffers that got no data last time are posted
    /// again, topped up from the pool. `sges` and `filled` are scratch
    /// space (no allocation per call).
    pub(super) fn refill(
        &self,
        core: &Core,
        posted: &mut [Vec<RecvBuffer>],
        empty: &mut Vec<usize>,
        chain: &mut ibv::RecvChain,
        sges: &mut Vec<ibv::Sge>,
        filled: &mut Vec<usize>,
    ) {
        if empty.is_empty() {
            return;
        }
        chain.clear();
        filled.clear();
        let base = self.pool_mr.addr() as usize;
        while let Some(&slot) = empty.last() {
            let need = self.sges_per_recv.saturating_sub(posted[slot].len());
            // The incoming queue's limits bound what is received but not
            // handled yet: beyond them no receive is posted (senders get
            // receiver-not-ready and retry) until handlers drained some and
            // wake this thread, as TCP stops reading its sockets.
            if core.recv_buffers_available() < need || !core.incoming_has_room() {
                break;
            }
            while posted[slot].len() < self.sges_per_recv {
                let Some(b) = core.take_recv_buffer() else {
                    break;
                };
                posted[slot].push(b);
            }
            if posted[slot].len() < self.sges_per_recv {
                break; // taken meanwhile; the slot keeps what it has
            }
            sges.clear();
            for b in &posted[slot] {
                let off = b.addr() as usize - base;
                match self.pool_mr.sge(off, b.capacity() as u32) {
                    Ok(s) => sges.push(s),
                    Err(e) => tracing::error!(
                        "{}: receive buffer outside the registered pool: {e}",
                        self.own
                    ),
                }
            }
            if sges.len() < self.sges_per_recv {
                for b in posted[slot].drain(..) {
                    core.return_recv_buffer(b);
                }
                break;
            }
            empty.pop();
            chain.push(slot as u64, sges);
            filled.push(slot);
        }
        if filled.is_empty() {
            return;
        }
        if let Err(e) = self.srq.post_recv(chain) {
            tracing::error!("{}: posting receive work requests failed: {e}", self.own);
            for &slot in filled.iter() {
                for b in posted[slot].drain(..) {
                    core.return_recv_buffer(b);
                }
                empty.push(slot);
            }
        }
    }
}
