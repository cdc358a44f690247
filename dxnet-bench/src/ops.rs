//! The operations, written once against [`Binding`]: who sends to whom, how
//! many messages each node expects, and the timed loops themselves.
//!
//! Roles (node ids 0..N; pairs are (0,1), (2,3), ...):
//! - throughput uni: even ids send to their partner, odd ids receive;
//!   throughput bi: both nodes of a pair send and receive;
//! - all-to-all: every node sends to every other round-robin and receives
//!   from all;
//! - latency / pingpong: even ids initiate round trips with their partner,
//!   odd ids answer (echo the message / respond to the request).
//!
//! A node's `count` is split over its sender threads; thread `j` sends its
//! `i`-th message to `dests[(i + j) % dests.len()]`. A receiver is done when
//! its expected count (computed from the same rule) has arrived, which is
//! what ends the measured time: `send` may return before delivery. A sender
//! thread calls [`Binding::flush`] after its last message (and a latency
//! initiator after every message), so buffering bindings deliver everything.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

use crate::binding::{one_sided_offset, wait_slot, Binding, Sink, SinkMode};
use crate::config::{Mode, Operation, RunSpec};
use crate::metrics::{new_histogram, record_ns, HistData, NodeResult};

/// A node's part in an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Role {
    /// Where this node's sender threads send (empty: it sends nothing).
    pub dests: Vec<u16>,
    /// Whether it initiates round trips (latency/pingpong) instead of
    /// streaming messages.
    pub initiator: bool,
    /// What its sink does.
    pub sink: SinkMode,
}

/// The role of node `id` among `n` nodes.
pub fn role(op: Operation, mode: Mode, id: u16, n: usize) -> Role {
    let partner = id ^ 1;
    let even = id & 1 == 0;
    match op {
        Operation::Throughput | Operation::RdmaWrite | Operation::RdmaRead => Role {
            dests: if mode == Mode::Bi || even {
                vec![partner]
            } else {
                vec![]
            },
            initiator: false,
            sink: SinkMode::Count,
        },
        Operation::AllToAll => Role {
            dests: (0..n as u16).filter(|&d| d != id).collect(),
            initiator: false,
            sink: SinkMode::Count,
        },
        Operation::Latency
        | Operation::Pingpong
        | Operation::RdmaWriteLat
        | Operation::RdmaReadLat => Role {
            dests: if even { vec![partner] } else { vec![] },
            initiator: even,
            sink: match (op, even) {
                (Operation::Latency, true) => SinkMode::Wake,
                (Operation::Latency, false) => SinkMode::Echo,
                _ => SinkMode::Count,
            },
        },
    }
}

/// Messages thread `j` of `threads` sends when its node sends `count`.
pub fn thread_count(count: u64, threads: usize, j: usize) -> u64 {
    let t = threads as u64;
    count / t + u64::from((j as u64) < count % t)
}

/// How many messages `src` sends to `dest` in a phase of `count` per node.
pub fn sent_to(
    op: Operation,
    mode: Mode,
    src: u16,
    dest: u16,
    n: usize,
    count: u64,
    threads: usize,
) -> u64 {
    if op.is_one_sided() {
        return 0; // nothing arrives at the partner's sink
    }
    let dests = role(op, mode, src, n).dests;
    let Some(k) = dests.iter().position(|&d| d == dest) else {
        return 0;
    };
    let d = dests.len() as u64;
    (0..threads)
        .map(|j| {
            let c = thread_count(count, threads, j);
            // Thread j's i-th message goes to index (i + j) % d, so index k
            // gets messages i = (k - j) mod d, (k - j) mod d + d, ...
            let first = (k as u64 + d - (j as u64 % d)) % d;
            c / d + u64::from(first < c % d)
        })
        .sum()
}

/// Messages (or requests) node `id` receives in a phase.
pub fn expected(op: Operation, mode: Mode, id: u16, n: usize, count: u64, threads: usize) -> u64 {
    (0..n as u16)
        .filter(|&s| s != id)
        .map(|s| sent_to(op, mode, s, id, n, count, threads))
        .sum()
}

/// One logical node of this process.
pub struct LocalNode {
    /// Node id.
    pub id: u16,
    /// Its binding instance.
    pub binding: Arc<dyn Binding>,
    /// Its receive sink.
    pub sink: Arc<Sink>,
}

