"""Operator-level attribution (issue 38), end to end on tiny models made with transformers'
classes: a Qwen3 (q_norm, k_norm), a Llama with exact GELU and a Qwen3.5 text model (a Gated
DeltaNet layer and a gated-attention layer).

Usage: operators_test.py BUILD_DIR

  1. Parity: assay-hf-worker and assay-oracle `layers` with every operator boundary give the
     same rows bit for bit at every boundary, and the same logits as without the operators and
     as transformers' plain forward (capturing changes nothing).
  2. The capture kit (clients/capture), pip-installed from the tree: on transformers' model its
     rows are the reference's bit for bit at every boundary; on a Qwen3 with fused modules laid
     out as vLLM's (tests/layers/operator_engines.py: qkv_proj, gate_up_proj, an in-place rotary
     embedding, SiluAndMul) too, every boundary the layout maps.
  3. Four deliberate changes inside an operator (operator_engines.CHANGES: bf16 RoPE angles,
     bf16 softmax, q_norm's epsilon, tanh GELU), each in layer 1 of an independent engine whose
     rows the kit captures, on ids screened by a fixed rule so that the change flips the token:
     through assayd, with patching (bisection), the signed result names that operator as the
     first non-bitwise boundary and as the first flip, in fewer forwards than boundaries given;
     `assay verify` accepts it. The same change sent as layer-level rows only is narrowed to its
     block, and the result names the block's operators as the rows that would narrow it.
Exit 0 when every check passes.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import transformers

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "hf_parity"))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
sys.path.insert(0, str(ROOT / "clients" / "python"))
import operator_engines  # noqa: E402
from assay_client import Client, AssayError  # noqa: E402
from hf_parity import make_model  # noqa: E402

IDS = [5, 17, 33, 99, 2, 7, 250, 11]
SMALL = dict(hidden_size=64, intermediate_size=128, vocab_size=320, max_position_embeddings=1024,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             tie_word_embeddings=False)
failures = 0


def check(label, ok, detail=""):
    global failures
    print(f"{'PASS' if ok else 'FAIL'}  {label}" + (f"  ({detail})" if detail and not ok else ""))
    failures += not ok


def read_rows(path):
    from safetensors.torch import load_file
    return load_file(str(path))


def first_difference(reference, rows, order):
    return next((n for n in order if n in rows and not torch.equal(reference[n], rows[n])), None)


def layers_input(model_dir, ids, operators, patch=None):
    doc = {"schema": "assay.oracle-layers-input.v1", "model_dir": str(model_dir),
           "token_ids": ids, "rows": "all", "operators": operators,
           "execution": {"device": "cpu", "dtype": "bfloat16", "threads": 2}}
    if patch:
        doc["patch"] = patch
    return doc


def run_worker(worker, doc, work, fds=()):
    work.mkdir(parents=True)
    (work / "input.json").write_text(json.dumps(doc))
    proc = subprocess.run([str(worker), "layers", "--input", "input.json", "--workdir", "."],
                          cwd=work, capture_output=True, text=True, pass_fds=fds)
    if proc.returncode != 0:
        raise SystemExit(f"{worker} layers failed: {proc.stderr[-3000:]}")
    return json.loads((work / "output.json").read_text())


def parity(build, tmp, name, model_dir):
    print(f"== parity: {name}")
    model = operator_engines.load(model_dir)
    sys.path.insert(0, str(ROOT / "worker" / "hf"))
    import assay_hf_worker
    names = assay_hf_worker.all_boundary_names(model)
    operators = [n for n in names if assay_hf_worker.is_operator(n)]
    with torch.inference_mode():
        plain = model(input_ids=torch.tensor([IDS]), use_cache=False).logits[0, -1].float()
    plain_sha = assay_hf_worker.sha256_id(plain.contiguous().numpy().tobytes())
    outs, rows = {}, {}
    for label, worker in (("hf", build / "worker/assay-hf-worker"),
                          ("oracle", build / "worker/assay-oracle")):
        for ops in (operators, []):
            work = tmp / f"{name}-{label}-{len(ops)}"
            outs[label, len(ops)] = run_worker(worker, layers_input(model_dir, IDS, ops), work)
            rows[label, len(ops)] = read_rows(work / "layers.safetensors")
    hf, oracle = rows["hf", len(operators)], rows["oracle", len(operators)]
    check(f"{name}: {len(names)} boundaries, {len(operators)} of them operators, in the same "
          "order from both backends",
          list(hf) and sorted(hf) == sorted(names) and
          [b["name"] for b in outs["hf", len(operators)]["boundaries"]] == names ==
          [b["name"] for b in outs["oracle", len(operators)]["boundaries"]])
    differ = [n for n in names if not torch.equal(hf[n], oracle[n])]
    check(f"{name}: assay-oracle's rows equal transformers' bit for bit at every operator",
          not differ, differ[:3])
    shas = {outs[k]["logits_sha256"] for k in outs}
    check(f"{name}: logits unchanged by capturing operators (both backends, plain forward)",
          shas == {plain_sha}, shas)
    return model, names


def install_kit(tmp):
    site, src = tmp / "site", tmp / "kit-src"
    shutil.copytree(ROOT / "clients/capture", src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(src)],
                   check=True, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    sys.path.insert(0, str(site))
    import assay_capture
    check("the kit installs with pip from the tree and imports from there",
          pathlib.Path(assay_capture.__file__).resolve().is_relative_to(site.resolve()))
    return assay_capture


def kit_capture(kit, model, ids, path, change=None, boundaries=None, layout="transformers"):
    """The engine's rows with `change` (in its layer), captured by the kit; its next token."""
    layer = operator_engines.CHANGED_LAYER.get(change, 1)
    with operator_engines.changed(model, change, layer):
        cap = kit.Capture(model, layout=layout, boundaries=boundaries)
        try:
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            digest = cap.write(path, ids)
        finally:
            cap.close()
    return digest, int(torch.argmax(logits.float()))


