//! Concurrency primitives that know nothing of messages, connections or
//! transports: the layers above (`core`, `transport`) use them, they use
//! nothing above them (plain configuration structs aside). Each is tested on its own; the lock-free ones (`orb`,
//! `write_interest`, `credit`, `wait_queue`, `in_order`, `read_lease`, `hazard`, `free_stack`) also by loom models of the same code (`sync` is the
//! std/loom shim they take their atomics from).
//!
//! - [`cpu`]: the CPU a thread runs on, a hint for per-CPU structures.
//! - [`credit`]: a window of bytes claimed by many threads, batched per CPU
//!   (flow control).
//! - [`deadline`]: a timeout that reads the clock only when a wait begins.
//! - [`hazard`]: a table of shared objects read without locked
//!   instructions (hazard pointers, `membarrier` on the writers' side).
//! - [`histogram`]: latency histograms recorded in per-thread cells
//!   (log-linear buckets, exact sums).
//! - [`in_order`]: outcomes of work a queue finishes in order (one report
//!   settles a run of items), with parking and wakers.
//! - [`mailbox`]: a bounded queue to application threads (blocking, with
//!   timeout, or async), behind pull receivers and event channels.
//! - [`orb`]: the outgoing ring buffer (lock-free, many producers, one
//!   consumer at a time).
//! - [`write_interest`]: the queue of connections with data for the send
//!   thread, each at most once, round-robin.
//! - [`prefetch`]: cache hints for lines a thread is about to write.
//! - [`pool`]: pooled, reusable receive buffers, the free ones in a
//!   [`free_stack`] (lock-free, last in first out: the buffers still in
//!   cache are used again first).
//! - [`read_lease`]: one reader at a time for a source that a regular
//!   reader polls and other threads may read in its place, no readiness
//!   lost between them.
//! - [`region_mem`]: address-stable memory of exposed regions, CPU
//!   accesses under a lock.
//! - [`park`]: load-adaptive idling (spin, yield, park) and wake-up signals.
//! - [`stats`]: per-thread counters for hot paths (one writer per cell,
//!   summed when read).
//! - [`wait_queue`]: threads blocked on ring space or flow-control window,
//!   none overtaken without bound.
//!
//! Blocking waits call a hook the runtime installs once
//! ([`set_blocking_hook`]) instead of calling up into it: the runtime uses
//! it to hand work over before a thread that runs handlers blocks.

use std::sync::OnceLock;

pub mod buffer_mem;
pub mod cpu;
pub mod credit;
pub mod deadline;
pub mod free_stack;
pub mod hazard;
pub mod histogram;
pub mod in_order;
pub mod mailbox;
pub mod orb;
pub mod park;
pub mod pool;
pub mod prefetch;
pub mod read_lease;
pub mod region_mem;
pub mod ring_notes;
pub mod stats;
pub mod sync;
pub mod wait_queue;
pub mod write_interest;

static BLOCKING_HOOK: OnceLock<fn()> = OnceLock::new();

/// Installs `hook`, called by every blocking wait of these primitives
/// before the thread parks (or spins on another thread's progress). The
/// first call wins; returns false if a hook was already installed.
pub fn set_blocking_hook(hook: fn()) -> bool {
    BLOCKING_HOOK.set(hook).is_ok()
}

/// Runs the installed blocking hook, if any.
#[inline]
pub fn before_blocking() {
    if let Some(hook) = BLOCKING_HOOK.get() {
        hook();
    }
}
