//! The discovery datagram: how a node finds the others of its cluster
//! before it connects to them (UDP, on the TCP engine's listening address or
//! the InfiniBand engine's handshake socket).
//!
//! A node probes addresses (seeds and node-map entries not discovered yet)
//! with a [`Kind::Probe`] that names itself (id, instance, the address it
//! is reached at) and carries a fresh nonce; a node that accepts the probe
//! answers with a [`Kind::Answer`] naming itself and echoing the nonce, so
//! an old answer cannot be replayed; a node that finds two holders of one
//! id sends [`Kind::Conflict`] to them; a node that discovers a prober
//! for the first time also sends it the addresses of the other nodes it
//! knows ([`Kind::Members`]). Every datagram is authenticated like
//! the connection handshake: HMAC-SHA256 with the cluster secret over the
//! fields, and with identity keys the sender's Ed25519 signature, checked
//! against the public key of the id it claims.
//!
//! Layout (little-endian):
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..4 | magic `DXdp` |
//! | 4..6 | protocol version |
//! | 6 | kind |
//! | 7 | length `L` of the address |
//! | 8..10 | sender id |
//! | 10..12 | subject id (the sender, or the disputed id of a conflict) |
//! | 12..20 | sender instance id |
//! | 20..36 | nonce |
//! | 36..36+L | address (UTF-8): the sender's, where a conflict's subject is held, or a member list |
//! | then 32 | HMAC (zeros without a secret) |
//! | then 64 | signature over everything before it (zeros without identities) |
//!
//! The decoder takes a datagram of any length and allocates at most the
//! address (at most 255 bytes).

use hmac::digest::KeyInit;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::identity::{Identity, SIGNATURE_LEN};
use crate::wire::PROTOCOL_VERSION;

/// Magic of a discovery datagram (distinct from the handshake datagram's
/// and the close notice's, so one socket can carry all three).
pub const DISCOVERY_MAGIC: [u8; 4] = *b"DXdp";
/// Bytes before the address.
const FIXED_LEN: usize = 36;
/// Bytes after the address: HMAC and signature.
const TRAILER_LEN: usize = 32 + SIGNATURE_LEN;
/// Longest address a datagram carries.
pub const MAX_ADDRESS_LEN: usize = 255;
/// Largest discovery datagram.
pub const DISCOVERY_MAX: usize = FIXED_LEN + MAX_ADDRESS_LEN + TRAILER_LEN;

/// What a discovery datagram says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// "I am `sender` at `address`; who are you?"
    Probe = 1,
    /// "I am `sender` at `address`" (answers the probe with `nonce`).
    Answer = 2,
    /// "Id `subject` is claimed by two nodes; the other one is at
    /// `address`."
    Conflict = 3,
    /// "Other nodes I know are at these addresses" (`address`: a
    /// comma-separated list; follows an answer, with its nonce): hints the
    /// receiver probes like seeds, trusting nothing but the probes'
    /// answers.
    Members = 4,
}

/// A discovery datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announcement {
    /// What it says.
    pub kind: Kind,
    /// The node that sent (and authenticated) it.
    pub sender: u16,
    /// The node it is about: the sender, or a conflict's disputed id.
    pub subject: u16,
    /// The sender's instance id (changes with every start).
    pub instance: u64,
    /// A probe's fresh nonce; an answer or conflict echoes it.
    pub nonce: [u8; 16],
    /// The sender's address, or where a conflict's subject is held.
    pub address: String,
}

/// Why a discovery datagram was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// Not a discovery datagram, or its length does not match its fields.
    #[error("not a discovery datagram")]
    BadFormat,
    /// A dxnet peer of another protocol version.
    #[error("protocol version mismatch: ours {ours}, peer {theirs}")]
    Version {
        /// Our version.
        ours: u16,
        /// The peer's.
        theirs: u16,
    },
    /// An unknown kind byte.
    #[error("unknown discovery kind {0}")]
    Kind(u8),
    /// The address is not UTF-8.
    #[error("address is not UTF-8")]
    Address,
    /// Wrong HMAC (another cluster secret, or tampered).
    #[error("authentication failed (wrong cluster secret?)")]
    Auth,
    /// The signature is not the claimed sender's (or the sender has no
    /// public key in the node map).
    #[error("node {0}'s identity signature is not valid")]
    Signature(u16),
}

