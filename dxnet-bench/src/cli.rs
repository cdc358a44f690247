//! Command line: every configuration option is also a flag; flags override
//! the file (or the built-in default suite).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use crate::binding::BindingKind;
use crate::config::{parse_size, BenchConfig, BenchEntry, Mode, Operation, Sizes};
use crate::coordinator::{self, Coordinator, Placement};
use crate::netns::{Guard, Layout};
use crate::output;

/// Observatory/OSU-style benchmarks of dxnet against raw baselines.
///
/// Without arguments it runs a short default suite between two local
/// processes over TCP loopback (raw-tcp, raw-tcp-batched, dxnet-tcp and
/// dxnet-tcp-typed; 64 B with 1 and 16 sender threads) and prints a
/// summary table; results go to `bench-results/` (CSV per operation, results.json, SVG/PNG plots).
#[derive(Debug, Parser)]
#[command(name = "dxnet-bench", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Option<Sub>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Sub {
    /// A node process, started by the coordinator (internal).
    #[command(hide = true)]
    Node {
        /// Control channel address (`unix:PATH` or `tcp:HOST:PORT`).
        #[arg(long)]
        coord: String,
        /// Logical node ids this process hosts.
        #[arg(long, value_delimiter = ',', required = true)]
        ids: Vec<u16>,
        /// CPUs this process runs on (`--bind-nodes`); default: any.
        #[arg(long, value_delimiter = ',')]
        cpus: Vec<usize>,
    },
    /// Create or remove the network namespaces by hand (`--netns` does both
    /// around a run by itself).
    Netns {
        #[command(subcommand)]
        action: NetnsAction,
    },
    /// Discovery: time until a starting node is reachable by all others
    /// (2..N nodes), and the rate and longest gap of an existing
    /// connection's stream while nodes join and leave, against a quiet
    /// phase of the same run.
    Membership {
        /// Node counts, e.g. `2,8,32`.
        #[arg(long, value_delimiter = ',', default_value = "2,8,32")]
        nodes: Vec<usize>,
        /// Discovery interval in milliseconds.
        #[arg(long, default_value_t = 100)]
        interval_ms: u64,
        /// Rounds per node count.
        #[arg(long, default_value_t = 3)]
        rounds: u32,
        /// Joins and leaves in the churn phase.
        #[arg(long, default_value_t = 5)]
        churn: u32,
        /// One network namespace per node (root).
        #[arg(long)]
        netns: bool,
        /// Namespace name prefix for --netns.
        #[arg(long, default_value = "dxm")]
        prefix: String,
        /// Port of every node (--netns) or the first port (local).
        #[arg(long, default_value_t = 23000)]
        base_port: u16,
        /// Nodes know only node 0's address (a seed), not the node map.
        #[arg(long)]
        seed_only: bool,
    },
    /// A node of `membership` (internal).
    #[command(hide = true)]
    MembershipNode {
        #[arg(long)]
        id: u16,
        #[arg(long, value_delimiter = ',', required = true)]
        addresses: Vec<String>,
        #[arg(long)]
        interval_ms: u64,
        #[arg(long)]
        stream_to: Option<u16>,
        #[arg(long)]
        seed_only: bool,
    },
    /// dxshuffle: an all-to-all shuffle among processes × threads, the
    /// one-sided mode against the messages mode on the same transport
    /// (alternating rounds; records/s, MB/s, CPU per record, time blocked).
    Shuffle {
        #[command(flatten)]
        args: ShuffleCli,
    },
    /// A process of `shuffle` (internal).
    #[command(hide = true)]
    ShuffleNode {
        /// This process's index.
        #[arg(long)]
        proc: usize,
        #[command(flatten)]
        args: ShuffleCli,
    },
    /// The Ibdxnet report's figures 11–19 re-run on this hardware: its
    /// configuration (`--preset ibdxnet-paper`, counts divided by `--scale`,
    /// default 1000), dxnet beside raw sockets and Open MPI (`tcp`) or raw
    /// verbs and perftest (`ib`); every run flag applies (`--netns`,
    /// `--node-file`, `--sizes`, ...). Writes `OUT/figNN/` per figure and the
    /// headline ratios to `OUT/figures.txt`.
    PaperFigures {
        /// `tcp` or `ib`.
        #[arg(long, default_value = "tcp")]
        transport: String,
        /// Figures to run, e.g. `11,13` (default: all; 17 includes 18).
        #[arg(long, value_delimiter = ',')]
        figures: Vec<u32>,
        /// The report's full sweep, every power of two from 1 B to 1 MiB
        /// (default: 1 B, 64 B, 1 KiB, 16 KiB, 64 KiB, 1 MiB).
        #[arg(long)]
        all_sizes: bool,
        #[command(flatten)]
        run: Box<RunArgs>,
    },
    /// Redraw plots, CSV and the summary table from a results.json; several
    /// files (e.g. rounds of the same suite) are merged into one
    /// results.json in the output directory, repetitions renumbered.
    Plot {
        /// The results file(s).
        #[arg(required = true)]
        results: Vec<PathBuf>,
        /// Output directory (default: the first results file's directory).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Skip the plots.
        #[arg(long)]
        no_plots: bool,
    },
}

