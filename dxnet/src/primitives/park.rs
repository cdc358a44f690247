//! Load-adaptive idling for internal threads: busy-poll, then yield, then
//! park until woken.
//!
//! A busy node keeps its threads spinning (no wake-up latency: waking a
//! sleeping thread costs 3–55 µs on small VMs); an idle node parks them so it
//! uses no CPU. [`Signal`] is the wake-up side: producers call
//! [`Signal::notify_one`], which costs one atomic load when nobody sleeps.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::config::ParkConfig;
use crate::primitives::sync;

/// What an idle thread should do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdlePhase {
    /// Busy-poll again (a `spin_loop` hint).
    Spin,
    /// Give the core away for a moment.
    Yield,
    /// Sleep until woken (or `max_park` passes).
    Park,
}

/// Threads of this process busy-polling or yielding right now.
static SPINNING: AtomicUsize = AtomicUsize::new(0);

/// How many threads of this process may busy-poll at once.
///
/// Spinning only helps while a core is free: with more runnable threads than
/// cores, a spinning thread takes the core from the very thread that would
/// produce its work (measured here: a 64-byte round trip between two
/// processes on two cores took 340 µs with every thread spinning 50 µs
/// without yielding, and 20 µs with none spinning). So idle threads spin
/// only within a budget, `park.max_spinning` or, by default, half of the
/// cores (at least one), they give the core away every few polls, and one
/// that finds its core wanted by another thread parks, and parks at once
/// for a while after (see [`CONTENDED_YIELD`]).
fn spin_budget(cfg: &ParkConfig) -> usize {
    cfg.max_spinning.unwrap_or_else(|| (cores() / 2).max(1))
}

/// A `sched_yield` that took at least this long ran another thread for a
/// while: a thread of this or another process works on the core, so an
/// idle thread stops spinning and parks rather than share the core with
/// it. One that returns sooner found nothing else runnable, or only
/// threads that ran briefly: requesters waiting for their responses, which
/// yield between two looks ([`yield_spin`]) and take a few microseconds per
/// turn. Spinning costs nobody much then, and saves the wake-up (3–55 µs on
/// small VMs, where a halted virtual CPU must be woken by an interrupt).
/// Measured on two cores (`dxnet-bench --bindings dxnet-tcp --operations
/// pingpong --sizes 64 --threads 1,2,4,16,100`, interleaved rounds, against
/// 10 µs): 1.24–1.48× the round trips with 2 requesters, 1.07–1.35× with 4,
/// 1.29–1.35× with 16, one requester and 100 within the noise; 64 B
/// throughput with 1–4 senders per node both ways 0.9–1.0×, uni-directional
/// and 16 senders unchanged.
pub const CONTENDED_YIELD: Duration = Duration::from_micros(100);

/// After a yield that ran another thread, the idle periods of the next
/// this long park at once (under steady load every yield would find the
/// core wanted; one look per period is enough to notice when it is not).
const CONTENDED_BACKOFF: Duration = Duration::from_micros(250);

/// Spin-phase polls between two yields.
const POLLS_PER_YIELD: u32 = 16;

/// Gives the core away; true if another thread ran meanwhile (the yield
/// took [`CONTENDED_YIELD`] or longer).
fn yield_contended() -> bool {
    let t = Instant::now();
    std::thread::yield_now();
    t.elapsed() >= CONTENDED_YIELD
}

/// Whether a thread's idle periods end soon enough for spinning through
/// them to pay (`park.adaptive`).
///
/// Spinning through an idle period costs its whole length in CPU time;
/// parking costs a wake-up (3–55 µs on small VMs, on both the waking and
/// the woken side). So a thread spins while most of its recent idle
/// periods ended within the spin window (`park.spin_us`), whether it spun
/// or parked through them, and parks at once otherwise: at moderate rates
/// (a message every 100 µs) a spinning receive thread took a whole core.
/// Every [`SpinPayoff::PROBE_EVERY`]-th period spins anyway, so a rising
/// rate is noticed even where a parked period's wake-up would push it
/// past the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpinPayoff {
    /// Moving average (weight 1/8) of the periods that ended within the
    /// window, out of [`SpinPayoff::FULL`].
    score: u32,
    /// Idle periods recorded (for the probes).
    periods: u32,
}

impl Default for SpinPayoff {
    fn default() -> Self {
        Self::new()
    }
}

impl SpinPayoff {
    const FULL: u32 = 256;
    /// One idle period in this many spins whatever the score.
    pub const PROBE_EVERY: u32 = 16;

    /// A thread that has not idled yet spins (a new thread is most often
    /// started into work).
    pub const fn new() -> Self {
        Self {
            score: Self::FULL,
            periods: 0,
        }
    }

