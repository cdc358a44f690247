//! Connection events for the application: a connection opened, a peer
//! came back after a restart, a connection closed or broke.
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
//! network.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam::channel::{Receiver, RecvTimeoutError, TryRecvError};

use crate::error::Unreachable;
use crate::NodeId;

/// Something that happened to the connection to a node.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectionEvent {
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
            ConnectionEvent::Connected { node }
            | ConnectionEvent::Restarted { node }
            | ConnectionEvent::Closed { node, .. }
            | ConnectionEvent::Lost { node, .. } => *node,
        }
    }
}

/// A subscription to a node's connection events as a bounded channel
/// ([`crate::Node::connection_events`]); dropping it unsubscribes.
#[derive(Debug)]
pub struct ConnectionEvents {
    pub(crate) rx: Receiver<ConnectionEvent>,
    pub(crate) dropped: Arc<AtomicU64>,
}

/// Why no event was received.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EventsEnded {
    /// No event within the time given (or none waiting, for `try_recv`).
    #[error("no connection event yet")]
    Empty,
    /// The node shut down: no event will come.
    #[error("the node shut down")]
    Shutdown,
}

impl ConnectionEvents {
    /// The next event; blocks until one comes or the node shuts down.
    pub fn recv(&self) -> Result<ConnectionEvent, EventsEnded> {
        self.rx.recv().map_err(|_| EventsEnded::Shutdown)
    }

    /// The next event within `timeout`.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<ConnectionEvent, EventsEnded> {
        self.rx.recv_timeout(timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => EventsEnded::Empty,
            RecvTimeoutError::Disconnected => EventsEnded::Shutdown,
        })
    }

    /// The next event if one is waiting.
    pub fn try_recv(&self) -> Result<ConnectionEvent, EventsEnded> {
        self.rx.try_recv().map_err(|e| match e {
            TryRecvError::Empty => EventsEnded::Empty,
            TryRecvError::Disconnected => EventsEnded::Shutdown,
        })
    }

    /// Events as they come, until the node shuts down.
    pub fn iter(&self) -> impl Iterator<Item = ConnectionEvent> + '_ {
        self.rx.iter()
    }

    /// Events this subscription missed because it was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}