/// The shape of a `shuffle` run.
#[derive(Debug, clap::Args)]
struct ShuffleCli {
    /// Processes (one dxnet node each).
    #[arg(long, default_value_t = 4)]
    procs: usize,
    /// Workers (threads) per process.
    #[arg(long, default_value_t = 8)]
    threads: usize,
    /// Records each worker pushes.
    #[arg(long, default_value_t = 20_000)]
    records: u64,
    /// Bytes per record.
    #[arg(long, default_value_t = 100)]
    size: usize,
    /// Probability that a record goes to worker 0 (0: uniform).
    #[arg(long, default_value_t = 0.0)]
    skew: f64,
    /// `tcp` (127.0.0.1) or `ib` (the device in RDMA_DEV).
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// Modes, e.g. `one-sided,messages`; `mpi` adds the same exchange with
    /// Open MPI's `MPI_Alltoallv` (needs `mpicc` and `mpirun`: Debian's
    /// `libopenmpi-dev` and `openmpi-bin`).
    #[arg(long, value_delimiter = ',', default_value = "one-sided,messages")]
    mode: Vec<String>,
    /// MPI mode: records per worker per `MPI_Alltoallv` round (0: all in
    /// one). The default was the fastest of 1000–64000 and one round for
    /// 100 B records on a 2-core host.
    #[arg(long, default_value_t = 4000)]
    mpi_chunk: u64,
    /// MPI mode: options for `mpirun`. The default keeps Open MPI on TCP
    /// over loopback, as dxnet's TCP runs (the ob1 layer with the tcp
    /// transport: no shared memory, no UCX).
    #[arg(
        long,
        default_value = "--mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include lo",
        allow_hyphen_values = true
    )]
    mpirun_options: String,
    /// Bytes of each sender's segment at each receiver.
    #[arg(long, default_value_t = 65536)]
    segment: usize,
    /// Pending bytes per destination that make a pusher write or send.
    #[arg(long, default_value_t = 16384)]
    batch: usize,
    /// Rounds (modes alternate within each).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// First port of the node map (127.0.0.1); with --netns the port of
    /// every process.
    #[arg(long, default_value_t = 24600)]
    base_port: u16,
    /// One network namespace per process on a bridge (root; TCP over veth
    /// links instead of loopback, as if on separate hosts; not for the
    /// mpi mode, whose launcher cannot reach ranks in other namespaces).
    #[arg(long)]
    netns: bool,
    /// Namespace name prefix for --netns.
    #[arg(long, default_value = "dxs")]
    netns_prefix: String,
    /// dxnet Config field for every process, `KEY=VALUE` (value as JSON,
    /// else a string), repeatable, e.g. `--dxnet limits.orb_size=4194304`.
    #[arg(long = "dxnet", value_name = "KEY=VALUE")]
    dxnet: Vec<String>,
}

impl ShuffleCli {
    fn to_args(&self) -> Result<crate::shuffle::ShuffleArgs> {
        Ok(crate::shuffle::ShuffleArgs {
            procs: self.procs,
            threads: self.threads,
            records: self.records,
            size: self.size,
            skew: self.skew,
            transport: self.transport.clone(),
            modes: self
                .mode
                .iter()
                .map(|m| crate::shuffle::parse_mode(m))
                .collect::<Result<_>>()?,
            segment: self.segment,
            batch: self.batch,
            rounds: self.rounds,
            base_port: self.base_port,
            mpi_chunk: self.mpi_chunk,
            mpirun_options: self.mpirun_options.clone(),
            netns: self
                .netns
                .then(|| Layout::new(&self.netns_prefix, self.procs, 1500)),
            dxnet: self.dxnet.clone(),
        })
    }
}

#[derive(Debug, Subcommand)]
enum NetnsAction {
    /// Create N namespaces `{prefix}0..` on a bridge (10.201.0.1.. /24).
    Setup {
        /// Number of node namespaces.
        #[arg(long)]
        nodes: usize,
        /// Namespace name prefix.
        #[arg(long, default_value = "dxb")]
        prefix: String,
        /// MTU of the veth links.
        #[arg(long, default_value_t = 1500)]
        mtu: u32,
    },
    /// Remove the namespaces of a prefix.
    Teardown {
        /// Namespace name prefix.
        #[arg(long, default_value = "dxb")]
        prefix: String,
    },
}

