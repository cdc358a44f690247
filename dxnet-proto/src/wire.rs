//! Fixed-size control structures that cross the network outside the
//! message stream: the connection handshake (over the TCP stream, or in UDP
//! datagrams for InfiniBand), the InfiniBand close notice and the TCP chunk
//! header.
//!
//! Every decoder here takes a fixed-size array, checks magic and version and
//! returns a typed error: nothing sized by the peer is allocated.

use hmac::digest::KeyInit;
use hmac::{Hmac, Mac};

use crate::identity::Identity;
use sha2::Sha256;

/// Protocol version; peers with another version are rejected (the first
/// ten bytes of every handshake message, magic and version, keep their
/// place across versions, so the mismatch is reported as such).
pub const PROTOCOL_VERSION: u16 = 5;
/// Magic at the start of every handshake message.
pub const HANDSHAKE_MAGIC: [u8; 8] = *b"DXNETrs\0";
/// Magic and version: the part of a handshake message every version keeps.
pub const HANDSHAKE_PREFIX_LEN: usize = 10;

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
    /// The peer encodes message payloads in another format (another
    /// build's codec), so neither could read the other's messages.
    #[error(
        "payload format mismatch: ours {} ({ours}), peer {} ({theirs})",
        crate::codec::codec_name(*ours),
        crate::codec::codec_name(*theirs)
    )]
    Codec {
        /// Our payload format id.
        ours: u8,
        /// The peer's.
        theirs: u8,
    },
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
    /// The dialer encodes payloads in another format than ours.
    CodecMismatch = 6,
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
            6 => Self::CodecMismatch,
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
            Self::CodecMismatch => "payload format differs from the peer's",
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
pub const HANDSHAKE_LEN: usize = 112;

/// Bytes of a transport endpoint in a [`Hello`]: an InfiniBand queue pair's
/// QPN, PSN, LID and GID (`dxnet_verbs::Endpoint`); zeros on TCP.
pub const ENDPOINT_LEN: usize = 26;

/// Bytes of a hello as proofs and signatures bind it (every field).
const HELLO_BOUND_LEN: usize = 37 + ENDPOINT_LEN;

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
    /// The sender's message payload format
    /// ([`codec::CODEC_ID`](crate::codec::CODEC_ID)): nodes with different
    /// formats would misread each other's messages, so they do not connect.
    pub codec: u8,
    /// Where the sender's transport takes this connection's data (opaque
    /// here; see [`ENDPOINT_LEN`]).
    pub endpoint: [u8; ENDPOINT_LEN],
}

impl Hello {
    /// Every field, in wire order (what proofs and signatures bind).
    fn bound(&self) -> [u8; HELLO_BOUND_LEN] {
        let mut b = [0u8; HELLO_BOUND_LEN];
        b[0..2].copy_from_slice(&self.node_id.to_le_bytes());
        b[2..4].copy_from_slice(&self.target_id.to_le_bytes());
        b[4..12].copy_from_slice(&self.instance.to_le_bytes());
        b[12..16].copy_from_slice(&self.fc_window.to_le_bytes());
        b[16..20].copy_from_slice(&self.fc_unit.to_le_bytes());
        b[20..36].copy_from_slice(&self.nonce);
        b[36] = self.codec;
        b[37..].copy_from_slice(&self.endpoint);
        b
    }

    fn from_bound(b: &[u8]) -> Self {
        Self {
            node_id: u16::from_le_bytes([b[0], b[1]]),
            target_id: u16::from_le_bytes([b[2], b[3]]),
            instance: u64::from_le_bytes(b[4..12].try_into().unwrap()),
            fc_window: u32::from_le_bytes(b[12..16].try_into().unwrap()),
            fc_unit: u32::from_le_bytes(b[16..20].try_into().unwrap()),
            nonce: b[20..36].try_into().unwrap(),
            codec: b[36],
            endpoint: b[37..HELLO_BOUND_LEN].try_into().unwrap(),
        }
    }
}

