//! `dxnet-tcp`, `dxnet-ib` and `dxnet-loopback`: the library under test.
//!
//! One-way messages use `send_raw` / `register_raw` (no serde on either
//! side: the payload is copied straight into the ring buffer, which is the
//! closest to what the raw baselines do); `dxnet-tcp-typed` sends them as a
//! user's typed message instead ([`BenchMsg`] with `send` / `register`). Request/response uses the typed
//! API (`request` with a `serde_bytes` payload) because that is what an
//! application would call; the handler moves the request's bytes into the
//! same-size response. Loopback nodes are `Node` instances in one process.
//!
//! `dxnet-ib` uses the InfiniBand/RoCE transport; the node-map addresses
//! (`127.0.0.1:port` on one host) are the nodes' UDP connection-handshake
//! addresses, and device, port and GID index come from `params.rdma` or the
//! environment (`RDMA_DEV`, `RDMA_PORT`, `RDMA_GID_INDEX`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use dxnet::config::NodeEntry;
use dxnet::region::{Access, ReadHandle, WriteHandle};
use dxnet::{Buffer, Config, Node, NodeId, Region, RemoteRegion, TlsConfig, TransportKind};
use dxnet::{BufferHandle, SendHandle};
use serde::{Deserialize, Serialize};

use super::{Binding, BindingKind, BindingSetup, Sink, ONE_SIDED_REGION};
use crate::config::RdmaTarget;

/// Message type of all benchmark traffic (type 0 is dxnet's own).
const BENCH_TYPE: u8 = 200;
const SUB_MSG: u8 = 1;
/// `params.buffers`: a request from a buffer (echoed), and its echo.
const SUB_ECHO: u8 = 8;
const SUB_ECHOED: u8 = 9;