/// Options of a benchmark run.
#[derive(Debug, Args, Default)]
pub struct RunArgs {
    /// Configuration file (JSON or TOML); default: the built-in short suite.
    #[arg(long, short = 'c')]
    config: Option<PathBuf>,
    /// A published evaluation's settings: `ibdxnet-paper` (the Ibdxnet
    /// report's Table 2 for dxnet, its counts and sizes). Other flags
    /// override it.
    #[arg(long)]
    preset: Option<String>,
    /// With `--preset` (and `paper-figures`): divide its message counts by
    /// this (small machines). Default 1; `paper-figures`: 1000.
    #[arg(long)]
    scale: Option<u64>,
    /// The benchmark to start from instead of a file or the default suite
    /// (`paper-figures`).
    #[arg(skip)]
    base: Option<BenchConfig>,
    /// Figures to split the records into afterwards (`paper-figures`).
    #[arg(skip)]
    figures: Option<Vec<u32>>,
    /// Output directory.
    #[arg(long, short = 'o', default_value = "bench-results")]
    out: PathBuf,
    /// Bindings, comma-separated (raw-tcp, raw-tcp-batched, dxnet-tcp,
    /// dxnet-tcp-typed, dxnet-tcp-tls, dxnet-loopback, dxnet-ib, raw-verbs, ib_send_bw,
    /// ib_send_lat, ib_write_bw, ib_write_lat, ib_read_bw, ib_read_lat,
    /// mpi-tcp, mpi-shm, mpich-tcp, mpich-shm).
    #[arg(long, value_delimiter = ',')]
    bindings: Vec<String>,
    /// Operations (throughput, latency, pingpong, all_to_all, rdma_write,
    /// rdma_read, rdma_write_lat, rdma_read_lat); replaces the config's
    /// list, keeping its entries for operations named here.
    #[arg(long, value_delimiter = ',')]
    operations: Vec<String>,
    /// Modes (uni, bi) for throughput.
    #[arg(long, value_delimiter = ',')]
    modes: Vec<String>,
    /// Message sizes, e.g. `64,4k,64k`.
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<String>,
    /// Smallest size of a power-of-two sweep (with --max-size).
    #[arg(long)]
    min_size: Option<String>,
    /// Largest size of a power-of-two sweep.
    #[arg(long)]
    max_size: Option<String>,
    /// Messages (round trips) per sending node, before halving above 4 KiB.
    #[arg(long)]
    count: Option<u64>,
    /// Warm-up messages per sending node.
    #[arg(long)]
    warmup: Option<u64>,
    /// Measured repetitions.
    #[arg(long)]
    repetitions: Option<u32>,
    /// Sender threads per node, e.g. `1,2,4,8,16`.
    #[arg(long, value_delimiter = ',')]
    threads: Vec<usize>,
    /// Message-handler threads per node (dxnet), e.g. `1,2,4`.
    #[arg(long, value_delimiter = ',')]
    handlers: Vec<usize>,
    /// Open-loop rates, messages (round trips) per second per sending
    /// node spread over its threads, e.g. `10k,100k,1M`; each rate is a
    /// run of its own, reported with its achieved rate, how late the
    /// operations were issued and CPU time per operation. 0: closed loop.
    #[arg(long, value_delimiter = ',', value_parser = parse_rate)]
    rate: Vec<u64>,
    /// Node counts, e.g. `2,4,6,8`.
    #[arg(long, value_delimiter = ',')]
    nodes: Vec<usize>,
    /// First data port.
    #[arg(long)]
    base_port: Option<u16>,
    /// Phase timeout in seconds.
    #[arg(long)]
    timeout: Option<u64>,
    /// Halve counts for every doubling of the size above this.
    #[arg(long)]
    halve_count_from: Option<String>,
    /// Counts never go below this.
    #[arg(long)]
    min_count: Option<u64>,
    /// dxnet Config field for every dxnet node, `KEY=VALUE` (value as JSON,
    /// else a string; a dotted key names a field of a section); repeatable,
    /// e.g. `--dxnet limits.orb_size=4194304`.
    #[arg(long = "dxnet", value_name = "KEY=VALUE")]
    dxnet: Vec<String>,
    /// dxnet bindings: keep per-stage latency histograms of requests
    /// (`metrics.breakdown`) and print where the `pingpong` round trips
    /// went (also in results.json as `breakdown`).
    #[arg(long)]
    breakdown: bool,
    /// Receive buffer of the raw TCP baseline in bytes (e.g. `4M`).
    #[arg(long)]
    raw_tcp_recv_buffer: Option<String>,
    /// How long latency waiters spin before parking, in microseconds.
    #[arg(long)]
    spin_us: Option<u64>,
    /// One-sided accesses in flight per sender thread (`rdma_write`,
    /// `rdma_read`); default 16.
    #[arg(long)]
    rdma_window: Option<usize>,
    /// One-sided accesses copy the application's bytes instead of using
    /// registered memory in place (dxnet `write`/`read` of slices instead
    /// of `write_from`/`read_into`).
    #[arg(long)]
    rdma_copy: bool,
    /// dxnet bindings: `pingpong` sends requests and echoes from reused
    /// `dxnet::Buffer`s (`send_buffer`) instead of typed requests.
    #[arg(long)]
    buffers: bool,
    /// With `--buffers`: a buffer is replaced by a new one after this many
    /// uses (1: no reuse); default: reused for the whole run.
    #[arg(long)]
    buffer_reuse: Option<u64>,
    /// Work per received message or request, in nanoseconds of hashing
    /// (every binding).
    #[arg(long)]
    handler_work_ns: Option<u64>,
    /// Time every received message or request blocks its handler
    /// (sleeping), in microseconds (every binding).
    #[arg(long)]
    handler_block_us: Option<u64>,
    /// dxnet bindings: receivers run on all handler threads at once, also
    /// for one connection (`register_parallel`).
    #[arg(long)]
    parallel_handlers: bool,
    /// Node processes on this host run on their own shares of its cores
    /// (disjoint while there are no more processes than cores), as nodes
    /// on separate machines would; MPI ranks are bound likewise when they
    /// fit. Default: every thread on any core (MPI: `--bind-to none`).
    #[arg(long)]
    bind_nodes: bool,
    /// Interface whose tx_bytes count the wire bytes (default: the one that
    /// carries the node's address).
    #[arg(long)]
    wire_iface: Option<String>,
    /// RDMA device of the verbs bindings (default: $RDMA_DEV, else the
    /// first device).
    #[arg(long)]
    rdma_dev: Option<String>,
    /// RDMA port (default: $RDMA_PORT, else 1).
    #[arg(long)]
    rdma_port: Option<u8>,
    /// MPI bindings: messages in flight per window (OSU's window size;
    /// default 64).
    #[arg(long)]
    mpi_window: Option<usize>,
    /// MPI bindings: further `mpirun` options, e.g. `--bind-to none`.
    #[arg(long, value_name = "OPTIONS", allow_hyphen_values = true)]
    mpirun_extra: Option<String>,
    /// GID index for RoCE (default: $RDMA_GID_INDEX).
    #[arg(long)]
    rdma_gid_index: Option<u32>,
    /// Skip the plots.
    #[arg(long)]
    no_plots: bool,
    /// No progress bar.
    #[arg(long, short = 'q')]
    quiet: bool,
    /// Print the effective configuration (JSON) and exit.
    #[arg(long)]
    print_config: bool,
    /// Run every networked node in its own network namespace, connected by
    /// veth pairs and a bridge (needs root).
    #[arg(long)]
    netns: bool,
    /// Namespace name prefix for --netns.
    #[arg(long, default_value = "dxb")]
    netns_prefix: String,
    /// MTU of the veth links for --netns.
    #[arg(long, default_value_t = 1500)]
    mtu: u32,
    /// Multi-host run: file of `ID HOST` lines, one node per host.
    #[arg(long, requires = "node_id")]
    node_file: Option<PathBuf>,
    /// This host's node id in the node file (0 coordinates).
    #[arg(long, requires = "node_file")]
    node_id: Option<u16>,
    /// Control port of node 0 in a multi-host run.
    #[arg(long, default_value_t = 24099)]
    control_port: u16,
}

