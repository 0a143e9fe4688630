#!/usr/bin/python3
"""`assay report` renders each result kind into self-contained HTML that headless Chromium draws.

Usage: report_test.py ASSAY_BINARY
For the committed next-token and fidelity results in fixtures/report (with their artifacts beside
them; the fidelity receipt carries issue 16's fields, assembled by assemble_receipt.py) and a
layer-attribution result built here (valid against its schema; an engine named <script>, zeros,
an omitted and an undefined boundary, patching): the page has no script and loads nothing,
validates as a receipt where it should, reads as text in w3m, and its Chromium screenshot is
non-trivial (size, distinct colours, no single colour over 97%; the layer chart's decisive marker
is drawn). Exit 0 when all hold; 77 (skipped) when chromium is not installed.
"""
import hashlib
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
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
        "result_sha256": sha256_id(b"not sealed: the report does not check it"),
    }
    path = directory / "layers-result.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


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
                           "layers.4.linear_attn", "is the result's artifact"])]
        for path, words in cases:
            name = path.name
            out = tmp / (name + ".html")
            r = subprocess.run([assay, "report", str(path), "-o", str(out)], capture_output=True, text=True)
            check(r.returncode == 0, f"{name}: exit {r.returncode} {r.stderr}")
            if r.returncode:
                continue
            html = out.read_text()
            check("<script" not in html.lower(), f"{name}: no script")
            urls = [u for u in re.findall(r"(?:https?:)?//[^\s\"'<>)]+", html) if u != "http://www.w3.org/2000/svg"]
            check(not urls, f"{name}: loads nothing from the network, found {urls[:3]}")
            check(html.count("<svg") >= (3 if name == "fidelity-result.json" else 1), f"{name}: inline SVG charts")
            check("from logits.safetensors" in html or "from kl.safetensors" in html
                  or "layers.safetensors beside the result is the result&#39;s artifact" in html,
                  f"{name}: the artifact beside the result was read")
            text = subprocess.run(["w3m", "-dump", "-T", "text/html", str(out)], capture_output=True,
                                  text=True).stdout if shutil.which("w3m") else unescape(html)
            text = " ".join(text.split())  # w3m wraps lines
            for w in words:
                check(w in text, f"{name}: the page says {w!r}")
            png = tmp / (name + ".png")
            s = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                "--window-size=1000,1600", f"--screenshot={png}", out.as_uri()],
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
            if path == layers:
                # The decisive boundary's purple marker line and label are drawn (#8e44ad).
                purple = sum(n for n, (r_, g, b) in colors
                             if abs(r_ - 0x8e) + abs(g - 0x44) + abs(b - 0xad) < 60)
                check(purple > 150, f"{name}: {purple} pixels of the decisive marker's colour")
            print(f"{name}: {len(html)} bytes of HTML, screenshot {png.stat().st_size} bytes, "
                  f"{len(colors)} colours, background {top:.1%}")
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