    /// Records an idle period of length `idle` against the spin window.
    pub fn record(&mut self, idle: Duration, window: Duration) {
        let hit = if idle < window { Self::FULL / 8 } else { 0 };
        self.score = self.score - self.score / 8 + hit;
        self.periods = self.periods.wrapping_add(1);
    }

    /// Whether the next idle period may spin.
    pub fn spin_next(&self) -> bool {
        self.score >= Self::FULL / 2 || self.periods.is_multiple_of(Self::PROBE_EVERY)
    }
}

/// Per-thread idle state machine: call [`Idle::reset`] after finding work and
/// [`Idle::phase`] after finding none.
#[derive(Debug)]
pub struct Idle {
    spin: Duration,
    yield_until: Duration,
    /// Longest single park (a safety net; wakes are explicit).
    pub max_park: Duration,
    idle_since: Option<Instant>,
    polls: u32,
    phase: IdlePhase,
    budget: usize,
    /// Holds one unit of the process-wide spinning budget.
    spinning: bool,
    /// A yield ran another thread: no spinning before then.
    contended_until: Option<Instant>,
    /// `park.adaptive`: whether spinning pays for this thread now (`None`:
    /// every idle period may spin).
    payoff: Option<SpinPayoff>,
    /// This idle period may spin (decided at its start).
    period_spins: bool,
}

impl Drop for Idle {
    fn drop(&mut self) {
        self.release();
    }
}

impl Idle {
    /// Idle state from the configured thresholds.
    pub fn new(cfg: &ParkConfig) -> Self {
        Self {
            spin: Duration::from_micros(cfg.spin_us),
            yield_until: Duration::from_micros(cfg.yield_us.max(cfg.spin_us)),
            max_park: Duration::from_millis(cfg.max_park_ms.max(1)),
            idle_since: None,
            polls: 0,
            phase: IdlePhase::Spin,
            budget: spin_budget(cfg),
            spinning: false,
            contended_until: None,
            payoff: cfg.adaptive.then(SpinPayoff::new),
            period_spins: true,
        }
    }

    /// Idle state that never spins: parks as soon as it finds no work.
    pub fn parking(cfg: &ParkConfig) -> Self {
        Self {
            budget: 0,
            payoff: None,
            ..Self::new(cfg)
        }
    }

