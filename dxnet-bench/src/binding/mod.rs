//! The single lean interface every measured system is driven through
//! (Observatory's idea): a binding can connect, send a one-way message and
//! run a request/response round trip; everything it receives goes to a
//! [`Sink`]. The operations in [`crate::ops`] are written once against it, so
//! dxnet and the raw baselines are measured by exactly the same code.
//!
//! Adding a binding: add a [`BindingKind`] variant, a module implementing
//! [`Binding`], and a line in [`create`] and [`BindingKind::wire`].
//!
//! `ib_send_bw` / `ib_send_lat` ([`perftest`]) and `mpi-tcp` / `mpi-shm`
//! ([`mpi`]) are external bindings: the coordinator runs perftest's
//! programs or `mpirun` for them instead of node processes, and records
//! their results in the same form.

mod count;
pub mod raw_tcp;
pub mod raw_tcp_batched;

pub mod dxnet;

pub mod mpi;
pub mod perftest;
pub mod raw_verbs;

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock, Weak};
use std::thread::Thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::config::{Mode, Operation, Params};
use count::ArrivalCount;

/// The bindings this build knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BindingKind {
    /// Blocking TCP sockets, one `writev` of a 4-byte prefix plus payload per
    /// message: the TCP analogue of `ib_send_bw` / `ib_send_lat`.
    RawTcp,
    /// One TCP socket per pair of nodes, shared by all sender threads
    /// through a mutex-guarded 64 KiB `BufWriter`: the fastest a plain byte
    /// stream carrying these messages goes (batching without a library).
    RawTcpBatched,
    /// dxnet over its TCP transport, one node per process.
    DxnetTcp,
    /// `dxnet-tcp` with one-way messages as a user's typed messages: a
    /// serde type with a byte field sent with `Node::send` to a receiver
    /// registered with `Node::register` (serialization on the sender,
    /// deserialization into an owned message on the receiver), where
    /// `dxnet-tcp` uses `send_raw`/`register_raw`.
    DxnetTcpTyped,
    /// `dxnet-tcp` with TLS 1.3 (rustls) on every connection: the
    /// coordinator writes a fresh CA and node certificates for the run
    /// (see [`pki_dir`]). Compared with `dxnet-tcp` to show TLS's cost.
    DxnetTcpTls,
    /// dxnet over its in-process loopback transport: all nodes of a run are
    /// `Node` instances inside one process.
    DxnetLoopback,
    /// dxnet over its InfiniBand/RoCE verbs transport (msgrc), one node per
    /// process.
    DxnetIb,
    /// RC SEND/RECV through dxnet-verbs, one send WR per message and a
    /// pre-posted receive queue: the verbs analogue of `raw-tcp`.
    RawVerbs,
    /// perftest's `ib_send_bw` (throughput; `bi` with `-b`), run as two processes.
    IbSendBw,
    /// perftest's `ib_send_lat` (latency and pingpong), run as two processes.
    IbSendLat,
    /// perftest's `ib_write_bw` (`rdma_write`; `bi` with `-b`).
    IbWriteBw,
    /// perftest's `ib_write_lat` (`rdma_write_lat`).
    IbWriteLat,
    /// perftest's `ib_read_bw` (`rdma_read`; `bi` with `-b`).
    IbReadBw,
    /// perftest's `ib_read_lat` (`rdma_read_lat`).
    IbReadLat,
    /// Open MPI's ob1 point-to-point over its TCP transport, the OSU
    /// benchmarks' calls ([`mpi`]), one rank per node.
    MpiTcp,
    /// The same over Open MPI's shared-memory transport (vader): MPI on one
    /// host at its fastest, for reference.
    MpiShm,
    /// MPICH (ch4 over UCX) restricted to UCX's TCP transport, the same
    /// program ([`mpi`]).
    MpichTcp,
    /// MPICH with its shared memory between ranks on one host.
    MpichShm,
}

/// The raw baseline a binding is compared with (by name, so that results of
/// other builds can be tabulated too): the same medium without the library.
pub fn baseline_of(binding: &str) -> Option<&'static str> {
    baselines_of(binding).first().copied()
}

