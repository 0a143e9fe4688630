"""Finds a dispute state shaped like Kiln's real one on a model directory: the reference's top two
logits exactly two bfloat16 steps apart (Kiln's 18.5 and 18.25). Prints {"input_token_ids",
"top", "second", "top_text", "second_text", "step"} as JSON.

Usage: two_step_state.py MODEL_DIR [--seed N]

The reference is transformers' eager forward in bfloat16 (the oracle's logits bit for bit);
prompts are drawn from a seeded generator until one fits, so the same model gives the same state.
"""
import json
import math
import random
import sys

import torch
import transformers


def bf16_step(v):
    v = abs(v)
    if v < 2.0 ** -126:
        return 2.0 ** -133
    return 2.0 ** (math.floor(math.log2(v)) - 7)


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv[1:2] in (["-h"], ["--help"]) else 2
    seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0
    torch.use_deterministic_algorithms(True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        argv[1], dtype=torch.bfloat16, attn_implementation="eager", local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(argv[1], local_files_only=True)
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    with torch.inference_mode():
        for _ in range(5000):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(4, 12))]
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            values, order = torch.sort(logits, descending=True, stable=True)
            top, second = values[0].item(), values[1].item()
            if top - second == 2 * bf16_step(top):
                a, b = int(order[0]), int(order[1])
                print(json.dumps({"input_token_ids": ids, "top": a, "second": b,
                                  "top_text": tokenizer.decode([a]),
                                  "second_text": tokenizer.decode([b]), "step": bf16_step(top)}))
                return 0
    print("no two-step state in 5000 prompts", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
