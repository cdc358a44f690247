//! `dxnet-bench paper-figures`: the evaluation of the Ibdxnet/DXNet report
//! (`shared/papers/ibdxnet-dxnet-long-report.txt`, figures 11–19; the
//! extended paper's figures 4–7 are the same runs) re-run on the present
//! hardware in one command, with the report's configuration (`--preset
//! ibdxnet-paper`) and the systems a user would compare side by side.
//!
//! All figures run as one benchmark (a case two figures share is measured
//! once); the records are then split by figure into `OUT/figNN/` with the
//! usual CSV, JSON and summary, plots titled like the figures they
//! reproduce, and `OUT/figures.txt`, the headline ratios of every figure.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use crate::binding::baselines_of;
use crate::config::{fmt_size, BenchConfig, BenchEntry, Mode, Operation, Params, Sizes};
use crate::metrics::{summarize, Record};
use crate::output::{self, plot, table};

/// Sender-thread counts of the multi-threaded figures.
pub const THREADS: [usize; 5] = [1, 2, 4, 8, 16];
/// Node counts of the all-to-all figures.
pub const NODES: [usize; 4] = [2, 4, 6, 8];
/// Sizes run unless `--sizes` or `--all-sizes` is given: the ends of the
/// report's sweep (1 B, 1 MiB), its small-message headline size (64 B) and
/// points between (the report's sweep has all 21 powers of two).
pub const DEFAULT_SIZES: [usize; 6] = [1, 64, 1 << 10, 16 << 10, 64 << 10, 1 << 20];
/// The size of the headline rows' small messages, when measured.
pub const HEADLINE_SMALL: usize = 64;

/// One figure of the report.
#[derive(Debug, Clone)]
pub struct Figure {
    /// Number in the long report.
    pub number: u32,
    /// Number in the extended paper, if it has the figure.
    pub paper: Option<u32>,
    /// What it shows.
    pub title: &'static str,
    /// The runs.
    pub entry: BenchEntry,
}

impl Figure {
    /// Whether `r` belongs to this figure.
    pub fn contains(&self, r: &Record) -> bool {
        let e = &self.entry;
        let mode_ok = e.operation.is_latency()
            || e.operation == Operation::AllToAll
            || e.modes.contains(&r.mode);
        r.operation == e.operation
            && mode_ok
            && e.threads.contains(&r.threads)
            && e.node_counts().contains(&r.nodes)
            && (r.handlers == 0 || e.handlers.contains(&r.handlers))
    }

    /// `figNN`.
    pub fn stem(&self) -> String {
        format!("fig{}", self.number)
    }

    /// "Figure 11" or "Figure 14 (paper: 5)".
    pub fn name(&self) -> String {
        match self.paper {
            Some(p) => format!("Figure {} (paper: {p})", self.number),
            None => format!("Figure {}", self.number),
        }
    }
}

/// The figures 11–19 of the long report, with `count`/`lat_count` messages
/// and round trips per run (before the size halving).
pub fn figures(count: u64, lat_count: u64) -> Vec<Figure> {
    let entry = |op: Operation, mode: Mode, threads: &[usize], handlers: &[usize]| {
        let mut e = BenchEntry::new(op, if op.is_latency() { lat_count } else { count });
        e.modes = vec![mode];
        e.threads = threads.to_vec();
        e.handlers = handlers.to_vec();
        e.repetitions = 1;
        if op == Operation::AllToAll {
            e.nodes = Some(NODES.to_vec());
        }
        e
    };
    use Mode::{Bi, Uni};
    use Operation::{AllToAll, Pingpong, Throughput};
    vec![
        Figure {
            number: 11,
            paper: None,
            title: "2 nodes, uni-directional throughput and message rate, one send thread, 1, 2 and 4 message handlers",
            entry: entry(Throughput, Uni, &[1], &[1, 2, 4]),
        },
        Figure {
            number: 12,
            paper: None,
            title: "2 nodes, bi-directional throughput and message rate, one send thread, 1, 2 and 4 message handlers",
            entry: entry(Throughput, Bi, &[1], &[1, 2, 4]),
        },
        Figure {
            number: 13,
            paper: None,
            title: "2 nodes, round-trip time and message rate, one send thread, one message handler",
            entry: entry(Pingpong, Uni, &[1], &[1]),
        },
        Figure {
            number: 14,
            paper: None,
            title: "2 to 8 nodes, all-to-all aggregated throughput and message rate, one send thread, one message handler",
            entry: entry(AllToAll, Bi, &[1], &[1]),
        },
        Figure {
            number: 15,
            paper: Some(4),
            title: "2 nodes, uni-directional throughput and message rate, 1 to 16 send threads, 4 message handlers",
            entry: entry(Throughput, Uni, &THREADS, &[4]),
        },
        Figure {
            number: 16,
            paper: Some(5),
            title: "2 nodes, bi-directional throughput and message rate, 1 to 16 send threads, 4 message handlers",
            entry: entry(Throughput, Bi, &THREADS, &[4]),
        },
        Figure {
            number: 17,
            paper: Some(6),
            title: "2 nodes, average round-trip time (18: percentiles) and message rate, 1 to 16 send threads, 4 message handlers",
            entry: entry(Pingpong, Uni, &THREADS, &[4]),
        },
        Figure {
            number: 19,
            paper: Some(7),
            title: "2 to 8 nodes, all-to-all aggregated throughput and message rate, 16 send threads, 4 message handlers",
            entry: entry(AllToAll, Bi, &[16], &[4]),
        },
    ]
}

