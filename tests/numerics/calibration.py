"""Calibrates the bug-or-numerics verdict on engines whose fault is known (engines.py).

For each tiny random model (Llama, Qwen3: transformers' classes) and each engine, prompts drawn
from a seeded generator are screened by one fixed rule: a state is a dispute when the engine's
argmax differs from the reference's (transformers' eager bf16 forward, the oracle's logits). Each
dispute's envelope is computed by the product's own code (worker/hf/assay_numerics.py, as
`assay-hf-worker envelope` runs it) and classified by the product's own rule (`assay numerics
classify`, common/numerics.cpp). The legitimate engines are none of them a member of the
envelope. Prints the per-state confusion matrix per engine, and with --markdown FILE writes it.

Usage: calibration.py --assay PATH [--disputes N] [--max-prompts M] [--seeds S] [--threads T]
                      [--skip ENGINE ...] [--markdown FILE] [--check]

--check exits 1 unless the goals hold: at most 1% of every legitimate engine's disputes called
reference_decides, and at least 90% of the gross bug's.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "worker", "hf"))
import assay_numerics  # noqa: E402  the product's envelope
import engines  # noqa: E402

CLASSES = ["reference_decides", "numerically_tied", "neither"]


def batches(seed, vocab, rows=32):
    """Batches of `rows` prompts of one length (8..24 ids), from a seeded generator."""
    rng = random.Random(seed)
    while True:
        length = rng.randint(8, 24)
        yield [[rng.randrange(vocab) for _ in range(length)] for _ in range(rows)]


def assay_numerics_step(v):
    import math
    v = abs(v)
    return 2.0 ** -133 if v < 2.0 ** -126 else 2.0 ** (math.floor(math.log2(v)) - 7)


# A batched pass flags a prompt when the argmaxes differ there or the reference's top two are
# within this many bf16 steps; only flagged prompts get the single-row forwards that decide.
FLAG_STEPS = 16


def disputes_of(model, engine, want, max_prompts, threads, seed):
    """(disputes [(ids, reference argmax, engine argmax)], prompts screened). The rule: the
    engine's single-row argmax differs from the reference's single-row argmax."""
    found, screened = [], 0
    for rows in batches(seed, model.config.vocab_size):
        if len(found) >= want or screened >= max_prompts:
            break
        ref = engines.reference_logits_rows(model, rows, threads)
        got = engine.last_logits_rows(rows)
        top2 = ref.topk(2, dim=-1).values
        for i, ids in enumerate(rows):
            if len(found) >= want or screened >= max_prompts:
                break
            screened += 1
            top, second = top2[i, 0].item(), top2[i, 1].item()
            near = top - second <= FLAG_STEPS * assay_numerics_step(top)
            if not near and int(ref[i].argmax()) == int(got[i].argmax()):
                continue
            a = int(engines.reference_logits(model, ids, threads).argmax())
            b = int(engine.last_logits(ids).argmax())
            if a != b:
                found.append((ids, a, b))
    return found, screened


def envelope_of(model, fp32_model, dispute, name, spec, threads):
    ids, ref, got = dispute
    torch.set_num_threads(threads)
    state = {"index": 0, "input_token_ids": ids,
             "candidate_tokens": [{"engine": "reference", "token_id": ref},
                                  {"engine": name, "token_id": got}]}
    states, _ = assay_numerics.envelope(torch, model, [state], dict(spec, fp32=False), "cpu")
    candidates = sorted({ref, got})
    with torch.inference_mode():
        fp32 = fp32_model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    return {"members": states[0]["members"],
            "candidates": state["candidate_tokens"],
            "fp32": assay_numerics.figures("fp32", fp32, candidates),
            "policy": {"spread_factor": spec["spread_factor"],
                       "margin_steps": spec["margin_steps"]}}


def classify(assay, envelopes):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for e in envelopes:
            f.write(json.dumps(e) + "\n")
        path = f.name
    try:
        out = subprocess.run([assay, "numerics", "classify", path], check=True,
                             capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def run(args):
    spec = {"reduction_seeds": args.seeds, "batch_sizes": [4], "sdpa": True, "kv_cache": True,
            "spread_factor": 3.0, "margin_steps": 1.0}
    rows = {}
    started = time.monotonic()
    for arch_index, arch in enumerate(["llama", "qwen3"]):
        model = engines.make_model(arch, seed=1000 + arch_index)
        fp32_model = __import__("copy").deepcopy(model).float()
        for name in [n for n in engines.LEGITIMATE + engines.BUGGY if n not in args.skip]:
            engine = engines.Engine(name, model, args.threads)
            want = args.disputes // 2 + (args.disputes % 2 if arch_index == 0 else 0)
            found, screened = disputes_of(model, engine, want, args.max_prompts // 2,
                                          args.threads, seed=7919 * (arch_index + 1))
            envelopes = [envelope_of(model, fp32_model, d, name, spec, args.threads)
                         for d in found]
            verdicts = classify(args.assay, envelopes) if envelopes else []
            row = rows.setdefault(name, {"legitimate": engine.legitimate, "screened": 0,
                                         "disputes": 0, "fp32_picks_engine": 0,
                                         **{c: 0 for c in CLASSES}})
            row["screened"] += screened
            row["disputes"] += len(found)
            for d, v in zip(found, verdicts):
                row[v["class"]] += 1
                row["fp32_picks_engine"] += int(v["fp32"]["argmax"] == d[2])
            print(f"{arch:6} {name:13} screened {screened:5} disputes {len(found):4} "
                  f"{ {c: sum(1 for v in verdicts if v['class'] == c) for c in CLASSES} } "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    return rows, spec, time.monotonic() - started


def table(rows):
    lines = ["| engine | kind | prompts screened | disputes | reference_decides | "
             "numerically_tied | neither | reference_decides rate | fp32 argmax = engine's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        kind = "legitimate (held out)" if r["legitimate"] else \
            ("gross bug" if name == "position" else "subtle bug")
        rate = f"{100.0 * r['reference_decides'] / r['disputes']:.1f}%" if r["disputes"] else "-"
        lines.append(f"| {name} | {kind} | {r['screened']} | {r['disputes']} | "
                     f"{r['reference_decides']} | {r['numerically_tied']} | {r['neither']} | "
                     f"{rate} | {r['fp32_picks_engine']} |")
    return "\n".join(lines)


def goals(rows):
    """[(goal, met)]: the issue's per-state goals."""
    out = []
    for name, r in rows.items():
        if r["legitimate"] and r["disputes"]:
            out.append((f"{name}: at most 1% of {r['disputes']} disputes reference_decides",
                        r["reference_decides"] <= 0.01 * r["disputes"]))
    p = rows.get("position")
    if p and p["disputes"]:
        out.append((f"position (gross): at least 90% of {p['disputes']} disputes "
                    "reference_decides", p["reference_decides"] >= 0.9 * p["disputes"]))
    return out


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assay", required=True)
    parser.add_argument("--disputes", type=int, default=200, help="per engine, both models")
    parser.add_argument("--max-prompts", type=int, default=20000, help="per engine")
    parser.add_argument("--seeds", type=int, default=16, help="reduction members")
    parser.add_argument("--threads", type=int, default=1,
                        help="the reference's intra-op threads (one: a second thread stalls the "
                             "tiny models' GEMMs whenever another process holds a core)")
    parser.add_argument("--skip", action="append", default=[],
                        help="leave an engine out (compiled: inductor compiles each shape anew, "
                             "minutes on 2 cores)")
    parser.add_argument("--markdown")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv[1:])
    torch.use_deterministic_algorithms(True)
    rows, spec, seconds = run(args)
    print(table(rows))
    results = goals(rows)
    for goal, met in results:
        print(("met:    " if met else "MISSED: ") + goal)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table(rows) + "\n\n")
            f.write(f"Envelope: {json.dumps(spec)}; {seconds:.0f} s.\n\n")
            for goal, met in results:
                f.write(f"- {'met' if met else '**missed**'}: {goal}\n")
    return 0 if (not args.check or all(met for _, met in results)) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
