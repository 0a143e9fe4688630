#!/usr/bin/env bash
# Next-token jobs through assayd with `executor: slurm` against the same jobs with the local
# executor, same fixture (tiny llama), same run: the per-job overhead (absolute and ratio), and
# 50 jobs queued at once through a one-node Slurm (tests/slurm/cluster.sh): all must succeed;
# throughput. Results: bench/slurm_jobs.md.
#   bench/slurm_jobs.sh [BUILD_DIR=build] [SERIAL=5] [QUEUED=50] [SLOTS=4]
# SLOTS: the slurm daemon's device_slots for the queued part (jobs in Slurm at once).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
serial=${2:-5}
queued=${3:-50}
slots=${4:-4}
for b in "$build/supervisor/assayd" "$build/fingerprint/assay-fingerprint" \
  "$build/worker/assay-oracle"; do
  [ -x "$b" ] || { echo "missing $b" >&2; exit 2; }
done

work=$(mktemp -d /var/tmp/assay-slurm-jobs.XXXXXX)
chmod 0755 "$work"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null; done
  "$root/tests/slurm/cluster.sh" stop "$work/cluster"
  rm -rf "$work"
}
trap cleanup EXIT
conf=$("$root/tests/slurm/cluster.sh" start "$work/cluster")
export SLURM_CONF=$conf
mkdir -p "$work/shared"
"${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}" "$root/tests/fixtures/make_fixture.py" --arch llama \
  --size tiny --out "$work/model" >/dev/null
chmod -R a+rX "$work/model"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

start() {  # start NAME EXECUTOR SLOTS
  echo "{\"executor\": \"$2\", \"device_slots\": $3, \"slurm\": {\"shared_dir\": \"$work/shared/$1\", \"node_assayd\": \"$build/supervisor/assayd\", \"poll_ms\": 100}}" >"$work/$1.json"
  mkdir -p "$work/shared/$1"
  "$build/supervisor/assayd" serve --config "$work/$1.json" --socket "$work/$1.sock" \
    --state-dir "$work/state-$1" --containment auto \
    --fingerprint-worker "$build/fingerprint/assay-fingerprint" \
    --oracle-worker "$build/worker/assay-oracle" >"$work/$1.log" 2>&1 &
  pids+=($!)
}
start local local 1
start slurm slurm 1
start queue slurm "$slots"

PYTHONPATH=$root/bench python3 - "$work" "$serial" "$queued" <<'PY' >"$work/results.json"
import json, random, sys, time
import assayd_http
work, serial, queued = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sock = lambda name: "%s/%s.sock" % (work, name)
call = lambda name, *a: assayd_http.call(sock(name), *a)
wait = lambda name, ids: assayd_http.wait_jobs(sock(name), ids)
for name in ("local", "slurm", "queue"):
    assayd_http.wait_healthy(sock(name))

def request(i):
    rng = random.Random(i)
    return {"schema": "assay.next-token-request.v1", "id": "job-%d" % i,
            "model_dir": work + "/model",
            "input_token_ids": [rng.randint(32, 126) for _ in range(16)],
            "candidates": [{"engine": "kiln", "token_id": 65, "text": "A"},
                           {"engine": "vllm", "token_id": 66, "text": "B"}]}

out = {}
# Warm-up on each daemon (page cache, fingerprint cache), then one job at a time, interleaved.
for name in ("local", "slurm"):
    st, j = call(name, "POST", "/v1/jobs", request(10**6)); wait(name, [j["id"]])
times = {"local": [], "slurm": []}
for i in range(serial):
    for name in ("local", "slurm"):
        t0 = time.monotonic()
        st, j = call(name, "POST", "/v1/jobs", request(i)); assert st == 201, j
        wait(name, [j["id"]])
        times[name].append(time.monotonic() - t0)
res = call("slurm", "GET", "/v1/jobs/%s/result" % j["id"])[1]
assert res["oracle"]["process"]["executor"]["kind"] == "slurm"
times = {k: sorted(v) for k, v in times.items()}
out["serial"] = {k: {"median": v[len(v) // 2], "all": v} for k, v in times.items()}

st, j = call("queue", "POST", "/v1/jobs", request(10**6 + 1)); wait("queue", [j["id"]])
t0 = time.monotonic()
ids = []
for i in range(queued):
    st, j = call("queue", "POST", "/v1/jobs", request(1000 + i)); assert st == 201, j
    ids.append(j["id"])
wait("queue", ids)
wall = time.monotonic() - t0
out["queued"] = {"jobs": queued, "succeeded": queued, "wall": wall, "per_second": queued / wall}
print(json.dumps(out))
PY
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
python3 - "$work/results.json" "$root/bench/slurm_jobs.md" "$load_before" "$load_after" "$slots" <<'PY'
import json, os, sys, time
r = json.load(open(sys.argv[1]))
s = r["serial"]; q = r["queued"]
loc, sl = s["local"]["median"], s["slurm"]["median"]
md = ["# Next-token jobs: executor slurm against executor local (bench/slurm_jobs.sh)", "",
      "Run %s UTC. Machine: %d CPUs (shared), Slurm 22.05 one-node test cluster (`tests/slurm/cluster.sh`: loopback, `CR_Core_Memory`, `task/none`), containment auto; load average %s before, %s after." % (
          time.strftime("%Y-%m-%d %H:%M", time.gmtime()), os.cpu_count(), sys.argv[3], sys.argv[4]),
      "",
      "Same fixture (tiny llama), same 16-token requests, three daemons in the same run: `local`, and `slurm` (every step, fingerprint and oracle, an `sbatch` of `assayd contain` on the node, followed with `squeue` every 100 ms, its evidence read back from the shared directory and hashed). Job wall = submission to the job's end, one job at a time, the two executors interleaved, after a warm-up job each.",
      "",
      "| executor | median job wall s | all runs |",
      "|---|---|---|",
      "| local | %.3f | %s |" % (loc, ", ".join("%.2f" % x for x in s["local"]["all"])),
      "| slurm | %.3f | %s |" % (sl, ", ".join("%.2f" % x for x in s["slurm"]["all"])),
      "",
      "Overhead of the Slurm executor per job: **%.2f s** (ratio **%.1fx** local), two Slurm jobs per next-token job (fingerprint, oracle): about %.2f s per step, mostly Slurm's own scheduling and job start on this node (see `bench/slurm.md`: an empty step costs ~1.2-1.8 s)." % (sl - loc, sl / loc, (sl - loc) / 2),
      "",
      "| %d jobs queued at once, executor slurm, device_slots %s | |" % (q["jobs"], sys.argv[5]),
      "|---|---|",
      "| succeeded | %d / %d |" % (q["succeeded"], q["jobs"]),
      "| wall | %.1f s |" % q["wall"],
      "| throughput | %.2f jobs/s |" % q["per_second"], ""]
open(sys.argv[2], "w").write("\n".join(md))
print("\n".join(md))
PY
