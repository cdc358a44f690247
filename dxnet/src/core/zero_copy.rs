//! Zero-copy from reused buffers: which uses of a [`crate::Buffer`] name
//! its memory in place, and the cache of its registrations.
//!
//! The frequent-buffer design for MPI over RDMA (register an application
//! buffer that is reused often instead of copying it into registered
//! memory each time) in Rust terms:
//! - **Reuse detection.** The paper keys a hash table by buffer address
//!   because MPI sees only pointers. A `Buffer` is an owned type dxnet
//!   sees, so its usage record lives in it: counting a use is one load and
//!   one store on the buffer's own cache line (V below, measured), no
//!   lookup that can collide or degrade, and nothing to clean up when the
//!   memory goes (its record and registration go with it, see
//!   `primitives::buffer_mem`).
//! - **Cost model.** A buffer of `len` bytes pays for its registration
//!   after `n = ceil(R(len) / (C(len) - V))` uses; below `min_bytes`, or
//!   where C ≤ V, never. R and C are measured on the device at the first
//!   use (registration of 1 and 64 pages, copies of 4 and 64 KiB: linear
//!   fits), unless `reuse_threshold` fixes `n`.
//! - **Speculation.** A buffer is registered at `speculative_fraction` of
//!   `n` (25 %): reused buffers get zero-copy sooner.
//! - **Fallback.** Speculation registers some buffers for nothing. Each
//!   buffer that passes the speculative mark has an outcome: it reaches
//!   `n` (speculation paid), or it is dropped before (wasted). Every 32
//!   outcomes, under `min_frequent_fraction` paid stops speculation (a
//!   buffer is registered only at `n`, which always pays); at or above
//!   it, speculation is on (again). Buffers are followed the same way
//!   while it is off, so it resumes when reuse comes back. This is the
//!   paper's "stop growing when under 20 % are frequent"; its second
//!   condition (chaining buckets) has no analogue without a table.
//! - **Cache.** Registrations count against `max_pinned_bytes`. A new one
//!   that does not fit evicts registrations in order of registration,
//!   skipping those used since the last look (second chance) and holding
//!   none that accesses in flight still use (they keep their own handle).
//!   A buffer that still does not fit is copied.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::config::ZeroCopyConfig;
use crate::primitives::buffer_mem::{BufferMem, InFlight, Pinned, Unreached, PASSED, REACHED};
use crate::transport::RemoteMemory;

/// What the policy needs of a device: registration for local access.
pub trait Registrar {
    /// Registers `len` bytes at `addr`; the handle deregisters when
    /// dropped.
    ///
    /// # Safety
    /// The memory must stay allocated until the handle is dropped.
    unsafe fn register_local(
        &self,
        addr: *mut u8,
        len: usize,
    ) -> crate::Result<Box<dyn std::any::Any + Send + Sync>>;
}

impl Registrar for dyn RemoteMemory + '_ {
    unsafe fn register_local(
        &self,
        addr: *mut u8,
        len: usize,
    ) -> crate::Result<Box<dyn std::any::Any + Send + Sync>> {
        // SAFETY: the caller's promise is `register`'s.
        unsafe { self.register(addr, len, false, false) }.map(|(_, h)| h)
    }
}

/// Costs measured on a node's device, in nanoseconds (see
/// `Node::zero_copy_costs`).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct ZeroCopyCosts {
    /// Registering and deregistering one page.
    pub register_ns: f64,
    /// Each further 4 KiB page of a registration.
    pub register_page_ns: f64,
    /// Copying 1 KiB.
    pub copy_kib_ns: f64,
    /// Counting a use of a buffer (V).
    pub count_ns: f64,
}