/// The systems of the figures over `transport` (`tcp` or `ib`): dxnet and
/// what a user would pick instead.
pub fn bindings(transport: &str) -> Result<Vec<String>> {
    let b: &[&str] = match transport {
        "tcp" => &["dxnet-tcp", "raw-tcp", "raw-tcp-batched", "mpi-tcp"],
        "ib" => &["dxnet-ib", "raw-verbs", "ib_send_bw", "ib_send_lat"],
        other => bail!("transport {other:?}: tcp or ib"),
    };
    Ok(b.iter().map(|s| s.to_string()).collect())
}

/// The benchmark of the figures `only` (all if empty).
pub fn config(transport: &str, only: &[u32], count: u64, lat_count: u64) -> Result<BenchConfig> {
    let figs = select(figures(count, lat_count), only)?;
    Ok(BenchConfig {
        bindings: bindings(transport)?,
        benchmarks: figs.into_iter().map(|f| f.entry).collect(),
        params: Params::default(),
    })
}

fn select(figs: Vec<Figure>, only: &[u32]) -> Result<Vec<Figure>> {
    // Figure 18 is figure 17's percentile plots.
    let only: Vec<u32> = only.iter().map(|&n| if n == 18 { 17 } else { n }).collect();
    let only = &only[..];
    for n in only {
        if !figs.iter().any(|f| f.number == *n) {
            bail!("no figure {n}: 11, 12, 13, 14, 15, 16, 17 (with 18) or 19");
        }
    }
    Ok(figs
        .into_iter()
        .filter(|f| only.is_empty() || only.contains(&f.number))
        .collect())
}

/// Writes each figure's records, tables and titled plots into
/// `dir/figNN/`, and the headline ratios into `dir/figures.txt`; returns
/// the headline text.
pub fn write(records: &[Record], only: &[u32], dir: &Path, plots: bool) -> Result<String> {
    let figs = select(figures(1, 1), only)?;
    let mut headline = String::new();
    for f in &figs {
        let recs: Vec<Record> = records.iter().filter(|r| f.contains(r)).cloned().collect();
        let sub = dir.join(f.stem());
        output::write_all(&recs, &sub, false)?;
        if plots {
            for mut c in plot::charts(&recs) {
                c.title = format!("{}: {}", f.name(), c.title);
                c.stem = format!("{}_{}", f.stem(), c.stem);
                plot::render(&c, &sub)?;
            }
        }
        let _ = writeln!(headline, "{}: {}", f.name(), f.title);
        headline.push_str(&headlines(f, &recs));
        headline.push('\n');
    }
    std::fs::write(dir.join("figures.txt"), &headline)?;
    Ok(headline)
}

