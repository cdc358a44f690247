//! Pull receivers: take messages of one type when the application wants
//! them, instead of having a callback run on a handler thread.
//!
//! ```no_run
//! # #[derive(serde::Serialize, serde::Deserialize)] struct Row(u64);
//! # impl dxnet::Message for Row { const TYPE: u8 = 9; const SUBTYPE: u8 = 0; }
//! # fn demo(node: &dxnet::Node) -> dxnet::Result<()> {
//! let rows = node.receiver::<Row>(1024)?;
//! for (from, row) in rows.iter() {
//!     println!("{from}: {}", row.0);
//! }
//! # Ok(()) }
//! ```
//!
//! A handler thread decodes each message of the type and puts it into the
//! receiver's queue, which holds at most `capacity` messages. When the
//! queue is full, the handler thread waits for room: the rest of that
//! connection's messages wait behind it (messages of one connection are
//! handled in order), its flow-control window is not given back, and the
//! sender blocks once the window is used up, so a slow consumer slows its
//! senders down and nothing is dropped. Memory stays bounded by the
//! capacity plus one flow-control window per connection. While it waits,
//! the handler thread lets others take its work (as any blocking wait in a
//! handler does): responses on that connection still complete, other
//! connections are handled by the other handler threads. A consumer that
//! stops taking messages for good therefore holds up its senders'
//! connections; drop the receiver to stop.
//!
//! Messages come in per-connection order; with several consumers (the
//! receiver is `Clone` and `Sync`) each takes the next message, so
//! consumers see interleaved subsequences.
//!
//! Dropping the last handle unregisters the type: messages still queued
//! are dropped, later ones are counted in `NodeStats::unknown_messages`
//! and discarded as for a type nobody registered, and
//! [`crate::Node::receiver`] may register the type again. At node
//! shutdown the receiver hands out what is queued, then ends
//! ([`RecvError::Shutdown`], the iterator and the stream end).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::core::pull::PullSlot;
use crate::primitives::mailbox::{Mailbox, PopError};
use crate::NodeId;

/// Why no message (or event) was received.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecvError {
    /// Nothing within the time given (or nothing waiting, for `try_recv`).
    #[error("nothing received yet")]
    Empty,
    /// The node shut down (or the subscription ended): nothing will come.
    #[error("the node shut down")]
    Shutdown,
}

impl From<PopError> for RecvError {
    fn from(e: PopError) -> Self {
        match e {
            PopError::Empty => RecvError::Empty,
            PopError::Closed => RecvError::Shutdown,
        }
    }
}

/// What the application holds; the last handle's drop unregisters.
struct Shared<M> {
    mailbox: Arc<Mailbox<(NodeId, M)>>,
    slot: Arc<PullSlot>,
}

impl<M> Drop for Shared<M> {
    fn drop(&mut self) {
        self.slot.clear();
        self.mailbox.close(true);
    }
}

/// Messages of type `M` to take (see the [module docs](self)); from
/// [`crate::Node::receiver`]. Clone it to take from several threads.
pub struct PullReceiver<M> {
    shared: Arc<Shared<M>>,
}

impl<M> Clone for PullReceiver<M> {
    fn clone(&self) -> Self {
        PullReceiver {
            shared: self.shared.clone(),
        }
    }
}

impl<M> std::fmt::Debug for PullReceiver<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PullReceiver")
            .field("queued", &self.shared.mailbox.len())
            .field("capacity", &self.shared.mailbox.capacity())
            .finish()
    }
}

impl<M: Send + 'static> PullReceiver<M> {
    pub(crate) fn new(mailbox: Arc<Mailbox<(NodeId, M)>>, slot: Arc<PullSlot>) -> Self {
        PullReceiver {
            shared: Arc::new(Shared { mailbox, slot }),
        }
    }

    /// The next message and its sender; blocks until one comes or the node
    /// shuts down.
    pub fn recv(&self) -> Result<(NodeId, M), RecvError> {
        Ok(self.shared.mailbox.pop_wait(None)?)
    }

    /// The next message within `timeout`.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<(NodeId, M), RecvError> {
        Ok(self
            .shared
            .mailbox
            .pop_wait(Some(Instant::now() + timeout))?)
    }

    /// The next message if one is waiting.
    pub fn try_recv(&self) -> Result<(NodeId, M), RecvError> {
        Ok(self.shared.mailbox.try_pop()?)
    }

    /// The next message as a future (runtime-agnostic); `None` once the
    /// node shut down and the queue is empty.
    pub fn recv_async(&self) -> Recv<'_, M> {
        Recv {
            mailbox: &self.shared.mailbox,
        }
    }

    /// Messages as they come, blocking, until the node shuts down.
    pub fn iter(&self) -> impl Iterator<Item = (NodeId, M)> + '_ {
        std::iter::from_fn(move || self.recv().ok())
    }

    /// The messages waiting now, without blocking.
    pub fn try_iter(&self) -> impl Iterator<Item = (NodeId, M)> + '_ {
        std::iter::from_fn(move || self.try_recv().ok())
    }

    /// Messages queued now.
    pub fn len(&self) -> usize {
        self.shared.mailbox.len()
    }

    /// True if no message is queued.
    pub fn is_empty(&self) -> bool {
        self.shared.mailbox.is_empty()
    }

    /// The most messages it queues before handlers wait.
    pub fn capacity(&self) -> usize {
        self.shared.mailbox.capacity()
    }
}

impl<M: Send + 'static> futures_core::Stream for PullReceiver<M> {
    type Item = (NodeId, M);
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.shared.mailbox.poll_pop(cx)
    }
}

/// The future of [`PullReceiver::recv_async`].
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub struct Recv<'a, M> {
    mailbox: &'a Mailbox<(NodeId, M)>,
}

impl<M> Future for Recv<'_, M> {
    type Output = Option<(NodeId, M)>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.mailbox.poll_pop(cx)
    }
}
