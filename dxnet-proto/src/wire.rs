//! Fixed-size control structures that cross the network outside the
//! message stream: the connection handshake (TCP; the IB exchange reuses its
//! fields) and the TCP chunk header.
//!
//! Every decoder here takes a fixed-size array, checks magic and version and
//! returns a typed error: nothing sized by the peer is allocated.

use hmac::{Hmac, KeyInit, Mac};

use crate::identity::Identity;
use sha2::Sha256;

/// Protocol version; peers with another version are rejected.
pub const PROTOCOL_VERSION: u16 = 3;
/// Magic at the start of every handshake message.
pub const HANDSHAKE_MAGIC: [u8; 8] = *b"DXNETrs\0";

/// TCP chunk header: data length and flow-control units (the TCP analogue of
/// RDMA immediate data).
pub const CHUNK_HEADER_LEN: usize = 8;

/// Encodes a chunk header.
pub fn encode_chunk_header(data_len: u32, fc_units: u32) -> [u8; CHUNK_HEADER_LEN] {
    let mut b = [0u8; CHUNK_HEADER_LEN];
    b[..4].copy_from_slice(&data_len.to_le_bytes());
    b[4..].copy_from_slice(&fc_units.to_le_bytes());
    b
}

/// Decodes a chunk header into (data length, flow-control units).
pub fn decode_chunk_header(b: &[u8; CHUNK_HEADER_LEN]) -> (u32, u32) {
    (
        u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
    )
}

/// Splits a TCP byte stream into chunk data ranges and flow-control units
/// (sans-IO: fed with whatever one `read` returned).
#[derive(Debug, Default, Clone)]
pub struct ChunkParser {
    header: [u8; CHUNK_HEADER_LEN],
    header_have: usize,
    data_left: usize,
}

impl ChunkParser {
    /// Parses `data`; `on_data` gets the ranges of `data` that are message
    /// bytes (in order), `on_units` every chunk's flow-control units.
    pub fn parse(
        &mut self,
        data: &[u8],
        mut on_data: impl FnMut(std::ops::Range<usize>),
        mut on_units: impl FnMut(u32),
    ) {
        let n = data.len();
        let mut i = 0;
        while i < n {
            if self.data_left > 0 {
                let take = self.data_left.min(n - i);
                on_data(i..i + take);
                self.data_left -= take;
                i += take;
            } else {
                let take = (CHUNK_HEADER_LEN - self.header_have).min(n - i);
                self.header[self.header_have..self.header_have + take]
                    .copy_from_slice(&data[i..i + take]);
                self.header_have += take;
                i += take;
                if self.header_have == CHUNK_HEADER_LEN {
                    self.header_have = 0;
                    let (len, units) = decode_chunk_header(&self.header);
                    self.data_left = len as usize;
                    if units > 0 {
                        on_units(units);
                    }
                }
            }
        }
    }

    /// True at a chunk boundary.
    pub fn is_idle(&self) -> bool {
        self.header_have == 0 && self.data_left == 0
    }
}

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// Not a dxnet peer.
    #[error("bad handshake magic")]
    BadMagic,
    /// A dxnet peer of another protocol version.
    #[error("protocol version mismatch: ours {ours}, peer {theirs}")]
    Version {
        /// Our version.
        ours: u16,
        /// The peer's.
        theirs: u16,
    },
    /// The peer sent a message of another kind than expected here.
    #[error("unexpected handshake message kind {0}")]
    Kind(u8),
    /// The peer rejected us (reason code, see [`Status`]).
    #[error("rejected by peer: {0}")]
    Rejected(Status),
    /// The peer's proof of the cluster secret was wrong.
    #[error("authentication failed (wrong cluster secret?)")]
    Auth,
    /// The peer's identity signature does not match the node map's public
    /// key of the id it claims.
    #[error("node {0}'s identity signature is not valid")]
    Signature(u16),
    /// A handshake message out of turn.
    #[error("expected the {expected}, got a {got} message")]
    Unexpected {
        /// What this side waited for.
        expected: &'static str,
        /// What arrived.
        got: &'static str,
    },
    /// Another node answered at the address of the one dialed.
    #[error("node {got} answered at the address of node {expected}")]
    WrongPeer {
        /// The node dialed.
        expected: u16,
        /// The node that answered.
        got: u16,
    },
    /// We refused the peer (the status it was sent).
    #[error("refused: {0}")]
    Refused(Status),
    /// The peer announced instance id 0 (reserved: no process has it).
    #[error("peer announced instance id 0")]
    ZeroInstance,
}