/// Every baseline a binding is compared with, the raw one first.
/// `"perftest"` stands for `ib_send_bw` in throughput rows and
/// `ib_send_lat` in latency rows (see [`perftest_for`]).
pub fn baselines_of(binding: &str) -> &'static [&'static str] {
    match binding {
        "dxnet-tcp" | "dxnet-loopback" => &[
            "raw-tcp",
            "raw-tcp-batched",
            "mpi-tcp",
            "mpi-shm",
            "mpich-tcp",
            "mpich-shm",
        ],
        "dxnet-tcp-tls" | "dxnet-tcp-typed" => &["dxnet-tcp", "raw-tcp", "raw-tcp-batched"],
        "dxnet-ib" => &["raw-verbs", "perftest"],
        _ => &[],
    }
}

/// The perftest binding that measures `op`.
pub fn perftest_for(op: Operation) -> &'static str {
    match op {
        Operation::RdmaWrite => "ib_write_bw",
        Operation::RdmaWriteLat => "ib_write_lat",
        Operation::RdmaRead => "ib_read_bw",
        Operation::RdmaReadLat => "ib_read_lat",
        op if op.is_latency() => "ib_send_lat",
        _ => "ib_send_bw",
    }
}

/// Whether a binding is a baseline (not dxnet): `raw-*`, perftest and MPI.
pub fn is_baseline(binding: &str) -> bool {
    binding.starts_with("raw-")
        || binding.starts_with("ib_")
        || binding.starts_with("mpi-")
        || binding.starts_with("mpich-")
}

/// Where a node's wire bytes are counted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireSource {
    /// The `tx_bytes` counter of a network interface.
    NetIface(String),
    /// The `port_xmit_data` counter (4-byte units) of an RDMA port.
    IbPort {
        /// Device name, e.g. `mlx5_0`.
        device: String,
        /// Port number.
        port: u8,
    },
}

impl BindingKind {
    /// Parses a binding name.
    pub fn parse(s: &str) -> Result<Self> {
        let k = match s.trim() {
            "raw-tcp" => BindingKind::RawTcp,
            "raw-tcp-batched" => BindingKind::RawTcpBatched,
            "dxnet-tcp" => BindingKind::DxnetTcp,
            "dxnet-tcp-tls" => BindingKind::DxnetTcpTls,
            "dxnet-tcp-typed" => BindingKind::DxnetTcpTyped,
            "dxnet-loopback" => BindingKind::DxnetLoopback,
            "dxnet-ib" => BindingKind::DxnetIb,
            "raw-verbs" => BindingKind::RawVerbs,
            "ib_send_bw" => BindingKind::IbSendBw,
            "ib_send_lat" => BindingKind::IbSendLat,
            "ib_write_bw" => BindingKind::IbWriteBw,
            "ib_write_lat" => BindingKind::IbWriteLat,
            "ib_read_bw" => BindingKind::IbReadBw,
            "ib_read_lat" => BindingKind::IbReadLat,
            "mpi-tcp" => BindingKind::MpiTcp,
            "mpi-shm" => BindingKind::MpiShm,
            "mpich-tcp" => BindingKind::MpichTcp,
            "mpich-shm" => BindingKind::MpichShm,
            other => {
                bail!(
                    "unknown binding {other:?} (raw-tcp, raw-tcp-batched, dxnet-tcp, \
                     dxnet-tcp-typed, dxnet-tcp-tls, dxnet-loopback, dxnet-ib, raw-verbs, ib_send_bw, ib_send_lat, \
                     ib_write_bw, ib_write_lat, ib_read_bw, ib_read_lat, mpi-tcp, mpi-shm, mpich-tcp, mpich-shm)"
                )
            }
        };
        Ok(k)
    }

