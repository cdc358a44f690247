//! Work requests (chains of send/receive WRs with scatter/gather lists) and
//! work completions.
//!
//! A chain owns its WR and SGE arrays and is reused across posts (`clear()`
//! keeps the capacity), so posting allocates nothing once warmed up. The
//! `next`/`sg_list` pointers are filled in right before each post, because the
//! arrays may move while the chain is built.

use std::ptr;

use crate::error::{Error, Result};
use crate::ffi;

/// One scatter/gather element: a byte range inside a registered memory
/// region. Made by [`MemoryRegion::sge`](crate::MemoryRegion::sge), which
/// checks the bounds, so it always names memory that was registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    pub(crate) raw: ffi::ibv_sge,
}

impl Sge {
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.raw.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.raw.length
    }
    /// True for a zero-length element.
    pub fn is_empty(&self) -> bool {
        self.raw.length == 0
    }
    /// Local key of its memory region.
    pub fn lkey(&self) -> u32 {
        self.raw.lkey
    }
    /// A sub-range of this element (same memory region).
    pub fn slice(&self, offset: u32, len: u32) -> Result<Sge> {
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.raw.length)
        {
            return Err(Error::InvalidArgument(format!(
                "range {offset}+{len} outside an SGE of {} bytes",
                self.raw.length
            )));
        }
        Ok(Sge {
            raw: ffi::ibv_sge {
                addr: self.raw.addr + offset as u64,
                length: len,
                lkey: self.raw.lkey,
            },
        })
    }
}

/// The operation of a send work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// SEND: consumes a receive WR on the peer.
    Send,
    /// SEND with 32-bit immediate data (given in host byte order; delivered
    /// in the peer's work completion). May carry zero bytes of payload.
    SendWithImm(u32),
    /// RDMA WRITE to `remote_addr` in the peer's region `rkey`.
    RdmaWrite {
        /// Target address on the peer.
        remote_addr: u64,
        /// The peer's remote key.
        rkey: u32,
    },
    /// RDMA WRITE with immediate data (consumes a receive WR on the peer).
    RdmaWriteWithImm {
        /// Target address on the peer.
        remote_addr: u64,
        /// The peer's remote key.
        rkey: u32,
        /// Immediate data, host byte order.
        imm: u32,
    },
    /// RDMA READ from `remote_addr` in the peer's region `rkey` into the
    /// work request's scatter list (which needs local write access). The
    /// queue pair must allow outstanding reads (`ConnectAttr::max_rd_atomic`
    /// here, `max_dest_rd_atomic` at the peer) and the peer's region remote
    /// read access.
    RdmaRead {
        /// Source address on the peer.
        remote_addr: u64,
        /// The peer's remote key.
        rkey: u32,
    },
}

/// `ibv_send_flags`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendFlags(pub u32);

