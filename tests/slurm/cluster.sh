#!/usr/bin/env bash
# A real Slurm cluster in a directory of its own, for tests and benchmarks:
#   cluster.sh start DIR   starts munged and slurmctld/slurmd with DIR's key, config, ports,
#                          state and spool: a single node "assay-node" on 127.0.0.1; prints the
#                          SLURM_CONF to export. Exit 77 (with a reason on stderr) where Slurm or
#                          munge is not installed or cannot start.
#   cluster.sh start DIR --nodes N
#                          a cluster of N (2..8) nodes assay-node1..assay-nodeN on this machine,
#                          each node in a network and UTS namespace of its own (see below); prints
#                          the SLURM_CONF as above, once every node is idle.
#   cluster.sh kill-node DIR I
#                          (multi-node) the loss of node I, like a power cut: SIGKILL to every
#                          process in its network namespace (its slurmd, slurmstepds and jobs).
#   cluster.sh stop DIR    stops every daemon and job it started (by the pid files in DIR and, for a
#                          multi-node cluster, by its namespaces) and deletes every namespace it
#                          made; also after a kill-node or a failed start, and again (idempotent).
# Single node: everything talks over loopback or unix sockets inside DIR. Needs root (slurmd runs
# jobs as their submitter and SlurmUser=root).
#
# Multi-node (--nodes N): a private network that exists only inside the test's namespaces.
#   - hub: a network namespace (its name in DIR/netns) with lo up and a bridge with address
#     10.213.0.1/24 (also in DIR/addr). slurmctld runs there, on 10.213.0.1 (ports 6817/6818:
#     every namespace has ports of its own).
#   - node i: a network namespace (its name in DIR/netns-node<i>) with lo up and eth0, one end of
#     a veth pair whose other end is a port of the hub's bridge, address 10.213.0.(10+i)/24 (also
#     in DIR/addr-node<i>); its slurmd runs there and in a UTS namespace of its own whose hostname
#     is assay-node<i>, so its jobs see that hostname and that address. Per-node spool, log and pid
#     files: DIR/spool/slurmd-assay-node<i>, DIR/log/slurmd-assay-node<i>.log,
#     DIR/run/slurmd-assay-node<i>.pid. All nodes are in partition "assay" (the default).
#   - one munged (in the initial namespaces), its socket a path in DIR: path unix sockets work
#     across network namespaces.
#   - Slurm commands must run inside the hub namespace, since slurmctld is only reachable there:
#       ip netns exec "$(cat DIR/netns)" sbatch ...      (likewise squeue, sinfo, scontrol, srun)
#     A process that must talk both to slurmctld and to the nodes (a "head" daemon) runs in the hub
#     too and listens on 10.213.0.1 (DIR/addr); the nodes (and their jobs) reach it there.
#   - SlurmdTimeout is 10 s (30 s single-node), so that a killed node goes DOWN (and its jobs end
#     NODE_FAIL, or are requeued unless submitted with --no-requeue) within about 10-20 s.
set -uo pipefail

usage() {
  echo "usage: cluster.sh start DIR [--nodes N] | stop DIR | kill-node DIR I" >&2
  exit 2
}
cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then usage; fi

skip() { echo "SKIP: $*" >&2; exit 77; }

net=10.213.0   # the multi-node cluster's /24; it exists only inside the test's namespaces
bridge=assaybr0
max_nodes=8

# The processes of network namespace $1 and all their descendants: a node's contained workers
# have network namespaces of their own, but are children of the node's processes.
netns_tree() {
  ip netns pids "$1" 2>/dev/null | python3 -c '
import os, sys
roots = {int(p) for p in sys.stdin.read().split()}
children = {}
for p in os.listdir("/proc"):
    if not p.isdigit():
        continue
    try:
        stat = open(f"/proc/{p}/stat").read()
    except OSError:
        continue
    ppid = int(stat[stat.rindex(")") + 2:].split()[1])
    children.setdefault(ppid, []).append(int(p))
tree, todo = set(), list(roots)
while todo:
    p = todo.pop()
    if p not in tree:
        tree.add(p)
        todo += children.get(p, [])
print(" ".join(map(str, sorted(tree))))'
}

# Every process in network namespace $1, and every descendant of one, gets SIGKILL (stopped
# first, so that none forks or reaps meanwhile), until none is left there (bounded): a power cut.
kill_netns() {
  local ns=$1 pids
  [ -e "/run/netns/$ns" ] || return 0
  for _ in $(seq 100); do
    pids=$(netns_tree "$ns")
    [ -z "$pids" ] && return 0
    # shellcheck disable=SC2086
    kill -STOP $pids 2>/dev/null
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null
    sleep 0.05
  done
  echo "cluster.sh: processes left in network namespace $ns: $(ip netns pids "$ns" 2>/dev/null | xargs)" >&2
  return 1
}

