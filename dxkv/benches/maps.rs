//! The concurrent map under dxkv's store, chosen by measurement: scc's
//! `HashMap` (what `store.rs` uses) against dashmap and papaya, doing what
//! a storage node does per request: look a key up and copy its record
//! bytes out (a read), or put a new record with the next version in its
//! place (an update). YCSB's workloads B (95 % reads) and A (50 %), keys
//! uniform over 100 000 records of 32 bytes, 1 to 100 threads on however
//! many cores there are; every map runs once per round, in a rotated order.
//!
//! `cargo bench -p dxkv --bench maps [-- ROUNDS]`

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

type Key = Arc<[u8]>;
type Value = (u64, Arc<[u8]>);

trait Map: Sync {
    fn name(&self) -> &'static str;
    fn insert(&self, k: Key, v: Value);
    /// The record's bytes, copied out (as a reply carries them).
    fn read(&self, k: &[u8]) -> Option<Vec<u8>>;
    /// Replaces the record in place with the next version.
    fn update(&self, k: &[u8], bytes: Arc<[u8]>) -> bool;
}

struct Scc(scc::HashMap<Key, Value>);
struct Dash(dashmap::DashMap<Key, Value>);
struct Papaya(papaya::HashMap<Key, Value>);

impl Map for Scc {
    fn name(&self) -> &'static str {
        "scc"
    }
    fn insert(&self, k: Key, v: Value) {
        let _ = self.0.insert_sync(k, v);
    }
    fn read(&self, k: &[u8]) -> Option<Vec<u8>> {
        self.0.read_sync(k, |_, v| v.1.to_vec())
    }
    fn update(&self, k: &[u8], bytes: Arc<[u8]>) -> bool {
        match self.0.get_sync(k) {
            Some(mut e) => {
                let v = e.get_mut();
                *v = (v.0 + 1, bytes);
                true
            }
            None => false,
        }
    }
}

impl Map for Dash {
    fn name(&self) -> &'static str {
        "dashmap"
    }
    fn insert(&self, k: Key, v: Value) {
        self.0.insert(k, v);
    }
    fn read(&self, k: &[u8]) -> Option<Vec<u8>> {
        self.0.get(k).map(|v| v.1.to_vec())
    }
    fn update(&self, k: &[u8], bytes: Arc<[u8]>) -> bool {
        match self.0.get_mut(k) {
            Some(mut v) => {
                *v = (v.0 + 1, bytes);
                true
            }
            None => false,
        }
    }
}

impl Map for Papaya {
    fn name(&self) -> &'static str {
        "papaya"
    }
    fn insert(&self, k: Key, v: Value) {
        self.0.pin().insert(k, v);
    }
    fn read(&self, k: &[u8]) -> Option<Vec<u8>> {
        self.0.pin().get(k).map(|v| v.1.to_vec())
    }
    fn update(&self, k: &[u8], bytes: Arc<[u8]>) -> bool {
        // Values are immutable: an update installs a new one.
        self.0
            .pin()
            .update(Arc::from(k), |v| (v.0 + 1, bytes.clone()))
            .is_some()
    }
}

const RECORDS: u64 = 100_000;
const OPS: u64 = 2_000_000;

fn key(n: u64) -> Vec<u8> {
    format!("user{:016x}", n.wrapping_mul(0x9E37_79B9_7F4A_7C15)).into_bytes()
}

/// Operations per second of `threads` threads sharing `OPS` operations,
/// `read_percent` of them reads.
fn run(map: &dyn Map, threads: u64, read_percent: u64) -> f64 {
    let value: Arc<[u8]> = Arc::from(&[7u8; 32][..]);
    let keys: Vec<Vec<u8>> = (0..RECORDS).map(key).collect();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (keys, value) = (&keys, value.clone());
            s.spawn(move || {
                // xorshift: cheap, and the same sequence for every map.
                let mut x = 0x2545_F491_4F6C_DD1D ^ (t + 1);
                for _ in 0..OPS / threads {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let k = &keys[(x % RECORDS) as usize];
                    if (x >> 40) % 100 < read_percent {
                        black_box(map.read(k).expect("loaded"));
                    } else {
                        assert!(map.update(k, value.clone()));
                    }
                }
            });
        }
    });
    (OPS / threads * threads) as f64 / t0.elapsed().as_secs_f64()
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(3);
    let maps: Vec<Box<dyn Map>> = vec![
        Box::new(Scc(scc::HashMap::new())),
        Box::new(Dash(dashmap::DashMap::new())),
        Box::new(Papaya(papaya::HashMap::new())),
    ];
    let value: Arc<[u8]> = Arc::from(&[1u8; 32][..]);
    for m in &maps {
        for n in 0..RECORDS {
            m.insert(Arc::from(key(n)), (1, value.clone()));
        }
    }
    println!(
        "{} cores; {OPS} operations per run, {RECORDS} records of 32 B; median Mops/s over {rounds} rounds, ratio to scc per round, then the median",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:<10} {:>8} {:<8} {:>8} {:>8}  rounds",
        "workload", "threads", "map", "Mops/s", "vs scc"
    );
    for (workload, reads) in [("B (95 %)", 95), ("A (50 %)", 50)] {
        for threads in [1, 2, 16, 100] {
            let mut rates = vec![Vec::new(); maps.len()];
            for round in 0..rounds {
                for i in 0..maps.len() {
                    let m = (i + round) % maps.len();
                    rates[m].push(run(&*maps[m], threads, reads));
                }
            }
            let median = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            for (m, map) in maps.iter().enumerate() {
                let ratios: Vec<f64> = rates[m].iter().zip(&rates[0]).map(|(a, b)| a / b).collect();
                let list: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
                println!(
                    "{workload:<10} {threads:>8} {:<8} {:>8.2} {:>7.2}x  {}",
                    map.name(),
                    median(rates[m].clone()) / 1e6,
                    median(ratios),
                    list.join(", ")
                );
            }
        }
    }
}
