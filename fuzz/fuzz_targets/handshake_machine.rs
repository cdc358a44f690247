//! The handshake state machine (`dxnet_proto::handshake`) in both roles:
//! never panics on any input, any split of the byte stream or any decision;
//! honest sides always establish (or end with the typed rejection the
//! acceptor chose); a tampered message never makes a side accept the
//! authenticated fields (ids, instances, challenges) changed; and with a
//! cluster secret or identity keys, bytes from the fuzzer never pass for a
//! peer's proof or signature.
//!
//! Input: [flags][chunk][tamper offset: u16][tamper bit][bytes for a lone
//! dialer and a lone acceptor].
#![no_main]

use dxnet_proto::handshake::{Credentials, Event, Handshake};
use dxnet_proto::identity::Identity;
use dxnet_proto::wire::{HandshakeError, Hello, Status};
use libfuzzer_sys::fuzz_target;

fn hello(node_id: u16, target_id: u16, n: u8) -> Hello {
    Hello {
        node_id,
        target_id,
        instance: 0x5000 + n as u64,
        fc_window: 1 << 20,
        fc_unit: 1 << 16,
        nonce: [n; 16],
        codec: dxnet_proto::codec::CODEC_ID,
        endpoint: [n ^ 0x5a; dxnet_proto::wire::ENDPOINT_LEN],
    }
}

/// The longest dialog: hello, reply, signature, proof, signature, final.
const DIALOG_MAX: usize = 6 * dxnet_proto::wire::HANDSHAKE_LEN;

/// Moves `from`'s queued messages into `to` in `chunk`-byte pieces,
/// flipping `tamper` (offset into the whole dialog, bit) when it passes;
/// `flipped` records that it did.
fn pump(
    from: &mut Handshake,
    to: &mut Handshake,
    chunk: usize,
    sent: &mut usize,
    tamper: Option<(usize, u8)>,
    flipped: &mut bool,
) -> Option<Result<Event, HandshakeError>> {
    let mut stream = Vec::new();
    while let Some(m) = from.poll_transmit() {
        stream.extend_from_slice(&m);
    }
    if let Some((at, bit)) = tamper {
        if (*sent..*sent + stream.len()).contains(&at) {
            stream[at - *sent] ^= 1 << (bit % 8);
            *flipped = true;
        }
    }
    *sent += stream.len();
    let mut at = 0;
    while at < stream.len() {
        let end = (at + chunk).min(stream.len());
        match to.read(&stream[at..end]) {
            Ok(p) => {
                assert!(p.consumed <= end - at);
                at += p.consumed;
                if let Some(ev) = p.event {
                    return Some(Ok(ev));
                }
                if p.consumed == 0 {
                    break;
                }
            }
            Err(e) => {
                assert!(to.is_failed());
                return Some(Err(e));
            }
        }
    }
    None
}

fn feed(hs: &mut Handshake, bytes: &[u8], chunk: usize) -> Vec<Event> {
    let mut events = Vec::new();
    let mut at = 0;
    while at < bytes.len() && !hs.is_failed() {
        let end = (at + chunk).min(bytes.len());
        match hs.read(&bytes[at..end]) {
            Ok(p) => {
                at += p.consumed;
                match p.event {
                    Some(Event::Introduced(_)) => hs.admit(),
                    Some(Event::Authenticated(_)) => {
                        hs.accept();
                    }
                    Some(Event::Verified(_)) | Some(Event::Established(_)) | None => {}
                }
                if let Some(ev) = p.event {
                    events.push(ev);
                }
                if p.consumed == 0 {
                    break;
                }
            }
            Err(_) => break,
        }
        while hs.poll_transmit().is_some() {}
    }
    events
}

