//! The memory behind an application's reusable buffer (`dxnet::Buffer`):
//! an address-stable allocation, its use count, and at most one device
//! registration of it.
//!
//! Who may touch the bytes when:
//! - the one owning handle (`dxnet::Buffer`) reads them through `&self`
//!   and writes them through `&mut self`, but only while no device access
//!   is in flight ([`BufferMem::in_flight`] is 0; otherwise the handle
//!   copies the bytes into new memory first, see [`BufferMem::detach`]);
//! - a device reads them (a send or one-sided write from the buffer) while
//!   an [`InFlight`] guard exists, which keeps the memory and the
//!   registration alive until the device is done;
//! - a device writes them (a one-sided read into the buffer) only while
//!   the operation owns the handle, which gets the bytes back only after
//!   completion, or a detached copy.
//!
//! A registration is dropped (the device forgets the memory) before the
//! memory is freed: [`InFlight`] holds both, and the slot inside the memory
//! is emptied in `Drop` before the allocation goes. So a registration can
//! never outlive its memory and name an address reused by another
//! allocation (the classic registration-cache bug).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::any::Any;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, OnceLock, Weak};

// The device-access count and the guards' flags decide who may touch the
// bytes: from the shim, so the loom model checks this code.
use super::sync::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::Mutex;

/// Alignment of buffers dxnet allocates: a cache line (registration works
/// on any address; page alignment would waste memory on small buffers).
const ALIGN: usize = 64;