impl ZeroCopyCosts {
    /// Uses after which registering a buffer of `len` bytes pays; `None`
    /// if it never does.
    pub fn threshold(&self, len: usize) -> Option<u32> {
        let pages = len.div_ceil(4096).max(1) as f64;
        let r = self.register_ns + self.register_page_ns * (pages - 1.0);
        let c = self.copy_kib_ns * len as f64 / 1024.0;
        let gain = c - self.count_ns;
        if gain <= 0.0 {
            return None;
        }
        Some((r / gain).ceil().clamp(1.0, u32::MAX as f64) as u32)
    }
}

/// Outcomes of buffers past the speculative mark looked at together.
const WINDOW: u64 = 32;

/// Counters of the node's zero-copy path (in `NodeStats`).
#[derive(Debug, Default)]
pub struct ZeroCopyStats {
    pub in_place: AtomicU64,
    pub copied: AtomicU64,
    pub registrations: AtomicU64,
    pub registration_failures: AtomicU64,
    pub evictions: AtomicU64,
    pub pinned_bytes: AtomicU64,
    pub speculation_stops: AtomicU64,
    /// Buffer sends whose payload an engine wrote in place without a
    /// registration (`Transport::lend`).
    pub lent: AtomicU64,
}

/// A node's zero-copy policy and registration cache.
pub struct ZeroCopy {
    cfg: ZeroCopyConfig,
    /// Tells this node's registrations from other nodes' in one process.
    owner: u64,
    costs: OnceLock<ZeroCopyCosts>,
    /// Registered buffers, oldest first.
    cache: Mutex<VecDeque<Weak<BufferMem>>>,
    pub stats: Arc<ZeroCopyStats>,
    fallback: Arc<Fallback>,
}

/// Whether to register speculatively, from the outcomes of the buffers
/// that passed the mark (see the module docs).
struct Fallback {
    speculating: AtomicBool,
    /// The current window's outcomes: paid, wasted.
    window: Mutex<(u64, u64)>,
    min_frequent: f64,
    stats: Arc<ZeroCopyStats>,
}

impl Fallback {
    fn outcome(&self, paid: bool) {
        let mut w = self.window.lock();
        if paid {
            w.0 += 1;
        } else {
            w.1 += 1;
        }
        if w.0 + w.1 < WINDOW {
            return;
        }
        let frequent = w.0 as f64 / (w.0 + w.1) as f64;
        *w = (0, 0);
        let on = frequent >= self.min_frequent;
        if self.speculating.swap(on, Ordering::Relaxed) && !on {
            self.stats.speculation_stops.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                "zero-copy: {:.0} % of the buffers reused a little went on to be reused often; speculation stops",
                frequent * 100.0
            );
        }
    }
}

impl Unreached for Fallback {
    fn unreached(&self) {
        self.outcome(false);
    }
}

impl std::fmt::Debug for ZeroCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroCopy")
            .field("cfg", &self.cfg)
            .field("costs", &self.costs.get())
            .finish_non_exhaustive()
    }
}

/// Why a buffer could not be registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterError {
    /// It does not fit under `max_pinned_bytes`, even after evicting.
    OverLimit,
    /// Another node's device has it registered.
    OtherNode,
    /// The device refused (e.g. the locked-memory limit).
    Device(String),
}

impl ZeroCopy {
    pub fn new(cfg: ZeroCopyConfig) -> ZeroCopy {
        static OWNERS: AtomicU64 = AtomicU64::new(1);
        let stats = Arc::new(ZeroCopyStats::default());
        let fallback = Arc::new(Fallback {
            speculating: AtomicBool::new(true),
            window: Mutex::new((0, 0)),
            min_frequent: cfg.min_frequent_fraction,
            stats: stats.clone(),
        });
        ZeroCopy {
            cfg,
            owner: OWNERS.fetch_add(1, Ordering::Relaxed),
            costs: OnceLock::new(),
            cache: Mutex::new(VecDeque::new()),
            stats,
            fallback,
        }
    }

    /// The measured costs, once measured.
    pub fn costs(&self) -> Option<ZeroCopyCosts> {
        self.costs.get().copied()
    }

    /// Speculation on.
    pub fn speculating(&self) -> bool {
        self.fallback.speculating.load(Ordering::Relaxed)
    }

