//! dxnet-bench: the benchmark tool of dxnet-rs, in the spirit of the
//! Observatory framework and the OSU micro-benchmarks used in the DXNet
//! papers.
//!
//! Layout:
//! - [`config`]: the benchmark configuration and its expansion into runs;
//! - [`binding`]: the single lean interface and its implementations
//!   (`raw-tcp`, `raw-tcp-batched`, `dxnet-tcp`, `dxnet-loopback`,
//!   `dxnet-ib`, `raw-verbs`),
//!   plus perftest (`ib_send_bw`, `ib_send_lat`) as external bindings;
//! - [`ops`]: the operations, written once against the binding interface;
//! - [`coordinator`], [`node`], [`proto`]: the coordinator process, the node
//!   processes it drives, and the control channel between them;
//! - [`metrics`]: histograms, CPU time, wire counters, aggregation;
//! - [`output`]: CSV, results.json, plots, summary table;
//! - [`membership`]: discovery's join time and what joins and leaves cost
//!   an existing connection (`dxnet-bench membership`).
//! - [`netns`]: N nodes in network namespaces on one machine.
//! - [`start_gate`]: the start line of worker threads, called off when a
//!   spawn fails.
//! - [`affinity`]: disjoint shares of the host's cores for node processes
//!   (`--bind-nodes`).

pub mod affinity;
pub mod binding;
pub mod cli;
pub mod config;
pub mod coordinator;
pub mod figures;
pub mod membership;
pub mod metrics;
pub mod netns;
pub mod node;
pub mod ops;
pub mod output;
pub mod presets;
pub mod proto;
pub mod shuffle;
pub mod start_gate;
