//! Tests against a real RDMA device. They are `#[ignore]`d because they need
//! one: `scripts/test-ib.sh` runs them with `--ignored` inside a VM with a
//! Soft-RoCE device (rxe0). Elsewhere: `RDMA_DEV=mlx5_0 RDMA_GID_INDEX=3
//! cargo test -p dxnet-verbs --test rxe -- --ignored`.
//!
//! Environment: RDMA_DEV (default: first device), RDMA_PORT (default 1),
//! RDMA_GID_INDEX (required on RoCE), DXNET_TEST_SEED, DXNET_TEST_MESSAGES.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use dxnet_verbs::*;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Setup {
    ctx: Context,
    port: u8,
    gid_index: Option<u32>,
}

fn setup() -> Setup {
    let dev = std::env::var("RDMA_DEV").ok();
    let ctx = Context::open(dev.as_deref()).unwrap_or_else(|e| panic!("open {dev:?}: {e}"));
    let port = env_or("RDMA_PORT", 1u8);
    let gid_index = std::env::var("RDMA_GID_INDEX")
        .ok()
        .map(|v| v.parse().expect("RDMA_GID_INDEX"));
    Setup {
        ctx,
        port,
        gid_index,
    }
}

/// xorshift64*: deterministic, seedable test randomness.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Payload source: message `seq` of direction `dir` is a window of a fixed
/// random table (so generating and checking are memory copies/compares).
struct Patterns(Vec<u8>);
const PATTERN_PERIOD: usize = 65_521;
impl Patterns {
    fn new() -> Patterns {
        let mut r = Rng(0x0123_4567_89ab_cdef);
        Patterns((0..2 * PATTERN_PERIOD).map(|_| r.next() as u8).collect())
    }
    fn get(&self, dir: u32, seq: u32, size: usize) -> &[u8] {
        let off = (seq as usize * 7919 + dir as usize * 104_729) % PATTERN_PERIOD;
        &self.0[off..off + size]
    }
}

/// Immediate value of message `seq` in direction `dir`.
fn imm_of(dir: u32, seq: u32) -> u32 {
    (dir << 31) | (seq.wrapping_mul(2_654_435_761) & 0x7fff_ffff)
}

/// Polls `cq` until `want` completions arrived; each must have succeeded
/// unless `f` is given the errors too (`check == false`).
fn poll_until<F: FnMut(&WorkCompletion)>(
    cq: &CompletionQueue,
    want: usize,
    what: &str,
    check: bool,
    mut f: F,
) {
    let mut wcs = [WorkCompletion::default(); 32];
    let mut got = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while got < want {
        let n = cq.poll(&mut wcs[..(want - got).min(32)]).expect("poll");
        for wc in &wcs[..n] {
            if check {
                wc.check().unwrap_or_else(|e| panic!("{what}: {e}"));
            }
            f(wc);
        }
        got += n;
        assert!(
            Instant::now() < deadline,
            "{what}: only {got} of {want} completions after 60 s"
        );
    }
}

#[test]
#[ignore = "needs an RDMA device (run by scripts/test-ib.sh in the rxe VM)"]
fn device_port_and_gid() {
    let s = setup();
    let dev = s.ctx.query_device().unwrap();
    eprintln!(
        "device {} guid {:#x}: {dev:?}",
        s.ctx.name(),
        s.ctx.node_guid()
    );
    assert!(dev.max_qp_wr > 0 && dev.max_sge > 1 && dev.max_srq_sge > 1 && dev.phys_port_cnt >= 1);
    let port = s.ctx.query_port(s.port).unwrap();
    eprintln!("port {}: {port:?}", s.port);
    assert_eq!(port.state, PortState::Active);
    if std::env::var_os("RDMA_VM").is_some() {
        // the harness's rxe0: RoCE on a 4200-byte-MTU dummy netdev
        assert_eq!(port.link_layer, LinkLayer::Ethernet);
        assert_eq!(port.active_mtu, Mtu::Mtu4096);
        assert_eq!(port.lid, 0);
        let gid = s.ctx.query_gid(s.port, s.gid_index.unwrap()).unwrap();
        let ip: std::net::Ipv4Addr = std::env::var("RDMA_IP").unwrap().parse().unwrap();
        assert_eq!(gid.ipv4(), Some(ip), "gid {gid}");
    }
    assert!(s.ctx.query_port(200).is_err());
    let names: Vec<String> = devices().unwrap().into_iter().map(|d| d.name).collect();
    assert!(names.contains(&s.ctx.name().to_string()));
    let err = Context::open(Some("no-such-device")).unwrap_err();
    assert!(err.to_string().contains("not found (available:"), "{err}");
}

