//! Shared receive queues and RC queue pairs: creation, the
//! RESET→INIT→RTR→RTS connection sequence and posting.

use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use crate::cq::{CompletionQueue, CqInner};
use crate::device::{Context, Gid, LinkLayer, Mtu};
use crate::error::{Error, Result};
use crate::ffi;
use crate::pd::{AccessFlags, PdInner, ProtectionDomain};
use crate::wr::{RecvChain, SendChain, SendFlags, SendOp};

pub(crate) struct SrqInner {
    pd: Arc<PdInner>,
    raw: NonNull<ffi::ibv_srq>,
}

// SAFETY: thread-safe libibverbs object (providers lock their queues);
// freed only in Drop.
unsafe impl Send for SrqInner {}
// SAFETY: see Send.
unsafe impl Sync for SrqInner {}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // SAFETY: QPs attached to the SRQ hold an Arc to it.
        unsafe { (self.pd.ctx.fns().destroy_srq)(self.raw.as_ptr()) };
    }
}

/// A shared receive queue (`struct ibv_srq`): one pool of receive buffers
/// for many QPs. Cheap to clone.
#[derive(Clone)]
pub struct SharedReceiveQueue {
    inner: Arc<SrqInner>,
    max_wr: u32,
    max_sge: u32,
}

impl fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("max_wr", &self.max_wr)
            .field("max_sge", &self.max_sge)
            .finish()
    }
}

impl ProtectionDomain {
    /// Creates an SRQ for `max_wr` receive requests of up to `max_sge`
    /// elements each.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        let mut attr = ffi::ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: ffi::ibv_srq_attr {
                max_wr,
                max_sge,
                srq_limit: 0,
            },
        };
        // SAFETY: live PD; valid attribute structure.
        let raw = unsafe { (self.inner.ctx.fns().create_srq)(self.as_raw(), &mut attr) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os("ibv_create_srq"))?;
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                pd: self.inner.clone(),
                raw,
            }),
            max_wr: attr.attr.max_wr,
            max_sge: attr.attr.max_sge,
        })
    }

    /// Creates an RC queue pair.
    pub fn create_rc_qp(&self, init: &QpInit<'_>) -> Result<QueuePair> {
        let mut attr = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: init.send_cq.as_raw(),
            recv_cq: init.recv_cq.as_raw(),
            srq: init.srq.map_or(ptr::null_mut(), |s| s.inner.raw.as_ptr()),
            cap: ffi::ibv_qp_cap {
                max_send_wr: init.caps.max_send_wr,
                // with an SRQ the QP has no receive queue of its own
                max_recv_wr: if init.srq.is_some() {
                    0
                } else {
                    init.caps.max_recv_wr
                },
                max_send_sge: init.caps.max_send_sge,
                max_recv_sge: if init.srq.is_some() {
                    0
                } else {
                    init.caps.max_recv_sge
                },
                max_inline_data: init.caps.max_inline_data,
            },
            qp_type: ffi::IBV_QPT_RC,
            sq_sig_all: init.sq_sig_all as i32,
        };
        // SAFETY: live PD; the CQs and SRQ are live objects of the same
        // context, kept alive by the QP.
        let raw = unsafe { (self.inner.ctx.fns().create_qp)(self.as_raw(), &mut attr) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os("ibv_create_qp"))?;
        let c = attr.cap;
        Ok(QueuePair {
            raw,
            pd: self.inner.clone(),
            _send_cq: init.send_cq.inner.clone(),
            _recv_cq: init.recv_cq.inner.clone(),
            _srq: init.srq.map(|s| s.inner.clone()),
            caps: QpCaps {
                max_send_wr: c.max_send_wr,
                max_recv_wr: c.max_recv_wr,
                max_send_sge: c.max_send_sge,
                max_recv_sge: c.max_recv_sge,
                max_inline_data: c.max_inline_data,
            },
        })
    }
}