/// Where a hello's fields start in a message.
const HELLO_AT: usize = 12;
/// Where a proof starts in a message.
const MAC_AT: usize = HELLO_AT + HELLO_BOUND_LEN + 5;

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
            b[HELLO_AT..HELLO_AT + HELLO_BOUND_LEN].copy_from_slice(&h.bound());
        };
        match self {
            Self::Hello(h) => {
                b[10] = KIND_HELLO;
                put_hello(&mut b, h);
            }
            Self::Reply(h, mac) => {
                b[10] = KIND_REPLY;
                put_hello(&mut b, h);
                b[MAC_AT..MAC_AT + 32].copy_from_slice(mac);
            }
            Self::Proof(mac) => {
                b[10] = KIND_PROOF;
                b[MAC_AT..MAC_AT + 32].copy_from_slice(mac);
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

    /// Checks the magic and version at the start of a message: the first
    /// [`HANDSHAKE_PREFIX_LEN`] bytes (a peer of another version may send
    /// messages of another length; this tells it apart before the rest).
    pub fn check_prefix(b: &[u8; HANDSHAKE_PREFIX_LEN]) -> Result<(), HandshakeError> {
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
        Ok(())
    }

    /// Decodes and validates a handshake message.
    pub fn decode(b: &[u8; HANDSHAKE_LEN]) -> Result<Self, HandshakeError> {
        Self::check_prefix(b[..HANDSHAKE_PREFIX_LEN].try_into().unwrap())?;
        let hello = || Hello::from_bound(&b[HELLO_AT..HELLO_AT + HELLO_BOUND_LEN]);
        let mac = || -> [u8; 32] { b[MAC_AT..MAC_AT + 32].try_into().unwrap() };
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

/// Length of a [`transcript`].
pub const TRANSCRIPT_LEN: usize = 16 + 2 * HELLO_BOUND_LEN;

/// What a side proves (HMAC with the cluster secret) and signs (identity
/// key) in the handshake: its role and both hellos in full (ids, instance
/// ids, flow-control parameters, challenges, transport endpoints), so a
/// proof or signature cannot be replayed for another connection, direction
/// or claimed id, and no announced field can be changed on the way.
pub fn transcript(role: &[u8], prover: &Hello, verifier: &Hello) -> [u8; TRANSCRIPT_LEN] {
    let mut t = [0u8; TRANSCRIPT_LEN];
    t[..8].copy_from_slice(b"dxnet-hs");
    let r = role.len().min(8);
    t[8..8 + r].copy_from_slice(&role[..r]);
    t[16..16 + HELLO_BOUND_LEN].copy_from_slice(&prover.bound());
    t[16 + HELLO_BOUND_LEN..].copy_from_slice(&verifier.bound());
    t
}

fn proof_mac(secret: &[u8], role: &[u8], prover: &Hello, verifier: &Hello) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC takes any key");
    mac.update(&transcript(role, prover, verifier));
    mac
}

/// Proof that a side knows the cluster secret: HMAC-SHA256 over its
/// [`transcript`]. Without a secret the proof is all zeros and is not
/// checked.
pub fn proof(secret: Option<&[u8]>, role: &[u8], prover: &Hello, verifier: &Hello) -> [u8; 32] {
    let Some(secret) = secret else {
        return [0; 32];
    };
    proof_mac(secret, role, prover, verifier)
        .finalize()
        .into_bytes()
        .into()
}

/// Constant-time check of a peer's proof.
pub fn verify_proof(
    secret: Option<&[u8]>,
    role: &[u8],
    prover: &Hello,
    verifier: &Hello,
    got: &[u8; 32],
) -> bool {
    let Some(secret) = secret else {
        return true;
    };
    proof_mac(secret, role, prover, verifier)
        .verify_slice(got)
        .is_ok()
}

/// Magic of a handshake datagram (the handshake over UDP, as the
/// InfiniBand engine runs it).
pub const DATAGRAM_MAGIC: [u8; 4] = *b"DXhd";
/// Bytes of a [`DatagramHeader`].
pub const DATAGRAM_HEADER_LEN: usize = 18;
/// Largest handshake datagram: the header and one flight of messages (a
/// reply or proof with its identity signature).
pub const DATAGRAM_MAX: usize = DATAGRAM_HEADER_LEN + 2 * HANDSHAKE_LEN;

/// Routes a handshake datagram to its handshake: which pair of nodes,
/// which handshake between them, and which side is addressed. Not
/// authenticated: it only selects the handshake, whose messages carry their
/// own proofs. The session id is the start of the dialer's fresh nonce, so
/// a sender off the path cannot guess it: its datagrams reach no
/// handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DatagramHeader {
    /// The node that started the handshake.
    pub dialer: u16,
    /// The node it dialed.
    pub acceptor: u16,
    /// The datagram goes to the acceptor (else to the dialer).
    pub to_acceptor: bool,
    /// Which handshake: the first bytes of the dialer's hello nonce.
    pub session: [u8; 8],
}

impl DatagramHeader {
    /// The session id of a handshake whose dialer sent `hello`.
    pub fn session_of(hello: &Hello) -> [u8; 8] {
        hello.nonce[..8].try_into().unwrap()
    }
}

impl DatagramHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; DATAGRAM_HEADER_LEN] {
        let mut b = [0u8; DATAGRAM_HEADER_LEN];
        b[..4].copy_from_slice(&DATAGRAM_MAGIC);
        b[4] = u8::from(self.to_acceptor);
        b[6..8].copy_from_slice(&self.dialer.to_le_bytes());
        b[8..10].copy_from_slice(&self.acceptor.to_le_bytes());
        b[10..18].copy_from_slice(&self.session);
        b
    }

    /// Splits a datagram into its header and the handshake messages.
    pub fn decode(d: &[u8]) -> Result<(Self, &[u8]), HandshakeError> {
        if d.len() < DATAGRAM_HEADER_LEN || d[..4] != DATAGRAM_MAGIC || d[4] > 1 {
            return Err(HandshakeError::BadMagic);
        }
        let h = Self {
            to_acceptor: d[4] == 1,
            dialer: u16::from_le_bytes([d[6], d[7]]),
            acceptor: u16::from_le_bytes([d[8], d[9]]),
            session: d[10..18].try_into().unwrap(),
        };
        Ok((h, &d[DATAGRAM_HEADER_LEN..]))
    }
}

