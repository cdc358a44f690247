//! The send path: serialize into the connection's ring buffer under flow
//! control, requests and responses, standalone frames, and who writes the
//! data out.

use super::*;
use crate::primitives::buffer_mem::{BufferMem, InFlight};
use crate::primitives::cpu;
use crate::primitives::in_order::{InOrderTrack, Outcome as InOrder};
use crate::transport::{Hold, Lent, LocalBytes, ResponseWait, Transport};
use std::task::{Context, Poll};

impl Core {
    /// Sends a typed message.
    pub fn send_message<M: Message>(&self, dest: NodeId, msg: &M) -> Result<()> {
        let len = codec::encoded_len(msg)?;
        with_encoded(msg, len, |payload| self.send_plain(dest, len, payload))
    }

    /// A plain message of type `M`, `len` bytes of `payload`, to `dest`.
    fn send_plain<M: Message>(
        &self,
        dest: NodeId,
        len: usize,
        payload: Payload<'_, M>,
    ) -> Result<()> {
        self.send_frame(
            dest,
            M::TYPE,
            M::SUBTYPE,
            MessageKind::Plain,
            0,
            len,
            None,
            None,
            |w| payload.fill(w),
        )
    }

    /// Sends a typed message to every node of `dests` (each once),
    /// serialized once: each destination's ring buffer gets a copy of the
    /// same bytes. Per destination as [`Core::send_message`].
    pub fn send_message_many<M: Message>(
        &self,
        dests: &[NodeId],
        msg: &M,
    ) -> Vec<(NodeId, Result<()>)> {
        let mut unique: Vec<NodeId> = Vec::with_capacity(dests.len());
        for d in dests {
            if !unique.contains(d) {
                unique.push(*d);
            }
        }
        let max = self.config.limits.max_message_size;
        let len = match codec::encoded_len(msg) {
            Ok(len) if len > max => {
                return unique
                    .into_iter()
                    .map(|d| (d, Err(Error::TooLarge { size: len, max })))
                    .collect();
            }
            Ok(len) => len,
            Err(e) => {
                let why = Error::from(e).to_string();
                return unique
                    .into_iter()
                    .map(|d| (d, Err(Error::Decode(why.clone()))))
                    .collect();
            }
        };
        with_encoded(msg, len, |payload| {
            unique
                .into_iter()
                .map(|d| (d, self.send_plain(d, len, payload)))
                .collect()
        })
    }

    /// Sends raw bytes as a message.
    pub fn send_raw(&self, dest: NodeId, t: u8, s: u8, payload: &[u8]) -> Result<()> {
        if t == 0 {
            return Err(Error::Config("message type 0 is reserved for dxnet".into()));
        }
        self.send_frame(
            dest,
            t,
            s,
            MessageKind::Plain,
            0,
            payload.len(),
            None,
            None,
            |w| w.write_all(payload),
        )
    }

    /// Sends the bytes of an application's buffer as a raw message of
    /// (`t`, `s`); returns once the buffer may change. Where the zero-copy
    /// policy registered the buffer with the device, the device reads the
    /// payload in place (the header from registered memory in the same
    /// work request) right behind the ring's data, and this waits for the
    /// send's completion; otherwise the bytes are copied into the ring
    /// as by [`Core::send_raw`].
    pub fn send_buffer(
        self: &Arc<Self>,
        dest: NodeId,
        t: u8,
        s: u8,
        mem: &Arc<BufferMem>,
    ) -> Result<()> {
        match self.start_send_buffer(dest, t, s, mem)? {
            None => Ok(()),
            Some(p) => self.wait_send(&p),
        }
    }

