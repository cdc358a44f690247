#!/usr/bin/env bash
# scripts/bench-ib.sh - InfiniBand/RoCE benchmarks: dxnet-bench's IB suite
# (dxnet-bench/configs/ib.json) for the bindings dxnet-ib (dxnet over verbs),
# raw-verbs (one SEND WR per message, pre-posted receive queue, no library;
# one RDMA WRITE/READ per access) and perftest's ib_send_bw / ib_send_lat /
# ib_write_bw / ib_write_lat / ib_read_bw / ib_read_lat, in one run of the
# Soft-RoCE VM.
#
# Usage:
#   scripts/bench-ib.sh [--quick] [--repeat N] [--debug] [--no-plots] [--figures L]
#                       [--dxnet KEY=VALUE]... OUTDIR
#       Build dxnet-bench (release) on the host, boot the Soft-RoCE VM
#       (scripts/rdma-vm/vm.sh, 4 vCPUs) and run the suite there.
#   scripts/bench-ib.sh --no-vm [--quick] [--repeat N] [--debug] OUTDIR
#       Run on this host's own RDMA device (needs perftest installed and
#       RDMA_DEV, RDMA_GID_INDEX (RoCE), optionally RDMA_PORT set).
#   --quick     2 000 messages / round trips per run, one round (smoke test)
#   --repeat N  rounds (default 3). Each round runs every binding once, so
#               load changes hit all bindings alike; the rounds are merged
#               into one results.json as repetitions 0..N-1.
#   --debug     use a debug build of dxnet-bench
#   --no-plots  skip the plots (drawn on the host after the VM run)
#   --dxnet K=V dxnet Config field for the dxnet-ib nodes (repeatable), e.g.
#               --dxnet 'park={"max_spinning":0}' or --dxnet 'ib={"sq_size":64}'
#   --threads L sender threads per node, e.g. 1,16 (default 1)
#   --bindings L only these bindings, e.g. dxnet-ib
#   --operations L, --sizes L, --count N
#               only these operations / sizes, and this many messages (round
#               trips) per run instead of the suite's
#   --rdma-window N  one-sided accesses in flight per thread (dxnet-bench's
#               params.rdma_window, default 16)
#   --rdma-copy one-sided accesses copy the application's bytes (dxnet's
#               write/read of slices) instead of using registered memory in
#               place (write_from/read_into; what perftest does)
#   --modes L   throughput and one-sided modes, e.g. uni,bi (default: the
#               suite's, uni)
#   --figures L instead of the suite, `dxnet-bench paper-figures --transport
#               ib` for these figures of the Ibdxnet report, e.g. 11,13
#               (dxnet-ib beside raw-verbs and perftest; each round's
#               figNN/ directories and figures.txt are in round-N/)
#   --scale N   with --figures: the report's counts divided by N (default
#               100000: the emulated device is slow)
#
# The suite: throughput uni at 64 B (20 000 messages) and 64 KiB (1 250),
# pingpong at 64 B (2 000 round trips), one-sided rdma_write and rdma_read
# at 64 B, 4 KiB and 64 KiB (10 000 accesses, halved above 4 KiB) and their
# latency at 64 B (2 000), 1 sender thread, 2 nodes, warm-up 10 %; dxnet-ib
# and raw-verbs through dxnet-bench's operations, perftest's programs with
# -s SIZE -n COUNT (-H for the latency ones) for comparison.
#
# The VM boots with tsc=reliable (DXNET_VM_KERNEL_ARGS replaces it): otherwise
# its clocksource is the emulated HPET and every clock read costs
# microseconds. Busy processes on the host during the run are listed
# (host-busy.txt): they make round trips of busy-polling programs jump to
# milliseconds.
#
# OUTDIR gets results.json (dxnet-bench's record schema: operation, mode,
# binding, size, threads, handlers, nodes, repetition, msgs_per_sec,
# bytes_per_sec, lat_us{avg,min,max,p50,p95,p99,p999,p9999}, cpu_s,
# wire_overhead, ...; bindings dxnet-ib, raw-verbs and perftest's;
# pingpong latencies are full round trips, ib_send_lat's RTT/2 samples
# doubled), summary.txt (the table printed at the end, with the ratios
# dxnet-ib / raw-verbs and dxnet-ib / perftest), the CSV files, plots, every
# round's own output (round-N/), rxe's counters per round (rxe.txt:
# completer_retry_err counts retransmissions after ACK timeouts of ~67 ms)
# and busy host processes seen during the run (host-busy.txt).
# Exit status non-zero if a benchmark failed.
#
# Under the VM (TCG software emulation, Soft-RoCE) the numbers measure the
# emulator, not a network: compare bindings within one run, never across
# machines.

