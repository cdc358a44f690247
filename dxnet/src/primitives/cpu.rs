//! The CPU the calling thread runs on, as a hint for structures kept per
//! CPU (flow-control credit slots, a connection's outgoing rings).
//!
//! A hint only: the thread may move right after. Every user must stay
//! correct for any value (slower, never wrong).

/// The calling thread's CPU number. (glibc answers from the
/// restartable-sequences area the kernel keeps per thread: a load.)
#[cfg(all(target_os = "linux", not(loom)))]
#[inline]
pub fn current() -> usize {
    // SAFETY: `sched_getcpu` takes no arguments and touches no memory of
    // ours; it returns -1 on error, mapped to CPU 0.
    let cpu = unsafe { libc::sched_getcpu() };
    cpu.max(0) as usize
}

/// Without a cheap CPU number: a number per thread, handed out in the
/// order threads first ask, so threads spread over the per-CPU structures
/// as they would over CPUs.
#[cfg(all(not(target_os = "linux"), not(loom)))]
#[inline]
pub fn current() -> usize {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static CPU: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    CPU.with(|c| {
        if c.get() == usize::MAX {
            c.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        c.get()
    })
}

/// Under loom: a number per model thread, in the order they first ask
/// (reset for every execution of the model).
#[cfg(loom)]
pub fn current() -> usize {
    use super::sync::{AtomicU64, Ordering};
    use std::cell::Cell;
    loom::lazy_static! {
        static ref NEXT: AtomicU64 = AtomicU64::new(0);
    }
    loom::thread_local! {
        static CPU: Cell<usize> = Cell::new(usize::MAX);
    }
    CPU.with(|c| {
        if c.get() == usize::MAX {
            c.set(NEXT.fetch_add(1, Ordering::Relaxed) as usize);
        }
        c.get()
    })
}
