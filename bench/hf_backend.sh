#!/bin/bash
# Benchmark of issue 24 item 4: one next-token job's oracle through the transformers backend
# (assay-hf-worker next-token: Python, transformers' AutoModelForCausalLM) against the same input
# through assay-oracle next-token (libtorch, the C++ port), on the same fixture, same threads,
# interleaved in one run. Per worker process: wall time, peak RSS, load (start-up: interpreter,
# imports, weights) and forward seconds as each reports them; ratios of medians, transformers
# over libtorch. Also whether the two logits are bitwise equal. Then each worker resident
# (`serve`, driven as assayd drives it: bench/serve_repeat.py), interleaved: its load, and the
# wall of REPEATS repeat jobs on the loaded model against its own forward. The machine's CPU,
# ATEN_CPU_CAPABILITY and bf16 GEMM rate (1024^3, the same threads) are measured in the run.
#
#   bench/hf_backend.sh [BUILD_DIR] [RUNS] [REPEATS]     (default build, 3, 3)
# Environment: SIZE (small; tiny for a quick look), TOKENS (512), THREADS (2). Writes
# bench/hf_backend.md (or $OUT).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
runs=${2:-3}
repeats=${3:-3}
size=${SIZE:-small}
tokens=${TOKENS:-512}
threads=${THREADS:-2}
out=${OUT:-$here/bench/hf_backend.md}
python=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
work=${TMPDIR:-/tmp}/assay-bench-hf
model=$work/llama-$size
mkdir -p "$work"
for w in "$build/worker/assay-oracle" "$build/worker/assay-hf-worker"; do
  [ -x "$w" ] || { echo "no $w (build first)" >&2; exit 1; }
done
if [ ! -f "$model/model.safetensors" ]; then
  $python "$here/tests/fixtures/make_fixture.py" --arch llama --size "$size" --out "$model" --seed 1
fi
vocab=$($python -c "import json; print(json.load(open('$model/config.json'))['vocab_size'])")
$python - "$model" "$tokens" "$threads" "$vocab" >"$work/input.json" <<'PY'
import json, random, sys
model, tokens, threads, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
r = random.Random(512)
print(json.dumps({"schema": "assay.oracle-input.v1", "model_dir": model,
                  "input_token_ids": [r.randrange(vocab) for _ in range(tokens)],
                  "candidate_tokens": [{"engine": "a", "token_id": 65, "text": "A"},
                                       {"engine": "b", "token_id": 66, "text": "B"}],
                  "execution": {"device": "cpu", "dtype": "bfloat16", "threads": threads}}))
PY

measure() {  # name worker -> appends "wall rss_kb load forward logits_sha256" to $work/name.txt
  local name=$1 worker=$2 ws=$work/ws-$1
  rm -rf "$ws"; mkdir -p "$ws"
  (cd "$ws" && /usr/bin/time -f "%e %M" -o "$work/time.txt" "$worker" next-token \
    --input "$work/input.json" --workdir . >/dev/null 2>"$work/err.txt") ||
    { cat "$work/err.txt" >&2; exit 1; }
  read -r wall rss <"$work/time.txt"
  $python -c "
import json; o = json.load(open('$ws/output.json'))
print('$wall', '$rss', o['load_seconds'], o['forward_seconds'], o['logits_sha256'])" >>"$work/$name.txt"
}
rm -f "$work/libtorch.txt" "$work/transformers.txt" "$work/serve-libtorch.jsonl" "$work/serve-transformers.jsonl"
for _ in $(seq "$runs"); do
  measure libtorch "$build/worker/assay-oracle"
  measure transformers "$build/worker/assay-hf-worker"
done
for _ in $(seq "$runs"); do
  $python "$here/bench/serve_repeat.py" "$build/worker/assay-oracle" "$model" "$work/input.json" \
    "$work/serve-ws" "$repeats" >>"$work/serve-libtorch.jsonl"
  $python "$here/bench/serve_repeat.py" "$build/worker/assay-hf-worker" "$model" "$work/input.json" \
    "$work/serve-ws" "$repeats" >>"$work/serve-transformers.jsonl"