set -euo pipefail
T0=$SECONDS
ROOT=$(cd "$(dirname "$0")/.." && pwd)
NO_VM=0
IN_VM=0
QUICK=0
REPEAT=3
PROFILE=release
PLOTS=1
BIN=
DXNET=()
THREADS=
BINDINGS=
OPERATIONS=
SIZES=
COUNT=
WINDOW=
RDMA_COPY=0
MODES=
FIGURES=
SCALE=100000
while [ $# -gt 0 ]; do
    case $1 in
        --no-vm) NO_VM=1; shift ;;
        --in-vm) IN_VM=1; BIN=$2; shift 2 ;;     # internal: run inside the VM
        --quick) QUICK=1; REPEAT=1; shift ;;
        --repeat) REPEAT=$2; shift 2 ;;
        --debug) PROFILE=debug; shift ;;
        --no-plots) PLOTS=0; shift ;;
        --dxnet) DXNET+=("$2"); shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --bindings) BINDINGS=$2; shift 2 ;;
        --operations) OPERATIONS=$2; shift 2 ;;
        --sizes) SIZES=$2; shift 2 ;;
        --count) COUNT=$2; shift 2 ;;
        --rdma-window) WINDOW=$2; shift 2 ;;
        --rdma-copy) RDMA_COPY=1; shift ;;
        --modes) MODES=$2; shift 2 ;;
        --figures) FIGURES=$2; shift 2 ;;
        --scale) SCALE=$2; shift 2 ;;
        -h|--help) sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; exit 0 ;;
        -*) echo "bench-ib.sh: unknown option $1" >&2; exit 2 ;;
        *) break ;;
    esac
