#!/usr/bin/python3
"""`assay report` renders both result kinds into self-contained HTML that headless Chromium draws.

Usage: report_test.py ASSAY_BINARY
For the committed next-token and fidelity results in fixtures/report (with their artifacts beside
them; the fidelity receipt carries issue 16's fields, assembled by assemble_receipt.py): the page
has no script and loads nothing, validates as a receipt where it should, reads as text in w3m, and
its Chromium screenshot is non-trivial (size, distinct colours, no single colour over 97%).
Exit 0 when all hold; 77 (skipped) when chromium is not installed.
"""
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

from PIL import Image

HERE = pathlib.Path(__file__).resolve().parent
FIX = HERE / "fixtures" / "report"
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what)


def main(assay):
    chromium = shutil.which("chromium")
    if not chromium:
        print("chromium is not installed (scripts/install-deps installs it): skipped")
        return 77
    v = subprocess.run([sys.executable, str(HERE.parent / "tools" / "validate_schema.py"),
                        str(HERE.parent.parent / "schemas" / "fidelity-result.schema.json"),
                        str(FIX / "fidelity-result.json")], capture_output=True, text=True)
    check(v.returncode == 0, "the fidelity fixture validates as a receipt: " + v.stdout + v.stderr)
    cases = [("result.json", ["Next-token oracle verdict", "produced the reference argmax",
                              "Top-10 reference logits", "kiln", "vllm", "Containment evidence"]),
             ("fidelity-result.json", ["Fidelity receipt", "Gates", "min_top1_agreement", "Gates: passed",
                                       "weights_identity_equal", "Token-wise KL along positions",
                                       "KL cumulative distribution", "Same top p"])]
    with tempfile.TemporaryDirectory(prefix="assay-report-") as tmp:
        tmp = pathlib.Path(tmp)
        for name, words in cases:
            out = tmp / (name + ".html")
            r = subprocess.run([assay, "report", str(FIX / name), "-o", str(out)], capture_output=True, text=True)
            check(r.returncode == 0, f"{name}: exit {r.returncode} {r.stderr}")
            if r.returncode:
                continue
            html = out.read_text()
            check("<script" not in html.lower(), f"{name}: no script")
            urls = [u for u in re.findall(r"(?:https?:)?//[^\s\"'<>)]+", html) if u != "http://www.w3.org/2000/svg"]
            check(not urls, f"{name}: loads nothing from the network, found {urls[:3]}")
            check(html.count("<svg") >= (1 if name == "result.json" else 3), f"{name}: inline SVG charts")
            check("from logits.safetensors" in html or "from kl.safetensors" in html,
                  f"{name}: the artifact beside the result was read")
            text = subprocess.run(["w3m", "-dump", "-T", "text/html", str(out)], capture_output=True,
                                  text=True).stdout if shutil.which("w3m") else html
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
