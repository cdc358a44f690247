//! One reader at a time for a source that a regular reader polls and that
//! other threads may read for a while in its place (a requester reading its
//! own connection while it waits, see the TCP engine's `lease.rs`).
//!
//! Neither side waits for the other: a thread that finds the lease held
//! leaves the reading to its holder. The regular reader, which goes on to
//! other sources, leaves a note (`missed`) and looks once more; a holder
//! that lets go learns of such a note from [`Lease::release`] and hands the
//! source back to the regular reader. So a readiness that the regular
//! reader skipped while the lease was held is never lost: either its
//! second look took the lease, or the holder sees the note. The loom model
//! below checks that.

use super::sync::{fence, AtomicBool, Ordering};

/// The right to read one source.
#[derive(Debug, Default)]
pub struct ReadLease {
    held: AtomicBool,
    /// The regular reader found the lease held and left the source.
    missed: AtomicBool,
}

/// A held [`ReadLease`]. Dropping it lets go without looking at notes:
/// right for the regular reader (the only one that leaves notes); other
/// holders call [`Lease::release`].
#[derive(Debug)]
pub struct Lease<'a> {
    lease: &'a ReadLease,
}

impl ReadLease {
    /// A lease nobody holds.
    pub fn new() -> Self {
        Self::default()
    }

    /// The lease, unless another thread holds it (never waits).
    pub fn try_take(&self) -> Option<Lease<'_>> {
        self.held
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Lease { lease: self })
    }

    /// For the regular reader: the lease, or `None` if another thread holds
    /// it, which then learns from [`Lease::release`] that the source was
    /// left to it.
    pub fn take_or_note(&self) -> Option<Lease<'_>> {
        if let Some(l) = self.try_take() {
            return Some(l);
        }
        self.missed.store(true, Ordering::SeqCst);
        // Pairs with the fence in `release`: either this second look sees
        // the lease free, or the holder's look at `missed` sees the note.
        fence(Ordering::SeqCst);
        let l = self.try_take()?;
        self.missed.store(false, Ordering::Relaxed);
        Some(l)
    }
}

impl Lease<'_> {
    /// Lets go; true if the regular reader left the source to this holder
    /// meanwhile (the caller must have it look at the source again).
    pub fn release(self) -> bool {
        let lease = self.lease;
        std::mem::forget(self);
        lease.held.store(false, Ordering::Release);
        fence(Ordering::SeqCst);
        lease.missed.swap(false, Ordering::SeqCst)
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.lease.held.store(false, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time_and_notes_reach_the_holder() {
        let l = ReadLease::new();
        let a = l.try_take().expect("free");
        assert!(l.try_take().is_none());
        assert!(l.take_or_note().is_none());
        assert!(a.release(), "the regular reader's note is reported");
        let b = l.take_or_note().expect("free again");
        drop(b);
        let c = l.try_take().expect("free after drop");
        assert!(!c.release(), "no note: nobody found it held");
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::primitives::sync::{thread, Arc};

    /// A holder letting go while the regular reader looks: the reader gets
    /// the lease, or the holder learns that it must hand the source back.
    #[test]
    fn loom_a_skipped_source_reaches_someone() {
        loom::model(|| {
            let l = Arc::new(ReadLease::new());
            let holder = {
                let l = l.clone();
                thread::spawn(move || {
                    let lease = l.try_take();
                    lease.map(|g| g.release())
                })
            };
            let reader = l.take_or_note().is_some();
            let released = holder.join().unwrap();
            match released {
                // The holder never had it: the reader held it meanwhile.
                None => {}
                Some(noted) => assert!(
                    reader || noted,
                    "the reader left the source and the holder was not told"
                ),
            }
        });
    }
}