def kit_checks(kit, tmp, model, names, reference_rows):
    print("== capture kit")
    digest, _ = kit_capture(kit, model, IDS, tmp / "kit.safetensors")
    got = read_rows(tmp / "kit.safetensors")
    check("kit on transformers' Qwen3: every boundary, bitwise the reference's",
          sorted(got) == sorted(names) and
          first_difference(reference_rows, got, names) is None,
          first_difference(reference_rows, got, names))
    import hashlib
    check("kit's digest is the file's",
          digest == "sha256:" + hashlib.sha256((tmp / "kit.safetensors").read_bytes()).hexdigest())
    fused = operator_engines.FusedQwen3(model).eval()
    module_names = dict(fused.named_modules())
    check("the fused model has no q_proj/gate_proj: vLLM's names",
          "model.layers.0.self_attn.qkv_proj" in module_names and
          "model.layers.0.self_attn.q_proj" not in module_names and
          "model.layers.0.mlp.gate_up_proj" in module_names)
    # The rotary embedding writes q and k in place, over q_norm's output: a hook that kept a
    # reference instead of a copy would hold rotated values.
    kept = {}
    handle = fused.model.layers[0].self_attn.q_norm.register_forward_hook(
        lambda m, a, out: kept.update(view=out, copy=out.clone()))
    cap = kit.Capture(fused, layout="vllm", config=model.config)
    with torch.inference_mode():
        fused_logits = fused(torch.tensor(IDS))[-1]
    cap.write(tmp / "fused.safetensors", IDS)
    cap.close()
    handle.remove()
    check("the fused model overwrites q_norm's output in place after its hook",
          not torch.equal(kept["view"], kept["copy"]))
    got = read_rows(tmp / "fused.safetensors")
    unmapped = [n for n in names if n not in got]
    check("vLLM layout maps every boundary but act_fn (SiluAndMul fuses it with the product)",
          all(n.endswith(".mlp.act_fn") for n in unmapped) and len(unmapped) == 2, unmapped)
    check("kit on the fused model: every mapped boundary bitwise the reference's",
          first_difference(reference_rows, got, names) is None,
          first_difference(reference_rows, got, names))
    with torch.inference_mode():
        hf_logits = model(input_ids=torch.tensor([IDS]), use_cache=False).logits[0, -1]
    check("the fused model's logits are transformers'", torch.equal(fused_logits, hf_logits))


