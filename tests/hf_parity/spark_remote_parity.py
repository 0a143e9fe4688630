#!/usr/bin/python3
"""Parity of assay-oracle's Spark2.5 with the model's own Hugging Face remote code.

    spark_remote_parity.py --oracle PATH/assay-oracle --remote-code DIR [--keep DIR]

DIR holds modeling_spark.py and configuration_spark.py as published with the checkpoint
(Spark2_5ForCausalLM, written for transformers 4.57; run with a transformers that loads it,
e.g. 4.57.x). They are not in this repository and cannot be fetched at test time, so this is
run by hand, not by CTest. For each variant of the tiny fixture (tests/fixtures/arch_spark2_5.py
--set), it copies the two files into the model folder, loads it with trust_remote_code
(HF_HUB_OFFLINE=1, eager attention), runs its forward and `assay-oracle logits --all-positions`
on the same ids, and compares every position's logits bitwise. Exits 1 on any difference,
77 (CTest's skip code) when DIR or transformers is missing.
"""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures")

# (name, config fields merged into the tiny config; null drops a field so its default applies)
VARIANTS = [
    ("checkpoint-like: tied, sigmoid gate, 3 sliding + 1 full", {}),
    ("untied, attention and mlp biases, silu gate",
     {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True,
      "gate_attn_act_mode": "silu"}),
    ("no output gate, 2 KV heads", {"headwise_attn_output_gate": False, "num_key_value_heads": 2}),
    ("Spark2_5Config defaults: untied, no gate, no biases, all full, head_dim from hidden",
     {"tie_word_embeddings": None, "headwise_attn_output_gate": None, "gate_attn_act_mode": None,
      "attention_bias": None, "mlp_bias": None, "layer_types": None, "sliding_window": None,
      "head_dim": None}),
    ("head_dim 256 (the checkpoint's), rotary 256 sliding / 64 full", {"head_dim": 256}),
]
LENGTHS = [1, 7, 33, 70]


def read_logits(path):
    import struct

    import torch

    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    info = json.loads(data[8 : 8 + n])["logits"]
    begin, end = info["data_offsets"]
    raw = bytearray(data[8 + n + begin : 8 + n + end])
    return torch.frombuffer(raw, dtype=torch.float32).reshape(info["shape"])


def token_ids(n, vocab, seed):
    return [(seed + 37 * i) % vocab for i in range(n)]


def make_model(base, settings, remote_code):
    os.makedirs(base)
    subprocess.run([sys.executable, os.path.join(FIXTURES, "make_fixture.py"), "--arch",
                    "spark2_5", "--size", "tiny", "--seed", "7", "--out", base], check=True)
    subprocess.run([sys.executable, os.path.join(FIXTURES, "arch_spark2_5.py"), "--out", base,
                    "--set", json.dumps(settings)], check=True, cwd=FIXTURES)
    for name in ("modeling_spark.py", "configuration_spark.py"):
        shutil.copy(os.path.join(remote_code, name), base)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--oracle", required=True,
                        help="the oracle binary (or any command taking its `logits` arguments)")
    parser.add_argument("--remote-code", required=True)
    parser.add_argument("--keep", help="directory for the models and logits (default: a temp dir)")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(args.remote_code, "modeling_spark.py")):
        print("skip: no modeling_spark.py in %s" % args.remote_code)
        return SKIP
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import torch
        import transformers
    except ImportError as e:
        print("skip: %s" % e)
        return SKIP
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    print("torch %s, transformers %s" % (torch.__version__, transformers.__version__), flush=True)

    work = args.keep or tempfile.mkdtemp(prefix="spark-parity-")
    failures = 0
    for v, (name, settings) in enumerate(VARIANTS):
        model_dir = os.path.join(work, "variant-%d" % v)
        shutil.rmtree(model_dir, ignore_errors=True)
        make_model(model_dir, settings, args.remote_code)
        for dtype in ("bfloat16", "float32"):
            model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, trust_remote_code=True, dtype=getattr(torch, dtype),
                attn_implementation="eager")
            model.eval()
            vocab = model.config.vocab_size
            for n in LENGTHS:
                ids = token_ids(n, vocab, 3 + n)
                with torch.inference_mode():
                    hf = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
                out = os.path.join(work, "oracle-%d-%s-%d.safetensors" % (v, dtype, n))
                subprocess.run(shlex.split(args.oracle) + ["logits", "--model", model_dir, "--token-ids",
                                ",".join(map(str, ids)), "--out", out, "--all-positions",
                                "--dtype", dtype, "--threads", "1"], check=True)
                ours = read_logits(out)
                same = ours.shape == hf.shape and torch.equal(ours, hf)
                diff = (ours - hf).abs().max().item() if ours.shape == hf.shape else float("inf")
                failures += not same
                print("%s  %-72s %-8s T=%-3d %s" % ("ok  " if same else "FAIL", name, dtype, n,
                                                    "bitwise" if same else "max |diff| %g" % diff), flush=True)
    print("%d of %d comparisons differ" % (failures, len(VARIANTS) * 2 * len(LENGTHS)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
