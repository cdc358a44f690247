//! The shuffle: set-up (regions exposed, descriptors exchanged, receivers
//! registered), the pushers and the pullers of both modes.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use crossbeam::channel::{self, Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use dxnet::region::{Access, RegionWrite, WriteHandle};
use dxnet::{HeldMessage, Node, NodeId, Region, RemoteRegion};

use crate::frame::{self, Frame};
use crate::{Mode, ShuffleConfig, ShuffleError};

type Result<T> = std::result::Result<T, ShuffleError>;

/// A puller's word to a writer: it has read the writer's segment up to
/// `tail` (the writer may reuse the room before it).
#[derive(Serialize, Deserialize, Debug)]
struct TailUpdate {
    sender: u32,
    receiver: u32,
    tail: u64,
}
dxnet::message!(TailUpdate, 201, 1);

/// Set-up: a process's incoming regions (empty until it is ready).
#[derive(Serialize, Deserialize, Debug)]
struct RegionsQuery;
#[derive(Serialize, Deserialize, Debug)]
struct RegionsAnswer {
    ready: bool,
    regions: Vec<RemoteRegion>,
}
dxnet::message!(RegionsAnswer, 201, 3);
dxnet::request!(RegionsQuery, 201, 2 => RegionsAnswer);

/// Messages mode: a batch of frames, `[to u32][from u32][frames]`.
const MSG_TYPE: u8 = 201;
const SUB_BATCH: u8 = 4;

/// What a puller's inbox carries.
enum Note {
    /// Bytes `[off, off + len)` of the segment of sender `seg` are written.
    Written { seg: usize, off: usize, len: usize },
    /// A batch from worker `from` (messages mode).
    Batch { from: usize, data: BatchData },
}

/// A batch's bytes, `[to u32][from u32][frames]`, and what it holds back
/// from its sender until the puller has read it.
enum BatchData {
    /// From another process: the message (lent from dxnet's receive
    /// buffer, or a copy), holding its share of that process's
    /// flow-control window.
    Remote(HeldMessage),
    /// From a pusher of this process, with one of the puller's credits.
    Local(Vec<u8>, #[allow(dead_code)] LocalHold),
}

impl BatchData {
    fn bytes(&self) -> &[u8] {
        match self {
            BatchData::Remote(m) => m,
            BatchData::Local(v, _) => v,
        }
    }
}

/// Batches this process's pushers may hand one of its own pullers before
/// it has read them (they bypass dxnet: no connection, no copy). Bounds
/// that memory at `LOCAL_BATCHES × batch_bytes` per puller.
const LOCAL_BATCHES: usize = 64;

/// A puller's credits for batches from pushers of its own process.
#[derive(Default)]
struct LocalCredit {
    used: Mutex<usize>,
    freed: Condvar,
}

impl LocalCredit {
    /// Takes a credit, waiting until `deadline` for one.
    fn acquire(self: &Arc<Self>, deadline: Instant) -> Option<LocalHold> {
        let mut used = self.used.lock();
        while *used >= LOCAL_BATCHES {
            if self.freed.wait_until(&mut used, deadline).timed_out() && *used >= LOCAL_BATCHES {
                return None;
            }
        }
        *used += 1;
        Some(LocalHold(self.clone()))
    }
}

/// A credit taken; given back on drop (when the puller has read the batch).
struct LocalHold(Arc<LocalCredit>);

impl Drop for LocalHold {
    fn drop(&mut self) {
        let mut used = self.0.used.lock();
        *used -= 1;
        if *used == LOCAL_BATCHES - 1 {
            self.0.freed.notify_all();
        }
    }
}

/// What the node's receivers reach: inboxes, writers' tails.
struct Routes {
    threads: usize,
    workers: usize,
    seg: usize,
    me: usize,
    /// The shuffle's processes (a worker `w` is on `nodes[w / threads]`):
    /// a peer speaks only for its own workers.
    nodes: Vec<NodeId>,
    inboxes: Vec<Sender<Note>>,
    /// Per local thread: the waker of its puller polled as a `Stream`.
    stream_wakers: Vec<Mutex<Option<Waker>>>,
    /// Messages mode, per local thread: storage of batches from this
    /// process its puller has read, for the next ones (a fresh buffer per
    /// batch, freed on another thread, costs page faults).
    spare_batches: Vec<Mutex<Vec<Vec<u8>>>>,
    /// Messages mode, per local thread: its puller's credits for batches
    /// from this process's pushers.
    local_credits: Vec<Arc<LocalCredit>>,
    /// Region id → local thread.
    region_thread: HashMap<u32, usize>,
    /// Tail reported by each destination, per local pusher:
    /// `[t * workers + dest]`.
    tails: Vec<AtomicU64>,
    /// Per local pusher: rung when a tail moves or one of its writes
    /// completes.
    signals: Vec<(Mutex<u64>, Condvar)>,
    /// This process's incoming regions, once set up.
    descriptors: OnceLock<Vec<RemoteRegion>>,
}

impl Routes {
    fn on_written(&self, w: RegionWrite) {
        let Some(&t) = self.region_thread.get(&w.region) else {
            return;
        };
        let seg = (w.offset / self.seg as u64) as usize;
        let off = (w.offset % self.seg as u64) as usize;
        // A write straddling two segments, or into another process's
        // segment, is not ours: dropped (the puller times out on the
        // sender whose data never comes).
        if seg >= self.workers
            || off as u64 + w.len > self.seg as u64
            || self.nodes[seg / self.threads] != w.from
        {
            return;
        }
        let _ = self.inboxes[t].send(Note::Written {
            seg,
            off,
            len: w.len as usize,
        });
        self.wake_stream(t);
    }

    fn wake_stream(&self, t: usize) {
        if let Some(w) = self.stream_wakers[t].lock().take() {
            w.wake();
        }
    }

    fn on_tail(&self, src: NodeId, u: TailUpdate) {
        let (sender, receiver) = (u.sender as usize, u.receiver as usize);
        if sender / self.threads != self.me
            || receiver >= self.workers
            || self.nodes[receiver / self.threads] != src
        {
            return;
        }
        let t = sender % self.threads;
        self.tails[t * self.workers + receiver].fetch_max(u.tail, Ordering::AcqRel);
        let (m, c) = &self.signals[t];
        *m.lock() += 1;
        c.notify_all();
    }

