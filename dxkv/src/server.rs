//! A storage node: serves the requests of [`crate::protocol`] from a
//! [`Store`] on a dxnet node's handler threads.
//!
//! Point operations (get, write, delete, create, by key or id) run on the
//! handler thread that decodes their connection ([`Node::register_request`]):
//! a lookup costs far less than handing the request to another thread
//! (1.25–1.47× the YCSB `paper-b` reads/s of handing every request over,
//! 100 client threads, `dxkv local`, 3 interleaved rounds). The requests of
//! one client node are served in arrival order. Multi-key operations,
//! scans, `clear` and stats, which take longer, are handed to whichever
//! handler thread is free ([`Node::register_request_parallel`]), so one
//! does not hold up the point operations behind it. Requests a client
//! thread issued one after the other (waiting for each) take effect in
//! that order; requests in flight together (async, multi-key) in any order.

use std::sync::Arc;

use dxnet::Node;

use crate::protocol::*;
use crate::record::Record;
use crate::store::{Store, StoreConfig, StoreError};

/// The storage side of a dxnet node.
pub struct Server {
    store: Arc<Store>,
}

fn record(bytes: Vec<u8>) -> Result<Record, StoreError> {
    Record::from_bytes(bytes).map_err(|e| StoreError::BadRecord(e.to_string()))
}

impl Server {
    /// Serves a new, empty store on `node` (its handlers stay registered
    /// for the node's lifetime).
    pub fn start(node: &Node, config: StoreConfig) -> dxnet::Result<Self> {
        let store = Arc::new(Store::new(node.id().0, config));
        let s = store.clone();
        node.register_request(move |_, r: Get| Found(s.get(&r.key, r.fields.as_deref())))?;
        let s = store.clone();
        node.register_request(move |_, r: Write| {
            WriteResult(record(r.record).and_then(|rec| s.write(&r.key, &rec, r.mode)))
        })?;
        let s = store.clone();
        node.register_request(move |_, r: Delete| Deleted(s.delete(&r.key)))?;
        let s = store.clone();
        node.register_request_parallel(move |_, r: MultiGet| {
            let f = r.fields.as_deref();
            MultiFound(r.keys.iter().map(|k| s.get(k, f)).collect())
        })?;
        let s = store.clone();
        node.register_request_parallel(move |_, r: MultiWrite| {
            MultiWritten(
                r.items
                    .into_iter()
                    .map(|(k, v)| record(v.into_vec()).and_then(|rec| s.write(&k, &rec, r.mode)))
                    .collect(),
            )
        })?;
        let s = store.clone();
        node.register_request_parallel(move |_, r: Scan| {
            Scanned(
                s.scan(&r.start, r.count, r.fields.as_deref())
                    .into_iter()
                    .map(|(k, item)| (serde_bytes::ByteBuf::from(k), item))
                    .collect(),
            )
        })?;
        let s = store.clone();
        node.register_request(move |_, r: Create| {
            Created(record(r.record).and_then(|rec| s.create(&rec)))
        })?;
        let s = store.clone();
        node.register_request(move |_, r: GetId| Found(s.get_id(r.id, r.fields.as_deref())))?;
        let s = store.clone();
        node.register_request(move |_, r: WriteId| {
            WriteResult(record(r.record).and_then(|rec| s.write_id(r.id, &rec, r.mode)))
        })?;
        let s = store.clone();
        node.register_request(move |_, r: DeleteId| Deleted(s.delete_id(r.id)))?;
        let s = store.clone();
        node.register_request_parallel(move |_, _: Clear| {
            s.clear();
            Cleared
        })?;
        let s = store.clone();
        node.register_request_parallel(move |_, _: GetStats| Stats(s.stats()))?;
        Ok(Self { store })
    }

    /// The store served.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }
}