/// Static parameters of the phases of one run.
pub struct PhaseCtx<'a> {
    /// The run.
    pub run: &'a RunSpec,
    /// Nodes in the run.
    pub n: usize,
    /// Sender threads per node.
    pub threads: usize,
    /// Payload per sender thread; its first byte is the thread index.
    pub payloads: &'a [Vec<u8>],
    /// Phase timeout.
    pub timeout: Duration,
    /// How long latency waiters spin before parking.
    pub spin: Duration,
    /// One-sided accesses in flight per thread.
    pub window: usize,
}

/// Payloads of `size` bytes for `threads` threads: a fixed pattern with the
/// thread index in byte 0 (latency echoes use it to find their waiter).
pub fn make_payloads(size: usize, threads: usize) -> Vec<Vec<u8>> {
    (0..threads)
        .map(|j| {
            let mut p: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            if let Some(b) = p.first_mut() {
                *b = j as u8;
            }
            p
        })
        .collect()
}

/// Arms every local sink for a phase of `count` messages per sending node.
/// Called only while no traffic flows (at the end of the previous phase or in
/// prepare), so early messages of a faster peer are never lost to a reset.
pub fn arm(nodes: &[LocalNode], ctx: &PhaseCtx, count: u64) {
    let r = ctx.run;
    for ln in nodes {
        let role = role(r.operation, r.mode, ln.id, ctx.n);
        let exp = expected(r.operation, r.mode, ln.id, ctx.n, count, ctx.threads);
        ln.sink
            .reset(role.sink, if exp == 0 { u64::MAX } else { exp });
    }
}

struct ThreadOut {
    node: u16,
    sent: u64,
    round_trips: u64,
    end: Instant,
    hist: Option<HistData>,
    late: Lateness,
}

/// How far behind its schedule an open-loop sender thread issued its
/// operations.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Lateness {
    /// Operations issued on a schedule.
    pub paced: u64,
    /// Sum of their delays after their scheduled times (ns).
    pub sum_ns: u64,
    /// The largest delay (ns).
    pub max_ns: u64,
}

/// An open-loop schedule: thread `j` of `threads` issues its `i`-th
/// operation at `start + (i * threads + j) / rate`, so the node's threads
/// together issue `rate` per second, evenly interleaved. A thread that is
/// behind issues at once (the backlog is not dropped); one that is ahead
/// sleeps, so the pacer spends no CPU of its own while it waits (its sleep
/// granularity, tens of microseconds, shows as lateness).
#[derive(Debug)]
pub struct Pace {
    start: Instant,
    /// Nanoseconds between two operations of the node.
    step_ns: f64,
    threads: u64,
    j: u64,
    /// Delays below this are not worth a sleep (a sleep's own cost).
    min_sleep: Duration,
    /// The delays so far.
    pub late: Lateness,
}

impl Pace {
    /// The schedule of thread `j` of `threads` for `rate` operations per
    /// second per node, from `start`; `None` for rate 0 (closed loop).
    pub fn new(rate: u64, threads: usize, j: usize, start: Instant) -> Option<Self> {
        (rate > 0).then(|| Pace {
            start,
            step_ns: 1e9 / rate as f64,
            threads: threads.max(1) as u64,
            j: j as u64,
            min_sleep: Duration::from_micros(5),
            late: Lateness::default(),
        })
    }

    /// When operation `i` of this thread is due.
    pub fn due(&self, i: u64) -> Instant {
        let n = (i * self.threads + self.j) as f64;
        self.start + Duration::from_nanos((n * self.step_ns) as u64)
    }

    /// Waits until operation `i` is due and records how late it is issued.
    pub fn wait(&mut self, i: u64) {
        let due = self.due(i);
        let mut now = Instant::now();
        if due > now {
            let ahead = due - now;
            if ahead >= self.min_sleep {
                std::thread::sleep(ahead);
                now = Instant::now();
            }
        }
        let late = now.saturating_duration_since(due).as_nanos() as u64;
        self.late.paced += 1;
        self.late.sum_ns += late;
        self.late.max_ns = self.late.max_ns.max(late);
    }
}

