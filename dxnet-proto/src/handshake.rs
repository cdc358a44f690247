//! The connection handshake as a state machine without I/O: bytes in,
//! messages out, and the two decisions only the runtime can take handed
//! back as [`Event`]s. The TCP engine drives it over a (TLS) stream in both
//! roles, the InfiniBand engine over UDP datagrams (one flight of messages
//! per datagram, see [`wire::DatagramHeader`]; the driver retransmits);
//! the fuzz target `handshake_machine` drives both roles against each
//! other, with tampered messages and with arbitrary bytes.
//!
//! Every message is [`HANDSHAKE_LEN`] bytes ([`HandshakeMsg`]):
//!
//! ```text
//! dialer                                       acceptor
//!   Hello (id, target, instance, window, nonce, endpoint) ──▶  Event::Introduced → admit / reject
//!        ◀── Reply (its hello, proof) [+ Signature]
//!   Event::Verified
//!   Proof [+ Signature] ──▶  Event::Authenticated → accept / reject
//!        ◀── Final (status)
//!   Event::Established
//! ```
//!
//! Proofs are HMACs with the cluster secret over the prover's
//! [`wire::transcript`] (its role and both hellos in full, so over both
//! challenges); with identity keys each side also signs it. A side that sees a bad proof
//! or signature fails, and the acceptor tells the dialer so (`Final` with
//! [`Status::AuthFailed`]): after an error, send what
//! [`Handshake::poll_transmit`] still returns, then close.

use std::collections::VecDeque;

use crate::identity::Identity;
use crate::wire::{self, HandshakeError, HandshakeMsg, Hello, Status, HANDSHAKE_LEN};

/// What proves this side's membership and identity.
#[derive(Clone, Copy, Default)]
pub struct Credentials<'a> {
    /// The cluster secret; without it proofs are not made nor checked.
    pub secret: Option<&'a [u8]>,
    /// This node's identity key and the node map's public keys; without it
    /// no signatures are exchanged.
    pub identity: Option<&'a Identity>,
}

impl std::fmt::Debug for Credentials<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret itself: handshakes may be logged.
        f.debug_struct("Credentials")
            .field("secret", &self.secret.map(|_| "<set>"))
            .field("identity", &self.identity)
            .finish()
    }
}

/// Which side of the connection this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Opened the connection.
    Dialer,
    /// Accepted it.
    Acceptor,
}

/// What the handshake hands back to its driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Acceptor: a dialer introduced itself (already checked: it asks for
    /// our id, claims another id than ours, has an instance id). The driver
    /// checks that the node is one it serves (node map, TLS certificate)
    /// and calls [`Handshake::admit`] or [`Handshake::reject`].
    Introduced(Hello),
    /// Dialer: the acceptor proved its id; this side's proof is queued.
    /// The acceptor may send data as soon as it gets that proof and
    /// accepts, so a driver whose transport needs set-up to receive (an
    /// InfiniBand queue pair connected to the acceptor's endpoint) does it
    /// now, before sending.
    Verified(Hello),
    /// Acceptor: the dialer proved the claimed id (and the cluster secret).
    /// The driver decides whether the connection may open (duplicates,
    /// limits) and calls [`Handshake::accept`] or [`Handshake::reject`].
    Authenticated(Hello),
    /// Dialer: the acceptor proved its id and accepted; data may flow.
    Established(Hello),
}

/// Bytes consumed by [`Handshake::read`] and what they completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Bytes of the input taken (never past the message that produced
    /// `event`, nor past the end of the handshake).
    pub consumed: usize,
    /// A decision to take or the end of the handshake.
    pub event: Option<Event>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    AwaitReply,
    AwaitAcceptorSignature,
    AwaitFinal,
    AwaitHello,
    Introduced,
    AwaitProof,
    AwaitDialerSignature,
    Authenticated,
    Established,
    Failed,
}

/// One side of one handshake. `Clone`, so that a driver on an unreliable
/// carrier (datagrams) can try input on a copy and drop input that fails.
#[derive(Debug, Clone)]
pub struct Handshake<'a> {
    role: Role,
    creds: Credentials<'a>,
    mine: Hello,
    theirs: Option<Hello>,
    state: State,
    buf: [u8; HANDSHAKE_LEN],
    have: usize,
    out: VecDeque<HandshakeMsg>,
}

const ACCEPTOR: &[u8] = b"acceptor";
const DIALER: &[u8] = b"dialer";