/// A registration of a buffer's memory with one node's device, and who
/// made it.
pub struct Pinned {
    /// Which node's device (see [`BufferMem::registration`]).
    pub owner: u64,
    /// The engine's handle; deregisters when dropped.
    pub handle: Box<dyn Any + Send + Sync>,
    /// Runs once the registration is gone (the cache's accounting).
    pub on_drop: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl std::fmt::Debug for Pinned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pinned")
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

/// Set in [`BufferMem::marks`] once the buffer passed the reuse policy's
/// speculative mark.
pub const PASSED: u32 = 1;
/// Set in [`BufferMem::marks`] once the buffer reached the policy's
/// threshold.
pub const REACHED: u32 = 2;

/// Told when a buffer that passed the speculative mark goes without
/// having reached the threshold (the reuse policy's fallback).
pub trait Unreached: Send + Sync {
    /// The buffer is dropped.
    fn unreached(&self);
}

/// An address-stable allocation of `len` bytes (see the module docs).
pub struct BufferMem {
    ptr: NonNull<u8>,
    /// Bytes allocated (and registered).
    cap: usize,
    /// Bytes in use: what accesses send, write or fill (at most `cap`).
    /// Changed only by the owning handle while no access is in flight
    /// (`Buffer::set_len` moves to a copy first otherwise), so accesses
    /// read a length that stays put while they run.
    len: std::sync::atomic::AtomicUsize,
    /// `Some`: allocated here with this layout; `None`: a `Box<[u8]>`.
    layout: Option<Layout>,
    /// Uses counted by the reuse policy.
    uses: AtomicU32,
    /// Device accesses in flight (their [`InFlight`] guards).
    in_flight: AtomicUsize,
    /// Used since the cache last looked (second-chance eviction).
    referenced: AtomicBool,
    /// The registration; at most one node's.
    reg: Mutex<Option<Arc<Pinned>>>,
    /// Flags of the reuse policy ([`PASSED`], [`REACHED`]), each counted
    /// once per buffer.
    pub marks: AtomicU32,
    /// Told at drop if the buffer passed but did not reach.
    watcher: OnceLock<Weak<dyn Unreached>>,
}

// SAFETY: the allocation is owned by this value; the bytes are reached
// only through the raw pointer under the rules of the module docs (one
// owning handle, device accesses bracketed by `InFlight`), and every other
// field is `Sync`.
unsafe impl Send for BufferMem {}
// SAFETY: as for `Send`.
unsafe impl Sync for BufferMem {}

impl std::fmt::Debug for BufferMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferMem")
            .field("len", &self.len)
            .field("uses", &self.uses.load(Ordering::Relaxed))
            .field("in_flight", &self.in_flight.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl BufferMem {
    /// `len` zeroed bytes. Panics like `Vec` when the memory cannot be had.
    pub fn zeroed(len: usize) -> BufferMem {
        if len == 0 {
            return Self::from_vec(Vec::new());
        }
        let layout = Layout::from_size_align(len, ALIGN).expect("buffer size overflows");
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(p) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self::with(ptr, len, Some(layout))
    }

    /// Takes over `v`'s allocation (no copy).
    pub fn from_vec(v: Vec<u8>) -> BufferMem {
        let b = v.into_boxed_slice();
        let len = b.len();
        let ptr = NonNull::new(Box::into_raw(b) as *mut u8).expect("a box is never null");
        Self::with(ptr, len, None)
    }

    fn with(ptr: NonNull<u8>, len: usize, layout: Option<Layout>) -> BufferMem {
        BufferMem {
            ptr,
            cap: len,
            len: std::sync::atomic::AtomicUsize::new(len),
            layout,
            uses: AtomicU32::new(0),
            in_flight: AtomicUsize::new(0),
            referenced: AtomicBool::new(false),
            reg: Mutex::new(None),
            marks: AtomicU32::new(0),
            watcher: OnceLock::new(),
        }
    }

    /// Bytes in use.
    #[inline]
    pub fn len(&self) -> usize {
        self.len.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes allocated.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the bytes in use to the first `len` (at most the capacity).
    /// For the owning handle while no access is in flight.
    pub fn set_len(&self, len: usize) {
        assert!(
            len <= self.cap,
            "length {len} over the capacity {}",
            self.cap
        );
        self.len.store(len, std::sync::atomic::Ordering::Relaxed);
    }

    /// Address of the first byte (for registration).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The bytes.
    ///
    /// # Safety
    /// No device may write them while the slice lives (the caller owns the
    /// buffer's handle, see the module docs).
    #[inline]
    pub unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `cap >= len` bytes for as long as
        // `self`; the caller rules out concurrent writers.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len()) }
    }

    /// The bytes, writable.
    ///
    /// # Safety
    /// The caller is the only one reaching the bytes while the slice lives:
    /// it owns the handle exclusively and no device access is in flight.
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: as for `bytes`, with exclusivity from the caller.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
    }

    /// Counts a use; returns the count including it (saturating).
    pub fn count_use(&self) -> u32 {
        self.referenced.store(true, Ordering::Relaxed);
        let n = self.uses.load(Ordering::Relaxed).saturating_add(1);
        // A lost update between racing users of one buffer only delays
        // the threshold by a use: counted without a read-modify-write.
        self.uses.store(n, Ordering::Relaxed);
        n
    }

    /// Sets who is told if the buffer goes without reaching the threshold
    /// (once; later calls do nothing).
    pub fn watch(&self, w: Weak<dyn Unreached>) {
        let _ = self.watcher.set(w);
    }

    /// Uses counted so far.
    pub fn uses(&self) -> u32 {
        self.uses.load(Ordering::Relaxed)
    }

    /// Device accesses in flight.
    #[inline]
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// The registration for node `owner`'s device, if the buffer has one.
    pub fn registration(&self, owner: u64) -> Option<Arc<Pinned>> {
        match &*self.reg.lock() {
            Some(p) if p.owner == owner => Some(p.clone()),
            _ => None,
        }
    }

    /// True if some node's device has the buffer registered.
    pub fn is_registered(&self) -> bool {
        self.reg.lock().is_some()
    }

    /// Installs `p` unless the buffer has a registration already (another
    /// node's device's, or a racing caller's): then `p` comes back as
    /// `Err` (dropping it deregisters).
    pub fn install(&self, p: Arc<Pinned>) -> std::result::Result<(), Arc<Pinned>> {
        let mut g = self.reg.lock();
        if g.is_some() {
            return Err(p);
        }
        *g = Some(p);
        Ok(())
    }

    /// Takes the registration away unless it was used since the last call
    /// (second chance). Accesses in flight keep their own handle on it, so
    /// the device keeps it until they are done. Returns it if it went.
    pub fn evict(&self, second_chance: bool) -> Option<Arc<Pinned>> {
        if second_chance && self.referenced.swap(false, Ordering::Relaxed) {
            return None;
        }
        self.reg.lock().take()
    }

    /// Copies the bytes into new memory (no registration, no uses) for an
    /// owner that must not share them with a device access in flight.
    pub fn detach(&self) -> BufferMem {
        let fresh = BufferMem::zeroed(self.cap);
        // SAFETY: both are valid for `cap` bytes and do not overlap; a
        // device may still write the source (an access that failed while
        // in flight): a raw copy of plain bytes tolerates that, the copy
        // gets some mix of old and new bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), fresh.as_ptr(), self.cap) };
        fresh.set_len(self.len());
        fresh
    }
}

impl Drop for BufferMem {
    fn drop(&mut self) {
        if *self.marks.get_mut() & REACHED == 0 {
            if let Some(w) = self.watcher.get().and_then(Weak::upgrade) {
                w.unreached();
            }
        }
        // The registration first (see the module docs).
        drop(self.reg.get_mut().take());
        match self.layout {
            // SAFETY: allocated in `zeroed` with this layout.
            Some(layout) => unsafe { dealloc(self.ptr.as_ptr(), layout) },
            None => {
                let raw = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.cap);
                // SAFETY: came from `Box::into_raw` of a `Box<[u8]>` of
                // `len` bytes in `from_vec`.
                drop(unsafe { Box::from_raw(raw) });
            }
        }
    }
}

/// A device access to a buffer in flight: keeps its memory and the
/// registration the access names alive until dropped (when the device is
/// done with it), and tells the buffer's owner not to write meanwhile.
pub struct InFlight {
    mem: Arc<BufferMem>,
    /// The registration the access's work requests name (`None`: an
    /// engine reads the bytes with the CPU, see [`InFlight::reading`]).
    pub pinned: Option<Arc<Pinned>>,
    /// [`InFlight::device_done`] ran.
    done: AtomicBool,
}

