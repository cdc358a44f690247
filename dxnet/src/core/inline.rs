//! Inline handling: a receive thread that finds every handler thread parked
//! handles a small received buffer itself instead of waking one (a thread
//! wake-up costs 3–55 µs on small machines: the largest part of a request's
//! round trip).
//!
//! The danger is a handler that blocks on something only the receive thread
//! can deliver (the response to a nested request, a flow-control
//! confirmation): the node would stop receiving. So the receive thread gives
//! up its *receive role* (a token the transport keeps: its poll set and
//! lists) before it runs handlers, and a standby thread can take the role
//! over:
//! - at once, when the inline handler is about to block inside dxnet
//!   (`Node::request`, a `send` under back-pressure, ...): every blocking
//!   wait in dxnet calls [`before_blocking`], which fires the hook the
//!   receive thread installed for the duration of the inline run;
//! - after at most `park.max_park_ms`, when the handler blocks or runs long
//!   outside dxnet (the standby's periodic check).
//!
//! The thread that finishes the inline run takes the role back if it is
//! still free, and becomes the standby otherwise.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::core::connection::Connection;
use crate::core::{Core, InlineWork};
use crate::primitives::park::{RequestWait, Signal, YieldingSpin};

/// What the holder of a receive role does next (see [`ReceiveRole::run`]).
pub enum Turn {
    /// Give the role up and handle this buffer on the calling thread.
    Inline(InlineWork),
    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    /// Give the role up and sleep (the transport's `sleep`) for at most
    /// this long: the engine armed its wake-up source.
    Sleep(Duration),
    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    /// Give the role up to the requesters that receive themselves now
    /// (see [`ReceiveRole::help`]); sleep meanwhile, looking again within
    /// `park.yield_us`.
    StepAside,
    /// The engine stops.
    Stop,
}

/// A transport's receive role (its poll set, or completion-queue state,
/// `R`), shared by two receive threads: the holder receives, the other is
/// the standby that takes over while the holder runs handlers inline.
///
/// Threads waiting for a response may take the role too while they wait
/// ([`ReceiveRole::help`]): the receive threads then step aside, and the
/// response is taken off the wire by the thread that waits for it, with no
/// other thread running (what a hand-written busy-polling ping-pong does;
/// on a machine with few cores each extra spinning thread slows the round
/// trip, and a wake-up costs more than the round trip itself).
pub struct ReceiveRole<R> {
    state: Mutex<R>,
    standby: Arc<Standby>,
    /// Threads inside [`ReceiveRole::help`].
    helpers: AtomicUsize,
    /// Held by the one receive thread sleeping on the engine's wake-up
    /// source (a completion channel must have at most one reader).
    sleeper: Mutex<()>,
    /// Counts helpers that left with their response (a clock read per
    /// request costs more than this on emulated machines).
    helped: AtomicU64,
    /// A helper left without its response (it parks): receive threads go
    /// back to receiving at once.
    resume: AtomicBool,
}

impl<R> ReceiveRole<R> {
    /// A role over the receive state `state`.
    pub fn new(state: R) -> Self {
        Self {
            state: Mutex::new(state),
            standby: Arc::new(Standby::default()),
            helpers: AtomicUsize::new(0),
            sleeper: Mutex::new(()),
            helped: AtomicU64::new(0),
            resume: AtomicBool::new(false),
        }
    }

    /// True while a waiting requester receives (the holder should return
    /// [`Turn::Sleep`] when it finds nothing to do).
    #[inline]
    pub fn helpers_waiting(&self) -> bool {
        self.helpers.load(Ordering::Acquire) > 0
    }

