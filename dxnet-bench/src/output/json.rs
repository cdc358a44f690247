//! `results.json`: a JSON array with one [`Record`] per (operation, mode,
//! binding, size, threads, handlers, nodes, repetition). The schema is
//! documented in the crate README.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

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
