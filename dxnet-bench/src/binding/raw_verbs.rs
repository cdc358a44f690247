//! `raw-verbs`: the RDMA baseline, what `ib_send_bw` / `ib_send_lat` do,
//! driven through the binding interface (the verbs analogue of `raw-tcp`).
//!
//! * One RC queue pair per (sender thread, peer), so sender threads never
//!   share a queue; endpoints (QPN, PSN, LID, GID) are exchanged over TCP on
//!   the node-map address, as perftest does.
//! * **Send:** every message is copied into a registered send slot and
//!   posted as one SEND work request with its own `ibv_post_send` call (no
//!   chaining, no aggregation); every `signal_every`-th request is signaled
//!   and at most `tx_depth` are outstanding (perftest's `-Q` / `-t`). The
//!   send CQ is polled only when the queue is full.
//! * **Receive:** every incoming queue pair has `rx_depth` receive WRs of
//!   `recv_size` bytes pre-posted on its own receive queue (`-r`). One
//!   receive thread busy-polls the completion queue they share, hands each
//!   message to the sink straight from the receive buffer and re-posts that
//!   WR at once. After `poll_spin_us` without completions it sleeps on the
//!   completion channel (between phases only: traffic keeps it polling).
//! * **Round trips:** a request is a SEND with immediate data marking it;
//!   the receive thread answers it on the same queue pair. The requesting
//!   thread busy-polls the receive CQ of its own queue pair for the
//!   response, so a ping-pong is one message each way.
//! * **One-sided** (`rdma_*`): every node registers a region of
//!   [`ONE_SIDED_REGION`] bytes for remote reads and writes and sends its
//!   address and remote key with its endpoint; a write is posted as one
//!   RDMA WRITE from a send slot (its bytes copied in first only with
//!   `params.rdma_copy`), a read lands in a send slot
//!   (one work request per slot-sized piece), with as many in flight as
//!   the run's window (`params.rdma_window`, the in-flight count of
//!   dxnet's binding too; at most `tx_depth`) and every
//!   `min(signal_every, window)`-th signaled, as `ib_write_bw` and
//!   `ib_read_bw` do with `-t`; with a window of 1 each access is
//!   signaled and awaited.
//! * Plain one-way messages carry no immediate data. Messages larger than
//!   `recv_size` are sent as several work requests of at most `recv_size`
//!   bytes with immediate data, the last one marked; the receiver
//!   reassembles them (RC delivers in order).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use dxnet_verbs::{
    AccessFlags, CompletionChannel, CompletionQueue, ConnectAttr, Context, Endpoint, MemoryRegion,
    ProtectionDomain, QpCaps, QpInit, QueuePair, RecvChain, SendChain, SendFlags, SendOp, Sge,
    WorkCompletion,
};

use super::{Binding, BindingSetup, Sink, ONE_SIDED_REGION};
use crate::config::{RawVerbsParams, RdmaTarget};

/// Immediate data: message kind in the low byte, `LAST` on the final work
/// request of a message.
const KIND_MSG: u32 = 1;
const KIND_REQ: u32 = 2;
const KIND_RESP: u32 = 3;
const KIND_MASK: u32 = 0xff;
const LAST: u32 = 1 << 8;
/// Receive WRs of an outgoing queue pair (it only receives responses, one
/// request is outstanding at a time).
const OUT_RX_DEPTH: u32 = 16;
/// Send slots of an incoming queue pair (it only sends responses).
const RESP_TX_DEPTH: u32 = 16;
/// Hello of a connecting node: node id, sender thread, endpoint.
const HELLO_LEN: usize = 4 + Endpoint::ENCODED_LEN;
/// The answer: endpoint, then the region's address and remote key.
const REPLY_LEN: usize = Endpoint::ENCODED_LEN + 8 + 4;

/// The device side shared by every queue pair of a node.
struct Dev {
    ctx: Context,
    pd: ProtectionDomain,
    attr: ConnectAttr,
    gid_index: Option<u32>,
    psn: AtomicU32,
}

