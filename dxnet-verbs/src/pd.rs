//! Protection domains and memory regions.

use std::alloc::Layout;
use std::ffi::c_void;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::device::Context;
use crate::error::{Error, Result};
use crate::ffi;
use crate::wr::Sge;

/// `ibv_access_flags` of a memory region or QP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AccessFlags(pub i32);

impl AccessFlags {
    /// Remote access not allowed; the device may only read (send from it).
    pub const NONE: AccessFlags = AccessFlags(0);
    /// The device may write (needed for receive buffers).
    pub const LOCAL_WRITE: AccessFlags = AccessFlags(ffi::IBV_ACCESS_LOCAL_WRITE);
    /// Peers may RDMA WRITE into it.
    pub const REMOTE_WRITE: AccessFlags = AccessFlags(ffi::IBV_ACCESS_REMOTE_WRITE);
    /// Peers may RDMA READ from it.
    pub const REMOTE_READ: AccessFlags = AccessFlags(ffi::IBV_ACCESS_REMOTE_READ);
    /// Peers may do atomics on it.
    pub const REMOTE_ATOMIC: AccessFlags = AccessFlags(ffi::IBV_ACCESS_REMOTE_ATOMIC);
    /// Whether all bits of `other` are set.
    pub fn contains(self, other: AccessFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for AccessFlags {
    type Output = AccessFlags;
    fn bitor(self, rhs: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 | rhs.0)
    }
}

pub(crate) struct PdInner {
    pub(crate) ctx: Context,
    pub(crate) raw: NonNull<ffi::ibv_pd>,
}

// SAFETY: protection domains may be used from any thread (thread-safe verbs);
// the pointer is only freed in Drop.
unsafe impl Send for PdInner {}
// SAFETY: see Send.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: MRs, SRQs and QPs hold an Arc to this PD, so none is left.
        unsafe { (self.ctx.fns().dealloc_pd)(self.raw.as_ptr()) };
    }
}

/// A protection domain (`struct ibv_pd`). Cheap to clone.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.inner.ctx.name())
            .finish()
    }
}

impl Context {
    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        // SAFETY: live context.
        let raw = unsafe { (self.fns().alloc_pd)(self.as_raw()) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os("ibv_alloc_pd"))?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                ctx: self.clone(),
                raw,
            }),
        })
    }
}

impl ProtectionDomain {
    /// The context it belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// The raw PD pointer.
    pub fn as_raw(&self) -> *mut ffi::ibv_pd {
        self.inner.raw.as_ptr()
    }

    /// Allocates `len` bytes of zeroed, page-aligned memory and registers
    /// it. The memory belongs to the returned region and is freed after
    /// deregistration.
    pub fn alloc_buffer(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot register an empty buffer".into(),
            ));
        }
        let layout = Layout::from_size_align(len, page_size())
            .map_err(|e| Error::InvalidArgument(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let mem = unsafe { std::alloc::alloc_zeroed(layout) };
        let mem = NonNull::new(mem).ok_or_else(|| Error::verbs("alloc_buffer", libc::ENOMEM))?;
        // SAFETY: `mem` is `len` valid bytes that the region owns and frees
        // only after deregistering (see Drop).
        match unsafe { self.register_raw(mem.as_ptr(), len, access) } {
            Ok(mut mr) => {
                mr.owned = Some((mem, layout));
                Ok(mr)
            }
            Err(e) => {
                // SAFETY: allocated above with this layout, not registered.
                unsafe { std::alloc::dealloc(mem.as_ptr(), layout) };
                Err(e)
            }
        }
    }

    /// Registers `len` bytes at `addr` (e.g. a ring buffer, once).
    ///
    /// # Safety
    /// The memory must stay allocated until the returned region is dropped,
    /// and from the moment a work request that names part of it is posted
    /// until that request completes, the device may read it (sends) or write
    /// it (receives, remote writes) at any time: the caller must not hand out
    /// Rust references to memory the device may write concurrently.
    pub unsafe fn register_raw(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        // SAFETY: live PD; the caller guarantees the memory range.
        let raw = unsafe {
            (self.inner.ctx.fns().reg_mr)(self.as_raw(), addr.cast::<c_void>(), len, access.0)
        };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os("ibv_reg_mr"))?;
        Ok(MemoryRegion {
            pd: self.inner.clone(),
            raw,
            addr,
            len,
            owned: None,
        })
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// A registered memory region (`struct ibv_mr`), deregistered on drop.
pub struct MemoryRegion {
    pd: Arc<PdInner>,
    raw: NonNull<ffi::ibv_mr>,
    addr: *mut u8,
    len: usize,
    owned: Option<(NonNull<u8>, Layout)>,
}

// SAFETY: the region is a handle (pointer to the libibverbs object plus the
// registered range); libibverbs objects are thread-safe, and the memory is
// only accessed through `read`/`write` (`write` takes `&mut self`) or by the
// device.
unsafe impl Send for MemoryRegion {}
// SAFETY: see Send.
unsafe impl Sync for MemoryRegion {}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

impl MemoryRegion {
    /// Start of the registered range.
    pub fn addr(&self) -> *mut u8 {
        self.addr
    }

    /// Length of the registered range in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty region (never: registration refuses them).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Local key (goes into SGEs).
    pub fn lkey(&self) -> u32 {
        // SAFETY: the ibv_mr stays valid until Drop.
        unsafe { (*self.raw.as_ptr()).lkey }
    }

    /// Remote key (for peers' RDMA operations).
    pub fn rkey(&self) -> u32 {
        // SAFETY: the ibv_mr stays valid until Drop.
        unsafe { (*self.raw.as_ptr()).rkey }
    }

    /// The raw MR pointer.
    pub fn as_raw(&self) -> *mut ffi::ibv_mr {
        self.raw.as_ptr()
    }

    /// A scatter/gather element for `len` bytes at `offset` in the region.
    pub fn sge(&self, offset: usize, len: u32) -> Result<Sge> {
        self.check(offset, len as usize)?;
        Ok(Sge {
            raw: ffi::ibv_sge {
                addr: self.addr as u64 + offset as u64,
                length: len,
                lkey: self.lkey(),
            },
        })
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::InvalidArgument(format!(
                "range {offset}+{len} outside the memory region of {} bytes",
                self.len
            )));
        }
        Ok(())
    }

    /// Copies `data` into the region at `offset`. Only for memory no posted
    /// receive or remote write may target right now.
    pub fn write(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        // SAFETY: in bounds of the registered range, which stays valid while
        // the region exists; `&mut self` excludes concurrent Rust access.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.addr.add(offset), data.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` out of the region into `out` (e.g. after the
    /// receive completion for that range).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        // SAFETY: in bounds of the registered range, which stays valid while
        // the region exists; the bytes are copied, no reference is kept.
        unsafe {
            std::ptr::copy_nonoverlapping(self.addr.add(offset), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: deregistered once; afterwards the device can no longer
        // access the memory, so owned memory can be freed.
        unsafe {
            (self.pd.ctx.fns().dereg_mr)(self.raw.as_ptr());
            if let Some((mem, layout)) = self.owned.take() {
                std::alloc::dealloc(mem.as_ptr(), layout);
            }
        }
    }
}
