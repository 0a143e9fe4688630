#!/usr/bin/env bash
# The Slurm executor's per-step overhead against `assayd contain` run locally (/bin/true), and
# 50 steps queued at once through a one-node Slurm (tests/slurm/cluster.sh): all must complete;
# throughput. Results: bench/slurm.md.
#   bench/slurm.sh [BUILD_DIR]     (default build; needs assayd and slurm_executor_tests built)
# Environment: ASSAY_BENCH_LOCAL (20), ASSAY_BENCH_SERIAL (10), ASSAY_BENCH_QUEUED (50),
# ASSAY_BENCH_POLL_MS (100).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
exec "$root/tests/slurm/run.sh" "$build/supervisor/assayd" \
  "$build/tests/slurm/slurm_executor_tests" --no-skip -tc="bench*" -s=false
