//! The coordinator: plans the runs, starts (or waits for) the node
//! processes, drives every phase as a barrier over the control channel and
//! turns what the nodes report into [`Record`]s.
//!
//! Placement of node processes:
//! - `Local`: N processes on this host, data over 127.0.0.1, control over a
//!   Unix socket;
//! - `Netns`: node `i` runs inside network namespace `i` (see
//!   [`crate::netns`]), data over the veth/bridge network;
//! - `Hosts`: one node per host from a node file; every host runs
//!   `dxnet-bench --node-file F --node-id I` with the same config, node 0 is
//!   the coordinator and the others connect to it over TCP.
//!
//! In-process bindings (dxnet-loopback) always run as one local process.

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use crate::binding::{BindingKind, BindingSetup};
use crate::config::{fmt_size, BenchConfig, Group};
use crate::metrics::{aggregate, Record};
use crate::netns::Layout;
use crate::proto::{Channel, Command, Listener, Reply};

/// Where node processes run.
pub enum Placement {
    /// Local processes over loopback.
    Local,
    /// Local processes, one per network namespace.
    Netns(Layout),
    /// One node per host; the channels of the connected node processes,
    /// index = node id.
    Hosts {
        /// Host of each node id.
        hosts: Vec<String>,
        /// Control channel of each node id.
        channels: Vec<Channel>,
        /// The local child process that plays node 0.
        child: Option<Child>,
    },
}

/// A node process taking part in a group.
struct Proc {
    ch: Channel,
    ids: Vec<u16>,
}

/// Everything a suite produced.
pub struct Outcome {
    /// One record per measured repetition.
    pub records: Vec<Record>,
    /// Groups that failed, with the reason.
    pub failures: Vec<String>,
}

/// Runs the whole suite.
pub struct Coordinator {
    cfg: BenchConfig,
    placement: Placement,
    exe: PathBuf,
    quiet: bool,
}

impl Coordinator {
    /// A coordinator for `cfg`; node processes are started from `exe`.
    pub fn new(cfg: BenchConfig, placement: Placement, exe: PathBuf, quiet: bool) -> Self {
        Coordinator {
            cfg,
            placement,
            exe,
            quiet,
        }
    }

    /// Runs every group, keeping going after a failed group.
    pub fn run(mut self) -> Result<Outcome> {
        let groups = self.cfg.plan()?;
        let total: u64 = groups
            .iter()
            .flat_map(|g| &g.runs)
            .map(|r| u64::from(r.repetitions) + 1)
            .sum();
        let pb = if self.quiet {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(total)
        };
        pb.set_style(
            ProgressStyle::with_template(
                "{elapsed_precise:.dim} [{bar:32.cyan/blue}] {pos}/{len} {msg}",
            )
            .unwrap()
            .progress_chars("=> "),
        );
        let stride = groups.iter().map(|g| g.key.nodes).max().unwrap_or(2) as u32 + 1;
        let mut out = Outcome {
            records: Vec::new(),
            failures: Vec::new(),
        };
        for (gi, g) in groups.iter().enumerate() {
            let skip = self.skip_reason(g);
            if let Some(why) = skip {
                note(&pb, format!("skipping {}: {why}", describe(g)));
                pb.inc(g.runs.iter().map(|r| u64::from(r.repetitions) + 1).sum());
                continue;
            }
            let port_off = (gi as u32 * stride) % 4000;
            match self.run_group(gi, g, port_off, &pb, &mut out.records) {
                Ok(()) => {}
                Err(e) => {
                    let msg = format!("{}: {e:#}", describe(g));
                    note(&pb, format!("FAILED {msg}"));
                    out.failures.push(msg);
                    if matches!(self.placement, Placement::Hosts { .. }) {
                        // The remote processes may be out of step: stop.
                        break;
                    }
                }
            }
        }
        pb.finish_and_clear();
        if let Placement::Hosts {
            channels, child, ..
        } = &mut self.placement
        {
            for ch in channels.iter_mut() {
                let _ = ch.send(&Command::Exit);
            }
            if let Some(c) = child {
                reap(c, Duration::from_secs(5));
            }
        }
        Ok(out)
    }

    fn skip_reason(&self, g: &Group) -> Option<String> {
        let kind = BindingKind::parse(&g.key.binding).ok()?;
        if kind.is_external() && !matches!(self.placement, Placement::Local) {
            return Some("perftest and mpirun run only on the local host".into());
        }
        match &self.placement {
            Placement::Hosts { hosts, .. } => {
                if kind.in_process() {
                    Some("in-process binding in a multi-host run".into())
                } else if g.key.nodes > hosts.len() {
                    Some(format!(
                        "needs {} nodes, node file has {}",
                        g.key.nodes,
                        hosts.len()
                    ))
                } else {
                    None
                }
            }
            Placement::Netns(l) if !kind.in_process() && g.key.nodes > l.nodes => Some(format!(
                "needs {} namespaces, {} set up",
                g.key.nodes, l.nodes
            )),
            _ => None,
        }
    }

