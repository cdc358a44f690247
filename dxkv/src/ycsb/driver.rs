//! Runs a workload's load or run phase on N client threads against a
//! binding, timing every operation (hdrhistogram, microseconds).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::SeedableRng;
use serde::Serialize;

use super::generator::Rng;
use super::workload::{Chooser, Op, Workload};
use crate::record::Record;

/// One client thread's connection to the store under test.
pub trait Session: Send {
    /// Stores `record` under `key` (load phase and inserts).
    fn insert(&mut self, key: &str, record: &Record) -> Result<(), String>;
    /// The record under `key` (only `fields` if given); `None` if missing.
    fn read(&mut self, key: &str, fields: Option<&[String]>) -> Result<Option<Record>, String>;
    /// Writes `fields` into the record under `key`.
    fn update(&mut self, key: &str, fields: &Record) -> Result<(), String>;
    /// Up to `count` records from `start` on; returns how many.
    fn scan(&mut self, start: &str, count: u32, fields: Option<&[String]>)
        -> Result<usize, String>;
}

/// A store under test: makes one session per client thread.
pub trait Binding: Sync {
    /// The binding's name in reports.
    fn name(&self) -> String;
    /// A session for one client thread.
    fn session(&self) -> Result<Box<dyn Session>, String>;
}

/// A phase of a YCSB run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Insert `recordcount` records.
    Load,
    /// `operationcount` operations chosen by the workload.
    Run,
}

/// Latency and count of one operation type.
#[derive(Debug, Clone, Serialize)]
pub struct OpStats {
    pub ok: u64,
    pub errors: u64,
    /// Reads whose record was missing (load not done, or a bug).
    pub not_found: u64,
    pub avg_us: f64,
    pub p50_us: u64,
    pub p95_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
}

/// The result of a phase.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub binding: String,
    pub phase: Phase,
    pub threads: usize,
    pub operations: u64,
    pub seconds: f64,
    pub ops_per_sec: f64,
    pub ops: BTreeMap<String, OpStats>,
    /// The first errors seen (at most 5), for the report.
    pub first_errors: Vec<String>,
}

#[derive(Default)]
struct Tally {
    hist: BTreeMap<Op, (Histogram<u64>, u64, u64)>,
    errors: Vec<String>,
}

impl Tally {
    /// The histogram (µs, up to a minute), error and not-found counts of `op`.
    fn entry(&mut self, op: Op) -> &mut (Histogram<u64>, u64, u64) {
        self.hist.entry(op).or_insert_with(|| {
            (
                Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds"),
                0,
                0,
            )
        })
    }

    fn record(&mut self, op: Op, took: Duration, r: Result<bool, String>) {
        let e = self.entry(op);
        match r {
            Ok(found) => {
                e.0.saturating_record(took.as_micros().max(1) as u64);
                if !found {
                    e.2 += 1;
                }
            }
            Err(msg) => {
                e.1 += 1;
                if self.errors.len() < 5 {
                    self.errors.push(format!("{op}: {msg}"));
                }
            }
        }
    }

    fn merge(&mut self, other: Tally) {
        for (op, (h, err, nf)) in other.hist {
            let e = self.entry(op);
            e.0.add(&h).expect("same bounds");
            e.1 += err;
            e.2 += nf;
        }
        for m in other.errors {
            if self.errors.len() < 5 {
                self.errors.push(m);
            }
        }
    }
}

