#!/usr/bin/env bash
# Issue 38's benchmark, through a real assayd (same machine, one run): operator-level rows.
#   - the capture's cost: a layer job whose engine file holds every boundary, operators included
#     (rows "last", and rows "all"), against a next-token job on the same model and ids (the
#     faster of two alternating runs each);
#   - patching's search: an engine with a real departure in the middle of the model (transformers
#     with layer L's attention output scaled by the first of 1.25, 2, 4, ... that changes its
#     token, captured with the kit, clients/capture), its
#     rows at every boundary; the job with patch_search "bisect" against "every" (one forward per
#     boundary). The forwards are counted by the oracle; "every" on the 4B-shaped checkpoint would
#     run one partial forward per boundary for hours on a 2-core machine, so there it is not run
#     unless --every-4b is given: its count is the number of boundaries given (as the small case
#     measures) and its time is modelled from the bisect run's own per-forward seconds.
# Cases: the small llama fixture at T=128; the Qwen3-4B-shaped checkpoint (/var/tmp/
# assay-bench-qwen3-4b, made on first use as bench/layers.sh makes it) at T=--4b-tokens (default 4:
# a 2-core AVX2 machine's bf16 GEMM runs at about 1 GFLOP/s). The engine's rows are captured
# with transformers first and its model freed before the jobs run, so that the two 8 GB copies
# never share the memory.
# Usage: bench/layers_operators.sh [--build DIR] [--no-4b] [--4b-tokens T] [--every-4b]
# Writes bench/layers_operators.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build
big=1
big_t=4
every_big=0
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$(cd "$2" && pwd); shift 2 ;;
    --no-4b) big=0; shift ;;
    --4b-tokens) big_t=$2; shift 2 ;;
    --every-4b) every_big=1; shift ;;
    *) echo "usage: $0 [--build DIR] [--no-4b] [--4b-tokens T] [--every-4b]" >&2; exit 2 ;;
  esac
done
py=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
containment=${CONTAINMENT:-auto}
for b in "$build/supervisor/assayd" "$build/fingerprint/assay-fingerprint" \
  "$build/worker/assay-oracle" "$build/compare/assay-compare"; do
  [ -x "$b" ] || { echo "missing $b" >&2; exit 2; }
done
work=$(mktemp -d /var/tmp/assay-operators-bench.XXXXXX)
chmod 755 "$work"
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

"$py" "$root/tests/fixtures/make_fixture.py" --arch llama --size small --out "$work/small" >/dev/null
cases=("small:$work/small:128:1")
if [ "$big" = 1 ]; then
  qwen=/var/tmp/assay-bench-qwen3-4b
  [ -f "$qwen/config.json" ] ||
    "$py" "$root/tests/fixtures/make_fixture.py" --arch qwen3 --size 4b --shards 4 --seed 0 --out "$qwen" >/dev/null
  cases+=("qwen3-4b:$qwen:$big_t:$every_big")
fi

# Workers may run 2 h: one forward per boundary on the 4B checkpoint outlasts the default 600 s.
echo '{"worker_timeout_seconds": 7200}' >"$work/assayd.json"
"$build/supervisor/assayd" serve --config "$work/assayd.json" --socket "$work/sock" --state-dir "$work/state" \
  --containment "$containment" --fingerprint-worker "$build/fingerprint/assay-fingerprint" \
  --oracle-worker "$build/worker/assay-oracle" --compare-worker "$build/compare/assay-compare" \
  >"$work/assayd.log" 2>&1 &
pid=$!

PYTHONPATH="$root/clients/capture:$root/clients/python" "$py" - "$work" "${cases[@]}" <<'PY' >"$work/rows.jsonl"
import json, os, random, sys, time
import torch, transformers
from assay_capture import Capture
from assay_client import Client, AssayError

work, cases = sys.argv[1], sys.argv[2:]
client = Client(work + "/sock")
for _ in range(200):
    try:
        client.health(); break
    except AssayError:
        time.sleep(0.05)

def run(doc):
    t0 = time.monotonic()
    job = client.wait(client.submit(doc).id, timeout=36000)
    wall = time.monotonic() - t0
    if job.state != "succeeded":
        sys.exit("job %s: %s" % (doc["id"], json.dumps(job.raw)[:2000]))
    return wall, client.result(job.id)

