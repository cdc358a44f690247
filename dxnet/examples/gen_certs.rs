//! Writes a development PKI for TLS into a directory: a new CA and, per node
//! id, a certificate naming `node-<id>.dxnet` with its key; prints the
//! `[tls]` section of each node's config.
//!
//! `cargo run -p dxnet --example gen_certs -- pki 1 2 3`

use dxnet::NodeId;

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(dir), ids) = (args.next(), args.collect::<Vec<_>>()) else {
        eprintln!("usage: gen_certs <dir> <node id>...");
        std::process::exit(2);
    };
    let ids: Vec<NodeId> = ids
        .iter()
        .map(|a| NodeId(a.parse().expect("node ids are numbers 0..=65535")))
        .collect();
    if ids.is_empty() {
        eprintln!("usage: gen_certs <dir> <node id>...");
        std::process::exit(2);
    }
    let tls = dxnet::pki::generate_cluster_pki(dir.as_ref(), &ids).unwrap_or_else(|e| {
        eprintln!("gen_certs: {e}");
        std::process::exit(1)
    });
    for (id, t) in ids.iter().zip(tls) {
        println!(
            "# {id}:\n[tls]\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\n",
            t.cert, t.key, t.ca
        );
    }
}