    fn address(&self, id: usize, port: u32) -> String {
        match &self.placement {
            Placement::Local => format!("127.0.0.1:{port}"),
            Placement::Netns(l) => format!("{}:{port}", l.address(id)),
            Placement::Hosts { hosts, .. } => format!("{}:{port}", hosts[id]),
        }
    }

    fn run_group(
        &mut self,
        gi: usize,
        g: &Group,
        port_off: u32,
        pb: &ProgressBar,
        records: &mut Vec<Record>,
    ) -> Result<()> {
        let kind = BindingKind::parse(&g.key.binding)?;
        if kind.is_external() {
            return self.run_external(g, pb, records);
        }
        let n = g.key.nodes;
        let params = &self.cfg.params;
        let setup = BindingSetup {
            binding: g.key.binding.clone(),
            nodes: (0..n)
                .map(|i| {
                    let port = u32::from(params.base_port) + port_off + i as u32;
                    let addr = if kind.uses_network() {
                        self.address(i, port)
                    } else {
                        String::new()
                    };
                    (i as u16, addr)
                })
                .collect(),
            threads: g.key.threads,
            handlers: g.key.handlers,
            params: g.params(params),
            fabric: format!("dxnet-bench-{}-{gi}", std::process::id()),
        };
        let _pki = if kind == BindingKind::DxnetTcpTls {
            Some(Pki::write(&setup)?)
        } else {
            None
        };
        let phase_timeout = Duration::from_secs(params.timeout_s * 2 + 30);
        pb.set_message(format!("{}: starting", describe(g)));

        // Initialize: start the processes (or borrow the remote ones).
        let mut children: Vec<Child> = Vec::new();
        let mut procs: Vec<Proc> = Vec::new();
        let mut host_channels = None;
        match &mut self.placement {
            Placement::Hosts { channels, .. } => {
                let taken: Vec<Channel> = channels.drain(..n).collect();
                procs = taken
                    .into_iter()
                    .enumerate()
                    .map(|(i, ch)| Proc {
                        ch,
                        ids: vec![i as u16],
                    })
                    .collect();
                host_channels = Some(());
            }
            placement => {
                let listener = Listener::unix(&gi.to_string())?;
                let addr = listener.address()?;
                let layout = match placement {
                    Placement::Netns(l) if !kind.in_process() => Some(l.clone()),
                    _ => None,
                };
                let plan: Vec<Vec<u16>> = if kind.in_process() {
                    vec![(0..n as u16).collect()]
                } else {
                    (0..n as u16).map(|i| vec![i]).collect()
                };
                let cores = if self.cfg.params.bind_nodes {
                    Some(crate::affinity::cores_of(&crate::affinity::allowed_cpus()?))
                } else {
                    None
                };
                let shares: Vec<Option<Vec<usize>>> = (0..plan.len())
                    .map(|i| {
                        cores
                            .as_ref()
                            .map(|c| crate::affinity::share(c, i, plan.len()))
                    })
                    .collect();
                for (ids, share) in plan.iter().zip(&shares) {
                    let ns = layout.as_ref().map(|l| l.namespace(ids[0] as usize));
                    children.push(spawn_node(
                        &self.exe,
                        &addr,
                        ids,
                        ns.as_deref(),
                        share.as_deref(),
                    )?);
                }
                for _ in 0..plan.len() {
                    let mut ch = listener.accept(Duration::from_secs(30), || {
                        for c in children.iter_mut() {
                            if let Some(st) = c.try_wait()? {
                                bail!("a node process exited early ({st})");
                            }
                        }
                        Ok(())
                    })?;
                    match ch.recv::<Reply>(Some(Duration::from_secs(30)))? {
                        Reply::Hello { ids, cpus, .. } => {
                            // Bound: each process runs on the share it was
                            // given (this is the only check: it covers a
                            // missing `--cpus` and a binding that failed).
                            let given = plan
                                .iter()
                                .position(|p| *p == ids)
                                .and_then(|i| shares[i].clone());
                            if let Some(mut want) = given {
                                want.sort_unstable();
                                if cpus != want {
                                    bail!("nodes {ids:?} run on CPUs {cpus:?}, not on their share {want:?}");
                                }
                            }
                            procs.push(Proc { ch, ids })
                        }
                        other => bail!("expected hello, got {other:?}"),
                    }
                }
            }
        }

        let result = (|| -> Result<()> {
            broadcast(
                &mut procs,
                &Command::Init {
                    setup: Box::new(setup.clone()),
                },
                phase_timeout,
            )
            .context("initialize")?;
            broadcast(&mut procs, &Command::Connect, phase_timeout).context("connect")?;
            for run in &g.runs {
                let what = format!(
                    "{} {} {} {}",
                    g.key.binding,
                    run.operation,
                    run.mode,
                    fmt_size(run.size)
                );
                pb.set_message(format!("{what}: warm-up"));
                broadcast(
                    &mut procs,
                    &Command::Prepare { run: run.clone() },
                    phase_timeout,
                )
                .with_context(|| format!("{what}: prepare"))?;
                broadcast(&mut procs, &Command::Warmup, phase_timeout)
                    .with_context(|| format!("{what}: warm-up"))?;
                pb.inc(1);
                for rep in 0..run.repetitions {
                    pb.set_message(format!("{what}: repetition {}", rep + 1));
                    broadcast(
                        &mut procs,
                        &Command::Measure { repetition: rep },
                        phase_timeout,
                    )
                    .with_context(|| format!("{what}: repetition {rep}"))?;
                    let replies = broadcast(&mut procs, &Command::Collect, phase_timeout)
                        .with_context(|| format!("{what}: collect"))?;
                    let results: Vec<_> = replies
                        .into_iter()
                        .filter_map(|r| match r {
                            Reply::Measured { result } => Some(result),
                            _ => None,
                        })
                        .collect();
                    records.push(aggregate(&g.key, run, rep, &results));
                    pb.inc(1);
                }
            }
            broadcast(&mut procs, &Command::Cleanup, phase_timeout).context("cleanup")?;
            Ok(())
        })();

        // Hand remote channels back, or stop the local processes.
        if host_channels.is_some() {
            if let Placement::Hosts { channels, .. } = &mut self.placement {
                let mut back: Vec<Channel> = procs.into_iter().map(|p| p.ch).collect();
                back.append(channels);
                *channels = back;
            }
        } else {
            if result.is_ok() {
                let _ = broadcast(&mut procs, &Command::Exit, Duration::from_secs(10));
            }
            drop(procs);
            for c in children.iter_mut() {
                if result.is_err() {
                    let _ = c.kill();
                }
                reap(c, Duration::from_secs(10));
            }
        }
        result
    }
}

