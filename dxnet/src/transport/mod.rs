//! Transport engines behind one trait.
//!
//! The core owns everything transport-independent; an engine moves bytes
//! out of connections' ring buffers (driven by the write-interest manager)
//! and delivers received bytes in pooled buffers to [`Core::deliver`]. It
//! carries flow-control units with its data (TCP chunk header, RDMA
//! immediate data) and reports connections it accepted through
//! [`Core::accept_incoming`] / [`Core::opened`] and failures through
//! [`Core::close_connection`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::TransportKind;
use crate::core::connection::Connection;
use crate::core::Core;
use crate::primitives::buffer_mem::InFlight;
use crate::primitives::in_order::InOrderTrack;
use crate::{NodeId, Result};

mod driver;
#[cfg(feature = "ib")]
pub mod ib;
pub mod loopback;
#[cfg(feature = "tcp")]
pub mod tcp;
#[cfg(all(feature = "tcp", not(feature = "tls")))]
#[path = "no_tls.rs"]
pub mod tls;
#[cfg(feature = "tls")]
pub mod tls;

/// A response the calling thread waits for (see
/// [`Transport::read_while_waiting`]).
pub struct ResponseWait<'a> {
    /// The node the request went to.
    pub peer: NodeId,
    /// True once the outcome is known.
    pub done: &'a dyn Fn() -> bool,
    /// Registers a waker that the outcome's arrival calls, from whichever
    /// thread completes it (before the thread sleeps).
    pub on_done: &'a dyn Fn(&std::task::Waker),
    /// Whether this requester may busy-wait at all.
    pub may_spin: bool,
    /// Busy-wait until then at most.
    pub spin_until: Instant,
    /// The request's timeout.
    pub deadline: Instant,
}

/// The long-lived threads of an engine: spawned by name at start, joined
/// at shutdown.
#[derive(Debug, Default)]
pub(crate) struct EngineThreads(parking_lot::Mutex<Vec<std::thread::JoinHandle<()>>>);

impl EngineThreads {
    /// Starts `f` on a thread named `name`.
    pub(crate) fn spawn(&self, name: String, f: impl FnOnce() + Send + 'static) -> Result<()> {
        let handle = std::thread::Builder::new()
            .name(name.clone())
            .spawn(f)
            .map_err(|e| crate::Error::Transport(format!("cannot spawn thread {name}: {e}")))?;
        self.0.lock().push(handle);
        Ok(())
    }

