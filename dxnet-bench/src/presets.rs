//! Named configurations (`--preset`): the settings of a published
//! evaluation, so that its runs can be repeated on other hardware.
//!
//! `ibdxnet-paper` is the Ibdxnet/DXNet report's Table 2
//! (`shared/papers/ibdxnet-dxnet-long-report.txt`, §9):
//!
//! | Table 2 | dxnet setting |
//! |---|---|
//! | incoming queue 8192 buffers / 128 MB | `limits.incoming_max_buffers`, `limits.incoming_max_bytes` |
//! | IB send queue 20 per connection | `ib.sq_size` (send CQ 20 × 100) |
//! | IB shared receive queue 2000 | `ib.srq_size` (receive CQ as deep) |
//! | 100 connections | `limits.max_connections` |
//! | receive pool 4 GB | `limits.recv_pool_size`: 4 GiB, at most 1/32 of this host's memory, at least 64 MiB |
//! | flow control 16 MB, threshold 0.1 | `limits.flow_control_window`, `limits.flow_control_threshold` |
//! | receive buffers 32 KB × 4 SGEs (1 B – 16 KB messages) | `limits.recv_buffer_size`, `ib.sges_per_recv` |
//! | receive buffers 1 MB × 1 SGE (32 KB – 1 MB) | the same, for the larger sizes |
//!
//! and its runs: 10^8 messages per throughput run and 10^7 round trips per
//! latency run, halved for every doubling of the size from 4 KB, sizes
//! 1 B – 1 MB; `--scale N` divides the counts for smaller machines. Every
//! benchmark entry is split at 16 KiB into the two receive-buffer settings
//! (each its own process group). Flags given beside the preset (`--sizes`,
//! `--count`, `--dxnet ...`) override it.

use anyhow::{bail, Result};
use serde_json::{json, Map, Value};

use crate::binding::dxnet::merge;
use crate::config::{BenchConfig, Sizes};

/// A named configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// The Ibdxnet/DXNet report's Table 2 and run sizes.
    IbdxnetPaper,
}

/// Largest message of the small-message receive-buffer setting.
pub const SMALL_MAX: usize = 16 << 10;

impl Preset {
    /// Parses a preset name.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "ibdxnet-paper" => Ok(Preset::IbdxnetPaper),
            other => bail!("unknown preset {other:?} (ibdxnet-paper)"),
        }
    }

    /// Messages per throughput run and round trips per latency run, before
    /// scaling.
    pub fn counts(self) -> (u64, u64) {
        match self {
            Preset::IbdxnetPaper => (100_000_000, 10_000_000),
        }
    }

    /// Sets the counts, sizes and dxnet settings of the preset on `cfg`:
    /// call before the command line's own flags are applied.
    pub fn apply(self, cfg: &mut BenchConfig, scale: u64) -> Result<()> {
        if scale == 0 {
            bail!("--scale must be at least 1");
        }
        let (tp, lat) = self.counts();
        for e in &mut cfg.benchmarks {
            let c = if e.operation.is_latency() { lat } else { tp };
            e.count = (c / scale).max(1);
            e.warmup = None;
            e.sizes = Sizes::default();
        }
        // Halved from 4 KB on: once at 4 KiB, twice at 8 KiB, ...
        cfg.params.halve_count_from = 2 << 10;
        // perftest as the report ran it: its queue sizes.
        cfg.params.perftest = crate::config::PerftestParams {
            rx_depth: 2000,
            tx_depth: 20,
        };
        let mut dxnet = Value::Object(table2());
        merge(
            &mut dxnet,
            &Value::Object(std::mem::take(&mut cfg.params.dxnet)),
        );
        if let Value::Object(m) = dxnet {
            cfg.params.dxnet = m;
        }
        Ok(())
    }

    /// Splits every entry at [`SMALL_MAX`] into the two receive-buffer
    /// settings of the preset: call after the command line's flags. A
    /// setting the user gave (`params.dxnet`, e.g. `--dxnet
    /// limits.recv_buffer_size=...`) is kept for every size.
    pub fn split_sizes(self, cfg: &mut BenchConfig) {
        let pool = pool_bytes(mem_total());
        let user = Value::Object(cfg.params.dxnet.clone());
        let mut out = Vec::new();
        for e in cfg.benchmarks.drain(..) {
            let sizes = e.sizes.expand();
            let (small, large): (Vec<usize>, Vec<usize>) =
                sizes.into_iter().partition(|&s| s <= SMALL_MAX);
            for (part, buffer, sges) in [(small, 32usize << 10, 4u32), (large, 1 << 20, 1)] {
                if part.is_empty() {
                    continue;
                }
                let mut p = e.clone();
                p.sizes = Sizes::List(part);
                let mut overlay = Value::Object(std::mem::take(&mut p.dxnet));
                merge(
                    &mut overlay,
                    &without_set(receive_buffers(buffer, sges, pool), &user),
                );
                if let Value::Object(m) = overlay {
                    p.dxnet = m;
                }
                out.push(p);
            }
        }
        cfg.benchmarks = out;
    }
}

