//! One-sided operations in hardware: RDMA WRITE and READ work requests on
//! a connection's queue pair, for `Node::write`/`read` on regions whose
//! descriptor carries a remote key.
//!
//! - A part is posted under the connection's send lock right after the
//!   data its ring holds, so a thread's earlier messages reach the peer
//!   before its write (RC queue pairs keep order), and a message posted
//!   after the write is seen after the write's data.
//! - Its bytes go through a registered staging slot (the caller's memory
//!   is not registered): a write is copied in before the post (or sent
//!   inline when small), a read lands there and is copied into the
//!   request's answer when it completes. Waiting for a free slot or room
//!   in the send queue retires send completions meanwhile.
//! - The part's completion completes its request in the request table
//!   with a one-sided answer, so waiting, futures, timeouts and failing on
//!   a lost connection work as for the emulated accesses. A part the peer
//!   refuses (remote access error: revoked region, forged descriptor) is
//!   answered "unknown region"; the queue pair is in error then and the
//!   connection closes (the next use reconnects).

use crossbeam::queue::ArrayQueue;

use super::*;
use crate::error::Waited;
use crate::proto::region::Status;
use crate::transport::{RdmaPart, RemoteMemory};

/// Bytes of one staging slot: the largest part of a one-sided access.
pub(super) const SLOT_LEN: usize = 64 << 10;

