#!/usr/bin/env bash
# scripts/bench-ib.sh - RDMA send bandwidth/latency baselines: perftest's
# ib_send_bw / ib_send_lat and dxnet-verbs' raw_verbs_bench example (RC SEND
# through the raw verbs layer), each as two processes over one device.
#
# Usage:
#   scripts/bench-ib.sh [--quick] [--repeat N] [--debug] OUTDIR
#       Build raw_verbs_bench (release) on the host, boot the Soft-RoCE VM
#       (scripts/rdma-vm/vm.sh) and run the benchmarks there.
#   scripts/bench-ib.sh --no-vm [--quick] [--debug] OUTDIR
#       Run on this host's own RDMA device (needs perftest installed and
#       RDMA_DEV, RDMA_GID_INDEX (RoCE), optionally RDMA_PORT set).
#   --quick     fewer iterations, one repetition (smoke test)
#   --repeat N  repetitions of every benchmark (default 3); results.json has
#               the median run of each (by msgs_per_sec, or p50 latency) with
#               "runs" and every run's value ("samples_...")
#   --debug     use a debug build of raw_verbs_bench
#
# OUTDIR gets results.json (a JSON array of records with the keys operation,
# mode, binding, size, msgs_per_sec, bytes_per_sec, lat_us, iters; binding is
# raw-verbs, ib_send_bw or ib_send_lat; lat_us is null for bandwidth records
# and {"min","avg","p50","p99","p999","max"} one-way microseconds for latency
# records, msgs_per_sec/bytes_per_sec are null there; "retransmits" counts
# rxe ACK-timeout retries during the run, each ~67 ms of dead time) plus the
# raw output of every run (*.log). Exit status non-zero if a benchmark failed.
#
# Under the VM (TCG software emulation, Soft-RoCE) the numbers measure the
# emulator, not a network: compare bindings within one run, never across
# machines.

set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
NO_VM=0
IN_VM=0
QUICK=0
REPEAT=3
PROFILE=release
BIN=
while [ $# -gt 0 ]; do
    case $1 in
        --no-vm) NO_VM=1; shift ;;
        --in-vm) IN_VM=1; BIN=$2; shift 2 ;;     # internal: run inside the VM
        --quick) QUICK=1; REPEAT=1; shift ;;
        --repeat) REPEAT=$2; shift 2 ;;
        --debug) PROFILE=debug; shift ;;
        -h|--help) sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; exit 0 ;;
        -*) echo "bench-ib.sh: unknown option $1" >&2; exit 2 ;;
        *) break ;;
    esac
