#!/usr/bin/env bash
# guest.sh: the checks of tests/vm/e2e.sh, run as root inside the booted VM (systemd PID 1,
# cgroup v2 only) in the shared folder that holds debs/, model/ and the request files.
# Every check prints PASS or FAIL with what it saw; the exit status is the number of failures.
set -uo pipefail
cd "$(dirname "$0")" || exit 125
work=$PWD
logs=$(mktemp -d)  # the shared folder may be read-only
fails=0
pass() { printf 'PASS  %s\n' "$*"; }
fail() { printf 'FAIL  %s\n' "$*"; fails=$((fails + 1)); return 1; }
check() { # check NAME COMMAND...: pass when COMMAND succeeds
  local name=$1; shift
  if "$@"; then pass "$name"; else fail "$name (command: $*)"; fi
}
eq() { # eq NAME GOT WANT
  if [ "$2" = "$3" ]; then pass "$1: $2"; else fail "$1: got \"$2\", want \"$3\""; fi
}
as_alice() { runuser -u alice -- env HOME=/home/alice "$@"; }
svc_cg=/sys/fs/cgroup/system.slice/assayd.service
t0=$(date +%s)
elapsed() { echo "$(($(date +%s) - t0))s"; }

echo "kernel $(uname -r), $(systemctl --version | head -1), cgroup: $(stat -fc %T /sys/fs/cgroup)"

# 1. the package installs, creates its users and enables + starts the socket (not the service)
dpkg -i debs/assay_*.deb debs/assay-oracle_*.deb >$logs/dpkg.log 2>&1
check "dpkg -i assay assay-oracle" [ $? = 0 ] || cat $logs/dpkg.log
check "group assay exists" getent group assay
check "user assay-worker exists" getent passwd assay-worker
worker_uid=$(id -u assay-worker)
if [ "${ASSAY_E2E_WORKER_USER:-}" = root ]; then
  # Diagnostic only: workers stay root, to see the rest of the checks when the drop fails.
  jq '.worker_user = ""' /etc/assay/assayd.json >$logs/assayd.json && cp $logs/assayd.json /etc/assay/assayd.json
  worker_uid=null  # spawn.uid is null when no drop happened
  echo "NOTE  ASSAY_E2E_WORKER_USER=root: workers run as root in this run"
fi
eq "assayd.socket enabled" "$(systemctl is-enabled assayd.socket)" enabled
eq "assayd.socket active" "$(systemctl is-active assayd.socket)" active
eq "assayd.service not started yet" "$(systemctl is-active assayd.service)" inactive
eq "socket mode/owner" "$(stat -c '%a %U %G' /run/assay/assayd.sock)" "660 root assay"
systemd-analyze verify assayd.service assayd.socket >$logs/verify.log 2>&1
check "systemd-analyze verify (no complaints)" [ ! -s $logs/verify.log ] || cat $logs/verify.log

useradd -m -G assay alice
useradd -m bob

# 2. socket activation: alice's first request starts the service
out=$(as_alice assay health 2>&1)
check "alice: assay health through the socket ($out)" [ $? = 0 ]
eq "service started by the socket" "$(systemctl is-active assayd.service)" active
eq "TriggeredBy" "$(systemctl show -P TriggeredBy assayd.service)" assayd.socket
pid=$(systemctl show -P MainPID assayd.service)
eq "assayd moved itself into its delegated subtree" "$(cut -d: -f3 /proc/$pid/cgroup)" \
  /system.slice/assayd.service/supervisor
journalctl -u assayd.service -o cat --no-pager | grep -m1 'assayd ready' || true

