//! A deadline that reads the clock only when a wait begins.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// When a blocked operation gives up.
///
/// Most sends never block, and reading the clock is a noticeable part of
/// what a small message costs its sender, so a timeout relative to "now"
/// is turned into an instant only when the first wait begins
/// ([`Deadline::get`]); from then on it stays fixed, so all waits of one
/// operation (flow-control window, then ring space) share it.
#[derive(Debug, Clone)]
pub struct Deadline {
    at: Cell<Option<Instant>>,
    timeout: Duration,
    cap: Option<Instant>,
}

impl Deadline {
    /// A fixed instant.
    pub fn at(at: Instant) -> Self {
        Deadline {
            at: Cell::new(Some(at)),
            timeout: Duration::ZERO,
            cap: None,
        }
    }

    /// `timeout` after the first [`Deadline::get`], but never later than
    /// `cap` (e.g. a request's own deadline).
    pub fn after(timeout: Duration, cap: Option<Instant>) -> Self {
        Deadline {
            at: Cell::new(None),
            timeout,
            cap,
        }
    }

    /// The instant; the first call of a relative deadline reads the clock.
    pub fn get(&self) -> Instant {
        match self.at.get() {
            Some(at) => at,
            None => self.start(Instant::now()),
        }
    }

    /// Fixes a relative deadline as measured from `now` (a clock reading
    /// the caller has anyway); a fixed one stays as it is. Returns the
    /// instant.
    pub fn start(&self, now: Instant) -> Instant {
        if let Some(at) = self.at.get() {
            return at;
        }
        let at = now + self.timeout;
        let at = self.cap.map_or(at, |cap| cap.min(at));
        self.at.set(Some(at));
        at
    }
}

impl From<Instant> for Deadline {
    fn from(at: Instant) -> Self {
        Deadline::at(at)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn relative_deadline_is_fixed_at_the_first_read() {
        let before = Instant::now();
        let d = Deadline::after(Duration::from_secs(5), None);
        let first = d.get();
        assert!(first >= before + Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(d.get(), first, "a deadline does not move once read");
    }

    #[test]
    fn cap_bounds_a_relative_deadline() {
        let cap = Instant::now() + Duration::from_millis(10);
        assert_eq!(
            Deadline::after(Duration::from_secs(5), Some(cap)).get(),
            cap
        );
        let late_cap = Instant::now() + Duration::from_secs(60);
        assert!(Deadline::after(Duration::from_secs(1), Some(late_cap)).get() < late_cap);
    }

    #[test]
    fn start_fixes_a_relative_deadline_from_the_given_reading() {
        let now = Instant::now();
        let d = Deadline::after(Duration::from_secs(5), None);
        assert_eq!(d.start(now), now + Duration::from_secs(5));
        assert_eq!(d.get(), now + Duration::from_secs(5));
        assert_eq!(
            d.start(now + Duration::from_secs(1)),
            now + Duration::from_secs(5)
        );
    }

    #[test]
    fn fixed_deadline_is_returned_as_given() {
        let at = Instant::now() + Duration::from_millis(3);
        assert_eq!(Deadline::at(at).get(), at);
        assert_eq!(Deadline::from(at).get(), at);
    }
}
