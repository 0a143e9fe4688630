#!/usr/bin/env bash
# Issue 37, item 1 (bench/cold_job.py): a cold next-token job through assayd reading the weights
# once (the fingerprint leaves settled shards to the oracle) against the same job reading them
# twice (shards just touched) and against transformers' eager forward, interleaved, same run.
# Cases: the small llama fixture and the Qwen3-4B-shaped 8 GB checkpoint (kept in
# /var/tmp/assay-bench-qwen3-4b, as bench/oracle_vs_hf.sh keeps it), T=42 (the 4B case's T is
# --4b-tokens: 1 where bf16 is emulated and a 4B forward at T=42 takes minutes).
# Usage: bench/cold_job.sh [--build DIR] [--no-4b] [--4b-tokens T] [--rounds N]
#        (CONTAINMENT=auto|none) Writes bench/cold_job.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build
big=1
big_tokens=42
rounds=3
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$(cd "$2" && pwd); shift 2 ;;
    --no-4b) big=0; shift ;;
    --4b-tokens) big_tokens=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    -h | --help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: $0 [--build DIR] [--no-4b] [--4b-tokens T] [--rounds N]" >&2; exit 2 ;;
  esac
done
py=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
for b in "$build/supervisor/assayd" "$build/fingerprint/assay-fingerprint" "$build/worker/assay-oracle"; do
  [ -x "$b" ] || { echo "missing $b" >&2; exit 2; }
done
work=$(mktemp -d /var/tmp/assay-cold-bench.XXXXXX)
trap 'pkill -f "serve --socket $work" 2>/dev/null || true; rm -rf "$work"' EXIT
chmod 755 "$work"
"$py" "$root/tests/fixtures/make_fixture.py" --arch llama --size small --out "$work/small" >/dev/null
cases=(--case "small:$work/small:42")
if [ "$big" = 1 ]; then
  qwen=/var/tmp/assay-bench-qwen3-4b
  [ -f "$qwen/config.json" ] ||
    "$py" "$root/tests/fixtures/make_fixture.py" --arch qwen3 --size 4b --shards 4 --seed 0 --out "$qwen" >/dev/null
  cases+=(--case "qwen3-4b:$qwen:$big_tokens")
fi
chmod -R a+rX "$work"
"$py" -c 'import torch, transformers' 2>/dev/null
cd "$root/bench"
"$py" "$root/bench/cold_job.py" --build "$build" "${cases[@]}" --work "$work" \
  --out "$root/bench/cold_job.md" --rounds "$rounds" --containment "${CONTAINMENT:-auto}"