# 3. a verified job as alice
job_id() { tail -1 <<<"$1" | jq -r '.id // .job_id // empty' 2>/dev/null; }
out=$(as_alice assay --json submit "$work/ok.json" --wait --wait-timeout 900 2>&1)
eq "alice: submit --wait ok.json exit status" $? 0 || { echo "$out"; journalctl -u assayd.service --no-pager | tail -30; }
ok_id=$(job_id "$out")
echo "job $ok_id finished after $(elapsed)"
mkdir -p /home/alice/out && chown alice /home/alice/out
as_alice assay result "$ok_id" -o /home/alice/out/result.json >/dev/null
as_alice assay artifact "$ok_id" -o /home/alice/out/logits.safetensors >/dev/null
as_alice assay keys -o /home/alice/out/pub.pem >/dev/null
as_alice assay verify /home/alice/out/result.json --pubkey /home/alice/out/pub.pem \
  --artifact /home/alice/out/logits.safetensors >$logs/verify-result.log 2>&1
check "alice: assay verify (signature, hashes, artifact)" [ $? = 0 ] || cat $logs/verify-result.log
r=/home/alice/out/result.json
assay verify /home/alice/out/result.json --pubkey /var/lib/assay/keys/host.pub \
  --artifact /home/alice/out/logits.safetensors >/dev/null 2>&1
check "root: verify against the key file on disk (not the socket's word)" [ $? = 0 ]
eq "result containment backend" "$(jq -r .containment.backend $r)" cgroup-v2
eq "oracle process evidence mode" "$(jq -r .oracle.process.mode $r)" cgroup-v2
eq "oracle ran as the worker user" "$(jq -r .oracle.process.spawn.uid $r)" "$worker_uid"
eq "oracle spawn method" "$(jq -r .oracle.process.spawn.method $r)" clone3-into-cgroup
eq "oracle network" "$(jq -c .containment.network $r)" '{"interfaces":["lo"],"namespace":"private"}'
peak=$(jq -r .oracle.process.memory.peak_bytes $r)
check "memory.peak present ($peak bytes)" [ "$peak" != null ] && [ "$peak" -gt 0 ]
events=$(jq -c '.oracle.process.counters["memory.events"]' $r)
jq_true() { jq -e "$@" >/dev/null; }
check "memory.events present, no OOM kill ($events)" jq_true '.oracle.process.counters["memory.events"].oom_kill == 0' $r
eq "oracle cgroup was removed" "$(jq -r .oracle.process.cgroup.removed $r)" true
echo "oracle cgroup: $(jq -r .oracle.process.cgroup.path $r), verdict: $(jq -c .verdict $r)"
# Issue 15's evidence, measured on cgroup v2: normalised counters from memory.events and
# memory.peak, the source tree, the implementation and the oracle's configuration.
check "normalised: memory_peak_bytes from memory.peak" jq_true \
  '.oracle.process.normalised.memory_peak_bytes > 0 and .oracle.process.normalised.sources.memory_peak_bytes == "memory.peak"' $r
check "normalised: memory_oom_kill_events 0, memory_high_events a number" jq_true \
  '.oracle.process.normalised.memory_oom_kill_events == 0 and (.oracle.process.normalised.memory_high_events | type) == "number"' $r
check "implementation: the oracle executable hashed" jq_true \
  '.implementation.executables["assay-oracle"].sha256 | startswith("sha256:")' $r
check "oracle configuration_sha256 and runtime" jq_true \
  '(.oracle.configuration_sha256 | startswith("sha256:")) and (.oracle.runtime.torch_version | type) == "string"' $r
echo "source: $(jq -c .source $r); normalised: $(jq -c .oracle.process.normalised $r)"

# 3b. a fidelity job as alice: five contained workers, a verified receipt
out=$(as_alice assay --json fidelity submit "$work/fidelity.json" --wait --wait-timeout 900 2>&1)
eq "alice: fidelity submit --wait exit status" $? 0 || { echo "$out"; journalctl -u assayd.service --no-pager | tail -30; }
fid_id=$(job_id "$out")
as_alice assay result "$fid_id" -o /home/alice/out/fidelity.json >/dev/null
as_alice assay artifact "$fid_id" -o /home/alice/out/kl.safetensors >/dev/null
as_alice assay verify /home/alice/out/fidelity.json --pubkey /home/alice/out/pub.pem \
  --artifact /home/alice/out/kl.safetensors >$logs/verify-fidelity.log 2>&1
