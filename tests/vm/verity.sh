#!/usr/bin/env bash
# verity.sh: weight files bound by fs-verity instead of a private copy, on a kernel that has it.
#
#   tests/vm/verity.sh [--build-dir DIR] [--size tiny|small] [--keep]
#
# The build machines' kernel has no CONFIG_FS_VERITY, so this boots the Debian 12 VM of
# ../shared/vm/ ONCE (stock kernel 6.1) and runs tests/vm/verity_guest.sh inside it, as root:
# an ext4 image made with `mkfs.ext4 -O verity` and loop-mounted; two copies of a two-shard Llama
# fixture on it, `fsverity enable` on every file of one copy but its second shard; then
# assay-fingerprint and assay-oracle next-token, each reading only descriptors opened for it
# (model_fds), on both copies. It checks that the oracle maps the verity shard and reports
# {fsverity_digest = `fsverity measure`'s, "bound_by": "fs-verity"}, copies and hashes the
# others (ENODATA), computes logits bitwise equal to the copy's, that the fingerprint records the
# digest beside the sha256 with the same model identity as the copy, that the supervisor's rule
# (fs-verity digest and bytes equal to the fingerprint's) holds, and that writes to a verity file
# are refused. Back on the host the outputs are validated against their schemas.
# Exit status: 0 when every check passed, else the number of failures; 125 if the VM failed.
#
# Needs, as root: apt-get install --no-install-recommends qemu-system-x86 qemu-utils mmdebstrap
# and the build tree's assay-oracle, assay-fingerprint and assay_test_run_with_fds
# (cmake --build build --target assay-oracle assay-fingerprint assay_test_run_with_fds). They
# run in the VM as built, with the LibTorch libraries they link (ldd) linked into the shared
# folder. The VM image (fsverity, e2fsprogs, libssl3, jq) is built once into $ASSAY_VERITY_IMAGE
# (default /var/tmp/assay-verity-vmimage) and reused while its package list is unchanged.
# --size small (~40M parameters) makes the load-time difference visible; tiny is the default.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$root/build
size=tiny
keep=0
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build=$(realpath -m "$2"); shift 2 ;;
    --size) size=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    -h | --help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "verity.sh: unknown argument \"$1\" (see --help)" >&2; exit 2 ;;
  esac
done
case $size in tiny | small) ;; *) echo "verity.sh: --size \"$size\" is not tiny or small" >&2; exit 2 ;; esac
vm=${ASSAY_VM_SCRIPTS:-$root/../shared/vm}
image=${ASSAY_VERITY_IMAGE:-/var/tmp/assay-verity-vmimage}
py=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
[ "$(id -u)" = 0 ] || { echo "verity.sh: must run as root (the VM scripts need it)" >&2; exit 2; }
for tool in qemu-system-x86_64 mmdebstrap; do
  command -v $tool >/dev/null ||
    { echo "verity.sh: $tool missing: apt-get install --no-install-recommends qemu-system-x86 qemu-utils mmdebstrap" >&2; exit 2; }
done
[ -x "$vm/run-in-vm.sh" ] || { echo "verity.sh: no VM scripts at $vm (set ASSAY_VM_SCRIPTS)" >&2; exit 2; }
oracle=$build/worker/assay-oracle
fingerprint=$build/fingerprint/assay-fingerprint
with_fds=$build/tests/fingerprint/assay_test_run_with_fds
for b in "$oracle" "$fingerprint" "$with_fds"; do
  [ -x "$b" ] || { echo "verity.sh: $b is not built (cmake --build $build --target assay-oracle assay-fingerprint assay_test_run_with_fds)" >&2; exit 2; }
done

say() { printf '== %s\n' "$*" >&2; }

packages=fsverity,e2fsprogs,libssl3,jq
if [ "$(cat "$image/assay-packages" 2>/dev/null)" != "$packages" ]; then
  say "building the VM image in $image (once; packages: $packages)"
  VMTEST_EXTRA_PACKAGES=$packages "$vm/build-image.sh" "$image" >&2
  echo "$packages" >"$image/assay-packages"