/// Runs `phase` of `workload` with `threads` client threads on `binding`.
/// `chooser` is the run's shared state (make one with [`Chooser::new`]
/// after the load; the load makes its own). `progress` is called about
/// every second with the operations done so far.
pub fn run(
    binding: &dyn Binding,
    workload: &Workload,
    phase: Phase,
    threads: usize,
    chooser: Option<&Chooser>,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<Report, String> {
    workload.validate()?;
    let threads = threads.max(1);
    let own;
    let chooser = match chooser {
        Some(c) => c,
        None => {
            own = Chooser::new(workload);
            &own
        }
    };
    let total = match phase {
        Phase::Load => workload.recordcount,
        Phase::Run => workload.operationcount,
    };
    let sessions = (0..threads)
        .map(|_| binding.session())
        .collect::<Result<Vec<_>, _>>()?;
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tallies: Vec<Tally> = std::thread::scope(|s| {
        let handles: Vec<_> = sessions
            .into_iter()
            .enumerate()
            .map(|(t, mut session)| {
                let done = done.clone();
                // Thread t does operations [lo, hi) of the phase.
                let lo = total * t as u64 / threads as u64;
                let hi = total * (t as u64 + 1) / threads as u64;
                s.spawn(move || {
                    let mut rng = Rng::seed_from_u64(0x5EED ^ (t as u64) << 32 ^ phase as u64);
                    let mut tally = Tally::default();
                    for i in lo..hi {
                        match phase {
                            Phase::Load => {
                                let key = workload.key(i);
                                let rec = workload.record(&key);
                                let t0 = Instant::now();
                                let r = session.insert(&key, &rec).map(|_| true);
                                tally.record(Op::Insert, t0.elapsed(), r);
                            }
                            Phase::Run => {
                                one_op(&mut *session, workload, chooser, &mut rng, &mut tally)
                            }
                        }
                        if i % 256 == 0 {
                            done.fetch_add(256.min(hi - i), Ordering::Relaxed);
                        }
                    }
                    tally
                })
            })
            .collect();
        let watcher_done = done.clone();
        let watch = s.spawn(move || {
            let mut last = Instant::now();
            while watcher_done.load(Ordering::Relaxed) < total {
                std::thread::sleep(Duration::from_millis(100));
                if handles_finished(&watcher_done, total) {
                    break;
                }
                if last.elapsed() >= Duration::from_secs(1) {
                    progress(watcher_done.load(Ordering::Relaxed), total);
                    last = Instant::now();
                }
            }
        });
        let tallies = handles
            .into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect();
        done.store(total, Ordering::Relaxed);
        watch.join().expect("progress thread");
        tallies
    });
    let seconds = start.elapsed().as_secs_f64();
    let mut all = Tally::default();
    for t in tallies {
        all.merge(t);
    }
    let mut ops = BTreeMap::new();
    let mut count = 0;
    for (op, (h, errors, not_found)) in &all.hist {
        count += h.len() + errors;
        ops.insert(
            op.to_string(),
            OpStats {
                ok: h.len(),
                errors: *errors,
                not_found: *not_found,
                avg_us: h.mean(),
                p50_us: h.value_at_quantile(0.5),
                p95_us: h.value_at_quantile(0.95),
                p99_us: h.value_at_quantile(0.99),
                p999_us: h.value_at_quantile(0.999),
                max_us: h.max(),
            },
        );
    }
    Ok(Report {
        binding: binding.name(),
        phase,
        threads,
        operations: count,
        seconds,
        ops_per_sec: count as f64 / seconds,
        ops,
        first_errors: all.errors,
    })
}

fn handles_finished(done: &AtomicU64, total: u64) -> bool {
    done.load(Ordering::Relaxed) >= total
}

fn one_op(session: &mut dyn Session, w: &Workload, c: &Chooser, rng: &mut Rng, tally: &mut Tally) {
    let op = c.op(rng);
    match op {
        Op::Insert => {
            let n = c.new_key();
            let key = w.key(n);
            let rec = w.record(&key);
            let t0 = Instant::now();
            let r = session.insert(&key, &rec).map(|_| true);
            tally.record(op, t0.elapsed(), r);
            c.inserted(n);
        }
        Op::Read => {
            let key = w.key(c.existing_key(rng));
            let fields = w.read_fields(rng);
            let t0 = Instant::now();
            let r = session.read(&key, fields.as_deref()).map(|r| r.is_some());
            tally.record(op, t0.elapsed(), r);
        }
        Op::Update => {
            let key = w.key(c.existing_key(rng));
            let fields = w.update_fields(&key, rng);
            let t0 = Instant::now();
            let r = session.update(&key, &fields).map(|_| true);
            tally.record(op, t0.elapsed(), r);
        }
        Op::Scan => {
            let key = w.key(c.existing_key(rng));
            let len = c.scan_length(rng);
            let fields = w.read_fields(rng);
            let t0 = Instant::now();
            let r = session.scan(&key, len, fields.as_deref()).map(|n| n > 0);
            tally.record(op, t0.elapsed(), r);
        }
        Op::ReadModifyWrite => {
            // As YCSB: a read, then an update of the same key (not atomic),
            // timed together.
            let key = w.key(c.existing_key(rng));
            let fields = w.read_fields(rng);
            let update = w.update_fields(&key, rng);
            let t0 = Instant::now();
            let r = session
                .read(&key, fields.as_deref())
                .and_then(|found| session.update(&key, &update).map(|_| found.is_some()));
            tally.record(op, t0.elapsed(), r);
        }
    }
}

/// The header of [`Report::csv_rows`].
pub const CSV_HEADER: &str =
    "binding,phase,threads,operation,ok,errors,not_found,phase_ops_per_sec,avg_us,p50_us,p95_us,p99_us,p999_us,max_us";

impl Report {
    /// One CSV line per operation type (columns as [`CSV_HEADER`]).
    pub fn csv_rows(&self) -> String {
        let phase = match self.phase {
            Phase::Load => "load",
            Phase::Run => "run",
        };
        let mut s = String::new();
        for (op, o) in &self.ops {
            s += &format!(
                "{},{phase},{},{op},{},{},{},{:.1},{:.1},{},{},{},{},{}\n",
                self.binding,
                self.threads,
                o.ok,
                o.errors,
                o.not_found,
                self.ops_per_sec,
                o.avg_us,
                o.p50_us,
                o.p95_us,
                o.p99_us,
                o.p999_us,
                o.max_us
            );
        }
        s
    }

    /// The report as a table (one row per operation type).
    pub fn table(&self) -> String {
        let mut s = format!(
            "{} {:?}: {} ops in {:.2} s = {:.0} ops/s with {} threads\n",
            self.binding, self.phase, self.operations, self.seconds, self.ops_per_sec, self.threads
        );
        s += &format!(
            "{:<18} {:>10} {:>7} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9}\n",
            "operation", "ok", "errors", "missing", "avg µs", "p50", "p95", "p99", "p99.9", "max"
        );
        for (op, o) in &self.ops {
            s += &format!(
                "{:<18} {:>10} {:>7} {:>9} {:>9.1} {:>8} {:>8} {:>8} {:>8} {:>9}\n",
                op,
                o.ok,
                o.errors,
                o.not_found,
                o.avg_us,
                o.p50_us,
                o.p95_us,
                o.p99_us,
                o.p999_us,
                o.max_us
            );
        }
        for e in &self.first_errors {
            s += &format!("  error: {e}\n");
        }
        s
    }
}
