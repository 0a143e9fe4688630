#!/usr/bin/env bash
# e2e.sh: the end-to-end test on a real systemd host with a pure cgroup v2 hierarchy.
#
#   tests/vm/e2e.sh [--build-dir DIR] [--debs DIR] [--no-hf] [--keep]
#
# --debs DIR: install the assay*.deb already in DIR instead of running packaging/build-deb.
# --no-hf: skip the transformers backend (its wheels, about 2.7 GB, are downloaded once into
# BUILD_DIR/hf-wheels with pip download; the guest installs them with assay-hf-setup --wheels).
#
# On the host (as root): builds the Debian packages (packaging/build-deb), a tiny Llama fixture
# model (tests/fixtures/make_fixture.py) and the job requests, then boots the Debian 12 VM of
# ../shared/vm/ ONCE and runs tests/vm/guest.sh inside it, which installs the packages and checks
# socket activation, a verified job as a user in group "assay", cgroup v2 evidence, an
# OOM-killed job with the service still healthy, a restart with a queued job, refusal of a user
# outside "assay", no leftover worker cgroup, and remove/purge; and the transformers backend:
# refused at admission until assay-hf-setup has made its environment, then a dispute settled
# by transformers' own forward with the C++ oracle's argmax. Exit status: guest.sh's
# (0 = every check passed), 125 if the VM failed.
#
# Needs: apt-get install --no-install-recommends qemu-system-x86 qemu-utils mmdebstrap
# The VM image (with LibTorch's runtime packages) is built once into $ASSAY_VM_IMAGE
# (default /var/tmp/assay-vmimage) and reused while its package list is unchanged.
# Under TCG emulation (no usable KVM) the whole run takes a few minutes.
# ASSAY_E2E_WORKER_USER=root (diagnostic): workers are not dropped to assay-worker.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$root/build-pkg
keep=0
hf=1
debs=""
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build=$(realpath -m "$2"); shift 2 ;;
    --debs) debs=$(realpath -e "$2"); shift 2 ;;
    --no-hf) hf=0; shift ;;
    --keep) keep=1; shift ;;
    -h | --help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "e2e.sh: unknown argument \"$1\" (see --help)" >&2; exit 2 ;;
  esac
done
vm=${ASSAY_VM_SCRIPTS:-$root/../shared/vm}
image=${ASSAY_VM_IMAGE:-/var/tmp/assay-vmimage}
py=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
[ "$(id -u)" = 0 ] || { echo "e2e.sh: must run as root (the VM scripts need it)" >&2; exit 2; }
for tool in qemu-system-x86_64 mmdebstrap; do
  command -v $tool >/dev/null ||
    { echo "e2e.sh: $tool missing: apt-get install --no-install-recommends qemu-system-x86 qemu-utils mmdebstrap" >&2; exit 2; }
done
[ -x "$vm/run-in-vm.sh" ] || { echo "e2e.sh: no VM scripts at $vm (set ASSAY_VM_SCRIPTS)" >&2; exit 2; }

say() { printf '== %s\n' "$*" >&2; }

# Runtime packages the binaries need inside the VM (the packages' Depends, resolved offline:
# the VM has no network), plus jq for the checks; Debian's python3 and its venv module for
# assay-hf-setup (the environment it makes holds about 5 GB, hence the image's size).
# (LibTorch comes bundled in the assay-oracle package: packaging/build-deb.)
packages=libspdlog1.10,libsystemd0,libfmt9,libssl3,jq,python3,python3-venv
size=16G
if [ "$(cat "$image/assay-packages" 2>/dev/null)" != "$packages $size" ]; then
  say "building the VM image in $image (once; packages: $packages; $size)"
  VMTEST_EXTRA_PACKAGES=$packages VMTEST_IMAGE_SIZE=$size "$vm/build-image.sh" "$image" >&2
  echo "$packages $size" >"$image/assay-packages"
fi

# The shared folder must not be under /tmp or /var/tmp: assayd.service has PrivateTmp=yes, so
# the service would not see a model there.
work=$build/e2e
rm -rf "$work"
mkdir -p "$work/debs"
chmod 0755 "$work"
if [ -n "$debs" ]; then
  cp "$debs"/assay_*.deb "$debs"/assay-oracle_*.deb "$work/debs/"
else
  say "building the Debian packages"
  "$root/packaging/build-deb" --build-dir "$build" --out "$work/debs" --no-lintian >&2
fi

