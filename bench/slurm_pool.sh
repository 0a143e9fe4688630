#!/usr/bin/env bash
# Slurm worker pools (docs/slurm.md "Worker pools") on a real four-node test cluster
# (tests/slurm/cluster.sh --nodes 4: four slurmd, each in network and UTS namespaces of its own,
# sharing this machine's CPUs; a pool job takes a node to itself, so the one-node pool holds one
# and the three-node pool the other three), same run:
#  1. per-dispute overhead (tiny llama): next-token disputes one at a time on a warm pool (one
#     node, its resident worker loaded) against the same disputes on a local resident worker,
#     interleaved;
#  2. a batch of STATES states (small llama) on a three-node pool against a one-node pool,
#     interleaved: wall,
#     the per-node split, the scheduling overhead, and a model on paper of throughput against
#     node count from the measured per-state cost.
# Results: bench/slurm_pool.md (rewritten; a hand-written "## Reading" below the rows is kept).
#   bench/slurm_pool.sh [BUILD_DIR=build] [DISPUTES=10] [STATES=300]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
disputes=${2:-10}
states=${3:-300}
py=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
for b in "$build/supervisor/assayd" "$build/fingerprint/assay-fingerprint" \
  "$build/worker/assay-oracle"; do
  [ -x "$b" ] || { echo "missing $b" >&2; exit 2; }
done

work=$(mktemp -d /var/tmp/assay-slurm-pool.XXXXXX)
chmod 0755 "$work"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null; done
  "$root/tests/slurm/cluster.sh" stop "$work/cluster"
  "$build/supervisor/assayd" contain --cleanup-orphans >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
conf=$("$root/tests/slurm/cluster.sh" start "$work/cluster" --nodes 4)
export SLURM_CONF=$conf
hub=/run/netns/$(cat "$work/cluster/netns")
addr=$(cat "$work/cluster/addr")
"$py" "$root/tests/fixtures/make_fixture.py" --arch llama --size tiny --out "$work/model" >/dev/null
"$py" "$root/tests/fixtures/make_fixture.py" --arch llama --size small --out "$work/small" >/dev/null
chmod -R a+rX "$work/model" "$work/small"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

# Every daemon runs in the cluster's hub namespace, where the nodes reach 10.213.0.1.
start() {  # start NAME CONFIG-JSON
  echo "$2" >"$work/$1.json"
  mkdir -p "$work/shared/$1"
  nsenter --net="$hub" "$build/supervisor/assayd" serve --config "$work/$1.json" \
    --socket "$work/$1.sock" --state-dir "$work/state-$1" --containment auto \
    --fingerprint-worker "$build/fingerprint/assay-fingerprint" \
    --oracle-worker "$build/worker/assay-oracle" >"$work/$1.log" 2>&1 &
  pids+=($!)
}
pool() {  # pool NAME NODES
  echo "{\"executor\": \"slurm\", \"device_slots\": $2, \"slurm\": {\"shared_dir\": \"$work/shared/$1\", \"node_assayd\": \"$build/supervisor/assayd\", \"poll_ms\": 100, \"pool\": {\"nodes\": $2, \"listen\": \"$addr:0\", \"idle_seconds\": 3600, \"memory_bytes\": 2147483648}}}"
}
start local '{"executor": "local", "device_slots": 1, "resident_models": {"count": 1}}'
start pool1 "$(pool pool1 1)"
start pool3 "$(pool pool3 3)"

PYTHONPATH=$root/bench "$py" - "$work" "$disputes" "$states" <<'PY' >"$work/results.json"
import collections, json, random, sys, time
import assayd_http
work, disputes, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sock = lambda name: "%s/%s.sock" % (work, name)
call = lambda name, *a: assayd_http.call(sock(name), *a)
for name in ("local", "pool1", "pool3"):
    assayd_http.wait_healthy(sock(name))

def wait(name, job, poll=0.002):
    while True:
        state = call(name, "GET", "/v1/jobs/" + job)[1]["state"]
        if state in ("succeeded", "failed", "cancelled"):
            assert state == "succeeded", (name, job, state)
            return
        time.sleep(poll)

def request(i, n=16, model="model"):
    rng = random.Random(i)
    return {"schema": "assay.next-token-request.v1", "id": "job-%d" % i,
            "model_dir": work + "/" + model,
            "input_token_ids": [rng.randint(32, 126) for _ in range(n)],
            "candidates": [{"engine": "kiln", "token_id": 65, "text": "A"},
                           {"engine": "vllm", "token_id": 66, "text": "B"}]}

