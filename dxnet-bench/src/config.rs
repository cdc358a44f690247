//! Benchmark configuration (Observatory-style: operations × modes × sizes ×
//! repetitions × warm-up, plus binding parameters) and its expansion into a
//! flat run plan.
//!
//! A configuration is a JSON or TOML file; every option can also be set (or
//! overridden) by command-line flags, see [`crate::cli`].

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// The operations the tool measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Operation {
    /// Message throughput between node pairs (`uni` or `bi`).
    Throughput,
    /// One-way message latency, measured as half the round trip of a message
    /// that the receiver's message handler echoes back (OSU style).
    Latency,
    /// Request/response round trip (full RTT).
    Pingpong,
    /// Every node sends to every other node round-robin and receives from all.
    AllToAll,
    /// One-sided writes into the partner's exposed region, up to
    /// `params.rdma_window` in flight per thread (`uni` or `bi`);
    /// Observatory's `RdmaWriteThroughput`.
    RdmaWrite,
    /// One-sided reads from the partner's exposed region, windowed like
    /// `rdma_write`; Observatory's `RdmaReadThroughput`.
    RdmaRead,
    /// One write at a time: time until it is in place at the partner;
    /// Observatory's `RdmaWriteLatency`.
    RdmaWriteLat,
    /// One read at a time: time until its bytes are here; Observatory's
    /// `RdmaReadLatency`.
    RdmaReadLat,
}

impl Operation {
    /// All operations, in report order.
    pub const ALL: [Operation; 8] = [
        Operation::Throughput,
        Operation::Latency,
        Operation::Pingpong,
        Operation::AllToAll,
        Operation::RdmaWrite,
        Operation::RdmaRead,
        Operation::RdmaWriteLat,
        Operation::RdmaReadLat,
    ];

    /// Whether the operation reports a latency histogram.
    pub fn is_latency(self) -> bool {
        matches!(
            self,
            Operation::Latency
                | Operation::Pingpong
                | Operation::RdmaWriteLat
                | Operation::RdmaReadLat
        )
    }

    /// Whether the operation accesses the partner's memory one-sidedly
    /// (nothing arrives at the partner's sink).
    pub fn is_one_sided(self) -> bool {
        matches!(
            self,
            Operation::RdmaWrite
                | Operation::RdmaRead
                | Operation::RdmaWriteLat
                | Operation::RdmaReadLat
        )
    }

    /// Whether the one-sided operation reads (else it writes).
    pub fn reads(self) -> bool {
        matches!(self, Operation::RdmaRead | Operation::RdmaReadLat)
    }

    /// The name used in results and file names.
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Throughput => "throughput",
            Operation::Latency => "latency",
            Operation::Pingpong => "pingpong",
            Operation::AllToAll => "all_to_all",
            Operation::RdmaWrite => "rdma_write",
            Operation::RdmaRead => "rdma_read",
            Operation::RdmaWriteLat => "rdma_write_lat",
            Operation::RdmaReadLat => "rdma_read_lat",
        }
    }

    /// Parses a name as written in configs and flags (`all-to-all` accepted).
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.trim().replace('-', "_").as_str() {
            "throughput" => Operation::Throughput,
            "latency" => Operation::Latency,
            "pingpong" | "ping_pong" => Operation::Pingpong,
            "all_to_all" | "alltoall" => Operation::AllToAll,
            "rdma_write" => Operation::RdmaWrite,
            "rdma_read" => Operation::RdmaRead,
            "rdma_write_lat" => Operation::RdmaWriteLat,
            "rdma_read_lat" => Operation::RdmaReadLat,
            other => {
                bail!(
                    "unknown operation {other:?} (throughput, latency, pingpong, all_to_all, \
                     rdma_write, rdma_read, rdma_write_lat, rdma_read_lat)"
                )
            }
        })
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Direction of traffic between the nodes of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Even node ids send, odd node ids receive.
    Uni,
    /// Both nodes of a pair send and receive at the same time.
    Bi,
}

impl Mode {
    /// The name used in results and file names.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Uni => "uni",
            Mode::Bi => "bi",
        }
    }

    /// Parses `uni` / `bi`.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.trim() {
            "uni" => Mode::Uni,
            "bi" => Mode::Bi,
            other => bail!("unknown mode {other:?} (uni, bi)"),
        })
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Message sizes: an explicit list or every power of two in a range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Sizes {
    /// Explicit payload sizes in bytes.
    List(Vec<usize>),
    /// Powers of two from `min` to `max` (inclusive, both rounded to powers of two).
    Range {
        /// Smallest size in bytes.
        min: usize,
        /// Largest size in bytes.
        max: usize,
    },
}