/// Outcome codes of a handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// Connection accepted.
    Accept = 0,
    /// A connection between the two nodes exists or is being made from the
    /// other side; use that one.
    Duplicate = 1,
    /// The dialer asked for another node id than ours.
    WrongTarget = 2,
    /// The dialer's id is not in our node map.
    UnknownNode = 3,
    /// The dialer failed authentication.
    AuthFailed = 4,
    /// We are shutting down.
    ShuttingDown = 5,
}

impl Status {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::Accept,
            1 => Self::Duplicate,
            2 => Self::WrongTarget,
            3 => Self::UnknownNode,
            4 => Self::AuthFailed,
            5 => Self::ShuttingDown,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Self::Accept => "accepted",
            Self::Duplicate => "duplicate connection",
            Self::WrongTarget => "wrong target node id",
            Self::UnknownNode => "node id not in the peer's node map",
            Self::AuthFailed => "authentication failed",
            Self::ShuttingDown => "peer shutting down",
        };
        f.write_str(s)
    }
}

/// Handshake message kinds.
const KIND_HELLO: u8 = 1;
const KIND_REPLY: u8 = 2;
const KIND_PROOF: u8 = 3;
const KIND_FINAL: u8 = 4;
const KIND_SIGNATURE: u8 = 5;

/// Length of every handshake message (they are padded to one size).
pub const HANDSHAKE_LEN: usize = 96;

/// The identity and flow-control parameters a side announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Sender's node id.
    pub node_id: u16,
    /// Node id the sender wants to reach (dialer) or 0 (acceptor).
    pub target_id: u16,
    /// Random id of the sender's process lifetime: a restarted node has a
    /// new one, so stale connection state is detected.
    pub instance: u64,
    /// Sender's flow-control window (bytes it accepts unprocessed).
    pub fc_window: u32,
    /// Sender's flow-control unit (bytes per confirmation unit).
    pub fc_unit: u32,
    /// Fresh random challenge.
    pub nonce: [u8; 16],
}

/// One handshake message on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeMsg {
    /// Dialer → acceptor: who I am, whom I want, my challenge.
    Hello(Hello),
    /// Acceptor → dialer: who I am, my challenge, proof over the dialer's
    /// challenge.
    Reply(Hello, [u8; 32]),
    /// Dialer → acceptor: proof over the acceptor's challenge.
    Proof([u8; 32]),
    /// Acceptor → dialer: the decision.
    Final(Status),
    /// With identity keys: the sender's Ed25519 signature of its
    /// [`transcript`], right after its `Reply` or `Proof`.
    Signature([u8; 64]),
}

