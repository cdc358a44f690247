//! Accesses from and into reused `Buffer`s over loopback and TCP, where
//! one-sided accesses are copied: more threads than cores, every byte
//! checked at both ends, buffers changed right after each access and
//! dropped and replaced; the statistics count the copies; a failed access
//! hands its buffer back. Messages from buffers of 8 KiB and more go from
//! the buffer in place on TCP (and TLS): payloads of several chunks, a
//! receiver too slow for the socket, the peer gone mid-send, shutdown
//! right after the sends. The same phase runs over real RDMA, where
//! buffers are registered, in `tests/ib.rs`.

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

/// `threads` threads of node 1 send `per` messages each to node 0 with
/// [`buffer_sends`] (buffers up to `max` bytes, in place from 8 KiB on
/// TCP), node 0 taking `per_message` for each; every message exactly
/// once, intact and in per-thread order. Returns node 1's statistics.
fn checked_buffer_sends(
    kind: Kind,
    threads: u32,
    per: u64,
    max: usize,
    per_message: std::time::Duration,
) -> dxnet::NodeStats {
    let nodes = start_all(cluster_configs(kind, 2, |c| {
        c.limits.send_timeout_ms = 60_000;
        c.tcp.send_in_place_from = 8192;
    }));
    let log = BufferSendLog::register_slow(&nodes[0], per_message);
    std::thread::scope(|s| {
        for t in 0..threads {
            let b = nodes[1].clone();
            s.spawn(move || buffer_sends(&b, dxnet::NodeId(0), t, per, max));
        }
    });
    log.expect(threads as u64 * per, 90);
    nodes[1].stats()
}

/// Messages from reused buffers (`send_buffer`) mixed with `send_raw` in
/// one stream: 24 threads on 2 cores, each message exactly once, intact
/// and in per-thread order, although every buffer is overwritten as soon
/// as its send returns.
fn buffer_messages(kind: Kind) {
    let st = checked_buffer_sends(kind, 24, 150, 100_000, std::time::Duration::ZERO);
    assert_eq!(st.zero_copy_in_place, 0);
    assert!(st.zero_copy_copied > 0);
    expect_lent(kind, st.buffer_sends_lent);
}

/// TCP (and TLS) sends buffers in place from `tcp.send_in_place_from`
/// bytes on; loopback copies them.
fn expect_lent(kind: Kind, lent: u64) {
    if kind == Kind::Loopback {
        assert_eq!(lent, 0);
    } else {
        assert!(lent > 0, "no payload went from its buffer in place");
    }
}

#[test]
fn buffer_messages_loopback() {
    buffer_messages(Kind::Loopback);
}

#[test]
fn buffer_messages_tcp() {
    buffer_messages(Kind::Tcp);
}

#[test]
fn buffer_messages_tls() {
    buffer_messages(Kind::TcpTls);
}

/// Payloads over the 1 MiB chunk size, in place: each goes out in several
/// chunks right behind its header, with other threads' messages in the
/// other rings; every message intact and in per-thread order.
fn large_buffer_messages(kind: Kind) {
    let st = checked_buffer_sends(kind, 6, 15, (2 << 20) + 77, std::time::Duration::ZERO);
    expect_lent(kind, st.buffer_sends_lent);
}

#[test]
fn large_buffer_messages_tcp() {
    large_buffer_messages(Kind::Tcp);
}

#[test]
fn large_buffer_messages_tls() {
    large_buffer_messages(Kind::TcpTls);
}

/// A receiver slower than the senders: the socket fills up, so payloads
/// in place are written in pieces as it drains (partial writes resumed
/// inside a payload and inside its chunk header).
fn buffer_messages_to_a_slow_receiver(kind: Kind) {
    let slow = std::time::Duration::from_millis(1);
    let st = checked_buffer_sends(kind, 4, 40, 300_001, slow);
    expect_lent(kind, st.buffer_sends_lent);
}

#[test]
fn buffer_messages_to_a_slow_receiver_tcp() {
    buffer_messages_to_a_slow_receiver(Kind::Tcp);
}

#[test]
fn buffer_messages_to_a_slow_receiver_tls() {
    buffer_messages_to_a_slow_receiver(Kind::TcpTls);
}