# TERM, then KILL after 5 s, to the process in pid file $1; removes the pid file.
stop_pidfile() {
  local pidfile=$1 pid
  [ -s "$pidfile" ] || { rm -f "$pidfile"; return 0; }
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$pidfile"
}

stop() {
  local d=$1 hub='' f
  [ -s "$d/netns" ] && hub=$(cat "$d/netns")
  if [ -n "$hub" ]; then
    # Multi-node: the nodes lose power (slurmd, slurmstepds and jobs: everything in their
    # namespaces), then slurmctld stops (TERM: it saves its state), then whatever else runs in the
    # hub (a caller's head daemon, a hung client).
    for f in "$d"/netns-node*; do
      [ -s "$f" ] && kill_netns "$(cat "$f")"
    done
    stop_pidfile "$d/run/slurmctld.pid"
    kill_netns "$hub"
    rm -f "$d"/run/slurmd-*.pid
  elif [ -s "$d/run/slurmctld.pid" ] && kill -0 "$(cat "$d/run/slurmctld.pid")" 2>/dev/null; then
    # Jobs first, through Slurm (their slurmstepd kills what they started), while it still runs.
    local ids
    ids=$(SLURM_CONF=$d/slurm.conf squeue -h -o %i 2>/dev/null)
    if [ -n "$ids" ]; then
      # shellcheck disable=SC2086
      SLURM_CONF=$d/slurm.conf scancel $ids 2>/dev/null
      for _ in $(seq 100); do
        [ -z "$(SLURM_CONF=$d/slurm.conf squeue -h -t running,completing -o %i 2>/dev/null)" ] && break
        sleep 0.1
      done
    fi
  fi
  for name in slurmd slurmctld munged; do
    stop_pidfile "$d/run/$name.pid"
  done
  # Anything left of this cluster (a slurmstepd and its job): slurmd started them with this
  # cluster's SLURM_CONF in their environment.
  local p
  for p in $(pgrep -x slurmstepd 2>/dev/null); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "SLURM_CONF=$d/slurm.conf"; then
      pkill -KILL -P "$p" 2>/dev/null
      kill -KILL "$p" 2>/dev/null
    fi
  done
  # The namespaces (deleting the hub deletes its bridge and veth ends, and so their peers).
  if [ -n "$hub" ]; then
    for f in "$d"/netns-node* "$d/netns"; do
      [ -s "$f" ] || continue
      local ns
      ns=$(cat "$f")
      [ -e "/run/netns/$ns" ] && ip netns del "$ns" 2>/dev/null
    done
  fi
  return 0
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

nodes=1
case "$cmd" in
  stop)
    [ -d "$dir" ] && dir=$(cd "$dir" && pwd)
    stop "$dir"
    exit 0
    ;;
  kill-node)
    i=${3:-}
    [[ $i =~ ^[0-9]+$ ]] || usage
    [ -s "$dir/netns-node$i" ] || { echo "cluster.sh: $dir has no node $i" >&2; exit 2; }
    kill_netns "$(cat "$dir/netns-node$i")" || exit 1
    rm -f "$dir/run/slurmd-assay-node$i.pid"
    exit 0
    ;;
  start)
    if [ $# -gt 2 ]; then
      if [ $# -ne 4 ] || [ "$3" != --nodes ]; then usage; fi
      nodes=$4
      if ! [[ $nodes =~ ^[0-9]+$ ]] || [ "$nodes" -lt 2 ] || [ "$nodes" -gt $max_nodes ]; then
        echo "cluster.sh: --nodes takes 2..$max_nodes" >&2
        exit 2
      fi
    fi
    ;;
  *) usage ;;
esac

[ "$(id -u)" -eq 0 ] || skip "a test Slurm cluster needs root (slurmd)"
for b in munged mungekey slurmctld slurmd sbatch squeue scontrol scancel srun; do
  command -v "$b" >/dev/null 2>&1 || skip "$b is not installed (scripts/install-deps installs slurmctld slurmd munge slurm-client)"
done
if [ "$nodes" -gt 1 ]; then
  for b in ip nsenter unshare hostname sinfo sha1sum; do
    command -v "$b" >/dev/null 2>&1 || skip "$b is not installed (a multi-node cluster needs it)"
  done
fi

mkdir -p "$dir" && dir=$(cd "$dir" && pwd)

# What an earlier multi-node cluster in DIR left (stopped: its namespaces are gone).
if [ -s "$dir/netns" ] && [ -e "/run/netns/$(cat "$dir/netns")" ]; then
  skip "network namespace $(cat "$dir/netns") exists: is a cluster of $dir running? (cluster.sh stop $dir)"
fi
rm -f "$dir/netns" "$dir"/netns-node* "$dir/addr" "$dir"/addr-node*

if [ "$nodes" -gt 1 ]; then
  # Namespace names: short, ip-netns-safe, unique per DIR. Written down before anything is made,
  # so that stop finds whatever a failed start left.
  base=$(basename "$dir")
  base=${base//[^A-Za-z0-9_-]/-}
  hub=assay-${base:0:12}-$(printf %s "$dir" | sha1sum | cut -c1-8)
  for ns in "$hub" $(seq -f "$hub-n%g" "$nodes"); do
    [ -e "/run/netns/$ns" ] && skip "network namespace $ns exists: is a cluster of $dir running? (cluster.sh stop $dir)"
  done
  echo "$hub" >"$dir/netns"
  echo "$net.1" >"$dir/addr"
  for i in $(seq "$nodes"); do
    echo "$hub-n$i" >"$dir/netns-node$i"
    echo "$net.$((10 + i))" >"$dir/addr-node$i"
  done
fi

mkdir -p "$dir"/{munge,run,log,state,spool}
chmod 0700 "$dir/munge" "$dir/state" "$dir/spool"
chmod 0755 "$dir/run"

# munge: a fresh key, its own socket, pid, log and seed files.
mungekey --create --keyfile="$dir/munge/munge.key" --force >/dev/null 2>&1 ||
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 0400 "$dir/munge/munge.key"
munge_socket=$dir/run/munge.socket
munged --force --socket="$munge_socket" --key-file="$dir/munge/munge.key" \
  --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
  --seed-file="$dir/munge/munge.seed" >"$dir/log/munged.out" 2>&1 ||
  { cat "$dir/log/munged.out" "$dir/log/munged.log" >&2 2>/dev/null; stop "$dir"; skip "munged did not start"; }
for _ in $(seq 100); do [ -S "$munge_socket" ] && break; sleep 0.05; done
[ -S "$munge_socket" ] || { stop "$dir"; skip "munged did not make its socket"; }

node=assay-node
node_line=$(slurmd -C 2>/dev/null | head -1)
cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$node_line")
boards=$(sed -n 's/.*Boards=\([0-9]*\).*/\1/p' <<<"$node_line")
sockets=$(sed -n 's/.*SocketsPerBoard=\([0-9]*\).*/\1/p' <<<"$node_line")
cores=$(sed -n 's/.*CoresPerSocket=\([0-9]*\).*/\1/p' <<<"$node_line")
threads=$(sed -n 's/.*ThreadsPerCore=\([0-9]*\).*/\1/p' <<<"$node_line")
memory=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node_line")
if [ -z "$cpus" ] || [ -z "$memory" ]; then stop "$dir"; skip "slurmd -C did not describe this node: $node_line"; fi
cpu_spec="CPUs=$cpus Boards=${boards:-1} SocketsPerBoard=${sockets:-1} CoresPerSocket=${cores:-1} ThreadsPerCore=${threads:-1}"

if [ "$nodes" -eq 1 ]; then
  ctld_port=$(free_port)
  slurmd_port=$(free_port)
  while [ "$slurmd_port" = "$ctld_port" ]; do slurmd_port=$(free_port); done
  ctld_addr=127.0.0.1
  slurmd_pid_file=$dir/run/slurmd.pid
  slurmd_log_file=$dir/log/slurmd.log
  slurmd_timeout=30
  node_lines="NodeName=$node NodeHostname=$(hostname) NodeAddr=127.0.0.1 $cpu_spec RealMemory=$memory State=UNKNOWN"
  partition_nodes=$node
else
  # The network: hub (lo, bridge), and per node a namespace whose eth0 is the peer of a veth end
  # on the hub's bridge. Each veth pair is made inside the hub with its peer put straight into the
  # node's namespace, so nothing ever appears in the initial network namespace.
  make_network() {
    ip netns add "$hub" &&
      ip -n "$hub" link set lo up &&
      ip -n "$hub" link add "$bridge" type bridge &&
      ip -n "$hub" addr add "$net.1/24" dev "$bridge" &&
      ip -n "$hub" link set "$bridge" up || return 1
    local i ns
    for i in $(seq "$nodes"); do
      ns=$(cat "$dir/netns-node$i")
      ip netns add "$ns" &&
        ip -n "$ns" link set lo up &&
        ip -n "$hub" link add "veth$i" type veth peer name eth0 netns "$ns" &&
        ip -n "$hub" link set "veth$i" master "$bridge" up &&
        ip -n "$ns" addr add "$net.$((10 + i))/24" dev eth0 &&
        ip -n "$ns" link set eth0 up || return 1
    done
  }
  make_network >"$dir/log/network.out" 2>&1 ||
    { cat "$dir/log/network.out" >&2; stop "$dir"; skip "could not make the cluster's network namespaces"; }
  # Every namespace has its own ports: Slurm's defaults.
  ctld_port=6817
  slurmd_port=6818
  ctld_addr=$net.1
  slurmd_pid_file=$dir/run/slurmd-%n.pid
  slurmd_log_file=$dir/log/slurmd-%n.log
  slurmd_timeout=10
  # CPUs: every node claims all the machine's CPUs (they share them; a test cluster oversubscribes
  # the machine). Memory: the nodes share the machine's, so each gets its share: slurmd accepts a
  # RealMemory below what it finds, and jobs asking more than the machine has stay pending.
  node_mem=$((memory / nodes))
  node_lines=
  for i in $(seq "$nodes"); do
    node_lines+="NodeName=$node$i NodeHostname=$node$i NodeAddr=$net.$((10 + i)) $cpu_spec RealMemory=$node_mem State=UNKNOWN"$'\n'
  done
  node_lines=${node_lines%$'\n'}
  partition_nodes="${node}[1-$nodes]"
fi

cat >"$dir/slurm.conf" <<CONF
ClusterName=assaytest
SlurmctldHost=localhost($ctld_addr)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$munge_socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/slurmd-%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$slurmd_pid_file
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$slurmd_log_file
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=$slurmd_timeout
InactiveLimit=0
KillWait=5
MinJobAge=300
OverTimeLimit=0
SchedulerParameters=sched_interval=1
$node_lines
PartitionName=assay Nodes=$partition_nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
export SLURM_CONF=$dir/slurm.conf

if [ "$nodes" -eq 1 ]; then
  slurmctld -f "$SLURM_CONF" -i >"$dir/log/slurmctld.out" 2>&1 ||
    { cat "$dir/log/slurmctld.out" "$dir/log/slurmctld.log" >&2 2>/dev/null; stop "$dir"; skip "slurmctld did not start"; }
  slurmd -f "$SLURM_CONF" -N "$node" >"$dir/log/slurmd.out" 2>&1 ||
    { cat "$dir/log/slurmd.out" "$dir/log/slurmd.log" >&2 2>/dev/null; stop "$dir"; skip "slurmd did not start"; }

  # Up when the node is idle.
  for _ in $(seq 200); do
    state=$(sinfo -h -n "$node" -o %T 2>/dev/null)
    [ "$state" = "idle" ] && break
    sleep 0.1
  done
  if [ "$state" != "idle" ]; then
    tail -20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2
    stop "$dir"
    skip "the node did not become idle (state \"$state\")"
  fi
  echo "$SLURM_CONF"
  exit 0
fi

logs_tail() {
  tail -n 20 "$dir"/log/slurmctld.out "$dir"/log/slurmctld.log "$dir"/log/slurmd-*.out \
    "$dir"/log/slurmd-*.log >&2 2>/dev/null
}
nsenter --net="/run/netns/$hub" slurmctld -f "$SLURM_CONF" -i >"$dir/log/slurmctld.out" 2>&1 ||
  { logs_tail; stop "$dir"; skip "slurmctld did not start"; }
for i in $(seq "$nodes"); do
  # slurmd daemonizes; it and what it starts stay in the node's network and UTS namespaces. Not
  # `ip netns exec`: that also mounts a fresh /sys, without the cgroup file system slurmd needs.
  # shellcheck disable=SC2016
  nsenter --net="/run/netns/$(cat "$dir/netns-node$i")" unshare --uts \
    sh -c 'hostname "$1" && exec slurmd -f "$2" -N "$1"' sh "$node$i" "$SLURM_CONF" \
    >"$dir/log/slurmd-$node$i.out" 2>&1 ||
    { logs_tail; stop "$dir"; skip "slurmd of $node$i did not start"; }
done

# Up when every node is idle.
idle=0
for _ in $(seq 150); do
  states=$(ip netns exec "$hub" sinfo -h -N -o '%N %T' 2>/dev/null)
  idle=$(grep -c ' idle$' <<<"$states")
  [ "$idle" -eq "$nodes" ] && break
  sleep 0.2
done
if [ "$idle" -ne "$nodes" ]; then
  logs_tail
  echo "node states: $(xargs <<<"$states")" >&2
  stop "$dir"
  skip "$((nodes - idle)) of $nodes nodes did not become idle"
fi
echo "$SLURM_CONF"