fn default_count(op: Operation) -> u64 {
    match op {
        Operation::Throughput | Operation::AllToAll => 100_000,
        Operation::RdmaWrite | Operation::RdmaRead => 100_000,
        Operation::Latency
        | Operation::Pingpong
        | Operation::RdmaWriteLat
        | Operation::RdmaReadLat => 10_000,
    }
}

/// Builds the effective configuration: file (or default suite) + flags.
pub fn effective_config(a: &RunArgs) -> Result<BenchConfig> {
    let mut cfg = match (&a.base, &a.config) {
        (Some(b), _) => b.clone(),
        (None, Some(p)) => BenchConfig::from_file(p)?,
        (None, None) => BenchConfig::default_suite(),
    };
    let preset = a
        .preset
        .as_deref()
        .map(crate::presets::Preset::parse)
        .transpose()?;
    if !a.bindings.is_empty() {
        cfg.bindings = a.bindings.iter().map(|s| s.trim().to_string()).collect();
    }
    if !a.operations.is_empty() {
        let mut entries = Vec::new();
        for o in &a.operations {
            let op = Operation::parse(o)?;
            let existing: Vec<BenchEntry> = cfg
                .benchmarks
                .iter()
                .filter(|e| e.operation == op)
                .cloned()
                .collect();
            if existing.is_empty() {
                let mut e = BenchEntry::new(op, default_count(op));
                if let Some(t) = cfg.benchmarks.first() {
                    // Keep the sweep of the base config so that a new
                    // operation runs at the same sizes.
                    e.sizes = t.sizes.clone();
                }
                entries.push(e);
            } else {
                entries.extend(existing);
            }
        }
        cfg.benchmarks = entries;
    }
    // The preset's counts and sizes, for every operation chosen above;
    // the flags below override them.
    match (preset, a.scale) {
        (Some(p), scale) => p.apply(&mut cfg, scale.unwrap_or(1))?,
        (None, Some(_)) => bail!("--scale goes with --preset"),
        (None, None) => {}
    }
    let sizes = if !a.sizes.is_empty() {
        Some(Sizes::List(
            a.sizes
                .iter()
                .map(|s| parse_size(s))
                .collect::<Result<_>>()?,
        ))
    } else if a.min_size.is_some() || a.max_size.is_some() {
        Some(Sizes::Range {
            min: a
                .min_size
                .as_deref()
                .map(parse_size)
                .transpose()?
                .unwrap_or(1),
            max: a
                .max_size
                .as_deref()
                .map(parse_size)
                .transpose()?
                .unwrap_or(1 << 20),
        })
    } else {
        None
    };
    let modes: Vec<Mode> = a
        .modes
        .iter()
        .map(|m| Mode::parse(m))
        .collect::<Result<_>>()?;
    for e in &mut cfg.benchmarks {
        if let Some(s) = &sizes {
            e.sizes = s.clone();
        }
        if !modes.is_empty() {
            e.modes = modes.clone();
        }
        if let Some(c) = a.count {
            e.count = c;
        }
        if let Some(w) = a.warmup {
            e.warmup = Some(w);
        }
        if let Some(r) = a.repetitions {
            e.repetitions = r;
        }
        if !a.threads.is_empty() {
            e.threads = a.threads.clone();
        }
        if !a.handlers.is_empty() {
            e.handlers = a.handlers.clone();
        }
        if !a.rate.is_empty() {
            e.rates = a.rate.clone();
        }
        if !a.nodes.is_empty() {
            e.nodes = Some(if e.operation == Operation::AllToAll {
                a.nodes.clone()
            } else {
                // Pairwise operations need even node counts.
                a.nodes.iter().copied().filter(|n| n % 2 == 0).collect()
            });
            if e.nodes.as_ref().is_some_and(|n| n.is_empty()) {
                e.nodes = None;
            }
        }
    }
    let p = &mut cfg.params;
    if let Some(v) = a.base_port {
        p.base_port = v;
    }
    if let Some(v) = a.timeout {
        p.timeout_s = v;
    }
    if let Some(v) = &a.halve_count_from {
        p.halve_count_from = parse_size(v)?;
    }
    if let Some(v) = a.min_count {
        p.min_count = v;
    }
    if let Some(v) = &a.raw_tcp_recv_buffer {
        p.raw_tcp_recv_buffer = parse_size(v)?;
    }
    if let Some(v) = a.rdma_window {
        p.rdma_window = v;
    }
    if a.rdma_copy {
        p.rdma_copy = true;
    }
    if a.buffers {
        p.buffers = true;
    }
    if let Some(v) = a.buffer_reuse {
        p.buffer_reuse = v;
    }
    if let Some(v) = a.handler_work_ns {
        p.handler_work_ns = v;
    }
    if let Some(v) = a.handler_block_us {
        p.handler_block_us = v;
    }
    if a.parallel_handlers {
        p.parallel_handlers = true;
    }
    if a.bind_nodes {
        p.bind_nodes = true;
    }
    if let Some(v) = a.spin_us {
        p.spin_us = v;
    }
    if let Some(v) = &a.wire_iface {
        p.wire_iface = v.clone();
    }
    if let Some(v) = &a.rdma_dev {
        p.rdma.device = v.clone();
    }
    if let Some(v) = a.rdma_port {
        p.rdma.port = v;
    }
    if let Some(v) = a.mpi_window {
        p.mpi_window = v;
    }
    if let Some(v) = &a.mpirun_extra {
        p.mpirun_options = v.clone();
    }
    if let Some(v) = a.rdma_gid_index {
        p.rdma.gid_index = Some(v);
    }
    if a.breakdown {
        crate::binding::dxnet::merge(
            p.dxnet
                .entry("metrics".to_string())
                .or_insert(serde_json::Value::Null),
            &serde_json::json!({ "breakdown": true }),
        );
    }
    for kv in &a.dxnet {
        crate::binding::dxnet::merge_setting(&mut p.dxnet, kv)?;
    }
    if let Some(p) = preset {
        p.split_sizes(&mut cfg);
    }
    cfg.validate()?;
    Ok(cfg)
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Entry point.
pub fn main() -> Result<i32> {
    let cli = Cli::parse();
    match cli.cmd {
        Some(Sub::Node { coord, ids, cpus }) => {
            if !cpus.is_empty() {
                // Before any thread starts: they all inherit it. The
                // coordinator checks the CPUs this process reports.
                crate::affinity::bind(&cpus)?;
            }
            crate::node::run(&coord, ids)?;
            Ok(0)
        }
        Some(Sub::Membership {
            nodes,
            interval_ms,
            rounds,
            churn,
            netns,
            prefix,
            base_port,
            seed_only,
        }) => {
            if netns && !is_root() {
                bail!("--netns needs root");
            }
            crate::membership::run(&crate::membership::MembershipArgs {
                nodes,
                interval_ms,
                rounds,
                churn,
                netns,
                prefix,
                base_port,
                seed_only,
            })?;
            Ok(0)
        }
        Some(Sub::MembershipNode {
            id,
            addresses,
            interval_ms,
            stream_to,
            seed_only,
        }) => {
            crate::membership::node_main(id, &addresses, interval_ms, stream_to, seed_only)?;
            Ok(0)
        }
        Some(Sub::Shuffle { args }) => {
            crate::shuffle::run(&args.to_args()?)?;
            Ok(0)
        }
        Some(Sub::ShuffleNode { proc, args }) => {
            crate::shuffle::node_main(&crate::shuffle::NodeArgs {
                proc,
                run: args.to_args()?,
            })?;
            Ok(0)
        }
        Some(Sub::Netns { action }) => {
            if !is_root() {
                bail!("network namespaces need root");
            }
            match action {
                NetnsAction::Setup { nodes, prefix, mtu } => {
                    let l = Layout::new(&prefix, nodes, mtu);
                    l.setup()?;
                    for i in 0..nodes {
                        println!("{}  {}", l.namespace(i), l.address(i));
                    }
                }
                NetnsAction::Teardown { prefix } => Layout::new(&prefix, 64, 1500).teardown(),
            }
            Ok(0)
        }
        Some(Sub::Plot {
            results,
            out,
            no_plots,
        }) => {
            let mut sets = Vec::new();
            for r in &results {
                sets.push(output::json::read(r)?);
            }
            let merged = sets.len() > 1;
            let records = output::json::merge(sets);
            let dir = out.unwrap_or_else(|| {
                results[0]
                    .parent()
                    .map(Path::to_path_buf)
                    .unwrap_or_else(|| PathBuf::from("."))
            });
            std::fs::create_dir_all(&dir)?;
            output::csv::write_all(&records, &dir)?;
            if merged {
                output::json::write(&records, &dir.join("results.json"))?;
                std::fs::write(dir.join("summary.txt"), output::table::render(&records))?;
            }
            let files = if no_plots {
                Vec::new()
            } else {
                output::plot::write_all(&records, &dir)?
            };
            print!("{}", output::table::render(&records));
            if merged {
                println!(
                    "\nmerged {} results files into {} ({} records)",
                    results.len(),
                    dir.join("results.json").display(),
                    records.len()
                );
            }
            println!("\nwrote {} plot files to {}", files.len(), dir.display());
            Ok(0)
        }
        Some(Sub::PaperFigures {
            transport,
            figures,
            all_sizes,
            mut run,
        }) => {
            let base = crate::figures::config(&transport, &figures, 1, 1)?;
            run.base = Some(base);
            run.preset = Some("ibdxnet-paper".into());
            run.scale = Some(run.scale.unwrap_or(1000));
            if run.sizes.is_empty() && run.min_size.is_none() && run.max_size.is_none() {
                run.sizes = crate::figures::sizes(all_sizes)
                    .expand()
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
            }
            if run.out == Path::new("bench-results") {
                run.out = crate::figures::default_out();
            }
            run.figures = Some(figures);
            run_suite(*run)
        }
        None => run_suite(cli.run),
    }
}

fn run_suite(a: RunArgs) -> Result<i32> {
    let cfg = effective_config(&a)?;
    if a.print_config {
        println!("{}", serde_json::to_string_pretty(&cfg)?);
        return Ok(0);
    }
    let exe = std::env::current_exe().context("cannot find own executable")?;
    let mut _guard = None;
    let placement = match (&a.node_file, a.node_id) {
        (Some(f), Some(id)) => {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("cannot read node file {}", f.display()))?;
            let hosts = coordinator::parse_node_file(&text)?;
            if id as usize >= hosts.len() {
                bail!("node id {id} is not in the node file");
            }
            if id != 0 {
                // A worker host: serve the coordinator until it says exit.
                let coord = format!("tcp:{}:{}", hosts[0], a.control_port);
                crate::node::run(&coord, vec![id])?;
                return Ok(0);
            }
            coordinator::gather_hosts(hosts, &format!("0.0.0.0:{}", a.control_port), &exe)?
        }
        _ if a.netns => {
            if !is_root() {
                bail!("--netns needs root");
            }
            let n = cfg
                .plan()?
                .iter()
                .filter(|g| BindingKind::parse(&g.key.binding).is_ok_and(|k| k.uses_network()))
                .map(|g| g.key.nodes)
                .max()
                .unwrap_or(2);
            let layout = Layout::new(&a.netns_prefix, n, a.mtu);
            layout.setup()?;
            _guard = Some(Guard(layout.clone()));
            Placement::Netns(layout)
        }
        _ => Placement::Local,
    };
    let groups = cfg.plan()?;
    let runs: usize = groups.iter().map(|g| g.runs.len()).sum();
    eprintln!(
        "dxnet-bench: {runs} runs in {} process groups; bindings: {}; results -> {}",
        groups.len(),
        cfg.bindings.join(", "),
        a.out.display()
    );
    if cfg.params.bind_nodes {
        match placement {
            Placement::Hosts { .. } => eprintln!(
                "dxnet-bench: --bind-nodes binds the node processes one host starts; \
                 with --node-file each host runs its node on all its cores"
            ),
            _ => eprintln!(
                "dxnet-bench: node processes bound to their shares of the cores \
                 (MPI ranks too; perftest unbound)"
            ),
        }
    }
    // The run's effective configuration beside its results (written first,
    // so a run cut short says what it was): bindings, counts and every
    // parameter such as `bind_nodes`.
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("cannot create {}", a.out.display()))?;
    let config_file = a.out.join("config.json");
    std::fs::write(&config_file, serde_json::to_string_pretty(&cfg)?)
        .with_context(|| format!("cannot write {}", config_file.display()))?;
    let outcome = Coordinator::new(cfg, placement, exe, a.quiet).run()?;
    drop(_guard);
    let mut files = output::write_all(&outcome.records, &a.out, !a.no_plots)?;
    files.push(config_file);
    println!();
    print!("{}", output::table::render(&outcome.records));
    if let Some(figs) = &a.figures {
        let text = crate::figures::write(&outcome.records, figs, &a.out, !a.no_plots)?;
        println!("\nThe report's figures re-run here (headline ratios; per figure in figNN/)\n");
        print!("{text}");
    }
    println!(
        "\n{} records; wrote {} files to {} (results.json, config.json, *.csv, summary.txt{})",
        outcome.records.len(),
        files.len(),
        a.out.display(),
        if a.no_plots { "" } else { ", *.svg, *.png" }
    );
    if !outcome.failures.is_empty() {
        eprintln!("\n{} group(s) failed:", outcome.failures.len());
        for f in &outcome.failures {
            eprintln!("  {f}");
        }
        return Ok(1);
    }
    Ok(0)
}

