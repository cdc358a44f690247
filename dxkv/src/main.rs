//! The `dxkv` command: run a storage node, run YCSB against a cluster, or
//! start a local cluster of processes and run YCSB on it in one go.

use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
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

#[derive(clap::Args, Clone)]
struct YcsbArgs {
    /// Workload preset: a, b, c, d, e, f (YCSB's), paper-a, paper-b (the
    /// Ibdxnet paper's).
    #[arg(long, default_value = "paper-b")]
    workload: String,
    /// YCSB property overrides, e.g. `--set fieldlength=64 --set
    /// requestdistribution=zipfian` (names as YCSB's, lower case).
    #[arg(long = "set", value_name = "NAME=VALUE")]
    set: Vec<String>,
    /// Records to load (YCSB's recordcount).
    #[arg(long)]
    records: Option<u64>,
    /// Operations of the run phase (YCSB's operationcount).
    #[arg(long)]
    operations: Option<u64>,
    /// Client threads.
    #[arg(long, default_value_t = 100)]
    threads: usize,
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
    /// Run a storage node (until stdin closes or the process is killed).
    Storage {
        /// The node's dxnet configuration (TOML or JSON).
        #[arg(long)]
        config: PathBuf,
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
    },
    /// Run YCSB from this node against the storage nodes.
    Ycsb {
        /// This node's dxnet configuration (TOML or JSON).
        #[arg(long)]
        config: PathBuf,
        /// The storage node ids, in partitioning order (the same for every
        /// client).
        #[arg(long, value_delimiter = ',', required = true)]
        storage: Vec<u16>,
        #[command(flatten)]
        ycsb: YcsbArgs,
    },
    /// Start `--storage-nodes` storage processes on 127.0.0.1 and run YCSB
    /// against them from this process, then stop them; with `--bindings`
    /// also against a local memcached (2 threads) and Redis, in interleaved
    /// rounds, each on a fresh server.
    Local {
        #[arg(long, default_value_t = 1)]
        storage_nodes: u16,
        /// Stores to run: dxkv, memcached, redis.
        #[arg(long, value_delimiter = ',', default_value = "dxkv")]
        bindings: Vec<String>,
        /// Rounds (each runs every binding, in a rotated order).
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// First TCP port of the node map (node i listens on port + i).
        #[arg(long, default_value_t = 17_300)]
        port: u16,
        /// Memory limit of each storage node, in bytes.
        #[arg(long, default_value_t = StoreConfig::default().max_memory)]
        max_memory: u64,
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
        } => {
            let cfg = Config::from_file(&config).map_err(|e| e.to_string())?;
            let node = Arc::new(Node::start(cfg).map_err(|e| e.to_string())?);
            let _server = Server::start(
                &node,
                StoreConfig {
                    max_memory,
                    ..Default::default()
                },
            )
            .map_err(|e| e.to_string())?;
            let _frontend = match memcached_port {
                Some(port) => {
                    let storage = if storage.is_empty() {
                        vec![node.id()]
                    } else {
                        storage.into_iter().map(NodeId).collect()
                    };
                    let client = Client::new(node.clone(), storage).map_err(|e| e.to_string())?;
                    let addr = format!("{memcached_host}:{port}");
                    let f = dxkv::memcached::Frontend::start(
                        client,
                        &addr,
                        dxkv::memcached::FrontendConfig {
                            max_connections: memcached_connections,
                            ..Default::default()
                        },
                    )
                    .map_err(|e| format!("memcached front end on {addr}: {e}"))?;
                    Some(f)
                }
                None => None,
            };
            println!("READY {}", node.id());
            // Serve until stdin closes (a parent's way to stop it) or a
            // signal ends the process.
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            drop(_frontend);
            if let Some(node) = Arc::into_inner(node) {
                node.shutdown();
            }
            Ok(())
        }
        Cmd::Ycsb {
            config,
            storage,
            ycsb,
        } => {
            workload(&ycsb)?; // refuse bad arguments before starting the node
            let cfg = Config::from_file(&config).map_err(|e| e.to_string())?;
            let node = Arc::new(Node::start(cfg).map_err(|e| e.to_string())?);
            let client = Client::new(node, storage.into_iter().map(NodeId).collect())
                .map_err(|e| e.to_string())?;
            run_ycsb(&client, &ycsb)
        }
        Cmd::Local {
            storage_nodes,
            bindings,
            rounds,
            port,
            max_memory,
            ycsb,
        } => local(storage_nodes, &bindings, rounds, port, max_memory, &ycsb),
    }
}

