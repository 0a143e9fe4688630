#!/usr/bin/env bash
# The containment runtime on a real cgroup v2 host with systemd as PID 1: boots the VM from
# ../shared/vm (one boot for everything) and runs there
#   1. contain_tests with the v2 backend below a base cgroup of the test service, and
#   2. assayd contain --delegated alone in a cgroup of its own, as Delegate=yes gives it (if
#      assayd was built),
#      checking that the worker was cloned straight into its cgroup and the OOM kill counted.
# Not part of ctest (needs qemu and about a minute).
#   usage: tests/contain/vm_v2_test.sh [BUILD_DIR]      (default build-contain)
# Image: VMTEST_IMAGE_DIR (default /var/tmp/vmtest-image-contain), built when missing with
#   VMTEST_EXTRA_PACKAGES=python3,python3-jsonschema,libssl3 ../shared/vm/build-image.sh DIR
set -euo pipefail

if [ "${1:-}" = --inside ]; then
  build=$2
  own=$(awk -F: '$1 == "0" { print $3 }' /proc/self/cgroup)
  cg=/sys/fs/cgroup$own
  echo "vm: kernel $(uname -r), PID 1 $(cat /proc/1/comm), cgroup $own"
  echo "vm: controllers: $(cat "$cg/cgroup.controllers")"
  # No internal processes: the test service's processes (this shell and the harness that
  # started it) move to a leaf before the service cgroup enables controllers.
  mkdir -p "$cg/runner" "$cg/pool"
  for p in $(cat "$cg/cgroup.procs"); do echo "$p" >"$cg/runner/cgroup.procs" 2>/dev/null || true; done
  echo "+memory +pids" >"$cg/cgroup.subtree_control"
  ASSAY_TEST_BASE_CGROUP=$own/pool "$build/tests/contain/contain_tests"
  left=$(find "$cg/pool" -mindepth 1 -type d | wc -l)
  [ "$left" -eq 0 ] || { echo "vm: $left cgroups left below $cg/pool" >&2; exit 1; }
  if [ -x "$build/supervisor/assayd" ]; then
    # assayd's runtime libraries, when the image was built without them.
    if ls "$build"/vm-debs/*.deb >/dev/null 2>&1; then dpkg -i "$build"/vm-debs/*.deb >/dev/null; fi
    out=$(mktemp)
    # What Delegate=yes gives a service: a cgroup of its own, assayd its only process (the
    # image has no D-Bus for systemd-run, so the shell makes that cgroup and execs assayd).
    mkdir "$cg/delegated"
    sh -c 'echo $$ >"$1/cgroup.procs"; shift; exec "$@"' sh "$cg/delegated" \
      "$build/supervisor/assayd" contain --mode v2 --delegated --memory-max 64M -- \
      /usr/bin/python3 -c "x = b'\x01' * (200 << 20)" >"$out"
    left=$(find "$cg/delegated/workers" -mindepth 1 -type d | wc -l)
    [ "$left" -eq 0 ] || { echo "vm: $left worker cgroups left in $cg/delegated/workers" >&2; exit 1; }
    /usr/bin/python3 - "$out" <<'PY'
import json, sys
e = json.load(open(sys.argv[1]))
assert e["mode"] == "cgroup-v2", e["mode"]
assert e["spawn"]["method"] == "clone3-into-cgroup", e["spawn"]["method"]
assert e["oom_killed"] is True and e["exit"]["signal"] == 9, e
assert e["counters"]["memory.events"]["oom_kill"] >= 1, e["counters"]
assert "/workers/" in e["cgroup"]["path"] and e["cgroup"]["removed"], e["cgroup"]
print("vm: assayd contain --delegated: OOM kill counted, clone3-into-cgroup, cgroup removed")
print(json.dumps(e["counters"], sort_keys=True))
PY
  else
    echo "vm: no $build/supervisor/assayd: delegated mode not tested"
  fi
  echo "vm: all passed"
  exit 0
fi

repo=$(cd "$(dirname "$0")/../.." && pwd)
build=$(realpath "${1:-$repo/build-contain}")
vm=$repo/../shared/vm
export VMTEST_IMAGE_DIR=${VMTEST_IMAGE_DIR:-/var/tmp/vmtest-image-contain}
if [ ! -f "$VMTEST_IMAGE_DIR/rootfs.ext4" ]; then
  VMTEST_EXTRA_PACKAGES=python3,python3-jsonschema,libssl3 "$vm/build-image.sh" "$VMTEST_IMAGE_DIR"
fi
if [ -x "$build/supervisor/assayd" ] && [ ! -d "$build/vm-debs" ]; then
  mkdir -p "$build/vm-debs"
  (cd "$build/vm-debs" && apt-get download -q libspdlog1.10 libfmt9 >/dev/null)
fi
VMTEST_TIMEOUT=${VMTEST_TIMEOUT:-900} VMTEST_MEM=${VMTEST_MEM:-1536} \
  "$vm/run-in-vm.sh" "$repo" "tests/contain/vm_v2_test.sh" --inside "$build"
