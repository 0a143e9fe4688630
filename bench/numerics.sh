#!/bin/bash
# Bug or numerics, issue 42: the per-state confusion matrix of the verdict on engines whose fault
# is known (tests/numerics/calibration.py: tiny random Llama and Qwen3, legitimate engines held out
# of the envelope, buggy ones; the fixed screen "engine argmax != reference argmax"), with the
# machine's facts beside it.
#
#   bench/numerics.sh [BUILD_DIR]
# Environment: DISPUTES (200 per engine), SEEDS (16 reduction members), MAX_PROMPTS (20000 per
# engine), THREADS (1), SKIP (engines to leave out, space-separated). Writes bench/numerics.md (or $OUT).
# PART=state or PART=audit runs one half and keeps the other's section of the file as it was.
# The engine audit (tests/numerics/audit_calibration.py): AUDIT_PANELS (5 per model),
# AUDIT_CONTEXTS (32), AUDIT_LENGTH (64), AUDIT_SEEDS (8), AUDIT_SKIP (engines to leave out).
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
part=${PART:-all}
facts="\`bench/numerics.sh\`, $(date -u +%Y-%m-%dT%H:%MZ); $cpu; ATEN_CPU_CAPABILITY $capability;
bf16 GEMM (2048^3, 2 threads) ${gemm} GFLOP/s in the same run."
if [ "$part" != state ]; then
  $python "$here/tests/numerics/audit_calibration.py" --assay "$build/client/assay" \
    --panels "${AUDIT_PANELS:-5}" --contexts "${AUDIT_CONTEXTS:-32}" --length "${AUDIT_LENGTH:-64}" \
    --seeds "${AUDIT_SEEDS:-8}" ${AUDIT_SKIP:+--skip $AUDIT_SKIP} --markdown "$work/audit.md"
  {
    echo "<!-- audit:begin (bench/numerics.sh PART=audit rewrites this section) -->"
    echo "## The engine audit over panels"
    echo
    echo "$facts"
    echo
    echo "Each engine's logits at every position of each panel against the product's audit"
    echo "(tests/numerics/audit_calibration.py: worker/hf/assay_numerics.py measures, \`assay numerics"
    echo "audit\` tests). A legitimate engine flagged is a false alarm; \"positions to first flag\" is the"
    echo "fewest positions (a prefix of the panel's contexts, 4 at a time) at which p < alpha."
    echo
    cat "$work/audit.md"
    echo "<!-- audit:end -->"
  } >"$work/audit-section.md"
fi
if [ "$part" = state ] && [ -f "$out" ]; then  # keep the audit section as it was
  sed -n '/<!-- audit:begin/,/<!-- audit:end -->/p' "$out" >"$work/audit-section.md"
  [ -s "$work/audit-section.md" ] || rm -f "$work/audit-section.md"
fi
if [ "$part" = audit ]; then
  [ -f "$out" ] || { echo "PART=audit needs an existing $out" >&2; exit 1; }
  $python - "$out" "$work/audit-section.md" <<'PY'
import re, sys
doc, section = open(sys.argv[1]).read(), open(sys.argv[2]).read()
pattern = re.compile(r"<!-- audit:begin.*?<!-- audit:end -->\n", re.S)
doc = pattern.sub(lambda m: section, doc) if pattern.search(doc) else doc.rstrip("\n") + "\n\n" + section
open(sys.argv[1], "w").write(doc)
PY
  echo "wrote the audit section of $out"
  exit 0
fi
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
  if [ -f "$work/audit-section.md" ]; then echo; cat "$work/audit-section.md"; fi
} >"$out"
echo "wrote $out"