    /// The name used in configs and results.
    pub fn name(self) -> &'static str {
        match self {
            BindingKind::RawTcp => "raw-tcp",
            BindingKind::RawTcpBatched => "raw-tcp-batched",
            BindingKind::DxnetTcp => "dxnet-tcp",
            BindingKind::DxnetTcpTls => "dxnet-tcp-tls",
            BindingKind::DxnetTcpTyped => "dxnet-tcp-typed",
            BindingKind::DxnetLoopback => "dxnet-loopback",
            BindingKind::DxnetIb => "dxnet-ib",
            BindingKind::RawVerbs => "raw-verbs",
            BindingKind::IbSendBw => "ib_send_bw",
            BindingKind::IbSendLat => "ib_send_lat",
            BindingKind::IbWriteBw => "ib_write_bw",
            BindingKind::IbWriteLat => "ib_write_lat",
            BindingKind::IbReadBw => "ib_read_bw",
            BindingKind::IbReadLat => "ib_read_lat",
            BindingKind::MpiTcp => "mpi-tcp",
            BindingKind::MpiShm => "mpi-shm",
            BindingKind::MpichTcp => "mpich-tcp",
            BindingKind::MpichShm => "mpich-shm",
        }
    }

    /// Whether the binding has message-handler threads to configure.
    pub fn has_handlers(self) -> bool {
        matches!(
            self,
            BindingKind::DxnetTcp
                | BindingKind::DxnetTcpTyped
                | BindingKind::DxnetTcpTls
                | BindingKind::DxnetLoopback
                | BindingKind::DxnetIb
        )
    }

    /// Whether the binding talks RDMA verbs (needs a device).
    pub fn uses_rdma(self) -> bool {
        matches!(
            self,
            BindingKind::DxnetIb
                | BindingKind::RawVerbs
                | BindingKind::IbSendBw
                | BindingKind::IbSendLat
                | BindingKind::IbWriteBw
                | BindingKind::IbWriteLat
                | BindingKind::IbReadBw
                | BindingKind::IbReadLat
        )
    }

    /// Whether the coordinator runs an external program (perftest,
    /// `mpirun`) instead of node processes.
    pub fn is_external(self) -> bool {
        self.is_perftest() || self.is_mpi()
    }

    /// Whether the binding is one of perftest's programs.
    pub fn is_perftest(self) -> bool {
        matches!(
            self,
            BindingKind::IbSendBw
                | BindingKind::IbSendLat
                | BindingKind::IbWriteBw
                | BindingKind::IbWriteLat
                | BindingKind::IbReadBw
                | BindingKind::IbReadLat
        )
    }

    /// Whether the binding runs MPI ([`mpi`]).
    pub fn is_mpi(self) -> bool {
        matches!(
            self,
            BindingKind::MpiTcp
                | BindingKind::MpiShm
                | BindingKind::MpichTcp
                | BindingKind::MpichShm
        )
    }

    /// Whether the binding can run `op`/`mode` with `threads` sender threads
    /// on `nodes` nodes. perftest measures one pair with one thread:
    /// `ib_send_bw` throughput (uni, or bi with `-b`), `ib_send_lat` round trips.
    pub fn supports(self, op: Operation, _mode: Mode, threads: usize, nodes: usize) -> bool {
        match self {
            // uni, or bi with perftest's `-b`.
            BindingKind::IbSendBw => op == Operation::Throughput && threads == 1 && nodes == 2,
            BindingKind::IbSendLat => {
                op.is_latency() && !op.is_one_sided() && threads == 1 && nodes == 2
            }
            // uni, or bi with perftest's `-b`.
            BindingKind::IbWriteBw | BindingKind::IbReadBw => {
                perftest_for(op) == self.name() && threads == 1 && nodes == 2
            }
            BindingKind::IbWriteLat | BindingKind::IbReadLat => {
                perftest_for(op) == self.name() && threads == 1 && nodes == 2
            }
            k if k.is_mpi() => mpi::supports(op),
            // One-sided operations: dxnet's API and raw verbs.
            _ if op.is_one_sided() => self.has_handlers() || self == BindingKind::RawVerbs,
            _ => true,
        }
    }

    /// Whether all nodes of a run live in one process.
    pub fn in_process(self) -> bool {
        self == BindingKind::DxnetLoopback
    }

    /// Whether the binding talks over the network (needs addresses, has wire
    /// counters).
    pub fn uses_network(self) -> bool {
        !self.in_process()
    }

    /// Where the wire bytes of a node with data address `addr` are counted.
    pub fn wire(self, addr: &str, params: &Params) -> Option<WireSource> {
        if !self.uses_network() {
            return None;
        }
        if self.uses_rdma() {
            let t = params.rdma.resolve();
            return Some(WireSource::IbPort {
                device: t.device?,
                port: t.port,
            });
        }
        if !params.wire_iface.is_empty() {
            return Some(WireSource::NetIface(params.wire_iface.clone()));
        }
        let ip = addr.rsplit_once(':').map(|(h, _)| h).unwrap_or(addr);
        let ip: std::net::IpAddr = ip.trim_matches(['[', ']']).parse().ok()?;
        crate::metrics::iface_of(ip).map(WireSource::NetIface)
    }
}

