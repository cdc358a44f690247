//! The request table: pending requests by id, matched with their responses.
//!
//! Each pending request has a slot shared between the table and the
//! caller's [`PendingResponse`]. A response, a connection failure, a timeout
//! or shutdown completes the slot exactly once; the first wins.

use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::core::breakdown::{self, Breakdown, RequesterTimes};
use crate::primitives::park;

use crate::error::{Cancelled, Waited};
use crate::{Error, NodeId, Result};

const SHARDS: usize = 64;
/// Low bits of a request id: the shard of the thread that sent it.
const SHARD_BITS: u32 = 6;

std::thread_local! {
    /// This thread's shard: its requests stay in one shard's table, so a
    /// thread's round trips touch the same memory every time (ids in
    /// sequence spread over all shards made every request and response
    /// touch another table: a cache and TLB miss each, which under full
    /// CPU emulation is a visible part of a round trip).
    static THREAD_SHARD: u32 = {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS as u32
    };
}

/// One lock's share of the pending requests.
/// FxHash: keys are our own sequential request ids (a peer's response can
/// only look one up, never insert), so SipHash's flooding resistance buys
/// nothing, and the lookup is on every response's path.
type Shard = Mutex<FxHashMap<u32, Arc<Slot>>>;

/// What a completed request holds: the encoded response payload or why none
/// came.
pub type Outcome = Result<Vec<u8>>;

#[derive(Debug)]
enum SlotState {
    Waiting {
        waker: Option<Waker>,
        thread: Option<Thread>,
        /// Storage for the response payload (a recycled buffer, see
        /// [`recycle_payload`]).
        buf: Vec<u8>,
    },
    Done(Outcome),
    Taken,
}

/// Payload buffers kept for reuse are at most this large.
const KEEP_PAYLOAD: usize = 64 << 10;

