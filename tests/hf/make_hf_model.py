"""A tiny model of an architecture assay's C++ port does not have, made with transformers' own
class from random weights (seed 0), with the byte-level tokenizer of the llama fixture.

Usage: make_hf_model.py ARCH OUT_DIR     (ARCH: mistral, gemma3)
"""
import pathlib
import shutil
import subprocess
import sys
import tempfile

import torch
import transformers

HERE = pathlib.Path(__file__).resolve().parent


def config_of(arch, vocab):
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=256, torch_dtype="bfloat16")
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=64, tie_word_embeddings=False, **common)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(sliding_window=16, query_pre_attn_scalar=8,
                                             layer_types=["sliding_attention", "full_attention"],
                                             **common)
    raise SystemExit(f"unknown arch {arch!r} (mistral, gemma3)")


def main(argv):
    if len(argv) != 3:
        raise SystemExit(__doc__)
    arch, out = argv[1], pathlib.Path(argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(HERE.parent / "fixtures" / "make_fixture.py"),
                        "--arch", "llama", "--size", "tiny", "--out", f"{tmp}/llama"],
                       check=True, capture_output=True)
        vocab = transformers.AutoConfig.from_pretrained(f"{tmp}/llama").vocab_size
        torch.manual_seed(0)
        config = config_of(arch, vocab)
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        model.save_pretrained(out, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(f"{tmp}/llama/{name}", out / name)
    print(out)


if __name__ == "__main__":
    main(sys.argv)