struct Side {
    qp: QueuePair,
    send_cq: CompletionQueue,
}

/// Two RC QPs on one device, connected to each other, sharing one SRQ and
/// one receive CQ (as the msgrc engine does for all its connections).
fn connected_pair(
    s: &Setup,
    pd: &ProtectionDomain,
    srq: &SharedReceiveQueue,
    recv_cq: &CompletionQueue,
    caps: QpCaps,
) -> (Side, Side) {
    connected_pair_with(s, pd, srq, recv_cq, caps, AccessFlags::NONE)
}

/// [`connected_pair`] whose QPs allow the peer `access` (remote write,
/// read) to the regions whose keys it has.
fn connected_pair_with(
    s: &Setup,
    pd: &ProtectionDomain,
    srq: &SharedReceiveQueue,
    recv_cq: &CompletionQueue,
    caps: QpCaps,
    access: AccessFlags,
) -> (Side, Side) {
    let mk = || {
        let send_cq = s.ctx.create_cq(caps.max_send_wr * 2, None).unwrap();
        let qp = pd
            .create_rc_qp(&QpInit {
                send_cq: &send_cq,
                recv_cq,
                srq: Some(srq),
                caps,
                sq_sig_all: false,
            })
            .unwrap();
        assert_eq!(qp.state().unwrap(), QpState::Reset);
        Side { qp, send_cq }
    };
    let (a, b) = (mk(), mk());
    let gid8 = s.gid_index.map(|g| g as u8);
    let attr_a = ConnectAttr {
        local_psn: 0x1234,
        access,
        ..ConnectAttr::for_port(&s.ctx, s.port, gid8).unwrap()
    };
    let attr_b = ConnectAttr {
        local_psn: 0xfedcba,
        ..attr_a
    };
    let ep_a = Endpoint::local(&s.ctx, &a.qp, s.port, s.gid_index, attr_a.local_psn).unwrap();
    let ep_b = Endpoint::local(&s.ctx, &b.qp, s.port, s.gid_index, attr_b.local_psn).unwrap();
    // exercise the wire encoding the engine will use
    let ep_a = Endpoint::from_bytes(&ep_a.to_bytes()).unwrap();
    let ep_b = Endpoint::from_bytes(&ep_b.to_bytes()).unwrap();
    a.qp.to_init(s.port, access).unwrap();
    assert_eq!(a.qp.state().unwrap(), QpState::Init);
    a.qp.to_rtr(&attr_a, &ep_b).unwrap();
    assert_eq!(a.qp.state().unwrap(), QpState::ReadyToReceive);
    a.qp.to_rts(&attr_a).unwrap();
    assert_eq!(a.qp.state().unwrap(), QpState::ReadyToSend);
    b.qp.connect(&attr_b, &ep_a).unwrap();
    assert_eq!(b.qp.state().unwrap(), QpState::ReadyToSend);
    (a, b)
}

/// Receive buffer layout: every receive WR scatters into three SGEs, the
/// first two from one MR (a small header-sized piece and a medium one,
/// deliberately not adjacent), the third from another MR.
const RECV_SGES: [usize; 3] = [64, 1000, 19_000];
const MAX_MSG: usize = 64 + 1000 + 19_000;

