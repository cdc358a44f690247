//! One-sided operations in hardware: RDMA WRITE and READ work requests on
//! a connection's queue pair, for `Node::write`/`read` on regions whose
//! descriptor carries a remote key.
//!
//! - A part is posted under the connection's send lock right after the
//!   data its ring holds, so a thread's earlier messages reach the peer
//!   before its write (RC queue pairs keep order), and a message posted
//!   after the write is seen after the write's data.
//! - A part of the caller's bytes goes through a registered staging slot
//!   (the caller's memory is not registered): a write is copied in before
//!   the post (or sent inline when small), a read lands there and is
//!   copied into the read's buffer when its chain is retired (so the slot
//!   is free again at once, whether or not anyone waits). A part from or
//!   into one of the caller's own regions (`Node::write_from`,
//!   `read_into`) names that registered memory in place, no copy; its
//!   chain keeps the region alive until the device is done. Waiting for a
//!   free slot or room in the send queue retires send completions
//!   meanwhile.
//! - Parts are numbered like every chain of the queue pair; the outcome of
//!   each shows in the connection's [`InOrderTrack`] (`Connection::parts`),
//!   which the caller checks, parks on or registers a waker with: no
//!   request-table entry per part. Only every `signal_every`-th part (and
//!   one a caller waits for at once) asks for a completion; a completion
//!   settles every chain before it. A waiter whose part has no signalled
//!   request behind it has a marker posted (`cover`).
//! - A part the peer refuses (remote access error: revoked region, forged
//!   descriptor) is refused in the track, the ones behind it are lost; the
//!   queue pair is in error then and the connection closes (the next use
//!   reconnects).
//!
//! [`InOrderTrack`]: crate::primitives::in_order::InOrderTrack

use crossbeam::queue::ArrayQueue;

use super::send::plan_send_wrs;
use super::*;
use crate::error::Waited;
use crate::transport::{LocalBytes, PartDest, PartSource, RdmaPart, ReadBuf, RemoteMemory};

/// Bytes of one staging slot: the largest part of a one-sided access.
pub(super) const SLOT_LEN: usize = 64 << 10;

/// A posted one-sided part (see [`Chain::one_sided`]).
pub(super) struct PartWr {
    /// Its staging slot, freed when the part's chain is retired.
    pub(super) slot: Option<u32>,
    /// A staged read's destination: the read's buffer and where in it.
    pub(super) read: Option<(ReadBuf, usize, usize)>,
    /// The caller's registered memory the part reads or fills in place:
    /// held until the device is done with it (the chain is retired, or its
    /// queue pair destroyed).
    pub(super) keep: Option<Arc<dyn crate::transport::Hold>>,
}

impl std::fmt::Debug for PartWr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartWr")
            .field("slot", &self.slot)
            .field("read", &self.read.as_ref().map(|(_, at, len)| (at, len)))
            .field("in_place", &self.keep.is_some())
            .finish()
    }
}

/// Registered memory for the bytes of one-sided parts in flight.
pub(super) struct Staging {
    mr: ibv::MemoryRegion,
    free: ArrayQueue<u32>,
}

impl Staging {
    /// `slots` slots of [`SLOT_LEN`] bytes in one registration.
    pub(super) fn new(pd: &ibv::ProtectionDomain, slots: usize) -> Result<Staging> {
        let slots = slots.max(1);
        let mr = pd
            .alloc_buffer(slots * SLOT_LEN, ibv::AccessFlags::LOCAL_WRITE)
            .map_err(verbs_err)?;
        let free = ArrayQueue::new(slots);
        for i in 0..slots as u32 {
            let _ = free.push(i);
        }
        Ok(Staging { mr, free })
    }

    fn release(&self, slot: u32) {
        let _ = self.free.push(slot);
    }

