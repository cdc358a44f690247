//! dxnet_proto::codec::decode of hostile payloads into nested serde types:
//! never panics, never allocates beyond what the payload carries (run with
//! -malloc_limit_mb; scripts/fuzz.sh does), a decoded value re-encodes to
//! exactly the payload (the size computation agrees), and postcard's own
//! decoder reads the same value from it.
#![no_main]

use dxnet_fuzz::{Item, Nested};
use dxnet_proto::codec::{decode, encode_into, encoded_len};
use libfuzzer_sys::fuzz_target;
use serde::{de::DeserializeOwned, Serialize};

fn roundtrip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(data: &[u8]) {
    match decode::<T>(data) {
        Ok(v) => {
            assert_eq!(encoded_len(&v).unwrap(), data.len(), "size of {v:?}");
            let mut out = Vec::with_capacity(data.len());
            encode_into(&mut out, &v).unwrap();
            assert_eq!(out, data, "re-encoding differs");
            assert_eq!(decode::<T>(&out).unwrap(), v);
            match postcard::take_from_bytes::<T>(data) {
                Ok((theirs, rest)) => {
                    assert_eq!(theirs, v, "postcard reads another value");
                    assert!(rest.is_empty(), "postcard leaves {} bytes", rest.len());
                }
                Err(e) => panic!("postcard refuses what we accept ({e}): {v:?}"),
            }
        }
        // Past our depth limit postcard's decoder (it has none) could
        // overflow the stack; other refusals it must share, unless its
        // reading is not the payload's one encoding (a varint with
        // trailing zero groups, which postcard accepts and never writes).
        Err(e) if e.0.contains("nesting deeper") || e.0.contains("more elements than") => {}
        Err(e) => {
            if let Ok((theirs, rest)) = postcard::take_from_bytes::<T>(data) {
                let mut canonical = Vec::new();
                encode_into(&mut canonical, &theirs).unwrap();
                assert!(
                    !rest.is_empty() || canonical != data,
                    "we refuse ({e}) the encoding of {theirs:?}"
                );
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    roundtrip::<Nested>(data);
    roundtrip::<Vec<Item>>(data);
    roundtrip::<(String, Vec<u64>, Option<char>)>(data);
    roundtrip::<Vec<Vec<u8>>>(data);
});
