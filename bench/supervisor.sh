#!/usr/bin/env bash
# Benchmarks of assayd (issue 6), recorded in bench/supervisor.md:
#  1. job status requests per second over the unix socket at concurrency 64 (goal >= 10,000/s),
#     against a baseline measured in the same run: a trivial responder serving the same reply
#     bytes on its own socket (bench/supervisor_load.cpp --baseline), i.e. the transport's floor.
#  2. submit-to-result overhead for a tiny fixture beyond the two workers' own wall times (goal
#     <= 50 ms): client-side time from POST to the terminal event on the events stream, minus the
#     fingerprint and oracle wall times the containment evidence records. Median of RUNS jobs.
# Usage: bench/supervisor.sh [BUILD_DIR=build] [RUNS=5]   (ASSAY_CONTAINMENT=auto|v1|v2|none)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
runs=${2:-5}
containment=${ASSAY_CONTAINMENT:-auto}
py=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
assayd=$build/supervisor/assayd
load=$build/tests/integration/supervisor_load
for b in "$assayd" "$load"; do [ -x "$b" ] || { echo "no $b (build assayd, supervisor_load)" >&2; exit 2; }; done

tmp=$(mktemp -d /tmp/assay-sup-bench.XXXXXX)
pid=""
stop() { [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; pid=""; }
trap 'stop; rm -rf "$tmp"' EXIT
sock=$tmp/assayd.sock

start() {
  "$assayd" serve --socket "$sock" --state-dir "$tmp/state-$1" "${@:2}" >"$tmp/assayd-$1.log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do curl -sf --unix-socket "$sock" http://a/v1/health >/dev/null && return 0; sleep 0.05; done
  cat "$tmp/assayd-$1.log" >&2
  return 1
}

# 1. Status throughput. A job that fails at once (/bin/false as its fingerprint worker) gives a
#    real job document to ask for.
mkdir -p "$tmp/model"
echo '{"vocab_size":260}' >"$tmp/model/config.json"
start status --containment none --fingerprint-worker /bin/false
req='{"schema":"assay.next-token-request.v1","id":"bench","model_dir":"'$tmp/model'","input_token_ids":[1,2,3],"candidates":[{"engine":"a","token_id":65,"text":"A"},{"engine":"b","token_id":66,"text":"B"}]}'
id=$(curl -sf --unix-socket "$sock" -X POST --data "$req" http://a/v1/jobs | $py -c 'import json,sys; print(json.load(sys.stdin)["id"])')
sleep 1
status_runs=()
base_runs=()
for i in 1 2 3; do
  status_runs+=("$("$load" --socket "$sock" --target "/v1/jobs/$id" --clients 64 --requests 500)")
  base_runs+=("$("$load" --socket "$sock" --target "/v1/jobs/$id" --clients 64 --requests 500 --baseline)")
done
stop
status_json=$(printf '%s\n' "${status_runs[@]}")
base_json=$(printf '%s\n' "${base_runs[@]}")

# 2. Submit-to-result overhead with the real workers.
overhead="not measured: assay-fingerprint or assay-oracle not built"
if [ -x "$build/fingerprint/assay-fingerprint" ] && [ -x "$build/worker/assay-oracle" ]; then
  $py "$root/tests/fixtures/make_fixture.py" --arch llama --size tiny --out "$tmp/llama" >/dev/null
  workers=(--fingerprint-worker "$build/fingerprint/assay-fingerprint" --oracle-worker "$build/worker/assay-oracle")
  start overhead --containment "$containment" "${workers[@]}" ||
    { containment=none; start overhead --containment none "${workers[@]}"; }
  overhead=$($py - "$sock" "$tmp/llama" "$runs" <<'PY'
import http.client, json, socket, statistics, sys, time
sock, model, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
class Conn(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(sock)
def call(method, path, body=None):
    c = Conn("assayd")
    c.request(method, path, body=body)
    r = c.getresponse()
    return r.status, r.read()
rows = []
for i in range(runs):
    req = {"schema": "assay.next-token-request.v1", "id": "overhead-%d-%f" % (i, time.time()),
           "model_dir": model, "input_token_ids": [72, 101, 108, 108, 111],
           "candidates": [{"engine": "a", "token_id": 65, "text": "A"}, {"engine": "b", "token_id": 66, "text": "B"}]}
    t0 = time.monotonic()
    status, body = call("POST", "/v1/jobs", json.dumps(req))
    job = json.loads(body)["id"]
    call("GET", "/v1/jobs/%s/events" % job)  # returns when the job is terminal
    total = time.monotonic() - t0
    status, body = call("GET", "/v1/jobs/%s/result" % job)
    if status != 200:
        sys.exit("job %s has no result: %s" % (job, call("GET", "/v1/jobs/" + job)[1].decode()))
    r = json.loads(body)
    workers = (r["model_fingerprint"]["process"]["wall_usec"] + r["oracle"]["process"]["wall_usec"]) / 1e6
    rows.append((total, workers, total - workers))
print(json.dumps({"runs": runs, "total_s": statistics.median(x[0] for x in rows),
                  "workers_s": statistics.median(x[1] for x in rows),
                  "overhead_ms": 1000 * statistics.median(x[2] for x in rows),
                  "overhead_ms_all": [round(1000 * x[2], 1) for x in rows]}))
PY
)
  stop
fi

$py - "$status_json" "$base_json" "$overhead" "$containment" >"$root/bench/supervisor.md" <<'PY'
import json, statistics, subprocess, sys
st = [json.loads(l) for l in sys.argv[1].splitlines()]
bs = [json.loads(l) for l in sys.argv[2].splitlines()]
rps = statistics.median(x["rps"] for x in st)
brps = statistics.median(x["rps"] for x in bs)
cpu = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
load = open("/proc/loadavg").read().split()[0]
print("# assayd benchmarks (bench/supervisor.sh)\n")
print("Machine: %s CPUs, load average %s at the start of the report (a shared build machine)." % (cpu, load))
print("\n## Job status requests per second, 64 concurrent keep-alive clients x 500 requests\n")
print("| run | assayd req/s | baseline req/s (fixed-reply responder) | errors |")
print("|---|---|---|---|")
for i, (a, b) in enumerate(zip(st, bs)):
    print("| %d | %.0f | %.0f | %d |" % (i + 1, a["rps"], b["rps"], a["errors"] + b["errors"]))
print("\nMedian: assayd **%.0f req/s** (goal >= 10,000), baseline %.0f req/s, ratio assayd/baseline **%.2f**." % (rps, brps, rps / brps))
print("\n## Submit-to-result overhead beyond the workers' own wall times (tiny llama fixture)\n")
o = sys.argv[3]
try:
    o = json.loads(o)
    print("Containment: %s. Median of %d jobs: total %.3f s, fingerprint + oracle wall %.3f s, "
          "**overhead %.1f ms** (goal <= 50 ms); per job: %s ms. Ratio total/workers %.3f." %
          (sys.argv[4], o["runs"], o["total_s"], o["workers_s"], o["overhead_ms"], o["overhead_ms_all"],
           o["total_s"] / o["workers_s"]))
except ValueError:
    print(o)
PY
cat "$root/bench/supervisor.md"
