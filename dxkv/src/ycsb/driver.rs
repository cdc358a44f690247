//! Runs a workload's load or run phase on N client threads against a
//! binding, timing every operation (hdrhistogram, microseconds).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Insert `recordcount` records.
    Load,
    /// `operationcount` operations chosen by the workload.
    Run,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Load => "load",
            Phase::Run => "run",
        })
    }
}

impl std::str::FromStr for Phase {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "load" => Ok(Phase::Load),
            "run" => Ok(Phase::Run),
            other => Err(format!("unknown phase {other:?} (load, run)")),
        }
    }
}

/// Latency and count of one operation type.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OpStats {
    /// Operations that succeeded.
    pub ok: u64,
    /// Operations that failed.
    pub errors: u64,
    /// Reads whose record was missing (load not done, or a bug).
    pub not_found: u64,
    /// Mean latency in µs.
    pub avg_us: f64,
    /// Median latency in µs.
    pub p50_us: u64,
    /// 95th percentile latency in µs.
    pub p95_us: u64,
    /// 99th percentile latency in µs.
    pub p99_us: u64,
    /// 99.9th percentile latency in µs.
    pub p999_us: u64,
    /// Largest latency in µs.
    pub max_us: u64,
}

/// The result of a phase.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// The store driven (`dxkv`, `memcached`, `redis`).
    pub binding: String,
    /// Load or run.
    pub phase: Phase,
    /// Client threads.
    pub threads: usize,
    /// Operations done.
    pub operations: u64,
    /// Wall time of the phase.
    pub seconds: f64,
    /// Operations per second.
    pub ops_per_sec: f64,
    /// Per operation type (`read`, `update`, ...).
    pub ops: BTreeMap<String, OpStats>,
    /// The first errors seen (at most 5), for the report.
    pub first_errors: Vec<String>,
    /// Per operation, the latency histogram as (µs, count) pairs, to merge
    /// the reports of several benchmark nodes ([`Report::merge`]); left out
    /// of JSON when empty.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub histograms: BTreeMap<String, Vec<(u64, u64)>>,
}

#[derive(Default)]
struct Tally {
    hist: BTreeMap<Op, (Histogram<u64>, u64, u64)>,
    errors: Vec<String>,
}

