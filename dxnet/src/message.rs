//! Typed messages and requests; the 12-byte message header on the wire
//! (defined in `dxnet-proto`, re-exported here).
//!
//! Any serde type becomes a message by implementing [`Message`] (usually via
//! [`message!`](macro@crate::message)): it then has a (type, subtype) id pair that
//! selects its receiver at the destination. Type 0 is reserved for dxnet's
//! own control messages.

use serde::{de::DeserializeOwned, Serialize};

/// A message that can be sent to a node: any serde type with a (type,
/// subtype) id pair. Type 0 is reserved.
pub trait Message: Serialize + DeserializeOwned + Send + 'static {
    /// Message type id (1..=255; 0 is reserved for dxnet itself).
    const TYPE: u8;
    /// Message subtype id.
    const SUBTYPE: u8;
}

/// A message that expects a typed [`Request::Response`].
pub trait Request: Message {
    /// The response type; it travels with the response flag and the request id.
    type Response: Message;
}

/// Implements [`Message`] for a serde type.
///
/// ```
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Hello { text: String }
/// dxnet::message!(Hello, 1, 0);
/// ```
#[macro_export]
macro_rules! message {
    ($ty:ty, $t:expr, $s:expr) => {
        impl $crate::Message for $ty {
            const TYPE: u8 = $t;
            const SUBTYPE: u8 = $s;
        }
    };
}

/// Implements [`Request`] (and [`Message`]) for a serde type.
///
/// ```
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Get { key: u64 }
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Value { data: Vec<u8> }
/// dxnet::message!(Value, 2, 1);
/// dxnet::request!(Get, 2, 0 => Value);
/// ```
#[macro_export]
macro_rules! request {
    ($ty:ty, $t:expr, $s:expr => $resp:ty) => {
        $crate::message!($ty, $t, $s);
        impl $crate::Request for $ty {
            type Response = $resp;
        }
    };
}

pub use dxnet_proto::header::{
    type_key, HeaderError, MessageHeader, MessageKind, FLAGS_KNOWN, FLAG_ERROR, FLAG_REQUEST,
    FLAG_RESPONSE, HEADER_LEN, HEADER_MAGIC,
};