class Daemon:
    def __init__(self, build, tmp):
        self.build, self.tmp = build, tmp
        self.sock = tmp / "assayd.sock"
        self.log = open(tmp / "assayd.log", "w")
        self.proc = subprocess.Popen(
            [str(build / "supervisor/assayd"), "serve", "--socket", str(self.sock), "--state-dir",
             str(tmp / "state"), "--containment", "none", "--log-level", "warn",
             "--fingerprint-worker", str(build / "fingerprint/assay-fingerprint"),
             "--oracle-worker", str(build / "worker/assay-oracle"),
             "--compare-worker", str(build / "compare/assay-compare")],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.client = Client(str(self.sock))
        for _ in range(300):
            try:
                self.client.health()
                break
            except AssayError:
                time.sleep(0.1)

    def run(self, request):
        job = self.client.submit(request)
        job = self.client.wait(job.id, timeout=300)
        if job.state != "succeeded":
            raise SystemExit(f"job {job.id} {job.state}: {job.raw}\n" +
                             (self.tmp / "assayd.log").read_text()[-3000:])
        return job.id, self.client.result(job.id)

    def verify(self, job_id):
        work = self.tmp / job_id
        work.mkdir()
        (work / "result.json").write_bytes(self.client.result_bytes(job_id))
        (work / "result.dsse.json").write_text(json.dumps(self.client.attestation(job_id)))
        self.client.artifact(job_id, work / "layers.safetensors")
        proc = subprocess.run(
            [str(self.build / "client/assay"), "verify", str(work / "result.json"), "--pubkey",
             str(self.tmp / "state/keys/host.pub"), "--artifact", str(work / "layers.safetensors")],
            capture_output=True, text=True)
        return proc.returncode == 0, proc.stdout + proc.stderr

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def request(name, model_dir, ids, rows_path, digest, next_token):
    return {"schema": "assay.layer-attribution-request.v1", "id": name,
            "model_dir": str(model_dir), "input_token_ids": ids, "rows": "all", "patching": True,
            "engine": {"name": name, "next_token_id": next_token,
                       "rows_file": {"path": str(rows_path), "sha256": digest}}}


def changes(kit, daemon, tmp, models):
    for change in operator_engines.CHANGES:
        print(f"== change: {change}")
        model_dir, model = models[{"tanh-gelu": "llama-gelu",
                                   "bf16-decay": "qwen3_5-text"}.get(change, "qwen3")]
        layer = operator_engines.CHANGED_LAYER[change]
        operator = f"layers.{layer}." + operator_engines.CHANGED_OPERATOR[change]
        found = operator_engines.screen(model, change, layer)
        check(f"{change}: the screen finds ids the change flips", found is not None)
        if found is None:
            continue
        ids, reference, candidate = found
        rows_path = tmp / f"{change}.safetensors"
        digest, token = kit_capture(kit, model, ids, rows_path, change)
        check(f"{change}: the engine's token is the changed one", token == candidate != reference)
        given = len(read_rows(rows_path))
        job_id, result = daemon.run(request(change, model_dir, ids, rows_path, digest, token))
        first = (result["first_non_bitwise"] or {}).get("name")
        check(f"{change}: first non-bitwise boundary is {operator}", first == operator, first)
        p = result["patching"]
        flip = (p["first_flip"] or {}).get("name")
        check(f"{change}: patching (bisect) first flips at {operator}", flip == operator, flip)
        check(f"{change}: {p['forwards']} forwards for {given} boundaries given",
              p["search"] == "bisect" and 0 < p["forwards"] < given / 5, p["forwards"])
        check(f"{change}: the reference argmax is the unchanged engine's",
              result["reference"]["argmax_token_id"] == reference)
        ok, out = daemon.verify(job_id)
        check(f"{change}: assay verify accepts the signed result", ok, out[-1500:])
        if change == "bf16-softmax":
            # The same change at layer granularity only: narrowed to its block, and the rows that
            # would narrow it further named.
            layer_level = [n for n in read_rows(rows_path) if n.count(".") < 3]
            coarse = tmp / f"{change}-layers.safetensors"
            digest, _ = kit_capture(kit, model, ids, coarse, change, boundaries=layer_level)
            _, coarse_result = daemon.run(request(change + "-layers", model_dir, ids, coarse,
                                                  digest, token))
            named = coarse_result["narrow_with"]
            check("layer-level rows: first non-bitwise is layers.1.self_attn",
                  (coarse_result["first_non_bitwise"] or {}).get("name") == "layers.1.self_attn")
            check("layer-level rows: narrow_with names self_attn's operators",
                  named and all(n.startswith("layers.1.self_attn.") for n in named) and
                  operator in named, named)
            coarse_id = coarse_result["job_id"]
            show = subprocess.run([str(daemon.build / "client/assay"), "--socket",
                                   str(daemon.sock), "layer", "show", coarse_id],
                                  capture_output=True, text=True)
            check("assay layer show names the rows that would narrow it",
                  show.returncode == 0 and "narrow it with rows at: " + named[0] in show.stdout,
                  show.stdout[-800:] + show.stderr)
            page = tmp / "coarse.html"
            (tmp / "coarse.json").write_bytes(daemon.client.result_bytes(coarse_id))
            report = subprocess.run([str(daemon.build / "client/assay"), "report",
                                     str(tmp / "coarse.json"), "-o", str(page)],
                                    capture_output=True, text=True)
            html = page.read_text() if report.returncode == 0 else report.stderr
            check("assay report drills into layers.1.self_attn and lists its operators",
                  "Inside layers.1.self_attn" in html and f"<code>{operator}</code>" in html,
                  html[-500:])
            fine_id, fine = daemon.run(request(change + "-again", model_dir, ids, rows_path,
                                               "sha256:" + __import__("hashlib").sha256(
                                                   rows_path.read_bytes()).hexdigest(), token))
            (tmp / "fine.json").write_bytes(daemon.client.result_bytes(fine_id))
            report = subprocess.run([str(daemon.build / "client/assay"), "report",
                                     str(tmp / "fine.json"), "-o", str(tmp / "fine.html")],
                                    capture_output=True, text=True)
            html = (tmp / "fine.html").read_text() if report.returncode == 0 else report.stderr
            check("with operator rows the report draws the block's operators, none to narrow with",
                  'class="drill"' in html and "would narrow" not in html and
                  fine["narrow_with"] == [], html[-500:])
            every = dict(request(change + "-every", model_dir, ids, rows_path,
                                 "sha256:" + __import__("hashlib").sha256(
                                     rows_path.read_bytes()).hexdigest(), token),
                         patch_search="every")
            _, every_result = daemon.run(every)
            pe = every_result["patching"]
            check("patch_search every: one forward per boundary given, the same first flip",
                  pe["forwards"] == given and pe["first_flip"] == p["first_flip"],
                  (pe["forwards"], pe["first_flip"], p["first_flip"]))


def main(argv):
    if len(argv) != 2:
        raise SystemExit(__doc__)
    build = pathlib.Path(argv[1]).resolve()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="assay-operators-"))
    os.chmod(tmp, 0o755)
    daemon = None
    try:
        models = {}
        for name, config in (
                ("qwen3", transformers.Qwen3Config(**SMALL, head_dim=16)),
                # Weights of std 0.1, not 0.02: the gate's pre-activations then reach where
                # tanh-approximated and exact GELU differ in bfloat16.
                ("llama-gelu", transformers.LlamaConfig(**SMALL, hidden_act="gelu",
                                                        initializer_range=0.1)),
                # Gated DeltaNet (layer 0) and gated attention (layer 1).
                ("qwen3_5-text", transformers.Qwen3_5TextConfig(
                    **SMALL, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                    layer_types=["linear_attention", "full_attention"]))):
            model_dir = pathlib.Path(make_model(transformers, torch, name, config, str(tmp)))
            model, names = parity(build, tmp, name, model_dir)
            models[name] = (model_dir, model)
            if name == "qwen3":
                qwen3_names = names
        kit = install_kit(tmp)
        reference = read_rows(tmp / f"qwen3-hf-{sum(n.count('.') >= 3 for n in qwen3_names)}"
                              / "layers.safetensors")
        kit_checks(kit, tmp, models["qwen3"][1], qwen3_names, reference)
        daemon = Daemon(build, tmp)
        changes(kit, daemon, tmp, models)
    finally:
        if daemon:
            daemon.close()
        if failures == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
