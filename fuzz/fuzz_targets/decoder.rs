//! Decoder::feed with the stream cut at fuzzer-chosen points (message
//! reassembly across receive buffers): never panics, every emitted payload
//! has its header's length and respects the limit, and the cut stream
//! yields exactly what the uncut stream yields (messages and error).
//! `MessageBounds` walking the same pieces ends between messages exactly
//! when the decoder is idle.
//!
//! Input: [max payload: u24 LE][n: u8][n × u16 cut offsets][stream].
#![no_main]

use dxnet_fuzz::{pieces, split_input};
use dxnet_proto::bounds::MessageBounds;
use dxnet_proto::decoder::Decoder;
use dxnet_proto::header::MessageHeader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let max = u32::from_le_bytes([data[0], data[1], data[2], 0]) as usize;
    let Some((cuts, stream)) = split_input(&data[3..]) else {
        return;
    };
    let check = |h: &MessageHeader, p: &[u8]| {
        assert_eq!(p.len(), h.payload_len as usize, "payload length != header");
        assert!(p.len() <= max, "payload above max_message_size");
    };

    let mut whole: Vec<(MessageHeader, Vec<u8>)> = Vec::new();
    let mut d = Decoder::new(max);
    let r_whole = d.feed(stream, |h, p| {
        check(h, p);
        whole.push((*h, p.to_vec()));
    });
    let idle_whole = d.is_idle();

    let mut split: Vec<(MessageHeader, Vec<u8>)> = Vec::new();
    let mut d = Decoder::new(max);
    let mut r_split = Ok(());
    let mut bounds = MessageBounds::new();
    for piece in pieces(stream, &cuts) {
        r_split = d.feed(piece, |h, p| {
            check(h, p);
            split.push((*h, p.to_vec()));
        });
        if r_split.is_err() {
            break;
        }
        bounds.feed(piece);
        assert_eq!(
            bounds.open().is_none(),
            d.is_idle(),
            "message bounds disagree with the decoder"
        );
    }
    assert_eq!(whole, split, "cutting the stream changed the messages");
    assert_eq!(r_whole, r_split, "cutting the stream changed the outcome");
    if r_split.is_ok() {
        assert_eq!(idle_whole, d.is_idle());
    } else {
        // A failed stream stays failed and emits nothing more.
        assert!(d
            .feed(stream, |_, _| panic!("message after error"))
            .is_err());
    }
});
