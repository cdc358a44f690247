//! The send thread every engine runs: take the connections with data to
//! write from the write-interest queue, let the engine write each, and when
//! there is none, park ([`Idle::parking`]). The engine supplies only what
//! differs ([`SendSide`]): how a connection is written, what else a round
//! does (retire completions, look at connections waiting for the peer),
//! and how it waits (a poll set, a wake-up signal).

use std::time::Duration;

use crate::core::Core;
use crate::primitives::park::Idle;

/// One engine's part of its send thread (owned by the thread: it may hold
/// per-thread state such as a poll set or a completion buffer).
pub(crate) trait SendSide {
    /// True once the engine stops.
    fn stopping(&self) -> bool;

    /// Start of every round, before the ready connections are taken.
    fn round(&mut self, _core: &Core) {}

    /// Writes what `peer`'s connection has ready.
    fn write(&mut self, core: &Core, peer: u16);

    /// The round found connections to write (`true`) or none (`false`),
    /// told before they are written and when the thread turns idle.
    fn busy(&mut self, _busy: bool) {}

    /// Ends the current round early (checked after every `write`): the
    /// engine saw a connection come up again that it left for later.
    fn round_over(&mut self) -> bool {
        false
    }

    /// The round wrote something: a chance to look at the engine's own
    /// events without waiting. Returns true if that found work.
    fn after_work(&mut self, _core: &Core) -> bool {
        false
    }

    /// Nothing to write. `park`: the idle policy says to block, for at
    /// most this long, until write interest or the engine's own events
    /// come; `None`: the thread is still spinning or yielding (the policy
    /// did that step already) and should only look without waiting.
    /// Returns true if it found work.
    fn idle(&mut self, core: &Core, park: Option<Duration>) -> bool;
}

/// Runs `side`'s send thread until it stops.
pub(crate) fn run_send_loop(side: &mut impl SendSide, core: &Core) {
    // The send thread does not spin (an engine's `idle` may stay awake a
    // bounded time under steady traffic, yielding, as TCP's does for
    // `tcp.coalesce_us`): while it is parked, requests and
    // responses are written by the threads that make them (no hop, see
    // `Core::on_urgent_write_interest`), and plain messages aggregate
    // during its wake-up.
    let mut idle = Idle::parking(core.park());
    while !side.stopping() {
        side.round(core);
        let mut worked = false;
        while let Some(peer) = core.next_write_interest() {
            if !worked {
                worked = true;
                side.busy(true);
            }
            side.write(core, peer);
            if side.round_over() {
                break;
            }
        }
        if worked {
            idle.reset();
            side.after_work(core);
            continue;
        }
        side.busy(false);
        let park = idle.step().then_some(idle.max_park);
        if side.idle(core, park) {
            idle.reset();
        }
    }
}