say "making the fixture model and requests"
$py "$root/tests/fixtures/make_fixture.py" --arch llama --size tiny --out "$work/model" >&2
$py "$root/tests/fixtures/quantize_fixture.py" --in "$work/model" --out "$work/model-q4" --bits 4 >&2
$py - "$work" "$root/tests/fixtures" <<'PY'
import json, sys
work, fixtures = sys.argv[1], sys.argv[2]
sys.path.insert(0, fixtures)
import fixture_lib
tok = json.load(open(work + "/model/tokenizer.json"))
inv = {v: k for k, v in tok["model"]["vocab"].items()}
byte_of = {c: b for b, c in fixture_lib.bytes_to_unicode().items()}
def text(i):
    return bytes(byte_of[c] for c in inv[i]).decode("utf-8")
ids = list(b"Hello, wor")
def request(name, engines, limits=None):
    r = {"schema": "assay.next-token-request.v1", "id": "e2e-" + name, "model_dir": work + "/model",
         "input_token_ids": ids,
         "candidates": [{"engine": e, "token_id": t, "text": text(t)} for e, t in engines]}
    if limits:
        r["limits"] = limits
    json.dump(r, open("%s/%s.json" % (work, name), "w"), indent=1)
request("ok", [("kiln", ord("l")), ("vllm", ord("x"))])
# 16 MiB cannot hold LibTorch's start-up: the oracle worker is OOM-killed in its leaf cgroup.
request("oom", [("kiln", ord("l")), ("vllm", ord("y"))], {"memory_bytes": 16 << 20})
# Holds the one device slot while "queued" waits; over the limit too, so that it ends fast after
# the restart instead of costing a second full forward pass under emulation.
request("running", [("kiln", ord("l")), ("vllm", ord("z"))], {"memory_bytes": 16 << 20})
request("queued", [("kiln", ord("l")), ("vllm", ord("q"))])
# A fidelity job: the 4-bit copy against the model, the reference captured twice.
json.dump({"schema": "assay.fidelity-request.v1", "id": "e2e-fidelity",
           "reference": {"model_dir": work + "/model"},
           "candidate": {"model_dir": work + "/model-q4", "label": "4-bit copy"},
           "panel": {"contexts": [{"id": "hello", "token_ids": list(b"Hello, world")},
                                  {"id": "fox", "token_ids": list(b"The quick brown fox"),
                                   "positions": [[4, 19]]}]},
           "reproduction_confirmation": True},
          open(work + "/fidelity.json", "w"), indent=1)
PY
if [ $hf = 1 ]; then
  # The transformers worker's pinned packages, as wheels (the VM has no network): downloaded
  # once per lock, hard-linked into the shared folder.
  lock=$root/requirements.lock
  want=$(sha256sum "$lock" | cut -d' ' -f1)
  if [ "$(cat "$build/hf-wheels/.lock-sha256" 2>/dev/null)" != "$want" ]; then
    say "downloading the wheels of requirements.lock into $build/hf-wheels (about 2.7 GB)"
    rm -rf "$build/hf-wheels"
    mkdir -p "$build/hf-wheels"
    $py -m pip download -q --no-input --only-binary=:all: -r "$lock" -d "$build/hf-wheels" >&2
    echo "$want" >"$build/hf-wheels/.lock-sha256"
  fi
  cp -al "$build/hf-wheels" "$work/hf-wheels" 2>/dev/null || cp -a "$build/hf-wheels" "$work/hf-wheels"
  $py - "$work" <<'PY'
import json, sys
work = sys.argv[1]
r = json.load(open(work + "/ok.json"))
r["id"] = "e2e-hf"
r["oracle"] = {"backend": "transformers"}
json.dump(r, open(work + "/hf.json", "w"), indent=1)
PY
fi
cp "$root/tests/vm/guest.sh" "$work/guest.sh"
chmod -R a+rX "$work"

say "booting the VM and running the checks (guest.sh)"
set +e
VMTEST_PASS_ENV="ASSAY_E2E_WORKER_USER ${VMTEST_PASS_ENV:-}" VMTEST_IMAGE_DIR=$image VMTEST_MEM=${VMTEST_MEM:-4096} VMTEST_TIMEOUT=${VMTEST_TIMEOUT:-3600} \
  "$vm/run-in-vm.sh" "$work" ./guest.sh
rc=$?
set -e
[ $keep = 1 ] || rm -rf "$work"
say "e2e.sh: exit $rc"
exit $rc
