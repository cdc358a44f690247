//! YCSB's number generators, with YCSB's semantics (its `generator`
//! package): which record an operation touches.
//!
//! - [`Zipfian`]: Gray et al.'s "Quickly generating billion-record synthetic
//!   databases" (YCSB's `ZipfianGenerator`), constant 0.99 by default;
//!   popular items are the small numbers. The item count may grow (the
//!   zeta sum is extended, not recomputed).
//! - [`ScrambledZipfian`]: zipfian over 10^10 items hashed (FNV-1a 64) into
//!   the range, so the popular items are spread over it
//!   (`ScrambledZipfianGenerator`).
//! - [`SkewedLatest`]: zipfian over the records inserted so far, the most
//!   recent the most popular (`SkewedLatestGenerator`).
//! - [`Hotspot`]: a fraction of the operations on a hot fraction of the
//!   items (`HotspotIntegerGenerator`).
//! - [`Uniform`].
//! - [`AcknowledgedCounter`]: the insert key sequence of the run phase;
//!   readers only pick keys whose insert finished
//!   (`AcknowledgedCounterGenerator`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use rand::RngExt;

/// The random source of one client thread.
pub type Rng = rand::rngs::SmallRng;

/// YCSB's zipfian constant.
pub const ZIPFIAN_CONSTANT: f64 = 0.99;

/// Item count of the scrambled zipfian's underlying zipfian (YCSB's).
const SCRAMBLED_ITEMS: u64 = 10_000_000_000;

/// zeta(10^10, 0.99), as YCSB hard-codes it (summing 10^10 terms at
/// start-up would take a minute).
const SCRAMBLED_ZETAN: f64 = 26.469_028_201_783_02;

/// YCSB's `Utils.fnvhash64`: FNV-1a over the 8 bytes of `v`, low byte
/// first, made non-negative.
pub fn fnv_hash64(mut v: u64) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for _ in 0..8 {
        h ^= v & 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
        v >>= 8;
    }
    (h as i64).unsigned_abs()
}

fn zeta(from: u64, to: u64, theta: f64, start: f64) -> f64 {
    let mut sum = start;
    for i in from..to {
        sum += 1.0 / ((i + 1) as f64).powf(theta);
    }
    sum
}

/// Zipfian over `[base, base + items)`: item `base` most popular.
#[derive(Debug, Clone)]
pub struct Zipfian {
    base: u64,
    items: u64,
    theta: f64,
    zeta2: f64,
    zetan: f64,
    alpha: f64,
    eta: f64,
}

impl Zipfian {
    /// Over `[min, max]` with constant `theta`.
    pub fn new(min: u64, max: u64, theta: f64) -> Self {
        let items = max - min + 1;
        Self::with_zetan(min, items, theta, zeta(0, items, theta, 0.0))
    }

    fn with_zetan(base: u64, items: u64, theta: f64, zetan: f64) -> Self {
        let zeta2 = zeta(0, 2, theta, 0.0);
        let mut z = Self {
            base,
            items,
            theta,
            zeta2,
            zetan,
            alpha: 1.0 / (1.0 - theta),
            eta: 0.0,
        };
        z.eta = z.eta_for(items);
        z
    }

    fn eta_for(&self, items: u64) -> f64 {
        (1.0 - (2.0 / items as f64).powf(1.0 - self.theta)) / (1.0 - self.zeta2 / self.zetan)
    }

    /// Grows the item count to `items` (never shrinks: YCSB's generator
    /// recomputes from scratch then, which no caller here needs).
    pub fn grow_to(&mut self, items: u64) {
        if items > self.items {
            self.zetan = zeta(self.items, items, self.theta, self.zetan);
            self.items = items;
            self.eta = self.eta_for(items);
        }
    }

    /// The item count.
    pub fn items(&self) -> u64 {
        self.items
    }

    /// The next number.
    pub fn next(&self, rng: &mut Rng) -> u64 {
        let u: f64 = rng.random();
        let uz = u * self.zetan;
        if uz < 1.0 {
            return self.base;
        }
        if uz < 1.0 + 0.5f64.powf(self.theta) {
            return self.base + 1;
        }
        let off = (self.items as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64;
        self.base + off.min(self.items - 1)
    }
}

/// Zipfian popularity scattered over `[min, max]` by hashing.
#[derive(Debug, Clone)]
pub struct ScrambledZipfian {
    min: u64,
    items: u64,
    zipf: Zipfian,
}

impl ScrambledZipfian {
    /// Over `[min, max]` with YCSB's constant.
    pub fn new(min: u64, max: u64) -> Self {
        Self {
            min,
            items: max - min + 1,
            zipf: Zipfian::with_zetan(0, SCRAMBLED_ITEMS, ZIPFIAN_CONSTANT, SCRAMBLED_ZETAN),
        }
    }

