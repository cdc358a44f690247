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
        let Some(mut buf) = core.take_recv_buffer() else {
            return ReadOutcome::Starved;
        };
        if let Some(tls) = &tc.tls {
            return self.read_tls(core, tc, tls, buf, inline);
        }
        let cap = buf.capacity();
        let n = match (&tc.stream).read(buf.space()) {
            Ok(0) => {
                core.return_recv_buffer(buf);
                core.close_connection(&tc.conn, "peer closed the connection", true);
                return ReadOutcome::Closed;
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                core.return_recv_buffer(buf);
                return ReadOutcome::Drained;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {
                core.return_recv_buffer(buf);
                return ReadOutcome::More;
            }
            Err(e) => {
                core.return_recv_buffer(buf);
                core.close_connection(&tc.conn, &format!("receive failed: {e}"), true);
                return ReadOutcome::Closed;
            }
        };
        self.parse_and_deliver(core, tc, buf, n, inline);
        if n < cap && !tc.read_closed.load(Ordering::Relaxed) {
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

    /// Marks the message data among the first `n` bytes of `buf` and hands
    /// the buffer to the incoming queue, or to `inline` (at most one buffer
    /// per turn of the receive role).
    pub(super) fn parse_and_deliver(
        &self,
        core: &Arc<Core>,
        tc: &TcpConn,
        mut buf: RecvBuffer,
        n: usize,
        inline: Option<&mut Option<InlineWork>>,
    ) {
        {
            let mut rs = tc.recv.lock();
            let (data, mut segs) = buf.space_and_segments();
            rs.parser
                .parse(&data[..n], |r| segs.push(r), |u| tc.conn.flow.on_confirm(u));
        }
        match inline {
            Some(slot) if slot.is_none() => *slot = core.deliver_or_inline(&tc.conn, buf),
            _ => core.deliver(&tc.conn, buf),
        }
    }

    /// [`TcpEngine::read_once`] of a TLS connection: decrypted data first,
    /// then more records from the socket until it would block.
    pub(super) fn read_tls(
        &self,
        core: &Arc<Core>,
        tc: &TcpConn,
        tls: &Mutex<tls::Session>,
        mut buf: RecvBuffer,
        inline: Option<&mut Option<InlineWork>>,
    ) -> ReadOutcome {
        let mut t = tls.lock();
        let fail = |t: &mut tls::Session, buf: RecvBuffer, why: String| {
            core.return_recv_buffer(buf);
            // Best effort: tell the peer why (a TLS alert).
            let _ = t.write_tls(&mut &tc.stream);
            core.close_connection(&tc.conn, &why, true);
            ReadOutcome::Closed
        };
        loop {
            match t.reader().read(buf.space()) {
                Ok(0) => {
                    return fail(&mut t, buf, "peer closed the connection (TLS)".into());
                }
                Ok(n) => {
                    let wants_write = t.wants_write();
                    drop(t);
                    if wants_write {
                        // TLS records to answer: not held for coalescing.
                        tc.urgent.store(true, Ordering::Release);
                        core.on_write_interest(tc.conn.peer);
                    }
                    self.parse_and_deliver(core, tc, buf, n, inline);
                    return ReadOutcome::More;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return fail(&mut t, buf, format!("TLS receive failed: {e}")),
            }
            match t.read_tls(&mut &tc.stream) {
                Ok(0) => return fail(&mut t, buf, "peer closed the connection".into()),
                Ok(_) => {
                    if let Err(e) = t.process_new_packets() {
                        return fail(&mut t, buf, format!("TLS error: {e}"));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let wants_write = t.wants_write();
                    drop(t);
                    core.return_recv_buffer(buf);
                    if wants_write {
                        tc.urgent.store(true, Ordering::Release);
                        core.on_write_interest(tc.conn.peer);
                    }
                    return ReadOutcome::Drained;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return fail(&mut t, buf, format!("receive failed: {e}")),
            }
        }
    }
}

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
