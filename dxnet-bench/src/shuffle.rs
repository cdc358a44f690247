//! `dxnet-bench shuffle`: a dxshuffle all-to-all among P processes × T
//! threads, one-sided against messages mode on the same transport, and
//! against the same exchange with Open MPI's `MPI_Alltoallv` (`mpi`
//! mode: `mpi/shuffle.c`, built with `mpicc` at the first run), in
//! alternating rounds.
//!
//! Every worker pushes `records` records of `size` bytes to destinations
//! drawn uniformly (or, with `skew` > 0, to worker 0 with that
//! probability) and pulls what is addressed to it. Each process is a
//! child (`dxnet-bench shuffle-node`) with one dxnet node; all start
//! together once the shuffle is set up everywhere, and the clock of a
//! process stops when its pullers saw every worker finish. Reported per mode: records/s and
//! payload bytes/s over the slowest process's time, CPU time per record
//! (all processes), and the average time a pusher was blocked.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use dxnet::{Config, Node, NodeId, TransportKind};
use dxshuffle::{Mode, Shuffle, ShuffleConfig};

use crate::metrics::process_cpu_s;
use crate::netns::{Guard, Layout};

/// What `shuffle` runs.
#[derive(Debug, Clone)]
pub struct ShuffleArgs {
    /// Processes.
    pub procs: usize,
    /// Workers per process.
    pub threads: usize,
    /// Records each worker pushes.
    pub records: u64,
    /// Bytes per record.
    pub size: usize,
    /// Probability that a record goes to worker 0.
    pub skew: f64,
    /// `tcp` or `ib`.
    pub transport: String,
    /// Modes, each run per round.
    pub modes: Vec<BenchMode>,
    /// Segment bytes (dxshuffle's `segment_bytes`).
    pub segment: usize,
    /// Batch bytes (dxshuffle's `batch_bytes`).
    pub batch: usize,
    /// Rounds (modes alternate within each).
    pub rounds: u32,
    /// First port of the node map (127.0.0.1).
    pub base_port: u16,
    /// MPI mode: records per worker per `MPI_Alltoallv` round (0: one).
    pub mpi_chunk: u64,
    /// MPI mode: options for `mpirun`.
    pub mpirun_options: String,
    /// One network namespace per process (TCP over veth links): process
    /// `p` runs in `namespace(p)` at `address(p)`, port `base_port`.
    pub netns: Option<Layout>,
    /// `--dxnet KEY=VALUE` settings for every process's dxnet node.
    pub dxnet: Vec<String>,
}

/// What one run of the benchmark uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchMode {
    /// dxshuffle in this mode.
    Shuffle(Mode),
    /// Open MPI's `MPI_Alltoallv`, one rank per process.
    Mpi,
}

/// One process's result line.
#[derive(Debug, Clone, Copy, Default)]
struct ProcResult {
    pushed: u64,
    received: u64,
    bytes: u64,
    elapsed_s: f64,
    cpu_s: f64,
    blocked_s: f64,
}

/// A round's result for one mode.
#[derive(Debug, Clone, Copy)]
struct RunResult {
    records_per_s: f64,
    bytes_per_s: f64,
    cpu_us_per_record: f64,
    blocked_ms_per_pusher: f64,
    elapsed_s: f64,
    /// Packets the RDMA device sent while the workers ran, per record
    /// (`--transport ib` where the device counts them).
    device_pkts_per_record: Option<f64>,
}

/// Parses `one-sided` / `messages` / `mpi`.
pub fn parse_mode(s: &str) -> Result<BenchMode> {
    match s {
        "one-sided" | "one_sided" => Ok(BenchMode::Shuffle(Mode::OneSided)),
        "messages" => Ok(BenchMode::Shuffle(Mode::Messages)),
        "mpi" => Ok(BenchMode::Mpi),
        other => bail!("mode {other}: one-sided, messages or mpi"),
    }
}

fn mode_name(m: BenchMode) -> &'static str {
    match m {
        BenchMode::Shuffle(Mode::OneSided) => "one-sided",
        BenchMode::Shuffle(_) => "messages",
        BenchMode::Mpi => "mpi",
    }
}

