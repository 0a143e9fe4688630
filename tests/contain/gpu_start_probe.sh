#!/usr/bin/env bash
# CUDA start-up under the worker's containment (issue 14: the seccomp filter must let CUDA
# start): runs a libcuda probe (cuInit, a context, a 1 MiB allocation) through `assayd contain`
# as the default worker identity, and, when given, the oracle on a tiny fixture on the GPU.
#   usage: tests/contain/gpu_start_probe.sh [ASSAYD] [ORACLE]   (needs root and an NVIDIA GPU)
set -euo pipefail
assayd=${1:-build/supervisor/assayd}
oracle=${2:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"
cat >"$work/probe.py" <<'PY'
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
def check(name, r):
    if r != 0:
        sys.exit(f"{name} failed with CUresult {r}")
check("cuInit", cuda.cuInit(0))
n = ctypes.c_int()
check("cuDeviceGetCount", cuda.cuDeviceGetCount(ctypes.byref(n)))
dev = ctypes.c_int()
check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(dev), 0))
ctx = ctypes.c_void_p()
check("cuCtxCreate", cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev))
ptr = ctypes.c_uint64()
check("cuMemAlloc", cuda.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20))
check("cuMemFree", cuda.cuMemFree_v2(ptr))
print(f"cuda ok: {n.value} device(s)")
PY
"$assayd" contain --workdir "$work" --stdout "$work/out" --stderr "$work/err" --timeout 120 \
  -- /usr/bin/python3 "$work/probe.py" >"$work/evidence.json"
cat "$work/out" "$work/err"
/usr/bin/python3 - "$work/evidence.json" <<'PY'
import json, sys
e = json.load(open(sys.argv[1]))
assert e["exit"]["code"] == 0, e["exit"]
assert e["spawn"]["capabilities"]["effective"] == "0" * 16, e["spawn"]["capabilities"]
assert e["spawn"]["uid"] != 0, e["spawn"]["uid"]
print("gpu: CUDA started under seccomp", e["spawn"]["seccomp"]["policy_sha256"], "as uid", e["spawn"]["uid"])
PY
[ -n "$oracle" ] || exit 0
"${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}" tests/fixtures/make_fixture.py --arch llama --size tiny --out "$work/model" >/dev/null
chmod -R a+rX "$work/model"
mkdir "$work/job" && chmod 777 "$work/job"
/usr/bin/python3 - "$work" <<'PY'
import json, sys
w = sys.argv[1]
json.dump({"schema": "assay.oracle-input.v1", "model_dir": w + "/model",
           "input_token_ids": [1, 5, 9, 12, 40, 3],
           "candidate_tokens": [{"engine": "kiln", "token_id": 7, "text": "\u0007"},
                                {"engine": "vllm", "token_id": 8, "text": "\u0008"}],
           "execution": {"device": "cuda", "dtype": "bfloat16", "threads": 1}},
          open(w + "/job/input.json", "w"))
PY
"$assayd" contain --workdir "$work/job" --stderr "$work/job/err" --timeout 300 \
  -- "$(realpath "$oracle")" next-token --input input.json --workdir . >"$work/oracle.json"
cat "$work/job/err"
/usr/bin/python3 -c 'import json,sys; e=json.load(open(sys.argv[1])); assert e["exit"]["code"] == 0, e["exit"]; print("gpu: oracle ran on cuda under the filter")' "$work/oracle.json"
