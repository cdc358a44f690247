//! Serde encoding of message payloads: postcard's format (varint integers,
//! length-prefixed strings and sequences, no field names).
//!
//! Senders compute the exact size first (no allocation), reserve that much
//! in the ring buffer and serialize straight into it or into a scratch
//! buffer ([`encode_append`]). Both ends announce [`CODEC_ID`] in the
//! handshake, so nodes built with different payload formats refuse to
//! connect instead of misreading each other's messages.
//!
//! Encoding and sizing are postcard's own serializer; decoding is
//! [`decode`], a deserializer of the same format that keeps the text of
//! errors and bounds what a hostile payload can cost.

use std::io;

use postcard::ser_flavors::{Flavor, Size};
use serde::{de::DeserializeOwned, Serialize};

mod decode;
#[cfg(test)]
mod tests;

/// The payload format's id in the handshake: 1 is postcard 1.x's format.
pub const CODEC_ID: u8 = 1;

/// A readable name of a payload format id, for error messages.
pub fn codec_name(id: u8) -> &'static str {
    match id {
        CODEC_ID => "postcard 1",
        _ => "unknown",
    }
}

/// A payload that could not be sized, encoded or decoded (the text says
/// why).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CodecError(pub String);

/// `Result` with [`CodecError`].
pub type Result<T, E = CodecError> = std::result::Result<T, E>;

/// Deepest nesting [`decode`] accepts: far beyond any sensible message, far
/// below what overflows a 2 MiB thread stack (debug builds included).
pub const MAX_DEPTH: usize = 256;

/// Exact encoded size of `value`.
pub fn encoded_len<T: Serialize + ?Sized>(value: &T) -> Result<usize> {
    postcard::serialize_with_flavor(value, Size::default())
        .map_err(|e| CodecError(format!("cannot size message: {e}")))
}

/// Serializes `value` into `w`.
pub fn encode_into<W: io::Write, T: Serialize + ?Sized>(w: W, value: &T) -> io::Result<()> {
    let mut ser = postcard::Serializer {
        output: ToWriter { w, failed: None },
    };
    match value.serialize(&mut ser) {
        Ok(()) => Ok(()),
        Err(e) => Err(ser
            .output
            .failed
            .unwrap_or_else(|| io::Error::other(format!("cannot encode message: {e}")))),
    }
}

/// Serializes `value` at the end of `buf`. The same bytes as
/// [`encode_into`], with no writer between the serializer and the vector
/// (a `Vec<u8>` payload is a push per byte).
pub fn encode_append<T: Serialize + ?Sized>(buf: &mut Vec<u8>, value: &T) -> Result<()> {
    postcard::serialize_with_flavor(value, ToVec(buf))
        .map_err(|e| CodecError(format!("cannot encode message: {e}")))
}

/// Deserializes a `T` from exactly `bytes`. Length fields inside the payload
/// are bounded by the payload size, so a hostile payload cannot make this
/// allocate more than it carries or loop longer than its bytes allow, and
/// values nested more than [`MAX_DEPTH`] levels deep are rejected, so it
/// cannot overflow the stack either.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    let mut de = decode::Decoder::new(bytes);
    let value = T::deserialize(&mut de).map_err(|e| CodecError(*e.0))?;
    let rest = de.rest().len();
    if rest != 0 {
        return Err(CodecError(format!(
            "{rest} bytes remaining after the value (of {})",
            bytes.len()
        )));
    }
    Ok(value)
}

/// A flavor writing to an `io::Write`, keeping the writer's error (postcard
/// keeps only "buffer full").
struct ToWriter<W> {
    w: W,
    failed: Option<io::Error>,
}

impl<W: io::Write> Flavor for ToWriter<W> {
    type Output = ();

    #[inline]
    fn try_push(&mut self, b: u8) -> postcard::Result<()> {
        self.try_extend(&[b])
    }

    #[inline]
    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        self.w.write_all(data).map_err(|e| {
            self.failed = Some(e);
            postcard::Error::SerializeBufferFull
        })
    }

    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
}

/// A flavor appending to a borrowed vector.
struct ToVec<'a>(&'a mut Vec<u8>);

impl Flavor for ToVec<'_> {
    type Output = ();

    #[inline]
    fn try_push(&mut self, b: u8) -> postcard::Result<()> {
        self.0.push(b);
        Ok(())
    }

    #[inline]
    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(data);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
}
