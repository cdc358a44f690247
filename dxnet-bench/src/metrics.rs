//! Measurements and their aggregation: latency histograms (HDR), CPU time,
//! wire byte counters, per-node results and the per-run [`Record`].

use std::collections::BTreeMap;
use std::net::IpAddr;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::binding::WireSource;
use crate::config::{GroupKey, Operation, RunSpec};

/// Highest latency the histograms track (60 s in ns); larger values saturate.
const HIST_MAX_NS: u64 = 60_000_000_000;

/// A latency histogram in nanoseconds, 3 significant digits.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_NS, 3).expect("valid histogram bounds")
}

/// Records `ns` (clamped into the histogram's range).
pub fn record_ns(h: &mut Histogram<u64>, ns: u64) {
    h.saturating_record(ns.clamp(1, HIST_MAX_NS));
}

/// A histogram in transit between processes: (bucket value, count) pairs of
/// the non-empty buckets. Lossless at the histogram's own precision.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistData(pub Vec<(u64, u64)>);

impl HistData {
    /// Captures `h`.
    pub fn from_hist(h: &Histogram<u64>) -> Self {
        HistData(
            h.iter_recorded()
                .map(|v| (v.value_iterated_to(), v.count_at_value()))
                .collect(),
        )
    }

    /// Adds the captured counts into `h`.
    pub fn add_to(&self, h: &mut Histogram<u64>) {
        for &(v, c) in &self.0 {
            let _ = h.record_n(v.clamp(1, HIST_MAX_NS), c);
        }
    }
}

/// Latency summary in microseconds (the `lat_us` object of results.json).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LatencyStats {
    /// Mean.
    pub avg: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// 99.99th percentile.
    pub p9999: f64,
}

impl LatencyStats {
    /// Summarizes a nanosecond histogram; `None` when it is empty.
    pub fn from_hist(h: &Histogram<u64>) -> Option<Self> {
        if h.is_empty() {
            return None;
        }
        let us = |ns: u64| ns as f64 / 1000.0;
        Some(LatencyStats {
            avg: h.mean() / 1000.0,
            min: us(h.min()),
            max: us(h.max()),
            p50: us(h.value_at_quantile(0.50)),
            p95: us(h.value_at_quantile(0.95)),
            p99: us(h.value_at_quantile(0.99)),
            p999: us(h.value_at_quantile(0.999)),
            p9999: us(h.value_at_quantile(0.9999)),
        })
    }

    /// The value of percentile `name` (`p50`, `p99`, `avg`, ...).
    pub fn get(&self, name: &str) -> Option<f64> {
        Some(match name {
            "avg" => self.avg,
            "min" => self.min,
            "max" => self.max,
            "p50" => self.p50,
            "p95" => self.p95,
            "p99" => self.p99,
            "p999" => self.p999,
            "p9999" => self.p9999,
            _ => return None,
        })
    }
}

/// Minimum, median and maximum of a set of repetitions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Smallest.
    pub min: f64,
    /// Median (mean of the middle two for an even count).
    pub median: f64,
    /// Largest.
    pub max: f64,
}

/// Min/median/max of `values`; `None` when empty. NaNs are ignored.
pub fn summarize(values: &[f64]) -> Option<Summary> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Some(Summary {
        min: v[0],
        median,
        max: v[n - 1],
    })
}

/// User + system CPU seconds of this process so far (all threads).
pub fn process_cpu_s() -> f64 {
    // SAFETY: getrusage only writes into the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    if rc != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// The current value of a wire byte counter, `None` if unreadable.
pub fn read_wire(src: &WireSource) -> Option<u64> {
    match src {
        WireSource::NetIface(name) => {
            read_u64(&format!("/sys/class/net/{name}/statistics/tx_bytes"))
        }
        // port_xmit_data counts 4-byte words.
        WireSource::IbPort { device, port } => read_u64(&format!(
            "/sys/class/infiniband/{device}/ports/{port}/counters/port_xmit_data"
        ))
        .map(|w| w * 4),
    }
}

fn read_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Identifies a counter across processes: two nodes in the same network
/// namespace on the same host read the same `lo` counter, which must be
/// counted once.
pub fn wire_key(src: &WireSource) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let ns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    match src {
        WireSource::NetIface(n) => format!("{host}/{ns}/{n}"),
        WireSource::IbPort { device, port } => format!("{host}/ib/{device}/{port}"),
    }
}

