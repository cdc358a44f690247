//! Push-based data shuffle among the threads of many processes on dxnet's
//! one-sided operations (the RDMA middleware design of
//! `../shared/papers`: writers push, nobody pulls remote memory).
//!
//! Every process of a shuffle (a list of dxnet node ids, one per process)
//! runs `threads` workers. Worker `w = p * threads + t` is thread `t` of
//! process `p`. Each worker pushes records to any worker with a
//! [`Pusher`] and reads the records addressed to it with a [`Puller`]: a
//! blocking `Iterator`, [`Puller::try_next`] without waiting, an async
//! `Stream` (`futures_core::Stream`), or [`Puller::next_with`], which
//! lends each record's bytes to a closure instead of copying them into a
//! [`Record`] (no allocation per record).
//!
//! ```no_run
//! # fn demo(node: std::sync::Arc<dxnet::Node>) -> Result<(), dxshuffle::ShuffleError> {
//! use dxshuffle::{Shuffle, ShuffleConfig};
//! let nodes = vec![dxnet::NodeId(0), dxnet::NodeId(1)];
//! let shuffle = Shuffle::new(node, ShuffleConfig::new(nodes, 4))?;
//! // On each of the 4 threads t of this process:
//! let t = 0;
//! // Pull while pushing (pushers wait once their destinations' buffers
//! // are full of records nobody reads).
//! let puller = shuffle.puller(t)?;
//! let pulling = std::thread::spawn(move || -> Result<(), dxshuffle::ShuffleError> {
//!     for record in puller {                // until every worker finished
//!         let (key, value): (String, u64) = record?.decode()?;
//!     }
//!     Ok(())
//! });
//! let mut pusher = shuffle.pusher(t)?;
//! pusher.push(5, &("key", 42u64))?;        // to worker 5
//! pusher.finish()?;                        // this worker's stream ends
//! pulling.join().expect("puller thread")?;
//! # Ok(()) }
//! ```
//!
//! **One-sided mode** ([`Mode::OneSided`], the default). Every worker
//! exposes one incoming region with a circular segment of
//! `segment_bytes` per sending worker (so each segment has one writer).
//! A pusher lays records into its outgoing buffer for each destination
//! and, once `batch_bytes` are pending (or at `flush`/`finish`), writes the
//! pending range straight into the remote segment. Where writes leave a
//! region in place ([`dxnet::Node::writes_from_region_in_place`]:
//! InfiniBand) that buffer is a registered mirror of the destination's
//! segment, and the write ([`dxnet::Node::write_with_notify_from_async`])
//! an RDMA WRITE from it, followed by a notification. Where writes are
//! emulated (TCP, loopback) their bytes are copied into the connection's
//! ring when posted, so records wait in a plain buffer instead
//! ([`dxnet::Node::write_with_notify_async`]): no lock per record. The
//! puller reads records out of its segments as
//! notifications arrive and tells each writer how far it has read (a small
//! message), which frees remote room.
//!
//! **Back-pressure.** A push never waits for a remote segment: while it is
//! full, records stay in the pusher's outgoing buffer and are written at
//! the pusher's next call once the puller made room (the paper's network
//! thread posts them on its own; here the pusher's next push, `flush` or
//! `finish` does). A push waits only for
//! room in its own outgoing buffer for that destination (`segment_bytes`),
//! up to `timeout` ([`ShuffleError::Timeout`]).
//!
//! **Messages mode** ([`Mode::Messages`]): the same API over plain dxnet
//! messages (batches of `batch_bytes`), the sockets-style push design the
//! paper compares with; dxnet's flow control is its back-pressure. Each
//! batch keeps its share of the sending process's flow-control window
//! ([`dxnet::Node::register_raw_held`]) until its puller has read it, so a
//! push to a process whose pullers lag waits (up to dxnet's send timeout)
//! once that process holds a window's worth of unread batches from this
//! one. Pullers read large batches in place, in dxnet's receive buffers
//! (see [`dxnet::HeldMessage`]). Batches to a puller of the own process
//! skip dxnet (no message, no copy): at most 64 of them wait unread per
//! puller, and a pusher with another one for it waits, up to `timeout`.
//! Pullers of one process share the window of each sending process and
//! hold back its own pushers when full: run them concurrently (a thread
//! each), as the paper's receiving threads do.
//!
//! **Guarantees.** Every record pushed reaches its destination worker
//! exactly once, and records of one pusher to one destination in order. A
//! record larger than [`Shuffle::max_record`] (the segment's size less a
//! 4-byte header) is refused with [`ShuffleError::RecordTooLarge`]. A
//! puller that sees no record for `timeout` while some senders have not
//! finished ends with [`ShuffleError::Timeout`] (a dead peer, or a worker
//! that never finished); a pusher whose destination died fails with
//! [`ShuffleError::Net`]. Memory: per process, `threads` incoming regions
//! and up to `threads` outgoing buffers of `workers × segment_bytes` each
//! (one-sided). In messages mode each pusher holds one batch per
//! destination, and the inboxes of a process hold at most dxnet's
//! `flow_control_window` of unread batches per other sending process, and
//! 64 batches from its own pushers per puller (each `batch_bytes` and at
//! most one record more; a puller keeps as many read ones for reuse).
//!
//! A shuffle takes its node's receiver of region-write notifications and
//! its message types (201, 1..=4): one shuffle per node.

