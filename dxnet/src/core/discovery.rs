//! The discovery job (Ibdxnet's connection manager): probes the addresses
//! of nodes not discovered yet over UDP, answers other nodes' probes, and
//! records who is where in the node map (`membership.rs`). The datagram is
//! `proto::discovery`; authentication is the handshake's (cluster secret,
//! identities).
//!
//! Who probes what, every `interval_ms`: the node map's entries that are
//! not discovered, or discovered but without a connection (their answer
//! keeps their claim to the id fresh), and the seeds whose node is not
//! known yet. A node that accepts a probe records the prober (so one probe
//! introduces both ways) and answers; an answer counts only if it echoes
//! the nonce of a probe this node sent in the last rounds. A claim of an id
//! from another address while the holder is alive (connected, or heard of
//! within three intervals) is a conflict: nothing changes, and both
//! claimants are told ([`Kind::Conflict`]), each reporting
//! [`ConnectionEvent::DuplicateId`].
//!
//! Sockets: the TCP engine has none of its own, so the job binds a UDP
//! socket on the node's address and receives on it; the InfiniBand engine
//! lends its handshake socket ([`Transport::discovery_socket`]) and hands
//! the datagrams with the discovery magic to [`Core::on_discovery_datagram`].

use std::collections::{HashMap, HashSet};
use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};

use crate::events::ConnectionEvent;
use crate::proto::discovery::{Announcement, Kind, DISCOVERY_MAX, MAX_ADDRESS_LEN};

use super::membership::Learned;
use super::*;

/// Rounds a probe's nonce stays valid for its answer.
const NONCE_ROUNDS: u32 = 3;
/// Rounds a seed learned from another node's list is probed without an
/// answer before it is dropped.
const GOSSIP_SEED_ROUNDS: u32 = 50;
/// Most seeds kept (configured ones included): a member's lists cannot
/// grow them without bound.
const SEEDS_MAX: usize = 1024;
/// Most addresses sent in one answer's member list.
const MEMBERS_SENT: usize = 1024;
/// Addresses of one host name probed.
const ADDRESSES_PER_NAME: usize = 4;
/// Conflicts remembered as reported.
const REPORTED_MAX: usize = 1024;
/// Longest a receive waits, so shutdown is seen promptly.
const POLL: Duration = Duration::from_millis(50);

/// A probe sent in the last rounds.
#[derive(Debug)]
struct Outstanding {
    /// The seed probed (its node is recorded from the answer).
    seed: Option<String>,
    sent: Instant,
}

/// An address probed until a node answers there.
#[derive(Debug)]
struct Seed {
    address: String,
    /// The node that answered: not probed while it is discovered.
    node: Option<u16>,
    /// Learned from another node's list: dropped if nobody answered by
    /// then (configured and added seeds stay).
    expires: Option<Instant>,
}

#[derive(Debug, Default)]
struct ProbeState {
    outstanding: HashMap<[u8; 16], Outstanding>,
    /// The configured seeds, those added at run time and those learned
    /// from other nodes' lists.
    seeds: Vec<Seed>,
    /// (id, other claimant's address) already reported.
    reported: HashSet<(u16, String)>,
}

/// The discovery job's state (present with `Config::discovery`).
#[derive(Debug)]
pub struct Discovery {
    interval: Duration,
    /// The address this node announces.
    advertise: String,
    state: Mutex<ProbeState>,
    /// Datagrams not accepted: malformed, unauthenticated, unsolicited
    /// answers, probes from removed nodes.
    pub ignored: AtomicU64,
    /// Conflicting claims of one id seen.
    pub conflicts: AtomicU64,
}

impl Discovery {
    /// The job's state for `config` (validated: the advertised address
    /// exists).
    pub fn new(config: &Config) -> Option<Self> {
        let d = config.discovery.as_ref()?;
        let advertise = d
            .advertise
            .clone()
            .or_else(|| config.address_of(NodeId(config.node_id)).map(str::to_owned))
            .unwrap_or_default();
        Some(Discovery {
            interval: Duration::from_millis(d.interval_ms),
            advertise,
            state: Mutex::new(ProbeState {
                seeds: d
                    .seeds
                    .iter()
                    .map(|a| Seed {
                        address: a.clone(),
                        node: None,
                        expires: None,
                    })
                    .collect(),
                ..ProbeState::default()
            }),
            ignored: AtomicU64::new(0),
            conflicts: AtomicU64::new(0),
        })
    }
}

