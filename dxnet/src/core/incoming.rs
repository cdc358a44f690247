//! The bounded incoming buffer queue shared by all connections.
//!
//! Transports push received buffers into their connection's inbox; a
//! connection with data is queued once in the ready queue; handler threads
//! take a connection, process its buffers in order, and give it back. So
//! messages of one connection are handled in order, different connections in
//! parallel. Limits on queued buffers and bytes (over all connections) make
//! receivers stop reading when handlers fall behind: memory stays bounded and
//! back-pressure reaches the senders (TCP window, RDMA flow control).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam::queue::SegQueue;

use crate::core::connection::{Connection, Incoming, Owned};
use crate::primitives::park::Signal;

/// The ready queue, limits and wake-up signal of the handler threads.
#[derive(Debug)]
pub struct IncomingQueue {
    ready: SegQueue<Owned>,
    buffers: AtomicUsize,
    bytes: AtomicUsize,
    max_buffers: usize,
    max_bytes: usize,
    /// Most buffers and bytes queued at once since start (for stats).
    peak_buffers: AtomicUsize,
    peak_bytes: AtomicUsize,
    starved: AtomicBool,
    /// Handler threads park on this.
    pub handlers: Signal,
}

impl IncomingQueue {
    /// A queue holding at most `max_buffers` buffers and `max_bytes` bytes.
    pub fn new(max_buffers: usize, max_bytes: usize) -> Self {
        Self {
            ready: SegQueue::new(),
            buffers: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            max_buffers,
            max_bytes,
            peak_buffers: AtomicUsize::new(0),
            peak_bytes: AtomicUsize::new(0),
            starved: AtomicBool::new(false),
            handlers: Signal::new(),
        }
    }

    /// True if one more buffer fits. A receiver checks this before reading;
    /// when false it stops and is woken once handlers drained some.
    pub fn has_room(&self) -> bool {
        if self.buffers.load(Ordering::Acquire) < self.max_buffers
            && self.bytes.load(Ordering::Acquire) < self.max_bytes
        {
            return true;
        }
        self.starved.store(true, Ordering::SeqCst);
        // Handlers may have drained between the check and the flag.
        self.buffers.load(Ordering::SeqCst) < self.max_buffers
            && self.bytes.load(Ordering::SeqCst) < self.max_bytes
    }

    #[cfg_attr(not(feature = "tcp"), allow(dead_code))]
    /// True if `conn` holds a quarter of either limit: its receiver should
    /// not read more of it until handlers drained some (they wake the
    /// receiver then, as for [`IncomingQueue::has_room`]). So one connection
    /// (e.g. a peer ignoring flow control whose requests are slow to answer)
    /// cannot fill the queue and stop the reception of every other one.
    ///
    /// While the connection's handler is blocked inside dxnet (decode-ahead,
    /// see `Core::owner_blocking`) its queued data is one item, which never
    /// counts as over the share by number (however small the queue): the
    /// response the handler waits for may be behind it, so reading goes
    /// on, bounded by bytes. (Found as a rare 3 s request timeout in
    /// `tests/inline.rs` under CPU load: with 4 buffers queued when the
    /// handler blocked, the connection stayed over its share and its
    /// response was never read.)
    pub fn over_share(&self, conn: &Connection) -> bool {
        let over = || {
            let inbox = conn.inbox.lock();
            let n = inbox.len();
            (n >= (self.max_buffers / 4).max(1) && !(inbox.owner_blocked() && n <= 1))
                || inbox.bytes() >= (self.max_bytes / 4).max(1)
        };
        if !over() {
            return false;
        }
        self.starved.store(true, Ordering::SeqCst);
        // Handlers may have drained between the check and the flag.
        over()
    }