#![warn(missing_docs)]

mod frame;
mod shuffle;

pub use shuffle::{Puller, Pusher, Record, Shuffle};

use std::time::Duration;

use dxnet::NodeId;

/// How records travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Remote writes into the destination's circular segments.
    OneSided,
    /// Plain dxnet messages.
    Messages,
}

/// A shuffle's shape and sizes; the same at every process.
#[derive(Debug, Clone)]
pub struct ShuffleConfig {
    /// The processes, one dxnet node each, in worker order.
    pub nodes: Vec<NodeId>,
    /// Workers (threads) per process.
    pub threads: usize,
    /// Bytes of the circular segment each sender has at each receiver
    /// (and of a pusher's outgoing buffer per destination); a multiple of
    /// 8, at least 64. The largest record is this less 4.
    pub segment_bytes: usize,
    /// Pending bytes per destination that make a pusher write (one-sided)
    /// or send a batch (messages). A one-sided write carries at most this
    /// many bytes (unless one record is larger); a multiple of 4096 fills
    /// whole packets of a RoCE device's 4 KiB MTU. On InfiniBand each
    /// write is a work request the device acknowledges and is followed by
    /// a notification, so larger batches (64 KiB, with 256 KiB segments:
    /// four times the memory) carry the same records in fewer of them.
    pub batch_bytes: usize,
    /// How long a push waits for room, a flush for its writes, a puller
    /// for the next record, and set-up for the other processes.
    pub timeout: Duration,
    /// How records travel.
    pub mode: Mode,
}

impl ShuffleConfig {
    /// `threads` workers on each of `nodes`, one-sided, 64 KiB segments,
    /// 16 KiB batches, 30 s timeout.
    pub fn new(nodes: Vec<NodeId>, threads: usize) -> ShuffleConfig {
        ShuffleConfig {
            nodes,
            threads,
            segment_bytes: 64 << 10,
            batch_bytes: 16 << 10,
            timeout: Duration::from_secs(30),
            mode: Mode::OneSided,
        }
    }
}

/// Why a shuffle operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShuffleError {
    /// The configuration cannot work (the text says why).
    #[error("shuffle configuration: {0}")]
    Config(String),
    /// A record larger than the segment allows.
    #[error("record of {len} bytes is larger than the {max} bytes a segment takes")]
    RecordTooLarge {
        /// The record's length.
        len: usize,
        /// The largest record.
        max: usize,
    },
    /// No room, no writes done or no record within the timeout.
    #[error("shuffle timed out waiting for {0}")]
    Timeout(&'static str),
    /// dxnet failed (a peer unreachable, a send timed out, ...).
    #[error(transparent)]
    Net(#[from] dxnet::Error),
    /// A peer sent what no worker's stream holds: a frame that is not one,
    /// frames or batches after the stream's end, a batch twice or numbered
    /// far ahead of the stream. (Batches and writes a peer sends for
    /// workers of other processes are dropped.)
    #[error("bad data from worker {from}: {why}")]
    Corrupt {
        /// The writing worker.
        from: usize,
        /// What was wrong.
        why: String,
    },
    /// A record did not decode as the type asked for.
    #[error("record does not decode: {0}")]
    Decode(String),
    /// The pusher or puller of this thread was handed out already, or the
    /// pusher finished.
    #[error("{0}")]
    State(&'static str),
}

/// The README's code, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
