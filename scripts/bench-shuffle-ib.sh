#!/usr/bin/env bash
# scripts/bench-shuffle-ib.sh - dxshuffle in the Soft-RoCE VM: the
# one-sided mode over InfiniBand/RoCE verbs beside the messages mode over
# verbs and over TCP, in interleaved rounds of one VM run. Builds
# dxnet-bench (release) on the host, boots the VM (scripts/rdma-vm/vm.sh,
# 4 vCPUs, tsc=reliable as scripts/bench-ib.sh explains) and runs there,
# ROUNDS times, one after the other:
#   dxnet-bench shuffle --procs 4 --threads 8 --records RECORDS --size 100 \
#     --rounds 1 --transport T --mode M [--batch B --segment S]
# for (T, M) = (ib, one-sided) with the default 16 KiB batches and 64 KiB
# segments, (ib, one-sided) with 64 KiB batches and 256 KiB segments,
# (tcp, messages) and (ib, messages). Then, for the device's own ceiling,
# perftest's ib_write_bw beside one TCP socket (dxnet-bench's raw-tcp
# binding) at 16 and 64 KiB.
#
# Usage: scripts/bench-shuffle-ib.sh OUTDIR [ROUNDS [RECORDS]]
#   (defaults: 5 rounds, 60 000 records per worker)
# OUTDIR gets summary.txt: one line per run ("R round label" and the
# bench's result line: records/s, MB/s, emulated CPU µs per record, time
# a pusher was blocked, device packets per record), the medians per label,
# and the ceiling runs' lines.
#
# Under the VM (TCG software emulation, Soft-RoCE) the numbers measure the
# emulator, not a network: compare the variants within one run only.

set -euo pipefail
T0=$SECONDS
ROOT=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] || { echo "usage: bench-shuffle-ib.sh OUTDIR [ROUNDS [RECORDS]]" >&2; exit 2; }
ROUNDS=${2:-5}
RECORDS=${3:-60000}

if [ "${IN_VM:-0}" = 1 ]; then
    bench=$STAGE/dxnet-bench
    variants=(
        "ib-one-sided --transport ib --mode one-sided"
        "ib-one-sided-64k --transport ib --mode one-sided --batch 65536 --segment 262144"
        "tcp-messages --transport tcp --mode messages"
        "ib-messages --transport ib --mode messages"
    )
    for r in $(seq 1 "$ROUNDS"); do
        for v in "${variants[@]}"; do
            read -r label args <<<"$v"
            # shellcheck disable=SC2086
            line=$("$bench" shuffle --procs 4 --threads 8 --records "$RECORDS" --size 100 \
                --rounds 1 $args 2>&1 | grep -E '^ +(one-sided|messages) ' || echo " failed")
            echo "R $r $label $line"
        done
    done | tee "$STAGE/runs.txt"
    echo "device ceiling (one stream, 5000 messages):"
    for b in ib_write_bw raw-tcp; do
        op=throughput
        [ "$b" = ib_write_bw ] && op=rdma_write
        "$bench" --config "$ROOT/dxnet-bench/configs/ib.json" --bindings "$b" --operations "$op" \
            --sizes 16384,65536 --count 5000 --repetitions 1 --no-plots -q \
            --out "$STAGE/ceiling-$b" 2>&1 | grep -E "^ *$op .* $b " || echo "  $b failed"
    done
    exit 0
fi

OUT=$(mkdir -p "$1" && cd "$1" && pwd)
STAGE="$ROOT/target/ib-vm/shuffle"
# shellcheck source=scripts/rdma-vm/stage.sh
. "$ROOT/scripts/rdma-vm/stage.sh"
stage_release_binary "$ROOT" dxnet-bench dxnet-bench "$STAGE"

set +e
DXNET_VM_SMP=${DXNET_VM_SMP:-4} DXNET_VM_MEM=${DXNET_VM_MEM:-3072} \
    "$ROOT/scripts/rdma-vm/vm.sh" --timeout "${DXNET_BENCH_TIMEOUT:-1800}" \
    --append "${DXNET_VM_KERNEL_ARGS-tsc=reliable}" \
    --env IN_VM=1 --env STAGE="$STAGE" "$ROOT" \
    bash "$ROOT/scripts/bench-shuffle-ib.sh" "$OUT" "$ROUNDS" "$RECORDS" | tee "$STAGE/summary.txt"
rc=${PIPESTATUS[0]}
set -e
# The median of each variant's rates and CPU times per record.
median() { sort -g | awk '{v[NR] = $1} END {if (NR) print v[int((NR + 1) / 2)]}'; }
{
    echo "medians of $ROUNDS rounds: records/s, emulated CPU µs per record"
    for label in $(awk '{print $3}' "$STAGE/runs.txt" 2>/dev/null | sort -u); do
        rate=$(awk -v l="$label" '$3 == l {print $5}' "$STAGE/runs.txt" | median)
        cpu=$(awk -v l="$label" '$3 == l {print $9}' "$STAGE/runs.txt" | median)
        printf '  %-18s %10s %8s\n' "$label" "$rate" "$cpu"
    done
} | tee -a "$STAGE/summary.txt"
cp "$STAGE"/summary.txt "$OUT/" 2>/dev/null || true
echo "bench-shuffle-ib: status $rc, summary in $OUT/summary.txt (whole script $((SECONDS - T0)) s)" >&2
exit $rc