    /// Appends `item` to `conn`'s inbox and schedules the connection; gives
    /// the item back if the connection's handler is blocked (the caller
    /// decodes it then, see [`crate::core::connection::Inbox::owner_blocked`]).
    pub fn push(&self, conn: &Arc<Connection>, item: Incoming) -> Option<Incoming> {
        let len = item.data_len();
        let schedule = {
            let mut inbox = conn.inbox.lock();
            if inbox.owner_blocked() && !matches!(item, Incoming::Decoded(_)) {
                return Some(item);
            }
            self.count_in(len);
            inbox.push(item)
        };
        if schedule {
            self.ready.push(Owned::new_scheduled(conn.clone()));
            self.handlers.notify_one();
        }
        None
    }

    /// Accounts for an item appended to an inbox directly (by the decode-ahead
    /// of a connection whose handler holds it).
    pub fn added(&self, len: usize) {
        self.count_in(len);
    }

    /// Counts one queued item of `len` bytes, keeping the peaks.
    fn count_in(&self, len: usize) {
        let buffers = self.buffers.fetch_add(1, Ordering::AcqRel) + 1;
        let bytes = self.bytes.fetch_add(len, Ordering::AcqRel) + len;
        // A load first: the peak rarely moves, so this stays a read.
        if buffers > self.peak_buffers.load(Ordering::Relaxed) {
            self.peak_buffers.fetch_max(buffers, Ordering::Relaxed);
        }
        if bytes > self.peak_bytes.load(Ordering::Relaxed) {
            self.peak_bytes.fetch_max(bytes, Ordering::Relaxed);
        }
    }

    /// Most buffers and bytes queued at once since start.
    pub fn peaks(&self) -> (usize, usize) {
        (
            self.peak_buffers.load(Ordering::Relaxed),
            self.peak_bytes.load(Ordering::Relaxed),
        )
    }

    /// Accounts for `n` queued items merged into others (the count drops).
    pub fn merged(&self, n: usize) {
        if n > 0 {
            self.buffers.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Accounts for queued items whose bytes changed from `old` to `new`
    /// (decoded ahead, see [`Incoming::Decoded`]).
    pub fn resized(&self, old: usize, new: usize) {
        if new >= old {
            self.bytes.fetch_add(new - old, Ordering::AcqRel);
        } else {
            self.bytes.fetch_sub(old - new, Ordering::AcqRel);
        }
    }

    /// Ends the hold of `conn` (its predecessor is done, see
    /// [`crate::core::connection::Inbox::hold_successor`]) and schedules it
    /// if it has data.
    pub fn unhold(&self, conn: Arc<Connection>) {
        if conn.inbox.lock().unhold() {
            self.ready.push(Owned::new_scheduled(conn));
            self.handlers.notify_one();
        }
    }

    /// Puts a connection that still has data back in the ready queue (a
    /// handler used up its budget on it; round-robin fairness).
    pub fn reschedule(&self, conn: Owned) {
        self.ready.push(conn);
        self.handlers.notify_one();
    }

    /// The next connection with data, now owned by the caller until its inbox
    /// is empty (see [`IncomingQueue::next_item`]) or it is rescheduled.
    pub fn pop_ready(&self) -> Option<Owned> {
        self.ready.pop()
    }

    /// True if no connection is waiting for a handler.
    pub fn is_idle(&self) -> bool {
        self.ready.is_empty()
    }

    /// The next buffer of a connection the caller owns; `None` ends the
    /// ownership (the connection is unscheduled under the inbox lock). The
    /// second value tells whether a starved receiver must be woken.
    pub fn next_item(&self, conn: &Owned) -> (Option<Incoming>, bool) {
        let popped = conn.inbox.lock().pop_or_release();
        let item = match popped {
            Ok(it) => Some(it),
            Err(successor) => {
                if let Some(s) = successor {
                    self.unhold(s);
                }
                None
            }
        };
        let mut wake = false;
        if let Some(it) = &item {
            self.buffers.fetch_sub(1, Ordering::AcqRel);
            self.bytes.fetch_sub(it.data_len(), Ordering::AcqRel);
            wake =
                self.starved.load(Ordering::SeqCst) && self.starved.swap(false, Ordering::SeqCst);
        }
        (item, wake)
    }
}
