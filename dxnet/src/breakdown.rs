//! Where a request's round trip goes: per-stage latency histograms, kept
//! with `metrics.breakdown` and read with [`crate::Node::latency_breakdown`].
//!
//! Each node records the stages it sees with its own clock. A requester
//! records, per request answered with a response:
//!
//! | stage | from | to |
//! | --- | --- | --- |
//! | `send` | the call | the request committed to the ring buffer (encode, flow-control window, commit) |
//! | `post` | the commit | the end of the call: the write to the transport when the calling thread does it because the send thread sleeps (else the wake-up of the send thread, which writes it) |
//! | `awaiting` | end of `post` | the response's receive buffer handed over by the engine |
//! | `response_receive` | that hand-over | the request completed (incoming queue or inline, decode, match) |
//! | `wake` | completion | the requesting thread holding the response (wake-up, or a spin noticing it) |
//! | `round_trip` | the call | the requesting thread holding the response (the five above) |
//!
//! A responder records, per request whose handler returned a response:
//!
//! | stage | from | to |
//! | --- | --- | --- |
//! | `request_queue` | the request's receive buffer handed over by the engine | its handler starting (incoming queue, handler thread wake-up, messages before it in the buffer) |
//! | `handler` | start | the handler's return (decode and the user's function) |
//! | `response_send` | the return | the response committed to the ring buffer |
//! | `response_post` | the commit | the end of the dispatch: the write when the handler's thread does it (responses to the messages of one received buffer leave together after the last one's handler, so for the others this is in `transport`) |
//!
//! The responder records these when the dispatch ends, just after the
//! response has left: a reading taken the moment the requester holds the
//! response may not count that request at the responder yet.
//!
//! `awaiting` minus the responder's four stages is what the two nodes'
//! clocks cannot split further: both engines (send thread, socket or queue
//! pair, receive thread) and the wire, both ways. Between two nodes that
//! only serve each other's requests [`LatencyBreakdown::transport_ns`]
//! computes it from means, which add up exactly. Requests of one-sided
//! operations (dxnet's own) are not recorded.

use serde::{Deserialize, Serialize};

use crate::primitives::histogram::{self, Snapshot};

/// A latency histogram: count, exact sum and log-linear buckets (each at
/// most 1/8 as wide as its lower bound), in nanoseconds.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Histogram {
    count: u64,
    sum_ns: u64,
    /// (bucket, count) of the non-empty buckets, by bucket.
    buckets: Vec<(u16, u64)>,
}

impl Histogram {
    pub(crate) fn from_snapshot(s: &Snapshot) -> Self {
        let buckets: Vec<(u16, u64)> = s
            .buckets
            .iter()
            .enumerate()
            .filter(|(_, &n)| n > 0)
            .map(|(i, &n)| (i as u16, n))
            .collect();
        Self {
            count: buckets.iter().map(|b| b.1).sum(),
            sum_ns: s.sum,
            buckets,
        }
    }

    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Their exact sum in nanoseconds.
    pub fn sum_ns(&self) -> u64 {
        self.sum_ns
    }

    /// Their exact mean in nanoseconds (0 when empty).
    pub fn mean_ns(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_ns as f64 / self.count as f64
        }
    }

    /// The value at quantile `q` (0..=1) in nanoseconds: the middle of its
    /// bucket (0 when empty).
    pub fn quantile_ns(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for &(b, n) in &self.buckets {
            seen += n;
            if seen >= rank {
                let (lo, hi) = (
                    histogram::bucket_low(b as usize),
                    histogram::bucket_high(b as usize),
                );
                return lo + (hi.min(lo.saturating_mul(2)) - lo) / 2;
            }
        }
        histogram::bucket_low(self.buckets.last().map_or(0, |b| b.0 as usize))
    }

    /// What was recorded after `earlier` (a reading of the same histogram).
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let mut buckets = Vec::with_capacity(self.buckets.len());
        let mut old = earlier.buckets.iter().peekable();
        for &(b, n) in &self.buckets {
            while old.peek().is_some_and(|o| o.0 < b) {
                old.next();
            }
            let before = match old.peek() {
                Some(&&(ob, on)) if ob == b => on,
                _ => 0,
            };
            if n > before {
                buckets.push((b, n - before));
            }
        }
        Histogram {
            count: buckets.iter().map(|b| b.1).sum(),
            sum_ns: self.sum_ns.saturating_sub(earlier.sum_ns),
            buckets,
        }
    }

    /// Adds `other`'s values (another node's, say).
    pub fn merge(&mut self, other: &Histogram) {
        let mut all = std::mem::take(&mut self.buckets);
        all.extend_from_slice(&other.buckets);
        all.sort_unstable_by_key(|b| b.0);
        for (b, n) in all {
            match self.buckets.last_mut() {
                Some(last) if last.0 == b => last.1 += n,
                _ => self.buckets.push((b, n)),
            }
        }
        self.count += other.count;
        self.sum_ns += other.sum_ns;
    }
}

/// A node's per-stage latency histograms (see the [module](self) for the
/// stages).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LatencyBreakdown {
    /// Requester: the call until the request is committed to the ring.
    pub send: Histogram,
    /// Requester: the commit until the end of the call (the write when
    /// the calling thread does it).
    pub post: Histogram,
    /// Requester: end of `post` until the response's buffer arrived.
    pub awaiting: Histogram,
    /// Requester: the response's arrival until its request completed.
    pub response_receive: Histogram,
    /// Requester: completion until the requesting thread has the response.
    pub wake: Histogram,
    /// Requester: the whole round trip.
    pub round_trip: Histogram,
    /// Responder: the request's arrival until its handler starts.
    pub request_queue: Histogram,
    /// Responder: the handler (decode and user code).
    pub handler: Histogram,
    /// Responder: the handler's return until the response is committed to
    /// the ring.
    pub response_send: Histogram,
    /// Responder: the commit until the end of the dispatch (the write when
    /// the handler's thread does it).
    pub response_post: Histogram,
}

