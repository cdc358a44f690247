//! One-sided operations on exposed regions over loopback and TCP, in one
//! process and across processes: random offsets and sizes (1 B to several
//! MiB) written and read back by more threads than cores, every byte
//! checked; writes with notification; bounds, rights and revocation; the
//! owner dying during operations.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::proc::*;
use common::*;
use dxnet::region::{Access, RegionWrite};
use dxnet::{Error, Node, NodeId, RegionError, RemoteRegion, Unreachable};
use serde::{Deserialize, Serialize};

/// Per-thread slice of the random phase.
const SLICE: usize = 1 << 20;
/// Bytes written and read at once in the large phase.
const LARGE: usize = 3 << 20;

/// [`Rng`] of `seed` as a closure.
fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut r = Rng::new(seed);
    move || r.next_u64()
}

/// A thread's random accesses inside its slice `[base, base + SLICE)`:
/// writes (blocking and async, some several in flight) each read back at
/// once; returns the slice as the thread wrote it.
fn random_phase(node: &Node, remote: &RemoteRegion, t: u64, base: usize, ops: u64) -> Vec<u8> {
    let mut shadow = vec![0u8; SLICE];
    let mut next = rng(t + 1);
    for i in 0..ops {
        let len = match next() % 8 {
            0 => 1,
            1 => 1 + (next() % (SLICE as u64 / 2)) as usize,
            _ => 1 + (next() % 5000) as usize,
        };
        let off = (next() % (SLICE - len + 1) as u64) as usize;
        let data = pattern(1, t as u16, i, len);
        if i % 5 == 0 {
            // Three writes in flight at once, then their read-backs.
            let mut handles = Vec::new();
            let mut spots = Vec::new();
            for k in 0..3u64 {
                let len = 1 + (next() % 3000) as usize;
                let off = (next() % (SLICE - len + 1) as u64) as usize;
                let d = pattern(2, t as u16, i * 4 + k, len);
                handles.push(node.write_async(remote, (base + off) as u64, &d).unwrap());
                shadow[off..off + len].copy_from_slice(&d);
                spots.push(off..off + len);
            }
            for h in handles {
                h.wait().unwrap();
            }
            for r in spots {
                let back = node
                    .read_async(remote, (base + r.start) as u64, r.len())
                    .unwrap()
                    .wait()
                    .unwrap();
                assert_eq!(back, shadow[r], "thread {t} op {i}: async read-back");
            }
            continue;
        }
        node.write(remote, (base + off) as u64, &data).unwrap();
        shadow[off..off + len].copy_from_slice(&data);
        let mut back = vec![0u8; len];
        node.read(remote, (base + off) as u64, &mut back).unwrap();
        assert_eq!(
            back, data,
            "thread {t} op {i}: read-back of {len} B at {off}"
        );
    }
    shadow
}

fn write_read_many_threads(kind: Kind) {
    const THREADS: u64 = 16;
    const LARGE_THREADS: u64 = 3;
    let nodes = start_all(cluster_configs(kind, 2, |c| {
        c.limits.request_timeout_ms = 60_000;
        c.limits.send_timeout_ms = 60_000;
    }));
    let len = THREADS as usize * SLICE + LARGE_THREADS as usize * LARGE;
    let region = nodes[0].expose(len, Access::ReadWrite).unwrap();
    let remote = region.descriptor();
    assert_eq!(remote.len(), len as u64);
    assert_eq!(remote.node(), NodeId(0));
    let shadows: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let node = nodes[1].clone();
                s.spawn(move || random_phase(&node, &remote, t, t as usize * SLICE, 60))
            })
            .collect();
        let large: Vec<_> = (0..LARGE_THREADS)
            .map(|t| {
                let node = nodes[1].clone();
                s.spawn(move || {
                    let base = THREADS as usize * SLICE + t as usize * LARGE;
                    let mut last = Vec::new();
                    for round in 0..3u64 {
                        let data = pattern(3, t as u16, round, LARGE);
                        node.write(&remote, base as u64, &data).unwrap();
                        let mut back = vec![0u8; LARGE];
                        node.read(&remote, base as u64, &mut back).unwrap();
                        assert!(back == data, "large thread {t} round {round}");
                        last = data;
                    }
                    last
                })
            })
            .collect();
        hs.into_iter()
            .chain(large)
            .map(|h| h.join().unwrap())
            .collect()
    });
    // The owner sees exactly what the writers wrote, byte for byte.
    let whole = region.to_vec();
    let expect: Vec<u8> = shadows.concat();
    assert_eq!(whole.len(), expect.len());
    let first_diff = whole.iter().zip(&expect).position(|(a, b)| a != b);
    assert_eq!(first_diff, None, "owner's bytes differ from the writers'");
    // The owner writes locally; the other node reads it.
    region.write(5, b"owner").unwrap();
    let mut b = [0u8; 5];
    nodes[1].read(&remote, 5, &mut b).unwrap();
    assert_eq!(&b, b"owner");
    // Parts written one after the other, in one call; past the end nothing.
    region.write_vectored(20, &[b"ow", b"", b"ner"]).unwrap();
    nodes[1].read(&remote, 20, &mut b).unwrap();
    assert_eq!(&b, b"owner");
    let end = region.len() - 4;
    assert!(region.write_vectored(end, &[b"ab", b"cde"]).is_err());
    let mut tail = [0u8; 4];
    region.read(end, &mut tail).unwrap();
    assert_eq!(tail, expect[end..].as_ref());
}