    /// Waits for every thread to end (the engine told them to stop), except
    /// the calling one if it is one of them (a shutdown started from a
    /// handler run on an engine thread).
    pub(crate) fn join_all(&self) {
        let me = std::thread::current().id();
        for t in std::mem::take(&mut *self.0.lock()) {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}

/// Upper bound of [`Transport::standalone_max`]: the core encodes such a
/// frame on the stack first.
pub const STANDALONE_FRAME_MAX: usize = 256;

/// What the core needs from a transport engine.
pub trait Transport: Send + Sync + 'static {
    /// Establishes `conn` (state Connecting) to `conn.peer`, blocking until
    /// the connection is open (the engine calls [`Core::opened`]) or
    /// `deadline`. Called on the first sender's thread.
    fn connect(&self, conn: &Arc<Connection>, deadline: Instant) -> Result<()>;
    /// Releases the engine's resources of `conn` (already marked closed).
    fn close(&self, conn: &Arc<Connection>);
    /// Outgoing rings per connection the engine's send thread drains
    /// ([`Connection::ring_for_thread`]); engines that drain only
    /// `Connection::orb` keep 1.
    fn rings(&self) -> usize {
        1
    }
    /// The write-interest manager got a new entry: wake the send thread.
    fn wake_sender(&self);
    /// Whether the engine holds bytes of `conn` that it took out of the
    /// rings but has not written out yet (TLS records rustls keeps while
    /// the socket is full): shutdown waits for these as for the rings'.
    fn holds_unsent(&self, _conn: &Connection) -> bool {
        false
    }
    /// Data for `peer` was just committed. An engine whose send thread is
    /// parked may write it out on the calling thread instead of waking that
    /// thread (one thread hop less on an idle node); returns true if it took
    /// care of the data. Under load the send thread aggregates as usual.
    /// `may_wait`: the caller blocks on a response right after, so it may
    /// wait briefly for another thread's write on the connection to end
    /// rather than leave the data to the send thread.
    /// `core` is the caller's: an engine holds only a weak reference to
    /// it, and upgrading that on every urgent send would make all sending
    /// threads write one shared counter.
    fn try_flush(&self, _core: &Core, _peer: NodeId, _may_wait: bool) -> bool {
        false
    }
    /// How long the send thread has been parked at `now`, if it is, so
    /// that a plain message would have to wake it ([`Transport::try_flush`]
    /// may then write it on the calling thread). Engines without that path
    /// keep `None`.
    fn sender_parked_for(&self, _now: Instant) -> Option<Duration> {
        None
    }
    /// A UDP socket on the node's address that the discovery job may send
    /// from, if the engine owns one; the engine then hands received
    /// discovery datagrams to [`Core::on_discovery_datagram`]. `None`: the
    /// job binds its own socket on the node's address.
    fn discovery_socket(&self) -> Option<std::net::UdpSocket> {
        None
    }
    /// Largest frame (message header and payload) that
    /// [`Transport::send_standalone`] takes; 0: the engine has no such path.
    fn standalone_max(&self) -> usize {
        0
    }
    /// Sends `frame` (one whole request or response message; its
    /// flow-control window is taken) to `conn`'s peer at once, outside the
    /// connection's ring buffer, if the engine can do so now without
    /// reordering it behind this thread's earlier messages (the ring
    /// buffer holds no unsent bytes) and without its send thread (idle).
    /// False: nothing was sent; the caller writes the frame into the ring
    /// buffer as usual. Saves the ring-buffer round on a latency-bound
    /// request/response (see the InfiniBand engine).
    fn send_standalone(&self, _core: &Core, _conn: &Connection, _frame: &[u8]) -> bool {
        false
    }
    /// The calling thread waits for a response from `w.peer`: an engine
    /// that can let it receive itself meanwhile does so and returns whether
    /// the response came while it busy-polled (until `w.spin_until`, if
    /// `w.may_spin`); the caller then parks until the outcome is in. TCP
    /// reads that connection, sleeping on its socket after the busy-wait
    /// until the outcome or `w.deadline` (see `tcp/lease.rs`); InfiniBand
    /// polls the completion queues while it busy-waits (see
    /// [`crate::core::inline::ReceiveRole::help`]). `None`: the engine
    /// cannot, or another thread reads that connection now; the caller
    /// waits as usual.
    fn read_while_waiting(&self, _w: &ResponseWait<'_>) -> Option<bool> {
        None
    }
    /// Receive buffers or incoming-queue room came free: a receiver that
    /// stopped for lack of them may go on.
    fn wake_receiver(&self);
    /// One-sided operations done by the device (InfiniBand RDMA);
    /// `None`: the runtime emulates them with messages.
    fn remote_memory(&self) -> Option<&dyn RemoteMemory> {
        None
    }
    /// From which payload size the engine writes a buffer's payload from
    /// the buffer in place, behind its message header in a ring
    /// ([`Transport::lend`]); `None`: never.
    fn lends_from(&self) -> Option<usize> {
        None
    }
    /// Takes `payload` (the payload of the message that starts at
    /// position `at` of `conn`'s ring `ring` with its `payload.header`
    /// bytes of header), to write right after that header. Called while the header's bytes are reserved and not
    /// yet committed, so the engine knows of the payload before it can
    /// see the header. Gives it back if the connection no longer takes
    /// payloads (it closed).
    fn lend(&self, _conn: &Connection, _ring: usize, _at: u64, payload: Lent) -> Result<(), Lent> {
        Err(payload)
    }
    /// Stops the engine's threads and closes its sockets/queue pairs.
    fn shutdown(&self);
}

/// A message payload lent to the engine in place ([`Transport::lend`]):
/// the bytes stay in the application's buffer, which the guard keeps alive
/// and unwritten until the engine wrote them. Its outcome goes to `track`
/// (one item): done once every byte is written out, lost if the payload
/// is dropped before (the connection closed).
pub struct Lent {
    /// Bytes of the message in the ring (its header), before the payload.
    pub header: usize,
    /// The buffer, held for reading.
    pub guard: InFlight,
    /// Where the outcome goes.
    pub track: Arc<InOrderTrack>,
    /// Set once done (the drop then reports nothing).
    done: bool,
}

impl Lent {
    /// `guard`'s buffer as the payload of a message with `header` bytes
    /// in the ring; its outcome for `track`.
    pub fn new(header: usize, guard: InFlight, track: Arc<InOrderTrack>) -> Lent {
        Lent {
            header,
            guard,
            track,
            done: false,
        }
    }

    /// The payload's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the guard counts a reading access in flight, so the
        // buffer's owner does not write the bytes while it lives (it moves
        // to a copy instead, see `buffer_mem`).
        unsafe { self.guard.bytes() }
    }

    /// Every byte was written out: the buffer is free again, the outcome
    /// done.
    pub fn finish(mut self) {
        self.done = true;
        self.guard.device_done();
        self.track.complete_through(1);
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if !self.done {
            self.guard.device_done();
            self.track.lose_pending();
        }
    }
}

impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lent")
            .field("len", &self.guard.len())
            .finish_non_exhaustive()
    }
}

/// Where a part of a one-sided access goes in the peer's registered
/// memory.
#[derive(Debug, Clone, Copy)]
// Read only by the InfiniBand engine.
#[cfg_attr(not(feature = "ib"), allow(dead_code))]
pub enum RdmaPart<'a> {
    /// Write the bytes of `src` there.
    Write {
        /// The bytes.
        src: PartSource<'a>,
        /// The peer's address of the first byte.
        addr: u64,
        /// The region's remote key.
        rkey: u32,
    },
    /// Read `len` bytes from there into `into`.
    Read {
        /// How many.
        len: usize,
        /// The peer's address of the first byte.
        addr: u64,
        /// The region's remote key.
        rkey: u32,
        /// Where they go.
        into: PartDest<'a>,
    },
}

/// The bytes a write part carries.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "ib"), allow(dead_code))]
pub enum PartSource<'a> {
    /// The caller's bytes: the engine copies them (into staging memory, or
    /// inline into the work request) before `post` returns.
    Bytes(&'a [u8]),
    /// `len` bytes of the caller's own registered region: the device reads
    /// them in place, no copy.
    Local(LocalBytes<'a>),
}

/// Where a read part's bytes go.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "ib"), allow(dead_code))]
pub enum PartDest<'a> {
    /// The whole read's buffer, at `at`: filled by the engine as the part
    /// completes (before its outcome shows as done).
    Buf {
        /// The read's buffer.
        buf: &'a ReadBuf,
        /// Where this part goes in it.
        at: usize,
    },
    /// The caller's own registered region: the device writes there.
    Local(LocalBytes<'a>),
}

/// A range of one of this node's regions, registered with the device
/// ([`RemoteMemory::register`]), that a part reads or fills in place.
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "ib"), allow(dead_code))]
pub struct LocalBytes<'a> {
    /// The registration (what [`RemoteMemory::register`] returned).
    pub registration: &'a (dyn std::any::Any + Send + Sync),
    /// Offset of the first byte in the registered memory.
    pub offset: usize,
    /// How many bytes.
    pub len: usize,
    /// Keeps the memory and the registration alive: the engine holds a
    /// clone until the device is done with the part (its completion, or the
    /// end of its queue pair), whatever the caller does meanwhile.
    pub keep: &'a Arc<dyn Hold>,
}

/// What keeps the memory of a part in place alive (see
/// [`LocalBytes::keep`]).
pub trait Hold: Send + Sync {
    /// The part completed: the device no longer touches the memory. Called
    /// before the part's outcome shows as done (the handle itself may be
    /// dropped later); not called for a part whose queue pair closed
    /// first (the device may use the memory until the queue pair is
    /// destroyed, when the handle is dropped).
    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    fn device_done(&self) {}
}

impl std::fmt::Debug for LocalBytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBytes")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// A device read's bytes. Shared with the engine, which copies each part
/// in when it completes (its staging memory is free again at once, even
/// if the caller never waits), so the caller may be gone by then.
pub type ReadBuf = Arc<parking_lot::Mutex<ReadBytes>>;

/// Bytes filled in disjoint pieces, taken out once all are there. Not
/// zeroed first: under CPU emulation every pass over a 64 KiB part is
/// visible in a read's latency.
#[derive(Debug)]
pub struct ReadBytes {
    buf: Vec<std::mem::MaybeUninit<u8>>,
    /// Bytes filled so far (pieces never overlap).
    filled: usize,
}

impl ReadBytes {
    /// Room for `len` bytes, none filled.
    pub fn new(len: usize) -> ReadBytes {
        let mut buf = Vec::with_capacity(len);
        // SAFETY: `MaybeUninit` needs no initialization; the capacity is
        // `len`.
        unsafe { buf.set_len(len) };
        ReadBytes { buf, filled: 0 }
    }

    /// Fills `[at, at + src.len())`, which no earlier call filled.
    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    pub fn fill(&mut self, at: usize, src: &[u8]) {
        let dst = &mut self.buf[at..at + src.len()];
        // SAFETY: `dst` is in bounds (the slicing checked it) and as long
        // as `src`; `MaybeUninit<u8>` has `u8`'s layout; the two do not
        // overlap (`src` is not part of this buffer).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), src.len())
        };
        self.filled += src.len();
    }

    /// The bytes, if every one was filled (else `None`); leaves this
    /// empty.
    pub fn take(&mut self) -> Option<Vec<u8>> {
        if self.filled != self.buf.len() {
            return None;
        }
        self.filled = 0;
        let mut buf = std::mem::ManuallyDrop::new(std::mem::take(&mut self.buf));
        // SAFETY: every byte was written (the filled pieces are disjoint
        // and add up to the length), `MaybeUninit<u8>` has `u8`'s layout
        // and alignment, and the allocation is handed over whole (the
        // original vector is not dropped).
        Some(unsafe {
            Vec::from_raw_parts(buf.as_mut_ptr().cast::<u8>(), buf.len(), buf.capacity())
        })
    }
}

