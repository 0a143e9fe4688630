#!/usr/bin/env bash
# packaging/bundle-libs on the built assay-oracle: LibTorch's own libraries are bundled, the C
# runtime never (issue 40: on Debian 12's merged /usr, libc.so.6's real path is one dpkg does not
# know, and the old rule, asking dpkg about the real path only, copied glibc into the package).
# Usage: bundle_libs_test.sh ASSAY_ORACLE. Exit 0 when every check holds.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
oracle=$1
fail=0
check() { if eval "$2"; then echo "ok   $1"; else echo "FAIL $1"; fail=1; fi; }
command -v dpkg >/dev/null || { echo "skipped: no dpkg"; exit 77; }
list=$("$root/packaging/bundle-libs" "$oracle") || { echo "FAIL bundle-libs exited $?"; exit 1; }
echo "$list" | sed 's/^/     bundles: /'
check "libtorch_cpu.so is bundled" 'grep -q "^libtorch_cpu.so " <<<"$list"'
check "libc10.so is bundled" 'grep -q "^libc10.so " <<<"$list"'
for lib in libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 libutil.so.1 libgcc_s.so.1 \
  libstdc++.so.6 ld-linux-x86-64.so.2 libcrypto.so.3; do
  check "$lib is not bundled" '! grep -q "^$lib " <<<"$list"'
done
check "every bundled file exists" 'while read -r n p; do [ -f "$p" ] || exit 1; done <<<"$list"'
# The reproduction: the C library's real path alone is unknown to dpkg on this system, which is
# what made the old rule bundle it (when dpkg knows it, the old rule was right here by chance).
libc=$(ldd "$oracle" | awk '$1 == "libc.so.6" {print $3}')
if ! dpkg -S "$(realpath "$libc")" >/dev/null 2>&1; then
  echo "     (reproduced: dpkg does not know $(realpath "$libc"), the path the old rule asked about)"
fi
check "a program of the base system bundles nothing" '[ -z "$("$root/packaging/bundle-libs" /bin/ls)" ]'
check "a static program bundles nothing" \
  '[ ! -x "$(dirname "$oracle")/../supervisor/assayd" ] || [ -z "$("$root/packaging/bundle-libs" "$(dirname "$oracle")/../supervisor/assayd")" ]'
check "a file that is not a program is refused" '! "$root/packaging/bundle-libs" "$root/README.md" 2>/dev/null'
exit $fail
