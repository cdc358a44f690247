//! Per-peer connection state and the table of open connections.
//!
//! A [`Connection`] is the transport-independent half of a link to one peer:
//! its outgoing ring buffer, flow control, received-but-unprocessed buffers
//! (inbox) and reassembly state. A transport engine attaches its own half
//! (socket, queue pair) keyed by the connection's id.

use std::any::Any;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::Mutex;

use crate::core::flow::FlowControl;
use crate::primitives::hazard::{Guard, HazardTable};
use crate::primitives::in_order::InOrderTrack;
use crate::primitives::orb::Orb;
use crate::primitives::park::{RequestSpinPolicy, Signal};
use crate::primitives::pool::RecvBuffer;
use crate::proto::decoder::Decoder;
use crate::NodeId;

/// Connection lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ConnState {
    /// Being established; senders wait.
    Connecting = 0,
    /// Established: data flows.
    Open = 1,
    /// Closed or broken; never reopened (a new connection replaces it).
    Closed = 2,
}

/// Received data waiting for a handler thread.
#[derive(Debug)]
pub enum Incoming {
    /// A pooled receive buffer (returned to the pool after processing).
    Pooled(RecvBuffer),
    /// Bytes of a message to the own node (never crossed a transport).
    Local(Vec<u8>),
    /// Whole messages (no responses) decoded ahead of their turn while the
    /// connection's handler was blocked (see `Core::owner_blocking`); parsed
    /// without the connection's decoder.
    Decoded(Vec<u8>),
}

impl Incoming {
    /// Message-stream bytes it carries.
    pub fn data_len(&self) -> usize {
        match self {
            Self::Pooled(b) => b.data_len(),
            Self::Local(v) | Self::Decoded(v) => v.len(),
        }
    }
}

/// The inbox of a connection: buffers received, in order, and who owns the
/// connection. Both live under one lock so no wake-up is lost.
///
/// The ownership protocol: a connection is *scheduled* while it is queued
/// in the ready queue or held by one thread (a handler thread, or a
/// receiving thread handling it inline); only that owner decodes and
/// dispatches its messages, so they run in order. [`Inbox::push`] schedules
/// an unowned connection (the caller hands it to the handlers),
/// [`Inbox::take_if_idle`] takes an idle one, and the owner gives it up
/// through [`Inbox::pop_or_release`] or [`Inbox::release_unless_queued`]
/// when nothing is left. While the owner is blocked inside dxnet
/// (`owner_blocked`, see `Core::owner_blocking`) arriving buffers are
/// decoded at once and wait as [`Incoming::Decoded`].
///
/// Lock order: a thread that needs both takes the connection's decoder
/// before its inbox, and never waits for the decoder while it holds the
/// inbox (it may only `try_lock` it).
#[derive(Debug, Default)]
pub struct Inbox {
    /// Buffers in arrival order.
    items: VecDeque<Incoming>,
    /// Message-stream bytes in `items`.
    bytes: usize,
    /// Queued in the ready queue or held by an owner.
    scheduled: bool,
    /// The owner is blocked inside dxnet: buffers are decoded on arrival.
    owner_blocked: bool,
    /// The connection that replaced this one to the same peer while this
    /// one still had data to handle; it is held until this one is done.
    successor: Option<Arc<Connection>>,
    /// Held behind its predecessor (see `successor`): pushes queue but do
    /// not schedule, and nobody takes it idle.
    held: bool,
}

impl Inbox {
    /// Appends `item`; true if the connection was not scheduled and now is
    /// (the caller then puts it in the ready queue).
    pub fn push(&mut self, item: Incoming) -> bool {
        self.bytes += item.data_len();
        self.items.push_back(item);
        !self.held && !std::mem::replace(&mut self.scheduled, true)
    }

    /// Takes ownership of a connection with nothing queued and no owner;
    /// false if it is scheduled or has data queued.
    pub fn take_if_idle(&mut self) -> bool {
        if self.scheduled || self.held || !self.items.is_empty() {
            return false;
        }
        self.scheduled = true;
        true
    }

    /// The owner's next item; `Err` ends the ownership (nothing queued) and
    /// hands over the successor held behind this connection, if any (the
    /// caller releases it with [`Inbox::unhold`]).
    pub fn pop_or_release(&mut self) -> Result<Incoming, Option<Arc<Connection>>> {
        match self.items.pop_front() {
            Some(it) => {
                self.bytes -= it.data_len();
                Ok(it)
            }
            None => {
                self.scheduled = false;
                Err(self.successor.take())
            }
        }
    }

    /// The owner is done: ends the ownership if nothing is queued (`Ok`,
    /// with the successor to release as for [`Inbox::pop_or_release`]);
    /// `Err` if items are queued (the owner keeps it and must reschedule
    /// it).
    pub fn release_unless_queued(&mut self) -> Result<Option<Arc<Connection>>, ()> {
        if self.items.is_empty() {
            self.scheduled = false;
            Ok(self.successor.take())
        } else {
            Err(())
        }
    }

