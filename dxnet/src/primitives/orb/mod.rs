//! The outgoing ring buffer (ORB): one per connection.
//!
//! Many sender threads serialize messages straight into the ring (no
//! per-message allocation, messages aggregate implicitly); one consumer, the
//! transport's send thread, takes contiguous committed bytes out of it.
//!
//! Four monotonically increasing `u64` byte positions describe the ring
//! (a position's offset in the buffer is `pos & (capacity - 1)`):
//!
//! ```text
//! front <= front_posted <= committed <= reserved <= front + capacity
//! ```
//!
//! - `front`: bytes the transport has finished with; the space before it is
//!   free for producers.
//! - `front_posted`: bytes handed to the transport, maybe not yet completed
//!   (RDMA posts work requests long before their completions arrive).
//! - `committed` (the "back"): bytes fully written by producers, as far as
//!   the consumer has collected them (contiguously, see below).
//! - `reserved` (the "back reserved"): bytes claimed by producers. Its top bit
//!   is the *exclusive* flag of a producer writing a message in chunks.
//!
//! Producers claim a span with a CAS on `reserved`, fill it without any lock
//! and publish it with one Release store of its length into the *commit
//! slot* of the span's first byte (one slot per [`GRANULE`] bytes of ring).
//! No producer ever waits for another: with more runnable threads than
//! cores, the producer of an earlier span may be preempted for a whole time
//! slice, and everybody else goes on filling the ring behind it.
//!
//! Producers' space check reads a copy of `front` kept in `reserved`'s cache
//! line (refreshed only when the copy says the ring is full), not `front`
//! itself, which the consumer writes after every transfer.
//!
//! The consumer moves `committed` forward by walking the slots from
//! `committed` on (Acquire loads; each slot it passes is cleared for the
//! ring's next lap) and stops at the first span not yet published, so it
//! only ever hands out whole, fully written spans, in position order. A
//! paused producer holds back the bytes behind its span (the stream's order
//! requires that), not the other producers.
//!
//! Why a slot per granule is unambiguous: every span is at least
//! [`MIN_MESSAGE_LEN`] = `GRANULE` bytes (chunked writers never leave a
//! shorter tail), so no two spans of one lap start in the same granule, and
//! a slot is only written again in the next lap, after the consumer cleared
//! it and freed the space.
//!
//! Loom models (below, and in `write_interest.rs`) check this very code
//! through the `sync` shim:
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test -p dxnet --release --lib loom_tests`

use super::deadline::Deadline;
use std::cell::UnsafeCell;
use std::fmt;
use std::io;
use std::ptr;

use crossbeam::utils::CachePadded;

use super::sync::{self, AtomicBool, AtomicU32, AtomicU64, ByteTracker, Ordering};
use super::wait_queue::{WaitError, WaitQueue};

/// Smallest ring; [`Orb::new`] rounds smaller capacities up to it. (Tiny
/// under loom to keep the models small.)
#[cfg(not(loom))]
pub const MIN_CAPACITY: usize = 4096;
/// Smallest ring; [`Orb::new`] rounds smaller capacities up to it. (Tiny
/// under loom to keep the models small.)
#[cfg(loom)]
pub const MIN_CAPACITY: usize = 16;

/// Bytes of ring per commit slot. (One byte under loom, so the models can
/// use tiny messages.)
#[cfg(not(loom))]
pub const GRANULE: usize = 8;
/// Bytes of ring per commit slot. (One byte under loom, so the models can
/// use tiny messages.)
#[cfg(loom)]
pub const GRANULE: usize = 1;

/// Shortest message [`Orb::write_message`] accepts (a span shorter than a
/// granule could share its commit slot with the next one).
pub const MIN_MESSAGE_LEN: usize = GRANULE;

/// Flag bit in `reserved`: a chunked writer owns the ring, nobody else may
/// reserve until it clears the bit.
const EXCLUSIVE: u64 = 1 << 63;

/// Busy-wait rounds (CPU spin hint) before yielding, and total rounds
/// (spins + yields) before blocking on the condvar. (Loom explores every
/// yield, so under loom waits yield at once and block without spinning.)
#[cfg(not(loom))]
const SPIN_ROUNDS: u32 = 64;
#[cfg(not(loom))]
const BACKOFF_ROUNDS: u32 = 80;

#[cfg(not(loom))]
thread_local! {
    /// Fills of reserved spans running on this thread (see [`filling`]).
    static FILLING: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Whether the calling thread is filling a span it reserved in a ring: its
/// reservation holds back every later one in that ring until the fill
/// ends, so the fill must not queue behind anything that may wait for one
/// of them (see `region_mem::MemBlock::with_bytes`). Always false under
/// loom, whose models never ask.
pub fn filling() -> bool {
    #[cfg(not(loom))]
    {
        FILLING.try_with(|f| f.get() > 0).unwrap_or(false)
    }
    #[cfg(loom)]
    {
        false
    }
}

/// Marks the calling thread as filling a reserved span while it lives.
struct Filling;

impl Filling {
    fn enter() -> Filling {
        #[cfg(not(loom))]
        let _ = FILLING.try_with(|f| f.set(f.get() + 1));
        Filling
    }
}

impl Drop for Filling {
    fn drop(&mut self) {
        #[cfg(not(loom))]
        let _ = FILLING.try_with(|f| f.set(f.get() - 1));
    }
}

/// Why a message could not be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OrbError {
    /// The deadline passed before space could be reserved. Nothing of the
    /// message was written; the ring is intact.
    #[error("timed out waiting for space in the outgoing ring buffer")]
    Timeout,
    /// The ring was closed (connection closing).
    #[error("outgoing ring buffer closed")]
    Closed,
    /// Bytes were committed that do not form the announced message: `fill`
    /// wrote fewer or more than `len` bytes, returned an error, or a chunked
    /// message timed out half way. The message stream is broken, so the ring
    /// has been closed and the caller must close the connection.
    #[error("outgoing message stream corrupted (partial or malformed message committed)")]
    Corrupted,
}

/// A snapshot of the ring's positions (see the module docs).
///
/// Loaded in the order front, front_posted, committed, reserved, so the
/// snapshot satisfies `front <= front_posted <= committed <= reserved`
/// (`reserved <= front + capacity` may not hold in a snapshot, as `front`
/// is loaded first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OrbPositions {
    /// Bytes completed by the transport.
    pub front: u64,
    /// Bytes handed to the transport.
    pub front_posted: u64,
    /// Bytes fully written by producers, as far as the consumer has
    /// collected them (published spans behind an unpublished one count
    /// once the consumer passes them).
    pub committed: u64,
    /// Bytes claimed by producers (without the exclusive flag).
    pub reserved: u64,
}

/// The outgoing ring buffer of one connection.
///
/// Producer side ([`Orb::write_message`]): any number of threads.
/// Consumer side ([`Orb::unposted`], [`Orb::unposted_len`],
/// [`Orb::mark_posted`], [`Orb::mark_completed`]): whoever holds the ring's
/// one [`Consumer`] (handed out once by [`Orb::consumer`]; `Send`, not
/// `Sync`, so one thread at a time: engines keep it in the connection's
/// send state, under its lock). The slices of `unposted` borrow the
/// consumer, so they cannot outlive the `mark_completed` that frees their
/// bytes. The consumer methods also check their arguments against the
/// positions (panicking on misuse) and update them atomically.
///
/// Never call `write_message` on a ring from its own consumer thread (or
/// from inside a `fill` closure): if the ring is full it would wait for
/// itself until the deadline.
pub struct Orb {
    /// The bytes. One allocation that never moves (an RDMA transport
    /// registers it once via [`Orb::base_ptr`]).
    buf: Box<[UnsafeCell<u8>]>,
    mask: u64,
    front: CachePadded<AtomicU64>,
    front_posted: CachePadded<AtomicU64>,
    /// Written by the consumer only (see [`Orb::collect_commits`]).
    committed: CachePadded<AtomicU64>,
    /// The reservation position and the producers' copy of `front`.
    reserved: CachePadded<Reservation>,
    /// `commits[i]`: length of the published span starting in granule `i`
    /// of the current lap, 0 while unpublished or already collected.
    commits: Box<[AtomicU32]>,
    closed: AtomicBool,
    /// End position of the last message written in chunks (see
    /// [`Orb::ends_inside_message`]); positions only grow, so an old value
    /// lies behind every later chunk end.
    chunked_end: AtomicU64,
    /// Producers blocked for space.
    waiters: WaitQueue,
    tracker: ByteTracker,
    /// Called when a producer blocks for space (see [`Orb::on_blocked`]).
    blocked_hook: std::sync::OnceLock<BlockedHook>,
    /// The [`Consumer`] was handed out.
    consumer_taken: AtomicBool,
}

/// What producers read and write to reserve space, in one cache line.
#[derive(Debug)]
struct Reservation {
    /// Bytes claimed by producers (the "back reserved"); its top bit is
    /// the exclusive flag of a producer writing a message in chunks.
    pos: AtomicU64,
    /// A value `front` had (never ahead of it: `front` only grows). The
    /// space check reads this instead of `front`, whose line the consumer
    /// writes after every transfer, so a reservation misses no cache line
    /// of the consumer's while the ring has room; `front` itself is read
    /// only when this copy says the ring is full.
    front_seen: AtomicU64,
}

/// The consumer role of one ring buffer (see [`Orb`]): taking committed
/// bytes out, marking them posted and completed. `Send` but not `Sync`:
/// one thread at a time uses it, through `&mut`.
#[derive(Debug)]
pub struct Consumer {
    /// Address of the ring it belongs to (compared, never dereferenced).
    orb: usize,
    _not_sync: std::marker::PhantomData<std::cell::Cell<()>>,
}

/// See [`Orb::on_blocked`].
pub type BlockedHook = Box<dyn Fn() + Send + Sync>;

// SAFETY: the only non-Sync part is the byte buffer. Producers write only
// into spans they reserved through the CAS on `reserved` (disjoint, and not
// readable by the consumer until published through their commit slot, nor
// overlapping bytes before `front + capacity`); the consumer reads only
// collected (committed), not yet completed bytes. Every hand-over of a byte
// between threads is ordered by a Release store / Acquire load pair on a
// commit slot (producer -> consumer; `committed` passes it on between
// consumer threads) or on `front` (consumer -> producer).
unsafe impl Sync for Orb {}

/// Spin, then yield; the caller decides when to block instead.
struct Backoff(u32);

impl Backoff {
    fn new() -> Self {
        Backoff(0)
    }

    fn snooze(&mut self) {
        #[cfg(not(loom))]
        if self.0 < SPIN_ROUNDS {
            self.0 += 1;
            sync::spin_loop();
            return;
        }
        self.0 = self.0.saturating_add(1);
        sync::thread::yield_now();
    }

    fn exhausted(&self) -> bool {
        #[cfg(not(loom))]
        return self.0 >= BACKOFF_ROUNDS;
        #[cfg(loom)]
        return true;
    }
}

impl Orb {
    /// A ring of at least `capacity` bytes, rounded up to a power of two
    /// (and to at least [`MIN_CAPACITY`]).
    pub fn new(capacity: usize) -> Orb {
        let cap = capacity.max(MIN_CAPACITY).next_power_of_two();
        let bytes: Box<[u8]> = vec![0u8; cap].into_boxed_slice();
        // SAFETY: `UnsafeCell<u8>` is `repr(transparent)` over `u8`, so
        // `[u8]` and `[UnsafeCell<u8>]` have the same layout; the box's
        // allocation is handed over unchanged (zeroed memory from calloc,
        // much cheaper than building the cells one by one).
        let buf = unsafe { Box::from_raw(Box::into_raw(bytes) as *mut [UnsafeCell<u8>]) };
        Orb {
            buf,
            mask: cap as u64 - 1,
            front: CachePadded::new(AtomicU64::new(0)),
            front_posted: CachePadded::new(AtomicU64::new(0)),
            committed: CachePadded::new(AtomicU64::new(0)),
            reserved: CachePadded::new(Reservation {
                pos: AtomicU64::new(0),
                front_seen: AtomicU64::new(0),
            }),
            commits: zeroed_slots(cap / GRANULE),
            closed: AtomicBool::new(false),
            chunked_end: AtomicU64::new(0),
            waiters: WaitQueue::new(),
            tracker: ByteTracker::new(cap),
            blocked_hook: std::sync::OnceLock::new(),
            consumer_taken: AtomicBool::new(false),
        }
    }

    /// Sets (once) what a producer that blocks for space calls, after it
    /// registered as waiter: the engine's send thread, which may park long
    /// while nobody waits, must then retire completed sends promptly.
    /// Called under the ring's lock: it must not take locks that are held
    /// while calling into the ring.
    pub fn on_blocked(&self, hook: BlockedHook) {
        let _ = self.blocked_hook.set(hook);
    }

    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    /// True if a producer waits for space.
    pub fn has_waiters(&self) -> bool {
        self.waiters.has_waiters()
    }

    /// The ring's size in bytes (a power of two).
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// Start of the backing memory, stable for the ring's lifetime (for
    /// registering it with RDMA hardware). Writing through it races with the
    /// producers; a transport only reads committed, unposted bytes.
    pub fn base_ptr(&self) -> *mut u8 {
        // Pointer cast only; the cells make writes through it legal.
        self.buf.as_ptr() as *mut u8
    }

    /// Offset of position `pos` in the buffer.
    pub fn offset_of(&self, pos: u64) -> usize {
        (pos & self.mask) as usize
    }

    /// Messages longer than this are written in chunks while the writer owns
    /// the ring exclusively (see [`Orb::write_message`]). Half the ring, so a
    /// normal message never waits for more than half of the ring to drain.
    pub fn chunk_threshold(&self) -> usize {
        self.capacity() / 2
    }

    /// Reserves `len` bytes, lets `fill` serialize the message into them and
    /// commits them; then calls `on_commit` (e.g. to register write interest
    /// and wake the send thread).
    ///
    /// `fill` must write exactly `len` bytes through the [`OrbWriter`]
    /// (which may wrap at the ring's end; `write_all` handles that). Waits
    /// (spin, yield, then block) for space until `deadline`.
    ///
    /// A message longer than [`Orb::chunk_threshold`] may even exceed the
    /// ring: its writer sets the exclusive flag (other producers wait), and
    /// the `OrbWriter` commits each full chunk, calls `on_commit` and waits
    /// for the consumer to free the next one while `fill` is still writing.
    /// The deadline covers the whole message, so choose it for the message's
    /// size.
    ///
    /// Returns the position after the message (`len == 0` is a no-op:
    /// `fill` is not called, and it returns 0).
    ///
    /// # Panics
    /// If `0 < len < MIN_MESSAGE_LEN` (every dxnet frame has a longer
    /// header).
    ///
    /// Errors: [`OrbError::Timeout`] if no space could be reserved before the
    /// deadline (nothing written); [`OrbError::Closed`] if the ring is or gets
    /// closed; [`OrbError::Corrupted`] if bytes were committed that do not
    /// form the message (wrong length written, `fill` failed, or a chunked
    /// message timed out after its first chunk). Committed bytes cannot be
    /// taken back, so on `Corrupted` the ring is closed and the caller must
    /// close the connection. If `fill` panics the same happens (the ring is
    /// closed) and the panic propagates.
    pub fn write_message<F>(
        &self,
        len: usize,
        deadline: &Deadline,
        on_commit: &dyn Fn(),
        fill: F,
    ) -> Result<u64, OrbError>
    where
        F: FnOnce(&mut OrbWriter<'_>) -> io::Result<()>,
    {
        if self.is_closed() {
            return Err(OrbError::Closed);
        }
        if len == 0 {
            return Ok(0);
        }
        assert!(
            len >= MIN_MESSAGE_LEN,
            "message of {len} bytes is shorter than MIN_MESSAGE_LEN"
        );
        let len = len as u64;
        let mut writer = if len <= self.chunk_threshold() as u64 {
            let start = self.wait_for(deadline, false, || self.try_reserve(len))?;
            OrbWriter::new(
                self,
                start,
                start + len,
                start + len,
                false,
                deadline,
                on_commit,
            )
        } else {
            let start = self.wait_for(deadline, false, || self.try_acquire_exclusive())?;
            // Before any of its chunks is committed: a consumer that
            // collects one sees this too.
            self.chunked_end.store(start + len, Ordering::Release);
            // From here on the writer's Drop clears the exclusive flag on
            // any early return.
            let mut w = OrbWriter::new(self, start, start, start + len, true, deadline, on_commit);
            // Nothing committed yet: Timeout/Closed pass through unchanged.
            w.reserve_chunk()?;
            w
        };
        let end = writer.msg_end();
        let result = {
            let _filling = Filling::enter();
            fill(&mut writer)
        };
        writer.finish(result).map(|()| end)
    }

    /// One attempt to reserve `len` contiguous bytes (retrying only on CAS
    /// contention). `None`: not enough space, or a chunked writer owns the
    /// ring.
    fn try_reserve(&self, len: u64) -> Option<u64> {
        loop {
            // Acquire on `front` (and on its copy): our writes to the bytes
            // we reserve come after the consumer's reads of them (Release
            // in `mark_completed`). `front` may pass `r` if others reserved
            // and were sent meanwhile: the check saturates and the swap
            // then fails.
            let r = self.reserved.pos.load(Ordering::Acquire);
            if r & EXCLUSIVE != 0 {
                return None;
            }
            let cap = self.capacity() as u64;
            // The producers' copy of `front` first (same line as `r`):
            // not ahead of `front`, so a span it lets through is free.
            // Acquire: it was stored Release after an Acquire load of
            // `front`, which passes on the order below.
            let seen = self.reserved.front_seen.load(Ordering::Acquire);
            if (r + len).saturating_sub(seen) > cap {
                let front = self.front.load(Ordering::Acquire);
                if front != seen {
                    self.reserved.front_seen.store(front, Ordering::Release);
                }
                if (r + len).saturating_sub(front) > cap {
                    return None;
                }
            }
            if self
                .reserved
                .pos
                .compare_exchange(r, r + len, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                self.prefetch_ahead(r + len);
                return Some(r);
            }
        }
    }

    /// Asks this core to take the ring's lines and their commit slots a
    /// few messages ahead of `pos` for writing (x86 `prefetchw`). The send
    /// thread read those bytes and cleared those slots on the other core;
    /// a producer's store there waits for the line's ownership at the next
    /// full barrier (the write-interest fence), once per message. Fetched
    /// while earlier messages are being written, the next messages find
    /// their lines owned. A hint: it never faults and changes no memory.
    #[inline]
    fn prefetch_ahead(&self, pos: u64) {
        #[cfg(not(loom))]
        {
            let base = self.base_ptr();
            let data = [128u64, 192]
                .map(|ahead| base.wrapping_add(self.offset_of(pos + ahead)).cast_const());
            // A slot line covers 16 slots: 128 ring bytes.
            let slots = [128u64, 256].map(|ahead| {
                let s: *const AtomicU32 = self.slot(pos + ahead);
                s.cast::<u8>()
            });
            crate::primitives::prefetch::for_write(data.into_iter().chain(slots));
        }
        #[cfg(loom)]
        let _ = pos;
    }

    /// One attempt to set the exclusive flag; returns the position where the
    /// exclusive writer's message starts.
    fn try_acquire_exclusive(&self) -> Option<u64> {
        loop {
            let r = self.reserved.pos.load(Ordering::Acquire);
            if r & EXCLUSIVE != 0 {
                return None;
            }
            if self
                .reserved
                .pos
                .compare_exchange(r, r | EXCLUSIVE, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return Some(r);
            }
        }
    }

    /// Repeats `attempt` until it yields a value: spinning, then yielding,
    /// then blocking in the ring's [`WaitQueue`] until `deadline`.
    ///
    /// Producers race for space unless a blocked one was overtaken too
    /// often; then they are served in order (see [`WaitQueue`]). The
    /// exclusive writer waiting for its next chunk (`priority`) is never
    /// held back: every blocked producer waits for its message to end.
    fn wait_for<T>(
        &self,
        deadline: &Deadline,
        priority: bool,
        mut attempt: impl FnMut() -> Option<T>,
    ) -> Result<T, OrbError> {
        let mut backoff = Backoff::new();
        loop {
            if self.closed.load(Ordering::Acquire) {
                return Err(OrbError::Closed);
            }
            if !priority && !self.waiters.may_race() {
                break;
            }
            if let Some(v) = attempt() {
                return Ok(v);
            }
            if backoff.exhausted() {
                break;
            }
            backoff.snooze();
        }
        crate::primitives::before_blocking();
        self.waiters
            .wait(
                deadline.get(),
                priority,
                || self.closed.load(Ordering::Acquire),
                attempt,
                || {
                    if let Some(hook) = self.blocked_hook.get() {
                        hook();
                    }
                },
            )
            .map_err(|e| match e {
                WaitError::Timeout => OrbError::Timeout,
                WaitError::Closed => OrbError::Closed,
            })
    }

    /// Wakes blocked producers; no lock, no syscall when none wait (just a
    /// fence and a load). Callers change the state producers wait for
    /// before calling (see [`WaitQueue`]).
    fn wake_waiters(&self) {
        self.waiters.wake();
    }

    /// Copies `data` into the ring at position `pos`, wrapping at the end.
    ///
    /// # Safety
    /// The caller must own `[pos, pos + data.len())`: reserved by it, not yet
    /// committed, and at most `capacity` bytes.
    unsafe fn copy_in(&self, pos: u64, data: &[u8]) {
        let off = self.offset_of(pos);
        let first = data.len().min(self.capacity() - off);
        let base = self.base_ptr();
        // SAFETY: both ranges lie inside the buffer (`off + first <= cap`,
        // `data.len() - first <= cap - first`), the source is a separate
        // slice, and the caller owns these bytes, so no other thread
        // accesses them concurrently.
        unsafe {
            ptr::copy_nonoverlapping(data.as_ptr(), base.add(off), first);
            ptr::copy_nonoverlapping(data.as_ptr().add(first), base, data.len() - first);
        }
        self.tracker.write(pos, data.len());
    }

    /// Commit slot of the span starting at `pos`.
    fn slot(&self, pos: u64) -> &AtomicU32 {
        &self.commits[self.offset_of(pos) / GRANULE]
    }

    /// Publishes `[start, end)`: one store, whatever earlier spans do.
    fn commit(&self, start: u64, end: u64) {
        debug_assert!(
            end - start >= MIN_MESSAGE_LEN as u64 && end - start <= self.capacity() as u64
        );
        // Release: our bytes are visible to the consumer that loads the slot.
        self.slot(start)
            .store((end - start) as u32, Ordering::Release);
    }

    // ----- consumer side (one thread) -----

    /// Moves `committed` over every span published contiguously after it
    /// and returns the new value. Consumer only.
    ///
    /// Walks at most one slot per published span and stops at the first
    /// unpublished one; clears each slot it passes (the slot's next writer
    /// reserves its span only after `mark_completed` freed this one, which
    /// orders the clearing before that write).
    fn collect_commits(&self) -> u64 {
        // Only the consumer writes `committed`; Acquire pairs with the
        // Release store of an earlier consumer thread.
        let start = self.committed.load(Ordering::Acquire);
        let mut c = start;
        loop {
            let slot = self.slot(c);
            // Acquire: pairs with the producer's Release in `commit`.
            let len = slot.load(Ordering::Acquire);
            if len == 0 {
                break;
            }
            slot.store(0, Ordering::Relaxed);
            c += u64::from(len);
        }
        if c != start {
            // Release: hands the producers' bytes on to a later consumer
            // thread (the consumer role moves between threads under the
            // transport's send lock) and to `positions` snapshots.
            self.committed.store(c, Ordering::Release);
        }
        c
    }

    /// The ring's consumer role; `None` once it was handed out.
    pub fn consumer(&self) -> Option<Consumer> {
        (!self.consumer_taken.swap(true, Ordering::AcqRel)).then_some(Consumer {
            orb: self as *const Orb as usize,
            _not_sync: std::marker::PhantomData,
        })
    }

    /// Gives the consumer role back, so that [`Orb::consumer`] hands it out
    /// again (a transport gave up the connection half that held it, e.g.
    /// an abandoned connection set-up). The ring's positions stay as they
    /// are: the next consumer goes on from there.
    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    pub fn release_consumer(&self, c: Consumer) {
        self.check_consumer(&c);
        // Taken by value: the role cannot be used after it is given back.
        let _ = c;
        self.consumer_taken.store(false, Ordering::Release);
    }

    fn check_consumer(&self, c: &Consumer) {
        assert_eq!(
            c.orb, self as *const Orb as usize,
            "the consumer of another ring buffer"
        );
    }

    /// Committed bytes from `front_posted` on, at most `max`, as two slices
    /// (the second is non-empty only when the bytes wrap at the ring's end).
    /// They borrow the consumer: [`Orb::mark_completed`], which lets
    /// producers overwrite them, cannot run while they are in use.
    pub fn unposted<'a>(&'a self, c: &'a mut Consumer, max: usize) -> (&'a [u8], &'a [u8]) {
        self.check_consumer(c);
        // Only the consumer writes front_posted.
        let fp = self.front_posted.load(Ordering::Relaxed);
        let committed = self.collect_commits();
        let n = ((committed - fp) as usize).min(max);
        self.tracker.read(fp, n);
        let off = self.offset_of(fp);
        let first = n.min(self.capacity() - off);
        let base = self.base_ptr();
        // SAFETY: `[fp, fp + n)` is committed (its writes happen-before the
        // Acquire loads of its commit slots) and not completed, so no
        // producer writes it until the consumer calls `mark_completed`,
        // which needs the `&mut Consumer` these slices borrow. Both ranges
        // lie inside the buffer since `n <= committed - front <= cap`.
        unsafe {
            (
                std::slice::from_raw_parts(base.add(off), first),
                std::slice::from_raw_parts(base, n - first),
            )
        }
    }

    /// The position of the first byte not yet handed to the transport.
    pub fn posted(&self, c: &mut Consumer) -> u64 {
        self.check_consumer(c);
        // Only the consumer writes front_posted.
        self.front_posted.load(Ordering::Relaxed)
    }

    /// Number of committed bytes not yet handed to the transport (the
    /// consumer's: it collects new commits).
    pub fn unposted_len(&self, c: &mut Consumer) -> usize {
        self.check_consumer(c);
        let fp = self.front_posted.load(Ordering::Acquire);
        (self.collect_commits() - fp) as usize
    }

    /// Whether the first `len` unposted bytes may end inside a message: a
    /// message written in chunks (larger than `chunk_threshold`) is
    /// published one chunk at a time, so the published bytes can stop
    /// inside it. Conservative: true also while such a message lies wholly
    /// after those bytes. A transport that interleaves several rings into
    /// one stream switches rings only where this is false.
    pub fn ends_inside_message(&self, c: &mut Consumer, len: usize) -> bool {
        self.check_consumer(c);
        let end = self.front_posted.load(Ordering::Acquire) + len as u64;
        self.chunked_end.load(Ordering::Acquire) > end
    }

    /// Whether any byte is reserved but not yet handed to the transport,
    /// published or not (any thread). A frame that must not overtake
    /// earlier messages of its thread may bypass the ring only when this is
    /// false: a committed span may still sit behind an unpublished one.
    pub fn has_unsent(&self) -> bool {
        let fp = self.front_posted.load(Ordering::Acquire);
        self.reserved.pos.load(Ordering::Acquire) & !EXCLUSIVE != fp
    }

    /// The transport took the next `n` unposted bytes.
    ///
    /// # Panics
    /// If fewer than `n` committed bytes are unposted.
    pub fn mark_posted(&self, c: &mut Consumer, n: usize) {
        self.check_consumer(c);
        let n = n as u64;
        let mut fp = self.front_posted.load(Ordering::Relaxed);
        loop {
            let committed = self.committed.load(Ordering::Acquire);
            assert!(
                n <= committed - fp,
                "mark_posted({n}) past the committed bytes"
            );
            // A CAS, not a store: even a (wrong) second consumer cannot move
            // `front_posted` backwards or past `committed`.
            match self.front_posted.compare_exchange(
                fp,
                fp + n,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(current) => fp = current,
            }
        }
    }

    /// The transport is done with the next `n` posted bytes: frees their
    /// space and wakes producers waiting for it (see below).
    ///
    /// # Panics
    /// If fewer than `n` bytes are posted and not completed.
    pub fn mark_completed(&self, c: &mut Consumer, n: usize) {
        self.check_consumer(c);
        if n == 0 {
            return;
        }
        let n = n as u64;
        let mut front = self.front.load(Ordering::Relaxed);
        loop {
            let fp = self.front_posted.load(Ordering::Acquire);
            assert!(n <= fp - front, "mark_completed({n}) past the posted bytes");
            // Release: our reads of these bytes happen-before the producers'
            // next writes (their Acquire load of `front`). A CAS keeps
            // `front` monotonic and `<= front_posted` even if misused.
            match self
                .front
                .compare_exchange(front, front + n, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(current) => front = current,
            }
        }
        // Blocked producers are woken once per quarter of the ring freed,
        // and whenever the consumer has caught up with everything collected
        // (then no later completion may come to wake them). Waking them at
        // every completion made dozens of producers blocked on a busy ring
        // wake, find it full again and block, once per socket write.
        let new_front = front + n;
        let quarter = (self.capacity() / 4) as u64;
        let crossed = new_front / quarter != front / quarter;
        if crossed
            || (self.front_posted.load(Ordering::Acquire) == new_front
                && self.committed.load(Ordering::Acquire) == new_front)
        {
            self.wake_waiters();
        }
    }

    /// A snapshot of the positions (see [`OrbPositions`]).
    pub fn positions(&self) -> OrbPositions {
        let front = self.front.load(Ordering::Acquire);
        let front_posted = self.front_posted.load(Ordering::Acquire);
        let committed = self.committed.load(Ordering::Acquire);
        let reserved = self.reserved.pos.load(Ordering::Acquire) & !EXCLUSIVE;
        OrbPositions {
            front,
            front_posted,
            committed,
            reserved,
        }
    }

    /// Whether every byte before position `pos` has been completed (the
    /// transport is done with it: written to the socket, or its send
    /// completed).
    #[inline]
    pub fn completed_through(&self, pos: u64) -> bool {
        // Acquire: pairs with the consumer's Release in `mark_completed`.
        self.front.load(Ordering::Acquire) >= pos
    }

    /// The position after the last reserved byte: every span reserved so
    /// far ends at or before it.
    pub fn reserved_end(&self) -> u64 {
        self.reserved.pos.load(Ordering::Acquire) & !EXCLUSIVE
    }

    /// Whether every reserved byte has been committed, posted and completed.
    pub fn is_empty(&self) -> bool {
        let front = self.front.load(Ordering::Acquire);
        front == self.reserved.pos.load(Ordering::Acquire) & !EXCLUSIVE
    }

    /// Closes the ring: producers waiting for space or for a chunked writer
    /// return [`OrbError::Closed`], later writes too. Bytes already committed
    /// stay readable. Idempotent.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        // Always (close is rare): the queue's lock orders this after any
        // waiter's check of `closed`.
        self.waiters.wake_all();
    }

    /// Whether [`Orb::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

