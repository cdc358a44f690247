//! Latency histograms for hot paths: log-linear buckets in per-thread
//! cells (one writer per cell, see [`super::stats`]), summed when read.
//!
//! A value `v` (nanoseconds) falls into one of [`BUCKETS`] buckets: below
//! [`SUB`] one bucket per value, above eight per power of two, so a
//! bucket's width is at most 1/8 of its lower bound. Each histogram also
//! keeps the exact sum, so means are exact. Recording is two plain loads
//! and stores in the thread's own cache lines: no locked instruction and
//! no line shared with another writer.

use crossbeam::utils::CachePadded;
use thread_local::ThreadLocal;

use super::stats::OwnedCell;

/// Sub-buckets per power of two (and the values counted one per bucket).
pub const SUB: u64 = 8;
const SUB_BITS: u32 = SUB.trailing_zeros();
/// The largest power of two told apart: 2^36 ns is about 69 s; larger
/// values land in the last bucket.
const MAX_EXP: u32 = 36;
/// Buckets per histogram.
pub const BUCKETS: usize = (SUB + (MAX_EXP - SUB_BITS + 1) as u64 * SUB) as usize;

/// The bucket of `v`.
#[inline]
pub fn bucket(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let exp = 63 - v.leading_zeros();
    if exp > MAX_EXP {
        return BUCKETS - 1;
    }
    let sub = (v >> (exp - SUB_BITS)) & (SUB - 1);
    (SUB + (exp - SUB_BITS) as u64 * SUB + sub) as usize
}

/// The smallest value of bucket `i`.
pub fn bucket_low(i: usize) -> u64 {
    let i = i as u64;
    if i < SUB {
        return i;
    }
    let exp = (i - SUB) / SUB + SUB_BITS as u64;
    let sub = (i - SUB) % SUB;
    (1u64 << exp) + (sub << (exp - SUB_BITS as u64))
}

/// The largest value of bucket `i` (the last bucket: `u64::MAX`).
pub fn bucket_high(i: usize) -> u64 {
    if i + 1 >= BUCKETS {
        u64::MAX
    } else {
        bucket_low(i + 1) - 1
    }
}

/// One thread's cells: per histogram its buckets, then its sum.
struct Cells(Box<[OwnedCell]>);

/// `n` histograms recorded by many threads.
pub struct Histograms {
    n: usize,
    cells: ThreadLocal<CachePadded<Cells>>,
}

impl std::fmt::Debug for Histograms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histograms").field("n", &self.n).finish()
    }
}

/// What one histogram held when read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Snapshot {
    /// Count per bucket ([`BUCKETS`] of them).
    pub buckets: Vec<u64>,
    /// Sum of the recorded values.
    pub sum: u64,
}

impl Histograms {
    /// `n` empty histograms.
    pub fn new(n: usize) -> Self {
        Self {
            n,
            cells: ThreadLocal::new(),
        }
    }

    fn mine(&self) -> &Cells {
        self.cells.get_or(|| {
            CachePadded::new(Cells(
                (0..self.n * (BUCKETS + 1))
                    .map(|_| OwnedCell::default())
                    .collect(),
            ))
        })
    }

    /// Records `values[k]` into histogram `first + k`, for each `k`.
    #[inline]
    pub fn record(&self, first: usize, values: &[u64]) {
        debug_assert!(first + values.len() <= self.n);
        let cells = &self.mine().0;
        for (k, &v) in values.iter().enumerate() {
            let base = (first + k) * (BUCKETS + 1);
            cells[base + bucket(v)].add(1);
            cells[base + BUCKETS].add(v);
        }
    }

    /// Histogram `h` summed over every thread that recorded.
    pub fn snapshot(&self, h: usize) -> Snapshot {
        let mut s = Snapshot {
            buckets: vec![0; BUCKETS],
            sum: 0,
        };
        let base = h * (BUCKETS + 1);
        for c in self.cells.iter() {
            for (b, cell) in s.buckets.iter_mut().zip(&c.0[base..base + BUCKETS]) {
                *b += cell.get();
            }
            s.sum = s.sum.wrapping_add(c.0[base + BUCKETS].get());
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_value_in_order() {
        assert_eq!(bucket_low(0), 0);
        for i in 0..BUCKETS - 1 {
            assert_eq!(bucket(bucket_low(i)), i, "low of {i}");
            assert_eq!(bucket(bucket_high(i)), i, "high of {i}");
            assert_eq!(bucket_high(i) + 1, bucket_low(i + 1));
            // At most 1/8 wide relative to its lower bound.
            let (lo, hi) = (bucket_low(i), bucket_high(i));
            assert!(hi - lo <= lo / SUB, "bucket {i}: {lo}..={hi}");
        }
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
        assert_eq!(bucket(1 << 40), BUCKETS - 1);
    }

    #[test]
    fn threads_record_into_one_sum() {
        let h = Histograms::new(2);
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let h = &h;
                s.spawn(move || {
                    for i in 0..1000u64 {
                        h.record(0, &[i * 10 + t, 5]);
                    }
                });
            }
        });
        let a = h.snapshot(0);
        assert_eq!(a.buckets.iter().sum::<u64>(), 8000);
        let want: u64 = (0..8u64)
            .map(|t| (0..1000u64).map(|i| i * 10 + t).sum::<u64>())
            .sum();
        assert_eq!(a.sum, want);
        let b = h.snapshot(1);
        assert_eq!(b.buckets[5], 8000);
        assert_eq!(b.sum, 40_000);
    }
}