/// The network interface that carries `ip` on this host.
pub fn iface_of(ip: IpAddr) -> Option<String> {
    if ip.is_loopback() {
        return Some("lo".into());
    }
    let mut found = None;
    // SAFETY: the list returned by getifaddrs is only read, then freed once.
    unsafe {
        let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut head) != 0 {
            return None;
        }
        let mut cur = head;
        while !cur.is_null() {
            let ifa = &*cur;
            if !ifa.ifa_addr.is_null() {
                let fam = (*ifa.ifa_addr).sa_family as i32;
                let addr = if fam == libc::AF_INET {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    Some(IpAddr::from(
                        u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
                    ))
                } else if fam == libc::AF_INET6 {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    Some(IpAddr::from(sin6.sin6_addr.s6_addr))
                } else {
                    None
                };
                if addr == Some(ip) {
                    found = Some(
                        std::ffi::CStr::from_ptr(ifa.ifa_name)
                            .to_string_lossy()
                            .into_owned(),
                    );
                    break;
                }
            }
            cur = ifa.ifa_next;
        }
        libc::freeifaddrs(head);
    }
    found
}

/// What one logical node measured in one phase.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeResult {
    /// Node id.
    pub id: u16,
    /// Messages sent (or requests completed).
    pub sent: u64,
    /// Messages received.
    pub received: u64,
    /// Payload bytes received.
    pub recv_bytes: u64,
    /// Round trips completed (latency and pingpong initiators).
    pub round_trips: u64,
    /// Seconds from the start signal to the node's last send or receive;
    /// 0 for a node with nothing to do.
    pub elapsed_s: f64,
    /// Latency histogram (ns) of initiators.
    pub hist: Option<HistData>,
    /// The binding's own statistics of the node's connections after the
    /// phase (dxnet: `Node::connection_stats`), if it has any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connections: Option<serde_json::Value>,
    /// The binding's per-stage latency of the phase's requests (dxnet
    /// with `--breakdown`: `Node::latency_breakdown`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breakdown: Option<dxnet::breakdown::LatencyBreakdown>,
    /// Open-loop runs: operations issued on a schedule, the sum and the
    /// largest of their delays after it (ns; see [`crate::ops::Pace`]).
    #[serde(default)]
    pub paced: u64,
    /// See `paced`.
    #[serde(default)]
    pub late_ns_sum: u64,
    /// See `paced`.
    #[serde(default)]
    pub late_ns_max: u64,
}

/// A wire counter's increase during a phase.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireDelta {
    /// See [`wire_key`].
    pub key: String,
    /// Bytes.
    pub bytes: u64,
}

/// What one node process measured in one phase.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcResult {
    /// Its logical nodes.
    pub nodes: Vec<NodeResult>,
    /// CPU seconds (user + sys) the process used during the phase.
    pub cpu_s: f64,
    /// Wire counter increases.
    pub wire: Vec<WireDelta>,
}

/// One line of results.json: one (operation, mode, binding, size, threads,
/// handlers, nodes, repetition).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// `throughput`, `latency`, `pingpong` or `all_to_all`.
    pub operation: Operation,
    /// `uni` or `bi`.
    pub mode: crate::config::Mode,
    /// Binding name.
    pub binding: String,
    /// Payload bytes per message.
    pub size: usize,
    /// Sender threads per node.
    pub threads: usize,
    /// Message-handler threads per node (0: not applicable).
    pub handlers: usize,
    /// Nodes in the run.
    pub nodes: usize,
    /// Repetition index, from 0.
    pub repetition: u32,
    /// Messages (or round trips) per sending node.
    pub count: u64,
    /// Messages received in total (throughput) or round trips (latency).
    pub messages: u64,
    /// Seconds of the measured phase (slowest node).
    pub elapsed_s: f64,
    /// Messages (round trips for latency/pingpong) per second.
    pub msgs_per_sec: f64,
    /// Payload bytes per second (one direction's payload for round trips).
    pub bytes_per_sec: f64,
    /// Latency in µs; one-way (RTT/2) for `latency`, RTT for `pingpong`.
    pub lat_us: Option<LatencyStats>,
    /// CPU seconds (user + sys) of all node processes during the phase.
    pub cpu_s: f64,
    /// Per node process, its CPU seconds during the phase.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub proc_cpu_s: Vec<f64>,
    /// CPU microseconds of all node processes per message (round trip).
    #[serde(default)]
    pub cpu_us_per_op: f64,
    /// Requested open-loop rate per sending node (messages or round trips
    /// per second); 0: closed loop.
    #[serde(default)]
    pub rate: u64,
    /// Open-loop runs: mean and largest delay of an operation after its
    /// scheduled time (µs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub late_us: Option<Lateness>,
    /// Bytes counted on the wire, when known.
    pub wire_bytes: Option<u64>,
    /// Wire bytes / payload bytes, when known.
    pub wire_overhead: Option<f64>,
    /// Per node, the binding's statistics of its connections after the
    /// repetition (dxnet: `Node::connection_stats`, counted since each
    /// connection opened; messages and bytes each way with
    /// `--dxnet metrics.per_connection=true`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub connections: Vec<serde_json::Value>,
    /// Where the round trips went (`--breakdown`, dxnet requests): every
    /// node's stages merged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breakdown: Option<BreakdownSummary>,
}

