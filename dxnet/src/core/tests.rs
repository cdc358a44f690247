//! The runtime's decisions, tested against a test engine (no sockets, no
//! engine threads): what a failed or closed connection does to pending
//! requests, least-recently-used closing, refused connections, the
//! flow-control window a send gives back when it cannot be written, and
//! where received responses complete.

use std::collections::HashSet;
use std::sync::Weak;

use serde::{Deserialize, Serialize};

use super::*;
use crate::transport::cannot_connect;

/// An engine that opens every connection at once (unless told to refuse
/// it) and never moves a byte: what the runtime does is all there is to
/// observe.
#[derive(Default)]
struct TestEngine {
    core: OnceLock<Weak<Core>>,
    refuse: Mutex<HashSet<u16>>,
    connects: Mutex<Vec<u16>>,
    closed: Mutex<Vec<u16>>,
}

impl Transport for TestEngine {
    fn connect(&self, conn: &Arc<Connection>, _deadline: Instant) -> Result<()> {
        self.connects.lock().push(conn.peer.0);
        if self.refuse.lock().contains(&conn.peer.0) {
            return Err(cannot_connect(conn.peer, "refused by the test engine"));
        }
        let core = self
            .core
            .get()
            .and_then(Weak::upgrade)
            .ok_or(Error::Shutdown)?;
        core.opened(conn, 7, 1 << 20, 1 << 19);
        Ok(())
    }

    fn close(&self, conn: &Arc<Connection>) {
        self.closed.lock().push(conn.peer.0);
    }

    fn wake_sender(&self) {}

    fn wake_receiver(&self) {}

    fn shutdown(&self) {}
}

fn start(tune: impl FnOnce(&mut Config)) -> (Arc<Core>, Arc<TestEngine>) {
    let mut config = Config::loopback(0, 8, "runtime unit tests");
    config.handler_threads = 1;
    tune(&mut config);
    let engine = Arc::new(TestEngine::default());
    let e = engine.clone();
    let core = Core::start_with(config, move |core| {
        let _ = e.core.set(Arc::downgrade(core));
        Ok(e as Arc<dyn Transport>)
    })
    .unwrap();
    (core, engine)
}

#[derive(Serialize, Deserialize, Debug)]
struct Ask(u32);
#[derive(Serialize, Deserialize, Debug)]
struct Answer(u32);
crate::message!(Answer, 40, 2);
crate::request!(Ask, 40, 1 => Answer);

const LONG: Duration = Duration::from_secs(60);

/// A connection the engine reports broken fails its pending requests with
/// the reason as `Unreachable(ConnectionLost)`; one closed for another
/// reason (here: shutdown of the connection by the runtime) cancels them.
#[test]
fn pending_requests_fail_with_their_connections_cause() {
    let (core, _engine) = start(|_| {});
    let p = core.send_request(NodeId(1), &Ask(1), LONG, false).unwrap();
    let conn = core.connections.get(NodeId(1)).unwrap();
    core.close_connection(&conn, "link down", true);
    assert_eq!(
        core.wait_response(p),
        Err(Error::Unreachable(
            NodeId(1),
            Unreachable::ConnectionLost("link down".into())
        ))
    );

    let p = core.send_request(NodeId(2), &Ask(2), LONG, false).unwrap();
    let conn = core.connections.get(NodeId(2)).unwrap();
    core.close_connection(&conn, "no longer needed", false);
    assert_eq!(
        core.wait_response(p),
        Err(Error::Cancelled(Cancelled::ConnectionClosed))
    );
    // The next send to the node opens a new connection.
    core.send_raw(NodeId(1), 40, 3, b"again").unwrap();
    let again = core.connections.get(NodeId(1)).unwrap();
    assert_ne!(again.id, conn.id);
    assert_eq!(again.state(), ConnState::Open);
    core.shutdown();
}

/// Beyond `max_connections` the least recently used connection is closed
/// (the engine is told), and its pending requests are cancelled.
#[test]
fn least_recently_used_connection_is_closed_beyond_the_limit() {
    let (core, engine) = start(|c| c.limits.max_connections = 2);
    let p1 = core.send_request(NodeId(1), &Ask(1), LONG, false).unwrap();
    let p2 = core.send_request(NodeId(2), &Ask(2), LONG, false).unwrap();
    // Node 2's connection was used last, node 1's long before.
    core.connections.get(NodeId(1)).unwrap().touch(10);
    core.connections.get(NodeId(2)).unwrap().touch(1_000);
    core.send_raw(NodeId(3), 40, 3, b"third").unwrap();
    assert_eq!(*engine.closed.lock(), vec![1]);
    assert!(core.connections.get(NodeId(1)).is_none());
    assert!(core.connections.get(NodeId(2)).is_some());
    assert!(core.connections.get(NodeId(3)).is_some());
    assert_eq!(
        core.wait_response(p1),
        Err(Error::Cancelled(Cancelled::ConnectionClosed))
    );
    let mut p2 = p2;
    assert!(p2.try_take().is_none(), "node 2's request still waits");
    core.shutdown();
}

