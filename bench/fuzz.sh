#!/usr/bin/env bash
# Every libFuzzer target (tests/fuzz/) run for SECONDS (default 600) on its seeds, one after the
# other, through scripts/fuzz; writes bench/fuzz.md with the machine, the clang and per target the
# executions, exec/s, libFuzzer's final cov and ft, the corpus it grew and what it found (its
# "## Findings" section, written by hand, is kept).
# nlohmann::json assertions are counted per site rather than ending a run
# (ASSAY_FUZZ_JSON_ASSERT=throw): where the caller catches std::exception, as assayd's engine does,
# one run then lists every site; elsewhere the exception ends the run like any crash.
# Usage: bench/fuzz.sh [SECONDS=600] [TARGET...]   (run it under nice: it takes a core for hours)
# ASSAY_FUZZ_PARALLEL=N runs N shares of the targets side by side (one core each).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-600}
shift || true
out=$(mktemp)
started=$(date -u +%Y-%m-%dT%H:%MZ)
parallel=${ASSAY_FUZZ_PARALLEL:-1}
"$root/scripts/fuzz" --build-only "$@"
set +e
pids=()
for k in $(seq 1 "$parallel"); do
  ASSAY_FUZZ_JSON_ASSERT=throw "$root/scripts/fuzz" "$seconds" --no-build --group "$k/$parallel" \
    "$@" >"$out.$k" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
head -1 "$out.1" >"$out"
for k in $(seq 1 "$parallel"); do tail -n +2 "$out.$k" >>"$out"; rm -f "$out.$k"; done
cat "$out"
set -e
{
  echo "# libFuzzer targets, $seconds s each (bench/fuzz.sh)"
  echo
  echo "Started $started, commit $(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet || echo ' (tree modified)');" \
    "$(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1), $(nproc) cores;" \
    "$(clang++ --version | head -1); $parallel target(s) at a time under nice -n 19, beside other work."
  echo "scripts/fuzz exit $rc (0: no target crashed)."
  echo
  echo '```'
  cat "$out"
  echo '```'
  echo
  # The findings are written by hand: kept from the last bench/fuzz.md.
  if [ -f "$root/bench/fuzz.md" ]; then sed -n '/^## Findings/,$p' "$root/bench/fuzz.md"; fi
} >"$root/bench/fuzz.md.new"
mv "$root/bench/fuzz.md.new" "$root/bench/fuzz.md"
rm -f "$out"
exit $rc