    /// Starts [`Core::send_buffer`]: `None` once it is done (copied),
    /// the send in flight otherwise (its buffer may change only once
    /// [`Core::wait_send`] or [`Core::poll_send`] reports it done).
    pub fn start_send_buffer(
        self: &Arc<Self>,
        dest: NodeId,
        t: u8,
        s: u8,
        mem: &Arc<BufferMem>,
    ) -> Result<Option<PendingSend>> {
        // Copied: urgent like a request, written out at once (on this
        // thread if the send thread sleeps), as the in-place send is.
        let copy = || -> Result<Option<PendingSend>> {
            if t == 0 {
                return Err(Error::Config("message type 0 is reserved for dxnet".into()));
            }
            // SAFETY: the caller borrows the buffer's handle for this
            // call, so no device writes its memory.
            let bytes = unsafe { mem.bytes() };
            let frame = Frame {
                t,
                s,
                kind: MessageKind::Plain,
                flush: Flush::Now,
                request_id: 0,
            };
            self.send_frame_as(dest, frame, bytes.len(), None, None, |w| w.write_all(bytes))
                .map(|()| None)
        };
        if t == 0 || mem.len() > self.config.limits.max_message_size || self.is_shut_down() {
            return copy(); // refused there, with the reason
        }
        if let Some(engine) = self
            .transport()
            .filter(|e| dest != self.own && e.lends_from().is_some_and(|from| mem.len() >= from))
        {
            return self.lend_buffer(&**engine, dest, t, s, mem).map(Some);
        }
        let rm = match self.transport() {
            Some(t) if dest != self.own => t.remote_memory(),
            _ => None,
        };
        let Some(guard) = self.zero_copy.use_buffer(rm, mem) else {
            return copy();
        };
        let rm = rm.expect("a registration implies the device");
        let InPlace {
            conn,
            header: hb,
            total,
            deadline,
        } = self.start_in_place(dest, t, s, mem)?;
        let guard = Arc::new(guard);
        let keep: Arc<dyn Hold> = guard.clone();
        let payload = LocalBytes {
            registration: &*guard.registration().handle,
            offset: 0,
            len: mem.len(),
            keep: &keep,
        };
        let seq = match rm.post_send(self, &conn, &hb, payload, deadline) {
            Ok(Some(seq)) => seq,
            Ok(None) => {
                conn.flow.on_confirm_bytes(total);
                return copy();
            }
            Err(e) => {
                conn.flow.on_confirm_bytes(total);
                return Err(e);
            }
        };
        drop((keep, guard));
        self.count_sent(&conn, total);
        Ok(Some(PendingSend {
            conn,
            wait: SendWait::Device(seq),
            deadline,
        }))
    }

    /// What a send of `mem` in place starts with: its message header, the
    /// connection, and the window for header and payload (the payload
    /// counts as if it were in the ring).
    fn start_in_place(&self, dest: NodeId, t: u8, s: u8, mem: &BufferMem) -> Result<InPlace> {
        let header = MessageHeader {
            msg_type: t,
            subtype: s,
            flags: MessageKind::Plain.flags(),
            request_id: 0,
            payload_len: mem.len() as u32,
        };
        let mut hb = [0u8; HEADER_LEN];
        header.encode(&mut hb);
        let total = (HEADER_LEN + mem.len()) as u64;
        let timeout = Duration::from_millis(self.config.limits.send_timeout_ms);
        let deadline = Instant::now() + timeout;
        let conn = self.connection(dest, deadline)?;
        let open = || conn.state() == ConnState::Open;
        conn.flow
            .acquire(
                cpu::current(),
                total,
                &Deadline::at(deadline),
                &self.config.park,
                open,
            )
            .map_err(|e| match e {
                FlowWaitError::Timeout => Error::Timeout(Waited::FlowControl),
                FlowWaitError::Closed => {
                    Error::Unreachable(dest, Unreachable::ConnectionLost(conn.close_reason()))
                }
            })?;
        Ok(InPlace {
            conn,
            header: hb,
            total,
            deadline,
        })
    }

