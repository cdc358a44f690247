//! Two-process RC ping-pong over an SRQ with verified payloads.
//!
//! The client sends SEND_WITH_IMM messages of random sizes (including
//! zero-length ones) to the server, which receives them through a shared
//! receive queue whose receive WRs have three SGEs each (posted as chains),
//! verifies every byte and the immediate value, and echoes a transformed
//! message back; the client verifies the echo the same way.
//!
//! ```text
//! rc_pingpong                      # both sides: spawns the server as a child process
//! rc_pingpong server [OPTIONS]
//! rc_pingpong client [OPTIONS]
//! options: --tcp-port P (18600)  --iters N (500)  --seed S  --max-size B (20000)
//!          --dev NAME ($RDMA_DEV)  --ib-port N ($RDMA_PORT, 1)  --gid-index N ($RDMA_GID_INDEX)
//! ```
//! The QP information is exchanged over TCP on 127.0.0.1. Exit status 0 when
//! every message was verified.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use dxnet_verbs::*;

#[derive(Clone)]
struct Opts {
    role: String,
    tcp_port: u16,
    iters: u32,
    seed: u64,
    max_size: usize,
    dev: Option<String>,
    ib_port: u8,
    gid_index: Option<u32>,
}

fn parse() -> Opts {
    let env = |n: &str| std::env::var(n).ok();
    let mut o = Opts {
        role: "both".into(),
        tcp_port: 18600,
        iters: 500,
        seed: 0x00c0_ffee,
        max_size: 20_000,
        dev: env("RDMA_DEV"),
        ib_port: env("RDMA_PORT").and_then(|v| v.parse().ok()).unwrap_or(1),
        gid_index: env("RDMA_GID_INDEX").and_then(|v| v.parse().ok()),
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let val = || {
            args.get(i + 1)
                .cloned()
                .unwrap_or_else(|| die(&format!("{} needs a value", args[i])))
        };
        match args[i].as_str() {
            "server" | "client" | "both" => {
                o.role = args[i].clone();
                i += 1;
                continue;
            }
            "--tcp-port" => o.tcp_port = val().parse().unwrap_or_else(|_| die("bad --tcp-port")),
            "--iters" => o.iters = val().parse().unwrap_or_else(|_| die("bad --iters")),
            "--seed" => o.seed = val().parse().unwrap_or_else(|_| die("bad --seed")),
            "--max-size" => o.max_size = val().parse().unwrap_or_else(|_| die("bad --max-size")),
            "--dev" => o.dev = Some(val()),
            "--ib-port" => o.ib_port = val().parse().unwrap_or_else(|_| die("bad --ib-port")),
            "--gid-index" => {
                o.gid_index = Some(val().parse().unwrap_or_else(|_| die("bad --gid-index")))
            }
            other => die(&format!("unknown argument {other}")),
        }
        i += 2;
    }
    o
}