    fn on_batch(&self, src: NodeId, msg: HeldMessage) {
        if msg.len() < BATCH_HEAD {
            return;
        }
        let to = u32::from_le_bytes(msg[..4].try_into().expect("4 bytes")) as usize;
        let from = u32::from_le_bytes(msg[4..8].try_into().expect("4 bytes")) as usize;
        if to / self.threads != self.me
            || from >= self.workers
            || self.nodes[from / self.threads] != src
        {
            return;
        }
        let t = to % self.threads;
        let _ = self.inboxes[t].send(Note::Batch {
            from,
            data: BatchData::Remote(msg),
        });
        self.wake_stream(t);
    }
}

struct Inner {
    node: Arc<Node>,
    cfg: ShuffleConfig,
    routes: Arc<Routes>,
    /// Per local thread: its incoming region (one-sided mode).
    incoming: Vec<Region>,
    /// Per worker: its incoming region (one-sided mode).
    remotes: Vec<RemoteRegion>,
    inboxes: Vec<Receiver<Note>>,
    /// Pushers and pullers handed out, per local thread.
    taken: Mutex<(Vec<bool>, Vec<bool>)>,
}

/// One process's part of a shuffle (see the [crate docs](crate)).
#[derive(Clone)]
pub struct Shuffle {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Shuffle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shuffle")
            .field("node", &self.inner.node.id())
            .field("config", &self.inner.cfg)
            .finish_non_exhaustive()
    }
}

impl Shuffle {
    /// Sets up this process's part: exposes its incoming regions,
    /// registers its receivers, and waits (up to `timeout`) until every
    /// other process of `config.nodes` has done the same.
    pub fn new(node: Arc<Node>, config: ShuffleConfig) -> Result<Shuffle> {
        let cfg = config;
        let bad = |why: String| Err(ShuffleError::Config(why));
        let procs = cfg.nodes.len();
        let Some(me) = cfg.nodes.iter().position(|&n| n == node.id()) else {
            return bad(format!("node {} is not among {:?}", node.id(), cfg.nodes));
        };
        let mut sorted = cfg.nodes.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != procs {
            return bad("a node is listed twice".into());
        }
        if cfg.threads == 0 {
            return bad("threads must be at least 1".into());
        }
        let seg = cfg.segment_bytes;
        if seg < 64 || !seg.is_multiple_of(frame::ALIGN) || seg > u32::MAX as usize {
            return bad(format!(
                "segment_bytes {seg}: a multiple of 8 from 64 to 4 GiB"
            ));
        }
        let workers = procs * cfg.threads;
        if workers > u32::MAX as usize || workers.checked_mul(seg).is_none() {
            return bad("too many workers for the segment size".into());
        }
        // A puller's inbox. One-sided: notes of written ranges, a few per
        // sender at most (its segment's room bounds them). Messages: the
        // batches themselves, each holding its share of the sending
        // process's flow-control window until read, so the batches queued
        // from one process never exceed its window (and no handler thread
        // waits for a puller).
        let (senders, receivers): (Vec<_>, Vec<_>) =
            (0..cfg.threads).map(|_| channel::unbounded()).unzip();
        let incoming = match cfg.mode {
            Mode::OneSided => (0..cfg.threads)
                .map(|_| node.expose(workers * seg, Access::WriteOnly))
                .collect::<dxnet::Result<Vec<Region>>>()?,
            Mode::Messages => Vec::new(),
        };
        let routes = Arc::new(Routes {
            threads: cfg.threads,
            workers,
            seg,
            me,
            nodes: cfg.nodes.clone(),
            inboxes: senders,
            stream_wakers: (0..cfg.threads).map(|_| Mutex::new(None)).collect(),
            spare_batches: (0..cfg.threads).map(|_| Mutex::new(Vec::new())).collect(),
            local_credits: (0..cfg.threads).map(|_| Arc::default()).collect(),
            region_thread: incoming
                .iter()
                .enumerate()
                .map(|(t, r)| (r.id(), t))
                .collect(),
            tails: (0..cfg.threads * workers)
                .map(|_| AtomicU64::new(0))
                .collect(),
            signals: (0..cfg.threads)
                .map(|_| (Mutex::new(0), Condvar::new()))
                .collect(),
            descriptors: OnceLock::new(),
        });
        let r = routes.clone();
        node.register_request(move |_src, RegionsQuery| match r.descriptors.get() {
            Some(d) => RegionsAnswer {
                ready: true,
                regions: d.clone(),
            },
            None => RegionsAnswer {
                ready: false,
                regions: Vec::new(),
            },
        })?;
        let r = routes.clone();
        node.register(move |src: NodeId, u: TailUpdate| r.on_tail(src, u))?;
        let r = routes.clone();
        node.on_region_write(move |w| r.on_written(w))?;
        let r = routes.clone();
        node.register_raw_held(MSG_TYPE, SUB_BATCH, move |src, m| r.on_batch(src, m))?;
        let own: Vec<RemoteRegion> = incoming.iter().map(Region::descriptor).collect();
        let _ = routes.descriptors.set(own.clone());

        // Every process's incoming regions (and that it is ready).
        let deadline = Instant::now() + cfg.timeout;
        let mut remotes = Vec::with_capacity(workers);
        for (p, &peer) in cfg.nodes.iter().enumerate() {
            let regions = if p == me {
                own.clone()
            } else {
                query_regions(&node, peer, deadline)?
            };
            let expect = match cfg.mode {
                Mode::OneSided => cfg.threads,
                Mode::Messages => 0,
            };
            if regions.len() != expect || regions.iter().any(|r| r.len() != (workers * seg) as u64)
            {
                return bad(format!(
                    "node {peer} runs a shuffle of another shape (mode, threads or sizes differ)"
                ));
            }
            remotes.extend(regions);
        }
        Ok(Shuffle {
            inner: Arc::new(Inner {
                node,
                routes,
                incoming,
                remotes,
                inboxes: receivers,
                taken: Mutex::new((vec![false; cfg.threads], vec![false; cfg.threads])),
                cfg,
            }),
        })
    }