impl LatencyBreakdown {
    fn each(&self) -> [&Histogram; 10] {
        [
            &self.send,
            &self.post,
            &self.awaiting,
            &self.response_receive,
            &self.wake,
            &self.round_trip,
            &self.request_queue,
            &self.handler,
            &self.response_send,
            &self.response_post,
        ]
    }

    fn each_mut(&mut self) -> [&mut Histogram; 10] {
        [
            &mut self.send,
            &mut self.post,
            &mut self.awaiting,
            &mut self.response_receive,
            &mut self.wake,
            &mut self.round_trip,
            &mut self.request_queue,
            &mut self.handler,
            &mut self.response_send,
            &mut self.response_post,
        ]
    }

    /// The stages' names and histograms, in path order (requester, then
    /// responder).
    pub fn stages(&self) -> [(&'static str, &Histogram); 10] {
        let h = self.each();
        [
            ("send", h[0]),
            ("post", h[1]),
            ("awaiting", h[2]),
            ("response_receive", h[3]),
            ("wake", h[4]),
            ("round_trip", h[5]),
            ("request_queue", h[6]),
            ("handler", h[7]),
            ("response_send", h[8]),
            ("response_post", h[9]),
        ]
    }

    /// What was recorded after `earlier` (a reading of the same node).
    pub fn since(&self, earlier: &LatencyBreakdown) -> LatencyBreakdown {
        let mut out = LatencyBreakdown::default();
        for ((o, a), b) in out
            .each_mut()
            .into_iter()
            .zip(self.each())
            .zip(earlier.each())
        {
            *o = a.since(b);
        }
        out
    }

    /// Adds `other`'s histograms (another node's, say).
    pub fn merge(&mut self, other: &LatencyBreakdown) {
        for (a, b) in self.each_mut().into_iter().zip(other.each()) {
            a.merge(b);
        }
    }

    /// Requests this node answered whose four responder stages are all in
    /// this reading: the least of their counts (a reading taken while a
    /// responder records may hold some of a request's stages, not yet all).
    pub fn served(&self) -> u64 {
        self.responder_stages()
            .iter()
            .map(|h| h.count())
            .min()
            .unwrap_or(0)
    }

    /// Mean time a request spent at its responder (queue, handler,
    /// response send and post), in nanoseconds.
    pub fn responder_mean_ns(&self) -> f64 {
        self.responder_stages().iter().map(|h| h.mean_ns()).sum()
    }

    fn responder_stages(&self) -> [&Histogram; 4] {
        [
            &self.request_queue,
            &self.handler,
            &self.response_send,
            &self.response_post,
        ]
    }

    /// Mean time of engines and wire, both ways: the requesters'
    /// `awaiting` less the responders' stages. `requesters` and
    /// `responders` must cover the same requests (e.g. both sides of
    /// nodes that only served each other). An estimate: a thread preempted
    /// between a commit and its clock read stretches its stage over the
    /// other side's, so under heavy load it can come out below zero.
    pub fn transport_ns(requesters: &LatencyBreakdown, responders: &LatencyBreakdown) -> f64 {
        requesters.awaiting.mean_ns() - responders.responder_mean_ns()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::primitives::histogram::{bucket, Histograms, BUCKETS};

    fn hist(values: &[u64]) -> Histogram {
        let h = Histograms::new(1);
        for &v in values {
            h.record(0, &[v]);
        }
        Histogram::from_snapshot(&h.snapshot(0))
    }

    #[test]
    fn quantiles_fall_in_their_buckets() {
        let values: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        let h = hist(&values);
        assert_eq!(h.count(), 1000);
        assert_eq!(h.sum_ns(), values.iter().sum::<u64>());
        assert!((h.mean_ns() - 500_500.0).abs() < 1e-6);
        for (q, want) in [(0.5, 500_000u64), (0.99, 990_000), (1.0, 1_000_000)] {
            let got = h.quantile_ns(q);
            assert_eq!(bucket(got), bucket(want), "q {q}: {got} vs {want}");
        }
        assert_eq!(Histogram::default().quantile_ns(0.5), 0);
        assert!(BUCKETS < u16::MAX as usize);
    }

    #[test]
    fn since_and_merge_undo_each_other() {
        let a = hist(&[5, 100, 100, 7000]);
        let b = hist(&[5, 100, 100, 7000, 7000, 1 << 30, 3]);
        let d = b.since(&a);
        assert_eq!(d, hist(&[7000, 1 << 30, 3]));
        let mut m = a.clone();
        m.merge(&d);
        assert_eq!(m, b);
        assert_eq!(b.since(&b), Histogram::default());
    }

    #[test]
    fn served_counts_requests_with_every_responder_stage() {
        let mut b = LatencyBreakdown::default();
        assert_eq!(b.served(), 0);
        b.round_trip = hist(&[1, 2, 3, 4]);
        b.request_queue = hist(&[1, 2, 3]);
        b.handler = hist(&[1, 2, 3]);
        b.response_send = hist(&[1, 2, 3]);
        assert_eq!(b.served(), 0, "no response_post yet");
        b.response_post = hist(&[1, 2]);
        assert_eq!(b.served(), 2);
        b.response_post = hist(&[1, 2, 3]);
        assert_eq!(b.served(), 3, "requester stages do not count");
    }
}