    /// A use of `mem` by an access of this node: the guard of an in-place
    /// access if the buffer is (or now gets) registered with the device
    /// of `rm` (`None`: the access cannot go through the device); `None`
    /// to copy.
    pub fn use_buffer<R: Registrar + ?Sized>(
        &self,
        rm: Option<&R>,
        mem: &Arc<BufferMem>,
    ) -> Option<InFlight> {
        if mem.len() < self.cfg.min_bytes.max(1) {
            return None;
        }
        let uses = mem.count_use();
        let guard = match rm.filter(|_| self.cfg.enabled) {
            None => None,
            Some(rm) => match mem.registration(self.owner) {
                Some(p) => {
                    self.follow(rm, mem, uses);
                    Some(InFlight::new(mem.clone(), p))
                }
                None => self.decide(rm, mem, uses),
            },
        };
        let counter = if guard.is_some() {
            &self.stats.in_place
        } else {
            &self.stats.copied
        };
        counter.fetch_add(1, Ordering::Relaxed);
        guard
    }

    /// Registers `mem` now (`Node::register_buffer`), whatever its uses.
    pub fn register_now<R: Registrar + ?Sized>(
        &self,
        rm: &R,
        mem: &Arc<BufferMem>,
    ) -> std::result::Result<(), RegisterError> {
        if mem.registration(self.owner).is_some() {
            return Ok(());
        }
        self.register(rm, mem).map(drop)
    }

    /// Not registered with this node's device: registers if `uses` says
    /// so.
    fn decide<R: Registrar + ?Sized>(
        &self,
        rm: &R,
        mem: &Arc<BufferMem>,
        uses: u32,
    ) -> Option<InFlight> {
        let (spec_at, n) = self.follow(rm, mem, uses)?;
        let due = uses >= n || (uses >= spec_at && self.speculating());
        if !due || mem.is_registered() {
            return None; // not yet, or another node's device has it
        }
        let p = self.register(rm, mem).ok()?;
        Some(InFlight::new(mem.clone(), p))
    }

    /// Notes where `mem` stands against its marks (each once per buffer,
    /// for the fallback); returns them: (speculative, threshold).
    fn follow<R: Registrar + ?Sized>(
        &self,
        rm: &R,
        mem: &BufferMem,
        uses: u32,
    ) -> Option<(u32, u32)> {
        let n = self.threshold(rm, mem.len())?;
        let spec_at = ((n as f64 * self.cfg.speculative_fraction).ceil() as u32).clamp(1, n);
        let marks = mem.marks.load(Ordering::Relaxed);
        if uses >= spec_at && marks & PASSED == 0 {
            // Followed from here: its drop before `n` counts as wasted.
            let w: Arc<dyn Unreached> = self.fallback.clone();
            mem.watch(Arc::downgrade(&w));
            mem.marks.fetch_or(PASSED, Ordering::Relaxed);
        }
        if uses >= n && marks & REACHED == 0 {
            let before = mem.marks.fetch_or(REACHED, Ordering::Relaxed);
            if before & REACHED == 0 {
                self.fallback.outcome(true);
            }
        }
        Some((spec_at, n))
    }

    /// Uses after which a buffer of `len` bytes is registered.
    fn threshold<R: Registrar + ?Sized>(&self, rm: &R, len: usize) -> Option<u32> {
        if let Some(n) = self.cfg.reuse_threshold {
            return Some(n);
        }
        self.costs.get_or_init(|| measure(rm)).threshold(len)
    }

