#!/usr/bin/env bash
# Benchmark of issue 17, part 1, through a real assayd (same machine, one run, same fixture):
# the wall time per dispute of one batch job of N states against N single next-token jobs over
# the same states, on the tiny and the small (~40M parameters) llama fixtures. Every state is a
# 32-token prompt of its own; the single jobs are all submitted at once (the queue runs them
# one after another, each with its own preflight, fingerprint and oracle process that loads the
# model); the batch pays those once. Wall time from the first submission to the last job's end.
# Usage: bench/batch.sh [BUILD_DIR=build] [N=100] [SIZES="tiny small"]
#   CONTAINMENT=auto|none (default auto)
# Writes bench/batch.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
n=${2:-100}
sizes=${3:-tiny small}
containment=${CONTAINMENT:-auto}
for b in "$build/supervisor/assayd" "$build/fingerprint/assay-fingerprint" \
  "$build/worker/assay-oracle"; do
  [ -x "$b" ] || { echo "missing $b" >&2; exit 2; }
done

work=$(mktemp -d /var/tmp/assay-batch-bench.XXXXXX)
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

"$build/supervisor/assayd" serve --socket "$work/sock" --state-dir "$work/state" \
  --containment "$containment" --fingerprint-worker "$build/fingerprint/assay-fingerprint" \
  --oracle-worker "$build/worker/assay-oracle" >"$work/assayd.log" 2>&1 &
pid=$!

for size in $sizes; do
  "${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}" "$root/tests/fixtures/make_fixture.py" --arch llama \
    --size "$size" --out "$work/model-$size" >/dev/null
done
sleep 2.1  # the fingerprint cache keeps no digest of a file changed in the last 2 s

PYTHONPATH=$root/bench python3 - "$work" "$n" $sizes <<'PY' >"$work/results.json"
import json, random, sys, time
from assayd_http import call as call_at, wait_healthy, wait_jobs
work, n, sizes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
sock = work + "/sock"
call = lambda *a: call_at(sock, *a)
wait = lambda ids: wait_jobs(sock, ids)
wait_healthy(sock)

def state(size, i):
    rng = random.Random(1000 * len(size) + i)
    return {"schema": "assay.next-token-request.v1", "id": "%s-%d" % (size, i),
            "input_token_ids": [rng.randint(32, 126) for _ in range(32)],
            "candidates": [{"engine": "kiln", "token_id": 65, "text": "A"},
                           {"engine": "vllm", "token_id": 66, "text": "B"}]}

out = {}
for size in sizes:
    model = work + "/model-" + size
    # Warm-up on other ids: the page cache and the fingerprint cache are warm for both paths.
    warm = dict(state(size, 10**6), model_dir=model)
    st, j = call("POST", "/v1/jobs", warm); assert st == 201, j; wait([j["id"]])

    t0 = time.monotonic()
    ids = []
    for i in range(n):
        while True:  # the queue holds at most max_queue jobs: submit as it drains
            st, j = call("POST", "/v1/jobs", dict(state(size, i), model_dir=model))
            if st != 429: break
            time.sleep(0.2)
        assert st == 201, j
        ids.append(j["id"])
    wait(ids)
    singles = time.monotonic() - t0
    single_logits = {}
    for i in (0, n - 1):
        single_logits[i] = call("GET", "/v1/jobs/%s/result" % ids[i])[1]["oracle"]["logits_sha256"]

    t0 = time.monotonic()
    st, j = call("POST", "/v1/jobs?model_dir=" + model,
                 {"schema": "assay.next-token-batch-request.v1", "id": "bench-" + size,
                  "states": [state(size, i) for i in range(n)]})
    assert st == 201, j
    wait([j["id"]])
    batch = time.monotonic() - t0
    summary = call("GET", "/v1/jobs/%s/result" % j["id"])[1]
    assert summary["counts"]["succeeded"] == n, summary["counts"]
    same = all(call("GET", "/v1/jobs/%s/result" % summary["states"][i]["job_id"])[1]["oracle"]
               ["logits_sha256"] == single_logits[i] for i in single_logits)
    out[size] = {"n": n, "single_seconds": singles, "batch_seconds": batch,
                 "per_dispute_single": singles / n, "per_dispute_batch": batch / n,
                 "ratio": singles / batch, "logits_equal": same,
                 "oracle_runs": len(summary["oracle_runs"])}
print(json.dumps(out))
PY

load_after=$(cut -d' ' -f1-3 /proc/loadavg)
python3 - "$work/results.json" "$root/bench/batch.md" "$load_before" "$load_after" "$containment" <<'PY'
import json, os, sys, time
res = json.load(open(sys.argv[1]))
md = ["# Batch jobs vs single next-token jobs (bench/batch.sh)", "",
      "Run %s UTC by `bench/batch.sh`. Machine: %d CPUs (shared), containment `%s`; load average %s before, %s after." % (
          time.strftime("%Y-%m-%d %H:%M", time.gmtime()), os.cpu_count(), sys.argv[5], sys.argv[3], sys.argv[4]),
      "",
      "Each fixture: N states, each a 32-token prompt of its own with two candidates. Baseline: N single next-token jobs over the same states, submitted at once, measured in the same run on the same daemon (each its own preflight, fingerprint worker, and oracle process that starts LibTorch and loads the model). Batch: one `assay.next-token-batch-request.v1` of the same N states (one preflight, one fingerprint, one oracle worker that loads the model once, a signed result per state and a signed summary). Wall time from the first submission to the last job's end; a warm-up job first, so both paths find the page cache and the fingerprint cache warm.",
      "",
      "| fixture | states | N single jobs, s | batch job, s | per dispute, single | per dispute, batch | **ratio** | oracle runs | logits equal (states 0 and N-1) |",
      "|---|---|---|---|---|---|---|---|---|"]
for size, r in res.items():
    md.append("| %s | %d | %.2f | %.2f | %.3f s | %.4f s | **%.1fx** | %d | %s |" % (
        size, r["n"], r["single_seconds"], r["batch_seconds"], r["per_dispute_single"],
        r["per_dispute_batch"], r["ratio"], r["oracle_runs"], "yes" if r["logits_equal"] else "NO"))
md += ["", "Goal (issue 17): at least 10x less wall time per dispute on the small fixture; the tiny one recorded too.", ""]
open(sys.argv[2], "w").write("\n".join(md))
print("\n".join(md))
PY
