//! The `dxkv` command: run a storage node, run YCSB against a cluster (or
//! against memcached or Redis), or start a whole cluster of processes (on
//! 127.0.0.1, in network namespaces or on the hosts of a node file) and run
//! YCSB on it in one go.

mod cluster;
mod stop;
mod summary;

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use dxkv::ycsb::workload::Share;
use dxkv::ycsb::{self, Binding, Chooser, DxkvBinding, Phase, Workload};
use dxkv::{Client, Server, StoreConfig};
use dxnet::{Config, Node, NodeId};

#[derive(Parser)]
#[command(
    name = "dxkv",
    about = "A DXRAM-style in-memory key-value store on dxnet, with YCSB"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// The workload and how to drive it.
#[derive(clap::Args, Clone)]
pub struct YcsbArgs {
    /// Workload presets: a, b, c, d, e, f (YCSB's), paper-a, paper-b (the
    /// Ibdxnet paper's); `local` runs each on a fresh cluster.
    #[arg(long, value_delimiter = ',', default_value = "paper-b")]
    workload: Vec<String>,
    /// YCSB property overrides, e.g. `--set fieldlength=64 --set
    /// requestdistribution=zipfian` (names as YCSB's, lower case).
    #[arg(long = "set", value_name = "NAME=VALUE")]
    set: Vec<String>,
    /// Records to load (YCSB's recordcount), over all benchmark nodes.
    #[arg(long)]
    records: Option<u64>,
    /// Operations of the run phase (YCSB's operationcount), per benchmark
    /// node.
    #[arg(long)]
    operations: Option<u64>,
    /// Client threads per benchmark node; `local` runs each of a list,
    /// e.g. `1,16,100`.
    #[arg(long, value_delimiter = ',', default_value = "100")]
    threads: Vec<usize>,
    /// Phases to run.
    #[arg(long, value_delimiter = ',', default_value = "load,run")]
    phases: Vec<String>,
    /// Also write the reports as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also write the reports as CSV here (one row per phase and
    /// operation).
    #[arg(long)]
    csv: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a storage node until SIGTERM or SIGINT, then shut down in
    /// order (a second signal stops it at once).
    Storage {
        /// The node's dxnet configuration (TOML or JSON; `-`: one line of
        /// JSON on stdin). Default: from the environment and the launcher
        /// (`DXNET_CONFIG`, `DXNET_*`, Slurm's, MPI's or a StatefulSet's
        /// rank; see `dxnet::launch`).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Memory limit of the records, in bytes.
        #[arg(long, default_value_t = StoreConfig::default().max_memory)]
        max_memory: u64,
        /// Also serve memcached's text protocol for the whole cluster on
        /// this TCP port (of 127.0.0.1 unless --memcached-host).
        #[arg(long)]
        memcached_port: Option<u16>,
        /// Address the memcached front end listens on.
        #[arg(long, default_value = "127.0.0.1")]
        memcached_host: String,
        /// Most memcached connections at once.
        #[arg(long, default_value_t = 1024)]
        memcached_connections: usize,
        /// The cluster's storage node ids, in partitioning order (for the
        /// memcached front end; default: this node alone).
        #[arg(long, value_delimiter = ',')]
        storage: Vec<u16>,
        /// Also shut down when standard input ends (for a parent process
        /// or a remote shell that holds the node's stdin open).
        #[arg(long)]
        stop_on_stdin_eof: bool,
        /// Longest orderly shutdown, in seconds: past it the process exits
        /// at once with code 1.
        #[arg(long, default_value_t = 10)]
        shutdown_timeout_s: u64,
    },
    /// Run YCSB from this node: against the dxkv storage nodes of the
    /// node map in `--config`, or against a memcached or Redis server.
    Ycsb {
        /// Store to drive: dxkv, memcached, redis.
        #[arg(long, default_value = "dxkv")]
        binding: String,
        /// This node's dxnet configuration (TOML or JSON; `-`: one line of
        /// JSON on stdin; dxkv only).
        #[arg(long)]
        config: Option<PathBuf>,
        /// The storage node ids, in partitioning order (the same for every
        /// client; dxkv only).
        #[arg(long, value_delimiter = ',')]
        storage: Vec<u16>,
        /// host:port of the memcached or Redis server.
        #[arg(long)]
        server: Option<String>,
        /// This benchmark node's index among `--clients` of them: it loads
        /// its slice of the records and inserts keys of its own.
        #[arg(long, default_value_t = 0)]
        client_index: u64,
        /// The number of benchmark nodes running this workload together.
        #[arg(long, default_value_t = 1)]
        clients: u64,
        /// Driven by `dxkv local`: before each phase print `READY <phase>`
        /// and wait for a line on stdin; print progress and the report as
        /// `PROGRESS <n>` and `REPORT <json>` lines.
        #[arg(long, hide = true)]
        coordinated: bool,
        #[command(flatten)]
        ycsb: YcsbArgs,
    },
    /// Start a cluster of processes (storage nodes and benchmark nodes, on
    /// 127.0.0.1, each in its own network namespace, or on the hosts of a
    /// node file), run YCSB on it,
    /// stop it; with `--bindings` also against a memcached (2 threads) and
    /// a Redis server, in interleaved rounds, each on a fresh server.
    Local {
        /// Storage nodes.
        #[arg(long, default_value_t = 1)]
        storage_nodes: u16,
        /// Benchmark nodes (processes of `--threads` client threads each).
        #[arg(long, default_value_t = 1)]
        benchmark_nodes: u16,
        /// Cluster sizes to run in turn instead of --storage-nodes and
        /// --benchmark-nodes, e.g. `2,4,8`: half storage, half benchmark
        /// nodes, as the Ibdxnet paper's scaling figure.
        #[arg(long, value_delimiter = ',')]
        nodes: Vec<u16>,
        /// Run every node in its own network namespace, linked by veth
        /// pairs through a bridge (needs root and iproute2).
        #[arg(long)]
        netns: bool,
        /// Run node i on the host of id i in this node file (lines `ID
        /// HOST` or `ID HOST:PORT`, ids 0..N; port default --port),
        /// started through --launcher. HOST is both what the launcher
        /// connects to and the node's dxnet address, so an address (or a
        /// name that resolves), not an ssh alias.
        #[arg(long, value_name = "NODE_FILE")]
        hosts: Option<PathBuf>,
        /// With --hosts: the command that runs a command line on a host,
        /// given the host and the line (as ssh does).
        #[arg(long, default_value = "ssh -o BatchMode=yes")]
        launcher: String,
        /// With --hosts: the path of `dxkv` on the hosts (default: this
        /// executable's path).
        #[arg(long)]
        remote_exe: Option<PathBuf>,
        /// Stores to run: dxkv (over TCP), dxkv-ib (over InfiniBand/RoCE
        /// verbs: the device in $RDMA_DEV, its GID index in
        /// $RDMA_GID_INDEX), memcached, redis.
        #[arg(long, value_delimiter = ',', default_value = "dxkv")]
        bindings: Vec<String>,
        /// Rounds (each runs every binding, in a rotated order).
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// First TCP port of the node map (on 127.0.0.1 node i listens on
        /// port + i; in namespaces every node on port).
        #[arg(long, default_value_t = 17_300)]
        port: u16,
        /// Memory limit of each storage node, in bytes.
        #[arg(long, default_value_t = StoreConfig::default().max_memory)]
        max_memory: u64,
        /// Draw the run phase's throughput against the cluster size (and
        /// the p99 latency) as SVG and PNG into this directory.
        #[arg(long)]
        plot: Option<PathBuf>,
        #[command(flatten)]
        ycsb: YcsbArgs,
    },
}

