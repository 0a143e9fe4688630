#!/usr/bin/env bash
# Benchmarks of issue 17, parts 2 and 3, through a real assayd (same machine, one run):
#  1. a trajectory job over 2 x N continuation tokens against 2N single next-token jobs over
#     the same states (prompt + each engine's continuation prefix), tiny llama fixture;
#  2. the fingerprint of an unchanged ~GB_SIZE random checkpoint: a first fingerprint (every
#     byte hashed) against a second one given the first's digests as its cache, and against a
#     second one without the cache (`fingerprint_cache: off`).
# Usage: bench/trajectory.sh [BUILD_DIR=build] [N=64] [GB_MIB=1536]
#   ORACLE=/path/to/assay-oracle (default BUILD_DIR/worker/assay-oracle), CONTAINMENT=auto|none
# Writes bench/trajectory.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
n=${2:-64}
gb_mib=${3:-1536}
oracle=${ORACLE:-$build/worker/assay-oracle}
containment=${CONTAINMENT:-auto}
for b in "$build/supervisor/assayd" "$build/fingerprint/assay-fingerprint" "$oracle" \
  "$build/compare/assay-compare"; do
  [ -x "$b" ] || { echo "missing $b" >&2; exit 2; }
done

work=$(mktemp -d /var/tmp/assay-traj-bench.XXXXXX)
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

"${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}" "$root/tests/fixtures/make_fixture.py" --arch llama --size tiny --out "$work/model" >/dev/null
"$build/supervisor/assayd" serve --socket "$work/sock" --state-dir "$work/state" \
  --containment "$containment" --fingerprint-worker "$build/fingerprint/assay-fingerprint" \
  --oracle-worker "$oracle" --compare-worker "$build/compare/assay-compare" \
  >"$work/assayd.log" 2>&1 &
pid=$!

python3 - "$work" "$n" <<'PY' >"$work/part1.txt"
import http.client, json, random, socket, sys, time
work, n = sys.argv[1], int(sys.argv[2])

class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX); self.sock.connect(work + "/sock")

def call(method, target, body=None):
    c = Unix("localhost"); c.request(method, target, body=json.dumps(body) if body else None,
                                     headers={"Content-Type": "application/json"})
    r = c.getresponse(); data = r.read(); c.close()
    return r.status, json.loads(data)

for _ in range(200):
    try:
        if call("GET", "/v1/health")[0] == 200: break
    except OSError: pass
    time.sleep(0.05)

def wait(ids):
    pending = set(ids)
    while pending:
        for i in list(pending):
            s = call("GET", "/v1/jobs/" + i)[1]["state"]
            if s in ("succeeded", "failed", "cancelled"):
                if s != "succeeded": sys.exit("job %s %s" % (i, s))
                pending.discard(i)
        time.sleep(0.05)

rng = random.Random(17)
prompt = [72, 101, 108, 108, 111, 44, 32]
cont = {e: [rng.randint(65, 90) for _ in range(n)] for e in ("kiln", "vllm")}
model = work + "/model"
# Warm-up: one job of each kind on other ids, so both paths start with the page cache warm.
st, j = call("POST", "/v1/jobs", {"schema": "assay.next-token-request.v1", "id": "warm",
    "model_dir": model, "input_token_ids": prompt,
    "candidates": [{"engine": "a", "token_id": 65, "text": "A"},
                   {"engine": "b", "token_id": 66, "text": "B"}]})
wait([j["id"]])

t0 = time.monotonic()
st, j = call("POST", "/v1/jobs", {"schema": "assay.trajectory-request.v1", "id": "traj",
    "model_dir": model, "prompt_token_ids": prompt,
    "continuations": [{"engine": e, "token_ids": cont[e]} for e in cont]})
assert st == 201, j
wait([j["id"]])
traj = time.monotonic() - t0
res = call("GET", "/v1/jobs/%s/result" % j["id"])[1]
deps = {e["engine"]: e["first_departure"] for e in res["engines"]}

t0 = time.monotonic()
ids = []
for e in cont:
    other = "vllm" if e == "kiln" else "kiln"
    for i in range(n):
        tok = cont[e][i]; alt = 65 + (tok - 65 + 1) % 26
        while True:  # the queue holds at most max_queue (256) jobs: submit as it drains
            st, j = call("POST", "/v1/jobs", {"schema": "assay.next-token-request.v1",
                "id": "state-%s-%d" % (e, i), "model_dir": model,
                "input_token_ids": prompt + cont[e][:i],
                "candidates": [{"engine": e, "token_id": tok, "text": chr(tok)},
                               {"engine": other, "token_id": alt, "text": chr(alt)}]})
            if st != 429: break
            time.sleep(0.2)
        assert st == 201, j
        ids.append(j["id"])
wait(ids)
singles = time.monotonic() - t0
print(json.dumps({"n": n, "trajectory_seconds": traj, "single_jobs": len(ids),
                  "single_seconds": singles, "ratio": singles / traj,
                  "first_departures": deps}))
PY

