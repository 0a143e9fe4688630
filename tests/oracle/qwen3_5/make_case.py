#!/opt/assay/venv/bin/python
"""Writes the Qwen3.5 bitwise test case: a tiny checkpoint in both config forms and the Python
reference logits for every GDN variant and kernel.

    make_case.py --out DIR [--lengths 37,64,150] [--seed 0]

DIR/nested/  config.json (model_type qwen3_5) + model.safetensors (model.language_model.*,
             plus model.visual.* and mtp.* tensors the text model must ignore)
DIR/flat/    config.json (model_type qwen3_5_text) + model.safetensors (model.*)
DIR/ref_T<T>.safetensors: input_ids I64 [1, T] and, per variant/kernel, logits F32 [T, V]
             named current_chunk, current_recurrent, legacy_chunk, legacy_recurrent
             (all from the nested checkpoint).
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "fixtures"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "reference"))
import arch_qwen3_5  # noqa: E402
import fixture_lib  # noqa: E402
import ref_qwen3_5  # noqa: E402


def write_model(path, config, weights):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    fixture_lib.write_checkpoint(path, weights)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", default="37,64,150")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    config = arch_qwen3_5.make_config("tiny")
    gen = torch.Generator().manual_seed(args.seed)
    weights = arch_qwen3_5.make_weights(config, gen)
    write_model(os.path.join(args.out, "nested"), config, weights)
    write_model(os.path.join(args.out, "flat"), arch_qwen3_5.flat_config(config),
                arch_qwen3_5.flat_weights(weights))

    vocab = config["text_config"]["vocab_size"]
    for length in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(0, vocab, (1, length), generator=gen, dtype=torch.int64)
        tensors = {"input_ids": ids}
        with torch.inference_mode():
            for variant in ("current", "legacy"):
                for mode in ("chunk", "recurrent"):
                    logits = ref_qwen3_5.forward(config, weights, ids, variant, mode)
                    tensors[f"{variant}_{mode}"] = logits[0].float().contiguous()
        fixture_lib.write_safetensors(os.path.join(args.out, f"ref_T{length}.safetensors"), tensors)


if __name__ == "__main__":
    main()