fuzz_target!(|data: &[u8]| {
    let Some((head, rest)) = data.split_first_chunk::<5>() else {
        return;
    };
    let flags = head[0];
    let chunk = 1 + head[1] as usize;
    let tamper = (flags & 4 != 0).then(|| {
        let at = u16::from_le_bytes([head[2], head[3]]) as usize % DIALOG_MAX;
        (at, head[4])
    });
    let secret = (flags & 1 != 0).then_some(&b"cluster secret"[..]);
    let keys = ([1u8; 32], [2u8; 32]);
    let peers = [
        (1, Identity::from_keys(keys.0, &[]).unwrap().public_key()),
        (2, Identity::from_keys(keys.1, &[]).unwrap().public_key()),
    ];
    let (i1, i2) = (
        Identity::from_keys(keys.0, &peers).unwrap(),
        Identity::from_keys(keys.1, &peers).unwrap(),
    );
    let ids = flags & 2 != 0;
    let cd = Credentials {
        secret,
        identity: ids.then_some(&i1),
    };
    let ca = Credentials {
        secret,
        identity: ids.then_some(&i2),
    };
    let decision = (flags >> 3) % 8;
    let (dh, ah) = (hello(1, 2, 11), hello(2, 0, 22));

    // Two sides against each other.
    let mut d = Handshake::dialer(cd, dh);
    let mut a = Handshake::acceptor(ca, ah);
    let mut sent = 0;
    let mut flipped = false;
    let mut dialer_end = None;
    let mut acceptor_saw = None;
    'dialog: for _ in 0..4 {
        match pump(&mut d, &mut a, chunk, &mut sent, tamper, &mut flipped) {
            Some(Ok(Event::Introduced(_))) if decision == 6 => a.reject(Status::UnknownNode),
            Some(Ok(Event::Introduced(_))) => a.admit(),
            Some(Ok(Event::Authenticated(h))) if decision == 7 => {
                acceptor_saw = Some(h);
                a.reject(Status::Duplicate)
            }
            Some(Ok(Event::Authenticated(_))) => acceptor_saw = Some(a.accept()),
            Some(Ok(Event::Established(_) | Event::Verified(_))) => {
                unreachable!("dialer event at the acceptor")
            }
            Some(Err(_)) | None => {}
        }
        match pump(&mut a, &mut d, chunk, &mut sent, tamper, &mut flipped) {
            Some(Ok(Event::Verified(h))) => {
                if !flipped {
                    assert_eq!(h, Hello { target_id: 0, ..ah });
                }
            }
            Some(Ok(Event::Established(h))) => {
                dialer_end = Some(Ok(h));
                break 'dialog;
            }
            Some(Ok(ev)) => unreachable!("dialer event {ev:?}"),
            Some(Err(e)) => {
                dialer_end = Some(Err(e));
                break 'dialog;
            }
            None => {}
        }
        if a.is_failed() && a.wants_read() == 0 && d.wants_read() == 0 {
            break;
        }
    }
    let authenticated = secret.is_some() || ids;
    if !flipped {
        match decision {
            6 => assert_eq!(
                dialer_end,
                Some(Err(HandshakeError::Rejected(Status::UnknownNode)))
            ),
            7 => assert_eq!(
                dialer_end,
                Some(Err(HandshakeError::Rejected(Status::Duplicate)))
            ),
            _ => {
                assert_eq!(dialer_end, Some(Ok(Hello { target_id: 0, ..ah })));
                assert_eq!(acceptor_saw, Some(dh));
                assert!(a.is_established() && d.is_established());
            }
        }
    } else if authenticated {
        // Every field of a hello is bound by the proofs and signatures.
        let bound = |x: &Hello, y: &Hello| x == y;
        if let Some(Ok(h)) = dialer_end {
            let ah = Hello { target_id: 0, ..ah };
            assert!(bound(&h, &ah), "dialer accepted a changed acceptor hello");
        }
        if let Some(h) = acceptor_saw {
            assert!(
                bound(&h, &dh),
                "acceptor authenticated a changed dialer hello"
            );
        }
    }

    // Each role alone against the fuzzer's bytes, with challenges derived
    // from those bytes (fixed ones would let a recorded honest dialog
    // replay as "forged" input).
    let bytes = &rest[..];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h = (h ^ *b as u64).wrapping_mul(0x100_0000_01b3);
    }
    let mut nonce = [0u8; 16];
    nonce[..8].copy_from_slice(&h.to_le_bytes());
    nonce[8..].copy_from_slice(&h.rotate_left(29).to_le_bytes());
    let mut d = Handshake::dialer(cd, Hello { nonce, ..dh });
    let events = feed(&mut d, bytes, chunk);
    let mut a = Handshake::acceptor(ca, Hello { nonce, ..ah });
    let a_events = feed(&mut a, bytes, chunk);
    if authenticated {
        assert!(
            events.is_empty(),
            "dialer verified or established by forged bytes"
        );
        assert!(
            !a_events
                .iter()
                .any(|e| matches!(e, Event::Authenticated(_))),
            "acceptor authenticated forged bytes"
        );
    }
});