/// The peer goes while payloads lent from buffers wait to be written (its
/// handler holds the socket full): every send ends, with success or a
/// lost connection (none with its timeout), and hands its buffer back.
#[test]
fn lent_sends_end_when_the_peer_goes() {
    const SENDS: usize = 24;
    const LEN: usize = 1 << 20;
    let mut nodes = start_all(cluster_configs(Kind::Tcp, 2, |c| {
        c.limits.send_timeout_ms = 60_000;
        c.limits.shutdown_linger_ms = 100;
    }));
    let gate = Arc::new(std::sync::Mutex::new(()));
    let held = gate.lock().unwrap();
    let g = gate.clone();
    nodes[0]
        .register_raw(BUFFER_MSG.0, BUFFER_MSG.1, move |_, _| drop(g.lock()))
        .unwrap();
    let sender = nodes[1].clone();
    let sends = std::thread::spawn(move || {
        let mut handles = Vec::new();
        for k in 0..SENDS {
            let buf = Buffer::from(vec![k as u8; LEN]);
            handles.push(sender.send_buffer_async(
                dxnet::NodeId(0),
                BUFFER_MSG.0,
                BUFFER_MSG.1,
                buf,
            ));
        }
        handles
            .into_iter()
            .map(|h| {
                let (res, buf) = h.wait();
                assert_eq!(buf.len(), LEN, "the buffer comes back whole");
                res
            })
            .collect::<Vec<_>>()
    });
    // Sends pile up behind the blocked handler, then the peer goes.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let receiver = nodes.remove(0);
    let closer = std::thread::spawn(move || drop(receiver));
    std::thread::sleep(std::time::Duration::from_millis(50));
    drop(held);
    closer.join().unwrap();
    let results = sends.join().unwrap();
    // A send that waited for its timeout would end with `Timeout`.
    for r in &results {
        match r {
            Ok(()) | Err(Error::Unreachable(_, _)) | Err(Error::Shutdown) => {}
            Err(e) => panic!("unexpected outcome: {e}"),
        }
    }
    assert!(
        results.iter().any(|r| r.is_err()),
        "the window and the sockets cannot hold {SENDS} MiB"
    );
}

/// Shutdown right after lent sends whose handles were dropped: the
/// payloads still go out (shutdown lingers for them) and arrive intact.
#[test]
fn lent_sends_go_out_before_shutdown() {
    // 24 MB: more than the sockets and the receiver's incoming queue hold
    // while its handler is slow, so most payloads still wait at the sender
    // when it shuts down.
    const SENDS: u64 = 48;
    let nodes = start_all(cluster_configs(Kind::Tcp, 2, |c| {
        c.limits.flow_control_window = 64 << 20;
        c.limits.incoming_max_bytes = 1 << 20;
        c.limits.send_timeout_ms = 60_000;
        c.limits.shutdown_linger_ms = 60_000;
    }));
    let log = BufferSendLog::register_slow(&nodes[0], std::time::Duration::from_millis(2));
    let mut nodes = nodes;
    let sender = nodes.remove(1);
    for seq in 0..SENDS {
        let msg = buffer_message(1, 0, seq, 500_000 + seq as usize);
        let h = sender.send_buffer_async(
            dxnet::NodeId(0),
            BUFFER_MSG.0,
            BUFFER_MSG.1,
            Buffer::from(msg),
        );
        drop(h);
    }
    assert!(sender.stats().buffer_sends_lent >= SENDS);
    drop(sender);
    log.expect(SENDS, 60);
}