impl HandshakeMsg {
    /// The message kind in words (for errors).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Hello(_) => "hello",
            Self::Reply(..) => "reply",
            Self::Proof(_) => "proof",
            Self::Final(_) => "final",
            Self::Signature(_) => "identity signature",
        }
    }

    /// Encodes the message into its fixed-size form.
    pub fn encode(&self) -> [u8; HANDSHAKE_LEN] {
        let mut b = [0u8; HANDSHAKE_LEN];
        b[..8].copy_from_slice(&HANDSHAKE_MAGIC);
        b[8..10].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        let put_hello = |b: &mut [u8; HANDSHAKE_LEN], h: &Hello| {
            b[12..14].copy_from_slice(&h.node_id.to_le_bytes());
            b[14..16].copy_from_slice(&h.target_id.to_le_bytes());
            b[16..24].copy_from_slice(&h.instance.to_le_bytes());
            b[24..28].copy_from_slice(&h.fc_window.to_le_bytes());
            b[28..32].copy_from_slice(&h.fc_unit.to_le_bytes());
            b[32..48].copy_from_slice(&h.nonce);
        };
        match self {
            Self::Hello(h) => {
                b[10] = KIND_HELLO;
                put_hello(&mut b, h);
            }
            Self::Reply(h, mac) => {
                b[10] = KIND_REPLY;
                put_hello(&mut b, h);
                b[48..80].copy_from_slice(mac);
            }
            Self::Proof(mac) => {
                b[10] = KIND_PROOF;
                b[48..80].copy_from_slice(mac);
            }
            Self::Final(s) => {
                b[10] = KIND_FINAL;
                b[11] = *s as u8;
            }
            Self::Signature(sig) => {
                b[10] = KIND_SIGNATURE;
                b[12..76].copy_from_slice(sig);
            }
        }
        b
    }

    /// Decodes and validates a handshake message.
    pub fn decode(b: &[u8; HANDSHAKE_LEN]) -> Result<Self, HandshakeError> {
        if b[..8] != HANDSHAKE_MAGIC {
            return Err(HandshakeError::BadMagic);
        }
        let theirs = u16::from_le_bytes([b[8], b[9]]);
        if theirs != PROTOCOL_VERSION {
            return Err(HandshakeError::Version {
                ours: PROTOCOL_VERSION,
                theirs,
            });
        }
        let hello = || Hello {
            node_id: u16::from_le_bytes([b[12], b[13]]),
            target_id: u16::from_le_bytes([b[14], b[15]]),
            instance: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            fc_window: u32::from_le_bytes(b[24..28].try_into().unwrap()),
            fc_unit: u32::from_le_bytes(b[28..32].try_into().unwrap()),
            nonce: b[32..48].try_into().unwrap(),
        };
        let mac = || -> [u8; 32] { b[48..80].try_into().unwrap() };
        match b[10] {
            KIND_HELLO => Ok(Self::Hello(hello())),
            KIND_REPLY => Ok(Self::Reply(hello(), mac())),
            KIND_PROOF => Ok(Self::Proof(mac())),
            KIND_SIGNATURE => Ok(Self::Signature(b[12..76].try_into().unwrap())),
            KIND_FINAL => Status::from_u8(b[11])
                .map(Self::Final)
                .ok_or(HandshakeError::Kind(b[11])),
            k => Err(HandshakeError::Kind(k)),
        }
    }
}

/// What a side signs with its identity key in the TCP handshake: the same
/// fields its HMAC proof binds (role, both challenges, both ids, its
/// instance id), so a signature cannot be replayed for another connection,
/// direction or claimed id.
pub fn transcript(
    role: &[u8],
    prover_nonce: &[u8; 16],
    verifier_nonce: &[u8; 16],
    prover_id: u16,
    verifier_id: u16,
    prover_instance: u64,
) -> [u8; 60] {
    let mut t = [0u8; 60];
    t[..8].copy_from_slice(b"dxnet-hs");
    let r = role.len().min(8);
    t[8..8 + r].copy_from_slice(&role[..r]);
    t[16..32].copy_from_slice(prover_nonce);
    t[32..48].copy_from_slice(verifier_nonce);
    t[48..50].copy_from_slice(&prover_id.to_le_bytes());
    t[50..52].copy_from_slice(&verifier_id.to_le_bytes());
    t[52..60].copy_from_slice(&prover_instance.to_le_bytes());
    t
}

/// The HMAC over the fields a proof binds: role, the prover's nonce, the
/// verifier's nonce, both ids and the prover's instance id.
fn proof_mac(
    secret: &[u8],
    role: &[u8],
    prover_nonce: &[u8; 16],
    verifier_nonce: &[u8; 16],
    prover_id: u16,
    verifier_id: u16,
    prover_instance: u64,
) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC takes any key");
    mac.update(role);
    mac.update(prover_nonce);
    mac.update(verifier_nonce);
    mac.update(&prover_id.to_le_bytes());
    mac.update(&verifier_id.to_le_bytes());
    mac.update(&prover_instance.to_le_bytes());
    mac
}

