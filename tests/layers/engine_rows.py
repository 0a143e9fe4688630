"""An "engine" for layer-attribution tests: transformers' own forward over a model directory,
optionally with one deliberate change, writing its hidden-state rows at the named boundaries as
the engine's rows file of a layer-attribution request.

    engine_rows.py --model DIR --token-ids 1,2,3 --rows last|all --dtype F32|BF16 --out FILE
                   [--perturb BOUNDARY=KIND] [--metadata] [--model-content-sha256 ID]
                   [--threads N]
    engine_rows.py --model DIR --screen N [--length L] --perturb BOUNDARY=KIND

--screen finds ids on which the change flips the engine's next token, by one fixed rule: the
first of the sequences seeded 0, 1, ..., N-1 (L ids each, default 24, drawn uniformly from the
vocabulary by Python's random.Random(seed)) whose argmax with the change differs from the
argmax without it, each sequence run alone. It prints {"token_ids", "screened", "next_token_id",
"changed_token_id"} (token_ids null when none of the N flips), so that a test finds its case on
the machine it runs on: which sequences flip depends on the CPU's kernels.

The model is loaded with from_pretrained (eager attention, bfloat16; RoPE's inv_freq stays
float32) under assay-hf-worker's deterministic settings and captured with its hooks, so that
without --perturb the rows equal the reference's bit for bit. Kinds of --perturb:

  bf16-rmsnorm  on layers.N.input_layernorm, layers.N.post_attention_layernorm or norm: that
                RMSNorm computed entirely in bfloat16 instead of float32 (an engine's fused
                kernel with a narrow accumulator)
  bf16-softmax  on layers.N.self_attn: that attention's softmax in bfloat16 (exponentials,
                sum and quotient each rounded to bfloat16)

Tensors are named by boundary, [1, hidden] (rows last) or [T, hidden] (rows all), in forward
order; --metadata adds __metadata__ {input_token_ids_sha256[, model_content_sha256]}. Prints
{"next_token_id", "logits_sha256", "boundaries"} as JSON on stdout.
"""
import argparse
import contextlib
import importlib.util
import inspect
import json
import pathlib
import random
import sys

import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def load_worker():
    """worker/hf/assay_hf_worker.py as a module: its hooks are the ones the reference runs."""
    spec = importlib.util.spec_from_file_location(
        "assay_hf_worker", ROOT / "worker" / "hf" / "assay_hf_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = load_worker()
transformers.utils.logging.disable_progress_bar()


def load_model(model_dir, threads=2):
    worker.deterministic_torch(torch, threads)
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()


def bf16_rmsnorm(module):
    """A forward for an RMSNorm module that stays in the input's dtype throughout."""
    offset = "1.0 + self.weight" in inspect.getsource(type(module).forward)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))

    def forward(x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        weight = module.weight.to(x.dtype)
        return y * (1.0 + weight) if offset else weight * y
    return forward


@contextlib.contextmanager
def perturbed(modules, spec):
    """The model with one deliberate change (BOUNDARY=KIND), undone on exit."""
    if spec is None:
        yield
        return
    boundary, _, kind = spec.partition("=")
    by_name = dict(modules)
    if boundary not in by_name:
        raise SystemExit(f"--perturb: {boundary!r} is not a boundary of the model")
    module = by_name[boundary]
    if kind == "bf16-rmsnorm" and (boundary == "norm" or boundary.endswith("_layernorm")):
        module.forward = bf16_rmsnorm(module)
        try:
            yield
        finally:
            del module.forward
    elif kind == "bf16-softmax" and boundary.endswith(".self_attn"):
        # eager attention calls nn.functional.softmax(..., dtype=float32): inside this one
        # module, every step in bfloat16 instead (torch's bf16 softmax kernel would accumulate
        # in float32 and round once, which is the float32 result).
        original, inside = torch.nn.functional.softmax, [False]

        def softmax(x, dim=None, dtype=None, **kwargs):
            if not inside[0]:
                return original(x, dim=dim, dtype=dtype, **kwargs)
            x = x.to(torch.bfloat16)
            e = torch.exp(x - x.amax(dim, keepdim=True))
            return e / e.sum(dim, keepdim=True)

        enter = module.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True))
        leave = module.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False))
        torch.nn.functional.softmax = softmax
        try:
            yield
        finally:
            torch.nn.functional.softmax = original
            enter.remove()
            leave.remove()
    else:
        raise SystemExit(f"--perturb: cannot apply {kind!r} to {boundary!r}")


def engine_rows(model, ids, rows, perturb=None):
    """({boundary: F32 rows}, in forward order, and the last position's F32 logits)."""
    modules = worker.boundary_modules(model)
    store = {}
    handles = worker.capture_hooks(modules, rows, store)
    try:
        with perturbed(modules, perturb), torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    return {name: store[name] for name, _ in modules}, logits[0, -1].float().contiguous()


def screen(model, count, length, perturb):
    """The first seeded sequence whose argmax the change flips (see --screen)."""
    modules = worker.boundary_modules(model)
    vocab = model.config.vocab_size
    for seed in range(count):
        rng = random.Random(seed)
        ids = [rng.randrange(vocab) for _ in range(length)]
        with torch.inference_mode():
            plain = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            with perturbed(modules, perturb):
                changed = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        a, b = worker.last_argmax(plain.contiguous()), worker.last_argmax(changed.contiguous())
        if a != b:
            return {"token_ids": ids, "screened": seed + 1, "next_token_id": a,
                    "changed_token_id": b}
    return {"token_ids": None, "screened": count, "next_token_id": None, "changed_token_id": None}


def write_rows(path, captured, dtype, metadata):
    entries = []
    for name, t in captured.items():
        t = t.to(torch.bfloat16) if dtype == "BF16" else t
        entries.append((name, dtype, list(t.shape), worker.tensor_bytes(t)))
    worker.write_safetensors(str(path), entries, metadata)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--token-ids", help="comma-separated")
    parser.add_argument("--rows", choices=["last", "all"])
    parser.add_argument("--dtype", choices=["F32", "BF16"])
    parser.add_argument("--out")
    parser.add_argument("--screen", type=int, metavar="N", help="find ids the change flips")
    parser.add_argument("--length", type=int, default=24, help="ids per screened sequence")
    parser.add_argument("--perturb", help="BOUNDARY=KIND (bf16-rmsnorm, bf16-softmax)")
    parser.add_argument("--metadata", action="store_true")
    parser.add_argument("--model-content-sha256")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv[1:])
    if args.screen is not None:
        if not args.perturb or args.screen < 1 or args.length < 1:
            parser.error("--screen needs --perturb, N >= 1 and --length >= 1")
        model = load_model(args.model, args.threads)
        print(json.dumps(screen(model, args.screen, args.length, args.perturb)))
        return 0
    for name in ("token_ids", "rows", "dtype", "out"):
        if getattr(args, name) is None:
            parser.error(f"--{name.replace('_', '-')} is required")

    ids = [int(t) for t in args.token_ids.split(",")]
    model = load_model(args.model, args.threads)
    captured, logits = engine_rows(model, ids, args.rows, args.perturb)
    metadata = {}
    if args.metadata:
        metadata["input_token_ids_sha256"] = worker.canonical_ids_sha256(ids)
        if args.model_content_sha256:
            metadata["model_content_sha256"] = args.model_content_sha256
    write_rows(args.out, captured, args.dtype, metadata)
    print(json.dumps({"next_token_id": worker.last_argmax(logits),
                      "logits_sha256": worker.sha256_id(logits.numpy().tobytes()),
                      "boundaries": list(captured)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
