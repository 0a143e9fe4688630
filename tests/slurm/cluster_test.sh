#!/usr/bin/env bash
# A real multi-node Slurm cluster on this machine (cluster.sh start DIR --nodes 3, each node in
# network and UTS namespaces of its own): a job pinned to each node runs there, with that node's
# hostname and address; the loss of a node (cluster.sh kill-node) is noticed by slurmctld (the node
# goes DOWN, its job ends NODE_FAIL) while the other nodes go on. Stops the cluster in any case.
# Exit 77 where cluster.sh cannot start the cluster (no Slurm, no root, no namespaces).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
n=3

dir=$(mktemp -d /tmp/assay-slurm-cluster.XXXXXX)
chmod 0755 "$dir"
cleanup() {
  "$here/cluster.sh" stop "$dir/cluster"
  [ -n "${KEEP_SLURM_DIR:-}" ] || rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

t0=$SECONDS
conf=$("$here/cluster.sh" start "$dir/cluster" --nodes $n)
rc=$?
[ $rc -eq 0 ] || exit $rc
export SLURM_CONF=$conf
hub=$(cat "$dir/cluster/netns")
echo "ok: $n nodes idle after $((SECONDS - t0)) s (hub namespace $hub)"

# Slurm's commands reach slurmctld from the hub namespace only.
hub() { ip netns exec "$hub" "$@"; }
fail() {
  echo "FAIL: $*" >&2
  tail -n 20 "$dir/cluster/log/slurmctld.log" "$dir"/cluster/log/slurmd-*.log >&2
  exit 1
}
job_state() { hub squeue -h -t all -j "$1" -o %T 2>/dev/null; }
node_state() { hub scontrol -o show node "$1" 2>/dev/null | sed -n 's/.* State=\([^ ]*\).*/\1/p'; }
# wait_state JOB SECONDS STATE...: until the job is in one of the states; prints the last state.
wait_state() {
  local id=$1 limit=$2 s='' want
  shift 2
  local deadline=$((SECONDS + limit))
  while [ $SECONDS -lt $deadline ]; do
    s=$(job_state "$id")
    for want in "$@"; do [ "$s" = "$want" ] && { echo "$s"; return 0; }; done
    case "$s" in COMPLETED | FAILED | CANCELLED | TIMEOUT | OUT_OF_MEMORY | NODE_FAIL) break ;; esac
    sleep 0.2
  done
  echo "$s"
  return 1
}

# One job per node: its hostname and IPv4 addresses.
declare -a ids
for i in $(seq $n); do
  ids[i]=$(hub sbatch --parsable -w "assay-node$i" -t 1 -o "$dir/job$i.log" \
    --wrap "{ hostname; ip -4 -o addr show | awk '{print \$4}'; } >'$dir/node$i.out'") ||
    fail "sbatch refused the job for assay-node$i"
done
for i in $(seq $n); do
  s=$(wait_state "${ids[i]}" 60 COMPLETED) ||
    fail "job ${ids[i]} on assay-node$i ended '$s': $(cat "$dir/job$i.log" 2>/dev/null)"
done
for i in $(seq $n); do
  want=$(cat "$dir/cluster/addr-node$i")
  out=$(cat "$dir/node$i.out" 2>/dev/null)
  ran_on=$(hub squeue -h -t all -j "${ids[i]}" -o %N)
  [ "$ran_on" = "assay-node$i" ] || fail "job ${ids[i]} ran on '$ran_on', not assay-node$i"
  [ "$(head -1 <<<"$out")" = "assay-node$i" ] ||
    fail "job on assay-node$i saw hostname '$(head -1 <<<"$out")'"
  # Its own address and loopback, nothing else (no other node's, not the hub's, not the host's).
  addrs=$(tail -n +2 <<<"$out" | sort | xargs)
  [ "$addrs" = "$want/24 127.0.0.1/8" ] ||
    fail "job on assay-node$i saw addresses '$addrs', not $want/24 and 127.0.0.1/8"
  echo "ok: job ${ids[i]} ran on assay-node$i: hostname assay-node$i, address $want"
done

# The loss of node 2 while a job runs there.
long=$(hub sbatch --parsable --no-requeue -w assay-node2 -t 5 -o /dev/null --wrap 'sleep 300') ||
  fail "sbatch refused the long job"
s=$(wait_state "$long" 30 RUNNING) || fail "the long job on assay-node2 is '$s', not RUNNING"
ns2=$(cat "$dir/cluster/netns-node2")
ip netns pids "$ns2" | xargs -r ps -o comm= -p | grep -qx sleep || fail "no sleep in $ns2"
"$here/cluster.sh" kill-node "$dir/cluster" 2 || fail "kill-node 2"
t1=$SECONDS
[ -z "$(ip netns pids "$ns2")" ] || fail "processes left in $ns2 after kill-node"
s=$(wait_state "$long" 90 NODE_FAIL) || fail "the long job on the killed node is '$s', not NODE_FAIL"
state=$(node_state assay-node2)
case "$state" in DOWN*) ;; *) fail "assay-node2 is $state, not DOWN" ;; esac
echo "ok: after kill-node 2, slurmctld set assay-node2 $state and job $long $s within $((SECONDS - t1)) s"

# The other nodes go on.
for i in 1 3; do
  id=$(hub sbatch --parsable -w "assay-node$i" -t 1 -o /dev/null --wrap true) ||
    fail "sbatch refused a job for assay-node$i after the loss of node 2"
  s=$(wait_state "$id" 60 COMPLETED) || fail "job $id on assay-node$i ended '$s' after the loss of node 2"
done
echo "ok: assay-node1 and assay-node3 still run jobs ($((SECONDS - t0)) s in all)"