std::thread_local! {
    /// A completed request's slot, for this thread's next request, and a
    /// response payload buffer: a blocking round trip then allocates
    /// nothing in the request table (an allocation and its release cost
    /// ~0.1 µs each under CPU emulation, and touch more memory).
    static SPARE_SLOT: std::cell::RefCell<Option<Arc<Slot>>> = const { std::cell::RefCell::new(None) };
    static SPARE_PAYLOAD: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Hands a response payload (from [`PendingResponse::wait`] and friends),
/// once decoded, back for the calling thread's next request.
pub fn recycle_payload(mut buf: Vec<u8>) {
    if buf.capacity() <= KEEP_PAYLOAD {
        buf.clear();
        let _ = SPARE_PAYLOAD.try_with(|b| {
            if let Ok(mut b) = b.try_borrow_mut() {
                if b.capacity() < buf.capacity() {
                    *b = buf;
                }
            }
        });
    }
}

fn spare_payload() -> Vec<u8> {
    SPARE_PAYLOAD
        .try_with(|b| {
            b.try_borrow_mut()
                .map(|mut b| std::mem::take(&mut *b))
                .unwrap_or_default()
        })
        .unwrap_or_default()
}

#[derive(Debug)]
struct Slot {
    peer: NodeId,
    deadline: Instant,
    state: Mutex<SlotState>,
    /// Set once the outcome is known (lets a waiter spin without the lock).
    done: AtomicBool,
    /// Stamps its path for the latency breakdown (`metrics.breakdown`).
    timed: bool,
    /// The call, in [`breakdown::ns`] (when `timed`).
    start: u64,
    /// The request committed and the call's end; its response's arrival
    /// and completion (these two written before `done`).
    committed: AtomicU64,
    sent: AtomicU64,
    arrived: AtomicU64,
    completed: AtomicU64,
}

impl Slot {
    /// Completes the slot; false if it was already complete.
    fn complete(&self, outcome: Outcome) -> bool {
        self.complete_with(|_| outcome)
    }

    /// Completes the slot with `payload`, copied into its buffer.
    fn complete_payload(&self, payload: &[u8]) -> bool {
        self.complete_with(|mut buf| {
            buf.clear();
            buf.extend_from_slice(payload);
            Ok(buf)
        })
    }

    /// Completes the slot with the outcome `f` makes of its payload buffer
    /// (only called while the slot is waiting); false if it was already
    /// complete.
    fn complete_with(&self, f: impl FnOnce(Vec<u8>) -> Outcome) -> bool {
        let mut st = self.state.lock();
        match std::mem::replace(&mut *st, SlotState::Taken) {
            SlotState::Waiting { waker, thread, buf } => {
                *st = SlotState::Done(f(buf));
                if self.timed {
                    let now = breakdown::now_ns();
                    self.completed.store(now, Ordering::Relaxed);
                    self.arrived
                        .store(breakdown::arrival_or(now), Ordering::Relaxed);
                }
                self.done.store(true, Ordering::Release);
                drop(st);
                if let Some(w) = waker {
                    w.wake();
                }
                if let Some(t) = thread {
                    t.unpark();
                }
                true
            }
            old => {
                *st = old;
                false
            }
        }
    }
}

/// All pending requests of a node.
#[derive(Debug)]
pub struct RequestTable {
    next_id: AtomicU32,
    /// Threads blocked in [`crate::core::Core::wait_response`] (beside
    /// `next_id`: a request touches both, so one line moves, not two).
    blocked: AtomicUsize,
    shards: Box<[Shard]>,
    closed: AtomicBool,
    timer: Timer,
    /// The node's latency breakdown, when kept.
    breakdown: Option<Arc<Breakdown>>,
}

impl RequestTable {
    /// An empty table with its timeout thread (for `Future` waiters);
    /// its requests record their stages into `breakdown` if given.
    pub fn new(breakdown: Option<Arc<Breakdown>>) -> Arc<Self> {
        let table = Arc::new(Self {
            next_id: AtomicU32::new(1),
            blocked: AtomicUsize::new(0),
            shards: (0..SHARDS)
                .map(|_| Mutex::new(FxHashMap::default()))
                .collect(),
            closed: AtomicBool::new(false),
            timer: Timer::default(),
            breakdown,
        });
        let weak = Arc::downgrade(&table);
        let handle = std::thread::Builder::new()
            .name("dxnet-req-timer".into())
            .spawn(move || timer_loop(weak))
            .expect("spawn request timer thread");
        *table.timer.thread.lock() = Some(handle);
        table
    }

    /// Counts the calling thread as blocked for a response until the
    /// guard drops (see [`RequestTable::blocked`]).
    pub fn block(&self) -> Blocked<'_> {
        self.blocked.fetch_add(1, Ordering::Relaxed);
        Blocked(&self.blocked)
    }

    /// Threads of this node blocked for a response now: each sends its
    /// next request soon after its response comes (a closed loop), which
    /// tells the send path that more requests are due.
    pub fn blocked(&self) -> usize {
        self.blocked.load(Ordering::Relaxed)
    }

    fn shard(&self, id: u32) -> &Shard {
        &self.shards[(id & ((1 << SHARD_BITS) - 1)) as usize]
    }

    /// Registers a new pending request to `peer`; returns its id and handle.
    #[cfg(test)]
    pub fn insert(
        self: &Arc<Self>,
        peer: NodeId,
        timeout: Duration,
    ) -> Result<(u32, PendingResponse)> {
        self.insert_at(peer, Instant::now(), timeout, false)
    }

    /// Registers a new pending request to `peer` sent at `now` (the caller's
    /// clock reading, also used for the send: one clock read less per
    /// request, which costs ~0.1 µs under CPU emulation).
    /// `timed`: a request whose stages go into the node's latency
    /// breakdown, if it keeps one.
    pub fn insert_at(
        self: &Arc<Self>,
        peer: NodeId,
        now: Instant,
        timeout: Duration,
        timed: bool,
    ) -> Result<(u32, PendingResponse)> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Shutdown);
        }
        let timed = timed && self.breakdown.is_some();
        let start = if timed { breakdown::ns(now) } else { 0 };
        let waiting = SlotState::Waiting {
            waker: None,
            thread: None,
            buf: spare_payload(),
        };
        let spare = SPARE_SLOT
            .try_with(|s| s.try_borrow_mut().ok().and_then(|mut s| s.take()))
            .ok()
            .flatten();
        let slot = match spare {
            Some(mut slot) => {
                // Unique: stored only when no one else held it.
                let s = Arc::get_mut(&mut slot).expect("a spare slot is unshared");
                s.peer = peer;
                s.deadline = now + timeout;
                *s.state.get_mut() = waiting;
                *s.done.get_mut() = false;
                s.timed = timed;
                s.start = start;
                slot
            }
            None => Arc::new(Slot {
                peer,
                deadline: now + timeout,
                state: Mutex::new(waiting),
                done: AtomicBool::new(false),
                timed,
                start,
                committed: AtomicU64::new(0),
                sent: AtomicU64::new(0),
                arrived: AtomicU64::new(0),
                completed: AtomicU64::new(0),
            }),
        };
        loop {
            let seq = self.next_id.fetch_add(1, Ordering::Relaxed);
            let id = seq << SHARD_BITS | THREAD_SHARD.with(|s| *s);
            if id == 0 {
                continue; // 0 means "no request"
            }
            let mut shard = self.shard(id).lock();
            if shard.contains_key(&id) {
                continue; // wrapped onto a request still pending
            }
            shard.insert(id, slot.clone());
            return Ok((
                id,
                PendingResponse {
                    id,
                    slot: Some(slot),
                    table: Arc::downgrade(self),
                    timer_armed: false,
                },
            ));
        }
    }

    /// Completes request `id` with a response from `from`; false if no such
    /// request is pending (late after a timeout, or a forged id from another
    /// node, which is ignored).
    pub fn complete(&self, id: u32, from: NodeId, outcome: Outcome) -> bool {
        self.take_pending(id, from)
            .is_some_and(|s| s.complete(outcome))
    }

    /// Completes request `id` from `from` with a response `payload` (copied
    /// into the slot's recycled buffer); see [`RequestTable::complete`].
    pub fn complete_payload(&self, id: u32, from: NodeId, payload: &[u8]) -> bool {
        self.take_pending(id, from)
            .is_some_and(|s| s.complete_payload(payload))
    }

    /// Completes request `id` from `from` with `payload` itself (a
    /// reassembled response taken from the decoder: no copy).
    pub fn complete_owned(&self, id: u32, from: NodeId, payload: Vec<u8>) -> bool {
        self.take_pending(id, from)
            .is_some_and(|s| s.complete_with(|_| Ok(payload)))
    }

    /// Removes and returns request `id` if it is pending on `from`.
    fn take_pending(&self, id: u32, from: NodeId) -> Option<Arc<Slot>> {
        let mut shard = self.shard(id).lock();
        match shard.get(&id) {
            Some(s) if s.peer == from => shard.remove(&id),
            _ => None,
        }
    }

    /// Fails every request pending on `peer` (its connection broke).
    pub fn fail_peer(&self, peer: NodeId, err: &Error) -> usize {
        let mut failed = Vec::new();
        for shard in self.shards.iter() {
            shard.lock().retain(|_, s| {
                if s.peer == peer {
                    failed.push(s.clone());
                    false
                } else {
                    true
                }
            });
        }
        let n = failed.len();
        for s in failed {
            s.complete(Err(err.clone()));
        }
        n
    }

    /// Fails every pending request with [`Error::Shutdown`] and refuses new ones.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let mut all = Vec::new();
        for shard in self.shards.iter() {
            all.extend(shard.lock().drain().map(|(_, s)| s));
        }
        for s in all {
            s.complete(Err(Error::Shutdown));
        }
        self.timer.stop.store(true, Ordering::Release);
        self.timer.cv.notify_all();
        if let Some(h) = self.timer.thread.lock().take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }

    /// Requests pending now.
    #[cfg(test)]
    pub fn pending(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Removes `id` if still pending and completes it with a timeout.
    fn expire(&self, id: u32) {
        let slot = self.shard(id).lock().remove(&id);
        if let Some(s) = slot {
            s.complete(Err(Error::Timeout(Waited::Response)));
        }
    }

    fn remove(&self, id: u32) {
        self.shard(id).lock().remove(&id);
    }
}