impl Default for Sizes {
    /// 1 B … 1 MiB, as in the papers.
    fn default() -> Self {
        Sizes::Range {
            min: 1,
            max: 1 << 20,
        }
    }
}

impl Sizes {
    /// The sizes in ascending order, deduplicated.
    pub fn expand(&self) -> Vec<usize> {
        let set: BTreeSet<usize> = match self {
            Sizes::List(v) => v.iter().copied().collect(),
            Sizes::Range { min, max } => {
                let mut s = min.max(&1).next_power_of_two();
                let mut out = BTreeSet::new();
                while s <= *max {
                    out.insert(s);
                    s *= 2;
                }
                out
            }
        };
        set.into_iter().collect()
    }
}

/// One benchmark entry: an operation over modes, sizes, thread counts, handler
/// counts and node counts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BenchEntry {
    /// The operation.
    pub operation: Operation,
    /// Modes (only throughput distinguishes them; latency and pingpong always
    /// run `uni`, all-to-all always `bi`). Default `["uni"]`.
    #[serde(default = "default_modes")]
    pub modes: Vec<Mode>,
    /// Payload sizes. Default 1 B … 1 MiB in powers of two.
    #[serde(default)]
    pub sizes: Sizes,
    /// Messages (or round trips) per sending node for sizes up to
    /// `params.halve_count_from`; halved per doubling above it.
    pub count: u64,
    /// Warm-up messages per sending node, scaled like `count`. Default count/10.
    #[serde(default)]
    pub warmup: Option<u64>,
    /// Measured repetitions per size. Default 3.
    #[serde(default = "default_reps")]
    pub repetitions: u32,
    /// Sender threads per node. Default `[1]`.
    #[serde(default = "default_one")]
    pub threads: Vec<usize>,
    /// Message-handler threads per node (dxnet bindings only). Default `[2]`.
    #[serde(default = "default_handlers")]
    pub handlers: Vec<usize>,
    /// Node counts. Default `[2]`; all-to-all default `[4]`.
    #[serde(default)]
    pub nodes: Option<Vec<usize>>,
    /// dxnet `Config` fields for this entry's runs only, laid over
    /// `params.dxnet` (e.g. a receive-buffer size per size range); entries
    /// with different ones run in different processes.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub dxnet: serde_json::Map<String, serde_json::Value>,
    /// Open-loop rates: messages (round trips) per second per sending
    /// node, spread evenly over its sender threads, each run once per
    /// rate; 0: closed loop, as fast as the binding goes. Default `[0]`.
    /// Not for one-sided operations.
    #[serde(default = "default_rates")]
    pub rates: Vec<u64>,
}

fn default_rates() -> Vec<u64> {
    vec![0]
}

fn default_modes() -> Vec<Mode> {
    vec![Mode::Uni]
}
fn default_reps() -> u32 {
    3
}
fn default_one() -> Vec<usize> {
    vec![1]
}
fn default_handlers() -> Vec<usize> {
    vec![2]
}

impl BenchEntry {
    /// An entry with the defaults for `op`.
    pub fn new(op: Operation, count: u64) -> Self {
        BenchEntry {
            operation: op,
            modes: default_modes(),
            sizes: Sizes::default(),
            count,
            warmup: None,
            repetitions: default_reps(),
            threads: default_one(),
            handlers: default_handlers(),
            nodes: None,
            dxnet: serde_json::Map::new(),
            rates: default_rates(),
        }
    }

    /// The node counts this entry runs with.
    pub fn node_counts(&self) -> Vec<usize> {
        match &self.nodes {
            Some(n) => n.clone(),
            None if self.operation == Operation::AllToAll => vec![4],
            None => vec![2],
        }
    }
}