done

$python - "$work" "$out" "$size" "$tokens" "$threads" "$runs" "$repeats" <<'PY'
import json, platform, statistics, subprocess, sys, time
work, out, size, tokens, threads, runs, repeats = sys.argv[1:8]
def rows(name):
    return [line.split() for line in open(f"{work}/{name}.txt")]
med = lambda rs, i: statistics.median(float(r[i]) for r in rs)
lt, tf = rows("libtorch"), rows("transformers")
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
import torch
cap = torch.backends.cpu.get_cpu_capability()
torch.set_num_threads(int(threads))
a, b = torch.randn(1024, 1024).to(torch.bfloat16), torch.randn(1024, 1024).to(torch.bfloat16)
torch.matmul(a, b)
best = float("inf")
for _ in range(3):
    t0 = time.perf_counter(); torch.matmul(a, b); best = min(best, time.perf_counter() - t0)
gflops = 2 * 1024 ** 3 / best / 1e9
serve = {n: [json.loads(l) for l in open(f"{work}/serve-{n}.jsonl")] for n in ("libtorch", "transformers")}
smed = lambda n, k: statistics.median(x for d in serve[n] for x in (d[k] if isinstance(d[k], list) else [d[k]]))
served = {h for n in serve for d in serve[n] for h in d["logits_sha256"]}
same = {r[4] for r in lt} == {r[4] for r in tf} and len({r[4] for r in lt}) == 1 and served == {lt[0][4]}
lines = [
    "# transformers backend vs assay-oracle (issue 24 item 4)", "",
    f"`bench/hf_backend.sh`, {runs} interleaved runs each, llama `{size}` fixture, T = {tokens}, "
    f"{threads} threads, bf16, CPU. Machine: {cpu}, ATEN_CPU_CAPABILITY {cap}, "
    f"{platform.machine()}, bf16 GEMM (1024^3, {threads} threads) {gflops:.0f} GFLOP/s in this run. "
    f"Baseline: assay-oracle (libtorch) in the same run.", "",
    "## A job in a worker of its own (cold)", "",
    "| worker | wall s (median) | peak RSS MiB | load s | forward s |", "|---|---|---|---|---|",
]
for name, rs in (("assay-oracle (libtorch)", lt), ("assay-hf-worker (transformers)", tf)):
    lines.append(f"| {name} | {med(rs,0):.2f} | {med(rs,1)/1024:.0f} | {med(rs,2):.2f} | "
                 f"{med(rs,3):.3f} |")
lines += ["", f"Ratios, transformers / libtorch: wall {med(tf,0)/med(lt,0):.2f}x, peak RSS "
          f"{med(tf,1)/med(lt,1):.2f}x, load {med(tf,2)/med(lt,2):.2f}x, forward "
          f"{med(tf,3)/med(lt,3):.2f}x.", "",
          "## Repeat jobs on a resident worker (`serve`)", "",
          f"{runs} interleaved worker starts each, {repeats} jobs per start; a job's wall is from "
          "\"run\" to \"done\" on the control socket (bench/serve_repeat.py).", "",
          "| worker | load s (median) | repeat job s (median) | its forward s (median) | job / forward |",
          "|---|---|---|---|---|"]
for name, n in (("assay-oracle serve", "libtorch"), ("assay-hf-worker serve", "transformers")):
    lines.append(f"| {name} | {smed(n,'load_seconds'):.2f} | {smed(n,'job_seconds'):.3f} | "
                 f"{smed(n,'forward_seconds'):.3f} | {smed(n,'job_seconds')/smed(n,'forward_seconds'):.2f}x |")
lines += ["", f"Ratios, transformers / libtorch, resident: repeat job "
          f"{smed('transformers','job_seconds')/smed('libtorch','job_seconds'):.2f}x, load "
          f"{smed('transformers','load_seconds')/smed('libtorch','load_seconds'):.2f}x.", "",
          f"Logits bitwise equal across backends, runs and resident jobs: {'yes' if same else 'NO'} "
          f"({lt[0][4]}).", ""]
open(out, "w").write("\n".join(lines))
print("\n".join(lines))
PY
