//! dxkv clusters in one process: storage nodes and a client node over dxnet
//! (TCP on 127.0.0.1, or loopback), every operation checked against a model.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dxkv::protocol::{Write, WriteResult};
use dxkv::{Client, Error, Record, Server, StoreConfig, StoreError, WriteMode, Written};
use dxnet::{Config, Node, NodeId};

/// A base port below the kernel's ephemeral range (32768 up), so no
/// outgoing connection takes a node's port between tests.
fn base_port(n: u16) -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    if NEXT.load(Ordering::SeqCst) == 0 {
        let seed = 12_000 + (std::process::id() % 900) as u16 * 20;
        let _ = NEXT.compare_exchange(0, seed, Ordering::SeqCst, Ordering::SeqCst);
    }
    loop {
        let p = NEXT.fetch_add(n + 1, Ordering::SeqCst);
        if (0..n).all(|i| std::net::TcpListener::bind(("127.0.0.1", p + i)).is_ok()) {
            return p;
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Tcp,
    Loopback,
}

fn config(kind: Kind, id: u16, n: u16, base: u16, fabric: &str) -> Config {
    let mut c = match kind {
        Kind::Tcp => Config::tcp_localhost(id, n, base),
        Kind::Loopback => Config::loopback(id, n, fabric),
    };
    // 2-core machine: idle threads must not hog it.
    c.park.spin_us = 20;
    c.park.yield_us = 200;
    c
}

/// `storage` storage nodes (ids 0..storage) and one client node (the last
/// id), with `store` limits.
struct Cluster {
    kind: Kind,
    n: u16,
    base: u16,
    fabric: String,
    nodes: Vec<Arc<Node>>,
    servers: Vec<Server>,
    client: Client,
}

fn cluster(kind: Kind, storage: u16, store: StoreConfig) -> Cluster {
    let n = storage + 1;
    let base = if kind == Kind::Tcp { base_port(n) } else { 0 };
    let fabric = format!("dxkv-{}-{base}-{}", std::process::id(), rand_u64());
    let nodes: Vec<Arc<Node>> = (0..n)
        .map(|i| Arc::new(Node::start(config(kind, i, n, base, &fabric)).unwrap()))
        .collect();
    let servers = nodes[..storage as usize]
        .iter()
        .map(|node| Server::start(node, store).unwrap())
        .collect();
    let client = Client::new(
        nodes[storage as usize].clone(),
        (0..storage).map(NodeId).collect(),
    )
    .unwrap();
    Cluster {
        kind,
        n,
        base,
        fabric,
        nodes,
        servers,
        client,
    }
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    h.finish()
}

/// A small deterministic generator (xorshift).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A record of 1..=4 fields of random sizes (0..300 bytes), derived from
/// `seed`.
fn random_record(seed: u64) -> Record {
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let fields = 1 + r.below(4);
    Record::from_fields((0..fields).map(|i| {
        let len = r.below(300) as usize;
        let v: Vec<u8> = (0..len).map(|_| r.next() as u8).collect();
        (format!("field{i}"), v)
    }))
}

#[test]
fn every_operation_routed_over_three_storage_nodes() {
    let c = cluster(Kind::Tcp, 3, StoreConfig::default());
    let kv = &c.client;
    let mut model: BTreeMap<Vec<u8>, Record> = BTreeMap::new();
    for i in 0..300u64 {
        let key = format!("user{i:05}").into_bytes();
        let rec = random_record(i);
        kv.put(&key, &rec).unwrap();
        model.insert(key, rec);
    }
    // Each key is on the node the client routes it to, and only there.
    let mut per_node = [0u64; 3];
    for k in model.keys() {
        per_node[kv.node_of_key(k).0 as usize] += 1;
    }
    for (i, server) in c.servers.iter().enumerate() {
        assert_eq!(server.store().stats().keys, per_node[i]);
        assert_eq!(kv.stats(NodeId(i as u16)).unwrap().keys, per_node[i]);
        assert!(per_node[i] > 50, "{per_node:?}");
        for (k, _) in model
            .iter()
            .filter(|(k, _)| kv.node_of_key(k).0 as usize == i)
        {
            assert!(server.store().get(k, None).is_some());
        }
    }
    for (k, rec) in &model {
        assert_eq!(&kv.get(k).unwrap().unwrap().record, rec);
    }
    let k0 = b"user00000".as_slice();
    let only = kv.get_fields(k0, &["field0", "nope"]).unwrap().unwrap();
    assert_eq!(only.record, model[k0].select(&["field0"]));
    assert_eq!(kv.get(b"missing").unwrap(), None);

    // Conditional writes.
    assert_eq!(kv.insert(k0, &Record::value(b"x")).unwrap(), None);
    assert_eq!(kv.get(k0).unwrap().unwrap().record, model[k0]);
    assert!(kv.insert(b"fresh", &Record::value(b"x")).unwrap().is_some());
    assert_eq!(kv.update(b"absent", &Record::value(b"x")).unwrap(), None);
    let upd = Record::from_fields([("field0", &b"new"[..]), ("extra", b"e")]);
    let v = kv.update(k0, &upd).unwrap().unwrap();
    let got = kv.get(k0).unwrap().unwrap();
    assert_eq!(got.version, v);
    assert_eq!(got.record, model[k0].merged(&upd));
    model.insert(k0.to_vec(), got.record.clone());
    assert_eq!(
        kv.write(k0, &Record::value(b"y"), WriteMode::IfVersion(v - 1))
            .unwrap(),
        Written::Changed(v)
    );
    assert_eq!(
        kv.write(b"absent", &Record::value(b"y"), WriteMode::Replace)
            .unwrap(),
        Written::Missing
    );
    assert!(kv.delete(b"fresh").unwrap().is_some());
    assert_eq!(kv.delete(b"fresh").unwrap(), None);

    // Multi-key operations keep the keys' order across nodes.
    let keys: Vec<Vec<u8>> = (0..120u64)
        .map(|i| format!("user{:05}", i * 3).into_bytes())
        .collect();
    let got = kv.multi_get(&keys).unwrap();
    for (k, g) in keys.iter().zip(&got) {
        assert_eq!(g.as_ref().map(|v| &v.record), model.get(k), "{k:?}");
    }
    let items: Vec<(Vec<u8>, Record)> = (0..50u64)
        .map(|i| (format!("multi{i:03}").into_bytes(), random_record(1000 + i)))
        .collect();
    kv.multi_put(&items).unwrap();
    let outcomes = kv.multi_write(&items, WriteMode::Insert).unwrap();
    assert!(outcomes.iter().all(|o| *o == Ok(Written::Exists)));
    for (k, r) in items {
        model.insert(k, r);
    }

    // Scans merge the nodes' keys in order.
    for start in [&b""[..], b"user00123", b"multi", b"user002999", b"zzz"] {
        let got = kv.scan(start, 25, None).unwrap();
        let want: Vec<(&Vec<u8>, &Record)> = model.range(start.to_vec()..).take(25).collect();
        assert_eq!(got.len(), want.len());
        for ((gk, gv), (wk, wv)) in got.iter().zip(want) {
            assert_eq!((gk, &gv.record), (wk, wv));
        }
    }
    let part = kv
        .scan_partition(NodeId(1), b"user", 10, Some(&["field0"]))
        .unwrap();
    assert_eq!(part.len(), 10);
    assert!(part.windows(2).all(|w| w[0].0 < w[1].0));
    for (k, v) in &part {
        assert_eq!(kv.node_of_key(k), NodeId(1));
        assert_eq!(v.record, model[k].select(&["field0"]));
    }

    // Records by id, created round robin.
    let mut ids = HashMap::new();
    for i in 0..30u64 {
        let rec = random_record(5000 + i);
        ids.insert(kv.create(&rec).unwrap(), rec);
    }
    let mut creators: Vec<u16> = ids.keys().map(|&id| kv.node_of_id(id).0).collect();
    creators.sort();
    creators.dedup();
    assert_eq!(creators, [0, 1, 2]);
    for (&id, rec) in &ids {
        assert_eq!(&kv.get_id(id).unwrap().unwrap().record, rec);
    }
    let (&id, _) = ids.iter().next().unwrap();
    assert!(matches!(
        kv.write_id(id, &Record::value(b"z"), WriteMode::Update),
        Ok(Written::Stored(_))
    ));
    assert_eq!(
        kv.get_id(id).unwrap().unwrap().record.plain_value(),
        Some(&b"z"[..])
    );
    assert!(kv.delete_id(id).unwrap().is_some());
    assert_eq!(kv.get_id(id).unwrap(), None);
    let on2 = kv.create_on(NodeId(2), &Record::value(b"two")).unwrap();
    assert_eq!(kv.node_of_id(on2), NodeId(2));

    // Async calls are futures of the same results.
    let fs: Vec<_> = model.keys().take(40).map(|k| kv.get_async(k)).collect();
    for (f, (_, rec)) in fs.into_iter().zip(&model) {
        assert_eq!(&pollster::block_on(f).unwrap().unwrap().record, rec);
    }
    let w = kv.write_async(b"async", &Record::value(b"a"), WriteMode::Put);
    assert!(matches!(pollster::block_on(w), Ok(Written::Stored(_))));
    assert!(pollster::block_on(kv.get_id_async(on2)).unwrap().is_some());
    assert!(pollster::block_on(kv.delete_async(b"async"))
        .unwrap()
        .is_some());
    assert!(pollster::block_on(kv.put_async(b"ap", &Record::value(b"1"))).is_ok());
    let again = pollster::block_on(kv.insert_async(b"ap", &Record::value(b"2")));
    assert_eq!(again.unwrap(), None, "insert keeps the record there");
    let fields = Record::from_fields([("f", &b"x"[..])]);
    assert!(pollster::block_on(kv.update_async(b"ap", &fields))
        .unwrap()
        .is_some());
    assert_eq!(
        pollster::block_on(kv.update_async(b"none", &fields)).unwrap(),
        None
    );
    let keys: Vec<&Vec<u8>> = model.keys().take(30).collect();
    let many = pollster::block_on(kv.multi_get_async(&keys)).unwrap();
    assert_eq!(many, kv.multi_get(&keys).unwrap());
    let items: Vec<(Vec<u8>, Record)> = (0..20)
        .map(|i| (format!("am{i}").into_bytes(), Record::value(b"m")))
        .collect();
    let written = pollster::block_on(kv.multi_write_async(&items, WriteMode::Insert)).unwrap();
    assert!(written.iter().all(|w| matches!(w, Ok(Written::Stored(_)))));
    let fields = pollster::block_on(kv.get_fields_async(b"am3", &[""])).unwrap();
    assert_eq!(fields.unwrap().record, Record::value(b"m"));
    let scanned = pollster::block_on(kv.scan_async(b"am", 5, None)).unwrap();
    assert_eq!(scanned, kv.scan(b"am", 5, None).unwrap());
    assert_eq!(scanned.len(), 5);
    let counter = |r: Option<&Record>| {
        let n = r.and_then(|r| r.plain_value()).map_or(0, |v| v[0]);
        Some(Record::value(&[n + 1]))
    };
    for _ in 0..3 {
        pollster::block_on(kv.read_modify_write_async(b"arm", counter)).unwrap();
    }
    assert_eq!(
        kv.get(b"arm").unwrap().unwrap().record.plain_value(),
        Some(&[3u8][..])
    );
    let id = pollster::block_on(kv.create_async(&Record::value(b"i"))).unwrap();
    let w = kv.write_id_async(id, &Record::value(b"j"), WriteMode::Put);
    assert!(matches!(pollster::block_on(w), Ok(Written::Stored(_))));
    assert_eq!(
        kv.get_id(id).unwrap().unwrap().record.plain_value(),
        Some(&b"j"[..])
    );
    assert!(pollster::block_on(kv.delete_id_async(id))
        .unwrap()
        .is_some());
    assert_eq!(kv.get_id(id).unwrap(), None);

    kv.clear().unwrap();
    for s in &c.servers {
        let st = s.store().stats();
        assert_eq!((st.keys, st.ids, st.used), (0, 0, 0));
    }
}

/// 100 client threads (50 times the cores) on two storage nodes: each
/// thread keeps its own keys (every read checked against its model) and
/// all of them increment the same few counters by read-modify-write.
#[test]
fn hundred_threads_every_read_checked_and_no_lost_increment() {
    const THREADS: u64 = 100;
    const OPS: u64 = 150;
    const COUNTERS: u64 = 5;
    let c = cluster(Kind::Loopback, 2, StoreConfig::default());
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let kv = c.client.clone();
            s.spawn(move || {
                let mut rng = Rng((t + 1).wrapping_mul(0x2545_F491_4F6C_DD1D));
                let mut model: HashMap<Vec<u8>, Record> = HashMap::new();
                for op in 0..OPS {
                    let key = format!("t{t}-k{}", rng.below(20)).into_bytes();
                    match rng.below(10) {
                        0..=3 => {
                            let rec = random_record(t << 32 | op);
                            kv.put(&key, &rec).unwrap();
                            model.insert(key, rec);
                        }
                        4..=6 => {
                            let got = kv.get(&key).unwrap().map(|v| v.record);
                            assert_eq!(got.as_ref(), model.get(&key), "thread {t} op {op}");
                        }
                        7 => {
                            let upd = Record::from_fields([("field1", op.to_le_bytes())]);
                            let v = kv.update(&key, &upd).unwrap();
                            assert_eq!(v.is_some(), model.contains_key(&key));
                            if let Some(r) = model.get_mut(&key) {
                                *r = r.merged(&upd);
                            }
                        }
                        8 => {
                            let v = kv.delete(&key).unwrap();
                            assert_eq!(v.is_some(), model.remove(&key).is_some());
                        }
                        _ => {
                            let counter = format!("counter{}", rng.below(COUNTERS));
                            kv.read_modify_write(counter.as_bytes(), |cur| {
                                let n = cur.map_or(0, |r| {
                                    u64::from_le_bytes(r.plain_value().unwrap().try_into().unwrap())
                                });
                                Some(Record::value(&(n + 1).to_le_bytes()))
                            })
                            .unwrap()
                            .unwrap();
                        }
                    }
                }
                // Everything this thread left is there, exactly.
                let keys: Vec<&Vec<u8>> = model.keys().collect();
                let got = kv.multi_get(&keys).unwrap();
                for (k, g) in keys.iter().zip(got) {
                    assert_eq!(g.map(|v| v.record).as_ref(), model.get(*k));
                }
            });
        }
    });
    // The increments: replay each thread's generator to count them.
    let mut expected = 0;
    for t in 0..THREADS {
        let mut rng = Rng((t + 1).wrapping_mul(0x2545_F491_4F6C_DD1D));
        for _ in 0..OPS {
            rng.below(20);
            if rng.below(10) == 9 {
                rng.below(COUNTERS);
                expected += 1;
            }
        }
    }
    let total: u64 = (0..COUNTERS)
        .filter_map(|i| c.client.get(format!("counter{i}").as_bytes()).unwrap())
        .map(|v| u64::from_le_bytes(v.record.plain_value().unwrap().try_into().unwrap()))
        .sum();
    assert!(expected > 1000);
    assert_eq!(total, expected);
}