impl Announcement {
    /// Encodes the datagram, with the HMAC of `secret` and the signature of
    /// `identity` where configured. The address is cut at
    /// [`MAX_ADDRESS_LEN`] bytes, on a character boundary (configuration
    /// checks keep it shorter).
    pub fn encode(&self, secret: Option<&[u8]>, identity: Option<&Identity>) -> Vec<u8> {
        let mut end = self.address.len().min(MAX_ADDRESS_LEN);
        while !self.address.is_char_boundary(end) {
            end -= 1;
        }
        let addr = &self.address.as_bytes()[..end];
        let mut b = Vec::with_capacity(FIXED_LEN + addr.len() + TRAILER_LEN);
        b.extend_from_slice(&DISCOVERY_MAGIC);
        b.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b.push(self.kind as u8);
        b.push(addr.len() as u8);
        b.extend_from_slice(&self.sender.to_le_bytes());
        b.extend_from_slice(&self.subject.to_le_bytes());
        b.extend_from_slice(&self.instance.to_le_bytes());
        b.extend_from_slice(&self.nonce);
        b.extend_from_slice(addr);
        let mac = match secret {
            Some(s) => mac(s, &b).finalize().into_bytes().into(),
            None => [0u8; 32],
        };
        b.extend_from_slice(&mac);
        let sig = identity.map_or([0u8; SIGNATURE_LEN], |id| id.sign(&b));
        b.extend_from_slice(&sig);
        b
    }

    /// Decodes and checks a datagram of any length: magic, version, kind,
    /// lengths, the HMAC with `secret` and, with `identity`, the sender's
    /// signature.
    pub fn decode(
        d: &[u8],
        secret: Option<&[u8]>,
        identity: Option<&Identity>,
    ) -> Result<Self, DiscoveryError> {
        if d.len() < FIXED_LEN + TRAILER_LEN || d[..4] != DISCOVERY_MAGIC {
            return Err(DiscoveryError::BadFormat);
        }
        let theirs = u16::from_le_bytes([d[4], d[5]]);
        if theirs != PROTOCOL_VERSION {
            return Err(DiscoveryError::Version {
                ours: PROTOCOL_VERSION,
                theirs,
            });
        }
        let kind = match d[6] {
            1 => Kind::Probe,
            2 => Kind::Answer,
            3 => Kind::Conflict,
            4 => Kind::Members,
            k => return Err(DiscoveryError::Kind(k)),
        };
        let addr_len = d[7] as usize;
        let body_len = FIXED_LEN + addr_len;
        if d.len() != body_len + TRAILER_LEN {
            return Err(DiscoveryError::BadFormat);
        }
        if let Some(s) = secret {
            // Constant-time comparison.
            if mac(s, &d[..body_len])
                .verify_slice(&d[body_len..body_len + 32])
                .is_err()
            {
                return Err(DiscoveryError::Auth);
            }
        }
        let sender = u16::from_le_bytes([d[8], d[9]]);
        if let Some(id) = identity {
            let sig: &[u8; SIGNATURE_LEN] = d[body_len + 32..].try_into().expect("trailer length");
            if !id.verify(sender, &d[..body_len + 32], sig) {
                return Err(DiscoveryError::Signature(sender));
            }
        }
        let address = std::str::from_utf8(&d[FIXED_LEN..body_len])
            .map_err(|_| DiscoveryError::Address)?
            .to_string();
        Ok(Self {
            kind,
            sender,
            subject: u16::from_le_bytes([d[10], d[11]]),
            instance: u64::from_le_bytes(d[12..20].try_into().expect("8 bytes")),
            nonce: d[20..36].try_into().expect("16 bytes"),
            address,
        })
    }
}

