//! # dxnet-proto
//!
//! The dxnet protocol without I/O: byte formats and the pure logic over
//! them. No sockets, no threads, no clock reads; everything that parses
//! bytes from the network is here and is fuzzed (`fuzz/`). Being its own
//! crate makes that a compiler rule: it cannot reach the runtime.
//!
//! - [`header`]: the 12-byte message header and its [`header::MessageKind`].
//! - [`codec`]: message payloads (postcard's format via serde, size
//!   computed first, decoding bounded in depth and work).
//! - [`decoder`]: reassembly of messages across received buffers.
//! - [`bounds`]: where messages begin and end in a stream, from their
//!   headers' lengths (so a receiver can keep a message in one buffer).
//! - [`handshake`]: the connection handshake's state machine (dialer and
//!   acceptor roles), driven over a TCP stream or UDP datagrams.
//! - [`wire`]: handshake messages, the handshake datagram header, the TCP
//!   chunk header, InfiniBand immediate data and close notices.
//! - [`discovery`]: the discovery datagram (probe, answer, conflict) of
//!   runtime membership.
//! - [`identity`]: node identities (Ed25519) and the signed handshake
//!   material.
//! - [`region`]: one-sided operations (remote write and read of exposed
//!   memory) carried as messages, and the owner's answers.

#![warn(missing_docs)]

pub mod bounds;
pub mod codec;
pub mod decoder;
pub mod discovery;
pub mod handshake;
pub mod header;
pub mod identity;
pub mod region;
pub mod wire;
