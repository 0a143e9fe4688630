#!/usr/bin/env bash
# A bad command line is the oracle's one-line error like any other failure, exit 2 (not CLI11's
# 106), naming what is wrong; --help still exits 0.
#   usage_exit.sh ASSAY_ORACLE
set -uo pipefail
oracle=$1
fail() { echo "FAIL: $*" >&2; exit 1; }
"$oracle" --help >/dev/null || fail "--help exited $?"
"$oracle" next-token --help >/dev/null || fail "next-token --help exited $?"
check() {  # expected substring, then the arguments
  local want=$1
  shift
  local err rc
  err=$("$oracle" "$@" 2>&1 >/dev/null)
  rc=$?
  echo "assay-oracle $*: exit $rc: $err"
  [ $rc -eq 2 ] || fail "exit $rc, not 2"
  case $err in "assay-oracle: error [usage]: "*"$want"*) ;; *) fail "no usage line naming $want" ;; esac
}
check "A subcommand is required"
check "--token-ids" logits --model /nonexistent --out /nonexistent/x
check "A subcommand is required" frobnicate
echo ok