impl Coordinator {
    /// A perftest or MPI group: every repetition runs the perftest pair or
    /// `mpirun` itself (no node processes, no warm-up phase of ours; perftest
    /// warms up by itself, the MPI program runs the warm-up count first).
    fn run_external(&self, g: &Group, pb: &ProgressBar, records: &mut Vec<Record>) -> Result<()> {
        let params = &self.cfg.params;
        for run in &g.runs {
            let what = format!(
                "{} {} {} {}",
                g.key.binding,
                run.operation,
                run.mode,
                fmt_size(run.size)
            );
            pb.inc(1);
            for rep in 0..run.repetitions {
                pb.set_message(format!("{what}: repetition {}", rep + 1));
                // perftest's exchange ports lie above the data ports of the
                // groups (base + 0..4000 + nodes), a fresh pair per run.
                static NEXT: AtomicU32 = AtomicU32::new(0);
                let k = NEXT.fetch_add(2, Ordering::Relaxed) % 1000;
                let port = (u32::from(params.base_port) + 4100 + k) as u16;
                let kind = BindingKind::parse(&g.key.binding)?;
                let rec = if kind.is_mpi() {
                    crate::binding::mpi::measure(&g.key, run, rep, params)
                } else {
                    crate::binding::perftest::measure(&g.key, run, rep, params, port)
                }
                .with_context(|| format!("{what}: repetition {rep}"))?;
                records.push(rec);
                pb.inc(1);
            }
        }
        Ok(())
    }
}

/// Prints above the progress bar, or plainly when there is none.
fn note(pb: &ProgressBar, msg: String) {
    if pb.is_hidden() {
        eprintln!("{msg}");
    } else {
        pb.println(msg);
    }
}

fn describe(g: &Group) -> String {
    format!(
        "{} nodes={} threads={} handlers={}",
        g.key.binding, g.key.nodes, g.key.threads, g.key.handlers
    )
}

/// Sends `cmd` to every process, then waits for every reply: the barrier.
fn broadcast(procs: &mut [Proc], cmd: &Command, timeout: Duration) -> Result<Vec<Reply>> {
    for p in procs.iter_mut() {
        p.ch.send(cmd)?;
    }
    let mut replies = Vec::with_capacity(procs.len());
    let mut errors = Vec::new();
    for p in procs.iter_mut() {
        match p.ch.recv::<Reply>(Some(timeout)) {
            Ok(Reply::Failed { error }) => errors.push(format!("nodes {:?}: {error}", p.ids)),
            Ok(r) => replies.push(r),
            Err(e) => errors.push(format!("nodes {:?}: {e:#}", p.ids)),
        }
    }
    if !errors.is_empty() {
        return Err(anyhow!(errors.join("; ")));
    }
    Ok(replies)
}

