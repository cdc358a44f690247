//! # dxnet
//!
//! Typed, aggregating messaging for highly concurrent distributed
//! applications, following the design of DXNet and its InfiniBand transport
//! Ibdxnet.
//!
//! Any thread sends a serde message to a 16-bit node id; the message is
//! serialized by the calling thread straight into the connection's outgoing
//! ring buffer (ORB), where concurrent senders aggregate implicitly. A
//! dedicated send thread hands the ring's contents to the transport
//! (loopback, TCP or InfiniBand/RoCE); at the destination, pooled receive
//! buffers pass through a bounded incoming queue to message-handler threads
//! that reassemble and dispatch the messages to registered receivers.
//!
//! Public API: [`Node`], [`Config`] (with its sections in [`config`]),
//! [`Message`] and [`Request`] (see [`mod@message`]), [`Error`], [`NodeId`],
//! [`NodeStats`]; one-sided access to exposed memory ([`Region`],
//! [`RemoteRegion`], see [`mod@region`]); connection events
//! ([`events::ConnectionEvent`], see [`mod@events`]); the node map at run
//! time and its discovery ([`Node::add_node`], [`Node::wait_for_nodes`],
//! [`DiscoveryConfig`]); pull receivers
//! ([`PullReceiver`], see [`mod@pull`]); `pki` with the `pki-gen` feature; [`proto`], the
//! protocol without I/O, for fuzzing and protocol tools.
//!
//! Inside (private; `ARCHITECTURE.md` maps them): `core`, the
//! transport-independent runtime (send path, handler threads, incoming
//! queue, flow control, request table, connection state); `primitives`,
//! the concurrency primitives it builds on (ring buffer, write interest,
//! buffer pool, parking, wait queue, counters), which import nothing from
//! the layers above; `transport`, the engines behind one trait (loopback,
//! TCP, InfiniBand).
//!
//! Cargo features: `tcp` (default), `tls`, `pki-gen`, `ib`, `metrics`;
//! `docs/configuration.md` lists what each adds.

#![warn(missing_docs)]
// A build with the loopback engine only leaves the parts of the runtime
// that serve network engines (receive threads, inline completion) unused.
#![cfg_attr(not(any(feature = "tcp", feature = "ib")), allow(dead_code))]

pub mod breakdown;
pub mod buffer;
pub mod config;
pub(crate) mod core;
pub mod error;
pub mod events;
pub mod launch;
pub mod message;
mod node;
#[cfg(feature = "pki-gen")]
pub mod pki;
pub(crate) mod primitives;
pub mod pull;
pub mod region;
/// The protocol without I/O (the `dxnet-proto` crate).
pub use dxnet_proto as proto;
pub(crate) mod transport;

pub use buffer::{Buffer, BufferHandle, SendHandle};
pub use config::{
    Config, DiscoveryConfig, MetricsConfig, TlsConfig, TransportKind, ZeroCopyConfig,
};
pub use core::metrics::ConnectionStats;
pub use error::{Cancelled, Error, RegionError, Result, Unreachable, Waited};
pub use message::{Message, Request};
pub use node::{HeldMessage, MultiSend, Node, NodeStats, ResponseHandle};
pub use pull::{PullReceiver, RecvError};
pub use region::{Access, Region, RemoteRegion};

/// A node's 16-bit id.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct NodeId(pub u16);

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "node {}", self.0)
    }
}

/// The README's code, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
