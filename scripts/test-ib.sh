#!/usr/bin/env bash
# scripts/test-ib.sh - test dxnet's InfiniBand/RoCE layer against a real verbs
# stack: builds the dxnet-verbs tests and examples on the host, then runs
# them inside a throw-away QEMU VM with a Soft-RoCE device (rxe0, see
# scripts/rdma-vm/vm.sh), including the #[ignore]d device tests and the
# two-process rc_pingpong example.
#
# Usage: scripts/test-ib.sh [--no-host-tests] [--timeout SECONDS] [--verbose]
#                           [--filter NAME]
#   --no-host-tests  skip `cargo test -p dxnet-verbs` on the host (the tests
#                    that need no device: layouts, errors, WR chains)
#   --timeout S      limit for the VM run (default 600)
#   --verbose        show the guest kernel console
#   --filter NAME    run only the tests whose name contains NAME (in every
#                    test binary; the programs are skipped)
# Environment passed into the VM when set: DXNET_TEST_SEED,
# DXNET_TEST_MESSAGES, RUST_BACKTRACE, RUST_LOG.
#
# Works from a fresh clone as root on Debian 12 (installs qemu-system-x86,
# xz-utils and libibverbs-dev with apt when missing; the guest packages come
# from `apt-get download`); needs a
# Rust toolchain (cargo). Non-interactive; exit status 0 = all passed.

set -euo pipefail
T0=$SECONDS
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VM="$ROOT/scripts/rdma-vm/vm.sh"
HOST_TESTS=1
FILTER=
VM_ARGS=()
while [ $# -gt 0 ]; do
    case $1 in
        --no-host-tests) HOST_TESTS=0; shift ;;
        --timeout) VM_ARGS+=(--timeout "$2"); shift 2 ;;
        --verbose) VM_ARGS+=(--verbose); shift ;;
        --filter) FILTER=$2; shift 2 ;;
        -h|--help) sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) echo "test-ib.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
say() { printf '\n=== test-ib: %s\n' "$*" >&2; }

command -v cargo >/dev/null || { echo "test-ib.sh: cargo not found (install a Rust toolchain)" >&2; exit 2; }

# The header lets the layout test compare against the installed verbs.h.
if [ ! -f /usr/include/infiniband/verbs.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing libibverbs-dev (for the struct layout check)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends libibverbs-dev >&2 ||
        { apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends libibverbs-dev >&2; } ||
        echo "test-ib.sh: warning: could not install libibverbs-dev" >&2
fi

cd "$ROOT"
if [ $HOST_TESTS = 1 ]; then
    say "host tests (no device needed)"
    if [ -f /usr/include/infiniband/verbs.h ]; then export DXNET_VERBS_REQUIRE_HEADER=1; fi
    cargo test -p dxnet-verbs
fi

say "building the tests and examples for the VM"
# The example's path from cargo's own report (the order of the artifacts in
# `cargo test --message-format=json` varies: an example may come first).
rc_pingpong=$(cargo build -p dxnet-verbs --examples --message-format=json |
    grep '"name":"rc_pingpong"' | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -n 1)
[ -x "$rc_pingpong" ] || { echo "test-ib.sh: rc_pingpong example not built" >&2; exit 1; }
tests_json=$(cargo test -p dxnet-verbs --no-run --message-format=json)
STAGE="$ROOT/target/ib-vm/test"
rm -rf "$STAGE"
mkdir -p "$STAGE/tests" "$STAGE/programs"
# integration-test binaries (kind "test"); the library's unit tests need no device
echo "$tests_json" | grep '"kind":\["test"\]' | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 |
while read -r exe; do
    name=${exe##*/}
    cp "$exe" "$STAGE/tests/${name%-*}"
done
# dxnet's own engine tests (multi-process nodes on the verbs device).
cargo test -p dxnet --test ib --no-run --message-format=json |
    grep '"kind":\["test"\]' | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 |
while read -r exe; do
    cp "$exe" "$STAGE/tests/dxnet-ib"
done
# dxshuffle over the device (in-process nodes).
cargo test -p dxshuffle --test ib --no-run --message-format=json |
    grep '"kind":\["test"\]' | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 |
while read -r exe; do
    cp "$exe" "$STAGE/tests/dxshuffle-ib"
done
cp "$rc_pingpong" "$STAGE/programs/rc_pingpong"
ls "$STAGE/tests" | grep -q . || { echo "test-ib.sh: no test binaries found" >&2; exit 1; }

say "running in the RDMA VM: $(ls "$STAGE/tests" "$STAGE/programs" | grep -v : | tr '\n' ' ')"
set +e
"$VM" "${VM_ARGS[@]}" --env RUST_BACKTRACE="${RUST_BACKTRACE:-1}" \
    ${DXNET_TEST_SEED:+--env DXNET_TEST_SEED="$DXNET_TEST_SEED"} \
    ${DXNET_TEST_MESSAGES:+--env DXNET_TEST_MESSAGES="$DXNET_TEST_MESSAGES"} \
    ${RUST_LOG:+--env RUST_LOG="$RUST_LOG"} \
    ${FILTER:+--env DXNET_TEST_FILTER="$FILTER"} \
    "$ROOT" sh "$ROOT/scripts/rdma-vm/guest-tests.sh" "$STAGE"
rc=$?
set -e
if [ $rc = 0 ]; then
    say "PASSED (whole script: $((SECONDS - T0)) s)"
else
    say "FAILED with status $rc (whole script: $((SECONDS - T0)) s)"
fi
exit $rc
