use super::*;

/// The varint (LEB128) encoding of `v`.
fn varint(mut v: u64) -> Vec<u8> {
    let mut b = Vec::new();
    while v >= 0x80 {
        b.push(v as u8 | 0x80);
        v >>= 7;
    }
    b.push(v as u8);
    b
}

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
    // A Vec<u8> claiming 2^60 elements in 9 bytes.
    assert!(decode::<Vec<u8>>(&varint(1 << 60)).is_err());
    // A string or byte buffer claiming (nearly) 2^64 bytes: checked
    // against the payload before anything is allocated.
    for len in [1u64 << 60, u64::MAX] {
        let mut bytes = varint(len);
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
    let mut b = vec![1u8; nodes];
    b.push(0);
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
    let mut b = vec![1u8; ones];
    b.push(0);
    b
}
/// `M::Map({7: ..})` `maps` times, then `M::End`: enum + map per level.
fn map_bytes(maps: usize) -> Vec<u8> {
    // Variant 1 (`Map`), one entry, key 7.
    let mut b = [1u8, 1, 7].repeat(maps);
    b.push(0);
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
    assert_too_deep::<Tree>(&tree_bytes(SIZE));
    assert_too_deep::<L>(&list_bytes(SIZE));
    assert_too_deep::<V>(&vec_bytes(SIZE));
    assert_too_deep::<M>(&map_bytes(SIZE / 3));
    // The same nesting inside ordinary containers.
    let mut b = vec![1u8];
    b.extend_from_slice(&tree_bytes(SIZE));
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

fn everything() -> Everything {
    Everything {
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
    }
}

#[test]
fn roundtrip_all_shapes() {
    let e = everything();
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
        Err(CodecError(m)) => assert!(m.contains("1 bytes remaining"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn invalid_encodings_are_still_rejected() {
    // Bad bool, bad Option tag, bad variant index, bad UTF-8, bad char.
    assert!(decode::<bool>(&[2]).is_err());
    assert!(decode::<Option<u8>>(&[2, 0]).is_err());
    assert!(decode::<E>(&[9, 0]).is_err());
    assert!(decode::<String>(&[2, 0xff, 0xfe]).is_err());
    assert!(decode::<char>(&[1, 0xff]).is_err());
    assert!(decode::<char>(&[2, b'a', b'b']).is_err());
    assert!(decode::<char>(&[0]).is_err());
    // A string claiming more bytes than the payload has.
    assert!(decode::<String>(&[100, b'a', b'b', b'c']).is_err());
    assert!(decode::<()>(&[]).is_ok());
    assert!(decode::<()>(&[0]).is_err());
    // Self-describing shapes have no encoding here.
    assert!(decode::<serde_json::Value>(&[0]).is_err());
}

#[test]
fn varints_have_one_encoding_and_fit_their_type() {
    assert_eq!(decode::<u16>(&[0xff, 0xff, 0x03]).unwrap(), u16::MAX);
    assert!(decode::<u16>(&[0xff, 0xff, 0x04]).is_err());
    assert!(decode::<u16>(&[0x80, 0x80, 0x80, 0x01]).is_err());
    assert_eq!(
        decode::<u32>(&[0xff, 0xff, 0xff, 0xff, 0x0f]).unwrap(),
        u32::MAX
    );
    assert!(decode::<u32>(&[0xff, 0xff, 0xff, 0xff, 0x10]).is_err());
    assert_eq!(decode::<u64>(&varint(u64::MAX)).unwrap(), u64::MAX);
    let mut over = varint(u64::MAX);
    *over.last_mut().unwrap() = 0x02;
    assert!(decode::<u64>(&over).is_err());
    let mut b = Vec::new();
    encode_into(&mut b, &u128::MAX).unwrap();
    assert_eq!(b.len(), 19);
    assert_eq!(decode::<u128>(&b).unwrap(), u128::MAX);
    *b.last_mut().unwrap() = 0x04;
    assert!(decode::<u128>(&b).is_err());
    // Trailing zero groups: 0 and 1 in two bytes.
    for long in [[0x80, 0x00], [0x81, 0x00]] {
        match decode::<u32>(&long) {
            Err(CodecError(m)) => assert!(m.contains("zero group"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
    // Zigzag: small magnitudes of either sign in one byte.
    for (v, byte) in [(0i64, 0u8), (-1, 1), (1, 2), (-64, 127)] {
        let mut b = Vec::new();
        encode_into(&mut b, &v).unwrap();
        assert_eq!(b, [byte]);
        assert_eq!(decode::<i64>(&b).unwrap(), v);
    }
    for v in [i16::MIN, i16::MAX] {
        let mut b = Vec::new();
        encode_into(&mut b, &v).unwrap();
        assert_eq!(decode::<i16>(&b).unwrap(), v);
    }
}

#[test]
fn zero_sized_elements_are_bounded() {
    // 2^62 units claimed in 9 bytes would loop for ages.
    match decode::<Vec<()>>(&varint(1 << 62)) {
        Err(CodecError(m)) => assert!(m.contains("more elements than"), "{m}"),
        other => panic!("{other:?}"),
    }
    let mut b = varint(1 << 62);
    b.push(0);
    assert!(decode::<std::collections::HashMap<(), ()>>(&b).is_err());
    // Sensible counts still decode.
    let units = vec![(); 1000];
    let mut b = Vec::new();
    encode_into(&mut b, &units).unwrap();
    assert_eq!(decode::<Vec<()>>(&b).unwrap(), units);
}

#[test]
fn errors_raised_by_values_keep_their_text() {
    // A variant index one build knows and another does not.
    match decode::<E>(&[9, 0]) {
        Err(CodecError(m)) => assert!(m.contains("variant index"), "{m}"),
        other => panic!("{other:?}"),
    }
    #[derive(Debug)]
    struct Even(u8);
    impl<'de> serde::Deserialize<'de> for Even {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            let v = u8::deserialize(d)?;
            if v % 2 == 1 {
                return Err(serde::de::Error::custom(format!("{v} is odd")));
            }
            Ok(Even(v))
        }
    }
    assert_eq!(decode::<Even>(&[4]).unwrap().0, 4);
    assert_eq!(decode::<Even>(&[5]).unwrap_err().0, "5 is odd");
}

#[test]
fn same_bytes_and_values_as_postcard() {
    let e = everything();
    let mut ours = Vec::new();
    encode_into(&mut ours, &e).unwrap();
    let mut appended = vec![0xaa];
    encode_append(&mut appended, &e).unwrap();
    assert_eq!(&appended[1..], &ours[..]);
    let theirs: Everything = postcard::from_bytes(&ours).unwrap();
    assert_eq!(theirs, e);
    assert_eq!(decode::<Everything>(&ours).unwrap(), theirs);
}

#[test]
fn writer_errors_reach_the_caller() {
    struct Full;
    impl io::Write for Full {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::new(io::ErrorKind::WriteZero, "ring full"))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let e = encode_into(Full, &(1u8, "x")).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::WriteZero);
    assert_eq!(e.to_string(), "ring full");
}

/// postcard's own decoder (no depth or work limit, errors without text),
/// for the benchmark.
fn decode_postcard<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    postcard::from_bytes(bytes).map_err(|e| CodecError(e.to_string()))
}

#[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
struct Small {
    id: u64,
    seq: u32,
    flag: bool,
    name: String,
    pos: (f64, f64),
}

/// cargo test -p dxnet-proto --release --lib codec::tests::decode_overhead -- --ignored --nocapture
#[test]
#[ignore = "micro-benchmark: run in release"]
fn decode_overhead() {
    use std::hint::black_box;
    use std::time::Instant;
    const N: u32 = 1_000_000;
    /// The fastest of 7 rounds of each decoder, rounds alternating.
    fn time<T: DeserializeOwned>(bytes: &[u8], theirs: fn(&[u8]) -> Result<T>) -> (f64, f64) {
        let round = |f: fn(&[u8]) -> Result<T>| {
            let t = Instant::now();
            for _ in 0..N {
                black_box(f(black_box(bytes)).unwrap());
            }
            t.elapsed().as_secs_f64() * 1e9 / N as f64
        };
        (0..7).fold((f64::INFINITY, f64::INFINITY), |(a, b), _| {
            (a.min(round(theirs)), b.min(round(decode)))
        })
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
    for (name, (theirs, ours)) in [
        (
            "Vec<u8> (64 bytes)",
            time::<Vec<u8>>(&vec_bytes, decode_postcard),
        ),
        (
            "Small (5 fields)",
            time::<Small>(&small_bytes, decode_postcard),
        ),
    ] {
        println!(
            "{name}: postcard::from_bytes {theirs:.1} ns, codec::decode {ours:.1} ns ({:.2}x)",
            ours / theirs
        );
    }
}