    fn release(&mut self) {
        if self.spinning {
            self.spinning = false;
            SPINNING.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Takes a unit of the spinning budget; false if none is left.
    fn acquire(&mut self) -> bool {
        if self.spinning {
            return true;
        }
        let mut cur = SPINNING.load(Ordering::Relaxed);
        while cur < self.budget {
            match SPINNING.compare_exchange_weak(cur, cur + 1, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    self.spinning = true;
                    return true;
                }
                Err(c) => cur = c,
            }
        }
        false
    }

    /// Work was found: start the next idle period from the spin phase.
    /// (After an idle period, with `park.adaptive`, one clock reading to
    /// record how long it lasted.)
    #[inline]
    pub fn reset(&mut self) {
        if let (Some(since), Some(p)) = (self.idle_since, self.payoff.as_mut()) {
            p.record(since.elapsed(), self.spin);
        }
        self.idle_since = None;
        self.polls = 0;
        self.phase = IdlePhase::Spin;
        self.release();
    }

    /// No work was found: which phase the thread is in now. Reads the clock
    /// only every 64 polls to keep busy-polling cheap. A thread waiting for
    /// a response ([`RequestWait`]) takes its unit over the budget: idle
    /// threads then park in its favour (its wait is on the critical path).
    pub fn phase(&mut self) -> IdlePhase {
        self.polls = self.polls.wrapping_add(1);
        if self.polls & 63 == 1 {
            if self.spinning && SPINNING.load(Ordering::Relaxed) > self.budget {
                self.release();
            }
            let now = Instant::now();
            let since = match self.idle_since {
                Some(t) => t,
                None => {
                    self.idle_since = Some(now);
                    self.period_spins = self.payoff.is_none_or(|p| p.spin_next());
                    now
                }
            };
            let idle = now.saturating_duration_since(since);
            let contended = self.contended_until.is_some_and(|t| now < t);
            self.phase =
                if idle < self.yield_until && self.period_spins && !contended && self.acquire() {
                    if idle < self.spin {
                        IdlePhase::Spin
                    } else {
                        IdlePhase::Yield
                    }
                } else {
                    self.release();
                    IdlePhase::Park
                };
        }
        self.phase
    }

    /// Runs the spin or yield step for `phase`; returns true if the caller
    /// should park now. A spin step yields every [`POLLS_PER_YIELD`] polls
    /// (the first one included) and a yield step every poll; a yield that
    /// ran another thread ends the spinning (the caller parks, see
    /// [`CONTENDED_YIELD`]).
    #[inline]
    pub fn step(&mut self) -> bool {
        self.step_with(yield_contended)
    }

    /// [`Idle::step`] with the yield given (tests pass one that reports
    /// contention or not).
    #[inline]
    fn step_with(&mut self, yield_now: impl FnOnce() -> bool) -> bool {
        let contended = match self.phase() {
            IdlePhase::Spin => {
                // From the first poll on: a busy core is noticed at once.
                if self.polls % POLLS_PER_YIELD == 1 {
                    yield_now()
                } else {
                    std::hint::spin_loop();
                    false
                }
            }
            IdlePhase::Yield => yield_now(),
            IdlePhase::Park => return true,
        };
        if contended {
            self.phase = IdlePhase::Park;
            self.contended_until = Some(Instant::now() + CONTENDED_BACKOFF);
            self.release();
        }
        contended
    }
}

/// How often a thread that busy-waits for another thread's progress gives
/// its core away (`sched_yield`, which returns at once when nothing else is
/// runnable there). A thread woken onto a spinner's core, often the very
/// one that carries what the spinner waits for, otherwise waits until the
/// scheduler preempts the spinner: up to a time slice. Measured
/// (`dxnet-bench --bindings dxnet-tcp --operations pingpong --sizes 64
/// --threads 1,2`, two cores, interleaved rounds): with two requester
/// threads, one of them spinning without yielding, p99 was 1.1 ms (the
/// slice) and the rate 0.5× that of one thread; yielding every 3 µs gave
/// p99 0.14 ms and 0.95×, one thread unchanged.
pub const SPIN_YIELD_EVERY: Duration = Duration::from_micros(3);

/// Waits for `done` without parking until `until`, giving the core away
/// (`sched_yield`) between two looks; true if `done` came.
///
/// For a thread that has nothing to do but look (a requester that does not
/// read its connection itself). Each yield lets any runnable thread of the
/// core go first, often the one that carries what the waiter waits for,
/// and returns at once when there is none, so the waiter costs the others
/// a system call and a switch per turn, never a slice of busy polling;
/// and the core stays awake, so the response needs no wake-up. Measured on
/// two cores (`dxnet-bench --bindings dxnet-tcp --operations pingpong
/// --sizes 64 --threads 16,100`, interleaved rounds): against busy polls
/// with a yield every [`SPIN_YIELD_EVERY`], 1.2–1.35× the round trips with
/// 16 requesters at 0.8× the CPU time per round trip.
pub fn yield_spin(until: Instant, mut done: impl FnMut() -> bool) -> bool {
    loop {
        if done() {
            return true;
        }
        std::thread::yield_now();
        if Instant::now() >= until {
            return done();
        }
    }
}

/// One busy-wait until a deadline, giving the core away every
/// [`SPIN_YIELD_EVERY`]. The caller polls its condition and calls
/// [`YieldingSpin::expired`] now and then (it reads the clock).
#[derive(Debug)]
pub struct YieldingSpin {
    until: Instant,
    /// Set at the first look at the clock (no clock read for a wait that
    /// ends before it).
    next_yield: Option<Instant>,
}

impl YieldingSpin {
    /// A busy-wait that may last until `until`.
    pub fn until(until: Instant) -> Self {
        Self {
            until,
            next_yield: None,
        }
    }