# Part 2: the fingerprint worker directly, as assayd runs it (worker protocol), with the digests
# of the first run passed back as its cache (what assayd does with fingerprint_cache: on).
m=$work/big
mkdir -p "$m"
echo '{"model_type":"llama","hidden_size":4096}' >"$m/config.json"
head -c $((4 << 20)) /dev/urandom >"$m/tokenizer.json"
shard=$((gb_mib / 3))
for i in 1 2 3; do head -c $((shard << 20)) /dev/urandom >"$m/model-0000$i-of-00003.safetensors"; done
printf '{"weight_map":{"a":"model-00001-of-00003.safetensors","b":"model-00002-of-00003.safetensors","c":"model-00003-of-00003.safetensors"}}' \
  >"$m/model.safetensors.index.json"
fp() {  # fp NAME INPUT_JSON -> wall seconds
  mkdir -p "$work/fp-$1"
  printf '%s' "$2" >"$work/fp-$1/input.json"
  local t0 t1
  t0=$(date +%s.%N)
  "$build/fingerprint/assay-fingerprint" run --input "$work/fp-$1/input.json" --workdir "$work/fp-$1"
  t1=$(date +%s.%N)
  echo "$t1 - $t0" | bc
}
base='{"schema":"assay.fingerprint-input.v1","model_dir":"'$m'","id":"big","threads":2}'
cold=$(fp first "$base")
nocache=$(fp nocache "$base")
cache=$(python3 -c '
import json,sys
out=json.load(open(sys.argv[1]))
entries=[]
for f in out["files"]:
    f.pop("source"); f["job"]="bench-first"; f["at"]="now"; entries.append(f)
print(json.dumps(entries))' "$work/fp-first/output.json")
withcache=$(fp cached "${base%\}},\"cache\":$cache}")
python3 - "$work" "$cold" "$nocache" "$withcache" "$gb_mib" <<'PY' >"$work/part2.txt"
import json, sys
work, cold, nocache, cached, mib = sys.argv[1], *map(float, sys.argv[2:5]), int(sys.argv[5])
c = json.load(open(work + "/fp-cached/output.json"))
a = json.load(open(work + "/fp-nocache/output.json"))
assert c["model_identity"] == a["model_identity"]
print(json.dumps({"mib": mib, "first_seconds": cold, "second_without_cache_seconds": nocache,
                  "second_with_cache_seconds": cached, "cached_files": c["stats"]["cached_files"],
                  "bytes_read_with_cache": c["stats"]["bytes"],
                  "ratio_with_over_without": cached / nocache}))
PY

python3 - "$work/part1.txt" "$work/part2.txt" "$n" "$containment" <<'PY' >"$root/bench/trajectory.md"
import json, os, sys
p1 = json.load(open(sys.argv[1])); p2 = json.load(open(sys.argv[2]))
print("# Trajectory attribution and the fingerprint cache (bench/trajectory.sh)\n")
print("Machine: %d CPUs (`nproc`), containment `%s`; one run of `bench/trajectory.sh`.\n"
      % (os.cpu_count(), sys.argv[4]))
print("## Trajectory vs single next-token jobs (tiny llama fixture)\n")
print("One trajectory job over 2 x %d continuation tokens (fingerprint, two captures, one "
      "comparison) against %d single next-token jobs over the same states (prompt + each "
      "engine's continuation prefix; each job its own fingerprint and oracle process), all "
      "through assayd, wall time from the first submission to the last job's end. The "
      "continuations are fixed pseudo-random letters: the work does not depend on the tokens.\n"
      % (p1["n"], p1["single_jobs"]))
print("| | wall seconds |\n|---|---|")
print("| trajectory job (2 x %d tokens) | %.2f |" % (p1["n"], p1["trajectory_seconds"]))
print("| %d single jobs | %.2f |" % (p1["single_jobs"], p1["single_seconds"]))
print("| **ratio (singles / trajectory)** | **%.1fx** |\n" % p1["ratio"])
print("## Second fingerprint of an unchanged model\n")
print("A %d MiB random checkpoint (3 shards + index, config, 4 MiB tokenizer), "
      "`assay-fingerprint run` as assayd runs it (2 threads, page cache warm after the first "
      "run). With the cache: the first run's per-file entries passed as `cache` (what assayd "
      "does with `fingerprint_cache: on`).\n" % p2["mib"])
print("| run | wall seconds |\n|---|---|")
print("| first (hash everything) | %.3f |" % p2["first_seconds"])
print("| second, `fingerprint_cache: off` | %.3f |" % p2["second_without_cache_seconds"])
print("| second, cache on (%d files from the cache, %d bytes read) | %.3f |"
      % (p2["cached_files"], p2["bytes_read_with_cache"], p2["second_with_cache_seconds"]))
print("| **with / without cache** | **%.2f%%** |" % (100 * p2["ratio_with_over_without"]))
print("\nThe cached run still reads `model.safetensors.index.json` (it names the shards) and "
      "starts a process that hashes its own executable; that is most of what remains.")
PY
cat "$root/bench/trajectory.md"
