//! `raw-tcp-batched`: the fastest a plain TCP byte stream carrying these
//! messages goes, with the batching a user would write without a library.
//!
//! One TCP socket per pair of nodes (the lower id connects), used in both
//! directions and shared by all sender threads of a node, as dxnet shares one
//! connection. Every message is a frame of a 4-byte prefix (length and kind,
//! as in `raw-tcp`) plus the payload, copied into a `BufWriter` of 64 KiB
//! behind a `Mutex`: several sender threads take turns on the lock, and the
//! socket sees a `write` only when the buffer is full (a message of 64 KiB or
//! more is written straight through, one `writev`). `TCP_NODELAY` is set, so
//! a flush leaves at once.
//!
//! Flushing: a sender thread flushes after its last message of a phase
//! ([`Binding::flush`], inside the measured time), so the receivers count
//! every message before the phase ends. A request cannot wait for a full
//! buffer: the requester flushes after writing it, and the responder flushes
//! its responses once it has answered every request of a `read` (one flush
//! per response while requests come one at a time; requests of several
//! threads that arrive together are answered with one flush). Latency
//! echoes are flushed one by one.
//!
//! One reader thread per socket reads into a large buffer
//! (`params.raw_tcp_recv_buffer`) and splits it into frames by their length
//! prefix: messages go to the sink, requests are answered on the same socket,
//! responses wake their requester. Responses return in the order of the
//! requests, so the requesters of a socket wait in a FIFO queue, appended to
//! under the writer lock (no request ids on the wire). A requester spins
//! `params.spin_us`, then parks, until the reader hands it its response.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::io::{self, BufWriter, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::raw_tcp::{bad_kind, read_frames, write_frame, Sockets, KIND_MSG, KIND_REQ, KIND_RESP};
use super::{wait_slot, Binding, BindingSetup, Sink, WaitSlot};

/// Capacity of every socket's write buffer.
pub const WRITE_BUFFER: usize = 64 << 10;

/// The socket shared with one peer node.
struct Peer {
    /// Every sender thread (and the reader, for responses) writes here.
    writer: Mutex<BufWriter<TcpStream>>,
    /// Requesters waiting for a response from this peer, in the order of
    /// their requests on the wire.
    pending: Mutex<VecDeque<Arc<WaitSlot>>>,
}

impl Peer {
    /// Wraps the socket with `src` and starts its reader thread.
    fn open(
        sockets: &Arc<Sockets>,
        src: u16,
        stream: TcpStream,
        sink: Arc<Sink>,
        recv_buffer: usize,
        io_timeout: Duration,
    ) -> Result<Arc<Peer>> {
        stream.set_write_timeout(Some(io_timeout))?;
        let peer = Arc::new(Peer {
            writer: Mutex::new(BufWriter::with_capacity(WRITE_BUFFER, stream.try_clone()?)),
            pending: Mutex::new(VecDeque::new()),
        });
        let p = peer.clone();
        sockets.spawn_reader(src, stream, move |mut s| {
            p.serve(&mut s, src, &sink, recv_buffer)
        })?;
        Ok(peer)
    }

    /// The reader thread: parses every frame the peer sends.
    fn serve(&self, stream: &mut TcpStream, src: u16, sink: &Sink, cap: usize) -> io::Result<()> {
        let answered = Cell::new(false);
        read_frames(
            stream,
            cap,
            |kind, payload| {
                match kind {
                    KIND_MSG => sink.deliver(src, payload),
                    KIND_REQ => {
                        write_frame(&mut *self.writer.lock().unwrap(), KIND_RESP, payload)?;
                        answered.set(true);
                        sink.note_request(payload.len());
                    }
                    KIND_RESP => match self.pending.lock().unwrap().pop_front() {
                        Some(slot) => slot.wake(),
                        None => {
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                "a response to no request",
                            ))
                        }
                    },
                    _ => return Err(bad_kind()),
                }
                Ok(())
            },
            || {
                if answered.replace(false) {
                    self.writer.lock().unwrap().flush()
                } else {
                    Ok(())
                }
            },
        )
    }
}

/// The batched raw TCP baseline binding of one node.
pub struct RawTcpBatched {
    me: u16,
    sockets: Arc<Sockets>,
    setup: BindingSetup,
    sink: Arc<Sink>,
    recv_buffer: usize,
    /// Sockets accepted from lower ids, until connect takes them.
    accepted: Arc<Mutex<HashMap<u16, Arc<Peer>>>>,
    peers: OnceLock<HashMap<u16, Arc<Peer>>>,
    /// Per sender thread: what its requests wait on.
    slots: Vec<Mutex<Option<Arc<WaitSlot>>>>,
    spin: Duration,
    timeout: Duration,
}

