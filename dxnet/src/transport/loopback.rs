//! In-process transport: nodes of one process, in the same named fabric,
//! exchange data by copying ring-buffer contents straight into the peer's
//! pooled receive buffers. It runs the whole core pipeline (ring buffers,
//! write interest, send thread, incoming queue, flow control, handlers)
//! without sockets, for tests and for measuring the pipeline alone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::core::connection::{ConnState, Connection};
use crate::core::Core;
use crate::primitives::orb::Consumer;
use crate::primitives::park::Signal;
use crate::proto::wire::Status;
use crate::transport::cannot_connect;
use crate::transport::driver::{run_send_loop, SendSide};
use crate::transport::{EngineThreads, Transport, STANDALONE_FRAME_MAX};
use crate::{Error, NodeId, Result};

/// Buffers one send-thread round moves for a connection before it serves
/// the next (round-robin fairness).
const ROUND_BUFFERS: usize = 8;

/// Nodes of one fabric, by id.
#[derive(Default)]
struct Fabric {
    nodes: Mutex<HashMap<u16, Weak<LoopbackEngine>>>,
    /// Serializes connection set-up between the fabric's nodes.
    connect_lock: Mutex<()>,
    /// Bumped when any node frees receive resources: stalled senders retry.
    resource_epoch: AtomicU64,
}

static FABRICS: LazyLock<Mutex<HashMap<String, Arc<Fabric>>>> = LazyLock::new(Default::default);

/// One direction of a connection: our connection object and the peer's.
struct Link {
    local: Arc<Connection>,
    remote: Arc<Connection>,
    remote_engine: Weak<LoopbackEngine>,
    /// Held while moving data to the peer (the send thread's round, a
    /// standalone frame): deliveries of one direction stay in order. It
    /// holds `local`'s ring-buffer consumer role.
    send: Mutex<Consumer>,
}

/// The loopback engine of one node.
pub struct LoopbackEngine {
    core: Weak<Core>,
    own: NodeId,
    fabric: Arc<Fabric>,
    links: Mutex<HashMap<u16, Arc<Link>>>,
    signal: Signal,
    stop: AtomicBool,
    threads: EngineThreads,
}

/// Starts the loopback engine of `core` and joins its fabric.
pub fn start(core: &Arc<Core>) -> Result<Arc<dyn Transport>> {
    let cfg = core.config();
    let fabric = FABRICS
        .lock()
        .entry(cfg.loopback.fabric.clone())
        .or_default()
        .clone();
    let own = core.own_id();
    let engine = Arc::new(LoopbackEngine {
        core: Arc::downgrade(core),
        own,
        fabric: fabric.clone(),
        links: Mutex::new(HashMap::new()),
        signal: Signal::new(),
        stop: AtomicBool::new(false),
        threads: EngineThreads::default(),
    });
    {
        let mut nodes = fabric.nodes.lock();
        if nodes.get(&own.0).is_some_and(|w| w.strong_count() > 0) {
            return Err(Error::Transport(format!(
                "node id {} already runs in loopback fabric '{}'",
                own.0, cfg.loopback.fabric
            )));
        }
        nodes.insert(own.0, Arc::downgrade(&engine));
    }
    let e = engine.clone();
    let c = core.clone();
    if let Err(e) = engine
        .threads
        .spawn(format!("dxnet-lo-send-{}", own.0), move || {
            let mut side = LoopbackSender {
                seen_epoch: e.fabric.resource_epoch.load(Ordering::Acquire),
                engine: e,
                stalled: Vec::new(),
            };
            run_send_loop(&mut side, &c);
        })
    {
        engine.shutdown();
        return Err(e);
    }
    Ok(engine)
}

/// The loopback engine's part of its send thread: moving ring contents
/// to the peer, and the connections stalled on the peer's receive
/// resources (taken up again when the fabric's resources change).
struct LoopbackSender {
    engine: Arc<LoopbackEngine>,
    stalled: Vec<u16>,
    seen_epoch: u64,
}

