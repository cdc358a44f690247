//! The send side: the send thread's loop over connections with write
//! interest, and writing chunks straight out of the ring buffer (through
//! rustls with TLS).

use super::*;
use crate::config::MAX_RINGS;
use crate::transport::driver::SendSide;

/// The TCP engine's part of its send thread: writing ring buffers, and a
/// poll set of the sockets that were full (writable again: write on).
pub(super) struct TcpSender {
    pub(super) engine: Arc<TcpEngine>,
    pub(super) poll: Poll,
    pub(super) events: Events,
    /// The poll set failed: the thread ends.
    pub(super) failed: bool,
    /// Connections whose ready data waits to coalesce with more
    /// (`tcp.coalesce_bytes`) this round. They stay queued (their write
    /// interest is pushed back at once, so producers find it set and do
    /// not queue them again); the round ends when one comes up twice.
    pub(super) deferred: Vec<u16>,
    /// A deferred connection came up again: the round ends.
    pub(super) round_over: bool,
    /// Until when the thread stays awake, yielding, instead of parking
    /// once it finds nothing to write: `tcp.coalesce_us` after a write
    /// that carried [`COALESCE_FROM`] bytes or more (traffic that keeps
    /// coming; see [`SendSide::idle`] below).
    pub(super) awake_until: Option<Instant>,
    /// Since when the thread, awake for blocked requesters, found nothing
    /// to write: it parks after `park.yield_us` of that (responses that
    /// take long, e.g. a slow handler, must not keep it busy).
    pub(super) gather_idle_since: Option<Instant>,
}

impl TcpSender {
    /// Whether the thread stays awake for the node's blocked requesters
    /// (see [`SendSide::idle`] below): while [`GATHER_REQUESTERS`] or more
    /// wait, up to `park.yield_us` after its last write.
    fn gathering(&mut self, core: &Core) -> bool {
        if core.blocked_requesters() < GATHER_REQUESTERS {
            self.gather_idle_since = None;
            return false;
        }
        let now = Instant::now();
        let since = *self.gather_idle_since.get_or_insert(now);
        now.saturating_duration_since(since) < Duration::from_micros(core.config().park.yield_us)
    }

    /// Waits up to `timeout` for sockets that turned writable and writes
    /// the ones that had been full; true if there were any.
    fn poll_writable(&mut self, core: &Core, timeout: Duration) -> bool {
        let e = &self.engine;
        if let Err(err) = self.poll.poll(&mut self.events, Some(timeout)) {
            if err.kind() != std::io::ErrorKind::Interrupted {
                tracing::error!("{}: send poll failed: {err}", e.own);
                self.failed = true;
            }
            return false;
        }
        let mut found = false;
        for ev in self.events.iter() {
            if ev.token() == WAKER {
                continue;
            }
            let tc = e.by_token.lock().get(&ev.token().0).cloned();
            if let Some(tc) = tc {
                let was_blocked = std::mem::replace(&mut tc.send.lock().blocked, false);
                if was_blocked {
                    found = true;
                    e.write_some(core, &tc);
                }
            }
        }
        found
    }
}

impl SendSide for TcpSender {
    fn stopping(&self) -> bool {
        self.failed || self.engine.stop.load(Ordering::Acquire)
    }

    fn round(&mut self, _core: &Core) {
        self.deferred.clear();
        self.round_over = false;
    }

    fn write(&mut self, core: &Core, peer: u16) {
        let Some(tc) = core.engine_half::<TcpConn>(NodeId(peer)) else {
            return;
        };
        let mut st = tc.send.lock();
        if self.engine.coalesces(&tc, &mut st) {
            drop(st);
            if self.deferred.contains(&peer) {
                self.round_over = true;
            } else {
                self.deferred.push(peer);
            }
            core.requeue_write_interest(peer);
            return;
        }
        let more = self.engine.write_locked(core, &tc, &mut st, true);
        if self.engine.coalesce_bytes > 0 && st.last_len >= COALESCE_FROM {
            if let Some(t) = st.last_write {
                self.awake_until = Some(t + self.engine.coalesce_wait);
            }
        }
        drop(st);
        if more {
            core.requeue_write_interest(peer);
        }
    }