    /// [`Core::start_send_buffer`] on an engine that writes payloads from
    /// the buffer in place ([`Transport::lend`], TCP): only the message
    /// header goes into the ring; the engine writes the payload right
    /// behind it and reports when it is out.
    fn lend_buffer(
        &self,
        engine: &dyn Transport,
        dest: NodeId,
        t: u8,
        s: u8,
        mem: &Arc<BufferMem>,
    ) -> Result<PendingSend> {
        let InPlace {
            conn,
            header: hb,
            total,
            deadline,
        } = self.start_in_place(dest, t, s, mem)?;
        let lost = |conn: &Connection| {
            Error::Unreachable(dest, Unreachable::ConnectionLost(conn.close_reason()))
        };
        let track = Arc::new(InOrderTrack::new());
        // Left to the send thread, which writes many such payloads with
        // one system call (a thread writing its own would make one each).
        let notify = || {
            self.on_write_interest(dest);
        };
        let ring = conn.ring_for_thread(cpu::current());
        let res =
            conn.ring(ring)
                .write_message(HEADER_LEN, &Deadline::at(deadline), &notify, |w| {
                    // Before the header's commit: the engine knows of the
                    // payload before it can see the header.
                    let lent = Lent::new(HEADER_LEN, InFlight::reading(mem.clone()), track.clone());
                    let start = w.msg_end() - HEADER_LEN as u64;
                    engine
                        .lend(&conn, ring, start, lent)
                        .map_err(|_| std::io::Error::other("the connection closed"))?;
                    w.write_all(&hb)
                });
        match res {
            Ok(end) => {
                conn.note_written(ring, end);
                self.count_sent(&conn, total);
                self.zero_copy.stats.lent.fetch_add(1, Ordering::Relaxed);
                Ok(PendingSend {
                    conn,
                    wait: SendWait::Lent(track),
                    deadline,
                })
            }
            Err(OrbError::Timeout) => {
                conn.flow.on_confirm_bytes(total);
                Err(Error::Timeout(Waited::RingBuffer))
            }
            Err(OrbError::Closed) => Err(lost(&conn)),
            Err(OrbError::Corrupted) => {
                // The engine refused the payload: the connection closed.
                self.close_connection(&conn, "connection closed during a send", true);
                Err(lost(&conn))
            }
        }
    }

    /// Blocks until the send in flight `p` completed (its buffer may
    /// change then).
    pub fn wait_send(self: &Arc<Self>, p: &PendingSend) -> Result<()> {
        let seq = match &p.wait {
            SendWait::Lent(track) => return send_outcome(p, track.wait(1, p.deadline)),
            SendWait::Device(seq) => *seq,
        };
        let Some(rm) = self.transport().and_then(|t| t.remote_memory()) else {
            return Err(Error::Shutdown);
        };
        send_outcome(p, self.wait_device_part(rm, &p.conn, seq, p.deadline))
    }

    /// [`Core::wait_send`] for a future: registers `cx`'s waker while the
    /// send is in flight.
    pub fn poll_send(&self, p: &PendingSend, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let seq = match &p.wait {
            SendWait::Lent(track) => {
                let outcome = track.register(1, cx.waker());
                if outcome == InOrder::Pending && Instant::now() < p.deadline {
                    return Poll::Pending;
                }
                return Poll::Ready(send_outcome(p, outcome));
            }
            SendWait::Device(seq) => *seq,
        };
        let Some(rm) = self.transport().and_then(|t| t.remote_memory()) else {
            return Poll::Ready(Err(Error::Shutdown));
        };
        let outcome = p.conn.parts.register(seq, cx.waker());
        if outcome == InOrder::Pending && Instant::now() < p.deadline {
            // Completions are retired by the engine now.
            rm.waiting();
            return Poll::Pending;
        }
        Poll::Ready(send_outcome(p, outcome))
    }

