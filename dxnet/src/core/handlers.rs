//! Handler threads: take a connection with data, decode its buffers, dispatch
//! to the registered receivers, decode ahead while a handler blocks.

use super::*;
use crate::node::HeldWindow;

/// A held message's payload is lent from its receive buffer (not copied)
/// from a sixteenth of a buffer or this many bytes, whichever is less: a
/// lent payload keeps its whole buffer out of the pool, and TCP's 256 KiB
/// buffers would otherwise copy the 4-16 KiB payloads (e.g. dxshuffle's
/// batches) that 64 KiB buffers lend.
const LEND_FROM_MAX: usize = 4096;

/// When a held message's payload is lent from its receive buffer rather
/// than copied (from the configuration, once at start).
#[derive(Debug)]
pub(super) struct LendPolicy {
    /// Smallest payload lent (see [`LEND_FROM_MAX`]).
    from: usize,
    /// Most receive buffers lent payloads may hold: half of the pool, so
    /// the other half keeps receiving.
    max_buffers: usize,
}

impl LendPolicy {
    pub(super) fn new(config: &Config) -> Self {
        Self {
            from: (config.recv_buffer_size() / 16).min(LEND_FROM_MAX),
            max_buffers: config.recv_pool_size() / 2,
        }
    }
}

/// What [`Core::process_item`] decodes: an [`Incoming`] item, its pooled
/// buffer possibly shared with held messages.
enum Source {
    Pooled(RecvBuffer),
    Shared(Arc<SharedRecv>),
    Local(Vec<u8>),
    Decoded(Vec<u8>),
}

impl Source {
    fn pooled(&self) -> Option<&RecvBuffer> {
        match self {
            Source::Pooled(b) => Some(b),
            Source::Shared(s) => Some(s.buffer()),
            Source::Local(_) | Source::Decoded(_) => None,
        }
    }
}