    /// Makes `next` (a new connection to the same peer) wait until this
    /// one's data is handled, if it has any: per sender thread, messages
    /// sent over the new connection come after those of the old one.
    /// Returns true if `next` is now held.
    pub fn hold_successor(&mut self, next: &Arc<Connection>) -> bool {
        if !self.scheduled && self.items.is_empty() {
            return false;
        }
        next.inbox.lock().held = true;
        // A successor already held behind this one goes behind `next`.
        if let Some(prev) = self.successor.replace(next.clone()) {
            next.inbox.lock().successor = Some(prev);
        }
        true
    }

    /// Ends the hold of this connection; true if it has data and was not
    /// scheduled: the caller then puts it in the ready queue (as after
    /// [`Inbox::push`]).
    pub fn unhold(&mut self) -> bool {
        self.held = false;
        !self.items.is_empty() && !std::mem::replace(&mut self.scheduled, true)
    }

    /// The held successor, taken (its hold is to end: the owner of this
    /// connection blocked inside dxnet, and a response it waits for may
    /// come on the successor).
    pub fn take_successor(&mut self) -> Option<Arc<Connection>> {
        self.successor.take()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Number of queued items.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Message-stream bytes queued.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether the owner is blocked inside dxnet (decode-ahead).
    pub fn owner_blocked(&self) -> bool {
        self.owner_blocked
    }

    /// Sets whether the owner is blocked; returns the previous value.
    pub fn set_owner_blocked(&mut self, blocked: bool) -> bool {
        std::mem::replace(&mut self.owner_blocked, blocked)
    }

    /// Takes every queued item out (decode-ahead merges them); their bytes
    /// leave the count until [`Inbox::push_decoded`] puts the result back.
    pub fn drain(&mut self) -> VecDeque<Incoming> {
        self.bytes = 0;
        std::mem::take(&mut self.items)
    }

    /// Appends decoded-ahead bytes: to the last item if it is decoded too
    /// (returns its length before, for the incoming queue's accounting),
    /// else as a new item (`None`). The connection stays owned.
    pub fn push_decoded(&mut self, new: Vec<u8>) -> Option<usize> {
        self.bytes += new.len();
        match self.items.back_mut() {
            Some(Incoming::Decoded(last)) => {
                let before = last.len();
                last.extend_from_slice(&new);
                Some(before)
            }
            _ => {
                self.items.push_back(Incoming::Decoded(new));
                None
            }
        }
    }
}

/// Proof that the holder owns a connection's received data (see [`Inbox`]):
/// only an `Owned` decodes and dispatches, so a connection's messages run
/// in order on one thread at a time. Made when a connection is scheduled
/// ([`Inbox::push`] via the incoming queue) or taken idle
/// ([`Connection::take_if_idle`]); not `Clone`. It ends by
/// [`Owned::release_unless_queued`], by the incoming queue's `next_item`
/// finding nothing, or by going back to the ready queue (`reschedule`).
#[derive(Debug)]
pub struct Owned(Arc<Connection>);

impl Owned {
    /// Only the inbox protocol makes one: the caller has just set
    /// `scheduled` under the inbox lock.
    pub(super) fn new_scheduled(conn: Arc<Connection>) -> Self {
        Owned(conn)
    }

    /// Ends the ownership if nothing is queued (`Ok`, with a successor the
    /// caller must release, see [`Inbox::pop_or_release`]), else keeps it
    /// and returns it (`Err`: the caller must reschedule it).
    pub fn release_unless_queued(self) -> Result<Option<Arc<Connection>>, Owned> {
        let released = self.0.inbox.lock().release_unless_queued();
        released.map_err(|()| self)
    }
}

impl std::ops::Deref for Owned {
    type Target = Arc<Connection>;