    /// Registers `mem` with the device, making room under the limit.
    fn register<R: Registrar + ?Sized>(
        &self,
        rm: &R,
        mem: &Arc<BufferMem>,
    ) -> std::result::Result<Arc<Pinned>, RegisterError> {
        let fail = |e: RegisterError| {
            self.stats
                .registration_failures
                .fetch_add(1, Ordering::Relaxed);
            Err(e)
        };
        let len = mem.capacity() as u64;
        if len > self.cfg.max_pinned_bytes {
            return fail(RegisterError::OverLimit);
        }
        if !self.reserve(len) {
            return fail(RegisterError::OverLimit);
        }
        // SAFETY: the registration is dropped before the memory: the
        // buffer empties its slot first when it goes, and every access
        // that names it holds the memory too (`InFlight`).
        let handle = match unsafe { rm.register_local(mem.as_ptr(), mem.capacity()) } {
            Ok(h) => h,
            Err(e) => {
                self.stats.pinned_bytes.fetch_sub(len, Ordering::Relaxed);
                tracing::debug!("zero-copy: registering {len} bytes failed: {e}");
                return fail(RegisterError::Device(e.to_string()));
            }
        };
        let stats = self.stats.clone();
        let p = Arc::new(Pinned {
            owner: self.owner,
            handle,
            on_drop: Some(Box::new(move || {
                stats.pinned_bytes.fetch_sub(len, Ordering::Relaxed);
            })),
        });
        if let Err(p) = mem.install(p.clone()) {
            drop(p);
            // A racing caller registered it: use that one if it is ours.
            return match mem.registration(self.owner) {
                Some(p) => Ok(p),
                None => fail(RegisterError::OtherNode),
            };
        }
        self.stats.registrations.fetch_add(1, Ordering::Relaxed);
        self.cache.lock().push_back(Arc::downgrade(mem));
        Ok(p)
    }

    /// Counts `len` more pinned bytes, evicting until they fit; false if
    /// they do not.
    fn reserve(&self, len: u64) -> bool {
        let limit = self.cfg.max_pinned_bytes;
        let fits = |s: &ZeroCopyStats| {
            s.pinned_bytes
                .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |p| {
                    (p + len <= limit).then_some(p + len)
                })
                .is_ok()
        };
        if fits(&self.stats) {
            return true;
        }
        let mut cache = self.cache.lock();
        // Two passes: the first gives each a second chance.
        let mut looks = cache.len() * 2;
        while looks > 0 {
            looks -= 1;
            let Some(w) = cache.pop_front() else { break };
            let Some(mem) = w.upgrade() else {
                continue; // gone with its registration
            };
            match mem.evict(true) {
                Some(p) => {
                    self.stats.evictions.fetch_add(1, Ordering::Relaxed);
                    // In-flight accesses keep theirs; the pinned bytes
                    // count down when the last one is done.
                    drop(p);
                    drop(mem);
                    if fits(&self.stats) {
                        return true;
                    }
                }
                None => cache.push_back(w),
            }
        }
        fits(&self.stats)
    }

    /// Drops every cached registration (the node stops).
    pub fn clear(&self) {
        for w in self.cache.lock().drain(..) {
            if let Some(mem) = w.upgrade() {
                drop(mem.evict(false));
            }
        }
    }
}