thread_local! {
    /// Set on the node's handler threads (they take parallel jobs).
    static IS_HANDLER_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Core {
    pub(super) fn handler_loop(self: Arc<Self>) {
        IS_HANDLER_THREAD.with(|h| h.set(true));
        // Handler threads never spin: while all of them are parked a
        // receive thread handles small buffers inline (no hop at all), and
        // a spinning handler would take a core from the application's
        // threads under load.
        let mut idle = Idle::parking(&self.config.park);
        loop {
            // Parallel messages first: each holds back flow-control window
            // of its connection until it ran.
            if let Some(job) = self.parallel.pop() {
                idle.reset();
                self.run_parallel(job);
                continue;
            }
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
                self.incoming.handlers.park_unless(
                    || !self.incoming.is_idle() || !self.parallel.is_empty() || self.is_shut_down(),
                    max,
                );
            }
        }
    }

    pub(super) fn process_connection(self: &Arc<Self>, conn: Owned) {
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
    pub(super) fn process_item(self: &Arc<Self>, conn: &Owned, item: Incoming) {
        let mut processed = 0u64;
        let mut held = 0u64;
        let mut responses = 0u64;
        let mut count = 0u64;
        let mut pending = take_scratch();
        let src = match item {
            // With a held receiver registered, a pooled buffer is shared
            // so that its large payloads can be lent.
            Incoming::Pooled(b) if self.any_held.load(Ordering::Relaxed) => {
                Source::Shared(Arc::new(SharedRecv::new(b, self.me.clone())))
            }
            Incoming::Pooled(b) => Source::Pooled(b),
            Incoming::Local(v) => Source::Local(v),
            Incoming::Decoded(v) => Source::Decoded(v),
        };
        let arrived = src.pooled().map_or(0, RecvBuffer::arrived);
        let _arrival = self.arrival_scope(arrived);
        let base: &[u8] = match (&src, src.pooled()) {
            (_, Some(b)) => b.bytes(),
            (Source::Local(v) | Source::Decoded(v), None) => v,
            (Source::Pooled(_) | Source::Shared(_), None) => unreachable!("pooled"),
        };
        let res = {
            let mut on_msg = |h: &MessageHeader, piece: Piece<'_>| {
                if h.kind().is_response() {
                    // Outside the flow-control window: counted in the
                    // stats only.
                    responses += (HEADER_LEN + piece.bytes().len()) as u64;
                    count += 1;
                    self.dispatch_piece(conn, h, piece);
                    return;
                }
                // Payloads inside the buffer are referenced, reassembled
                // ones (split across buffers) copied or, if large, taken
                // from the decoder.
                let at = match piece {
                    Piece::Given(v) => PayloadAt::Owned(std::mem::take(v)),
                    Piece::Lent(p) => {
                        let off = (p.as_ptr() as usize).wrapping_sub(base.as_ptr() as usize);
                        if !p.is_empty() && off <= base.len() && p.len() <= base.len() - off {
                            PayloadAt::In(off..off + p.len())
                        } else {
                            PayloadAt::Owned(p.to_vec())
                        }
                    }
                };
                pending.push(PendingMessage { header: *h, at });
            };
            match (&src, src.pooled()) {
                // Whole messages outside the stream: its decoder is
                // neither needed nor touched.
                (_, Some(b)) if b.is_standalone() => self.feed_standalone(b, &mut on_msg),
                (_, Some(b)) => {
                    let mut dec = conn.decoder.lock();
                    b.segments()
                        .try_for_each(|seg| dec.feed_pieces(seg, &mut on_msg))
                }
                (Source::Local(v), None) => conn.decoder.lock().feed_pieces(v, &mut on_msg),
                // Whole messages: no decoder state involved.
                (Source::Decoded(v), None) => {
                    Decoder::new(self.config.limits.max_message_size).feed_pieces(v, &mut on_msg)
                }
                (Source::Pooled(_) | Source::Shared(_), None) => unreachable!("pooled"),
            }
        };
        if !pending.is_empty() {
            let several = pending.len() > 1;
            let mut run = || {
                for m in pending.drain(..) {
                    if self.is_parallel(&m.header) {
                        let payload = match m.at {
                            PayloadAt::In(r) => self.parallel_payload(&base[r]),
                            PayloadAt::Owned(v) => v,
                        };
                        self.queue_parallel(conn, m.header, payload, arrived);
                        continue;
                    }
                    if let Some(f) = self.held_receiver(&m.header) {
                        let (msg, bytes) = self.held_message(conn, &src, base, m.at);
                        processed += bytes;
                        held += bytes;
                        count += 1;
                        f(conn.peer, msg);
                        if inline::take_blocked() {
                            conn.inbox.lock().set_owner_blocked(false);
                        }
                        continue;
                    }
                    let payload = match &m.at {
                        PayloadAt::In(r) => &base[r.clone()],
                        PayloadAt::Owned(v) => v,
                    };
                    processed += (HEADER_LEN + payload.len()) as u64;
                    count += 1;
                    // Bytes a receiver holds go back when it lets go.
                    held += self.dispatch(conn, &m.header, payload);
                    if inline::take_blocked() {
                        conn.inbox.lock().set_owner_blocked(false);
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
        self.count_received(conn, count, processed + responses);
        // A shared buffer goes back once its lent payloads are dropped too.
        if let Source::Pooled(b) = src {
            self.give_back(b);
        }
        if conn.id != 0 && conn.flow.on_processed(processed - held) && conn.is_alive() {
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

    /// The receiver of `h` if it is a held one (and `h` a plain message).
    fn held_receiver(&self, h: &MessageHeader) -> Option<&HeldFn> {
        // Without held receivers (the common case) no second table lookup
        // per message.
        if !self.any_held.load(Ordering::Relaxed) || h.kind() != MessageKind::Plain {
            return None;
        }
        match &self.handlers[h.type_key() as usize].get()?.kind {
            HandlerKind::Held(f) => Some(f),
            _ => None,
        }
    }

    /// A held receiver's message and its bytes (with the header): its
    /// payload lent from a shared buffer when that pays and at most half
    /// of the pool is lent (see [`crate::HeldMessage`]), else copied (or
    /// the reassembled bytes).
    fn held_message(
        &self,
        conn: &Arc<Connection>,
        src: &Source,
        base: &[u8],
        at: PayloadAt,
    ) -> (crate::HeldMessage, u64) {
        let payload_len = match &at {
            PayloadAt::In(r) => r.len(),
            PayloadAt::Owned(v) => v.len(),
        };
        let bytes = (HEADER_LEN + payload_len) as u64;
        let window = HeldWindow::new(self.me.clone(), conn, bytes);
        let msg = match (at, src) {
            (PayloadAt::In(r), Source::Shared(s))
                if r.len() >= self.lend.from
                    && s.may_lend(&self.lent_buffers, self.lend.max_buffers) =>
            {
                crate::HeldMessage::lent(s.clone(), r.start, r.len(), window)
            }
            (PayloadAt::In(r), _) => crate::HeldMessage::owned(base[r].to_vec(), window),
            (PayloadAt::Owned(v), _) => crate::HeldMessage::owned(v, window),
        };
        (msg, bytes)
    }

    fn is_parallel(&self, h: &MessageHeader) -> bool {
        // Without parallel types (the common case) no second table lookup
        // per message.
        self.any_parallel.load(Ordering::Relaxed)
            && self.handlers[h.type_key() as usize]
                .get()
                .is_some_and(|e| e.mode == Mode::Parallel)
    }

    /// Hands a message of a parallel type to any handler thread; its bytes
    /// count as processed (flow control) once it ran. A parked handler
    /// thread is woken only for the second job waiting: the first is left
    /// to a thread that comes by (this one, once done with its
    /// connection), since a wake-up costs more than many small handlers.
    fn queue_parallel(
        &self,
        conn: &Arc<Connection>,
        header: MessageHeader,
        payload: Vec<u8>,
        arrived: u64,
    ) {
        self.parallel.push(ParallelJob {
            conn: conn.clone(),
            header,
            payload,
            arrived,
        });
        // Receive threads (inline handling) and senders to the own node
        // never take jobs: they always wake a handler thread.
        if self.parallel.len() > 1 || !IS_HANDLER_THREAD.with(|h| h.get()) {
            self.incoming.handlers.notify_one();
        }
    }

    /// A copy of `bytes` for a parallel job, in a recycled buffer: a fresh
    /// allocation per message (freed on another thread) costs page faults
    /// for large messages.
    fn parallel_payload(&self, bytes: &[u8]) -> Vec<u8> {
        let mut v = self.parallel_spare.pop().unwrap_or_default();
        v.extend_from_slice(bytes);
        v
    }

    /// Gives back the window of bytes a receiver held (see
    /// [`crate::HeldMessage`]).
    pub(crate) fn release_held(&self, conn: &Connection, bytes: u64) {
        if conn.id != 0 && conn.flow.on_processed(bytes) && conn.is_alive() {
            self.on_write_interest(conn.peer);
        }
    }

    /// Runs one parallel message and gives its bytes back to its
    /// connection's flow-control window.
    fn run_parallel(&self, job: ParallelJob) {
        let ParallelJob {
            conn,
            header,
            mut payload,
            arrived,
        } = job;
        {
            let _arrival = self.arrival_scope(arrived);
            self.dispatch(&conn, &header, &payload);
        }
        let bytes = (HEADER_LEN + payload.len()) as u64;
        if payload.capacity() <= PARALLEL_SPARE_MAX_BYTES {
            payload.clear();
            let _ = self.parallel_spare.push(payload);
        }
        self.count_received(&conn, 1, bytes);
        if conn.id != 0 && conn.flow.on_processed(bytes) && conn.is_alive() {
            self.on_write_interest(conn.peer);
        }
    }

    /// [`Core::dispatch`] of a decoded response [`Piece`]: a large
    /// reassembled payload becomes the request's outcome as it is (no
    /// copy).
    pub(super) fn dispatch_piece(
        &self,
        conn: &Arc<Connection>,
        h: &MessageHeader,
        piece: Piece<'_>,
    ) {
        match piece {
            Piece::Given(v) if h.kind() == MessageKind::Response => {
                if !self
                    .requests
                    .complete_owned(h.request_id, conn.peer, std::mem::take(v))
                {
                    tracing::debug!(
                        "{}: response {} from {} matches no pending request",
                        self.own,
                        h.request_id,
                        conn.peer
                    );
                }
            }
            piece => {
                self.dispatch(conn, h, piece.bytes());
            }
        }
    }

    /// Runs the receiver of one message from `conn`; returns the bytes
    /// whose flow-control window its receiver holds on to (see
    /// [`crate::HeldMessage`]), 0 for every other kind of receiver.
    pub(super) fn dispatch(
        &self,
        conn: &Arc<Connection>,
        h: &MessageHeader,
        payload: &[u8],
    ) -> u64 {
        let src = conn.peer;
        let kind = h.kind();
        if kind.is_response() {
            let completed = if kind == MessageKind::ErrorResponse {
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
            return 0;
        }
        let Some(entry) = self.handlers[h.type_key() as usize].get() else {
            self.drop_unknown(src, h);
            return 0;
        };
        match &entry.kind {
            // Held receivers normally get their messages from
            // `held_message` (lent where it pays); this copy serves one
            // registered while its message's buffer was being processed.
            HandlerKind::Held(f) if kind == MessageKind::Plain => {
                let bytes = (HEADER_LEN + payload.len()) as u64;
                let window = HeldWindow::new(self.me.clone(), conn, bytes);
                f(src, crate::HeldMessage::owned(payload.to_vec(), window));
                return bytes;
            }
            HandlerKind::Held(_) => self.drop_unknown(src, h),
            HandlerKind::Request(f) => {
                if kind != MessageKind::Request {
                    tracing::warn!(
                        "{}: request type ({}, {}) sent without request flag by {src}",
                        self.own,
                        h.msg_type,
                        h.subtype
                    );
                    return 0;
                }
                match &self.breakdown {
                    Some(b) => b.handle(|| f(self, src, h.request_id, payload)),
                    None => f(self, src, h.request_id, payload),
                }
            }
            HandlerKind::Message(_) if entry.mode == Mode::Exclusive => {
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
            // dxnet's own plain messages; as a request, no such type.
            HandlerKind::Own(f) if kind == MessageKind::Plain => f(self, src, payload),
            HandlerKind::Own(_) => self.drop_unknown(src, h),
            HandlerKind::Pull(_) if kind != MessageKind::Plain => self.drop_unknown(src, h),
            HandlerKind::Pull(slot) => match slot.sink().map(|s| s.offer(src, payload)) {
                Some(pull::Offered::Queued) => {}
                None | Some(pull::Offered::Gone) => self.drop_unknown(src, h),
                Some(pull::Offered::Undecodable(e)) => tracing::warn!(
                    "{}: message ({}, {}) from {src} dropped: {e}",
                    self.own,
                    h.msg_type,
                    h.subtype
                ),
            },
        }
        0
    }

    /// Counts and logs a message no receiver takes; a request gets an
    /// "unknown type" error response.
    fn drop_unknown(&self, src: NodeId, h: &MessageHeader) {
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
        if h.kind() == MessageKind::Request {
            self.send_error_response(
                src,
                h.request_id,
                REMOTE_UNKNOWN_TYPE,
                h.msg_type,
                h.subtype,
            );
        }
    }

    pub(super) fn exclusive_loop(self: Arc<Self>, rx: Receiver<ExclusiveItem>) {
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
}