fi

work=$build/verity-vm
rm -rf "$work"
mkdir -p "$work/bin" "$work/lib" "$work/out"
cp "$oracle" "$fingerprint" "$work/bin/"
cp "$with_fds" "$work/bin/run_with_fds"
# The libraries outside the system's own directories (LibTorch, its OpenMP and CUDA stubs): the
# guest finds them through LD_LIBRARY_PATH. Hard links where the file system allows (~450 MB).
ldd "$oracle" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | while read -r lib; do
  case $lib in /lib/* | /usr/lib/* | /lib64/*) continue ;; esac
  ln -f "$(realpath "$lib")" "$work/lib/$(basename "$lib")" 2>/dev/null || cp "$lib" "$work/lib/"
done

say "making the $size fixture model and the worker inputs"
$py "$root/tests/fixtures/make_fixture.py" --arch llama --size "$size" --shards 2 --out "$work/model" >&2
$py - "$work" "$root/tests/fixtures" <<'PY'
import json, os, sys
work, fixtures = sys.argv[1], sys.argv[2]
sys.path.insert(0, fixtures)
import fixture_lib
tok = json.load(open(work + "/model/tokenizer.json"))
inv = {v: k for k, v in tok["model"]["vocab"].items()}
byte_of = {c: b for b, c in fixture_lib.bytes_to_unicode().items()}
def text(i):
    return bytes(byte_of[c] for c in inv[i]).decode("utf-8")
# The guest opens the files in this order at fds 3, 4, ... (run_with_fds --open).
names = sorted(os.listdir(work + "/model"))
fds = [{"name": n, "fd": 3 + i} for i, n in enumerate(names)]
open(work + "/model-files", "w").write("".join(n + "\n" for n in names))
# model_dir is filled in by the guest: the verity copy's or the plain copy's.
json.dump({"schema": "assay.fingerprint-input.v1", "model_dir": "", "id": "verity-fixture",
           "model_fds": fds}, open(work + "/fingerprint-input.json", "w"), indent=1)
json.dump({"schema": "assay.oracle-input.v1", "model_dir": "",
           "input_token_ids": list(b"Hello, wor"),
           "candidate_tokens": [{"engine": "kiln", "token_id": 5, "text": text(5)},
                                {"engine": "vllm", "token_id": 6, "text": text(6)}],
           "execution": {"device": "cpu", "dtype": "bfloat16", "threads": 2},
           "model_fds": fds}, open(work + "/oracle-input.json", "w"), indent=1)
PY
cp "$root/tests/vm/verity_guest.sh" "$work/guest.sh"
chmod -R a+rX "$work"

say "booting the VM and running the checks (verity_guest.sh)"
set +e
VMTEST_IMAGE_DIR=$image VMTEST_MEM=${VMTEST_MEM:-3072} VMTEST_TIMEOUT=${VMTEST_TIMEOUT:-1500} \
  "$vm/run-in-vm.sh" "$work" ./guest.sh
rc=$?
set -e

if [ $rc != 125 ] && [ $rc != 124 ]; then
  say "validating the outputs against their schemas"
  for doc in fingerprint-verity:fingerprint-output fingerprint-plain:fingerprint-output \
             oracle-verity:oracle-output oracle-plain:oracle-output; do
    dir=${doc%%:*} schema=${doc#*:}
    if [ -f "$work/out/$dir/output.json" ] &&
       $py "$root/tests/tools/validate_schema.py" "$root/schemas/$schema.schema.json" \
         "$work/out/$dir/output.json" >&2; then
      printf 'PASS  out/%s/output.json is a valid %s\n' "$dir" "$schema"
    else
      printf 'FAIL  out/%s/output.json is not a valid %s\n' "$dir" "$schema"
      rc=$((rc == 0 ? 1 : rc + 1))
    fi
  done
fi
[ $keep = 1 ] || rm -rf "$work"
say "verity.sh: exit $rc"
exit $rc
