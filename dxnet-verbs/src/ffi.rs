//! Raw libibverbs ABI: `#[repr(C)]` declarations of the structures this crate
//! touches, the constants it uses, the table of exported functions resolved at
//! run time with `dlopen("libibverbs.so.1")`, and the data-path calls that
//! `verbs.h` implements as `static inline` functions (they dispatch through
//! `struct ibv_context`'s `ops` table, so they need no symbol).
//!
//! Layouts follow rdma-core 44's `<infiniband/verbs.h>` (Debian 12) on LP64
//! Linux; they have been stable since rdma-core 17. `tests/layout.rs` checks
//! every size and offset declared here against a reference table generated
//! from that header and, where a C compiler and the header are installed,
//! against a freshly compiled probe (`tests/layout_probe.c`).
//!
//! Everything here is `unsafe` to use; the safe API is in the other modules.

#![allow(non_camel_case_types, missing_docs)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::mem::{offset_of, size_of};

use libc::{pthread_cond_t, pthread_mutex_t};

use crate::error::Error;

// ---------------------------------------------------------------------------
// Constants (values checked against the header by tests/layout.rs)
// ---------------------------------------------------------------------------

pub const IBV_WR_RDMA_WRITE: c_uint = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_uint = 1;
pub const IBV_WR_SEND: c_uint = 2;
pub const IBV_WR_SEND_WITH_IMM: c_uint = 3;
pub const IBV_WR_RDMA_READ: c_uint = 4;

pub const IBV_SEND_FENCE: c_uint = 1;
pub const IBV_SEND_SIGNALED: c_uint = 2;
pub const IBV_SEND_SOLICITED: c_uint = 4;
pub const IBV_SEND_INLINE: c_uint = 8;

pub const IBV_WC_SEND: c_uint = 0;
pub const IBV_WC_RDMA_WRITE: c_uint = 1;
pub const IBV_WC_RDMA_READ: c_uint = 2;
pub const IBV_WC_RECV: c_uint = 128;
pub const IBV_WC_RECV_RDMA_WITH_IMM: c_uint = 129;
pub const IBV_WC_WITH_IMM: c_uint = 2;

pub const IBV_WC_SUCCESS: c_uint = 0;
pub const IBV_WC_WR_FLUSH_ERR: c_uint = 5;
pub const IBV_WC_REM_ACCESS_ERR: c_uint = 10;
pub const IBV_WC_GENERAL_ERR: c_uint = 21;

pub const IBV_QPT_RC: c_uint = 2;

pub const IBV_QPS_RESET: c_uint = 0;
pub const IBV_QPS_INIT: c_uint = 1;
pub const IBV_QPS_RTR: c_uint = 2;
pub const IBV_QPS_RTS: c_uint = 3;
pub const IBV_QPS_ERR: c_uint = 6;

pub const IBV_QP_STATE: c_int = 1 << 0;
pub const IBV_QP_CUR_STATE: c_int = 1 << 1;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 2;
pub const IBV_ACCESS_REMOTE_READ: c_int = 4;
pub const IBV_ACCESS_REMOTE_ATOMIC: c_int = 8;

pub const IBV_MTU_256: c_uint = 1;
pub const IBV_MTU_1024: c_uint = 3;
pub const IBV_MTU_4096: c_uint = 5;

pub const IBV_PORT_DOWN: c_uint = 1;
pub const IBV_PORT_ACTIVE: c_uint = 4;
pub const IBV_PORT_ACTIVE_DEFER: c_uint = 5;

pub const IBV_LINK_LAYER_UNSPECIFIED: u8 = 0;
pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

