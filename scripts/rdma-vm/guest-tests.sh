#!/bin/sh
# Runs inside the RDMA VM (started by scripts/test-ib.sh): every test binary
# in STAGE/tests with --include-ignored (so the device tests run too), then
# every executable in STAGE/programs (two-process examples). With
# DXNET_TEST_FILTER set, only the tests whose name contains it (no
# programs). Prints a summary line and exits non-zero if anything failed.
set -u
STAGE=$1
passed=0
failed=0
failures=
echo "== RDMA device: $RDMA_DEV port $RDMA_PORT, GID index $RDMA_GID_INDEX ($RDMA_IP), $(uname -r)"
for t in "$STAGE"/tests/*; do
    [ -x "$t" ] || continue
    name=${t##*/}
    echo "== test binary $name"
    start=$(cut -d' ' -f1 /proc/uptime)
    if "$t" --include-ignored --test-threads=1 ${DXNET_TEST_FILTER:-}; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1)); failures="$failures $name"
    fi
    echo "== $name took $(awk -v s="$start" '{ printf "%.1f", $1 - s }' /proc/uptime)s"
done
for p in "$STAGE"/programs/*; do
    [ -x "$p" ] || continue
    [ -z "${DXNET_TEST_FILTER:-}" ] || continue
    name=${p##*/}
    echo "== program $name"
    start=$(cut -d' ' -f1 /proc/uptime)
    if "$p"; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1)); failures="$failures $name"
    fi
    echo "== $name took $(awk -v s="$start" '{ printf "%.1f", $1 - s }' /proc/uptime)s"
done
echo "rxe counters: $(for c in sent_pkts rcvd_pkts completer_retry_err rcvd_rnr_err retry_exceeded_err; do
    printf '%s=%s ' "$c" "$(cat /sys/class/infiniband/$RDMA_DEV/ports/$RDMA_PORT/hw_counters/$c 2>/dev/null)"; done)"
[ $failed -eq 0 ] || echo "FAILED:$failures"
echo "test-ib: $passed passed, $failed failed"
[ $failed -eq 0 ]