    /// Workers in the shuffle (processes × threads).
    pub fn workers(&self) -> usize {
        self.inner.routes.workers
    }

    /// The worker id of thread `thread` of this process.
    pub fn worker(&self, thread: usize) -> usize {
        self.inner.routes.me * self.inner.cfg.threads + thread
    }

    /// The largest record (bytes) a pusher takes.
    pub fn max_record(&self) -> usize {
        frame::max_record(self.inner.cfg.segment_bytes)
    }

    /// The pusher of this process's thread `thread` (once).
    pub fn pusher(&self, thread: usize) -> Result<Pusher> {
        self.take(thread, true)?;
        let inner = self.inner.clone();
        let workers = self.workers();
        let one_sided = inner.cfg.mode == Mode::OneSided;
        let in_place = inner.node.writes_from_region_in_place();
        let out = match one_sided && in_place {
            true => Some(
                inner
                    .node
                    .expose(workers * inner.cfg.segment_bytes, Access::LocalOnly)?,
            ),
            false => None,
        };
        let me = self.worker(thread);
        Ok(Pusher {
            dests: (0..workers)
                .map(|d| Dest {
                    batch: match one_sided {
                        true => Vec::new(),
                        false => batch_head(d, me),
                    },
                    ..Dest::default()
                })
                .collect(),
            me,
            thread,
            one_sided,
            out,
            finished: false,
            waker: Waker::from(Arc::new(PusherWaker {
                routes: inner.routes.clone(),
                thread,
            })),
            scratch: Vec::new(),
            blocked: Duration::ZERO,
            inner,
        })
    }

    /// The puller of this process's thread `thread` (once).
    pub fn puller(&self, thread: usize) -> Result<Puller> {
        self.take(thread, false)?;
        let workers = self.workers();
        Ok(Puller {
            inner: self.inner.clone(),
            thread,
            me: self.worker(thread),
            segs: (0..workers).map(|_| SegIn::default()).collect(),
            ready: VecDeque::new(),
            open: workers,
            batches: VecDeque::new(),
            max_early: (self.inner.node.config().limits.flow_control_window
                / (BATCH_HEAD + frame::HEADER))
                .max(LOCAL_BATCHES) as u64,
        })
    }

    fn take(&self, thread: usize, pusher: bool) -> Result<()> {
        if thread >= self.inner.cfg.threads {
            return Err(ShuffleError::Config(format!(
                "thread {thread} of {}",
                self.inner.cfg.threads
            )));
        }
        let mut taken = self.inner.taken.lock();
        let slot = if pusher {
            &mut taken.0[thread]
        } else {
            &mut taken.1[thread]
        };
        if std::mem::replace(slot, true) {
            return Err(ShuffleError::State(
                "this thread's pusher or puller was taken",
            ));
        }
        Ok(())
    }
}

/// Asks `peer` for its incoming regions until it is ready or `deadline`.
fn query_regions(node: &Node, peer: NodeId, deadline: Instant) -> Result<Vec<RemoteRegion>> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ShuffleError::Timeout("the other processes to set up"));
        }
        match node.request(peer, &RegionsQuery, left.min(Duration::from_secs(2))) {
            Ok(RegionsAnswer {
                ready: true,
                regions,
            }) => return Ok(regions),
            // Not ready, not started, or not yet registered: again.
            Ok(_) | Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Bytes before a batch's frames: destination, sender, and the batch's
/// number among the sender's batches to that destination.
const BATCH_HEAD: usize = 16;

/// The head of the first batch from `from` to `to`.
fn batch_head(to: usize, from: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    b.extend_from_slice(&(to as u32).to_le_bytes());
    b.extend_from_slice(&(from as u32).to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b
}

/// A batch's number (from its head).
fn batch_number(batch: &[u8]) -> u64 {
    u64::from_le_bytes(batch[8..BATCH_HEAD].try_into().expect("8 bytes"))
}

/// Makes `batch` (a head alone) the head of the next batch: its number
/// one higher. The puller orders by it: a pusher moved to another thread
/// writes into another of the connection's rings (`tcp.rings`), and its
/// later batches may overtake earlier ones.
fn next_batch(batch: &mut [u8]) {
    let n = batch_number(batch) + 1;
    batch[8..BATCH_HEAD].copy_from_slice(&n.to_le_bytes());
}

/// Wakes a pusher waiting in `wait_dest` when one of its writes completes.
struct PusherWaker {
    routes: Arc<Routes>,
    thread: usize,
}

impl Wake for PusherWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let (m, c) = &self.routes.signals[self.thread];
        *m.lock() += 1;
        c.notify_all();
    }
}

/// A pusher's state towards one destination. Positions as in
/// [`frame`]: `completed <= posted <= head`; the outgoing mirror holds
/// `[completed, head)`; the destination has read its segment up to the
/// tail it reported.
#[derive(Default)]
struct Dest {
    /// End of the last frame laid into the mirror (or staged).
    head: u64,
    /// Written to the destination (or being written) up to here.
    posted: u64,
    /// Writes done up to here: the mirror's room before it is free.
    completed: u64,
    /// Writes in flight and the position each ends at.
    inflight: VecDeque<(WriteHandle, u64)>,
    /// Messages mode: the batch being filled (with its 8-byte head).
    /// One-sided without a mirror: the frames of `[posted, head)`.
    batch: Vec<u8>,
}

/// A worker's sending side (see [`Shuffle::pusher`]). Dropping it
/// finishes its stream ([`Pusher::finish`]; errors are lost then).
pub struct Pusher {
    inner: Arc<Inner>,
    thread: usize,
    /// This worker's id (the segment it writes at every destination).
    me: usize,
    dests: Vec<Dest>,
    /// One-sided mode.
    one_sided: bool,
    /// The outgoing mirror of every destination's segment (one-sided where
    /// writes go from it in place: `Node::writes_from_region_in_place`,
    /// InfiniBand). Elsewhere a write's bytes are copied into the
    /// connection's ring when it is posted, so frames wait in
    /// `Dest::batch` instead: no lock per record, and no pass over every
    /// byte into a mirror.
    out: Option<Region>,
    finished: bool,
    waker: Waker,
    scratch: Vec<u8>,
    /// Time spent waiting (see [`Pusher::blocked`]).
    blocked: Duration,
}

