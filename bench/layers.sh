#!/usr/bin/env bash
# Issue 26's benchmark, through a real assayd (same machine, one run): what a layer-attribution
# job costs against one next-token job on the same model and ids:
#   - next-token job (the baseline: fingerprint + one oracle forward);
#   - layer job, rows "last" (fingerprint + one forward keeping every boundary's last row +
#     the comparison);
#   - layer job, rows "all" with patching (the same, all positions, plus one forward per
#     boundary with the engine's rows substituted there).
# Cases: the small llama fixture at T=128, and the Qwen3-4B-shaped checkpoint (8 GB, kept in
# /var/tmp/assay-bench-qwen3-4b between runs, as bench/oracle_vs_hf.sh keeps it) at T=42.
# The engine's rows are the reference's own (from `assay-oracle layers`), so nothing departs:
# the cost does not depend on the values.
# Usage: bench/layers.sh [--build DIR] [--no-4b]   (CONTAINMENT=auto|none) Writes bench/layers.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build
big=1
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$(cd "$2" && pwd); shift 2 ;;
    --no-4b) big=0; shift ;;
    *) echo "usage: $0 [--build DIR] [--no-4b]" >&2; exit 2 ;;
  esac
done
py=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
containment=${CONTAINMENT:-auto}
for b in "$build/supervisor/assayd" "$build/fingerprint/assay-fingerprint" \
  "$build/worker/assay-oracle" "$build/compare/assay-compare"; do
  [ -x "$b" ] || { echo "missing $b" >&2; exit 2; }
done
work=$(mktemp -d /var/tmp/assay-layers-bench.XXXXXX)
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

"$py" "$root/tests/fixtures/make_fixture.py" --arch llama --size small --out "$work/small" >/dev/null
cases=("small:$work/small:128")
if [ "$big" = 1 ]; then
  qwen=/var/tmp/assay-bench-qwen3-4b
  [ -f "$qwen/config.json" ] ||
    "$py" "$root/tests/fixtures/make_fixture.py" --arch qwen3 --size 4b --shards 4 --seed 0 --out "$qwen" >/dev/null
  cases+=("qwen3-4b:$qwen:42")
fi

"$build/supervisor/assayd" serve --socket "$work/sock" --state-dir "$work/state" \
  --containment "$containment" --fingerprint-worker "$build/fingerprint/assay-fingerprint" \
  --oracle-worker "$build/worker/assay-oracle" --compare-worker "$build/compare/assay-compare" \
  >"$work/assayd.log" 2>&1 &
pid=$!

"$py" - "$work" "$build/worker/assay-oracle" "${cases[@]}" <<'PY' >"$work/rows.jsonl"
import hashlib, http.client, json, os, random, socket, subprocess, sys, time
import numpy as np
from safetensors.numpy import load_file, save_file

work, oracle, cases = sys.argv[1], sys.argv[2], sys.argv[3:]

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

def run(doc):
    t0 = time.monotonic()
    st, j = call("POST", "/v1/jobs", doc)
    assert st == 201, j
    while True:
        s = call("GET", "/v1/jobs/" + j["id"])[1]
        if s["state"] in ("succeeded", "failed", "cancelled"): break
        time.sleep(0.05)
    wall = time.monotonic() - t0
    if s["state"] != "succeeded": sys.exit("job %s: %s" % (doc["id"], json.dumps(s)[:2000]))
    return wall, call("GET", "/v1/jobs/%s/result" % j["id"])[1]

def sha(path):
    return "sha256:" + hashlib.sha256(open(path, "rb").read()).hexdigest()