impl Dev {
    fn open(t: &RdmaTarget) -> Result<Dev> {
        let ctx = Context::open(t.device.as_deref())?;
        let pd = ctx.alloc_pd()?;
        let gid8 = t
            .gid_index
            .map(|g| u8::try_from(g).map_err(|_| anyhow!("GID index {g} > 255")))
            .transpose()?;
        let mut attr = ConnectAttr::for_port(&ctx, t.port, gid8)?;
        // RDMA WRITE/READ into the one-sided region, reads in flight as
        // many as the device allows (perftest's `-o`, up to 16).
        attr.access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let da = ctx.query_device()?;
        attr.max_rd_atomic = da.max_qp_init_rd_atom.clamp(1, 16) as u8;
        attr.max_dest_rd_atomic = da.max_qp_rd_atom.clamp(1, 16) as u8;
        Ok(Dev {
            ctx,
            pd,
            attr,
            gid_index: t.gid_index,
            psn: AtomicU32::new(std::process::id().wrapping_mul(2_654_435_761)),
        })
    }

    /// A fresh start PSN and our endpoint for `qp` with it.
    fn endpoint(&self, qp: &QueuePair) -> Result<(ConnectAttr, Endpoint)> {
        let psn = self.psn.fetch_add(0x9e37, Ordering::Relaxed) & 0xff_ffff;
        let attr = ConnectAttr {
            local_psn: psn,
            ..self.attr
        };
        let ep = Endpoint::local(&self.ctx, qp, self.attr.port, self.gid_index, psn)?;
        Ok((attr, ep))
    }
}

/// A queue pair's send side: `depth` registered slots of `slot` bytes, slot
/// `i % depth` for the `i`-th work request.
struct SendQ {
    cq: CompletionQueue,
    buf: MemoryRegion,
    depth: u64,
    slot: usize,
    signal_every: u64,
    posted: u64,
    completed: u64,
    /// `posted` after the last signaled request.
    signaled: u64,
    /// Requests in flight at most now: `depth`, or a one-sided run's
    /// window (then every `min(signal_every, limit)`-th is signaled).
    limit: u64,
    chain: SendChain,
    wcs: Vec<WorkCompletion>,
}

impl SendQ {
    fn new(dev: &Dev, depth: u32, slot: usize, signal_every: u32) -> Result<SendQ> {
        let cq = dev.ctx.create_cq(depth, None)?;
        let buf = dev
            .pd
            .alloc_buffer(depth as usize * slot, AccessFlags::LOCAL_WRITE)?;
        Ok(SendQ {
            cq,
            buf,
            depth: u64::from(depth),
            slot,
            // At most `depth`, so that a full queue always holds a signaled
            // request whose completion frees slots.
            signal_every: u64::from(signal_every.clamp(1, depth)),
            posted: 0,
            completed: 0,
            signaled: 0,
            limit: u64::from(depth),
            chain: SendChain::with_capacity(1, 1),
            wcs: vec![WorkCompletion::default(); 16],
        })
    }

    /// Polls send completions; a signaled completion also completes every
    /// earlier request of the queue.
    fn reap(&mut self) -> Result<usize> {
        let n = self.cq.poll(&mut self.wcs)?;
        for wc in &self.wcs[..n] {
            if !wc.is_success() {
                bail!(
                    "send failed: {} (vendor error {:#x})",
                    wc.status_name(),
                    wc.vendor_err()
                );
            }
            self.completed = self.completed.max(wc.wr_id() + 1);
        }
        Ok(n)
    }

    /// Posts `data` (at most one slot) as one SEND work request, waiting up
    /// to `timeout` for a free slot.
    fn post(
        &mut self,
        qp: &QueuePair,
        data: &[u8],
        imm: Option<u32>,
        timeout: Duration,
    ) -> Result<()> {
        let op = imm.map_or(SendOp::Send, SendOp::SendWithImm);
        self.limit = self.depth;
        self.post_op(qp, op, data, data.len(), false, timeout)
    }

