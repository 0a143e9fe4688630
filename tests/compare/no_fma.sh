#!/bin/sh
# The kernel clones use fused multiply-adds only where written explicitly (exp's polynomial, the
# same bits in every clone: compare_tests checks them bitwise); nothing else may be contracted
# into one. Fails when a function outside compare::clones holds an FMA instruction.
set -e
bin=$1
objdump -d --no-show-raw-insn "$bin" >/dev/null
found=$(objdump -d --no-show-raw-insn "$bin" |
  awk '/^[0-9a-f]+ <.*>:$/ { fn = $2 } /vf(n)?m(add|sub)/ { print fn }' | grep -v clones | sort -u)
if [ -n "$found" ]; then
  echo "FMA instructions outside the kernel clones: $found"
  exit 1
fi
echo "no contracted FMA outside the kernel clones"
