use super::*;
use crate::wire::{self, HandshakeMsg};

fn hello(node_id: u16, target_id: u16, n: u8) -> Hello {
    Hello {
        node_id,
        target_id,
        instance: 0x1000 + n as u64,
        fc_window: 1 << 20,
        fc_unit: 1 << 16,
        nonce: [n; 16],
        codec: crate::codec::CODEC_ID,
        endpoint: [0; wire::ENDPOINT_LEN],
    }
}

fn identities() -> (Identity, Identity) {
    let (k1, k2) = ([1u8; 32], [2u8; 32]);
    let p1 = Identity::from_keys(k1, &[]).unwrap().public_key();
    let p2 = Identity::from_keys(k2, &[]).unwrap().public_key();
    let peers = [(1, p1), (2, p2)];
    (
        Identity::from_keys(k1, &peers).unwrap(),
        Identity::from_keys(k2, &peers).unwrap(),
    )
}

/// Moves every queued message of `from` into `to`, `chunk` bytes at a
/// time; returns the first event or error `to` produced.
fn pump(
    from: &mut Handshake,
    to: &mut Handshake,
    chunk: usize,
) -> Option<Result<Event, HandshakeError>> {
    let mut stream = Vec::new();
    while let Some(m) = from.poll_transmit() {
        stream.extend_from_slice(&m);
    }
    let mut at = 0;
    while at < stream.len() {
        let end = (at + chunk).min(stream.len());
        match to.read(&stream[at..end]) {
            Ok(p) => {
                assert!(p.consumed <= end - at);
                at += p.consumed;
                if let Some(ev) = p.event {
                    assert_eq!(at, stream.len(), "an event ends the peer's burst");
                    return Some(Ok(ev));
                }
                if p.consumed == 0 {
                    break;
                }
            }
            Err(e) => return Some(Err(e)),
        }
    }
    None
}

/// Runs a whole handshake; the acceptor admits and accepts unless told
/// otherwise. Returns what each side ended with.
fn run(
    d: &mut Handshake,
    a: &mut Handshake,
    chunk: usize,
    on_authenticated: Option<Status>,
) -> Result<(Hello, Hello), HandshakeError> {
    match pump(d, a, chunk) {
        Some(Ok(Event::Introduced(_))) => a.admit(),
        Some(Err(e)) => {
            if let Some(Err(de)) = pump(a, d, chunk) {
                return Err(de);
            }
            return Err(e);
        }
        other => panic!("acceptor after hello: {other:?}"),
    }
    match pump(a, d, chunk) {
        Some(Ok(Event::Verified(h))) => assert_eq!(Some(&h), a.peer().map(|_| &a.mine)),
        Some(Err(e)) => return Err(e),
        other => panic!("dialer after reply: {other:?}"),
    }
    let theirs = match pump(d, a, chunk) {
        Some(Ok(Event::Authenticated(h))) => match on_authenticated {
            None => a.accept(),
            Some(st) => {
                a.reject(st);
                h
            }
        },
        Some(Err(e)) => {
            if let Some(Err(de)) = pump(a, d, chunk) {
                assert_eq!(de, HandshakeError::Rejected(Status::AuthFailed));
            }
            return Err(e);
        }
        other => panic!("acceptor after proof: {other:?}"),
    };
    match pump(a, d, chunk) {
        Some(Ok(Event::Established(h))) => Ok((h, theirs)),
        Some(Err(e)) => Err(e),
        other => panic!("dialer after final: {other:?}"),
    }
}

#[test]
fn honest_sides_establish_with_every_credential_set() {
    let (i1, i2) = identities();
    for (secret, ids) in [
        (None, false),
        (Some(&b"s3cret"[..]), false),
        (Some(&b"s3cret"[..]), true),
    ] {
        for chunk in [1, 7, HANDSHAKE_LEN, 4 * HANDSHAKE_LEN] {
            let cd = Credentials {
                secret,
                identity: ids.then_some(&i1),
            };
            let ca = Credentials {
                secret,
                identity: ids.then_some(&i2),
            };
            let mut d = Handshake::dialer(cd, hello(1, 2, 10));
            let mut a = Handshake::acceptor(ca, hello(2, 99, 20));
            let (seen_by_d, seen_by_a) = run(&mut d, &mut a, chunk, None).unwrap();
            assert_eq!(seen_by_d, hello(2, 0, 20), "dialer saw the acceptor");
            assert_eq!(seen_by_a, hello(1, 2, 10), "acceptor saw the dialer");
            assert!(d.is_established() && a.is_established());
            assert_eq!((d.wants_read(), a.wants_read()), (0, 0));
            assert_eq!(a.poll_transmit(), None);
        }
    }
}

