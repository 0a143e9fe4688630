#!/usr/bin/env bash
# ctest driver of the Slurm tests: starts a single-node Slurm cluster in a temporary directory
# (cluster.sh), checks that `assayd contain` runs and reports an OOM kill under srun and sbatch,
# runs the executor tests against it, and stops every daemon it started, also on failure.
#   run.sh ASSAYD SLURM_EXECUTOR_TESTS INTEGRATION_TESTS|- [doctest options]
# INTEGRATION_TESTS: then runs its "slurm: *" cases (assayd with executor slurm) on the cluster.
# Exit 77 where Slurm cannot be installed or started here.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
assayd=$(realpath "$1")
tests=$(realpath "$2")
integration=$3
[ "$integration" = - ] || integration=$(realpath "$integration")
shift 3

dir=$(mktemp -d /tmp/assay-slurm.XXXXXX)
chmod 0755 "$dir"
cleanup() {
  "$here/cluster.sh" stop "$dir/cluster"
  [ -n "${KEEP_SLURM_DIR:-}" ] || rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

conf=$("$here/cluster.sh" start "$dir/cluster")
rc=$?
[ $rc -eq 0 ] || exit $rc
export SLURM_CONF=$conf
mkdir -p "$dir/shared"
cd "$dir/shared" || exit 1

fail() { echo "FAIL: $*" >&2; tail -20 "$dir/cluster/log/slurmd.log" >&2; exit 1; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {'d': d}))" "$@"; }

# srun: contained and measured on the node.
srun --mem=256M -t 1 "$assayd" contain -- /bin/true >"$dir/true.json" || fail "srun assayd contain -- /bin/true"
[ "$(field "$dir/true.json" 'd["exit"]["code"]')" = 0 ] || fail "srun: /bin/true did not exit 0"
[ "$(field "$dir/true.json" 'd["mode"]')" != none ] || fail "srun: not contained"
echo "ok: srun assayd contain -- /bin/true"

# sbatch: an OOM kill inside assay's cgroup, reported in the evidence.
id=$(sbatch --parsable --mem=512M -t 1 -o "$dir/oom.json" -e "$dir/oom.err" \
  --wrap "exec $assayd contain --memory-max 64M -- python3 -c 'x=bytearray(1<<30)'") ||
  fail "sbatch refused the OOM job"
for _ in $(seq 300); do
  state=$(squeue -h -t all -j "$id" -o %T)
  case "$state" in COMPLETED | FAILED | CANCELLED | TIMEOUT | OUT_OF_MEMORY | NODE_FAIL) break ;; esac
  sleep 0.1
done
[ "$state" = COMPLETED ] || fail "sbatch OOM job ended $state: $(cat "$dir/oom.err")"
[ "$(field "$dir/oom.json" 'd["oom_killed"]')" = True ] || fail "sbatch: no OOM kill reported"
echo "ok: sbatch assayd contain --memory-max 64M reports oom_killed"

ASSAY_TEST_ASSAYD=$assayd ASSAY_TEST_SHARED=$dir/shared ASSAY_TEST_SCHEMAS=$here/../../schemas \
  "$tests" "$@" || exit 1
[ "$integration" = - ] && exit 0
# Jobs through assayd with executor slurm.
ASSAY_TEST_SHARED=$dir/shared "$integration" -tc="slurm:*" "$@"
