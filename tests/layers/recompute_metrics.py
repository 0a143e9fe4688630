"""Recomputes a layer-attribution result's per-boundary metrics from the two rows files, in
numpy float64, by Kiln's definitions (kiln.rocm-hf-layer-attribution.v2 $defs/boundary, cited in
schemas/layer-attribution-result.schema.json), and says which field of which boundary differs.

    recompute_metrics.py RESULT_JSON REFERENCE_ROWS ENGINE_ROWS [--boundary NAME]

REFERENCE_ROWS is the job's layers.safetensors (F32, the reference in Kiln's "hf" role),
ENGINE_ROWS the engine's rows file of the request (F32 or BF16, Kiln's "kiln" role). Every metric
must agree within 1e-9 relative (relative_rmse_growth: relative to the larger of the two relative
errors it subtracts), the digests, bitwise_equal, present and engine_dtype exactly. Without
--boundary every boundary is checked, and so are first_non_bitwise, first_over_tolerance and
largest_growth. Exit 0 when all agree; else one line per disagreement on stderr and exit 1.
"""
import argparse
import hashlib
import json
import math
import sys

import numpy as np

TOLERANCE = 1e-9
METRICS = ("cosine_similarity", "max_abs_error", "mean_abs_error", "root_mean_square_error",
           "reference_root_mean_square", "relative_root_mean_square_error")


