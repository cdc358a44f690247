//! Cheap counters for hot paths: one set of cells per thread, each written
//! only by its own thread, summed when read.
//!
//! A send adds to two counters per message. As atomic read-modify-writes
//! (even striped over cache lines) they would be two locked instructions
//! per message, each a full barrier that waits for the message's bytes to
//! leave the store buffer (in a profile of 16 senders, a third of the
//! sender's time in `send_raw`). A cell
//! with a single writer needs only a plain load and store; readers (the
//! `stats()` snapshot) sum the cells of every thread that ever counted.
//! Per-thread storage comes from the `thread_local` crate (lookup without
//! locked instructions; a thread's cells are reused by a later thread that
//! gets its id, which keeps adding to them, so no count is lost).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crossbeam::utils::CachePadded;
use parking_lot::Mutex;
use thread_local::ThreadLocal;

/// One cell written by a single thread (the owner of the `ThreadLocal`
/// entry holding it) and read by any.
#[derive(Debug, Default)]
pub(crate) struct OwnedCell(AtomicU64);

impl OwnedCell {
    /// Adds `n`. Only the owning thread calls this, so a load and a store
    /// (no read-modify-write) cannot lose an update.
    #[inline]
    pub(crate) fn add(&self, n: u64) {
        self.0.store(
            self.0.load(Ordering::Relaxed).wrapping_add(n),
            Ordering::Relaxed,
        );
    }

    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Sets the value. Only the owning thread calls this.
    #[inline]
    fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }
}

/// A counter that many threads add to and few read.
#[derive(Default)]
pub struct Counter {
    cells: ThreadLocal<CachePadded<OwnedCell>>,
}

impl Counter {
    /// Adds `n`.
    #[inline]
    pub fn add(&self, n: u64) {
        self.cells.get_or_default().add(n);
    }

    /// The sum (not a snapshot across threads; fine for statistics).
    pub fn get(&self) -> u64 {
        self.cells.iter().map(|c| c.get()).sum()
    }
}

/// Messages and their bytes, counted together (one per-thread lookup for
/// both).
#[derive(Default)]
pub struct Traffic {
    cells: ThreadLocal<CachePadded<[OwnedCell; 2]>>,
}

impl Traffic {
    /// Adds `messages` messages of `bytes` bytes in total.
    #[inline]
    pub fn add(&self, messages: u64, bytes: u64) {
        let c = self.cells.get_or_default();
        c[0].add(messages);
        c[1].add(bytes);
    }

    /// Messages counted so far.
    pub fn messages(&self) -> u64 {
        self.cells.iter().map(|c| c[0].get()).sum()
    }

    /// Bytes counted so far.
    pub fn bytes(&self) -> u64 {
        self.cells.iter().map(|c| c[1].get()).sum()
    }
}

/// Slots per thread of [`SentTraffic`]: while at most this many
/// connections are open, each has a slot of its own and no send evicts.
pub const SENT_SLOTS: usize = 64;

/// One connection's messages and bytes as counted by one thread.
#[derive(Debug, Default)]
struct SentSlot {
    /// The connection's id; 0: empty.
    conn: OwnedCell,
    messages: OwnedCell,
    bytes: OwnedCell,
}

/// One thread's cells of [`SentTraffic`].
#[derive(Debug)]
struct SentCells {
    /// Messages and bytes not counted per connection.
    total: [OwnedCell; 2],
    /// Per connection, direct-mapped by id.
    slots: [SentSlot; SENT_SLOTS],
}

impl Default for SentCells {
    fn default() -> Self {
        Self {
            total: Default::default(),
            slots: std::array::from_fn(|_| SentSlot::default()),
        }
    }
}

/// Messages and bytes sent, by the node and (when
/// [`SentTraffic::count_per_connection`] is on) by connection, at the cost
/// of the node-wide count alone: a send updates one slot of its own
/// thread's cells, which also counts for the node. Each open connection
/// holds a slot index of its own ([`SentTraffic::take_slot`]) while fewer
/// than [`SENT_SLOTS`] are open; beyond, connections share slots by id. A
/// thread that finds another connection in a slot (a shared slot, or one
/// handed on after a close) first moves that one's counts to a shared map
/// under its lock; readers sum under the same lock, so they never see
/// counts in both places.
#[derive(Default)]
pub struct SentTraffic {
    cells: ThreadLocal<CachePadded<SentCells>>,
    per_connection: AtomicBool,
    evicted: Mutex<Evicted>,
    /// Slot indices no open connection holds (filled at the first take).
    free_slots: Mutex<Option<Vec<u32>>>,
}

/// A connection's slot index when it has none of its own: shared by id.
pub const SHARED_SLOT: u32 = u32::MAX;