impl SharedReceiveQueue {
    /// Posts a chain of receive requests. On failure the requests before
    /// [`Error::Post::bad_index`](Error::Post) were posted.
    #[inline]
    pub fn post_recv(&self, chain: &mut RecvChain) -> Result<()> {
        let head = chain.link();
        if head.is_null() {
            return Ok(());
        }
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: live SRQ; `head` is a NULL-terminated chain owned by
        // `chain`, whose SGEs were made from registered memory regions
        // (`MemoryRegion::sge`), valid while those regions exist.
        let ret = unsafe { ffi::post_srq_recv(self.inner.raw.as_ptr(), head, &mut bad) };
        if ret != 0 {
            return Err(Error::Post {
                call: "ibv_post_srq_recv",
                errno: ffi::ret_to_errno(ret),
                bad_index: chain.index_of(bad),
            });
        }
        Ok(())
    }

    /// Actual maximum number of outstanding requests.
    pub fn max_wr(&self) -> u32 {
        self.max_wr
    }

    /// Actual maximum number of SGEs per request.
    pub fn max_sge(&self) -> u32 {
        self.max_sge
    }

    /// The raw SRQ pointer.
    pub fn as_raw(&self) -> *mut ffi::ibv_srq {
        self.inner.raw.as_ptr()
    }
}

/// Queue sizes of a QP (`struct ibv_qp_cap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send requests.
    pub max_send_wr: u32,
    /// Outstanding receive requests (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// SGEs per send request.
    pub max_send_sge: u32,
    /// SGEs per receive request (ignored with an SRQ).
    pub max_recv_sge: u32,
    /// Bytes a send request may carry inline.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> QpCaps {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 0,
        }
    }
}

/// What [`ProtectionDomain::create_rc_qp`] needs.
#[derive(Clone, Copy, Debug)]
pub struct QpInit<'a> {
    /// CQ for send completions.
    pub send_cq: &'a CompletionQueue,
    /// CQ for receive completions.
    pub recv_cq: &'a CompletionQueue,
    /// Take receive buffers from this SRQ instead of a receive queue.
    pub srq: Option<&'a SharedReceiveQueue>,
    /// Queue sizes.
    pub caps: QpCaps,
    /// Signal every send request (else only those with `SIGNALED`).
    pub sq_sig_all: bool,
}

/// `enum ibv_qp_state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum QpState {
    Reset,
    Init,
    ReadyToReceive,
    ReadyToSend,
    SendQueueDrain,
    SendQueueError,
    Error,
    Other(u32),
}

impl QpState {
    fn from_raw(v: u32) -> QpState {
        match v {
            ffi::IBV_QPS_RESET => QpState::Reset,
            ffi::IBV_QPS_INIT => QpState::Init,
            ffi::IBV_QPS_RTR => QpState::ReadyToReceive,
            ffi::IBV_QPS_RTS => QpState::ReadyToSend,
            4 => QpState::SendQueueDrain,
            5 => QpState::SendQueueError,
            ffi::IBV_QPS_ERR => QpState::Error,
            o => QpState::Other(o),
        }
    }
}

/// What a peer needs to know to connect its QP to ours. Exchange it out of
/// band (TCP, a file, ...); [`Endpoint::to_bytes`] gives a fixed 26-byte
/// encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Endpoint {
    /// QP number.
    pub qpn: u32,
    /// First packet sequence number the peer's requests will carry (24 bits).
    pub psn: u32,
    /// LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID (RoCE: the address of the port's GID entry; may be zero on IB).
    pub gid: Gid,
}

impl Endpoint {
    /// Size of [`Endpoint::to_bytes`].
    pub const ENCODED_LEN: usize = 26;

    /// The local endpoint of `qp` on `port`: its QPN, the port's LID and,
    /// with `gid_index`, that GID.
    pub fn local(
        ctx: &Context,
        qp: &QueuePair,
        port: u8,
        gid_index: Option<u32>,
        psn: u32,
    ) -> Result<Endpoint> {
        let attr = ctx.query_port(port)?;
        let gid = match gid_index {
            Some(i) => ctx.query_gid(port, i)?,
            None => Gid::default(),
        };
        Ok(Endpoint {
            qpn: qp.qp_num(),
            psn: psn & 0xff_ffff,
            lid: attr.lid,
            gid,
        })
    }

    /// Fixed-size big-endian encoding: qpn, psn, lid, gid.
    pub fn to_bytes(&self) -> [u8; Endpoint::ENCODED_LEN] {
        let mut b = [0u8; Endpoint::ENCODED_LEN];
        b[0..4].copy_from_slice(&self.qpn.to_be_bytes());
        b[4..8].copy_from_slice(&self.psn.to_be_bytes());
        b[8..10].copy_from_slice(&self.lid.to_be_bytes());
        b[10..26].copy_from_slice(&self.gid.0);
        b
    }

