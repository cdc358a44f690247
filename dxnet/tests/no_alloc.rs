//! The send path allocates nothing per message: a counting allocator counts
//! the sending thread's allocations over many sends after warm-up.
//!
//! A thread that blocks for the first time (its ring or the flow-control
//! window full) allocates its wait condition variable once; whether that
//! happens in the warm-up or later depends on how fast the peer reads, so
//! a few such one-time allocations are allowed. Anything per message, per
//! chunk or per write would be thousands.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::*;
use dxnet::NodeId;
use serde::{Deserialize, Serialize};

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

#[derive(Serialize, Deserialize)]
struct Typed {
    a: u64,
    name: String,
    values: Vec<u32>,
}
dxnet::message!(Typed, 30, 1);

/// The thread's wait condition variable and the registration of its
/// thread-local destructor, if it first blocks after the warm-up.
const ONE_TIME_ALLOCS: u64 = 2;

fn no_alloc_on(kind: Kind) {
    let cluster = start_all(cluster_configs(kind, 2, |_| {}));
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    cluster[1]
        .register_raw(30, 2, move |_, _| {
            g.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
    let g = got.clone();
    cluster[1]
        .register(move |_, _m: Typed| {
            g.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
    let payload = [7u8; 64];
    let typed = Typed {
        a: 1,
        name: "a name".into(),
        values: vec![1, 2, 3, 4],
    };
    let a = &cluster[0];
    for _ in 0..1000 {
        a.send_raw(NodeId(1), 30, 2, &payload).unwrap(); // connects, warms up
        a.send(NodeId(1), &typed).unwrap();
    }
    let before = allocs();
    for _ in 0..20_000 {
        a.send_raw(NodeId(1), 30, 2, &payload).unwrap();
        a.send(NodeId(1), &typed).unwrap();
    }
    let counted = allocs() - before;
    wait_for(60, "delivery", || got.load(Ordering::Relaxed) == 42_000);
    assert!(
        counted <= ONE_TIME_ALLOCS,
        "{counted} allocations on the send path for 40000 messages"
    );
}

#[test]
fn send_path_does_not_allocate_loopback() {
    no_alloc_on(Kind::Loopback);
}

#[test]
fn send_path_does_not_allocate_tcp() {
    no_alloc_on(Kind::Tcp);
}