/// Counts moved out of threads' slots.
#[derive(Debug, Default)]
struct Evicted {
    /// Of connections that may still be open.
    by_conn: HashMap<u64, (u64, u64)>,
    /// Of connections known to be gone.
    retired: (u64, u64),
}

impl Evicted {
    fn totals(&self) -> (u64, u64) {
        self.by_conn
            .values()
            .fold(self.retired, |(m, b), v| (m + v.0, b + v.1))
    }
}

impl SentTraffic {
    /// Counts per connection from now on (set before any send).
    pub fn count_per_connection(&self, on: bool) {
        self.per_connection.store(on, Ordering::Relaxed);
    }

    /// A slot index for a new connection: its own while fewer than
    /// [`SENT_SLOTS`] connections hold one, else [`SHARED_SLOT`].
    pub fn take_slot(&self) -> u32 {
        let mut f = self.free_slots.lock();
        let free = f.get_or_insert_with(|| (0..SENT_SLOTS as u32).rev().collect());
        free.pop().unwrap_or(SHARED_SLOT)
    }

    /// Gives back the slot index of a connection that closed.
    pub fn give_slot(&self, slot: u32) {
        if (slot as usize) < SENT_SLOTS {
            if let Some(free) = self.free_slots.lock().as_mut() {
                free.push(slot);
            }
        }
    }

    fn index(conn: u64, slot: u32) -> usize {
        if (slot as usize) < SENT_SLOTS {
            slot as usize
        } else {
            conn as usize % SENT_SLOTS
        }
    }

    /// Adds one message of `bytes` sent on connection `conn` holding slot
    /// index `slot` (`conn` 0: not a connection to count, e.g. the node's
    /// own local queue).
    #[inline]
    pub fn add(&self, conn: u64, slot: u32, bytes: u64) {
        let c = self.cells.get_or_default();
        if !self.per_connection.load(Ordering::Relaxed) || conn == 0 {
            c.total[0].add(1);
            c.total[1].add(bytes);
            return;
        }
        let s = &c.slots[Self::index(conn, slot)];
        if s.conn.get() != conn {
            self.evict(s, conn);
        }
        s.messages.add(1);
        s.bytes.add(bytes);
    }

    /// Moves the counts of the connection in `s` to the shared map and
    /// gives the slot to `conn`, all under the lock readers take.
    #[cold]
    fn evict(&self, s: &SentSlot, conn: u64) {
        let mut e = self.evicted.lock();
        let (held, m, b) = (s.conn.get(), s.messages.get(), s.bytes.get());
        if held != 0 && m > 0 {
            let x = e.by_conn.entry(held).or_default();
            x.0 += m;
            x.1 += b;
        }
        s.messages.set(0);
        s.bytes.set(0);
        s.conn.set(conn);
        drop(e);
    }

    /// Messages counted so far (all connections).
    pub fn messages(&self) -> u64 {
        let e = self.evicted.lock();
        self.sum(|c| c.total[0].get() + c.slots.iter().map(|s| s.messages.get()).sum::<u64>())
            + e.totals().0
    }

    /// Bytes counted so far (all connections).
    pub fn bytes(&self) -> u64 {
        let e = self.evicted.lock();
        self.sum(|c| c.total[1].get() + c.slots.iter().map(|s| s.bytes.get()).sum::<u64>())
            + e.totals().1
    }

    /// Messages and bytes counted for connection `conn` holding slot index
    /// `slot` (zero unless counting per connection).
    pub fn of_connection(&self, conn: u64, slot: u32) -> (u64, u64) {
        let e = self.evicted.lock();
        let mut m = 0;
        let mut b = 0;
        for c in self.cells.iter() {
            let s = &c.slots[Self::index(conn, slot)];
            if s.conn.get() == conn {
                m += s.messages.get();
                b += s.bytes.get();
            }
        }
        let moved = e.by_conn.get(&conn).copied().unwrap_or_default();
        (m + moved.0, b + moved.1)
    }

    /// Whether counts of some connection were moved to the shared map (so
    /// that closes know whether [`SentTraffic::retain`] has work).
    pub fn any_moved(&self) -> bool {
        !self.evicted.lock().by_conn.is_empty()
    }

    /// Keeps moved counts by connection only for the connections `live`
    /// says are open (the others' go into the node's total): called when
    /// connections close, so the map stays as small as the open set plus
    /// what moved since.
    pub fn retain(&self, live: impl Fn(u64) -> bool) {
        let mut e = self.evicted.lock();
        let Evicted { by_conn, retired } = &mut *e;
        by_conn.retain(|id, v| {
            let keep = live(*id);
            if !keep {
                retired.0 += v.0;
                retired.1 += v.1;
            }
            keep
        });
    }

