#!/opt/assay/venv/bin/python
"""Self-checks of the Qwen3.5 Python reference that need no C++:

* the chunked gated delta rule (64-token chunks) agrees with the token-by-token recurrence to
  fp32 rounding, for both transformers variants, for T below, at and above one chunk, with
  grouped value heads (value heads = 2 x key heads);
* the flat qwen3_5_text checkpoint gives the same logits bits as the nested qwen3_5 one;
* the two variants differ visibly on a bf16 model (which is why only transformers 5.13.1's,
  "legacy" here, is the oracle's: tests/hf_parity checks it against transformers itself).

Exits non-zero with a message on the first failure.
"""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "fixtures"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "reference"))
import arch_qwen3_5  # noqa: E402
import ref_qwen3_5 as ref  # noqa: E402


def fail(message):
    sys.exit("check_reference.py: FAIL: " + message)


def check_chunk_matches_recurrence(gen):
    for length in (5, 64, 150):
        q = torch.randn(1, length, 2, 16, generator=gen)
        k = torch.randn(1, length, 2, 16, generator=gen)
        v = torch.randn(1, length, 4, 16, generator=gen)
        g = -torch.rand(1, length, 4, generator=gen) * 0.5
        beta = torch.rand(1, length, 4, generator=gen)
        for variant in ("current", "legacy"):
            qq, kk = q, k
            if variant == "legacy":  # the legacy caller repeats q/k to the value heads
                qq, kk = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
            chunk = ref.GDN_RULES[(variant, "chunk")](qq, kk, v, g, beta)
            steps = ref.GDN_RULES[(variant, "recurrent")](qq, kk, v, g, beta)
            scale = steps.abs().max().item()
            err = (chunk - steps).abs().max().item()
            # fp32 rounding of O(T) accumulations: a few ulps of the output scale.
            if not err <= 64 * torch.finfo(torch.float32).eps * scale:
                fail(f"{variant} chunk vs recurrent at T={length}: max |diff| {err} (scale {scale})")
            print(f"ok {variant} chunk vs recurrent T={length}: max |diff| {err:.3g} of {scale:.3g}")


def check_flat_equals_nested(gen):
    config = arch_qwen3_5.make_config("tiny")
    weights = arch_qwen3_5.make_weights(config, gen)
    ids = torch.randint(0, 260, (1, 70), generator=gen)
    nested = ref.forward(config, weights, ids)
    flat = ref.forward(arch_qwen3_5.flat_config(config), arch_qwen3_5.flat_weights(weights), ids)
    if not torch.equal(nested, flat):
        fail("flat qwen3_5_text logits differ from nested qwen3_5 logits")
    current = ref.forward(config, weights, ids, "current")
    diff = (current.float() - nested.float()).abs().max().item()
    if diff == 0:
        fail("legacy and current GDN variants gave identical logits on a bf16 model")
    print(f"ok flat == nested; legacy vs current max |diff| {diff}")


def main():
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        check_chunk_matches_recurrence(gen)
        check_flat_equals_nested(gen)


if __name__ == "__main__":
    main()