/// Everything a node needs to create its binding instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BindingSetup {
    /// Binding name.
    pub binding: String,
    /// Node map: (id, data address `ip:port`); empty addresses for in-process
    /// bindings.
    pub nodes: Vec<(u16, String)>,
    /// Sender threads per node.
    pub threads: usize,
    /// Message-handler threads per node.
    pub handlers: usize,
    /// Global parameters.
    pub params: Params,
    /// Name of the in-process fabric (loopback), unique per group.
    pub fabric: String,
}

impl BindingSetup {
    /// Where the certificates of a `dxnet-tcp-tls` run live: a directory
    /// unique to the run's group, written by the coordinator before the node
    /// processes start (so nodes on other hosts need a shared file system).
    pub fn pki_dir(&self) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("{}-pki", self.fabric))
    }

    /// The data address of node `id`.
    pub fn address(&self, id: u16) -> Option<&str> {
        self.nodes
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, a)| a.as_str())
    }
}

/// Bytes of the region a node exposes for the one-sided operations; the
/// accesses of a phase go to rotating offsets inside it.
pub const ONE_SIDED_REGION: usize = 64 << 20;
/// Largest one-sided access the benchmark makes.
pub const ONE_SIDED_MAX: usize = 16 << 20;

/// The offset of access `i` of sender thread `thread` with `window` in
/// flight: each thread's accesses in flight touch bytes of their own, as
/// far as the region allows.
pub fn one_sided_offset(thread: usize, window: usize, i: u64, size: usize) -> u64 {
    let slots = (ONE_SIDED_REGION / size.max(1)).max(1);
    let slot = (thread * window + (i % window as u64) as usize) % slots;
    (slot * size) as u64
}

/// The lean interface. All methods may be called from many threads at once;
/// `thread` is the caller's sender-thread index (0..threads), which a binding
/// may use to pick a per-thread connection or scratch buffer.
pub trait Binding: Send + Sync {
    /// Connect phase: after it returns this node can send to every peer and
    /// every peer's connections to this node are accepted.
    fn connect(&self, peers: &[u16], timeout: Duration) -> Result<()>;
    /// Sends one message; delivered to the destination's [`Sink`]. May return
    /// before delivery (dxnet returns once the message is in its ring buffer,
    /// `raw-tcp-batched` once it is in its write buffer).
    fn send(&self, thread: usize, dest: u16, payload: &[u8]) -> Result<()>;
    /// Pushes out what `send` left buffered for `dests`. Called by a sender
    /// thread after its last message of a phase (inside the measured time)
    /// and after every message that waits for an answer (latency, echoes).
    /// Bindings that write every message at once need not implement it.
    fn flush(&self, _thread: usize, _dests: &[u16]) -> Result<()> {
        Ok(())
    }
    /// Sends a request of `payload` and blocks until the destination's
    /// same-size response has arrived.
    fn request(&self, thread: usize, dest: u16, payload: &[u8]) -> Result<()>;
    /// One-sided access (`rdma_*` operations): writes `data` (or, with
    /// `read`, reads `data.len()` bytes) at `offset` of the region `dest`
    /// exposes for the benchmark ([`ONE_SIDED_REGION`] bytes). Keeps up to
    /// `window` accesses of this thread in flight: returns once fewer are
    /// (`window` 1: once this one is done).
    fn one_sided(
        &self,
        _thread: usize,
        _dest: u16,
        _read: bool,
        _offset: u64,
        _data: &[u8],
        _window: usize,
    ) -> Result<()> {
        bail!("this binding has no one-sided operations")
    }
    /// Waits until every one-sided access of `thread` is done.
    fn one_sided_drain(&self, _thread: usize) -> Result<()> {
        Ok(())
    }
    /// The binding's statistics of this node's connections (for the
    /// results), if it keeps any.
    fn connection_stats(&self) -> Option<serde_json::Value> {
        None
    }
    /// The binding's per-stage latency histograms of requests so far (dxnet
    /// with `metrics.breakdown`), if it keeps any.
    fn latency_breakdown(&self) -> Option<::dxnet::breakdown::LatencyBreakdown> {
        None
    }
    /// Cleanup phase: closes connections and stops threads.
    fn shutdown(&self);
}