/// How late an open-loop run issued its operations (µs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Lateness {
    /// Mean delay after the scheduled time.
    pub mean: f64,
    /// Largest delay.
    pub max: f64,
}

/// One stage of a [`BreakdownSummary`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageSummary {
    /// The stage (see `dxnet::breakdown`), or `transport`.
    pub stage: String,
    /// Requests it was recorded for.
    pub count: u64,
    /// Mean in µs (exact).
    pub mean_us: f64,
    /// Median in µs (within its histogram bucket, 1/8 wide; none for
    /// `transport`, known as a mean only).
    pub p50_us: Option<f64>,
    /// 99th percentile in µs (likewise).
    pub p99_us: Option<f64>,
}

/// The round trips of a phase split into stages, from the merged
/// histograms of its nodes: the requesters' `send`, `post`, `awaiting`,
/// `response_receive`, `wake` (which add up to `round_trip`), the
/// responders' `request_queue`, `handler`, `response_send`,
/// `response_post`, and
/// `transport`: the mean of `awaiting` less the responders' stages (both
/// engines and the wire, both ways; a mean only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BreakdownSummary {
    /// Stages in path order, `transport` after `awaiting`.
    pub stages: Vec<StageSummary>,
}

impl BreakdownSummary {
    /// Summarizes the merged breakdown of a phase's nodes; `None` when it
    /// holds no round trip.
    pub fn from_merged(b: &dxnet::breakdown::LatencyBreakdown) -> Option<Self> {
        if b.round_trip.count() == 0 {
            return None;
        }
        let us = |ns: f64| ns / 1000.0;
        let mut stages = Vec::new();
        for (name, h) in b.stages() {
            stages.push(StageSummary {
                stage: name.to_string(),
                count: h.count(),
                mean_us: us(h.mean_ns()),
                p50_us: Some(us(h.quantile_ns(0.5) as f64)),
                p99_us: Some(us(h.quantile_ns(0.99) as f64)),
            });
            if name == "awaiting" {
                stages.push(StageSummary {
                    stage: "transport".into(),
                    count: h.count(),
                    mean_us: us(dxnet::breakdown::LatencyBreakdown::transport_ns(b, b)),
                    p50_us: None,
                    p99_us: None,
                });
            }
        }
        Some(Self { stages })
    }

    /// The stage named `name`.
    pub fn stage(&self, name: &str) -> Option<&StageSummary> {
        self.stages.iter().find(|s| s.stage == name)
    }
}

