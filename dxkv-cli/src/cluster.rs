//! `dxkv local`: a cluster of processes. Storage nodes run `dxkv storage`,
//! benchmark nodes `dxkv ycsb --coordinated`, each handed its dxnet
//! configuration on stdin; this process starts every phase on all
//! benchmark nodes at once, gathers their reports and merges them. Nodes
//! run on 127.0.0.1 (node i on port + i), each in its own network namespace
//! (node i at 10.201.0.(i+1), all on one port), or on the hosts of a node
//! file, started through a launcher such as ssh.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use dxkv::ycsb::{self, Report, Workload};
use dxnet::Config;
use dxnet_bench::netns;
use serde::Serialize;

use crate::{phases, workload, YcsbArgs};

/// What `dxkv local` runs.
pub struct LocalArgs {
    /// (storage nodes, benchmark nodes) of each cluster to run.
    pub layouts: Vec<(u16, u16)>,
    pub netns: bool,
    /// Node i on the i-th host of a node file (host, port), started
    /// through `launcher` (e.g. ssh) as `remote_exe`.
    pub hosts: Option<Vec<(String, u16)>>,
    pub launcher: Vec<String>,
    pub remote_exe: Option<PathBuf>,
    pub bindings: Vec<String>,
    pub rounds: usize,
    pub port: u16,
    pub max_memory: u64,
    pub plot: Option<PathBuf>,
    pub ycsb: YcsbArgs,
}

/// One binding's phases on one fresh cluster.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// The preset's name.
    pub workload_name: String,
    pub workload: Workload,
    pub storage_nodes: u16,
    pub benchmark_nodes: u16,
    /// Client threads of each benchmark node.
    pub threads_per_node: usize,
    pub round: usize,
    pub binding: String,
    /// Per phase, the benchmark nodes' reports merged.
    pub reports: Vec<Report>,
    /// Per phase, each benchmark node's operations per second.
    pub per_node_ops_per_sec: Vec<Vec<f64>>,
}

/// Runs every workload on every layout, `rounds` times each binding (in a
/// rotated order), then prints the summary and writes JSON, CSV and plots.
pub fn local(a: &LocalArgs) -> Result<(), String> {
    for name in &a.ycsb.workload {
        workload(name, &a.ycsb)?; // refuse bad arguments before starting
    }
    phases(&a.ycsb)?;
    for b in &a.bindings {
        if !["dxkv", "dxkv-ib", "memcached", "redis"].contains(&b.as_str()) {
            return Err(format!(
                "unknown binding {b:?} (dxkv, dxkv-ib, memcached, redis)"
            ));
        }
        if b == "dxkv-ib" && !dxnet::TransportKind::Ib.is_available() {
            return Err("dxkv-ib: this build has no InfiniBand engine".into());
        }
    }
    if a.bindings.is_empty() {
        return Err("--bindings: name at least one".into());
    }
    for &(s, b) in &a.layouts {
        if s == 0 || b == 0 {
            return Err("at least one storage and one benchmark node".into());
        }
        if s > 1 && a.bindings.iter().any(|b| !is_dxkv(b)) {
            return Err(
                "memcached and Redis run as one server: compare them with one storage node".into(),
            );
        }
    }
    let most = a
        .layouts
        .iter()
        .map(|&(s, b)| u32::from(s) + u32::from(b))
        .max()
        .unwrap_or(2);
    if a.netns && most > 250 {
        return Err(format!("--netns: at most 250 nodes, not {most}"));
    }
    if most > u32::from(u16::MAX) {
        return Err(format!("{most} nodes: node ids are 16 bits"));
    }
    if !a.netns && a.hosts.is_none() && u32::from(a.port) + most - 1 > 65_535 {
        return Err("--port: the node map runs past port 65535".into());
    }
    let most = most as u16;
    if let Some(h) = &a.hosts {
        if a.netns {
            return Err("--hosts and --netns: one placement at a time".into());
        }
        if h.len() < most as usize {
            return Err(format!(
                "the node file lists {} hosts, the largest cluster needs {most}",
                h.len()
            ));
        }
        if a.launcher.is_empty() {
            return Err("--launcher: empty".into());
        }
    }
    let layout = a
        .netns
        .then(|| netns::Layout::new(&format!("dxkv{}n", std::process::id()), most as usize, 1500));
    let _guard = match &layout {
        Some(l) => {
            remove_stale_namespaces();
            l.setup().map_err(|e| format!("{e:#}"))?;
            Some(netns::Guard(l.clone()))
        }
        None => None,
    };
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let placement = Placement {
        netns: layout.as_ref(),
        hosts: a.hosts.as_deref(),
        launcher: &a.launcher,
        exe: a.remote_exe.clone().unwrap_or(exe),
        port: a.port,
    };
    let rounds = a.rounds.max(1);
    let mut runs = Vec::new();
    for name in &a.ycsb.workload {
        for &(storage, bench) in &a.layouts {
            for &threads in &a.ycsb.threads {
                for round in 0..rounds {
                    for i in 0..a.bindings.len() {
                        let binding = &a.bindings[(i + round) % a.bindings.len()];
                        if binding == "memcached" && workload(name, &a.ycsb)?.scanproportion > 0.0 {
                            if round == 0 {
                                println!("--- {name}: memcached has no scan, left out");
                            }
                            continue;
                        }
                        println!(
                            "--- {name}, {storage} storage + {bench} benchmark nodes x {threads} threads, round {} of {rounds}: {binding}",
                            round + 1
                        );
                        let c = Cluster {
                            storage,
                            bench,
                            threads,
                        };
                        let (reports, per_node_ops_per_sec) =
                            match run_once(a, &placement, name, c, binding) {
                                Ok(r) => r,
                                Err(e) => {
                                    // Keep what the finished runs measured.
                                    if !runs.is_empty() {
                                        print!("{}", crate::summary::table(&a.bindings, &runs));
                                        write_outputs(a, &runs)?;
                                    }
                                    return Err(e);
                                }
                            };
                        runs.push(Run {
                            workload_name: name.clone(),
                            workload: workload(name, &a.ycsb)?,
                            storage_nodes: storage,
                            benchmark_nodes: bench,
                            threads_per_node: threads,
                            round,
                            binding: binding.clone(),
                            reports,
                            per_node_ops_per_sec,
                        });
                    }
                }
            }
        }
    }
    if runs.len() > 1 {
        print!("{}", crate::summary::table(&a.bindings, &runs));
    }
    write_outputs(a, &runs)
}

