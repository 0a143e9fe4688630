"""An engine's logits over a panel, for the engine audit's tests and calibration.

Usage: audit_panel.py MODEL_DIR OUT_DIR --engine NAME [--contexts N] [--length L] [--seed S]
                      [--reduction-seeds K]

Loads MODEL_DIR with transformers (bfloat16, eager), builds engines.py's engine NAME over it (the
engines whose fault is known; none of them is a member of the envelope, and this file never
imports the product's numerics code), draws N contexts of L ids from a seeded generator and
writes, per context, OUT_DIR/c<i>.safetensors (a tensor "logits", F32, [L, vocab]: the engine's
logits at every position) and OUT_DIR/request.json, an assay.engine-audit-request.v1 naming them
with their sha256. Prints the request's path.
"""
import argparse
import hashlib
import json
import os
import pathlib
import random
import sys

import safetensors.torch
import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engines  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--engine", required=True, choices=engines.LEGITIMATE + engines.BUGGY)
    parser.add_argument("--contexts", type=int, default=16)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reduction-seeds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.bfloat16, attn_implementation="eager",
        local_files_only=True).eval()
    engine = engines.Engine(args.engine, model, 1)
    vocab = model.config.vocab_size
    rng = random.Random(args.seed)
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    contexts, files = [], []
    for i in range(args.contexts):
        ids = [rng.randrange(vocab) for _ in range(args.length)]
        path = out / f"c{i}.safetensors"
        safetensors.torch.save_file({"logits": engine.all_logits(ids).contiguous()}, str(path))
        digest = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        contexts.append({"id": f"c{i}", "token_ids": ids})
        files.append({"path": str(path.resolve()), "sha256": digest})
    request = {
        "schema": "assay.engine-audit-request.v1",
        "id": f"audit-{args.engine}-{args.seed}",
        "model_dir": str(pathlib.Path(args.model_dir).resolve()),
        "engine": {"name": args.engine, "logits": files},
        "panel": {"contexts": contexts},
        "audit": {"reduction_seeds": args.reduction_seeds},
    }
    (out / "request.json").write_text(json.dumps(request, indent=1) + "\n")
    print(out / "request.json")


if __name__ == "__main__":
    main()