/// Deadlines of requests awaited as futures (blocking waiters time out by
/// themselves).
#[derive(Debug, Default)]
struct Timer {
    heap: Mutex<BinaryHeap<std::cmp::Reverse<(Instant, u32)>>>,
    cv: Condvar,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn timer_loop(table: Weak<RequestTable>) {
    loop {
        let Some(t) = table.upgrade() else { return };
        if t.timer.stop.load(Ordering::Acquire) {
            return;
        }
        let mut heap = t.timer.heap.lock();
        let now = Instant::now();
        let mut due = Vec::new();
        while let Some(std::cmp::Reverse((d, id))) = heap.peek().copied() {
            if d <= now {
                heap.pop();
                due.push(id);
            } else {
                break;
            }
        }
        if due.is_empty() {
            let wait = heap
                .peek()
                .map(|std::cmp::Reverse((d, _))| d.saturating_duration_since(now))
                .unwrap_or(Duration::from_millis(100))
                .min(Duration::from_millis(100));
            t.timer.cv.wait_for(&mut heap, wait);
            continue;
        }
        drop(heap);
        for id in due {
            t.expire(id);
        }
    }
}

/// The caller's side of a pending request.
#[derive(Debug)]
pub struct PendingResponse {
    id: u32,
    /// Always `Some` until dropped (taken in `drop` for reuse).
    slot: Option<Arc<Slot>>,
    table: Weak<RequestTable>,
    timer_armed: bool,
}

impl PendingResponse {
    fn slot(&self) -> &Slot {
        self.slot.as_deref().expect("slot present until drop")
    }

