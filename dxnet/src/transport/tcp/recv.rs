//! The receive side: the receive role's loop over readable sockets, reads
//! into pooled buffers (decrypting with TLS), chunk parsing and delivery.

use super::*;

impl TcpEngine {
    /// Body of the two receive threads: the one holding the receive role
    /// receives; the other is the standby (see [`crate::core::inline`]).
    pub(super) fn recv_thread(self: Arc<Self>, core: Arc<Core>) {
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
    pub(super) fn receive(&self, core: &Arc<Core>, r: &mut Receiver) -> Option<InlineWork> {
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
                    if ev.is_read_closed() || ev.is_error() {
                        // Remembered: this edge is not raised again, and a
                        // short read does not show the end of the stream.
                        tc.read_closed.store(true, Ordering::Relaxed);
                    }
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
                let outcome = match tc.read.take_or_note() {
                    Some(_reading) => self.read_once(core, &tc, Some(&mut inline)),
                    // A requester reads it (and hands it back if needed).
                    None => ReadOutcome::Drained,
                };
                match outcome {
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

    /// Reads one buffer from `tc`'s socket (the caller holds its reader)
    /// and delivers it; `inline`: the receive role's slot for a buffer to
    /// handle on the calling thread, `None` to deliver only.
    pub(super) fn read_once(
        &self,
        core: &Arc<Core>,
        tc: &TcpConn,
        inline: Option<&mut Option<InlineWork>>,
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
        let carried = tc.recv.lock().carry.take();
        let (mut buf, from) = match carried {
            Some(c) => (c.buf, c.filled),
            None => match core.take_recv_buffer() {
                Some(b) => (b, 0),
                None => return ReadOutcome::Starved,
            },
        };
        if let Some(tls) = &tc.tls {
            return self.read_tls(core, tc, tls, buf, from, inline);
        }
        let cap = buf.capacity();
        let n = match (&tc.stream).read(&mut buf.space()[from..]) {
            Ok(0) => {
                core.return_recv_buffer(buf);
                core.close_connection(&tc.conn, "peer closed the connection", true);
                return ReadOutcome::Closed;
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                self.put_back(core, tc, buf, from);
                return ReadOutcome::Drained;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {
                self.put_back(core, tc, buf, from);
                return ReadOutcome::More;
            }
            Err(e) => {
                core.return_recv_buffer(buf);
                core.close_connection(&tc.conn, &format!("receive failed: {e}"), true);
                return ReadOutcome::Closed;
            }
        };
        self.parse_and_deliver(core, tc, buf, from, n, inline);
        if from + n < cap && !tc.read_closed.load(Ordering::Relaxed) {
            // A short read of a stream socket means its queue is empty now;
            // with edge-triggered polling new data raises a new event, so
            // the extra read that would only return EAGAIN is skipped. Not
            // once the peer's FIN was seen: its event may have come while
            // the connection was already queued for reading (and was
            // dropped), so only a read that returns 0 ends the stream.
            ReadOutcome::Drained
        } else {
            ReadOutcome::More
        }
    }

    /// A buffer taken for a read that got nothing: back to the connection
    /// if it carries a message's first part (`filled` bytes), else to the
    /// pool.
    fn put_back(&self, core: &Core, tc: &TcpConn, buf: RecvBuffer, filled: usize) {
        if filled == 0 {
            core.return_recv_buffer(buf);
            return;
        }
        let mut rs = tc.recv.lock();
        // Checked under the lock `close` takes the carried buffer with
        // (after the connection is marked closed): a buffer put back later
        // would never return to the pool.
        if tc.conn.is_alive() {
            rs.carry = Some(Carry { buf, filled });
        } else {
            drop(rs);
            core.return_recv_buffer(buf);
        }
    }

    /// Marks the message data among bytes `from..from + n` of `buf` (those
    /// before are a carried message's first part, marked already) and
    /// hands the buffer to the incoming queue, or to `inline` (at most one
    /// buffer per turn of the receive role).
    ///
    /// A message the stream now ends inside, if it is at most half a buffer
    /// long, is kept whole for its receiver: the buffer stays with the
    /// connection for the next read if the message is all it holds, else
    /// the message's first part moves to a fresh buffer that the next read
    /// goes on filling. Its receiver then gets it in one buffer (lent, not
    /// reassembled: for messages of kilobytes the copy of one part saves an
    /// allocation and a copy of all of it). Finding that message means
    /// walking every message header, a few nanoseconds each; a stream
    /// that fills a buffer with messages of under [`WALK_MIN_AVG`] bytes on
    /// average stops the walk for good (its split messages are small and
    /// cheap to reassemble).
    pub(super) fn parse_and_deliver(
        &self,
        core: &Arc<Core>,
        tc: &TcpConn,
        mut buf: RecvBuffer,
        from: usize,
        n: usize,
        inline: Option<&mut Option<InlineWork>>,
    ) {
        let end = from + n;
        let mut rs = tc.recv.lock();
        let RecvState { parser, bounds, .. } = &mut *rs;
        // Stream position of the buffer's first message byte.
        let first = bounds.as_ref().map(|w| w.pos() - buf.data_len() as u64);
        let mut begun = 0;
        {
            let (data, mut segs) = buf.space_and_segments();
            parser.parse(
                &data[from..end],
                |r| {
                    let r = from + r.start..from + r.end;
                    if let Some(w) = bounds.as_mut() {
                        begun += w.feed(&data[r.clone()]);
                    }
                    segs.push(r);
                },
                |u| tc.conn.flow.on_confirm(u),
            );
        }
        if let (Some(w), Some(first)) = (bounds.as_ref(), first) {
            let cap = buf.capacity();
            let open = w
                .open()
                .filter(|m| m.start >= first && m.len.is_none_or(|l| l <= cap as u64 / 2));
            if end == cap && n < begun * WALK_MIN_AVG {
                // A full read (the stream is busy) of small messages.
                *bounds = None;
            }
            // Alive checked under the lock `close` takes the carried buffer
            // with: a buffer carried after it would be lost to the pool.
            if let Some(m) = open.filter(|_| {
                core.recv_buffers_available() > self.carry_min_free && tc.conn.is_alive()
            }) {
                let keep = (m.start - first) as usize;
                match carry(core, buf, keep, end) {
                    Carried::Kept(c) => {
                        rs.carry = Some(c);
                        return;
                    }
                    Carried::Moved(b, c) => {
                        rs.carry = c;
                        buf = b;
                    }
                }
            }
        }
        drop(rs);
        self.deliver(core, tc, buf, inline);
    }

    /// Hands `buf` to the incoming queue, or to `inline` (at most one
    /// buffer per turn of the receive role).
    fn deliver(
        &self,
        core: &Arc<Core>,
        tc: &TcpConn,
        buf: RecvBuffer,
        inline: Option<&mut Option<InlineWork>>,
    ) {
        match inline {
            Some(slot) if slot.is_none() => *slot = core.deliver_or_inline(&tc.conn, buf),
            _ => core.deliver(&tc.conn, buf),
        }
    }

    /// [`TcpEngine::read_once`] of a TLS connection: decrypted data first,
    /// then more records from the socket, until the buffer is full or the
    /// socket would block. TLS hands its plaintext over a record (at most
    /// 16 KiB) at a time: filling the buffer with as many as have arrived
    /// makes one hand-over per buffer, as a plain read does.
    pub(super) fn read_tls(
        &self,
        core: &Arc<Core>,
        tc: &TcpConn,
        tls: &Mutex<tls::Session>,
        mut buf: RecvBuffer,
        from: usize,
        inline: Option<&mut Option<InlineWork>>,
    ) -> ReadOutcome {
        let cap = buf.capacity();
        let mut filled = from;
        // Why the stream ended (the plaintext before it is delivered
        // first), or how reading stopped.
        let stop = loop {
            if filled == cap {
                break Ok(ReadOutcome::More);
            }
            // Taken per record, not per buffer: the send thread encrypts
            // under the same lock.
            let mut t = tls.lock();
            match t.reader().read(&mut buf.space()[filled..]) {
                Ok(0) => break Err("peer closed the connection (TLS)".to_string()),
                Ok(n) => {
                    filled += n;
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => break Err(format!("TLS receive failed: {e}")),
            }
            match t.read_tls(&mut &tc.stream) {
                Ok(0) => break Err("peer closed the connection".into()),
                Ok(_) => {
                    if let Err(e) = t.process_new_packets() {
                        break Err(format!("TLS error: {e}"));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    break Ok(ReadOutcome::Drained);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(format!("receive failed: {e}")),
            }
        };
        let mut t = tls.lock();
        let wants_write = if stop.is_err() {
            // Best effort: tell the peer why (a TLS alert).
            let _ = t.write_tls(&mut &tc.stream);
            false
        } else {
            t.wants_write()
        };
        drop(t);
        if wants_write {
            // TLS records to answer: not held for coalescing.
            tc.urgent.store(true, Ordering::Release);
            core.on_write_interest(tc.conn.peer);
        }
        if filled > from {
            self.parse_and_deliver(core, tc, buf, from, filled - from, inline);
        } else if stop.is_ok() {
            self.put_back(core, tc, buf, from);
        } else {
            core.return_recv_buffer(buf);
        }
        match stop {
            Ok(outcome) => outcome,
            Err(why) => {
                core.close_connection(&tc.conn, &why, true);
                ReadOutcome::Closed
            }
        }
    }
}

/// What [`carry`] did with a buffer.
enum Carried {
    /// The buffer holds nothing but the open message: kept for the next
    /// read, nothing to deliver.
    Kept(Carry),
    /// The buffer to deliver, and the fresh buffer holding the open
    /// message's first part (`None`: none free, or no room left to keep
    /// it; the decoder reassembles the message).
    Moved(RecvBuffer, Option<Carry>),
}

/// Keeps the message that `buf`'s first `end` bytes end inside in one
/// buffer: `keep` stream bytes of `buf` come before it.
fn carry(core: &Core, mut buf: RecvBuffer, keep: usize, end: usize) -> Carried {
    if keep == 0 {
        if end < buf.capacity() {
            return Carried::Kept(Carry { buf, filled: end });
        }
        return Carried::Moved(buf, None);
    }
    let Some(mut next) = core.take_recv_buffer() else {
        return Carried::Moved(buf, None);
    };
    let mut filled = 0;
    for r in buf.truncate_stream(keep) {
        let len = r.len();
        next.space()[filled..filled + len].copy_from_slice(&buf.bytes()[r]);
        filled += len;
    }
    next.push_segment(0..filled);
    Carried::Moved(buf, Some(Carry { buf: next, filled }))
}

/// Smallest average message size (bytes, over a read that filled its
/// buffer) for which a connection goes on walking message headers to keep
/// messages whole in one buffer (`TcpEngine::parse_and_deliver`).
const WALK_MIN_AVG: usize = 1024;

pub(super) enum ReadOutcome {
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
