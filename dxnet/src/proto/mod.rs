//! The protocol: byte formats and the pure logic over them. No I/O, no
//! threads, no clock reads; everything that parses bytes from the network
//! is here and is fuzzed (`fuzz/`).
//!
//! - [`codec`]: message payloads (bincode via serde, size computed first).
//! - [`depth`]: a nesting-depth limit for decoding untrusted payloads.
//! - [`decoder`]: reassembly of messages across received buffers.
//! - [`wire`]: TCP handshake and chunk header, InfiniBand immediate data
//!   and connection-exchange datagrams.
//! - [`identity`]: node identities (ed25519) and the signed handshake
//!   material.
//!
//! The message header itself is in [`message`](mod@crate::message).

pub mod codec;
pub mod decoder;
pub mod depth;
pub mod identity;
pub mod wire;
