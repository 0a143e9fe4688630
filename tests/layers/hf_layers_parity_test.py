"""Layer captures of the two oracle backends, transformers itself and a deliberately broken
engine, on tiny models made with transformers' classes: a Llama and a Qwen3.5 text model whose
layer 0 is Gated DeltaNet (linear_attn).

Usage: hf_layers_parity_test.py ASSAY_ORACLE|- ASSAY_HF_WORKER

Per model, with token ids chosen (the first of seeded random sequences) so that RMSNorm in
bfloat16 at layers.1.post_attention_layernorm flips the last position's argmax:
  * assay-hf-worker layers (rows all) and transformers without hooks (from_pretrained, plain
    forward) give the same logits_sha256: the captures change no bit;
  * tests/layers/engine_rows.py unperturbed holds the worker's rows bit for bit; perturbed, its
    first boundary that differs is exactly the perturbed one (bf16-softmax at layers.1.self_attn
    too);
  * patching with the perturbed rows (F32 for one model, BF16 for the other) holds the reference
    argmax up to layers.1.self_attn and first flips at the perturbed boundary, nothing rounded;
  * rows "last" is the last row of rows "all";
  * assay-oracle layers (unless ASSAY_ORACLE is "-") on the same input.json: every boundary's
    rows, logits_sha256, argmax and the patching argmaxes equal assay-hf-worker's; and so on
    assay's Qwen3.5 fixture, laid out as Qwen publishes it (model.language_model.*, tied);
  * output.json validates against schemas/oracle-layers-output.schema.json;
  * the worker refuses, by name, a patch file with a NaN, a wrong shape or an unknown tensor.
Exit 0 when every check passes.
"""
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile

import jsonschema
import torch
import transformers

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "hf_parity"))
import engine_rows  # noqa: E402
import recompute_metrics  # noqa: E402
from hf_parity import make_model  # noqa: E402

PERTURBED = "layers.1.post_attention_layernorm"
PERTURB = f"{PERTURBED}=bf16-rmsnorm"
OUTPUT_SCHEMA = json.loads((ROOT / "schemas" / "oracle-layers-output.schema.json").read_text())
TOKENS, SEARCHED = 8, 1000