/// `address` as a socket address; host names are looked up only on the
/// discovery thread (`lookup`): on the datagram path, which on InfiniBand
/// is the engine's connection thread, a slow lookup would hold up
/// handshakes, so there only literal addresses are used.
/// A host name's first [`ADDRESSES_PER_NAME`] addresses are all probed
/// (IPv4 and IPv6 alike).
fn resolve(address: &str, lookup: bool) -> Vec<SocketAddr> {
    if let Ok(a) = address.parse() {
        return vec![a];
    }
    if !lookup {
        return Vec::new();
    }
    match address.to_socket_addrs() {
        Ok(it) => it.take(ADDRESSES_PER_NAME).collect(),
        Err(e) => {
            tracing::debug!("discovery: cannot resolve {address:?}: {e}");
            Vec::new()
        }
    }
}

impl Core {
    fn discovery(&self) -> Option<&Discovery> {
        self.discovery.as_deref()
    }

    /// Adds `address` to the seeds probed until a node answers there (no
    /// change if it is one already).
    pub fn add_seed(&self, address: &str) -> Result<()> {
        let Some(d) = self.discovery() else {
            return Err(Error::Config(
                "add_seed: discovery is not configured (Config::discovery)".into(),
            ));
        };
        if address.is_empty() {
            return Err(Error::Config("add_seed: empty address".into()));
        }
        let mut st = d.state.lock();
        match st.seeds.iter_mut().find(|s| s.address == address) {
            Some(s) => s.expires = None,
            None => st.seeds.push(Seed {
                address: address.to_string(),
                node: None,
                expires: None,
            }),
        }
        Ok(())
    }

    /// Starts the discovery thread (with discovery configured), after the
    /// engine: on InfiniBand it uses the engine's socket.
    pub(super) fn start_discovery(self: &Arc<Self>) -> Result<()> {
        if self.discovery.is_none() {
            return Ok(());
        }
        let lent = self.transport().and_then(|t| t.discovery_socket());
        let (socket, receives) = match lent {
            Some(s) => (s, false),
            None => {
                let own = self
                    .address_of(self.own)
                    .map_err(|e| Error::Config(format!("discovery: own address: {e}")))?;
                let s = UdpSocket::bind(&own).map_err(|e| {
                    Error::Transport(format!("discovery: cannot bind udp {own}: {e}"))
                })?;
                (s, true)
            }
        };
        let core = self.clone();
        let handle = std::thread::Builder::new()
            .name(format!("dxnet-discovery-{}", self.own.0))
            .spawn(move || core.discovery_loop(socket, receives))
            .map_err(|e| Error::Config(format!("cannot spawn the discovery thread: {e}")))?;
        self.threads.lock().push(handle);
        Ok(())
    }

    fn discovery_loop(&self, socket: UdpSocket, receives: bool) {
        let Some(d) = self.discovery() else { return };
        let mut buf = vec![0u8; DISCOVERY_MAX + 1];
        let mut next_round = Instant::now();
        while !self.is_shut_down() {
            let now = Instant::now();
            if now >= next_round {
                self.probe_round(d, &socket);
                next_round = now + d.interval;
            }
            let wait = next_round
                .saturating_duration_since(Instant::now())
                .clamp(Duration::from_millis(1), POLL);
            if !receives {
                std::thread::sleep(wait);
                continue;
            }
            let _ = socket.set_read_timeout(Some(wait));
            match socket.recv_from(&mut buf) {
                Ok((n, from)) => self.on_discovery_datagram(&buf[..n], from, &socket),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                // An ICMP "port unreachable" of an earlier probe (Linux
                // reports it on the next receive).
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
                Err(e) => {
                    tracing::warn!("{}: discovery socket: {e}", self.own);
                    std::thread::sleep(POLL);
                }
            }
        }
    }

    /// Probes every address that needs it now.
    fn probe_round(&self, d: &Discovery, socket: &UdpSocket) {
        let connected = |id: u16| {
            self.connections
                .get(NodeId(id))
                .is_some_and(|c| c.state() == ConnState::Open)
        };
        let mut targets: Vec<(bool, String)> = self
            .membership
            .to_probe(self.own.0, connected)
            .into_iter()
            .map(|(_, a)| (false, a))
            .collect();
        {
            let mut st = d.state.lock();
            let expiry = d.interval * NONCE_ROUNDS;
            st.outstanding.retain(|_, o| o.sent.elapsed() < expiry);
            let now = Instant::now();
            st.seeds
                .retain(|s| s.node.is_some() || !matches!(s.expires, Some(t) if t <= now));
            for seed in &st.seeds {
                let known = seed.node.is_some_and(|n| {
                    // Its node is probed as a node-map entry, or removed.
                    n == self.own.0 || self.membership.is_discovered(n) || {
                        matches!(
                            self.membership.dialable(NodeId(n)),
                            Err(Unreachable::Removed)
                        )
                    }
                });
                if !known {
                    targets.push((true, seed.address.clone()));
                }
            }
        }
        for (is_seed, address) in targets {
            self.probe(d, socket, is_seed, &address, true);
        }
    }