for case in cases:
    name, model, t = case.split(":"); t = int(t)
    rng = random.Random(26)
    ids = [rng.randint(65, 90) for _ in range(t)]
    nt = {"schema": "assay.next-token-request.v1", "model_dir": model, "input_token_ids": ids,
          "candidates": [{"engine": "a", "token_id": 65, "text": "A"},
                         {"engine": "b", "token_id": 66, "text": "B"}]}
    run(dict(nt, id=name + "-warm", input_token_ids=ids[:-1]))  # page cache and fingerprint cache
    # The engine's rows: the reference's own, all positions, and their last rows.
    ws = os.path.join(work, name + "-rows"); os.makedirs(ws)
    json.dump({"schema": "assay.oracle-layers-input.v1", "model_dir": model, "token_ids": ids,
               "rows": "all", "execution": {"device": "cpu", "dtype": "bfloat16", "threads": 2}},
              open(ws + "/input.json", "w"))
    subprocess.run([oracle, "layers", "--input", ws + "/input.json", "--workdir", ws], check=True)
    rows = load_file(ws + "/layers.safetensors")
    save_file({k: np.ascontiguousarray(v[-1:]) for k, v in rows.items()}, ws + "/last.safetensors")
    os.chmod(ws, 0o755)
    for f in ("layers.safetensors", "last.safetensors"): os.chmod(os.path.join(ws, f), 0o644)
    def layer(kind, path, patching, tag, token):
        engine = {"name": "engine", "rows_file": {"path": path, "sha256": sha(path)}}
        if token is not None: engine["next_token_id"] = token
        # patch_search "every": this bench measures one patched forward per boundary (bisection,
        # the default, skips every boundary of an all-bitwise engine: bench/layers_operators.sh).
        return run({"schema": "assay.layer-attribution-request.v1", "id": name + "-" + kind + tag,
                    "model_dir": model, "input_token_ids": ids, "rows": kind, "engine": engine,
                    "patching": patching, "patch_search": "every"})
    # The short jobs twice each, alternating, the faster kept (a VM's first touch of memory
    # freed a while ago can cost seconds); the patching job once.
    nt_runs, last_runs = [], []
    for k in range(2):
        nt_runs.append(run(dict(nt, id="%s-next-token-%d" % (name, k))))
        last_runs.append(layer("last", ws + "/last.safetensors", False, "-%d" % k, None))
    nt_wall, nt_result = min(nt_runs, key=lambda r: r[0])
    last_wall, last = min(last_runs, key=lambda r: r[0])
    all_wall, full = layer("all", ws + "/layers.safetensors", True, "",
                           nt_result["oracle"]["argmax"])
    print(json.dumps({
        "case": name, "T": t, "boundaries": len(full["boundaries"]),
        "next_token": nt_wall, "layers_last": last_wall, "layers_all_patching": all_wall,
        "next_token_runs": [r[0] for r in nt_runs], "layers_last_runs": [r[0] for r in last_runs],
        "next_token_forward": nt_result["oracle"]["forward_seconds"],
        "last_forward": last["reference"]["output"]["forward_seconds"],
        "patching_seconds": full["patching"]["seconds"], "forwards": full["patching"]["forwards"],
        "all_bitwise": full["first_non_bitwise"] is None and last["first_non_bitwise"] is None,
        "patched_not_reference": [b["name"] for b in full["patching"]["boundaries"]
                                  if not b["becomes_candidate"]],
        "patched_logits_are_reference": all(
            b["logits_sha256"] == full["reference"]["logits_sha256"]
            for b in full["patching"]["boundaries"]),
        "logits_equal": last["reference"]["logits_sha256"] == nt_result["oracle"]["logits_sha256"],
        "peak_rss": {"next_token": nt_result["oracle"]["peak_rss_bytes"],
                     "last": last["reference"]["output"]["peak_rss_bytes"],
                     "all": full["reference"]["output"]["peak_rss_bytes"]}}), flush=True)
PY

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
cap=$("$py" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')
"$py" - "$work/rows.jsonl" "$cpu" "$cap" "$root/bench/layers.md" <<'PY'
import json, sys, datetime
rows = [json.loads(l) for l in open(sys.argv[1])]
cpu, cap, out = sys.argv[2], sys.argv[3], sys.argv[4]
lines = ["# Layer attribution against one next-token job (`bench/layers.sh`)", "",
         "Same run, through assayd (containment as configured), 2 threads per worker; wall from "
         "submission to the terminal state, the fingerprint cache warm (a warm-up job first); "
         "next-token and last-rows jobs the faster of two alternating runs, the patching job one run. "
         "Ratios are against the next-token job on the same model and ids.", "",
         f"CPU: {cpu}; `ATEN_CPU_CAPABILITY` {cap}; measured {datetime.date.today()}.", "",
         "| case | T | boundaries | next-token job (s) | layer job, last rows (s) | **ratio** | "
         "layer job, all rows + patching (s) | **ratio** | patching forwards / s | "
         "oracle peak RSS next-token / last / all (GB) | logits equal | all bitwise | "
         "patched logits = reference's |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    rss = r["peak_rss"]
    lines.append(
        f"| {r['case']} | {r['T']} | {r['boundaries']} | {r['next_token']:.2f} | "
        f"{r['layers_last']:.2f} | **{r['layers_last'] / r['next_token']:.2f}x** | "
        f"{r['layers_all_patching']:.2f} | **{r['layers_all_patching'] / r['next_token']:.2f}x** | "
        f"{r['forwards']} / {r['patching_seconds']:.2f} | "
        f"{rss['next_token'] / 1e9:.2f} / {rss['last'] / 1e9:.2f} / {rss['all'] / 1e9:.2f} | "
        f"{'yes' if r['logits_equal'] else 'NO'} | {'yes' if r['all_bitwise'] else 'NO'} | "
        f"{'yes' if r['patched_logits_are_reference'] else 'NO'} |")
lines += ["", "Raw rows:", "", "```"] + [json.dumps(r) for r in rows] + ["```", ""]
# What is written by hand below the rows (the reading, operator-level rows) stays, marked as
# written for an earlier run.
try:
    before = open(out).read()
except FileNotFoundError:
    before = ""
if "\n## " in before:
    kept = before[before.index("\n## ") + 1:]
    if not kept.startswith("(Written for an earlier run"):
        kept = "(Written for an earlier run; the rows above are newer.)\n\n" + kept
    lines += [kept.rstrip("\n"), ""]
open(out, "w").write("\n".join(lines))
print("\n".join(lines))
PY