impl std::fmt::Debug for Pusher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pusher")
            .field("worker", &self.me)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl Pusher {
    /// Pushes a serde record to worker `dest`.
    pub fn push<T: Serialize + ?Sized>(&mut self, dest: usize, record: &T) -> Result<()> {
        let mut buf = std::mem::take(&mut self.scratch);
        buf.clear();
        let encoded = dxnet::proto::codec::encode_append(&mut buf, record)
            .map_err(|e| ShuffleError::Decode(e.to_string()));
        let res = encoded.and_then(|()| self.push_bytes(dest, &buf));
        self.scratch = buf;
        res
    }

    /// Pushes `bytes` as one record to worker `dest`. Waits only for room
    /// in this pusher's outgoing buffer for `dest` (never for the
    /// destination), up to the shuffle's timeout.
    #[inline]
    pub fn push_bytes(&mut self, dest: usize, bytes: &[u8]) -> Result<()> {
        if self.finished {
            return Err(ShuffleError::State("the pusher finished"));
        }
        if dest >= self.dests.len() {
            return Err(ShuffleError::Config(format!(
                "worker {dest} of {}",
                self.dests.len()
            )));
        }
        let max = frame::max_record(self.inner.cfg.segment_bytes);
        if bytes.len() > max {
            return Err(ShuffleError::RecordTooLarge {
                len: bytes.len(),
                max,
            });
        }
        self.append(dest, Some(bytes))
    }

    /// Writes every record pushed so far and waits until they are at
    /// their destinations (up to the timeout while a destination's
    /// segment stays full).
    pub fn flush(&mut self) -> Result<()> {
        for d in 0..self.dests.len() {
            self.flush_dest(d)?;
        }
        Ok(())
    }

    /// Ends this worker's stream at every destination (after flushing);
    /// their pullers end once every worker finished.
    pub fn finish(&mut self) -> Result<()> {
        if self.finished {
            return Ok(());
        }
        for d in 0..self.dests.len() {
            self.append(d, None)?;
        }
        self.finished = true;
        self.flush()
    }

    /// Time this pusher spent waiting so far: for room in its outgoing
    /// buffer and for writes to finish (one-sided), in sends (messages:
    /// dxnet's flow control, and the send itself).
    pub fn blocked(&self) -> Duration {
        self.blocked
    }

    /// Lays one frame (a record, or the end with `None`) for `dest`.
    #[inline]
    fn append(&mut self, dest: usize, record: Option<&[u8]>) -> Result<()> {
        let header = match record {
            Some(b) => b.len() as u32,
            None => frame::END,
        };
        let payload = record.unwrap_or(&[]);
        if self.one_sided {
            return self.append_to_segment(dest, header, payload);
        }
        let d = &mut self.dests[dest];
        d.batch.extend_from_slice(&header.to_le_bytes());
        d.batch.extend_from_slice(payload);
        if d.batch.len() >= self.inner.cfg.batch_bytes {
            return self.send_batch(dest);
        }
        // The next record to `dest` comes after records to the others:
        // have the line it will end in at hand.
        let next = frame::HEADER + payload.len();
        if let Some(b) = d.batch.spare_capacity_mut().get(next) {
            prefetch_ptr(b.as_ptr());
        }
        Ok(())
    }

    /// One-sided: [`Pusher::append`] into `dest`'s segment mirror, or
    /// staged for it.
    #[inline(never)]
    fn append_to_segment(&mut self, dest: usize, header: u32, payload: &[u8]) -> Result<()> {
        let batch_bytes = self.inner.cfg.batch_bytes.max(1);
        let seg = self.inner.cfg.segment_bytes;
        let len = frame::frame_len(payload.len());
        let (wrap, start) = frame::place(self.dests[dest].head, seg, len);
        if wrap.is_some() {
            // The marker takes the rest of the segment, `[w, start)`.
            self.make_room(dest, start)?;
            let w = (self.dests[dest].head % seg as u64) as usize;
            match &self.out {
                Some(out) => out.write(dest * seg + w, &frame::WRAP.to_le_bytes())?,
                None => {
                    // Staged bytes stand for positions one to one: the
                    // skipped rest of the segment is staged too.
                    let b = &mut self.dests[dest].batch;
                    b.extend_from_slice(&frame::WRAP.to_le_bytes());
                    b.resize(b.len() + (seg - w - frame::HEADER), 0);
                }
            }
            self.dests[dest].head = start;
        }
        let end = start + len as u64;
        // Writes carry at most `batch_bytes` (unless one frame is larger):
        // a device splits a write into packets of its path MTU, and a
        // batch one frame over a multiple of it costs a packet more.
        let pending = self.dests[dest].head - self.dests[dest].posted;
        if pending > 0 && end - self.dests[dest].posted > batch_bytes as u64 {
            self.post(dest)?;
        }
        self.make_room(dest, end)?;
        // With a mirror (InfiniBand) straight into it, header and payload
        // under one lock: a staging batch copied in later would cost one
        // more pass over every byte, which is dear where the device is
        // emulated. Without one, staged: the post copies it into the ring.
        match &self.out {
            Some(out) => {
                let at = dest * seg + (start % seg as u64) as usize;
                out.write_vectored(at, &[&header.to_le_bytes(), payload])?;
            }
            None => {
                let b = &mut self.dests[dest].batch;
                b.extend_from_slice(&header.to_le_bytes());
                b.extend_from_slice(payload);
                b.resize(b.len() + len - frame::HEADER - payload.len(), 0);
            }
        }
        let d = &mut self.dests[dest];
        d.head = end;
        if d.head - d.posted >= batch_bytes as u64 {
            self.post(dest)?;
        }
        // Writes done are taken when room runs short: polling a write's
        // handle asks the engine to retire completions (on InfiniBand its
        // send thread polls for a while), too dear per record.
        Ok(())
    }

    /// Messages mode: sends `dest`'s batch, if it holds frames.
    fn send_batch(&mut self, dest: usize) -> Result<()> {
        let d = &mut self.dests[dest];
        if d.batch.len() <= BATCH_HEAD {
            return Ok(());
        }
        let threads = self.inner.cfg.threads;
        if dest / threads == self.inner.routes.me {
            return self.hand_batch(dest);
        }
        let node = self.inner.cfg.nodes[dest / threads];
        let t = Instant::now();
        let sent = self
            .inner
            .node
            .send_raw(node, MSG_TYPE, SUB_BATCH, &d.batch);
        self.blocked += t.elapsed();
        sent?;
        d.batch.truncate(BATCH_HEAD);
        next_batch(&mut d.batch);
        Ok(())
    }

    /// Messages mode: hands `dest`'s batch (a puller of this process) to
    /// its inbox as it is, taking a fresh one from the puller's spares.
    fn hand_batch(&mut self, dest: usize) -> Result<()> {
        let routes = &self.inner.routes;
        let t = dest % self.inner.cfg.threads;
        let started = Instant::now();
        let hold = routes.local_credits[t].acquire(started + self.inner.cfg.timeout);
        self.blocked += started.elapsed();
        let hold = hold.ok_or(ShuffleError::Timeout("a puller of this process to read"))?;
        let mut next = routes.spare_batches[t].lock().pop().unwrap_or_default();
        let d = &mut self.dests[dest];
        next.extend_from_slice(&d.batch[..BATCH_HEAD]);
        next_batch(&mut next);
        let bytes = std::mem::replace(&mut d.batch, next);
        let _ = routes.inboxes[t].send(Note::Batch {
            from: self.me,
            data: BatchData::Local(bytes, hold),
        });
        routes.wake_stream(t);
        Ok(())
    }

    /// Writes what the destination has room for: `[posted, tail + seg)`.
    fn post(&mut self, dest: usize) -> Result<()> {
        let seg = self.inner.cfg.segment_bytes;
        let workers = self.dests.len();
        let tail = self.inner.routes.tails[self.thread * workers + dest].load(Ordering::Acquire);
        let d = &mut self.dests[dest];
        let end = d.head.min(tail + seg as u64);
        let from = d.posted;
        let mut res = Ok(());
        while d.posted < end {
            let off = (d.posted % seg as u64) as usize;
            let n = ((end - d.posted) as usize).min(seg - off);
            let remote = &self.inner.remotes[dest];
            let at = (self.me * seg + off) as u64;
            let started = match &self.out {
                Some(out) => self.inner.node.write_with_notify_from_async(
                    remote,
                    at,
                    out,
                    dest * seg + off,
                    n,
                    self.me as u32,
                ),
                None => {
                    // Staged from `posted` on; copied into the ring here.
                    let i = (d.posted - from) as usize;
                    self.inner.node.write_with_notify_async(
                        remote,
                        at,
                        &d.batch[i..i + n],
                        self.me as u32,
                    )
                }
            };
            match started {
                Ok(h) => {
                    d.posted += n as u64;
                    d.inflight.push_back((h, d.posted));
                }
                Err(e) => {
                    res = Err(e.into());
                    break;
                }
            }
        }
        if self.out.is_none() {
            // What was posted is copied (also when a later part failed);
            // the rest waits for room there.
            let n = (d.posted - from) as usize;
            if n == d.batch.len() {
                d.batch.clear();
            } else {
                d.batch.drain(..n);
            }
        }
        res
    }

    /// Takes the writes to `dest` that are done, without waiting.
    fn reap(&mut self, dest: usize) -> Result<()> {
        let mut cx = Context::from_waker(&self.waker);
        let d = &mut self.dests[dest];
        while let Some((h, end)) = d.inflight.front_mut() {
            match Pin::new(h).poll(&mut cx) {
                Poll::Ready(r) => {
                    d.completed = *end;
                    d.inflight.pop_front();
                    r?;
                }
                Poll::Pending => break,
            }
        }
        Ok(())
    }

    /// Waits until the mirror for `dest` has room up to `end` (the bytes
    /// from `completed` on are live).
    fn make_room(&mut self, dest: usize, end: u64) -> Result<()> {
        let seg = self.inner.cfg.segment_bytes as u64;
        if end - self.dests[dest].completed <= seg {
            return Ok(());
        }
        self.wait_dest(
            dest,
            |d| end - d.completed <= seg,
            "room in the outgoing buffer",
        )
    }

    fn flush_dest(&mut self, dest: usize) -> Result<()> {
        if !self.one_sided {
            return self.send_batch(dest);
        }
        self.wait_dest(dest, |d| d.completed == d.head, "writes to finish")
    }

    /// Posts and retires `dest`'s writes until `done`: waits for the
    /// oldest write in flight, or, with none, for the destination to make
    /// room (a tail update), up to the timeout.
    fn wait_dest(
        &mut self,
        dest: usize,
        done: impl Fn(&Dest) -> bool,
        what: &'static str,
    ) -> Result<()> {
        let started = Instant::now();
        let res = self.wait_dest_inner(dest, done, what, started + self.inner.cfg.timeout);
        self.blocked += started.elapsed();
        res
    }

    fn wait_dest_inner(
        &mut self,
        dest: usize,
        done: impl Fn(&Dest) -> bool,
        what: &'static str,
        deadline: Instant,
    ) -> Result<()> {
        let routes = self.inner.routes.clone();
        let (m, c) = &routes.signals[self.thread];
        loop {
            // Read before looking: a completion or tail update after the
            // look rings the signal, so the wait below does not miss it.
            let seen = *m.lock();
            self.post(dest)?;
            self.reap(dest)?;
            if done(&self.dests[dest]) {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ShuffleError::Timeout(what));
            }
            // Woken by a write's completion (the handles' waker) or a tail
            // update; in slices, as an engine retires completions for a
            // waiter only for a while after each poll.
            let mut rung = m.lock();
            let slice = deadline.min(now + Duration::from_millis(5));
            while *rung == seen && Instant::now() < slice {
                c.wait_until(&mut rung, slice);
            }
        }
    }
}

