//! The send side: the send thread, posting ring-buffer data as RDMA sends
//! with immediate data (zero-copy from the registered ring), send
//! completions and the watchdog.

use super::*;
use crate::transport::driver::SendSide;

/// The InfiniBand engine's part of its send thread: posting ring
/// buffers, retiring send completions, the watchdog.
pub(super) struct IbSender {
    pub(super) engine: Arc<IbEngine>,
    pub(super) wcs: Vec<ibv::WorkCompletion>,
    pub(super) last_watch: Instant,
}

impl SendSide for IbSender {
    fn stopping(&self) -> bool {
        self.engine.stop.load(Ordering::Acquire)
    }

    fn round(&mut self, core: &Core) {
        let e = &self.engine;
        if e.outstanding_total.load(Ordering::Acquire) > 0 {
            // Completions alone do not restart the idle clock: a thread
            // that spins for them would take the spinning budget from the
            // receive thread, whose spinning is what keeps round trips
            // short.
            e.poll_send(core, &mut self.wcs, None);
            if self.last_watch.elapsed() >= Duration::from_millis(100) {
                self.last_watch = Instant::now();
                e.watchdog(core);
            }
        }
    }

    fn write(&mut self, core: &Core, peer: u16) {
        if let Some(ic) = core.engine_half::<IbConn>(NodeId(peer)) {
            self.engine.post(core, &ic);
        }
    }

    fn busy(&mut self, busy: bool) {
        self.engine.send_busy.store(busy, Ordering::SeqCst);
    }

    fn idle(&mut self, core: &Core, park: Option<Duration>) -> bool {
        let Some(max_park) = park else {
            return false;
        };
        let e = &self.engine;
        // Completions outstanding that someone waits for (a producer
        // blocked on a full ring, a post refused for a full send queue):
        // look again soon. Otherwise they wait for the next post or wake-up
        // (inline posters retire them too, see `try_flush`): a timer per
        // send would wake this thread thousands of times a second in a
        // ping-pong. Cleared before the check: a wake after it is not lost.
        e.send_woken.store(false, Ordering::SeqCst);
        let pressure = e.outstanding_total.load(Ordering::Acquire) > 0
            && (e.sq_refused.swap(false, Ordering::AcqRel)
                || e.polling_for_waiters()
                || e.by_qpn.lock().values().any(|ic| ic.conn.orb.has_waiters()));
        let max = if pressure {
            Duration::from_micros(200)
        } else {
            max_park.min(Duration::from_millis(100))
        };
        e.send_signal.park_unless(
            || {
                !core.write_interest_is_empty()
                    || e.send_woken.load(Ordering::SeqCst)
                    || e.stop.load(Ordering::Acquire)
            },
            max,
        );
        false
    }
}

impl IbEngine {
    /// A peer that died without a word leaves our sends without completions
    /// on some devices (no retry-exceeded error): a connection whose oldest
    /// send has not completed within the send timeout is declared broken.
    pub(super) fn watchdog(&self, core: &Core) {
        let limit = Duration::from_millis(
            core.config()
                .limits
                .send_timeout_ms
                .max(core.config().limits.connect_timeout_ms),
        );
        let conns: Vec<_> = self.by_qpn.lock().values().cloned().collect();
        let now = Instant::now();
        for ic in conns {
            // Stale: the same chain at the front since longer than `limit`
            // (as the watchdog saw it; it runs often compared to `limit`).
            let stale = {
                let mut st = ic.send.lock();
                let front = st.chains.front().map(|c| c.seq);
                match (front, st.front_seen) {
                    (Some(seq), Some((seen, since))) if seq == seen => {
                        now.duration_since(since) > limit
                    }
                    (Some(seq), _) => {
                        st.front_seen = Some((seq, now));
                        false
                    }
                    (None, _) => {
                        st.front_seen = None;
                        false
                    }
                }
            };
            if stale {
                core.close_connection(
                    &ic.conn,
                    &format!("no send completion within {limit:?}: peer unresponsive"),
                    true,
                );
            }
        }
    }

