//! The terminal summary: a side-by-side comparison (one column per binding,
//! medians over the repetitions, and the ratio of each binding to its
//! baselines), a "versus" table per library binding (message rate,
//! bandwidth, p50/p99/p99.9 against each baseline), then a detail table with
//! min/median/max, CPU time and wire overhead per binding.
//!
//! Baselines come from [`baselines_of`]: `raw-tcp` and `raw-tcp-batched`
//! for the dxnet TCP and loopback bindings, `raw-verbs` and `perftest` for
//! `dxnet-ib`, where `perftest` is `ib_send_bw` in throughput rows and
//! `ib_send_lat` in round-trip rows.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::binding::{baselines_of, perftest_for};
use crate::config::{fmt_size, Mode, Operation};
use crate::metrics::{summarize, Record, Summary};

/// Formats a rate with k/M/G prefixes.
pub fn fmt_rate(v: f64) -> String {
    if v >= 1e9 {
        format!("{:.2} G", v / 1e9)
    } else if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1} k", v / 1e3)
    } else {
        format!("{v:.0} ")
    }
}

/// Formats bytes/s in decimal units (MB/s, GB/s) as the papers' plots do.
pub fn fmt_bw(v: f64) -> String {
    if v >= 1e9 {
        format!("{:.2} GB/s", v / 1e9)
    } else if v >= 1e6 {
        format!("{:.1} MB/s", v / 1e6)
    } else {
        format!("{:.1} kB/s", v / 1e3)
    }
}

/// Formats microseconds.
pub fn fmt_us(v: f64) -> String {
    if v >= 1000.0 {
        format!("{:.2} ms", v / 1000.0)
    } else {
        format!("{v:.1} µs")
    }
}

/// Lays out rows in aligned columns (first row is the header).
pub fn layout(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let width = |c: usize| {
        rows.iter()
            .map(|r| r.get(c).map(|s| s.chars().count()).unwrap_or(0))
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..cols).map(width).collect();
    let mut out = String::new();
    for (i, r) in rows.iter().enumerate() {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(c, s)| format!("{s:<w$}", w = widths[c]))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
        if i == 0 {
            let total: usize = widths.iter().sum::<usize>() + 2 * cols.saturating_sub(1);
            out.push_str(&"-".repeat(total));
            out.push('\n');
        }
    }
    out
}

/// A comparable case: everything but the binding (and the handler count of
/// raw baselines, which have none).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Case {
    op: Operation,
    mode: Mode,
    nodes: usize,
    threads: usize,
    size: usize,
    /// Open-loop rate per sending node; 0: closed loop.
    rate: u64,
    handlers: usize,
}

impl Case {
    /// The operation (and mode), with the rate of an open-loop run.
    fn op_name(&self) -> String {
        let name = if self.op.is_latency() {
            self.op.to_string()
        } else {
            format!("{} {}", self.op, self.mode)
        };
        if self.rate > 0 {
            format!("{name} @{}/s", fmt_rate(self.rate as f64).trim_end())
        } else {
            name
        }
    }
}

struct Cell {
    rate: Summary,
    bw: Summary,
    p50: Option<Summary>,
    p99: Option<Summary>,
    p999: Option<Summary>,
    cpu: Option<Summary>,
    cpu_op: Option<Summary>,
    late_mean: Option<Summary>,
    late_max: Option<Summary>,
    wire: Option<Summary>,
}

fn cell(rs: &[&Record]) -> Option<Cell> {
    let m = |f: &dyn Fn(&Record) -> Option<f64>| {
        summarize(&rs.iter().filter_map(|r| f(r)).collect::<Vec<_>>())
    };
    Some(Cell {
        rate: m(&|r| Some(r.msgs_per_sec))?,
        bw: m(&|r| Some(r.bytes_per_sec))?,
        p50: m(&|r| r.lat_us.map(|l| l.p50)),
        p99: m(&|r| r.lat_us.map(|l| l.p99)),
        p999: m(&|r| r.lat_us.map(|l| l.p999)),
        cpu: m(&|r| Some(r.cpu_s)),
        cpu_op: m(&|r| (r.messages > 0).then_some(r.cpu_us_per_op)),
        late_mean: m(&|r| r.late_us.map(|l| l.mean)),
        late_max: m(&|r| r.late_us.map(|l| l.max)),
        wire: m(&|r| r.wire_overhead),
    })
}