/// Parameters that apply to every run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Params {
    /// First data port; node `i` of a run listens on a port derived from it.
    pub base_port: u16,
    /// Counts are halved for every doubling of the size above this (bytes).
    pub halve_count_from: usize,
    /// Counts never drop below this.
    pub min_count: u64,
    /// A phase that takes longer than this fails (seconds).
    pub timeout_s: u64,
    /// Receive buffer of the raw TCP baseline in bytes.
    pub raw_tcp_recv_buffer: usize,
    /// Extra dxnet `Config` fields (any subset, e.g.
    /// `{"limits": {"orb_size": 4194304}}`), laid over the defaults of every
    /// dxnet node (sections merged field by field).
    pub dxnet: serde_json::Map<String, serde_json::Value>,
    /// Interface whose counters give the wire bytes of TCP runs; empty picks
    /// the interface that carries the node's address.
    pub wire_iface: String,
    /// How long a latency waiter spins before it parks (microseconds).
    pub spin_us: u64,
    /// RDMA device of the verbs bindings (`dxnet-ib`, `raw-verbs`,
    /// `ib_send_bw`, `ib_send_lat`).
    pub rdma: RdmaParams,
    /// The `raw-verbs` baseline's queue sizes.
    pub raw_verbs: RawVerbsParams,
    /// One-sided accesses in flight per sender thread in `rdma_write` and
    /// `rdma_read` (the queue depth of a verbs benchmark).
    pub rdma_window: usize,
    /// One-sided accesses copy the application's bytes (dxnet's `write`
    /// and `read` of slices; raw verbs through its send slots) instead of
    /// using registered memory in place (dxnet's `write_from` and
    /// `read_into` of an own region; raw verbs' send slots as they are),
    /// which is what perftest and Observatory's verbs binding measure.
    pub rdma_copy: bool,
    /// Work every received message and request costs its handler, in
    /// nanoseconds of hashing (counted in iterations calibrated once per
    /// process, so a preempted handler still does all of it); 0: none. The
    /// same for every binding.
    pub handler_work_ns: u64,
    /// Time every received message and request blocks its handler
    /// (sleeping, as a handler waiting for storage or another service
    /// would), in microseconds; 0: none. The same for every binding.
    pub handler_block_us: u64,
    /// dxnet bindings: register the benchmark's receivers as parallel
    /// (`Node::register_raw_parallel`, `register_request_parallel`), so the
    /// handler threads share one connection's messages.
    pub parallel_handlers: bool,
    /// Node processes on one host run on their own shares of its cores
    /// (whole cores, disjoint while there are no more processes than
    /// cores; see [`crate::affinity::share`]), as nodes on separate
    /// machines would; MPI ranks get the same shares when there are no
    /// more of them than cores. Off: the kernel places every thread of
    /// every node on any core, MPI ranks too (`--bind-to none`).
    pub bind_nodes: bool,
    /// dxnet bindings: request/response (`pingpong`) sends each request
    /// and its echo as a raw message from a reused `dxnet::Buffer`
    /// (`Node::send_buffer`, which the zero-copy policy may send in place)
    /// instead of typed requests: the frequent-buffer paper's ping-pong.
    /// Both sides copy what they receive into their buffer, as an MPI
    /// receive does. One-sided operations go from and into reused buffers
    /// (`write_buffer`, `read_buffer` and their async forms). Compare with
    /// `--dxnet 'zero_copy={"enabled":false}'`.
    pub buffers: bool,
    /// With `buffers`: each buffer is replaced by a new one after this many
    /// uses (the frequent-buffer paper's spectrum test; 1: no reuse at
    /// all); 0: reused for the whole run.
    pub buffer_reuse: u64,
    /// MPI bindings: messages in flight per window (the OSU benchmarks'
    /// window size; per peer in `all_to_all`).
    pub mpi_window: usize,
    /// perftest's queue depths.
    pub perftest: PerftestParams,
    /// MPI bindings: further `mpirun` options (whitespace-separated), after
    /// the ones that pick the transport.
    pub mpirun_options: String,
    /// Open-loop runs (a rate above 0) send at most this many seconds'
    /// worth of messages (rate × seconds caps `count`; the warm-up is at
    /// most a tenth of it).
    pub open_loop_s: f64,
}

/// Which RDMA device, port and GID the verbs bindings use. Unset values come
/// from the node process's environment (`RDMA_DEV`, `RDMA_PORT`,
/// `RDMA_GID_INDEX`, as set inside the Soft-RoCE VM), else the first device,
/// port 1 and no GID index (InfiniBand; RoCE needs one).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RdmaParams {
    /// Device name, e.g. `mlx5_0` or `rxe0`; empty: `$RDMA_DEV`, else the
    /// first device.
    pub device: String,
    /// Port number (1-based); 0: `$RDMA_PORT`, else 1.
    pub port: u8,
    /// GID index (RoCE v2: the IPv4 GID); unset: `$RDMA_GID_INDEX`.
    pub gid_index: Option<u32>,
}

