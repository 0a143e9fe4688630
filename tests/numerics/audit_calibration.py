"""Calibrates the engine audit on engines whose fault is known (engines.py).

For each tiny random model (Llama, Qwen3: transformers' classes, logit std 5) and each of P
panels (N contexts of L ids from a seeded generator), the product's own code measures the panel
(worker/hf/assay_numerics.py `audit`, as `assay-hf-worker audit` runs it: the float32 anchor, the
reference, K seeded reduction orders and SDPA at every position) against every engine's logits at
every position, and the product's own statistic (`assay numerics audit`, common/audit.cpp) tests
each engine. The legitimate engines are none of them a member of the audit. Reported per engine:
the panels flagged beyond_legitimate at the full panel (for a legitimate engine, false alarms),
the median ratio and its interval, and for each panel the fewest positions (a prefix of its
contexts: 4, 8, 12, ... of them) at which the test first has p < alpha.

Usage: audit_calibration.py --assay PATH [--panels P] [--contexts N] [--length L] [--seeds K]
                            [--archs llama qwen3] [--skip ENGINE ...] [--markdown FILE] [--check]

--check exits 1 unless no legitimate engine is flagged on any panel and the gross bug (position)
is flagged on every one.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "worker", "hf"))
import assay_numerics  # noqa: E402  the product's audit measurement
import engines  # noqa: E402


def statistics_of(assay, lines):
    """`assay numerics audit` on JSONL lines: each line's statistics document."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))
        path = f.name
    try:
        out = subprocess.run([assay, "numerics", "audit", path], check=True,
                             capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    return [json.loads(line) for line in out.splitlines()]


def summed(measured, count):
    """The per-context sums (assayd's, in position order) of the first `count` contexts."""
    return [{"id": c["id"], "positions": c["positions"], "engine_sum": sum(c["engine"]),
             "member_sums": [sum(m) for m in c["members"]]} for c in measured[:count]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assay", required=True)
    parser.add_argument("--panels", type=int, default=10)
    parser.add_argument("--contexts", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--archs", nargs="+", default=["llama", "qwen3"])
    parser.add_argument("--skip", nargs="*", default=[])
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--markdown")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = [e for e in engines.LEGITIMATE + engines.BUGGY if e not in args.skip]
    spec = {"reduction_seeds": args.seeds, "sdpa": True}
    members = assay_numerics.audit_member_names(spec)
    prefixes = list(range(4, args.contexts + 1, 4))
    rows = {name: {"flagged": 0, "panels": 0, "ratios": [], "lows": [], "highs": [],
                   "to_flag": [], "argmax_differs": 0} for name in names}
    started = time.monotonic()
    for arch in args.archs:
        model = engines.make_model(arch, 1, logit_std=5.0)
        built = {name: engines.Engine(name, model, 1) for name in names}
        vocab = model.config.vocab_size
        for panel in range(args.panels):
            rng = random.Random(f"{arch}-{panel}")
            ids = [[rng.randrange(vocab) for _ in range(args.length)]
                   for _ in range(args.contexts)]
            lines, keys = [], []
            for name in names:
                contexts = [{"id": f"c{i}", "token_ids": c,
                             "engine_logits": built[name].all_logits(c)}
                            for i, c in enumerate(ids)]
                measured, _ = assay_numerics.audit(torch, model, contexts, spec, "cpu")
                rows[name]["argmax_differs"] += sum(c["argmax_differs"] for c in measured)
                for count in prefixes:
                    lines.append({"members": members, "contexts": summed(measured, count),
                                  "policy": {"alpha": args.alpha}})
                    keys.append((name, count))
            for (name, count), s in zip(keys, statistics_of(args.assay, lines)):
                row = rows[name]
                beyond = s["class"] == "beyond_legitimate"
                if count == prefixes[0]:
                    row["first"] = None
                if beyond and row.get("first") is None:
                    row["first"] = count * args.length
                if count == prefixes[-1]:
                    row["panels"] += 1
                    row["flagged"] += beyond
                    row["ratios"].append(s["ratio"])
                    row["lows"].append(s["ci95"][0])
                    row["highs"].append(s["ci95"][1])
                    row["to_flag"].append(row["first"])
            print(f"{arch} panel {panel}: "
                  + ", ".join(f"{n} {rows[n]['ratios'][-1]:.3f}" for n in names),
                  file=sys.stderr, flush=True)
    seconds = time.monotonic() - started

    def to_flag(values):
        found = sorted(v for v in values if v is not None)
        if not found:
            return "never"
        return f"{len(found)}/{len(values)} panels; median {statistics.median(found):.0f}"

    header = ("| engine | kind | panels | flagged (p < alpha) | ratio median [min, max] | "
              "median 95% CI | positions to first flag | positions whose argmax differs |")
    lines = [header, "|" + "---|" * 8]
    ok = True
    for name in names:
        r = rows[name]
        legit = name in engines.LEGITIMATE
        kind = ("legitimate (held out)" if legit
                else "gross bug" if name == "position" else "subtle bug")
        lines.append(
            f"| {name} | {kind} | {r['panels']} | {r['flagged']} | "
            f"{statistics.median(r['ratios']):.3f} [{min(r['ratios']):.3f}, "
            f"{max(r['ratios']):.3f}] | [{statistics.median(r['lows']):.3f}, "
            f"{statistics.median(r['highs']):.3f}] | {to_flag(r['to_flag'])} | "
            f"{r['argmax_differs']} |")
        if legit and r["flagged"]:
            ok = False
        if name == "position" and r["flagged"] != r["panels"]:
            ok = False
    table = "\n".join(lines)
    summary = (f"{args.panels} panels per model ({', '.join(args.archs)}), each {args.contexts} "
               f"contexts x {args.length} positions = {args.contexts * args.length} positions; "
               f"members {members[0]}, reduction:0..{args.seeds - 1}, sdpa; alpha {args.alpha}; "
               f"{seconds:.0f} s.")
    print(table)
    print(summary)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n\n" + summary + "\n")
    if args.check and not ok:
        print("audit_calibration: a legitimate engine was flagged, or the gross bug was missed",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