    /// Retires send completions; connections with data left to post are
    /// handed to the send thread, except `posting` (an inline poster about
    /// to post its data itself: waking the send thread for it would cost a
    /// wake-up per round trip).
    pub(super) fn poll_send(
        &self,
        core: &Core,
        wcs: &mut [ibv::WorkCompletion],
        posting: Option<NodeId>,
    ) -> bool {
        let n = match self.send_cq.poll(wcs) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(
                    "{}: polling the send completion queue failed: {e}",
                    self.own
                );
                return false;
            }
        };
        for wc in &wcs[..n] {
            // The peer's id travels in the work request id.
            let ic = self.completion_conn(core, NodeId((wc.wr_id() >> 48) as u16), wc.qp_num());
            tracing::trace!(
                "{}: send completion qp {} status {} known {}",
                self.own,
                wc.qp_num(),
                wc.status_name(),
                ic.is_some()
            );
            let Some(ic) = ic else { continue };
            let seq = wr_seq(wc.wr_id());
            if !wc.is_success() {
                if wc.is_remote_access_error() {
                    // A one-sided part the peer refused (a revoked region,
                    // a forged descriptor): the chains before it completed;
                    // its caller learns why; the queue pair is in error,
                    // the connection closes.
                    self.retire_chains(&ic, seq, true);
                }
                if !wc.is_flush() {
                    core.close_connection(
                        &ic.conn,
                        &format!("send completion error: {}", wc.status_name()),
                        true,
                    );
                }
                continue;
            }
            let more = self.retire_chains(&ic, seq, false);
            if more && posting != Some(ic.conn.peer) {
                core.on_write_interest(ic.conn.peer);
            }
        }
        n > 0
    }

    /// Retires `ic`'s chains up to the one numbered `seq`, whose completion
    /// came: it and the unsignalled ones before it are complete, or, with
    /// `refused`, it failed (a remote access error) after those before it
    /// completed. Their one-sided parts' outcomes go to the connection's
    /// track. Returns whether the connection has data left to post.
    fn retire_chains(&self, ic: &IbConn, seq: u64, refused: bool) -> bool {
        let mut parts: [Option<one_sided::PartWr>; 4] = Default::default();
        loop {
            let mut n = 0;
            let (more, finished) = {
                let mut st = ic.send.lock();
                while n < parts.len() {
                    let Some(c) = st.chains.front() else { break };
                    if c.seq > seq {
                        break;
                    }
                    let c = st.chains.pop_front().expect("front exists");
                    ic.conn.orb.mark_completed(&mut st.consumer, c.bytes);
                    if c.one_sided_wr {
                        st.parts_outstanding -= c.wrs;
                    } else {
                        st.outstanding -= c.wrs;
                    }
                    self.outstanding_total
                        .fetch_sub(c.wrs as u64, Ordering::AcqRel);
                    if let Some(p) = c.one_sided {
                        // A read's bytes are in place, and memory in
                        // place is the caller's again, before the track
                        // says it is done.
                        self.land_read(&p);
                        if let Some(k) = &p.keep {
                            k.device_done();
                        }
                        parts[n] = Some(p);
                        n += 1;
                    }
                }
                let finished = st.chains.front().is_none_or(|c| c.seq > seq);
                if finished {
                    // Under the send lock, as the close that loses the
                    // rest: the track sees one order of events.
                    if refused {
                        ic.conn.parts.complete_through(seq - 1);
                        ic.conn.parts.refuse(seq);
                    } else {
                        ic.conn.parts.complete_through(seq);
                    }
                }
                let more = ic.conn.orb.unposted_len(&mut st.consumer) > 0
                    || ic.conn.flow.pending_units() > 0;
                (more, finished)
            };
            for p in parts.iter_mut().take(n) {
                self.retire_part(p.take().expect("filled"));
            }
            if finished {
                return more;
            }
        }
    }

    /// Posts `ic`'s unposted ring-buffer data (and pending flow-control
    /// units) as one chain of SEND_WITH_IMM work requests.
    pub(super) fn post(&self, core: &Core, ic: &IbConn) {
        let conn = &ic.conn;
        if conn.state() != ConnState::Open {
            return;
        }
        let mut guard = ic.send.lock();
        if let Err(e) = self.post_locked(ic, &mut guard) {
            drop(guard);
            core.close_connection(conn, &format!("posting sends failed: {e}"), true);
        }
    }

    /// [`IbEngine::post`] under the connection's send lock; the error
    /// closes the connection.
    pub(super) fn post_locked(
        &self,
        ic: &IbConn,
        st: &mut SendState,
    ) -> std::result::Result<(), String> {
        let conn = &ic.conn;
        let free = self.sq_size.saturating_sub(st.outstanding);
        if free == 0 {
            // A completion will re-register interest; the send thread
            // must poll for it.
            self.sq_refused.store(true, Ordering::Release);
            return Ok(());
        }
        let units = conn.flow.take_units(u8::MAX as u32) as u8;
        // The slices are handed to the device (as addresses in the
        // registered ring) before `mark_completed`, called under the same
        // lock once their sends completed, frees their bytes.
        let (a, b) = conn
            .orb
            .unposted(&mut st.consumer, free as usize * self.max_recv_size);
        let total = a.len() + b.len();
        if total == 0 && units == 0 {
            return Ok(());
        }
        tracing::trace!(
            "{}: posting {total} bytes, {units} units to {} (free {free})",
            self.own,
            conn.peer
        );
        let base = ic.orb_mr.addr() as usize;
        let imm_first = wire::encode_imm(self.own.0, units);
        let imm_rest = wire::encode_imm(self.own.0, 0);
        let mut st_chain = std::mem::take(&mut st.chain);
        st_chain.clear();
        let mut wrs = 0u32;
        let seq = st.next_seq;
        let wr_id = send_wr_id(conn, seq);
        let result: std::result::Result<(), String> = (|| {
            if total == 0 {
                st_chain.push(
                    wr_id,
                    ibv::SendOp::SendWithImm(imm_first),
                    &[],
                    ibv::SendFlags::SIGNALED,
                );
                wrs = 1;
                return Ok(());
            }
            // Work requests of at most max_recv_size bytes over the (up to
            // two) ring slices.
            let slices = [a, b];
            let planned = plan_send_wrs([a.len(), b.len()], self.max_recv_size, |pieces, last| {
                let mut s: [Option<ibv::Sge>; 2] = [None, None];
                for (slot, &(which, off, len)) in s.iter_mut().zip(pieces) {
                    let piece = &slices[which][off..off + len];
                    let at = piece.as_ptr() as usize - base;
                    *slot = Some(ic.orb_mr.sge(at, len as u32).map_err(|e| e.to_string())?);
                }
                let sl: &[ibv::Sge] = match (&s[0], &s[1]) {
                    (Some(x), Some(y)) => &[*x, *y],
                    (Some(x), None) => std::slice::from_ref(x),
                    _ => &[],
                };
                let imm = if wrs == 0 { imm_first } else { imm_rest };
                let mut flags = if last {
                    ibv::SendFlags::SIGNALED
                } else {
                    ibv::SendFlags::NONE
                };
                let bytes: usize = pieces.iter().map(|p| p.2).sum();
                if bytes <= ic.max_inline {
                    // Copied into the request at post time.
                    flags = flags | ibv::SendFlags::INLINE;
                }
                st_chain.push(wr_id, ibv::SendOp::SendWithImm(imm), sl, flags);
                wrs += 1;
                Ok(())
            })?;
            debug_assert_eq!(planned, wrs);
            Ok(())
        })();
        let posted = result.and_then(|_| ic.qp.post_send(&mut st_chain).map_err(|e| e.to_string()));
        st.chain = st_chain;
        posted?;
        tracing::trace!(
            "{}: posted {wrs} work requests, {total} bytes, to {}",
            self.own,
            conn.peer
        );
        conn.orb.mark_posted(&mut st.consumer, total);
        st.outstanding += wrs;
        st.signalled(seq, conn);
        st.chains.push_back(Chain {
            seq,
            bytes: total,
            wrs,
            one_sided_wr: false,
            one_sided: None,
        });
        self.outstanding_total
            .fetch_add(wrs as u64, Ordering::AcqRel);
        Ok(())
    }

    /// The connection to `peer` for a post on the calling thread (see
    /// [`Transport::try_flush`], [`Transport::send_standalone`]); `None`
    /// while the send thread is at work (it aggregates) or without one.
    /// The idle send thread does not poll send completions: they are
    /// retired here once half the send queue is in use (in batches: polling
    /// on every post was a visible part of a round trip), or the send queue
    /// fills up (`sq_size` round trips) and the next post waits for the
    /// send thread (measured: every 20th round trip stalled ~100 ms). Safe
    /// beside the send thread: chains complete in queue order under the
    /// connection's send lock.
    pub(super) fn inline_poster(&self, core: &Core, peer: NodeId) -> Option<Arc<IbConn>> {
        if self.send_busy.load(Ordering::SeqCst) {
            return None;
        }
        let ic = core.engine_half::<IbConn>(peer)?;
        if self.outstanding_total.load(Ordering::Acquire) >= u64::from(self.sq_size / 2).max(1) {
            let mut wcs: [ibv::WorkCompletion; 8] =
                std::array::from_fn(|_| ibv::WorkCompletion::default());
            self.poll_send(core, &mut wcs, Some(peer));
        }
        Some(ic)
    }
}