    /// The slot's bytes once the device is done with them.
    ///
    /// # Safety
    /// No work request that names the slot may be in flight.
    unsafe fn bytes(&self, slot: u32, len: usize) -> &[u8] {
        debug_assert!(len <= SLOT_LEN);
        // SAFETY: the slot lies inside the registered buffer the region
        // owns; the caller guarantees the device does not write it now,
        // and the slot is not handed out again before `release`.
        unsafe { std::slice::from_raw_parts(self.mr.addr().add(slot as usize * SLOT_LEN), len) }
    }

    /// Copies `data` into the slot.
    fn fill(&self, slot: u32, data: &[u8]) {
        assert!(data.len() <= SLOT_LEN);
        // SAFETY: inside the buffer; the slot was just taken from the free
        // list, so no work request names it.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.mr.addr().add(slot as usize * SLOT_LEN),
                data.len(),
            )
        };
    }
}

/// The scatter/gather element of a part in the caller's registered memory.
fn local_sge(l: LocalBytes<'_>) -> Result<ibv::Sge> {
    let mr = l
        .registration
        .downcast_ref::<ibv::MemoryRegion>()
        .ok_or_else(|| Error::Transport("a local region registered by another engine".into()))?;
    let len = u32::try_from(l.len).map_err(|_| Error::Transport("part too long".into()))?;
    mr.sge(l.offset, len).map_err(verbs_err)
}

/// How long the send thread retires completions often after a caller
/// began waiting for a one-sided part without polling itself (parked, or a
/// pending future); a waiter asks again when it lasts longer. Without one,
/// completions of parts nobody polls for are retired at the send thread's
/// next turn (at most `park.max_park_ms`).
pub(super) const WAITER_POLL: Duration = Duration::from_millis(10);

