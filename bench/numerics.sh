#!/bin/bash
# Bug or numerics, issue 42: the per-state confusion matrix of the verdict on engines whose fault
# is known (tests/numerics/calibration.py: tiny random Llama and Qwen3, legitimate engines held out
# of the envelope, buggy ones; the fixed screen "engine argmax != reference argmax"), with the
# machine's facts beside it.
#
#   bench/numerics.sh [BUILD_DIR]
# Environment: DISPUTES (200 per engine), SEEDS (16 reduction members), MAX_PROMPTS (20000 per
# engine), THREADS (1), SKIP (engines to leave out, space-separated). Writes bench/numerics.md (or $OUT).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
out=${OUT:-$here/bench/numerics.md}
python=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
[ -x "$build/client/assay" ] || { echo "no $build/client/assay (build first)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
capability=$($python -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
gemm=$($python - <<'PY'
import time, torch
torch.set_num_threads(2)
a = torch.randn(2048, 2048, dtype=torch.bfloat16); b = torch.randn(2048, 2048, dtype=torch.bfloat16)
a @ b
t = time.perf_counter(); n = 5
for _ in range(n): a @ b
print(f"{2 * 2048**3 * n / (time.perf_counter() - t) / 1e9:.0f}")
PY
)
$python "$here/tests/numerics/calibration.py" --assay "$build/client/assay" \
  --disputes "${DISPUTES:-200}" --max-prompts "${MAX_PROMPTS:-20000}" --seeds "${SEEDS:-16}" \
  --threads "${THREADS:-1}" ${SKIP:+$(printf -- '--skip %s ' $SKIP)} --markdown "$work/table.md" | tee "$work/log.txt"
{
  echo "# Bug or numerics: the verdict on engines whose fault is known"
  echo
  echo "\`bench/numerics.sh\`, $(date -u +%Y-%m-%dT%H:%MZ); $cpu; ATEN_CPU_CAPABILITY $capability;"
  echo "bf16 GEMM (2048^3, 2 threads) ${gemm} GFLOP/s in the same run."
  echo
  echo "Per-state confusion matrix (tests/numerics/calibration.py): each engine's disputes over"
  echo "both tiny models, classified by \`assay numerics classify\` from the envelope the product"
  echo "computes. A legitimate engine's dispute called reference_decides is a false accusation."
  echo
  cat "$work/table.md"
} >"$out"
echo "wrote $out"
