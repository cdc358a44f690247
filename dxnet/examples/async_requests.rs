//! Requests from async tasks on tokio: a hundred tasks on two worker
//! threads, each awaiting its responses, none blocking an executor thread
//! while it waits for an answer.
//!
//! `cargo run -p dxnet --example async_requests`
//!
//! `request_async` returns at once with a `Future` unless the connection's
//! flow-control window is full; then it waits on the calling thread, for
//! at most `limits.send_timeout_ms`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dxnet::{Config, Node, NodeId};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Square(u64);
#[derive(Serialize, Deserialize)]
struct Squared(u64);
dxnet::message!(Squared, 2, 2);
dxnet::request!(Square, 2, 1 => Squared);

const TASKS: u64 = 100;
const PER_TASK: u64 = 200;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> dxnet::Result<()> {
    // Two nodes over TCP on 127.0.0.1 (ports 22300, 22301), in this process.
    let server = Node::start(Config::tcp_localhost(1, 2, 22300))?;
    server.register_request(|_, Square(x)| Squared(x * x))?;
    let client = Arc::new(Node::start(Config::tcp_localhost(0, 2, 22300))?);

    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..TASKS {
        let client = client.clone();
        tasks.spawn(async move {
            for i in 0..PER_TASK {
                let x = t * PER_TASK + i;
                let pending =
                    client.request_async(NodeId(1), &Square(x), Duration::from_secs(5))?;
                let Squared(y) = pending.await?;
                assert_eq!(y, x * x);
            }
            Ok::<u64, dxnet::Error>(PER_TASK)
        });
    }
    let mut answered = 0;
    while let Some(done) = tasks.join_next().await {
        answered += done.expect("task panicked")?;
    }
    let took = start.elapsed();
    println!(
        "{answered} requests from {TASKS} tasks answered in {took:.2?} ({:.0} per second)",
        answered as f64 / took.as_secs_f64()
    );
    assert_eq!(answered, TASKS * PER_TASK);
    Ok(())
}
