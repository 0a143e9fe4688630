#!/bin/bash
# Benchmark of issue 5: small fixture (~42M parameters, Llama), T = 512, all positions.
# assay-oracle `logits` process wall time against the Python reference process
# (tests/reference/reference.py, same ATen build) on the same machine, same thread count;
# ratio of medians (goal <= 0.8). Also load time, forward time and peak RSS of each.
#
#   bench/oracle.sh [BUILD_DIR] [RUNS]      (default build-oracle, 5)
# Writes the results to bench/oracle.md.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build-oracle}
runs=${2:-5}
threads=${THREADS:-2}
oracle=$build/worker/assay-oracle
python=/usr/bin/python3
work=${TMPDIR:-/tmp}/assay-bench-oracle
model=$work/llama-small
mkdir -p "$work"
[ -x "$oracle" ] || { echo "no $oracle (build the assay-oracle target first)" >&2; exit 1; }
if [ ! -f "$model/model.safetensors" ]; then
  $python "$here/tests/fixtures/make_fixture.py" --arch llama --size small --out "$model" --seed 1
fi
ids=$($python -c "import random; r=random.Random(512); print(','.join(str(r.randrange(8192)) for _ in range(512)))")

# Each run: "wall_seconds max_rss_kb load_seconds forward_seconds" appended to a file.
measure() {  # name command...
  local name=$1; shift
  /usr/bin/time -f "%e %M" -o "$work/time.txt" "$@" 2>"$work/err.txt" >/dev/null ||
    { cat "$work/err.txt" >&2; exit 1; }
  local load forward
  load=$(grep -o 'load_seconds=[0-9.e-]*' "$work/err.txt" | cut -d= -f2)
  forward=$(grep -o 'forward_seconds=[0-9.e-]*' "$work/err.txt" | cut -d= -f2)
  echo "$(cat "$work/time.txt") $load $forward" >>"$work/$name.runs"
}

rm -f "$work"/*.runs
for i in $(seq "$runs"); do
  measure oracle "$oracle" logits --model "$model" --token-ids "$ids" --out "$work/oracle.st" \
    --all-positions --threads "$threads" --verbose
  measure reference $python "$here/tests/reference/reference.py" --model "$model" \
    --token-ids "$ids" --out "$work/reference.st" --all-positions --threads "$threads" --verbose
done
# The two files differ only in their metadata; compare the logits themselves.
same=$($python - "$work/oracle.st" "$work/reference.st" "$here/tests/reference" <<'PY'
import sys
import torch
sys.path.insert(0, sys.argv[3])
import reference
a, b = (reference.read_safetensors(p)["logits"] for p in sys.argv[1:3])
print("bitwise equal" if a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32)) else "DIFFERENT")
PY
)

median() {  # file column
  awk -v c="$2" '{print $c}' "$1" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'
}
ow=$(median "$work/oracle.runs" 1); rw=$(median "$work/reference.runs" 1)
orss=$(median "$work/oracle.runs" 2); rrss=$(median "$work/reference.runs" 2)
ol=$(median "$work/oracle.runs" 3); rl=$(median "$work/reference.runs" 3)
of=$(median "$work/oracle.runs" 4); rf=$(median "$work/reference.runs" 4)
ratio=$(awk -v a="$ow" -v b="$rw" 'BEGIN {printf "%.3f", a / b}')
weights=$(stat -c %s "$model/model.safetensors")
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')

cat >"$here/bench/oracle.md" <<MD
# assay-oracle benchmark

\`bench/oracle.sh\` — small Llama fixture ($((weights / 1000000)) MB of bf16 weights, ~42M
parameters, vocab 8192), T = 512, all positions, $threads threads, $runs runs each, medians.
Baseline: the Python reference process (\`tests/reference/reference.py\`, Debian python3-torch,
the same ATen build) measured in the same run. Goal: ratio <= 0.8.

| | assay-oracle | Python reference |
|---|---|---|
| process wall time (s) | $ow | $rw |
| load (s) | $ol | $rl |
| forward (s) | $of | $rf |
| peak RSS (MB) | $((orss / 1024)) | $((rrss / 1024)) |

**Ratio of medians (oracle / reference): $ratio.** Logits: $same.

Machine: $cpu, $(nproc) cores (shared), $(date -u +%Y-%m-%d).
Peak RSS for reference: weights $((weights / 1048576)) MiB, logits 512 x 8192 F32 = 16 MiB.
MD
cat "$here/bench/oracle.md"
