#!/usr/bin/env bash
# The man pages scripts/make-man writes from assay's and assayd's --help: groff finds nothing to
# warn about, every command of `assay --help` (and their own commands) has its section, the exit
# codes and the config keys are in them, and two runs give the same compressed bytes.
# Usage: man_pages_test.sh ASSAY ASSAYD PYTHON. Exit 0 when every check holds.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
assay=$1 assayd=$2 python=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
check() { if eval "$2"; then echo "ok   $1"; else echo "FAIL $1"; fail=1; fi; }
make() {
  "$python" "$root/scripts/make-man" "$1" "$2" 0.1.0 "$3" --date 2026-12-06 --summary "$4"
}
make "$assay" 1 "$tmp/assay.1.gz" "the client" || exit 1
make "$assayd" 8 "$tmp/assayd.8.gz" "the daemon" || exit 1
make "$assay" 1 "$tmp/again.1.gz" "the client" || exit 1
make "$root/packaging/assay-hf-setup" 8 "$tmp/assay-hf-setup.8.gz" "the worker's setup" || exit 1
check "two runs give the same bytes" 'cmp -s "$tmp/assay.1.gz" "$tmp/again.1.gz"'
for page in assay.1 assayd.8 assay-hf-setup.8; do
  zcat "$tmp/$page.gz" >"$tmp/$page"
  warnings=$(LC_ALL=C.UTF-8 groff -man -Tutf8 -ww -z "$tmp/$page" 2>&1)
  check "$page: groff has no warning" '[ -z "$warnings" ]'
  check "$page: man renders it" 'MANWIDTH=100 man -l "$tmp/$page" >/dev/null 2>&1'
done
for cmd in $("$assay" --help | sed -n '/^Subcommands:/,/^$/p' | awk 'NR > 1 && /^  [a-z]/ {print $1}'); do
  check "assay.1 has a section for assay $cmd" 'grep -q "^\.SS \"assay $cmd\"" "$tmp/assay.1"'
done
check "assay.1 has fidelity's own commands" 'grep -q "^\.SS \"assay fidelity submit\"" "$tmp/assay.1"'
check "assay.1 names the exit codes" 'grep -q "Exit status" "$tmp/assay.1" && grep -q " 12  --decide" "$tmp/assay.1"'
check "assayd.8 has serve and contain" 'grep -q "^\.SS \"assayd serve\"" "$tmp/assayd.8" && grep -q "^\.SS \"assayd contain\"" "$tmp/assayd.8"'
check "assayd.8 lists the config keys" 'grep -q "metrics_listen" "$tmp/assayd.8"'
exit $fail