#[test]
#[ignore = "needs an RDMA device (run by scripts/test-ib.sh in the rxe VM)"]
fn rc_srq_send_with_imm_random_sizes() {
    let s = setup();
    let seed: u64 = env_or("DXNET_TEST_SEED", 0x5eed_1234_abcd_0001);
    let per_dir: u32 = env_or("DXNET_TEST_MESSAGES", 1500);
    eprintln!("seed {seed:#x}, {per_dir} messages per direction");
    let mut rng = Rng(seed | 1);
    let patterns = Patterns::new();

    let pd = s.ctx.alloc_pd().unwrap();
    let srq_depth = 64u32;
    let srq = pd.create_srq(srq_depth, 3).unwrap();
    assert!(srq.max_wr() >= srq_depth && srq.max_sge() >= 3);
    let recv_cq = s.ctx.create_cq(srq_depth * 2, None).unwrap();
    let caps = QpCaps {
        max_send_wr: 64,
        max_send_sge: 3,
        ..QpCaps::default()
    };
    let (a, b) = connected_pair(&s, &pd, &srq, &recv_cq, caps);
    let sides = [&a, &b];

    // receive memory: MR "small" holds pieces 0 and 1 of every slot, MR
    // "large" piece 2
    let slots = srq_depth as usize;
    let small_stride = 4096;
    let recv_small = pd
        .alloc_buffer(slots * small_stride, AccessFlags::LOCAL_WRITE)
        .unwrap();
    let recv_large = pd
        .alloc_buffer(slots * RECV_SGES[2], AccessFlags::LOCAL_WRITE)
        .unwrap();
    let recv_sges = |slot: usize| -> [Sge; 3] {
        [
            recv_small
                .sge(slot * small_stride, RECV_SGES[0] as u32)
                .unwrap(),
            recv_small
                .sge(slot * small_stride + 2048, RECV_SGES[1] as u32)
                .unwrap(),
            recv_large
                .sge(slot * RECV_SGES[2], RECV_SGES[2] as u32)
                .unwrap(),
        ]
    };
    // post all receive slots as chains of 8
    let mut rchain = RecvChain::with_capacity(8, 24);
    for chunk in (0..slots).collect::<Vec<_>>().chunks(8) {
        rchain.clear();
        for &slot in chunk {
            rchain.push(slot as u64, &recv_sges(slot));
        }
        srq.post_recv(&mut rchain).unwrap();
    }

    // send memory: per direction, a ring of `window` message slots
    let window = 16usize;
    let mut send_mem: Vec<MemoryRegion> = (0..2)
        .map(|_| {
            pd.alloc_buffer(window * MAX_MSG, AccessFlags::NONE)
                .unwrap()
        })
        .collect();

    let mut next_seq = [0u32; 2];
    let mut in_flight = [0usize; 2]; // sent, send completion not yet seen
    let mut sizes: [HashMap<u32, usize>; 2] = [HashMap::new(), HashMap::new()];
    let mut received = [0u32; 2];
    let mut expect_seq = [0u32; 2];
    let mut zero_len = 0u32;
    let mut multi_sge_recv = 0u32;
    let mut schain = SendChain::with_capacity(8, 24);
    let mut wcs = [WorkCompletion::default(); 32];
    let mut repost: Vec<usize> = Vec::new();
    let mut buf = vec![0u8; MAX_MSG];
    let t0 = Instant::now();

    while received[0] < per_dir || received[1] < per_dir {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "stuck: received {received:?} of {per_dir}"
        );
        // 1. send a chain of 1..=4 messages per direction while receive
        //    slots are guaranteed (total in flight ≤ SRQ depth)
        for dir in 0..2 {
            let outstanding: usize = (0..2).map(|d| (next_seq[d] - received[d]) as usize).sum();
            let room = (slots.saturating_sub(outstanding)).min(window - in_flight[dir]);
            let left = (per_dir - next_seq[dir]) as usize;
            let k = room.min(left).min(1 + rng.below(4) as usize);
            if k == 0 {
                continue;
            }
            schain.clear();
            for _ in 0..k {
                let seq = next_seq[dir];
                next_seq[dir] += 1;
                let size = match rng.below(10) {
                    0 => 0,                            // zero-length with immediate
                    1..=3 => rng.below(65) as usize,   // fits the first SGE
                    4..=6 => rng.below(1100) as usize, // spans the first two
                    _ => rng.below(MAX_MSG as u64 + 1) as usize,
                };
                sizes[dir].insert(seq, size);
                let slot = seq as usize % window;
                let base = slot * MAX_MSG;
                send_mem[dir]
                    .write(base, patterns.get(dir as u32, seq, size))
                    .unwrap();
                // split the payload into 1..=3 SGEs
                let pieces = if size < 2 {
                    1
                } else {
                    1 + rng.below(3) as usize
                };
                let mut cuts: Vec<usize> = (0..pieces - 1)
                    .map(|_| rng.below(size as u64 + 1) as usize)
                    .collect();
                cuts.sort_unstable();
                let mut sges = Vec::new();
                let mut start = 0;
                for end in cuts.into_iter().chain(std::iter::once(size)) {
                    if end > start {
                        sges.push(
                            send_mem[dir]
                                .sge(base + start, (end - start) as u32)
                                .unwrap(),
                        );
                    }
                    start = end;
                }
                // every 4th request (and the chain's last) is signaled
                let last = seq + 1 == next_seq[dir] && schain.len() + 1 == k;
                let flags = if seq % 4 == 3 || last {
                    SendFlags::SIGNALED
                } else {
                    SendFlags::NONE
                };
                schain.push(
                    ((dir as u64) << 32) | seq as u64,
                    SendOp::SendWithImm(imm_of(dir as u32, seq)),
                    &sges,
                    flags,
                );
            }
            sides[dir].qp.post_send(&mut schain).unwrap();
            in_flight[dir] += k;
        }

        // 2. receive completions: verify every byte and the immediate
        let n = recv_cq.poll(&mut wcs).unwrap();
        repost.clear();
        for wc in &wcs[..n] {
            wc.check().unwrap_or_else(|e| panic!("receive: {e}"));
            assert_eq!(wc.opcode(), WcOpcode::Recv);
            let dir = if wc.qp_num() == b.qp.qp_num() {
                0
            } else {
                assert_eq!(wc.qp_num(), a.qp.qp_num());
                1
            };
            let seq = expect_seq[dir]; // RC delivers in order per QP
            expect_seq[dir] += 1;
            let imm = wc.imm().expect("immediate data missing");
            assert_eq!(
                imm,
                imm_of(dir as u32, seq),
                "direction {dir}: immediate of message {seq}"
            );
            let size = sizes[dir].remove(&seq).unwrap();
            assert_eq!(
                wc.byte_len() as usize,
                size,
                "direction {dir}: length of message {seq}"
            );
            let slot = wc.wr_id() as usize;
            // gather the pieces of this slot back into one message
            let mut off = 0;
            for (i, piece) in recv_sges(slot).iter().enumerate() {
                let take = (size - off).min(piece.len() as usize);
                if take == 0 {
                    break;
                }
                let (mr, at) = if i < 2 {
                    (
                        &recv_small,
                        slot * small_stride + if i == 1 { 2048 } else { 0 },
                    )
                } else {
                    (&recv_large, slot * RECV_SGES[2])
                };
                mr.read(at, &mut buf[off..off + take]).unwrap();
                off += take;
            }
            if size > RECV_SGES[0] {
                multi_sge_recv += 1;
            }
            if size == 0 {
                zero_len += 1;
            }
            let want = patterns.get(dir as u32, seq, size);
            if &buf[..size] != want {
                let i = (0..size).find(|&i| buf[i] != want[i]).unwrap();
                panic!(
                    "direction {dir}: message {seq} ({size} bytes): byte {i} is {:#x}, want {:#x}",
                    buf[i], want[i]
                );
            }
            received[dir] += 1;
            repost.push(slot);
        }
        if !repost.is_empty() {
            rchain.clear();
            for &slot in &repost {
                rchain.push(slot as u64, &recv_sges(slot));
            }
            srq.post_recv(&mut rchain).unwrap();
        }

        // 3. send completions free the send slots (a signaled completion
        //    covers the unsignaled requests before it)
        for dir in 0..2 {
            let n = sides[dir].send_cq.poll(&mut wcs).unwrap();
            for wc in &wcs[..n] {
                wc.check().unwrap_or_else(|e| panic!("send: {e}"));
                assert_eq!(wc.opcode(), WcOpcode::Send);
                let seq = (wc.wr_id() & 0xffff_ffff) as u32;
                assert_eq!((wc.wr_id() >> 32) as usize, dir);
                in_flight[dir] = (next_seq[dir] - (seq + 1)) as usize;
            }
        }
    }
    let el = t0.elapsed();
    eprintln!(
        "{} messages verified in {el:?} ({zero_len} zero-length, {multi_sge_recv} spanning several receive SGEs)",
        received[0] + received[1]
    );
    assert!(zero_len > 0 && multi_sge_recv > 0);
    // drain the outstanding send completions
    for dir in 0..2 {
        if in_flight[dir] > 0 {
            poll_until(
                &sides[dir].send_cq,
                1,
                "final send completions",
                true,
                |_| {},
            );
        }
    }
}