/// Runs the rounds and prints a table and the medians.
pub fn run(a: &ShuffleArgs) -> Result<()> {
    if a.procs < 1 || a.threads < 1 || a.modes.is_empty() {
        bail!("shuffle: at least 1 process, 1 thread and 1 mode");
    }
    println!(
        "shuffle: {} processes x {} threads, {} records of {} B per worker, skew {}, {} transport, segments {} B, batches {} B",
        a.procs, a.threads, a.records, a.size, a.skew, a.transport, a.segment, a.batch
    );
    let _guard = match &a.netns {
        Some(l) => {
            if a.transport != "tcp" {
                bail!("--netns runs over tcp");
            }
            if a.modes.contains(&BenchMode::Mpi) {
                // Tried: its ranks fail in MPI_Init ("Unreachable"), as the
                // PMIx server of `mpirun` listens on the host's loopback.
                bail!("the mpi mode runs without --netns: Open MPI's launcher cannot reach ranks in other network namespaces");
            }
            l.setup()?;
            println!(
                "network namespaces {}0..{}{} ({}..{})",
                l.prefix,
                l.prefix,
                a.procs - 1,
                l.address(0),
                l.address(a.procs - 1)
            );
            Some(Guard(l.clone()))
        }
        None => None,
    };
    let pkts = a.transport == "ib";
    println!(
        "{:>5} {:>10} {:>12} {:>10} {:>12} {:>14} {:>10}{}",
        "round",
        "mode",
        "records/s",
        "MB/s",
        "cpu_us/rec",
        "blocked_ms/p",
        "time_s",
        if pkts { "   pkts/rec" } else { "" }
    );
    let mut all: Vec<(BenchMode, RunResult)> = Vec::new();
    for round in 0..a.rounds {
        // Alternate the order of the modes between rounds.
        let mut modes = a.modes.clone();
        if round % 2 == 1 {
            modes.reverse();
        }
        for &m in &modes {
            let r = match m {
                BenchMode::Shuffle(mode) => one_run(a, mode, round)?,
                BenchMode::Mpi => mpi_run(a)?,
            };
            let pkts_col = match (pkts, r.device_pkts_per_record) {
                (false, _) => String::new(),
                (true, Some(p)) => format!(" {p:>10.4}"),
                (true, None) => format!(" {:>10}", "-"),
            };
            println!(
                "{:>5} {:>10} {:>12.0} {:>10.1} {:>12.3} {:>14.1} {:>10.2}{}",
                round,
                mode_name(m),
                r.records_per_s,
                r.bytes_per_s / 1e6,
                r.cpu_us_per_record,
                r.blocked_ms_per_pusher,
                r.elapsed_s,
                pkts_col
            );
            all.push((m, r));
        }
    }
    println!("medians:");
    let mut medians = Vec::new();
    for &m in &a.modes {
        let pick = |f: fn(&RunResult) -> f64| {
            let mut v: Vec<f64> = all
                .iter()
                .filter(|(x, _)| *x == m)
                .map(|(_, r)| f(r))
                .collect();
            v.sort_by(|x, y| x.partial_cmp(y).expect("no NaN"));
            v[v.len() / 2]
        };
        let rate = pick(|r| r.records_per_s);
        let mut pkts: Vec<f64> = all
            .iter()
            .filter(|(x, _)| *x == m)
            .filter_map(|(_, r)| r.device_pkts_per_record)
            .collect();
        pkts.sort_by(|x, y| x.partial_cmp(y).expect("no NaN"));
        let pkts_col = pkts
            .get(pkts.len() / 2)
            .map_or(String::new(), |p| format!(" {p:>8.4} device pkts/rec"));
        println!(
            "{:>10} {:>12.0} records/s {:>10.1} MB/s {:>8.3} cpu_us/rec {:>8.1} blocked_ms/pusher{}",
            mode_name(m),
            rate,
            pick(|r| r.bytes_per_s) / 1e6,
            pick(|r| r.cpu_us_per_record),
            pick(|r| r.blocked_ms_per_pusher),
            pkts_col
        );
        medians.push((m, rate));
    }
    let rate = |m: BenchMode| medians.iter().find(|(x, _)| *x == m).map(|(_, r)| *r);
    let (one_sided, messages, mpi) = (
        rate(BenchMode::Shuffle(Mode::OneSided)),
        rate(BenchMode::Shuffle(Mode::Messages)),
        rate(BenchMode::Mpi),
    );
    if let (Some(o), Some(s)) = (one_sided, messages) {
        println!("one-sided / messages (records/s): {:.2}x", o / s);
    }
    for (name, r) in [("one-sided", one_sided), ("messages", messages)] {
        if let (Some(r), Some(m)) = (r, mpi) {
            println!("{name} / mpi (records/s): {:.2}x", r / m);
        }
    }
    Ok(())
}

