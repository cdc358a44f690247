//! Loading libibverbs, listing and opening devices, port and GID queries.

use std::ffi::{c_int, CStr};
use std::fmt;
use std::net::Ipv4Addr;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use crate::error::{errno_text, Error, Result};
use crate::ffi;

/// Environment variable that overrides the library [`Library::load`] opens
/// (a file name or path; default `libibverbs.so.1`).
pub const LIBRARY_ENV: &str = "DXNET_IBVERBS_LIB";

/// A loaded libibverbs. Loading happens at run time (`dlopen`), so a binary
/// using this crate runs on hosts without rdma-core and reports
/// [`Error::LibraryNotAvailable`] there instead of failing to start.
#[derive(Clone, Copy)]
pub struct Library {
    pub(crate) verbs: &'static ffi::Verbs,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library")
            .field("name", &self.verbs.library_name)
            .finish()
    }
}

static DEFAULT: OnceLock<Result<Library>> = OnceLock::new();

impl Library {
    /// The process-wide libibverbs (`$DXNET_IBVERBS_LIB`, else
    /// `libibverbs.so.1`), loaded on first use. The outcome, success or
    /// error, is cached.
    pub fn load() -> Result<Library> {
        DEFAULT
            .get_or_init(|| {
                let name =
                    std::env::var(LIBRARY_ENV).unwrap_or_else(|_| ffi::LIBIBVERBS.to_string());
                Library::load_from(&name)
            })
            .clone()
    }

    /// Loads the library `name` (file name or path). Every successful call
    /// loads and keeps a library for the rest of the process (they are never
    /// unloaded); prefer [`Library::load`].
    pub fn load_from(name: &str) -> Result<Library> {
        let verbs = ffi::Verbs::open(name)?;
        Ok(Library {
            verbs: Box::leak(Box::new(verbs)),
        })
    }

    /// The name or path it was loaded from.
    pub fn name(&self) -> &str {
        &self.verbs.library_name
    }

    /// The RDMA devices libibverbs sees (may be empty).
    pub fn devices(&self) -> Result<Vec<DeviceInfo>> {
        let list = DeviceList::get(self)?;
        Ok((0..list.len()).map(|i| list.info(i)).collect())
    }

    /// Opens the device called `name`, or the first device for `None`.
    pub fn open(&self, name: Option<&str>) -> Result<Context> {
        let list = DeviceList::get(self)?;
        if list.len() == 0 {
            return Err(Error::NoDevice { detail: None });
        }
        let index = match name {
            None => 0,
            Some(want) => (0..list.len())
                .find(|&i| list.info(i).name == want)
                .ok_or_else(|| Error::DeviceNotFound {
                    name: want.to_string(),
                    available: (0..list.len()).map(|i| list.info(i).name).collect(),
                })?,
        };
        let info = list.info(index);
        // SAFETY: the device pointer comes from the live list; opening a
        // device before the list is freed is how libibverbs is meant to be
        // used (the context keeps its own reference to the device).
        let raw = unsafe { (self.verbs.fns.open_device)(list.device(index)) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os("ibv_open_device"))?;
        Ok(Context {
            inner: Arc::new(ContextInner {
                lib: *self,
                raw,
                name: info.name,
                node_guid: info.node_guid,
            }),
        })
    }
}

/// Name and GUID of a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `mlx5_0` or `rxe0`.
    pub name: String,
    /// Node GUID (host byte order).
    pub node_guid: u64,
}

/// The list from `ibv_get_device_list`, freed on drop.
struct DeviceList<'a> {
    lib: &'a Library,
    raw: NonNull<*mut ffi::ibv_device>,
    len: usize,
}