    fn deref(&self) -> &Arc<Connection> {
        &self.0
    }
}

/// The transport-independent state of a connection to one peer.
#[derive(Debug)]
pub struct Connection {
    /// The peer.
    pub peer: NodeId,
    /// Unique id of this connection in the process, never reused (0: a
    /// node's connections to itself).
    pub id: u64,
    /// This connection, for the entries threads keep of the ring they
    /// write into ([`RingUse`]).
    me: Weak<Connection>,
    /// Outgoing ring buffer (the first of the connection's rings; the only
    /// one unless the engine drains several, see [`Connection::ring_for_thread`]).
    pub orb: Orb,
    /// The connection's further rings.
    more_rings: Box<[Orb]>,
    /// Bit `r` set once a thread wrote into ring `r` (ring 0 from the
    /// start): the engine looks only at rings in use, not at every ring
    /// per write (several rings, few sending threads).
    rings_in_use: AtomicU32,
    /// Flow control, both directions.
    pub flow: FlowControl,
    /// Received data waiting for processing.
    pub inbox: Mutex<Inbox>,
    /// Reassembly state; used by the connection's owner (see [`Inbox`]),
    /// and by decode-ahead while the owner is blocked. Locked before the
    /// inbox.
    pub decoder: Mutex<Decoder>,
    state: AtomicU8,
    peer_instance: AtomicU64,
    last_used: AtomicU64,
    /// Signalled when the state changes.
    pub state_changed: Signal,
    close_reason: Mutex<Option<String>>,
    /// The peer refused this connection because it does not know this
    /// node (not in its node map yet): with discovery, a dial worth
    /// repeating once the peer has heard of this node.
    refused_as_unknown: AtomicBool,
    /// The last response to this peer timed out: further responses are
    /// dropped instead of blocking a handler thread (see `Core::send_response`).
    pub responses_stalled: AtomicBool,
    /// Whether a plain message to this peer that finds the send thread
    /// parked is written on the sender's thread.
    pub direct_writes: super::direct_write::DirectWrites,
    /// How long blocking requests to this peer busy-wait.
    pub request_spin: RequestSpinPolicy,
    /// The engine's half of this connection (socket, send state, ...),
    /// attached once it is set up: engines find it from the connection
    /// instead of keeping their own per-peer maps in sync with the
    /// connection table. Weak: the engine owns it (its poll registration),
    /// and the engine's half holds the connection.
    engine: OnceLock<Weak<dyn Any + Send + Sync>>,
    /// Outcomes of the one-sided device parts posted on this connection,
    /// numbered by the engine (see `transport::RemoteMemory::post`).
    pub parts: Box<InOrderTrack>,
    /// Messages and bytes of this connection, when `metrics.per_connection`
    /// is on (`None` costs a sender nothing but the check).
    pub counters: Option<Box<ConnCounters>>,
    /// Where the node's sent-message counts keep this connection's (see
    /// `SentTraffic::take_slot`).
    pub sent_slot: u32,
}

/// Messages and bytes one connection received (those it sent are counted
/// with the node's, see [`crate::primitives::stats::SentTraffic`]):
/// added once per received buffer, or per message for receivers run on
/// all handler threads (`register_parallel`).
#[derive(Debug, Default)]
pub struct ConnCounters {
    /// Messages dispatched from this connection (added once per received
    /// buffer by the thread that handled it).
    pub received_messages: AtomicU64,
    /// Their bytes (header + payload).
    pub received_bytes: AtomicU64,
}

impl Connection {
    /// A new connection in state `Connecting` with `rings` outgoing rings
    /// (at least one) sharing `orb_size` bytes ([`ring_capacity`]); with
    /// per-connection counters if `sent_slot` names the slot its sent
    /// messages are counted in.
    pub fn new(
        peer: NodeId,
        id: u64,
        (orb_size, rings): (usize, usize),
        flow: FlowControl,
        max_payload: usize,
        sent_slot: Option<u32>,
    ) -> Arc<Self> {
        let capacity = ring_capacity(orb_size, rings);
        Arc::new_cyclic(|me| Self {
            peer,
            id,
            me: me.clone(),
            orb: Orb::new(capacity),
            more_rings: (1..rings.max(1)).map(|_| Orb::new(capacity)).collect(),
            rings_in_use: AtomicU32::new(1),
            flow,
            inbox: Mutex::new(Inbox::default()),
            decoder: Mutex::new(Decoder::new(max_payload)),
            state: AtomicU8::new(ConnState::Connecting as u8),
            peer_instance: AtomicU64::new(0),
            last_used: AtomicU64::new(0),
            state_changed: Signal::new(),
            close_reason: Mutex::new(None),
            refused_as_unknown: AtomicBool::new(false),
            responses_stalled: AtomicBool::new(false),
            direct_writes: super::direct_write::DirectWrites::new(),
            request_spin: RequestSpinPolicy::default(),
            engine: OnceLock::new(),
            parts: Box::default(),
            counters: sent_slot.map(|_| Box::default()),
            sent_slot: sent_slot.unwrap_or(crate::primitives::stats::SHARED_SLOT),
        })
    }

    /// Attaches the engine's half of this connection; false if one is
    /// attached already (a connection is set up once).
    pub fn attach_engine<T: Any + Send + Sync>(&self, half: &Arc<T>) -> bool {
        let weak: Weak<dyn Any + Send + Sync> = Arc::downgrade(half) as Weak<dyn Any + Send + Sync>;
        self.engine.set(weak).is_ok()
    }

    /// The engine's half of this connection, if attached, still held by
    /// the engine, and of type `T`.
    #[inline]
    pub fn engine<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        self.engine.get()?.upgrade()?.downcast::<T>().ok()
    }

