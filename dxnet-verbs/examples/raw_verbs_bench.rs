//! Raw-verbs baseline for dxnet-bench: RC SEND bandwidth and ping-pong
//! latency between two processes, with nothing but dxnet-verbs in between.
//!
//! * `bw`: the client posts one SEND work request per message (one
//!   `ibv_post_send` call each, no chaining), keeping up to `--tx-depth`
//!   outstanding and signaling every `--signal-every`-th; the server has
//!   `--rx-depth` receive WRs pre-posted on the QP's receive queue and
//!   re-posts each one as soon as its completion is polled.
//! * `lat`: ping-pong of `--size`-byte SENDs, busy-polling; latency = round
//!   trip / 2, reported as percentiles.
//!
//! Results go to stdout as one JSON object per line:
//! `{"operation":"send","mode":"bw","binding":"raw-verbs","size":64,
//!   "msgs":100000,"seconds":..,"msgs_per_sec":..,"bytes_per_sec":..,"lat_us":null,...}`
//! and for `lat` `"lat_us":{"min":..,"avg":..,"p50":..,"p90":..,"p99":..,"p999":..,"max":..}`.
//!
//! ```text
//! raw_verbs_bench [both|server|client] --mode bw|lat [--size B] [--iters N]
//!     [--tcp-port P] [--tx-depth N] [--rx-depth N] [--signal-every N]
//!     [--dev NAME] [--ib-port N] [--gid-index N]
//! ```
//! `both` (the default) runs the server as a child process. Device, port and
//! GID index default to $RDMA_DEV, $RDMA_PORT, $RDMA_GID_INDEX. QP
//! information is exchanged over TCP on 127.0.0.1.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use dxnet_verbs::*;

#[derive(Clone, Debug)]
struct Opts {
    role: String,
    mode: String,
    size: usize,
    iters: u64,
    tcp_port: u16,
    tx_depth: u32,
    rx_depth: u32,
    signal_every: u32,
    dev: Option<String>,
    ib_port: u8,
    gid_index: Option<u32>,
}

fn die(msg: &str) -> ! {
    eprintln!("raw_verbs_bench: {msg}");
    std::process::exit(2)
}

fn parse() -> Opts {
    let env = |n: &str| std::env::var(n).ok();
    let mut o = Opts {
        role: "both".into(),
        mode: "bw".into(),
        size: 64,
        iters: 0,
        tcp_port: 18700,
        tx_depth: 128,
        rx_depth: 512,
        signal_every: 100,
        dev: env("RDMA_DEV"),
        ib_port: env("RDMA_PORT").and_then(|v| v.parse().ok()).unwrap_or(1),
        gid_index: env("RDMA_GID_INDEX").and_then(|v| v.parse().ok()),
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if matches!(a, "both" | "server" | "client") {
            o.role = a.into();
            i += 1;
            continue;
        }
        let v = args
            .get(i + 1)
            .cloned()
            .unwrap_or_else(|| die(&format!("{a} needs a value")));
        let num = |v: &str| -> u64 {
            v.parse()
                .unwrap_or_else(|_| die(&format!("bad value for {a}: {v}")))
        };
        match a {
            "--mode" if v == "bw" || v == "lat" => o.mode = v,
            "--size" => o.size = num(&v) as usize,
            "--iters" => o.iters = num(&v),
            "--tcp-port" => o.tcp_port = num(&v) as u16,
            "--tx-depth" => o.tx_depth = num(&v).max(1) as u32,
            "--rx-depth" => o.rx_depth = num(&v).max(1) as u32,
            "--signal-every" => o.signal_every = num(&v).max(1) as u32,
            "--dev" => o.dev = Some(v),
            "--ib-port" => o.ib_port = num(&v) as u8,
            "--gid-index" => o.gid_index = Some(num(&v) as u32),
            _ => die(&format!(
                "unknown argument {a} (see the source header for usage)"
            )),
        }
        i += 2;
    }
    if o.iters == 0 {
        o.iters = if o.mode == "lat" {
            10_000
        } else if o.size >= 16384 {
            2_000
        } else {
            50_000
        };
    }
    o.signal_every = o.signal_every.min(o.tx_depth);
    o
}