    /// True once `until` has passed; otherwise yields the core if due.
    #[inline]
    pub fn expired(&mut self) -> bool {
        let now = Instant::now();
        if now >= self.until {
            return true;
        }
        match self.next_yield {
            None => self.next_yield = Some(now + SPIN_YIELD_EVERY),
            Some(t) if now >= t => {
                std::thread::yield_now();
                self.next_yield = Some(Instant::now() + SPIN_YIELD_EVERY);
            }
            Some(_) => {}
        }
        false
    }
}

/// Threads of the process blocked in a request right now (spinning or
/// parked).
static REQUEST_WAITERS: AtomicUsize = AtomicUsize::new(0);

/// Of those, the ones allowed to wait without parking (until they stop
/// spinning).
static REQUEST_SPINNERS: AtomicUsize = AtomicUsize::new(0);

fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Threads of the process blocked in a request right now.
pub fn request_waiters() -> usize {
    REQUEST_WAITERS.load(Ordering::Relaxed)
}

/// Up to how many blocked requesters may wait without parking
/// (`park.max_request_spinners`; by default all of them).
///
/// A waiting requester reads its connection (the engine's
/// `read_while_waiting`, one at a time) or yields between two looks at its
/// slot ([`yield_spin`]), so it gives its core to any thread that has work
/// at once, and its response needs no wake-up: on a small virtual machine
/// a wake-up onto a halted core is the dearest step of a loopback round
/// trip. Each waits only its request's spin time
/// ([`RequestSpinPolicy`]), so the CPU it spends is bounded. Measured on
/// two cores (`dxnet-bench --bindings dxnet-tcp --operations pingpong
/// --sizes 64 --threads 32,100,250`, interleaved rounds, against raw-tcp):
/// all waiting gave 1.2×, 1.9× and 2.4× raw-tcp's round trips; at most 64
/// per core waiting (the others parked, woken by their responses) 1.2×,
/// 1.6× and 1.5×.
fn request_spin_budget(cfg: &ParkConfig) -> usize {
    cfg.max_request_spinners.unwrap_or(usize::MAX)
}

/// A thread blocked in a request, counted until the guard drops. It may
/// wait without parking ([`RequestWait::may_spin`]) only if at most
/// `park.max_request_spinners` requesters were blocked when it came; then it
/// holds a unit of the spinning budget, even over the idle threads' budget
/// (see [`Idle::phase`]), until [`RequestWait::stop_spinning`] or drop.
#[derive(Debug)]
pub struct RequestWait {
    spinning: bool,
}

impl RequestWait {
    /// Registers the calling thread as a blocked requester.
    pub fn enter(cfg: &ParkConfig) -> Self {
        let waiters = REQUEST_WAITERS.fetch_add(1, Ordering::Relaxed) + 1;
        let spinning = waiters <= request_spin_budget(cfg);
        if spinning {
            SPINNING.fetch_add(1, Ordering::Relaxed);
            REQUEST_SPINNERS.fetch_add(1, Ordering::Relaxed);
        }
        RequestWait { spinning }
    }

    /// Threads of the process blocked in a request that do not wait
    /// without parking
    /// (they parked, or are about to): someone must receive their
    /// responses. Approximate (two counters read one after the other).
    pub fn parked() -> usize {
        let spinners = REQUEST_SPINNERS.load(Ordering::Relaxed);
        REQUEST_WAITERS
            .load(Ordering::Relaxed)
            .saturating_sub(spinners)
    }

    /// Whether this requester may wait without parking.
    pub fn may_spin(&self) -> bool {
        self.spinning
    }

