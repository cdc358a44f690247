//! Serde encoding of message payloads (bincode, fixed-width integers).
//!
//! Senders compute the exact size first (no allocation), reserve that much
//! in the ring buffer and serialize straight into it.

use std::io;

use bincode::Options;
use serde::{de::DeserializeOwned, Serialize};

use crate::depth::{DepthLimited, DEFAULT_MAX_DEPTH};

/// A payload that could not be sized, encoded or decoded (the text says
/// why).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CodecError(pub String);

/// `Result` with [`CodecError`].
pub type Result<T, E = CodecError> = std::result::Result<T, E>;

/// Deepest nesting [`decode`] accepts (see [`DepthLimited`]).
pub const MAX_DEPTH: usize = DEFAULT_MAX_DEPTH;

fn options() -> impl Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
}

/// Exact encoded size of `value`.
pub fn encoded_len<T: Serialize + ?Sized>(value: &T) -> Result<usize> {
    options()
        .serialized_size(value)
        .map(|n| n as usize)
        .map_err(|e| CodecError(format!("cannot size message: {e}")))
}

/// Serializes `value` into `w`.
pub fn encode_into<W: std::io::Write, T: Serialize + ?Sized>(
    w: W,
    value: &T,
) -> std::io::Result<()> {
    options()
        .serialize_into(w, value)
        .map_err(|e| std::io::Error::other(e.to_string()))
}

/// Deserializes a `T` from exactly `bytes`. Length fields inside the payload
/// are bounded by the payload size, so a hostile payload cannot make this
/// allocate more than it carries, and values nested more than [`MAX_DEPTH`]
/// levels deep are rejected, so it cannot overflow the stack either.
///
/// No bincode size limit: the reader checks every claimed string or byte
/// length against the bytes left before it allocates, which bounds them by
/// the payload already, while a limit would cost a check per value read
/// (twice the time for a 64-byte `Vec<u8>`). (`Options::deserialize`, used
/// before, silently replaced any limit with `Infinite` too.)
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    let mut rest = bytes;
    let value = {
        let mut de = bincode::Deserializer::with_bincode_read(Rest(&mut rest), options());
        T::deserialize(DepthLimited::new(&mut de, MAX_DEPTH))
    }
    .map_err(|e| CodecError(e.to_string()))?;
    if !rest.is_empty() {
        // bincode's own wording (`reject_trailing_bytes`).
        return Err(CodecError(
            "Slice had bytes remaining after deserialization".into(),
        ));
    }
    Ok(value)
}

/// bincode's slice reader, except that what is left unread stays visible in
/// the borrowed slice (bincode only checks it inside `Options::deserialize`,
/// which leaves no room for a wrapping deserializer). Like bincode's, it
/// checks a length against the bytes left before it copies or allocates.
struct Rest<'a, 'r>(&'r mut &'a [u8]);

impl<'a> Rest<'a, '_> {
    #[inline(always)]
    fn take(&mut self, n: usize) -> bincode::Result<&'a [u8]> {
        let s: &'a [u8] = self.0;
        if n > s.len() {
            return Err(Box::new(bincode::ErrorKind::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "",
            ))));
        }
        let (head, tail) = s.split_at(n);
        *self.0 = tail;
        Ok(head)
    }
}

impl io::Read for Rest<'_, '_> {
    #[inline(always)]
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        self.read_exact(out).map(|()| out.len())
    }

    #[inline(always)]
    fn read_exact(&mut self, out: &mut [u8]) -> io::Result<()> {
        let s: &[u8] = self.0;
        if out.len() > s.len() {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let (head, tail) = s.split_at(out.len());
        out.copy_from_slice(head);
        *self.0 = tail;
        Ok(())
    }
}

