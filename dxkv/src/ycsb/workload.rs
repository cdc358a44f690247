//! YCSB's core workload: its properties, the standard workloads A–F and the
//! paper's two as presets, key names, record contents and the choice of
//! each operation (YCSB's `CoreWorkload`).

use std::fmt;
use std::str::FromStr;

use rand::RngExt;
use serde::{Deserialize, Serialize};

use super::generator::{
    fnv_hash64, AcknowledgedCounter, Hotspot, Rng, ScrambledZipfian, SkewedLatest, Uniform,
    Zipfian, ZIPFIAN_CONSTANT,
};
use crate::record::Record;

/// Which records the operations pick (`requestdistribution`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Distribution {
    /// Every record equally often.
    Uniform,
    /// Scrambled zipfian (constant 0.99): a few records very often,
    /// scattered over the key space.
    Zipfian,
    /// Zipfian over the inserts so far, the newest most often.
    Latest,
    /// `hotspotopnfraction` of the operations on the first
    /// `hotspotdatafraction` of the records.
    Hotspot,
}

/// The length of each scan (`scanlengthdistribution`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScanLength {
    /// Uniform in 1..=maxscanlength.
    Uniform,
    /// Zipfian in 1..=maxscanlength (short scans most often).
    Zipfian,
}

/// The length of each field value (`fieldlengthdistribution`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FieldLength {
    /// Always `fieldlength` bytes.
    Constant,
    /// Uniform in 1..=fieldlength.
    Uniform,
    /// Zipfian in 1..=fieldlength (short values most often).
    Zipfian,
}

/// The properties of a YCSB core workload (YCSB's names, lower case).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Workload {
    /// Records loaded in the load phase.
    pub recordcount: u64,
    /// Operations of the run phase (over all client threads).
    pub operationcount: u64,
    /// Fields per record.
    pub fieldcount: u32,
    /// Bytes per field value (the largest, unless constant).
    pub fieldlength: u32,
    /// How field lengths vary: constant, uniform or zipfian up to `fieldlength`.
    pub fieldlengthdistribution: FieldLength,
    /// Reads fetch every field (else one random field).
    pub readallfields: bool,
    /// Updates write every field (else one random field).
    pub writeallfields: bool,
    /// Share of reads among the run phase's operations.
    pub readproportion: f64,
    /// Share of updates.
    pub updateproportion: f64,
    /// Share of inserts (of new keys).
    pub insertproportion: f64,
    /// Share of scans.
    pub scanproportion: f64,
    /// Share of read-modify-writes.
    pub readmodifywriteproportion: f64,
    /// Which keys operations pick: uniform, zipfian, latest or hotspot.
    pub requestdistribution: Distribution,
    /// Longest scan.
    pub maxscanlength: u32,
    /// How scan lengths vary up to `maxscanlength`.
    pub scanlengthdistribution: ScanLength,
    /// Key numbers hashed into key names (YCSB's default `hashed`), else
    /// in order.
    pub insertorder_hashed: bool,
    /// With the hotspot distribution: the share of keys that are hot.
    pub hotspotdatafraction: f64,
    /// With the hotspot distribution: the share of operations on hot keys.
    pub hotspotopnfraction: f64,
}

impl Default for Workload {
    fn default() -> Self {
        Self {
            recordcount: 1000,
            operationcount: 1000,
            fieldcount: 10,
            fieldlength: 100,
            fieldlengthdistribution: FieldLength::Constant,
            readallfields: true,
            writeallfields: false,
            readproportion: 0.95,
            updateproportion: 0.05,
            insertproportion: 0.0,
            scanproportion: 0.0,
            readmodifywriteproportion: 0.0,
            requestdistribution: Distribution::Uniform,
            maxscanlength: 1000,
            scanlengthdistribution: ScanLength::Uniform,
            insertorder_hashed: true,
            hotspotdatafraction: 0.2,
            hotspotopnfraction: 0.8,
        }
    }
}

