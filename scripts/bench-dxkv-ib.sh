#!/usr/bin/env bash
# scripts/bench-dxkv-ib.sh - dxkv over InfiniBand/RoCE verbs beside dxkv over
# TCP, same workload, same VM, interleaved rounds: builds dxkv (release) on
# the host, boots the Soft-RoCE VM (scripts/rdma-vm/vm.sh, 4 vCPUs,
# tsc=reliable as scripts/bench-ib.sh explains) and runs there
#   dxkv local --bindings dxkv,dxkv-ib ARGS...
# (one storage and one benchmark process on the VM's loopback; the ib one
# connects through rxe0). ARGS default to the Ibdxnet paper's workload B at
# a size the emulated machine finishes in minutes.
#
# Usage: scripts/bench-dxkv-ib.sh OUTDIR [dxkv local ARGS...]
#   e.g. scripts/bench-dxkv-ib.sh /tmp/kv-ib --workload paper-a --rounds 3
# OUTDIR gets the output (summary.txt), results.json and results.csv.
#
# Under the VM (TCG software emulation, Soft-RoCE) the numbers measure the
# emulator, not a network: compare the two bindings within one run only.

set -euo pipefail
T0=$SECONDS
ROOT=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] || { echo "usage: bench-dxkv-ib.sh OUTDIR [dxkv local ARGS...]" >&2; exit 2; }
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
shift
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--workload paper-b --rounds 2 --records 5000 --operations 20000 --threads 100)

STAGE="$ROOT/target/ib-vm/dxkv"
# shellcheck source=scripts/rdma-vm/stage.sh
. "$ROOT/scripts/rdma-vm/stage.sh"
stage_release_binary "$ROOT" dxkv-cli dxkv "$STAGE"

set +e
DXNET_VM_SMP=${DXNET_VM_SMP:-4} "$ROOT/scripts/rdma-vm/vm.sh" --timeout "${DXNET_BENCH_TIMEOUT:-1200}" \
    --append "${DXNET_VM_KERNEL_ARGS-tsc=reliable}" "$ROOT" \
    "$STAGE/dxkv" local --bindings dxkv,dxkv-ib --port 17300 \
    --json "$STAGE/results.json" --csv "$STAGE/results.csv" "${ARGS[@]}" | tee "$STAGE/summary.txt"
rc=${PIPESTATUS[0]}
set -e
cp "$STAGE"/summary.txt "$OUT/" 2>/dev/null || true
cp "$STAGE"/results.json "$STAGE"/results.csv "$OUT/" 2>/dev/null || true
echo "bench-dxkv-ib: status $rc, results in $OUT (whole script $((SECONDS - T0)) s)" >&2
exit $rc