impl SendSide for LoopbackSender {
    fn stopping(&self) -> bool {
        self.engine.stop.load(Ordering::Acquire)
    }

    fn round(&mut self, core: &Core) {
        let epoch = self.engine.fabric.resource_epoch.load(Ordering::Acquire);
        if epoch != self.seen_epoch && !self.stalled.is_empty() {
            self.seen_epoch = epoch;
            for p in self.stalled.drain(..) {
                core.requeue_write_interest(p);
            }
        }
    }

    fn write(&mut self, core: &Core, peer: u16) {
        if self.engine.pump(core, peer) {
            self.stalled.push(peer);
        }
    }

    fn idle(&mut self, core: &Core, park: Option<Duration>) -> bool {
        let Some(max) = park else {
            return false;
        };
        let e = &self.engine;
        e.signal.park_unless(
            || {
                !core.write_interest_is_empty()
                    || e.stop.load(Ordering::Acquire)
                    || (!self.stalled.is_empty()
                        && e.fabric.resource_epoch.load(Ordering::Acquire) != self.seen_epoch)
            },
            max,
        );
        false
    }
}

impl LoopbackEngine {
    /// Moves `peer`'s ring-buffer data and confirmations to the peer. Returns
    /// true if it stalled for lack of receive resources at the peer.
    fn pump(&self, core: &Core, peer: u16) -> bool {
        let Some(link) = self.links.lock().get(&peer).cloned() else {
            return false;
        };
        if !link.local.is_alive() {
            return false;
        }
        let units = link.local.flow.take_units(u32::MAX);
        link.remote.flow.on_confirm(units);
        let Some(rcore) = link.remote_engine.upgrade().and_then(|e| e.core.upgrade()) else {
            return false;
        };
        let orb = &link.local.orb;
        let mut consumer = link.send.lock();
        for _ in 0..ROUND_BUFFERS {
            if orb.unposted_len(&mut consumer) == 0 {
                return false;
            }
            if !rcore.incoming_has_room() {
                return true;
            }
            let Some(mut buf) = rcore.take_recv_buffer() else {
                return true;
            };
            let cap = buf.capacity();
            // The slices are copied before `mark_completed` below frees
            // their bytes.
            let (a, b) = orb.unposted(&mut consumer, cap);
            let n = a.len() + b.len();
            let space = buf.space();
            space[..a.len()].copy_from_slice(a);
            space[a.len()..n].copy_from_slice(b);
            buf.push_segment(0..n);
            orb.mark_posted(&mut consumer, n);
            orb.mark_completed(&mut consumer, n);
            rcore.deliver(&link.remote, buf);
        }
        // More data than one round: serve the others first.
        core.requeue_write_interest(peer);
        false
    }
}

