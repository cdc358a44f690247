//! The summary table and the plots of `dxkv local`: the run phase's
//! throughput per workload, cluster, thread count and binding, as medians
//! over rounds, and each binding's ratio to the first one's from the same
//! round.

use std::collections::{BTreeMap, BTreeSet};

use dxkv::ycsb::{Phase, Report};
use dxnet_bench::output::plot::{Chart, Line, XAxis};

use crate::cluster::Run;

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(|x, y| x.total_cmp(y));
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

fn run_report(r: &Run) -> Option<&Report> {
    r.reports.iter().find(|r| r.phase == Phase::Run)
}

/// What one line of the table compares across bindings.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Key {
    workload: String,
    storage: u16,
    bench: u16,
    threads: usize,
}

impl Key {
    fn of(r: &Run) -> Self {
        Key {
            workload: r.workload_name.clone(),
            storage: r.storage_nodes,
            bench: r.benchmark_nodes,
            threads: r.threads_per_node,
        }
    }
}

/// Every key, in the order first run.
fn keys(runs: &[Run]) -> Vec<Key> {
    let mut out: Vec<Key> = Vec::new();
    for r in runs {
        let k = Key::of(r);
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

/// The run phase's operations per second of `binding` at `k`, by round.
fn rates(runs: &[Run], k: &Key, binding: &str) -> Vec<(usize, f64)> {
    runs.iter()
        .filter(|r| r.binding == binding && Key::of(r) == *k)
        .filter_map(|r| run_report(r).map(|rep| (r.round, rep.ops_per_sec)))
        .collect()
}

/// The summary table: per workload, cluster, thread count and binding the
/// median run phase rate; with several bindings each one's ratio to the
/// first one's in the same round (then the median of those); with several
/// cluster sizes or thread counts the ratio to the same binding on the
/// first of them.
pub fn table(bindings: &[String], runs: &[Run]) -> String {
    let first = &bindings[0];
    let all = keys(runs);
    let compare = bindings.len() > 1;
    let scale = all
        .iter()
        .any(|k| (k.storage, k.bench, k.threads) != (all[0].storage, all[0].bench, all[0].threads));
    let mut s = String::from("\nrun phase, median over rounds");
    if compare {
        s += &format!("; vs {first}: ratio per round, then their median");
    }
    if scale {
        s += "; vs first: ratio to the same binding and workload on the first cluster and thread count";
    }
    s += &format!(
        ":\n{:<9} {:>7} {:>9} {:>7} {:<10} {:>12} {:>14} {:>12}",
        "workload",
        "storage",
        "benchmark",
        "threads",
        "binding",
        "ops/s",
        "/storage node",
        "/bench node"
    );
    if compare {
        s += &format!(" {:>8} {:<16}", format!("vs {first}"), "(rounds)");
    }
    if scale {
        s += "  vs first";
    }
    s += "\n";
    for k in &all {
        let base = rates(runs, k, first);
        for b in bindings {
            let mine = rates(runs, k, b);
            let Some(m) = median(mine.iter().map(|x| x.1).collect()) else {
                continue;
            };
            s += &format!(
                "{:<9} {:>7} {:>9} {:>7} {:<10} {:>12.0} {:>14.0} {:>12.0}",
                k.workload,
                k.storage,
                k.bench,
                k.threads,
                b,
                m,
                m / f64::from(k.storage),
                m / f64::from(k.bench),
            );
            if compare {
                let ratios: Vec<f64> = mine
                    .iter()
                    .filter_map(|(round, v)| base.iter().find(|x| x.0 == *round).map(|x| v / x.1))
                    .collect();
                let list: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
                s += &format!(
                    " {:>7.2}x {:<16}",
                    median(ratios).unwrap_or(f64::NAN),
                    format!("({})", list.join(", "))
                );
            }
            if scale {
                let first_k = all
                    .iter()
                    .find(|f| f.workload == k.workload)
                    .expect("k is in all");
                let m0 = median(rates(runs, first_k, b).iter().map(|x| x.1).collect());
                s += &format!(" {:>8.2}x", m0.map_or(f64::NAN, |m0| m / m0));
            }
            s += "\n";
        }
    }
    s
}

/// The operation type a workload's run phase does most.
fn main_op(r: &Report) -> Option<String> {
    r.ops
        .iter()
        .max_by_key(|(_, o)| o.ok)
        .map(|(op, _)| op.clone())
}

/// One run's values on a chart.
struct Point {
    mops: f64,
    mops_per_storage_node: f64,
    p50: f64,
    p99: f64,
}

/// Per workload run on two or more cluster sizes (x: nodes) or else on two
/// or more thread counts (x: threads per benchmark node): the run phase's
/// throughput (all nodes, and per storage node) and its main operation's
/// p50 and p99 latency, a line per binding (and thread count, against
/// nodes).
pub fn charts(bindings: &[String], runs: &[Run]) -> Vec<Chart> {
    let mut by_workload: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
    for r in runs {
        by_workload.entry(&r.workload_name).or_default().push(r);
    }
    let mut out = Vec::new();
    for (w, runs) in by_workload {
        let nodes = |r: &Run| r.storage_nodes + r.benchmark_nodes;
        let sizes: BTreeSet<u16> = runs.iter().map(|r| nodes(r)).collect();
        let threads: BTreeSet<usize> = runs.iter().map(|r| r.threads_per_node).collect();
        // The x of a run and the series it belongs to (beyond its binding).
        type Place = Box<dyn Fn(&Run) -> (f64, String)>;
        let (x, place): (XAxis, Place) = if sizes.len() >= 2 {
            let label = threads.len() >= 2;
            (
                XAxis::Count("nodes (storage + benchmark)".into()),
                Box::new(move |r: &Run| {
                    let t = if label {
                        format!(" t{}", r.threads_per_node)
                    } else {
                        String::new()
                    };
                    (f64::from(nodes(r)), t)
                }),
            )
        } else if threads.len() >= 2 {
            (
                XAxis::Count("client threads per benchmark node".into()),
                Box::new(|r: &Run| (r.threads_per_node as f64, String::new())),
            )
        } else {
            continue;
        };
        let op = runs.iter().find_map(|r| run_report(r).and_then(main_op));
        let mut tput = Vec::new();
        let mut lat = Vec::new();
        for b in bindings {
            // series -> x -> points
            let mut series: BTreeMap<String, BTreeMap<u64, Vec<Point>>> = BTreeMap::new();
            for r in runs.iter().filter(|r| &r.binding == b) {
                let Some(rep) = run_report(r) else { continue };
                let o = op.as_ref().and_then(|op| rep.ops.get(op));
                let (xv, extra) = place(r);
                series
                    .entry(format!("{b}{extra}"))
                    .or_default()
                    .entry(xv.to_bits())
                    .or_default()
                    .push(Point {
                        mops: rep.ops_per_sec / 1e6,
                        mops_per_storage_node: rep.ops_per_sec / 1e6 / f64::from(r.storage_nodes),
                        p50: o.map_or(f64::NAN, |o| o.p50_us as f64),
                        p99: o.map_or(f64::NAN, |o| o.p99_us as f64),
                    });
            }
            for (name, points) in &series {
                let line = |label: String, dashed, f: &dyn Fn(&Point) -> f64| {
                    let mut pts: Vec<(f64, f64)> = points
                        .iter()
                        .filter_map(|(xb, v)| {
                            let m = median(v.iter().map(f).filter(|x| x.is_finite()).collect())?;
                            Some((f64::from_bits(*xb), m))
                        })
                        .collect();
                    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                    Line {
                        label,
                        dashed,
                        points: pts,
                    }
                };
                tput.push(line(format!("{name} all nodes"), false, &|p| p.mops));
                if sizes.len() >= 2 {
                    tput.push(line(format!("{name} per storage node"), true, &|p| {
                        p.mops_per_storage_node
                    }));
                }
                lat.push(line(format!("{name} p50"), false, &|p| p.p50));
                lat.push(line(format!("{name} p99"), true, &|p| p.p99));
            }
        }
        out.push(Chart {
            x: x.clone(),
            stem: format!("dxkv_{w}_throughput"),
            title: format!("YCSB {w}: run phase throughput"),
            y_desc: "million operations/s".into(),
            log_y: false,
            lines: tput,
        });
        if let Some(op) = &op {
            out.push(Chart {
                x,
                stem: format!("dxkv_{w}_latency"),
                title: format!("YCSB {w}: {op} latency"),
                y_desc: "latency [µs]".into(),
                log_y: true,
                lines: lat,
            });
        }
    }
    out
}