    /// Body of each of the two receive threads, until `stop`: holding the
    /// role, `receive` receives until it returns a buffer to handle inline,
    /// asks to sleep, or stops; the role is given up for the inline run,
    /// with the standby armed to take over if a handler blocks, and while
    /// sleeping. Without the role the thread is the standby: woken by such
    /// a handler, or every `max_park` to take over from one that runs long.
    /// While requesters receive themselves (and for `park.yield_us` after
    /// one left with its response: the next request of a ping-pong comes
    /// sooner), the thread only `peek`s once every `park.yield_us` (one
    /// pass, nothing handled inline) instead of taking the role: taking it
    /// back and forth costs a wake-up and a spinning thread each time.
    /// `on_stop` gets the state once `stop` is seen while holding it.
    pub fn run(
        &self,
        core: &Arc<Core>,
        stop: &AtomicBool,
        mut receive: impl FnMut(&mut R) -> Turn,
        mut peek: impl FnMut(&mut R),
        mut sleep: impl FnMut(Duration),
        mut on_stop: impl FnMut(&mut R),
    ) {
        let max_park = Duration::from_millis(core.config().park.max_park_ms.max(1));
        let grace = Duration::from_micros(core.config().park.yield_us.max(100));
        // `helped` as of this thread's last look: a change means a helper
        // got its response since (within about one grace period).
        let mut seen = self.helped.load(Ordering::Acquire);
        while !stop.load(Ordering::Acquire) {
            let helped = self.helped.load(Ordering::Acquire);
            let recent = std::mem::replace(&mut seen, helped) != helped
                && !self.resume.load(Ordering::Acquire);
            if self.helpers_waiting() || recent {
                if !self.helpers_waiting() {
                    if let Some(mut state) = self.state.try_lock() {
                        peek(&mut state);
                    }
                }
                self.sleep_or_stand_by(stop, grace, max_park, &mut sleep);
                continue;
            }
            let Some(mut state) = self.state.try_lock() else {
                // A helper that left meanwhile counted `helped` or set
                // `resume` before it stopped counting as a helper.
                if self.helpers_waiting()
                    || self.resume.load(Ordering::Acquire)
                    || self.helped.load(Ordering::Acquire) != seen
                {
                    // A helper holds the role (or is handing it back, which
                    // re-arms the wake-up source this nap waits on).
                    // Parking as the standby instead would leave nobody
                    // receiving until `max_park` if the other receive
                    // thread parks too.
                    self.sleep_or_stand_by(stop, grace, max_park, &mut sleep);
                } else {
                    self.standby.park(stop, max_park);
                }
                continue;
            };
            // Taking over: a hand-back asked for is served.
            self.resume.store(false, Ordering::Release);
            let turn = receive(&mut state);
            if stop.load(Ordering::Acquire) {
                on_stop(&mut state);
            }
            drop(state);
            match turn {
                Turn::Inline(work) => {
                    with_standby(self.standby.clone(), || core.run_inline(work));
                }
                Turn::Sleep(d) => self.sleep_or_stand_by(stop, d, max_park, &mut sleep),
                Turn::StepAside => self.sleep_or_stand_by(stop, grace, max_park, &mut sleep),
                Turn::Stop => {}
            }
        }
    }

