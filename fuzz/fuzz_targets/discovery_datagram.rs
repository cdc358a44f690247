//! The discovery datagram (`Announcement::decode`, with and without a
//! cluster secret) on datagrams of any length: never panic; an accepted
//! datagram re-encodes to the same bytes' fields and decodes to the same
//! value; with a secret or an identity key, flipping any bit of an
//! authentic datagram gets it rejected.
//!
//! Input: [secret length: u8][secret][datagram].
#![no_main]

use dxnet_proto::discovery::{Announcement, DiscoveryError, DISCOVERY_MAX};
use dxnet_proto::identity::Identity;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = (n as usize).min(rest.len());
    let (secret, dgram) = rest.split_at(n);
    let secret = (!secret.is_empty()).then_some(secret);

    let decoded = match Announcement::decode(dgram, secret, None) {
        Ok(a) => {
            assert!(dgram.len() <= DISCOVERY_MAX);
            let e = a.encode(secret, None);
            assert_eq!(Announcement::decode(&e, secret, None), Ok(a.clone()));
            Some(a)
        }
        Err(DiscoveryError::Auth) => {
            assert!(secret.is_some());
            None
        }
        Err(_) => None,
    };
    // Whatever decoded (unauthenticated), authenticated by a key and by an
    // identity: every flipped bit is caught.
    let Some(a) = decoded.or_else(|| Announcement::decode(dgram, None, None).ok()) else {
        return;
    };
    let key = secret.unwrap_or(b"k");
    let sender = Identity::from_keys([7; 32], &[]).unwrap();
    let me = Identity::from_keys([8; 32], &[(a.sender, sender.public_key())]).unwrap();
    let signed = a.encode(Some(key), Some(&sender));
    assert_eq!(
        Announcement::decode(&signed, Some(key), Some(&me)),
        Ok(a.clone())
    );
    let bit = dgram.last().copied().unwrap_or(0) as usize;
    let at = (bit * 7 + n) % signed.len();
    let mut bad = signed;
    bad[at] ^= 1 << (bit % 8);
    assert!(
        Announcement::decode(&bad, Some(key), Some(&me)).is_err(),
        "flipped bit {} of byte {at} accepted",
        bit % 8
    );
});