/// The resolved RDMA settings of one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaTarget {
    /// Device name; `None`: the first device.
    pub device: Option<String>,
    /// Port number.
    pub port: u8,
    /// GID index, if any.
    pub gid_index: Option<u32>,
}

impl RdmaParams {
    /// Fills unset values from this process's environment.
    pub fn resolve(&self) -> RdmaTarget {
        self.resolve_with(|k| std::env::var(k).ok())
    }

    /// [`resolve`](Self::resolve) with an explicit environment (tests).
    pub fn resolve_with(&self, env: impl Fn(&str) -> Option<String>) -> RdmaTarget {
        let device = if self.device.is_empty() {
            env("RDMA_DEV").filter(|d| !d.trim().is_empty())
        } else {
            Some(self.device.clone())
        };
        let port = if self.port == 0 {
            env("RDMA_PORT")
                .and_then(|p| p.trim().parse().ok())
                .unwrap_or(1)
        } else {
            self.port
        };
        let gid_index = self
            .gid_index
            .or_else(|| env("RDMA_GID_INDEX").and_then(|g| g.trim().parse().ok()));
        RdmaTarget {
            device,
            port,
            gid_index,
        }
    }
}

/// Queue depths the perftest bindings pass (`-r`, `-t`); 0 leaves
/// perftest's default. The Ibdxnet report ran perftest with receive depth
/// 2000 and send depth 20, its own queue sizes (`--preset ibdxnet-paper`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PerftestParams {
    /// Receive queue depth of `ib_send_bw` (`-r`).
    pub rx_depth: u32,
    /// Send queue depth of the bandwidth tests (`-t`).
    pub tx_depth: u32,
}

/// Queue sizes of the `raw-verbs` baseline (perftest's defaults where it has
/// them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawVerbsParams {
    /// Send-queue depth per queue pair (`ib_send_bw -t`, default 128).
    pub tx_depth: u32,
    /// Receive WRs pre-posted per incoming queue pair (`ib_send_bw -r`,
    /// default 512).
    pub rx_depth: u32,
    /// Every n-th send is signaled (`ib_send_bw -Q`, default 100; at most
    /// `tx_depth`).
    pub signal_every: u32,
    /// Bytes per receive WR. Larger messages are sent as several WRs of
    /// this size (default 64 KiB).
    pub recv_size: usize,
    /// How long the receive thread busy-polls an idle CQ before it sleeps
    /// on the completion channel (microseconds).
    pub poll_spin_us: u64,
}

impl Default for RawVerbsParams {
    fn default() -> Self {
        RawVerbsParams {
            tx_depth: 128,
            rx_depth: 512,
            signal_every: 100,
            recv_size: 64 << 10,
            poll_spin_us: 2000,
        }
    }
}

impl Default for Params {
    fn default() -> Self {
        Params {
            base_port: 24100,
            halve_count_from: 4096,
            min_count: 16,
            timeout_s: 60,
            raw_tcp_recv_buffer: 4 << 20,
            dxnet: serde_json::Map::new(),
            wire_iface: String::new(),
            spin_us: 20,
            rdma: RdmaParams::default(),
            raw_verbs: RawVerbsParams::default(),
            rdma_window: 16,
            rdma_copy: false,
            buffers: false,
            buffer_reuse: 0,
            handler_work_ns: 0,
            handler_block_us: 0,
            parallel_handlers: false,
            bind_nodes: false,
            mpi_window: 64,
            perftest: PerftestParams::default(),
            mpirun_options: String::new(),
            open_loop_s: 2.0,
        }
    }
}

/// A whole benchmark configuration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BenchConfig {
    /// Bindings to run every entry with, e.g. `["raw-tcp", "dxnet-tcp"]`.
    pub bindings: Vec<String>,
    /// The benchmark entries.
    pub benchmarks: Vec<BenchEntry>,
    /// Parameters for all runs.
    #[serde(default)]
    pub params: Params,
}