    /// One receive thread sleeps on the engine's wake-up source (at most
    /// `d`), the other parks as the standby (at most `max_park`).
    fn sleep_or_stand_by(
        &self,
        stop: &AtomicBool,
        d: Duration,
        max_park: Duration,
        sleep: &mut impl FnMut(Duration),
    ) {
        match self.sleeper.try_lock() {
            Some(_g) => sleep(d),
            None => {
                self.standby.park(stop, max_park);
            }
        }
    }

    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    /// Called by a thread that waits for a response: takes the role while
    /// it is free and calls `poll` (one pass over the receive queue, no
    /// user code run: other messages go to the handler threads) until
    /// `done` or `until`; while another thread holds the role it yields
    /// its core between two looks at `done`. The receive threads step
    /// aside meanwhile. When
    /// the last helper leaves without its response (it is about to park),
    /// or with it while other requesters of the process are parked (their
    /// responses must not wait for the next helper), `hand_back` runs once
    /// more with the role: it must make the receive threads take over (on
    /// InfiniBand: re-arm the completion channel the sleeping one waits
    /// on). A helper that got its response while no one else waits leaves
    /// without waking anyone: the receive thread looks again within
    /// `park.yield_us` (its "grace" sleep), and another request of the same
    /// thread usually comes first.
    pub fn help(
        &self,
        done: &dyn Fn() -> bool,
        until: std::time::Instant,
        mut poll: impl FnMut(&mut R),
        hand_back: impl FnOnce(&mut R),
    ) {
        self.helpers.fetch_add(1, Ordering::AcqRel);
        let mut n = 0u32;
        let mut spin = YieldingSpin::until(until);
        while !done() {
            if let Some(mut st) = self.state.try_lock() {
                poll(&mut st);
                n = n.wrapping_add(1);
                if n.is_multiple_of(32) && spin.expired() {
                    break;
                }
            } else {
                // Another thread polls: only look at the own request,
                // yielding the core between two looks (`park::yield_spin`).
                std::thread::yield_now();
                if std::time::Instant::now() >= until {
                    break;
                }
            }
        }
        let got = done();
        // Requesters that parked need a receiver when the last helper is
        // gone (this thread still counts as spinning, not as parked).
        let hand_over = !got || RequestWait::parked() > 0;
        // Before the count drops: a receive thread that sees no helper
        // sees this too.
        if got {
            self.helped.fetch_add(1, Ordering::AcqRel);
        }
        if hand_over {
            self.resume.store(true, Ordering::Release);
        }
        let last = self.helpers.fetch_sub(1, Ordering::AcqRel) == 1;
        if last && hand_over {
            // Someone else holding the role now receives (a receive
            // thread, or a new helper that hands back in turn).
            if let Some(mut st) = self.state.try_lock() {
                hand_back(&mut st);
            }
        }
    }

    /// Wakes a parked standby at shutdown (the caller has set `stop`).
    pub fn stopping(&self) {
        self.standby.signal.notify_all();
    }
}

/// The receive thread that does not hold the role parks here; a handler
/// run inline that blocks inside dxnet calls it to take the role over.
#[derive(Debug, Default)]
pub struct Standby {
    signal: Signal,
    /// Set before the signal fires: a call that comes while the standby is
    /// on its way to park is seen when it re-checks under the signal's lock
    /// (a bare notification could be lost and cost `max_park`).
    called: AtomicBool,
}

impl Standby {
    /// Asks the parked (or parking) standby to take the role over.
    fn call(&self) {
        self.called.store(true, Ordering::SeqCst);
        self.signal.notify_one();
    }

    /// Parks until called, `stop`, or `max_park`; consumes the call and
    /// returns whether there was one.
    fn park(&self, stop: &AtomicBool, max_park: Duration) -> bool {
        self.signal.park_unless(
            || stop.load(Ordering::Acquire) || self.called.load(Ordering::SeqCst),
            max_park,
        );
        self.called.swap(false, Ordering::Relaxed)
    }
}

/// The connection whose messages this thread is handling.
struct Handling {
    core: Arc<Core>,
    conn: Arc<Connection>,
}

thread_local! {
    /// Set while a receive thread runs handlers inline: its standby.
    static STANDBY: RefCell<Option<Arc<Standby>>> = const { RefCell::new(None) };
    /// Set while this thread runs handlers of a connection it holds.
    static HANDLING: RefCell<Option<Handling>> = const { RefCell::new(None) };
    /// A handler of `HANDLING` blocked (its connection decodes ahead).
    static BLOCKED: Cell<bool> = const { Cell::new(false) };
    /// Set while this thread runs the handlers of one received buffer:
    /// peers whose requests or responses wait to be written out together
    /// (see [`deferring_flushes`]).
    static DEFERRED: RefCell<Option<Vec<u16>>> = const { RefCell::new(None) };
    /// The storage of the last finished deferral, reused by the next one
    /// (no allocation per received buffer).
    static SPARE: Cell<Vec<u16>> = const { Cell::new(Vec::new()) };
}