#[test]
fn full_store_bad_records_and_long_keys_are_refused_clearly() {
    let c = cluster(
        Kind::Loopback,
        1,
        StoreConfig {
            max_memory: 64 << 10,
            max_key: 64,
            ..Default::default()
        },
    );
    let kv = &c.client;
    let big = Record::value(&[1u8; 1000]);
    let mut stored = 0;
    let err = loop {
        match kv.put(format!("k{stored}").as_bytes(), &big) {
            Ok(_) => stored += 1,
            Err(e) => break e,
        }
    };
    assert!(
        matches!(
            &err,
            Error::Refused {
                node: NodeId(0),
                error: StoreError::Full { .. }
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("full"), "{err}");
    assert!((50..64).contains(&stored), "{stored}");
    // What was stored is intact and the node keeps serving.
    assert_eq!(kv.get(b"k0").unwrap().unwrap().record, big);
    assert!(kv.delete(b"k0").unwrap().is_some());
    kv.put(b"k0", &big).unwrap();
    let long = vec![b'x'; 65];
    assert!(matches!(
        kv.put(&long, &big),
        Err(Error::Refused {
            error: StoreError::KeyTooLong { size: 65, max: 64 },
            ..
        })
    ));
    // A client sending bytes that are not a record gets the reason back.
    let node = kv.node();
    for bad in [vec![], vec![1, 0], vec![1, 0, 3, b'a']] {
        let r: WriteResult = node
            .request(
                NodeId(0),
                &Write {
                    key: b"bad".to_vec(),
                    record: bad,
                    mode: WriteMode::Put,
                },
                Duration::from_secs(5),
            )
            .unwrap();
        assert!(
            matches!(&r.0, Err(StoreError::BadRecord(why)) if why.contains("malformed")),
            "{r:?}"
        );
    }
    assert_eq!(kv.get(b"bad").unwrap(), None);
}

#[test]
fn a_stopped_storage_node_fails_only_its_keys_and_restarts_empty() {
    let mut c = cluster(Kind::Tcp, 2, StoreConfig::default());
    let kv = c.client.clone().with_timeout(Duration::from_secs(2));
    let keys: Vec<Vec<u8>> = (0..100).map(|i| format!("key{i}").into_bytes()).collect();
    for k in &keys {
        kv.put(k, &Record::value(k)).unwrap();
    }
    let (on1, on0): (Vec<_>, Vec<_>) = keys.iter().partition(|k| kv.node_of_key(k) == NodeId(1));
    assert!(!on1.is_empty() && !on0.is_empty());

    c.servers.pop();
    let node1 = c.nodes.remove(1);
    Arc::into_inner(node1)
        .expect("only the cluster held node 1")
        .shutdown();
    for k in &on1 {
        let e = kv.get(k).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::Net(dxnet::Error::Unreachable(..) | dxnet::Error::Timeout(_))
            ),
            "{e}"
        );
    }
    for k in &on0 {
        assert_eq!(kv.get(k).unwrap().unwrap().record, Record::value(k));
    }

    // Same id, same address: its keys are served again, from empty.
    let node1 = Arc::new(Node::start(config(c.kind, 1, c.n, c.base, &c.fabric)).unwrap());
    c.servers
        .push(Server::start(&node1, StoreConfig::default()).unwrap());
    let mut served = false;
    for _ in 0..200 {
        match kv.get(on1[0]) {
            Ok(v) => {
                assert_eq!(v, None, "a restarted node is empty");
                served = true;
                break;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    assert!(served, "the restarted node never answered");
    for k in &on1 {
        assert_eq!(kv.get(k).unwrap(), None);
        kv.put(k, &Record::value(b"again")).unwrap();
    }
    for k in &on0 {
        assert_eq!(kv.get(k).unwrap().unwrap().record, Record::value(k));
    }
}