fn write_outputs(a: &LocalArgs, runs: &[Run]) -> Result<(), String> {
    let people: Vec<Run> = runs
        .iter()
        .map(|r| Run {
            reports: r.reports.iter().map(crate::without_histograms).collect(),
            ..r.clone()
        })
        .collect();
    if let Some(path) = &a.ycsb.json {
        let json = serde_json::json!({ "runs": people });
        std::fs::write(
            path,
            serde_json::to_string_pretty(&json).expect("serializable"),
        )
        .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if let Some(path) = &a.ycsb.csv {
        let mut csv = format!(
            "workload,storage_nodes,benchmark_nodes,threads_per_node,round,{}\n",
            ycsb::driver::CSV_HEADER
        );
        for r in runs {
            for rep in &r.reports {
                for row in rep.csv_rows().lines() {
                    csv += &format!(
                        "{},{},{},{},{},{row}\n",
                        r.workload_name,
                        r.storage_nodes,
                        r.benchmark_nodes,
                        r.threads_per_node,
                        r.round + 1
                    );
                }
            }
        }
        std::fs::write(path, csv).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if let Some(dir) = &a.plot {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for chart in crate::summary::charts(&a.bindings, runs) {
            let files =
                dxnet_bench::output::plot::render(&chart, dir).map_err(|e| e.to_string())?;
            for f in files {
                println!("plot: {}", f.display());
            }
        }
    }
    Ok(())
}

/// Deletes the namespaces of earlier `dxkv local --netns` runs whose
/// process is gone (killed before it could tear them down).
fn remove_stale_namespaces() {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("dxkv")
            .and_then(|r| r.split_once('n'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip").args(["netns", "del", &name]).status();
        }
    }
}

/// dxkv itself, over TCP (`dxkv`) or InfiniBand/RoCE verbs (`dxkv-ib`).
fn is_dxkv(binding: &str) -> bool {
    binding.starts_with("dxkv")
}

/// Where node i runs and listens: on 127.0.0.1 (port + i), in network
/// namespace i, or on the i-th host of a node file.
struct Placement<'a> {
    netns: Option<&'a netns::Layout>,
    hosts: Option<&'a [(String, u16)]>,
    launcher: &'a [String],
    /// The `dxkv` executable (on the hosts: its path there).
    exe: PathBuf,
    port: u16,
}

impl Placement<'_> {
    fn host(&self, i: u16) -> String {
        match (self.hosts, self.netns) {
            (Some(h), _) => h[i as usize].0.clone(),
            (None, Some(l)) => l.address(i as usize),
            (None, None) => "127.0.0.1".into(),
        }
    }

    fn port(&self, i: u16) -> u16 {
        match (self.hosts, self.netns) {
            (Some(h), _) => h[i as usize].1,
            (None, Some(_)) => self.port,
            (None, None) => self.port + i,
        }
    }

    fn address(&self, i: u16) -> String {
        let host = self.host(i);
        if host.contains(':') {
            format!("[{host}]:{}", self.port(i))
        } else {
            format!("{host}:{}", self.port(i))
        }
    }

    /// `program args` run as node i: in its namespace if there are some,
    /// through the launcher on its host if there is a node file (the
    /// launcher gets the host, then the command line quoted for a POSIX
    /// shell, as ssh wants it).
    fn command(&self, i: u16, program: &Path, args: &[String]) -> Command {
        self.command_with(i, program, args, false)
    }

    /// [`Placement::command`] for a program that ignores its stdin: on a
    /// host it is stopped when its stdin ends, as a dxkv node stops (here
    /// the process itself is killed).
    fn server_command(&self, i: u16, program: &Path, args: &[String]) -> Command {
        self.command_with(i, program, args, true)
    }

    fn command_with(&self, i: u16, program: &Path, args: &[String], until_eof: bool) -> Command {
        match (self.hosts, self.netns) {
            (Some(h), _) => {
                let mut c = Command::new(&self.launcher[0]);
                let line: Vec<String> = std::iter::once(program.to_string_lossy().into_owned())
                    .chain(args.iter().cloned())
                    .map(|a| shell_quote(&a))
                    .collect();
                let mut line = line.join(" ");
                if until_eof {
                    // A server ignores its stdin: the host's shell stops it
                    // when the line's stdin ends (ssh ending included).
                    line = format!("{line} </dev/null & p=$!; cat >/dev/null; kill $p");
                }
                c.args(&self.launcher[1..]).arg(&h[i as usize].0).arg(line);
                c
            }
            (None, Some(l)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &l.namespace(i as usize)])
                    .arg(program)
                    .args(args);
                c
            }
            (None, None) => {
                let mut c = Command::new(program);
                c.args(args);
                c
            }
        }
    }
}