/// Starts a node process hosting `ids`, in namespace `netns` and on
/// `cpus` if given.
/// `xs` as one argument of the node subcommand (`0,1,2`).
fn comma_list<T: std::fmt::Display>(xs: &[T]) -> String {
    xs.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn spawn_node(
    exe: &PathBuf,
    coord: &str,
    ids: &[u16],
    netns: Option<&str>,
    cpus: Option<&[usize]>,
) -> Result<Child> {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = std::process::Command::new("ip");
            c.args(["netns", "exec", ns]).arg(exe);
            c
        }
        None => std::process::Command::new(exe),
    };
    cmd.args(["node", "--coord", coord, "--ids", &comma_list(ids)]);
    if let Some(c) = cpus {
        cmd.args(["--cpus", &comma_list(c)]);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    cmd.spawn()
        .with_context(|| format!("cannot start node process {}", exe.display()))
}

/// Waits for a child for up to `grace`, then kills it.
fn reap(c: &mut Child, grace: Duration) {
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = c.kill();
    let _ = c.wait();
}

/// Multi-host mode, node 0: listens for the other nodes' processes on
/// `control` (`ip:port`), starts node 0 itself as a local child and returns
/// the placement once all `hosts.len()` processes said hello.
pub fn gather_hosts(hosts: Vec<String>, control: &str, exe: &PathBuf) -> Result<Placement> {
    let listener = Listener::tcp(control)?;
    let port = control.rsplit_once(':').map(|(_, p)| p).unwrap_or("0");
    let mut child = spawn_node(exe, &format!("tcp:127.0.0.1:{port}"), &[0], None, None)?;
    let mut slots: Vec<Option<Channel>> = (0..hosts.len()).map(|_| None).collect();
    eprintln!(
        "waiting for {} node processes on {control} ...",
        hosts.len()
    );
    for _ in 0..hosts.len() {
        let mut ch = listener.accept(Duration::from_secs(600), || {
            if let Some(st) = child.try_wait()? {
                bail!("local node 0 exited early ({st})");
            }
            Ok(())
        })?;
        match ch.recv::<Reply>(Some(Duration::from_secs(30)))? {
            Reply::Hello { ids, .. } if ids.len() == 1 && (ids[0] as usize) < hosts.len() => {
                let i = ids[0] as usize;
                if slots[i].is_some() {
                    bail!("node {i} connected twice");
                }
                slots[i] = Some(ch);
            }
            other => bail!("unexpected hello {other:?}"),
        }
    }
    Ok(Placement::Hosts {
        hosts,
        channels: slots.into_iter().map(|c| c.unwrap()).collect(),
        child: Some(child),
    })
}

/// Parses a node file: one `ID HOST` per line (`#` comments); ids must be
/// 0..N without gaps. Returns the hosts by id.
pub fn parse_node_file(text: &str) -> Result<Vec<String>> {
    let mut entries = Vec::new();
    for (ln, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut it = line.split_whitespace();
        let (Some(id), Some(host), None) = (it.next(), it.next(), it.next()) else {
            bail!("node file line {}: expected `ID HOST`", ln + 1);
        };
        let id: usize = id
            .parse()
            .with_context(|| format!("node file line {}: bad id", ln + 1))?;
        entries.push((id, host.to_string()));
    }
    entries.sort();
    for (i, (id, _)) in entries.iter().enumerate() {
        if *id != i {
            bail!("node file: ids must be 0..{} without gaps", entries.len());
        }
    }
    if entries.len() < 2 {
        bail!("node file: at least two nodes are needed");
    }
    Ok(entries.into_iter().map(|(_, h)| h).collect())
}

/// The certificates of a `dxnet-tcp-tls` group, removed when dropped.
struct Pki(std::path::PathBuf);

impl Pki {
    fn write(setup: &BindingSetup) -> Result<Self> {
        let dir = setup.pki_dir();
        let ids: Vec<dxnet::NodeId> = setup.nodes.iter().map(|(i, _)| dxnet::NodeId(*i)).collect();
        dxnet::pki::generate_cluster_pki(&dir, &ids)
            .map_err(|e| anyhow::anyhow!("writing TLS certificates to {}: {e}", dir.display()))?;
        Ok(Pki(dir))
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_file() {
        let h = parse_node_file("# cluster\n1 10.0.0.2\n0 10.0.0.1  # head\n\n").unwrap();
        assert_eq!(h, vec!["10.0.0.1", "10.0.0.2"]);
        assert!(parse_node_file("0 a\n2 b\n").is_err());
        assert!(parse_node_file("0 a b\n1 c").is_err());
        assert!(parse_node_file("0 a\n").is_err());
    }
}
