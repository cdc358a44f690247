//! Accesses from and into reused `Buffer`s over loopback and TCP, where
//! they are copied: more threads than cores, every byte checked at both
//! ends, buffers changed right after each access and dropped and replaced;
//! the statistics count the copies; a failed access hands its buffer back.
//! The same phase runs over real RDMA, where buffers are registered, in
//! `tests/ib.rs`.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::*;
use dxnet::region::{Access, RegionWrite};
use dxnet::{Buffer, Error, RegionError};

const SLICE: usize = 1 << 20;

fn buffers(kind: Kind) {
    const THREADS: u64 = 12;
    const OPS: u64 = 60;
    let nodes = start_all(cluster_configs(kind, 2, |c| {
        c.limits.request_timeout_ms = 60_000;
        c.limits.send_timeout_ms = 60_000;
    }));
    let (a, b) = (&nodes[0], &nodes[1]);
    let region = a
        .expose(THREADS as usize * SLICE, Access::ReadWrite)
        .unwrap();
    let remote = region.descriptor();
    let notified = Arc::new(AtomicU64::new(0));
    let n = notified.clone();
    a.on_region_write(move |_: RegionWrite| {
        n.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    let results: Vec<(Vec<u8>, u64)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let b = b.clone();
                s.spawn(move || buffer_phase(&b, &remote, t, (t as usize * SLICE, SLICE), OPS))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let shadows: Vec<u8> = results.iter().flat_map(|(s, _)| s.clone()).collect();
    assert!(region.to_vec() == shadows, "owner's bytes differ");
    let expect: u64 = results.iter().map(|(_, n)| n).sum();
    wait_for(30, "one notification per notifying write", || {
        notified.load(Ordering::SeqCst) == expect
    });
    assert_eq!(notified.load(Ordering::SeqCst), expect);
    let st = b.stats();
    // Every access of a buffer of at least `min_bytes` is counted: copied
    // here, as the engine has no registered memory.
    assert_eq!(st.zero_copy_in_place, 0);
    assert!(
        st.zero_copy_copied >= THREADS * OPS * 2,
        "{} copies counted",
        st.zero_copy_copied
    );
    assert_eq!(st.buffer_registrations, 0);
    assert_eq!(st.pinned_bytes, 0);
    assert!(!b.register_buffer(&Buffer::new(4096)).unwrap());

    // Failures hand the buffer back, bytes intact for a write.
    let buf = Buffer::from(vec![7u8; 5000]);
    let (res, buf) = b.write_buffer_async(&remote, remote.len() - 10, buf).wait();
    assert!(matches!(
        res,
        Err(Error::Region(RegionError::OutOfBounds { .. }))
    ));
    assert!(buf.iter().all(|&x| x == 7));
    let (res, buf) = b.read_buffer_async(&remote, remote.len(), buf).wait();
    assert!(res.is_err());
    assert_eq!(buf.len(), 5000);
    // The own node, from and into buffers.
    let mut buf = Buffer::from(b"hello buffers".to_vec());
    a.write_buffer(&remote, 5, &buf).unwrap();
    buf.fill(0);
    a.read_buffer(&remote, 5, &mut buf).unwrap();
    assert_eq!(&buf[..], b"hello buffers");
}

#[test]
fn buffers_loopback() {
    buffers(Kind::Loopback);
}

#[test]
fn buffers_tcp() {
    buffers(Kind::Tcp);
}

/// Messages from reused buffers (`send_buffer`) mixed with `send_raw` in
/// one stream: 24 threads on 2 cores, each message exactly once, intact
/// and in per-thread order, although every buffer is overwritten as soon
/// as its send returns.
fn buffer_messages(kind: Kind) {
    const THREADS: u32 = 24;
    const PER: u64 = 150;
    let nodes = start_all(cluster_configs(kind, 2, |c| {
        c.limits.send_timeout_ms = 60_000;
    }));
    let log = BufferSendLog::register(&nodes[0]);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let b = nodes[1].clone();
            s.spawn(move || buffer_sends(&b, dxnet::NodeId(0), t, PER, 100_000));
        }
    });
    log.expect(THREADS as u64 * PER, 60);
    let st = nodes[1].stats();
    assert_eq!(st.zero_copy_in_place, 0);
    assert!(st.zero_copy_copied > 0);
}

#[test]
fn buffer_messages_loopback() {
    buffer_messages(Kind::Loopback);
}

#[test]
fn buffer_messages_tcp() {
    buffer_messages(Kind::Tcp);
}