    /// Sends a request; the handle waits for its response. `blocking`: the
    /// caller waits for the response right after (it may wait briefly for
    /// the connection to write the request itself, see [`Flush`]).
    pub fn send_request<R: Request>(
        &self,
        dest: NodeId,
        req: &R,
        timeout: Duration,
        blocking: bool,
    ) -> Result<PendingResponse> {
        let len = codec::encoded_len(req)?;
        let now = Instant::now();
        let (id, pending) = self.requests.insert_at(dest, now, timeout, true)?;
        if self.breakdown.is_some() {
            breakdown::take_committed();
        }
        let deadline = pending.deadline();
        let frame = Frame {
            t: R::TYPE,
            s: R::SUBTYPE,
            kind: MessageKind::Request,
            flush: if blocking {
                Flush::NowThenBlock
            } else {
                Flush::Now
            },
            request_id: id,
        };
        with_encoded(req, len, |payload| {
            self.send_frame_as(dest, frame, len, Some(deadline), Some(now), |w| {
                payload.fill(w)
            })
        })?;
        pending.mark_sent();
        Ok(pending)
    }

    /// Sends a request of (`t`, `s`) whose payload of `len` bytes `fill`
    /// writes (dxnet's own requests, e.g. one-sided operations).
    pub(super) fn send_request_frame(
        &self,
        dest: NodeId,
        t: u8,
        s: u8,
        len: usize,
        timeout: Duration,
        fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
    ) -> Result<PendingResponse> {
        let now = Instant::now();
        let (id, pending) = self.requests.insert_at(dest, now, timeout, false)?;
        let deadline = pending.deadline();
        self.send_frame(
            dest,
            t,
            s,
            MessageKind::Request,
            id,
            len,
            Some(deadline),
            Some(now),
            fill,
        )?;
        Ok(pending)
    }

    /// Blocks until `p`'s outcome is known: waits without parking first (a
    /// response that arrives meanwhile is taken without waking this
    /// thread), then parks. How long: [`park::RequestSpinPolicy`]. On an
    /// engine that supports it this thread reads its connection itself
    /// meanwhile (TCP: until the outcome is in, sleeping on the socket
    /// after the wait; InfiniBand: while it waits, see
    /// `ReceiveRole::help`), see [`Transport::read_while_waiting`].
    pub fn wait_response(&self, p: PendingResponse) -> Outcome {
        let park = &self.config.park;
        if p.is_done() {
            return p.wait();
        }
        let mut waiting = park::RequestWait::enter(park);
        let _blocked = self.requests.block();
        // More requesters blocked than `park.max_request_spinners` allows
        // (no limit by default): this one neither waits without parking
        // nor reads its connection; it parks at once.
        let may_wait = waiting.may_spin();
        let may_spin = park.request_spin_us > 0 && may_wait;
        let start = Instant::now();
        let conn = self.connections.get(p.peer());
        let spin = match (&conn, may_spin) {
            (_, false) => Duration::ZERO,
            (Some(c), true) => c.request_spin.spin(park),
            (None, true) => park::RequestSpinPolicy::full(park),
        };
        inline::before_blocking();
        let until = (start + spin).min(p.deadline());
        let read = self.transport().filter(|_| may_wait).and_then(|t| {
            t.read_while_waiting(&ResponseWait {
                peer: p.peer(),
                done: &|| p.is_done(),
                on_done: &|w| p.set_waker(w),
                may_spin,
                spin_until: until,
                deadline: p.deadline(),
            })
        });
        let answered = match read {
            Some(answered) => answered,
            None if may_spin => {
                p.spin_until(until);
                p.is_done()
            }
            None => {
                // Parks: no longer one of the process's spinning threads.
                waiting.stop_spinning();
                return p.wait();
            }
        };
        waiting.stop_spinning();
        if let (Some(c), true) = (&conn, may_spin) {
            let spun = spin.min(p.deadline().saturating_duration_since(start));
            c.request_spin.record(park, spun, answered);
        }
        p.wait()
    }

    pub(super) fn send_response<M: Message>(&self, dest: NodeId, id: u32, resp: &M) -> Result<()> {
        if self.breakdown.is_some() {
            breakdown::handler_returned();
        }
        let len = codec::encoded_len(resp)?;
        with_encoded(resp, len, |payload| {
            self.send_frame(
                dest,
                M::TYPE,
                M::SUBTYPE,
                MessageKind::Response,
                id,
                len,
                None,
                Some(Instant::now()),
                |w| payload.fill(w),
            )
        })
    }