    fn take_done(&self) -> Option<Outcome> {
        let mut st = self.slot().state.lock();
        if matches!(*st, SlotState::Done(_)) {
            match std::mem::replace(&mut *st, SlotState::Taken) {
                SlotState::Done(o) => {
                    drop(st);
                    if o.is_ok() && self.slot().timed {
                        self.record_stages();
                    }
                    Some(o)
                }
                _ => unreachable!(),
            }
        } else if matches!(*st, SlotState::Taken) {
            Some(Err(Error::Cancelled(Cancelled::AlreadyTaken)))
        } else {
            None
        }
    }

    /// Notes that the call sending the request ends (see
    /// [`breakdown::committed`] for the commit before).
    pub fn mark_sent(&self) {
        let s = self.slot();
        if s.timed {
            s.committed
                .store(breakdown::take_committed(), Ordering::Relaxed);
            s.sent.store(breakdown::now_ns(), Ordering::Relaxed);
        }
    }

    /// Records a timed request's stages as its outcome is taken (the
    /// slot's completion times were written before `done`, which the
    /// caller saw under the slot's lock).
    #[cold]
    fn record_stages(&self) {
        let s = self.slot();
        let times = RequesterTimes {
            start: s.start,
            committed: s.committed.load(Ordering::Relaxed),
            sent: s.sent.load(Ordering::Relaxed),
            arrived: s.arrived.load(Ordering::Relaxed),
            completed: s.completed.load(Ordering::Relaxed),
        };
        let taken = breakdown::now_ns();
        if let Some(b) = self.table.upgrade().and_then(|t| t.breakdown.clone()) {
            b.record_requester(times, taken);
        }
    }

    /// The request's id (what its response carries).
    #[cfg(test)]
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The node the request went to.
    pub fn peer(&self) -> NodeId {
        self.slot().peer
    }

