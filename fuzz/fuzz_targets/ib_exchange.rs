//! The InfiniBand engine's UDP exchange datagram (node discovery and
//! queue-pair exchange), Exchange::decode on datagrams of any length, with
//! and without a cluster secret: never panics; an accepted datagram
//! re-encodes to one that decodes to the same value; and with a secret,
//! flipping any bit of an authentic datagram gets it rejected.
//!
//! Input: [secret length: u8][secret][datagram].
#![no_main]

use dxnet::core::wire::{
    decode_imm, encode_imm, Exchange, HandshakeError, EXCHANGE_LEN, EXCHANGE_MAGIC,
    PROTOCOL_VERSION,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = (n as usize).min(rest.len());
    let (secret, dgram) = rest.split_at(n);
    let secret = (!secret.is_empty()).then_some(secret);

    // Whatever arrives on the UDP port.
    match Exchange::decode(dgram, secret) {
        Ok(m) => {
            assert_eq!(dgram.len(), EXCHANGE_LEN);
            let e = m.encode(secret);
            assert_eq!(Exchange::decode(&e, secret), Ok(m), "round trip");
            // Byte 11 and bytes 74..88 are padding.
            assert_eq!(e[..11], dgram[..11], "header kept");
            assert_eq!(e[12..74], dgram[12..74], "fields kept");
        }
        Err(HandshakeError::Auth) => assert!(secret.is_some()),
        Err(_) => {}
    }

    // The same bytes made well-formed, then authenticated: any flipped bit
    // must be caught.
    if dgram.len() >= EXCHANGE_LEN {
        let mut b = [0u8; EXCHANGE_LEN];
        b.copy_from_slice(&dgram[..EXCHANGE_LEN]);
        b[..8].copy_from_slice(&EXCHANGE_MAGIC);
        b[8..10].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b[10] = 1 + b[10] % 4;
        let m = Exchange::decode(&b, None).expect("well-formed datagram");
        let key = secret.unwrap_or(b"k");
        let auth = m.encode(Some(key));
        assert_eq!(Exchange::decode(&auth, Some(key)), Ok(m));
        let bit = dgram.get(EXCHANGE_LEN).copied().unwrap_or(0) as usize;
        let mut bad = auth;
        let at = (bit * 7 + n) % EXCHANGE_LEN;
        bad[at] ^= 1 << (bit % 8);
        assert!(
            Exchange::decode(&bad, Some(key)).is_err(),
            "flipped bit {} of byte {at} accepted",
            bit % 8
        );
    }

    // RDMA immediate data (source id, flow-control units) of 4 bytes.
    if let Some(imm) = data.get(..4) {
        let imm = u32::from_le_bytes(imm.try_into().unwrap());
        let (src, units) = decode_imm(imm);
        assert_eq!(decode_imm(encode_imm(src, units)), (src, units));
    }
});
