//! Connection events: made where connections open and close, handed to the
//! application by the events thread (see [`crate::events`]).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam::channel::{Receiver, Sender, TrySendError};
use parking_lot::{Mutex, RwLock};

use super::Core;
use crate::events::{ConnectionEvent, ConnectionEvents};
use crate::primitives::mailbox::{Mailbox, PushError};
use crate::{Error, NodeId, Result};

/// Events waiting for the events thread.
const QUEUE: usize = 1024;

type EventFn = Box<dyn Fn(ConnectionEvent) + Send + Sync>;
/// A registered callback (shared: the events thread calls a snapshot of
/// them without holding the lock, so a callback may subscribe more).
type SharedFn = Arc<dyn Fn(ConnectionEvent) + Send + Sync>;

/// A channel subscriber and what it missed.
struct ChannelSub {
    mailbox: Arc<Mailbox<ConnectionEvent>>,
    dropped: Arc<AtomicU64>,
}

/// Subscribers, the queue to the events thread, and the instance id each
/// peer had last (restart detection).
#[derive(Default)]
pub struct Events {
    /// Set with the first subscription: before, nothing is made.
    active: AtomicBool,
    tx: RwLock<Option<Sender<ConnectionEvent>>>,
    callbacks: RwLock<Vec<SharedFn>>,
    channels: Mutex<Vec<ChannelSub>>,
    /// Events dropped because the queue was full.
    pub dropped: AtomicU64,
    instances: Mutex<HashMap<u16, u64>>,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events")
            .field("active", &self.active.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Core {
    /// Hands `ev` to the events thread without waiting (dropped and counted
    /// if its queue is full).
    pub(super) fn emit(&self, ev: ConnectionEvent) {
        if !self.events.active.load(Ordering::Acquire) {
            return;
        }
        if let Some(tx) = &*self.events.tx.read() {
            if let Err(TrySendError::Full(_)) = tx.try_send(ev) {
                self.events.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// A connection to `peer` opened with the peer's `instance`.
    pub(super) fn emit_opened(&self, peer: NodeId, instance: u64) {
        // Kept even without subscribers: a later subscriber still learns
        // of restarts.
        let before = self.events.instances.lock().insert(peer.0, instance);
        self.emit(ConnectionEvent::Connected { node: peer });
        if before.is_some_and(|b| b != instance) {
            self.emit(ConnectionEvent::Restarted { node: peer });
        }
    }

    /// Adds a callback subscriber.
    pub fn on_connection_event(self: &Arc<Self>, f: EventFn) -> Result<()> {
        self.events.callbacks.write().push(Arc::from(f));
        self.start_events()
    }

    /// Adds a channel subscriber of `capacity` events.
    pub fn connection_events(self: &Arc<Self>, capacity: usize) -> Result<ConnectionEvents> {
        let mailbox = Arc::new(Mailbox::new(capacity));
        let dropped = Arc::new(AtomicU64::new(0));
        self.events.channels.lock().push(ChannelSub {
            mailbox: mailbox.clone(),
            dropped: dropped.clone(),
        });
        self.start_events()?;
        Ok(ConnectionEvents { mailbox, dropped })
    }

    /// Starts the events thread once.
    fn start_events(self: &Arc<Self>) -> Result<()> {
        let mut slot = self.events.tx.write();
        if slot.is_some() || self.events.active.load(Ordering::Acquire) {
            return Ok(());
        }
        if self.is_shut_down() {
            return Err(Error::Shutdown);
        }
        let (tx, rx) = crossbeam::channel::bounded(QUEUE);
        let core = Arc::downgrade(self);
        let handle = std::thread::Builder::new()
            .name(format!("dxnet-events-{}", self.own.0))
            .spawn(move || events_loop(core, rx))
            .map_err(|e| Error::Config(format!("cannot spawn the events thread: {e}")))?;
        self.threads.lock().push(handle);
        *slot = Some(tx);
        self.events.active.store(true, Ordering::Release);
        Ok(())
    }

    /// Ends the events thread once the events already made are handed out.
    pub(super) fn stop_events(&self) {
        self.events.tx.write().take();
    }
}

fn events_loop(core: std::sync::Weak<Core>, rx: Receiver<ConnectionEvent>) {
    while let Ok(ev) = rx.recv() {
        let Some(core) = core.upgrade() else { return };
        let callbacks: Vec<SharedFn> = core.events.callbacks.read().clone();
        for f in &callbacks {
            if std::panic::catch_unwind(AssertUnwindSafe(|| f(ev.clone()))).is_err() {
                tracing::error!("{}: connection event callback panicked", core.own);
            }
        }
        core.events
            .channels
            .lock()
            .retain(|c| match c.mailbox.try_push(ev.clone()) {
                Ok(()) => true,
                Err(PushError::Full(_)) => {
                    c.dropped.fetch_add(1, Ordering::Relaxed);
                    true
                }
                // The subscriber dropped its end.
                Err(PushError::Closed(_)) => false,
            });
    }
    // The node shut down: channel subscribers get what is queued, then the
    // end.
    if let Some(core) = core.upgrade() {
        for c in core.events.channels.lock().drain(..) {
            c.mailbox.close(false);
        }
    }
}
