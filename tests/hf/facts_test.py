"""What assay-hf-worker says of its own run is measured from what ran (issue 39):

  - linear_attention_implementation: "transformers_torch_fallback" (Kiln's name) for a Qwen3.5
    model, whose Gated DeltaNet layers bind transformers' torch gated delta rule here (no fla or
    causal-conv1d kernel installed), "none" for llama; the same value in its configuration;
  - transformers.python: the interpreter that ran it (sys.executable resolved) and that file's
    sha256, recomputed here.

Usage: facts_test.py ASSAY_HF_WORKER. Exit 0 when every check holds.
"""
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def run(worker, model, work):
    work.mkdir()
    doc = {"schema": "assay.oracle-input.v1", "model_dir": str(model),
           "input_token_ids": [5, 6, 7, 8],
           "candidate_tokens": [{"engine": "a", "token_id": 65, "text": "A"},
                                {"engine": "b", "token_id": 66, "text": "B"}],
           "execution": {"device": "cpu", "dtype": "bfloat16", "threads": 1}}
    (work / "input.json").write_text(json.dumps(doc))
    proc = subprocess.run([worker, "next-token", "--input", "input.json", "--workdir", "."],
                          cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{worker} exited {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads((work / "output.json").read_text())


def kiln_reader(check, arch, path, out, linear):
    """What Kiln's reader of a reference artifact requires (its load_reference): exactly
    input_ids (I64) and logits (F32, one dimension, finite), the request's ids, the metadata
    schema kiln.qwen35-hf-full-logits.v1 and the implementations; for Qwen3.5 on transformers
    they are Kiln's own ("eager", "transformers_torch_fallback"). The other metadata values are
    what the same interpreter's torch and transformers report."""
    import torch
    import transformers
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        names = sorted(f.keys())
        ids = f.get_tensor("input_ids") if "input_ids" in names else None
        logits = f.get_tensor("logits") if "logits" in names else None
    check(f"{arch}: artifact tensors are exactly input_ids and logits",
          names == ["input_ids", "logits"], names)
    check(f"{arch}: input_ids is I64 [1, N] of the request's ids",
          ids is not None and ids.dtype == torch.int64 and ids.tolist() == [[5, 6, 7, 8]], ids)
    check(f"{arch}: logits is F32, one dimension, finite",
          logits is not None and logits.dtype == torch.float32 and logits.dim() == 1
          and bool(torch.isfinite(logits).all()), None if logits is None else logits.shape)
    want = {"schema": "kiln.qwen35-hf-full-logits.v1", "attention_implementation": "eager",
            "linear_attention_implementation": linear, "input_token_ids": "[5,6,7,8]",
            "torch_version": torch.__version__, "torch_hip_version": str(torch.version.hip),
            "torch_commit": torch.version.git_version,
            "transformers_version": transformers.__version__,
            "device_name": out["device_name"]}
    for key, value in want.items():
        check(f"{arch}: metadata {key} is {value!r}", meta.get(key) == value, meta.get(key))


def main(argv):
    worker = argv[1]
    failed = []

    def check(name, ok, got):
        print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {got!r}"))
        if not ok:
            failed.append(name)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for arch, want in (("qwen3_5", "transformers_torch_fallback"), ("llama", "none")):
            model = tmp / arch
            subprocess.run([sys.executable, str(ROOT / "tests/fixtures/make_fixture.py"), "--arch",
                            arch, "--size", "tiny", "--out", str(model)], check=True,
                           capture_output=True)
            out = run(worker, model, tmp / ("work-" + arch))
            got = out["linear_attention_implementation"]
            check(f"{arch}: linear_attention_implementation is {want}", got == want, got)
            conf = out["configuration"]["linear_attention_implementation"]
            check(f"{arch}: the configuration says the same", conf == want, conf)
            python = out["transformers"]["python"]
            # The interpreter the wrapper execs (build/worker/assay-hf-worker:
            # exec '<python>' -I '<script>'), resolved as exec resolves it.
            line = next(l for l in pathlib.Path(worker).read_text().splitlines()
                        if l.startswith("exec "))
            real = os.path.realpath(line.split("'")[1])
            check(f"{arch}: transformers.python.path is the interpreter that ran",
                  python["path"] == real, python["path"])
            digest = "sha256:" + hashlib.sha256(pathlib.Path(real).read_bytes()).hexdigest()
            check(f"{arch}: transformers.python.sha256 is that file's", python["sha256"] == digest,
                  python["sha256"])
            script = line.split("'")[3]
            mine = "sha256:" + hashlib.sha256(pathlib.Path(script).read_bytes()).hexdigest()
            check(f"{arch}: executable_sha256 is the worker script's", out["executable_sha256"] == mine,
                  out["executable_sha256"])
            kiln_reader(check, arch, tmp / ("work-" + arch) / "logits.safetensors", out, want)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