#[test]
fn bytes_after_the_final_message_are_left_to_the_caller() {
    let mut d = Handshake::dialer(Credentials::default(), hello(1, 2, 1));
    let mut a = Handshake::acceptor(Credentials::default(), hello(2, 0, 2));
    assert!(matches!(
        pump(&mut d, &mut a, 1),
        Some(Ok(Event::Introduced(_)))
    ));
    a.admit();
    assert!(matches!(
        pump(&mut a, &mut d, 1),
        Some(Ok(Event::Verified(_)))
    ));
    assert!(matches!(
        pump(&mut d, &mut a, 1),
        Some(Ok(Event::Authenticated(_)))
    ));
    a.accept();
    let mut bytes = a.poll_transmit().unwrap().to_vec();
    bytes.extend_from_slice(b"chunk data");
    let p = d.read(&bytes).unwrap();
    assert_eq!(p.consumed, HANDSHAKE_LEN);
    assert!(matches!(p.event, Some(Event::Established(_))));
    assert_eq!(d.read(b"more").unwrap().consumed, 0);
}

#[test]
fn a_wrong_secret_fails_on_both_sides() {
    // The dialer checks the acceptor's proof first.
    let mut d = Handshake::dialer(
        Credentials {
            secret: Some(b"one"),
            identity: None,
        },
        hello(1, 2, 1),
    );
    let mut a = Handshake::acceptor(
        Credentials {
            secret: Some(b"two"),
            identity: None,
        },
        hello(2, 0, 2),
    );
    assert_eq!(run(&mut d, &mut a, 13, None), Err(HandshakeError::Auth));
    assert!(d.is_failed());
    // The acceptor checks the dialer's proof and says so.
    let mut a = Handshake::acceptor(
        Credentials {
            secret: Some(b"two"),
            identity: None,
        },
        hello(2, 0, 2),
    );
    a.read(&HandshakeMsg::Hello(hello(1, 2, 1)).encode())
        .unwrap();
    a.admit();
    while a.poll_transmit().is_some() {}
    let err = a.read(&HandshakeMsg::Proof([7; 32]).encode()).unwrap_err();
    assert_eq!(err, HandshakeError::Auth);
    assert_eq!(
        a.poll_transmit().map(|b| HandshakeMsg::decode(&b)),
        Some(Ok(HandshakeMsg::Final(Status::AuthFailed)))
    );
}

#[test]
fn rejections_reach_the_dialer_typed() {
    let creds = Credentials::default();
    // Wrong target: refused by the machine itself.
    let mut d = Handshake::dialer(creds, hello(1, 3, 1));
    let mut a = Handshake::acceptor(creds, hello(2, 0, 2));
    assert_eq!(
        pump(&mut d, &mut a, 96),
        Some(Err(HandshakeError::Refused(Status::WrongTarget)))
    );
    assert_eq!(
        pump(&mut a, &mut d, 96),
        Some(Err(HandshakeError::Rejected(Status::WrongTarget)))
    );
    // The runtime's decision after authentication.
    let mut d = Handshake::dialer(creds, hello(1, 2, 1));
    let mut a = Handshake::acceptor(creds, hello(2, 0, 2));
    assert_eq!(
        run(&mut d, &mut a, 96, Some(Status::Duplicate)),
        Err(HandshakeError::Rejected(Status::Duplicate))
    );
    assert!(a.is_failed() && d.is_failed());
    // The runtime's decision on the introduction.
    let mut d = Handshake::dialer(creds, hello(1, 2, 1));
    let mut a = Handshake::acceptor(creds, hello(2, 0, 2));
    assert!(matches!(
        pump(&mut d, &mut a, 96),
        Some(Ok(Event::Introduced(_)))
    ));
    a.reject(Status::UnknownNode);
    assert_eq!(
        pump(&mut a, &mut d, 96),
        Some(Err(HandshakeError::Rejected(Status::UnknownNode)))
    );
}