/// Table 2 without the receive buffers (which depend on the message size).
fn table2() -> Map<String, Value> {
    let v = json!({
        "limits": {
            "incoming_max_buffers": 8192,
            "incoming_max_bytes": 128u64 << 20,
            "max_connections": 100,
            "flow_control_window": 16u64 << 20,
            "flow_control_threshold": 0.1
        },
        "ib": {
            "sq_size": 20,
            "srq_size": 2000,
            "send_cq_size": 20 * 100,
            "recv_cq_size": 2000
        }
    });
    match v {
        Value::Object(m) => m,
        _ => unreachable!("a JSON object literal"),
    }
}

/// The receive-buffer setting of one size class, with the pool of `pool`
/// bytes.
fn receive_buffers(buffer: usize, sges: u32, pool: u64) -> Value {
    json!({
        "limits": {
            "recv_buffer_size": buffer,
            "recv_pool_size": (pool / buffer as u64).max(2 * u64::from(sges)),
        },
        "ib": {"sges_per_recv": sges}
    })
}

/// `v` without the leaves `set` has (two levels: section, field).
fn without_set(mut v: Value, set: &Value) -> Value {
    if let Value::Object(sections) = &mut v {
        for (name, fields) in sections.iter_mut() {
            if let (Value::Object(f), Some(Value::Object(given))) = (fields, set.get(name)) {
                f.retain(|k, _| !given.contains_key(k));
            }
        }
    }
    v
}

/// Table 2's 4 GB receive pool, scaled to a host of `mem` bytes: at most a
/// 32nd of its memory (several node processes may share it), at least
/// 64 MiB.
pub fn pool_bytes(mem: u64) -> u64 {
    (mem / 32).clamp(64 << 20, 4 << 30)
}

/// This host's memory in bytes (`MemTotal`), 1 GiB if unknown.
fn mem_total() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kib| kib * 1024)
        .unwrap_or(1 << 30)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BenchEntry, Operation};

    fn cfg() -> BenchConfig {
        let mut c = BenchConfig::default_suite();
        c.benchmarks = vec![
            BenchEntry::new(Operation::Throughput, 5),
            BenchEntry::new(Operation::Pingpong, 5),
        ];
        c
    }

    #[test]
    fn sets_table2_and_the_paper_counts() {
        let mut c = cfg();
        c.params
            .dxnet
            .insert("limits".into(), json!({"flow_control_window": 1234}));
        Preset::IbdxnetPaper.apply(&mut c, 100).unwrap();
        assert_eq!(c.benchmarks[0].count, 1_000_000);
        assert_eq!(c.benchmarks[1].count, 100_000);
        assert_eq!(c.params.halve_count_from, 2048);
        assert_eq!(c.scaled_count(c.benchmarks[0].count, 4096), 500_000);
        let l = &c.params.dxnet["limits"];
        // The user's own setting wins over the preset's.
        assert_eq!(l["flow_control_window"], 1234);
        assert_eq!(l["incoming_max_buffers"], 8192);
        assert_eq!(l["flow_control_threshold"], 0.1);
        assert_eq!(c.params.dxnet["ib"]["srq_size"], 2000);
        assert!(Preset::IbdxnetPaper.apply(&mut c, 0).is_err());
        assert!(Preset::parse("nope").is_err());
    }

    #[test]
    fn splits_entries_at_16_kib_into_the_two_buffer_settings() {
        let mut c = cfg();
        Preset::IbdxnetPaper.apply(&mut c, 1000).unwrap();
        Preset::IbdxnetPaper.split_sizes(&mut c);
        assert_eq!(c.benchmarks.len(), 4);
        let (small, large) = (&c.benchmarks[0], &c.benchmarks[1]);
        assert_eq!(*small.sizes.expand().last().unwrap(), 16 << 10);
        assert_eq!(large.sizes.expand()[0], 32 << 10);
        assert_eq!(small.dxnet["limits"]["recv_buffer_size"], 32 << 10);
        assert_eq!(small.dxnet["ib"]["sges_per_recv"], 4);
        assert_eq!(large.dxnet["limits"]["recv_buffer_size"], 1 << 20);
        assert_eq!(large.dxnet["ib"]["sges_per_recv"], 1);
        c.validate().unwrap();
        // A receive-buffer size the user set holds for every size.
        let mut u = cfg();
        Preset::IbdxnetPaper.apply(&mut u, 1000).unwrap();
        u.params
            .dxnet
            .insert("limits".into(), json!({"recv_buffer_size": 4096}));
        Preset::IbdxnetPaper.split_sizes(&mut u);
        for e in &u.benchmarks {
            assert!(e.dxnet["limits"].get("recv_buffer_size").is_none());
            assert!(e.dxnet["limits"].get("recv_pool_size").is_some());
        }
        // Each setting is its own process group (shared by the operations).
        let groups = c.plan().unwrap();
        let dxnet: Vec<_> = groups
            .iter()
            .filter(|g| g.key.binding == "dxnet-tcp")
            .collect();
        assert_eq!(dxnet.len(), 2);
        assert_eq!(
            dxnet[1].params(&c.params).dxnet["limits"]["recv_buffer_size"],
            1 << 20
        );
        assert_eq!(
            dxnet[1].params(&c.params).dxnet["limits"]["incoming_max_buffers"],
            8192
        );
    }

    #[test]
    fn the_pool_follows_the_host() {
        assert_eq!(pool_bytes(24 << 30), 768 << 20);
        assert_eq!(pool_bytes(1 << 30), 64 << 20);
        assert_eq!(pool_bytes(1 << 40), 4 << 30);
        assert!(mem_total() > 0);
    }
}