def dispute(name, i):
    t0 = time.monotonic()
    st, j = call(name, "POST", "/v1/jobs", request(i)); assert st == 201, j
    wait(name, j["id"])
    return time.monotonic() - t0, j["id"]

out = {}
# 1. Warm-up (the pool's node joins and loads its resident worker; local loads its own), then
# one dispute at a time, interleaved.
for name in ("local", "pool1"):
    for w in range(2):
        dispute(name, 10**6 + w)
times = {"local": [], "pool1": []}
for i in range(disputes):
    for name in ("local", "pool1"):
        times[name].append(dispute(name, i)[0])
_, last = dispute("pool1", 10**6 + 7)
res = call("pool1", "GET", "/v1/jobs/%s/result" % last)[1]
assert res["oracle"]["process"]["executor"]["kind"] == "slurm-pool"
assert res["oracle"]["process"]["resident"]["jobs_before"] >= 2
out["disputes"] = {k: sorted(v) for k, v in times.items()}

# 2. Batches: the three-node pool is grown and warmed by a first batch; then the batch of
# `count` states on each pool, interleaved (pool1, pool3, pool3, pool1).
def batch(name, n, seed):
    rng = random.Random(seed)
    states = []
    for i in range(n):
        s = request(seed * 100000 + i, 32, "small"); del s["model_dir"]; states.append(s)
    t0 = time.monotonic()
    st, j = call(name, "POST", "/v1/jobs?model_dir=" + work + "/small",
                 {"schema": "assay.next-token-batch-request.v1", "id": "sweep", "states": states})
    assert st == 201, j
    wait(name, j["id"], 0.02)
    wall = time.monotonic() - t0
    summary = call(name, "GET", "/v1/jobs/%s/result" % j["id"])[1]
    assert summary["counts"]["succeeded"] == n, summary["counts"]
    nodes = collections.Counter()
    shards = {}
    for s in summary["states"]:
        r = call(name, "GET", "/v1/jobs/%s/result" % s["job_id"])[1]
        p = r["oracle"]["process"]
        node = p["executor"]["node"]
        nodes[node] += 1
        key = (node, p["resident"]["worker"], p["resident"]["jobs_before"])
        shards[key] = {"states": len(p["executor"]["states"]), "wall_s": p["wall_usec"] / 1e6}
    busy = collections.Counter()
    for (node, _, _), sh in shards.items():
        busy[node] += sh["wall_s"]
    return {"wall": wall, "nodes": dict(nodes), "shards": len(shards),
            "worker_seconds": sum(sh["wall_s"] for sh in shards.values()),
            "busy": dict(busy), "shard_sizes": sorted(sh["states"] for sh in shards.values())}

batch("pool3", 60, 1)
batch("pool1", 12, 2)
runs = collections.defaultdict(list)
for k, name in enumerate(("pool1", "pool3", "pool3", "pool1")):
    runs[name].append(batch(name, count, 10 + k))
