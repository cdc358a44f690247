//! The storage side of one node: records by key and by id, in memory.
//!
//! Knows nothing of the network: the server ([`crate::server`]) decodes
//! requests and calls these methods from dxnet's handler threads, any number
//! at once.
//!
//! - Records by key live in an [`scc::HashMap`]: one read-write lock per
//!   bucket (no map-wide lock, no spinning), lock-free resizing. Point
//!   operations, the bulk of a YCSB run, touch one bucket. Measured against
//!   dashmap and papaya doing a node's read and update (`benches/maps.rs`):
//!   dashmap 0.8–1.4× scc's rate (slower with 1–2 threads at 50 % updates,
//!   faster with more threads), papaya 0.04–0.95× (it falls apart with
//!   many threads updating). A map operation is about 5 % of a request's
//!   CPU time here (about 0.5 µs of 10 µs), so dashmap's lead would not
//!   show end to end; scc stays, with the ordered index below from the
//!   same crate and no case where the map collapses.
//! - The keys are also kept in order in an [`scc::TreeIndex`] (a B+ tree
//!   with lock-free reads), which `scan` walks. Both share one allocation
//!   per key (`Arc<[u8]>`). A key enters and leaves the tree while its
//!   bucket is locked, so the tree holds exactly the keys of the map.
//! - Records by id (DXRAM's chunks: created here, addressed by a 64-bit id
//!   of this node's id and a local counter) live in a second hash map.
//!
//! Every write gives the record a new version, unique in this store (a
//! store-wide counter): a client reads a version and writes back only if it
//! is unchanged ([`Store::cas`]), which is how read-modify-write loses no
//! update, and what memcached's `cas` unique is.
//!
//! Memory: each record is charged its key and record bytes plus
//! [`ENTRY_OVERHEAD`]; a write that would take the total past
//! [`StoreConfig::max_memory`] fails with [`StoreError::Full`] and changes
//! nothing.

use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::record::Record;

/// Bytes charged per record beyond its key and record bytes: the map and
/// tree entries, the key's and record's allocation headers (an estimate).
pub const ENTRY_OVERHEAD: u64 = 96;

/// Limits of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// Most bytes the records may take (see [`ENTRY_OVERHEAD`]); writes
    /// beyond fail with [`StoreError::Full`].
    pub max_memory: u64,
    /// Largest encoded record accepted, in bytes.
    pub max_record: u32,
    /// Longest key accepted, in bytes.
    pub max_key: u32,
    /// Most records one scan returns (a larger count is cut to this).
    pub max_scan: u32,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            max_memory: 1 << 30,
            max_record: 1 << 20,
            max_key: 4096,
            max_scan: 10_000,
        }
    }
}

/// Why a write was refused. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum StoreError {
    /// The write would take the store past `max_memory`.
    #[error("storage node full: {used} of {limit} bytes used, the write needs {needed} more")]
    Full {
        /// Bytes the store holds.
        used: u64,
        /// Its `max_memory`.
        limit: u64,
        /// Bytes the write would add.
        needed: u64,
    },
    /// The record is larger than `max_record`.
    #[error("record of {size} bytes (at most {max})")]
    RecordTooLarge {
        /// The record's encoded size.
        size: u64,
        /// `max_record`.
        max: u64,
    },
    /// The key is longer than `max_key`.
    #[error("key of {size} bytes (at most {max})")]
    KeyTooLong {
        /// The key's length.
        size: u64,
        /// `max_key`.
        max: u64,
    },
    /// The record sent is not well formed.
    #[error("{0}")]
    BadRecord(String),
    /// Merging an update would give the record too many fields.
    #[error("update would give the record {0} fields (at most {max})", max = crate::record::MAX_FIELDS)]
    TooManyFields(usize),
}

/// A stored record as read: its version and encoded bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Item {
    /// The version of the write that stored it.
    pub version: u64,
    /// The encoded record ([`Record::from_bytes`]).
    #[serde(with = "serde_bytes")]
    pub record: Vec<u8>,
}

/// How a key write treats an existing or missing record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WriteMode {
    /// Store the record whether or not one exists.
    Put,
    /// Store only if no record exists.
    Insert,
    /// Store only if a record exists (replacing it).
    Replace,
    /// Merge the fields into the existing record (only if one exists).
    Update,
    /// Store only if the existing record's version is this one.
    IfVersion(u64),
}

/// Result of a key write that was not refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Written {
    /// Stored with this version.
    Stored(u64),
    /// Not stored: a record exists ([`WriteMode::Insert`]).
    Exists,
    /// Not stored: no record exists (`Replace`, `Update`, `IfVersion`).
    Missing,
    /// Not stored: the record's version is this one, not the expected
    /// ([`WriteMode::IfVersion`]).
    Changed(u64),
}