fn mac(secret: &[u8], body: &[u8]) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC takes any key");
    mac.update(b"discovery");
    mac.update(body);
    mac
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe() -> Announcement {
        Announcement {
            kind: Kind::Probe,
            sender: 3,
            subject: 3,
            instance: 0xDEAD_BEEF,
            nonce: [7; 16],
            address: "10.0.0.3:7000".into(),
        }
    }

    #[test]
    fn round_trip_with_secret() {
        let a = probe();
        let d = a.encode(Some(b"s3cret"), None);
        assert!(d.len() <= DISCOVERY_MAX);
        assert_eq!(Announcement::decode(&d, Some(b"s3cret"), None), Ok(a));
    }

    #[test]
    fn wrong_secret_and_tampering_are_refused() {
        let d = probe().encode(Some(b"s3cret"), None);
        assert_eq!(
            Announcement::decode(&d, Some(b"other"), None),
            Err(DiscoveryError::Auth)
        );
        let mut t = d.clone();
        t[9] ^= 1; // another sender id
        assert_eq!(
            Announcement::decode(&t, Some(b"s3cret"), None),
            Err(DiscoveryError::Auth)
        );
        // Without a secret at the sender the MAC is zeros: refused by a
        // receiver that has one.
        let plain = probe().encode(None, None);
        assert_eq!(
            Announcement::decode(&plain, Some(b"s3cret"), None),
            Err(DiscoveryError::Auth)
        );
    }

    #[test]
    fn lengths_and_kinds_are_checked() {
        let d = probe().encode(None, None);
        for cut in 0..d.len() {
            assert!(Announcement::decode(&d[..cut], None, None).is_err());
        }
        let mut longer = d.clone();
        longer.push(0);
        assert_eq!(
            Announcement::decode(&longer, None, None),
            Err(DiscoveryError::BadFormat)
        );
        let mut k = d.clone();
        k[6] = 9;
        assert_eq!(
            Announcement::decode(&k, None, None),
            Err(DiscoveryError::Kind(9))
        );
        let mut v = d;
        v[4] = v[4].wrapping_add(1);
        assert!(matches!(
            Announcement::decode(&v, None, None),
            Err(DiscoveryError::Version { .. })
        ));
    }

    #[test]
    fn identities_bind_the_sender() {
        let keys: Vec<[u8; 32]> = (1..=3u8).map(|i| [i; 32]).collect();
        let pubs: Vec<(u16, [u8; 32])> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let id = Identity::from_keys(*k, &[]).unwrap();
                (i as u16 + 1, id.public_key())
            })
            .collect();
        let node3 = Identity::from_keys(keys[2], &pubs).unwrap();
        let node1 = Identity::from_keys(keys[0], &pubs).unwrap();
        let d = probe().encode(None, Some(&node3));
        assert_eq!(Announcement::decode(&d, None, Some(&node1)), Ok(probe()));
        // Node 2 claiming to be node 3.
        let node2 = Identity::from_keys(keys[1], &pubs).unwrap();
        let forged = probe().encode(None, Some(&node2));
        assert_eq!(
            Announcement::decode(&forged, None, Some(&node1)),
            Err(DiscoveryError::Signature(3))
        );
        // A sender the node map has no key for.
        let mut stranger = probe();
        stranger.sender = 9;
        let d = stranger.encode(None, Some(&node3));
        assert_eq!(
            Announcement::decode(&d, None, Some(&node1)),
            Err(DiscoveryError::Signature(9))
        );
    }

    #[test]
    fn long_addresses_are_cut_not_overflowed() {
        let mut a = probe();
        a.address = "x".repeat(400);
        let d = a.encode(None, None);
        assert_eq!(d.len(), DISCOVERY_MAX);
        let back = Announcement::decode(&d, None, None).unwrap();
        assert_eq!(back.address.len(), MAX_ADDRESS_LEN);
    }
}