#[test]
fn write_read_many_threads_loopback() {
    write_read_many_threads(Kind::Loopback);
}

#[test]
fn write_read_many_threads_tcp() {
    write_read_many_threads(Kind::Tcp);
}

/// Accesses in place between an own region and a remote one
/// (`write_from`, `read_into` and their async and notifying forms) from
/// more threads than cores, every byte checked at both ends; the local
/// side's bounds, ownership and rights; a source or destination dropped
/// while its access runs.
fn in_place(kind: Kind) {
    const THREADS: u64 = 12;
    const OPS: u64 = 30;
    let nodes = start_all(cluster_configs(kind, 2, |c| {
        c.limits.request_timeout_ms = 60_000;
        c.limits.send_timeout_ms = 60_000;
    }));
    let (a, b) = (&nodes[0], &nodes[1]);
    // Emulated writes copy the bytes out when posted.
    assert!(!a.writes_from_region_in_place() && !b.writes_from_region_in_place());
    let region = a
        .expose(THREADS as usize * SLICE, Access::ReadWrite)
        .unwrap();
    let remote = region.descriptor();
    let local = b
        .expose(THREADS as usize * SLICE, Access::LocalOnly)
        .unwrap();
    let notified = Arc::new(AtomicU64::new(0));
    let n = notified.clone();
    a.on_region_write(move |w: RegionWrite| {
        assert_eq!(w.from, NodeId(1));
        n.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    let shadows: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (b, local) = (b.clone(), &local);
                let at = t as usize * SLICE;
                s.spawn(move || in_place_phase(&b, &remote, local, t, (at, at, SLICE), OPS))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(region.to_vec() == shadows.concat(), "owner's bytes differ");
    let expect = THREADS * (0..OPS).filter(|i| i % 3 == 2).count() as u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    while notified.load(Ordering::SeqCst) < expect && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(notified.load(Ordering::SeqCst), expect, "one per write");

    // The local side: bounds, ownership; a LocalOnly region refuses others.
    let region_err = |r: dxnet::Result<()>| match r {
        Err(Error::Region(e)) => e,
        other => panic!("expected a region error, got {other:?}"),
    };
    let len = local.len();
    assert!(matches!(
        region_err(b.write_from(&remote, 0, &local, len - 1, 2)),
        RegionError::LocalOutOfBounds { offset, len: 2, region_len } if offset == len as u64 - 1 && region_len == len as u64
    ));
    assert!(matches!(
        region_err(b.read_into(&remote, 0, &local, usize::MAX, 2)),
        RegionError::LocalOutOfBounds { .. }
    ));
    assert_eq!(
        region_err(b.write_from(&remote, 0, &region, 0, 1)),
        RegionError::NotOwnRegion
    );
    assert_eq!(
        region_err(a.write(&local.descriptor(), 0, b"x")),
        RegionError::WriteNotPermitted
    );
    assert_eq!(
        region_err(a.read(&local.descriptor(), 0, &mut [0; 1])),
        RegionError::ReadNotPermitted
    );
    // The remote side's checks hold as for copying accesses.
    assert!(matches!(
        region_err(b.write_from(&remote, remote.len(), &local, 0, 1)),
        RegionError::OutOfBounds { .. }
    ));
    // The own node, from and into its own region (overlapping ranges).
    region.write(0, b"abcdef").unwrap();
    a.write_from(&remote, 2, &region, 0, 4).unwrap();
    assert_eq!(&region.to_vec()[..6], b"ababcd");
    a.read_into(&remote, 0, &region, 1, 3).unwrap();
    assert_eq!(&region.to_vec()[..6], b"aabacd");
    // A source dropped right after its write started: the write carries
    // the bytes it held; a destination dropped before its read completes.
    let src = b.expose(300_000, Access::LocalOnly).unwrap();
    let data = pattern(5, 5, 5, 300_000);
    src.write(0, &data).unwrap();
    let h = b
        .write_from_async(&remote, 1000, &src, 0, data.len())
        .unwrap();
    drop(src);
    h.wait().unwrap();
    let mut back = vec![0u8; data.len()];
    region.read(1000, &mut back).unwrap();
    assert!(back == data, "a dropped source's write");
    let dst = b.expose(300_000, Access::LocalOnly).unwrap();
    let h = b
        .read_into_async(&remote, 1000, &dst, 0, data.len())
        .unwrap();
    drop(dst);
    h.wait().unwrap();
}

#[test]
fn in_place_loopback() {
    in_place(Kind::Loopback);
}

#[test]
fn in_place_tcp() {
    in_place(Kind::Tcp);
}

#[derive(Serialize, Deserialize, Debug)]
struct AfterWrite {
    offset: u64,
    len: u64,
    seed: u64,
}
dxnet::message!(AfterWrite, 40, 1);

/// Notifications arrive once per write, after all of its data (also for
/// writes of several parts); a message sent after a write sees its data.
fn notify_and_order(kind: Kind) {
    const THREADS: u64 = 8;
    const PER: u64 = 40;
    let nodes = start_all(cluster_configs(kind, 2, |c| {
        c.limits.request_timeout_ms = 60_000;
        c.limits.send_timeout_ms = 60_000;
    }));
    let slot = 700_000usize;
    let region = Arc::new(
        nodes[0]
            .expose(THREADS as usize * slot, Access::WriteOnly)
            .unwrap(),
    );
    let remote = region.descriptor();
    let seen = Arc::new(Mutex::new(HashSet::new()));
    let bad = Arc::new(AtomicU64::new(0));
    {
        let (region, seen, bad) = (region.clone(), seen.clone(), bad.clone());
        nodes[0]
            .on_region_write(move |w: RegionWrite| {
                let mut got = vec![0u8; w.len as usize];
                region.read(w.offset as usize, &mut got).unwrap();
                let t = w.offset / 700_000;
                if w.from != NodeId(1)
                    || got != pattern(4, t as u16, w.imm as u64, w.len as usize)
                    || !seen.lock().unwrap().insert((t, w.imm))
                {
                    eprintln!(
                        "BAD notify {w:?} eq5={}",
                        got == pattern(5, t as u16, w.imm as u64, w.len as usize)
                    );
                    bad.fetch_add(1, Ordering::Relaxed);
                }
            })
            .unwrap();
    }
    assert!(matches!(
        nodes[0].on_region_write(|_| {}),
        Err(Error::AlreadyRegistered(..))
    ));
    let after_ok = Arc::new(AtomicU64::new(0));
    {
        let (region, after_ok, bad) = (region.clone(), after_ok.clone(), bad.clone());
        nodes[0]
            .register(move |_, m: AfterWrite| {
                let mut got = vec![0u8; m.len as usize];
                region.read(m.offset as usize, &mut got).unwrap();
                let t = m.offset / 700_000;
                if got == pattern(5, t as u16, m.seed, m.len as usize) {
                    after_ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    bad.fetch_add(1, Ordering::Relaxed);
                }
            })
            .unwrap();
    }
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let node = nodes[1].clone();
            s.spawn(move || {
                let base = t * slot as u64;
                for i in 0..PER {
                    let len = if i % 10 == 0 {
                        600_000
                    } else {
                        1 + (i as usize * 997) % 9000
                    };
                    let d = pattern(4, t as u16, i, len);
                    node.write_with_notify(&remote, base, &d, i as u32).unwrap();
                    // Issued, not awaited: the message behind it still
                    // finds the data in place.
                    let d = pattern(5, t as u16, i, len);
                    let h = node.write_async(&remote, base, &d).unwrap();
                    node.send(
                        NodeId(0),
                        &AfterWrite {
                            offset: base,
                            len: len as u64,
                            seed: i,
                        },
                    )
                    .unwrap();
                    h.wait().unwrap();
                }
            });
        }
    });
    wait_for(60, "every notification and message", || {
        seen.lock().unwrap().len() as u64 == THREADS * PER
            && after_ok.load(Ordering::Relaxed) + bad.load(Ordering::Relaxed) >= THREADS * PER
    });
    assert_eq!(bad.load(Ordering::Relaxed), 0);
    assert_eq!(after_ok.load(Ordering::Relaxed), THREADS * PER);
}