/// Plans the send work requests for ring-buffer data given as the lengths of
/// its (up to) two slices, before and after the ring's end: every request
/// carries at most `max` bytes, as one piece, or two where it crosses from
/// the first slice into the second. `emit` gets each request's pieces as
/// (slice index, offset in that slice, length) and whether it is the last
/// one. Returns the number of requests.
pub(super) fn plan_send_wrs(
    lens: [usize; 2],
    max: usize,
    mut emit: impl FnMut(&[(usize, usize, usize)], bool) -> std::result::Result<(), String>,
) -> std::result::Result<u32, String> {
    assert!(max > 0, "receive size must be positive");
    let total = lens[0] + lens[1];
    let (mut which, mut off) = (0usize, 0usize);
    let mut left = total;
    let mut wrs = 0u32;
    let mut pieces = [(0usize, 0usize, 0usize); 2];
    while left > 0 {
        let mut want = left.min(max);
        let mut n = 0;
        while want > 0 {
            if off == lens[which] {
                which += 1;
                off = 0;
            }
            let take = want.min(lens[which] - off);
            pieces[n] = (which, off, take);
            n += 1;
            off += take;
            want -= take;
            left -= take;
        }
        emit(&pieces[..n], left == 0)?;
        wrs += 1;
    }
    Ok(wrs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte of both slices is covered once, in order; requests are
    /// at most `max` bytes with one piece, or two only across the wrap.
    fn check(lens: [usize; 2], max: usize) {
        let mut covered = Vec::new();
        let mut seen_last = 0;
        let n = plan_send_wrs(lens, max, |pieces, last| {
            assert!(!pieces.is_empty() && pieces.len() <= 2, "{pieces:?}");
            let bytes: usize = pieces.iter().map(|p| p.2).sum();
            assert!(bytes > 0 && bytes <= max);
            if pieces.len() == 2 {
                assert_eq!(
                    (pieces[0].0, pieces[1].0),
                    (0, 1),
                    "two pieces only across the wrap"
                );
                assert_eq!(
                    pieces[0].1 + pieces[0].2,
                    lens[0],
                    "first piece ends at the ring's end"
                );
                assert_eq!(pieces[1].1, 0, "second piece starts at the ring's start");
            }
            for &(w, off, len) in pieces {
                assert!(len > 0 && off + len <= lens[w]);
                covered.extend((off..off + len).map(|i| (w, i)));
            }
            if last {
                seen_last += 1;
            }
            Ok(())
        })
        .unwrap();
        let want: Vec<_> = (0..lens[0])
            .map(|i| (0, i))
            .chain((0..lens[1]).map(|i| (1, i)))
            .collect();
        assert_eq!(covered, want, "lens {lens:?} max {max}");
        let total = lens[0] + lens[1];
        assert_eq!(n as usize, total.div_ceil(max));
        assert_eq!(seen_last, usize::from(total > 0));
    }

    #[test]
    fn slicing_sges_and_wrap_around() {
        for max in [1, 3, 7, 64, 65536] {
            for a in [0, 1, 2, 5, 63, 64, 65, 200, 65536, 65537] {
                for b in [0, 1, 6, 64, 100, 131072] {
                    check([a, b], max);
                }
            }
        }
    }

    #[test]
    fn slicing_stops_at_the_first_error() {
        let mut calls = 0;
        let r = plan_send_wrs([100, 0], 10, |_, _| {
            calls += 1;
            if calls == 3 {
                Err("post failed".into())
            } else {
                Ok(())
            }
        });
        assert_eq!(r, Err("post failed".to_string()));
        assert_eq!(calls, 3);
    }
}
