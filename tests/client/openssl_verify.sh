#!/bin/sh
# Verifies an assay result's DSSE signature and subjects with jq, base64, openssl and sha256sum
# only (no assay code): the commands client/README.md shows. Run in a directory holding
# result.json, result.dsse.json, logits.safetensors and pubkey.pem.
set -eu
jq -j .payload result.dsse.json | base64 -d > payload.json
jq -j '.signatures[0].sig' result.dsse.json | base64 -d > sig.bin
type=$(jq -j .payloadType result.dsse.json)
printf 'DSSEv1 %d %s %d ' ${#type} "$type" "$(stat -c %s payload.json)" > pae.bin
cat payload.json >> pae.bin
openssl pkeyutl -verify -pubin -inkey pubkey.pem -rawin -in pae.bin -sigfile sig.bin
jq -r '.subject[] | "\(.digest.sha256)  \(.name)"' payload.json | sha256sum -c -
