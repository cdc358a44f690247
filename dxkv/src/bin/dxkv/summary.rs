//! The summary table and the plots of `dxkv local`: the run phase's
//! throughput per workload, cluster and binding, as medians over rounds,
//! and each binding's ratio to the first one's from the same round.

use std::collections::BTreeMap;

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

/// (workload, storage nodes, benchmark nodes) in the order first run.
fn clusters(runs: &[Run]) -> Vec<(String, u16, u16)> {
    let mut out: Vec<(String, u16, u16)> = Vec::new();
    for r in runs {
        let k = (r.workload_name.clone(), r.storage_nodes, r.benchmark_nodes);
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

/// The run phase's operations per second of `binding` on a cluster, by
/// round.
fn rates(runs: &[Run], c: &(String, u16, u16), binding: &str) -> Vec<(usize, f64)> {
    runs.iter()
        .filter(|r| {
            r.binding == binding
                && r.workload_name == c.0
                && r.storage_nodes == c.1
                && r.benchmark_nodes == c.2
        })
        .filter_map(|r| run_report(r).map(|rep| (r.round, rep.ops_per_sec)))
        .collect()
}

/// The summary table: per workload, cluster and binding the median run
/// phase rate; with several bindings each one's ratio to the first one's
/// in the same round (then the median of those); with several cluster
/// sizes the ratio to the same binding on the first size.
pub fn table(bindings: &[String], runs: &[Run]) -> String {
    let first = &bindings[0];
    let all = clusters(runs);
    let compare = bindings.len() > 1;
    let scale = all.iter().any(|c| (c.1, c.2) != (all[0].1, all[0].2));
    let mut s = String::from("\nrun phase, median over rounds");
    if compare {
        s += &format!("; vs {first}: ratio per round, then their median");
    }
    if scale {
        s += "; vs first size: ratio to the same binding on the first cluster";
    }
    s += &format!(
        ":\n{:<9} {:>7} {:>9} {:<10} {:>12} {:>14} {:>12}",
        "workload", "storage", "benchmark", "binding", "ops/s", "/storage node", "/bench node"
    );
    if compare {
        s += &format!(" {:>8} {:<16}", format!("vs {first}"), "(rounds)");
    }
    if scale {
        s += " vs first size";
    }
    s += "\n";
    for c in &all {
        let base = rates(runs, c, first);
        for b in bindings {
            let mine = rates(runs, c, b);
            let Some(m) = median(mine.iter().map(|x| x.1).collect()) else {
                continue;
            };
            s += &format!(
                "{:<9} {:>7} {:>9} {:<10} {:>12.0} {:>14.0} {:>12.0}",
                c.0,
                c.1,
                c.2,
                b,
                m,
                m / f64::from(c.1),
                m / f64::from(c.2),
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
                let smallest = all.iter().find(|f| f.0 == c.0).expect("c is in all");
                let m0 = median(rates(runs, smallest, b).iter().map(|x| x.1).collect());
                s += &format!(" {:>12.2}x", m0.map_or(f64::NAN, |m0| m / m0));
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

/// Per workload run on two or more cluster sizes: the run phase's
/// throughput (all nodes, and per storage node) and its main operation's
/// p50 and p99 latency against the number of nodes, a line per binding.
pub fn charts(bindings: &[String], runs: &[Run]) -> Vec<Chart> {
    let mut by_workload: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
    for r in runs {
        by_workload.entry(&r.workload_name).or_default().push(r);
    }
    let x = XAxis::Count("nodes (storage + benchmark)".into());
    let mut out = Vec::new();
    for (w, runs) in by_workload {
        let sizes: std::collections::BTreeSet<u16> = runs
            .iter()
            .map(|r| r.storage_nodes + r.benchmark_nodes)
            .collect();
        if sizes.len() < 2 {
            continue;
        }
        let op = runs.iter().find_map(|r| run_report(r).and_then(main_op));
        let mut tput = Vec::new();
        let mut lat = Vec::new();
        for b in bindings {
            let mut points: BTreeMap<u16, Vec<Point>> = BTreeMap::new();
            for r in runs.iter().filter(|r| &r.binding == b) {
                let Some(rep) = run_report(r) else { continue };
                let o = op.as_ref().and_then(|op| rep.ops.get(op));
                points
                    .entry(r.storage_nodes + r.benchmark_nodes)
                    .or_default()
                    .push(Point {
                        mops: rep.ops_per_sec / 1e6,
                        mops_per_storage_node: rep.ops_per_sec / 1e6 / f64::from(r.storage_nodes),
                        p50: o.map_or(f64::NAN, |o| o.p50_us as f64),
                        p99: o.map_or(f64::NAN, |o| o.p99_us as f64),
                    });
            }
            let line = |label: String, dashed, f: &dyn Fn(&Point) -> f64| Line {
                label,
                dashed,
                points: points
                    .iter()
                    .filter_map(|(n, v)| {
                        let m = median(v.iter().map(f).filter(|x| x.is_finite()).collect())?;
                        Some((f64::from(*n), m))
                    })
                    .collect(),
            };
            tput.push(line(format!("{b} all nodes"), false, &|p| p.mops));
            tput.push(line(format!("{b} per storage node"), true, &|p| {
                p.mops_per_storage_node
            }));
            lat.push(line(format!("{b} p50"), false, &|p| p.p50));
            lat.push(line(format!("{b} p99"), true, &|p| p.p99));
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
                x: x.clone(),
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
