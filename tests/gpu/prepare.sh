#!/usr/bin/env bash
# prepare.sh: what tests/gpu/run.sh needs on a GPU test host that has a PyTorch, a compiler and
# nvcc but no apt and no network, made here once into tests/gpu/stage/ (ignored by git; carry it
# to the host with the tree, under 64 MiB):
#   assayd                the statically linked supervisor (its `contain` runs the start probe)
#   debs/*.deb            headers assay-oracle builds against: nlohmann-json, CLI11, OpenSSL
#   wheels/cmake-*.whl    CMake, in case the host has none
#
#   tests/gpu/prepare.sh [BUILD_DIR]     (default build/, where scripts/build put assayd)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
stage=$root/tests/gpu/stage
rm -rf "$stage"
mkdir -p "$stage/debs" "$stage/wheels"
[ -x "$build/supervisor/assayd" ] || { echo "prepare.sh: no $build/supervisor/assayd (run scripts/build)" >&2; exit 2; }
readelf -d "$build/supervisor/assayd" | grep -q NEEDED &&
  { echo "prepare.sh: $build/supervisor/assayd is not statically linked" >&2; exit 2; }
install -m 0755 "$build/supervisor/assayd" "$stage/assayd"
(cd "$stage/debs" && apt-get download -q nlohmann-json3-dev libcli11-dev libssl-dev >/dev/null)
"${ASSAY_VENV:-/opt/assay/venv}/bin/pip" download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --platform manylinux_2_17_x86_64 -d "$stage/wheels" "cmake==3.31.6"
du -sh "$stage"