/// Proof that a side knows the cluster secret: HMAC-SHA256 over the role,
/// both challenges and both identities, so a proof cannot be replayed for
/// another connection, another direction or another claimed node id.
/// Without a secret the proof is all zeros and is not checked.
pub fn proof(
    secret: Option<&[u8]>,
    role: &[u8],
    my_nonce: &[u8; 16],
    peer_nonce: &[u8; 16],
    my_id: u16,
    peer_id: u16,
    my_instance: u64,
) -> [u8; 32] {
    let Some(secret) = secret else {
        return [0; 32];
    };
    proof_mac(
        secret,
        role,
        my_nonce,
        peer_nonce,
        my_id,
        peer_id,
        my_instance,
    )
    .finalize()
    .into_bytes()
    .into()
}

/// Constant-time check of a peer's proof.
#[allow(clippy::too_many_arguments)]
pub fn verify_proof(
    secret: Option<&[u8]>,
    role: &[u8],
    peer_nonce: &[u8; 16],
    my_nonce: &[u8; 16],
    peer_id: u16,
    my_id: u16,
    peer_instance: u64,
    got: &[u8; 32],
) -> bool {
    let Some(secret) = secret else {
        return true;
    };
    proof_mac(
        secret,
        role,
        peer_nonce,
        my_nonce,
        peer_id,
        my_id,
        peer_instance,
    )
    .verify_slice(got)
    .is_ok()
}

/// Magic of the InfiniBand connection-exchange datagrams.
pub const EXCHANGE_MAGIC: [u8; 8] = *b"DXNETib\0";
/// Size of an exchange datagram: fields, HMAC (bytes 88..120) and the
/// sender's identity signature of bytes 0..120 (120..184; zeros without
/// identity keys).
pub const EXCHANGE_LEN: usize = 184;
/// Bytes of a queue-pair endpoint (QPN, PSN, LID, GID) in an exchange.
pub const ENDPOINT_LEN: usize = 26;

/// Kinds of exchange datagrams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ExchangeKind {
    /// "Connect your queue pair to mine" (retransmitted until answered).
    Request = 1,
    /// "Done; here is mine" (answer to a request).
    Accept = 2,
    /// "I closed the connection that used this queue pair."
    Close = 3,
    /// "My queue pair is connected to yours; send" (answer to an accept).
    Ready = 4,
}

/// The UDP datagram by which two nodes discover each other and exchange
/// queue-pair endpoints (the InfiniBand analogue of the TCP handshake).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exchange {
    /// What this datagram asks for.
    pub kind: ExchangeKind,
    /// Sender node id.
    pub src: u16,
    /// Receiver node id.
    pub dst: u16,
    /// Sender's instance id (detects restarted nodes).
    pub instance: u64,
    /// Sender's flow-control window.
    pub fc_window: u32,
    /// Sender's flow-control unit.
    pub fc_unit: u32,
    /// Sender's queue-pair endpoint (opaque here; `dxnet_verbs::Endpoint`).
    pub endpoint: [u8; ENDPOINT_LEN],
    /// Fresh random value: makes every datagram's MAC unique.
    pub nonce: [u8; 16],
}

impl Exchange {
    /// Encodes and, with a secret, authenticates the datagram
    /// (HMAC-SHA256 over everything before the MAC); with an identity, signs
    /// it.
    pub fn encode(&self, secret: Option<&[u8]>, identity: Option<&Identity>) -> [u8; EXCHANGE_LEN] {
        let mut b = [0u8; EXCHANGE_LEN];
        b[..8].copy_from_slice(&EXCHANGE_MAGIC);
        b[8..10].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b[10] = self.kind as u8;
        b[12..14].copy_from_slice(&self.src.to_le_bytes());
        b[14..16].copy_from_slice(&self.dst.to_le_bytes());
        b[16..24].copy_from_slice(&self.instance.to_le_bytes());
        b[24..28].copy_from_slice(&self.fc_window.to_le_bytes());
        b[28..32].copy_from_slice(&self.fc_unit.to_le_bytes());
        b[32..58].copy_from_slice(&self.endpoint);
        b[58..74].copy_from_slice(&self.nonce);
        let mac = exchange_mac(secret, &b[..88]);
        b[88..120].copy_from_slice(&mac);
        if let Some(id) = identity {
            let sig = id.sign(&b[..120]);
            b[120..184].copy_from_slice(&sig);
        }
        b
    }