/// A refused connection is `Unreachable(Connect)`, leaves no connection
/// behind (nor a count in the stats), and the next send tries again.
#[test]
fn refused_connection_is_unreachable_and_retried() {
    let (core, engine) = start(|_| {});
    engine.refuse.lock().insert(5);
    for _ in 0..2 {
        match core.send_raw(NodeId(5), 40, 3, b"x") {
            Err(Error::Unreachable(NodeId(5), Unreachable::Connect(why))) => {
                assert!(why.contains("refused by the test engine"), "{why}")
            }
            other => panic!("expected Unreachable(Connect), got {other:?}"),
        }
        assert!(core.connections.get(NodeId(5)).is_none());
    }
    assert_eq!(*engine.connects.lock(), vec![5, 5]);
    let st = core.stats();
    assert_eq!(
        (st.connections_opened, st.connections_closed),
        (0, 0),
        "refused connects are neither opened nor closed connections"
    );
    engine.refuse.lock().clear();
    core.send_raw(NodeId(5), 40, 3, b"x").unwrap();
    assert_eq!(core.stats().connections_opened, 1);
    core.shutdown();
}

/// Sends that cannot be written (the engine never drains the ring buffer)
/// time out waiting for ring space and give their flow-control window
/// back: what stays claimed is exactly what is in the ring.
#[test]
fn a_send_that_times_out_gives_its_window_back() {
    let (core, _engine) = start(|c| {
        c.limits.orb_size = 4096;
        c.limits.send_timeout_ms = 20;
    });
    let payload = [7u8; 1000];
    let mut sent = 0;
    let err = loop {
        match core.send_raw(NodeId(1), 40, 3, &payload) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent < 100, "a 4 KiB ring took {sent} KiB");
    };
    assert_eq!(err, Error::Timeout(Waited::RingBuffer));
    let conn = core.connections.get(NodeId(1)).unwrap();
    let pos = conn.orb.positions();
    assert_eq!(
        sent as u64 * (HEADER_LEN as u64 + 1000),
        pos.reserved - pos.front
    );
    assert_eq!(conn.flow.in_flight(), pos.reserved - pos.front);
    core.shutdown();
}

/// A received buffer of whole responses, in several segments (chunks that
/// left the peer in separate writes, read at once), completes its requests
/// on the receiving thread: nothing goes to the handler threads, whose
/// wake-up would cost a thread hop per buffer.
#[test]
fn responses_in_several_segments_complete_on_the_receiving_thread() {
    let (core, _engine) = start(|_| {});
    let a = core.send_request(NodeId(1), &Ask(1), LONG, false).unwrap();
    let b = core.send_request(NodeId(1), &Ask(2), LONG, false).unwrap();
    let conn = core.connections.get(NodeId(1)).unwrap();
    let mut buf = core.pool.get().expect("a receive buffer");
    let mut at = 0;
    for (id, answer) in [(a.id(), 10u32), (b.id(), 20)] {
        let mut payload = Vec::new();
        codec::encode_into(&mut payload, &Answer(answer)).unwrap();
        let header = MessageHeader {
            msg_type: 40,
            subtype: 2,
            flags: MessageKind::Response.flags(),
            request_id: id,
            payload_len: payload.len() as u32,
        };
        let end = at + HEADER_LEN + payload.len();
        let space = buf.space();
        header.encode((&mut space[at..at + HEADER_LEN]).try_into().unwrap());
        space[at + HEADER_LEN..end].copy_from_slice(&payload);
        buf.push_segment(at..end);
        at = end + 8; // the next chunk's header lies between
    }
    core.deliver(&conn, buf);
    assert!(
        a.is_done() && b.is_done(),
        "completed before deliver returned"
    );
    assert_eq!(core.stats().incoming_peak_buffers, 0, "nothing was queued");
    for (p, want) in [(a, 10), (b, 20)] {
        let bytes = core.wait_response(p).unwrap();
        assert_eq!(codec::decode::<Answer>(&bytes).unwrap().0, want);
    }
    core.shutdown();
}