impl SendFlags {
    /// No flags: unsignaled (no completion unless the QP has `sq_sig_all`).
    pub const NONE: SendFlags = SendFlags(0);
    /// Fence: wait for earlier RDMA READs.
    pub const FENCE: SendFlags = SendFlags(ffi::IBV_SEND_FENCE);
    /// Generate a work completion on the send CQ.
    pub const SIGNALED: SendFlags = SendFlags(ffi::IBV_SEND_SIGNALED);
    /// Set the solicited-event bit.
    pub const SOLICITED: SendFlags = SendFlags(ffi::IBV_SEND_SOLICITED);
    /// Copy the payload into the WR (up to the QP's `max_inline_data`).
    pub const INLINE: SendFlags = SendFlags(ffi::IBV_SEND_INLINE);
    /// Whether all bits of `other` are set.
    pub fn contains(self, other: SendFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for SendFlags {
    type Output = SendFlags;
    fn bitor(self, rhs: SendFlags) -> SendFlags {
        SendFlags(self.0 | rhs.0)
    }
}

/// A raw work request that chains link (`ibv_send_wr`, `ibv_recv_wr`).
trait RawWr {
    fn set_num_sge(&mut self, n: i32);
    fn num_sge(&self) -> i32;
    fn set_links(&mut self, sg_list: *mut ffi::ibv_sge, next: *mut Self);
}

/// Both raw work request types have the fields a chain links.
macro_rules! impl_raw_wr {
    ($($t:ty),*) => {$(
        impl RawWr for $t {
            fn set_num_sge(&mut self, n: i32) {
                self.num_sge = n;
            }
            fn num_sge(&self) -> i32 {
                self.num_sge
            }
            fn set_links(&mut self, sg_list: *mut ffi::ibv_sge, next: *mut Self) {
                self.sg_list = sg_list;
                self.next = next;
            }
        }
    )*};
}

impl_raw_wr!(ffi::ibv_send_wr, ffi::ibv_recv_wr);

/// What send and receive chains share: the work requests, their SGEs in
/// one array, and the linking right before a post.
struct Chain<W> {
    wrs: Vec<W>,
    sges: Vec<ffi::ibv_sge>,
    /// Index of each WR's first SGE in `sges`.
    first_sge: Vec<usize>,
}

// SAFETY: the raw pointers inside the work requests only ever point into the
// chain's own vectors and are rebuilt by `link` right before every post, so
// moving a chain to another thread cannot leave a dangling pointer in use.
unsafe impl<W> Send for Chain<W> {}

impl<W: RawWr> Chain<W> {
    fn with_capacity(wrs: usize, sges: usize) -> Self {
        Self {
            wrs: Vec::with_capacity(wrs),
            sges: Vec::with_capacity(sges),
            first_sge: Vec::with_capacity(wrs),
        }
    }

    fn push(&mut self, mut wr: W, sges: &[Sge]) {
        wr.set_num_sge(sges.len() as i32);
        self.first_sge.push(self.sges.len());
        self.sges.extend(sges.iter().map(|s| s.raw));
        self.wrs.push(wr);
    }

    fn total_bytes(&self) -> u64 {
        self.sges.iter().map(|s| s.length as u64).sum()
    }

    fn clear(&mut self) {
        self.wrs.clear();
        self.sges.clear();
        self.first_sge.clear();
    }

    /// Fills in `next` and `sg_list`; returns the head (NULL for an empty
    /// chain). The pointers stay valid until the chain is modified.
    fn link(&mut self) -> *mut W {
        let n = self.wrs.len();
        let sge_base = self.sges.as_mut_ptr();
        let wr_base = self.wrs.as_mut_ptr();
        for (i, wr) in self.wrs.iter_mut().enumerate() {
            let sg_list = if wr.num_sge() == 0 {
                ptr::null_mut()
            } else {
                sge_base.wrapping_add(self.first_sge[i])
            };
            let next = if i + 1 < n {
                wr_base.wrapping_add(i + 1)
            } else {
                ptr::null_mut()
            };
            wr.set_links(sg_list, next);
        }
        if n == 0 {
            ptr::null_mut()
        } else {
            wr_base
        }
    }

    /// Index of `bad` (as returned by a failed post) in the chain.
    fn index_of(&self, bad: *const W) -> usize {
        if bad.is_null() {
            return 0;
        }
        let base = self.wrs.as_ptr();
        let off = (bad as usize).wrapping_sub(base as usize) / std::mem::size_of::<W>().max(1);
        off.min(self.wrs.len())
    }
}

/// A chain of send work requests, posted with one
/// [`QueuePair::post_send`](crate::QueuePair::post_send).
pub struct SendChain(Chain<ffi::ibv_send_wr>);

impl Default for SendChain {
    fn default() -> Self {
        Self::new()
    }
}

impl SendChain {
    /// An empty chain.
    pub fn new() -> SendChain {
        SendChain::with_capacity(0, 0)
    }

    /// An empty chain with room for `wrs` requests and `sges` elements.
    pub fn with_capacity(wrs: usize, sges: usize) -> SendChain {
        SendChain(Chain::with_capacity(wrs, sges))
    }

    /// Appends a work request. `sges` may be empty (e.g. a zero-length
    /// SEND_WITH_IMM).
    pub fn push(
        &mut self,
        wr_id: u64,
        op: SendOp,
        sges: &[Sge],
        flags: SendFlags,
    ) -> &mut SendChain {
        self.0.push(Self::raw_wr(wr_id, op, flags), sges);
        self
    }

    /// An unlinked work request without SGEs.
    pub(crate) fn raw_wr(wr_id: u64, op: SendOp, flags: SendFlags) -> ffi::ibv_send_wr {
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            send_flags: flags.0,
            ..Default::default()
        };
        match op {
            SendOp::Send => wr.opcode = ffi::IBV_WR_SEND,
            SendOp::SendWithImm(imm) => {
                wr.opcode = ffi::IBV_WR_SEND_WITH_IMM;
                wr.imm_data = imm.to_be();
            }
            SendOp::RdmaWrite { remote_addr, rkey } => {
                wr.opcode = ffi::IBV_WR_RDMA_WRITE;
                wr.wr.rdma = ffi::ibv_send_wr_rdma { remote_addr, rkey };
            }
            SendOp::RdmaWriteWithImm {
                remote_addr,
                rkey,
                imm,
            } => {
                wr.opcode = ffi::IBV_WR_RDMA_WRITE_WITH_IMM;
                wr.wr.rdma = ffi::ibv_send_wr_rdma { remote_addr, rkey };
                wr.imm_data = imm.to_be();
            }
            SendOp::RdmaRead { remote_addr, rkey } => {
                wr.opcode = ffi::IBV_WR_RDMA_READ;
                wr.wr.rdma = ffi::ibv_send_wr_rdma { remote_addr, rkey };
            }
        }
        wr
    }

    /// Number of work requests.
    pub fn len(&self) -> usize {
        self.0.wrs.len()
    }

    /// True when there is no work request.
    pub fn is_empty(&self) -> bool {
        self.0.wrs.is_empty()
    }

    /// Total payload bytes of all requests.
    pub fn total_bytes(&self) -> u64 {
        self.0.total_bytes()
    }

    /// Removes all requests, keeping the allocations.
    pub fn clear(&mut self) {
        self.0.clear()
    }

    /// Links the chain for posting (see `Chain::link`).
    pub(crate) fn link(&mut self) -> *mut ffi::ibv_send_wr {
        self.0.link()
    }

    /// Index of `bad` (as returned by a failed post) in the chain.
    pub(crate) fn index_of(&self, bad: *const ffi::ibv_send_wr) -> usize {
        self.0.index_of(bad)
    }

    /// The raw, linked work requests (for inspection and tests).
    pub fn raw_linked(&mut self) -> &[ffi::ibv_send_wr] {
        self.0.link();
        &self.0.wrs
    }
}

/// A chain of receive work requests, for
/// [`SharedReceiveQueue::post_recv`](crate::SharedReceiveQueue::post_recv) or
/// [`QueuePair::post_recv`](crate::QueuePair::post_recv).
pub struct RecvChain(Chain<ffi::ibv_recv_wr>);

impl Default for RecvChain {
    fn default() -> Self {
        Self::new()
    }
}

impl RecvChain {
    /// An empty chain.
    pub fn new() -> RecvChain {
        RecvChain::with_capacity(0, 0)
    }