/// Magic of an InfiniBand close notice.
pub const CLOSE_MAGIC: [u8; 8] = *b"DXNETib\0";
/// Size of a close notice: fields, HMAC (bytes 68..100) and the sender's
/// identity signature of bytes 0..100 (100..164; zeros without identity
/// keys).
pub const CLOSE_LEN: usize = 164;

/// "I closed the connection between these two queue pairs": a UDP datagram
/// that lets the peer fail its half at once rather than at its next send.
/// It names both endpoints, so it closes only that connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CloseNotice {
    /// Sender node id.
    pub src: u16,
    /// Receiver node id.
    pub dst: u16,
    /// The sender's endpoint of the connection.
    pub src_endpoint: [u8; ENDPOINT_LEN],
    /// The receiver's endpoint of the connection.
    pub dst_endpoint: [u8; ENDPOINT_LEN],
}

impl CloseNotice {
    /// Encodes and, with a secret, authenticates the notice (HMAC-SHA256
    /// over everything before the MAC); with an identity, signs it.
    pub fn encode(&self, secret: Option<&[u8]>, identity: Option<&Identity>) -> [u8; CLOSE_LEN] {
        let mut b = [0u8; CLOSE_LEN];
        b[..8].copy_from_slice(&CLOSE_MAGIC);
        b[8..10].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b[12..14].copy_from_slice(&self.src.to_le_bytes());
        b[14..16].copy_from_slice(&self.dst.to_le_bytes());
        b[16..42].copy_from_slice(&self.src_endpoint);
        b[42..68].copy_from_slice(&self.dst_endpoint);
        let mac = close_mac(secret, &b[..68]);
        b[68..100].copy_from_slice(&mac);
        if let Some(id) = identity {
            let sig = id.sign(&b[..100]);
            b[100..164].copy_from_slice(&sig);
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
        if b.len() != CLOSE_LEN || b[..8] != CLOSE_MAGIC {
            return Err(HandshakeError::BadMagic);
        }
        let theirs = u16::from_le_bytes([b[8], b[9]]);
        if theirs != PROTOCOL_VERSION {
            return Err(HandshakeError::Version {
                ours: PROTOCOL_VERSION,
                theirs,
            });
        }
        if b[10] != 0 || b[11] != 0 {
            return Err(HandshakeError::Kind(b[10]));
        }
        if let Some(secret) = secret {
            // Constant-time comparison.
            if close_hmac(secret, &b[..68])
                .verify_slice(&b[68..100])
                .is_err()
            {
                return Err(HandshakeError::Auth);
            }
        }
        let src = u16::from_le_bytes([b[12], b[13]]);
        if let Some(id) = identity {
            let sig: &[u8; 64] = b[100..164].try_into().unwrap();
            if !id.verify(src, &b[..100], sig) {
                return Err(HandshakeError::Auth);
            }
        }
        Ok(Self {
            src,
            dst: u16::from_le_bytes([b[14], b[15]]),
            src_endpoint: b[16..42].try_into().unwrap(),
            dst_endpoint: b[42..68].try_into().unwrap(),
        })
    }
}

fn close_hmac(secret: &[u8], body: &[u8]) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC takes any key");
    mac.update(b"ib-close");
    mac.update(body);
    mac
}

