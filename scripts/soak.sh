#!/usr/bin/env bash
# Soak test (not part of CI): 4 dxnet nodes in separate processes (TCP on
# 127.0.0.1) send to each other all-to-all, 3 threads each, random sizes up
# to 128 KiB, for MINUTES (default 10). Every node samples its RSS every
# second and fails if it grows more than RSS_SLACK_MIB (default 32) above its
# value at the end of the warm-up (a fifth of the run, at least 10 s); at the
# end every sender's per-stream counts are checked at every receiver (no
# loss, no duplicate, in order, intact).
#
#   scripts/soak.sh [MINUTES]
#
# Per-second RSS samples of each node are written to target/tmp/soak/node<i>.log.
# Release build (the test is `#[ignore]`d in
# `cargo test`: dxnet/tests/faults.rs, soak_four_nodes_all_to_all).
set -euo pipefail
cd "$(dirname "$0")/.."
export SOAK_MINUTES="${1:-10}"
exec cargo test --release -p dxnet --test faults -- \
  --ignored --exact soak_four_nodes_all_to_all --nocapture