impl IbEngine {
    /// Posts a marker on `ic` (send lock held as `st`, room in its part
    /// budget): a signalled RDMA WRITE of no bytes, which the peer's device
    /// does not check against its memory (IBA C9-88); its completion
    /// reports every chain before it.
    fn post_marker(&self, ic: &IbConn, st: &mut SendState) -> std::result::Result<(), String> {
        let conn = &ic.conn;
        let (remote_addr, rkey) = st.last_remote;
        let marker = st.next_seq;
        let mut chain = std::mem::take(&mut st.chain);
        chain.clear();
        chain.push(
            send_wr_id(conn, marker),
            ibv::SendOp::RdmaWrite { remote_addr, rkey },
            &[],
            ibv::SendFlags::SIGNALED,
        );
        let posted = ic.qp.post_send(&mut chain);
        st.chain = chain;
        posted.map_err(|e| e.to_string())?;
        st.parts_outstanding += 1;
        st.signalled(marker, conn);
        st.chains.push_back(Chain {
            seq: marker,
            bytes: 0,
            wrs: 1,
            one_sided_wr: true,
            one_sided: None,
        });
        self.outstanding_total.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Staging slots ran out: has every connection's unsignalled parts
    /// reported (a marker behind them where needed), so that the slots
    /// they hold come back even if their callers never wait.
    fn cover_all(&self, core: &Core) {
        let conns: Vec<Arc<IbConn>> = self.by_qpn.lock().values().cloned().collect();
        for ic in conns {
            let mut st = ic.send.lock();
            let last = st.next_seq - 1;
            let uncovered = !ic.conn.parts.reports(last)
                && st
                    .chains
                    .back()
                    .is_some_and(|c| c.seq == last && c.one_sided.is_some());
            if uncovered
                && st.parts_outstanding < self.rdma_depth
                && ic.conn.state() == ConnState::Open
            {
                if let Err(e) = self.post_marker(&ic, &mut st) {
                    drop(st);
                    let why = format!("posting a marker failed: {e}");
                    core.close_connection(&ic.conn, &why, true);
                }
            }
        }
    }

    /// Whether a waiter asked for completions to be retired lately (see
    /// [`WAITER_POLL`]).
    pub(super) fn polling_for_waiters(&self) -> bool {
        let now = self.started.elapsed().as_micros() as u64;
        now < self.poll_until_us.load(Ordering::Acquire)
    }

    /// Copies a retired read part's bytes from its slot into the read's
    /// buffer. Called under the send lock, before the track shows the part
    /// done.
    pub(super) fn land_read(&self, p: &PartWr) {
        if let (Some((buf, at, len)), Some(slot)) = (&p.read, p.slot) {
            // SAFETY: the part's work request completed (its chain is being
            // retired): the device wrote the slot and touches it no more;
            // the slot is released only after this copy.
            let bytes = unsafe { self.staged().bytes(slot, *len) };
            buf.lock().fill(*at, bytes);
        }
    }

    /// Frees what a retired part's chain holds (its staging slot; the
    /// caller's memory it kept alive).
    pub(super) fn retire_part(&self, p: PartWr) {
        if let Some(slot) = p.slot {
            self.staged().release(slot);
        }
    }

    /// The staging memory, which a part with a slot implies exists.
    fn staged(&self) -> &Staging {
        self.staging
            .get()
            .expect("slots come from the staging memory")
    }

    /// The staging memory, registered on first use.
    fn staging(&self) -> Result<&Staging> {
        if let Some(s) = self.staging.get() {
            return Ok(s);
        }
        let made = Staging::new(&self.pd, self.staging_slots)?;
        // A racing first user may have won: its memory is used, ours freed.
        let _ = self.staging.set(made);
        Ok(self.staging.get().expect("just set"))
    }

    /// Frees what the parts of a destroyed queue pair held.
    pub(super) fn release_quarantine(&self, ic: &IbConn) {
        for p in std::mem::take(&mut ic.send.lock().quarantined) {
            self.retire_part(p);
        }
    }

    /// Retires send completions while a one-sided post waits for room.
    /// Takes `ic`'s send lock after posting the data its ring holds (this
    /// thread's earlier messages go first); `None` if anything reserved in
    /// the ring is still unposted: the send queue is full, or a committed
    /// message (maybe this thread's) sits behind another thread's
    /// reservation that is not committed yet. The caller then must not
    /// post (it would overtake those messages): it waits and tries again,
    /// or takes the ring itself. Fails if the connection is not open, or
    /// closes it if posting fails.
    fn lock_behind_ring<'a>(
        &self,
        core: &Core,
        ic: &'a IbConn,
    ) -> Result<Option<parking_lot::MutexGuard<'a, SendState>>> {
        let conn = &ic.conn;
        let lost = || {
            Error::Unreachable(
                conn.peer,
                crate::error::Unreachable::ConnectionLost(conn.close_reason()),
            )
        };
        if conn.state() != ConnState::Open {
            return Err(lost());
        }
        let mut guard = ic.send.lock();
        if let Err(e) = self.post_locked(ic, &mut guard) {
            drop(guard);
            core.close_connection(conn, &format!("posting sends failed: {e}"), true);
            return Err(lost());
        }
        if conn.orb.has_unsent() {
            return Ok(None);
        }
        Ok(Some(guard))
    }

    /// [`IbEngine::wait_for_room`] after a post found the send queue (or
    /// the ring before it) full: the send thread keeps polling meanwhile.
    fn wait_for_sq_room(&self, core: &Core, deadline: Instant) -> Result<()> {
        self.sq_refused.store(true, Ordering::Release);
        self.wait_for_room(core, deadline)
    }

    fn wait_for_room(&self, core: &Core, deadline: Instant) -> Result<()> {
        if Instant::now() >= deadline {
            return Err(Error::Timeout(Waited::RingBuffer));
        }
        let mut wcs: [ibv::WorkCompletion; 8] =
            std::array::from_fn(|_| ibv::WorkCompletion::default());
        if !self.poll_send(core, &mut wcs, None) {
            std::thread::yield_now();
        }
        Ok(())
    }
}