/// The part of a workload one of several benchmark clients runs. YCSB runs
/// one client per process; with `of` of them against one store, client
/// `index` loads its own slice of the records (YCSB's `insertstart` and
/// `insertcount`), reads and updates any loaded record, and inserts new keys
/// of its own (key numbers `recordcount + index + k * of`), so no two clients
/// insert the same key and each reads back only inserts it saw finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Share {
    /// This client, `0..of`.
    pub index: u64,
    /// The number of clients.
    pub of: u64,
}

impl Default for Share {
    fn default() -> Self {
        Share { index: 0, of: 1 }
    }
}

impl Share {
    /// Client `index` of `of`.
    pub fn new(index: u64, of: u64) -> Result<Self, String> {
        if of == 0 || index >= of {
            return Err(format!("client {index} of {of}: needs index < count"));
        }
        Ok(Share { index, of })
    }

    /// The key numbers this client loads.
    pub fn load_range(&self, recordcount: u64) -> std::ops::Range<u64> {
        let part = |i: u64| (recordcount as u128 * i as u128 / self.of as u128) as u64;
        part(self.index)..part(self.index + 1)
    }

    /// The key number of this client's `n`-th key, counting the loaded
    /// records first: loaded ones are everyone's, later ones its own.
    pub fn key_number(&self, recordcount: u64, n: u64) -> u64 {
        if n < recordcount {
            n
        } else {
            recordcount + (n - recordcount) * self.of + self.index
        }
    }
}

/// The named presets.
pub const PRESETS: &[&str] = &["a", "b", "c", "d", "e", "f", "paper-a", "paper-b"];

impl Workload {
    /// A preset: YCSB's workloads `a`–`f` (its `workloads/workloada` ...
    /// files) or the Ibdxnet paper's `paper-a` (10 × 100 B fields, 100 %
    /// reads, uniform) and `paper-b` (one 32 B field, 100 % reads,
    /// uniform).
    pub fn preset(name: &str) -> Option<Self> {
        let d = Self::default();
        let read_only = |fields, len| Self {
            fieldcount: fields,
            fieldlength: len,
            readproportion: 1.0,
            updateproportion: 0.0,
            requestdistribution: Distribution::Uniform,
            ..Self::default()
        };
        Some(
            match name.to_ascii_lowercase().trim_start_matches("workload") {
                "a" => Self {
                    readproportion: 0.5,
                    updateproportion: 0.5,
                    requestdistribution: Distribution::Zipfian,
                    ..d
                },
                "b" => Self {
                    requestdistribution: Distribution::Zipfian,
                    ..d
                },
                "c" => Self {
                    readproportion: 1.0,
                    updateproportion: 0.0,
                    requestdistribution: Distribution::Zipfian,
                    ..d
                },
                "d" => Self {
                    updateproportion: 0.0,
                    insertproportion: 0.05,
                    requestdistribution: Distribution::Latest,
                    ..d
                },
                "e" => Self {
                    readproportion: 0.0,
                    updateproportion: 0.0,
                    scanproportion: 0.95,
                    insertproportion: 0.05,
                    requestdistribution: Distribution::Zipfian,
                    maxscanlength: 100,
                    ..d
                },
                "f" => Self {
                    readproportion: 0.5,
                    updateproportion: 0.0,
                    readmodifywriteproportion: 0.5,
                    requestdistribution: Distribution::Zipfian,
                    ..d
                },
                "paper-a" => read_only(10, 100),
                "paper-b" => read_only(1, 32),
                _ => return None,
            },
        )
    }

    /// Checks the properties.
    pub fn validate(&self) -> Result<(), String> {
        let p = [
            self.readproportion,
            self.updateproportion,
            self.insertproportion,
            self.scanproportion,
            self.readmodifywriteproportion,
        ];
        if p.iter().any(|&x| !(0.0..=1.0).contains(&x)) || p.iter().sum::<f64>() <= 0.0 {
            return Err("operation proportions must be in 0..=1 and not all 0".into());
        }
        if self.fieldcount == 0 || self.fieldcount > 1000 {
            return Err("fieldcount must be 1..=1000".into());
        }
        if self.recordcount == 0 {
            return Err("recordcount must be at least 1".into());
        }
        if self.maxscanlength == 0 {
            return Err("maxscanlength must be at least 1".into());
        }
        Ok(())
    }