check "alice: assay verify of the fidelity receipt" [ $? = 0 ] || cat $logs/verify-fidelity.log
f=/home/alice/out/fidelity.json
eq "fidelity: reproduction confirmed" "$(jq -r .reproduction.confirmed $f)" true
eq "fidelity: capture ran in cgroup v2" "$(jq -r .reference.capture.process.mode $f)" cgroup-v2
eq "fidelity: compare ran as the worker user" "$(jq -r .comparison.process.spawn.uid $f)" "$worker_uid"
check "fidelity: mean KL > 0 for the 4-bit copy" jq_true '.comparison.metrics.kl.mean > 0' $f
echo "fidelity: $(jq -c '.comparison.metrics' $f)"
check "fidelity: no captured logits left" [ -z "$(find /var/lib/assay/jobs/$fid_id -mindepth 2 -name '*.safetensors')" ]

# 3c. the transformers backend from the packages: refused at admission (by name) until the
# operator runs assay-hf-setup (here from the wheels beside the packages: the VM has no network),
# then a dispute settled by transformers' own forward: the C++ oracle's argmax and its logits bit
# for bit, the record verified.
if [ -d "$work/hf-wheels" ]; then
  assay-hf-setup --check >$logs/hf-check.log 2>&1
  eq "assay-hf-setup --check before setup (1: missing)" $? 1 || cat $logs/hf-check.log
  check "assayd said at start that it has no transformers worker" \
    bash -c "journalctl -u assayd.service -o cat --no-pager | grep -q 'no transformers worker at /usr/libexec/assay/assay-hf-worker'"
  out=$(as_alice assay --json submit "$work/hf.json" 2>&1)
  eq "alice: backend transformers refused at admission (exit 4)" $? 4 || echo "$out"
  check "the refusal names request.backend_unavailable" grep -q backend_unavailable <<<"$out"
  t=$(date +%s)
  assay-hf-setup --wheels "$work/hf-wheels" >$logs/hf-setup.log 2>&1
  eq "assay-hf-setup --wheels exit status" $? 0 || tail -20 $logs/hf-setup.log
  echo "assay-hf-setup (pip install of $(ls "$work/hf-wheels" | wc -l) wheels, offline) took $(($(date +%s) - t))s; /opt/assay/venv $(du -sh /opt/assay/venv | cut -f1)"
  check "assay-hf-setup --check: ready" assay-hf-setup --check
  out=$(as_alice assay --json submit "$work/hf.json" --wait --wait-timeout 1800 2>&1)
  eq "alice: submit --wait hf.json (transformers) exit status" $? 0 || { echo "$out"; journalctl -u assayd.service --no-pager | tail -30; }
  hf_id=$(job_id "$out")
  echo "transformers job $hf_id finished after $(elapsed)"
  as_alice assay result "$hf_id" -o /home/alice/out/hf.json >/dev/null
  as_alice assay artifact "$hf_id" -o /home/alice/out/hf-logits.safetensors >/dev/null
  as_alice assay verify /home/alice/out/hf.json --pubkey /home/alice/out/pub.pem \
    --artifact /home/alice/out/hf-logits.safetensors >$logs/verify-hf.log 2>&1
  check "alice: assay verify of the transformers result" [ $? = 0 ] || cat $logs/verify-hf.log
  h=/home/alice/out/hf.json
  eq "hf: oracle backend" "$(jq -r .oracle.backend $h)" transformers
  eq "hf: the same verdict as the C++ oracle's" "$(jq -c .verdict $h)" "$(jq -c .verdict $r)"
  eq "hf: the same logits, bit for bit" "$(jq -r .oracle.logits_sha256 $h)" "$(jq -r .oracle.logits_sha256 $r)"
  eq "hf: worker ran as the worker user" "$(jq -r .oracle.process.spawn.uid $h)" "$worker_uid"
  eq "hf: worker process evidence mode" "$(jq -r .oracle.process.mode $h)" cgroup-v2
  echo "hf: transformers $(jq -r .oracle.transformers.version $h), peak $(jq -r .oracle.process.memory.peak_bytes $h) bytes, forward $(jq -r .oracle.forward_seconds $h) s"
