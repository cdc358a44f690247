//! Shared pieces of the fuzz targets: the input layouts (so the seed-corpus
//! generator and the targets agree) and the nested serde type that
//! `payload_decode` decodes.

use serde::{Deserialize, Serialize};

/// Cut points are encoded as up to this many little-endian u16 offsets.
pub const MAX_CUTS: usize = 32;

/// Splits `data` into `[n: u8][n × u16 cut offsets][stream]`; the cuts are
/// clamped to the stream and sorted, so every input is valid.
pub fn split_input(data: &[u8]) -> Option<(Vec<usize>, &[u8])> {
    let (&n, rest) = data.split_first()?;
    let n = n as usize % (MAX_CUTS + 1);
    if rest.len() < 2 * n {
        return None;
    }
    let (cuts, stream) = rest.split_at(2 * n);
    let mut cuts: Vec<usize> = cuts
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]) as usize % (stream.len() + 1))
        .collect();
    cuts.sort_unstable();
    Some((cuts, stream))
}

/// The pieces of `stream` between sorted `cuts` (empty pieces included: a
/// `read` of zero message bytes must be harmless too).
pub fn pieces<'a>(stream: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut out = Vec::with_capacity(cuts.len() + 1);
    let mut at = 0;
    for &c in cuts {
        out.push(&stream[at..c]);
        at = c;
    }
    out.push(&stream[at..]);
    out
}

/// Builds a split input (the inverse of [`split_input`]).
pub fn make_split_input(cuts: &[u16], stream: &[u8]) -> Vec<u8> {
    assert!(cuts.len() <= MAX_CUTS);
    let mut v = vec![cuts.len() as u8];
    for c in cuts {
        v.extend_from_slice(&c.to_le_bytes());
    }
    v.extend_from_slice(stream);
    v
}

/// A deliberately varied message type: sequences, options, enums, strings,
/// chars, bools, arrays, tuples, boxes and (bounded by the input) recursion.
#[derive(Serialize, Deserialize, Debug, PartialEq, Eq, Clone)]
pub struct Nested {
    pub items: Vec<Option<Item>>,
    pub name: String,
    pub pair: (u64, i32),
    pub flags: [bool; 3],
    pub letter: char,
    pub blob: Vec<u8>,
    pub table: Vec<(u16, String)>,
    pub child: Option<Box<Nested>>,
}

/// Enum payloads of [`Nested`].
#[derive(Serialize, Deserialize, Debug, PartialEq, Eq, Clone)]
pub enum Item {
    Unit,
    Small(u8),
    Text { s: String, n: u128 },
    List(Vec<u32>),
    Pair(Box<Item>, i16),
}

/// A sample value for the seed corpus.
pub fn sample(depth: usize) -> Nested {
    Nested {
        items: vec![
            Some(Item::Small(7)),
            None,
            Some(Item::Text {
                s: "dxnet".into(),
                n: u128::MAX / 3,
            }),
            Some(Item::List(vec![1, 2, 3])),
            Some(Item::Pair(Box::new(Item::Unit), -5)),
        ],
        name: "node ☃".into(),
        pair: (u64::MAX, -1),
        flags: [true, false, true],
        letter: 'ß',
        blob: (0..40).collect(),
        table: vec![(1, "one".into()), (2, String::new())],
        child: (depth > 0).then(|| Box::new(sample(depth - 1))),
    }
}