impl Transport for LoopbackEngine {
    fn connect(&self, conn: &Arc<Connection>, deadline: Instant) -> Result<()> {
        let core = self.core.upgrade().ok_or(Error::Shutdown)?;
        let peer = conn.peer;
        let guard = self.fabric.connect_lock.lock();
        let remote_engine = self
            .fabric
            .nodes
            .lock()
            .get(&peer.0)
            .and_then(Weak::upgrade)
            .ok_or_else(|| cannot_connect(peer, "no such node in the loopback fabric"))?;
        let rcore = remote_engine
            .core
            .upgrade()
            .ok_or_else(|| cannot_connect(peer, "node shut down"))?;
        match rcore.accept_incoming(self.own, core.instance) {
            Ok(rconn) => {
                let (Some(consumer), Some(rconsumer)) = (conn.orb.consumer(), rconn.orb.consumer())
                else {
                    return Err(cannot_connect(
                        peer,
                        "a connection's ring buffer already has a consumer",
                    ));
                };
                self.links.lock().insert(
                    peer.0,
                    Arc::new(Link {
                        local: conn.clone(),
                        remote: rconn.clone(),
                        remote_engine: Arc::downgrade(&remote_engine),
                        send: Mutex::new(consumer),
                    }),
                );
                remote_engine.links.lock().insert(
                    self.own.0,
                    Arc::new(Link {
                        local: rconn.clone(),
                        remote: conn.clone(),
                        remote_engine: self
                            .fabric
                            .nodes
                            .lock()
                            .get(&self.own.0)
                            .cloned()
                            .unwrap_or_default(),
                        send: Mutex::new(rconsumer),
                    }),
                );
                rcore.opened(&rconn, core.instance, core.fc_window, core.fc_unit);
                core.opened(conn, rcore.instance, rcore.fc_window, rcore.fc_unit);
                Ok(())
            }
            Err(Status::Duplicate) => {
                // The peer's own connect to us wins; it will open `conn`.
                drop(guard);
                conn.state_changed.wait_until(core.park(), deadline, || {
                    conn.state() != ConnState::Connecting
                });
                if conn.state() == ConnState::Open {
                    Ok(())
                } else {
                    Err(cannot_connect(peer, "connection not established in time"))
                }
            }
            Err(s) => Err(cannot_connect(peer, s.to_string())),
        }
    }

    fn close(&self, conn: &Arc<Connection>) {
        let link = {
            let mut links = self.links.lock();
            match links.get(&conn.peer.0) {
                Some(l) if l.local.id == conn.id => links.remove(&conn.peer.0),
                _ => None,
            }
        };
        if let Some(l) = link {
            if let Some(rcore) = l.remote_engine.upgrade().and_then(|e| e.core.upgrade()) {
                rcore.close_connection(&l.remote, "peer closed the connection", true);
            }
        }
    }

    fn standalone_max(&self) -> usize {
        STANDALONE_FRAME_MAX
    }

    /// Copies the frame into a receive buffer of the peer and delivers it
    /// marked standalone, without a send-thread hop, when this direction
    /// has no unsent ring-buffer bytes (under the link's send lock, which
    /// the send thread's round holds too: earlier messages were delivered
    /// before).
    fn send_standalone(&self, _core: &Core, conn: &Connection, frame: &[u8]) -> bool {
        let Some(link) = self.links.lock().get(&conn.peer.0).cloned() else {
            return false;
        };
        if !std::ptr::eq(Arc::as_ptr(&link.local), conn) || !conn.is_alive() {
            return false;
        }
        let Some(rcore) = link.remote_engine.upgrade().and_then(|e| e.core.upgrade()) else {
            return false;
        };
        let _send = link.send.lock();
        if conn.orb.has_unsent() || !rcore.incoming_has_room() {
            return false;
        }
        let Some(mut buf) = rcore.take_recv_buffer() else {
            return false;
        };
        if frame.len() > buf.capacity() {
            rcore.return_recv_buffer(buf);
            return false;
        }
        link.remote.flow.on_confirm(conn.flow.take_units(u32::MAX));
        buf.space()[..frame.len()].copy_from_slice(frame);
        buf.push_segment(0..frame.len());
        buf.mark_standalone();
        rcore.deliver(&link.remote, buf);
        true
    }

    fn wake_sender(&self) {
        self.signal.notify_one();
    }

    fn wake_receiver(&self) {
        // Our receive resources came free: every sender in the fabric may be
        // stalled on us.
        self.fabric.resource_epoch.fetch_add(1, Ordering::AcqRel);
        let nodes: Vec<_> = self
            .fabric
            .nodes
            .lock()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for n in nodes {
            n.signal.notify_one();
        }
    }

    fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        self.signal.notify_all();
        self.threads.join_all();
        let mut nodes = self.fabric.nodes.lock();
        if nodes
            .get(&self.own.0)
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), self))
        {
            nodes.remove(&self.own.0);
        }
    }
}
