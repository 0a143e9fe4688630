"""How assay-hf-worker loads weights (issue 37 item 5): each file once into a private copy that is
made read-only after it was hashed; its tensors are views of that copy, not a second allocation;
the safetensors layout is checked as the safetensors library checks it. (That the logits stay
from_pretrained's, bit for bit, on every architecture is tests/hf_parity/hf_parity.py's.)

Usage: load_test.py ASSAY_HF_WORKER
1. Malformed images (a hole between tensors, an overlap, a range past the end, a shape that
   disagrees with its bytes, a header that is not JSON) are refused with
   [model.invalid_safetensors] naming the file and the tensor; one of them through the worker's
   command line, exit 2.
2. An aligned tensor is a view of the copy (its storage lies inside the mapping); a tensor whose
   start is not a multiple of its element size is copied, with the values safetensors reads.
3. Writing to a loaded parameter in place kills the process (SIGSEGV) instead of changing the
   hashed bytes: in a child that built a tiny model with the worker's own build_model.
"""
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def worker_module():
    spec = importlib.util.spec_from_file_location("assay_hf_worker",
                                                  ROOT / "worker" / "hf" / "assay_hf_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def image(header, data):
    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + data


def load(w, torch, path, name="m.safetensors"):
    fd = os.open(path, os.O_RDONLY)
    try:
        buf, digest, size = w.read_fd_private(fd, name)
    finally:
        os.close(fd)
    return buf, w.safetensors_views(torch, buf, size, name)


def main(worker):
    import safetensors.torch
    import torch

    w = worker_module()
    worker = os.path.abspath(worker)
    with tempfile.TemporaryDirectory(prefix="assay-hf-load-") as tmp:
        tmp = pathlib.Path(tmp)
        bf = {"dtype": "BF16", "shape": [2]}
        bad = {
            "hole": image({"a": {**bf, "data_offsets": [0, 4]}, "b": {**bf, "data_offsets": [6, 10]}}, bytes(10)),
            "overlap": image({"a": {**bf, "data_offsets": [0, 4]}, "b": {**bf, "data_offsets": [2, 6]}}, bytes(6)),
            "past the end": image({"a": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}, bytes(4)),
            "shape disagrees": image({"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}}, bytes(4)),
            "not JSON": (5).to_bytes(8, "little") + b"{nope" + bytes(4),
        }
        for what, data in bad.items():
            p = tmp / "bad.safetensors"
            p.write_bytes(data)
            try:
                load(w, torch, p, "bad.safetensors")
                check(False, f"{what}: refused")
            except w.WorkerError as e:
                check(e.code == "model.invalid_safetensors" and "bad.safetensors" in str(e),
                      f"{what}: refused [{e.code}] {e}")
        # Through the command line: exit 2, the code at the head of the error line.
        model = tmp / "holed"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 16}))
        (model / "model.safetensors").write_bytes(bad["hole"])
        (tmp / "work").mkdir()
        (tmp / "work" / "input.json").write_text(json.dumps({
            "schema": "assay.oracle-input.v1", "model_dir": str(model), "input_token_ids": [1, 2],
            "candidate_tokens": [{"engine": "a", "token_id": 1, "text": "x"}],
            "execution": {"device": "cpu", "dtype": "bfloat16", "threads": 1}}))
        r = subprocess.run([worker, "next-token", "--input", "input.json", "--workdir", "."],
                           cwd=tmp / "work", capture_output=True, text=True, timeout=600)
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
        check(r.returncode == 2 and last.startswith("assay-hf-worker: error [model.invalid_safetensors]")
              and "model.safetensors" in last, f"the worker refuses a holed file: exit {r.returncode} {last[:200]}")

        # Views and copies: a U8 tensor of 3 bytes puts the BF16 one after it off its alignment.
        good = {"a": torch.arange(8, dtype=torch.float32).to(torch.bfloat16),
                "u": torch.tensor([1, 2, 3], dtype=torch.uint8),
                "z": torch.linspace(-1, 1, 6).to(torch.bfloat16).reshape(2, 3)}
        p = tmp / "good.safetensors"
        # Laid out by hand (save_file would align them): u at 0..3, a at 3..19 (off its
        # 2-byte alignment when the data starts on an even byte), z after it.
        raw = {k: t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes()
               for k, t in good.items()}
        names = {"u": "U8", "a": "BF16", "z": "BF16"}
        hdr, at = {}, 0
        for k in ("u", "a", "z"):
            hdr[k] = {"dtype": names[k], "shape": list(good[k].shape), "data_offsets": [at, at + len(raw[k])]}
            at += len(raw[k])
        h = json.dumps(hdr).encode()
        h += b" " * ((8 - len(h) % 8) % 8)  # the data starts on an 8-byte boundary
        p.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(raw[k] for k in ("u", "a", "z")))
        header = json.loads(p.read_bytes()[8:8 + int.from_bytes(p.read_bytes()[:8], "little")])
        offsets = {k: v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
        buf, views = load(w, torch, p)
        want = safetensors.torch.load(p.read_bytes())
        check(all(torch.equal(views[k], want[k]) and views[k].dtype == want[k].dtype for k in want),
              "every tensor has the values and dtype safetensors reads")
        import ctypes
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        inside = {k: base <= views[k].data_ptr() < base + len(buf) for k in views}
        start = 8 + int.from_bytes(p.read_bytes()[:8], "little")
        aligned = {k: (start + offsets[k]) % views[k].element_size() == 0 for k in views}
        check(all(inside[k] == aligned[k] for k in views) and any(aligned.values())
              and not all(aligned.values()),
              f"aligned tensors are views of the copy, others copies: aligned {aligned}, inside {inside}")

        # A loaded parameter cannot be changed in place: the write faults.
        fixture = tmp / "tiny"
        subprocess.run([sys.executable, str(ROOT / "tests" / "fixtures" / "make_fixture.py"), "--arch",
                        "llama", "--size", "tiny", "--out", str(fixture)], check=True,
                       capture_output=True)
        child = f"""
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("w", {str(ROOT / "worker" / "hf" / "assay_hf_worker.py")!r})
w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w)
built = w.build_model({{"model_dir": {str(fixture)!r},
                       "execution": {{"device": "cpu", "dtype": "bfloat16", "threads": 1}}}}, ".")
p = built.model.model.layers[0].mlp.down_proj.weight
print("built", p.dtype, flush=True)
with torch.no_grad():
    p.add_(1)
print("WROTE", flush=True)
"""
        r = subprocess.run([sys.executable, "-c", child], cwd=tmp, capture_output=True, text=True,
                           timeout=600)
        check(r.returncode == -signal.SIGSEGV and "built torch.bfloat16" in r.stdout and "WROTE" not in r.stdout,
              f"an in-place write to a loaded parameter faults: exit {r.returncode} {r.stdout.strip()} {r.stderr[-300:]}")
    print(f"{'all checks passed' if not failures else str(len(failures)) + ' check(s) failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
