//! Region descriptors as they arrive in messages (`proto::region::
//! Descriptor` through the payload codec: what `dxnet::RemoteRegion` is on
//! the wire) and the check an access makes against one before anything
//! is sent. Decoding never panics and re-encodes to exactly the payload;
//! `check` accepts an access only with the right the descriptor claims
//! and only inside its length, without overflow, and refuses it for the
//! reason it gives.
//!
//! Input: [offset: u64 LE][len: u64 LE][write: u8][descriptor payload].
#![no_main]

use dxnet_proto::codec::{decode, encode_into, encoded_len};
use dxnet_proto::region::{in_bounds, Descriptor, Refusal};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 17 {
        return;
    }
    let offset = u64::from_le_bytes(data[0..8].try_into().unwrap());
    let len = u64::from_le_bytes(data[8..16].try_into().unwrap());
    let write = data[16] & 1 == 1;
    let payload = &data[17..];
    let Ok(d) = decode::<Descriptor>(payload) else {
        return;
    };
    assert_eq!(encoded_len(&d).unwrap(), payload.len());
    let mut out = Vec::with_capacity(payload.len());
    encode_into(&mut out, &d).unwrap();
    assert_eq!(out, payload, "re-encoding differs");
    let right = if write {
        d.access.can_write()
    } else {
        d.access.can_read()
    };
    match d.check(offset, len, write) {
        Ok(()) => {
            assert!(right);
            let end = offset.checked_add(len).expect("accepted without overflow");
            assert!(end <= d.len);
        }
        Err(Refusal::NotPermitted) => assert!(!right),
        Err(Refusal::OutOfBounds) => assert!(right && !in_bounds(offset, len, d.len)),
    }
});