    /// Waits until a slot is free (reaping completions).
    fn wait_room(&mut self, timeout: Duration) -> Result<()> {
        if self.posted - self.completed >= self.limit {
            // The clock only every 1024 empty polls: reading it can be a
            // system call (e.g. the HPET clocksource of an emulated VM).
            let mut start = None;
            let mut spins = 0u32;
            while self.posted - self.completed >= self.limit {
                if self.reap()? == 0 {
                    spins = spins.wrapping_add(1);
                    if spins.is_multiple_of(1024) {
                        let t = *start.get_or_insert_with(Instant::now);
                        if t.elapsed() >= timeout {
                            bail!("no send completion within {timeout:?}");
                        }
                    }
                    std::hint::spin_loop();
                }
            }
        }
        Ok(())
    }

    /// Posts one work request of `op` over the next slot: `data` copied in
    /// first (sends, writes), `len` bytes of the slot named (a read's
    /// destination); `signal` forces a completion.
    fn post_op(
        &mut self,
        qp: &QueuePair,
        op: SendOp,
        data: &[u8],
        len: usize,
        signal: bool,
        timeout: Duration,
    ) -> Result<()> {
        self.wait_room(timeout)?;
        let off = (self.posted % self.depth) as usize * self.slot;
        self.buf.write(off, data)?;
        let sge: [Sge; 1];
        let sges: &[Sge] = if len == 0 {
            &[]
        } else {
            sge = [self.buf.sge(off, len as u32)?];
            &sge
        };
        let signal = signal || (self.posted + 1).is_multiple_of(self.signal_every.min(self.limit));
        let flags = if signal {
            SendFlags::SIGNALED
        } else {
            SendFlags::NONE
        };
        self.chain.clear();
        self.chain.push(self.posted, op, sges, flags);
        qp.post_send(&mut self.chain)?;
        self.posted += 1;
        if signal {
            self.signaled = self.posted;
        }
        Ok(())
    }

    /// Waits until every posted request completed; posts a signaled empty
    /// RDMA WRITE first if the last one was unsignaled.
    fn drain(&mut self, qp: &QueuePair, remote: (u64, u32), timeout: Duration) -> Result<()> {
        if self.completed >= self.posted {
            return Ok(());
        }
        if self.signaled < self.posted {
            let op = SendOp::RdmaWrite {
                remote_addr: remote.0,
                rkey: remote.1,
            };
            self.post_op(qp, op, &[], 0, true, timeout)?;
        }
        let mut start = None;
        let mut spins = 0u32;
        while self.completed < self.posted {
            if self.reap()? == 0 {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(1024)
                    && start.get_or_insert_with(Instant::now).elapsed() >= timeout
                {
                    bail!("no send completion within {timeout:?}");
                }
                std::hint::spin_loop();
            }
        }
        Ok(())
    }

    /// Sends one message of `kind`: a single work request (immediate data
    /// only for requests and responses), or slot-sized pieces.
    fn send_msg(
        &mut self,
        qp: &QueuePair,
        kind: u32,
        data: &[u8],
        timeout: Duration,
    ) -> Result<()> {
        if data.len() <= self.slot {
            let imm = (kind != KIND_MSG).then_some(kind | LAST);
            return self.post(qp, data, imm, timeout);
        }
        let n = data.len().div_ceil(self.slot);
        for (i, piece) in data.chunks(self.slot).enumerate() {
            let last = if i + 1 == n { LAST } else { 0 };
            self.post(qp, piece, Some(kind | last), timeout)?;
        }
        Ok(())
    }
}

/// A queue pair's receive buffers: `depth` slots of `slot` bytes, WR id =
/// slot index.
struct RecvBufs {
    buf: MemoryRegion,
    depth: u32,
    slot: usize,
}

impl RecvBufs {
    fn new(dev: &Dev, depth: u32, slot: usize) -> Result<RecvBufs> {
        let buf = dev
            .pd
            .alloc_buffer(depth as usize * slot, AccessFlags::LOCAL_WRITE)?;
        Ok(RecvBufs { buf, depth, slot })
    }

