"""The two oracle backends on the same input: assay-oracle next-token (libtorch, the C++ port)
and assay-hf-worker next-token (transformers' own forward) must give the same logits, bit for
bit, on an architecture both run, at a length where RoPE's precision shows.

Usage: backend_parity_test.py ASSAY_ORACLE ASSAY_HF_WORKER

On the tiny llama fixture with 256 input ids: both workers run as assayd runs them (input.json
naming model_dir, a fresh work directory); their output.json's logits_sha256, argmax and
candidates must agree and their logits.safetensors hold the same F32 bytes. Exit 0 when so.
"""
import json
import pathlib
import random
import subprocess
import sys
import tempfile

import safetensors.torch

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def run(worker, doc, work):
    work.mkdir()
    (work / "input.json").write_text(json.dumps(doc))
    proc = subprocess.run([worker, "next-token", "--input", "input.json", "--workdir", "."],
                          cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{worker} exited {proc.returncode}: {proc.stderr}")
    return json.loads((work / "output.json").read_text())


def main(argv):
    oracle, hf = argv[1], argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        model = tmp / "llama"
        subprocess.run([sys.executable, str(ROOT / "tests/fixtures/make_fixture.py"), "--arch",
                        "llama", "--size", "tiny", "--out", str(model)], check=True,
                       capture_output=True)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        r = random.Random(256)
        doc = {"schema": "assay.oracle-input.v1", "model_dir": str(model),
               "input_token_ids": [r.randrange(vocab) for _ in range(256)],
               "candidate_tokens": [{"engine": "a", "token_id": 65, "text": "A"},
                                    {"engine": "b", "token_id": 66, "text": "B"}],
               "execution": {"device": "cpu", "dtype": "bfloat16", "threads": 2}}
        a = run(oracle, doc, tmp / "libtorch")
        b = run(hf, doc, tmp / "transformers")
        la = safetensors.torch.load_file(tmp / "libtorch" / a["logits_file"])["logits"]
        lb = safetensors.torch.load_file(tmp / "transformers" / b["logits_file"])["logits"]
        checks = {
            "logits_sha256": a["logits_sha256"] == b["logits_sha256"],
            "logits bytes": la.numpy().tobytes() == lb.numpy().tobytes(),
            "argmax": a["argmax"] == b["argmax"],
            "candidates": [(c["logit"], c["rank"]) for c in a["candidate_tokens"]] ==
                          [(c["logit"], c["rank"]) for c in b["candidate_tokens"]],
            "bytes_used": a["bytes_used"] == b["bytes_used"],
        }
        for name, ok in checks.items():
            print(f"{'PASS' if ok else 'FAIL'}  {name}")
        if not checks["logits bytes"]:
            diff = (la - lb).abs()
            print(f"  {int((diff > 0).sum())} of {la.numel()} logits differ, max {float(diff.max())}")
        print(f"backend {b.get('backend')}, transformers {b['transformers']['version']}, "
              f"{b['transformers']['modeling_file']} {b['transformers']['modeling_sha256']}")
        return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