/// Combines what every process measured in one repetition into a record.
pub fn aggregate(key: &GroupKey, run: &RunSpec, repetition: u32, procs: &[ProcResult]) -> Record {
    let nodes: Vec<&NodeResult> = procs.iter().flat_map(|p| &p.nodes).collect();
    let elapsed = nodes.iter().map(|n| n.elapsed_s).fold(0.0, f64::max);
    let cpu_s: f64 = procs.iter().map(|p| p.cpu_s).sum();
    let (messages, payload_bytes, lat_us) = if run.operation.is_latency() {
        let mut h = new_histogram();
        for n in &nodes {
            if let Some(d) = &n.hist {
                d.add_to(&mut h);
            }
        }
        let rt: u64 = nodes.iter().map(|n| n.round_trips).sum();
        let ways = if run.operation.is_one_sided() { 1 } else { 2 };
        (rt, ways * rt * run.size as u64, LatencyStats::from_hist(&h))
    } else if run.operation.is_one_sided() {
        // Nothing arrives at a sink: the initiators count their accesses.
        let m: u64 = nodes.iter().map(|n| n.sent).sum();
        (m, m * run.size as u64, None)
    } else {
        let m: u64 = nodes.iter().map(|n| n.received).sum();
        let b: u64 = nodes.iter().map(|n| n.recv_bytes).sum();
        (m, b, None)
    };
    // The same counter seen by several processes (e.g. `lo`) counts once.
    let mut wire: BTreeMap<&str, u64> = BTreeMap::new();
    for d in procs.iter().flat_map(|p| &p.wire) {
        let e = wire.entry(d.key.as_str()).or_default();
        *e = (*e).max(d.bytes);
    }
    let wire_bytes = (!wire.is_empty()).then(|| wire.values().sum::<u64>());
    let wire_overhead = wire_bytes
        .filter(|_| payload_bytes > 0)
        .map(|w| w as f64 / payload_bytes as f64);
    let rate = |x: f64| if elapsed > 0.0 { x / elapsed } else { 0.0 };
    let msgs_per_sec = rate(messages as f64);
    let bytes_per_sec = if run.operation.is_latency() {
        msgs_per_sec * run.size as f64
    } else {
        rate(payload_bytes as f64)
    };
    let paced: u64 = nodes.iter().map(|n| n.paced).sum();
    let late_us = (paced > 0).then(|| Lateness {
        mean: nodes.iter().map(|n| n.late_ns_sum).sum::<u64>() as f64 / paced as f64 / 1e3,
        max: nodes.iter().map(|n| n.late_ns_max).max().unwrap_or(0) as f64 / 1e3,
    });
    Record {
        proc_cpu_s: procs.iter().map(|p| p.cpu_s).collect(),
        cpu_us_per_op: if messages > 0 {
            cpu_s * 1e6 / messages as f64
        } else {
            0.0
        },
        rate: run.rate,
        late_us,
        operation: run.operation,
        mode: run.mode,
        binding: key.binding.clone(),
        size: run.size,
        threads: key.threads,
        handlers: key.handlers,
        nodes: key.nodes,
        repetition,
        count: run.count,
        messages,
        elapsed_s: elapsed,
        msgs_per_sec,
        bytes_per_sec,
        lat_us,
        cpu_s,
        wire_bytes,
        wire_overhead,
        connections: nodes.iter().filter_map(|n| n.connections.clone()).collect(),
        breakdown: merged_breakdown(&nodes),
    }
}