/// Runs `f` (the handlers of the messages of one received buffer) so that
/// the requests and responses they send are written out together when it
/// returns, instead of one write each: a buffer that brought several
/// requests sends their responses in one write (one system call and one
/// wake-up of the peer instead of one per response). `flush` writes out a
/// peer's data. A handler that blocks inside dxnet flushes first (see
/// [`before_blocking`]), so nothing waits for a blocked handler; the
/// responses of a buffer's earlier messages wait for its later handlers.
pub(crate) fn deferring_flushes<R>(f: impl FnOnce() -> R, mut flush: impl FnMut(u16)) -> R {
    struct Reset(Option<Vec<u16>>);
    impl Drop for Reset {
        fn drop(&mut self) {
            let prev = self.0.take();
            let _ = DEFERRED.try_with(|d| *d.borrow_mut() = prev);
        }
    }
    let spare = SPARE.with(Cell::take);
    let prev = DEFERRED.with(|d| d.borrow_mut().replace(spare));
    let reset = Reset(prev);
    let r = f();
    let mut peers = DEFERRED.with(|d| d.borrow_mut().take()).unwrap_or_default();
    drop(reset);
    for &p in &peers {
        flush(p);
    }
    peers.clear();
    SPARE.with(|s| s.set(peers));
    r
}

/// True if this thread defers writing out `peer`'s data (it runs under
/// [`deferring_flushes`]); the peer is then recorded.
#[inline]
pub(crate) fn defer_flush(peer: u16) -> bool {
    DEFERRED
        .try_with(|d| match d.try_borrow_mut() {
            Ok(mut d) => match d.as_mut() {
                Some(v) => {
                    if !v.contains(&peer) {
                        v.push(peer);
                    }
                    true
                }
                None => false,
            },
            Err(_) => false,
        })
        .unwrap_or(false)
}

/// Takes the peers deferred so far (see [`deferring_flushes`]); deferral
/// goes on for what the handlers send next.
fn take_deferred() -> Vec<u16> {
    DEFERRED
        .try_with(|d| {
            d.try_borrow_mut()
                .ok()
                .and_then(|mut d| d.as_mut().map(std::mem::take))
        })
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Runs `f` (the inline handling of a receive thread) with `standby` to be
/// woken if a handler inside `f` blocks; fires at most once.
pub fn with_standby<R>(standby: Arc<Standby>, f: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            STANDBY.with(|h| h.borrow_mut().take());
        }
    }
    STANDBY.with(|h| *h.borrow_mut() = Some(standby));
    let _reset = Reset;
    f()
}

/// Runs `f` (handlers of messages of `conn`, which the caller holds) so
/// that a handler blocking inside dxnet makes `conn` decode ahead (see
/// `Core::owner_blocking`). Returns `f`'s result.
pub(crate) fn handling<R>(core: &Arc<Core>, conn: &Arc<Connection>, f: impl FnOnce() -> R) -> R {
    struct Reset(Option<Handling>);
    impl Drop for Reset {
        fn drop(&mut self) {
            let prev = self.0.take();
            HANDLING.with(|h| *h.borrow_mut() = prev);
        }
    }
    let prev = HANDLING.with(|h| {
        h.borrow_mut().replace(Handling {
            core: core.clone(),
            conn: conn.clone(),
        })
    });
    let _reset = Reset(prev);
    f()
}

/// The connection whose messages this thread is handling, if any.
pub(crate) fn current_conn() -> Option<Arc<Connection>> {
    HANDLING
        .try_with(|h| {
            h.try_borrow()
                .ok()
                .and_then(|h| h.as_ref().map(|x| x.conn.clone()))
        })
        .ok()
        .flatten()
}

/// True (once) if a handler run under [`handling`] blocked since the last
/// call: the caller then ends the decode-ahead of its connection.
pub(crate) fn take_blocked() -> bool {
    BLOCKED.with(|b| b.replace(false))
}