out["batches"] = runs
print(json.dumps(out))
PY
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
cap=$("$py" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')
gemm=$("$py" -c '
import time, torch
torch.set_num_threads(2)
a = torch.randn(1024, 1024, dtype=torch.bfloat16); b = torch.randn(1024, 1024, dtype=torch.bfloat16)
a @ b; t = time.perf_counter(); n = 0
while time.perf_counter() - t < 2: a @ b; n += 1
print("%.1f" % (2 * 1024 ** 3 * n / (time.perf_counter() - t) / 1e9))')

"$py" - "$work/results.json" "$root/bench/slurm_pool.md" "$load_before" "$load_after" "$cpu" \
  "$cap" "$gemm" "$disputes" "$states" <<'PY'
import json, os, statistics, sys, time
r = json.load(open(sys.argv[1]))
out, before, after, cpu, cap, gemm, disputes, count = sys.argv[2:10]
count = int(count)
d = r["disputes"]
med = {k: statistics.median(v) for k, v in d.items()}
extra_ms = (med["pool1"] - med["local"]) * 1000
b = r["batches"]
one = min(b["pool1"], key=lambda x: x["wall"])
three = min(b["pool3"], key=lambda x: x["wall"])
# Per-state cost on one node (its worker's own wall, the node alone on the CPUs), and what the
# pool adds per shard beyond it.
c = one["worker_seconds"] / count
over1 = one["wall"] - one["worker_seconds"]
over3 = three["wall"] - max(three["busy"].values())
per_shard = max(0.0, (three["wall"] - three["worker_seconds"] / len(three["busy"])) / three["shards"])
md = ["# Slurm worker pools (bench/slurm_pool.sh)", "",
      "Run %s UTC. CPU: %s, %d CPUs (shared by the head, the nodes and their workers); "
      "`ATEN_CPU_CAPABILITY` %s; 2-thread bf16 GEMM (1024^3) %s GFLOP/s; load average %s before, "
      "%s after. Slurm 22.05, four-node test cluster (`tests/slurm/cluster.sh --nodes 4`: each "
      "slurmd in network and UTS namespaces of its own, veth pairs to a bridge; a pool job takes "
      "a node to itself, so the one-node pool held one and the three-node pool the other three). "
      "Fixtures: tiny llama for the disputes, small llama for the batches (make_fixture.py); "
      "each side's runs interleaved with the other's." % (
          time.strftime("%Y-%m-%d %H:%M", time.gmtime()), cpu, os.cpu_count(), cap, gemm, before,
          after), "",
      "## Per-dispute overhead: a warm pool against a local resident worker", "",
      "A dispute = a next-token job (16 tokens, two candidates) from submission to its end, "
      "polled every 2 ms; %s of each, interleaved, after two warm-up disputes each (the pool's "
      "node joined and its resident worker loaded). Local: `executor local`, `resident_models` 1. "
      "Pool: `executor slurm` with `pool.nodes` 1: the fingerprint and the oracle both run on "
      "the node (no sbatch), the oracle on its resident worker." % disputes, "",
      "| daemon | median s | all runs s |", "|---|---|---|"]
for k in ("local", "pool1"):
    md.append("| %s | %.3f | %s |" % ("local resident" if k == "local" else "warm pool (1 node)",
                                      med[k], ", ".join("%.3f" % x for x in d[k])))
md += ["", "Pool over local: **%+.0f ms per dispute** (ratio %.2fx; goal: at most +50 ms; the "
       "Slurm step executor: +2.77 s, `bench/slurm_jobs.md`)." % (extra_ms, med["pool1"] / med["local"]), "",
       "## A batch of %d states (small llama, 32 tokens each): three nodes against one" % count, "",
       "Two runs each, interleaved (one, three, three, one); the faster of each is shown. Worker "
       "seconds: the sum of every shard's resident-worker wall; busy: per node.", "",
       "| pool | wall s | states per node | shards (sizes) | worker s | busy per node s |",
       "|---|---|---|---|---|---|"]
for name, x in (("1 node", one), ("3 nodes", three)):
    md.append("| %s | %.2f | %s | %d (%s) | %.2f | %s |" % (
        name, x["wall"], ", ".join("%s %d" % kv for kv in sorted(x["nodes"].items())), x["shards"],
        " ".join(map(str, x["shard_sizes"])), x["worker_seconds"],
        ", ".join("%s %.2f" % kv for kv in sorted(x["busy"].items()))))
md += ["", "All runs: one node %s s; three nodes %s s." % (
           ", ".join("%.2f" % x["wall"] for x in b["pool1"]),
           ", ".join("%.2f" % x["wall"] for x in b["pool3"])), "",
       "Three nodes against one: **%.2fx** the wall (%.2f s against %.2f s) on %d shared CPUs." % (
           three["wall"] / one["wall"], three["wall"], one["wall"], os.cpu_count()), "",
       "Scheduling overhead (wall minus the workers' own time): one node %.2f s (%.1f ms per "
       "state); three nodes %.2f s beyond the busiest node, about %.0f ms per shard." % (
           over1, 1000 * over1 / count, over3, 1000 * per_shard), "",
       "## Throughput against node count, on paper", "",
       "Per-state cost measured on one node: c = %.1f ms (its worker alone); a shard costs the "
       "pool about o = %.0f ms beyond its states (round trip, file moves, the engine's harvest "
       "of that run). With n nodes of their own (not sharing CPUs as here) and guided "
       "self-scheduling (about 2n + n log(S/2n) shards), a batch of S states takes about "
       "S*c/n + shards*o/n + the first load:" % (1000 * c, 1000 * per_shard), "",
       "| nodes | modelled wall s (S=%d) | states/s |" % count, "|---|---|---|"]
import math
for n in (1, 2, 3, 4, 8, 16):
    shards = 2 * n + n * max(0.0, math.log(max(1.0, count / (2 * n))))
    wall = count * c / n + shards * per_shard / n
    md.append("| %d | %.2f | %.1f |" % (n, wall, count / wall))
md.append("")
kept = ""
if os.path.exists(out):
    old = open(out).read()
    at = old.find("\n## Reading")
    if at >= 0:
        kept = old[at:]
open(out, "w").write("\n".join(md) + kept)
print("\n".join(md))
PY