struct Entry {
    version: u64,
    record: Box<[u8]>,
}

impl Entry {
    fn item(&self, fields: Option<&[String]>) -> Item {
        let record = match fields {
            None => self.record.to_vec(),
            Some(names) => record_view(&self.record).select(names).into_bytes(),
        };
        Item {
            version: self.version,
            record,
        }
    }
}

fn record_view(bytes: &[u8]) -> Record {
    // Stored bytes were validated on the way in.
    Record::from_bytes(bytes.to_vec()).expect("stored records are well formed")
}

/// Counts of a store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreStats {
    /// Records stored by key.
    pub keys: u64,
    /// Records stored by id.
    pub ids: u64,
    /// Bytes charged (see [`ENTRY_OVERHEAD`]).
    pub used: u64,
    /// `max_memory`.
    pub limit: u64,
}

/// The records of one storage node.
pub struct Store {
    config: StoreConfig,
    node: u16,
    keys: scc::HashMap<Arc<[u8]>, Entry>,
    order: scc::TreeIndex<Arc<[u8]>, ()>,
    ids: scc::HashMap<u64, Entry>,
    next_local: AtomicU64,
    next_version: AtomicU64,
    used: AtomicU64,
}

/// Largest local part of a record id (48 bits; the top 16 are the node id).
pub const MAX_LOCAL_ID: u64 = (1 << 48) - 1;

/// A record id from the node that created it and its local id there.
pub fn record_id(node: u16, local: u64) -> u64 {
    (node as u64) << 48 | (local & MAX_LOCAL_ID)
}

/// The node that created record `id`.
pub fn id_node(id: u64) -> u16 {
    (id >> 48) as u16
}

impl Store {
    /// An empty store of node `node`.
    pub fn new(node: u16, config: StoreConfig) -> Self {
        Self {
            config,
            node,
            keys: scc::HashMap::new(),
            order: scc::TreeIndex::new(),
            ids: scc::HashMap::new(),
            next_local: AtomicU64::new(1),
            next_version: AtomicU64::new(1),
            used: AtomicU64::new(0),
        }
    }