    /// The next number.
    pub fn next(&self, rng: &mut Rng) -> u64 {
        self.min + fnv_hash64(self.zipf.next(rng)) % self.items
    }
}

/// Uniform over `[min, max]`.
#[derive(Debug, Clone, Copy)]
pub struct Uniform {
    min: u64,
    max: u64,
}

impl Uniform {
    /// Over `[min, max]`.
    pub fn new(min: u64, max: u64) -> Self {
        Self { min, max }
    }

    /// The next number.
    pub fn next(&self, rng: &mut Rng) -> u64 {
        rng.random_range(self.min..=self.max)
    }
}

/// `hot_op_fraction` of the numbers from the first `hot_set_fraction` of
/// `[min, max]`, the rest from the others, uniformly within each.
#[derive(Debug, Clone, Copy)]
pub struct Hotspot {
    min: u64,
    hot: u64,
    cold: u64,
    hot_op_fraction: f64,
}

impl Hotspot {
    /// YCSB's `HotspotIntegerGenerator(min, max, hotsetfraction,
    /// hotopnfraction)`.
    pub fn new(min: u64, max: u64, hot_set_fraction: f64, hot_op_fraction: f64) -> Self {
        let items = max - min + 1;
        let hot = ((items as f64 * hot_set_fraction.clamp(0.0, 1.0)) as u64).clamp(1, items);
        Self {
            min,
            hot,
            cold: items - hot,
            hot_op_fraction: hot_op_fraction.clamp(0.0, 1.0),
        }
    }

    /// The next number.
    pub fn next(&self, rng: &mut Rng) -> u64 {
        if self.cold == 0 || rng.random::<f64>() < self.hot_op_fraction {
            self.min + rng.random_range(0..self.hot)
        } else {
            self.min + self.hot + rng.random_range(0..self.cold)
        }
    }
}

/// Zipfian over the numbers below the counter's last acknowledged one,
/// the most recent the most popular.
#[derive(Debug)]
pub struct SkewedLatest {
    zipf: Mutex<Zipfian>,
}

impl SkewedLatest {
    /// Over the numbers `counter` acknowledged.
    pub fn new(counter: &AcknowledgedCounter) -> Self {
        Self {
            zipf: Mutex::new(Zipfian::new(0, counter.last().max(1) - 1, ZIPFIAN_CONSTANT)),
        }
    }

    /// The next number, below `counter.last()`.
    pub fn next(&self, counter: &AcknowledgedCounter, rng: &mut Rng) -> u64 {
        let max = counter.last().max(1);
        let z = {
            let mut z = self.zipf.lock().expect("not poisoned");
            z.grow_to(max);
            z.clone()
        };
        max - 1 - z.next(rng).min(max - 1)
    }
}

/// Hands out insert numbers and tracks the highest one below which every
/// insert was acknowledged (finished), so readers never pick a record
/// whose insert is still in flight.
#[derive(Debug)]
pub struct AcknowledgedCounter {
    next: AtomicU64,
    /// Every number below this was acknowledged.
    limit: AtomicU64,
    pending: Mutex<std::collections::BTreeSet<u64>>,
}

impl AcknowledgedCounter {
    /// Numbers from `start` on; those below are taken as acknowledged.
    pub fn new(start: u64) -> Self {
        Self {
            next: AtomicU64::new(start),
            limit: AtomicU64::new(start),
            pending: Mutex::new(Default::default()),
        }
    }