/// Creates the binding instance of node `me`.
pub fn create(setup: &BindingSetup, me: u16, sink: Arc<Sink>) -> Result<Arc<dyn Binding>> {
    let b: Arc<dyn Binding> = match BindingKind::parse(&setup.binding)? {
        BindingKind::RawTcp => Arc::new(raw_tcp::RawTcp::start(setup, me, sink.clone())?),
        BindingKind::RawTcpBatched => Arc::new(raw_tcp_batched::RawTcpBatched::start(
            setup,
            me,
            sink.clone(),
        )?),
        BindingKind::DxnetTcp
        | BindingKind::DxnetTcpTyped
        | BindingKind::DxnetTcpTls
        | BindingKind::DxnetLoopback
        | BindingKind::DxnetIb => Arc::new(dxnet::DxnetBinding::start(setup, me, sink.clone())?),
        BindingKind::RawVerbs => Arc::new(raw_verbs::RawVerbs::start(setup, me, sink.clone())?),
        k @ (BindingKind::IbSendBw
        | BindingKind::IbSendLat
        | BindingKind::IbWriteBw
        | BindingKind::IbWriteLat
        | BindingKind::IbReadBw
        | BindingKind::IbReadLat
        | BindingKind::MpiTcp
        | BindingKind::MpiShm
        | BindingKind::MpichTcp
        | BindingKind::MpichShm) => {
            bail!(
                "{} is run by the coordinator, not in a node process",
                k.name()
            )
        }
    };
    sink.set_binding(Arc::downgrade(&b));
    Ok(b)
}

/// What a [`Sink`] does with each message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum SinkMode {
    /// Count messages and bytes (throughput receivers).
    Count = 0,
    /// Count, then send the message back to its source (latency responder).
    Echo = 1,
    /// Wake the sender thread named by the payload's first byte (latency
    /// initiator).
    Wake = 2,
}

/// A thread waiting for its echoes (latency initiator) or responses
/// (`raw-tcp-batched` requester).
pub struct WaitSlot {
    /// Echoes or responses received.
    pub seq: AtomicU64,
    thread: Thread,
}

impl WaitSlot {
    /// A slot owned by the calling thread.
    pub fn for_current_thread() -> Self {
        WaitSlot {
            seq: AtomicU64::new(0),
            thread: std::thread::current(),
        }
    }

    /// Whether the calling thread owns the slot.
    pub fn is_current_thread(&self) -> bool {
        self.thread.id() == std::thread::current().id()
    }

    /// Counts one arrival and wakes the owner.
    pub fn wake(&self) {
        self.seq.fetch_add(1, Ordering::Release);
        self.thread.unpark();
    }
}

/// Receives every message a binding delivers. Counting is lock-free; the
/// time the expected count is reached is recorded by the delivering thread
/// so that the waiter can poll lazily without skewing the measurement.
pub struct Sink {
    mode: AtomicU8,
    /// Messages and bytes received in this phase, against the expected
    /// count.
    arrivals: ArrivalCount,
    /// Requests answered (never reset; see [`Sink::requests`]).
    requests: AtomicU64,
    done: Mutex<Option<Instant>>,
    done_cv: Condvar,
    slots: RwLock<Vec<Arc<WaitSlot>>>,
    binding: OnceLock<Weak<dyn Binding>>,
    errors: AtomicU64,
    /// Hashing iterations every counted message costs (`handler_work_ns`).
    work_iters: AtomicU64,
    /// How long every counted message blocks its handler (`handler_block_us`).
    block_us: AtomicU64,
}

impl Default for Sink {
    fn default() -> Self {
        Self::new()
    }
}