fi

# 4. an over-limit job is OOM-killed; the service stays up and unrestarted
restarts_before=$(systemctl show -P NRestarts assayd.service)
out=$(as_alice assay --json submit "$work/oom.json" --wait --wait-timeout 900 2>/dev/null)
eq "alice: submit --wait oom.json exit status (5: job failed)" $? 5
oom_id=$(job_id "$out")
ev=/var/lib/assay/jobs/$oom_id/oracle/evidence.json
eq "oom job: oracle evidence oom_killed" "$(jq -r .oom_killed "$ev" 2>&1)" true
echo "oom job: memory.events $(jq -c '.counters["memory.events"]' "$ev" 2>&1), peak $(jq -r .memory.peak_bytes "$ev" 2>&1)"
echo "oom job error: $(as_alice assay --json status "$oom_id" | jq -c .error)"
eq "service still active after the OOM kill" "$(systemctl is-active assayd.service)" active
eq "service not restarted (NRestarts)" "$(systemctl show -P NRestarts assayd.service)" "$restarts_before"
eq "same main pid" "$(systemctl show -P MainPID assayd.service)" "$pid"
check "alice: assay health after the OOM kill" as_alice assay health
echo "after OOM: $(elapsed)"

# 5. restart while a job is queued; it finishes afterwards ("running" holds the slot; it is over
#    its memory limit too, so it fails fast whether it is re-run or not)
as_alice assay --json submit "$work/running.json" >$logs/submit-running.json
as_alice assay --json submit "$work/queued.json" >$logs/submit-queued.json
run_id=$(job_id "$(cat $logs/submit-running.json)")
q_id=$(job_id "$(cat $logs/submit-queued.json)")
echo "submitted $run_id (to run) and $q_id (to queue)"
sleep 1
eq "second job is queued before the restart" "$(as_alice assay --json status "$q_id" | jq -r .state)" queued
systemctl restart assayd.service
eq "service active after restart" "$(systemctl is-active assayd.service)" active
as_alice assay wait "$q_id" --wait-timeout 900 >$logs/wait-queued.log 2>&1
eq "queued job finished after the restart (wait exit status)" $? 0 || cat $logs/wait-queued.log
eq "queued job state" "$(as_alice assay --json status "$q_id" | jq -r .state)" succeeded
as_alice assay wait "$run_id" --wait-timeout 900 >/dev/null 2>&1
echo "job holding the slot at the restart ended: $(as_alice assay --json status "$run_id" | jq -c '{state, error}')"
echo "after restart: $(elapsed)"

# 6. a user outside group assay is refused by the socket's permissions
out=$(runuser -u bob -- assay health 2>&1)
rc=$?
eq "bob (not in group assay): assay health exit status (3: not reachable)" $rc 3
echo "bob saw: $out"

# 7. no worker cgroup left under the service's cgroup
left=$(find $svc_cg/workers -mindepth 1 -type d 2>/dev/null | wc -l)
eq "worker cgroups left under $svc_cg/workers" "$left" 0
echo "service cgroup children: $(cd $svc_cg && ls -d */ | tr '\n' ' ')"

# 8. started alone (no socket first), and remove keeps /var/lib/assay, purge deletes it
systemctl stop assayd.service assayd.socket
systemctl start assayd.service
eq "service started alone brings up the socket" "$(systemctl is-active assayd.socket)" active
check "alice: health after starting the service alone" as_alice assay health
dpkg -r assay-oracle assay >$logs/dpkg-r.log 2>&1
check "dpkg -r" [ $? = 0 ] || cat $logs/dpkg-r.log
eq "service stopped on removal" "$(systemctl is-active assayd.service)" inactive
check "/var/lib/assay kept on remove (keys)" [ -f /var/lib/assay/keys/host.pub ]
dpkg -P assay >/dev/null 2>&1
check "/var/lib/assay deleted on purge" [ ! -e /var/lib/assay ]

echo "total $(elapsed), $fails failed"
exit $fails