    /// True once the outcome is known (a later wait returns at once).
    #[inline]
    pub fn is_done(&self) -> bool {
        self.slot().done.load(Ordering::Acquire)
    }

    /// When the request times out.
    pub fn deadline(&self) -> Instant {
        self.slot().deadline
    }

    /// Waits without parking until the outcome is known or `until`,
    /// giving the core away between two looks (see [`park::yield_spin`]).
    pub fn spin_until(&self, until: Instant) {
        park::yield_spin(until, || self.slot().done.load(Ordering::Acquire));
    }

    /// Blocks until the outcome is known or the deadline passes.
    pub fn wait(self) -> Outcome {
        if self.slot().done.load(Ordering::Acquire) {
            // Usually so after a busy-wait: no thread to register.
            if let Some(o) = self.take_done() {
                return o;
            }
        } else {
            crate::core::inline::before_blocking();
        }
        loop {
            {
                let mut st = self.slot().state.lock();
                if let SlotState::Waiting { thread, .. } = &mut *st {
                    *thread = Some(std::thread::current());
                }
            }
            if let Some(o) = self.take_done() {
                return o;
            }
            let now = Instant::now();
            if now >= self.slot().deadline {
                if let Some(t) = self.table.upgrade() {
                    t.expire(self.id);
                } else {
                    self.slot().complete(Err(Error::Shutdown));
                }
                return self
                    .take_done()
                    .unwrap_or(Err(Error::Timeout(Waited::Response)));
            }
            std::thread::park_timeout(self.slot().deadline - now);
        }
    }

    /// The outcome if known, without blocking.
    pub fn try_take(&mut self) -> Option<Outcome> {
        if let Some(o) = self.take_done() {
            return Some(o);
        }
        if Instant::now() >= self.slot().deadline {
            if let Some(t) = self.table.upgrade() {
                t.expire(self.id);
            }
            return self.take_done();
        }
        None
    }

    /// Registers `w` to be woken when the outcome is known (no timer: the
    /// caller watches the deadline).
    pub fn set_waker(&self, w: &Waker) {
        let mut st = self.slot().state.lock();
        if let SlotState::Waiting { waker, .. } = &mut *st {
            *waker = Some(w.clone());
        }
    }

    /// `Future` support: the outcome, or registers the waker.
    pub fn poll_take(&mut self, cx: &mut Context<'_>) -> Poll<Outcome> {
        {
            let mut st = self.slot().state.lock();
            if let SlotState::Waiting { waker, .. } = &mut *st {
                match waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => *waker = Some(cx.waker().clone()),
                }
            }
        }
        if let Some(o) = self.take_done() {
            return Poll::Ready(o);
        }
        if !self.timer_armed {
            self.timer_armed = true;
            match self.table.upgrade() {
                Some(t) => {
                    t.timer
                        .heap
                        .lock()
                        .push(std::cmp::Reverse((self.slot().deadline, self.id)));
                    t.timer.cv.notify_all();
                }
                None => return Poll::Ready(Err(Error::Shutdown)),
            }
        }
        Poll::Pending
    }
}

impl Drop for PendingResponse {
    fn drop(&mut self) {
        // An abandoned request must not stay in the table. A completed one
        // is gone from it already (every completion removes it first).
        if !self.slot().done.load(Ordering::Acquire) {
            if let Some(t) = self.table.upgrade() {
                t.remove(self.id);
            }
            return;
        }
        // Complete, so out of the table: reuse the slot for this thread's
        // next request if nobody else holds it.
        if let Some(mut slot) = self.slot.take() {
            if Arc::get_mut(&mut slot).is_some() {
                let _ = SPARE_SLOT.try_with(|s| {
                    if let Ok(mut s) = s.try_borrow_mut() {
                        s.get_or_insert(slot);
                    }
                });
            }
        }
    }
}