/// A rate with an optional decimal suffix: `5000`, `20k`, `1M`.
fn parse_rate(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1_000),
        Some('m' | 'M') => (&t[..t.len() - 1], 1_000_000),
        _ => (t, 1),
    };
    num.trim()
        .parse::<u64>()
        .map(|n| n * mul)
        .map_err(|_| format!("bad rate {s:?} (e.g. 5000, 20k, 1M)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> RunArgs {
        let mut full = vec!["dxnet-bench"];
        full.extend_from_slice(v);
        Cli::try_parse_from(full).unwrap().run
    }

    #[test]
    fn preset_sets_the_paper_configuration_and_flags_override_it() {
        let c = effective_config(&args(&[
            "--preset",
            "ibdxnet-paper",
            "--scale",
            "1000",
            "--operations",
            "throughput,pingpong",
            "--bindings",
            "dxnet-tcp,mpi-tcp",
            "--dxnet",
            "limits.flow_control_threshold=0.2",
        ]))
        .unwrap();
        // The default suite's two throughput entries (1 and 16 threads) and
        // its pingpong entry, each split into the two receive-buffer settings.
        assert_eq!(c.benchmarks.len(), 6);
        for e in &c.benchmarks {
            let want = if e.operation == Operation::Pingpong {
                10_000
            } else {
                100_000
            };
            assert_eq!(e.count, want);
        }
        assert_eq!(c.benchmarks[0].sizes.expand()[0], 1);
        assert_eq!(c.params.dxnet["limits"]["flow_control_threshold"], 0.2);
        assert_eq!(c.params.dxnet["limits"]["incoming_max_bytes"], 128 << 20);
        let c = effective_config(&args(&[
            "--preset",
            "ibdxnet-paper",
            "--sizes",
            "64",
            "--count",
            "7",
        ]))
        .unwrap();
        assert!(c.benchmarks.iter().all(|e| e.count == 7));
        assert!(c
            .benchmarks
            .iter()
            .all(|e| e.dxnet["limits"]["recv_buffer_size"] == 32 << 10));
        assert!(effective_config(&args(&["--preset", "nope"])).is_err());
        assert!(effective_config(&args(&["--scale", "2"])).is_err());
    }

    #[test]
    fn flags_override_config() {
        let a = args(&[
            "--bindings",
            "raw-tcp",
            "--operations",
            "throughput,all-to-all",
            "--sizes",
            "64,4k",
            "--count",
            "500",
            "--threads",
            "1,2",
            "--nodes",
            "2,3,4",
            "--dxnet",
            "limits.orb_size=4194304",
            "--dxnet",
            "limits.send_timeout_ms=9000",
            "--dxnet",
            "cluster_secret=abc",
        ]);
        let c = effective_config(&a).unwrap();
        assert_eq!(c.bindings, vec!["raw-tcp"]);
        // The default suite's two throughput entries, then a new one.
        let ops: Vec<Operation> = c.benchmarks.iter().map(|e| e.operation).collect();
        assert_eq!(
            ops,
            [
                Operation::Throughput,
                Operation::Throughput,
                Operation::AllToAll
            ]
        );
        assert_eq!(c.benchmarks[0].sizes.expand(), vec![64, 4096]);
        assert_eq!(c.benchmarks[1].count, 500);
        assert_eq!(c.benchmarks[1].threads, vec![1, 2]);
        assert_eq!(c.benchmarks[0].nodes, Some(vec![2, 4]));
        assert_eq!(c.benchmarks[2].nodes, Some(vec![2, 3, 4]));
        // Both throughput entries now name the same cases: measured once.
        let g = c.plan().unwrap();
        assert_eq!(g.iter().filter(|g| g.key.nodes == 2).count(), 2);
        for g in g.iter().filter(|g| g.key.nodes == 2) {
            let tp = g
                .runs
                .iter()
                .filter(|r| r.operation == Operation::Throughput);
            assert_eq!(tp.count(), 2, "{g:?}");
        }
        assert_eq!(c.params.dxnet["limits"]["orb_size"], 4194304);
        assert_eq!(c.params.dxnet["limits"]["send_timeout_ms"], 9000);
        assert_eq!(c.params.dxnet["cluster_secret"], "abc");
    }

    #[test]
    fn rdma_flags() {
        let c = effective_config(&args(&[
            "--bindings",
            "dxnet-ib,raw-verbs,ib_send_bw,ib_send_lat",
            "--rdma-dev",
            "rxe0",
            "--rdma-gid-index",
            "1",
        ]))
        .unwrap();
        assert_eq!(c.params.rdma.device, "rxe0");
        assert_eq!(c.params.rdma.gid_index, Some(1));
        let t = c.params.rdma.resolve_with(|_| Some("7".into()));
        assert_eq!(
            (t.device.as_deref(), t.port, t.gid_index),
            (Some("rxe0"), 7, Some(1))
        );
    }

    #[test]
    fn default_suite_without_flags() {
        let c = effective_config(&args(&[])).unwrap();
        assert_eq!(c, BenchConfig::default_suite());
    }

    #[test]
    fn bad_flags_fail() {
        assert!(effective_config(&args(&["--operations", "nope"])).is_err());
        assert!(effective_config(&args(&["--sizes", "abc"])).is_err());
        assert!(effective_config(&args(&["--dxnet", "novalue"])).is_err());
        assert!(Cli::try_parse_from(["dxnet-bench", "--node-id", "1"]).is_err());
    }

    #[test]
    fn example_configs_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let mut n = 0;
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let text = std::fs::read_to_string(&p).unwrap();
            let v: serde_json::Value = if p.extension().is_some_and(|x| x == "toml") {
                let t: toml::Value = toml::from_str(&text).unwrap();
                serde_json::to_value(t).unwrap()
            } else {
                serde_json::from_str(&text).unwrap()
            };
            BenchConfig::from_json(&v.to_string())
                .unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
            n += 1;
        }
        assert!(n >= 3);
    }
}