done
[ $# = 1 ] || { echo "usage: bench-ib.sh [--no-vm] [--quick] [--repeat N] [--debug] OUTDIR" >&2; exit 2; }
OUT=$1

# ---------------------------------------------------------------------------
# The benchmarks themselves (inside the VM, or --no-vm on a real device)
# ---------------------------------------------------------------------------
run_benchmarks() {
    local bench=$1 out=$2
    mkdir -p "$out/records"
    : "${RDMA_DEV:?RDMA_DEV must name the RDMA device}"
    local port=${RDMA_PORT:-1}
    local -a G=(-d "$RDMA_DEV" -i "$port" -F)
    [ -n "${RDMA_GID_INDEX:-}" ] && G+=(-x "$RDMA_GID_INDEX")
    local n_small=20000 n_large=1000 n_lat=5000
    if [ $QUICK = 1 ]; then n_small=2000; n_large=200; n_lat=500; fi
    local failed=0 rep
    local counters=/sys/class/infiniband/$RDMA_DEV/ports/$port/hw_counters

    # wait until something listens on TCP port $1 (perftest's server)
    wait_listen() {
        local hex i=0
        hex=$(printf ':%04X' "$1")
        while ! grep -q "$hex 00000000:0000 0A" /proc/net/tcp 2>/dev/null; do
            i=$((i + 1)); [ $i -gt 600 ] && return 1
            sleep 0.05
        done
    }
    # rxe's retransmission counter (each retry costs one ACK timeout, ~67 ms)
    retries() { cat "$counters/completer_retry_err" 2>/dev/null || echo 0; }
    # add_record KEY JSON: keep one record of a repetition
    add_record() { echo "$2" >>"$out/records/$1.jsonl"; }
    # perftest TOOL SIZE ITERS TCPPORT REP: server + client, keeps a record
    perftest() {
        local tool=$1 size=$2 iters=$3 tport=$4 log="$out/$1-$2-r$5.log" spid crc src r0 line attempt
        for attempt in 1 2; do
            r0=$(retries)
            "$tool" "${G[@]}" -s "$size" -n "$iters" -p "$tport" >"$out/$tool-$size-r$5-server.log" 2>&1 &
            spid=$!
            wait_listen "$tport" || echo "bench-ib: $tool server did not start listening" >&2
            "$tool" "${G[@]}" -s "$size" -n "$iters" -p "$tport" 127.0.0.1 >"$log" 2>&1
            crc=$?
            wait $spid
            src=$?
            if [ $crc != 0 ] || [ $src != 0 ]; then
                echo "bench-ib: $tool -s $size failed (client $crc, server $src)" >&2
                cat "$log" "$out/$tool-$size-r$5-server.log" >&2
                failed=1
                return 0
            fi
            line=$(awk '/#bytes/ { getline; print; exit }' "$log")
            # perftest now and then prints inf/nan (clock trouble under emulation)
            echo "$line" | grep -qiE 'inf|nan' || break
            echo "bench-ib: $tool -s $size printed non-finite numbers; running it again" >&2
            mv "$log" "${log%.log}-nonfinite.log"
            line=
        done
        [ -n "$line" ] || { echo "bench-ib: no usable $tool -s $size result" >&2; return 0; }
        if [ "$tool" = ib_send_bw ]; then
            # bytes iterations BW_peak BW_average[MB/s] MsgRate[Mpps]
            add_record "$tool-$size" "$(echo "$line" | awk -v size="$size" -v iters="$iters" -v rt="$(( $(retries) - r0 ))" '{
                mps = $5 * 1000000
                printf "{\"operation\":\"send\",\"mode\":\"bw\",\"binding\":\"ib_send_bw\",\"size\":%d,\"iters\":%d,\"msgs_per_sec\":%.1f,\"bytes_per_sec\":%.1f,\"lat_us\":null,\"perftest_bw_avg_MBps\":%s,\"retransmits\":%d}\n", size, iters, mps, mps * size, $4, rt }')"
        else
            # bytes iterations t_min t_max t_typical t_avg t_stdev p99 p99.9
            add_record "$tool-$size" "$(echo "$line" | awk -v size="$size" -v iters="$iters" -v rt="$(( $(retries) - r0 ))" '{
                printf "{\"operation\":\"send\",\"mode\":\"lat\",\"binding\":\"ib_send_lat\",\"size\":%d,\"iters\":%d,\"msgs_per_sec\":null,\"bytes_per_sec\":null,\"lat_us\":{\"min\":%s,\"avg\":%s,\"p50\":%s,\"p99\":%s,\"p999\":%s,\"max\":%s,\"stdev\":%s},\"retransmits\":%d}\n", size, iters, $3, $6, $5, $8, $9, $4, $7, rt }')"
        fi
    }
    raw() {   # raw MODE SIZE ITERS TCPPORT REP
        local log="$out/raw-verbs-$1-$2-r$5.log" r0 line
        r0=$(retries)
        if "$bench" both --mode "$1" --size "$2" --iters "$3" --tcp-port "$4" >"$log" 2>"${log%.log}.err"; then
            line=$(grep '^{' "$log" | tail -n 1)
            add_record "raw-verbs-$1-$2" "${line%\}},\"retransmits\":$(( $(retries) - r0 ))}"
        else
            echo "bench-ib: raw_verbs_bench --mode $1 --size $2 failed" >&2
            cat "$log" "${log%.log}.err" >&2
            failed=1
        fi
    }
    # median KEY FIELD: the record with the median FIELD among the
    # repetitions, plus "runs" and the FIELD value of every run ("samples")
    median() {
        local f="$out/records/$1.jsonl" vals n pick
        [ -s "$f" ] || return 0
        vals=$(sed -n "s/.*\"$2\":\([0-9.]*\).*/\1/p" "$f")
        n=$(echo "$vals" | wc -l)
        pick=$(echo "$vals" | awk '{ print $1, NR }' | sort -n | awk -v m=$(( (n + 1) / 2 )) 'NR == m { print $2 }')
        line=$(sed -n "${pick}p" "$f")
        echo "${line%\}},\"runs\":$n,\"samples_$2\":[$(echo "$vals" | paste -sd, -)]}"
    }

    echo "bench-ib: device $RDMA_DEV port $port gid index ${RDMA_GID_INDEX:-none}, $REPEAT repetitions" >&2
    for rep in $(seq 1 "$REPEAT"); do
        # interleaved, so that load changes hit every binding alike
        perftest ib_send_bw 64 $n_small 18515 "$rep"
        raw bw 64 $n_small 18715 "$rep"
        perftest ib_send_bw 65536 $n_large 18516 "$rep"
        raw bw 65536 $n_large 18716 "$rep"
        perftest ib_send_lat 64 $n_lat 18517 "$rep"
        raw lat 64 $n_lat 18717 "$rep"
    done

    local -a records=()
    local r
    for r in "$(median ib_send_bw-64 msgs_per_sec)" "$(median raw-verbs-bw-64 msgs_per_sec)" \
             "$(median ib_send_bw-65536 msgs_per_sec)" "$(median raw-verbs-bw-65536 msgs_per_sec)" \
             "$(median ib_send_lat-64 p50)" "$(median raw-verbs-lat-64 p50)"; do
        [ -n "$r" ] && records+=("$r")
    done
    {
        echo "["
        local i
        for i in "${!records[@]}"; do
            if [ "$i" -lt $((${#records[@]} - 1)) ]; then echo "  ${records[$i]},"; else echo "  ${records[$i]}"; fi
        done
        echo "]"
    } >"$out/results.json"
    cat "$out/results.json"
    return $failed
}

if [ $IN_VM = 1 ]; then
    run_benchmarks "$BIN" "$OUT"
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
    cargo build --release -p dxnet-verbs --example raw_verbs_bench
else
    cargo build -p dxnet-verbs --example raw_verbs_bench
fi
exe=$(cargo metadata --format-version 1 --no-deps 2>/dev/null | grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4)
exe=${exe:-$ROOT/target}/$PROFILE/examples/raw_verbs_bench
[ -x "$exe" ] || { echo "bench-ib.sh: $exe was not built" >&2; exit 1; }

if [ $NO_VM = 1 ]; then
    run_benchmarks "$exe" "$OUT"
    exit $?
fi

STAGE="$ROOT/target/ib-vm/bench"
rm -rf "$STAGE"
mkdir -p "$STAGE/bin" "$STAGE/out"
cp "$exe" "$STAGE/bin/raw_verbs_bench"
args=(--in-vm "$STAGE/bin/raw_verbs_bench")
[ $QUICK = 1 ] && args+=(--quick)
args+=(--repeat "$REPEAT")
set +e
# 4 vCPUs (even on a 2-core host): two busy-polling processes plus rxe's
# kernel work otherwise wait for scheduler ticks (4 ms latency outliers)
DXNET_VM_SMP=${DXNET_VM_SMP:-4} "$ROOT/scripts/rdma-vm/vm.sh" --timeout "${DXNET_BENCH_TIMEOUT:-900}" "$ROOT" \
    bash "$ROOT/scripts/bench-ib.sh" "${args[@]}" "$STAGE/out"
rc=$?
set -e
mkdir -p "$OUT"
cp -r "$STAGE/out/." "$OUT/"
echo "bench-ib: results in $OUT/results.json (status $rc)" >&2
exit $rc