impl InFlight {
    /// Starts an access to `mem` through `pinned`.
    pub fn new(mem: Arc<BufferMem>, pinned: Arc<Pinned>) -> InFlight {
        Self::start(mem, Some(pinned))
    }

    /// Starts an engine's read of `mem` without a registration (TCP
    /// writes the bytes to its socket from the buffer).
    pub fn reading(mem: Arc<BufferMem>) -> InFlight {
        Self::start(mem, None)
    }

    fn start(mem: Arc<BufferMem>, pinned: Option<Arc<Pinned>>) -> InFlight {
        mem.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight {
            mem,
            pinned,
            done: AtomicBool::new(false),
        }
    }

    /// Another access (a further part) to the same buffer through the same
    /// registration.
    pub fn another(&self) -> InFlight {
        Self::start(self.mem.clone(), self.pinned.clone())
    }

    /// The registration the access names; panics for [`InFlight::reading`]
    /// guards, which name none.
    pub fn registration(&self) -> &Pinned {
        self.pinned
            .as_deref()
            .expect("an access through the device names a registration")
    }

    /// The buffer's length.
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// The buffer's bytes.
    ///
    /// # Safety
    /// Until [`InFlight::device_done`], the owner does not write them (the
    /// access counts as in flight); after it, the caller must not read
    /// them any more.
    pub unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: the caller's promise; the memory lives as long as `self`.
        unsafe { self.mem.bytes() }
    }

    /// The device is done with the memory (the guard may live on, holding
    /// it): the owner may write it again.
    pub fn device_done(&self) {
        if !self.done.swap(true, Ordering::AcqRel) {
            // Release: the device's accesses (seen by the engine before
            // this) happen before an owner's write after it saw 0.
            self.mem.in_flight.fetch_sub(1, Ordering::Release);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.device_done();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn pinned(owner: u64, drops: &Arc<AtomicUsize>) -> Arc<Pinned> {
        let d = drops.clone();
        Arc::new(Pinned {
            owner,
            handle: Box::new(()),
            on_drop: Some(Box::new(move || {
                d.fetch_add(1, Ordering::SeqCst);
            })),
        })
    }

    #[test]
    fn registration_goes_before_memory_and_in_flight_keeps_it() {
        let drops = Arc::new(AtomicUsize::new(0));
        let mem = Arc::new(BufferMem::from_vec(vec![7u8; 100]));
        assert!(mem.install(pinned(1, &drops)).is_ok());
        assert!(mem.install(pinned(2, &drops)).is_err());
        assert_eq!(drops.load(Ordering::SeqCst), 1, "the refused one is gone");
        assert!(mem.registration(2).is_none());
        let f = InFlight::new(mem.clone(), mem.registration(1).unwrap());
        assert_eq!(mem.in_flight(), 1);
        // Evicted while in flight: the access still holds it.
        let p = mem.evict(false).unwrap();
        drop(p);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        drop(mem);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        drop(f);
        assert_eq!(drops.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn second_chance_and_detach() {
        let drops = Arc::new(AtomicUsize::new(0));
        let mem = BufferMem::zeroed(4096);
        // SAFETY: no device, sole owner.
        unsafe { mem.bytes_mut() }.fill(3);
        mem.install(pinned(1, &drops)).unwrap();
        mem.count_use();
        assert!(mem.evict(true).is_none(), "used since the last look");
        assert!(mem.evict(true).is_some());
        let copy = mem.detach();
        // SAFETY: no device, sole owner.
        assert!(unsafe { copy.bytes() }.iter().all(|&b| b == 3));
        assert!(!copy.is_registered());
        assert_eq!(copy.uses(), 0);
        assert_eq!(BufferMem::zeroed(0).len(), 0);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::cell::UnsafeCell;

    /// Two parts of an access read the bytes (a cell stands for the
    /// device's DMA) and complete on another thread, one through
    /// `device_done`, one by dropping its guard; the owner writes the
    /// bytes only after it saw no access in flight, as `Buffer`'s
    /// `make_unique` does (otherwise it would move to a copy). Loom
    /// reports a race if the count let the owner in early.
    #[test]
    fn loom_owner_writes_only_after_the_device_is_done() {
        loom::model(|| {
            let mem = Arc::new(BufferMem::from_vec(vec![0u8; 8]));
            let bytes = std::sync::Arc::new(UnsafeCell::new(0u8));
            let pinned = Arc::new(Pinned {
                owner: 1,
                handle: Box::new(()),
                on_drop: None,
            });
            let first = InFlight::new(mem.clone(), pinned);
            let second = first.another();
            let device = {
                let bytes = bytes.clone();
                loom::thread::spawn(move || {
                    // SAFETY: a read; the owner writes only after the
                    // guards said the device is done (what loom checks).
                    bytes.with(|p| unsafe { std::ptr::read(p) });
                    first.device_done();
                    bytes.with(|p| unsafe { std::ptr::read(p) });
                    drop(second);
                    drop(first);
                })
            };
            if mem.in_flight() == 0 {
                // SAFETY: no access in flight: the owner's alone.
                bytes.with_mut(|p| unsafe { *p = 1 });
            }
            device.join().unwrap();
            assert_eq!(mem.in_flight(), 0);
        });
    }
}
