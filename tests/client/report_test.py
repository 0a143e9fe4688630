#!/usr/bin/python3
"""`assay report` renders each result kind into self-contained HTML that headless Chromium draws.

Usage: report_test.py ASSAY_BINARY
For the committed next-token and fidelity results in fixtures/report (with their artifacts beside
them; the fidelity receipt carries issue 16's fields, assembled by assemble_receipt.py) and a
layer-attribution result built here (valid against its schema; an engine named <script>, zeros,
an omitted and an undefined boundary, patching), the next-token result with a numerics envelope and
an engine-audit result (both built here, valid against their schemas, their classes computed by
`assay numerics classify` and `assay numerics audit`; the strip plot's reference diamond and
member dots, the audit's interval are drawn): the page has no script and loads nothing,
validates as a receipt where it should, reads as text in w3m, and its Chromium screenshot is
non-trivial (size, distinct colours, no single colour over 97%; the layer chart's decisive marker
is drawn). Exit 0 when all hold; 77 (skipped) when chromium is not installed.
"""
import hashlib
import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from html import unescape

from PIL import Image

HERE = pathlib.Path(__file__).resolve().parent
FIX = HERE / "fixtures" / "report"
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what)


def sha256_id(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _make_corpus():
    spec = importlib.util.spec_from_file_location("make_corpus", HERE.parent / "fuzz" / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_sealed(path, doc):
    """The document as assayd writes it: RFC 8785 canonical, result_sha256 of the rest (`assay
    report` refuses a record whose self-hash does not hold). Not signed."""
    canonical = _make_corpus().canonical
    doc = {k: v for k, v in doc.items() if k != "result_sha256"}
    doc["result_sha256"] = sha256_id(canonical(doc).encode())
    path.write_text(canonical(doc))


def layer_result(directory):
    """A layer-attribution result on a six-layer model whose engine computes layer 1's input
    RMSNorm in bf16: bitwise up to it, growing after it, decisive there; layers.3.mlp omitted,
    layers.4.self_attn undefined (reference RMS 0). Written with layers.safetensors beside it."""
    fx = json.loads((FIX / "result.json").read_text())
    process = fx["oracle"]["process"]
    names = ["embedding"]
    for n in range(6):
        attn = "linear_attn" if n % 3 != 2 else "self_attn"
        names += [f"layers.{n}.{part}" for part in ("input_layernorm", attn, "post_attention_layernorm", "mlp")]
        names.append(f"layers.{n}")
    names.append("norm")
    rel = {}
    for i, name in enumerate(names):
        rel[name] = 0.0 if i < 6 else 3e-3 * 1.08 ** (i - 6) * (3 if i >= 13 else 1)
    rel["layers.3.mlp"] = None  # omitted
    rel["layers.4.linear_attn"] = "undefined"
    artifact = b"reference rows standing in for layers.safetensors"
    (directory / "layers.safetensors").write_bytes(artifact)
    boundaries, omitted, prev = [], [], None
    first_nb = first_over = largest = None
    best = 0.0
    for i, name in enumerate(names):
        v = rel[name]
        b = {"index": i, "name": name, "present": v is not None, "bitwise_equal": None,
             "cosine_similarity": None, "max_abs_error": None, "mean_abs_error": None,
             "root_mean_square_error": None, "reference_root_mean_square": None,
             "relative_root_mean_square_error": None, "relative_rmse_growth": None,
             "reference_sha256": sha256_id(b"ref " + name.encode()), "engine_sha256": None,
             "engine_dtype": None}
        if v is None:
            omitted.append(name)
        else:
            b.update(engine_sha256=sha256_id(b"eng " + name.encode()), engine_dtype="BF16")
            if v == "undefined":
                b.update(bitwise_equal=False, max_abs_error=0.5, mean_abs_error=0.1,
                         root_mean_square_error=0.2, reference_root_mean_square=0.0)
            else:
                b.update(bitwise_equal=v == 0, cosine_similarity=1 - v * v / 2, max_abs_error=6 * v,
                         mean_abs_error=0.8 * v, root_mean_square_error=v,
                         reference_root_mean_square=1.0, relative_root_mean_square_error=v)
                if prev is not None:
                    b["relative_rmse_growth"] = v - prev
                    if v - prev > best:
                        best, largest = v - prev, {"index": i, "name": name}
                prev = v
                if first_over is None and v > 0.01:
                    first_over = {"index": i, "name": name}
            if first_nb is None and b["bitwise_equal"] is False:
                first_nb = {"index": i, "name": name}
        boundaries.append(b)
    patched = [{"index": b["index"], "name": b["name"], "argmax_token_id": 9 if b["index"] >= 6 else 4,
                "becomes_candidate": b["index"] >= 6, "seconds": 0.05, "rounded_elements": 0,
                "logits_sha256": "sha256:" + ("9" if b["index"] >= 6 else "4") * 64}
               for b in boundaries if b["present"]]
    doc = {
        "schema": "assay.layer-attribution-result.v1", "created_at_utc": "2026-12-03T09:00:00.000Z",
        "duration_seconds": 6.5, "job_id": "j-layers-report-0001", "supervisor": fx["supervisor"],
        "request": {"schema": "assay.layer-attribution-request.v1", "id": "bf16-rmsnorm-layer-1",
                    "sha256": sha256_id(b"request"), "model_dir": "/models/six-layers", "input_length": 24,
                    "input_token_ids_sha256": sha256_id(b"ids"), "rows": "all",
                    "tolerance": {"relative_rmse": 0.01}, "patching": True},
        "model_identity": fx["model_identity"],
        "model_fingerprint": {"implementation_sha256": None, "files": None, "process": process},
        "engine": {"name": "<script>alert(1)</script>", "next_token_id": 9,
                   "rows_file": {"path": "/data/engine-rows.safetensors", "sha256": sha256_id(b"engine"),
                                 "bytes": 1 << 20},
                   "boundaries_given": len(names) - len(omitted), "omitted": omitted},
        "reference": {"argmax_token_id": 4, "argmax_logit": 17.25, "logits_sha256": sha256_id(b"logits"),
                      "hidden_size": 64, "boundary_count": len(names), "rows_sha256": sha256_id(artifact),
                      "output": {"forward_seconds": 0.4}, "process": process},
        "boundaries": boundaries, "first_non_bitwise": first_nb, "first_over_tolerance": first_over,
        "largest_growth": largest,
        "patching": {"candidate_token_id": 9, "reference_argmax_token_id": 4, "forwards": len(patched),
                     "seconds": 0.05 * len(patched), "boundaries": patched,
                     "first_flip": {"index": 6, "name": names[6]}, "last_hold": {"index": 5, "name": names[5]}},
        "comparison": {"seconds": 0.02, "process": process}, "containment": fx["containment"],
        "layers_artifact": {"name": "layers.safetensors", "bytes": len(artifact), "sha256": sha256_id(artifact)},
    }
    path = directory / "layers-result.json"
    write_sealed(path, doc)
    return path


def bf16_step(v):
    """The spacing of bfloat16 numbers at |v| (8 significant bits)."""
    import math
    e = math.frexp(abs(v))[1] - 1 if v else -126
    return 2.0 ** (max(e, -126) - 7)


def numerics_result(directory, assay):
    """The committed next-token result with an envelope: 16 reduction orders, sdpa, kv-cache and
    batched:3 whose top logits move by whole bf16 steps (a seeded pattern), the float32 answer
    off the bf16 grid. The class comes from the product's own rule (`assay numerics classify`),
    so the page is drawn from figures that agree with each other."""
    import random
    fx = json.loads((FIX / "result.json").read_text())
    o = fx["oracle"]
    top = [(t["token_id"], t["logit"]) for t in o["top_tokens"]]
    cands = [{"engine": c["engine"], "token_id": c["token_id"]} for c in o["candidate_tokens"]]
    rng = random.Random(7)

    def member(name, logits):
        order = sorted(logits, key=lambda t: (-t[1], t[0]))
        val = dict(logits)
        return {"name": name, "argmax": order[0][0], "argmax_logit": order[0][1],
                "top_tie": order[0][1] == order[1][1], "margin": order[0][1] - order[1][1],
                "top": [{"token_id": t, "logit": l} for t, l in order[:5]],
                "candidates": [{"token_id": c["token_id"], "logit": val[c["token_id"]],
                                "rank": 1 + sum(l > val[c["token_id"]] for _, l in logits)}
                               for c in cands],
                # The reference member is the record's own forward (verify checks it is).
                "logits_sha256": o["logits_sha256"] if name == "reference" else sha256_id(name.encode())}

    names = ["reference"] + [f"reduction:{i}" for i in range(16)] + ["sdpa", "kv-cache", "batched:3"]
    members = []
    for name in names:
        moved = top if name == "reference" else [
            (t, l + rng.choice([-1, 0, 0, 0, 1]) * bf16_step(l)) for t, l in top]
        members.append(member(name, moved))
    fp32 = member("fp32", [(t, l + 0.0013 * (1 + i % 3)) for i, (t, l) in enumerate(top)])
    policy = {"spread_factor": 3.0, "margin_steps": 1.0}
    line = json.dumps({"members": members, "candidates": cands, "fp32": fp32, "policy": policy})
    r = subprocess.run([assay, "numerics", "classify", "-"], input=line, capture_output=True,
                       text=True)
    check(r.returncode == 0, f"assay numerics classify: {r.returncode} {r.stderr}")
    verdict = json.loads(r.stdout.splitlines()[0])  # the verdict itself, one line per envelope
    # Fields results carry since the fixture was recorded.
    fx["request"].setdefault("receipts", {"checked": False, "reason": "the request names none"})
    fx["request"].setdefault("prompt_check", {"checked": False, "reason": "the request gives ids"})
    fx["numerics"] = {
        "requested": {"reduction_seeds": 16, "batch_sizes": [3]}, "policy": policy,
        "candidates": cands, "members": members, "fp32": fp32,
        "transformers_reference_bitwise_equal": True, "verdict": verdict,
        "worker": {"numerics_module_sha256": sha256_id(b"module"), "executable_sha256": None,
                   "transformers": None, "threads": 2, "load_seconds": 0.5, "forward_seconds": 1.5,
                   "process": o["process"]}}
    path = directory / "numerics-result.json"
    write_sealed(path, fx)
    (directory / "logits.safetensors").write_bytes((FIX / "logits.safetensors").read_bytes())
    return path


def audit_result(directory, assay):
    """An engine-audit result over 12 contexts whose engine is about 1.5x the farthest member
    (a seeded panel of sums); its statistics come from the product's rule (`assay numerics
    audit`)."""
    import random
    fx = json.loads((FIX / "result.json").read_text())
    rng = random.Random(3)
    members = ["reference", "reduction:0", "reduction:1", "reduction:2", "sdpa"]
    contexts = []
    for i in range(12):
        unit = 24 * (1e-4 + 2e-5 * rng.random())
        sums = [unit * (0.6 + 0.35 * rng.random()) for _ in members]
        sums[2] = unit
        contexts.append({"id": f"c{i}", "positions": 24, "engine_sum": unit * (2.1 + 0.4 * rng.random()),
                         "member_sums": sums, "argmax_differs": rng.randrange(0, 3)})
    line = json.dumps({"members": members, "contexts": contexts, "policy": {"alpha": 0.01}})
    r = subprocess.run([assay, "numerics", "audit", "-"], input=line, capture_output=True, text=True)
    check(r.returncode == 0, f"assay numerics audit: {r.returncode} {r.stderr}")
    stats = json.loads(r.stdout.splitlines()[0])  # the statistics themselves, one line per audit
    doc = {
        "schema": "assay.engine-audit-result.v1", "created_at_utc": "2026-12-05T09:00:00.000Z",
        "duration_seconds": 41.0, "job_id": "j-audit-report-0001", "supervisor": fx["supervisor"],
        "request": {"schema": "assay.engine-audit-request.v1", "id": "rope-theta-panel",
                    "sha256": sha256_id(b"request"), "model_dir": "/models/llama-tiny",
                    "contexts": 12, "positions": 288,
                    "audit": {"reduction_seeds": 3, "sdpa": True, "policy": {"alpha": 0.01}}},
        "model_identity": fx["model_identity"], "model_fingerprint": fx["model_fingerprint"],
        "engine": {"name": "engine <b>rope+1%</b>",
                   "logits_files": [{"context": c["id"], "path": f"/data/{c['id']}.safetensors",
                                     "sha256": sha256_id(c["id"].encode()), "dtype": "F32"}
                                    for c in contexts],
                   "argmax_differs_from_reference": sum(c["argmax_differs"] for c in contexts)},
        "anchor": "fp32", "members": members, "contexts": contexts, "statistics": stats,
        "worker": {"threads": 2}, "containment": fx["containment"],
        "audit_artifact": {"name": "audit.json", "bytes": 100, "sha256": sha256_id(b"audit")},
    }
    path = directory / "audit-result.json"
    write_sealed(path, doc)
    return path, stats


def kiln_id(doc):
    """Kiln's canonical sha256 (json.dumps sort_keys, compact, ASCII), as model identities use."""
    return sha256_id(json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())


def prompt_result(directory):
    """The committed next-token result made to answer an assay request written here: resealed
    with the request's sha256, its token ids' sha256 and the hash of the tokenizer in the model
    directory beside it (fixture_lib's byte-level BPE, id = byte), the identity's content_sha256
    recomputed. Returns (result, request, model directory)."""
    sys.path.insert(0, str(HERE.parent / "fixtures"))
    import fixture_lib
    canonical = _make_corpus().canonical
    model = directory / "model"
    model.mkdir(parents=True)
    tok, cfg = fixture_lib.build_tokenizer(512)
    (model / "tokenizer.json").write_text(json.dumps(tok))
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    doc = json.loads((FIX / "result.json").read_text())
    ids = list("Say \"hi\"\x01\nto me".encode())
    request = {"schema": "assay.next-token-request.v1", "id": doc["request"]["id"],
               "model_dir": str(model), "input_token_ids": ids,
               "candidates": [{"engine": c["engine"], "token_id": c["token_id"], "text": c["text"]}
                              for c in doc["oracle"]["candidate_tokens"]]}
    (directory / "request.json").write_text(json.dumps(request))
    doc["request"]["sha256"] = sha256_id(canonical(request).encode())
    doc["request"]["input_token_ids_sha256"] = sha256_id(json.dumps(ids, separators=(",", ":")).encode())
    identity = doc["model_identity"]
    identity["tokenizer_hash"] = sha256_id((model / "tokenizer.json").read_bytes())
    identity["content_sha256"] = kiln_id({k: identity[k] for k in (
        "id", "config_hash", "tokenizer_hash", "chat_template_hash", "weight_files")})
    result = directory / "result.json"
    write_sealed(result, doc)
    shutil.copy(FIX / "logits.safetensors", directory / "logits.safetensors")
    return result, directory / "request.json", model


def prompt_refusals(tmp, assay, result, request, model):
    """What `assay report --request` refuses, and what it shows without a tokenizer it trusts."""
    def report(*args):
        out = tmp / "refused.html"
        out.unlink(missing_ok=True)
        r = subprocess.run([assay, "report", *map(str, args), "-o", str(out)], capture_output=True, text=True)
        return r, (out.read_text() if out.exists() else None)
    # A request with one id changed is not the one the result answers: exit 6, nothing written.
    other = json.loads(request.read_text())
    other["input_token_ids"][0] += 1
    changed = tmp / "other-request.json"
    changed.write_text(json.dumps(other))
    r, page = report(result, "--request", changed)
    check(r.returncode == 6 and "is not the request this result answers" in r.stderr and page is None,
          f"--request with another request: exit {r.returncode} {r.stderr[-300:]}")
    r, page = report(result, "--request", HERE / "fixtures" / "kiln-request-v1.json")
    check(r.returncode == 6 and page is None, f"--request with Kiln's request: exit {r.returncode}")
    r, page = report(result, "--request", FIX / "fidelity-result.json")
    check(r.returncode == 7 and "is not a next-token request" in r.stderr and page is None,
          f"--request with a result file: exit {r.returncode} {r.stderr[-200:]}")
    r, page = report(result, "--model", model)
    check(r.returncode == 2 and "needs --request" in r.stderr, f"--model alone: exit {r.returncode}")
    r, page = report(FIX / "fidelity-result.json", "--request", request)
    check(r.returncode == 7 and "applies to a next-token result" in r.stderr,
          f"--request with a fidelity result: exit {r.returncode} {r.stderr[-200:]}")
    # A tokenizer that is not the result's is not used: the ids are not decoded, the page says why.
    r, page = report(result, "--request", request, "--model", HERE.parent / "fixtures" / "qwen3-tokenizer")
    check(r.returncode == 0 and page and "not decoded:" in page and "not the result&#39;s tokenizer_hash" in page
          and '<pre class="prompt">' not in page, f"another tokenizer: exit {r.returncode} {r.stderr[-200:]}")
    # Without --request the page says how to show the prompt.
    r, page = report(result)
    check(r.returncode == 0 and page and "--request FILE" in page, "without --request the page says how")
    # Kiln's real request against a record resealed to answer it: its message and template
    # options shown, the continuation prefix counted apart, no model directory to decode with.
    check_out = subprocess.run([assay, "--json", "request", "check", str(HERE / "fixtures" / "kiln-request-v1.json")],
                               capture_output=True, text=True)
    check(check_out.returncode == 0, f"request check of Kiln's request: {check_out.stderr[-200:]}")
    if check_out.returncode == 0:
        digests = json.loads(check_out.stdout)
        doc = json.loads(result.read_text())
        doc["request"]["sha256"] = digests["request_sha256"]
        doc["request"]["input_token_ids_sha256"] = digests["input_token_ids_sha256"]
        kiln = tmp / "kiln" / "result.json"
        kiln.parent.mkdir()
        write_sealed(kiln, doc)
        r, page = report(kiln, "--request", HERE / "fixtures" / "kiln-request-v1.json")
        text = " ".join(unescape(re.sub(r"<[^>]+>", " ", page or "")).split())
        check(r.returncode == 0 and "Marker sequence: raven | nickel" in text and "enable_thinking" in text
              and "166 input tokens (163 of the prompt, then 3 forced by the continuation prefix)" in text
              and "a Kiln request names no model directory" in text,
              f"Kiln's request: exit {r.returncode} {r.stderr[-200:]} {text[:600]}")


def main(assay):
    chromium = shutil.which("chromium")
    if not chromium:
        print("chromium is not installed (scripts/install-deps installs it): skipped")
        return 77
    v = subprocess.run([sys.executable, str(HERE.parent / "tools" / "validate_schema.py"),
                        str(HERE.parent.parent / "schemas" / "fidelity-result.schema.json"),
                        str(FIX / "fidelity-result.json")], capture_output=True, text=True)
    check(v.returncode == 0, "the fidelity fixture validates as a receipt: " + v.stdout + v.stderr)
    with tempfile.TemporaryDirectory(prefix="assay-report-") as tmp:
        tmp = pathlib.Path(tmp)
        layers = layer_result(tmp)
        v = subprocess.run([sys.executable, str(HERE.parent / "tools" / "validate_schema.py"),
                            str(HERE.parent.parent / "schemas" / "layer-attribution-result.schema.json"),
                            str(layers)], capture_output=True, text=True)
        check(v.returncode == 0, "the layer result validates against its schema: " + v.stdout + v.stderr)
        envelope = numerics_result(tmp, assay)
        audit, stats = audit_result(tmp, assay)
        for schema, doc in (("next-token-oracle-result", envelope), ("engine-audit-result", audit)):
            v = subprocess.run([sys.executable, str(HERE.parent / "tools" / "validate_schema.py"),
                                str(HERE.parent.parent / "schemas" / f"{schema}.schema.json"), str(doc)],
                               capture_output=True, text=True)
            check(v.returncode == 0, f"{doc.name} validates against {schema}: " + v.stdout + v.stderr)
        prompt, request, model = prompt_result(tmp / "prompt")
        prompt_refusals(tmp, assay, prompt, request, model)
        env_class = json.loads(envelope.read_text())["numerics"]["verdict"]["class"]
        check(stats["class"] == "beyond_legitimate", f"the audit's seeded panel is beyond: {stats}")
        cases = [(FIX / "result.json", ["Next-token oracle verdict", "produced the reference argmax",
                                        "Top-10 reference logits", "kiln", "vllm", "Containment evidence"]),
                 (FIX / "fidelity-result.json", ["Fidelity receipt", "Gates", "min_top1_agreement",
                                                 "Gates: passed", "weights_identity_equal",
                                                 "Token-wise KL along positions", "KL cumulative distribution",
                                                 "Same top p"]),
                 (layers, ["Layer attribution", "<script>alert(1)</script>", "first leaves the reference at "
                           "boundary 6 layers.1.input_layernorm", "Decisive: with the engine's rows substituted "
                           "at 6 layers.1.input_layernorm", "it grows most at 13 layers.2.post_attention_layernorm",
                           "Relative RMSE against depth", "Per boundary", "omitted", "last hold",
                           "layers.4.linear_attn", "is the result's artifact"]),
                 (envelope, ["Bug or numerics", env_class, "legitimate bf16 executions",
                             "reduction:15", "kv-cache", "batched:3", "fp32 (not a member)",
                             "grid: one bf16 step", "every member's figures"]),
                 (FIX / "trajectory-result.json", ["Trajectory: where each engine left the reference",
                                                   "vllm departed first", "at index 2 of the continuation",
                                                   "The engines first differ at index 2", "→ kiln",
                                                   "First departures", "(position 13)"]),
                 (FIX / "batch-result.json", ["Next-token batch", "3 states: 3 succeeded, 0 failed",
                                              "kiln 1, neither 1, vllm 1", "state-2", "Oracle runs",
                                              "States"]),
                 (prompt, ["Next-token oracle verdict", "Prompt", "As the model saw it", "decoded with",
                           'Say "hi"\\u0001\\n', "to me", "15 input tokens"], ["--request", request]),
                 (audit, ["Engine audit", "engine <b>rope+1%</b>", "beyond_legitimate",
                          "Beyond legitimate", "1 = the farthest legitimate execution",
                          "x the legitimate spread", "Per context", "c11", "reduction:2"])]
        for path, words, *extra in cases:
            name = path.name if path != prompt else "prompt-result.json"
            out = tmp / (name + ".html")
            r = subprocess.run([assay, "report", str(path), "-o", str(out)] + [str(a) for a in (extra[0] if extra else [])],
                               capture_output=True, text=True)
            check(r.returncode == 0, f"{name}: exit {r.returncode} {r.stderr}")
            if r.returncode:
                continue
            html = out.read_text()
            check('<p class="unverified" role="status">NOT VERIFIED: the self-hash holds' in html,
                  f"{name}: the page says its signature was not checked")
            check("<script" not in html.lower(), f"{name}: no script")
            urls = [u for u in re.findall(r"(?:https?:)?//[^\s\"'<>)]+", html) if u != "http://www.w3.org/2000/svg"]
            check(not urls, f"{name}: loads nothing from the network, found {urls[:3]}")
            want_svgs = {"fidelity-result.json": 3, "numerics-result.json": 2}.get(name, 1)
            check(html.count("<svg") >= want_svgs, f"{name}: inline SVG charts")
            check(path == audit or "from logits.safetensors" in html or "from kl.safetensors" in html
                  or "layers.safetensors beside the result is the result&#39;s artifact" in html
                  or "trajectory.safetensors beside the result is the result&#39;s artifact" in html
                  or "states.jsonl beside the result is the result&#39;s artifact" in html,
                  f"{name}: the artifact beside the result was read")
            text = subprocess.run(["w3m", "-dump", "-T", "text/html", str(out)], capture_output=True,
                                  text=True).stdout if shutil.which("w3m") else unescape(html)
            text = " ".join(text.split())  # w3m wraps lines
            for w in words:
                check(w in text, f"{name}: the page says {w!r}")
            png = tmp / (name + ".png")
            # The envelope's strip plot sits around y = 1520..1650: a 1600-px window cut its
            # member dots off by a few pixels of layout (a flake seen twice).
            height = 2400 if path == envelope else 1600
            s = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                f"--window-size=1000,{height}", f"--screenshot={png}", out.as_uri()],
                               capture_output=True, text=True, timeout=120)
            check(s.returncode == 0 and png.exists(), f"{name}: chromium screenshot: {s.stderr[-300:]}")
            if not png.exists():
                continue
            img = Image.open(png).convert("RGB")
            colors = img.getcolors(maxcolors=1 << 20) or []
            top = max(n for n, _ in colors) / (img.width * img.height) if colors else 1
            check(png.stat().st_size > 30000, f"{name}: screenshot {png.stat().st_size} bytes")
            check(len(colors) > 200, f"{name}: {len(colors)} distinct colours")
            check(top < 0.97, f"{name}: the most common colour covers {top:.1%}")
            if path == envelope:
                # The reference's orange diamonds and the members' blue dots are drawn.
                for what, (cr, cg, cb), least in (("reference diamond", (0xdc, 0x76, 0x33), 100),
                                                   ("member dots", (0x3b, 0x6f, 0xd1), 100)):
                    n = sum(k for k, (r_, g, b) in colors if abs(r_ - cr) + abs(g - cg) + abs(b - cb) < 40)
                    check(n > least, f"{name}: {n} pixels of the {what}' colour")
            if path == audit:
                # The engine's interval and point are drawn in the bug colour (#c0392b).
                red = sum(k for k, (r_, g, b) in colors if abs(r_ - 0xc0) + abs(g - 0x39) + abs(b - 0x2b) < 40)
                check(red > 150, f"{name}: {red} pixels of the engine's interval colour")
            if path.name == "fidelity-result.json":
                # Axes scaled to the data (its KL sits in 1e-3..1e-2), the KL gate drawn on both
                # KL axes, the histogram binned over the data's own range.
                check("1e-16" not in html and ">1e-3<" in html and ">1e-1<" in html,
                      f"{name}: the KL axes span the data's decades, not a fixed 1e-16 floor")
                check(html.count('class="threshold"') == 2 and "gate max_mean_kl &lt;= 0.05" in html,
                      f"{name}: the max_mean_kl gate is drawn on the positions and CDF charts")
                check("24 bins over the data&#39;s range" in html,
                      f"{name}: the histogram bins the artifact's values over their range")
                bars = re.findall(r'<rect x="[0-9.]+" y="[0-9.]+" width="[0-9.]+" height="([0-9.]+)" '
                                  r'fill="#3366cc"', html)
                check(sum(float(h) > 0 for h in bars) >= 10, f"{name}: {len(bars)} bars, most not empty")
            if path.name == "trajectory-result.json":
                # Each engine's track: green while it follows the argmax, red at its departure.
                for what, (cr, cg, cb) in (("followed", (0x2e, 0x9e, 0x5b)), ("departure", (0xc0, 0x39, 0x2b))):
                    n = sum(k for k, (r_, g, b) in colors if abs(r_ - cr) + abs(g - cg) + abs(b - cb) < 40)
                    check(n > 300, f"{name}: {n} pixels of the {what} cells' colour")
            if path.name == "batch-result.json":
                # The neither bar is drawn in red, the engines' in blue.
                for what, (cr, cg, cb) in (("neither", (0xc0, 0x39, 0x2b)), ("engine", (0x3b, 0x6f, 0xd1))):
                    n = sum(k for k, (r_, g, b) in colors if abs(r_ - cr) + abs(g - cg) + abs(b - cb) < 40)
                    check(n > 300, f"{name}: {n} pixels of the {what} bars' colour")
            if path == layers:
                # The decisive boundary's purple marker line and label are drawn (#8e44ad).
                purple = sum(n for n, (r_, g, b) in colors
                             if abs(r_ - 0x8e) + abs(g - 0x44) + abs(b - 0xad) < 60)
                check(purple > 150, f"{name}: {purple} pixels of the decisive marker's colour")
            print(f"{name}: {len(html)} bytes of HTML, screenshot {png.stat().st_size} bytes, "
                  f"{len(colors)} colours, background {top:.1%}")
        # A candidate whose text holds control bytes: each shown as its escape, marked, never as
        # an invisible byte or an empty box; the containment figures with their units.
        doc = json.loads((FIX / "result.json").read_text())
        doc["oracle"]["candidate_tokens"][0]["text"] = "a\u0019b\n"
        doc.pop("result_sha256")
        ctl = tmp / "ctl" / "result.json"
        ctl.parent.mkdir()
        write_sealed(ctl, doc)
        out = tmp / "ctl.html"
        r = subprocess.run([assay, "report", str(ctl), "-o", str(out)], capture_output=True, text=True)
        check(r.returncode == 0, f"control-byte text: exit {r.returncode} {r.stderr}")
        html = out.read_text() if out.exists() else ""
        check('a<span class="ctl">\\u0019</span>b<span class="ctl">\\n</span>' in html,
              "a candidate's control bytes are shown as marked escapes")
        check("\x19" not in html, "no raw control byte reaches the page")
        check("62.3 MiB (65359872)" in html and "host_memory.available_bytes_before" in html,
              "containment bytes are humanised, the exact figure beside them")
        check("word-break:break-all" in html, "long cgroup paths wrap")
        # A record's own figures never make the page unbounded or wrong: a trajectory claiming a
        # continuation of 10^12 tokens draws at most 4096 cells, fast; KL values that are NaN or
        # infinite (artifact and record rehashed to match) place no point off the axes.
        doc = json.loads((FIX / "trajectory-result.json").read_text())
        doc["engines"][0]["continuation_length"] = 10 ** 12
        huge = tmp / "huge" / "trajectory-result.json"
        huge.parent.mkdir()
        write_sealed(huge, doc)
        t0 = time.monotonic()
        r = subprocess.run([assay, "report", str(huge), "-o", str(tmp / "huge.html")],
                           capture_output=True, text=True, timeout=60)
        check(r.returncode == 0 and time.monotonic() - t0 < 20
              and (tmp / "huge.html").read_text().count("<rect") < 4096 + 100,
              f"a claimed 10^12-token continuation: exit {r.returncode}, {time.monotonic() - t0:.1f} s")
        import numpy as np
        from safetensors.numpy import load_file, save_file
        kl = load_file(str(FIX / "kl.safetensors"))
        name = next(k for k, v in kl.items() if v.dtype == np.float64 or v.dtype == np.float32)
        kl[name] = kl[name].copy()
        kl[name][0], kl[name][1] = np.inf, np.nan
        bad = tmp / "nonfinite"
        bad.mkdir()
        save_file(kl, str(bad / "kl.safetensors"))
        doc = json.loads((FIX / "fidelity-result.json").read_text())
        data = (bad / "kl.safetensors").read_bytes()
        doc["kl_artifact"]["sha256"] = sha256_id(data)
        doc["kl_artifact"]["bytes"] = len(data)
        write_sealed(bad / "fidelity-result.json", doc)
        r = subprocess.run([assay, "report", str(bad / "fidelity-result.json"), "-o",
                            str(tmp / "nonfinite.html")], capture_output=True, text=True, timeout=60)
        page = (tmp / "nonfinite.html").read_text() if r.returncode == 0 else ""
        coords = re.findall(r'(?:c[xy]|[xy][12]?|d)="([^"]*)"', page)
        check(r.returncode == 0 and "from kl.safetensors" in page
              and not any(re.search(r"nan|inf", c, re.I) for c in coords),
              f"NaN and infinite KL values: exit {r.returncode} {r.stderr[-200:]}, "
              f"{[c for c in coords if re.search(r'nan|inf', c, re.I)][:3]}")
        # Each record changed after it was sealed (its verdict, say) is refused, nothing written.
        for path in (FIX / "result.json", FIX / "fidelity-result.json", layers, envelope, audit,
                     FIX / "trajectory-result.json", FIX / "batch-result.json"):
            doc = json.loads(path.read_text())
            doc["created_at_utc"] = "2000-01-01T00:00:00Z"
            changed = tmp / ("changed-" + path.name)
            changed.write_text(json.dumps(doc, separators=(",", ":"), sort_keys=True))
            out = tmp / ("changed-" + path.name + ".html")
            r = subprocess.run([assay, "report", str(changed), "-o", str(out)], capture_output=True, text=True)
            check(r.returncode == 6 and "result_sha256: claimed" in r.stderr and not out.exists(),
                  f"changed {path.name}: exit {r.returncode}, {r.stderr[-300:]}")
    # A document of another kind is refused with a message naming its schema.
    r = subprocess.run([assay, "report", str(HERE.parent.parent / "schemas" / "compare-input.schema.json"),
                        "-o", "/dev/null"], capture_output=True, text=True)
    check(r.returncode != 0 and "not schema" in r.stderr, f"another document is refused: {r.stderr}")
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("report_test: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
