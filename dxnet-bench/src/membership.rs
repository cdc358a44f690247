//! `dxnet-bench membership`: how long discovery takes to make a starting
//! node reachable, and whether nodes joining and leaving disturb the
//! traffic of an existing connection.
//!
//! For each node count N (and round): N-1 member processes start with the
//! full node map (addresses of all N nodes) and discovery on; once each
//! lists the other members, a stream of 64 B messages runs from member 0
//! to member 1 over TCP. Then the last node (the joiner) starts: its *join
//! time* is from just before its `Node::start` until every member has a
//! `Discovered` event for it, and its *mesh time* until its own
//! `Node::nodes` lists all N. Then the joiner starts and stops `churn`
//! more times while the stream runs; member 1 reports the stream's rate
//! and its longest gap between two messages in the quiet phase before and
//! in the churn phase (same run), so the ratio shows what joins and leaves
//! cost the existing connection.
//!
//! With `--seed-only` every node starts knowing only its own address and
//! node 0's (a seed): the others are found through member lists.
//!
//! With `--netns` (root) every node runs in its own network namespace on a
//! bridge ([`crate::netns`]); without, all run on 127.0.0.1.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use dxnet::config::NodeEntry;
use dxnet::events::ConnectionEvent;
use dxnet::{Config, DiscoveryConfig, Node, NodeId};
use serde::{Deserialize, Serialize};

use crate::netns::{Guard, Layout};

/// Options of a membership run.
#[derive(Debug, Clone)]
pub struct MembershipArgs {
    /// Node counts (joiner included).
    pub nodes: Vec<usize>,
    /// Discovery interval.
    pub interval_ms: u64,
    /// Rounds per node count.
    pub rounds: u32,
    /// Joins and leaves during the churn phase.
    pub churn: u32,
    /// One network namespace per node.
    pub netns: bool,
    /// Namespace prefix.
    pub prefix: String,
    /// First port (local) or the port of every node (netns).
    pub base_port: u16,
    /// Nodes start knowing only node 0's address (a seed), not the map.
    pub seed_only: bool,
}

