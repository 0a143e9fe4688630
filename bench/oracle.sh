#!/bin/bash
# Benchmark of issue 5: small fixture (~42M parameters, Llama), T = 512, all positions.
# assay-oracle `logits` process wall time against the Python reference process
# (tests/reference/reference.py, same ATen build) on the same machine, same thread count;
# ratio of medians (goal <= 0.8). Also load time, forward time and peak RSS of each.
#
#   bench/oracle.sh [BUILD_DIR] [RUNS]      (default build-oracle, 5)
# Environment: THREADS (2), TOKENS (512), SKIP_REFERENCE=1 (no Python reference runs),
# ORACLE_BEFORE=/path/to/an/earlier/assay-oracle: measured the same way, interleaved in the same
# run, for a before/after table (what a change costs: wall, load, peak RSS and their ratios).
# Writes the results to bench/oracle.md (or $OUT).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build-oracle}
runs=${2:-5}
threads=${THREADS:-2}
tokens=${TOKENS:-512}
skip_reference=${SKIP_REFERENCE:-0}
before=${ORACLE_BEFORE:-}
out=${OUT:-$here/bench/oracle.md}
oracle=$build/worker/assay-oracle
python=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
work=${TMPDIR:-/tmp}/assay-bench-oracle
model=$work/llama-small
mkdir -p "$work"
[ -x "$oracle" ] || { echo "no $oracle (build the assay-oracle target first)" >&2; exit 1; }
if [ ! -f "$model/model.safetensors" ]; then
  $python "$here/tests/fixtures/make_fixture.py" --arch llama --size small --out "$model" --seed 1
fi
ids=$($python -c "import random; r=random.Random(512); print(','.join(str(r.randrange(8192)) for _ in range($tokens)))")

# Each run: "wall_seconds max_rss_kb load_seconds forward_seconds cpu_seconds" appended to a file.
measure() {  # name command...
  local name=$1; shift
  /usr/bin/time -f "%e %M %U %S" -o "$work/time.txt" "$@" 2>"$work/err.txt" >/dev/null ||
    { cat "$work/err.txt" >&2; exit 1; }
  local load forward
  load=$(grep -o 'load_seconds=[0-9.e-]*' "$work/err.txt" | cut -d= -f2)
  forward=$(grep -o 'forward_seconds=[0-9.e-]*' "$work/err.txt" | cut -d= -f2)
  read -r wall rss user sys <"$work/time.txt"
  echo "$wall $rss $load $forward $(awk -v u="$user" -v s="$sys" 'BEGIN {print u + s}')" >>"$work/$name.runs"
}

rm -f "$work"/*.runs
for i in $(seq "$runs"); do
  measure oracle "$oracle" logits --model "$model" --token-ids "$ids" --out "$work/oracle.st" \
    --all-positions --threads "$threads" --verbose
  if [ -n "$before" ]; then
    measure before "$before" logits --model "$model" --token-ids "$ids" --out "$work/before.st" \
      --all-positions --threads "$threads" --verbose
  fi
  if [ "$skip_reference" != 1 ]; then
    measure reference $python "$here/tests/reference/reference.py" --model "$model" \
      --token-ids "$ids" --out "$work/reference.st" --all-positions --threads "$threads" --verbose
  fi
done
# The files differ only in their metadata; compare the logits themselves.
same_logits() {  # file file
  $python - "$1" "$2" "$here/tests/reference" <<'PY'
import sys
import torch
sys.path.insert(0, sys.argv[3])
import reference
a, b = (reference.read_safetensors(p)["logits"] for p in sys.argv[1:3])
print("bitwise equal" if a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32)) else "DIFFERENT")
PY
}

median() {  # file column
  awk -v c="$2" '{print $c}' "$1" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.3f", a / b}'; }
ow=$(median "$work/oracle.runs" 1); orss=$(median "$work/oracle.runs" 2)
ol=$(median "$work/oracle.runs" 3); of=$(median "$work/oracle.runs" 4); oc=$(median "$work/oracle.runs" 5)
weights=$(stat -c %s "$model/model.safetensors")
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')

{
  cat <<MD
# assay-oracle benchmark

\`bench/oracle.sh\` — small Llama fixture ($((weights / 1000000)) MB of bf16 weights, ~42M
parameters, vocab 8192), T = $tokens, all positions, $threads threads, $runs runs each, medians.
Machine: $cpu, $(nproc) cores (shared), $(date -u +%Y-%m-%d).
MD
  if [ "$skip_reference" != 1 ]; then
    rw=$(median "$work/reference.runs" 1); rrss=$(median "$work/reference.runs" 2)
    rl=$(median "$work/reference.runs" 3); rf=$(median "$work/reference.runs" 4)
    cat <<MD

## Against the Python reference

Baseline: the Python reference process (\`tests/reference/reference.py\`, Debian python3-torch,
the same ATen build) measured in the same run. Goal: ratio <= 0.8.

| | assay-oracle | Python reference |
|---|---|---|
| process wall time (s) | $ow | $rw |
| load (s) | $ol | $rl |
| forward (s) | $of | $rf |
| peak RSS (MB) | $((orss / 1024)) | $((rrss / 1024)) |

**Ratio of medians (oracle / reference): $(ratio "$ow" "$rw").** Logits: $(same_logits "$work/oracle.st" "$work/reference.st").
Peak RSS for reference: weights $((weights / 1048576)) MiB, logits $tokens x 8192 F32.
MD
  fi
  if [ -n "$before" ]; then
    bw=$(median "$work/before.runs" 1); brss=$(median "$work/before.runs" 2)
    bl=$(median "$work/before.runs" 3); bf=$(median "$work/before.runs" 4); bc=$(median "$work/before.runs" 5)
    cat <<MD

## Before / after (same run, interleaved)

Before: \`$before\`; after: \`$oracle\`.

| | before | after | after / before |
|---|---|---|---|
| process wall time (s) | $bw | $ow | $(ratio "$ow" "$bw") |
| process CPU time, user + sys (s) | $bc | $oc | $(ratio "$oc" "$bc") |
| load (s) | $bl | $ol | $(ratio "$ol" "$bl") |
| forward (s) | $bf | $of | $(ratio "$of" "$bf") |
| peak RSS (MB) | $((brss / 1024)) | $((orss / 1024)) | $(ratio "$orss" "$brss") |

Logits before and after: $(same_logits "$work/oracle.st" "$work/before.st").
MD
  fi
} >"$out"
cat "$out"