/// The figure's headline rows: for every dxnet configuration, at 64 B
/// (else the smallest size measured) and the largest, dxnet's message rate (median
/// RTT for round trips) and its ratio to every baseline of the same case.
fn headlines(f: &Figure, recs: &[Record]) -> String {
    let lat = f.entry.operation.is_latency();
    // (nodes, threads, handlers, size) -> binding -> records
    type Case = (usize, usize, usize, usize);
    let mut by: BTreeMap<Case, BTreeMap<String, Vec<&Record>>> = BTreeMap::new();
    for r in recs {
        by.entry((r.nodes, r.threads, r.handlers, r.size))
            .or_default()
            .entry(r.binding.clone())
            .or_default()
            .push(r);
    }
    let sizes: Vec<usize> = {
        let mut s: Vec<usize> = recs.iter().map(|r| r.size).collect();
        s.sort_unstable();
        s.dedup();
        let small = if s.contains(&HEADLINE_SMALL) {
            Some(HEADLINE_SMALL)
        } else {
            s.first().copied()
        };
        match (small, s.last()) {
            (Some(a), Some(&b)) if a != b => vec![a, b],
            (Some(a), _) => vec![a],
            _ => vec![],
        }
    };
    let value = |rs: &[&Record]| -> Option<f64> {
        let v: Vec<f64> = rs
            .iter()
            .filter_map(|r| {
                if lat {
                    r.lat_us.map(|l| l.p50)
                } else {
                    Some(r.msgs_per_sec)
                }
            })
            .collect();
        summarize(&v).map(|s| s.median)
    };
    let mut rows = vec![vec![
        "case".to_string(),
        "binding".into(),
        if lat { "RTT p50" } else { "msg/s" }.into(),
        "ratios (dxnet / baseline; for RTT > 1 is slower)".into(),
    ]];
    for (&(nodes, threads, handlers, size), bindings) in &by {
        if !sizes.contains(&size) || handlers == 0 {
            continue;
        }
        for (b, rs) in bindings {
            let Some(v) = value(rs) else { continue };
            let mut ratios = Vec::new();
            for base in baselines_of(b) {
                // Baselines have no handler threads: their case is h = 0.
                let Some(brs) = by.get(&(nodes, threads, 0, size)).and_then(|m| {
                    m.get(&if *base == "perftest" {
                        crate::binding::perftest_for(f.entry.operation).to_string()
                    } else {
                        base.to_string()
                    })
                }) else {
                    continue;
                };
                if let Some(bv) = value(brs).filter(|x| *x > 0.0) {
                    ratios.push(format!("/ {base} {:.2}x", v / bv));
                }
            }
            rows.push(vec![
                format!("{} n{nodes} t{threads} h{handlers}", fmt_size(size)),
                b.clone(),
                if lat {
                    table::fmt_us(v)
                } else {
                    table::fmt_rate(v)
                },
                ratios.join(", "),
            ]);
        }
    }
    if rows.len() == 1 {
        return "  (no dxnet records)\n".into();
    }
    let mut out = String::new();
    for l in table::layout(&rows).lines() {
        let _ = writeln!(out, "  {l}");
    }
    out
}

/// Sizes of the figure runs: `--sizes`, else [`DEFAULT_SIZES`], or the
/// report's full sweep with `all`.
pub fn sizes(all: bool) -> Sizes {
    if all {
        Sizes::default()
    } else {
        Sizes::List(DEFAULT_SIZES.to_vec())
    }
}

/// Where the figures go by default.
pub fn default_out() -> PathBuf {
    PathBuf::from("bench-results/paper-figures")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_figure_runs_and_cases_are_shared() {
        let c = config("tcp", &[], 1000, 100).unwrap();
        c.validate().unwrap();
        assert_eq!(c.benchmarks.len(), 8);
        let groups = c.plan().unwrap();
        // MPI runs all four operations; dxnet with every handler count.
        assert!(groups
            .iter()
            .any(|g| g.key.binding == "mpi-tcp" && g.key.threads == 16 && g.key.nodes == 8));
        assert!(groups
            .iter()
            .any(|g| g.key.binding == "dxnet-tcp" && g.key.handlers == 1));
        assert!(config("ib", &[13], 1, 1).is_ok());
        assert!(config("x", &[], 1, 1).is_err());
        assert!(config("tcp", &[20], 1, 1).is_err());
        assert_eq!(config("tcp", &[18], 1, 1).unwrap().benchmarks.len(), 1);
    }

    #[test]
    fn records_go_to_their_figures() {
        let figs = figures(1, 1);
        let mut r = Record {
            operation: Operation::Throughput,
            mode: Mode::Uni,
            binding: "dxnet-tcp".into(),
            size: 64,
            threads: 1,
            handlers: 4,
            nodes: 2,
            repetition: 0,
            count: 1,
            messages: 1,
            elapsed_s: 1.0,
            msgs_per_sec: 1.0,
            bytes_per_sec: 64.0,
            lat_us: None,
            cpu_s: 0.0,
            proc_cpu_s: Vec::new(),
            cpu_us_per_op: 0.0,
            rate: 0,
            late_us: None,
            wire_bytes: None,
            wire_overhead: None,
            connections: Vec::new(),
            breakdown: None,
        };
        let of = |r: &Record| -> Vec<u32> {
            figs.iter()
                .filter(|f| f.contains(r))
                .map(|f| f.number)
                .collect()
        };
        // One thread, 4 handlers: in both uni figures.
        assert_eq!(of(&r), vec![11, 15]);
        r.handlers = 0; // a baseline
        assert_eq!(of(&r), vec![11, 15]);
        r.threads = 16;
        assert_eq!(of(&r), vec![15]);
        r.mode = Mode::Bi;
        assert_eq!(of(&r), vec![16]);
        r.operation = Operation::AllToAll;
        r.nodes = 6;
        assert_eq!(of(&r), vec![19]);
    }
}