impl<'a> Handshake<'a> {
    /// The dialer's side: `mine` announces this node (its `target_id` is
    /// the node it wants, its `nonce` fresh random bytes). The hello is
    /// ready to send.
    pub fn dialer(creds: Credentials<'a>, mine: Hello) -> Self {
        let mut hs = Self::new(Role::Dialer, creds, mine, State::AwaitReply);
        hs.out.push_back(HandshakeMsg::Hello(mine));
        hs
    }

    /// The acceptor's side: `mine` announces this node (`target_id` is
    /// ignored; `nonce` fresh random bytes). It waits for the hello.
    pub fn acceptor(creds: Credentials<'a>, mine: Hello) -> Self {
        let mine = Hello {
            target_id: 0,
            ..mine
        };
        Self::new(Role::Acceptor, creds, mine, State::AwaitHello)
    }

    fn new(role: Role, creds: Credentials<'a>, mine: Hello, state: State) -> Self {
        Self {
            role,
            creds,
            mine,
            theirs: None,
            state,
            buf: [0; HANDSHAKE_LEN],
            have: 0,
            out: VecDeque::with_capacity(2),
        }
    }

    /// This side's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The peer's hello, once received.
    pub fn peer(&self) -> Option<&Hello> {
        self.theirs.as_ref()
    }

    /// True once the connection may carry data (dialer: the acceptor
    /// accepted; acceptor: [`Handshake::accept`] was called).
    pub fn is_established(&self) -> bool {
        self.state == State::Established
    }

    /// True once the handshake failed or was rejected.
    pub fn is_failed(&self) -> bool {
        self.state == State::Failed
    }

    /// Bytes still needed to complete the next expected message; 0 while a
    /// decision is pending or when the handshake is over.
    pub fn wants_read(&self) -> usize {
        match self.state {
            State::AwaitReply
            | State::AwaitAcceptorSignature
            | State::AwaitFinal
            | State::AwaitHello
            | State::AwaitProof
            | State::AwaitDialerSignature => HANDSHAKE_LEN - self.have,
            State::Introduced | State::Authenticated | State::Established | State::Failed => 0,
        }
    }

    /// The next message to send, encoded.
    pub fn poll_transmit(&mut self) -> Option<[u8; HANDSHAKE_LEN]> {
        self.out.pop_front().map(|m| m.encode())
    }

    /// Feeds received bytes. Stops after a message that produced an event
    /// (the rest of `input` is the caller's to feed again after acting on
    /// it) and at the end of the handshake (what follows is connection
    /// data). Any error ends the handshake.
    pub fn read(&mut self, input: &[u8]) -> Result<Progress, HandshakeError> {
        let mut consumed = 0;
        while consumed < input.len() && self.wants_read() > 0 {
            let take = (HANDSHAKE_LEN - self.have).min(input.len() - consumed);
            self.buf[self.have..self.have + take]
                .copy_from_slice(&input[consumed..consumed + take]);
            self.have += take;
            consumed += take;
            if self.have >= wire::HANDSHAKE_PREFIX_LEN {
                // A peer of another version may send messages of another
                // length: say so rather than wait for bytes that never come.
                let prefix = self.buf[..wire::HANDSHAKE_PREFIX_LEN].try_into().unwrap();
                if let Err(e) = HandshakeMsg::check_prefix(prefix) {
                    self.have = 0;
                    return Err(self.fail(e, None));
                }
            }
            if self.have < HANDSHAKE_LEN {
                break;
            }
            self.have = 0;
            let msg = match HandshakeMsg::decode(&self.buf) {
                Ok(m) => m,
                Err(e) => return Err(self.fail(e, None)),
            };
            let event = match self.role {
                Role::Dialer => self.on_dialer_msg(msg)?,
                Role::Acceptor => self.on_acceptor_msg(msg)?,
            };
            if event.is_some() {
                return Ok(Progress { consumed, event });
            }
        }
        Ok(Progress {
            consumed,
            event: None,
        })
    }

    /// Acceptor, after [`Event::Introduced`]: answer with our hello and
    /// proof.
    ///
    /// # Panics
    /// Outside that state (a bug in the driver, not something a peer can
    /// cause).
    pub fn admit(&mut self) {
        self.admit_at(self.mine.endpoint);
    }