    /// The key name of key number `n` (`user` and the number, hashed
    /// unless `insertorder_hashed` is off).
    pub fn key(&self, n: u64) -> String {
        let n = if self.insertorder_hashed {
            fnv_hash64(n)
        } else {
            n
        };
        format!("user{n}")
    }

    /// Field `i`'s name.
    pub fn field_name(i: u32) -> String {
        format!("field{i}")
    }

    /// The value of field `field` of key `key` as written with `stamp`
    /// (deterministic, so a read can be checked against it; its length
    /// follows `fieldlengthdistribution`).
    pub fn value(&self, key: &str, field: u32, stamp: u64) -> Vec<u8> {
        let mut x =
            xxhash_rust::xxh3::xxh3_64_with_seed(key.as_bytes(), field as u64 ^ stamp << 20) | 1;
        let max = self.fieldlength.max(1) as u64;
        let len = match self.fieldlengthdistribution {
            FieldLength::Constant => max,
            FieldLength::Uniform => 1 + x % max,
            FieldLength::Zipfian => {
                let mut rng = <Rng as rand::SeedableRng>::seed_from_u64(x);
                Zipfian::new(1, max, ZIPFIAN_CONSTANT).next(&mut rng)
            }
        };
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                b' ' + (x % 95) as u8
            })
            .collect()
    }

    /// The record of key `key` as loaded: every field, stamp 0.
    pub fn record(&self, key: &str) -> Record {
        Record::from_fields(
            (0..self.fieldcount).map(|f| (Self::field_name(f), self.value(key, f, 0))),
        )
    }

    /// The fields an update writes (all, or one at random).
    pub fn update_fields(&self, key: &str, rng: &mut Rng) -> Record {
        let stamp = rng.random::<u32>() as u64 + 1;
        if self.writeallfields {
            Record::from_fields(
                (0..self.fieldcount).map(|f| (Self::field_name(f), self.value(key, f, stamp))),
            )
        } else {
            let f = rng.random_range(0..self.fieldcount);
            Record::from_fields([(Self::field_name(f), self.value(key, f, stamp))])
        }
    }

    /// The fields a read asks for (`None`: all).
    pub fn read_fields(&self, rng: &mut Rng) -> Option<Vec<String>> {
        (!self.readallfields).then(|| vec![Self::field_name(rng.random_range(0..self.fieldcount))])
    }
}

impl FromStr for Workload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::preset(s)
            .ok_or_else(|| format!("unknown workload {s:?} (presets: {})", PRESETS.join(", ")))
    }
}

/// An operation of the run phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Insert a new key.
    Insert,
    /// Read one record.
    Read,
    /// Update fields of one record.
    Update,
    /// Read records in key order from a key on.
    Scan,
    /// Read a record and write it back changed.
    #[serde(rename = "read-modify-write")]
    ReadModifyWrite,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Insert => "insert",
            Op::Read => "read",
            Op::Update => "update",
            Op::Scan => "scan",
            Op::ReadModifyWrite => "read-modify-write",
        })
    }
}

enum KeyChooser {
    Uniform(Uniform),
    Zipfian(ScrambledZipfian),
    Latest(SkewedLatest),
    Hotspot(Hotspot),
}

/// The run phase's shared state: which operation comes next and on which
/// key (one per run, used by every client thread).
pub struct Chooser {
    workload: Workload,
    share: Share,
    keys: KeyChooser,
    inserts: AcknowledgedCounter,
    scan_len: Option<Zipfian>,
    cumulative: [(f64, Op); 5],
}

impl Chooser {
    /// For the run after a load of `workload.recordcount` records.
    pub fn new(workload: &Workload) -> Self {
        Self::with_share(workload, Share::default())
    }

