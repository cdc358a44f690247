//! The error type every fallible dxnet call returns.

use crate::NodeId;

/// Everything that can go wrong when sending, requesting or configuring.
///
/// Errors are values a caller can match on: a timeout is not an unreachable
/// node, and neither is a decode failure.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum Error {
    /// The node could not be reached: no address known, connecting failed, or
    /// the connection broke while the operation was in flight.
    #[error("destination {0} unreachable: {1}")]
    Unreachable(NodeId, String),
    /// The operation did not complete in time (request response, or a send
    /// blocked by back-pressure: flow-control window or full ring buffer).
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// A pending request was cancelled (its connection was closed for reasons
    /// other than a failure, e.g. the connection limit, or the node shut down).
    #[error("response cancelled: {0}")]
    Cancelled(&'static str),
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
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
