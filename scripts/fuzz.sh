#!/usr/bin/env bash
# Runs every libFuzzer target in fuzz/ for SECONDS each (default 60) and fails
# on any crash, panic, leak, timeout or oversized allocation.
#
#   scripts/fuzz.sh [SECONDS]
#
# Installs cargo-fuzz if missing. The stable toolchain is used with
# RUSTC_BOOTSTRAP=1 (cargo-fuzz needs -Z flags). The committed seed corpus
# (fuzz/corpus/<target>) is read only; what the fuzzer finds goes to
# fuzz/corpus-work/<target> (ignored by git). FUZZ_UPDATE_CORPUS=1 writes
# into the committed corpus instead. Crashing inputs land in
# fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET="${1:-60}"
export RUSTC_BOOTSTRAP=1
export CARGO_TERM_COLOR=never

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "=== installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

start=$(date +%s)
echo "=== building fuzz targets"
(cd fuzz && cargo fuzz build)
targets=$(cd fuzz && cargo fuzz list)
# Run the binaries just built (`cargo fuzz run` would rebuild each target).
bin_dir="fuzz/target/$(rustc -vV | sed -n 's/^host: //p')/release"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_odr_violation=0}"

declare -A execs
failed=()
for t in $targets; do
  echo "=== fuzzing $t for ${SECONDS_PER_TARGET}s"
  work="fuzz/corpus-work/$t"
  seeds="fuzz/corpus/$t"
  mkdir -p "$work" "$seeds"
  if [ "${FUZZ_UPDATE_CORPUS:-0}" = 1 ]; then work="$seeds"; fi
  log="fuzz/corpus-work/$t.log"
  # -malloc_limit_mb: any single allocation above 64 MiB is a bug (nothing
  # may be sized by an untrusted length); -timeout: a hang is a bug.
  mkdir -p "fuzz/artifacts/$t"
  if "$bin_dir/$t" "$work" "$seeds" -artifact_prefix="fuzz/artifacts/$t/" \
      -max_total_time="$SECONDS_PER_TARGET" -timeout=10 \
      -rss_limit_mb=2048 -malloc_limit_mb=64 -print_final_stats=1 >"$log" 2>&1; then
    :
  else
    failed+=("$t")
    tail -40 "$log"
  fi
  n=$(grep -oE 'Done [0-9]+ runs' "$log" | grep -oE '[0-9]+' | tail -1 || true)
  execs[$t]="${n:-?}"
  echo "$t: ${execs[$t]} executions"
done

echo
echo "=== fuzz summary (${SECONDS_PER_TARGET}s per target, $(( $(date +%s) - start ))s in total, build included)"
printf '%-16s %14s\n' target executions
for t in $targets; do printf '%-16s %14s\n' "$t" "${execs[$t]}"; done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]} (inputs in fuzz/artifacts/)"
  exit 1
fi
echo "no crashes"