impl<'a> DeviceList<'a> {
    fn get(lib: &'a Library) -> Result<DeviceList<'a>> {
        let mut n: c_int = 0;
        // SAFETY: plain call with a valid out pointer.
        let raw = unsafe { (lib.verbs.fns.get_device_list)(&mut n) };
        match NonNull::new(raw) {
            Some(raw) => Ok(DeviceList {
                lib,
                raw,
                len: n.max(0) as usize,
            }),
            None => {
                let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
                let detail = if errno == libc::ENOSYS {
                    "the kernel has no RDMA support: ibv_get_device_list returned ENOSYS"
                        .to_string()
                } else {
                    format!("ibv_get_device_list: {}", errno_text(errno))
                };
                Err(Error::NoDevice {
                    detail: Some(detail),
                })
            }
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn device(&self, i: usize) -> *mut ffi::ibv_device {
        assert!(i < self.len);
        // SAFETY: the list holds `len` valid device pointers (then NULL).
        unsafe { *self.raw.as_ptr().add(i) }
    }

    fn info(&self, i: usize) -> DeviceInfo {
        let dev = self.device(i);
        // SAFETY: `dev` is a live device of the list; the name is a
        // NUL-terminated string owned by the device.
        let name = unsafe {
            let p = (self.lib.verbs.fns.get_device_name)(dev);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        // SAFETY: `dev` is a live device of the list.
        let guid = unsafe { (self.lib.verbs.fns.get_device_guid)(dev) };
        DeviceInfo {
            name,
            node_guid: u64::from_be(guid),
        }
    }
}

impl Drop for DeviceList<'_> {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once.
        unsafe { (self.lib.verbs.fns.free_device_list)(self.raw.as_ptr()) }
    }
}

/// The RDMA devices of the default library ([`Library::load`]).
pub fn devices() -> Result<Vec<DeviceInfo>> {
    Library::load()?.devices()
}

pub(crate) struct ContextInner {
    pub(crate) lib: Library,
    pub(crate) raw: NonNull<ffi::ibv_context>,
    name: String,
    node_guid: u64,
}

// SAFETY: libibverbs contexts may be used from any thread, concurrently
// (rdma-core's verbs are thread-safe); the pointer is only freed in Drop.
unsafe impl Send for ContextInner {}
// SAFETY: see Send.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: every object created on this context holds an Arc to it,
        // so nothing uses the context any more; it is closed once.
        unsafe { (self.lib.verbs.fns.close_device)(self.raw.as_ptr()) };
    }
}

/// An open RDMA device (`struct ibv_context`). Cheap to clone; the device is
/// closed when the last clone and every object created from it are gone.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.inner.name)
            .finish()
    }
}

impl Context {
    /// Opens the device `name` (or the first one) of the default library.
    /// Fails with "libibverbs not available" or "no RDMA device found" on
    /// hosts without RDMA.
    pub fn open(name: Option<&str>) -> Result<Context> {
        Library::load()?.open(name)
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The node GUID (host byte order).
    pub fn node_guid(&self) -> u64 {
        self.inner.node_guid
    }

    /// The raw context pointer, for calls this crate does not wrap.
    pub fn as_raw(&self) -> *mut ffi::ibv_context {
        self.inner.raw.as_ptr()
    }

    pub(crate) fn fns(&self) -> &'static ffi::VerbsFns {
        &self.inner.lib.verbs.fns
    }

    /// Device capabilities (`ibv_query_device`).
    pub fn query_device(&self) -> Result<DeviceAttr> {
        let mut attr = std::mem::MaybeUninit::<ffi::ibv_device_attr>::zeroed();
        // SAFETY: live context, out pointer to a zeroed structure of the
        // header's layout.
        let ret = unsafe { (self.fns().query_device)(self.as_raw(), attr.as_mut_ptr()) };
        if ret != 0 {
            return Err(Error::verbs("ibv_query_device", ffi::ret_to_errno(ret)));
        }
        // SAFETY: zero-initialised plain-old-data, filled in by the call.
        let a = unsafe { attr.assume_init() };
        let fw: Vec<u8> = a
            .fw_ver
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8)
            .collect();
        Ok(DeviceAttr {
            fw_ver: String::from_utf8_lossy(&fw).into_owned(),
            node_guid: u64::from_be(a.node_guid),
            max_mr_size: a.max_mr_size,
            max_qp: a.max_qp,
            max_qp_wr: a.max_qp_wr,
            max_sge: a.max_sge,
            max_cq: a.max_cq,
            max_cqe: a.max_cqe,
            max_mr: a.max_mr,
            max_pd: a.max_pd,
            max_qp_rd_atom: a.max_qp_rd_atom,
            max_qp_init_rd_atom: a.max_qp_init_rd_atom,
            max_srq: a.max_srq,
            max_srq_wr: a.max_srq_wr,
            max_srq_sge: a.max_srq_sge,
            phys_port_cnt: a.phys_port_cnt,
        })
    }

    /// Port state, LID, MTU and link layer (`ibv_query_port`).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: live context from this library; valid out pointer.
        let ret = unsafe { ffi::query_port(self.inner.lib.verbs, self.as_raw(), port, &mut attr) };
        if ret != 0 {
            return Err(Error::verbs("ibv_query_port", ffi::ret_to_errno(ret)));
        }
        Ok(PortAttr {
            state: PortState::from_raw(attr.state),
            max_mtu: Mtu::from_raw(attr.max_mtu),
            active_mtu: Mtu::from_raw(attr.active_mtu),
            lid: attr.lid,
            sm_lid: attr.sm_lid,
            gid_tbl_len: attr.gid_tbl_len,
            max_msg_sz: attr.max_msg_sz,
            port_cap_flags: attr.port_cap_flags,
            link_layer: LinkLayer::from_raw(attr.link_layer),
        })
    }

    /// GID table entry `index` of `port` (`ibv_query_gid`).
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        let index = c_int::try_from(index)
            .map_err(|_| Error::InvalidArgument(format!("GID index {index}")))?;
        let mut gid = ffi::ibv_gid::default();
        // SAFETY: live context; valid out pointer.
        let ret = unsafe { (self.fns().query_gid)(self.as_raw(), port, index, &mut gid) };
        if ret != 0 {
            return Err(Error::verbs("ibv_query_gid", ffi::ret_to_errno(ret)));
        }
        Ok(Gid(gid.raw))
    }
}