fn die(msg: &str) -> ! {
    eprintln!("rc_pingpong: {msg}");
    std::process::exit(2)
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Payload source: message `seq` with `tag` is a window of a fixed random
/// table, so generating and checking are plain memory copies/compares.
struct Patterns(Vec<u8>);
const PATTERN_PERIOD: usize = 65_521;
impl Patterns {
    fn new() -> Patterns {
        let mut r = Rng(0x1234_5678_9abc_def1);
        Patterns(
            (0..2 * PATTERN_PERIOD)
                .map(|_| r.below(256) as u8)
                .collect(),
        )
    }
    fn get(&self, tag: u32, seq: u32, size: usize) -> &[u8] {
        let off = (seq as usize * 7919 + tag as usize * 104_729) % PATTERN_PERIOD;
        &self.0[off..off + size]
    }
}
fn imm_of(tag: u32, seq: u32) -> u32 {
    seq.wrapping_mul(0x9e37_79b9) ^ (tag << 30)
}

const RECV_DEPTH: usize = 32;
const SGE_SPLIT: [usize; 3] = [128, 4096, 0]; // the third piece takes the rest

struct Node {
    ctx: Context,
    qp: QueuePair,
    srq: SharedReceiveQueue,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    channel: CompletionChannel,
    recv_mr: MemoryRegion,
    send_mr: MemoryRegion,
    slot: usize,
    patterns: Patterns,
}

impl Node {
    fn new(o: &Opts) -> Result<Node> {
        let ctx = Context::open(o.dev.as_deref())?;
        let pd = ctx.alloc_pd()?;
        // completions are awaited through a completion channel (sleeping,
        // not busy-polling: on small machines the peer process and the
        // kernel's RDMA work need the CPU)
        let channel = ctx.create_comp_channel()?;
        let send_cq = ctx.create_cq(64, Some(&channel))?;
        let recv_cq = ctx.create_cq(2 * RECV_DEPTH as u32, Some(&channel))?;
        let srq = pd.create_srq(RECV_DEPTH as u32, 3)?;
        let qp = pd.create_rc_qp(&QpInit {
            send_cq: &send_cq,
            recv_cq: &recv_cq,
            srq: Some(&srq),
            caps: QpCaps {
                max_send_wr: 16,
                max_send_sge: 3,
                ..QpCaps::default()
            },
            sq_sig_all: true,
        })?;
        let slot = o.max_size.max(SGE_SPLIT[0] + SGE_SPLIT[1] + 1);
        let recv_mr = pd.alloc_buffer(RECV_DEPTH * slot, AccessFlags::LOCAL_WRITE)?;
        let send_mr = pd.alloc_buffer(slot, AccessFlags::NONE)?;
        if o.max_size > PATTERN_PERIOD {
            return Err(Error::InvalidArgument(format!(
                "--max-size is limited to {PATTERN_PERIOD}"
            )));
        }
        let node = Node {
            ctx,
            qp,
            srq,
            send_cq,
            recv_cq,
            channel,
            recv_mr,
            send_mr,
            slot,
            patterns: Patterns::new(),
        };
        let mut chain = RecvChain::with_capacity(RECV_DEPTH, 3 * RECV_DEPTH);
        for s in 0..RECV_DEPTH {
            chain.push(s as u64, &node.recv_sges(s)?);
        }
        node.srq.post_recv(&mut chain)?; // one chain of 32 WRs x 3 SGEs
        Ok(node)
    }

    fn recv_sges(&self, s: usize) -> Result<[Sge; 3]> {
        let base = s * self.slot;
        let rest = self.slot - SGE_SPLIT[0] - SGE_SPLIT[1];
        Ok([
            self.recv_mr.sge(base, SGE_SPLIT[0] as u32)?,
            self.recv_mr.sge(base + SGE_SPLIT[0], SGE_SPLIT[1] as u32)?,
            self.recv_mr
                .sge(base + SGE_SPLIT[0] + SGE_SPLIT[1], rest as u32)?,
        ])
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
        let peer = Endpoint::from_bytes(&buf)?;
        self.qp.connect(&attr, &peer)?;
        // both sides are in RTS (and have receives posted) after this
        stream.write_all(b"R").map_err(io_err)?;
        stream.read_exact(&mut buf[..1]).map_err(io_err)?;
        Ok(())
    }

    /// Sends `size` bytes of pattern `tag`/`seq` with `imm_of(tag, seq)`,
    /// split into 1..=3 SGEs.
    fn send(&mut self, rng: &mut Rng, tag: u32, seq: u32, size: usize) -> Result<()> {
        self.send_mr.write(0, self.patterns.get(tag, seq, size))?;
        let a = if size > 0 {
            rng.below(size as u64 + 1) as usize
        } else {
            0
        };
        let b = a + if size > a {
            rng.below((size - a) as u64 + 1) as usize
        } else {
            0
        };
        let mut sges = Vec::new();
        for (start, end) in [(0, a), (a, b), (b, size)] {
            if end > start {
                sges.push(self.send_mr.sge(start, (end - start) as u32)?);
            }
        }
        let mut chain = SendChain::new();
        chain.push(
            seq as u64,
            SendOp::SendWithImm(imm_of(tag, seq)),
            &sges,
            SendFlags::SIGNALED,
        );
        self.qp.post_send(&mut chain)?;
        let wc = wait_one(&self.send_cq, &self.channel)?;
        wc.check()?;
        Ok(())
    }

    /// Receives one message and checks it against `tag`/`seq`; returns its size.
    fn recv_check(&mut self, tag: u32, seq: u32) -> Result<usize> {
        let wc = wait_one(&self.recv_cq, &self.channel)?;
        wc.check()?;
        let bad =
            |what: String| Error::InvalidArgument(format!("message {seq} (tag {tag}): {what}"));
        if wc.opcode() != WcOpcode::Recv {
            return Err(bad(format!("opcode {:?}", wc.opcode())));
        }
        if wc.imm() != Some(imm_of(tag, seq)) {
            return Err(bad(format!(
                "immediate {:?}, want {:#x}",
                wc.imm(),
                imm_of(tag, seq)
            )));
        }
        let size = wc.byte_len() as usize;
        let s = wc.wr_id() as usize;
        let mut got = vec![0u8; size];
        // the three SGEs of a slot are contiguous in this layout
        self.recv_mr.read(s * self.slot, &mut got)?;
        let want = self.patterns.get(tag, seq, size);
        if got != want {
            let i = (0..size).find(|&i| got[i] != want[i]).unwrap_or(0);
            return Err(bad(format!(
                "byte {i} of {size} is {:#x}, want {:#x}",
                got[i], want[i]
            )));
        }
        let mut chain = RecvChain::new();
        chain.push(s as u64, &self.recv_sges(s)?);
        self.srq.post_recv(&mut chain)?;
        Ok(size)
    }
}

fn io_err(e: std::io::Error) -> Error {
    Error::InvalidArgument(format!("TCP exchange: {e}"))
}

/// Waits for one completion on `cq`: poll, arm the CQ, poll again (for
/// completions that came before arming), then sleep on the channel.
fn wait_one(cq: &CompletionQueue, channel: &CompletionChannel) -> Result<WorkCompletion> {
    let mut wc = [WorkCompletion::default(); 1];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if cq.poll(&mut wc)? == 1 {
            return Ok(wc[0]);
        }
        cq.req_notify(false)?;
        if cq.poll(&mut wc)? == 1 {
            return Ok(wc[0]);
        }
        // an event of either CQ wakes us; then poll again
        let left = deadline.saturating_duration_since(Instant::now());
        if channel.wait_timeout(Some(left))?.is_none() {
            return Err(Error::InvalidArgument("no completion within 30 s".into()));
        }
    }
}

