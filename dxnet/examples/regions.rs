//! One-sided operations: a node exposes memory, hands its descriptor to
//! another node in an ordinary message, and that node writes and reads it
//! without the owner's threads taking part; a write with notification
//! tells the owner when its data is in place.
//!
//! `cargo run -p dxnet --example regions`

use std::sync::mpsc;
use std::time::Duration;

use dxnet::region::{Access, RemoteRegion};
use dxnet::{Config, Node, NodeId};
use serde::{Deserialize, Serialize};

/// A region's descriptor, sent as any message.
#[derive(Serialize, Deserialize)]
struct Offer(RemoteRegion);
dxnet::message!(Offer, 5, 0);

fn main() -> dxnet::Result<()> {
    let owner = Node::start(Config::tcp_localhost(0, 2, 22330))?;
    let user = Node::start(Config::tcp_localhost(1, 2, 22330))?;
    let offers = user.receiver::<Offer>(4)?;

    // 1 MiB, zeroed, that others may read and write.
    let region = owner.expose(1 << 20, Access::ReadWrite)?;
    let (notified, notes) = mpsc::channel();
    owner.on_region_write(move |w| {
        let _ = notified.send(w);
    })?;
    owner.send(NodeId(1), &Offer(region.descriptor()))?;

    let (_, Offer(remote)) = offers.recv_timeout(Duration::from_secs(5)).expect("offer");
    user.write(&remote, 4096, b"written from node 1")?; // returns once in place
    let mut back = [0u8; 19];
    user.read(&remote, 4096, &mut back)?;
    assert_eq!(&back, b"written from node 1");
    // The owner's own view of the memory:
    let mut local = [0u8; 19];
    region.read(4096, &mut local)?;
    assert_eq!(local, back);

    // A write the owner hears of (imm is the user's tag).
    user.write_with_notify(&remote, 0, b"ready", 7)?;
    let w = notes
        .recv_timeout(Duration::from_secs(5))
        .expect("notification");
    println!(
        "owner notified: {} bytes at {} from {} (imm {})",
        w.len, w.offset, w.from, w.imm
    );
    assert_eq!((w.from, w.offset, w.len, w.imm), (NodeId(1), 0, 5, 7));

    // Accesses outside the region, or after it is revoked, fail cleanly.
    assert!(user.write(&remote, 1 << 20, b"x").is_err());
    region.revoke();
    assert!(user.read(&remote, 0, &mut back).is_err());
    println!("one-sided writes, reads and notifications checked");
    Ok(())
}