impl Drop for Pusher {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// A record a puller got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The worker that pushed it.
    pub from: usize,
    bytes: Vec<u8>,
}

impl Record {
    /// A record of a copy of `bytes`, from worker `from`.
    fn copied(from: usize, bytes: &[u8]) -> Record {
        Record {
            from,
            bytes: bytes.to_vec(),
        }
    }

    /// The record's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The record's bytes, owned.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// Decodes a record pushed with [`Pusher::push`].
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T> {
        dxnet::proto::codec::decode(&self.bytes).map_err(|e| ShuffleError::Decode(e.to_string()))
    }
}

/// A puller's view of one sender's segment.
#[derive(Default)]
struct SegIn {
    /// Read up to here.
    read: u64,
    /// Written (notified, without gaps) up to here.
    avail: u64,
    /// Notified ranges beyond `avail`: start → end.
    later: BTreeMap<u64, u64>,
    /// Read since the last tail update sent.
    unreported: u64,
    /// In the ready queue.
    queued: bool,
    /// The sender's stream ended.
    done: bool,
    /// Bytes copied out of the segment (one copy per notified range, not
    /// per record), starting at position `buf_from`.
    buf: Vec<u8>,
    buf_from: u64,
    /// Bytes of `buf` copied last (`buf` keeps its largest length, so a
    /// refill does not zero it first).
    buf_len: usize,
    /// Messages mode: the number of the sender's next batch, and batches
    /// that came before it (see [`next_batch`]).
    next_batch: u64,
    early: BTreeMap<u64, BatchData>,
}

