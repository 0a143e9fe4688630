#!/usr/bin/python3
"""Adds issue 16's fields to a fidelity receipt exactly as supervisor/pipelines/fidelity.cpp is to
(until it does): re-runs the job's captures and `assay-compare run` (with token_ids and thresholds
in its input), then writes the receipt with comparison_kind, metric, scope, comparator, gates and
comparison.statistics, and the supervisor's two reproduction gates decided from the capture
outputs and fingerprints. result_sha256 is recomputed; the DSSE signature is NOT (this is a view
for reports and docs, not a record).

Usage: assemble_receipt.py JOB_DIR ORACLE COMPARE OUT_DIR [THRESHOLDS_JSON]
writes OUT_DIR/fidelity-result.json and OUT_DIR/kl.safetensors.
"""
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys


def canonical(v):
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha(b):
    return "sha256:" + hashlib.sha256(b).hexdigest()


def capture_content_digest(out):
    """sha256 of the canonical captures array without file names: what a capture run produced."""
    caps = [{k: v for k, v in c.items() if k != "file"} for c in out["captures"]]
    return sha(canonical(caps).encode())


def main(job, oracle, compare, out_dir, thresholds):
    fingerprint = str(pathlib.Path(oracle).parent.parent / "fingerprint" / "assay-fingerprint")
    job, out_dir = pathlib.Path(job), pathlib.Path(out_dir)
    work = out_dir / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    receipt = json.loads((job / "result.json").read_text())
    request = json.loads((job / "request.json").read_text())
    captures = {}
    for side in ("reference", "reproduction", "candidate"):
        cin = job / ("capture-" + side) / "input.json"
        if not cin.exists():
            continue
        wd = work / side
        wd.mkdir()
        subprocess.run([oracle, "capture", "--input", str(cin), "--workdir", str(wd)], check=True,
                       capture_output=True)
        captures[side] = json.loads((wd / "output.json").read_text())
    cmp_in = json.loads((job / "compare" / "input.json").read_text())
    panel = {c["id"]: c for c in request["panel"]["contexts"]}
    for i, c in enumerate(cmp_in["contexts"]):
        for side in ("reference", "reproduction", "candidate"):
            if side in c:
                c[side]["path"] = str(work / side / f"capture-{i}.safetensors")
        c["token_ids"] = panel[c["id"]]["token_ids"]  # (1) the supervisor passes the panel's ids
    if thresholds:
        cmp_in["thresholds"] = thresholds  # (2) and the request's thresholds
    (work / "input.json").write_text(json.dumps(cmp_in))
    subprocess.run([compare, "run", "--input", str(work / "input.json"), "--workdir", str(work)],
                   check=True)
    cmp = json.loads((work / "output.json").read_text())

    # (3) the receipt: compare's new sections as they are, statistics beside the metrics.
    for k in ("comparison_kind", "metric", "scope", "comparator"):
        receipt[k] = cmp[k]
    for k in ("metrics", "contexts", "histogram", "positions", "statistics"):
        receipt["comparison"][k] = cmp[k]
    gates = cmp["gates"]
    if gates["reproduction"] is not None:
        # (4) the supervisor's two gates.
        gates["reproduction"]["capture_content_digest_equal"] = (
            capture_content_digest(captures["reference"]) == capture_content_digest(captures["reproduction"]))
        # Both captures read the same model_dir: fingerprint it again after the reproduction
        # capture; its identity must equal the reference's fingerprint.
        fwd = work / "fingerprint-reproduction"
        fwd.mkdir()
        subprocess.run([fingerprint, "run", "--input", str(job / "fingerprint-reference" / "input.json"),
                        "--workdir", str(fwd)], check=True, capture_output=True)
        again = json.loads((fwd / "output.json").read_text())
        ref_id = receipt["reference"]["model_identity"]["content_sha256"]
        gates["reproduction"]["weights_identity_equal"] = (
            again["model_identity"]["content_sha256"] == ref_id)
    failed = [k for k, v in sorted((gates["reproduction"] or {}).items()) if v is False]
    failed += [t["name"] for t in gates["thresholds"] if not t["passed"]]
    any_gate = bool(gates["reproduction"]) or bool(gates["thresholds"])
    gates["status"] = "failed" if failed else ("passed" if any_gate else "none")
    gates["failed"] = failed
    receipt["gates"] = gates
    if receipt.get("reproduction"):
        for k in ("kl", "top1_agreement", "digests_equal", "confirmed"):
            receipt["reproduction"][k] = cmp["reproduction"][k]
    art = (work / "kl.safetensors").read_bytes()
    (out_dir / "kl.safetensors").write_bytes(art)
    receipt["kl_artifact"] = {"name": "kl.safetensors", "bytes": len(art), "sha256": sha(art)}
    receipt.pop("result_sha256", None)
    receipt["result_sha256"] = sha(canonical(receipt).encode())
    (out_dir / "fidelity-result.json").write_text(json.dumps(receipt, indent=1))
    shutil.rmtree(work)


if __name__ == "__main__":
    if len(sys.argv) not in (5, 6):
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(2)
    main(*sys.argv[1:5], json.loads(sys.argv[5]) if len(sys.argv) == 6 else None)
