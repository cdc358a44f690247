//! The requests a client sends to a storage node and their responses, as
//! dxnet request types (message type [`MESSAGE_TYPE`], one subtype each).
//!
//! Keys and records travel as byte strings (`serde_bytes`: one length and
//! one copy, not a byte at a time). A record's bytes are checked by the
//! server ([`crate::Record::from_bytes`]) before the store sees them.

use serde::{Deserialize, Serialize};

use crate::store::{Item, StoreError, StoreStats, WriteMode, Written};

/// The dxnet message type of every dxkv message (subtypes 1..).
pub const MESSAGE_TYPE: u8 = 202;

/// Why a request was refused by the storage node.
pub type Refused = StoreError;

/// Reads the record under `key`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Get {
    /// The record's key.
    #[serde(with = "serde_bytes")]
    pub key: Vec<u8>,
    /// Only these fields (all if `None`).
    pub fields: Option<Vec<String>>,
}

/// A record read, or `None` if there is none.
#[derive(Debug, Serialize, Deserialize)]
pub struct Found(pub Option<Item>);

/// Writes a record under `key`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Write {
    /// The record's key.
    #[serde(with = "serde_bytes")]
    pub key: Vec<u8>,
    /// The record, encoded (`Record::to_bytes`).
    #[serde(with = "serde_bytes")]
    pub record: Vec<u8>,
    /// How to write it: insert, update, replace, or only over a given version.
    pub mode: WriteMode,
}

/// The outcome of a write.
#[derive(Debug, Serialize, Deserialize)]
pub struct WriteResult(pub Result<Written, Refused>);

/// Deletes the record under `key`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Delete {
    /// The record's key.
    #[serde(with = "serde_bytes")]
    pub key: Vec<u8>,
}

/// The deleted record's version, `None` if there was none.
#[derive(Debug, Serialize, Deserialize)]
pub struct Deleted(pub Option<u64>);

/// Reads several records of one storage node.
#[derive(Debug, Serialize, Deserialize)]
pub struct MultiGet {
    /// The keys.
    pub keys: Vec<serde_bytes::ByteBuf>,
    /// Only these fields (all if `None`).
    pub fields: Option<Vec<String>>,
}

/// One answer per key, in the keys' order.
#[derive(Debug, Serialize, Deserialize)]
pub struct MultiFound(pub Vec<Option<Item>>);

/// Writes several records of one storage node (each as `mode`).
#[derive(Debug, Serialize, Deserialize)]
pub struct MultiWrite {
    /// The keys with their encoded records.
    pub items: Vec<(serde_bytes::ByteBuf, serde_bytes::ByteBuf)>,
    /// How to write it: insert, update, replace, or only over a given version.
    pub mode: WriteMode,
}

/// One outcome per item, in the items' order.
#[derive(Debug, Serialize, Deserialize)]
pub struct MultiWritten(pub Vec<Result<Written, Refused>>);

/// Up to `count` records of one storage node with keys from `start` on.
#[derive(Debug, Serialize, Deserialize)]
pub struct Scan {
    /// The first key (bytewise order).
    #[serde(with = "serde_bytes")]
    pub start: Vec<u8>,
    /// At most this many records.
    pub count: u32,
    /// Only these fields (all if `None`).
    pub fields: Option<Vec<String>>,
}

/// The records scanned, in key order.
#[derive(Debug, Serialize, Deserialize)]
pub struct Scanned(pub Vec<(serde_bytes::ByteBuf, Item)>);

/// Stores a record under a new id of the storage node.
#[derive(Debug, Serialize, Deserialize)]
pub struct Create {
    /// The record, encoded (`Record::to_bytes`).
    #[serde(with = "serde_bytes")]
    pub record: Vec<u8>,
}

/// The new record's id and version.
#[derive(Debug, Serialize, Deserialize)]
pub struct Created(pub Result<(u64, u64), Refused>);

/// Reads the record with id `id`.
#[derive(Debug, Serialize, Deserialize)]
pub struct GetId {
    /// The record's id.
    pub id: u64,
    /// Only these fields (all if `None`).
    pub fields: Option<Vec<String>>,
}

/// Writes the record with id `id`.
#[derive(Debug, Serialize, Deserialize)]
pub struct WriteId {
    /// The record's id.
    pub id: u64,
    /// The record, encoded (`Record::to_bytes`).
    #[serde(with = "serde_bytes")]
    pub record: Vec<u8>,
    /// How to write it: insert, update, replace, or only over a given version.
    pub mode: WriteMode,
}

/// Deletes the record with id `id`.
#[derive(Debug, Serialize, Deserialize)]
pub struct DeleteId {
    /// The record's id.
    pub id: u64,
}

/// Deletes every record of the storage node.
#[derive(Debug, Serialize, Deserialize)]
pub struct Clear;

/// Done.
#[derive(Debug, Serialize, Deserialize)]
pub struct Cleared;

/// Asks for the storage node's counts.
#[derive(Debug, Serialize, Deserialize)]
pub struct GetStats;

/// The storage node's counts.
#[derive(Debug, Serialize, Deserialize)]
pub struct Stats(pub StoreStats);

dxnet::request!(Get, MESSAGE_TYPE, 1 => Found);
dxnet::message!(Found, MESSAGE_TYPE, 2);
dxnet::request!(Write, MESSAGE_TYPE, 3 => WriteResult);
dxnet::message!(WriteResult, MESSAGE_TYPE, 4);
dxnet::request!(Delete, MESSAGE_TYPE, 5 => Deleted);
dxnet::message!(Deleted, MESSAGE_TYPE, 6);
dxnet::request!(MultiGet, MESSAGE_TYPE, 7 => MultiFound);
dxnet::message!(MultiFound, MESSAGE_TYPE, 8);
dxnet::request!(MultiWrite, MESSAGE_TYPE, 9 => MultiWritten);
dxnet::message!(MultiWritten, MESSAGE_TYPE, 10);
dxnet::request!(Scan, MESSAGE_TYPE, 11 => Scanned);
dxnet::message!(Scanned, MESSAGE_TYPE, 12);
dxnet::request!(Create, MESSAGE_TYPE, 13 => Created);
dxnet::message!(Created, MESSAGE_TYPE, 14);
dxnet::request!(GetId, MESSAGE_TYPE, 15 => Found);
dxnet::request!(WriteId, MESSAGE_TYPE, 16 => WriteResult);
dxnet::request!(DeleteId, MESSAGE_TYPE, 17 => Deleted);
dxnet::request!(Clear, MESSAGE_TYPE, 18 => Cleared);
dxnet::message!(Cleared, MESSAGE_TYPE, 19);
dxnet::request!(GetStats, MESSAGE_TYPE, 20 => Stats);
dxnet::message!(Stats, MESSAGE_TYPE, 21);
