#!/usr/bin/env bash
# All-to-all among N nodes (default 4), each in its own network namespace
# connected by veth pairs and a bridge, as if on separate hosts. Needs root.
# Extra arguments go to dxnet-bench, e.g.:
#   dxnet-bench/scripts/netns-all-to-all.sh 8 --sizes 64,4k,64k --bindings raw-tcp
set -euo pipefail
nodes="${1:-4}"
shift || true
cd "$(dirname "$0")/../.."
cargo build --release -p dxnet-bench
exec target/release/dxnet-bench --netns --operations all_to_all --nodes "$nodes" \
    --out "bench-results/netns-all-to-all-n$nodes" "$@"