    /// Decodes and checks a datagram of any length; with an identity, the
    /// signature must be the claimed sender's.
    pub fn decode(
        b: &[u8],
        secret: Option<&[u8]>,
        identity: Option<&Identity>,
    ) -> Result<Self, HandshakeError> {
        if b.len() != EXCHANGE_LEN || b[..8] != EXCHANGE_MAGIC {
            return Err(HandshakeError::BadMagic);
        }
        let theirs = u16::from_le_bytes([b[8], b[9]]);
        if theirs != PROTOCOL_VERSION {
            return Err(HandshakeError::Version {
                ours: PROTOCOL_VERSION,
                theirs,
            });
        }
        let kind = match b[10] {
            1 => ExchangeKind::Request,
            2 => ExchangeKind::Accept,
            3 => ExchangeKind::Close,
            4 => ExchangeKind::Ready,
            k => return Err(HandshakeError::Kind(k)),
        };
        if let Some(secret) = secret {
            // Constant-time comparison.
            if exchange_hmac(secret, &b[..88])
                .verify_slice(&b[88..120])
                .is_err()
            {
                return Err(HandshakeError::Auth);
            }
        }
        let src = u16::from_le_bytes([b[12], b[13]]);
        if let Some(id) = identity {
            let sig: &[u8; 64] = b[120..184].try_into().unwrap();
            if !id.verify(src, &b[..120], sig) {
                return Err(HandshakeError::Auth);
            }
        }
        Ok(Self {
            kind,
            src: u16::from_le_bytes([b[12], b[13]]),
            dst: u16::from_le_bytes([b[14], b[15]]),
            instance: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            fc_window: u32::from_le_bytes(b[24..28].try_into().unwrap()),
            fc_unit: u32::from_le_bytes(b[28..32].try_into().unwrap()),
            endpoint: b[32..58].try_into().unwrap(),
            nonce: b[58..74].try_into().unwrap(),
        })
    }
}

fn exchange_hmac(secret: &[u8], body: &[u8]) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC takes any key");
    mac.update(b"ib-exchange");
    mac.update(body);
    mac
}

fn exchange_mac(secret: Option<&[u8]>, body: &[u8]) -> [u8; 32] {
    match secret {
        Some(secret) => exchange_hmac(secret, body).finalize().into_bytes().into(),
        None => [0; 32],
    }
}

/// Immediate data of an RDMA send: source node id (16 bits),
/// flow-control units (8 bits) and flags (8 bits, [`IMM_STANDALONE`]; the
/// other bits must be zero).
pub fn encode_imm(src: u16, fc_units: u8) -> u32 {
    (src as u32) << 16 | (fc_units as u32) << 8
}

/// Flag of the immediate data: the send carries whole messages outside the
/// connection's byte stream (posted directly, not from the ring buffer), to
/// be decoded on their own; stream bytes around it are not affected.
pub const IMM_STANDALONE: u32 = 0x01;