/// A worker's receiving side (see [`Shuffle::puller`]): an iterator over
/// the records addressed to it, ending once every worker finished.
pub struct Puller {
    inner: Arc<Inner>,
    thread: usize,
    me: usize,
    segs: Vec<SegIn>,
    /// Segments with unread notified bytes.
    ready: VecDeque<usize>,
    /// Senders whose stream has not ended.
    open: usize,
    /// Messages mode: batches not read to the end, with the read offset
    /// (each holds its sender back until it is dropped here).
    batches: VecDeque<(usize, BatchData, usize)>,
    /// Messages mode: how far ahead of a sender's next batch one may be
    /// numbered. Batches overtake one another only while in flight, and
    /// a sending process has at most its flow-control window of them in
    /// flight to this process (its own pushers: `LOCAL_BATCHES`); one
    /// numbered further is a peer's error, not one to wait for.
    max_early: u64,
}

/// Where a parsed record's bytes are, until the puller parses again.
struct At {
    /// The worker that pushed it (one-sided: also its segment).
    from: usize,
    place: Place,
    start: usize,
    len: usize,
}

/// The buffer an [`At`] points into.
enum Place {
    /// The front batch (messages mode).
    Batch,
    /// The sender's segment buffer (one-sided mode).
    Segment,
}

impl std::fmt::Debug for Puller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Puller")
            .field("worker", &self.me)
            .field("open", &self.open)
            .finish_non_exhaustive()
    }
}

impl Puller {
    /// The next record; `None` once every worker finished. Waits up to the
    /// shuffle's timeout for one.
    pub fn next_record(&mut self) -> Result<Option<Record>> {
        self.next_with(Record::copied)
    }

    /// Like [`Puller::next_record`], but lends the record's sender and
    /// bytes to `f` instead of copying them into a [`Record`]: no
    /// allocation per record.
    pub fn next_with<R>(&mut self, f: impl FnOnce(usize, &[u8]) -> R) -> Result<Option<R>> {
        if let Some((from, bytes)) = self.front_record() {
            return Ok(Some(f(from, bytes)));
        }
        Ok(self.next_loc()?.map(|at| f(at.from, self.bytes_at(&at))))
    }

    /// The usual case, taken first: the next record of the front batch,
    /// when it holds a whole one, with the batch's bytes looked up once
    /// (not again through an [`At`]: for small records that lookup costs
    /// as much as the parse). `None` for anything else (the batch's end, a
    /// stream's end, a bad header, no batch): [`Puller::parse`] takes
    /// those.
    #[inline(always)]
    fn front_record(&mut self) -> Option<(usize, &[u8])> {
        let (from, data, at) = self.batches.front_mut()?;
        let bytes = data.bytes();
        if *at >= bytes.len() {
            return None;
        }
        let Ok(BatchItem::Record { start, len }) = batch_item(bytes, *at) else {
            return None;
        };
        *at = start + len;
        prefetch_batch(bytes, *at);
        Some((*from, &bytes[start..start + len]))
    }

    /// Where the next record is, waiting for one (see `next_record`).
    fn next_loc(&mut self) -> Result<Option<At>> {
        let mut deadline = None;
        loop {
            // The inbox only once what it brought is read: its channel is
            // written by other threads, a look per record would cost more
            // than the record.
            if let Some(r) = self.parse()? {
                return Ok(Some(r));
            }
            if self.drain_inbox()? {
                continue;
            }
            if self.open == 0 {
                return Ok(None);
            }
            // About to wait: every writer learns how far it was read (a
            // writer may wait for that room).
            self.report_all()?;
            let dl = *deadline.get_or_insert_with(|| Instant::now() + self.inner.cfg.timeout);
            match self.inner.inboxes[self.thread].recv_deadline(dl) {
                Ok(n) => self.apply(n)?,
                Err(_) => return Err(ShuffleError::Timeout("records from unfinished workers")),
            }
        }
    }

    /// A record if one is here now (`Ok(None)`: none yet, or the end: see
    /// [`Puller::is_finished`]).
    pub fn try_next(&mut self) -> Result<Option<Record>> {
        if let Some((from, bytes)) = self.front_record() {
            return Ok(Some(Record::copied(from, bytes)));
        }
        let mut r = self.parse()?;
        if r.is_none() && self.drain_inbox()? {
            r = self.parse()?;
        }
        if r.is_none() {
            self.report_all()?;
        }
        Ok(r.map(|at| self.record(at)))
    }

    /// The bytes of the record at `at` (valid until the next parse).
    fn bytes_at(&self, at: &At) -> &[u8] {
        let buf = match at.place {
            Place::Batch => self.batches.front().expect("the record's batch").1.bytes(),
            Place::Segment => &self.segs[at.from].buf,
        };
        &buf[at.start..at.start + at.len]
    }