impl RawTcpBatched {
    /// Initialize phase: binds the listener and starts accepting.
    pub fn start(setup: &BindingSetup, me: u16, sink: Arc<Sink>) -> Result<Self> {
        let recv_buffer = setup.params.raw_tcp_recv_buffer.max(64 << 10);
        let timeout = Sockets::io_timeout(setup);
        let accepted = Arc::new(Mutex::new(HashMap::new()));
        let (acc, s) = (accepted.clone(), sink.clone());
        let sockets = Sockets::listen(
            setup,
            me,
            "raw-tcp-batched",
            move |sockets, stream, src, _| {
                let peer = Peer::open(sockets, src, stream, s.clone(), recv_buffer, timeout)?;
                if acc.lock().unwrap().insert(src, peer).is_some() {
                    bail!("node {src} connected twice");
                }
                Ok(())
            },
        )?;
        Ok(RawTcpBatched {
            me,
            sockets,
            setup: setup.clone(),
            sink,
            recv_buffer,
            accepted,
            peers: OnceLock::new(),
            slots: (0..setup.threads.max(1))
                .map(|_| Mutex::new(None))
                .collect(),
            spin: Duration::from_micros(setup.params.spin_us),
            timeout,
        })
    }

    fn peer(&self, dest: u16) -> Result<&Peer> {
        self.peers
            .get()
            .ok_or_else(|| anyhow!("not connected"))?
            .get(&dest)
            .map(|p| &**p)
            .ok_or_else(|| anyhow!("no connection to node {dest}"))
    }

    /// The calling sender thread's slot (a new one for each phase's thread).
    fn slot(&self, thread: usize) -> Arc<WaitSlot> {
        let mut s = self.slots[thread % self.slots.len()].lock().unwrap();
        match &*s {
            Some(w) if w.is_current_thread() => w.clone(),
            _ => {
                let w = Arc::new(WaitSlot::for_current_thread());
                *s = Some(w.clone());
                w
            }
        }
    }
}

impl Binding for RawTcpBatched {
    fn connect(&self, peers: &[u16], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let me = self.me;
        let mut map = HashMap::new();
        for &p in peers.iter().filter(|&&p| p > me) {
            let stream = self.sockets.dial(&self.setup, p, 0, deadline)?;
            let peer = Peer::open(
                &self.sockets,
                p,
                stream,
                self.sink.clone(),
                self.recv_buffer,
                self.timeout,
            )?;
            map.insert(p, peer);
        }
        let lower = peers.iter().filter(|&&p| p < me).count();
        self.sockets.wait_accepted(lower, deadline)?;
        map.extend(self.accepted.lock().unwrap().drain());
        if let Some(p) = peers.iter().find(|&&p| p != me && !map.contains_key(&p)) {
            bail!("no connection from node {p}");
        }
        self.peers
            .set(map)
            .map_err(|_| anyhow!("connect called twice"))
    }

    fn send(&self, _thread: usize, dest: u16, payload: &[u8]) -> Result<()> {
        let peer = self.peer(dest)?;
        let mut w = peer.writer.lock().unwrap();
        write_frame(&mut *w, KIND_MSG, payload).with_context(|| format!("send to node {dest}"))
    }

    fn flush(&self, _thread: usize, dests: &[u16]) -> Result<()> {
        for &d in dests {
            self.peer(d)?
                .writer
                .lock()
                .unwrap()
                .flush()
                .with_context(|| format!("flush to node {d}"))?;
        }
        Ok(())
    }

    fn request(&self, thread: usize, dest: u16, payload: &[u8]) -> Result<()> {
        let peer = self.peer(dest)?;
        let slot = self.slot(thread);
        let target = slot.seq.load(Ordering::Acquire) + 1;
        {
            let mut w = peer.writer.lock().unwrap();
            peer.pending.lock().unwrap().push_back(slot.clone());
            write_frame(&mut *w, KIND_REQ, payload)
                .and_then(|()| w.flush())
                .with_context(|| format!("request to node {dest}"))?;
        }
        wait_slot(&slot, target, self.spin, Instant::now() + self.timeout)
            .with_context(|| format!("response from node {dest}"))
    }

    fn shutdown(&self) {
        self.sockets.shutdown();
    }
}

impl Drop for RawTcpBatched {
    fn drop(&mut self) {
        if !self.sockets.stopped() {
            self.sockets.shutdown();
        }
    }
}
