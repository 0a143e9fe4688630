#!/usr/bin/env bash
# --device cuda with a LibTorch that has no GPU half (a CPU-only build: no libtorch_cuda.so, no
# libtorch_hip.so beside libtorch_cpu.so) ends in a clear oracle.device_unavailable that names
# the folder, before any model file is read; not a crash and not a silent CPU run.
#   gpu_backend_missing.sh ASSAY_ORACLE
set -euo pipefail
oracle=$1
libdir=$(dirname "$(ldd "$oracle" | awk '/libtorch_cpu\.so/ {print $3; exit}')")
[ -f "$libdir/libtorch_cpu.so" ] || { echo "no libtorch_cpu.so found for $oracle" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/lib" "$tmp/model"
# The same LibTorch without its GPU half, found first through LD_LIBRARY_PATH (the oracle has a
# RUNPATH, which LD_LIBRARY_PATH precedes). Hard links where the file system allows.
for f in "$libdir"/*.so*; do
  case $(basename "$f") in
    libtorch_cuda* | libtorch_hip* | libc10_cuda* | libc10_hip*) continue ;;
  esac
  ln "$f" "$tmp/lib/" 2>/dev/null || cp "$f" "$tmp/lib/"
done
set +e
out=$(LD_LIBRARY_PATH="$tmp/lib" "$oracle" logits --model "$tmp/model" --token-ids 1,2,3 \
  --out "$tmp/out.safetensors" --device cuda 2>&1)
rc=$?
set -e
echo "exit $rc: $out"
fail() { echo "FAIL: $*" >&2; exit 1; }
[ $rc -ne 0 ] || fail "the oracle exited 0"
[ $rc -lt 128 ] || fail "the oracle died of a signal"
case $out in *"[oracle.device_unavailable]"*) ;; *) fail "no oracle.device_unavailable" ;; esac
case $out in *"$tmp/lib has neither libtorch_cuda.so nor libtorch_hip.so"*) ;;
  *) fail "the error does not name the folder and the missing libraries" ;; esac
[ ! -e "$tmp/out.safetensors" ] || fail "an output was written"
echo PASS