    /// Gives the spinning unit back (before parking).
    pub fn stop_spinning(&mut self) {
        if std::mem::take(&mut self.spinning) {
            SPINNING.fetch_sub(1, Ordering::Relaxed);
            REQUEST_SPINNERS.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for RequestWait {
    fn drop(&mut self) {
        self.stop_spinning();
        REQUEST_WAITERS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A wake-up signal for threads that park while waiting for a condition.
///
/// Protocol (no lost wake-ups; the loom models below check it): the waiter
/// registers as sleeper (SeqCst, then a SeqCst fence), takes the lock,
/// re-checks its condition, then waits; the notifier publishes its work
/// first, then (after a SeqCst fence) notifies only if a sleeper is
/// registered, under the lock. The two fences order each side's store
/// before its load: either the notifier sees the sleeper or the waiter's
/// re-check sees the work.
///
/// Atomics, lock and condition variable come from [`sync`]: std's and
/// parking_lot's normally, loom's under `--cfg loom`.
pub struct Signal {
    sleepers: sync::AtomicUsize,
    lock: sync::SleepMutex<()>,
    cv: sync::SleepCondvar,
}

impl std::fmt::Debug for Signal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signal")
            .field("sleepers", &self.sleepers())
            .finish()
    }
}

impl Default for Signal {
    fn default() -> Self {
        Self::new()
    }
}

impl Signal {
    /// A signal nobody waits on yet.
    pub fn new() -> Self {
        Self {
            sleepers: sync::AtomicUsize::new(0),
            lock: sync::SleepMutex::new(()),
            cv: sync::SleepCondvar::new(),
        }
    }

    /// Threads parked (or about to park) on this signal now.
    pub fn sleepers(&self) -> usize {
        self.sleepers.load(sync::Ordering::SeqCst)
    }

    /// Wakes one sleeping waiter, if any (one atomic load otherwise).
    #[inline]
    pub fn notify_one(&self) {
        sync::fence(sync::Ordering::SeqCst);
        if self.sleepers.load(sync::Ordering::SeqCst) > 0 {
            let _g = sync::sleep_lock(&self.lock);
            self.cv.notify_one();
        }
    }

    /// Wakes all sleeping waiters, if any.
    #[inline]
    pub fn notify_all(&self) {
        sync::fence(sync::Ordering::SeqCst);
        if self.sleepers.load(sync::Ordering::SeqCst) > 0 {
            let _g = sync::sleep_lock(&self.lock);
            self.cv.notify_all();
        }
    }

    /// Parks until `ready()` is true, a notify arrives, or `timeout` passes
    /// (no timeout under loom: a lost wake-up is a deadlock in the model).
    /// Returns `ready()` as seen last. Spurious returns are allowed: callers
    /// loop.
    pub fn park_unless(&self, ready: impl Fn() -> bool, timeout: Duration) -> bool {
        self.sleepers.fetch_add(1, sync::Ordering::SeqCst);
        // Pairs with the notifier's fence (see the type's docs): the
        // read-modify-write alone does not order the re-check below after
        // it in the language's memory model (it does on x86).
        sync::fence(sync::Ordering::SeqCst);
        let mut g = sync::sleep_lock(&self.lock);
        let r = ready();
        if !r {
            g = sync::sleep_until(&self.cv, g, Instant::now() + timeout);
        }
        drop(g);
        self.sleepers.fetch_sub(1, sync::Ordering::SeqCst);
        r || ready()
    }

    /// Waits adaptively (spin, yield, park) until `ready()` is true or the
    /// deadline passes; returns whether it became ready.
    pub fn wait_until(
        &self,
        cfg: &ParkConfig,
        deadline: Instant,
        ready: impl Fn() -> bool,
    ) -> bool {
        if ready() {
            return true;
        }
        crate::primitives::before_blocking();
        let mut idle = Idle::new(cfg);
        loop {
            if ready() {
                return true;
            }
            if idle.step() {
                let now = Instant::now();
                if now >= deadline {
                    return ready();
                }
                let t = (deadline - now).min(idle.max_park);
                if self.park_unless(&ready, t) {
                    return true;
                }
            } else if idle.polls.is_multiple_of(256) && Instant::now() >= deadline {
                return ready();
            }
        }
    }
}

/// Decides how long blocking requests to one peer wait without parking for their
/// responses (one per connection; see `Core::wait_response`).
///
/// A response that comes while its requester spins needs no wake-up; one
/// that comes after it parked costs a chain of them (armed completion
/// channel, receive thread, requester), which took 1–2 ms in the Soft-RoCE
/// VM. So requests wait up to `park.request_spin_max_us` while that mostly
/// pays off, i.e. while at least half of the recent full-length waits got
/// their response; to a slow peer (slow handlers, a congested link) they
/// wait `park.request_spin_us` only, except every [`Self::PROBE_EVERY`]-th
/// request, which waits the full length to see whether the peer got fast
/// again. Measured in the Soft-RoCE VM (dxnet-bench pingpong, same run):
/// the previous rule, 4× an estimate of the 80th percentile of the round
/// trips (~0.3 ms), parked ~5 % of the round trips (p95 0.7–1.6 ms); worse,
/// the estimate included parked round trips, so after a slow start it
/// could stay high, wait 50 µs and keep parking. Waiting 1 ms cut the mean
/// round trip ~2×, p99 ~4×.
#[derive(Debug)]
pub struct RequestSpinPolicy {
    /// Share of recent full-length waits (and of shorter ones that were
    /// answered) that got their response, in 1/65536: an exponential
    /// moving average over about 16 requests. Starts at "all".
    answered: AtomicU32,
    /// Requests made while the peer counts as slow (for the probes).
    slow_requests: AtomicU32,
}

/// 1.0 in [`RequestSpinPolicy::answered`]'s fixed point.
const ALL: u32 = 1 << 16;

impl Default for RequestSpinPolicy {
    fn default() -> Self {
        Self {
            answered: AtomicU32::new(ALL),
            slow_requests: AtomicU32::new(0),
        }
    }
}

impl RequestSpinPolicy {
    /// Every how many requests to a slow peer one waits the full length.
    pub const PROBE_EVERY: u32 = 8;

    /// The full-length wait: `park.request_spin_max_us` (at least
    /// `park.request_spin_us`); also the wait when no policy applies yet.
    pub fn full(park: &ParkConfig) -> Duration {
        Duration::from_micros(park.request_spin_max_us.max(park.request_spin_us))
    }

    /// How long the next request busy-waits.
    pub fn spin(&self, park: &ParkConfig) -> Duration {
        if self.answered.load(Ordering::Relaxed) >= ALL / 2
            || self
                .slow_requests
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(Self::PROBE_EVERY)
        {
            Self::full(park)
        } else {
            Duration::from_micros(park.request_spin_us)
        }
    }

    /// Records how a busy-wait of `spun` ended: `answered` if the response
    /// came meanwhile. A wait shorter than [`Self::full`] without response
    /// says nothing about whether a full one would have paid, so it is not
    /// counted. Concurrent updates may lose one another's step; that only
    /// slows the average.
    pub fn record(&self, park: &ParkConfig, spun: Duration, answered: bool) {
        if !answered && spun < Self::full(park) {
            return;
        }
        let old = self.answered.load(Ordering::Relaxed);
        let new = if answered {
            old + (ALL - old) / 16
        } else {
            old - old / 16
        };
        self.answered.store(new, Ordering::Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    /// Spins of `n` requests to a peer answering within `rtt` (`None`: not
    /// within any wait), as the requester would record them.
    fn requests(p: &RequestSpinPolicy, n: usize, rtt: Option<Duration>) -> Vec<Duration> {
        (0..n)
            .map(|_| {
                let spin = p.spin(&park(50, 1000));
                p.record(&park(50, 1000), spin, rtt.is_some_and(|r| r <= spin));
                spin
            })
            .collect()
    }

    fn park(request_spin_us: u64, request_spin_max_us: u64) -> ParkConfig {
        ParkConfig {
            request_spin_us,
            request_spin_max_us,
            ..ParkConfig::default()
        }
    }

    #[test]
    fn request_spin_waits_long_for_fast_peers_only() {
        let us = Duration::from_micros;
        let p = RequestSpinPolicy::default();
        // Unknown peer: the full wait. A slow first round trip (connection
        // set-up) does not make a fast peer slow.
        assert_eq!(requests(&p, 1, None), [us(1000)]);
        let fast = requests(&p, 1000, Some(us(60)));
        assert!(fast.iter().all(|&s| s == us(1000)));
        // The peer gets slow: within a few requests only the probes wait
        // long, one in PROBE_EVERY.
        let slow = requests(&p, 800, Some(us(20_000)));
        let long = slow[100..].iter().filter(|&&s| s == us(1000)).count();
        assert!((87..=88).contains(&long), "{long} full waits in 700");
        assert!(slow[100..].iter().all(|&s| s == us(50) || s == us(1000)));
        // Its short waits (never answered) do not count; the probes do:
        // when it is fast again (60 µs: longer than the short wait, so only
        // probes see it) it is waited for in full again.
        let back = requests(&p, 400, Some(us(60)));
        assert!(
            back[300..].iter().all(|&s| s == us(1000)),
            "recovered within 300 requests"
        );
        // A peer slower than every wait, from the start: mostly short waits.
        let p = RequestSpinPolicy::default();
        let slow = requests(&p, 400, None);
        let long = slow.iter().filter(|&&s| s == us(1000)).count();
        assert!(
            long <= 16 + 400 / RequestSpinPolicy::PROBE_EVERY as usize,
            "{long} full waits"
        );
        // Short waits answered in time count as answered: a slow peer that
        // gets very fast is waited for in full again without probes.
        let p = RequestSpinPolicy::default();
        requests(&p, 100, None);
        let spins = requests(&p, 100, Some(us(10)));
        assert_eq!(spins[50..], [us(1000); 50]);
        // A maximum below the minimum is raised to it.
        assert_eq!(RequestSpinPolicy::default().spin(&park(200, 100)), us(200));
    }

    #[test]
    fn yield_spin_returns_when_done_or_at_its_deadline() {
        let far = Instant::now() + Duration::from_secs(60);
        let mut looks = 0;
        assert!(yield_spin(far, || {
            looks += 1;
            looks == 3
        }));
        assert_eq!(looks, 3, "one look per turn until done");
        let past = Instant::now();
        assert!(!yield_spin(past, || false), "not done by the deadline");
        assert!(yield_spin(past, || true), "done at the first look");
    }

    #[test]
    fn yielding_spin_ends_at_its_deadline() {
        assert!(YieldingSpin::until(Instant::now()).expired());
        let mut long = YieldingSpin::until(Instant::now() + Duration::from_secs(3600));
        assert!((0..1000).all(|_| !long.expired()));
    }

    #[test]
    fn spinning_stops_while_idle_periods_outlast_the_window() {
        let window = Duration::from_micros(50);
        let mut p = SpinPayoff::new();
        assert!(p.spin_next(), "a new thread spins");
        // Periods of 100 µs (a message every 100 µs): parks after a few,
        // but spins for one period in PROBE_EVERY.
        let mut spins = 0;
        for _ in 0..(10 * SpinPayoff::PROBE_EVERY) {
            p.record(Duration::from_micros(100), window);
            spins += p.spin_next() as u32;
        }
        assert!(!p.spin_next() || p.periods.is_multiple_of(SpinPayoff::PROBE_EVERY));
        assert!(spins <= 10 + 8, "{spins} periods spun");
        // Short periods again (a busy thread): spins after a few.
        for _ in 0..8 {
            p.record(Duration::from_micros(5), window);
        }
        assert!(p.spin_next());
        // Most periods short, one in four long (a busy thread that
        // sometimes waits): every period spins.
        let mut p = SpinPayoff::new();
        for i in 0..1000 {
            let d = if i % 4 == 3 { 500 } else { 5 };
            p.record(Duration::from_micros(d), window);
            assert!(p.spin_next(), "period {i}");
        }
    }

    #[test]
    fn adaptive_idle_parks_at_once_after_long_periods() {
        let cfg = ParkConfig {
            spin_us: 50,
            yield_us: 20_000_000,
            max_spinning: Some(1000),
            adaptive: true,
            ..ParkConfig::default()
        };
        let mut idle = Idle::new(&cfg);
        assert_eq!(idle.phase(), IdlePhase::Spin);
        // Long idle periods recorded (as `reset` does after each).
        for _ in 0..8 {
            idle.payoff
                .as_mut()
                .unwrap()
                .record(Duration::from_millis(1), idle.spin);
        }
        idle.idle_since = None;
        idle.reset();
        idle.payoff.as_mut().unwrap().periods = 1;
        assert_eq!(idle.phase(), IdlePhase::Park, "spinning does not pay");
        // Latency first: every period spins.
        let mut fixed = Idle::new(&ParkConfig {
            adaptive: false,
            ..cfg
        });
        assert!(fixed.payoff.is_none());
        assert_eq!(fixed.phase(), IdlePhase::Spin);
    }

    #[test]
    fn idle_progresses_to_park() {
        let mut idle = Idle::new(&ParkConfig {
            spin_us: 0,
            yield_us: 0,
            max_park_ms: 1,
            max_spinning: None,
            request_spin_us: 0,
            ..ParkConfig::default()
        });
        assert_eq!(idle.phase(), IdlePhase::Park);
        idle.reset();
        let cfg = |max| ParkConfig {
            spin_us: 1_000_000,
            yield_us: 2_000_000,
            max_park_ms: 1,
            max_spinning: Some(max),
            request_spin_us: 0,
            ..ParkConfig::default()
        };
        let mut idle = Idle::new(&cfg(usize::MAX));
        assert_eq!(idle.phase(), IdlePhase::Spin);
        idle.reset();
        // No spinning budget: park at once however long spinning is allowed.
        let mut none = Idle::new(&cfg(0));
        assert_eq!(none.phase(), IdlePhase::Park);
    }

    #[test]
    fn idle_thread_parks_once_a_yield_ran_another_thread() {
        // A budget far above what other tests hold at the same time (the
        // count is process-wide).
        let cfg = ParkConfig {
            spin_us: 10_000_000,
            yield_us: 20_000_000,
            max_spinning: Some(1000),
            ..ParkConfig::default()
        };
        let mut idle = Idle::new(&cfg);
        // Yields that find the core free: spinning goes on, yielding at the
        // first poll and every `POLLS_PER_YIELD` polls after it.
        let mut yields = 0;
        for _ in 0..(3 * POLLS_PER_YIELD) {
            assert!(!idle.step_with(|| {
                yields += 1;
                false
            }));
        }
        assert_eq!(yields, 3);
        assert!(idle.spinning);
        // A yield that ran another thread: park, and the budget is given back.
        let mut parked = false;
        for _ in 0..POLLS_PER_YIELD {
            parked = idle.step_with(|| true);
            if parked {
                break;
            }
        }
        assert!(parked);
        assert!(!idle.spinning);
        // Work found: the next idle periods park at once for a while (set
        // far ahead here, so the test does not depend on the clock), then
        // spin again.
        assert!(idle.contended_until.is_some());
        idle.contended_until = Some(Instant::now() + Duration::from_secs(3600));
        idle.reset();
        assert!(idle.step_with(|| false));
        idle.contended_until = Some(Instant::now());
        idle.reset();
        assert!(!idle.step_with(|| false));
        assert!(idle.spinning);
    }

    #[test]
    fn idle_spinners_park_in_favour_of_requesters() {
        // A budget far above what other tests hold at the same time (the
        // count is process-wide).
        const BUDGET: usize = 1000;
        let mut idle = Idle::new(&ParkConfig {
            spin_us: 10_000_000,
            yield_us: 20_000_000,
            max_spinning: Some(BUDGET),
            ..ParkConfig::default()
        });
        assert_eq!(idle.phase(), IdlePhase::Spin);
        let requesters = ParkConfig {
            max_request_spinners: Some(usize::MAX),
            ..ParkConfig::default()
        };
        let claims: Vec<_> = (0..BUDGET)
            .map(|_| RequestWait::enter(&requesters))
            .collect();
        assert!(claims.iter().all(RequestWait::may_spin));
        // The next look at the clock (every 64 polls) sees the budget
        // exceeded: the idle thread parks and gives its unit back.
        let mut phases = (0..64).map(|_| idle.phase());
        assert!(phases.any(|p| p == IdlePhase::Park));
        assert!(!idle.spinning);
        drop(claims);
        let mut phases = (0..64).map(|_| idle.phase());
        assert!(phases.any(|p| p == IdlePhase::Spin));
    }

    #[test]
    fn requesters_spin_only_while_few_are_blocked() {
        let none = ParkConfig {
            max_request_spinners: Some(0),
            ..ParkConfig::default()
        };
        assert!(!RequestWait::enter(&none).may_spin());
        let many = ParkConfig {
            max_request_spinners: Some(usize::MAX),
            ..ParkConfig::default()
        };
        let mut first = RequestWait::enter(&many);
        assert!(first.may_spin());
        first.stop_spinning();
        assert!(!first.may_spin());
        drop(first);
    }

    #[test]
    fn signal_wakes_parked_thread() {
        let sig = Arc::new(Signal::new());
        let flag = Arc::new(AtomicBool::new(false));
        let (s2, f2) = (sig.clone(), flag.clone());
        let cfg = ParkConfig {
            spin_us: 0,
            yield_us: 0,
            max_park_ms: 10_000,
            max_spinning: None,
            request_spin_us: 0,
            ..ParkConfig::default()
        };
        let t = std::thread::spawn(move || {
            s2.wait_until(&cfg, Instant::now() + Duration::from_secs(60), || {
                f2.load(Ordering::SeqCst)
            })
        });
        std::thread::sleep(Duration::from_millis(20));
        flag.store(true, Ordering::SeqCst);
        sig.notify_all();
        assert!(t.join().unwrap());
    }

    #[test]
    fn wait_until_times_out() {
        let sig = Signal::new();
        let cfg = ParkConfig::default();
        assert!(!sig.wait_until(&cfg, Instant::now() + Duration::from_millis(5), || false));
    }
}

/// Models of [`Signal`]'s wake-up protocol: in every interleaving the
/// waiters end (a lost wake-up would leave one waiting forever, which loom
/// reports as a deadlock; its condition variable has no timeout).
#[cfg(all(test, loom))]
mod loom_tests {
    use super::Signal;
    use crate::primitives::sync::{thread, Arc, AtomicUsize, Ordering};
    use std::time::Duration;

    /// Waits as the runtime's threads do: park until the work is there.
    fn wait_for(sig: &Signal, work: &AtomicUsize, at_least: usize) {
        let ready = || work.load(Ordering::Relaxed) >= at_least;
        while !sig.park_unless(ready, Duration::from_secs(1)) {}
    }

    /// One waiter, one notifier that publishes with a plain (Relaxed)
    /// store: the fences alone order it against the sleeper count.
    #[test]
    fn loom_signal_notify_one_wakes_the_waiter() {
        loom::model(|| {
            let sig = Arc::new(Signal::new());
            let work = Arc::new(AtomicUsize::new(0));
            let (s, w) = (sig.clone(), work.clone());
            let notifier = thread::spawn(move || {
                w.store(1, Ordering::Relaxed);
                s.notify_one();
            });
            wait_for(&sig, &work, 1);
            notifier.join().unwrap();
            assert_eq!(sig.sleepers(), 0);
        });
    }

    /// Two waiters, one `notify_all` after the work both wait for (with
    /// `notify_one` instead, the model deadlocks: both may be parked).
    #[test]
    fn loom_signal_notify_all_wakes_every_waiter() {
        loom::model(|| {
            let sig = Arc::new(Signal::new());
            let work = Arc::new(AtomicUsize::new(0));
            let waiters: Vec<_> = (0..2)
                .map(|_| {
                    let (s, w) = (sig.clone(), work.clone());
                    thread::spawn(move || wait_for(&s, &w, 1))
                })
                .collect();
            work.store(1, Ordering::Relaxed);
            sig.notify_all();
            for w in waiters {
                w.join().unwrap();
            }
        });
    }

    /// Two notifiers each publish a unit and `notify_one`; the waiter
    /// needs both (each wake-up may find only part of the work).
    #[test]
    fn loom_signal_waiter_sees_every_notifier() {
        loom::model(|| {
            let sig = Arc::new(Signal::new());
            let work = Arc::new(AtomicUsize::new(0));
            let notifiers: Vec<_> = (0..2)
                .map(|_| {
                    let (s, w) = (sig.clone(), work.clone());
                    thread::spawn(move || {
                        w.fetch_add(1, Ordering::Relaxed);
                        s.notify_one();
                    })
                })
                .collect();
            wait_for(&sig, &work, 2);
            for n in notifiers {
                n.join().unwrap();
            }
        });
    }
}
