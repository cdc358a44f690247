//! What engines call: write interest, delivery of received buffers, inline
//! handling and completion of responses on the receiving thread.

use super::*;

impl Core {
    /// `peer`'s connection has data or confirmations to send. True if it
    /// was newly queued for the send thread (not queued already).
    #[inline]
    pub fn on_write_interest(&self, peer: NodeId) -> bool {
        if self.wim.push(peer.0) {
            if let Some(t) = self.transport() {
                t.wake_sender();
            }
            true
        } else {
            false
        }
    }

    /// Like [`Core::on_write_interest`] for requests and responses, whose
    /// latency matters more than aggregation: if the send thread is parked,
    /// the engine may write the data on this thread rather than wake it.
    /// (Plain messages keep the wake: the time it takes is what lets
    /// concurrent and back-to-back sends aggregate into one write.)
    /// `may_wait`: the calling thread blocks on a response right after
    /// (see [`Transport::try_flush`]).
    pub(super) fn on_urgent_write_interest(&self, peer: NodeId, may_wait: bool) {
        if inline::defer_flush(peer.0) {
            return;
        }
        self.write_out(peer, may_wait);
    }

    /// Writes out `peer`'s urgent data that an inline handler run deferred
    /// (on this thread if the engine can, see
    /// [`Core::on_urgent_write_interest`]).
    pub(crate) fn flush_deferred(&self, peer: NodeId) {
        self.write_out(peer, false);
    }

    fn write_out(&self, peer: NodeId, may_wait: bool) {
        match self.transport() {
            Some(t) if t.try_flush(self, peer, may_wait) => {}
            _ => {
                self.on_write_interest(peer);
            }
        }
    }

    /// A transport received `buf` (segments set) on `conn`.
    pub fn deliver(self: &Arc<Self>, conn: &Arc<Connection>, mut buf: RecvBuffer) {
        if buf.data_len() == 0 {
            self.give_back(buf);
            return;
        }
        self.stamp_arrival(&mut buf);
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
        mut buf: RecvBuffer,
    ) -> Option<InlineWork> {
        let len = buf.data_len();
        if len == 0 || len > self.config.inline_receive_bytes {
            self.deliver(conn, buf);
            return None;
        }
        self.stamp_arrival(&mut buf);
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
        let Some(conn) = conn.take_if_idle() else {
            self.enqueue(conn, Incoming::Pooled(buf));
            return None;
        };
        Some(InlineWork { conn, buf })
    }

    /// While held, the messages this thread dispatches count as arrived at
    /// `arrived` (when the node keeps a latency breakdown).
    #[inline]
    pub(super) fn arrival_scope(&self, arrived: u64) -> Option<breakdown::ArrivalScope> {
        self.breakdown
            .is_some()
            .then(|| breakdown::ArrivalScope::enter(arrived))
    }