    /// The limits.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    fn version(&self) -> u64 {
        self.next_version.fetch_add(1, Ordering::Relaxed)
    }

    /// Charges `n` bytes, or refuses if that passes the limit.
    fn charge(&self, n: u64) -> Result<(), StoreError> {
        let limit = self.config.max_memory;
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            if used.saturating_add(n) > limit {
                return Err(StoreError::Full {
                    used,
                    limit,
                    needed: n,
                });
            }
            match self.used.compare_exchange_weak(
                used,
                used + n,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(u) => used = u,
            }
        }
    }

    fn refund(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::Relaxed);
    }

    /// Charges the change from `old` to `new` bytes.
    fn recharge(&self, old: u64, new: u64) -> Result<(), StoreError> {
        if new > old {
            self.charge(new - old)
        } else {
            self.refund(old - new);
            Ok(())
        }
    }

    fn check_record(&self, r: &Record) -> Result<(), StoreError> {
        let size = r.encoded_len() as u64;
        if size > self.config.max_record as u64 {
            return Err(StoreError::RecordTooLarge {
                size,
                max: self.config.max_record as u64,
            });
        }
        Ok(())
    }

    fn check_key(&self, key: &[u8]) -> Result<(), StoreError> {
        if key.len() as u64 > self.config.max_key as u64 {
            return Err(StoreError::KeyTooLong {
                size: key.len() as u64,
                max: self.config.max_key as u64,
            });
        }
        Ok(())
    }

    fn merge(&self, old: &[u8], update: &Record) -> Result<Record, StoreError> {
        let merged = record_view(old).merged(update);
        if merged.len() > crate::record::MAX_FIELDS {
            return Err(StoreError::TooManyFields(merged.len()));
        }
        self.check_record(&merged)?;
        Ok(merged)
    }

    /// Writes `record` over the existing `entry` (its bucket locked by the
    /// caller) as `mode` says.
    fn rewrite(
        &self,
        entry: &mut Entry,
        record: &Record,
        mode: WriteMode,
    ) -> Result<Written, StoreError> {
        let new_record = match mode {
            WriteMode::Insert => return Ok(Written::Exists),
            WriteMode::IfVersion(v) if v != entry.version => {
                return Ok(Written::Changed(entry.version))
            }
            WriteMode::Update => self.merge(&entry.record, record)?.into_bytes(),
            _ => record.as_bytes().to_vec(),
        };
        self.recharge(entry.record.len() as u64, new_record.len() as u64)?;
        let version = self.version();
        *entry = Entry {
            version,
            record: new_record.into_boxed_slice(),
        };
        Ok(Written::Stored(version))
    }

    /// Writes `record` under `key` as `mode` says.
    pub fn write(
        &self,
        key: &[u8],
        record: &Record,
        mode: WriteMode,
    ) -> Result<Written, StoreError> {
        self.check_key(key)?;
        self.check_record(record)?;
        let size = record.encoded_len() as u64;
        // Existing record: modify it under its bucket lock.
        if let Some(mut e) = self.keys.get_sync(key) {
            return self.rewrite(e.get_mut(), record, mode);
        }
        match mode {
            WriteMode::Replace | WriteMode::Update | WriteMode::IfVersion(_) => {
                return Ok(Written::Missing)
            }
            WriteMode::Put | WriteMode::Insert => {}
        }
        let charge = key.len() as u64 + size + ENTRY_OVERHEAD;
        self.charge(charge)?;
        let k: Arc<[u8]> = Arc::from(key);
        if let scc::hash_map::Entry::Vacant(v) = self.keys.entry_sync(k.clone()) {
            let version = self.version();
            // Under the bucket lock: the tree gets the key exactly when the
            // map does.
            let _ = self.order.insert_sync(k, ());
            v.insert_entry(Entry {
                version,
                record: record.as_bytes().into(),
            });
            return Ok(Written::Stored(version));
        }
        // Another writer stored the key since the look above (its bucket
        // lock is released here): write to the existing record.
        self.refund(charge);
        self.write(key, record, mode)
    }

    /// The record under `key` (only `fields` of it if given).
    pub fn get(&self, key: &[u8], fields: Option<&[String]>) -> Option<Item> {
        self.keys.read_sync(key, |_, e| e.item(fields))
    }

    /// Deletes the record under `key`; returns its version.
    pub fn delete(&self, key: &[u8]) -> Option<u64> {
        let e = self.keys.get_sync(key)?;
        self.order.remove_sync(key);
        let (k, entry) = e.remove_entry();
        self.refund(k.len() as u64 + entry.record.len() as u64 + ENTRY_OVERHEAD);
        Some(entry.version)
    }

    /// Up to `count` records (at most `max_scan`) with keys from `start` on,
    /// in key order. Not a snapshot: a record written during the scan may
    /// or may not be seen, each key at most once.
    pub fn scan(
        &self,
        start: &[u8],
        count: u32,
        fields: Option<&[String]>,
    ) -> Vec<(Vec<u8>, Item)> {
        let count = count.min(self.config.max_scan) as usize;
        let guard = scc::Guard::new();
        let mut out = Vec::with_capacity(count.min(1024));
        for (k, _) in self
            .order
            .range::<[u8], _>((Bound::Included(start), Bound::Unbounded), &guard)
        {
            if out.len() == count {
                break;
            }
            if let Some(item) = self.get(k, fields) {
                out.push((k.to_vec(), item));
            }
        }
        out
    }

    /// Stores `record` under a new id of this node.
    pub fn create(&self, record: &Record) -> Result<(u64, u64), StoreError> {
        self.check_record(record)?;
        let local = self.next_local.fetch_add(1, Ordering::Relaxed);
        if local > MAX_LOCAL_ID {
            return Err(StoreError::Full {
                used: self.used.load(Ordering::Relaxed),
                limit: self.config.max_memory,
                needed: 0,
            });
        }
        self.charge(8 + record.encoded_len() as u64 + ENTRY_OVERHEAD)?;
        let id = record_id(self.node, local);
        let version = self.version();
        let fresh = self.ids.insert_sync(
            id,
            Entry {
                version,
                record: record.as_bytes().into(),
            },
        );
        debug_assert!(fresh.is_ok(), "local ids are never reused");
        Ok((id, version))
    }

    /// The record with id `id`.
    pub fn get_id(&self, id: u64, fields: Option<&[String]>) -> Option<Item> {
        self.ids.read_sync(&id, |_, e| e.item(fields))
    }

    /// Writes the record with id `id`: ids are made by [`Store::create`], so
    /// only the modes that need an existing record apply (`Put` and
    /// `Replace` both replace it; `Insert` is refused as
    /// [`Written::Exists`] or [`Written::Missing`]).
    pub fn write_id(
        &self,
        id: u64,
        record: &Record,
        mode: WriteMode,
    ) -> Result<Written, StoreError> {
        self.check_record(record)?;
        let Some(mut e) = self.ids.get_sync(&id) else {
            return Ok(Written::Missing);
        };
        self.rewrite(e.get_mut(), record, mode)
    }

    /// Deletes the record with id `id`; returns its version.
    pub fn delete_id(&self, id: u64) -> Option<u64> {
        let (_, e) = self.ids.remove_sync(&id)?;
        self.refund(8 + e.record.len() as u64 + ENTRY_OVERHEAD);
        Some(e.version)
    }

    /// Deletes every record (memcached's `flush_all`).
    pub fn clear(&self) {
        self.keys.retain_sync(|k, e| {
            self.order.remove_sync(&**k);
            self.refund(k.len() as u64 + e.record.len() as u64 + ENTRY_OVERHEAD);
            false
        });
        self.ids.retain_sync(|_, e| {
            self.refund(8 + e.record.len() as u64 + ENTRY_OVERHEAD);
            false
        });
    }

    /// Counts.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            keys: self.keys.len() as u64,
            ids: self.ids.len() as u64,
            used: self.used.load(Ordering::Relaxed),
            limit: self.config.max_memory,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(v: &str) -> Record {
        Record::from_fields([("f", v.as_bytes())])
    }

    #[test]
    fn every_write_mode_on_present_and_missing_keys() {
        let s = Store::new(3, StoreConfig::default());
        assert_eq!(
            s.write(b"k", &rec("a"), WriteMode::Replace),
            Ok(Written::Missing)
        );
        assert_eq!(
            s.write(b"k", &rec("a"), WriteMode::Update),
            Ok(Written::Missing)
        );
        assert_eq!(
            s.write(b"k", &rec("a"), WriteMode::IfVersion(1)),
            Ok(Written::Missing)
        );
        let Ok(Written::Stored(v1)) = s.write(b"k", &rec("a"), WriteMode::Insert) else {
            panic!()
        };
        assert_eq!(
            s.write(b"k", &rec("b"), WriteMode::Insert),
            Ok(Written::Exists)
        );
        let Ok(Written::Stored(v2)) = s.write(b"k", &rec("b"), WriteMode::Put) else {
            panic!()
        };
        assert!(v2 > v1);
        assert_eq!(
            s.write(b"k", &rec("c"), WriteMode::IfVersion(v1)),
            Ok(Written::Changed(v2))
        );
        let Ok(Written::Stored(v3)) = s.write(b"k", &rec("c"), WriteMode::IfVersion(v2)) else {
            panic!()
        };
        let up = Record::from_fields([("g", b"x")]);
        let Ok(Written::Stored(v4)) = s.write(b"k", &up, WriteMode::Update) else {
            panic!()
        };
        assert!(v4 > v3);
        let item = s.get(b"k", None).unwrap();
        assert_eq!(item.version, v4);
        let r = Record::from_bytes(item.record).unwrap();
        assert_eq!(r.field("f"), Some(&b"c"[..]));
        assert_eq!(r.field("g"), Some(&b"x"[..]));
        let only_g = s.get(b"k", Some(&["g".to_string()])).unwrap();
        assert_eq!(Record::from_bytes(only_g.record).unwrap().len(), 1);
        assert_eq!(s.delete(b"k"), Some(v4));
        assert_eq!(s.delete(b"k"), None);
        assert_eq!(s.get(b"k", None), None);
        assert_eq!(s.stats().used, 0);
    }

    #[test]
    fn scan_walks_keys_in_order_from_the_start_key() {
        let s = Store::new(
            0,
            StoreConfig {
                max_scan: 5,
                ..Default::default()
            },
        );
        for i in (0..20).rev() {
            s.write(
                format!("key{i:02}").as_bytes(),
                &rec(&i.to_string()),
                WriteMode::Put,
            )
            .unwrap();
        }
        s.delete(b"key07");
        let got: Vec<String> = s
            .scan(b"key05", 4, None)
            .into_iter()
            .map(|(k, _)| String::from_utf8(k).unwrap())
            .collect();
        assert_eq!(got, ["key05", "key06", "key08", "key09"]);
        assert_eq!(s.scan(b"", 100, None).len(), 5, "cut to max_scan");
        assert!(s.scan(b"z", 3, None).is_empty());
    }

    #[test]
    fn memory_limit_refuses_writes_and_changes_nothing() {
        let s = Store::new(
            0,
            StoreConfig {
                max_memory: 1000,
                ..Default::default()
            },
        );
        let big = Record::from_fields([("f", vec![7u8; 500])]);
        assert!(matches!(
            s.write(b"a", &big, WriteMode::Put),
            Ok(Written::Stored(_))
        ));
        let e = s.write(b"b", &big, WriteMode::Put).unwrap_err();
        assert!(matches!(e, StoreError::Full { limit: 1000, .. }), "{e}");
        assert_eq!(s.get(b"b", None), None);
        assert!(s.create(&big).is_err());
        // Smaller records still fit; deleting frees.
        assert!(s.write(b"c", &rec("x"), WriteMode::Put).is_ok());
        s.delete(b"a");
        assert!(s.write(b"b", &big, WriteMode::Put).is_ok());
        s.clear();
        assert_eq!(
            s.stats(),
            StoreStats {
                limit: 1000,
                ..Default::default()
            }
        );
    }

    #[test]
    fn size_limits_are_checked() {
        let s = Store::new(
            0,
            StoreConfig {
                max_record: 100,
                max_key: 8,
                ..Default::default()
            },
        );
        let big = Record::from_fields([("f", vec![0u8; 200])]);
        assert!(matches!(
            s.write(b"k", &big, WriteMode::Put),
            Err(StoreError::RecordTooLarge { .. })
        ));
        assert!(matches!(
            s.write(b"123456789", &rec("x"), WriteMode::Put),
            Err(StoreError::KeyTooLong { .. })
        ));
        assert!(matches!(
            s.create(&big),
            Err(StoreError::RecordTooLarge { .. })
        ));
    }

    #[test]
    fn records_by_id() {
        let s = Store::new(7, StoreConfig::default());
        let (a, va) = s.create(&rec("a")).unwrap();
        let (b, _) = s.create(&rec("b")).unwrap();
        assert_ne!(a, b);
        assert_eq!(id_node(a), 7);
        assert_eq!(s.get_id(a, None).unwrap().version, va);
        assert_eq!(
            s.write_id(a, &rec("z"), WriteMode::Insert),
            Ok(Written::Exists)
        );
        assert!(matches!(
            s.write_id(a, &rec("z"), WriteMode::Put),
            Ok(Written::Stored(_))
        ));
        assert_eq!(
            s.write_id(record_id(7, 999), &rec("z"), WriteMode::Put),
            Ok(Written::Missing)
        );
        assert!(s.delete_id(b).is_some());
        assert_eq!(s.get_id(b, None), None);
        assert_eq!(s.stats().ids, 1);
    }

    #[test]
    fn concurrent_version_checked_increments_lose_no_update() {
        let s = Store::new(0, StoreConfig::default());
        s.write(b"n", &Record::value(b"0"), WriteMode::Put).unwrap();
        std::thread::scope(|sc| {
            for _ in 0..8 {
                sc.spawn(|| {
                    for _ in 0..500 {
                        loop {
                            let item = s.get(b"n", None).unwrap();
                            let r = Record::from_bytes(item.record).unwrap();
                            let n: u64 = std::str::from_utf8(r.plain_value().unwrap())
                                .unwrap()
                                .parse()
                                .unwrap();
                            let next = Record::value((n + 1).to_string().as_bytes());
                            match s
                                .write(b"n", &next, WriteMode::IfVersion(item.version))
                                .unwrap()
                            {
                                Written::Stored(_) => break,
                                Written::Changed(_) => continue,
                                other => panic!("{other:?}"),
                            }
                        }
                    }
                });
            }
        });
        let r = Record::from_bytes(s.get(b"n", None).unwrap().record).unwrap();
        assert_eq!(r.plain_value(), Some(&b"4000"[..]));
    }

    #[test]
    fn concurrent_inserts_and_deletes_keep_map_and_order_in_step() {
        let s = Store::new(0, StoreConfig::default());
        std::thread::scope(|sc| {
            for t in 0..6u8 {
                let s = &s;
                sc.spawn(move || {
                    for i in 0..2000u32 {
                        let key = (i % 37).to_be_bytes();
                        if (i + t as u32).is_multiple_of(3) {
                            s.delete(&key);
                        } else {
                            s.write(&key, &rec("v"), WriteMode::Put).unwrap();
                        }
                    }
                });
            }
        });
        let scanned: Vec<Vec<u8>> = s
            .scan(b"", 1000, None)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        let guard = scc::Guard::new();
        assert_eq!(s.order.iter(&guard).count(), s.stats().keys as usize);
        assert_eq!(scanned.len(), s.stats().keys as usize);
        let per_key = 4 + rec("v").encoded_len() as u64 + ENTRY_OVERHEAD;
        assert_eq!(s.stats().used, per_key * s.stats().keys);
    }
}