    /// [`Handshake::admit`], announcing `endpoint` as this side's transport
    /// endpoint (one the driver creates only for an admitted dialer).
    ///
    /// # Panics
    /// Outside that state (a bug in the driver).
    pub fn admit_at(&mut self, endpoint: [u8; wire::ENDPOINT_LEN]) {
        assert_eq!(self.state, State::Introduced, "admit() without Introduced");
        self.mine.endpoint = endpoint;
        let theirs = self.theirs.expect("introduced");
        let mac = self.own_proof(&theirs);
        self.out.push_back(HandshakeMsg::Reply(self.mine, mac));
        self.push_own_signature(&theirs);
        self.state = State::AwaitProof;
    }

    /// Acceptor, after [`Event::Authenticated`]: tell the dialer the
    /// connection is open. Returns its hello.
    ///
    /// # Panics
    /// Outside that state (a bug in the driver).
    pub fn accept(&mut self) -> Hello {
        assert_eq!(
            self.state,
            State::Authenticated,
            "accept() without Authenticated"
        );
        self.out.push_back(HandshakeMsg::Final(Status::Accept));
        self.state = State::Established;
        self.theirs.expect("authenticated")
    }

    /// Acceptor, after either event: refuse the dialer with `status` (sent
    /// as the final message).
    ///
    /// # Panics
    /// Outside those states, or with [`Status::Accept`] (a bug in the
    /// driver).
    pub fn reject(&mut self, status: Status) {
        assert!(
            matches!(self.state, State::Introduced | State::Authenticated),
            "reject() without a pending decision"
        );
        assert_ne!(status, Status::Accept, "reject() with Accept");
        self.out.push_back(HandshakeMsg::Final(status));
        self.state = State::Failed;
    }

    /// Ends the handshake with `e`; `tell` is the final status the peer
    /// gets (the acceptor's answer to a dialer that failed a check).
    fn fail(&mut self, e: HandshakeError, tell: Option<Status>) -> HandshakeError {
        if let Some(st) = tell {
            self.out.push_back(HandshakeMsg::Final(st));
        }
        self.state = State::Failed;
        e
    }

    fn unexpected(&mut self, expected: &'static str, got: &HandshakeMsg) -> HandshakeError {
        let tell =
            (self.role == Role::Acceptor && self.theirs.is_some()).then_some(Status::AuthFailed);
        self.fail(
            HandshakeError::Unexpected {
                expected,
                got: got.name(),
            },
            tell,
        )
    }

    fn on_dialer_msg(&mut self, msg: HandshakeMsg) -> Result<Option<Event>, HandshakeError> {
        let mine = self.mine;
        match (self.state, msg) {
            (State::AwaitFinal, HandshakeMsg::Final(Status::Accept)) => {
                self.state = State::Established;
                Ok(Some(Event::Established(
                    self.theirs.expect("reply received"),
                )))
            }
            (_, HandshakeMsg::Final(st)) if st != Status::Accept => {
                Err(self.fail(HandshakeError::Rejected(st), None))
            }
            (State::AwaitReply, HandshakeMsg::Reply(h, mac)) => {
                if h.node_id != mine.target_id {
                    return Err(self.fail(
                        HandshakeError::WrongPeer {
                            expected: mine.target_id,
                            got: h.node_id,
                        },
                        None,
                    ));
                }
                if !self.peer_proof_ok(&h, &mac) {
                    return Err(self.fail(HandshakeError::Auth, None));
                }
                if h.instance == 0 {
                    return Err(self.fail(HandshakeError::ZeroInstance, None));
                }
                if h.codec != mine.codec {
                    let e = HandshakeError::Codec {
                        ours: mine.codec,
                        theirs: h.codec,
                    };
                    return Err(self.fail(e, None));
                }
                self.theirs = Some(h);
                if self.creds.identity.is_some() {
                    self.state = State::AwaitAcceptorSignature;
                    Ok(None)
                } else {
                    self.send_proof(h);
                    Ok(Some(Event::Verified(h)))
                }
            }
            (State::AwaitAcceptorSignature, HandshakeMsg::Signature(sig)) => {
                let h = self.theirs.expect("reply received");
                if !self.peer_signature_ok(&h, &sig) {
                    return Err(self.fail(HandshakeError::Signature(h.node_id), None));
                }
                self.send_proof(h);
                Ok(Some(Event::Verified(h)))
            }
            (State::AwaitReply, m) => Err(self.unexpected("reply", &m)),
            (State::AwaitAcceptorSignature, m) => Err(self.unexpected("identity signature", &m)),
            (_, m) => Err(self.unexpected("final", &m)),
        }
    }