/// A thread blocked for a response (see [`RequestTable::block`]).
pub struct Blocked<'a>(&'a AtomicUsize);

impl Drop for Blocked<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complete_fail_timeout() {
        let t = RequestTable::new(None);
        let (id, p) = t.insert(NodeId(1), Duration::from_secs(10)).unwrap();
        assert!(
            !t.complete(id, NodeId(2), Ok(vec![1])),
            "wrong peer ignored"
        );
        assert!(t.complete(id, NodeId(1), Ok(vec![1, 2])));
        assert!(!t.complete(id, NodeId(1), Ok(vec![3])), "only once");
        assert_eq!(p.wait(), Ok(vec![1, 2]));

        let (_, p1) = t.insert(NodeId(3), Duration::from_secs(10)).unwrap();
        let (_, p2) = t.insert(NodeId(4), Duration::from_secs(10)).unwrap();
        let e = Error::Unreachable(NodeId(3), crate::Unreachable::ConnectionLost("test".into()));
        assert_eq!(t.fail_peer(NodeId(3), &e), 1);
        assert_eq!(p1.wait(), Err(e));
        drop(p2);
        assert_eq!(t.pending(), 0, "dropped handle removes its entry");

        let (_, p) = t.insert(NodeId(5), Duration::from_millis(5)).unwrap();
        assert_eq!(p.wait(), Err(Error::Timeout(Waited::Response)));
        assert_eq!(t.pending(), 0);
        t.close();
        assert!(t.insert(NodeId(1), Duration::from_secs(1)).is_err());
    }

    #[test]
    fn slots_and_payload_buffers_are_reused_per_thread() {
        let t = RequestTable::new(None);
        let (id1, p1) = t.insert(NodeId(1), Duration::from_secs(10)).unwrap();
        let slot1 = Arc::as_ptr(p1.slot.as_ref().unwrap());
        assert!(t.complete_payload(id1, NodeId(1), &[7; 100]));
        let bytes = p1.wait().unwrap();
        assert_eq!(bytes, vec![7; 100]);
        let buf1 = bytes.as_ptr();
        recycle_payload(bytes);
        let (id2, p2) = t.insert(NodeId(2), Duration::from_secs(10)).unwrap();
        assert_ne!(id1, id2);
        assert_eq!(Arc::as_ptr(p2.slot.as_ref().unwrap()), slot1, "slot reused");
        assert_eq!(p2.peer(), NodeId(2));
        assert!(!p2.is_done(), "a reused slot starts waiting");
        assert!(
            !t.complete_payload(id1, NodeId(1), &[1]),
            "a stale id completes nothing"
        );
        assert!(t.complete_payload(id2, NodeId(2), &[9; 10]));
        let bytes = p2.wait().unwrap();
        assert_eq!(bytes, vec![9; 10]);
        assert_eq!(bytes.as_ptr(), buf1, "payload buffer reused");
        // A handle dropped before completion is removed, not reused.
        let (_, p3) = t.insert(NodeId(3), Duration::from_secs(10)).unwrap();
        drop(p3);
        assert_eq!(t.pending(), 0);
        t.close();
    }

    #[test]
    fn many_threads_match_responses() {
        let t = RequestTable::new(None);
        let mut handles = Vec::new();
        for th in 0..4 {
            let t = t.clone();
            handles.push(std::thread::spawn(move || {
                let mut pend = Vec::new();
                for i in 0..500u32 {
                    let (id, p) = t.insert(NodeId(th), Duration::from_secs(30)).unwrap();
                    pend.push((id, i, p));
                }
                // Respond out of order from this thread.
                for (id, i, _) in pend.iter().rev() {
                    assert!(t.complete(*id, NodeId(th), Ok(i.to_le_bytes().to_vec())));
                }
                for (_, i, p) in pend {
                    assert_eq!(p.wait().unwrap(), i.to_le_bytes().to_vec());
                }
            }));
        }
        for h in handles {
            h.join().unwrap();
        }
        t.close();
    }
}