    /// Decodes [`Endpoint::to_bytes`].
    pub fn from_bytes(b: &[u8]) -> Result<Endpoint> {
        if b.len() != Endpoint::ENCODED_LEN {
            return Err(Error::InvalidArgument(format!(
                "endpoint encoding of {} bytes, want 26",
                b.len()
            )));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[10..26]);
        Ok(Endpoint {
            qpn: u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
            psn: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
            lid: u16::from_be_bytes([b[8], b[9]]),
            gid: Gid(gid),
        })
    }
}

/// Connection parameters for [`QueuePair::connect`] (the local side; the
/// remote side is an [`Endpoint`]). `Default` suits Soft-RoCE and typical
/// fabrics: timeout 14 (~67 ms), 7 retries, infinite RNR retries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectAttr {
    /// Local port number (1-based).
    pub port: u8,
    /// Local GID index for the GRH. Required on RoCE (Ethernet link layer);
    /// `None` means no GRH (plain InfiniBand within a subnet).
    pub sgid_index: Option<u8>,
    /// Path MTU (use the smaller of both ports' active MTUs).
    pub mtu: Mtu,
    /// Our first send PSN (24 bits); the peer's `Endpoint::psn` is the
    /// PSN it will send with.
    pub local_psn: u32,
    /// What the peer may do to our memory (REMOTE_WRITE/READ/ATOMIC).
    pub access: AccessFlags,
    /// Local ACK timeout exponent (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// Transport retries (max 7).
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// Minimal RNR NAK timer (encoded, 12 = 0.64 ms).
    pub min_rnr_timer: u8,
    /// Outstanding RDMA READs/atomics we may issue.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA READs/atomics the peer may issue to us.
    pub max_dest_rd_atomic: u8,
    /// GRH hop limit.
    pub hop_limit: u8,
    /// GRH traffic class.
    pub traffic_class: u8,
    /// Service level.
    pub sl: u8,
}

impl Default for ConnectAttr {
    fn default() -> ConnectAttr {
        ConnectAttr {
            port: 1,
            sgid_index: None,
            mtu: Mtu::Mtu1024,
            local_psn: 0,
            access: AccessFlags::NONE,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            hop_limit: 64,
            traffic_class: 0,
            sl: 0,
        }
    }
}

impl ConnectAttr {
    /// Defaults for `port` of `ctx`: its active MTU and, on RoCE, a GRH with
    /// `gid_index` (which is then required).
    pub fn for_port(ctx: &Context, port: u8, gid_index: Option<u8>) -> Result<ConnectAttr> {
        let p = ctx.query_port(port)?;
        if p.link_layer == LinkLayer::Ethernet && gid_index.is_none() {
            return Err(Error::InvalidArgument(format!(
                "{} port {port} is RoCE (Ethernet link layer): a GID index is required",
                ctx.name()
            )));
        }
        Ok(ConnectAttr {
            port,
            sgid_index: gid_index,
            mtu: p.active_mtu,
            ..ConnectAttr::default()
        })
    }
}

/// An RC queue pair (`struct ibv_qp`), destroyed on drop.
pub struct QueuePair {
    raw: NonNull<ffi::ibv_qp>,
    pd: Arc<PdInner>,
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
    _srq: Option<Arc<SrqInner>>,
    caps: QpCaps,
}

// SAFETY: thread-safe libibverbs object (providers lock their queues);
// freed only in Drop.
unsafe impl Send for QueuePair {}
// SAFETY: see Send.
unsafe impl Sync for QueuePair {}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.qp_num())
            .field("caps", &self.caps)
            .finish()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: destroyed once; the CQs/SRQ/PD it uses outlive it (Arcs
        // dropped after this).
        unsafe { (self.pd.ctx.fns().destroy_qp)(self.raw.as_ptr()) };
    }
}

