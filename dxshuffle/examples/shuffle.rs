//! A shuffle among two nodes with four threads each over TCP: every
//! worker pushes records to every worker, each record is pulled exactly
//! once by the worker it was pushed to.
//!
//! `cargo run -p dxshuffle --example shuffle`
//! (one node per process in production: each runs the same code with its
//! own node; see dxshuffle/README.md).

use std::sync::Arc;

use dxnet::{Config, Node, NodeId};
use dxshuffle::{Shuffle, ShuffleConfig};

const THREADS: usize = 4;
const PER_PAIR: u64 = 5_000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ids = vec![NodeId(0), NodeId(1)];
    // Every process sets its shuffle up at once (each waits for the
    // others'), so here each node does on its own thread.
    let setups: Vec<_> = (0..2)
        .map(|id| {
            let ids = ids.clone();
            std::thread::spawn(move || -> Result<Arc<Shuffle>, dxshuffle::ShuffleError> {
                let node = Arc::new(Node::start(Config::tcp_localhost(id, 2, 22370))?);
                Ok(Arc::new(Shuffle::new(
                    node,
                    ShuffleConfig::new(ids, THREADS),
                )?))
            })
        })
        .collect();
    let shuffles = setups
        .into_iter()
        .map(|s| s.join().expect("setup thread"))
        .collect::<Result<Vec<_>, _>>()?;
    let workers = shuffles[0].workers();
    let mut pushers = Vec::new();
    let mut pullers = Vec::new();
    for s in &shuffles {
        for t in 0..THREADS {
            let s = s.clone();
            pushers.push(std::thread::spawn(move || {
                let me = s.worker(t) as u64;
                let mut p = s.pusher(t).expect("pusher");
                for i in 0..PER_PAIR {
                    for dest in 0..s.workers() {
                        p.push(dest, &(me, i)).expect("push");
                    }
                }
                p.finish().expect("finish");
            }));
        }
        for t in 0..THREADS {
            let s = s.clone();
            pullers.push(std::thread::spawn(move || {
                // Per sender: how many records and their index sum.
                let mut from = vec![(0u64, 0u64); s.workers()];
                for r in s.puller(t).expect("puller") {
                    let (sender, i): (u64, u64) = r.expect("record").decode().expect("decode");
                    from[sender as usize].0 += 1;
                    from[sender as usize].1 += i;
                }
                from
            }));
        }
    }
    for p in pushers {
        p.join().expect("pusher thread");
    }
    let want = (PER_PAIR, PER_PAIR * (PER_PAIR - 1) / 2);
    for p in pullers {
        let from = p.join().expect("puller thread");
        assert!(from.iter().all(|&f| f == want), "{from:?}");
    }
    println!(
        "{} records shuffled among {workers} workers, each pulled once",
        PER_PAIR * (workers * workers) as u64
    );
    Ok(())
}
