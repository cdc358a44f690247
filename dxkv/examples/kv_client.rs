//! A dxkv cluster in one process: two storage nodes and a client node over
//! TCP on 127.0.0.1; puts, gets, many requests in flight with the async
//! calls, a batch, a version-checked update from several threads at once.
//!
//! `cargo run -p dxkv --example kv_client`
//! (in production each node is its own process, `dxkv storage` on the
//! storage hosts; see dxkv/README.md).

use std::sync::Arc;

use dxkv::{Client, Record, Server, StoreConfig};
use dxnet::{Config, Node, NodeId};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let nodes: Vec<Arc<Node>> = (0..3)
        .map(|id| Node::start(Config::tcp_localhost(id, 3, 22360)).map(Arc::new))
        .collect::<Result<_, _>>()?;
    let _servers = [
        Server::start(&nodes[0], StoreConfig::default())?,
        Server::start(&nodes[1], StoreConfig::default())?,
    ];
    let kv = Arc::new(Client::new(nodes[2].clone(), vec![NodeId(0), NodeId(1)])?);

    kv.put(b"greeting", &Record::value(b"hello"))?;
    let got = kv.get(b"greeting")?.expect("stored");
    println!(
        "greeting = {:?} (version {})",
        String::from_utf8_lossy(got.record.field("").unwrap()),
        got.version
    );

    // A thousand gets in flight at once, then awaited.
    let keys: Vec<Vec<u8>> = (0..1000).map(|i| format!("key{i}").into_bytes()).collect();
    let items: Vec<(Vec<u8>, Record)> =
        keys.iter().map(|k| (k.clone(), Record::value(k))).collect();
    kv.multi_put(&items)?; // one request per storage node
    let pending: Vec<_> = keys.iter().map(|k| kv.get_async(k)).collect();
    for (k, f) in keys.iter().zip(pending) {
        let v = pollster::block_on(f)?.expect("stored");
        assert_eq!(v.record, Record::value(k));
    }
    println!("1000 records written in a batch and read back asynchronously");

    // Eight threads increment one counter 100 times each: no update is lost.
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let kv = kv.clone();
            std::thread::spawn(move || {
                for _ in 0..100 {
                    kv.read_modify_write(b"counter", |cur| {
                        let n = cur
                            .and_then(|r| r.field(""))
                            .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
                        Some(Record::value(&(n + 1).to_le_bytes()))
                    })
                    .expect("update");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    let c = kv.get(b"counter")?.expect("counter");
    let n = u64::from_le_bytes(c.record.field("").expect("value").try_into()?);
    println!("counter = {n} after 8 threads x 100 increments");
    assert_eq!(n, 800);
    Ok(())
}