impl<'a> bincode::BincodeRead<'a> for Rest<'a, '_> {
    #[inline(always)]
    fn forward_read_str<V: serde::de::Visitor<'a>>(
        &mut self,
        length: usize,
        visitor: V,
    ) -> bincode::Result<V::Value> {
        match std::str::from_utf8(self.take(length)?) {
            Ok(s) => visitor.visit_borrowed_str(s),
            Err(e) => Err(Box::new(bincode::ErrorKind::InvalidUtf8Encoding(e))),
        }
    }

    #[inline(always)]
    fn get_byte_buffer(&mut self, length: usize) -> bincode::Result<Vec<u8>> {
        self.take(length).map(<[u8]>::to_vec)
    }

    #[inline(always)]
    fn forward_read_bytes<V: serde::de::Visitor<'a>>(
        &mut self,
        length: usize,
        visitor: V,
    ) -> bincode::Result<V::Value> {
        visitor.visit_borrowed_bytes(self.take(length)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    enum E {
        A(u8),
        B { s: String },
    }
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Nested {
        v: Vec<Option<E>>,
        name: String,
        t: (u64, i32),
    }

    #[test]
    fn roundtrip_nested_and_exact_size() {
        let n = Nested {
            v: vec![Some(E::A(1)), None, Some(E::B { s: "x".into() })],
            name: "hello".into(),
            t: (7, -3),
        };
        let len = encoded_len(&n).unwrap();
        let mut buf = Vec::new();
        encode_into(&mut buf, &n).unwrap();
        assert_eq!(buf.len(), len);
        assert_eq!(decode::<Nested>(&buf).unwrap(), n);
        assert!(decode::<Nested>(&buf[..len - 1]).is_err());
    }

    #[test]
    fn hostile_length_is_rejected() {
        // A Vec<u8> claiming 2^60 elements in 8 bytes.
        let bytes = (1u64 << 60).to_le_bytes();
        assert!(decode::<Vec<u8>>(&bytes).is_err());
        // A string or byte buffer claiming (nearly) 2^64 bytes: checked
        // against the payload before anything is allocated.
        for len in [1u64 << 60, u64::MAX] {
            let mut bytes = len.to_le_bytes().to_vec();
            bytes.extend_from_slice(b"abc");
            assert!(decode::<String>(&bytes).is_err());
            assert!(decode::<(u8, String)>(&bytes).is_err());
        }
    }

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    enum Tree {
        Leaf,
        Node(Box<Tree>),
    }
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct L(Option<Box<L>>);
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct V(Vec<V>);
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    enum M {
        End,
        Map(std::collections::BTreeMap<u8, M>),
        Pair(u8, Box<M>),
        Named { x: i16, next: Option<Box<M>> },
    }

    /// `Node` `nodes` times, then `Leaf`: `nodes + 1` levels.
    fn tree_bytes(nodes: usize) -> Vec<u8> {
        let mut b = 1u32.to_le_bytes().repeat(nodes);
        b.extend_from_slice(&0u32.to_le_bytes());
        b
    }
    /// `L(Some(..))` `somes` times, then `L(None)`: newtype + Some per level.
    fn list_bytes(somes: usize) -> Vec<u8> {
        let mut b = vec![1u8; somes];
        b.push(0);
        b
    }
    /// `V(vec![..])` `ones` times, then `V(vec![])`: newtype + seq per level.
    fn vec_bytes(ones: usize) -> Vec<u8> {
        let mut b = 1u64.to_le_bytes().repeat(ones);
        b.extend_from_slice(&0u64.to_le_bytes());
        b
    }
    /// `M::Map({7: ..})` `maps` times, then `M::End`: enum + map per level.
    fn map_bytes(maps: usize) -> Vec<u8> {
        let mut level = 1u32.to_le_bytes().to_vec();
        level.extend_from_slice(&1u64.to_le_bytes());
        level.push(7);
        let mut b = level.repeat(maps);
        b.extend_from_slice(&0u32.to_le_bytes());
        b
    }

    fn assert_too_deep<T: DeserializeOwned + std::fmt::Debug>(bytes: &[u8]) {
        match decode::<T>(bytes) {
            Err(CodecError(m)) => assert!(
                m.contains(&format!("nesting deeper than {MAX_DEPTH} levels")),
                "{m}"
            ),
            other => panic!("expected a depth error, got {other:?}"),
        }
    }

    #[test]
    fn hostile_deep_payloads_fail_without_overflowing() {
        const SIZE: usize = 10 << 20;
        assert_too_deep::<Tree>(&tree_bytes(SIZE / 4));
        assert_too_deep::<L>(&list_bytes(SIZE));
        assert_too_deep::<V>(&vec_bytes(SIZE / 8));
        assert_too_deep::<M>(&map_bytes(SIZE / 13));
        // The same nesting inside ordinary containers.
        let mut b = 1u64.to_le_bytes().to_vec();
        b.extend_from_slice(&tree_bytes(SIZE / 4));
        assert_too_deep::<Vec<Tree>>(&b);
        let mut b = vec![1u8];
        b.extend_from_slice(&list_bytes(SIZE));
        assert_too_deep::<(Option<L>,)>(&b);
    }

    #[test]
    fn depth_limit_boundary() {
        // Tree: one level per node and one for the leaf.
        assert!(decode::<Tree>(&tree_bytes(MAX_DEPTH - 1)).is_ok());
        assert_too_deep::<Tree>(&tree_bytes(MAX_DEPTH));
        // L: two levels per Some, one for the last L.
        assert!(decode::<L>(&list_bytes((MAX_DEPTH - 1) / 2)).is_ok());
        assert_too_deep::<L>(&list_bytes(MAX_DEPTH / 2));
    }

    #[test]
    fn deepest_accepted_values_fit_a_default_thread_stack() {
        // Handler threads get the default 2 MiB stack.
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(|| {
                assert!(decode::<Tree>(&tree_bytes(MAX_DEPTH - 1)).is_ok());
                assert!(decode::<L>(&list_bytes((MAX_DEPTH - 1) / 2)).is_ok());
                assert!(decode::<V>(&vec_bytes((MAX_DEPTH - 1) / 2)).is_ok());
                assert!(decode::<M>(&map_bytes((MAX_DEPTH - 1) / 2)).is_ok());
            })
            .unwrap()
            .join()
            .unwrap();
    }

    #[test]
    fn nested_values_at_depth_100_roundtrip() {
        let mut t = Tree::Leaf;
        let mut l = L(None);
        let mut v = V(Vec::new());
        let mut m = M::End;
        for i in 0..100 {
            t = Tree::Node(Box::new(t));
            l = L(Some(Box::new(l)));
            v = V(vec![v]);
            m = match i % 3 {
                0 => M::Map([(i as u8, m)].into()),
                1 => M::Pair(i as u8, Box::new(m)),
                _ => M::Named {
                    x: -(i as i16),
                    next: Some(Box::new(m)),
                },
            };
        }
        fn rt<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(v: &T) {
            let mut buf = Vec::new();
            encode_into(&mut buf, v).unwrap();
            assert_eq!(buf.len(), encoded_len(v).unwrap());
            assert_eq!(&decode::<T>(&buf).unwrap(), v);
        }
        rt(&t);
        rt(&l);
        rt(&v);
        rt(&m);
        let mut deep_vec: Vec<Vec<Vec<Vec<u8>>>> = vec![vec![vec![vec![1, 2]], vec![]]; 3];
        deep_vec.push(Vec::new());
        rt(&deep_vec);
    }

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Unit;
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Wrapper(u16);
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Everything {
        nested: Nested,
        map: std::collections::HashMap<String, Vec<(u8, Option<E>)>>,
        tree: std::collections::BTreeMap<(i64, char), M>,
        opt: Option<Option<String>>,
        tuple: (Unit, Wrapper, (), bool, f64, u128, i8),
        array: [Option<Wrapper>; 3],
        bytes: Vec<u8>,
        text: String,
        empty: Vec<String>,
    }

    #[test]
    fn roundtrip_all_shapes() {
        let e = Everything {
            nested: Nested {
                v: vec![None, Some(E::B { s: "é€".into() })],
                name: String::new(),
                t: (u64::MAX, i32::MIN),
            },
            map: [
                ("a".to_string(), vec![(1, None), (2, Some(E::A(9)))]),
                ("".to_string(), vec![]),
            ]
            .into(),
            tree: [
                ((-1, 'λ'), M::End),
                (
                    (5, 'x'),
                    M::Named {
                        x: 3,
                        next: Some(Box::new(M::Pair(1, Box::new(M::Map(Default::default()))))),
                    },
                ),
            ]
            .into(),
            opt: Some(None),
            tuple: (Unit, Wrapper(513), (), true, -0.5, u128::MAX - 1, -128),
            array: [Some(Wrapper(1)), None, Some(Wrapper(u16::MAX))],
            bytes: (0..=255).collect(),
            text: "hello, world".into(),
            empty: vec![],
        };
        let mut buf = Vec::new();
        encode_into(&mut buf, &e).unwrap();
        assert_eq!(buf.len(), encoded_len(&e).unwrap());
        assert_eq!(decode::<Everything>(&buf).unwrap(), e);
        // Every proper prefix fails, and so does a trailing byte.
        for n in 0..buf.len() {
            assert!(decode::<Everything>(&buf[..n]).is_err(), "prefix {n}");
        }
        buf.push(0);
        match decode::<Everything>(&buf) {
            Err(CodecError(m)) => assert!(m.contains("bytes remaining"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn invalid_encodings_are_still_rejected() {
        // Bad bool, bad Option tag, bad variant index, bad UTF-8, bad char.
        assert!(decode::<bool>(&[2]).is_err());
        assert!(decode::<Option<u8>>(&[2, 0]).is_err());
        assert!(decode::<E>(&[9, 0, 0, 0, 0]).is_err());
        let mut s = 2u64.to_le_bytes().to_vec();
        s.extend_from_slice(&[0xff, 0xfe]);
        assert!(decode::<String>(&s).is_err());
        assert!(decode::<char>(&[0xff]).is_err());
        // A string claiming more bytes than the payload has.
        let mut s = 100u64.to_le_bytes().to_vec();
        s.extend_from_slice(b"abc");
        assert!(decode::<String>(&s).is_err());
        assert!(decode::<()>(&[]).is_ok());
        assert!(decode::<()>(&[0]).is_err());
    }

    /// The previous `decode` (plain bincode, no depth limit; its size limit is
    /// replaced by `Infinite` inside `Options::deserialize`), for the benchmark.
    fn decode_before<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
        options()
            .with_limit(bytes.len() as u64)
            .reject_trailing_bytes()
            .deserialize(bytes)
            .map_err(|e| CodecError(e.to_string()))
    }

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Small {
        id: u64,
        seq: u32,
        flag: bool,
        name: String,
        pos: (f64, f64),
    }

    /// cargo test -p dxnet --release --lib codec::tests::decode_overhead -- --ignored --nocapture
    #[test]
    #[ignore = "micro-benchmark: run in release"]
    fn decode_overhead() {
        use std::hint::black_box;
        use std::time::Instant;
        const N: u32 = 1_000_000;
        fn time<T: DeserializeOwned>(bytes: &[u8], f: fn(&[u8]) -> Result<T>) -> f64 {
            (0..5)
                .map(|_| {
                    let t = Instant::now();
                    for _ in 0..N {
                        black_box(f(black_box(bytes)).unwrap());
                    }
                    t.elapsed().as_secs_f64() * 1e9 / N as f64
                })
                .fold(f64::INFINITY, f64::min)
        }
        let mut vec_bytes = Vec::new();
        encode_into(&mut vec_bytes, &(0..64).collect::<Vec<u8>>()).unwrap();
        let mut small_bytes = Vec::new();
        let small = Small {
            id: 42,
            seq: 7,
            flag: true,
            name: "node-0042".into(),
            pos: (1.5, -2.25),
        };
        encode_into(&mut small_bytes, &small).unwrap();
        for (name, plain, limited) in [
            (
                "Vec<u8> (64 bytes)",
                time::<Vec<u8>>(&vec_bytes, decode_before),
                time::<Vec<u8>>(&vec_bytes, decode),
            ),
            (
                "Small (5 fields)",
                time::<Small>(&small_bytes, decode_before),
                time::<Small>(&small_bytes, decode),
            ),
        ] {
            println!(
                "{name}: before {plain:.1} ns, after (depth-limited) {limited:.1} ns ({:+.1}%)",
                (limited / plain - 1.0) * 100.0
            );
        }
    }
}