impl Sink {
    /// A sink in `Count` mode expecting nothing.
    pub fn new() -> Self {
        Sink {
            mode: AtomicU8::new(SinkMode::Count as u8),
            arrivals: ArrivalCount::new(u64::MAX),
            requests: AtomicU64::new(0),
            done: Mutex::new(None),
            done_cv: Condvar::new(),
            slots: RwLock::new(Vec::new()),
            binding: OnceLock::new(),
            errors: AtomicU64::new(0),
            work_iters: AtomicU64::new(0),
            block_us: AtomicU64::new(0),
        }
    }

    fn set_binding(&self, b: Weak<dyn Binding>) {
        let _ = self.binding.set(b);
    }

    /// Resets the counters for a new phase. Only call while no traffic flows.
    pub fn reset(&self, mode: SinkMode, expected: u64) {
        self.mode.store(mode as u8, Ordering::SeqCst);
        self.arrivals.reset(expected);
        self.errors.store(0, Ordering::SeqCst);
        *self.done.lock().unwrap() = None;
        self.slots.write().unwrap().clear();
    }

    /// Registers the calling thread as waiter `index` (index = payload[0]).
    pub fn register_waiter(&self, index: usize) -> Arc<WaitSlot> {
        let slot = Arc::new(WaitSlot::for_current_thread());
        let mut s = self.slots.write().unwrap();
        while s.len() <= index {
            // Placeholders are replaced by the real thread below.
            s.push(slot.clone());
        }
        s[index] = slot.clone();
        slot
    }

    /// Called by the binding for every received message.
    pub fn deliver(&self, src: u16, payload: &[u8]) {
        match self.mode.load(Ordering::Relaxed) {
            m if m == SinkMode::Wake as u8 => {
                let idx = payload.first().copied().unwrap_or(0) as usize;
                let slot = self.slots.read().unwrap().get(idx).cloned();
                if let Some(slot) = slot {
                    slot.wake();
                }
            }
            m if m == SinkMode::Echo as u8 => {
                let thread = payload.first().copied().unwrap_or(0) as usize;
                match self.binding.get().and_then(|w| w.upgrade()) {
                    Some(b) => {
                        let sent = b
                            .send(thread, src, payload)
                            .and_then(|()| b.flush(thread, &[src]));
                        if sent.is_err() {
                            self.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    None => {
                        self.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            _ => {}
        }
        self.count(payload.len());
    }

    /// Called by the binding for every request it answers itself, so that a
    /// responder knows when the initiator is done.
    pub fn note_request(&self, len: usize) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.count(len);
    }

    /// Requests answered since the sink was made (each counted as its
    /// handler runs, before the response leaves).
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Acquire)
    }

    /// Makes every counted message cost `ns` nanoseconds of hashing.
    pub fn set_work_ns(&self, ns: u64) {
        let iters = if ns == 0 {
            0
        } else {
            ns * work_iters_per_us() / 1000
        };
        self.work_iters
            .store(iters.max(u64::from(ns > 0)), Ordering::Relaxed);
    }

    /// Makes every counted message block its handler for `us` microseconds.
    pub fn set_block_us(&self, us: u64) {
        self.block_us.store(us, Ordering::Relaxed);
    }

    fn count(&self, len: usize) {
        let iters = self.work_iters.load(Ordering::Relaxed);
        if iters > 0 {
            std::hint::black_box(hash_work(iters));
        }
        let block = self.block_us.load(Ordering::Relaxed);
        if block > 0 {
            std::thread::sleep(Duration::from_micros(block));
        }
        if self.arrivals.add(len) {
            let now = Instant::now();
            *self.done.lock().unwrap() = Some(now);
            self.done_cv.notify_all();
        }
    }

    /// Messages received in this phase.
    pub fn received(&self) -> u64 {
        self.arrivals.messages()
    }

    /// Payload bytes received in this phase.
    pub fn bytes(&self) -> u64 {
        self.arrivals.bytes()
    }

    /// Echo sends that failed in this phase.
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Acquire)
    }

    /// Waits until the expected count is reached; returns when it was reached.
    pub fn wait_done(&self, deadline: Instant) -> Result<Instant> {
        let mut g = self.done.lock().unwrap();
        loop {
            if let Some(t) = *g {
                return Ok(t);
            }
            let now = Instant::now();
            if now >= deadline {
                bail!(
                    "timed out: received {} of {} messages",
                    self.received(),
                    self.arrivals.expected()
                );
            }
            g = self.done_cv.wait_timeout(g, deadline - now).unwrap().0;
        }
    }
}

