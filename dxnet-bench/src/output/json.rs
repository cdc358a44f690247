//! `results.json`: a JSON array with one [`Record`] per (operation, mode,
//! binding, size, threads, handlers, nodes, repetition). The schema is
//! documented in the crate README.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use std::collections::HashMap;

use crate::metrics::Record;

/// Writes `records` to `path` (pretty-printed).
pub fn write(records: &[Record], path: &Path) -> Result<PathBuf> {
    let f =
        std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?;
    serde_json::to_writer_pretty(std::io::BufWriter::new(f), records)?;
    Ok(path.to_path_buf())
}

/// Reads a results file written by [`write`] (used by `dxnet-bench plot`).
pub fn read(path: &Path) -> Result<Vec<Record>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("bad results file {}", path.display()))
}

/// Concatenates several result sets (e.g. interleaved rounds of one suite)
/// and renumbers the repetitions of every (operation, mode, binding, size,
/// threads, handlers, nodes) 0, 1, 2, ... in order.
pub fn merge(sets: Vec<Vec<Record>>) -> Vec<Record> {
    let mut next: HashMap<String, u32> = HashMap::new();
    let mut out = Vec::new();
    for mut r in sets.into_iter().flatten() {
        let key = format!(
            "{}/{}/{}/{}/{}/{}/{}",
            r.operation, r.mode, r.binding, r.size, r.threads, r.handlers, r.nodes
        );
        let n = next.entry(key).or_default();
        r.repetition = *n;
        *n += 1;
        out.push(r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Mode, Operation};

    fn rec(binding: &str, rep: u32) -> Record {
        Record {
            operation: Operation::Throughput,
            mode: Mode::Uni,
            binding: binding.into(),
            size: 64,
            threads: 1,
            handlers: 0,
            nodes: 2,
            repetition: rep,
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
        }
    }

    #[test]
    fn merge_renumbers_repetitions() {
        let m = merge(vec![
            vec![rec("a", 0), rec("b", 0)],
            vec![rec("a", 0), rec("b", 0)],
            vec![rec("a", 0)],
        ]);
        let reps: Vec<(String, u32)> = m
            .iter()
            .map(|r| (r.binding.clone(), r.repetition))
            .collect();
        assert_eq!(
            reps,
            [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2)]
                .map(|(b, r)| (b.to_string(), r))
                .to_vec()
        );
        assert_eq!(merge(vec![vec![rec("a", 5)]])[0].repetition, 0);
    }
}