/// Every node's breakdown merged and summarized (a phase's requests are
/// all served by nodes of the same phase).
fn merged_breakdown(nodes: &[&NodeResult]) -> Option<BreakdownSummary> {
    let mut all = nodes.iter().filter_map(|n| n.breakdown.as_ref()).peekable();
    all.peek()?;
    let mut merged = dxnet::breakdown::LatencyBreakdown::default();
    for b in all {
        merged.merge(b);
    }
    BreakdownSummary::from_merged(&merged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Mode;

    #[test]
    fn percentiles_of_uniform_distribution() {
        let mut h = new_histogram();
        for us in 1..=10_000u64 {
            record_ns(&mut h, us * 1000);
        }
        let s = LatencyStats::from_hist(&h).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() / b < 0.002;
        assert!(close(s.p50, 5000.0), "{s:?}");
        assert!(close(s.p95, 9500.0), "{s:?}");
        assert!(close(s.p99, 9900.0), "{s:?}");
        assert!(close(s.p999, 9990.0), "{s:?}");
        assert!(close(s.p9999, 9999.0), "{s:?}");
        assert!(close(s.min, 1.0) && close(s.max, 10_000.0), "{s:?}");
        assert!(close(s.avg, 5000.5), "{s:?}");
        assert!(s.p50 <= s.p95 && s.p95 <= s.p99 && s.p99 <= s.p999 && s.p999 <= s.p9999);
    }

    #[test]
    fn percentiles_of_skewed_distribution() {
        // 99 fast samples and 1 slow one: the tail shows from p99.9 on.
        let mut h = new_histogram();
        for _ in 0..990 {
            record_ns(&mut h, 10_000);
        }
        for _ in 0..10 {
            record_ns(&mut h, 1_000_000);
        }
        let s = LatencyStats::from_hist(&h).unwrap();
        assert!((s.p50 - 10.0).abs() < 0.05);
        assert!((s.p99 - 10.0).abs() < 0.05, "{s:?}");
        assert!((s.p999 - 1000.0).abs() < 1.0, "{s:?}");
        assert!((s.avg - (0.99 * 10.0 + 0.01 * 1000.0)).abs() < 0.1);
        assert!(LatencyStats::from_hist(&new_histogram()).is_none());
    }

    #[test]
    fn histogram_survives_transport() {
        let mut a = new_histogram();
        for v in [1u64, 7, 1_000, 123_456, 9_999_999_999] {
            record_ns(&mut a, v);
        }
        let data: HistData =
            serde_json::from_str(&serde_json::to_string(&HistData::from_hist(&a)).unwrap())
                .unwrap();
        let mut b = new_histogram();
        data.add_to(&mut b);
        assert_eq!(a.len(), b.len());
        for q in [0.0, 0.25, 0.5, 0.9, 1.0] {
            assert_eq!(a.value_at_quantile(q), b.value_at_quantile(q));
        }
        data.add_to(&mut b);
        assert_eq!(b.len(), 2 * a.len());
    }

    #[test]
    fn summary_min_median_max() {
        let s = summarize(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.min, s.median, s.max), (1.0, 2.0, 3.0));
        let s = summarize(&[4.0, 1.0, 2.0, 3.0]).unwrap();
        assert_eq!(s.median, 2.5);
        assert!(summarize(&[]).is_none());
        assert_eq!(summarize(&[f64::NAN, 5.0]).unwrap().median, 5.0);
    }

    fn key() -> GroupKey {
        GroupKey {
            binding: "raw-tcp".into(),
            nodes: 2,
            threads: 1,
            handlers: 0,
        }
    }

    fn run(op: Operation, size: usize) -> RunSpec {
        RunSpec {
            operation: op,
            mode: Mode::Uni,
            size,
            count: 1000,
            warmup: 0,
            repetitions: 1,
            rate: 0,
        }
    }

    #[test]
    fn aggregates_throughput() {
        let procs = vec![
            ProcResult {
                nodes: vec![NodeResult {
                    id: 0,
                    sent: 1000,
                    elapsed_s: 0.5,
                    ..Default::default()
                }],
                cpu_s: 0.25,
                wire: vec![WireDelta {
                    key: "h/ns/lo".into(),
                    bytes: 150_000,
                }],
            },
            ProcResult {
                nodes: vec![NodeResult {
                    id: 1,
                    received: 1000,
                    recv_bytes: 100_000,
                    elapsed_s: 1.0,
                    ..Default::default()
                }],
                cpu_s: 0.5,
                // Same counter seen by the other process: counted once.
                wire: vec![WireDelta {
                    key: "h/ns/lo".into(),
                    bytes: 140_000,
                }],
            },
        ];
        let r = aggregate(&key(), &run(Operation::Throughput, 100), 2, &procs);
        assert_eq!(r.messages, 1000);
        assert_eq!(r.elapsed_s, 1.0);
        assert_eq!(r.msgs_per_sec, 1000.0);
        assert_eq!(r.bytes_per_sec, 100_000.0);
        assert_eq!(r.cpu_s, 0.75);
        assert_eq!(r.wire_bytes, Some(150_000));
        assert_eq!(r.wire_overhead, Some(1.5));
        assert!(r.lat_us.is_none());
        assert_eq!(r.repetition, 2);
    }

    #[test]
    fn aggregates_latency() {
        let mut h = new_histogram();
        for _ in 0..100 {
            record_ns(&mut h, 20_000);
        }
        let node = NodeResult {
            id: 0,
            round_trips: 100,
            elapsed_s: 0.004,
            hist: Some(HistData::from_hist(&h)),
            ..Default::default()
        };
        let procs = vec![ProcResult {
            nodes: vec![node.clone(), NodeResult { id: 2, ..node }],
            cpu_s: 0.1,
            wire: vec![],
        }];
        let r = aggregate(&key(), &run(Operation::Pingpong, 64), 0, &procs);
        assert_eq!(r.messages, 200);
        assert_eq!(r.msgs_per_sec, 50_000.0);
        assert_eq!(r.bytes_per_sec, 50_000.0 * 64.0);
        let l = r.lat_us.unwrap();
        assert!((l.p50 - 20.0).abs() < 0.05 && (l.avg - 20.0).abs() < 0.05);
        assert_eq!(r.wire_overhead, None);
    }

    #[test]
    fn cpu_time_is_monotonic() {
        let a = process_cpu_s();
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(process_cpu_s() >= a);
    }

    #[test]
    fn loopback_iface() {
        assert_eq!(
            iface_of("127.0.0.1".parse().unwrap()).as_deref(),
            Some("lo")
        );
    }
}