def sha256_id(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def read_rows(path):
    """{name: (dtype, float32 array)} of a safetensors file, in the file's order; BF16 is widened
    exactly (its bits are a float32's upper half)."""
    with open(path, "rb") as f:
        data = f.read()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header.pop("__metadata__", None)
    body = memoryview(data)[8 + size:]
    out = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        raw = body[begin:end]
        if info["dtype"] == "F32":
            rows = np.frombuffer(raw, dtype="<f4").astype(np.float32)
        elif info["dtype"] == "BF16":
            rows = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit(f"{path}: tensor {name!r} has dtype {info['dtype']}")
        out[name] = (info["dtype"], rows.reshape(info["shape"]))
    return out


def metrics(reference, engine):
    """Kiln's metrics of one boundary, float64 over every element of its rows."""
    r = reference.astype(np.float64).ravel()
    e = engine.astype(np.float64).ravel()
    if r.shape != e.shape:
        raise ValueError(f"{e.size} engine elements against {r.size} reference elements")
    d = e - r
    rmse = math.sqrt(np.mean(d * d))
    ref_rms = math.sqrt(np.mean(r * r))
    norms = math.sqrt(np.dot(r, r)) * math.sqrt(np.dot(e, e))
    if norms == 0:
        cosine = 1.0 if not r.any() and not e.any() else 0.0
    else:
        cosine = float(np.dot(r, e)) / norms
    if ref_rms == 0:
        relative = 0.0 if rmse == 0 else None
    else:
        relative = rmse / ref_rms
    reference_f32 = np.ascontiguousarray(reference, dtype="<f4").tobytes()
    engine_f32 = np.ascontiguousarray(engine, dtype="<f4").tobytes()
    return {
        "bitwise_equal": reference_f32 == engine_f32,
        "cosine_similarity": cosine,
        "max_abs_error": float(np.max(np.abs(d))),
        "mean_abs_error": float(np.mean(np.abs(d))),
        "root_mean_square_error": rmse,
        "reference_root_mean_square": ref_rms,
        "relative_root_mean_square_error": relative,
        "reference_sha256": sha256_id(reference_f32),
        "engine_sha256": sha256_id(engine_f32),
    }


def recompute(reference_rows, engine_rows):
    """[{name, present, engine_dtype, ...metrics, relative_rmse_growth}] in the reference's
    (the model's) boundary order."""
    out, previous = [], None
    for name, (_, reference) in reference_rows.items():
        if name not in engine_rows:
            out.append({"name": name, "present": False, "engine_dtype": None,
                        "bitwise_equal": None, "engine_sha256": None,
                        "reference_sha256": sha256_id(
                            np.ascontiguousarray(reference, dtype="<f4").tobytes()),
                        "relative_rmse_growth": None, **{m: None for m in METRICS}})
            continue
        dtype, engine = engine_rows[name]
        row = {"name": name, "present": True, "engine_dtype": dtype, **metrics(reference, engine)}
        relative = row["relative_root_mean_square_error"]
        # Null for the first present boundary, and where either relative error is null.
        row["relative_rmse_growth"] = (None if previous is None or relative is None else
                                       relative - previous)
        row["previous_relative"] = previous
        previous = relative
        out.append(row)
    return out


def close(a, b, scale):
    return abs(a - b) <= TOLERANCE * scale


def check_boundary(got, want):
    """Problems of one result boundary against its recomputation: ["FIELD: result X, recomputed
    Y"]."""
    problems = []

    def differ(field, a, b):
        problems.append(f"{field}: result {json.dumps(a)}, recomputed {json.dumps(b)}")

    for field in ("name", "present", "engine_dtype", "bitwise_equal", "reference_sha256",
                  "engine_sha256"):
        if got.get(field) != want[field]:
            differ(field, got.get(field), want[field])
    for field in METRICS + ("relative_rmse_growth",):
        a, b = got.get(field), want[field]
        if a is None or b is None:
            if a is not b:
                differ(field, a, b)
            continue
        scale = max(abs(a), abs(b))
        if field == "relative_rmse_growth":
            scale = max(scale, abs(want["relative_root_mean_square_error"]),
                        abs(want["previous_relative"]))
        if not close(a, b, scale):
            differ(field, a, b)
    return problems


def at(row):
    return None if row is None else {"index": row["index"], "name": row["name"]}


def check_summary(result, rows):
    """first_non_bitwise, first_over_tolerance and largest_growth from the recomputed rows."""
    present = [dict(r, index=i) for i, r in enumerate(rows) if r["present"]]
    tolerance = result["request"]["tolerance"]["relative_rmse"]
    growing = [r for r in present
               if r["relative_rmse_growth"] is not None and r["relative_rmse_growth"] > 0]
    largest = max(growing, key=lambda r: r["relative_rmse_growth"], default=None)
    if largest is not None:  # the first on a tie
        largest = next(r for r in growing
                       if r["relative_rmse_growth"] == largest["relative_rmse_growth"])
    want = {
        "first_non_bitwise": next((r for r in present if not r["bitwise_equal"]), None),
        "first_over_tolerance": next(
            (r for r in present if r["relative_root_mean_square_error"] is not None and
             r["relative_root_mean_square_error"] > tolerance), None),
        "largest_growth": largest,
    }
    problems = []
    for field, row in want.items():
        got = result.get(field)
        got = None if got is None else {"index": got.get("index"), "name": got.get("name")}
        if got != at(row):
            problems.append(f"{field}: result {json.dumps(got)}, recomputed {json.dumps(at(row))}")
    return problems


def check(result, reference_path, engine_path, boundary=None):
    """Every disagreement between the result and the rows, as lines naming boundary and field;
    [] when the result's metrics are the rows' by Kiln's definitions."""
    reference_rows, engine_rows = read_rows(reference_path), read_rows(engine_path)
    rows = recompute(reference_rows, engine_rows)
    given = result["boundaries"]
    problems = []
    names = [b.get("name") for b in given]
    if names != [r["name"] for r in rows]:
        problems.append(f"boundaries: result names {names}, reference rows {list(reference_rows)}")
        return problems
    for index, (got, want) in enumerate(zip(given, rows)):
        if boundary is not None and want["name"] != boundary:
            continue
        if got.get("index") != index:
            problems.append(f"{want['name']}: index: result {got.get('index')}, expected {index}")
        problems += [f"{want['name']}: {p}" for p in check_boundary(got, want)]
    if boundary is not None and boundary not in names:
        problems.append(f"{boundary}: no such boundary in the result")
    if boundary is None:
        problems += check_summary(result, rows)
    return problems


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result")
    parser.add_argument("reference_rows")
    parser.add_argument("engine_rows")
    parser.add_argument("--boundary", help="check this boundary only")
    args = parser.parse_args(argv[1:])
    with open(args.result, "rb") as f:
        result = json.loads(f.read())
    problems = check(result, args.reference_rows, args.engine_rows, args.boundary)
    for p in problems:
        print(f"recompute_metrics: {p}", file=sys.stderr)
    if problems:
        return 1
    checked = args.boundary or f"{len(result['boundaries'])} boundaries"
    print(f"recompute_metrics: {checked}: every metric agrees")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