fn main() {
    tracing_init();
    if let Err(e) = real_main() {
        eprintln!("dxkv: {e}");
        std::process::exit(1);
    }
}

fn tracing_init() {
    // Errors of the node itself go to stderr; RUST_LOG as usual.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
}

fn real_main() -> Result<(), String> {
    match Cli::parse().cmd {
        Cmd::Storage {
            config,
            max_memory,
            memcached_port,
            memcached_host,
            memcached_connections,
            storage,
            stop_on_stdin_eof,
            shutdown_timeout_s,
        } => storage_node(StorageArgs {
            config,
            max_memory,
            memcached_port,
            memcached_host,
            memcached_connections,
            storage,
            stop_on_stdin_eof,
            shutdown_timeout: std::time::Duration::from_secs(shutdown_timeout_s),
        }),
        Cmd::Ycsb {
            binding,
            config,
            storage,
            server,
            client_index,
            clients,
            coordinated,
            ycsb,
        } => {
            let share = Share::new(client_index, clients)?;
            let [name] = &ycsb.workload[..] else {
                return Err("ycsb runs one workload (local runs several)".into());
            };
            let [threads] = ycsb.threads[..] else {
                return Err("ycsb runs one thread count (local runs several)".into());
            };
            // Refuse bad arguments before starting the node.
            let w = workload(name, &ycsb)?;
            let binding: Box<dyn Binding> = match binding.as_str() {
                "dxkv" => {
                    let config = config.ok_or("--config is needed with the dxkv binding")?;
                    if storage.is_empty() {
                        return Err("--storage is needed with the dxkv binding".into());
                    }
                    let cfg = load_config(&config)?;
                    let node = Arc::new(Node::start(cfg).map_err(|e| e.to_string())?);
                    let client = Client::new(node, storage.into_iter().map(NodeId).collect())
                        .map_err(|e| e.to_string())?;
                    Box::new(DxkvBinding::new(client))
                }
                "memcached" | "redis" => {
                    let server = server.ok_or("--server host:port is needed")?;
                    wait_for_server(&server)?;
                    if binding == "memcached" {
                        Box::new(ycsb::baselines::MemcachedBinding::new(&server))
                    } else {
                        Box::new(ycsb::baselines::RedisBinding::new(&server))
                    }
                }
                other => {
                    return Err(format!(
                        "unknown binding {other:?} (dxkv, memcached, redis)"
                    ))
                }
            };
            let chooser = Chooser::with_share(&w, share);
            if coordinated {
                return coordinated_phases(&*binding, &chooser, threads, &ycsb);
            }
            let reports = run_phases(&*binding, &chooser, threads, &ycsb)?;
            write_reports(&ycsb, &w, &reports)
        }
        Cmd::Local {
            storage_nodes,
            benchmark_nodes,
            nodes,
            netns,
            hosts,
            launcher,
            remote_exe,
            bindings,
            rounds,
            port,
            max_memory,
            plot,
            ycsb,
        } => {
            let layouts = if nodes.is_empty() {
                vec![(storage_nodes, benchmark_nodes)]
            } else {
                let mut v = Vec::new();
                for n in nodes {
                    if n < 2 {
                        return Err(format!("--nodes {n}: at least 2 (half storage)"));
                    }
                    v.push((n / 2, n - n / 2));
                }
                v
            };
            let hosts = match hosts {
                Some(path) => Some(node_file(&path, port)?),
                None => None,
            };
            cluster::local(&cluster::LocalArgs {
                layouts,
                netns,
                hosts,
                launcher: launcher.split_whitespace().map(String::from).collect(),
                remote_exe,
                bindings,
                rounds,
                port,
                max_memory,
                plot,
                ycsb,
            })
        }
    }
}