/// Waits for `slot.seq >= target`: spins `spin` first (the echo usually comes
/// within microseconds), then parks.
pub fn wait_slot(slot: &WaitSlot, target: u64, spin: Duration, deadline: Instant) -> Result<()> {
    if slot.seq.load(Ordering::Acquire) >= target {
        return Ok(());
    }
    let start = Instant::now();
    let mut i = 0u32;
    loop {
        if slot.seq.load(Ordering::Acquire) >= target {
            return Ok(());
        }
        i = i.wrapping_add(1);
        if i & 63 == 0 {
            let now = Instant::now();
            if now >= deadline {
                bail!("timed out waiting for an echo");
            }
            if now - start >= spin {
                std::thread::park_timeout(Duration::from_millis(1));
            }
        } else {
            std::hint::spin_loop();
        }
    }
}

/// `iters` rounds of a multiply-xorshift hash (the handler work of
/// `params.handler_work_ns`).
fn hash_work(iters: u64) -> u64 {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for i in 0..iters {
        x = (x ^ i).wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 29;
    }
    x
}

/// Rounds of [`hash_work`] per microsecond on this machine, measured once
/// per process (the best of a few 2 ms runs, so preemption during the
/// calibration does not shrink the work).
fn work_iters_per_us() -> u64 {
    static RATE: OnceLock<u64> = OnceLock::new();
    *RATE.get_or_init(|| {
        let mut best = 1u64;
        for _ in 0..5 {
            let start = Instant::now();
            let mut n = 0u64;
            while start.elapsed() < std::time::Duration::from_millis(2) {
                std::hint::black_box(hash_work(1000));
                n += 1000;
            }
            let us = start.elapsed().as_micros().max(1) as u64;
            best = best.max(n / us);
        }
        best
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sink_counts_and_marks_done() {
        let s = Sink::new();
        s.reset(SinkMode::Count, 3);
        s.deliver(1, b"ab");
        s.deliver(1, b"c");
        assert!(s
            .wait_done(Instant::now() + Duration::from_millis(1))
            .is_err());
        s.deliver(2, b"");
        assert_eq!(s.received(), 3);
        assert_eq!(s.bytes(), 3);
        s.wait_done(Instant::now()).unwrap();
        s.reset(SinkMode::Count, 1);
        assert_eq!(s.received(), 0);
    }

    #[test]
    fn sink_wakes_waiter_by_first_byte() {
        let s = Arc::new(Sink::new());
        s.reset(SinkMode::Wake, u64::MAX);
        let slot = s.register_waiter(2);
        let s2 = s.clone();
        let h = std::thread::spawn(move || s2.deliver(1, &[2, 0, 0]));
        wait_slot(
            &slot,
            1,
            Duration::from_micros(10),
            Instant::now() + Duration::from_secs(10),
        )
        .unwrap();
        h.join().unwrap();
    }

    #[test]
    fn one_sided_offsets_stay_inside_and_apart() {
        for (size, window, threads) in [
            (64usize, 16usize, 4usize),
            (1 << 20, 16, 8),
            (16 << 20, 4, 2),
        ] {
            let mut seen = std::collections::HashSet::new();
            for t in 0..threads {
                for i in 0..window as u64 {
                    let off = one_sided_offset(t, window, i, size);
                    assert!(off as usize + size <= ONE_SIDED_REGION);
                    assert_eq!(off as usize % size, 0);
                    seen.insert(off);
                }
            }
            let slots = ONE_SIDED_REGION / size;
            assert_eq!(seen.len(), (threads * window).min(slots), "{size} {window}");
        }
        assert!(BindingKind::DxnetTcp.supports(Operation::RdmaWrite, Mode::Bi, 4, 2));
        assert!(!BindingKind::RawTcp.supports(Operation::RdmaRead, Mode::Uni, 1, 2));
        assert!(!BindingKind::IbSendLat.supports(Operation::RdmaWriteLat, Mode::Uni, 1, 2));
        assert!(BindingKind::IbWriteLat.supports(Operation::RdmaWriteLat, Mode::Uni, 1, 2));
        assert!(!BindingKind::IbWriteLat.supports(Operation::RdmaReadLat, Mode::Uni, 1, 2));
        assert!(BindingKind::IbReadBw.supports(Operation::RdmaRead, Mode::Uni, 1, 2));
        assert!(BindingKind::IbReadBw.supports(Operation::RdmaRead, Mode::Bi, 1, 2));
        assert!(!BindingKind::IbReadBw.supports(Operation::RdmaRead, Mode::Bi, 2, 2));
        assert!(BindingKind::RawVerbs.supports(Operation::RdmaWrite, Mode::Bi, 4, 2));
        assert_eq!(perftest_for(Operation::RdmaReadLat), "ib_read_lat");
    }

    #[test]
    fn binding_names() {
        assert_eq!(BindingKind::parse("raw-tcp").unwrap(), BindingKind::RawTcp);
        for k in [
            BindingKind::RawTcp,
            BindingKind::RawTcpBatched,
            BindingKind::DxnetTcp,
            BindingKind::DxnetTcpTls,
            BindingKind::DxnetTcpTyped,
            BindingKind::DxnetLoopback,
            BindingKind::DxnetIb,
            BindingKind::RawVerbs,
            BindingKind::IbSendBw,
            BindingKind::IbSendLat,
            BindingKind::IbWriteBw,
            BindingKind::IbWriteLat,
            BindingKind::IbReadBw,
            BindingKind::IbReadLat,
            BindingKind::MpiTcp,
            BindingKind::MpiShm,
            BindingKind::MpichTcp,
            BindingKind::MpichShm,
        ] {
            assert_eq!(BindingKind::parse(k.name()).unwrap(), k);
        }
        assert!(BindingKind::parse("bogus").is_err());
        assert!(BindingKind::DxnetIb.has_handlers() && BindingKind::DxnetIb.uses_rdma());
        assert!(!BindingKind::RawVerbs.has_handlers());
        assert!(BindingKind::IbSendLat.is_external());
        assert!(BindingKind::IbSendBw.supports(Operation::Throughput, Mode::Uni, 1, 2));
        assert!(BindingKind::IbSendBw.supports(Operation::Throughput, Mode::Bi, 1, 2));
        assert!(!BindingKind::IbSendBw.supports(Operation::Pingpong, Mode::Uni, 1, 2));
        assert!(!BindingKind::IbSendLat.supports(Operation::Pingpong, Mode::Uni, 2, 2));
        assert!(BindingKind::IbSendLat.supports(Operation::Latency, Mode::Uni, 1, 2));
        assert!(BindingKind::RawVerbs.supports(Operation::AllToAll, Mode::Bi, 4, 6));
        assert_eq!(baselines_of("dxnet-ib"), ["raw-verbs", "perftest"]);
        assert_eq!(baseline_of("dxnet-ib"), Some("raw-verbs"));
        assert_eq!(perftest_for(Operation::Pingpong), "ib_send_lat");
        assert!(is_baseline("ib_send_bw") && is_baseline("raw-verbs") && !is_baseline("dxnet-ib"));
        assert_eq!(
            BindingKind::parse("dxnet-loopback").unwrap(),
            BindingKind::DxnetLoopback
        );
        assert_eq!(baseline_of("dxnet-tcp"), Some("raw-tcp"));
        assert_eq!(
            baselines_of("dxnet-tcp"),
            [
                "raw-tcp",
                "raw-tcp-batched",
                "mpi-tcp",
                "mpi-shm",
                "mpich-tcp",
                "mpich-shm"
            ]
        );
        assert!(is_baseline("mpi-tcp") && BindingKind::MpiShm.is_external());
        assert!(is_baseline("mpich-tcp") && BindingKind::MpichShm.is_mpi());
        assert!(BindingKind::MpiTcp.supports(Operation::AllToAll, Mode::Bi, 16, 4));
        assert!(!BindingKind::MpiTcp.supports(Operation::RdmaWrite, Mode::Uni, 1, 2));
        assert_eq!(baseline_of("raw-tcp"), None);
        assert!(is_baseline("raw-tcp-batched"));
        assert!(!BindingKind::RawTcpBatched.has_handlers());
        assert!(BindingKind::RawTcpBatched.supports(Operation::Pingpong, Mode::Uni, 16, 2));
    }
}