impl RemoteMemory for IbEngine {
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        read: bool,
        write: bool,
    ) -> Result<(u32, Box<dyn std::any::Any + Send + Sync>)> {
        let mut access = ibv::AccessFlags::LOCAL_WRITE;
        if read {
            access = access | ibv::AccessFlags::REMOTE_READ;
        }
        if write {
            access = access | ibv::AccessFlags::REMOTE_WRITE;
        }
        // SAFETY: the caller keeps the memory allocated until the returned
        // handle (the registration) is dropped, and accepts device access
        // meanwhile.
        let mr = unsafe { self.pd.register_raw(addr, len, access) }.map_err(verbs_err)?;
        Ok((mr.rkey(), Box::new(mr)))
    }

    fn part_max(&self) -> usize {
        SLOT_LEN
    }

    fn post_send(
        &self,
        core: &Core,
        conn: &Arc<Connection>,
        header: &[u8],
        payload: LocalBytes<'_>,
        deadline: Instant,
    ) -> Result<Option<u64>> {
        let lost = || {
            Error::Unreachable(
                conn.peer,
                crate::error::Unreachable::ConnectionLost(conn.close_reason()),
            )
        };
        let ic = conn.engine::<IbConn>().ok_or_else(lost)?;
        let lens = [header.len(), payload.len];
        // Work requests of at most one receive each, as for ring data.
        let wrs =
            plan_send_wrs(lens, self.max_recv_size, |_, _| Ok(())).map_err(Error::Transport)?;
        if wrs > self.sq_size || header.len() > SLOT_LEN {
            return Ok(None);
        }
        let mr = payload
            .registration
            .downcast_ref::<ibv::MemoryRegion>()
            .ok_or_else(|| Error::Transport("a buffer registered by another engine".into()))?;
        // The header goes through a staging slot (registered memory).
        let staging = self.staging()?;
        let slot = loop {
            if let Some(s) = staging.free.pop() {
                break s;
            }
            self.cover_all(core);
            self.wait_for_room(core, deadline)?;
        };
        staging.fill(slot, header);
        let give_back = |e: Error| {
            staging.release(slot);
            e
        };
        loop {
            // All of the ring's data first: nothing may come between header
            // and payload.
            let mut guard = match self.lock_behind_ring(core, &ic).map_err(give_back)? {
                // Behind ring data that cannot go yet: through the ring
                // instead (the caller copies), never ahead of it.
                None => {
                    staging.release(slot);
                    return Ok(None);
                }
                Some(g) if self.sq_size.saturating_sub(g.outstanding) >= wrs => g,
                Some(g) => {
                    drop(g);
                    self.wait_for_sq_room(core, deadline).map_err(give_back)?;
                    continue;
                }
            };
            let st = &mut *guard;
            let seq = st.next_seq;
            let wr_id = send_wr_id(conn, seq);
            let imm = wire::encode_imm(self.own.0, 0);
            let mut chain = std::mem::take(&mut st.chain);
            chain.clear();
            let staged = &staging.mr;
            let planned = plan_send_wrs(lens, self.max_recv_size, |pieces, last| {
                let mut sges: [Option<ibv::Sge>; 2] = [None, None];
                for (sge, &(which, off, len)) in sges.iter_mut().zip(pieces) {
                    let len32 = len as u32;
                    *sge = Some(
                        if which == 0 {
                            staged.sge(slot as usize * SLOT_LEN + off, len32)
                        } else {
                            mr.sge(payload.offset + off, len32)
                        }
                        .map_err(|e| e.to_string())?,
                    );
                }
                let sl: &[ibv::Sge] = match (&sges[0], &sges[1]) {
                    (Some(x), Some(y)) => &[*x, *y],
                    (Some(x), None) => std::slice::from_ref(x),
                    _ => &[],
                };
                let flags = if last {
                    ibv::SendFlags::SIGNALED
                } else {
                    ibv::SendFlags::NONE
                };
                chain.push(wr_id, ibv::SendOp::SendWithImm(imm), sl, flags);
                Ok(())
            });
            let posted =
                planned.and_then(|_| ic.qp.post_send(&mut chain).map_err(|e| e.to_string()));
            st.chain = chain;
            if let Err(e) = posted {
                drop(guard);
                core.close_connection(conn, &format!("posting a send in place failed: {e}"), true);
                return Err(give_back(lost()));
            }
            st.signalled(seq, conn);
            st.outstanding += wrs;
            st.chains.push_back(Chain {
                seq,
                bytes: 0,
                wrs,
                one_sided_wr: false,
                one_sided: Some(PartWr {
                    slot: Some(slot),
                    read: None,
                    keep: Some(payload.keep.clone()),
                }),
            });
            self.outstanding_total
                .fetch_add(wrs as u64, Ordering::AcqRel);
            return Ok(Some(seq));
        }
    }

    fn cover(&self, core: &Core, conn: &Arc<Connection>, seq: u64, deadline: Instant) {
        let Some(ic) = conn.engine::<IbConn>() else {
            return; // closed: its parts fail with the connection
        };
        let mut st = loop {
            let st = ic.send.lock();
            let pending = st.chains.front().is_some_and(|c| c.seq <= seq);
            if !pending || conn.parts.reports(seq) || conn.state() != ConnState::Open {
                return;
            }
            if st.parts_outstanding < self.rdma_depth {
                break st;
            }
            // Full: signalled requests before the part free room.
            drop(st);
            if self.wait_for_room(core, deadline).is_err() {
                return; // the caller's wait times out
            }
        };
        if let Err(e) = self.post_marker(&ic, &mut st) {
            drop(st);
            core.close_connection(conn, &format!("posting a marker failed: {e}"), true);
        }
    }

    fn waiting(&self) {
        // The send thread looks for completions often (see
        // `IbSender::idle`) for the next `WAITER_POLL`; a waiter still
        // waiting by then asks again.
        let until = self.started.elapsed() + WAITER_POLL;
        let until = until.as_micros() as u64;
        if self.poll_until_us.fetch_max(until, Ordering::AcqRel) < until {
            self.wake_sender();
        }
    }

    fn progress(&self, core: &Core) -> bool {
        let mut wcs: [ibv::WorkCompletion; 8] =
            std::array::from_fn(|_| ibv::WorkCompletion::default());
        self.poll_send(core, &mut wcs, None)
    }

    fn post(
        &self,
        core: &Core,
        conn: &Arc<Connection>,
        part: RdmaPart<'_>,
        deadline: Instant,
        signal: bool,
    ) -> Result<u64> {
        let lost = || {
            Error::Unreachable(
                conn.peer,
                crate::error::Unreachable::ConnectionLost(conn.close_reason()),
            )
        };
        let ic = conn.engine::<IbConn>().ok_or_else(lost)?;
        // The caller's registered memory, read or filled in place.
        let local = match part {
            RdmaPart::Write {
                src: PartSource::Local(l),
                ..
            }
            | RdmaPart::Read {
                into: PartDest::Local(l),
                ..
            } => Some(l),
            _ => None,
        };
        let (len, inline) = match part {
            RdmaPart::Write {
                src: PartSource::Bytes(data),
                ..
            } => (data.len(), data.len() <= ic.max_inline),
            RdmaPart::Write {
                src: PartSource::Local(l),
                ..
            } => (l.len, false),
            RdmaPart::Read { len, .. } => (len, false),
        };
        assert!(len <= SLOT_LEN, "parts are at most part_max() bytes");
        let local_sge = match local {
            Some(l) => Some(local_sge(l)?),
            None => None,
        };
        // A staging slot (not for inline writes: copied at post time; not
        // for parts in the caller's registered memory).
        let staging = if inline || local.is_some() {
            None
        } else {
            Some(self.staging()?)
        };
        let slot = match staging {
            None => None,
            Some(staging) => loop {
                if let Some(s) = staging.free.pop() {
                    break Some(s);
                }
                // Slots held by unsignalled parts come back only once
                // something reports them.
                self.cover_all(core);
                self.wait_for_room(core, deadline)?;
            },
        };
        let give_back = |e: Error| {
            if let Some(s) = slot {
                self.staged().release(s);
            }
            e
        };
        if let (
            Some(s),
            RdmaPart::Write {
                src: PartSource::Bytes(data),
                ..
            },
        ) = (slot, part)
        {
            self.staged().fill(s, data);
        }
        loop {
            let mut guard = match self.lock_behind_ring(core, &ic).map_err(give_back)? {
                Some(g) if g.parts_outstanding < self.rdma_depth => g,
                other => {
                    drop(other);
                    self.wait_for_sq_room(core, deadline).map_err(give_back)?;
                    continue;
                }
            };
            let st = &mut *guard;
            let seq = st.next_seq;
            let wr_id = send_wr_id(conn, seq);
            // Signalled when the caller waits for it at once, and every
            // `signal_every`-th part: the others complete with the next
            // signalled chain (fewer completions to generate and retire;
            // the unsignalled run stays below the send queue's size, so a
            // full queue always holds a signalled request).
            let signal = signal || st.unsignalled + 1 >= self.signal_every;
            let flags = if signal {
                ibv::SendFlags::SIGNALED
            } else {
                ibv::SendFlags::NONE
            };
            let sge = match slot {
                Some(s) => Some(
                    self.staged()
                        .mr
                        .sge(s as usize * SLOT_LEN, len as u32)
                        .map_err(|e| give_back(verbs_err(e)))?,
                ),
                None => local_sge,
            };
            let op = match part {
                RdmaPart::Write { addr, rkey, .. } => ibv::SendOp::RdmaWrite {
                    remote_addr: addr,
                    rkey,
                },
                RdmaPart::Read { addr, rkey, .. } => ibv::SendOp::RdmaRead {
                    remote_addr: addr,
                    rkey,
                },
            };
            let posted = match (part, sge) {
                (
                    RdmaPart::Write {
                        src: PartSource::Bytes(data),
                        ..
                    },
                    None,
                ) => ic.qp.post_send_inline(wr_id, op, data, signal),
                (_, Some(sge)) => {
                    let mut chain = std::mem::take(&mut st.chain);
                    chain.clear();
                    chain.push(wr_id, op, &[sge], flags);
                    let r = ic.qp.post_send(&mut chain);
                    st.chain = chain;
                    r
                }
                (_, None) => unreachable!("only inline writes go without an SGE"),
            };
            if let Err(e) = posted {
                drop(guard);
                core.close_connection(conn, &format!("posting a one-sided part failed: {e}"), true);
                return Err(give_back(lost()));
            }
            st.parts_outstanding += 1;
            if signal {
                st.signalled(seq, conn);
            } else {
                st.next_seq += 1;
                st.unsignalled += 1;
            }
            st.last_remote = match part {
                RdmaPart::Write { addr, rkey, .. } | RdmaPart::Read { addr, rkey, .. } => {
                    (addr, rkey)
                }
            };
            let read = match part {
                RdmaPart::Read {
                    into: PartDest::Buf { buf, at },
                    len,
                    ..
                } => Some((buf.clone(), at, len)),
                _ => None,
            };
            st.chains.push_back(Chain {
                seq,
                bytes: 0,
                wrs: 1,
                one_sided_wr: true,
                one_sided: Some(PartWr {
                    slot,
                    read,
                    keep: local.map(|l| l.keep.clone()),
                }),
            });
            self.outstanding_total.fetch_add(1, Ordering::AcqRel);
            // The send thread is not woken: the caller retires completions
            // while it waits, and asks for the send thread only when it
            // stops polling (`RemoteMemory::waiting`).
            return Ok(seq);
        }
    }
}