/// `ibv_context.abi_compat` of a context that is embedded in a
/// `struct verbs_context` (every provider since rdma-core 17).
pub const VERBS_ABI_IS_EXTENDED: usize = usize::MAX;
/// `offsetof(verbs_context, context) - offsetof(verbs_context, query_port)`:
/// how far in front of the `ibv_context` the extended `query_port` op lives.
pub const VCTX_CONTEXT_MINUS_QUERY_PORT: usize = 320;
/// `sizeof(verbs_context) - offsetof(verbs_context, query_port)`: the minimum
/// `verbs_context.sz` of a provider that fills in `query_port`.
pub const VCTX_SIZE_MINUS_QUERY_PORT: usize = 648;
/// `offsetof(verbs_context, context) - offsetof(verbs_context, sz)`.
pub const VCTX_CONTEXT_MINUS_SZ: usize = 8;

// ---------------------------------------------------------------------------
// Structures
// ---------------------------------------------------------------------------

/// `union ibv_gid` (16 bytes, 8-byte aligned because of its `__be64` view).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

/// `struct ibv_device`: only ever handled by pointer.
#[repr(C)]
pub struct ibv_device {
    _opaque: [u8; 0],
}

/// Opaque structures only handled by pointer.
#[repr(C)]
pub struct ibv_ah {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ibv_mw {
    _opaque: [u8; 0],
}

pub type PollCqFn =
    unsafe extern "C" fn(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int;
pub type ReqNotifyCqFn = unsafe extern "C" fn(cq: *mut ibv_cq, solicited_only: c_int) -> c_int;
pub type PostSrqRecvFn = unsafe extern "C" fn(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int;
pub type PostSendFn = unsafe extern "C" fn(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int;
pub type PostRecvFn = unsafe extern "C" fn(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int;
pub type QueryPortExFn = unsafe extern "C" fn(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    attr_len: usize,
) -> c_int;

type AnyFn = Option<unsafe extern "C" fn()>;

/// `struct ibv_context_ops`: 32 function pointers; the `_compat_*` ones are
/// legacy slots this crate never calls.
#[repr(C)]
pub struct ibv_context_ops {
    pub _compat_query_device: AnyFn,
    pub _compat_query_port: AnyFn,
    pub _compat_alloc_pd: AnyFn,
    pub _compat_dealloc_pd: AnyFn,
    pub _compat_reg_mr: AnyFn,
    pub _compat_rereg_mr: AnyFn,
    pub _compat_dereg_mr: AnyFn,
    pub alloc_mw: AnyFn,
    pub bind_mw: AnyFn,
    pub dealloc_mw: AnyFn,
    pub _compat_create_cq: AnyFn,
    pub poll_cq: Option<PollCqFn>,
    pub req_notify_cq: Option<ReqNotifyCqFn>,
    pub _compat_cq_event: AnyFn,
    pub _compat_resize_cq: AnyFn,
    pub _compat_destroy_cq: AnyFn,
    pub _compat_create_srq: AnyFn,
    pub _compat_modify_srq: AnyFn,
    pub _compat_query_srq: AnyFn,
    pub _compat_destroy_srq: AnyFn,
    pub post_srq_recv: Option<PostSrqRecvFn>,
    pub _compat_create_qp: AnyFn,
    pub _compat_query_qp: AnyFn,
    pub _compat_modify_qp: AnyFn,
    pub _compat_destroy_qp: AnyFn,
    pub post_send: Option<PostSendFn>,
    pub post_recv: Option<PostRecvFn>,
    pub _compat_create_ah: AnyFn,
    pub _compat_destroy_ah: AnyFn,
    pub _compat_attach_mcast: AnyFn,
    pub _compat_detach_mcast: AnyFn,
    pub _compat_async_event: AnyFn,
}

/// `struct ibv_context`.
#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

/// `struct ibv_device_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_uint,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_port_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_port_attr {
    pub state: c_uint,
    pub max_mtu: c_uint,
    pub active_mtu: c_uint,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

/// `struct ibv_pd`.
#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// `struct ibv_cq`.
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// `struct ibv_srq`.
#[repr(C)]
pub struct ibv_srq {
    pub context: *mut ibv_context,
    pub srq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub handle: u32,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_qp`.
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_uint,
    pub qp_type: c_uint,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `wr.rdma` of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_send_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

/// `wr.atomic` of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_send_wr_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// `wr.ud` of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_ud {
    pub ah: *mut ibv_ah,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// The `wr` union of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_wr {
    pub rdma: ibv_send_wr_rdma,
    pub atomic: ibv_send_wr_atomic,
    pub ud: ibv_send_wr_ud,
}

/// `struct ibv_send_wr`. The trailing `qp_type` (XRC) and `bind_mw`/`tso`
/// unions are kept as zeroed raw storage: an RC SEND never reads them.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    /// Immediate data in network byte order (union with `invalidate_rkey`).
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    pub qp_type: u32,
    pub bind_mw: [u64; 6],
}

impl Default for ibv_send_wr {
    fn default() -> Self {
        ibv_send_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
            opcode: 0,
            send_flags: 0,
            imm_data: 0,
            wr: ibv_send_wr_wr {
                atomic: ibv_send_wr_atomic::default(),
            },
            qp_type: 0,
            bind_mw: [0; 6],
        }
    }
}

/// `struct ibv_recv_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

impl Default for ibv_recv_wr {
    fn default() -> Self {
        ibv_recv_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        }
    }
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_uint,
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Immediate data in network byte order (union with `invalidated_rkey`).
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

/// `struct ibv_srq_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_srq_attr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

/// `struct ibv_srq_init_attr`.
#[repr(C)]
pub struct ibv_srq_init_attr {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: c_uint,
    pub cur_qp_state: c_uint,
    pub path_mtu: c_uint,
    pub path_mig_state: c_uint,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

// ---------------------------------------------------------------------------
// Exported functions, resolved with dlopen/dlsym
// ---------------------------------------------------------------------------

/// The default library name (the SONAME of rdma-core's libibverbs).
pub const LIBIBVERBS: &str = "libibverbs.so.1";

macro_rules! verbs_fns {
    ($( $field:ident = $sym:literal : fn($($arg:ty),*) $(-> $ret:ty)? ;)*) => {
        /// The exported libibverbs functions this crate uses.
        pub struct VerbsFns {
            $( pub $field: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
        }

        impl VerbsFns {
            /// Resolves every symbol in `lib`.
            ///
            /// # Safety
            /// `lib` must be rdma-core's libibverbs (ABI `IBVERBS_1.1`), whose
            /// symbols have exactly these signatures, and must stay loaded
            /// for as long as the returned table is used.
            pub unsafe fn resolve(lib: &libloading::Library, name: &str) -> Result<Self, Error> {
                Ok(VerbsFns {
                    $( $field: {
                        // SAFETY: the caller guarantees that `lib` is
                        // libibverbs, where this symbol has this signature.
                        let sym = unsafe {
                            lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(
                                concat!($sym, "\0").as_bytes())
                        };
                        *sym.map_err(|e| Error::MissingSymbol {
                            library: name.to_string(),
                            symbol: $sym,
                            reason: e.to_string(),
                        })?
                    }, )*
                })
            }
        }
    };
}

verbs_fns! {
    get_device_list = "ibv_get_device_list": fn(*mut c_int) -> *mut *mut ibv_device;
    free_device_list = "ibv_free_device_list": fn(*mut *mut ibv_device);
    get_device_name = "ibv_get_device_name": fn(*mut ibv_device) -> *const c_char;
    get_device_guid = "ibv_get_device_guid": fn(*mut ibv_device) -> u64;
    open_device = "ibv_open_device": fn(*mut ibv_device) -> *mut ibv_context;
    close_device = "ibv_close_device": fn(*mut ibv_context) -> c_int;
    query_device = "ibv_query_device": fn(*mut ibv_context, *mut ibv_device_attr) -> c_int;
    query_port = "ibv_query_port": fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
    query_gid = "ibv_query_gid": fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
    alloc_pd = "ibv_alloc_pd": fn(*mut ibv_context) -> *mut ibv_pd;
    dealloc_pd = "ibv_dealloc_pd": fn(*mut ibv_pd) -> c_int;
    reg_mr = "ibv_reg_mr": fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
    dereg_mr = "ibv_dereg_mr": fn(*mut ibv_mr) -> c_int;
    create_comp_channel = "ibv_create_comp_channel": fn(*mut ibv_context) -> *mut ibv_comp_channel;
    destroy_comp_channel = "ibv_destroy_comp_channel": fn(*mut ibv_comp_channel) -> c_int;
    create_cq = "ibv_create_cq": fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq;
    destroy_cq = "ibv_destroy_cq": fn(*mut ibv_cq) -> c_int;
    get_cq_event = "ibv_get_cq_event": fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;
    ack_cq_events = "ibv_ack_cq_events": fn(*mut ibv_cq, c_uint);
    create_srq = "ibv_create_srq": fn(*mut ibv_pd, *mut ibv_srq_init_attr) -> *mut ibv_srq;
    destroy_srq = "ibv_destroy_srq": fn(*mut ibv_srq) -> c_int;
    create_qp = "ibv_create_qp": fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
    modify_qp = "ibv_modify_qp": fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
    query_qp = "ibv_query_qp": fn(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int;
    destroy_qp = "ibv_destroy_qp": fn(*mut ibv_qp) -> c_int;
}

/// A loaded libibverbs: the library handle and its resolved functions.
/// Never unloaded (the function pointers are used for the life of the
/// process; unloading libibverbs with open devices is not supported anyway).
pub struct Verbs {
    pub fns: VerbsFns,
    pub library_name: String,
    _lib: libloading::Library,
}

impl Verbs {
    /// `dlopen`s `name` and resolves the functions.
    pub fn open(name: &str) -> Result<Verbs, Error> {
        // SAFETY: loading a shared library runs its initialisers; libibverbs'
        // (and its providers') constructors only set up internal state.
        let lib =
            unsafe { libloading::Library::new(name) }.map_err(|e| Error::LibraryNotAvailable {
                library: name.to_string(),
                reason: e.to_string(),
            })?;
        // SAFETY: `lib` is the library the caller named as libibverbs, and it
        // is stored next to the table, so it outlives every use of it.
        let fns = unsafe { VerbsFns::resolve(&lib, name) }?;
        Ok(Verbs {
            fns,
            library_name: name.to_string(),
            _lib: lib,
        })
    }
}

// ---------------------------------------------------------------------------
// The static inline parts of verbs.h
// ---------------------------------------------------------------------------

/// Converts a verbs return value to an errno: rdma-core functions return a
/// positive errno, a few providers `-errno`, and some `-1` with `errno` set.
pub fn ret_to_errno(ret: c_int) -> i32 {
    if ret > 0 {
        ret
    } else if ret == -1 {
        std::io::Error::last_os_error()
            .raw_os_error()
            .filter(|e| *e != 0)
            .unwrap_or(libc::EIO)
    } else {
        -ret
    }
}

/// `ibv_query_port()` as verbs.h does it: through the extended
/// `verbs_context.query_port` op when the provider has one (it fills the whole
/// structure, e.g. `link_layer`), else the exported compat entry point.
///
/// # Safety
/// `ctx` must be an open context from `verbs`, `attr` valid for writes.
pub unsafe fn query_port(
    verbs: &Verbs,
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: `ctx` is a live context (caller). When `abi_compat` says
    // "extended", the context is the last member of a `struct verbs_context`,
    // whose `sz` field and `query_port` op sit at the fixed distances in front
    // of it that tests/layout.rs checks against the header; `sz` tells whether
    // this provider's structure is large enough to have the op.
    unsafe {
        if (*ctx).abi_compat as usize == VERBS_ABI_IS_EXTENDED {
            let base = ctx.cast::<u8>();
            let sz = base.sub(VCTX_CONTEXT_MINUS_SZ).cast::<usize>().read();
            if sz >= VCTX_SIZE_MINUS_QUERY_PORT {
                let op = base
                    .sub(VCTX_CONTEXT_MINUS_QUERY_PORT)
                    .cast::<Option<QueryPortExFn>>()
                    .read();
                if let Some(op) = op {
                    return op(ctx, port, attr, size_of::<ibv_port_attr>());
                }
            }
        }
        attr.write(ibv_port_attr::default());
        (verbs.fns.query_port)(ctx, port, attr)
    }
}

/// `ibv_poll_cq()`: returns the number of completions written, or < 0.
///
/// # Safety
/// `cq` must be a live CQ, `wc` valid for `n` writes.
#[inline]
pub unsafe fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: a live CQ points at its live context, whose ops table the
    // provider filled in; the caller provides the output array.
    unsafe {
        match (*(*cq).context).ops.poll_cq {
            Some(f) => f(cq, n, wc),
            None => -libc::EOPNOTSUPP,
        }
    }
}

/// `ibv_req_notify_cq()`.
///
/// # Safety
/// `cq` must be a live CQ.
#[inline]
pub unsafe fn req_notify_cq(cq: *mut ibv_cq, solicited_only: bool) -> c_int {
    // SAFETY: as in `poll_cq`.
    unsafe {
        match (*(*cq).context).ops.req_notify_cq {
            Some(f) => f(cq, solicited_only as c_int),
            None => libc::EOPNOTSUPP,
        }
    }
}

/// `ibv_post_send()`.
///
/// # Safety
/// `qp` must be a live QP; `wr` a valid NULL-terminated chain whose SGEs
/// describe registered memory that stays valid until the WRs complete.
#[inline]
pub unsafe fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: a live QP points at its live context and its provider ops.
    unsafe {
        match (*(*qp).context).ops.post_send {
            Some(f) => f(qp, wr, bad),
            None => libc::EOPNOTSUPP,
        }
    }
}

/// `ibv_post_recv()`.
///
/// # Safety
/// As for [`post_send`].
#[inline]
pub unsafe fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: a live QP points at its live context and its provider ops.
    unsafe {
        match (*(*qp).context).ops.post_recv {
            Some(f) => f(qp, wr, bad),
            None => libc::EOPNOTSUPP,
        }
    }
}

/// `ibv_post_srq_recv()`.
///
/// # Safety
/// As for [`post_send`], with a live SRQ.
#[inline]
pub unsafe fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: a live SRQ points at its live context and its provider ops.
    unsafe {
        match (*(*srq).context).ops.post_srq_recv {
            Some(f) => f(srq, wr, bad),
            None => libc::EOPNOTSUPP,
        }
    }
}

// ---------------------------------------------------------------------------
// Layout report (compared with tests/layout_probe.c by tests/layout.rs)
// ---------------------------------------------------------------------------

/// The sizes, offsets and constants declared in this module, in the output
/// format of `tests/layout_probe.c`.
#[doc(hidden)]
pub fn layout_report() -> String {
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    macro_rules! sz {
        ($t:ident) => {
            line(format!("size {} {}", stringify!($t), size_of::<$t>()))
        };
    }
    macro_rules! off {
        ($t:ident, $($f:ident),+) => {
            $( line(format!("off {}.{} {}", stringify!($t), stringify!($f), offset_of!($t, $f))); )+
        };
    }
    macro_rules! konst {
        ($($c:ident),+) => {
            $( line(format!("const {} {}", stringify!($c), $c as i64)); )+
        };
    }
    sz!(ibv_gid);
    sz!(ibv_context_ops);
    off!(
        ibv_context_ops,
        poll_cq,
        req_notify_cq,
        post_srq_recv,
        post_send,
        post_recv
    );
    sz!(ibv_context);
    off!(
        ibv_context,
        device,
        ops,
        cmd_fd,
        async_fd,
        num_comp_vectors,
        mutex,
        abi_compat
    );
    line(format!(
        "vctx context_minus_query_port {VCTX_CONTEXT_MINUS_QUERY_PORT}"
    ));
    line(format!(
        "vctx size_minus_query_port {VCTX_SIZE_MINUS_QUERY_PORT}"
    ));
    line(format!("vctx context_minus_sz {VCTX_CONTEXT_MINUS_SZ}"));
    sz!(ibv_port_attr);
    off!(
        ibv_port_attr,
        state,
        max_mtu,
        active_mtu,
        gid_tbl_len,
        port_cap_flags,
        max_msg_sz,
        pkey_tbl_len,
        lid,
        sm_lid,
        lmc,
        active_width,
        active_speed,
        phys_state,
        link_layer,
        flags,
        port_cap_flags2
    );
    sz!(ibv_device_attr);
    off!(
        ibv_device_attr,
        node_guid,
        max_mr_size,
        vendor_id,
        max_qp,
        max_qp_wr,
        max_sge,
        max_cqe,
        max_mr,
        atomic_cap,
        max_srq,
        max_srq_wr,
        max_srq_sge,
        max_pkeys,
        local_ca_ack_delay,
        phys_port_cnt
    );
    sz!(ibv_pd);
    off!(ibv_pd, context, handle);
    sz!(ibv_mr);
    off!(ibv_mr, addr, length, handle, lkey, rkey);
    sz!(ibv_comp_channel);
    off!(ibv_comp_channel, fd);
    sz!(ibv_cq);
    off!(
        ibv_cq,
        context,
        channel,
        cq_context,
        handle,
        cqe,
        mutex,
        cond,
        comp_events_completed,
        async_events_completed
    );
    sz!(ibv_srq);
    off!(
        ibv_srq,
        context,
        srq_context,
        pd,
        handle,
        mutex,
        cond,
        events_completed
    );
    sz!(ibv_qp);
    off!(
        ibv_qp,
        context,
        qp_context,
        pd,
        send_cq,
        recv_cq,
        srq,
        handle,
        qp_num,
        state,
        qp_type,
        mutex,
        cond,
        events_completed
    );
    sz!(ibv_sge);
    off!(ibv_sge, addr, length, lkey);
    sz!(ibv_send_wr);
    off!(
        ibv_send_wr,
        wr_id,
        next,
        sg_list,
        num_sge,
        opcode,
        send_flags,
        imm_data,
        wr
    );
    let wr = offset_of!(ibv_send_wr, wr);
    line(format!(
        "off ibv_send_wr.wr.rdma.remote_addr {}",
        wr + offset_of!(ibv_send_wr_rdma, remote_addr)
    ));
    line(format!(
        "off ibv_send_wr.wr.rdma.rkey {}",
        wr + offset_of!(ibv_send_wr_rdma, rkey)
    ));
    line(format!(
        "off ibv_send_wr.wr.ud.remote_qpn {}",
        wr + offset_of!(ibv_send_wr_ud, remote_qpn)
    ));
    off!(ibv_send_wr, qp_type, bind_mw);
    sz!(ibv_recv_wr);
    off!(ibv_recv_wr, wr_id, next, sg_list, num_sge);
    sz!(ibv_wc);
    off!(
        ibv_wc,
        wr_id,
        status,
        opcode,
        vendor_err,
        byte_len,
        imm_data,
        qp_num,
        src_qp,
        wc_flags,
        pkey_index,
        slid,
        sl,
        dlid_path_bits
    );
    sz!(ibv_qp_cap);
    off!(
        ibv_qp_cap,
        max_send_wr,
        max_recv_wr,
        max_send_sge,
        max_recv_sge,
        max_inline_data
    );
    sz!(ibv_qp_init_attr);
    off!(
        ibv_qp_init_attr,
        qp_context,
        send_cq,
        recv_cq,
        srq,
        cap,
        qp_type,
        sq_sig_all
    );
    sz!(ibv_srq_attr);
    sz!(ibv_srq_init_attr);
    off!(ibv_srq_init_attr, attr);
    sz!(ibv_global_route);
    off!(
        ibv_global_route,
        dgid,
        flow_label,
        sgid_index,
        hop_limit,
        traffic_class
    );
    sz!(ibv_ah_attr);
    off!(
        ibv_ah_attr,
        grh,
        dlid,
        sl,
        src_path_bits,
        static_rate,
        is_global,
        port_num
    );
    sz!(ibv_qp_attr);
    off!(
        ibv_qp_attr,
        qp_state,
        cur_qp_state,
        path_mtu,
        path_mig_state,
        qkey,
        rq_psn,
        sq_psn,
        dest_qp_num,
        qp_access_flags,
        cap,
        ah_attr,
        alt_ah_attr,
        pkey_index,
        alt_pkey_index,
        en_sqd_async_notify,
        sq_draining,
        max_rd_atomic,
        max_dest_rd_atomic,
        min_rnr_timer,
        port_num,
        timeout,
        retry_cnt,
        rnr_retry,
        alt_port_num,
        alt_timeout,
        rate_limit
    );
    konst!(
        IBV_WR_RDMA_WRITE,
        IBV_WR_RDMA_WRITE_WITH_IMM,
        IBV_WR_SEND,
        IBV_WR_SEND_WITH_IMM,
        IBV_WR_RDMA_READ,
        IBV_SEND_FENCE,
        IBV_SEND_SIGNALED,
        IBV_SEND_SOLICITED,
        IBV_SEND_INLINE,
        IBV_WC_SEND,
        IBV_WC_RDMA_WRITE,
        IBV_WC_RDMA_READ,
        IBV_WC_RECV,
        IBV_WC_RECV_RDMA_WITH_IMM,
        IBV_WC_WITH_IMM,
        IBV_WC_SUCCESS,
        IBV_WC_WR_FLUSH_ERR,
        IBV_WC_REM_ACCESS_ERR,
        IBV_WC_GENERAL_ERR,
        IBV_QPT_RC,
        IBV_QPS_RESET,
        IBV_QPS_INIT,
        IBV_QPS_RTR,
        IBV_QPS_RTS,
        IBV_QPS_ERR,
        IBV_QP_STATE,
        IBV_QP_CUR_STATE,
        IBV_QP_ACCESS_FLAGS,
        IBV_QP_PKEY_INDEX,
        IBV_QP_PORT,
        IBV_QP_AV,
        IBV_QP_PATH_MTU,
        IBV_QP_TIMEOUT,
        IBV_QP_RETRY_CNT,
        IBV_QP_RNR_RETRY,
        IBV_QP_RQ_PSN,
        IBV_QP_MAX_QP_RD_ATOMIC,
        IBV_QP_MIN_RNR_TIMER,
        IBV_QP_SQ_PSN,
        IBV_QP_MAX_DEST_RD_ATOMIC,
        IBV_QP_DEST_QPN,
        IBV_ACCESS_LOCAL_WRITE,
        IBV_ACCESS_REMOTE_WRITE,
        IBV_ACCESS_REMOTE_READ,
        IBV_ACCESS_REMOTE_ATOMIC,
        IBV_MTU_256,
        IBV_MTU_1024,
        IBV_MTU_4096,
        IBV_PORT_ACTIVE,
        IBV_PORT_DOWN,
        IBV_PORT_ACTIVE_DEFER,
        IBV_LINK_LAYER_UNSPECIFIED,
        IBV_LINK_LAYER_INFINIBAND,
        IBV_LINK_LAYER_ETHERNET
    );
    out
}