    /// For client `share` of several (see [`Share`]).
    pub fn with_share(workload: &Workload, share: Share) -> Self {
        let w = workload.clone();
        let n = w.recordcount;
        let inserts = AcknowledgedCounter::new(n);
        // As YCSB: zipfian keys range over the records expected by the end
        // (twice the expected inserts, for safety); picks past the inserts
        // acknowledged so far are drawn again.
        let expected_new = (w.operationcount as f64 * w.insertproportion * 2.0) as u64;
        let keys = match w.requestdistribution {
            Distribution::Uniform => KeyChooser::Uniform(Uniform::new(0, n - 1)),
            Distribution::Zipfian => {
                KeyChooser::Zipfian(ScrambledZipfian::new(0, n + expected_new - 1))
            }
            Distribution::Latest => KeyChooser::Latest(SkewedLatest::new(&inserts)),
            Distribution::Hotspot => KeyChooser::Hotspot(Hotspot::new(
                0,
                n - 1,
                w.hotspotdatafraction,
                w.hotspotopnfraction,
            )),
        };
        let scan_len = (w.scanlengthdistribution == ScanLength::Zipfian)
            .then(|| Zipfian::new(1, w.maxscanlength as u64, ZIPFIAN_CONSTANT));
        let mut acc = 0.0;
        let mut cumulative = [(0.0, Op::Read); 5];
        for (i, (p, op)) in [
            (w.readproportion, Op::Read),
            (w.updateproportion, Op::Update),
            (w.insertproportion, Op::Insert),
            (w.scanproportion, Op::Scan),
            (w.readmodifywriteproportion, Op::ReadModifyWrite),
        ]
        .into_iter()
        .enumerate()
        {
            acc += p;
            cumulative[i] = (acc, op);
        }
        Self {
            workload: w,
            share,
            keys,
            inserts,
            scan_len,
            cumulative,
        }
    }

    /// The workload.
    pub fn workload(&self) -> &Workload {
        &self.workload
    }

    /// The next operation.
    pub fn op(&self, rng: &mut Rng) -> Op {
        let total = self.cumulative[4].0;
        let u = rng.random::<f64>() * total;
        self.cumulative
            .iter()
            .find(|(c, _)| u < *c)
            .map_or(self.cumulative[4].1, |&(_, op)| op)
    }

    /// Which share of the workload this chooser runs.
    pub fn share(&self) -> Share {
        self.share
    }

    /// The key number an operation other than insert touches: one whose
    /// insert finished.
    pub fn existing_key(&self, rng: &mut Rng) -> u64 {
        let n = self.existing_sequence(rng);
        self.share.key_number(self.workload.recordcount, n)
    }

    fn existing_sequence(&self, rng: &mut Rng) -> u64 {
        loop {
            let limit = self.inserts.last();
            let k = match &self.keys {
                KeyChooser::Uniform(u) => u.next(rng),
                KeyChooser::Zipfian(z) => z.next(rng),
                KeyChooser::Latest(l) => l.next(&self.inserts, rng),
                KeyChooser::Hotspot(h) => h.next(rng),
            };
            if k < limit {
                return k;
            }
        }
    }

    /// The sequence number of a new key to insert (its key number is
    /// [`Chooser::key_number`]); call [`Chooser::inserted`] once done.
    pub fn new_key(&self) -> u64 {
        self.inserts.next()
    }

    /// The key number of sequence number `n`.
    pub fn key_number(&self, n: u64) -> u64 {
        self.share.key_number(self.workload.recordcount, n)
    }

    /// Marks sequence number `n`'s insert as finished.
    pub fn inserted(&self, n: u64) {
        self.inserts.acknowledge(n);
    }

