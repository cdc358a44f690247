//! The runtime as transport engines see it: the buffer pool, the
//! write-interest queue and the incoming queue's limits, behind methods, so
//! the runtime's fields stay private to it.
//!
//! Everything an engine may call on [`Core`] is here or in the other
//! engine-facing files: [`Core::deliver`] / [`Core::deliver_or_inline`] /
//! [`Core::run_inline`] and [`Core::on_write_interest`] (`receive.rs`),
//! [`Core::accept_incoming`] / [`Core::opened`] /
//! [`Core::close_connection`] (`connections.rs`), and the read-only
//! accessors (`config`, `park`, `own_id`, `instance`, `fc_window`,
//! `fc_unit`, `identity`).

use super::*;

impl Core {
    /// This node's hello for a handshake with `target` (0 as the
    /// acceptor): ids, instance, flow-control window and unit, a fresh
    /// nonce, and the transport's `endpoint` (zeros where it has none).
    #[cfg(any(feature = "tcp", feature = "ib"))]
    pub fn hello(
        &self,
        target: u16,
        endpoint: [u8; crate::proto::wire::ENDPOINT_LEN],
    ) -> crate::proto::wire::Hello {
        crate::proto::wire::Hello {
            node_id: self.own_id().0,
            target_id: target,
            instance: self.instance,
            fc_window: self.fc_window.min(u32::MAX as u64) as u32,
            fc_unit: self.fc_unit.min(u32::MAX as u64) as u32,
            nonce: rand::random(),
            codec: crate::proto::codec::CODEC_ID,
            endpoint,
        }
    }

    /// A free receive buffer; `None` when all are in use: the engine stops
    /// receiving until [`Transport::wake_receiver`] says some came back.
    #[inline]
    pub fn take_recv_buffer(&self) -> Option<RecvBuffer> {
        self.pool.get()
    }

    /// Gives back a receive buffer the engine took and will not deliver.
    #[inline]
    pub fn return_recv_buffer(&self, buf: RecvBuffer) {
        self.give_back(buf);
    }

    /// Free receive buffers now.
    #[inline]
    pub fn recv_buffers_available(&self) -> usize {
        self.pool.available()
    }

    /// Start and length of the memory all receive buffers live in (for an
    /// RDMA engine's one memory registration).
    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    pub fn recv_arena(&self) -> (*mut u8, usize) {
        self.pool.arena()
    }

    /// The next connection (peer id) with data or confirmations to send,
    /// round-robin; each is queued at most once.
    #[inline]
    pub fn next_write_interest(&self) -> Option<u16> {
        self.wim.pop()
    }

    /// Threads of this node blocked for a response now (see
    /// [`crate::core::requests::RequestTable::blocked`]).
    #[inline]
    pub fn blocked_requesters(&self) -> usize {
        self.requests.blocked()
    }

    /// Whether no connection waits for the send thread.
    #[inline]
    pub fn write_interest_is_empty(&self) -> bool {
        self.wim.is_empty()
    }

    /// Queues `peer`'s connection again (it has more to send than one
    /// round); true if it was not queued already (then the send thread may
    /// need a wake-up).
    #[inline]
    pub fn requeue_write_interest(&self, peer: u16) -> bool {
        self.wim.push(peer)
    }

    /// Whether the incoming queue takes one more buffer; when false the
    /// engine stops receiving (reading sockets, posting receives) until
    /// [`Transport::wake_receiver`].
    #[inline]
    pub fn incoming_has_room(&self) -> bool {
        self.incoming.has_room()
    }

    /// Whether `conn` holds its share of the incoming queue: an engine that
    /// can stop receiving from one connection (TCP) reads the others until
    /// handlers drained it (see [`IncomingQueue::over_share`]).
    #[cfg_attr(not(feature = "tcp"), allow(dead_code))]
    #[inline]
    pub fn incoming_over_share(&self, conn: &Connection) -> bool {
        self.incoming.over_share(conn)
    }

    /// Until when a shutting-down engine may finish writing and close its
    /// connections gracefully (now, if shutdown has not begun).
    pub fn linger_until(&self) -> Instant {
        self.linger_until
            .get()
            .copied()
            .unwrap_or_else(Instant::now)
    }

    /// The engine's half (see [`Connection::engine`]) of the current
    /// connection to `peer`.
    #[inline]
    pub fn engine_half<T: std::any::Any + Send + Sync>(&self, peer: NodeId) -> Option<Arc<T>> {
        self.connections.guard(peer).as_ref()?.engine::<T>()
    }
}