    /// An empty chain with room for `wrs` requests and `sges` elements.
    pub fn with_capacity(wrs: usize, sges: usize) -> RecvChain {
        RecvChain(Chain::with_capacity(wrs, sges))
    }

    /// Appends a receive request scattering into `sges` (in order).
    pub fn push(&mut self, wr_id: u64, sges: &[Sge]) -> &mut RecvChain {
        let wr = ffi::ibv_recv_wr {
            wr_id,
            ..Default::default()
        };
        self.0.push(wr, sges);
        self
    }

    /// Number of work requests.
    pub fn len(&self) -> usize {
        self.0.wrs.len()
    }

    /// True when there is no work request.
    pub fn is_empty(&self) -> bool {
        self.0.wrs.is_empty()
    }

    /// Total bytes the chain can receive.
    pub fn total_bytes(&self) -> u64 {
        self.0.total_bytes()
    }

    /// Removes all requests, keeping the allocations.
    pub fn clear(&mut self) {
        self.0.clear()
    }

    /// Links the chain for posting (see `Chain::link`).
    pub(crate) fn link(&mut self) -> *mut ffi::ibv_recv_wr {
        self.0.link()
    }

    /// Index of `bad` (as returned by a failed post) in the chain.
    pub(crate) fn index_of(&self, bad: *const ffi::ibv_recv_wr) -> usize {
        self.0.index_of(bad)
    }

