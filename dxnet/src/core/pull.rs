//! The runtime side of pull receivers (`crate::pull`): the handler-table
//! entry of a pulled type, which the application's receiver fills and
//! clears, and the typed queue the handler threads decode into.

use std::sync::Arc;

use arc_swap::ArcSwapOption;

use super::*;
use crate::primitives::mailbox::Mailbox;
use crate::pull::PullReceiver;

/// What a handler thread does with one message of a pulled type.
pub(crate) enum Offered {
    /// Decoded and queued.
    Queued,
    /// The receiver is gone (dropped, or the node shuts down).
    Gone,
    /// The payload is not a valid message of the type.
    Undecodable(Error),
}

/// A receiver's typed queue, seen without its type.
pub(crate) trait PullSink: Send + Sync {
    /// Decodes `payload` and queues it, waiting while the queue is full.
    fn offer(&self, src: NodeId, payload: &[u8]) -> Offered;
    /// Ends the receiver (node shutdown): waiting handlers return.
    fn close(&self);
}

struct TypedSink<M> {
    mailbox: Arc<Mailbox<(NodeId, M)>>,
}

impl<M: Message> PullSink for TypedSink<M> {
    fn offer(&self, src: NodeId, payload: &[u8]) -> Offered {
        match codec::decode::<M>(payload) {
            Ok(m) => match self.mailbox.push_wait((src, m)) {
                Ok(()) => Offered::Queued,
                Err(_) => Offered::Gone,
            },
            Err(e) => Offered::Undecodable(e.into()),
        }
    }

    fn close(&self) {
        self.mailbox.close(false);
    }
}

/// The handler-table entry of a type registered for pulling: it stays in
/// the table for good (the table's entries are set once); the receiver
/// behind it comes and goes.
#[derive(Default)]
pub(crate) struct PullSlot {
    sink: ArcSwapOption<Box<dyn PullSink>>,
    /// Serializes registering (a check, then a store).
    register: Mutex<()>,
}

impl PullSlot {
    /// The current receiver's queue, if one is registered.
    pub(super) fn sink(&self) -> Option<Arc<Box<dyn PullSink>>> {
        self.sink.load_full()
    }

    /// Unregisters (the receiver was dropped).
    pub(crate) fn clear(&self) {
        self.sink.store(None);
    }
}

impl Core {
    /// Registers a pull receiver of `M` holding up to `capacity` messages.
    pub fn register_pull<M: Message>(&self, capacity: usize) -> Result<PullReceiver<M>> {
        if M::TYPE == 0 {
            return Err(Error::Config("message type 0 is reserved for dxnet".into()));
        }
        if capacity == 0 {
            return Err(Error::Config(
                "a pull receiver needs a capacity of at least 1".into(),
            ));
        }
        let entry =
            self.handlers[type_key(M::TYPE, M::SUBTYPE) as usize].get_or_init(|| HandlerEntry {
                kind: HandlerKind::Pull(Arc::new(PullSlot::default())),
                mode: Mode::Ordered,
            });
        let HandlerKind::Pull(slot) = &entry.kind else {
            return Err(Error::AlreadyRegistered(M::TYPE, M::SUBTYPE));
        };
        let _guard = slot.register.lock();
        // Under the lock that `close_pull_receivers` takes too: a receiver
        // registered now is either closed by it or refused here.
        if self.is_shut_down() {
            return Err(Error::Shutdown);
        }
        if slot.sink.load().is_some() {
            return Err(Error::AlreadyRegistered(M::TYPE, M::SUBTYPE));
        }
        let mailbox = Arc::new(Mailbox::new(capacity));
        let sink: Box<dyn PullSink> = Box::new(TypedSink {
            mailbox: mailbox.clone(),
        });
        slot.sink.store(Some(Arc::new(sink)));
        Ok(PullReceiver::new(mailbox, slot.clone()))
    }

    /// Ends every pull receiver (at shutdown): handler threads waiting for
    /// room return, consumers get what is queued and then the end.
    pub(super) fn close_pull_receivers(&self) {
        for entry in self.handlers.iter().filter_map(|h| h.get()) {
            if let HandlerKind::Pull(slot) = &entry.kind {
                let _guard = slot.register.lock();
                if let Some(sink) = slot.sink() {
                    sink.close();
                }
            }
        }
    }
}