    pub(super) fn send_error_response(&self, dest: NodeId, id: u32, code: u8, t: u8, s: u8) {
        let payload = [code, t, s];
        let res = self.send_frame(
            dest,
            t,
            s,
            MessageKind::ErrorResponse,
            id,
            3,
            None,
            Some(Instant::now()),
            |w| w.write_all(&payload),
        );
        if let Err(e) = res {
            tracing::debug!("error response to {dest} not sent: {e}");
        }
    }

    /// Serializes one message (header + payload of `payload_len` bytes
    /// written by `fill`) into the destination's ring buffer, or sends a
    /// small request or response at once (see
    /// [`Transport::send_standalone`]). `now`: the caller's clock reading,
    /// if it took one (requests and responses); plain messages read no
    /// clock unless they block or queue their connection for the send
    /// thread (see [`Deadline`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn send_frame<F>(
        &self,
        dest: NodeId,
        t: u8,
        s: u8,
        kind: MessageKind,
        request_id: u32,
        payload_len: usize,
        deadline: Option<Instant>,
        now: Option<Instant>,
        fill: F,
    ) -> Result<()>
    where
        F: FnOnce(&mut dyn Write) -> std::io::Result<()>,
    {
        let flush = if kind == MessageKind::Plain {
            Flush::Aggregate
        } else {
            Flush::Now
        };
        let frame = Frame {
            t,
            s,
            kind,
            flush,
            request_id,
        };
        self.send_frame_as(dest, frame, payload_len, deadline, now, fill)
    }

    /// [`Core::send_frame`] of a frame that says when it leaves ([`Flush`])
    /// apart from its kind.
    pub(super) fn send_frame_as<F>(
        &self,
        dest: NodeId,
        frame: Frame,
        payload_len: usize,
        deadline: Option<Instant>,
        now: Option<Instant>,
        fill: F,
    ) -> Result<()>
    where
        F: FnOnce(&mut dyn Write) -> std::io::Result<()>,
    {
        let Frame {
            t,
            s,
            kind,
            flush,
            request_id,
        } = frame;
        if payload_len > self.config.limits.max_message_size {
            return Err(Error::TooLarge {
                size: payload_len,
                max: self.config.limits.max_message_size,
            });
        }
        if self.is_shut_down() {
            return Err(Error::Shutdown);
        }
        let header = MessageHeader {
            msg_type: t,
            subtype: s,
            flags: kind.flags(),
            request_id,
            payload_len: payload_len as u32,
        };
        let mut hb = [0u8; HEADER_LEN];
        header.encode(&mut hb);
        let total = HEADER_LEN + payload_len;
        let send_timeout = Duration::from_millis(self.config.limits.send_timeout_ms);
        let deadline = Deadline::after(send_timeout, deadline);
        if let Some(now) = now {
            deadline.start(now);
        }

        if dest == self.own {
            return self.send_local(&hb, total, deadline.get(), fill);
        }
        let mut guard = self.connections.guard(dest);
        let slow;
        let conn: &Connection = match guard.as_deref() {
            Some(c) if c.state() == ConnState::Open => c,
            _ => {
                // Lets a closed connection go before the wait for a new one
                // (it is freed once no reader holds it).
                drop(guard.take());
                slow = self.connection(dest, deadline.get())?;
                &slow
            }
        };
        if let Some(now) = now {
            conn.touch(self.tick(now));
        }
        // Responses are sent by handler threads. Once a response to this
        // peer timed out (a peer that does not read, or ignores flow
        // control), the next ones are tried without waiting until one fits
        // again: otherwise such a peer, sending requests, would hold a
        // handler thread for `send_timeout_ms` per request and its
        // unprocessed buffers would fill the incoming queue of every
        // connection.
        let response = kind.is_response();
        let deadline = if response && conn.responses_stalled.load(Ordering::Relaxed) {
            Deadline::at(Instant::now())
        } else {
            deadline
        };
        let res = self.send_frame_on(conn, dest, &hb, total, (kind, flush), &deadline, fill);
        if response {
            let stalled = matches!(res, Err(Error::Timeout(_)));
            if conn.responses_stalled.load(Ordering::Relaxed) != stalled {
                conn.responses_stalled.store(stalled, Ordering::Relaxed);
            }
        }
        res
    }

    /// [`Core::send_frame`] once the connection is known and open.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn send_frame_on<F>(
        &self,
        conn: &Connection,
        dest: NodeId,
        hb: &[u8; HEADER_LEN],
        total: usize,
        (kind, flush): (MessageKind, Flush),
        deadline: &Deadline,
        fill: F,
    ) -> Result<()>
    where
        F: FnOnce(&mut dyn Write) -> std::io::Result<()>,
    {
        // Responses are outside the flow-control window: the requester
        // asked for them (its outstanding requests bound them) and takes
        // them off the wire at once, even while its handler is blocked.
        // Counting them would let two nodes whose windows are full of each
        // other's messages deadlock: each one's handler waits for window
        // to answer a request, which only the other's blocked handler
        // could free.
        let flow_controlled = !kind.is_response();
        // For the flow-control credit slot.
        let cpu = cpu::current();
        let window_back = |total: usize| {
            if flow_controlled {
                conn.flow.on_confirm_bytes(total as u64);
            }
        };
        if flow_controlled {
            let open = || conn.state() == ConnState::Open;
            conn.flow
                .acquire(cpu, total as u64, deadline, &self.config.park, open)
                .map_err(|e| match e {
                    FlowWaitError::Timeout => Error::Timeout(Waited::FlowControl),
                    FlowWaitError::Closed => {
                        Error::Unreachable(dest, Unreachable::ConnectionLost(conn.close_reason()))
                    }
                })?;
        }
        // A small request or response goes out at once, outside the ring
        // buffer, where the engine has such a path (InfiniBand, loopback): encoded on
        // the stack first, and into the ring after all if the engine
        // declines (see `Transport::send_standalone`).
        let mut small;
        let mut encoded_frame: Option<&[u8]> = None;
        let mut fill = Some(fill);
        let urgent = flush != Flush::Aggregate;
        if urgent && total <= STANDALONE_FRAME_MAX {
            if let Some(t) = self.transport().filter(|t| total <= t.standalone_max()) {
                small = [0u8; STANDALONE_FRAME_MAX];
                small[..HEADER_LEN].copy_from_slice(hb);
                let mut rest: &mut [u8] = &mut small[HEADER_LEN..total];
                let encoded = fill.take().map_or(Ok(()), |f| f(&mut rest)).and_then(|()| {
                    if rest.is_empty() {
                        Ok(())
                    } else {
                        Err(std::io::Error::other(
                            "serialized size differs from computed size",
                        ))
                    }
                });
                if let Err(e) = encoded {
                    // Nothing was written: give the window back.
                    window_back(total);
                    return Err(Error::Decode(format!("cannot serialize message: {e}")));
                }
                if self.breakdown.is_some() {
                    breakdown::committed();
                }
                if t.send_standalone(self, conn, &small[..total]) {
                    self.count_sent(conn, total as u64);
                    return Ok(());
                }
                encoded_frame = Some(&small[..total]);
            }
        }
        let notify = || {
            if urgent {
                if self.breakdown.is_some() {
                    breakdown::committed();
                }
                self.on_urgent_write_interest(dest, flush == Flush::NowThenBlock)
            } else if let Some(now) = self.plain_at_low_rate(conn) {
                // Nothing to aggregate with: written on this thread if the
                // send thread still sleeps (one wake-up less, as raw
                // sockets at that rate).
                self.on_urgent_write_interest(dest, false);
                conn.touch(self.tick(now));
            } else if self.on_write_interest(dest) {
                // A plain message (no clock reading of its own), newly
                // queued for the send thread: this connection is in use now
                // (least-recently-used closing); the clock is read once per
                // send-thread round rather than per message.
                conn.touch(self.tick(Instant::now()));
            }
        };
        // Read again: a send that waited for window has often moved to
        // another core meanwhile, and writing into the old core's ring
        // would move that ring's lines between cores.
        let ring = conn.ring_for_thread(cpu::current());
        let res = conn
            .ring(ring)
            .write_message(total, deadline, &notify, |w| match (fill, encoded_frame) {
                (Some(fill), _) => {
                    w.write_all(hb)?;
                    fill(w)
                }
                (None, Some(frame)) => w.write_all(frame),
                (None, None) => unreachable!("a frame is either encoded or still to fill"),
            });
        match res {
            Ok(end) => {
                conn.note_written(ring, end);
                self.count_sent(conn, total as u64);
                Ok(())
            }
            Err(OrbError::Timeout) => {
                // Nothing was written: give the window back.
                window_back(total);
                Err(Error::Timeout(Waited::RingBuffer))
            }
            Err(OrbError::Closed) => Err(Error::Unreachable(
                dest,
                Unreachable::ConnectionLost(conn.close_reason()),
            )),
            Err(OrbError::Corrupted) => {
                // Still installed unless it closed meanwhile.
                if let Some(c) = self.connections.get(dest).filter(|c| c.id == conn.id) {
                    self.close_connection(&c, "message stream corrupted by a failed send", true);
                }
                Err(Error::Timeout(Waited::RingBuffer))
            }
        }
    }

    /// With `park.direct_writes`: whether a plain message just committed for
    /// `conn` comes alone, so that waking the send thread buys no
    /// aggregation ([`super::direct_write`]); `Some` with the clock reading
    /// if so. Reads the clock on every plain message that newly queues its
    /// connection (as the least-recently-used tracking does anyway).
    fn plain_at_low_rate(&self, conn: &Connection) -> Option<Instant> {
        if !self.config.park.direct_writes {
            return None;
        }
        let now = Instant::now();
        let parked = self.transport()?.sender_parked_for(now)?;
        let ns = now.duration_since(self.started).as_nanos() as u64;
        conn.direct_writes
            .decide(ns, parked >= super::direct_write::ALONE_GAP)
            .then_some(now)
    }

    /// Delivers a message to the own node through the handler threads.
    pub(super) fn send_local<F>(
        &self,
        hb: &[u8; HEADER_LEN],
        total: usize,
        deadline: Instant,
        fill: F,
    ) -> Result<()>
    where
        F: FnOnce(&mut dyn Write) -> std::io::Result<()>,
    {
        let mut v = Vec::with_capacity(total);
        v.extend_from_slice(hb);
        fill(&mut v).map_err(|e| Error::Decode(format!("cannot serialize message: {e}")))?;
        if v.len() != total {
            return Err(Error::Decode(
                "serialized size differs from computed size".into(),
            ));
        }
        if !self.incoming.has_room()
            && !self.local_room.wait_until(&self.config.park, deadline, || {
                self.incoming.has_room() || self.is_shut_down()
            })
        {
            return Err(Error::Timeout(Waited::IncomingQueue));
        }
        let depth = match inline::current_conn() {
            Some(c) if c.id == 0 => self
                .locals
                .iter()
                .position(|l| Arc::ptr_eq(l, &c))
                .map_or(0, |i| (i + 1).min(LOCAL_DEPTHS - 1)),
            _ => 0,
        };
        self.enqueue(&self.locals[depth], Incoming::Local(v));
        self.count_sent(&self.locals[depth], total as u64);
        Ok(())
    }
}

