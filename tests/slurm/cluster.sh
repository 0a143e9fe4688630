#!/usr/bin/env bash
# A real single-node Slurm cluster in a directory of its own, for tests and benchmarks:
#   cluster.sh start DIR   starts munged and slurmctld/slurmd with DIR's key, config, ports,
#                          state and spool; prints the SLURM_CONF to export. Exit 77 (with a
#                          reason on stderr) where Slurm or munge is not installed or cannot start.
#   cluster.sh stop DIR    stops every daemon it started (by the pid files in DIR).
# Everything listens on loopback or on unix sockets inside DIR. Needs root (slurmd runs jobs as
# their submitter and SlurmUser=root).
set -uo pipefail

cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { echo "usage: cluster.sh start|stop DIR" >&2; exit 2; }

skip() { echo "SKIP: $*" >&2; exit 77; }

stop() {
  local d=$1
  # Jobs first, through Slurm (their slurmstepd kills what they started), while it still runs.
  if [ -s "$d/run/slurmctld.pid" ] && kill -0 "$(cat "$d/run/slurmctld.pid")" 2>/dev/null; then
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
    local pidfile=$d/run/$name.pid
    [ -s "$pidfile" ] || continue
    local pid
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    fi
    rm -f "$pidfile"
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
  return 0
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

case "$cmd" in
  stop) stop "$dir"; exit 0 ;;
  start) ;;
  *) echo "usage: cluster.sh start|stop DIR" >&2; exit 2 ;;
esac

[ "$(id -u)" -eq 0 ] || skip "a test Slurm cluster needs root (slurmd)"
for b in munged mungekey slurmctld slurmd sbatch squeue scontrol scancel srun; do
  command -v "$b" >/dev/null 2>&1 || skip "$b is not installed (scripts/install-deps installs slurmctld slurmd munge slurm-client)"
done

mkdir -p "$dir" && dir=$(cd "$dir" && pwd)
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
[ -n "$cpus" ] && [ -n "$memory" ] || { stop "$dir"; skip "slurmd -C did not describe this node: $node_line"; }
ctld_port=$(free_port)
slurmd_port=$(free_port)
while [ "$slurmd_port" = "$ctld_port" ]; do slurmd_port=$(free_port); done

cat >"$dir/slurm.conf" <<CONF
ClusterName=assaytest
SlurmctldHost=localhost(127.0.0.1)
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
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
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
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
OverTimeLimit=0
SchedulerParameters=sched_interval=1
NodeName=$node NodeHostname=$(hostname) NodeAddr=127.0.0.1 CPUs=$cpus Boards=${boards:-1} SocketsPerBoard=${sockets:-1} CoresPerSocket=${cores:-1} ThreadsPerCore=${threads:-1} RealMemory=$memory State=UNKNOWN
PartitionName=assay Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
export SLURM_CONF=$dir/slurm.conf

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