    fn send_proof(&mut self, theirs: Hello) {
        let p = self.own_proof(&theirs);
        self.out.push_back(HandshakeMsg::Proof(p));
        self.push_own_signature(&theirs);
        self.state = State::AwaitFinal;
    }

    /// The roles' labels in proofs and transcripts: (this side's, the
    /// peer's).
    fn labels(&self) -> (&'static [u8], &'static [u8]) {
        match self.role {
            Role::Dialer => (DIALER, ACCEPTOR),
            Role::Acceptor => (ACCEPTOR, DIALER),
        }
    }

    /// This side's proof of the cluster secret (binds both hellos).
    fn own_proof(&self, theirs: &Hello) -> [u8; 32] {
        wire::proof(self.creds.secret, self.labels().0, &self.mine, theirs)
    }

    /// Queues this side's identity signature of its transcript, when it
    /// has identity keys.
    fn push_own_signature(&mut self, theirs: &Hello) {
        if let Some(id) = self.creds.identity {
            let t = wire::transcript(self.labels().0, &self.mine, theirs);
            self.out.push_back(HandshakeMsg::Signature(id.sign(&t)));
        }
    }

    /// Whether the peer's proof binds its hello and ours.
    fn peer_proof_ok(&self, theirs: &Hello, mac: &[u8; 32]) -> bool {
        wire::verify_proof(self.creds.secret, self.labels().1, theirs, &self.mine, mac)
    }

    /// Whether the peer's identity signature of its transcript is the
    /// claimed node's (called only with identity keys configured).
    fn peer_signature_ok(&self, theirs: &Hello, sig: &[u8; 64]) -> bool {
        let t = wire::transcript(self.labels().1, theirs, &self.mine);
        let id = self.creds.identity.expect("identity configured");
        id.verify(theirs.node_id, &t, sig)
    }

    fn on_acceptor_msg(&mut self, msg: HandshakeMsg) -> Result<Option<Event>, HandshakeError> {
        let mine = self.mine;
        match (self.state, msg) {
            (State::AwaitHello, HandshakeMsg::Hello(h)) => {
                self.theirs = Some(h);
                if h.target_id != mine.node_id {
                    return Err(self.fail(
                        HandshakeError::Refused(Status::WrongTarget),
                        Some(Status::WrongTarget),
                    ));
                }
                if h.node_id == mine.node_id {
                    return Err(self.fail(
                        HandshakeError::Refused(Status::UnknownNode),
                        Some(Status::UnknownNode),
                    ));
                }
                if h.instance == 0 {
                    return Err(self.fail(HandshakeError::ZeroInstance, Some(Status::AuthFailed)));
                }
                if h.codec != mine.codec {
                    // Told to the dialer, which could not read our messages.
                    let e = HandshakeError::Codec {
                        ours: mine.codec,
                        theirs: h.codec,
                    };
                    return Err(self.fail(e, Some(Status::CodecMismatch)));
                }
                self.state = State::Introduced;
                Ok(Some(Event::Introduced(h)))
            }
            (State::AwaitProof, HandshakeMsg::Proof(p)) => {
                let h = self.theirs.expect("hello received");
                if !self.peer_proof_ok(&h, &p) {
                    return Err(self.fail(HandshakeError::Auth, Some(Status::AuthFailed)));
                }
                if self.creds.identity.is_some() {
                    self.state = State::AwaitDialerSignature;
                    return Ok(None);
                }
                self.state = State::Authenticated;
                Ok(Some(Event::Authenticated(h)))
            }
            (State::AwaitDialerSignature, HandshakeMsg::Signature(sig)) => {
                let h = self.theirs.expect("hello received");
                if !self.peer_signature_ok(&h, &sig) {
                    return Err(self.fail(
                        HandshakeError::Signature(h.node_id),
                        Some(Status::AuthFailed),
                    ));
                }
                self.state = State::Authenticated;
                Ok(Some(Event::Authenticated(h)))
            }
            (State::AwaitHello, m) => Err(self.unexpected("hello", &m)),
            (State::AwaitProof, m) => Err(self.unexpected("proof", &m)),
            (_, m) => Err(self.unexpected("identity signature", &m)),
        }
    }
}

#[cfg(test)]
mod tests;