#[test]
fn claims_are_checked() {
    let creds = Credentials::default();
    // Our own id.
    let mut a = Handshake::acceptor(creds, hello(2, 0, 2));
    assert_eq!(
        a.read(&HandshakeMsg::Hello(hello(2, 2, 1)).encode()),
        Err(HandshakeError::Refused(Status::UnknownNode))
    );
    // Instance 0.
    let mut a = Handshake::acceptor(creds, hello(2, 0, 2));
    let h = Hello {
        instance: 0,
        ..hello(1, 2, 1)
    };
    assert_eq!(
        a.read(&HandshakeMsg::Hello(h).encode()),
        Err(HandshakeError::ZeroInstance)
    );
    // Another payload format: the acceptor refuses and says why.
    let mut d = Handshake::dialer(
        creds,
        Hello {
            codec: 9,
            ..hello(1, 2, 1)
        },
    );
    let mut a = Handshake::acceptor(creds, hello(2, 0, 2));
    let refused = pump(&mut d, &mut a, 96);
    assert_eq!(
        refused,
        Some(Err(HandshakeError::Codec {
            ours: crate::codec::CODEC_ID,
            theirs: 9
        }))
    );
    let msg = refused.unwrap().unwrap_err().to_string();
    assert!(msg.contains("postcard 1 (1), peer unknown (9)"), "{msg}");
    assert_eq!(
        pump(&mut a, &mut d, 96),
        Some(Err(HandshakeError::Rejected(Status::CodecMismatch)))
    );
    // The same from an acceptor of another format.
    let mut d = Handshake::dialer(creds, hello(1, 2, 1));
    d.poll_transmit();
    let r = Hello {
        codec: 9,
        ..hello(2, 0, 2)
    };
    assert_eq!(
        d.read(&HandshakeMsg::Reply(r, [0; 32]).encode()),
        Err(HandshakeError::Codec {
            ours: crate::codec::CODEC_ID,
            theirs: 9
        })
    );
    // Another node answering at the dialed address.
    let mut d = Handshake::dialer(creds, hello(1, 2, 1));
    let r = HandshakeMsg::Reply(hello(5, 0, 5), [0; 32]).encode();
    assert_eq!(
        d.read(&r),
        Err(HandshakeError::WrongPeer {
            expected: 2,
            got: 5
        })
    );
    // Messages out of turn.
    let mut a = Handshake::acceptor(creds, hello(2, 0, 2));
    assert_eq!(
        a.read(&HandshakeMsg::Proof([0; 32]).encode()),
        Err(HandshakeError::Unexpected {
            expected: "hello",
            got: "proof"
        })
    );
    assert_eq!(a.poll_transmit(), None, "nothing said to a non-dialer");
    let mut d = Handshake::dialer(creds, hello(1, 2, 1));
    d.poll_transmit();
    assert!(matches!(
        d.read(&HandshakeMsg::Final(Status::Accept).encode()),
        Err(HandshakeError::Unexpected { .. })
    ));
}

#[test]
fn an_identity_signature_of_another_key_is_refused() {
    let (i1, i2) = identities();
    // An impostor that knows the node map's public keys but holds neither
    // node's private key.
    let peers = [(1, i1.public_key()), (2, i2.public_key())];
    let impostor = Identity::from_keys([9; 32], &peers).unwrap();
    let creds = |id| Credentials {
        secret: Some(b"s"),
        identity: Some(id),
    };
    // The impostor answers as node 2: the real node 1 refuses its signature.
    let mut d = Handshake::dialer(creds(&i1), hello(1, 2, 1));
    let mut a = Handshake::acceptor(creds(&impostor), hello(2, 0, 2));
    assert!(matches!(
        pump(&mut d, &mut a, 96),
        Some(Ok(Event::Introduced(_)))
    ));
    a.admit();
    assert_eq!(
        pump(&mut a, &mut d, 96),
        Some(Err(HandshakeError::Signature(2)))
    );
    // The impostor dials as node 1: the real node 2 refuses and says so.
    let mut d = Handshake::dialer(creds(&impostor), hello(1, 2, 3));
    let mut a = Handshake::acceptor(creds(&i2), hello(2, 0, 4));
    assert!(matches!(
        pump(&mut d, &mut a, 96),
        Some(Ok(Event::Introduced(_)))
    ));
    a.admit();
    // (Node 2's own signature checks out: the impostor has its public key.)
    assert!(matches!(
        pump(&mut a, &mut d, 96),
        Some(Ok(Event::Verified(_)))
    ));
    assert_eq!(
        pump(&mut d, &mut a, 96),
        Some(Err(HandshakeError::Signature(1)))
    );
    assert_eq!(
        a.poll_transmit().map(|b| HandshakeMsg::decode(&b)),
        Some(Ok(HandshakeMsg::Final(Status::AuthFailed)))
    );
}

