#!/usr/bin/env bash
# run.sh: the GPU check, on a test host with one NVIDIA GPU, a PyTorch with CUDA and transformers
# (default /opt/torch/.venv), g++ and nvcc, and neither apt nor network. Run tests/gpu/prepare.sh
# on a development machine first and bring tests/gpu/stage/ with the tree. Under 8 minutes:
#   1. builds assay-oracle against that host's torch (cmake -DASSAY_ORACLE_ONLY=ON);
#   2. the transformers parity on cuda (tests/hf_parity/hf_parity.py --device cuda): bitwise
#      against transformers eager on the same torch and GPU expected, the largest difference
#      printed where not;
#   3. the CUDA start probe under the worker's seccomp filter and namespaces
#      (tests/contain/gpu_start_probe.sh, with the oracle on a tiny fixture on the GPU);
#   4. the Qwen3-4B-shaped forward on the GPU, T=42 and T=1024, timed, with the evidence's GPU
#      settings printed.
#
#   tests/gpu/run.sh [--venv DIR] [--skip-4b]
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=/opt/torch/.venv
skip4b=0
while [ $# -gt 0 ]; do
  case $1 in
    --venv) venv=$2; shift 2 ;;
    --skip-4b) skip4b=1; shift ;;
    -h | --help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown argument \"$1\" (see --help)" >&2; exit 2 ;;
  esac
done
stage=$root/tests/gpu/stage
py=$venv/bin/python
export ASSAY_PYTHON3=$py
[ -x "$py" ] || { echo "run.sh: no Python at $py (--venv)" >&2; exit 2; }
[ -d "$stage/debs" ] || { echo "run.sh: no $stage (run tests/gpu/prepare.sh where apt works)" >&2; exit 2; }
work=${ASSAY_GPU_WORK:-$(mktemp -d /var/tmp/assay-gpu.XXXXXX)}
chmod 755 "$work"
say() { printf '\n== %s (%ds)\n' "$*" "$SECONDS"; }
status=0
step() { local name=$1; shift; if "$@"; then echo "PASS $name"; else echo "FAIL $name"; status=1; fi; }

say "host"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2
"$py" -c "import torch, transformers; print('torch', torch.__version__, torch.version.git_version, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"

say "headers and cmake from the stage"
sysroot=$work/sysroot
mkdir -p "$sysroot"
for deb in "$stage"/debs/*.deb; do
  if command -v dpkg-deb >/dev/null; then dpkg-deb -x "$deb" "$sysroot"
  else (cd "$sysroot" && ar p "$deb" data.tar.xz | tar -xJ); fi
done
cmake_bin=$(command -v cmake || true)
if [ -z "$cmake_bin" ]; then
  "$py" -m pip install -q --no-index --target "$work/cmake" "$stage"/wheels/cmake-*.whl
  cmake_bin=$work/cmake/bin/cmake
fi
torch_dir=$("$py" -c "import os, torch; print(os.path.dirname(torch.__file__))")

say "build assay-oracle against $torch_dir"
build=$work/build
multiarch=$sysroot/usr/lib/x86_64-linux-gnu
step build "$cmake_bin" -S "$root" -B "$build" -DASSAY_ORACLE_ONLY=ON -DCMAKE_BUILD_TYPE=Release \
  -DASSAY_TORCH_DIR="$torch_dir" -DASSAY_PYTHON3="$py" \
  -DCMAKE_PREFIX_PATH="$sysroot/usr;$multiarch/cmake" \
  -DOPENSSL_ROOT_DIR="$sysroot/usr" -DOPENSSL_INCLUDE_DIR="$sysroot/usr/include" \
  -DOPENSSL_CRYPTO_LIBRARY="$multiarch/libcrypto.a" -DOPENSSL_USE_STATIC_LIBS=ON
step compile "$cmake_bin" --build "$build" -j"$(nproc)" --target assay-oracle assay-fingerprint
oracle=$build/worker/assay-oracle
[ -x "$oracle" ] || { echo "run.sh: the oracle did not build"; exit 1; }

say "transformers parity on cuda"
step hf_parity_cuda "$py" "$root/tests/hf_parity/hf_parity.py" --oracle "$oracle" --device cuda \
  --threads 4
step hf_parity_cpu "$py" "$root/tests/hf_parity/hf_parity.py" --oracle "$oracle" --device cpu \
  --threads 4 --lengths 1,8,301

say "CUDA start probe under the worker filter"
step gpu_start_probe bash "$root/tests/contain/gpu_start_probe.sh" "$stage/assayd" "$oracle"

if [ $skip4b = 0 ]; then
  say "Qwen3-4B-shaped forward on the GPU"
  model=$work/qwen3-4b
  "$py" "$root/tests/fixtures/make_fixture.py" --arch qwen3 --size 4b --shards 4 --out "$model" >/dev/null
  for t in 42 1024; do
    ids=$("$py" -c "import random; r=random.Random($t); print(','.join(str(r.randrange(150000)) for _ in range($t)))")
    /usr/bin/time -f "T=$t wall %e s, peak RSS %M KB" "$oracle" logits --model "$model" \
      --token-ids "$ids" --out "$work/4b-$t.safetensors" --device cuda --verbose 2>&1 | tail -4
  done
  rm -rf "$model"
fi
say "done: $([ $status = 0 ] && echo all passed || echo FAILURES)"
exit $status
