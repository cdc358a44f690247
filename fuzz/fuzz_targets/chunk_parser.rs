//! ChunkParser::parse (the TCP chunk framing, carrying flow-control units)
//! with the stream cut at fuzzer-chosen points, as `read` would: never
//! panics, every data range lies within its read, ranges are in order and
//! disjoint, and data bytes + header bytes account for every input byte
//! exactly as a straightforward reference parser of the whole stream says.
//!
//! Input: [n: u8][n × u16 cut offsets][stream].
#![no_main]

use dxnet_fuzz::{pieces, split_input};
use dxnet_proto::wire::{ChunkParser, CHUNK_HEADER_LEN};
use libfuzzer_sys::fuzz_target;

/// Reference: (message bytes, flow-control units of each chunk, header
/// bytes, ends at a chunk boundary).
fn reference(stream: &[u8]) -> (Vec<u8>, Vec<u32>, usize, bool) {
    let (mut data, mut units, mut hdr) = (Vec::new(), Vec::new(), 0);
    let mut i = 0;
    while i < stream.len() {
        if stream.len() - i < CHUNK_HEADER_LEN {
            hdr += stream.len() - i;
            return (data, units, hdr, false);
        }
        let h = &stream[i..i + CHUNK_HEADER_LEN];
        let len = u32::from_le_bytes(h[..4].try_into().unwrap()) as usize;
        let u = u32::from_le_bytes(h[4..].try_into().unwrap());
        hdr += CHUNK_HEADER_LEN;
        i += CHUNK_HEADER_LEN;
        if u > 0 {
            units.push(u);
        }
        let take = len.min(stream.len() - i);
        data.extend_from_slice(&stream[i..i + take]);
        i += take;
        if take < len {
            return (data, units, hdr, false);
        }
    }
    (data, units, hdr, true)
}

fuzz_target!(|data: &[u8]| {
    let Some((cuts, stream)) = split_input(data) else {
        return;
    };
    let mut p = ChunkParser::default();
    let (mut got, mut units) = (Vec::new(), Vec::new());
    for piece in pieces(stream, &cuts) {
        let mut last_end = 0;
        p.parse(
            piece,
            |r| {
                assert!(
                    r.start <= r.end && r.end <= piece.len(),
                    "range {r:?} outside read"
                );
                assert!(r.start >= last_end, "ranges overlap or go backwards");
                assert!(r.start < r.end, "empty data range");
                last_end = r.end;
                got.extend_from_slice(&piece[r]);
            },
            |u| units.push(u),
        );
    }
    let (want, want_units, hdr, idle) = reference(stream);
    assert_eq!(got.len() + hdr, stream.len(), "bytes unaccounted for");
    assert_eq!(got, want, "message bytes differ from the reference");
    assert_eq!(units, want_units, "flow-control units differ");
    assert_eq!(p.is_idle(), idle || stream.is_empty());
});