def configs():
    small = dict(hidden_size=64, intermediate_size=128, vocab_size=320,
                 max_position_embeddings=1024, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    return [
        ("llama", transformers.LlamaConfig(**small, tie_word_embeddings=False), "F32"),
        ("qwen3_5-text", transformers.Qwen3_5TextConfig(
            **small, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention"]), "BF16"),
    ]


class Checks:
    def __init__(self):
        self.failures = 0

    def check(self, label, ok, detail=""):
        print(f"{'PASS' if ok else 'FAIL'}  {label}" + (f"  ({detail})" if detail else ""))
        self.failures += not ok


def sha256_f32(t):
    return engine_rows.worker.sha256_id(t.float().contiguous().numpy().tobytes())


def flipping_ids(model, vocab):
    """The first of SEARCHED seeded random id sequences whose argmax the perturbation flips.
    One batched forward each way screens them; each candidate is then confirmed alone, as the
    workers run it."""
    batch = []
    for seed in range(SEARCHED):
        r = random.Random(seed)
        batch.append([r.randrange(vocab) for _ in range(TOKENS)])
    modules = engine_rows.worker.boundary_modules(model)
    argmaxes = []
    for spec in (None, PERTURB):
        with engine_rows.perturbed(modules, spec), torch.inference_mode():
            logits = model(input_ids=torch.tensor(batch), use_cache=False).logits[:, -1]
        argmaxes.append(logits.float().argmax(-1))
    for seed in torch.nonzero(argmaxes[0] != argmaxes[1]).flatten().tolist():
        _, clean = engine_rows.engine_rows(model, batch[seed], "last")
        _, broken = engine_rows.engine_rows(model, batch[seed], "last", PERTURB)
        if int(torch.argmax(clean)) != int(torch.argmax(broken)):
            return seed, batch[seed]
    raise SystemExit(f"no sequence of {SEARCHED} flips the argmax under {PERTURB}")


def run_worker(worker, doc, work, fds=()):
    work.mkdir()
    (work / "input.json").write_text(json.dumps(doc))
    proc = subprocess.run([worker, "layers", "--input", "input.json", "--workdir", "."],
                          cwd=work, capture_output=True, text=True, pass_fds=fds)
    output = json.loads((work / "output.json").read_text()) if proc.returncode == 0 else None
    return proc, output


def rows_of(work):
    return {name: rows for name, (_, rows) in
            recompute_metrics.read_rows(work / "layers.safetensors").items()}


def first_difference(a, b):
    return next((n for n in a if a[n].tobytes() != b[n].tobytes()), None)


def patch_file_with(path, name, tensor, source):
    """A copy of the engine rows file at source with tensor `name` replaced (or added)."""
    tensors = {n: torch.from_numpy(rows.copy()) for n, (_, rows) in
               recompute_metrics.read_rows(source).items()}
    tensors[name] = tensor
    engine_rows.write_rows(path, tensors, "F32", {})


def refusals(hf, doc, tmp, checks):
    """A bad patch file is refused by request.bad_layer_rows naming its tensor."""
    good = tmp / "engine-perturbed.safetensors"
    t = len(doc["token_ids"])
    nan = torch.from_numpy(recompute_metrics.read_rows(good)[PERTURBED][1].copy())
    nan[0, 0] = float("nan")
    cases = {
        "NaN": (PERTURBED, nan),
        "wrong shape": (PERTURBED, nan[:, :32].nan_to_num()),
        "unknown tensor": ("layers.7.mlp", torch.zeros(t, 64)),
    }
    for label, (name, tensor) in cases.items():
        path = tmp / f"bad-{label.replace(' ', '-')}.safetensors"
        patch_file_with(path, name, tensor, good)
        fd = os.open(path, os.O_RDONLY)
        try:
            bad = dict(doc, patch=dict(doc["patch"], fd=fd))
            proc, _ = run_worker(hf, bad, tmp / f"refuse-{label.replace(' ', '-')}", (fd,))
        finally:
            os.close(fd)
        checks.check(f"refuses a patch file with {label} (request.bad_layer_rows naming {name})",
                     proc.returncode == 2 and "[request.bad_layer_rows]" in proc.stderr and
                     repr(name) in proc.stderr, proc.stderr.strip().splitlines()[-1:])


def check_model(name, config, patch_dtype, oracle, hf, tmp, checks):
    print(f"== {name}")
    model_dir = make_model(transformers, torch, name, config, str(tmp))
    model = engine_rows.load_model(model_dir)
    seed, ids = flipping_ids(model, config.vocab_size)
    print(f"ids (seed {seed}): {ids}")

    with torch.inference_mode():
        plain = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    clean, clean_logits = engine_rows.engine_rows(model, ids, "all")
    broken, broken_logits = engine_rows.engine_rows(model, ids, "all", PERTURB)
    candidate = int(torch.argmax(broken_logits))
    perturbed_file = tmp / "engine-perturbed.safetensors"
    engine_rows.write_rows(perturbed_file, broken, patch_dtype, {})

    fd = os.open(perturbed_file, os.O_RDONLY)
    doc = {"schema": "assay.oracle-layers-input.v1", "model_dir": model_dir, "token_ids": ids,
           "rows": "all", "execution": {"device": "cpu", "dtype": "bfloat16", "threads": 2},
           "patch": {"fd": fd, "boundaries": list(broken), "candidate_token_id": candidate}}
    try:
        proc, out = run_worker(hf, doc, tmp / f"{name}-hf", (fd,))
        if out is None:
            raise SystemExit(f"assay-hf-worker layers failed: {proc.stderr}")
        reference = rows_of(tmp / f"{name}-hf")
        if oracle != "-":
            oproc, oout = run_worker(oracle, doc, tmp / f"{name}-oracle", (fd,))
    finally:
        os.close(fd)

    jsonschema.Draft202012Validator(OUTPUT_SCHEMA).validate(out)
    checks.check("output.json validates", True)
    names = [b["name"] for b in out["boundaries"]]
    mixer = "linear_attn" if "qwen3_5" in name else "self_attn"
    checks.check("boundaries in forward order in output.json and layers.safetensors",
                 names == list(reference) == list(clean) and names[2] == f"layers.0.{mixer}" and
                 len(names) == 2 + 5 * config.num_hidden_layers, names)
    checks.check("boundary sha256 are of the rows' F32 bytes",
                 all(b["sha256"] == engine_rows.worker.sha256_id(reference[b["name"]].tobytes())
                     for b in out["boundaries"]))
    checks.check("captures change no logit bit (worker vs plain transformers forward)",
                 out["logits_sha256"] == sha256_f32(plain) == sha256_f32(clean_logits))
    checks.check("argmax is plain transformers'", out["argmax_token_id"] ==
                 int(torch.argmax(plain)), f"{out['argmax_token_id']} vs candidate {candidate}")
    checks.check("engine_rows.py unperturbed equals the worker's rows bitwise",
                 first_difference(reference, {n: t.numpy() for n, t in clean.items()}) is None)
    differs = first_difference(reference, {n: t.numpy() for n, t in broken.items()})
    checks.check(f"perturbed engine first differs at {PERTURBED}", differs == PERTURBED, differs)
    softmax, _ = engine_rows.engine_rows(model, ids, "all", "layers.1.self_attn=bf16-softmax")
    differs = first_difference(reference, {n: t.numpy() for n, t in softmax.items()})
    checks.check("bf16 softmax engine first differs at layers.1.self_attn",
                 differs == "layers.1.self_attn", differs)

    patching = out["patching"]
    flips = [b["name"] for b in patching["boundaries"] if b["becomes_candidate"]]
    checks.check(f"patching ({patch_dtype} rows) first flips at {PERTURBED}",
                 flips[:1] == [PERTURBED], f"flips at {flips}")
    checks.check("patching holds the reference argmax at every boundary before it",
                 all(b["argmax_token_id"] == out["argmax_token_id"]
                     for b in patching["boundaries"][:names.index(PERTURBED)]))
    checks.check("patching rounds nothing (rows widened from bf16), names the file",
                 all(b["rounded_elements"] == 0 for b in patching["boundaries"]) and
                 patching["forwards"] == len(names) and patching["file_sha256"] ==
                 engine_rows.worker.sha256_id(perturbed_file.read_bytes()))

    last_doc = {k: v for k, v in doc.items() if k != "patch"}
    last_doc["rows"] = "last"
    _, last = run_worker(hf, last_doc, tmp / f"{name}-hf-last")
    last_rows = rows_of(tmp / f"{name}-hf-last")
    checks.check("rows last is the last row of rows all",
                 last is not None and last["logits_sha256"] == out["logits_sha256"] and
                 all(last_rows[n].shape == (1, 64) and
                     last_rows[n].tobytes() == reference[n][-1:].tobytes() for n in names))

    if oracle != "-":
        if oout is None:
            checks.check("assay-oracle layers ran", False, oproc.stderr.strip())
        else:
            theirs = rows_of(tmp / f"{name}-oracle")
            differ = [n for n in names if n not in theirs or
                      theirs[n].tobytes() != reference[n].tobytes()]
            detail = [(n, float(abs(theirs[n].astype("f8") - reference[n]).max()))
                      for n in differ if n in theirs and theirs[n].shape == reference[n].shape]
            checks.check("assay-oracle rows bitwise equal the hf worker's, every boundary",
                         not differ and list(theirs) == names, differ and
                         f"first {differ[0]}; max abs diff {detail[:3]}")
            jsonschema.Draft202012Validator(OUTPUT_SCHEMA).validate(oout)
            checks.check("assay-oracle output.json validates", True)
            checks.check("assay-oracle logits_sha256 and argmax equal",
                         oout["logits_sha256"] == out["logits_sha256"] and
                         oout["argmax_token_id"] == out["argmax_token_id"])
            keys = ("index", "name", "argmax_token_id", "becomes_candidate", "rounded_elements",
                    "logits_sha256")
            mine = [[b[k] for k in keys] for b in patching["boundaries"]]
            its = [[b.get(k) for k in keys]
                   for b in (oout.get("patching") or {}).get("boundaries", [])]
            checks.check("assay-oracle patching equal (argmax, rounded elements, file sha256)",
                         mine == its and oout["patching"]["file_sha256"] ==
                         patching["file_sha256"])
    return doc


def substitution_rounds(checks):
    """The substituting hook converts to the module's dtype and counts what that rounds."""
    counts = {}
    rows = torch.tensor([[1.0, 1.0 + 2.0 ** -10], [-3.0, 0.1]])  # [T = 2, hidden = 2]
    output = (torch.zeros(1, 2, 2, dtype=torch.bfloat16), "weights")
    new = engine_rows.worker.substitute_hook(rows, counts)(None, (), output)
    checks.check("substitution returns the rows in bf16 and counts 2 rounded elements",
                 new[1] == "weights" and new[0].dtype == torch.bfloat16 and
                 new[0].float().tolist() == [[[1.0, 1.0], [-3.0, 0.10009765625]]] and
                 counts["rounded"] == 2, f"{new[0].float().tolist()}, {counts}")


def nested_fixture_parity(oracle, hf, tmp, checks):
    """assay's Qwen3.5 fixture as Qwen publishes it (model.language_model.*, tied embeddings,
    mtp weights): both backends' rows and logits bitwise equal."""
    print("== qwen3_5 fixture (multimodal layout, tied)")
    model_dir = tmp / "qwen3_5-fixture"
    subprocess.run([sys.executable, str(ROOT / "tests/fixtures/make_fixture.py"), "--arch",
                    "qwen3_5", "--size", "tiny", "--out", str(model_dir)], check=True,
                   capture_output=True)
    r = random.Random(35)
    doc = {"schema": "assay.oracle-layers-input.v1", "model_dir": str(model_dir),
           "token_ids": [r.randrange(256) for _ in range(TOKENS)], "rows": "all",
           "execution": {"device": "cpu", "dtype": "bfloat16", "threads": 2}}
    runs = {}
    for label, worker in (("hf", hf), ("oracle", oracle)):
        proc, out = run_worker(worker, doc, tmp / f"fixture-{label}")
        if out is None:
            checks.check(f"{label} layers ran on the fixture", False, proc.stderr.strip())
            return
        runs[label] = (out, rows_of(tmp / f"fixture-{label}"))
    (a, rows_a), (b, rows_b) = runs["hf"], runs["oracle"]
    checks.check("fixture: rows bitwise equal at every boundary, logits_sha256 equal",
                 list(rows_a) == list(rows_b) == [x["name"] for x in b["boundaries"]] and
                 first_difference(rows_a, rows_b) is None and
                 a["logits_sha256"] == b["logits_sha256"],
                 f"first difference {first_difference(rows_a, rows_b)}")


def main(argv):
    if len(argv) != 3:
        raise SystemExit(__doc__)
    oracle = argv[1] if argv[1] == "-" else os.path.abspath(argv[1])
    hf = os.path.abspath(argv[2])
    checks = Checks()
    substitution_rounds(checks)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for name, config, patch_dtype in configs():
            work = tmp / name
            work.mkdir()
            doc = check_model(name, config, patch_dtype, oracle, hf, work, checks)
            if name == "llama":
                refusals(hf, doc, work, checks)
        if oracle != "-":
            nested_fixture_parity(oracle, hf, tmp, checks)
    print(f"{checks.failures} failure(s)")
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
