#!/opt/assay/venv/bin/python
"""Independent Python reference forward for assay-oracle's bitwise tests.

    reference.py --model DIR --token-ids 1,2,3 --out FILE.safetensors [--all-positions]
                 [--dtype bfloat16|float32] [--threads N] [--gdn-variant current|legacy]

Loads config.json and the safetensors weights in pure Python, dispatches on model_type to
ref_<module>.forward(config, weights, input_ids) -> logits [1, T, V] in the model dtype, and
writes input_ids (I64 [1, T]) and logits (F32 [V], or [T, V] with --all-positions), the same
layout as `assay-oracle logits`.
"""

import argparse
import importlib
import json
import os
import struct
import sys
import time

import numpy
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))
import fixture_lib  # noqa: E402

MODULES = {
    "llama": "ref_llama",
    "qwen2": "ref_llama",
    "qwen3": "ref_llama",
    "spark2_5": "ref_spark2_5",
    "qwen3_5": "ref_qwen3_5",
    "qwen3_5_text": "ref_qwen3_5",
}

_NUMPY = {"BF16": numpy.int16, "F16": numpy.float16, "F32": numpy.float32,
          "F64": numpy.float64, "I64": numpy.int64, "I32": numpy.int32}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        np_dtype = numpy.dtype(_NUMPY[info["dtype"]])
        count = (end - begin) // np_dtype.itemsize
        arr = numpy.frombuffer(data, dtype=np_dtype, count=count, offset=base + begin)
        t = torch.from_numpy(arr.copy()).reshape(info["shape"])
        if info["dtype"] == "BF16":
            t = t.view(torch.bfloat16)
        out[name] = t
    return out


def load_weights(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for file in files:
        weights.update(read_safetensors(os.path.join(model_dir, file)))
    return weights


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--token-ids", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--all-positions", action="store_true")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    # legacy: transformers 5.13.1 (the oracle's only rule); current: after PR #47625, a cross-check
    parser.add_argument("--gdn-variant", choices=["current", "legacy"], default="legacy")
    parser.add_argument("--verbose", action="store_true",
                        help="print load and forward seconds to stderr")
    args = parser.parse_args()
    start = time.monotonic()

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    model_type = config["model_type"]
    if model_type not in MODULES:
        sys.exit("reference.py: unsupported model_type %r" % model_type)
    module = importlib.import_module(MODULES[model_type])
    config["_gdn_variant"] = args.gdn_variant

    dtype = getattr(torch, args.dtype)
    weights = load_weights(args.model)
    weights = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in weights.items()}
    ids = torch.tensor([[int(x) for x in args.token_ids.split(",")]], dtype=torch.int64)

    loaded = time.monotonic()
    with torch.inference_mode():
        logits = module.forward(config, weights, ids)
    if args.verbose:
        print("reference.py: load_seconds=%g forward_seconds=%g" % (
            loaded - start, time.monotonic() - loaded), file=sys.stderr)
    assert logits.dtype == dtype and logits.dim() == 3, (logits.dtype, logits.shape)
    logits = logits[0].float()
    if not args.all_positions:
        logits = logits[-1]
    fixture_lib.write_safetensors(
        args.out, {"input_ids": ids, "logits": logits.contiguous()},
        {"architecture": config.get("architectures", ["?"])[0], "dtype": args.dtype,
         "torch_version": torch.__version__})


if __name__ == "__main__":
    main()