impl fmt::Debug for Orb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Orb")
            .field("capacity", &self.capacity())
            .field("positions", &self.positions())
            .field("closed", &self.is_closed())
            .finish()
    }
}

/// `n` commit slots, all 0. Outside loom from zeroed memory (calloc), like
/// the ring's bytes: the pages of a ring no thread writes into are never
/// touched (a connection's extra rings, `tcp.rings`, cost no memory until
/// a thread uses them).
fn zeroed_slots(n: usize) -> Box<[AtomicU32]> {
    #[cfg(not(loom))]
    {
        let zeros: Box<[u32]> = vec![0u32; n].into_boxed_slice();
        // SAFETY: `AtomicU32` has the same size, alignment and bit validity
        // as `u32`, so `[u32]` and `[AtomicU32]` have the same layout; the
        // box's allocation is handed over unchanged.
        unsafe { Box::from_raw(Box::into_raw(zeros) as *mut [AtomicU32]) }
    }
    #[cfg(loom)]
    {
        (0..n).map(|_| AtomicU32::new(0)).collect()
    }
}

mod writer;
#[cfg(all(test, not(loom)))]
use writer::chunk_len;
pub use writer::OrbWriter;

#[cfg(all(test, not(loom)))]
mod tests;

#[cfg(all(test, loom))]
mod loom_tests;