/// The settings of `dxkv storage`.
struct StorageArgs {
    config: Option<PathBuf>,
    max_memory: u64,
    memcached_port: Option<u16>,
    memcached_host: String,
    memcached_connections: usize,
    storage: Vec<u16>,
    stop_on_stdin_eof: bool,
    shutdown_timeout: std::time::Duration,
}

fn storage_node(a: StorageArgs) -> Result<(), String> {
    let cfg = match &a.config {
        Some(path) => load_config(path)?,
        None => Config::from_env().map_err(|e| e.to_string())?,
    };
    // Before serving: a stop request that comes during start-up waits.
    let stop = stop::StopRequests::install(a.stop_on_stdin_eof)?;
    let node = Arc::new(Node::start(cfg).map_err(|e| e.to_string())?);
    let server = Server::start(
        &node,
        StoreConfig {
            max_memory: a.max_memory,
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let frontend = match a.memcached_port {
        Some(port) => {
            let storage = if a.storage.is_empty() {
                vec![node.id()]
            } else {
                a.storage.into_iter().map(NodeId).collect()
            };
            let client = Client::new(node.clone(), storage).map_err(|e| e.to_string())?;
            let addr = format!("{}:{port}", a.memcached_host);
            let f = dxkv::memcached::Frontend::start(
                client,
                &addr,
                dxkv::memcached::FrontendConfig {
                    max_connections: a.memcached_connections,
                    shutdown_timeout: a.shutdown_timeout,
                    ..Default::default()
                },
            )
            .map_err(|e| format!("memcached front end on {addr}: {e}"))?;
            Some(f)
        }
        None => None,
    };
    println!("READY {}", node.id());
    let _ = std::io::stdout().flush();
    let why = stop.wait();
    eprintln!("dxkv: {why}: shutting down");
    stop.bound_shutdown(a.shutdown_timeout);
    // In order: memcached clients get the answers to what they sent, then
    // the end of their stream; the node then writes out what it accepted,
    // fails its own requests still pending and closes its connections
    // with a notice to each peer.
    if let Some(f) = frontend {
        let busy = f.shutdown();
        if busy > 0 {
            eprintln!("dxkv: {busy} memcached connections still busy at shutdown");
        }
    }
    drop(server);
    // A connection thread that has just ended may still hold the front
    // end's client for a moment; one that hangs is ended by the bound.
    let mut node = node;
    loop {
        match Arc::try_unwrap(node) {
            Ok(n) => break n.shutdown(),
            Err(n) => node = n,
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    eprintln!("dxkv: stopped");
    Ok(())
}

/// A dxnet configuration from a file, or from the first line of stdin for
/// `-` (how `dxkv local` hands each process its own).
fn load_config(path: &std::path::Path) -> Result<Config, String> {
    if path.as_os_str() == "-" {
        let mut line = String::new();
        std::io::stdin()
            .read_line(&mut line)
            .map_err(|e| format!("reading the configuration from stdin: {e}"))?;
        return Config::from_json(&line).map_err(|e| format!("the configuration on stdin: {e}"));
    }
    Config::from_file(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The hosts of a node file by id, each with its port (`HOST:PORT`, else
/// `port`).
fn node_file(path: &std::path::Path, port: u16) -> Result<Vec<(String, u16)>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let hosts = dxnet_bench::coordinator::parse_node_file(&text)
        .map_err(|e| format!("{}: {e:#}", path.display()))?;
    let bad = |h: &str| format!("{}: bad port in {h:?}", path.display());
    hosts
        .into_iter()
        .map(|h| {
            if h.starts_with('-') {
                // It would reach the launcher as an option.
                return Err(format!("{}: bad host {h:?}", path.display()));
            }
            if let Some(rest) = h.strip_prefix('[') {
                // [IPv6] or [IPv6]:PORT
                return match rest.split_once(']') {
                    Some((host, "")) => Ok((host.to_string(), port)),
                    Some((host, p)) => match p.strip_prefix(':').map(str::parse) {
                        Some(Ok(p)) => Ok((host.to_string(), p)),
                        _ => Err(bad(&h)),
                    },
                    None => Err(bad(&h)),
                };
            }
            match h.rsplit_once(':') {
                // One colon: HOST:PORT (a bare IPv6 address has more).
                Some((host, p)) if !host.contains(':') => p
                    .parse()
                    .map(|p| (host.to_string(), p))
                    .map_err(|_| bad(&h)),
                _ => Ok((h.clone(), port)),
            }
        })
        .collect()
}

/// The workload preset `name` with the overrides of `a`.
pub fn workload(name: &str, a: &YcsbArgs) -> Result<Workload, String> {
    let mut w: Workload = name.parse()?;
    if !a.set.is_empty() {
        // Overrides go through serde: the same names and checks as a file.
        let mut v = serde_json::to_value(&w).map_err(|e| e.to_string())?;
        for s in &a.set {
            let (k, val) = s
                .split_once('=')
                .ok_or_else(|| format!("--set {s}: expected NAME=VALUE"))?;
            let parsed = serde_json::from_str(val).unwrap_or(serde_json::Value::String(val.into()));
            v[k] = parsed;
        }
        w = serde_json::from_value(v).map_err(|e| format!("--set: {e}"))?;
    }
    if let Some(r) = a.records {
        w.recordcount = r;
    }
    if let Some(o) = a.operations {
        w.operationcount = o;
    }
    w.validate()?;
    Ok(w)
}

/// The phases named in `a`, checked.
pub fn phases(a: &YcsbArgs) -> Result<Vec<Phase>, String> {
    a.phases.iter().map(|p| p.parse()).collect()
}

fn write_reports(a: &YcsbArgs, w: &Workload, reports: &[ycsb::Report]) -> Result<(), String> {
    if let Some(path) = &a.csv {
        let mut csv = format!("{}\n", ycsb::driver::CSV_HEADER);
        for r in reports {
            csv += &r.csv_rows();
        }
        std::fs::write(path, csv).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if let Some(path) = &a.json {
        let reports: Vec<ycsb::Report> = reports.iter().map(without_histograms).collect();
        let json = serde_json::json!({ "workload": w, "reports": reports });
        std::fs::write(
            path,
            serde_json::to_string_pretty(&json).expect("serializable"),
        )
        .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// A report for people: the raw latency histograms left out.
pub fn without_histograms(r: &ycsb::Report) -> ycsb::Report {
    ycsb::Report {
        histograms: Default::default(),
        ..r.clone()
    }
}

/// Runs the phases of `a` on `binding`, printing each report.
fn run_phases(
    binding: &dyn Binding,
    chooser: &Chooser,
    threads: usize,
    a: &YcsbArgs,
) -> Result<Vec<ycsb::Report>, String> {
    let mut reports = Vec::new();
    for phase in phases(a)? {
        let tty = std::io::stderr().is_terminal();
        let progress = |done: u64, total: u64| {
            if tty {
                eprint!("\r{phase:?}: {done}/{total}   ");
            }
        };
        let r = ycsb::run(binding, phase, threads, chooser, &progress)?;
        if tty {
            eprint!("\r{:40}\r", "");
        }
        print!("{}", r.table());
        reports.push(r);
    }
    Ok(reports)
}

/// The phases under `dxkv local`'s control (see `Cmd::Ycsb::coordinated`):
/// every benchmark node starts a phase when all are ready for it.
fn coordinated_phases(
    binding: &dyn Binding,
    chooser: &Chooser,
    threads: usize,
    a: &YcsbArgs,
) -> Result<(), String> {
    let mut stdin = std::io::stdin().lock();
    let out = std::sync::Mutex::new(std::io::stdout());
    let say = |line: String| {
        let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
        if writeln!(o, "{line}").and_then(|_| o.flush()).is_err() {
            // Nobody coordinates this node any more: stop rather than run
            // phases nobody waits for.
            eprintln!("dxkv ycsb: the coordinator's end of stdout is closed; stopping");
            std::process::exit(1);
        }
    };
    for phase in phases(a)? {
        say(format!("READY {phase}"));
        let mut go = String::new();
        if stdin.read_line(&mut go).map_err(|e| e.to_string())? == 0 {
            return Err("stopped before the phase began".into());
        }
        let progress = |done: u64, _total: u64| say(format!("PROGRESS {done}"));
        let r = ycsb::run(binding, phase, threads, chooser, &progress)?;
        say(format!(
            "REPORT {}",
            serde_json::to_string(&r).expect("serializable")
        ));
    }
    Ok(())
}

/// Waits up to 10 s for `server` to accept connections (a server started
/// beside this process may still be coming up).
fn wait_for_server(server: &str) -> Result<(), String> {
    let t = std::time::Instant::now();
    loop {
        match std::net::TcpStream::connect(server) {
            Ok(_) => return Ok(()),
            Err(e) if t.elapsed() > std::time::Duration::from_secs(10) => {
                return Err(format!("nothing listens on {server}: {e}"))
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
}

/// True if this process runs as root (memcached then needs `-u root`).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_files_give_hosts_with_ports() {
        let path = std::env::temp_dir().join(format!("dxkv-nodefile-{}", std::process::id()));
        std::fs::write(
            &path,
            "1 b.example:9000\n0 a.example # head\n2 [fe80::1]:7\n3 ::1\n",
        )
        .unwrap();
        let hosts = node_file(&path, 17300).unwrap();
        assert_eq!(
            hosts,
            [
                ("a.example".to_string(), 17300),
                ("b.example".to_string(), 9000),
                ("fe80::1".to_string(), 7),
                ("::1".to_string(), 17300),
            ]
        );
        std::fs::write(&path, "0 a:x\n1 b\n").unwrap();
        assert!(node_file(&path, 1).unwrap_err().contains("bad port"));
        std::fs::write(&path, "0 a\n2 b\n").unwrap();
        assert!(node_file(&path, 1).is_err());
        std::fs::write(&path, "0 a\n1 -oProxyCommand=x\n").unwrap();
        assert!(node_file(&path, 1).unwrap_err().contains("bad host"));
        std::fs::remove_file(&path).unwrap();
    }
}