    /// Current state.
    pub fn state(&self) -> ConnState {
        match self.state.load(Ordering::Acquire) {
            0 => ConnState::Connecting,
            1 => ConnState::Open,
            _ => ConnState::Closed,
        }
    }

    /// True unless closed.
    pub fn is_alive(&self) -> bool {
        self.state() != ConnState::Closed
    }

    /// Connecting → Open, recording the peer's instance id; false if the
    /// connection was closed meanwhile.
    pub fn mark_open(&self, peer_instance: u64) -> bool {
        self.peer_instance.store(peer_instance, Ordering::Release);
        let ok = self
            .state
            .compare_exchange(
                ConnState::Connecting as u8,
                ConnState::Open as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
            || self.state() == ConnState::Open;
        self.state_changed.notify_all();
        ok
    }

    /// Moves to Closed (the first reason sticks); returns the state it
    /// closed from, `None` if it was closed already.
    pub fn close(&self, reason: &str) -> Option<ConnState> {
        let prev = self.state.swap(ConnState::Closed as u8, Ordering::AcqRel);
        if prev == ConnState::Closed as u8 {
            return None;
        }
        *self.close_reason.lock() = Some(reason.to_string());
        for r in self.rings() {
            r.close();
        }
        self.flow.wake_all();
        self.state_changed.notify_all();
        Some(if prev == ConnState::Open as u8 {
            ConnState::Open
        } else {
            ConnState::Connecting
        })
    }

    /// Why the connection closed.
    pub fn close_reason(&self) -> String {
        self.close_reason
            .lock()
            .clone()
            .unwrap_or_else(|| "connection closed".into())
    }

    /// Notes that the peer refused this connection as from a node it does
    /// not know (the engine's handshake was rejected so), before the
    /// connection closes.
    pub fn set_refused_as_unknown(&self) {
        self.refused_as_unknown.store(true, Ordering::Release);
    }

    /// Whether the peer refused this connection as from a node it does not
    /// know.
    pub fn refused_as_unknown(&self) -> bool {
        self.refused_as_unknown.load(Ordering::Acquire)
    }

    /// The outgoing rings, the first one first.
    pub fn rings(&self) -> impl Iterator<Item = &Orb> {
        std::iter::once(&self.orb).chain(self.more_rings.iter())
    }

    /// Ring `i` (0: `orb`).
    pub fn ring(&self, i: usize) -> &Orb {
        if i == 0 {
            &self.orb
        } else {
            &self.more_rings[i - 1]
        }
    }

    /// How many outgoing rings the connection has.
    pub fn ring_count(&self) -> usize {
        1 + self.more_rings.len()
    }

    /// The ring the calling thread writes its next message into (an index
    /// for [`Connection::ring`]; after the write, report where the message
    /// ended with [`Connection::note_written`]).
    ///
    /// The ring of the CPU the thread runs on, so the threads of one core
    /// share a ring whose lines stay in that core's cache, while threads on
    /// different cores never write the same lines. A thread that moved to
    /// another CPU keeps its old ring until every message it wrote there
    /// was written out (its order: a later message must not overtake an
    /// earlier one in another ring); each thread remembers, per connection,
    /// its ring and where its last message there ends (see [`RingUse`]).
    /// With one ring every message is ordered after
    /// those whose sends returned before its own began; with several, only
    /// after the same thread's. `cpu` is the calling thread's CPU
    /// ([`crate::primitives::cpu::current`]).
    #[inline]
    pub fn ring_for_thread(&self, cpu: usize) -> usize {
        if self.more_rings.is_empty() {
            return 0;
        }
        let count = self.ring_count();
        // Without a cheap CPU number `cpu` only tells threads apart: the
        // fixed ring does that already.
        let want = if cfg!(all(target_os = "linux", not(loom))) {
            cpu % count
        } else {
            thread_ring(count)
        };
        // The connection of a displaced entry, if `settled` found it alive:
        // dropped after the entry's borrow ends (its last reference may go
        // with it, and with the connection whatever it holds).
        let mut displaced = None;
        let r = RING_USE.try_with(|table| {
            let mut e = table[self.id as usize % RING_MEMORY].borrow_mut();
            if e.conn == self.id {
                if usize::from(e.ring) == want {
                    return want;
                }
                if !self.ring(usize::from(e.ring)).completed_through(e.end) {
                    return usize::from(e.ring);
                }
                // Everything this thread wrote into its old ring is out:
                // it has nothing in the new one.
                e.ring = want as u8;
                e.end = 0;
                return want;
            }
            // No entry: whatever this thread has not had written out yet
            // sits in its fixed ring (entries leave only when settled).
            let fixed = thread_ring(count);
            if e.conn != 0 && !e.settled(&mut displaced) {
                return fixed;
            }
            let end = self.ring(fixed).reserved_end();
            let ring = if self.ring(fixed).completed_through(end) {
                want
            } else {
                fixed
            };
            *e = RingUse {
                conn: self.id,
                end: if ring == fixed { end } else { 0 },
                ring: ring as u8,
                owner: self.me.clone(),
            };
            ring
        });
        drop(displaced);
        let r = r.unwrap_or_else(|_| self.ring_after_teardown(thread_ring(count)));
        let bit = 1u32 << r;
        // Set before the thread's first reservation in the ring: the send
        // thread, woken by that message's write interest, finds it. A
        // thread that finds the bit set was ordered after its setting
        // through this load, and the send thread after this thread.
        if self.rings_in_use.load(Ordering::Relaxed) & bit == 0 {
            self.rings_in_use.fetch_or(bit, Ordering::Release);
        }
        r
    }

    /// The ring of a thread whose ring entries are gone: a send from a
    /// thread-local destructor that runs after theirs. Its fixed ring,
    /// once everything in the other rings when it asks is written out (or
    /// the connection closed): nothing of its can be left there then.
    #[cold]
    fn ring_after_teardown(&self, fixed: usize) -> usize {
        for r in (0..self.ring_count()).filter(|&r| r != fixed) {
            let end = self.ring(r).reserved_end();
            while !self.ring(r).completed_through(end) && self.is_alive() {
                std::thread::yield_now();
            }
        }
        fixed
    }

    /// Records that the calling thread's message in ring `ring` (as
    /// chosen by [`Connection::ring_for_thread`]) ends at `end`.
    #[inline]
    pub fn note_written(&self, ring: usize, end: u64) {
        if self.more_rings.is_empty() {
            return;
        }
        // Without the table (thread teardown) the thread has no entry.
        let _ = RING_USE.try_with(|table| {
            let mut e = table[self.id as usize % RING_MEMORY].borrow_mut();
            if e.conn == self.id && usize::from(e.ring) == ring && end > e.end {
                e.end = end;
            }
        });
    }

    /// The rings a thread wrote into so far (bit `r`: ring `r`; ring 0
    /// always): a ring outside it holds no data.
    #[inline]
    pub fn rings_in_use(&self) -> u32 {
        self.rings_in_use.load(Ordering::Acquire)
    }

    /// The peer's instance id (from the handshake).
    pub fn peer_instance(&self) -> u64 {
        self.peer_instance.load(Ordering::Acquire)
    }

    /// Records use at `tick` (coarse time, for least-recently-used closing).
    #[inline]
    pub fn touch(&self, tick: u64) {
        if self.last_used.load(Ordering::Relaxed) != tick {
            self.last_used.store(tick, Ordering::Relaxed);
        }
    }

    /// Takes ownership of this connection's received data if nothing is
    /// queued and nobody owns it (see [`Inbox::take_if_idle`]).
    pub fn take_if_idle(self: &Arc<Self>) -> Option<Owned> {
        self.inbox
            .lock()
            .take_if_idle()
            .then(|| Owned(self.clone()))
    }

    /// True if nothing is queued to send or to process.
    pub fn is_idle(&self) -> bool {
        self.rings().all(|r| r.is_empty()) && self.inbox.lock().is_empty()
    }

    /// Last use tick.
    pub fn last_used(&self) -> u64 {
        self.last_used.load(Ordering::Relaxed)
    }
}

/// The size of each of `rings` outgoing rings sharing `orb_size` bytes:
/// the largest power of two within an equal share, at least 4 KiB. The
/// rings of all connections stay within the caches about as one ring
/// would (a ring's lines are written again only after the whole ring
/// went round).
pub fn ring_capacity(orb_size: usize, rings: usize) -> usize {
    let share = (orb_size / rings.max(1)).max(4096);
    1 << share.ilog2()
}

/// A thread's entry for one connection with several rings: the ring its
/// last message went into and where that message ends. Invariant: for a
/// connection without an entry, everything of the thread's not yet written
/// out is in its fixed ring ([`thread_ring`]), so an entry may be dropped
/// only when it is settled ([`RingUse::settled`]).
#[derive(Debug)]
struct RingUse {
    /// Connection id (0: empty; ids start at 1, unique in the process).
    conn: u64,
    /// Position in the ring after the thread's last message there.
    end: u64,
    /// Ring index.
    ring: u8,
    /// The connection, whichever node it belongs to. Weak: an entry keeps
    /// no connection alive (only the memory of the `Arc` that held it, at
    /// most one per entry).
    owner: Weak<Connection>,
}

impl RingUse {
    /// Whether the thread may forget this entry: nothing of its is
    /// unwritten outside its fixed ring, or the connection can no longer
    /// send (gone or closed: what it had unwritten is written out or lost
    /// with it, and a successor connection has entries of its own). The
    /// connection, if alive, is left in `keep`, for the caller to drop
    /// once it no longer borrows the entry.
    fn settled(&self, keep: &mut Option<Arc<Connection>>) -> bool {
        *keep = self.owner.upgrade();
        let Some(c) = keep else {
            return true;
        };
        c.state() == ConnState::Closed
            || usize::from(self.ring) == thread_ring(c.ring_count())
            || c.ring(usize::from(self.ring)).completed_through(self.end)
    }
}

/// Entries per thread, direct-mapped by connection id (ids given out one
/// after another take different entries).
const RING_MEMORY: usize = 64;

thread_local! {
    static RING_USE: [RefCell<RingUse>; RING_MEMORY] = const {
        [const {
            RefCell::new(RingUse {
                conn: 0,
                end: 0,
                ring: 0,
                owner: Weak::new(),
            })
        }; RING_MEMORY]
    };
}

/// This thread's fixed ring among a connection's `count` rings (where it
/// writes while it has no [`RingUse`] entry): threads take them in turn
/// as they first send. Each thread keeps its ring for every
/// possible count (a division per message would cost about a tenth of a
/// small message's send).
#[inline]
fn thread_ring(count: usize) -> usize {
    use crate::config::MAX_RINGS;
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static RING_OF_COUNT: [u8; MAX_RINGS + 1] = {
            let index = NEXT.fetch_add(1, Ordering::Relaxed);
            std::array::from_fn(|n| index.checked_rem(n).unwrap_or(0) as u8)
        };
    }
    RING_OF_COUNT.with(|r| r.get(count).map_or(0, |&i| usize::from(i)))
}

