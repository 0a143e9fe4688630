#!/opt/assay/venv/bin/python
"""Checks assay-compare against an independent numpy computation on the same logits.

Usage: independent_kl.py ASSAY_COMPARE_BINARY

Writes random logits files (F32 and BF16, several contexts, vocab 151,936 and 1,001; logits
~ N(0, 3), candidate = reference + N(0, 0.5) so the KL is far from 0) with its own safetensors
writer, runs `assay-compare run`, and checks with numpy in fp64 (x - max, exp, sum, log; no
scipy, no code shared with assay): every token-wise KL in the artifact to 1e-12 relative, both
argmaxes exactly, the statistics (np.mean, np.percentile), top-1 agreement, max_at, histogram,
every digest (hashlib), and both documents against their JSON Schemas. Then the llama.cpp-style
statistics (issue 16): KL mean and standard error and percentiles, same-top fraction and its
standard error, Δp of the reference's top token and of the actual next token (mean, standard
error, RMS and its standard error, percentiles), the perplexities of both sides over the
positions whose next token is known, their ln ratio, ratio and difference with standard errors,
the correlation of the per-token ln PPL, and the threshold gates, all to 1e-10 relative (plus
1e-14 absolute for values near 0). Exit 0 when all hold.
"""
import hashlib
import json
import os
import pathlib
import struct
import subprocess
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
SCHEMAS = HERE.parent.parent / "schemas"
VALIDATE = HERE.parent / "tools" / "validate_schema.py"
REL = 1e-12
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what)


