#!/usr/bin/env bash
# ctest driver of the worker-pool cases on a real three-node Slurm cluster: cluster.sh starts
# slurmctld in a hub network namespace and three slurmd nodes, each in network and UTS
# namespaces of its own (veth pairs to a bridge in the hub), munge shared; the integration
# tests' "pool: *" cases then run inside the hub namespace (nsenter --net, which keeps /sys and
# so the cgroups), where assayd listens for its pool nodes on the bridge's address. Stops
# everything it started, also on failure. Exit 77 where Slurm or the namespaces are missing.
#   pool_run.sh ASSAYD INTEGRATION_TESTS [doctest options]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
assayd=$(realpath "$1")
integration=$(realpath "$2")
shift 2

dir=$(mktemp -d /tmp/assay-pool.XXXXXX)
chmod 0755 "$dir"
cleanup() {
  "$here/cluster.sh" stop "$dir/cluster"
  # The worker cgroups of a node killed as by a power cut (its assayd died with them).
  "$assayd" contain --cleanup-orphans >/dev/null 2>&1
  [ -n "${KEEP_SLURM_DIR:-}" ] || rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

conf=$("$here/cluster.sh" start "$dir/cluster" --nodes 3)
rc=$?
[ $rc -eq 0 ] || exit $rc
hub=$(cat "$dir/cluster/netns")
mkdir -p "$dir/shared"
cd "$dir/shared" || exit 1
SLURM_CONF=$conf ASSAY_TEST_SHARED=$dir/shared ASSAY_TEST_CLUSTER=$dir/cluster \
  ASSAY_TEST_POOL_LISTEN="$(cat "$dir/cluster/addr"):0" \
  nsenter --net="/run/netns/$hub" "$integration" -tc="pool:*" "$@"