    fn round_over(&mut self) -> bool {
        self.round_over
    }

    fn busy(&mut self, busy: bool) {
        if busy {
            self.gather_idle_since = None;
        }
    }

    fn after_work(&mut self, core: &Core) -> bool {
        if !self.deferred.is_empty() {
            // Data waits to coalesce: the core goes to the threads that
            // make more (or receive), and the next round comes back to it.
            std::thread::yield_now();
        }
        self.poll_writable(core, Duration::ZERO)
    }

    fn idle(&mut self, core: &Core, park: Option<Duration>) -> bool {
        // Under traffic that keeps coming, the next data is due within
        // `coalesce_us`: the thread stays awake (giving its core to any
        // thread that wants it) rather than park and be woken for it; and
        // while it is awake, requests and responses go through it, with
        // what else is ready, instead of a system call each on their
        // threads.
        //
        // So too while several of the node's threads wait for responses:
        // each sends its next request soon after its response comes, and
        // with the send thread awake those requests leave together (one
        // `writev`, the flush left to this thread: see `try_flush`)
        // instead of a system call each on the requesters' threads,
        // which would take turns at the socket.
        let awake = self.awake_until.is_some_and(|t| Instant::now() < t) || self.gathering(core);
        if park.is_some() && awake {
            std::thread::yield_now();
            let found = self.poll_writable(core, Duration::ZERO);
            if found {
                self.gather_idle_since = None;
            }
            return found;
        }
        let Some(max) = park else {
            return self.poll_writable(core, Duration::ZERO);
        };
        let parked_at = self.engine.epoch.elapsed().as_nanos() as u64;
        self.engine
            .send_parked_at
            .store(parked_at, Ordering::Relaxed);
        self.engine.send_sleeping.store(true, Ordering::SeqCst);
        let timeout = if core.write_interest_is_empty() {
            max
        } else {
            Duration::ZERO
        };
        let found = self.poll_writable(core, timeout);
        self.engine.send_sleeping.store(false, Ordering::SeqCst);
        found
    }
}

impl TcpEngine {
    /// Writes chunks of `tc`'s ring buffer until it is empty, the socket is
    /// full, or the round budget is used up.
    pub(super) fn write_some(&self, core: &Core, tc: &TcpConn) {
        let mut st = tc.send.lock();
        if self.write_locked(core, tc, &mut st, false) {
            core.requeue_write_interest(tc.conn.peer.0);
        }
    }

    /// Whether the send thread leaves `tc`'s ready data for a later round,
    /// to write it together with what comes meanwhile (write coalescing,
    /// `tcp.coalesce_bytes`): some but less than `coalesce_bytes` is ready, the
    /// connection was written to within `coalesce_us` and that write
    /// carried at least [`COALESCE_FROM`] bytes (data comes faster than
    /// a message or two per write), and nothing else is due (a request or
    /// response, a flow-control confirmation, a part-written chunk, a
    /// poke). A connection idle for longer, or with a trickle of small
    /// messages, is written at once: a lone message never waits, and the
    /// send thread does not give its core away per message.
    pub(super) fn coalesces(&self, tc: &TcpConn, st: &mut SendState) -> bool {
        let conn = &tc.conn;
        self.coalesce_bytes > 0
            && st.header_off == CHUNK_HEADER_LEN
            && st.data_left == 0
            && !st.blocked
            && st.lent.is_empty()
            && !tc.lent.pending()
            && conn.state() == ConnState::Open
            && conn.flow.pending_units() == 0
            && !tc.poke.load(Ordering::Acquire)
            && !tc.urgent.load(Ordering::Acquire)
            && st.last_len >= COALESCE_FROM
            && st
                .last_write
                .is_some_and(|t| t.elapsed() < self.coalesce_wait)
            && (1..self.coalesce_bytes).contains(&ready_len(conn, st))
    }