fn close_mac(secret: Option<&[u8]>, body: &[u8]) -> [u8; 32] {
    match secret {
        Some(secret) => close_hmac(secret, body).finalize().into_bytes().into(),
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
            codec: 3,
            endpoint: [8; ENDPOINT_LEN],
        }
    }

    #[test]
    fn handshake_roundtrip() {
        for m in [
            HandshakeMsg::Hello(hello()),
            HandshakeMsg::Reply(hello(), [5; 32]),
            HandshakeMsg::Proof([6; 32]),
            HandshakeMsg::Final(Status::Duplicate),
            HandshakeMsg::Signature([7; 64]),
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
        assert!(matches!(
            HandshakeMsg::check_prefix(b[..HANDSHAKE_PREFIX_LEN].try_into().unwrap()),
            Err(HandshakeError::Version { theirs: 99, .. })
        ));
        b[0] = b'X';
        assert_eq!(HandshakeMsg::decode(&b), Err(HandshakeError::BadMagic));
        let mut b = HandshakeMsg::Final(Status::Accept).encode();
        b[11] = 200;
        assert!(HandshakeMsg::decode(&b).is_err());
    }

    #[test]
    fn proofs_bind_secret_roles_and_every_hello_field() {
        let s = Some(&b"secret"[..]);
        let (a, b) = (
            hello(),
            Hello {
                node_id: 7,
                target_id: 0,
                nonce: [1; 16],
                ..hello()
            },
        );
        let p = proof(s, b"dialer", &a, &b);
        assert!(verify_proof(s, b"dialer", &a, &b, &p));
        assert!(!verify_proof(Some(b"other"), b"dialer", &a, &b, &p));
        assert!(!verify_proof(s, b"acceptor", &a, &b, &p));
        assert!(!verify_proof(s, b"dialer", &b, &a, &p), "direction bound");
        let changed = [
            Hello { node_id: 4, ..a },
            Hello { target_id: 8, ..a },
            Hello { instance: 1, ..a },
            Hello { fc_window: 1, ..a },
            Hello { fc_unit: 1, ..a },
            Hello {
                nonce: [0; 16],
                ..a
            },
            Hello { codec: 4, ..a },
            Hello {
                endpoint: [0; ENDPOINT_LEN],
                ..a
            },
        ];
        for c in changed {
            assert!(!verify_proof(s, b"dialer", &c, &b, &p), "{c:?} bound");
            assert!(!verify_proof(s, b"dialer", &a, &c, &p), "{c:?} bound");
        }
        assert!(verify_proof(None, b"dialer", &a, &b, &[0; 32]), "no secret");
    }

    #[test]
    fn datagram_header_roundtrip() {
        let h = DatagramHeader {
            dialer: 513,
            acceptor: 2,
            to_acceptor: true,
            session: [3; 8],
        };
        let mut d = h.encode().to_vec();
        d.extend_from_slice(&[1, 2, 3]);
        assert_eq!(DatagramHeader::decode(&d), Ok((h, &[1u8, 2, 3][..])));
        assert!(DatagramHeader::decode(&d[..DATAGRAM_HEADER_LEN - 1]).is_err());
        d[4] = 2;
        assert!(DatagramHeader::decode(&d).is_err());
    }

    #[test]
    fn close_notice_roundtrip_and_auth() {
        let e = CloseNotice {
            src: 1,
            dst: 2,
            src_endpoint: [4; ENDPOINT_LEN],
            dst_endpoint: [5; ENDPOINT_LEN],
        };
        let s = Some(&b"k"[..]);
        let b = e.encode(s, None);
        assert_eq!(CloseNotice::decode(&b, s, None), Ok(e));
        assert_eq!(
            CloseNotice::decode(&b, Some(b"other"), None),
            Err(HandshakeError::Auth)
        );
        let mut t = b;
        t[12] = 9; // claims another source
        assert_eq!(CloseNotice::decode(&t, s, None), Err(HandshakeError::Auth));
        assert_eq!(
            CloseNotice::decode(&b[..100], s, None),
            Err(HandshakeError::BadMagic)
        );
        assert_eq!(
            CloseNotice::decode(&e.encode(None, None), None, None),
            Ok(e)
        );
        // Identity keys: node 1 signs; node 3 (a member with the secret but
        // another key) cannot pass as node 1.
        let n1 = Identity::from_keys([1; 32], &[]).unwrap();
        let n3 = Identity::from_keys([3; 32], &[]).unwrap();
        let me =
            Identity::from_keys([2; 32], &[(1, n1.public_key()), (3, n3.public_key())]).unwrap();
        let signed = e.encode(s, Some(&n1));
        assert_eq!(CloseNotice::decode(&signed, s, Some(&me)), Ok(e));
        let forged = e.encode(s, Some(&n3));
        assert_eq!(
            CloseNotice::decode(&forged, s, Some(&me)),
            Err(HandshakeError::Auth)
        );
        assert_eq!(
            CloseNotice::decode(&b, s, Some(&me)),
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