    fn sum(&self, f: impl Fn(&SentCells) -> u64) -> u64 {
        self.cells.iter().map(|c| f(c)).sum()
    }
}

impl std::fmt::Debug for SentTraffic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentTraffic")
            .field("messages", &self.messages())
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.get())
    }
}

impl std::fmt::Debug for Traffic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Traffic")
            .field("messages", &self.messages())
            .field("bytes", &self.bytes())
            .finish()
    }
}

/// Counters of one node.
#[derive(Debug, Default)]
pub struct Stats {
    /// Messages sent, and their bytes (header + payload), also per
    /// connection with `metrics.per_connection`.
    pub sent: SentTraffic,
    /// Messages dispatched, and their bytes.
    pub received: Traffic,
    /// Connections opened.
    pub connections_opened: Counter,
    /// Connections closed.
    pub connections_closed: Counter,
    /// Messages with no receiver.
    pub unknown_messages: Counter,
    /// Received buffers handled on a receive thread (inline handling).
    pub inline_buffers: Counter,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Threads sending round-robin to 100 connections: 64 hold slots of
    /// their own, 36 share slots by id (so counts move to the shared map);
    /// then a closed connection's slot goes to a new one. Every
    /// connection's counts and the totals are exact once senders are done,
    /// also after closed connections' counts are retired.
    #[test]
    fn sent_per_connection_with_shared_and_reused_slots() {
        let sent = Arc::new(SentTraffic::default());
        sent.count_per_connection(true);
        let conns = 100u64;
        let slots: Arc<Vec<u32>> = Arc::new((0..conns).map(|_| sent.take_slot()).collect());
        assert_eq!(slots.iter().filter(|&&s| s == SHARED_SLOT).count(), 36);
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let (sent, slots) = (Arc::clone(&sent), Arc::clone(&slots));
                std::thread::spawn(move || {
                    for i in 0..5_000u64 {
                        let conn = 1 + (i + t) % conns;
                        sent.add(conn, slots[conn as usize - 1], conn);
                    }
                    // The own queue (id 0) is counted for the node only.
                    sent.add(0, SHARED_SLOT, 1000);
                })
            })
            .collect();
        for h in threads {
            h.join().unwrap();
        }
        let per = 8 * 5_000 / conns;
        let of = |conn: u64| sent.of_connection(conn, slots[conn as usize - 1]);
        for conn in 1..=conns {
            assert_eq!(of(conn), (per, per * conn), "conn {conn}");
        }
        let mut bytes: u64 = (1..=conns).map(|c| per * c).sum::<u64>() + 8 * 1000;
        assert_eq!((sent.messages(), sent.bytes()), (8 * 5_001, bytes));
        assert!(sent.any_moved());
        // Connection 1 closes; its slot goes to connection 101.
        sent.give_slot(slots[0]);
        let reused = sent.take_slot();
        assert_eq!(reused, slots[0]);
        sent.add(101, reused, 7);
        assert_eq!(sent.of_connection(101, reused), (1, 7));
        assert_eq!(of(1), (per, per));
        bytes += 7;
        sent.retain(|id| id % 2 == 0);
        assert_eq!((sent.messages(), sent.bytes()), (8 * 5_001 + 1, bytes));
        assert_eq!(of(2), (per, per * 2));
        // Without per-connection counting nothing is kept by connection.
        let off = SentTraffic::default();
        off.add(7, 0, 10);
        assert_eq!((off.of_connection(7, 0), off.messages()), ((0, 0), 1));
    }

    /// Many more threads than cores, in waves: each wave starts after the
    /// one before exited, so its threads reuse the cells of exited ones.
    /// Every addition is in the sums.
    #[test]
    fn sums_every_threads_additions() {
        let stats = Arc::new(Stats::default());
        for wave in 0..4u64 {
            let threads: Vec<_> = (0..16u64)
                .map(|t| {
                    let stats = Arc::clone(&stats);
                    std::thread::spawn(move || {
                        for i in 0..10_000u64 {
                            stats.sent.add(0, SHARED_SLOT, i % 7 + wave + t);
                            stats.unknown_messages.add(2);
                        }
                    })
                })
                .collect();
            for h in threads {
                h.join().unwrap();
            }
        }
        let per_thread: u64 = (0..10_000u64).map(|i| i % 7).sum();
        let expected_bytes: u64 = (0..4u64)
            .flat_map(|wave| (0..16u64).map(move |t| per_thread + 10_000 * (wave + t)))
            .sum();
        assert_eq!(stats.sent.messages(), 64 * 10_000);
        assert_eq!(stats.sent.bytes(), expected_bytes);
        assert_eq!(stats.unknown_messages.get(), 64 * 20_000);
        assert_eq!(stats.received.messages(), 0);
    }
}
