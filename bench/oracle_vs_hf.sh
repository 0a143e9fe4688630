#!/usr/bin/env bash
# Benchmark of issue 22: assay-oracle against transformers' eager forward (bench/oracle_vs_hf.py)
# on the small Llama fixture at T=512 and the Qwen3-4B-shaped checkpoint (8 GB, kept in
# /var/tmp/assay-bench-qwen3-4b between runs) at T=42 and T=1024, in one run, plus this CPU's
# bf16/fp32 GEMM rate. Writes bench/oracle_vs_hf.md.
#   bench/oracle_vs_hf.sh [--build DIR] [--no-4b] [--threads N] [--4b-lengths "42 1024"]
# (ASSAY_BENCH_ARGS="--repeat N": runs of each side per case, the fastest reported; default 2)
# (a 4B forward at T=1024 takes about 10 minutes a side on a 2-core AVX2 machine);
# ASSAY_BENCH_ARGS=--skip-gemm leaves out the GEMM rate (minutes in bf16 without native bf16).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build
big=1
threads=$(nproc)
lengths="42 1024"
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$(cd "$2" && pwd); shift 2 ;;
    --no-4b) big=0; shift ;;
    --threads) threads=$2; shift 2 ;;
    --4b-lengths) lengths=$2; shift 2 ;;
    *) echo "usage: $0 [--build DIR] [--no-4b] [--threads N] [--4b-lengths \"42 1024\"]" >&2; exit 2 ;;
  esac
done
py=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
oracle=$build/worker/assay-oracle
[ -x "$oracle" ] || { echo "no $oracle (scripts/build)" >&2; exit 2; }
small=/var/tmp/assay-bench-llama-small
[ -f "$small/model.safetensors" ] ||
  "$py" "$root/tests/fixtures/make_fixture.py" --arch llama --size small --out "$small" --seed 1 >/dev/null
cases=(--case "small:$small:512")
if [ $big = 1 ]; then
  qwen=/var/tmp/assay-bench-qwen3-4b
  [ -f "$qwen/config.json" ] ||
    "$py" "$root/tests/fixtures/make_fixture.py" --arch qwen3 --size 4b --shards 4 --seed 0 --out "$qwen" >/dev/null
  for t in $lengths; do cases+=(--case "qwen3-4b:$qwen:$t"); done
fi
exec "$py" "$root/bench/oracle_vs_hf.py" --oracle "$oracle" --threads "$threads" "${cases[@]}" \
  --out "$root/bench/oracle_vs_hf.md" ${ASSAY_BENCH_ARGS:-}