/// A one-way message of `dxnet-tcp-typed`: what a user's message with a
/// byte field is (serialized by the sender, deserialized into an owned
/// message by the receiver).
#[derive(Serialize, Deserialize)]
struct BenchMsg(#[serde(with = "serde_bytes")] Vec<u8>);
dxnet::message!(BenchMsg, BENCH_TYPE, SUB_MSG);

#[derive(Serialize, Deserialize)]
struct BenchReq(#[serde(with = "serde_bytes")] Vec<u8>);
#[derive(Serialize, Deserialize)]
struct BenchResp(#[serde(with = "serde_bytes")] Vec<u8>);
dxnet::message!(BenchResp, BENCH_TYPE, 3);
dxnet::request!(BenchReq, BENCH_TYPE, 2 => BenchResp);

/// Connect-phase probe, kept apart from the measured request type.
#[derive(Serialize, Deserialize)]
struct Ping(u16);
#[derive(Serialize, Deserialize)]
struct Pong(u16);
dxnet::message!(Pong, BENCH_TYPE, 5);
dxnet::request!(Ping, BENCH_TYPE, 4 => Pong);

/// Asks a node for the descriptor of its benchmark region (one-sided
/// operations), which it exposes on the first ask.
#[derive(Serialize, Deserialize)]
struct RegionAsk;
#[derive(Serialize, Deserialize)]
struct RegionIs(RemoteRegion);
dxnet::message!(RegionIs, BENCH_TYPE, 7);
dxnet::request!(RegionAsk, BENCH_TYPE, 6 => RegionIs);

/// A one-sided access in flight.
enum InFlight {
    Write(WriteHandle),
    Read(ReadHandle),
    /// From or into a buffer (`params.buffers`), which comes back.
    Buffer(BufferHandle),
}

impl InFlight {
    fn wait(self) -> dxnet::Result<Option<Buffer>> {
        match self {
            InFlight::Write(h) => h.wait().map(|()| None),
            InFlight::Read(h) => h.wait().map(|_| None),
            InFlight::Buffer(h) => {
                let (res, buf) = h.wait();
                res.map(|()| Some(buf))
            }
        }
    }
}

/// A reused buffer (`params.buffers`), replaced after `params.buffer_reuse`
/// uses.
#[derive(Default)]
struct Reused {
    buf: Option<Buffer>,
    uses: u64,
}

impl Reused {
    /// The buffer for the next use: of `len` bytes, filled from `fill`
    /// when new.
    fn next(&mut self, len: usize, reuse: u64, fill: impl FnOnce(&mut Buffer)) -> &mut Buffer {
        let stale = reuse > 0 && self.uses >= reuse;
        if stale || !matches!(&self.buf, Some(b) if b.len() == len) {
            let mut b = Buffer::new(len);
            fill(&mut b);
            self.buf = Some(b);
            self.uses = 0;
        }
        self.uses += 1;
        self.buf.as_mut().expect("just set")
    }
}

/// Per sender thread state of the one-sided operations.
#[derive(Default)]
struct OneSidedThread {
    /// Accesses in flight, with their buffer's uses (`params.buffers`).
    inflight: VecDeque<(InFlight, u64)>,
    /// A blocking read's buffer.
    scratch: Vec<u8>,
    /// The last destination's region (a map lookup per access would be
    /// measured as part of the access).
    last: Option<(u16, RemoteRegion)>,
    /// The own region accesses go from and into in place (unless
    /// `params.rdma_copy`): as large as the largest access so far, holding
    /// the first payload of that size.
    local: Option<Region>,
    /// `params.buffers`: the buffer of blocking accesses, and the free
    /// buffers of async ones.
    reused: Reused,
    free: Vec<Reused>,
}

impl OneSidedThread {
    /// Waits for the oldest accesses until fewer than `window` are in
    /// flight.
    fn make_room(&mut self, window: usize) -> dxnet::Result<()> {
        while self.inflight.len() >= window {
            let (op, uses) = self.inflight.pop_front().expect("non-empty");
            if let Some(buf) = op.wait()? {
                self.free.push(Reused {
                    buf: Some(buf),
                    uses,
                });
            }
        }
        Ok(())
    }
}

/// A dxnet node driven through the lean interface.
pub struct DxnetBinding {
    node: Arc<Node>,
    /// `dxnet-tcp-typed`: one-way messages go as [`BenchMsg`].
    typed: bool,
    /// Per sender thread: the request last sent, reused while the size stays
    /// the same so that the measured loop does not allocate.
    reqs: Vec<Mutex<Option<BenchReq>>>,
    /// The peers' benchmark regions, asked for on first use.
    remotes: RwLock<HashMap<u16, RemoteRegion>>,
    one_sided: Vec<Mutex<OneSidedThread>>,
    /// This node's benchmark region, exposed when a peer first asks.
    _region: Arc<OnceLock<Region>>,
    /// One-sided accesses copy the payload (`write`/`read` of slices)
    /// instead of using an own region in place.
    rdma_copy: bool,
    timeout: Duration,
    /// `params.buffers`: per requester thread, its reused buffer and the
    /// echo it waits for.
    buffers: Option<Vec<BufferThread>>,
    /// `params.buffer_reuse`.
    buffer_reuse: u64,
    /// `params.spin_us`.
    spin: Duration,
}

/// A requester thread of `params.buffers`: the buffer it sends from, and
/// the buffer its echo is copied into (set by the echo's receiver).
struct BufferThread {
    send: Mutex<Reused>,
    echo: Arc<Echo>,
}

/// Where a requester thread's echo lands.
#[derive(Default)]
struct Echo {
    slot: Mutex<EchoSlot>,
    arrived: Condvar,
    /// Set once the slot holds the echo: the requester spins on it for
    /// `params.spin_us` before it waits on `arrived`, like the other
    /// bindings' latency waiters.
    ready: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct EchoSlot {
    buf: Vec<u8>,
    arrived: bool,
}

/// `params.buffers`: the echo receivers. A request is copied into the
/// node's reused buffer of its size and sent back from it
/// (`send_buffer_async`; the buffer comes back before the next echo of
/// that size); an echo is copied into its requester thread's slot (what an
/// MPI receive into the application's buffer does).
fn register_echo(node: &Arc<Node>, threads: usize, sink: Arc<Sink>) -> Result<Vec<BufferThread>> {
    let bufs: Vec<BufferThread> = (0..threads)
        .map(|_| BufferThread {
            send: Mutex::default(),
            echo: Arc::default(),
        })
        .collect();
    // Per size: the last echo sent from that size's buffer (long done
    // when the next request of that size comes).
    let last: Arc<Mutex<HashMap<usize, SendHandle>>> = Arc::default();
    let weak = Arc::downgrade(node);
    node.register_raw(BENCH_TYPE, SUB_ECHO, move |src, p| {
        let Some(node) = weak.upgrade() else { return };
        sink.note_request(p.len());
        let prev = last.lock().unwrap().remove(&p.len());
        let mut b = match prev.map(SendHandle::wait) {
            Some((Ok(()), b)) => b,
            Some((Err(e), b)) => {
                eprintln!("echo to node {}: {e}", src.0);
                b
            }
            None => Buffer::new(p.len()),
        };
        b.copy_from_slice(p);
        let h = node.send_buffer_async(src, BENCH_TYPE, SUB_ECHOED, b);
        last.lock().unwrap().insert(p.len(), h);
    })
    .map_err(|e| anyhow!("{e}"))?;
    let slots: Vec<_> = bufs.iter().map(|b| b.echo.clone()).collect();
    node.register_raw(BENCH_TYPE, SUB_ECHOED, move |_src, p| {
        let Some(t) = p
            .get(..4)
            .map(|t| u32::from_le_bytes(t.try_into().unwrap()))
        else {
            return;
        };
        let Some(echo) = slots.get(t as usize) else {
            return;
        };
        let mut g = echo.slot.lock().unwrap();
        g.buf.clear();
        g.buf.extend_from_slice(p);
        g.arrived = true;
        echo.ready.store(true, Ordering::Release);
        echo.arrived.notify_one();
    })
    .map_err(|e| anyhow!("{e}"))?;
    Ok(bufs)
}

/// The dxnet configuration of node `me`: the binding's node map and
/// transport (and RDMA device), then the user's `params.dxnet` fields
/// (objects such as `ib` are merged key by key), then the handler count.
pub fn node_config(setup: &BindingSetup, me: u16) -> Result<Config> {
    node_config_with(setup, me, setup.params.rdma.resolve())
}

/// Points `c`'s InfiniBand engine at `rdma` (device, port, GID index).
pub fn set_rdma_target(c: &mut Config, rdma: RdmaTarget) -> Result<()> {
    c.ib.device = rdma.device.unwrap_or_default();
    c.ib.port = rdma.port;
    c.ib.gid_index = match rdma.gid_index {
        Some(g) => u8::try_from(g).map_err(|_| anyhow!("GID index {g} > 255"))?,
        None => 0,
    };
    Ok(())
}

fn node_config_with(setup: &BindingSetup, me: u16, rdma: RdmaTarget) -> Result<Config> {
    let kind = BindingKind::parse(&setup.binding)?;
    let base = match kind {
        BindingKind::DxnetLoopback => Config::loopback(me, setup.nodes.len() as u16, &setup.fabric),
        BindingKind::DxnetTcp
        | BindingKind::DxnetTcpTyped
        | BindingKind::DxnetTcpTls
        | BindingKind::DxnetIb => {
            let mut c = Config::default();
            c.node_id = me;
            c.nodes = setup
                .nodes
                .iter()
                .map(|(id, a)| NodeEntry::new(*id, a.clone()))
                .collect();
            c.transport = if kind == BindingKind::DxnetIb {
                TransportKind::Ib
            } else {
                TransportKind::Tcp
            };
            set_rdma_target(&mut c, rdma)?;
            c.tls = (kind == BindingKind::DxnetTcpTls).then(|| {
                let dir = setup.pki_dir();
                let file = |ext: &str| dir.join(format!("node-{me}.{ext}")).display().to_string();
                TlsConfig::new(
                    file("pem"),
                    file("key"),
                    dir.join("ca.pem").display().to_string(),
                )
            });
            c
        }
        other => bail!("{} is not a dxnet binding", other.name()),
    };
    let mut fields = setup.params.dxnet.clone();
    if setup.handlers > 0 {
        fields.insert("handler_threads".into(), setup.handlers.into());
    }
    with_fields(&base, &fields)
}

/// Lays one `--dxnet KEY=VALUE` setting over `fields` (dxnet `Config`
/// fields as JSON): `limits.orb_size=4194304` becomes
/// `{"limits": {"orb_size": 4194304}}`, merged into what is there; a value
/// that is not JSON is a string.
pub(crate) fn merge_setting(
    fields: &mut serde_json::Map<String, serde_json::Value>,
    kv: &str,
) -> Result<()> {
    let (k, v) = kv
        .split_once('=')
        .with_context(|| format!("--dxnet expects KEY=VALUE, got {kv:?}"))?;
    let mut val = serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String(v.into()));
    let mut path: Vec<&str> = k.trim().split('.').collect();
    let first = path.remove(0).to_string();
    for key in path.into_iter().rev() {
        let mut m = serde_json::Map::new();
        m.insert(key.to_string(), val);
        val = serde_json::Value::Object(m);
    }
    merge(fields.entry(first).or_insert(serde_json::Value::Null), &val);
    Ok(())
}

/// `base` with `fields` (dxnet `Config` fields as JSON) laid over it; the
/// fields that name the node and its peers are refused.
pub(crate) fn with_fields(
    base: &Config,
    fields: &serde_json::Map<String, serde_json::Value>,
) -> Result<Config> {
    let mut v = serde_json::to_value(base)?;
    let obj = v.as_object_mut().expect("Config serializes to an object");
    for (k, val) in fields {
        if matches!(k.as_str(), "node_id" | "nodes" | "transport" | "loopback") {
            bail!("dxnet.{k} is set by the benchmark itself");
        }
        merge(obj.entry(k.clone()).or_insert(serde_json::Value::Null), val);
    }
    let cfg: Config = serde_json::from_value(v).context("invalid dxnet settings")?;
    cfg.validate().map_err(|e| anyhow!("dxnet config: {e}"))?;
    Ok(cfg)
}

/// Lays `src` over `dst`: objects key by key (recursively), anything else
/// replaces.
pub(crate) fn merge(dst: &mut serde_json::Value, src: &serde_json::Value) {
    match (dst, src) {
        (serde_json::Value::Object(d), serde_json::Value::Object(s)) => {
            for (k, v) in s {
                merge(d.entry(k.clone()).or_insert(serde_json::Value::Null), v);
            }
        }
        (d, s) => *d = s.clone(),
    }
}

impl DxnetBinding {
    /// Initialize phase: starts the node and registers the receivers.
    pub fn start(setup: &BindingSetup, me: u16, sink: Arc<Sink>) -> Result<Self> {
        let cfg = node_config(setup, me)?;
        let node = Node::start(cfg).map_err(|e| anyhow!("dxnet node {me}: {e}"))?;
        let typed = BindingKind::parse(&setup.binding)? == BindingKind::DxnetTcpTyped;
        let s = sink.clone();
        let deliver = move |src: NodeId, payload: &[u8]| s.deliver(src.0, payload);
        let s = sink.clone();
        let deliver_typed = move |src: NodeId, m: BenchMsg| s.deliver(src.0, &m.0);
        let echo_sink = sink.clone();
        let s = sink;
        let answer = move |_src, req: BenchReq| {
            s.note_request(req.0.len());
            BenchResp(req.0)
        };
        match (setup.params.parallel_handlers, typed) {
            (true, false) => node.register_raw_parallel(BENCH_TYPE, SUB_MSG, deliver),
            (true, true) => node.register_parallel::<BenchMsg, _>(deliver_typed),
            (false, false) => node.register_raw(BENCH_TYPE, SUB_MSG, deliver),
            (false, true) => node.register::<BenchMsg, _>(deliver_typed),
        }
        .and_then(|()| {
            if setup.params.parallel_handlers {
                node.register_request_parallel::<BenchReq, _>(answer)
            } else {
                node.register_request::<BenchReq, _>(answer)
            }
        })
        .map_err(|e| anyhow!("{e}"))?;
        node.register_request::<Ping, _>(move |_src, p: Ping| Pong(p.0))
            .map_err(|e| anyhow!("{e}"))?;
        let node = Arc::new(node);
        let threads = setup.threads.max(1);
        let buffers = setup
            .params
            .buffers
            .then(|| register_echo(&node, threads, echo_sink))
            .transpose()?;
        let region: Arc<OnceLock<Region>> = Arc::default();
        let (r, weak): (_, Weak<Node>) = (region.clone(), Arc::downgrade(&node));
        node.register_request::<RegionAsk, _>(move |_src, _| {
            let node = weak.upgrade().expect("the node runs its own handlers");
            let region = r.get_or_init(|| {
                node.expose(ONE_SIDED_REGION, Access::ReadWrite)
                    .expect("benchmark region")
            });
            RegionIs(region.descriptor())
        })
        .map_err(|e| anyhow!("{e}"))?;
        Ok(DxnetBinding {
            node,
            typed,
            reqs: (0..threads).map(|_| Mutex::new(None)).collect(),
            remotes: RwLock::default(),
            one_sided: (0..threads).map(|_| Mutex::default()).collect(),
            _region: region,
            rdma_copy: setup.params.rdma_copy,
            timeout: Duration::from_secs(setup.params.timeout_s.max(1)),
            buffers,
            buffer_reuse: setup.params.buffer_reuse,
            spin: Duration::from_micros(setup.params.spin_us),
        })
    }

    /// [`Binding::one_sided`] from and into reused buffers
    /// (`params.buffers`).
    fn one_sided_buffer(
        &self,
        st: &mut OneSidedThread,
        remote: &RemoteRegion,
        read: bool,
        offset: u64,
        data: &[u8],
        window: usize,
    ) -> Result<()> {
        let fail = |e: dxnet::Error| anyhow!("one-sided access to node {}: {e}", remote.node().0);
        let reuse = self.buffer_reuse;
        if window <= 1 {
            let buf = st
                .reused
                .next(data.len(), reuse, |b| b.copy_from_slice(data));
            return if read {
                self.node.read_buffer(remote, offset, buf)
            } else {
                self.node.write_buffer(remote, offset, buf)
            }
            .map_err(fail);
        }
        st.make_room(window).map_err(fail)?;
        let mut r = st.free.pop().unwrap_or_default();
        r.next(data.len(), reuse, |b| b.copy_from_slice(data));
        let buf = r.buf.take().expect("set by next");
        let h = if read {
            self.node.read_buffer_async(remote, offset, buf)
        } else {
            self.node.write_buffer_async(remote, offset, buf)
        };
        st.inflight.push_back((InFlight::Buffer(h), r.uses));
        Ok(())
    }

    /// [`Binding::request`] of `params.buffers`: the thread's buffer sent
    /// with `send_buffer`, the echo awaited.
    fn request_buffer(
        &self,
        bufs: &[BufferThread],
        thread: usize,
        dest: u16,
        payload: &[u8],
    ) -> Result<()> {
        if payload.len() < 4 {
            bail!("--buffers needs requests of at least 4 bytes (the thread's number)");
        }
        let me = &bufs[thread % bufs.len()];
        let mut send = me.send.lock().unwrap();
        // Filled once, like a reused send buffer.
        send.next(payload.len(), self.buffer_reuse, |b| {
            b.copy_from_slice(payload);
            b[..4].copy_from_slice(&(thread as u32).to_le_bytes());
        });
        let echo = &*me.echo;
        echo.slot.lock().unwrap().arrived = false;
        echo.ready.store(false, Ordering::Release);
        // Async: a send in place completes while the echo is awaited.
        let out = send.buf.take().expect("set by next");
        let sending = self
            .node
            .send_buffer_async(NodeId(dest), BENCH_TYPE, SUB_ECHO, out);
        let spin_end = Instant::now() + self.spin;
        let mut n = 0u32;
        while !echo.ready.load(Ordering::Acquire) {
            n = n.wrapping_add(1);
            if n.is_multiple_of(64) && Instant::now() >= spin_end {
                break;
            }
            std::hint::spin_loop();
        }
        let end = Instant::now() + self.timeout;
        let (slot, arrived) = (&echo.slot, &echo.arrived);
        let mut g = slot.lock().unwrap();
        while !g.arrived {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("no echo from node {dest} within {:?}", self.timeout);
            }
            g = arrived.wait_timeout(g, left).unwrap().0;
        }
        if g.buf.len() != payload.len() {
            bail!("echo of {} bytes to {}", g.buf.len(), payload.len());
        }
        drop(g);
        let (res, back) = sending.wait();
        send.buf = Some(back);
        res.map_err(|e| anyhow!("send to node {dest}: {e}"))
    }

    /// [`Binding::one_sided`] from and into the thread's own region in
    /// place (`write_from`, `read_into`).
    fn one_sided_in_place(
        &self,
        st: &mut OneSidedThread,
        remote: &RemoteRegion,
        read: bool,
        offset: u64,
        data: &[u8],
        window: usize,
    ) -> Result<()> {
        let dest = remote.node();
        let fail = |e: dxnet::Error| anyhow!("one-sided access to node {dest}: {e}");
        let len = data.len();
        if st.local.as_ref().is_none_or(|r| r.len() < len) {
            // Finished first (accesses in flight keep their memory anyway).
            st.make_room(1).map_err(fail)?;
            let r = self
                .node
                .expose(len.max(1), Access::LocalOnly)
                .map_err(fail)?;
            r.write(0, data).map_err(fail)?;
            st.local = Some(r);
        }
        if window <= 1 {
            let local = st.local.as_ref().expect("made above");
            return if read {
                self.node.read_into(remote, offset, local, 0, len)
            } else {
                self.node.write_from(remote, offset, local, 0, len)
            }
            .map_err(fail);
        }
        st.make_room(window).map_err(fail)?;
        let local = st.local.as_ref().expect("made above");
        let h = if read {
            self.node.read_into_async(remote, offset, local, 0, len)
        } else {
            self.node.write_from_async(remote, offset, local, 0, len)
        };
        st.inflight
            .push_back((InFlight::Write(h.map_err(fail)?), 0));
        Ok(())
    }

    /// `dest`'s benchmark region (asked for once).
    fn remote(&self, dest: u16) -> Result<RemoteRegion> {
        if let Some(r) = self.remotes.read().unwrap().get(&dest) {
            return Ok(*r);
        }
        let RegionIs(r) = self
            .node
            .request(NodeId(dest), &RegionAsk, self.timeout)
            .map_err(|e| anyhow!("asking node {dest} for its region: {e}"))?;
        self.remotes.write().unwrap().insert(dest, r);
        Ok(r)
    }
}

impl Binding for DxnetBinding {
    fn connect(&self, peers: &[u16], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let me = self.node.id().0;
        for &p in peers.iter().filter(|&&p| p != me) {
            loop {
                match self
                    .node
                    .request(NodeId(p), &Ping(me), Duration::from_secs(1))
                {
                    Ok(Pong(x)) if x == me => break,
                    Ok(_) => bail!("node {p} answered a ping wrongly"),
                    Err(e) if Instant::now() >= deadline => {
                        bail!("cannot reach node {p}: {e}")
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
        Ok(())
    }

    fn send(&self, _thread: usize, dest: u16, payload: &[u8]) -> Result<()> {
        let sent = if self.typed {
            // The calling thread's message, filled with each payload:
            // reused so that the measured loop does not allocate, as a
            // sender reusing its message would. Per OS thread, not per
            // `thread` index: handler threads echo too (latency).
            thread_local!(static MSG: std::cell::RefCell<BenchMsg> =
                const { std::cell::RefCell::new(BenchMsg(Vec::new())) });
            MSG.with_borrow_mut(|m| {
                m.0.clear();
                m.0.extend_from_slice(payload);
                self.node.send(NodeId(dest), m)
            })
        } else {
            self.node
                .send_raw(NodeId(dest), BENCH_TYPE, SUB_MSG, payload)
        };
        sent.map_err(|e| anyhow!("send to node {dest}: {e}"))
    }

    fn request(&self, thread: usize, dest: u16, payload: &[u8]) -> Result<()> {
        if let Some(bufs) = &self.buffers {
            return self.request_buffer(bufs, thread, dest, payload);
        }
        let mut slot = self.reqs[thread % self.reqs.len()].lock().unwrap();
        if !matches!(slot.as_ref(), Some(r) if r.0.len() == payload.len()) {
            *slot = Some(BenchReq(payload.to_vec()));
        }
        let req = slot.as_ref().unwrap();
        let resp = self
            .node
            .request(NodeId(dest), req, self.timeout)
            .map_err(|e| anyhow!("request to node {dest}: {e}"))?;
        if resp.0.len() != payload.len() {
            bail!(
                "response of {} bytes to a {}-byte request",
                resp.0.len(),
                payload.len()
            );
        }
        Ok(())
    }

    fn one_sided(
        &self,
        thread: usize,
        dest: u16,
        read: bool,
        offset: u64,
        data: &[u8],
        window: usize,
    ) -> Result<()> {
        let mut guard = self.one_sided[thread % self.one_sided.len()]
            .lock()
            .unwrap();
        let st = &mut *guard;
        let remote = match st.last {
            Some((d, r)) if d == dest => r,
            _ => {
                let r = self.remote(dest)?;
                st.last = Some((dest, r));
                r
            }
        };
        let fail = |e: dxnet::Error| anyhow!("one-sided access to node {dest}: {e}");
        if self.buffers.is_some() {
            return self.one_sided_buffer(st, &remote, read, offset, data, window);
        }
        if !self.rdma_copy {
            return self.one_sided_in_place(st, &remote, read, offset, data, window);
        }
        if window <= 1 {
            return if read {
                st.scratch.resize(data.len(), 0);
                self.node
                    .read(&remote, offset, &mut st.scratch)
                    .map_err(fail)
            } else {
                self.node.write(&remote, offset, data).map_err(fail)
            };
        }
        st.make_room(window).map_err(fail)?;
        let op = if read {
            InFlight::Read(
                self.node
                    .read_async(&remote, offset, data.len())
                    .map_err(fail)?,
            )
        } else {
            InFlight::Write(self.node.write_async(&remote, offset, data).map_err(fail)?)
        };
        st.inflight.push_back((op, 0));
        Ok(())
    }

    fn one_sided_drain(&self, thread: usize) -> Result<()> {
        let mut st = self.one_sided[thread % self.one_sided.len()]
            .lock()
            .unwrap();
        st.make_room(1)
            .map_err(|e| anyhow!("one-sided access in flight: {e}"))
    }

    fn connection_stats(&self) -> Option<serde_json::Value> {
        Some(serde_json::json!({
            "node": self.node.id().0,
            "connections": self.node.connection_stats(),
        }))
    }

    fn latency_breakdown(&self) -> Option<dxnet::breakdown::LatencyBreakdown> {
        self.node.latency_breakdown()
    }

    fn shutdown(&self) {
        if self.buffers.is_some() {
            let st = self.node.stats();
            eprintln!(
                "node {}: zero-copy costs {:?}; accesses in place {}, copied {}, registrations {}, evictions {}",
                self.node.id().0,
                self.node.zero_copy_costs(),
                st.zero_copy_in_place,
                st.zero_copy_copied,
                st.buffer_registrations,
                st.buffer_evictions
            );
        }
        // The node stops when the binding is dropped (Node's Drop joins its
        // threads); nothing may be in flight by now.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Params;

    fn setup(binding: &str) -> BindingSetup {
        let mut params = Params::default();
        params
            .dxnet
            .insert("limits".into(), serde_json::json!({"orb_size": 1_048_576}));
        BindingSetup {
            binding: binding.into(),
            nodes: vec![(0, "127.0.0.1:1".into()), (1, "127.0.0.1:2".into())],
            threads: 1,
            handlers: 3,
            params,
            fabric: "t".into(),
        }
    }

    #[test]
    fn config_layers() {
        let c = node_config(&setup("dxnet-tcp"), 1).unwrap();
        assert_eq!(c.node_id, 1);
        assert_eq!(c.transport, TransportKind::Tcp);
        assert_eq!(c.limits.orb_size, 1_048_576);
        assert_eq!(c.handler_threads, 3);
        assert_eq!(c.nodes.len(), 2);
        let l = node_config(&setup("dxnet-loopback"), 0).unwrap();
        assert_eq!(l.transport, TransportKind::Loopback);
        assert_eq!(l.loopback.fabric, "t");
        let mut bad = setup("dxnet-tcp");
        bad.params
            .dxnet
            .insert("nodes".into(), serde_json::json!([]));
        assert!(node_config(&bad, 0).is_err());
        let mut bad = setup("dxnet-tcp");
        bad.params.dxnet.insert("no_such_field".into(), 1.into());
        assert!(node_config(&bad, 0).is_err());
    }

    #[test]
    fn settings_merge_by_path_and_refuse_node_identity() {
        let mut f = serde_json::Map::new();
        merge_setting(&mut f, "limits.orb_size=524288").unwrap();
        merge_setting(&mut f, "limits.recv_buffer_size=262144").unwrap();
        merge_setting(&mut f, "tcp.rings=2").unwrap();
        assert!(merge_setting(&mut f, "no_equals_sign").is_err());
        let c = with_fields(&Config::tcp_localhost(0, 2, 27000), &f).unwrap();
        assert_eq!(c.limits.orb_size, 524288);
        assert_eq!(c.limits.recv_buffer_size, Some(262144));
        assert_eq!(c.tcp.rings, 2);
        merge_setting(&mut f, "node_id=1").unwrap();
        assert!(with_fields(&Config::tcp_localhost(0, 2, 27000), &f).is_err());
    }

    #[test]
    fn ib_config_takes_device_and_merges_ib_fields() {
        let mut s = setup("dxnet-ib");
        s.params
            .dxnet
            .insert("ib".into(), serde_json::json!({"sq_size": 64}));
        let rdma = RdmaTarget {
            device: Some("rxe0".into()),
            port: 1,
            gid_index: Some(1),
        };
        let c = node_config_with(&s, 1, rdma.clone()).unwrap();
        assert_eq!(c.transport, TransportKind::Ib);
        assert_eq!(c.ib.device, "rxe0");
        assert_eq!(c.ib.gid_index, 1);
        assert_eq!(c.ib.sq_size, 64, "user field merged into ib");
        assert_eq!(c.nodes[1].address, "127.0.0.1:2", "UDP exchange address");
        s.params
            .dxnet
            .insert("ib".into(), serde_json::json!({"device": "mlx5_0"}));
        assert_eq!(
            node_config_with(&s, 1, rdma).unwrap().ib.device,
            "mlx5_0",
            "params.dxnet wins"
        );
    }
}