    /// The record at `at`, copied out.
    fn record(&self, at: At) -> Record {
        Record::copied(at.from, self.bytes_at(&at))
    }

    /// Whether every worker finished and every record was read.
    pub fn is_finished(&self) -> bool {
        self.open == 0 && self.ready.is_empty() && self.batches.is_empty()
    }

    /// Applies every note in the inbox; true if there was one.
    fn drain_inbox(&mut self) -> Result<bool> {
        let mut any = false;
        while let Ok(n) = self.inner.inboxes[self.thread].try_recv() {
            self.apply(n)?;
            any = true;
        }
        Ok(any)
    }

    fn apply(&mut self, note: Note) -> Result<()> {
        match note {
            Note::Batch { from, data } => {
                // In the order the sender made them; frames start after
                // the batch's head.
                let s = &mut self.segs[from];
                if s.done {
                    return Err(corrupt(from, "a batch after the end of stream"));
                }
                let n = batch_number(data.bytes());
                if n == s.next_batch {
                    // The usual case: no map (a node allocated and freed
                    // per batch).
                    s.next_batch += 1;
                    self.batches.push_back((from, data, BATCH_HEAD));
                } else if n < s.next_batch || s.early.contains_key(&n) {
                    return Err(corrupt(from, "a batch came twice"));
                } else if n - s.next_batch > self.max_early {
                    return Err(corrupt(from, "a batch numbered far ahead of the stream"));
                } else {
                    s.early.insert(n, data);
                }
                while let Some(data) = s.early.remove(&s.next_batch) {
                    s.next_batch += 1;
                    self.batches.push_back((from, data, BATCH_HEAD));
                }
                Ok(())
            }
            Note::Written { seg, off, len } => {
                let size = self.inner.cfg.segment_bytes as u64;
                let s = &mut self.segs[seg];
                // The position of `off` in [avail, avail + size).
                let mut pos = s.avail - s.avail % size + off as u64;
                if pos < s.avail {
                    pos += size;
                }
                if s.done || pos + len as u64 > s.read + size {
                    return Err(corrupt(seg, "a write beyond the segment's free room"));
                }
                if pos == s.avail {
                    s.avail = pos + len as u64;
                } else {
                    s.later.insert(pos, pos + len as u64);
                }
                while let Some(end) = s.later.remove(&s.avail) {
                    s.avail = end;
                }
                if s.avail > s.read && !s.queued {
                    s.queued = true;
                    self.ready.push_back(seg);
                }
                Ok(())
            }
        }
    }

    /// Keeps a read batch's storage for the next batches from this
    /// process to this puller.
    fn keep_batch(&self, data: BatchData) {
        if let BatchData::Local(mut bytes, _) = data {
            let mut spare = self.inner.routes.spare_batches[self.thread].lock();
            if spare.len() < LOCAL_BATCHES {
                bytes.clear();
                spare.push(bytes);
            }
        }
    }

    /// The next record of any ready segment or batch.
    fn parse(&mut self) -> Result<Option<At>> {
        while let Some((from, data, at)) = self.batches.front_mut() {
            let from = *from;
            let bytes = data.bytes();
            if *at >= bytes.len() {
                if let Some((_, data, _)) = self.batches.pop_front() {
                    self.keep_batch(data);
                }
                continue;
            }
            match batch_item(bytes, *at).map_err(|why| corrupt(from, why))? {
                BatchItem::End => {
                    // The last frame of the sender's last batch.
                    let later = |&(f, _, _): &(usize, BatchData, usize)| f == from;
                    if *at + frame::HEADER != bytes.len() || self.batches.iter().skip(1).any(later)
                    {
                        return Err(corrupt(from, "frames after the end of stream"));
                    }
                    if let Some((_, _, at)) = self.batches.front_mut() {
                        *at += frame::HEADER;
                    }
                    self.end_of(from)?;
                }
                BatchItem::Record { start, len } => {
                    *at = start + len;
                    prefetch_batch(bytes, *at);
                    return Ok(Some(At {
                        from,
                        place: Place::Batch,
                        start,
                        len,
                    }));
                }
            }
        }
        while let Some(&seg) = self.ready.front() {
            match self.parse_segment(seg)? {
                Some(r) => {
                    // Round-robin over the senders with data.
                    self.ready.pop_front();
                    if self.segs[seg].avail > self.segs[seg].read && !self.segs[seg].done {
                        self.ready.push_back(seg);
                    } else {
                        self.segs[seg].queued = false;
                    }
                    return Ok(Some(r));
                }
                None => {
                    self.ready.pop_front();
                    self.segs[seg].queued = false;
                }
            }
        }
        Ok(None)
    }

    /// The next record of `seg`'s segment, if a whole one is written.
    fn parse_segment(&mut self, seg: usize) -> Result<Option<At>> {
        let size = self.inner.cfg.segment_bytes;
        loop {
            let s = &self.segs[seg];
            if s.done || s.avail - s.read < frame::ALIGN as u64 {
                return Ok(None);
            }
            let read = s.read;
            let mut h = [0u8; 4];
            if !self.buffered(seg, frame::HEADER)? {
                return Ok(None);
            }
            let s = &self.segs[seg];
            let i = (read - s.buf_from) as usize;
            h.copy_from_slice(&s.buf[i..i + frame::HEADER]);
            match frame::parse(u32::from_le_bytes(h), read, size) {
                Err(e) => return Err(corrupt(seg, &e.to_string())),
                Ok(Frame::Wrap) => {
                    // The skipped rest of the segment is written (with
                    // stale bytes) before the next frame.
                    let next = frame::after_wrap(read, size);
                    if s.avail < next {
                        return Ok(None);
                    }
                    self.consumed(seg, next)?;
                }
                Ok(Frame::End) => {
                    self.consumed(seg, read + frame::ALIGN as u64)?;
                    self.end_of(seg)?;
                    return Ok(None);
                }
                Ok(Frame::Record(n)) => {
                    let len = frame::frame_len(n);
                    if !self.buffered(seg, len)? {
                        return Ok(None); // the rest is still coming
                    }
                    let s = &self.segs[seg];
                    let start = (read - s.buf_from) as usize + frame::HEADER;
                    self.consumed(seg, read + len as u64)?;
                    return Ok(Some(At {
                        from: seg,
                        place: Place::Segment,
                        start,
                        len: n,
                    }));
                }
            }
        }
    }