fn workload(a: &YcsbArgs) -> Result<Workload, String> {
    let mut w: Workload = a.workload.parse()?;
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

fn run_ycsb(client: &Client, a: &YcsbArgs) -> Result<(), String> {
    let reports = run_phases(&DxkvBinding::new(client.clone()), a)?;
    write_reports(a, &reports)
}

fn write_reports(a: &YcsbArgs, reports: &[ycsb::Report]) -> Result<(), String> {
    if let Some(path) = &a.csv {
        let mut csv = format!("{}\n", ycsb::driver::CSV_HEADER);
        for r in reports {
            csv += &r.csv_rows();
        }
        std::fs::write(path, csv).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if let Some(path) = &a.json {
        let json = serde_json::json!({ "workload": workload(a)?, "reports": reports });
        std::fs::write(
            path,
            serde_json::to_string_pretty(&json).expect("serializable"),
        )
        .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// Runs the phases of `a` on `binding`, printing each report.
fn run_phases(binding: &dyn Binding, a: &YcsbArgs) -> Result<Vec<ycsb::Report>, String> {
    let w = workload(a)?;
    let mut reports = Vec::new();
    let mut chooser = None;
    for p in &a.phases {
        let phase = match p.as_str() {
            "load" => Phase::Load,
            "run" => Phase::Run,
            other => return Err(format!("unknown phase {other:?} (load, run)")),
        };
        if phase == Phase::Run && chooser.is_none() {
            chooser = Some(Chooser::new(&w));
        }
        let tty = std::io::stderr().is_terminal();
        let progress = |done: u64, total: u64| {
            if tty {
                eprint!("\r{phase:?}: {done}/{total}   ");
            }
        };
        let r = ycsb::run(binding, &w, phase, a.threads, chooser.as_ref(), &progress)?;
        if tty {
            eprint!("\r{:40}\r", "");
        }
        print!("{}", r.table());
        reports.push(r);
    }
    Ok(reports)
}

/// Storage processes that are stopped (stdin closed, then killed) on drop.
struct Children(Vec<Child>);

impl Drop for Children {
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

fn local(
    storage_nodes: u16,
    bindings: &[String],
    rounds: usize,
    port: u16,
    max_memory: u64,
    a: &YcsbArgs,
) -> Result<(), String> {
    if storage_nodes == 0 {
        return Err("--storage-nodes must be at least 1".into());
    }
    workload(a)?; // refuse bad arguments before starting processes
    for b in bindings {
        if !["dxkv", "memcached", "redis"].contains(&b.as_str()) {
            return Err(format!("unknown binding {b:?} (dxkv, memcached, redis)"));
        }
    }
    let mut all = Vec::new();
    for round in 0..rounds.max(1) {
        for i in 0..bindings.len() {
            let b = &bindings[(i + round) % bindings.len()];
            println!("--- round {} of {}: {b}", round + 1, rounds.max(1));
            let reports = match b.as_str() {
                "dxkv" => local_dxkv(storage_nodes, port, max_memory, a)?,
                other => local_baseline(other, port, max_memory, a)?,
            };
            all.extend(reports.into_iter().map(|r| (round, r)));
        }
    }
    if rounds > 1 || bindings.len() > 1 {
        print!("{}", summary(bindings, &all));
    }
    let reports: Vec<ycsb::Report> = all.into_iter().map(|(_, r)| r).collect();
    write_reports(a, &reports)
}

/// Run-phase throughput per binding (median over rounds) and its ratio to
/// the first binding's in the same round (median of the rounds' ratios).
fn summary(bindings: &[String], reports: &[(usize, ycsb::Report)]) -> String {
    let runs = |b: &str| -> Vec<(usize, f64)> {
        reports
            .iter()
            .filter(|(_, r)| r.binding == *b && r.phase == Phase::Run)
            .map(|(round, r)| (*round, r.ops_per_sec))
            .collect()
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(|x, y| x.total_cmp(y));
        (!v.is_empty()).then(|| v[v.len() / 2])
    };
    let base = runs(&bindings[0]);
    let mut s =
        String::from("\nrun phase (median over rounds; ratios per round, then their median):\n");
    for b in bindings {
        let mine = runs(b);
        let Some(m) = median(mine.iter().map(|x| x.1).collect()) else {
            continue;
        };
        let ratios: Vec<f64> = mine
            .iter()
            .filter_map(|(round, v)| base.iter().find(|x| x.0 == *round).map(|x| v / x.1))
            .collect();
        let list: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
        s += &format!(
            "  {b:<10} {m:>10.0} ops/s   {:.2}x {} (rounds: {})\n",
            median(ratios.clone()).unwrap_or(f64::NAN),
            bindings[0],
            list.join(", ")
        );
    }
    s
}

fn local_dxkv(
    storage_nodes: u16,
    port: u16,
    max_memory: u64,
    a: &YcsbArgs,
) -> Result<Vec<ycsb::Report>, String> {
    let n = storage_nodes + 1;
    let dir = std::env::temp_dir().join(format!("dxkv-local-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // A fresh secret: only this run's processes can join the cluster.
    let secret = format!(
        "{:016x}{:016x}",
        rand::random::<u64>(),
        rand::random::<u64>()
    );
    let config = |id: u16| {
        let mut c = Config::tcp_localhost(id, n, port);
        c.cluster_secret = Some(secret.clone());
        c
    };
    let mut children = Children(Vec::new());
    for id in 0..storage_nodes {
        let path = dir.join(format!("node{id}.json"));
        std::fs::write(
            &path,
            serde_json::to_string(&config(id)).expect("serializable"),
        )
        .map_err(|e| e.to_string())?;
        let mut child = Command::new(&exe)
            .args(["storage", "--config"])
            .arg(&path)
            .args(["--max-memory", &max_memory.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting a storage process: {e}"))?;
        let mut line = String::new();
        let out = child.stdout.take().expect("piped");
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line)
            .map_err(|e| e.to_string())?;
        children.0.push(child);
        if !line.starts_with("READY") {
            return Err(format!(
                "storage node {id} did not start (see its errors above)"
            ));
        }
    }
    let node = Arc::new(Node::start(config(storage_nodes)).map_err(|e| e.to_string())?);
    let client = Client::new(node.clone(), (0..storage_nodes).map(NodeId).collect())
        .map_err(|e| e.to_string())?;
    let r = run_phases(&DxkvBinding::new(client), a);
    drop(children);
    if let Some(node) = Arc::into_inner(node) {
        node.shutdown();
    }
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// Runs a fresh memcached (2 threads, as the paper's comparison) or Redis
/// on 127.0.0.1:`port` and the phases against it.
fn local_baseline(
    which: &str,
    port: u16,
    max_memory: u64,
    a: &YcsbArgs,
) -> Result<Vec<ycsb::Report>, String> {
    let address = format!("127.0.0.1:{port}");
    let mib = (max_memory >> 20).max(64).to_string();
    let p = port.to_string();
    let mut cmd = match which {
        "memcached" => {
            let mut c = Command::new("memcached");
            c.args([
                "-l",
                "127.0.0.1",
                "-p",
                &p,
                "-U",
                "0",
                "-t",
                "2",
                "-c",
                "4096",
            ])
            .args(["-m", &mib]);
            // As root memcached wants a user to drop to.
            if is_root() {
                c.args(["-u", "root"]);
            }
            c
        }
        _ => {
            let mut c = Command::new("redis-server");
            c.args([
                "--port",
                &p,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--maxmemory", &max_memory.to_string()]);
            c
        }
    };
    let child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {which} (is it installed?): {e}"))?;
    let _children = Children(vec![child]);
    let t = std::time::Instant::now();
    while std::net::TcpStream::connect(&address).is_err() {
        if t.elapsed() > Duration::from_secs(10) {
            return Err(format!("{which} did not listen on {address}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    match which {
        "memcached" => run_phases(&ycsb::baselines::MemcachedBinding::new(&address), a),
        _ => run_phases(&ycsb::baselines::RedisBinding::new(&address), a),
    }
}

fn is_root() -> bool {
    std::env::var("USER").map(|u| u == "root").unwrap_or(false)
        || std::fs::read_to_string("/proc/self/status")
            .map(|s| {
                s.lines()
                    .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
            })
            .unwrap_or(false)
}