def bf16_bits(x):
    """float32 -> bf16 bits, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype="<f4").view("<u4").astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def write_safetensors(path, tensors, metadata=None):
    """tensors: list of (name, dtype, shape, bytes)."""
    header, offset, blobs = {}, 0, []
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def write_logits(path, values, dtype):
    """values: float32 [rows, vocab]. Returns the raw tensor bytes."""
    data = bf16_bits(values).tobytes() if dtype == "BF16" else np.ascontiguousarray(values, "<f4").tobytes()
    write_safetensors(path, [("logits", dtype, values.shape, data)], {"writer": "independent_kl.py"})
    return data


def read_safetensors(path):
    raw = pathlib.Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    np_dtype = {"F64": "<f8", "I64": "<i8", "F32": "<f4", "BF16": "<u2"}
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=np_dtype[t["dtype"]]).reshape(t["shape"])
    return out, header.get("__metadata__", {})


def as_f64(stored, dtype):
    if dtype == "BF16":
        return (stored.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return stored.astype(np.float64)


def log_softmax(x):
    m = x.max()
    e = np.exp(x - m)
    s = e.sum()
    return (x - m) - np.log(s), e / s


def sha(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def close(a, b):
    return abs(a - b) <= REL * abs(b)


def near(a, b, rel=1e-10, tiny=1e-14):
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= rel * abs(b) + tiny


def se(v):
    return float(np.sqrt(np.var(v) / (len(v) - 1))) if len(v) >= 2 else None


def numpy_statistics(kl, same, dtop, dnext, nll_r, nll_c):
    """The statistics object as an independent numpy computation."""
    kl_p = {"p99_9": 99.9, "p99": 99, "p95": 95, "p90": 90, "median": 50, "p10": 10, "p5": 5, "p1": 1, "p0_1": 0.1}
    dp_p = {"p99_9": 99.9, "p99": 99, "p95": 95, "p90": 90, "p75": 75, "median": 50, "p25": 25, "p10": 10,
            "p5": 5, "p1": 1, "p0_1": 0.1}

    def dist(v, pcts):
        d = {"n": len(v), "mean": float(np.mean(v)), "standard_error": se(v), "max": float(v.max()), "min": float(v.min())}
        for k, q in pcts.items():
            d[k] = float(np.percentile(v, q))
        return d

    def delta(v):
        if len(v) == 0:
            return None
        d = dist(v, dp_p)
        rms = float(np.sqrt(np.mean(v * v)))
        d["rms"] = rms
        s2 = se(v * v)
        d["rms_standard_error"] = 0.5 / rms * s2 if s2 is not None and rms > 0 else None
        return d

    n = len(kl)
    p = float(np.mean(same))
    out = {"kl": dist(kl, kl_p),
           "same_top": {"n": n, "count": int(np.sum(same)), "fraction": p,
                        "standard_error": float(np.sqrt(p * (1 - p) / (n - 1))) if n >= 2 else None},
           "delta_p_top": delta(dtop), "delta_p_next": delta(dnext), "perplexity": None}
    if len(nll_r):
        m = len(nll_r)

        def side(v):
            mv, sv = float(np.mean(v)), se(v)
            ppl = float(np.exp(mv))
            return {"ppl": ppl, "ppl_standard_error": ppl * sv if sv is not None else None,
                    "mean_nll": mv, "mean_nll_standard_error": sv}
        r, c = side(nll_r), side(nll_c)
        ln = c["mean_nll"] - r["mean_nll"]
        ln_se = se(nll_c - nll_r)
        ratio = float(np.exp(ln))
        diff_se = None
        if m >= 2:
            cov = np.cov(nll_c, nll_r, bias=True)[0, 1] / (m - 1)
            diff_se = float(np.sqrt(max(0.0, c["ppl_standard_error"] ** 2 + r["ppl_standard_error"] ** 2
                                        - 2 * c["ppl"] * r["ppl"] * cov)))
        out["perplexity"] = {
            "tokens": m, "reference": r, "candidate": c,
            "ln_ppl_correlation": float(np.corrcoef(nll_c, nll_r)[0, 1]) if m >= 2 else None,
            "ln_ratio": {"value": ln, "standard_error": ln_se},
            "ratio": {"value": ratio, "standard_error": ratio * ln_se if ln_se is not None else None},
            "difference": {"value": c["ppl"] - r["ppl"], "standard_error": diff_se}}
    return out


def compare_tree(got, want, path, worst):
    """Every number of `want` near the same one of `got`; returns the worst relative difference."""
    if isinstance(want, dict):
        check(isinstance(got, dict) and set(got) == set(want), f"{path}: keys {sorted(got) if isinstance(got, dict) else got} vs {sorted(want)}")
        for k in want:
            if isinstance(got, dict) and k in got:
                worst = compare_tree(got[k], want[k], f"{path}.{k}", worst)
        return worst
    if want is None or got is None:
        check(got is None and want is None, f"{path} = {got!r}, numpy {want!r}")
        return worst
    if isinstance(want, int) and not isinstance(want, bool):
        check(got == want, f"{path} = {got!r}, numpy {want!r}")
        return worst
    check(near(got, want), f"{path} = {got!r}, numpy {want!r}")
    if want != 0:
        worst = max(worst, abs(got - want) / abs(want))
    return worst


def stats(v):
    p = np.percentile(v, [50, 95, 99, 99.9])
    return {"mean": v.mean(), "median": p[0], "p95": p[1], "p99": p[2], "p99_9": p[3],
            "max": v.max(), "min": v.min()}


def run_case(binary, work, vocab, contexts, seed, reproduction, thresholds):
    """contexts: list of (id, ranges, reference dtype, candidate dtype)."""
    rng = np.random.default_rng(seed)
    files = pathlib.Path(work) / "files"
    files.mkdir()
    wd = pathlib.Path(work) / "work"
    wd.mkdir()
    spec, truth = [], []
    for k, (cid, ranges, rdt, cdt) in enumerate(contexts):
        rows = sum(b - a for a, b in ranges)
        # Token ids for every other context (the rest: no next tokens known). The last range
        # ends at the last token, so that position's next token is unknown.
        tokens = [int(t) for t in rng.integers(0, vocab, ranges[-1][1])] if k % 2 == 0 else None
        ref = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
        cand = (ref + rng.normal(0, 0.5, (rows, vocab))).astype(np.float32)
        rp, cp = files / f"ref{k}.safetensors", files / f"cand{k}.safetensors"
        ref_raw = write_logits(rp, ref, rdt)
        cand_raw = write_logits(cp, cand, cdt)
        entry = {"id": cid, "positions": [list(r) for r in ranges],
                 "reference": {"path": str(rp), "sha256": None},
                 # every other candidate carries its sha256, as a user-supplied one does
                 "candidate": {"path": str(cp), "sha256": sha(cp.read_bytes()) if k % 2 == 0 else None},
                 "token_ids": tokens}
        if reproduction:
            pp = files / f"again{k}.safetensors"
            write_logits(pp, ref, rdt)
            entry["reproduction"] = {"path": str(pp), "sha256": None}
        spec.append(entry)
        truth.append((cid, ranges, rp, cp, rdt, cdt, ref_raw, cand_raw, tokens))
    doc = {"schema": "assay.compare-input.v1", "vocab_size": vocab, "kl_file": "kl.safetensors",
           "contexts": spec, "thresholds": thresholds}
    (wd / "input.json").write_text(json.dumps(doc, indent=1))
    r = subprocess.run([binary, "run", "--input", "input.json", "--workdir", "."], cwd=wd,
                       capture_output=True, text=True)
    check(r.returncode == 0, f"vocab {vocab}: exit {r.returncode}: {r.stderr.strip()}")
    if r.returncode != 0:
        return
    for schema, name in (("compare-input.schema.json", "input.json"), ("compare-output.schema.json", "output.json")):
        v = subprocess.run([sys.executable, str(VALIDATE), str(SCHEMAS / schema), str(wd / name)],
                           capture_output=True, text=True)
        check(v.returncode == 0, f"{name} against {schema}: {v.stdout}{v.stderr}")
    out = json.loads((wd / "output.json").read_text())
    art, meta = read_safetensors(wd / "kl.safetensors")
    check(out["kl_file_sha256"] == sha((wd / "kl.safetensors").read_bytes()), "kl_file_sha256")
    check(meta == {"schema": "assay.fidelity-kl.v1", "contexts": json.dumps([c[0] for c in contexts], separators=(",", ":"))},
          f"artifact metadata {meta}")

    kl_np, ra_np, ca_np, pos_np, ctx_np = [], [], [], [], []
    worst, worst_i = 0.0, 0
    same, dtop, dnext, nll_r, nll_c = [], [], [], [], []
    for k, (cid, ranges, rp, cp, rdt, cdt, ref_raw, cand_raw, tokens) in enumerate(truth):
        R = as_f64(read_safetensors(rp)[0]["logits"], rdt)
        C = as_f64(read_safetensors(cp)[0]["logits"], cdt)
        positions = [p for a, b in ranges for p in range(a, b)]
        for i, p in enumerate(positions):
            lr, pr = log_softmax(R[i])
            lc, _ = log_softmax(C[i])
            kl_np.append(np.sum(pr * (lr - lc)))
            t = int(np.argmax(R[i]))
            same.append(int(t == int(np.argmax(C[i]))))
            dtop.append(np.exp(lc[t]) - np.exp(lr[t]))
            if tokens is not None and p + 1 < len(tokens):
                nxt = tokens[p + 1]
                dnext.append(np.exp(lc[nxt]) - np.exp(lr[nxt]))
                nll_r.append(-lr[nxt])
                nll_c.append(-lc[nxt])
            ra_np.append(int(np.argmax(R[i])))
            ca_np.append(int(np.argmax(C[i])))
            pos_np.append(p)
            ctx_np.append(k)
        c = out["contexts"][k]
        check(c["id"] == cid, f"context {k} id")
        check(c["reference_sha256"] == sha(ref_raw), f"{cid} reference_sha256 (raw tensor bytes)")
        check(c["candidate_sha256"] == sha(cand_raw), f"{cid} candidate_sha256 (raw tensor bytes)")
        # A whole-file digest exactly where the input names one to check.
        check(c["reference_file_sha256"] is None, f"{cid} reference_file_sha256 (not asked)")
        want_file = sha(cp.read_bytes()) if k % 2 == 0 else None
        check(c["candidate_file_sha256"] == want_file, f"{cid} candidate_file_sha256")
        check(c["candidate_dtype"] == cdt and c["reference_dtype"] == rdt, f"{cid} dtypes")
    kl_np = np.array(kl_np)
    got = art["kl"]
    check(len(got) == len(kl_np), "artifact length")
    for i, (a, b) in enumerate(zip(got, kl_np)):
        if abs(a - b) / abs(b) > worst: worst, worst_i = abs(a - b) / abs(b), i
        check(close(a, b), f"kl[{i}] = {a!r}, numpy {b!r}")
    check(list(art["reference_argmax"]) == ra_np, "reference argmaxes")
    check(list(art["candidate_argmax"]) == ca_np, "candidate argmaxes")
    check(list(art["position"]) == pos_np, "positions")
    check(list(art["context_index"]) == ctx_np, "context indices")

    m = out["metrics"]
    want = stats(kl_np)
    mine = stats(got)
    for key, value in want.items():
        check(close(m["kl"][key], value), f"metrics.kl.{key} = {m['kl'][key]!r}, numpy {value!r}")
        if key != "mean":  # same values, same method: bit for bit
            check(m["kl"][key] == mine[key], f"metrics.kl.{key} vs np.percentile of the artifact")
    agree = int(np.sum(np.array(ra_np) == np.array(ca_np)))
    check(m["top1_agree_count"] == agree and m["top1_agreement"] == agree / len(kl_np), "top-1")
    at = int(np.argmax(got))
    check(m["max_at"] == {"context": contexts[ctx_np[at]][0], "position": pos_np[at]}, "max_at")
    start = 0
    for k, (cid, ranges, *_rest) in enumerate(truth):
        n = sum(b - a for a, b in ranges)
        ck = out["contexts"][k]
        part = kl_np[start:start + n]
        for key, value in stats(part).items():
            check(close(ck["kl"][key], value), f"{cid}.kl.{key}")
        ag = int(np.sum(np.array(ra_np[start:start + n]) == np.array(ca_np[start:start + n])))
        check(ck["positions"] == n and ck["top1_agree_count"] == ag, f"{cid} counts")
        start += n
    h = out["histogram"]
    edges = np.array(h["edges"])
    check(list(edges) == [10.0 ** e for e in range(-15, 3)], "histogram edges")
    pos_kl = got[got > 0]
    counts = np.bincount(np.searchsorted(edges, pos_kl, side="right"), minlength=len(edges) + 1)
    check(h["counts"] == counts.tolist() and h["zero"] == int(np.sum(got == 0))
          and h["negative"] == int(np.sum(got < 0)), "histogram counts")
    if reproduction:
        rep = out["reproduction"]
        check(rep["confirmed"] is True and rep["digests_equal"] is True, "reproduction confirmed")
        check(np.all(art["reproduction_kl"] == 0.0), "reproduction KL exactly 0")
    else:
        check(out["reproduction"] is None, "no reproduction")
    want_stats = numpy_statistics(kl_np, np.array(same), np.array(dtop), np.array(dnext),
                                  np.array(nll_r), np.array(nll_c))
    worst_stat = compare_tree(out["statistics"], want_stats, "statistics", 0.0)
    check(out["metric"]["value"] == m["kl"]["mean"], "metric.value = metrics.kl.mean")
    check(out["scope"]["next_token_positions"] == (len(nll_r) if all(t[8] is not None for t in truth) else None),
          "scope.next_token_positions")
    gates = {g["name"]: g for g in out["gates"]["thresholds"]}
    check(set(gates) == set(thresholds), f"threshold gates {sorted(gates)}")
    for name, bound in thresholds.items():
        stat = {"max_mean_kl": ("kl", "mean"), "min_top1_agreement": ("same_top", "fraction"),
                "max_kl_p99": ("kl", "p99"), "max_rms_delta_p": ("delta_p_next", "rms"),
                "max_ppl_ratio": ("perplexity", "ratio", "value")}[name]
        v = want_stats
        for part in stat:
            v = v[part]
        want_pass = v >= bound if name.startswith("min_") else v <= bound
        check(gates[name]["passed"] == want_pass and near(gates[name]["observed"], v),
              f"gate {name}: {gates[name]}, numpy {v!r}")
    failed = sorted(n for n, g in gates.items() if not g["passed"])
    check(sorted(out["gates"]["failed"]) == failed, f"gates.failed {out['gates']['failed']} vs {failed}")
    print(f"vocab {vocab}: statistics agree with numpy, worst relative difference {worst_stat:.3e}")
    print(f"vocab {vocab}: {len(kl_np)} positions, KL mean {kl_np.mean():.6f}, "
          f"worst relative difference {worst:.3e} (KL {kl_np[worst_i]:.3e}), top-1 {agree}/{len(kl_np)}")


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    binary = os.path.abspath(argv[1])
    with tempfile.TemporaryDirectory(prefix="assay-cmp-py-") as work:
        (pathlib.Path(work) / "a").mkdir()
        run_case(binary, pathlib.Path(work) / "a", 151936,
                 [("c0", [(0, 5), (10, 13)], "F32", "F32"),
                  ("c1", [(2, 6)], "F32", "BF16"),
                  ("long context/7", [(100, 103)], "BF16", "BF16")], seed=1, reproduction=False,
                 thresholds={"max_mean_kl": 1e-3, "min_top1_agreement": 0.5})
        (pathlib.Path(work) / "b").mkdir()
        run_case(binary, pathlib.Path(work) / "b", 1001,
                 [("a", [(0, 120)], "F32", "F32"),
                  ("b", [(3, 40), (41, 100)], "BF16", "F32"),
                  ("c", [(7, 8)], "F32", "BF16")], seed=2, reproduction=True,
                 thresholds={"max_mean_kl": 10.0, "max_kl_p99": 1e-6, "max_rms_delta_p": 1.0, "max_ppl_ratio": 2.0})
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("independent_kl: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