    /// The raw, linked work requests (for inspection and tests).
    pub fn raw_linked(&mut self) -> &[ffi::ibv_recv_wr] {
        self.0.link();
        &self.0.wrs
    }
}

/// Opcode of a work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// A SEND (with or without immediate) completed.
    Send,
    /// An RDMA WRITE completed.
    RdmaWrite,
    /// An RDMA READ completed.
    RdmaRead,
    /// A receive WR consumed by a SEND.
    Recv,
    /// A receive WR consumed by an RDMA WRITE with immediate.
    RecvRdmaWithImm,
    /// Anything else (raw `ibv_wc_opcode`).
    Other(u32),
}

/// One work completion, as filled in by
/// [`CompletionQueue::poll`](crate::CompletionQueue::poll).
#[repr(transparent)]
#[derive(Clone, Copy, Default, Debug)]
pub struct WorkCompletion(pub(crate) ffi::ibv_wc);

impl WorkCompletion {
    /// The `wr_id` of the completed request.
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }
    /// Raw `ibv_wc_status` (0 = success).
    pub fn status(&self) -> u32 {
        self.0.status
    }
    /// True when the request succeeded.
    pub fn is_success(&self) -> bool {
        self.0.status == ffi::IBV_WC_SUCCESS
    }
    /// True when the request was flushed (QP in the error state).
    pub fn is_flush(&self) -> bool {
        self.0.status == ffi::IBV_WC_WR_FLUSH_ERR
    }
    /// True when the peer refused a remote access (RDMA WRITE/READ outside
    /// a region, without its rights, or with a stale key).
    pub fn is_remote_access_error(&self) -> bool {
        self.0.status == ffi::IBV_WC_REM_ACCESS_ERR
    }
    /// `Ok(())` on success, else an [`Error::Completion`].
    pub fn check(&self) -> Result<()> {
        if self.is_success() {
            Ok(())
        } else {
            Err(Error::Completion {
                wr_id: self.0.wr_id,
                status: self.0.status,
                vendor_err: self.0.vendor_err,
            })
        }
    }
    /// The name of the status, e.g. `IBV_WC_RETRY_EXC_ERR`.
    pub fn status_name(&self) -> &'static str {
        wc_status_name(self.0.status)
    }
    /// The opcode (only meaningful on success).
    pub fn opcode(&self) -> WcOpcode {
        match self.0.opcode {
            ffi::IBV_WC_SEND => WcOpcode::Send,
            ffi::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            ffi::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            ffi::IBV_WC_RECV => WcOpcode::Recv,
            ffi::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
            other => WcOpcode::Other(other),
        }
    }
    /// Bytes received (receive completions).
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }
    /// The immediate data in host byte order, if the message carried one.
    pub fn imm(&self) -> Option<u32> {
        if self.0.wc_flags & ffi::IBV_WC_WITH_IMM != 0 {
            Some(u32::from_be(self.0.imm_data))
        } else {
            None
        }
    }
    /// The local QP number the completion belongs to.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }
    /// The remote QP number (receive completions).
    pub fn src_qp(&self) -> u32 {
        self.0.src_qp
    }
    /// The vendor error code (error completions).
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }
    /// The raw structure.
    pub fn raw(&self) -> &ffi::ibv_wc {
        &self.0
    }
}