/// A signature made for one role does not pass for the other: the
/// acceptor's signature of a handshake, reflected back as the dialer's in a
/// handshake with the same challenges, is refused.
#[test]
fn a_signature_reflected_across_roles_is_refused() {
    let (i1, i2) = identities();
    let creds = |id| Credentials {
        secret: None,
        identity: Some(id),
    };
    // Node 2 dials node 1 with challenge 7; node 1 answers with challenge 8.
    let mut d = Handshake::dialer(creds(&i2), hello(2, 1, 7));
    let mut a = Handshake::acceptor(creds(&i1), hello(1, 0, 8));
    assert!(matches!(
        pump(&mut d, &mut a, 96),
        Some(Ok(Event::Introduced(_)))
    ));
    a.admit();
    a.poll_transmit().unwrap();
    let acceptor_sig = a.poll_transmit().unwrap();
    // Node 1 dials node 2 with challenge 8; node 2 answers with challenge 7:
    // an attacker relays node 1's acceptor signature as node 1's dialer
    // signature.
    let mut d = Handshake::dialer(creds(&i1), hello(1, 2, 8));
    let mut a = Handshake::acceptor(creds(&i2), hello(2, 0, 7));
    assert!(matches!(
        pump(&mut d, &mut a, 96),
        Some(Ok(Event::Introduced(_)))
    ));
    a.admit();
    while a.poll_transmit().is_some() {}
    a.read(&HandshakeMsg::Proof([0; 32]).encode()).unwrap();
    assert_eq!(a.read(&acceptor_sig), Err(HandshakeError::Signature(1)));
}

/// The acceptor announces the endpoint it chose when admitting; the dialer
/// sees it (bound by the proof: a changed endpoint fails).
#[test]
fn the_acceptors_endpoint_reaches_the_dialer_bound_by_its_proof() {
    let creds = Credentials {
        secret: Some(b"s"),
        identity: None,
    };
    let ep = [7u8; wire::ENDPOINT_LEN];
    let mut d = Handshake::dialer(creds, hello(1, 2, 1));
    let mut a = Handshake::acceptor(creds, hello(2, 0, 2));
    assert!(matches!(
        pump(&mut d, &mut a, 112),
        Some(Ok(Event::Introduced(_)))
    ));
    a.admit_at(ep);
    let reply = a.poll_transmit().unwrap();
    let mut tampered = reply;
    let HandshakeMsg::Reply(h, mac) = HandshakeMsg::decode(&reply).unwrap() else {
        panic!("not a reply");
    };
    assert_eq!(h.endpoint, ep);
    let other = Hello {
        endpoint: [8; wire::ENDPOINT_LEN],
        ..h
    };
    tampered.copy_from_slice(&HandshakeMsg::Reply(other, mac).encode());
    let mut d2 = Handshake::dialer(creds, hello(1, 2, 1));
    d2.poll_transmit();
    assert_eq!(d2.read(&tampered), Err(HandshakeError::Auth));
    match d.read(&reply) {
        Ok(Progress {
            event: Some(Event::Verified(h)),
            ..
        }) => assert_eq!(h.endpoint, ep),
        other => panic!("{other:?}"),
    }
}

/// A peer of another protocol version is told apart from its first ten
/// bytes, whatever the length of its messages.
#[test]
fn another_version_is_reported_from_the_prefix() {
    let mut a = Handshake::acceptor(Credentials::default(), hello(2, 0, 2));
    let mut old = HandshakeMsg::Hello(hello(1, 2, 1)).encode();
    old[8..10].copy_from_slice(&3u16.to_le_bytes());
    assert_eq!(
        a.read(&old[..wire::HANDSHAKE_PREFIX_LEN]),
        Err(HandshakeError::Version {
            ours: wire::PROTOCOL_VERSION,
            theirs: 3
        })
    );
    assert!(a.is_failed());
    let mut a = Handshake::acceptor(Credentials::default(), hello(2, 0, 2));
    assert_eq!(a.read(b"GET / HTTP/1.1\r\n"), Err(HandshakeError::BadMagic));
}
