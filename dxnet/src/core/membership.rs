//! The node map at run time: the configured entries, plus the nodes added
//! and minus the nodes removed since start ([`crate::Node::add_node`],
//! [`crate::Node::remove_node`]). Engines look addresses up here, not in
//! the configuration.

use std::collections::HashMap;

use parking_lot::RwLock;

use super::*;
use crate::config::NodeEntry;

/// One node of the map.
#[derive(Debug, Clone)]
struct Member {
    address: String,
    /// Removed at run time: connections to and from it are refused with
    /// [`Unreachable::Removed`] until it is added again.
    removed: bool,
}

/// The node map (read on connection set-up, written by
/// `add_node`/`remove_node`).
#[derive(Debug, Default)]
pub struct Membership {
    map: RwLock<HashMap<u16, Member>>,
}

impl Membership {
    /// The configured node map.
    pub fn from_config(config: &Config) -> Self {
        let map = config
            .nodes
            .iter()
            .map(|n| {
                (
                    n.id,
                    Member {
                        address: n.address.clone(),
                        removed: false,
                    },
                )
            })
            .collect();
        Membership {
            map: RwLock::new(map),
        }
    }

    /// `node`'s address, or why there is none.
    pub fn address_of(&self, node: NodeId) -> std::result::Result<String, Unreachable> {
        match self.map.read().get(&node.0) {
            Some(m) if m.removed => Err(Unreachable::Removed),
            Some(m) => Ok(m.address.clone()),
            None => Err(Unreachable::NotInNodeMap),
        }
    }

    /// The nodes of the map (not removed), in id order.
    pub fn nodes(&self) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self
            .map
            .read()
            .iter()
            .filter(|(_, m)| !m.removed)
            .map(|(id, _)| NodeId(*id))
            .collect();
        v.sort();
        v
    }
}

impl Core {
    /// `node`'s address in the node map, or why it has none (not listed,
    /// removed).
    pub fn address_of(&self, node: NodeId) -> std::result::Result<String, Unreachable> {
        self.membership.address_of(node)
    }

    /// The nodes of the node map now, this one included.
    pub fn member_nodes(&self) -> Vec<NodeId> {
        self.membership.nodes()
    }

    /// Adds `entry` to the node map, or changes the address (and key) of
    /// a node already in it, or brings back a removed node.
    pub fn add_node(&self, entry: NodeEntry) -> Result<()> {
        if entry.id == self.own.0 {
            return Err(Error::Config(format!(
                "add_node: {} is this node's own id",
                entry.id
            )));
        }
        if self.config.transport != TransportKind::Loopback && entry.address.is_empty() {
            return Err(Error::Config(format!(
                "add_node: node {} has no address",
                entry.id
            )));
        }
        if let Some(identity) = &self.identity {
            let Some(key) = &entry.public_key else {
                return Err(Error::Config(format!(
                    "add_node: node {} needs a public_key (this node checks identities)",
                    entry.id
                )));
            };
            identity
                .add_peer(entry.id, key)
                .map_err(|e| Error::Config(format!("add_node: {e}")))?;
        }
        let changed = {
            let mut map = self.membership.map.write();
            let old = map.insert(
                entry.id,
                Member {
                    address: entry.address.clone(),
                    removed: false,
                },
            );
            old.is_some_and(|o| !o.removed && o.address != entry.address)
        };
        // A connection to the old address belongs to what the node was.
        if changed {
            if let Some(c) = self.connections.get(NodeId(entry.id)) {
                self.close_connection(&c, "node moved to another address", false);
            }
        }
        tracing::info!(
            "{}: node {} added at {:?}",
            self.own,
            entry.id,
            entry.address
        );
        Ok(())
    }

    /// Removes `node` from the node map: its connection closes, its
    /// pending requests fail and later sends and connections from it are
    /// refused, all with [`Unreachable::Removed`].
    pub fn remove_node(&self, node: NodeId) -> Result<()> {
        if node == self.own {
            return Err(Error::Config("remove_node: this node's own id".into()));
        }
        {
            let mut map = self.membership.map.write();
            match map.get_mut(&node.0) {
                Some(m) if !m.removed => m.removed = true,
                _ => return Err(Error::Unreachable(node, Unreachable::NotInNodeMap)),
            }
        }
        if let Some(identity) = &self.identity {
            identity.remove_peer(node.0);
        }
        if let Some(c) = self.connections.get(node) {
            self.close_connection_with(&c, "node removed", Some(Unreachable::Removed));
        }
        // Requests registered but not sent when the connection went.
        self.requests
            .fail_peer(node, &Error::Unreachable(node, Unreachable::Removed));
        tracing::info!("{}: node {node} removed", self.own);
        Ok(())
    }
}