fn one_run(a: &ShuffleArgs, mode: Mode, round: u32) -> Result<RunResult> {
    let exe = std::env::current_exe().context("own executable")?;
    let base = a.base_port
        + (round as u16 % 8) * (a.procs as u16 + 1) * 2
        + if mode == Mode::OneSided {
            0
        } else {
            a.procs as u16 + 1
        };
    let mut children: Vec<Child> = (0..a.procs)
        .map(|p| {
            let mut cmd = match &a.netns {
                Some(l) => {
                    let mut c = Command::new("ip");
                    c.args(["netns", "exec", &l.namespace(p)]).arg(&exe);
                    c
                }
                None => Command::new(&exe),
            };
            cmd.arg("shuffle-node");
            if let Some(l) = &a.netns {
                cmd.args(["--netns", "--netns-prefix", &l.prefix]);
            }
            cmd.args(["--proc", &p.to_string()])
                .args(["--procs", &a.procs.to_string()])
                .args(["--threads", &a.threads.to_string()])
                .args(["--records", &a.records.to_string()])
                .args(["--size", &a.size.to_string()])
                .args(["--skew", &a.skew.to_string()])
                .args(["--transport", &a.transport])
                .args(["--mode", mode_name(BenchMode::Shuffle(mode))])
                .args(["--segment", &a.segment.to_string()])
                .args(["--batch", &a.batch.to_string()])
                .args(["--base-port", &base.to_string()])
                .args(a.dxnet.iter().flat_map(|kv| ["--dxnet", kv.as_str()]))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .context("starting a shuffle process")
        })
        .collect::<Result<_>>()?;
    let mut outs: Vec<_> = children
        .iter_mut()
        .map(|c| BufReader::new(c.stdout.take().expect("piped")))
        .collect();
    let wait_for = |r: &mut BufReader<std::process::ChildStdout>, prefix: &str| -> Result<String> {
        let mut line = String::new();
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 {
                bail!("a shuffle process ended before {prefix}");
            }
            if let Some(rest) = line.trim().strip_prefix(prefix) {
                return Ok(rest.to_string());
            }
        }
    };
    // Set up everywhere, then all start at once.
    for r in outs.iter_mut() {
        wait_for(r, "READY")?;
    }
    let counter = (a.transport == "ib").then(device_sent_packets).flatten();
    let sent_before = counter.as_ref().and_then(|c| c.read());
    for c in children.iter_mut() {
        writeln!(c.stdin.as_mut().expect("piped"), "go")?;
    }
    let mut results = Vec::new();
    for r in outs.iter_mut() {
        results.push(parse_result(&wait_for(r, "RESULT ")?)?);
    }
    let sent = match (sent_before, counter.as_ref().and_then(|c| c.read())) {
        (Some(b), Some(e)) => Some(e.saturating_sub(b)),
        _ => None,
    };
    // Every process has its records: all may exit now.
    for c in children.iter_mut() {
        if let Some(mut i) = c.stdin.take() {
            let _ = writeln!(i, "exit");
        }
    }
    for mut c in children {
        let st = c.wait()?;
        if !st.success() {
            bail!("a shuffle process failed: {st}");
        }
    }
    let pushed: u64 = results.iter().map(|r| r.pushed).sum();
    let received: u64 = results.iter().map(|r| r.received).sum();
    if pushed != received {
        bail!("{pushed} records pushed, {received} received");
    }
    let elapsed = results.iter().map(|r| r.elapsed_s).fold(0.0, f64::max);
    let bytes: u64 = results.iter().map(|r| r.bytes).sum();
    let cpu: f64 = results.iter().map(|r| r.cpu_s).sum();
    let blocked: f64 = results.iter().map(|r| r.blocked_s).sum();
    Ok(RunResult {
        records_per_s: received as f64 / elapsed,
        bytes_per_s: bytes as f64 / elapsed,
        cpu_us_per_record: cpu * 1e6 / received.max(1) as f64,
        blocked_ms_per_pusher: blocked * 1e3 / (a.procs * a.threads) as f64,
        elapsed_s: elapsed,
        device_pkts_per_record: sent.map(|p| p as f64 / received.max(1) as f64),
    })
}

/// The RDMA device's count of packets sent (`sent_pkts` of its port's
/// `hw_counters` in sysfs, which Soft-RoCE and most RoCE drivers keep),
/// for the device the environment names (`RDMA_DEV`, `RDMA_PORT`; else the
/// first device, port 1). Every process on the device counts, so with all
/// of a shuffle's processes on one host it is the whole shuffle's traffic
/// (on a loopback device both directions).
struct PacketCounter(std::path::PathBuf);

