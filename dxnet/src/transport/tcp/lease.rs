//! A requester reads its own connection while it waits for a response
//! (leader/follower, as a blocking socket per thread would): the response
//! then wakes the thread that waits for it straight from the kernel. Without
//! this the receive thread is woken, reads, and wakes the requester: one
//! thread hop more per round trip, and a wake-up costs 3–55 µs on small
//! machines, more than the rest of a loopback round trip.
//!
//! Protocol:
//! - Only the holder of [`TcpConn::read`] (a [`ReadLease`]) reads the
//!   socket: a receive thread for one read, or a requester for its whole
//!   wait. Neither waits for it: without it a requester waits as usual,
//!   the receive thread delivering its response.
//! - While a requester holds it the socket is out of the receive poll
//!   ([`Polled`]), so no event wakes a receive thread for data it would
//!   only have to skip. The requester reads everything that arrives (other
//!   messages go to the incoming queue, other requesters' responses
//!   complete on this thread), looks at the socket while the request's
//!   spin budget lasts (yielding its core after each look that finds
//!   nothing), then sleeps in `poll(2)` on the socket and on its
//!   thread's eventfd, which the completion of its response by any other
//!   path writes (the connection closed, the response was read before the
//!   lease), until the response is in or the deadline passes.
//! - Leaving, it puts the socket back in the receive poll (which reports
//!   data that is there already) and lets the lease go. A receive thread
//!   that found the lease held (a readable entry from before the lease, or
//!   an event from just before the requester let go) leaves a note; the
//!   leaving requester learns of it and has the receive thread read the
//!   socket.
//! - Receive-side back-pressure (no receive buffer, incoming queue full,
//!   the connection over its share) ends the lease: the receive thread
//!   keeps the lists for those cases.

use std::cell::RefCell;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::fence;
use std::task::{Wake, Waker};

use super::recv::ReadOutcome;
use super::*;
use crate::primitives::read_lease::Lease;
use crate::transport::ResponseWait;

/// Whether a connection's socket is in the receive poll.
#[derive(Debug)]
pub(super) struct Polled {
    /// In the poll (out while a requester reads the socket).
    pub(super) polled: bool,
    /// The connection closed: the socket never goes back.
    pub(super) closed: bool,
}

impl Default for Polled {
    fn default() -> Self {
        Self {
            polled: true,
            closed: false,
        }
    }
}

/// Wakes a requester asleep in `poll(2)` on its connection: the waker its
/// pending response holds.
struct SleepWake {
    /// An eventfd, polled beside the socket.
    fd: OwnedFd,
    /// The requester is in `poll(2)` (or about to be): only then does a
    /// completion write to `fd` (a system call per response otherwise).
    asleep: AtomicBool,
}

impl SleepWake {
    fn new() -> Option<Arc<Self>> {
        // SAFETY: plain system call; a valid descriptor is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        Some(Arc::new(Self {
            // SAFETY: `fd` was just created and is owned by nobody else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            asleep: AtomicBool::new(false),
        }))
    }

    /// Empties the eventfd after it woke the sleeper.
    fn reset(&self) {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a live `u64`; the fd is non-blocking.
        unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut v as *mut u64).cast::<libc::c_void>(),
                8,
            )
        };
    }
}

impl Wake for SleepWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // The completion set the response's done flag before calling this;
        // the sleeper sets `asleep` before its last look at that flag. With
        // both fences at least one of them sees the other's store.
        fence(Ordering::SeqCst);
        if self.asleep.load(Ordering::SeqCst) {
            let one = 1u64;
            // SAFETY: writes 8 bytes from a live `u64`; a full counter
            // (EAGAIN) still leaves the eventfd readable.
            unsafe {
                libc::write(
                    self.fd.as_raw_fd(),
                    (&one as *const u64).cast::<libc::c_void>(),
                    8,
                )
            };
        }
    }
}

thread_local! {
    /// This thread's wake-up for sleeps on a connection, made on first use.
    static SLEEP_WAKE: RefCell<Option<(Arc<SleepWake>, Waker)>> = const { RefCell::new(None) };
}

fn sleep_wake() -> Option<(Arc<SleepWake>, Waker)> {
    SLEEP_WAKE
        .try_with(|w| {
            let mut w = w.try_borrow_mut().ok()?;
            if w.is_none() {
                let s = SleepWake::new()?;
                *w = Some((s.clone(), Waker::from(s)));
            }
            w.clone()
        })
        .ok()
        .flatten()
}

/// `poll(2)` for input on `fds` for at most `timeout` (rounded up to whole
/// milliseconds; zero: just look).
fn poll_in(fds: &mut [libc::pollfd], timeout: Duration) -> bool {
    for f in fds.iter_mut() {
        f.events = libc::POLLIN;
        f.revents = 0;
    }
    let ms = if timeout.is_zero() {
        0
    } else {
        timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
    };
    // SAFETY: `fds` is a live, exclusively borrowed array of its length.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    n > 0
}

fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// How a requester's reading of its connection ended.
enum Read {
    /// The socket has no more data now.
    Drained,
    /// Closed, or receive-side back-pressure: the receive thread takes over.
    GiveUp,
}

impl TcpEngine {
    /// See [`Transport::read_while_waiting`] and the module comment.
    pub(super) fn read_while_waiting(&self, w: &ResponseWait<'_>) -> Option<bool> {
        let core = self.core.upgrade()?;
        let tc = core.engine_half::<TcpConn>(w.peer)?;
        let reader = tc.read.try_take()?;
        if !self.out_of_poll(&tc) {
            self.hand_back(&tc, reader);
            return None;
        }
        let fd = tc.stream.as_raw_fd();
        let mut answered_spinning = false;
        let mut wake: Option<(Arc<SleepWake>, Waker)> = None;
        let mut spinning = w.may_spin;
        // Whether the socket may have data (a look said so, or not looked).
        let mut readable = true;
        loop {
            if readable {
                if let Read::GiveUp = self.read_all(&core, &tc) {
                    break;
                }
            }
            if (w.done)() {
                answered_spinning = spinning;
                break;
            }
            if spinning {
                // A look at the socket is a system call: the clock read
                // costs little beside it. Nothing to read: the core goes to
                // whoever has work first (the thread that carries the
                // response, often), as in `park::yield_spin`.
                if Instant::now() < w.spin_until {
                    readable = poll_in(&mut [pollfd(fd)], Duration::ZERO);
                    if !readable {
                        std::thread::yield_now();
                    }
                    continue;
                }
                spinning = false;
            }
            let now = Instant::now();
            if now >= w.deadline {
                break;
            }
            if wake.is_none() {
                wake = sleep_wake();
                match &wake {
                    Some((_, waker)) => (w.on_done)(waker),
                    None => break, // no eventfd: wait as usual
                }
            }
            let Some((sw, _)) = &wake else { break };
            sw.asleep.store(true, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            readable = false;
            if !(w.done)() {
                let mut fds = [pollfd(fd), pollfd(sw.fd.as_raw_fd())];
                poll_in(&mut fds, w.deadline - now);
                readable = fds[0].revents != 0;
                if fds[1].revents != 0 {
                    sw.reset();
                }
            }
            sw.asleep.store(false, Ordering::Relaxed);
        }
        self.back_in_poll(&tc);
        self.hand_back(&tc, reader);
        Some(answered_spinning)
    }

    /// Lets the lease go; a receive thread that skipped the socket
    /// meanwhile is told to read it.
    fn hand_back(&self, tc: &Arc<TcpConn>, lease: Lease<'_>) {
        if lease.release() {
            self.kick.lock().push(tc.clone());
            self.wake_receiver();
        }
    }

    /// Reads until the socket has no more data (delivering, never handling
    /// inline: no application code on a requester's thread).
    fn read_all(&self, core: &Arc<Core>, tc: &TcpConn) -> Read {
        loop {
            match self.read_once(core, tc, None) {
                ReadOutcome::More => {}
                ReadOutcome::Drained => return Read::Drained,
                ReadOutcome::Starved | ReadOutcome::Paused | ReadOutcome::Closed => {
                    return Read::GiveUp
                }
            }
        }
    }

    /// Takes the socket out of the receive poll; false once it closed.
    fn out_of_poll(&self, tc: &TcpConn) -> bool {
        let mut p = tc.polled.lock();
        if p.closed {
            return false;
        }
        if p.polled {
            let fd = tc.stream.as_raw_fd();
            if self.recv_registry.deregister(&mut SourceFd(&fd)).is_err() {
                return false;
            }
            p.polled = false;
        }
        true
    }

    /// Puts the socket back in the receive poll unless it closed meanwhile
    /// (the poll reports data already there).
    fn back_in_poll(&self, tc: &TcpConn) {
        let mut p = tc.polled.lock();
        if p.closed || p.polled {
            return;
        }
        let fd = tc.stream.as_raw_fd();
        match self.recv_registry.register(
            &mut SourceFd(&fd),
            Token(tc.conn.id as usize),
            Interest::READABLE,
        ) {
            Ok(()) => p.polled = true,
            Err(e) => {
                drop(p);
                if let Some(core) = self.core.upgrade() {
                    core.close_connection(&tc.conn, &format!("receive poll failed: {e}"), true);
                }
            }
        }
    }

    /// The connection closed: its socket stays out of the receive poll.
    pub(super) fn close_poll(&self, tc: &TcpConn) {
        let mut p = tc.polled.lock();
        p.closed = true;
        if std::mem::take(&mut p.polled) {
            let fd = tc.stream.as_raw_fd();
            let _ = self.recv_registry.deregister(&mut SourceFd(&fd));
        }
    }
}