/// Measures the costs of the model on `rm`'s device.
fn measure<R: Registrar + ?Sized>(rm: &R) -> ZeroCopyCosts {
    fn best(rounds: usize, mut f: impl FnMut()) -> f64 {
        (0..rounds)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed()
            })
            .min()
            .unwrap_or(Duration::ZERO)
            .as_nanos() as f64
    }
    let small = BufferMem::zeroed(4096);
    let large = BufferMem::zeroed(64 * 4096);
    let reg = |m: &BufferMem| {
        // SAFETY: the handle is dropped at once, before the memory.
        drop(unsafe { rm.register_local(m.as_ptr(), m.capacity()) });
    };
    let r1 = best(5, || reg(&small));
    let r64 = best(5, || reg(&large));
    let src = vec![1u8; 64 << 10];
    let mut dst = vec![0u8; 64 << 10];
    let c64 = best(9, || {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
    });
    let probe = BufferMem::zeroed(64);
    const COUNTS: u32 = 10_000;
    let v = best(3, || {
        for _ in 0..COUNTS {
            std::hint::black_box(probe.count_use());
        }
    }) / COUNTS as f64;
    let costs = ZeroCopyCosts {
        register_ns: r1.max(1.0),
        register_page_ns: ((r64 - r1) / 63.0).max(0.0),
        copy_kib_ns: (c64 / 64.0).max(0.01),
        count_ns: v,
    };
    tracing::debug!("zero-copy costs measured: {costs:?}");
    costs
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A device that counts its live registrations, and refuses them
    /// while `refuse` is set.
    #[derive(Default)]
    struct Device {
        live: Arc<AtomicUsize>,
        made: AtomicUsize,
        refuse: AtomicBool,
    }

    struct Handle(Arc<AtomicUsize>);
    impl Drop for Handle {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl Registrar for Device {
        unsafe fn register_local(
            &self,
            _addr: *mut u8,
            _len: usize,
        ) -> crate::Result<Box<dyn std::any::Any + Send + Sync>> {
            if self.refuse.load(Ordering::SeqCst) {
                return Err(crate::Error::Transport("memlock limit".into()));
            }
            self.made.fetch_add(1, Ordering::SeqCst);
            self.live.fetch_add(1, Ordering::SeqCst);
            Ok(Box::new(Handle(self.live.clone())))
        }
    }

    fn policy(threshold: u32, max_pinned: u64) -> ZeroCopy {
        ZeroCopy::new(ZeroCopyConfig {
            reuse_threshold: Some(threshold),
            max_pinned_bytes: max_pinned,
            ..ZeroCopyConfig::default()
        })
    }

    fn buffer(len: usize) -> Arc<BufferMem> {
        Arc::new(BufferMem::zeroed(len))
    }

    #[test]
    fn registers_at_a_quarter_of_the_threshold_and_stays() {
        let dev = Device::default();
        let zc = policy(8, 1 << 20);
        let b = buffer(4096);
        // 25 % of 8: the second use goes in place.
        assert!(zc.use_buffer(Some(&dev), &b).is_none());
        let g = zc.use_buffer(Some(&dev), &b).expect("registered at 2 uses");
        assert_eq!(dev.made.load(Ordering::SeqCst), 1);
        for _ in 0..20 {
            assert!(zc.use_buffer(Some(&dev), &b).is_some());
        }
        assert_eq!(dev.made.load(Ordering::SeqCst), 1, "registered once");
        assert_eq!(zc.stats.pinned_bytes.load(Ordering::SeqCst), 4096);
        assert_eq!(zc.stats.copied.load(Ordering::SeqCst), 1);
        assert_eq!(zc.stats.in_place.load(Ordering::SeqCst), 21);
        drop(b);
        assert_eq!(
            dev.live.load(Ordering::SeqCst),
            1,
            "the access in flight keeps it"
        );
        drop(g);
        assert_eq!(dev.live.load(Ordering::SeqCst), 0);
        assert_eq!(zc.stats.pinned_bytes.load(Ordering::SeqCst), 0);
        // Short buffers and no device: copied, never registered.
        let small = buffer(64);
        for _ in 0..20 {
            assert!(zc.use_buffer(Some(&dev), &small).is_none());
        }
        let b = buffer(4096);
        for _ in 0..20 {
            assert!(zc.use_buffer(None::<&Device>, &b).is_none());
        }
        assert_eq!(dev.made.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn evicts_under_a_tiny_limit_and_copies_what_does_not_fit() {
        let dev = Device::default();
        let zc = policy(1, 3 * 4096);
        let bufs: Vec<_> = (0..8).map(|_| buffer(4096)).collect();
        for round in 0..4 {
            for b in &bufs {
                let g = zc.use_buffer(Some(&dev), b);
                assert!(
                    g.is_some(),
                    "round {round}: an idle registration makes room"
                );
            }
            assert!(dev.live.load(Ordering::SeqCst) <= 3);
            assert!(zc.stats.pinned_bytes.load(Ordering::SeqCst) <= 3 * 4096);
        }
        assert!(zc.stats.evictions.load(Ordering::SeqCst) >= 20);
        // Held in flight, nothing can be evicted: the fourth is copied.
        let held: Vec<_> = bufs[..3]
            .iter()
            .map(|b| zc.use_buffer(Some(&dev), b).unwrap())
            .collect();
        let before = zc.stats.registration_failures.load(Ordering::SeqCst);
        let copied = bufs[3..]
            .iter()
            .filter(|b| zc.use_buffer(Some(&dev), b).is_none())
            .count();
        assert!(copied > 0);
        assert!(zc.stats.registration_failures.load(Ordering::SeqCst) > before);
        // Larger than the limit: refused with a typed error.
        assert_eq!(
            zc.register_now(&dev, &buffer(4 * 4096)),
            Err(RegisterError::OverLimit)
        );
        drop(held);
        drop(bufs);
        assert_eq!(dev.live.load(Ordering::SeqCst), 0);
        assert_eq!(zc.stats.pinned_bytes.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_refusing_device_means_copies_and_counted_failures() {
        let dev = Device::default();
        dev.refuse.store(true, Ordering::SeqCst);
        let zc = policy(1, 1 << 20);
        let b = buffer(4096);
        for _ in 0..5 {
            assert!(zc.use_buffer(Some(&dev), &b).is_none());
        }
        assert_eq!(zc.stats.registration_failures.load(Ordering::SeqCst), 5);
        assert_eq!(zc.stats.pinned_bytes.load(Ordering::SeqCst), 0);
        assert!(matches!(
            zc.register_now(&dev, &b),
            Err(RegisterError::Device(_))
        ));
        dev.refuse.store(false, Ordering::SeqCst);
        assert!(zc.use_buffer(Some(&dev), &b).is_some());
    }

    #[test]
    fn speculation_stops_without_reuse_and_resumes_with_it() {
        let dev = Device::default();
        let zc = policy(8, 1 << 30);
        // Buffers used twice (the speculative mark) and dropped: each
        // registration is wasted.
        for _ in 0..WINDOW {
            let b = buffer(4096);
            zc.use_buffer(Some(&dev), &b);
            assert!(zc.use_buffer(Some(&dev), &b).is_some() || !zc.speculating());
        }
        assert!(!zc.speculating(), "no buffer went on to 8 uses");
        assert_eq!(zc.stats.speculation_stops.load(Ordering::SeqCst), 1);
        let made = dev.made.load(Ordering::SeqCst);
        // Off: the mark passes without a registration; the threshold still
        // registers (that always pays).
        let b = buffer(4096);
        for _ in 0..7 {
            assert!(zc.use_buffer(Some(&dev), &b).is_none());
        }
        assert!(zc.use_buffer(Some(&dev), &b).is_some());
        assert_eq!(dev.made.load(Ordering::SeqCst), made + 1);
        // Reuse comes back: buffers reach their threshold; the next window
        // turns speculation on again.
        for _ in 0..WINDOW {
            let b = buffer(4096);
            for _ in 0..8 {
                zc.use_buffer(Some(&dev), &b);
            }
        }
        assert!(zc.speculating());
        let b = buffer(4096);
        zc.use_buffer(Some(&dev), &b);
        assert!(zc.use_buffer(Some(&dev), &b).is_some(), "speculative again");
    }

    #[test]
    fn threshold_follows_the_model() {
        let c = ZeroCopyCosts {
            register_ns: 10_000.0,
            register_page_ns: 100.0,
            copy_kib_ns: 50.0,
            count_ns: 2.0,
        };
        // 8 KiB: R = 10.1 µs, C = 400 ns: 26 uses.
        assert_eq!(c.threshold(8192), Some((10_100.0f64 / 398.0).ceil() as u32));
        // Copying 40 bytes costs less than counting: never.
        assert_eq!(c.threshold(40), None);
        assert!(c.threshold(1 << 20).unwrap() < c.threshold(4096).unwrap());
    }
}
