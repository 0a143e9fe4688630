#!/usr/bin/env python3
"""Parity of assay-oracle with Hugging Face transformers itself.

    hf_parity.py --oracle PATH/assay-oracle [--hf-worker PATH/assay-hf-worker]
                 [--device cpu|cuda] [--threads N] [--keep DIR] [--only NAME[,NAME]]
                 [--lengths 1,2,...]

Builds tiny random models of every architecture assay-oracle supports that this transformers
has a class for (Llama, Qwen2, Qwen3, Qwen3.5 text with its Gated DeltaNet layers), in several
shapes (GQA and MHA, tied and untied heads, biases, head_dim unlike hidden/heads, RoPE
scaling), with transformers' own classes, saves them as bf16 safetensors, reloads each with
`from_pretrained(..., attn_implementation="eager")` as a user would, and compares transformers'
logits (`model(ids).logits` under inference_mode, deterministic algorithms, TF32 off, the same
thread count) with assay-oracle's through every mode that computes them: `logits
--all-positions` at every length, `next-token`, `capture` (with a block size that splits the
rows unevenly) and `next-token-batch`; with --hf-worker, the transformers worker's
`next-token` too (it builds the model without random initialisation and assigns the weights as
views of its read-only copy of the file: its logits must be from_pretrained's). Every comparison is bitwise on the float32 bits; where one
differs it prints the largest difference and the test fails. Exits 77 (CTest's skip code) only
when transformers is not importable, saying why. Spark2.5 has no class in transformers: its
Hugging Face remote code (written for transformers 4.57) is compared by
tests/hf_parity/spark_remote_parity.py where a copy of it is at hand (worker/README.md).
"""

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))


def read_safetensors(path, name):
    import torch

    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    info = header[name]
    begin, end = info["data_offsets"]
    raw = bytearray(data[8 + n + begin : 8 + n + end])
    dtype = {"F32": torch.float32, "I64": torch.int64}[info["dtype"]]
    return torch.frombuffer(raw, dtype=dtype).reshape(info["shape"])