/// Open connections by peer id: lookup without a locked instruction on the
/// send path (a [`HazardTable`]), creation and removal serialized by a
/// lock.
pub struct ConnectionTable {
    /// One slot per possible peer id.
    slots: HazardTable<Connection>,
    /// Serializes creation, replacement and removal; holds the count.
    pub lock: Mutex<usize>,
    /// The last connection made per peer, also after it left the table
    /// (closed): a new one is held behind it while it has data (see
    /// [`Inbox::hold_successor`]). Weak: nothing is kept alive for it.
    last: Mutex<std::collections::HashMap<u16, std::sync::Weak<Connection>>>,
}

impl std::fmt::Debug for ConnectionTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionTable")
            .field("count", &*self.lock.lock())
            .finish()
    }
}

impl Default for ConnectionTable {
    fn default() -> Self {
        Self {
            slots: HazardTable::new(u16::MAX as usize + 1),
            lock: Mutex::new(0),
            last: Mutex::new(std::collections::HashMap::new()),
        }
    }
}

impl ConnectionTable {
    /// The current connection to `peer`, if any.
    #[inline]
    pub fn get(&self, peer: NodeId) -> Option<Arc<Connection>> {
        self.slots.get(peer.0 as usize)
    }

    /// The current connection to `peer` without touching its reference
    /// count (the send hot path: no locked instruction per message); the
    /// connection stays alive while the guard lives.
    #[inline]
    pub fn guard(&self, peer: NodeId) -> Option<Guard<'_, Connection>> {
        self.slots.protect(peer.0 as usize)
    }

    /// A fresh connection id, unique in the process: a thread's ring
    /// entries ([`RingUse`]) tell connections of different nodes apart
    /// by it.
    pub fn next_id(&self) -> u64 {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }

    /// Records `conn` as the newest connection to its peer; returns the one
    /// before it if that one still exists (caller holds `lock`).
    pub fn succeed(&self, conn: &Arc<Connection>) -> Option<Arc<Connection>> {
        let mut last = self.last.lock();
        last.retain(|_, w| w.strong_count() > 0);
        last.insert(conn.peer.0, Arc::downgrade(conn))
            .and_then(|w| w.upgrade())
    }

    /// Installs `conn` (caller holds `lock`, passing the guarded count).
    pub fn install(&self, count: &mut usize, conn: Arc<Connection>) {
        let peer = conn.peer.0 as usize;
        if !self.slots.replace(peer, Some(conn)) {
            *count += 1;
        }
    }

    /// Removes `conn` if it is still the installed one (caller holds `lock`).
    pub fn remove_if_current(&self, count: &mut usize, conn: &Connection) -> bool {
        let peer = conn.peer.0 as usize;
        let current = self.slots.protect(peer).is_some_and(|c| c.id == conn.id);
        if current {
            self.slots.replace(peer, None);
            *count -= 1;
        }
        current
    }

    /// All installed connections (a snapshot).
    pub fn all(&self) -> Vec<Arc<Connection>> {
        self.slots.all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inbox_ownership_protocol() {
        let mut inbox = Inbox::default();
        assert!(inbox.take_if_idle(), "an idle connection can be taken");
        assert!(!inbox.take_if_idle(), "but only once");
        assert!(
            matches!(inbox.release_unless_queued(), Ok(None)),
            "released: nothing queued"
        );
        assert!(inbox.push(Incoming::Local(vec![1; 10])), "push schedules");
        assert!(!inbox.push(Incoming::Local(vec![2; 5])), "once");
        assert!(!inbox.take_if_idle(), "scheduled: not idle");
        assert_eq!((inbox.len(), inbox.bytes()), (2, 15));
        assert!(matches!(inbox.pop_or_release(), Ok(Incoming::Local(v)) if v.len() == 10));
        assert!(inbox.pop_or_release().is_ok());
        assert!(
            matches!(inbox.pop_or_release(), Err(None)),
            "empty: ownership ends"
        );
        assert!(inbox.take_if_idle(), "and the connection is idle again");
    }

    fn conn(id: u64) -> Arc<Connection> {
        Connection::new(
            NodeId(1),
            id,
            (4096, 1),
            crate::core::flow::FlowControl::new(1 << 20, 1 << 16),
            1 << 20,
            None,
        )
    }

    /// Pins the calling thread to `cpu`; false if it may not run there.
    #[cfg(target_os = "linux")]
    fn pin(cpu: usize) -> bool {
        // SAFETY: a zeroed `cpu_set_t` is a valid empty set; the calls get
        // its size and address, and `0` names the calling thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) == 0
                && libc::sched_getcpu() == cpu as i32
        }
    }

    /// Two CPUs this process may use whose rings differ among 4.
    #[cfg(target_os = "linux")]
    fn two_cpus() -> Option<(usize, usize)> {
        // SAFETY: as in `pin`; the kernel fills the set.
        let allowed: Vec<usize> = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) != 0 {
                return None;
            }
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect()
        };
        let first = *allowed.first()?;
        let second = *allowed.iter().find(|&&c| c % 4 != first % 4)?;
        Some((first, second))
    }

    /// Writes one 64-byte message the way the send path does: into the
    /// ring the thread is given, noting where it ended.
    fn write_one(c: &Connection) -> usize {
        use crate::primitives::deadline::Deadline;
        use std::io::Write as _;
        let r = c.ring_for_thread(crate::primitives::cpu::current());
        let deadline = Deadline::at(std::time::Instant::now() + std::time::Duration::from_secs(30));
        let end = c
            .ring(r)
            .write_message(64, &deadline, &|| {}, |w| w.write_all(&[7; 64]))
            .unwrap();
        c.note_written(r, end);
        r
    }

    /// A connection with four rings of 4 KiB.
    fn four_rings(id: u64) -> Arc<Connection> {
        Connection::new(
            NodeId(1),
            id,
            (4 * 4096, 4),
            crate::core::flow::FlowControl::new(1 << 20, 1 << 16),
            1 << 20,
            None,
        )
    }

    /// Takes everything written into ring `r` as written out.
    fn drain(c: &Connection, r: usize, cons: &mut crate::primitives::orb::Consumer) {
        let n = c.ring(r).unposted_len(cons);
        c.ring(r).mark_posted(cons, n);
        c.ring(r).mark_completed(cons, n);
    }

    /// The connection id of the calling thread's entry in slot `slot`.
    fn entry_conn(slot: usize) -> u64 {
        RING_USE.with(|t| t[slot].borrow().conn)
    }

    /// A thread writes into its CPU's ring, and moves to another CPU's
    /// ring only once everything it wrote into the old one is written out
    /// (its order across rings); the entry that remembers this is given up
    /// to another connection only when settled, and meanwhile that one
    /// uses the thread's fixed ring.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_thread_changes_rings_only_once_its_messages_are_out() {
        let Some((c0, c1)) = two_cpus() else {
            eprintln!("skipped: needs two CPUs");
            return;
        };
        // A fresh thread: an empty table of ring entries, and pinning that
        // leaves the test harness alone.
        std::thread::spawn(move || {
            let mk = four_rings;
            // Same entry slot: ids `RING_MEMORY` apart.
            let (a, b) = (mk(1), mk(1 + RING_MEMORY as u64));
            let mut consumers: Vec<_> = (0..4).map(|i| a.ring(i).consumer().unwrap()).collect();
            assert!(pin(c0));
            let r0 = write_one(&a);
            assert_eq!(r0, c0 % 4, "the CPU's ring");
            assert!(pin(c1));
            assert_eq!(
                write_one(&a),
                r0,
                "its messages in the old ring are not out: it stays"
            );
            drain(&a, r0, &mut consumers[r0]);
            let r1 = write_one(&a);
            assert_eq!(r1, c1 % 4, "all out: it moves to its CPU's ring");

            let fixed = thread_ring(4);
            let mut b_consumers: Vec<_> = (0..4).map(|i| b.ring(i).consumer().unwrap()).collect();
            if r1 != fixed {
                // `a`'s entry holds unwritten data outside `a`'s fixed ring.
                assert_eq!(write_one(&b), fixed, "no entry for b: its fixed ring");
                assert_eq!(entry_conn(1), a.id, "a's entry stays");
                drain(&a, r1, &mut consumers[r1]);
            }
            // `a` settled: `b` takes the slot, still in its fixed ring
            // while its message there is unwritten.
            assert_eq!(write_one(&b), fixed);
            assert_eq!(entry_conn(1), b.id);
            drain(&b, fixed, &mut b_consumers[fixed]);
            assert_eq!(write_one(&b), c1 % 4, "out: b moves to the CPU's ring");
        })
        .join()
        .unwrap();
    }

    /// An entry whose connection closed or is gone is settled, whatever it
    /// left unwritten: another connection takes its slot (as connections
    /// of several nodes in one process do, whose ids are unique).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_closed_or_dropped_connection_gives_its_entry_up() {
        let Some((c0, c1)) = two_cpus() else {
            eprintln!("skipped: needs two CPUs");
            return;
        };
        std::thread::spawn(move || {
            let mk = four_rings;
            let fixed = thread_ring(4);
            // A CPU whose ring is not the fixed one: the entry then holds
            // data outside the fixed ring, unwritten.
            let cpu = if c0 % 4 != fixed { c0 } else { c1 };
            assert!(pin(cpu));
            let slot = 3;
            let (a, b, c) = (
                mk(slot as u64),
                mk((slot + RING_MEMORY) as u64),
                mk((slot + 2 * RING_MEMORY) as u64),
            );
            assert_eq!(write_one(&a), cpu % 4);
            assert_eq!(write_one(&b), fixed, "a unsettled: b in its fixed ring");
            assert_eq!(entry_conn(slot), a.id);
            a.close("test");
            write_one(&b);
            assert_eq!(entry_conn(slot), b.id, "a closed: b takes the slot");
            // b's entry names its fixed ring (settled); once that is
            // written out b moves to the CPU's ring, where its unwritten
            // message leaves the entry unsettled.
            let mut b_cons = b.ring(fixed).consumer().unwrap();
            drain(&b, fixed, &mut b_cons);
            assert_eq!(write_one(&b), cpu % 4, "b in the CPU's ring");
            assert_eq!(write_one(&c), fixed, "b unsettled: c in its fixed ring");
            drop(b);
            write_one(&c);
            assert_eq!(entry_conn(slot), c.id, "b gone: c takes the slot");
        })
        .join()
        .unwrap();
    }

    /// A new connection to a peer waits for the data its predecessor still
    /// has: queued, it is not scheduled until the predecessor's owner
    /// releases it and hands the successor over.
    #[test]
    fn successor_is_held_until_its_predecessor_is_done() {
        let (old, new) = (conn(1), conn(2));
        assert!(
            !old.inbox.lock().hold_successor(&new),
            "an idle predecessor holds nothing"
        );
        assert!(old.inbox.lock().push(Incoming::Local(vec![1; 3])));
        let newer = conn(3);
        assert!(old.inbox.lock().hold_successor(&new));
        assert!(
            !new.inbox.lock().push(Incoming::Local(vec![2; 3])),
            "held: not scheduled"
        );
        assert!(!new.inbox.lock().take_if_idle(), "held: not taken idle");
        assert!(old.inbox.lock().pop_or_release().is_ok());
        match old.inbox.lock().pop_or_release() {
            Err(Some(s)) => assert_eq!(s.id, 2, "the successor is handed over"),
            other => panic!("{other:?}"),
        }
        assert!(new.inbox.lock().unhold(), "unheld with data: schedule it");
        assert!(
            new.inbox.lock().hold_successor(&newer),
            "its data holds the next one"
        );
        assert!(!newer.inbox.lock().push(Incoming::Local(vec![3; 3])));
    }

    #[test]
    fn inbox_decode_ahead_keeps_the_byte_count() {
        let mut inbox = Inbox::default();
        inbox.push(Incoming::Local(vec![0; 7]));
        inbox.push(Incoming::Local(vec![0; 9]));
        assert!(!inbox.set_owner_blocked(true));
        assert!(inbox.set_owner_blocked(true), "already blocked");
        let drained = inbox.drain();
        assert_eq!((drained.len(), inbox.bytes()), (2, 0));
        assert_eq!(inbox.push_decoded(vec![0; 12]), None, "a new item");
        assert_eq!(inbox.push_decoded(vec![0; 4]), Some(12), "appended to it");
        assert_eq!((inbox.len(), inbox.bytes()), (1, 16));
        assert!(
            inbox.release_unless_queued().is_err(),
            "queued items keep the owner"
        );
    }
}