    /// (Re-)posts receive WR `i`.
    fn post(&self, qp: &QueuePair, chain: &mut RecvChain, i: u64) -> Result<()> {
        chain.clear();
        chain.push(
            i,
            &[self.buf.sge(i as usize * self.slot, self.slot as u32)?],
        );
        qp.post_recv(chain)?;
        Ok(())
    }

    fn post_all(&self, qp: &QueuePair) -> Result<()> {
        let mut chain = RecvChain::with_capacity(1, 1);
        for i in 0..u64::from(self.depth) {
            self.post(qp, &mut chain, i)?;
        }
        Ok(())
    }

    /// The bytes a successful receive completion delivered. Valid until its
    /// WR is re-posted, which callers do only after they are done with it.
    fn data(&self, wc: &WorkCompletion) -> Result<&[u8]> {
        let i = wc.wr_id() as usize;
        let len = wc.byte_len() as usize;
        if i >= self.depth as usize || len > self.slot {
            bail!("bad receive completion: wr {i}, {len} bytes");
        }
        // SAFETY: in bounds of the registered region (checked above), which
        // lives as long as `self`; the device finished writing this slot
        // (its completion was polled) and nothing writes it until the WR is
        // re-posted, after the returned borrow ends (callers' contract).
        Ok(unsafe { std::slice::from_raw_parts(self.buf.addr().add(i * self.slot), len) })
    }
}

/// A queue pair this node opened to a peer for one sender thread.
struct OutConn {
    qp: QueuePair,
    send: SendQ,
    /// The peer's one-sided region: address and remote key.
    remote: (u64, u32),
    recv_cq: CompletionQueue,
    rbufs: RecvBufs,
    rchain: RecvChain,
    wcs: Vec<WorkCompletion>,
}

/// A queue pair a peer opened to this node.
struct InConn {
    src: u16,
    qp: QueuePair,
    rbufs: RecvBufs,
    resp: Mutex<SendQ>,
}

struct Shared {
    me: u16,
    sink: Arc<Sink>,
    dev: Dev,
    opts: RawVerbsParams,
    /// Receive WRs per incoming queue pair (rx_depth, capped by the device).
    rx_depth: u32,
    /// The region peers write and read one-sidedly.
    region: MemoryRegion,
    in_cq: CompletionQueue,
    channel: CompletionChannel,
    incoming: Mutex<Vec<Arc<InConn>>>,
    accepted: AtomicUsize,
    stop: AtomicBool,
    timeout: Duration,
}

/// The raw verbs baseline binding of one node.
pub struct RawVerbs {
    sh: Arc<Shared>,
    setup: BindingSetup,
    out: OnceLock<HashMap<u16, Vec<Mutex<OutConn>>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_context(|| format!("cannot resolve {addr}"))?
        .next()
        .ok_or_else(|| anyhow!("no address for {addr}"))
}