torch.set_num_threads(2)
torch.use_deterministic_algorithms(True)
for case in cases:
    name, model_dir, t, every_runs = case.split(":"); t = int(t)
    rng = random.Random(38)
    ids = [rng.randint(65, 90) for _ in range(t)]
    nt = {"schema": "assay.next-token-request.v1", "model_dir": model_dir, "input_token_ids": ids,
          "candidates": [{"engine": "a", "token_id": 65, "text": "A"},
                         {"engine": "b", "token_id": 66, "text": "B"}]}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()
    def capture(path, rows, scale_layer=None, scale=1.0):
        undo = None
        if scale_layer is not None:
            o_proj = model.model.layers[scale_layer].self_attn.o_proj
            undo = o_proj.register_forward_pre_hook(lambda m, a: (a[0] * scale,)).remove
        cap = Capture(model, layout="transformers")
        try:
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            digest = cap.write(path, ids, rows=rows)
        finally:
            cap.close()
            if undo: undo()
        os.chmod(path, 0o644)
        return digest, int(torch.argmax(logits.float()))
    def layer(tag, path, digest, rows, patching=False, token=None, search="bisect"):
        engine = {"name": "engine", "rows_file": {"path": path, "sha256": digest}}
        if token is not None: engine["next_token_id"] = token
        return run({"schema": "assay.layer-attribution-request.v1", "id": name + "-" + tag,
                    "model_dir": model_dir, "input_token_ids": ids, "rows": rows,
                    "engine": engine, "patching": patching, "patch_search": search,
                    "limits": {"timeout_seconds": 7200}})
    last = capture(work + f"/{name}-last.safetensors", "last")
    full = capture(work + f"/{name}-all.safetensors", "all")
    # The departure: layer L = layers // 2 of the engine has its attention output scaled, by the
    # first of a fixed list of factors that changes the engine's token (patching then has a
    # flip to find); every boundary from there on is the engine's own.
    layers = model.config.num_hidden_layers
    path = work + f"/{name}-departed.safetensors"
    for scale in (1.25, 2.0, 4.0, 8.0, 16.0, 32.0):
        digest, token = capture(path, "all", scale_layer=layers // 2, scale=scale)
        if token != full[1]:
            break
    else:
        sys.exit(f"{name}: no scale of layer {layers // 2}'s attention output changes the token")
    del model
    import gc; gc.collect()
    run(dict(nt, id=name + "-warm", input_token_ids=ids[:-1]))
    nt_runs, last_runs, all_runs = [], [], []
    for k in range(2):
        nt_runs.append(run(dict(nt, id="%s-next-token-%d" % (name, k))))
        last_runs.append(layer("last-%d" % k, work + f"/{name}-last.safetensors", last[0], "last"))
        all_runs.append(layer("all-%d" % k, work + f"/{name}-all.safetensors", full[0], "all"))
    nt_wall, nt_result = min(nt_runs, key=lambda r: r[0])
    last_wall, last_result = min(last_runs, key=lambda r: r[0])
    all_wall, all_result = min(all_runs, key=lambda r: r[0])
    bisect_wall, bisect = layer("bisect", path, digest, "all", True, token, "bisect")
    every = None
    if every_runs == "1":
        every_wall, every = layer("every", path, digest, "all", True, token, "every")
    p = bisect["patching"]
    computed = [b for b in p["boundaries"] if b["computed"]]
    given = bisect["engine"]["boundaries_given"]
    # "every" modelled: a patched forward runs from its boundary's layer to the end, so it costs
    # a + b x (layers it runs), a and b fitted (least squares) to the bisect run's own forwards.
    def layers_run(n):
        if n.startswith("layers."):
            return layers - int(n.split(".")[1])
        return layers if n == "embedding" else 0
    xs = [layers_run(b["name"]) for b in computed]
    ys = [b["seconds"] for b in computed]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else my / max(mx, 1)
    fixed = my - slope * mx if var else 0.0
    modelled = sum(fixed + slope * layers_run(b["name"]) for b in bisect["boundaries"])
    print(json.dumps({
        "case": name, "T": t, "boundaries": len(bisect["boundaries"]),
        "operators": bisect["engine"]["operators_given"], "given": given,
        "next_token": nt_wall, "layers_last_operators": last_wall,
        "layers_all_operators": all_wall,
        "next_token_runs": [r[0] for r in nt_runs], "last_runs": [r[0] for r in last_runs],
        "all_runs": [r[0] for r in all_runs],
        "all_bitwise": last_result["first_non_bitwise"] is None and
                       all_result["first_non_bitwise"] is None,
        "logits_equal": last_result["reference"]["logits_sha256"] ==
                        all_result["reference"]["logits_sha256"] ==
                        nt_result["oracle"]["logits_sha256"],
        "peak_rss": {"next_token": nt_result["oracle"]["peak_rss_bytes"],
                     "last": last_result["reference"]["output"]["peak_rss_bytes"],
                     "all": all_result["reference"]["output"]["peak_rss_bytes"]},
        "departed_at": (bisect["first_non_bitwise"] or {}).get("name"),
        "engine_token": token, "reference_token": bisect["reference"]["argmax_token_id"],
        "scale": scale, "fit_seconds": {"per_forward": fixed, "per_layer": slope},
        "bisect_job": bisect_wall, "bisect_forwards": p["forwards"],
        "bisect_seconds": p["seconds"], "bisect_first_flip": (p["first_flip"] or {}).get("name"),
        "every_forwards": every["patching"]["forwards"] if every else None,
        "every_seconds": every["patching"]["seconds"] if every else None,
        "every_job": every_wall if every else None,
        "every_first_flip": (every["patching"]["first_flip"] or {}).get("name") if every else None,
        "every_modelled_seconds": modelled}), flush=True)
PY

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
cap=$("$py" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')
gemm=$("$py" -c '
import time, torch
torch.set_num_threads(2)
a = torch.randn(1024, 1024, dtype=torch.bfloat16); b = torch.randn(1024, 1024, dtype=torch.bfloat16)
a @ b; t = time.perf_counter(); n = 0
while time.perf_counter() - t < 2: a @ b; n += 1
print("%.1f" % (2 * 1024 ** 3 * n / (time.perf_counter() - t) / 1e9))')
"$py" - "$work/rows.jsonl" "$cpu" "$cap" "$gemm" "$root/bench/layers_operators.md" <<'PY'
import json, sys, datetime
rows = [json.loads(l) for l in open(sys.argv[1])]
cpu, cap, gemm, out = sys.argv[2:6]
f = lambda v: "—" if v is None else ("%.2f" % v if isinstance(v, float) else str(v))
lines = ["# Operator-level rows: capture cost and patching's search (`bench/layers_operators.sh`)", "",
         "Same run, through assayd (containment as configured), 2 threads per worker; wall from "
         "submission to the terminal state, the fingerprint cache warm. The capture rows: the engine "
         "file holds every boundary, operators included (transformers captured with clients/capture; "
         "bitwise the reference's), the faster of two alternating runs, ratio against the next-token "
         "job on the same model and ids. The search rows: an engine whose layer L = layers/2 "
         "attention output (o_proj's input) is scaled, rows at every boundary; forwards as the "
         "oracle counts them. The scale is the first of 1.25, 2, 4, ... that changes the engine's token. \"every, "
         "modelled\" sums a + b x (layers run) over the boundaries, a and b fitted to the bisect "
         "run's own forwards (on the small case it stands beside the measured time).", "",
         f"CPU: {cpu}; `ATEN_CPU_CAPABILITY` {cap}; 2-thread bf16 GEMM (1024^3) {gemm} GFLOP/s; "
         f"measured {datetime.date.today()}.", "",
         "| case | T | boundaries (operators) | next-token job (s) | all operators, last rows (s) | "
         "**ratio** | all operators, all rows (s) | **ratio** | oracle peak RSS next-token / last / all (GB) "
         "| logits equal | all bitwise |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    rss = r["peak_rss"]
    lines.append(
        f"| {r['case']} | {r['T']} | {r['boundaries']} ({r['operators']}) | {r['next_token']:.2f} | "
        f"{r['layers_last_operators']:.2f} | **{r['layers_last_operators'] / r['next_token']:.2f}x** | "
        f"{r['layers_all_operators']:.2f} | **{r['layers_all_operators'] / r['next_token']:.2f}x** | "
        f"{rss['next_token'] / 1e9:.2f} / {rss['last'] / 1e9:.2f} / {rss['all'] / 1e9:.2f} | "
        f"{'yes' if r['logits_equal'] else 'NO'} | {'yes' if r['all_bitwise'] else 'NO'} |")
lines += ["", "| case | first non-bitwise | engine / reference token | boundaries given | bisect: "
          "forwards, s (first flip) | every: forwards, s (first flip) | **forwards ratio** | every, "
          "modelled s |", "|---|---|---|---|---|---|---|---|"]
for r in rows:
    every_n = r["every_forwards"] if r["every_forwards"] is not None else r["given"]
    lines.append(
        f"| {r['case']} | {r['departed_at']} | {r['engine_token']} / {r['reference_token']} | "
        f"{r['given']} | {r['bisect_forwards']}, {r['bisect_seconds']:.2f} ({r['bisect_first_flip']}) | "
        + (f"{r['every_forwards']}, {r['every_seconds']:.2f} ({r['every_first_flip']})"
           if r["every_forwards"] is not None else f"not run ({r['given']} by definition)")
        + f" | **{every_n / max(1, r['bisect_forwards']):.1f}x fewer** | "
        f"{r['every_modelled_seconds']:.0f} |")
lines += ["", "Raw rows:", "", "```"] + [json.dumps(r) for r in rows] + ["```", ""]
# A reading written by hand below the rows stays, marked as the reading of an earlier run.
try:
    before = open(out).read()
except FileNotFoundError:
    before = ""
if "\n## Reading" in before:
    kept = before[before.index("\n## Reading") + 1:]
    if not kept.startswith("## Reading (an earlier run"):
        kept = kept.replace("## Reading", "## Reading (an earlier run; the rows above are newer)", 1)
    lines += [kept.rstrip("\n"), ""]
open(out, "w").write("\n".join(lines))
print("\n".join(lines))
PY
