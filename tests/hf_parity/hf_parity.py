#!/usr/bin/python3
"""Parity of assay-oracle with Hugging Face transformers itself.

    hf_parity.py --oracle PATH/assay-oracle [--device cpu|cuda] [--keep DIR]

Where `transformers` is importable (e.g. a GPU host with torch + transformers), builds tiny
random Llama, Qwen2, Qwen3 (and Qwen3.5 when this transformers has it) models with
transformers, saves them in bf16 safetensors, runs the eager forward and assay-oracle on the
same ids, and compares the logits of every position: bitwise when transformers uses the same
torch build as the oracle, else reports the largest difference. Exits 77 (CTest's skip code)
with the reason printed when transformers is not importable. Spark2.5 has no public
transformers code and is covered by tests/reference instead.
"""

import argparse
import os
import struct
import subprocess
import sys
import tempfile

SKIP = 77


def read_logits(path):
    import json

    import torch

    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    info = header["logits"]
    begin, end = info["data_offsets"]
    raw = bytearray(data[8 + n + begin : 8 + n + end])
    return torch.frombuffer(raw, dtype=torch.float32).reshape(info["shape"])


def configs(transformers):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                  max_position_embeddings=512)
    out = [
        ("llama", transformers.LlamaConfig(
            **common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64})),
        ("qwen2", transformers.Qwen2Config(**common, tie_word_embeddings=True)),
    ]
    if hasattr(transformers, "Qwen3Config"):
        out.append(("qwen3", transformers.Qwen3Config(**common, head_dim=32)))
    if hasattr(transformers, "Qwen3_5TextConfig"):
        out.append(("qwen3_5_text", transformers.Qwen3_5TextConfig(**common)))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--oracle", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--keep", help="keep the generated models in this directory")
    args = parser.parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        print("SKIP: transformers is not importable here (%s); run this on a host with "
              "torch + transformers" % e)
        return SKIP

    torch.manual_seed(0)
    failures = 0
    root = args.keep or tempfile.mkdtemp(prefix="assay-hf-parity-")
    for name, config in configs(transformers):
        config.torch_dtype = torch.bfloat16
        model = transformers.AutoModelForCausalLM.from_config(
            config, torch_dtype=torch.bfloat16, attn_implementation="eager").eval()
        model_dir = os.path.join(root, name)
        model.save_pretrained(model_dir, safe_serialization=True)
        # The oracle needs a tokenizer.json only for next-token; logits does not read it.
        for t in (5, 70):
            ids = torch.randint(0, config.vocab_size, (1, t), generator=torch.Generator().manual_seed(t))
            with torch.no_grad():
                expected = model.to(args.device)(ids.to(args.device)).logits[0].float().cpu()
            out = os.path.join(root, "%s-%d.safetensors" % (name, t))
            subprocess.run([args.oracle, "logits", "--model", model_dir, "--token-ids",
                            ",".join(str(int(i)) for i in ids[0]), "--out", out,
                            "--all-positions", "--device", args.device], check=True)
            got = read_logits(out)
            same = torch.equal(got.view(torch.int32), expected.view(torch.int32))
            diff = (got - expected).abs().max().item()
            print("%-14s T=%-3d bitwise=%s max_abs_diff=%g" % (name, t, same, diff))
            failures += not same
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