impl RawVerbs {
    /// Initialize phase: opens the device, listens for the peers' queue-pair
    /// exchange and starts the receive thread.
    pub fn start(setup: &BindingSetup, me: u16, sink: Arc<Sink>) -> Result<Self> {
        let addr = setup
            .address(me)
            .ok_or_else(|| anyhow!("node {me} has no address"))?;
        let target = setup.params.rdma.resolve();
        let dev = Dev::open(&target).context("raw-verbs")?;
        let opts = setup.params.raw_verbs.clone();
        // One shared receive CQ must hold every incoming QP's receives.
        let n_in = (setup.nodes.len().saturating_sub(1) * setup.threads.max(1)).max(1) as u32;
        let da = dev.ctx.query_device()?;
        let max_cqe = da.max_cqe.max(1) as u32;
        let rx_depth = opts
            .rx_depth
            .min(da.max_qp_wr.max(1) as u32)
            .min((max_cqe / n_in).max(1));
        let channel = dev.ctx.create_comp_channel()?;
        let in_cq = dev.ctx.create_cq(rx_depth * n_in, Some(&channel))?;
        let listener = TcpListener::bind(resolve(addr)?)
            .with_context(|| format!("cannot listen on {addr}"))?;
        listener.set_nonblocking(true)?;
        let region = dev.pd.alloc_buffer(
            ONE_SIDED_REGION,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )?;
        let sh = Arc::new(Shared {
            me,
            sink,
            dev,
            opts,
            rx_depth,
            region,
            in_cq,
            channel,
            incoming: Mutex::new(Vec::new()),
            accepted: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            timeout: Duration::from_secs(setup.params.timeout_s.max(1)),
        });
        let mut threads = Vec::new();
        let s = sh.clone();
        threads.push(
            std::thread::Builder::new()
                .name(format!("raw-verbs-accept-{me}"))
                .spawn(move || accept_loop(listener, s))?,
        );
        let s = sh.clone();
        threads.push(
            std::thread::Builder::new()
                .name(format!("raw-verbs-rx-{me}"))
                .spawn(move || rx_loop(s))?,
        );
        Ok(RawVerbs {
            sh,
            setup: setup.clone(),
            out: OnceLock::new(),
            threads: Mutex::new(threads),
        })
    }

    fn conn(&self, thread: usize, dest: u16) -> Result<&Mutex<OutConn>> {
        self.out
            .get()
            .ok_or_else(|| anyhow!("not connected"))?
            .get(&dest)
            .and_then(|v| v.get(thread % v.len()))
            .ok_or_else(|| anyhow!("no connection to node {dest}"))
    }

    /// Opens the queue pair of sender thread `t` to node `p` at `addr`.
    fn connect_one(
        &self,
        p: u16,
        t: usize,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<OutConn> {
        let sh = &self.sh;
        let slot = sh.opts.recv_size;
        let send = SendQ::new(&sh.dev, sh.opts.tx_depth, slot, sh.opts.signal_every)?;
        let recv_cq = sh.dev.ctx.create_cq(OUT_RX_DEPTH, None)?;
        let qp = sh.dev.pd.create_rc_qp(&QpInit {
            send_cq: &send.cq,
            recv_cq: &recv_cq,
            srq: None,
            caps: QpCaps {
                max_send_wr: sh.opts.tx_depth,
                max_recv_wr: OUT_RX_DEPTH,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: false,
        })?;
        let rbufs = RecvBufs::new(&sh.dev, OUT_RX_DEPTH, slot)?;
        qp.to_init(sh.dev.attr.port, sh.dev.attr.access)?;
        rbufs.post_all(&qp)?;
        let (attr, mine) = sh.dev.endpoint(&qp)?;

        let mut stream = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => bail!("cannot connect to node {p} at {addr}: {e}"),
            }
        };
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(sh.timeout))?;
        stream.set_write_timeout(Some(sh.timeout))?;
        let mut hello = [0u8; HELLO_LEN];
        hello[..2].copy_from_slice(&sh.me.to_le_bytes());
        hello[2..4].copy_from_slice(&(t as u16).to_le_bytes());
        hello[4..].copy_from_slice(&mine.to_bytes());
        stream.write_all(&hello)?;
        let mut theirs = [0u8; REPLY_LEN];
        stream
            .read_exact(&mut theirs)
            .with_context(|| format!("endpoint of node {p}"))?;
        let e = Endpoint::ENCODED_LEN;
        let peer = Endpoint::from_bytes(&theirs[..e])?;
        let remote = (
            u64::from_le_bytes(theirs[e..e + 8].try_into().expect("8 bytes")),
            u32::from_le_bytes(theirs[e + 8..].try_into().expect("4 bytes")),
        );
        qp.to_rtr(&attr, &peer)?;
        qp.to_rts(&attr)?;
        // The peer counts the connection once ours can receive responses.
        stream.write_all(b"R")?;
        Ok(OutConn {
            qp,
            send,
            remote,
            recv_cq,
            rbufs,
            rchain: RecvChain::with_capacity(1, 1),
            wcs: vec![WorkCompletion::default(); 16],
        })
    }
}

