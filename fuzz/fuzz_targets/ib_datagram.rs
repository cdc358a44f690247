//! The InfiniBand engine's UDP datagrams: the handshake datagram header
//! (`DatagramHeader::decode`) and the close notice (`CloseNotice::decode`,
//! with and without a cluster secret) on datagrams of any length: never
//! panic; an accepted close notice re-encodes to one that decodes to the
//! same value; with a secret or an identity key, flipping any bit of an
//! authentic notice gets it rejected. Also the RDMA immediate data.
//!
//! Input: [secret length: u8][secret][datagram].
#![no_main]

use dxnet_proto::identity::Identity;
use dxnet_proto::wire::{
    decode_imm, encode_imm, CloseNotice, DatagramHeader, HandshakeError, CLOSE_LEN, CLOSE_MAGIC,
    DATAGRAM_HEADER_LEN, PROTOCOL_VERSION,
};
use libfuzzer_sys::fuzz_target;

/// End of the bytes the HMAC covers.
const MAC_END: usize = 68;

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = (n as usize).min(rest.len());
    let (secret, dgram) = rest.split_at(n);
    let secret = (!secret.is_empty()).then_some(secret);

    // Whatever arrives on the UDP port, as a handshake datagram.
    if let Ok((h, msgs)) = DatagramHeader::decode(dgram) {
        assert_eq!(msgs, &dgram[DATAGRAM_HEADER_LEN..]);
        let e = h.encode();
        assert_eq!(DatagramHeader::decode(&e), Ok((h, &[][..])), "round trip");
    }

    // ... and as a close notice.
    match CloseNotice::decode(dgram, secret, None) {
        Ok(m) => {
            assert_eq!(dgram.len(), CLOSE_LEN);
            let e = m.encode(secret, None);
            assert_eq!(CloseNotice::decode(&e, secret, None), Ok(m), "round trip");
            assert_eq!(e[..MAC_END], dgram[..MAC_END], "fields kept");
        }
        Err(HandshakeError::Auth) => assert!(secret.is_some()),
        Err(_) => {}
    }

    // The same bytes made well-formed, then authenticated: any flipped bit
    // must be caught.
    if dgram.len() >= CLOSE_LEN {
        let mut b = [0u8; CLOSE_LEN];
        b.copy_from_slice(&dgram[..CLOSE_LEN]);
        b[..8].copy_from_slice(&CLOSE_MAGIC);
        b[8..10].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b[10] = 0;
        b[11] = 0;
        let m = CloseNotice::decode(&b, None, None).expect("well-formed notice");
        let key = secret.unwrap_or(b"k");
        let auth = m.encode(Some(key), None);
        assert_eq!(CloseNotice::decode(&auth, Some(key), None), Ok(m));
        let bit = dgram.get(CLOSE_LEN).copied().unwrap_or(0) as usize;
        let mut bad = auth;
        let at = (bit * 7 + n) % MAC_END;
        bad[at] ^= 1 << (bit % 8);
        assert!(
            CloseNotice::decode(&bad, Some(key), None).is_err(),
            "flipped bit {} of byte {at} accepted",
            bit % 8
        );
        // Signed by the sender's identity key: every byte is covered.
        let src = u16::from_le_bytes([b[12], b[13]]);
        let sender = Identity::from_keys([7; 32], &[]).unwrap();
        let me = Identity::from_keys([8; 32], &[(src, sender.public_key())]).unwrap();
        let signed = m.encode(Some(key), Some(&sender));
        assert_eq!(CloseNotice::decode(&signed, Some(key), Some(&me)), Ok(m));
        let mut bad = signed;
        let at = (bit * 7 + n) % CLOSE_LEN;
        bad[at] ^= 1 << (bit % 8);
        assert!(
            CloseNotice::decode(&bad, Some(key), Some(&me)).is_err(),
            "flipped bit {} of byte {at} of a signed notice accepted",
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