/// Decodes [`encode_imm`] into (source node id, flow-control units, flags).
pub fn decode_imm(imm: u32) -> (u16, u8, u8) {
    ((imm >> 16) as u16, (imm >> 8) as u8, imm as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            node_id: 3,
            target_id: 7,
            instance: 0x0123_4567_89AB_CDEF,
            fc_window: 1 << 20,
            fc_unit: 1 << 19,
            nonce: [9; 16],
        }
    }

    #[test]
    fn handshake_roundtrip() {
        for m in [
            HandshakeMsg::Hello(hello()),
            HandshakeMsg::Reply(hello(), [5; 32]),
            HandshakeMsg::Proof([6; 32]),
            HandshakeMsg::Final(Status::Duplicate),
        ] {
            assert_eq!(HandshakeMsg::decode(&m.encode()), Ok(m));
        }
    }

    #[test]
    fn handshake_rejects_mismatches() {
        let mut b = HandshakeMsg::Hello(hello()).encode();
        b[8] = 99;
        assert!(matches!(
            HandshakeMsg::decode(&b),
            Err(HandshakeError::Version { theirs: 99, .. })
        ));
        b[0] = b'X';
        assert_eq!(HandshakeMsg::decode(&b), Err(HandshakeError::BadMagic));
        let mut b = HandshakeMsg::Final(Status::Accept).encode();
        b[11] = 200;
        assert!(HandshakeMsg::decode(&b).is_err());
    }

    #[test]
    fn proofs_bind_secret_roles_and_ids() {
        let s = Some(&b"secret"[..]);
        let (a, b) = ([1u8; 16], [2u8; 16]);
        let p = proof(s, b"dialer", &a, &b, 1, 2, 42);
        assert!(verify_proof(s, b"dialer", &a, &b, 1, 2, 42, &p));
        assert!(!verify_proof(
            Some(b"other"),
            b"dialer",
            &a,
            &b,
            1,
            2,
            42,
            &p
        ));
        assert!(!verify_proof(s, b"acceptor", &a, &b, 1, 2, 42, &p));
        assert!(
            !verify_proof(s, b"dialer", &a, &b, 3, 2, 42, &p),
            "claimed id bound"
        );
        assert!(!verify_proof(s, b"dialer", &b, &a, 1, 2, 42, &p));
    }

    #[test]
    fn exchange_roundtrip_and_auth() {
        let e = Exchange {
            kind: ExchangeKind::Request,
            src: 1,
            dst: 2,
            instance: 77,
            fc_window: 1 << 20,
            fc_unit: 1 << 19,
            endpoint: [4; ENDPOINT_LEN],
            nonce: [5; 16],
        };
        let s = Some(&b"k"[..]);
        let b = e.encode(s, None);
        assert_eq!(Exchange::decode(&b, s, None), Ok(e));
        assert_eq!(
            Exchange::decode(&b, Some(b"other"), None),
            Err(HandshakeError::Auth)
        );
        let mut t = b;
        t[12] = 9; // claims another source
        assert_eq!(Exchange::decode(&t, s, None), Err(HandshakeError::Auth));
        assert_eq!(
            Exchange::decode(&b[..100], s, None),
            Err(HandshakeError::BadMagic)
        );
        assert_eq!(Exchange::decode(&e.encode(None, None), None, None), Ok(e));
        // Identity keys: node 1 signs; node 3 (a member with the secret but
        // another key) cannot pass as node 1.
        let n1 = Identity::from_keys([1; 32], &[]).unwrap();
        let n3 = Identity::from_keys([3; 32], &[]).unwrap();
        let me =
            Identity::from_keys([2; 32], &[(1, n1.public_key()), (3, n3.public_key())]).unwrap();
        let signed = e.encode(s, Some(&n1));
        assert_eq!(Exchange::decode(&signed, s, Some(&me)), Ok(e));
        let forged = e.encode(s, Some(&n3));
        assert_eq!(
            Exchange::decode(&forged, s, Some(&me)),
            Err(HandshakeError::Auth)
        );
        assert_eq!(
            Exchange::decode(&b, s, Some(&me)),
            Err(HandshakeError::Auth),
            "unsigned"
        );
        assert_eq!(decode_imm(encode_imm(0xBEEF, 200)), (0xBEEF, 200, 0));
        assert_eq!(
            decode_imm(encode_imm(0xBEEF, 7) | IMM_STANDALONE),
            (0xBEEF, 7, IMM_STANDALONE as u8)
        );
    }

    #[test]
    fn chunk_parser_any_split() {
        let mut stream = Vec::new();
        let mut expect_data = Vec::new();
        for (i, len) in [0usize, 5, 1, 300, 0, 17].iter().enumerate() {
            stream.extend_from_slice(&encode_chunk_header(*len as u32, i as u32));
            let d: Vec<u8> = (0..*len).map(|x| (x * 3 + i) as u8).collect();
            stream.extend_from_slice(&d);
            expect_data.extend(d);
        }
        for split in [1, 3, 8, 9, 64, stream.len()] {
            let mut p = ChunkParser::default();
            let (mut data, mut units) = (Vec::new(), 0u32);
            for c in stream.chunks(split) {
                p.parse(c, |r| data.extend_from_slice(&c[r]), |u| units += u);
            }
            assert!(p.is_idle());
            assert_eq!(data, expect_data, "split {split}");
            assert_eq!(units, 1 + 2 + 3 + 4 + 5);
        }
    }

    #[test]
    fn chunk_header_roundtrip() {
        let b = encode_chunk_header(123_456, 7);
        assert_eq!(decode_chunk_header(&b), (123_456, 7));
    }
}