fn accept_loop(listener: TcpListener, sh: Arc<Shared>) {
    while !sh.stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = accept_one(stream, &sh) {
                    eprintln!("raw-verbs node {}: bad incoming connection: {e:#}", sh.me);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => {
                eprintln!("raw-verbs node {}: accept failed: {e}", sh.me);
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Creates the queue pair for a connecting peer: receives pre-posted, RTS,
/// registered with the receive thread, before our endpoint goes back.
fn accept_one(mut stream: TcpStream, sh: &Arc<Shared>) -> Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(sh.timeout))?;
    stream.set_write_timeout(Some(sh.timeout))?;
    let mut hello = [0u8; HELLO_LEN];
    stream.read_exact(&mut hello)?;
    let src = u16::from_le_bytes([hello[0], hello[1]]);
    let peer = Endpoint::from_bytes(&hello[4..])?;
    let slot = sh.opts.recv_size;
    let resp = SendQ::new(&sh.dev, RESP_TX_DEPTH, slot, RESP_TX_DEPTH)?;
    let qp = sh.dev.pd.create_rc_qp(&QpInit {
        send_cq: &resp.cq,
        recv_cq: &sh.in_cq,
        srq: None,
        caps: QpCaps {
            max_send_wr: RESP_TX_DEPTH,
            max_recv_wr: sh.rx_depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
    })?;
    let rbufs = RecvBufs::new(&sh.dev, sh.rx_depth, slot)?;
    qp.to_init(sh.dev.attr.port, sh.dev.attr.access)?;
    rbufs.post_all(&qp)?;
    let (attr, mine) = sh.dev.endpoint(&qp)?;
    qp.to_rtr(&attr, &peer)?;
    qp.to_rts(&attr)?;
    sh.incoming.lock().unwrap().push(Arc::new(InConn {
        src,
        qp,
        rbufs,
        resp: Mutex::new(resp),
    }));
    let mut reply = [0u8; REPLY_LEN];
    let e = Endpoint::ENCODED_LEN;
    reply[..e].copy_from_slice(&mine.to_bytes());
    reply[e..e + 8].copy_from_slice(&(sh.region.addr() as u64).to_le_bytes());
    reply[e + 8..].copy_from_slice(&sh.region.rkey().to_le_bytes());
    stream.write_all(&reply)?;
    let mut ready = [0u8; 1];
    stream.read_exact(&mut ready)?;
    sh.accepted.fetch_add(1, Ordering::AcqRel);
    Ok(())
}

/// The receive thread: busy-polls the incoming queue pairs' CQ, sleeps on
/// its completion channel after `poll_spin_us` without completions.
fn rx_loop(sh: Arc<Shared>) {
    let mut conns: HashMap<u32, (Arc<InConn>, Vec<u8>)> = HashMap::new();
    let mut wcs = vec![WorkCompletion::default(); 64];
    let mut chain = RecvChain::with_capacity(1, 1);
    let spin = Duration::from_micros(sh.opts.poll_spin_us);
    let mut idle_since: Option<Instant> = None;
    let mut empty = 0u32;
    while !sh.stop.load(Ordering::Acquire) {
        let mut n = match sh.in_cq.poll(&mut wcs) {
            Ok(n) => n,
            Err(e) => {
                eprintln!("raw-verbs node {}: {e}", sh.me);
                return;
            }
        };
        if n == 0 {
            // The clock only every 256 empty polls (it can be a system call).
            empty = empty.wrapping_add(1);
            if !empty.is_multiple_of(256) {
                std::hint::spin_loop();
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() < spin {
                continue;
            }
            // Arm, then poll once more: a completion that came before
            // arming raises no event.
            if sh.in_cq.req_notify(false).is_err() {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            n = sh.in_cq.poll(&mut wcs).unwrap_or(0);
            if n == 0 {
                let _ = sh.channel.wait_timeout(Some(Duration::from_millis(20)));
                continue;
            }
        }
        idle_since = None;
        empty = 0;
        for wc in &wcs[..n] {
            if let Err(e) = on_recv(&sh, &mut conns, wc, &mut chain) {
                if !sh.stop.load(Ordering::Acquire) {
                    eprintln!("raw-verbs node {}: {e:#}", sh.me);
                }
            }
        }
    }
}

fn on_recv(
    sh: &Shared,
    conns: &mut HashMap<u32, (Arc<InConn>, Vec<u8>)>,
    wc: &WorkCompletion,
    chain: &mut RecvChain,
) -> Result<()> {
    let qpn = wc.qp_num();
    if !conns.contains_key(&qpn) {
        for c in sh.incoming.lock().unwrap().iter() {
            conns
                .entry(c.qp.qp_num())
                .or_insert_with(|| (c.clone(), Vec::new()));
        }
    }
    let Some((conn, partial)) = conns.get_mut(&qpn) else {
        bail!("receive completion for unknown QP {qpn}");
    };
    if !wc.is_success() {
        if wc.is_flush() {
            return Ok(());
        }
        bail!(
            "receive from node {} failed: {} (vendor error {:#x})",
            conn.src,
            wc.status_name(),
            wc.vendor_err()
        );
    }
    let res = (|| -> Result<()> {
        let data = conn.rbufs.data(wc)?;
        match wc.imm() {
            None => sh.sink.deliver(conn.src, data),
            Some(imm) if imm & LAST == 0 => partial.extend_from_slice(data),
            Some(imm) if partial.is_empty() => dispatch(sh, conn, imm & KIND_MASK, data)?,
            Some(imm) => {
                partial.extend_from_slice(data);
                let r = dispatch(sh, conn, imm & KIND_MASK, partial);
                partial.clear();
                r?
            }
        }
        Ok(())
    })();
    conn.rbufs.post(&conn.qp, chain, wc.wr_id())?;
    res
}

fn dispatch(sh: &Shared, conn: &InConn, kind: u32, data: &[u8]) -> Result<()> {
    match kind {
        KIND_MSG => sh.sink.deliver(conn.src, data),
        KIND_REQ => {
            conn.resp
                .lock()
                .unwrap()
                .send_msg(&conn.qp, KIND_RESP, data, sh.timeout)
                .with_context(|| format!("response to node {}", conn.src))?;
            sh.sink.note_request(data.len());
        }
        other => bail!("node {} sent message kind {other}", conn.src),
    }
    Ok(())
}

impl Binding for RawVerbs {
    fn connect(&self, peers: &[u16], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let me = self.sh.me;
        let threads = self.setup.threads.max(1);
        let mut out = HashMap::new();
        for &p in peers.iter().filter(|&&p| p != me) {
            let addr = resolve(
                self.setup
                    .address(p)
                    .ok_or_else(|| anyhow!("node {p} has no address"))?,
            )?;
            let conns = (0..threads)
                .map(|t| self.connect_one(p, t, addr, deadline).map(Mutex::new))
                .collect::<Result<Vec<_>>>()?;
            out.insert(p, conns);
        }
        let expected = peers.iter().filter(|&&p| p != me).count() * threads;
        self.out
            .set(out)
            .map_err(|_| anyhow!("connect called twice"))?;
        while self.sh.accepted.load(Ordering::Acquire) < expected {
            if Instant::now() >= deadline {
                bail!(
                    "only {} of {expected} peer queue pairs arrived",
                    self.sh.accepted.load(Ordering::Acquire)
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }

    fn send(&self, thread: usize, dest: u16, payload: &[u8]) -> Result<()> {
        let mut c = self.conn(thread, dest)?.lock().unwrap();
        let OutConn { qp, send, .. } = &mut *c;
        send.send_msg(qp, KIND_MSG, payload, self.sh.timeout)
            .with_context(|| format!("send to node {dest}"))
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
        let mut c = self.conn(thread, dest)?.lock().unwrap();
        let OutConn {
            qp, send, remote, ..
        } = &mut *c;
        let slot = send.slot;
        // As many in flight as dxnet's binding keeps: `window`, within the
        // queue's depth.
        send.limit = (window.max(1) as u64).min(send.depth);
        let pieces = data.len().div_ceil(slot).max(1);
        for i in 0..pieces {
            let at = i * slot;
            let len = (data.len() - at).min(slot);
            let addr = remote.0 + offset + at as u64;
            let (op, bytes) = if read {
                (
                    SendOp::RdmaRead {
                        remote_addr: addr,
                        rkey: remote.1,
                    },
                    &[][..],
                )
            } else {
                (
                    SendOp::RdmaWrite {
                        remote_addr: addr,
                        rkey: remote.1,
                    },
                    // In place: the slot's bytes as they are (perftest).
                    if self.setup.params.rdma_copy {
                        &data[at..at + len]
                    } else {
                        &[][..]
                    },
                )
            };
            let last = i + 1 == pieces;
            send.post_op(qp, op, bytes, len, window <= 1 && last, self.sh.timeout)
                .with_context(|| format!("one-sided access to node {dest}"))?;
        }
        if window <= 1 {
            let r = *remote;
            send.drain(qp, r, self.sh.timeout)?;
        }
        Ok(())
    }

    fn one_sided_drain(&self, thread: usize) -> Result<()> {
        let Some(out) = self.out.get() else {
            return Ok(());
        };
        for (dest, conns) in out {
            let mut c = conns[thread % conns.len()].lock().unwrap();
            let OutConn {
                qp, send, remote, ..
            } = &mut *c;
            let r = *remote;
            send.drain(qp, r, self.sh.timeout)
                .with_context(|| format!("one-sided accesses to node {dest}"))?;
        }
        Ok(())
    }

    fn request(&self, thread: usize, dest: u16, payload: &[u8]) -> Result<()> {
        let mut c = self.conn(thread, dest)?.lock().unwrap();
        let OutConn {
            qp,
            send,
            recv_cq,
            rbufs,
            rchain,
            wcs,
            ..
        } = &mut *c;
        send.send_msg(qp, KIND_REQ, payload, self.sh.timeout)
            .with_context(|| format!("request to node {dest}"))?;
        let mut got = 0usize;
        // Busy-poll; the clock only every 1024 empty polls.
        let mut spins = 0u32;
        let mut start = None;
        loop {
            let n = recv_cq.poll(wcs)?;
            if n == 0 {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(1024)
                    && start.get_or_insert_with(Instant::now).elapsed() > self.sh.timeout
                {
                    bail!("no response from node {dest} within {:?}", self.sh.timeout);
                }
                std::hint::spin_loop();
                continue;
            }
            let mut done = false;
            for wc in &wcs[..n] {
                if !wc.is_success() {
                    bail!(
                        "response from node {dest} failed: {} (vendor error {:#x})",
                        wc.status_name(),
                        wc.vendor_err()
                    );
                }
                got += wc.byte_len() as usize;
                rbufs.post(qp, rchain, wc.wr_id())?;
                let imm = wc.imm().unwrap_or(0);
                if imm & KIND_MASK != KIND_RESP {
                    bail!("expected a response from node {dest}, got kind {imm:#x}");
                }
                done |= imm & LAST != 0;
            }
            if done {
                break;
            }
        }
        if got != payload.len() {
            bail!(
                "response of {got} bytes to a {}-byte request",
                payload.len()
            );
        }
        Ok(())
    }

    fn shutdown(&self) {
        self.sh.stop.store(true, Ordering::Release);
        let threads: Vec<_> = self.threads.lock().unwrap().drain(..).collect();
        for h in threads {
            let _ = h.join();
        }
    }
}

impl Drop for RawVerbs {
    fn drop(&mut self) {
        if !self.sh.stop.load(Ordering::Acquire) {
            self.shutdown();
        }
    }
}
