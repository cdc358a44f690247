//! The `dxkv` command: run a storage node, run YCSB against a cluster, or
//! start a local cluster of processes and run YCSB on it in one go.

use std::io::Read;
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
    /// against them from this process, then stop them.
    Local {
        #[arg(long, default_value_t = 1)]
        storage_nodes: u16,
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
        Cmd::Storage { config, max_memory } => {
            let cfg = Config::from_file(&config).map_err(|e| e.to_string())?;
            let node = Node::start(cfg).map_err(|e| e.to_string())?;
            let _server = Server::start(
                &node,
                StoreConfig {
                    max_memory,
                    ..Default::default()
                },
            )
            .map_err(|e| e.to_string())?;
            println!("READY node {}", node.id());
            // Serve until stdin closes (a parent's way to stop it) or a
            // signal ends the process.
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            node.shutdown();
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
            port,
            max_memory,
            ycsb,
        } => local(storage_nodes, port, max_memory, &ycsb),
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
    let w = workload(a)?;
    let binding = DxkvBinding::new(client.clone());
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
        let progress = |done: u64, total: u64| eprint!("\r{phase:?}: {done}/{total}   ");
        let r = ycsb::run(
            &binding as &dyn Binding,
            &w,
            phase,
            a.threads,
            chooser.as_ref(),
            &progress,
        )?;
        eprint!("\r{:40}\r", "");
        print!("{}", r.table());
        reports.push(r);
    }
    if let Some(path) = &a.json {
        let json = serde_json::json!({ "workload": w, "reports": reports });
        std::fs::write(
            path,
            serde_json::to_string_pretty(&json).expect("serializable"),
        )
        .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
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

fn local(storage_nodes: u16, port: u16, max_memory: u64, a: &YcsbArgs) -> Result<(), String> {
    if storage_nodes == 0 {
        return Err("--storage-nodes must be at least 1".into());
    }
    workload(a)?; // refuse bad arguments before starting processes
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
        let cfg = config(id);
        std::fs::write(&path, serde_json::to_string(&cfg).expect("serializable"))
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
    let client =
        Client::new(node, (0..storage_nodes).map(NodeId).collect()).map_err(|e| e.to_string())?;
    let r = run_ycsb(&client, a);
    drop(children);
    let _ = std::fs::remove_dir_all(&dir);
    r
}
