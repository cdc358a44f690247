//! dxnet-verbs: a thin, mostly safe layer over libibverbs for dxnet's msgrc
//! (reliable connection) engine.
//!
//! * libibverbs is **loaded at run time** (`dlopen("libibverbs.so.1")`, see
//!   [`Library`]): the same binary runs on hosts without rdma-core and gets
//!   [`Error::LibraryNotAvailable`] ("libibverbs not available") or
//!   [`Error::NoDevice`] ("no RDMA device found") there.
//! * The data-path calls that `verbs.h` implements as `static inline`
//!   functions (`ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`,
//!   `ibv_poll_cq`, `ibv_req_notify_cq`) dispatch through the provider's ops
//!   table in `struct ibv_context`, using `#[repr(C)]` layouts checked against
//!   rdma-core 44's header ([`ffi`], `tests/layout.rs`).
//! * Objects are reference counted: a QP keeps its CQs, SRQ and PD alive, an
//!   MR its PD, everything its [`Context`]; destruction happens in the right
//!   order automatically. All handles are `Send + Sync` (libibverbs is
//!   thread-safe).
//! * `unsafe` is confined to the calls into libibverbs; the only unsafe
//!   public function is [`ProtectionDomain::register_raw`] (registering
//!   memory the caller owns).
//!
//! Typical use (RoCE):
//!
//! ```no_run
//! use dxnet_verbs::*;
//! # fn main() -> Result<()> {
//! let ctx = Context::open(Some("rxe0"))?;
//! let pd = ctx.alloc_pd()?;
//! let (scq, rcq) = (ctx.create_cq(256, None)?, ctx.create_cq(256, None)?);
//! let srq = pd.create_srq(256, 4)?;
//! let qp = pd.create_rc_qp(&QpInit { send_cq: &scq, recv_cq: &rcq, srq: Some(&srq),
//!                                    caps: QpCaps::default(), sq_sig_all: false })?;
//! let attr = ConnectAttr { local_psn: 1, ..ConnectAttr::for_port(&ctx, 1, Some(1))? };
//! let me = Endpoint::local(&ctx, &qp, 1, Some(1), attr.local_psn)?;
//! let peer: Endpoint = me; // exchange `me.to_bytes()` with the peer instead
//! qp.connect(&attr, &peer)?;
//! let mut buf = pd.alloc_buffer(1 << 20, AccessFlags::LOCAL_WRITE)?;
//! buf.write(0, b"hello")?;
//! let mut chain = SendChain::new();
//! chain.push(1, SendOp::SendWithImm(42), &[buf.sge(0, 5)?], SendFlags::SIGNALED);
//! qp.post_send(&mut chain)?;
//! let mut wcs = [WorkCompletion::default(); 16];
//! let n = scq.poll(&mut wcs)?;
//! # let _ = n; Ok(()) }
//! ```

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod cq;
mod device;
mod error;
pub mod ffi;
mod pd;
mod qp;
mod wr;

pub use cq::{CompletionChannel, CompletionQueue};
pub use device::{
    devices, Context, DeviceAttr, DeviceInfo, Gid, Library, LinkLayer, Mtu, PortAttr, PortState,
    LIBRARY_ENV,
};
pub use error::{errno_text, Error, Result};
pub use pd::{AccessFlags, MemoryRegion, ProtectionDomain};
pub use qp::{ConnectAttr, Endpoint, QpCaps, QpInit, QpState, QueuePair, SharedReceiveQueue};
pub use wr::{
    wc_status_name, RecvChain, SendChain, SendFlags, SendOp, Sge, WcOpcode, WorkCompletion,
};