#[test]
fn notify_and_order_loopback() {
    notify_and_order(Kind::Loopback);
}

#[test]
fn notify_and_order_tcp() {
    notify_and_order(Kind::Tcp);
}

/// A descriptor with fields changed, as a hostile or confused peer could
/// send one (through its serde form).
fn forged(r: &RemoteRegion, f: impl FnOnce(&mut serde_json::Value)) -> RemoteRegion {
    let mut v = serde_json::to_value(r).unwrap();
    f(&mut v);
    serde_json::from_value(v).unwrap()
}

fn bounds_rights_revocation(kind: Kind) {
    let nodes = start_all(cluster_configs(kind, 2, |_| {}));
    let (a, b) = (&nodes[0], &nodes[1]);
    let ro = a.expose(1000, Access::ReadOnly).unwrap();
    let wo = a.expose(1000, Access::WriteOnly).unwrap();
    let rw = a.expose(1000, Access::ReadWrite).unwrap();
    let (ro_d, wo_d, rw_d) = (ro.descriptor(), wo.descriptor(), rw.descriptor());
    let region_err = |r: dxnet::Result<()>| match r {
        Err(Error::Region(e)) => e,
        other => panic!("expected a region error, got {other:?}"),
    };
    // Rights, checked before sending ...
    assert_eq!(
        region_err(b.write(&ro_d, 0, b"x")),
        RegionError::WriteNotPermitted
    );
    assert_eq!(
        region_err(b.read(&wo_d, 0, &mut [0; 1])),
        RegionError::ReadNotPermitted
    );
    // ... and by the owner, when the descriptor lies.
    let ro_lying = forged(&ro_d, |v| v["access"] = "ReadWrite".into());
    assert_eq!(
        region_err(b.write(&ro_lying, 0, b"x")),
        RegionError::WriteNotPermitted
    );
    let wo_lying = forged(&wo_d, |v| v["access"] = "ReadWrite".into());
    assert_eq!(
        region_err(b.read(&wo_lying, 0, &mut [0; 1])),
        RegionError::ReadNotPermitted
    );
    // Bounds, checked before sending and by the owner.
    for (off, len) in [(1000u64, 1usize), (999, 2), (u64::MAX, 2), (0, 1001)] {
        assert!(matches!(
            region_err(b.write(&rw_d, off, &vec![1; len])),
            RegionError::OutOfBounds {
                region_len: 1000,
                ..
            }
        ));
    }
    let rw_long = forged(&rw_d, |v| v["len"] = (1u64 << 30).into());
    assert!(matches!(
        region_err(b.write(&rw_long, 990, &[1; 20])),
        RegionError::OutOfBounds { .. }
    ));
    assert!(matches!(
        region_err(b.read(&rw_long, 2000, &mut [0; 8])),
        RegionError::OutOfBounds { .. }
    ));
    // Nothing of the refused accesses landed.
    assert!(rw.to_vec().iter().all(|&x| x == 0));
    assert!(ro.to_vec().iter().all(|&x| x == 0));
    // Empty accesses at the end are fine; the own node works directly.
    b.write(&rw_d, 1000, &[]).unwrap();
    b.read(&rw_d, 1000, &mut []).unwrap();
    a.write(&rw_d, 10, b"self").unwrap();
    let mut s = [0u8; 4];
    a.read(&rw_d, 10, &mut s).unwrap();
    assert_eq!(&s, b"self");
    // A guessed key names nothing.
    let guessed = forged(&rw_d, |v| v["key"] = 12345.into());
    assert_eq!(region_err(b.write(&guessed, 0, b"x")), RegionError::Revoked);
    // Revoked: later accesses fail, from others and from the own node.
    b.write(&rw_d, 0, b"before").unwrap();
    rw.revoke();
    assert_eq!(
        region_err(b.write(&rw_d, 0, b"after")),
        RegionError::Revoked
    );
    assert_eq!(
        region_err(b.read(&rw_d, 0, &mut [0; 6])),
        RegionError::Revoked
    );
    assert_eq!(
        region_err(a.write(&rw_d, 0, b"after")),
        RegionError::Revoked
    );
    // Other regions keep working.
    let mut got = [0u8; 3];
    b.read(&ro_d, 0, &mut got).unwrap();
    b.write(&wo_d, 997, b"end").unwrap();
    let mut end = [0u8; 3];
    wo.read(997, &mut end).unwrap();
    assert_eq!(&end, b"end");
    // Local accesses are bounds-checked too.
    assert!(matches!(
        wo.write(999, b"xy"),
        Err(Error::Region(RegionError::OutOfBounds { .. }))
    ));
    assert!(matches!(
        a.expose(0, Access::ReadWrite),
        Err(Error::Region(RegionError::Allocation(0)))
    ));
}