/// The name of an `ibv_wc_status` value.
pub fn wc_status_name(status: u32) -> &'static str {
    const NAMES: [&str; 24] = [
        "IBV_WC_SUCCESS",
        "IBV_WC_LOC_LEN_ERR",
        "IBV_WC_LOC_QP_OP_ERR",
        "IBV_WC_LOC_EEC_OP_ERR",
        "IBV_WC_LOC_PROT_ERR",
        "IBV_WC_WR_FLUSH_ERR",
        "IBV_WC_MW_BIND_ERR",
        "IBV_WC_BAD_RESP_ERR",
        "IBV_WC_LOC_ACCESS_ERR",
        "IBV_WC_REM_INV_REQ_ERR",
        "IBV_WC_REM_ACCESS_ERR",
        "IBV_WC_REM_OP_ERR",
        "IBV_WC_RETRY_EXC_ERR",
        "IBV_WC_RNR_RETRY_EXC_ERR",
        "IBV_WC_LOC_RDD_VIOL_ERR",
        "IBV_WC_REM_INV_RD_REQ_ERR",
        "IBV_WC_REM_ABORT_ERR",
        "IBV_WC_INV_EECN_ERR",
        "IBV_WC_INV_EEC_STATE_ERR",
        "IBV_WC_FATAL_ERR",
        "IBV_WC_RESP_TIMEOUT_ERR",
        "IBV_WC_GENERAL_ERR",
        "IBV_WC_TM_ERR",
        "IBV_WC_TM_RNDV_INCOMPLETE",
    ];
    NAMES
        .get(status as usize)
        .copied()
        .unwrap_or("IBV_WC_UNKNOWN")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sge(addr: u64, len: u32, lkey: u32) -> Sge {
        Sge {
            raw: ffi::ibv_sge {
                addr,
                length: len,
                lkey,
            },
        }
    }

    #[test]
    fn send_chain_links_wrs_and_sges() {
        let mut c = SendChain::with_capacity(1, 1); // force reallocation while building
        c.push(
            7,
            SendOp::SendWithImm(0x0102_0304),
            &[sge(0x1000, 10, 5), sge(0x2000, 20, 5)],
            SendFlags::SIGNALED,
        );
        c.push(8, SendOp::SendWithImm(0xdead_beef), &[], SendFlags::NONE); // zero-length with imm
        c.push(
            9,
            SendOp::Send,
            &[sge(0x3000, 30, 6)],
            SendFlags::SIGNALED | SendFlags::SOLICITED,
        );
        c.push(
            10,
            SendOp::RdmaWrite {
                remote_addr: 0xabc,
                rkey: 77,
            },
            &[sge(0x4000, 1, 6)],
            SendFlags::NONE,
        );
        assert_eq!(c.len(), 4);
        assert_eq!(c.total_bytes(), 61);
        let wrs = c.raw_linked().to_vec();
        let base = c.raw_linked().as_ptr();
        assert_eq!(wrs[0].wr_id, 7);
        assert_eq!(wrs[0].opcode, ffi::IBV_WR_SEND_WITH_IMM);
        assert_eq!(wrs[0].imm_data, 0x0102_0304u32.to_be());
        assert_eq!(wrs[0].num_sge, 2);
        assert_eq!(wrs[0].send_flags, ffi::IBV_SEND_SIGNALED);
        // SAFETY: sg_list points into the chain's SGE array, which holds 2
        // elements for this WR (test of the linking logic itself).
        let s0 = unsafe { std::slice::from_raw_parts(wrs[0].sg_list, 2) };
        assert_eq!(
            s0,
            &[
                ffi::ibv_sge {
                    addr: 0x1000,
                    length: 10,
                    lkey: 5
                },
                ffi::ibv_sge {
                    addr: 0x2000,
                    length: 20,
                    lkey: 5
                }
            ]
        );
        assert_eq!(wrs[0].next as *const _, base.wrapping_add(1));
        assert_eq!(wrs[1].num_sge, 0);
        assert!(wrs[1].sg_list.is_null());
        assert_eq!(wrs[1].imm_data, 0xdead_beefu32.to_be());
        assert_eq!(wrs[1].next as *const _, base.wrapping_add(2));
        assert_eq!(wrs[2].opcode, ffi::IBV_WR_SEND);
        assert_eq!(
            wrs[2].send_flags,
            ffi::IBV_SEND_SIGNALED | ffi::IBV_SEND_SOLICITED
        );
        // SAFETY: as above, one element.
        assert_eq!(
            unsafe { *wrs[2].sg_list },
            ffi::ibv_sge {
                addr: 0x3000,
                length: 30,
                lkey: 6
            }
        );
        assert_eq!(wrs[3].opcode, ffi::IBV_WR_RDMA_WRITE);
        // SAFETY: `rdma` is the variant this WR was built with.
        let rdma = unsafe { wrs[3].wr.rdma };
        assert_eq!((rdma.remote_addr, rdma.rkey), (0xabc, 77));
        assert!(wrs[3].next.is_null());
        let mut r = SendChain::new();
        r.push(
            11,
            SendOp::RdmaRead {
                remote_addr: 0xdef,
                rkey: 78,
            },
            &[sge(0x5000, 64, 6)],
            SendFlags::SIGNALED,
        );
        r.push(
            12,
            SendOp::RdmaWriteWithImm {
                remote_addr: 0x10,
                rkey: 79,
                imm: 5,
            },
            &[],
            SendFlags::NONE,
        );
        let rw = r.raw_linked().to_vec();
        assert_eq!(rw[0].opcode, ffi::IBV_WR_RDMA_READ);
        // SAFETY: `rdma` is the variant these WRs were built with.
        let (r0, r1) = unsafe { (rw[0].wr.rdma, rw[1].wr.rdma) };
        assert_eq!((r0.remote_addr, r0.rkey), (0xdef, 78));
        assert_eq!(rw[1].opcode, ffi::IBV_WR_RDMA_WRITE_WITH_IMM);
        assert_eq!(
            (r1.remote_addr, r1.rkey, rw[1].imm_data),
            (0x10, 79, 5u32.to_be())
        );
        assert_eq!(c.index_of(base.wrapping_add(2)), 2);
        assert_eq!(c.index_of(ptr::null()), 0);
        c.clear();
        assert!(c.is_empty());
        assert!(c.link().is_null());
    }

    #[test]
    fn recv_chain_links_multi_sge() {
        let mut c = RecvChain::new();
        for i in 0..5u64 {
            c.push(
                i,
                &[
                    sge(i * 0x100, 16, 1),
                    sge(i * 0x100 + 16, 48, 1),
                    sge(0x9000, 64, 2),
                ],
            );
        }
        assert_eq!(c.len(), 5);
        assert_eq!(c.total_bytes(), 5 * 128);
        let head = c.link();
        let mut n = 0;
        let mut p = head;
        while !p.is_null() {
            // SAFETY: walking the chain just linked; every node is in `c.wrs`.
            let wr = unsafe { &*p };
            assert_eq!(wr.wr_id, n);
            assert_eq!(wr.num_sge, 3);
            // SAFETY: 3 SGEs per WR were pushed.
            let s = unsafe { std::slice::from_raw_parts(wr.sg_list, 3) };
            assert_eq!(s[0].addr, n * 0x100);
            assert_eq!(s[1].addr, n * 0x100 + 16);
            assert_eq!(s[2].length, 64);
            p = wr.next;
            n += 1;
        }
        assert_eq!(n, 5);
    }

    #[test]
    fn sge_slice_bounds() {
        let s = sge(0x1000, 100, 3);
        assert_eq!(s.slice(10, 90).unwrap().addr(), 0x100a);
        assert_eq!(s.slice(100, 0).unwrap().len(), 0);
        assert!(s.slice(10, 91).is_err());
        assert!(s.slice(u32::MAX, 2).is_err());
    }

    #[test]
    fn work_completion_accessors() {
        let wc = WorkCompletion(ffi::ibv_wc {
            wr_id: 42,
            status: 0,
            opcode: ffi::IBV_WC_RECV,
            byte_len: 99,
            imm_data: 0x1234_5678u32.to_be(),
            wc_flags: ffi::IBV_WC_WITH_IMM,
            ..Default::default()
        });
        assert!(wc.is_success());
        assert_eq!(wc.opcode(), WcOpcode::Recv);
        assert_eq!(wc.imm(), Some(0x1234_5678));
        assert_eq!(wc.byte_len(), 99);
        let bad = WorkCompletion(ffi::ibv_wc {
            wr_id: 3,
            status: 12,
            vendor_err: 0x81,
            ..Default::default()
        });
        assert_eq!(bad.imm(), None);
        assert_eq!(bad.status_name(), "IBV_WC_RETRY_EXC_ERR");
        let e = bad.check().unwrap_err();
        assert_eq!(
            e.to_string(),
            "work request 3 completed with error IBV_WC_RETRY_EXC_ERR (12), vendor error 0x81"
        );
        assert_eq!(wc_status_name(1000), "IBV_WC_UNKNOWN");
    }
}