struct Node {
    ctx: Context,
    qp: QueuePair,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    mr: MemoryRegion,
    slot: usize,
    rx_depth: u32,
}

impl Node {
    fn new(o: &Opts) -> Result<Node> {
        let ctx = Context::open(o.dev.as_deref())?;
        let pd = ctx.alloc_pd()?;
        let send_cq = ctx.create_cq(o.tx_depth, None)?;
        let recv_cq = ctx.create_cq(o.rx_depth, None)?;
        let qp = pd.create_rc_qp(&QpInit {
            send_cq: &send_cq,
            recv_cq: &recv_cq,
            srq: None,
            caps: QpCaps {
                max_send_wr: o.tx_depth,
                max_recv_wr: o.rx_depth,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: false,
        })?;
        // receive slots + one send slot, each `size` bytes (at least 1)
        let slot = o.size.max(1);
        let mr = pd.alloc_buffer((o.rx_depth as usize + 1) * slot, AccessFlags::LOCAL_WRITE)?;
        let node = Node {
            ctx,
            qp,
            send_cq,
            recv_cq,
            mr,
            slot,
            rx_depth: o.rx_depth,
        };
        Ok(node)
    }

    fn post_all_recvs(&self, size: usize) -> Result<()> {
        let mut chain = RecvChain::new();
        for i in 0..self.rx_depth as u64 {
            chain.clear();
            chain.push(i, &[self.mr.sge(i as usize * self.slot, size as u32)?]);
            self.qp.post_recv(&mut chain)?;
        }
        Ok(())
    }

    fn send_sge(&self, size: usize) -> Result<Vec<Sge>> {
        if size == 0 {
            Ok(vec![])
        } else {
            Ok(vec![self
                .mr
                .sge(self.rx_depth as usize * self.slot, size as u32)?])
        }
    }

    fn connect(&self, o: &Opts, stream: &mut TcpStream, psn: u32) -> Result<()> {
        let gid8 = o.gid_index.map(|g| g as u8);
        let attr = ConnectAttr {
            local_psn: psn,
            ..ConnectAttr::for_port(&self.ctx, o.ib_port, gid8)?
        };
        let me = Endpoint::local(&self.ctx, &self.qp, o.ib_port, o.gid_index, psn)?;
        stream.write_all(&me.to_bytes()).map_err(io_err)?;
        let mut buf = [0u8; Endpoint::ENCODED_LEN];
        stream.read_exact(&mut buf).map_err(io_err)?;
        // receives can only be posted from INIT on; they must be in place
        // before the peer may send (RTR + the sync below)
        self.qp.to_init(attr.port, attr.access)?;
        self.post_all_recvs(o.size)?;
        let peer = Endpoint::from_bytes(&buf)?;
        self.qp.to_rtr(&attr, &peer)?;
        self.qp.to_rts(&attr)?;
        sync(stream)
    }
}

fn sync(stream: &mut TcpStream) -> Result<()> {
    stream.write_all(b"S").map_err(io_err)?;
    let mut b = [0u8; 1];
    stream.read_exact(&mut b).map_err(io_err)
}

fn io_err(e: std::io::Error) -> Error {
    Error::InvalidArgument(format!("TCP exchange: {e}"))
}

fn check_all(wcs: &[WorkCompletion]) -> Result<()> {
    wcs.iter().try_for_each(|wc| wc.check())
}

/// Receiver side of `bw`: count `iters` receives, re-posting each WR.
fn bw_server(o: &Opts, node: &Node) -> Result<()> {
    let mut wcs = [WorkCompletion::default(); 64];
    let mut chain = RecvChain::with_capacity(1, 1);
    let mut got = 0u64;
    let deadline = Instant::now() + Duration::from_secs(300);
    while got < o.iters {
        let n = node.recv_cq.poll(&mut wcs)?;
        check_all(&wcs[..n])?;
        for wc in &wcs[..n] {
            if wc.byte_len() as usize != o.size {
                return Err(Error::InvalidArgument(format!(
                    "received {} bytes, want {}",
                    wc.byte_len(),
                    o.size
                )));
            }
            got += 1;
            // re-post unless all remaining messages already have a WR
            if got + node.rx_depth as u64 <= o.iters {
                let i = wc.wr_id() as usize;
                chain.clear();
                chain.push(i as u64, &[node.mr.sge(i * node.slot, o.size as u32)?]);
                node.qp.post_recv(&mut chain)?;
            }
        }
        if n == 0 && Instant::now() > deadline {
            return Err(Error::InvalidArgument(format!(
                "bw: only {got} of {} messages arrived",
                o.iters
            )));
        }
    }
    Ok(())
}

/// Sender side of `bw`: returns the elapsed time.
fn bw_client(o: &Opts, node: &Node) -> Result<Duration> {
    let sges = node.send_sge(o.size)?;
    let mut chain = SendChain::with_capacity(1, 1);
    let mut wcs = [WorkCompletion::default(); 16];
    let (mut posted, mut completed) = (0u64, 0u64);
    let sig = o.signal_every as u64;
    let t0 = Instant::now();
    while completed < o.iters {
        while posted < o.iters && posted - completed < o.tx_depth as u64 {
            // signal every `sig`-th and the last one, so `completed`
            // advances in steps of at most `sig`
            let flags = if (posted + 1) % sig == 0 || posted + 1 == o.iters {
                SendFlags::SIGNALED
            } else {
                SendFlags::NONE
            };
            chain.clear();
            chain.push(posted, SendOp::Send, &sges, flags);
            node.qp.post_send(&mut chain)?;
            posted += 1;
        }
        let n = node.send_cq.poll(&mut wcs)?;
        check_all(&wcs[..n])?;
        if let Some(last) = wcs[..n].last() {
            completed = last.wr_id() + 1;
        }
        if t0.elapsed() > Duration::from_secs(300) {
            return Err(Error::InvalidArgument("bw: timed out".into()));
        }
    }
    Ok(t0.elapsed())
}

fn poll_one(cq: &CompletionQueue) -> Result<WorkCompletion> {
    let mut wc = [WorkCompletion::default(); 1];
    let t0 = Instant::now();
    loop {
        if cq.poll(&mut wc)? == 1 {
            wc[0].check()?;
            return Ok(wc[0]);
        }
        if t0.elapsed() > Duration::from_secs(30) {
            return Err(Error::InvalidArgument(
                "lat: no completion within 30 s".into(),
            ));
        }
    }
}

/// One side of `lat`. The client sends first and records round-trip times.
fn lat_side(o: &Opts, node: &Node, client: bool, rtts: &mut Vec<f64>) -> Result<()> {
    let sges = node.send_sge(o.size)?;
    let mut chain = SendChain::with_capacity(1, 1);
    let mut rchain = RecvChain::with_capacity(1, 1);
    let mut send = |seq: u64| -> Result<()> {
        chain.clear();
        chain.push(seq, SendOp::Send, &sges, SendFlags::SIGNALED);
        node.qp.post_send(&mut chain)
    };
    let mut repost = |wc: &WorkCompletion| -> Result<()> {
        let i = wc.wr_id() as usize;
        rchain.clear();
        rchain.push(i as u64, &[node.mr.sge(i * node.slot, o.size as u32)?]);
        node.qp.post_recv(&mut rchain)
    };
    for seq in 0..o.iters {
        if client {
            let t = Instant::now();
            send(seq)?;
            let wc = poll_one(&node.recv_cq)?;
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
            repost(&wc)?;
            poll_one(&node.send_cq)?;
        } else {
            let wc = poll_one(&node.recv_cq)?;
            send(seq)?;
            repost(&wc)?;
            poll_one(&node.send_cq)?;
        }
    }
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn run(o: &Opts, server: bool) -> Result<()> {
    let node = Node::new(o)?;
    let mut stream = if server {
        let l = TcpListener::bind(("127.0.0.1", o.tcp_port)).map_err(io_err)?;
        l.accept().map_err(io_err)?.0
    } else {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match TcpStream::connect(("127.0.0.1", o.tcp_port)) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => return Err(io_err(e)),
            }
        }
    };
    node.connect(o, &mut stream, if server { 0x111 } else { 0x222 })?;
    let port = node.ctx.query_port(o.ib_port)?;
    let common = format!(
        "\"operation\":\"send\",\"mode\":\"{}\",\"binding\":\"raw-verbs\",\"size\":{},\"device\":\"{}\",\"mtu\":{}",
        o.mode,
        o.size,
        node.ctx.name(),
        port.active_mtu.bytes()
    );
    if o.mode == "bw" {
        if server {
            bw_server(o, &node)?;
            sync(&mut stream)?;
        } else {
            let el = bw_client(o, &node)?;
            sync(&mut stream)?; // the server got every message
            let secs = el.as_secs_f64();
            let mps = o.iters as f64 / secs;
            println!(
                "{{{common},\"msgs\":{},\"seconds\":{secs:.6},\"msgs_per_sec\":{mps:.1},\"bytes_per_sec\":{:.1},\"lat_us\":null,\"tx_depth\":{},\"rx_depth\":{},\"signal_every\":{}}}",
                o.iters,
                mps * o.size as f64,
                o.tx_depth,
                o.rx_depth,
                o.signal_every
            );
        }
    } else {
        let mut rtts = Vec::with_capacity(o.iters as usize);
        lat_side(o, &node, !server, &mut rtts)?;
        sync(&mut stream)?;
        if !server {
            let mut one_way: Vec<f64> = rtts.iter().map(|r| r / 2.0).collect();
            one_way.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let avg = one_way.iter().sum::<f64>() / one_way.len().max(1) as f64;
            println!(
                "{{{common},\"iters\":{},\"msgs_per_sec\":null,\"bytes_per_sec\":null,\"lat_us\":{{\"min\":{:.2},\"avg\":{avg:.2},\"p50\":{:.2},\"p90\":{:.2},\"p99\":{:.2},\"p999\":{:.2},\"max\":{:.2}}}}}",
                o.iters,
                one_way.first().copied().unwrap_or(0.0),
                percentile(&one_way, 50.0),
                percentile(&one_way, 90.0),
                percentile(&one_way, 99.0),
                percentile(&one_way, 99.9),
                one_way.last().copied().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let o = parse();
    let res = match o.role.as_str() {
        "server" => run(&o, true),
        "client" => run(&o, false),
        _ => {
            let exe = std::env::current_exe().expect("current_exe");
            let mut args: Vec<String> = std::env::args().skip(1).filter(|a| a != "both").collect();
            args.insert(0, "server".into());
            let mut child = Command::new(exe)
                .args(&args)
                .spawn()
                .unwrap_or_else(|e| die(&format!("spawn server: {e}")));
            let r = run(&o, false);
            if r.is_err() {
                let _ = child.kill();
            }
            let st = child.wait().expect("wait for the server");
            match r {
                Ok(()) if !st.success() => Err(Error::InvalidArgument(format!(
                    "server process failed: {st}"
                ))),
                other => other,
            }
        }
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("raw_verbs_bench {} ({} {} B): {e}", o.role, o.mode, o.size);
            ExitCode::FAILURE
        }
    }
}