/// Runs one phase of `count` messages per sending node on all local nodes
/// at once and returns what each measured. Sinks must be armed.
pub fn run_phase(nodes: &[LocalNode], ctx: &PhaseCtx, count: u64) -> Result<Vec<NodeResult>> {
    let r = ctx.run;
    let roles: Vec<Role> = nodes
        .iter()
        .map(|ln| role(r.operation, r.mode, ln.id, ctx.n))
        .collect();
    let n_threads: usize = roles.iter().filter(|ro| !ro.dests.is_empty()).count() * ctx.threads;
    // Called off if a spawn fails (see `StartGate`).
    let gate = crate::start_gate::StartGate::new();
    std::thread::scope(|scope| -> Result<Vec<NodeResult>> {
        let opener = gate.opener();
        let mut handles = Vec::new();
        for (ln, ro) in nodes.iter().zip(&roles) {
            if ro.dests.is_empty() {
                continue;
            }
            for j in 0..ctx.threads {
                let gate = &gate;
                let op = r.operation;
                let thread = std::thread::Builder::new().name(format!("sender-{j}"));
                handles.push(thread.spawn_scoped(scope, move || -> Result<ThreadOut> {
                    let c = thread_count(count, ctx.threads, j);
                    let payload = &ctx.payloads[j];
                    let slot = (op == Operation::Latency).then(|| ln.sink.register_waiter(j));
                    if !gate.wait() {
                        return Err(anyhow!("called off"));
                    }
                    let deadline = Instant::now() + ctx.timeout;
                    let mut pace = Pace::new(r.rate, ctx.threads, j, Instant::now());
                    let mut pace_wait = |i: u64| {
                        if let Some(p) = pace.as_mut() {
                            p.wait(i);
                        }
                    };
                    let mut out = ThreadOut {
                        node: ln.id,
                        sent: 0,
                        round_trips: 0,
                        end: Instant::now(),
                        hist: None,
                        late: Lateness::default(),
                    };
                    let b = &ln.binding;
                    let size = payload.len();
                    let window = ctx.window;
                    if op.is_one_sided() && ro.initiator {
                        // One access at a time: its completion time.
                        let dest = ro.dests[0];
                        let mut h = new_histogram();
                        for i in 0..c {
                            let off = one_sided_offset(j, 1, i, size);
                            let t = Instant::now();
                            b.one_sided(j, dest, op.reads(), off, payload, 1)?;
                            record_ns(&mut h, t.elapsed().as_nanos() as u64);
                            out.sent += 1;
                            out.round_trips += 1;
                        }
                        out.hist = Some(HistData::from_hist(&h));
                    } else if op.is_one_sided() {
                        let d = ro.dests.len();
                        for i in 0..c {
                            let off = one_sided_offset(j, window, i, size);
                            let dest = ro.dests[(i as usize + j) % d];
                            b.one_sided(j, dest, op.reads(), off, payload, window)?;
                            out.sent += 1;
                        }
                        b.one_sided_drain(j)?;
                    } else if ro.initiator {
                        let dest = ro.dests[0];
                        let mut h = new_histogram();
                        for i in 0..c {
                            pace_wait(i);
                            let t = Instant::now();
                            if let Some(slot) = &slot {
                                b.send(j, dest, payload)?;
                                b.flush(j, &ro.dests)?;
                                wait_slot(slot, i + 1, ctx.spin, deadline)?;
                                record_ns(&mut h, t.elapsed().as_nanos() as u64 / 2);
                            } else {
                                b.request(j, dest, payload)?;
                                record_ns(&mut h, t.elapsed().as_nanos() as u64);
                            }
                            out.sent += 1;
                            out.round_trips += 1;
                        }
                        out.hist = Some(HistData::from_hist(&h));
                    } else {
                        let d = ro.dests.len();
                        for i in 0..c as usize {
                            pace_wait(i as u64);
                            b.send(j, ro.dests[(i + j) % d], payload)?;
                            out.sent += 1;
                        }
                        // Buffering bindings: the receivers' count (which
                        // ends the measured time) needs the last bytes.
                        b.flush(j, &ro.dests)?;
                    }
                    out.end = Instant::now();
                    if let Some(p) = &pace {
                        out.late = p.late;
                    }
                    Ok(out)
                })?);
            }
        }
        let t0 = Instant::now();
        opener.open(n_threads);
        let deadline = t0 + ctx.timeout;
        let mut results: Vec<NodeResult> = nodes
            .iter()
            .map(|ln| NodeResult {
                id: ln.id,
                ..Default::default()
            })
            .collect();
        let mut first_err = None;
        // Receivers first: their completion ends the measured time.
        for (i, ln) in nodes.iter().enumerate() {
            let exp = expected(r.operation, r.mode, ln.id, ctx.n, count, ctx.threads);
            if exp == 0 {
                continue;
            }
            match ln.sink.wait_done(deadline) {
                Ok(t) => {
                    results[i].elapsed_s = results[i].elapsed_s.max((t - t0).as_secs_f64());
                }
                Err(e) => {
                    first_err.get_or_insert(e.context(format!("node {}", ln.id)));
                    break;
                }
            }
        }
        for h in handles {
            match h.join().map_err(|_| anyhow!("sender thread panicked"))? {
                Ok(out) => {
                    let i = nodes.iter().position(|ln| ln.id == out.node).unwrap();
                    let res = &mut results[i];
                    res.sent += out.sent;
                    res.round_trips += out.round_trips;
                    res.paced += out.late.paced;
                    res.late_ns_sum += out.late.sum_ns;
                    res.late_ns_max = res.late_ns_max.max(out.late.max_ns);
                    res.elapsed_s = res.elapsed_s.max((out.end - t0).as_secs_f64());
                    if let Some(d) = out.hist {
                        let mut h = new_histogram();
                        if let Some(prev) = &res.hist {
                            prev.add_to(&mut h);
                        }
                        d.add_to(&mut h);
                        res.hist = Some(HistData::from_hist(&h));
                    }
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        for (i, ln) in nodes.iter().enumerate() {
            results[i].received = ln.sink.received();
            results[i].recv_bytes = ln.sink.bytes();
            if ln.sink.errors() > 0 {
                return Err(anyhow!(
                    "node {}: {} echoes failed",
                    ln.id,
                    ln.sink.errors()
                ));
            }
        }
        Ok(results)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pace_interleaves_threads_at_the_node_rate() {
        let start = Instant::now();
        // 1000 per second over 4 threads: thread 1's ops at 1, 5, 9 ms.
        let p = Pace::new(1000, 4, 1, start).unwrap();
        let ms = |i| (p.due(i) - start).as_micros();
        assert_eq!([ms(0), ms(1), ms(2)], [1000, 5000, 9000]);
        assert!(Pace::new(0, 4, 1, start).is_none(), "rate 0: closed loop");
        // Behind its schedule: issued at once, the delay recorded.
        let mut late = Pace::new(1000, 1, 0, start - Duration::from_secs(1)).unwrap();
        late.wait(0);
        assert_eq!(late.late.paced, 1);
        assert!(late.late.max_ns >= 1_000_000_000 - 1_000_000);
    }

    #[test]
    fn roles() {
        let r = role(Operation::Throughput, Mode::Uni, 0, 2);
        assert_eq!(r.dests, vec![1]);
        assert!(role(Operation::Throughput, Mode::Uni, 1, 2)
            .dests
            .is_empty());
        assert_eq!(role(Operation::Throughput, Mode::Bi, 3, 4).dests, vec![2]);
        assert_eq!(
            role(Operation::AllToAll, Mode::Bi, 2, 4).dests,
            vec![0, 1, 3]
        );
        let l = role(Operation::Latency, Mode::Uni, 1, 2);
        assert_eq!(l.sink, SinkMode::Echo);
        assert!(role(Operation::Pingpong, Mode::Uni, 0, 2).initiator);
    }

    #[test]
    fn counts_are_conserved() {
        for &(n, count, threads) in &[
            (2usize, 1000u64, 1usize),
            (4, 1001, 3),
            (6, 7, 4),
            (8, 99, 16),
        ] {
            for op in [
                Operation::Throughput,
                Operation::AllToAll,
                Operation::Pingpong,
            ] {
                for mode in [Mode::Uni, Mode::Bi] {
                    let mut sent = 0;
                    let mut recv = 0;
                    for id in 0..n as u16 {
                        if !role(op, mode, id, n).dests.is_empty() {
                            sent += count;
                        }
                        recv += expected(op, mode, id, n, count, threads);
                    }
                    assert_eq!(sent, recv, "{op:?} {mode:?} n={n} c={count} t={threads}");
                }
            }
        }
    }

    #[test]
    fn all_to_all_spreads_evenly() {
        // 4 nodes, 3 peers each, 300 messages: 100 to each peer.
        for d in [1u16, 2, 3] {
            assert_eq!(sent_to(Operation::AllToAll, Mode::Bi, 0, d, 4, 300, 2), 100);
        }
        assert_eq!(expected(Operation::AllToAll, Mode::Bi, 0, 4, 300, 2), 300);
        assert_eq!(thread_count(10, 3, 0), 4);
        assert_eq!(thread_count(10, 3, 2), 3);
    }

    #[test]
    fn payload_carries_thread_index() {
        let p = make_payloads(8, 3);
        assert_eq!(p.len(), 3);
        assert_eq!(p[2][0], 2);
        assert_eq!(p[1].len(), 8);
        assert!(make_payloads(0, 1)[0].is_empty());
    }
}
