#!/usr/bin/env bash
# packaging/assay-hf-setup, the one command that makes the transformers worker usable on a host
# the packages were installed on: --check names what is missing; a run on the pinned environment
# (scripts/install-deps made it from this lock, so pip has nothing to fetch) writes the launcher
# config hf_worker names; --check then says ready; the launcher runs a real next-token job of
# the transformers worker; a second run changes nothing; bad arguments are refused by name.
# Usage: hf_setup_test.sh VENV PYTHON. Exit 0 when every check holds.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=$1 python=$2
[ -f "$venv/pyvenv.cfg" ] || { echo "skipped: $venv is not a virtual environment"; exit 77; }
tmp=$(mktemp -d)
chmod 755 "$tmp"
trap 'rm -rf "$tmp"' EXIT
fail=0
check() { if eval "$2"; then echo "ok   $1"; else echo "FAIL $1"; fail=1; fi; }
setup() {
  "$root/packaging/assay-hf-setup" --venv "$venv" --lock "$root/requirements.lock" \
    --worker-script "$root/worker/hf/assay_hf_worker.py" --launcher "$tmp/libexec/assay-hf-worker" "$@"
}
out=$(setup --check 2>&1); rc=$?
check "--check before: exit 1 naming the missing launcher" '[ $rc = 1 ] && grep -q "missing: the launcher $tmp/libexec/assay-hf-worker" <<<"$out"'
out=$(setup 2>&1); rc=$?
echo "$out" | sed 's/^/     /'
check "a run on the pinned environment succeeds" '[ $rc = 0 ] && grep -q "^ready: " <<<"$out"'
check "pip had nothing to install (the stamp matched the lock)" '! grep -q "installing the pinned packages" <<<"$out"'
check "the launcher is executable by everyone" '[ "$(stat -c %a "$tmp/libexec/assay-hf-worker")" = 755 ]'
check "it execs the environment's python on the worker script" \
  'grep -qxF "exec '"'"'$venv/bin/python'"'"' -I '"'"'$root/worker/hf/assay_hf_worker.py'"'"' \"\$@\"" "$tmp/libexec/assay-hf-worker"'
out=$(setup --check 2>&1); rc=$?
check "--check after: ready" '[ $rc = 0 ] && grep -q "^ready: " <<<"$out"'
before=$(sha256sum "$tmp/libexec/assay-hf-worker")
setup >/dev/null 2>&1
check "a second run leaves the same launcher" '[ "$(sha256sum "$tmp/libexec/assay-hf-worker")" = "$before" ]'
check "no temporary file is left" '[ "$(ls "$tmp/libexec")" = assay-hf-worker ]'
# The launcher is the worker: a next-token run on a tiny model through it.
"$python" "$root/tests/fixtures/make_fixture.py" --arch llama --size tiny --out "$tmp/model" >/dev/null 2>&1
mkdir "$tmp/work"
cat >"$tmp/work/input.json" <<JSON
{"schema": "assay.oracle-input.v1", "model_dir": "$tmp/model", "input_token_ids": [72, 101, 108],
 "candidate_tokens": [{"engine": "a", "token_id": 44, "text": ","}, {"engine": "b", "token_id": 33, "text": "!"}],
 "execution": {"device": "cpu", "dtype": "bfloat16", "threads": 1}}
JSON
(cd "$tmp/work" && "$tmp/libexec/assay-hf-worker" next-token --input input.json --workdir . >/dev/null 2>"$tmp/err")
check "the launcher runs a transformers next-token job" \
  '[ -f "$tmp/work/output.json" ] && grep -q "\"backend\": *\"transformers\"" "$tmp/work/output.json" || { tail -5 "$tmp/err"; false; }'
out=$("$root/packaging/assay-hf-setup" --venv relative/dir 2>&1); rc=$?
check "a relative --venv is refused by name (exit 2)" '[ $rc = 2 ] && grep -q "relative/dir" <<<"$out"'
out=$("$root/packaging/assay-hf-setup" --lock "$tmp/none.lock" 2>&1); rc=$?
check "a missing lock is named" '[ $rc = 1 ] && grep -q "$tmp/none.lock does not exist" <<<"$out"'
out=$("$root/packaging/assay-hf-setup" --wheels "$tmp/no-such-dir" 2>&1); rc=$?
check "a --wheels that is not a directory is refused by name (exit 2)" '[ $rc = 2 ] && grep -q "no-such-dir" <<<"$out"'
# --wheels installs from that directory only: with no wheels there, pip finds nothing and never
# asks the network (tests/vm/e2e.sh installs the real lock this way in a VM without one).
mkdir "$tmp/wheels"
out=$("$root/packaging/assay-hf-setup" --venv "$tmp/offline-venv" --python "$(command -v python3)" \
  --lock "$root/requirements.lock" --worker-script "$root/worker/hf/assay_hf_worker.py" \
  --launcher "$tmp/libexec/offline" --wheels "$tmp/wheels" 2>&1); rc=$?
check "--wheels with no wheels: pip fails offline, no launcher, no stamp" \
  '[ $rc != 0 ] && grep -qi "no matching distribution" <<<"$out" && [ ! -e "$tmp/libexec/offline" ] && [ ! -e "$tmp/offline-venv/.assay-lock-sha256" ]'
out=$("$root/packaging/assay-hf-setup" --bogus 2>&1); rc=$?
check "an unknown argument exits 2" '[ $rc = 2 ]'
exit $fail