#[test]
#[ignore = "needs an RDMA device (run by scripts/test-ib.sh in the rxe VM)"]
fn post_errors_report_the_bad_request() {
    let s = setup();
    let pd = s.ctx.alloc_pd().unwrap();
    let srq = pd.create_srq(16, 2).unwrap();
    let recv_cq = s.ctx.create_cq(32, None).unwrap();
    let caps = QpCaps {
        max_send_wr: 16,
        max_send_sge: 2,
        ..QpCaps::default()
    };
    let (a, _b) = connected_pair(&s, &pd, &srq, &recv_cq, caps);
    let mr = pd.alloc_buffer(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let too_many: Vec<Sge> = (0..a.qp.caps().max_send_sge + 1)
        .map(|i| mr.sge(i as usize * 8, 8).unwrap())
        .collect();
    let mut chain = SendChain::new();
    chain.push(1, SendOp::SendWithImm(1), &[], SendFlags::SIGNALED);
    chain.push(2, SendOp::SendWithImm(2), &too_many, SendFlags::SIGNALED);
    chain.push(3, SendOp::SendWithImm(3), &[], SendFlags::SIGNALED);
    let err = a.qp.post_send(&mut chain).unwrap_err();
    eprintln!("expected error: {err}");
    match err {
        Error::Post {
            call: "ibv_post_send",
            bad_index,
            errno,
        } => {
            assert_eq!(bad_index, 1);
            assert!(errno > 0);
        }
        other => panic!("unexpected {other:?}"),
    }
    // no receive buffer posted: the first request (posted) waits in RNR
    // retry; moving the QP to ERROR flushes it
    a.qp.to_error().unwrap();
    let mut statuses = Vec::new();
    poll_until(&a.send_cq, 1, "flush", false, |wc| {
        statuses.push((wc.wr_id(), wc.is_flush()))
    });
    assert_eq!(statuses, vec![(1, true)], "the posted request is flushed");
}

#[test]
#[ignore = "needs an RDMA device (run by scripts/test-ib.sh in the rxe VM)"]
fn completion_channel_wakes_up() {
    let s = setup();
    let pd = s.ctx.alloc_pd().unwrap();
    let srq = pd.create_srq(8, 1).unwrap();
    let channel = s.ctx.create_comp_channel().unwrap();
    let recv_cq = s.ctx.create_cq(16, Some(&channel)).unwrap();
    let (a, _b) = connected_pair(&s, &pd, &srq, &recv_cq, QpCaps::default());
    let mut mr = pd.alloc_buffer(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let mut rc = RecvChain::new();
    rc.push(77, &[mr.sge(2048, 2048).unwrap()]);
    srq.post_recv(&mut rc).unwrap();
    recv_cq.req_notify(false).unwrap();
    mr.write(0, b"wake up").unwrap();
    let mut sc = SendChain::new();
    sc.push(
        5,
        SendOp::SendWithImm(0xabcd),
        &[mr.sge(0, 7).unwrap()],
        SendFlags::SIGNALED,
    );
    a.qp.post_send(&mut sc).unwrap();
    let fired = channel.wait().unwrap();
    assert_eq!(fired, recv_cq.id());
    let mut got = Vec::new();
    poll_until(&recv_cq, 1, "receive after event", true, |wc| got.push(*wc));
    assert_eq!(got[0].wr_id(), 77);
    assert_eq!(got[0].imm(), Some(0xabcd));
    let mut out = [0u8; 7];
    mr.read(2048, &mut out).unwrap();
    assert_eq!(&out, b"wake up");
    poll_until(&a.send_cq, 1, "send", true, |_| {});
}

/// Posts `ops` (one SGE each, signalled) on `side` in batches of the send
/// queue's depth and waits for their completions, which must succeed with
/// `opcode`.
fn post_all(side: &Side, ops: &[(SendOp, Sge)], opcode: WcOpcode, what: &str) {
    let depth = side.qp.caps().max_send_wr as usize;
    for batch in ops.chunks(depth) {
        let mut chain = SendChain::new();
        for (i, (op, sge)) in batch.iter().enumerate() {
            chain.push(i as u64, *op, &[*sge], SendFlags::SIGNALED);
        }
        side.qp.post_send(&mut chain).unwrap();
        poll_until(&side.send_cq, batch.len(), what, true, |wc| {
            assert_eq!(wc.opcode(), opcode, "{what}")
        });
    }
}

/// Waits for `side`'s one send completion, which must be an error (not a
/// flush: the operation itself was refused).
fn expect_error_completion(side: &Side, what: &str) {
    let mut status = None;
    poll_until(&side.send_cq, 1, what, false, |wc| {
        status = Some((wc.is_success(), wc.is_flush(), wc.status_name()))
    });
    let (ok, flush, name) = status.unwrap();
    eprintln!("{what}: {name}");
    assert!(!ok && !flush, "{what} completed with {name}");
}

/// One-sided operations: RDMA WRITEs of random sizes to random offsets of
/// a peer's region land there byte for byte, RDMA READs bring them back,
/// a WRITE with immediate data consumes a receive and delivers the value;
/// a write past the region's end and a write to a region without remote
/// write access fail with an error completion that breaks only their own
/// queue pair.
#[test]
#[ignore = "needs an RDMA device (run by scripts/test-ib.sh in the rxe VM)"]
fn rdma_write_read_and_access_errors() {
    const LEN: usize = 1 << 20;
    let s = setup();
    let pd = s.ctx.alloc_pd().unwrap();
    let srq = pd.create_srq(16, 1).unwrap();
    let recv_cq = s.ctx.create_cq(64, None).unwrap();
    let caps = QpCaps {
        max_send_wr: 32,
        max_send_sge: 1,
        ..QpCaps::default()
    };
    let remote = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let (a, _b) = connected_pair_with(&s, &pd, &srq, &recv_cq, caps, remote);
    let local = AccessFlags::LOCAL_WRITE;
    let mut src = pd.alloc_buffer(LEN, local).unwrap();
    let target = pd.alloc_buffer(LEN, local | remote).unwrap();
    let dst = pd.alloc_buffer(LEN, local).unwrap();
    let mut rng = Rng(env_or("DXNET_TEST_SEED", 0x5eed_u64) | 1);
    let data: Vec<u8> = (0..LEN).map(|_| rng.next() as u8).collect();
    src.write(0, &data).unwrap();
    let at = |off: usize| target.addr() as u64 + off as u64;

    // Writes of 1 B .. 64 KiB at random offsets; later ones may overwrite
    // earlier ones (completions, and so placement, in post order).
    let mut expect = vec![0u8; LEN];
    let mut writes = Vec::new();
    for _ in 0..300 {
        let size = 1 + rng.below(64 << 10) as usize;
        let off = rng.below((LEN - size) as u64) as usize;
        let op = SendOp::RdmaWrite {
            remote_addr: at(off),
            rkey: target.rkey(),
        };
        writes.push((op, src.sge(off, size as u32).unwrap()));
        expect[off..off + size].copy_from_slice(&data[off..off + size]);
    }
    post_all(&a, &writes, WcOpcode::RdmaWrite, "rdma write");
    let mut landed = vec![0u8; LEN];
    target.read(0, &mut landed).unwrap();
    assert!(landed == expect, "written bytes differ");

    // Reads of the whole region in 64 KiB pieces.
    let reads: Vec<_> = (0..LEN / (64 << 10))
        .map(|i| {
            let off = i * (64 << 10);
            let op = SendOp::RdmaRead {
                remote_addr: at(off),
                rkey: target.rkey(),
            };
            (op, dst.sge(off, 64 << 10).unwrap())
        })
        .collect();
    post_all(&a, &reads, WcOpcode::RdmaRead, "rdma read");
    let mut back = vec![0u8; LEN];
    dst.read(0, &mut back).unwrap();
    assert!(back == expect, "read bytes differ");

    // A write with immediate data consumes a receive (no buffer needed).
    let mut rc = RecvChain::new();
    rc.push(99, &[]);
    srq.post_recv(&mut rc).unwrap();
    let op = SendOp::RdmaWriteWithImm {
        remote_addr: at(0),
        rkey: target.rkey(),
        imm: 0xfeed_0001,
    };
    post_all(
        &a,
        &[(op, src.sge(100, 300).unwrap())],
        WcOpcode::RdmaWrite,
        "write with imm",
    );
    let mut got = Vec::new();
    poll_until(&recv_cq, 1, "write-with-imm receive", true, |wc| {
        got.push(*wc)
    });
    assert_eq!(got[0].wr_id(), 99);
    assert_eq!(got[0].opcode(), WcOpcode::RecvRdmaWithImm);
    assert_eq!(got[0].imm(), Some(0xfeed_0001));
    assert_eq!(got[0].byte_len(), 300);
    let mut head = [0u8; 300];
    target.read(0, &mut head).unwrap();
    assert_eq!(head[..], data[100..400]);

    // Past the end of the region: an error completion on this queue pair.
    let (c, _d) = connected_pair_with(&s, &pd, &srq, &recv_cq, caps, remote);
    let mut chain = SendChain::new();
    let op = SendOp::RdmaWrite {
        remote_addr: at(LEN - 10),
        rkey: target.rkey(),
    };
    chain.push(1, op, &[src.sge(0, 100).unwrap()], SendFlags::SIGNALED);
    c.qp.post_send(&mut chain).unwrap();
    expect_error_completion(&c, "write past the end");
    assert_eq!(landed[LEN - 10..], {
        let mut tail = [0u8; 10];
        target.read(LEN - 10, &mut tail).unwrap();
        tail
    });

    // A region without remote write access.
    let read_only = pd
        .alloc_buffer(4096, local | AccessFlags::REMOTE_READ)
        .unwrap();
    let (e, _f) = connected_pair_with(&s, &pd, &srq, &recv_cq, caps, remote);
    let mut chain = SendChain::new();
    let op = SendOp::RdmaWrite {
        remote_addr: read_only.addr() as u64,
        rkey: read_only.rkey(),
    };
    chain.push(1, op, &[src.sge(0, 8).unwrap()], SendFlags::SIGNALED);
    e.qp.post_send(&mut chain).unwrap();
    expect_error_completion(&e, "write to a read-only region");
    let mut ro = [1u8; 8];
    read_only.read(0, &mut ro).unwrap();
    assert_eq!(ro, [0u8; 8], "nothing written");

    // The first queue pair is unaffected.
    let op = SendOp::RdmaRead {
        remote_addr: at(4096),
        rkey: target.rkey(),
    };
    post_all(
        &a,
        &[(op, dst.sge(0, 64).unwrap())],
        WcOpcode::RdmaRead,
        "read after errors",
    );
    let mut again = [0u8; 64];
    dst.read(0, &mut again).unwrap();
    assert_eq!(again[..], expect[4096..4160]);
}