/// The stream's messages.
#[derive(Serialize, Deserialize)]
struct Tick(#[serde(with = "serde_bytes")] Vec<u8>);
dxnet::message!(Tick, 60, 1);

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The node map of a run: node `i`'s address.
fn address(netns: bool, base_port: u16, i: usize) -> String {
    if netns {
        format!("10.201.0.{}:{base_port}", i + 1)
    } else {
        format!("127.0.0.1:{}", base_port as usize + i)
    }
}

/// A child node process and the lines it printed.
struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    fn spawn(netns: Option<&str>, args: &[String]) -> Result<Proc> {
        let exe = std::env::current_exe()?;
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        cmd.arg("membership-node")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().context("cannot start a membership node")?;
        let out = child.stdout.take().expect("piped");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let l = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
                l.lock().unwrap().push(line);
            }
        });
        let stdin = child.stdin.take();
        Ok(Proc {
            child,
            stdin,
            lines,
        })
    }

    /// The first printed line starting with `prefix` (waits up to
    /// `timeout`).
    fn wait_line(&mut self, prefix: &str, timeout: Duration) -> Result<String> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(l) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|l| l.starts_with(prefix))
            {
                return Ok(l.clone());
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                bail!("node exited ({st}) before printing {prefix}");
            }
            if Instant::now() >= end {
                bail!("no {prefix} line within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn lines_with(&self, prefix: &str) -> Vec<String> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with(prefix))
            .cloned()
            .collect()
    }

    fn command(&mut self, c: &str) -> Result<()> {
        let s = self.stdin.as_mut().ok_or_else(|| anyhow!("stdin closed"))?;
        writeln!(s, "{c}")?;
        s.flush()?;
        Ok(())
    }

    /// Asks the node to stop and waits for it (kills it after 10 s).
    fn stop(mut self) {
        let _ = self.command("exit");
        self.stdin.take();
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn field(line: &str, key: &str) -> Result<u64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .ok_or_else(|| anyhow!("no {key} in {line:?}"))?
        .parse()
        .with_context(|| format!("{key} in {line:?}"))
}

/// Runs the benchmark and prints its table.
pub fn run(a: &MembershipArgs) -> Result<()> {
    println!(
        "membership: discovery interval {} ms, {}, {} ({} rounds, {} joins/leaves in the churn phase)",
        a.interval_ms,
        if a.seed_only {
            "nodes know only node 0's address"
        } else {
            "full node map"
        },
        if a.netns {
            "one network namespace per node"
        } else {
            "127.0.0.1"
        },
        a.rounds,
        a.churn
    );
    println!(
        "{:>5} {:>5} {:>12} {:>12} {:>14} {:>14} {:>12} {:>14} {:>14}",
        "nodes",
        "round",
        "join_ms",
        "mesh_ms",
        "quiet_msg/s",
        "churn_msg/s",
        "churn/quiet",
        "quiet_gap_ms",
        "churn_gap_ms"
    );
    for &n in &a.nodes {
        for round in 0..a.rounds {
            let r = one_run(a, n)?;
            println!(
                "{:>5} {:>5} {:>12.1} {:>12.1} {:>14.0} {:>14.0} {:>12.2} {:>14.1} {:>14.1}",
                n,
                round,
                r.join_ms,
                r.mesh_ms,
                r.quiet_rate,
                r.churn_rate,
                if r.quiet_rate > 0.0 {
                    r.churn_rate / r.quiet_rate
                } else {
                    f64::NAN
                },
                r.quiet_gap_ms,
                r.churn_gap_ms
            );
        }
    }
    Ok(())
}

struct RunResult {
    join_ms: f64,
    mesh_ms: f64,
    quiet_rate: f64,
    churn_rate: f64,
    quiet_gap_ms: f64,
    churn_gap_ms: f64,
}

fn one_run(a: &MembershipArgs, n: usize) -> Result<RunResult> {
    if n < 2 {
        bail!("membership: at least 2 nodes");
    }
    let _guard = if a.netns {
        let l = Layout::new(&a.prefix, n, 1500);
        l.setup()?;
        Some(Guard(l))
    } else {
        None
    };
    let addresses: Vec<String> = (0..n).map(|i| address(a.netns, a.base_port, i)).collect();
    let ns = |i: usize| a.netns.then(|| format!("{}{i}", a.prefix));
    let node_args = |i: usize, stream_to: Option<usize>| {
        let mut v = vec![
            "--id".to_string(),
            i.to_string(),
            "--addresses".into(),
            addresses.join(","),
            "--interval-ms".into(),
            a.interval_ms.to_string(),
        ];
        if let Some(t) = stream_to {
            v.push("--stream-to".into());
            v.push(t.to_string());
        }
        if a.seed_only {
            v.push("--seed-only".into());
        }
        v
    };
    let members = n - 1;
    let streaming = members >= 2;
    let mut procs = Vec::new();
    for i in 0..members {
        let to = (streaming && i == 0).then_some(1);
        procs.push(Proc::spawn(ns(i).as_deref(), &node_args(i, to))?);
    }
    let up = Duration::from_secs(60 + 2 * n as u64);
    for p in procs.iter_mut() {
        p.wait_line("MEMBERS", up)?;
    }
    // The joiner: join and mesh time.
    let joiner = n - 1;
    let mut j = Proc::spawn(ns(joiner).as_deref(), &node_args(joiner, None))?;
    let start = field(&j.wait_line("START", up)?, "t=")?;
    let mesh = field(&j.wait_line("MESH", up)?, "t=")?;
    let end = Instant::now() + up;
    let mut found = Vec::new();
    for p in &procs {
        loop {
            let hit = p
                .lines_with("FOUND")
                .iter()
                .filter(|l| field(l, "id=").ok() == Some(joiner as u64))
                .filter_map(|l| field(l, "t=").ok())
                .find(|t| *t >= start);
            if let Some(t) = hit {
                found.push(t);
                break;
            }
            if Instant::now() >= end {
                bail!("a member never discovered the joiner");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    j.stop();
    let join_ms = (found.iter().max().copied().unwrap_or(start) - start) as f64 / 1e6;
    let mesh_ms = (mesh.saturating_sub(start)) as f64 / 1e6;

    // Stream: a quiet phase, then a churn phase of the same length or
    // longer.
    let (mut quiet_rate, mut churn_rate, mut quiet_gap, mut churn_gap) = (0.0, 0.0, 0.0, 0.0);
    if streaming {
        let mark = |p: &mut Proc, k: u32| -> Result<(u64, u64, Instant)> {
            p.command(&format!("mark {k}"))?;
            let l = p.wait_line(&format!("MARK k={k} "), Duration::from_secs(30))?;
            Ok((field(&l, "count=")?, field(&l, "gap_us=")?, Instant::now()))
        };
        std::thread::sleep(Duration::from_millis(500));
        let (c0, _, t0) = mark(&mut procs[1], 0)?;
        std::thread::sleep(Duration::from_millis(
            (a.churn as u64 * 400).clamp(1000, 10_000),
        ));
        let (c1, g1, t1) = mark(&mut procs[1], 1)?;
        for _ in 0..a.churn {
            let mut j = Proc::spawn(ns(joiner).as_deref(), &node_args(joiner, None))?;
            j.wait_line("MESH", up)?;
            j.stop();
        }
        let (c2, g2, t2) = mark(&mut procs[1], 2)?;
        quiet_rate = (c1 - c0) as f64 / (t1 - t0).as_secs_f64();
        churn_rate = (c2 - c1) as f64 / (t2 - t1).as_secs_f64();
        quiet_gap = g1 as f64 / 1e3;
        churn_gap = g2 as f64 / 1e3;
    }
    for p in procs {
        p.stop();
    }
    Ok(RunResult {
        join_ms,
        mesh_ms,
        quiet_rate,
        churn_rate,
        quiet_gap_ms: quiet_gap,
        churn_gap_ms: churn_gap,
    })
}

/// A node process of the benchmark (`dxnet-bench membership-node`).
pub fn node_main(
    id: u16,
    addresses: &[String],
    interval_ms: u64,
    stream_to: Option<u16>,
    seed_only: bool,
) -> Result<()> {
    let mut c = Config::default();
    c.node_id = id;
    let seeds = if seed_only {
        c.nodes = vec![NodeEntry::new(id, addresses[id as usize].clone())];
        if id == 0 {
            Vec::new()
        } else {
            vec![addresses[0].clone()]
        }
    } else {
        c.nodes = addresses
            .iter()
            .enumerate()
            .map(|(i, a)| NodeEntry::new(i as u16, a.clone()))
            .collect();
        Vec::new()
    };
    c.cluster_secret = Some("dxnet-bench-membership".into());
    c.discovery = Some(DiscoveryConfig::new(seeds, interval_ms));
    c.handler_threads = 1;
    c.park.spin_us = 0;
    c.park.yield_us = 50;
    println!("START t={}", now_ns());
    let node = Arc::new(Node::start(c).map_err(|e| anyhow!("node {id}: {e}"))?);
    let events = node.connection_events(4096)?;
    std::thread::spawn(move || {
        for e in events.iter() {
            if let ConnectionEvent::Discovered { node } = e {
                println!("FOUND id={} t={}", node.0, now_ns());
            }
        }
    });
    // Stream receiver side: count and the longest gap.
    let count = Arc::new(AtomicU64::new(0));
    let last = Arc::new(AtomicU64::new(0));
    let gap = Arc::new(AtomicU64::new(0));
    {
        let (count, last, gap) = (count.clone(), last.clone(), gap.clone());
        node.register(move |_, _t: Tick| {
            let now = now_ns();
            let prev = last.swap(now, Ordering::Relaxed);
            if prev != 0 {
                gap.fetch_max((now - prev) / 1000, Ordering::Relaxed);
            }
            count.fetch_add(1, Ordering::Relaxed);
        })?;
    }
    let everyone = addresses.len();
    let members = everyone - 1;
    let full = if (id as usize) < members {
        members
    } else {
        everyone
    };
    node.wait_for_nodes(full, Duration::from_secs(120))?;
    println!(
        "{} t={}",
        if full == everyone { "MESH" } else { "MEMBERS" },
        now_ns()
    );
    let stop = Arc::new(AtomicBool::new(false));
    let sender = stream_to.map(|to| {
        let (node, stop) = (node.clone(), stop.clone());
        std::thread::spawn(move || {
            let tick = Tick(vec![0u8; 48]);
            while !stop.load(Ordering::Relaxed) {
                let _ = node.send(NodeId(to), &tick);
            }
        })
    });
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line?;
        let mut w = line.split_whitespace();
        match w.next() {
            Some("mark") => {
                let k = w.next().unwrap_or("0");
                println!(
                    "MARK k={k} count={} gap_us={}",
                    count.load(Ordering::Relaxed),
                    gap.swap(0, Ordering::Relaxed)
                );
            }
            Some("exit") | None => break,
            Some(other) => eprintln!("membership-node: unknown command {other:?}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(s) = sender {
        let _ = s.join();
    }
    Ok(())
}
