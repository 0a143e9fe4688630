"""assay-hf-worker's error line keeps its head: the code and the offending value survive the
2000-byte excerpt of stderr that assayd puts in a failed job's error (issue 36, defect 6: an
unknown model_type's error was cut from the front, leaving only the tail of transformers' list of
model types).

Usage: error_head_test.py ASSAY_HF_WORKER
"""
import json
import os
import subprocess
import sys
import tempfile


def main(argv):
    worker = argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        os.mkdir(model)
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump({"model_type": "assay-no-such-type", "architectures": ["NoSuchForCausalLM"],
                       "vocab_size": 16}, f)
        with open(os.path.join(model, "model.safetensors"), "wb") as f:
            header = b'{"w":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}'
            f.write(len(header).to_bytes(8, "little") + header + b"\0\0")
        work = os.path.join(tmp, "work")
        os.mkdir(work)
        doc = {"schema": "assay.oracle-input.v1", "model_dir": model, "input_token_ids": [1, 2],
               "candidate_tokens": [{"engine": "a", "token_id": 1, "text": "x"}],
               "execution": {"device": "cpu", "dtype": "bfloat16", "threads": 1}}
        with open(os.path.join(work, "input.json"), "w") as f:
            json.dump(doc, f)
        run = subprocess.run([worker, "next-token", "--input", os.path.join(work, "input.json"),
                              "--workdir", work], capture_output=True, text=True, timeout=600)
    err = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else ""
    excerpt = run.stderr.encode()[-2000:].decode(errors="replace")  # what assayd keeps
    failures = []
    if run.returncode != 2:
        failures.append(f"exit {run.returncode}, expected 2")
    if not err.startswith("assay-hf-worker: error [model.unsupported]"):
        failures.append(f"the error line does not start with its code: {err[:200]!r}")
    if "assay-no-such-type" not in excerpt or "[model.unsupported]" not in excerpt:
        failures.append(f"assayd's 2000-byte excerpt lost the head: {excerpt[:300]!r}")
    if "characters cut" not in err:
        failures.append("transformers' long list was not cut in the middle")
    for f in failures:
        print("FAIL:", f)
    print(f"{1 - min(1, len(failures))} passed, {min(1, len(failures))} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