fn size_for(rng: &mut Rng, max: usize) -> usize {
    match rng.below(8) {
        0 => 0,
        1 | 2 => rng.below(129) as usize,
        _ => rng.below(max as u64 + 1) as usize,
    }
}

fn server(o: &Opts) -> Result<()> {
    let mut node = Node::new(o)?;
    let listener = TcpListener::bind(("127.0.0.1", o.tcp_port)).map_err(io_err)?;
    let (mut stream, _) = listener.accept().map_err(io_err)?;
    node.connect(o, &mut stream, 0x0a0b0c)?;
    let mut rng = Rng(o.seed ^ 0x5555);
    for seq in 0..o.iters {
        let size = node.recv_check(1, seq)?;
        node.send(&mut rng, 2, seq, size)?; // echo with another pattern
    }
    Ok(())
}

fn client(o: &Opts) -> Result<()> {
    let mut node = Node::new(o)?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut stream = loop {
        match TcpStream::connect(("127.0.0.1", o.tcp_port)) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(io_err(e)),
        }
    };
    node.connect(o, &mut stream, 0x010203)?;
    let mut rng = Rng(o.seed | 1);
    let (mut zero, mut bytes) = (0u32, 0u64);
    let t0 = Instant::now();
    for seq in 0..o.iters {
        let size = size_for(&mut rng, o.max_size);
        node.send(&mut rng, 1, seq, size)?;
        let echoed = node.recv_check(2, seq)?;
        if echoed != size {
            return Err(Error::InvalidArgument(format!(
                "echo of message {seq}: {echoed} bytes, sent {size}"
            )));
        }
        zero += (size == 0) as u32;
        bytes += size as u64;
    }
    let el = t0.elapsed();
    println!(
        "rc_pingpong: {} round trips verified ({} zero-length, {} payload bytes each way) in {:.2} s, {:.1} us per round trip",
        o.iters,
        zero,
        bytes,
        el.as_secs_f64(),
        el.as_secs_f64() * 1e6 / o.iters.max(1) as f64
    );
    Ok(())
}

fn main() -> ExitCode {
    let o = parse();
    let res = match o.role.as_str() {
        "server" => server(&o),
        "client" => client(&o),
        _ => {
            // spawn the server as a second process, then be the client
            let exe = std::env::current_exe().expect("current_exe");
            let mut args: Vec<String> = std::env::args().skip(1).filter(|a| a != "both").collect();
            args.insert(0, "server".into());
            let mut child = match Command::new(exe).args(&args).spawn() {
                Ok(c) => c,
                Err(e) => die(&format!("cannot start the server process: {e}")),
            };
            let r = client(&o);
            if r.is_err() {
                let _ = child.kill();
            }
            let status = child.wait().expect("wait for server");
            match r {
                Ok(()) if !status.success() => Err(Error::InvalidArgument(format!(
                    "server process failed: {status}"
                ))),
                other => other,
            }
        }
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rc_pingpong {}: {e}", o.role);
            ExitCode::FAILURE
        }
    }
}
