//! Per-node identity keys (Ed25519): bind node ids to their holders.
//!
//! The cluster secret proves membership, but every member knows it, so a
//! member could claim the id of another node (while that node is down). With
//! identity keys each node signs its part of the connection set-up (the
//! handshake transcript, InfiniBand close notices) with its own
//! private key, and the peer checks the signature against the public key the
//! node map lists for the claimed id. A member then cannot act as any other
//! node id. Signatures come from `ed25519-dalek` (RustCrypto's dalek
//! implementation), never hand-written crypto.

use std::collections::HashMap;

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};

/// An identity configuration that cannot work (the text names the
/// field: `identity_key`, or `nodes: node N public_key`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct IdentityError(pub String);

type Result<T, E = IdentityError> = std::result::Result<T, E>;

/// Length of a signature on the wire.
pub const SIGNATURE_LEN: usize = 64;

/// This node's signing key and the public keys of the node map.
pub struct Identity {
    signing: SigningKey,
    /// Changed when the node map changes at run time (rarely; read once
    /// per handshake).
    peers: std::sync::RwLock<HashMap<u16, VerifyingKey>>,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field(
                "public",
                &hex::encode(self.signing.verifying_key().as_bytes()),
            )
            .field("peers", &self.peers().len())
            .finish()
    }
}

fn key_bytes(what: &str, hex_text: &str) -> Result<[u8; 32]> {
    let v = hex::decode(hex_text.trim())
        .map_err(|e| IdentityError(format!("{what}: not a hex string: {e}")))?;
    v.try_into()
        .map_err(|v: Vec<u8>| IdentityError(format!("{what}: {} bytes, expected 32", v.len())))
}

impl Identity {
    /// The identity of node `own` from its configuration: `None` without
    /// `identity_key`. Every node-map entry (`nodes`: id and hex public
    /// key) then needs a public key, and the own entry's must match the
    /// private key; any problem is an error naming the field.
    pub fn from_config(
        own: u16,
        identity_key: Option<&str>,
        nodes: &[(u16, Option<&str>)],
    ) -> Result<Option<Self>> {
        let Some(secret) = identity_key else {
            if let Some((id, _)) = nodes.iter().find(|(_, pk)| pk.is_some()) {
                return Err(IdentityError(format!(
                    "nodes: node {id} has a public_key but identity_key is not set"
                )));
            }
            return Ok(None);
        };
        let signing = SigningKey::from_bytes(&key_bytes("identity_key", secret)?);
        let mut peers = HashMap::new();
        for &(id, pk) in nodes {
            let what = format!("nodes: node {id} public_key");
            let Some(pk) = pk else {
                return Err(IdentityError(format!(
                    "{what} missing (identity_key is set, so every node needs one)"
                )));
            };
            let key = VerifyingKey::from_bytes(&key_bytes(&what, pk)?)
                .map_err(|e| IdentityError(format!("{what}: {e}")))?;
            if id == own && key != signing.verifying_key() {
                return Err(IdentityError(format!(
                    "{what} does not belong to identity_key"
                )));
            }
            peers.insert(id, key);
        }
        Ok(Some(Self {
            signing,
            peers: std::sync::RwLock::new(peers),
        }))
    }

    /// An identity from raw keys: this node's 32-byte private key seed and
    /// the public keys of the nodes it talks to.
    pub fn from_keys(own: [u8; 32], peers: &[(u16, [u8; 32])]) -> Result<Self> {
        let mut map = HashMap::new();
        for (id, pk) in peers {
            let key = VerifyingKey::from_bytes(pk)
                .map_err(|e| IdentityError(format!("public key of node {id}: {e}")))?;
            map.insert(*id, key);
        }
        Ok(Self {
            signing: SigningKey::from_bytes(&own),
            peers: std::sync::RwLock::new(map),
        })
    }

    fn peers(&self) -> std::sync::RwLockReadGuard<'_, HashMap<u16, VerifyingKey>> {
        self.peers
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds (or replaces) node `id`'s public key, given as hex.
    pub fn add_peer(&self, id: u16, public_key_hex: &str) -> Result<()> {
        let pk = key_bytes(&format!("public key of node {id}"), public_key_hex)?;
        let key = VerifyingKey::from_bytes(&pk)
            .map_err(|e| IdentityError(format!("public key of node {id}: {e}")))?;
        self.peers
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id, key);
        Ok(())
    }

    /// Forgets node `id`'s public key: its signatures no longer verify.
    pub fn remove_peer(&self, id: u16) {
        self.peers
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&id);
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
        self.peers()
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

    /// Node `me` of a node map whose node `i` has key pair `keys[i]`.
    struct Cfg {
        me: u16,
        key: Option<String>,
        nodes: Vec<(u16, Option<String>)>,
    }

    impl Cfg {
        fn new(me: u16, keys: &[(String, String)]) -> Self {
            Cfg {
                me,
                key: Some(keys[me as usize].0.clone()),
                nodes: keys
                    .iter()
                    .enumerate()
                    .map(|(i, (_, pk))| (i as u16, Some(pk.clone())))
                    .collect(),
            }
        }

        fn identity(&self) -> Result<Option<Identity>> {
            let nodes: Vec<_> = self
                .nodes
                .iter()
                .map(|(id, pk)| (*id, pk.as_deref()))
                .collect();
            Identity::from_config(self.me, self.key.as_deref(), &nodes)
        }
    }

    #[test]
    fn signatures_bind_node_ids() {
        let keys: Vec<_> = (0..3).map(|_| generate_keypair()).collect();
        let a = Cfg::new(0, &keys).identity().unwrap().unwrap();
        let b = Cfg::new(1, &keys).identity().unwrap().unwrap();
        let sig = b.sign(b"transcript");
        assert!(a.verify(1, b"transcript", &sig));
        assert!(!a.verify(2, b"transcript", &sig), "node 1 cannot pass as 2");
        assert!(!a.verify(1, b"transcripT", &sig));
        assert!(!a.verify(9, b"transcript", &sig), "unknown node");
    }

    #[test]
    fn config_errors_name_the_field() {
        let keys: Vec<_> = (0..2).map(|_| generate_keypair()).collect();
        let mut c = Cfg::new(0, &keys);
        c.nodes[1].1 = None;
        let e = c.identity().unwrap_err().to_string();
        assert!(e.contains("node 1 public_key missing"), "{e}");
        let mut c = Cfg::new(0, &keys);
        c.key = Some(keys[1].0.clone());
        let e = c.identity().unwrap_err().to_string();
        assert!(e.contains("does not belong to identity_key"), "{e}");
        let mut c = Cfg::new(0, &keys);
        c.key = Some("abc".into());
        assert!(c.identity().is_err());
        let mut c = Cfg::new(0, &keys);
        c.key = None;
        let e = c.identity().unwrap_err().to_string();
        assert!(e.contains("identity_key is not set"), "{e}");
        for n in &mut c.nodes {
            n.1 = None;
        }
        assert!(c.identity().unwrap().is_none());
    }
}