#[test]
fn bounds_rights_revocation_loopback() {
    bounds_rights_revocation(Kind::Loopback);
}

#[test]
fn bounds_rights_revocation_tcp() {
    bounds_rights_revocation(Kind::Tcp);
}

/// A typed failure of an access whose owner went away (or, just before,
/// revoked the region: the owner answers accesses arriving during its
/// shutdown with `Revoked`): never a hang or a wrong success.
fn is_owner_gone(e: &Error) -> bool {
    matches!(
        e,
        Error::Unreachable(_, Unreachable::ConnectionLost(_) | Unreachable::Connect(_))
            | Error::Timeout(_)
            | Error::Region(RegionError::Revoked)
    )
}

/// The owner shuts down while 8 threads write and read: every access
/// returns, those after the end with a typed error.
#[test]
fn owner_shutdown_during_operations_tcp() {
    let mut nodes = start_all(cluster_configs(Kind::Tcp, 2, |c| {
        c.limits.request_timeout_ms = 5_000;
        c.limits.connect_timeout_ms = 500;
    }));
    let owner = nodes.remove(0);
    let region = owner.expose(8 << 20, Access::ReadWrite).unwrap();
    let remote = region.descriptor();
    let failures = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let node = nodes[0].clone();
            let failures = &failures;
            s.spawn(move || {
                let mut next = rng(t + 100);
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    let len = 1 + (next() % (1 << 20)) as usize;
                    let off = t * (1 << 20);
                    let r = if next().is_multiple_of(2) {
                        node.write(&remote, off, &buf[..len])
                    } else {
                        node.read(&remote, off, &mut buf[..len])
                    };
                    if let Err(e) = r {
                        assert!(is_owner_gone(&e), "thread {t}: {e:?}");
                        failures.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
            });
        }
        std::thread::sleep(Duration::from_millis(300));
        drop(region);
        drop(owner);
    });
    assert_eq!(failures.load(Ordering::Relaxed), 8);
    // A hang detector, not a timing test: each access ends within its
    // timeout plus a reconnect attempt.
    assert!(start.elapsed() < Duration::from_secs(60));
}