impl QueuePair {
    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: the ibv_qp stays valid while `self` exists.
        unsafe { (*self.raw.as_ptr()).qp_num }
    }

    /// The queue sizes the device actually granted.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// The raw QP pointer.
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.raw.as_ptr()
    }

    fn modify(&self, attr: &mut ffi::ibv_qp_attr, mask: i32) -> Result<()> {
        // SAFETY: live QP; valid attribute structure.
        let ret = unsafe { (self.pd.ctx.fns().modify_qp)(self.raw.as_ptr(), attr, mask) };
        if ret != 0 {
            return Err(Error::verbs("ibv_modify_qp", ffi::ret_to_errno(ret)));
        }
        Ok(())
    }

    /// The current state (`ibv_query_qp`).
    pub fn state(&self) -> Result<QpState> {
        let mut attr = ffi::ibv_qp_attr::default();
        let mut init = std::mem::MaybeUninit::<ffi::ibv_qp_init_attr>::zeroed();
        // SAFETY: live QP; valid out pointers.
        let ret = unsafe {
            (self.pd.ctx.fns().query_qp)(
                self.raw.as_ptr(),
                &mut attr,
                ffi::IBV_QP_STATE,
                init.as_mut_ptr(),
            )
        };
        if ret != 0 {
            return Err(Error::verbs("ibv_query_qp", ffi::ret_to_errno(ret)));
        }
        Ok(QpState::from_raw(attr.qp_state))
    }

    /// RESET → INIT on `port`, allowing the peer `access` to our memory.
    pub fn to_init(&self, port: u8, access: AccessFlags) -> Result<()> {
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: port,
            qp_access_flags: access.0 as u32,
            ..Default::default()
        };
        self.modify(
            &mut a,
            ffi::IBV_QP_STATE
                | ffi::IBV_QP_PKEY_INDEX
                | ffi::IBV_QP_PORT
                | ffi::IBV_QP_ACCESS_FLAGS,
        )
    }

    /// INIT → RTR: point the QP at `remote` (QPN, PSN, LID and, with a GRH,
    /// GID).
    pub fn to_rtr(&self, attr: &ConnectAttr, remote: &Endpoint) -> Result<()> {
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_RTR,
            path_mtu: attr.mtu.raw(),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn & 0xff_ffff,
            max_dest_rd_atomic: attr.max_dest_rd_atomic,
            min_rnr_timer: attr.min_rnr_timer,
            ..Default::default()
        };
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = attr.sl;
        a.ah_attr.port_num = attr.port;
        if let Some(sgid_index) = attr.sgid_index {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid.0 };
            a.ah_attr.grh.sgid_index = sgid_index;
            a.ah_attr.grh.hop_limit = attr.hop_limit;
            a.ah_attr.grh.traffic_class = attr.traffic_class;
        }
        self.modify(
            &mut a,
            ffi::IBV_QP_STATE
                | ffi::IBV_QP_AV
                | ffi::IBV_QP_PATH_MTU
                | ffi::IBV_QP_DEST_QPN
                | ffi::IBV_QP_RQ_PSN
                | ffi::IBV_QP_MAX_DEST_RD_ATOMIC
                | ffi::IBV_QP_MIN_RNR_TIMER,
        )
    }

    /// RTR → RTS: start sending with `attr.local_psn`.
    pub fn to_rts(&self, attr: &ConnectAttr) -> Result<()> {
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_RTS,
            sq_psn: attr.local_psn & 0xff_ffff,
            timeout: attr.timeout,
            retry_cnt: attr.retry_cnt,
            rnr_retry: attr.rnr_retry,
            max_rd_atomic: attr.max_rd_atomic,
            ..Default::default()
        };
        self.modify(
            &mut a,
            ffi::IBV_QP_STATE
                | ffi::IBV_QP_TIMEOUT
                | ffi::IBV_QP_RETRY_CNT
                | ffi::IBV_QP_RNR_RETRY
                | ffi::IBV_QP_SQ_PSN
                | ffi::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// The whole sequence RESET → INIT → RTR → RTS.
    pub fn connect(&self, attr: &ConnectAttr, remote: &Endpoint) -> Result<()> {
        self.to_init(attr.port, attr.access)?;
        self.to_rtr(attr, remote)?;
        self.to_rts(attr)
    }

    /// Moves the QP to the error state: outstanding requests complete with
    /// `IBV_WC_WR_FLUSH_ERR` (for an orderly shutdown).
    pub fn to_error(&self) -> Result<()> {
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify(&mut a, ffi::IBV_QP_STATE)
    }

    /// Moves the QP back to RESET (it can then be connected again).
    pub fn reset(&self) -> Result<()> {
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_RESET,
            ..Default::default()
        };
        self.modify(&mut a, ffi::IBV_QP_STATE)
    }

    /// Posts a chain of send requests. On failure the requests before
    /// `bad_index` (see [`Error::Post`]) were posted.
    #[inline]
    pub fn post_send(&self, chain: &mut SendChain) -> Result<()> {
        let head = chain.link();
        if head.is_null() {
            return Ok(());
        }
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP; `head` is a NULL-terminated chain owned by
        // `chain`, whose SGEs were made from registered memory regions
        // (`MemoryRegion::sge`), valid while those regions exist.
        let ret = unsafe { ffi::post_send(self.raw.as_ptr(), head, &mut bad) };
        if ret != 0 {
            return Err(Error::Post {
                call: "ibv_post_send",
                errno: ffi::ret_to_errno(ret),
                bad_index: chain.index_of(bad),
            });
        }
        Ok(())
    }

    /// Posts one send request whose payload `data` is copied into the work
    /// request (`IBV_SEND_INLINE`): `data` needs no memory registration and
    /// may be reused as soon as this returns. At most the QP's
    /// `max_inline_data` bytes (the provider refuses more). `signaled`: the
    /// request produces a work completion.
    pub fn post_send_inline(
        &self,
        wr_id: u64,
        op: SendOp,
        data: &[u8],
        signaled: bool,
    ) -> Result<()> {
        if data.len() > self.caps.max_inline_data as usize {
            return Err(Error::InvalidArgument(format!(
                "{} bytes inline, the queue pair takes at most {}",
                data.len(),
                self.caps.max_inline_data
            )));
        }
        let mut sge = ffi::ibv_sge {
            addr: data.as_ptr() as u64,
            length: data.len() as u32,
            lkey: 0,
        };
        let mut flags = SendFlags::INLINE;
        if signaled {
            flags = flags | SendFlags::SIGNALED;
        }
        let mut wr = SendChain::raw_wr(wr_id, op, flags);
        if !data.is_empty() {
            wr.num_sge = 1;
            wr.sg_list = &mut sge;
        }
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP; `wr` is a single request (next = NULL) whose one
        // SGE points at `data`, which is borrowed for this call. With
        // IBV_SEND_INLINE the provider copies those bytes into the send
        // queue during the call and never reads them (or the lkey) later.
        let ret = unsafe { ffi::post_send(self.raw.as_ptr(), &mut wr, &mut bad) };
        if ret != 0 {
            return Err(Error::Post {
                call: "ibv_post_send",
                errno: ffi::ret_to_errno(ret),
                bad_index: 0,
            });
        }
        Ok(())
    }

    /// Posts a chain of receive requests to the QP's own receive queue (not
    /// for QPs that use an SRQ).
    #[inline]
    pub fn post_recv(&self, chain: &mut RecvChain) -> Result<()> {
        let head = chain.link();
        if head.is_null() {
            return Ok(());
        }
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: as in `post_send`.
        let ret = unsafe { ffi::post_recv(self.raw.as_ptr(), head, &mut bad) };
        if ret != 0 {
            return Err(Error::Post {
                call: "ibv_post_recv",
                errno: ffi::ret_to_errno(ret),
                bad_index: chain.index_of(bad),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_roundtrip() {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[10, 211, 0, 1]);
        let e = Endpoint {
            qpn: 0x11,
            psn: 0xabcdef,
            lid: 7,
            gid: Gid(gid),
        };
        let b = e.to_bytes();
        assert_eq!(Endpoint::from_bytes(&b).unwrap(), e);
        assert!(Endpoint::from_bytes(&b[..25]).is_err());
        assert_eq!(e.gid.ipv4(), Some(std::net::Ipv4Addr::new(10, 211, 0, 1)));
        assert_eq!(e.gid.to_string(), "0000:0000:0000:0000:0000:ffff:0ad3:0001");
    }

    #[test]
    fn mtu_values() {
        assert_eq!(Mtu::Mtu256.bytes(), 256);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert_eq!(Mtu::from_raw(ffi::IBV_MTU_4096), Mtu::Mtu4096);
        assert_eq!(Mtu::Mtu1024.raw(), ffi::IBV_MTU_1024);
    }
}
