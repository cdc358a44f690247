//! Prints fresh identity keys (Ed25519) for a node map, as TOML to paste:
//! each node's `identity_key` (keep it secret, in that node's config only)
//! and every node's `public_key` (in everyone's node map).
//!
//! `cargo run -p dxnet --example gen_identities -- 1 2 3`

fn main() {
    let ids: Vec<u16> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("node ids are numbers 0..=65535"))
        .collect();
    if ids.is_empty() {
        eprintln!("usage: gen_identities <node id>...");
        std::process::exit(2);
    }
    let keys: Vec<(u16, (String, String))> = ids
        .iter()
        .map(|&id| (id, dxnet::proto::identity::generate_keypair()))
        .collect();
    println!("# Node map entries (the same in every node's config):");
    for (id, (_, public)) in &keys {
        println!(
            "[[nodes]]\nid = {id}\naddress = \"host-{id}:22222\"\npublic_key = \"{public}\"\n"
        );
    }
    println!("# Private keys: one line in each node's own config only.");
    for (id, (secret, _)) in &keys {
        println!("# node {id}:\nidentity_key = \"{secret}\"");
    }
}
