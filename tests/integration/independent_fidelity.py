#!/opt/assay/venv/bin/python
"""Recomputes a fidelity job independently of assay and checks its KL vector and receipt.

    independent_fidelity.py --request REQUEST.json --kl kl.safetensors --result result.json

For every panel context, tests/reference/reference.py (pure Python + Debian's torch) computes
the logits of every position for the reference and for the candidate (a model directory, or
the candidate's logits files as supplied); numpy computes KL(ref || cand) per scored position
in fp64 from the log-softmax of each row. Checks, failing with exit 1 and a message:
  - every token-wise KL in kl.safetensors equals numpy's to 1e-12 relative (an absolute floor
    of 1e-15 for values near 0, where relative error is meaningless),
  - the reference and candidate argmax of every position, exactly,
  - the receipt's mean, median, p95, p99, p99.9, max and top-1 agreement (numpy's percentile,
    linear interpolation) to the same tolerance.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(HERE, "..", "reference", "reference.py")
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))
import reference  # noqa: E402

REL, ABS = 1e-12, 1e-15


def all_logits(model_dir, ids, tmp, name):
    out = os.path.join(tmp, name + ".safetensors")
    subprocess.run([sys.executable, REFERENCE, "--model", model_dir, "--all-positions",
                    "--token-ids", ",".join(str(i) for i in ids), "--out", out], check=True)
    return reference.read_safetensors(out)["logits"].float().numpy()


def scored(context):
    positions = context.get("positions", "all")
    if positions == "all":
        return list(range(len(context["token_ids"])))
    return [p for b, e in positions for p in range(b, e)]


def log_softmax(x):
    x = x.astype(numpy.float64)
    m = x.max()
    return x - (m + numpy.log(numpy.exp(x - m).sum()))


def kl(ref_row, cand_row):
    lr, lc = log_softmax(ref_row), log_softmax(cand_row)
    return float((numpy.exp(lr) * (lr - lc)).sum())


def close(a, b):
    return abs(a - b) <= REL * abs(b) + ABS


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--request", required=True)
    p.add_argument("--kl", required=True)
    p.add_argument("--result", required=True)
    args = p.parse_args()
    with open(args.request) as f:
        req = json.load(f)
    with open(args.result) as f:
        result = json.load(f)
    art = reference.read_safetensors(args.kl)
    got_kl = art["kl"].numpy()
    got_ref_arg = art["reference_argmax"].numpy()
    got_cand_arg = art["candidate_argmax"].numpy()

    want, ref_arg, cand_arg = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, c in enumerate(req["panel"]["contexts"]):
            rows = scored(c)
            ref = all_logits(req["reference"]["model_dir"], c["token_ids"], tmp, "ref%d" % i)[rows]
            if "model_dir" in req["candidate"]:
                cand = all_logits(req["candidate"]["model_dir"], c["token_ids"], tmp, "cand%d" % i)[rows]
            else:
                cand = reference.read_safetensors(req["candidate"]["logits"][i]["path"])["logits"].float().numpy()
            for r in range(len(rows)):
                want.append(kl(ref[r], cand[r]))
                ref_arg.append(int(numpy.argmax(ref[r])))
                cand_arg.append(int(numpy.argmax(cand[r])))
    want = numpy.array(want)
    if got_kl.shape != want.shape:
        sys.exit("kl has shape %s, expected %s" % (got_kl.shape, want.shape))
    worst = 0.0
    for k, (a, b) in enumerate(zip(got_kl, want)):
        if not close(a, b):
            sys.exit("position %d: assay KL %r, numpy %r" % (k, a, b))
        if b != 0:
            worst = max(worst, abs(a - b) / abs(b))
    if list(got_ref_arg) != ref_arg or list(got_cand_arg) != cand_arg:
        sys.exit("argmax differs: assay %s / %s, numpy %s / %s" % (
            list(got_ref_arg), list(got_cand_arg), ref_arg, cand_arg))

    metrics = result["comparison"]["metrics"]
    expect = {"mean": want.mean(), "median": numpy.percentile(want, 50),
              "p95": numpy.percentile(want, 95), "p99": numpy.percentile(want, 99),
              "p99_9": numpy.percentile(want, 99.9), "max": want.max()}
    for key, value in expect.items():
        if not close(metrics["kl"][key], float(value)):
            sys.exit("receipt kl.%s = %r, numpy %r" % (key, metrics["kl"][key], float(value)))
    agree = sum(a == b for a, b in zip(ref_arg, cand_arg)) / len(ref_arg)
    if metrics["top1_agreement"] != agree:
        sys.exit("receipt top1_agreement %r, numpy %r" % (metrics["top1_agreement"], agree))
    print("ok: %d positions, max relative difference %.3g, mean KL %.6g, top-1 %.4f" % (
        len(want), worst, want.mean(), agree))


if __name__ == "__main__":
    main()
