//! Connection events for the application: discovery found a node or two
//! nodes claiming one id, a connection opened, a peer came back after a
//! restart, a connection closed or broke.
//!
//! ```no_run
//! # fn demo(node: &dxnet::Node) -> dxnet::Result<()> {
//! use dxnet::events::ConnectionEvent;
//! // As a callback ...
//! node.on_connection_event(|e| println!("{e:?}"))?;
//! // ... or as a bounded channel.
//! let events = node.connection_events(256)?;
//! while let Ok(e) = events.recv() {
//!     if let ConnectionEvent::Lost { node, .. } = e { eprintln!("{node} lost"); }
//! }
//! # Ok(()) }
//! ```
//!
//! Events are made by the network threads, which never wait for the
//! application: they put each event into a bounded queue (1024) that a
//! thread of the node (`dxnet-events-N`, started with the first
//! subscription) empties, calling the callbacks in registration order and
//! offering the event to every channel. An event finds a full queue only
//! when callbacks are slow; it is then dropped and counted in
//! `NodeStats::events_dropped`. A channel that is full drops the event for
//! that channel alone and counts it ([`ConnectionEvents::dropped`]); a
//! dropped [`ConnectionEvents`] unsubscribes. Per node, events come in the
//! order they happened; a callback runs on the events thread, so a slow or
//! blocking callback delays later events (of every subscriber), never the
//! network. [`ConnectionEvents`] is also an async `Stream`
//! (`futures_core::Stream`), which ends at shutdown.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::primitives::mailbox::Mailbox;

use crate::error::Unreachable;
use crate::NodeId;

/// Something that happened to the connection to a node.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectionEvent {
    /// Discovery found `node` (it answered a probe or probed this node):
    /// it can be connected to now. Made only with discovery on, again
    /// after each loss.
    Discovered {
        /// The peer.
        node: NodeId,
    },
    /// Two nodes claim id `node`: the one at `address` and another one
    /// (this node, or the one this node knew first). Neither takes over
    /// the other: this node keeps the one it knew, and the node map should
    /// be fixed.
    DuplicateId {
        /// The disputed id.
        node: NodeId,
        /// The address of the other claimant.
        address: String,
    },
    /// A connection to `node` opened (this node dialed, or accepted it).
    Connected {
        /// The peer.
        node: NodeId,
    },
    /// `node` came back with a new instance id: it restarted since its
    /// last connection (follows that connection's `Connected`).
    Restarted {
        /// The peer.
        node: NodeId,
    },
    /// The connection closed without a failure: this node closed it
    /// (least-recently-used closing at the connection limit, shutdown) or
    /// the peer closed it in order.
    Closed {
        /// The peer.
        node: NodeId,
        /// Why, for people.
        reason: String,
    },
    /// The connection broke (peer gone, protocol error, no progress): its
    /// pending requests failed with this cause; the next send reconnects.
    Lost {
        /// The peer.
        node: NodeId,
        /// The cause, as the failed requests saw it.
        cause: Unreachable,
    },
}

impl ConnectionEvent {
    /// The node the event is about.
    pub fn node(&self) -> NodeId {
        match self {
            ConnectionEvent::Discovered { node }
            | ConnectionEvent::DuplicateId { node, .. }
            | ConnectionEvent::Connected { node }
            | ConnectionEvent::Restarted { node }
            | ConnectionEvent::Closed { node, .. }
            | ConnectionEvent::Lost { node, .. } => *node,
        }
    }
}

/// A subscription to a node's connection events as a bounded channel
/// ([`crate::Node::connection_events`]), also an async `Stream`; dropping
/// it unsubscribes.
#[derive(Debug)]
pub struct ConnectionEvents {
    pub(crate) mailbox: Arc<Mailbox<ConnectionEvent>>,
    pub(crate) dropped: Arc<AtomicU64>,
}

/// Why no event was received: the error of pull receivers.
pub type EventsEnded = crate::RecvError;

impl ConnectionEvents {
    /// The next event; blocks until one comes or the node shuts down.
    pub fn recv(&self) -> Result<ConnectionEvent, EventsEnded> {
        Ok(self.mailbox.pop_wait(None)?)
    }

    /// The next event within `timeout`.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<ConnectionEvent, EventsEnded> {
        Ok(self.mailbox.pop_wait(Some(Instant::now() + timeout))?)
    }

    /// The next event if one is waiting.
    pub fn try_recv(&self) -> Result<ConnectionEvent, EventsEnded> {
        Ok(self.mailbox.try_pop()?)
    }

    /// Events as they come, until the node shuts down.
    pub fn iter(&self) -> impl Iterator<Item = ConnectionEvent> + '_ {
        std::iter::from_fn(move || self.recv().ok())
    }

    /// Events this subscription missed because it was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

impl futures_core::Stream for ConnectionEvents {
    type Item = ConnectionEvent;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<ConnectionEvent>> {
        self.mailbox.poll_pop(cx)
    }
}

impl Drop for ConnectionEvents {
    fn drop(&mut self) {
        self.mailbox.close(true);
    }
}
