//! Serde encoding of message payloads (bincode, fixed-width integers).
//!
//! Senders compute the exact size first (no allocation), reserve that much
//! in the ring buffer and serialize straight into it.

use bincode::Options;
use serde::{de::DeserializeOwned, Serialize};

use crate::{Error, Result};

fn options() -> impl Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
}

/// Exact encoded size of `value`.
pub fn encoded_len<T: Serialize + ?Sized>(value: &T) -> Result<usize> {
    options()
        .serialized_size(value)
        .map(|n| n as usize)
        .map_err(|e| Error::Decode(format!("cannot size message: {e}")))
}

/// Serializes `value` into `w`.
pub fn encode_into<W: std::io::Write, T: Serialize + ?Sized>(
    w: W,
    value: &T,
) -> std::io::Result<()> {
    options()
        .serialize_into(w, value)
        .map_err(|e| std::io::Error::other(e.to_string()))
}

/// Deserializes a `T` from exactly `bytes`. Length fields inside the payload
/// are bounded by the payload size, so a hostile payload cannot make this
/// allocate more than it carries.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    options()
        .with_limit(bytes.len() as u64)
        .reject_trailing_bytes()
        .deserialize(bytes)
        .map_err(|e| Error::Decode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    enum E {
        A(u8),
        B { s: String },
    }
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Nested {
        v: Vec<Option<E>>,
        name: String,
        t: (u64, i32),
    }

    #[test]
    fn roundtrip_nested_and_exact_size() {
        let n = Nested {
            v: vec![Some(E::A(1)), None, Some(E::B { s: "x".into() })],
            name: "hello".into(),
            t: (7, -3),
        };
        let len = encoded_len(&n).unwrap();
        let mut buf = Vec::new();
        encode_into(&mut buf, &n).unwrap();
        assert_eq!(buf.len(), len);
        assert_eq!(decode::<Nested>(&buf).unwrap(), n);
        assert!(decode::<Nested>(&buf[..len - 1]).is_err());
    }

    #[test]
    fn hostile_length_is_rejected() {
        // A Vec<u8> claiming 2^60 elements in 8 bytes.
        let bytes = (1u64 << 60).to_le_bytes();
        assert!(decode::<Vec<u8>>(&bytes).is_err());
    }
}