/// Called by every blocking wait in dxnet before it parks or spins: a
/// receive thread running handlers inline hands its receive role to the
/// standby, and the connection whose handler blocks decodes ahead so that
/// responses it waits for can arrive.
#[inline]
pub fn before_blocking() {
    // `try_with`: also called from thread-local destructors at exit.
    let standby = STANDBY
        .try_with(|h| h.try_borrow_mut().ok().and_then(|mut h| h.take()))
        .ok()
        .flatten();
    if let Some(s) = standby {
        s.call();
    }
    let deferred = take_deferred();
    if !deferred.is_empty() {
        let core = HANDLING
            .try_with(|h| {
                h.try_borrow()
                    .ok()
                    .and_then(|h| h.as_ref().map(|x| x.core.clone()))
            })
            .ok()
            .flatten();
        if let Some(core) = core {
            for p in deferred {
                core.flush_deferred(crate::NodeId(p));
            }
        }
    }
    if BLOCKED.try_with(|b| b.get()).unwrap_or(true) {
        return; // already decoding ahead (or thread exiting)
    }
    let handling = HANDLING
        .try_with(|h| {
            h.try_borrow()
                .ok()
                .and_then(|h| h.as_ref().map(|x| (x.core.clone(), x.conn.clone())))
        })
        .ok()
        .flatten();
    if let Some((core, conn)) = handling {
        BLOCKED.with(|b| b.set(true));
        core.owner_blocking(&conn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    use crossbeam::channel::{Receiver, Sender};

    /// A fake receive queue: items (ids) arrive on a channel; receiving
    /// one counts it as delivered.
    struct FakeQueue {
        rx: Receiver<usize>,
        delivered: Arc<Vec<AtomicU32>>,
    }

    impl FakeQueue {
        /// One pass: delivers what is there; returns how many.
        fn poll(&mut self) -> usize {
            let mut n = 0;
            while let Ok(id) = self.rx.try_recv() {
                self.delivered[id].fetch_add(1, Ordering::SeqCst);
                n += 1;
            }
            n
        }
    }

    /// Receive threads (`ReceiveRole::run`) and helpers (`help`) share the
    /// role under load: every item is delivered exactly once, helpers that
    /// give up hand back and their item still arrives (a receive thread
    /// takes over), and nothing hangs.
    #[test]
    fn helpers_and_receive_threads_deliver_every_item_once() {
        const HELPERS: usize = 3;
        const PER_HELPER: usize = 300;
        const STRAY: usize = 2000;
        let total = HELPERS * PER_HELPER + STRAY;
        let core = Core::start_with(
            crate::Config {
                node_id: 1,
                transport: crate::config::TransportKind::Loopback,
                park: crate::config::ParkConfig {
                    yield_us: 200,
                    max_park_ms: 2,
                    ..Default::default()
                },
                ..crate::Config::default()
            },
            crate::transport::start,
        )
        .unwrap();
        let (tx, rx): (Sender<usize>, Receiver<usize>) = crossbeam::channel::unbounded();
        let delivered: Arc<Vec<AtomicU32>> =
            Arc::new((0..total).map(|_| AtomicU32::new(0)).collect());
        let role = Arc::new(ReceiveRole::new(FakeQueue {
            rx,
            delivered: delivered.clone(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let receivers: Vec<_> = (0..2)
            .map(|_| {
                let (role, core, stop) = (role.clone(), core.clone(), stop.clone());
                std::thread::spawn(move || {
                    let r2 = role.clone();
                    let mut idle = 0u32;
                    role.run(
                        &core,
                        &stop,
                        |q| loop {
                            if stop.load(Ordering::Acquire) {
                                return Turn::Stop;
                            }
                            if q.poll() > 0 {
                                idle = 0;
                                continue;
                            }
                            if r2.helpers_waiting() {
                                return Turn::StepAside;
                            }
                            idle += 1;
                            if idle > 100 {
                                idle = 0;
                                return Turn::Sleep(Duration::from_micros(300));
                            }
                            std::thread::yield_now();
                        },
                        |q| {
                            q.poll();
                        },
                        std::thread::sleep,
                        |q| {
                            q.poll();
                        },
                    )
                })
            })
            .collect();
        // Stray items (messages nobody waits for) arrive throughout.
        let stray = {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for i in 0..STRAY {
                    tx.send(HELPERS * PER_HELPER + i).unwrap();
                    if i % 16 == 0 {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
            })
        };
        let helpers: Vec<_> = (0..HELPERS)
            .map(|h| {
                let (role, tx, delivered) = (role.clone(), tx.clone(), delivered.clone());
                std::thread::spawn(move || {
                    let mut handed_back = 0;
                    for k in 0..PER_HELPER {
                        let id = h * PER_HELPER + k;
                        // Every 4th "response" comes late: the helper gives
                        // up first (a receive thread must deliver it).
                        let late = k % 4 == 0;
                        if !late {
                            tx.send(id).unwrap();
                        } else {
                            let tx = tx.clone();
                            std::thread::spawn(move || {
                                std::thread::sleep(Duration::from_micros(300));
                                tx.send(id).unwrap();
                            });
                        }
                        let done = || delivered[id].load(Ordering::SeqCst) > 0;
                        let until = std::time::Instant::now() + Duration::from_micros(100);
                        role.help(
                            &done,
                            until,
                            |q| {
                                q.poll();
                            },
                            |q| {
                                handed_back += 1;
                                q.poll();
                            },
                        );
                        // Then wait as a parked requester would: only the
                        // receive threads can deliver it now.
                        let deadline = std::time::Instant::now() + Duration::from_secs(30);
                        while !done() {
                            assert!(
                                std::time::Instant::now() < deadline,
                                "item {id} never delivered"
                            );
                            std::thread::sleep(Duration::from_micros(100));
                        }
                    }
                    handed_back
                })
            })
            .collect();
        let handed_back: usize = helpers.into_iter().map(|h| h.join().unwrap()).sum();
        stray.join().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while delivered.iter().any(|d| d.load(Ordering::SeqCst) == 0) {
            assert!(
                std::time::Instant::now() < deadline,
                "stray items never delivered"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        stop.store(true, Ordering::Release);
        role.stopping();
        for r in receivers {
            r.join().unwrap();
        }
        for (id, d) in delivered.iter().enumerate() {
            assert_eq!(d.load(Ordering::SeqCst), 1, "item {id}");
        }
        // Late items made helpers give up, and some of them handed back.
        assert!(handed_back > 0);
        core.shutdown();
    }

    #[test]
    fn deferred_flushes_leave_once_per_peer_after_the_run() {
        let flushed = RefCell::new(Vec::new());
        assert!(!defer_flush(3), "nothing is deferred outside a run");
        let r = deferring_flushes(
            || {
                assert!(defer_flush(3));
                assert!(defer_flush(5));
                assert!(defer_flush(3));
                assert!(flushed.borrow().is_empty(), "nothing leaves during the run");
                // Nested runs (a handler run inside a handler) keep their
                // own list.
                deferring_flushes(|| assert!(defer_flush(7)), |p| flushed.borrow_mut().push(p));
                assert_eq!(*flushed.borrow(), vec![7]);
                assert_eq!(take_deferred(), vec![3, 5]);
                assert!(defer_flush(9));
                1
            },
            |p| flushed.borrow_mut().push(p),
        );
        assert_eq!(r, 1);
        assert_eq!(*flushed.borrow(), vec![7, 9]);
        assert!(!defer_flush(3));
    }

    #[test]
    fn standby_is_called_once_and_only_inside() {
        let standby = Arc::new(Standby::default());
        let s2 = standby.clone();
        // Parks until called: the call is a flag checked under the
        // signal's lock, so it is seen however the two threads interleave.
        // A lost call ends the park at the (long) timeout without one.
        let waiter =
            std::thread::spawn(move || s2.park(&AtomicBool::new(false), Duration::from_secs(120)));
        before_blocking(); // outside: nothing
        assert!(!standby.called.load(Ordering::SeqCst));
        let r = with_standby(standby.clone(), || {
            before_blocking();
            before_blocking();
            7
        });
        assert_eq!(r, 7);
        assert!(waiter.join().unwrap(), "woken by the call");
        assert!(!standby.called.load(Ordering::SeqCst), "call consumed");
        assert!(STANDBY.with(|h| h.borrow().is_none()));
        assert!(!take_blocked());
    }
}
