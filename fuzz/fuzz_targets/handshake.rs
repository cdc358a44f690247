//! HandshakeMsg::decode on any HANDSHAKE_LEN bytes: never panics; a valid message
//! re-encodes to one that decodes to the same value and keeps the header
//! bytes. The bytes after the first HANDSHAKE_LEN serve as a cluster secret for the
//! proof check (HMAC), which must not panic on any key or MAC.
#![no_main]

use dxnet_proto::wire::{
    proof, verify_proof, HandshakeError, HandshakeMsg, Hello, HANDSHAKE_LEN, HANDSHAKE_MAGIC,
    PROTOCOL_VERSION,
};
use libfuzzer_sys::fuzz_target;

fn check(b: &[u8; HANDSHAKE_LEN], secret: &[u8]) {
    match HandshakeMsg::decode(b) {
        Ok(m) => {
            let e = m.encode();
            assert_eq!(HandshakeMsg::decode(&e), Ok(m), "round trip");
            assert_eq!(e[..11], b[..11], "magic, version, kind kept");
            let secret = (!secret.is_empty()).then_some(secret);
            match m {
                HandshakeMsg::Hello(h) | HandshakeMsg::Reply(h, _) => {
                    let mac = match m {
                        HandshakeMsg::Reply(_, mac) => mac,
                        _ => [0; 32],
                    };
                    let mine = Hello {
                        node_id: 1,
                        nonce: [0x5a; 16],
                        ..h
                    };
                    let ok = verify_proof(secret, b"acceptor", &h, &mine, &mac);
                    // A correct proof verifies; the fuzzer's MAC only if it
                    // happens to be right (or there is no secret).
                    let good = proof(secret, b"acceptor", &h, &mine);
                    assert_eq!(ok, secret.is_none() || good == mac);
                    assert!(verify_proof(secret, b"acceptor", &h, &mine, &good));
                }
                HandshakeMsg::Proof(_) | HandshakeMsg::Final(_) | HandshakeMsg::Signature(_) => {}
            }
        }
        Err(HandshakeError::BadMagic) => assert_ne!(b[..8], HANDSHAKE_MAGIC),
        Err(HandshakeError::Version { theirs, .. }) => {
            assert_eq!(b[..8], HANDSHAKE_MAGIC);
            assert_ne!(theirs, PROTOCOL_VERSION);
        }
        Err(HandshakeError::Kind(_)) => assert_eq!(b[..8], HANDSHAKE_MAGIC),
        Err(e) => panic!("decode returned {e:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let mut b = [0u8; HANDSHAKE_LEN];
    let n = data.len().min(HANDSHAKE_LEN);
    b[..n].copy_from_slice(&data[..n]);
    let secret = data.get(HANDSHAKE_LEN..).unwrap_or(&[]);
    check(&b, secret);
    // The same bytes behind a valid magic and version, so the fuzzer
    // explores the message kinds without first guessing the magic.
    b[..8].copy_from_slice(&HANDSHAKE_MAGIC);
    b[8..10].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    check(&b, secret);
});