def configs(transformers):
    """(name, config) for each shape under test."""
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=320,
                 max_position_embeddings=1024)
    out = [
        # MHA, untied, Llama 3 RoPE scaling
        ("llama-mha-llama3rope", transformers.LlamaConfig(
            **small, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64})),
        # GQA, tied, attention and MLP biases, linear RoPE scaling
        ("llama-gqa-tied-bias", transformers.LlamaConfig(
            **small, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
            attention_bias=True, mlp_bias=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
        # q/k/v biases, tied, GQA 8:2
        ("qwen2-gqa-tied", transformers.Qwen2Config(
            **small, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)),
        # head_dim 32 unlike 64/4, untied, q/k norms
        ("qwen3-headdim32", transformers.Qwen3Config(
            **small, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            tie_word_embeddings=False)),
        # MHA with head_dim 8 unlike 64/4, tied, a large RoPE base (YaRN and dynamic NTK are
        # refused by name: tests/oracle/model_test.cpp)
        ("qwen3-mha-tied", transformers.Qwen3Config(
            **small, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    ]
    if hasattr(transformers, "Qwen3_5TextConfig"):
        gdn = dict(hidden_size=64, intermediate_size=128, vocab_size=320,
                   max_position_embeddings=1024, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                   linear_value_head_dim=16)
        out += [
            ("qwen3_5-text", transformers.Qwen3_5TextConfig(
                **gdn, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=["linear_attention", "linear_attention", "linear_attention",
                             "full_attention"])),
            ("qwen3_5-text-tied", transformers.Qwen3_5TextConfig(
                **gdn, num_hidden_layers=2, linear_num_key_heads=4, linear_num_value_heads=4,
                tie_word_embeddings=True, layer_types=["linear_attention", "full_attention"])),
        ]
    return out


class Oracle:
    def __init__(self, path, device, threads, root):
        self.path, self.device, self.threads, self.root = path, device, threads, root

    def run(self, *args):
        r = subprocess.run([self.path, *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("assay-oracle %s failed (%d): %s" % (args[0], r.returncode,
                                                                     r.stderr.strip()))

    def execution(self):
        return {"device": self.device, "dtype": "bfloat16", "threads": self.threads}

    def logits(self, model_dir, ids, out):
        self.run("logits", "--model", model_dir, "--token-ids", ",".join(map(str, ids)),
                 "--out", out, "--all-positions", "--device", self.device,
                 "--threads", str(self.threads))
        return read_safetensors(out, "logits")

    def protocol(self, mode, name, document):
        work = os.path.join(self.root, name)
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        with open(os.path.join(work, "input.json"), "w") as f:
            json.dump(document, f)
        self.run(mode, "--input", os.path.join(work, "input.json"), "--workdir", work)
        return work


def candidates(tokenizer, row):
    """Two candidates: the reference argmax and the runner-up, with transformers' decoded text."""
    top = row.float().topk(2).indices.tolist()
    return [{"engine": engine, "token_id": int(t), "text": tokenizer.decode([int(t)])}
            for engine, t in zip(("kiln", "vllm"), top)]


class Report:
    def __init__(self):
        self.failures = 0
        self.cases = 0

    def compare(self, label, got, expected):
        import torch

        self.cases += 1
        got = got.to(torch.float32).contiguous()
        expected = expected.to(torch.float32).contiguous()
        if got.shape != expected.shape:
            print("FAIL %-48s shape %s != %s" % (label, list(got.shape), list(expected.shape)))
            self.failures += 1
            return
        same = torch.equal(got.view(torch.int32), expected.view(torch.int32))
        diff = (got - expected).abs().max().item() if got.numel() else 0.0
        differing = int((got.view(torch.int32) != expected.view(torch.int32)).sum())
        print("%s %-48s bitwise=%s max_abs_diff=%g differing=%d/%d" % (
            "ok  " if same else "FAIL", label, same, diff, differing, got.numel()))
        self.failures += not same


def make_model(transformers, torch, name, config, root):
    from fixture_lib import build_tokenizer

    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.bfloat16, attn_implementation="eager")
    # Random norms instead of all-ones, so that a norm applied in the wrong place shows.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname and p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p.float()).to(p.dtype))
    model_dir = os.path.join(root, name)
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer_json, tokenizer_config = build_tokenizer(config.vocab_size)
    with open(os.path.join(model_dir, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json, f)
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f)
    return model_dir


def reference_logits(model, ids, device):
    import torch

    with torch.inference_mode():
        return model(torch.tensor([ids], device=device)).logits[0].float().cpu()


def check_model(transformers, torch, name, config, args, oracle, report):
    model_dir = make_model(transformers, torch, name, config, oracle.root)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="eager").eval().to(args.device)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(len(name))
    ids = {t: torch.randint(0, config.vocab_size, (t,), generator=gen).tolist()
           for t in args.lengths}
    expected = {t: reference_logits(model, ids[t], args.device) for t in args.lengths}

    for t in args.lengths:
        got = oracle.logits(model_dir, ids[t], os.path.join(oracle.root, "%s-%d.st" % (name, t)))
        report.compare("%s logits --all-positions T=%d" % (name, t), got, expected[t])

    short, long = min(args.lengths), max(args.lengths)
    for t in sorted({short, 8 if 8 in ids else short, long}):
        work = oracle.protocol("next-token", "%s-next-%d" % (name, t), {
            "schema": "assay.oracle-input.v1", "model_dir": os.path.abspath(model_dir),
            "input_token_ids": ids[t], "candidate_tokens": candidates(tokenizer, expected[t][-1]),
            "execution": oracle.execution()})
        got = read_safetensors(os.path.join(work, "logits.safetensors"), "logits")
        report.compare("%s next-token T=%d" % (name, t), got.reshape(-1), expected[t][-1])
        out = json.load(open(os.path.join(work, "output.json")))
        want = int(expected[t][-1].argmax())
        if out["argmax"] != want:
            print("FAIL %s next-token T=%d argmax %d != transformers' %d" % (
                name, t, out["argmax"], want))
            report.failures += 1

    if args.hf_worker:
        work = os.path.join(oracle.root, "%s-hf-%d" % (name, long))
        os.makedirs(work)
        with open(os.path.join(work, "input.json"), "w") as f:
            json.dump({"schema": "assay.oracle-input.v1", "model_dir": os.path.abspath(model_dir),
                       "input_token_ids": ids[long],
                       "candidate_tokens": candidates(tokenizer, expected[long][-1]),
                       "execution": oracle.execution()}, f)
        r = subprocess.run([args.hf_worker, "next-token", "--input", "input.json", "--workdir", "."],
                           cwd=work, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("assay-hf-worker next-token failed (%d): %s" % (
                r.returncode, r.stderr.strip()[-2000:]))
        got = read_safetensors(os.path.join(work, "logits.safetensors"), "logits")
        report.compare("%s assay-hf-worker next-token T=%d" % (name, long), got.reshape(-1),
                       expected[long][-1])

    work = oracle.protocol("capture", "%s-capture" % name, {
        "schema": "assay.oracle-capture-input.v1", "model_dir": os.path.abspath(model_dir),
        "contexts": [{"id": "long", "token_ids": ids[long], "positions": "all"},
                     {"id": "short", "token_ids": ids[short], "positions": "all"}],
        "block_positions": 7, "execution": oracle.execution()})
    for i, t in enumerate((long, short)):
        got = read_safetensors(os.path.join(work, "capture-%d.safetensors" % i), "logits")
        report.compare("%s capture T=%d block=7" % (name, t), got, expected[t])

    states = sorted({short, 8 if 8 in ids else short, long})
    work = oracle.protocol("next-token-batch", "%s-batch" % name, {
        "schema": "assay.oracle-batch-input.v1", "model_dir": os.path.abspath(model_dir),
        "execution": oracle.execution(),
        "states": [{"index": i, "input_token_ids": ids[t],
                    "candidate_tokens": candidates(tokenizer, expected[t][-1])}
                   for i, t in enumerate(states)]})
    for i, t in enumerate(states):
        path = os.path.join(work, "state-%d.safetensors" % i)
        if not os.path.exists(path):
            print("FAIL %s batch state %d: %s" % (
                name, i, open(os.path.join(work, "state-%d.json" % i)).read()))
            report.failures += 1
            continue
        got = read_safetensors(path, "logits")
        report.compare("%s next-token-batch state T=%d" % (name, t), got.reshape(-1),
                       expected[t][-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--oracle", required=True)
    parser.add_argument("--hf-worker", help="also compare assay-hf-worker next-token")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", help="keep the generated models and outputs in this directory")
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--lengths", default="1,2,3,5,8,64,301",
                        help="comma-separated sequence lengths")
    args = parser.parse_args()
    args.lengths = sorted({int(t) for t in args.lengths.split(",")})
    try:
        import torch
        import transformers
    except ImportError as e:
        print("SKIP: transformers is not importable here (%s); scripts/install-deps makes the "
              "pinned environment" % e)
        return SKIP

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    print("torch %s (%s), transformers %s, device %s, threads %d, cpu capability %s" % (
        torch.__version__, torch.version.git_version, transformers.__version__, args.device,
        args.threads, torch.backends.cpu.get_cpu_capability()))

    root = args.keep or tempfile.mkdtemp(prefix="assay-hf-parity-")
    os.makedirs(root, exist_ok=True)
    oracle = Oracle(os.path.abspath(args.oracle), args.device, args.threads, root)
    report = Report()
    only = set(args.only.split(",")) if args.only else None
    try:
        for name, config in configs(transformers):
            if only and name not in only:
                continue
            try:
                check_model(transformers, torch, name, config, args, oracle, report)
            except RuntimeError as e:
                print("FAIL %s: %s" % (name, e))
                report.failures += 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print("%d passed, %d failed" % (report.cases - min(report.failures, report.cases),
                                    report.failures))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
