//! Observatory-compatible CSV, one file per operation (`throughput.csv`,
//! ...): `Benchmark,Iteration,Size` followed by the metrics. `Benchmark`
//! names the configuration (`throughput-uni/raw-tcp/n2/t1/h0`), `Iteration`
//! is the repetition.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::config::Operation;
use crate::metrics::Record;

/// The header of every CSV file.
pub const HEADER: [&str; 28] = [
    "Benchmark",
    "Iteration",
    "Size",
    "Binding",
    "Mode",
    "Nodes",
    "Threads",
    "Handlers",
    "Count",
    "Messages",
    "Time[s]",
    "MsgsPerSec",
    "BytesPerSec",
    "LatAvg[us]",
    "LatMin[us]",
    "LatMax[us]",
    "LatP50[us]",
    "LatP95[us]",
    "LatP99[us]",
    "LatP999[us]",
    "LatP9999[us]",
    "Cpu[s]",
    "CpuPerOp[us]",
    "Rate",
    "LateMean[us]",
    "LateMax[us]",
    "WireBytes",
    "WireOverhead",
];

/// The `Benchmark` column of a record (`/r{rate}` for open-loop runs).
pub fn benchmark_name(r: &Record) -> String {
    let rate = if r.rate > 0 {
        format!("/r{}", r.rate)
    } else {
        String::new()
    };
    format!(
        "{}-{}/{}/n{}/t{}/h{}{rate}",
        r.operation, r.mode, r.binding, r.nodes, r.threads, r.handlers
    )
}

fn row(r: &Record) -> Vec<String> {
    let opt = |v: Option<f64>| v.map(|x| format!("{x:.3}")).unwrap_or_default();
    let lat = |f: fn(&crate::metrics::LatencyStats) -> f64| opt(r.lat_us.as_ref().map(f));
    vec![
        benchmark_name(r),
        r.repetition.to_string(),
        r.size.to_string(),
        r.binding.clone(),
        r.mode.to_string(),
        r.nodes.to_string(),
        r.threads.to_string(),
        r.handlers.to_string(),
        r.count.to_string(),
        r.messages.to_string(),
        format!("{:.6}", r.elapsed_s),
        format!("{:.1}", r.msgs_per_sec),
        format!("{:.1}", r.bytes_per_sec),
        lat(|l| l.avg),
        lat(|l| l.min),
        lat(|l| l.max),
        lat(|l| l.p50),
        lat(|l| l.p95),
        lat(|l| l.p99),
        lat(|l| l.p999),
        lat(|l| l.p9999),
        format!("{:.4}", r.cpu_s),
        format!("{:.4}", r.cpu_us_per_op),
        r.rate.to_string(),
        opt(r.late_us.map(|l| l.mean)),
        opt(r.late_us.map(|l| l.max)),
        r.wire_bytes.map(|w| w.to_string()).unwrap_or_default(),
        r.wire_overhead
            .map(|w| format!("{w:.4}"))
            .unwrap_or_default(),
    ]
}

/// Writes `{operation}.csv` for every operation present in `records`.
pub fn write_all(records: &[Record], dir: &Path) -> Result<Vec<PathBuf>> {
    let mut by_op: BTreeMap<Operation, Vec<&Record>> = BTreeMap::new();
    for r in records {
        by_op.entry(r.operation).or_default().push(r);
    }
    let mut files = Vec::new();
    for (op, recs) in by_op {
        let path = dir.join(format!("{op}.csv"));
        let mut w = ::csv::Writer::from_path(&path)?;
        w.write_record(HEADER)?;
        for r in recs {
            w.write_record(row(r))?;
        }
        w.flush()?;
        files.push(path);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_matches_header() {
        let r: Record = serde_json::from_str(
            r#"{"operation":"pingpong","mode":"uni","binding":"raw-tcp","size":64,"threads":1,
                "handlers":0,"nodes":2,"repetition":1,"count":10,"messages":10,"elapsed_s":0.001,
                "msgs_per_sec":10000.0,"bytes_per_sec":640000.0,
                "lat_us":{"avg":1.0,"min":0.5,"max":2.0,"p50":1.0,"p95":1.5,"p99":2.0,"p999":2.0,"p9999":2.0},
                "cpu_s":0.01,"wire_bytes":null,"wire_overhead":null}"#,
        )
        .unwrap();
        let row = row(&r);
        assert_eq!(row.len(), HEADER.len());
        assert_eq!(row[0], "pingpong-uni/raw-tcp/n2/t1/h0");
        assert_eq!(row[1], "1");
        assert_eq!(row[2], "64");
        assert_eq!(row[16], "1.000");
        assert_eq!(row[23], "0", "closed loop");
        assert_eq!(row[27], "");
    }
}
