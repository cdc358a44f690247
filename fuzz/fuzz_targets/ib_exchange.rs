//! The InfiniBand engine's UDP exchange datagram (node discovery and
//! queue-pair exchange), Exchange::decode on datagrams of any length, with
//! and without a cluster secret: never panics; an accepted datagram
//! re-encodes to one that decodes to the same value; and with a secret,
//! flipping any bit of an authentic datagram gets it rejected.
//!
//! Input: [secret length: u8][secret][datagram].
#![no_main]

use dxnet_proto::wire::{
    decode_imm, encode_imm, Exchange, HandshakeError, EXCHANGE_LEN, EXCHANGE_MAGIC,
    PROTOCOL_VERSION,
};
use dxnet_proto::identity::Identity;
use libfuzzer_sys::fuzz_target;

/// End of the bytes the HMAC covers.
const MAC_END: usize = 120;

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = (n as usize).min(rest.len());
    let (secret, dgram) = rest.split_at(n);
    let secret = (!secret.is_empty()).then_some(secret);

    // Whatever arrives on the UDP port.
    match Exchange::decode(dgram, secret, None) {
        Ok(m) => {
            assert_eq!(dgram.len(), EXCHANGE_LEN);
            let e = m.encode(secret, None);
            assert_eq!(Exchange::decode(&e, secret, None), Ok(m), "round trip");
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
        let m = Exchange::decode(&b, None, None).expect("well-formed datagram");
        let key = secret.unwrap_or(b"k");
        let auth = m.encode(Some(key), None);
        assert_eq!(Exchange::decode(&auth, Some(key), None), Ok(m));
        let bit = dgram.get(EXCHANGE_LEN).copied().unwrap_or(0) as usize;
        // The HMAC covers bytes 0..120.
        let mut bad = auth;
        let at = (bit * 7 + n) % MAC_END;
        bad[at] ^= 1 << (bit % 8);
        assert!(
            Exchange::decode(&bad, Some(key), None).is_err(),
            "flipped bit {} of byte {at} accepted",
            bit % 8
        );
        // Signed by the sender's identity key: every byte is covered.
        let src = u16::from_le_bytes([b[12], b[13]]);
        let sender = Identity::from_keys([7; 32], &[]).unwrap();
        let me = Identity::from_keys([8; 32], &[(src, sender.public_key())]).unwrap();
        let signed = m.encode(Some(key), Some(&sender));
        assert_eq!(Exchange::decode(&signed, Some(key), Some(&me)), Ok(m));
        let mut bad = signed;
        let at = (bit * 7 + n) % EXCHANGE_LEN;
        bad[at] ^= 1 << (bit % 8);
        assert!(
            Exchange::decode(&bad, Some(key), Some(&me)).is_err(),
            "flipped bit {} of byte {at} of a signed datagram accepted",
            bit % 8
        );
    }

    // RDMA immediate data (source id, flow-control units, flags) of 4 bytes.
    if let Some(imm) = data.get(..4) {
        let imm = u32::from_le_bytes(imm.try_into().unwrap());
        let (src, units, flags) = decode_imm(imm);
        assert_eq!(
            decode_imm(encode_imm(src, units) | u32::from(flags)),
            (src, units, flags)
        );
    }
});