    /// The next number to insert.
    pub fn next(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Marks `n`'s insert as finished.
    pub fn acknowledge(&self, n: u64) {
        let mut p = self.pending.lock().expect("not poisoned");
        p.insert(n);
        let mut limit = self.limit.load(Ordering::Relaxed);
        while p.remove(&limit) {
            limit += 1;
        }
        self.limit.store(limit, Ordering::Release);
    }

    /// One past the highest number below which all were acknowledged.
    pub fn last(&self) -> u64 {
        self.limit.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn rng() -> Rng {
        Rng::seed_from_u64(42)
    }

    #[test]
    fn fnv_is_fnv1a_over_the_little_endian_bytes_made_non_negative() {
        for v in [0u64, 1, 255, 256, 0xDEAD_BEEF, u64::MAX] {
            let mut h = 0xCBF2_9CE4_8422_2325u64;
            for b in v.to_le_bytes() {
                h = (h ^ b as u64).wrapping_mul(0x100_0000_01B3);
            }
            assert_eq!(fnv_hash64(v), (h as i64).unsigned_abs(), "{v}");
        }
    }

    #[test]
    fn zipfian_frequencies_follow_the_law() {
        let n = 1000;
        let z = Zipfian::new(0, n - 1, ZIPFIAN_CONSTANT);
        let mut r = rng();
        let draws = 400_000;
        let mut counts = vec![0u64; n as usize];
        for _ in 0..draws {
            counts[z.next(&mut r) as usize] += 1;
        }
        // Items 0 and 1 are drawn with their exact probability
        // P(i) = 1 / ((i+1)^theta * zeta(n)); Gray's method approximates
        // the rest by a continuous law, so for them the test checks the
        // mass of the most popular items and the tail against the law.
        let zetan = zeta(0, n, ZIPFIAN_CONSTANT, 0.0);
        let p = |i: u64| 1.0 / ((i + 1) as f64).powf(ZIPFIAN_CONSTANT) / zetan;
        for i in [0u64, 1] {
            let want = p(i) * draws as f64;
            let sd = (want * (1.0 - p(i))).sqrt();
            let got = counts[i as usize] as f64;
            assert!((got - want).abs() < 5.0 * sd, "item {i}: {got} vs {want}");
        }
        for (lo, hi) in [(2u64, 10u64), (10, 100), (100, 1000)] {
            let want: f64 = (lo..hi).map(p).sum::<f64>() * draws as f64;
            let got: u64 = counts[lo as usize..hi as usize].iter().sum();
            let ratio = got as f64 / want;
            assert!(
                (0.85..1.15).contains(&ratio),
                "items {lo}..{hi}: {got} vs {want:.0}"
            );
        }
        // Growing matches building at the larger size.
        let mut g = Zipfian::new(0, 499, ZIPFIAN_CONSTANT);
        g.grow_to(1000);
        assert!((g.zetan - z.zetan).abs() < 1e-9);
        assert!((g.eta - z.eta).abs() < 1e-12);
    }

    #[test]
    fn scrambled_zipfian_stays_in_range_and_is_skewed_but_spread() {
        let z = ScrambledZipfian::new(100, 10_099);
        let mut r = rng();
        let mut counts = std::collections::HashMap::new();
        for _ in 0..200_000 {
            let v = z.next(&mut r);
            assert!((100..=10_099).contains(&v));
            *counts.entry(v).or_insert(0u64) += 1;
        }
        let mut c: Vec<(u64, u64)> = counts.into_iter().collect();
        c.sort_by_key(|&(v, n)| (std::cmp::Reverse(n), v));
        // The hottest item takes several percent (zipfian), and the hot
        // items are not the low numbers (scrambled).
        assert!(c[0].1 > 200_000 / 50, "{:?}", &c[..5]);
        assert!(
            c[..10].iter().filter(|(v, _)| *v < 200).count() <= 2,
            "{:?}",
            &c[..10]
        );
    }

    #[test]
    fn hotspot_and_uniform_fractions() {
        let h = Hotspot::new(0, 999, 0.2, 0.8);
        let u = Uniform::new(10, 19);
        let mut r = rng();
        let (mut hot, n) = (0, 100_000);
        let mut seen = [false; 10];
        for _ in 0..n {
            let v = h.next(&mut r);
            assert!(v < 1000);
            if v < 200 {
                hot += 1;
            }
            let w = u.next(&mut r);
            seen[(w - 10) as usize] = true;
        }
        let frac = hot as f64 / n as f64;
        assert!((0.79..0.81).contains(&frac), "{frac}");
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn latest_prefers_recent_acknowledged_inserts() {
        let c = AcknowledgedCounter::new(1000);
        let a = c.next();
        let b = c.next();
        c.acknowledge(b);
        assert_eq!(c.last(), 1000, "a gap below b");
        c.acknowledge(a);
        assert_eq!(c.last(), 1002);
        let l = SkewedLatest::new(&c);
        let mut r = rng();
        let mut newest = 0;
        for _ in 0..10_000 {
            let v = l.next(&c, &mut r);
            assert!(v < 1002);
            if v == 1001 {
                newest += 1;
            }
        }
        assert!(newest > 10_000 / 15, "{newest}");
    }
}