impl BenchConfig {
    /// The short suite the tool runs with no arguments: small counts so that it
    /// finishes well within two minutes on a two-core machine. Throughput at
    /// 64 B, 4 KiB and 64 KiB with one sender thread, 64 B with 16 sender
    /// threads sharing each node's connection, and 64 B round trips with 1 and
    /// 16 threads; every one for `raw-tcp`, `raw-tcp-batched`, `dxnet-tcp` and
    /// `dxnet-tcp-typed` (the same with typed serde messages).
    pub fn default_suite() -> Self {
        let bindings = ["raw-tcp", "raw-tcp-batched", "dxnet-tcp", "dxnet-tcp-typed"]
            .map(String::from)
            .to_vec();
        let mut tp = BenchEntry::new(Operation::Throughput, 200_000);
        tp.sizes = Sizes::List(vec![64, 4096, 65536]);
        tp.warmup = Some(20_000);
        // 16 threads: a quarter of the messages, so that a binding whose
        // threads contend (tens of k msg/s) still takes seconds, not minutes.
        let mut tp16 = BenchEntry::new(Operation::Throughput, 50_000);
        tp16.sizes = Sizes::List(vec![64]);
        tp16.warmup = Some(5_000);
        tp16.threads = vec![16];
        // Round trips are bounded by the slower binding's latency: keep the
        // count small so the suite stays short on a loaded two-core machine.
        let mut pp = BenchEntry::new(Operation::Pingpong, 10_000);
        pp.sizes = Sizes::List(vec![64]);
        pp.warmup = Some(1_000);
        pp.threads = vec![1, 16];
        BenchConfig {
            bindings,
            benchmarks: vec![tp, tp16, pp],
            params: Params::default(),
        }
    }

