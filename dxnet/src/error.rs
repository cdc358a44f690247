//! The error type every fallible dxnet call returns.

use crate::NodeId;

/// Everything that can go wrong when sending, requesting or configuring.
///
/// Errors are values a caller can match on: a timeout is not an unreachable
/// node, and neither is a decode failure; [`Waited`] says which wait timed
/// out and [`Unreachable`] why a node could not be reached.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The node could not be reached: not in the node map, connecting
    /// failed, or the connection broke while the operation was in flight.
    #[error("destination {0} unreachable: {1}")]
    Unreachable(NodeId, Unreachable),
    /// The operation did not complete in time: a request's response, or a
    /// send blocked by back-pressure (flow-control window or full ring
    /// buffer).
    #[error("timed out waiting for {0}")]
    Timeout(Waited),
    /// A pending request was cancelled (see [`Cancelled`]).
    #[error("response cancelled: {0}")]
    Cancelled(Cancelled),
    /// No receiver is registered for this (type, subtype) pair.
    #[error("unknown message type ({0}, {1})")]
    UnknownMessageType(u8, u8),
    /// A message or response could not be (de)serialized.
    #[error("decode failure: {0}")]
    Decode(String),
    /// A message exceeds the configured `max_message_size`.
    #[error("message of {size} bytes exceeds max_message_size {max}")]
    TooLarge {
        /// Size of the message.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// The configuration is invalid (the text says which field and why).
    #[error("configuration error: {0}")]
    Config(String),
    /// A receiver was registered twice for the same (type, subtype).
    #[error("a receiver for ({0}, {1}) is already registered")]
    AlreadyRegistered(u8, u8),
    /// The transport could not be started (e.g. port in use, no RDMA device).
    #[error("transport error: {0}")]
    Transport(String),
    /// The node is shutting down or has shut down.
    #[error("node is shut down")]
    Shutdown,
    /// A one-sided access to a memory region failed (see [`RegionError`]).
    #[error("region access failed: {0}")]
    Region(RegionError),
}

/// Why a one-sided access ([`crate::Node::write`], [`crate::Node::read`],
/// a [`crate::Region`]'s own accesses) failed. Nothing was written or read
/// (except where a multi-part write says otherwise).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegionError {
    /// The range is not inside the region.
    #[error("bytes {offset}..{offset}+{len} are outside the region's {region_len} bytes")]
    OutOfBounds {
        /// Start of the access.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// The region was exposed without read access.
    #[error("the region does not permit reading")]
    ReadNotPermitted,
    /// The region was exposed without write access.
    #[error("the region does not permit writing")]
    WriteNotPermitted,
    /// The region was revoked, or its node does not know it (it restarted
    /// since the descriptor was made, or the descriptor is forged).
    #[error("the region is revoked or unknown at its node")]
    Revoked,
    /// The range of the own region a write takes its bytes from, or a
    /// read puts them in ([`crate::Node::write_from`],
    /// [`crate::Node::read_into`]), is not inside it.
    #[error("bytes {offset}..{offset}+{len} are outside the local region's {region_len} bytes")]
    LocalOutOfBounds {
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: u64,
        /// The local region's length.
        region_len: u64,
    },
    /// The region given as the local side of an access belongs to another
    /// node (each node's regions are registered with its own engine).
    #[error("the local region belongs to another node")]
    NotOwnRegion,
    /// The memory for a new region could not be had (or its length is 0).
    #[error("cannot allocate a region of {0} bytes")]
    Allocation(usize),
    /// A buffer could not be registered with the device
    /// ([`crate::Node::register_buffer`]); accesses from it are copied.
    #[error("cannot register a buffer of {len} bytes: {reason}")]
    Registration {
        /// The buffer's length.
        len: u64,
        /// Why: over `zero_copy.max_pinned_bytes`, registered with another
        /// node's device, or the device's refusal (e.g. the locked-memory
        /// limit).
        reason: String,
    },
}

/// Why a node could not be reached ([`Error::Unreachable`]). The text
/// of each cause is for people; match on the variant.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unreachable {
    /// The node map has no address for the node.
    #[error("not in the node map")]
    NotInNodeMap,
    /// No connection could be set up: resolving the address, connecting,
    /// the connection handshake or its authentication failed, or it did not
    /// finish within `connect_timeout_ms`.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The connection closed or broke (the text is why) while the operation
    /// needed it.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
    /// The node was removed from the node map ([`crate::Node::remove_node`]).
    #[error("removed from the node map")]
    Removed,
    /// Discovery is on and the node has not answered its probes (yet, or
    /// since its connection was lost).
    #[error("not discovered (it has not answered discovery probes)")]
    Undiscovered,
}

impl Unreachable {
    /// The detail text (without the cause's prefix).
    pub fn detail(&self) -> &str {
        match self {
            Unreachable::NotInNodeMap => "not in the node map",
            Unreachable::Removed => "removed from the node map",
            Unreachable::Undiscovered => "not discovered",
            Unreachable::Connect(s) | Unreachable::ConnectionLost(s) => s,
        }
    }
}

/// What a timed-out operation waited for ([`Error::Timeout`]).
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Waited {
    /// A request's response (the request's timeout).
    #[error("the response")]
    Response,
    /// A send's turn in the connection's flow-control window
    /// (`send_timeout_ms`): the receiver processes slower than this node
    /// sends.
    #[error("flow-control window (send blocked)")]
    FlowControl,
    /// Space in the connection's outgoing ring buffer (`send_timeout_ms`):
    /// the transport writes slower than this node's threads send. (A
    /// message larger than half the ring that times out after its first
    /// part went out also closes the connection: its stream is broken.)
    #[error("ring-buffer space (send blocked)")]
    RingBuffer,
    /// Room in this node's own incoming queue, for a message a node sends
    /// to itself (`send_timeout_ms`).
    #[error("room in the own incoming queue (send to self blocked)")]
    IncomingQueue,
    /// Nodes to be discovered ([`crate::Node::wait_for_nodes`]).
    #[error("nodes to be discovered")]
    Nodes,
    /// The device to finish sending a buffer in place
    /// ([`crate::Node::send_buffer`], `send_timeout_ms`).
    #[error("the device to send the buffer")]
    Device,
}

/// Why a pending request was cancelled ([`Error::Cancelled`]).
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cancelled {
    /// Its connection was closed for a reason other than a failure (the
    /// connection limit, or the node shut down).
    #[error("connection closed")]
    ConnectionClosed,
    /// The response was taken already (`ResponseHandle::try_take`).
    #[error("response already taken")]
    AlreadyTaken,
    /// The destination's request handler panicked.
    #[error("the remote request handler panicked")]
    RemoteHandlerPanicked,
}

impl From<dxnet_proto::codec::CodecError> for Error {
    fn from(e: dxnet_proto::codec::CodecError) -> Self {
        Error::Decode(e.0)
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
