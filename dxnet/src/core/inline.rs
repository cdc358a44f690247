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

use std::cell::RefCell;

thread_local! {
    static ON_BLOCK: RefCell<Option<Box<dyn FnOnce()>>> = const { RefCell::new(None) };
}

/// Runs `f` with `on_block` installed as this thread's blocking hook; the
/// hook fires at most once, from the first blocking wait inside `f`.
pub fn with_blocking_hook<R>(on_block: impl FnOnce() + 'static, f: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            ON_BLOCK.with(|h| h.borrow_mut().take());
        }
    }
    ON_BLOCK.with(|h| *h.borrow_mut() = Some(Box::new(on_block)));
    let _reset = Reset;
    f()
}

/// Called by every blocking wait in dxnet before it parks or spins: if this
/// thread is running handlers inline for a receive thread, hand the receive
/// role to the standby now.
#[inline]
pub fn before_blocking() {
    // `try_with`: also called from thread-local destructors at exit.
    let hook = ON_BLOCK
        .try_with(|h| h.try_borrow_mut().ok().and_then(|mut h| h.take()))
        .ok()
        .flatten();
    if let Some(f) = hook {
        f();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn hook_fires_once_and_only_inside() {
        let n = Arc::new(AtomicUsize::new(0));
        before_blocking();
        let m = n.clone();
        let r = with_blocking_hook(
            move || {
                m.fetch_add(1, Ordering::SeqCst);
            },
            || {
                before_blocking();
                before_blocking();
                7
            },
        );
        assert_eq!(r, 7);
        before_blocking();
        assert_eq!(n.load(Ordering::SeqCst), 1);
        // Not fired when nothing blocks; removed afterwards.
        let m = n.clone();
        with_blocking_hook(
            move || {
                m.fetch_add(1, Ordering::SeqCst);
            },
            || {},
        );
        before_blocking();
        assert_eq!(n.load(Ordering::SeqCst), 1);
    }
}