impl Tally {
    /// The histogram (µs, up to a minute), error and not-found counts of `op`.
    fn entry(&mut self, op: Op) -> &mut (Histogram<u64>, u64, u64) {
        self.hist
            .entry(op)
            .or_insert_with(|| (new_histogram(), 0, 0))
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

/// Runs `phase` of the chooser's workload with `threads` client threads on
/// `binding`. `chooser` is the run's shared state, made once for both
/// phases ([`Chooser::new`], or [`Chooser::with_share`] for one of several
/// benchmark clients: then the load inserts only its share of the
/// records). `progress` is called about every second with the operations
/// done so far.
pub fn run(
    binding: &dyn Binding,
    phase: Phase,
    threads: usize,
    chooser: &Chooser,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<Report, String> {
    let workload = chooser.workload();
    workload.validate()?;
    let threads = threads.max(1);
    let load = chooser.share().load_range(workload.recordcount);
    let total = match phase {
        Phase::Load => load.end - load.start,
        Phase::Run => workload.operationcount,
    };
    let load_start = load.start;
    let sessions = (0..threads)
        .map(|_| binding.session())
        .collect::<Result<Vec<_>, _>>()?;
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    // The phase ends when its last client thread does (not when the
    // progress thread next wakes).
    let (tallies, seconds): (Vec<Tally>, f64) = std::thread::scope(|s| {
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
                                let key = workload.key(load_start + i);
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
        let seconds = start.elapsed().as_secs_f64();
        done.store(total, Ordering::Relaxed);
        watch.join().expect("progress thread");
        (tallies, seconds)
    });
    let mut all = Tally::default();
    for t in tallies {
        all.merge(t);
    }
    let mut ops = BTreeMap::new();
    let mut histograms = BTreeMap::new();
    let mut count = 0;
    for (op, (h, errors, not_found)) in &all.hist {
        count += h.len() + errors;
        ops.insert(op.to_string(), op_stats(h, *errors, *not_found));
        histograms.insert(op.to_string(), pairs(h));
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
        histograms,
    })
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds")
}

fn op_stats(h: &Histogram<u64>, errors: u64, not_found: u64) -> OpStats {
    OpStats {
        ok: h.len(),
        errors,
        not_found,
        avg_us: h.mean(),
        p50_us: h.value_at_quantile(0.5),
        p95_us: h.value_at_quantile(0.95),
        p99_us: h.value_at_quantile(0.99),
        p999_us: h.value_at_quantile(0.999),
        max_us: h.max(),
    }
}

fn pairs(h: &Histogram<u64>) -> Vec<(u64, u64)> {
    h.iter_recorded()
        .map(|v| (v.value_iterated_to(), v.count_at_value()))
        .collect()
}

impl Report {
    /// The reports of one phase run at the same time on several benchmark
    /// nodes, as one: operations and threads add up, the phase lasts as
    /// long as the slowest node, latencies come from the merged histograms
    /// (each report must carry its [`Report::histograms`]).
    pub fn merge(reports: &[Report]) -> Result<Report, String> {
        let first = reports.first().ok_or("no reports to merge")?;
        let mut hist: BTreeMap<String, (Histogram<u64>, u64, u64)> = BTreeMap::new();
        let mut first_errors = Vec::new();
        for r in reports {
            if r.phase != first.phase || r.binding != first.binding {
                return Err("reports of different phases or bindings".into());
            }
            for (op, o) in &r.ops {
                let e = hist
                    .entry(op.clone())
                    .or_insert_with(|| (new_histogram(), 0, 0));
                let points = r.histograms.get(op).map_or(&[][..], |p| &p[..]);
                let recorded: u64 = points.iter().map(|p| p.1).sum();
                if recorded != o.ok {
                    return Err(format!(
                        "report of {op} has {recorded} latencies for {} operations",
                        o.ok
                    ));
                }
                for &(v, n) in points {
                    e.0.saturating_record_n(v.max(1), n);
                }
                e.1 += o.errors;
                e.2 += o.not_found;
            }
            first_errors.extend(r.first_errors.iter().cloned());
        }
        first_errors.truncate(5);
        let seconds = reports.iter().map(|r| r.seconds).fold(0.0, f64::max);
        let operations = reports.iter().map(|r| r.operations).sum::<u64>();
        Ok(Report {
            binding: first.binding.clone(),
            phase: first.phase,
            threads: reports.iter().map(|r| r.threads).sum(),
            operations,
            seconds,
            ops_per_sec: operations as f64 / seconds.max(1e-9),
            ops: hist
                .iter()
                .map(|(op, (h, e, nf))| (op.clone(), op_stats(h, *e, *nf)))
                .collect(),
            histograms: hist
                .iter()
                .map(|(op, (h, _, _))| (op.clone(), pairs(h)))
                .collect(),
            first_errors,
        })
    }
}

fn handles_finished(done: &AtomicU64, total: u64) -> bool {
    done.load(Ordering::Relaxed) >= total
}

fn one_op(session: &mut dyn Session, w: &Workload, c: &Chooser, rng: &mut Rng, tally: &mut Tally) {
    let op = c.op(rng);
    match op {
        Op::Insert => {
            let n = c.new_key();
            let key = w.key(c.key_number(n));
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
        let phase = self.phase;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ycsb::workload::Share;
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// A store in a map behind a lock: the driver's own logic under test,
    /// not a stand-in for a store.
    #[derive(Default)]
    struct MapBinding(Arc<Mutex<HashMap<String, Record>>>);

    struct MapSession(Arc<Mutex<HashMap<String, Record>>>);

    impl Binding for MapBinding {
        fn name(&self) -> String {
            "map".into()
        }
        fn session(&self) -> Result<Box<dyn Session>, String> {
            Ok(Box::new(MapSession(self.0.clone())))
        }
    }

    impl Session for MapSession {
        fn insert(&mut self, key: &str, record: &Record) -> Result<(), String> {
            let old = self.0.lock().unwrap().insert(key.into(), record.clone());
            match old {
                Some(_) => Err(format!("{key} inserted twice")),
                None => Ok(()),
            }
        }
        fn read(&mut self, key: &str, _: Option<&[String]>) -> Result<Option<Record>, String> {
            Ok(self.0.lock().unwrap().get(key).cloned())
        }
        fn update(&mut self, key: &str, _: &Record) -> Result<(), String> {
            match self.0.lock().unwrap().contains_key(key) {
                true => Ok(()),
                false => Err(format!("update of missing {key}")),
            }
        }
        fn scan(&mut self, _: &str, _: u32, _: Option<&[String]>) -> Result<usize, String> {
            Ok(1)
        }
    }

    /// Two clients sharing a workload load every record once between them,
    /// insert disjoint keys, read only what exists, and their merged reports
    /// count every operation with latencies from both histograms.
    #[test]
    fn two_shares_load_once_and_their_reports_merge() {
        let w = Workload {
            recordcount: 2001,
            operationcount: 3000,
            readproportion: 0.5,
            insertproportion: 0.5,
            ..Workload::default()
        };
        let store = MapBinding::default();
        let choosers: Vec<Chooser> = (0..2)
            .map(|i| Chooser::with_share(&w, Share::new(i, 2).unwrap()))
            .collect();
        let mut by_phase = [Vec::new(), Vec::new()];
        for (p, phase) in [Phase::Load, Phase::Run].into_iter().enumerate() {
            for c in &choosers {
                by_phase[p].push(run(&store, phase, 3, c, &|_, _| {}).unwrap());
            }
        }
        assert_eq!(
            store.0.lock().unwrap().len(),
            2001 + by_phase[1][0].ops["insert"].ok as usize
                + by_phase[1][1].ops["insert"].ok as usize
        );
        let load = Report::merge(&by_phase[0]).unwrap();
        assert_eq!((load.operations, load.threads), (2001, 6));
        assert_eq!(load.ops["insert"].errors, 0);
        let run = Report::merge(&by_phase[1]).unwrap();
        assert_eq!(run.operations, 6000);
        for (op, s) in &run.ops {
            assert_eq!(
                (s.errors, s.not_found),
                (0, 0),
                "{op}: {:?}",
                run.first_errors
            );
            let parts: u64 = by_phase[1].iter().map(|r| r.ops[op].ok).sum();
            assert_eq!(s.ok, parts);
            let max = by_phase[1].iter().map(|r| r.ops[op].max_us).max().unwrap();
            assert!(s.p50_us <= s.p99_us && s.p99_us <= s.max_us);
            // Histogram buckets keep 3 significant digits.
            assert!(
                s.max_us.abs_diff(max) <= max / 500 + 1,
                "{} vs {max}",
                s.max_us
            );
        }
        // Reports without histograms cannot be merged silently wrong.
        let mut bare = by_phase[1].clone();
        bare[0].histograms.clear();
        assert!(Report::merge(&bare).is_err());
        assert!(Report::merge(&[by_phase[0][0].clone(), by_phase[1][0].clone()]).is_err());
    }
}