/// Messages up to this size are serialized into the thread's scratch buffer
/// before their ring space is reserved; larger ones straight into the ring.
const PRE_ENCODE_MAX: usize = 16 << 10;

thread_local! {
    /// The thread's scratch buffer for [`with_encoded`] (grows to the
    /// thread's message sizes once, then no allocation per message).
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A message's bytes as [`Core::send_frame`] writes them.
enum Payload<'a, T: ?Sized> {
    /// Serialized already.
    Bytes(&'a [u8]),
    /// To serialize into the ring.
    Serde(&'a T),
}

// By hand: derived impls would ask `T: Copy`.
impl<T: ?Sized> Clone for Payload<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: ?Sized> Copy for Payload<'_, T> {}

impl<T: serde::Serialize + ?Sized> Payload<'_, T> {
    fn fill(self, w: &mut dyn Write) -> std::io::Result<()> {
        match self {
            Payload::Bytes(b) => w.write_all(b),
            Payload::Serde(m) => codec::encode_into(w, m),
        }
    }
}

/// Runs `send` with `msg`'s payload (`len` bytes), serialized first into
/// the thread's scratch buffer when it is small. Serde writes element by
/// element, so serializing straight into the ring made a `Vec<u8>` payload
/// a call per byte through the ring's writer, and the ring space stayed
/// reserved (the send thread waiting behind it) while it ran. Single sends
/// of 64 B `Vec<u8>` messages to 8 nodes: ~6× the rate (`cargo run
/// --release --example multisend`). A send run inside another's on the
/// same thread (an inline receiver sending while its caller blocks)
/// serializes into the ring.
fn with_encoded<T: serde::Serialize + ?Sized, R>(
    msg: &T,
    len: usize,
    send: impl FnOnce(Payload<'_, T>) -> R,
) -> R {
    if len > PRE_ENCODE_MAX {
        return send(Payload::Serde(msg));
    }
    SCRATCH.with(|scratch| match scratch.try_borrow_mut() {
        Ok(mut buf) => {
            buf.clear();
            if codec::encode_append(&mut buf, msg).is_ok() && buf.len() == len {
                send(Payload::Bytes(&buf))
            } else {
                // The send reports the failure (and gives the window back).
                send(Payload::Serde(msg))
            }
        }
        Err(_) => send(Payload::Serde(msg)),
    })
}

/// What a frame is besides its bytes (see [`Core::send_frame_as`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Frame {
    t: u8,
    s: u8,
    kind: MessageKind,
    flush: Flush,
    request_id: u32,
}

/// When a frame's bytes leave for the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Flush {
    /// Left for the send thread, which aggregates them with others.
    Aggregate,
    /// Written out at once (on this thread if the send thread sleeps).
    Now,
    /// As `Now`, for a request its sender blocks on right after: the sender
    /// has nothing else to do meanwhile, so it may wait briefly for another
    /// thread's write on the connection to end and write its request
    /// itself ([`Transport::try_flush`]'s `may_wait`).
    NowThenBlock,
}

/// A send of a buffer in place, in flight (see [`Core::start_send_buffer`]).
#[derive(Debug)]
pub struct PendingSend {
    conn: Arc<Connection>,
    wait: SendWait,
    deadline: Instant,
}

/// A send in place, started (see [`Core::start_in_place`]).
struct InPlace {
    conn: Arc<Connection>,
    header: [u8; HEADER_LEN],
    /// Header and payload bytes, taken from the window.
    total: u64,
    deadline: Instant,
}

/// Where a send in place reports its outcome.
#[derive(Debug)]
enum SendWait {
    /// The device's send: its number in the connection's track of device
    /// parts.
    Device(u64),
    /// A payload lent to the engine ([`Transport::lend`]).
    Lent(Arc<InOrderTrack>),
}

fn send_outcome(p: &PendingSend, outcome: InOrder) -> Result<()> {
    match outcome {
        InOrder::Done => Ok(()),
        InOrder::Pending => Err(Error::Timeout(Waited::Device)),
        InOrder::Lost | InOrder::Refused => Err(Error::Unreachable(
            p.conn.peer,
            Unreachable::ConnectionLost(p.conn.close_reason()),
        )),
    }
}
