//! dxkv: a distributed in-memory key-value store on dxnet, in the style of
//! DXRAM (the store the Ibdxnet paper evaluates with YCSB).
//!
//! - Storage nodes ([`Server`]) hold records in memory ([`store`]); client
//!   nodes ([`Client`]) route each operation to the storage node of its key
//!   (hash partitioning, see [`client`]) or of its record id, as dxnet
//!   requests. A node can be both.
//! - A record ([`Record`]) is a set of named fields in one buffer. Records
//!   are addressed by key (any bytes) or by a 64-bit id made by `create`
//!   (the creating storage node's id in the top 16 bits, a local counter
//!   below, as DXRAM's chunk ids).
//! - Operations: get (all or some fields), put / insert / replace / update
//!   (merge fields) / version-checked write, delete, read-modify-write
//!   (version checked, loses no update), scan (a key range, over all nodes
//!   or one partition), multi-get and multi-write (one request per storage
//!   node), and the same by id.
//! - In memory only, like DXRAM with backup off: a storage node that
//!   restarts comes back empty; while it is down, its keys fail with
//!   dxnet's `Unreachable` or `Timeout` errors within the client's timeout,
//!   and the other nodes' keys keep working.

#![warn(missing_docs)]

pub mod client;
pub mod memcached;
pub mod protocol;
pub mod record;
pub mod server;
pub mod store;
pub mod ycsb;

pub use client::{Client, Error, Result, Versioned};
pub use record::Record;
pub use server::Server;
pub use store::{StoreConfig, StoreError, WriteMode, Written};

/// The README's code, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
