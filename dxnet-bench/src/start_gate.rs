//! A start line for a benchmark's worker threads that the spawning thread
//! can also call off.
//!
//! A `std::sync::Barrier` over the workers and the spawning thread hangs
//! when a spawn fails partway (thread limit, memory): the spawning thread
//! returns the error, the scope joins the workers already spawned, and
//! those wait at the barrier for threads that never came. With a
//! [`StartGate`] the spawning thread holds an [`Opener`]; dropping it
//! without [`Opener::open`] (any early return) sends the waiting workers
//! home instead.

use std::sync::{Condvar, Mutex, MutexGuard};

/// Where the gate stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stand {
    Closed,
    Open,
    CalledOff,
}

#[derive(Debug)]
struct State {
    stand: Stand,
    /// Workers at the gate.
    arrived: usize,
}

/// Workers wait at the gate ([`StartGate::wait`]) until the holder of its
/// [`Opener`] opens it (all of them at once) or calls it off.
#[derive(Debug)]
pub struct StartGate {
    state: Mutex<State>,
    changed: Condvar,
}

impl Default for StartGate {
    fn default() -> Self {
        Self::new()
    }
}

impl StartGate {
    /// A closed gate with nobody at it.
    pub fn new() -> StartGate {
        StartGate {
            state: Mutex::new(State {
                stand: Stand::Closed,
                arrived: 0,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking worker cannot leave the state half-changed: every
        // change is one field store.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The handle that opens the gate; calls it off when dropped unopened.
    pub fn opener(&self) -> Opener<'_> {
        Opener {
            gate: self,
            opened: false,
        }
    }

    /// Waits at the gate: true once it opens, false if it was called off
    /// (the worker should return without doing its part).
    pub fn wait(&self) -> bool {
        let mut s = self.lock();
        s.arrived += 1;
        self.changed.notify_all();
        loop {
            match s.stand {
                Stand::Open => return true,
                Stand::CalledOff => return false,
                Stand::Closed => {
                    s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }
}

/// Opens or calls off a [`StartGate`] (see [`StartGate::opener`]).
#[derive(Debug)]
pub struct Opener<'a> {
    gate: &'a StartGate,
    opened: bool,
}

impl Opener<'_> {
    /// Waits until `workers` threads are at the gate, then lets them all
    /// go.
    pub fn open(mut self, workers: usize) {
        let mut s = self.gate.lock();
        while s.arrived < workers {
            s = self.gate.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.stand = Stand::Open;
        self.opened = true;
        self.gate.changed.notify_all();
    }
}

impl Drop for Opener<'_> {
    fn drop(&mut self) {
        if !self.opened {
            self.gate.lock().stand = Stand::CalledOff;
            self.gate.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_start_together_once_all_arrived() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let gate = StartGate::new();
        let opening = AtomicBool::new(false);
        std::thread::scope(|s| {
            let opener = gate.opener();
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        let go = gate.wait();
                        // Nobody passes before the opener decided to open.
                        assert!(opening.load(Ordering::SeqCst));
                        go
                    })
                })
                .collect();
            opening.store(true, Ordering::SeqCst);
            opener.open(8);
            for h in handles {
                assert!(h.join().unwrap());
            }
        });
    }

    #[test]
    fn an_unopened_gate_sends_the_waiting_workers_home() {
        let gate = StartGate::new();
        // As after a failed spawn: the spawning side returns early with
        // its opener, and the scope joins the workers already waiting.
        let outcome = std::thread::scope(|s| -> Result<(), &str> {
            let _opener = gate.opener();
            for _ in 0..4 {
                s.spawn(|| assert!(!gate.wait()));
            }
            Err("the fifth spawn failed")
        });
        assert_eq!(outcome, Err("the fifth spawn failed"));
        // A worker arriving after the call-off does not wait either.
        assert!(!gate.wait());
    }
}
