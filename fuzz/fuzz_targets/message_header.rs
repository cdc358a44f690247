//! MessageHeader::decode on any 12 bytes and any limit: never panics; an
//! accepted header respects the limit and the flag rules, and re-encodes to
//! exactly the input bytes.
#![no_main]

use dxnet_proto::header::{
    HeaderError, MessageHeader, FLAGS_KNOWN, FLAG_ERROR, FLAG_REQUEST, FLAG_RESPONSE, HEADER_LEN,
    HEADER_MAGIC,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut b = [0u8; HEADER_LEN];
    let n = data.len().min(HEADER_LEN);
    b[..n].copy_from_slice(&data[..n]);
    // Limit: the next 4 bytes if present, else the default 64 MiB.
    let max = match data.get(HEADER_LEN..HEADER_LEN + 4) {
        Some(m) => u32::from_le_bytes(m.try_into().unwrap()) as usize,
        None => 64 << 20,
    };
    match MessageHeader::decode(&b, max) {
        Ok(h) => {
            assert_eq!(b[0], HEADER_MAGIC);
            assert!(h.payload_len as usize <= max);
            assert_eq!(h.flags & !FLAGS_KNOWN, 0);
            assert!(!(h.flags & FLAG_REQUEST != 0 && h.flags & FLAG_RESPONSE != 0));
            assert!(h.flags & FLAG_ERROR == 0 || h.flags & FLAG_RESPONSE != 0);
            let mut e = [0u8; HEADER_LEN];
            h.encode(&mut e);
            assert_eq!(e, b, "re-encoding changes the header");
            assert_eq!(h.type_key(), (b[1] as u16) << 8 | b[2] as u16);
        }
        Err(HeaderError::BadMagic(m)) => assert!(m == b[0] && m != HEADER_MAGIC),
        Err(HeaderError::BadFlags(f)) => assert_eq!(f, b[3]),
        Err(HeaderError::TooLong { len, max: m }) => {
            assert_eq!(m, max);
            assert!(len as usize > max);
        }
        Err(HeaderError::Truncated) => panic!("header decoding reported a truncated unit"),
    }
});
