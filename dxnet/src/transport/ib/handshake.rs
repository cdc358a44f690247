//! The connection thread: the connection handshake over UDP (it drives
//! `proto::handshake` in both roles, one flight of messages per datagram,
//! with retransmission), the jobs of the engine (dial, close) and close
//! notices; the queue-pair work is in `setup.rs`.
//!
//! ```text
//! dialer (conn Connecting)                         acceptor
//!   queue pair (INIT), Hello + endpoint   ──▶  Introduced: node map; queue pair (INIT)
//!        ◀── Reply + endpoint (proof) [+ signature]
//!   Verified: queue pair → RTR/RTS
//!   Proof [+ signature]                   ──▶  Authenticated: accept_incoming,
//!                                              queue pair → RTR/RTS, open
//!        ◀── Final(Accept)
//!   Established: open (or at the first data, if it overtakes the Final)
//! ```
//!
//! The dialer retransmits its last flight every [`REQUEST_RETRY`]; the
//! acceptor answers a repeated datagram with its last flight again (and
//! keeps a finished handshake [`ACCEPT_LINGER`] for that). Every datagram
//! names its handshake (the session id from the dialer's nonce), so one
//! from a sender off the path reaches none; a hello is taken only from the
//! claimed node's node-map address. A datagram is fed to a copy of its
//! handshake first: a late repeat the handshake cannot take is dropped
//! without touching it; any other failure (a wrong proof or signature, a
//! refusal) ends the handshake, and the dialer's connect fails with it (a
//! sender on the path that sees the session can end a handshake that way;
//! the next send tries again). Of two nodes dialing each other at once, the lower id's dial wins
//! (as on TCP): the lower id refuses the other's hello at once with
//! `Duplicate`, the higher id gives up its own dial when it accepts. A
//! dialer whose handshake the acceptor accepted but that gave up (its
//! connect timed out) tells the acceptor with a close notice; and an
//! authenticated new handshake of a node replaces an open connection to it
//! (a node dials only without one).

use super::setup::NewQp;
use super::*;
use crate::proto::handshake::{Credentials, Event, Handshake};
use crate::proto::wire::{
    CloseNotice, DatagramHeader, HandshakeError, HandshakeMsg, Hello, CLOSE_MAGIC, DATAGRAM_MAX,
    HANDSHAKE_LEN,
};

/// How long a finished handshake is kept to answer repeats of the dialer's
/// last flight (its copy of our final answer was lost).
const ACCEPT_LINGER: Duration = Duration::from_secs(2);

/// Handshakes a dialer may have going with us at once (older ones go).
const ACCEPTS_PER_DIALER: usize = 4;

/// This node's side of a handshake it started.
struct Dial<'a> {
    ic: Arc<IbConn>,
    hs: Handshake<'a>,
    session: [u8; 8],
    /// The last flight sent (retransmitted until answered).
    flight: Vec<u8>,
    /// The last datagram taken (a repeat of it is dropped).
    last_in: Vec<u8>,
}

/// This node's side of a handshake a peer started.
struct Accept<'a> {
    hs: Handshake<'a>,
    /// Created when the dialer was admitted; tied to the connection when
    /// it is accepted.
    qp: Option<NewQp>,
    flight: Vec<u8>,
    last_in: Vec<u8>,
    started: Instant,
    /// When the handshake ended (accepted, refused or failed).
    ended: Option<Instant>,
}

/// The connection thread's handshakes: ours by peer node id, the peers'
/// by dialer node id and session.
#[derive(Default)]
struct Handshakes<'a> {
    dials: HashMap<u16, Dial<'a>>,
    accepts: HashMap<(u16, [u8; 8]), Accept<'a>>,
}

/// Feeds one datagram's messages (whole messages only) to a copy of `hs`
/// and returns the copy with the events it produced, or the error. The
/// caller keeps the copy only if it wants the outcome.
fn try_feed<'a>(
    hs: &Handshake<'a>,
    msgs: &[u8],
) -> (
    Handshake<'a>,
    std::result::Result<Vec<Event>, HandshakeError>,
) {
    let mut trial = hs.clone();
    let mut events = Vec::new();
    let mut at = 0;
    while at < msgs.len() {
        match trial.read(&msgs[at..]) {
            Ok(p) => {
                at += p.consumed;
                events.extend(p.event);
                if p.consumed == 0 {
                    break;
                }
            }
            Err(e) => return (trial, Err(e)),
        }
    }
    (trial, Ok(events))
}