impl PacketCounter {
    fn read(&self) -> Option<u64> {
        std::fs::read_to_string(&self.0).ok()?.trim().parse().ok()
    }
}

fn device_sent_packets() -> Option<PacketCounter> {
    let t = crate::config::RdmaParams::default().resolve();
    let root = std::path::Path::new("/sys/class/infiniband");
    let dev = match t.device {
        Some(d) => d,
        None => {
            let mut names: Vec<String> = std::fs::read_dir(root)
                .ok()?
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect();
            names.sort();
            names.into_iter().next()?
        }
    };
    let c = PacketCounter(root.join(format!("{dev}/ports/{}/hw_counters/sent_pkts", t.port)));
    c.read().map(|_| c)
}

/// The MPI peer's source (`mpi/shuffle.c`).
const MPI_SOURCE: &str = include_str!("../mpi/shuffle.c");

/// One run of the MPI peer: `procs` ranks of `mpirun` on this host.
fn mpi_run(a: &ShuffleArgs) -> Result<RunResult> {
    if a.transport != "tcp" {
        bail!("the mpi mode runs on the host (transport tcp)");
    }
    let exe = crate::binding::mpi::program("shuffle-mpi", MPI_SOURCE)?;
    let mut cmd = crate::binding::mpi::mpirun(a.procs);
    cmd.args(a.mpirun_options.split_whitespace())
        .arg(&exe)
        .args([
            a.threads.to_string(),
            a.records.to_string(),
            a.size.to_string(),
            a.skew.to_string(),
            a.mpi_chunk.to_string(),
        ]);
    let out = cmd
        .output()
        .context("running mpirun (Debian: openmpi-bin)")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "mpirun failed ({}): {}{}",
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let line = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("RESULT "))
        .ok_or_else(|| anyhow!("no result from the MPI run: {stdout}"))?;
    let r = parse_result(line)?;
    if r.pushed != r.received {
        bail!("MPI: {} records pushed, {} received", r.pushed, r.received);
    }
    Ok(RunResult {
        records_per_s: r.received as f64 / r.elapsed_s,
        bytes_per_s: r.bytes as f64 / r.elapsed_s,
        cpu_us_per_record: r.cpu_s * 1e6 / r.received.max(1) as f64,
        blocked_ms_per_pusher: 0.0,
        elapsed_s: r.elapsed_s,
        device_pkts_per_record: None,
    })
}

fn parse_result(s: &str) -> Result<ProcResult> {
    let mut r = ProcResult::default();
    for kv in s.split_whitespace() {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| anyhow!("bad result {s}"))?;
        match k {
            "pushed" => r.pushed = v.parse()?,
            "received" => r.received = v.parse()?,
            "bytes" => r.bytes = v.parse()?,
            "elapsed_s" => r.elapsed_s = v.parse()?,
            "cpu_s" => r.cpu_s = v.parse()?,
            "blocked_s" => r.blocked_s = v.parse()?,
            _ => {}
        }
    }
    Ok(r)
}

/// What one `shuffle-node` process runs.
#[derive(Debug, Clone)]
pub struct NodeArgs {
    /// This process's index.
    pub proc: usize,
    /// The run's shape (the mode in `modes[0]`).
    pub run: ShuffleArgs,
}