/// Device capabilities (a subset of `struct ibv_device_attr`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct DeviceAttr {
    pub fw_ver: String,
    pub node_guid: u64,
    pub max_mr_size: u64,
    pub max_qp: i32,
    pub max_qp_wr: i32,
    pub max_sge: i32,
    pub max_cq: i32,
    pub max_cqe: i32,
    pub max_mr: i32,
    pub max_pd: i32,
    pub max_qp_rd_atom: i32,
    pub max_qp_init_rd_atom: i32,
    pub max_srq: i32,
    pub max_srq_wr: i32,
    pub max_srq_sge: i32,
    pub phys_port_cnt: u8,
}

/// Port properties (a subset of `struct ibv_port_attr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAttr {
    /// Logical port state; traffic needs [`PortState::Active`].
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU currently in effect (use it as the QP's path MTU).
    pub active_mtu: Mtu,
    /// LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// LID of the subnet manager (InfiniBand).
    pub sm_lid: u16,
    /// Number of GID table entries.
    pub gid_tbl_len: i32,
    /// Largest message size.
    pub max_msg_sz: u32,
    /// `port_cap_flags` bits.
    pub port_cap_flags: u32,
    /// InfiniBand or Ethernet (RoCE).
    pub link_layer: LinkLayer,
}

/// `enum ibv_port_state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum PortState {
    Nop,
    Down,
    Init,
    Armed,
    Active,
    ActiveDefer,
    Other(u32),
}

impl PortState {
    fn from_raw(v: u32) -> PortState {
        match v {
            0 => PortState::Nop,
            ffi::IBV_PORT_DOWN => PortState::Down,
            2 => PortState::Init,
            3 => PortState::Armed,
            ffi::IBV_PORT_ACTIVE => PortState::Active,
            ffi::IBV_PORT_ACTIVE_DEFER => PortState::ActiveDefer,
            o => PortState::Other(o),
        }
    }
}

/// Link layer of a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayer {
    /// Not reported (old providers; means InfiniBand).
    Unspecified,
    /// InfiniBand: addressed by LID.
    InfiniBand,
    /// Ethernet (RoCE): addressed by GID, needs a GRH.
    Ethernet,
    /// Unknown value.
    Other(u8),
}

impl LinkLayer {
    fn from_raw(v: u8) -> LinkLayer {
        match v {
            ffi::IBV_LINK_LAYER_UNSPECIFIED => LinkLayer::Unspecified,
            ffi::IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
            ffi::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
            o => LinkLayer::Other(o),
        }
    }
}

/// `enum ibv_mtu`: path MTU of an RC connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// From the raw enum value (unknown values give 1024).
    pub fn from_raw(v: u32) -> Mtu {
        match v {
            1 => Mtu::Mtu256,
            2 => Mtu::Mtu512,
            4 => Mtu::Mtu2048,
            5 => Mtu::Mtu4096,
            _ => Mtu::Mtu1024,
        }
    }
    /// The raw enum value.
    pub fn raw(self) -> u32 {
        self as u32
    }
    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }
}

/// A 128-bit GID (RoCE: an IPv6 or IPv4-mapped address).
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// True for the all-zero GID (an empty GID table slot).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        let g = &self.0;
        if g[..10] == [0; 10] && g[10] == 0xff && g[11] == 0xff {
            Some(Ipv4Addr::new(g[12], g[13], g[14], g[15]))
        } else {
            None
        }
    }
}

impl fmt::Display for Gid {
    /// The sysfs notation, e.g. `0000:0000:0000:0000:0000:ffff:0ad3:0001`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for i in 0..8 {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", self.0[2 * i], self.0[2 * i + 1])?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}