    /// [`TcpEngine::write_some`] with the send state held; returns true if
    /// data is left that the socket would take (round budget used up, or,
    /// with `coalesce`, less than `tcp.coalesce_bytes` came during the
    /// last write: see [`TcpEngine::coalesces`]).
    pub(super) fn write_locked(
        &self,
        core: &Core,
        tc: &TcpConn,
        st: &mut SendState,
        coalesce: bool,
    ) -> bool {
        let conn = &tc.conn;
        if conn.state() != ConnState::Open {
            // Its sender learns that the connection closed.
            drop_lent(tc, st);
            return false;
        }
        if st.blocked {
            return false;
        }
        // With TLS, chunks are copied from the ring buffer into rustls
        // (bounded by its buffer limit, so a chunk counts as sent once
        // rustls holds it) and its records written out, pending records
        // before new data.
        let mut tls = tc.tls.as_ref().map(|t| t.lock());
        let mut wrote = 0;
        for round in 0..SEND_ROUNDS {
            if let Some(t) = tls.as_deref_mut() {
                if let Err(e) = flush_tls(t, &tc.stream) {
                    self.write_failed(core, conn, st, e);
                    return false;
                }
            }
            if st.header_off == CHUNK_HEADER_LEN && st.data_left == 0 && st.lent_left == 0 {
                if round > 0 && coalesce && self.coalesces(tc, st) {
                    return true;
                }
                let units = conn.flow.take_units(u32::MAX);
                // The rest of a lent payload too large for its chunk, or
                // the next ring chunk with the payloads lent behind its
                // headers spliced in (the receiver gets those messages
                // whole, in one chunk).
                let (ring, lent) = match lent_rest(st) {
                    Some(len) => (0, len),
                    None => {
                        let take = next_chunk_ring(tc, st);
                        splice_lent(tc, st, take)
                    }
                };
                let avail = ring + lent;
                let poke = tc.poke.swap(false, Ordering::AcqRel);
                if avail == 0 && units == 0 && !poke {
                    // All written, so whatever `urgent` was set for went
                    // out (its bytes were committed before the flag). A
                    // flag this swap takes may belong to bytes committed
                    // since the look above: then the connection is queued
                    // again, still urgent.
                    if tc.urgent.swap(false, Ordering::AcqRel) && has_sendable(conn, st) {
                        tc.urgent.store(true, Ordering::Release);
                        return true;
                    }
                    return false;
                }
                st.header = encode_chunk_header(avail as u32, units);
                st.header_off = 0;
                st.data_left = ring;
                st.lent_left = lent;
            }
            // Chunks of the connection's other rings go out in the same
            // call behind the current one (one system call however many
            // rings have data), unless the current chunk is cut.
            let mut plan = [(0usize, 0usize, false); MAX_GATHER];
            let mut headers = [[0u8; CHUNK_HEADER_LEN]; MAX_GATHER];
            let planned = plan_gather(tc, st, &mut plan);
            for (h, &(_, len, _)) in headers.iter_mut().zip(&plan[..planned]) {
                *h = encode_chunk_header(len as u32, 0);
            }
            // Where the current chunk's ring data starts (the payloads'
            // places are relative to it).
            let mut posted = conn.ring(st.ring).posted(&mut st.consumers[st.ring]);
            let written = {
                // The slices are written out (or copied into rustls) before
                // `mark_completed` frees them (they borrow the consumers).
                let mut parts: [(&[u8], &[u8]); MAX_RINGS] = [(&[], &[]); MAX_RINGS];
                for (r, c) in st.consumers.iter_mut().enumerate() {
                    let len = if r == st.ring {
                        st.data_left
                    } else if let Some(&(_, len, _)) =
                        plan[..planned].iter().find(|&&(pr, _, _)| pr == r)
                    {
                        len
                    } else {
                        continue;
                    };
                    parts[r] = conn.ring(r).unposted(c, len);
                }
                let mut iov = [IoSlice::new(&[]); MAX_IOV];
                iov[0] = IoSlice::new(&st.header[st.header_off..]);
                let mut used = 1;
                let mut ring_left = st.data_left;
                let (mut a, mut b) = parts[st.ring];
                let mut lent_left = st.lent_left;
                for (k, (at, l)) in st.lent.iter().enumerate() {
                    if lent_left == 0 {
                        break;
                    }
                    // The ring's bytes up to this payload's place, then
                    // as much of it as the chunk holds.
                    let before = (at - posted) as usize;
                    let head;
                    (head, (a, b)) = split_parts((a, b), before);
                    for p in [head.0, head.1] {
                        if !p.is_empty() {
                            iov[used] = IoSlice::new(p);
                            used += 1;
                        }
                    }
                    ring_left -= before;
                    posted = *at;
                    let off = if k == 0 { st.lent_off } else { 0 };
                    let take = (l.bytes().len() - off).min(lent_left);
                    iov[used] = IoSlice::new(&l.bytes()[off..off + take]);
                    used += 1;
                    lent_left -= take;
                }
                debug_assert!(a.len() + b.len() == ring_left);
                for p in [a, b] {
                    if !p.is_empty() {
                        iov[used] = IoSlice::new(p);
                        used += 1;
                    }
                }
                for (&(r, _, _), h) in plan[..planned].iter().zip(&headers) {
                    iov[used] = IoSlice::new(h);
                    iov[used + 1] = IoSlice::new(parts[r].0);
                    iov[used + 2] = IoSlice::new(parts[r].1);
                    used += 3;
                }
                let iov = &iov[..used];
                match tls.as_deref_mut() {
                    None => (&tc.stream).write_vectored(iov),
                    Some(t) => t.writer().write_vectored(iov),
                }
            };
            match written {
                Ok(mut n) => {
                    // The current chunk first (its ring data, then its lent
                    // payload); bytes past it went to the planned chunks in
                    // turn, and the last one they reached becomes the
                    // current chunk.
                    let mut next = plan[..planned].iter().zip(&headers);
                    loop {
                        let h = n.min(CHUNK_HEADER_LEN - st.header_off);
                        st.header_off += h;
                        n -= h;
                        // The chunk's data in order: ring bytes up to the
                        // next payload's place, the payload's part in this
                        // chunk, and so on; the ring's rest.
                        while n > 0 && (st.data_left > 0 || st.lent_left > 0) {
                            let consumer = &mut st.consumers[st.ring];
                            let orb = conn.ring(st.ring);
                            let next_at = st.lent.front().map(|&(at, _)| at);
                            let ring_part = match next_at {
                                Some(at) if st.lent_left > 0 => {
                                    (at - orb.posted(consumer)) as usize
                                }
                                _ => st.data_left,
                            };
                            let d = n.min(ring_part);
                            if d > 0 {
                                orb.mark_posted(consumer, d);
                                orb.mark_completed(consumer, d);
                                st.data_left -= d;
                                n -= d;
                                wrote += d;
                                continue;
                            }
                            let Some((_, l)) = st.lent.front() else { break };
                            let e = n.min(st.lent_left).min(l.bytes().len() - st.lent_off);
                            st.lent_off += e;
                            st.lent_left -= e;
                            n -= e;
                            wrote += e;
                            finish_lent(tc, st);
                        }
                        if self.coalesce_bytes > 0 && wrote > 0 {
                            st.last_write = Some(Instant::now());
                            st.last_len = wrote;
                        }
                        if n == 0 {
                            break;
                        }
                        let Some((&(r, len, cut), header)) = next.next() else {
                            break;
                        };
                        st.ring = r;
                        st.cut = cut;
                        st.header = *header;
                        st.header_off = 0;
                        st.data_left = len;
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
            || st.lent_left > 0
            || st.header_off < CHUNK_HEADER_LEN
            || !st.lent.is_empty()
            || has_sendable(conn, st)
            || conn.flow.pending_units() > 0
    }

    /// Handles a failed write: a full socket waits for a writable event,
    /// an interrupted call is retried (true), anything else closes the
    /// connection.
    pub(super) fn write_failed(
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

/// Writes a TLS connection's pending records to its socket.
pub(super) fn flush_tls(t: &mut tls::Session, mut stream: &TcpStream) -> std::io::Result<()> {
    while t.wants_write() {
        match t.write_tls(&mut stream) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Picks the ring of the next chunk and returns its length (at most
/// `MAX_CHUNK`): the rings take turns, each chunk holding what its ring
/// has published. A chunk that may end inside a message (cut at
/// `MAX_CHUNK`, or part of a message written into the ring in chunks) is
/// followed by the rest of its ring first, so the receiver's stream never
/// switches rings inside a message.
fn next_chunk_ring(tc: &TcpConn, st: &mut SendState) -> usize {
    for r in candidate_rings(&tc.conn, st) {
        if let Some((take, cut)) = chunk_of(tc, st, r) {
            st.ring = r;
            st.cut = cut;
            return take;
        }
    }
    0
}

/// Most chunks of other rings written in one call behind the current one.
const MAX_GATHER: usize = 7;

/// The chunk ring `r` would send next, if it has published data: its
/// length (at most `MAX_CHUNK`) and whether it may end inside a message.
fn chunk_of(tc: &TcpConn, st: &mut SendState, r: usize) -> Option<(usize, bool)> {
    let ring = tc.conn.ring(r);
    let len = ring.unposted_len(&mut st.consumers[r]);
    if len == 0 {
        return None;
    }
    let take = len.min(MAX_CHUNK);
    Some((
        take,
        take < len || ring.ends_inside_message(&mut st.consumers[r], take),
    ))
}

/// Where ring `r`'s next `take` bytes must end for a chunk without lent
/// payloads (gathered behind the current chunk): before the first message
/// with one (`unposted_len` acquired its header's commit, so its payload
/// is queued).
fn before_lent(tc: &TcpConn, st: &mut SendState, r: usize, take: usize) -> usize {
    match tc.lent.next_at(r) {
        Some(start) => {
            let posted = tc.conn.ring(r).posted(&mut st.consumers[r]);
            take.min(start.saturating_sub(posted) as usize)
        }
        None => take,
    }
}

/// Most payloads spliced into one chunk (bounds the `writev` vector).
const MAX_SPLICED: usize = 32;
/// Entries of one `writev`: the chunk header, each payload and the ring
/// pieces around them (two where the ring wraps), the gathered chunks.
const MAX_IOV: usize = 1 + 2 * (MAX_SPLICED + 1) + MAX_SPLICED + 3 * MAX_GATHER;

/// The current chunk is ring `st.ring`'s next `take` bytes: takes the
/// payloads lent to messages among them (`st.lent`), the chunk to carry
/// each right after its header, as many as one chunk holds; shortens the
/// ring bytes to end before a message whose payload does not fit (it
/// starts the next chunk). Returns the chunk's ring and payload bytes.
fn splice_lent(tc: &TcpConn, st: &mut SendState, take: usize) -> (usize, usize) {
    if take == 0 {
        return (0, 0);
    }
    let posted = tc.conn.ring(st.ring).posted(&mut st.consumers[st.ring]);
    let mut ring = take;
    let mut lent = 0;
    while let Some((start, end, len)) = tc.lent.peek(st.ring, |start, l| {
        (start, start + l.header as u64, l.bytes().len())
    }) {
        if start >= posted + ring as u64 {
            break; // a later chunk's
        }
        let before = (end - posted) as usize;
        let full = st.lent.len() == MAX_SPLICED || (lent > 0 && before + lent + len > MAX_CHUNK);
        if (full || end > posted + ring as u64) && start > posted {
            // The next chunk starts with this message (a boundary): its
            // header is not split from its payload.
            ring = (start - posted) as usize;
            st.cut = false;
            break;
        }
        if end > posted + ring as u64 {
            break; // the rest of a header sent in part: its payload next
        }
        let Some(l) = tc.lent.take_at(st.ring, start) else {
            break;
        };
        st.lent.push_back((end, l));
        if before + lent + len > MAX_CHUNK {
            // Larger than a chunk: its first part here, the rest in chunks
            // of its own before anything else.
            ring = before;
            lent += MAX_CHUNK.saturating_sub(before).max(1);
            st.cut = true;
            break;
        }
        lent += len;
    }
    if !st.lent.is_empty() {
        st.lent_off = 0;
    }
    (ring, lent)
}

/// The next chunk of a lent payload too large for the chunk of its
/// header, if one is being written.
fn lent_rest(st: &mut SendState) -> Option<usize> {
    let (_, l) = st.lent.front()?;
    st.cut = true;
    Some((l.bytes().len() - st.lent_off).min(MAX_CHUNK))
}

/// If the first lent payload is written out, it is done (its buffer free
/// again); once none is left in progress the rings take turns again.
fn finish_lent(tc: &TcpConn, st: &mut SendState) {
    let Some((_, l)) = st.lent.front() else {
        return;
    };
    if st.lent_off < l.bytes().len() {
        return;
    }
    if let Some((_, l)) = st.lent.pop_front() {
        l.finish();
        tc.lent.finished();
    }
    st.lent_off = 0;
    if st.lent.is_empty() && st.data_left == 0 {
        st.cut = false;
    }
}

/// Drops the lent payloads being written (the connection closed): their
/// senders learn that they were lost.
fn drop_lent(tc: &TcpConn, st: &mut SendState) {
    for (_, l) in st.lent.drain(..) {
        drop(l);
        tc.lent.finished();
    }
    st.lent_off = 0;
    st.lent_left = 0;
}

/// A span of ring bytes as its two slices (the second non-empty where the
/// span wraps at the ring's end).
type Span<'a> = (&'a [u8], &'a [u8]);

/// Splits `span` after `n` bytes: the first part, then the rest.
fn split_parts(span: Span<'_>, n: usize) -> (Span<'_>, Span<'_>) {
    let (a, b) = span;
    if n <= a.len() {
        let (a1, a2) = a.split_at(n);
        ((a1, &[]), (a2, b))
    } else {
        let (b1, b2) = b.split_at(n - a.len());
        ((a, b1), (&[], b2))
    }
}

/// Fills `plan` with the chunks (ring, length, cut) of the other rings to
/// write behind the current chunk, in turn after the current ring, and
/// returns how many. None if the current chunk is cut (its ring goes on
/// first); the plan ends with a cut chunk, for the same reason.
fn plan_gather(
    tc: &TcpConn,
    st: &mut SendState,
    plan: &mut [(usize, usize, bool); MAX_GATHER],
) -> usize {
    if st.cut || st.consumers.len() == 1 {
        return 0;
    }
    let mut planned = 0;
    let current = st.ring;
    // The rings in use after the current one (it comes last: skipped).
    for r in candidate_rings(&tc.conn, st).filter(|&r| r != current) {
        if planned == MAX_GATHER {
            break;
        }
        if let Some((len, cut)) = chunk_of(tc, st, r) {
            let plain = before_lent(tc, st, r, len);
            if plain < len {
                // Messages with lent payloads are spliced when the ring's
                // turn comes as the current chunk: the bytes before them
                // now, then that ring next.
                if plain > 0 {
                    plan[planned] = (r, plain, false);
                    planned += 1;
                }
                break;
            }
            plan[planned] = (r, len, cut);
            planned += 1;
            if cut {
                break;
            }
        }
    }
    planned
}

/// The least a connection's last write must have carried for the next
/// one to wait and coalesce (see [`TcpEngine::coalesces`]): a few small
/// messages that came during one write. One message per write (a thread
/// that sends and waits for the answer) never waits for coalescing.
const COALESCE_FROM: usize = 256;

/// Bytes the connection's rings have published and not yet written.
fn ready_len(conn: &Connection, st: &mut SendState) -> usize {
    let in_use = conn.rings_in_use();
    (0..st.consumers.len())
        .filter(|&r| in_use & (1 << r) != 0)
        .map(|r| conn.ring(r).unposted_len(&mut st.consumers[r]))
        .sum()
}

/// Whether [`next_chunk_ring`] would find data now.
fn has_sendable(conn: &Connection, st: &mut SendState) -> bool {
    candidate_rings(conn, st).any(|r| conn.ring(r).unposted_len(&mut st.consumers[r]) > 0)
}

/// The rings the next chunk may come from, in the order to try them: the
/// ones in use after the current ring in turn, or after a cut only the
/// current ring (nothing is sent until it has published more: a message
/// written in chunks needs the room its sent chunks free, nothing else).
fn candidate_rings(conn: &Connection, st: &SendState) -> impl Iterator<Item = usize> {
    let n = st.consumers.len();
    let (first, tries) = if st.cut {
        (st.ring, 1)
    } else {
        ((st.ring + 1) % n, n)
    };
    let in_use = conn.rings_in_use();
    (0..tries)
        .map(move |k| (first + k) % n)
        .filter(move |&r| in_use & (1 << r) != 0)
}
