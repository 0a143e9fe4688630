#!/usr/bin/env bash
# The longer Schemathesis run of issue 23 against a live assayd (tests/tools/schemathesis_run.py,
# the ctest api_schemathesis runs the same with 20 examples per operation): no 5xx, no status,
# content type or body outside schemas/openapi.yaml, the daemon alive and healthy afterwards.
# Usage: bench/api_fuzz.sh [BUILD_DIR=build] [EXAMPLES=100] [SEED=23]
# Writes bench/api_fuzz.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
examples=${2:-100}
seed=${3:-23}
python=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
report=$(mktemp)
out=$(mktemp)
set +e
"$python" "$root/tests/tools/schemathesis_run.py" --assayd "$build/supervisor/assayd" \
  --source "$root" --max-examples "$examples" --seed "$seed" --report "$report" >"$out" 2>&1
rc=$?
set -e
{
  echo "# Schemathesis against assayd (bench/api_fuzz.sh)"
  echo
  echo "Last run: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git -C "$root" rev-parse --short HEAD)," \
    "$(nproc) cores; schemathesis $("$python" -m pip show schemathesis 2>/dev/null | sed -n 's/^Version: //p')," \
    "$examples examples per operation, seed $seed: exit $rc (0: every check held)."
  echo
  echo '```'
  cat "$report"
  echo
  sed -n '/ERRORS/,/SUMMARY/p;/FAILURES/,/SUMMARY/p' "$out" | head -60
  grep -E "passed|failed|errored|Summary|operations|test cases|schemathesis exit" "$out" | tail -20
  echo '```'
} >"$root/bench/api_fuzz.md"
cat "$root/bench/api_fuzz.md"
rm -f "$report" "$out"
exit $rc