impl IbEngine {
    pub(super) fn send_datagram(&self, core: &Core, peer: u16, d: &[u8]) {
        let Some(addr) = core
            .address_of(NodeId(peer))
            .ok()
            .and_then(|a| resolve(&a).ok())
        else {
            return;
        };
        if let Err(e) = self.udp.send_to(d, addr) {
            tracing::debug!("{}: datagram to node {peer} failed: {e}", self.own);
        }
    }

    /// Sends what `hs` has queued as one datagram; keeps it in `flight`
    /// for retransmission.
    fn transmit(
        &self,
        core: &Core,
        peer: u16,
        header: DatagramHeader,
        hs: &mut Handshake<'_>,
        flight: &mut Vec<u8>,
    ) {
        let mut d = header.encode().to_vec();
        while let Some(m) = hs.poll_transmit() {
            d.extend_from_slice(&m);
        }
        if d.len() > wire::DATAGRAM_HEADER_LEN {
            self.send_datagram(core, peer, &d);
            *flight = d;
        }
    }

    // ----- connection thread ------------------------------------------------

    pub(super) fn connection_loop(self: Arc<Self>, jobs: Receiver<Job>) {
        let Some(core) = self.core.upgrade() else {
            return;
        };
        let creds = Credentials {
            secret: self.secret(),
            identity: core.identity.as_ref(),
        };
        let mut hss = Handshakes::default();
        let mut buf = [0u8; 2 * DATAGRAM_MAX];
        let mut lingering: VecDeque<(Instant, Arc<IbConn>)> = VecDeque::new();
        let mut last_retry = Instant::now();
        let connect_timeout = Duration::from_millis(core.config().limits.connect_timeout_ms);
        while !self.stop.load(Ordering::Acquire) {
            while let Ok(job) = jobs.try_recv() {
                match job {
                    Job::Create(conn) => self.dial(&core, creds, &mut hss, &conn),
                    Job::Close(ic) => {
                        if let Some(remote) = *ic.remote.lock() {
                            self.send_close_notice(&core, &ic, &remote);
                        }
                        lingering.push_back((Instant::now() + CLOSE_LINGER, ic));
                    }
                }
            }
            while lingering.front().is_some_and(|(t, _)| *t <= Instant::now()) {
                if let Some((_, ic)) = lingering.pop_front() {
                    self.release_quarantine(&ic);
                }
            }
            if last_retry.elapsed() >= REQUEST_RETRY {
                last_retry = Instant::now();
                let gone: Vec<u16> = hss
                    .dials
                    .iter()
                    .filter(|(_, d)| d.ic.conn.state() != ConnState::Connecting)
                    .map(|(p, _)| *p)
                    .collect();
                for p in gone {
                    let d = hss.dials.remove(&p).expect("listed");
                    self.abandon(&core, d.ic);
                }
                for (p, d) in &hss.dials {
                    self.send_datagram(&core, *p, &d.flight);
                }
                hss.accepts.retain(|_, a| match a.ended {
                    Some(t) => t.elapsed() < ACCEPT_LINGER,
                    None => a.started.elapsed() < connect_timeout,
                });
            }
            match self.udp.recv_from(&mut buf) {
                Ok((n, from)) => self.on_datagram(&core, creds, &mut hss, &buf[..n], from),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => {
                    tracing::warn!("{}: connection socket: {e}", self.own);
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    /// Starts this node's handshake for `conn` (unless one runs or the
    /// peer's got there first).
    fn dial<'a>(
        &self,
        core: &Core,
        creds: Credentials<'a>,
        hss: &mut Handshakes<'a>,
        conn: &Arc<Connection>,
    ) {
        let peer = conn.peer.0;
        if conn.state() != ConnState::Connecting || conn.engine::<IbConn>().is_some() {
            return;
        }
        if let Some(d) = hss.dials.get(&peer) {
            if d.ic.conn.id == conn.id {
                return; // already dialing
            }
            let old = hss.dials.remove(&peer).expect("present");
            self.abandon(core, old.ic);
        }
        let ic = self.create_qp().and_then(|q| self.bind_qp(conn, q));
        let ic = match ic {
            Ok(ic) => ic,
            Err(e) => {
                tracing::warn!(
                    "{}: cannot create a queue pair for {}: {e}",
                    self.own,
                    conn.peer
                );
                conn.close(&format!("queue pair creation failed: {e}"));
                return;
            }
        };
        let hello = core.hello(peer, ic.local.to_bytes());
        let mut d = Dial {
            hs: Handshake::dialer(creds, hello),
            session: DatagramHeader::session_of(&hello),
            ic,
            flight: Vec::new(),
            last_in: Vec::new(),
        };
        let header = DatagramHeader {
            dialer: self.own.0,
            acceptor: peer,
            to_acceptor: true,
            session: d.session,
        };
        self.transmit(core, peer, header, &mut d.hs, &mut d.flight);
        hss.dials.insert(peer, d);
    }

    fn on_datagram<'a>(
        &self,
        core: &Arc<Core>,
        creds: Credentials<'a>,
        hss: &mut Handshakes<'a>,
        d: &[u8],
        from: std::net::SocketAddr,
    ) {
        if d.starts_with(&crate::proto::discovery::DISCOVERY_MAGIC) {
            core.on_discovery_datagram(d, from, &self.udp);
            return;
        }
        if d.starts_with(&CLOSE_MAGIC) {
            match CloseNotice::decode(d, self.secret(), core.identity.as_ref()) {
                Ok(n) if n.dst == self.own.0 => self.on_close_notice(core, &mut hss.dials, &n),
                Ok(n) => tracing::info!(
                    "{}: close notice for node {} from {from} ignored",
                    self.own,
                    n.dst
                ),
                Err(e) => tracing::warn!("{}: bad close notice from {from}: {e}", self.own),
            }
            return;
        }
        let (h, msgs) = match DatagramHeader::decode(d) {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("{}: bad datagram from {from}: {e}", self.own);
                return;
            }
        };
        if let Some(prefix) = msgs.get(..wire::HANDSHAKE_PREFIX_LEN) {
            if let Err(e @ HandshakeError::Version { .. }) =
                HandshakeMsg::check_prefix(prefix.try_into().expect("prefix length"))
            {
                tracing::warn!("{}: handshake datagram from {from}: {e}", self.own);
                let ours = !h.to_acceptor && h.dialer == self.own.0;
                if let Some(dial) = hss
                    .dials
                    .get(&h.acceptor)
                    .filter(|d| ours && d.session == h.session)
                {
                    let conn = dial.ic.conn.clone();
                    core.close_connection(&conn, &format!("handshake failed: {e}"), true);
                }
                return;
            }
        }
        if msgs.is_empty() || msgs.len() % HANDSHAKE_LEN != 0 {
            tracing::warn!(
                "{}: handshake datagram of {} bytes from {from} ignored",
                self.own,
                d.len()
            );
            return;
        }
        if h.to_acceptor && h.acceptor == self.own.0 {
            self.on_accept_datagram(core, creds, hss, h, d, from);
        } else if !h.to_acceptor && h.dialer == self.own.0 {
            self.on_dial_datagram(core, hss, h, d, msgs);
        } else {
            tracing::info!(
                "{}: handshake datagram between {} and {} from {from} ignored",
                self.own,
                h.dialer,
                h.acceptor
            );
        }
    }

    /// An answer to our dial.
    fn on_dial_datagram(
        &self,
        core: &Core,
        hss: &mut Handshakes<'_>,
        h: DatagramHeader,
        d: &[u8],
        msgs: &[u8],
    ) {
        let peer = h.acceptor;
        let Some(dial) = hss.dials.get_mut(&peer) else {
            return; // over, or never ours
        };
        if dial.session != h.session || dial.last_in == d {
            return; // another handshake's, or a repeat
        }
        let (trial, fed) = try_feed(&dial.hs, msgs);
        let events = match fed {
            Ok(events) => events,
            Err(HandshakeError::Unexpected { .. }) => return, // a late repeat
            Err(e) => {
                let dial = hss.dials.remove(&peer).expect("present");
                let conn = dial.ic.conn.clone();
                self.abandon(core, dial.ic);
                if e == HandshakeError::Rejected(Status::Duplicate) {
                    // The peer's own dial to us wins; the connection stays
                    // connecting until that one is accepted.
                    tracing::debug!("{}: dial to node {peer} yields to the peer's", self.own);
                } else {
                    if e == HandshakeError::Rejected(Status::UnknownNode) {
                        conn.set_refused_as_unknown();
                    }
                    tracing::warn!("{}: handshake with node {peer} failed: {e}", self.own);
                    core.close_connection(&conn, &format!("handshake failed: {e}"), true);
                }
                return;
            }
        };
        dial.hs = trial;
        dial.last_in = d.to_vec();
        let mut finished = false;
        for ev in events {
            match ev {
                Event::Verified(theirs) => {
                    // Connected before our proof goes: the acceptor may
                    // send once it has it.
                    if let Err(e) = self.connect_qp(&dial.ic, &theirs.endpoint) {
                        let conn = dial.ic.conn.clone();
                        let dial = hss.dials.remove(&peer).expect("present");
                        self.abandon(core, dial.ic);
                        let why = format!("connection set-up failed: {e}");
                        core.close_connection(&conn, &why, true);
                        return;
                    }
                    self.verified.lock().insert(peer, (dial.ic.clone(), theirs));
                }
                Event::Established(_) => finished = true,
                ev => tracing::warn!("{}: dialer got {ev:?}", self.own),
            }
        }
        let (hs, flight) = (&mut dial.hs, &mut dial.flight);
        self.transmit(core, peer, h_to_acceptor(h), hs, flight);
        if finished {
            let dial = hss.dials.remove(&peer).expect("present");
            // Unless its first data opened it already.
            self.open_verified(core, &dial.ic);
        }
    }

    /// A datagram of a peer's dial to us.
    fn on_accept_datagram<'a>(
        &self,
        core: &Arc<Core>,
        creds: Credentials<'a>,
        hss: &mut Handshakes<'a>,
        h: DatagramHeader,
        d: &[u8],
        from: std::net::SocketAddr,
    ) {
        let msgs = &d[wire::DATAGRAM_HEADER_LEN..];
        let peer = h.dialer;
        let key = (peer, h.session);
        if let Some(a) = hss.accepts.get(&key) {
            if a.last_in == d {
                // The dialer did not get our answer: again.
                self.send_datagram(core, peer, &a.flight);
                return;
            }
        } else {
            let hello = HandshakeMsg::decode(msgs[..HANDSHAKE_LEN].try_into().unwrap());
            let opens = matches!(hello, Ok(HandshakeMsg::Hello(ref x))
                if x.node_id == peer && DatagramHeader::session_of(x) == h.session);
            // A node's connection socket is bound to its node-map address:
            // a hello from elsewhere is not that node's.
            let home = core
                .address_of(NodeId(peer))
                .ok()
                .and_then(|a| resolve(&a).ok());
            if !opens || peer == self.own.0 || home != Some(from) {
                tracing::info!(
                    "{}: handshake datagram of no handshake from {from} (as node {peer}) ignored",
                    self.own
                );
                return;
            }
            // A dialer has few handshakes going at once. Only finished ones
            // make room: one waiting for its proof is never pushed out by
            // a newer hello (it ends by `connect_timeout_ms` at the latest).
            let mine: Vec<_> = hss
                .accepts
                .iter()
                .filter(|(k, _)| k.0 == peer)
                .map(|(k, a)| (*k, a.ended))
                .collect();
            if mine.len() >= ACCEPTS_PER_DIALER {
                let Some(oldest) = mine
                    .iter()
                    .filter_map(|(k, ended)| ended.map(|t| (t, *k)))
                    .min()
                    .map(|(_, k)| k)
                else {
                    tracing::info!(
                        "{}: hello from node {peer} dropped: {ACCEPTS_PER_DIALER} of its handshakes are under way",
                        self.own
                    );
                    return;
                };
                hss.accepts.remove(&oldest);
            }
            // (The endpoint comes when the dialer is admitted.)
            let mine = core.hello(0, [0; wire::ENDPOINT_LEN]);
            hss.accepts.insert(
                key,
                Accept {
                    hs: Handshake::acceptor(creds, mine),
                    qp: None,
                    flight: Vec::new(),
                    last_in: Vec::new(),
                    started: Instant::now(),
                    ended: None,
                },
            );
        }
        let a = hss.accepts.get_mut(&key).expect("present");
        if a.ended.is_some() {
            return;
        }
        let (trial, fed) = try_feed(&a.hs, msgs);
        let events = match fed {
            Ok(events) => events,
            Err(HandshakeError::Unexpected { .. }) => return, // a late repeat
            Err(e) => {
                tracing::warn!("{}: handshake from node {peer} failed: {e}", self.own);
                a.ended = Some(Instant::now());
                Vec::new()
            }
        };
        a.hs = trial;
        a.last_in = d.to_vec();
        let mut accepted = false;
        for ev in events {
            match ev {
                Event::Introduced(theirs) => self.on_introduced(core, a, &theirs),
                Event::Authenticated(theirs) => {
                    accepted = self.on_authenticated(core, &mut hss.dials, peer, a, &theirs);
                    a.ended = Some(Instant::now());
                }
                ev => {
                    tracing::warn!("{}: acceptor got {ev:?}", self.own);
                    a.ended = Some(Instant::now());
                }
            }
        }
        let header = DatagramHeader {
            to_acceptor: false,
            ..h
        };
        let (hs, flight) = (&mut a.hs, &mut a.flight);
        self.transmit(core, peer, header, hs, flight);
        if accepted {
            // The dialer's older handshakes are over: a late proof of one
            // must not replace this connection.
            hss.accepts.retain(|k, _| k.0 != peer || *k == key);
        }
    }

