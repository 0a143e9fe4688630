#!/usr/bin/env bash
# verity_guest.sh: the checks of tests/vm/verity.sh, run as root inside the booted VM in the
# shared folder that holds bin/, lib/, model/, model-files and the two worker inputs. Outputs go
# to out/ there. Every check prints PASS or FAIL with what it saw; the exit status is the number
# of failures.
set -uo pipefail
cd "$(dirname "$0")" || exit 125
here=$PWD
fails=0
pass() { printf 'PASS  %s\n' "$*"; }
fail() { printf 'FAIL  %s\n' "$*"; fails=$((fails + 1)); return 1; }
check() { # check NAME COMMAND...: pass when COMMAND succeeds
  local name=$1; shift
  if "$@"; then pass "$name"; else fail "$name (command: $*)"; fi
}
eq() { # eq NAME GOT WANT
  if [ "$2" = "$3" ]; then pass "$1: $2"; else fail "$1: got \"$2\", want \"$3\""; fi
}
export LD_LIBRARY_PATH=$here/lib
mapfile -t names <model-files
shards=(model-00001-of-00002.safetensors model-00002-of-00002.safetensors)
mapped=${shards[0]} copied=${shards[1]}  # the second shard is left without fs-verity

echo "kernel $(uname -r); $(fsverity --version 2>&1 | head -1)"
check "kernel has CONFIG_FS_VERITY=y" grep -qx CONFIG_FS_VERITY=y "/boot/config-$(uname -r)"

# An ext4 file system with the verity feature, loop-mounted from the VM's own disk.
img=/var/tmp/verity.ext4
mnt=/mnt/verity
truncate -s 512M $img
check "mkfs.ext4 -O verity" mkfs.ext4 -q -F -O verity -b 4096 $img
mkdir -p $mnt
check "mount -o loop" mount -o loop $img $mnt || exit $fails
cp -r model $mnt/verity
cp -r model $mnt/plain
for n in "${names[@]}"; do
  [ "$n" = "$copied" ] && continue
  fsverity enable "$mnt/verity/$n" || fail "fsverity enable $n"
done
want=$(fsverity measure "$mnt/verity/$mapped" | cut -d' ' -f1)
check "fsverity measure $mapped: $want" [ -n "$want" ]
fsverity measure "$mnt/verity/$copied" >/dev/null 2>&1
check "$copied has no fs-verity (measure fails)" [ $? != 0 ]

# Writes to a file with fs-verity are refused, whoever asks (root here).
( echo x >>"$mnt/verity/$mapped" ) 2>/dev/null
check "append (echo >>) to the verity shard is refused" [ $? != 0 ]
dd if=/dev/zero of="$mnt/verity/$mapped" bs=1 count=1 conv=notrunc status=none 2>/dev/null
check "an in-place write (open O_WRONLY) to the verity shard is refused" [ $? != 0 ]
truncate -s 0 "$mnt/verity/$mapped" 2>/dev/null
check "truncate of the verity shard is refused" [ $? != 0 ]
eq "the verity shard's digest after the attempts" \
  "$(fsverity measure "$mnt/verity/$mapped" | cut -d' ' -f1)" "$want"

# Workers reading only the descriptors opened for them, at 3, 4, ... in model-files order.
run_worker() { # run_worker WHICH MODEL_DIR COMMAND... (input.json and workdir in out/WHICH)
  local which=$1 dir=$2; shift 2
  local opens=()
  for n in "${names[@]}"; do opens+=(--open "$dir/$n"); done
  mkdir -p "out/$which"
  "$here/bin/run_with_fds" "${opens[@]}" -- "$@" --input "out/$which/input.json" \
    --workdir "out/$which" 2>"out/$which/stderr.log"
}
for copy in verity plain; do
  mkdir -p out/fingerprint-$copy out/oracle-$copy
  jq --arg d "$mnt/$copy" '.model_dir = $d' fingerprint-input.json >out/fingerprint-$copy/input.json
  jq --arg d "$mnt/$copy" '.model_dir = $d' oracle-input.json >out/oracle-$copy/input.json
  run_worker fingerprint-$copy "$mnt/$copy" "$here/bin/assay-fingerprint" run
  rc=$?
  check "assay-fingerprint on the $copy copy" [ $rc = 0 ] || cat out/fingerprint-$copy/stderr.log
  t0=$(date +%s%N)
  run_worker oracle-$copy "$mnt/$copy" "$here/bin/assay-oracle" next-token
  rc=$?
  check "assay-oracle next-token on the $copy copy ($((($(date +%s%N) - t0) / 1000000)) ms)" \
    [ $rc = 0 ] || cat out/oracle-$copy/stderr.log
