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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