done
[ $# = 1 ] || { echo "usage: bench-ib.sh [--no-vm] [--quick] [--repeat N] [--debug] [--no-plots] [--dxnet K=V]... [--threads L] [--bindings L] [--operations L] [--sizes L] [--count N] [--rdma-window N] [--rdma-copy] [--modes L] [--figures L [--scale N]] OUTDIR" >&2; exit 2; }
OUT=$1
CONFIG=$ROOT/dxnet-bench/configs/ib.json

# ---------------------------------------------------------------------------
# The suite itself (inside the VM, or --no-vm on a real device)
# ---------------------------------------------------------------------------
run_suite() {
    local bench=$1 out=$2 r failed=0
    : "${RDMA_DEV:?RDMA_DEV must name the RDMA device}"
    local port=${RDMA_PORT:-1}
    local counters=/sys/class/infiniband/$RDMA_DEV/ports/$port/hw_counters
    local -a extra=()
    [ $QUICK = 1 ] && extra+=(--count 2000 --warmup 200)
    local kv
    for kv in ${DXNET[@]+"${DXNET[@]}"}; do extra+=(--dxnet "$kv"); done
    [ -n "$THREADS" ] && extra+=(--threads "$THREADS")
    [ -n "$BINDINGS" ] && extra+=(--bindings "$BINDINGS")
    [ -n "$OPERATIONS" ] && extra+=(--operations "$OPERATIONS")
    [ -n "$SIZES" ] && extra+=(--sizes "$SIZES")
    [ -n "$COUNT" ] && extra+=(--count "$COUNT")
    [ -n "$WINDOW" ] && extra+=(--rdma-window "$WINDOW")
    [ "$RDMA_COPY" = 1 ] && extra+=(--rdma-copy)
    [ -n "$MODES" ] && extra+=(--modes "$MODES")
    rxe() {
        local c
        for c in sent_pkts completer_retry_err rcvd_rnr_err retry_exceeded_err; do
            printf '%s=%s ' "$c" "$(cat "$counters/$c" 2>/dev/null || echo -)"
        done
    }
    mkdir -p "$out"
    : >"$out/rxe.txt"
    echo "bench-ib: device $RDMA_DEV port $port gid index ${RDMA_GID_INDEX:-none}, $REPEAT round(s), $(nproc) CPUs, clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null || echo unknown)" >&2
    local -a files=()
    for r in $(seq 1 "$REPEAT"); do
        echo "bench-ib: round $r of $REPEAT" >&2
        echo "round $r before: $(rxe)" >>"$out/rxe.txt"
        local -a what=(--config "$CONFIG")
        [ -n "$FIGURES" ] && what=(paper-figures --transport ib --figures "$FIGURES" --scale "$SCALE")
        if ! "$bench" "${what[@]}" --repetitions 1 "${extra[@]}" \
                --out "$out/round-$r" --no-plots -q >"$out/round-$r.log" 2>&1; then
            failed=1
            echo "bench-ib: round $r failed:" >&2
            grep -E 'FAILED|failed|error' "$out/round-$r.log" >&2 || tail -n 20 "$out/round-$r.log" >&2
        fi
        echo "round $r after:  $(rxe)" >>"$out/rxe.txt"
        [ -s "$out/round-$r/results.json" ] && files+=("$out/round-$r/results.json")
    done
    [ ${#files[@]} -gt 0 ] || { echo "bench-ib: no results" >&2; return 1; }
    # merge the rounds (repetitions 0..N-1), write results.json, CSV,
    # summary.txt and print the table
    "$bench" plot "${files[@]}" --out "$out" --no-plots >"$out/table.log" 2>&1 ||
        { cat "$out/table.log" >&2; return 1; }
    # with a single round, plot does not rewrite results.json/summary.txt
    if [ ${#files[@]} = 1 ]; then
        cp "${files[0]}" "$out/results.json"
        cp "${files[0]%/results.json}/summary.txt" "$out/summary.txt"
    fi
    cat "$out/rxe.txt" >&2
    return $failed
}

if [ $IN_VM = 1 ]; then
    run_suite "$BIN" "$OUT"
    exit $?
fi

if [ $NO_VM = 1 ]; then
    command -v ib_send_bw >/dev/null || { echo "bench-ib.sh: perftest not installed (apt-get install perftest)" >&2; exit 2; }
fi

# ---------------------------------------------------------------------------
# Host: build, then run here (--no-vm) or in the VM
# ---------------------------------------------------------------------------
command -v cargo >/dev/null || { echo "bench-ib.sh: cargo not found" >&2; exit 2; }
cd "$ROOT"
if [ $PROFILE = release ]; then
    cargo build --release -p dxnet-bench
else
    cargo build -p dxnet-bench
fi
exe=$(cargo metadata --format-version 1 --no-deps 2>/dev/null | grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4)
exe=${exe:-$ROOT/target}/$PROFILE/dxnet-bench
[ -x "$exe" ] || { echo "bench-ib.sh: $exe was not built" >&2; exit 1; }

load() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown; }
echo "bench-ib: host load average before: $(load) ($(nproc) cores)" >&2
rc=0
if [ $NO_VM = 1 ]; then
    set +e
    run_suite "$exe" "$OUT"
    rc=$?
    set -e
else
    # A private copy: the shared target directory may be rebuilt meanwhile.
    STAGE="$ROOT/target/ib-vm/bench"
    rm -rf "$STAGE"
    mkdir -p "$STAGE/bin" "$STAGE/out"
    cp "$exe" "$STAGE/bin/dxnet-bench"
    args=(--in-vm "$STAGE/bin/dxnet-bench" --repeat "$REPEAT")
    [ $QUICK = 1 ] && args+=(--quick)
    for kv in ${DXNET[@]+"${DXNET[@]}"}; do args+=(--dxnet "$kv"); done
    [ -n "$THREADS" ] && args+=(--threads "$THREADS")
    [ -n "$BINDINGS" ] && args+=(--bindings "$BINDINGS")
    [ -n "$OPERATIONS" ] && args+=(--operations "$OPERATIONS")
    [ -n "$SIZES" ] && args+=(--sizes "$SIZES")
    [ -n "$COUNT" ] && args+=(--count "$COUNT")
    [ -n "$WINDOW" ] && args+=(--rdma-window "$WINDOW")
    [ "$RDMA_COPY" = 1 ] && args+=(--rdma-copy)
    [ -n "$MODES" ] && args+=(--modes "$MODES")
    [ -n "$FIGURES" ] && args+=(--figures "$FIGURES" --scale "$SCALE")
    # Other busy processes on the host (builds, fuzzers) take the emulated
    # CPUs' time and show up as millisecond round trips: note them.
    (
        while sleep 5; do
            top -b -n 1 -w 200 2>/dev/null |
                awk -v t="$(date +%T)" 'NR > 7 && $9 + 0 >= 30 && $12 !~ /qemu/ { print t, $9 "%", $12 }'
        done
    ) >"$STAGE/out/host-busy.txt" 2>/dev/null &
    sampler=$!
    set +e
    # 4 vCPUs (even on a 2-core host): the busy-polling benchmark threads
    # plus rxe's kernel work otherwise wait for scheduler ticks.
    # tsc=reliable: the guest kernel distrusts the emulated TSC and falls
    # back to the HPET, where every clock_gettime is an emulated device
    # access (microseconds): dxnet and the bench read the clock, perftest
    # uses rdtsc directly. TCG's TSC is the host's, so it is safe.
    DXNET_VM_SMP=${DXNET_VM_SMP:-4} "$ROOT/scripts/rdma-vm/vm.sh" --timeout "${DXNET_BENCH_TIMEOUT:-600}" \
        --append "${DXNET_VM_KERNEL_ARGS-tsc=reliable}" "$ROOT" \
        bash "$ROOT/scripts/bench-ib.sh" "${args[@]}" "$STAGE/out"
    rc=$?
    set -e
    kill "$sampler" 2>/dev/null || true
    wait "$sampler" 2>/dev/null || true
    mkdir -p "$OUT"
    cp -r "$STAGE/out/." "$OUT/"
    if [ -s "$OUT/host-busy.txt" ]; then
        echo "bench-ib: other busy host processes during the run (>= 30 % CPU, every 5 s; expect noisier numbers):" >&2
        awk '{ print $3 }' "$OUT/host-busy.txt" | sort | uniq -c | sort -rn | head -n 5 >&2
    fi
fi

if [ -s "$OUT/results.json" ]; then
    # Plots (and the table once more) on the host, where drawing is fast.
    if [ $PLOTS = 1 ]; then
        "$exe" plot "$OUT/results.json" --out "$OUT" >/dev/null 2>&1 ||
            echo "bench-ib: drawing the plots failed" >&2
    fi
    echo
    cat "$OUT/summary.txt"
fi
echo "bench-ib: host load average after: $(load); results in $OUT/results.json (status $rc, whole script $((SECONDS - T0)) s)" >&2
exit $rc