done
fv=out/fingerprint-verity/output.json fp=out/fingerprint-plain/output.json
ov=out/oracle-verity/output.json op=out/oracle-plain/output.json
[ -f $fv ] && [ -f $fp ] && [ -f $ov ] && [ -f $op ] || { fail "a worker wrote no output.json"; exit $fails; }
size=$(stat -c %s "$mnt/verity/$mapped")

# The fingerprint: the digest beside the sha256, and the same identity as the plain copy.
file_field() { jq -r --arg n "$2" --arg k "$3" '.files[] | select(.name == $n) | .[$k] // "none"' "$1"; }
eq "fingerprint files[$mapped].fsverity_digest" "$(file_field $fv "$mapped" fsverity_digest)" "$want"
eq "fingerprint files[config.json].fsverity_digest" "$(file_field $fv config.json fsverity_digest)" \
  "$(fsverity measure $mnt/verity/config.json | cut -d' ' -f1)"
eq "fingerprint files[$copied].fsverity_digest" "$(file_field $fv "$copied" fsverity_digest)" none
eq "fingerprint files[$mapped].sha256 (verity copy) = plain copy's" \
  "$(file_field $fv "$mapped" sha256)" "$(file_field $fp "$mapped" sha256)"
eq "model_identity.content_sha256, verity copy = plain copy" \
  "$(jq -r .model_identity.content_sha256 $fv)" "$(jq -r .model_identity.content_sha256 $fp)"
eq "model_identity carries no fs-verity field" "$(jq '[.model_identity | .. | objects |
  select(has("fsverity_digest"))] | length' $fv)" 0

# The oracle: the verity shard mapped and named by its fs-verity digest, the others hashed.
used() { jq -cS --arg n "$2" '.bytes_used.weight_files[] | select(.path == $n)' "$1"; }
eq "oracle bytes_used[$mapped] (verity copy)" "$(used $ov "$mapped")" "$(jq -cnS --arg p "$mapped" \
  --argjson b "$size" --arg d "$want" '{path: $p, bytes: $b, fsverity_digest: $d, bound_by: "fs-verity"}')"
eq "oracle bytes_used[$copied] (verity copy) = fingerprint's" "$(used $ov "$copied")" \
  "$(jq -cS --arg n "$copied" '.model_identity.weight_files[] | select(.path == $n)' $fv)"
eq "oracle bytes_used (plain copy, ENODATA: every file copied) = fingerprint's weight_files" \
  "$(jq -c .bytes_used.weight_files $op)" "$(jq -c .model_identity.weight_files $fp)"
eq "oracle config_hash (verity copy) = fingerprint's" "$(jq -r .bytes_used.config_hash $ov)" \
  "$(jq -r .model_identity.config_hash $fv)"
# assayd's check_bytes_used for a mapped file: bytes and fs-verity digest equal the fingerprint's.
eq "check_bytes_used's rule: oracle's (bytes, fsverity_digest) = fingerprint's" \
  "$(used $ov "$mapped" | jq -r '"\(.bytes) \(.fsverity_digest)"')" \
  "$(file_field $fv "$mapped" size) $(file_field $fv "$mapped" fsverity_digest)"
eq "logits_sha256, verity copy = plain copy" "$(jq -r .logits_sha256 $ov)" "$(jq -r .logits_sha256 $op)"
check "logits.safetensors bitwise equal (cmp)" cmp out/oracle-verity/logits.safetensors \
  out/oracle-plain/logits.safetensors
echo "load_seconds: mapped $(jq .load_seconds $ov), copied $(jq .load_seconds $op);" \
  "peak_rss_bytes: mapped $(jq .peak_rss_bytes $ov), copied $(jq .peak_rss_bytes $op)"

umount $mnt
echo "$fails check(s) failed"
exit $fails