    /// A scan's length.
    pub fn scan_length(&self, rng: &mut Rng) -> u32 {
        match &self.scan_len {
            Some(z) => z.next(rng) as u32,
            None => rng.random_range(1..=self.workload.maxscanlength),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn field_lengths_follow_their_distribution() {
        let lens = |d| {
            let w = Workload {
                fieldlengthdistribution: d,
                fieldlength: 100,
                ..Workload::default()
            };
            (0..2000u32)
                .map(|i| w.value(&w.key(i as u64), i % 10, 0).len())
                .collect::<Vec<_>>()
        };
        assert!(lens(FieldLength::Constant).iter().all(|&l| l == 100));
        let u = lens(FieldLength::Uniform);
        assert!(u.iter().all(|&l| (1..=100).contains(&l)));
        let mean = u.iter().sum::<usize>() as f64 / u.len() as f64;
        assert!((45.0..56.0).contains(&mean), "{mean}");
        let z = lens(FieldLength::Zipfian);
        assert!(z.iter().all(|&l| (1..=100).contains(&l)));
        let short = z.iter().filter(|&&l| l <= 5).count();
        assert!(
            short > z.len() / 4,
            "zipfian lengths favour short values: {short}"
        );
    }

    #[test]
    fn presets_have_ycsb_proportions() {
        for p in PRESETS {
            Workload::preset(p).unwrap().validate().unwrap();
        }
        let e = Workload::preset("workloade").unwrap();
        assert_eq!(
            (e.scanproportion, e.insertproportion, e.maxscanlength),
            (0.95, 0.05, 100)
        );
        let b = Workload::preset("paper-b").unwrap();
        assert_eq!(
            (b.fieldcount, b.fieldlength, b.readproportion),
            (1, 32, 1.0)
        );
        assert!("nope".parse::<Workload>().is_err());
    }

    #[test]
    fn operations_come_in_their_proportions() {
        let mut w = Workload::preset("a").unwrap();
        w.readproportion = 0.6;
        w.updateproportion = 0.1;
        w.insertproportion = 0.1;
        w.scanproportion = 0.1;
        w.readmodifywriteproportion = 0.1;
        let c = Chooser::new(&w);
        let mut rng = Rng::seed_from_u64(7);
        let mut counts = std::collections::BTreeMap::new();
        let n = 100_000;
        for _ in 0..n {
            *counts.entry(c.op(&mut rng)).or_insert(0) += 1;
        }
        for (op, want) in [
            (Op::Read, 0.6),
            (Op::Update, 0.1),
            (Op::Insert, 0.1),
            (Op::Scan, 0.1),
            (Op::ReadModifyWrite, 0.1),
        ] {
            let got = counts[&op] as f64 / n as f64;
            assert!((got - want).abs() < 0.01, "{op}: {got}");
        }
    }

    #[test]
    fn keys_are_loaded_ones_and_values_are_deterministic() {
        let w = Workload {
            recordcount: 500,
            requestdistribution: Distribution::Zipfian,
            insertproportion: 0.5,
            ..Workload::default()
        };
        let c = Chooser::new(&w);
        let mut rng = Rng::seed_from_u64(1);
        for _ in 0..10_000 {
            assert!(c.existing_key(&mut rng) < 500);
        }
        let k = c.new_key();
        assert_eq!(k, 500);
        assert_eq!(c.key_number(k), 500);
        c.inserted(k);
        let r = w.record(&w.key(3));
        assert_eq!(r.len(), 10);
        assert_eq!(r.field("field9").unwrap().len(), 100);
        assert_eq!(r, w.record(&w.key(3)));
        assert_ne!(w.key(3), w.key(4));
        assert_eq!(
            Workload {
                insertorder_hashed: false,
                ..w.clone()
            }
            .key(3),
            "user3"
        );
    }

    #[test]
    fn shares_load_disjoint_slices_and_insert_disjoint_keys() {
        let w = Workload {
            recordcount: 1003,
            insertproportion: 0.5,
            ..Workload::default()
        };
        let mut loaded = Vec::new();
        let mut inserted = std::collections::BTreeSet::new();
        for i in 0..4 {
            let share = Share::new(i, 4).unwrap();
            loaded.extend(share.load_range(w.recordcount));
            let c = Chooser::with_share(&w, share);
            for _ in 0..100 {
                let n = c.new_key();
                assert!(inserted.insert(c.key_number(n)), "key inserted twice");
                c.inserted(n);
            }
            // Reads reach the loaded records and this client's own inserts.
            let mut rng = Rng::seed_from_u64(i);
            for _ in 0..1000 {
                let k = c.existing_key(&mut rng);
                assert!(k < w.recordcount || (k - w.recordcount) % 4 == i, "{k}");
            }
        }
        assert_eq!(loaded, (0..1003).collect::<Vec<_>>());
        assert!(inserted.iter().all(|&k| k >= 1003));
        assert!(Share::new(4, 4).is_err() && Share::new(0, 0).is_err());
    }
}