/// One buffer reused for messages of many lengths (`Buffer::set_len`):
/// each message carries exactly the bytes in use, in order, whether
/// copied or sent in place (from `in_place_from` bytes on; `None`: the
/// default, 256 KiB); the capacity bounds the length.
fn buffer_lengths(kind: Kind, in_place_from: Option<usize>) {
    let nodes = start_all(cluster_configs(kind, 2, |c| {
        c.limits.send_timeout_ms = 60_000;
        if let Some(n) = in_place_from {
            c.tcp.send_in_place_from = n;
        }
    }));
    let got = Arc::new(std::sync::Mutex::new(Vec::new()));
    let g = got.clone();
    nodes[0]
        .register_raw(BUFFER_MSG.0, BUFFER_MSG.1, move |_, p| {
            let fill = p.first().copied();
            let same = p.iter().all(|&x| Some(x) == fill);
            g.lock().unwrap().push((p.len(), fill, same));
        })
        .unwrap();
    let lens = [10usize, 99_999, 9_000, 100_000, 1, 50_000, 8_192, 8_191];
    let mut buf = Buffer::with_capacity(100_000);
    assert_eq!((buf.len(), buf.capacity()), (0, 100_000));
    for (k, &len) in lens.iter().enumerate() {
        buf.set_len(len);
        buf.fill(k as u8 + 1);
        if k % 2 == 0 {
            nodes[1]
                .send_buffer(dxnet::NodeId(0), BUFFER_MSG.0, BUFFER_MSG.1, &buf)
                .unwrap();
        } else {
            let h = nodes[1].send_buffer_async(dxnet::NodeId(0), BUFFER_MSG.0, BUFFER_MSG.1, buf);
            let (res, back) = h.wait();
            res.unwrap();
            buf = back;
        }
        assert_eq!(buf.len(), len);
    }
    wait_for(30, "every message", || {
        got.lock().unwrap().len() == lens.len()
    });
    let want: Vec<_> = lens
        .iter()
        .enumerate()
        .map(|(k, &len)| (len, Some(k as u8 + 1), true))
        .collect();
    assert_eq!(*got.lock().unwrap(), want);
    let over = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| buf.set_len(100_001)));
    assert!(over.is_err(), "a length over the capacity is refused");
    let lent = match (kind, in_place_from) {
        (Kind::Loopback, _) | (_, None) => 0,
        (_, Some(n)) => lens.iter().filter(|&&len| len >= n).count() as u64,
    };
    assert_eq!(nodes[1].stats().buffer_sends_lent, lent);
}

#[test]
fn buffer_lengths_loopback() {
    buffer_lengths(Kind::Loopback, None);
}

#[test]
fn buffer_lengths_tcp() {
    buffer_lengths(Kind::Tcp, None);
}

#[test]
fn buffer_lengths_tcp_in_place() {
    buffer_lengths(Kind::Tcp, Some(8192));
}

/// Many small payloads lent at once (16 threads, several sends each in
/// flight, the receiver held back at first so headers pile up in the
/// rings): one chunk splices as many as it holds; every message arrives
/// once, intact, in per-thread order.
#[test]
fn many_lent_messages_in_one_chunk() {
    const THREADS: u32 = 16;
    const PER: u64 = 120;
    const IN_FLIGHT: usize = 6;
    let nodes = start_all(cluster_configs(Kind::Tcp, 2, |c| {
        c.limits.send_timeout_ms = 60_000;
        c.limits.flow_control_window = 16 << 20;
        c.tcp.send_in_place_from = 8192;
    }));
    let gate = Arc::new(std::sync::Mutex::new(()));
    let held = gate.lock().unwrap();
    let log = Arc::new(BufferSendLog::default());
    let (l, g) = (log.clone(), gate.clone());
    nodes[0]
        .register_raw(BUFFER_MSG.0, BUFFER_MSG.1, move |src, p| {
            drop(g.lock());
            l.check_message(src.0, p);
        })
        .unwrap();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let b = nodes[1].clone();
            s.spawn(move || {
                let mut flight = std::collections::VecDeque::new();
                for seq in 0..PER {
                    let len = 8192 + ((seq as usize * 7 + t as usize * 13) % 1024);
                    let msg = buffer_message(b.id().0, t, seq, len);
                    flight.push_back(b.send_buffer_async(
                        dxnet::NodeId(0),
                        BUFFER_MSG.0,
                        BUFFER_MSG.1,
                        Buffer::from(msg),
                    ));
                    if flight.len() > IN_FLIGHT {
                        flight.pop_front().unwrap().wait().0.unwrap();
                    }
                }
                for h in flight {
                    h.wait().0.unwrap();
                }
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(held);
    });
    log.expect(THREADS as u64 * PER, 60);
    assert!(nodes[1].stats().buffer_sends_lent >= THREADS as u64 * PER);
}
