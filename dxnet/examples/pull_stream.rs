//! A pull receiver consumed as a `Stream` on tokio: messages of one type
//! queue (bounded) until a task takes them, instead of running a callback
//! on a handler thread.
//!
//! `cargo run -p dxnet --example pull_stream`

use std::time::Duration;

use dxnet::{Config, Node, NodeId};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Row {
    seq: u64,
    text: String,
}
dxnet::message!(Row, 3, 0);

const ROWS: u64 = 10_000;

#[tokio::main(flavor = "current_thread")]
async fn main() -> dxnet::Result<()> {
    let consumer = Node::start(Config::tcp_localhost(1, 2, 22310))?;
    // Up to 1024 rows wait; beyond that the senders are held back (flow
    // control), nothing is dropped.
    let mut rows = consumer.receiver::<Row>(1024)?;
    let producer = Node::start(Config::tcp_localhost(0, 2, 22310))?;
    let sender = std::thread::spawn(move || -> dxnet::Result<()> {
        for seq in 0..ROWS {
            producer.send(
                NodeId(1),
                &Row {
                    seq,
                    text: format!("row {seq}"),
                },
            )?;
        }
        // Sends return once queued; the node writes them out on shutdown.
        producer.shutdown();
        Ok(())
    });

    let mut next = 0;
    while next < ROWS {
        let item = tokio::time::timeout(Duration::from_secs(10), rows.next()).await;
        let (from, row) = item.expect("rows stopped coming").expect("node stopped");
        // One sending thread: its rows arrive in order, each once.
        assert_eq!((from, row.seq), (NodeId(0), next), "{row:?}");
        next += 1;
    }
    sender.join().expect("sender panicked")?;
    println!("{ROWS} rows pulled in order as a stream");
    Ok(())
}