    /// Reads a `.json` or `.toml` file (by extension; anything else is tried
    /// as JSON, then TOML).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        let is_toml = path.extension().is_some_and(|e| e == "toml");
        let cfg = if is_toml {
            Self::from_toml(&text)
        } else {
            Self::from_json(&text).or_else(|e| Self::from_toml(&text).map_err(|_| e))
        };
        cfg.with_context(|| format!("invalid config {}", path.display()))
    }

    /// Parses and validates JSON text.
    pub fn from_json(text: &str) -> Result<Self> {
        let c: Self = serde_json::from_str(text)?;
        c.validate()?;
        Ok(c)
    }

    /// Parses and validates TOML text.
    pub fn from_toml(text: &str) -> Result<Self> {
        let c: Self = toml::from_str(text)?;
        c.validate()?;
        Ok(c)
    }

    /// Checks values that serde cannot.
    pub fn validate(&self) -> Result<()> {
        if self.bindings.is_empty() {
            bail!("bindings: at least one binding is needed");
        }
        for b in &self.bindings {
            crate::binding::BindingKind::parse(b)?;
        }
        for e in &self.benchmarks {
            let op = e.operation;
            if e.count == 0 {
                bail!("{op}: count must be > 0");
            }
            if e.repetitions == 0 {
                bail!("{op}: repetitions must be > 0");
            }
            let sizes = e.sizes.expand();
            if sizes.is_empty() {
                bail!("{op}: no message sizes");
            }
            if sizes.iter().any(|&s| s == 0 || s > 1 << 30) {
                bail!("{op}: sizes must be within 1 B ..= 1 GiB");
            }
            if op.is_one_sided() && sizes.iter().any(|&s| s > crate::binding::ONE_SIDED_MAX) {
                bail!(
                    "{op}: sizes must be at most {} bytes",
                    crate::binding::ONE_SIDED_MAX
                );
            }
            if e.threads.is_empty() || e.threads.iter().any(|&t| t == 0 || t > 255) {
                bail!("{op}: threads must be within 1..=255");
            }
            if e.handlers.is_empty() || e.handlers.contains(&0) {
                bail!("{op}: handlers must be >= 1");
            }
            if e.modes.is_empty() {
                bail!("{op}: at least one mode is needed");
            }
            if e.rates.is_empty() {
                bail!("{op}: at least one rate is needed (0: closed loop)");
            }
            if op.is_one_sided() && e.rates.iter().any(|&r| r > 0) {
                bail!("{op}: one-sided operations run closed loop only (rate 0)");
            }
            if e.rates.iter().any(|&r| r > 1_000_000_000) {
                bail!("{op}: rates must be at most 10^9 per second");
            }
            for n in e.node_counts() {
                if !(2..=64).contains(&n) {
                    bail!("{op}: nodes must be within 2..=64");
                }
                if op != Operation::AllToAll && n % 2 != 0 {
                    bail!("{op}: pairwise operations need an even node count, got {n}");
                }
            }
        }
        if !(1..=4096).contains(&self.params.rdma_window) {
            bail!("params.rdma_window must be within 1..=4096");
        }
        if !(1..=4096).contains(&self.params.mpi_window) {
            bail!("params.mpi_window must be within 1..=4096");
        }
        if !(self.params.open_loop_s > 0.0 && self.params.open_loop_s <= 3600.0) {
            bail!("params.open_loop_s must be within (0, 3600] seconds");
        }
        if self.params.min_count == 0 {
            bail!("params.min_count must be > 0");
        }
        let rv = &self.params.raw_verbs;
        if rv.tx_depth == 0 || rv.rx_depth == 0 || rv.signal_every == 0 || rv.recv_size == 0 {
            bail!("params.raw_verbs: tx_depth, rx_depth, signal_every and recv_size must be > 0");
        }
        if rv.recv_size > 1 << 30 {
            bail!("params.raw_verbs.recv_size must be at most 1 GiB");
        }
        Ok(())
    }

    /// Messages per sending node for `size`: `count` up to
    /// `halve_count_from`, halved for every doubling above it, never below
    /// `min_count` (nor above `count`).
    pub fn scaled_count(&self, count: u64, size: usize) -> u64 {
        scaled_count(
            count,
            size,
            self.params.halve_count_from,
            self.params.min_count,
        )
    }

    /// Expands the configuration into process groups, each a list of runs
    /// that share the same processes and binding instances.
    pub fn plan(&self) -> Result<Vec<Group>> {
        let mut groups: Vec<Group> = Vec::new();
        for b in &self.bindings {
            let kind = crate::binding::BindingKind::parse(b)?;
            for e in &self.benchmarks {
                // Latency and pingpong are one initiator per pair; all-to-all is
                // inherently bidirectional.
                let modes: Vec<Mode> = if e.operation.is_latency() {
                    // (one-sided latency too: one initiator per pair)
                    vec![Mode::Uni]
                } else if e.operation == Operation::AllToAll {
                    vec![Mode::Bi]
                } else {
                    dedup(e.modes.clone())
                };
                // Handler threads mean nothing to the raw baselines: run them once.
                let handlers: Vec<usize> = if kind.has_handlers() {
                    dedup(e.handlers.clone())
                } else {
                    vec![0]
                };
                for &nodes in &dedup(e.node_counts()) {
                    for &threads in &dedup(e.threads.clone()) {
                        for &h in &handlers {
                            // Runs the binding cannot do (perftest: only
                            // its own test, two nodes, one thread) are left out.
                            let runs: Vec<RunSpec> = modes
                                .iter()
                                .filter(|&&m| kind.supports(e.operation, m, threads, nodes))
                                .flat_map(|&mode| {
                                    e.sizes.expand().into_iter().map(move |size| (mode, size))
                                })
                                .flat_map(|(mode, size)| {
                                    dedup(e.rates.clone())
                                        .into_iter()
                                        .map(move |rate| (mode, size, rate))
                                })
                                // External programs (perftest, MPI) pace
                                // nothing: closed loop only.
                                .filter(|&(_, _, rate)| rate == 0 || !kind.is_external())
                                .map(|(mode, size, rate)| {
                                    let mut count = self.scaled_count(e.count, size);
                                    let warm = e.warmup.unwrap_or(e.count / 10);
                                    let mut warmup = if warm == 0 {
                                        0
                                    } else {
                                        self.scaled_count(warm, size).min(count)
                                    };
                                    if rate > 0 {
                                        // Open loop: `open_loop_s` seconds at most.
                                        let cap = (rate as f64 * self.params.open_loop_s) as u64;
                                        count = count.min(cap.max(1));
                                        warmup = warmup.min(count / 10);
                                    }
                                    RunSpec {
                                        operation: e.operation,
                                        mode,
                                        size,
                                        count,
                                        warmup,
                                        repetitions: e.repetitions,
                                        rate,
                                    }
                                })
                                .collect();
                            if runs.is_empty() {
                                continue;
                            }
                            let key = GroupKey {
                                binding: kind.name().to_string(),
                                nodes,
                                threads,
                                handlers: h,
                            };
                            let gi = match groups
                                .iter()
                                .position(|g| g.key == key && g.dxnet == e.dxnet)
                            {
                                Some(i) => i,
                                None => {
                                    groups.push(Group {
                                        key: key.clone(),
                                        runs: Vec::new(),
                                        dxnet: e.dxnet.clone(),
                                    });
                                    groups.len() - 1
                                }
                            };
                            // A case is measured once per group: the first
                            // entry naming it sets its counts (flags such as
                            // --threads can make two entries overlap).
                            for run in runs {
                                let case = (run.operation, run.mode, run.size, run.rate);
                                if !groups[gi]
                                    .runs
                                    .iter()
                                    .any(|r| (r.operation, r.mode, r.size, r.rate) == case)
                                {
                                    groups[gi].runs.push(run);
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(groups)
    }
}

/// See [`BenchConfig::scaled_count`].
pub fn scaled_count(count: u64, size: usize, halve_from: usize, min_count: u64) -> u64 {
    let mut c = count;
    if halve_from > 0 {
        let mut s = halve_from;
        while s < size {
            c /= 2;
            s = s.saturating_mul(2);
        }
    }
    c.max(min_count.min(count))
}

fn dedup<T: Ord + Clone>(v: Vec<T>) -> Vec<T> {
    let mut seen = BTreeSet::new();
    v.into_iter().filter(|x| seen.insert(x.clone())).collect()
}

/// What makes two runs share processes and binding instances.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupKey {
    /// Binding name.
    pub binding: String,
    /// Number of nodes.
    pub nodes: usize,
    /// Sender threads per node.
    pub threads: usize,
    /// Message-handler threads per node (0 for raw bindings).
    pub handlers: usize,
}

/// Runs that share one set of node processes (initialize and connect once,
/// then prepare / warm up / measure per run, clean up at the end).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Group {
    /// The shared parameters.
    pub key: GroupKey,
    /// The runs, in order.
    pub runs: Vec<RunSpec>,
    /// dxnet `Config` fields of this group's entries, over `params.dxnet`.
    pub dxnet: serde_json::Map<String, serde_json::Value>,
}

impl Group {
    /// The parameters of this group's processes: `params` with the group's
    /// dxnet fields laid over `params.dxnet`.
    pub fn params(&self, params: &Params) -> Params {
        let mut p = params.clone();
        if !self.dxnet.is_empty() {
            let mut v = serde_json::Value::Object(std::mem::take(&mut p.dxnet));
            crate::binding::dxnet::merge(&mut v, &serde_json::Value::Object(self.dxnet.clone()));
            if let serde_json::Value::Object(m) = v {
                p.dxnet = m;
            }
        }
        p
    }
}

/// One (operation, mode, size, rate) with its counts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunSpec {
    /// The operation.
    pub operation: Operation,
    /// The mode.
    pub mode: Mode,
    /// Payload bytes per message.
    pub size: usize,
    /// Messages or round trips per sending node in a measured repetition.
    pub count: u64,
    /// Messages or round trips per sending node in the warm-up.
    pub warmup: u64,
    /// Measured repetitions.
    pub repetitions: u32,
    /// Open-loop rate per sending node (messages or round trips per
    /// second, spread over its sender threads); 0: closed loop.
    #[serde(default)]
    pub rate: u64,
}

/// Parses a size with an optional binary suffix: `64`, `4k`, `4KiB`, `1M`.
pub fn parse_size(s: &str) -> Result<usize> {
    let t = s.trim().to_ascii_lowercase();
    let t = t.trim_end_matches("ib").trim_end_matches('b');
    let (num, mul) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1usize << 10),
        Some('m') => (&t[..t.len() - 1], 1 << 20),
        Some('g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let n: usize = num
        .trim()
        .parse()
        .with_context(|| format!("bad size {s:?}"))?;
    Ok(n * mul)
}

/// Formats a byte size the way the plots and tables label it (`64 B`, `4 KiB`).
pub fn fmt_size(s: usize) -> String {
    if s >= 1 << 30 && s & ((1 << 30) - 1) == 0 {
        format!("{} GiB", s >> 30)
    } else if s >= 1 << 20 && s & ((1 << 20) - 1) == 0 {
        format!("{} MiB", s >> 20)
    } else if s >= 1 << 10 && s & ((1 << 10) - 1) == 0 {
        format!("{} KiB", s >> 10)
    } else {
        format!("{s} B")
    }
}

#[cfg(test)]
mod tests;