    /// Admits or refuses a dialer that introduced itself.
    fn on_introduced(&self, core: &Core, a: &mut Accept<'_>, theirs: &Hello) {
        let p = NodeId(theirs.node_id);
        // Both dial: the lower id's dial wins (no state is touched yet, so
        // this needs no authentication).
        let dialing = core
            .connections
            .get(p)
            .is_some_and(|c| c.state() == ConnState::Connecting);
        if dialing && self.own < p {
            a.hs.reject(Status::Duplicate);
            a.ended = Some(Instant::now());
            return;
        }
        match self.create_qp() {
            Ok(q) => {
                a.hs.admit_at(q.local.to_bytes());
                a.qp = Some(q);
            }
            Err(e) => {
                tracing::warn!("{}: cannot create a queue pair for {p}: {e}", self.own);
                a.hs.reject(Status::ShuttingDown);
                a.ended = Some(Instant::now());
            }
        }
    }

    /// The dialer proved its id: accept the connection (or refuse it).
    /// True if accepted.
    fn on_authenticated(
        &self,
        core: &Arc<Core>,
        dials: &mut HashMap<u16, Dial<'_>>,
        peer: u16,
        a: &mut Accept<'_>,
        theirs: &Hello,
    ) -> bool {
        let p = NodeId(peer);
        // A node dials only when it has no connection to us: an open one
        // of the same process is stale (its dial gave up after we had
        // accepted it, or it closed and its notice was lost).
        if let Some(old) = core.connections.get(p) {
            if old.state() == ConnState::Open && old.peer_instance() == theirs.instance {
                core.close_connection(&old, "the peer dialed again: it lost this connection", true);
            }
        }
        let conn = match core.accept_incoming(p, theirs.instance) {
            Ok(c) => c,
            Err(st) => {
                tracing::info!("{}: connection from {p} refused: {st}", self.own);
                a.hs.reject(st);
                return false;
            }
        };
        // Our own dial to the peer, if any, yields: its connection is the
        // one accepted now, and the ring's consumer goes to this half.
        if let Some(d) = dials.remove(&peer) {
            self.abandon(core, d.ic);
        }
        let q = a.qp.take().expect("admitted dialers have a queue pair");
        let res = self.bind_qp(&conn, q).and_then(|ic| {
            self.connect_qp(&ic, &theirs.endpoint)?;
            // The dialer's queue pair is connected (it was before it sent
            // its proof): open, then say so.
            self.attach_and_open(core, &ic, theirs)
        });
        match res {
            Ok(()) => {
                a.hs.accept();
                true
            }
            Err(e) => {
                core.close_connection(&conn, &format!("connection set-up failed: {e}"), true);
                // No status says "failed here"; the dialer fails its
                // connect, and the next send tries again.
                a.hs.reject(Status::ShuttingDown);
                false
            }
        }
    }

    fn on_close_notice(&self, core: &Core, dials: &mut HashMap<u16, Dial<'_>>, n: &CloseNotice) {
        let names = |ic: &IbConn| {
            ic.local.to_bytes() == n.dst_endpoint
                && ic
                    .remote
                    .lock()
                    .is_some_and(|r| r.to_bytes() == n.src_endpoint)
        };
        if let Some(ic) = core.engine_half::<IbConn>(NodeId(n.src)) {
            if names(&ic) {
                core.close_connection(&ic.conn, "peer closed the connection", true);
            }
            return;
        }
        // Our dial, accepted and closed by the peer before we opened it
        // (its final answer was lost): it must not open on a repeat.
        if dials.get(&n.src).is_some_and(|d| names(&d.ic)) {
            let dial = dials.remove(&n.src).expect("present");
            let conn = dial.ic.conn.clone();
            self.abandon(core, dial.ic);
            core.close_connection(&conn, "peer closed the connection during set-up", true);
        }
    }
}

/// The header of our datagrams in the handshake `h` came in (to the
/// acceptor).
fn h_to_acceptor(h: DatagramHeader) -> DatagramHeader {
    DatagramHeader {
        to_acceptor: true,
        ..h
    }
}