    /// Probes `address` (a seed's, if `is_seed`) with a fresh nonce
    /// (`lookup`: host names are looked up, see [`resolve`]).
    fn probe(&self, d: &Discovery, socket: &UdpSocket, is_seed: bool, address: &str, lookup: bool) {
        let to = resolve(address, lookup);
        if to.is_empty() {
            return;
        }
        let nonce: [u8; 16] = rand::random();
        let probe = self.announcement(Kind::Probe, self.own.0, nonce, &d.advertise);
        d.state.lock().outstanding.insert(
            nonce,
            Outstanding {
                seed: is_seed.then(|| address.to_string()),
                sent: Instant::now(),
            },
        );
        for to in to {
            self.send_announcement(socket, &probe, to);
        }
    }

    /// A datagram from this node about `subject`.
    fn announcement(
        &self,
        kind: Kind,
        subject: u16,
        nonce: [u8; 16],
        address: &str,
    ) -> Announcement {
        Announcement {
            kind,
            sender: self.own.0,
            subject,
            instance: self.instance,
            nonce,
            address: address.to_string(),
        }
    }

    fn send_announcement(&self, socket: &UdpSocket, a: &Announcement, to: SocketAddr) {
        let secret = self.config.cluster_secret.as_deref().map(str::as_bytes);
        let bytes = a.encode(secret, self.identity.as_ref());
        if let Err(e) = socket.send_to(&bytes, to) {
            tracing::debug!("{}: discovery datagram to {to}: {e}", self.own);
        }
    }

