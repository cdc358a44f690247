//! The node map at run time: the configured entries, plus the nodes added
//! and minus the nodes removed since start ([`crate::Node::add_node`],
//! [`crate::Node::remove_node`]). Engines look addresses up here, not in
//! the configuration. With discovery ([`crate::config::DiscoveryConfig`])
//! a node is dialed only once it is discovered (`core/discovery.rs`).

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
    /// It answered discovery (or connected) since it was last lost; always
    /// true without discovery. Only discovered nodes are dialed.
    discovered: bool,
    /// When discovery last heard of it: a claim of its id from another
    /// address is a conflict while this is recent.
    last_seen: Option<Instant>,
}

impl Member {
    fn new(address: String, discovered: bool) -> Self {
        Member {
            address,
            removed: false,
            discovered,
            last_seen: None,
        }
    }
}

/// What [`Membership::learn`] made of a node's claim to be at an address.
#[derive(Debug, PartialEq, Eq)]
pub enum Learned {
    /// Recorded; `newly`: it was not discovered before; `moved`: it had
    /// another address.
    Recorded {
        /// Not discovered before.
        newly: bool,
        /// Its address changed.
        moved: bool,
    },
    /// Removed at run time: ignored.
    Removed,
    /// Another node holds the id at this address and is alive.
    Conflict(String),
}

/// The node map (read on connection set-up, written by
/// `add_node`/`remove_node`).
#[derive(Debug, Default)]
pub struct Membership {
    map: RwLock<HashMap<u16, Member>>,
    /// Discovery is on: entries start undiscovered.
    discovery: bool,
    /// Rung when a node is discovered (`Node::wait_for_nodes`).
    pub discovered: Signal,
}

impl Membership {
    /// Whether discovery is on (nodes learn of each other at run time).
    pub fn discovery(&self) -> bool {
        self.discovery
    }

    /// The configured node map.
    pub fn from_config(config: &Config) -> Self {
        let discovery = config.discovery.is_some();
        let map = config
            .nodes
            .iter()
            .map(|n| {
                let discovered = !discovery || n.id == config.node_id;
                (n.id, Member::new(n.address.clone(), discovered))
            })
            .collect();
        Membership {
            map: RwLock::new(map),
            discovery,
            discovered: Signal::new(),
        }
    }

    /// Whether `node` may be dialed: listed, not removed and discovered.
    pub fn dialable(&self, node: NodeId) -> std::result::Result<(), Unreachable> {
        match self.map.read().get(&node.0) {
            Some(m) if m.removed => Err(Unreachable::Removed),
            Some(m) if !m.discovered => Err(Unreachable::Undiscovered),
            Some(_) => Ok(()),
            None => Err(Unreachable::NotInNodeMap),
        }
    }

    /// `node` connected (authenticated): it is alive, so discovered.
    pub fn connected(&self, node: NodeId) -> bool {
        if !self.discovery {
            return false;
        }
        let mut map = self.map.write();
        match map.get_mut(&node.0) {
            Some(m) if !m.removed && !m.discovered => {
                m.discovered = true;
                m.last_seen = Some(Instant::now());
                drop(map);
                self.discovered.notify_all();
                true
            }
            _ => false,
        }
    }

    /// `node`'s connection was lost (or could not be set up): it goes
    /// back to the nodes discovery probes. No-op without discovery.
    pub fn lost(&self, node: NodeId) {
        if !self.discovery {
            return;
        }
        if let Some(m) = self.map.write().get_mut(&node.0) {
            m.discovered = false;
        }
    }

    /// Records that `node` (authenticated) says it is at `address`:
    /// discovered there, unless it was removed or another node holds the
    /// id at another address and was heard of within `fresh` (or
    /// `holder_connected` says it has a live connection).
    pub fn learn(
        &self,
        node: u16,
        address: &str,
        fresh: Duration,
        holder_connected: impl FnOnce() -> bool,
    ) -> Learned {
        let now = Instant::now();
        let mut map = self.map.write();
        let learned = match map.get_mut(&node) {
            Some(m) if m.removed => return Learned::Removed,
            Some(m) => {
                // An entry listed without an address (or known only from
                // its connection) learns it here: not a move.
                let moved = !m.address.is_empty() && m.address != address;
                let holder_alive = m.discovered
                    && (m.last_seen.is_some_and(|t| now.duration_since(t) < fresh)
                        || holder_connected());
                if moved && holder_alive {
                    return Learned::Conflict(m.address.clone());
                }
                let newly = !m.discovered;
                m.address = address.to_string();
                m.discovered = true;
                m.last_seen = Some(now);
                Learned::Recorded { newly, moved }
            }
            None => {
                let mut m = Member::new(address.to_string(), true);
                m.last_seen = Some(now);
                map.insert(node, m);
                Learned::Recorded {
                    newly: true,
                    moved: false,
                }
            }
        };
        drop(map);
        if let Learned::Recorded { newly: true, .. } = learned {
            self.discovered.notify_all();
        }
        learned
    }

