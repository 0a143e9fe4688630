#!/opt/assay/venv/bin/python
"""Two builds of assay-oracle against each other on the same checkpoint, interleaved.

    oracle_ab.py --a NAME=BIN --b NAME=BIN --model DIR --lengths 42,1024 [--repeat 3]
                 [--threads N] [--rest S] [--gemm-size N] --out MD

For each length T and each repeat, A then B run `assay-oracle logits --verbose` in fresh
processes over the same T seeded ids (the page cache warmed first, S s of rest before each run,
default 3; after 15 s a VM with free page reporting has handed the freed memory to its host):
wall from outside, load/forward/total as the oracle reports them (total includes waiting for
its weight digests, which every output waits for). The logits files of A and B must be equal
byte for byte. Reports per T the fastest run of each side and the ratio B/A, with this CPU's
model, ATen's CPU capability and the bf16 GEMM rate of the same run. Built for decisions inside
the oracle (first: hashing the weights as they are read against hashing them on a thread of
their own during the forward, bench/oracle_hashing.md).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_vs_hf import gemm_gflops, warm_page_cache  # noqa: E402


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def run(binary, model, ids, out, threads):
    t = time.perf_counter()
    r = subprocess.run([binary, "logits", "--model", model, "--token-ids", ",".join(map(str, ids)),
                        "--out", out, "--threads", str(threads), "--verbose"],
                       capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"{binary} failed: {r.stderr[-2000:]}")
    fields = {}
    for line in r.stderr.splitlines():
        if "load_seconds=" in line:
            for item in line.split(":", 1)[1].split():
                k, v = item.split("=")
                fields[k] = float(v)
    return dict(fields, wall=wall)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="NAME=BIN, the baseline")
    p.add_argument("--b", required=True, help="NAME=BIN")
    p.add_argument("--model", required=True)
    p.add_argument("--lengths", default="42,1024")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rest", type=float, default=3, help="seconds between runs")
    p.add_argument("--gemm-size", type=int, default=4096,
                   help="N of the N^3 bf16 GEMM measured (1024 where bf16 is emulated)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    sides = [tuple(s.split("=", 1)) for s in (args.a, args.b)]
    for name, binary in sides:
        if not os.access(binary, os.X_OK):
            sys.exit(f"--{name}: {binary} is not an executable")
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    gemm = gemm_gflops(torch.bfloat16, args.threads, size=args.gemm_size)
    warm_page_cache(args.model)
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    vocab = config.get("text_config", config)["vocab_size"]
    rows, log = [], []
    for t in (int(x) for x in args.lengths.split(",")):
        rng = random.Random(0)
        # [1000, 100000) where the vocabulary has it (the recorded 4B run's ids), else within it.
        ids = [rng.randrange(min(1000, vocab // 2), min(100000, vocab)) for _ in range(t)]
        best = {}
        for rep in range(args.repeat):
            outs = []
            for name, binary in sides:
                out = f"/tmp/oracle-ab-{os.getpid()}-{name}.safetensors"
                time.sleep(args.rest)
                r = run(binary, args.model, ids, out, args.threads)
                log.append(f"T={t} run {rep + 1} {name}: wall {r['wall']:.2f} s, load "
                           f"{r['load_seconds']:.2f}, forward {r['forward_seconds']:.2f}, total "
                           f"{r['total_seconds']:.2f}")
                print(log[-1], flush=True)
                if name not in best or r["wall"] < best[name]["wall"]:
                    best[name] = r
                outs.append(out)
            with open(outs[0], "rb") as fa, open(outs[1], "rb") as fb:
                if fa.read() != fb.read():
                    sys.exit(f"T={t}: the logits of {sides[0][0]} and {sides[1][0]} differ")
            for out in outs:
                os.unlink(out)
        a, b = (best[name] for name, _ in sides)
        rows.append((t, a, b))
    (an, abin), (bn, bbin) = sides
    lines = [f"# `{bn}` against `{an}`: two assay-oracle builds (`bench/oracle_ab.py`)", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. CPU: {cpu_model()}, "
             f"{args.threads} threads; `ATEN_CPU_CAPABILITY` {capability}; bf16 GEMM ({args.gemm_size}^3, "
             f"same run) **{gemm:.1f} GFLOP/s**. Model: `{args.model}`. Each side the fastest of "
             f"{args.repeat} runs, interleaved A, B, {args.rest:g} s of rest before each; logits "
             f"byte-equal in every pair.", "",
             f"| T | wall {an} (s) | wall {bn} (s) | **{bn} / {an}** | load {an} / {bn} (s) | "
             f"forward {an} / {bn} (s) |", "|---|---|---|---|---|---|"]
    for t, a, b in rows:
        lines.append(f"| {t} | {a['wall']:.2f} | {b['wall']:.2f} | **{b['wall'] / a['wall']:.2f}x** | "
                     f"{a['load_seconds']:.2f} / {b['load_seconds']:.2f} | "
                     f"{a['forward_seconds']:.2f} / {b['forward_seconds']:.2f} |")
    lines += ["", "Every run, in order:", "", "```", *log, "```", ""]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
