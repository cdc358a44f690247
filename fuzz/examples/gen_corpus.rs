//! Writes the seed corpus under fuzz/corpus/<target>/: a few valid and a
//! few broken inputs per target. Run from fuzz/: `cargo run --example gen_corpus`.

use std::path::Path;

use dxnet_fuzz::{make_split_input, sample, Item};
use dxnet_proto::codec::encode_into;
use dxnet_proto::header::{MessageHeader, FLAG_ERROR, FLAG_REQUEST, FLAG_RESPONSE, HEADER_LEN};
use dxnet_proto::region::{
    Access, Descriptor, Notify, NotifyFrame, RdmaKey, ReadRequest, RegionRef, WriteHead,
};
use dxnet_proto::wire::{
    encode_chunk_header, CloseNotice, DatagramHeader, HandshakeMsg, Hello, Status, ENDPOINT_LEN,
};

fn header(t: u8, flags: u8, id: u32, len: u32) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    MessageHeader {
        msg_type: t,
        subtype: 1,
        flags,
        request_id: id,
        payload_len: len,
    }
    .encode(&mut b);
    b
}

fn message(t: u8, flags: u8, id: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = header(t, flags, id, payload.len() as u32).to_vec();
    v.extend_from_slice(payload);
    v
}

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join(name), bytes).unwrap();
}

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let max = (1u32 << 16).to_le_bytes();

    // message_header: 12 header bytes + optional u32 limit.
    for (name, h) in [
        ("plain", header(10, 0, 0, 100)),
        ("request", header(11, FLAG_REQUEST, 7, 3)),
        ("response", header(11, FLAG_RESPONSE, 7, 0)),
        (
            "error_response",
            header(11, FLAG_RESPONSE | FLAG_ERROR, 9, 3),
        ),
        ("len_4gib", header(10, 0, 0, u32::MAX)),
    ] {
        let mut v = h.to_vec();
        v.extend_from_slice(&max);
        write(&dir, "message_header", name, &v);
    }
    let mut bad = header(10, FLAG_REQUEST | FLAG_RESPONSE, 0, 1).to_vec();
    bad[0] = 0;
    write(&dir, "message_header", "bad_magic_flags", &bad);

    // decoder: [max u24][cuts][stream].
    let mut stream = Vec::new();
    for i in 0..6u8 {
        let p: Vec<u8> = (0..i as usize * 13).map(|x| x as u8 ^ i).collect();
        stream.extend(message(
            10 + i,
            if i % 2 == 0 { 0 } else { FLAG_REQUEST },
            i as u32,
            &p,
        ));
    }
    let with_max = |m: u32, cuts: &[u16], s: &[u8]| {
        let mut v = m.to_le_bytes()[..3].to_vec();
        v.extend(make_split_input(cuts, s));
        v
    };
    write(&dir, "decoder", "six_uncut", &with_max(4096, &[], &stream));
    write(
        &dir,
        "decoder",
        "six_cut",
        &with_max(4096, &[1, 5, 12, 13, 40, 41, 200], &stream),
    );
    let mut huge = stream[..30].to_vec();
    huge.extend(header(10, 0, 0, u32::MAX));
    huge.extend_from_slice(&[1, 2, 3]);
    write(&dir, "decoder", "len_4gib", &with_max(4096, &[20], &huge));
    let mut over = message(10, 0, 0, &[7; 64]);
    over.extend(header(10, 0, 0, 5000));
    write(
        &dir,
        "decoder",
        "over_max",
        &with_max(4096, &[3, 70], &over),
    );
    write(
        &dir,
        "decoder",
        "garbage",
        &with_max(100, &[2], b"not a dxnet stream at all"),
    );

    // handshake: HANDSHAKE_LEN bytes (+ optional secret).
    let hello = Hello {
        node_id: 2,
        target_id: 1,
        instance: 0x1234_5678_9abc_def0,
        fc_window: 4 << 20,
        fc_unit: 2 << 20,
        nonce: [3; 16],
        codec: dxnet_proto::codec::CODEC_ID,
        endpoint: [4; ENDPOINT_LEN],
    };
    write(
        &dir,
        "handshake",
        "hello",
        &HandshakeMsg::Hello(hello).encode(),
    );
    let mut reply = HandshakeMsg::Reply(hello, [9; 32]).encode().to_vec();
    reply.extend_from_slice(b"cluster secret");
    write(&dir, "handshake", "reply_with_secret", &reply);
    write(
        &dir,
        "handshake",
        "proof",
        &HandshakeMsg::Proof([1; 32]).encode(),
    );
    write(
        &dir,
        "handshake",
        "final_authfailed",
        &HandshakeMsg::Final(Status::AuthFailed).encode(),
    );
    let mut v = HandshakeMsg::Final(Status::Accept).encode();
    v[8] = 2;
    write(&dir, "handshake", "wrong_version", &v);

    // chunk_parser: [cuts][stream of chunks].
    let mut chunks = Vec::new();
    for (i, len) in [0usize, 5, 300, 1].into_iter().enumerate() {
        chunks.extend_from_slice(&encode_chunk_header(len as u32, i as u32));
        chunks.extend((0..len).map(|x| x as u8));
    }
    write(
        &dir,
        "chunk_parser",
        "four_uncut",
        &make_split_input(&[], &chunks),
    );
    write(
        &dir,
        "chunk_parser",
        "four_cut",
        &make_split_input(&[3, 8, 9, 100, 314], &chunks),
    );
    let mut big = encode_chunk_header(u32::MAX, u32::MAX).to_vec();
    big.extend_from_slice(&[0xAB; 40]);
    write(
        &dir,
        "chunk_parser",
        "len_4gib",
        &make_split_input(&[4, 20], &big),
    );
    write(
        &dir,
        "chunk_parser",
        "partial_header",
        &make_split_input(&[2], &[1, 0, 0]),
    );

    // payload_decode: the codec's encoding of the nested types.
    let enc = |v: &dyn erased::Enc| v.bytes();
    write(&dir, "payload_decode", "nested0", &enc(&sample(0)));
    write(&dir, "payload_decode", "nested2", &enc(&sample(2)));
    write(
        &dir,
        "payload_decode",
        "items",
        &enc(&vec![Item::Unit, Item::Small(1), Item::List(vec![5; 4])]),
    );
    write(
        &dir,
        "payload_decode",
        "tuple",
        &enc(&("key".to_string(), vec![1u64, 2, 3], Some('x'))),
    );
    // `items` claiming 2^60 elements (a varint of nine bytes).
    let mut hostile = vec![0x80; 8];
    hostile.push(0x10);
    hostile.extend_from_slice(&enc(&sample(0))[1..]);
    write(&dir, "payload_decode", "hostile_len", &hostile);
    // ib_datagram: [secret length][secret][datagram].
    let notice = CloseNotice {
        src: 1,
        dst: 2,
        src_endpoint: [7; ENDPOINT_LEN],
        dst_endpoint: [8; ENDPOINT_LEN],
    };
    let mut v = vec![0u8];
    v.extend_from_slice(&notice.encode(None, None));
    write(&dir, "ib_datagram", "close_no_secret", &v);
    let mut v = vec![6u8];
    v.extend_from_slice(b"secret");
    v.extend_from_slice(&notice.encode(Some(b"secret"), None));
    write(&dir, "ib_datagram", "close_with_secret", &v);
    let mut v = vec![0u8];
    v.extend_from_slice(&notice.encode(None, None)[..60]);
    write(&dir, "ib_datagram", "truncated", &v);
    let mut v = vec![0u8];
    v.extend_from_slice(
        &DatagramHeader {
            dialer: 1,
            acceptor: 2,
            to_acceptor: true,
            session: [3; 8],
        }
        .encode(),
    );
    v.extend_from_slice(&HandshakeMsg::Hello(hello).encode());
    write(&dir, "ib_datagram", "hello_datagram", &v);

    // discovery_datagram: [secret length][secret][datagram].
    let probe = dxnet_proto::discovery::Announcement {
        kind: dxnet_proto::discovery::Kind::Probe,
        sender: 4,
        subject: 4,
        instance: 99,
        nonce: [5; 16],
        address: "10.0.0.4:7000".into(),
    };
    let mut v = vec![0u8];
    v.extend_from_slice(&probe.encode(None, None));
    write(&dir, "discovery_datagram", "probe_no_secret", &v);
    let mut v = vec![6u8];
    v.extend_from_slice(b"secret");
    v.extend_from_slice(&probe.encode(Some(b"secret"), None));
    write(&dir, "discovery_datagram", "probe_with_secret", &v);
    let mut v = vec![0u8];
    v.extend_from_slice(&probe.encode(None, None)[..40]);
    write(&dir, "discovery_datagram", "truncated", &v);

    // region_descriptor: [offset u64][len u64][write u8][descriptor].
    let desc = |access, rdma| Descriptor {
        node: 3,
        id: 7,
        key: 0x0123_4567_89ab_cdef,
        len: 1 << 20,
        access,
        rdma,
    };
    let rdma = Some(RdmaKey {
        addr: 0x7f00_0000_0000,
        rkey: 0x1234,
    });
    for (name, offset, len, is_write, d) in [
        (
            "write_in",
            4096u64,
            64u64,
            1u8,
            desc(Access::ReadWrite, rdma),
        ),
        (
            "read_end",
            (1 << 20) - 8,
            8,
            0,
            desc(Access::ReadOnly, None),
        ),
        ("write_ro", 0, 1, 1, desc(Access::ReadOnly, rdma)),
        ("overflow", u64::MAX, 2, 0, desc(Access::ReadWrite, None)),
        ("local_only", 0, 1, 0, desc(Access::LocalOnly, None)),
    ] {
        let mut v = offset.to_le_bytes().to_vec();
        v.extend_from_slice(&len.to_le_bytes());
        v.push(is_write);
        v.extend_from_slice(&enc(&d));
        write(&dir, "region_descriptor", name, &v);
    }

    // region_frames: [selector][frame].
    let target = RegionRef {
        id: 7,
        key: 0x0123_4567_89ab_cdef,
    };
    for (name, notify) in [
        ("write", None),
        (
            "write_notify",
            Some(Notify {
                imm: 42,
                start: 100,
            }),
        ),
    ] {
        let mut v = vec![0u8];
        v.extend_from_slice(
            &WriteHead {
                region: target,
                offset: 4096,
                notify,
            }
            .encode(),
        );
        v.extend_from_slice(b"data");
        write(&dir, "region_frames", name, &v);
    }
    let mut v = vec![1u8];
    v.extend_from_slice(
        &ReadRequest {
            region: target,
            offset: 4096,
            len: 65536,
        }
        .encode(),
    );
    write(&dir, "region_frames", "read", &v);
    write(&dir, "region_frames", "answer_ok", b"\x02\x00abc");
    write(&dir, "region_frames", "answer_refused", b"\x02\x02");
    let mut v = vec![3u8];
    v.extend_from_slice(
        &NotifyFrame {
            region: target,
            start: 0,
            len: 4096,
            imm: 9,
        }
        .encode(),
    );
    write(&dir, "region_frames", "notify", &v);

    println!("corpus written to {}", dir.display());
}

mod erased {
    /// Object-safe "encode me".
    pub trait Enc {
        fn bytes(&self) -> Vec<u8>;
    }
    impl<T: serde::Serialize> Enc for T {
        fn bytes(&self) -> Vec<u8> {
            let mut v = Vec::new();
            super::encode_into(&mut v, self).unwrap();
            v
        }
    }
}