/// One process of a shuffle run: prints `READY` once set up, starts on a
/// line on stdin, prints `RESULT ...`, then waits for `exit` on stdin (its
/// peers may still read from it until then).
pub fn node_main(n: &NodeArgs) -> Result<()> {
    let a = &n.run;
    let procs = a.procs as u16;
    let mut c = Config::tcp_localhost(n.proc as u16, procs, a.base_port);
    if let Some(l) = &a.netns {
        for (i, e) in c.nodes.iter_mut().enumerate() {
            e.address = format!("{}:{}", l.address(i), a.base_port);
        }
    }
    if a.transport == "ib" {
        c.transport = TransportKind::Ib;
        // The device the environment names (RDMA_DEV, RDMA_PORT,
        // RDMA_GID_INDEX), as the verbs bindings use it.
        crate::binding::dxnet::set_rdma_target(
            &mut c,
            crate::config::RdmaParams::default().resolve(),
        )?;
    } else if a.transport != "tcp" {
        bail!("transport {}: tcp or ib (processes)", a.transport);
    }
    c.limits.request_timeout_ms = 60_000;
    c.limits.send_timeout_ms = 60_000;
    if !a.dxnet.is_empty() {
        let mut fields = serde_json::Map::new();
        for kv in &a.dxnet {
            crate::binding::dxnet::merge_setting(&mut fields, kv)?;
        }
        c = crate::binding::dxnet::with_fields(&c, &fields)?;
    }
    let node = Arc::new(Node::start(c)?);
    let mut cfg = ShuffleConfig::new((0..procs).map(NodeId).collect(), a.threads);
    cfg.mode = match a.modes[0] {
        BenchMode::Shuffle(m) => m,
        BenchMode::Mpi => bail!("shuffle-node runs dxshuffle modes only"),
    };
    cfg.segment_bytes = a.segment;
    cfg.batch_bytes = a.batch;
    cfg.timeout = Duration::from_secs(120);
    let shuffle = Shuffle::new(node, cfg)?;
    let workers = shuffle.workers();
    // Outgoing buffers are allocated and registered before the clock.
    let mut ends = (0..a.threads)
        .map(|t| Ok((shuffle.pusher(t)?, shuffle.puller(t)?)))
        .collect::<Result<Vec<_>>>()?;
    let payload = vec![0x5au8; a.size];
    // The workers start (threads spawned, their stacks and allocator
    // arenas set up) before the clock, as the MPI peer's ranks do, and wait
    // for the go (called off if a spawn fails: see `StartGate`).
    let go = crate::start_gate::StartGate::new();
    let mut line = String::new();
    let (pushed, received, bytes, blocked, elapsed, cpu) = std::thread::scope(|s| -> Result<_> {
        let go = &go;
        let opener = go.opener();
        let mut pushers = Vec::new();
        let mut pullers = Vec::new();
        for (t, (mut p, mut q)) in ends.drain(..).enumerate() {
            let me = shuffle.worker(t) as u64;
            let payload = &payload;
            let pusher = std::thread::Builder::new().name(format!("pusher-{t}"));
            pushers.push(pusher.spawn_scoped(s, move || -> Result<(u64, Duration)> {
                let mut x = (me + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                if !go.wait() {
                    return Err(anyhow!("called off"));
                }
                for _ in 0..a.records {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let to = if a.skew > 0.0 && (x >> 11) as f64 / (1u64 << 53) as f64 <= a.skew {
                        0
                    } else {
                        (x % workers as u64) as usize
                    };
                    p.push_bytes(to, payload)?;
                }
                p.finish()?;
                Ok((a.records, p.blocked()))
            })?);
            let puller = std::thread::Builder::new().name(format!("puller-{t}"));
            pullers.push(puller.spawn_scoped(s, move || -> Result<(u64, u64)> {
                let (mut n, mut b) = (0u64, 0u64);
                if !go.wait() {
                    return Err(anyhow!("called off"));
                }
                // The records' bytes lent, not copied (as the MPI peer
                // parses in place).
                while let Some(len) = q.next_with(|_, bytes| bytes.len())? {
                    n += 1;
                    b += len as u64;
                }
                Ok((n, b))
            })?);
        }
        let ready = (|| -> Result<()> {
            println!("READY");
            std::io::stdout().flush()?;
            std::io::stdin().read_line(&mut line)?;
            Ok(())
        })();
        // On an error the opener, dropped, sends the workers home.
        ready?;
        let cpu0 = process_cpu_s();
        let start = Instant::now();
        opener.open(2 * a.threads);
        let (mut pushed, mut blocked) = (0, Duration::ZERO);
        for h in pushers {
            let (n, b) = h.join().map_err(|_| anyhow!("a pusher panicked"))??;
            pushed += n;
            blocked += b;
        }
        let (mut received, mut bytes) = (0, 0);
        for h in pullers {
            let (n, b) = h.join().map_err(|_| anyhow!("a puller panicked"))??;
            received += n;
            bytes += b;
        }
        let elapsed = start.elapsed().as_secs_f64();
        let cpu = process_cpu_s() - cpu0;
        Ok((pushed, received, bytes, blocked, elapsed, cpu))
    })?;
    println!(
        "RESULT pushed={pushed} received={received} bytes={bytes} elapsed_s={elapsed} cpu_s={cpu} blocked_s={}",
        blocked.as_secs_f64()
    );
    std::io::stdout().flush()?;
    let _ = std::io::stdin().read_line(&mut line);
    Ok(())
}