/// `s` as one word for a POSIX shell.
fn shell_quote(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_=.,/:@%+".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Processes stopped on drop: stdin closed (a dxkv node's signal to shut
/// down), a second to exit, then killed.
struct Processes(Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for c in &mut self.0 {
            drop(c.stdin.take());
        }
        for c in &mut self.0 {
            for _ in 0..50 {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The nodes of one run.
#[derive(Debug, Clone, Copy)]
struct Cluster {
    storage: u16,
    bench: u16,
    /// Client threads per benchmark node.
    threads: usize,
}

/// A fresh cluster for one binding: its servers, its benchmark nodes, every
/// phase; returns the merged report of each phase and each node's rate.
fn run_once(
    a: &LocalArgs,
    at: &Placement,
    name: &str,
    cluster: Cluster,
    binding: &str,
) -> Result<(Vec<Report>, Vec<Vec<f64>>), String> {
    let Cluster {
        storage,
        bench,
        threads,
    } = cluster;
    let n = storage + bench;
    // A fresh secret: only this run's processes can join the cluster.
    let secret = format!(
        "{:016x}{:016x}",
        rand::random::<u64>(),
        rand::random::<u64>()
    );
    // Each node's configuration goes to it as the first line of its stdin
    // (`--config -`): no files to copy to other hosts.
    let config_line = |id: u16| -> String {
        // The node map of ids 0..n, each address set below.
        let mut c = Config::tcp_localhost(id, n, 0);
        for e in &mut c.nodes {
            e.address = at.address(e.id);
        }
        c.cluster_secret = Some(secret.clone());
        if binding == "dxkv-ib" {
            // The device, port and GID as dxnet-bench's verbs bindings take
            // them ($RDMA_DEV, $RDMA_PORT, $RDMA_GID_INDEX, as the Soft-RoCE
            // VM sets them); the node map's addresses carry the UDP
            // handshake.
            let rdma = dxnet_bench::config::RdmaParams::default().resolve();
            c.transport = dxnet::TransportKind::Ib;
            c.ib.device = rdma.device.unwrap_or_default();
            c.ib.port = rdma.port;
            if let Some(g) = rdma.gid_index.and_then(|g| u8::try_from(g).ok()) {
                c.ib.gid_index = g;
            }
        }
        format!("{}\n", serde_json::to_string(&c).expect("serializable"))
    };
    let mut servers = Processes(Vec::new());
    if is_dxkv(binding) {
        for id in 0..storage {
            let args: Vec<String> = [
                "storage",
                "--config",
                "-",
                "--stop-on-stdin-eof",
                "--max-memory",
            ]
            .iter()
            .map(|s| s.to_string())
            .chain([a.max_memory.to_string()])
            .collect();
            let mut child = at
                .command(id, &at.exe, &args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| format!("starting a storage process: {e}"))?;
            let mut line = String::new();
            let out = child.stdout.take().expect("piped");
            let sent = child
                .stdin
                .as_mut()
                .expect("piped")
                .write_all(config_line(id).as_bytes());
            servers.0.push(child);
            sent.map_err(|e| format!("storage node {id} stopped at once: {e}"))?;
            BufReader::new(out)
                .read_line(&mut line)
                .map_err(|e| e.to_string())?;
            if !line.starts_with("READY") {
                return Err(format!(
                    "storage node {id} did not start (see its errors above)"
                ));
            }
        }
    } else {
        servers.0.push(start_baseline(binding, at, a.max_memory)?);
    }
    let mut nodes = Processes(Vec::new());
    let (tx, rx) = mpsc::channel::<(usize, Option<String>)>();
    let mut stdins: Vec<ChildStdin> = Vec::new();
    let storage_ids: Vec<String> = (0..storage).map(|i| i.to_string()).collect();
    for b in 0..bench {
        let id = storage + b;
        let child_binding = if is_dxkv(binding) { "dxkv" } else { binding };
        let mut args: Vec<String> = vec![
            "ycsb".into(),
            "--coordinated".into(),
            "--binding".into(),
            child_binding.into(),
            "--client-index".into(),
            b.to_string(),
            "--clients".into(),
            bench.to_string(),
            "--workload".into(),
            name.into(),
            "--threads".into(),
            threads.to_string(),
            "--phases".into(),
            a.ycsb.phases.join(","),
        ];
        for s in &a.ycsb.set {
            args.extend(["--set".into(), s.clone()]);
        }
        if let Some(r) = a.ycsb.records {
            args.extend(["--records".into(), r.to_string()]);
        }
        if let Some(o) = a.ycsb.operations {
            args.extend(["--operations".into(), o.to_string()]);
        }
        if is_dxkv(binding) {
            args.extend([
                "--config".into(),
                "-".into(),
                "--storage".into(),
                storage_ids.join(","),
            ]);
        } else {
            args.extend(["--server".into(), at.address(0)]);
        }
        let mut cmd = at.command(id, &at.exe, &args);
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting a benchmark process: {e}"))?;
        let mut stdin = child.stdin.take().expect("piped");
        let out = child.stdout.take().expect("piped");
        nodes.0.push(child);
        if is_dxkv(binding) {
            stdin
                .write_all(config_line(id).as_bytes())
                .map_err(|e| format!("benchmark node {b} stopped at once: {e}"))?;
        }
        stdins.push(stdin);
        let tx = tx.clone();
        let i = b as usize;
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send((i, Some(line))).is_err() {
                    return;
                }
            }
            let _ = tx.send((i, None));
        });
    }
    drop(tx);
    let mut merged = Vec::new();
    let mut per_node = Vec::new();
    let tty = std::io::stderr().is_terminal();
    // A node may be ready for the next phase before the others reported.
    let mut ready_early = BTreeSet::new();
    // Nodes whose output ended after their last report.
    let mut gone = BTreeSet::new();
    for phase in phases(&a.ycsb)? {
        let pname = phase.to_string();
        // Every node ready, then all go at once.
        let mut ready = std::mem::take(&mut ready_early);
        if let Some(&i) = gone.iter().find(|i| !ready.contains(*i)) {
            return Err(exited(i));
        }
        while ready.len() < bench as usize {
            match next_line(&rx)? {
                (i, Some(line)) if line == format!("READY {pname}") => {
                    ready.insert(i);
                }
                (i, None) => return Err(exited(i)),
                _ => {}
            }
        }
        for (i, s) in stdins.iter_mut().enumerate() {
            s.write_all(b"go\n")
                .and_then(|_| s.flush())
                .map_err(|e| format!("benchmark node {i} stopped: {e}"))?;
        }
        let mut reports: Vec<Option<Report>> = vec![None; bench as usize];
        let mut done = vec![0u64; bench as usize];
        while reports.iter().any(Option::is_none) {
            let (i, line) = next_line(&rx)?;
            let Some(line) = line else {
                // After its last report a node exits.
                if reports[i].is_none() {
                    return Err(exited(i));
                }
                gone.insert(i);
                continue;
            };
            if let Some(n) = line.strip_prefix("PROGRESS ") {
                done[i] = n.parse().unwrap_or(done[i]);
                if tty {
                    eprint!("\r{pname}: {} operations   ", done.iter().sum::<u64>());
                }
            } else if let Some(json) = line.strip_prefix("REPORT ") {
                let r: Report = serde_json::from_str(json)
                    .map_err(|e| format!("benchmark node {i} sent a bad report: {e}"))?;
                reports[i] = Some(r);
            } else if line.starts_with("READY ") {
                ready_early.insert(i);
            }
        }
        if tty {
            eprint!("\r{:40}\r", "");
        }
        let reports: Vec<Report> = reports.into_iter().flatten().collect();
        let mut m = Report::merge(&reports)?;
        m.binding = binding.to_string();
        print!("{}", m.table());
        per_node.push(reports.iter().map(|r| r.ops_per_sec).collect());
        merged.push(m);
    }
    drop(stdins);
    drop(nodes);
    drop(servers);
    Ok((merged, per_node))
}

/// How long the benchmark nodes may all stay silent: a running node prints
/// its progress every second, a node between phases is ready at once, and
/// a starting one within its connection timeouts.
const SILENCE: Duration = Duration::from_secs(60);

/// The next line of a benchmark node, `None` when it closed its output; an
/// error when none said anything for [`SILENCE`].
fn next_line(
    rx: &mpsc::Receiver<(usize, Option<String>)>,
) -> Result<(usize, Option<String>), String> {
    rx.recv_timeout(SILENCE).map_err(|e| match e {
        mpsc::RecvTimeoutError::Timeout => format!(
            "no benchmark node said anything for {} s (a node or its connection hangs)",
            SILENCE.as_secs()
        ),
        mpsc::RecvTimeoutError::Disconnected => "every benchmark node exited".to_string(),
    })
}

fn exited(i: usize) -> String {
    format!("benchmark node {i} exited early (see its errors above)")
}

/// A new memcached (2 threads, as the Ibdxnet paper's comparison) or Redis
/// as node 0, listening where the storage node would; stopped with the
/// run.
fn start_baseline(which: &str, at: &Placement, max_memory: u64) -> Result<Child, String> {
    let host = at.host(0);
    let port = at.port(0).to_string();
    let mib = (max_memory >> 20).max(64).to_string();
    let mut cmd = if which == "memcached" {
        let mut args: Vec<String> = ["-l", &host, "-p", &port, "-U", "0", "-t", "2"]
            .iter()
            .chain(&["-c", "4096", "-m", &mib])
            .map(|s| s.to_string())
            .collect();
        // As root memcached wants a user to drop to (on other hosts it
        // must be started as another user).
        if at.hosts.is_none() && crate::is_root() {
            args.extend(["-u".into(), "root".into()]);
        }
        at.server_command(0, Path::new("memcached"), &args)
    } else {
        let args: Vec<String> = ["--port", &port, "--bind", &host, "--save", ""]
            .iter()
            .chain(&["--appendonly", "no", "--maxmemory", &max_memory.to_string()])
            .map(|s| s.to_string())
            .collect();
        at.server_command(0, Path::new("redis-server"), &args)
    };
    // The benchmark nodes wait for it to listen.
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {which} (is it installed?): {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_quote_survives_a_posix_shell() {
        for s in ["plain-1,2", "", "a b", "it's", "x=\"y\" $HOME `id` \\"] {
            let out = Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", shell_quote(s)))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8(out.stdout).unwrap(), s);
        }
        assert_eq!(shell_quote("--records"), "--records");
    }
}
