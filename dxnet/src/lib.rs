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
//! Layout:
//! - [`Node`], [`Config`], [`Message`], [`Request`], [`Error`]: the public API.
//! - [`core`]: the transport-independent runtime (send path, handler
//!   threads, incoming queue, flow control, request table, connection
//!   state).
//! - [`proto`]: the protocol without I/O (codec, reassembly, wire formats,
//!   identities).
//! - [`primitives`]: the concurrency primitives the layers above build on
//!   (ring buffer, write interest, buffer pool, parking, counters); they
//!   import nothing from the layers above.
//! - [`transport`]: the engines behind one trait.

#![warn(missing_docs)]

pub mod config;
pub mod core;
mod error;
pub mod message;
mod node;
#[cfg(feature = "pki-gen")]
pub mod pki;
pub mod primitives;
pub mod proto;
pub mod transport;

pub use config::{Config, TlsConfig, TransportKind};
pub use error::{Error, Result};
pub use message::{Message, Request};
pub use node::{Node, NodeStats, ResponseHandle};

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