/// A posted one-sided part (see [`Chain::one_sided`]).
#[derive(Debug)]
pub(super) struct PartWr {
    /// Its request in the request table.
    id: u32,
    /// Its staging slot, if it has one.
    pub(super) slot: Option<u32>,
    /// A read's length (`None`: a write).
    read_len: Option<usize>,
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

impl IbEngine {
    /// Completes the request of a part whose work request completed.
    pub(super) fn complete_part(&self, core: &Core, ic: &IbConn, p: PartWr) {
        self.one_sided_inflight.fetch_sub(1, Ordering::AcqRel);
        let peer = ic.conn.peer;
        match (p.read_len, p.slot) {
            (Some(len), Some(slot)) => {
                // SAFETY: the read completed: the device is done with the
                // slot, which is released only after this copy.
                let bytes = unsafe { self.staged().bytes(slot, len) };
                core.requests
                    .complete_parts(p.id, peer, &[&[Status::Ok as u8], bytes]);
            }
            _ => {
                core.requests
                    .complete_parts(p.id, peer, &[&[Status::Ok as u8]]);
            }
        }
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

    /// Answers the request of a part the peer refused.
    pub(super) fn fail_part(&self, core: &Core, ic: &IbConn, p: PartWr) {
        self.one_sided_inflight.fetch_sub(1, Ordering::AcqRel);
        core.requests
            .complete_parts(p.id, ic.conn.peer, &[&[Status::Unknown as u8]]);
        if let Some(slot) = p.slot {
            self.staged().release(slot);
        }
    }

    /// Frees the staging slots of a destroyed queue pair.
    pub(super) fn release_quarantine(&self, ic: &IbConn) {
        for slot in std::mem::take(&mut ic.send.lock().quarantined) {
            self.staged().release(slot);
        }
    }

    /// Retires send completions while a one-sided post waits for room.
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

    fn cover(&self, core: &Core, conn: &Arc<Connection>, seq: u64, deadline: Instant) {
        let Some(ic) = conn.engine::<IbConn>() else {
            return; // closed: its parts fail with the connection
        };
        let mut st = loop {
            let st = ic.send.lock();
            let pending = st.chains.front().is_some_and(|c| c.seq <= seq);
            if !pending || st.signalled_seq >= seq || conn.state() != ConnState::Open {
                return;
            }
            if st.outstanding < self.sq_size {
                break st;
            }
            // Full: signalled requests before the part free room.
            drop(st);
            if self.wait_for_room(core, deadline).is_err() {
                return; // the caller's wait times out
            }
        };
        // A marker: a signalled RDMA WRITE of no bytes, which the peer's
        // device does not check against its memory (IBA C9-88).
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
        if let Err(e) = posted {
            drop(st);
            core.close_connection(conn, &format!("posting a marker failed: {e}"), true);
            return;
        }
        st.outstanding += 1;
        st.signalled(marker);
        st.chains.push_back(Chain {
            seq: marker,
            bytes: 0,
            wrs: 1,
            posted: Instant::now(),
            one_sided: None,
        });
        self.outstanding_total.fetch_add(1, Ordering::AcqRel);
    }

    fn waiting(&self) {
        // The send thread looks for completions often while parts are in
        // flight (see `IbSender::idle`).
        self.wake_sender();
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
        id: u32,
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
        let (len, inline) = match part {
            RdmaPart::Write { data, .. } => (data.len(), data.len() <= ic.max_inline),
            RdmaPart::Read { len, .. } => (len, false),
        };
        assert!(len <= SLOT_LEN, "parts are at most part_max() bytes");
        // A staging slot (not for inline writes: copied at post time).
        let staging = if inline { None } else { Some(self.staging()?) };
        let slot = match staging {
            None => None,
            Some(staging) => loop {
                if let Some(s) = staging.free.pop() {
                    break Some(s);
                }
                self.wait_for_room(core, deadline)?;
            },
        };
        let give_back = |e: Error| {
            if let Some(s) = slot {
                self.staged().release(s);
            }
            e
        };
        if let (Some(s), RdmaPart::Write { data, .. }) = (slot, part) {
            self.staged().fill(s, data);
        }
        loop {
            if conn.state() != ConnState::Open {
                return Err(give_back(lost()));
            }
            let mut guard = ic.send.lock();
            let st = &mut *guard;
            // The ring's data first: this thread's earlier messages.
            if let Err(e) = self.post_locked(&ic, st) {
                drop(guard);
                core.close_connection(conn, &format!("posting sends failed: {e}"), true);
                return Err(give_back(lost()));
            }
            if st.outstanding >= self.sq_size {
                drop(guard);
                self.sq_refused.store(true, Ordering::Release);
                if let Err(e) = self.wait_for_room(core, deadline) {
                    return Err(give_back(e));
                }
                continue;
            }
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
                None => None,
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
                (RdmaPart::Write { data, .. }, None) => {
                    ic.qp.post_send_inline(wr_id, op, data, signal)
                }
                (_, Some(sge)) => {
                    let mut chain = std::mem::take(&mut st.chain);
                    chain.clear();
                    chain.push(wr_id, op, &[sge], flags);
                    let r = ic.qp.post_send(&mut chain);
                    st.chain = chain;
                    r
                }
                (RdmaPart::Read { .. }, None) => unreachable!("reads always stage"),
            };
            if let Err(e) = posted {
                drop(guard);
                core.close_connection(conn, &format!("posting a one-sided part failed: {e}"), true);
                return Err(give_back(lost()));
            }
            st.outstanding += 1;
            if signal {
                st.signalled(seq);
            } else {
                st.next_seq += 1;
                st.unsignalled += 1;
            }
            st.last_remote = match part {
                RdmaPart::Write { addr, rkey, .. } | RdmaPart::Read { addr, rkey, .. } => {
                    (addr, rkey)
                }
            };
            st.chains.push_back(Chain {
                seq,
                bytes: 0,
                wrs: 1,
                posted: Instant::now(),
                one_sided: Some(PartWr {
                    id,
                    slot,
                    read_len: matches!(part, RdmaPart::Read { .. }).then_some(len),
                }),
            });
            self.outstanding_total.fetch_add(1, Ordering::AcqRel);
            self.one_sided_inflight.fetch_add(1, Ordering::AcqRel);
            // The send thread is not woken: the caller retires completions
            // while it waits, and asks for the send thread only when it
            // stops polling (`RemoteMemory::waiting`).
            return Ok(seq);
        }
    }
}