    /// Whether `len` bytes from `seg`'s read position are in its buffer,
    /// copying the notified bytes up to the segment's end out of the
    /// region when they are not (false: they are not written yet).
    fn buffered(&mut self, seg: usize, len: usize) -> Result<bool> {
        let size = self.inner.cfg.segment_bytes as u64;
        let s = &mut self.segs[seg];
        if s.read >= s.buf_from && s.read + len as u64 <= s.buf_from + s.buf_len as u64 {
            return Ok(true);
        }
        if s.avail - s.read < len as u64 {
            return Ok(false);
        }
        let off = s.read % size;
        let n = (s.avail - s.read).min(size - off) as usize;
        if s.buf.len() < n {
            s.buf.resize(n, 0);
        }
        s.buf_from = s.read;
        s.buf_len = n;
        self.inner.incoming[self.thread]
            .read(seg * size as usize + off as usize, &mut s.buf[..n])?;
        Ok(n >= len)
    }

    /// `seg`'s segment is read up to `to`; its writer hears of it every
    /// quarter segment.
    fn consumed(&mut self, seg: usize, to: u64) -> Result<()> {
        let s = &mut self.segs[seg];
        s.unreported += to - s.read;
        s.read = to;
        if s.unreported >= (self.inner.cfg.segment_bytes / 4) as u64 {
            self.report(seg)?;
        }
        Ok(())
    }

    fn end_of(&mut self, from: usize) -> Result<()> {
        let s = &mut self.segs[from];
        if s.done {
            return Err(corrupt(from, "a second end of stream"));
        }
        if !s.early.is_empty() {
            return Err(corrupt(
                from,
                "the end of stream before some of its batches",
            ));
        }
        s.done = true;
        self.open -= 1;
        Ok(())
    }

    fn report(&mut self, seg: usize) -> Result<()> {
        let s = &mut self.segs[seg];
        if s.unreported == 0 || s.done {
            // A finished writer writes no more: nothing to free.
            s.unreported = 0;
            return Ok(());
        }
        s.unreported = 0;
        let node = self.inner.cfg.nodes[seg / self.inner.cfg.threads];
        // A writer that cannot be told is gone: if it had not finished,
        // its stream times out; its room does not matter any more.
        let _ = self.inner.node.send(
            node,
            &TailUpdate {
                sender: seg as u32,
                receiver: self.me as u32,
                tail: s.read,
            },
        );
        Ok(())
    }

    fn report_all(&mut self) -> Result<()> {
        for seg in 0..self.segs.len() {
            if self.segs[seg].unreported > 0 {
                self.report(seg)?;
            }
        }
        Ok(())
    }
}

/// A frame of a messages-mode batch (after its head).
enum BatchItem {
    /// A record at `bytes[start..start + len]`.
    Record { start: usize, len: usize },
    /// The sender's stream ends.
    End,
}

/// The frame at offset `at` (inside the batch) of a batch a peer sent:
/// checked, never trusted.
#[inline(always)]
fn batch_item(bytes: &[u8], at: usize) -> std::result::Result<BatchItem, &'static str> {
    let rest = bytes.get(at..).unwrap_or_default();
    let Some(h) = rest.get(..frame::HEADER) else {
        return Err("a batch ends inside a header");
    };
    let h = u32::from_le_bytes(h.try_into().expect("4 bytes"));
    if h == frame::END {
        return Ok(BatchItem::End);
    }
    if h > frame::MAX_LEN {
        return Err("a frame header no batch holds (wrap marker or length over the limit)");
    }
    let len = h as usize;
    if rest.len() - frame::HEADER < len {
        return Err("a record runs past its batch");
    }
    Ok(BatchItem::Record {
        start: at + frame::HEADER,
        len,
    })
}

/// Asks for the two lines `PREFETCH_AHEAD` past a batch's read offset `at`:
/// a small record's frame often ends in the line after the one it starts
/// in, and one hint per record would leave every other line to the
/// hardware.
#[inline(always)]
fn prefetch_batch(bytes: &[u8], at: usize) {
    prefetch(bytes, at + PREFETCH_AHEAD);
    prefetch(bytes, at + PREFETCH_AHEAD + 64);
}

/// How far ahead of the record being parsed a puller asks for a batch's
/// bytes: they were received on another core.
const PREFETCH_AHEAD: usize = 1024;

/// A hint to load the cache line of `bytes[at]` (nothing past the end).
#[inline(always)]
fn prefetch(bytes: &[u8], at: usize) {
    if let Some(b) = bytes.get(at) {
        prefetch_ptr(b);
    }
}

/// A hint to load the cache line of `p` into this core's caches.
#[inline(always)]
fn prefetch_ptr(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE (which `_mm_prefetch` needs) is part of the x86_64
    // baseline; a prefetch never faults, whatever the address, and changes
    // nothing but the caches.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

fn corrupt(from: usize, why: &str) -> ShuffleError {
    ShuffleError::Corrupt {
        from,
        why: why.to_string(),
    }
}

/// The async form: records as they come, `None` once every worker
/// finished. It has no timeout of its own (wrap it in the runtime's).
impl futures_core::Stream for Puller {
    type Item = Result<Record>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Record>>> {
        let this = self.get_mut();
        for registered in [false, true] {
            match this.try_next() {
                Err(e) => return Poll::Ready(Some(Err(e))),
                Ok(Some(r)) => return Poll::Ready(Some(Ok(r))),
                Ok(None) if this.is_finished() => return Poll::Ready(None),
                Ok(None) if registered => return Poll::Pending,
                // Register, then look once more: a note sent in between
                // finds the waker.
                Ok(None) => {
                    *this.inner.routes.stream_wakers[this.thread].lock() = Some(cx.waker().clone())
                }
            }
        }
        Poll::Pending
    }
}

impl Iterator for Puller {
    type Item = Result<Record>;

    fn next(&mut self) -> Option<Result<Record>> {
        self.next_record().transpose()
    }
}