fn primary(case: &Case, c: &Cell) -> String {
    let op = case.op;
    if case.rate > 0 {
        // Open loop: the rate is set; what it costs is the result.
        let cpu = c
            .cpu_op
            .map_or("-".into(), |s| format!("{:.2} µs cpu/op", s.median));
        format!("{}/s  {cpu}", fmt_rate(c.rate.median).trim_end())
    } else if op.is_latency() {
        match (c.p50, c.p99) {
            (Some(a), Some(b)) => format!("{} p50 / {} p99", fmt_us(a.median), fmt_us(b.median)),
            _ => "-".into(),
        }
    } else {
        format!("{}msg/s  {}", fmt_rate(c.rate.median), fmt_bw(c.bw.median))
    }
}

/// Renders both tables.
pub fn render(records: &[Record]) -> String {
    // Bindings in order of appearance.
    let mut bindings: Vec<String> = Vec::new();
    for r in records {
        if !bindings.contains(&r.binding) {
            bindings.push(r.binding.clone());
        }
    }
    let mut cells: BTreeMap<(Case, String), Vec<&Record>> = BTreeMap::new();
    for r in records {
        let case = Case {
            op: r.operation,
            mode: r.mode,
            nodes: r.nodes,
            threads: r.threads,
            size: r.size,
            rate: r.rate,
            handlers: r.handlers,
        };
        cells.entry((case, r.binding.clone())).or_default().push(r);
    }
    // Rows: the cases of the non-raw bindings; raw-only cases stand alone.
    let mut cases: Vec<Case> = Vec::new();
    for (case, b) in cells.keys() {
        let raw = case.handlers == 0;
        let covered = raw
            && cells.keys().any(|(c, b2)| {
                b2 != b
                    && c.handlers > 0
                    && Case {
                        handlers: 0,
                        ..c.clone()
                    } == *case
            });
        if !covered && !cases.contains(case) {
            cases.push(case.clone());
        }
    }
    cases.sort();
    let lookup = |case: &Case, b: &str| -> Option<Cell> {
        let b = if b == "perftest" {
            perftest_for(case.op)
        } else {
            b
        };
        let rs = cells.get(&(case.clone(), b.to_string())).or_else(|| {
            cells.get(&(
                Case {
                    handlers: 0,
                    ..case.clone()
                },
                b.to_string(),
            ))
        })?;
        cell(rs)
    };
    let present = |base: &str| {
        bindings
            .iter()
            .any(|x| x == base || (base == "perftest" && (x == "ib_send_bw" || x == "ib_send_lat")))
    };
    let ratio_pairs: Vec<(String, String)> = bindings
        .iter()
        .flat_map(|b| {
            baselines_of(b)
                .iter()
                .filter(|base| present(base))
                .map(|base| (b.clone(), base.to_string()))
        })
        .collect();

    let mut out = String::new();
    let mut rows = vec![{
        let mut h: Vec<String> = ["operation", "size", "nodes", "thr", "hnd"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        h.extend(bindings.iter().cloned());
        h.extend(ratio_pairs.iter().map(|(b, base)| format!("{b} / {base}")));
        h
    }];
    for case in &cases {
        let mut row = vec![
            case.op_name(),
            fmt_size(case.size),
            case.nodes.to_string(),
            case.threads.to_string(),
            if case.handlers > 0 {
                case.handlers.to_string()
            } else {
                "-".into()
            },
        ];
        for b in &bindings {
            row.push(
                lookup(case, b)
                    .map(|c| primary(case, &c))
                    .unwrap_or_else(|| "-".into()),
            );
        }
        for (b, base) in &ratio_pairs {
            let r = match (lookup(case, b), lookup(case, base)) {
                (Some(x), Some(y)) if case.rate > 0 => match (x.cpu_op, y.cpu_op) {
                    (Some(a), Some(c)) if c.median > 0.0 => {
                        format!("{:.2}x cpu/op", a.median / c.median)
                    }
                    _ => "-".into(),
                },
                (Some(x), Some(y)) if case.op.is_latency() => match (x.p50, y.p50) {
                    (Some(a), Some(c)) if c.median > 0.0 => {
                        format!("{:.2}x latency", a.median / c.median)
                    }
                    _ => "-".into(),
                },
                (Some(x), Some(y)) if y.rate.median > 0.0 => {
                    format!("{:.2}x msg/s", x.rate.median / y.rate.median)
                }
                _ => "-".into(),
            };
            row.push(r);
        }
        rows.push(row);
    }
    let _ = writeln!(out, "Summary (medians over repetitions)\n");
    out.push_str(&layout(&rows));

    // Versus tables: one per library binding that has baselines here.
    let mut libs: Vec<&String> = ratio_pairs.iter().map(|(b, _)| b).collect();
    libs.dedup();
    for lib in libs {
        let bases: Vec<&String> = ratio_pairs
            .iter()
            .filter(|(b, _)| b == lib)
            .map(|(_, base)| base)
            .collect();
        let mut rows = vec![{
            let mut h: Vec<String> = vec!["case".into(), "metric".into(), lib.clone()];
            h.extend(bases.iter().map(|b| b.to_string()));
            h.extend(bases.iter().map(|b| format!("{lib} / {b}")));
            h
        }];
        for case in &cases {
            let Some(mine) = lookup(case, lib) else {
                continue;
            };
            let theirs: Vec<Option<Cell>> = bases.iter().map(|b| lookup(case, b)).collect();
            let name = format!("{} {}", case.op_name(), fmt_size(case.size));
            let name = if case.nodes != 2 || case.threads != 1 {
                format!("{name} n{} t{}", case.nodes, case.threads)
            } else {
                name
            };
            type Metric = (&'static str, fn(&Cell) -> Option<f64>, fn(f64) -> String);
            let cpu_op: Metric = (
                "cpu/op",
                |c| c.cpu_op.map(|s| s.median),
                |v| format!("{v:.2} µs"),
            );
            let metrics: Vec<Metric> = if case.rate > 0 {
                vec![
                    cpu_op,
                    (
                        "achieved",
                        |c| Some(c.rate.median),
                        |v| format!("{}/s", fmt_rate(v).trim_end()),
                    ),
                    ("late mean", |c| c.late_mean.map(|s| s.median), fmt_us),
                ]
            } else if case.op == Operation::Pingpong {
                vec![
                    ("RTT p50", |c| c.p50.map(|s| s.median), fmt_us),
                    ("RTT p99", |c| c.p99.map(|s| s.median), fmt_us),
                    ("RTT p99.9", |c| c.p999.map(|s| s.median), fmt_us),
                ]
            } else if case.op.is_latency() {
                vec![
                    ("one-way p50", |c| c.p50.map(|s| s.median), fmt_us),
                    ("one-way p99", |c| c.p99.map(|s| s.median), fmt_us),
                    ("one-way p99.9", |c| c.p999.map(|s| s.median), fmt_us),
                ]
            } else {
                vec![
                    (
                        "msg/s",
                        |c| Some(c.rate.median),
                        |v| format!("{}msg/s", fmt_rate(v)),
                    ),
                    ("payload", |c| Some(c.bw.median), fmt_bw),
                ]
            };
            for (metric, get, fmt) in metrics {
                let a = get(&mine);
                let mut row = vec![
                    name.clone(),
                    metric.to_string(),
                    a.map(fmt).unwrap_or_else(|| "-".into()),
                ];
                for t in &theirs {
                    row.push(
                        t.as_ref()
                            .and_then(get)
                            .map(fmt)
                            .unwrap_or_else(|| "-".into()),
                    );
                }
                for t in &theirs {
                    row.push(match (a, t.as_ref().and_then(get)) {
                        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
                        _ => "-".into(),
                    });
                }
                rows.push(row);
            }
        }
        if rows.len() > 1 {
            let _ = writeln!(
                out,
                "\n{lib} versus {} (medians; latency ratios > 1 mean {lib} is slower)\n",
                bases
                    .iter()
                    .map(|b| b.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            out.push_str(&layout(&rows));
        }
    }

    // Detail table.
    let mut rows = vec![[
        "operation",
        "size",
        "binding",
        "n",
        "t",
        "h",
        "msg/s min/med/max",
        "payload",
        "p50",
        "p99",
        "cpu s",
        "cpu/op",
        "late mean/max",
        "wire x",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect::<Vec<_>>()];
    for ((case, b), rs) in &cells {
        let Some(c) = cell(rs) else { continue };
        rows.push(vec![
            case.op_name(),
            fmt_size(case.size),
            b.clone(),
            case.nodes.to_string(),
            case.threads.to_string(),
            case.handlers.to_string(),
            format!(
                "{}/ {}/ {}",
                fmt_rate(c.rate.min),
                fmt_rate(c.rate.median),
                fmt_rate(c.rate.max)
            ),
            fmt_bw(c.bw.median),
            c.p50
                .map(|s| fmt_us(s.median))
                .unwrap_or_else(|| "-".into()),
            c.p99
                .map(|s| fmt_us(s.median))
                .unwrap_or_else(|| "-".into()),
            c.cpu
                .map(|s| format!("{:.3}", s.median))
                .unwrap_or_else(|| "-".into()),
            c.cpu_op
                .map(|s| format!("{:.2} µs", s.median))
                .unwrap_or_else(|| "-".into()),
            match (c.late_mean, c.late_max) {
                (Some(a), Some(b)) => format!("{}/ {}", fmt_us(a.median), fmt_us(b.max)),
                _ => "-".into(),
            },
            c.wire
                .map(|s| format!("{:.3}", s.median))
                .unwrap_or_else(|| "-".into()),
        ]);
    }
    let _ = writeln!(out, "\nDetails (per binding; medians unless noted)\n");
    out.push_str(&layout(&rows));
    out.push_str(&breakdown_table(records));
    out
}

/// The latency breakdown of the records that have one (`--breakdown`):
/// per repetition, the mean of each stage in µs, with the share of the
/// round trip of the requester's own stages, the responder's, and the
/// transport (engines and wire both ways). Empty without such records.
pub fn breakdown_table(records: &[Record]) -> String {
    const STAGES: [(&str, &str); 11] = [
        ("send", "send"),
        ("post", "post"),
        ("transport", "transport"),
        ("request_queue", "req queue"),
        ("handler", "handler"),
        ("response_send", "resp send"),
        ("response_post", "resp post"),
        ("response_receive", "resp recv"),
        ("wake", "wake"),
        ("round_trip", "round trip"),
        ("round_trip", "rt p99"),
    ];
    let mut rows = vec![{
        let mut h: Vec<String> = ["operation", "size", "binding", "n", "t", "rep", "bench RTT"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        h.extend(STAGES.iter().map(|s| s.1.to_string()));
        h.extend(["requester", "responder", "transport"].map(|s| format!("{s} %")));
        h
    }];
    for r in records {
        let Some(b) = &r.breakdown else { continue };
        let mean = |s: &str| b.stage(s).map_or(0.0, |x| x.mean_us);
        let mut row = vec![
            r.operation.to_string(),
            fmt_size(r.size),
            r.binding.clone(),
            r.nodes.to_string(),
            r.threads.to_string(),
            r.repetition.to_string(),
            r.lat_us
                .as_ref()
                .filter(|_| r.operation == Operation::Pingpong)
                .map(|l| format!("{:.2}", l.avg))
                .unwrap_or_else(|| "-".into()),
        ];
        for (name, label) in STAGES {
            let v = if label == "rt p99" {
                b.stage(name).and_then(|s| s.p99_us)
            } else {
                Some(mean(name))
            };
            row.push(v.map_or_else(|| "-".into(), |v| format!("{v:.2}")));
        }
        let rt = mean("round_trip");
        let requester = mean("send") + mean("post") + mean("response_receive") + mean("wake");
        let responder =
            mean("request_queue") + mean("handler") + mean("response_send") + mean("response_post");
        for part in [requester, responder, mean("transport")] {
            row.push(if rt > 0.0 {
                format!("{:.0}", 100.0 * part / rt)
            } else {
                "-".into()
            });
        }
        rows.push(row);
    }
    if rows.len() == 1 {
        return String::new();
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nLatency breakdown (means in µs over each repetition's requests; send + post + transport \
         + responder stages + resp recv + wake = round trip, which lies within the bench's RTT; \
         post = the write on the sending thread; transport = both engines and the wire, both \
         ways, known as a mean only)\n"
    );
    out.push_str(&layout(&rows));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::LatencyStats;

    fn rec(binding: &str, handlers: usize, op: Operation, rate: f64, rep: u32) -> Record {
        Record {
            operation: op,
            mode: Mode::Uni,
            binding: binding.into(),
            size: 64,
            threads: 1,
            handlers,
            nodes: 2,
            repetition: rep,
            count: 10,
            messages: 10,
            elapsed_s: 1.0,
            msgs_per_sec: rate,
            bytes_per_sec: rate * 64.0,
            lat_us: op.is_latency().then_some(LatencyStats {
                avg: 1e6 / rate,
                min: 1.0,
                max: 1.0,
                p50: 1e6 / rate,
                p95: 1.0,
                p99: 1.0,
                p999: 1.0,
                p9999: 1.0,
            }),
            cpu_s: 0.5,
            proc_cpu_s: Vec::new(),
            cpu_us_per_op: 0.0,
            rate: 0,
            late_us: None,
            wire_bytes: None,
            wire_overhead: None,
            connections: Vec::new(),
            breakdown: None,
        }
    }

    #[test]
    fn side_by_side_with_ratio() {
        let recs = vec![
            rec("raw-tcp", 0, Operation::Throughput, 1e6, 0),
            rec("raw-tcp", 0, Operation::Throughput, 3e6, 1),
            rec("raw-tcp", 0, Operation::Throughput, 2e6, 2),
            rec("dxnet-tcp", 2, Operation::Throughput, 4e6, 0),
            rec("raw-tcp", 0, Operation::Pingpong, 50_000.0, 0),
            rec("dxnet-tcp", 2, Operation::Pingpong, 25_000.0, 0),
        ];
        let t = render(&recs);
        assert!(t.contains("dxnet-tcp / raw-tcp"), "{t}");
        assert!(t.contains("2.00x msg/s"), "{t}");
        assert!(t.contains("2.00x latency"), "{t}");
        assert!(t.contains("1.00 M/ 2.00 M/ 3.00 M"), "{t}");
    }

    #[test]
    fn tcp_against_both_raw_baselines_per_thread_count() {
        let mut recs = vec![
            rec("raw-tcp", 0, Operation::Throughput, 1e5, 0),
            rec("raw-tcp-batched", 0, Operation::Throughput, 8e6, 0),
            rec("dxnet-tcp", 2, Operation::Throughput, 2e6, 0),
            rec("raw-tcp", 0, Operation::Throughput, 2e5, 0),
            rec("dxnet-tcp", 2, Operation::Throughput, 4e4, 0),
        ];
        for r in &mut recs[3..] {
            r.threads = 16;
        }
        let t = render(&recs);
        let summary = t.split("versus").next().unwrap();
        assert!(summary.contains("dxnet-tcp / raw-tcp-batched"), "{t}");
        let row = |thr: &str| {
            summary
                .lines()
                .find(|l| l.starts_with("throughput") && l.split_whitespace().nth(5) == Some(thr))
                .unwrap_or_else(|| panic!("no {thr}-thread row:\n{t}"))
                .to_string()
        };
        // 1 thread: 20x raw-tcp, 0.25x raw-tcp-batched.
        let r1 = row("1");
        assert!(
            r1.contains("20.00x msg/s") && r1.contains("0.25x msg/s"),
            "{t}"
        );
        // 16 threads: no batched run, so no ratio against it.
        let r16 = row("16");
        assert!(
            r16.contains("0.20x msg/s") && r16.trim_end().ends_with('-'),
            "{t}"
        );
        assert!(t.contains("throughput uni 64 B n2 t16"), "{t}");
    }

    #[test]
    fn ib_versus_raw_verbs_and_perftest() {
        let mut recs = vec![
            rec("raw-verbs", 0, Operation::Throughput, 10_000.0, 0),
            rec("ib_send_bw", 0, Operation::Throughput, 20_000.0, 0),
            rec("dxnet-ib", 2, Operation::Throughput, 50_000.0, 0),
            rec("raw-verbs", 0, Operation::Pingpong, 40_000.0, 0),
            rec("ib_send_lat", 0, Operation::Pingpong, 50_000.0, 0),
            rec("dxnet-ib", 2, Operation::Pingpong, 25_000.0, 0),
        ];
        recs[5].lat_us.as_mut().unwrap().p999 = 4.0;
        let t = render(&recs);
        assert!(t.contains("dxnet-ib / raw-verbs"), "{t}");
        assert!(t.contains("dxnet-ib / perftest"), "{t}");
        assert!(
            t.contains("5.00x msg/s") && t.contains("2.50x msg/s"),
            "{t}"
        );
        // p50 40 µs vs 25 (raw-verbs) and 20 (ib_send_lat)
        assert!(
            t.contains("1.60x latency") && t.contains("2.00x latency"),
            "{t}"
        );
        assert!(t.contains("dxnet-ib versus raw-verbs, perftest"), "{t}");
        let versus = t.split("versus").nth(1).unwrap();
        assert!(versus.contains("RTT p99.9"), "{t}");
        assert!(versus.contains("4.00x"), "p99.9 4 µs vs 1 µs: {t}");
        assert!(!t.contains("dxnet-ib / raw-tcp"));
    }

    #[test]
    fn formatting() {
        assert_eq!(fmt_rate(1_234_567.0), "1.23 M");
        assert_eq!(fmt_bw(2.5e9), "2.50 GB/s");
        assert_eq!(fmt_us(12.34), "12.3 µs");
        assert_eq!(fmt_us(1500.0), "1.50 ms");
        let l = layout(&[
            vec!["a".into(), "bb".into()],
            vec!["ccc".into(), "d".into()],
        ]);
        assert_eq!(l, "a    bb\n-------\nccc  d\n");
    }
}