#[test]
fn child_region_owner() {
    if !is_child() {
        return;
    }
    init_child_log();
    let base: u16 = env_parse("BASE");
    let node = Node::start(dxnet::Config::tcp_localhost(0, 2, base)).unwrap();
    let region = node.expose(16 << 20, Access::ReadWrite).unwrap();
    println!(
        "DESC {}",
        serde_json::to_string(&region.descriptor()).unwrap()
    );
    loop {
        let cmd = next_command();
        if cmd == "sum" {
            println!("SUM {}", checksum(&region.to_vec()));
        } else if cmd == "quit" {
            return;
        }
    }
}

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Owner in another process: 12 threads write and read random ranges, the
/// owner's own view of the region matches byte for byte; then the owner is
/// killed during operations and every access ends with a typed error.
#[test]
fn multiprocess_owner_and_kill() {
    let base = base_port(2);
    let mut child = spawn_child("child_region_owner", &[("BASE", base.to_string())]);
    let line = child.wait_line("DESC ", 60);
    let remote: RemoteRegion = serde_json::from_str(&line["DESC ".len()..]).unwrap();
    let mut cfg = dxnet::Config::tcp_localhost(1, 2, base);
    cfg.limits.request_timeout_ms = 10_000;
    cfg.limits.connect_timeout_ms = 500;
    let node = Arc::new(Node::start(cfg).unwrap());
    until_reachable("owner", || node.read(&remote, 0, &mut [0u8; 1]));
    let shadows: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..12u64)
            .map(|t| {
                let node = node.clone();
                s.spawn(move || random_phase(&node, &remote, t, t as usize * SLICE, 25))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut whole = shadows.concat();
    whole.resize(16 << 20, 0);
    child.command("sum");
    let sum = child.wait_line("SUM ", 60);
    assert_eq!(sum, format!("SUM {}", checksum(&whole)));

    let failures = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..6u64 {
            let node = node.clone();
            let failures = &failures;
            s.spawn(move || {
                let mut buf = vec![7u8; 2 << 20];
                loop {
                    let r = if t % 2 == 0 {
                        node.write(&remote, t << 21, &buf)
                    } else {
                        node.read(&remote, t << 21, &mut buf)
                    };
                    if let Err(e) = r {
                        assert!(is_owner_gone(&e), "thread {t}: {e:?}");
                        failures.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
            });
        }
        std::thread::sleep(Duration::from_millis(300));
        child.kill9();
    });
    assert_eq!(failures.load(Ordering::Relaxed), 6);
}