/// An engine's one-sided operations in hardware (see
/// [`Transport::remote_memory`]).
pub trait RemoteMemory: Send + Sync {
    /// Registers `len` bytes at `addr` for remote reads and/or writes;
    /// returns the remote key and a handle that deregisters when dropped.
    ///
    /// # Safety
    /// The memory must stay allocated until the handle is dropped; the
    /// device reads and writes it at any time meanwhile.
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        read: bool,
        write: bool,
    ) -> Result<(u32, Box<dyn std::any::Any + Send + Sync>)>;
    /// Largest part one work request carries.
    fn part_max(&self) -> usize;
    /// Retires completions of posted parts (a waiting caller polls);
    /// true if there were any.
    fn progress(&self, core: &Core) -> bool;
    /// A caller stops polling [`RemoteMemory::progress`] and waits for
    /// completions of parts in flight to be retired by the engine: the
    /// engine does so for a while (some milliseconds); a caller still
    /// waiting then calls again.
    fn waiting(&self);
    /// Posts `part` on the open connection `conn` after the data its ring
    /// holds. Its outcome shows in `conn.parts` (`Connection::parts`)
    /// under the returned sequence number. Waits for room (send queue, staging memory) until
    /// `deadline`. Unless `signal` (the caller waits for it at once), the
    /// engine may leave its report to a later request's: a caller that
    /// waits for it calls [`RemoteMemory::cover`] first.
    fn post(
        &self,
        core: &Core,
        conn: &Arc<Connection>,
        part: RdmaPart<'_>,
        deadline: Instant,
        signal: bool,
    ) -> Result<u64>;
    /// Posts a message of `header` and a payload the device reads in
    /// place from `payload`, on the open connection `conn` right after the
    /// data its ring holds, with nothing in between. Its completion shows
    /// in `conn.parts` under the returned number (it asks for one). Waits
    /// for room (send queue, staging memory for the header) until
    /// `deadline`. `None`: the engine declines (the message needs more work
    /// requests than the send queue holds, or ring data reserved before it
    /// cannot be posted yet), the caller copies it through the ring.
    fn post_send(
        &self,
        core: &Core,
        conn: &Arc<Connection>,
        header: &[u8],
        payload: LocalBytes<'_>,
        deadline: Instant,
    ) -> Result<Option<u64>>;
    /// Makes sure the outcome of part `seq` on `conn` gets reported
    /// (posts a signalled marker behind it if nothing signalled follows;
    /// waits for room in the send queue until `deadline`).
    fn cover(&self, core: &Core, conn: &Arc<Connection>, seq: u64, deadline: Instant);
}

/// The error of a connection set-up that failed (see
/// [`crate::error::Unreachable::Connect`]).
pub(crate) fn cannot_connect(peer: NodeId, why: impl Into<String>) -> crate::Error {
    crate::Error::Unreachable(peer, crate::error::Unreachable::Connect(why.into()))
}

/// The first socket address a node-map address (`host:port`) resolves to.
#[cfg(any(feature = "tcp", feature = "ib"))]
pub(crate) fn resolve(addr: &str) -> std::io::Result<std::net::SocketAddr> {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other(format!("{addr} resolves to no address")))
}

/// Starts the engine the configuration names.
pub(crate) fn start(core: &Arc<Core>) -> Result<Arc<dyn Transport>> {
    match core.config().transport {
        TransportKind::Loopback => loopback::start(core),
        #[cfg(feature = "tcp")]
        TransportKind::Tcp => tcp::start(core),
        #[cfg(feature = "ib")]
        TransportKind::Ib => ib::start(core),
        #[allow(unreachable_patterns)]
        other => Err(crate::Error::Config(format!(
            "transport {other:?}: {}",
            other.missing_feature()
        ))),
    }
}

#[cfg(test)]
mod read_bytes_tests {
    use super::ReadBytes;

    #[test]
    fn read_bytes_are_taken_only_once_every_piece_is_filled() {
        let mut b = ReadBytes::new(10);
        b.fill(4, &[4, 5, 6]);
        assert_eq!(b.take(), None);
        b.fill(0, &[0, 1, 2, 3]);
        b.fill(7, &[7, 8, 9]);
        assert_eq!(b.take(), Some((0..10).collect::<Vec<u8>>()));
        assert_eq!(b.take(), Some(Vec::new()), "taken: empty");
        let mut empty = ReadBytes::new(0);
        assert_eq!(empty.take(), Some(Vec::new()));
    }
}