    /// Handles a datagram with the discovery magic that arrived at this
    /// node's socket from `from`; replies go out on `socket`.
    pub fn on_discovery_datagram(&self, datagram: &[u8], from: SocketAddr, socket: &UdpSocket) {
        let Some(d) = self.discovery() else {
            return; // discovery is off here: not our business
        };
        if self.is_shut_down() {
            // A stopping node must not be discovered again after its
            // connections closed.
            return;
        }
        let secret = self.config.cluster_secret.as_deref().map(str::as_bytes);
        let a = match Announcement::decode(datagram, secret, self.identity.as_ref()) {
            Ok(a) => a,
            Err(e) => {
                // Counted; logged at debug only, so a flood cannot flood
                // the log.
                d.ignored.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("{}: discovery datagram from {from} ignored: {e}", self.own);
                return;
            }
        };
        match a.kind {
            Kind::Probe => self.on_probe(d, &a, from, socket),
            Kind::Answer => {
                // The nonce stays valid for its rounds: the probed node's
                // list may come after its answer.
                let seed = match d.state.lock().outstanding.get(&a.nonce) {
                    Some(o) => o.seed.clone(),
                    None => {
                        d.ignored.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                };
                if a.sender == self.own.0 {
                    self.report_duplicate(d, a.sender, &a.address);
                    return;
                }
                if let Some(seed) = seed {
                    let mut st = d.state.lock();
                    if let Some(s) = st.seeds.iter_mut().find(|s| s.address == seed) {
                        s.node = Some(a.sender);
                    }
                }
                self.learn(d, &a, socket);
            }
            Kind::Members => {
                if !d.state.lock().outstanding.contains_key(&a.nonce) {
                    d.ignored.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                // Probed at once: joining takes one exchange, not an
                // interval more.
                for address in self.learn_seeds(d, &a) {
                    self.probe(d, socket, true, &address, false);
                }
            }
            Kind::Conflict => {
                if a.subject == self.own.0 {
                    self.report_duplicate(d, a.subject, &a.address);
                } else {
                    d.ignored.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    fn on_probe(&self, d: &Discovery, a: &Announcement, from: SocketAddr, socket: &UdpSocket) {
        if a.sender == self.own.0 {
            if a.instance == self.instance {
                return; // this node's own probe (a seed names this node)
            }
            // Another node with this node's id: both learn of it.
            self.report_duplicate(d, a.sender, &a.address);
            let conflict = self.announcement(Kind::Conflict, self.own.0, a.nonce, &d.advertise);
            self.send_announcement(socket, &conflict, from);
            return;
        }
        if let Some(newly) = self.learn(d, a, socket) {
            let answer = self.announcement(Kind::Answer, self.own.0, a.nonce, &d.advertise);
            self.send_announcement(socket, &answer, from);
            if newly {
                // A node new to this one learns where the others are.
                self.send_members(a, from, socket);
            }
        }
    }

    /// Sends `to` (node `a.sender`, just discovered) the addresses of the
    /// other discovered nodes, in datagrams of up to
    /// [`MAX_ADDRESS_LEN`] bytes of list: hints it probes like seeds.
    fn send_members(&self, a: &Announcement, to: SocketAddr, socket: &UdpSocket) {
        let list = self
            .membership
            .discovered_addresses(&[self.own.0, a.sender]);
        let mut chunk = String::new();
        for address in list.into_iter().take(MEMBERS_SENT) {
            if chunk.len() + 1 + address.len() > MAX_ADDRESS_LEN && !chunk.is_empty() {
                let m = self.announcement(Kind::Members, self.own.0, a.nonce, &chunk);
                self.send_announcement(socket, &m, to);
                chunk.clear();
            }
            if address.len() > MAX_ADDRESS_LEN {
                continue;
            }
            if !chunk.is_empty() {
                chunk.push(',');
            }
            chunk.push_str(&address);
        }
        if !chunk.is_empty() {
            let m = self.announcement(Kind::Members, self.own.0, a.nonce, &chunk);
            self.send_announcement(socket, &m, to);
        }
    }

    /// Adds the addresses of a member list (answering a probe of this
    /// node) as seeds that expire unless a node answers there; returns the
    /// new ones.
    fn learn_seeds(&self, d: &Discovery, a: &Announcement) -> Vec<String> {
        let expires = Instant::now() + d.interval * GOSSIP_SEED_ROUNDS;
        let mut added = Vec::new();
        let mut st = d.state.lock();
        for address in a.address.split(',') {
            if address.is_empty() || address == d.advertise || self.membership.lists(address) {
                continue;
            }
            if st.seeds.len() >= SEEDS_MAX {
                break;
            }
            if !st.seeds.iter().any(|s| s.address == address) {
                st.seeds.push(Seed {
                    address: address.to_string(),
                    node: None,
                    expires: Some(expires),
                });
                added.push(address.to_string());
            }
        }
        added
    }

    /// Records `a`'s sender at its address; on a conflict tells both
    /// claimants. Returns whether it was recorded, and if so whether it is
    /// new.
    fn learn(&self, d: &Discovery, a: &Announcement, socket: &UdpSocket) -> Option<bool> {
        let holder_connected = || {
            self.connections
                .get(NodeId(a.sender))
                .is_some_and(|c| c.state() == ConnState::Open)
        };
        let node = NodeId(a.sender);
        match self.membership.learn(
            a.sender,
            &a.address,
            d.interval * NONCE_ROUNDS,
            holder_connected,
        ) {
            Learned::Recorded { newly, moved } => {
                if moved {
                    self.node_moved(node);
                }
                if newly {
                    tracing::info!("{}: discovered node {node} at {:?}", self.own, a.address);
                    self.emit(ConnectionEvent::Discovered { node });
                }
                Some(newly)
            }
            Learned::Removed => {
                d.ignored.fetch_add(1, Ordering::Relaxed);
                None
            }
            Learned::Conflict(holder) => {
                self.report_duplicate(d, a.sender, &a.address);
                // The claimant learns where the id is held, the holder
                // where it is claimed.
                for (to, other) in [(a.address.as_str(), holder.as_str()), (&holder, &a.address)] {
                    for to in resolve(to, false) {
                        let conflict = self.announcement(Kind::Conflict, a.sender, a.nonce, other);
                        self.send_announcement(socket, &conflict, to);
                    }
                }
                None
            }
        }
    }

    /// Two nodes claim `id`, one of them at `address`: an error in the log
    /// and an event, once per (id, address).
    fn report_duplicate(&self, d: &Discovery, id: u16, address: &str) {
        d.conflicts.fetch_add(1, Ordering::Relaxed);
        {
            let mut st = d.state.lock();
            if st.reported.len() >= REPORTED_MAX {
                st.reported.clear(); // bounded; at worst reported again
            }
            if !st.reported.insert((id, address.to_string())) {
                return;
            }
        }
        if id == self.own.0 {
            tracing::error!(
                "{}: another node at {address:?} claims this node's id {id}: fix the node map",
                self.own
            );
        } else {
            tracing::error!(
                "{}: node id {id} is claimed by two nodes (one at {address:?}); keeping the one known first",
                self.own
            );
        }
        self.emit(ConnectionEvent::DuplicateId {
            node: NodeId(id),
            address: address.to_string(),
        });
    }
}
