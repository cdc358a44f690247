//! Everything the tool writes: Observatory-style CSV per operation,
//! `results.json`, plots and the terminal summary table.

pub mod csv;
pub mod json;
pub mod plot;
pub mod table;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::metrics::Record;

/// Writes CSV, JSON, the summary table (`summary.txt`) and, unless
/// `plots` is false, the plots into `dir`. Returns the files written.
pub fn write_all(records: &[Record], dir: &Path, plots: bool) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut files = csv::write_all(records, dir)?;
    files.push(json::write(records, &dir.join("results.json"))?);
    let summary = dir.join("summary.txt");
    std::fs::write(&summary, table::render(records))?;
    files.push(summary);
    if plots {
        files.extend(plot::write_all(records, dir)?);
    }
    Ok(files)
}
