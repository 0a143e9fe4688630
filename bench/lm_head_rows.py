#!/usr/bin/env python3
"""Is the LM head of the last hidden row alone bitwise the last row of the LM head over all rows?

Issue 37 asked for the oracle's LM head on the rows a job needs only (a next-token job needs the
last). The reference's contract is bitwise equality with transformers' eager forward, which
computes the LM head over every position (logits_to_keep=0, its default); a GEMM with one row may
take another kernel or another reduction order than one with T rows. This script measures it on
this machine for the dtypes and the shapes assay serves (the small fixtures' and Qwen3-4B's hidden
size and vocabulary), with torch's deterministic algorithms and 2 threads as the oracle runs, and
writes bench/lm_head_rows.md.

usage: bench/lm_head_rows.py [OUT.md]   (run with the project's venv: /opt/assay/venv/bin/python)
"""
import datetime
import os
import platform
import sys
import time

import torch

SHAPES = [(64, 1000), (256, 4096), (2560, 151936)]  # (hidden, vocab)
ROWS = [2, 7, 42, 128, 513]


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def gemm_rate():
    """bf16 GFLOP/s of a 4096^3 matmul on this run's threads (the machine's GEMM limit)."""
    a = torch.randn(4096, 4096).to(torch.bfloat16)
    b = torch.randn(4096, 4096).to(torch.bfloat16)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * 4096**3 / best / 1e9


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "lm_head_rows.md")
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for hidden, vocab in SHAPES:
            w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(dtype)
            for t in ROWS:
                if hidden >= 2560 and t > 128:
                    continue
                h = torch.randn(1, t, hidden, generator=g).to(dtype)
                with torch.inference_mode():
                    full = torch.nn.functional.linear(h, w)[0, -1]
                    last = torch.nn.functional.linear(h[:, -1:], w)[0, -1]
                differ = int((full != last).sum())
                diff = (full.float() - last.float()).abs().max().item()
                rows.append((str(dtype).split(".")[1], hidden, vocab, t, differ, diff))
    rate = gemm_rate()
    flop = 2 * 42 * 2560 * 151936
    unequal = sum(1 for r in rows if r[4])
    table = "\n".join(f"| {d} | {h} | {v} | {t} | {n} | {x:.3g} |" for d, h, v, t, n, x in rows)
    text = f"""# The LM head on the last row alone (issue 37, item 3)

`bench/lm_head_rows.py`: for each dtype and shape, the last row of `linear(h[1, T, hidden], W)`
against `linear(h[:, -1:], W)`, deterministic algorithms, 2 threads.

Last run: {datetime.datetime.utcnow().strftime('%Y-%m-%d %H:%M UTC')}; CPU {cpu_model()},
`ATEN_CPU_CAPABILITY` {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__},
bf16 GEMM limit {rate:.0f} GFLOP/s (4096^3, 2 threads, same run).

**{unequal} of {len(rows)} cases differ in at least one logit.** The oracle therefore keeps the LM
head over every position for a next-token job: its contract is bitwise equality with
transformers' eager forward, which computes every position's logits, and one row alone is not
the same arithmetic on this CPU. (Its cost at the 4B shape is 2 * T * 2560 * 151936 FLOP:
{flop / 1e9:.0f} GFLOP at T = 42, {flop / 1e9 / rate:.2f} s at this machine's GEMM limit.)

| dtype | hidden | vocab | T | logits that differ | max abs difference |
|---|---|---|---|---|---|
{table}
"""
    with open(out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
