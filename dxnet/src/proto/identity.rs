//! Per-node identity keys (Ed25519): bind node ids to their holders.
//!
//! The cluster secret proves membership, but every member knows it, so a
//! member could claim the id of another node (while that node is down). With
//! identity keys each node signs its part of the connection set-up (the TCP
//! handshake transcript, the InfiniBand exchange datagrams) with its own
//! private key, and the peer checks the signature against the public key the
//! node map lists for the claimed id. A member then cannot act as any other
//! node id. Signatures come from `ed25519-dalek` (RustCrypto's dalek
//! implementation), never hand-written crypto.

use std::collections::HashMap;

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};

use crate::config::Config;
use crate::{Error, Result};

/// Length of a signature on the wire.
pub const SIGNATURE_LEN: usize = 64;

/// This node's signing key and the public keys of the node map.
pub struct Identity {
    signing: SigningKey,
    peers: HashMap<u16, VerifyingKey>,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field(
                "public",
                &hex::encode(self.signing.verifying_key().as_bytes()),
            )
            .field("peers", &self.peers.len())
            .finish()
    }
}

fn key_bytes(what: &str, hex_text: &str) -> Result<[u8; 32]> {
    let v = hex::decode(hex_text.trim())
        .map_err(|e| Error::Config(format!("{what}: not a hex string: {e}")))?;
    v.try_into()
        .map_err(|v: Vec<u8>| Error::Config(format!("{what}: {} bytes, expected 32", v.len())))
}

impl Identity {
    /// The identity of `cfg`'s node: `None` without `identity_key`. Every
    /// node-map entry then needs a `public_key`, and the own entry's must
    /// match the private key; any problem is a configuration error naming
    /// the field.
    pub fn from_config(cfg: &Config) -> Result<Option<Self>> {
        let Some(secret) = &cfg.identity_key else {
            if let Some(n) = cfg.nodes.iter().find(|n| n.public_key.is_some()) {
                return Err(Error::Config(format!(
                    "nodes: node {} has a public_key but identity_key is not set",
                    n.id
                )));
            }
            return Ok(None);
        };
        let signing = SigningKey::from_bytes(&key_bytes("identity_key", secret)?);
        let mut peers = HashMap::new();
        for n in &cfg.nodes {
            let what = format!("nodes: node {} public_key", n.id);
            let Some(pk) = &n.public_key else {
                return Err(Error::Config(format!(
                    "{what} missing (identity_key is set, so every node needs one)"
                )));
            };
            let key = VerifyingKey::from_bytes(&key_bytes(&what, pk)?)
                .map_err(|e| Error::Config(format!("{what}: {e}")))?;
            if n.id == cfg.node_id && key != signing.verifying_key() {
                return Err(Error::Config(format!(
                    "{what} does not belong to identity_key"
                )));
            }
            peers.insert(n.id, key);
        }
        Ok(Some(Self { signing, peers }))
    }

    /// An identity from raw keys: this node's 32-byte private key seed and
    /// the public keys of the nodes it talks to.
    pub fn from_keys(own: [u8; 32], peers: &[(u16, [u8; 32])]) -> Result<Self> {
        let mut map = HashMap::new();
        for (id, pk) in peers {
            let key = VerifyingKey::from_bytes(pk)
                .map_err(|e| Error::Config(format!("public key of node {id}: {e}")))?;
            map.insert(*id, key);
        }
        Ok(Self {
            signing: SigningKey::from_bytes(&own),
            peers: map,
        })
    }

    /// This node's public key.
    pub fn public_key(&self) -> [u8; 32] {
        self.signing.verifying_key().to_bytes()
    }

    /// Signs `msg` as this node.
    pub fn sign(&self, msg: &[u8]) -> [u8; SIGNATURE_LEN] {
        self.signing.sign(msg).to_bytes()
    }

    /// True if `sig` is node `node`'s signature of `msg` (false for nodes
    /// without a key).
    pub fn verify(&self, node: u16, msg: &[u8], sig: &[u8; SIGNATURE_LEN]) -> bool {
        self.peers
            .get(&node)
            .is_some_and(|k| k.verify(msg, &Signature::from_bytes(sig)).is_ok())
    }
}

/// A fresh identity key pair as hex strings: (`identity_key` for the node's
/// config, `public_key` for its node-map entry).
pub fn generate_keypair() -> (String, String) {
    let signing = SigningKey::from_bytes(&rand::random());
    (
        hex::encode(signing.to_bytes()),
        hex::encode(signing.verifying_key().as_bytes()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::NodeEntry;

    fn cfg(me: u16, keys: &[(String, String)]) -> Config {
        Config {
            node_id: me,
            nodes: keys
                .iter()
                .enumerate()
                .map(|(i, (_, pk))| NodeEntry {
                    id: i as u16,
                    address: format!("127.0.0.1:{}", 1000 + i),
                    public_key: Some(pk.clone()),
                })
                .collect(),
            identity_key: Some(keys[me as usize].0.clone()),
            ..Config::default()
        }
    }

    #[test]
    fn signatures_bind_node_ids() {
        let keys: Vec<_> = (0..3).map(|_| generate_keypair()).collect();
        let a = Identity::from_config(&cfg(0, &keys)).unwrap().unwrap();
        let b = Identity::from_config(&cfg(1, &keys)).unwrap().unwrap();
        let sig = b.sign(b"transcript");
        assert!(a.verify(1, b"transcript", &sig));
        assert!(!a.verify(2, b"transcript", &sig), "node 1 cannot pass as 2");
        assert!(!a.verify(1, b"transcripT", &sig));
        assert!(!a.verify(9, b"transcript", &sig), "unknown node");
    }

    #[test]
    fn config_errors_name_the_field() {
        let keys: Vec<_> = (0..2).map(|_| generate_keypair()).collect();
        let mut c = cfg(0, &keys);
        c.nodes[1].public_key = None;
        let e = Identity::from_config(&c).unwrap_err().to_string();
        assert!(e.contains("node 1 public_key missing"), "{e}");
        let mut c = cfg(0, &keys);
        c.identity_key = Some(keys[1].0.clone());
        let e = Identity::from_config(&c).unwrap_err().to_string();
        assert!(e.contains("does not belong to identity_key"), "{e}");
        let mut c = cfg(0, &keys);
        c.identity_key = Some("abc".into());
        assert!(Identity::from_config(&c).is_err());
        let mut c = cfg(0, &keys);
        c.identity_key = None;
        let e = Identity::from_config(&c).unwrap_err().to_string();
        assert!(e.contains("identity_key is not set"), "{e}");
        for n in &mut c.nodes {
            n.public_key = None;
        }
        assert!(Identity::from_config(&c).unwrap().is_none());
    }
}
