//! dxnet_proto::codec::decode of hostile payloads into nested serde types:
//! never panics, never allocates beyond what the payload carries (run with
//! -malloc_limit_mb; scripts/fuzz.sh does), and a decoded value re-encodes
//! to exactly the payload (the size computation agrees).
#![no_main]

use dxnet_fuzz::{Item, Nested};
use dxnet_proto::codec::{decode, encode_into, encoded_len};
use libfuzzer_sys::fuzz_target;
use serde::{de::DeserializeOwned, Serialize};

fn roundtrip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(data: &[u8]) {
    if let Ok(v) = decode::<T>(data) {
        assert_eq!(encoded_len(&v).unwrap(), data.len(), "size of {v:?}");
        let mut out = Vec::with_capacity(data.len());
        encode_into(&mut out, &v).unwrap();
        assert_eq!(out, data, "re-encoding differs");
        assert_eq!(decode::<T>(&out).unwrap(), v);
    }
}

fuzz_target!(|data: &[u8]| {
    roundtrip::<Nested>(data);
    roundtrip::<Vec<Item>>(data);
    roundtrip::<(String, Vec<u64>, Option<char>)>(data);
    roundtrip::<Vec<Vec<u8>>>(data);
});
