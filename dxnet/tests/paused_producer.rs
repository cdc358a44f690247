//! A sender thread paused in the middle of serializing a message into the
//! connection's ring buffer (as when the scheduler preempts it) must not hold
//! up the other sender threads: their sends return while ring space lasts,
//! and once it resumes every message arrives exactly once, intact and in
//! per-thread order.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use dxnet::NodeId;
use serde::{Deserialize, Serialize, Serializer};

/// Serialization calls of [`Gate`] messages so far; the send path calls it
/// twice per message (size, then the write into the ring).
static GATE_CALLS: AtomicUsize = AtomicUsize::new(0);
/// `(paused, resume)`: the second serialization (the one writing into the
/// ring) reports on `paused` and blocks until `resume` delivers.
type GateChannels = (mpsc::Sender<()>, mpsc::Receiver<()>);
static GATE: Mutex<Option<GateChannels>> = Mutex::new(None);

/// A message whose serializer pauses half way through the ring write.
#[derive(Debug, Deserialize)]
struct Gate(u64, u64);
dxnet::message!(Gate, 12, 1);

impl Serialize for Gate {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTupleStruct;
        let mut t = s.serialize_tuple_struct("Gate", 2)?;
        t.serialize_field(&self.0)?;
        if GATE_CALLS.fetch_add(1, Ordering::SeqCst) == 1 {
            if let Some((paused, resume)) = GATE.lock().unwrap().as_ref() {
                paused.send(()).unwrap();
                resume.recv().unwrap();
            }
        }
        t.serialize_field(&self.1)?;
        t.end()
    }
}

fn paused_producer(kind: Kind) {
    const THREADS: u16 = 8;
    const PER_THREAD: u64 = 100;
    const PAUSED_THREAD: u16 = THREADS;
    let cfgs = cluster_configs(kind, 2, |c| {
        c.limits.orb_size = 4 << 20;
        c.limits.flow_control_window = 4 << 20;
        c.handler_threads = 2;
        // Only guards against hangs: a send that cannot go on fails the
        // test instead of blocking it.
        c.limits.send_timeout_ms = 60_000;
    });
    let cluster = start_all(cfgs);
    let (sender, receiver) = (&cluster[0], &cluster[1]);
    let chk = Arc::new(Checker::default());
    {
        let chk = chk.clone();
        receiver
            .register(move |src, m: Data| chk.check(src, &m))
            .unwrap();
    }
    let gates = Arc::new(AtomicUsize::new(0));
    {
        let gates = gates.clone();
        receiver
            .register(move |_, g: Gate| {
                assert_eq!((g.0, g.1), (7, 8), "gate message intact");
                gates.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
    }
    // Open the connection first, so the paused write goes into its ring.
    sender.send(NodeId(1), &Gate(7, 8)).unwrap();
    wait_for(60, "connection", || gates.load(Ordering::SeqCst) == 1);
    let (paused_tx, paused_rx) = mpsc::channel();
    let (resume_tx, resume_rx) = mpsc::channel();
    *GATE.lock().unwrap() = Some((paused_tx, resume_rx));
    GATE_CALLS.store(0, Ordering::SeqCst);

    let send = |thread: u16, seqs: std::ops::Range<u64>| {
        for seq in seqs {
            let len = size_for(seq ^ (thread as u64) << 32, 256);
            let m = Data {
                from: 0,
                thread,
                seq,
                payload: pattern(0, thread, seq, len),
            };
            sender.send(NodeId(1), &m).unwrap();
        }
    };
    std::thread::scope(|s| {
        let paused = s.spawn(|| {
            send(PAUSED_THREAD, 0..10);
            sender.send(NodeId(1), &Gate(7, 8)).unwrap();
            send(PAUSED_THREAD, 10..20);
        });
        paused_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the gate message reached its ring write");
        // The others write behind the paused span; every send returns
        // while it is still paused (at most 8 x 100 x 4 KiB: the ring and
        // the flow-control window hold it).
        let (done_tx, done_rx) = mpsc::channel();
        for t in 0..THREADS {
            let done_tx = done_tx.clone();
            s.spawn(move || {
                send(t, 0..PER_THREAD);
                done_tx.send(t).unwrap();
            });
        }
        for _ in 0..THREADS {
            done_rx
                .recv_timeout(Duration::from_secs(60))
                .expect("a sender is held up by the paused one");
        }
        resume_tx.send(()).unwrap();
        paused.join().unwrap();
    });
    let expect = THREADS as u64 * PER_THREAD + 20;
    wait_for(60, "all messages", || {
        chk.received.load(Ordering::SeqCst) >= expect || !chk.errors.lock().unwrap().is_empty()
    });
    wait_for(60, "the gate message", || gates.load(Ordering::SeqCst) == 2);
    chk.assert_ok();
    assert_eq!(chk.received.load(Ordering::SeqCst), expect);
    for t in 0..THREADS {
        assert_eq!(chk.next_seq(0, t), PER_THREAD);
    }
    assert_eq!(chk.next_seq(0, PAUSED_THREAD), 20);
    *GATE.lock().unwrap() = None;
}

#[test]
fn paused_producer_does_not_block_others_tcp() {
    paused_producer(Kind::Tcp);
}