    /// Stamps `buf`'s arrival when the node keeps a latency breakdown.
    #[inline]
    fn stamp_arrival(&self, buf: &mut RecvBuffer) {
        if self.breakdown.is_some() && buf.arrived() == 0 {
            buf.set_arrived(breakdown::now_ns());
        }
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
    pub(super) fn complete_responses_inline(
        self: &Arc<Self>,
        conn: &Arc<Connection>,
        buf: RecvBuffer,
    ) -> std::result::Result<(), RecvBuffer> {
        // Every segment (one per chunk the read took in: several when
        // responses to several requesters left in separate writes) holds
        // whole responses only.
        let only_responses = buf.segments().all(|seg| {
            let mut pos = 0;
            while pos < seg.len() {
                match message_at(seg, pos, self.config.limits.max_message_size) {
                    Some((h, end)) if h.kind().is_response() => pos = end,
                    _ => return false,
                }
            }
            true
        });
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
        // Take the connection like a handler thread would, if its decoder
        // holds no partial message (checked without waiting: the inbox is
        // held, see the lock order at `Inbox`).
        let owned = {
            let mut inbox = conn.inbox.lock();
            let decoder_idle = conn.decoder.try_lock().is_some_and(|d| d.is_idle());
            if !decoder_idle || !inbox.take_if_idle() {
                return Err(buf);
            }
            Owned::new_scheduled(conn.clone())
        };
        self.process_item(&owned, Incoming::Pooled(buf));
        match owned.release_unless_queued() {
            Ok(Some(successor)) => self.incoming.unhold(successor),
            Ok(None) => {}
            Err(still_owned) => self.incoming.reschedule(still_owned),
        }
        Ok(())
    }

    /// Completes the responses of a standalone buffer that holds nothing
    /// else (checked by the caller) and returns the buffer: the requester's
    /// own path when it receives its response itself (see
    /// `ReceiveRole::help`), so kept short.
    pub(super) fn complete_standalone_responses(&self, conn: &Arc<Connection>, buf: RecvBuffer) {
        let mut processed = 0u64;
        let mut count = 0u64;
        let _arrival = self.arrival_scope(buf.arrived());
        if let Some(seg) = buf.segments().next() {
            let mut pos = 0;
            while let Some((h, end)) = message_at(seg, pos, self.config.limits.max_message_size) {
                self.dispatch(conn, &h, &seg[pos + HEADER_LEN..end]);
                processed += (end - pos) as u64;
                count += 1;
                pos = end;
            }
        }
        self.count_received(conn, count, processed);
        self.give_back(buf);
        // Responses only: outside the flow-control window, nothing to
        // confirm.
    }

    /// Returns a receive buffer to the pool, waking a receiver the empty
    /// pool stopped.
    pub(crate) fn give_back(&self, buf: RecvBuffer) {
        if self.pool.put(buf) {
            self.resources_freed();
        }
    }

    /// Transports call this when a receive resource frees up (for local
    /// delivery waiters too).
    pub(super) fn resources_freed(&self) {
        if let Some(t) = self.transport() {
            t.wake_receiver();
        }
        self.local_room.notify_all();
    }

    /// Queues a received item for its connection's handler; decodes it at
    /// once instead while that handler is blocked (see
    /// [`Core::owner_blocking`]).
    pub(super) fn enqueue(&self, conn: &Arc<Connection>, item: Incoming) {
        let mut item = item;
        while let Some(back) = self.incoming.push(conn, item) {
            let mut freed = false;
            let mut failed = None;
            {
                let mut dec = conn.decoder.lock();
                let mut inbox = conn.inbox.lock();
                if !inbox.owner_blocked() {
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
                // Appended to the last decoded item if there is one: waiting
                // messages then count as one item against the connection's
                // share of the incoming queue, and bytes stay bounded by
                // the sender's flow-control window.
                let added = new.len();
                match inbox.push_decoded(new) {
                    Some(before) => self.incoming.resized(before, before + added),
                    None => self.incoming.added(added),
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
            if inbox.set_owner_blocked(true) {
                return;
            }
            // A new connection to the peer held behind this one may carry
            // the response the owner waits for: it goes ahead.
            if let Some(s) = inbox.take_successor() {
                drop(inbox);
                drop(dec);
                self.incoming.unhold(s);
                dec = conn.decoder.lock();
                inbox = conn.inbox.lock();
            }
            // Everything queued becomes one item (decoded ahead, in order):
            // the connection then holds one item of the incoming queue,
            // below its share, and its receiver reads on — the response
            // the handler waits for may be behind the queued buffers
            // (see `IncomingQueue::over_share`). Bytes still count.
            let k = inbox.len();
            if k > 0 {
                let mut merged: Vec<u8> = Vec::new();
                let mut old = 0;
                for it in inbox.drain() {
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
                inbox.push_decoded(merged);
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
    pub(super) fn decode_ahead(
        &self,
        conn: &Arc<Connection>,
        dec: &mut Decoder,
        item: Incoming,
        freed: &mut bool,
    ) -> std::result::Result<Vec<u8>, crate::message::HeaderError> {
        let mut out = Vec::new();
        let mut done = 0u64;
        let mut responses = 0u64;
        let mut on_msg = |h: &MessageHeader, piece: Piece<'_>| {
            if h.kind().is_response() {
                done += (HEADER_LEN + piece.bytes().len()) as u64;
                responses += 1;
                self.dispatch_piece(conn, h, piece);
            } else {
                let mut hb = [0u8; HEADER_LEN];
                h.encode(&mut hb);
                out.extend_from_slice(&hb);
                out.extend_from_slice(piece.bytes());
            }
        };
        let res = match &item {
            Incoming::Pooled(b) if b.is_standalone() => self.feed_standalone(b, &mut on_msg),
            Incoming::Pooled(b) => b
                .segments()
                .try_for_each(|seg| dec.feed_pieces(seg, &mut on_msg)),
            Incoming::Local(v) | Incoming::Decoded(v) => dec.feed_pieces(v, &mut on_msg),
        };
        if let Incoming::Pooled(b) = item {
            *freed |= self.pool.put(b);
        }
        // Only responses were processed: outside the flow-control window,
        // nothing to confirm.
        self.count_received(conn, responses, done);
        res.map(|()| out)
    }

    /// Decodes a standalone buffer (whole messages outside the stream, see
    /// [`RecvBuffer::mark_standalone`]) with a decoder of its own.
    pub(super) fn feed_standalone(
        &self,
        b: &RecvBuffer,
        on_msg: &mut impl FnMut(&MessageHeader, Piece<'_>),
    ) -> std::result::Result<(), crate::message::HeaderError> {
        let mut dec = Decoder::new(self.config.limits.max_message_size);
        b.segments()
            .try_for_each(|seg| dec.feed_pieces(seg, &mut *on_msg))?;
        if dec.is_idle() {
            Ok(())
        } else {
            Err(crate::message::HeaderError::Truncated)
        }
    }

    pub(super) fn after_decode_ahead(
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
}