    /// What the discovery job probes this round: (id, address) of the
    /// listed nodes, other than `own`, that are not removed and either
    /// undiscovered or without a live connection.
    pub fn to_probe(&self, own: u16, connected: impl Fn(u16) -> bool) -> Vec<(u16, String)> {
        self.map
            .read()
            .iter()
            .filter(|(id, m)| {
                **id != own
                    && !m.removed
                    && !m.address.is_empty()
                    && (!m.discovered || !connected(**id))
            })
            .map(|(id, m)| (*id, m.address.clone()))
            .collect()
    }

    /// The addresses of the discovered nodes other than `except`.
    pub fn discovered_addresses(&self, except: &[u16]) -> Vec<String> {
        self.map
            .read()
            .iter()
            .filter(|(id, m)| {
                m.discovered && !m.removed && !m.address.is_empty() && !except.contains(id)
            })
            .map(|(_, m)| m.address.clone())
            .collect()
    }

    /// Whether a node of the map (removed or not) has `address`: it is
    /// probed as such, or deliberately not.
    pub fn lists(&self, address: &str) -> bool {
        self.map.read().values().any(|m| m.address == address)
    }

    /// Whether `node` is discovered now.
    pub fn is_discovered(&self, node: u16) -> bool {
        self.map
            .read()
            .get(&node)
            .is_some_and(|m| m.discovered && !m.removed)
    }

    /// `node`'s address, or why there is none.
    pub fn address_of(&self, node: NodeId) -> std::result::Result<String, Unreachable> {
        match self.map.read().get(&node.0) {
            Some(m) if m.removed => Err(Unreachable::Removed),
            Some(m) => Ok(m.address.clone()),
            None => Err(Unreachable::NotInNodeMap),
        }
    }

    /// The nodes of the map (not removed, discovered), in id order.
    pub fn nodes(&self) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self
            .map
            .read()
            .iter()
            .filter(|(_, m)| !m.removed && m.discovered)
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

    /// The nodes of the node map now (discovered ones only, with
    /// discovery), this one included.
    pub fn member_nodes(&self) -> Vec<NodeId> {
        self.membership.nodes()
    }

    /// Waits until the node map holds at least `count` nodes (this one
    /// included; with discovery, discovered ones) or `timeout` passes.
    pub fn wait_for_nodes(&self, count: usize, timeout: Duration) -> Result<Vec<NodeId>> {
        let deadline = Instant::now() + timeout;
        loop {
            let nodes = self.membership.nodes();
            if nodes.len() >= count {
                return Ok(nodes);
            }
            if self.is_shut_down() {
                return Err(Error::Shutdown);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout(Waited::Nodes));
            }
            self.membership.discovered.park_unless(
                || self.membership.nodes().len() >= count,
                (deadline - now).min(Duration::from_millis(50)),
            );
        }
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
            // With discovery an added node is probed first, unless it
            // already answered at this address.
            let discovered = !self.membership.discovery
                || map
                    .get(&entry.id)
                    .is_some_and(|o| !o.removed && o.discovered && o.address == entry.address);
            let old = map.insert(entry.id, Member::new(entry.address.clone(), discovered));
            old.is_some_and(|o| !o.removed && o.address != entry.address)
        };
        if changed {
            self.node_moved(NodeId(entry.id));
        }
        tracing::info!(
            "{}: node {} added at {:?}",
            self.own,
            entry.id,
            entry.address
        );
        Ok(())
    }

    /// `node` has a new address: a connection to the old one belongs to
    /// what the node was, and closes.
    pub(super) fn node_moved(&self, node: NodeId) {
        if let Some(c) = self.connections.get(node) {
            self.close_connection(&c, "node moved to another address", false);
        }
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
